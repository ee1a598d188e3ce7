//! Figure 3 (and figure 8 under load): pipeline throughput, **orchestration only**. The tool
//! is `noop-terraform`, which answers instantly, so the figure is Takosumi's own ceiling:
//! API admission, outbox relay, RabbitMQ, claims, git checkout, sealing, object storage
//! and commits, with the real step binaries (`takosumi-plan`, `takosumi-gate`,
//! `takosumi-apply`) started as separate processes, 1, 2 and 4 per step, each handling 2
//! messages at once (`TAKOSUMI_CONCURRENCY=2`). The API runs inside the bench process.
//!
//! One pipeline run = `POST plan` → planned → the plan's gate decision, then `POST apply`
//! → gate → applied, each on its own Capsule (so applies never wait for one another).
//! All plans are submitted at t0; the driver submits each apply as soon as its plan is
//! planned. Throughput = runs / (last `applied` event − t0).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde_json::json;
use takosumi_core::RunId;
use takosumi_tests::{GitRepo, Options, Stack, Steps};

use crate::fig_overhead::Segments;
use crate::harness::{self, Processes, ms};
use crate::procfs;
use crate::report::Report;
use crate::stats::Summary;

/// The services' processes, by command name: Postgres, RabbitMQ (Erlang), s3s-fs.
const SERVICES: &[&[&str]] = &[
    &["postgres"],
    &["beam.smp", "epmd", "erl_child_setup", "inet_gethost"],
    &["s3s-fs"],
];

/// The step processes the figure starts.
const STEPS: [&str; 3] = ["plan", "gate", "apply"];

/// What one configuration measured.
#[derive(Debug)]
pub struct Config {
    /// Processes per step.
    pub procs: usize,
    /// Pipeline runs completed.
    pub runs: usize,
    /// Runs per second.
    pub rate: f64,
}

/// Queue latency samples under load (the largest configuration), for figure 8.
#[derive(Debug, Default)]
pub struct LoadQueue {
    /// Processes per step these were taken with.
    pub procs: usize,
    /// plan: `queued` → `claimed` (includes waiting for a free handler: a backlog).
    pub plan: Vec<f64>,
    /// apply: `gate_decision` → `claimed`.
    pub apply: Vec<f64>,
}

/// Runs figure 3 for each entry of `procs`.
pub async fn run(report: &mut Report, procs: &[usize], runs: usize) -> anyhow::Result<LoadQueue> {
    let noop = harness::sibling("noop-terraform")?;
    let stack = Stack::start_with_tool(
        Options {
            steps: Steps::API_ONLY,
            lease_secs: 60,
        },
        Some(&noop),
    )
    .await?;
    let result = measure(&stack, report, procs, runs).await;
    stack.stop().await?;
    result
}

async fn measure(
    stack: &Stack,
    report: &mut Report,
    procs: &[usize],
    runs: usize,
) -> anyhow::Result<LoadQueue> {
    let repo = GitRepo::with_example("network")?;
    let ws = harness::workspace(stack).await?;
    let mut configs = Vec::new();
    let mut lines = vec![
        "CPU time per pipeline run over the timed interval, by process: each step process's own time and its sandboxes' (bubblewrap, git, the launcher and the no-op tool: everything it started, counted through a cgroup per step; where the bench could not make one, only the children the step reaped, which leaves the sandboxes in \"rest\"), the bench process (API + driver), the services, and the rest (the kernel's own threads, anything else running on the machine). Then the median time each Run spent waiting and working.".to_owned(),
        String::new(),
        "| processes/step | runs/s | plan own + sandboxes | gate | apply own + sandboxes | bench (API + driver) | Postgres | RabbitMQ | s3s-fs | rest | machine busy | plan: queued→claimed / claimed→planned | apply: queued→gate / gate→claimed / claimed→applied (median ms) |".to_owned(),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|".to_owned(),
    ];
    let mut sequential_lines = Vec::new();
    let mut load = LoadQueue::default();
    for (ci, &k) in procs.iter().enumerate() {
        let children = Processes::spawn(stack, &STEPS, k)?;
        let ready = harness::wait_consumers(
            stack,
            &[("run.plan", k), ("run.gate", k), ("run.apply", k)],
            Duration::from_secs(60),
        )
        .await;
        if let Err(e) = ready {
            children.stop().await;
            return Err(e);
        }
        if ci == 0 {
            match sequential(stack, &repo, ws, 10).await {
                Ok(l) => sequential_lines = l,
                Err(e) => {
                    children.stop().await;
                    return Err(e);
                }
            }
        }
        let result = one_config(stack, &repo, ws, &children, ci, k, runs).await;
        children.stop().await;
        let (cfg, line, q) = result?;
        lines.push(line);
        configs.push(cfg);
        load = q;
    }
    let best = configs.iter().map(|c| c.rate).fold(0.0f64, f64::max);
    let value = configs
        .iter()
        .map(|c| format!("{}×: {:.1}", c.procs, c.rate))
        .collect::<Vec<_>>()
        .join(", ");
    report.row(
        format!("3. pipeline throughput, no-op tool, orchestration only (n={runs} per config)"),
        format!("{value} runs/s"),
        "— (no peer publishes one)",
        "—",
        "≥ 50 runs/s",
        Some(best >= 50.0),
    );
    report.detail("3. throughput: where the CPU goes", lines);
    report.detail(
        "3. one no-op pipeline run at a time, per step (from Run events)",
        sequential_lines,
    );
    Ok(load)
}

