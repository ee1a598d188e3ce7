//! A hostile Capsule, through the real API, Postgres, RabbitMQ, the S3 server and
//! terraform 1.0.3: its `local-exec` provisioner and its command credential try to read
//! the handler's environment (every `/proc/*/environ`), the stack's secret file and S3
//! data directory, `/etc/shadow`, the host's TLS private keys; to log in to Postgres and RabbitMQ with well-known
//! passwords; to write outside their directory; and to leave a process running. What
//! they find is printed base64-encoded, so the masker cannot be what saves us: only the
//! sandbox can. Every attempt must fail, and none of the server's secrets may appear in
//! any log, event, Run record or response.

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Map, json};
use takosumi_client::{NewCapsule, NewProviderBinding, Source};
use takosumi_core::{CapsuleId, SandboxMode, WorkspaceId};
use takosumi_seal::delivery::DeliveryKeyPair;
use takosumi_tests::{GitRepo, Stack, keys_env, spawn_relay};

/// What a hostile author commits: everything it can reach goes into one base64 blob.
const PROBE: &str = r#"#!/bin/sh
found=$( (for f in /proc/[0-9]*/environ; do tr '\0' '\n' < "$f"; done
  cat /var/tmp/takosumi-stack/secrets /var/tmp/takosumi-stack/env.sh
  ls -R /var/tmp/takosumi-stack/s3 | head -100
  cat /etc/shadow
  cat /etc/ssl/private/* /etc/pki/tls/private/*
  echo "cred=$CMD_CRED") 2>/dev/null | base64 -w0)
echo "PROBE_FOUND=$found"
echo "PROBE_UID=$(id -u)"
echo "PROBE_PROCS=$(ls /proc | grep -c '^[0-9]')"
for target in /var/tmp/pwned /etc/pwned /usr/pwned "$HOME/../../pwned-parent"; do
  if (echo x > "$target") 2>/dev/null; then echo "PROBE_WROTE $target"; fi
done
echo "PROBE_S3=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8014/)"
echo "PROBE_GUEST=$(curl -s -o /dev/null -w '%{http_code}' -u guest:guest http://127.0.0.1:15672/api/overview)"
if PGPASSWORD=takosumi psql -h 127.0.0.1 -U takosumi -d postgres -tAc 'select 1' >/dev/null 2>&1; then echo PROBE_PG_OPEN; fi
(setsid sleep 25.1357 >/dev/null 2>&1 &)
echo PROBE_DONE
"#;

/// The command credential: it tries the same from plan time and returns what it found.
const CRED: &str = r#"#!/bin/sh
(for f in /proc/[0-9]*/environ; do tr '\0' '\n' < "$f"; done; cat /var/tmp/takosumi-stack/secrets) 2>/dev/null | base64 -w0
echo "-cred-ok"
"#;

const MAIN_TF: &str = r#"
resource "null_resource" "probe" {
  provisioner "local-exec" {
    command = "sh ./probe.sh"
  }
}
"#;

fn sleepers(marker: &str) -> usize {
    let want = format!("sleep\0{marker}\0").into_bytes();
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == want))
                .count()
        })
        .unwrap_or(0)
}

/// Where the hostile Capsule runs.
enum Host<'a> {
    /// The control node's in-process plan and apply handlers.
    ControlNode,
    /// A relay worker process of a pool (its token and delivery keys are the secrets).
    Relay { pool: &'a str },
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hostile_capsule_reaches_nothing_of_the_server() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let canaries = server_canaries(&stack);
    hostile_run(&stack, &canaries, Host::ControlNode).await?;
    stack.stop().await
}

/// The same Capsule on a relay worker: its environment holds the pool token and the
/// delivery keys, and the Run's sandbox reaches neither (nor anything of the control node).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hostile_capsule_on_a_relay_worker_reaches_nothing_of_the_worker() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let ws = stack.client.create_workspace("hostile-relay").await?;
    let (pool, token, key) = new_pool(&stack, ws.id).await?;
    let keys = keys_env(&[&key]);
    let mut canaries = server_canaries(&stack);
    canaries.push(("pool token", token.clone()));
    canaries.push(("delivery key", keys.split_once('=').unwrap().1.to_owned()));
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys, work.path())?;
    hostile_run_in(&stack, &canaries, Host::Relay { pool: &pool }, ws.id).await?;
    worker.kill().await?;
    stack.stop().await
}

