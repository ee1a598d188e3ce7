//! Detection: webhook secrets, stale Capsules, automatic update, RunGroups, and where a
//! webhook-started plan must check out. Nothing here starts an apply.

use chrono::{DateTime, Utc};
use takosumi_core::{CapsuleId, RunGroupId, RunId, RunKind, WorkspaceId};

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
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A Workspace's sealed webhook secret.
pub async fn webhook_secret(
    pool: &sqlx::PgPool,
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
    .execute(&mut **tx)
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
    .execute(&mut **tx)
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
    pool: &sqlx::PgPool,
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

/// Marks Capsules stale with the pushed commit.
pub async fn mark_stale(tx: &mut Tx, ids: &[CapsuleId], commit: &str) -> Result<u64, StoreError> {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|c| c.as_uuid()).collect();
    let done = sqlx::query!(
        "UPDATE capsules SET stale = true, stale_commit = $2, updated_at = now() WHERE id = ANY($1)",
        &ids,
        commit
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected())
}

/// Turns automatic update on or off, recording on whose behalf it runs.
pub async fn set_auto_update(
    tx: &mut Tx,
    id: CapsuleId,
    on: bool,
    by: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "UPDATE capsules SET auto_update = $2, auto_update_by = CASE WHEN $2 THEN $3 ELSE NULL END, updated_at = now() WHERE id = $1",
        id.as_uuid(),
        on,
        by
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Creates a RunGroup.
pub async fn create_group(
    tx: &mut Tx,
    ws: WorkspaceId,
    kind: &str,
    by: &str,
) -> Result<RunGroupId, StoreError> {
    let id = RunGroupId::new();
    sqlx::query!(
        "INSERT INTO run_groups (id, workspace_id, kind, created_by) VALUES ($1, $2, $3, $4)",
        id.as_uuid(),
        ws.as_uuid(),
        kind,
        by
    )
    .execute(&mut **tx)
    .await?;
    Ok(id)
}

/// A RunGroup row.
#[derive(Debug, Clone)]
pub struct RunGroup {
    /// Its id.
    pub id: RunGroupId,
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// `plan_update` or `drift_check`.
    pub kind: String,
    /// Who started it.
    pub created_by: String,
    /// When.
    pub created_at: DateTime<Utc>,
}

/// Reads a RunGroup.
pub async fn group(pool: &sqlx::PgPool, id: RunGroupId) -> Result<Option<RunGroup>, StoreError> {
    let row = sqlx::query!(
        "SELECT id, workspace_id, kind, created_by, created_at FROM run_groups WHERE id = $1",
        id.as_uuid()
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| RunGroup {
        id: RunGroupId::from_uuid(r.id),
        workspace_id: WorkspaceId::from_uuid(r.workspace_id),
        kind: r.kind,
        created_by: r.created_by,
        created_at: r.created_at,
    }))
}

/// The Runs of a group, oldest first.
pub async fn group_runs(pool: &sqlx::PgPool, id: RunGroupId) -> Result<Vec<RunId>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id FROM runs WHERE run_group_id = $1 ORDER BY created_at, id",
        id.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| RunId::from_uuid(r.id)).collect())
}

/// The Capsules of a Workspace (only the stale ones when asked).
pub async fn workspace_capsules(
    pool: &sqlx::PgPool,
    ws: WorkspaceId,
    only_stale: bool,
) -> Result<Vec<CapsuleId>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id FROM capsules WHERE workspace_id = $1 AND (stale OR NOT $2) ORDER BY created_at, id",
        ws.as_uuid(),
        only_stale
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| CapsuleId::from_uuid(r.id))
        .collect())
}

