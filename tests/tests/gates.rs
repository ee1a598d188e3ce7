//! End-to-end: gates and approvals on the saved plan (real terraform 1.0.3 and the offline
//! null provider). Rules hold applies, approvals bind the plan digest, requesters cannot
//! approve themselves, and agent runs need a person twice.

use serde_json::json;
use takosumi_client::Capsule;
use takosumi_core::{RunId, RunStatus};
use takosumi_tests::{GitRepo, Stack};

async fn null_capsule(stack: &Stack, repo: &GitRepo) -> anyhow::Result<Capsule> {
    stack
        .new_capsule(repo, "nulls", "infra/null", serde_json::json!({}))
        .await
}

fn bump_revision(repo: &GitRepo, to: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../infra/examples/null/main.tf"
    ))?;
    repo.commit(
        &[(
            "infra/null/main.tf",
            &text.replacen("default = \"1\"", &format!("default = \"{to}\""), 1),
        )],
        "bump",
    )?;
    Ok(())
}

/// `max_destroy`: a plan that replaces 2 resources is held over a limit of 1 (replacements
/// count as deletions, read from the saved plan) and released under a limit of 2; a held
/// apply runs once a person approves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_destroy_holds_over_the_limit_and_releases_under_it() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = &stack;
    let repo = GitRepo::with_example("null")?;
    let capsule = null_capsule(&stack, &repo).await?;
    let first = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(
        stack
            .wait(stack.client.apply(first.id, None).await?.id)
            .await?
            .status,
        RunStatus::Applied
    );

    let (s, body) = api
        .call_as(
            "PUT",
            &format!("/api/v1/capsules/{}/rules", capsule.id),
            &stack.admin_token,
            json!({ "maxDestroy": 1 }),
        )
        .await?;
    assert_eq!(s, 200, "{body}");
    bump_revision(&repo, "2")?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.changes.unwrap().destroy, 2);
    let held = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let hold = held.hold.clone().expect("hold");
    assert_eq!(hold.reason, "max_destroy");
    assert_eq!(
        hold.details["maxDestroy"],
        json!({ "limit": 1, "destroy": 2 })
    );
    assert_eq!(stack.tool_count("apply"), 1, "a held apply must not run");

    let (_, approver) = api.token("alice", "approver").await?;
    let _ = approver;
    let (atoken, _) = api.token("bob", "approver").await?;
    let (s, body) = api
        .approve_as(held.id, &atoken, json!({ "planDigest": plan.plan_digest }))
        .await?;
    assert_eq!(s, 200, "{body}");
    let applied = stack.wait_released(held.id).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    let events = stack.client.events(held.id).await?;
    assert!(events.iter().any(|e| e.kind == "approved"));

    // Under the limit: released straight away.
    api.call_as(
        "PUT",
        &format!("/api/v1/capsules/{}/rules", capsule.id),
        &stack.admin_token,
        json!({ "maxDestroy": 2 }),
    )
    .await?;
    bump_revision(&repo, "3")?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    stack.stop().await
}

const NO_DELETES: &str = r#"package takosumi
deny contains msg if {
    some rc in input.resource_changes
    "delete" in rc.change.actions
    msg := sprintf("%s would be deleted", [rc.address])
}
"#;

