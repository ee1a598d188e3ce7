//! End-to-end: provider lockfile continuity and dependency snapshots, through the real
//! API, RabbitMQ, Postgres, the S3 server and terraform 1.0.3 with the offline
//! null-provider mirror (the tests use `terraform`; OpenTofu cannot be installed here).

use serde_json::{Value, json};
use takosumi_client::{Capsule, Run};
use takosumi_core::{FailureCode, Outcome, RunId, RunMessage, RunStatus};
use takosumi_seal::Purpose;
use takosumi_tests::{GitRepo, Options, Stack, Steps};

/// SHA-256 of the null example's lockfile as terraform 1.0.3 writes it (LOCAL-STACK.md).
const NULL_LOCK_DIGEST: &str = "4b0f595b002219cd61c1d2e566fecb352d32c3ad06d56327f401b4955feea637";
/// SHA-256 of zero bytes.
const EMPTY_DIGEST: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

const NETWORK_TF: &str = "variable \"region\" {\n  type = string\n}\n\noutput \"vpc\" {\n  value = \"vpc-${var.region}\"\n}\n";

async fn register(
    stack: &Stack,
    repo: &GitRepo,
    dir: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    stack.new_capsule(repo, "capsule", dir, vars).await
}

async fn plan(stack: &Stack, capsule: &Capsule) -> anyhow::Result<Run> {
    let run = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(run.status, RunStatus::Planned, "{run:?}");
    Ok(run)
}

async fn apply(stack: &Stack, plan: &Run) -> anyhow::Result<Run> {
    stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await
}

async fn raw_get(stack: &Stack, path: &str) -> anyhow::Result<(u16, String)> {
    let resp = reqwest::Client::new()
        .get(format!("{}{path}", stack.api_url))
        .bearer_auth(&stack.admin_token)
        .send()
        .await?;
    Ok((resp.status().as_u16(), resp.text().await?))
}

/// Every string value (and object key) inside `v`.
fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|i| strings(i, out)),
        Value::Object(map) => {
            for (k, i) in map {
                out.push(k.clone());
                strings(i, out);
            }
        }
        _ => {}
    }
}

fn private_row(row: Option<takosumi_store::runs::Run>) -> takosumi_store::runs::Run {
    row.expect("the run's private row")
}

async fn row(stack: &Stack, id: RunId) -> anyhow::Result<takosumi_store::runs::Run> {
    Ok(private_row(
        takosumi_store::runs::get(&stack.ctx.pool, id).await?,
    ))
}

async fn state_versions(stack: &Stack, capsule: &Capsule) -> i64 {
    takosumi_store::states::versions::count_for_capsule(&stack.ctx.pool, capsule.id)
        .await
        .unwrap()
}

