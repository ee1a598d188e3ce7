//! End-to-end (real API, Postgres, RabbitMQ, the S3 server and terraform): the seed's
//! sentences the product once did not keep, each tested as written.

use serde_json::{Value, json};
use takosumi_client::{NewCapsule, PlanRequest, Source};
use takosumi_core::RunStatus;
use takosumi_tests::{Endpoints, GitRepo, Options, Stack};

/// `db_password` is declared sensitive; it is given as a plain Capsule variable and as a
/// plain Run variable, the two ways the first cut served it in clear.
const NAMES_TF: &str = r#"
variable "db_password" {
  type      = string
  sensitive = true
}
variable "region" { type = string }
resource "null_resource" "db" {
  triggers = { region = var.region, password_len = length(var.db_password) }
}
output "region" { value = var.region }
"#;

fn obj(v: Value) -> serde_json::Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

/// "The names of the injected environment variables — values are not stored": a Run shows
/// its variables by name only, wherever it is served (the Run, the Workspace's run list,
/// events), and its row keeps them sealed. A Capsule's own variables are shown by name,
/// with a value only for a variable the configuration does not mark sensitive, only once a
/// plan has read the configuration, and only to a role that may edit the Capsule.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_carry_variable_names_never_values() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let capsule_canary = format!("capsule-pw-{}", uuid::Uuid::new_v4().simple());
    let run_canary = format!("run-pw-{}", uuid::Uuid::new_v4().simple());
    let repo = GitRepo::new(&[("infra/main.tf", NAMES_TF)])?;
    let ws = stack.client.create_workspace("names").await?;
    let cap = stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "db".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra".into(),
                tool: "terraform".into(),
                vars: obj(json!({ "region": "eu", "db_password": capsule_canary })),
            },
        )
        .await?;
    // Before any plan nothing is known about which variables are sensitive: no value shown.
    assert!(cap.vars.is_empty(), "{cap:?}");
    assert_eq!(cap.withheld_vars, ["db_password", "region"]);
    assert_eq!(cap.var_names, ["db_password", "region"]);

    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let overridden = PlanRequest {
        vars: obj(json!({ "db_password": run_canary })),
        ..PlanRequest::default()
    };
    let with_run_var = stack
        .wait(stack.client.plan_with(cap.id, None, &overridden).await?.id)
        .await?;
    assert_eq!(with_run_var.status, RunStatus::Planned, "{with_run_var:?}");
    assert_eq!(
        with_run_var.var_names,
        Some(vec!["db_password".to_owned(), "region".to_owned()])
    );
    let apply = stack
        .wait(stack.client.apply(with_run_var.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(
        apply.var_names, with_run_var.var_names,
        "an apply shows its plan's names"
    );

    let mut served = Vec::new();
    for path in [
        format!("/api/v1/runs/{}", plan.id),
        format!("/api/v1/runs/{}", with_run_var.id),
        format!("/api/v1/runs/{}", apply.id),
        format!("/api/v1/runs/{}/events", with_run_var.id),
        format!("/api/v1/runs/{}/events", apply.id),
        format!("/api/v1/workspaces/{}/runs", ws.id),
        format!("/api/v1/workspaces/{}/activity", ws.id),
        format!("/api/v1/capsules/{}", cap.id),
        format!("/api/v1/workspaces/{}/capsules", ws.id),
    ] {
        let (status, body) = stack.call("GET", &path, Value::Null).await?;
        assert_eq!(status, 200, "{path}: {body}");
        served.push((path, body.to_string()));
    }
    for (path, body) in &served {
        for canary in [&capsule_canary, &run_canary] {
            assert!(
                !body.contains(canary.as_str()),
                "{path} serves {canary}: {body}"
            );
        }
    }
    // The row keeps the Run's variables sealed: no plain copy, no canary in the bytes.
    let (plain, sealed): (Option<Value>, Option<Vec<u8>>) =
        sqlx::query_as("SELECT vars, vars_sealed FROM runs WHERE id = $1")
            .bind(with_run_var.id.as_uuid())
            .fetch_one(&stack.ctx.pool)
            .await?;
    assert!(plain.is_none());
    let sealed = sealed.expect("sealed variables");
    assert!(
        !sealed
            .windows(run_canary.len())
            .any(|w| w == run_canary.as_bytes())
    );

    // The configuration marks db_password sensitive: an editor sees region's value only.
    let shown = stack.client.get_capsule(cap.id).await?;
    assert_eq!(shown.vars, obj(json!({ "region": "eu" })));
    assert_eq!(shown.withheld_vars, ["db_password"]);
    // A viewer sees names only.
    let (viewer, _) = stack.token("reader", "viewer").await?;
    let (status, as_viewer) = stack
        .request(
            "GET",
            &format!("/api/v1/capsules/{}", cap.id),
            Some(&viewer),
            None,
        )
        .await?;
    assert_eq!(status, 200, "{as_viewer}");
    assert_eq!(as_viewer["vars"], json!({}));
    assert_eq!(as_viewer["withheldVars"], json!(["db_password", "region"]));
    stack.stop().await
}

/// Repository URLs: credentials inside a URL are refused (and never quoted back), so are
/// plain http and git:// URLs; local repositories only behind the server's explicit
/// `TAKOSUMI_ALLOW_FILE_REPOS`. A refusal creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repository_urls_with_credentials_or_local_paths_are_refused() -> anyhow::Result<()> {
    let stack = Stack::start_on(
        Options::default(),
        &Endpoints {
            settings: vec![("TAKOSUMI_ALLOW_FILE_REPOS".into(), "false".into())],
            ..Endpoints::default()
        },
    )
    .await?;
    let ws = stack.client.create_workspace("urls").await?;
    let token = format!("ghp_{}", uuid::Uuid::new_v4().simple());
    let local = GitRepo::with_example("network")?;
    for (repo, says) in [
        (
            format!("https://deploy:{token}@github.com/acme/infra.git"),
            "credentials",
        ),
        (
            format!("https://{token}@github.com/acme/infra.git"),
            "credentials",
        ),
        ("http://github.com/acme/infra.git".to_owned(), "http://"),
        ("git://github.com/acme/infra.git".to_owned(), "git://"),
        (local.url(), "TAKOSUMI_ALLOW_FILE_REPOS"),
        (
            local.url().trim_start_matches("file://").to_owned(),
            "TAKOSUMI_ALLOW_FILE_REPOS",
        ),
    ] {
        let (status, body) = stack
            .call(
                "POST",
                &format!("/api/v1/workspaces/{}/capsules", ws.id),
                json!({ "name": "c", "source": { "repo": repo, "branch": "main" }, "dir": "infra/network", "tool": "terraform" }),
            )
            .await?;
        assert_eq!(
            (status, body["code"].as_str()),
            (422, Some("invalid_source")),
            "{repo}: {body}"
        );
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(says), "{repo}: {message}");
        assert!(
            !body.to_string().contains(&token),
            "the token was quoted back: {body}"
        );
    }
    let (status, body) = stack
        .call(
            "GET",
            &format!("/api/v1/workspaces/{}/capsules", ws.id),
            Value::Null,
        )
        .await?;
    assert_eq!(status, 200);
    assert_eq!(
        body["capsules"],
        json!([]),
        "a refusal created a Capsule: {body}"
    );
    // The accepted forms register (nothing is fetched at registration).
    for (i, repo) in [
        "https://github.com/acme/infra.git",
        "ssh://git@github.com/acme/infra.git",
        "git@github.com:acme/infra.git",
    ]
    .iter()
    .enumerate()
    {
        let (status, body) = stack
            .call(
                "POST",
                &format!("/api/v1/workspaces/{}/capsules", ws.id),
                json!({ "name": format!("ok{i}"), "source": { "repo": repo, "branch": "main" }, "dir": "infra", "tool": "terraform" }),
            )
            .await?;
        assert_eq!(status, 201, "{repo}: {body}");
        assert_eq!(body["source"]["repo"], json!(repo));
    }
    stack.stop().await
}

