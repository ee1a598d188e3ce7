//! How an apply submission runs: in one step (`apply -auto-approve`, nothing saved in
//! between) when no rule covers it, or planned first (`plan -out`, the rules decide on the
//! saved plan) when one does. The mode is recorded on the Run so its record says which
//! path it took; see `infra/migrations/20261130000700_apply_modes.sql`.

use takosumi_core::{ApplyMode, RunId};

use crate::{StoreError, Tx};

/// Records how a Run was submitted ([`ApplyMode::OneStep`] or [`ApplyMode::ProposesApply`]),
/// in the submission's transaction; only a queued Run can be marked, once.
pub async fn set(tx: &mut Tx, id: RunId, mode: ApplyMode) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "UPDATE runs SET apply_mode = $2 WHERE id = $1 AND apply_mode IS NULL AND status IN ('queued', 'held')",
        id.as_uuid(),
        mode as ApplyMode
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// How a Run was submitted (`None`: the ordinary paths).
pub async fn get<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<Option<ApplyMode>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT apply_mode as "apply_mode: ApplyMode" FROM runs WHERE id = $1"#,
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.and_then(|r| r.apply_mode))
}

/// A one-step apply plans against the state it finds when it starts, so the generation it
/// is checked against is the Capsule's current one, taken right before the apply claim
/// (which then takes the Capsule and compares in one transaction). Only a queued, released
/// one-step Apply Run is touched.
pub async fn pin_current_generation(tx: &mut Tx, id: RunId) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs r SET state_generation = c.state_generation, updated_at = now()
             FROM capsules c
            WHERE r.id = $1 AND c.id = r.capsule_id AND r.kind = 'apply' AND r.status = 'queued'
              AND r.apply_mode = 'one_step' AND r.plan_run_id IS NULL"#,
        id.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// What a one-step apply executed, recorded on its Run while it runs (only by the lease
/// holder): the commit and tree, the tool version and the provider lockfile digest
/// (`None`: a provider-free configuration, recorded as an explicit null).
pub struct OneStepSnapshot<'a> {
    /// The commit that was applied.
    pub commit: &'a str,
    /// Digest of the checked-out tree.
    pub tree_digest: &'a str,
    /// `version -json` of the tool.
    pub tool_version: &'a serde_json::Value,
    /// SHA-256 of `.terraform.lock.hcl` after init, `None` for no lockfile.
    pub provider_lock_digest: Option<&'a str>,
    /// Names of the injected variables (never values).
    pub injected_env_names: &'a [String],
}

/// Records a one-step apply's snapshot (see [`OneStepSnapshot`]).
pub async fn record_snapshot<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
    owner: &str,
    s: &OneStepSnapshot<'_>,
) -> Result<bool, StoreError> {
    let state = takosumi_core::ProviderLockState::of_digest(s.provider_lock_digest);
    let done = sqlx::query!(
        r#"UPDATE runs SET source_commit = $3, tree_digest = $4, tool_version = $5,
                  provider_lock_state = $6, provider_lock_digest = $7, injected_env_names = $8,
                  updated_at = now()
            WHERE id = $1 AND status = 'applying' AND lease_owner = $2 AND apply_mode = 'one_step'"#,
        id.as_uuid(),
        owner,
        s.commit,
        s.tree_digest,
        s.tool_version,
        state as takosumi_core::ProviderLockState,
        s.provider_lock_digest,
        s.injected_env_names
    )
    .execute(executor)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Marks a planned [`ApplyMode::ProposesApply`] plan Run as having proposed its Apply Run: the guard
/// that makes the proposal happen once however often the gate is woken.
pub async fn mark_proposed(tx: &mut Tx, id: RunId) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET apply_mode = 'proposed_apply', updated_at = now()
            WHERE id = $1 AND apply_mode = 'proposes_apply' AND status = 'planned'"#,
        id.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}
