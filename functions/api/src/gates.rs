//! Rules, approvals and releases. Rules are versioned per Workspace and per Capsule, and a
//! policy that does not compile is rejected when it is set. An approval is bound to the
//! digest of the plan its approver is shown: approving one plan can never release
//! another, the requester cannot approve their own Run, and only the rule's approver
//! roles count.

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::json;
use takosumi_core::{
    ActivityKind, CapsuleId, EventKind, HoldReason, RunId, RunStatus, Topic, WorkspaceId,
};
use takosumi_policy::RuleSet;
use takosumi_store::{activity, approvals, capsules, events, outbox, rules, runs};
use takosumi_wire::{ApprovalCount, RulesAnswer};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, views};

pub fn api() -> Api {
    Api::new()
        .route(
            Method::PUT,
            "/api/v1/workspaces/{ws}/rules",
            Access::Token(Action::Administer, Scope::Workspace),
            set_workspace_rules,
        )
        .doc(
            Doc::op(
                "setWorkspaceRules",
                "Replace the Workspace's approval rules",
            )
            .object_body("A rule set.")
            .ok::<takosumi_wire::RulesAnswer>(200),
        )
        .route(
            Method::GET,
            "/api/v1/workspaces/{ws}/rules",
            Access::Token(Action::Read, Scope::Workspace),
            get_workspace_rules,
        )
        .doc(
            Doc::op("getWorkspaceRules", "The Workspace's approval rules")
                .ok::<takosumi_wire::RulesAnswer>(200),
        )
        .route(
            Method::PUT,
            "/api/v1/capsules/{cap}/rules",
            Access::Token(Action::Administer, Scope::Capsule),
            set_capsule_rules,
        )
        .doc(
            Doc::op("setCapsuleRules", "Replace the Capsule's approval rules")
                .object_body("A rule set.")
                .ok::<takosumi_wire::RulesAnswer>(200),
        )
        .route(
            Method::GET,
            "/api/v1/capsules/{cap}/rules",
            Access::Token(Action::Read, Scope::Capsule),
            get_capsule_rules,
        )
        .doc(
            Doc::op("getCapsuleRules", "The Capsule's approval rules")
                .ok::<takosumi_wire::RulesAnswer>(200),
        )
        .route(
            Method::POST,
            "/api/v1/runs/{run}/approve",
            Access::Token(Action::Approve, Scope::Run),
            approve,
        )
        .doc(
            Doc::op("approveRun", "Approve a held Run, bound to its plan digest")
                .optional_body::<ApproveBody>()
                .ok::<takosumi_wire::Approved>(200),
        )
}

fn parse_rules(body: &Bytes) -> Result<RuleSet, ApiError> {
    extract::refuse_nul(body)?;
    let rules: RuleSet = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_json(format!("the rules are not valid: {e}")))?;
    rules.validate().map_err(|e| match e {
        takosumi_policy::PolicyError::Compile(m) => ApiError::invalid(
            ErrorCode::InvalidPolicy,
            format!("the plan_gate policy does not compile: {m}"),
        ),
        other => ApiError::invalid(ErrorCode::InvalidRules, other.to_string()),
    })?;
    Ok(rules)
}

async fn store_rules(
    st: &AppState,
    caller: &Caller,
    ws: WorkspaceId,
    cap: Option<CapsuleId>,
    rules: &RuleSet,
) -> Result<impl IntoResponse + use<>, ApiError> {
    let value = serde_json::to_value(rules).map_err(|e| ApiError::Internal {
        transient: false,
        source: Box::new(e),
    })?;
    let mut tx = st.pool.begin().await?;
    let version = rules::set_rules(&mut tx, ws, cap, &value, &caller.actor()).await?;
    let subject = cap.map_or_else(|| ws.to_string(), |c| c.to_string());
    activity::append(
        tx.db(),
        ws,
        ActivityKind::RulesSet,
        &subject,
        &caller.actor(),
        json!({ "version": version }),
    )
    .await?;
    tx.commit().await?;
    Ok((
        StatusCode::OK,
        Json(RulesAnswer {
            scope: subject,
            version: Some(version.into()),
            rules: value,
        }),
    ))
}

async fn set_workspace_rules(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Administer).await?;
    let rules = parse_rules(&body)?;
    store_rules(&st, &caller, ws, None, &rules).await
}

async fn get_workspace_rules(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let cur = rules::current_rules(&st.pool, ws, None).await?;
    Ok(Json(rules_answer(ws.to_string(), cur)))
}

async fn set_capsule_rules(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Administer).await?;
    let rules = parse_rules(&body)?;
    store_rules(&st, &caller, capsule.workspace_id, Some(capsule.id), &rules).await
}

async fn get_capsule_rules(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Read).await?;
    let cur = rules::current_rules(&st.pool, capsule.workspace_id, Some(capsule.id)).await?;
    Ok(Json(rules_answer(capsule.id.to_string(), cur)))
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ApproveBody {
    /// The digest of the plan the approver reviewed; refused when it is not this Run's.
    #[serde(default)]
    plan_digest: Option<String>,
    #[serde(default)]
    note: Option<String>,
}

