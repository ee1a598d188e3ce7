//! Timeouts on every dependency: a dependency that is slow, busy or has stopped answering
//! fails the work that needs it with a retryable error within the configured time, instead
//! of hanging it, and the work completes once the dependency is back.
//!
//! - Postgres: every session carries `statement_timeout` and `lock_timeout`; a slow
//!   statement or a lock wait ends retryable (an API request answers 503), and a Postgres
//!   whose processes are paused (SIGSTOP) fails new work and work in flight within the
//!   acquire timeout plus the answer bound (`takosumi_store::Pool`: the statement timeout
//!   plus a margin, enforced by the client).
//!   The paused-server test runs its own Postgres cluster (`takosumi_tests::services`):
//!   pausing the shared one would stall every other test using it. It needs root.
//! - The object store: a server that accepts connections and never answers fails an
//!   operation within the attempt timeouts.
//! - The broker: while one caller connects to a broker that never answers, the others fail
//!   fast instead of waiting behind the connect.

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use takosumi_client::{NewCapsule, Source};
use takosumi_core::{RunMessage, RunStatus, Secret};
use takosumi_tests::probe::record;
use takosumi_tests::services::PrivatePostgres;
use takosumi_tests::{Endpoints, GitRepo, Options, Stack, Steps};
use tokio::time::Instant;

/// A TCP server that accepts connections and never says a word (a process that is up but
/// stuck, a half-open load balancer).
fn black_hole() -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    Ok((addr, task))
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

