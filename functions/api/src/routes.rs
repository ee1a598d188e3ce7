//! Endpoints. Each submission validates everything first, then writes its rows and the
//! wake-up in one transaction; bad input changes nothing.

use crate::access::{Access, Api, Doc, Scope};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use takosumi_core::{ActorKind, Role, RunKind, RunStatus, Topic, WorkspaceId};
use takosumi_runner::{Runner, Tool};
use takosumi_store::{activity, capsules, events, outbox, runs, workspaces};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, views};

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
        .merge(crate::gates::api())
        .merge(crate::one_step::api())
        .merge(crate::detection::api())
        .merge(crate::listing::api())
        .merge(crate::bindings::api())
        .merge(crate::records::api())
        .merge(crate::dead_letters::api())
        .merge(crate::pools::api())
        .merge(crate::relay::api())
        .merge(crate::evidence::api())
        .merge(crate::review::api())
        .merge(crate::tokens::api())
        .merge(crate::openapi::api())
        .merge(crate::dashboard::api())
}

/// The routes with the answers for no route and a wrong method.
pub fn router() -> Router<AppState> {
    let (router, _) = api().into_parts();
    router
        .fallback(|| async {
            ApiError::client(
                StatusCode::NOT_FOUND,
                ErrorCode::NoSuchEndpoint,
                "no such endpoint; the API is described at GET /api/v1/openapi.json",
            )
        })
        // An id that happens to spell a sub-resource (`/capsules/rules`) meets a route of
        // other methods: still an answer with a code.
        .method_not_allowed_fallback(|| async {
            ApiError::client(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorCode::MethodNotAllowed,
                "this endpoint does not take that method; the API is described at GET /api/v1/openapi.json",
            )
        })
        .layer(axum::middleware::from_fn(crate::observe::trace))
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
        &mut *tx,
        ws.id,
        "workspace_created",
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
    req.tool.parse::<Tool>().map_err(|_| {
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
        tool: &req.tool,
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
        &mut *tx,
        ws,
        "capsule_registered",
        &id.to_string(),
        &caller.actor(),
        json!({ "name": req.name, "repo": repo, "branch": branch, "dir": req.dir }),
    )
    .await?;
    let capsule = capsules::get(&mut *tx, id)
        .await?
        .ok_or_else(|| ApiError::not_found("the new Capsule"))?;
    tx.commit().await?;
    Ok((
        StatusCode::CREATED,
        Json(views::capsule(
            &capsule,
            caller.may(Action::Operate, Some(capsule.workspace_id)),
        )),
    ))
}

async fn get_capsule(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Read).await?;
    let mut body = views::capsule(
        &capsule,
        caller.may(Action::Operate, Some(capsule.workspace_id)),
    );
    // The latest finished drift check decides whether the Capsule shows as drifted.
    let drift = takosumi_store::detection::capsule_drifted(&st.pool, capsule.id).await?;
    body["drift"] = json!(drift);
    body["drifted"] = json!(drift == Some(true));
    // The worker pool it runs on; `null`: the control node's own queues.
    let pool = takosumi_store::pools::of_capsule(&st.pool, capsule.id).await?;
    body["pool"] = json!(pool.map(|p| p.name));
    if drift == Some(true) && body["status"] == json!("ok") {
        body["status"] = json!("drifted");
    }
    Ok(Json(body))
}

async fn plan_capsule(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let inputs = crate::bindings::PlanInputs::parse(&body)?;
    submit_plan(st, caller, cap, headers, RunKind::Plan, inputs).await
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
    submit_plan(st, caller, cap, headers, RunKind::Destroy, inputs).await
}

pub(crate) fn actor_kind(caller: &Caller) -> ActorKind {
    if caller.0.role == Role::Agent {
        ActorKind::Agent
    } else {
        ActorKind::User
    }
}

/// Returns the Run an earlier submission with the same key created, if it is the same
/// kind of request.
async fn replay(
    st: &AppState,
    ws: WorkspaceId,
    key: Option<&str>,
    kind: RunKind,
    subject: &str,
) -> Result<Option<runs::Run>, ApiError> {
    let Some(key) = key else { return Ok(None) };
    let Some(id) = runs::find_by_idempotency_key(&st.pool, ws, key).await? else {
        return Ok(None);
    };
    let run = runs::get(&st.pool, id)
        .await?
        .ok_or_else(|| ApiError::not_found("the idempotent Run"))?;
    let same = run.kind == kind
        && (run.capsule_id.to_string() == subject
            || run.plan_run_id.is_some_and(|p| p.to_string() == subject));
    if !same {
        return Err(ApiError::invalid(
            ErrorCode::IdempotencyKeyReused,
            "this Idempotency-Key was already used for a different request",
        ));
    }
    Ok(Some(run))
}

