//! Fault suite: handler processes killed at random moments, graceful shutdown, and poison
//! messages, against the real API, RabbitMQ, Postgres, the S3 server and terraform 1.0.3.
//!
//! The kill test runs a short profile by default (about 20 Runs) and the long one (at
//! least 100 Runs) with `TAKOSUMI_FAULTS_LONG=1`; `TAKOSUMI_FAULTS_SEED=<n>` replays a
//! run's random choices (the seed is printed).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use takosumi_client::Capsule;
use takosumi_core::{RunId, RunMessage, RunStatus, Topic};
use takosumi_tests::probe::{self, record};
use takosumi_tests::{GitRepo, Options, Stack, Steps, processes_exactly};
use tokio::process::Child;
use tokio::time::Instant;

/// A small deterministic PRNG (xorshift64*): the seed is printed so a failing run can be
/// replayed with `TAKOSUMI_FAULTS_SEED`.
struct Rng(u64);

impl Rng {
    fn from_env() -> Self {
        let seed = std::env::var("TAKOSUMI_FAULTS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(7, |d| d.as_nanos() as u64)
            })
            | 1;
        record("faults", "seed (TAKOSUMI_FAULTS_SEED)", seed);
        Self(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

fn long_profile() -> bool {
    std::env::var("TAKOSUMI_FAULTS_LONG").is_ok_and(|v| v == "1")
}

async fn register(stack: &Stack, repo: &GitRepo, vars: Value) -> anyhow::Result<Capsule> {
    stack
        .new_capsule(repo, "network", "infra/network", vars)
        .await
}

/// The network example with one more output, so every round's apply writes a new state.
fn network_revision(round: usize) -> String {
    format!(
        "variable \"region\" {{\n  type = string\n}}\n\noutput \"vpc\" {{\n  value = \"vpc-${{var.region}}\"\n}}\n\noutput \"round\" {{\n  value = \"{round}\"\n}}\n"
    )
}

/// Waits for a Run to end (terminal); after `secs`, returns what it is then.
async fn settle(stack: &Stack, run: RunId, secs: u64) -> RunStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Ok(Some(r)) = takosumi_store::runs::get(&stack.ctx.pool, run).await {
            if r.status.is_terminal() || Instant::now() > deadline {
                return r.status;
            }
        } else if Instant::now() > deadline {
            return RunStatus::Queued;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One Capsule's workload: per round a new revision, a plan, its apply (when planned),
/// and every third round an extra plan that is never applied.
async fn workload(stack: &Stack, capsule: &Capsule, repo: &GitRepo, rounds: usize) -> usize {
    let mut submitted = 0;
    for round in 0..rounds {
        if repo
            .commit(
                &[("infra/network/main.tf", &network_revision(round))],
                "revision",
            )
            .is_err()
        {
            continue;
        }
        let Ok(plan) = stack.client.plan(capsule.id, None).await else {
            continue;
        };
        submitted += 1;
        if round % 3 == 2
            && let Ok(extra) = stack.client.plan(capsule.id, None).await
        {
            submitted += 1;
            let _ = extra;
        }
        if settle(stack, plan.id, 150).await != RunStatus::Planned {
            continue;
        }
        if let Ok(apply) = stack.client.apply(plan.id, None).await {
            submitted += 1;
            // An apply whose process vanished keeps the Capsule from other applies until
            // an operator resolves it; do what the operator would, so later rounds apply.
            if settle(stack, apply.id, 150).await == RunStatus::UnknownOutcome {
                let _ = stack
                    .client
                    .resolve(apply.id, "kill suite: the handler was killed on purpose")
                    .await;
            }
        }
    }
    submitted
}

const KINDS: [&str; 3] = ["plan", "gate", "apply"];

fn spawn(stack: &Stack, kind: &str) -> anyhow::Result<Child> {
    // The processes' own reapers re-send a lost wake-up after 4 s (a handler killed
    // between its ack and its claim), instead of the fixture's 20 s.
    stack.spawn_process_with(
        kind,
        &[("TAKOSUMI_STUCK_QUEUED_SECS", "4"), ("RUST_LOG", "error")],
    )
}

/// Applies held by the apply process `pid` right now.
async fn applying_of(stack: &Stack, pid: u32) -> anyhow::Result<Vec<uuid::Uuid>> {
    Ok(
        sqlx::query_scalar("SELECT id FROM runs WHERE status = 'applying' AND lease_owner LIKE $1")
            .bind(format!("apply-{pid}-%"))
            .fetch_all(&stack.ctx.pool)
            .await?,
    )
}

/// Kills handler processes (SIGKILL) at random moments until `done` (or `max_kills`),
/// restarting each at once; some kills are aimed just after the tool's `apply` or `show`
/// started, where the tool finishing and the commit fall. Returns kills per kind and the applies whose
/// process vanished while they were `applying`.
async fn kill_loop(
    stack: &Stack,
    procs: &mut HashMap<&'static str, Child>,
    rng: &mut Rng,
    done: &AtomicBool,
    max_kills: usize,
) -> anyhow::Result<(BTreeMap<&'static str, usize>, HashSet<uuid::Uuid>)> {
    let mut kills: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut vanished = HashSet::new();
    while !done.load(Ordering::SeqCst) && kills.values().sum::<usize>() < max_kills {
        tokio::time::sleep(rng.millis(300, 2200)).await;
        if done.load(Ordering::SeqCst) {
            break;
        }
        let kind = match rng.below(10) {
            0..=3 => "plan",
            4..=5 => "gate",
            _ => "apply",
        };
        if rng.below(2) == 0 && kind != "gate" {
            // Aim: wait for the tool's next `apply` (or a plan's `show`), then a short delay.
            let cmd = if kind == "apply" { "apply" } else { "show" };
            let before = stack.tool_count(cmd);
            let deadline = Instant::now() + Duration::from_secs(6);
            while stack.tool_count(cmd) == before && Instant::now() < deadline {
                if done.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            tokio::time::sleep(rng.millis(0, 900)).await;
        }
        let child = procs.get_mut(kind).expect("every kind runs");
        let Some(pid) = child.id() else { continue };
        child.start_kill()?; // SIGKILL
        child.wait().await?;
        *kills.entry(kind).or_default() += 1;
        if kind == "apply" {
            vanished.extend(applying_of(stack, pid).await?);
        }
        tokio::time::sleep(rng.millis(0, 600)).await;
        procs.insert(kind, spawn(stack, kind)?);
    }
    Ok((kills, vanished))
}

/// The promise: handler processes SIGKILLed at random moments (mid-plan, mid-gate,
/// mid-apply, and just after the tool's apply, where the tool finishing and the commit
/// fall) lose no Run and apply nothing twice. Every Run ends terminal; no apply Run has
/// more than one StateVersion or more than one tool `apply`; each Capsule's generations
/// form an unbroken chain 1..n ending at its current StateVersion; an apply whose process
/// vanished while applying ends `unknown_outcome` and is never applied again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_handlers_lose_no_run_and_apply_nothing_twice() -> anyhow::Result<()> {
    let (capsules, rounds, max_kills) = if long_profile() {
        (6, 8, usize::MAX)
    } else {
        (3, 3, 10)
    };
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: true,
            plan: false,
            gate: false,
            apply: false,
        },
        lease_secs: 2,
    })
    .await?;
    let mut rng = Rng::from_env();
    let mut procs: HashMap<&'static str, Child> = HashMap::new();
    for kind in KINDS {
        procs.insert(kind, spawn(&stack, kind)?);
    }
    let mut caps = Vec::new();
    for i in 0..capsules {
        let repo = GitRepo::with_example("network")?;
        let capsule = register(&stack, &repo, json!({ "region": format!("r{i}") })).await?;
        caps.push((capsule, repo));
    }
    let started = Instant::now();
    let done = AtomicBool::new(false);
    let work = async {
        let submitted: usize = futures::future::join_all(
            caps.iter()
                .map(|(capsule, repo)| workload(&stack, capsule, repo, rounds)),
        )
        .await
        .into_iter()
        .sum();
        done.store(true, Ordering::SeqCst);
        submitted
    };
    let (submitted, killed) = tokio::join!(
        work,
        kill_loop(&stack, &mut procs, &mut rng, &done, max_kills)
    );
    let (kills, vanished) = killed?;

