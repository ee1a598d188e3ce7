//! End-to-end: the walking skeleton's promises, through the real API, RabbitMQ, Postgres,
//! the S3 server and terraform 1.0.3 (the tests use `terraform`; OpenTofu cannot be
//! installed on these machines).

use std::time::Duration;

use serde_json::{Value, json};
use takosumi_client::Capsule;
use takosumi_core::{RunMessage, RunStatus, Topic};
use takosumi_tests::{GitRepo, Options, Stack, Steps};

async fn register(
    stack: &Stack,
    repo: &GitRepo,
    dir: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    stack.new_capsule(repo, "capsule", dir, vars).await
}

async fn state_version_count(stack: &Stack, capsule: &Capsule) -> i64 {
    takosumi_store::states::versions::count_for_capsule(&stack.ctx.pool, capsule.id)
        .await
        .unwrap()
}

/// The seed's example: plan → apply publishes `vpc = "vpc-eu"` and moves the Capsule from
/// generation 0 to 1, with every pin recorded on both Runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_example_plans_and_applies() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    assert_eq!(capsule.state_generation, 0);

    let plan = stack.client.plan(capsule.id, None).await?;
    assert_eq!(plan.status, RunStatus::Queued);
    let plan = stack.wait(plan.id).await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    assert_eq!(plan.state_generation, Some(0));
    assert_eq!(
        plan.provider_lock_digest,
        Some(None),
        "provider-free plan records an explicit null"
    );
    let digest = plan.plan_digest.clone().expect("plan digest");
    assert_eq!(digest.len(), 64);
    let snapshot = plan.source_snapshot.clone().expect("source snapshot");
    assert_eq!(snapshot.commit.len(), 40);
    assert_eq!(
        plan.tool_version
            .as_ref()
            .and_then(|v| v["terraform_version"].as_str()),
        Some("1.0.3")
    );
    assert_eq!(plan.injected_env_names, vec!["TF_VAR_region".to_owned()]);

    let apply = stack.client.apply(plan.id, None).await?;
    assert_eq!(apply.plan_run_id, Some(plan.id));
    assert_eq!(apply.plan_digest.as_deref(), Some(digest.as_str()));
    let apply = stack.wait(apply.id).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(apply.outputs, Some(json!({ "vpc": "vpc-eu" })));
    assert_eq!(apply.state_generation, Some(1));
    assert!(apply.state_version_id.is_some());

    let capsule = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(capsule.state_generation, 1);
    assert_eq!(capsule.current_state_version_id, apply.state_version_id);
    assert_eq!(stack.tool_count("apply"), 1);
    // The outputs above come from the state the apply wrote: no tool start to print them.
    assert_eq!(stack.tool_count("output"), 0);

    // The apply learnt the plan's sensitive values from its sealed JSON: no second `show`.
    assert_eq!(stack.tool_count("show"), 1);
    // Each Run's progress in one order, whatever ran beside what (events written beside the
    // work they report, the scan's report and its event as one statement).
    let steps_of = |events: Vec<takosumi_client::RunEvent>| -> Vec<String> {
        events
            .into_iter()
            .map(
                |e| match (e.data["pin"].as_str(), e.data["command"].as_str()) {
                    (Some(pin), _) => format!("{}:{pin}", e.kind),
                    (None, Some(command)) => format!("{}:{command}", e.kind),
                    _ => e.kind.to_string(),
                },
            )
            .collect()
    };
    let steps = steps_of(stack.client.events(plan.id).await?);
    assert_eq!(
        steps,
        [
            "queued",
            "claimed",
            "checkout_started",
            "environment_prepared",
            "checked_out",
            "dry_run_scan",
            "tool_started:init",
            "tool_started:plan",
            "planned",
            "gate_decision"
        ],
        "{steps:?}"
    );
    // Every pin of the apply: the plan file (placed beside the checkout, with the state and
    // the environment), the source, the modules.
    let steps = steps_of(stack.client.events(apply.id).await?);
    assert_eq!(
        steps,
        [
            "queued",
            "gate_decision",
            "claimed",
            "pin_checked:planDigest",
            "environment_prepared",
            "pin_checked:sourceSnapshot",
            "pin_checked:dependencySnapshot",
            "tool_started:init",
            "tool_started:apply",
            "state_version_written",
            "applied"
        ],
        "{steps:?}"
    );

    // The sealed plan and its sealed JSON are wiped once its apply ends, and no object key
    // is in any projection.
    let objects = stack
        .ctx
        .objects
        .list(&format!("runs/{}/", plan.id))
        .await?;
    assert!(
        objects
            .iter()
            .all(|k| !k.contains("plan.") && !k.contains("show.")),
        "plan file or plan JSON not wiped: {objects:?}"
    );
    let raw = reqwest::Client::new()
        .get(format!("{}/api/v1/runs/{}", stack.api_url, plan.id))
        .bearer_auth(&stack.admin_token)
        .send()
        .await?
        .text()
        .await?;
    assert!(
        !raw.contains("runs/") && !raw.contains(".sealed"),
        "object key leaked: {raw}"
    );
    stack.stop().await
}

