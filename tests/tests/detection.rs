//! End-to-end: detection never starts an apply. Drift checks report and keep their plan
//! for a reconcile, sweeps only enqueue checks, signed pushes only mark Capsules stale
//! (automatic update being the one explicit exception), and RunGroups act on each Run.

use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use takosumi_client::{Capsule, NewCapsule, Source};
use takosumi_core::{CapsuleStatus, RunId, RunStatus, WorkspaceId};
use takosumi_tests::{GitRepo, Options, Stack, Steps, WATCHED_CONFIG, watched_input};

async fn workspace(stack: &Stack) -> anyhow::Result<WorkspaceId> {
    Ok(stack
        .client
        .create_workspace(&format!(
            "ws-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?
        .id)
}

async fn capsule(
    stack: &Stack,
    ws: WorkspaceId,
    name: &str,
    repo: &str,
    branch: &str,
    dir: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    let req = NewCapsule {
        name: name.into(),
        source: Source {
            repo: repo.into(),
            branch: branch.into(),
        },
        dir: dir.into(),
        tool: "terraform".into(),
        vars: vars.as_object().cloned().unwrap_or_default(),
    };
    Ok(stack.client.create_capsule(ws, &req).await?)
}

async fn drift_check(stack: &Stack, cap: &Capsule) -> anyhow::Result<takosumi_client::Run> {
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/drift-check", cap.id),
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{b}");
    let id: RunId = b["id"].as_str().unwrap().parse()?;
    stack.wait(id).await
}

/// Real drift without a cloud: an out-of-band input changes; the check reports drift and
/// keeps its plan; the reconcile applies exactly that plan; the next check finds none. A
/// newer check replaces the plan an older one kept, and reconciling the old one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drift_is_detected_kept_reconciled_and_replaced() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let dir = takosumi_tests::fixture_dir()?;
    let input = dir.path().join("input.tfstate");
    std::fs::write(&input, watched_input("a"))?;
    let repo = GitRepo::new(&[("infra/watched/main.tf", WATCHED_CONFIG)])?;
    let ws = workspace(&stack).await?;
    let cap = capsule(
        &stack,
        ws,
        "watched",
        &repo.url(),
        "main",
        "infra/watched",
        json!({ "input_state": input.display().to_string() }),
    )
    .await?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(
        stack
            .wait(stack.client.apply(plan.id, None).await?.id)
            .await?
            .status,
        RunStatus::Applied
    );
    let applies = stack.tool_count("apply");

    let clean = drift_check(&stack, &cap).await?;
    assert_eq!(
        (clean.status, clean.drift),
        (RunStatus::Planned, Some(false)),
        "{clean:?}"
    );
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/runs/{}/apply", clean.id),
            json!({}),
        )
        .await?;
    assert_eq!((s, b["code"].as_str()), (409, Some("no_kept_plan")), "{b}");

    std::fs::write(&input, watched_input("b"))?;
    let older = drift_check(&stack, &cap).await?;
    assert_eq!(older.drift, Some(true), "{older:?}");
    // The tool itself was asked (`-detailed-exitcode`; its exit code 2 is not a failure).
    let events = stack.client.events(older.id).await?;
    assert!(
        events.iter().any(|e| e.kind == "tool_started"
            && e.data["command"] == "plan"
            && e.data["detailedExitcode"] == true),
        "{events:?}"
    );
    let c = older.changes.unwrap();
    assert_eq!((c.add, c.destroy), (1, 1));
    let status = stack.client.get_capsule(cap.id).await?.status;
    assert_eq!(status, "drifted");
    // Every answer that shows the Capsule says so, the Workspace's list (the CLI's
    // `capsules`, the dashboard's Workspace page) as much as the Capsule's own.
    let (s, listed) = stack
        .call(
            "GET",
            &format!("/api/v1/workspaces/{ws}/capsules"),
            Value::Null,
        )
        .await?;
    assert_eq!(s, 200, "{listed}");
    let own = stack
        .call("GET", &format!("/api/v1/capsules/{}", cap.id), Value::Null)
        .await?
        .1;
    assert_eq!(
        listed["capsules"][0], own,
        "the list shows the Capsule as its own answer does"
    );
    let listed = stack.client.list_capsules(ws).await?;
    assert_eq!(
        (
            listed[0].status.as_str(),
            listed[0].drifted,
            listed[0].drift
        ),
        ("drifted", true, Some(true)),
        "{listed:?}"
    );
    // Detection never starts an apply.
    assert_eq!(stack.tool_count("apply"), applies);

    let newer = drift_check(&stack, &cap).await?;
    assert_eq!(newer.drift, Some(true));
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/runs/{}/apply", older.id),
            json!({}),
        )
        .await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (409, Some("no_kept_plan")),
        "the replaced plan must not be applicable: {b}"
    );
    let kept = stack
        .ctx
        .objects
        .list(&format!("runs/{}/", older.id))
        .await?;
    assert!(
        kept.iter().all(|k| !k.contains("/plan.")),
        "the replaced plan was not dropped: {kept:?}"
    );

    let reconcile = stack
        .wait(stack.client.apply(newer.id, None).await?.id)
        .await?;
    assert_eq!(reconcile.status, RunStatus::Applied, "{reconcile:?}");
    assert_eq!(
        reconcile.plan_digest, newer.plan_digest,
        "the reconcile carries out exactly the kept plan"
    );
    let after = drift_check(&stack, &cap).await?;
    assert_eq!(after.drift, Some(false), "{after:?}");
    assert_eq!(stack.client.get_capsule(cap.id).await?.status, "ok");
    let listed = stack.client.list_capsules(ws).await?;
    assert_eq!(
        (
            listed[0].status.as_str(),
            listed[0].drifted,
            listed[0].drift
        ),
        ("ok", false, Some(false)),
        "{listed:?}"
    );
    stack.stop().await
}

