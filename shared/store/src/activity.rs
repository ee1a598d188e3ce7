//! The Workspace's activity record.

use chrono::{DateTime, Utc};
use takosumi_core::{ActivityKind, WorkspaceId};

use crate::StoreError;

/// Appends an activity entry.
pub async fn append<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
    kind: ActivityKind,
    subject: &str,
    actor: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query!(
        "INSERT INTO activity (workspace_id, kind, subject, actor, data) VALUES ($1, $2, $3, $4, $5)",
        workspace_id.as_uuid(),
        kind as ActivityKind,
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
    kind: ActivityKind,
    subject: &str,
    actor: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query!(
        "INSERT INTO activity (workspace_id, kind, subject, actor, data) VALUES (NULL, $1, $2, $3, $4)",
        kind as ActivityKind,
        subject,
        actor,
        data
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// One activity entry.
#[derive(Debug, Clone)]
pub struct ActivityEntry {
    /// Order within the instance (the cursor).
    pub id: i64,
    /// What it records.
    pub kind: ActivityKind,
    /// The id it is about.
    pub subject: String,
    /// Who did it.
    pub actor: String,
    /// Details (never secret values).
    pub data: serde_json::Value,
    /// When.
    pub at: DateTime<Utc>,
}

/// One page of a Workspace's activity, newest first, starting below `before_id`.
pub async fn list(
    pool: &crate::Pool,
    workspace_id: WorkspaceId,
    kind: Option<ActivityKind>,
    before_id: Option<i64>,
    limit: i64,
) -> Result<(Vec<ActivityEntry>, Option<i64>), StoreError> {
    let mut rows = sqlx::query_as!(
        ActivityEntry,
        r#"SELECT id, kind AS "kind: ActivityKind", subject, actor, data, at FROM activity
            WHERE workspace_id = $1
              AND ($2::text IS NULL OR kind = $2)
              AND ($3::bigint IS NULL OR id < $3)
            ORDER BY id DESC
            LIMIT $4"#,
        workspace_id.as_uuid(),
        kind as Option<ActivityKind>,
        before_id,
        limit + 1
    )
    .fetch_all(pool)
    .await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(usize::try_from(limit).unwrap_or(0));
    let next = if more {
        rows.last().map(|r| r.id)
    } else {
        None
    };
    Ok((rows, next))
}
