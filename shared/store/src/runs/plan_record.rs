//! What a plan keeps on its Run besides the status change: the dry-run scan's report,
//! recorded as the scan ends, and the reads of what [`super::record_plan`] wrote with the
//! status (the resource-change summary for cost estimates, the masked diff).

use takosumi_core::{EventKind, RunId};

use crate::StoreError;

/// A plan's resource-change summary, if the plan step recorded one.
pub async fn resource_changes(
    pool: &crate::Pool,
    id: RunId,
) -> Result<Option<serde_json::Value>, StoreError> {
    let row = sqlx::query!(
        "SELECT resource_changes FROM runs WHERE id = $1",
        id.as_uuid()
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.and_then(|r| r.resource_changes))
}

/// A plan's masked diff, if its plan step recorded one.
pub async fn plan_diff(
    pool: &crate::Pool,
    id: RunId,
) -> Result<Option<serde_json::Value>, StoreError> {
    let row = sqlx::query!("SELECT plan_diff FROM runs WHERE id = $1", id.as_uuid())
        .fetch_optional(pool)
        .await?;
    Ok(row.and_then(|r| r.plan_diff))
}

/// Records the dry-run scan's report on a plan Run (audit evidence).
pub async fn set_scan_report<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
    report: &serde_json::Value,
) -> Result<(), StoreError> {
    // A finding may quote the Capsule's files.
    let report = takosumi_core::json_without_nul(report);
    sqlx::query!(
        "UPDATE runs SET scan_report = $2 WHERE id = $1",
        id.as_uuid(),
        report.as_ref()
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// [`set_scan_report`] as progress, with the Run's `dry_run_scan` event (the report is its
/// data) written by the same statement: one statement that commits without waiting for the
/// disk ([`crate::progress`]); whatever the Run does next (hold, plan, fail) commits it. The
/// event's id is taken under the row lock the update holds (see [`crate::events`]).
pub async fn set_scan_report_progress(
    pool: &crate::Pool,
    id: RunId,
    report: &serde_json::Value,
    actor: &str,
) -> Result<(), StoreError> {
    // A finding may quote the Capsule's files.
    let report = takosumi_core::json_without_nul(report);
    let done = sqlx::query!(
        "WITH run AS (
             UPDATE runs SET scan_report = $2
              WHERE id = $1 AND set_config('synchronous_commit', 'off', true) IS NOT NULL
             RETURNING id)
         INSERT INTO run_events (run_id, kind, actor, data)
         SELECT id, $3, $4, $2 FROM run",
        id.as_uuid(),
        report.as_ref(),
        EventKind::DryRunScan as EventKind,
        actor
    )
    .execute(pool)
    .await?;
    crate::appended_to_run(done.rows_affected())
}

/// The dry-run scan report of a Run, if one was made.
pub async fn scan_report<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<Option<serde_json::Value>, StoreError> {
    let row = sqlx::query!("SELECT scan_report FROM runs WHERE id = $1", id.as_uuid())
        .fetch_optional(executor)
        .await?;
    Ok(row.and_then(|r| r.scan_report))
}
