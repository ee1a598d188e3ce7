//! End-to-end: signed audit evidence against the real API, RabbitMQ, Postgres,
//! the S3 server and terraform 1.0.3. Every Run that ends gets one signed statement,
//! chained per Workspace; `takosumi verify` checks them with nothing but the statements
//! and the public keys, and names the link that broke when the database was tampered with.

use std::time::Duration;

use serde_json::{Value, json};
use takosumi_client::evidence::{Bundle, SignedStatement};
use takosumi_client::{Capsule, NewCapsule, PlanRequest, Source};
use takosumi_core::{RunId, RunStatus, WorkspaceId};
use takosumi_evidence::{Signer, Statement, sha256_hex};
use takosumi_tests::{GitRepo, Options, Stack, Steps};

const KEY_ID: &str = "test-evidence-1";

async fn capsule(stack: &Stack, repo: &GitRepo, dir: &str, vars: Value) -> anyhow::Result<Capsule> {
    let ws = stack
        .client
        .create_workspace(&format!(
            "ev-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?;
    Ok(stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "c".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: dir.into(),
                tool: "terraform".into(),
                vars: vars.as_object().cloned().unwrap_or_default(),
            },
        )
        .await?)
}

/// A stack whose only process is the API (its evidence writer among it), and a Capsule of
/// the network example (the repository lives as long as the value) in a Workspace of its
/// own: for Runs that end without a step.
async fn api_only_with_capsule() -> anyhow::Result<(Stack, GitRepo, Capsule)> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let cap = capsule(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    Ok((stack, repo, cap))
}

/// The Run's signed statement, once the writer has signed it (polled: it is written just
/// after the Run ends). Only `evidence_pending` is waited out.
async fn evidence_of(stack: &Stack, run: RunId) -> anyhow::Result<SignedStatement> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = stack
            .call("GET", &format!("/api/v1/runs/{run}/evidence"), Value::Null)
            .await?;
        if status == 200 {
            return Ok(serde_json::from_value(body)?);
        }
        anyhow::ensure!(
            status == 409
                && body["code"] == "evidence_pending"
                && tokio::time::Instant::now() < deadline,
            "no statement for {run}: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn statement(s: &SignedStatement) -> Statement {
    serde_json::from_slice(&s.envelope.payload_bytes().expect("base64")).expect("a statement")
}

/// Runs the CLI with only `env` (no inherited variables): `(exit code, stdout, stderr)`.
async fn cli_with(env: &[(&str, &str)], args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let out = tokio::process::Command::new(takosumi_tests::binary("takosumi")?)
        .env_clear()
        .envs(env.iter().copied())
        .args(args)
        .output()
        .await?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The CLI as the stack's admin.
async fn cli(stack: &Stack, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    cli_with(
        &[
            ("TAKOSUMI_DEPLOY_CONTROL_URL", &stack.api_url),
            ("TAKOSUMI_DEPLOY_CONTROL_TOKEN", &stack.admin_token),
        ],
        args,
    )
    .await
}

/// `takosumi verify --workspace WS` must fail with a message containing every `needle`.
async fn assert_workspace_fails(
    stack: &Stack,
    ws: WorkspaceId,
    needles: &[&str],
) -> anyhow::Result<()> {
    let (code, out, err) = cli(stack, &["verify", "--workspace", &ws.to_string()]).await?;
    assert_eq!(code, 1, "verification must fail: {out}{err}");
    for n in needles {
        assert!(err.contains(n), "the failure must say {n:?}: {err}");
    }
    Ok(())
}

async fn assert_workspace_verifies(
    stack: &Stack,
    ws: WorkspaceId,
    statements: usize,
) -> anyhow::Result<()> {
    let (code, out, err) = cli(stack, &["verify", "--workspace", &ws.to_string()]).await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("verified: {statements} statement(s) of {ws}")),
        "{out}"
    );
    Ok(())
}

/// An agent's plan is held before it plans; canceling it ends it: a statement of a Run
/// that pinned nothing, without running the tool.
async fn canceled_run(stack: &Stack, capsule: &Capsule, reason: &str) -> anyhow::Result<RunId> {
    let run = held_run(stack, capsule).await?;
    cancel(stack, run, reason).await?;
    Ok(run)
}

