//! An apply whose tool ran but whose new state cannot be stored, and the Capsule lock an
//! `unknown_outcome` apply leaves until an operator resolves it.
//!
//! The test runs its own s3s-fs server (`takosumi_tests::services::PrivateS3`) so it can
//! make object storage refuse every write under `states/` (a plain file where the
//! server would create the `states` directory) without touching the shared server: plans,
//! sealed plans and lockfiles still store, only the new state of an apply does not.

use std::time::Duration;

use serde_json::json;
use takosumi_client::{Capsule, ClientError, NewCapsule, Source};
use takosumi_core::{ResolutionAction, RunId, RunStatus, StateVersionId};
use takosumi_seal::Purpose;
use takosumi_tests::services::{PrivateRabbit, PrivateS3};
use takosumi_tests::{Endpoints, GitRepo, Options, Stack, Steps};

async fn register(stack: &Stack, repo: &GitRepo) -> anyhow::Result<Capsule> {
    let ws = stack
        .client
        .create_workspace(&format!(
            "ws-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?;
    let vars = json!({ "region": "eu" })
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

async fn planned(stack: &Stack, capsule: &Capsule) -> anyhow::Result<RunId> {
    let plan = stack.client.plan(capsule.id, None).await?;
    let done = stack.wait(plan.id).await?;
    anyhow::ensure!(
        done.status == RunStatus::Planned,
        "plan ended {:?}",
        done.status
    );
    Ok(plan.id)
}

async fn status_of(stack: &Stack, run: RunId) -> anyhow::Result<RunStatus> {
    Ok(stack.client.get_run(run).await?.status)
}

async fn wait_long(stack: &Stack, run: RunId) -> anyhow::Result<takosumi_client::Run> {
    Ok(stack.client.wait(run, Duration::from_secs(150)).await?)
}

/// The promise: when the tool has applied and the new state cannot be stored, the
/// apply retries storing it (with backoff), then ends `unknown_outcome` — not `failed`
/// with "nothing was applied" — with a message saying the tool applied and the state
/// could not be stored. The state is not lost: it is kept in Postgres sealed under its
/// StateVersion id, opens with the server key and hashes to the recorded digest; the
/// Capsule's generation does not move and no StateVersion points at a missing object.
///
/// And the lock: until an operator resolves the `unknown_outcome` apply, the Capsule
/// takes no other apply. One queued behind it is refused `capsule_needs_inspection`
/// without the tool starting; a new submission gets 409 `capsule_needs_inspection` and
/// creates nothing; plans still run. Once resolved (`POST /runs/{id}/resolve`), an apply
/// runs again and moves the generation by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unstored_state_ends_unknown_outcome_keeps_the_state_and_locks_the_capsule()
-> anyhow::Result<()> {
    let s3 = tokio::task::spawn_blocking(PrivateS3::start).await??;
    let stack = Stack::start_on(
        Options {
            steps: Steps::ALL,
            lease_secs: 30,
        },
        &Endpoints {
            s3_endpoint: Some(s3.endpoint()),
            ..Endpoints::default()
        },
    )
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo).await?;
    let first_plan = planned(&stack, &capsule).await?;

    // Object storage refuses every new state from here on.
    let bucket_dir = s3.data_dir().join(&stack.settings.s3_bucket);
    anyhow::ensure!(bucket_dir.is_dir(), "no bucket directory {bucket_dir:?}");
    let blocker = bucket_dir.join("states");
    std::fs::write(&blocker, b"not a directory")?;

    let first_apply = stack.client.apply(first_plan, None).await?.id;
    // While it retries storing, a second plan runs beside it and its apply queues
    // behind it (the Capsule is held by the first).
    let second_plan = planned(&stack, &capsule).await?;
    assert_eq!(
        status_of(&stack, first_apply).await?,
        RunStatus::Applying,
        "the first apply should still be retrying its state store"
    );
    let queued_apply = stack.client.apply(second_plan, None).await?.id;

    let first = wait_long(&stack, first_apply).await?;
    assert_eq!(first.status, RunStatus::UnknownOutcome);
    let error = first
        .error
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no error"))?;
    assert_eq!(error.code, "unknown_outcome");
    assert!(
        error.message.contains("the tool applied")
            && error.message.contains("could not be stored")
            && error.message.contains("kept sealed in the database"),
        "message: {}",
        error.message
    );
    assert!(!error.message.contains("nothing was applied"));
    assert_eq!(stack.tool_count("apply"), 1, "the tool ran once");

    // The state is kept, sealed, in Postgres, and opens to what the tool wrote.
    let held = takosumi_store::states::held::held_for_run(&stack.ctx.pool, first_apply).await?;
    assert_eq!(held.len(), 1, "one held state");
    let takosumi_store::states::held::HeldSealed {
        state_version_id: sv_id,
        generation,
        digest,
        sealed,
    } = held.into_iter().next().unwrap_or_else(|| unreachable!());
    assert_eq!(generation, 1);
    let state = stack
        .ctx
        .sealer
        .unseal(Purpose::State, &sv_id.to_string(), &sealed)?;
    assert_eq!(takosumi_store::sha256_hex(&state), digest);
    assert!(
        String::from_utf8_lossy(&state).contains("vpc-eu"),
        "the held state is the applied one"
    );
    assert!(
        !String::from_utf8_lossy(&sealed).contains("vpc-eu"),
        "kept sealed, not in the clear"
    );
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM state_versions")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(versions, 0, "no StateVersion points at a missing object");
    assert_eq!(
        stack.client.get_capsule(capsule.id).await?.state_generation,
        0
    );
    let events: Vec<String> =
        sqlx::query_scalar("SELECT kind FROM run_events WHERE run_id = $1 ORDER BY id")
            .bind(first_apply.as_uuid())
            .fetch_all(&stack.ctx.pool)
            .await?;
    assert!(events.iter().any(|e| e == "unknown_outcome"), "{events:?}");
    assert!(!events.iter().any(|e| e == "failed"), "{events:?}");

    // The apply queued behind it is refused, the tool never starting for it.
    let queued = wait_long(&stack, queued_apply).await?;
    assert_eq!(queued.status, RunStatus::Failed);
    let refused = queued
        .error
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no error"))?;
    assert_eq!(refused.code, "capsule_needs_inspection");
    assert!(refused.message.contains(&first_apply.to_string()));
    assert_eq!(stack.tool_count("apply"), 1);

    // Plans still run; a new apply is refused at submission and creates nothing.
    let third_plan = planned(&stack, &capsule).await?;
    let runs_before: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    match stack.client.apply(third_plan, None).await {
        Err(ClientError::Api { status, code, .. }) => {
            assert_eq!(status, 409);
            assert_eq!(code, "capsule_needs_inspection");
        }
        other => panic!("apply while the Capsule needs inspection: {other:?}"),
    }
    let runs_after: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(runs_before, runs_after);

    // The operator inspects, records it, storage is mended: applies run again.
    stack
        .client
        .resolve(
            first_apply,
            "checked the provider side; the held state matches it",
        )
        .await?;
    std::fs::remove_file(&blocker)?;
    let after = stack.client.apply(third_plan, None).await?.id;
    let after = stack.wait(after).await?;
    assert_eq!(after.status, RunStatus::Applied, "{:?}", after.error);
    assert_eq!(
        stack.client.get_capsule(capsule.id).await?.state_generation,
        1
    );
    assert_eq!(stack.tool_count("apply"), 2);

    stack.stop().await?;
    drop(s3);
    Ok(())
}

/// The promise: a storage outage that ends while the apply is still retrying costs
/// nothing. The tool applied once; storing the new state is retried with backoff until
/// storage takes it; the apply ends `applied` with the StateVersion in object storage,
/// the generation moved by one and nothing held in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn state_store_is_retried_until_storage_is_back() -> anyhow::Result<()> {
    let s3 = tokio::task::spawn_blocking(PrivateS3::start).await??;
    let stack = Stack::start_on(
        Options {
            steps: Steps::ALL,
            lease_secs: 30,
        },
        &Endpoints {
            s3_endpoint: Some(s3.endpoint()),
            ..Endpoints::default()
        },
    )
    .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = register(&stack, &repo).await?;
    let plan = planned(&stack, &capsule).await?;
    let blocker = s3.data_dir().join(&stack.settings.s3_bucket).join("states");
    std::fs::write(&blocker, b"not a directory")?;

    let apply = stack.client.apply(plan, None).await?.id;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while stack.tool_count("apply") == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the tool never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The tool has run; storing its state is refused and retried (the Run says so).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let events = stack.client.events(apply).await?;
        if let Some(e) = events.iter().find(|e| e.kind == "state_store_retrying") {
            assert!(e.data["error"].is_string(), "{e:?}");
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no state_store_retrying event: {events:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status_of(&stack, apply).await?, RunStatus::Applying);
    std::fs::remove_file(&blocker)?;

    let done = wait_long(&stack, apply).await?;
    assert_eq!(done.status, RunStatus::Applied, "{:?}", done.error);
    assert_eq!(stack.tool_count("apply"), 1);
    let now = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(now.state_generation, 1);
    assert!(done.state_version_id.is_some());
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM held_states")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(held, 0);
    stack.stop().await?;
    drop(s3);
    Ok(())
}

// ---- resolving an unknown_outcome apply with a state --------------------------------

/// A Capsule of `infra/examples/null` (two `null_resource`s: a plan of it without state
/// adds two, with the applied state adds none).
async fn register_null(stack: &Stack, repo: &GitRepo) -> anyhow::Result<Capsule> {
    stack
        .new_capsule(repo, "nodes", "infra/null", serde_json::json!({}))
        .await
}

/// A stack on its own object storage (so storage can refuse states) and its own broker
/// (vhosts come and go on the shared one all day; these tests need none of that).
async fn start_private(s3: &PrivateS3) -> anyhow::Result<(Stack, PrivateRabbit)> {
    let rabbit = tokio::task::spawn_blocking(PrivateRabbit::start).await??;
    let stack = Stack::start_on(
        Options {
            steps: Steps::ALL,
            lease_secs: 30,
        },
        &Endpoints {
            s3_endpoint: Some(s3.endpoint()),
            amqp_url: Some(rabbit.amqp_url()),
            ..Endpoints::default()
        },
    )
    .await?;
    Ok((stack, rabbit))
}

/// Plans and waits; returns the plan and its counted changes.
async fn plan_changes(
    stack: &Stack,
    capsule: &Capsule,
) -> anyhow::Result<(RunId, takosumi_core::Changes)> {
    let plan = planned(stack, capsule).await?;
    let changes = stack
        .client
        .get_run(plan)
        .await?
        .changes
        .ok_or_else(|| anyhow::anyhow!("a planned Run without changes"))?;
    Ok((plan, changes))
}

/// `chattr` on a directory: `+i` makes it take no new entry, even from root, while its
/// files stay readable.
fn chattr(flag: &str, dir: &std::path::Path) -> anyhow::Result<()> {
    let out = std::process::Command::new("chattr")
        .arg(flag)
        .arg(dir)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "chattr {flag} {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Applies `plan` while object storage refuses every new state of `capsule` (a plain
/// file where the `states` directory would be; or, once the Capsule has states, its
/// states directory made immutable, so the current state still reads): the apply ends
/// `unknown_outcome` with its state held. Storage is mended before returning. Returns the
/// apply and the held state `(id, generation, unsealed bytes)`.
async fn apply_unstored(
    stack: &Stack,
    s3: &PrivateS3,
    capsule: &Capsule,
    plan: RunId,
) -> anyhow::Result<(RunId, StateVersionId, i64, Vec<u8>)> {
    let states = s3.data_dir().join(&stack.settings.s3_bucket).join("states");
    let own = states.join(capsule.id.to_string());
    let had_states = own.is_dir();
    if had_states {
        chattr("+i", &own)?;
    } else {
        std::fs::write(&states, b"not a directory")?;
    }
    let apply = stack.client.apply(plan, None).await;
    let done = match &apply {
        Ok(run) => wait_long(stack, run.id).await,
        Err(_) => Err(anyhow::anyhow!("the apply was not accepted")),
    };
    if had_states {
        chattr("-i", &own)?;
    } else {
        std::fs::remove_file(&states)?;
    }
    let apply = apply?.id;
    let done = done?;
    anyhow::ensure!(
        done.status == RunStatus::UnknownOutcome,
        "the apply ended {:?}: {:?}",
        done.status,
        done.error
    );
    let held = takosumi_store::states::held::held_for_run(&stack.ctx.pool, apply).await?;
    anyhow::ensure!(held.len() == 1, "{} held states", held.len());
    let takosumi_store::states::held::HeldSealed {
        state_version_id: id,
        generation,
        digest,
        sealed,
    } = held.into_iter().next().unwrap_or_else(|| unreachable!());
    let state = stack
        .ctx
        .sealer
        .unseal(Purpose::State, &id.to_string(), &sealed)?;
    anyhow::ensure!(takosumi_store::sha256_hex(&state) == digest);
    Ok((apply, id, generation, state))
}

async fn state_version_count(stack: &Stack) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM state_versions")
        .fetch_one(&stack.ctx.pool)
        .await?)
}

/// What the resolution wrote, as text: the Run as the API shows it, its `resolved` and
/// `state_version_written` events and the Workspace's matching activity (the apply's own
/// logs are the tool's output from before, not the resolution's).
async fn record_text(stack: &Stack, run: RunId) -> anyhow::Result<String> {
    let r = stack.client.get_run(run).await?;
    let mut text = serde_json::to_string(&r)?;
    let rows: Vec<String> = sqlx::query_scalar(
        r#"SELECT kind || ' ' || data::text FROM run_events
            WHERE run_id = $1 AND kind IN ('resolved', 'state_version_written')
           UNION ALL
           SELECT kind || ' ' || data::text FROM activity
            WHERE subject <> '' AND kind IN ('run_resolved', 'state_version_written')"#,
    )
    .bind(run.as_uuid())
    .fetch_all(&stack.ctx.pool)
    .await?;
    anyhow::ensure!(
        rows.len() >= 3,
        "the resolution's events and activity: {rows:?}"
    );
    text.push_str(&rows.join("\n"));
    Ok(text)
}

/// The ids of the resources in a state: values only the state itself holds.
fn resource_ids(state: &[u8]) -> anyhow::Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(state)?;
    let mut ids = Vec::new();
    for r in v["resources"].as_array().cloned().unwrap_or_default() {
        for i in r["instances"].as_array().cloned().unwrap_or_default() {
            if let Some(id) = i["attributes"]["id"].as_str() {
                ids.push(id.to_owned());
            }
        }
    }
    anyhow::ensure!(!ids.is_empty(), "the state holds no resource ids");
    Ok(ids)
}

