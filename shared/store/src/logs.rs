//! Run logs: the tool's output as it was stored (callers store only masked text).

use takosumi_core::RunId;

use crate::StoreError;

/// Appends a chunk of (already masked) output.
pub async fn append(
    pool: &sqlx::PgPool,
    run_id: RunId,
    step: &str,
    chunk: &str,
) -> Result<(), StoreError> {
    sqlx::query!(
        "INSERT INTO run_logs (run_id, step, chunk) VALUES ($1, $2, $3)",
        run_id.as_uuid(),
        step,
        chunk
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The whole log of a Run, in order.
pub async fn read(pool: &sqlx::PgPool, run_id: RunId) -> Result<Vec<(String, String)>, StoreError> {
    let rows = sqlx::query!(
        "SELECT step, chunk FROM run_logs WHERE run_id = $1 ORDER BY id",
        run_id.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.step, r.chunk)).collect())
}