/// An agent's plan, held before it plans: it has not ended, so it has no statement.
async fn held_run(stack: &Stack, capsule: &Capsule) -> anyhow::Result<RunId> {
    let (agent, _) = stack.token("ev-agent", "agent").await?;
    let (s, held) = stack
        .call_as(
            "POST",
            &format!("/api/v1/capsules/{}/plan", capsule.id),
            &agent,
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{held}");
    assert_eq!(held["status"], "held", "{held}");
    let run: RunId = held["id"].as_str().unwrap_or_default().parse()?;
    let (s, body) = stack
        .call("GET", &format!("/api/v1/runs/{run}/evidence"), Value::Null)
        .await?;
    assert_eq!(
        (s, body["code"].as_str()),
        (409, Some("run_not_ended")),
        "{body}"
    );
    Ok(run)
}

async fn cancel(stack: &Stack, run: RunId, reason: &str) -> anyhow::Result<()> {
    let (s, body) = stack
        .call(
            "POST",
            &format!("/api/v1/runs/{run}/cancel"),
            json!({ "reason": reason }),
        )
        .await?;
    assert_eq!(s, 200, "{body}");
    Ok(())
}

/// The promise: plan → approve → apply leaves two signed statements that verify and link:
/// the plan's names its plan file digest, source, tool, provider lockfile, modules, scan
/// report and sandbox; the apply's names the same plan digest, the StateVersion it wrote,
/// the gate's hold under the rule version in force, the approval (who, role, when, which
/// plan digest) and the plan Run's statement digest. `takosumi verify` accepts both
/// online and, from an exported bundle, offline with no URL and no token; the public keys
/// are published to anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plan_approve_apply_leaves_two_statements_that_verify_and_link() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("null")?;
    let cap = capsule(&stack, &repo, "infra/null", json!({})).await?;
    let ws = cap.workspace_id;
    let (s, body) = stack
        .call(
            "PUT",
            &format!("/api/v1/capsules/{}/rules", cap.id),
            json!({ "approval": { "required": 1, "approverRoles": ["approver"] } }),
        )
        .await?;
    assert_eq!(s, 200, "{body}");
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let held = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let (approver, _) = stack.token("ev-approver", "approver").await?;
    let approver_id = takosumi_store::tokens::find(&stack.ctx.pool, &approver)
        .await?
        .expect("the approver's token")
        .id
        .to_string();
    let (s, body) = stack
        .approve_as(
            held.id,
            &approver,
            json!({ "planDigest": plan.plan_digest }),
        )
        .await?;
    assert_eq!(s, 200, "{body}");
    let apply = stack.wait_released(held.id).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");

    let plan_signed = evidence_of(&stack, plan.id).await?;
    let apply_signed = evidence_of(&stack, apply.id).await?;
    assert_eq!((plan_signed.sequence, apply_signed.sequence), (1, 2));
    assert_eq!(plan_signed.key_id, KEY_ID);
    let p = statement(&plan_signed);
    let a = statement(&apply_signed);
    let plan_digest = plan.plan_digest.clone().expect("a plan digest");
    // The plan's statement.
    assert_eq!(p.statement_type, "https://in-toto.io/Statement/v1");
    assert_eq!(p.subject.len(), 1);
    assert_eq!(p.subject[0].digest["sha256"], plan_digest);
    let pp = &p.predicate;
    assert_eq!(pp.chain.workspace_id, ws.to_string());
    assert_eq!((pp.chain.sequence, pp.chain.previous.as_deref()), (1, None));
    assert_eq!(
        (pp.kind.as_str(), pp.result.status.as_str()),
        ("plan", "planned")
    );
    let source = plan.source_snapshot.clone().expect("a source snapshot");
    let ps = pp.source.clone().expect("the source in the statement");
    assert_eq!(ps.commit, source.commit);
    assert_eq!(ps.tree_digest, source.tree_digest);
    assert_eq!(pp.tool.name, "terraform");
    assert_eq!(pp.tool.version.as_deref(), Some("1.0.3"));
    assert_eq!(pp.provider_lock.state, "present");
    assert_eq!(
        Some(pp.provider_lock.digest.clone()),
        plan.provider_lock_digest
    );
    assert!(pp.provider_lock.digest.is_some());
    assert!(
        pp.module_tree_digest
            .as_ref()
            .is_some_and(|d| d.len() == 64),
        "{pp:?}"
    );
    assert_eq!(pp.dependency_snapshot, plan.dependency_snapshot);
    let scan = pp.dry_run_scan.clone().expect("the dry-run scan");
    assert_eq!(
        (scan.run_id.as_str(), scan.clean),
        (plan.id.to_string().as_str(), Some(true))
    );
    assert_eq!(pp.sandbox.as_deref(), Some("bubblewrap"));
    assert_eq!(pp.actor.kind, "user");
    assert!(!pp.auto_apply_requested);
    assert_eq!(pp.rules_in_force.capsule, Some(1));
    assert!(pp.plan_run.is_none() && pp.approvals.is_empty());
    // The apply's statement: the same plan, the state it wrote, the hold and the approval.
    let ap = &a.predicate;
    assert_eq!(
        (ap.kind.as_str(), ap.result.status.as_str()),
        ("apply", "applied")
    );
    assert_eq!(ap.plan_digest.as_deref(), Some(plan_digest.as_str()));
    assert_eq!(
        ap.chain.previous.as_deref(),
        Some(plan_signed.digest.as_str())
    );
    let link = ap.plan_run.clone().expect("the plan it carried out");
    assert_eq!(link.run_id, plan.id.to_string());
    assert_eq!(link.statement_digest, plan_signed.digest);
    assert_eq!(
        plan_signed.digest,
        sha256_hex(&plan_signed.envelope.payload_bytes().unwrap())
    );
    let sv = ap.state_version.clone().expect("the StateVersion it wrote");
    assert_eq!(
        Some(sv.id.clone()),
        apply.state_version_id.map(|s| s.to_string())
    );
    let sv_digest: String =
        sqlx::query_scalar("SELECT digest FROM state_versions WHERE run_id = $1")
            .bind(apply.id.as_uuid())
            .fetch_one(&stack.ctx.pool)
            .await?;
    assert_eq!(sv.digest, sv_digest);
    assert!(a.subject.iter().any(|s| s.digest["sha256"] == plan_digest));
    assert!(a.subject.iter().any(|s| s.digest["sha256"] == sv_digest));
    assert_eq!(ap.approvals.len(), 1, "{:?}", ap.approvals);
    assert_eq!(ap.approvals[0].approver, approver_id);
    assert_eq!(ap.approvals[0].role, "approver");
    assert_eq!(
        ap.approvals[0].plan_digest.as_deref(),
        Some(plan_digest.as_str())
    );
    let held_decision = ap
        .gate
        .iter()
        .find(|g| g.decision == "held")
        .expect("the gate's hold");
    assert_eq!(held_decision.reason.as_deref(), Some("approval_rule"));
    assert_eq!(held_decision.rule_versions.and_then(|v| v.capsule), Some(1));
    assert!(
        ap.gate.iter().any(|g| g.decision == "released"),
        "{:?}",
        ap.gate
    );
    assert_eq!(
        ap.dry_run_scan.as_ref().map(|s| s.report_digest.clone()),
        Some(scan.report_digest)
    );

    // The library (what a dashboard calls) and the CLI, online.
    let bundle = stack.client.export_evidence(ws).await?;
    let report = bundle.verify(None)?;
    assert_eq!(report.require(&apply.id.to_string())?.position, 2);
    let (code, out, err) = cli(&stack, &["verify", &apply.id.to_string()]).await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("verified: 2 statement(s)"), "{out}");
    assert!(
        out.contains("statement #2 (apply applied)")
            && out.contains(&format!("carries out plan Run {} (statement #1)", plan.id)),
        "{out}"
    );
    assert_workspace_verifies(&stack, ws, 2).await?;

    // Offline: an exported bundle, no URL, no token.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("bundle.json");
    let file_s = file.display().to_string();
    let (code, out, err) = cli(
        &stack,
        &[
            "evidence",
            "export",
            "--workspace",
            &ws.to_string(),
            "--out",
            &file_s,
        ],
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    let exported: Bundle = serde_json::from_str(&std::fs::read_to_string(&file)?)?;
    assert_eq!(exported.statements.len(), 2);
    let (code, out, err) =
        cli_with(&[], &["verify", "--bundle", &file_s, &plan.id.to_string()]).await?;
    assert_eq!(
        code, 0,
        "offline verification needs nothing but the bundle: {out}{err}"
    );
    assert!(out.contains("statement #1 (plan planned)"), "{out}");
    // Pinned keys: only the published key list, fetched without a token.
    let (s, keys) = stack
        .request("GET", "/api/v1/evidence/keys", None, None)
        .await?;
    assert_eq!(s, 200, "{keys}");
    assert_eq!(keys["keys"][0]["keyId"], KEY_ID);
    assert_eq!(keys["keys"][0]["algorithm"], "ed25519");
    assert_eq!(keys["keys"][0]["current"], true);
    let keys_file = dir.path().join("keys.json");
    std::fs::write(&keys_file, keys.to_string())?;
    let keys_s = keys_file.display().to_string();
    let (code, out, err) =
        cli_with(&[], &["verify", "--bundle", &file_s, "--keys", &keys_s]).await?;
    assert_eq!(code, 0, "{out}{err}");
    // Keys of someone else: nothing verifies.
    let (stranger, _) = Signer::generate(KEY_ID)?;
    let stranger_keys = json!({ "keys": [{ "keyId": KEY_ID, "algorithm": "ed25519",
        "publicKey": stranger.public_key().to_base64(), "current": true }] });
    std::fs::write(&keys_file, stranger_keys.to_string())?;
    let (code, out, err) =
        cli_with(&[], &["verify", "--bundle", &file_s, "--keys", &keys_s]).await?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("statement #1") && err.contains("signature"),
        "{err}"
    );
    stack.stop().await
}

