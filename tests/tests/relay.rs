//! End-to-end: worker pools and relay workers, through the real API, RabbitMQ,
//! Postgres, the S3 server and terraform 1.0.3. The relay worker is the real
//! `takosumi-relay` binary, started as a process whose environment holds no database URL,
//! no S3 setting and no server key: only the API's URL, its pool token and its delivery
//! keys. The control node's own plan, gate and apply handlers run beside it the whole time.

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Map, Value, json};
use takosumi_client::{Capsule, NewCapsule, Source};
use takosumi_core::{ApplyMode, FailureCode, RunId, RunStatus, SandboxMode};
use takosumi_seal::delivery::DeliveryKeyPair;
use takosumi_tests::{
    GitRepo, Stack, WATCHED_CONFIG, keys_env, spawn_relay, spawn_relay_via, watched_input,
};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

const NULL_CONFIG: &str = r#"
variable "region" { type = string }
resource "null_resource" "net" {
  triggers = { region = var.region }
}
output "vpc" { value = "vpc-${var.region}" }
"#;

fn uniq(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

struct Admin<'a> {
    stack: &'a Stack,
    http: reqwest::Client,
}

impl<'a> Admin<'a> {
    fn new(stack: &'a Stack) -> Self {
        Self {
            stack,
            http: reqwest::Client::new(),
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> (u16, Value) {
        let resp = self
            .http
            .request(method, format!("{}{path}", self.stack.api_url))
            .bearer_auth(&self.stack.admin_token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Creates a pool (with the public half of `key`, if any); returns its token.
    async fn pool(&self, ws: &str, name: &str, key: Option<&DeliveryKeyPair>) -> String {
        let mut body = json!({ "name": name });
        if let Some(k) = key {
            body["deliveryKey"] =
                json!({ "keyId": k.key_id(), "publicKey": B64.encode(k.public().public) });
        }
        let (status, v) = self
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/workspaces/{ws}/pools"),
                body,
            )
            .await;
        assert_eq!(status, 201, "{v}");
        assert!(v.get("deliveryPublicKey").is_none());
        v["token"].as_str().unwrap().to_owned()
    }

    async fn rotate(&self, pool: &str, key: &DeliveryKeyPair, grace_secs: i64) -> Value {
        let (status, v) = self
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/pools/{pool}/delivery-key"),
                json!({ "keyId": key.key_id(), "publicKey": B64.encode(key.public().public), "graceSecs": grace_secs }),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v
    }

    /// Creates a credential set `name` with `env` in the Capsule's Workspace and attaches
    /// it to the Capsule; returns the binding.
    async fn credential(&self, cap: &Capsule, name: &str, env: Value) -> Value {
        let (status, b) = self
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/workspaces/{}/provider-bindings", cap.workspace_id),
                json!({ "name": name, "kind": "env", "env": env }),
            )
            .await;
        assert_eq!(status, 201, "{b}");
        let (status, v) = self
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/capsules/{}/provider-bindings", cap.id),
                json!({ "bindingId": b["id"] }),
            )
            .await;
        assert!(status < 300, "{v}");
        b
    }

    /// A new pool (prefix `prefix`) with `key`'s public half, the Capsule moved onto it;
    /// returns (pool name, pool token).
    async fn pool_for(
        &self,
        cap: &Capsule,
        prefix: &str,
        key: &DeliveryKeyPair,
    ) -> (String, String) {
        let pool = uniq(prefix);
        let token = self
            .pool(&cap.workspace_id.to_string(), &pool, Some(key))
            .await;
        self.set_pool(cap, Some(&pool)).await;
        (pool, token)
    }

    async fn set_pool(&self, cap: &Capsule, pool: Option<&str>) {
        let (status, v) = self
            .call(
                reqwest::Method::PUT,
                &format!("/api/v1/capsules/{}/pool", cap.id),
                json!({ "pool": pool }),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["pool"], json!(pool));
    }
}

async fn capsule(stack: &Stack, files: &[(&str, &str)]) -> anyhow::Result<(GitRepo, Capsule)> {
    let repo = GitRepo::new(files)?;
    let ws = stack.client.create_workspace(&uniq("ws")).await?;
    let mut vars = Map::new();
    vars.insert("region".into(), json!("eu"));
    let cap = stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "net".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra".into(),
                tool: "terraform".into(),
                vars,
            },
        )
        .await?;
    Ok((repo, cap))
}

async fn claimers(stack: &Stack, run: RunId) -> Vec<String> {
    stack
        .client
        .events(run)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "claimed")
        .map(|e| e.actor)
        .collect()
}

async fn outbox_topics(stack: &Stack) -> Vec<String> {
    sqlx::query_scalar::<_, String>("SELECT DISTINCT topic FROM outbox ORDER BY 1")
        .fetch_all(&stack.ctx.pool)
        .await
        .unwrap()
}

/// A Capsule on a pool is planned and applied by the pool's relay worker process (no
/// database or S3 settings), never by the control node's handlers running beside it: its
/// wake-ups go to `run.plan.<pool>` / `run.apply.<pool>`; the plan file the worker hands
/// back is sealed by the control node; the apply receives it sealed to the pool's delivery
/// key and hands back the state, which moves the generation 0 → 1; the next plan gets that
/// state (sealed to the pool) and proposes no change; a drift check runs there as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_worker_plans_and_applies_a_pool_capsule() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let (pool, token) = admin.pool_for(&cap, "edge", &key).await;
    // A credential: delivered sealed to the pool, injected, never shown.
    let canary = format!("relay-canary-{}", uuid::Uuid::new_v4().simple());
    admin
        .credential(&cap, "cloud", json!({ "CLOUD_SECRET": canary }))
        .await;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys_env(&[&key]), work.path())?;

    let plan = stack.client.plan(cap.id, None).await?;
    let plan = stack.wait(plan.id).await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    assert_eq!(plan.changes.map(|c| c.add), Some(1));
    assert!(
        plan.injected_env_names.contains(&"CLOUD_SECRET".to_owned()),
        "{plan:?}"
    );
    assert!(
        plan.provider_lock_digest.clone().flatten().is_some(),
        "the lockfile crossed the relay"
    );
    let by = claimers(&stack, plan.id).await;
    assert_eq!(by.len(), 1, "{by:?}");
    assert!(
        by[0].starts_with(&format!("handler:relay:{pool}:")),
        "{by:?}"
    );

    let apply = stack.client.apply(plan.id, None).await?;
    let apply = stack.wait(apply.id).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(apply.outputs, Some(json!({ "vpc": "vpc-eu" })));
    assert_eq!(apply.state_generation, Some(1));
    let by = claimers(&stack, apply.id).await;
    assert!(
        by.len() == 1 && by[0].starts_with("handler:relay:"),
        "{by:?}"
    );
    let capsule = stack.client.get_capsule(cap.id).await?;
    assert_eq!(capsule.state_generation, 1);
    assert_eq!(capsule.current_state_version_id, apply.state_version_id);

    // The next plan sees the applied state: it was delivered to the worker.
    let again = stack.client.plan(cap.id, None).await?;
    let again = stack.wait(again.id).await?;
    assert_eq!(again.status, RunStatus::Planned, "{again:?}");
    assert_eq!(
        again.changes.map(|c| (c.add, c.change, c.destroy)),
        Some((0, 0, 0))
    );
    assert_eq!(again.state_generation, Some(1));

    // A drift check runs on the pool too (its wake-up on `run.drift.<pool>`).
    let check = stack.client.drift_check(cap.id).await?;
    let check = stack.wait(check.id).await?;
    assert_eq!(check.status, RunStatus::Planned, "{check:?}");
    assert_eq!(check.drift, Some(false));
    let by = claimers(&stack, check.id).await;
    assert!(
        by.len() == 1 && by[0].starts_with("handler:relay:"),
        "{by:?}"
    );
    let (_, shown) = admin
        .call(
            reqwest::Method::GET,
            &format!("/api/v1/capsules/{}", cap.id),
            Value::Null,
        )
        .await;
    assert_eq!(shown["pool"], json!(pool));

    // The sweep's drift check of a pool's Capsule wakes the pool's queue too.
    sqlx::query(
        "UPDATE capsules SET drift_interval_secs = 60, last_drift_enqueued_at = NULL WHERE id = $1",
    )
    .bind(cap.id.as_uuid())
    .execute(&stack.ctx.pool)
    .await?;
    sqlx::query("DELETE FROM outbox WHERE topic LIKE 'run.drift%'")
        .execute(&stack.ctx.pool)
        .await?;
    assert_eq!(takosumi_sweep::sweep_once(&stack.ctx).await?, 1);
    let swept: RunId = sqlx::query_scalar::<_, uuid::Uuid>(
        "SELECT id FROM runs WHERE capsule_id = $1 AND kind = 'drift_check' ORDER BY created_at DESC LIMIT 1",
    )
    .bind(cap.id.as_uuid())
    .fetch_one(&stack.ctx.pool)
    .await
    .map(RunId::from_uuid)?;
    assert_ne!(swept, check.id);
    let swept = stack.wait(swept).await?;
    assert_eq!(swept.drift, Some(false), "{swept:?}");
    let by = claimers(&stack, swept.id).await;
    assert!(by.iter().all(|c| c.starts_with("handler:relay:")), "{by:?}");

    let topics = outbox_topics(&stack).await;
    assert!(topics.contains(&format!("run.drift.{pool}")), "{topics:?}");
    assert!(!topics.iter().any(|t| t == "run.drift"), "{topics:?}");
    assert!(topics.contains(&format!("run.plan.{pool}")), "{topics:?}");
    assert!(topics.contains(&format!("run.apply.{pool}")), "{topics:?}");
    assert!(
        !topics.iter().any(|t| t == "run.plan" || t == "run.apply"),
        "{topics:?}"
    );
    for run in [plan.id, apply.id, again.id, check.id] {
        let record = serde_json::to_string(&stack.client.get_run(run).await?)?;
        assert!(!stack.client.logs(run).await?.contains(&canary));
        assert!(!record.contains(&canary));
    }
    // The worker's private directories are gone.
    let left = takosumi_tests::leftover_run_dirs(work.path());
    assert!(left.is_empty(), "{left:?}");
    worker.kill().await?;
    stack.stop().await
}