fn assert_no_state_content(text: &str, ids: &[String], canary: &str) {
    for id in ids {
        assert!(
            !text.contains(id.as_str()),
            "a resource id from the state leaked"
        );
    }
    assert!(!text.contains(canary), "the state's canary leaked");
    assert!(
        !text.contains("null_resource"),
        "the state's resources leaked"
    );
}

fn api_code(e: &ClientError) -> (u16, String) {
    match e {
        ClientError::Api { status, code, .. } => (*status, code.to_string()),
        other => (0, other.to_string()),
    }
}

/// The promise: `restore_held_state` makes the state an `unknown_outcome` apply's tool
/// wrote — held sealed in the database because object storage refused it — the Capsule's
/// next StateVersion, written against the generation the apply started from. Until it works
/// nothing changes: while storage still refuses, the request fails and the Run stays
/// unresolved; a non-admin token is refused; a Capsule whose generation moved since the
/// apply started is refused `state_generation_changed`. Then the held state is the
/// Capsule's current state (generation +1, the same StateVersion id and digest, its object
/// in storage), the Run is resolved and its record says so without any of the state's
/// content, the Capsule takes applies again, and a following plan of the same config shows
/// no changes (the resources the lost apply made are known). Sending it twice writes one
/// StateVersion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restore_held_state_makes_the_applied_state_current() -> anyhow::Result<()> {
    let s3 = tokio::task::spawn_blocking(PrivateS3::start).await??;
    let (stack, rabbit) = start_private(&s3).await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register_null(&stack, &repo).await?;
    let (plan, changes) = plan_changes(&stack, &capsule).await?;
    assert_eq!((changes.add, changes.destroy), (2, 0));
    let (apply, held_id, held_generation, held_state) =
        apply_unstored(&stack, &s3, &capsule, plan).await?;
    assert_eq!(held_generation, 1);
    let ids = resource_ids(&held_state)?;
    let path = format!("/api/v1/runs/{apply}/resolve");
    let body = json!({ "action": "restore_held_state", "note": "provider side has both nodes" });

    // Storage refuses again: the request fails and nothing changes.
    let blocker = s3.data_dir().join(&stack.settings.s3_bucket).join("states");
    std::fs::write(&blocker, b"not a directory")?;
    let (status, err) = stack.call("POST", &path, body.clone()).await?;
    assert!(status >= 500, "{status} {err}");
    std::fs::remove_file(&blocker)?;
    assert!(stack.client.get_run(apply).await?.resolution.is_none());
    assert_eq!(state_version_count(&stack).await?, 0);

    // A non-admin token is refused.
    let (operator, _) = stack.token("op", "operator").await?;
    let (status, err) = stack
        .request("POST", &path, Some(&operator), Some(&body.to_string()))
        .await?;
    assert_eq!(status, 403, "{err}");
    assert_eq!(state_version_count(&stack).await?, 0);

    // The generation moved since the apply started (forced here; the Capsule lock keeps
    // applies out): the compare-and-set refuses, nothing changes.
    let bump = "UPDATE capsules SET state_generation = state_generation + $2 WHERE id = $1";
    sqlx::query(bump)
        .bind(capsule.id.as_uuid())
        .bind(1_i64)
        .execute(&stack.ctx.pool)
        .await?;
    let (status, err) = stack.call("POST", &path, body.clone()).await?;
    assert_eq!(
        (status, err["code"].as_str()),
        (409, Some("state_generation_changed")),
        "{err}"
    );
    sqlx::query(bump)
        .bind(capsule.id.as_uuid())
        .bind(-1_i64)
        .execute(&stack.ctx.pool)
        .await?;
    assert_eq!(state_version_count(&stack).await?, 0);
    assert!(stack.client.get_run(apply).await?.resolution.is_none());

    let resolved = stack
        .client
        .restore_held_state(apply, "provider side has both nodes")
        .await?;
    assert_eq!(resolved.status, RunStatus::UnknownOutcome);
    assert_eq!(
        resolved.resolution.as_ref().map(|r| &r.action),
        Some(&ResolutionAction::RestoreHeldState.into())
    );
    assert_eq!(resolved.state_version_id, Some(held_id));
    let now = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(now.state_generation, 1, "generation +1");
    assert_eq!(now.current_state_version_id, Some(held_id));
    let sv = takosumi_store::states::versions::get(&stack.ctx.pool, held_id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no StateVersion"))?;
    assert_eq!(sv.generation, 1);
    assert_eq!(sv.run_id, apply);
    let stored = stack
        .ctx
        .objects
        .get(&sv.object_key, 64 * 1024 * 1024)
        .await?;
    let opened = stack
        .ctx
        .sealer
        .unseal(Purpose::State, &held_id.to_string(), &stored)?;
    assert_eq!(opened, held_state, "the stored state is the held one");
    assert_eq!(takosumi_store::sha256_hex(&opened), sv.digest);

    // Sending it twice: refused, one StateVersion.
    let again = stack
        .client
        .restore_held_state(apply, "again")
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(api_code(&again), (409, "already_resolved".to_owned()));
    assert_eq!(state_version_count(&stack).await?, 1);
    assert_eq!(
        stack.client.get_capsule(capsule.id).await?.state_generation,
        1
    );

    let events = stack.client.events(apply).await?;
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert!(
        kinds.ends_with(&["state_version_written", "resolved"]),
        "{kinds:?}"
    );
    let text = record_text(&stack, apply).await?;
    assert!(text.contains(&sv.digest), "the record names the digest");
    assert_no_state_content(&text, &ids, "no-canary-here");

    // The applied state is current: the same config plans no changes; and the Capsule
    // takes applies again.
    let (plan, changes) = plan_changes(&stack, &capsule).await?;
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(stack.tool_count("apply"), 1);
    let next = stack.wait(stack.client.apply(plan, None).await?.id).await?;
    assert_eq!(next.status, RunStatus::Applied, "{:?}", next.error);

    stack.stop().await?;
    drop(rabbit);
    drop(s3);
    Ok(())
}