/// Two sweepers at once over many Capsules enqueue one drift check per Capsule, and a
/// second pass enqueues nothing while those checks are queued. The sweep creates no
/// other Run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_sweeps_enqueue_each_capsule_once() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let n = 40;
    for i in 0..n + 5 {
        let c = capsule(
            &stack,
            ws,
            &format!("c{i}"),
            &repo.url(),
            "main",
            "infra/network",
            json!({ "region": "eu" }),
        )
        .await?;
        // The first n were applied (seeded, as this stack runs no tool); five never were,
        // and the sweep leaves those out.
        if i < n {
            seed_applied(&stack, ws, c.id).await?;
        }
    }
    let (s, b) = stack
        .call(
            "PATCH",
            &format!("/api/v1/workspaces/{ws}/settings"),
            json!({ "driftIntervalSecs": 3600 }),
        )
        .await?;
    assert_eq!(s, 200, "{b}");
    let other = takosumi_runtime::Ctx::connect(&stack.settings, "sweep-2").await?;
    let before = unix_ms_now();
    let (a, b) = tokio::join!(
        takosumi_sweep::sweep_once(&stack.ctx),
        takosumi_sweep::sweep_once(&other)
    );
    assert_eq!(a? + b?, n);
    // Time-ordered ids, as every other Run's (`RunId::new`): version 7, made during the pass.
    let after = unix_ms_now();
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM runs WHERE actor_id = 'sweep'")
        .fetch_all(&stack.ctx.pool)
        .await?;
    assert_eq!(ids.len() as i64, n);
    for id in &ids {
        assert_eq!(id.get_version_num(), 7, "{id} is not a version-7 uuid");
        assert_eq!(id.get_variant(), uuid::Variant::RFC4122, "{id}");
        let (secs, nanos) = id
            .get_timestamp()
            .ok_or_else(|| anyhow::anyhow!("{id} has no timestamp"))?
            .to_unix();
        let ms = u128::from(secs) * 1000 + u128::from(nanos / 1_000_000);
        assert!(
            (before..=after).contains(&ms),
            "{id} was made at {ms} ms, not during the pass ({before}..={after})"
        );
    }
    let per_capsule: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FROM runs WHERE actor_id = 'sweep' GROUP BY capsule_id",
    )
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert_eq!(per_capsule.len() as i64, n);
    assert!(per_capsule.iter().all(|c| *c == 1), "{per_capsule:?}");
    let kinds: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT kind::text FROM runs WHERE actor_id = 'sweep'")
            .fetch_all(&stack.ctx.pool)
            .await?;
    assert_eq!(kinds, vec!["drift_check".to_owned()]);
    let others: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM runs WHERE actor_id <> 'sweep' AND actor_id <> 'seeded'",
    )
    .fetch_one(&stack.ctx.pool)
    .await?;
    assert_eq!(
        others, 0,
        "the sweep created a Run that is not a drift check"
    );
    assert_eq!(takosumi_sweep::sweep_once(&stack.ctx).await?, 0);
    stack.stop().await
}

/// A pass walks the Capsules in ranges side by side, several batches each: every due
/// Capsule gets exactly one check and one wake-up, wherever the ranges and batches end,
/// also with a second sweeper walking at the same time; the next pass finds nothing due.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pass_walks_ranges_side_by_side_and_takes_each_capsule_once() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let pool = &stack.ctx.pool;
    // Fewer Capsules than ranges: one range, the whole key space.
    assert_eq!(takosumi_store::drift::sweep_bounds(pool, 2).await?, vec![]);
    // More than WALKS × BATCH, and not a multiple of either: each range takes batches
    // and ends on a short one.
    let n = (takosumi_sweep::WALKS * takosumi_sweep::BATCH + 123) as usize;
    takosumi_tests::seed::due_capsules(pool, "walks", n).await?;
    let bounds = takosumi_store::drift::sweep_bounds(pool, takosumi_sweep::WALKS).await?;
    assert_eq!(bounds.len() as i64, takosumi_sweep::WALKS - 1, "{bounds:?}");
    let first: i64 = sqlx::query_scalar("SELECT count(*) FROM capsules WHERE id <= $1")
        .bind(bounds[0].as_uuid())
        .fetch_one(pool)
        .await?;
    assert_eq!(
        first,
        (n / 2) as i64,
        "the ranges split the Capsules evenly"
    );
    let other = takosumi_runtime::Ctx::connect(&stack.settings, "sweep-2").await?;
    let (a, b) = tokio::join!(
        takosumi_sweep::sweep_once(&stack.ctx),
        takosumi_sweep::sweep_once(&other)
    );
    assert_eq!((a? + b?) as usize, n);
    let (checks, capsules): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT capsule_id) FROM runs WHERE kind = 'drift_check' AND actor_id = 'sweep'",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!((checks as usize, capsules as usize), (n, n));
    let wakes: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT payload->>'runId') FROM outbox WHERE topic = 'run.drift'",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!(wakes as usize, n, "one wake-up per check");
    assert_eq!(takosumi_sweep::sweep_once(&stack.ctx).await?, 0);
    stack.stop().await
}

fn unix_ms_now() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Records `capsule` as applied at some commit (an applied Run and its StateVersion), for a
/// stack that runs no tool.
async fn seed_applied(
    stack: &Stack,
    ws: WorkspaceId,
    capsule: takosumi_core::CapsuleId,
) -> anyhow::Result<()> {
    let run = uuid::Uuid::new_v4();
    let sv = uuid::Uuid::new_v4();
    let mut tx = stack.ctx.pool.begin().await?;
    sqlx::query(
        "INSERT INTO runs (id, kind, status, workspace_id, capsule_id, actor_kind, actor_id, source_commit)
         VALUES ($1, 'apply', 'applied', $2, $3, 'system', 'seeded', 'abcdef0123456789')",
    )
    .bind(run)
    .bind(ws.as_uuid())
    .bind(capsule.as_uuid())
    .execute(tx.db())
    .await?;
    sqlx::query(
        "INSERT INTO state_versions (id, capsule_id, generation, run_id, object_key, digest, size_bytes)
         VALUES ($1, $2, 1, $3, 'seeded', 'sha256:seeded', 0)",
    )
    .bind(sv)
    .bind(capsule.as_uuid())
    .bind(run)
    .execute(tx.db())
    .await?;
    sqlx::query(
        "UPDATE capsules SET current_state_version_id = $2, state_generation = 1,
                             drift_baseline_run_id = $3 WHERE id = $1",
    )
    .bind(capsule.as_uuid())
    .bind(sv)
    .bind(run)
    .execute(tx.db())
    .await?;
    tx.commit().await?;
    Ok(())
}