/// A pool with no delivery key plans (nothing secret crosses), but the apply proposed from
/// that plan fails at once with `pool_has_no_delivery_key`; the tool never applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_without_a_delivery_key_cannot_run_a_gated_apply() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let pool = uniq("nokey");
    let token = admin.pool(&cap.workspace_id.to_string(), &pool, None).await;
    admin.set_pool(&cap, Some(&pool)).await;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, "", work.path())?;

    let plan = stack.client.plan(cap.id, None).await?;
    let plan = stack.wait(plan.id).await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack.client.apply(plan.id, None).await?;
    assert_eq!(apply.status, RunStatus::Failed, "failed at once: {apply:?}");
    let error = apply.error.clone().expect("error");
    assert_eq!(error.code, "pool_has_no_delivery_key");
    assert!(error.message.contains(&pool), "{}", error.message);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(stack.tool_count("apply"), 0);
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 0);
    worker.kill().await?;
    stack.stop().await
}

/// A plan file over 19 MiB does not cross the relay: a real plan that large fails
/// `plan_too_large` with its size and the limit in the message and proposes nothing; at
/// the boundary the control node takes exactly 19 MiB and refuses 19 MiB + 1 byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_over_19_mib_is_refused_at_the_relay() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let big = takosumi_tests::plan_filler(22);
    let (_repo, cap) = capsule(
        &stack,
        &[("infra/main.tf", NULL_CONFIG), ("infra/filler.tf", &big)],
    )
    .await?;
    drop(big);
    let key = DeliveryKeyPair::generate("k1")?;
    let pool = uniq("big");
    let token = admin
        .pool(&cap.workspace_id.to_string(), &pool, Some(&key))
        .await;
    admin.set_pool(&cap, Some(&pool)).await;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys_env(&[&key]), work.path())?;
    let plan = stack.client.plan(cap.id, None).await?;
    let plan = stack.wait(plan.id).await?;
    assert_eq!(plan.status, RunStatus::Failed, "{plan:?}");
    let error = plan.error.clone().expect("error");
    assert_eq!(error.code, "plan_too_large");
    assert!(
        error.message.contains("19922944-byte (19 MiB) limit"),
        "{}",
        error.message
    );
    assert!(
        error.message.contains("split the configuration"),
        "{}",
        error.message
    );
    let size: u64 = error
        .message
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .expect("the size is stated");
    assert!(size > 19 * 1024 * 1024, "{size}");
    eprintln!("measured plan file: {size} bytes");
    assert!(plan.plan_digest.is_none());
    let (status, v) = admin
        .call(
            reqwest::Method::POST,
            &format!("/api/v1/runs/{}/apply", plan.id),
            json!({}),
        )
        .await;
    assert_eq!(status, 409, "no apply is proposed from it: {v}");
    worker.kill().await?;

    // The boundary, measured by the control node itself: a worker (this test, with the
    // pool token over plain HTTP) hands over exactly 19 MiB, then 19 MiB + 1 byte.
    let http = reqwest::Client::new();
    for (extra, expect) in [(0usize, 200u16), (1, 413)] {
        let p = stack.client.plan(cap.id, None).await?;
        let job = claim(&http, &stack, &token, &["k1"]).await;
        assert_eq!(job["runId"], json!(p.id.to_string()), "{job}");
        let resp = http
            .put(format!(
                "{}/api/v1/relay/runs/{}/plan-file",
                stack.api_url, p.id
            ))
            .bearer_auth(&token)
            .header("x-takosumi-claim", job["claim"].as_str().unwrap())
            .body(vec![7u8; 19 * 1024 * 1024 + extra])
            .send()
            .await?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await?;
        assert_eq!(status, expect, "{body}");
        if expect == 413 {
            assert_eq!(body["code"], "plan_too_large");
            assert!(
                body["message"].as_str().unwrap().contains("19922945 bytes"),
                "{body}"
            );
            let r = stack.client.get_run(p.id).await?;
            assert_eq!(r.status, RunStatus::Failed);
        } else {
            // Let the claim lapse into a failure so the next claim gets the next plan.
            http.post(format!("{}/api/v1/relay/runs/{}/fail", stack.api_url, p.id))
                .bearer_auth(&token)
                .header("x-takosumi-claim", job["claim"].as_str().unwrap())
                .json(&json!({ "code": "plan_failed", "message": "test" }))
                .send()
                .await?
                .error_for_status()?;
        }
    }
    stack.stop().await
}

/// Sixteen resources whose triggers are read from an out-of-band state file: the input a
/// drift check can make arbitrarily large without the configuration changing (each value
/// stays under the provider protocol's 4 MiB message limit).
const CHUNKS_CONFIG: &str = r#"
variable "input_state" { type = string }
data "terraform_remote_state" "input" {
  backend = "local"
  config = { path = var.input_state }
}
resource "null_resource" "chunk" {
  count    = 16
  triggers = { value = data.terraform_remote_state.input.outputs.chunks[count.index] }
}
"#;

/// The input [`CHUNKS_CONFIG`] reads: sixteen strings of `len` random base64 characters.
fn chunks_input(len: usize) -> String {
    use sha2::Digest;
    let mut block = [0u8; 32];
    let chunks: Vec<String> = (0u64..16)
        .map(|c| {
            let mut raw = Vec::with_capacity(len);
            let mut i = 0u64;
            while raw.len() * 4 / 3 < len {
                block =
                    sha2::Sha256::digest([&block[..], &c.to_le_bytes(), &i.to_le_bytes()].concat())
                        .into();
                raw.extend_from_slice(&block);
                i += 1;
            }
            let mut text = B64.encode(&raw);
            text.truncate(len);
            text
        })
        .collect();
    json!({
        "version": 4, "terraform_version": "1.0.3", "serial": 1, "lineage": "takosumi-test-chunks",
        "outputs": { "chunks": { "value": chunks, "type": ["list", "string"] } }, "resources": []
    })
    .to_string()
}

