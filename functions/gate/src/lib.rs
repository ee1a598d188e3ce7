//! The gate step: decides from the saved plan whether what follows it runs, waits for a
//! person, or stops. With no rules configured it releases: a plan Run stays `planned`
//! with the decision recorded; an Apply Run goes on to the apply queue. The decision and
//! the wake-up it causes commit together.

use takosumi_core::{Outcome, RunKind, RunMessage, RunStatus, StepError, Topic};
use takosumi_runtime::Ctx;
use takosumi_runtime::step::store_err;
use takosumi_store::{events, outbox, runs};

/// Handles one `run.gate` wake-up. Safe to run twice: the decision is recorded once.
pub async fn handle(ctx: &Ctx, msg: RunMessage) -> Result<Outcome, StepError> {
    let run_id = msg.run_id;
    let run = runs::get(&ctx.pool, run_id)
        .await
        .map_err(store_err)?
        .ok_or_else(|| StepError::Poison(format!("{run_id} does not exist")))?;
    let expected = if run.kind == RunKind::Apply {
        RunStatus::Queued
    } else {
        RunStatus::Planned
    };
    if run.status != expected || run.gate_decision.is_some() {
        return Ok(Outcome::Skipped(
            "already decided, or not waiting for the gate",
        ));
    }
    let mut tx = ctx.pool.begin().await.map_err(|e| store_err(e.into()))?;
    if !runs::record_gate_release(&mut tx, run_id)
        .await
        .map_err(store_err)?
    {
        return Ok(Outcome::Skipped("decided by another handler"));
    }
    let actor = format!("handler:{}", ctx.owner);
    events::append(
        &mut *tx,
        run_id,
        "gate_decision",
        &actor,
        serde_json::json!({ "decision": "released", "rules": [], "reason": "no rule covers this run" }),
    )
    .await
    .map_err(store_err)?;
    if run.kind == RunKind::Apply {
        outbox::enqueue(&mut tx, Topic::Apply, run_id)
            .await
            .map_err(store_err)?;
    }
    tx.commit().await.map_err(|e| store_err(e.into()))?;
    ctx.relay_wake.notify_one();
    Ok(Outcome::Done)
}