/// Every session of a pool starts with the configured `statement_timeout` and
/// `lock_timeout`: a statement that runs too long ends with 57014, a lock wait with 55P03,
/// both within their timeout and both retryable; an API request stuck behind a lock
/// answers 503 `unavailable` (try again), not a hang and not a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_sessions_carry_statement_and_lock_timeouts() -> anyhow::Result<()> {
    let stack = Stack::start_on(
        Options {
            steps: Steps::API_ONLY,
            ..Options::default()
        },
        &Endpoints {
            settings: vec![
                ("TAKOSUMI_PG_STATEMENT_TIMEOUT_MS".into(), "1500".into()),
                ("TAKOSUMI_PG_LOCK_TIMEOUT_MS".into(), "700".into()),
            ],
            ..Endpoints::default()
        },
    )
    .await?;
    let pool = &stack.ctx.pool;
    let shown: (String, String) = sqlx::query_as(
        "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!(shown, ("1500ms".to_owned(), "700ms".to_owned()));

    let t0 = Instant::now();
    let slow = sqlx::query("SELECT pg_sleep(10)")
        .execute(pool)
        .await
        .expect_err("a 10 s statement under a 1.5 s statement_timeout");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(sqlstate(&slow).as_deref(), Some("57014"), "{slow}");
    assert!(takosumi_store::StoreError::from(slow).retryable());

    let ws = stack.client.create_workspace("locked").await?.id;
    let mut holder = pool.begin().await?;
    sqlx::query("SELECT id FROM workspaces WHERE id = $1 FOR UPDATE")
        .bind(ws.as_uuid())
        .execute(holder.db())
        .await?;
    let t0 = Instant::now();
    let waited = sqlx::query("UPDATE workspaces SET name = name WHERE id = $1")
        .bind(ws.as_uuid())
        .execute(pool)
        .await
        .expect_err("a lock held longer than lock_timeout");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert_eq!(sqlstate(&waited).as_deref(), Some("55P03"), "{waited}");
    assert!(takosumi_store::StoreError::from(waited).retryable());

    // The API's own sessions carry it too: a settings change waits on the row lock, gives
    // up and says to try again.
    let t0 = Instant::now();
    let (s, b) = stack
        .call(
            "PATCH",
            &format!("/api/v1/workspaces/{ws}/settings"),
            json!({ "driftIntervalSecs": 3600 }),
        )
        .await?;
    assert_eq!((s, b["code"].as_str()), (503, Some("unavailable")), "{b}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    holder.rollback().await?;
    let (s, b) = stack
        .call(
            "PATCH",
            &format!("/api/v1/workspaces/{ws}/settings"),
            json!({ "driftIntervalSecs": 3600 }),
        )
        .await?;
    assert_eq!(
        s, 200,
        "once the lock is gone the same request succeeds: {b}"
    );
    record(
        "timeouts",
        "slow statement, lock wait, API request behind a lock: ended retryable in time",
        3,
    );
    stack.stop().await
}

/// Pauses (SIGSTOP) a private cluster's postmaster and every backend serving one database,
/// and resumes (SIGCONT) them when dropped — on a panic too, and from a watchdog thread if
/// the test stalls: a paused cluster must never outlive the test step that paused it.
struct Paused {
    pids: Vec<i32>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Paused {
    async fn database(admin: &takosumi_store::Pool, db: &str) -> anyhow::Result<Self> {
        let backends: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(db)
        .fetch_all(admin)
        .await?;
        anyhow::ensure!(!backends.is_empty(), "no backend serves {db}");
        // The postmaster first: no new backend (a reconnect) can start once it is paused.
        let postmaster = parent_of(backends[0])?;
        let mut pids = vec![postmaster];
        pids.extend(&backends);
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut paused = Self {
            pids: Vec::new(),
            done: done.clone(),
        };
        for pid in pids {
            signal("STOP", pid)?;
            paused.pids.push(pid);
        }
        let watchdog_pids = paused.pids.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while std::time::Instant::now() < deadline {
                if done.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            eprintln!("watchdog: resuming the paused Postgres processes");
            for pid in watchdog_pids.iter().rev() {
                let _ = signal("CONT", *pid);
            }
        });
        Ok(paused)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        for pid in self.pids.iter().rev() {
            if let Err(e) = signal("CONT", *pid) {
                eprintln!("could not resume {pid}: {e}");
            }
        }
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

fn signal(sig: &str, pid: i32) -> anyhow::Result<()> {
    let out = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "kill -{sig} {pid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn parent_of(pid: i32) -> anyhow::Result<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // pid (comm) state ppid …; comm may hold spaces, so read after the last ')'.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_default();
    Ok(after
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no ppid in /proc/{pid}/stat"))?
        .parse()?)
}

/// Postgres stops answering mid-step (its postmaster and every backend of the test's
/// database paused while a plan runs the tool): a statement already running fails, an API
/// request answers 503 `unavailable` and a handler call fails with a retryable error, each
/// within the acquire timeout plus the answer bound instead of hanging (the server enforces
/// no statement timeout while paused: the client's bound ends them); once Postgres resumes,
/// the Run that was mid-step completes and the same request succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_postgres_fails_work_fast_and_the_run_completes_after() -> anyhow::Result<()> {
    let pg = tokio::task::spawn_blocking(PrivatePostgres::start).await??;
    let acquire = Duration::from_secs(2);
    let statement = Duration::from_millis(1500);
    let stack = Stack::start_on(
        Options::default(),
        &Endpoints {
            pg_admin_url: Some(pg.admin_url()),
            settings: vec![
                (
                    "TAKOSUMI_PG_ACQUIRE_TIMEOUT_MS".into(),
                    acquire.as_millis().to_string(),
                ),
                (
                    "TAKOSUMI_PG_STATEMENT_TIMEOUT_MS".into(),
                    statement.as_millis().to_string(),
                ),
            ],
            ..Endpoints::default()
        },
    )
    .await?;
    let answer = stack
        .ctx
        .pool
        .answer_bound()
        .ok_or_else(|| anyhow::anyhow!("the pool has no answer bound"))?;
    assert_eq!(answer, statement + takosumi_store::ANSWER_MARGIN);
    // The longest any of the work below may take while Postgres is paused, with room for a
    // loaded machine.
    let bound = acquire + answer + Duration::from_millis(1500);
    let repo = GitRepo::with_example("network")?;
    let ws = stack.client.create_workspace("paused").await?.id;
    let capsule = stack
        .client
        .create_capsule(
            ws,
            &NewCapsule {
                name: "network".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra/network".into(),
                tool: "terraform".into(),
                vars: json!({ "region": "eu" })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
            },
        )
        .await?;
    stack.pause_plans(true)?;
    let run = stack.client.plan(capsule.id, None).await?.id;
    // Mid-step: the tool is running (held in its plan by the pause file).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stack.tool_invocations().iter().any(|l| l == "paused") {
        anyhow::ensure!(Instant::now() < deadline, "the plan never started the tool");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let get_run = || async {
        let resp = reqwest::Client::new()
            .get(format!("{}/api/v1/runs/{run}", stack.api_url))
            .bearer_auth(&stack.admin_token)
            .timeout(Duration::from_secs(30))
            .send()
            .await?;
        let status = resp.status().as_u16();
        anyhow::Ok((status, resp.json::<Value>().await.unwrap_or(Value::Null)))
    };
    assert_eq!(get_run().await?.0, 200);
    let admin = takosumi_store::connect(&pg.admin_url(), 1).await?;
    {
        // A statement at the server when it stops: the server will not end it (its own
        // statement timeout does not run while paused), the client's bound does.
        let pool = stack.ctx.pool.clone();
        let in_flight = tokio::spawn(async move {
            let t0 = Instant::now();
            let r = sqlx::query("SELECT pg_sleep(1.3)").execute(&pool).await;
            (r, t0.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        let _paused = Paused::database(&admin, &db).await?;
        let (r, took) = in_flight.await?;
        let err = r.expect_err("a statement in flight while Postgres is paused");
        assert!(
            matches!(&err, sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::TimedOut),
            "not the client's bound (did the pause come after the statement ended?): {err}"
        );
        assert!(takosumi_store::StoreError::from(err).retryable());
        assert!(
            took < bound,
            "the statement in flight failed after {took:?}"
        );

        let t0 = Instant::now();
        let (s, b) = get_run().await?;
        let took = t0.elapsed();
        assert_eq!(
            (s, b["code"].as_str()),
            (503, Some("unavailable")),
            "an API request while Postgres is paused: {b}"
        );
        assert!(
            took < bound,
            "the API answered after {took:?}, not within the acquire timeout and the answer bound"
        );

        let t0 = Instant::now();
        let handled = tokio::time::timeout(
            Duration::from_secs(30),
            takosumi_plan::handle(&stack.ctx, RunMessage { run_id: run }),
        )
        .await
        .map_err(|_| anyhow::anyhow!("a handler call hung on the paused Postgres"))?;
        let took = t0.elapsed();
        let err = handled.expect_err("a handler call while Postgres is paused");
        assert!(err.retryable(), "not retryable: {err}");
        assert!(
            took < bound,
            "the handler failed after {took:?}, not within the acquire timeout and the answer bound"
        );
    }
    // Resumed: the request succeeds and the Run that was mid-step completes.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, b) = get_run().await?;
        if s == 200 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the API did not recover: {s} {b}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stack.pause_plans(false)?;
    let done = stack.wait(run).await?;
    assert_eq!(done.status, RunStatus::Planned, "{done:?}");
    let plans = stack.tool_count_by_run("plan");
    assert_eq!(
        plans.get(&run.to_string()).copied(),
        Some(1),
        "planned once: {plans:?}"
    );
    record(
        "timeouts",
        "Postgres paused mid-step: statement in flight, API request and handler call failed in time, Run completed",
        3,
    );
    admin.close().await;
    stack.stop().await?;
    drop(pg);
    Ok(())
}

/// An object store that accepts connections and never answers fails an operation with a
/// transient error within its attempt timeouts (five attempts with backoff), never hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_object_store_fails_within_its_timeouts() -> anyhow::Result<()> {
    let (addr, server) = black_hole()?;
    let store = takosumi_objects::ObjectStore::connect(&takosumi_objects::ObjectStoreConfig {
        endpoint: Some(format!("http://{addr}")),
        region: "us-east-1".into(),
        access_key: "AKIDTEST".into(),
        secret_key: Secret::new("not-a-secret".to_owned()),
        bucket: "silent".into(),
        timeouts: takosumi_objects::ObjectTimeouts {
            connect: Duration::from_secs(1),
            attempt: Duration::from_millis(500),
            operation: Duration::from_secs(1),
        },
    })
    .await;
    let t0 = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(30), store.exists("runs/x"))
        .await
        .map_err(|_| anyhow::anyhow!("the object store call hung"))?
        .expect_err("a silent server");
    assert!(err.retryable(), "{err}");
    assert!(
        t0.elapsed() < Duration::from_secs(12),
        "{:?}: slower than five 0.5 s attempts with backoff",
        t0.elapsed()
    );
    server.abort();
    record("timeouts", "silent S3 server: operation failed in time", 1);
    Ok(())
}

/// While one caller connects to a broker that never answers, the others do not queue
/// behind that connect: they fail fast (transient, within the wait timeout), and the
/// connect itself gives up at the connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_callers_do_not_wait_behind_a_hanging_connect() -> anyhow::Result<()> {
    let (addr, server) = black_hole()?;
    let bus = std::sync::Arc::new(
        takosumi_queue::Bus::new(format!("amqp://guest:guest@{addr}/%2f"), "timeouts-test")
            .with_timeouts(Duration::from_secs(3), Duration::from_millis(300)),
    );
    let t0 = Instant::now();
    let first = {
        let bus = bus.clone();
        tokio::spawn(async move { bus.get().await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t1 = Instant::now();
    let second = bus.get().await.map(|_| ());
    let waited = t1.elapsed();
    let err = second.expect_err("the broker never answered");
    assert!(err.retryable(), "{err}");
    assert!(
        waited < Duration::from_millis(1500),
        "a second caller waited {waited:?} behind the connect"
    );
    let err = first.await?.expect_err("the broker never answered");
    assert!(err.retryable(), "{err}");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(2500) && took < Duration::from_secs(6),
        "the connect gave up after {took:?}, not at its 3 s timeout"
    );
    server.abort();
    record(
        "timeouts",
        "silent broker: callers failed fast behind a connect",
        1,
    );
    Ok(())
}

/// A transaction begun while Postgres is paused fails within its bound and leaves no
/// transaction open behind it. sqlx counts a transaction only once its `BEGIN` is answered,
/// so a begin cut short after sending it handed its connection back to the pool with the
/// server inside a transaction nobody would end: every later autocommit statement on that
/// connection stayed uncommitted, unseen by anyone else and holding its locks (a Run's row
/// lock, taken by each event, then stalled the Run's next step). Here the pool has one
/// connection, so the statement after the failed begin runs on the same one, and another
/// session must see what it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_cut_short_by_a_paused_postgres_leaves_no_transaction_open() -> anyhow::Result<()> {
    let pg = tokio::task::spawn_blocking(PrivatePostgres::start).await??;
    let admin = takosumi_store::connect(&pg.admin_url(), 1).await?;
    sqlx::query("CREATE DATABASE begun").execute(&admin).await?;
    let url = pg.admin_url().replace("/postgres", "/begun");
    let timeouts = takosumi_store::PgTimeouts {
        statement: Duration::from_millis(1000),
        lock: Duration::from_millis(1000),
        acquire: Duration::from_secs(2),
    };
    let pool = takosumi_store::connect_with(&url, "begun", 1, timeouts).await?;
    let other = takosumi_store::connect_with(&url, "other", 1, timeouts).await?;
    sqlx::query("CREATE TABLE written (n int)")
        .execute(&pool)
        .await?;
    let bound = pool
        .answer_bound()
        .ok_or_else(|| anyhow::anyhow!("the pool has no answer bound"))?;
    // The connection was just used, so the begin sends its BEGIN at once (no ping first).
    let begun = {
        let _paused = Paused::database(&admin, "begun").await?;
        let t0 = Instant::now();
        let begun = pool.begin().await;
        let took = t0.elapsed();
        assert!(
            took < timeouts.acquire + bound + Duration::from_millis(1500),
            "the begin failed after {took:?}"
        );
        begun
    };
    let err = begun.expect_err("a begin while Postgres is paused");
    assert!(
        takosumi_store::StoreError::from(err).retryable(),
        "not retryable"
    );
    // Resumed: the next statement on the pool's one connection is its own transaction.
    sqlx::query("INSERT INTO written VALUES (1)")
        .execute(&pool)
        .await?;
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM written")
        .fetch_one(&other)
        .await?;
    assert_eq!(
        seen, 1,
        "a statement after the failed begin was left in its transaction"
    );
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = 'begun' AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&admin)
    .await?;
    assert_eq!(open, 0, "a session of the pool is idle in a transaction");
    pool.close().await;
    other.close().await;
    admin.close().await;
    drop(pg);
    Ok(())
}
