//! A wrapper for values that must never be printed: `Debug` and `Display` show a
//! placeholder, and the memory is zeroed on drop.

use std::fmt;
use zeroize::Zeroize;

/// A secret value. The only way to read it is [`Secret::expose`], so every use is visible
/// in review.
#[derive(Clone, Default)]
pub struct Secret<T: Zeroize>(T);

impl<T: Zeroize> Secret<T> {
    /// Wraps a value.
    pub fn new(value: T) -> Self {
        Self(value)
    }

    /// Reads the value. Call sites must not log or store what they get.
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T: Zeroize> Drop for Secret<T> {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl<T: Zeroize> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl<T: Zeroize> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// A secret setting: `NAME` itself, or the contents of the file `NAME_FILE` names (a
/// mounted Secret, mode 0600; one trailing newline is dropped). Both set is an error:
/// which one wins would be a guess. Errors name the setting and the file, never a value.
pub fn read_secret<S: std::hash::BuildHasher>(
    vars: &std::collections::HashMap<String, String, S>,
    name: &str,
) -> Result<Option<String>, String> {
    let direct = vars.get(name).filter(|v| !v.is_empty());
    let file_key = format!("{name}_FILE");
    let file = vars.get(&file_key).filter(|v| !v.is_empty());
    match (direct, file) {
        (Some(_), Some(_)) => Err(format!("{name} and {file_key} are both set: keep one")),
        (Some(v), None) => Ok(Some(v.clone())),
        (None, None) => Ok(None),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("{file_key}: {path} cannot be read ({})", e.kind()))?;
            let value = text.strip_suffix('\n').unwrap_or(&text);
            let value = value.strip_suffix('\r').unwrap_or(value);
            if value.is_empty() {
                return Err(format!("{file_key}: {path} is empty"));
            }
            Ok(Some(value.to_owned()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new(String::from("canary-7d1f"));
        assert!(!format!("{s:?} {s}").contains("canary"));
        assert_eq!(s.expose(), "canary-7d1f");
    }
}