/// The seed: "a drift check keeps no plan and says a reconcile cannot be proposed from it"
/// when its plan file is over the relay limit, and it still reports its drift. Applied on
/// a pool, reality moves out of band twice: the first check keeps its plan; the second,
/// whose plan is about 24 MB, reports `drift: true` with its changes, keeps no plan, drops
/// the first check's kept plan, and a reconcile from either is refused with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_relayed_drift_check_reports_drift_and_keeps_no_plan() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let dir = takosumi_tests::fixture_dir()?;
    let input = dir.path().join("chunks.tfstate");
    std::fs::write(&input, chunks_input(1))?;
    let repo = GitRepo::new(&[("infra/main.tf", CHUNKS_CONFIG)])?;
    let ws = stack.client.create_workspace(&uniq("ws")).await?;
    let cap = stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "chunks".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra".into(),
                tool: "terraform".into(),
                vars: json!({ "input_state": input.display().to_string() })
                    .as_object()
                    .cloned()
                    .unwrap(),
            },
        )
        .await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let pool = uniq("chunks");
    let token = admin.pool(&ws.id.to_string(), &pool, Some(&key)).await;
    admin.set_pool(&cap, Some(&pool)).await;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys_env(&[&key]), work.path())?;
    stack.plan_and_apply(cap.id).await?;

    std::fs::write(&input, chunks_input(2))?;
    let kept = stack
        .wait(stack.client.drift_check(cap.id).await?.id)
        .await?;
    assert_eq!(
        (kept.status, kept.drift),
        (RunStatus::Planned, Some(true)),
        "{kept:?}"
    );
    assert!(kept.plan_digest.is_some(), "a small check keeps its plan");

    std::fs::write(&input, chunks_input(1_000_000))?;
    let big = stack
        .wait(stack.client.drift_check(cap.id).await?.id)
        .await?;
    assert_eq!(
        (big.status, big.drift),
        (RunStatus::Planned, Some(true)),
        "{big:?}"
    );
    let c = big.changes.unwrap();
    assert_eq!((c.add, c.change, c.destroy), (16, 0, 16));
    assert!(big.plan_digest.is_none(), "{big:?}");
    let keys: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT plan_object_key FROM runs WHERE id = ANY($1) ORDER BY created_at",
    )
    .bind(vec![kept.id.as_uuid(), big.id.as_uuid()])
    .fetch_all(&stack.ctx.pool)
    .await?;
    assert_eq!(keys, vec![None, None], "neither check keeps a plan now");
    let events = stack.client.events(big.id).await?;
    let planned = events
        .iter()
        .find(|e| e.kind == "planned")
        .expect("planned");
    let why = planned.data["planNotKept"]
        .as_str()
        .expect("the reason is recorded");
    assert!(why.contains("19922944-byte (19 MiB) limit"), "{why}");
    assert!(why.contains("a reconcile cannot be proposed"), "{why}");
    for (check, says) in [
        (big.id, "too large to cross the relay"),
        (kept.id, "replaced it"),
    ] {
        let (status, v) = admin
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/runs/{check}/apply"),
                json!({}),
            )
            .await;
        assert_eq!(
            (status, v["code"].as_str()),
            (409, Some("no_kept_plan")),
            "{v}"
        );
        assert!(v["message"].as_str().unwrap().contains(says), "{v}");
    }
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 1);
    worker.kill().await?;
    stack.stop().await
}

async fn claim(http: &reqwest::Client, stack: &Stack, token: &str, keys: &[&str]) -> Value {
    let resp = http
        .post(format!("{}/api/v1/relay/claim", stack.api_url))
        .bearer_auth(token)
        .json(&json!({ "deliveryKeyIds": keys, "waitSecs": 10 }))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    if status != 200 {
        return json!({ "status": status, "body": body });
    }
    body["job"].clone()
}

/// Delivery-key rotation: during the grace a worker still holding only the old key gets
/// its apply sealed to that key and applies; once the grace is over, a worker holding
/// only a rotated-out key is refused with `delivery_key_expired` before anything is
/// claimed (nothing silent), a worker whose key does not open what is sealed to the
/// pool fails the Run `delivery_key_unopenable`, and a worker with the current key plans
/// on the delivered state.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rotating_the_delivery_key_keeps_a_grace_then_refuses_with_a_code() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let (k1, k2, k3) = (
        DeliveryKeyPair::generate("k1")?,
        DeliveryKeyPair::generate("k2")?,
        DeliveryKeyPair::generate("k3")?,
    );
    let pool = uniq("rot");
    let token = admin
        .pool(&cap.workspace_id.to_string(), &pool, Some(&k1))
        .await;
    admin.set_pool(&cap, Some(&pool)).await;
    let work = tempfile::tempdir()?;

    // Grace: rotated to k2, a worker with only k1 still plans and applies.
    let v = admin.rotate(&pool, &k2, 600).await;
    assert_eq!(v["deliveryKeyId"], "k2");
    assert_eq!(v["previousKeyId"], "k1");
    let mut old = spawn_relay(&stack, &token, &keys_env(&[&k1]), work.path())?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    let delivered: Vec<Value> = stack
        .client
        .events(apply.id)
        .await?
        .into_iter()
        .filter(|e| e.kind == "pin_checked")
        .map(|e| e.data)
        .collect();
    assert!(
        delivered.iter().any(|d| d["deliveredTo"] == "k1"),
        "{delivered:?}"
    );
    old.kill().await?;

    // No grace: rotated to k3 with graceSecs 0, k2 is past its grace at once.
    admin.rotate(&pool, &k3, 0).await;
    let (status, v) = admin
        .call(
            reqwest::Method::POST,
            &format!("/api/v1/pools/{pool}/delivery-key"),
            json!({ "keyId": "k3", "publicKey": B64.encode(k3.public().public) }),
        )
        .await;
    assert_eq!(
        (status, v["code"].as_str()),
        (409, Some("delivery_key_id_used")),
        "{v}"
    );
    let http = reqwest::Client::new();
    let refused = claim(&http, &stack, &token, &["k2"]).await;
    assert_eq!(refused["status"], 409, "{refused}");
    assert_eq!(refused["body"]["code"], "delivery_key_expired", "{refused}");
    let unknown = claim(&http, &stack, &token, &["k1"]).await;
    assert_eq!(unknown["body"]["code"], "delivery_key_unknown", "{unknown}");

    // A worker whose "k3" is not the pool's k3 cannot open the state sealed to it: the
    // Run fails `delivery_key_unopenable`, it never plans on nothing.
    let impostor = DeliveryKeyPair::generate("k3")?;
    let mut wrong = spawn_relay(&stack, &token, &keys_env(&[&impostor]), work.path())?;
    let failed = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(failed.status, RunStatus::Failed, "{failed:?}");
    assert_eq!(
        failed.error.and_then(|e| e.code.known()),
        Some(FailureCode::DeliveryKeyUnopenable)
    );
    wrong.kill().await?;

    let mut current = spawn_relay(&stack, &token, &keys_env(&[&k3]), work.path())?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    assert_eq!(
        plan.state_generation,
        Some(1),
        "the state was delivered and opened"
    );
    current.kill().await?;
    stack.stop().await
}

