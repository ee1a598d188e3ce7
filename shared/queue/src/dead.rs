//! Dead letters: the collector that moves them out of the broker into Postgres, and the
//! read-only depth of what it has not collected yet.
//!
//! Why move them instead of peeking at the queue: AMQP 0-9-1 has no read-only look at a
//! queue. Every way of seeing a message (`basic.get`, a consumer, the management API's "get
//! messages", whose `ack_requeue_true` is the same get-and-requeue) takes it and hands it
//! back, and handing back is not neutral: on a quorum queue each return counts as a
//! delivery (RabbitMQ before 4.3), RabbitMQ 4.0 gives every quorum queue a default delivery
//! limit of 20, and our dead-letter queues have no dead-letter exchange of their own — the
//! 20th look would drop the message. Returned messages can also come back in another order,
//! and two operators looking at once each see part of the queue. A stream queue is
//! read-only to read, but its entries cannot be removed one by one (no requeue or purge of a
//! single message), and the existing queues' type cannot change in place.
//!
//! So the collector consumes every step queue's dead-letter queue and stores each message in
//! `dead_letters` — committed before the message is acked, so a crash in between keeps the
//! message in the broker (it may then be stored twice; a wake-up requeued twice is harmless,
//! the second finds the claim taken or the step done). While an insert fails (Postgres
//! away) the message is held, unacked, and the insert retried; it goes back to the queue
//! only when the collector's channel closes. What operators see is a `SELECT`; requeue and
//! purge are transactions on those rows (`takosumi_store::dead_letters`). The only thing
//! still read from the broker is each dead-letter queue's depth (a passive declare, which
//! changes nothing): messages not collected yet, e.g. while no API runs.

use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use takosumi_core::RunMessage;
use takosumi_store::dead_letters::{self, NewDeadLetter};
use tokio_util::sync::CancellationToken;

use crate::{Broker, Bus, QueueError, Topology};

/// Messages a collector holds unacked at once.
const PREFETCH: u16 = 50;

/// A step queue's dead-letter queue and the messages waiting in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadQueueDepth {
    /// The step queue (`run.plan`).
    pub queue: String,
    /// Its dead-letter queue (`run.plan.dead`).
    pub dead_letter_queue: String,
    /// Messages waiting in it, not yet collected.
    pub depth: u32,
}

/// How often a collector looks for worker pools created since it started.
const POOL_RESCAN: Duration = Duration::from_secs(15);

/// The queues whose dead letters are collected: every step queue, then every worker
/// pool's (`run.plan.<pool>`, …).
pub async fn collected_queues(
    pool: &takosumi_store::Pool,
    topology: &Topology,
) -> Result<Vec<String>, takosumi_store::StoreError> {
    let mut queues = topology.queues.clone();
    for name in takosumi_store::pools::names(pool).await? {
        queues.extend(Topology::pool_queues(&name));
    }
    Ok(queues)
}