const SECRET_TF: &str = r#"
variable "region" { type = string }
variable "db_password" {
  type      = string
  sensitive = true
}
output "vpc" { value = "vpc-${var.region}" }
output "password" {
  value     = var.db_password
  sensitive = true
}
"#;

/// The promise: no secret or sensitive value is in any statement. Canaries as a
/// credential's value, a sensitive variable, a plain variable's value, a sensitive output,
/// an approval note and a cancel reason: the Runs ran with them and the statements name
/// what happened (digests, ids, names) without any of them, in the API's answers, the
/// export and the stored rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_secret_reaches_a_statement() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let r = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let cred = format!("canary-cred-{r}");
    let password = format!("canary-password-{r}");
    let region = format!("canary-region-{r}");
    let note = format!("canary-note-{r}");
    let reason = format!("canary-reason-{r}");
    let canaries = [&cred, &password, &region, &note, &reason];
    let repo = GitRepo::new(&[("infra/secret/main.tf", SECRET_TF)])?;
    let cap = capsule(&stack, &repo, "infra/secret", json!({ "region": region })).await?;
    let ws = cap.workspace_id;
    let (s, binding) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/provider-bindings"),
            json!({ "name": "cloud", "kind": "env", "env": { "CLOUD_TOKEN": cred } }),
        )
        .await?;
    assert_eq!(s, 201, "{binding}");
    let (s, body) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/provider-bindings", cap.id),
            json!({ "bindingId": binding["id"] }),
        )
        .await?;
    assert!(s < 300, "{body}");
    let req = PlanRequest {
        sensitive_vars: json!({ "db_password": password })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        ..PlanRequest::default()
    };
    let plan = stack
        .wait(stack.client.plan_with(cap.id, None, &req).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let (s, held) = stack
        .call(
            "POST",
            &format!("/api/v1/runs/{}/apply", plan.id),
            json!({ "requireApproval": true }),
        )
        .await?;
    assert_eq!(s, 202, "{held}");
    let held = stack
        .wait(held["id"].as_str().unwrap_or_default().parse()?)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let (approver, _) = stack.token("ev-approver", "approver").await?;
    let (s, body) = stack
        .approve_as(held.id, &approver, json!({ "note": note }))
        .await?;
    assert_eq!(s, 200, "{body}");
    let apply = stack.wait_released(held.id).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    // The Run really had them: the sensitive output is what was given.
    assert!(
        apply
            .outputs
            .as_ref()
            .is_some_and(|o| o.to_string().contains("vpc-canary-region"))
    );
    let canceled = canceled_run(&stack, &cap, &reason).await?;

    let mut texts: Vec<(String, String)> = Vec::new();
    for run in [plan.id, apply.id, canceled] {
        let s = evidence_of(&stack, run).await?;
        let decoded = String::from_utf8(s.envelope.payload_bytes().unwrap())?;
        // Not vacuous: the statement is about this Run and says what it pinned.
        assert!(decoded.contains(&run.to_string()), "{decoded}");
        texts.push((format!("statement of {run}"), decoded));
        texts.push((
            format!("evidence response of {run}"),
            serde_json::to_string(&s)?,
        ));
    }
    let apply_text = &texts[2].1;
    assert!(
        apply_text.contains(plan.plan_digest.as_deref().unwrap()),
        "{apply_text}"
    );
    assert!(apply_text.contains("require_approval"), "{apply_text}");
    let canceled_statement = statement(&evidence_of(&stack, canceled).await?);
    assert_eq!(canceled_statement.predicate.result.status, "canceled");
    assert!(canceled_statement.predicate.result.canceled_by.is_some());
    assert!(canceled_statement.subject.is_empty(), "it pinned nothing");
    let bundle = stack.client.export_evidence(ws).await?;
    texts.push(("the bundle".into(), serde_json::to_string(&bundle)?));
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT row_to_json(e)::text FROM evidence_statements e")
            .fetch_all(&stack.ctx.pool)
            .await?;
    texts.extend(rows.into_iter().map(|r| ("a stored row".to_owned(), r)));
    for (place, text) in &texts {
        takosumi_tests::canary::assert_absent(place, text.as_bytes(), &canaries);
    }
    assert_eq!(bundle.verify(None)?.statements.len(), 3);
    stack.stop().await
}