/// A worker of another pool cannot take or touch a pool's job: its claims never return
/// it, and every call on the Run answers 403 `wrong_pool` and changes nothing; an API
/// token is not a pool token (401), and a pool token is not an API token (401).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_of_another_pool_cannot_fetch_or_touch_the_job() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let ws = cap.workspace_id.to_string();
    let (ka, kb) = (
        DeliveryKeyPair::generate("a1")?,
        DeliveryKeyPair::generate("b1")?,
    );
    let (pa, pb) = (uniq("pa"), uniq("pb"));
    let token_a = admin.pool(&ws, &pa, Some(&ka)).await;
    let token_b = admin.pool(&ws, &pb, Some(&kb)).await;
    admin.set_pool(&cap, Some(&pa)).await;
    let http = reqwest::Client::new();

    let plan = stack.client.plan(cap.id, None).await?;
    let none = claim(&http, &stack, &token_b, &["b1"]).await;
    assert!(none.is_null(), "pool B got A's job: {none}");
    let job = claim(&http, &stack, &token_a, &["a1"]).await;
    assert_eq!(job["runId"], json!(plan.id.to_string()));
    let claim_a = job["claim"].as_str().unwrap().to_owned();
    for (method, what, body) in [
        (
            reqwest::Method::POST,
            "progress",
            json!({ "logs": [{ "step": "plan", "text": "injected" }] }),
        ),
        (
            reqwest::Method::POST,
            "fail",
            json!({ "code": "plan_failed", "message": "x" }),
        ),
        (reqwest::Method::POST, "planned", json!({})),
    ] {
        let resp = http
            .request(
                method,
                format!("{}/api/v1/relay/runs/{}/{what}", stack.api_url, plan.id),
            )
            .bearer_auth(&token_b)
            .header("x-takosumi-claim", &claim_a)
            .json(&body)
            .send()
            .await?;
        let status = resp.status().as_u16();
        let v: Value = resp.json().await?;
        assert_eq!(
            (status, v["code"].as_str()),
            (403, Some("wrong_pool")),
            "{what}: {v}"
        );
    }
    let run = stack.client.get_run(plan.id).await?;
    assert_eq!(run.status, RunStatus::Planning);
    assert!(stack.client.logs(plan.id).await?.is_empty());
    // Tokens do not cross over.
    let r = http
        .post(format!("{}/api/v1/relay/claim", stack.api_url))
        .bearer_auth(&stack.admin_token)
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 401);
    let r = http
        .get(format!("{}/api/v1/runs/{}", stack.api_url, plan.id))
        .bearer_auth(&token_a)
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 401);
    stack.stop().await
}

/// A cancel of a Run a relay worker is planning reaches the worker (its lease renewals
/// answer `cancelRequested`): it interrupts the tool and the Run ends `canceled` with who
/// asked, within seconds; the worker then plans the next Run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn canceling_a_relayed_plan_interrupts_the_workers_tool() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let pool = uniq("cx");
    let token = admin
        .pool(&cap.workspace_id.to_string(), &pool, Some(&key))
        .await;
    admin.set_pool(&cap, Some(&pool)).await;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys_env(&[&key]), work.path())?;
    stack.pause_plans(true)?;
    let plan = stack.client.plan(cap.id, None).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !stack.tool_invocations().iter().any(|l| l == "paused") {
        assert!(
            std::time::Instant::now() < deadline,
            "the plan never started"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, body) = admin
        .call(
            reqwest::Method::POST,
            &format!("/api/v1/runs/{}/cancel", plan.id),
            json!({}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
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
            .unwrap_or_default()
            .starts_with("user:")
    );
    stack.pause_plans(false)?;
    let next = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(next.status, RunStatus::Planned, "{next:?}");
    worker.kill().await?;
    stack.stop().await
}

/// The same on a pool: the generation a relayed plan is recorded against is the one of the
/// state its job carried (recorded when the job was delivered), not the Capsule's at the
/// report. Two workers: one holds the paused plan while the other applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relayed_plan_an_apply_overtook_keeps_the_generation_it_planned_from()
-> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let (_pool, token) = admin.pool_for(&cap, "gen", &key).await;
    let (one, two) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let mut workers = [
        spawn_relay(&stack, &token, &keys_env(&[&key]), one.path())?,
        spawn_relay(&stack, &token, &keys_env(&[&key]), two.path())?,
    ];
    let checked = stack
        .check_an_overtaken_plan_keeps_its_generation(cap.id)
        .await;
    for worker in &mut workers {
        worker.kill().await?;
    }
    checked?;
    stack.stop().await
}