const NULL_TF: &str = r#"
resource "null_resource" "n" {}
output "tool" { value = "ran" }
"#;

/// "The tofu binary must be on the PATH of the process executing runs … Nothing else is
/// configured." A `tofu` Capsule plans and applies with a binary named `tofu` found on the
/// handlers' PATH and no setting naming it; the Run records that binary's path and version.
/// Honest note: the `tofu` here is a symbolic link to the terraform 1.0.3 the tests pin (no
/// OpenTofu release is installable offline); what is tested is the lookup, not OpenTofu.
/// With no `tofu` on PATH and none named, the Run fails `invalid_configuration` saying
/// what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tofu_capsule_runs_with_the_tofu_found_on_path() -> anyhow::Result<()> {
    let real = std::env::var("TAKOSUMI_TERRAFORM_BIN")?;
    let bin = takosumi_tests::fixture_dir()?;
    let tofu = bin.path().join("tofu");
    std::os::unix::fs::symlink(&real, &tofu)?;
    let path = format!("{}:/usr/local/bin:/usr/bin:/bin", bin.path().display());
    for (path, found) in [(path.as_str(), true), ("/usr/bin:/bin", false)] {
        let stack = Stack::start_on(
            Options::default(),
            &Endpoints {
                settings: vec![("PATH".into(), path.into())],
                ..Endpoints::default()
            },
        )
        .await?;
        let repo = GitRepo::new(&[("infra/main.tf", NULL_TF)])?;
        let ws = stack.client.create_workspace("tofu").await?;
        let cap = stack
            .client
            .create_capsule(
                ws.id,
                &NewCapsule {
                    name: "t".into(),
                    source: Source {
                        repo: repo.url(),
                        branch: "main".into(),
                    },
                    dir: "infra".into(),
                    tool: "tofu".into(),
                    vars: Default::default(),
                },
            )
            .await?;
        let plan = stack
            .wait(stack.client.plan(cap.id, None).await?.id)
            .await?;
        if !found {
            assert_eq!(plan.status, RunStatus::Failed, "{plan:?}");
            let error = plan.error.clone().unwrap();
            assert_eq!(error.code, "invalid_configuration");
            assert!(
                error.message.contains("put `tofu` on the PATH")
                    && error.message.contains("TAKOSUMI_TOFU_BIN"),
                "{}",
                error.message
            );
            stack.stop().await?;
            continue;
        }
        assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
        let version = plan.tool_version.clone().unwrap();
        assert_eq!(
            version["path"],
            json!(tofu.display().to_string()),
            "{version}"
        );
        assert_eq!(version["terraform_version"], json!("1.0.3"), "{version}");
        let apply = stack
            .wait(stack.client.apply(plan.id, None).await?.id)
            .await?;
        assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
        assert_eq!(apply.outputs.clone().unwrap()["tool"], json!("ran"));
        assert_eq!(apply.tool_version.clone().unwrap()["path"], version["path"]);
        stack.stop().await?;
    }
    Ok(())
}

