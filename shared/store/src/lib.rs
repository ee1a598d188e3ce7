//! Postgres, the source of truth: the schema's repositories, every Run transition as a
//! conditional update, leases, the state-generation compare-and-set and the transactional
//! outbox. A function that changes a row and wakes a handler does both in one transaction.
//! This crate never talks to the broker, the object store or the tool.
//!
//! A module per aggregate, named by the thing it owns: [`workspaces`], [`capsules`]
//! (rows, listing, staleness, automatic update and the generation compare-and-set),
//! [`runs`] (the lifecycle, with a sub-module per other part of the Run row),
//! [`states`] (StateVersions and held states), [`events`], [`logs`], [`activity`],
//! [`rules`], [`approvals`], [`groups`] (RunGroups), [`drift`], [`webhooks`],
//! [`bindings`], [`pools`], [`tokens`], [`sessions`], [`evidence`], [`outbox`],
//! [`dead_letters`] and [`stats`].
#![deny(missing_docs)]

pub mod activity;
pub mod approvals;
pub mod bindings;
mod bounded;
pub mod capsules;
pub mod dead_letters;
pub mod drift;
pub mod events;
pub mod evidence;
pub mod groups;
pub mod logs;
pub mod outbox;
pub mod pools;
pub mod rules;
pub mod runs;
pub mod sessions;
pub mod states;
pub mod stats;
pub mod tokens;
pub mod webhooks;
pub mod workspaces;

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use takosumi_core::RunStatus;

pub use bounded::{ANSWER_MARGIN, Bounded, Conn, PING_AFTER_IDLE, Pool, Tx};
pub use sqlx::Postgres;

/// How a Run's progress (its events, its log, the dry-run scan report) is written: one
/// autocommit statement whose commit returns without waiting for the WAL to reach the disk.
/// A flush costs 0.1-3 ms on a virtual machine's disk, and a step waits for its progress.
/// Each progress statement says so itself, with
/// `WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL`: the setting is local to
/// the statement's own transaction, which Postgres commits right after it, so one round trip
/// does what `BEGIN; SET LOCAL …`, the statement and `COMMIT` did in three. Postgres writes
/// the WAL in order, so the next ordinary commit (the Run's next state change: its plan,
/// hold, apply or failure) makes the progress before it durable too; what a database crash
/// can lose is progress of a Run whose state change never committed, which the reaper takes
/// back and runs again. Never for a state change or anything a decision reads. The writers:
/// [`events::append_progress`], [`logs::append_progress`],
/// [`runs::plan_record::set_scan_report_progress`].
pub mod progress {}

/// What an append to a Run's events or log wrote: none found no Run to write to.
pub(crate) fn appended_to_run(rows: u64) -> Result<(), StoreError> {
    if rows == 0 {
        return Err(StoreError::NotFound("run"));
    }
    Ok(())
}

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
    /// A caller asked for a status change the Run lifecycle does not have
    /// ([`RunStatus::TRANSITIONS`]): a bug, refused before the database is asked.
    #[error("a Run cannot go from {} to {}", from.as_str(), to.as_str())]
    Transition {
        /// The status the Run was to leave.
        from: RunStatus,
        /// The status it was to take.
        to: RunStatus,
    },
}

/// Checks, when the crate compiles, that each `from => to` a transition function writes
/// into its SQL is in the Run lifecycle ([`RunStatus::TRANSITIONS`]): a function that
/// makes a change the lifecycle does not have does not build. Written at the top of every
/// function whose `UPDATE` changes `runs.status` with the statuses fixed in its SQL.
macro_rules! transitions {
    ($($from:ident => $to:ident),+ $(,)?) => {
        $(
            const _: () = assert!(
                takosumi_core::RunStatus::$from.can_become(takosumi_core::RunStatus::$to),
                concat!(
                    "the Run lifecycle has no ",
                    stringify!($from),
                    " -> ",
                    stringify!($to)
                )
            );
        )+
    };
}
pub(crate) use transitions;

