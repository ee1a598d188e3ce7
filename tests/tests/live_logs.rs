//! End-to-end: a run's logs are readable while the tool still works (real API, RabbitMQ,
//! Postgres, the S3 server and terraform 1.0.3). The tool's masked output is stored as it
//! arrives; a secret printed in two pieces is still masked; a plan's diff (which can show
//! values only the plan marks sensitive) is stored only once those values are masked.

use std::time::Duration;

use serde_json::{Map, Value, json};
use takosumi_client::{NewCapsule, PlanRequest, Source};
use takosumi_core::{RunId, RunStatus};
use takosumi_tests::{GitRepo, Options, Stack};

/// An apply that prints a canary (given as a sensitive variable the configuration does
/// not declare sensitive), then works for several seconds. (A secret split across two
/// reads of the tool's output is unit-tested in `takosumi_runner`: terraform itself turns
/// a slow partial write of a provisioner into two separate lines.)
/// Its markers (`begin-2`, `middle-4`, `end-6`) are computed by the shell, so the echoed
/// command line terraform prints first does not contain them.
const SLOW_APPLY_TF: &str = r#"
variable "api_key" { type = string }
resource "null_resource" "slow" {
  triggers = { n = length(var.api_key) }
  provisioner "local-exec" {
    command     = "echo begin-$((1+1)); echo \"k=$KEY\"; sleep 1; echo middle-$((2+2)); sleep 8; echo end-$((3+3))"
    environment = { KEY = var.api_key }
  }
}
"#;

/// A plan whose diff shows, in clear, a value only an output marks sensitive.
const DERIVED_TF: &str = r#"
variable "seed" { type = string }
locals { derived = "canary-derived-${substr(sha256(var.seed), 0, 16)}" }
resource "null_resource" "watched" {
  triggers = { derived = local.derived }
}
output "derived" {
  value     = local.derived
  sensitive = true
}
"#;

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

