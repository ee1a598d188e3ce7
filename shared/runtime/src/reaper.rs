//! The reaper: takes back Runs whose handler vanished (expired lease) and wakes queued
//! Runs whose wake-up was lost. Plans are queued again; an apply becomes
//! `unknown_outcome` and is never re-applied automatically.

use std::time::Duration;

use takosumi_core::{EventKind, GateDecision, RunKind, RunStatus, Topic};
use takosumi_store::{events, outbox, runs};
use tokio_util::sync::CancellationToken;

use crate::{Ctx, RuntimeError};

/// The queue that moves a queued Run forward.
pub fn topic_for(kind: RunKind, gate_decision: Option<GateDecision>) -> Topic {
    match kind {
        RunKind::Plan | RunKind::Destroy => Topic::Plan,
        RunKind::DriftCheck => Topic::Drift,
        RunKind::Apply if gate_decision == Some(GateDecision::Released) => Topic::Apply,
        RunKind::Apply => Topic::Gate,
    }
}

/// One pass; returns how many Runs it acted on.
pub async fn reap_once(ctx: &Ctx, stuck_queued_secs: i64) -> Result<usize, RuntimeError> {
    let mut tx = ctx
        .pool
        .begin()
        .await
        .map_err(takosumi_store::StoreError::from)?;
    let reaped = runs::reap_expired(&mut tx, ctx.max_attempts).await?;
    let mut actions: Vec<&'static str> = Vec::with_capacity(reaped.len());
    for r in &reaped {
        let kind = match r.status {
            RunStatus::Queued => {
                outbox::enqueue(&mut tx, topic_for(r.kind, None), r.id).await?;
                EventKind::LeaseExpiredRequeued
            }
            RunStatus::UnknownOutcome => EventKind::LeaseExpiredUnknownOutcome,
            RunStatus::Canceled => EventKind::LeaseExpiredCanceled,
            _ => EventKind::LeaseExpiredFailed,
        };
        actions.push(kind.as_str());
        events::append(
            tx.db(),
            r.id,
            kind,
            "system:reaper",
            serde_json::json!({ "status": r.status }),
        )
        .await?;
    }
    let stuck = runs::stuck_queued(&mut tx, stuck_queued_secs).await?;
    for s in &stuck {
        outbox::enqueue(&mut tx, topic_for(s.kind, s.gate_decision), s.id).await?;
        events::append(
            tx.db(),
            s.id,
            EventKind::WakeUpResent,
            "system:reaper",
            serde_json::json!({}),
        )
        .await?;
    }
    tx.commit()
        .await
        .map_err(takosumi_store::StoreError::from)?;
    // Counted once committed: a pass that rolled back did nothing.
    let m = takosumi_telemetry::metrics::global();
    for action in actions {
        m.count_reaper(action, 1);
    }
    m.count_reaper("wake_up_resent", stuck.len() as u64);
    let n = reaped.len() + stuck.len();
    if n > 0 {
        tracing::info!(reaped = reaped.len(), woken = stuck.len(), "reaper acted");
        ctx.relay_wake.notify_one();
    }
    Ok(n)
}

/// Runs the reaper every `interval` until `shutdown`.
pub async fn run_reaper(
    ctx: Ctx,
    interval: Duration,
    stuck_queued_secs: i64,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        if let Err(e) = reap_once(&ctx, stuck_queued_secs).await {
            tracing::warn!(error = %e, "reaper pass failed");
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(interval) => {}
        }
    }
}
