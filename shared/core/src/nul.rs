//! NUL characters in what a Capsule's code or a tool produced. Neither a tool's environment
//! nor Postgres (`text`, or a `jsonb` string or key) can hold one, and a tool prints and
//! plans whatever the Capsule's values hold (HCL writes a NUL `"\u0000"`). Input a person
//! sends is refused with one ([`holds_nul`]); what a tool produced is kept with each NUL
//! shown as U+FFFD ([`without_nul`], [`json_without_nul`]), since refusing it would fail
//! the Run for its content.

use std::borrow::Cow;

use serde_json::Value;

/// Whether a string anywhere in `value` (an object's keys included) holds a NUL character.
pub fn holds_nul(value: &Value) -> bool {
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) if s.contains('\0') => return true,
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                if map.keys().any(|k| k.contains('\0')) {
                    return true;
                }
                stack.extend(map.values());
            }
            _ => {}
        }
    }
    false
}

/// `text` with each NUL shown as U+FFFD (borrowed when it has none).
pub fn without_nul(text: &str) -> Cow<'_, str> {
    if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(text)
    }
}

/// `value` with each NUL in its strings and keys shown as U+FFFD (borrowed when it has
/// none, the common case: one scan, no copy).
pub fn json_without_nul(value: &Value) -> Cow<'_, Value> {
    if !holds_nul(value) {
        return Cow::Borrowed(value);
    }
    fn replace(v: &mut Value) {
        match v {
            Value::String(s) => {
                if let Cow::Owned(o) = without_nul(s) {
                    *s = o;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(replace),
            Value::Object(map) => {
                let old = std::mem::take(map);
                for (k, mut item) in old {
                    replace(&mut item);
                    map.insert(without_nul(&k).into_owned(), item);
                }
            }
            _ => {}
        }
    }
    let mut owned = value.clone();
    replace(&mut owned);
    Cow::Owned(owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nuls_are_found_anywhere_and_shown_as_u_fffd() {
        for v in [
            json!("a\u{0}b"),
            json!(["ok", "a\u{0}b"]),
            json!({"k": ["a\u{0}b"]}),
            json!({"k\u{0}": 1}),
        ] {
            assert!(holds_nul(&v), "{v}");
            let clean = json_without_nul(&v);
            assert!(!holds_nul(&clean), "{clean}");
            assert!(clean.to_string().contains('\u{FFFD}'), "{clean}");
        }
        let plain = json!({"k": ["a", 1, null, {"x": "y"}], "u": "\\u0000"});
        assert!(!holds_nul(&plain));
        assert!(matches!(json_without_nul(&plain), Cow::Borrowed(_)));
        assert_eq!(without_nul("x\0y\0"), "x\u{FFFD}y\u{FFFD}");
        assert!(matches!(without_nul("plain"), Cow::Borrowed(_)));
    }
}