/// The control node's secrets: in-process steps hold exactly these in their environment.
fn server_canaries(stack: &Stack) -> Vec<(&'static str, String)> {
    let vars = stack.env_vars().clone();
    let db_password = vars["TAKOSUMI_DATABASE_URL"]
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, p)| p.to_owned())
        .expect("a password in the database URL");
    vec![
        ("seal key", vars["TAKOSUMI_SEAL_KEY"].clone()),
        (
            "evidence signing key",
            vars["TAKOSUMI_EVIDENCE_KEY"].clone(),
        ),
        ("S3 secret", vars["TAKOSUMI_S3_SECRET_KEY"].clone()),
        ("admin token", stack.admin_token.clone()),
        ("database password", db_password),
    ]
}

async fn hostile_run(
    stack: &Stack,
    canaries: &[(&str, String)],
    host: Host<'_>,
) -> anyhow::Result<()> {
    let ws = stack.client.create_workspace("hostile").await?;
    hostile_run_in(stack, canaries, host, ws.id).await
}

/// Plans and applies the hostile Capsule in Workspace `ws` on `host` and checks that
/// every attempt failed and nothing of `canaries` is anywhere.
async fn hostile_run_in(
    stack: &Stack,
    canaries: &[(&str, String)],
    host: Host<'_>,
    ws: WorkspaceId,
) -> anyhow::Result<()> {
    for (what, value) in canaries {
        assert!(value.len() >= 8, "{what} is too short to be a canary");
    }
    let repo = GitRepo::new(&[
        ("infra/hostile/main.tf", MAIN_TF),
        ("infra/hostile/probe.sh", PROBE),
    ])?;
    let fixtures = takosumi_tests::fixture_dir()?;
    let cred = fixtures.path().join("cred.sh");
    std::fs::write(&cred, CRED)?;
    let capsule = stack
        .client
        .create_capsule(
            ws,
            &NewCapsule {
                name: "hostile".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra/hostile".into(),
                tool: "terraform".into(),
                vars: Map::new(),
            },
        )
        .await?;
    // A command credential runs where the Run runs; a pool takes env credentials only,
    // so there the probe gets one whose value is already in the probe's own format.
    let binding = match host {
        Host::ControlNode => NewProviderBinding::Command {
            name: "probe".into(),
            command: vec!["/bin/sh".into(), cred.display().to_string()],
            env_name: "CMD_CRED".into(),
        },
        Host::Relay { .. } => NewProviderBinding::Env {
            name: "probe".into(),
            env: std::collections::BTreeMap::from([(
                "CMD_CRED".to_owned(),
                format!(
                    "{}-cred-ok",
                    base64::engine::general_purpose::STANDARD.encode("an env credential")
                ),
            )]),
        },
    };
    let binding = stack.client.create_provider_binding(ws, &binding).await?;
    stack
        .client
        .attach_provider_binding(capsule.id, binding.id)
        .await?;
    if let Host::Relay { pool } = host {
        move_to_pool(stack, capsule.id, pool).await?;
    }

    let (plan, apply) = stack.plan_and_apply(capsule.id).await?;
    let log = stack.client.logs(apply.id).await?;
    assert!(
        log.contains("PROBE_DONE"),
        "the provisioner did not run: {log}"
    );

    let field = |name: &str| -> String {
        log.lines()
            .find_map(|l| {
                l.split_once(&format!("{name}="))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| panic!("no {name} in the log: {log}"))
    };
    // What the provisioner could read, decoded: none of the server's secrets.
    let found = base64::engine::general_purpose::STANDARD
        .decode(field("PROBE_FOUND"))
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    for (what, value) in canaries {
        assert!(
            !found.contains(value.as_str()),
            "the provisioner read the {what}"
        );
    }
    assert!(
        !found.contains("TAKOSUMI_"),
        "the provisioner read a handler setting: {found}"
    );
    assert!(!found.contains("root:"), "/etc/shadow is readable");
    assert!(
        !found.contains("PRIVATE KEY"),
        "a host TLS private key is readable"
    );
    assert!(
        !found.contains("S3_SECRET_KEY="),
        "the stack's secret file is readable"
    );
    // The command credential ran (plan and apply) inside the sandbox too: what it
    // found and handed to the tool holds nothing of the server.
    let cred_seen = found
        .lines()
        .find_map(|l| l.strip_prefix("cred="))
        .unwrap_or_default();
    assert!(cred_seen.ends_with("-cred-ok"), "{found}");
    let cred_found = base64::engine::general_purpose::STANDARD
        .decode(cred_seen.trim_end_matches("-cred-ok"))
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    for (what, value) in canaries {
        assert!(
            !cred_found.contains(value.as_str()),
            "the credential command read the {what}"
        );
    }
    assert!(!cred_found.contains("TAKOSUMI_"), "{cred_found}");

    assert_eq!(field("PROBE_UID"), takosumi_runner::SANDBOX_UID.to_string());
    let procs: usize = field("PROBE_PROCS").parse()?;
    assert!(
        procs < 12,
        "{procs} processes visible: not a pid namespace of its own"
    );
    // A write that succeeded landed in the sandbox's private scratch (its own `/tmp`),
    // never on the host.
    for line in log
        .lines()
        .filter_map(|l| l.split_once("PROBE_WROTE ").map(|(_, p)| p.trim()))
    {
        assert!(
            !std::path::Path::new(line).exists(),
            "the provisioner wrote {line} on the host"
        );
    }
    for host in ["/var/tmp/pwned", "/etc/pwned", "/usr/pwned"] {
        assert!(!std::path::Path::new(host).exists(), "{host} was written");
        assert!(!log.contains(&format!("PROBE_WROTE {host}")), "{log}");
    }
    // Loopback is shared, so the stack's services must not take well-known passwords.
    assert_ne!(field("PROBE_GUEST"), "200", "RabbitMQ accepted guest/guest");
    // The S3 server answers, but lists nothing without the secret the sandbox never sees.
    let s3 = field("PROBE_S3");
    assert!(
        s3 != "200" && s3 != "000",
        "S3 from the sandbox answered {s3}"
    );
    assert!(
        !log.contains("PROBE_PG_OPEN"),
        "Postgres accepted a well-known password"
    );
    // Nothing it started outlives the Run.
    let mut left = sleepers("25.1357");
    for _ in 0..50 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = sleepers("25.1357");
    }
    assert_eq!(
        left, 0,
        "a process the provisioner started outlived the Run"
    );
    assert_eq!(apply.sandbox, Some(SandboxMode::Bubblewrap.into()));
    assert_eq!(plan.sandbox, Some(SandboxMode::Bubblewrap.into()));

    // Nowhere the API serves holds a secret of the server's, in clear or base64.
    let mut served = String::new();
    for run in [plan.id, apply.id] {
        served.push_str(&stack.client.logs(run).await?);
        served.push_str(&serde_json::to_string(&stack.client.events(run).await?)?);
        served.push_str(&serde_json::to_string(&stack.client.get_run(run).await?)?);
    }
    for (what, value) in canaries {
        if let Some(how) = takosumi_tests::canary::find(served.as_bytes(), value.as_bytes()) {
            panic!("the {what} is served ({how})");
        }
    }
    if let Host::Relay { pool } = host {
        let claimer = stack
            .client
            .events(apply.id)
            .await?
            .into_iter()
            .find(|e| e.kind == "claimed")
            .map(|e| e.actor)
            .unwrap_or_default();
        assert!(
            claimer.starts_with(&format!("handler:relay:{pool}:")),
            "{claimer}"
        );
    }
    Ok(())
}

