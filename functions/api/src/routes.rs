//! The core endpoints: health, creating Workspaces and Capsules, reading a Capsule and a
//! Run (its events and logs), and the plan, destroy-plan and apply submissions (`proposals`
//! starts their Runs). Each submission validates everything first, then writes its rows
//! and the wake-up in one transaction; bad input changes nothing.

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::{Value, json};
use takosumi_core::{ActivityKind, RunKind};
use takosumi_runner::{Runner, Tool};
use takosumi_store::{activity, capsules, events, workspaces};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, proposals, views};

pub fn api() -> Api {
    Api::new()
        .route(Method::GET, "/healthz", Access::Public, healthz)
        .doc(
            Doc::op("health", "Whether the API, Postgres and the broker are up")
                .ok_object(200, "`{\"status\", \"postgres\", \"broker\"}`, each `ok`.")
                .ok_object(
                    503,
                    "The same, naming the dependency that is `unavailable`.",
                ),
        )
        .route(
            Method::POST,
            "/api/v1/workspaces",
            Access::Token(Action::Administer, Scope::Instance),
            create_workspace,
        )
        .doc(
            Doc::op("createWorkspace", "Create a Workspace")
                .body::<NewWorkspace>()
                .ok::<takosumi_wire::Workspace>(201),
        )
        .route(
            Method::POST,
            "/api/v1/workspaces/{ws}/capsules",
            Access::Token(Action::Operate, Scope::Workspace),
            create_capsule,
        )
        .doc(
            Doc::op("createCapsule", "Register a Capsule")
                .body::<NewCapsule>()
                .ok::<takosumi_wire::Capsule>(201),
        )
        .route(
            Method::GET,
            "/api/v1/capsules/{cap}",
            Access::Token(Action::Read, Scope::Capsule),
            get_capsule,
        )
        .doc(
            Doc::op(
                "getCapsule",
                "A Capsule, its status and current StateVersion",
            )
            .ok::<takosumi_wire::Capsule>(200),
        )
        .route(
            Method::DELETE,
            "/api/v1/capsules/{cap}",
            Access::Token(Action::Submit, Scope::Capsule),
            destroy_capsule,
        )
        .doc(
            Doc::op(
                "destroyCapsule",
                "Propose a destroy plan (nothing is destroyed until it is applied)",
            )
            .optional_body::<crate::bindings::PlanInputs>()
            .ok::<takosumi_wire::Run>(202)
            .header("Idempotency-Key", "The same key returns the same Run."),
        )
        .route(
            Method::POST,
            "/api/v1/capsules/{cap}/plan",
            Access::Token(Action::Submit, Scope::Capsule),
            plan_capsule,
        )
        .doc(
            Doc::op("planCapsule", "Submit a plan Run")
                .optional_body::<crate::bindings::PlanInputs>()
                .ok::<takosumi_wire::Run>(202)
                .header("Idempotency-Key", "The same key returns the same Run."),
        )
        .route(
            Method::GET,
            "/api/v1/runs/{run}",
            Access::Token(Action::Read, Scope::Run),
            get_run,
        )
        .doc(Doc::op("getRun", "The Run record").ok::<takosumi_wire::Run>(200))
        .route(
            Method::GET,
            "/api/v1/runs/{run}/events",
            Access::Token(Action::Read, Scope::Run),
            run_events,
        )
        .doc(
            Doc::op("listRunEvents", "The Run's ordered events")
                .ok::<takosumi_wire::EventList>(200),
        )
        .route(
            Method::GET,
            "/api/v1/runs/{run}/logs",
            Access::Token(Action::Read, Scope::Run),
            run_logs,
        )
        .doc(Doc::op("listRunLogs", "The Run's masked logs").ok::<takosumi_wire::LogList>(200))
        .route(
            Method::POST,
            "/api/v1/runs/{run}/apply",
            Access::Token(Action::Submit, Scope::Run),
            apply_run,
        )
        .doc(
            Doc::op("applyRun", "Propose the apply pinned to this plan")
                .optional_body::<ApplyOptions>()
                .ok::<takosumi_wire::Run>(202)
                .header("Idempotency-Key", "The same key returns the same Run."),
        )
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct NewWorkspace {
    name: String,
}

/// Readiness: 200 when Postgres answers a query and the broker connection is up (or comes
/// up), 503 naming which is not, each checked within two seconds. What is wrong is named,
/// never why (no addresses, no errors).
async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    const LIMIT: std::time::Duration = std::time::Duration::from_secs(2);
    let (postgres, broker) = tokio::join!(
        tokio::time::timeout(LIMIT, takosumi_store::ping(&state.pool)),
        tokio::time::timeout(LIMIT, state.bus.get()),
    );
    let postgres = matches!(postgres, Ok(Ok(())));
    let broker = matches!(broker, Ok(Ok(_)));
    let word = |ok: bool| if ok { "ok" } else { "unavailable" };
    let status = if postgres && broker {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({
            "status": word(postgres && broker),
            "postgres": word(postgres),
            "broker": word(broker),
        })),
    )
}

