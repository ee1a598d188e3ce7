//! End-to-end: the dashboard in headless Chromium (Debian's, driven by playwright-core; see
//! tests/browser/dashboard.cjs) against the real stack — API, plan, gate, approve and apply
//! handlers, Postgres, RabbitMQ, the S3 server and terraform 1.0.3. The browser signs in,
//! installs the network example from its Capsule page and watches it apply `vpc-eu`; a
//! destroying plan under `maxDestroy: 0` is held, refused to a viewer (no button, a forged
//! POST refused, a CSRF-less POST refused) and approved by a second user on the Run page;
//! a canary sensitive variable and a canary credential appear on no page and in no stream.
//! Screenshots of the main pages are saved under `$CARGO_TARGET_DIR/artifacts/dashboard`.
//!
//! Here the Rust side sets the stack up, runs the browser, and checks what it reports
//! against Postgres (the approval's actor, the Runs' outcomes).

use std::path::PathBuf;
use std::process::Stdio;

use serde::Deserialize;
use serde_json::{Map, Value, json};
use takosumi_client::{Capsule, NewCapsule, PlanRequest, RunId, RunKind, RunStatus, Source};
use takosumi_tests::{GitRepo, Stack};

fn playwright_core() -> PathBuf {
    std::env::var_os("TAKOSUMI_PLAYWRIGHT_CORE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(
                std::env::var("TAKOSUMI_CACHE")
                    .unwrap_or_else(|_| "/var/tmp/takosumi-cache".into()),
            )
            .join("node/node_modules/playwright-core")
        })
}

fn screenshots() -> PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target").to_owned());
    PathBuf::from(target).join("artifacts/dashboard")
}

async fn capsule(
    stack: &Stack,
    ws: takosumi_client::WorkspaceId,
    name: &str,
    repo: &GitRepo,
    dir: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    let req = NewCapsule {
        name: name.into(),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: dir.into(),
        tool: "terraform".into(),
        vars: vars.as_object().cloned().unwrap_or_default(),
    };
    Ok(stack.client.create_capsule(ws, &req).await?)
}

/// What the browser script reports.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Seen {
    install_plan_run: RunId,
    install_apply_run: RunId,
    held_run: RunId,
    viewer_forged_status: u16,
    approved_digest_prefix: String,
    /// Whether the install apply's page came before its statement and its evidence line
    /// fetched itself until the statement was there.
    evidence_awaited: bool,
    seen: Sweeps,
}

