//! Applies whose result could not be recorded, and the Capsule lock they leave behind.
//!
//! When the tool has applied but the step cannot record what it did (the new state does
//! not reach object storage, reading the outputs fails, the final commit fails), the
//! apply ends `unknown_outcome`, never `failed` with "nothing was applied". A state the
//! tool wrote is kept sealed in `held_states` when object storage will not take it, so an
//! operator can recover it. A Capsule with an `unknown_outcome` apply that no operator
//! has resolved (`POST /runs/{id}/resolve`) takes no other apply: applying on top of a
//! state nobody has looked at could undo or repeat what the lost apply did.

use takosumi_core::{CapsuleId, RunId, StateVersionId};

use crate::{StoreError, Tx};

/// A sealed state kept in Postgres because object storage would not take it.
#[derive(Debug, Clone)]
pub struct HeldState {
    /// The StateVersion id the state was sealed under (its associated data).
    pub state_version_id: StateVersionId,
    /// The apply that wrote it.
    pub run_id: RunId,
    /// Its Capsule.
    pub capsule_id: CapsuleId,
    /// The generation it would have become.
    pub generation: i64,
    /// The object key it was meant for.
    pub object_key: String,
    /// SHA-256 hex of the unsealed state.
    pub digest: String,
    /// Size of the unsealed state.
    pub size_bytes: i64,
    /// Why it is held (the storage error, no secret).
    pub reason: String,
}

/// Keeps `sealed` (already sealed under `held.state_version_id`) in the database. Safe to
/// call twice for the same StateVersion id.
pub async fn hold_state(
    pool: &sqlx::PgPool,
    held: &HeldState,
    sealed: &[u8],
) -> Result<(), StoreError> {
    sqlx::query!(
        r#"INSERT INTO held_states (state_version_id, run_id, capsule_id, generation, object_key,
                                    digest, size_bytes, sealed, reason)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
           ON CONFLICT (state_version_id) DO NOTHING"#,
        held.state_version_id.as_uuid(),
        held.run_id.as_uuid(),
        held.capsule_id.as_uuid(),
        held.generation,
        held.object_key,
        held.digest,
        held.size_bytes,
        sealed,
        held.reason
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// A state held for an apply Run, sealed.
#[derive(Debug, Clone)]
pub struct HeldSealed {
    /// The StateVersion id it was sealed under.
    pub state_version_id: StateVersionId,
    /// The generation it would have become.
    pub generation: i64,
    /// SHA-256 hex of the unsealed state.
    pub digest: String,
    /// The sealed bytes.
    pub sealed: Vec<u8>,
}

/// The states held for an apply Run, oldest first.
pub async fn held_for_run(
    pool: &sqlx::PgPool,
    run_id: RunId,
) -> Result<Vec<HeldSealed>, StoreError> {
    let rows = sqlx::query!(
        "SELECT state_version_id, generation, digest, sealed FROM held_states WHERE run_id = $1 ORDER BY created_at",
        run_id.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| HeldSealed {
            state_version_id: StateVersionId::from_uuid(r.state_version_id),
            generation: r.generation,
            digest: r.digest,
            sealed: r.sealed,
        })
        .collect())
}

/// The ids of the states held for an apply Run (without their bytes).
pub async fn held_ids_for_run(
    executor: impl sqlx::PgExecutor<'_>,
    run_id: RunId,
) -> Result<Vec<StateVersionId>, StoreError> {
    let ids = sqlx::query_scalar!(
        "SELECT state_version_id FROM held_states WHERE run_id = $1 ORDER BY created_at",
        run_id.as_uuid()
    )
    .fetch_all(executor)
    .await?;
    Ok(ids.into_iter().map(StateVersionId::from_uuid).collect())
}

/// `applying` → `unknown_outcome` with `message`, only while `owner` holds the lease; lets
/// go of the Capsule's running-apply slot (the lock that matters from here on is
/// [`unresolved_unknown_apply`]). `false`: the lease was lost (the reaper took the Run,
/// and made it `unknown_outcome` itself).
pub async fn mark_unknown_outcome(
    tx: &mut Tx,
    run_id: RunId,
    owner: &str,
    message: &str,
) -> Result<bool, StoreError> {
    crate::transitions!(Applying => UnknownOutcome);
    let row = sqlx::query_scalar!(
        r#"UPDATE runs SET status = 'unknown_outcome', error_code = 'unknown_outcome', error_message = $3,
                  lease_owner = NULL, lease_until = NULL, updated_at = now(), finished_at = now()
            WHERE id = $1 AND status = 'applying' AND lease_owner = $2
        RETURNING capsule_id"#,
        run_id.as_uuid(),
        owner,
        message
    )
    .fetch_optional(&mut **tx)
    .await?;
    let Some(capsule) = row else {
        return Ok(false);
    };
    crate::capsules::release_apply(tx, CapsuleId::from_uuid(capsule), run_id).await?;
    Ok(true)
}

/// The Capsule's oldest `unknown_outcome` apply that no operator has resolved, if any.
pub async fn unresolved_unknown_apply<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    capsule_id: CapsuleId,
) -> Result<Option<RunId>, StoreError> {
    let id = sqlx::query_scalar!(
        r#"SELECT id FROM runs
            WHERE capsule_id = $1 AND kind = 'apply' AND status = 'unknown_outcome' AND resolved_at IS NULL
            ORDER BY finished_at NULLS LAST, created_at LIMIT 1"#,
        capsule_id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(id.map(RunId::from_uuid))
}

/// The message a refused apply carries.
pub fn needs_inspection_message(blocking: RunId) -> String {
    format!(
        "apply {blocking} of this Capsule ended unknown_outcome and nobody has resolved it yet; nothing was applied. \
         Inspect the provider side and the Capsule's current StateVersion, record it with \
         `takosumi resolve {blocking} --note …` (POST /api/v1/runs/{blocking}/resolve), then plan again"
    )
}