async fn approve(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    let req: ApproveBody = extract::optional_body(&body)?;
    if req.note.as_ref().is_some_and(|n| n.len() > 2000) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidNote,
            "the note is at most 2000 characters",
        ));
    }
    let (run, approvals) = approve_run(
        &st,
        &caller,
        &run,
        req.plan_digest.as_deref(),
        req.note.as_deref(),
    )
    .await?;
    Ok(Json(ApprovedView {
        run: views::RunView::of(&run),
        approvals,
    })
    .into_response())
}

/// The approve answer: the Run as every answer shows it, and the approvals so far
/// (`takosumi_wire::Approved` reads it).
#[derive(serde::Serialize)]
struct ApprovedView<'a> {
    #[serde(flatten)]
    run: views::RunView<'a>,
    approvals: ApprovalCount,
}

/// A rule set's answer (none set: version `null`, the rules `{}`).
fn rules_answer(scope: String, cur: Option<rules::StoredRules>) -> RulesAnswer {
    RulesAnswer {
        scope,
        version: cur.as_ref().map(|r| r.version.into()),
        rules: cur.map_or_else(|| json!({}), |r| r.rules),
    }
}

/// Records one person's approval of a held Run, bound to the Run's plan digest, and
/// releases the Run when enough distinct approvals of the right roles are in.
pub async fn approve_run(
    st: &AppState,
    caller: &Caller,
    run: &runs::Run,
    plan_digest: Option<&str>,
    note: Option<&str>,
) -> Result<(runs::Run, ApprovalCount), ApiError> {
    let id = run.id;
    if run.status != RunStatus::Held {
        return Err(ApiError::conflict(
            ErrorCode::NotHeld,
            format!(
                "{id} is {}; only a held Run can be approved",
                run.status.as_str()
            ),
        ));
    }
    let gate = runs::hold::gate_fields(&st.pool, id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Run"))?;
    let (required, roles) = (gate.approvals_required, gate.approver_roles);
    if caller.0.id.to_string() == run.actor_id {
        return Err(ApiError::forbidden_code(
            ErrorCode::SelfApproval,
            "the requester of a Run cannot approve it; ask another approver",
        ));
    }
    if !roles.contains(&caller.0.role) {
        return Err(ApiError::forbidden(format!(
            "approvals of this Run count only from the roles {}",
            roles
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    if let Some(d) = plan_digest
        && Some(d) != run.plan_digest.as_deref()
    {
        return Err(ApiError::conflict(
            ErrorCode::PlanDigestMismatch,
            "this approval names another plan's digest; an approval only ever releases the plan its approver reviewed",
        ));
    }
    let mut tx = st.pool.begin().await?;
    if !approvals::add_approval(
        &mut tx,
        id,
        run.plan_digest.as_deref(),
        &caller.0.id.to_string(),
        caller.0.role,
        note,
    )
    .await?
    {
        return Err(ApiError::conflict(
            ErrorCode::AlreadyApproved,
            "you already approved this Run",
        ));
    }
    let given = approvals::count_approvals(&mut tx, id, run.plan_digest.as_deref(), &roles).await?;
    events::append(
        tx.db(),
        id,
        EventKind::Approved,
        &caller.actor(),
        json!({ "planDigest": run.plan_digest, "approvals": given, "required": required }),
    )
    .await?;
    activity::append(
        tx.db(),
        run.workspace_id,
        ActivityKind::Approval,
        &id.to_string(),
        &caller.actor(),
        json!({ "approvals": given, "required": required }),
    )
    .await?;
    // The approve step counts the approvals bound to this plan digest and releases the Run.
    outbox::enqueue(&mut tx, Topic::Approve, id).await?;
    let run = runs::get(tx.db(), id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Run"))?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    let count = ApprovalCount {
        given,
        required: required.into(),
    };
    Ok((run, count))
}

/// Whether the rules exempt this agent (by token name) from being held.
pub async fn agent_exempt(
    st: &AppState,
    capsule: &capsules::Capsule,
    token_name: &str,
) -> Result<bool, ApiError> {
    Ok(crate::one_step::effective_rules(st, capsule)
        .await?
        .agent_exemptions
        .iter()
        .any(|n| n == token_name))
}

/// Holds an agent's plan before anything plans: planning runs provider code with the
/// server's credentials, so a person releases it first.
pub async fn hold_agent_plan(
    tx: &mut takosumi_store::Tx,
    id: RunId,
    caller: &Caller,
) -> Result<(), ApiError> {
    let details =
        json!({ "reasons": [HoldReason::AgentRun], "agentRun": true, "stage": "before_plan" });
    let roles = takosumi_policy::default_approver_roles();
    runs::hold::hold(tx, id, HoldReason::AgentRun, &details, 1, &roles).await?;
    events::append(
        tx.db(),
        id,
        EventKind::Held,
        &caller.actor(),
        json!({ "reason": HoldReason::AgentRun, "stage": "before_plan" }),
    )
    .await?;
    Ok(())
}
