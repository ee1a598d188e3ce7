//! Reading the dead-letter queues for operators, over AMQP itself.
//!
//! Why AMQP and not the management HTTP API or a table: the management plugin is an
//! optional broker add-on that production brokers often do not expose, and a table
//! written by the consume loop would miss what the broker dead-letters on its own (a body
//! rejected as unparseable, a delivery over `x-delivery-limit`). Reading the queue is the
//! one view that cannot disagree with what is really there. A peek takes messages with
//! `basic.get` without acking and hands every one back (`basic.nack` with requeue) before
//! it returns: nothing is removed, and no step consumes a dead-letter queue, so holding
//! them for a moment disturbs nothing.

use lapin::options::{BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::{Broker, QueueError, Topology};

/// The largest body shown of a dead letter (they are wake-ups of a few dozen bytes; a
/// foreign body can be anything).
const MAX_BODY_CHARS: usize = 2000;

/// One step queue's dead letters.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadQueue {
    /// The step queue (`run.plan`).
    pub queue: String,
    /// Its dead-letter queue (`run.plan.dead`).
    pub dead_letter_queue: String,
    /// Messages waiting in the dead-letter queue.
    pub depth: u32,
    /// The first few of them, oldest first, left in place.
    pub messages: Vec<DeadLetter>,
}

/// A message that a step could not process.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    /// The body as text (lossy UTF-8, cut at 2000 characters).
    pub body: String,
    /// Whether the body was cut.
    pub truncated: bool,
    /// Why the step gave up, when a step dead-lettered it (`x-takosumi-error`).
    pub error: Option<String>,
    /// Why the broker dead-lettered it (`rejected`, `delivery_limit`, …), from `x-death`.
    pub broker_reason: Option<String>,
    /// The publisher's message id (the outbox row id), if any.
    pub message_id: Option<String>,
}

impl Broker {
    /// Depth and the first `limit` messages of every step queue's dead-letter queue.
    pub async fn peek_dead_letters(&self, limit: u16) -> Result<Vec<DeadQueue>, QueueError> {
        let mut out = Vec::new();
        for queue in &self.topology().queues {
            out.push(self.peek_dead_queue(queue, limit).await?);
        }
        Ok(out)
    }

    async fn peek_dead_queue(&self, queue: &str, limit: u16) -> Result<DeadQueue, QueueError> {
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
        let depth = declared.message_count();
        let mut messages = Vec::new();
        let mut last_tag = None;
        while messages.len() < usize::from(limit)
            && u32::try_from(messages.len()).unwrap_or(u32::MAX) < depth
        {
            let Some(got) = ch
                .basic_get(dead.clone().into(), BasicGetOptions { no_ack: false })
                .await?
            else {
                break;
            };
            let d = got.delivery;
            last_tag = Some(d.delivery_tag);
            messages.push(describe(&d.data, &d.properties));
        }
        if let Some(tag) = last_tag {
            ch.basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await?;
        }
        // Closing also returns anything still unacked.
        let _ = ch.close(200, "peeked".into()).await;
        Ok(DeadQueue {
            queue: queue.to_owned(),
            dead_letter_queue: dead,
            depth,
            messages,
        })
    }
}

fn describe(data: &[u8], props: &lapin::BasicProperties) -> DeadLetter {
    let text = String::from_utf8_lossy(data);
    let truncated = text.chars().count() > MAX_BODY_CHARS;
    let body: String = text.chars().take(MAX_BODY_CHARS).collect();
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
    DeadLetter {
        body,
        truncated,
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
