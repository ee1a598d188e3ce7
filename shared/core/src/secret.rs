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
