//! The Run record as people and scripts read and steer it: cancel a Run, estimate the
//! cost of a plan, resolve an `unknown_outcome` apply, and page through a Workspace's Run
//! history and activity.
//!
//! Cancel: a `queued` or `held` Run ends `canceled` at once (200); a running one gets a
//! recorded request (202) that the handler holding it acts on — it interrupts the tool and
//! ends the Run `canceled` when the tool stops, keeping any state an interrupted apply
//! wrote; a finished Run is 409 `run_finished`. Every change is a conditional update that
//! records who and when, with an event and an activity entry in the same transaction.
//!
//! Resolve (`POST /runs/{id}/resolve`, admin only): an `unknown_outcome` apply stays
//! `unknown_outcome` — its outcome is still not known to Takosumi — but an operator who
//! inspected the provider side and the Capsule's current StateVersion records that they
//! did, with a note; the Workspace's Run list stops counting it as needing attention.
//! `{"action": "mark_resolved"}` records only that; `restore_held_state` and
//! `attach_state` also give the Capsule a state through the generation compare-and-set
//! (see `resolve_state`).

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use chrono::DateTime;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use takosumi_core::{
    ActivityKind, CapsuleId, EventKind, ResolutionAction, RunId, RunKind, RunStatus, WorkspaceId,
};
use takosumi_cost::{Catalogue, PlanResources, estimate};
use takosumi_store::runs::list::{RunCursor, RunFilter};
use takosumi_store::{activity, events, runs};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::views::RunView;
use crate::{ApiError, AppState, extract};

/// Page size when `limit` is not given.
const DEFAULT_LIMIT: i64 = 20;
/// The largest page.
const MAX_LIMIT: i64 = 100;
/// The longest operator note or cancel reason.
const MAX_NOTE_CHARS: usize = 2000;

/// The record endpoints; merged into the API's router.
pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/runs/{run}/cancel",
            Access::Token(Action::Operate, Scope::Run),
            cancel_run,
        )
        .doc(
            Doc::op(
                "cancelRun",
                "Cancel a Run (queued/held at once, running: recorded)",
            )
            .optional_body::<CancelRequest>()
            .ok::<takosumi_wire::Run>(200)
            .ok::<takosumi_wire::Run>(202),
        )
        .route(
            Method::GET,
            "/api/v1/runs/{run}/cost",
            Access::Token(Action::Read, Scope::Run),
            run_cost,
        )
        .doc(
            Doc::op("getRunCost", "Cost estimate of the plan")
                .ok::<takosumi_cost::CostEstimate>(200),
        )
        .route(
            Method::POST,
            "/api/v1/runs/{run}/resolve",
            Access::Token(Action::Administer, Scope::Run),
            // An attached state is up to 8 MiB; the limit is answered in JSON below.
            axum::handler::Handler::layer(
                resolve_run,
                axum::extract::DefaultBodyLimit::max(crate::resolve_state::RESOLVE_BODY_LIMIT),
            ),
        )
        .doc(
            Doc::op("resolveRun", "Resolve an `unknown_outcome` Run")
                .body::<ResolveRequest>()
                .ok_object(200, "The resolution and the Run."),
        )
        .route(
            Method::GET,
            "/api/v1/workspaces/{ws}/runs",
            Access::Token(Action::Read, Scope::Workspace),
            list_runs,
        )
        .doc(
            Doc::op("listRuns", "The Workspace's Runs, newest first")
                .query("capsule", "Only this Capsule's (`cap_…`).")
                .query("kind", "Only this kind.")
                .query("status", "Only this status.")
                .query("limit", "At most this many (1-100).")
                .query("cursor", "From a previous page's `nextCursor`.")
                .ok::<takosumi_wire::RunPage>(200),
        )
        .route(
            Method::GET,
            "/api/v1/workspaces/{ws}/activity",
            Access::Token(Action::Read, Scope::Workspace),
            list_activity,
        )
        .doc(
            Doc::op(
                "listActivity",
                "The Workspace's activity record, newest first",
            )
            .query("limit", "At most this many (1-100).")
            .query("cursor", "From a previous page's `nextCursor`.")
            .ok::<takosumi_wire::ActivityPage>(200),
        )
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(t)| t).map_err(|e| {
        ApiError::client(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidQuery,
            format!("the query string is not valid: {}", e.body_text()),
        )
    })
}

