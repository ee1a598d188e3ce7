//! Dead letters for operators (admin tokens only, instance-wide): what the steps could not
//! process — a body that is not a Run message, a Run that does not exist, a fault that
//! outlasted its retries — seen instead of silently dropped, and two documented actions.
//!
//! - `GET /api/v1/dead-letters?limit=` lists, per step queue, the dead letters stored in
//!   Postgres (oldest first) and how many still wait in the broker's dead-letter queue, not
//!   collected yet. Viewing is read-only: a `SELECT` and a passive queue declare; no message
//!   is taken from the broker and handed back (see `takosumi_queue`'s `dead` module for why
//!   a get-and-requeue peek is not safe, and for the collector that moves dead letters out
//!   of the broker, which runs beside this API).
//! - `POST /api/v1/dead-letters/requeue` `{"queue": "run.plan"}` | `{"ids": [1, 2]}` |
//!   `{"all": true}` moves the selected dead letters back onto their work queue: each one's
//!   Run gets a wake-up through the outbox in the transaction that deletes its row, so a
//!   requeue is never lost nor half done, and the wake-up starts with fresh retries. At most
//!   1,000 per call, oldest first; `remaining` says how many requeueable ones are left. A
//!   message that is not a Run message can never be processed; it stays, listed under
//!   `skipped`, for a purge. A
//!   step that wakes for a Run already done does nothing, so requeueing is always safe.
//! - `POST /api/v1/dead-letters/purge` with the same selection deletes them for good.
//!
//! A selection is required: `{}` is refused rather than read as "everything".

use std::collections::BTreeMap;

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::Method;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use takosumi_store::dead_letters::{self, Selection};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState};

/// Messages shown per queue when `limit` is not given.
const DEFAULT_LIMIT: u16 = 10;
/// The most shown per queue.
const MAX_LIMIT: u16 = 50;
/// The largest body shown of a dead letter (they are wake-ups of a few dozen bytes; a
/// foreign body can be anything).
const MAX_BODY_CHARS: usize = 2000;
/// Dead letters one requeue moves.
const REQUEUE_BATCH: i64 = 1000;
/// Ids one selection may name.
const MAX_IDS: usize = 1000;

/// The dead-letter endpoints; merged into the API's router.
pub fn api() -> Api {
    Api::new()
        .route(
            Method::GET,
            "/api/v1/dead-letters",
            Access::Token(Action::Administer, Scope::Instance),
            list,
        )
        .doc(
            Doc::op("listDeadLetters", "Messages the steps gave up on")
                .query("queue", "Only this step queue's (`run.plan`).")
                .query("limit", "At most this many.")
                .ok_object(200, "The dead letters."),
        )
        .route(
            Method::POST,
            "/api/v1/dead-letters/requeue",
            Access::Token(Action::Administer, Scope::Instance),
            requeue,
        )
        .doc(
            Doc::op(
                "requeueDeadLetters",
                "Send dead letters back to their queue",
            )
            .body::<SelectionBody>()
            .ok_object(200, "What was requeued."),
        )
        .route(
            Method::POST,
            "/api/v1/dead-letters/purge",
            Access::Token(Action::Administer, Scope::Instance),
            purge,
        )
        .doc(
            Doc::op("purgeDeadLetters", "Drop dead letters")
                .body::<SelectionBody>()
                .ok_object(200, "What was purged."),
        )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeadQuery {
    /// Messages to show per queue (0–50).
    limit: Option<u16>,
}

async fn list(
    State(st): State<AppState>,
    caller: Caller,
    q: Result<Query<DeadQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Action::Administer, None)?;
    let Query(q) = q.map_err(|e| {
        ApiError::client(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidQuery,
            format!("the query string is not valid: {}", e.body_text()),
        )
    })?;
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if limit > MAX_LIMIT {
        return Err(ApiError::invalid(
            ErrorCode::InvalidLimit,
            format!("limit is at most {MAX_LIMIT}"),
        ));
    }
    let stored: BTreeMap<String, i64> = dead_letters::counts(&st.pool).await?.into_iter().collect();
    // What the broker still holds, read without taking anything; unknown (null) while the
    // broker is away — the stored dead letters are shown all the same.
    let collected =
        takosumi_queue::collected_queues(&st.pool, &takosumi_queue::Topology::load()).await?;
    let uncollected: Option<BTreeMap<String, u32>> = match st.bus.get().await {
        Ok(broker) => match broker.dead_letter_depths(&collected).await {
            Ok(depths) => Some(depths.into_iter().map(|d| (d.queue, d.depth)).collect()),
            Err(e) => {
                tracing::warn!(error = %e, "could not read the dead-letter queues' depth");
                None
            }
        },
        Err(e) => {
            tracing::warn!(error = %e, "could not read the dead-letter queues' depth");
            None
        }
    };
    let mut queues = Vec::new();
    let mut total: i64 = 0;
    for queue in collected {
        let depth = stored.get(&queue).copied().unwrap_or(0);
        total += depth;
        let mut messages = Vec::new();
        if limit > 0 && depth > 0 {
            for d in dead_letters::oldest(&st.pool, &queue, i64::from(limit)).await? {
                messages.push(letter(&d));
            }
        }
        queues.push(json!({
            "queue": queue,
            "deadLetterQueue": takosumi_queue::Topology::dead_queue_name(&queue),
            "depth": depth,
            "uncollected": uncollected.as_ref().map(|u| u.get(&queue).copied().unwrap_or(0)),
            "messages": messages,
        }));
    }
    // Rows of a queue no longer collected (renamed since): still shown, never lost.
    for (queue, depth) in &stored {
        if !queues.iter().any(|q| q["queue"] == *queue) {
            total += depth;
            let mut messages = Vec::new();
            for d in dead_letters::oldest(&st.pool, queue, i64::from(limit)).await? {
                messages.push(letter(&d));
            }
            queues.push(json!({
                "queue": queue,
                "deadLetterQueue": takosumi_queue::Topology::dead_queue_name(queue),
                "depth": depth,
                "uncollected": null,
                "messages": messages,
            }));
        }
    }
    let uncollected_total: Option<u64> = uncollected
        .as_ref()
        .map(|u| u.values().map(|n| u64::from(*n)).sum());
    Ok(Json(
        json!({ "total": total, "uncollected": uncollected_total, "queues": queues }),
    ))
}