#[derive(Debug, Deserialize)]
struct Sweeps {
    pages: u32,
    streams: u32,
    steps: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dashboard_installs_reviews_and_approves_in_a_browser() -> anyhow::Result<()> {
    let module = playwright_core();
    anyhow::ensure!(
        module.join("package.json").exists() && std::path::Path::new("/usr/bin/chromium").exists(),
        "the browser tests need Chromium and playwright-core: run infra/local/install.sh"
    );
    let stack = Stack::start().await?;
    let ws = stack
        .client
        .create_workspace(&format!(
            "ws-dash-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?;
    let network_repo = GitRepo::with_example("network")?;
    let network = capsule(
        &stack,
        ws.id,
        "network",
        &network_repo,
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let null_repo = GitRepo::with_example("null")?;
    let nulls = capsule(&stack, ws.id, "nulls", &null_repo, "infra/null", json!({})).await?;

    // A canary credential injected into every Run of the null Capsule, and a canary
    // sensitive variable on one of its plans.
    let canary = format!("canary-{}", uuid::Uuid::new_v4().simple());
    let cred = format!("cred-{}", uuid::Uuid::new_v4().simple());
    let (s, binding) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{}/provider-bindings", ws.id),
            json!({ "name": "cloud", "kind": "env", "env": { "CLOUD_TOKEN": cred } }),
        )
        .await?;
    assert_eq!(s, 201, "{binding}");
    let (s, body) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/provider-bindings", nulls.id),
            json!({ "bindingId": binding["id"] }),
        )
        .await?;
    assert!(s < 300, "{body}");

    // The null Capsule's resources exist, so destroying them is a destroying plan.
    let first = stack
        .wait(stack.client.plan(nulls.id, None).await?.id)
        .await?;
    let applied = stack
        .wait(stack.client.apply(first.id, None).await?.id)
        .await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    let (s, body) = stack
        .call(
            "PUT",
            &format!("/api/v1/capsules/{}/rules", nulls.id),
            json!({ "maxDestroy": 0 }),
        )
        .await?;
    assert_eq!(s, 200, "{body}");
    let mut sensitive = Map::new();
    sensitive.insert("revision".into(), Value::String(canary.clone()));
    let canary_plan = stack
        .wait(
            stack
                .client
                .plan_with(
                    nulls.id,
                    None,
                    &PlanRequest {
                        sensitive_vars: sensitive,
                        ..PlanRequest::default()
                    },
                )
                .await?
                .id,
        )
        .await?;
    assert_eq!(canary_plan.status, RunStatus::Planned, "{canary_plan:?}");
    // The diff the page renders is masked at the source.
    let (s, plan_view) = stack
        .call(
            "GET",
            &format!("/api/v1/runs/{}/plan", canary_plan.id),
            Value::Null,
        )
        .await?;
    assert_eq!(s, 200, "{plan_view}");
    let text = plan_view.to_string();
    assert!(!text.contains(&canary) && !text.contains(&cred), "{text}");
    assert!(text.contains("null_resource.node[0]"), "{text}");

    let (operator, _) = stack.token("dash-operator", "operator").await?;
    let (approver, approver_client) = stack.token("dash-approver", "approver").await?;
    let (viewer, _) = stack.token("dash-viewer", "viewer").await?;
    let shots = screenshots();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/browser/dashboard.cjs");
    let out = tokio::process::Command::new("node")
        .arg(script)
        .env("PLAYWRIGHT_CORE", &module)
        .env("BASE_URL", &stack.api_url)
        .env("CAPSULE_ID", network.id.to_string())
        .env("NULL_CAPSULE_ID", nulls.id.to_string())
        .env("CANARY", &canary)
        .env("CREDENTIAL_CANARY", &cred)
        .env("CANARY_RUN_ID", canary_plan.id.to_string())
        .env("SCREENSHOT_DIR", &shots)
        .env("OPERATOR_TOKEN", &operator)
        .env("APPROVER_TOKEN", &approver)
        .env("VIEWER_TOKEN", &viewer)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser test failed ({}):\n{stderr}",
        out.status
    );
    let line = String::from_utf8_lossy(&out.stdout);
    let seen: Seen = serde_json::from_str(line.trim())
        .map_err(|e| anyhow::anyhow!("the browser test's report {line:?}: {e}"))?;
    eprintln!("dashboard: {seen:?}; screenshots in {}", shots.display());
    if seen.evidence_awaited {
        eprintln!("dashboard: the apply's page came before its statement and waited for it");
    }
    assert!(seen.seen.pages >= 10 && seen.seen.streams == 3, "{seen:?}");
    assert_eq!(seen.seen.steps.len(), 9, "{seen:?}");
    assert_eq!(seen.viewer_forged_status, 403);

    // What the browser did is what Postgres holds.
    let plan = stack.client.get_run(seen.install_plan_run).await?;
    assert!(
        plan.auto_apply_requested,
        "Install plans with autoApplyRequested"
    );
    let install = stack.client.get_run(seen.install_apply_run).await?;
    assert_eq!(install.status, RunStatus::Applied, "{install:?}");
    assert_eq!(install.plan_run_id, Some(plan.id));
    assert_eq!(install.outputs, Some(json!({ "vpc": "vpc-eu" })));
    let held = approver_client.get_run(seen.held_run).await?;
    assert_eq!(held.kind, RunKind::Apply);
    assert_eq!(held.status, RunStatus::Applied, "{held:?}");
    let destroy_plan = stack
        .client
        .get_run(held.plan_run_id.expect("the held apply carries out a plan"))
        .await?;
    assert_eq!(destroy_plan.kind, RunKind::Destroy);
    let digest = held.plan_digest.clone().expect("plan digest");
    assert!(digest.starts_with(&seen.approved_digest_prefix));
    let approvals = takosumi_store::approvals::approvals(&stack.ctx.pool, held.id).await?;
    assert_eq!(
        approvals.len(),
        1,
        "only the approver's approval counts: {approvals:?}"
    );
    assert_eq!(approvals[0].approver_role, "approver");
    assert_eq!(approvals[0].plan_digest.as_deref(), Some(digest.as_str()));
    let approver_id = takosumi_store::tokens::find(&stack.ctx.pool, &approver)
        .await?
        .expect("approver token")
        .id;
    assert_eq!(approvals[0].approver_id, approver_id.to_string());
    // The sessions the browser made are the only trace of it, and hold no token.
    let sessions: i64 = sqlx::query_scalar("SELECT count(*) FROM dashboard_sessions")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert!(sessions >= 1, "the last sign-in's session is kept");
    for png in [
        "capsule",
        "run-plan",
        "run-apply",
        "workspace",
        "run-held",
        "run-approved",
    ] {
        let p = shots.join(format!("{png}.png"));
        assert!(
            std::fs::metadata(&p)
                .map(|m| m.len() > 1000)
                .unwrap_or(false),
            "screenshot {} missing",
            p.display()
        );
    }
    stack.stop().await
}

/// `takosumi watch` follows the same stream the Run page does, live, and exits with the
/// Run's outcome; `takosumi diff` prints the same masked diff the page renders.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_watches_the_stream_and_prints_the_diff() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let ws = stack.client.create_workspace("ws-watch").await?;
    let repo = GitRepo::with_example("network")?;
    let cap = capsule(
        &stack,
        ws.id,
        "network",
        &repo,
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let plan = stack.client.plan(cap.id, None).await?;
    let cli = async |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = stack.cli(&args).await?;
        anyhow::Ok((out.code, out.stdout, out.stderr))
    };
    // Started while the plan is queued: it follows the Run to its end.
    let (code, out, err) = cli(vec!["watch".into(), plan.id.to_string()]).await?;
    assert_eq!(code, 0, "{out}\n{err}");
    for expected in [
        "queued",
        "claimed",
        "planned",
        "== init ==",
        "== plan ==",
        "-- planned --",
    ] {
        assert!(
            out.contains(expected),
            "watch printed no {expected:?}:\n{out}"
        );
    }
    let settled = stack.client.get_run(plan.id).await?;
    assert_eq!(settled.status, RunStatus::Planned);
    let (code, out, err) = cli(vec!["diff".into(), plan.id.to_string()]).await?;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "output vpc: null -> \"vpc-eu\"\n");
    let (code, out, _) = cli(vec!["--json".into(), "watch".into(), plan.id.to_string()]).await?;
    assert_eq!(code, 0);
    let last: takosumi_client::StreamEvent =
        serde_json::from_str(out.lines().last().unwrap_or_default())?;
    assert_eq!(
        last,
        takosumi_client::StreamEvent::End {
            status: RunStatus::Planned
        }
    );
    stack.stop().await
}
