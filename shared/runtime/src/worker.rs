//! The loop a step binary runs: consume its queue (reconnecting with backoff when the
//! broker goes away), relay its outbox, reap expired leases, and on shutdown stop
//! consuming, let in-flight work finish and close.

use std::future::Future;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use takosumi_core::{Outcome, RunMessage, StepError, Topic};
use takosumi_queue::{ConsumeConfig, OnceLimits, consume, consume_once, relay_once, run_relay};
use tokio_util::sync::CancellationToken;

use crate::{Ctx, RuntimeError, Settings, run_reaper};

/// A token cancelled on SIGTERM or Ctrl-C.
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            if let Ok(mut term) = signal(SignalKind::terminate()) {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            } else {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutdown requested: stop consuming, finish in-flight work");
        t.cancel();
    });
    token
}

/// How a step process runs, from its command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerMode {
    /// Consume until SIGTERM (a Deployment, or `infra/local`'s processes).
    Serve,
    /// Take at most one Run's worth of work, finish it, publish its wake-ups, exit 0 (a
    /// Kubernetes Job started per queued message).
    Once(OnceLimits),
}

#[derive(Debug, clap::Parser)]
struct WorkerCli {
    /// Claim at most one Run, finish it, publish what it committed and exit 0: for a
    /// Kubernetes Job started per queued message (KEDA ScaledJob). Without it the process
    /// consumes until SIGTERM.
    #[arg(long)]
    once: bool,
    /// With --once: messages taken at most before exiting (duplicates of finished Runs count).
    #[arg(long, default_value_t = 10, requires = "once")]
    max_messages: u32,
    /// With --once: seconds an empty queue is waited on before exiting 0.
    #[arg(long, default_value_t = 10, requires = "once")]
    idle_secs: u64,
}

impl WorkerMode {
    /// Reads the command line of the step binary `name` (`takosumi-plan`, …); `--help`
    /// and bad flags print and exit as clap does.
    pub fn from_args(name: &'static str) -> Self {
        use clap::{CommandFactory, FromArgMatches};
        let matches = WorkerCli::command()
            .name(name)
            .about("A Takosumi step: consumes its queue and runs one step per Run")
            .get_matches();
        let cli = WorkerCli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        if cli.once {
            Self::Once(OnceLimits {
                max_messages: cli.max_messages.max(1),
                idle: Duration::from_secs(cli.idle_secs),
            })
        } else {
            Self::Serve
        }
    }
}

/// Runs a step in `mode`: until `shutdown` ([`WorkerMode::Serve`]) or for one Run's worth
/// of work ([`WorkerMode::Once`]).
pub async fn run_step<H, Fut>(
    ctx: Ctx,
    settings: &Settings,
    topic: Topic,
    handler: H,
    mode: WorkerMode,
    shutdown: CancellationToken,
) -> Result<(), RuntimeError>
where
    H: Fn(Ctx, RunMessage) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, StepError>> + Send + 'static,
{
    match mode {
        WorkerMode::Serve => run_worker(ctx, settings, topic, handler, shutdown).await,
        WorkerMode::Once(limits) => run_once(ctx, topic, handler, limits, shutdown).await,
    }
}

/// One Run's worth of work (see [`consume_once`]), then the outbox rows this process
/// committed are published before it exits, so the next step need not wait for another
/// process's relay (which would publish them anyway: they are in Postgres). No reaper
/// runs here: the long-running processes (API, gate, approve) reap for everyone.
async fn run_once<H, Fut>(
    ctx: Ctx,
    topic: Topic,
    handler: H,
    limits: OnceLimits,
    shutdown: CancellationToken,
) -> Result<(), RuntimeError>
where
    H: Fn(Ctx, RunMessage) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, StepError>> + Send + 'static,
{
    if matches!(topic, Topic::Plan | Topic::Apply | Topic::Drift) {
        ctx.runner.start_up().await?;
    }
    let mut cfg = ConsumeConfig::new(topic.queue_name());
    cfg.concurrency = 1;
    let step = with_ctx(&ctx, handler);
    let report = consume_once(&ctx.bus, &cfg, limits, step, shutdown).await;
    let flushed = flush_outbox(&ctx).await;
    ctx.bus.close().await;
    ctx.pool.close().await;
    let report = report?;
    tracing::info!(
        queue = %cfg.queue,
        messages = report.messages,
        worked = report.worked,
        outbox_published = flushed,
        "--once: done"
    );
    Ok(())
}

