//! Figures 1, 2 and 8 (idle): what Takosumi adds to one plan and one apply of the network
//! example with the real terraform 1.0.3, against the bare tool on the same configuration.
//!
//! Each iteration times, back to back so machine noise hits both alike:
//! 1. bare plan: a fresh copy of the directory, `init && plan -out && show -json`;
//! 2. bare apply: a fresh copy with that plan file, `init && apply FILE && output -json`;
//! 3. Takosumi plan: a new Capsule, `POST plan` → the Run's `planned` event;
//! 4. Takosumi apply: `POST apply` → the Run's `applied` event.
//!
//! The tool gets the environment the runner gives it (nothing inherited; `HOME` empty,
//! `CHECKPOINT_DISABLE=1`, `TF_FORK=0`, the offline CLI config), so the only difference is
//! Takosumi. Each iteration also times the bare plan and apply as an operator runs them by
//! hand, without `TF_FORK=0` (terraform 1.0.3 then starts twice per command, under
//! panicwrap): what a Run costs against the tool one would otherwise run.
//! End times are the events' `clock_timestamp()`, written in the committing transaction on
//! the same host clock as the client's start time, so the wait loop's poll interval is not
//! counted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::Utc;
use serde_json::json;
use takosumi_tests::{GitRepo, Options, Stack, Steps};

use crate::harness::{self, Ev, ms};
use crate::report::Report;
use crate::stats::Summary;

/// The runner's fixed tool PATH.
const TOOL_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

struct Bare {
    tf: PathBuf,
    cli_config: Option<String>,
    main_tf: String,
    root: tempfile::TempDir,
    seq: usize,
    /// Whether the commands run as the runner runs them (`TF_FORK=0`) or as by hand.
    runner_env: bool,
}

impl Bare {
    fn fresh_dir(&mut self) -> anyhow::Result<(PathBuf, PathBuf)> {
        self.seq += 1;
        let dir = self.root.path().join(format!("d{}", self.seq));
        let home = self.root.path().join(format!("h{}", self.seq));
        std::fs::create_dir_all(&dir)?;
        std::fs::create_dir_all(&home)?;
        std::fs::write(dir.join("main.tf"), &self.main_tf)?;
        Ok((dir, home))
    }