/// Every stored statement of a Workspace, as the rows hold them: `(run, statement,
/// signature, digest)`.
async fn rows(
    stack: &Stack,
    ws: WorkspaceId,
) -> anyhow::Result<Vec<(uuid::Uuid, String, String, String)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, statement, signature, digest FROM evidence_statements WHERE workspace_id = $1 ORDER BY sequence",
    )
    .bind(ws.as_uuid())
    .fetch_all(&stack.ctx.pool)
    .await?)
}

async fn restore(
    stack: &Stack,
    saved: &[(uuid::Uuid, String, String, String)],
) -> anyhow::Result<()> {
    for (run, statement, signature, digest) in saved {
        sqlx::query(
            "UPDATE evidence_statements SET statement = $2, signature = $3, digest = $4 WHERE run_id = $1",
        )
        .bind(run)
        .bind(statement)
        .bind(signature)
        .bind(digest)
        .execute(&stack.ctx.pool)
        .await?;
    }
    Ok(())
}

/// Deletes a Run and every row that refers to it (what someone with the database would
/// have to do to make a Run disappear).
async fn delete_run(stack: &Stack, run: RunId) -> anyhow::Result<()> {
    let refs: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, a.attname::text FROM pg_constraint c
           JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)
          WHERE c.contype = 'f' AND c.confrelid = 'runs'::regclass",
    )
    .fetch_all(&stack.ctx.pool)
    .await?;
    let mut tx = stack.ctx.pool.begin().await?;
    for (table, column) in refs {
        // A Run's links from other Runs and from its Capsule (the drift baseline) are
        // cleared; rows that exist only for the Run go with it.
        let sql = if table == "runs" || table == "capsules" {
            format!("UPDATE {table} SET {column} = NULL WHERE {column} = $1")
        } else {
            format!("DELETE FROM {table} WHERE {column} = $1")
        };
        sqlx::query(&sql)
            .bind(run.as_uuid())
            .execute(tx.db())
            .await?;
    }
    sqlx::query("DELETE FROM runs WHERE id = $1")
        .bind(run.as_uuid())
        .execute(tx.db())
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The promise: whoever can write the database but does not hold the signing key cannot
/// change the record unnoticed, and `takosumi verify` names the link that broke: a
/// statement altered in place (its signature no longer matches), two statements'
/// signatures swapped, another Workspace's statement spliced in, an apply statement that
/// names another plan digest than its plan Run's (even one signed with the server's own
/// key), statements deleted at the end of the chain, and a Run deleted with its record.
/// Each time the chain was intact before the change and verifies again once it is undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tampering_breaks_verification_and_says_where() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::with_example("network")?;
    let cap = capsule(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let ws = cap.workspace_id;
    let (plan, apply) = stack.plan_and_apply(cap.id).await?;
    let third = canceled_run(&stack, &cap, "tail").await?;
    for run in [plan.id, apply.id, third] {
        evidence_of(&stack, run).await?;
    }
    // Another Workspace's chain, to splice from.
    let other = capsule(&stack, &repo, "infra/network", json!({ "region": "us" })).await?;
    let foreign = canceled_run(&stack, &other, "other").await?;
    evidence_of(&stack, foreign).await?;
    assert_workspace_verifies(&stack, ws, 3).await?;
    assert_workspace_verifies(&stack, other.workspace_id, 1).await?;
    let saved = rows(&stack, ws).await?;
    let pool = &stack.ctx.pool;

    // 1. The plan's statement altered in place.
    let n = sqlx::query(
        "UPDATE evidence_statements SET statement = replace(statement, '\"add\":0', '\"add\":7') WHERE run_id = $1",
    )
    .bind(plan.id.as_uuid())
    .execute(pool)
    .await?
    .rows_affected();
    assert_eq!(n, 1);
    assert_ne!(rows(&stack, ws).await?, saved, "the statement changed");
    assert_workspace_fails(
        &stack,
        ws,
        &[
            &format!("statement #1 ({})", plan.id),
            "does not match",
            "altered",
        ],
    )
    .await?;
    // `verify RUN` of another Run of the chain sees it too: the whole chain is checked.
    let (code, _, err) = cli(&stack, &["verify", &apply.id.to_string()]).await?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("statement #1 ({})", plan.id)),
        "{err}"
    );
    restore(&stack, &saved).await?;
    assert_workspace_verifies(&stack, ws, 3).await?;

    // 2. Two statements' signatures swapped.
    sqlx::query(
        "UPDATE evidence_statements e SET signature = o.signature FROM evidence_statements o
          WHERE (e.run_id, o.run_id) IN (($1, $2), ($2, $1))",
    )
    .bind(plan.id.as_uuid())
    .bind(apply.id.as_uuid())
    .execute(pool)
    .await?;
    assert_workspace_fails(
        &stack,
        ws,
        &[
            &format!("statement #1 ({})", plan.id),
            "signature",
            "swapped",
        ],
    )
    .await?;
    restore(&stack, &saved).await?;
    assert_workspace_verifies(&stack, ws, 3).await?;

    // 3. Another Workspace's (validly signed) statement spliced in place of the apply's.
    sqlx::query(
        "UPDATE evidence_statements e SET statement = o.statement, signature = o.signature, digest = o.digest
           FROM evidence_statements o WHERE e.run_id = $1 AND o.run_id = $2",
    )
    .bind(apply.id.as_uuid())
    .bind(foreign.as_uuid())
    .execute(pool)
    .await?;
    assert_workspace_fails(
        &stack,
        ws,
        &[
            &format!("statement #2 ({foreign})"),
            &format!("belongs to Workspace {}, not {ws}", other.workspace_id),
            "spliced",
        ],
    )
    .await?;
    restore(&stack, &saved).await?;
    assert_workspace_verifies(&stack, ws, 3).await?;

    // 4. An apply statement naming another plan digest, signed with the server's own key
    // (what a compromised or buggy writer would produce): the plan link breaks.
    let key = Signer::from_seed_base64(KEY_ID, &stack.env_vars()["TAKOSUMI_EVIDENCE_KEY"])?;
    let apply_signed = evidence_of(&stack, apply.id).await?;
    let mut forged = statement(&apply_signed);
    let other_digest = sha256_hex(b"another plan");
    forged.predicate.plan_digest = Some(other_digest.clone());
    let bytes = forged.to_canonical()?;
    let envelope = key.sign(&bytes);
    sqlx::query(
        "UPDATE evidence_statements SET statement = $2, signature = $3, digest = $4 WHERE run_id = $1",
    )
    .bind(apply.id.as_uuid())
    .bind(String::from_utf8(bytes.clone())?)
    .bind(&envelope.signatures[0].sig)
    .bind(sha256_hex(&bytes))
    .execute(pool)
    .await?;
    assert_workspace_fails(
        &stack,
        ws,
        &[
            &format!("statement #2 (apply {})", apply.id),
            &format!("carries out plan digest sha256:{}", &other_digest[..16]),
            &format!("plan Run {}", plan.id),
            "did not carry out the reviewed plan",
        ],
    )
    .await?;
    restore(&stack, &saved).await?;
    assert_workspace_verifies(&stack, ws, 3).await?;

    // 5. The last statement deleted: the chain no longer reaches its recorded head, and
    // the Run's own evidence is missing.
    sqlx::query("DELETE FROM evidence_statements WHERE run_id = $1")
        .bind(third.as_uuid())
        .execute(pool)
        .await?;
    assert_workspace_fails(
        &stack,
        ws,
        &["ends at statement #2", "head is #3", "deleted"],
    )
    .await?;
    let (code, _, err) = cli(&stack, &["verify", &third.to_string()]).await?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("evidence_missing"), "{err}");
    // The dashboard says so on the Run's page rather than wait for a statement to come.
    let page = run_page(&stack, third).await?;
    assert!(
        page.contains("✗") && page.contains("evidence_missing") && !page.contains("Being signed"),
        "the Run page of a deleted statement: {page}"
    );

    // 6. The plan Run deleted with everything that refers to it: the apply's statement now
    // comes first and follows a statement that is gone, and its plan is missing.
    delete_run(&stack, plan.id).await?;
    assert_workspace_fails(
        &stack,
        ws,
        &[
            &format!("statement #1 ({})", apply.id),
            &format!("follows sha256:{}", &saved[0].3[..16]),
            "deleted",
        ],
    )
    .await?;
    let (code, _, err) = cli(&stack, &["verify", &plan.id.to_string()]).await?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not_found"), "{err}");
    // The other Workspace's chain is untouched by all of it.
    assert_workspace_verifies(&stack, other.workspace_id, 1).await?;
    stack.stop().await
}

