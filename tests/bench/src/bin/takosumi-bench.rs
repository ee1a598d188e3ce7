//! `takosumi-bench`: the end-to-end figures, each beside its reference measured
//! in the same run, as markdown on stdout (progress on stderr). Needs the local stack
//! (`infra/local/start.sh`, then source its env.sh) and the release binaries beside this
//! one; `infra/local/bench.sh` does all of it. Exits 0 whatever the figures are: only a
//! broken pipeline is an error.
//!
//! Options: `--runs N` (figures 1–2, default 30), `--warmup N` (default 2),
//! `--pipeline-runs N` (figure 3 per configuration, default 100), `--procs 1,2,4`,
//! `--load-secs S` (figure 6 per endpoint, default 5), `--capsules N` (figure 4, default
//! 10000), `--list-runs N` (figure 9, default 1000000), `--sweep-capsules N` (figure 10,
//! default 100000), `--relay-wakeups N` (figure 11, default 100000), `--only 0,1,3,5` (a subset; 0 is the machine's unit costs), `--out FILE` (also
//! write the markdown there).

use std::collections::BTreeSet;

use anyhow::{Context, bail};
use takosumi_bench::report::Report;
use takosumi_bench::{
    fig_http, fig_memory, fig_overhead, fig_queue, fig_relay, fig_scale, fig_seal, fig_sweep,
    fig_throughput, fig_units, machine,
};

struct Args {
    runs: usize,
    warmup: usize,
    pipeline_runs: usize,
    procs: Vec<usize>,
    load_secs: u64,
    capsules: usize,
    list_runs: usize,
    sweep_capsules: usize,
    relay_wakeups: usize,
    only: BTreeSet<u32>,
    out: Option<String>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        runs: 30,
        warmup: 2,
        pipeline_runs: 100,
        procs: vec![1, 2, 4],
        load_secs: 5,
        capsules: 10_000,
        list_runs: 1_000_000,
        sweep_capsules: 100_000,
        relay_wakeups: 100_000,
        only: (0..=11).collect(),
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--runs" => a.runs = value()?.parse()?,
            "--warmup" => a.warmup = value()?.parse()?,
            "--pipeline-runs" => a.pipeline_runs = value()?.parse()?,
            "--procs" => {
                a.procs = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--load-secs" => a.load_secs = value()?.parse()?,
            "--capsules" => a.capsules = value()?.parse()?,
            "--list-runs" => a.list_runs = value()?.parse()?,
            "--sweep-capsules" => a.sweep_capsules = value()?.parse()?,
            "--relay-wakeups" => a.relay_wakeups = value()?.parse()?,
            "--only" => {
                a.only = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--out" => a.out = Some(value()?),
            "-h" | "--help" => {
                println!(
                    "takosumi-bench [--runs N] [--warmup N] [--pipeline-runs N] [--procs 1,2,4] [--load-secs S] [--capsules N] [--list-runs N] [--sweep-capsules N] [--relay-wakeups N] [--only 1,2,…] [--out FILE]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown option {other}; see --help"),
        }
    }
    anyhow::ensure!(
        a.runs >= 1 && a.pipeline_runs >= 1,
        "counts must be at least 1"
    );
    Ok(a)
}

fn figure_number(figure: &str) -> u32 {
    figure
        .split('.')
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(99)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let started = std::time::Instant::now();
    let load_at_start = takosumi_bench::procfs::loadavg();
    let want = |n: u32| args.only.contains(&n);
    let mut report = Report::default();
    let step = |what: &str| eprintln!("bench: [{:>5.1} s] {what}", started.elapsed().as_secs_f64());

    if want(0) {
        step("unit costs of this machine (Postgres, RabbitMQ, S3, process start, git clone)");
        fig_units::run(&mut report).await?;
    }
    if want(5) {
        step("figure 5: seal/unseal vs openssl speed");
        fig_seal::run(&mut report)?;
    }
    if want(4) {
        step("figure 4: sweep enqueue stand-in");
        fig_sweep::run(&mut report, args.capsules, 1000).await?;
    }
    let mut idle = None;
    if want(1) || want(2) || want(8) {
        step("figures 1, 2 (and 8 idle): plan/apply overhead vs bare terraform");
        idle = Some(fig_overhead::run(&mut report, args.runs, args.warmup).await?);
    }
    let mut load = None;
    if want(3) {
        step("figure 3 (and 8 under load): pipeline throughput with the no-op tool");
        load = Some(fig_throughput::run(&mut report, &args.procs, args.pipeline_runs).await?);
    }
    if want(6) {
        step("figure 6: API under load");
        fig_http::run(&mut report, args.load_secs).await?;
    }
    if want(7) {
        step("figure 7: peak RSS of the step processes");
        fig_memory::run(&mut report).await?;
    }
    if want(9) {
        step("figure 9: the Run history page with many Runs in the table");
        fig_scale::list_page(&mut report, args.list_runs, args.load_secs).await?;
    }
    if want(10) {
        step("figure 10: one sweep pass over many due Capsules");
        fig_scale::sweep(&mut report, args.sweep_capsules).await?;
    }
    if want(11) {
        step("figure 11: the outbox relay publishing a sweep's wake-ups");
        fig_relay::run(&mut report, args.relay_wakeups).await?;
    }
    if want(8) {
        fig_queue::report(&mut report, idle.as_ref(), load.as_ref());
    }
    report.rows.sort_by_key(|r| figure_number(&r.figure));
    report
        .details
        .sort_by_key(|(title, _)| figure_number(title));

    let mut extra = vec![
        (
            "load average 1/5/15 min, at start → at end (anything else running shares the cores)"
                .to_owned(),
            format!("{load_at_start} → {}", takosumi_bench::procfs::loadavg()),
        ),
        (
            "bench duration".to_owned(),
            format!("{:.0} s", started.elapsed().as_secs_f64()),
        ),
    ];
    if let Ok(tf) = std::env::var("TAKOSUMI_TERRAFORM_BIN") {
        extra.push((
            "terraform".to_owned(),
            machine::first_line(&tf, &["version"]).unwrap_or_default(),
        ));
    }
    extra.push((
        "Postgres".to_owned(),
        postgres_server().await.unwrap_or_default(),
    ));
    extra.push((
        "RabbitMQ".to_owned(),
        rabbitmq_version().await.unwrap_or_default(),
    ));
    extra.push((
        "build".to_owned(),
        if cfg!(debug_assertions) {
            "debug (figures are not representative: use --release)".to_owned()
        } else {
            "release".to_owned()
        },
    ));
    let md = report.markdown(&machine::describe(&extra));
    println!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md)?;
    }
    Ok(())
}