/// The three lockfile states are told apart and kept exactly: a provider-free plan
/// records `providerLockDigest: null` and stores nothing; the null-provider plan records
/// the SHA-256 of the lockfile bytes init wrote; a repository committing an empty
/// `.terraform.lock.hcl` (terraform 1.0.3 keeps the 0-byte file through init for a
/// provider-free configuration, measured) records the digest of the empty string,
/// stored as a 0-byte artifact — distinct from null — and its apply installs those 0
/// bytes and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn null_present_and_empty_lockfiles_are_distinct() -> anyhow::Result<()> {
    let stack = Stack::start().await?;

    let free_repo = GitRepo::with_example("network")?;
    let free = register(
        &stack,
        &free_repo,
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let null_repo = GitRepo::with_example("null")?;
    let null = register(&stack, &null_repo, "infra/null", json!({ "instances": 1 })).await?;
    let empty_repo = GitRepo::new(&[
        ("infra/network/main.tf", NETWORK_TF),
        ("infra/network/.terraform.lock.hcl", ""),
    ])?;
    let empty = register(
        &stack,
        &empty_repo,
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;

    let free_plan = plan(&stack, &free).await?;
    let null_plan = plan(&stack, &null).await?;
    let empty_plan = plan(&stack, &empty).await?;

    // The public record: null, the lockfile's digest, the empty digest.
    assert_eq!(free_plan.provider_lock_digest, Some(None));
    assert_eq!(
        null_plan.provider_lock_digest,
        Some(Some(NULL_LOCK_DIGEST.to_owned()))
    );
    assert_eq!(
        empty_plan.provider_lock_digest,
        Some(Some(EMPTY_DIGEST.to_owned()))
    );
    let (_, raw) = raw_get(&stack, &format!("/api/v1/runs/{}", free_plan.id)).await?;
    let raw: Value = serde_json::from_str(&raw)?;
    assert!(
        raw.as_object().unwrap().contains_key("providerLockDigest")
            && raw["providerLockDigest"].is_null(),
        "provider-free must be an explicit null, not absent: {raw}"
    );
    // Same files, same module tree; only the lockfile differs: so do the snapshots.
    let snapshots: Vec<String> = [&free_plan, &null_plan, &empty_plan]
        .iter()
        .map(|r| r.dependency_snapshot.clone().expect("dependencySnapshot"))
        .collect();
    assert!(snapshots.iter().all(|s| s.len() == 64), "{snapshots:?}");
    assert_ne!(
        snapshots[0], snapshots[2],
        "empty lockfile must differ from null"
    );

    // The private record: nothing stored for null; the bytes, sealed to the Run, else.
    let free_row = row(&stack, free_plan.id).await?;
    assert_eq!(
        free_row.provider_lock_state,
        takosumi_core::ProviderLockState::None
    );
    assert_eq!(free_row.lockfile_object_key, None);
    for (plan, digest, len) in [
        (&null_plan, NULL_LOCK_DIGEST, None),
        (&empty_plan, EMPTY_DIGEST, Some(0)),
    ] {
        let r = row(&stack, plan.id).await?;
        assert_eq!(
            r.provider_lock_state,
            takosumi_core::ProviderLockState::Present
        );
        let key = r.lockfile_object_key.expect("lockfile artifact");
        assert!(key.starts_with(&format!("runs/{}/", plan.id)), "{key}");
        let sealed = stack.ctx.objects.get(&key, 2 << 20).await?;
        let bytes = stack
            .ctx
            .sealer
            .unseal(Purpose::Lockfile, &plan.id.to_string(), &sealed)?;
        assert_eq!(takosumi_store::sha256_hex(&bytes), digest);
        if let Some(len) = len {
            assert_eq!(bytes.len(), len);
        }
    }

    // Each applies with its own lockfile state in place.
    for plan in [&free_plan, &null_plan, &empty_plan] {
        let applied = apply(&stack, plan).await?;
        assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
        assert_eq!(applied.provider_lock_digest, plan.provider_lock_digest);
        assert_eq!(applied.dependency_snapshot, plan.dependency_snapshot);
    }
    stack.stop().await
}

/// Submits a plan and runs the plan handler for it right here (the stack has no plan
/// worker), so a test can prepare the object store first.
async fn plan_by_hand(stack: &Stack, capsule: &Capsule) -> anyhow::Result<(RunId, Outcome)> {
    let run = stack.client.plan(capsule.id, None).await?;
    let outcome = takosumi_plan::handle(&stack.ctx, RunMessage { run_id: run.id }).await?;
    Ok((run.id, outcome))
}

/// A plan succeeds only when its stored lockfile reads back as the bytes init wrote:
/// an artifact already sitting at the plan's key (sealed correctly to this Run, but with
/// other bytes) fails the plan `lockfile_mismatch`, and an oversized one
/// `lockfile_too_large`; the plan records no digest and runs no tool step after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plan_refuses_a_lockfile_artifact_that_does_not_read_back() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: true,
            plan: false,
            gate: true,
            apply: true,
        },
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({ "instances": 1 })).await?;

    for (oversized, code) in [(false, "lockfile_mismatch"), (true, "lockfile_too_large")] {
        let submitted = stack.client.plan(capsule.id, None).await?;
        // Sealed to this Run with other bytes, or simply too large to be a lockfile.
        let planted = if oversized {
            vec![b'#'; (1 << 20) + 8192]
        } else {
            stack.ctx.sealer.seal(
                Purpose::Lockfile,
                &submitted.id.to_string(),
                b"# not what init wrote\n",
            )?
        };
        // The first claim is attempt 1: its lockfile key is known before it runs.
        let key = format!("runs/{}/lockfile.1.sealed", submitted.id);
        stack.ctx.objects.put(&key, planted).await?;
        let plans_before = stack.tool_count("plan");
        let outcome = takosumi_plan::handle(
            &stack.ctx,
            RunMessage {
                run_id: submitted.id,
            },
        )
        .await?;
        let failed = stack.client.get_run(submitted.id).await?;
        assert_eq!(failed.status, RunStatus::Failed, "{failed:?}");
        assert_eq!(failed.error.as_ref().unwrap().code, code);
        assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
        assert_eq!(failed.plan_digest, None);
        assert_eq!(
            stack.tool_count("plan"),
            plans_before,
            "the tool planned after the lockfile was refused"
        );
        let message = &failed.error.unwrap().message;
        assert!(
            !message.contains("runs/") && !message.contains(".sealed"),
            "{message}"
        );
    }

    // Nothing planted: the same configuration plans.
    let (id, outcome) = plan_by_hand(&stack, &capsule).await?;
    assert_eq!(outcome, Outcome::Done);
    let planned = stack.wait(id).await?;
    assert_eq!(
        planned.provider_lock_digest,
        Some(Some(NULL_LOCK_DIGEST.to_owned()))
    );
    stack.stop().await
}

