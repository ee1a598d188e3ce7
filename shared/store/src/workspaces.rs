//! Workspaces: named groups of Capsules.

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
    .fetch_one(&mut **tx)
    .await?;
    Ok(Workspace {
        id,
        name: name.to_owned(),
        created_at: row.created_at,
    })
}

/// Reads a Workspace.
pub async fn get(pool: &sqlx::PgPool, id: WorkspaceId) -> Result<Option<Workspace>, StoreError> {
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
