//! Listings for people and the CLI: the Workspaces a token can see and a Workspace's
//! Capsules, oldest first.

use takosumi_core::{CapsuleId, RunId, StateVersionId, WorkspaceId};

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
    let rows = sqlx::query!(
        r#"SELECT id, workspace_id, name, repo, branch, dir, tool, vars, state_generation,
                  current_state_version_id, running_apply_id, stale, created_at
             FROM capsules WHERE workspace_id = $1 ORDER BY created_at, id"#,
        ws.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Capsule {
            id: CapsuleId::from_uuid(r.id),
            workspace_id: WorkspaceId::from_uuid(r.workspace_id),
            name: r.name,
            repo: r.repo,
            branch: r.branch,
            dir: r.dir,
            tool: r.tool,
            vars: r.vars,
            state_generation: r.state_generation,
            current_state_version_id: r.current_state_version_id.map(StateVersionId::from_uuid),
            running_apply_id: r.running_apply_id.map(RunId::from_uuid),
            stale: r.stale,
            created_at: r.created_at,
        })
        .collect())
}
