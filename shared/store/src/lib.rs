//! Postgres, the source of truth: the schema's repositories, every Run transition as a
//! conditional update, leases, the state-generation compare-and-set and the transactional
//! outbox. A function that changes a row and wakes a handler does both in one transaction.
//! This crate never talks to the broker, the object store or the tool.
#![deny(missing_docs)]

pub mod activity;
pub mod apply_modes;
pub mod bindings;
pub mod capsules;
pub mod detection;
pub mod dry_runs;
pub mod events;
pub mod evidence;
pub mod gates;
pub mod listing;
pub mod logs;
pub mod outbox;
pub mod pools;
pub mod records;
pub mod resolutions;
pub mod runs;
pub mod sessions;
pub mod state_versions;
pub mod tokens;
pub mod unrecorded;
pub mod workspaces;

use sqlx::postgres::{PgPool, PgPoolOptions};

pub use sqlx::{PgPool as Pool, Postgres};

/// A database transaction.
pub type Tx = sqlx::Transaction<'static, Postgres>;

/// The embedded migrations from `infra/migrations`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../infra/migrations");

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed; `retryable` says whether trying again can help.
    #[error("database error")]
    Db(#[from] sqlx::Error),
    /// Migrations failed.
    #[error("migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A row that must exist does not.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// A conditional update found the row changed under it.
    #[error("conflict: {0}")]
    Conflict(&'static str),
    /// An evidence statement could not be encoded (a bug: statements hold no fractions).
    #[error("evidence statement: {0}")]
    Evidence(String),
}

impl StoreError {
    /// Connection, pool and I/O errors pass; constraint violations and bugs do not.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Db(e) => {
                matches!(
                    e,
                    sqlx::Error::Io(_)
                        | sqlx::Error::PoolTimedOut
                        | sqlx::Error::PoolClosed
                        | sqlx::Error::WorkerCrashed
                        | sqlx::Error::Tls(_)
                ) || e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .is_some_and(|c| {
                        c.starts_with("08") || c.starts_with("57P") || c == "40001" || c == "40P01"
                    })
            }
            _ => false,
        }
    }

    /// Whether a unique constraint rejected the write.
    pub fn is_unique_violation(&self) -> bool {
        matches!(self, Self::Db(e) if e.as_database_error().is_some_and(|d| d.is_unique_violation()))
    }
}

/// Connects a pool.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, StoreError> {
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect(url)
        .await?)
}

/// Applies pending migrations.
pub async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// SHA-256 hex of bytes; used for digests recorded on rows.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}