/// A Rego `plan_gate` evaluated on the saved plan: its deny messages hold the apply and
/// are shown to the approver; a plan it allows is released. A policy that does not
/// compile is refused when it is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rego_plan_gate_denies_and_allows() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = &stack;
    let repo = GitRepo::with_example("null")?;
    let capsule = null_capsule(&stack, &repo).await?;
    let ws_rules = format!("/api/v1/workspaces/{}/rules", capsule.workspace_id);
    let (s, body) = api
        .call_as(
            "PUT",
            &ws_rules,
            &stack.admin_token,
            json!({ "planGate": "package takosumi\ndeny contains msg if {" }),
        )
        .await?;
    assert_eq!(
        (s, body["code"].as_str()),
        (422, Some("invalid_policy")),
        "{body}"
    );
    let (s, body) = api
        .call_as(
            "PUT",
            &ws_rules,
            &stack.admin_token,
            json!({ "planGate": NO_DELETES }),
        )
        .await?;
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        body["version"],
        json!(1),
        "a refused policy must not create a version: {body}"
    );

    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(
        apply.status,
        RunStatus::Applied,
        "creates only: allowed: {apply:?}"
    );

    bump_revision(&repo, "2")?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let held = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held);
    let hold = held.hold.expect("hold");
    assert_eq!(hold.reason, "plan_gate");
    let deny: Vec<String> = serde_json::from_value(hold.details["planGate"]["deny"].clone())?;
    assert_eq!(
        deny,
        vec![
            "null_resource.node[0] would be deleted".to_owned(),
            "null_resource.node[1] would be deleted".to_owned()
        ]
    );
    let events = stack.client.events(held.id).await?;
    let decision = events
        .iter()
        .find(|e| e.kind == "gate_decision")
        .expect("decision");
    assert_eq!(decision.data["ruleVersions"]["workspace"], json!(1));
    stack.stop().await
}

/// N-of-M approvals: the requester cannot approve their own apply, a viewer's approval
/// does not count, an approval naming another plan's digest is refused, and the apply is
/// released only at the second distinct approver.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_of_m_approvals_bound_to_the_plan_digest() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = &stack;
    let repo = GitRepo::with_example("null")?;
    let capsule = null_capsule(&stack, &repo).await?;
    api.call_as(
        "PUT",
        &format!("/api/v1/capsules/{}/rules", capsule.id),
        &stack.admin_token,
        json!({ "approval": { "required": 2 } }),
    )
    .await?;
    let (op_token, op) = api.token("requester", "operator").await?;
    let (a1, _) = api.token("approver1", "approver").await?;
    let (a2, _) = api.token("approver2", "approver").await?;
    let (viewer, _) = api.token("viewer", "viewer").await?;

    let other = stack.wait(op.plan(capsule.id, None).await?.id).await?;
    // Another configuration: two plans of one configuration made within the same second
    // are the same bytes (the plan file's zip times have a resolution of one second), so
    // the same digest.
    bump_revision(&repo, "2")?;
    let plan = stack.wait(op.plan(capsule.id, None).await?.id).await?;
    assert_ne!(other.plan_digest, plan.plan_digest);
    let held = stack.wait(op.apply(plan.id, None).await?.id).await?;
    assert_eq!(held.status, RunStatus::Held);
    assert_eq!(held.hold.as_ref().unwrap().reason, "approval_rule");

    let (s, b) = api.approve_as(held.id, &op_token, json!({})).await?;
    assert_eq!((s, b["code"].as_str()), (403, Some("self_approval")), "{b}");
    let (s, b) = api.approve_as(held.id, &viewer, json!({})).await?;
    assert_eq!(s, 403, "{b}");
    let (s, b) = api
        .approve_as(held.id, &a1, json!({ "planDigest": other.plan_digest }))
        .await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (409, Some("plan_digest_mismatch")),
        "{b}"
    );
    let (s, b) = api
        .approve_as(held.id, &a1, json!({ "planDigest": plan.plan_digest }))
        .await?;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["status"], json!("held"));
    assert_eq!(b["approvals"], json!({ "given": 1, "required": 2 }));
    let (s, b) = api.approve_as(held.id, &a1, json!({})).await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (409, Some("already_approved")),
        "{b}"
    );
    assert_eq!(stack.client.get_run(held.id).await?.status, RunStatus::Held);
    let (s, b) = api.approve_as(held.id, &a2, json!({})).await?;
    assert_eq!(s, 200, "{b}");
    let done = stack.wait_released(held.id).await?;
    assert_eq!(done.status, RunStatus::Applied, "{done:?}");

    // A plan made from the old generation, approved after the state moved on, fails
    // without running the tool and says to plan again.
    let stale = stack.wait(op.apply(other.id, None).await?.id).await?;
    assert_eq!(stale.status, RunStatus::Held);
    api.approve_as(stale.id, &a1, json!({})).await?;
    api.approve_as(stale.id, &a2, json!({})).await?;
    let failed = stack.wait_released(stale.id).await?;
    assert_eq!(failed.status, RunStatus::Failed);
    assert_eq!(failed.error.unwrap().code, "state_generation_changed");
    assert_eq!(stack.tool_count("apply"), 1);
    stack.stop().await
}