/// The relay boundary, spoken to as a worker would (pool token, claim header): the claim
/// records the sandbox the worker reports; while the Run is in flight the Capsule cannot
/// move to another pool (409 `run_in_flight`); a progress report with an event kind a
/// worker may not report (`applied`, `approved`, `gate_decision`…) is refused whole (422
/// `invalid_event`, nothing stored); relayed log text is masked again with the Run's
/// credentials before it is stored, whatever the worker sent; a numbered report is stored
/// once however often it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relay_boundary_takes_only_what_a_worker_may_report() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let (pool, token) = admin.pool_for(&cap, "edge", &key).await;
    let canary = format!("boundary-canary-{}", uuid::Uuid::new_v4().simple());
    admin
        .credential(&cap, "cloud", json!({ "CLOUD_SECRET": canary }))
        .await;

    let plan = stack.client.plan(cap.id, None).await?;
    let http = reqwest::Client::new();
    let worker = |path: String, body: Value, claim: Option<String>| {
        let mut req = http
            .post(format!("{}{path}", stack.api_url))
            .bearer_auth(&token)
            .json(&body);
        if let Some(c) = claim {
            req = req.header("x-takosumi-claim", c);
        }
        async move {
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    // An unknown sandbox is refused; a known one is recorded on the claimed Run.
    let (status, v) = worker(
        "/api/v1/relay/claim".into(),
        json!({ "deliveryKeyIds": ["k1"], "waitSecs": 0, "sandbox": "docker" }),
        None,
    )
    .await;
    assert_eq!(
        (status, v["code"].as_str()),
        (422, Some("invalid_sandbox")),
        "{v}"
    );
    let message = v["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("bubblewrap, none") && !message.contains("docker"),
        "{v}"
    );
    let (status, v) = worker(
        "/api/v1/relay/claim".into(),
        json!({ "deliveryKeyIds": ["k1"], "waitSecs": 10, "sandbox": "none" }),
        None,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let job = &v["job"];
    assert_eq!(job["runId"], json!(plan.id.to_string()), "{v}");
    let claim = job["claim"].as_str().unwrap().to_owned();
    let claimed = stack.client.get_run(plan.id).await?;
    assert_eq!(claimed.status, RunStatus::Planning);
    assert_eq!(claimed.sandbox, Some(SandboxMode::None.into()));

    // In flight: the Capsule stays on its pool.
    let (status, v) = admin
        .call(
            reqwest::Method::PUT,
            &format!("/api/v1/capsules/{}/pool", cap.id),
            json!({ "pool": null }),
        )
        .await;
    assert_eq!(
        (status, v["code"].as_str()),
        (409, Some("run_in_flight")),
        "{v}"
    );
    let (_, shown) = admin
        .call(
            reqwest::Method::GET,
            &format!("/api/v1/capsules/{}", cap.id),
            Value::Null,
        )
        .await;
    assert_eq!(shown["pool"], json!(pool));

    // Event kinds only the control node records are refused, the whole report with them
    // (its log too); so is a kind that is none (still `invalid_event`, not a body that does
    // not parse).
    let progress = format!("/api/v1/relay/runs/{}/progress", plan.id);
    let refused = [
        "applied",
        "approved",
        "state_version_written",
        "gate_decision",
        "planned",
        "no_such_kind",
    ]
    .map(|kind| json!({ "kind": kind, "data": {} }));
    for event in refused {
        let (status, v) = worker(
            progress.clone(),
            json!({
                "events": [{ "kind": "tool_started", "data": { "command": "plan" } }, event],
                "logs": [{ "step": "plan", "text": "from a refused report\n" }]
            }),
            Some(claim.clone()),
        )
        .await;
        assert_eq!(
            (status, v["code"].as_str()),
            (422, Some("invalid_event")),
            "{event}: {v}"
        );
    }
    let log = stack.client.logs(plan.id).await?;
    assert!(!log.contains("from a refused report"), "{log}");
    let kinds: Vec<String> = stack
        .client
        .events(plan.id)
        .await?
        .into_iter()
        .map(|e| e.kind.to_string())
        .collect();
    assert!(
        !kinds
            .iter()
            .any(|k| k == "tool_started" || k == "applied" || k == "approved"),
        "a refused report stored events: {kinds:?}"
    );
    // A worker's own progress is taken; its log is masked again before it is stored; a NUL
    // in an event's data (a tool's output quoted) is stored as U+FFFD, as the control
    // node stores it.
    let (status, v) = worker(
        progress.clone(),
        json!({
            "events": [
                { "kind": "tool_started", "data": { "command": "plan" } },
                { "kind": "tool_started", "data": { "command": "nul\u{0}" } }
            ],
            "logs": [{ "step": "plan", "text": format!("the worker forgot to mask {canary} here\n") }]
        }),
        Some(claim.clone()),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let log = stack.client.logs(plan.id).await?;
    assert!(log.contains("the worker forgot to mask"), "{log}");
    assert!(
        !log.contains(&canary),
        "a relayed log stored the credential: {log}"
    );
    let started: Vec<Value> = stack
        .client
        .events(plan.id)
        .await?
        .into_iter()
        .filter(|e| e.kind == "tool_started")
        .map(|e| e.data)
        .collect();
    assert!(
        started.contains(&json!({ "command": "plan" }))
            && started.contains(&json!({ "command": "nul\u{FFFD}" })),
        "{started:?}"
    );

    // A numbered report is stored once: sent again (its answer lost) or after a later one
    // was stored, it is answered and not stored again. A NUL the tool printed is stored as
    // U+FFFD, not refused.
    let numbered = |seq: u64, mark: &str| {
        json!({
            "seq": seq,
            "events": [{ "kind": "tool_started", "data": { "command": mark } }],
            "logs": [{ "step": "plan", "text": format!("report {mark}\u{0} with a NUL\n") }]
        })
    };
    for (seq, mark) in [
        (1, "first"),
        (1, "first"),
        (2, "second"),
        (1, "first"),
        (2, "second"),
        (3, "third"),
    ] {
        let (status, v) = worker(progress.clone(), numbered(seq, mark), Some(claim.clone())).await;
        assert_eq!(status, 200, "report {seq}: {v}");
    }
    let commands: Vec<String> = stack
        .client
        .events(plan.id)
        .await?
        .into_iter()
        .filter(|e| e.kind == "tool_started")
        .filter_map(|e| e.data["command"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        commands,
        ["plan", "nul\u{FFFD}", "first", "second", "third"]
    );
    let log = stack.client.logs(plan.id).await?;
    for mark in ["first", "second", "third"] {
        assert_eq!(
            log.matches(&format!("report {mark}\u{FFFD} with a NUL"))
                .count(),
            1,
            "{mark}: {log}"
        );
    }
    stack.stop().await
}

const ACTING: &str = r#"
variable "region" { type = string }
data "external" "lookup" {
  program = ["sh", "-c", "echo {}"]
}
"#;

/// Kinds of a Run's events, in order, without the handler-only ones that name where it ran.
async fn event_kinds(stack: &Stack, run: RunId) -> Vec<String> {
    stack
        .client
        .events(run)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind.to_string())
        .collect()
}

/// What must be the same wherever a Run executed.
fn comparable(run: &takosumi_client::Run) -> Value {
    json!({
        "kind": run.kind,
        "status": run.status,
        "changes": run.changes,
        "drift": run.drift,
        "providerLockDigest": run.provider_lock_digest,
        "dependencySnapshot": run.dependency_snapshot,
        "stateGeneration": run.state_generation,
        "outputs": run.outputs,
        "sandbox": run.sandbox,
        "injectedEnvNames": run.injected_env_names,
        "hold": run.hold.as_ref().map(|h| json!({ "reason": h.reason, "stage": h.details["stage"], "findings": h.details["findings"] })),
        "error": run.error.as_ref().map(|e| e.code.clone()),
    })
}

/// One pipeline: the same Capsule planned, applied, drifted and drift-checked on the
/// control node and through a relay worker gives the same record (changes, lockfile and
/// dependency digests, drift from `-detailed-exitcode`, events by kind); and a plan whose
/// configuration declares an `external` data source is held by the dry-run scan before
/// `init` on both, under the same approval rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_control_node_and_a_relay_worker_keep_the_same_record() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let key = DeliveryKeyPair::generate("k1")?;
    let fixtures = takosumi_tests::fixture_dir()?;
    let work = tempfile::tempdir()?;
    let mut worker = None;
    let mut records: Vec<(Vec<Value>, Vec<Vec<String>>)> = Vec::new();
    for on_pool in [false, true] {
        let input = fixtures.path().join(if on_pool {
            "relay.tfstate"
        } else {
            "node.tfstate"
        });
        std::fs::write(&input, watched_input("a"))?;
        let repo = GitRepo::new(&[("infra/main.tf", WATCHED_CONFIG)])?;
        let ws = stack.client.create_workspace(&uniq("ws")).await?;
        let mut vars = Map::new();
        vars.insert("input_state".into(), json!(input.display().to_string()));
        let cap = stack
            .client
            .create_capsule(
                ws.id,
                &NewCapsule {
                    name: "watched".into(),
                    source: Source {
                        repo: repo.url(),
                        branch: "main".into(),
                    },
                    dir: "infra".into(),
                    tool: "terraform".into(),
                    vars,
                },
            )
            .await?;
        let (_acting_repo, acting) = capsule(&stack, &[("infra/main.tf", ACTING)]).await?;
        let (status, v) = admin
            .call(
                reqwest::Method::PUT,
                &format!("/api/v1/workspaces/{}/rules", acting.workspace_id),
                json!({ "approval": { "required": 1 }, "excludeDryRun": true }),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        if on_pool {
            for c in [&cap, &acting] {
                let pool = uniq("same");
                let token = admin
                    .pool(&c.workspace_id.to_string(), &pool, Some(&key))
                    .await;
                admin.set_pool(c, Some(&pool)).await;
                // one worker per pool (a pool belongs to one Workspace)
                worker.get_or_insert_with(Vec::new).push(spawn_relay(
                    &stack,
                    &token,
                    &keys_env(&[&key]),
                    work.path(),
                )?);
            }
        }
        let plan = stack
            .wait(stack.client.plan(cap.id, None).await?.id)
            .await?;
        assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
        let apply = stack
            .wait(stack.client.apply(plan.id, None).await?.id)
            .await?;
        assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
        let clean = stack
            .wait(stack.client.drift_check(cap.id).await?.id)
            .await?;
        assert_eq!(clean.drift, Some(false), "{clean:?}");
        std::fs::write(&input, watched_input("b"))?;
        let drifted = stack
            .wait(stack.client.drift_check(cap.id).await?.id)
            .await?;
        assert_eq!(drifted.drift, Some(true), "{drifted:?}");
        let held = stack
            .wait(stack.client.plan(acting.id, None).await?.id)
            .await?;
        assert_eq!(held.status, RunStatus::Held, "{held:?}");
        let runs = [&plan, &apply, &clean, &drifted, &held];
        let mut kinds = Vec::new();
        for r in runs {
            kinds.push(event_kinds(&stack, r.id).await);
        }
        // Every drift check asked the tool with -detailed-exitcode, wherever it ran.
        for check in [&clean, &drifted] {
            let started = stack.client.events(check.id).await?;
            let plan_started = started
                .iter()
                .find(|e| e.kind == "tool_started" && e.data["command"] == json!("plan"))
                .expect("the plan started");
            assert_eq!(
                plan_started.data["detailedExitcode"],
                json!(true),
                "on_pool={on_pool}"
            );
        }
        // The held dry run ran neither init nor plan.
        let held_events = stack.client.events(held.id).await?;
        assert!(
            !held_events
                .iter()
                .any(|e| e.kind == "tool_started" && e.data["command"] != json!("get")),
            "on_pool={on_pool}: {:?}",
            kinds.last()
        );
        records.push((runs.iter().map(|r| comparable(r)).collect(), kinds));
    }
    assert_eq!(
        records[0].0, records[1].0,
        "the records differ between the hosts"
    );
    assert_eq!(
        records[0].1, records[1].1,
        "the events differ between the hosts"
    );
    for mut w in worker.unwrap_or_default() {
        w.kill().await?;
    }
    stack.stop().await
}

/// A credential set that no longer opens (its sealed value altered at rest): the Run fails
/// `credential_failed` on a pool exactly as on the control node, naming the binding, never
/// a 500 to the worker and never a value.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unopenable_credential_fails_the_same_on_a_pool_as_on_the_control_node()
-> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let mut failed = Vec::new();
    for on_pool in [false, true] {
        let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
        let (status, b) = admin
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/workspaces/{}/provider-bindings", cap.workspace_id),
                json!({ "name": "cloud", "kind": "env", "env": { "CLOUD_SECRET": "broken-binding-value" } }),
            )
            .await;
        assert_eq!(status, 201, "{b}");
        let (status, v) = admin
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/capsules/{}/provider-bindings", cap.id),
                json!({ "bindingId": b["id"] }),
            )
            .await;
        assert!(status < 300, "{v}");
        let id: takosumi_core::ProviderBindingId = b["id"].as_str().unwrap().parse()?;
        sqlx::query("UPDATE provider_bindings SET sealed = $2 WHERE id = $1")
            .bind(id.as_uuid())
            .bind(b"not a sealed credential".to_vec())
            .execute(&stack.ctx.pool)
            .await?;
        let mut token = None;
        if on_pool {
            let key = DeliveryKeyPair::generate("k1")?;
            let pool = uniq("broken");
            token = Some(
                admin
                    .pool(&cap.workspace_id.to_string(), &pool, Some(&key))
                    .await,
            );
            admin.set_pool(&cap, Some(&pool)).await;
        }
        let plan = stack.client.plan(cap.id, None).await?;
        if let Some(token) = token {
            let resp = reqwest::Client::new()
                .post(format!("{}/api/v1/relay/claim", stack.api_url))
                .bearer_auth(&token)
                .json(&json!({ "deliveryKeyIds": ["k1"], "waitSecs": 5 }))
                .send()
                .await?;
            assert_eq!(
                resp.status().as_u16(),
                200,
                "a broken binding is not our fault"
            );
        }
        let done = stack.wait(plan.id).await?;
        assert_eq!(
            done.status,
            RunStatus::Failed,
            "on_pool={on_pool}: {done:?}"
        );
        let error = done.error.clone().expect("an error");
        assert_eq!(
            error.code, "credential_failed",
            "on_pool={on_pool}: {error:?}"
        );
        assert!(error.message.contains("\"cloud\""), "{error:?}");
        assert!(
            !error.message.contains("broken-binding"),
            "a value in the message: {error:?}"
        );
        failed.push(error.message);
    }
    // The same words on both hosts, but for the binding's id.
    let without_id = |m: &str| {
        let (head, rest) = m.split_once("(pb_").unwrap_or((m, ""));
        format!(
            "{head}{}",
            rest.split_once(')').map_or("", |(_, tail)| tail)
        )
    };
    assert_eq!(without_id(&failed[0]), without_id(&failed[1]));
    stack.stop().await
}

