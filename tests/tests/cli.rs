//! End-to-end: the `takosumi` CLI's saved login, listings and per-run variables, against
//! the real API, RabbitMQ, Postgres, the S3 server and terraform 1.0.3.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;

use serde_json::{Value, json};
use takosumi_tests::{GitRepo, Stack};
use tokio::io::AsyncWriteExt;

/// Runs the CLI with nothing inherited but `env`, feeding `stdin`:
/// `(exit code, stdout, stderr)`.
async fn cli(
    env: &[(&str, &str)],
    args: &[&str],
    stdin: Option<&str>,
) -> anyhow::Result<(i32, String, String)> {
    let mut child = tokio::process::Command::new(takosumi_tests::binary("takosumi")?)
        .env_clear()
        .envs(env.iter().copied())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut pipe = child.stdin.take().expect("stdin");
    pipe.write_all(stdin.unwrap_or_default().as_bytes()).await?;
    drop(pipe);
    let out = child.wait_with_output().await?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

const VARS_TF: &str = r#"
variable "region" { type = string }
variable "zones" { type = list(string) }
variable "tags" { type = map(string) }
output "region" { value = var.region }
output "zones_json" { value = jsonencode(var.zones) }
output "tags_json" { value = jsonencode(var.tags) }
"#;

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// The promise: `login` checks the token against the API before saving it (a bad one
/// saves nothing and says so), writes URL and token to `$TAKOSUMI_CONFIG` with mode 0600
/// and never prints the token; later commands use the saved login with no environment;
/// a config file others can read is refused with the `chmod` that fixes it; `workspace
/// list` and `capsule list` show what the token may see; `plan --var` passes strings and
/// JSON lists/maps (and `--var-json`) to the configuration, and a malformed one is a
/// usage error that sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn login_lists_and_plans_with_variables() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let home = tempfile::tempdir()?;
    let config = home.path().join("conf").join("takosumi.toml");
    let config_s = config.display().to_string();
    let home_s = home.path().display().to_string();
    let saved: [(&str, &str); 2] = [("TAKOSUMI_CONFIG", &config_s), ("HOME", &home_s)];

    let (code, out, err) = cli(&saved, &["workspace", "list"], None).await?;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("takosumi login"), "{err}");

    let (code, out, err) = cli(
        &saved,
        &["login", "--url", &stack.api_url],
        Some("tks_not_a_valid_token\n"),
    )
    .await?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("nothing was saved"), "{err}");
    assert!(!config.exists(), "a refused login wrote the config");

    let (code, out, err) = cli(
        &saved,
        &["login", "--url", &stack.api_url],
        Some(&format!("{}\n", stack.admin_token)),
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        !out.contains(&stack.admin_token) && !err.contains(&stack.admin_token),
        "login printed the token"
    );
    assert_eq!(mode_of(&config), 0o600);
    let text = std::fs::read_to_string(&config)?;
    assert!(text.contains(&stack.admin_token) && text.contains(&stack.api_url));

    let (code, out, err) = cli(&saved, &["--json", "workspace", "create", "cli-ws"], None).await?;
    assert_eq!(code, 0, "{out}{err}");
    let ws = serde_json::from_str::<Value>(&out)?["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, out, err) = cli(&saved, &["workspace", "list"], None).await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&ws) && out.contains("cli-ws"), "{out}");

    let repo = GitRepo::new(&[("infra/vars/main.tf", VARS_TF)])?;
    let (code, out, err) = cli(
        &saved,
        &[
            "--json",
            "capsule",
            "create",
            "--workspace",
            &ws,
            "--name",
            "vars",
            "--repo",
            &repo.url(),
            "--dir",
            "infra/vars",
            "--tool",
            "terraform",
            "--var",
            "region=us",
            "--var-json",
            r#"zones=["x"]"#,
            "--var-json",
            r#"tags={}"#,
        ],
        None,
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    let cap = serde_json::from_str::<Value>(&out)?["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, out, err) = cli(&saved, &["capsule", "list", "--workspace", &ws], None).await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&cap) && out.contains("vars"), "{out}");

    // A token limited to another Workspace sees neither this Workspace nor its Capsules.
    let other = stack.client.create_workspace("cli-other").await?.id;
    let scoped = format!(
        "tks_scoped_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    takosumi_store::tokens::upsert(
        &stack.ctx.pool,
        &scoped,
        "scoped",
        takosumi_core::Role::Operator,
        Some(other),
    )
    .await?;
    let (s, b) = stack
        .request("GET", "/api/v1/workspaces", Some(&scoped), None)
        .await?;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["workspaces"].as_array().unwrap().len(), 1, "{b}");
    assert_eq!(b["workspaces"][0]["id"], json!(other));
    let (s, b) = stack
        .request(
            "GET",
            &format!("/api/v1/workspaces/{ws}/capsules"),
            Some(&scoped),
            None,
        )
        .await?;
    assert_eq!(s, 404, "{b}");

    let (code, out, err) = cli(&saved, &["plan", &cap, "--var", "zones=[a"], None).await?;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("not valid JSON"), "{err}");
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&stack.ctx.pool)
        .await?;
    assert_eq!(runs, 0, "a refused command line sent a plan");

    let (code, out, err) = cli(
        &saved,
        &[
            "--json",
            "plan",
            &cap,
            "--var",
            "region=eu",
            "--var",
            r#"zones=["eu-1a","eu-1b"]"#,
            "--var-json",
            r#"tags={"env":"prod"}"#,
            "--wait",
        ],
        None,
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    let plan: Value = serde_json::from_str(&out)?;
    assert_eq!(plan["status"], json!("planned"), "{plan}");
    // names only on the Run; the values are checked through the outputs below
    assert_eq!(plan["varNames"], json!(["region", "tags", "zones"]));
    assert!(!plan.to_string().contains("eu-1a"), "{plan}");
    let plan_id = plan["id"].as_str().unwrap().to_owned();
    let (code, out, err) = cli(&saved, &["--json", "apply", &plan_id, "--wait"], None).await?;
    assert_eq!(code, 0, "{out}{err}");
    let applied: Value = serde_json::from_str(&out)?;
    assert_eq!(
        applied["outputs"],
        json!({ "region": "eu", "zones_json": r#"["eu-1a","eu-1b"]"#, "tags_json": r#"{"env":"prod"}"# }),
        "{applied}"
    );

    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644))?;
    let (code, out, err) = cli(&saved, &["workspace", "list"], None).await?;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("chmod 600"), "{err}");
    assert!(
        !err.contains(&stack.admin_token),
        "the refusal printed the token"
    );
    stack.stop().await
}

