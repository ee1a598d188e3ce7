//! RunGroups: a plan-update of a Workspace's Capsules, and approving or applying a group's
//! Runs at once, each Run keeping its own record (its own approval, bound to its own plan
//! digest; its own Apply Run pinned to its own plan).

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::json;
use takosumi_core::{GroupKind, RunKind, RunStatus, WorkspaceId};
use takosumi_store::{capsules, groups, runs};
use takosumi_wire::{GroupResult, GroupResults, GroupStarted, ResultError, SkippedCapsule};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, proposals, views};

pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/workspaces/{ws}/plan-update",
            Access::Token(Action::Submit, Scope::Workspace),
            plan_update,
        )
        .doc(
            Doc::op("planUpdateWorkspace", "A RunGroup of plan Runs")
                .optional_body::<PlanUpdate>()
                .ok::<GroupStarted>(202),
        )
        .route(
            Method::GET,
            "/api/v1/run-groups/{rg}",
            Access::Token(Action::Read, Scope::RunGroup),
            get_group,
        )
        .doc(Doc::op("getRunGroup", "A RunGroup and its Runs").ok::<takosumi_wire::RunGroup>(200))
        .route(
            Method::POST,
            "/api/v1/run-groups/{rg}/approve",
            Access::Token(Action::Approve, Scope::RunGroup),
            approve_group,
        )
        .doc(
            Doc::op("approveRunGroup", "Approve every held Run of the group")
                .ok::<GroupResults>(200),
        )
        .route(
            Method::POST,
            "/api/v1/run-groups/{rg}/apply",
            Access::Token(Action::Submit, Scope::RunGroup),
            apply_group,
        )
        .doc(
            Doc::op(
                "applyRunGroup",
                "Propose the apply of every planned Run of the group",
            )
            .ok::<GroupResults>(202),
        )
}

pub(crate) async fn start_group(
    st: &AppState,
    caller: &Caller,
    ws: WorkspaceId,
    kind: RunKind,
    only_stale: bool,
) -> Result<(StatusCode, Json<GroupStarted>), ApiError> {
    caller.require(Action::Submit, Some(ws))?;
    let ids = capsules::workspace_capsules(&st.pool, ws, only_stale).await?;
    let group_kind = if kind == RunKind::DriftCheck {
        GroupKind::DriftCheck
    } else {
        GroupKind::PlanUpdate
    };
    let mut tx = st.pool.begin().await?;
    let group = groups::create_group(&mut tx, ws, group_kind, &caller.actor()).await?;
    let mut created = Vec::new();
    let mut skipped = Vec::new();
    for id in ids {
        let Some(capsule) = capsules::get(tx.db(), id).await? else {
            continue;
        };
        if kind == RunKind::DriftCheck && capsule.drift_baseline_run_id.is_none() {
            skipped.push(SkippedCapsule {
                capsule_id: capsule.id,
                code: ErrorCode::NotApplied.into(),
            });
            continue;
        }
        let hold_for = proposals::agent_to_hold(st, caller, &capsule).await?;
        let start = proposals::RunStart {
            kind,
            capsule: &capsule,
            group: Some(group),
            actor_kind: proposals::actor_kind(caller),
            actor_id: caller.0.id.to_string(),
            actor: caller.actor(),
            auto_apply: false,
            hold_for,
        };
        created.push(proposals::start_run(&mut tx, &start).await?);
    }
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok((
        StatusCode::ACCEPTED,
        Json(GroupStarted {
            id: group,
            workspace_id: ws,
            kind: group_kind.into(),
            run_ids: created,
            skipped,
        }),
    ))
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PlanUpdate {
    #[serde(default)]
    only_stale: bool,
}

async fn plan_update(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let req: PlanUpdate = extract::optional_body(&body)?;
    start_group(&st, &caller, ws, RunKind::Plan, req.only_stale).await
}

async fn get_group(
    State(st): State<AppState>,
    caller: Caller,
    Path(rg): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let group = extract::run_group(&st, &caller, &rg, Action::Read).await?;
    let ids = groups::group_runs(&st.pool, group.id).await?;
    let runs = runs::get_many(&st.pool, &ids).await?;
    let items: Vec<views::RunView<'_>> = runs.iter().map(views::RunView::of).collect();
    Ok(Json(
        json!({ "id": group.id, "workspaceId": group.workspace_id, "kind": group.kind, "createdBy": group.created_by, "createdAt": group.created_at, "runs": items }),
    ))
}

/// Approves every held Run of the group, each with its own approval record (bound to
/// its own plan digest); Runs this caller may not approve are listed with the reason.
async fn approve_group(
    State(st): State<AppState>,
    caller: Caller,
    Path(rg): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let group = extract::run_group(&st, &caller, &rg, Action::Read).await?;
    let mut results = Vec::new();
    for id in groups::group_runs(&st.pool, group.id).await? {
        let Some(run) = runs::get(&st.pool, id).await? else {
            continue;
        };
        if run.status != RunStatus::Held {
            continue;
        }
        let done = match crate::gates::approve_run(&st, &caller, &run, None, None).await {
            Ok((now, approvals)) => GroupResult {
                status: Some(now.status),
                approvals: Some(approvals),
                ..GroupResult::default()
            },
            Err(e) => refused(e)?,
        };
        results.push(GroupResult {
            run_id: Some(id),
            ..done
        });
    }
    Ok(Json(GroupResults {
        id: group.id,
        results,
    }))
}

/// One Run's refusal (the 4xx its own endpoint would answer) as its result; any other
/// error ends the whole request.
fn refused(e: ApiError) -> Result<GroupResult, ApiError> {
    match e {
        ApiError::Client { code, message, .. } => Ok(GroupResult {
            error: Some(ResultError {
                code: code.into(),
                message,
            }),
            ..GroupResult::default()
        }),
        e => Err(e),
    }
}

/// Proposes an apply for each planned Run of the group, each pinned to its own plan.
async fn apply_group(
    State(st): State<AppState>,
    caller: Caller,
    Path(rg): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let group = extract::run_group(&st, &caller, &rg, Action::Submit).await?;
    let mut results = Vec::new();
    for id in groups::group_runs(&st.pool, group.id).await? {
        let Some(run) = runs::get(&st.pool, id).await? else {
            continue;
        };
        if !run.kind.is_plan_like() || run.status != RunStatus::Planned {
            continue;
        }
        let done = match proposals::propose_apply(&st, &caller, &run, None, false).await {
            Ok(apply) => GroupResult {
                apply_run_id: Some(apply.id),
                ..GroupResult::default()
            },
            Err(e) => refused(e)?,
        };
        results.push(GroupResult {
            plan_run_id: Some(id),
            ..done
        });
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(GroupResults {
            id: group.id,
            results,
        }),
    ))
}
