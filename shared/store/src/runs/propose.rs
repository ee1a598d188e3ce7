//! Proposing an apply of a planned Run: the one way an Apply Run is created, whoever
//! proposes it (a person's `POST /runs/{id}/apply`, the gate continuing an
//! `autoApplyRequested` plan, the gate turning a covered apply submission's plan into its
//! apply). Whether the plan may be applied at all is the caller's question, asked before.

use serde_json::{Map, Value, json};
use takosumi_core::{ActorKind, RunId, RunKind, Topic};

use super::{NewRun, Run, Start};
use crate::StoreError;

/// Who proposes an apply, and how it starts.
#[derive(Debug)]
pub struct ApplyProposal<'a> {
    /// The proposer's kind (`System` for the gate's own auto-apply).
    pub actor_kind: ActorKind,
    /// The proposer's id (for a step's proposal, the plan's actor).
    pub actor_id: String,
    /// Who proposed it, as events and activity name an actor.
    pub actor: &'a str,
    /// The plan asked to continue to an apply when clean.
    pub auto_apply_requested: bool,
    /// The submission's `Idempotency-Key`.
    pub idempotency_key: Option<String>,
    /// The request's `traceparent`; `None` continues the plan's trace.
    pub traceparent: Option<String>,
    /// The submission asked for a person's approval whatever the rules say.
    pub require_approval: bool,
    /// What proposed it, when not a person's request (`apply_submission`).
    pub proposed_by: Option<&'a str>,
    /// The wake-up (the gate); `None` when the caller wakes or fails it itself.
    pub wake: Option<Topic>,
}

/// Starts an Apply Run that carries out `plan`'s saved plan, through [`super::start`]
/// (row with the plan's pins and the approval the proposal requires, `queued` event,
/// activity, wake-up): one statement, in the caller's transaction when it passes one.
/// Answers the new Run as written. A second live apply of the same plan (or a reused
/// Idempotency-Key) is a unique violation the caller answers.
pub async fn propose_apply<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    plan: &Run,
    p: ApplyProposal<'_>,
) -> Result<Run, StoreError> {
    let new = NewRun {
        id: RunId::new(),
        kind: RunKind::Apply,
        workspace_id: plan.workspace_id,
        capsule_id: plan.capsule_id,
        run_group_id: plan.run_group_id,
        plan_run_id: Some(plan.id),
        actor_kind: p.actor_kind,
        actor_id: p.actor_id,
        auto_apply_requested: p.auto_apply_requested,
        idempotency_key: p.idempotency_key,
        require_approval: p.require_approval,
        traceparent: p.traceparent,
        vars: None,
    };
    let mut event = Map::new();
    event.insert("kind".into(), json!(RunKind::Apply));
    event.insert("planRunId".into(), json!(plan.id));
    event.insert("planDigest".into(), json!(plan.plan_digest));
    let mut activity = Map::new();
    activity.insert("kind".into(), json!(RunKind::Apply));
    activity.insert("planRunId".into(), json!(plan.id));
    if p.auto_apply_requested {
        event.insert("autoApplyRequested".into(), json!(true));
        activity.insert("autoApply".into(), json!(true));
    }
    if let Some(by) = p.proposed_by {
        event.insert("proposedBy".into(), json!(by));
    }
    let start = Start {
        actor: p.actor,
        event: Value::Object(event),
        activity: Value::Object(activity),
        wake: p.wake,
    };
    super::start(executor, &new, start).await
}
