//! End-to-end: the Run record — cancel at each stage, destroy, cost, Run history and
//! activity, unknown_outcome resolution, and the `takosumi` CLI — through the real API,
//! RabbitMQ, Postgres, the S3 server and terraform 1.0.3 (the tests use `terraform`;
//! OpenTofu cannot be installed on these machines).

use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Map, Value, json};
use takosumi_client::{Capsule, Client, NewCapsule, RunQuery, Source};
use takosumi_core::{
    ActivityKind, ResolutionAction, Role, RunKind, RunMessage, RunStatus, StateVersionId,
    WorkspaceId,
};
use takosumi_tests::{GitRepo, Options, Stack, Steps};
use tokio::io::{AsyncBufReadExt, BufReader};

const NULL_PROVIDER: &str = r#"terraform {
  required_providers {
    null = {
      source  = "hashicorp/null"
      version = "2.1.2"
    }
  }
}
"#;

async fn workspace(stack: &Stack) -> anyhow::Result<WorkspaceId> {
    let name = format!("ws-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    Ok(stack.client.create_workspace(&name).await?.id)
}

async fn register_in(
    stack: &Stack,
    ws: WorkspaceId,
    name: &str,
    repo: &GitRepo,
    dir: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    let vars: Map<String, Value> = vars.as_object().cloned().unwrap_or_default();
    let req = NewCapsule {
        name: name.into(),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: dir.into(),
        tool: "terraform".into(),
        vars,
    };
    Ok(stack.client.create_capsule(ws, &req).await?)
}

async fn register(
    stack: &Stack,
    repo: &GitRepo,
    dir: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    let ws = workspace(stack).await?;
    register_in(stack, ws, "capsule", repo, dir, vars).await
}

/// A raw call: the status and the JSON body (for status codes the typed client hides).
async fn call(
    stack: &Stack,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> anyhow::Result<(u16, Value)> {
    let mut rb = reqwest::Client::new()
        .request(method, format!("{}{path}", stack.api_url))
        .bearer_auth(token);
    if let Some(body) = body {
        rb = rb.json(&body);
    }
    let resp = rb.send().await?;
    let status = resp.status().as_u16();
    let text = resp.text().await?;
    Ok((
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

/// `GET /runs/{id}` as the admin sees it (200 asserted).
async fn run_view(stack: &Stack, run: takosumi_core::RunId) -> anyhow::Result<Value> {
    let (status, body) = call(
        stack,
        reqwest::Method::GET,
        &format!("/api/v1/runs/{run}"),
        &stack.admin_token,
        None,
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    Ok(body)
}

async fn token(stack: &Stack, role: &str) -> anyhow::Result<String> {
    let token = format!("tks_{role}_{}", uuid::Uuid::new_v4().simple());
    takosumi_store::tokens::upsert(&stack.ctx.pool, &token, role, role.parse()?, None).await?;
    Ok(token)
}

async fn wait_until(what: &str, secs: u64, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Live (not zombie) processes whose command line has every one of `parts` as an argument
/// (or, for a path, contains it).
fn processes_with(parts: &[&str]) -> Vec<u32> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        // bubblewrap's own command line names the program it sandboxes: skip it
        let sandbox = args.first().is_some_and(|a| a.ends_with("bwrap"));
        if !sandbox
            && parts.iter().all(|p| {
                args.iter()
                    .any(|a| a == p || (p.contains('/') && a.contains(p)))
            })
            && !is_zombie(pid)
        {
            found.push(pid);
        }
    }
    found
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// The live children of `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                })
                == Some(parent)
        })
        .filter(|pid| !is_zombie(*pid))
        .collect()
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid)
}

/// The Capsule's current state, unsealed.
async fn current_state(stack: &Stack, sv: StateVersionId) -> anyhow::Result<Value> {
    let row = takosumi_store::states::versions::get(&stack.ctx.pool, sv)
        .await?
        .expect("state version row");
    let sealed = stack.ctx.objects.get(&row.object_key, 64 << 20).await?;
    let bytes = stack
        .ctx
        .sealer
        .unseal(takosumi_seal::Purpose::State, &sv.to_string(), &sealed)?;
    Ok(serde_json::from_slice(&bytes)?)
}

fn resource_names(state: &Value) -> Vec<String> {
    state["resources"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .filter_map(|r| r["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn kinds(events: &[takosumi_client::RunEvent]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

/// A queued Run is canceled at once (who and when recorded, an event and an activity
/// entry), no handler ever runs it afterwards, a viewer may not cancel, and canceling a
/// finished Run is 409 `run_finished`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_run_is_canceled_at_once_and_a_finished_one_is_409() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let plan = stack.client.plan(capsule.id, None).await?;
    assert_eq!(plan.status, RunStatus::Queued);
    let path = format!("/api/v1/runs/{}/cancel", plan.id);

    let viewer = token(&stack, "viewer").await?;
    let (status, body) = call(&stack, reqwest::Method::POST, &path, &viewer, None).await?;
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );
    assert_eq!(
        stack.client.get_run(plan.id).await?.status,
        RunStatus::Queued
    );

    let (status, body) = call(
        &stack,
        reqwest::Method::POST,
        &path,
        &stack.admin_token,
        Some(json!({ "reason": "wrong branch" })),
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "canceled");
    assert!(
        body["canceledBy"]
            .as_str()
            .unwrap()
            .starts_with("user:tok_"),
        "{body}"
    );
    assert!(body["canceledAt"].is_string(), "{body}");

    let events = stack.client.events(plan.id).await?;
    assert_eq!(kinds(&events), ["queued", "canceled"]);
    assert_eq!(events[1].data["from"], "queued");
    assert_eq!(events[1].data["reason"], "wrong branch");
    let activity = stack
        .client
        .activity(plan.workspace_id, None, None, None)
        .await?;
    assert!(
        activity
            .activity
            .iter()
            .any(|a| a.kind == "run_canceled" && a.subject == plan.id.to_string()),
        "{activity:?}"
    );

    // The wake-up still arrives: the handler finds nothing to do.
    let outcome = takosumi_plan::handle(&stack.ctx, RunMessage { run_id: plan.id }).await?;
    assert!(
        matches!(outcome, takosumi_core::Outcome::Skipped(_)),
        "{outcome:?}"
    );
    assert_eq!(stack.tool_count("init"), 0);
    assert_eq!(
        stack.client.get_run(plan.id).await?.status,
        RunStatus::Canceled
    );

    let err = stack.client.cancel(plan.id, None).await.unwrap_err();
    assert_eq!(
        (err.status(), err.code()),
        (Some(409), Some("run_finished"))
    );
    let err = stack.client.cost(plan.id).await.unwrap_err();
    assert_eq!(err.code(), Some("plan_not_ready"));
    let (status, _) = call(
        &stack,
        reqwest::Method::POST,
        &path,
        &stack.admin_token,
        Some(json!({"why": 1})),
    )
    .await?;
    assert_eq!(status, 400, "unknown fields are refused");
    stack.stop().await
}

/// A plan's admission, and an apply's, answers with the Run as it was recorded: the
/// `202`'s body is what `GET /runs/{id}` shows of the new Run (its status, pins, variable
/// names, actor, times), and the row's `queued` event was written with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_admission_answers_the_run_as_recorded() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let (status, answered) = call(
        &stack,
        reqwest::Method::POST,
        &format!("/api/v1/capsules/{}/plan", capsule.id),
        &stack.admin_token,
        Some(json!({ "vars": { "region": "us" } })),
    )
    .await?;
    assert_eq!(status, 202, "{answered}");
    let run: takosumi_core::RunId = answered["id"].as_str().unwrap().parse()?;
    assert_eq!(
        answered,
        run_view(&stack, run).await?,
        "the admission's answer is the recorded Run"
    );
    assert_eq!(answered["status"], "queued", "{answered}");
    assert!(
        !answered.to_string().contains("\"us\""),
        "a variable's value is not served: {answered}"
    );
    let events = stack.client.events(run).await?;
    assert_eq!(kinds(&events), ["queued"]);

    // The plan planned and released (its handlers called here, none runs on its own), its
    // apply proposed: the answer carries the plan's pins as the record does.
    let msg = takosumi_core::RunMessage { run_id: run };
    takosumi_plan::handle(&stack.ctx, msg).await?;
    takosumi_gate::handle(&stack.ctx, msg).await?;
    assert_eq!(stack.client.get_run(run).await?.status, RunStatus::Planned);
    let (status, answered) = call(
        &stack,
        reqwest::Method::POST,
        &format!("/api/v1/runs/{run}/apply"),
        &stack.admin_token,
        Some(json!({})),
    )
    .await?;
    assert_eq!(status, 202, "{answered}");
    let apply: takosumi_core::RunId = answered["id"].as_str().unwrap().parse()?;
    assert_eq!(
        answered,
        run_view(&stack, apply).await?,
        "the apply's answer is the recorded Run"
    );
    assert_eq!(
        (&answered["status"], &answered["planRunId"]),
        (&json!("queued"), &json!(run)),
        "{answered}"
    );
    let plan = run_view(&stack, run).await?;
    assert!(plan["planDigest"].is_string(), "{plan}");
    assert_eq!(
        (&answered["planDigest"], &answered["sourceSnapshot"]),
        (&plan["planDigest"], &plan["sourceSnapshot"]),
        "the apply is pinned to its plan from its first answer: {answered}"
    );
    assert_eq!(kinds(&stack.client.events(apply).await?), ["queued"]);
    Ok(())
}

/// A held Run (an agent's plan, held before anything plans) is canceled at once too, and
/// a later approval cannot bring it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_run_is_canceled_at_once() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let agent = token(&stack, "agent").await?;
    let (status, body) = call(
        &stack,
        reqwest::Method::POST,
        &format!("/api/v1/capsules/{}/plan", capsule.id),
        &agent,
        Some(json!({})),
    )
    .await?;
    assert_eq!(status, 202, "{body}");
    assert_eq!(
        body["status"], "held",
        "an agent's plan is held first: {body}"
    );
    let run: takosumi_core::RunId = body["id"].as_str().unwrap().parse()?;

    let canceled = stack.client.cancel(run, None).await?;
    assert_eq!(canceled.status, RunStatus::Canceled);
    let events = stack.client.events(run).await?;
    let last = events.last().unwrap();
    assert_eq!(
        (last.kind.as_str(), &last.data["from"]),
        ("canceled", &json!("held"))
    );
    let _ = call(
        &stack,
        reqwest::Method::POST,
        &format!("/api/v1/runs/{run}/approve"),
        &stack.admin_token,
        Some(json!({})),
    )
    .await?;
    assert_eq!(stack.client.get_run(run).await?.status, RunStatus::Canceled);
    stack.stop().await
}

/// A provider failure that left state behind (the second of two resources fails after
/// the first was created): the Run fails `apply_failed`, says a StateVersion was recorded,
/// points at it, and that StateVersion holds the created resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_apply_that_changed_state_records_a_state_version() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let config = format!(
        "{NULL_PROVIDER}
resource \"null_resource\" \"ok\" {{}}

resource \"null_resource\" \"broken\" {{
  depends_on = [null_resource.ok]
  provisioner \"local-exec\" {{
    command = \"exit 3\"
  }}
}}
"
    );
    let repo = GitRepo::new(&[("infra/broken/main.tf", &config)])?;
    let capsule = register(&stack, &repo, "infra/broken", json!({})).await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Failed, "{apply:?}");
    let error = apply.error.clone().expect("error");
    assert_eq!(error.code, "apply_failed");
    assert!(
        error.message.contains("a new StateVersion was recorded"),
        "{}",
        error.message
    );
    let sv = apply
        .state_version_id
        .expect("the Run points at the StateVersion");
    let capsule = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(
        (capsule.state_generation, capsule.current_state_version_id),
        (1, Some(sv))
    );
    let state = current_state(&stack, sv).await?;
    assert!(resource_names(&state).contains(&"ok".to_owned()), "{state}");
    let events = stack.client.events(apply.id).await?;
    let k = kinds(&events);
    assert!(
        k.contains(&"state_version_written") && k.ends_with(&["failed"]),
        "{k:?}"
    );
    stack.stop().await
}

