//! Metrics and traces, against the real API, RabbitMQ, Postgres, the S3 server
//! and terraform 1.0.3:
//! - `/metrics` figures move by exactly what a plan and its apply did (HTTP requests by
//!   route template, step durations, queue lag, Runs by kind and status from Postgres),
//!   and a step process serves its own;
//! - a `traceparent` sent with `POST /plan` is on the plan and apply handlers' log lines
//!   (every line naming the Run) and on the spans they export over OTLP.
//!
//! The tests share the process's metrics, so they take turns.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use takosumi_core::{RunId, RunStatus};
use takosumi_tests::probe::{self, record};
use takosumi_tests::{Endpoints, GitRepo, Options, Stack, Steps};
use tokio::time::Instant;

static TURNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn scrape(url: &str) -> anyhow::Result<String> {
    let resp = reqwest::get(url).await?;
    anyhow::ensure!(resp.status() == 200, "{url}: {}", resp.status());
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    anyhow::ensure!(ct.starts_with("application/openmetrics-text"), "{ct}");
    Ok(resp.text().await?)
}

/// The value of the sample `series` (name with its labels, exactly as rendered), 0 when
/// the series is not there yet.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A plan and its apply move each figure by exactly what they did.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_move_as_runs_go_through() -> anyhow::Result<()> {
    let _turn = TURNS.lock().await;
    let port = free_port()?;
    let stack = Stack::start_on(
        Options::default(),
        &Endpoints {
            settings: vec![(
                "TAKOSUMI_METRICS_LISTEN".into(),
                format!("127.0.0.1:{port}"),
            )],
            ..Endpoints::default()
        },
    )
    .await?;
    let url = format!("http://127.0.0.1:{port}/metrics");
    let repo = GitRepo::with_example("network")?;
    let cap = stack
        .new_capsule(&repo, "network", "infra/network", json!({ "region": "eu" }))
        .await?;

    let before = scrape(&url).await?;
    let plan_route = r#"takosumi_http_requests_total{route="/api/v1/capsules/{cap}/plan",method="POST",status="202"}"#;
    let apply_route = r#"takosumi_http_requests_total{route="/api/v1/runs/{run}/apply",method="POST",status="202"}"#;
    let not_found =
        r#"takosumi_http_requests_total{route="/api/v1/runs/{run}",method="GET",status="404"}"#;
    let unmatched = r#"takosumi_http_requests_total{route="unmatched",method="GET",status="404"}"#;
    let plan_latency = r#"takosumi_http_request_duration_seconds_count{route="/api/v1/capsules/{cap}/plan",method="POST"}"#;
    let steps = [
        (
            r#"takosumi_step_duration_seconds_count{step="plan",outcome="done"}"#,
            1.0,
        ),
        (
            r#"takosumi_step_duration_seconds_count{step="gate",outcome="done"}"#,
            2.0,
        ),
        (
            r#"takosumi_step_duration_seconds_count{step="apply",outcome="done"}"#,
            1.0,
        ),
        (r#"takosumi_queue_lag_seconds_count{step="plan"}"#, 1.0),
        (r#"takosumi_queue_lag_seconds_count{step="apply"}"#, 1.0),
    ];

    let (plan, _apply) = stack.plan_and_apply(cap.id).await?;
    let missing = format!("/api/v1/runs/{}", RunId::new());
    assert_eq!(
        probe::call(&stack, "GET", &missing, Some(&stack.admin_token), &[], None)
            .await?
            .status,
        404
    );
    let nowhere = format!("/api/v1/nowhere/{}", RunId::new());
    assert_eq!(
        probe::call(&stack, "GET", &nowhere, Some(&stack.admin_token), &[], None)
            .await?
            .status,
        404
    );
    let after = scrape(&url).await?;

    let delta = |series: &str| sample(&after, series) - sample(&before, series);
    assert_eq!(delta(plan_route), 1.0, "one plan submitted\n{after}");
    assert_eq!(delta(apply_route), 1.0, "one apply submitted");
    assert_eq!(delta(plan_latency), 1.0, "one plan's latency observed");
    assert_eq!(
        delta(not_found),
        1.0,
        "a 404 on a route is labelled by its template"
    );
    assert_eq!(
        delta(unmatched),
        1.0,
        "a path that matches no route is `unmatched`"
    );
    assert!(
        !after.contains(&plan.id.to_string()) && !after.contains(&missing),
        "no id is ever a label"
    );
    for (series, want) in steps {
        assert_eq!(delta(series), want, "{series}\n{after}");
    }
    // From Postgres: this stack's database has exactly these two Runs.
    assert_eq!(
        sample(&after, r#"takosumi_runs{kind="plan",status="planned"}"#),
        1.0
    );
    assert_eq!(
        sample(&after, r#"takosumi_runs{kind="apply",status="applied"}"#),
        1.0
    );
    assert_eq!(sample(&after, "takosumi_dead_letters"), 0.0);
    assert_eq!(sample(&after, "takosumi_unknown_outcome_runs"), 0.0);
    assert!(after.contains("# TYPE takosumi_outbox_backlog gauge"));
    assert!(after.contains("# TYPE takosumi_outbox_oldest_age_seconds gauge"));
    assert!(after.ends_with("# EOF\n"));

    // 10,000 Runs: the scrape's Postgres figures are aggregates, not rows.
    sqlx::query(
        "INSERT INTO runs (id, kind, workspace_id, capsule_id, actor_kind, actor_id, status)
         SELECT gen_random_uuid(), 'plan', $1, $2, 'system', 'bench', 'failed'
           FROM generate_series(1, 10000)",
    )
    .bind(cap.workspace_id.as_uuid())
    .bind(cap.id.as_uuid())
    .execute(&stack.ctx.pool)
    .await?;
    let mut took = Vec::new();
    let mut text = String::new();
    for _ in 0..20 {
        let started = Instant::now();
        text = scrape(&url).await?;
        took.push(started.elapsed());
    }
    took.sort();
    assert_eq!(
        sample(&text, r#"takosumi_runs{kind="plan",status="failed"}"#),
        10_000.0
    );
    let median_ms = took[took.len() / 2].as_secs_f64() * 1000.0;
    record(
        "observability",
        "/metrics scrape with 10,000 Runs, median ms",
        format!("{median_ms:.1}"),
    );
    stack.stop().await
}

/// A collector that keeps every OTLP/HTTP export it is sent.
async fn collector() -> anyhow::Result<(String, Arc<Mutex<Vec<Vec<u8>>>>)> {
    use axum::routing::post;
    let got: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let keep = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |body: axum::body::Bytes| {
            let keep = keep.clone();
            async move {
                keep.lock().unwrap().push(body.to_vec());
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, got))
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The trace id of `POST /plan` reaches the plan and apply handlers' logs and spans, through
/// the Run row, the outbox, the AMQP headers and the apply the gate proposes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trace_id_sent_with_a_plan_is_on_the_handlers_logs_and_spans() -> anyhow::Result<()> {
    let _turn = TURNS.lock().await;
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let (otlp, exported) = collector().await?;
    let logs = tempfile::tempdir()?;
    let apply_metrics = free_port()?;
    let mut procs = HashMap::new();
    for step in ["plan", "gate", "apply"] {
        let metrics = format!("127.0.0.1:{apply_metrics}");
        let mut extra = vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ];
        if step == "apply" {
            extra.push(("TAKOSUMI_METRICS_LISTEN", metrics.as_str()));
        }
        let log = logs.path().join(format!("{step}.log"));
        let child = stack.spawn_step(step, &[], &extra, Some(&log))?;
        procs.insert(step, (child, log));
    }

    let repo = GitRepo::with_example("network")?;
    let cap = stack
        .new_capsule(&repo, "network", "infra/network", json!({ "region": "eu" }))
        .await?;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let body = json!({ "autoApplyRequested": true }).to_string();
    let resp = probe::call(
        &stack,
        "POST",
        &format!("/api/v1/capsules/{}/plan", cap.id),
        Some(&stack.admin_token),
        &[("traceparent", traceparent.as_str())],
        Some(body.as_bytes()),
    )
    .await?;
    assert_eq!(resp.status, 202, "{}", resp.text);
    let plan: RunId = resp.json["id"]
        .as_str()
        .unwrap_or_default()
        .parse()
        .map_err(|e| anyhow::anyhow!("{e}: {}", resp.text))?;
    let planned = stack.wait(plan).await?;
    assert_eq!(planned.status, RunStatus::Planned, "{planned:?}");
    let apply = stack.proposed_apply(&cap, plan).await?;
    let applied = stack.wait(apply).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");

    // The apply process serves its own figures.
    let own = scrape(&format!("http://127.0.0.1:{apply_metrics}/metrics")).await?;
    assert_eq!(
        sample(
            &own,
            r#"takosumi_step_duration_seconds_count{step="apply",outcome="done"}"#
        ),
        1.0,
        "{own}"
    );
    assert!(
        !own.contains("takosumi_runs{"),
        "Postgres figures are the API's alone"
    );

    // SIGTERM: each process finishes and flushes its spans.
    for (child, _) in procs.values() {
        if let Some(pid) = child.id() {
            std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()?;
        }
    }
    for (step, (child, _)) in procs.iter_mut() {
        let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .map_err(|_| anyhow::anyhow!("takosumi-{step} did not stop on SIGTERM"))??;
        assert!(status.success(), "takosumi-{step}: {status}");
    }

    let needle = format!("trace_id={trace_id}");
    for (step, run) in [
        ("plan", plan),
        ("gate", plan),
        ("gate", apply),
        ("apply", apply),
    ] {
        let text = std::fs::read_to_string(&procs[step].1)?;
        let naming: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(&run.to_string()))
            .collect();
        assert!(
            !naming.is_empty(),
            "takosumi-{step} logged nothing about {run}:\n{text}"
        );
        for line in &naming {
            assert!(
                line.contains(&needle),
                "takosumi-{step}'s line about {run} has no trace id: {line}"
            );
        }
    }

    let bytes = hex::decode(trace_id)?;
    let bodies = exported.lock().unwrap().clone();
    for service in ["takosumi-plan", "takosumi-gate", "takosumi-apply"] {
        assert!(
            bodies
                .iter()
                .any(|b| contains(b, service.as_bytes()) && contains(b, &bytes)),
            "{service} exported no span of trace {trace_id} ({} exports)",
            bodies.len()
        );
    }
    record("observability", "trace id carried plan → gate → apply", 1);
    stack.stop().await
}
