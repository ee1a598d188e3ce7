//! The machine's unit costs, measured in the same run: what one Postgres round trip and
//! one committed write, one confirmed RabbitMQ publish, one S3 put and get, one process
//! start (the no-op tool, terraform) and one `git clone` of a one-file repository take
//! here. A Run is a sequence of these, so they are the reference the per-step timings of
//! figures 1–3 are read against (and the floor any orchestration figure has on this box).
//! Also what one write of a Run's row and of a Run event costs inside Postgres, without
//! the round trip and the commit: the constraints each write evaluates are in it. And how
//! long a message takes from its publish to a consumer, through a quorum queue (the steps')
//! and a classic one.

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
    for queue_type in ["quorum", "classic"] {
        rows.push((
            format!(
                "RabbitMQ publish → delivery to a consumer ({queue_type} queue, durable, persistent message; the steps' queues are quorum)"
            ),
            delivery_latency(&broker, queue_type).await?,
        ));
    }
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
    let (run_write, event_write) = server_write_costs(pool).await?;
    // What those writes re-read per statement (session 24: the CHECKs call functions).
    let check_bytes: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(length(conbin::text)), 0)::bigint FROM pg_constraint
          WHERE contype = 'c' AND conrelid IN ('runs'::regclass, 'run_events'::regclass)",
    )
    .fetch_one(pool)
    .await?;
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
    for (name, s) in [
        ("a Run's row (`UPDATE runs`)", run_write),
        ("a Run event (`INSERT INTO run_events`)", event_write),
    ] {
        lines.push(format!(
            "| Postgres server time of one write of {name}, without round trip or commit ({SERVER_WRITES} in one PL/pgSQL call, {SERVER_CALLS} calls; the CHECKs of `runs` and `run_events` are {check_bytes} bytes of stored expression) | {:.1} µs | {:.1} µs |",
            s.median, s.p95
        ));
    }
    report.detail(
        "0. unit costs on this machine (the references per-step timings are read against)",
        lines,
    );
    Ok(())
}

/// How long a wake-up takes from its publish to a consumer's delivery through a queue of
/// `queue_type` (declared for this, removed after): a quorum queue hands a message on only
/// once its log has it; a classic queue at once. Measured without waiting for the confirm,
/// as a step sees it.
async fn delivery_latency(
    broker: &takosumi_queue::Broker,
    queue_type: &str,
) -> anyhow::Result<Summary> {
    use futures::StreamExt as _;
    use lapin::options::{
        BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    let channel = broker.channel().await?;
    let queue = format!("bench.delivery.{queue_type}");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(queue_type.to_owned().into()),
    );
    channel
        .queue_declare(
            queue.clone().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await?;
    let mut consumer = channel
        .basic_consume(
            queue.clone().into(),
            format!("bench-{queue_type}").into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let publisher = broker.channel().await?;
    // The first trip warms the channel up and is not counted, as in `timed`.
    let mut samples = Vec::with_capacity(N);
    for i in 0..=N {
        let t = Instant::now();
        let _confirm = publisher
            .basic_publish(
                String::new().into(),
                queue.clone().into(),
                BasicPublishOptions::default(),
                b"{}",
                lapin::BasicProperties::default().with_delivery_mode(2),
            )
            .await?;
        let delivered = tokio::time::timeout(std::time::Duration::from_secs(5), consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the consumer ended"))??;
        anyhow::ensure!(delivered.data == b"{}");
        if i > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let summary = Summary::of(&samples).ok_or_else(|| anyhow::anyhow!("no samples"));
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await?;
    summary
}

const SERVER_WRITES: i32 = 5000;
const SERVER_CALLS: usize = 7;

/// Microseconds per write of a Run's row and of a Run event inside Postgres: `SERVER_WRITES`
/// of each in one function call, so neither the client's round trip nor a commit is in it,
/// only the statement's own work (its constraints, triggers, indexes).
async fn server_write_costs(pool: &takosumi_store::Pool) -> anyhow::Result<(Summary, Summary)> {
    let run = takosumi_tests::seed::one_queued_run(pool, "bench-units").await?;
    sqlx::query(
        r#"CREATE FUNCTION bench_server_writes(run uuid, n int) RETURNS float8[]
           LANGUAGE plpgsql AS $$
           DECLARE t0 timestamptz; t1 timestamptz; t2 timestamptz;
           BEGIN
               t0 := clock_timestamp();
               FOR i IN 1..n LOOP
                   UPDATE runs SET attempts = attempts + 1, hold_reason = NULL WHERE id = run;
               END LOOP;
               t1 := clock_timestamp();
               FOR i IN 1..n LOOP
                   INSERT INTO run_events (run_id, kind, actor, data)
                   VALUES (run, 'planned', 'bench', '{"k": 1}');
               END LOOP;
               t2 := clock_timestamp();
               RETURN ARRAY[extract(epoch FROM t1 - t0) * 1e6 / n,
                            extract(epoch FROM t2 - t1) * 1e6 / n];
           END $$"#,
    )
    .execute(pool)
    .await?;
    let (mut runs, mut events) = (Vec::new(), Vec::new());
    for _ in 0..SERVER_CALLS {
        let us: Vec<f64> = sqlx::query_scalar("SELECT bench_server_writes($1, $2)")
            .bind(run)
            .bind(SERVER_WRITES)
            .fetch_one(pool)
            .await?;
        runs.push(us[0]);
        events.push(us[1]);
    }
    let summary = |v: &[f64]| Summary::of(v).ok_or_else(|| anyhow::anyhow!("no samples"));
    Ok((summary(&runs)?, summary(&events)?))
}