/// A Run canceled while the tool plans: the cancel is recorded at once (202), the handler
/// interrupts the tool, the tool's process group is gone, and the Run ends `canceled`
/// with who asked; the plan handler stays healthy and plans the next Run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn canceling_a_running_plan_interrupts_the_tool() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({})).await?;
    stack.pause_plans(true)?;
    let plan = stack.client.plan(capsule.id, None).await?;
    wait_until("the tool's plan to start", 60, || {
        stack.tool_invocations().iter().any(|l| l == "paused")
    })
    .await;
    let wrapper = stack.env_vars()["TAKOSUMI_TERRAFORM_BIN"].clone();
    let mut tool = processes_with(&[&wrapper, "plan"]);
    assert_eq!(tool.len(), 1, "the paused tool process: {tool:?}");
    // the wrapper's wait loop (`sleep 0.1`), when caught
    tool.extend(children_of(tool[0]));
    assert_eq!(
        stack.client.get_run(plan.id).await?.status,
        RunStatus::Planning
    );

    let (status, body) = call(
        &stack,
        reqwest::Method::POST,
        &format!("/api/v1/runs/{}/cancel", plan.id),
        &stack.admin_token,
        None,
    )
    .await?;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["status"], "planning");
    assert!(body["cancelRequestedAt"].is_string(), "{body}");
    // The typed field reads back as the API wrote it (chrono's own form, digit for digit).
    let requested_at = &body["cancelRequestedAt"];
    // Asking again changes nothing. The handler may already have interrupted the tool by
    // now (it reacts within a poll), so the second ask meets either the same pending cancel
    // or the finished Run; in both cases the recorded request is the first one.
    match stack.client.cancel(plan.id, None).await {
        Ok(again) => assert_eq!(&json!(again.cancel_requested_at), requested_at),
        Err(err) => {
            assert_eq!(err.code(), Some("run_finished"), "{err}");
            let now = stack.client.get_run(plan.id).await?;
            assert_eq!(now.status, RunStatus::Canceled, "{now:?}");
            assert_eq!(&json!(now.cancel_requested_at), requested_at);
        }
    }

    let started = std::time::Instant::now();
    let done = stack.wait(plan.id).await?;
    assert_eq!(done.status, RunStatus::Canceled, "{done:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert!(
        done.canceled_by
            .as_deref()
            .unwrap()
            .starts_with("user:tok_")
    );
    assert!(
        done.plan_digest.is_none(),
        "an interrupted plan records no plan"
    );
    wait_until("the tool process to be gone", 10, || {
        !tool.iter().any(|p| alive(*p))
    })
    .await;
    assert!(processes_with(&[&wrapper, "plan"]).is_empty());

    let events = stack.client.events(plan.id).await?;
    let k = kinds(&events);
    assert!(
        k.contains(&"cancel_requested") && k.contains(&"canceled"),
        "{k:?}"
    );
    assert!(!k.contains(&"planned") && !k.contains(&"failed"), "{k:?}");
    let canceled = events.iter().find(|e| e.kind == "canceled").unwrap();
    assert_eq!(canceled.data["whileRunning"], true);
    assert_eq!(canceled.data["step"], "plan");
    let logs = stack.client.logs(plan.id).await?;
    assert!(logs.contains("== init =="), "{logs}");
    assert!(
        logs.contains("[takosumi: interrupted: the run was canceled]"),
        "{logs}"
    );
    let row = takosumi_store::runs::get(&stack.ctx.pool, plan.id)
        .await?
        .unwrap();
    assert!(row.lease_owner.is_none());
    let err = stack.client.cancel(plan.id, None).await.unwrap_err();
    assert_eq!(err.code(), Some("run_finished"));

    stack.pause_plans(false)?;
    let next = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(next.status, RunStatus::Planned, "{next:?}");
    stack.stop().await
}

/// A cancel requested for a plan whose handler then vanished: when the reaper takes the
/// expired claim back, the Run ends `canceled` as asked (by the person who asked), not
/// queued again for a new handler to start and only then cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_whose_handler_vanished_after_a_cancel_request_is_canceled_by_the_reaper()
-> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({})).await?;
    let plan = stack.client.plan(capsule.id, None).await?;
    // A handler claims it, then vanishes (no plan step runs in this stack).
    let data = json!({ "step": "plan" });
    assert!(
        takosumi_store::runs::claim(
            &stack.ctx.pool,
            plan.id,
            &[takosumi_core::RunKind::Plan],
            (RunStatus::Queued, RunStatus::Planning),
            ("ghost", 60),
            takosumi_store::runs::ClaimRecord {
                data: &data,
                sandbox: None,
            },
        )
        .await?
    );
    let (status, body) = call(
        &stack,
        reqwest::Method::POST,
        &format!("/api/v1/runs/{}/cancel", plan.id),
        &stack.admin_token,
        None,
    )
    .await?;
    assert_eq!(status, 202, "{body}");
    sqlx::query("UPDATE runs SET lease_until = now() - interval '1 second' WHERE id = $1")
        .bind(plan.id.as_uuid())
        .execute(&stack.ctx.pool)
        .await?;

    // The API's own reaper takes it back.
    let done = stack.wait(plan.id).await?;
    assert_eq!(done.status, RunStatus::Canceled, "{done:?}");
    assert!(
        done.canceled_by
            .as_deref()
            .is_some_and(|b| b.starts_with("user:tok_")),
        "{done:?}"
    );
    assert!(done.canceled_at.is_some(), "{done:?}");
    let k: Vec<String> = stack
        .client
        .events(plan.id)
        .await?
        .into_iter()
        .map(|e| e.kind.to_string())
        .collect();
    assert!(k.iter().any(|k| k == "lease_expired_canceled"), "{k:?}");
    let wakeups: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE payload->>'runId' = $1")
            .bind(plan.id.to_string())
            .fetch_one(&stack.ctx.pool)
            .await?;
    assert_eq!(
        wakeups, 1,
        "the submission's wake-up only, none after the cancel"
    );
    // Reaping again finds nothing: the pass is safe to run twice.
    assert_eq!(takosumi_runtime::reap_once(&stack.ctx, 3600).await?, 0);
    stack.stop().await
}

