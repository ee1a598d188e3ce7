//! Reading what the tool reports as JSON: changes from `show -json`, outputs from the state
//! file the apply wrote (the same `name → {value, type, sensitive}` map `output -json`
//! prints, without starting the tool again). Never from printed text (except the
//! stale-plan error, which has no JSON form).

use serde::Deserialize;
use serde_json::{Map, Value};
use takosumi_core::Changes;
use takosumi_wire::{AttributeDiff, PlanDiff, ResourceDiff};

use crate::ToolOutput;

/// Counts resource changes from `show -json <plan>`: `["create"]` is an add, `["update"]`
/// a change, `["delete"]` a destroy, a replacement (`["delete","create"]` or
/// `["create","delete"]`) one add and one destroy. `no-op`, `read` (data sources) and
/// `forget` change nothing. A missing `resource_changes` key (a provider-free
/// configuration under terraform 1.0.3) means no changes.
pub fn count_changes(show_json: &Value) -> Changes {
    let mut changes = Changes::default();
    let Some(resource_changes) = show_json.get("resource_changes").and_then(Value::as_array) else {
        return changes;
    };
    for rc in resource_changes {
        let actions: Vec<&str> = rc
            .pointer("/change/actions")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        match actions.as_slice() {
            ["create"] => changes.add += 1,
            ["update"] => changes.change += 1,
            ["delete"] => changes.destroy += 1,
            ["delete", "create"] | ["create", "delete"] => {
                changes.add += 1;
                changes.destroy += 1;
            }
            _ => {}
        }
    }
    changes
}

/// At most this many resources in a [`PlanDiff`]; the rest are counted, not listed.
pub const MAX_DIFF_RESOURCES: usize = 500;
/// At most this many attributes per resource in a [`PlanDiff`].
pub const MAX_DIFF_ATTRIBUTES: usize = 200;
/// An attribute value longer than this (as JSON) is shown by its length only.
pub const MAX_DIFF_VALUE_CHARS: usize = 1_000;

/// The diff of `show -json <plan>` (see [`PlanDiff`]). `no-op` resources are left out.
pub fn plan_diff(show_json: &Value) -> PlanDiff {
    use takosumi_cost::marked_sensitive;
    let mut diff = PlanDiff {
        outputs: output_diffs(show_json),
        ..PlanDiff::default()
    };
    let Some(resource_changes) = show_json.get("resource_changes").and_then(Value::as_array) else {
        return diff;
    };
    for rc in resource_changes {
        let Some(change) = rc.get("change") else {
            continue;
        };
        let actions: Vec<&str> = change
            .get("actions")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let (action, create_before_destroy) = match actions.as_slice() {
            ["create"] => ("create", false),
            ["update"] => ("update", false),
            ["delete"] => ("delete", false),
            ["read"] => ("read", false),
            ["delete", "create"] => ("replace", false),
            ["create", "delete"] => ("replace", true),
            _ => continue,
        };
        if diff.resources.len() >= MAX_DIFF_RESOURCES {
            diff.omitted += 1;
            continue;
        }
        let empty = Map::new();
        let side = |k: &str| change.get(k).and_then(Value::as_object).unwrap_or(&empty);
        let (before, after) = (side("before"), side("after"));
        let unknown = change.get("after_unknown");
        let replace_paths: Vec<&str> = change
            .get("replace_paths")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| p.as_array()?.first()?.as_str())
            .collect();
        let mut names: Vec<&String> = before.keys().chain(after.keys()).collect();
        if let Some(u) = unknown.and_then(Value::as_object) {
            names.extend(u.keys());
        }
        names.sort();
        names.dedup();
        let mut attributes = Vec::new();
        let mut omitted_attributes = 0;
        for name in names {
            let sensitive = marked_sensitive(change.get("before_sensitive"), name)
                || marked_sensitive(change.get("after_sensitive"), name);
            let is_unknown = marked_sensitive(unknown, name);
            let (b, a) = (before.get(name), after.get(name));
            let changed = is_unknown || b != a;
            // A create or delete lists what it sets or removes; an update what changes.
            let listed = match action {
                "create" | "read" => is_unknown || a.is_some_and(|v| !v.is_null()),
                "delete" => b.is_some_and(|v| !v.is_null()),
                _ => changed,
            };
            if !listed {
                continue;
            }
            if attributes.len() >= MAX_DIFF_ATTRIBUTES {
                omitted_attributes += 1;
                continue;
            }
            let shown = |v: Option<&Value>| v.filter(|_| !sensitive).map(capped);
            attributes.push(AttributeDiff {
                name: name.clone(),
                before: shown(b),
                after: if is_unknown { None } else { shown(a) },
                sensitive,
                unknown: is_unknown,
                forces_replacement: replace_paths.contains(&name.as_str()),
            });
        }
        diff.resources.push(ResourceDiff {
            address: rc
                .get("address")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            action: action.to_owned(),
            create_before_destroy,
            reason: rc
                .get("action_reason")
                .and_then(Value::as_str)
                .map(str::to_owned),
            attributes,
            omitted_attributes,
        });
    }
    diff
}