/// The dashboard's page of `run`, signed in as the admin.
async fn run_page(stack: &Stack, run: RunId) -> anyhow::Result<String> {
    let cookie = stack.dashboard_session(&stack.admin_token).await?;
    let page = reqwest::Client::new()
        .get(format!("{}/runs/{run}", stack.api_url))
        .header("cookie", cookie)
        .send()
        .await?;
    anyhow::ensure!(page.status() == 200, "the Run page: {}", page.status());
    Ok(page.text().await?)
}

/// Serves the stack's API in this process with `settings` until the token is canceled.
fn serve(
    stack: &Stack,
    settings: takosumi_runtime::Settings,
) -> anyhow::Result<(
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
)> {
    let stop = tokio_util::sync::CancellationToken::new();
    let addr = stack.env_vars()["TAKOSUMI_LISTEN"].clone();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        let run = async {
            let ctx = takosumi_runtime::Ctx::connect(&settings, "api").await?;
            let listener = tokio::net::TcpListener::bind(&addr).await?;
            takosumi_api::serve(ctx, &settings, listener, token).await?;
            anyhow::Ok(())
        };
        if let Err(e) = run.await {
            eprintln!("api stopped: {e:#}");
        }
    });
    Ok((stop, task))
}

async fn wait_for_api(stack: &Stack) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while stack
        .request("GET", "/healthz", None, None)
        .await
        .map(|r| r.0)
        .ok()
        != Some(200)
    {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the API did not come up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// The promise: rotating the signing key keeps old statements verifiable. The API is
/// restarted with a new key and the old public key listed as previous: statements signed
/// before and after verify as one chain, the keys endpoint publishes both (the new one
/// current), and a verifier that trusts only the new key is told which statement was
/// signed with a key it does not have. An API with no signing key refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_rotation_keeps_old_statements_verifiable() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: false,
            ..Steps::ALL
        },
        ..Options::default()
    })
    .await?;
    let mut vars = stack.env_vars().clone();
    let first_settings = takosumi_runtime::Settings::from_map(&vars)?;
    let old = first_settings.evidence_signer()?;
    let (stop, task) = serve(&stack, first_settings)?;
    wait_for_api(&stack).await?;
    let repo = GitRepo::with_example("network")?;
    let cap = capsule(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let ws = cap.workspace_id;
    let first = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(evidence_of(&stack, first.id).await?.key_id, KEY_ID);
    stop.cancel();
    task.await?;

    // Without a key the API does not start, and says what to set.
    let mut keyless = vars.clone();
    keyless.remove("TAKOSUMI_EVIDENCE_KEY");
    let keyless = takosumi_runtime::Settings::from_map(&keyless)?;
    let ctx = takosumi_runtime::Ctx::connect(&keyless, "api").await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let refused = takosumi_api::serve(
        ctx,
        &keyless,
        listener,
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .expect_err("an API without an evidence key must not serve");
    assert!(
        refused.to_string().contains("TAKOSUMI_EVIDENCE_KEY"),
        "{refused}"
    );

    // Rotate: a new key, the old public key still published.
    let (_, new_seed) = Signer::generate("test-evidence-2")?;
    vars.insert("TAKOSUMI_EVIDENCE_KEY".into(), new_seed.to_string());
    vars.insert("TAKOSUMI_EVIDENCE_KEY_ID".into(), "test-evidence-2".into());
    vars.insert(
        "TAKOSUMI_EVIDENCE_PREVIOUS_KEYS".into(),
        old.public_key().to_entry(),
    );
    let (stop, task) = serve(&stack, takosumi_runtime::Settings::from_map(&vars)?)?;
    wait_for_api(&stack).await?;
    let second = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    let signed = evidence_of(&stack, second.id).await?;
    assert_eq!(
        (signed.key_id.as_str(), signed.sequence),
        ("test-evidence-2", 2)
    );
    let keys = stack.client.evidence_keys().await?;
    let ids: Vec<(&str, bool)> = keys
        .keys
        .iter()
        .map(|k| (k.key_id.as_str(), k.current))
        .collect();
    assert_eq!(ids, vec![("test-evidence-2", true), (KEY_ID, false)]);
    let (code, out, err) = cli(&stack, &["verify", "--workspace", &ws.to_string()]).await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("signed by {KEY_ID}, test-evidence-2")),
        "{out}"
    );
    let (code, out, err) = cli(&stack, &["verify", &first.id.to_string()]).await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("signed by {KEY_ID}")), "{out}");

    // A verifier that trusts only the new key cannot check the old statements, and says so.
    let dir = tempfile::tempdir()?;
    let only_new = dir.path().join("keys.json");
    let mut pinned = keys.clone();
    pinned.keys.retain(|k| k.current);
    std::fs::write(&only_new, serde_json::to_string(&pinned)?)?;
    let (code, out, err) = cli(
        &stack,
        &[
            "verify",
            "--workspace",
            &ws.to_string(),
            "--keys",
            &only_new.display().to_string(),
        ],
    )
    .await?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!("statement #1 ({})", first.id)) && err.contains(KEY_ID),
        "{err}"
    );
    stop.cancel();
    task.await?;
    stack.stop().await
}