/// An apply canceled while the tool applies: terraform is interrupted (SIGINT first), the
/// resource it already created is kept in a new StateVersion the Run points to, the
/// Capsule's generation moves on and the Capsule is free again; the Run ends `canceled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn canceling_a_running_apply_keeps_the_state_the_tool_wrote() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let config = format!(
        "{NULL_PROVIDER}
resource \"null_resource\" \"first\" {{}}

resource \"null_resource\" \"slow\" {{
  depends_on = [null_resource.first]
  provisioner \"local-exec\" {{
    command = \"sleep 67\"
  }}
}}
"
    );
    let repo = GitRepo::new(&[("infra/slow/main.tf", &config)])?;
    let capsule = register(&stack, &repo, "infra/slow", json!({})).await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack.client.apply(plan.id, None).await?;
    wait_until("the provisioner to run", 90, || {
        !processes_with(&["sleep", "67"]).is_empty()
    })
    .await;
    let sleeper = processes_with(&["sleep", "67"]);

    let requested = stack.client.cancel(apply.id, Some("stop it")).await?;
    assert_eq!(requested.status, RunStatus::Applying);
    let done = stack.wait(apply.id).await?;
    assert_eq!(done.status, RunStatus::Canceled, "{done:?}");
    wait_until("the provisioner to be gone", 10, || {
        !sleeper.iter().any(|p| alive(*p))
    })
    .await;

    let sv = done
        .state_version_id
        .expect("the state the tool wrote is recorded");
    let capsule = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(capsule.state_generation, 1);
    assert_eq!(capsule.current_state_version_id, Some(sv));
    assert_eq!(capsule.status, "ok", "the Capsule is free again");
    let state = current_state(&stack, sv).await?;
    assert!(
        resource_names(&state).contains(&"first".to_owned()),
        "{state}"
    );

    let events = stack.client.events(apply.id).await?;
    let k = kinds(&events);
    assert!(k.contains(&"state_version_written"), "{k:?}");
    assert!(!k.contains(&"applied") && !k.contains(&"failed"), "{k:?}");
    let canceled = events.iter().find(|e| e.kind == "canceled").unwrap();
    assert_eq!(canceled.data["stateVersionId"], json!(sv));
    let logs = stack.client.logs(apply.id).await?;
    assert!(
        logs.contains("Interrupt received"),
        "terraform was sent SIGINT first: {logs}"
    );
    stack.stop().await
}

/// The null example applied, then `DELETE /capsules/{id}`: a destroy plan counting 2
/// destroys from `show -json`, whose apply leaves a state with no resources and moves
/// the generation on; the cost estimate prices null_resource at 0 before and after, and
/// the activity record lists the Capsule, every Run started and both StateVersions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn destroy_plan_applied_removes_every_resource() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({ "instances": 2 })).await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");

    let cost = stack.client.cost(plan.id).await?;
    assert_eq!(cost.plan_run_id, plan.id);
    assert_eq!(cost.estimate.currency, "USD");
    let addrs: Vec<&str> = cost
        .estimate
        .resources
        .iter()
        .map(|r| r.address.as_str())
        .collect();
    assert_eq!(addrs, ["null_resource.node[0]", "null_resource.node[1]"]);
    assert!(
        cost.estimate
            .resources
            .iter()
            .all(|r| r.actions == ["create"])
    );
    assert!(cost.estimate.unpriced.is_empty() && cost.estimate.complete);
    assert_eq!(cost.estimate.total.proposed, 0.0);

    let applied = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    // An Apply Run answers with the estimate of the plan it carried out.
    assert_eq!(stack.client.cost(applied.id).await?.plan_run_id, plan.id);

    let destroy = stack.client.destroy(capsule.id, None).await?;
    assert_eq!(destroy.kind, RunKind::Destroy);
    let destroy = stack.wait(destroy.id).await?;
    assert_eq!(destroy.status, RunStatus::Planned, "{destroy:?}");
    let changes = destroy.changes.expect("changes");
    assert_eq!((changes.add, changes.change, changes.destroy), (0, 0, 2));
    let events = stack.client.events(destroy.id).await?;
    let plan_started = events
        .iter()
        .find(|e| e.kind == "tool_started" && e.data["command"] == "plan")
        .expect("plan started");
    assert_eq!(plan_started.data["destroy"], true);
    let dcost = stack.client.cost(destroy.id).await?;
    assert!(
        dcost
            .estimate
            .resources
            .iter()
            .all(|r| r.actions == ["delete"]),
        "{dcost:?}"
    );
    assert_eq!(dcost.estimate.total.delta, 0.0);

    let removed = stack
        .wait(stack.client.apply(destroy.id, None).await?.id)
        .await?;
    assert_eq!(removed.status, RunStatus::Applied, "{removed:?}");
    assert_eq!(removed.state_generation, Some(2));
    let capsule_now = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(capsule_now.state_generation, 2);
    let sv = capsule_now.current_state_version_id.expect("state version");
    assert_eq!(Some(sv), removed.state_version_id);
    let state = current_state(&stack, sv).await?;
    assert!(resource_names(&state).is_empty(), "{state}");

    let activity = stack
        .client
        .activity(capsule.workspace_id, None, Some(100), None)
        .await?;
    let count = |k: &str| activity.activity.iter().filter(|a| a.kind == k).count();
    assert_eq!(count("capsule_registered"), 1);
    assert_eq!(count("run_started"), 4);
    assert_eq!(count("state_version_written"), 2);
    let written: HashSet<&str> = activity
        .activity
        .iter()
        .filter(|a| a.kind == "state_version_written")
        .map(|a| a.subject.as_str())
        .collect();
    assert!(written.contains(sv.to_string().as_str()));
    // Newest first; one kind; pages of one entry walk the same record.
    assert!(activity.activity.windows(2).all(|w| w[0].id > w[1].id));
    let only = stack
        .client
        .activity(
            capsule.workspace_id,
            Some("state_version_written"),
            None,
            None,
        )
        .await?;
    assert_eq!(only.activity.len(), 2);
    let mut cursor: Option<String> = None;
    let mut walked = Vec::new();
    loop {
        let page = stack
            .client
            .activity(capsule.workspace_id, None, Some(1), cursor.as_deref())
            .await?;
        walked.extend(page.activity.iter().map(|a| a.id));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    let all: Vec<i64> = activity.activity.iter().map(|a| a.id).collect();
    assert_eq!(walked, all);
    stack.stop().await
}