    // Let every Run end: leases expire (2 s), lost wake-ups are re-sent (4 s).
    let deadline = Instant::now() + Duration::from_secs(120);
    let open = loop {
        let open: Vec<(uuid::Uuid, String)> = sqlx::query_as(
            "SELECT id, status::text FROM runs WHERE status NOT IN ('planned', 'applied', 'failed', 'canceled', 'unknown_outcome')",
        )
        .fetch_all(&stack.ctx.pool)
        .await?;
        if open.is_empty() || Instant::now() > deadline {
            break open;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // Time for anything that would wrongly apply again (a re-queued apply) to show.
    tokio::time::sleep(Duration::from_secs(4)).await;

    let runs: Vec<(uuid::Uuid, String, String)> =
        sqlx::query_as("SELECT id, kind::text, status::text FROM runs")
            .fetch_all(&stack.ctx.pool)
            .await?;
    let apply_runs: Vec<&(uuid::Uuid, String, String)> =
        runs.iter().filter(|r| r.1 == "apply").collect();
    let by_run = stack.tool_count_by_run("apply");
    let tool_applies = stack.tool_count("apply");
    let run_text = |id: &uuid::Uuid| RunId::from_uuid(*id).to_string();
    let doubled: Vec<String> = by_run
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(r, n)| format!("{r}: {n} tool applies"))
        .collect();
    let sv_doubled: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
        "SELECT run_id, count(*) FROM state_versions GROUP BY run_id HAVING count(*) > 1",
    )
    .fetch_all(&stack.ctx.pool)
    .await?;
    let double_applies = doubled.len() + sv_doubled.len();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for r in &runs {
        *statuses.entry(format!("{}:{}", r.1, r.2)).or_default() += 1;
    }
    let total_kills: usize = kills.values().sum();
    probe::say(&format!(
        "kill suite: runs {} (submitted {submitted}), kills {total_kills} {kills:?}, lost {}, double applies {double_applies}, vanished mid-apply {}, tool applies {tool_applies}, {:.0} s; {statuses:?}",
        runs.len(),
        open.len(),
        vanished.len(),
        started.elapsed().as_secs_f64()
    ));
    record("faults", "kill: runs", runs.len());
    record("faults", "kill: SIGKILLs survived", total_kills);
    record("faults", "kill: runs lost", open.len());
    record("faults", "kill: double applies", double_applies);