async fn new_capsule(stack: &Stack, repo: &GitRepo, dir: &str) -> anyhow::Result<NewCapsuleId> {
    let ws = stack
        .client
        .create_workspace(&format!(
            "live-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?
        .id;
    let cap = stack
        .client
        .create_capsule(
            ws,
            &NewCapsule {
                name: "live".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: dir.into(),
                tool: "terraform".into(),
                vars: Map::new(),
            },
        )
        .await?;
    Ok(cap.id)
}

type NewCapsuleId = takosumi_core::CapsuleId;

/// Polls the Run's logs until `ready(logs)` holds, and returns those logs with the Run's
/// status read right after them.
async fn logs_when(
    stack: &Stack,
    run: RunId,
    ready: impl Fn(&str) -> bool,
) -> anyhow::Result<(String, RunStatus)> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let logs = stack.client.logs(run).await?;
        if ready(&logs) {
            let status = stack.client.get_run(run).await?.status;
            return Ok((logs, status));
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the logs never showed what was expected: {logs}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The promise: while an apply is still working, `GET /runs/{id}/logs` already shows what
/// the tool printed so far, its last line included (the masker holds back no finished
/// line) — and a canary secret it printed is masked there, in the final log and in every
/// stored log row. The live part is not stored twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn apply_logs_are_readable_while_the_tool_works() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::new(&[("infra/slow/main.tf", SLOW_APPLY_TF)])?;
    let cap = new_capsule(&stack, &repo, "infra/slow").await?;
    let canary = format!(
        "canary-live-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    let req = PlanRequest {
        vars: Map::new(),
        sensitive_vars: obj(json!({ "api_key": canary })),
        ..PlanRequest::default()
    };
    let plan = stack
        .wait(stack.client.plan_with(cap, None, &req).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack.client.apply(plan.id, None).await?.id;

    let (partial, status) = logs_when(&stack, apply, |l| l.contains("middle-4")).await?;
    assert!(
        !status.is_terminal(),
        "the logs were expected while the apply still worked; it is {status:?}"
    );
    assert!(
        !partial.contains("end-6"),
        "the apply had not finished: {partial}"
    );
    assert!(!partial.contains(&canary), "the live log holds the canary");
    assert!(partial.contains("k=***"), "{partial}");

    let done = stack.wait(apply).await?;
    assert_eq!(done.status, RunStatus::Applied, "{done:?}");
    let full = stack.client.logs(apply).await?;
    assert!(full.contains("end-6"), "{full}");
    assert!(!full.contains(&canary), "the final log holds the canary");
    assert_eq!(
        full.matches("begin-2").count(),
        1,
        "the live part was stored twice: {full}"
    );
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT chunk FROM run_logs WHERE run_id = $1 AND step = 'apply' ORDER BY id",
    )
    .bind(apply.as_uuid())
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert!(
        rows.len() >= 2,
        "the apply's output was stored in one piece at the end: {rows:?}"
    );
    assert!(rows.iter().all(|r| !r.contains(&canary)));
    stack.stop().await
}

/// The promise: a plan's progress lines are readable while it still works, but its diff
/// — which shows a value only the plan marks sensitive — is stored only after that value
/// joined the masker: it is in no live log and masked in the final one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plan_progress_is_live_and_its_diff_waits_for_the_masker() -> anyhow::Result<()> {
    let tools = takosumi_tests::fixture_dir()?;
    let wrapper = tools.path().join("terraform");
    let real = std::env::var("TAKOSUMI_TERRAFORM_BIN")?;
    let slow = tools.path().join("slow-plans");
    // The real terraform; a plan then keeps its output pipe open a few seconds longer.
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif [ \"$1\" = plan ] && [ -f '{slow}' ]; then '{real}' \"$@\"; rc=$?; sleep 6; exit $rc; fi\nexec '{real}' \"$@\"\n",
            slow = slow.display(),
        ),
    )?;
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    let stack = Stack::start_with_tool(Options::default(), Some(&wrapper)).await?;
    let repo = GitRepo::new(&[("infra/derived/main.tf", DERIVED_TF)])?;
    let cap = new_capsule(&stack, &repo, "infra/derived").await?;
    let plan_with_seed = |seed: &str| PlanRequest {
        vars: obj(json!({ "seed": seed })),
        ..PlanRequest::default()
    };
    let first = stack
        .wait(
            stack
                .client
                .plan_with(cap, None, &plan_with_seed("one"))
                .await?
                .id,
        )
        .await?;
    let applied = stack
        .wait(stack.client.apply(first.id, None).await?.id)
        .await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");

    std::fs::write(&slow, "")?;
    let seed = "two";
    let derived = {
        use sha2::Digest;
        let digest = hex::encode(sha2::Sha256::digest(seed.as_bytes()));
        format!("canary-derived-{}", &digest[..16])
    };
    let plan = stack
        .client
        .plan_with(cap, None, &plan_with_seed(seed))
        .await?
        .id;
    let (partial, status) = logs_when(&stack, plan, |l| {
        l.contains("null_resource.watched: Refreshing state")
    })
    .await?;
    assert!(
        !status.is_terminal(),
        "the progress was expected while the plan still worked; it is {status:?}"
    );
    assert!(
        !partial.contains("must be replaced") && !partial.contains(&derived),
        "the plan's diff went live before its sensitive values were known: {partial}"
    );

    let done = stack.wait(plan).await?;
    assert_eq!(done.status, RunStatus::Planned, "{done:?}");
    let full = stack.client.logs(plan).await?;
    assert!(full.contains("must be replaced"), "{full}");
    assert!(
        !full.contains(&derived),
        "the plan-sensitive value is in the log"
    );
    assert_eq!(
        full.matches("Refreshing state").count(),
        1,
        "the live part was stored twice: {full}"
    );
    stack.stop().await
}
