//! The step context: every connection a step needs, built once per process and cloned
//! cheaply into each handler call.

use std::sync::Arc;
use std::time::Duration;

use takosumi_core::{EventKind, RunId};
use takosumi_objects::{ObjectStore, ObjectStoreConfig};
use takosumi_queue::Bus;
use takosumi_runner::Runner;
use takosumi_seal::Sealer;
use takosumi_store::Pool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{RuntimeError, Settings};

/// What a step handler works with.
#[derive(Clone)]
pub struct Ctx {
    /// Postgres.
    pub pool: Pool,
    /// The broker (reconnecting).
    pub bus: Arc<Bus>,
    /// Object storage for sealed artifacts.
    pub objects: ObjectStore,
    /// Seals and unseals plan files, lockfiles and state.
    pub sealer: Sealer,
    /// Runs the tool.
    pub runner: Runner,
    /// This process's lease owner id (`<queue>-<pid>-<random>`).
    pub owner: String,
    /// Lease length.
    pub lease_secs: i64,
    /// Claims before a plan fails.
    pub max_attempts: i32,
    /// Wakes this process's outbox relay after a commit.
    pub relay_wake: Arc<Notify>,
    /// The price catalogue the gate's cost check (`maxMonthlyIncrease`) estimates with:
    /// `TAKOSUMI_PRICING_CATALOGUE` when set, else the built-in one.
    pub pricing: Arc<takosumi_cost::Catalogue>,
    /// Set by [`Ctx::streaming_logs`]: the run whose tool output is stored as it arrives.
    pub live_log: Option<Arc<crate::live_log::LiveLog>>,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl Ctx {
    /// Connects everything the settings name. Migrations run here so that any process can
    /// start first on a new database.
    pub async fn connect(settings: &Settings, name: &str) -> Result<Self, RuntimeError> {
        let pool = takosumi_store::connect_with(
            settings.database_url.expose(),
            &format!("takosumi-{name}"),
            settings.pg_max_connections,
            settings.pg_timeouts,
        )
        .await?;
        takosumi_store::migrate(&pool).await?;
        let bus = Arc::new(Bus::new(
            settings.amqp_url.expose().clone(),
            name.to_owned(),
        ));
        bus.get().await?;
        let objects = ObjectStore::connect(&ObjectStoreConfig {
            endpoint: settings.s3_endpoint.clone(),
            region: settings.s3_region.clone(),
            access_key: settings.s3_access_key.clone(),
            secret_key: settings.s3_secret_key.clone(),
            bucket: settings.s3_bucket.clone(),
            timeouts: settings.s3_timeouts,
        })
        .await;
        objects.ensure_bucket().await?;
        let sealer = Sealer::from_base64(&settings.seal_key_id, &settings.seal_key)?;
        let pricing = match &settings.pricing_catalogue {
            None => takosumi_cost::Catalogue::embedded().clone(),
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| e.to_string())
                .and_then(|t| takosumi_cost::Catalogue::parse(&t).map_err(|e| e.to_string()))
                .map_err(|e| crate::SettingsError {
                    problems: vec![format!(
                        "TAKOSUMI_PRICING_CATALOGUE ({}) is not a usable price catalogue: {e}",
                        path.display()
                    )],
                })?,
        };
        let runner = Runner::new(settings.runner.clone());
        Ok(Self {
            pool,
            bus,
            objects,
            sealer,
            runner,
            owner: format!(
                "{name}-{}-{}",
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ),
            lease_secs: settings.lease_secs,
            max_attempts: settings.max_attempts,
            relay_wake: Arc::new(Notify::new()),
            pricing: Arc::new(pricing),
            live_log: None,
        })
    }

    /// Who this process's events name: `handler:<owner>`.
    pub fn actor(&self) -> String {
        format!("handler:{}", self.owner)
    }

    /// Records an event on a Run; a failure to record is logged, never fatal to the step.
    /// Progress: committed without waiting for the disk ([`takosumi_store::progress`]).
    pub async fn event(&self, run_id: RunId, kind: EventKind, data: serde_json::Value) {
        let actor = self.actor();
        let recorded =
            takosumi_store::events::append_progress(&self.pool, run_id, kind, &actor, data);
        if let Err(e) = recorded.await {
            tracing::warn!(%run_id, %kind, error = %e, "could not record event");
        }
    }

    /// Appends tool output to the Run's log, masked with `masker` (the run's
    /// [`takosumi_runner::ToolEnv::masker`]). The runner already masked the output while
    /// it was read; masking again here also covers values registered after the tool
    /// printed (the plan's sensitive values, found by `show -json` after `plan`), and makes
    /// storing an unmasked log impossible to write by accident. In a
    /// [`Ctx::streaming_logs`] context only the part that did not go live is stored here,
    /// after the rest, and this returns once all of it is written.
    pub async fn log(
        &self,
        run_id: RunId,
        step: &str,
        masker: &takosumi_runner::Masker,
        text: &str,
    ) {
        if self.finish_live_log(run_id, step, masker, text).await {
            return;
        }
        if text.is_empty() {
            return;
        }
        let text = masker.mask(text);
        if let Err(e) =
            takosumi_store::logs::append_progress(&self.pool, run_id, &[(step, text.as_str())])
                .await
        {
            tracing::warn!(%run_id, step, error = %e, "could not store log");
        }
    }

    /// Keeps this process's lease on `run_id` alive while the guard lives. When the lease
    /// is lost (the reaper took the Run back), `lost()` fires and the step must stop before
    /// committing anything. When someone asks to cancel the Run (`POST /runs/{id}/cancel`
    /// records the request; this keeper polls for it every second), `cancel_requested()`
    /// fires: the step still holds the lease, interrupts the tool and ends the Run
    /// `canceled` itself.
    pub fn keep_lease(&self, run_id: RunId) -> LeaseGuard {
        let lost = CancellationToken::new();
        let cancel = CancellationToken::new();
        let (pool, owner, secs, lost_token, cancel_token) = (
            self.pool.clone(),
            self.owner.clone(),
            self.lease_secs,
            lost.clone(),
            cancel.clone(),
        );
        let period = Duration::from_millis(u64::try_from(secs).unwrap_or(60) * 1000 / 3);
        let poll = period.min(CANCEL_POLL);
        let task = tokio::spawn(async move {
            let mut last_renewal = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(poll).await;
                if !cancel_token.is_cancelled() {
                    match takosumi_store::runs::cancel::cancel_requested(&pool, run_id, &owner)
                        .await
                    {
                        Ok(true) => {
                            tracing::info!(%run_id, "cancel requested: interrupting the step");
                            cancel_token.cancel();
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(%run_id, error = %e, "could not check for a cancel request")
                        }
                    }
                }
                if last_renewal.elapsed() < period {
                    continue;
                }
                match takosumi_store::runs::renew_lease(&pool, run_id, &owner, secs).await {
                    Ok(true) => last_renewal = tokio::time::Instant::now(),
                    Ok(false) => {
                        tracing::warn!(%run_id, "lease lost");
                        lost_token.cancel();
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(%run_id, error = %e, "lease renewal failed; will retry")
                    }
                }
            }
        });
        LeaseGuard { lost, cancel, task }
    }
}

/// How often a running step looks for a cancel request.
const CANCEL_POLL: Duration = Duration::from_secs(1);

/// Renews a lease until dropped.
#[derive(Debug)]
pub struct LeaseGuard {
    lost: CancellationToken,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseGuard {
    /// Fires when the lease was lost.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Fires when a cancel of the Run was requested (the lease is still held).
    pub fn cancel_requested(&self) -> CancellationToken {
        self.cancel.clone()
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}
