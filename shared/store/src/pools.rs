//! Worker pools: named sets of relay workers that execute a Capsule's plans,
//! drift checks and applies away from the control node. A pool authenticates with its own
//! token (only the SHA-256 is stored, like API tokens) and receives secrets sealed to its
//! delivery key; the previous key stays deliverable until its grace ends.

use chrono::{DateTime, Utc};
use takosumi_core::{CapsuleId, RunId, WorkspaceId};
use uuid::Uuid;

use crate::{StoreError, Tx};

/// A worker pool row (the token hash stays here).
#[derive(Debug, Clone)]
pub struct WorkerPool {
    /// Its id.
    pub id: Uuid,
    /// Its name: unique, it names the pool's queues.
    pub name: String,
    /// The Workspace whose Capsules may use it.
    pub workspace_id: WorkspaceId,
    /// The current delivery key id, if a key was registered.
    pub delivery_key_id: Option<String>,
    /// The current delivery public key (32 bytes).
    pub delivery_public_key: Option<Vec<u8>>,
    /// The key before the last rotation.
    pub previous_key_id: Option<String>,
    /// Its public key.
    pub previous_public_key: Option<Vec<u8>>,
    /// Until when the previous key is still delivered to.
    pub previous_key_until: Option<DateTime<Utc>>,
    /// Created.
    pub created_at: DateTime<Utc>,
}

/// The row as the `query_as!` macros read it; the id columns become typed ids in `From`.
struct PoolRow {
    id: Uuid,
    name: String,
    workspace_id: Uuid,
    delivery_key_id: Option<String>,
    delivery_public_key: Option<Vec<u8>>,
    previous_key_id: Option<String>,
    previous_public_key: Option<Vec<u8>>,
    previous_key_until: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
}

impl From<PoolRow> for WorkerPool {
    fn from(r: PoolRow) -> Self {
        WorkerPool {
            id: r.id,
            name: r.name,
            workspace_id: WorkspaceId::from_uuid(r.workspace_id),
            delivery_key_id: r.delivery_key_id,
            delivery_public_key: r.delivery_public_key,
            previous_key_id: r.previous_key_id,
            previous_public_key: r.previous_public_key,
            previous_key_until: r.previous_key_until,
            created_at: r.created_at,
        }
    }
}

/// Creates a pool whose token hashes to `token_hash(token)`.
pub async fn create(
    tx: &mut Tx,
    name: &str,
    workspace_id: WorkspaceId,
    token: &str,
    delivery_key: Option<(&str, &[u8])>,
) -> Result<WorkerPool, StoreError> {
    let row = sqlx::query_as!(
        PoolRow,
        "INSERT INTO worker_pools (id, name, workspace_id, token_hash, delivery_key_id, delivery_public_key)
         VALUES ($1, $2, $3, $4, $5, $6)
         RETURNING id, name, workspace_id, delivery_key_id, delivery_public_key, previous_key_id,
                   previous_public_key, previous_key_until, created_at",
        Uuid::now_v7(),
        name,
        workspace_id.as_uuid(),
        crate::tokens::hash_token(token),
        delivery_key.map(|k| k.0),
        delivery_key.map(|k| k.1)
    )
    .fetch_one(tx.db())
    .await?;
    Ok(row.into())
}

/// The pool a presented pool token belongs to.
pub async fn find_by_token(
    pool: &crate::Pool,
    token: &str,
) -> Result<Option<WorkerPool>, StoreError> {
    let row = sqlx::query_as!(
        PoolRow,
        "SELECT id, name, workspace_id, delivery_key_id, delivery_public_key, previous_key_id,
                previous_public_key, previous_key_until, created_at
           FROM worker_pools WHERE token_hash = $1",
        crate::tokens::hash_token(token)
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(Into::into))
}

/// A pool by name.
pub async fn by_name<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    name: &str,
) -> Result<Option<WorkerPool>, StoreError> {
    // Postgres text cannot hold NUL: no pool has such a name (and asking would fail).
    if name.contains('\0') {
        return Ok(None);
    }
    let row = sqlx::query_as!(
        PoolRow,
        "SELECT id, name, workspace_id, delivery_key_id, delivery_public_key, previous_key_id,
                previous_public_key, previous_key_until, created_at
           FROM worker_pools WHERE name = $1",
        name
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(Into::into))
}

/// Every pool's name, in name order (the queues a pool has are named after it).
pub async fn names<'e, E: sqlx::PgExecutor<'e>>(executor: E) -> Result<Vec<String>, StoreError> {
    Ok(
        sqlx::query_scalar!("SELECT name FROM worker_pools ORDER BY name")
            .fetch_all(executor)
            .await?,
    )
}

/// The pool a Capsule names, if any.
pub async fn of_capsule<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    capsule_id: CapsuleId,
) -> Result<Option<WorkerPool>, StoreError> {
    let row = sqlx::query_as!(
        PoolRow,
        "SELECT p.id, p.name, p.workspace_id, p.delivery_key_id, p.delivery_public_key,
                p.previous_key_id, p.previous_public_key, p.previous_key_until, p.created_at
           FROM worker_pools p JOIN capsules c ON c.pool_id = p.id WHERE c.id = $1",
        capsule_id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(Into::into))
}