async fn create_workspace(
    State(st): State<AppState>,
    caller: Caller,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    caller.require(Action::Administer, None)?;
    let req: NewWorkspace = extract::parse_body(&body)?;
    if !extract::valid_name(&req.name) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidName,
            "a Workspace name is 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit",
        ));
    }
    let mut tx = st.pool.begin().await?;
    let ws = match workspaces::create(&mut tx, &req.name).await {
        Ok(ws) => ws,
        Err(e) if e.is_unique_violation() => {
            return Err(ApiError::conflict(
                ErrorCode::WorkspaceExists,
                format!("a Workspace named {:?} already exists", req.name),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    activity::append(
        tx.db(),
        ws.id,
        ActivityKind::WorkspaceCreated,
        &ws.id.to_string(),
        &caller.actor(),
        json!({ "name": ws.name }),
    )
    .await?;
    tx.commit().await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": ws.id, "name": ws.name, "createdAt": ws.created_at })),
    ))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct NewCapsuleSource {
    repo: String,
    #[serde(default = "default_branch")]
    branch: String,
}

fn default_branch() -> String {
    "main".to_owned()
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct NewCapsule {
    name: String,
    source: NewCapsuleSource,
    #[serde(default)]
    dir: String,
    tool: String,
    #[serde(default)]
    #[schema(value_type = Object)]
    vars: serde_json::Map<String, Value>,
}

async fn create_capsule(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Operate).await?;
    let req: NewCapsule = extract::parse_body(&body)?;
    if !extract::valid_name(&req.name) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidName,
            "a Capsule name is 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit",
        ));
    }
    let repo = req.source.repo.trim();
    takosumi_runner::check_repo_url(repo, st.allow_file_repos)
        .map_err(|e| ApiError::invalid(ErrorCode::InvalidSource, e.0))?;
    let branch = req.source.branch.trim();
    if branch.is_empty()
        || branch.starts_with('-')
        || branch.contains("..")
        || branch.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(ApiError::invalid(
            ErrorCode::InvalidSource,
            "source.branch must be a branch name",
        ));
    }
    // 400, not 422: a directory that escapes the checkout is a malformed request.
    Runner::validate_dir(&req.dir).map_err(|e| {
        ApiError::client(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidDir,
            format!("{e}; give a directory relative to the repository root, without '..'"),
        )
    })?;
    let tool = req.tool.parse::<Tool>().map_err(|_| {
        ApiError::invalid(
            ErrorCode::InvalidTool,
            "tool must be \"tofu\" or \"terraform\"",
        )
    })?;
    takosumi_runner::ToolEnv::new()
        .with_variables(&req.vars)
        .map_err(|e| ApiError::invalid(ErrorCode::InvalidVars, e.to_string()))?;
    let vars = Value::Object(req.vars.clone());
    let new = capsules::NewCapsule {
        workspace_id: ws,
        name: &req.name,
        repo,
        branch,
        dir: &req.dir,
        tool,
        vars: &vars,
    };
    let mut tx = st.pool.begin().await?;
    let id = match capsules::create(&mut tx, &new).await {
        Ok(id) => id,
        Err(e) if e.is_unique_violation() => {
            return Err(ApiError::conflict(
                ErrorCode::CapsuleExists,
                format!(
                    "a Capsule named {:?} already exists in this Workspace",
                    req.name
                ),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    activity::append(
        tx.db(),
        ws,
        ActivityKind::CapsuleRegistered,
        &id.to_string(),
        &caller.actor(),
        json!({ "name": req.name, "repo": repo, "branch": branch, "dir": req.dir }),
    )
    .await?;
    let shown = capsules::get_shown(tx.db(), id)
        .await?
        .ok_or_else(|| ApiError::not_found("the new Capsule"))?;
    tx.commit().await?;
    Ok((StatusCode::CREATED, views::capsule_json(&shown, &caller)).into_response())
}

async fn get_capsule(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Read).await?;
    let shown = capsules::get_shown(&st.pool, capsule.id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Capsule"))?;
    Ok(views::capsule_json(&shown, &caller))
}

async fn plan_capsule(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let inputs = crate::bindings::PlanInputs::parse(&body)?;
    proposals::submit_plan(st, caller, cap, headers, RunKind::Plan, inputs).await
}

async fn destroy_capsule(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    // A destroy plan needs the configuration's variables too: same optional body as a plan.
    let inputs = crate::bindings::PlanInputs::parse(&body)?;
    proposals::submit_plan(st, caller, cap, headers, RunKind::Destroy, inputs).await
}

/// Options of an apply submission.
#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ApplyOptions {
    /// Hold the apply for a person whatever the rules say.
    #[serde(default)]
    require_approval: bool,
}

async fn apply_run(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let plan = extract::run(&st, &caller, &run, Action::Submit).await?;
    let key = extract::idempotency_key(&headers)?;
    let options: ApplyOptions = if body.iter().all(u8::is_ascii_whitespace) {
        ApplyOptions::default()
    } else {
        extract::parse_body(&body)?
    };
    let run = proposals::propose_apply(&st, &caller, &plan, key, options.require_approval).await?;
    Ok((StatusCode::ACCEPTED, views::run_json(&run)))
}

async fn get_run(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    Ok(crate::views::run_json(&run))
}

async fn run_events(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    let list = events::list(&st.pool, run.id).await?;
    let items: Vec<Value> = list
        .iter()
        .map(
            |e| json!({ "id": e.id, "kind": e.kind, "actor": e.actor, "data": e.data, "at": e.at }),
        )
        .collect();
    Ok(Json(json!({ "runId": run.id, "events": items })))
}

async fn run_logs(
    State(st): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let run = extract::run(&st, &caller, &run, Action::Read).await?;
    let logs = takosumi_store::logs::read(&st.pool, run.id).await?;
    let items: Vec<Value> = logs
        .iter()
        .map(|c| json!({ "step": c.step, "text": c.text }))
        .collect();
    Ok(Json(json!({ "runId": run.id, "logs": items })))
}
