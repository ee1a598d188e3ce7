//! Runs held for people and released: the gate's hold of a queued Run, the plan step's hold
//! of a claimed plan (a dry run the approval rule covers, or whose exemption did not hold
//! because the dry-run scan found a data source that acts or something it could not read),
//! the release, and the fields the gate decides on. A hold and a release are conditional
//! updates like every other transition; the approvals that release a hold are
//! [`crate::approvals`].

use takosumi_core::{EventKind, HoldReason, Role, RunId, RunMessage, Topic};

use crate::{StoreError, Tx};

/// Holds a queued Run for people: records the reason and how many approvals release it.
pub async fn hold(
    tx: &mut Tx,
    id: RunId,
    reason: HoldReason,
    details: &serde_json::Value,
    approvals_required: i32,
    approver_roles: &[Role],
) -> Result<bool, StoreError> {
    crate::transitions!(Queued => Held);
    let done = sqlx::query!(
        r#"UPDATE runs SET status = 'held', hold_reason = $2, hold_details = $3, gate_decision = 'held',
                  approvals_required = $4, approver_roles = $5, updated_at = now()
            WHERE id = $1 AND status = 'queued' AND gate_decision IS NULL"#,
        id.as_uuid(),
        reason as HoldReason,
        details,
        approvals_required,
        &role_names(approver_roles) as &[&str]
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// `planning` → `held` for the lease holder, before the tool planned anything; the approve
/// step releases it back to the planner like an agent's plan.
pub async fn hold_claimed(
    tx: &mut Tx,
    id: RunId,
    owner: &str,
    reason: HoldReason,
    details: &serde_json::Value,
    approvals_required: i32,
    approver_roles: &[Role],
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
        &role_names(approver_roles) as &[&str]
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Releases a held Run back to `queued` with the gate decision `released`.
pub async fn release(tx: &mut Tx, id: RunId) -> Result<bool, StoreError> {
    crate::transitions!(Held => Queued);
    let done = sqlx::query!(
        r#"UPDATE runs SET status = 'queued', gate_decision = 'released', updated_at = now()
            WHERE id = $1 AND status = 'held'"#,
        id.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The gate released the Run: records the decision once, with its `gate_decision` event and,
/// given a topic, the wake-up of the step that carries the Run on (routed as
/// [`crate::outbox::enqueue`] routes it). One statement: on a pool it is the whole decision,
/// one round trip and one commit; in a transaction it is part of one. `false`: the decision
/// was already made (nothing is written).
pub async fn release_at_gate<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
    actor: &str,
    event: &serde_json::Value,
    wake: Option<Topic>,
) -> Result<bool, StoreError> {
    let event = takosumi_core::json_without_nul(event);
    let done = sqlx::query_scalar!(
        r#"WITH released AS (
               UPDATE runs SET gate_decision = 'released', updated_at = now()
                WHERE id = $1 AND gate_decision IS NULL AND status IN ('queued', 'planned')
               RETURNING id, capsule_id, traceparent),
           event AS (
               INSERT INTO run_events (run_id, kind, actor, data)
               SELECT id, $2, $3, $4 FROM released),
           wake AS (
               INSERT INTO outbox (topic, payload, traceparent)
               SELECT wake_topic($5, w.pool_name), $6, released.traceparent
                 FROM released
                 LEFT JOIN capsule_wake_routes w ON w.capsule_id = released.capsule_id
                WHERE $5::text IS NOT NULL)
           SELECT count(*) AS "released!" FROM released"#,
        id.as_uuid(),
        EventKind::GateDecision as EventKind,
        actor,
        event.as_ref(),
        wake.map(Topic::queue_name),
        RunMessage { run_id: id }.to_json(),
    )
    .fetch_one(executor)
    .await?;
    Ok(done == 1)
}

/// The gate's view of a Run's private fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GateFields {
    /// The submission asked for approval (`NewRun::require_approval`).
    pub require_approval: bool,
    /// Private: where the sealed `show -json` of the plan lives.
    pub plan_json_object_key: Option<String>,
    /// How many approvals release the hold.
    pub approvals_required: i32,
    /// The roles whose approvals count.
    pub approver_roles: Vec<Role>,
}

/// The roles as `runs.approver_roles` and `approvals.approver_role` store them.
pub(crate) fn role_names(roles: &[Role]) -> Vec<&'static str> {
    roles.iter().map(|r| r.as_str()).collect()
}

/// The roles `runs.approver_roles` names. Only [`hold`] and [`hold_claimed`] write it, from
/// [`Role`]s; a name that is not one is left out (logged), so it can only make an approval
/// count from fewer roles, never from more.
fn stored_roles(names: Vec<String>) -> Vec<Role> {
    names
        .into_iter()
        .filter_map(|name| {
            name.parse()
                .inspect_err(
                    |e| tracing::error!(error = %e, "a Run names an approver role that is not one"),
                )
                .ok()
        })
        .collect()
}

/// The gate's view of a Run's private fields.
pub async fn gate_fields<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<Option<GateFields>, StoreError> {
    let row = sqlx::query!(
        "SELECT require_approval, plan_json_object_key, approvals_required, approver_roles FROM runs WHERE id = $1",
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| GateFields {
        require_approval: r.require_approval,
        plan_json_object_key: r.plan_json_object_key,
        approvals_required: r.approvals_required,
        approver_roles: stored_roles(r.approver_roles),
    }))
}