fn letter(d: &dead_letters::DeadLetter) -> Value {
    let text = String::from_utf8_lossy(&d.body);
    let cut = text.chars().count() > MAX_BODY_CHARS;
    let body: String = text.chars().take(MAX_BODY_CHARS).collect();
    json!({
        "id": d.id,
        "body": body,
        "truncated": cut || d.body_truncated,
        "runId": d.run_id,
        "error": d.error,
        "brokerReason": d.broker_reason,
        "messageId": d.message_id,
        "collectedAt": d.collected_at,
    })
}

/// Which dead letters an action takes.
#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SelectionBody {
    /// Those of one step queue (`run.plan`).
    #[serde(default)]
    queue: Option<String>,
    /// Those with these ids.
    #[serde(default)]
    ids: Option<Vec<i64>>,
    /// Every one (required when neither `queue` nor `ids` is given).
    #[serde(default)]
    all: bool,
}

fn selection(body: &Bytes) -> Result<Selection, ApiError> {
    let req: SelectionBody = crate::extract::optional_body(body)?;
    if req.queue.is_none() && req.ids.is_none() && !req.all {
        return Err(ApiError::invalid(
            ErrorCode::NoSelection,
            "name the dead letters: {\"queue\": \"run.plan\"}, {\"ids\": [..]} or {\"all\": true}",
        ));
    }
    if req.all && (req.queue.is_some() || req.ids.is_some()) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidSelection,
            "`all` cannot be combined with `queue` or `ids`",
        ));
    }
    if let Some(q) = &req.queue
        && !takosumi_queue::Topology::load().queues.contains(q)
    {
        return Err(ApiError::invalid(
            ErrorCode::UnknownQueue,
            format!(
                "`{q}` is not a step queue (one of: {})",
                takosumi_queue::Topology::load().queues.join(", ")
            ),
        ));
    }
    if let Some(ids) = &req.ids
        && (ids.is_empty() || ids.len() > MAX_IDS)
    {
        return Err(ApiError::invalid(
            ErrorCode::InvalidIds,
            format!("`ids` names 1 to {MAX_IDS} dead letters"),
        ));
    }
    Ok(Selection {
        queue: req.queue,
        ids: req.ids,
    })
}

async fn requeue(
    State(st): State<AppState>,
    caller: Caller,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    caller.require(Action::Administer, None)?;
    let sel = selection(&body)?;
    let mut tx = st.pool.begin().await?;
    let done = dead_letters::requeue(&mut tx, &sel, REQUEUE_BATCH).await?;
    tx.commit().await?;
    let requeued: Vec<Value> = done
        .requeued
        .iter()
        .map(|d| json!({ "id": d.id, "queue": d.queue, "runId": d.run_id }))
        .collect();
    let skipped: Vec<Value> = done
        .skipped
        .iter()
        .map(|(id, queue)| {
            json!({
                "id": id,
                "queue": queue,
                "reason": "not a Run message: no step can process it; purge it",
            })
        })
        .collect();
    if !requeued.is_empty() {
        st.relay_wake.notify_one();
    }
    // Still selected after this call: more than one batch, or ones held by another call.
    let remaining = dead_letters::count_selected(&st.pool, &sel).await?
        - i64::try_from(skipped.len()).unwrap_or(0);
    tracing::info!(
        actor = %caller.actor(),
        requeued = requeued.len(),
        skipped = skipped.len(),
        "dead letters requeued"
    );
    Ok(Json(
        json!({ "requeued": requeued, "skipped": skipped, "remaining": remaining.max(0) }),
    ))
}

async fn purge(
    State(st): State<AppState>,
    caller: Caller,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    caller.require(Action::Administer, None)?;
    let sel = selection(&body)?;
    let mut tx = st.pool.begin().await?;
    let ids = dead_letters::purge(&mut tx, &sel).await?;
    tx.commit().await?;
    tracing::info!(actor = %caller.actor(), purged = ids.len(), "dead letters purged");
    Ok(Json(json!({ "purged": ids.len(), "ids": ids })))
}