/// A status change given by a caller, checked against the Run lifecycle
/// ([`RunStatus::TRANSITIONS`]) before any SQL runs: [`StoreError::Transition`] for a pair
/// it does not have.
pub(crate) fn check_transition(from: RunStatus, to: RunStatus) -> Result<(), StoreError> {
    if from.can_become(to) {
        Ok(())
    } else {
        Err(StoreError::Transition { from, to })
    }
}

/// A step meets a store failure as transient when trying again can help (the message is
/// taken back and redelivered), as internal otherwise.
impl From<StoreError> for takosumi_core::StepError {
    fn from(e: StoreError) -> Self {
        if e.retryable() {
            Self::transient(e)
        } else {
            Self::internal(e)
        }
    }
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
                        c.starts_with("08")
                            || c.starts_with("57P")
                            || c == "40001"
                            || c == "40P01"
                            // statement_timeout (or a cancel) and lock_timeout: the
                            // database was slow or busy, not the request wrong.
                            || c == "57014"
                            || c == "55P03"
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

/// How long the database may keep a caller waiting. Every connection of a pool starts with
/// `statement_timeout` and `lock_timeout` set (Postgres enforces them: a slow statement or a
/// lock wait ends with SQLSTATE 57014 / 55P03, which [`StoreError::retryable`] counts as
/// transient), and taking a connection from the pool — which pings one idle for
/// [`PING_AFTER_IDLE`] first, or opens a new one — gives up after `acquire` (`PoolTimedOut`,
/// transient too). A server that stops answering altogether (a paused process, a dead host
/// whose TCP connections stay open) cannot enforce its own timeouts: the client does, with
/// the answer bound of [`Pool`] (`statement` plus [`ANSWER_MARGIN`]), so new work and work
/// in flight both fail (transient) within `acquire` plus that bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PgTimeouts {
    /// `statement_timeout` of every session (`TAKOSUMI_PG_STATEMENT_TIMEOUT_MS`).
    pub statement: Duration,
    /// `lock_timeout` of every session (`TAKOSUMI_PG_LOCK_TIMEOUT_MS`).
    pub lock: Duration,
    /// Longest wait for a pooled connection (`TAKOSUMI_PG_ACQUIRE_TIMEOUT_MS`).
    pub acquire: Duration,
}

impl Default for PgTimeouts {
    /// 30 s per statement (nothing Takosumi runs takes a second; a migration runs without
    /// it), 5 s per lock wait (row locks are held for one short transaction), 10 s to get a
    /// connection.
    fn default() -> Self {
        Self {
            statement: Duration::from_secs(30),
            lock: Duration::from_secs(5),
            acquire: Duration::from_secs(10),
        }
    }
}

/// Connects a pool with the default [`PgTimeouts`], its sessions named `takosumi`.
pub async fn connect(url: &str, max_connections: u32) -> Result<Pool, StoreError> {
    connect_with(url, "takosumi", max_connections, PgTimeouts::default()).await
}

/// Connects a pool whose sessions start with `timeouts` (see [`PgTimeouts`]) and whose
/// statements carry the answer bound ([`Pool`]). A timeout of zero turns that one off, as
/// in Postgres. The sessions carry `application_name` (`pg_stat_activity` then says which
/// process holds which connections) unless the URL names one itself.
pub async fn connect_with(
    url: &str,
    application_name: &str,
    max_connections: u32,
    timeouts: PgTimeouts,
) -> Result<Pool, StoreError> {
    let mut options = PgConnectOptions::from_str(url)?.options([
        ("statement_timeout", millis(timeouts.statement)),
        ("lock_timeout", millis(timeouts.lock)),
    ]);
    if options.get_application_name().is_none() {
        options = options.application_name(application_name);
    }
    let inner = pool_options(max_connections, timeouts.acquire, timeouts.statement)
        .connect_with(options)
        .await?;
    Ok(Pool::new(inner, timeouts.statement))
}