/// `requireApproval` on the submission holds an apply no rule covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn require_approval_holds_an_uncovered_apply() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = &stack;
    let repo = GitRepo::with_example("null")?;
    let capsule = null_capsule(&stack, &repo).await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let (s, b) = api
        .call_as(
            "POST",
            &format!("/api/v1/runs/{}/apply", plan.id),
            &stack.admin_token,
            json!({ "requireApproval": true }),
        )
        .await?;
    assert_eq!(s, 202, "{b}");
    let id: RunId = b["id"].as_str().unwrap().parse()?;
    let held = stack.wait(id).await?;
    assert_eq!(held.status, RunStatus::Held);
    assert_eq!(held.hold.unwrap().reason, "require_approval");
    let (a, _) = api.token("approver", "approver").await?;
    api.approve_as(id, &a, json!({})).await?;
    assert_eq!(stack.wait_released(id).await?.status, RunStatus::Applied);
    stack.stop().await
}

/// An agent's run is held before anything plans, and the apply it proposes is held again:
/// two approvals. An exemption lets a named agent take the ordinary path.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_runs_need_two_approvals_unless_exempt() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = &stack;
    let repo = GitRepo::with_example("null")?;
    let capsule = null_capsule(&stack, &repo).await?;
    let (_, agent) = api.token("copilot", "agent").await?;
    let (approver, _) = api.token("human", "approver").await?;

    let plan = agent.plan(capsule.id, None).await?;
    let held = stack.wait(plan.id).await?;
    assert_eq!(held.status, RunStatus::Held);
    assert_eq!(held.hold.as_ref().unwrap().reason, "agent_run");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        stack.tool_count("plan"),
        0,
        "an agent's plan ran before a person released it"
    );
    assert_eq!(api.approve_as(plan.id, &approver, json!({})).await?.0, 200);
    let planned = stack.wait_released(plan.id).await?;
    assert_eq!(planned.status, RunStatus::Planned, "{planned:?}");

    let apply = stack.wait(agent.apply(plan.id, None).await?.id).await?;
    assert_eq!(apply.status, RunStatus::Held);
    assert_eq!(apply.hold.as_ref().unwrap().reason, "agent_run");
    assert_eq!(stack.tool_count("apply"), 0);
    assert_eq!(
        api.approve_as(
            apply.id,
            &approver,
            json!({ "planDigest": planned.plan_digest })
        )
        .await?
        .0,
        200
    );
    assert_eq!(
        stack.wait_released(apply.id).await?.status,
        RunStatus::Applied
    );

    // Exempt by name: the ordinary path, recorded.
    api.call_as(
        "PUT",
        &format!("/api/v1/workspaces/{}/rules", capsule.workspace_id),
        &stack.admin_token,
        json!({ "agentExemptions": ["copilot"] }),
    )
    .await?;
    bump_revision(&repo, "2")?;
    let plan = stack.wait(agent.plan(capsule.id, None).await?.id).await?;
    assert_eq!(plan.status, RunStatus::Planned);
    let apply = stack.wait(agent.apply(plan.id, None).await?.id).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    let events = stack.client.events(apply.id).await?;
    let decision = events
        .iter()
        .find(|e| e.kind == "gate_decision")
        .expect("decision");
    assert_eq!(decision.data["agentExemption"], json!("copilot"));
    stack.stop().await
}
