//! Figure 7: peak resident memory (`VmHWM` in `/proc/<pid>/status`) of each step process
//! (`takosumi-plan`, `takosumi-gate`, `takosumi-apply`, real binaries) idle — connected and
//! consuming, nothing handled yet — and after one 19 MiB plan file went through them: the
//! plan step reads, digests, seals and uploads it; the apply step downloads, unseals,
//! digests and writes it. The no-op tool writes the 19 MiB plan (`noop_plan_bytes`), so
//! the tool's own memory (a separate process) is not in these figures.

use std::time::Duration;

use serde_json::json;
use takosumi_tests::{GitRepo, Options, Stack, Steps};

use crate::harness::{self, Processes};
use crate::procfs;
use crate::report::Report;

/// The plan file size moved: the relay limit, 19 MiB.
pub const PLAN_BYTES: u64 = 19 * 1024 * 1024;

/// Runs figure 7.
pub async fn run(report: &mut Report) -> anyhow::Result<()> {
    let noop = harness::sibling("noop-terraform")?;
    let stack = Stack::start_with_tool(
        Options {
            steps: Steps::API_ONLY,
            lease_secs: 60,
        },
        Some(&noop),
    )
    .await?;
    let children = match Processes::spawn(&stack, &["plan", "gate", "apply"], 1) {
        Ok(c) => c,
        Err(e) => {
            stack.stop().await?;
            return Err(e);
        }
    };
    let result = measure(&stack, &children, report).await;
    children.stop().await;
    stack.stop().await?;
    result
}

async fn measure(stack: &Stack, children: &Processes, report: &mut Report) -> anyhow::Result<()> {
    harness::wait_consumers(
        stack,
        &[("run.plan", 1), ("run.gate", 1), ("run.apply", 1)],
        Duration::from_secs(60),
    )
    .await?;
    // Let start-up settle (connection pools, first reaper pass).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pids = children.pids();
    let idle: Vec<procfs::Memory> = pids
        .iter()
        .map(|(_, p)| procfs::memory(*p))
        .collect::<Result<_, _>>()?;

    let repo = GitRepo::with_example("network")?;
    let ws = harness::workspace(stack).await?;
    let cap = harness::capsule(
        stack,
        ws,
        &repo,
        "big-plan",
        json!({ "region": "eu", "noop_plan_bytes": PLAN_BYTES }),
    )
    .await?;
    let plan = stack.client.plan(cap.id, None).await?;
    harness::wait_status(stack, plan.id, "planned", Duration::from_secs(120)).await?;
    let apply = stack.client.apply(plan.id, None).await?;
    harness::wait_status(stack, apply.id, "applied", Duration::from_secs(120)).await?;
    let moved: Vec<procfs::Memory> = pids
        .iter()
        .map(|(_, p)| procfs::memory(*p))
        .collect::<Result<_, _>>()?;

    let mib = |kib: u64| kib as f64 / 1024.0;
    let plan_mib = PLAN_BYTES as f64 / 1024.0 / 1024.0;
    let mut lines = vec![
        "| process | idle VmRSS | idle peak (VmHWM) | peak after moving a 19 MiB plan (VmHWM) | peak / plan size | growth over idle / plan size |".to_owned(),
        "|---|---|---|---|---|---|".to_owned(),
    ];
    let mut moving_max_ratio: f64 = 0.0;
    let mut growth_max_ratio: f64 = 0.0;
    let mut values = Vec::new();
    for (((step, _), i), m) in pids.iter().zip(&idle).zip(&moved) {
        let ratio = mib(m.peak_kib) / plan_mib;
        let growth = (mib(m.peak_kib) - mib(i.peak_kib)) / plan_mib;
        if step != "gate" {
            moving_max_ratio = moving_max_ratio.max(ratio);
            growth_max_ratio = growth_max_ratio.max(growth);
        }
        lines.push(format!(
            "| takosumi-{step} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {ratio:.2}× | {:.2}× |",
            mib(i.now_kib),
            mib(i.peak_kib),
            mib(m.peak_kib),
            growth,
        ));
        values.push(format!(
            "{step}: idle {:.1}, moving {:.1}",
            mib(i.peak_kib),
            mib(m.peak_kib)
        ));
    }
    lines.push(String::new());
    lines.push("The gate never touches the plan file; its figure is for completeness. VmHWM is the peak since the process started, so the idle peak includes start-up.".to_owned());
    report.row(
        "7. peak RSS per step process (MiB)",
        values.join("; "),
        format!("plan file {plan_mib:.0} MiB"),
        format!(
            "moving: worst peak {moving_max_ratio:.2}×, growth over idle {growth_max_ratio:.2}× the plan size"
        ),
        "≤ 2× the plan size above idle",
        Some(growth_max_ratio <= 2.0),
    );
    report.detail("7. memory", lines);
    Ok(())
}
