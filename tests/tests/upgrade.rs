//! Schema upgrades: a database made by the previous release's migrations and
//! holding the previous release's data is migrated to this release, and the pipeline works
//! on it.
//!
//! What "the previous release" is here:
//! - **Schema**: the embedded migrations (`infra/migrations`, the bytes the server runs) up
//!   to and including [`PREVIOUS_RELEASE_LAST_MIGRATION`]. sqlx checks every applied
//!   migration's checksum when the rest run, so a released migration edited afterwards
//!   fails this test.
//! - **Data**: the previous release's binaries are not built here, so its rows are written
//!   directly, shaped like the rows a real plan → apply left behind (copied from such a run):
//!   a Workspace, a Capsule of a local Git repository holding the `network` example, Runs in
//!   several statuses (a planned plan and the apply that applied it with its StateVersion, a
//!   failed plan, a canceled plan, and a plan still queued whose outbox wake-up was never
//!   sent), their events, sent and unsent outbox rows, activity (a Workspace's and an
//!   instance-wide one), API tokens (live, revoked, expired). Each row is inserted naming
//!   only the columns it sets (`jsonb_populate_record`), so a fixture column that the old
//!   schema lacks fails the insert. The StateVersion's object is a terraform 1.0.3 state
//!   sealed with the server key, as the apply step stores it. The evidence statements are
//!   signed by `takosumi_store::evidence::write_pending` (which reads only tables the
//!   previous release's schema has, as a writer started before the migrations must), run on
//!   the old schema before the upgrade.
//!
//! After the remaining migrations the stack starts on that database and bucket: the old
//! Runs read back through the API (one by one and as the Workspace's history), the old
//! queued plan's unsent wake-up is relayed and planned against the old state, the old
//! Capsule plans and applies again (generation 1 → 2, the new state continues the old
//! state's lineage), the old tokens authenticate (or stay refused), and the evidence chain
//! — old statements and new ones — verifies.

use std::borrow::Cow;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::migrate::{Migration, Migrator};
use takosumi_core::{CapsuleId, RunId, RunStatus, Secret, StateVersionId, TokenId, WorkspaceId};
use takosumi_objects::ObjectStore;
use takosumi_seal::{Purpose, Sealer};
use takosumi_store::Pool;
use takosumi_tests::{Endpoints, GitRepo, Options, Stack};

/// The version of the last migration the previous release shipped (release `a2068cd`:
/// `20261201002000_token_admin.sql`). Bump it to the newest migration at each release, so
/// this test always upgrades from what is deployed.
const PREVIOUS_RELEASE_LAST_MIGRATION: i64 = 20261201002000;

fn env(name: &str) -> anyhow::Result<String> {
    std::env::var(name).map_err(|_| {
        anyhow::anyhow!("{name} is not set: run the tests through infra/local/test.sh")
    })
}

fn replace_db(url: &str, db: &str) -> String {
    match url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{db}"),
        None => url.to_owned(),
    }
}

/// Inserts one row into `table`, setting only the columns `row` names (the others keep
/// their defaults); Postgres converts each JSON value to its column's type.
async fn insert(pool: &Pool, table: &str, row: Value) -> anyhow::Result<()> {
    let cols: Vec<String> = row
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("a row is a JSON object"))?
        .keys()
        .cloned()
        .collect();
    let list = cols.join(", ");
    sqlx::query(&format!(
        "INSERT INTO {table} ({list}) SELECT {list} FROM jsonb_populate_record(NULL::{table}, $1)"
    ))
    .bind(&row)
    .execute(pool)
    .await
    .map_err(|e| anyhow::anyhow!("inserting into {table} {row}: {e}"))?;
    Ok(())
}

/// `now() - secs` as a timestamptz literal.
async fn ago(pool: &Pool, secs: i64) -> anyhow::Result<String> {
    Ok(
        sqlx::query_scalar("SELECT (now() - make_interval(secs => $1::double precision))::text")
            .bind(secs as f64)
            .fetch_one(pool)
            .await?,
    )
}

