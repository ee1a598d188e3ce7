//! How the API starts a Run: a plan or destroy-plan submission, the Apply Run proposed
//! from a plan (one, or each of a RunGroup's), and the Runs detection starts (drift
//! checks, RunGroups, automatic-update and speculative plans). Each validates first, then
//! writes the Run with its `queued` event, `run_started` activity and wake-up in one
//! transaction; an agent's Run the rules do not exempt is held for a person instead of
//! woken.

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use serde_json::json;
use takosumi_core::{ActorKind, Role, RunGroupId, RunId, RunKind, RunStatus, Topic, WorkspaceId};
use takosumi_store::{Tx, capsules, outbox, runs};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, views};

/// How events and the Run record name who started a Run.
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

/// A plan or destroy-plan submission of a Capsule: the Run (or the one an earlier
/// submission with the same Idempotency-Key created), its inputs and its wake-up — or, for
/// an agent the rules do not exempt, its hold — in one transaction (one statement when the
/// Run is all it writes).
pub(crate) async fn submit_plan(
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
    let subject = capsule.id.to_string();
    let earlier = || replay(&st, capsule.workspace_id, key.as_deref(), kind, &subject);
    if let Some(run) = earlier().await? {
        return Ok((StatusCode::ACCEPTED, views::run_json(&run)));
    }
    let id = RunId::new();
    let new = runs::NewRun {
        id,
        kind,
        workspace_id: capsule.workspace_id,
        capsule_id: capsule.id,
        run_group_id: None,
        plan_run_id: None,
        actor_kind: actor_kind(&caller),
        actor_id: caller.0.id.to_string(),
        auto_apply_requested: inputs.auto_apply_requested,
        idempotency_key: key.clone(),
        require_approval: false,
        traceparent: takosumi_telemetry::current_trace().map(|t| t.to_string()),
        vars: Some(inputs.seal_vars(&st, id, &vars)?),
    };
    let actor = caller.actor();
    let start = runs::Start {
        actor: &actor,
        event: json!({ "kind": kind, "autoApplyRequested": inputs.auto_apply_requested }),
        activity: json!({ "kind": kind, "capsuleId": capsule.id }),
        // An agent's plan is held for a person below instead of woken.
        wake: (!hold_agent).then_some(Topic::Plan),
    };
    let started = if hold_agent || inputs.has_sensitive_vars() {
        // The hold and the sealed values commit with the Run or not at all.
        let mut tx = st.pool.begin().await?;
        match runs::start(tx.db(), &new, start).await {
            Ok(run) => {
                // The sensitive values have a table of their own; a hold changes the row,
                // so only then does the answer read it again before the commit.
                inputs.store_sensitive(&st, &mut tx, run.id).await?;
                if hold_agent {
                    crate::gates::hold_agent_plan(&mut tx, run.id, &caller).await?;
                    Ok(commit_started(&st, tx, run.id).await?)
                } else {
                    tx.commit().await?;
                    st.relay_wake.notify_one();
                    Ok(run)
                }
            }
            Err(e) => Err(e),
        }
    } else {
        // A Run started alone is one statement that answers its row: no transaction
        // around it and no read after it, so the answer costs one round trip after the
        // connection's, not four (BEGIN, the start, the read, COMMIT).
        let mut conn = st.pool.acquire().await?;
        let started = runs::start(conn.db(), &new, start).await;
        if started.is_ok() {
            st.relay_wake.notify_one();
        }
        started
    };
    let run = match started {
        Ok(run) => run,
        Err(e) if e.is_unique_violation() && key.is_some() => earlier()
            .await?
            .ok_or_else(ApiError::idempotency_key_in_flight)?,
        Err(e) => return Err(e.into()),
    };
    Ok((StatusCode::ACCEPTED, views::run_json(&run)))
}

