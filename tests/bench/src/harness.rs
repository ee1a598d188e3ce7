//! What every end-to-end figure needs around the fixture: Workspaces and Capsules through
//! the API, waiting on a Run's status and reading its events straight from the Run's
//! database (so waiting costs the API nothing), spawning and stopping step processes, and
//! knowing when they consume.

use std::time::Duration;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use takosumi_client::{Capsule, NewCapsule, Source};
use takosumi_core::{RunId, WorkspaceId};
use takosumi_tests::{GitRepo, Stack};

use crate::cgroup::CpuGroup;

/// A stack of the figure's own (database, vhost, bucket) with no API and no step
/// running: the figure calls what it measures itself.
pub async fn quiet_stack() -> anyhow::Result<Stack> {
    Stack::start_with(takosumi_tests::Options {
        steps: takosumi_tests::Steps {
            api: false,
            plan: false,
            gate: false,
            apply: false,
        },
        lease_secs: 60,
    })
    .await
}

/// A new Workspace with a unique name.
pub async fn workspace(stack: &Stack) -> anyhow::Result<WorkspaceId> {
    let name = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    Ok(stack.client.create_workspace(&name).await?.id)
}

/// Registers a terraform Capsule on `repo`'s `infra/network` directory.
pub async fn capsule(
    stack: &Stack,
    ws: WorkspaceId,
    repo: &GitRepo,
    name: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    let vars: Map<String, Value> = vars.as_object().cloned().unwrap_or_default();
    let req = NewCapsule {
        name: name.into(),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: "infra/network".into(),
        tool: "terraform".into(),
        vars,
    };
    Ok(stack.client.create_capsule(ws, &req).await?)
}

/// A Run's status, read from the database.
pub async fn status(stack: &Stack, run: RunId) -> anyhow::Result<String> {
    let s: String = sqlx::query_scalar("SELECT status::text FROM runs WHERE id = $1")
        .bind(run.as_uuid())
        .fetch_one(&stack.ctx.pool)
        .await?;
    Ok(s)
}

/// Waits until the Run is `want`, polling the database every 10 ms (the figures take their
/// end time from the Run's events, not from this poll). Any other terminal status is an
/// error: a benchmark of a failing pipeline measures nothing.
pub async fn wait_status(
    stack: &Stack,
    run: RunId,
    want: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let s = status(stack, run).await?;
        if s == want {
            return Ok(());
        }
        if matches!(
            s.as_str(),
            "failed" | "canceled" | "unknown_outcome" | "held" | "applied"
        ) {
            let err: Option<(Option<String>, Option<String>)> =
                sqlx::query_as("SELECT error_code, error_message FROM runs WHERE id = $1")
                    .bind(run.as_uuid())
                    .fetch_optional(&stack.ctx.pool)
                    .await?;
            bail!("{run} ended {s}, not {want}: {err:?}");
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{run} still {s} after {timeout:?} (wanted {want})");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One Run event, labelled for breakdowns: the kind, plus the tool command or pin it
/// names (`tool_started(init)`, `pin_checked(planDigest)`).
#[derive(Debug, Clone)]
pub struct Ev {
    /// The event kind.
    pub kind: String,
    /// Kind plus command or pin.
    pub label: String,
    /// `clock_timestamp()` when it was written.
    pub at: DateTime<Utc>,
}

/// A Run's events in order.
pub async fn events(stack: &Stack, run: RunId) -> anyhow::Result<Vec<Ev>> {
    let rows: Vec<(String, Value, DateTime<Utc>)> =
        sqlx::query_as("SELECT kind, data, at FROM run_events WHERE run_id = $1 ORDER BY id")
            .bind(run.as_uuid())
            .fetch_all(&stack.ctx.pool)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(kind, data, at)| {
            let sub = data["command"].as_str().or(data["pin"].as_str());
            let label = match sub {
                Some(s) => format!("{kind}({s})"),
                None => kind.clone(),
            };
            Ev { kind, label, at }
        })
        .collect())
}

/// The first event of `kind`.
pub fn at(events: &[Ev], kind: &str) -> anyhow::Result<DateTime<Utc>> {
    events
        .iter()
        .find(|e| e.kind == kind)
        .map(|e| e.at)
        .with_context(|| format!("no {kind} event"))
}

/// Milliseconds from `a` to `b`.
pub fn ms(a: DateTime<Utc>, b: DateTime<Utc>) -> f64 {
    (b - a).num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0
}

