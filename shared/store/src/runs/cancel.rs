//! Cancellation of a Run: at once for a Run no step holds, by request for a running one
//! (the handler holding it notices, interrupts the tool and ends it).
//!
//! Every change here is a conditional `UPDATE`: zero rows means the Run moved on, and the
//! caller reads it again to say why.

use takosumi_core::{RunId, RunStatus, WorkspaceId};

use crate::{StoreError, Tx};

/// Ends a `queued` or `held` Run `canceled` at once, recording who and when. Returns the
/// status it had, or `None` when it was in no such status (running, or finished).
pub async fn cancel_waiting(
    tx: &mut Tx,
    id: RunId,
    by: &str,
) -> Result<Option<RunStatus>, StoreError> {
    crate::transitions!(Queued => Canceled, Held => Canceled);
    let row = sqlx::query!(
        r#"UPDATE runs r SET status = 'canceled', canceled_by = $2, canceled_at = now(),
                  updated_at = now(), finished_at = now()
             FROM (SELECT id, status FROM runs WHERE id = $1 FOR UPDATE) old
            WHERE r.id = old.id AND r.status IN ('queued', 'held')
        RETURNING old.status as "old: RunStatus""#,
        id.as_uuid(),
        by
    )
    .fetch_optional(tx.db())
    .await?;
    debug_assert!(
        row.as_ref()
            .is_none_or(|r| r.old.can_become(RunStatus::Canceled)),
        "canceled a Run from a status the Run lifecycle cannot cancel"
    );
    Ok(row.map(|r| r.old))
}

/// Records a cancel request on a running (`planning`/`applying`) Run; the handler holding
/// it notices, interrupts the tool and ends it. Returns `true` when this call recorded it,
/// `false` when the Run is not running or a request is already recorded.
pub async fn request_cancel(tx: &mut Tx, id: RunId, by: &str) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET cancel_requested_at = now(), cancel_requested_by = $2, updated_at = now()
            WHERE id = $1 AND status IN ('planning', 'applying') AND cancel_requested_at IS NULL"#,
        id.as_uuid(),
        by
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Whether a cancel was requested for a Run this `owner` still holds. Polled by the lease
/// keeper: cheap (primary key).
pub async fn cancel_requested(
    pool: &crate::Pool,
    id: RunId,
    owner: &str,
) -> Result<bool, StoreError> {
    let row = sqlx::query!(
        r#"SELECT (cancel_requested_at IS NOT NULL) as "requested!" FROM runs
            WHERE id = $1 AND lease_owner = $2 AND status IN ('planning', 'applying')"#,
        id.as_uuid(),
        owner
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.is_some_and(|r| r.requested))
}

/// Who canceled a running Run, once its handler ended it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Canceled {
    /// Who asked for the cancel.
    pub by: String,
    /// The Run's Workspace (for the activity record).
    pub workspace_id: WorkspaceId,
}

/// Ends a running Run `canceled`, only for the lease holder and only when a cancel was
/// requested; `canceled_by` takes the request's. `None`: the Run was not this holder's to
/// end (lease lost, or no cancel requested).
pub async fn cancel_claimed(
    tx: &mut Tx,
    id: RunId,
    owner: &str,
) -> Result<Option<Canceled>, StoreError> {
    crate::transitions!(Planning => Canceled, Applying => Canceled);
    let row = sqlx::query!(
        r#"UPDATE runs SET status = 'canceled', canceled_by = cancel_requested_by, canceled_at = now(),
                  lease_owner = NULL, lease_until = NULL, updated_at = now(), finished_at = now()
            WHERE id = $1 AND lease_owner = $2 AND status IN ('planning', 'applying')
              AND cancel_requested_at IS NOT NULL
        RETURNING canceled_by, workspace_id"#,
        id.as_uuid(),
        owner
    )
    .fetch_optional(tx.db())
    .await?;
    Ok(row.map(|r| Canceled {
        by: r.canceled_by.unwrap_or_default(),
        workspace_id: WorkspaceId::from_uuid(r.workspace_id),
    }))
}