/// The promise: however many writers run at once (several API processes), every ended Run
/// gets exactly one statement and the Workspace's chain stays one unbroken line. Four
/// writers race the API's own while Runs end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_append_each_statement_once() -> anyhow::Result<()> {
    let (stack, _repo, cap) = api_only_with_capsule().await?;
    let ws = cap.workspace_id;
    let key = Signer::from_seed_base64(KEY_ID, &stack.env_vars()["TAKOSUMI_EVIDENCE_KEY"])?;
    let stop = tokio_util::sync::CancellationToken::new();
    let writers: Vec<_> = (0..4)
        .map(|_| {
            let (pool, key, stop) = (stack.ctx.pool.clone(), key.clone(), stop.clone());
            tokio::spawn(async move {
                let mut written = 0;
                while !stop.is_cancelled() {
                    written += takosumi_store::evidence::write_pending(&pool, &key).await?;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                anyhow::Ok(written)
            })
        })
        .collect();
    let mut ended = Vec::new();
    for _ in 0..12 {
        ended.push(canceled_run(&stack, &cap, "race").await?);
    }
    for run in &ended {
        evidence_of(&stack, *run).await?;
    }
    stop.cancel();
    let mut by_racers = 0;
    for w in writers {
        by_racers += w.await??;
    }
    let per_run: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FROM evidence_statements WHERE workspace_id = $1 GROUP BY run_id",
    )
    .bind(ws.as_uuid())
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert_eq!(per_run.len(), ended.len(), "one statement per ended Run");
    assert!(per_run.iter().all(|n| *n == 1), "{per_run:?}");
    assert!(by_racers <= ended.len());
    assert_workspace_verifies(&stack, ws, ended.len()).await?;
    stack.stop().await
}