/// An apply installs only the plan Run's own, intact lockfile: a modified artifact
/// (bytes flipped, or resealed to the Run with other bytes) fails `lockfile_mismatch`, an
/// oversized one `lockfile_too_large`, a deleted artifact or a cleared reference
/// `lockfile_missing`, and a reference pointed at another Run's (otherwise identical)
/// lockfile `lockfile_cross_run`. In every case the tool never applies, no StateVersion
/// is written, and the error names no object key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn apply_refuses_each_bad_lockfile_artifact_with_its_code() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({ "instances": 1 })).await?;

    enum Tamper {
        FlipByte,
        Reseal,
        Oversize,
        Delete,
        ClearReference,
        OtherRun,
    }
    let cases = [
        (Tamper::FlipByte, FailureCode::LockfileMismatch),
        (Tamper::Reseal, FailureCode::LockfileMismatch),
        (Tamper::Oversize, FailureCode::LockfileTooLarge),
        (Tamper::Delete, FailureCode::LockfileMissing),
        (Tamper::ClearReference, FailureCode::LockfileMissing),
        (Tamper::OtherRun, FailureCode::LockfileCrossRun),
    ];
    let donor = plan(&stack, &capsule).await?;
    let donor_key = row(&stack, donor.id)
        .await?
        .lockfile_object_key
        .expect("donor lockfile");
    for (tamper, code) in cases {
        let target = plan(&stack, &capsule).await?;
        let key = row(&stack, target.id)
            .await?
            .lockfile_object_key
            .expect("lockfile key");
        let subject = target.id.to_string();
        match tamper {
            Tamper::FlipByte => {
                let mut sealed = stack.ctx.objects.get(&key, 2 << 20).await?;
                let last = sealed.len() - 1;
                sealed[last] ^= 0x01;
                stack.ctx.objects.put(&key, sealed).await?;
            }
            Tamper::Reseal => {
                let sealed = stack.ctx.sealer.seal(
                    Purpose::Lockfile,
                    &subject,
                    b"# a lockfile nobody reviewed\n",
                )?;
                stack.ctx.objects.put(&key, sealed).await?;
            }
            Tamper::Oversize => {
                // Sealed correctly to this Run: only the size gives it away.
                let sealed = stack.ctx.sealer.seal(
                    Purpose::Lockfile,
                    &subject,
                    &vec![b'#'; (1 << 20) + 1],
                )?;
                stack.ctx.objects.put(&key, sealed).await?;
            }
            Tamper::Delete => stack.ctx.objects.delete(&key).await?,
            Tamper::ClearReference => {
                sqlx::query("UPDATE runs SET lockfile_object_key = NULL WHERE id = $1")
                    .bind(target.id.as_uuid())
                    .execute(&stack.ctx.pool)
                    .await?;
            }
            Tamper::OtherRun => {
                sqlx::query("UPDATE runs SET lockfile_object_key = $2 WHERE id = $1")
                    .bind(target.id.as_uuid())
                    .bind(&donor_key)
                    .execute(&stack.ctx.pool)
                    .await?;
            }
        }
        let refused = apply(&stack, &target).await?;
        assert_eq!(refused.status, RunStatus::Failed, "{refused:?}");
        let error = refused.error.expect("error");
        assert_eq!(error.code, code.as_str(), "{}", error.message);
        assert!(error.message.contains("plan again"), "{}", error.message);
        assert!(
            !error.message.contains("runs/") && !error.message.contains(".sealed"),
            "{}",
            error.message
        );
        assert_eq!(stack.tool_count("apply"), 0);
        assert_eq!(state_versions(&stack, &capsule).await, 0);
    }
    assert_eq!(
        stack.client.get_capsule(capsule.id).await?.state_generation,
        0
    );

    // The untouched donor still applies: the checks refuse only what is wrong.
    let applied = apply(&stack, &donor).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    assert_eq!(stack.tool_count("apply"), 1);
    stack.stop().await
}