/// `n` pipeline runs one after another with the no-op tool (one process per step): where a
/// Run's time goes when nothing else waits, tool excluded.
async fn sequential(
    stack: &Stack,
    repo: &GitRepo,
    ws: takosumi_core::WorkspaceId,
    n: usize,
) -> anyhow::Result<Vec<String>> {
    let (mut plan_seg, mut apply_seg) = (Segments::default(), Segments::default());
    let timeout = Duration::from_secs(60);
    for i in 0..n {
        let cap = harness::capsule(
            stack,
            ws,
            repo,
            &format!("seq-{i}"),
            json!({ "region": "eu" }),
        )
        .await?;
        let start = Utc::now();
        let plan = stack.client.plan(cap.id, None).await?;
        harness::wait_status(stack, plan.id, "planned", timeout).await?;
        let astart = Utc::now();
        let apply = stack.client.apply(plan.id, None).await?;
        harness::wait_status(stack, apply.id, "applied", timeout).await?;
        plan_seg.add(
            "POST plan",
            start,
            &harness::events(stack, plan.id).await?,
            "planned",
        );
        apply_seg.add(
            "POST apply",
            astart,
            &harness::events(stack, apply.id).await?,
            "applied",
        );
    }
    let mut lines = vec![
        format!("{n} runs, one at a time, no-op tool, one process per step. Plan Run:"),
        String::new(),
    ];
    lines.extend(plan_seg.lines());
    lines.push(String::new());
    lines.push("Apply Run:".to_owned());
    lines.push(String::new());
    lines.extend(apply_seg.lines());
    Ok(lines)
}