/// The tool as a hostile provider would leave it: `show -json` starts the configuration's
/// providers, and this one rewrites the saved plan once `show` has read it (the real
/// terraform's `show`, then the file replaced). Everything else is the real terraform.
fn plan_rewriting_tool(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let real = std::env::var("TAKOSUMI_TERRAFORM_BIN")?;
    let path = dir.join("terraform");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nif [ \"$1\" = show ]; then\n  for plan; do :; done\n  '{real}' \"$@\"\n  status=$?\n  printf '{REWRITTEN}' > \"$plan\"\n  exit $status\nfi\nexec '{real}' \"$@\"\n"
        ),
    )?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path)
}

/// What the hostile provider writes over the saved plan.
const REWRITTEN: &str = "not the plan anybody reviewed";

/// A plan file rewritten while `show -json` runs is never what is sealed, reviewed or
/// applied: the plan step keeps the file before `show` starts any provider (control node
/// and relay worker alike), and an apply that has to run `show` itself (a relay worker's)
/// refuses to apply a file that changed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_rewritten_while_show_runs_is_never_applied() -> anyhow::Result<()> {
    let fixtures = takosumi_tests::fixture_dir()?;
    let tool = plan_rewriting_tool(fixtures.path())?;
    let stack =
        takosumi_tests::Stack::start_with_tool(takosumi_tests::Options::default(), Some(&tool))
            .await?;
    let rewritten = takosumi_core::sha256_hex(REWRITTEN.as_bytes());

    // The control node: the plan kept is the one `show` read; the apply reads the plan's
    // sealed `show -json` (no `show` of its own) and applies it.
    let repo = GitRepo::with_example("network")?;
    let capsule = stack
        .new_capsule(&repo, "network", "infra/network", json!({ "region": "eu" }))
        .await?;
    let (plan, apply) = stack.plan_and_apply(capsule.id).await?;
    let digest = plan.plan_digest.clone().expect("a plan digest");
    assert_ne!(
        digest, rewritten,
        "the control node sealed the rewritten plan"
    );
    assert_eq!(apply.outputs, Some(json!({ "vpc": "vpc-eu" })), "{apply:?}");

    // A relay worker: its plan keeps the file before `show` too; its apply runs `show`
    // (it has no sealed JSON), and the file changed under it: nothing is applied.
    let capsule = stack
        .new_capsule(&repo, "network", "infra/network", json!({ "region": "eu" }))
        .await?;
    let (pool, token, key) = new_pool(&stack, capsule.workspace_id).await?;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys_env(&[&key]), work.path())?;
    move_to_pool(&stack, capsule.id, &pool).await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, takosumi_core::RunStatus::Planned, "{plan:?}");
    assert_ne!(
        plan.plan_digest.as_deref(),
        Some(rewritten.as_str()),
        "the relay worker sent the rewritten plan"
    );
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    worker.kill().await?;
    assert_eq!(apply.status, takosumi_core::RunStatus::Failed, "{apply:?}");
    let error = apply.error.expect("the failure");
    assert_eq!(error.code, "apply_failed", "{error:?}");
    assert!(
        error.message.contains("changed while `show -json` ran"),
        "{error:?}"
    );
    assert!(
        !stack
            .client
            .logs(apply.id)
            .await?
            .contains("Apply complete"),
        "the rewritten plan was applied"
    );
    stack.stop().await
}

