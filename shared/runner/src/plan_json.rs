//! Reading what the tool reports as JSON: changes from `show -json`, outputs from
//! `output -json`. Never from printed text (except the stale-plan error, which has no
//! JSON form).

use serde_json::{Map, Value};
use takosumi_core::Changes;

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

/// Whether the tool refused a saved plan because the state moved on (`Error: Saved plan is
/// stale`, exit 1; applying an already-applied plan fails the same way).
pub fn is_stale_plan(out: &ToolOutput) -> bool {
    const STALE: &str = "Saved plan is stale";
    out.stderr.contains(STALE) || out.output.contains(STALE)
}

/// The outputs a Run may publish, from `output -json`: `name → value` for non-sensitive
/// outputs; a sensitive one maps to `{"sensitive": true}` and its value is dropped.
pub fn public_outputs(output_json: &Value) -> Map<String, Value> {
    let mut public = Map::new();
    let Some(outputs) = output_json.as_object() else {
        return public;
    };
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
        let public = public_outputs(&outputs);
        assert_eq!(public["vpc"], json!("vpc-eu"));
        assert_eq!(public["password"], json!({"sensitive": true}));
        assert_eq!(public["list"], json!(["a"]));
        assert!(!Value::Object(public).to_string().contains("hunter2"));
        assert!(public_outputs(&json!({})).is_empty());
    }
}
