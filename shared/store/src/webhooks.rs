//! What the push and pull-request webhooks read and write: a Workspace's sealed webhook
//! secret, the deliveries already processed (so a replay changes nothing), and the
//! Capsules a push to a branch may concern. Nothing here starts an apply.

use takosumi_core::{CapsuleId, WorkspaceId};

use crate::{StoreError, Tx};

/// Stores a Workspace's sealed webhook secret.
pub async fn set_webhook_secret(
    tx: &mut Tx,
    ws: WorkspaceId,
    sealed: &[u8],
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "UPDATE workspaces SET webhook_secret_sealed = $2 WHERE id = $1",
        ws.as_uuid(),
        sealed
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A Workspace's sealed webhook secret.
pub async fn webhook_secret(
    pool: &crate::Pool,
    ws: WorkspaceId,
) -> Result<Option<Vec<u8>>, StoreError> {
    let row = sqlx::query!(
        "SELECT webhook_secret_sealed FROM workspaces WHERE id = $1",
        ws.as_uuid()
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.and_then(|r| r.webhook_secret_sealed))
}

/// How long a webhook delivery id is remembered: a replay within this window changes
/// nothing. GitHub lets a person redeliver a delivery of the last three days and GitLab
/// retries within hours, so a week covers both with room to spare.
pub const DELIVERY_RETENTION_DAYS: i32 = 7;

/// Records that `ws` processed the delivery `delivery_id`, in the transaction that carries
/// the delivery's effect; `false` when the id was recorded before (a replay: the caller
/// rolls back and answers that it was a duplicate). A concurrent delivery of the same id
/// waits on the first one's transaction and then finds it, or inserts if it rolled back.
/// Also prunes up to 100 ids older than [`DELIVERY_RETENTION_DAYS`] (any Workspace's; rows
/// another transaction is pruning are skipped, never waited for), so the table stays
/// about a week of deliveries without a timer.
pub async fn record_delivery(
    tx: &mut Tx,
    ws: WorkspaceId,
    delivery_id: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "INSERT INTO webhook_deliveries (workspace_id, delivery_id) VALUES ($1, $2)
         ON CONFLICT (workspace_id, delivery_id) DO NOTHING",
        ws.as_uuid(),
        delivery_id
    )
    .execute(tx.db())
    .await?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query!(
        "DELETE FROM webhook_deliveries WHERE (workspace_id, delivery_id) IN (
             SELECT workspace_id, delivery_id FROM webhook_deliveries
              WHERE received_at < now() - make_interval(days => $1)
              ORDER BY received_at LIMIT 100 FOR UPDATE SKIP LOCKED)",
        DELIVERY_RETENTION_DAYS
    )
    .execute(tx.db())
    .await?;
    Ok(true)
}

/// A Capsule a push may concern.
#[derive(Debug, Clone)]
pub struct PushTarget {
    /// The Capsule.
    pub id: CapsuleId,
    /// Its repository URL.
    pub repo: String,
    /// Automatic update enabled.
    pub auto_update: bool,
    /// Who enabled it.
    pub auto_update_by: Option<String>,
}

/// Capsules of a Workspace on `branch` (the caller matches repository URLs).
pub async fn capsules_on_branch(
    pool: &crate::Pool,
    ws: WorkspaceId,
    branch: &str,
) -> Result<Vec<PushTarget>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id, repo, auto_update, auto_update_by FROM capsules WHERE workspace_id = $1 AND branch = $2 ORDER BY created_at",
        ws.as_uuid(),
        branch
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| PushTarget {
            id: CapsuleId::from_uuid(r.id),
            repo: r.repo,
            auto_update: r.auto_update,
            auto_update_by: r.auto_update_by,
        })
        .collect())
}