async fn submit_plan(
    st: AppState,
    caller: Caller,
    cap: String,
    headers: HeaderMap,
    kind: RunKind,
    inputs: crate::bindings::PlanInputs,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Submit).await?;
    let key = extract::idempotency_key(&headers)?;
    let vars = inputs.effective_vars(&capsule)?;
    if inputs.auto_apply_requested {
        // The seed: "when a user starts an install … the Run records autoApplyRequested".
        if kind != RunKind::Plan {
            return Err(ApiError::invalid(
                ErrorCode::InvalidAutoApply,
                "autoApplyRequested is for a plan (an install); a destroy plan always stops for review: apply it explicitly",
            ));
        }
        if caller.0.role == Role::Agent {
            return Err(ApiError::client(
                StatusCode::FORBIDDEN,
                ErrorCode::AutoApplyPersonOnly,
                "autoApplyRequested is asked for by a person starting an install; an agent's plan is applied only through review",
            ));
        }
    }
    let hold_agent = caller.0.role == Role::Agent
        && !crate::gates::agent_exempt(&st, &capsule, &caller.0.name).await?;
    if let Some(run) = replay(
        &st,
        capsule.workspace_id,
        key.as_deref(),
        kind,
        &capsule.id.to_string(),
    )
    .await?
    {
        return Ok((StatusCode::ACCEPTED, views::run_json(&run)));
    }
    let new = runs::NewRun {
        kind,
        workspace_id: capsule.workspace_id,
        capsule_id: capsule.id,
        run_group_id: None,
        plan_run_id: None,
        actor_kind: actor_kind(&caller),
        actor_id: caller.0.id.to_string(),
        auto_apply_requested: inputs.auto_apply_requested,
        idempotency_key: key.clone(),
        traceparent: takosumi_telemetry::current_trace().map(|t| t.to_string()),
    };
    let mut tx = st.pool.begin().await?;
    let id = match runs::insert(&mut tx, &new).await {
        Ok(id) => id,
        Err(e) if e.is_unique_violation() && key.is_some() => {
            drop(tx);
            let run = replay(
                &st,
                capsule.workspace_id,
                key.as_deref(),
                kind,
                &capsule.id.to_string(),
            )
            .await?
            .ok_or_else(|| {
                ApiError::conflict(
                    ErrorCode::Conflict,
                    "a concurrent request with this Idempotency-Key is in progress; retry",
                )
            })?;
            return Ok((StatusCode::ACCEPTED, views::run_json(&run)));
        }
        Err(e) => return Err(e.into()),
    };
    inputs.store(&st, &mut tx, id, &vars).await?;
    events::append(
        &mut *tx,
        id,
        "queued",
        &caller.actor(),
        json!({ "kind": kind, "autoApplyRequested": inputs.auto_apply_requested }),
    )
    .await?;
    activity::append(
        &mut *tx,
        capsule.workspace_id,
        "run_started",
        &id.to_string(),
        &caller.actor(),
        json!({ "kind": kind, "capsuleId": capsule.id }),
    )
    .await?;
    if hold_agent {
        crate::gates::hold_agent_plan(&mut tx, id, &caller).await?;
    } else {
        outbox::enqueue(&mut tx, Topic::Plan, id).await?;
    }
    let run = runs::get(&mut *tx, id)
        .await?
        .ok_or_else(|| ApiError::not_found("the new Run"))?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok((StatusCode::ACCEPTED, views::run_json(&run)))
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
    let run = propose_apply(&st, &caller, &plan, key, options.require_approval).await?;
    Ok((StatusCode::ACCEPTED, views::run_json(&run)))
}