/// A person's free text (a note, a reason): trimmed, at most 2000 characters, no control
/// characters other than newlines and tabs.
fn note_text(raw: &str, field: &'static str) -> Result<String, ApiError> {
    let text = raw.trim();
    if text.chars().count() > MAX_NOTE_CHARS
        || text
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t')
    {
        return Err(ApiError::invalid(
            ErrorCode::InvalidNote,
            format!("{field} must be at most {MAX_NOTE_CHARS} characters of text"),
        ));
    }
    Ok(text.to_owned())
}

// ---- cancel -------------------------------------------------------------------------

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CancelRequest {
    #[serde(default)]
    reason: Option<String>,
}

async fn cancel_run(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Operate).await?;
    let req: CancelRequest = extract::optional_body(&body)?;
    let reason = req
        .reason
        .as_deref()
        .map(|r| note_text(r, "reason"))
        .transpose()?
        .filter(|r| !r.is_empty());
    let actor = caller.actor();
    // A Run can move (queued → planning) between the two conditional updates; a few
    // rounds settle it.
    for _ in 0..5 {
        let mut tx = st.pool.begin().await?;
        if let Some(from) = runs::cancel::cancel_waiting(&mut tx, run.id, &actor).await? {
            events::append(
                tx.db(),
                run.id,
                EventKind::Canceled,
                &actor,
                json!({ "from": from, "whileRunning": false, "reason": reason }),
            )
            .await?;
            activity::append(
                tx.db(),
                run.workspace_id,
                ActivityKind::RunCanceled,
                &run.id.to_string(),
                &actor,
                json!({ "kind": run.kind, "capsuleId": run.capsule_id, "from": from }),
            )
            .await?;
            let now = runs::get(tx.db(), run.id)
                .await?
                .ok_or_else(|| ApiError::not_found("the Run"))?;
            tx.commit().await?;
            return Ok((StatusCode::OK, crate::views::run_json(&now)));
        }
        if runs::cancel::request_cancel(&mut tx, run.id, &actor).await? {
            events::append(
                tx.db(),
                run.id,
                EventKind::CancelRequested,
                &actor,
                json!({ "reason": reason }),
            )
            .await?;
            let now = runs::get(tx.db(), run.id)
                .await?
                .ok_or_else(|| ApiError::not_found("the Run"))?;
            tx.commit().await?;
            return Ok((StatusCode::ACCEPTED, crate::views::run_json(&now)));
        }
        drop(tx);
        let now = runs::get(&st.pool, run.id)
            .await?
            .ok_or_else(|| ApiError::not_found("the Run"))?;
        if now.status.is_terminal() {
            return Err(ApiError::conflict(
                ErrorCode::RunFinished,
                format!(
                    "{} already ended {}; only a queued, held or running Run can be canceled",
                    now.id,
                    now.status.as_str()
                ),
            ));
        }
        if matches!(now.status, RunStatus::Planning | RunStatus::Applying) {
            // Already requested: asking again changes nothing.
            return Ok((StatusCode::ACCEPTED, crate::views::run_json(&now)));
        }
    }
    Err(ApiError::conflict(
        ErrorCode::Conflict,
        "the Run kept changing while it was being canceled; try again",
    ))
}

// ---- cost ---------------------------------------------------------------------------