fn sign(secret: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

async fn push(
    stack: &Stack,
    ws: WorkspaceId,
    signature: &str,
    body: &Value,
) -> anyhow::Result<(u16, Value)> {
    let bytes = serde_json::to_vec(body)?;
    let resp = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/webhooks/git?workspace={ws}",
            stack.api_url
        ))
        .header("x-github-event", "push")
        .header("x-hub-signature-256", signature)
        .header("content-type", "application/json")
        .body(bytes)
        .send()
        .await?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().await.unwrap_or(Value::Null)))
}

/// A signed push marks exactly the Capsules of that repository and branch stale, with the
/// commit, and starts no Run; a forged signature is refused and records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn signed_push_marks_matching_capsules_stale_and_starts_nothing() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let elsewhere = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let main = capsule(
        &stack,
        ws,
        "main",
        &repo.url(),
        "main",
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let dev = capsule(
        &stack,
        ws,
        "dev",
        &repo.url(),
        "dev",
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let other = capsule(
        &stack,
        ws,
        "other",
        &elsewhere.url(),
        "main",
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/webhook-secret"),
            json!({}),
        )
        .await?;
    assert_eq!(s, 201, "{b}");
    let secret = b["secret"].as_str().unwrap().to_owned();
    let commit = repo.commit(&[("README.md", "change")], "push")?;
    let event = json!({ "ref": "refs/heads/main", "after": commit, "repository": { "clone_url": format!("{}.git", repo.url()) } });

    let activity_before: i64 = sqlx::query_scalar("SELECT count(*) FROM activity")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let forged = sign("not-the-secret", &serde_json::to_vec(&event)?);
    let (s, b) = push(&stack, ws, &forged, &event).await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (401, Some("invalid_signature")),
        "{b}"
    );
    let activity_after: i64 = sqlx::query_scalar("SELECT count(*) FROM activity")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(
        activity_before, activity_after,
        "a forged push recorded something"
    );
    assert_ne!(
        stack.client.get_capsule(main.id).await?.status,
        CapsuleStatus::Stale
    );

    let (s, b) = push(
        &stack,
        ws,
        &sign(&secret, &serde_json::to_vec(&event)?),
        &event,
    )
    .await?;
    assert_eq!(s, 202, "{b}");
    assert_eq!(b["stale"], json!([main.id]));
    assert_eq!(stack.client.get_capsule(main.id).await?.status, "stale");
    assert_eq!(stack.client.get_capsule(dev.id).await?.status, "ok");
    assert_eq!(stack.client.get_capsule(other.id).await?.status, "ok");
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(runs, 0, "a push started a Run");
    let stale_commit: Option<String> =
        sqlx::query_scalar("SELECT stale_commit FROM capsules WHERE id = $1")
            .bind(main.id.as_uuid())
            .fetch_one(&stack.ctx.pool)
            .await?;
    assert_eq!(stale_commit.as_deref(), Some(commit.as_str()));
    stack.stop().await
}

/// Automatic update: a push starts a plan with autoApplyRequested that continues to
/// apply when clean, and stops for review when the plan deletes something.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn automatic_update_applies_clean_plans_and_stops_on_deletions() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let ws = workspace(&stack).await?;
    let cap = capsule(
        &stack,
        ws,
        "nulls",
        &repo.url(),
        "main",
        "infra/null",
        json!({}),
    )
    .await?;
    let (s, b) = stack
        .call(
            "PATCH",
            &format!("/api/v1/capsules/{}/settings", cap.id),
            json!({ "autoUpdate": true }),
        )
        .await?;
    assert_eq!(s, 200, "{b}");
    let (_, b) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/webhook-secret"),
            json!({}),
        )
        .await?;
    let secret = b["secret"].as_str().unwrap().to_owned();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../infra/examples/null/main.tf"
    ))?;

    let send = |commit: String| {
        let (stack, secret, repo_url) = (&stack, secret.clone(), repo.url());
        async move {
            let event = json!({ "ref": "refs/heads/main", "after": commit, "repository": { "clone_url": repo_url } });
            let (s, b) = push(
                stack,
                ws,
                &sign(&secret, &serde_json::to_vec(&event)?),
                &event,
            )
            .await?;
            assert_eq!(s, 202, "{b}");
            let plan: RunId = b["autoUpdatePlans"][0]
                .as_str()
                .expect("an automatic-update plan")
                .parse()?;
            anyhow::Ok(plan)
        }
    };
    let commit = repo.commit(&[("README.md", "one")], "first push")?;
    let plan = stack.wait(send(commit.clone()).await?).await?;
    assert!(plan.auto_apply_requested);
    assert_eq!(plan.source_snapshot.as_ref().unwrap().commit, commit);
    let apply_id = wait_for_apply_of(&stack, plan.id).await?;
    let apply = stack.wait(apply_id).await?;
    assert_eq!(
        apply.status,
        RunStatus::Applied,
        "a clean automatic update applies: {apply:?}"
    );

    let commit = repo.commit(
        &[(
            "infra/null/main.tf",
            &text.replacen("default = \"1\"", "default = \"2\"", 1),
        )],
        "replace",
    )?;
    let plan = stack.wait(send(commit).await?).await?;
    assert_eq!(plan.changes.unwrap().destroy, 2);
    let held = stack
        .wait(wait_for_apply_of(&stack, plan.id).await?)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let hold = held.hold.unwrap();
    assert_eq!(hold.reason, "max_destroy");
    assert!(
        hold.details["maxDestroy"]["autoApply"].is_string(),
        "{:?}",
        hold.details
    );
    stack.stop().await
}

