//! The machine's unit costs, measured in the same run: what one Postgres round trip and
//! one committed write, one confirmed RabbitMQ publish, one S3 put and get, one process
//! start (the no-op tool, terraform) and one `git clone` of a one-file repository take
//! here. A Run is a sequence of these, so they are the reference the per-step timings of
//! figures 1–3 are read against (and the floor any orchestration figure has on this box).

use std::time::Instant;

use takosumi_tests::{GitRepo, Options, Stack, Steps};

use crate::harness;
use crate::report::Report;
use crate::stats::Summary;

const N: usize = 30;

async fn timed<F, Fut>(mut f: F) -> anyhow::Result<Summary>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    f(usize::MAX).await?;
    let mut v = Vec::with_capacity(N);
    for i in 0..N {
        let t = Instant::now();
        f(i).await?;
        v.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    Summary::of(&v).ok_or_else(|| anyhow::anyhow!("no samples"))
}

/// Adds the unit-cost table.
pub async fn run(report: &mut Report) -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: false,
            plan: false,
            gate: false,
            apply: false,
        },
        lease_secs: 60,
    })
    .await?;
    let result = measure(&stack, report).await;
    stack.stop().await?;
    result
}

async fn measure(stack: &Stack, report: &mut Report) -> anyhow::Result<()> {
    let pool = &stack.ctx.pool;
    let mut rows: Vec<(String, Summary)> = Vec::new();
    rows.push((
        "Postgres `SELECT 1` round trip".into(),
        timed(|_| async {
            sqlx::query("SELECT 1").execute(pool).await?;
            Ok(())
        })
        .await?,
    ));
    sqlx::query("CREATE TABLE bench_commit (id bigserial PRIMARY KEY, data jsonb NOT NULL)")
        .execute(pool)
        .await?;
    rows.push((
        "Postgres one-row INSERT, autocommit (a Run event is one)".into(),
        timed(|_| async {
            sqlx::query("INSERT INTO bench_commit (data) VALUES ('{\"k\":1}')")
                .execute(pool)
                .await?;
            Ok(())
        })
        .await?,
    ));
    let broker = stack.ctx.bus.get().await?;
    rows.push((
        "RabbitMQ publish with confirm (quorum queue `run.drift`)".into(),
        timed(|_| {
            let broker = broker.clone();
            async move {
                broker
                    .publish("run.drift", b"{}", None, Default::default())
                    .await?;
                Ok(())
            }
        })
        .await?,
    ));
    let objects = &stack.ctx.objects;
    let body = vec![7u8; 1024];
    rows.push((
        "S3 (s3s-fs) PUT 1 KiB".into(),
        timed(|i| {
            let body = body.clone();
            async move {
                objects.put(&format!("bench/unit-{i}"), body).await?;
                Ok(())
            }
        })
        .await?,
    ));
    rows.push((
        "S3 (s3s-fs) GET 1 KiB".into(),
        timed(|_| async {
            objects.get("bench/unit-0", 1 << 20).await?;
            Ok(())
        })
        .await?,
    ));
    let noop = harness::sibling("noop-terraform")?;
    rows.push((
        "process start: `noop-terraform version -json`".into(),
        timed(|_| {
            let noop = noop.clone();
            async move {
                let out = tokio::process::Command::new(noop)
                    .args(["version", "-json"])
                    .output()
                    .await?;
                anyhow::ensure!(out.status.success());
                Ok(())
            }
        })
        .await?,
    ));
    if let Ok(tf) = std::env::var("TAKOSUMI_TERRAFORM_BIN") {
        rows.push((
            "process start: `terraform version -json` (1.0.3, 78 MB static binary)".into(),
            timed(|_| {
                let tf = tf.clone();
                async move {
                    let home = tempfile::tempdir()?;
                    let out = tokio::process::Command::new(tf)
                        .env_clear()
                        .env("HOME", home.path())
                        .env("CHECKPOINT_DISABLE", "1")
                        .args(["version", "-json"])
                        .output()
                        .await?;
                    anyhow::ensure!(out.status.success());
                    Ok(())
                }
            })
            .await?,
        ));
    }
    let repo = GitRepo::with_example("network")?;
    let into = tempfile::tempdir()?;
    let url = repo.url();
    rows.push((
        "`git clone --no-hardlinks` of the one-file example repository (file://)".into(),
        timed(|i| {
            let (url, dest) = (url.clone(), into.path().join(format!("c{i}")));
            async move {
                let out = tokio::process::Command::new("git")
                    .args([
                        "clone",
                        "--quiet",
                        "--no-hardlinks",
                        "--branch",
                        "main",
                        "--",
                    ])
                    .arg(&url)
                    .arg(&dest)
                    .output()
                    .await?;
                anyhow::ensure!(out.status.success());
                Ok(())
            }
        })
        .await?,
    ));
    let mut lines = vec![
        format!(
            "Each measured {N} times, one at a time, on the same machine and in the same run as the figures."
        ),
        String::new(),
        "| operation | median | p95 |".to_owned(),
        "|---|---|---|".to_owned(),
    ];
    for (name, s) in rows {
        lines.push(format!("| {name} | {:.2} ms | {:.2} ms |", s.median, s.p95));
    }
    report.detail(
        "0. unit costs on this machine (the references per-step timings are read against)",
        lines,
    );
    Ok(())
}