/// How every pool hands out connections. One idle for [`PING_AFTER_IDLE`] or more is pinged
/// first, so a server that went away while it was idle fails the acquire (bounded by
/// `acquire`); one used more recently goes out at once and its statement carries the
/// answer bound. Without a statement timeout there is no bound, so every connection is
/// pinged, as sqlx does by default.
fn pool_options(max_connections: u32, acquire: Duration, statement: Duration) -> PgPoolOptions {
    let options = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire);
    if statement.is_zero() {
        return options.test_before_acquire(true);
    }
    options
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// A pool beside `pool` (same server, same session settings and answer bound, at most
/// `max_connections`, connected on first use) whose sessions keep one generic plan per
/// prepared statement (`plan_cache_mode = force_generic_plan`).
///
/// Only for statements whose every parameter value is served by the same index scan, as
/// the history listings are (one statement per filter shape, `list::list_runs`). Postgres
/// otherwise plans them afresh on every execution, because the custom plan's estimate
/// keeps winning, and that planning was the largest part of a history page's time in
/// Postgres (BENCHMARKS.md, session 15). Statements with optional filters written as
/// `$n IS NULL OR …` need their custom plans and stay on the main pool.
pub fn plan_once_pool(pool: &Pool, max_connections: u32) -> Pool {
    let options = (*pool.connect_options())
        .clone()
        .options([("plan_cache_mode", "force_generic_plan")]);
    let statement = pool.statement_timeout();
    let inner = pool_options(
        max_connections,
        pool.options().get_acquire_timeout(),
        statement,
    )
    .connect_lazy_with(options);
    Pool::new(inner, statement)
}

fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

/// Applies pending migrations, through a one-connection pool of its own without the
/// pool's statement and lock timeouts: a migration may rewrite a large table, and waits
/// for another process's migration lock (`pg_advisory_lock`) for as long as that one
/// migrates.
pub async fn migrate(pool: &Pool) -> Result<(), StoreError> {
    // Later `-c` options override earlier ones: this pool's sessions have no timeouts.
    let options = (*pool.connect_options())
        .clone()
        .options([("statement_timeout", "0"), ("lock_timeout", "0")]);
    let own = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(pool.options().get_acquire_timeout())
        .connect_with(options)
        .await?;
    let ran = MIGRATOR.run(&own).await;
    own.close().await;
    ran?;
    Ok(())
}

/// A round trip to Postgres (the readiness check).
pub async fn ping(pool: &Pool) -> Result<(), StoreError> {
    sqlx::query_scalar!("select 1 as \"one!\"")
        .fetch_one(pool)
        .await?;
    Ok(())
}

/// SHA-256 hex of bytes, the digest recorded on rows (defined once, in core).
pub use takosumi_core::sha256_hex;

#[cfg(test)]
mod tests {
    use super::*;