/// A state made by a real `terraform apply` of `infra/examples/null` in a directory of
/// its own (another lineage), with a canary output.
fn foreign_state(canary: &str) -> anyhow::Result<Vec<u8>> {
    let dir = tempfile::tempdir()?;
    let src =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/examples/null/main.tf");
    std::fs::copy(&src, dir.path().join("main.tf"))?;
    let tf = std::env::var("TAKOSUMI_TERRAFORM_BIN")?;
    let config = std::env::var("TAKOSUMI_TF_CLI_CONFIG")?;
    for args in [
        &["init", "-input=false", "-no-color"][..],
        &["apply", "-auto-approve", "-input=false", "-no-color"][..],
    ] {
        let out = std::process::Command::new(&tf)
            .args(args)
            .current_dir(dir.path())
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", dir.path())
            .env("TF_CLI_CONFIG_FILE", &config)
            .env("CHECKPOINT_DISABLE", "1")
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "terraform {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("terraform.tfstate"))?)?;
    state["outputs"]["canary"] = json!({ "value": canary, "type": "string" });
    Ok(serde_json::to_vec_pretty(&state)?)
}

/// Runs the built `takosumi` CLI against the stack as the admin.
async fn cli(stack: &Stack, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let out = tokio::process::Command::new(takosumi_tests::binary("takosumi")?)
        .env_clear()
        .env("TAKOSUMI_DEPLOY_CONTROL_URL", &stack.api_url)
        .env("TAKOSUMI_DEPLOY_CONTROL_TOKEN", &stack.admin_token)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The promise: `attach_state` takes a Terraform state (format version 4) an operator
/// pulled from the provider side and makes it the Capsule's next StateVersion, and it
/// refuses, changing nothing (no StateVersion, no generation, no object, the Run
/// unresolved), a state of another lineage (a real terraform apply elsewhere:
/// `state_lineage_mismatch`), an older serial, a state over 8 MiB (413
/// `state_too_large`), one that is not format version 4, and a non-admin token; none of
/// the refusals echo the state. Attached through the CLI (`takosumi resolve RUN --note …
/// --attach-state FILE`) it becomes current (generation +1; the plan of the same config
/// shows no changes), the Run's record names its digest, serial and lineage and nothing
/// of its content, and sending it twice writes one StateVersion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attach_state_checks_the_state_and_makes_it_current() -> anyhow::Result<()> {
    let s3 = tokio::task::spawn_blocking(PrivateS3::start).await??;
    let (stack, rabbit) = start_private(&s3).await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register_null(&stack, &repo).await?;
    // Generation 1: an ordinary apply.
    let (plan, _) = plan_changes(&stack, &capsule).await?;
    let first = stack.wait(stack.client.apply(plan, None).await?.id).await?;
    assert_eq!(first.status, RunStatus::Applied, "{:?}", first.error);
    let current: serde_json::Value = {
        let sv_id = first
            .state_version_id
            .ok_or_else(|| anyhow::anyhow!("no StateVersion"))?;
        let sv = takosumi_store::states::versions::get(&stack.ctx.pool, sv_id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no StateVersion row"))?;
        let sealed = stack.ctx.objects.get(&sv.object_key, 64 << 20).await?;
        serde_json::from_slice(&stack.ctx.sealer.unseal(
            Purpose::State,
            &sv_id.to_string(),
            &sealed,
        )?)?
    };
    let lineage = current["lineage"].as_str().unwrap_or_default().to_owned();

    // A new revision replaces both nodes; its apply's state cannot be stored.
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/examples/null/main.tf"),
    )?
    .replace("default = \"1\"", "default = \"2\"");
    repo.commit(&[("infra/null/main.tf", &text)], "revision 2")?;
    let (plan, changes) = plan_changes(&stack, &capsule).await?;
    assert_eq!((changes.add, changes.destroy), (2, 2));
    let (apply, _, _, held_state) = apply_unstored(&stack, &s3, &capsule, plan).await?;
    let ids = resource_ids(&held_state)?;
    let path = format!("/api/v1/runs/{apply}/resolve");
    let states_dir = s3
        .data_dir()
        .join(&stack.settings.s3_bucket)
        .join("states")
        .join(capsule.id.to_string());
    let objects = || {
        std::fs::read_dir(&states_dir)
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let unchanged = |what: &'static str| {
        let stack = &stack;
        async move {
            assert_eq!(
                state_version_count(stack).await?,
                1,
                "{what}: no StateVersion"
            );
            let c = stack.client.get_capsule(capsule.id).await?;
            assert_eq!(c.state_generation, 1, "{what}: generation");
            assert!(
                stack.client.get_run(apply).await?.resolution.is_none(),
                "{what}: still unresolved"
            );
            anyhow::Ok(())
        }
    };
    assert_eq!(objects(), 1);
    let canary = format!("canary-state-{}", uuid::Uuid::new_v4().simple());
    let attach = |state: &serde_json::Value| json!({ "action": "attach_state", "note": "pulled from the provider side", "state": state });

    // Another lineage: a state from a real terraform apply elsewhere.
    let foreign: serde_json::Value = serde_json::from_slice(&foreign_state(&canary)?)?;
    assert_ne!(foreign["lineage"].as_str(), Some(lineage.as_str()));
    let (status, err) = stack.call("POST", &path, attach(&foreign)).await?;
    assert_eq!(
        (status, err["code"].as_str()),
        (409, Some("state_lineage_mismatch")),
        "{err}"
    );
    assert!(!err.to_string().contains(&canary));
    unchanged("lineage mismatch").await?;

    // An older serial of the same lineage.
    let mut older = current.clone();
    older["serial"] = json!(current["serial"].as_u64().unwrap_or(1).saturating_sub(1));
    older["outputs"]["canary"] = json!({ "value": canary, "type": "string" });
    let (status, err) = stack.call("POST", &path, attach(&older)).await?;
    assert_eq!(
        (status, err["code"].as_str()),
        (409, Some("state_serial_older")),
        "{err}"
    );
    unchanged("older serial").await?;

    // Not format version 4.
    let mut v3 = older.clone();
    v3["version"] = json!(3);
    let (status, err) = stack.call("POST", &path, attach(&v3)).await?;
    assert_eq!(
        (status, err["code"].as_str()),
        (422, Some("invalid_state")),
        "{err}"
    );
    assert!(!err.to_string().contains(&canary));
    unchanged("version 3").await?;

    // Over 8 MiB.
    let mut big: serde_json::Value = serde_json::from_slice(&held_state)?;
    big["outputs"]["pad"] = json!({ "value": "x".repeat(9 << 20), "type": "string" });
    let (status, err) = stack.call("POST", &path, attach(&big)).await?;
    assert_eq!(
        (status, err["code"].as_str()),
        (413, Some("state_too_large")),
        "{err}"
    );
    unchanged("oversized").await?;

    // A non-admin token.
    let (operator, _) = stack.token("op", "operator").await?;
    let held_json: serde_json::Value = serde_json::from_slice(&held_state)?;
    let (status, err) = stack
        .request(
            "POST",
            &path,
            Some(&operator),
            Some(&attach(&held_json).to_string()),
        )
        .await?;
    assert_eq!(status, 403, "{err}");
    unchanged("non-admin").await?;
    assert_eq!(objects(), 1, "no refused state reached storage");

    // The state pulled from the provider side (here: the one the lost apply wrote),
    // attached through the CLI.
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), &held_state)?;
    let file_path = file.path().display().to_string();
    let apply_id = apply.to_string();
    let (code, out, err) = cli(
        &stack,
        &[
            "resolve",
            &apply_id,
            "--note",
            "state pulled from the provider side",
            "--attach-state",
            &file_path,
        ],
    )
    .await?;
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(
        err.contains("is now the Capsule's state (generation 2)"),
        "{err}"
    );
    assert_no_state_content(&format!("{out}{err}"), &ids, &canary);
    let run = stack.client.get_run(apply).await?;
    assert_eq!(
        run.resolution.as_ref().map(|r| &r.action),
        Some(&ResolutionAction::AttachState.into())
    );
    let sv_id = run
        .state_version_id
        .ok_or_else(|| anyhow::anyhow!("the Run names no StateVersion"))?;
    let c = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(c.state_generation, 2, "generation +1");
    assert_eq!(c.current_state_version_id, Some(sv_id));
    let sv = takosumi_store::states::versions::get(&stack.ctx.pool, sv_id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no StateVersion row"))?;
    let stored = stack.ctx.objects.get(&sv.object_key, 64 << 20).await?;
    let opened = stack
        .ctx
        .sealer
        .unseal(Purpose::State, &sv_id.to_string(), &stored)?;
    assert_eq!(takosumi_store::sha256_hex(&opened), sv.digest);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&opened)?,
        held_json
    );

    // Twice: refused, one StateVersion more than before, not two.
    let again = stack
        .client
        .attach_state(apply, "again", &held_state)
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(api_code(&again), (409, "already_resolved".to_owned()));
    assert_eq!(state_version_count(&stack).await?, 2);
    assert_eq!(objects(), 2);

    let record = record_text(&stack, apply).await?;
    assert!(
        record.contains(&sv.digest) && record.contains(&lineage),
        "digest and lineage recorded"
    );
    assert_no_state_content(&record, &ids, &canary);

    // The attached state is current: the same config plans no changes.
    let (_, changes) = plan_changes(&stack, &capsule).await?;
    assert!(changes.is_empty(), "{changes:?}");

    stack.stop().await?;
    drop(rabbit);
    drop(s3);
    Ok(())
}
