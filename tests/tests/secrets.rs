//! Credentials and variables, end to end (real API, RabbitMQ, Postgres, the S3 server and
//! terraform 1.0.3): ProviderBindings of every kind and sensitive variables reach the
//! tool, and their values appear nowhere else — not in a log, event, error, Run field,
//! API response, database row or stored object.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};
use takosumi_client::{Capsule, NewCapsule, NewProviderBinding, PlanRequest, Source};
use takosumi_core::RunStatus;
use takosumi_tests::{GitRepo, Options, Stack, Steps};

/// A configuration that receives every kind of input and tells us, without printing a
/// secret itself, that it did: digests and lengths of the values, and a `local-exec` that
/// echoes the credentials (which the masker must catch) and their digests.
const MAIN_TF: &str = r#"
variable "secret" {
  type      = string
  sensitive = true
}
# Given as a sensitive variable but not declared sensitive: terraform prints it in the
# plan in clear text; only Takosumi's masker hides it.
variable "api_key" { type = string }
variable "seed" { type = string }
variable "region" { type = string }
variable "zones" { type = list(string) }
variable "tags" { type = map(string) }

locals {
  # Not an input at all: only the plan's sensitive markers (the `derived` output) name it.
  derived = "canary-out-${substr(sha256(var.seed), 0, 16)}"
}

resource "null_resource" "uses_secret" {
  triggers = {
    secret  = var.secret
    api_key = var.api_key
    derived = local.derived
  }
}

resource "null_resource" "env_probe" {
  triggers = { seed = var.seed }
  provisioner "local-exec" {
    command = "echo cred=$CANARY_CRED token=$TAKOSUMI_TOKEN cmd=$CMD_CRED checkpoint=$CHECKPOINT_DISABLE; echo cred-sha=$(printf %s \"$CANARY_CRED\" | sha256sum | cut -c1-64); echo token-sha=$(printf %s \"$TAKOSUMI_TOKEN\" | sha256sum | cut -c1-64); echo switchtender-sha=$(printf %s \"$SWITCHTENDER_TOKEN\" | sha256sum | cut -c1-64); echo cmd-sha=$(printf %s \"$CMD_CRED\" | sha256sum | cut -c1-64); echo fork=$TF_FORK tool-parent=$(cat /proc/$(awk '{print $4}' /proc/$PPID/stat)/comm)"
  }
}

output "secret_sha" { value = nonsensitive(sha256(var.secret)) }
output "api_key_len" { value = length(var.api_key) }
# Not marked sensitive by the configuration: published, but masked.
output "api_key_echo" { value = "key:${var.api_key}" }
output "secret_out" {
  value     = "so-${var.secret}"
  sensitive = true
}
output "derived" {
  value     = local.derived
  sensitive = true
}
output "zones_json" { value = jsonencode(var.zones) }
output "tags_json" { value = jsonencode(var.tags) }
output "region" { value = var.region }
"#;

fn sha(text: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

fn random() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

async fn workspace_and_capsule(
    stack: &Stack,
    repo: &GitRepo,
    dir: &str,
    vars: Value,
) -> anyhow::Result<Capsule> {
    let ws = stack
        .client
        .create_workspace(&format!("ws-{}", random()))
        .await?;
    let req = NewCapsule {
        name: "secrets".into(),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: dir.into(),
        tool: "terraform".into(),
        vars: obj(vars),
    };
    Ok(stack.client.create_capsule(ws.id, &req).await?)
}

/// A raw GET as any user would make it: the body's text, whatever the status.
async fn raw_get(stack: &Stack, path: &str) -> anyhow::Result<String> {
    Ok(reqwest::Client::new()
        .get(format!("{}{path}", stack.api_url))
        .bearer_auth(&stack.admin_token)
        .send()
        .await?
        .text()
        .await?)
}

/// A raw request with a JSON body: `(status, body text)`.
async fn raw_send(
    stack: &Stack,
    method: reqwest::Method,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    let resp = reqwest::Client::new()
        .request(method, format!("{}{path}", stack.api_url))
        .bearer_auth(&stack.admin_token)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await?;
    let status = resp.status().as_u16();
    Ok((status, resp.text().await?))
}

/// Fails naming `place` when any canary appears in `text`, in any encoding
/// [`takosumi_tests::canary`] knows (raw, base64 at every alignment, hex, URL, JSON).
fn assert_clean(place: &str, text: &str, canaries: &[String]) {
    takosumi_tests::canary::assert_absent(place, text.as_bytes(), canaries);
}

/// Every row of every table of the stack's database, as JSON text.
async fn dump_database(stack: &Stack) -> anyhow::Result<Vec<(String, String)>> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables
          WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1",
    )
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert!(tables.iter().any(|t| t == "provider_bindings"));
    let mut rows = Vec::new();
    for table in tables {
        let texts: Vec<String> =
            sqlx::query_scalar(&format!("SELECT row_to_json(t)::text FROM \"{table}\" t"))
                .fetch_all(&stack.ctx.pool)
                .await?;
        for text in texts {
            rows.push((table.clone(), text));
        }
    }
    Ok(rows)
}

