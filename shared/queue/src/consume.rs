//! The consume loop. A delivery is acked as soon as it is parsed: the handler's claim in
//! Postgres, not the broker, is what keeps a Run from running twice, and an apply can run
//! far longer than a broker would keep a delivery unacked. A body that is not a Run
//! message is rejected into the dead-letter queue; a handler error that may pass is
//! retried by re-publishing with a backoff, a bounded number of times, then dead-lettered
//! with the reason so operators can see it.
//!
//! A retry or dead-letter is published through the [`Bus`], never on the connection the
//! message came in on: after a broker restart that connection is dead, and a re-publish
//! on it would be lost until the reaper's stuck-queue sweep noticed the Run. The bus
//! hands out the live connection (reconnecting), and the publish is retried with backoff
//! (`backon`) until the broker is back.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicQosOptions,
    BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use takosumi_core::{Outcome, RunMessage, StepError};
use takosumi_telemetry::{TraceParent, metrics, step_span};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::{Bus, QueueError};

const RETRY_HEADER: &str = "x-takosumi-retries";
/// The W3C trace context of the Run a message wakes.
pub(crate) const TRACEPARENT_HEADER: &str = takosumi_telemetry::TRACEPARENT_HEADER;
/// When the message's outbox row became due, milliseconds since the epoch.
pub(crate) const DUE_HEADER: &str = "x-takosumi-due-ms";

/// What a delivery's headers say besides its body.
#[derive(Debug, Clone, Default)]
struct Meta {
    retries: u32,
    trace: Option<TraceParent>,
    due_ms: Option<i64>,
}

impl Meta {
    fn of(props: &lapin::BasicProperties) -> Self {
        let get = |name: &str| {
            props
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(name).cloned())
        };
        let int = |v: AMQPValue| match v {
            AMQPValue::LongUInt(n) => Some(i64::from(n)),
            AMQPValue::LongLongInt(n) => Some(n),
            AMQPValue::LongInt(n) => Some(i64::from(n)),
            _ => None,
        };
        let text = |v: AMQPValue| match v {
            AMQPValue::LongString(s) => Some(s.to_string()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        };
        Self {
            retries: get(RETRY_HEADER)
                .and_then(int)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(0),
            trace: get(TRACEPARENT_HEADER)
                .and_then(text)
                .and_then(|t| TraceParent::parse(&t)),
            due_ms: get(DUE_HEADER).and_then(int),
        }
    }
}

/// How a step consumes its queue.
#[derive(Debug, Clone)]
pub struct ConsumeConfig {
    /// The queue (`run.plan`, or a pool queue `run.plan.<pool>`).
    pub queue: String,
    /// Messages handled at once by this process.
    pub concurrency: u16,
    /// Re-publishes of a message whose handler failed transiently, before dead-lettering.
    pub max_retries: u32,
    /// The first retry delay; doubles each time, with jitter, up to 30 s.
    pub retry_base: Duration,
}

impl ConsumeConfig {
    /// Defaults for a step queue.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            concurrency: 2,
            max_retries: 5,
            retry_base: Duration::from_millis(200),
        }
    }
}

/// Consumes `cfg.queue` on the bus's current connection until `shutdown` fires (then
/// stops consuming, lets in-flight handlers finish, and returns `Ok`) or the broker
/// connection fails (returns `Err`; the caller reconnects).
pub async fn consume<H, Fut>(
    bus: &Arc<Bus>,
    cfg: &ConsumeConfig,
    handler: H,
    shutdown: CancellationToken,
) -> Result<(), QueueError>
where
    H: Fn(RunMessage) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, StepError>> + Send + 'static,
{
    let broker = bus.get().await?;
    let ch = broker.channel().await?;
    ch.basic_qos(cfg.concurrency, BasicQosOptions::default())
        .await?;
    let tag = format!("{}-{}", cfg.queue, std::process::id());
    let mut consumer = ch
        .basic_consume(
            cfg.queue.clone().into(),
            tag.clone().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let permits = Arc::new(Semaphore::new(usize::from(cfg.concurrency.max(1))));
    let mut tasks = JoinSet::new();
    let result = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            next = consumer.next() => {
                let delivery = match next {
                    None => break Err(QueueError::Refused(format!("consumer of {} was canceled by the broker", cfg.queue))),
                    Some(Err(e)) => break Err(e.into()),
                    Some(Ok(d)) => d,
                };
                let Ok(permit) = permits.clone().acquire_owned().await else { break Ok(()) };
                match RunMessage::from_bytes(&delivery.data) {
                    Err(e) => {
                        tracing::warn!(queue = %cfg.queue, error = %e, "poison message: not a Run message; dead-lettering it");
                        delivery.acker.reject(BasicRejectOptions { requeue: false }).await?;
                    }
                    Ok(msg) => {
                        delivery.acker.ack(BasicAckOptions::default()).await?;
                        let meta = Meta::of(&delivery.properties);
                        let (bus, cfg, handler) = (bus.clone(), cfg.clone(), handler.clone());
                        tasks.spawn(async move {
                            let _permit = permit;
                            let _ = handle_one(&bus, &cfg, msg, meta, handler).await;
                        });
                    }
                }
            }
        }
    };
    let _ = ch
        .basic_cancel(tag.into(), BasicCancelOptions::default())
        .await;
    while tasks.join_next().await.is_some() {}
    let _ = ch.close(200, "consumer stopped".into()).await;
    result
}