/// `GET /workspaces/{ws}/runs`: newest first, filtered by Capsule, kind and status (alone
/// and together), paged with an opaque cursor that neither skips nor repeats a Run; bad
/// filters are 4xx; another Workspace's token sees nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_list_filters_and_pages() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let a = register_in(
        &stack,
        ws,
        "a",
        &repo,
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let b = register_in(
        &stack,
        ws,
        "b",
        &repo,
        "infra/network",
        json!({ "region": "us" }),
    )
    .await?;
    let mut created = Vec::new();
    for _ in 0..5 {
        created.push(stack.client.plan(a.id, None).await?.id);
    }
    for _ in 0..2 {
        created.push(stack.client.destroy(b.id, None).await?.id);
    }
    let canceled = created[1];
    stack.client.cancel(canceled, None).await?;

    let all = stack.client.list_runs(ws, &RunQuery::default()).await?;
    let ids: Vec<_> = all.runs.iter().map(|r| r.id).collect();
    let newest_first: Vec<_> = created.iter().rev().copied().collect();
    assert_eq!(ids, newest_first);
    assert!(all.next_cursor.is_none());
    assert_eq!(all.unknown_outcome_count, 0);

    let mut walked = Vec::new();
    let mut q = RunQuery {
        limit: Some(2),
        ..RunQuery::default()
    };
    loop {
        let page = stack.client.list_runs(ws, &q).await?;
        assert!(page.runs.len() <= 2);
        walked.extend(page.runs.iter().map(|r| r.id));
        match page.next_cursor {
            Some(c) => q.cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(walked, newest_first, "pages skip or repeat nothing");

    let count = |q: RunQuery| {
        let client = stack.client.clone();
        async move { client.list_runs(ws, &q).await.map(|p| p.runs) }
    };
    let of_b = count(RunQuery {
        capsule: Some(b.id),
        ..RunQuery::default()
    })
    .await?;
    assert_eq!(of_b.len(), 2);
    assert!(of_b.iter().all(|r| r.capsule_id == b.id));
    let destroys = count(RunQuery {
        kind: Some(RunKind::Destroy),
        ..RunQuery::default()
    })
    .await?;
    assert_eq!(destroys.len(), 2);
    let cancels = count(RunQuery {
        status: Some(RunStatus::Canceled),
        ..RunQuery::default()
    })
    .await?;
    assert_eq!(cancels.iter().map(|r| r.id).collect::<Vec<_>>(), [canceled]);
    let queued_plans = count(RunQuery {
        capsule: Some(a.id),
        kind: Some(RunKind::Plan),
        status: Some(RunStatus::Queued),
        ..RunQuery::default()
    })
    .await?;
    assert_eq!(queued_plans.len(), 4);

    // Each filter shape is its own statement: walked a page of 1 at a time, each lists
    // exactly what its unpaged listing does, newest first.
    let shapes = [
        RunQuery {
            capsule: Some(a.id),
            ..RunQuery::default()
        },
        RunQuery {
            capsule: Some(a.id),
            status: Some(RunStatus::Queued),
            ..RunQuery::default()
        },
        RunQuery {
            status: Some(RunStatus::Queued),
            ..RunQuery::default()
        },
        RunQuery {
            status: Some(RunStatus::Queued),
            kind: Some(RunKind::Plan),
            ..RunQuery::default()
        },
        RunQuery {
            kind: Some(RunKind::Plan),
            ..RunQuery::default()
        },
    ];
    for shape in shapes {
        let unpaged: Vec<_> = count(shape.clone()).await?.iter().map(|r| r.id).collect();
        assert!(unpaged.len() >= 2, "{shape:?} lists several Runs");
        let expected: Vec<_> = newest_first
            .iter()
            .filter(|id| unpaged.contains(id))
            .copied()
            .collect();
        assert_eq!(unpaged, expected, "{shape:?} lists newest first");
        let mut q = RunQuery {
            limit: Some(1),
            ..shape.clone()
        };
        let mut walked = Vec::new();
        loop {
            let page = stack.client.list_runs(ws, &q).await?;
            walked.extend(page.runs.iter().map(|r| r.id));
            match page.next_cursor {
                Some(c) => q.cursor = Some(c),
                None => break,
            }
        }
        assert_eq!(walked, unpaged, "{shape:?} pages skip or repeat nothing");
    }

    let base = format!("/api/v1/workspaces/{ws}/runs");
    for (query, status, code) in [
        ("?kind=nope", 422, "invalid_filter"),
        ("?status=done", 422, "invalid_filter"),
        ("?limit=0", 422, "invalid_limit"),
        ("?limit=101", 422, "invalid_limit"),
        ("?cursor=zz", 400, "invalid_cursor"),
        ("?capsule=run_1", 400, "invalid_id"),
        ("?colour=red", 400, "invalid_query"),
    ] {
        let (s, body) = call(
            &stack,
            reqwest::Method::GET,
            &format!("{base}{query}"),
            &stack.admin_token,
            None,
        )
        .await?;
        assert_eq!(
            (s, body["code"].as_str()),
            (status, Some(code)),
            "{query}: {body}"
        );
    }
    // A token limited to another Workspace learns nothing about this one.
    let other = workspace(&stack).await?;
    let scoped = format!("tks_scoped_{}", uuid::Uuid::new_v4().simple());
    takosumi_store::tokens::upsert(&stack.ctx.pool, &scoped, "scoped", Role::Admin, Some(other))
        .await?;
    let (s, _) = call(&stack, reqwest::Method::GET, &base, &scoped, None).await?;
    assert_eq!(s, 404);
    let (s, _) = call(
        &stack,
        reqwest::Method::GET,
        &format!("/api/v1/workspaces/{ws}/activity"),
        &scoped,
        None,
    )
    .await?;
    assert_eq!(s, 404);
    // The API remembers Workspaces it saw exist, never one it did not: an id unknown at
    // first is found once another process (here: SQL) has created it.
    let later = WorkspaceId::new();
    let page = format!("/api/v1/workspaces/{later}/runs");
    let get_page = || {
        call(
            &stack,
            reqwest::Method::GET,
            &page,
            &stack.admin_token,
            None,
        )
    };
    let (s, body) = get_page().await?;
    assert_eq!(
        (s, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    sqlx::query("INSERT INTO workspaces (id, name) VALUES ($1, 'created-elsewhere')")
        .bind(later.as_uuid())
        .execute(&stack.ctx.pool)
        .await?;
    let (s, body) = get_page().await?;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["runs"].as_array().map(Vec::len), Some(0), "{body}");
    stack.stop().await
}

/// The history listings' pool plans each statement once per session: a page is not
/// planned afresh (Postgres keeps choosing custom plans for these statements on the main
/// pool). Checked in Postgres's own count of each prepared statement's plans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_listings_are_planned_once_per_session() -> anyhow::Result<()> {
    use takosumi_store::runs::list::{RunFilter, count_unresolved_unknown, list_runs};
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let ws = workspace(&stack).await?;
    let history = takosumi_store::plan_once_pool(&stack.ctx.pool, 1);
    let mut conn = history.acquire().await?;
    let mode: String = sqlx::query_scalar("SHOW plan_cache_mode")
        .fetch_one(conn.db())
        .await?;
    assert_eq!(mode, "force_generic_plan");
    for _ in 0..7 {
        let (page, next) = list_runs(conn.db(), ws, &RunFilter::default(), None, 50).await?;
        assert!(page.is_empty() && next.is_none());
        assert_eq!(count_unresolved_unknown(conn.db(), ws).await?, 0);
    }
    let plans: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
          WHERE statement LIKE '%FROM runs%' AND statement NOT LIKE '%pg_prepared_statements%'",
    )
    .fetch_all(conn.db())
    .await?;
    assert_eq!(plans.len(), 2, "{plans:?}");
    for (statement, generic, custom) in &plans {
        assert_eq!((*generic, *custom), (7, 0), "{statement}");
    }
    drop(conn);
    history.close().await;
    stack.stop().await
}

