//! Signed audit evidence: the endpoints that serve each Run's signed statement,
//! a Workspace's chain and the public keys, and the writer loop that signs statements as
//! Runs end.
//!
//! The statements are read-only here: what they say and how they are chained and signed is
//! `takosumi_evidence` and `takosumi_store::evidence`; a Run is queued for its statement by
//! the database in the transaction that ends it. Reading a Run's or a Workspace's evidence
//! takes the same role as reading its Runs; the public keys are public (no token), since a
//! verifier trusts nothing but them and must be able to fetch them from anywhere.

use std::time::Duration;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Deserialize;
use sqlx::postgres::PgListener;
use takosumi_evidence::{Signer, StatementPage};
use takosumi_store::{Pool, evidence};
use tokio_util::sync::CancellationToken;

use crate::access::{Access, Api, Doc, Scope};
use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract};

/// Page size when `limit` is not given (and the largest page).
const MAX_LIMIT: i64 = 200;
/// How often the writer looks for ended Runs when no notification woke it (a notification
/// can be lost while the listening connection is re-established).
const POLL: Duration = Duration::from_secs(2);
/// The least time between two passes the notifications start: Runs end in bursts (a
/// pipeline's plan then its apply, a sweep's drift checks, many pipelines at once), and
/// one pass signs a Workspace's batch in one transaction whose fixed cost (the head's lock,
/// the pending rows, the head's update, a commit that waits for the disk) is then paid once
/// for the burst instead of once per Run. A Run that ends after a quiet spell is signed at
/// once; one that ends within this time of the last pass waits for the rest of it, with
/// every other Run that ends meanwhile.
const GATHER: Duration = Duration::from_millis(200);

/// The evidence endpoints; merged into the API's router.
pub fn api() -> Api {
    Api::new()
        .route(
            Method::GET,
            "/api/v1/runs/{run}/evidence",
            Access::Token(Action::Read, Scope::Run),
            run_evidence,
        )
        .doc(
            Doc::op(
                "getRunEvidence",
                "The signed evidence statement of an ended Run",
            )
            .ok_object(200, "The statement and its signature."),
        )
        .route(
            Method::GET,
            "/api/v1/workspaces/{ws}/evidence",
            Access::Token(Action::Read, Scope::Workspace),
            workspace_evidence,
        )
        .doc(
            Doc::op(
                "listWorkspaceEvidence",
                "The Workspace's evidence statements",
            )
            .query("limit", "At most this many.")
            .query("cursor", "From a previous page.")
            .ok_object(200, "A page of statements."),
        )
        // A verifier needs the public keys from anywhere, with no token.
        .route(Method::GET, "/api/v1/evidence/keys", Access::Public, keys)
        .doc(
            Doc::op("getEvidenceKeys", "The public keys evidence is signed with")
                .ok_object(200, "Current and rotated-out keys."),
        )
}

