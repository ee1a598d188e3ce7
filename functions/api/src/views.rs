//! Public projections. Object keys, leases and lockfile bytes never appear here.

use serde_json::{Map, Value, json};
use takosumi_store::capsules::Capsule;
use takosumi_store::runs::Run;

/// A Run as the API shows it (DESIGN §5).
pub fn run(r: &Run) -> Value {
    let mut m = Map::new();
    m.insert("id".into(), json!(r.id));
    m.insert("kind".into(), json!(r.kind));
    m.insert("status".into(), json!(r.status));
    m.insert("workspaceId".into(), json!(r.workspace_id));
    m.insert("capsuleId".into(), json!(r.capsule_id));
    m.insert("runGroupId".into(), json!(r.run_group_id));
    m.insert("planRunId".into(), json!(r.plan_run_id));
    m.insert("planDigest".into(), json!(r.plan_digest));
    m.insert(
        "sourceSnapshot".into(),
        match &r.source_commit {
            Some(commit) => json!({ "commit": commit, "treeDigest": r.tree_digest }),
            None => Value::Null,
        },
    );
    m.insert(
        "toolVersion".into(),
        r.tool_version.clone().unwrap_or(Value::Null),
    );
    // null = provider-free (recorded); absent = unknown (legacy / not yet planned).
    match r.provider_lock_state.as_str() {
        "none" => {
            m.insert("providerLockDigest".into(), Value::Null);
        }
        "present" => {
            m.insert("providerLockDigest".into(), json!(r.provider_lock_digest));
        }
        _ => {}
    }
    m.insert("dependencySnapshot".into(), json!(r.dependency_snapshot));
    m.insert("stateGeneration".into(), json!(r.state_generation));
    m.insert("changes".into(), r.changes.clone().unwrap_or(Value::Null));
    m.insert("drift".into(), json!(r.drift));
    m.insert("outputs".into(), r.outputs.clone().unwrap_or(Value::Null));
    m.insert("stateVersionId".into(), json!(r.state_version_id));
    m.insert(
        "hold".into(),
        match &r.hold_reason {
            Some(reason) => json!({ "reason": reason, "details": r.hold_details }),
            None => Value::Null,
        },
    );
    m.insert(
        "error".into(),
        match &r.error_code {
            Some(code) => json!({ "code": code, "message": r.error_message }),
            None => Value::Null,
        },
    );
    m.insert(
        "actor".into(),
        json!({ "kind": r.actor_kind, "id": r.actor_id }),
    );
    m.insert("autoApplyRequested".into(), json!(r.auto_apply_requested));
    m.insert("injectedEnvNames".into(), json!(r.injected_env_names));
    // `bubblewrap` | `none` (a runner started unisolated), null before execution.
    m.insert("sandbox".into(), json!(r.sandbox));
    // Ids and names of the credential sets used; their values are never stored here.
    m.insert("providerBindings".into(), r.provider_bindings.clone());
    // Non-secret variables only (sensitive ones appear as names in injectedEnvNames).
    m.insert("vars".into(), r.vars.clone().unwrap_or(Value::Null));
    m.insert("attempts".into(), json!(r.attempts));
    m.insert("canceledBy".into(), json!(r.canceled_by));
    m.insert("canceledAt".into(), json!(r.canceled_at));
    m.insert("createdAt".into(), json!(r.created_at));
    m.insert("updatedAt".into(), json!(r.updated_at));
    Value::Object(m)
}

/// A Capsule as the API shows it.
pub fn capsule(c: &Capsule) -> Value {
    let status = if c.running_apply_id.is_some() {
        "applying"
    } else if c.stale {
        "stale"
    } else {
        "ok"
    };
    json!({
        "id": c.id,
        "workspaceId": c.workspace_id,
        "name": c.name,
        "source": { "repo": c.repo, "branch": c.branch },
        "dir": c.dir,
        "tool": c.tool,
        "vars": c.vars,
        "stateGeneration": c.state_generation,
        "currentStateVersionId": c.current_state_version_id,
        "status": status,
        // `stale` (the branch moved past what was planned) and `drifted` (reality moved
        // away from what was applied) are independent; `status` shows the first that holds.
        "stale": c.stale,
        "createdAt": c.created_at,
    })
}