const MODULE_TF: &str = "variable \"name\" {\n  type = string\n}\n\noutput \"greeting\" {\n  value = \"hello-${var.name}\"\n}\n";
const LOCAL_MODULE_TF: &str = "output \"v\" {\n  value = \"local\"\n}\n";

fn root_with_modules(module_repo: &GitRepo) -> String {
    format!(
        "module \"local\" {{\n  source = \"./modules/local\"\n}}\n\n\
         module \"remote\" {{\n  source = \"git::{}?ref=main\"\n  name   = \"x\"\n}}\n\n\
         output \"o\" {{\n  value = \"${{module.local.v}}-${{module.remote.greeting}}\"\n}}\n",
        module_repo.url()
    )
}

/// Modules from a local path and from a `git::file://` repository are downloaded once per
/// plan (`get`, then `init -get=false`, which downloads nothing) and pinned by the
/// dependency snapshot: two plans of the same sources record the same snapshot; when the
/// module repository's branch moves between plan and apply, the apply fails
/// `dependency_changed` and the tool never applies; a new plan records a new snapshot and
/// applies the new module.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn modules_are_pinned_by_the_dependency_snapshot() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let module = GitRepo::new(&[("main.tf", MODULE_TF)])?;
    let repo = GitRepo::new(&[
        ("infra/app/main.tf", &root_with_modules(&module)),
        ("infra/app/modules/local/main.tf", LOCAL_MODULE_TF),
    ])?;
    let capsule = register(&stack, &repo, "infra/app", json!({})).await?;

    let first = plan(&stack, &capsule).await?;
    let snapshot = first.dependency_snapshot.clone().expect("snapshot");
    assert_eq!(snapshot.len(), 64);
    assert_eq!(first.provider_lock_digest, Some(None));
    assert_eq!(stack.tool_count("get"), 1, "{:?}", stack.tool_invocations());
    let logs = stack.client.log_entries(first.id).await?;
    let get_log: String = logs
        .iter()
        .filter(|l| l.step == "get")
        .map(|l| l.text.as_str())
        .collect();
    let init_log: String = logs
        .iter()
        .filter(|l| l.step == "init")
        .map(|l| l.text.as_str())
        .collect();
    assert!(get_log.contains("Downloading"), "{get_log}");
    assert!(
        !init_log.contains("Downloading") && !init_log.contains("Initializing modules"),
        "init downloaded modules again: {init_log}"
    );

    // The same sources plan to the same snapshot (a fresh download digests alike).
    let again = plan(&stack, &capsule).await?;
    assert_eq!(
        again.dependency_snapshot.as_deref(),
        Some(snapshot.as_str())
    );
    // A configuration without modules has another snapshot.
    let plain_repo = GitRepo::with_example("network")?;
    let plain = register(
        &stack,
        &plain_repo,
        "infra/network",
        json!({ "region": "eu" }),
    )
    .await?;
    let plain_plan = plan(&stack, &plain).await?;
    assert_ne!(
        plain_plan.dependency_snapshot.as_deref(),
        Some(snapshot.as_str())
    );

    // The module's branch moves after the plan: the apply refuses before applying.
    module.commit(
        &[("main.tf", &MODULE_TF.replace("hello", "changed"))],
        "module v2",
    )?;
    let refused = apply(&stack, &first).await?;
    assert_eq!(refused.status, RunStatus::Failed, "{refused:?}");
    let error = refused.error.expect("error");
    assert_eq!(error.code, "dependency_changed", "{}", error.message);
    assert_eq!(stack.tool_count("apply"), 0);
    assert_eq!(state_versions(&stack, &capsule).await, 0);
    let events = stack.client.events(refused.id).await?;
    assert!(
        !events
            .iter()
            .any(|e| e.kind == "tool_started" && e.data["command"] == "apply"),
        "{events:?}"
    );

    // A new plan pins the new module and applies it.
    let second = plan(&stack, &capsule).await?;
    assert_ne!(
        second.dependency_snapshot.as_deref(),
        Some(snapshot.as_str())
    );
    let applied = apply(&stack, &second).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    assert_eq!(applied.outputs, Some(json!({ "o": "local-changed-x" })));
    assert_eq!(applied.dependency_snapshot, second.dependency_snapshot);
    stack.stop().await
}

