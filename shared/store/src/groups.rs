//! RunGroups: the Runs one request started over a Workspace's Capsules (`plan_update`,
//! `drift_check`).

use chrono::{DateTime, Utc};
use takosumi_core::{GroupKind, RunGroupId, RunId, WorkspaceId};

use crate::{StoreError, Tx};

/// Creates a RunGroup.
pub async fn create_group(
    tx: &mut Tx,
    ws: WorkspaceId,
    kind: GroupKind,
    by: &str,
) -> Result<RunGroupId, StoreError> {
    let id = RunGroupId::new();
    sqlx::query!(
        "INSERT INTO run_groups (id, workspace_id, kind, created_by) VALUES ($1, $2, $3, $4)",
        id.as_uuid(),
        ws.as_uuid(),
        kind as GroupKind,
        by
    )
    .execute(tx.db())
    .await?;
    Ok(id)
}

/// A RunGroup row.
#[derive(Debug, Clone)]
pub struct RunGroup {
    /// Its id.
    pub id: RunGroupId,
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// What it started.
    pub kind: GroupKind,
    /// Who started it.
    pub created_by: String,
    /// When.
    pub created_at: DateTime<Utc>,
}

/// Reads a RunGroup.
pub async fn group(pool: &crate::Pool, id: RunGroupId) -> Result<Option<RunGroup>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT id, workspace_id, kind AS "kind: GroupKind", created_by, created_at FROM run_groups WHERE id = $1"#,
        id.as_uuid()
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| RunGroup {
        id: RunGroupId::from_uuid(r.id),
        workspace_id: WorkspaceId::from_uuid(r.workspace_id),
        kind: r.kind,
        created_by: r.created_by,
        created_at: r.created_at,
    }))
}

/// The Runs of a group, oldest first.
pub async fn group_runs(pool: &crate::Pool, id: RunGroupId) -> Result<Vec<RunId>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id FROM runs WHERE run_group_id = $1 ORDER BY created_at, id",
        id.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| RunId::from_uuid(r.id)).collect())
}
