//! Run logs: the tool's output as it was stored (callers store only masked text).
//!
//! A chunk's id is taken under the Run's row lock, as an event's is ([`crate::events`]), so
//! a reader following the log by id (`id > cursor`) never passes a chunk committed later.

use takosumi_core::RunId;

use crate::StoreError;

/// Appends a chunk of (already masked) output.
pub async fn append<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
    step: &str,
    chunk: &str,
) -> Result<(), StoreError> {
    let chunk = takosumi_core::without_nul(chunk);
    let done = sqlx::query!(
        "WITH run AS (SELECT id FROM runs WHERE id = $1 FOR NO KEY UPDATE)
         INSERT INTO run_logs (run_id, step, chunk) SELECT id, $2, $3 FROM run",
        run_id.as_uuid(),
        step,
        chunk.as_ref()
    )
    .execute(executor)
    .await?;
    crate::appended_to_run(done.rows_affected())
}

/// Appends chunks (step, already masked text) in order as progress: one statement that
/// commits without waiting for the disk ([`crate::progress`]).
pub async fn append_progress<S: AsRef<str>, T: AsRef<str>>(
    pool: &crate::Pool,
    run_id: RunId,
    chunks: &[(S, T)],
) -> Result<(), StoreError> {
    if chunks.is_empty() {
        return Ok(());
    }
    let steps: Vec<&str> = chunks.iter().map(|(step, _)| step.as_ref()).collect();
    let texts: Vec<String> = chunks
        .iter()
        .map(|(_, chunk)| takosumi_core::without_nul(chunk.as_ref()).into_owned())
        .collect();
    // `ORDER BY` the position: the ids (the log's order) are taken in the order rows arrive,
    // after the Run's lock (see the module docs).
    let done = sqlx::query!(
        "WITH run AS (SELECT id FROM runs WHERE id = $1 FOR NO KEY UPDATE)
         INSERT INTO run_logs (run_id, step, chunk)
         SELECT run.id, l.step, l.chunk
           FROM run, UNNEST($2::text[], $3::text[]) WITH ORDINALITY AS l(step, chunk, n)
          WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL
          ORDER BY l.n",
        run_id.as_uuid(),
        &steps as &[&str],
        &texts
    )
    .execute(pool)
    .await?;
    crate::appended_to_run(done.rows_affected())
}

/// The whole log of a Run, in order.
pub async fn read(pool: &crate::Pool, run_id: RunId) -> Result<Vec<LogChunk>, StoreError> {
    read_after(pool, run_id, 0).await
}

/// One stored chunk of a Run's log.
#[derive(Debug, Clone)]
pub struct LogChunk {
    /// Its order within the log.
    pub id: i64,
    /// The step that printed it.
    pub step: String,
    /// The (masked) text.
    pub text: String,
}

/// The chunks of a Run's log after the one with id `after`, in order.
pub async fn read_after(
    pool: &crate::Pool,
    run_id: RunId,
    after: i64,
) -> Result<Vec<LogChunk>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id, step, chunk FROM run_logs WHERE run_id = $1 AND id > $2 ORDER BY id",
        run_id.as_uuid(),
        after
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| LogChunk {
            id: r.id,
            step: r.step,
            text: r.chunk,
        })
        .collect())
}
