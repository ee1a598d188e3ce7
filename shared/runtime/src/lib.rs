//! What every Takosumi process shares: the typed [`Settings`] loaded once from
//! `TAKOSUMI_*`, the step context [`Ctx`] (database pool, broker, object store, sealer,
//! runner), telemetry, the shutdown signal, leases, the reaper and the worker loop a step
//! binary runs, and the step logic both hosts (a control-node step and the API's relay
//! endpoints) commit through: `plan_commit`, `apply_commit`, `dry_run`, `inputs`,
//! `dependencies`, `cancel`. The steps' own decisions live in `functions/*` and
//! `takosumi-steps`.
#![deny(missing_docs)]

pub mod apply_commit;
mod cancel;
mod ctx;
pub mod dependencies;
pub mod dry_run;
pub mod inputs;
pub mod live_log;
pub mod metrics_server;
pub mod plan_commit;
mod reaper;
mod settings;
pub mod step;
pub mod unrecorded;
mod worker;

pub use ctx::{Ctx, LeaseGuard};
pub use reaper::{reap_once, run_reaper, topic_for};
pub use settings::{Settings, SettingsError};
pub use worker::{WorkerMode, flush_outbox, run_step, run_worker, shutdown_signal};

/// Errors starting or running a process.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A setting is missing or invalid.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// Postgres failed.
    #[error("database: {0}")]
    Store(#[from] takosumi_store::StoreError),
    /// The broker failed.
    #[error("broker: {0}")]
    Queue(#[from] takosumi_queue::QueueError),
    /// The seal key is unusable.
    #[error("seal key: {0}")]
    Seal(#[from] takosumi_seal::SealError),
    /// The object store failed.
    #[error("object store: {0}")]
    Objects(#[from] takosumi_objects::ObjectError),
    /// The runner cannot start (the sandbox does not work here, the work root is unusable).
    #[error("runner: {0}")]
    Runner(#[from] takosumi_runner::RunnerError),
}

/// Starts logging (and OTLP trace export when `OTEL_EXPORTER_OTLP_ENDPOINT` is set): see
/// [`takosumi_telemetry::init`]. Keep the guard until the process ends. Never logs
/// setting values.
pub fn init_telemetry(service: &str) -> takosumi_telemetry::Telemetry {
    takosumi_telemetry::init(service)
}