/// The null-provider example: 2 to add, applied; after a change, the replacements are
/// counted from `show -json` (each replacement is one add and one destroy).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn null_example_counts_adds_and_replacements() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({ "instances": 2 })).await?;

    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let changes = plan.changes.expect("changes");
    assert_eq!((changes.add, changes.change, changes.destroy), (2, 0, 0));
    let lock = plan
        .provider_lock_digest
        .clone()
        .flatten()
        .expect("a provider plan records its lockfile digest");
    assert_eq!(
        lock,
        "4b0f595b002219cd61c1d2e566fecb352d32c3ad06d56327f401b4955feea637"
    );
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");

    // A new revision replaces both instances.
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../infra/examples/null/main.tf"
    ))?;
    let changed = text.replacen("default = \"1\"", "default = \"2\"", 1);
    assert_ne!(
        changed, text,
        "the null example must have a revision variable defaulting to \"1\""
    );
    repo.commit(&[("infra/null/main.tf", &changed)], "bump revision")?;
    let replan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(replan.status, RunStatus::Planned, "{replan:?}");
    assert_eq!(replan.state_generation, Some(1));
    let changes = replan.changes.expect("changes");
    assert_eq!((changes.add, changes.change, changes.destroy), (2, 0, 2));
    assert_ne!(
        replan.source_snapshot.unwrap().commit,
        plan.source_snapshot.unwrap().commit
    );
    stack.stop().await
}

/// Two plans from generation g; the first is applied; applying the second fails
/// `state_generation_changed` before the tool is ever started.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn second_plan_of_the_same_generation_is_refused_without_running_the_tool()
-> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let first = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let second = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(
        (first.state_generation, second.state_generation),
        (Some(0), Some(0))
    );

    let applied = stack
        .wait(stack.client.apply(first.id, None).await?.id)
        .await?;
    assert_eq!(applied.status, RunStatus::Applied);
    let applies_before = stack.tool_count("apply");
    let inits_before = stack.tool_count("init");

    let refused = stack
        .wait(stack.client.apply(second.id, None).await?.id)
        .await?;
    assert_eq!(refused.status, RunStatus::Failed);
    let error = refused.error.expect("error");
    assert_eq!(error.code, "state_generation_changed");
    assert!(
        error
            .message
            .contains("submit the apply again, and it is planned afresh"),
        "{}",
        error.message
    );
    // The tool never started: no invocation, and no tool_started event on the Run.
    assert_eq!(stack.tool_count("apply"), applies_before);
    assert_eq!(stack.tool_count("init"), inits_before);
    let events = stack.client.events(refused.id).await?;
    assert!(
        events.iter().all(|e| e.kind != "tool_started"),
        "{events:?}"
    );
    let failed = events
        .iter()
        .find(|e| e.kind == "failed")
        .expect("failed event");
    assert_eq!(failed.data["toolStarted"], json!(false));
    assert_eq!(
        stack.client.get_capsule(capsule.id).await?.state_generation,
        1
    );
    stack.stop().await
}

/// A sealed plan altered in the object store fails the apply `plan_digest_mismatch`;
/// the tool never applies and the state is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn altered_sealed_plan_is_refused() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let row = takosumi_store::runs::get(&stack.ctx.pool, plan.id)
        .await?
        .expect("row");
    let key = row.plan_object_key.expect("sealed plan key");
    let mut sealed = stack.ctx.objects.get(&key, 64 << 20).await?;
    let last = sealed.len() - 1;
    sealed[last] ^= 0x01;
    stack.ctx.objects.put(&key, sealed).await?;

    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Failed);
    assert_eq!(apply.error.expect("error").code, "plan_digest_mismatch");
    assert_eq!(stack.tool_count("apply"), 0);
    let capsule = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(capsule.state_generation, 0);
    assert_eq!(capsule.current_state_version_id, None);
    assert_eq!(state_version_count(&stack, &capsule).await, 0);
    stack.stop().await
}

