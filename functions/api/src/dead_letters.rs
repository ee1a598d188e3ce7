//! `GET /api/v1/dead-letters` (admin only): every step queue's dead-letter queue, its
//! depth and its first messages (left in place), so a message that could not be
//! processed — a body that is not a Run message, a Run that does not exist, a fault that
//! outlasted its retries — is seen by operators instead of silently dropped.
//!
//! The queues are read over AMQP (`Broker::peek_dead_letters`), not through the
//! management HTTP API, which production brokers often do not expose, and not from a
//! table, which would miss what the broker dead-letters on its own.

use crate::access::{Access, Api, Scope};
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::Method;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::{Action, Caller};
use crate::{ApiError, AppState};

/// Messages shown per queue when `limit` is not given.
const DEFAULT_LIMIT: u16 = 10;
/// The most shown per queue.
const MAX_LIMIT: u16 = 50;

/// The dead-letter endpoint; merged into the API's router.
pub fn api() -> Api {
    Api::new().route(
        Method::GET,
        "/api/v1/dead-letters",
        Access::Token(Action::Administer, Scope::Instance),
        list,
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
            "invalid_query",
            format!("the query string is not valid: {}", e.body_text()),
        )
    })?;
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if limit > MAX_LIMIT {
        return Err(ApiError::invalid(
            "invalid_limit",
            format!("limit is at most {MAX_LIMIT}"),
        ));
    }
    let unavailable = |e: takosumi_queue::QueueError| ApiError::Internal {
        transient: true,
        source: Box::new(e),
    };
    let broker = st.bus.get().await.map_err(unavailable)?;
    let queues = broker.peek_dead_letters(limit).await.map_err(unavailable)?;
    let total: u64 = queues.iter().map(|q| u64::from(q.depth)).sum();
    Ok(Json(json!({ "total": total, "queues": queues })))
}
