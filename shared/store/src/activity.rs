//! The Workspace's activity record.

use takosumi_core::WorkspaceId;

use crate::StoreError;

/// Appends an activity entry.
pub async fn append<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
    kind: &str,
    subject: &str,
    actor: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query!(
        "INSERT INTO activity (workspace_id, kind, subject, actor, data) VALUES ($1, $2, $3, $4, $5)",
        workspace_id.as_uuid(),
        kind,
        subject,
        actor,
        data
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// Appends an instance-wide activity entry (no Workspace: an instance-wide token made or
/// revoked).
pub async fn append_instance<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    kind: &str,
    subject: &str,
    actor: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query!(
        "INSERT INTO activity (workspace_id, kind, subject, actor, data) VALUES (NULL, $1, $2, $3, $4)",
        kind,
        subject,
        actor,
        data
    )
    .execute(executor)
    .await?;
    Ok(())
}
