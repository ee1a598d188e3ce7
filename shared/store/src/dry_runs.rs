//! Plans (dry runs) held before they plan: the approval rule covers them (`excludeDryRun:
//! false`), or their exemption did not hold because the dry-run scan found a data source
//! that acts or something it could not read. The plan step holds its claimed Run and gives
//! its lease back in one conditional update.

use takosumi_core::{HoldReason, RunId};

use crate::{StoreError, Tx};

/// `planning` → `held` for the lease holder, before the tool planned anything; the approve
/// step releases it back to the planner like an agent's plan.
pub async fn hold_claimed(
    tx: &mut Tx,
    id: RunId,
    owner: &str,
    reason: HoldReason,
    details: &serde_json::Value,
    approvals_required: i32,
    approver_roles: &[String],
) -> Result<bool, StoreError> {
    crate::transitions!(Planning => Held);
    // The claim ended cleanly (held for a person, not lost): counted as handed back, so a
    // released plan keeps every attempt `max_attempts` allows.
    let done = sqlx::query!(
        r#"UPDATE runs SET status = 'held', hold_reason = $3, hold_details = $4, gate_decision = 'held',
                  approvals_required = $5, approver_roles = $6, lease_owner = NULL, lease_until = NULL,
                  handbacks = handbacks + 1, updated_at = now()
            WHERE id = $1 AND status = 'planning' AND lease_owner = $2 AND gate_decision IS NULL"#,
        id.as_uuid(),
        owner,
        reason as HoldReason,
        details,
        approvals_required,
        approver_roles
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}