/// Rotates the pool's delivery key: the current key becomes the previous one, delivered
/// to for `grace_secs` more; a pool without a key just gets one. Refuses (`Conflict`) a
/// key id the pool uses now or used last, so an envelope's key id always names one key.
pub async fn rotate_delivery_key(
    tx: &mut Tx,
    id: Uuid,
    key_id: &str,
    public: &[u8],
    grace_secs: i64,
) -> Result<WorkerPool, StoreError> {
    let row = sqlx::query_as!(
        PoolRow,
        "UPDATE worker_pools
            SET previous_key_id = delivery_key_id, previous_public_key = delivery_public_key,
                previous_key_until = CASE WHEN delivery_key_id IS NULL THEN NULL
                                          ELSE now() + make_interval(secs => $4::bigint::double precision) END,
                delivery_key_id = $2, delivery_public_key = $3, updated_at = now()
          WHERE id = $1
            AND delivery_key_id IS DISTINCT FROM $2 AND previous_key_id IS DISTINCT FROM $2
        RETURNING id, name, workspace_id, delivery_key_id, delivery_public_key, previous_key_id,
                  previous_public_key, previous_key_until, created_at",
        id,
        key_id,
        public,
        grace_secs
    )
    .fetch_optional(tx.db())
    .await?;
    match row {
        Some(r) => Ok(r.into()),
        None => Err(StoreError::Conflict(
            "delivery key id already used by this pool",
        )),
    }
}

/// Sets (or clears) the pool a Capsule's runs execute on, only while none of its Runs is
/// in flight (queued, held, planning or applying): a Run keeps the runner it started on.
/// `false`: the Capsule is gone or a Run of it is in flight (nothing changed).
pub async fn set_capsule_pool(
    tx: &mut Tx,
    capsule_id: CapsuleId,
    pool_id: Option<Uuid>,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE capsules SET pool_id = $2, updated_at = now()
            WHERE id = $1
              AND NOT EXISTS (SELECT 1 FROM runs
                               WHERE runs.capsule_id = $1
                                 AND runs.status IN ('queued', 'held', 'planning', 'applying'))"#,
        capsule_id.as_uuid(),
        pool_id
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Claims the pool's oldest queued plan, destroy or drift-check Run for a relay worker
/// (`queued` → `planning` with a lease owned by `owner`). `SKIP LOCKED` and the status
/// condition let exactly one of several concurrent claimers win each Run.
pub async fn claim_next_plan(
    executor: impl sqlx::PgExecutor<'_>,
    pool_id: Uuid,
    owner: &str,
    lease_secs: i64,
    record: crate::runs::ClaimRecord<'_>,
) -> Result<Option<RunId>, StoreError> {
    crate::transitions!(Queued => Planning);
    // The claim writes its record in the same statement, as `runs::claim` does.
    let id = sqlx::query_scalar!(
        r#"WITH claimed AS (
               UPDATE runs SET status = 'planning', lease_owner = $2,
                      lease_until = now() + make_interval(secs => $3::bigint::double precision),
                      attempts = attempts + 1, sandbox = COALESCE($4, sandbox), updated_at = now()
                WHERE id = (SELECT r.id FROM runs r JOIN capsules c ON c.id = r.capsule_id
                             WHERE c.pool_id = $1 AND r.status = 'queued'
                               AND r.kind IN ('plan', 'destroy', 'drift_check')
                             ORDER BY r.created_at LIMIT 1 FOR UPDATE OF r SKIP LOCKED)
                  AND status = 'queued'
            RETURNING id)
           INSERT INTO run_events (run_id, kind, actor, data)
           SELECT id, 'claimed', 'handler:' || $2, $5 FROM claimed
           RETURNING run_id"#,
        pool_id,
        owner,
        lease_secs,
        record.sandbox as Option<takosumi_core::SandboxMode>,
        record.data
    )
    .fetch_optional(executor)
    .await?;
    Ok(id.map(RunId::from_uuid))
}

/// The pool's released, queued Apply Runs, oldest first (claimed one by one with
/// [`crate::runs::claim_apply`], which also takes the Capsule), each with whether it
/// carries out a saved plan (a one-step apply has none).
pub async fn released_applies<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    pool_id: Uuid,
) -> Result<Vec<(RunId, bool)>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT r.id, r.plan_run_id IS NOT NULL AS "has_plan!"
             FROM runs r JOIN capsules c ON c.id = r.capsule_id
            WHERE c.pool_id = $1 AND r.kind = 'apply' AND r.status = 'queued'
              AND r.gate_decision = 'released'
            ORDER BY r.created_at LIMIT 10"#,
        pool_id
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (RunId::from_uuid(r.id), r.has_plan))
        .collect())
}

/// The lease owner of a Run, if a step holds it.
pub async fn lease_owner<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<Option<String>, StoreError> {
    let owner = sqlx::query_scalar!("SELECT lease_owner FROM runs WHERE id = $1", id.as_uuid())
        .fetch_optional(executor)
        .await?;
    Ok(owner.flatten())
}