async fn wait_for_apply_of(stack: &Stack, plan: RunId) -> anyhow::Result<RunId> {
    for _ in 0..200 {
        let id: Option<uuid::Uuid> =
            sqlx::query_scalar("SELECT id FROM runs WHERE plan_run_id = $1")
                .bind(plan.as_uuid())
                .fetch_optional(&stack.ctx.pool)
                .await?;
        if let Some(id) = id {
            return Ok(RunId::from_uuid(id));
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    anyhow::bail!("no Apply Run followed {plan}")
}

/// A RunGroup: plan-update plans every Capsule, the group's applies are held by an
/// approval rule, one group approval releases them all, and each Run keeps its own record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_group_planned_approved_and_applied_at_once() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let a = capsule(
        &stack,
        ws,
        "a",
        &repo.url(),
        "main",
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let b_cap = capsule(
        &stack,
        ws,
        "b",
        &repo.url(),
        "main",
        "infra/network",
        json!({ "region": "us" }),
    )
    .await?;
    stack
        .call(
            "PUT",
            &format!("/api/v1/workspaces/{ws}/rules"),
            json!({ "approval": { "required": 1 } }),
        )
        .await?;
    let (s, group) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/plan-update"),
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{group}");
    let rg = group["id"].as_str().unwrap().to_owned();
    assert_eq!(group["runIds"].as_array().unwrap().len(), 2);
    for id in group["runIds"].as_array().unwrap() {
        let run = stack.wait(id.as_str().unwrap().parse()?).await?;
        assert_eq!(run.status, RunStatus::Planned);
    }
    let (s, applied) = stack
        .call("POST", &format!("/api/v1/run-groups/{rg}/apply"), json!({}))
        .await?;
    assert_eq!(s, 202, "{applied}");
    let apply_ids: Vec<RunId> = applied["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["applyRunId"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(apply_ids.len(), 2);
    for id in &apply_ids {
        assert_eq!(stack.wait(*id).await?.status, RunStatus::Held);
    }
    let (token, _) = stack.token("approver", "approver").await?;
    let resp = reqwest::Client::new()
        .post(format!("{}/api/v1/run-groups/{rg}/approve", stack.api_url))
        .bearer_auth(&token)
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 200);
    for id in &apply_ids {
        let run = stack.wait_released(*id).await?;
        assert_eq!(run.status, RunStatus::Applied, "{run:?}");
        let events = stack.client.events(*id).await?;
        assert_eq!(
            events.iter().filter(|e| e.kind == "approved").count(),
            1,
            "each Run keeps its own approval record"
        );
    }
    let (s, g) = stack
        .call("GET", &format!("/api/v1/run-groups/{rg}"), Value::Null)
        .await?;
    assert_eq!(s, 200);
    assert_eq!(
        g["runs"].as_array().unwrap().len(),
        4,
        "two plans and their two applies: {g}"
    );
    let outputs: Vec<Value> = [a.id, b_cap.id]
        .iter()
        .map(|c| {
            g["runs"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["capsuleId"] == json!(c) && r["kind"] == json!("apply"))
                .unwrap()["outputs"]
                .clone()
        })
        .collect();
    assert_eq!(
        outputs,
        vec![json!({ "vpc": "vpc-eu" }), json!({ "vpc": "vpc-us" })]
    );
    stack.stop().await
}

async fn pull_request(
    stack: &Stack,
    ws: WorkspaceId,
    secret: &str,
    repo: &GitRepo,
    head_ref: &str,
    head_sha: &str,
) -> anyhow::Result<RunId> {
    let event = json!({
        "action": "opened",
        "pull_request": { "base": { "ref": "main" }, "head": { "ref": head_ref, "sha": head_sha } },
        "repository": { "clone_url": repo.url() }
    });
    let bytes = serde_json::to_vec(&event)?;
    let resp = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/webhooks/git?workspace={ws}",
            stack.api_url
        ))
        .header("x-github-event", "pull_request")
        .header("x-hub-signature-256", sign(secret, &bytes))
        .header("content-type", "application/json")
        .body(bytes)
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 202);
    let body: Value = resp.json().await?;
    Ok(body["speculativePlans"][0]
        .as_str()
        .expect("a speculative plan")
        .parse()?)
}

/// A pull request gets a speculative plan of its head that can never be applied; a head
/// declaring a data source that acts when planned is refused by the dry-run scan, named
/// by address, and the tool never plans it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pull_request_plans_are_speculative_and_scanned() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let cap = capsule(
        &stack,
        ws,
        "net",
        &repo.url(),
        "main",
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let (_, b) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/webhook-secret"),
            json!({}),
        )
        .await?;
    let secret = b["secret"].as_str().unwrap().to_owned();

    let clean_sha = repo.commit(&[("README.md", "pr")], "clean pr")?;
    let plan = stack
        .wait(pull_request(&stack, ws, &secret, &repo, "main", &clean_sha).await?)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    assert_eq!(plan.source_snapshot.as_ref().unwrap().commit, clean_sha);
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/runs/{}/apply", plan.id),
            json!({}),
        )
        .await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (409, Some("speculative_plan")),
        "{b}"
    );

    let plans_before = stack.tool_count("plan");
    let acting = "data \"external\" \"lookup\" {\n  program = [\"sh\", \"-c\", \"echo {}\"]\n}\n";
    let bad_sha = repo.commit(&[("infra/network/lookup.tf", acting)], "acting pr")?;
    let refused = stack
        .wait(pull_request(&stack, ws, &secret, &repo, "main", &bad_sha).await?)
        .await?;
    assert_eq!(refused.status, RunStatus::Failed, "{refused:?}");
    let error = refused.error.unwrap();
    assert_eq!(error.code, "dry_run_scan_refused");
    assert!(
        error.message.contains("data.external.lookup"),
        "{}",
        error.message
    );
    assert_eq!(
        stack.tool_count("plan"),
        plans_before,
        "a refused pull request plan ran the tool"
    );
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 0);
    stack.stop().await
}