/// A `.terraform` committed to the repository (here: a module tree with a different
/// module in it, and a modules.json pointing at it) is never read: the output comes from
/// the module `get` downloaded, and the source and dependency snapshots equal those of
/// the same repository without the committed directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_dot_terraform_is_never_read() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let module = GitRepo::new(&[("main.tf", MODULE_TF)])?;
    let root = root_with_modules(&module);
    let files = [
        ("infra/app/main.tf", root.as_str()),
        ("infra/app/modules/local/main.tf", LOCAL_MODULE_TF),
    ];
    let clean = GitRepo::new(&files)?;
    let modules_json = format!(
        "{{\"Modules\":[{{\"Key\":\"\",\"Source\":\"\",\"Dir\":\".\"}},\
         {{\"Key\":\"local\",\"Source\":\"./modules/local\",\"Dir\":\"modules/local\"}},\
         {{\"Key\":\"remote\",\"Source\":\"git::{}?ref=main\",\"Dir\":\".terraform/modules/remote\"}}]}}",
        module.url()
    );
    let evil_tf =
        "variable \"name\" {\n  type = string\n}\n\noutput \"greeting\" {\n  value = \"EVIL\"\n}\n";
    let mut dirty_files = files.to_vec();
    dirty_files.push(("infra/app/.terraform/modules/modules.json", &modules_json));
    dirty_files.push(("infra/app/.terraform/modules/remote/main.tf", evil_tf));
    let dirty = GitRepo::new(&dirty_files)?;

    let clean_cap = register(&stack, &clean, "infra/app", json!({})).await?;
    let dirty_cap = register(&stack, &dirty, "infra/app", json!({})).await?;
    let clean_plan = plan(&stack, &clean_cap).await?;
    let dirty_plan = plan(&stack, &dirty_cap).await?;
    assert_eq!(
        dirty_plan.source_snapshot.as_ref().unwrap().tree_digest,
        clean_plan.source_snapshot.as_ref().unwrap().tree_digest,
        "the committed .terraform counted in the source snapshot"
    );
    assert_eq!(
        dirty_plan.dependency_snapshot, clean_plan.dependency_snapshot,
        "the committed module tree counted in the dependency snapshot"
    );
    let applied = apply(&stack, &dirty_plan).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    assert_eq!(applied.outputs, Some(json!({ "o": "local-hello-x" })));
    stack.stop().await
}

