//! Workspaces: named groups of Capsules. A Workspace is never deleted: the API remembers
//! the ones it has seen exist (`takosumi_api`'s `known_workspaces`), so a way to delete one
//! must come with a way to make every API process forget it.

use chrono::{DateTime, Utc};
use takosumi_core::WorkspaceId;

use crate::{StoreError, Tx};

/// A Workspace row.
#[derive(Debug, Clone)]
pub struct Workspace {
    /// Its id.
    pub id: WorkspaceId,
    /// Its unique name.
    pub name: String,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

/// Inserts a Workspace.
pub async fn create(tx: &mut Tx, name: &str) -> Result<Workspace, StoreError> {
    let id = WorkspaceId::new();
    let row = sqlx::query!(
        "INSERT INTO workspaces (id, name) VALUES ($1, $2) RETURNING created_at",
        id.as_uuid(),
        name
    )
    .fetch_one(tx.db())
    .await?;
    Ok(Workspace {
        id,
        name: name.to_owned(),
        created_at: row.created_at,
    })
}

/// Reads a Workspace.
pub async fn get(pool: &crate::Pool, id: WorkspaceId) -> Result<Option<Workspace>, StoreError> {
    let row = sqlx::query!(
        "SELECT id, name, created_at FROM workspaces WHERE id = $1",
        id.as_uuid()
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| Workspace {
        id: WorkspaceId::from_uuid(r.id),
        name: r.name,
        created_at: r.created_at,
    }))
}

/// Every Workspace, or only `scope` (a token limited to one Workspace sees only it).
pub async fn list(
    pool: &crate::Pool,
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

/// A resource a request path names whose row the handler reads itself, for finding the
/// Workspace it belongs to (the API's access check, made before any handler runs; a
/// Workspace, Capsule or Run the check reads whole, for the handler to use).
#[derive(Debug, Clone, Copy)]
pub enum Owned<'a> {
    /// A RunGroup.
    RunGroup(takosumi_core::RunGroupId),
    /// A worker pool, by name.
    Pool(&'a str),
}

/// The Workspace `what` belongs to; `None` when it does not exist.
pub async fn owner_of(
    pool: &crate::Pool,
    what: Owned<'_>,
) -> Result<Option<WorkspaceId>, StoreError> {
    let id = match what {
        Owned::RunGroup(id) => {
            sqlx::query_scalar!(
                "SELECT workspace_id FROM run_groups WHERE id = $1",
                id.as_uuid()
            )
            .fetch_optional(pool)
            .await?
        }
        // Postgres text cannot hold NUL: no pool has such a name.
        Owned::Pool(name) if name.contains('\0') => None,
        Owned::Pool(name) => {
            sqlx::query_scalar!(
                "SELECT workspace_id FROM worker_pools WHERE name = $1",
                name
            )
            .fetch_optional(pool)
            .await?
        }
    };
    Ok(id.map(WorkspaceId::from_uuid))
}