/// The Workspace drift view rolls drifted Capsules up by what changed — the sorted set of
/// (resource address, action) from each latest check's `show -json` — not by change
/// counts: two Capsules whose `null_resource.watched` drifts are one row, a third whose
/// `null_resource.other` drifts with the very same counts (1 to add, 1 to destroy) is
/// another, and a Capsule without drift is in no row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drift_view_rolls_up_capsules_by_changed_resources() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let dir = takosumi_tests::fixture_dir()?;
    let other_tf = WATCHED_CONFIG.replace("\"watched\"", "\"other\"");
    let repo = GitRepo::new(&[
        ("infra/watched/main.tf", WATCHED_CONFIG),
        ("infra/other/main.tf", &other_tf),
    ])?;
    let ws = workspace(&stack).await?;
    let mut caps = Vec::new();
    for (name, cap_dir) in [
        ("a", "infra/watched"),
        ("b", "infra/watched"),
        ("c", "infra/other"),
        ("clean", "infra/watched"),
    ] {
        let input = dir.path().join(format!("{name}.tfstate"));
        std::fs::write(&input, watched_input("1"))?;
        let cap = capsule(
            &stack,
            ws,
            name,
            &repo.url(),
            "main",
            cap_dir,
            json!({ "input_state": input.display().to_string() }),
        )
        .await?;
        let plan = stack
            .wait(stack.client.plan(cap.id, None).await?.id)
            .await?;
        let apply = stack
            .wait(stack.client.apply(plan.id, None).await?.id)
            .await?;
        assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
        caps.push((cap, input));
    }
    for (_, input) in &caps[..3] {
        std::fs::write(input, watched_input("2"))?;
    }
    let (s, group) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/drift-check"),
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{group}");
    for id in group["runIds"].as_array().unwrap() {
        let run = stack.wait(id.as_str().unwrap().parse()?).await?;
        assert_eq!(run.status, RunStatus::Planned, "{run:?}");
        let c = run.changes.unwrap();
        let drifted = run.capsule_id != caps[3].0.id;
        assert_eq!(run.drift, Some(drifted), "{run:?}");
        if drifted {
            assert_eq!((c.add, c.change, c.destroy), (1, 0, 1));
        }
    }

    let (s, view) = stack
        .call(
            "GET",
            &format!("/api/v1/workspaces/{ws}/drift"),
            Value::Null,
        )
        .await?;
    assert_eq!(s, 200, "{view}");
    let rows = view["drifted"].as_array().unwrap();
    assert_eq!(
        rows.len(),
        2,
        "two rows, one per set of changed resources: {view}"
    );
    let row_of = |address: &str| {
        rows.iter()
            .find(|r| r["drift"]["resources"][0]["address"] == json!(address))
            .unwrap_or_else(|| panic!("no row for {address}: {view}"))
    };
    let capsules_of = |row: &Value| {
        let mut ids: Vec<String> = row["capsules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["capsuleId"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };
    let watched = row_of("null_resource.watched");
    assert_eq!(
        watched["drift"]["resources"],
        json!([{ "address": "null_resource.watched", "type": "null_resource", "action": "replace" }])
    );
    let mut expected = vec![caps[0].0.id.to_string(), caps[1].0.id.to_string()];
    expected.sort();
    assert_eq!(capsules_of(watched), expected);
    let other = row_of("null_resource.other");
    assert_eq!(
        other["drift"]["resources"],
        json!([{ "address": "null_resource.other", "type": "null_resource", "action": "replace" }])
    );
    assert_eq!(capsules_of(other), vec![caps[2].0.id.to_string()]);
    assert!(
        !view.to_string().contains(&caps[3].0.id.to_string()),
        "a Capsule without drift is in no row: {view}"
    );
    stack.stop().await
}

/// A drift check or a plan-update group an agent submits is held (`agent_run`) before
/// anything plans, like an agent's plan: the tool never starts until a person releases
/// it; the released check runs as a drift check and the released group's plans plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_drift_checks_and_plan_updates_are_held_before_planning() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let cap = capsule(
        &stack,
        ws,
        "net",
        &repo.url(),
        "main",
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    // applied once, so a drift check has something to compare with
    stack.plan_and_apply(cap.id).await?;
    let plans_before = stack.tool_count("plan");
    let (agent, _) = stack.token("copilot", "agent").await?;
    let (approver, _) = stack.token("human", "approver").await?;
    let held = |run: &Value| {
        assert_eq!(run["status"], json!("held"), "{run}");
        assert_eq!(run["hold"]["reason"], json!("agent_run"), "{run}");
        assert_eq!(run["actor"]["kind"], json!("agent"), "{run}");
    };

    let (s, check) = stack
        .request(
            "POST",
            &format!("/api/v1/capsules/{}/drift-check", cap.id),
            Some(&agent),
            None,
        )
        .await?;
    assert_eq!(s, 202, "{check}");
    held(&check);
    let mut group_runs = Vec::new();
    for what in ["drift-check", "plan-update"] {
        let (s, group) = stack
            .request(
                "POST",
                &format!("/api/v1/workspaces/{ws}/{what}"),
                Some(&agent),
                None,
            )
            .await?;
        assert_eq!(s, 202, "{group}");
        let ids = group["runIds"].as_array().unwrap();
        assert_eq!(ids.len(), 1, "{group}");
        let (_, run) = stack
            .call(
                "GET",
                &format!("/api/v1/runs/{}", ids[0].as_str().unwrap()),
                Value::Null,
            )
            .await?;
        held(&run);
        group_runs.push((group["id"].as_str().unwrap().to_owned(), run));
    }
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    assert_eq!(
        stack.tool_count("plan"),
        plans_before,
        "an agent's Run planned before a person released it"
    );
    for (_, run) in &group_runs {
        let (_, now) = stack
            .call(
                "GET",
                &format!("/api/v1/runs/{}", run["id"].as_str().unwrap()),
                Value::Null,
            )
            .await?;
        assert_eq!(now["status"], json!("held"), "{now}");
    }

    let check_id: RunId = check["id"].as_str().unwrap().parse()?;
    let (s, b) = stack
        .request(
            "POST",
            &format!("/api/v1/runs/{check_id}/approve"),
            Some(&approver),
            Some("{}"),
        )
        .await?;
    assert_eq!(s, 200, "{b}");
    let released = stack.wait_released(check_id).await?;
    assert_eq!(released.status, RunStatus::Planned, "{released:?}");
    assert!(
        released.drift.is_some(),
        "released as a drift check: {released:?}"
    );
    for (rg, run) in &group_runs {
        let (s, b) = stack
            .request(
                "POST",
                &format!("/api/v1/run-groups/{rg}/approve"),
                Some(&approver),
                None,
            )
            .await?;
        assert_eq!(s, 200, "{b}");
        let run = stack
            .wait_released(run["id"].as_str().unwrap().parse()?)
            .await?;
        assert_eq!(run.status, RunStatus::Planned, "{run:?}");
    }
    stack.stop().await
}