/// "A lifecycle failure after apply can leave the applied state current": the tool applies,
/// then recording its outputs fails (they are larger than the 1 MiB a Run record keeps).
/// The state it wrote is sealed and recorded first — a StateVersion, the Capsule's
/// generation moved to it — and only then is the Run failed (`after_apply_failed`), with
/// the StateVersion on it and a message that says the applied state is current and not to
/// repeat the apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failure_after_the_apply_records_the_applied_state_first() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    // 1,100,000 zeros: more than a Run record keeps, applied like any other output.
    let big = format!("{NULL_TF}output \"big\" {{ value = format(\"%01100000d\", 0) }}\n");
    let repo = GitRepo::new(&[("infra/main.tf", big.as_str())])?;
    let ws = stack.client.create_workspace("after-apply").await?;
    let cap = stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "n".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra".into(),
                tool: "terraform".into(),
                vars: Default::default(),
            },
        )
        .await?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Failed, "{apply:?}");
    let error = apply.error.clone().unwrap();
    assert_eq!(error.code, "after_apply_failed");
    assert!(
        error.message.contains("is recorded as StateVersion")
            && error.message.contains("do not repeat the apply")
            && error
                .message
                .contains("more than the 1048576 a Run record keeps"),
        "{}",
        error.message
    );
    assert!(
        apply.outputs.is_none(),
        "no outputs recorded: {:?}",
        apply.outputs.as_ref().map(|o| o.to_string().len())
    );
    let sv = apply
        .state_version_id
        .expect("the applied state is on the Run");
    let shown = stack.client.get_capsule(cap.id).await?;
    assert_eq!(shown.current_state_version_id, Some(sv));
    assert_eq!(shown.state_generation, 1);
    assert_eq!(shown.status, "ok", "the Capsule is free again: {shown:?}");
    let kinds: Vec<String> = stack
        .client
        .events(apply.id)
        .await?
        .into_iter()
        .map(|e| e.kind.to_string())
        .collect();
    let written = kinds.iter().position(|k| k == "state_version_written");
    let failed = kinds.iter().position(|k| k == "failed");
    assert!(
        written.is_some() && written < failed,
        "the state is recorded before the Run fails: {kinds:?}"
    );
    // The next plan starts from that state: nothing left to add.
    let next = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(next.changes.unwrap().add, 0, "{next:?}");
    stack.stop().await
}