async fn run_cost(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    // An Apply Run is estimated by the plan it carries out.
    let plan = match (run.kind, run.plan_run_id) {
        (RunKind::Apply, Some(plan_id)) => runs::get(&st.pool, plan_id)
            .await?
            .ok_or_else(|| ApiError::not_found(&format!("plan Run {plan_id}")))?,
        _ => run.clone(),
    };
    if plan.status != RunStatus::Planned {
        return Err(ApiError::conflict(
            ErrorCode::PlanNotReady,
            format!(
                "{} is {}; a cost estimate needs a finished plan",
                plan.id,
                plan.status.as_str()
            ),
        ));
    }
    let Some(summary) = runs::plan_record::resource_changes(&st.pool, plan.id).await? else {
        return Err(ApiError::conflict(
            ErrorCode::CostUnavailable,
            format!(
                "{} was planned before Takosumi kept resource summaries; plan again for an estimate",
                plan.id
            ),
        ));
    };
    let resources: PlanResources =
        serde_json::from_value(summary).map_err(|e| ApiError::Internal {
            transient: false,
            source: Box::new(e),
        })?;
    let estimate = estimate(Catalogue::embedded(), &resources);
    let mut body = match serde_json::to_value(&estimate) {
        Ok(Value::Object(m)) => m,
        Ok(_) => Map::new(),
        Err(e) => {
            return Err(ApiError::Internal {
                transient: false,
                source: Box::new(e),
            });
        }
    };
    body.insert("runId".into(), json!(run.id));
    body.insert("planRunId".into(), json!(plan.id));
    Ok(Json(Value::Object(body)))
}

// ---- resolve ------------------------------------------------------------------------

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ResolveRequest {
    action: String,
    note: String,
    /// `attach_state` only: the state pulled from the provider side (never echoed).
    #[serde(default)]
    state: Option<Value>,
}

async fn resolve_run(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Administer).await?;
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            crate::resolve_state::too_large(None)
        } else {
            ApiError::invalid_json("the request body could not be read")
        }
    })?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_json(
            "send {\"action\": \"mark_resolved\" | \"restore_held_state\" | \"attach_state\", \"note\": \"what you checked\"} (attach_state also takes \"state\")",
        ));
    }
    let req: ResolveRequest = extract::parse_body(&body)?;
    drop(body);
    let Ok(action) = req.action.parse::<ResolutionAction>() else {
        return Err(ApiError::invalid(
            ErrorCode::InvalidAction,
            "action must be \"mark_resolved\", \"restore_held_state\" or \"attach_state\"",
        ));
    };
    match (action, req.state.is_some()) {
        (ResolutionAction::AttachState, false) => {
            return Err(ApiError::invalid(
                ErrorCode::MissingState,
                "attach_state needs \"state\": the Terraform state (JSON object) pulled from the provider side",
            ));
        }
        (ResolutionAction::MarkResolved | ResolutionAction::RestoreHeldState, true) => {
            return Err(ApiError::invalid(
                ErrorCode::UnexpectedState,
                "\"state\" is only taken with action \"attach_state\"",
            ));
        }
        _ => {}
    }
    let note = note_text(&req.note, "note")?;
    if note.is_empty() {
        return Err(ApiError::invalid(
            ErrorCode::InvalidNote,
            "note must say what was checked (the provider side, the current StateVersion)",
        ));
    }
    if run.status != RunStatus::UnknownOutcome {
        return Err(ApiError::conflict(
            ErrorCode::NotUnknownOutcome,
            format!(
                "{} is {}; only an unknown_outcome Run is resolved",
                run.id,
                run.status.as_str()
            ),
        ));
    }
    let actor = caller.actor();
    if action != ResolutionAction::MarkResolved {
        if run.resolved_at.is_some() {
            return Err(crate::resolve_state::already_resolved(&run));
        }
        match req.state {
            Some(state) => {
                crate::resolve_state::attach_state(&st, &run, &actor, &note, state).await?;
            }
            None => crate::resolve_state::restore_held_state(&st, &run, &actor, &note).await?,
        }
        let now = runs::get(&st.pool, run.id)
            .await?
            .ok_or_else(|| ApiError::not_found("the Run"))?;
        return Ok(crate::views::run_json(&now));
    }
    let mut tx = st.pool.begin().await?;
    if !runs::unknown::resolve_unknown(&mut tx, run.id, action, &actor, &note).await? {
        return Err(ApiError::conflict(
            ErrorCode::AlreadyResolved,
            format!("{} was already resolved; see its events", run.id),
        ));
    }
    events::append(
        tx.db(),
        run.id,
        EventKind::Resolved,
        &actor,
        json!({ "action": req.action, "note": note }),
    )
    .await?;
    activity::append(
        tx.db(),
        run.workspace_id,
        ActivityKind::RunResolved,
        &run.id.to_string(),
        &actor,
        json!({ "action": req.action, "note": note, "capsuleId": run.capsule_id }),
    )
    .await?;
    tx.commit().await?;
    let now = runs::get(&st.pool, run.id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Run"))?;
    Ok(crate::views::run_json(&now))
}

