//! States an apply's tool wrote that object storage would not take, kept sealed in
//! `held_states` so an operator can recover them: the step keeps one
//! ([`hold_state`]), and the operator action `restore_held_state` reads it back and records
//! that it reached object storage. This module never reads or writes a state's bytes in
//! the clear.

use takosumi_core::{CapsuleId, RunId, StateVersionId};

use crate::{StoreError, Tx};

/// A sealed state kept in Postgres because object storage would not take it.
#[derive(Debug, Clone)]
pub struct HeldState {
    /// The StateVersion id the state was sealed under (its associated data).
    pub state_version_id: StateVersionId,
    /// The apply that wrote it.
    pub run_id: RunId,
    /// Its Capsule.
    pub capsule_id: CapsuleId,
    /// The generation it would have become.
    pub generation: i64,
    /// The object key it was meant for.
    pub object_key: String,
    /// SHA-256 hex of the unsealed state.
    pub digest: String,
    /// Size of the unsealed state.
    pub size_bytes: i64,
    /// Why it is held (the storage error, no secret).
    pub reason: String,
}

/// Keeps `sealed` (already sealed under `held.state_version_id`) in the database. Safe to
/// call twice for the same StateVersion id.
pub async fn hold_state(
    pool: &crate::Pool,
    held: &HeldState,
    sealed: &[u8],
) -> Result<(), StoreError> {
    sqlx::query!(
        r#"INSERT INTO held_states (state_version_id, run_id, capsule_id, generation, object_key,
                                    digest, size_bytes, sealed, reason)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
           ON CONFLICT (state_version_id) DO NOTHING"#,
        held.state_version_id.as_uuid(),
        held.run_id.as_uuid(),
        held.capsule_id.as_uuid(),
        held.generation,
        held.object_key,
        held.digest,
        held.size_bytes,
        sealed,
        held.reason
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// A state held for an apply Run, sealed.
#[derive(Debug, Clone)]
pub struct HeldSealed {
    /// The StateVersion id it was sealed under.
    pub state_version_id: StateVersionId,
    /// The generation it would have become.
    pub generation: i64,
    /// SHA-256 hex of the unsealed state.
    pub digest: String,
    /// The sealed bytes.
    pub sealed: Vec<u8>,
}

/// The states held for an apply Run, oldest first.
pub async fn held_for_run(
    pool: &crate::Pool,
    run_id: RunId,
) -> Result<Vec<HeldSealed>, StoreError> {
    let rows = sqlx::query!(
        "SELECT state_version_id, generation, digest, sealed FROM held_states WHERE run_id = $1 ORDER BY created_at",
        run_id.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| HeldSealed {
            state_version_id: StateVersionId::from_uuid(r.state_version_id),
            generation: r.generation,
            digest: r.digest,
            sealed: r.sealed,
        })
        .collect())
}

/// The ids of the states held for an apply Run (without their bytes).
pub async fn held_ids_for_run(
    executor: impl sqlx::PgExecutor<'_>,
    run_id: RunId,
) -> Result<Vec<StateVersionId>, StoreError> {
    let ids = sqlx::query_scalar!(
        "SELECT state_version_id FROM held_states WHERE run_id = $1 ORDER BY created_at",
        run_id.as_uuid()
    )
    .fetch_all(executor)
    .await?;
    Ok(ids.into_iter().map(StateVersionId::from_uuid).collect())
}

/// A state held for an apply Run, sealed under its StateVersion id.
#[derive(Debug, Clone)]
pub struct Held {
    /// The StateVersion id the state was sealed under; it becomes the StateVersion's id.
    pub state_version_id: StateVersionId,
    /// The generation it becomes (the apply started from `generation - 1`).
    pub generation: i64,
    /// The object key it was meant for.
    pub object_key: String,
    /// SHA-256 hex of the unsealed state.
    pub digest: String,
    /// Size of the unsealed state.
    pub size_bytes: i64,
    /// The sealed bytes.
    pub sealed: Vec<u8>,
    /// How many states are held for the Run (normally one).
    pub count: i64,
}

/// The newest state held for `run_id`, if any.
pub async fn latest_held(pool: &crate::Pool, run_id: RunId) -> Result<Option<Held>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT state_version_id, generation, object_key, digest, size_bytes, sealed,
                  count(*) OVER () AS "n!"
             FROM held_states WHERE run_id = $1
         ORDER BY created_at DESC LIMIT 1"#,
        run_id.as_uuid()
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| Held {
        state_version_id: StateVersionId::from_uuid(r.state_version_id),
        generation: r.generation,
        object_key: r.object_key,
        digest: r.digest,
        size_bytes: r.size_bytes,
        sealed: r.sealed,
        count: r.n,
    }))
}

/// Records that a held state is now in object storage (it stays in the table, sealed,
/// as the record of what was held).
pub async fn mark_held_stored(tx: &mut Tx, sv: StateVersionId) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE held_states SET stored_at = now() WHERE state_version_id = $1 AND stored_at IS NULL",
        sv.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(())
}