/// An apply whose handler vanished becomes `unknown_outcome` (the real reaper); it is
/// counted on every Run list of its Workspace and listed by `status=unknown_outcome`
/// until an admin records a resolution (who, when, the note: event and activity);
/// operators may not resolve, a note is required, and a Run is resolved once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_outcome_is_listed_until_an_admin_resolves_it() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let plan = stack.client.plan(capsule.id, None).await?;
    let msg = RunMessage { run_id: plan.id };
    takosumi_plan::handle(&stack.ctx, msg).await?;
    takosumi_gate::handle(&stack.ctx, msg).await?;
    let apply = stack.client.apply(plan.id, None).await?;
    takosumi_gate::handle(&stack.ctx, RunMessage { run_id: apply.id }).await?;
    // A handler claims the apply, then vanishes: its 1-second lease runs out.
    let mut tx = stack.ctx.pool.begin().await?;
    let data = json!({ "step": "apply" });
    let record = takosumi_store::runs::ClaimRecord {
        data: &data,
        sandbox: None,
    };
    let claim =
        takosumi_store::runs::claim_apply(&mut tx, apply.id, "vanished-handler", 1, record).await?;
    assert_eq!(claim, takosumi_store::runs::ApplyClaim::Claimed);
    tx.commit().await?;
    let lost = stack.wait(apply.id).await?;
    assert_eq!(lost.status, RunStatus::UnknownOutcome, "{lost:?}");

    let ws = capsule.workspace_id;
    let page = stack.client.list_runs(ws, &RunQuery::default()).await?;
    assert_eq!(page.unknown_outcome_count, 1);
    let listed = stack
        .client
        .list_runs(
            ws,
            &RunQuery {
                status: Some(RunStatus::UnknownOutcome),
                ..RunQuery::default()
            },
        )
        .await?;
    assert_eq!(
        listed.runs.iter().map(|r| r.id).collect::<Vec<_>>(),
        [apply.id]
    );
    assert_eq!(listed.runs[0].resolution, None);

    let path = format!("/api/v1/runs/{}/resolve", apply.id);
    let operator = token(&stack, "operator").await?;
    let good = json!({ "action": "mark_resolved", "note": "checked: nothing was created; state v0 is right" });
    let (s, body) = call(
        &stack,
        reqwest::Method::POST,
        &path,
        &operator,
        Some(good.clone()),
    )
    .await?;
    assert_eq!((s, body["code"].as_str()), (403, Some("forbidden")));
    for (bad, status, code) in [
        (
            json!({ "action": "mark_resolved", "note": "  " }),
            422,
            "invalid_note",
        ),
        (
            json!({ "action": "attach_state", "note": "x" }),
            422,
            "missing_state",
        ),
        (
            json!({ "action": "undo", "note": "x" }),
            422,
            "invalid_action",
        ),
        (json!({ "action": "mark_resolved" }), 400, "invalid_json"),
    ] {
        let (s, body) = call(
            &stack,
            reqwest::Method::POST,
            &path,
            &stack.admin_token,
            Some(bad),
        )
        .await?;
        assert_eq!((s, body["code"].as_str()), (status, Some(code)), "{body}");
    }
    let (s, _) = call(
        &stack,
        reqwest::Method::POST,
        &format!("/api/v1/runs/{}/resolve", plan.id),
        &stack.admin_token,
        Some(good.clone()),
    )
    .await?;
    assert_eq!(s, 409, "only unknown_outcome Runs are resolved");
    assert_eq!(
        stack
            .client
            .list_runs(ws, &RunQuery::default())
            .await?
            .unknown_outcome_count,
        1
    );

    let resolved = stack
        .client
        .resolve(apply.id, good["note"].as_str().unwrap())
        .await?;
    assert_eq!(
        resolved.status,
        RunStatus::UnknownOutcome,
        "the outcome itself stays unknown"
    );
    let r = resolved.resolution.clone().expect("resolved");
    assert_eq!(r.action, ResolutionAction::MarkResolved);
    assert_eq!(r.note.as_deref(), good["note"].as_str());
    assert!(
        r.by.as_deref().unwrap().starts_with("user:tok_") && r.at.is_some(),
        "{r:?}"
    );
    assert_eq!(
        stack
            .client
            .list_runs(ws, &RunQuery::default())
            .await?
            .unknown_outcome_count,
        0
    );
    let events = stack.client.events(apply.id).await?;
    let k = kinds(&events);
    assert!(
        k.contains(&"lease_expired_unknown_outcome") && k.ends_with(&["resolved"]),
        "{k:?}"
    );
    let activity = stack
        .client
        .activity(ws, Some("run_resolved"), None, None)
        .await?;
    assert_eq!(activity.activity.len(), 1);
    assert_eq!(activity.activity[0].subject, apply.id.to_string());
    assert_eq!(activity.activity[0].kind, ActivityKind::RunResolved);
    // A kind that is not one is refused, naming the kinds there are.
    let err = stack
        .client
        .activity(ws, Some("run_resolve"), None, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("invalid_filter"), "{err}");
    assert!(err.to_string().contains("run_resolved, approval"), "{err}");
    let err = stack.client.resolve(apply.id, "again").await.unwrap_err();
    assert_eq!(err.code(), Some("already_resolved"));
    stack.stop().await
}

/// Runs the built `takosumi` binary against the stack's API; returns (exit code, stdout,
/// stderr).
async fn cli(stack: &Stack, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let out = tokio::process::Command::new(takosumi_tests::binary("takosumi")?)
        .env_clear()
        .env("TAKOSUMI_DEPLOY_CONTROL_URL", &stack.api_url)
        .env("TAKOSUMI_DEPLOY_CONTROL_TOKEN", &stack.admin_token)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn run_id_in(text: &str) -> takosumi_core::RunId {
    text.split_whitespace()
        .find_map(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no run id in {text}"))
}

/// The CLI end to end: `plan --watch` shows events and status changes as they happen and
/// exits 0 for a clean plan (1 for a failed one); `status`, `logs --follow`, `cost`,
/// `apply --wait`, `runs` and `activity` print the record; `logs --follow` prints a
/// running plan's init output before the plan ends and exits 1 when the Run ends
/// canceled; `cancel` of a finished Run exits 1 with `run_finished`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cli_watches_follows_and_applies() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({ "instances": 2 })).await?;
    let cap = capsule.id.to_string();
    let ws = capsule.workspace_id.to_string();

    let (code, out, err) = cli(&stack, &["plan", &cap, "--watch"]).await?;
    assert_eq!(code, 0, "{out}\n{err}");
    let run = run_id_in(out.lines().next().unwrap_or_default());
    // The watch ends when the plan is `planned`; the gate records its decision on a plan
    // Run after that, asynchronously, so it is not part of what the watch must show.
    for kind in ["queued", "claimed", "tool_started", "planned"] {
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().nth(1) == Some(kind)),
            "{kind} missing:\n{out}"
        );
    }
    assert!(out.contains("status: planned"), "{out}");
    assert!(out.contains("status:           planned"), "{out}");
    assert!(out.contains("changes:          +2 ~0 -0"), "{out}");

    let (code, out, _) = cli(&stack, &["status", &run.to_string()]).await?;
    assert_eq!(code, 0);
    assert!(out.contains("status:           planned"), "{out}");

    let (code, out, err) = cli(&stack, &["logs", &run.to_string(), "--follow"]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("== init ==") && out.contains("== plan =="),
        "{out}"
    );
    assert!(
        out.contains("Plan: 2 to add, 0 to change, 0 to destroy."),
        "{out}"
    );

    let (code, out, _) = cli(&stack, &["cost", &run.to_string()]).await?;
    assert_eq!(code, 0);
    assert!(
        out.contains("null_resource.node[1]") && out.contains("USD per month"),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("total") && l.contains("+0.00")),
        "{out}"
    );

    let (code, out, err) = cli(&stack, &["apply", &run.to_string(), "--wait"]).await?;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("status:           applied"), "{out}");
    let apply = run_id_in(out.lines().next().unwrap_or_default());

    let (code, out, _) = cli(&stack, &["runs", &ws, "--kind", "apply"]).await?;
    assert_eq!(code, 0);
    assert!(
        out.contains(&apply.to_string()) && !out.contains(&run.to_string()),
        "{out}"
    );
    let (code, out, _) = cli(&stack, &["activity", &ws]).await?;
    assert_eq!(code, 0);
    assert!(
        out.contains("state_version_written") && out.contains("capsule_registered"),
        "{out}"
    );

    let (code, _, err) = cli(&stack, &["cancel", &run.to_string()]).await?;
    assert_eq!(code, 1);
    assert!(err.contains("run_finished"), "{err}");
    let (code, _, err) = cli(&stack, &["runs", &ws, "--kind", "nope"]).await?;
    assert_eq!(code, 2, "a bad flag is a usage error: {err}");

    // Following a running plan: init's output arrives while the plan is still going.
    stack.pause_plans(true)?;
    let (code, out, _) = cli(&stack, &["plan", &cap]).await?;
    assert_eq!(code, 0);
    let live = run_id_in(out.lines().next().unwrap_or_default());
    let mut follower = tokio::process::Command::new(takosumi_tests::binary("takosumi")?)
        .env_clear()
        .env("TAKOSUMI_DEPLOY_CONTROL_URL", &stack.api_url)
        .env("TAKOSUMI_DEPLOY_CONTROL_TOKEN", &stack.admin_token)
        .args(["logs", &live.to_string(), "--follow"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(follower.stdout.take().unwrap()).lines();
    let seen_init = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await? {
            if line.contains("Terraform has been successfully initialized") {
                return Ok::<_, std::io::Error>(true);
            }
        }
        Ok(false)
    })
    .await??;
    assert!(seen_init, "init output never arrived");
    assert_eq!(
        stack.client.get_run(live).await?.status,
        RunStatus::Planning
    );
    let (code, _, err) = cli(&stack, &["cancel", &live.to_string()]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("cancel requested"), "{err}");
    let status = tokio::time::timeout(Duration::from_secs(60), follower.wait()).await??;
    assert_eq!(status.code(), Some(1), "the followed Run ended canceled");
    assert_eq!(
        stack.client.get_run(live).await?.status,
        RunStatus::Canceled
    );
    stack.pause_plans(false)?;

    // A plan that fails: --watch exits 1.
    let broken = GitRepo::new(&[("infra/bad/main.tf", "resource \"null_resource\" {\n")])?;
    let bad = register_in(
        &stack,
        capsule.workspace_id,
        "bad",
        &broken,
        "infra/bad",
        json!({}),
    )
    .await?;
    let (code, out, _) = cli(&stack, &["plan", &bad.id.to_string(), "--watch"]).await?;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("status: failed"), "{out}");
    // Keep the client type in use for scripts that link the crate.
    let _ = Client::new(&stack.api_url, &stack.admin_token)?;
    stack.stop().await
}