    /// Runs the tool once; returns its wall time and stdout.
    async fn tool(&self, dir: &Path, home: &Path, args: &[&str]) -> anyhow::Result<(f64, Vec<u8>)> {
        let mut cmd = tokio::process::Command::new(&self.tf);
        cmd.env_clear()
            .env("PATH", TOOL_PATH)
            .env("HOME", home)
            .env("CHECKPOINT_DISABLE", "1")
            .env("TF_IN_AUTOMATION", "1")
            .env("TF_INPUT", "0")
            .env("TF_VAR_region", "eu")
            .current_dir(dir)
            .args(args);
        if let Some(c) = &self.cli_config {
            cmd.env("TF_CLI_CONFIG_FILE", c);
        }
        if self.runner_env {
            cmd.env("TF_FORK", "0");
        }
        let t = Instant::now();
        let out = cmd.output().await?;
        let elapsed = t.elapsed().as_secs_f64() * 1000.0;
        if !out.status.success() {
            bail!(
                "bare terraform {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok((elapsed, out.stdout))
    }

    /// `init && plan -out && show -json` in a fresh directory: per-command and total ms,
    /// and the directory (holding `tfplan`).
    async fn plan(&mut self) -> anyhow::Result<(BTreeMap<&'static str, f64>, f64, PathBuf)> {
        let (dir, home) = self.fresh_dir()?;
        let t = Instant::now();
        let mut per = BTreeMap::new();
        per.insert(
            "init",
            self.tool(&dir, &home, &["init", "-input=false", "-no-color"])
                .await?
                .0,
        );
        per.insert(
            "plan",
            self.tool(
                &dir,
                &home,
                &["plan", "-input=false", "-no-color", "-out=tfplan"],
            )
            .await?
            .0,
        );
        let (show_ms, show) = self.tool(&dir, &home, &["show", "-json", "tfplan"]).await?;
        let _: serde_json::Value = serde_json::from_slice(&show)?;
        per.insert("show", show_ms);
        Ok((per, t.elapsed().as_secs_f64() * 1000.0, dir))
    }

    /// `init && apply tfplan && output -json` in a fresh directory holding `plan_dir`'s plan.
    async fn apply(
        &mut self,
        plan_dir: &Path,
    ) -> anyhow::Result<(BTreeMap<&'static str, f64>, f64)> {
        let (dir, home) = self.fresh_dir()?;
        std::fs::copy(plan_dir.join("tfplan"), dir.join("tfplan"))?;
        let t = Instant::now();
        let mut per = BTreeMap::new();
        per.insert(
            "init",
            self.tool(&dir, &home, &["init", "-input=false", "-no-color"])
                .await?
                .0,
        );
        per.insert(
            "apply",
            self.tool(
                &dir,
                &home,
                &["apply", "-input=false", "-no-color", "tfplan"],
            )
            .await?
            .0,
        );
        let (out_ms, out) = self.tool(&dir, &home, &["output", "-json"]).await?;
        let _: serde_json::Value = serde_json::from_slice(&out)?;
        per.insert("output", out_ms);
        Ok((per, t.elapsed().as_secs_f64() * 1000.0))
    }

    /// The bare plan and apply totals as an operator runs them by hand (no `TF_FORK=0`).
    async fn by_hand(&mut self) -> anyhow::Result<(f64, f64)> {
        self.runner_env = false;
        let out = async {
            let (_, plan, dir) = self.plan().await?;
            let (_, apply) = self.apply(&dir).await?;
            anyhow::Ok((plan, apply))
        }
        .await;
        self.runner_env = true;
        out
    }

    /// `version -json` alone: the call Takosumi makes that the bare sequence does not.
    async fn version(&mut self) -> anyhow::Result<f64> {
        let (dir, home) = self.fresh_dir()?;
        Ok(self.tool(&dir, &home, &["version", "-json"]).await?.0)
    }
}

/// Per-segment timings between consecutive events, keyed by `a → b`, kept in first-seen order.
#[derive(Default)]
pub struct Segments {
    order: Vec<String>,
    samples: BTreeMap<String, Vec<f64>>,
}

impl Segments {
    /// Adds one Run's consecutive gaps, starting from `start` (the client's POST).
    pub fn add(
        &mut self,
        start_label: &str,
        start: chrono::DateTime<Utc>,
        events: &[Ev],
        until: &str,
    ) {
        let mut prev = (start_label.to_owned(), start);
        for e in events {
            let key = format!("{} → {}", prev.0, e.label);
            if !self.samples.contains_key(&key) {
                self.order.push(key.clone());
            }
            self.samples.entry(key).or_default().push(ms(prev.1, e.at));
            prev = (e.label.clone(), e.at);
            if e.kind == until {
                break;
            }
        }
    }

    /// Markdown table lines: segment, median, p95, n.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![
            "| segment (consecutive Run events) | median | p95 | n |".to_owned(),
            "|---|---|---|---|".to_owned(),
        ];
        for key in &self.order {
            if let Some(s) = Summary::of(&self.samples[key]) {
                out.push(format!(
                    "| {key} | {:.1} ms | {:.1} ms | {} |",
                    s.median, s.p95, s.n
                ));
            }
        }
        out
    }
}

/// Queue latency samples of the idle runs, for figure 8.
#[derive(Debug, Default)]
pub struct QueueSamples {
    /// plan step: `queued` → `claimed`.
    pub plan: Vec<f64>,
    /// apply step: the gate's `gate_decision` (committed with the apply wake-up) → `claimed`.
    pub apply: Vec<f64>,
    /// gate step: the apply Run's `queued` → `gate_decision` (the whole gate step).
    pub gate: Vec<f64>,
    /// plan step split: `queued` → the relay's pickup (outbox `sent_at`).
    pub relay_pickup: Vec<f64>,
    /// plan step split: the relay's pickup → `claimed`.
    pub broker_to_claim: Vec<f64>,
}