async fn applied_versions(pool: &Pool) -> anyhow::Result<Vec<i64>> {
    Ok(
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(pool)
            .await?,
    )
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// The ids of what the previous release left behind.
struct OldData {
    workspace: WorkspaceId,
    capsule: CapsuleId,
    planned: RunId,
    applied: RunId,
    failed: RunId,
    canceled: RunId,
    queued: RunId,
    state_version: StateVersionId,
    lineage: String,
    operator_token: String,
    revoked_token: String,
    expired_token: String,
}

const STATE_LINEAGE: &str = "b7e3f0a4-5c1d-4e8f-9a2b-6d0c1e2f3a4b";

/// A terraform 1.0.3 state of the `network` example applied with `region = "eu"`.
fn old_state() -> Vec<u8> {
    json!({
        "version": 4, "terraform_version": "1.0.3", "serial": 1, "lineage": STATE_LINEAGE,
        "outputs": { "vpc": { "value": "vpc-eu", "type": "string" } },
        "resources": []
    })
    .to_string()
    .into_bytes()
}

/// Writes the previous release's rows (see the module comment).
#[allow(clippy::too_many_lines)]
async fn write_old_data(
    pool: &Pool,
    repo: &GitRepo,
    commit: &str,
    state_digest: &str,
    state_size: usize,
) -> anyhow::Result<OldData> {
    let ws = WorkspaceId::new();
    let cap = CapsuleId::new();
    let (planned, applied, failed, canceled, queued) = (
        RunId::new(),
        RunId::new(),
        RunId::new(),
        RunId::new(),
        RunId::new(),
    );
    let sv = StateVersionId::new();
    let operator = TokenId::new();
    let actor = format!("user:{operator}");
    let token = |name: &str| {
        format!(
            "tks_{name}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        )
    };
    let (operator_token, revoked_token, expired_token) =
        (token("prevop"), token("prevrev"), token("prevexp"));
    let hash = |t: &str| format!("\\x{}", sha256_hex(t.as_bytes()));
    let t = |secs: i64| ago(pool, secs);
    let plan_digest = sha256_hex(b"previous release plan");
    let tree_digest = sha256_hex(b"previous release tree");
    let deps = sha256_hex(b"previous release dependencies");
    let tool_version = json!({
        "path": "/usr/local/bin/terraform", "platform": "linux_amd64",
        "provider_selections": {}, "terraform_outdated": false, "terraform_version": "1.0.3"
    });
    let scan = json!({
        "clean": true, "findings": [], "modulesRead": [], "unreadable": [],
        "modulesDigest": sha256_hex(b"")
    });

    insert(
        pool,
        "workspaces",
        json!({ "id": ws.as_uuid(), "name": format!("ws-prev-{}", &ws.to_string()[3..11]), "created_at": t(7200).await? }),
    )
    .await?;
    for (id, name, role, extra) in [
        (operator, "previous-operator", "operator", json!({})),
        (
            TokenId::new(),
            "previous-revoked",
            "viewer",
            json!({ "revoked_at": t(3000).await?, "revoked_by": "user:bootstrap" }),
        ),
        (
            TokenId::new(),
            "previous-expired",
            "viewer",
            json!({ "expires_at": t(60).await? }),
        ),
    ] {
        let value = match name {
            "previous-operator" => &operator_token,
            "previous-revoked" => &revoked_token,
            _ => &expired_token,
        };
        let mut row = json!({
            "id": id.as_uuid(), "token_hash": hash(value), "name": name, "role": role,
            "created_at": t(7100).await?, "created_by": "user:bootstrap"
        });
        row.as_object_mut()
            .expect("object")
            .extend(extra.as_object().cloned().unwrap_or_default());
        insert(pool, "api_tokens", row).await?;
        insert(
            pool,
            "activity",
            json!({ "workspace_id": null, "kind": "token_created", "subject": id.to_string(),
                    "actor": "user:bootstrap", "data": { "name": name, "role": role }, "at": t(7100).await? }),
        )
        .await?;
    }
    insert(
        pool,
        "capsules",
        json!({
            "id": cap.as_uuid(), "workspace_id": ws.as_uuid(), "name": "network",
            "repo": repo.url(), "branch": "main", "dir": "infra/network", "tool": "terraform",
            "vars": { "region": "eu" }, "state_generation": 1,
            "current_state_version_id": sv.as_uuid(), "sensitive_var_names": [],
            "created_at": t(7000).await?, "updated_at": t(5000).await?
        }),
    )
    .await?;
    for (kind, subject, data, at) in [
        (
            "workspace_created",
            ws.to_string(),
            json!({ "name": "ws-prev" }),
            7200,
        ),
        (
            "capsule_registered",
            cap.to_string(),
            json!({ "name": "network", "repo": repo.url(), "branch": "main", "dir": "infra/network" }),
            7000,
        ),
        (
            "run_started",
            planned.to_string(),
            json!({ "capsuleId": cap.to_string(), "kind": "plan" }),
            6000,
        ),
        (
            "run_started",
            applied.to_string(),
            json!({ "kind": "apply", "planRunId": planned.to_string() }),
            5500,
        ),
        (
            "state_version_written",
            sv.to_string(),
            json!({ "capsuleId": cap.to_string(), "generation": 1, "runId": applied.to_string() }),
            5000,
        ),
    ] {
        insert(
            pool,
            "activity",
            json!({ "workspace_id": ws.as_uuid(), "kind": kind, "subject": subject,
                    "actor": actor, "data": data, "at": t(at).await? }),
        )
        .await?;
    }

    let base = json!({
        "workspace_id": ws.as_uuid(), "capsule_id": cap.as_uuid(), "actor_kind": "user",
        "actor_id": operator.to_string(), "var_names": ["region"], "sandbox": "bubblewrap",
    });
    let run = |fields: Value| {
        let mut row = base.clone();
        row.as_object_mut()
            .expect("object")
            .extend(fields.as_object().cloned().unwrap_or_default());
        row
    };
    // The plan the apply applied (finished before evidence: the writer below signs it).
    insert(
        pool,
        "runs",
        run(json!({
            "id": planned.as_uuid(), "kind": "plan", "status": "planned",
            "source_commit": commit, "tree_digest": tree_digest, "tool_version": tool_version,
            "plan_digest": plan_digest, "provider_lock_state": "none", "dependency_snapshot": deps,
            "state_generation": 0, "changes": { "add": 0, "change": 0, "destroy": 0 },
            "injected_env_names": ["TF_VAR_region"], "gate_decision": "released", "attempts": 1,
            "plan_diff": { "omitted": 0, "resources": [], "outputs": [{ "name": "vpc", "before": null,
                "after": "vpc-eu", "sensitive": false, "unknown": false, "forcesReplacement": false }] },
            "resource_changes": { "resources": [], "truncated": false }, "scan_report": scan,
            "created_at": t(6000).await?, "updated_at": t(5000).await?, "finished_at": t(5900).await?
        })),
    )
    .await?;
    insert(
        pool,
        "runs",
        run(json!({
            "id": applied.as_uuid(), "kind": "apply", "status": "applied", "plan_run_id": planned.as_uuid(),
            "source_commit": commit, "tree_digest": tree_digest, "tool_version": tool_version,
            "plan_digest": plan_digest, "provider_lock_state": "none", "dependency_snapshot": deps,
            "state_generation": 1, "changes": { "add": 0, "change": 0, "destroy": 0 },
            "outputs": { "vpc": "vpc-eu" }, "state_version_id": sv.as_uuid(),
            "injected_env_names": ["TF_VAR_region"], "gate_decision": "released", "attempts": 1,
            "created_at": t(5500).await?, "updated_at": t(5000).await?, "finished_at": t(5000).await?
        })),
    )
    .await?;
    insert(
        pool,
        "state_versions",
        json!({
            "id": sv.as_uuid(), "capsule_id": cap.as_uuid(), "generation": 1, "run_id": applied.as_uuid(),
            "object_key": format!("states/{cap}/{sv}.sealed"), "digest": state_digest,
            "size_bytes": state_size, "created_at": t(5000).await?
        }),
    )
    .await?;
    insert(
        pool,
        "runs",
        run(json!({
            "id": failed.as_uuid(), "kind": "plan", "status": "failed", "source_commit": commit,
            "tree_digest": tree_digest, "tool_version": tool_version, "attempts": 1,
            "error_code": "plan_failed", "error_message": "`plan` failed: Error: Invalid reference",
            "created_at": t(4000).await?, "updated_at": t(3900).await?, "finished_at": t(3900).await?
        })),
    )
    .await?;
    insert(
        pool,
        "runs",
        run(json!({
            "id": canceled.as_uuid(), "kind": "plan", "status": "canceled",
            "canceled_by": actor, "canceled_at": t(3000).await?,
            "created_at": t(3100).await?, "updated_at": t(3000).await?, "finished_at": t(3000).await?
        })),
    )
    .await?;
    // Queued just before the upgrade: its wake-up never left the outbox.
    insert(
        pool,
        "runs",
        run(json!({
            "id": queued.as_uuid(), "kind": "plan", "status": "queued", "var_names": null,
            "created_at": t(120).await?, "updated_at": t(120).await?
        })),
    )
    .await?;

    let handler = |step: &str| format!("handler:run.{step}-4242-prevrel0");
    let events: Vec<(RunId, &str, String, Value, i64)> = vec![
        (
            planned,
            "queued",
            actor.clone(),
            json!({ "kind": "plan", "autoApplyRequested": false }),
            6000,
        ),
        (
            planned,
            "claimed",
            handler("plan"),
            json!({ "attempt": 1, "step": "plan" }),
            5990,
        ),
        (
            planned,
            "checked_out",
            handler("plan"),
            json!({ "commit": commit, "treeDigest": tree_digest }),
            5980,
        ),
        (
            planned,
            "planned",
            handler("plan"),
            json!({ "changes": { "add": 0, "change": 0, "destroy": 0 }, "planDigest": plan_digest, "stateGeneration": 0 }),
            5900,
        ),
        (
            planned,
            "gate_decision",
            handler("gate"),
            json!({ "decision": "recorded", "reason": "a plan proposes; its Apply Run is gated" }),
            5890,
        ),
        (
            applied,
            "queued",
            actor.clone(),
            json!({ "kind": "apply", "planDigest": plan_digest, "planRunId": planned.to_string() }),
            5500,
        ),
        (
            applied,
            "gate_decision",
            handler("gate"),
            json!({ "decision": "released", "planDigest": plan_digest, "rules": [],
                    "ruleVersions": { "capsule": null, "workspace": null }, "cost": null, "agentExemption": null }),
            5490,
        ),
        (
            applied,
            "claimed",
            handler("apply"),
            json!({ "step": "apply" }),
            5480,
        ),
        (
            applied,
            "state_version_written",
            handler("apply"),
            json!({ "generation": 1, "stateVersionId": sv.to_string() }),
            5000,
        ),
        (
            applied,
            "applied",
            handler("apply"),
            json!({ "generation": 1 }),
            5000,
        ),
        (
            failed,
            "queued",
            actor.clone(),
            json!({ "kind": "plan", "autoApplyRequested": false }),
            4000,
        ),
        (
            failed,
            "failed",
            handler("plan"),
            json!({ "code": "plan_failed" }),
            3900,
        ),
        (
            canceled,
            "queued",
            actor.clone(),
            json!({ "kind": "plan", "autoApplyRequested": false }),
            3100,
        ),
        (
            canceled,
            "canceled",
            actor.clone(),
            json!({ "by": actor }),
            3000,
        ),
        (
            queued,
            "queued",
            actor.clone(),
            json!({ "kind": "plan", "autoApplyRequested": false }),
            120,
        ),
    ];
    for (run_id, kind, who, data, at) in events {
        insert(
            pool,
            "run_events",
            json!({ "run_id": run_id.as_uuid(), "kind": kind, "actor": who, "data": data, "at": t(at).await? }),
        )
        .await?;
    }
    // Sent wake-ups of the finished Runs, and the queued plan's, never sent.
    for (topic, run_id, at, sent) in [
        ("run.plan", planned, 6000, true),
        ("run.gate", planned, 5900, true),
        ("run.gate", applied, 5500, true),
        ("run.apply", applied, 5490, true),
        ("run.plan", failed, 4000, true),
        ("run.plan", canceled, 3100, true),
        ("run.plan", queued, 120, false),
    ] {
        let at = t(at).await?;
        insert(
            pool,
            "outbox",
            json!({ "topic": topic, "payload": { "runId": run_id.to_string() }, "available_at": at,
                    "created_at": at, "sent_at": if sent { Value::String(at.clone()) } else { Value::Null } }),
        )
        .await?;
    }
    Ok(OldData {
        workspace: ws,
        capsule: cap,
        planned,
        applied,
        failed,
        canceled,
        queued,
        state_version: sv,
        lineage: STATE_LINEAGE.to_owned(),
        operator_token,
        revoked_token,
        expired_token,
    })
}

/// The promise: a database made by the previous release's migrations, holding the previous
/// release's data, migrates cleanly to this release, and the pipeline works on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines)]
async fn previous_release_database_upgrades_and_the_pipeline_works_on_it() -> anyhow::Result<()> {
    // 1. The previous release's schema.
    let all = &takosumi_store::MIGRATOR;
    let previous: Vec<Migration> = all
        .iter()
        .filter(|m| m.version <= PREVIOUS_RELEASE_LAST_MIGRATION)
        .cloned()
        .collect();
    let newer: Vec<(i64, String)> = all
        .iter()
        .filter(|m| m.version > PREVIOUS_RELEASE_LAST_MIGRATION)
        .map(|m| (m.version, m.description.to_string()))
        .collect();
    assert!(
        previous
            .iter()
            .any(|m| m.version == PREVIOUS_RELEASE_LAST_MIGRATION),
        "no embedded migration has version {PREVIOUS_RELEASE_LAST_MIGRATION}: the constant names no migration"
    );
    assert!(
        !newer.is_empty(),
        "no migration is newer than PREVIOUS_RELEASE_LAST_MIGRATION ({PREVIOUS_RELEASE_LAST_MIGRATION}): \
         this test upgrades nothing; at a release, bump the constant to the release's last migration \
         (and keep it until the next release adds one)"
    );
    // The fields `migrate!` fills (sqlx has no public constructor from a list of migrations).
    let old_migrator = Migrator {
        migrations: Cow::Owned(previous.clone()),
        ..Migrator::DEFAULT
    };

    let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let db_name = format!("takosumi_up_{id}");
    let admin_url = env("TAKOSUMI_PG_ADMIN_URL")?;
    let admin = takosumi_store::connect(&admin_url, 1).await?;
    sqlx::query(&format!("CREATE DATABASE {db_name}"))
        .execute(&admin)
        .await?;
    let db_url = replace_db(&admin_url, &db_name);
    let pool = takosumi_store::connect(&db_url, 2).await?;
    old_migrator.run(&*pool).await?;
    let before = applied_versions(&pool).await?;
    assert_eq!(
        before,
        previous.iter().map(|m| m.version).collect::<Vec<_>>()
    );

    // 2. The previous release's data, its state object and its evidence.
    let repo = GitRepo::with_example("network")?;
    let out = std::process::Command::new("git")
        .args(["ls-remote", &repo.url(), "refs/heads/main"])
        .output()?;
    let commit = String::from_utf8(out.stdout)?
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(commit.len(), 40, "the fixture repository has a commit");
    let state = old_state();
    let old = write_old_data(&pool, &repo, &commit, &sha256_hex(&state), state.len()).await?;
    let bucket = format!("t-up-{id}");
    let objects = ObjectStore::connect(&takosumi_tests::s3_config(
        &env("TAKOSUMI_S3_ENDPOINT")?,
        &bucket,
    )?)
    .await;
    objects.ensure_bucket().await?;
    let sealer = Sealer::from_base64("test-1", &Secret::new(env("TAKOSUMI_SEAL_KEY")?))?;
    let old_key = format!("states/{}/{}.sealed", old.capsule, old.state_version);
    objects
        .put(
            &old_key,
            sealer.seal(Purpose::State, &old.state_version.to_string(), &state)?,
        )
        .await?;
    let (signer, evidence_seed) = takosumi_evidence::Signer::generate("test-evidence-1")?;
    let signed = takosumi_store::evidence::write_pending(&pool, &signer).await?;
    assert_eq!(signed, 4, "the previous release signed its 4 ended Runs");
    let old_statements: Vec<(uuid::Uuid, i64, String)> = sqlx::query_as(
        "SELECT run_id, sequence, digest FROM evidence_statements ORDER BY sequence",
    )
    .fetch_all(&pool)
    .await?;

    // 3. This release's migrations on it: exactly the newer ones run, and cleanly.
    takosumi_store::migrate(&pool).await?;
    let after = applied_versions(&pool).await?;
    let ran: Vec<i64> = after
        .iter()
        .copied()
        .filter(|v| !before.contains(v))
        .collect();
    println!(
        "upgrade: {} migrations of the previous release (last {PREVIOUS_RELEASE_LAST_MIGRATION}), then {}: {newer:?}",
        before.len(),
        ran.len()
    );
    assert_eq!(ran, newer.iter().map(|(v, _)| *v).collect::<Vec<_>>());
    assert_eq!(after.len(), all.iter().count());
    pool.close().await;

    // 4. The stack on the upgraded database and the old bucket.
    let stack = Stack::start_on(
        Options::default(),
        &Endpoints {
            settings: vec![
                ("TAKOSUMI_DATABASE_URL".into(), db_url.clone()),
                ("TAKOSUMI_S3_BUCKET".into(), bucket.clone()),
                ("TAKOSUMI_EVIDENCE_KEY".into(), evidence_seed.to_string()),
                ("TAKOSUMI_EVIDENCE_KEY_ID".into(), "test-evidence-1".into()),
            ],
            ..Endpoints::default()
        },
    )
    .await?;
    let result = check_pipeline(&stack, &repo, &old, &old_statements, &old_key).await;
    stack.stop().await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"))
        .execute(&admin)
        .await?;
    admin.close().await;
    result
}

#[allow(clippy::too_many_lines)]
async fn check_pipeline(
    stack: &Stack,
    repo: &GitRepo,
    old: &OldData,
    old_statements: &[(uuid::Uuid, i64, String)],
    old_key: &str,
) -> anyhow::Result<()> {
    let pool = &stack.ctx.pool;
    // The old Runs read back through the API.
    let planned = stack.client.get_run(old.planned).await?;
    assert_eq!(planned.status, RunStatus::Planned);
    assert_eq!(planned.state_generation, Some(0));
    let applied = stack.client.get_run(old.applied).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    assert_eq!(applied.plan_run_id, Some(old.planned));
    assert_eq!(applied.state_generation, Some(1));
    assert_eq!(applied.state_version_id, Some(old.state_version));
    assert_eq!(applied.outputs, Some(json!({ "vpc": "vpc-eu" })));
    // The Capsule's drift baseline, filled in by the upgrade: the plan its apply carried out.
    let baseline: Option<uuid::Uuid> =
        sqlx::query_scalar("SELECT drift_baseline_run_id FROM capsules WHERE id = $1")
            .bind(old.capsule.as_uuid())
            .fetch_one(pool)
            .await?;
    assert_eq!(baseline, Some(old.planned.as_uuid()));
    let failed = stack.client.get_run(old.failed).await?;
    assert_eq!(failed.status, RunStatus::Failed);
    assert_eq!(
        failed.error.as_ref().and_then(|e| e.code.known()),
        Some(takosumi_core::FailureCode::PlanFailed),
        "{failed:?}"
    );
    assert_eq!(
        stack.client.get_run(old.canceled).await?.status,
        RunStatus::Canceled
    );
    let events = stack.client.events(old.applied).await?;
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "queued",
            "gate_decision",
            "claimed",
            "state_version_written",
            "applied"
        ]
    );
    // The history, newest first.
    let page = stack
        .client
        .list_runs(
            old.workspace,
            &takosumi_client::RunQuery {
                limit: Some(100),
                ..takosumi_client::RunQuery::default()
            },
        )
        .await?;
    let history: Vec<RunId> = page.runs.iter().map(|r| r.id).collect();
    assert_eq!(
        history,
        [
            old.queued,
            old.canceled,
            old.failed,
            old.applied,
            old.planned
        ],
        "the Workspace's history lists the previous release's Runs newest first"
    );
    let (status, _) = stack
        .request(
            "GET",
            &format!("/api/v1/workspaces/{}/activity", old.workspace),
            Some(&stack.admin_token),
            None,
        )
        .await?;
    assert_eq!(status, 200, "the old activity reads back");

    // The old tokens: the live one authenticates, the revoked and expired ones do not.
    let operator = takosumi_client::Client::new(&stack.api_url, &old.operator_token)?;
    assert_eq!(
        operator.get_run(old.applied).await?.status,
        RunStatus::Applied
    );
    for t in [&old.revoked_token, &old.expired_token] {
        let (status, _) = stack
            .request(
                "GET",
                &format!("/api/v1/runs/{}", old.applied),
                Some(t),
                None,
            )
            .await?;
        assert_eq!(status, 401, "a revoked or expired token of the old release");
    }

    // The plan the old release queued: its unsent wake-up is relayed and it plans on the
    // old state (restored from the old object: a missing or altered one fails the plan).
    let queued = stack.wait(old.queued).await?;
    assert_eq!(queued.status, RunStatus::Planned, "{queued:?}");
    assert_eq!(queued.state_generation, Some(1));
    let unsent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
        .fetch_one(pool)
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut unsent = unsent;
    while unsent > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        unsent = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            .fetch_one(pool)
            .await?;
    }
    assert_eq!(unsent, 0, "the outbox drains");
    // The relays pruned the old release's wake-ups sent more than an hour before
    // (`KEEP_SENT`) when they started; the one sent 52 minutes before is kept.
    let old_sent: Vec<String> = sqlx::query_scalar(
        "SELECT topic FROM outbox WHERE sent_at < now() - interval '30 minutes' ORDER BY id",
    )
    .fetch_all(pool)
    .await?;
    assert_eq!(
        old_sent,
        ["run.plan"],
        "old sent wake-ups pruned, a recent one kept"
    );

    // The old Capsule plans and applies again, on a new commit (one more output): the
    // generation moves 1 → 2 and the new state continues the old one.
    let main_tf = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/examples/network/main.tf"),
    )?;
    repo.commit(
        &[(
            "infra/network/main.tf",
            &format!("{main_tf}\noutput \"zone\" {{\n  value = \"${{var.region}}-a\"\n}}\n"),
        )],
        "a zone output",
    )?;
    let (plan, apply) = stack.plan_and_apply(old.capsule).await?;
    assert_eq!(plan.state_generation, Some(1));
    assert_eq!(apply.state_generation, Some(2));
    assert_eq!(
        apply.outputs,
        Some(json!({ "vpc": "vpc-eu", "zone": "eu-a" }))
    );
    let capsule = stack.client.get_capsule(old.capsule).await?;
    assert_eq!(capsule.state_generation, 2);
    let new_sv = capsule.current_state_version_id.expect("a current state");
    assert_ne!(new_sv, old.state_version);
    assert_eq!(apply.state_version_id, Some(new_sv));
    let (generation, key): (i64, String) =
        sqlx::query_as("SELECT generation, object_key FROM state_versions WHERE id = $1")
            .bind(new_sv.as_uuid())
            .fetch_one(pool)
            .await?;
    assert_eq!(generation, 2);
    assert_ne!(key, old_key);
    let sealed = stack.ctx.objects.get(&key, 1 << 20).await?;
    let new_state: Value = serde_json::from_slice(&stack.ctx.sealer.unseal(
        Purpose::State,
        &new_sv.to_string(),
        &sealed,
    )?)?;
    assert_eq!(
        new_state["lineage"].as_str(),
        Some(old.lineage.as_str()),
        "the new state continues the old state (restored, not started afresh)"
    );
    assert!(new_state["serial"].as_i64() > Some(1), "{new_state}");

    // The evidence chain: the old statements are untouched, the new ones follow them, and
    // `takosumi verify` accepts the whole chain.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM evidence_pending")
            .fetch_one(pool)
            .await?;
        if pending == 0 {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "evidence still pending"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let statements: Vec<(uuid::Uuid, i64, String)> = sqlx::query_as(
        "SELECT run_id, sequence, digest FROM evidence_statements WHERE workspace_id = $1 ORDER BY sequence",
    )
    .bind(old.workspace.as_uuid())
    .fetch_all(pool)
    .await?;
    assert_eq!(&statements[..old_statements.len()], old_statements);
    let sequences: Vec<i64> = statements.iter().map(|s| s.1).collect();
    assert_eq!(
        sequences,
        (1..=7).collect::<Vec<_>>(),
        "4 old statements, then the queued plan's, the new plan's and the new apply's"
    );
    let out = stack
        .cli(&["verify", "--workspace", &old.workspace.to_string()])
        .await?;
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    let out = stack.cli(&["verify", &old.applied.to_string()]).await?;
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    Ok(())
}
