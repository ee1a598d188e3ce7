//! The gate's decision on a one-step Apply Run (one with no plan: the API found no rule
//! covering it). The rules are read again here, at the decision, with their versions: if
//! none covers the apply it is released to run `apply -auto-approve`, recorded as a one-step
//! release; if a rule now covers it (set after the submission), it fails without running
//! anything and says to submit it again, when it is planned first. It is never held: a
//! hold needs a saved plan for its approval to bind.

use serde_json::json;
use takosumi_core::{ActorKind, EventKind, FailureCode, HoldReason, Outcome, StepError, Topic};
use takosumi_policy::RuleSet;
use takosumi_runtime::Ctx;
use takosumi_store::StoreError;
use takosumi_store::{events, rules, runs, tokens};

/// The Capsule's rules over its Workspace's, and the versions they came from.
pub(crate) async fn effective_rules(
    ctx: &Ctx,
    run: &runs::Run,
) -> Result<(RuleSet, rules::RuleVersions), StepError> {
    let in_force = rules::rules_in_force(&ctx.pool, run.workspace_id, run.capsule_id).await?;
    let rules = RuleSet::layered(
        in_force.capsule.as_ref().map(|r| &r.rules),
        in_force.workspace.as_ref().map(|r| &r.rules),
    )
    .map_err(StepError::internal)?;
    Ok((rules, in_force.versions()))
}

pub(crate) async fn decide(ctx: &Ctx, run: &runs::Run, actor: &str) -> Result<Outcome, StepError> {
    let run_id = run.id;
    let (rules, versions) = effective_rules(ctx, run).await?;
    let require_approval = runs::hold::gate_fields(&ctx.pool, run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("{run_id} vanished")))?
        .require_approval;
    let mut agent = run.actor_kind == ActorKind::Agent;
    if agent {
        let name = tokens::token_name(&ctx.pool, &run.actor_id).await?;
        agent = !name.is_some_and(|n| rules.agent_exemptions.contains(&n));
    }
    let mut covered_by: Vec<HoldReason> = rules.covering_rules();
    if require_approval {
        covered_by.push(HoldReason::RequireApproval);
    }
    if agent {
        covered_by.push(HoldReason::AgentRun);
    }
    if covered_by.is_empty() {
        let released = json!({ "decision": "released", "oneStep": true, "rules": [], "ruleVersions": versions,
                "reason": "no rule covers this apply: it runs apply -auto-approve, with nothing saved in between" });
        if !runs::hold::release_at_gate(&ctx.pool, run_id, actor, &released, Some(Topic::Apply))
            .await?
        {
            return Ok(Outcome::Skipped("decided by another handler"));
        }
    } else {
        let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
        let message = format!(
            "a rule now covers applies of this Capsule ({}), so it cannot run in one step; nothing was applied. Submit the apply again: it is planned first and the rules decide on the saved plan",
            covered_by
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        if !runs::fail(&mut tx, run_id, None, FailureCode::StalePlan, &message).await? {
            return Ok(Outcome::Skipped("decided by another handler"));
        }
        events::append(
            tx.db(),
            run_id,
            EventKind::GateDecision,
            actor,
            json!({ "decision": "refused", "oneStep": true, "coveredBy": covered_by, "ruleVersions": versions }),
        )
        .await?;
        tx.commit().await.map_err(StoreError::from)?;
    }
    ctx.relay_wake.notify_one();
    Ok(Outcome::Done)
}

/// A plan an apply submission started (a rule covered the apply, so it was planned first
/// with `-out`): once planned, it proposes its Apply Run, pinned to the saved plan, by the
/// same actor (so an agent's proposal is held again and a requester cannot approve their
/// own), carrying the submission's `requireApproval`; the gate then decides on that Apply
/// Run like on any other. Happens once: the plan's mode moves to `proposed_apply` in the
/// same transaction.
pub(crate) async fn propose_apply(
    ctx: &Ctx,
    run: &runs::Run,
    actor: &str,
) -> Result<Outcome, StepError> {
    let run_id = run.id;
    let require_approval = runs::hold::gate_fields(&ctx.pool, run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("{run_id} vanished")))?
        .require_approval;
    let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
    if !runs::apply_mode::mark_proposed(&mut tx, run_id).await? {
        return Ok(Outcome::Skipped("the apply was already proposed"));
    }
    let recorded = json!({ "decision": "recorded", "reason": "an apply submission a rule covers was planned first; its Apply Run carries out this saved plan and is gated" });
    // A plan a person released before it planned has its decision already: only the event.
    if run.gate_decision.is_some()
        || !runs::hold::release_at_gate(tx.db(), run_id, actor, &recorded, None).await?
    {
        events::append(tx.db(), run_id, EventKind::GateDecision, actor, recorded).await?;
    }
    if run.plan_object_key.is_some() {
        let proposal = runs::ApplyProposal {
            actor_kind: run.actor_kind,
            actor_id: run.actor_id.clone(),
            actor,
            auto_apply_requested: false,
            idempotency_key: None,
            // The apply continues its plan's trace.
            traceparent: None,
            require_approval,
            proposed_by: Some("apply_submission"),
            wake: Some(Topic::Gate),
        };
        runs::propose_apply(tx.db(), run, proposal).await?;
    }
    tx.commit().await.map_err(StoreError::from)?;
    ctx.relay_wake.notify_one();
    Ok(Outcome::Done)
}

/// The cost estimate of a plan, from the resource summary the plan step kept (never the
/// sealed plan) and the process's price catalogue. `None`: the plan kept no summary.
pub(crate) async fn cost_estimate(
    ctx: &Ctx,
    plan_run_id: takosumi_core::RunId,
) -> Result<Option<takosumi_cost::CostEstimate>, StepError> {
    let Some(summary) =
        takosumi_store::runs::plan_record::resource_changes(&ctx.pool, plan_run_id).await?
    else {
        return Ok(None);
    };
    let resources: takosumi_cost::PlanResources =
        serde_json::from_value(summary).map_err(StepError::internal)?;
    Ok(Some(takosumi_cost::estimate(&ctx.pricing, &resources)))
}