impl Broker {
    /// How many messages wait in each of `queues`' dead-letter queues (a passive declare
    /// per queue: nothing is taken, returned or reordered).
    pub async fn dead_letter_depths(
        &self,
        queues: &[String],
    ) -> Result<Vec<DeadQueueDepth>, QueueError> {
        let mut out = Vec::new();
        for queue in queues {
            let dead = Topology::dead_queue_name(queue);
            // A channel per queue: a failed passive declare closes its channel.
            let ch = self.channel().await?;
            let declared = ch
                .queue_declare(
                    dead.clone().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            let _ = ch.close(200, "depth read".into()).await;
            out.push(DeadQueueDepth {
                queue: queue.clone(),
                dead_letter_queue: dead,
                depth: declared.message_count(),
            });
        }
        Ok(out)
    }
}

/// Collects dead letters into Postgres until `shutdown` (reconnecting with backoff when the
/// broker goes away). Any number may run: each message goes to one of them.
pub async fn run_dead_letter_collector(
    pool: takosumi_store::Pool,
    bus: Arc<Bus>,
    shutdown: CancellationToken,
) {
    let backoff = || {
        ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(10))
            .without_max_times()
            .build()
    };
    let mut delays = backoff();
    while !shutdown.is_cancelled() {
        let started = tokio::time::Instant::now();
        match collect(&pool, &bus, &shutdown).await {
            Ok(()) => break,
            Err(e) => {
                if started.elapsed() > Duration::from_secs(10) {
                    delays = backoff();
                }
                let delay = delays.next().unwrap_or(Duration::from_secs(10));
                tracing::warn!(error = %e, ?delay, "dead-letter collector stopped; reconnecting");
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// One session: consume every dead-letter queue on one channel until `shutdown` (`Ok`) or
/// the connection fails (`Err`). A worker pool created meanwhile is picked up within
/// [`POOL_RESCAN`].
async fn collect(
    pool: &takosumi_store::Pool,
    bus: &Bus,
    shutdown: &CancellationToken,
) -> Result<(), QueueError> {
    let broker = bus.get().await?;
    let ch = broker.channel().await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let mut watched = std::collections::BTreeSet::new();
    let mut all = futures::stream::SelectAll::new();
    // The step queues first: a pool listing that fails (Postgres away) must not keep
    // their dead letters in the broker.
    let mut wanted = broker.topology().queues.clone();
    let mut rescan = tokio::time::interval(POOL_RESCAN);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        for queue in std::mem::take(&mut wanted) {
            if watched.contains(&queue) {
                continue;
            }
            if !broker.topology().queues.contains(&queue) {
                // A pool's queues are declared when it is created; declaring again (the
                // same arguments, so a no-op) covers a broker that lost them since,
                // where consuming a missing queue would close the channel.
                broker.topology().declare_queue(&ch, &queue).await?;
            }
            let dead = Topology::dead_queue_name(&queue);
            let consumer = ch
                .basic_consume(
                    dead.clone().into(),
                    format!("collector-{dead}-{}", std::process::id()).into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let name = queue.clone();
            all.push(consumer.map(move |d| (name.clone(), d)).boxed());
            watched.insert(queue);
        }
        let next = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            _ = rescan.tick() => {
                match collected_queues(pool, broker.topology()).await {
                    Ok(queues) => wanted = queues,
                    Err(e) => tracing::warn!(error = %e, "could not list the worker pools' queues; will look again"),
                }
                continue;
            }
            next = all.next() => next,
        };
        let (queue, delivery) = match next {
            None => {
                break Err(QueueError::Refused(
                    "the dead-letter consumers were canceled by the broker".into(),
                ));
            }
            Some((_, Err(e))) => break Err(e.into()),
            Some((queue, Ok(d))) => (queue, d),
        };
        let letter = describe(&queue, &delivery.data, &delivery.properties);
        let store = || dead_letters::insert(pool, &letter);
        let stored = store
            .retry(
                ExponentialBuilder::default()
                    .with_jitter()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(10))
                    .without_max_times(),
            )
            .sleep(tokio::time::sleep)
            .when(|e: &takosumi_store::StoreError| e.retryable() && !shutdown.is_cancelled())
            .notify(|e, delay| {
                tracing::warn!(%queue, error = %e, ?delay, "could not store a dead letter; holding it and retrying");
            })
            .await;
        match stored {
            Ok(id) => {
                tracing::warn!(%queue, dead_letter = id, reason = ?letter.error.as_ref().or(letter.broker_reason.as_ref()), "dead letter collected");
                delivery.acker.ack(BasicAckOptions::default()).await?;
            }
            // Not acked: it goes back to its queue when the channel closes below.
            Err(e) => break Err(e.into()),
        }
    };
    let _ = ch.close(200, "collector stopped".into()).await;
    result
}

fn describe(queue: &str, data: &[u8], props: &lapin::BasicProperties) -> NewDeadLetter {
    let headers = props.headers().as_ref().map(|h| h.inner().clone());
    let header_text = |name: &str| -> Option<String> {
        headers.as_ref().and_then(|h| h.get(name)).and_then(text_of)
    };
    let broker_reason = headers
        .as_ref()
        .and_then(|h| h.get("x-death"))
        .and_then(|v| match v {
            AMQPValue::FieldArray(a) => a.as_slice().first().cloned(),
            _ => None,
        })
        .and_then(|first| match first {
            AMQPValue::FieldTable(t) => t.inner().get("reason").and_then(text_of),
            _ => None,
        });
    NewDeadLetter {
        queue: queue.to_owned(),
        body: data.to_vec(),
        run_id: RunMessage::from_bytes(data).ok().map(|m| m.run_id),
        error: header_text("x-takosumi-error"),
        broker_reason,
        message_id: props.message_id().as_ref().map(|m| m.to_string()),
    }
}

fn text_of(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}