/// A Run's progress (its events, its log, the dry-run scan report with its event) is written
/// by one statement each that commits without waiting for the disk; a state change waits. A
/// trigger in this test's database records the setting in force in the transaction of each
/// write; the setting is the statement's own and the session's default is back after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_progress_commits_without_waiting_for_the_disk() -> anyhow::Result<()> {
    use takosumi_core::{EventKind, RunId};
    use takosumi_store::{events, logs, runs::plan_record};
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let url = &stack.env_vars()["TAKOSUMI_DATABASE_URL"];
    // One connection: every statement below runs in the same session.
    let pool = takosumi_store::connect(url, 1).await?;
    let run = RunId::from_uuid(takosumi_tests::seed::one_queued_run(&pool, "progress").await?);
    sqlx::raw_sql(
        "CREATE TABLE seen (n bigserial, what text, setting text);
         CREATE FUNCTION note_setting() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
             INSERT INTO seen (what, setting)
             VALUES (coalesce(TG_ARGV[0], TG_TABLE_NAME), current_setting('synchronous_commit'));
             RETURN NEW; END $$;
         CREATE TRIGGER note BEFORE INSERT ON run_events FOR EACH ROW EXECUTE FUNCTION note_setting();
         CREATE TRIGGER note BEFORE INSERT ON run_logs FOR EACH ROW EXECUTE FUNCTION note_setting();
         CREATE TRIGGER note BEFORE UPDATE OF scan_report ON runs
             FOR EACH ROW EXECUTE FUNCTION note_setting();
         CREATE TRIGGER note_claim BEFORE UPDATE OF claimed_until ON outbox
             FOR EACH ROW EXECUTE FUNCTION note_setting('outbox claim');
         CREATE TRIGGER note BEFORE UPDATE OF sent_at ON outbox
             FOR EACH ROW EXECUTE FUNCTION note_setting();",
    )
    .execute(&pool)
    .await?;
    let actor = "test";
    events::append_progress(&pool, run, EventKind::CheckoutStarted, actor, json!({})).await?;
    logs::append_progress(&pool, run, &[("init", "one"), ("plan", "two\0")]).await?;
    plan_record::set_scan_report_progress(&pool, run, &json!({"findings": []}), actor).await?;
    // A state change's event, written the ordinary way.
    events::append(&pool, run, EventKind::Planned, actor, json!({})).await?;
    // A wake-up claimed and marked sent: a claim or a mark a crash loses is one more
    // publish, so neither waits.
    let mut tx = pool.begin().await?;
    takosumi_store::outbox::enqueue(&mut tx, takosumi_core::Topic::Gate, run).await?;
    tx.commit().await?;
    // Relayed here or, if its poll came first, by the API's relay: the same code either way.
    let broker = stack.ctx.bus.get().await?;
    takosumi_queue::relay_once(&pool, &broker).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
        .fetch_one(&pool)
        .await?
        > 0
    {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the wake-up was not sent"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let session: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
        .fetch_one(&pool)
        .await?;
    let seen: Vec<(String, String)> = sqlx::query_as("SELECT what, setting FROM seen ORDER BY n")
        .fetch_all(&pool)
        .await?;
    let seen: Vec<(&str, &str)> = seen.iter().map(|(w, s)| (w.as_str(), s.as_str())).collect();
    assert_eq!(
        seen,
        [
            ("run_events", "off"),
            ("run_logs", "off"),
            ("run_logs", "off"),
            // the scan report and its event, one statement
            ("runs", "off"),
            ("run_events", "off"),
            ("run_events", "on"),
            ("outbox claim", "off"),
            ("outbox", "off"),
        ]
    );
    assert_eq!(session, "on", "the setting outlived its statement");
    // The log keeps its order, with a NUL shown as U+FFFD.
    let log: Vec<(String, String)> =
        sqlx::query_as("SELECT step, chunk FROM run_logs WHERE run_id = $1 ORDER BY id")
            .bind(run.as_uuid())
            .fetch_all(&pool)
            .await?;
    assert_eq!(
        log,
        [
            ("init".to_owned(), "one".to_owned()),
            ("plan".to_owned(), "two\u{FFFD}".to_owned())
        ]
    );
    pool.close().await;
    stack.stop().await
}

/// A watcher follows a Run's events and its log by id (`takosumi watch`, the Run page's
/// stream: `id > cursor`), so a Run's rows must become visible in id order. Here a writer in
/// a transaction (a cancel request, an approval) takes its ids first and commits last, and a
/// step's progress is written meanwhile: the progress waits for the transaction (the Run's
/// row lock), and a watcher that read in between, and then after both, has seen every row.
/// Without the lock the progress commits first with the higher ids, the watcher's cursor
/// passes the transaction's rows and it never sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_following_a_run_by_id_misses_nothing_committed_out_of_order()
-> anyhow::Result<()> {
    use takosumi_core::{EventKind, RunId};
    use takosumi_store::{StoreError, events, logs};
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let pool = stack.ctx.pool.clone();
    let run = RunId::from_uuid(takosumi_tests::seed::one_queued_run(&pool, "order").await?);

    let mut tx = pool.begin().await?;
    events::append(
        tx.db(),
        run,
        EventKind::CancelRequested,
        "test:first",
        json!({}),
    )
    .await?;
    logs::append(tx.db(), run, "plan", "first\n").await?;
    let progress = tokio::spawn({
        let pool = pool.clone();
        async move {
            events::append_progress(&pool, run, EventKind::ToolStarted, "test:second", json!({}))
                .await?;
            logs::append_progress(&pool, run, &[("plan", "second\n")]).await
        }
    });
    // Time for the progress to commit if it could; what is asserted below holds either way.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut seen_events = events::list_after(&pool, run, 0).await?;
    let mut seen_log = logs::read_after(&pool, run, 0).await?;
    assert!(
        !progress.is_finished(),
        "the progress was written while a transaction holding the Run's earlier rows was open"
    );
    tx.commit().await?;
    progress.await??;
    let cursor = seen_events.last().map_or(0, |e| e.id);
    seen_events.extend(events::list_after(&pool, run, cursor).await?);
    let cursor = seen_log.last().map_or(0, |c| c.id);
    seen_log.extend(logs::read_after(&pool, run, cursor).await?);

    let actors: Vec<&str> = seen_events.iter().map(|e| e.actor.as_str()).collect();
    let all: Vec<i64> = events::list(&pool, run)
        .await?
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(
        seen_events.iter().map(|e| e.id).collect::<Vec<_>>(),
        all,
        "{actors:?}"
    );
    assert_eq!(actors[actors.len() - 2..], ["test:first", "test:second"]);
    let texts: Vec<&str> = seen_log.iter().map(|c| c.text.as_str()).collect();
    assert_eq!(texts, ["first\n", "second\n"]);

    // An append names a Run that exists, or is refused with nothing written.
    let nobody = RunId::from_uuid(uuid::Uuid::now_v7());
    let refused = events::append(&pool, nobody, EventKind::Queued, "test", json!({})).await;
    assert!(
        matches!(refused, Err(StoreError::NotFound("run"))),
        "{refused:?}"
    );
    let refused = logs::append_progress(&pool, nobody, &[("plan", "x")]).await;
    assert!(
        matches!(refused, Err(StoreError::NotFound("run"))),
        "{refused:?}"
    );
    stack.stop().await
}

/// The pool pings a connection idle for `PING_AFTER_IDLE` or more before it hands it out:
/// one the server dropped meanwhile is replaced at the acquire and the statement runs. One
/// used more recently goes out unpinged (a round trip saved on every busy acquire), so a
/// statement can meet a connection the server dropped: it fails with a retryable error,
/// and the next one runs on a new connection.
#[tokio::test]
async fn an_idle_connection_the_server_dropped_is_replaced_at_the_acquire() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let url = &stack.env_vars()["TAKOSUMI_DATABASE_URL"];
    let pool = takosumi_store::connect(url, 1).await?;
    let pid = "SELECT pg_backend_pid()";
    let admin = &stack.ctx.pool;
    let drop_backend = |backend: i32| async move {
        let dropped: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(backend)
            .fetch_one(admin)
            .await?;
        anyhow::ensure!(dropped, "pg_terminate_backend({backend})");
        anyhow::Ok(())
    };

    let first: i32 = sqlx::query_scalar(pid).fetch_one(&pool).await?;
    // Back in the pool (sqlx pings a connection it takes back) before the server drops it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while pool.num_idle() < 1 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the connection never came back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop_backend(first).await?;
    tokio::time::sleep(takosumi_store::PING_AFTER_IDLE + Duration::from_millis(100)).await;
    let second: i32 = sqlx::query_scalar(pid).fetch_one(&pool).await?;
    assert_ne!(first, second, "the dropped idle connection was handed out");

    let mut held = pool.acquire().await?;
    drop_backend(second).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let err = sqlx::query_scalar::<_, i32>(pid)
        .fetch_one(held.db())
        .await
        .expect_err("a statement on a connection the server dropped");
    assert!(
        takosumi_store::StoreError::from(err).retryable(),
        "the failure says try again"
    );
    drop(held);
    let third: i32 = sqlx::query_scalar(pid).fetch_one(&pool).await?;
    assert!(third != second && third != first, "a new connection");
    pool.close().await;
    stack.stop().await
}

