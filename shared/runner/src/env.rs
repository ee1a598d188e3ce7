//! Which tool runs, and the environment it gets: built from nothing, never inherited.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;
use takosumi_core::{Secret, holds_nul};

use crate::{Masker, RunnerError};

pub use takosumi_core::Tool;

/// What a tool step printed.
#[derive(Clone)]
pub struct ToolOutput {
    /// The exit code (128 + signal number when the process was killed by a signal).
    pub exit_code: i32,
    /// stdout and stderr interleaved line by line in arrival order, masked as it was read
    /// with the [`ToolEnv`]'s masker. Truncated (with a marker line) past 16 MiB.
    pub output: String,
    /// stderr alone (where `Error: …` lines go), masked the same way.
    pub stderr: String,
}

impl ToolOutput {
    /// Exit code 0.
    pub fn success(&self) -> bool {
        self.exit_code == 0
    }
}

impl fmt::Debug for ToolOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolOutput")
            .field("exit_code", &self.exit_code)
            .field("output_bytes", &self.output.len())
            .field("stderr_bytes", &self.stderr.len())
            .finish()
    }
}

/// Names the runner sets itself or that would change how the tool runs behind the
/// runner's back (argument injection, another CLI config, debug logs that print values,
/// attaching to foreign provider processes, library preloading, a second process per
/// command).
const RESERVED: &[&str] = &[
    "PATH",
    "HOME",
    "TF_IN_AUTOMATION",
    "TF_INPUT",
    "TF_FORK",
    "TF_CLI_CONFIG_FILE",
    "TOFU_CLI_CONFIG_FILE",
    "TERRAFORM_CONFIG",
    "TF_CLI_ARGS",
    "TF_DATA_DIR",
    "TF_WORKSPACE",
    "TF_LOG",
    "TF_LOG_PATH",
    "TF_LOG_CORE",
    "TF_LOG_PROVIDER",
    "TF_REATTACH_PROVIDERS",
    "TF_PLUGIN_CACHE_DIR",
    "TF_PLUGIN_CACHE_MAY_BREAK_DEPENDENCY_LOCK_FILE",
];
const RESERVED_PREFIXES: &[&str] = &["TF_CLI_ARGS_", "LD_", "DYLD_"];

/// The entries a run adds to the tool's environment: `TF_VAR_*` variables and credential
/// entries. The runner's own fixed entries (PATH, HOME, …) come on top of these; nothing
/// comes from the server's environment. Values are held zeroizing and never printed.
///
/// It also carries the run's [`Masker`]: every secret entry is registered with it as it is
/// added, and the runner masks everything the tool prints with it before the output leaves
/// the runner. Clones share the masker, so a value registered later (a sensitive plan
/// value) reaches every later step.
#[derive(Clone, Default)]
pub struct ToolEnv {
    entries: BTreeMap<String, Secret<String>>,
    /// The first name `with_secret_env` refused; reported when the tool is started.
    refused: Option<(String, &'static str)>,
    masker: Masker,
}

impl ToolEnv {
    /// An empty environment.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds each variable as `TF_VAR_<name>`: strings, numbers and booleans as their plain
    /// text, lists and maps as JSON; `null` is left out (the variable's default applies).
    /// Names must match `[A-Za-z_][A-Za-z0-9_-]*`.
    pub fn with_variables(
        mut self,
        vars: &serde_json::Map<String, Value>,
    ) -> Result<Self, RunnerError> {
        for (name, value) in vars {
            if !valid_name(name) {
                return Err(RunnerError::InvalidVariable {
                    name: name.clone(),
                    reason: "names must match [A-Za-z_][A-Za-z0-9_-]*",
                });
            }
            let text = match value {
                Value::Null => continue,
                Value::String(s) => s.clone(),
                Value::Bool(b) => b.to_string(),
                Value::Number(n) => n.to_string(),
                Value::Array(_) | Value::Object(_) => {
                    serde_json::to_string(value).map_err(|_| RunnerError::InvalidVariable {
                        name: name.clone(),
                        reason: "the value cannot be encoded as JSON",
                    })?
                }
            };
            // JSON encodes a NUL inside a list or an object as `\u0000`: the encoded text
            // has none, but the tool would get one, and Postgres cannot store it.
            if holds_nul(value) {
                return Err(RunnerError::InvalidVariable {
                    name: name.clone(),
                    reason: "the value contains a NUL character",
                });
            }
            self.entries
                .insert(format!("TF_VAR_{name}"), Secret::new(text));
        }
        Ok(self)
    }