    assert!(open.is_empty(), "Runs never ended: {open:?}");
    assert!(doubled.is_empty(), "applied twice: {doubled:?}");
    assert!(
        sv_doubled.is_empty(),
        "two StateVersions for one apply: {sv_doubled:?}"
    );
    assert!(
        tool_applies <= apply_runs.len(),
        "{tool_applies} tool applies for {} apply Runs",
        apply_runs.len()
    );
    // Every Run of the workload was recorded (none vanished without a row).
    assert_eq!(
        runs.len(),
        submitted,
        "submitted Runs missing from the store"
    );
    // Each Capsule's generations: an unbroken chain 1..n, at its current StateVersion.
    for (capsule, _) in &caps {
        let svs: Vec<(uuid::Uuid, i64, uuid::Uuid)> = sqlx::query_as(
            "SELECT id, generation, run_id FROM state_versions WHERE capsule_id = $1 ORDER BY generation",
        )
        .bind(capsule.id.as_uuid())
        .fetch_all(&stack.ctx.pool)
        .await?;
        let gens: Vec<i64> = svs.iter().map(|s| s.1).collect();
        let chain: Vec<i64> = (1..=i64::try_from(svs.len())?).collect();
        assert_eq!(gens, chain, "{}: generations are not 1..n", capsule.id);
        let now = stack.client.get_capsule(capsule.id).await?;
        assert_eq!(now.state_generation, i64::try_from(svs.len())?);
        assert_eq!(
            now.current_state_version_id.map(|s| s.as_uuid()),
            svs.last().map(|s| s.0),
            "{}: current StateVersion is not the newest generation",
            capsule.id
        );
        for (_, _, run_id) in &svs {
            let st: String = sqlx::query_scalar("SELECT status::text FROM runs WHERE id = $1")
                .bind(run_id)
                .fetch_one(&stack.ctx.pool)
                .await?;
            assert!(
                ["applied", "failed", "canceled"].contains(&st.as_str()),
                "a StateVersion was written by a Run that is {st}"
            );
        }
    }
    // An apply whose process vanished mid-apply is unknown_outcome and was not re-applied.
    for id in &vanished {
        let (status, attempts): (String, i32) =
            sqlx::query_as("SELECT status::text, attempts FROM runs WHERE id = $1")
                .bind(id)
                .fetch_one(&stack.ctx.pool)
                .await?;
        assert_eq!(status, "unknown_outcome", "{}", run_text(id));
        assert_eq!(attempts, 1, "{} was claimed again", run_text(id));
        assert!(by_run.get(&run_text(id)).copied().unwrap_or(0) <= 1);
    }
    for (kind, mut child) in procs {
        child.start_kill()?;
        child.wait().await?;
        let _ = kind;
    }
    stack.stop().await
}

