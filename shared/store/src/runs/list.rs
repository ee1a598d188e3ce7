//! A Workspace's Run history for people and the CLI: Runs newest first with keyset
//! pagination, and the count of `unknown_outcome` applies nobody has resolved.

use chrono::{DateTime, Utc};
use takosumi_core::{CapsuleId, RunId, RunKind, RunStatus, WorkspaceId};

use super::{Run, select_runs};
use crate::StoreError;

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

/// One page of Runs, newest first, read whole from the index scan that finds them (no
/// second lookup by id), and the cursor of the last one when more may follow.
///
/// Each filter shape has its own statement, read from the index in its order (a Capsule's
/// history, a status, a kind, or the whole Workspace): one statement with every filter
/// optional gets one generic plan, which walks the Workspace's index and discards what
/// does not match, so a rare status read every Run the Workspace has. The cursor is
/// compared with `COALESCE`d bounds for the same reason: it stays an index condition.
pub async fn list_runs<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
    filter: &RunFilter,
    after: Option<RunCursor>,
    limit: i64,
) -> Result<(Vec<Run>, Option<RunCursor>), StoreError> {
    let ws = workspace_id.as_uuid();
    let capsule = filter.capsule_id.map(|c| c.as_uuid());
    let kind = filter.kind;
    let status = filter.status;
    let at = after.map(|c| c.created_at);
    let id = after.map(|c| c.id.as_uuid());
    let fetch = limit + 1;
    macro_rules! page {
        ($q:expr) => {
            $q.fetch_all(executor).await?
        };
    }
    let mut page = match (capsule, status, kind) {
        (Some(capsule), _, _) => page!(select_runs!(
            "WHERE capsule_id = $2 AND workspace_id = $1
                  AND ($3::run_kind IS NULL OR kind = $3)
                  AND ($4::run_status IS NULL OR status = $4)
                  AND (created_at, id) < (COALESCE($5, 'infinity'::timestamptz),
                                          COALESCE($6, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $7",
            ws,
            capsule,
            kind as Option<RunKind>,
            status as Option<RunStatus>,
            at,
            id,
            fetch
        )),
        (None, Some(status), _) => page!(select_runs!(
            "WHERE workspace_id = $1 AND status = $2
                  AND ($3::run_kind IS NULL OR kind = $3)
                  AND (created_at, id) < (COALESCE($4, 'infinity'::timestamptz),
                                          COALESCE($5, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $6",
            ws,
            status as RunStatus,
            kind as Option<RunKind>,
            at,
            id,
            fetch
        )),
        (None, None, Some(kind)) => page!(select_runs!(
            "WHERE workspace_id = $1 AND kind = $2
                  AND (created_at, id) < (COALESCE($3, 'infinity'::timestamptz),
                                          COALESCE($4, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $5",
            ws,
            kind as RunKind,
            at,
            id,
            fetch
        )),
        (None, None, None) => page!(select_runs!(
            "WHERE workspace_id = $1
                  AND (created_at, id) < (COALESCE($2, 'infinity'::timestamptz),
                                          COALESCE($3, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid))
                ORDER BY created_at DESC, id DESC
                LIMIT $4",
            ws,
            at,
            id,
            fetch
        )),
    };
    let more = page.len() as i64 > limit;
    page.truncate(usize::try_from(limit).unwrap_or(0));
    let next = if more {
        page.last().map(|run| RunCursor {
            created_at: run.created_at,
            id: run.id,
        })
    } else {
        None
    };
    Ok((page, next))
}

/// The Workspace's `unknown_outcome` Runs no operator has resolved yet.
pub async fn count_unresolved_unknown<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
) -> Result<i64, StoreError> {
    let row = sqlx::query!(
        r#"SELECT count(*) as "n!" FROM runs
            WHERE workspace_id = $1 AND status = 'unknown_outcome' AND resolved_at IS NULL"#,
        workspace_id.as_uuid()
    )
    .fetch_one(executor)
    .await?;
    Ok(row.n)
}
