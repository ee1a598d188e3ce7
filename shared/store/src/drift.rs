//! Drift: the intervals drift checks are swept at, the sweep that enqueues due ones, what
//! the latest checks found, and the plans earlier checks kept. Read-only towards
//! infrastructure: nothing here starts an apply.

use takosumi_core::{CapsuleId, RunId, WorkspaceId};

use crate::{StoreError, Tx};

/// Sets the drift-check interval of a Capsule (`None`: use the Workspace's).
pub async fn set_capsule_drift_interval(
    tx: &mut Tx,
    id: CapsuleId,
    secs: Option<i32>,
) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE capsules SET drift_interval_secs = $2 WHERE id = $1",
        id.as_uuid(),
        secs
    )
    .execute(tx.db())
    .await?;
    Ok(())
}

/// Sets the default drift-check interval of a Workspace's Capsules.
pub async fn set_workspace_drift_interval(
    tx: &mut Tx,
    id: WorkspaceId,
    secs: Option<i32>,
) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE workspaces SET drift_interval_secs = $2 WHERE id = $1",
        id.as_uuid(),
        secs
    )
    .execute(tx.db())
    .await?;
    Ok(())
}

/// Enqueues a drift check for up to `limit` due Capsules after `after` and up to `until`
/// (in id order; `None`: from the first, to the last) in one statement: due means an
/// interval is set (the Capsule's, else its Workspace's), it has passed since the last
/// sweep enqueued one, no check of the Capsule is queued or running, and something was
/// applied to check against (it has a drift baseline). Returns how many were enqueued and
/// the last Capsule taken, where the next batch starts. Read-only towards infrastructure:
/// it only creates drift-check Runs.
///
/// Batches walk the Capsules' primary key, so a pass over n Capsules reads each once:
/// ordered by anything else, every batch sorted every due Capsule again and the pass grew
/// with n² (20,000 Capsules took 50 s).
pub async fn sweep_due(
    tx: &mut Tx,
    after: Option<CapsuleId>,
    until: Option<CapsuleId>,
    limit: i64,
) -> Result<(i64, Option<CapsuleId>), StoreError> {
    // The new rows take the column's default status, which is where the lifecycle starts.
    const _: () = assert!(matches!(
        takosumi_core::RunStatus::INITIAL,
        takosumi_core::RunStatus::Queued
    ));
    let row = sqlx::query!(
        r#"WITH due AS (
               SELECT c.id
                 FROM capsules c JOIN workspaces w ON w.id = c.workspace_id
                -- `COALESCE` rather than `$1 IS NULL OR …`: the statement's generic plan
                -- can then start both index scans at the batch's first key
                WHERE c.id > COALESCE($1::uuid, '00000000-0000-0000-0000-000000000000')
                  AND c.id <= COALESCE($3::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff')
                  AND COALESCE(c.drift_interval_secs, w.drift_interval_secs) IS NOT NULL
                  AND (c.last_drift_enqueued_at IS NULL
                       OR c.last_drift_enqueued_at
                          < now() - make_interval(secs => COALESCE(c.drift_interval_secs, w.drift_interval_secs)))
                  -- `r.capsule_id > $1` repeats `c.id > $1` so the open-check index is
                  -- read from where the batch starts, not from its beginning
                  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.capsule_id = c.id AND r.kind = 'drift_check'
                                     AND r.status IN ('queued', 'held', 'planning')
                                     AND r.capsule_id > COALESCE($1::uuid, '00000000-0000-0000-0000-000000000000')
                                     AND r.capsule_id <= COALESCE($3::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                  -- only what was applied can drift
                  AND c.drift_baseline_run_id IS NOT NULL
                ORDER BY c.id
                LIMIT $2
                  FOR UPDATE OF c SKIP LOCKED),
           marked AS (
               -- `= ANY (ARRAY(…))` looks the batch up by key; a join with `due` was
               -- planned as a hash join over every Capsule, once per batch
               UPDATE capsules SET last_drift_enqueued_at = now()
                WHERE id = ANY (ARRAY(SELECT id FROM due))
               RETURNING id, workspace_id, pool_id),
           new_runs AS (
               INSERT INTO runs (id, kind, workspace_id, capsule_id, actor_kind, actor_id, traceparent)
               -- time-ordered, as every Run id (`uuid_v7`, migration 20261210000000)
               SELECT uuid_v7(), 'drift_check', workspace_id, id, 'system', 'sweep',
                      -- a trace of its own per check (W3C: 32 + 16 lower-case hex digits)
                      '00-' || md5(random()::text) || '-' || substr(md5(random()::text), 1, 16) || '-01'
                 FROM marked
               RETURNING id, traceparent, capsule_id),
           queued AS (
               INSERT INTO run_events (run_id, kind, actor, data)
               SELECT id, 'queued', 'system:sweep', '{"kind": "drift_check"}'::jsonb FROM new_runs),
           wake AS (
               -- a pool's Capsule wakes the pool's queue (`wake_topic`)
               INSERT INTO outbox (topic, payload, traceparent)
               SELECT wake_topic('run.drift', p.name),
                      jsonb_build_object('runId', 'run_' || replace(n.id::text, '-', '')), n.traceparent
                 FROM new_runs n
                 JOIN marked m ON m.id = n.capsule_id
                 LEFT JOIN worker_pools p ON p.id = m.pool_id)
           SELECT (SELECT count(*) FROM new_runs) as "n!",
                  (SELECT id FROM marked ORDER BY id DESC LIMIT 1) as "last: CapsuleId""#,
        after.map(|c| c.as_uuid()),
        limit,
        until.map(|c| c.as_uuid())
    )
    .fetch_one(tx.db())
    .await?;
    Ok((row.n, row.last))
}

/// Splits the Capsules' ids into `parts` ranges of about as many Capsules each, for
/// sweeps that walk them side by side: the `parts - 1` ids that end all but the last range
/// (each range is `(previous end, end]`). Fewer when there are fewer Capsules than parts.
/// Reads the primary key only (an index-only scan), not the Capsules.
pub async fn sweep_bounds(pool: &crate::Pool, parts: i64) -> Result<Vec<CapsuleId>, StoreError> {
    let rows = sqlx::query!(
        r#"WITH total AS (SELECT count(*) AS n FROM capsules)
           SELECT (SELECT id FROM capsules ORDER BY id OFFSET (total.n * g / $1::bigint) - 1 LIMIT 1) AS "id: CapsuleId"
             FROM total, generate_series(1, $1::bigint - 1) g
            WHERE total.n * g / $1::bigint > 0
            ORDER BY g"#,
        parts
    )
    .fetch_all(pool)
    .await?;
    let mut bounds: Vec<CapsuleId> = rows.into_iter().filter_map(|r| r.id).collect();
    bounds.dedup();
    Ok(bounds)
}

/// A Capsule whose latest finished drift check found drift.
#[derive(Debug, Clone)]
pub struct DriftedCapsule {
    /// The Capsule.
    pub capsule_id: CapsuleId,
    /// Its latest finished drift check.
    pub run_id: RunId,
    /// The check's change counts (`{add, change, destroy}`).
    pub changes: Option<serde_json::Value>,
    /// The check's resource-change summary from `show -json` (see
    /// `takosumi_cost::PlanResources`): what the Workspace view rolls up by.
    pub resource_changes: Option<serde_json::Value>,
}

/// The latest finished drift check of each Capsule of a Workspace that found drift,
/// oldest Capsule first.
pub async fn drifted_capsules(
    pool: &crate::Pool,
    ws: WorkspaceId,
) -> Result<Vec<DriftedCapsule>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT DISTINCT ON (capsule_id) capsule_id, id, drift, changes, resource_changes
             FROM runs WHERE workspace_id = $1 AND kind = 'drift_check' AND status = 'planned'
            ORDER BY capsule_id, created_at DESC"#,
        ws.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter(|r| r.drift == Some(true))
        .map(|r| DriftedCapsule {
            capsule_id: CapsuleId::from_uuid(r.capsule_id),
            run_id: RunId::from_uuid(r.id),
            changes: r.changes,
            resource_changes: r.resource_changes,
        })
        .collect())
}

/// Drops the plans earlier drift checks of a Capsule kept; returns their object keys so
/// the caller can delete them once the transaction commits.
pub async fn drop_kept_drift_plans(
    tx: &mut Tx,
    capsule_id: CapsuleId,
    except: RunId,
) -> Result<Vec<String>, StoreError> {
    let rows = sqlx::query!(
        r#"WITH kept AS (
               SELECT id, plan_object_key FROM runs
                WHERE capsule_id = $1 AND kind = 'drift_check' AND id <> $2 AND plan_object_key IS NOT NULL
                FOR UPDATE)
           UPDATE runs SET plan_object_key = NULL, updated_at = now()
             FROM kept WHERE runs.id = kept.id
           RETURNING kept.plan_object_key as "key""#,
        capsule_id.as_uuid(),
        except.as_uuid()
    )
    .fetch_all(tx.db())
    .await?;
    Ok(rows.into_iter().filter_map(|r| r.key).collect())
}