/// How a `--once` process consumes: until one message did work, `max_messages` were
/// handled, or the queue stayed empty for `idle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnceLimits {
    /// Messages taken at most (duplicates and deferrals count too).
    pub max_messages: u32,
    /// How long an empty queue is waited on before giving up.
    pub idle: Duration,
}

/// What a `--once` process did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OnceReport {
    /// Messages taken from the queue (poison ones included).
    pub messages: u32,
    /// Whether one of them did work (the step ran: `Done` or `Failed`).
    pub worked: bool,
}

/// The `--once` mode of [`consume`], for a process that runs as one Kubernetes Job: takes
/// messages one at a time with `basic.get` (no prefetch, so nothing waits unacked in a
/// process that is about to exit) and hands each to the same handling as the consume loop
/// (ack when parsed, retry or dead-letter on error). Stops after the first message whose
/// handler did work, after `max_messages`, when the queue stays empty for `idle`, or on
/// `shutdown` (in-flight work finishes first).
pub async fn consume_once<H, Fut>(
    bus: &Arc<Bus>,
    cfg: &ConsumeConfig,
    limits: OnceLimits,
    handler: H,
    shutdown: CancellationToken,
) -> Result<OnceReport, QueueError>
where
    H: Fn(RunMessage) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, StepError>> + Send + 'static,
{
    let mut report = OnceReport::default();
    let mut idle_since = tokio::time::Instant::now();
    while report.messages < limits.max_messages && !shutdown.is_cancelled() {
        let ch = bus.get().await?.channel().await?;
        let got = ch
            .basic_get(cfg.queue.clone().into(), BasicGetOptions::default())
            .await?;
        let Some(message) = got else {
            let _ = ch.close(200, "empty".into()).await;
            if idle_since.elapsed() >= limits.idle {
                break;
            }
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
            continue;
        };
        let delivery = message.delivery;
        report.messages += 1;
        match RunMessage::from_bytes(&delivery.data) {
            Err(e) => {
                tracing::warn!(queue = %cfg.queue, error = %e, "poison message: not a Run message; dead-lettering it");
                delivery
                    .acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
            }
            Ok(msg) => {
                delivery.acker.ack(BasicAckOptions::default()).await?;
                let meta = Meta::of(&delivery.properties);
                let outcome = handle_one(bus, cfg, msg, meta, handler.clone()).await;
                if matches!(outcome, Some(Outcome::Done | Outcome::Failed(_))) {
                    report.worked = true;
                }
            }
        }
        let _ = ch.close(200, "taken".into()).await;
        if report.worked {
            break;
        }
        idle_since = tokio::time::Instant::now();
    }
    Ok(report)
}

