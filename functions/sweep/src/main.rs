//! `takosumi-sweep`: the scheduled, read-only drift sweep, with its outbox relay
//! (`--once`: one pass, its wake-ups published, then exit — for a CronJob).

use std::time::Duration;

use clap::Parser;
use takosumi_runtime::{Ctx, Settings, flush_outbox, init_telemetry, shutdown_signal};

#[derive(Parser)]
#[command(
    name = "takosumi-sweep",
    about = "Enqueues the drift checks of every Capsule that is due"
)]
struct Cli {
    /// One sweep pass, publish the checks it enqueued, exit 0 (a Kubernetes CronJob).
    /// Without it the process sweeps every TAKOSUMI_SWEEP_INTERVAL_MS until SIGTERM.
    #[arg(long)]
    once: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = Settings::from_env()?;
    let _telemetry = init_telemetry("sweep");
    let ctx = Ctx::connect(&settings, "sweep").await?;
    if cli.once {
        let enqueued = takosumi_sweep::sweep_once(&ctx).await?;
        let published = flush_outbox(&ctx).await;
        tracing::info!(enqueued, published, "--once: sweep pass done");
        ctx.bus.close().await;
        return Ok(());
    }
    let interval = std::env::var("TAKOSUMI_SWEEP_INTERVAL_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000u64);
    let shutdown = shutdown_signal();
    let relay_stop = tokio_util::sync::CancellationToken::new();
    let bus = ctx.bus.clone();
    let metrics = takosumi_runtime::metrics_server::spawn(
        settings.metrics_listen.as_deref(),
        None,
        relay_stop.clone(),
    )
    .await?;
    let relay = tokio::spawn(takosumi_queue::run_relay(
        ctx.pool.clone(),
        move || {
            let bus = bus.clone();
            async move { bus.get().await }
        },
        ctx.relay_wake.clone(),
        relay_stop.clone(),
    ));
    takosumi_sweep::run(ctx.clone(), Duration::from_millis(interval), shutdown).await;
    ctx.relay_wake.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay_stop.cancel();
    let _ = relay.await;
    if let Some(metrics) = metrics {
        let _ = metrics.await;
    }
    ctx.bus.close().await;
    Ok(())
}