/// Cgroups [`Processes::spawn`] made so far in this process.
static GROUPS_MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Step processes a figure started, stopped with SIGTERM (graceful: in-flight work ends,
/// connections close) and killed only if they do not exit within 10 s.
#[derive(Debug, Default)]
pub struct Processes {
    /// `(step, child)`.
    pub children: Vec<(String, tokio::process::Child)>,
    /// A cgroup per step holding its processes and everything they start, where the
    /// machine lets the bench make one (see [`CpuGroup`]), and whether every process of
    /// the step went into it. Dropped after the processes.
    groups: Vec<(String, CpuGroup, bool)>,
}

impl Processes {
    /// Starts `count` processes of each step, with warnings-only logs and the defaults a
    /// deployment runs with stated explicitly: 2 messages at once per process, and a
    /// reaper pass every 2 s (the test stack's 300 ms, meant to make reaper tests quick,
    /// cost 4-5 statements per process every 300 ms: with 13 processes, ~200 statements a
    /// second that no deployment makes, charged to figure 3's Postgres).
    pub fn spawn(stack: &Stack, steps: &[&str], count: usize) -> anyhow::Result<Self> {
        let mut p = Self::default();
        for step in steps {
            // A name of its own each time: a group the last figure could not remove yet
            // (a sandbox still on its way out) does not stop this one.
            let seq = GROUPS_MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let group = CpuGroup::create(&format!(
                "takosumi-bench-{}-{seq}-{step}",
                std::process::id()
            ));
            let mut whole = group.is_some();
            for _ in 0..count {
                let child = stack.spawn_process_with(
                    step,
                    &[
                        ("RUST_LOG", "warn"),
                        ("TAKOSUMI_CONCURRENCY", "2"),
                        ("TAKOSUMI_REAPER_INTERVAL_MS", "2000"),
                    ],
                )?;
                if let (Some(group), Some(pid), true) = (&group, child.id(), whole) {
                    // Before it has a Run: nothing it starts for one escapes the group.
                    if let Err(e) = group.add(pid) {
                        eprintln!(
                            "bench: {step}'s processes cannot join a cgroup ({e}): its sandboxes are counted only as reaped children"
                        );
                        whole = false;
                    }
                }
                p.children.push(((*step).to_owned(), child));
            }
            if let Some(group) = group {
                p.groups.push(((*step).to_owned(), group, whole));
            }
        }
        Ok(p)
    }

    /// CPU seconds `step`'s processes and everything they started (sandboxes included)
    /// have used, when the machine gave the bench a cgroup for it.
    pub fn group_cpu(&self, step: &str) -> Option<f64> {
        self.groups
            .iter()
            .find(|(s, _, whole)| s == step && *whole)
            .and_then(|(_, g, _)| g.usage_secs())
    }

    /// `(step, pid)` of every process still running.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.children
            .iter()
            .filter_map(|(s, c)| c.id().map(|pid| (s.clone(), pid)))
            .collect()
    }

    /// Stops every process this figure started (by its own pid only).
    pub async fn stop(mut self) {
        for (_, child) in &self.children {
            if let Some(pid) = child.id() {
                let _ = tokio::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
        }
        for (_, child) in &mut self.children {
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

/// Waits until each queue has at least the given number of consumers (asks RabbitMQ's
/// management API), so a timed figure does not include process start-up.
pub async fn wait_consumers(
    stack: &Stack,
    queues: &[(&str, usize)],
    timeout: Duration,
) -> anyhow::Result<()> {
    let vars = stack.env_vars();
    let amqp = vars
        .get("TAKOSUMI_AMQP_URL")
        .context("no TAKOSUMI_AMQP_URL")?;
    let vhost = amqp.rsplit('/').next().unwrap_or_default();
    let env = |k: &str| std::env::var(k).with_context(|| format!("{k} is not set"));
    let mgmt = env("TAKOSUMI_RABBITMQ_MGMT_URL")?;
    let (user, pass) = (
        env("TAKOSUMI_RABBITMQ_MGMT_USER")?,
        env("TAKOSUMI_RABBITMQ_MGMT_PASSWORD")?,
    );
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + timeout;
    for (queue, want) in queues {
        loop {
            let body: Value = http
                .get(format!("{mgmt}/api/queues/{vhost}/{queue}"))
                .basic_auth(&user, Some(&pass))
                .send()
                .await?
                .json()
                .await
                .unwrap_or_default();
            let have = body["consumers"].as_u64().unwrap_or(0) as usize;
            if have >= *want {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("{queue} has {have} consumers after {timeout:?}, wanted {want}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// The step binaries and the no-op tool must sit beside the bench binary (one
/// `cargo build --release` builds them all; see infra/local/bench.sh).
pub fn sibling(name: &str) -> anyhow::Result<std::path::PathBuf> {
    takosumi_tests::binary(name)
}