/// Drift is reality against what was applied, exactly as a user meets it: apply
/// at commit A, push commit B (the Capsule goes `stale`), check: the check plans A, not B,
/// finds no drift and records that it checked A; the Capsule is stale and not drifted.
/// Reality then moves out of band: the check, still at A, reports only that; the reconcile
/// carries out exactly that check's plan and B is never applied. A Capsule never applied
/// is refused (409 `not_applied`, nothing created), skipped by a Workspace check and left
/// out by the sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drift_checks_compare_reality_with_the_applied_commit() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let dir = takosumi_tests::fixture_dir()?;
    let input = dir.path().join("input.tfstate");
    std::fs::write(&input, watched_input("a"))?;
    let repo = GitRepo::new(&[("infra/watched/main.tf", WATCHED_CONFIG)])?;
    let ws = workspace(&stack).await?;
    let vars = json!({ "input_state": input.display().to_string() });
    let cap = capsule(
        &stack,
        ws,
        "watched",
        &repo.url(),
        "main",
        "infra/watched",
        vars.clone(),
    )
    .await?;
    let never = capsule(
        &stack,
        ws,
        "never-applied",
        &repo.url(),
        "main",
        "infra/watched",
        vars,
    )
    .await?;

    let runs_before: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/drift-check", never.id),
            json!({}),
        )
        .await?;
    assert_eq!((s, b["code"].as_str()), (409, Some("not_applied")), "{b}");
    assert!(
        b["message"].as_str().unwrap().contains("apply it first"),
        "{b}"
    );
    let runs_after: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(runs_before, runs_after, "a refused check created a Run");

    let (_, applied) = stack.plan_and_apply(cap.id).await?;
    let commit_a = applied.source_snapshot.clone().unwrap().commit;

    // Commit B adds a resource nobody applied; a signed push marks the Capsule stale.
    let with_b = format!("{WATCHED_CONFIG}\nresource \"null_resource\" \"added_in_b\" {{}}\n");
    let commit_b = repo.commit(&[("infra/watched/main.tf", &with_b)], "B")?;
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/webhook-secret"),
            json!({}),
        )
        .await?;
    assert_eq!(s, 201, "{b}");
    let secret = b["secret"].as_str().unwrap().to_owned();
    let event = json!({ "ref": "refs/heads/main", "after": commit_b, "repository": { "clone_url": format!("{}.git", repo.url()) } });
    let (s, b) = push(
        &stack,
        ws,
        &sign(&secret, &serde_json::to_vec(&event)?),
        &event,
    )
    .await?;
    assert_eq!(s, 202, "{b}");
    let shown = stack.client.get_capsule(cap.id).await?;
    assert_eq!((shown.status.as_str(), shown.stale), ("stale", true));

    let clean = drift_check(&stack, &cap).await?;
    assert_eq!(
        (clean.status, clean.drift),
        (RunStatus::Planned, Some(false)),
        "B's new resource is not drift: {clean:?}"
    );
    let checked = clean.source_snapshot.clone().unwrap().commit;
    assert_eq!(checked, commit_a, "the check planned the applied commit");
    assert_ne!(checked, commit_b);
    let shown = stack.client.get_capsule(cap.id).await?;
    assert!(shown.stale && !shown.drifted, "{shown:?}");

    std::fs::write(&input, watched_input("b"))?;
    let drifted = drift_check(&stack, &cap).await?;
    assert_eq!(drifted.drift, Some(true), "{drifted:?}");
    assert_eq!(drifted.source_snapshot.clone().unwrap().commit, commit_a);
    let c = drifted.changes.unwrap();
    assert_eq!(
        (c.add, c.change, c.destroy),
        (1, 0, 1),
        "only the out-of-band change (the watched resource replaced), not B's addition"
    );
    let shown = stack.client.get_capsule(cap.id).await?;
    assert!(shown.stale && shown.drifted, "{shown:?}");

    let reconcile = stack
        .wait(stack.client.apply(drifted.id, None).await?.id)
        .await?;
    assert_eq!(reconcile.status, RunStatus::Applied, "{reconcile:?}");
    assert_eq!(reconcile.plan_digest, drifted.plan_digest);
    assert_eq!(reconcile.source_snapshot.clone().unwrap().commit, commit_a);
    let after = drift_check(&stack, &cap).await?;
    assert_eq!(after.drift, Some(false), "{after:?}");
    // B was never applied: planning the branch now still adds B's resource.
    let plan_b = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan_b.source_snapshot.clone().unwrap().commit, commit_b);
    assert_eq!(plan_b.changes.unwrap().add, 1, "{plan_b:?}");

    // The sweep checks only what was applied; a Workspace check skips the rest and says so.
    let (s, b) = stack
        .call(
            "PATCH",
            &format!("/api/v1/workspaces/{ws}/settings"),
            json!({ "driftIntervalSecs": 3600 }),
        )
        .await?;
    assert_eq!(s, 200, "{b}");
    assert_eq!(takosumi_sweep::sweep_once(&stack.ctx).await?, 1);
    let swept: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT capsule_id FROM runs WHERE actor_id = 'sweep' AND kind = 'drift_check'",
    )
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert_eq!(swept, vec![cap.id.as_uuid()]);
    let (s, b) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/drift-check"),
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{b}");
    assert_eq!(b["runIds"].as_array().unwrap().len(), 1, "{b}");
    assert_eq!(
        b["skipped"],
        json!([{ "capsuleId": never.id, "code": "not_applied" }])
    );
    let group_run: RunId = b["runIds"][0].as_str().unwrap().parse()?;
    assert_eq!(stack.wait(group_run).await?.drift, Some(false));
    let sweep_run: RunId = sqlx::query_scalar::<_, uuid::Uuid>(
        "SELECT id FROM runs WHERE actor_id = 'sweep' AND kind = 'drift_check'",
    )
    .fetch_one(&stack.ctx.pool)
    .await
    .map(RunId::from_uuid)?;
    stack.wait(sweep_run).await?;
    stack.stop().await
}

