//! Canonical JSON: what is signed and digested. Object keys sorted (by UTF-16 code units,
//! as RFC 8785 orders them), no whitespace, strings escaped as RFC 8785 does (`"`, `\` and
//! control characters only; `serde_json` escapes exactly those, lowercase `\u00xx`), and
//! integers only: the statement has no fractional numbers, and refusing them keeps the
//! number format (the hard part of RFC 8785) out of the contract.

use serde::Serialize;
use serde_json::Value;

/// A value that has no canonical form here.
#[derive(Debug, thiserror::Error)]
pub enum CanonicalError {
    /// A number that is not an integer.
    #[error("a fractional number has no canonical form in a statement: {0}")]
    Fraction(String),
    /// The value could not be turned into JSON.
    #[error("the value is not JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// The canonical bytes of `value`.
pub fn to_canonical<T: Serialize>(value: &T) -> Result<Vec<u8>, CanonicalError> {
    canonical_value(&serde_json::to_value(value)?)
}

/// The canonical bytes of a JSON value.
pub fn canonical_value(value: &Value) -> Result<Vec<u8>, CanonicalError> {
    let mut out = Vec::with_capacity(1024);
    write(value, &mut out)?;
    Ok(out)
}

fn write(value: &Value, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => {
            if n.is_i64() || n.is_u64() {
                out.extend_from_slice(n.to_string().as_bytes());
            } else {
                return Err(CanonicalError::Fraction(n.to_string()));
            }
        }
        Value::String(s) => serde_json::to_writer(&mut *out, s)?,
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
            out.push(b'{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key)?;
                out.push(b':');
                write(&map[key.as_str()], out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

/// SHA-256 of `bytes`, lowercase hex: a statement's digest is this over its canonical bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_sorted_and_nothing_is_spaced() {
        let v = json!({"b": [1, {"z": null, "a": true}], "a": "x\"\n\u{1}é", "A": -3});
        assert_eq!(
            String::from_utf8(canonical_value(&v).unwrap()).unwrap(),
            "{\"A\":-3,\"a\":\"x\\\"\\n\\u0001é\",\"b\":[1,{\"a\":true,\"z\":null}]}"
        );
    }

    #[test]
    fn the_same_value_encodes_alike_whatever_its_key_order() {
        let a: Value = serde_json::from_str(r#"{"x":1,"y":{"q":2,"p":3}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"y":{"p":3,"q":2},"x":1}"#).unwrap();
        assert_eq!(canonical_value(&a).unwrap(), canonical_value(&b).unwrap());
    }

    #[test]
    fn fractions_are_refused() {
        assert!(matches!(
            canonical_value(&json!({"n": 1.5})),
            Err(CanonicalError::Fraction(_))
        ));
    }

    #[test]
    fn keys_sort_by_utf16_code_units() {
        // U+10000 is D800 DC00 in UTF-16, before U+FF61 (FF61): the byte order says otherwise.
        let v = json!({"\u{ff61}": 1, "\u{10000}": 2});
        let text = String::from_utf8(canonical_value(&v).unwrap()).unwrap();
        assert!(text.find('\u{10000}').unwrap() < text.find('\u{ff61}').unwrap());
    }
}