// ---- history ------------------------------------------------------------------------

/// An opaque cursor: hex of `r:<created_at µs>:<uuid>` or `a:<activity id>`. Clients pass
/// it back unchanged.
fn encode_cursor(text: &str) -> String {
    hex::encode(text.as_bytes())
}

fn bad_cursor() -> ApiError {
    ApiError::client(
        StatusCode::BAD_REQUEST,
        ErrorCode::InvalidCursor,
        "cursor is not one this API returned; start again without it",
    )
}

fn decode_cursor(raw: &str, prefix: &str) -> Result<String, ApiError> {
    let bytes = hex::decode(raw).map_err(|_| bad_cursor())?;
    let text = String::from_utf8(bytes).map_err(|_| bad_cursor())?;
    text.strip_prefix(prefix)
        .map(str::to_owned)
        .ok_or_else(bad_cursor)
}

fn run_cursor(c: &RunCursor) -> String {
    encode_cursor(&format!(
        "r:{}:{}",
        c.created_at.timestamp_micros(),
        c.id.as_uuid()
    ))
}

fn parse_run_cursor(raw: &str) -> Result<RunCursor, ApiError> {
    let text = decode_cursor(raw, "r:")?;
    let (micros, id) = text.split_once(':').ok_or_else(bad_cursor)?;
    let created_at = micros
        .parse::<i64>()
        .ok()
        .and_then(DateTime::from_timestamp_micros)
        .ok_or_else(bad_cursor)?;
    let id = uuid::Uuid::parse_str(id).map_err(|_| bad_cursor())?;
    Ok(RunCursor {
        created_at,
        id: RunId::from_uuid(id),
    })
}

fn parse_limit(raw: Option<&str>) -> Result<i64, ApiError> {
    crate::extract::page_limit(raw, DEFAULT_LIMIT, MAX_LIMIT)
}

