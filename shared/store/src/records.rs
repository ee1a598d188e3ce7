//! The Run record beyond the pipeline's own transitions: cancellation (at once for a Run
//! no step holds, by request for a running one), the resource-change summary a plan keeps
//! for cost estimates, the operator's resolution of an `unknown_outcome` apply, and the
//! Workspace's history (Runs newest first, activity) with keyset pagination.
//!
//! Every change here is a conditional `UPDATE`: zero rows means the Run moved on, and the
//! caller reads it again to say why.

use chrono::{DateTime, Utc};
use takosumi_core::{CapsuleId, RunId, RunKind, RunStatus, WorkspaceId};

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
    .fetch_optional(&mut **tx)
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
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Whether a cancel was requested for a Run this `owner` still holds. Polled by the lease
/// keeper: cheap (primary key).
pub async fn cancel_requested(
    pool: &sqlx::PgPool,
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
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(|r| Canceled {
        by: r.canceled_by.unwrap_or_default(),
        workspace_id: WorkspaceId::from_uuid(r.workspace_id),
    }))
}

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

/// Records an operator's resolution of an `unknown_outcome` Run, once. `false`: the Run is
/// not `unknown_outcome`, or it was already resolved.
pub async fn resolve_unknown(
    tx: &mut Tx,
    id: RunId,
    action: &str,
    by: &str,
    note: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET resolution_action = $2, resolved_by = $3, resolution_note = $4,
                  resolved_at = now(), updated_at = now()
            WHERE id = $1 AND status = 'unknown_outcome' AND resolved_at IS NULL"#,
        id.as_uuid(),
        action,
        by,
        note
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Filters of a Workspace's Run history.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    /// Only this Capsule's Runs.
    pub capsule_id: Option<CapsuleId>,
    /// Only this kind.
    pub kind: Option<RunKind>,
    /// Only this status.
    pub status: Option<RunStatus>,
}

/// Where a page of a newest-first listing starts: after `(created_at, id)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunCursor {
    /// The last listed Run's creation time.
    pub created_at: DateTime<Utc>,
    /// The last listed Run's id (ties on time are broken by id).
    pub id: RunId,
}

/// One page of Run ids, newest first, and the cursor of the last one when more may follow.
///
/// Each filter shape has its own statement, read from the index in its order (a Capsule's
/// history, a status, a kind, or the whole Workspace): one statement with every filter
/// optional gets one generic plan, which walks the Workspace's index and discards what
/// does not match, so a rare status read every Run the Workspace has. The cursor is
/// compared with `COALESCE`d bounds for the same reason: it stays an index condition.
pub async fn list_runs(
    pool: &sqlx::PgPool,
    workspace_id: WorkspaceId,
    filter: &RunFilter,
    after: Option<RunCursor>,
    limit: i64,
) -> Result<(Vec<RunId>, Option<RunCursor>), StoreError> {
    let ws = workspace_id.as_uuid();
    let capsule = filter.capsule_id.map(|c| c.as_uuid());
    let kind = filter.kind;
    let status = filter.status;
    let at = after.map(|c| c.created_at);
    let id = after.map(|c| c.id.as_uuid());
    let fetch = limit + 1;
    macro_rules! page {
        ($q:expr) => {
            $q.fetch_all(pool)
                .await?
                .into_iter()
                .map(|r| (r.id, r.created_at))
                .collect::<Vec<_>>()
        };
    }
    let rows = match (capsule, status, kind) {
        (Some(capsule), _, _) => page!(sqlx::query!(
            r#"SELECT id, created_at FROM runs
                WHERE capsule_id = $2 AND workspace_id = $1
                  AND ($3::run_kind IS NULL OR kind = $3)
                  AND ($4::run_status IS NULL OR status = $4)
                  AND (created_at, id) < (COALESCE($5, 'infinity'::timestamptz),
                                          COALESCE($6, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $7"#,
            ws,
            capsule,
            kind as Option<RunKind>,
            status as Option<RunStatus>,
            at,
            id,
            fetch
        )),
        (None, Some(status), _) => page!(sqlx::query!(
            r#"SELECT id, created_at FROM runs
                WHERE workspace_id = $1 AND status = $2
                  AND ($3::run_kind IS NULL OR kind = $3)
                  AND (created_at, id) < (COALESCE($4, 'infinity'::timestamptz),
                                          COALESCE($5, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $6"#,
            ws,
            status as RunStatus,
            kind as Option<RunKind>,
            at,
            id,
            fetch
        )),
        (None, None, Some(kind)) => page!(sqlx::query!(
            r#"SELECT id, created_at FROM runs
                WHERE workspace_id = $1 AND kind = $2
                  AND (created_at, id) < (COALESCE($3, 'infinity'::timestamptz),
                                          COALESCE($4, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $5"#,
            ws,
            kind as RunKind,
            at,
            id,
            fetch
        )),
        (None, None, None) => page!(sqlx::query!(
            r#"SELECT id, created_at FROM runs
                WHERE workspace_id = $1
                  AND (created_at, id) < (COALESCE($2, 'infinity'::timestamptz),
                                          COALESCE($3, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $4"#,
            ws,
            at,
            id,
            fetch
        )),
    };
    let more = rows.len() as i64 > limit;
    let page: Vec<_> = rows
        .into_iter()
        .take(usize::try_from(limit).unwrap_or(0))
        .collect();
    let next = if more {
        page.last().map(|(id, created_at)| RunCursor {
            created_at: *created_at,
            id: RunId::from_uuid(*id),
        })
    } else {
        None
    };
    Ok((
        page.into_iter()
            .map(|(id, _)| RunId::from_uuid(id))
            .collect(),
        next,
    ))
}

/// The Workspace's `unknown_outcome` Runs no operator has resolved yet.
pub async fn count_unresolved_unknown(
    pool: &sqlx::PgPool,
    workspace_id: WorkspaceId,
) -> Result<i64, StoreError> {
    let row = sqlx::query!(
        r#"SELECT count(*) as "n!" FROM runs
            WHERE workspace_id = $1 AND status = 'unknown_outcome' AND resolved_at IS NULL"#,
        workspace_id.as_uuid()
    )
    .fetch_one(pool)
    .await?;
    Ok(row.n)
}

/// One activity entry.
#[derive(Debug, Clone)]
pub struct ActivityEntry {
    /// Order within the instance (the cursor).
    pub id: i64,
    /// `capsule_registered`, `run_started`, `state_version_written`, …
    pub kind: String,
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
pub async fn list_activity(
    pool: &sqlx::PgPool,
    workspace_id: WorkspaceId,
    kind: Option<&str>,
    before_id: Option<i64>,
    limit: i64,
) -> Result<(Vec<ActivityEntry>, Option<i64>), StoreError> {
    let mut rows = sqlx::query_as!(
        ActivityEntry,
        r#"SELECT id, kind, subject, actor, data, at FROM activity
            WHERE workspace_id = $1
              AND ($2::text IS NULL OR kind = $2)
              AND ($3::bigint IS NULL OR id < $3)
            ORDER BY id DESC
            LIMIT $4"#,
        workspace_id.as_uuid(),
        kind,
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
