//! The outbox relay: claims committed wake-ups for a short while ([`CLAIM`]), publishes them
//! with publisher confirms and marks them sent. Rows another relay claimed are skipped, so
//! any number of relays can run; a relay that dies before its mark leaves the rows pending,
//! and they are published again when the claim lapses (handlers are safe to run twice).
//! Sent rows are deleted once they are older than [`KEEP_SENT`].

use std::sync::Arc;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use takosumi_store::outbox;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{Broker, QueueError};

/// How often a relay looks for due rows nobody woke it for.
const POLL: Duration = Duration::from_millis(250);

/// The most rows one pass claims and publishes.
pub const BATCH: usize = 200;

/// How long a pass's claim keeps other relays off its rows: far longer than a batch takes
/// to publish (milliseconds), short enough that a relay that died mid-pass delays its
/// wake-ups by seconds, not minutes.
pub const CLAIM: Duration = Duration::from_secs(15);

/// How long a sent row is kept before a relay deletes it: long enough to tell when a
/// recent wake-up left (an operator's question, the benchmark's relay/broker split), not
/// so long that the table grows with every Run ever made.
pub const KEEP_SENT: Duration = Duration::from_secs(60 * 60);
/// How often a relay prunes, starting when it starts.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
/// Rows one prune statement deletes at most, and statements one prune makes at most: a
/// backlog (the first start after an upgrade) goes over a few minutes, in short statements.
const PRUNE_BATCH: i64 = 5_000;
const PRUNE_STATEMENTS: usize = 4;

/// Publishes up to one batch ([`BATCH`]) of due rows; returns how many were sent. Two
/// autocommit statements, the claim and the mark; one when nothing is due.
pub async fn relay_once(pool: &sqlx_pool::PgPool, broker: &Broker) -> Result<usize, QueueError> {
    let rows = claim(pool).await?;
    if rows.is_empty() {
        return Ok(0);
    }
    publish_claimed(pool, broker, rows).await
}

async fn claim(pool: &sqlx_pool::PgPool) -> Result<Vec<outbox::Pending>, QueueError> {
    let lease = i64::try_from(CLAIM.as_secs()).unwrap_or(i64::MAX);
    Ok(outbox::claim_due(pool, BATCH as i64, lease).await?)
}

/// Publishes rows this relay claimed and marks those the broker confirmed; the others are
/// given up (counted as a failed attempt) with the first error.
async fn publish_claimed(
    pool: &sqlx_pool::PgPool,
    broker: &Broker,
    rows: Vec<outbox::Pending>,
) -> Result<usize, QueueError> {
    let messages = rows
        .iter()
        .map(|row| {
            let body = serde_json::to_vec(&row.payload).unwrap_or_default();
            (
                row.topic.as_str(),
                body,
                Some(row.id.to_string()),
                headers(row),
            )
        })
        .collect();
    let mut sent = Vec::with_capacity(rows.len());
    let mut failure = None;
    for (row, result) in rows.iter().zip(broker.publish_all(messages).await) {
        match result {
            Ok(()) => sent.push(row.id),
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    if !sent.is_empty() {
        outbox::mark_sent(pool, &sent).await?;
    }
    if let Some(e) = failure {
        let unsent: Vec<i64> = rows
            .iter()
            .map(|r| r.id)
            .filter(|id| !sent.contains(id))
            .collect();
        let _ = outbox::mark_failed(pool, &unsent).await;
        return Err(e);
    }
    Ok(sent.len())
}

/// The headers a wake-up carries besides its body: the Run's trace context and when the
/// row became due (the consumer's queue lag).
fn headers(row: &outbox::Pending) -> FieldTable {
    let mut headers = FieldTable::default();
    if let Some(tp) = &row.traceparent {
        headers.insert(
            crate::consume::TRACEPARENT_HEADER.into(),
            AMQPValue::LongString(tp.clone().into()),
        );
    }
    headers.insert(
        crate::consume::DUE_HEADER.into(),
        AMQPValue::LongLongInt(row.due_ms),
    );
    headers
}

/// Relays until `shutdown`. `wake` lets a process that just committed an outbox row skip
/// the poll interval. `connect` gives the current broker (reconnecting when needed).
///
/// A pass that published a whole batch is followed by another at once (more may be due);
/// otherwise the relay waits for a wake-up or the poll interval. A wake-up committed while
/// a pass published is kept by `wake` and starts the next pass. The poll (rows other
/// processes committed and their relays did not take, rows whose retry delay or claim ended)
/// is a pass: one statement when nothing is due, and every process polls four times a
/// second.
pub async fn run_relay<F, Fut>(
    pool: sqlx_pool::PgPool,
    connect: F,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Broker, QueueError>>,
{
    let pruner = tokio::spawn(prune_until(pool.clone(), shutdown.clone()));
    let mut failures: u32 = 0;
    while !shutdown.is_cancelled() {
        // The broker is asked for only when something is due: a relay whose broker is away
        // waits quietly until there is something to send.
        let result = match claim(&pool).await {
            Ok(rows) if rows.is_empty() => Ok(0),
            Ok(rows) => match connect().await {
                Ok(broker) => publish_claimed(&pool, &broker, rows).await,
                Err(e) => {
                    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
                    let _ = outbox::mark_failed(&pool, &ids).await;
                    Err(e)
                }
            },
            Err(e) => Err(e),
        };
        match result {
            Ok(n) if n >= BATCH => {
                failures = 0;
                continue;
            }
            Ok(_) => {
                failures = 0;
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(POLL) => {}
                }
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                let delay =
                    Duration::from_millis(100u64 << failures.min(8)).min(Duration::from_secs(10));
                tracing::warn!(error = %e, ?delay, "outbox relay failed; backing off");
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    let _ = pruner.await;
}

/// Deletes sent rows older than [`KEEP_SENT`] now and every [`PRUNE_EVERY`] until
/// `shutdown`. Every process's relay does it; they skip each other's rows.
async fn prune_until(pool: sqlx_pool::PgPool, shutdown: CancellationToken) {
    let keep = i64::try_from(KEEP_SENT.as_secs()).unwrap_or(i64::MAX);
    while !shutdown.is_cancelled() {
        let mut removed = 0;
        for _ in 0..PRUNE_STATEMENTS {
            match outbox::prune_sent(&pool, keep, PRUNE_BATCH).await {
                Ok(n) => {
                    removed += n;
                    if n < PRUNE_BATCH as u64 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "pruning sent outbox rows failed; trying again later");
                    break;
                }
            }
        }
        if removed > 0 {
            tracing::debug!(removed, "pruned sent outbox rows");
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(PRUNE_EVERY) => {}
        }
    }
}

mod sqlx_pool {
    pub use takosumi_store::Pool as PgPool;
}