async fn handle_one<H, Fut>(
    bus: &Bus,
    cfg: &ConsumeConfig,
    msg: RunMessage,
    meta: Meta,
    handler: H,
) -> Option<Outcome>
where
    H: Fn(RunMessage) -> Fut,
    Fut: Future<Output = Result<Outcome, StepError>>,
{
    let run_id = msg.run_id;
    let retries = meta.retries;
    let step = cfg.queue.strip_prefix("run.").unwrap_or(&cfg.queue);
    if let Some(due) = meta.due_ms {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let lag = u64::try_from(now.saturating_sub(due)).unwrap_or(0);
        metrics::global().observe_queue_lag(step, Duration::from_millis(lag));
    }
    let span = step_span(step, &run_id, meta.trace.as_ref());
    let body = serde_json::to_vec(&msg.to_json()).unwrap_or_default();
    let started = tokio::time::Instant::now();
    let result = handler(msg).instrument(span.clone()).await;
    let outcome_label = match &result {
        Ok(Outcome::Done) => "done",
        Ok(Outcome::Failed(_)) => "failed",
        Ok(Outcome::Skipped(_)) => "skipped",
        Ok(Outcome::Deferred(_)) => "deferred",
        Err(_) => "error",
    };
    metrics::global().observe_step(step, outcome_label, started.elapsed());
    // What follows (a retry's wait and re-publish, a dead-letter) belongs to the step too.
    let after = async move {
        match result {
            Ok(outcome) => {
                tracing::info!(queue = %cfg.queue, %run_id, ?outcome, "handled");
                return Some(outcome);
            }
            Err(e) if e.retryable() && retries < cfg.max_retries => {
                let delay = retry_delay(cfg.retry_base, retries);
                tracing::warn!(queue = %cfg.queue, %run_id, error = %e, retry = retries + 1, ?delay, "handler failed; retrying");
                tokio::time::sleep(delay).await;
                let mut headers = FieldTable::default();
                headers.insert(RETRY_HEADER.into(), AMQPValue::LongUInt(retries + 1));
                if let Some(trace) = &meta.trace {
                    headers.insert(
                        TRACEPARENT_HEADER.into(),
                        AMQPValue::LongString(trace.to_string().into()),
                    );
                }
                let publish = || async {
                    bus.get()
                        .await?
                        .publish(&cfg.queue, &body, None, headers.clone())
                        .await
                };
                if let Err(pe) = with_broker_backoff(publish, &cfg.queue, run_id).await {
                    // The Run is still in Postgres: the reaper's stuck-queue sweep wakes it again.
                    tracing::error!(queue = %cfg.queue, %run_id, error = %pe, "could not re-publish for retry");
                }
            }
            Err(e) => {
                tracing::error!(queue = %cfg.queue, %run_id, error = %e, retries, "handler failed for good; dead-lettering");
                let reason = e.to_string();
                let publish = || async {
                    bus.get()
                        .await?
                        .publish_dead(&cfg.queue, &body, &reason)
                        .await
                };
                if let Err(pe) = with_broker_backoff(publish, &cfg.queue, run_id).await {
                    tracing::error!(queue = %cfg.queue, %run_id, error = %pe, "could not dead-letter");
                }
            }
        }
        None
    };
    after.instrument(span).await
}

/// Retries a publish through the bus while the broker is away: exponential backoff with
/// jitter from 200 ms up to 5 s between tries, for about a minute in all (a broker
/// restart takes seconds). Each try asks the bus again, so it lands on a fresh
/// connection once the broker is back.
async fn with_broker_backoff<F, Fut>(
    publish: F,
    queue: &str,
    run_id: takosumi_core::RunId,
) -> Result<(), QueueError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), QueueError>>,
{
    publish
        .retry(
            ExponentialBuilder::default()
                .with_jitter()
                .with_min_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_secs(5))
                .with_max_times(16),
        )
        .sleep(tokio::time::sleep)
        .when(QueueError::retryable)
        .notify(|e: &QueueError, delay: Duration| {
            tracing::warn!(%queue, %run_id, error = %e, ?delay, "broker unavailable for a re-publish; backing off");
        })
        .await
}

/// Exponential backoff with full jitter, capped at 30 s.
fn retry_delay(base: Duration, retries: u32) -> Duration {
    let exp = base
        .saturating_mul(1u32 << retries.min(16))
        .min(Duration::from_secs(30));
    let jitter = rand_fraction();
    exp.mul_f64(0.5 + jitter / 2.0)
}

fn rand_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(u64::from(std::process::id()));
    (h.finish() % 1000) as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_grow_and_stay_capped() {
        let base = Duration::from_millis(200);
        let first = retry_delay(base, 0);
        assert!(first >= Duration::from_millis(100) && first <= Duration::from_millis(200));
        let late = retry_delay(base, 30);
        assert!(late <= Duration::from_secs(30));
        assert!(late >= Duration::from_secs(15));
    }
}