/// The promise: SIGTERM makes a step process stop consuming at once, finish the Run it
/// holds, and exit 0. The in-flight plan ends `planned` (claimed once); a plan submitted
/// after the signal is not taken by the stopping process and waits, queued, for the next
/// one, which plans it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_finishes_the_run_in_flight_and_exits_cleanly() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: true,
            plan: false,
            gate: true,
            apply: true,
        },
        lease_secs: 30,
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, json!({ "region": "eu" })).await?;
    stack.pause_plans(true)?;
    let mut handler = stack.spawn_process("plan")?;
    let first = stack.client.plan(capsule.id, None).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stack.tool_invocations().iter().any(|l| l == "paused") {
        assert!(Instant::now() < deadline, "the plan never started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = handler.id().expect("running");
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .stderr(Stdio::null())
        .status()?;
    assert!(term.success());
    // The stopping process takes nothing new.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let second = stack.client.plan(capsule.id, None).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        stack.client.get_run(second.id).await?.status,
        RunStatus::Queued,
        "a process told to stop took new work"
    );
    assert!(
        handler.try_wait()?.is_none(),
        "it must not exit while it holds a Run"
    );
    stack.pause_plans(false)?;
    let status = tokio::time::timeout(Duration::from_secs(90), handler.wait()).await??;
    assert_eq!(status.code(), Some(0), "{status:?}");
    let first = stack.wait(first.id).await?;
    assert_eq!(first.status, RunStatus::Planned, "{first:?}");
    assert_eq!(first.extra.get("attempts"), Some(&json!(1)));
    assert_eq!(
        stack.client.get_run(second.id).await?.status,
        RunStatus::Queued
    );
    let _next = stack.spawn_process("plan")?;
    let second = stack.wait(second.id).await?;
    assert_eq!(second.status, RunStatus::Planned, "{second:?}");
    record("faults", "graceful SIGTERMs survived", 1);
    stack.stop().await
}