/// 32 random bytes in standard base64: an X25519 public key as far as the API can tell.
fn random_public_key() -> String {
    use base64::Engine as _;
    let mut raw = uuid::Uuid::new_v4().as_bytes().to_vec();
    raw.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
    base64::engine::general_purpose::STANDARD.encode(raw)
}

/// The promise: `pool create` prints the pool and its token once (saying it is shown only
/// now; with `--json` the token is in the JSON), and that token is the one the API stored
/// for the pool; `capsule set-pool CAP POOL` moves the Capsule onto the pool and `--none`
/// back to the control node (as `GET /capsules/{id}` shows); `pool rotate-key` makes the new
/// key current and keeps the old one as previous; a bad public key exits 1 with the API's
/// code and a hint on stderr and changes nothing; `set-pool` with neither a pool nor
/// `--none` is a usage error (exit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pools_are_created_assigned_and_rotated() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let home = tempfile::tempdir()?;
    let home_s = home.path().display().to_string();
    let env: [(&str, &str); 3] = [
        ("TAKOSUMI_DEPLOY_CONTROL_URL", &stack.api_url),
        ("TAKOSUMI_DEPLOY_CONTROL_TOKEN", &stack.admin_token),
        ("HOME", &home_s),
    ];
    let ws = stack.client.create_workspace("cli-pools").await?.id;
    let repo = GitRepo::new(&[("main.tf", "output \"x\" { value = 1 }\n")])?;
    let cap = stack
        .client
        .create_capsule(
            ws,
            &takosumi_client::NewCapsule {
                name: "edge-app".into(),
                source: takosumi_client::Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: ".".into(),
                tool: "terraform".into(),
                vars: Default::default(),
            },
        )
        .await?
        .id
        .to_string();
    let ws = ws.to_string();
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let name = format!("edge-{suffix}");
    let (key1, key2) = (random_public_key(), random_public_key());

    // Create (human form): the token is printed once, with the note that it is shown only now.
    let (code, out, err) = cli(
        &env,
        &[
            "pool",
            "create",
            "--workspace",
            &ws,
            &name,
            "--key-id",
            "k1",
            "--public-key",
            &key1,
        ],
        None,
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("shown only now"), "{err}");
    let token = out
        .lines()
        .find_map(|l| l.strip_prefix("token:"))
        .map(str::trim)
        .expect("a token line")
        .to_owned();
    assert_eq!(out.matches(&token).count(), 1, "{out}");
    assert!(out.contains("delivery key:     k1"), "{out}");
    let stored = takosumi_store::pools::find_by_token(&stack.ctx.pool, &token).await?;
    assert_eq!(stored.map(|p| p.name), Some(name.clone()));

    // Create with --json: the token is in the JSON.
    let other = format!("edge-json-{suffix}");
    let (code, out, err) = cli(
        &env,
        &["--json", "pool", "create", "--workspace", &ws, &other],
        None,
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    let created: Value = serde_json::from_str(&out)?;
    assert_eq!(created["name"], json!(other), "{created}");
    let json_token = created["token"].as_str().expect("token in the JSON");
    assert!(
        takosumi_store::pools::find_by_token(&stack.ctx.pool, json_token)
            .await?
            .is_some()
    );

    // Onto the pool and back.
    let pool_of = |v: Value| v["pool"].clone();
    let (code, out, err) = cli(&env, &["capsule", "set-pool", &cap, &name], None).await?;
    assert_eq!(code, 0, "{out}{err}");
    let (s, v) = stack
        .call("GET", &format!("/api/v1/capsules/{cap}"), Value::Null)
        .await?;
    assert_eq!((s, pool_of(v)), (200, json!(name)));
    let (code, out, err) = cli(&env, &["capsule", "set-pool", &cap, "--none"], None).await?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("control node"), "{out}");
    let (s, v) = stack
        .call("GET", &format!("/api/v1/capsules/{cap}"), Value::Null)
        .await?;
    assert_eq!((s, pool_of(v)), (200, Value::Null));
    let (code, out, err) = cli(&env, &["capsule", "set-pool", &cap], None).await?;
    assert_eq!(code, 2, "{out}{err}");
    let (code, out, err) = cli(&env, &["capsule", "set-pool", &cap, "no-such-pool"], None).await?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("(not_found)") && err.contains("hint:"),
        "{err}"
    );

    // Rotate.
    let (code, out, err) = cli(
        &env,
        &[
            "--json",
            "pool",
            "rotate-key",
            &name,
            "--key-id",
            "k2",
            "--public-key",
            &key2,
            "--grace-secs",
            "60",
        ],
        None,
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    let rotated: Value = serde_json::from_str(&out)?;
    assert_eq!(rotated["deliveryKeyId"], json!("k2"), "{rotated}");
    assert_eq!(rotated["previousKeyId"], json!("k1"), "{rotated}");
    assert!(rotated.get("token").is_none(), "{rotated}");

    // A bad public key: exit 1, the API's code and a hint; nothing changed.
    let (code, out, err) = cli(
        &env,
        &[
            "pool",
            "rotate-key",
            &name,
            "--key-id",
            "k3",
            "--public-key",
            "QUFBQQ==",
        ],
        None,
    )
    .await?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("(invalid_delivery_key)"), "{err}");
    assert!(err.contains("hint:") && err.contains("keygen"), "{err}");
    let pool = takosumi_store::pools::by_name(&stack.ctx.pool, &name)
        .await?
        .expect("the pool");
    assert_eq!(pool.delivery_key_id.as_deref(), Some("k2"));
    let (code, out, err) = cli(
        &env,
        &[
            "pool",
            "create",
            "--workspace",
            &ws,
            &format!("edge-bad-{suffix}"),
            "--key-id",
            "k1",
            "--public-key",
            "not base64!",
        ],
        None,
    )
    .await?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("(invalid_delivery_key)"), "{err}");
    assert!(
        takosumi_store::pools::by_name(&stack.ctx.pool, &format!("edge-bad-{suffix}"))
            .await?
            .is_none()
    );
    stack.stop().await
}