/// A value as a diff shows it: itself, or its length when it is long.
fn capped(v: &Value) -> Value {
    let chars = v.to_string().chars().count();
    if chars > MAX_DIFF_VALUE_CHARS {
        Value::String(format!("({chars} characters, not shown)"))
    } else {
        v.clone()
    }
}

/// The root module's changing outputs (`output_changes`), sensitive ones withheld.
fn output_diffs(show_json: &Value) -> Vec<AttributeDiff> {
    let Some(outputs) = show_json.get("output_changes").and_then(Value::as_object) else {
        return Vec::new();
    };
    let flag = |c: &Value, k: &str| match c.get(k) {
        Some(Value::Bool(b)) => *b,
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        _ => false,
    };
    outputs
        .iter()
        .filter(|(_, c)| {
            c.pointer("/actions")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|x| x.as_str() != Some("no-op")))
        })
        .take(MAX_DIFF_ATTRIBUTES)
        .map(|(name, c)| {
            let sensitive = flag(c, "before_sensitive") || flag(c, "after_sensitive");
            let unknown = flag(c, "after_unknown");
            let shown = |k: &str| c.get(k).filter(|_| !sensitive).map(capped);
            AttributeDiff {
                name: name.clone(),
                before: shown("before"),
                after: if unknown { None } else { shown("after") },
                sensitive,
                unknown,
                forces_replacement: false,
            }
        })
        .collect()
}

/// Whether the tool refused a saved plan because the state moved on (`Error: Saved plan is
/// stale`, exit 1; applying an already-applied plan fails the same way).
pub fn is_stale_plan(out: &ToolOutput) -> bool {
    const STALE: &str = "Saved plan is stale";
    out.stderr.contains(STALE) || out.output.contains(STALE)
}

/// The most a Run record keeps of an apply's public outputs, as JSON. An apply whose
/// outputs are larger fails after its state is recorded (`after_apply_failed`): the Run
/// row is not the place for megabytes, and dropping them silently would hide it.
pub const MAX_OUTPUTS_BYTES: usize = 1024 * 1024;

/// The root module's outputs in a state file (format version 4, what terraform ≥ 0.12 and
/// tofu write): `name → {value, type, sensitive}`, the shape `output -json` prints. A
/// state with no outputs (or no `outputs` key) gives an empty map. Values may be
/// sensitive: pass the result through [`public_outputs`] before it goes anywhere.
pub fn state_outputs(state: &[u8]) -> Result<Map<String, Value>, serde_json::Error> {
    // Only `outputs` is kept; resources and everything else are skipped while parsing.
    #[derive(Deserialize)]
    struct StateOutputs {
        #[serde(default)]
        outputs: Map<String, Value>,
    }
    serde_json::from_slice::<StateOutputs>(state).map(|s| s.outputs)
}

