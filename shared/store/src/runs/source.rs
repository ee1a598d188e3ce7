//! What a plan step checks out: a webhook-started plan's pinned ref and commit (a pull
//! request's plan is speculative and can never be applied), and for a drift check the
//! commit that was last applied.

use takosumi_core::{CapsuleId, RunId, RunKind};

use crate::{StoreError, Tx};

/// Pins what a webhook-started plan checks out; a speculative plan can never be applied.
pub async fn set_run_source(
    tx: &mut Tx,
    id: RunId,
    source_ref: &str,
    commit: &str,
    speculative: bool,
) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET source_ref = $2, pinned_commit = $3, speculative = $4 WHERE id = $1",
        id.as_uuid(),
        source_ref,
        commit,
        speculative
    )
    .execute(tx.db())
    .await?;
    Ok(())
}

/// What a plan step checks out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSource {
    /// The branch (or pull request ref) to clone; `None`: the Capsule's branch.
    pub source_ref: Option<String>,
    /// The exact commit to plan, if pinned: a webhook's pushed commit, or — for a drift
    /// check — the commit of the Capsule's current StateVersion, read at claim time.
    pub pinned_commit: Option<String>,
    /// A pull request's plan: never applied.
    pub speculative: bool,
    /// A drift check with nothing applied to compare against (the Capsule has no
    /// StateVersion, or its last apply was a destroy): it must not plan the branch instead.
    pub no_baseline: bool,
    /// For a drift check: the Run whose variables produced the current StateVersion (the
    /// plan the last apply carried out, or a one-step apply itself). The check plans with
    /// exactly those, so a variable changed on the Capsule since is not reported as drift.
    pub baseline_run: Option<RunId>,
}

/// Why a drift check of a Capsule with no baseline does not plan (the Run's error, and the
/// API's 409 `not_applied`).
pub const NOT_APPLIED: &str = "nothing was applied to this Capsule (no StateVersion, or its last apply destroyed everything), so there is nothing to check drift against; plan and apply it first";

/// What the Capsule's current StateVersion was applied from: the commit of the plan the
/// apply carried out, and whether that plan destroyed everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedBaseline {
    /// The applied plan's commit.
    pub commit: String,
    /// The applied plan was a destroy plan: nothing the configuration declares is meant to
    /// exist, so there is nothing to drift from.
    pub destroyed: bool,
}

/// The baseline a drift check of `capsule` compares reality with; `None` when nothing was
/// ever applied (or the StateVersion records no commit).
pub async fn applied_baseline<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    capsule: CapsuleId,
) -> Result<Option<AppliedBaseline>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT a.source_commit as "commit?", p.kind as "plan_kind?: RunKind"
             FROM capsules c
             JOIN state_versions sv ON sv.id = c.current_state_version_id
             JOIN runs a ON a.id = sv.run_id
             LEFT JOIN runs p ON p.id = a.plan_run_id
            WHERE c.id = $1"#,
        capsule.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.and_then(|r| {
        r.commit.map(|commit| AppliedBaseline {
            commit,
            destroyed: r.plan_kind == Some(RunKind::Destroy),
        })
    }))
}

/// What a plan step must check out, and whether the plan is speculative. A drift check
/// plans the commit that was last applied, never the branch head: it reports what changed
/// outside Takosumi, and the plan it keeps brings reality back to what was applied.
/// `None`: no such Run.
pub async fn run_source(
    executor: &crate::Pool,
    id: RunId,
) -> Result<Option<RunSource>, StoreError> {
    // One round trip: the Run's own pins and, for a drift check, the applied baseline
    // (the same join as `applied_baseline`).
    let row = sqlx::query!(
        r#"SELECT r.source_ref, r.pinned_commit, r.speculative, r.kind as "kind: RunKind",
                  a.source_commit as "applied_commit?", p.kind as "applied_plan_kind?: RunKind",
                  COALESCE(p.id, a.id) as "baseline_run?"
             FROM runs r
             JOIN capsules c ON c.id = r.capsule_id
             LEFT JOIN state_versions sv ON sv.id = c.current_state_version_id
             LEFT JOIN runs a ON a.id = sv.run_id
             LEFT JOIN runs p ON p.id = a.plan_run_id
            WHERE r.id = $1"#,
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let mut source = RunSource {
        source_ref: row.source_ref,
        pinned_commit: row.pinned_commit,
        speculative: row.speculative,
        no_baseline: false,
        baseline_run: None,
    };
    if row.kind == RunKind::DriftCheck {
        match row.applied_commit {
            Some(commit) if row.applied_plan_kind != Some(RunKind::Destroy) => {
                source.pinned_commit = Some(commit);
                source.baseline_run = row.baseline_run.map(RunId::from_uuid);
            }
            _ => source.no_baseline = true,
        }
    }
    Ok(Some(source))
}

/// Whether a Run is a pull request's speculative plan.
pub async fn speculative<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<bool, StoreError> {
    Ok(
        sqlx::query_scalar!("SELECT speculative FROM runs WHERE id = $1", id.as_uuid())
            .fetch_one(executor)
            .await?,
    )
}
