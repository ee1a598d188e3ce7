//! `POST /api/v1/capsules/{cap}/apply`: apply a Capsule's branch as it is (CLI `takosumi
//! apply-capsule CAP`). When no rule covers the apply (no `maxDestroy`, `planGate`,
//! approval rule or `maxMonthlyIncrease`, no `requireApproval`, not an unexempted agent),
//! it is one Apply Run that runs `apply -auto-approve`, with nothing saved in between, and
//! its record says so (`applyMode: "one_step"`). When a rule covers it, it is planned first
//! with `-out` (a plan Run, `applyMode: "proposes_apply"`); once planned, the gate proposes
//! the Apply Run pinned to that saved plan and the rules decide on it, so an approval always
//! binds the plan that runs. An agent's submission is held before anything plans.
//! The gate checks the rules again when it decides (see the gate's `one_step`).

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::json;
use takosumi_core::{ApplyMode, EventKind, HoldReason, Role, RunKind, Topic};
use takosumi_policy::RuleSet;
use takosumi_store::{capsules, rules, runs};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract};

pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/capsules/{cap}/apply",
            Access::Token(Action::Submit, Scope::Capsule),
            apply_capsule,
        )
        .doc(
            Doc::op(
                "applyCapsule",
                "Plan and apply in one step (the gate still holds what needs review)",
            )
            .optional_body::<ApplyCapsule>()
            .ok::<takosumi_wire::ApplySubmitted>(202)
            .header("Idempotency-Key", "The same key returns the same Run."),
        )
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ApplyCapsule {
    /// Hold the apply for a person whatever the rules say (it is then planned first).
    #[serde(default)]
    require_approval: bool,
}

/// The Capsule's rules over its Workspace's.
pub(crate) async fn effective_rules(
    st: &AppState,
    capsule: &capsules::Capsule,
) -> Result<RuleSet, ApiError> {
    let in_force = rules::rules_in_force(&st.pool, capsule.workspace_id, capsule.id).await?;
    RuleSet::layered(
        in_force.capsule.as_ref().map(|r| &r.rules),
        in_force.workspace.as_ref().map(|r| &r.rules),
    )
    .map_err(|e| ApiError::Internal {
        transient: false,
        source: Box::new(e),
    })
}

async fn apply_capsule(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Submit).await?;
    let req: ApplyCapsule = extract::optional_body(&body)?;
    let key = extract::idempotency_key(&headers)?;
    if let Some(run) = replay(&st, &capsule, key.as_deref()).await? {
        let covered_by = covered_when_started(&st, &run).await?;
        return Ok((StatusCode::ACCEPTED, submitted(&run, covered_by)));
    }

    let rules = effective_rules(&st, &capsule).await?;
    let mut covered_by: Vec<HoldReason> = rules.covering_rules();
    if req.require_approval {
        covered_by.push(HoldReason::RequireApproval);
    }
    let hold_agent = caller.0.role == Role::Agent
        && !crate::gates::agent_exempt(&st, &capsule, &caller.0.name).await?;
    if hold_agent {
        covered_by.push(HoldReason::AgentRun);
    }
    let one_step = covered_by.is_empty();
    let kind = if one_step {
        RunKind::Apply
    } else {
        RunKind::Plan
    };
    let new = runs::NewRun {
        id: takosumi_core::RunId::new(),
        kind,
        workspace_id: capsule.workspace_id,
        capsule_id: capsule.id,
        run_group_id: None,
        plan_run_id: None,
        actor_kind: crate::proposals::actor_kind(&caller),
        actor_id: caller.0.id.to_string(),
        auto_apply_requested: false,
        idempotency_key: key.clone(),
        require_approval: req.require_approval,
        traceparent: takosumi_telemetry::current_trace().map(|t| t.to_string()),
        vars: None,
    };
    let mode = if one_step {
        ApplyMode::OneStep
    } else {
        ApplyMode::ProposesApply
    };
    let actor = caller.actor();
    let start = runs::Start {
        actor: &actor,
        event: json!(QueuedSubmission {
            kind,
            apply_mode: Some(mode),
            covered_by: covered_by.clone(),
        }),
        activity: json!({ "kind": kind, "capsuleId": capsule.id, "applyMode": mode }),
        wake: if one_step {
            // The gate reads the rules again when it decides, and releases it to run in one step.
            Some(Topic::Gate)
        } else if hold_agent {
            None
        } else {
            Some(Topic::Plan)
        },
    };
    let mut tx = st.pool.begin().await?;
    let run_id = match runs::start(tx.db(), &new, start).await {
        Ok(run) => run.id,
        Err(e) if e.is_unique_violation() && key.is_some() => {
            drop(tx);
            let run = replay(&st, &capsule, key.as_deref())
                .await?
                .ok_or_else(ApiError::idempotency_key_in_flight)?;
            let covered_by = covered_when_started(&st, &run).await?;
            return Ok((StatusCode::ACCEPTED, submitted(&run, covered_by)));
        }
        Err(e) => return Err(e.into()),
    };
    runs::apply_mode::set(&mut tx, run_id, mode).await?;
    if !one_step && hold_agent {
        crate::gates::hold_agent_plan(&mut tx, run_id, &caller).await?;
    }
    let run = crate::proposals::commit_started(&st, tx, run_id).await?;
    Ok((StatusCode::ACCEPTED, submitted(&run, covered_by)))
}

/// The answer (`takosumi_wire::ApplySubmitted` reads it): the Run as every answer shows
/// it, and the rules that made it plan first.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct SubmittedView<'a> {
    #[serde(flatten)]
    run: crate::views::RunView<'a>,
    covered_by: Vec<HoldReason>,
}

fn submitted(run: &runs::Run, covered_by: Vec<HoldReason>) -> axum::response::Response {
    Json(SubmittedView {
        run: crate::views::RunView::of(run),
        covered_by,
    })
    .into_response()
}

/// The `queued` event of an apply submission's Run: what the submission started and the
/// rules that made it plan first. Written when it starts, read back by a replay.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct QueuedSubmission {
    /// `apply` (one step) or `plan` (planned first).
    kind: RunKind,
    #[serde(default)]
    apply_mode: Option<ApplyMode>,
    #[serde(default)]
    covered_by: Vec<HoldReason>,
}

/// What covered an earlier submission, as its `queued` event recorded it: a replay answers
/// what the first answer said, though the rules may have changed since.
async fn covered_when_started(st: &AppState, run: &runs::Run) -> Result<Vec<HoldReason>, ApiError> {
    let events = takosumi_store::events::list(&st.pool, run.id).await?;
    Ok(events
        .into_iter()
        .find(|e| e.kind == EventKind::Queued)
        .and_then(|e| serde_json::from_value::<QueuedSubmission>(e.data).ok())
        .map(|q| q.covered_by)
        .unwrap_or_default())
}

/// The Run an earlier apply submission of this Capsule with the same key created.
async fn replay(
    st: &AppState,
    capsule: &capsules::Capsule,
    key: Option<&str>,
) -> Result<Option<runs::Run>, ApiError> {
    let Some(key) = key else { return Ok(None) };
    let Some(id) = runs::find_by_idempotency_key(&st.pool, capsule.workspace_id, key).await? else {
        return Ok(None);
    };
    let run = runs::get(&st.pool, id)
        .await?
        .ok_or_else(|| ApiError::not_found("the idempotent Run"))?;
    let same = run.capsule_id == capsule.id && run.apply_mode.is_some();
    if !same {
        return Err(ApiError::invalid(
            ErrorCode::IdempotencyKeyReused,
            "this Idempotency-Key was already used for a different request",
        ));
    }
    Ok(Some(run))
}
