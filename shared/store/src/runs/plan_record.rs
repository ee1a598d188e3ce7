//! What a plan keeps on its Run beside the record its status change writes
//! ([`super::record_plan`]): the resource-change summary (for cost estimates), the masked
//! diff, where the sealed `show -json` lives, and the dry-run scan's report.

use takosumi_core::RunId;

use crate::{StoreError, Tx};

/// Stores a plan's resource-change summary (see `takosumi_cost`), only while the
/// Run is the plan step's (`planning`, this lease holder) or in the same transaction that
/// recorded it `planned`.
pub async fn set_resource_changes(
    tx: &mut Tx,
    id: RunId,
    summary: &serde_json::Value,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "UPDATE runs SET resource_changes = $2 WHERE id = $1 AND status IN ('planning', 'planned')",
        id.as_uuid(),
        summary
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A plan's resource-change summary, if the plan step recorded one.
pub async fn resource_changes(
    pool: &sqlx::PgPool,
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

/// Stores a plan's masked resource-by-resource diff, under the same condition as
/// [`set_resource_changes`].
pub async fn set_plan_diff(
    tx: &mut Tx,
    id: RunId,
    diff: &serde_json::Value,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "UPDATE runs SET plan_diff = $2 WHERE id = $1 AND status IN ('planning', 'planned')",
        id.as_uuid(),
        diff
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A plan's masked diff, if its plan step recorded one.
pub async fn plan_diff(
    pool: &sqlx::PgPool,
    id: RunId,
) -> Result<Option<serde_json::Value>, StoreError> {
    let row = sqlx::query!("SELECT plan_diff FROM runs WHERE id = $1", id.as_uuid())
        .fetch_optional(pool)
        .await?;
    Ok(row.and_then(|r| r.plan_diff))
}

/// Where the sealed `show -json` of a plan lives (private).
pub async fn set_plan_json_key(tx: &mut Tx, id: RunId, key: &str) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET plan_json_object_key = $2 WHERE id = $1",
        id.as_uuid(),
        key
    )
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Records the dry-run scan's report on a plan Run (audit evidence).
pub async fn set_scan_report<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
    report: &serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET scan_report = $2 WHERE id = $1",
        id.as_uuid(),
        report
    )
    .execute(executor)
    .await?;
    Ok(())
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