/// Which constraint refused a statement (None: it ran); a refusal must carry `sqlstate`.
fn refused_with(
    ran: Result<sqlx::postgres::PgQueryResult, sqlx::Error>,
    sqlstate: &str,
) -> Option<String> {
    let e = ran.err()?;
    let db = e.as_database_error().expect("a database error");
    assert_eq!(db.code().as_deref(), Some(sqlstate), "{db}");
    Some(db.constraint().expect("a named constraint").to_owned())
}

/// The database keeps each closed set and each rule across columns itself (the CHECKs call
/// functions since session 24, so a statement does not re-read a long expression): every name
/// in a set passes, a name outside it is refused by the constraint named for its column.
#[tokio::test]
async fn the_database_refuses_a_name_outside_each_closed_set() -> anyhow::Result<()> {
    use takosumi_core::{
        ApplyMode, BindingKind, EventKind, GroupKind, HoldReason, ProviderLockState, SandboxMode,
    };
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let pool = &stack.ctx.pool;
    let run = takosumi_tests::seed::one_queued_run(pool, "closed-sets").await?;

    async fn refused_by(
        pool: &takosumi_store::Pool,
        sql: &str,
        run: uuid::Uuid,
        value: &str,
    ) -> Option<String> {
        let ran = sqlx::query(sql).bind(run).bind(value).execute(pool).await;
        refused_with(ran, "23514")
    }
    let event = "INSERT INTO run_events (run_id, kind, actor) VALUES ($1, $2, 'test')";
    for kind in EventKind::ALL {
        assert_eq!(
            refused_by(pool, event, run, kind.as_str()).await,
            None,
            "{kind:?}"
        );
    }
    assert_eq!(
        refused_by(pool, event, run, "launched").await.as_deref(),
        Some("run_events_kind_check")
    );

    let columns: [(&str, Vec<&str>, &str); 5] = [
        (
            "hold_reason",
            HoldReason::ALL.iter().map(|r| r.as_str()).collect(),
            "runs_hold_reason_check",
        ),
        (
            "apply_mode",
            ApplyMode::ALL.iter().map(|m| m.as_str()).collect(),
            "runs_apply_mode_check",
        ),
        (
            "provider_lock_state",
            ProviderLockState::ALL.iter().map(|s| s.as_str()).collect(),
            "runs_provider_lock_state_check",
        ),
        (
            "sandbox",
            SandboxMode::ALL.iter().map(|m| m.as_str()).collect(),
            "runs_sandbox_check",
        ),
        (
            "resolution_action",
            ResolutionAction::ALL.iter().map(|a| a.as_str()).collect(),
            "runs_resolution_action_check",
        ),
    ];
    for (column, names, constraint) in columns {
        // A present lockfile has a digest and a resolution is recorded whole, so each name is
        // set with what the rules across columns ask of it.
        let sql = format!(
            "UPDATE runs SET {column} = $2,
                    provider_lock_digest =
                        CASE WHEN '{column}' = 'provider_lock_state' AND $2 = 'present'
                               OR '{column}' <> 'provider_lock_state' AND provider_lock_state = 'present'
                             THEN 'sha256:x' END,
                    resolved_at = CASE WHEN '{column}' = 'resolution_action' THEN now() END,
                    resolved_by = CASE WHEN '{column}' = 'resolution_action' THEN 'test' END
              WHERE id = $1"
        );
        for name in &names {
            assert_eq!(
                refused_by(pool, &sql, run, name).await,
                None,
                "{column} = {name}"
            );
        }
        assert_eq!(
            refused_by(pool, &sql, run, "unheard_of").await.as_deref(),
            Some(constraint),
            "{column}"
        );
    }
    // The closed sets of the tables beside a Run's: a RunGroup's kind, a ProviderBinding's.
    let group = "INSERT INTO run_groups (id, workspace_id, kind, created_by)
                 SELECT gen_random_uuid(), workspace_id, $2, 'test' FROM runs WHERE id = $1";
    let binding = "INSERT INTO provider_bindings
                          (id, workspace_id, name, kind, env_names, sealed, created_by)
                   SELECT gen_random_uuid(), workspace_id, 'b-' || $2, $2, '{}', '\\x00', 'test'
                     FROM runs WHERE id = $1";
    let tables: [(&str, Vec<&str>, &str); 2] = [
        (
            group,
            GroupKind::ALL.iter().map(|k| k.as_str()).collect(),
            "run_groups_kind_check",
        ),
        (
            binding,
            BindingKind::ALL.iter().map(|k| k.as_str()).collect(),
            "provider_bindings_kind_check",
        ),
    ];
    for (sql, names, constraint) in tables {
        for name in &names {
            assert_eq!(
                refused_by(pool, sql, run, name).await,
                None,
                "{constraint}: {name}"
            );
        }
        assert_eq!(
            refused_by(pool, sql, run, "unheard_of").await.as_deref(),
            Some(constraint)
        );
    }
    // The rules across columns.
    let lock =
        "UPDATE runs SET provider_lock_state = $2, provider_lock_digest = NULL WHERE id = $1";
    assert_eq!(refused_by(pool, lock, run, "none").await, None);
    assert_eq!(
        refused_by(pool, lock, run, "present").await.as_deref(),
        Some("runs_provider_lock_digest")
    );
    let half = "UPDATE runs SET resolution_action = $2, resolved_at = now(), resolved_by = NULL
                 WHERE id = $1";
    assert_eq!(
        refused_by(pool, half, run, "mark_resolved")
            .await
            .as_deref(),
        Some("runs_resolution_complete")
    );
    stack.stop().await
}

/// A Run's Workspace is its Capsule's, and the database holds that itself (one foreign key
/// on the pair since session 36, where two on each column let a Run name another
/// Workspace's Capsule): a Run of a Capsule in the Run's Workspace is written; one naming a
/// Capsule of another Workspace, a Capsule that does not exist or a Workspace that does
/// not exist is refused by that key, and nothing is written.
#[tokio::test]
async fn a_runs_workspace_is_its_capsules() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let pool = &stack.ctx.pool;
    let first = takosumi_tests::seed::one_queued_run(pool, "pair-a").await?;
    let other = takosumi_tests::seed::one_queued_run(pool, "pair-b").await?;
    let (ws, capsule): (uuid::Uuid, uuid::Uuid) =
        sqlx::query_as("SELECT workspace_id, capsule_id FROM runs WHERE id = $1")
            .bind(first)
            .fetch_one(&**pool)
            .await?;
    let (other_ws, other_capsule): (uuid::Uuid, uuid::Uuid) =
        sqlx::query_as("SELECT workspace_id, capsule_id FROM runs WHERE id = $1")
            .bind(other)
            .fetch_one(&**pool)
            .await?;
    assert_ne!(ws, other_ws);

    async fn insert(
        pool: &takosumi_store::Pool,
        ws: uuid::Uuid,
        capsule: uuid::Uuid,
    ) -> Option<String> {
        let written = sqlx::query(
            "INSERT INTO runs (id, kind, workspace_id, capsule_id, actor_kind, actor_id)
             VALUES ($1, 'plan', $2, $3, 'user', 'test')",
        )
        .bind(uuid::Uuid::now_v7())
        .bind(ws)
        .bind(capsule)
        .execute(&**pool)
        .await;
        refused_with(written, "23503")
    }
    let runs = |ws: uuid::Uuid| {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runs WHERE workspace_id = $1")
            .bind(ws)
            .fetch_one(&**pool)
    };
    assert_eq!(insert(pool, ws, capsule).await, None);
    assert_eq!(runs(ws).await?, 2);
    let key = Some("runs_capsule_workspace_fkey");
    assert_eq!(insert(pool, other_ws, capsule).await.as_deref(), key);
    assert_eq!(insert(pool, ws, other_capsule).await.as_deref(), key);
    assert_eq!(
        insert(pool, ws, uuid::Uuid::now_v7()).await.as_deref(),
        key,
        "a Capsule that does not exist"
    );
    assert_eq!(
        insert(pool, uuid::Uuid::now_v7(), capsule).await.as_deref(),
        key,
        "a Workspace that does not exist"
    );
    assert_eq!((runs(ws).await?, runs(other_ws).await?), (2, 1));
    stack.stop().await
}