/// "A reconcile … whose plan went stale before its approval landed fails the same way an
/// apply does, saying to run the check again and propose the reconcile from it": a check
/// keeps its plan, another apply moves the state on, and the reconcile fails
/// `state_generation_changed` without running the tool, in the seed's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_reconcile_says_to_run_the_check_again() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let dir = takosumi_tests::fixture_dir()?;
    let input = dir.path().join("input.tfstate");
    std::fs::write(&input, watched_input("a"))?;
    let repo = GitRepo::new(&[("infra/watched/main.tf", WATCHED_CONFIG)])?;
    let ws = workspace(&stack).await?;
    let cap = capsule(
        &stack,
        ws,
        "watched",
        &repo.url(),
        "main",
        "infra/watched",
        json!({ "input_state": input.display().to_string() }),
    )
    .await?;
    stack.plan_and_apply(cap.id).await?;
    std::fs::write(&input, watched_input("b"))?;
    let check = drift_check(&stack, &cap).await?;
    assert_eq!(check.drift, Some(true), "{check:?}");
    // The state moves on before anyone reconciles.
    stack.plan_and_apply(cap.id).await?;
    let applies = stack.tool_count("apply");
    let reconcile = stack
        .wait(stack.client.apply(check.id, None).await?.id)
        .await?;
    assert_eq!(reconcile.status, RunStatus::Failed, "{reconcile:?}");
    let error = reconcile.error.clone().unwrap();
    assert_eq!(error.code, "state_generation_changed");
    assert!(
        error
            .message
            .contains("run the drift check again and propose the reconcile from it"),
        "{}",
        error.message
    );
    assert_eq!(stack.tool_count("apply"), applies, "nothing was applied");
    stack.stop().await
}

/// A drift check plans with the variables of what was applied, not the Capsule's defaults:
/// a plan given its own variable and applied, then checked, reports no drift even though
/// the Capsule's default points somewhere else; a change behind the applied variable is
/// drift. The check's record names the variables it planned with.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drift_check_plans_with_the_applied_plans_variables() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let dir = takosumi_tests::fixture_dir()?;
    let default_input = dir.path().join("default.tfstate");
    let applied_input = dir.path().join("applied.tfstate");
    std::fs::write(&default_input, watched_input("default"))?;
    std::fs::write(&applied_input, watched_input("applied"))?;
    let repo = GitRepo::new(&[("infra/watched/main.tf", WATCHED_CONFIG)])?;
    let ws = workspace(&stack).await?;
    let cap = capsule(
        &stack,
        ws,
        "overridden",
        &repo.url(),
        "main",
        "infra/watched",
        json!({ "input_state": default_input.display().to_string() }),
    )
    .await?;
    let request = takosumi_client::PlanRequest {
        vars: json!({ "input_state": applied_input.display().to_string() })
            .as_object()
            .cloned()
            .unwrap(),
        ..Default::default()
    };
    let plan = stack
        .wait(stack.client.plan_with(cap.id, None, &request).await?.id)
        .await?;
    let applied = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");

    let clean = drift_check(&stack, &cap).await?;
    assert_eq!(
        (clean.status, clean.drift),
        (RunStatus::Planned, Some(false)),
        "the check read the applied variable, not the Capsule's default: {clean:?}"
    );
    assert_eq!(clean.var_names, Some(vec!["input_state".to_owned()]));

    // The Capsule's default changing is not drift (nothing applied reads it) …
    std::fs::write(&default_input, watched_input("default-2"))?;
    let still = drift_check(&stack, &cap).await?;
    assert_eq!(still.drift, Some(false), "{still:?}");
    // … a change behind the applied variable is.
    std::fs::write(&applied_input, watched_input("applied-2"))?;
    let drifted = drift_check(&stack, &cap).await?;
    assert_eq!(drifted.drift, Some(true), "{drifted:?}");
    // Its reconcile applies with the same variables, so the next check is clean.
    let reconcile = stack
        .wait(stack.client.apply(drifted.id, None).await?.id)
        .await?;
    assert_eq!(reconcile.status, RunStatus::Applied, "{reconcile:?}");
    let after = drift_check(&stack, &cap).await?;
    assert_eq!(after.drift, Some(false), "{after:?}");
    Ok(())
}

/// Delivers `body` to the Workspace's webhook with `headers` (signature included).
async fn deliver(
    stack: &Stack,
    ws: WorkspaceId,
    headers: &[(&str, String)],
    body: &Value,
) -> anyhow::Result<(u16, Value)> {
    let mut req = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/webhooks/git?workspace={ws}",
            stack.api_url
        ))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body)?);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().await.unwrap_or(Value::Null)))
}

/// What a delivery can change, counted: Runs, activity lines, and the Capsule's last
/// update (a stale mark moves it).
async fn effects(stack: &Stack, cap: &Capsule) -> anyhow::Result<(i64, i64, String)> {
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let activity: i64 = sqlx::query_scalar("SELECT count(*) FROM activity")
        .fetch_one(&stack.ctx.pool)
        .await?;
    let updated: String = sqlx::query_scalar("SELECT updated_at::text FROM capsules WHERE id = $1")
        .bind(cap.id.as_uuid())
        .fetch_one(&stack.ctx.pool)
        .await?;
    Ok((runs, activity, updated))
}

