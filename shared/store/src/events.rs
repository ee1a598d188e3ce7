//! Run events: the ordered record of every step and transition, with time and actor.

use chrono::{DateTime, Utc};
use takosumi_core::{EventKind, RunId};

use crate::StoreError;

/// One event.
#[derive(Debug, Clone)]
pub struct Event {
    /// Order within the Run.
    pub id: i64,
    /// What happened.
    pub kind: EventKind,
    /// Who did it (`user:tok_…`, `handler:plan`, `system:reaper`).
    pub actor: String,
    /// Details (never secret values).
    pub data: serde_json::Value,
    /// When.
    pub at: DateTime<Utc>,
}

/// Appends an event.
pub async fn append<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
    kind: EventKind,
    actor: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    // An event may quote what a tool printed or planned (see takosumi_core::nul).
    let data = takosumi_core::json_without_nul(&data);
    sqlx::query!(
        "INSERT INTO run_events (run_id, kind, actor, data) VALUES ($1, $2, $3, $4)",
        run_id.as_uuid(),
        kind as EventKind,
        actor,
        data.as_ref()
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// Appends an event as progress: one statement that commits without waiting for the disk
/// ([`crate::progress`]). Only on a pool (the statement is its own transaction).
pub async fn append_progress(
    pool: &crate::Pool,
    run_id: RunId,
    kind: EventKind,
    actor: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    // An event may quote what a tool printed or planned (see takosumi_core::nul).
    let data = takosumi_core::json_without_nul(&data);
    sqlx::query!(
        "INSERT INTO run_events (run_id, kind, actor, data)
         SELECT $1, $2, $3, $4
          WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL",
        run_id.as_uuid(),
        kind as EventKind,
        actor,
        data.as_ref()
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// A Run's events in order.
pub async fn list(pool: &crate::Pool, run_id: RunId) -> Result<Vec<Event>, StoreError> {
    list_after(pool, run_id, 0).await
}

/// A Run's events after the one with id `after`, in order (what a watcher has not seen).
pub async fn list_after(
    pool: &crate::Pool,
    run_id: RunId,
    after: i64,
) -> Result<Vec<Event>, StoreError> {
    let rows = sqlx::query_as!(
        Event,
        r#"SELECT id, kind as "kind: EventKind", actor, data, at FROM run_events WHERE run_id = $1 AND id > $2 ORDER BY id"#,
        run_id.as_uuid(),
        after
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
