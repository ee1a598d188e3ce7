//! What a reviewer reads besides the Run record: the plan's diff resource by resource
//! (`GET /runs/{run}/plan`, masked when the plan was recorded, so nothing here unseals
//! anything), the approvals a hold needs and has (`GET /runs/{run}/approvals`), and the
//! Run as it goes (`GET /runs/{run}/stream`, Server-Sent Events: the event record and the
//! masked log so far, then what is stored next, until the Run settles). The dashboard and
//! `takosumi watch` read these same endpoints.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method};
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use takosumi_core::{RunId, RunStatus};
use takosumi_store::{approvals, events, logs, runs};
use takosumi_wire::{
    ApprovalsView, Code, GivenApproval, PlanDiff, PlanView, RunEvent, StreamEvent,
};

use crate::access::{Access, Api, Doc, Scope};
use crate::auth::{Action, Caller};
use crate::{ApiError, AppState, extract};

/// How often a stream looks for what was stored since.
const STREAM_POLL: Duration = Duration::from_millis(300);
/// A stream ends after this long even if the Run has not settled (a client reconnects
/// with `Last-Event-ID` and continues where it was).
const STREAM_MAX: Duration = Duration::from_secs(30 * 60);

/// The review endpoints; merged into the API's router.
pub fn api() -> Api {
    Api::new()
        .route(
            Method::GET,
            "/api/v1/runs/{run}/plan",
            Access::Token(Action::Read, Scope::Run),
            plan,
        )
        .doc(
            Doc::op("getRunPlan", "The plan's changes as a reviewer reads them")
                .ok::<takosumi_wire::PlanView>(200),
        )
        .route(
            Method::GET,
            "/api/v1/runs/{run}/approvals",
            Access::Token(Action::Read, Scope::Run),
            approvals,
        )
        .doc(
            Doc::op(
                "getRunApprovals",
                "What the rule in force needs and who approved",
            )
            .ok::<takosumi_wire::ApprovalsView>(200),
        )
        .route(
            Method::GET,
            "/api/v1/runs/{run}/stream",
            Access::Token(Action::Read, Scope::Run),
            stream,
        )
        .doc(
            Doc::op(
                "streamRun",
                "Server-Sent Events: the Run's events, logs and status as they happen",
            )
            .ok_sse::<takosumi_wire::StreamEvent>(200, &["event", "log", "status", "end", "error"]),
        )
}

async fn plan(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    // An apply shows the plan it carries out.
    let plan_run = match run.plan_run_id {
        Some(p) => runs::get(&st.pool, p)
            .await?
            .ok_or_else(|| ApiError::not_found(&format!("the plan Run of {}", run.id)))?,
        None => run.clone(),
    };
    let diff: Option<PlanDiff> = match runs::plan_record::plan_diff(&st.pool, plan_run.id).await? {
        Some(v) => Some(serde_json::from_value(v).map_err(ApiError::internal)?),
        None => None,
    };
    Ok(Json(PlanView {
        run_id: run.id,
        plan_run_id: plan_run.id,
        plan_digest: plan_run.plan_digest,
        diff,
    }))
}

async fn approvals(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    let gate = runs::hold::gate_fields(&st.pool, run.id)
        .await?
        .unwrap_or_default();
    let (required, approver_roles) = (gate.approvals_required, gate.approver_roles);
    let given = approvals::approvals(&st.pool, run.id)
        .await?
        .into_iter()
        .map(|a| GivenApproval {
            approver: a.approver_id,
            role: a.approver_role.into(),
            plan_digest: a.plan_digest,
            note: a.note,
            at: a.at,
        })
        .collect();
    Ok(Json(ApprovalsView {
        run_id: run.id,
        required,
        approver_roles: approver_roles.into_iter().map(Code::from).collect(),
        given,
    }))
}

/// Where a watcher is: the last event and log chunk it was sent. Sent as each SSE `id:`
/// (`<event>.<log>`) so a reconnect (`Last-Event-ID`) continues without repeating.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Cursor {
    event: i64,
    log: i64,
}

impl Cursor {
    fn parse(raw: &str) -> Option<Self> {
        let (e, l) = raw.split_once('.')?;
        Some(Self {
            event: e.parse().ok()?,
            log: l.parse().ok()?,
        })
    }
}

struct Watch {
    st: AppState,
    run: RunId,
    cursor: Cursor,
    status: Option<RunStatus>,
    pending: VecDeque<StreamEvent>,
    polled: bool,
    done: bool,
    started: Instant,
}

impl Watch {
    /// Queues what was stored since the cursor: events, then the log, then the status.
    /// The status is read first: a Run writes nothing after its end, so once the status
    /// read is terminal, the events and log read after it are the whole of them. (Read
    /// last, a status that turned terminal between the reads ended the stream without
    /// what was written meanwhile: the last events and the plan's log.)
    async fn poll(&mut self) -> Result<(), ApiError> {
        let run = runs::get(&self.st.pool, self.run)
            .await?
            .ok_or_else(|| ApiError::not_found(&format!("Run {}", self.run)))?;
        for e in events::list_after(&self.st.pool, self.run, self.cursor.event).await? {
            self.cursor.event = e.id;
            self.pending.push_back(StreamEvent::Event {
                event: RunEvent {
                    id: e.id,
                    kind: e.kind.into(),
                    actor: e.actor,
                    data: e.data,
                    at: Some(e.at),
                    extra: Default::default(),
                },
            });
        }
        for c in logs::read_after(&self.st.pool, self.run, self.cursor.log).await? {
            self.cursor.log = c.id;
            self.pending.push_back(StreamEvent::Log {
                step: c.step,
                text: c.text,
            });
        }
        if self.status != Some(run.status) {
            self.status = Some(run.status);
            self.pending
                .push_back(StreamEvent::Status { status: run.status });
        }
        if run.status.is_terminal() {
            self.pending
                .push_back(StreamEvent::End { status: run.status });
            self.done = true;
        }
        Ok(())
    }

    async fn next(mut self) -> Option<(Result<Event, Infallible>, Self)> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                let sse = Event::default()
                    .event(ev.name())
                    .id(format!("{}.{}", self.cursor.event, self.cursor.log))
                    .json_data(&ev)
                    .unwrap_or_else(|_| Event::default().event("error"));
                return Some((Ok(sse), self));
            }
            if self.done || self.started.elapsed() > STREAM_MAX {
                return None;
            }
            if self.polled {
                tokio::time::sleep(STREAM_POLL).await;
            }
            self.polled = true;
            if let Err(e) = self.poll().await {
                // The stream has begun: the error can only be logged, and the client
                // reconnects where it was.
                tracing::warn!(run = %self.run, error = ?e, "run stream stopped");
                return None;
            }
        }
    }
}

async fn stream(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    let cursor = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(Cursor::parse)
        .unwrap_or_default();
    let watch = Watch {
        st,
        run: run.id,
        cursor,
        status: None,
        pending: VecDeque::new(),
        polled: false,
        done: false,
        started: Instant::now(),
    };
    let body = futures::stream::unfold(watch, Watch::next);
    Ok(Sse::new(body).keep_alive(KeepAlive::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_what_it_sent() {
        assert_eq!(Cursor::parse("12.40"), Some(Cursor { event: 12, log: 40 }));
        for bad in ["", "12", "a.b", "1.2.3", "-"] {
            assert_eq!(Cursor::parse(bad), None, "{bad}");
        }
    }
}
