//! The sweep: on a timer, enqueues a drift check for every Capsule whose interval (its
//! own, else its Workspace's) has passed and whose last check is not still queued or
//! running. It is read-only: it creates drift-check Runs and nothing else, never an
//! apply, and never re-picks a target. Due Capsules are claimed in Postgres (`FOR UPDATE
//! SKIP LOCKED` plus a timestamp moved in the same statement), so any number of sweepers
//! can run at once without enqueueing a Capsule twice.

use std::time::Duration;

use takosumi_core::{CapsuleId, StepError};
use takosumi_runtime::Ctx;
use takosumi_store::StoreError;
use tokio_util::sync::CancellationToken;

/// Capsules claimed per statement.
pub const BATCH: i64 = 2000;

/// Ranges of Capsules a pass walks side by side, each on its own connection. A batch's
/// work is Postgres's (per Capsule: index lookups, an update, three inserts and their
/// foreign-key checks), done by one server process per statement: walked one batch at a
/// time, a pass kept one of the server's cores busy and left the rest idle.
pub const WALKS: i64 = 2;

/// One pass: enqueues every due Capsule's check; returns how many.
pub async fn sweep_once(ctx: &Ctx) -> Result<i64, StepError> {
    let bounds = takosumi_store::drift::sweep_bounds(&ctx.pool, WALKS).await?;
    // Ranges (start, end]: from the first Capsule, between the bounds, to the last.
    let starts = std::iter::once(None).chain(bounds.iter().copied().map(Some));
    let ends = bounds
        .iter()
        .copied()
        .map(Some)
        .chain(std::iter::once(None));
    let counts = futures::future::try_join_all(
        starts
            .zip(ends)
            .map(|(after, until)| walk(ctx, after, until)),
    )
    .await?;
    let total = counts.iter().sum();
    if total > 0 {
        ctx.relay_wake.notify_one();
        tracing::info!(enqueued = total, "sweep enqueued drift checks");
    }
    Ok(total)
}

/// Enqueues the checks of the due Capsules in `(after, until]`, a batch per transaction.
async fn walk(
    ctx: &Ctx,
    mut after: Option<CapsuleId>,
    until: Option<CapsuleId>,
) -> Result<i64, StepError> {
    let mut total = 0;
    loop {
        let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
        let (n, last) = takosumi_store::drift::sweep_due(&mut tx, after, until, BATCH).await?;
        tx.commit().await.map_err(StoreError::from)?;
        total += n;
        if n < BATCH {
            return Ok(total);
        }
        after = last;
    }
}

/// Sweeps every `interval` until `shutdown`.
pub async fn run(ctx: Ctx, interval: Duration, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        if let Err(e) = sweep_once(&ctx).await {
            tracing::warn!(error = %e, "sweep pass failed; will retry");
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(interval) => {}
        }
    }
}