    /// Adds each variable as a sensitive `TF_VAR_<name>`, encoded as
    /// [`Self::with_variables`] does, and registers the encoded value and every string or
    /// number inside it with the masker (see [`crate::mask`] for what is too short to
    /// mask).
    pub fn with_sensitive_variables(
        mut self,
        vars: &serde_json::Map<String, Value>,
    ) -> Result<Self, RunnerError> {
        let encoded = Self::new().with_variables(vars)?;
        for (name, value) in vars {
            if !value.is_null() {
                self.masker
                    .add_all(leaf_texts(value).iter().map(String::as_str));
            }
            let key = format!("TF_VAR_{name}");
            if let Some(text) = encoded.entries.get(&key) {
                self.masker.add(text.expose());
                self.entries.insert(key, text.clone());
            }
        }
        Ok(self)
    }

    /// Adds one entry (a credential such as `AWS_SECRET_ACCESS_KEY`, or a sensitive
    /// `TF_VAR_*`) and registers its value with the masker. The value is never printed. A
    /// name the runner reserves (PATH, HOME, TF_CLI_ARGS*, TF_LOG*, …) or an invalid name
    /// makes every later tool start fail with [`RunnerError::InvalidEnv`].
    /// `CHECKPOINT_DISABLE` is allowed and replaces the runner's default.
    pub fn with_secret_env(mut self, name: &str, value: Secret<String>) -> Self {
        let refusal = match check_env_name(name) {
            Err(reason) => Some(reason),
            Ok(()) if value.expose().contains('\0') => Some("the value contains a NUL character"),
            Ok(()) => None,
        };
        match refusal {
            Some(reason) => {
                if self.refused.is_none() {
                    self.refused = Some((name.to_owned(), reason));
                }
            }
            None => {
                self.masker.add(value.expose());
                self.entries.insert(name.to_owned(), value);
            }
        }
        self
    }

    /// The masker holding every secret value of this environment; the runner masks the
    /// tool's output with it. Add values the run learns later (sensitive plan values) here.
    pub fn masker(&self) -> &Masker {
        &self.masker
    }

    /// Names of every injected entry (`TF_VAR_region`, `AWS_ACCESS_KEY_ID`, …), sorted;
    /// never values. This is what a Run records as `injectedEnvNames`.
    pub fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    /// Whether nothing was injected.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, or the first refusal.
    pub(crate) fn entries(&self) -> Result<impl Iterator<Item = (&str, &str)>, RunnerError> {
        if let Some((name, reason)) = &self.refused {
            return Err(RunnerError::InvalidEnv {
                name: name.clone(),
                reason,
            });
        }
        Ok(self
            .entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.expose().as_str())))
    }
}

impl fmt::Debug for ToolEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolEnv")
            .field("names", &self.names())
            .finish()
    }
}

/// Whether `name` may be injected with [`ToolEnv::with_secret_env`]: `Err` says why not
/// (an invalid name, or one the runner sets or forbids). Lets the API refuse a credential
/// set at registration instead of at its first run.
pub fn check_env_name(name: &str) -> Result<(), &'static str> {
    if !valid_name(name) {
        Err("names must match [A-Za-z_][A-Za-z0-9_-]*")
    } else if is_reserved(name) {
        Err("the runner sets or forbids this entry")
    } else {
        Ok(())
    }
}

/// Strings and numbers inside a variable value, as text.
fn leaf_texts(value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Number(n) => out.push(n.to_string()),
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => stack.extend(map.values()),
            Value::Bool(_) | Value::Null => {}
        }
    }
    out
}

