//! The rows behind the operator actions that resolve an `unknown_outcome` apply by giving
//! the Capsule a state: `restore_held_state` (the state the apply's tool wrote, kept in
//! `held_states` because object storage would not take it) and `attach_state` (a state the
//! operator pulled from the provider side).
//!
//! Every write here is conditional: the generation compare-and-set only moves a Capsule
//! that is still at the generation the operator's action was checked against and that no
//! apply holds, and the Run only takes the StateVersion while it is an `unknown_outcome`
//! apply without one. This module never reads or writes a state's bytes in the clear.

use takosumi_core::{CapsuleId, RunId, StateVersionId};

use crate::{StoreError, Tx};

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
pub async fn latest_held(pool: &sqlx::PgPool, run_id: RunId) -> Result<Option<Held>, StoreError> {
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
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The generation compare-and-set for a state an operator gives the Capsule: `g` → `g + 1`
/// pointing at `sv`, only where the generation is still `expected` and no apply holds the
/// Capsule. `false`: the generation moved or an apply holds the Capsule; nothing changed.
pub async fn advance_generation(
    tx: &mut Tx,
    capsule_id: CapsuleId,
    expected: i64,
    sv: StateVersionId,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE capsules
              SET state_generation = state_generation + 1, current_state_version_id = $3,
                  updated_at = now()
            WHERE id = $1 AND state_generation = $2 AND running_apply_id IS NULL"#,
        capsule_id.as_uuid(),
        expected,
        sv.as_uuid()
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Gives an `unknown_outcome` apply the StateVersion its resolution wrote, only if it has
/// none. `false`: it already has one; nothing changed.
pub async fn set_run_state_version(
    tx: &mut Tx,
    run_id: RunId,
    sv: StateVersionId,
    generation: i64,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET state_version_id = $2, state_generation = $3, updated_at = now()
            WHERE id = $1 AND status = 'unknown_outcome' AND state_version_id IS NULL"#,
        run_id.as_uuid(),
        sv.as_uuid(),
        generation
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}
