//! The one digest every record names: SHA-256 in lowercase hex (plan files, lockfiles,
//! states, module trees). The evidence crate keeps its own copy on purpose: a verifier
//! links nothing of Takosumi's but it.

use sha2::Digest;

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    #[test]
    fn digests_are_lowercase_hex_sha256() {
        assert_eq!(
            super::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