/// Neither the lockfile's bytes (its `h1:` hash line, its body) nor any artifact key
/// (`runs/…`, `….sealed`) appears in any API response about the plan or its apply: the
/// Runs, their events, their logs, the Capsule, and the Workspace listings that exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_lockfile_bytes_or_keys_in_any_api_response() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let capsule = register(&stack, &repo, "infra/null", json!({ "instances": 1 })).await?;
    let planned = plan(&stack, &capsule).await?;
    let applied = apply(&stack, &planned).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");

    let key = row(&stack, planned.id)
        .await?
        .lockfile_object_key
        .expect("lockfile key");
    let sealed = stack.ctx.objects.get(&key, 2 << 20).await?;
    let lockfile = String::from_utf8(stack.ctx.sealer.unseal(
        Purpose::Lockfile,
        &planned.id.to_string(),
        &sealed,
    )?)?;
    let hashes: Vec<&str> = lockfile
        .split('"')
        .filter(|s| s.starts_with("h1:") || s.starts_with("zh:"))
        .collect();
    assert!(!hashes.is_empty(), "the lockfile has no hashes: {lockfile}");

    let mut paths = vec![format!("/api/v1/capsules/{}", capsule.id)];
    for id in [planned.id, applied.id] {
        paths.push(format!("/api/v1/runs/{id}"));
        paths.push(format!("/api/v1/runs/{id}/events"));
        paths.push(format!("/api/v1/runs/{id}/logs"));
    }
    let optional = [
        format!("/api/v1/workspaces/{}/runs", capsule.workspace_id),
        format!("/api/v1/workspaces/{}/activity", capsule.workspace_id),
    ];
    let mut bodies = Vec::new();
    for path in &paths {
        let (status, body) = raw_get(&stack, path).await?;
        assert_eq!(status, 200, "{path}: {body}");
        bodies.push((path.clone(), body));
    }
    for path in &optional {
        let (status, body) = raw_get(&stack, path).await?;
        if status == 200 {
            bodies.push((path.clone(), body));
        }
    }
    let logs = stack.client.logs(planned.id).await?;
    assert!(logs.contains("lock file"), "expected init's log: {logs}");
    let key_prefixes = [
        format!("runs/{}/", planned.id),
        format!("runs/{}/", applied.id),
    ];
    for (path, body) in &bodies {
        // Raw text, and every string in it as decoded JSON (escapes cannot hide a match).
        let mut texts = vec![body.clone()];
        strings(&serde_json::from_str(body)?, &mut texts);
        for text in &texts {
            for hash in &hashes {
                assert!(!text.contains(hash), "{path} leaks a lockfile hash: {text}");
            }
            assert!(
                !text.contains(lockfile.trim()),
                "{path} leaks the lockfile body"
            );
            assert!(
                !text.contains(&key) && !text.contains(".sealed"),
                "{path} leaks an object key: {text}"
            );
            for prefix in &key_prefixes {
                assert!(!text.contains(prefix), "{path} leaks an object key: {text}");
            }
            assert!(
                !text.contains("lockfile_object_key") && !text.contains("lockfileObjectKey"),
                "{path}: {text}"
            );
        }
    }
    // The digest is public; the bytes are not.
    let (_, run_body) = raw_get(&stack, &format!("/api/v1/runs/{}", planned.id)).await?;
    assert!(run_body.contains(NULL_LOCK_DIGEST));
    stack.stop().await
}
