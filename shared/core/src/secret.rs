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
    fn secret_settings_come_from_the_variable_or_its_file() {
        let dir = std::env::temp_dir().join(format!("takosumi-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("seal");
        std::fs::write(&file, "canary-file-value\n").unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, "").unwrap();
        let vars = |pairs: &[(&str, &str)]| -> std::collections::HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let path = file.display().to_string();
        assert_eq!(
            read_secret(&vars(&[("K", "direct")]), "K"),
            Ok(Some("direct".into()))
        );
        assert_eq!(
            read_secret(&vars(&[("K_FILE", &path)]), "K"),
            Ok(Some("canary-file-value".into())),
            "one trailing newline is dropped"
        );
        assert_eq!(read_secret(&vars(&[]), "K"), Ok(None));
        let both = read_secret(&vars(&[("K", "x"), ("K_FILE", &path)]), "K").unwrap_err();
        assert!(both.contains("both set"), "{both}");
        let missing = read_secret(&vars(&[("K_FILE", "/nonexistent/k")]), "K").unwrap_err();
        assert!(
            missing.contains("K_FILE") && missing.contains("cannot be read"),
            "{missing}"
        );
        let empty = read_secret(&vars(&[("K_FILE", &empty.display().to_string())]), "K");
        assert!(empty.unwrap_err().contains("is empty"));
        // An error names the setting and the file, never a value.
        assert!(!both.contains("canary") && !missing.contains("canary"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new(String::from("canary-7d1f"));
        assert!(!format!("{s:?} {s}").contains("canary"));
        assert_eq!(s.expose(), "canary-7d1f");
    }
}