/// The consumer's handler: the step's `handler` given this process's context.
fn with_ctx<H, Fut>(
    ctx: &Ctx,
    handler: H,
) -> impl Fn(RunMessage) -> Fut + Clone + Send + Sync + 'static
where
    H: Fn(Ctx, RunMessage) -> Fut + Clone + Send + Sync + 'static,
{
    let ctx = ctx.clone();
    move |msg| handler(ctx.clone(), msg)
}

/// How long [`flush_outbox`] keeps trying while nothing it publishes gets through.
const FLUSH_STALL: Duration = Duration::from_secs(20);

/// Publishes due outbox rows until none are left: a `--once` process's wake-ups are out
/// when it exits, however many it made (a sweep's 100,000 take longer than a fixed bound).
/// A broker that is away for [`FLUSH_STALL`] leaves the rest to the other relays. Returns
/// how many this process sent.
pub async fn flush_outbox(ctx: &Ctx) -> usize {
    let mut sent = 0;
    let mut deadline = tokio::time::Instant::now() + FLUSH_STALL;
    while tokio::time::Instant::now() < deadline {
        let result = match ctx.bus.get().await {
            Ok(broker) => relay_once(&ctx.pool, &broker).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(0) => break,
            Ok(n) => {
                sent += n;
                deadline = tokio::time::Instant::now() + FLUSH_STALL;
            }
            Err(e) => {
                tracing::warn!(error = %e, "--once: outbox not flushed; another relay will publish it");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    sent
}

/// Runs a step until `shutdown`.
pub async fn run_worker<H, Fut>(
    ctx: Ctx,
    settings: &Settings,
    topic: Topic,
    handler: H,
    shutdown: CancellationToken,
) -> Result<(), RuntimeError>
where
    H: Fn(Ctx, RunMessage) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, StepError>> + Send + 'static,
{
    if matches!(topic, Topic::Plan | Topic::Apply | Topic::Drift) {
        // Before any claim: a runner whose sandbox cannot work here must not take a Run.
        ctx.runner.start_up().await?;
    }
    let background = CancellationToken::new();
    let relay = {
        let bus = ctx.bus.clone();
        tokio::spawn(run_relay(
            ctx.pool.clone(),
            move || {
                let bus = bus.clone();
                async move { bus.get().await }
            },
            ctx.relay_wake.clone(),
            background.clone(),
        ))
    };
    let reaper = tokio::spawn(run_reaper(
        ctx.clone(),
        Duration::from_millis(settings.reaper_interval_ms),
        settings.stuck_queued_secs,
        background.clone(),
    ));
    let metrics =
        crate::metrics_server::spawn(settings.metrics_listen.as_deref(), None, background.clone())
            .await
            .map_err(|e| crate::SettingsError {
                problems: vec![format!("TAKOSUMI_METRICS_LISTEN cannot be bound: {e}")],
            })?;
    let mut cfg = ConsumeConfig::new(topic.queue_name());
    cfg.concurrency = settings.concurrency;
    let step = with_ctx(&ctx, handler);
    // Reconnect delays grow (with jitter) while the broker stays away and start small
    // again after a session that ran: a second outage an hour later is not met with the
    // longest delay of the first.
    let reconnect_backoff = || {
        ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(5))
            .without_max_times()
            .build()
    };
    let mut delays = reconnect_backoff();
    while !shutdown.is_cancelled() {
        let session = tokio::time::Instant::now();
        let result = consume(&ctx.bus, &cfg, step.clone(), shutdown.clone()).await;
        match result {
            Ok(()) => break,
            Err(e) => {
                if session.elapsed() > Duration::from_secs(10) {
                    delays = reconnect_backoff();
                }
                let delay = delays.next().unwrap_or(Duration::from_secs(5));
                tracing::warn!(error = %e, ?delay, "consumer stopped; reconnecting");
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    // Give the relay a moment to publish what the last handlers committed.
    ctx.relay_wake.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    background.cancel();
    let _ = relay.await;
    let _ = reaper.await;
    if let Some(metrics) = metrics {
        let _ = metrics.await;
    }
    ctx.bus.close().await;
    ctx.pool.close().await;
    Ok(())
}
