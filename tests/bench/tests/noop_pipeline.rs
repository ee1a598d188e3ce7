//! End-to-end: the orchestration-only `noop-terraform` satisfies every call Takosumi makes,
//! through the real API, RabbitMQ, Postgres, the S3 server and the in-process steps. The
//! throughput and memory figures rest on this: if the stand-in stopped being accepted, they
//! would measure a failing pipeline.

use std::path::Path;

use serde_json::json;
use takosumi_bench::harness;
use takosumi_core::RunStatus;
use takosumi_tests::{GitRepo, Options, Stack};

/// A plan with the no-op tool is planned with its one `create` counted and its plan sealed
/// under a digest; applying it writes a StateVersion (generation 0 → 1) and publishes the
/// tool's output; the recorded tool version names the stand-in, never terraform's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn noop_tool_goes_through_plan_gate_apply() -> anyhow::Result<()> {
    let noop = Path::new(env!("CARGO_BIN_EXE_noop-terraform"));
    let stack = Stack::start_with_tool(Options::default(), Some(noop)).await?;
    let repo = GitRepo::with_example("network")?;
    let ws = harness::workspace(&stack).await?;
    let cap = harness::capsule(
        &stack,
        ws,
        &repo,
        "noop",
        json!({ "region": "eu", "noop_plan_bytes": 65536 }),
    )
    .await?;

    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let changes = plan.changes.expect("changes");
    assert_eq!((changes.add, changes.change, changes.destroy), (1, 0, 0));
    assert_eq!(plan.plan_digest.as_deref().map(str::len), Some(64));
    assert_eq!(
        plan.tool_version
            .as_ref()
            .and_then(|v| v["terraform_version"].as_str()),
        Some(takosumi_bench::noop::VERSION)
    );

    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(apply.outputs, Some(json!({ "noop": "ok" })));
    assert_eq!(apply.state_generation, Some(1));
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 1);
    stack.stop().await
}