/// A Capsule's own values may hold a NUL (HCL writes it `"\u0000"`), which `show -json`
/// and the outputs carry as the escape, and which Postgres cannot keep in `jsonb`. The
/// Run still plans and applies: what the record keeps (the reviewer's diff, the outputs)
/// shows each NUL as U+FFFD, as a log does; the sealed plan keeps the tool's exact bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nul_in_the_capsules_values_is_recorded_as_u_fffd() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let tf = r#"
resource "null_resource" "n" {
  triggers = { odd = "x\u0000y" }
}
output "odd" { value = "a\u0000b" }
"#;
    let repo = GitRepo::new(&[("infra/main.tf", tf)])?;
    let cap = null_capsule(&stack, &repo).await?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let (status, diff) = stack
        .call(
            "GET",
            &format!("/api/v1/runs/{}/plan", plan.id),
            Value::Null,
        )
        .await?;
    assert_eq!(status, 200, "{diff}");
    let shown = diff.to_string();
    assert!(
        shown.contains("x\u{FFFD}y"),
        "the diff shows the NUL as U+FFFD: {shown}"
    );
    assert!(!shown.contains("\\u0000"), "{shown}");
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(apply.outputs.clone().unwrap()["odd"], json!("a\u{FFFD}b"));
    stack.stop().await
}

async fn null_capsule(stack: &Stack, repo: &GitRepo) -> anyhow::Result<takosumi_client::Capsule> {
    let ws = stack
        .client
        .create_workspace(&format!(
            "ws-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?;
    Ok(stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "n".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra".into(),
                tool: "terraform".into(),
                vars: Default::default(),
            },
        )
        .await?)
}

/// The apply-time source pin fires: the reviewed commit was force-pushed away before the
/// apply, so the plan's commit cannot be checked out any more; the apply fails
/// `source_changed` before init or apply run, and nothing is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_apply_whose_commit_was_rewritten_away_fails_source_changed() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::new(&[("infra/main.tf", NULL_TF)])?;
    let cap = null_capsule(&stack, &repo).await?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let reviewed = plan.source_snapshot.clone().unwrap().commit;
    let rewritten = repo.rewrite_last_commit()?;
    assert_ne!(reviewed, rewritten);
    let (inits, applies) = (stack.tool_count("init"), stack.tool_count("apply"));
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Failed, "{apply:?}");
    let error = apply.error.clone().unwrap();
    assert_eq!(error.code, "source_changed", "{error:?}");
    assert!(error.message.contains("plan again"), "{}", error.message);
    assert_eq!(
        (stack.tool_count("init"), stack.tool_count("apply")),
        (inits, applies),
        "nothing ran past the pin"
    );
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 0);
    stack.stop().await
}