/// Command credentials work on relay workers too: the command runs on the
/// worker, inside the sandbox, for every run — resolved afresh for the apply — and its
/// value reaches the tool masked, as on the control node; the Run records its name only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_command_credential_runs_on_the_relay_worker() -> anyhow::Result<()> {
    use sha2::Digest;
    let sha = |t: &str| hex::encode(sha2::Sha256::digest(t.as_bytes()));
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let dir = takosumi_tests::fixture_dir()?;
    let cred_file = dir.path().join("cmd-cred");
    let (first, second) = (
        format!("cmd-a-{}", uuid::Uuid::new_v4().simple()),
        format!("cmd-b-{}", uuid::Uuid::new_v4().simple()),
    );
    std::fs::write(&cred_file, format!("{first}\n"))?;
    let config = r#"
resource "null_resource" "probe" {
  provisioner "local-exec" {
    command = "echo cmd=$CMD_CRED; echo cmd-sha=$(printf %s \"$CMD_CRED\" | sha256sum | cut -c1-64)"
  }
}
"#;
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", config)]).await?;
    let binding = stack
        .client
        .create_provider_binding(
            cap.workspace_id,
            &takosumi_client::NewProviderBinding::Command {
                name: "vault".into(),
                command: vec!["/bin/cat".into(), cred_file.display().to_string()],
                env_name: "CMD_CRED".into(),
            },
        )
        .await?;
    stack
        .client
        .attach_provider_binding(cap.id, binding.id)
        .await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let pool = uniq("cmd");
    let token = admin
        .pool(&cap.workspace_id.to_string(), &pool, Some(&key))
        .await;
    admin.set_pool(&cap, Some(&pool)).await;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys_env(&[&key]), work.path())?;

    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    assert!(plan.injected_env_names.iter().any(|n| n == "CMD_CRED"));
    // Resolved afresh for the apply.
    std::fs::write(&cred_file, format!("{second}\n"))?;
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    let by = claimers(&stack, apply.id).await;
    assert!(
        !by.is_empty() && by.iter().all(|c| c.starts_with("handler:relay:")),
        "{by:?}"
    );
    let log = stack.client.logs(apply.id).await?;
    assert!(log.contains(&format!("cmd-sha={}", sha(&second))), "{log}");
    assert!(log.contains("cmd=***"), "the value is masked: {log}");
    for (what, text) in [
        ("plan log", stack.client.logs(plan.id).await?),
        ("apply log", log.clone()),
        ("apply", serde_json::to_string(&apply)?),
        (
            "events",
            serde_json::to_string(&stack.client.events(apply.id).await?)?,
        ),
    ] {
        assert!(
            !text.contains(&first) && !text.contains(&second),
            "{what} holds the command's value: {text}"
        );
    }
    worker.kill().await?;
    stack.stop().await
}

/// The one-step apply runs on relay workers too: an apply no rule covers, of a
/// pool's Capsule, is one Apply Run with no plan Run that the worker carries out with
/// `apply -auto-approve` through the same pipeline as the control node (no `plan` run, the
/// record saying `applyMode: "one_step"` with what was applied); its state is handed back,
/// sealed and recorded by the control node, and the next plan sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_one_step_apply_runs_on_the_relay_worker() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let pool = uniq("onestep");
    let token = admin
        .pool(&cap.workspace_id.to_string(), &pool, Some(&key))
        .await;
    admin.set_pool(&cap, Some(&pool)).await;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay(&stack, &token, &keys_env(&[&key]), work.path())?;
    let plans = stack.tool_count("plan");
    let (status, v) = admin
        .call(
            reqwest::Method::POST,
            &format!("/api/v1/capsules/{}/apply", cap.id),
            json!({}),
        )
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["kind"], json!("apply"), "{v}");
    assert!(v["planRunId"].is_null(), "{v}");
    let apply = stack.wait(v["id"].as_str().unwrap().parse()?).await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    assert_eq!(apply.apply_mode, Some(ApplyMode::OneStep), "{apply:?}");
    assert!(apply.source_snapshot.is_some(), "{apply:?}");
    assert!(apply.state_version_id.is_some(), "{apply:?}");
    let by = claimers(&stack, apply.id).await;
    assert!(
        !by.is_empty() && by.iter().all(|c| c.starts_with("handler:relay:")),
        "{by:?}"
    );
    assert_eq!(stack.tool_count("plan"), plans, "nothing was planned first");
    let events = stack.client.events(apply.id).await?;
    assert!(
        events.iter().any(|e| e.kind == "tool_started"
            && e.data["command"] == "apply"
            && e.data["oneStep"] == true),
        "{events:?}"
    );
    let capsule = stack.client.get_capsule(cap.id).await?;
    assert_eq!(capsule.state_generation, 1);
    assert_eq!(capsule.current_state_version_id, apply.state_version_id);
    let again = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(
        again.changes.map(|c| (c.add, c.change, c.destroy)),
        Some((0, 0, 0)),
        "the next plan sees the handed-back state: {again:?}"
    );
    worker.kill().await?;
    stack.stop().await
}

