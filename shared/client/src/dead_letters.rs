//! The client side of the dead-letter endpoints (admin tokens only): what the steps could
//! not process, per step queue, and the operator actions on it — requeue (back onto the
//! work queue) and purge.

use reqwest::Method;
use serde::{Deserialize, Serialize};

use crate::{Client, ClientError};

/// Every step queue's dead letters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetters {
    /// Dead letters stored, all queues.
    #[serde(default)]
    pub total: u64,
    /// Messages still in the broker's dead-letter queues, not collected yet (`None` while
    /// the broker is away).
    #[serde(default)]
    pub uncollected: Option<u64>,
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
    /// Dead letters stored for it.
    pub depth: u64,
    /// Messages still in its dead-letter queue, not collected yet.
    #[serde(default)]
    pub uncollected: Option<u64>,
    /// The first few, oldest first.
    #[serde(default)]
    pub messages: Vec<DeadLetter>,
}

/// A message a step could not process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    /// What a requeue or purge names.
    #[serde(default)]
    pub id: i64,
    /// The Run it wakes, when the body is a Run message (only those can be requeued).
    #[serde(default)]
    pub run_id: Option<String>,
    /// When it was collected from the broker.
    #[serde(default)]
    pub collected_at: Option<String>,
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

/// Which dead letters an operator action takes (one of the three is required).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSelection {
    /// Those of one step queue (`run.plan`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// Those with these ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids: Option<Vec<i64>>,
    /// Every one.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
}

/// What a requeue did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequeueResult {
    /// Moved back onto their work queue.
    #[serde(default)]
    pub requeued: Vec<RequeuedLetter>,
    /// Left in place: not Run messages, which no step can process (purge them).
    #[serde(default)]
    pub skipped: Vec<SkippedLetter>,
    /// Requeueable ones still selected (more than one call's batch of 1,000).
    #[serde(default)]
    pub remaining: u64,
}

/// A dead letter moved back onto its work queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequeuedLetter {
    /// Its id.
    pub id: i64,
    /// The work queue.
    pub queue: String,
    /// The Run woken.
    pub run_id: String,
}

/// A dead letter a requeue left in place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SkippedLetter {
    /// Its id.
    pub id: i64,
    /// Its queue.
    pub queue: String,
    /// Why.
    pub reason: String,
}

/// What a purge did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PurgeResult {
    /// How many were deleted.
    pub purged: u64,
    /// Their ids.
    #[serde(default)]
    pub ids: Vec<i64>,
}

impl Client {
    /// `POST /api/v1/dead-letters/requeue`: moves the selected dead letters back onto their
    /// work queue (at most 1,000 a call).
    pub async fn requeue_dead_letters(
        &self,
        selection: &DeadLetterSelection,
    ) -> Result<RequeueResult, ClientError> {
        let path = "/api/v1/dead-letters/requeue";
        let rb = self.request(Method::POST, path).json(selection);
        self.execute(Method::POST, path, rb).await
    }

    /// `POST /api/v1/dead-letters/purge`: deletes the selected dead letters for good.
    pub async fn purge_dead_letters(
        &self,
        selection: &DeadLetterSelection,
    ) -> Result<PurgeResult, ClientError> {
        let path = "/api/v1/dead-letters/purge";
        let rb = self.request(Method::POST, path).json(selection);
        self.execute(Method::POST, path, rb).await
    }

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
