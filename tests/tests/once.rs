//! `--once` handlers: each step binary run as a process that takes one Run's
//! worth of work, finishes it, publishes its wake-ups and exits 0 — the shape of a
//! Kubernetes Job started per queued message — against the real API, RabbitMQ, Postgres,
//! the S3 server and terraform 1.0.3. Nothing but the API runs in the test process.

use std::time::Duration;

use serde_json::json;
use takosumi_core::RunStatus;
use takosumi_tests::probe::record;
use takosumi_tests::{GitRepo, Options, Stack, Steps, processes_exactly};
use tokio::time::Instant;

const API_ONLY: Options = Options {
    steps: Steps::API_ONLY,
    lease_secs: 3,
};

/// Runs `takosumi-<step> --once <args>` to its end; returns its exit code and how long it ran.
async fn once(stack: &Stack, step: &str, args: &[&str]) -> anyhow::Result<(i32, Duration)> {
    let started = Instant::now();
    let mut argv = vec!["--once"];
    argv.extend_from_slice(args);
    // A Job handles one Run: a pool of three connections is enough (the pipeline test checks
    // none holds more).
    let mut child = stack.spawn_step(step, &argv, &[("TAKOSUMI_PG_MAX_CONNECTIONS", "3")], None)?;
    let status = tokio::time::timeout(Duration::from_secs(180), child.wait())
        .await
        .map_err(|_| anyhow::anyhow!("takosumi-{step} --once did not exit within 180 s"))??;
    Ok((status.code().unwrap_or(-1), started.elapsed()))
}

/// Samples `pg_stat_activity` every 10 ms until the returned flag is set; the task's result
/// is the most sessions each Takosumi process (by its `application_name`) held at once.
fn watch_connections(
    stack: &Stack,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    tokio::task::JoinHandle<anyhow::Result<std::collections::HashMap<String, i64>>>,
) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pool = stack.ctx.pool.clone();
    let done = stop.clone();
    let task = tokio::spawn(async move {
        let mut most = std::collections::HashMap::<String, i64>::new();
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            let now: Vec<(String, i64)> = sqlx::query_as(
                "SELECT application_name, count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name LIKE 'takosumi-%'
                  GROUP BY 1",
            )
            .fetch_all(&pool)
            .await?;
            for (name, n) in now {
                let seen = most.entry(name).or_default();
                *seen = (*seen).max(n);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(most)
    });
    (stop, task)
}

async fn status_of(stack: &Stack, run: takosumi_core::RunId) -> anyhow::Result<RunStatus> {
    Ok(stack.client.get_run(run).await?.status)
}

/// The pipeline as Jobs: a plan Job, a gate Job and an apply Job, each a process that
/// exits 0 having moved the Run one step; a Job started on an empty queue exits 0 after
/// its idle limit and touches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn once_processes_take_a_run_through_the_pipeline_and_exit() -> anyhow::Result<()> {
    let stack = Stack::start_with(API_ONLY).await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = stack
        .new_capsule(&repo, "network", "infra/network", json!({ "region": "eu" }))
        .await?;

    let plan = stack.client.plan(capsule.id, None).await?;
    assert_eq!(status_of(&stack, plan.id).await?, RunStatus::Queued);
    let (stop_watching, watched) = watch_connections(&stack);
    let (code, _) = once(&stack, "plan", &["--idle-secs", "20"]).await?;
    assert_eq!(code, 0, "the plan Job's exit code");
    assert_eq!(
        stack.tool_count("plan"),
        1,
        "the plan Job ran the tool once"
    );
    assert_eq!(status_of(&stack, plan.id).await?, RunStatus::Planned);
    // The plan's gate check (cost, rules), then the apply's gate.
    let (code, _) = once(&stack, "gate", &["--idle-secs", "20"]).await?;
    assert_eq!(code, 0, "the gate Job's exit code");
    assert_eq!(status_of(&stack, plan.id).await?, RunStatus::Planned);

    let apply = stack.client.apply(plan.id, None).await?;
    let (code, _) = once(&stack, "gate", &["--idle-secs", "20"]).await?;
    assert_eq!(code, 0, "the apply's gate Job's exit code");
    assert_eq!(
        status_of(&stack, apply.id).await?,
        RunStatus::Queued,
        "the gate passed the apply on to the apply queue"
    );
    let (code, _) = once(&stack, "apply", &["--idle-secs", "20"]).await?;
    assert_eq!(code, 0, "the apply Job's exit code");
    let applied = stack.wait(apply.id).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    assert_eq!(stack.tool_count("apply"), 1);
    assert_eq!(
        stack.tool_count("show"),
        1,
        "the apply read the plan's sealed show -json instead of running show again"
    );
    assert!(
        serde_json::to_string(&applied)?.contains("vpc-eu"),
        "the apply's outputs: {applied:?}"
    );
    let after = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(after.state_generation, 1, "the apply Job moved the state");
    // Each Job's sessions carry its name, and none held more than its
    // TAKOSUMI_PG_MAX_CONNECTIONS.
    stop_watching.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = watched.await??;
    for job in ["takosumi-plan", "takosumi-gate", "takosumi-apply"] {
        let held = most.get(job).copied().unwrap_or_default();
        assert!(
            (1..=3).contains(&held),
            "{job} held {held} connections at once: {most:?}"
        );
    }

    // Nothing queued: the Job waits its idle limit and exits 0 without running the tool.
    let (code, took) = once(&stack, "apply", &["--idle-secs", "1"]).await?;
    assert_eq!(code, 0, "an apply Job on an empty queue");
    assert!(
        took < Duration::from_secs(30),
        "an idle Job exits near its idle limit, took {took:?}"
    );
    assert_eq!(stack.tool_count("apply"), 1, "an idle Job applied nothing");

    // `--idle-secs` means nothing without `--once`: refused, as a usage error.
    let mut bad = stack.spawn_step("plan", &["--idle-secs", "3"], &[], None)?;
    let code = tokio::time::timeout(Duration::from_secs(30), bad.wait())
        .await??
        .code();
    assert_eq!(code, Some(2), "a flag that needs --once is a usage error");
    assert_eq!(
        stack.tool_count("plan"),
        1,
        "the refused process planned nothing"
    );

    record("once", "pipeline as --once Jobs (plan, gate, apply)", 1);
    stack.stop().await
}

