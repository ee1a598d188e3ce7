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

/// Who gives a Capsule a new state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// The apply that holds the Capsule (`sv.run_id`) and wrote the state: it lets go of the
    /// Capsule, and the Capsule is no longer stale (what it applied is current).
    Apply,
    /// An operator resolving a Run of unknown outcome (`by` is the resolution's action): only
    /// while no apply holds the Capsule.
    Resolution {
        /// The resolution's action, recorded on the event and the activity entry.
        by: takosumi_core::ResolutionAction,
    },
}

/// Gives the Capsule the state `sv`, in one statement: the state-generation compare-and-set
/// (the Capsule moves from `expected` to `sv.generation` and points at `sv` and at the drift
/// baseline `sv`'s Run makes, only where the generation is still `expected` and the Capsule
/// is held as `writer` says), the StateVersion row, its `state_version_written` event on
/// `sv.run_id` and the Workspace's activity entry. `false`: the generation moved or the Capsule is not held that way, and
/// nothing is written.
pub async fn record_written(
    tx: &mut Tx,
    sv: &StateVersion,
    size: i64,
    expected: i64,
    writer: Writer,
    actor: &str,
    workspace_id: WorkspaceId,
) -> Result<bool, StoreError> {
    let (holder, by) = match writer {
        Writer::Apply => (Some(sv.run_id.as_uuid()), None),
        Writer::Resolution { by } => (None, Some(by)),
    };
    let mut event = serde_json::json!({ "stateVersionId": sv.id, "generation": sv.generation });
    let mut activity = serde_json::json!({
        "capsuleId": sv.capsule_id, "runId": sv.run_id, "generation": sv.generation
    });
    if let Some(by) = by {
        event["by"] = by.as_str().into();
        activity["by"] = by.as_str().into();
    }
    let done = sqlx::query_scalar!(
        r#"WITH advanced AS (
               UPDATE capsules
                  SET state_generation = $3, current_state_version_id = $1,
                      -- what a drift check compares with from now on: the plan this state's
                      -- Run carried out (or a one-step apply itself), none after a destroy
                      -- or a Run that records no commit (migration 20261212000000)
                      drift_baseline_run_id = (
                          SELECT COALESCE(p.id, a.id) FROM runs a LEFT JOIN runs p ON p.id = a.plan_run_id
                           WHERE a.id = $4 AND a.source_commit IS NOT NULL
                             AND p.kind IS DISTINCT FROM 'destroy'),
                      running_apply_id = NULL, stale = stale AND $15::uuid IS NULL,
                      updated_at = now()
                WHERE id = $2 AND state_generation = $8 AND $3 = $8 + 1
                  AND running_apply_id IS NOT DISTINCT FROM $15
               RETURNING id),
           version AS (
               INSERT INTO state_versions (id, capsule_id, generation, run_id, object_key, digest, size_bytes)
               SELECT $1, $2, $3, $4, $5, $6, $7 FROM advanced),
           -- the Run's event id is taken under its row lock (see `crate::events`)
           run AS (SELECT id FROM runs WHERE id = $4 FOR NO KEY UPDATE),
           event AS (
               INSERT INTO run_events (run_id, kind, actor, data)
               SELECT run.id, $9, $10, $11 FROM advanced, run)
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
        sv.id.to_string(),
        holder
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