/// The promise: a message no step can process is never silently dropped. A body that is
/// not JSON, JSON that is not a Run message, and a message naming a Run that does not
/// exist each land in `run.plan.dead`, with the reason where a step gave one, and
/// operators see them through `GET /api/v1/dead-letters` and `takosumi dead-letters`
/// (collected from the broker into Postgres, so looking is read-only and never takes a
/// message and hands it back); looking does not remove them, and only admins may look.
/// Nothing else changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_messages_are_dead_lettered_and_visible() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let before = probe::row_counts(&stack.ctx.pool).await?;
    let broker = stack.ctx.bus.get().await?;
    let ghost = RunId::new();
    let poison: Vec<Vec<u8>> = vec![
        b"this is not json {".to_vec(),
        br#"{"hello": "world"}"#.to_vec(),
        serde_json::to_vec(&RunMessage { run_id: ghost }.to_json())?,
    ];
    for body in &poison {
        broker
            .publish(Topic::Plan.queue_name(), body, None, Default::default())
            .await?;
    }
    // The apply and gate queues refuse a missing Run the same way.
    broker
        .publish(
            Topic::Apply.queue_name(),
            &serde_json::to_vec(&RunMessage { run_id: ghost }.to_json())?,
            None,
            Default::default(),
        )
        .await?;

    let deadline = Instant::now() + Duration::from_secs(30);
    let listing = loop {
        let r = probe::call(
            &stack,
            "GET",
            "/api/v1/dead-letters?limit=10",
            Some(&stack.admin_token),
            &[],
            None,
        )
        .await?;
        assert_eq!(r.status, 200, "{}", r.text);
        if r.json["total"].as_u64() >= Some(4) || Instant::now() > deadline {
            break r.json;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let queue = |name: &str| {
        listing["queues"]
            .as_array()
            .and_then(|qs| qs.iter().find(|q| q["queue"] == name))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let plan_dead = queue("run.plan");
    assert_eq!(plan_dead["deadLetterQueue"], "run.plan.dead", "{listing}");
    assert_eq!(plan_dead["depth"], 3, "{listing}");
    let messages = plan_dead["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let bodies: Vec<&str> = messages.iter().filter_map(|m| m["body"].as_str()).collect();
    assert!(bodies.contains(&"this is not json {"), "{listing}");
    assert!(bodies.iter().any(|b| b.contains("hello")), "{listing}");
    let ghost_msg = messages
        .iter()
        .find(|m| {
            m["body"]
                .as_str()
                .is_some_and(|b| b.contains(&ghost.to_string()))
        })
        .unwrap_or_else(|| panic!("the missing Run's message: {listing}"));
    assert!(
        ghost_msg["error"]
            .as_str()
            .is_some_and(|e| e.contains("does not exist")),
        "{ghost_msg}"
    );
    let unparseable = messages
        .iter()
        .find(|m| m["body"] == "this is not json {")
        .unwrap();
    assert_eq!(unparseable["brokerReason"], "rejected", "{unparseable}");
    assert_eq!(queue("run.apply")["depth"], 1, "{listing}");
    assert_eq!(listing["total"], 4, "{listing}");

    // Looking again shows the same: a peek removes nothing.
    let again = probe::call(
        &stack,
        "GET",
        "/api/v1/dead-letters",
        Some(&stack.admin_token),
        &[],
        None,
    )
    .await?;
    assert_eq!(again.json["total"], 4, "{}", again.text);

    // The CLI shows them too.
    let out = tokio::process::Command::new(takosumi_tests::binary("takosumi")?)
        .env_clear()
        .env("TAKOSUMI_DEPLOY_CONTROL_URL", &stack.api_url)
        .env("TAKOSUMI_DEPLOY_CONTROL_TOKEN", &stack.admin_token)
        .arg("dead-letters")
        .stdin(Stdio::null())
        .output()
        .await?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("dead letters: 4"), "{text}");
    assert!(text.contains("run.plan.dead  depth 3"), "{text}");
    assert!(text.contains("does not exist"), "{text}");

    // Only admins; a bad limit is a 4xx with a code.
    let ws = stack.client.create_workspace("poison").await?;
    let viewer = "tks_test_viewer_dead_letters";
    takosumi_store::tokens::upsert(&stack.ctx.pool, viewer, "viewer", "viewer", None).await?;
    let scoped = "tks_test_scoped_dead_letters";
    takosumi_store::tokens::upsert(&stack.ctx.pool, scoped, "scoped", "admin", Some(ws.id)).await?;
    for token in [viewer, scoped] {
        let r = probe::call(
            &stack,
            "GET",
            "/api/v1/dead-letters",
            Some(token),
            &[],
            None,
        )
        .await?;
        assert_eq!(r.status, 403, "{}", r.text);
        assert_eq!(r.json["code"], "forbidden");
    }
    let r = probe::call(
        &stack,
        "GET",
        "/api/v1/dead-letters?limit=9999",
        Some(&stack.admin_token),
        &[],
        None,
    )
    .await?;
    assert_eq!(r.status, 422, "{}", r.text);
    let r = probe::call(
        &stack,
        "GET",
        "/api/v1/dead-letters?limit=x",
        Some(&stack.admin_token),
        &[],
        None,
    )
    .await?;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.json["code"], "invalid_query");

    // No Run, event or outbox row came of any of it (beyond the workspace and tokens).
    // The dead letters themselves are the collector's rows, and viewing them twice (and
    // the CLI) left exactly those: nothing taken from the broker and handed back.
    let mut after = probe::row_counts(&stack.ctx.pool).await?;
    assert_eq!(after["dead_letters"], 4, "{after:?}");
    let uncollected: u32 = broker
        .dead_letter_depths()
        .await?
        .iter()
        .map(|q| q.depth)
        .sum();
    assert_eq!(uncollected, 0, "left in the broker");
    for t in ["workspaces", "api_tokens", "activity", "dead_letters"] {
        after.insert(t.to_owned(), before[t]);
    }
    assert_eq!(after, before);
    record(
        "faults",
        "poison messages dead-lettered and shown",
        poison.len() + 1,
    );
    stack.stop().await
}

/// Waits until the dead-letter listing shows `total` stored dead letters.
async fn dead_letters_total(stack: &Stack, total: u64) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = probe::call(
            stack,
            "GET",
            "/api/v1/dead-letters",
            Some(&stack.admin_token),
            &[],
            None,
        )
        .await?;
        assert_eq!(r.status, 200, "{}", r.text);
        if r.json["total"].as_u64() == Some(total) {
            return Ok(r.json);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "dead letters never reached {total}: {}",
            r.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The promise: operators can put dead letters back to work and clear them, and neither
/// action loses or duplicates anything. A Run whose wake-up a step gave up on (dead-lettered
/// with its reason) is requeued by `POST /api/v1/dead-letters/requeue`: its wake-up goes
/// back onto `run.plan` (through the outbox) and the Run plans; a poison body is left in
/// place (no step could ever process it) and named, and `takosumi dead-letters purge`
/// deletes it. A requeue or purge that selects nothing is refused, not read as "all".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operators_requeue_and_purge_dead_letters() -> anyhow::Result<()> {
    let stack = Stack::start_on(
        Options {
            steps: Steps::API_ONLY,
            ..Options::default()
        },
        &takosumi_tests::Endpoints {
            // No reaper wake-ups behind the test's back: only the requeue may wake the Run.
            settings: vec![("TAKOSUMI_STUCK_QUEUED_SECS".into(), "3600".into())],
            ..Default::default()
        },
    )
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, json!({ "region": "eu" })).await?;
    let run = stack.client.plan(capsule.id, None).await?.id;
    let broker = stack.ctx.bus.get().await?;
    let ch = broker.channel().await?;
    // The step takes the wake-up and gives up on it, as the consume loop does after its
    // retries: the message goes to run.plan.dead with the reason.
    let deadline = Instant::now() + Duration::from_secs(30);
    let wake_up = loop {
        if let Some(got) = ch
            .basic_get(
                Topic::Plan.queue_name().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await?
        {
            break got.delivery.data;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the plan's wake-up never arrived"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    broker
        .publish_dead(
            Topic::Plan.queue_name(),
            &wake_up,
            "gave up after 5 retries (test)",
        )
        .await?;
    broker
        .publish_dead(
            Topic::Plan.queue_name(),
            b"not a run message",
            "poison (test)",
        )
        .await?;
    let listing = dead_letters_total(&stack, 2).await?;
    let plan_dead = listing["queues"]
        .as_array()
        .and_then(|qs| qs.iter().find(|q| q["queue"] == "run.plan"))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(plan_dead["uncollected"], 0, "{listing}");
    let messages = plan_dead["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let wake = messages
        .iter()
        .find(|m| m["runId"] == run.to_string())
        .unwrap_or_else(|| panic!("the Run's dead letter: {listing}"));
    assert_eq!(wake["error"], "gave up after 5 retries (test)");
    let poison_id = messages
        .iter()
        .find(|m| m["body"] == "not a run message")
        .and_then(|m| m["id"].as_i64())
        .unwrap_or_else(|| panic!("the poison dead letter: {listing}"));

    for (body, code) in [
        (json!({}), "no_selection"),
        (json!({ "queue": "run.nowhere" }), "unknown_queue"),
        (
            json!({ "all": true, "queue": "run.plan" }),
            "invalid_selection",
        ),
        (json!({ "ids": [] }), "invalid_ids"),
    ] {
        for action in ["requeue", "purge"] {
            let (s, b) = stack
                .call(
                    "POST",
                    &format!("/api/v1/dead-letters/{action}"),
                    body.clone(),
                )
                .await?;
            assert_eq!(
                (s, b["code"].as_str()),
                (422, Some(code)),
                "{action} {body}: {b}"
            );
        }
    }
    assert_eq!(dead_letters_total(&stack, 2).await?["total"], 2);

    let (s, b) = stack
        .call(
            "POST",
            "/api/v1/dead-letters/requeue",
            json!({ "queue": "run.plan" }),
        )
        .await?;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["requeued"].as_array().map(Vec::len), Some(1), "{b}");
    assert_eq!(b["requeued"][0]["runId"], run.to_string(), "{b}");
    assert_eq!(b["skipped"][0]["id"], poison_id, "{b}");
    assert_eq!(b["remaining"], 0, "{b}");
    dead_letters_total(&stack, 1).await?;

    // The wake-up is back on run.plan (published by the relay), and the Run plans from it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let again = loop {
        if let Some(got) = ch
            .basic_get(
                Topic::Plan.queue_name().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await?
        {
            break got.delivery.data;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the requeued wake-up never arrived"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let msg = RunMessage::from_bytes(&again)?;
    assert_eq!(msg.run_id, run);
    takosumi_plan::handle(&stack.ctx, msg).await?;
    assert_eq!(stack.client.get_run(run).await?.status, RunStatus::Planned);
    let depth = broker
        .dead_letter_depths()
        .await?
        .iter()
        .map(|q| q.depth)
        .sum::<u32>();
    assert_eq!(depth, 0);

    // The CLI purges the poison body; a second requeue finds nothing to move.
    let cli = async |args: &[&str]| {
        let out = stack.cli(args).await?;
        anyhow::Ok((out.code == 0, format!("{}{}", out.stdout, out.stderr)))
    };
    let (ok, text) = cli(&["dead-letters", "purge"]).await?;
    assert!(!ok, "a purge without a selection: {text}");
    let (ok, text) = cli(&["dead-letters", "requeue", "--all"]).await?;
    assert!(ok && text.contains("requeued 0"), "{text}");
    assert!(text.contains("left in place 1"), "{text}");
    let id = poison_id.to_string();
    let (ok, text) = cli(&["dead-letters", "purge", "--id", &id]).await?;
    assert!(ok && text.contains("purged 1"), "{text}");
    let (ok, text) = cli(&["dead-letters"]).await?;
    assert!(ok && text.contains("dead letters: 0"), "{text}");
    record("faults", "dead letters requeued and purged by operators", 2);
    stack.stop().await
}

/// The sandbox's promise under a hard crash: an apply handler SIGKILLed while its tool
/// runs a provisioner takes the tool and everything it started with it (bubblewrap's
/// `--die-with-parent` and the pid namespace), and the next apply handler that starts
/// removes the dead one's Run directory. The apply ends `unknown_outcome`, never re-applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_killed_mid_apply_leaves_no_tool_and_no_run_directory() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: true,
            plan: true,
            gate: true,
            apply: false,
        },
        lease_secs: 3,
    })
    .await?;
    let marker = "61.2468";
    let config = format!(
        "resource \"null_resource\" \"slow\" {{\n  provisioner \"local-exec\" {{\n    command = \"sleep {marker}\"\n  }}\n}}\n"
    );
    let repo = GitRepo::new(&[("infra/network/main.tf", &config)])?;
    let capsule = register(&stack, &repo, json!({})).await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let mut handler = stack.spawn_process("apply")?;
    let apply = stack.client.apply(plan.id, None).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while processes_exactly(&["sleep", marker]).is_empty() {
        assert!(Instant::now() < deadline, "the provisioner never started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let runs_dir = std::path::PathBuf::from(&stack.env_vars()["TAKOSUMI_WORK_DIR"]);
    let run_dirs = || -> Vec<String> {
        std::fs::read_dir(&runs_dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                    .filter(|n| n.starts_with(&apply.id.to_string()))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        run_dirs().len(),
        1,
        "the apply's run directory exists while it runs"
    );

    handler.kill().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !processes_exactly(&["sleep", marker]).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the tool's provisioner outlived its SIGKILLed handler"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        run_dirs().len(),
        1,
        "nothing removed the dead handler's directory yet"
    );

    // The next apply handler removes it when it starts; the reaper ends the apply.
    let mut next = stack.spawn_process("apply")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !run_dirs().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the restarted handler left the dead one's run directory: {:?}",
            run_dirs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let done = stack.wait(apply.id).await?;
    assert_eq!(done.status, RunStatus::UnknownOutcome, "{done:?}");
    assert_eq!(stack.tool_count("apply"), 1, "the apply ran again");
    next.kill().await?;
    record("faults", "handlers SIGKILLed mid-apply, nothing left", 1);
    stack.stop().await
}