    /// The names the last `CHECK` on `table.column` in the embedded migrations (the SQL the
    /// server runs, in order) allows: the quoted list of its `column IN (…)`, written in the
    /// CHECK or in the last definition of the function it calls as `function(column)`.
    fn check_names(table: &str, column: &str) -> Vec<String> {
        let needle = format!("{column} IN (");
        let list_in = |text: &str| {
            text.find(&needle).map(|i| {
                let list = &text[i + needle.len()..];
                list[..list.find(')').expect("the list closes")]
                    .split(',')
                    .map(|n| n.trim().trim_matches('\'').to_owned())
                    .collect::<Vec<_>>()
            })
        };
        // A function's body up to its first `;`, which holds its `RETURN … IN (…)`.
        let mut functions = std::collections::HashMap::<String, String>::new();
        let mut last = None;
        for migration in MIGRATOR.iter() {
            let sql: Vec<&str> = migration
                .sql
                .lines()
                .map(|l| l.split("--").next().unwrap_or_default())
                .collect();
            for statement in sql.join("\n").split(';') {
                let words: Vec<&str> = statement.split_whitespace().take(5).collect();
                let defined = match words[..] {
                    ["CREATE", "FUNCTION", f, ..] | ["CREATE", "OR", "REPLACE", "FUNCTION", f] => {
                        Some(f)
                    }
                    _ => None,
                };
                if let Some(f) = defined {
                    let name = f.split('(').next().unwrap_or_default();
                    functions.insert(name.to_owned(), statement.to_owned());
                    continue;
                }
                let on_table = match words[..] {
                    ["CREATE" | "ALTER", "TABLE", t, ..] => t.trim_end_matches('(') == table,
                    _ => false,
                };
                if !on_table {
                    continue;
                }
                for (at, _) in statement.match_indices("CHECK (") {
                    let check = &statement[at..];
                    // The CHECK's own parentheses: up to the `)` that closes `CHECK (`.
                    let mut depth = 0usize;
                    let end = check
                        .char_indices()
                        .find(|&(_, c)| {
                            match c {
                                '(' => depth += 1,
                                ')' => depth -= 1,
                                _ => return false,
                            }
                            depth == 0
                        })
                        .map(|(i, _)| i)
                        .expect("a CHECK closes");
                    let check = &check["CHECK (".len()..end];
                    let called = format!("({column})");
                    let names = list_in(check).or_else(|| {
                        let call = check.find(&called)?;
                        let function = check[..call].trim();
                        let body = functions.get(function).unwrap_or_else(|| {
                            panic!(
                                "{table}.{column}: CHECK calls {function}, defined nowhere before"
                            )
                        });
                        Some(
                            list_in(body)
                                .unwrap_or_else(|| panic!("{function} lists no names of {column}")),
                        )
                    });
                    if names.is_some() {
                        last = names;
                    }
                }
            }
        }
        last.unwrap_or_else(|| panic!("no CHECK lists the names of {table}.{column}"))
    }

    #[test]
    fn every_text_column_check_lists_its_closed_set() {
        use std::collections::BTreeSet;
        use takosumi_core::{
            ApplyMode, EventKind, HoldReason, ProviderLockState, ResolutionAction, Tool,
        };
        // As sets: the order of a CHECK's list means nothing.
        fn names<T: Copy>(all: &[T], name: fn(T) -> &'static str) -> BTreeSet<String> {
            all.iter().map(|v| name(*v).to_owned()).collect()
        }
        for (table, column, all) in [
            (
                "runs",
                "hold_reason",
                names(HoldReason::ALL, HoldReason::as_str),
            ),
            (
                "runs",
                "apply_mode",
                names(ApplyMode::ALL, ApplyMode::as_str),
            ),
            (
                "runs",
                "provider_lock_state",
                names(ProviderLockState::ALL, ProviderLockState::as_str),
            ),
            (
                "runs",
                "resolution_action",
                names(ResolutionAction::ALL, ResolutionAction::as_str),
            ),
            ("capsules", "tool", names(Tool::ALL, Tool::as_str)),
            (
                "run_events",
                "kind",
                names(EventKind::ALL, EventKind::as_str),
            ),
        ] {
            let checked: BTreeSet<String> = check_names(table, column).into_iter().collect();
            assert_eq!(checked, all, "{table}.{column} CHECK");
        }
    }

    #[test]
    fn a_caller_given_transition_outside_the_lifecycle_is_refused() {
        for from in RunStatus::ALL {
            for to in RunStatus::ALL {
                match check_transition(from, to) {
                    Ok(()) => assert!(from.can_become(to), "{from:?} -> {to:?}"),
                    Err(e) => {
                        assert!(!from.can_become(to), "{from:?} -> {to:?}");
                        assert!(matches!(e, StoreError::Transition { .. }));
                        assert!(!e.retryable());
                        assert_eq!(
                            e.to_string(),
                            format!("a Run cannot go from {} to {}", from.as_str(), to.as_str())
                        );
                    }
                }
            }
        }
        // What the steps claim with.
        assert!(check_transition(RunStatus::Queued, RunStatus::Planning).is_ok());
        assert!(check_transition(RunStatus::Queued, RunStatus::Applying).is_ok());
        assert!(check_transition(RunStatus::Planned, RunStatus::Planning).is_err());
        assert!(check_transition(RunStatus::Applying, RunStatus::Queued).is_err());
    }
}
