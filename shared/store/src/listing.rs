//! Listings for people and the CLI: the Workspaces a token can see and a Workspace's
//! Capsules, oldest first.

use takosumi_core::{CapsuleId, RunId, StateVersionId, Tool, WorkspaceId};

use crate::StoreError;
use crate::capsules::Capsule;
use crate::workspaces::Workspace;

/// Every Workspace, or only `scope` (a token limited to one Workspace sees only it).
pub async fn workspaces(
    pool: &sqlx::PgPool,
    scope: Option<WorkspaceId>,
) -> Result<Vec<Workspace>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id, name, created_at FROM workspaces WHERE $1::uuid IS NULL OR id = $1 ORDER BY created_at, id",
        scope.map(|s| s.as_uuid())
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Workspace {
            id: WorkspaceId::from_uuid(r.id),
            name: r.name,
            created_at: r.created_at,
        })
        .collect())
}

/// The Capsules of a Workspace.
pub async fn capsules(pool: &sqlx::PgPool, ws: WorkspaceId) -> Result<Vec<Capsule>, StoreError> {
    Ok(sqlx::query_as!(
        Capsule,
        r#"SELECT id as "id: CapsuleId", workspace_id as "workspace_id: WorkspaceId", name, repo,
                  branch, dir, tool as "tool: Tool", vars, state_generation,
                  current_state_version_id as "current_state_version_id: StateVersionId",
                  running_apply_id as "running_apply_id: RunId", stale, sensitive_var_names,
                  created_at
             FROM capsules WHERE workspace_id = $1 ORDER BY created_at, id"#,
        ws.as_uuid()
    )
    .fetch_all(pool)
    .await?)
}