/// Everything a user or an operator could read: API responses, every database row, every
/// stored object (raw: sealed objects must not hold a canary's bytes in clear), and the
/// run directories (which must be gone).
async fn assert_nowhere(
    stack: &Stack,
    paths: &[String],
    canaries: &[String],
) -> anyhow::Result<()> {
    for path in paths {
        let body = raw_get(stack, path).await?;
        assert_clean(&format!("GET {path}"), &body, canaries);
    }
    let rows = dump_database(stack).await?;
    assert!(rows.len() > 10, "the dump is suspiciously small");
    for (table, row) in &rows {
        assert_clean(&format!("a row of table {table}"), row, canaries);
    }
    let keys = stack.ctx.objects.list("").await?;
    assert!(!keys.is_empty(), "a plan and an apply store objects");
    for key in &keys {
        let bytes = stack.ctx.objects.get(key, 512 * 1024 * 1024).await?;
        takosumi_tests::canary::assert_absent(&format!("object {key}"), &bytes, canaries);
    }
    let leftovers = takosumi_tests::leftover_run_dirs(&stack.settings.work_dir);
    assert!(
        leftovers.is_empty(),
        "run directories (and the values in them) must vanish: {leftovers:?}"
    );
    Ok(())
}

/// The promise: an env credential, a token credential (as `TAKOSUMI_TOKEN`), a
/// command-source credential (resolved fresh for the plan and again for the apply), a
/// sensitive variable, a sensitive variable the configuration does not declare sensitive,
/// and a value only the plan marks sensitive all reach the configuration — and none of
/// their values appears in any API response (Run, events, logs, bindings, history), any
/// row of any table, any stored object or a leftover run directory. The tool's own
/// printing of them is masked. Per-run list/map variables reach the configuration as
/// JSON, override the Capsule's for that Run only, and tool processes run with
/// `CHECKPOINT_DISABLE=1` and `TF_FORK=0` (one process per command).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn canary_secrets_reach_the_tool_and_nothing_else() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let r = random();
    let cred = format!("canary-cred-{r}");
    let token = format!("canary-token-{r}");
    let cmd_a = format!("canary-cmd-a-{r}");
    let cmd_b = format!("canary-cmd-b-{r}");
    let secret = format!("canary-secret-{r}");
    let api_key = format!("canary-api-{r}");
    let seed = format!("seed-{r}");
    let derived = format!("canary-out-{}", &sha(&seed)[..16]);
    let canaries = vec![
        cred.clone(),
        token.clone(),
        cmd_a.clone(),
        cmd_b.clone(),
        secret.clone(),
        api_key.clone(),
        derived.clone(),
    ];

    let repo = GitRepo::new(&[("infra/secrets/main.tf", MAIN_TF)])?;
    let capsule = workspace_and_capsule(
        &stack,
        &repo,
        "infra/secrets",
        json!({ "region": "eu", "seed": seed, "zones": ["default-zone"], "tags": { "team": "default" } }),
    )
    .await?;
    let ws = capsule.workspace_id;

    // Three credential sets; what comes back is names only.
    let cred_dir = takosumi_tests::fixture_dir()?;
    let cred_file = cred_dir.path().join("cmd-cred");
    std::fs::write(&cred_file, format!("{cmd_a}\n"))?;
    let created = [
        stack
            .client
            .create_provider_binding(
                ws,
                &NewProviderBinding::Env {
                    name: "cloud".into(),
                    env: BTreeMap::from([("CANARY_CRED".to_owned(), cred.clone())]),
                },
            )
            .await?,
        stack
            .client
            .create_provider_binding(
                ws,
                &NewProviderBinding::Token {
                    name: "ci".into(),
                    token: token.clone(),
                },
            )
            .await?,
        stack
            .client
            .create_provider_binding(
                ws,
                &NewProviderBinding::Command {
                    name: "vault".into(),
                    command: vec!["/bin/cat".into(), cred_file.display().to_string()],
                    env_name: "CMD_CRED".into(),
                },
            )
            .await?,
    ];
    let names: Vec<Vec<String>> = created.iter().map(|b| b.env_names.clone()).collect();
    assert_eq!(
        names,
        vec![
            vec!["CANARY_CRED".to_owned()],
            vec!["TAKOSUMI_TOKEN".to_owned(), "SWITCHTENDER_TOKEN".to_owned()],
            vec!["CMD_CRED".to_owned()]
        ]
    );
    for b in &created {
        assert!(b.id.to_string().starts_with("pb_"));
        assert_clean("a create response", &serde_json::to_string(b)?, &canaries);
        let attached = stack
            .client
            .attach_provider_binding(capsule.id, b.id)
            .await?;
        assert!(attached.iter().any(|a| a.id == b.id));
    }
    // Attaching again changes nothing.
    let again = stack
        .client
        .attach_provider_binding(capsule.id, created[0].id)
        .await?;
    assert_eq!(again.len(), 3);

    // Plan with per-run variables (lists and maps) and sensitive variables.
    let req = PlanRequest {
        vars: obj(json!({ "zones": ["eu-1a", "eu-1b"], "tags": { "team": "net", "env": "prod" } })),
        sensitive_vars: obj(json!({ "secret": secret, "api_key": api_key })),
        ..PlanRequest::default()
    };
    let plan = stack.client.plan_with(capsule.id, None, &req).await?;
    assert_clean(
        "the plan submission's response",
        &serde_json::to_string(&plan)?,
        &canaries,
    );
    let plan = stack.wait(plan.id).await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let used: Vec<String> = plan
        .provider_bindings
        .iter()
        .map(|b| b.name.clone())
        .collect();
    assert_eq!(used, ["cloud", "ci", "vault"]);
    assert_eq!(
        plan.provider_bindings
            .iter()
            .map(|b| b.id)
            .collect::<Vec<_>>(),
        created.iter().map(|b| b.id).collect::<Vec<_>>()
    );
    for name in [
        "CANARY_CRED",
        "TAKOSUMI_TOKEN",
        "SWITCHTENDER_TOKEN",
        "CMD_CRED",
        "TF_VAR_secret",
        "TF_VAR_api_key",
        "TF_VAR_zones",
        "TF_VAR_tags",
        "TF_VAR_region",
        "TF_VAR_seed",
    ] {
        assert!(
            plan.injected_env_names.iter().any(|n| n == name),
            "{name} missing from {:?}",
            plan.injected_env_names
        );
    }
    // Names, not values: the plain variables' values are checked through the outputs.
    let names = plan
        .var_names
        .clone()
        .expect("the plan records its variables' names");
    for name in ["region", "seed", "tags", "zones"] {
        assert!(names.iter().any(|n| n == name), "{name}: {names:?}");
    }
    assert!(
        !names.iter().any(|n| n == "secret" || n == "api_key"),
        "{names:?}"
    );
    let served = serde_json::to_string(&plan)?;
    assert!(
        !served.contains("eu-1a") && !served.contains("\"net\""),
        "{served}"
    );
    let plan_log = stack.client.logs(plan.id).await?;
    assert!(
        plan_log.contains("\"api_key\" = \"***\"") && plan_log.contains("\"derived\" = \"***\""),
        "the plan printed the undeclared sensitive variable and the derived value; both must be masked:\n{plan_log}"
    );

    // The command-source credential is resolved again for the apply.
    std::fs::write(&cred_file, format!("{cmd_b}\n"))?;
    let apply = stack.client.apply(plan.id, None).await?;
    let apply = stack.wait(apply.id).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(apply.provider_bindings.len(), 3);
    assert!(apply.injected_env_names.iter().any(|n| n == "CMD_CRED"));
    let outputs = apply.outputs.clone().expect("outputs");
    assert_eq!(outputs["secret_sha"], json!(sha(&secret)), "{outputs}");
    assert_eq!(outputs["api_key_len"], json!(api_key.len()), "{outputs}");
    assert_eq!(outputs["api_key_echo"], json!("key:***"), "{outputs}");
    assert_eq!(outputs["secret_out"], json!({ "sensitive": true }));
    assert_eq!(outputs["derived"], json!({ "sensitive": true }));
    assert_eq!(outputs["zones_json"], json!(r#"["eu-1a","eu-1b"]"#));
    assert_eq!(
        outputs["tags_json"],
        json!(r#"{"env":"prod","team":"net"}"#)
    );
    assert_eq!(outputs["region"], json!("eu"));
    let apply_log = stack.client.logs(apply.id).await?;
    assert!(
        apply_log.contains("cred=*** token=*** cmd=*** checkpoint=1"),
        "the tool printed every credential (masked) and ran with CHECKPOINT_DISABLE=1:\n{apply_log}"
    );
    // The tool ran as one process: terraform 1.0.3 re-executes itself under panicwrap
    // unless TF_FORK=0, and then the provisioner's shell has terraform for grandparent.
    let tool_parent = apply_log
        .split("fork=0 tool-parent=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_default();
    assert!(
        !tool_parent.is_empty() && tool_parent != "terraform",
        "the tool must run as one process with TF_FORK=0, its parent {tool_parent:?}:\n{apply_log}"
    );
    for line in [
        format!("cred-sha={}", sha(&cred)),
        format!("token-sha={}", sha(&token)),
        // the seed's name for the same token
        format!("switchtender-sha={}", sha(&token)),
        format!("cmd-sha={}", sha(&cmd_b)),
    ] {
        assert!(apply_log.contains(&line), "{line} missing:\n{apply_log}");
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM run_sensitive_vars")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(
        left, 0,
        "a plan's sealed sensitive variables go with its apply"
    );

    // A later plan without overrides is planned with the Capsule's own variables (its
    // sensitive variables are given again: nothing of the first Run's inputs is reused).
    let again = PlanRequest {
        sensitive_vars: obj(json!({ "secret": secret, "api_key": api_key })),
        ..PlanRequest::default()
    };
    let plain = stack
        .wait(stack.client.plan_with(capsule.id, None, &again).await?.id)
        .await?;
    assert_eq!(plain.status, RunStatus::Planned, "{plain:?}");
    assert!(
        stack.client.logs(plain.id).await?.contains("default-zone"),
        "planned with the Capsule's own zones"
    );
    assert!(!serde_json::to_string(&plain)?.contains("default-zone"));

    // A destroy plan takes the same optional body (the configuration needs its variables).
    let (status, body) = raw_send(
        &stack,
        reqwest::Method::DELETE,
        &format!("/api/v1/capsules/{}", capsule.id),
        &json!({ "sensitiveVars": { "secret": secret, "api_key": api_key } }).to_string(),
    )
    .await?;
    assert_eq!(status, 202, "{body}");
    let destroy: Value = serde_json::from_str(&body)?;
    let destroy_id: takosumi_core::RunId = serde_json::from_value(destroy["id"].clone())?;
    let destroy = stack.wait(destroy_id).await?;
    assert_eq!(destroy.status, RunStatus::Planned, "{destroy:?}");
    assert_eq!(destroy.changes.map(|c| c.destroy), Some(2));

    let mut paths = vec![
        format!("/api/v1/capsules/{}", capsule.id),
        format!("/api/v1/capsules/{}/provider-bindings", capsule.id),
        format!("/api/v1/workspaces/{ws}/provider-bindings"),
        format!("/api/v1/workspaces/{ws}/runs"),
        format!("/api/v1/workspaces/{ws}/activity"),
    ];
    for run in [plan.id, apply.id, plain.id, destroy.id] {
        for suffix in ["", "/events", "/logs", "/cost"] {
            paths.push(format!("/api/v1/runs/{run}{suffix}"));
        }
    }
    assert_nowhere(&stack, &paths, &canaries).await?;
    stack.stop().await
}

/// The promise: a command-source credential that fails ends the plan `credential_failed`
/// before any tool starts, and what the command printed (maybe the secret) is in no
/// message, event, log or row; a repository with a link out of the checkout fails
/// `invalid_configuration`; bad credential sets and plan bodies are refused with a code,
/// change nothing, and never quote a submitted value back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_credentials_escaping_links_and_bad_input_fail_with_a_code() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::ALL,
        ..Options::default()
    })
    .await?;
    let r = random();
    let printed = format!("canary-printed-{r}");
    let canaries = vec![printed.clone()];

    // 1. A failing credential command.
    let repo = GitRepo::with_example("network")?;
    let capsule =
        workspace_and_capsule(&stack, &repo, "infra/network", json!({ "region": "eu" })).await?;
    let ws = capsule.workspace_id;
    let script = cred_script(&printed)?;
    let failing = stack
        .client
        .create_provider_binding(
            ws,
            &NewProviderBinding::Command {
                name: "broken".into(),
                command: vec!["/bin/sh".into(), script.1.display().to_string()],
                env_name: "BROKEN_CRED".into(),
            },
        )
        .await?;
    stack
        .client
        .attach_provider_binding(capsule.id, failing.id)
        .await?;
    let tools_before = stack.tool_invocations().len();
    let run = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(run.status, RunStatus::Failed, "{run:?}");
    let error = run.error.clone().expect("error");
    assert_eq!(error.code, "credential_failed");
    assert!(
        error.message.contains("broken") && error.message.contains("code 7"),
        "{}",
        error.message
    );
    assert_eq!(
        stack.tool_invocations().len(),
        tools_before,
        "no tool starts without its credentials"
    );
    let paths: Vec<String> = ["", "/events", "/logs"]
        .iter()
        .map(|s| format!("/api/v1/runs/{}{s}", run.id))
        .collect();
    for path in &paths {
        assert_clean(path, &raw_get(&stack, path).await?, &canaries);
    }
    for (table, row) in dump_database(&stack).await? {
        assert_clean(&format!("a row of {table}"), &row, &canaries);
    }

    // 2. A link out of the checkout.
    let linked = GitRepo::with_example("network")?;
    let dir = linked.url().trim_start_matches("file://").to_owned();
    std::os::unix::fs::symlink("/etc/hostname", format!("{dir}/infra/network/host.tf"))?;
    linked.commit(&[], "link out of the repository")?;
    let escaping =
        workspace_and_capsule(&stack, &linked, "infra/network", json!({ "region": "eu" })).await?;
    let run = stack
        .wait(stack.client.plan(escaping.id, None).await?.id)
        .await?;
    assert_eq!(run.status, RunStatus::Failed, "{run:?}");
    let error = run.error.expect("error");
    assert_eq!(error.code, "invalid_configuration", "{}", error.message);
    assert!(
        error.message.contains("outside the checkout"),
        "{}",
        error.message
    );

    // 3. Bad input: a code, nothing written, no value quoted back.
    let other_ws = stack
        .client
        .create_workspace(&format!("other-{}", random()))
        .await?;
    let foreign = stack
        .client
        .create_provider_binding(
            other_ws.id,
            &NewProviderBinding::Token {
                name: "foreign".into(),
                token: "foreign-token".into(),
            },
        )
        .await?;
    let clash = stack
        .client
        .create_provider_binding(
            ws,
            &NewProviderBinding::Env {
                name: "clash".into(),
                env: BTreeMap::from([("BROKEN_CRED".to_owned(), "whatever".to_owned())]),
            },
        )
        .await?;
    let before = counts(&stack).await?;
    let bindings = format!("/api/v1/workspaces/{ws}/provider-bindings");
    let attach = format!("/api/v1/capsules/{}/provider-bindings", capsule.id);
    let plan = format!("/api/v1/capsules/{}/plan", capsule.id);
    let post = reqwest::Method::POST;
    let cases: Vec<(&str, String, String, u16, &str)> = vec![
        (
            "reserved name",
            bindings.clone(),
            json!({"name": "x", "kind": "env", "env": {"PATH": printed}}).to_string(),
            422,
            "invalid_binding",
        ),
        (
            "unknown kind",
            bindings.clone(),
            json!({"name": "x", "kind": "vault", "token": printed}).to_string(),
            422,
            "invalid_binding",
        ),
        (
            "mixed kinds",
            bindings.clone(),
            json!({"name": "x", "kind": "token", "token": printed, "env": {"A": printed}})
                .to_string(),
            422,
            "invalid_binding",
        ),
        (
            "empty env",
            bindings.clone(),
            json!({"name": "x", "kind": "env", "env": {}}).to_string(),
            422,
            "invalid_binding",
        ),
        (
            "a value of the wrong type",
            bindings.clone(),
            format!(r#"{{"name": "x", "kind": "env", "env": {{"A": ["{printed}"]}}}}"#),
            400,
            "invalid_json",
        ),
        (
            "broken JSON",
            bindings.clone(),
            format!(r#"{{"name": "x", "kind": "token", "token": "{printed}"#),
            400,
            "invalid_json",
        ),
        (
            "bad name",
            bindings.clone(),
            json!({"name": "-x", "kind": "token", "token": printed}).to_string(),
            422,
            "invalid_name",
        ),
        (
            "duplicate name",
            bindings.clone(),
            json!({"name": "broken", "kind": "token", "token": printed}).to_string(),
            409,
            "binding_exists",
        ),
        (
            "another Workspace's binding",
            attach.clone(),
            json!({"bindingId": foreign.id}).to_string(),
            404,
            "not_found",
        ),
        (
            "a name another binding injects",
            attach.clone(),
            json!({"bindingId": clash.id}).to_string(),
            409,
            "env_name_conflict",
        ),
        (
            "not an id",
            attach.clone(),
            json!({"bindingId": "nope"}).to_string(),
            400,
            "invalid_id",
        ),
        (
            "a variable twice",
            plan.clone(),
            json!({"vars": {"region": "x"}, "sensitiveVars": {"region": printed}}).to_string(),
            422,
            "invalid_vars",
        ),
        (
            "a bad variable name",
            plan.clone(),
            json!({"sensitiveVars": {"bad name": printed}}).to_string(),
            422,
            "invalid_vars",
        ),
        (
            "an unknown field",
            plan.clone(),
            json!({"secrets": {"a": printed}}).to_string(),
            400,
            "invalid_json",
        ),
        (
            "a sensitive value of the wrong shape",
            plan.clone(),
            format!(r#"{{"sensitiveVars": "{printed}"}}"#),
            400,
            "invalid_json",
        ),
    ];
    for (what, path, body, want_status, want_code) in cases {
        let (status, text) = raw_send(&stack, post.clone(), &path, &body).await?;
        assert_eq!(status, want_status, "{what}: {text}");
        let parsed: Value = serde_json::from_str(&text)?;
        assert_eq!(parsed["code"], json!(want_code), "{what}: {text}");
        assert_clean(&format!("the answer to {what}"), &text, &canaries);
    }
    assert_eq!(
        counts(&stack).await?,
        before,
        "a refused request wrote rows"
    );
    let attached = stack.client.capsule_provider_bindings(capsule.id).await?;
    assert_eq!(attached.len(), 1);
    let left = stack
        .client
        .detach_provider_binding(capsule.id, failing.id)
        .await?;
    assert!(left.is_empty());
    stack.stop().await
}

/// A credential helper that prints the canary on both streams, then fails. The directory
/// lives as long as the returned guard.
fn cred_script(printed: &str) -> anyhow::Result<(tempfile::TempDir, std::path::PathBuf)> {
    let dir = takosumi_tests::fixture_dir()?;
    let path = dir.path().join("helper.sh");
    std::fs::write(
        &path,
        format!("echo {printed}\necho {printed} >&2\nexit 7\n"),
    )?;
    Ok((dir, path))
}

async fn counts(stack: &Stack) -> anyhow::Result<Vec<i64>> {
    let mut out = Vec::new();
    for table in [
        "provider_bindings",
        "capsule_provider_bindings",
        "runs",
        "run_sensitive_vars",
        "outbox",
        "activity",
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&stack.ctx.pool)
            .await?;
        out.push(n);
    }
    Ok(out)
}
