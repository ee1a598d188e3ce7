//! StateVersions: each generation of a Capsule's state, sealed in object storage.

use takosumi_core::{CapsuleId, EventKind, RunId, StateVersionId, WorkspaceId};

use crate::{StoreError, Tx};

/// A StateVersion row (its object key is private).
#[derive(Debug, Clone)]
pub struct StateVersion {
    /// Its id.
    pub id: StateVersionId,
    /// The Capsule.
    pub capsule_id: CapsuleId,
    /// Generation it is.
    pub generation: i64,
    /// The Run that wrote it.
    pub run_id: RunId,
    /// Private: the sealed object.
    pub object_key: String,
    /// SHA-256 of the state bytes.
    pub digest: String,
}

/// Records a new StateVersion.
pub async fn insert(tx: &mut Tx, sv: &StateVersion, size: i64) -> Result<(), StoreError> {
    sqlx::query!(
        r#"INSERT INTO state_versions (id, capsule_id, generation, run_id, object_key, digest, size_bytes)
           VALUES ($1, $2, $3, $4, $5, $6, $7)"#,
        sv.id.as_uuid(),
        sv.capsule_id.as_uuid(),
        sv.generation,
        sv.run_id.as_uuid(),
        sv.object_key,
        sv.digest,
        size
    )
    .execute(tx.db())
    .await?;
    Ok(())
}

/// Records the state an apply wrote, in one statement: the state-generation compare-and-set
/// (the Capsule moves from `expected` to `sv.generation` and points at `sv`, only where the
/// generation is still `expected` and `sv.run_id` holds the Capsule, which it releases),
/// the StateVersion row, its `state_version_written` event and the Workspace's activity
/// entry. `false`: the generation moved or the apply does not hold the Capsule, and nothing
/// is written.
pub async fn record_applied(
    tx: &mut Tx,
    sv: &StateVersion,
    size: i64,
    expected: i64,
    actor: &str,
    workspace_id: WorkspaceId,
) -> Result<bool, StoreError> {
    let event = serde_json::json!({ "stateVersionId": sv.id, "generation": sv.generation });
    let activity = serde_json::json!({
        "capsuleId": sv.capsule_id, "runId": sv.run_id, "generation": sv.generation
    });
    let done = sqlx::query_scalar!(
        r#"WITH advanced AS (
               UPDATE capsules
                  SET state_generation = $3, current_state_version_id = $1,
                      running_apply_id = NULL, stale = false, updated_at = now()
                WHERE id = $2 AND state_generation = $8 AND running_apply_id = $4
                  AND $3 = $8 + 1
               RETURNING id),
           version AS (
               INSERT INTO state_versions (id, capsule_id, generation, run_id, object_key, digest, size_bytes)
               SELECT $1, $2, $3, $4, $5, $6, $7 FROM advanced),
           event AS (
               INSERT INTO run_events (run_id, kind, actor, data)
               SELECT $4, $9, $10, $11 FROM advanced)
           INSERT INTO activity (workspace_id, kind, subject, actor, data)
           SELECT $12, 'state_version_written', $14, $10, $13 FROM advanced
           RETURNING 1 AS "recorded!""#,
        sv.id.as_uuid(),
        sv.capsule_id.as_uuid(),
        sv.generation,
        sv.run_id.as_uuid(),
        sv.object_key,
        sv.digest,
        size,
        expected,
        EventKind::StateVersionWritten as EventKind,
        actor,
        event,
        workspace_id.as_uuid(),
        activity,
        sv.id.to_string()
    )
    .fetch_optional(tx.db())
    .await?;
    Ok(done.is_some())
}

/// Reads a StateVersion.
pub async fn get<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: StateVersionId,
) -> Result<Option<StateVersion>, StoreError> {
    let row = sqlx::query!(
        "SELECT id, capsule_id, generation, run_id, object_key, digest FROM state_versions WHERE id = $1",
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| StateVersion {
        id: StateVersionId::from_uuid(r.id),
        capsule_id: CapsuleId::from_uuid(r.capsule_id),
        generation: r.generation,
        run_id: RunId::from_uuid(r.run_id),
        object_key: r.object_key,
        digest: r.digest,
    }))
}

/// How many StateVersions a Capsule has.
pub async fn count_for_capsule(
    pool: &crate::Pool,
    capsule_id: CapsuleId,
) -> Result<i64, StoreError> {
    let row = sqlx::query!(
        r#"SELECT count(*) as "n!" FROM state_versions WHERE capsule_id = $1"#,
        capsule_id.as_uuid()
    )
    .fetch_one(pool)
    .await?;
    Ok(row.n)
}
