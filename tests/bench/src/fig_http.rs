//! Figure 6: the API under load on loopback. `GET /api/v1/runs/{id}` of a planned Run, then
//! `POST /api/v1/capsules/{id}/plan` admission (each request writes a Run, its `queued`
//! event, an activity row and an outbox row in one transaction; nothing consumes the plan
//! queue meanwhile). The load generator is `wrk` when installed (infra/local/bench.sh
//! installs it from apt), otherwise a bounded tokio + reqwest loop in this binary, named
//! as such in the report. The API runs inside this process; the generator shares the
//! same cores. The database holds 20,000 applied Runs, analyzed, before the loads.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use takosumi_core::RunMessage;
use takosumi_tests::{GitRepo, Options, Stack, Steps};

use crate::harness;
use crate::parse;
use crate::report::Report;
use crate::stats::Summary;

/// Concurrent connections.
pub const CONNECTIONS: usize = 32;
/// Applied Runs (each of a Capsule of its own) in the database before the loads.
const HISTORY: usize = 20_000;
/// The most requests the fallback loop sends in one test, whatever the time.
const MAX_REQUESTS: usize = 500_000;

/// One load test's result.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Requests per second.
    pub rps: f64,
    /// Median latency, ms.
    pub p50: f64,
    /// 99th percentile latency, ms.
    pub p99: f64,
    /// Requests sent.
    pub requests: u64,
    /// Responses that were not 2xx, plus socket errors.
    pub errors: u64,
}

/// Runs figure 6 for `secs` seconds per endpoint.
pub async fn run(report: &mut Report, secs: u64) -> anyhow::Result<()> {
    let noop = harness::sibling("noop-terraform")?;
    let stack = Stack::start_with_tool(
        Options {
            steps: Steps::API_ONLY,
            lease_secs: 60,
        },
        Some(&noop),
    )
    .await?;
    let result = measure(&stack, report, secs).await;
    stack.stop().await?;
    result
}

async fn measure(stack: &Stack, report: &mut Report, secs: u64) -> anyhow::Result<()> {
    let repo = GitRepo::with_example("network")?;
    let ws = harness::workspace(stack).await?;
    let cap = harness::capsule(stack, ws, &repo, "http", json!({ "region": "eu" })).await?;
    // A planned, gated Run to read: the handlers are called directly (no workers run, so
    // the admission test below leaves its Runs queued and costs nothing else).
    let plan = stack.client.plan(cap.id, None).await?;
    let msg = RunMessage { run_id: plan.id };
    takosumi_plan::handle(&stack.ctx, msg).await?;
    takosumi_gate::handle(&stack.ctx, msg).await?;
    anyhow::ensure!(harness::status(stack, plan.id).await? == "planned");
    // History, analyzed, as a running deployment's tables have: on a new database each
    // connection's prepared statements get generic plans made while `runs` holds one row
    // (sequential scans), which nothing re-plans within the load (BENCHMARKS.md, session 17).
    takosumi_tests::seed::due_capsules(&stack.ctx.pool, "http-history", HISTORY).await?;

    let tmp = tempfile::tempdir()?;
    let wrk = which_wrk();
    let get_url = format!("{}/api/v1/runs/{}", stack.api_url, plan.id);
    let post_url = format!("{}/api/v1/capsules/{}/plan", stack.api_url, cap.id);
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let (get, get_cpu) = with_cpu(load(
        &wrk,
        tmp.path(),
        &stack.admin_token,
        "GET",
        &get_url,
        secs,
    ))
    .await?;
    let (post, post_cpu) = with_cpu(load(
        &wrk,
        tmp.path(),
        &stack.admin_token,
        "POST",
        &post_url,
        secs,
    ))
    .await?;
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let generator = match &wrk {
        Some(_) => format!(
            "wrk -t2 -c{CONNECTIONS} -d{secs}s --latency ({})",
            crate::machine::first_line("wrk", &["--version"]).unwrap_or_default()
        ),
        None => format!(
            "fallback tokio+reqwest loop in the bench binary ({CONNECTIONS} connections, {secs} s, at most {MAX_REQUESTS} requests): wrk not installed"
        ),
    };
    // The goals: reads at ≥ 5,000 req/s with p99 ≤ 20 ms, admissions at ≥ 1,500/s.
    let goals = [
        (
            "GET /runs/{id}",
            get,
            "≥ 5,000 req/s, p99 ≤ 20 ms",
            5000.0,
            Some(20.0),
        ),
        ("POST plan admission", post, "≥ 1,500 req/s", 1500.0, None),
    ];
    for (name, l, goal, rps, p99) in goals {
        report.row(
            format!("6. {name}"),
            format!(
                "{:.0} req/s, p99 {:.2} ms (p50 {:.2} ms)",
                l.rps, l.p99, l.p50
            ),
            "—",
            "—",
            goal,
            Some(l.rps >= rps && p99.is_none_or(|p| l.p99 <= p) && l.errors == 0),
        );
    }
    let cpu_line = |name: &str, l: &Load, c: &Cpu| {
        let per = |x: f64| format!("{:.0} µs", x * 1e6 / l.requests.max(1) as f64);
        format!(
            "| {name} | {} | {} | {} | {} | {} | {:.0}% of the cores |",
            per(c.api),
            per(c.generator),
            per(c.postgres),
            per(c.rabbitmq),
            per(c.rest),
            c.busy_pct
        )
    };
    report.detail(
        "6. API under load",
        vec![
            format!("Load generator: {generator}, on loopback; the API serves from the bench process."),
            String::new(),
            "CPU time per request, by process, over each test:".to_owned(),
            String::new(),
            "| endpoint | API (bench process) | load generator | Postgres | RabbitMQ (relay publishing) | rest | machine busy |".to_owned(),
            "|---|---|---|---|---|---|---|".to_owned(),
            cpu_line("GET /runs/{id}", &get, &get_cpu),
            cpu_line("POST plan", &post, &post_cpu),
            String::new(),
            format!(
                "GET: {} requests, {} errors. POST: {} requests, {} errors; {} Runs were created during the POST test.",
                get.requests,
                get.errors,
                post.requests,
                post.errors,
                after - before
            ),
        ],
    );
    Ok(())
}

