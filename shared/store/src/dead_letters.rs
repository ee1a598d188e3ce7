//! Dead letters moved out of the broker: the collector inserts each one (before it acks
//! it), operators read them, requeue them (an outbox wake-up in the transaction that deletes
//! the row) or purge them. Reading changes nothing.

use chrono::{DateTime, Utc};
use takosumi_core::{RunId, Topic};

use crate::{StoreError, Tx, outbox};

/// The most body bytes kept of a dead letter.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A dead letter as the collector found it.
#[derive(Debug, Clone)]
pub struct NewDeadLetter {
    /// The step queue it was meant for.
    pub queue: String,
    /// Its body (cut at [`MAX_BODY_BYTES`] on insert).
    pub body: Vec<u8>,
    /// The Run it names, when the body is a Run message.
    pub run_id: Option<RunId>,
    /// Why a step gave up (`x-takosumi-error`).
    pub error: Option<String>,
    /// Why the broker dead-lettered it (`x-death`).
    pub broker_reason: Option<String>,
    /// The publisher's message id.
    pub message_id: Option<String>,
}

/// A stored dead letter.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// Row id: what a requeue or purge names.
    pub id: i64,
    /// The step queue it was meant for.
    pub queue: String,
    /// Its body (at most [`MAX_BODY_BYTES`]).
    pub body: Vec<u8>,
    /// Whether the body was cut.
    pub body_truncated: bool,
    /// The Run it names, when the body is a Run message.
    pub run_id: Option<RunId>,
    /// Why a step gave up.
    pub error: Option<String>,
    /// Why the broker dead-lettered it.
    pub broker_reason: Option<String>,
    /// The publisher's message id.
    pub message_id: Option<String>,
    /// When the collector moved it here.
    pub collected_at: DateTime<Utc>,
}

/// Which dead letters an operator's action takes: those of `queue`, those with the given
/// ids, or (neither given) all of them.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Only this step queue's.
    pub queue: Option<String>,
    /// Only these rows.
    pub ids: Option<Vec<i64>>,
}

/// Stores a dead letter; returns its id.
pub async fn insert<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    d: &NewDeadLetter,
) -> Result<i64, StoreError> {
    let truncated = d.body.len() > MAX_BODY_BYTES;
    let body = &d.body[..d.body.len().min(MAX_BODY_BYTES)];
    let id = sqlx::query_scalar!(
        "INSERT INTO dead_letters (queue, body, body_truncated, run_id, error, broker_reason, message_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
        d.queue,
        body,
        truncated,
        d.run_id.map(|r| r.as_uuid()),
        d.error,
        d.broker_reason,
        d.message_id
    )
    .fetch_one(executor)
    .await?;
    Ok(id)
}

/// How many dead letters each queue has.
pub async fn counts(pool: &crate::Pool) -> Result<Vec<(String, i64)>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT queue, count(*) AS "n!" FROM dead_letters GROUP BY queue ORDER BY queue"#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.queue, r.n)).collect())
}

/// The oldest `limit` dead letters of `queue`.
pub async fn oldest(
    pool: &crate::Pool,
    queue: &str,
    limit: i64,
) -> Result<Vec<DeadLetter>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id, queue, body, body_truncated, run_id, error, broker_reason, message_id, collected_at
           FROM dead_letters WHERE queue = $1 ORDER BY id LIMIT $2",
        queue,
        limit
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| DeadLetter {
            id: r.id,
            queue: r.queue,
            body: r.body,
            body_truncated: r.body_truncated,
            run_id: r.run_id.map(RunId::from_uuid),
            error: r.error,
            broker_reason: r.broker_reason,
            message_id: r.message_id,
            collected_at: r.collected_at,
        })
        .collect())
}

/// A dead letter a requeue moved back onto its step queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requeued {
    /// The row (now deleted).
    pub id: i64,
    /// The step queue.
    pub queue: String,
    /// The Run woken.
    pub run_id: RunId,
}

/// What a requeue did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequeueResult {
    /// Moved back onto their step queue.
    pub requeued: Vec<Requeued>,
    /// Selected but left in place, `(id, queue)` (the first 1,000): not a Run message (or
    /// of no step queue), so no step could ever process them; purge them.
    pub skipped: Vec<(i64, String)>,
}

/// Requeues up to `limit` selected dead letters that name a Run, oldest first: for each, a
/// wake-up on its step queue (through the outbox, so it is published with confirms after
/// the commit, and reaches a worker pool's queue where the Run's Capsule names one) and the
/// row deleted, in `tx`. Rows another requeue or purge holds are skipped, never waited for.
pub async fn requeue(
    tx: &mut Tx,
    selection: &Selection,
    limit: i64,
) -> Result<RequeueResult, StoreError> {
    let step_queues: Vec<String> = Topic::ALL
        .iter()
        .map(|t| t.queue_name().to_owned())
        .collect();
    let rows = sqlx::query!(
        r#"SELECT id, queue, run_id AS "run_id!" FROM dead_letters
          WHERE ($1::text IS NULL OR queue = $1) AND ($2::bigint[] IS NULL OR id = ANY($2))
            AND run_id IS NOT NULL AND queue = ANY($3)
          ORDER BY id LIMIT $4 FOR UPDATE SKIP LOCKED"#,
        selection.queue,
        selection.ids.as_deref(),
        &step_queues,
        limit
    )
    .fetch_all(tx.db())
    .await?;
    let mut out = RequeueResult::default();
    for r in rows {
        let Some(topic) = Topic::from_queue_name(&r.queue) else {
            continue;
        };
        let run_id = RunId::from_uuid(r.run_id);
        outbox::enqueue(tx, topic, run_id).await?;
        sqlx::query!("DELETE FROM dead_letters WHERE id = $1", r.id)
            .execute(tx.db())
            .await?;
        out.requeued.push(Requeued {
            id: r.id,
            queue: r.queue,
            run_id,
        });
    }
    let skipped = sqlx::query!(
        "SELECT id, queue FROM dead_letters
          WHERE ($1::text IS NULL OR queue = $1) AND ($2::bigint[] IS NULL OR id = ANY($2))
            AND (run_id IS NULL OR NOT queue = ANY($3))
          ORDER BY id LIMIT 1000",
        selection.queue,
        selection.ids.as_deref(),
        &step_queues
    )
    .fetch_all(tx.db())
    .await?;
    out.skipped = skipped.into_iter().map(|r| (r.id, r.queue)).collect();
    Ok(out)
}

/// Deletes the selected dead letters; returns the ids deleted.
pub async fn purge(tx: &mut Tx, selection: &Selection) -> Result<Vec<i64>, StoreError> {
    let ids = sqlx::query_scalar!(
        "DELETE FROM dead_letters
          WHERE ($1::text IS NULL OR queue = $1) AND ($2::bigint[] IS NULL OR id = ANY($2))
          RETURNING id",
        selection.queue,
        selection.ids.as_deref()
    )
    .fetch_all(tx.db())
    .await?;
    Ok(ids)
}

/// How many selected dead letters there are.
pub async fn count_selected<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    selection: &Selection,
) -> Result<i64, StoreError> {
    let n = sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM dead_letters
          WHERE ($1::text IS NULL OR queue = $1) AND ($2::bigint[] IS NULL OR id = ANY($2))"#,
        selection.queue,
        selection.ids.as_deref()
    )
    .fetch_one(executor)
    .await?;
    Ok(n)
}