async fn run_evidence(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    let id = run.id;
    if let Some(s) = evidence::of_run(&st.pool, id).await? {
        return Ok(Json(s.to_signed()));
    }
    if !run.status.is_terminal() {
        return Err(ApiError::conflict(
            ErrorCode::RunNotEnded,
            format!(
                "{id} is {}; its evidence statement is written when it ends",
                run.status.as_str()
            ),
        ));
    }
    if evidence::is_pending(&st.pool, id).await? {
        return Err(ApiError::conflict(
            ErrorCode::EvidencePending,
            format!("{id} ended; its evidence statement is being signed: ask again in a moment"),
        ));
    }
    // The writer turns the pending row into the statement in one transaction: it may have
    // committed between the two reads above, and then the statement is there now.
    if let Some(s) = evidence::of_run(&st.pool, id).await? {
        return Ok(Json(s.to_signed()));
    }
    Err(ApiError::client(
        StatusCode::NOT_FOUND,
        ErrorCode::EvidenceMissing,
        format!(
            "{id} ended but has no evidence statement: it was deleted; `takosumi verify --workspace {}` shows where the chain broke",
            run.workspace_id
        ),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PageQuery {
    limit: Option<String>,
    cursor: Option<String>,
}

fn bad_cursor() -> ApiError {
    ApiError::client(
        StatusCode::BAD_REQUEST,
        ErrorCode::InvalidCursor,
        "cursor is not one this API returned; start again without it",
    )
}

/// Cursors are opaque to clients: the hex of `e:<last sequence>`.
fn encode_cursor(sequence: i64) -> String {
    hex::encode(format!("e:{sequence}"))
}

fn decode_cursor(raw: &str) -> Result<i64, ApiError> {
    let bytes = hex::decode(raw).map_err(|_| bad_cursor())?;
    let text = String::from_utf8(bytes).map_err(|_| bad_cursor())?;
    text.strip_prefix("e:")
        .and_then(|n| n.parse::<i64>().ok())
        .filter(|n| *n >= 0)
        .ok_or_else(bad_cursor)
}

fn parse_limit(raw: Option<&str>) -> Result<i64, ApiError> {
    crate::extract::page_limit(raw, MAX_LIMIT, MAX_LIMIT)
}

async fn workspace_evidence(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let Query(q) = q.map_err(|e| {
        ApiError::client(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidQuery,
            format!("the query string is not valid: {}", e.body_text()),
        )
    })?;
    let limit = parse_limit(q.limit.as_deref())?;
    let after = q
        .cursor
        .as_deref()
        .map(decode_cursor)
        .transpose()?
        .unwrap_or(0);
    // The head first: the statements read after it reach it (the chain only grows).
    let head = evidence::head(&st.pool, ws).await?;
    let (rows, more) = evidence::page(&st.pool, ws, after, limit).await?;
    let next_cursor = more
        .then(|| rows.last().map(|r| encode_cursor(r.sequence)))
        .flatten();
    Ok(Json(StatementPage {
        workspace_id: ws.to_string(),
        statements: rows
            .iter()
            .map(evidence::StoredStatement::to_signed)
            .collect(),
        next_cursor,
        head,
    }))
}

async fn keys(State(st): State<AppState>) -> impl IntoResponse {
    Json((*st.evidence_keys).clone())
}

/// Signs the statements of Runs that ended, until `shutdown`: woken by the database's
/// notification when a Run ends, and every [`POLL`] regardless. Failures (the database
/// restarting) are logged and tried again; nothing is lost, the queue is a table.
pub async fn run_writer(pool: Pool, signer: Signer, shutdown: CancellationToken) {
    let mut listener: Option<PgListener> = None;
    loop {
        if listener.is_none() {
            listener = listen(&pool).await;
        }
        let passed = tokio::time::Instant::now();
        match evidence::write_pending(&pool, &signer).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(statements = n, "evidence statements signed"),
            Err(e) => tracing::warn!(error = %e, "evidence statements could not be written yet"),
        }
        let woken = async {
            match listener.as_mut() {
                Some(l) => {
                    l.recv().await?;
                    gather(l, passed + GATHER).await
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(POLL) => {}
            got = woken => {
                if got.is_err() {
                    // Listen again on the next round; the poll covers the gap.
                    listener = None;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// Takes every notification already received and every one that arrives before `until`
/// (none more when it has passed), so that the pass after it signs them together and none
/// of them starts a pass of its own; fails when the listening connection broke.
async fn gather(listener: &mut PgListener, until: tokio::time::Instant) -> Result<(), sqlx::Error> {
    while let Ok(got) = tokio::time::timeout_at(until, listener.recv()).await {
        got?;
    }
    Ok(())
}

async fn listen(pool: &Pool) -> Option<PgListener> {
    let mut l = PgListener::connect_with(pool)
        .await
        .map_err(|e| tracing::warn!(error = %e, "cannot listen for ended Runs; polling"))
        .ok()?;
    l.listen(evidence::CHANNEL)
        .await
        .map_err(|e| tracing::warn!(error = %e, "cannot listen for ended Runs; polling"))
        .ok()?;
    Some(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        assert_eq!(decode_cursor(&encode_cursor(42)).unwrap(), 42);
        for bad in [
            "",
            "zz",
            &hex::encode("r:1"),
            &hex::encode("e:-1"),
            &hex::encode("e:x"),
        ] {
            assert!(decode_cursor(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_limit(None).unwrap(), MAX_LIMIT);
        for bad in ["0", "201", "x"] {
            assert!(parse_limit(Some(bad)).is_err(), "{bad}");
        }
    }
}