/// Pins what a webhook-started plan checks out; a speculative plan can never be applied.
pub async fn set_run_source(
    tx: &mut Tx,
    id: RunId,
    source_ref: &str,
    commit: &str,
    speculative: bool,
) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET source_ref = $2, pinned_commit = $3, speculative = $4 WHERE id = $1",
        id.as_uuid(),
        source_ref,
        commit,
        speculative
    )
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// What a plan step checks out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSource {
    /// The branch (or pull request ref) to clone; `None`: the Capsule's branch.
    pub source_ref: Option<String>,
    /// The exact commit to plan, if pinned: a webhook's pushed commit, or — for a drift
    /// check — the commit of the Capsule's current StateVersion, read at claim time.
    pub pinned_commit: Option<String>,
    /// A pull request's plan: never applied.
    pub speculative: bool,
    /// A drift check with nothing applied to compare against (the Capsule has no
    /// StateVersion, or its last apply was a destroy): it must not plan the branch instead.
    pub no_baseline: bool,
    /// For a drift check: the Run whose variables produced the current StateVersion (the
    /// plan the last apply carried out, or a one-step apply itself). The check plans with
    /// exactly those, so a variable changed on the Capsule since is not reported as drift.
    pub baseline_run: Option<RunId>,
}

/// Why a drift check of a Capsule with no baseline does not plan (the Run's error, and the
/// API's 409 `not_applied`).
pub const NOT_APPLIED: &str = "nothing was applied to this Capsule (no StateVersion, or its last apply destroyed everything), so there is nothing to check drift against; plan and apply it first";

/// What the Capsule's current StateVersion was applied from: the commit of the plan the
/// apply carried out, and whether that plan destroyed everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedBaseline {
    /// The applied plan's commit.
    pub commit: String,
    /// The applied plan was a destroy plan: nothing the configuration declares is meant to
    /// exist, so there is nothing to drift from.
    pub destroyed: bool,
}

/// The baseline a drift check of `capsule` compares reality with; `None` when nothing was
/// ever applied (or the StateVersion records no commit).
pub async fn applied_baseline<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    capsule: CapsuleId,
) -> Result<Option<AppliedBaseline>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT a.source_commit as "commit?", p.kind as "plan_kind?: RunKind"
             FROM capsules c
             JOIN state_versions sv ON sv.id = c.current_state_version_id
             JOIN runs a ON a.id = sv.run_id
             LEFT JOIN runs p ON p.id = a.plan_run_id
            WHERE c.id = $1"#,
        capsule.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.and_then(|r| {
        r.commit.map(|commit| AppliedBaseline {
            commit,
            destroyed: r.plan_kind == Some(RunKind::Destroy),
        })
    }))
}

/// What a plan step must check out, and whether the plan is speculative. A drift check
/// plans the commit that was last applied, never the branch head: it reports what changed
/// outside Takosumi, and the plan it keeps brings reality back to what was applied.
pub async fn run_source(executor: &sqlx::PgPool, id: RunId) -> Result<RunSource, StoreError> {
    // One round trip: the Run's own pins and, for a drift check, the applied baseline
    // (the same join as `applied_baseline`).
    let row = sqlx::query!(
        r#"SELECT r.source_ref, r.pinned_commit, r.speculative, r.kind as "kind: RunKind",
                  a.source_commit as "applied_commit?", p.kind as "applied_plan_kind?: RunKind",
                  COALESCE(p.id, a.id) as "baseline_run?"
             FROM runs r
             JOIN capsules c ON c.id = r.capsule_id
             LEFT JOIN state_versions sv ON sv.id = c.current_state_version_id
             LEFT JOIN runs a ON a.id = sv.run_id
             LEFT JOIN runs p ON p.id = a.plan_run_id
            WHERE r.id = $1"#,
        id.as_uuid()
    )
    .fetch_one(executor)
    .await?;
    let mut source = RunSource {
        source_ref: row.source_ref,
        pinned_commit: row.pinned_commit,
        speculative: row.speculative,
        no_baseline: false,
        baseline_run: None,
    };
    if row.kind == RunKind::DriftCheck {
        match row.applied_commit {
            Some(commit) if row.applied_plan_kind != Some(RunKind::Destroy) => {
                source.pinned_commit = Some(commit);
                source.baseline_run = row.baseline_run.map(RunId::from_uuid);
            }
            _ => source.no_baseline = true,
        }
    }
    Ok(source)
}

