//! The approve step. The API records each person's approval (bound to the digest of the
//! plan they were shown) and wakes this step; it counts the distinct approvals of the
//! approver roles the hold requires that are bound to the Run's current plan digest, and
//! when there are enough releases the Run in one transaction with its next wake-up: an
//! apply to the apply queue, an agent's plan held before planning to the planner. An
//! approval of another plan can never count here.

use serde_json::json;
use takosumi_core::{
    EventKind, Outcome, RunKind, RunMessage, RunStatus, ShownToApprover, StepError, Topic,
};
use takosumi_runtime::Ctx;
use takosumi_store::StoreError;
use takosumi_store::{approvals, events, outbox, runs};

/// Handles one `run.approve` wake-up. Safe to run twice: the release is conditional.
pub async fn handle(ctx: &Ctx, msg: RunMessage) -> Result<Outcome, StepError> {
    let run_id = msg.run_id;
    let run = runs::get(&ctx.pool, run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("{run_id} does not exist")))?;
    if run.status != RunStatus::Held {
        return Ok(Outcome::Skipped("not held: already released or ended"));
    }
    let gate = runs::hold::gate_fields(&ctx.pool, run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("{run_id} vanished")))?;
    let (required, roles) = (gate.approvals_required, gate.approver_roles);
    let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
    let given =
        approvals::count_approvals(&mut tx, run_id, run.plan_digest.as_deref(), &roles).await?;
    if given < i64::from(required.max(1)) {
        return Ok(Outcome::Skipped("not enough approvals yet"));
    }
    if !runs::hold::release(&mut tx, run_id).await? {
        return Ok(Outcome::Skipped("released by another handler"));
    }
    let topic = match run.kind {
        RunKind::Apply => Topic::Apply,
        RunKind::DriftCheck => Topic::Drift,
        RunKind::Plan | RunKind::Destroy => Topic::Plan,
    };
    outbox::enqueue(&mut tx, topic, run_id).await?;
    let actor = format!("handler:{}", ctx.owner);
    let shown = ShownToApprover::of(run.hold_details.as_ref());
    events::append(
        tx.db(),
        run_id,
        EventKind::Released,
        &actor,
        // a dry run held before planning is released bound to what its scan read
        json!({
            "approvals": given,
            "required": required,
            "planDigest": run.plan_digest,
            "commit": shown.commit,
            "modulesDigest": shown.modules_digest,
        }),
    )
    .await?;
    tx.commit().await.map_err(StoreError::from)?;
    ctx.relay_wake.notify_one();
    Ok(Outcome::Done)
}
