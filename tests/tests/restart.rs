//! Restart suite: RabbitMQ, the S3 server and Postgres restarted under running Runs.
//!
//! The test runs its own Postgres cluster, RabbitMQ node and s3s-fs server
//! (`takosumi_tests::services`): restarting the shared services `infra/local/start.sh`
//! runs would break every other test and developer using them at the same time. The
//! handlers, the relay and the reaper run in-process, exactly as the step binaries run
//! them (`run_worker`). Needs root, like `start.sh`.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use takosumi_client::{Capsule, NewCapsule, Source};
use takosumi_core::{RunId, RunStatus};
use takosumi_tests::probe::{self, record};
use takosumi_tests::services::{PrivatePostgres, PrivateRabbit, PrivateS3};
use takosumi_tests::{Endpoints, GitRepo, Options, Stack, Steps};
use tokio::time::Instant;

/// How long the S3 server stays down.
const S3_OUTAGE_SECS: u64 = 6;

async fn register(stack: &Stack, repo: &GitRepo, region: &str) -> anyhow::Result<Capsule> {
    let ws = stack
        .client
        .create_workspace(&format!(
            "ws-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?;
    let vars = json!({ "region": region })
        .as_object()
        .cloned()
        .unwrap_or_default();
    let req = NewCapsule {
        name: "network".into(),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: "infra/network".into(),
        tool: "terraform".into(),
        vars,
    };
    Ok(stack.client.create_capsule(ws.id, &req).await?)
}

/// Waits until every Run in `runs` has ended; reads Postgres directly and rides out its
/// own restart. Returns each Run's final status.
async fn settle_all(
    stack: &Stack,
    runs: &[RunId],
    secs: u64,
) -> anyhow::Result<HashMap<RunId, RunStatus>> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut done = HashMap::new();
    while done.len() < runs.len() {
        for id in runs {
            if done.contains_key(id) {
                continue;
            }
            if let Ok(Some(r)) = takosumi_store::runs::get(&stack.ctx.pool, *id).await
                && r.status.is_terminal()
            {
                done.insert(*id, r.status);
            }
        }
        if Instant::now() > deadline {
            // Say where each open Run stands, so a failure can be read without a rerun.
            let mut open = Vec::new();
            for id in runs.iter().filter(|r| !done.contains_key(r)) {
                let state: Option<(String, i32)> =
                    sqlx::query_as("SELECT status::text, attempts FROM runs WHERE id = $1")
                        .bind(id.as_uuid())
                        .fetch_optional(&stack.ctx.pool)
                        .await
                        .ok()
                        .flatten();
                let events: Vec<String> =
                    sqlx::query_scalar("SELECT kind FROM run_events WHERE run_id = $1 ORDER BY id")
                        .bind(id.as_uuid())
                        .fetch_all(&stack.ctx.pool)
                        .await
                        .unwrap_or_default();
                open.push(format!("{id} {state:?} events {events:?}"));
            }
            let outbox = takosumi_store::outbox::pending_count(&stack.ctx.pool)
                .await
                .ok();
            anyhow::bail!(
                "Runs still open {secs} s after recovery (outbox pending {outbox:?}): {open:#?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(done)
}

/// Waits until some Run is `planning` (a plan is in flight).
async fn until_planning(stack: &Stack) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let n: Result<i64, _> =
            sqlx::query_scalar("SELECT count(*) FROM runs WHERE status = 'planning'")
                .fetch_one(&stack.ctx.pool)
                .await;
        if n.is_ok_and(|n| n > 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}

/// What every restart test ends with, once every Run has ended: nothing lost (every
/// wake-up committed was published, the outbox is empty; nothing was dead-lettered; every
/// Run submitted is in the store) and nothing done twice (one `planned` / `applied` record
/// per Run, one gate decision per apply, one tool `apply` per apply Run, each Capsule's
/// generations an unbroken chain 1..`generations`).
async fn nothing_lost_or_done_twice(
    stack: &Stack,
    all_runs: &[RunId],
    caps: &[(Capsule, GitRepo)],
    generations: i64,
) -> anyhow::Result<()> {
    // Nothing lost: every wake-up committed was published; nothing dead-lettered.
    let deadline = Instant::now() + Duration::from_secs(20);
    let pending = loop {
        let n = takosumi_store::outbox::pending_count(&stack.ctx.pool).await?;
        if n == 0 || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(pending, 0, "outbox rows never published");
    // Dead letters: those the collector moved to Postgres, and any still in the broker.
    let uncollected = stack.uncollected_dead_letters().await?;
    let collected: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(
        (collected, uncollected),
        (0, 0),
        "dead-lettered during the restarts: {uncollected} uncollected"
    );

    // Nothing processed twice.
    let total_runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(usize::try_from(total_runs)?, all_runs.len());
    for (kind, event) in [("plan", "planned"), ("apply", "applied")] {
        let twice: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
            "SELECT r.id, count(e.id) FROM runs r LEFT JOIN run_events e ON e.run_id = r.id AND e.kind = $2 \
              WHERE r.kind::text = $1 GROUP BY r.id HAVING count(e.id) <> 1",
        )
        .bind(kind)
        .bind(event)
        .fetch_all(&stack.ctx.pool)
        .await?;
        assert!(
            twice.is_empty(),
            "{kind} Runs without exactly one `{event}`: {twice:?}"
        );
    }
    let gate_twice: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
        "SELECT r.id, count(e.id) FROM runs r LEFT JOIN run_events e ON e.run_id = r.id AND e.kind = 'gate_decision' \
          WHERE r.kind = 'apply' GROUP BY r.id HAVING count(e.id) <> 1",
    )
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert!(gate_twice.is_empty(), "gate decisions: {gate_twice:?}");
    let doubled: Vec<(String, usize)> = stack
        .tool_count_by_run("apply")
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(doubled.is_empty(), "applied twice: {doubled:?}");
    let apply_runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE kind = 'apply'")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(i64::try_from(stack.tool_count("apply"))?, apply_runs);
    for (c, _) in caps {
        let gens: Vec<i64> = sqlx::query_scalar(
            "SELECT generation FROM state_versions WHERE capsule_id = $1 ORDER BY generation",
        )
        .bind(c.id.as_uuid())
        .fetch_all(&stack.ctx.pool)
        .await?;
        let chain: Vec<i64> = (1..=i64::try_from(gens.len())?).collect();
        assert_eq!(gens, chain);
        let now = stack.client.get_capsule(c.id).await?;
        assert_eq!(now.state_generation, i64::try_from(gens.len())?);
        assert_eq!(
            now.state_generation, generations,
            "{}: {generations} applied revisions",
            c.id
        );
    }
    Ok(())
}

fn all_are(statuses: &HashMap<RunId, RunStatus>, want: RunStatus) -> Result<(), String> {
    let bad: Vec<String> = statuses
        .iter()
        .filter(|(_, s)| **s != want)
        .map(|(r, s)| format!("{r}: {}", s.as_str()))
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("expected {}: {bad:?}", want.as_str()))
    }
}

/// The promise: Runs in flight ride out a RabbitMQ restart, an S3 server crash and a
/// Postgres restart, one after the other. The handlers, relay and reaper reconnect with
/// backoff; every Run completes after recovery (plans `planned`, applies `applied`);
/// what was committed while the broker was down is published once it is back (the
/// outbox ends empty); nothing is processed twice (one tool apply and one StateVersion
/// per apply, one `planned`/`applied` record per Run, one gate decision per apply, an
/// unbroken generation chain per Capsule); nothing is dead-lettered.
///
/// Applies are in flight only across the broker restart: an apply caught by a storage or
/// database outage is, by design, not retried behind a person's back (it fails before
/// the tool with "submit again", or ends `unknown_outcome` after it), so the store and
/// database outages put plans in flight and the applies follow after recovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_complete_across_broker_store_and_database_restarts() -> anyhow::Result<()> {
    // TAKOSUMI_TEST_LOG=1 (with RUST_LOG) shows what the in-process handlers log.
    if std::env::var_os("TAKOSUMI_TEST_LOG").is_some() {
        takosumi_runtime::init_telemetry("restart-test");
    }
    let started = Instant::now();
    let (pg, rabbit, s3) = blocking(|| {
        Ok((
            PrivatePostgres::start()?,
            PrivateRabbit::start()?,
            PrivateS3::start()?,
        ))
    })
    .await?;
    let s3_endpoint = s3.endpoint();
    let s3 = std::sync::Arc::new(std::sync::Mutex::new(s3));
    let pg = std::sync::Arc::new(pg);
    let rabbit = std::sync::Arc::new(rabbit);
    let boot = started.elapsed();
    let stack = Stack::start_on(
        Options {
            steps: Steps::ALL,
            lease_secs: 5,
        },
        &Endpoints {
            pg_admin_url: Some(pg.admin_url()),
            amqp_url: Some(rabbit.amqp_url()),
            s3_endpoint: Some(s3_endpoint),
            settings: vec![("TAKOSUMI_STUCK_QUEUED_SECS".into(), "5".into())],
        },
    )
    .await?;
    let mut caps = Vec::new();
    for region in ["eu", "us", "ap"] {
        let repo = GitRepo::with_example("network")?;
        let capsule = register(&stack, &repo, region).await?;
        caps.push((capsule, repo));
    }
    let mut all_runs: Vec<RunId> = Vec::new();
    let mut restarts = 0;

    // Warm-up: one planned Run per Capsule.
    let mut planned = Vec::new();
    for (c, _) in &caps {
        planned.push(stack.client.plan(c.id, None).await?.id);
    }
    all_runs.extend(&planned);
    all_are(
        &settle_all(&stack, &planned, 120).await?,
        RunStatus::Planned,
    )
    .map_err(anyhow::Error::msg)?;

    // 1. RabbitMQ restarts with applies and plans in flight; more are submitted while it
    //    is down (their wake-ups wait in the outbox).
    let mut phase = Vec::new();
    phase.push(stack.client.apply(planned[0], None).await?.id);
    phase.push(stack.client.apply(planned[1], None).await?.id);
    phase.push(stack.client.plan(caps[2].0.id, None).await?.id);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let r = rabbit.clone();
    blocking(move || r.stop_app()).await?;
    phase.push(stack.client.apply(planned[2], None).await?.id);
    phase.push(stack.client.plan(caps[0].0.id, None).await?.id);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = rabbit.clone();
    blocking(move || r.start_app()).await?;
    restarts += 1;
    let statuses = settle_all(&stack, &phase, 120).await?;
    for (id, status) in &statuses {
        let want = if phase[..2].contains(id) || *id == phase[3] {
            RunStatus::Applied
        } else {
            RunStatus::Planned
        };
        assert_eq!(*status, want, "{id} after the broker restart");
    }
    all_runs.extend(&phase);

    // 2. The S3 server crashes (SIGKILL) with plans in flight, and comes back 2 s later.
    let mut phase = Vec::new();
    for (c, _) in &caps {
        phase.push(stack.client.plan(c.id, None).await?.id);
    }
    until_planning(&stack).await;
    {
        let s = s3.clone();
        blocking(move || s.lock().map_err(|_| anyhow::anyhow!("lock"))?.kill()).await?;
    }
    // Long enough that a plan meets the outage on several tries in a row: a transient
    // fault the handler hands back must never use up the Run's attempts.
    tokio::time::sleep(Duration::from_secs(S3_OUTAGE_SECS)).await;
    {
        let s = s3.clone();
        blocking(move || s.lock().map_err(|_| anyhow::anyhow!("lock"))?.start_again()).await?;
    }
    restarts += 1;
    all_are(&settle_all(&stack, &phase, 120).await?, RunStatus::Planned)
        .map_err(|e| anyhow::anyhow!("after the S3 crash: {e}"))?;
    all_runs.extend(&phase);
    let mut applies = Vec::new();
    for p in &phase {
        applies.push(stack.client.apply(*p, None).await?.id);
    }
    all_are(
        &settle_all(&stack, &applies, 120).await?,
        RunStatus::Applied,
    )
    .map_err(|e| anyhow::anyhow!("applies after the S3 crash: {e}"))?;
    all_runs.extend(&applies);

    // 3. Postgres restarts (fast shutdown: every session is cut) with plans in flight.
    let mut phase = Vec::new();
    for (c, repo) in &caps {
        repo.commit(
            &[(
                "infra/network/main.tf",
                "variable \"region\" {\n  type = string\n}\n\noutput \"vpc\" {\n  value = \"vpc2-${var.region}\"\n}\n",
            )],
            "second revision",
        )?;
        phase.push(stack.client.plan(c.id, None).await?.id);
    }
    until_planning(&stack).await;
    let p = pg.clone();
    blocking(move || p.stop()).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let p = pg.clone();
    blocking(move || p.start_again()).await?;
    restarts += 1;
    all_are(&settle_all(&stack, &phase, 150).await?, RunStatus::Planned)
        .map_err(|e| anyhow::anyhow!("after the Postgres restart: {e}"))?;
    all_runs.extend(&phase);
    let mut applies = Vec::new();
    for p in &phase {
        applies.push(stack.client.apply(*p, None).await?.id);
    }
    all_are(
        &settle_all(&stack, &applies, 120).await?,
        RunStatus::Applied,
    )
    .map_err(|e| anyhow::anyhow!("applies after the Postgres restart: {e}"))?;
    all_runs.extend(&applies);

    nothing_lost_or_done_twice(&stack, &all_runs, &caps, 2).await?;
    let plan_runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE kind = 'plan'")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let retried = i64::try_from(stack.tool_count("plan"))? - plan_runs;
    probe::say(&format!(
        "restart suite: {} Runs across {restarts} restarts (RabbitMQ, S3, Postgres), plan retries {retried}, services up in {:.1} s, total {:.0} s",
        all_runs.len(),
        boot.as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
    record("restart", "service restarts survived", restarts);
    record("restart", "runs through restarts", all_runs.len());
    record("restart", "runs lost", 0);
    stack.stop().await?;
    drop(s3);
    Ok(())
}

/// Waits until one of `runs` is provably mid-step: its status is `status` (a handler
/// holds its lease) and, with `tool`, the tool has started that command for it. Returns it.
async fn until_mid_step(
    stack: &Stack,
    runs: &[RunId],
    status: &str,
    tool: Option<&str>,
) -> anyhow::Result<RunId> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let started = tool.map(|t| stack.tool_count_by_run(t));
        for id in runs {
            let now: Option<String> =
                sqlx::query_scalar("SELECT status::text FROM runs WHERE id = $1")
                    .bind(id.as_uuid())
                    .fetch_optional(&stack.ctx.pool)
                    .await?;
            let tool_ok = started
                .as_ref()
                .is_none_or(|s| s.contains_key(&id.to_string()));
            if now.as_deref() == Some(status) && tool_ok {
                return Ok(*id);
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "none of {runs:?} was ever {status} (tool {tool:?} started)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The promise under hard crashes: RabbitMQ's node SIGKILLed with applies mid-step, and
/// Postgres SIGKILLed (the postmaster and every backend) with plans mid-step — the tool
/// running for them — lose nothing and do nothing twice. Submissions accepted while the
/// broker is dead wait in the outbox; after each recovery (the node's queues from their
/// logs, the cluster from its WAL) every Run completes (plans `planned`, applies
/// `applied`), the outbox ends empty, nothing is dead-lettered, and each apply ran the
/// tool once with one StateVersion and one `applied` record.
///
/// As in the graceful test, applies are mid-step only across the broker crash: one caught
/// by a database crash is, by design, never retried behind a person's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_complete_across_hard_crashes_of_the_broker_and_the_database() -> anyhow::Result<()> {
    let started = Instant::now();
    let (pg, rabbit) =
        blocking(|| Ok((PrivatePostgres::start()?, PrivateRabbit::start()?))).await?;
    let pg = std::sync::Arc::new(pg);
    let rabbit = std::sync::Arc::new(rabbit);
    let stack = Stack::start_on(
        Options {
            steps: Steps::ALL,
            lease_secs: 5,
        },
        &Endpoints {
            pg_admin_url: Some(pg.admin_url()),
            amqp_url: Some(rabbit.amqp_url()),
            // The shared S3 server: only Postgres and RabbitMQ are crashed here.
            s3_endpoint: None,
            settings: vec![("TAKOSUMI_STUCK_QUEUED_SECS".into(), "5".into())],
        },
    )
    .await?;
    let mut caps = Vec::new();
    for region in ["eu", "us", "ap"] {
        let repo = GitRepo::with_example("network")?;
        let capsule = register(&stack, &repo, region).await?;
        caps.push((capsule, repo));
    }
    let mut all_runs: Vec<RunId> = Vec::new();
    let mut planned = Vec::new();
    for (c, _) in &caps {
        planned.push(stack.client.plan(c.id, None).await?.id);
    }
    all_runs.extend(&planned);
    all_are(
        &settle_all(&stack, &planned, 120).await?,
        RunStatus::Planned,
    )
    .map_err(anyhow::Error::msg)?;

    // 1. RabbitMQ's node is SIGKILLed while an apply is applying; more is submitted while
    //    it is dead, and waits in the outbox.
    let mut phase = vec![
        stack.client.apply(planned[0], None).await?.id,
        stack.client.apply(planned[1], None).await?.id,
        stack.client.plan(caps[2].0.id, None).await?.id,
    ];
    let mid_apply = until_mid_step(&stack, &phase[..2], "applying", None).await?;
    let r = rabbit.clone();
    let beam = blocking(move || r.kill_node()).await?;
    phase.push(stack.client.apply(planned[2], None).await?.id);
    phase.push(stack.client.plan(caps[0].0.id, None).await?.id);
    let waiting = takosumi_store::outbox::pending_count(&stack.ctx.pool).await?;
    assert!(
        waiting > 0,
        "what was submitted while the broker was dead is not waiting in the outbox"
    );
    let r = rabbit.clone();
    blocking(move || r.start_node_again()).await?;
    let statuses = settle_all(&stack, &phase, 150).await?;
    for (id, status) in &statuses {
        let want = if phase[..2].contains(id) || *id == phase[3] {
            RunStatus::Applied
        } else {
            RunStatus::Planned
        };
        assert_eq!(*status, want, "{id} after the broker was killed");
    }
    all_runs.extend(&phase);

    // 2. Postgres is SIGKILLed (postmaster and backends) while plans run the tool.
    let mut phase = Vec::new();
    for (c, repo) in &caps {
        repo.commit(
            &[(
                "infra/network/main.tf",
                "variable \"region\" {\n  type = string\n}\n\noutput \"vpc\" {\n  value = \"vpc2-${var.region}\"\n}\n",
            )],
            "second revision",
        )?;
        phase.push(stack.client.plan(c.id, None).await?.id);
    }
    let mid_plan = until_mid_step(&stack, &phase, "planning", Some("plan")).await?;
    let p = pg.clone();
    let killed = blocking(move || p.kill_hard()).await?;
    let p = pg.clone();
    blocking(move || p.start_again()).await?;
    all_are(&settle_all(&stack, &phase, 150).await?, RunStatus::Planned)
        .map_err(|e| anyhow::anyhow!("after Postgres was killed: {e}"))?;
    all_runs.extend(&phase);
    let mut applies = Vec::new();
    for p in &phase {
        applies.push(stack.client.apply(*p, None).await?.id);
    }
    all_are(
        &settle_all(&stack, &applies, 120).await?,
        RunStatus::Applied,
    )
    .map_err(|e| anyhow::anyhow!("applies after Postgres was killed: {e}"))?;
    all_runs.extend(&applies);

    nothing_lost_or_done_twice(&stack, &all_runs, &caps, 2).await?;
    // The Runs caught mid-step were handled once: one claim of the apply that was
    // applying; the plan that was running its tool planned (again, after its lease ran out).
    let claims: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'claimed'",
    )
    .bind(mid_apply.as_uuid())
    .fetch_one(&stack.ctx.pool)
    .await?;
    assert_eq!(
        claims, 1,
        "{mid_apply} was claimed again after the broker crash"
    );
    probe::say(&format!(
        "hard crashes: {} Runs; RabbitMQ node (beam.smp {beam}) SIGKILLed with {mid_apply} applying, {waiting} wake-ups waiting in the outbox; Postgres SIGKILLed ({} processes) with {mid_plan} running the tool's plan; {:.0} s",
        all_runs.len(),
        killed.len(),
        started.elapsed().as_secs_f64()
    ));
    record(
        "restart",
        "hard crashes survived (SIGKILL of RabbitMQ's node, of Postgres)",
        2,
    );
    record("restart", "runs through hard crashes", all_runs.len());
    record("restart", "Postgres processes SIGKILLed", killed.len());
    stack.stop().await
}