/// A relay worker holds no control-plane secret, however it would be given: each one set
/// directly or as a `_FILE` stops the worker before it does anything.
#[tokio::test]
async fn a_relay_worker_refuses_control_plane_secrets_in_any_form() -> anyhow::Result<()> {
    let bin = takosumi_tests::binary("takosumi-relay")?;
    for name in [
        "TAKOSUMI_DATABASE_URL",
        "TAKOSUMI_DATABASE_URL_FILE",
        "TAKOSUMI_AMQP_URL_FILE",
        "TAKOSUMI_S3_SECRET_KEY_FILE",
        "TAKOSUMI_SEAL_KEY_FILE",
        "TAKOSUMI_EVIDENCE_KEY_FILE",
    ] {
        let out = tokio::process::Command::new(&bin)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("TAKOSUMI_DEPLOY_CONTROL_URL", "http://127.0.0.1:9")
            .env("TAKOSUMI_POOL_TOKEN", "pool-token-canary")
            .env(name, "/dev/null")
            .output()
            .await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: the worker started");
        assert!(
            stderr.contains(&format!(
                "{name} is set: a relay worker talks only to the API"
            )),
            "{name}: {stderr}"
        );
        assert!(!stderr.contains("pool-token-canary"), "{stderr}");
    }
    Ok(())
}