/// Every plan, gate and apply message delivered more than once (published again by hand
/// while the first is in flight, and again after the Run ended) gives one plan file, one
/// StateVersion, one tool apply, and the same final records.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_messages_change_nothing() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let broker = stack.ctx.bus.get().await?;
    let publish = |topic: Topic, msg: RunMessage| {
        let broker = broker.clone();
        async move {
            let body = serde_json::to_vec(&msg.to_json()).unwrap();
            broker
                .publish(topic.queue_name(), &body, None, Default::default())
                .await
        }
    };
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;

    let plan = stack.client.plan(capsule.id, None).await?;
    let msg = RunMessage { run_id: plan.id };
    publish(Topic::Plan, msg).await?;
    publish(Topic::Plan, msg).await?;
    let plan = stack.wait(plan.id).await?;
    assert_eq!(plan.status, RunStatus::Planned);
    publish(Topic::Plan, msg).await?;
    publish(Topic::Gate, msg).await?;

    let apply = stack.client.apply(plan.id, None).await?;
    let amsg = RunMessage { run_id: apply.id };
    publish(Topic::Gate, amsg).await?;
    publish(Topic::Apply, amsg).await?;
    publish(Topic::Apply, amsg).await?;
    let apply = stack.wait(apply.id).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    publish(Topic::Apply, amsg).await?;
    publish(Topic::Gate, amsg).await?;
    publish(Topic::Plan, msg).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    assert_eq!(
        stack.tool_count("plan"),
        1,
        "{:?}",
        stack.tool_invocations()
    );
    assert_eq!(
        stack.tool_count("apply"),
        1,
        "{:?}",
        stack.tool_invocations()
    );
    assert_eq!(state_version_count(&stack, &capsule).await, 1);
    assert_eq!(
        stack.client.get_capsule(capsule.id).await?.state_generation,
        1
    );
    let plan_after = stack.client.get_run(plan.id).await?;
    let apply_after = stack.client.get_run(apply.id).await?;
    assert_eq!(plan_after.plan_digest, plan.plan_digest);
    assert_eq!(plan_after.status, RunStatus::Planned);
    assert_eq!(apply_after.status, RunStatus::Applied);
    assert_eq!(apply_after.state_version_id, apply.state_version_id);
    assert_eq!(
        apply_after.updated_at, apply.updated_at,
        "a duplicate rewrote the finished apply"
    );
    let gate_decisions = stack
        .client
        .events(apply.id)
        .await?
        .iter()
        .filter(|e| e.kind == "gate_decision")
        .count();
    assert_eq!(gate_decisions, 1);
    stack.stop().await
}

/// Handlers called directly, twice at once, for the same Run: exactly one claims it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_handlers_claim_once() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let plan = stack.client.plan(capsule.id, None).await?;
    let msg = RunMessage { run_id: plan.id };
    let (a, b) = tokio::join!(
        takosumi_plan::handle(&stack.ctx, msg),
        takosumi_plan::handle(&stack.ctx, msg)
    );
    let outcomes = [a?, b?];
    let done = outcomes
        .iter()
        .filter(|o| **o == takosumi_core::Outcome::Done)
        .count();
    assert_eq!(done, 1, "{outcomes:?}");
    // The other found the Run taken: before its reads, or (its checkout already on its way
    // beside the claim) at the claim. Either way it wrote nothing and left nothing behind.
    assert!(
        outcomes.iter().any(|o| matches!(
            o,
            takosumi_core::Outcome::Skipped(
                "claimed by another handler" | "not queued: claimed elsewhere or already planned"
            )
        )),
        "{outcomes:?}"
    );
    let events = stack.client.events(plan.id).await?;
    for kind in [
        "claimed",
        "checkout_started",
        "environment_prepared",
        "checked_out",
        "planned",
    ] {
        assert_eq!(
            events.iter().filter(|e| e.kind == kind).count(),
            1,
            "{kind}: {events:?}"
        );
    }
    let left = takosumi_tests::leftover_run_dirs(&stack.settings.work_dir);
    assert!(left.is_empty(), "run directories left behind: {left:?}");
    let plan_files: Vec<String> = stack
        .ctx
        .objects
        .list(&format!("runs/{}/", plan.id))
        .await?
        .into_iter()
        .filter(|k| k.contains("plan."))
        .collect();
    assert_eq!(plan_files.len(), 1, "{plan_files:?}");
    let (g1, g2) = tokio::join!(
        takosumi_gate::handle(&stack.ctx, msg),
        takosumi_gate::handle(&stack.ctx, msg)
    );
    assert_eq!(
        [g1?, g2?]
            .iter()
            .filter(|o| **o == takosumi_core::Outcome::Done)
            .count(),
        1
    );

    let apply = stack.client.apply(plan.id, None).await?;
    let amsg = RunMessage { run_id: apply.id };
    takosumi_gate::handle(&stack.ctx, amsg).await?;
    let (x, y) = tokio::join!(
        takosumi_apply::handle(&stack.ctx, amsg),
        takosumi_apply::handle(&stack.ctx, amsg)
    );
    let outcomes = [x?, y?];
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == takosumi_core::Outcome::Done)
            .count(),
        1,
        "{outcomes:?}"
    );
    assert_eq!(stack.tool_count("apply"), 1);
    assert_eq!(state_version_count(&stack, &capsule).await, 1);
    stack.stop().await
}