/// Plan submissions racing with one Idempotency-Key start one Run, and every one of them is
/// answered with it, as the API serves it afterwards (a Run started alone is one autocommit
/// statement since session 24; a second submission's insert meets the first's key).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plan_submissions_racing_with_one_key_start_one_run() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("null")?;
    let ws = stack.client.create_workspace("idempotent-race").await?.id;
    let capsule = stack
        .client
        .create_capsule(
            ws,
            &NewCapsule {
                name: "race".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra/null".into(),
                tool: "terraform".into(),
                vars: Map::new(),
            },
        )
        .await?;
    let answers =
        futures::future::join_all((0..8).map(|_| stack.client.plan(capsule.id, Some("race-1"))))
            .await;
    let runs: Vec<_> = answers.into_iter().collect::<Result<_, _>>()?;
    let first = &runs[0];
    assert!(runs.iter().all(|r| r.id == first.id), "{runs:?}");
    assert_eq!(first.status, RunStatus::Queued);
    // The answer is the Run as it is read back.
    assert_eq!(&stack.client.get_run(first.id).await?, first);
    let pool = &stack.ctx.pool;
    let (runs, queued, wakes): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM runs WHERE capsule_id = $1),
                (SELECT count(*) FROM run_events e JOIN runs r ON r.id = e.run_id
                  WHERE r.capsule_id = $1 AND e.kind = 'queued'),
                (SELECT count(*) FROM outbox WHERE payload->>'runId' = $2)",
    )
    .bind(capsule.id.as_uuid())
    .bind(first.id.to_string())
    .fetch_one(pool)
    .await?;
    assert_eq!((runs, queued, wakes), (1, 1, 1));
    stack.stop().await
}

/// A sent wake-up is deleted once it is older than the relay's retention
/// (`takosumi_queue::KEEP_SENT`), the longest-sent first and in bounded batches; every
/// process's relay prunes when it starts. Rows sent inside the retention and one not sent
/// yet (held back, however old) stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_wake_ups_are_pruned_after_the_retention() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    // The API's relay prunes first thing when it starts, then not for a minute: the rows
    // below are written after that first prune.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pool = &stack.ctx.pool;
    let keep = i64::try_from(takosumi_queue::KEEP_SENT.as_secs())?;
    // (seconds ago it was sent (None: not yet), seconds until it is due)
    let rows: [(Option<i64>, i64); 8] = [
        (Some(50 * 60), 0),
        (Some(40 * 60), 0),
        (Some(30 * 60), 0),
        (Some(keep + 300), 0),
        (Some(keep + 200), 0),
        (Some(keep + 100), 0),
        (Some(keep - 60), 0),
        (None, 3600),
    ];
    let mut ids = Vec::new();
    for (sent, due_in) in rows {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO outbox (topic, payload, created_at, sent_at, available_at)
             VALUES ('run.gate', '{}', now() - interval '1 day',
                     now() - make_interval(secs => $1::bigint::double precision),
                     now() + make_interval(secs => $2::bigint::double precision))
             RETURNING id",
        )
        .bind(sent)
        .bind(due_in)
        .fetch_one(pool)
        .await?;
        ids.push(id);
    }
    let left = || async {
        let left: Vec<i64> =
            sqlx::query_scalar("SELECT id FROM outbox WHERE id = ANY($1) ORDER BY id")
                .bind(&ids)
                .fetch_all(pool)
                .await?;
        anyhow::Ok(left)
    };
    // With a 35-minute retention, six rows are expired; a batch of two takes the two sent
    // longest ago (written after the others, so not the lowest ids).
    assert_eq!(
        takosumi_store::outbox::prune_sent(pool, 35 * 60, 2).await?,
        2
    );
    let expect: Vec<i64> = [0, 1, 2, 5, 6, 7].iter().map(|&i| ids[i]).collect();
    assert_eq!(left().await?, expect);
    // A process that starts prunes, with the real retention: the last row sent more than
    // an hour ago goes; those sent 50, 40, 30 and 59 minutes ago and the pending one stay.
    let mut gate = stack.spawn_process("gate")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while left().await?.contains(&ids[5]) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = gate.kill().await;
    let expect: Vec<i64> = [0, 1, 2, 6, 7].iter().map(|&i| ids[i]).collect();
    assert_eq!(
        left().await?,
        expect,
        "the gate's relay did not prune the expired row, or pruned one it must keep"
    );
    assert_eq!(
        takosumi_store::outbox::prune_sent(pool, keep, 100).await?,
        0
    );
    stack.stop().await
}

/// A relay claims the wake-ups it publishes for `takosumi_queue::CLAIM`, and other relays
/// leave a claimed row alone: a relay that dies after its claim (a row claimed an hour ahead
/// stands in for it) delays that wake-up until the claim lapses, and then the next relay to
/// look sends it. Two claims at once never take the same row, and a claim takes due rows
/// in the order they were committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_a_dead_relay_claimed_is_sent_once_the_claim_lapses() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let pool = &stack.ctx.pool;
    let sent = |id: i64| async move {
        let sent: bool = sqlx::query_scalar("SELECT sent_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await?;
        anyhow::Ok(sent)
    };
    // A row due now but claimed (by a relay that then died) until an hour from now.
    let claimed: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload, claimed_until)
         VALUES ('run.gate', '{}', now() + interval '1 hour') RETURNING id",
    )
    .fetch_one(pool)
    .await?;
    // The API's relay polls four times a second: eight polls later it is still not sent,
    // and a pass of this test's own finds nothing to claim.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!sent(claimed).await?, "a claimed row was published");
    let broker = stack.ctx.bus.get().await?;
    assert_eq!(takosumi_queue::relay_once(pool, &broker).await?, 0);
    // The claim lapses: the next poll sends it.
    sqlx::query("UPDATE outbox SET claimed_until = now() - interval '1 second' WHERE id = $1")
        .bind(claimed)
        .execute(pool)
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !sent(claimed).await? {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the row whose claim lapsed was not sent"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Two claims at once over 40 rows, written claimed (so the API's relay leaves them
    // alone while they are written) and then released together.
    let mut ids: Vec<i64> = Vec::new();
    for _ in 0..40 {
        ids.push(
            sqlx::query_scalar(
                "INSERT INTO outbox (topic, payload, claimed_until)
                 VALUES ('run.gate', '{}', now() + interval '1 hour') RETURNING id",
            )
            .fetch_one(pool)
            .await?,
        );
    }
    sqlx::query("UPDATE outbox SET claimed_until = NULL WHERE id = ANY($1)")
        .bind(&ids)
        .execute(pool)
        .await?;
    let (a, b) = tokio::join!(
        takosumi_store::outbox::claim_due(pool, 30, 60),
        takosumi_store::outbox::claim_due(pool, 30, 60)
    );
    let (a, b) = (a?, b?);
    let mut taken: Vec<i64> = a.iter().chain(&b).map(|p| p.id).collect();
    for side in [&a, &b] {
        let side: Vec<i64> = side.iter().map(|p| p.id).collect();
        assert!(side.is_sorted(), "a claim's rows out of order: {side:?}");
    }
    taken.sort_unstable();
    let before = taken.len();
    taken.dedup();
    assert_eq!(taken.len(), before, "two claims took the same row");
    // Whatever the API's relay did not take in between, the two took all of, between them.
    let left: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox WHERE id = ANY($1) AND sent_at IS NULL
            AND (claimed_until IS NULL OR claimed_until <= now()) ORDER BY id",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await?;
    assert!(
        left.is_empty(),
        "rows neither claim took (each asked for 30 of 40): {left:?}"
    );
    stack.stop().await
}

/// A relay publishes a batch in the order it claimed it: the batch's sends run side by side
/// (`Broker::publish_all`), each queueing its frames when first polled, in order. A hundred
/// wake-ups (past the 30 where `join_all` changes how it drives its futures) reach their
/// queue in the order they were written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_publishes_a_batch_in_the_order_it_was_written() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let pool = &stack.ctx.pool;
    // Written claimed, then released together, so one relay pass (the API's or this test's)
    // takes all of them.
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload, claimed_until)
         SELECT 'run.drift', jsonb_build_object('n', g), now() + interval '1 hour'
           FROM generate_series(1, 100) g ORDER BY g RETURNING id",
    )
    .fetch_all(pool)
    .await?;
    sqlx::query("UPDATE outbox SET claimed_until = NULL WHERE id = ANY($1)")
        .bind(&ids)
        .execute(pool)
        .await?;
    let broker = stack.ctx.bus.get().await?;
    takosumi_queue::relay_once(pool, &broker).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let unsent: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE id = ANY($1) AND sent_at IS NULL",
        )
        .bind(&ids)
        .fetch_one(pool)
        .await?;
        if unsent == 0 {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{unsent} wake-ups not sent"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ch = broker.channel().await?;
    let mut order = Vec::new();
    while let Some(got) = ch
        .basic_get(
            "run.drift".into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await?
    {
        let body: Value = serde_json::from_slice(&got.delivery.data)?;
        order.push(body["n"].as_i64().unwrap_or(-1));
    }
    assert_eq!(order, (1..=100).collect::<Vec<i64>>());
    stack.stop().await
}
