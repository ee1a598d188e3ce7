//! What a plan step checks out: a webhook-started plan's pinned ref and commit (a pull
//! request's plan is speculative and can never be applied), and for a drift check the
//! commit that was last applied.

use takosumi_core::{RunId, RunKind};

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

/// What a plan step must check out, and whether the plan is speculative. A drift check
/// plans the commit that was last applied, never the branch head: it reports what changed
/// outside Takosumi, and the plan it keeps brings reality back to what was applied.
/// `None`: no such Run.
pub async fn run_source(
    executor: &crate::Pool,
    id: RunId,
) -> Result<Option<RunSource>, StoreError> {
    // One round trip: the Run's own pins and, for a drift check, the Capsule's baseline
    // and the commit it planned.
    let row = sqlx::query!(
        r#"SELECT r.source_ref, r.pinned_commit, r.speculative, r.kind as "kind: RunKind",
                  b.id as "baseline_run?", b.source_commit as "baseline_commit?"
             FROM runs r
             JOIN capsules c ON c.id = r.capsule_id
             LEFT JOIN runs b ON b.id = c.drift_baseline_run_id
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
        match (row.baseline_run, row.baseline_commit) {
            (Some(run), Some(commit)) => {
                source.pinned_commit = Some(commit);
                source.baseline_run = Some(RunId::from_uuid(run));
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