/// A plan whose `show -json` fails (here: the tool exits 1 for `show`, as a hostile or
/// broken provider can make it) fails the Run and leaves nothing of its claim in object
/// storage: the lockfile and the sealed plan kept before `show` are deleted, since no
/// record will ever reference them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_whose_show_fails_leaves_no_sealed_plan_behind() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let fixtures = takosumi_tests::fixture_dir()?;
    let real = std::env::var("TAKOSUMI_TERRAFORM_BIN")?;
    let tool = fixtures.path().join("terraform");
    std::fs::write(
        &tool,
        format!("#!/bin/sh\nif [ \"$1\" = show ]; then\n  exit 1\nfi\nexec '{real}' \"$@\"\n"),
    )?;
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755))?;
    let stack =
        takosumi_tests::Stack::start_with_tool(takosumi_tests::Options::default(), Some(&tool))
            .await?;
    let repo = GitRepo::with_example("network")?;
    let capsule = stack
        .new_capsule(&repo, "network", "infra/network", json!({ "region": "eu" }))
        .await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, takosumi_core::RunStatus::Failed, "{plan:?}");
    // `show` ran (the pipeline got past `plan`, so the plan file had been kept).
    let error = plan.error.expect("the failure");
    assert!(
        error.message.contains("`show` exited with code 1"),
        "{error:?}"
    );
    let left = stack
        .ctx
        .objects
        .list(&format!("runs/{}/", plan.id))
        .await?;
    assert!(left.is_empty(), "objects left behind: {left:?}");
    stack.stop().await
}

/// A worker pool of Workspace `ws` with a delivery key of its own: its name, its token and
/// the key (for the relay worker's environment).
async fn new_pool(
    stack: &Stack,
    ws: WorkspaceId,
) -> anyhow::Result<(String, String, DeliveryKeyPair)> {
    let pool = format!("edge-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let key = DeliveryKeyPair::generate("k1")?;
    let (status, created) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{ws}/pools"),
            json!({ "name": pool, "deliveryKey": { "keyId": key.key_id(), "publicKey": base64::engine::general_purpose::STANDARD.encode(key.public().public) } }),
        )
        .await?;
    assert_eq!(status, 201, "{created}");
    let token = created["token"].as_str().unwrap().to_owned();
    Ok((pool, token, key))
}

/// Moves `capsule` onto `pool`: its Runs are executed by the pool's relay workers.
async fn move_to_pool(stack: &Stack, capsule: CapsuleId, pool: &str) -> anyhow::Result<()> {
    let (status, v) = stack
        .call(
            "PUT",
            &format!("/api/v1/capsules/{capsule}/pool"),
            json!({ "pool": pool }),
        )
        .await?;
    assert_eq!(status, 200, "{v}");
    Ok(())
}