/// Creates the Apply Run pinned to `plan` (or returns the one an earlier submission with
/// the same Idempotency-Key created), with its gate wake-up: one statement, or one
/// transaction that fails it at once when its pool can never receive the plan.
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
    // The checks and the proposal share one connection: one acquire, and no statement of
    // the usual apply waits for another's connection.
    let mut conn = st.pool.acquire().await?;
    // An unresolved unknown_outcome apply locks the Capsule against applies until an
    // operator resolves it; say so now rather than queue an apply that will be refused.
    if let Some(blocking) =
        takosumi_store::runs::unknown::unresolved_unknown_apply(conn.db(), plan.capsule_id).await?
    {
        return Err(ApiError::conflict(
            ErrorCode::CapsuleNeedsInspection,
            takosumi_store::runs::unknown::needs_inspection_message(blocking),
        ));
    }
    if takosumi_store::runs::source::speculative(conn.db(), plan.id).await? {
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
    if let Some(existing) = runs::live_apply_of(conn.db(), plan.id).await? {
        return Err(ApiError::conflict(
            ErrorCode::ApplyExists,
            format!("{existing} already applies this plan"),
        ));
    }
    let actor = caller.actor();
    // A pool with no delivery key can never receive the saved plan: the apply fails at
    // once, with a code that says so, instead of being woken.
    let undeliverable = takosumi_store::pools::of_capsule(conn.db(), plan.capsule_id)
        .await?
        .is_some_and(|p| p.delivery_key_id.is_none());
    let proposal = runs::ApplyProposal {
        actor_kind: actor_kind(caller),
        actor_id: caller.0.id.to_string(),
        actor: &actor,
        auto_apply_requested: false,
        idempotency_key: key.clone(),
        traceparent: takosumi_telemetry::current_trace().map(|t| t.to_string()),
        require_approval,
        proposed_by: None,
        wake: (!undeliverable).then_some(Topic::Gate),
    };
    let proposed = if undeliverable {
        drop(conn);
        let mut tx = st.pool.begin().await?;
        match runs::propose_apply(tx.db(), plan, proposal).await {
            Ok(run) => {
                // The failure changes the row: the answer reads it again before the commit.
                // A key registered since the read above: woken after all.
                if !crate::relay::fail_if_pool_has_no_key(&mut tx, run.id, plan.capsule_id).await? {
                    outbox::enqueue(&mut tx, Topic::Gate, run.id).await?;
                }
                return commit_started(st, tx, run.id).await;
            }
            Err(e) => Err(e),
        }
    } else {
        // The usual apply is one statement that answers its row (as a plan's admission):
        // no transaction, no read after it.
        let proposed = runs::propose_apply(conn.db(), plan, proposal).await;
        drop(conn);
        if proposed.is_ok() {
            st.relay_wake.notify_one();
        }
        proposed
    };
    match proposed {
        Ok(run) => Ok(run),
        Err(e) if e.is_unique_violation() => {
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
            Err(ApiError::conflict(
                ErrorCode::ApplyExists,
                format!("another apply of {} was just submitted", plan.id),
            ))
        }
        Err(e) => Err(e.into()),
    }
}

/// What a new Run is, for [`start_run`].
pub(crate) struct RunStart<'a> {
    pub(crate) kind: RunKind,
    pub(crate) capsule: &'a capsules::Capsule,
    pub(crate) group: Option<RunGroupId>,
    pub(crate) actor_kind: ActorKind,
    pub(crate) actor_id: String,
    pub(crate) actor: String,
    pub(crate) auto_apply: bool,
    /// The agent whose Run this is, when it must be held before anything plans: planning
    /// runs provider code with the server's credentials, so a person looks first.
    pub(crate) hold_for: Option<&'a Caller>,
}

/// Inserts a queued Run with its `queued` event, its activity line and its wake-up — or,
/// for an agent's Run, holds it for a person instead of waking a step.
pub(crate) async fn start_run(tx: &mut Tx, s: &RunStart<'_>) -> Result<RunId, ApiError> {
    let new = runs::NewRun {
        id: RunId::new(),
        kind: s.kind,
        workspace_id: s.capsule.workspace_id,
        capsule_id: s.capsule.id,
        run_group_id: s.group,
        plan_run_id: None,
        actor_kind: s.actor_kind,
        actor_id: s.actor_id.clone(),
        auto_apply_requested: s.auto_apply,
        idempotency_key: None,
        require_approval: false,
        traceparent: takosumi_telemetry::current_trace().map(|t| t.to_string()),
        vars: None,
    };
    let topic = if s.kind == RunKind::DriftCheck {
        Topic::Drift
    } else {
        Topic::Plan
    };
    let start = runs::Start {
        actor: &s.actor,
        event: json!({ "kind": s.kind, "runGroupId": s.group, "autoApplyRequested": s.auto_apply }),
        activity: json!({ "kind": s.kind, "capsuleId": s.capsule.id }),
        wake: if s.hold_for.is_some() {
            None
        } else {
            Some(topic)
        },
    };
    let id = runs::start(tx.db(), &new, start).await?.id;
    if let Some(agent) = s.hold_for {
        crate::gates::hold_agent_plan(tx, id, agent).await?;
    }
    Ok(id)
}

/// The caller, when it is an agent the rules do not exempt for this Capsule: its Runs are
/// held before anything plans, as `submit_plan` holds an agent's plan.
pub(crate) async fn agent_to_hold<'a>(
    st: &AppState,
    caller: &'a Caller,
    capsule: &capsules::Capsule,
) -> Result<Option<&'a Caller>, ApiError> {
    if caller.0.role == Role::Agent
        && !crate::gates::agent_exempt(st, capsule, &caller.0.name).await?
    {
        Ok(Some(caller))
    } else {
        Ok(None)
    }
}

/// Ends a request that started a Run: reads the new Run in its own transaction, commits,
/// and wakes the outbox relay for the wake-up the transaction wrote.
pub(crate) async fn commit_started(
    st: &AppState,
    mut tx: Tx,
    id: RunId,
) -> Result<runs::Run, ApiError> {
    let run = runs::get(tx.db(), id)
        .await?
        .ok_or_else(|| ApiError::not_found("the new Run"))?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok(run)
}
