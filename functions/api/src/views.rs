//! Public projections. Object keys, leases and lockfile bytes never appear here.

use serde_json::{Map, Value, json};
use takosumi_store::capsules::Capsule;
use takosumi_store::runs::Run;

/// A Run as the API shows it.
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
    // Names, not values (the seed's record keeps "the names of the injected environment
    // variables — values are not stored"): the values stay sealed where the pipeline reads
    // them. `null`: the Capsule's variables, named once a step ran.
    let names = r.var_names.clone().or_else(|| {
        r.vars
            .as_ref()
            .and_then(Value::as_object)
            .map(|m| m.keys().cloned().collect())
    });
    m.insert("varNames".into(), json!(names));
    m.insert("attempts".into(), json!(r.attempts));
    m.insert("canceledBy".into(), json!(r.canceled_by));
    m.insert("canceledAt".into(), json!(r.canceled_at));
    m.insert("createdAt".into(), json!(r.created_at));
    m.insert("updatedAt".into(), json!(r.updated_at));
    Value::Object(m)
}

/// A Capsule's variables as `caller_may_edit` sees them: every name, and a value only for
/// a variable its configuration does not declare `sensitive` (as its plans read it: before
/// the first plan, none is known, so none is shown) and only to a role that may edit the
/// Capsule. `(shown, withheld names)`.
fn capsule_vars(c: &Capsule, caller_may_edit: bool) -> (Map<String, Value>, Vec<String>) {
    let mut shown = Map::new();
    let mut withheld = Vec::new();
    for (name, value) in c.vars.as_object().into_iter().flatten() {
        let declared_plain = c
            .sensitive_var_names
            .as_ref()
            .is_some_and(|sensitive| !sensitive.contains(name));
        if caller_may_edit && declared_plain {
            shown.insert(name.clone(), value.clone());
        } else {
            withheld.push(name.clone());
        }
    }
    (shown, withheld)
}

/// A Capsule as the API shows it (its variables as [`capsule_vars`] says).
pub fn capsule(c: &Capsule, caller_may_edit: bool) -> Value {
    let (vars, withheld) = capsule_vars(c, caller_may_edit);
    let names: Vec<&String> = c
        .vars
        .as_object()
        .into_iter()
        .flat_map(|m| m.keys())
        .collect();
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
        "source": { "repo": takosumi_runner::redact_repo_url(&c.repo), "branch": c.branch },
        "dir": c.dir,
        "tool": c.tool,
        "vars": vars,
        "varNames": names,
        "withheldVars": withheld,
        "stateGeneration": c.state_generation,
        "currentStateVersionId": c.current_state_version_id,
        "status": status,
        // `stale` (the branch moved past what was planned) and `drifted` (reality moved
        // away from what was applied) are independent; `status` shows the first that holds.
        "stale": c.stale,
        "createdAt": c.created_at,
    })
}
