//! Applies whose result could not be recorded (`unknown_outcome`), the Capsule lock they
//! leave behind, and an operator's resolution of one.
//!
//! When the tool has applied but the step cannot record what it did (the new state does
//! not reach object storage, reading the outputs fails, the final commit fails), the
//! apply ends `unknown_outcome`, never `failed` with "nothing was applied". A state the
//! tool wrote is kept sealed ([`crate::states::held`]) when object storage will not take
//! it, so an operator can recover it. A Capsule with an `unknown_outcome` apply that no operator
//! has resolved (`POST /runs/{id}/resolve`) takes no other apply: applying on top of a
//! state nobody has looked at could undo or repeat what the lost apply did.

use takosumi_core::{CapsuleId, ResolutionAction, RunId, StateVersionId};

use crate::{StoreError, Tx};

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
    let message = takosumi_core::without_nul(message);
    let row = sqlx::query_scalar!(
        r#"UPDATE runs SET status = 'unknown_outcome', error_code = 'unknown_outcome', error_message = $3,
                  lease_owner = NULL, lease_until = NULL, updated_at = now(), finished_at = now()
            WHERE id = $1 AND status = 'applying' AND lease_owner = $2
        RETURNING capsule_id"#,
        run_id.as_uuid(),
        owner,
        message.as_ref()
    )
    .fetch_optional(tx.db())
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

/// Records an operator's resolution of an `unknown_outcome` Run, once. `false`: the Run is
/// not `unknown_outcome`, or it was already resolved.
pub async fn resolve_unknown(
    tx: &mut Tx,
    id: RunId,
    action: ResolutionAction,
    by: &str,
    note: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET resolution_action = $2, resolved_by = $3, resolution_note = $4,
                  resolved_at = now(), updated_at = now()
            WHERE id = $1 AND status = 'unknown_outcome' AND resolved_at IS NULL"#,
        id.as_uuid(),
        action as ResolutionAction,
        by,
        note
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Gives an `unknown_outcome` apply the StateVersion its resolution wrote, only if it has
/// none. `false`: it already has one; nothing changed.
pub async fn set_run_state_version(
    tx: &mut Tx,
    run_id: RunId,
    sv: StateVersionId,
    generation: i64,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET state_version_id = $2, state_generation = $3, updated_at = now()
            WHERE id = $1 AND status = 'unknown_outcome' AND state_version_id IS NULL"#,
        run_id.as_uuid(),
        sv.as_uuid(),
        generation
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}