/// A drift check queued while its Capsule had something applied, and reached by the plan
/// step only after a destroy removed it, fails `not_applied` before anything runs. The
/// step finds that before the checkout, while its claim (made beside git) may still be on
/// its way: it waits for the claim, so the failure is recorded on a Run it holds, and never
/// checks out. A new check is refused at once (409 `not_applied`): the destroy's state left
/// the Capsule without a drift baseline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drift_check_whose_baseline_a_destroy_removed_fails_not_applied() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let through = |plan: takosumi_core::RunId| {
        let stack = &stack;
        async move {
            let msg = RunMessage { run_id: plan };
            takosumi_plan::handle(&stack.ctx, msg).await?;
            takosumi_gate::handle(&stack.ctx, msg).await?;
            let apply = stack.client.apply(plan, None).await?;
            let msg = RunMessage { run_id: apply.id };
            takosumi_gate::handle(&stack.ctx, msg).await?;
            takosumi_apply::handle(&stack.ctx, msg).await?;
            let applied = stack.client.get_run(apply.id).await?;
            anyhow::ensure!(applied.status == RunStatus::Applied, "{applied:?}");
            Ok::<_, anyhow::Error>(())
        }
    };
    let plan = stack.client.plan(capsule.id, None).await?;
    through(plan.id).await?;
    let check = stack.client.drift_check(capsule.id).await?;
    let destroy = stack.client.destroy(capsule.id, None).await?;
    through(destroy.id).await?;
    let checkouts_before = stack.tool_count("init");

    let outcome = takosumi_plan::handle(&stack.ctx, RunMessage { run_id: check.id }).await?;
    assert_eq!(
        outcome,
        takosumi_core::Outcome::Failed(takosumi_core::FailureCode::NotApplied)
    );
    let failed = stack.client.get_run(check.id).await?;
    assert_eq!(failed.status, RunStatus::Failed, "{failed:?}");
    let kinds: Vec<String> = stack
        .client
        .events(check.id)
        .await?
        .into_iter()
        .map(|e| e.kind.as_str().to_owned())
        .collect();
    assert_eq!(kinds, ["queued", "claimed", "failed"], "{kinds:?}");
    assert_eq!(stack.tool_count("init"), checkouts_before, "a tool ran");
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/drift-check", capsule.id),
            json!({}),
        )
        .await?;
    assert_eq!((s, b["code"].as_str()), (409, Some("not_applied")), "{b}");
    let left = takosumi_tests::leftover_run_dirs(&stack.settings.work_dir);
    assert!(left.is_empty(), "run directories left behind: {left:?}");
    stack.stop().await
}

/// A plan an apply overtook is recorded against the generation it planned from, so its
/// own apply is refused `state_generation_changed` (Stack::check_an_overtaken_plan_keeps_its_generation).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_an_apply_overtook_keeps_the_generation_it_planned_from() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    stack
        .check_an_overtaken_plan_keeps_its_generation(capsule.id)
        .await?;
    stack.stop().await
}

/// A plan handler process killed with SIGKILL mid-plan: the reaper re-queues the Run when
/// its lease expires, and a new handler finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_plan_handler_is_recovered_by_the_reaper() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: true,
            plan: false,
            gate: true,
            apply: true,
        },
        lease_secs: 2,
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    stack.pause_plans(true)?;
    let mut victim = stack.spawn_process("plan")?;
    let plan = stack.client.plan(capsule.id, None).await?;
    // Wait until the tool's plan is running inside the victim.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !stack.tool_invocations().iter().any(|l| l == "paused") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the plan never started: {:?}",
            stack.tool_invocations()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        stack.client.get_run(plan.id).await?.status,
        RunStatus::Planning
    );
    victim.kill().await?; // SIGKILL
    stack.pause_plans(false)?;
    let _rescuer = stack.spawn_process("plan")?;
    let done = stack.wait(plan.id).await?;
    assert_eq!(done.status, RunStatus::Planned, "{done:?}");
    assert_eq!(done.attempts, 2, "{done:?}");
    let events = stack.client.events(plan.id).await?;
    assert!(
        events.iter().any(|e| e.kind == "lease_expired_requeued"),
        "{events:?}"
    );
    assert_eq!(events.iter().filter(|e| e.kind == "claimed").count(), 2);
    stack.stop().await
}