/// The server's version, and whether a connection made as the figures' are (the same host,
/// the same `PGSSLMODE`/`PGSSL*` environment) speaks TLS: on loopback TLS is a measurable
/// share of each statement (session 43: figure 9 served 11 % more pages a second without it), so
/// runs that differ in it are not compared.
async fn postgres_server() -> anyhow::Result<String> {
    let url = std::env::var("TAKOSUMI_PG_ADMIN_URL")?;
    let pool = takosumi_store::connect(&url, 1).await?;
    let (version, tls): (String, bool) = sqlx::query_as(
        "SELECT current_setting('server_version'),
                COALESCE((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false)",
    )
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    let tls = if tls { "TLS" } else { "no TLS" };
    Ok(format!("{version}; connections: {tls}"))
}

async fn rabbitmq_version() -> anyhow::Result<String> {
    let mgmt = std::env::var("TAKOSUMI_RABBITMQ_MGMT_URL")?;
    let user = std::env::var("TAKOSUMI_RABBITMQ_MGMT_USER")?;
    let pass = std::env::var("TAKOSUMI_RABBITMQ_MGMT_PASSWORD")?;
    let v: serde_json::Value = reqwest::Client::new()
        .get(format!("{mgmt}/api/overview"))
        .basic_auth(user, Some(pass))
        .send()
        .await?
        .json()
        .await?;
    Ok(v["rabbitmq_version"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}