/// Whether a Run is a pull request's speculative plan.
pub async fn speculative<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<bool, StoreError> {
    Ok(
        sqlx::query_scalar!("SELECT speculative FROM runs WHERE id = $1", id.as_uuid())
            .fetch_one(executor)
            .await?,
    )
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
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows.into_iter().filter_map(|r| r.key).collect())
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
    pool: &sqlx::PgPool,
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

/// Whether a Capsule's latest finished drift check found drift.
pub async fn capsule_drifted<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: CapsuleId,
) -> Result<Option<bool>, StoreError> {
    let row = sqlx::query!(
        "SELECT drift FROM runs WHERE capsule_id = $1 AND kind = 'drift_check' AND status = 'planned' ORDER BY created_at DESC LIMIT 1",
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.and_then(|r| r.drift))
}

/// Enqueues a drift check for up to `limit` due Capsules after `after` (in id order) in
/// one statement: due means an interval is set (the Capsule's, else its Workspace's), it
/// has passed since the last sweep enqueued one, no check of the Capsule is queued or
/// running, and something was applied to check against. Returns how many were enqueued
/// and the last Capsule taken, where the next batch starts. Read-only towards
/// infrastructure: it only creates drift-check Runs.
///
/// Batches walk the Capsules' primary key, so a pass over n Capsules reads each once:
/// ordered by anything else, every batch sorted every due Capsule again and the pass grew
/// with n² (20,000 Capsules took 50 s).
pub async fn sweep_due(
    tx: &mut Tx,
    after: Option<CapsuleId>,
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
                  AND COALESCE(c.drift_interval_secs, w.drift_interval_secs) IS NOT NULL
                  AND (c.last_drift_enqueued_at IS NULL
                       OR c.last_drift_enqueued_at
                          < now() - make_interval(secs => COALESCE(c.drift_interval_secs, w.drift_interval_secs)))
                  -- `r.capsule_id > $1` repeats `c.id > $1` so the open-check index is
                  -- read from where the batch starts, not from its beginning
                  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.capsule_id = c.id AND r.kind = 'drift_check'
                                     AND r.status IN ('queued', 'held', 'planning')
                                     AND r.capsule_id > COALESCE($1::uuid, '00000000-0000-0000-0000-000000000000'))
                  -- only what was applied can drift (see `applied_baseline`)
                  AND EXISTS (SELECT 1 FROM state_versions sv JOIN runs a ON a.id = sv.run_id
                                LEFT JOIN runs p ON p.id = a.plan_run_id
                               WHERE sv.id = c.current_state_version_id AND a.source_commit IS NOT NULL
                                 AND p.kind IS DISTINCT FROM 'destroy')
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
               SELECT gen_random_uuid(), 'drift_check', workspace_id, id, 'system', 'sweep',
                      -- a trace of its own per check (W3C: 32 + 16 lower-case hex digits)
                      '00-' || md5(random()::text) || '-' || substr(md5(random()::text), 1, 16) || '-01'
                 FROM marked
               RETURNING id, traceparent, capsule_id),
           queued AS (
               INSERT INTO run_events (run_id, kind, actor, data)
               SELECT id, 'queued', 'system:sweep', '{"kind": "drift_check"}'::jsonb FROM new_runs),
           wake AS (
               -- a pool's Capsule wakes the pool's queue, as `outbox::enqueue` routes it
               INSERT INTO outbox (topic, payload, traceparent)
               SELECT CASE WHEN p.name IS NOT NULL THEN 'run.drift.' || p.name ELSE 'run.drift' END,
                      jsonb_build_object('runId', 'run_' || replace(n.id::text, '-', '')), n.traceparent
                 FROM new_runs n
                 JOIN marked m ON m.id = n.capsule_id
                 LEFT JOIN worker_pools p ON p.id = m.pool_id)
           SELECT (SELECT count(*) FROM new_runs) as "n!",
                  (SELECT id FROM marked ORDER BY id DESC LIMIT 1) as "last: CapsuleId""#,
        after.map(|c| c.as_uuid()),
        limit
    )
    .fetch_one(&mut **tx)
    .await?;
    Ok((row.n, row.last))
}

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
    .execute(&mut **tx)
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
    .execute(&mut **tx)
    .await?;
    Ok(())
}