/// An apply Job killed mid-apply: the tool dies with it, the Run ends `unknown_outcome`
/// (the API's reaper, when the lease runs out), and the next apply Job removes the dead
/// one's Run directory, finds nothing to claim and exits 0: the apply never runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_apply_job_killed_mid_apply_is_never_applied_again() -> anyhow::Result<()> {
    let stack = Stack::start_with(API_ONLY).await?;
    let marker = "47.3519";
    let config = format!(
        "resource \"null_resource\" \"slow\" {{\n  provisioner \"local-exec\" {{\n    command = \"sleep {marker}\"\n  }}\n}}\n"
    );
    let repo = GitRepo::new(&[("infra/network/main.tf", &config)])?;
    let capsule = stack
        .new_capsule(&repo, "network", "infra/network", json!({}))
        .await?;
    let plan = stack.client.plan(capsule.id, None).await?;
    assert_eq!(once(&stack, "plan", &["--idle-secs", "20"]).await?.0, 0);
    assert_eq!(once(&stack, "gate", &["--idle-secs", "20"]).await?.0, 0);
    assert_eq!(status_of(&stack, plan.id).await?, RunStatus::Planned);

    let apply = stack.client.apply(plan.id, None).await?;
    assert_eq!(once(&stack, "gate", &["--idle-secs", "20"]).await?.0, 0);
    let mut job = stack.spawn_step("apply", &["--once", "--idle-secs", "20"], &[], None)?;
    let deadline = Instant::now() + Duration::from_secs(90);
    while processes_exactly(&["sleep", marker]).is_empty() {
        assert!(Instant::now() < deadline, "the provisioner never started");
        if let Some(status) = job.try_wait()? {
            anyhow::bail!("the apply Job exited ({status}) before its provisioner started");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status_of(&stack, apply.id).await?, RunStatus::Applying);
    let runs_dir = std::path::PathBuf::from(&stack.env_vars()["TAKOSUMI_WORK_DIR"]);
    let run_dirs = || -> usize {
        std::fs::read_dir(&runs_dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        e.file_name()
                            .to_str()
                            .is_some_and(|n| n.starts_with(&apply.id.to_string()))
                    })
                    .count()
            })
            .unwrap_or(0)
    };
    assert_eq!(
        run_dirs(),
        1,
        "the apply's run directory exists while it runs"
    );
    job.kill().await?; // SIGKILL, as a node going away
    let deadline = Instant::now() + Duration::from_secs(10);
    while !processes_exactly(&["sleep", marker]).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the provisioner outlived its killed Job"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let done = stack.wait(apply.id).await?;
    assert_eq!(done.status, RunStatus::UnknownOutcome, "{done:?}");
    let (code, _) = once(&stack, "apply", &["--idle-secs", "2"]).await?;
    assert_eq!(code, 0, "the next apply Job exits 0");
    assert_eq!(
        run_dirs(),
        0,
        "the next Job removed the dead one's run directory"
    );
    assert_eq!(
        status_of(&stack, apply.id).await?,
        RunStatus::UnknownOutcome,
        "nobody resumed the apply"
    );
    assert_eq!(stack.tool_count("apply"), 1, "the apply ran once");
    record("once", "apply Jobs killed mid-apply, never re-applied", 1);
    stack.stop().await
}