async fn one_config(
    stack: &Stack,
    repo: &GitRepo,
    ws: takosumi_core::WorkspaceId,
    children: &Processes,
    ci: usize,
    k: usize,
    runs: usize,
) -> anyhow::Result<(Config, String, LoadQueue)> {
    // Capsules first (untimed).
    let caps: Vec<_> = futures::stream::iter(0..runs)
        .map(|i| async move {
            let name = format!("tp{ci}-{i}");
            harness::capsule(stack, ws, repo, &name, json!({ "region": "eu" })).await
        })
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let pids = children.pids();
    let cpu_before: Vec<procfs::CpuTime> = pids
        .iter()
        .map(|(_, p)| procfs::cpu(*p))
        .collect::<Result<_, _>>()?;
    let groups_before = STEPS.map(|s| children.group_cpu(s));
    let self_before = procfs::cpu_of_path(std::path::Path::new("/proc/self/stat"))?;
    let services_before = procfs::cpu_by_comm(SERVICES);
    let (busy0, total0) = procfs::machine_cpu()?;

    let t0: DateTime<Utc> = Utc::now();
    let plans: Vec<RunId> = futures::stream::iter(caps.iter())
        .map(|c| async move { stack.client.plan(c.id, None).await.map(|r| r.id) })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let plan_uuids: Vec<uuid::Uuid> = plans.iter().map(|r| r.as_uuid()).collect();
    let mut applies: HashMap<RunId, RunId> = HashMap::new();
    // The driver (the person who applies each reviewed plan) reads only the Runs it still
    // waits for, one statement every 20 ms: its reads are charged to Postgres's CPU in the
    // table, so they stay small beside the pipeline's (they were two statements over all
    // 200 Runs every 10 ms, ~1.5 ms of Postgres each).
    let mut waiting: HashSet<uuid::Uuid> = plan_uuids.iter().copied().collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    while !waiting.is_empty() {
        let ids: Vec<uuid::Uuid> = waiting.iter().copied().collect();
        let rows: Vec<(uuid::Uuid, String)> =
            sqlx::query_as("SELECT id, status::text FROM runs WHERE id = ANY($1)")
                .bind(&ids)
                .fetch_all(&stack.ctx.pool)
                .await?;
        let mut planned = Vec::new();
        for (id, status) in rows {
            match status.as_str() {
                "planned" => planned.push(RunId::from_uuid(id)),
                "applied" => {
                    waiting.remove(&id);
                }
                "failed" | "held" | "unknown_outcome" | "canceled" => {
                    bail!("Run {id} ended {status} during the throughput run");
                }
                _ => {}
            }
        }
        let submitted: Vec<(RunId, RunId)> = futures::stream::iter(planned)
            .map(|p| async move { stack.client.apply(p, None).await.map(|a| (p, a.id)) })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        for (plan, apply) in submitted {
            waiting.remove(&plan.as_uuid());
            waiting.insert(apply.as_uuid());
            applies.insert(plan, apply);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "throughput run did not finish in 300 s: {} Runs still running",
                waiting.len()
            );
        }
        if !waiting.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    anyhow::ensure!(
        applies.len() == runs,
        "{} of {runs} plans applied",
        applies.len()
    );
    let (busy1, total1) = procfs::machine_cpu()?;
    let groups_after = STEPS.map(|s| children.group_cpu(s));
    let self_after = procfs::cpu_of_path(std::path::Path::new("/proc/self/stat"))?;
    let services_after = procfs::cpu_by_comm(SERVICES);
    let cpu_after: Vec<procfs::CpuTime> = pids
        .iter()
        .map(|(_, p)| procfs::cpu(*p))
        .collect::<Result<_, _>>()?;

    // Every event of these runs, in one query.
    let all: Vec<uuid::Uuid> = plan_uuids
        .iter()
        .copied()
        .chain(applies.values().map(|r| r.as_uuid()))
        .collect();
    let rows: Vec<(uuid::Uuid, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT run_id, kind, at FROM run_events WHERE run_id = ANY($1) ORDER BY id",
    )
    .bind(&all)
    .fetch_all(&stack.ctx.pool)
    .await?;
    let mut first: HashMap<(uuid::Uuid, String), DateTime<Utc>> = HashMap::new();
    for (run, kind, at) in rows {
        first.entry((run, kind)).or_insert(at);
    }
    let ev = |run: RunId, kind: &str| {
        first
            .get(&(run.as_uuid(), kind.to_owned()))
            .copied()
            .with_context(|| format!("{run} has no {kind} event"))
    };
    let mut end = t0;
    let (mut p_wait, mut p_work, mut a_gate, mut a_wait, mut a_work) =
        (vec![], vec![], vec![], vec![], vec![]);
    let gated: HashSet<RunId> = plans
        .iter()
        .copied()
        .filter(|p| ev(*p, "gate_decision").is_ok())
        .collect();
    for (plan, apply) in &applies {
        let applied = ev(*apply, "applied")?;
        end = end.max(applied);
        p_wait.push(ms(ev(*plan, "queued")?, ev(*plan, "claimed")?));
        p_work.push(ms(ev(*plan, "claimed")?, ev(*plan, "planned")?));
        let gate = ev(*apply, "gate_decision")?;
        a_gate.push(ms(ev(*apply, "queued")?, gate));
        a_wait.push(ms(gate, ev(*apply, "claimed")?));
        a_work.push(ms(ev(*apply, "claimed")?, applied));
    }
    let secs = ms(t0, end) / 1000.0;
    let rate = runs as f64 / secs;

    // (own, sandboxes) per step: the cgroup's total less the processes' own time, or
    // without a cgroup the children they reaped.
    let mut per_step: HashMap<&str, (f64, f64)> = HashMap::new();
    for (((step, _), b), a) in pids.iter().zip(&cpu_before).zip(&cpu_after) {
        let e = per_step.entry(step.as_str()).or_default();
        e.0 += a.own - b.own;
        e.1 += a.children - b.children;
    }
    for ((step, before), after) in STEPS.iter().zip(groups_before).zip(groups_after) {
        if let (Some(before), Some(after), Some(e)) = (before, after, per_step.get_mut(step)) {
            e.1 = (after - before - e.0).max(0.0);
        }
    }
    let handlers_total: f64 = per_step.values().map(|(own, kids)| own + kids).sum();
    let bench_used =
        (self_after.own - self_before.own) + (self_after.children - self_before.children);
    let services: Vec<f64> = services_after
        .iter()
        .zip(&services_before)
        .map(|(a, b)| (a - b).max(0.0))
        .collect();
    let machine_busy = busy1 - busy0;
    let rest = (machine_busy - handlers_total - bench_used - services.iter().sum::<f64>()).max(0.0);
    let per_run = |x: f64| format!("{:.0} ms", x * 1000.0 / runs as f64);
    let step = |name: &str| per_step.get(name).copied().unwrap_or_default();
    let med = |v: &[f64]| Summary::of(v).map_or(f64::NAN, |s| s.median);
    let line = format!(
        "| {k} | {rate:.1} | {} + {} | {} | {} + {} | {} | {} | {} | {} | {} | {:.0}% of {} cores | {:.0} / {:.0} | {:.0} / {:.0} / {:.0} |",
        per_run(step("plan").0),
        per_run(step("plan").1),
        per_run(step("gate").0 + step("gate").1),
        per_run(step("apply").0),
        per_run(step("apply").1),
        per_run(bench_used),
        per_run(services[0]),
        per_run(services[1]),
        per_run(services[2]),
        per_run(rest),
        100.0 * machine_busy / (total1 - total0).max(1e-9),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        med(&p_wait),
        med(&p_work),
        med(&a_gate),
        med(&a_wait),
        med(&a_work),
    );
    if gated.len() != plans.len() {
        eprintln!(
            "bench: {} of {} plans had no gate decision when the run ended",
            plans.len() - gated.len(),
            plans.len()
        );
    }
    eprintln!(
        "bench: figure 3: {k} process(es) per step: {rate:.1} runs/s ({runs} runs in {secs:.2} s)"
    );
    Ok((
        Config {
            procs: k,
            runs,
            rate,
        },
        line,
        LoadQueue {
            procs: k,
            plan: p_wait,
            apply: a_wait,
        },
    ))
}