/// The promise: a Run that ends after a quiet spell is signed at once, and the Runs that
/// end within a moment of a pass are signed together in the next one (one transaction), not
/// in a pass each; every one gets its statement and the chain verifies. Six Runs end 15 ms
/// apart: passes of their own would sign them at six different times (a statement's
/// `signed_at` is its transaction's start), checked by setting the gathering to nothing;
/// a writer that always gathered first would sign the first of them 200 ms after it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_ending_alone_is_signed_at_once_and_a_burst_together() -> anyhow::Result<()> {
    const GATHER_MS: f64 = 200.0;
    let (stack, _repo, cap) = api_only_with_capsule().await?;
    let ws = cap.workspace_id;
    let mut runs = Vec::new();
    for _ in 0..7 {
        runs.push(held_run(&stack, &cap).await?);
    }
    // A first Run is signed: the writer's next poll is two seconds after that pass, so for
    // the next second nothing but the burst wakes it, and the burst starts after a quiet
    // spell longer than the gathering.
    let primer = runs.remove(0);
    cancel(&stack, primer, "primer").await?;
    evidence_of(&stack, primer).await?;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let began = std::time::Instant::now();
    for (i, run) in runs.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        cancel(&stack, *run, "burst").await?;
    }
    let span_ms = began.elapsed().as_secs_f64() * 1000.0;
    for run in &runs {
        evidence_of(&stack, *run).await?;
    }
    let ids: Vec<uuid::Uuid> = runs.iter().map(|r| r.as_uuid()).collect();
    let (statements, passes): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT signed_at) FROM evidence_statements WHERE run_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_one(&stack.ctx.pool)
    .await?;
    assert_eq!(statements, 6, "one statement per ended Run");
    // The first at once, then at most one pass per gathering the burst spans.
    let most = 1 + (span_ms / GATHER_MS).ceil() as i64;
    assert!(
        passes <= most && passes < 6,
        "six Runs ended 15 ms apart over {span_ms:.0} ms were signed in {passes} passes"
    );
    let first_wait_ms: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM e.signed_at - COALESCE(r.finished_at, r.updated_at))::float8 * 1000
           FROM evidence_statements e JOIN runs r ON r.id = e.run_id WHERE e.run_id = $1",
    )
    .bind(ids[0])
    .fetch_one(&stack.ctx.pool)
    .await?;
    eprintln!(
        "burst: {passes} passes over {span_ms:.0} ms; its first Run signed {first_wait_ms:.0} ms after it ended"
    );
    assert!(
        first_wait_ms < GATHER_MS / 2.0,
        "the burst's first Run, after a quiet spell, was signed {first_wait_ms:.0} ms after it ended"
    );
    assert_workspace_verifies(&stack, ws, runs.len() + 1).await?;
    stack.stop().await
}
