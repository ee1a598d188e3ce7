//! The loop a step binary runs: consume its queue (reconnecting with backoff when the
//! broker goes away), relay its outbox, reap expired leases, and on shutdown stop
//! consuming, let in-flight work finish and close.

use std::future::Future;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use takosumi_core::{Outcome, RunMessage, StepError, Topic};
use takosumi_queue::{ConsumeConfig, consume, run_relay};
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
    let mut cfg = ConsumeConfig::new(topic.queue_name());
    cfg.concurrency = settings.concurrency;
    let step = {
        let ctx = ctx.clone();
        move |msg: RunMessage| {
            let (ctx, handler) = (ctx.clone(), handler.clone());
            async move { handler(ctx, msg).await }
        }
    };
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
    ctx.bus.close().await;
    ctx.pool.close().await;
    Ok(())
}