/// The outputs a Run may publish, from [`state_outputs`] (or `output -json`): `name →
/// value` for non-sensitive outputs; a sensitive one maps to `{"sensitive": true}` and its
/// value is dropped.
pub fn public_outputs(outputs: &Map<String, Value>) -> Map<String, Value> {
    let mut public = Map::new();
    for (name, output) in outputs {
        let sensitive = output
            .get("sensitive")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let value = if sensitive {
            serde_json::json!({ "sensitive": true })
        } else {
            output.get("value").cloned().unwrap_or(Value::Null)
        };
        public.insert(name.clone(), value);
    }
    public
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn rc(addr: &str, actions: &[&str]) -> Value {
        json!({"address": addr, "mode": "managed", "change": {"actions": actions}})
    }

    #[test]
    fn a_plan_of_outputs_only_shows_them() {
        let show = json!({"output_changes": {
            "vpc": {"actions": ["create"], "before": null, "after": "vpc-eu",
                    "after_unknown": false, "before_sensitive": false, "after_sensitive": false},
            "key": {"actions": ["update"], "before": "a", "after": "b",
                    "after_unknown": false, "before_sensitive": true, "after_sensitive": true},
            "same": {"actions": ["no-op"], "before": "x", "after": "x"},
        }});
        let diff = plan_diff(&show);
        assert!(diff.resources.is_empty());
        let names: Vec<&str> = diff.outputs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["key", "vpc"]);
        assert!(diff.outputs[0].sensitive && diff.outputs[0].after.is_none());
        assert_eq!(diff.outputs[1].after, Some(json!("vpc-eu")));
    }

    #[test]
    fn a_diff_withholds_sensitive_attributes_and_shows_replacements() {
        let show = json!({"resource_changes": [
            {"address": "null_resource.a", "mode": "managed", "change": {"actions": ["no-op"]}},
            {"address": "aws_db.main", "action_reason": "replace_because_cannot_update",
             "change": {"actions": ["create", "delete"],
                "before": {"engine": "pg14", "password": "hunter2", "tags": {"k": "v"}},
                "after": {"engine": "pg15", "password": "hunter3", "tags": {"k": "v"}},
                "after_unknown": {"id": true},
                "before_sensitive": {"password": true}, "after_sensitive": {"password": true},
                "replace_paths": [["engine"]]}},
            {"address": "aws_s3.logs", "change": {"actions": ["delete"],
                "before": {"bucket": "logs", "acl": null}, "after": null}},
        ]});
        let diff = plan_diff(&show);
        assert_eq!(diff.resources.len(), 2, "{diff:?}");
        let db = &diff.resources[0];
        assert_eq!(
            (db.action.as_str(), db.create_before_destroy),
            ("replace", true)
        );
        assert_eq!(db.reason.as_deref(), Some("replace_because_cannot_update"));
        let names: Vec<&str> = db.attributes.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["engine", "id", "password"], "tags did not change");
        let engine = &db.attributes[0];
        assert!(engine.forces_replacement);
        assert_eq!(engine.after, Some(json!("pg15")));
        assert!(db.attributes[1].unknown && db.attributes[1].after.is_none());
        let pw = &db.attributes[2];
        assert!(pw.sensitive && pw.before.is_none() && pw.after.is_none());
        assert!(!serde_json::to_string(&diff).unwrap().contains("hunter"));
        let logs = &diff.resources[1];
        assert_eq!(logs.action, "delete");
        assert_eq!(logs.attributes.len(), 1, "null attributes are not listed");
    }

    #[test]
    fn counts_real_actions_only() {
        let show = json!({
            "format_version": "0.2",
            "resource_changes": [
                rc("null_resource.a", &["create"]),
                rc("null_resource.b", &["create"]),
                rc("null_resource.c", &["update"]),
                rc("null_resource.d", &["delete"]),
                rc("null_resource.e", &["delete", "create"]),
                rc("null_resource.f", &["create", "delete"]),
                rc("null_resource.g", &["no-op"]),
                rc("null_resource.h", &["forget"]),
                {"address": "data.x.y", "mode": "data", "change": {"actions": ["read"]}},
                {"address": "broken"},
            ]
        });
        assert_eq!(
            count_changes(&show),
            Changes {
                add: 4,
                change: 1,
                destroy: 3
            }
        );
    }

    #[test]
    fn missing_or_empty_resource_changes_is_no_change() {
        // terraform 1.0.3, provider-free configuration: no key at all.
        let show = json!({"format_version": "0.2", "planned_values": {"outputs": {}}});
        assert!(count_changes(&show).is_empty());
        assert!(count_changes(&json!({"resource_changes": []})).is_empty());
        assert!(count_changes(&json!({"resource_changes": [rc("a", &["no-op"])]})).is_empty());
        assert!(count_changes(&Value::Null).is_empty());
    }

    #[test]
    fn stale_plan_detection() {
        let out = ToolOutput {
            exit_code: 1,
            output: String::new(),
            stderr: "\nError: Saved plan is stale\n\nThe given plan file can no longer be applied"
                .into(),
        };
        assert!(is_stale_plan(&out));
        let ok = ToolOutput {
            exit_code: 1,
            output: "Error: something else".into(),
            stderr: String::new(),
        };
        assert!(!is_stale_plan(&ok));
    }

    #[test]
    fn sensitive_outputs_lose_their_value() {
        let outputs = json!({
            "vpc": {"sensitive": false, "type": "string", "value": "vpc-eu"},
            "password": {"sensitive": true, "type": "string", "value": "hunter2"},
            "list": {"sensitive": false, "type": ["list", "string"], "value": ["a"]},
        });
        let public = public_outputs(outputs.as_object().unwrap());
        assert_eq!(public["vpc"], json!("vpc-eu"));
        assert_eq!(public["password"], json!({"sensitive": true}));
        assert_eq!(public["list"], json!(["a"]));
        assert!(!Value::Object(public).to_string().contains("hunter2"));
        assert!(public_outputs(&Map::new()).is_empty());
    }

    #[test]
    fn outputs_are_read_from_the_state_file() {
        // As terraform 1.0.3 writes it: `sensitive` only when true, resources beside.
        let state = br#"{"version":4,"terraform_version":"1.0.3","serial":2,"lineage":"l",
            "outputs":{"vpc":{"value":"vpc-eu","type":"string"},
                       "password":{"value":"hunter2","type":"string","sensitive":true}},
            "resources":[{"mode":"managed","type":"null_resource","name":"a","instances":[]}]}"#;
        let outputs = state_outputs(state).unwrap();
        let public = public_outputs(&outputs);
        assert_eq!(public["vpc"], json!("vpc-eu"));
        assert_eq!(public["password"], json!({"sensitive": true}));
        assert_eq!(public.len(), 2);
        // A state without outputs has none; one that is not JSON is an error.
        assert!(
            state_outputs(br#"{"version":4,"resources":[]}"#)
                .unwrap()
                .is_empty()
        );
        assert!(state_outputs(b"not json").is_err());
        assert!(state_outputs(br#"{"outputs":[1]}"#).is_err());
    }
}