/// A worker pool's queues have dead-letter queues of their own (`run.plan.<pool>.dead`):
/// what lands there is collected into Postgres and listed under the pool's queue like a
/// step queue's, for a pool created after the API started.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pools_dead_letters_are_collected_and_listed() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let pool = uniq("dead");
    admin.pool(&cap.workspace_id.to_string(), &pool, None).await;
    let queue = format!("run.plan.{pool}");
    stack
        .ctx
        .bus
        .get()
        .await?
        .publish_dead(&queue, br#"{"poison": true}"#, "refused by the test")
        .await?;

    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let listed = loop {
        let (status, listing) = admin
            .call(
                reqwest::Method::GET,
                "/api/v1/dead-letters?limit=5",
                Value::Null,
            )
            .await;
        assert_eq!(status, 200, "{listing}");
        let of_pool = listing["queues"]
            .as_array()
            .and_then(|qs| qs.iter().find(|q| q["queue"] == queue.as_str()))
            .cloned()
            .unwrap_or(Value::Null);
        if of_pool["depth"] == 1 || std::time::Instant::now() > deadline {
            break of_pool;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(listed["depth"], 1, "collected into Postgres: {listed}");
    assert_eq!(
        listed["deadLetterQueue"],
        format!("{queue}.dead"),
        "{listed}"
    );
    assert_eq!(
        listed["uncollected"], 0,
        "nothing left in the broker: {listed}"
    );
    let message = &listed["messages"][0];
    assert_eq!(message["body"], r#"{"poison": true}"#, "{listed}");
    assert_eq!(message["error"], "refused by the test", "{listed}");
    assert_eq!(stack.uncollected_dead_letters().await?, 0);
    stack.stop().await
}

/// A pool Capsule with a relay worker running, and its first plan, planned on the worker.
struct PlannedOnPool {
    _repo: GitRepo,
    _work: tempfile::TempDir,
    capsule: Capsule,
    plan: takosumi_client::Run,
    worker: tokio::process::Child,
}

impl PlannedOnPool {
    async fn start(stack: &Stack, pool: &str) -> anyhow::Result<Self> {
        let admin = Admin::new(stack);
        let (repo, capsule) = capsule(stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
        let key = DeliveryKeyPair::generate("k1")?;
        let (_pool, token) = admin.pool_for(&capsule, pool, &key).await;
        let work = tempfile::tempdir()?;
        let worker = spawn_relay(stack, &token, &keys_env(&[&key]), work.path())?;
        let plan = stack
            .wait(stack.client.plan(capsule.id, None).await?.id)
            .await?;
        anyhow::ensure!(plan.status == RunStatus::Planned, "{plan:?}");
        Ok(Self {
            _repo: repo,
            _work: work,
            capsule,
            plan,
            worker,
        })
    }
}

/// A relay worker's apply whose new state object storage will not take ends exactly as
/// the control node's does (one implementation, `takosumi_runtime::unrecorded`): the
/// store is retried, the state is kept sealed in Postgres, the apply ends
/// `unknown_outcome`, and the Capsule refuses applies until an operator resolves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_workers_unstored_state_is_held_like_the_control_nodes() -> anyhow::Result<()> {
    let s3 = tokio::task::spawn_blocking(takosumi_tests::services::PrivateS3::start).await??;
    let stack = Stack::start_on(
        takosumi_tests::Options::default(),
        &takosumi_tests::Endpoints {
            s3_endpoint: Some(s3.endpoint()),
            ..takosumi_tests::Endpoints::default()
        },
    )
    .await?;
    let mut on_pool = PlannedOnPool::start(&stack, "held").await?;
    let (cap, plan) = (on_pool.capsule.clone(), on_pool.plan.clone());

    // Object storage refuses every new state from here on.
    let blocker = s3.data_dir().join(&stack.settings.s3_bucket).join("states");
    std::fs::write(&blocker, b"not a directory")?;
    let apply = stack.client.apply(plan.id, None).await?.id;
    let deadline = std::time::Instant::now() + Duration::from_secs(150);
    let apply = loop {
        let run = stack.client.get_run(apply).await?;
        if run.status.is_terminal() {
            break run;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the apply never ended: {run:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(apply.status, RunStatus::UnknownOutcome, "{apply:?}");
    let error = apply.error.clone().unwrap_or_else(|| unreachable!());
    assert!(
        error.message.contains("kept sealed in the database"),
        "{}",
        error.message
    );
    let by = claimers(&stack, apply.id).await;
    assert!(by.iter().all(|b| b.starts_with("handler:relay:")), "{by:?}");
    let events = event_kinds(&stack, apply.id).await;
    assert!(
        events.iter().any(|e| e == "state_store_retrying")
            && events.iter().any(|e| e == "unknown_outcome"),
        "{events:?}"
    );
    let held = takosumi_store::states::held::held_for_run(&stack.ctx.pool, apply.id).await?;
    assert_eq!(held.len(), 1, "the worker's state is held");
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 0);
    // the Capsule waits for an operator
    let next = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    match stack.client.apply(next.id, None).await {
        Err(takosumi_client::ClientError::Api { code, .. }) => {
            assert_eq!(code, takosumi_client::ErrorCode::CapsuleNeedsInspection);
        }
        other => panic!("an apply beside an unknown outcome: {other:?}"),
    }
    std::fs::remove_file(&blocker)?;
    on_pool.worker.kill().await?;
    stack.stop().await?;
    drop(s3);
    Ok(())
}

/// A digest-only (`unknown`) lockfile record is refused on a pool exactly as on the control
/// node (one decision, `Ctx::planned_lockfile`): the apply fails `lockfile_mismatch` when
/// the relay prepares its job, and the worker's tool never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_legacy_lockfile_record_is_refused_on_a_pool_as_on_the_control_node() -> anyhow::Result<()>
{
    let stack = Stack::start().await?;
    let mut on_pool = PlannedOnPool::start(&stack, "legacy").await?;
    let (cap, plan) = (on_pool.capsule.clone(), on_pool.plan.clone());
    assert!(plan.provider_lock_digest.clone().flatten().is_some());
    sqlx::query(
        "UPDATE runs SET provider_lock_state = 'unknown', lockfile_object_key = NULL WHERE id = $1",
    )
    .bind(plan.id.as_uuid())
    .execute(&stack.ctx.pool)
    .await?;
    let (inits, applies) = (stack.tool_count("init"), stack.tool_count("apply"));
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Failed, "{apply:?}");
    let error = apply.error.clone().unwrap_or_else(|| unreachable!());
    assert_eq!(error.code, "lockfile_mismatch", "{error:?}");
    assert!(error.message.contains("older runner"), "{}", error.message);
    assert_eq!(
        (stack.tool_count("init"), stack.tool_count("apply")),
        (inits, applies),
        "nothing ran on the worker"
    );
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 0);
    on_pool.worker.kill().await?;
    stack.stop().await
}

/// A TCP gateway between a relay worker and the API that the test takes away, with every
/// connection through it, and brings back on the same port: an API restart as the worker
/// sees it.
struct Gateway {
    addr: std::net::SocketAddr,
    upstream: std::net::SocketAddr,
    serving: Option<tokio::task::JoinHandle<()>>,
}

impl Gateway {
    async fn start(upstream: std::net::SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let mut gateway = Self {
            addr: listener.local_addr()?,
            upstream,
            serving: None,
        };
        gateway.serve(listener);
        Ok(gateway)
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let upstream = self.upstream;
        self.serving = Some(tokio::spawn(async move {
            // Dropped with this task: every connection through the gateway ends with it.
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                connections.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
    }

    fn down(&mut self) {
        if let Some(serving) = self.serving.take() {
            serving.abort();
        }
    }

    async fn up(&mut self) -> anyhow::Result<()> {
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        self.serve(listener);
        Ok(())
    }
}

/// A relay worker whose apply ends while the API does not answer hands its result in once
/// the API is back (within the claim's lease), instead of leaving a finished apply to end
/// `unknown_outcome` with its new state lost; the progress it could not send meanwhile (the
/// apply's log) goes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_apply_report_the_api_missed_is_sent_again() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let slow = r#"
resource "null_resource" "slow" {
  provisioner "local-exec" { command = "sleep 3" }
}
output "done" { value = "yes" }
"#;
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", slow)]).await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let (_pool, token) = admin.pool_for(&cap, "again", &key).await;
    let upstream = stack.api_url.trim_start_matches("http://").parse()?;
    let mut gateway = Gateway::start(upstream).await?;
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay_via(
        &stack,
        &format!("http://{}", gateway.addr),
        &token,
        &keys_env(&[&key]),
        work.path(),
    )?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    anyhow::ensure!(plan.status == RunStatus::Planned, "{plan:?}");

    let apply = stack.client.apply(plan.id, None).await?.id;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    // Once the tool's apply runs, the worker needs nothing more of the API but the report.
    let applying = |e: &takosumi_client::RunEvent| {
        e.kind.as_str() == "tool_started" && e.data["command"] == "apply"
    };
    while !stack.client.events(apply).await?.iter().any(applying) {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the apply never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The tool sleeps 3 s; the API is away until well after it ended.
    gateway.down();
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        stack.client.get_run(apply).await?.status,
        RunStatus::Applying,
        "nothing reached the API meanwhile"
    );
    gateway.up().await?;
    let done = stack.wait(apply).await?;
    assert_eq!(done.status, RunStatus::Applied, "{done:?}");
    assert_eq!(stack.client.get_capsule(cap.id).await?.state_generation, 1);
    // The progress the worker could not send while the API was away (the apply's output)
    // was sent before the report, not dropped.
    let log = stack.client.logs(apply).await?;
    assert!(log.contains("Apply complete!"), "{log}");
    worker.kill().await?;
    stack.stop().await?;
    Ok(())
}

/// A progress report the API stored but whose answer the worker never saw (the connection
/// dropped with the answer on its way) is sent again with its number and stored once: the
/// relayed plan's record has each event and each command's output exactly once, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn progress_whose_answer_was_lost_is_sent_again_and_stored_once() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let admin = Admin::new(&stack);
    let (_repo, cap) = capsule(&stack, &[("infra/main.tf", NULL_CONFIG)]).await?;
    let key = DeliveryKeyPair::generate("k1")?;
    let (_pool, token) = admin.pool_for(&cap, "lossy", &key).await;
    let gateway = LossyGateway::start(stack.api_url.trim_start_matches("http://").parse()?).await?;
    // The answers to the plan's first three numbered reports never reach the worker.
    gateway.lose_numbered(3);
    let work = tempfile::tempdir()?;
    let mut worker = spawn_relay_via(
        &stack,
        &format!("http://{}", gateway.addr),
        &token,
        &keys_env(&[&key]),
        work.path(),
    )?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    assert_eq!(
        gateway.still_to_lose(),
        0,
        "fewer than three answers were lost"
    );

    let events = stack.client.events(plan.id).await?;
    let commands: Vec<&str> = events
        .iter()
        .filter(|e| e.kind == "tool_started")
        .filter_map(|e| e.data["command"].as_str())
        .collect();
    assert_eq!(commands, ["init", "plan"], "{events:?}");
    for (i, a) in events.iter().enumerate() {
        assert!(
            !events[i + 1..]
                .iter()
                .any(|b| b.kind == a.kind && b.data == a.data),
            "recorded twice: {} {}",
            a.kind,
            a.data
        );
    }
    let kinds = event_kinds(&stack, plan.id).await;
    for kind in ["checkout_started", "checked_out", "dry_run_scan", "planned"] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} missing: {kinds:?}");
    }
    let log = stack.client.logs(plan.id).await?;
    assert_eq!(
        log.matches("Terraform has been successfully initialized")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(
        log.matches("null_resource.net will be created").count(),
        1,
        "{log}"
    );
    worker.kill().await?;
    stack.stop().await?;
    Ok(())
}

/// A TCP gateway between a relay worker and the API that drops the API's answer to the
/// next numbered progress reports (requests whose body carries `"seq":`) it is told to,
/// with the connection: the request was served, the worker sees a connection cut before
/// any answer. Everything else passes through.
struct LossyGateway {
    addr: std::net::SocketAddr,
    to_lose: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _serving: tokio::task::JoinHandle<()>,
}

impl LossyGateway {
    async fn start(upstream: std::net::SocketAddr) -> anyhow::Result<Self> {
        use std::sync::atomic::Ordering::SeqCst;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let to_lose = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = to_lose.clone();
        let serving = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let to_lose = count.clone();
                connections.spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut from_worker, mut to_worker) = inbound.into_split();
                    let (mut from_api, mut to_api) = outbound.into_split();
                    // Whether the request in flight on this connection is a numbered report.
                    let numbered = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                    let seen = numbered.clone();
                    let up = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        while let Ok(n @ 1..) = from_worker.read(&mut buf).await {
                            let chunk = &buf[..n];
                            if [&b"POST "[..], b"GET ", b"PUT ", b"DELETE "]
                                .iter()
                                .any(|m| chunk.starts_with(m))
                            {
                                seen.store(false, SeqCst);
                            }
                            if chunk.windows(6).any(|w| w == b"\"seq\":") {
                                seen.store(true, SeqCst);
                            }
                            if to_api.write_all(chunk).await.is_err() {
                                break;
                            }
                        }
                    };
                    let down = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        while let Ok(n @ 1..) = from_api.read(&mut buf).await {
                            if numbered.load(SeqCst)
                                && to_lose
                                    .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                                    .is_ok()
                            {
                                break;
                            }
                            if to_worker.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    };
                    // Either direction ending drops both: the worker's connection is cut.
                    tokio::select! {
                        () = up => {}
                        () = down => {}
                    }
                });
            }
        });
        Ok(Self {
            addr,
            to_lose,
            _serving: serving,
        })
    }

    /// Drops the answers to the next `n` numbered reports.
    fn lose_numbered(&self, n: usize) {
        self.to_lose.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many of those answers are still to be dropped.
    fn still_to_lose(&self) -> usize {
        self.to_lose.load(std::sync::atomic::Ordering::SeqCst)
    }
}