/// A webhook delivery id is processed once: a signed push replayed with the same
/// `X-GitHub-Delivery` (sequentially, or four copies at once) answers 200 `duplicate` and
/// adds no Run, no activity line and no stale mark; the same payload under a new id is a
/// new delivery and processed again. GitLab's `X-Gitlab-Event-UUID` and `Idempotency-Key`
/// (kept across GitLab's retries, preferred over the event UUID) likewise, and a pull
/// request's speculative plan is not started twice. A delivery naming no id is processed
/// every time. Ids older than the retention are pruned by a later delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replayed_delivery_changes_nothing() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("null")?;
    let ws = workspace(&stack).await?;
    let cap = capsule(
        &stack,
        ws,
        "nulls",
        &repo.url(),
        "main",
        "infra/null",
        json!({}),
    )
    .await?;
    // Automatic update: every processed push starts a Run, the effect a replay must not repeat.
    let (s, b) = stack
        .call(
            "PATCH",
            &format!("/api/v1/capsules/{}/settings", cap.id),
            json!({ "autoUpdate": true }),
        )
        .await?;
    assert_eq!(s, 200, "{b}");
    let (_, b) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/webhook-secret"),
            json!({}),
        )
        .await?;
    let secret = b["secret"].as_str().unwrap().to_owned();
    let commit = repo.commit(&[("README.md", "push")], "push")?;
    let event = json!({ "ref": "refs/heads/main", "after": commit, "repository": { "clone_url": repo.url() } });
    let github = |id: &str| {
        vec![
            ("x-github-event", "push".to_owned()),
            (
                "x-hub-signature-256",
                sign(&secret, &serde_json::to_vec(&event).unwrap()),
            ),
            ("x-github-delivery", id.to_owned()),
        ]
    };

    let baseline = effects(&stack, &cap).await?;
    let (s, b) = deliver(&stack, ws, &github("gh-1"), &event).await?;
    assert_eq!(s, 202, "{b}");
    assert_eq!(
        b["autoUpdatePlans"].as_array().map(Vec::len),
        Some(1),
        "{b}"
    );
    let once = effects(&stack, &cap).await?;
    let (s, b) = deliver(&stack, ws, &github("gh-1"), &event).await?;
    assert_eq!((s, &b["duplicate"]), (200, &json!(true)), "{b}");
    assert_eq!(
        effects(&stack, &cap).await?,
        once,
        "a replayed push changed something"
    );

    // Four copies of one new delivery at once: exactly one is processed.
    let copies = futures::future::join_all((0..4).map(|_| {
        let headers = github("gh-race");
        let (stack, event) = (&stack, &event);
        async move { deliver(stack, ws, &headers, event).await }
    }))
    .await;
    let mut statuses: Vec<u16> = Vec::new();
    for c in copies {
        statuses.push(c?.0);
    }
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        vec![200, 200, 200, 202],
        "concurrent copies of one delivery"
    );
    let (runs, activity, _) = effects(&stack, &cap).await?;
    let per_push = (once.0 - baseline.0, once.1 - baseline.1);
    assert_eq!(
        (runs, activity),
        (once.0 + per_push.0, once.1 + per_push.1),
        "the race processed it once"
    );

    // The same payload under a new id is a new delivery.
    let (s, b) = deliver(&stack, ws, &github("gh-2"), &event).await?;
    assert_eq!(s, 202, "{b}");
    assert_eq!(effects(&stack, &cap).await?.0, once.0 + 2);

    // GitLab: the token is the credential, the event UUID or the idempotency key the id.
    let gl_event = json!({ "ref": "refs/heads/main", "checkout_sha": commit, "project": { "git_http_url": repo.url() } });
    let gitlab = |extra: &[(&'static str, &str)]| {
        let mut h = vec![
            ("x-gitlab-event", "Push Hook".to_owned()),
            ("x-gitlab-token", secret.clone()),
        ];
        h.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
        h
    };
    let before = effects(&stack, &cap).await?;
    let (s, b) = deliver(
        &stack,
        ws,
        &gitlab(&[("x-gitlab-event-uuid", "gl-1")]),
        &gl_event,
    )
    .await?;
    assert_eq!(s, 202, "{b}");
    let (s, b) = deliver(
        &stack,
        ws,
        &gitlab(&[("x-gitlab-event-uuid", "gl-1")]),
        &gl_event,
    )
    .await?;
    assert_eq!((s, &b["duplicate"]), (200, &json!(true)), "{b}");
    // A GitLab retry keeps its Idempotency-Key, whatever event UUID it carries.
    let (s, b) = deliver(
        &stack,
        ws,
        &gitlab(&[
            ("idempotency-key", "key-1"),
            ("x-gitlab-event-uuid", "gl-2"),
        ]),
        &gl_event,
    )
    .await?;
    assert_eq!(s, 202, "{b}");
    let (s, b) = deliver(
        &stack,
        ws,
        &gitlab(&[
            ("idempotency-key", "key-1"),
            ("x-gitlab-event-uuid", "gl-3"),
        ]),
        &gl_event,
    )
    .await?;
    assert_eq!((s, &b["duplicate"]), (200, &json!(true)), "{b}");
    assert_eq!(
        effects(&stack, &cap).await?.0,
        before.0 + 2,
        "GitLab replays started Runs"
    );

    // A pull request replayed does not start its speculative plan twice.
    let pr = json!({
        "action": "opened",
        "pull_request": { "base": { "ref": "main" }, "head": { "ref": "feature", "sha": commit } },
        "repository": { "clone_url": repo.url() }
    });
    let pr_headers = vec![
        ("x-github-event", "pull_request".to_owned()),
        (
            "x-hub-signature-256",
            sign(&secret, &serde_json::to_vec(&pr)?),
        ),
        ("x-github-delivery", "gh-pr".to_owned()),
    ];
    let (s, b) = deliver(&stack, ws, &pr_headers, &pr).await?;
    assert_eq!(s, 202, "{b}");
    let with_pr = effects(&stack, &cap).await?;
    let (s, b) = deliver(&stack, ws, &pr_headers, &pr).await?;
    assert_eq!((s, &b["duplicate"]), (200, &json!(true)), "{b}");
    assert_eq!(
        effects(&stack, &cap).await?,
        with_pr,
        "a replayed pull request changed something"
    );

    // No id: processed each time.
    let no_id: Vec<_> = github("unused").into_iter().take(2).collect();
    let before = effects(&stack, &cap).await?.0;
    for _ in 0..2 {
        let (s, b) = deliver(&stack, ws, &no_id, &event).await?;
        assert_eq!(s, 202, "{b}");
    }
    assert_eq!(effects(&stack, &cap).await?.0, before + 2);

    // A malformed id is refused and changes nothing.
    let before = effects(&stack, &cap).await?;
    let (s, b) = deliver(&stack, ws, &github(&"x".repeat(300)), &event).await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (400, Some("invalid_delivery_id")),
        "{b}"
    );
    assert_eq!(effects(&stack, &cap).await?, before);

    // Pruning: an id past the retention goes with the next delivery; a recent one stays.
    sqlx::query(
        "INSERT INTO webhook_deliveries (workspace_id, delivery_id, received_at)
         VALUES ($1, 'github:old', now() - interval '8 days'), ($1, 'github:recent', now() - interval '6 days')",
    )
    .bind(ws.as_uuid())
    .execute(&stack.ctx.pool)
    .await?;
    let (s, b) = deliver(&stack, ws, &github("gh-3"), &event).await?;
    assert_eq!(s, 202, "{b}");
    let kept: Vec<String> = sqlx::query_scalar(
        "SELECT delivery_id FROM webhook_deliveries WHERE delivery_id IN ('github:old', 'github:recent')",
    )
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert_eq!(kept, vec!["github:recent".to_owned()]);
    takosumi_tests::probe::record("detection", "webhook replays that changed nothing", 7);
    stack.stop().await
}