/// Creates the Apply Run pinned to `plan` (or returns the one an earlier submission with
/// the same Idempotency-Key created), with its gate wake-up, in one transaction.
pub(crate) async fn propose_apply(
    st: &AppState,
    caller: &Caller,
    plan: &runs::Run,
    key: Option<String>,
    require_approval: bool,
) -> Result<runs::Run, ApiError> {
    if let Some(run) = replay(
        st,
        plan.workspace_id,
        key.as_deref(),
        RunKind::Apply,
        &plan.id.to_string(),
    )
    .await?
    {
        return Ok(run);
    }
    if !plan.kind.is_plan_like() {
        return Err(ApiError::conflict(
            ErrorCode::NotAPlan,
            format!(
                "{} is an apply Run; apply the plan Run it carries out instead",
                plan.id
            ),
        ));
    }
    if plan.status != RunStatus::Planned {
        return Err(ApiError::conflict(
            ErrorCode::PlanNotReady,
            format!(
                "{} is {}; only a planned Run can be applied",
                plan.id,
                plan.status.as_str()
            ),
        ));
    }
    // An unresolved unknown_outcome apply locks the Capsule against applies until an
    // operator resolves it; say so now rather than queue an apply that will be refused.
    if let Some(blocking) =
        takosumi_store::unrecorded::unresolved_unknown_apply(&st.pool, plan.capsule_id).await?
    {
        return Err(ApiError::conflict(
            ErrorCode::CapsuleNeedsInspection,
            takosumi_store::unrecorded::needs_inspection_message(blocking),
        ));
    }
    let speculative = takosumi_store::detection::speculative(&st.pool, plan.id).await?;
    if speculative {
        return Err(ApiError::conflict(
            ErrorCode::SpeculativePlan,
            format!(
                "{} is a pull request's speculative plan and can never be applied",
                plan.id
            ),
        ));
    }
    if plan.kind == RunKind::DriftCheck && plan.drift == Some(true) && plan.plan_digest.is_none() {
        return Err(ApiError::conflict(
            ErrorCode::NoKeptPlan,
            format!(
                "{} found drift, but its plan was too large to cross the relay and was not kept, so a reconcile cannot be proposed from it; run the check on a queue the control node executes (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}}) and reconcile from that check",
                plan.id
            ),
        ));
    }
    if plan.kind == RunKind::DriftCheck
        && (plan.drift != Some(true) || plan.plan_object_key.is_none())
    {
        return Err(ApiError::conflict(
            ErrorCode::NoKeptPlan,
            format!(
                "{} kept no plan (it found no drift, or a newer check of the Capsule replaced it); run the check again and propose the reconcile from it",
                plan.id
            ),
        ));
    }
    if plan.plan_object_key.is_none() {
        return Err(ApiError::conflict(
            ErrorCode::PlanAlreadyUsed,
            format!(
                "the saved plan of {} was already applied or wiped; plan again",
                plan.id
            ),
        ));
    }
    if let Some(existing) = runs::live_apply_of(&st.pool, plan.id).await? {
        return Err(ApiError::conflict(
            ErrorCode::ApplyExists,
            format!("{existing} already applies this plan"),
        ));
    }
    let new = runs::NewRun {
        kind: RunKind::Apply,
        workspace_id: plan.workspace_id,
        capsule_id: plan.capsule_id,
        run_group_id: plan.run_group_id,
        plan_run_id: Some(plan.id),
        actor_kind: actor_kind(caller),
        actor_id: caller.0.id.to_string(),
        auto_apply_requested: false,
        idempotency_key: key.clone(),
        traceparent: takosumi_telemetry::current_trace().map(|t| t.to_string()),
    };
    let mut tx = st.pool.begin().await?;
    let id = match runs::insert(&mut tx, &new).await {
        Ok(id) => id,
        Err(e) if e.is_unique_violation() => {
            drop(tx);
            if let Some(run) = replay(
                st,
                plan.workspace_id,
                key.as_deref(),
                RunKind::Apply,
                &plan.id.to_string(),
            )
            .await?
            {
                return Ok(run);
            }
            return Err(ApiError::conflict(
                ErrorCode::ApplyExists,
                format!("another apply of {} was just submitted", plan.id),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    events::append(
        &mut *tx,
        id,
        "queued",
        &caller.actor(),
        json!({ "kind": "apply", "planRunId": plan.id, "planDigest": plan.plan_digest }),
    )
    .await?;
    activity::append(
        &mut *tx,
        plan.workspace_id,
        "run_started",
        &id.to_string(),
        &caller.actor(),
        json!({ "kind": "apply", "planRunId": plan.id }),
    )
    .await?;
    if require_approval {
        takosumi_store::gates::set_require_approval(&mut tx, id).await?;
    }
    // A pool with no delivery key can never receive the saved plan: the apply fails at
    // once, with a code that says so.
    if !crate::relay::fail_if_pool_has_no_key(&mut tx, id, plan.capsule_id).await? {
        outbox::enqueue(&mut tx, Topic::Gate, id).await?;
    }
    let run = runs::get(&mut *tx, id)
        .await?
        .ok_or_else(|| ApiError::not_found("the new Run"))?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok(run)
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
        .map(|(step, text)| json!({ "step": step, "text": text }))
        .collect();
    Ok(Json(json!({ "runId": run.id, "logs": items })))
}
