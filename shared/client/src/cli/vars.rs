//! `--var` and `--var-json`: the variables a Capsule is registered with or a plan Run is
//! given, parsed as the command line is read, so a malformed one is a usage error before
//! anything is sent.

use clap::error::ErrorKind;
use serde_json::{Map, Value};

/// One `--var` / `--var-json`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Var {
    pub(crate) key: String,
    pub(crate) value: Value,
}

fn split_var(s: &str) -> Result<(&str, &str), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not KEY=VALUE"))?;
    if key.is_empty() {
        return Err(format!("`{s}` has an empty variable name"));
    }
    if key.chars().any(char::is_whitespace) {
        return Err(format!("variable name `{key}` contains whitespace"));
    }
    Ok((key, value))
}

pub(crate) fn parse_var(s: &str) -> Result<Var, String> {
    let (key, value) = split_var(s)?;
    Ok(Var {
        key: key.to_owned(),
        value: Value::String(value.to_owned()),
    })
}

/// `--var` of a plan: a string, or a list or map when the value is one in JSON.
pub(crate) fn parse_plan_var(s: &str) -> Result<Var, String> {
    let (key, value) = split_var(s)?;
    let trimmed = value.trim_start();
    let value = if trimmed.starts_with('[') || trimmed.starts_with('{') {
        serde_json::from_str(value).map_err(|e| {
            format!("the value of `{key}` looks like a JSON list or map but is not valid JSON ({e}); fix it, or pass a string with --var-json '{key}=\"…\"'")
        })?
    } else {
        Value::String(value.to_owned())
    };
    Ok(Var {
        key: key.to_owned(),
        value,
    })
}

pub(crate) fn parse_var_json(s: &str) -> Result<Var, String> {
    let (key, value) = split_var(s)?;
    let value = serde_json::from_str(value)
        .map_err(|e| format!("the value of `{key}` is not valid JSON: {e}"))?;
    Ok(Var {
        key: key.to_owned(),
        value,
    })
}

/// Merges `--var` and `--var-json`; a name given twice is an error.
pub(crate) fn collect_vars(
    vars: Vec<Var>,
    var_json: Vec<Var>,
) -> Result<Map<String, Value>, String> {
    let mut out = Map::new();
    for Var { key, value } in vars.into_iter().chain(var_json) {
        if out.contains_key(&key) {
            return Err(format!("variable `{key}` is given more than once"));
        }
        out.insert(key, value);
    }
    Ok(out)
}

/// [`collect_vars`], or a usage error (exit 2, nothing sent) when a name is given twice.
pub(crate) fn collect_or_exit(vars: Vec<Var>, var_json: Vec<Var>) -> Map<String, Value> {
    collect_vars(vars, var_json)
        .unwrap_or_else(|message| super::usage_error(ErrorKind::ArgumentConflict, message))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn vars_parse() {
        assert_eq!(
            parse_var("region=eu").unwrap(),
            Var {
                key: "region".into(),
                value: json!("eu")
            }
        );
        assert_eq!(parse_var("conn=a=b").unwrap().value, json!("a=b"));
        assert_eq!(parse_var("empty=").unwrap().value, json!(""));
        assert!(parse_var("noequals").is_err());
        assert!(parse_var("=x").is_err());
        assert!(parse_var("a b=x").is_err());

        assert_eq!(
            parse_var_json("zones=[\"a\",\"b\"]").unwrap().value,
            json!(["a", "b"])
        );
        assert_eq!(parse_var_json("n=3").unwrap().value, json!(3));
        assert_eq!(parse_var_json("s=\"text\"").unwrap().value, json!("text"));
        let err = parse_var_json("bad={").unwrap_err();
        assert!(err.contains("`bad` is not valid JSON"), "{err}");

        let vars = collect_vars(
            vec![parse_var("a=1").unwrap()],
            vec![parse_var_json("b=2").unwrap()],
        )
        .unwrap();
        assert_eq!(Value::Object(vars), json!({"a": "1", "b": 2}));
        let dup = collect_vars(
            vec![parse_var("a=1").unwrap()],
            vec![parse_var_json("a=2").unwrap()],
        );
        assert!(dup.unwrap_err().contains("`a`"));
    }
}
