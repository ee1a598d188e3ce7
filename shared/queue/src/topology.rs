//! The exchange and queue layout, read from `infra/rabbitmq/topology.json` at build time
//! so the file in the repository is the one the processes declare.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};
use serde::Deserialize;

const TOPOLOGY_JSON: &str = include_str!("../../../infra/rabbitmq/topology.json");

/// The declared layout.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Topology {
    /// The direct exchange every wake-up goes through.
    pub exchange: String,
    /// The exchange dead letters go through.
    pub dead_letter_exchange: String,
    /// `quorum` (or `classic` for brokers without quorum queues).
    pub queue_type: String,
    /// Redeliveries before the broker dead-letters a message.
    pub delivery_limit: i64,
    /// One queue per step.
    pub queues: Vec<String>,
}

impl Topology {
    /// The layout in the repository.
    pub fn load() -> Self {
        // A broken topology file is a build defect; the unit test below catches it.
        serde_json::from_str(TOPOLOGY_JSON)
            .unwrap_or_else(|e| panic!("infra/rabbitmq/topology.json: {e}"))
    }

    /// The step queues each worker pool has its own of (`run.plan.<pool>`): the steps a
    /// pool's relay worker runs.
    pub const POOL_STEPS: [&'static str; 3] = ["run.plan", "run.apply", "run.drift"];

    /// A pool's queues (`run.plan.<pool>`, …).
    pub fn pool_queues(pool: &str) -> Vec<String> {
        Self::POOL_STEPS
            .iter()
            .map(|step| format!("{step}.{pool}"))
            .collect()
    }

    /// The dead-letter queue of a queue.
    pub fn dead_queue_name(queue: &str) -> String {
        format!("{queue}.dead")
    }

    /// Declares exchanges, queues, dead-letter queues and bindings (idempotent).
    pub async fn declare(&self, ch: &Channel) -> Result<(), lapin::Error> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        ch.exchange_declare(
            self.exchange.clone().into(),
            ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await?;
        ch.exchange_declare(
            self.dead_letter_exchange.clone().into(),
            ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await?;
        for queue in &self.queues {
            self.declare_queue(ch, queue).await?;
        }
        Ok(())
    }

    /// Declares one step queue and its dead-letter queue (also used for pool queues).
    pub async fn declare_queue(&self, ch: &Channel, queue: &str) -> Result<(), lapin::Error> {
        let dead = Self::dead_queue_name(queue);
        let opts = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut dead_args = FieldTable::default();
        dead_args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.clone().into()),
        );
        ch.queue_declare(dead.clone().into(), opts, dead_args)
            .await?;
        ch.queue_bind(
            dead.clone().into(),
            self.dead_letter_exchange.clone().into(),
            dead.clone().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.clone().into()),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.dead_letter_exchange.clone().into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(dead.into()),
        );
        if self.queue_type == "quorum" {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(self.delivery_limit),
            );
        }
        ch.queue_declare(queue.to_owned().into(), opts, args)
            .await?;
        ch.queue_bind(
            queue.to_owned().into(),
            self.exchange.clone().into(),
            queue.to_owned().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use takosumi_core::Topic;

    #[test]
    fn the_repository_topology_declares_every_step_queue() {
        let t = Topology::load();
        for topic in Topic::ALL {
            assert!(
                t.queues.iter().any(|q| q == topic.queue_name()),
                "{topic:?} missing"
            );
        }
        assert_eq!(Topology::dead_queue_name("run.plan"), "run.plan.dead");
        assert!(t.delivery_limit > 0);
    }
}