/// "Digest-only records from older runners remain undefined (unknown); Takosumi does not
/// later retrieve or regenerate a lockfile": such a record (a digest, state `unknown`, no
/// stored artifact) can be stored, reads as unknown (no `providerLockDigest` on the Run),
/// and an apply of it is refused before init, writing no lockfile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_digest_only_legacy_lockfile_record_reads_as_unknown() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let cap = stack
        .client
        .create_capsule(
            stack.client.create_workspace("legacy").await?.id,
            &NewCapsule {
                name: "legacy".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra/null".into(),
                tool: "terraform".into(),
                vars: Default::default(),
            },
        )
        .await?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert!(
        plan.provider_lock_digest.clone().flatten().is_some(),
        "{plan:?}"
    );
    // What an older runner recorded: the digest alone.
    sqlx::query(
        "UPDATE runs SET provider_lock_state = 'unknown', lockfile_object_key = NULL WHERE id = $1",
    )
    .bind(plan.id.as_uuid())
    .execute(&stack.ctx.pool)
    .await?;
    let (status, view) = stack
        .call("GET", &format!("/api/v1/runs/{}", plan.id), Value::Null)
        .await?;
    assert_eq!(status, 200);
    assert!(
        view.get("providerLockDigest").is_none(),
        "unknown, not null: {view}"
    );
    let objects_before = stack
        .ctx
        .objects
        .list(&format!("runs/{}/", plan.id))
        .await?;
    let inits = stack.tool_count("init");
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Failed, "{apply:?}");
    let error = apply.error.clone().unwrap();
    assert_eq!(error.code, "lockfile_mismatch");
    assert!(error.message.contains("older runner"), "{}", error.message);
    assert_eq!(
        stack.tool_count("init"),
        inits,
        "init ran: nothing may regenerate it"
    );
    let (state, digest): (String, Option<String>) =
        sqlx::query_as("SELECT provider_lock_state, provider_lock_digest FROM runs WHERE id = $1")
            .bind(plan.id.as_uuid())
            .fetch_one(&stack.ctx.pool)
            .await?;
    assert_eq!(state, "unknown");
    assert!(digest.is_some(), "the digest stays as recorded");
    assert_eq!(
        stack
            .ctx
            .objects
            .list(&format!("runs/{}/", plan.id))
            .await?,
        objects_before,
        "no lockfile was regenerated"
    );
    stack.stop().await
}

/// "The 19 MiB limit is the relay's": a plan the control node executes has no such cap.
/// A real plan of about 24 MiB is sealed from its file in chunks (format 2) and uploaded
/// in parts, and its apply streams it back, checks its digest and applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_control_node_plans_and_applies_a_plan_over_19_mib() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let filler = takosumi_tests::plan_filler(26);
    let repo = GitRepo::new(&[("infra/main.tf", NULL_TF), ("infra/filler.tf", &filler)])?;
    drop(filler);
    let cap = null_capsule(&stack, &repo).await?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let key: String = sqlx::query_scalar("SELECT plan_object_key FROM runs WHERE id = $1")
        .bind(plan.id.as_uuid())
        .fetch_one(&stack.ctx.pool)
        .await?;
    let sealed = stack.ctx.objects.get(&key, 64 * 1024 * 1024).await?;
    assert_eq!(&sealed[..4], b"TKS2", "sealed in the chunked format");
    assert!(
        sealed.len() as u64 > 19 * 1024 * 1024 + 4096,
        "a plan over the relay limit: {} sealed bytes",
        sealed.len()
    );
    let plain =
        stack
            .ctx
            .sealer
            .unseal(takosumi_seal::Purpose::Plan, &plan.id.to_string(), &sealed)?;
    drop(sealed);
    assert_eq!(
        Some(takosumi_store::sha256_hex(&plain)),
        plan.plan_digest,
        "the digest is of the plan file itself"
    );
    eprintln!("plan file: {} bytes", plain.len());
    drop(plain);
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 1);
    stack.stop().await
}