fn parse_enum<T: serde::de::DeserializeOwned>(
    raw: &str,
    field: &str,
    allowed: &str,
) -> Result<T, ApiError> {
    serde_json::from_value(Value::String(raw.to_owned())).map_err(|_| {
        ApiError::invalid(
            ErrorCode::InvalidFilter,
            format!("{field} must be one of {allowed}"),
        )
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunsQuery {
    capsule: Option<String>,
    kind: Option<String>,
    status: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

async fn list_runs(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    q: Result<Query<RunsQuery>, QueryRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let q = query(q)?;
    let filter = RunFilter {
        capsule_id: q
            .capsule
            .as_deref()
            .map(extract::parse_id::<CapsuleId>)
            .transpose()?,
        kind: q
            .kind
            .as_deref()
            .map(|k| parse_enum(k, "kind", "plan, destroy, apply, drift_check"))
            .transpose()?,
        status: q
            .status
            .as_deref()
            .map(|s| {
                parse_enum(
                    s,
                    "status",
                    "queued, held, planning, planned, applying, applied, failed, canceled, unknown_outcome",
                )
            })
            .transpose()?,
    };
    let limit = parse_limit(q.limit.as_deref())?;
    let after = q.cursor.as_deref().map(parse_run_cursor).transpose()?;
    // One connection for the page's two statements: one acquire (and its liveness ping).
    let mut conn = st.history.acquire().await?;
    let (runs, next) = runs::list::list_runs(conn.db(), ws, &filter, after, limit).await?;
    let unknown = runs::list::count_unresolved_unknown(conn.db(), ws).await?;
    drop(conn);
    Ok(Json(RunPage {
        workspace_id: ws,
        runs: runs.iter().map(RunView::of).collect(),
        next_cursor: next.as_ref().map(run_cursor),
        unknown_outcome_count: unknown,
    })
    .into_response())
}

/// A page of a Workspace's Runs, serialized straight from the rows.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct RunPage<'a> {
    workspace_id: WorkspaceId,
    runs: Vec<RunView<'a>>,
    next_cursor: Option<String>,
    unknown_outcome_count: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ActivityQuery {
    kind: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

async fn list_activity(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    q: Result<Query<ActivityQuery>, QueryRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let q = query(q)?;
    let kind = q
        .kind
        .as_deref()
        .map(|k| {
            k.parse::<ActivityKind>().map_err(|e| {
                ApiError::invalid(
                    ErrorCode::InvalidFilter,
                    format!("kind must be an activity kind: {}", e.names),
                )
            })
        })
        .transpose()?;
    let limit = parse_limit(q.limit.as_deref())?;
    let before = q
        .cursor
        .as_deref()
        .map(|c| {
            decode_cursor(c, "a:")?
                .parse::<i64>()
                .map_err(|_| bad_cursor())
        })
        .transpose()?;
    let (entries, next) = activity::list(&st.pool, ws, kind, before, limit).await?;
    let items: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({ "id": e.id, "kind": e.kind, "subject": e.subject, "actor": e.actor,
                    "data": e.data, "at": e.at })
        })
        .collect();
    Ok(Json(json!({
        "workspaceId": ws,
        "activity": items,
        "nextCursor": next.map(|id| encode_cursor(&format!("a:{id}"))),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        let c = RunCursor {
            created_at: DateTime::from_timestamp_micros(1_796_000_000_123_456).unwrap(),
            id: RunId::new(),
        };
        assert_eq!(parse_run_cursor(&run_cursor(&c)).unwrap(), c);
        for bad in [
            "",
            "zz",
            "00",
            &encode_cursor("a:12"),
            &encode_cursor("r:x:y"),
        ] {
            assert!(parse_run_cursor(bad).is_err(), "{bad}");
        }
        assert_eq!(decode_cursor(&encode_cursor("a:42"), "a:").unwrap(), "42");
    }

    #[test]
    fn limits_and_notes() {
        assert_eq!(parse_limit(None).unwrap(), DEFAULT_LIMIT);
        assert_eq!(parse_limit(Some("100")).unwrap(), 100);
        for bad in ["0", "101", "-1", "x"] {
            assert!(parse_limit(Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(
            note_text("  checked AWS \n", "note").unwrap(),
            "checked AWS"
        );
        assert!(note_text("a\u{7}b", "note").is_err());
        assert!(note_text(&"x".repeat(MAX_NOTE_CHARS + 1), "note").is_err());
    }

    #[test]
    fn enums_parse_by_their_api_names() {
        let k: RunKind = parse_enum("drift_check", "kind", "").unwrap();
        assert_eq!(k, RunKind::DriftCheck);
        let s: RunStatus = parse_enum("unknown_outcome", "status", "").unwrap();
        assert_eq!(s, RunStatus::UnknownOutcome);
        assert!(parse_enum::<RunStatus>("done", "status", "").is_err());
    }
}