/// Runs figures 1 and 2 (and collects figure 8's idle samples).
pub async fn run(report: &mut Report, runs: usize, warmup: usize) -> anyhow::Result<QueueSamples> {
    let tf = std::env::var("TAKOSUMI_TERRAFORM_BIN")
        .context("TAKOSUMI_TERRAFORM_BIN is not set: source the stack's env.sh")?;
    let tf = PathBuf::from(tf);
    let main_tf = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../infra/examples/network/main.tf"
    ))?;
    let mut bare = Bare {
        tf: tf.clone(),
        cli_config: std::env::var("TAKOSUMI_TF_CLI_CONFIG").ok(),
        main_tf,
        root: tempfile::tempdir()?,
        seq: 0,
        runner_env: true,
    };
    let stack = Stack::start_with_tool(
        Options {
            steps: Steps::ALL,
            lease_secs: 60,
        },
        Some(&tf),
    )
    .await?;
    let result = measure(&stack, &mut bare, report, runs, warmup).await;
    stack.stop().await?;
    result
}

async fn measure(
    stack: &Stack,
    bare: &mut Bare,
    report: &mut Report,
    runs: usize,
    warmup: usize,
) -> anyhow::Result<QueueSamples> {
    let repo = GitRepo::with_example("network")?;
    let ws = harness::workspace(stack).await?;
    let (mut bare_plan, mut bare_apply, mut tk_plan, mut tk_apply) =
        (vec![], vec![], vec![], vec![]);
    let (mut d_plan, mut d_apply) = (vec![], vec![]);
    let (mut hand_plan, mut hand_apply, mut dh_plan, mut dh_apply) =
        (vec![], vec![], vec![], vec![]);
    let mut bare_cmds: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let mut version_ms = vec![];
    let (mut seg_plan, mut seg_apply) = (Segments::default(), Segments::default());
    let mut q = QueueSamples::default();
    let timeout = Duration::from_secs(120);
    for i in 0..warmup + runs {
        let keep = i >= warmup;
        let (per_plan, bp, plan_dir) = bare.plan().await?;
        let (per_apply, ba) = bare.apply(&plan_dir).await?;
        let v = bare.version().await?;
        let (hp, ha) = bare.by_hand().await?;

        let cap = harness::capsule(
            stack,
            ws,
            &repo,
            &format!("net-{i}"),
            json!({ "region": "eu" }),
        )
        .await?;
        let start = Utc::now();
        let plan = stack.client.plan(cap.id, None).await?;
        harness::wait_status(stack, plan.id, "planned", timeout).await?;
        let pev = harness::events(stack, plan.id).await?;
        let tp = ms(start, harness::at(&pev, "planned")?);
        // Let the plan's own gate decision land before timing the apply.
        let gate_deadline = tokio::time::Instant::now() + timeout;
        while !harness::events(stack, plan.id)
            .await?
            .iter()
            .any(|e| e.kind == "gate_decision")
        {
            if tokio::time::Instant::now() > gate_deadline {
                bail!("{} never got its gate decision", plan.id);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let astart = Utc::now();
        let apply = stack.client.apply(plan.id, None).await?;
        harness::wait_status(stack, apply.id, "applied", timeout).await?;
        let aev = harness::events(stack, apply.id).await?;
        let ta = ms(astart, harness::at(&aev, "applied")?);
        if !keep {
            continue;
        }
        bare_plan.push(bp);
        bare_apply.push(ba);
        tk_plan.push(tp);
        tk_apply.push(ta);
        d_plan.push(tp - bp);
        d_apply.push(ta - ba);
        hand_plan.push(hp);
        hand_apply.push(ha);
        dh_plan.push(tp - hp);
        dh_apply.push(ta - ha);
        version_ms.push(v);
        for (k, v) in per_plan
            .into_iter()
            .chain(per_apply.into_iter().map(|(k, v)| match k {
                "init" => ("init (apply dir)", v),
                other => (other, v),
            }))
        {
            bare_cmds.entry(k).or_default().push(v);
        }
        seg_plan.add("POST plan", start, &pev, "planned");
        seg_apply.add("POST apply", astart, &aev, "applied");

        let queued = harness::at(&pev, "queued")?;
        q.plan.push(ms(queued, harness::at(&pev, "claimed")?));
        let gate = harness::at(&aev, "gate_decision")?;
        q.gate.push(ms(harness::at(&aev, "queued")?, gate));
        q.apply.push(ms(gate, harness::at(&aev, "claimed")?));
        let sent: Option<chrono::DateTime<Utc>> = sqlx::query_scalar(
            "SELECT sent_at FROM outbox WHERE topic = 'run.plan' AND payload->>'runId' = $1 ORDER BY id LIMIT 1",
        )
        .bind(plan.id.to_string())
        .fetch_one(&stack.ctx.pool)
        .await?;
        if let Some(sent) = sent {
            q.relay_pickup.push(ms(queued, sent));
            q.broker_to_claim
                .push(ms(sent, harness::at(&pev, "claimed")?));
        }
    }

    let s = |v: &[f64]| Summary::of(v).context("no samples");
    let (bp, ba, tp, ta, dp, da) = (
        s(&bare_plan)?,
        s(&bare_apply)?,
        s(&tk_plan)?,
        s(&tk_apply)?,
        s(&d_plan)?,
        s(&d_apply)?,
    );
    report.row(
        format!("1. plan overhead (n={runs})"),
        format!(
            "{} (Takosumi {})",
            dp.signed_ms_median_p95(),
            tp.ms_median_p95()
        ),
        format!("bare init+plan+show {}", bp.ms_median_p95()),
        format!("{:.2}× bare", tp.median / bp.median),
        "≤ +40 ms median",
        Some(dp.median <= 40.0),
    );
    report.row(
        format!("2. apply overhead (n={runs})"),
        format!(
            "{} (Takosumi {})",
            da.signed_ms_median_p95(),
            ta.ms_median_p95()
        ),
        format!("bare init+apply+output {}", ba.ms_median_p95()),
        format!("{:.2}× bare", ta.median / ba.median),
        "≤ +60 ms median",
        Some(da.median <= 60.0),
    );
    let (hp, ha, dhp, dha) = (s(&hand_plan)?, s(&hand_apply)?, s(&dh_plan)?, s(&dh_apply)?);
    report.row(
        "1. plan against the tool run by hand (no `TF_FORK=0`)".to_owned(),
        dhp.signed_ms_median_p95(),
        format!("by hand init+plan+show {}", hp.ms_median_p95()),
        format!("{:.2}× by hand", tp.median / hp.median),
        "—",
        None,
    );
    report.row(
        "2. apply against the tool run by hand (no `TF_FORK=0`)".to_owned(),
        dha.signed_ms_median_p95(),
        format!("by hand init+apply+output {}", ha.ms_median_p95()),
        format!("{:.2}× by hand", ta.median / ha.median),
        "—",
        None,
    );
    let mut lines = vec![
        "Overhead = Takosumi (client `POST` → the Run's `planned`/`applied` event) minus the bare tool, paired per iteration; median / p95.".to_owned(),
        String::new(),
        "| bare terraform command (runner's environment) | median | p95 |".to_owned(),
        "|---|---|---|".to_owned(),
    ];
    if let Some(v) = Summary::of(&version_ms) {
        lines.push(format!("| version -json (Takosumi asks it once per binary and process; the bare sequence does not) | {:.1} ms | {:.1} ms |", v.median, v.p95));
    }
    for (k, v) in &bare_cmds {
        if let Some(v) = Summary::of(v) {
            lines.push(format!("| {k} | {:.1} ms | {:.1} ms |", v.median, v.p95));
        }
    }
    report.detail("1. bare tool per command (figures 1 and 2)", lines);
    let mut plan_lines = vec![
        "Where a Takosumi plan Run's time goes (real terraform 1.0.3, idle machine):".to_owned(),
        String::new(),
    ];
    plan_lines.extend(seg_plan.lines());
    report.detail("1. plan Run, per step (from Run events)", plan_lines);
    let mut apply_lines = vec![
        "Where a Takosumi apply Run's time goes:".to_owned(),
        String::new(),
    ];
    apply_lines.extend(seg_apply.lines());
    report.detail("2. apply Run, per step (from Run events)", apply_lines);
    Ok(q)
}