/// `wrk` on PATH, when installed.
pub fn which_wrk() -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("wrk"))
            .find(|p| p.is_file())
    })
}

/// One load test of `url` for `secs` seconds: `wrk` when there is one, else the fallback loop.
pub async fn load(
    wrk: &Option<std::path::PathBuf>,
    tmp: &std::path::Path,
    token: &str,
    method: &str,
    url: &str,
    secs: u64,
) -> anyhow::Result<Load> {
    match wrk {
        Some(bin) => {
            // The token goes in a private script file, not on the command line.
            let script = tmp.join(format!("{}.lua", method.to_ascii_lowercase()));
            std::fs::write(
                &script,
                format!(
                    "wrk.method = \"{method}\"\nwrk.headers[\"Authorization\"] = \"Bearer {token}\"\n"
                ),
            )?;
            let out = tokio::process::Command::new(bin)
                .args([
                    "-t2",
                    &format!("-c{CONNECTIONS}"),
                    &format!("-d{secs}s"),
                    "--latency",
                    "-s",
                ])
                .arg(&script)
                .arg(url)
                .output()
                .await?;
            let text = String::from_utf8_lossy(&out.stdout);
            let r = parse::wrk(&text)
                .ok_or_else(|| anyhow::anyhow!("could not read wrk's output: {text}"))?;
            Ok(Load {
                rps: r.requests_per_sec,
                p50: r.p50_ms,
                p99: r.p99_ms,
                requests: r.requests,
                errors: r.non_2xx + r.socket_errors,
            })
        }
        None => fallback(token, method, url, secs).await,
    }
}

/// A closed-loop load: `CONNECTIONS` tasks each send one request after another until the
/// time is up or `MAX_REQUESTS` were sent in all.
async fn fallback(token: &str, method: &str, url: &str, secs: u64) -> anyhow::Result<Load> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONNECTIONS)
        .build()?;
    let sent = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let (client, sent, url, token, post) = (
            client.clone(),
            sent.clone(),
            url.to_owned(),
            token.to_owned(),
            method == "POST",
        );
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            while Instant::now() < deadline && sent.fetch_add(1, Ordering::Relaxed) < MAX_REQUESTS {
                let req = if post {
                    client.post(&url)
                } else {
                    client.get(&url)
                };
                let t = Instant::now();
                match req.bearer_auth(&token).send().await {
                    Ok(r) if r.status().is_success() => {
                        let _ = r.bytes().await;
                        lat.push(t.elapsed().as_secs_f64() * 1000.0);
                    }
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (lat, e) = t.await?;
        all.extend(lat);
        errors += e;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let s = Summary::of(&all).ok_or_else(|| anyhow::anyhow!("no request succeeded"))?;
    Ok(Load {
        rps: all.len() as f64 / elapsed,
        p50: s.median,
        p99: s.p99,
        requests: all.len() as u64 + errors,
        errors,
    })
}

/// CPU seconds used during one load test, by process.
#[derive(Debug, Clone, Copy)]
struct Cpu {
    api: f64,
    generator: f64,
    postgres: f64,
    rabbitmq: f64,
    rest: f64,
    busy_pct: f64,
}

/// Runs `f` and attributes the machine's CPU over it: this process's own time is the API
/// (nothing else here is busy meanwhile); its reaped children's time is wrk.
async fn with_cpu<F: std::future::Future<Output = anyhow::Result<Load>>>(
    f: F,
) -> anyhow::Result<(Load, Cpu)> {
    let groups: &[&[&str]] = &[&["postgres"], &["beam.smp", "epmd", "erl_child_setup"]];
    let me = std::path::Path::new("/proc/self/stat");
    let (s0, m0, p0) = (
        crate::procfs::cpu_of_path(me)?,
        crate::procfs::machine_cpu()?,
        crate::procfs::cpu_by_comm(groups),
    );
    let load = f.await?;
    let (s1, m1, p1) = (
        crate::procfs::cpu_of_path(me)?,
        crate::procfs::machine_cpu()?,
        crate::procfs::cpu_by_comm(groups),
    );
    let api = s1.own - s0.own;
    let generator = s1.children - s0.children;
    let postgres = (p1[0] - p0[0]).max(0.0);
    let rabbitmq = (p1[1] - p0[1]).max(0.0);
    let busy = m1.0 - m0.0;
    Ok((
        load,
        Cpu {
            api,
            generator,
            postgres,
            rabbitmq,
            rest: (busy - api - generator - postgres - rabbitmq).max(0.0),
            busy_pct: 100.0 * busy / (m1.1 - m0.1).max(1e-9),
        },
    ))
}
