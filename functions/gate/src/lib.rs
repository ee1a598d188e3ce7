//! The gate step: decides from the saved plan — its `show -json`, never printed text —
//! whether what follows runs, waits for people, or stops. An Apply Run that no rule
//! covers is released to the apply queue; one a rule covers (`max_destroy`, a Rego
//! `plan_gate`, an approval rule), one whose submission asked for approval, and one an
//! AI agent proposed are held with the reason and the findings its approvers are shown.
//! The decision, the rule versions it used and the wake-up it causes commit together.

use serde_json::{Value, json};
use takosumi_core::{
    ActivityKind, ActorKind, Changes, EventKind, HoldReason, Outcome, RunKind, RunMessage,
    RunStatus, StepError, Topic,
};
use takosumi_policy::{Decision, GateInput};
use takosumi_runtime::Ctx;
use takosumi_store::StoreError;
use takosumi_store::{activity, events, runs, tokens};

mod one_step;

/// Handles one `run.gate` wake-up. Safe to run twice: the decision is recorded once.
pub async fn handle(ctx: &Ctx, msg: RunMessage) -> Result<Outcome, StepError> {
    let run_id = msg.run_id;
    let run = runs::get(&ctx.pool, run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("{run_id} does not exist")))?;
    // An apply submission a rule covers was planned first: the plan proposes its apply
    // (also after a person released it before planning, as an agent's is).
    if run.kind == RunKind::Plan
        && run.status == RunStatus::Planned
        && run.apply_mode == Some(takosumi_core::ApplyMode::ProposesApply)
    {
        return one_step::propose_apply(ctx, &run, &format!("handler:{}", ctx.owner)).await;
    }
    let expected = if run.kind == RunKind::Apply {
        RunStatus::Queued
    } else {
        RunStatus::Planned
    };
    if run.status != expected || run.gate_decision.is_some() {
        return Ok(Outcome::Skipped(
            "already decided, or not waiting for the gate",
        ));
    }
    let actor = format!("handler:{}", ctx.owner);
    if run.kind != RunKind::Apply {
        let recorded =
            json!({ "decision": "recorded", "reason": "a plan proposes; its Apply Run is gated" });
        // autoApplyRequested: the plan continues to an Apply Run, which this gate then
        // decides on like any other (deletions and rules stop it for review).
        let proposes = run.auto_apply_requested
            && run.kind == RunKind::Plan
            && run.plan_object_key.is_some()
            && !takosumi_store::runs::source::speculative(&ctx.pool, run_id).await?;
        if !proposes {
            if !runs::hold::release_at_gate(&ctx.pool, run_id, &actor, &recorded, None).await? {
                return Ok(Outcome::Skipped("decided by another handler"));
            }
            return Ok(Outcome::Done);
        }
        let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
        if !runs::hold::release_at_gate(tx.db(), run_id, &actor, &recorded, None).await? {
            return Ok(Outcome::Skipped("decided by another handler"));
        }
        let proposal = runs::ApplyProposal {
            actor_kind: ActorKind::System,
            actor_id: run.actor_id.clone(),
            actor: &actor,
            auto_apply_requested: true,
            idempotency_key: None,
            // The apply continues its plan's trace.
            traceparent: None,
            require_approval: false,
            proposed_by: None,
            wake: Some(Topic::Gate),
        };
        runs::propose_apply(tx.db(), &run, proposal).await?;
        tx.commit().await.map_err(StoreError::from)?;
        ctx.relay_wake.notify_one();
        return Ok(Outcome::Done);
    }

    let Some(plan_run_id) = run.plan_run_id else {
        // No plan: the API found no rule covering it; decide whether it runs in one step.
        return one_step::decide(ctx, &run, &actor).await;
    };
    let (rules, versions) = one_step::effective_rules(ctx, &run).await?;
    let require_approval = runs::hold::gate_fields(&ctx.pool, run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("{run_id} vanished")))?
        .require_approval;
    let mut agent = run.actor_kind == ActorKind::Agent;
    let mut exemption = None;
    if agent && !rules.agent_exemptions.is_empty() {
        let name = tokens::token_name(&ctx.pool, &run.actor_id).await?;
        if let Some(name) = name.filter(|n| rules.agent_exemptions.contains(n)) {
            agent = false;
            exemption = Some(name);
        }
    }
    let plan_json = if rules.plan_gate.is_some() {
        Some(takosumi_runtime::plan_commit::read_plan_json(ctx, plan_run_id).await?)
    } else {
        None
    };
    let changes: Changes = run.changes().unwrap_or_default();
    // The cost estimate (only for a cost check) and the plan's dry-run scan: both go into
    // the decision's record and what the approver is shown.
    let cost = if rules.max_monthly_increase.is_some() || rules.plan_gate.is_some() {
        one_step::cost_estimate(ctx, plan_run_id).await?
    } else {
        None
    };
    let scan = runs::plan_record::scan_report(&ctx.pool, plan_run_id).await?;
    let input = GateInput {
        changes,
        plan_json: plan_json.as_ref(),
        run: json!({
            "id": run.id, "planRunId": plan_run_id, "capsuleId": run.capsule_id, "workspaceId": run.workspace_id,
            "actor": { "kind": run.actor_kind, "id": run.actor_id }, "planDigest": run.plan_digest,
        }),
        require_approval,
        agent,
        auto_apply: run.auto_apply_requested,
        cost: cost.as_ref(),
    };
    let cost_record = match (rules.max_monthly_increase, &cost) {
        (Some(limit), Some(est)) => Some(takosumi_policy::cost_finding(limit, est)),
        _ => None,
    };
    let decision = match takosumi_policy::decide(&rules, &input) {
        Ok(Decision::Hold {
            reason,
            mut details,
            approvals_required,
            approver_roles,
        }) => {
            if let (Value::Object(m), Some(scan)) = (&mut details, &scan) {
                m.insert("dryRunScan".into(), scan.clone());
            }
            Decision::Hold {
                reason,
                details,
                approvals_required,
                approver_roles,
            }
        }
        Ok(d) => d,
        Err(e) => {
            // A policy that fails at runtime holds the apply rather than letting it through.
            Decision::Hold {
                reason: HoldReason::PlanGate,
                details: json!({ "planGate": { "error": e.to_string() } }),
                approvals_required: 1,
                approver_roles: takosumi_policy::default_approver_roles(),
            }
        }
    };

    match &decision {
        Decision::Release { checked } => {
            let released = json!({ "decision": "released", "rules": checked, "ruleVersions": versions, "agentExemption": exemption, "planDigest": run.plan_digest, "cost": cost_record });
            if !runs::hold::release_at_gate(
                &ctx.pool,
                run_id,
                &actor,
                &released,
                Some(Topic::Apply),
            )
            .await?
            {
                return Ok(Outcome::Skipped("decided by another handler"));
            }
        }
        Decision::Hold {
            reason,
            details,
            approvals_required,
            approver_roles,
        } => {
            let required = i32::try_from(*approvals_required).unwrap_or(1);
            let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
            if !runs::hold::hold(&mut tx, run_id, *reason, details, required, approver_roles)
                .await?
            {
                return Ok(Outcome::Skipped("decided by another handler"));
            }
            events::append(
                tx.db(),
                run_id,
                EventKind::GateDecision,
                &actor,
                json!({ "decision": "held", "reason": reason, "details": details, "ruleVersions": versions, "approvalsRequired": required, "planDigest": run.plan_digest, "cost": cost_record }),
            )
            .await?;
            activity::append(
                tx.db(),
                run.workspace_id,
                ActivityKind::RunHeld,
                &run_id.to_string(),
                &actor,
                json!({ "reason": reason }),
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
        }
    }
    ctx.relay_wake.notify_one();
    Ok(Outcome::Done)
}
