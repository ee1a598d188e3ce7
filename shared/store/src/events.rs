//! Run events: the ordered record of every step and transition, with time and actor.
//!
//! A watcher follows a Run's events by id ([`list_after`]: `id > cursor`), which holds only
//! if a Run's events become visible in id order. An id is taken from one sequence when its
//! row is inserted and the row becomes visible when its transaction commits, so two writers
//! of one Run (a step's progress and a cancel request, say) could commit out of id order,
//! and a watcher that saw the later id would never see the earlier one. So every writer of
//! a Run's events takes the id while it holds the Run's row lock, kept to its commit: the
//! `UPDATE runs` of the same statement (a claim, a transition), or `FOR NO KEY UPDATE` here
//! (which conflicts with neither the foreign keys' `KEY SHARE` nor readers). A Run's events
//! are then written one transaction at a time, in id order; a new Run's first event is
//! written with the Run, which nobody else sees before it commits. The log
//! ([`crate::logs`]) is written the same way.

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
    // The id is taken after the lock (see the module docs).
    let done = sqlx::query!(
        "WITH run AS (SELECT id FROM runs WHERE id = $1 FOR NO KEY UPDATE)
         INSERT INTO run_events (run_id, kind, actor, data)
         SELECT id, $2, $3, $4 FROM run",
        run_id.as_uuid(),
        kind as EventKind,
        actor,
        data.as_ref()
    )
    .execute(executor)
    .await?;
    crate::appended_to_run(done.rows_affected())
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
    // The id is taken after the lock (see the module docs).
    let done = sqlx::query!(
        "WITH run AS (SELECT id FROM runs WHERE id = $1 FOR NO KEY UPDATE)
         INSERT INTO run_events (run_id, kind, actor, data)
         SELECT id, $2, $3, $4 FROM run
          WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL",
        run_id.as_uuid(),
        kind as EventKind,
        actor,
        data.as_ref()
    )
    .execute(pool)
    .await?;
    crate::appended_to_run(done.rows_affected())
}

/// A Run's events in order.
pub async fn list(pool: &crate::Pool, run_id: RunId) -> Result<Vec<Event>, StoreError> {
    list_after(pool, run_id, 0).await
}

/// A Run's events after the one with id `after`, in order (what a watcher has not seen;
/// none committed later has a lower id: see the module docs).
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