/// `[A-Za-z_][A-Za-z0-9_-]*`
pub(crate) fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn is_reserved(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    RESERVED.contains(&upper.as_str()) || RESERVED_PREFIXES.iter().any(|p| upper.starts_with(p))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn vars(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn get(env: &ToolEnv, name: &str) -> Option<String> {
        env.entries()
            .unwrap()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    }

    #[test]
    fn tool_names_round_trip() {
        for tool in [Tool::Terraform, Tool::Tofu] {
            assert_eq!(tool.to_string().parse::<Tool>().unwrap(), tool);
            assert_eq!(serde_json::to_value(tool).unwrap(), json!(tool.as_str()));
        }
        assert!("opentofu".parse::<Tool>().is_err());
        assert_eq!(
            serde_json::from_value::<Tool>(json!("tofu")).unwrap(),
            Tool::Tofu
        );
    }

    /// A NUL anywhere in a value is refused, in a list or an object too (where JSON would
    /// hide it as `\u0000`, which Postgres cannot store: found by the fuzz suite).
    #[test]
    fn a_nul_anywhere_in_a_value_is_refused() {
        for value in [
            json!("a\u{0}b"),
            json!(["ok", "a\u{0}b"]),
            json!({"k": ["a\u{0}b"]}),
            json!({"k\u{0}": 1}),
        ] {
            let refused = ToolEnv::new().with_variables(&vars(json!({ "v": value })));
            assert!(
                matches!(refused, Err(RunnerError::InvalidVariable { .. })),
                "{value}"
            );
        }
        assert!(
            ToolEnv::new()
                .with_variables(&vars(json!({"v": {"k": ["a", 1, null]}})))
                .is_ok()
        );
    }

    #[test]
    fn variables_are_encoded_for_tf_var() {
        let env = ToolEnv::new()
            .with_variables(&vars(json!({
                "region": "eu",
                "count": 3,
                "ratio": 1.5,
                "enabled": true,
                "zones": ["a", "b"],
                "tags": {"team": "net", "n": 1},
                "nothing": null,
                "with-dash": "x",
                "_under": "y",
            })))
            .unwrap();
        assert_eq!(get(&env, "TF_VAR_region").as_deref(), Some("eu"));
        assert_eq!(get(&env, "TF_VAR_count").as_deref(), Some("3"));
        assert_eq!(get(&env, "TF_VAR_ratio").as_deref(), Some("1.5"));
        assert_eq!(get(&env, "TF_VAR_enabled").as_deref(), Some("true"));
        assert_eq!(get(&env, "TF_VAR_zones").as_deref(), Some(r#"["a","b"]"#));
        let tags: Value = serde_json::from_str(&get(&env, "TF_VAR_tags").unwrap()).unwrap();
        assert_eq!(tags, json!({"team": "net", "n": 1}));
        assert_eq!(get(&env, "TF_VAR_nothing"), None);
        assert_eq!(
            env.names(),
            vec![
                "TF_VAR__under",
                "TF_VAR_count",
                "TF_VAR_enabled",
                "TF_VAR_ratio",
                "TF_VAR_region",
                "TF_VAR_tags",
                "TF_VAR_with-dash",
                "TF_VAR_zones",
            ]
        );
    }

    #[test]
    fn bad_variable_names_are_refused() {
        for bad in ["", "1abc", "a b", "a=b", "a.b", "é", "a\0b", "-x"] {
            let err = ToolEnv::new()
                .with_variables(&vars(json!({ bad: "v" })))
                .unwrap_err();
            assert!(
                matches!(err, RunnerError::InvalidVariable { .. }),
                "{bad:?}"
            );
        }
        let err = ToolEnv::new()
            .with_variables(&vars(json!({"ok": "a\0b"})))
            .unwrap_err();
        assert!(matches!(err, RunnerError::InvalidVariable { .. }));
        assert!(!format!("{err}").contains("a\0b"));
    }

    #[test]
    fn secret_env_names_and_values() {
        let env = ToolEnv::new()
            .with_secret_env("AWS_SECRET_ACCESS_KEY", Secret::new("canary-42".into()))
            .with_secret_env("CHECKPOINT_DISABLE", Secret::new("0".into()));
        assert_eq!(
            env.names(),
            vec!["AWS_SECRET_ACCESS_KEY", "CHECKPOINT_DISABLE"]
        );
        assert!(!format!("{env:?}").contains("canary"));
        assert_eq!(
            get(&env, "AWS_SECRET_ACCESS_KEY").as_deref(),
            Some("canary-42")
        );
        // Every injected secret is masked in what the tool prints; "0" is too short.
        assert_eq!(env.masker().mask("key=canary-42 cp=0"), "key=*** cp=0");
        assert_eq!(check_env_name("TAKOSUMI_TOKEN"), Ok(()));
        assert!(check_env_name("TF_LOG").is_err());
        assert!(check_env_name("1X").is_err());

        for reserved in [
            "PATH",
            "HOME",
            "TF_CLI_ARGS",
            "TF_CLI_ARGS_plan",
            "tf_log",
            "LD_PRELOAD",
            "TF_CLI_CONFIG_FILE",
            "TF_FORK",
            "bad name",
        ] {
            let env = ToolEnv::new().with_secret_env(reserved, Secret::new("x".into()));
            assert!(
                matches!(env.entries(), Err(RunnerError::InvalidEnv { .. })),
                "{reserved}"
            );
            assert!(env.names().is_empty());
        }
    }

    #[test]
    fn sensitive_variables_are_injected_and_masked() {
        let env = ToolEnv::new()
            .with_variables(&vars(json!({"region": "eu-west-1"})))
            .unwrap()
            .with_sensitive_variables(&vars(json!({
                "db_password": "pw-canary-77",
                "keys": ["key-one-canary", "k2"],
                "nothing": null,
            })))
            .unwrap();
        assert_eq!(
            env.names(),
            vec!["TF_VAR_db_password", "TF_VAR_keys", "TF_VAR_region"]
        );
        assert_eq!(
            get(&env, "TF_VAR_db_password").as_deref(),
            Some("pw-canary-77")
        );
        let m = env.masker();
        assert_eq!(
            m.mask("pw-canary-77 key-one-canary [\"key-one-canary\",\"k2\"] eu-west-1"),
            "*** *** *** eu-west-1",
            "plain variables are not masked"
        );
        assert!(
            ToolEnv::new()
                .with_sensitive_variables(&vars(json!({"bad name": "x"})))
                .is_err()
        );
    }
}
