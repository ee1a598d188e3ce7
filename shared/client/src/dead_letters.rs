//! The client side of `GET /api/v1/dead-letters`: what the steps could not process, per
//! step queue (admin tokens only).

use reqwest::Method;
use serde::{Deserialize, Serialize};

use crate::{Client, ClientError};

/// Every step queue's dead letters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetters {
    /// Messages waiting in all dead-letter queues.
    #[serde(default)]
    pub total: u64,
    /// One entry per step queue.
    #[serde(default)]
    pub queues: Vec<DeadQueue>,
}

/// One step queue's dead-letter queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadQueue {
    /// The step queue (`run.plan`).
    pub queue: String,
    /// Its dead-letter queue (`run.plan.dead`).
    pub dead_letter_queue: String,
    /// Messages waiting in it.
    pub depth: u64,
    /// The first few, oldest first (left in place).
    #[serde(default)]
    pub messages: Vec<DeadLetter>,
}

/// A message a step could not process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    /// The body as text (cut at 2000 characters).
    pub body: String,
    /// Whether the body was cut.
    #[serde(default)]
    pub truncated: bool,
    /// Why the step gave up, when a step dead-lettered it.
    #[serde(default)]
    pub error: Option<String>,
    /// Why the broker dead-lettered it (`rejected`, `delivery_limit`, …).
    #[serde(default)]
    pub broker_reason: Option<String>,
    /// The publisher's message id, if any.
    #[serde(default)]
    pub message_id: Option<String>,
}

impl Client {
    /// `GET /api/v1/dead-letters`: every dead-letter queue's depth and its first `limit`
    /// messages (the API's default is 10, at most 50).
    pub async fn dead_letters(&self, limit: Option<u16>) -> Result<DeadLetters, ClientError> {
        let path = "/api/v1/dead-letters";
        let mut rb = self.request(Method::GET, path);
        if let Some(l) = limit {
            rb = rb.query(&[("limit", l.to_string())]);
        }
        self.execute(Method::GET, path, rb).await
    }
}
