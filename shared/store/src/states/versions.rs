//! StateVersions: each generation of a Capsule's state, sealed in object storage.

use takosumi_core::{CapsuleId, RunId, StateVersionId};

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
