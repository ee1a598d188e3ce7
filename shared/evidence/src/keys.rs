//! The server's evidence signing key and the public keys statements are checked against.
//!
//! A signing key is an Ed25519 seed (32 bytes, standard base64: `TAKOSUMI_EVIDENCE_KEY`)
//! with a key id (`TAKOSUMI_EVIDENCE_KEY_ID`). Rotating it means starting the API with a new
//! seed and id and listing the old public key in `TAKOSUMI_EVIDENCE_PREVIOUS_KEYS`
//! (`id:base64,…`), so statements it signed stay verifiable: keys are published, never
//! withdrawn.

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair as _, UnparsedPublicKey};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::envelope::{Envelope, PAYLOAD_TYPE, pae};

/// The only signature algorithm, as published with each key.
pub const ALGORITHM: &str = "ed25519";
/// Length of an Ed25519 seed and of a public key, in bytes.
const KEY_LEN: usize = 32;
/// Longest key id.
const MAX_KEY_ID_LEN: usize = 64;

/// A key that cannot be used. Messages name the key id, never key bytes.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key id is not 1-64 of `[A-Za-z0-9._-]`.
    #[error("evidence key id {0:?} must be 1-64 letters, digits, '.', '_' or '-'")]
    BadKeyId(String),
    /// The private key is not a base64 32-byte Ed25519 seed.
    #[error(
        "the evidence signing key must be a 32-byte Ed25519 seed in standard base64 (e.g. `head -c32 /dev/urandom | base64`)"
    )]
    BadSeed,
    /// A public key is not a base64 32-byte Ed25519 public key.
    #[error(
        "the public key of evidence key {0:?} is not a 32-byte Ed25519 public key in standard base64"
    )]
    BadPublicKey(String),
    /// A published key names another algorithm.
    #[error("evidence key {key_id:?} is published for {algorithm:?}; only ed25519 is used")]
    BadAlgorithm {
        /// The key id.
        key_id: String,
        /// The algorithm named.
        algorithm: String,
    },
    /// A list entry is not `id:base64`.
    #[error("{0:?} is not `key-id:base64-public-key`")]
    BadEntry(String),
    /// The same key id twice, with different keys.
    #[error("evidence key id {0:?} is listed twice with different keys")]
    Duplicate(String),
    /// The operating system gave no randomness.
    #[error("no randomness available to generate a key")]
    Random,
}

/// Whether `id` may name a key.
pub fn valid_key_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_KEY_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn check_key_id(id: &str) -> Result<(), KeyError> {
    if valid_key_id(id) {
        Ok(())
    } else {
        Err(KeyError::BadKeyId(id.to_owned()))
    }
}

/// The server's signing key: its id and the Ed25519 key pair. Cheap to clone; `Debug`
/// shows the key id only.
#[derive(Clone)]
pub struct Signer {
    key_id: String,
    pair: Arc<Ed25519KeyPair>,
}

impl fmt::Debug for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signer")
            .field("key_id", &self.key_id)
            .field("key", &"[redacted]")
            .finish()
    }
}

impl Signer {
    /// A signer from a base64 32-byte seed (`TAKOSUMI_EVIDENCE_KEY`).
    pub fn from_seed_base64(key_id: &str, seed_base64: &str) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let seed = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(seed_base64.trim().as_bytes())
                .map_err(|_| KeyError::BadSeed)?,
        );
        if seed.len() != KEY_LEN {
            return Err(KeyError::BadSeed);
        }
        let pair = Ed25519KeyPair::from_seed_unchecked(&seed).map_err(|_| KeyError::BadSeed)?;
        Ok(Self {
            key_id: key_id.to_owned(),
            pair: Arc::new(pair),
        })
    }

    /// A new random key: the signer and its seed in base64 (to be kept as
    /// `TAKOSUMI_EVIDENCE_KEY`; shown once).
    pub fn generate(key_id: &str) -> Result<(Self, Zeroizing<String>), KeyError> {
        use ring::rand::SecureRandom as _;
        let mut seed = Zeroizing::new([0u8; KEY_LEN]);
        ring::rand::SystemRandom::new()
            .fill(&mut seed[..])
            .map_err(|_| KeyError::Random)?;
        let text = Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(&seed[..]));
        Ok((Self::from_seed_base64(key_id, &text)?, text))
    }

    /// The key id statements name.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The public half, to publish.
    pub fn public_key(&self) -> PublicKey {
        let mut bytes = [0u8; KEY_LEN];
        bytes.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey {
            key_id: self.key_id.clone(),
            bytes,
        }
    }

    /// Signs canonical statement bytes: the DSSE envelope.
    pub fn sign(&self, statement: &[u8]) -> Envelope {
        let sig = self.pair.sign(&pae(PAYLOAD_TYPE, statement));
        Envelope::new(statement, &self.key_id, sig.as_ref())
    }
}

/// A public key and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    key_id: String,
    bytes: [u8; KEY_LEN],
}

impl PublicKey {
    /// A public key from its id and standard base64.
    pub fn from_base64(key_id: &str, public_base64: &str) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(public_base64.trim().as_bytes())
            .map_err(|_| KeyError::BadPublicKey(key_id.to_owned()))?;
        let bytes: [u8; KEY_LEN] = raw
            .try_into()
            .map_err(|_| KeyError::BadPublicKey(key_id.to_owned()))?;
        Ok(Self {
            key_id: key_id.to_owned(),
            bytes,
        })
    }

    /// `TAKOSUMI_EVIDENCE_PREVIOUS_KEYS`: `id:base64,id:base64` (empty: none).
    pub fn parse_list(text: &str) -> Result<Vec<Self>, KeyError> {
        text.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|entry| {
                let (id, key) = entry
                    .split_once(':')
                    .ok_or_else(|| KeyError::BadEntry(entry.to_owned()))?;
                Self::from_base64(id.trim(), key)
            })
            .collect()
    }

    /// Its id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// Standard base64 of the 32 key bytes.
    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.bytes)
    }

    /// `id:base64`, the form `TAKOSUMI_EVIDENCE_PREVIOUS_KEYS` lists.
    pub fn to_entry(&self) -> String {
        format!("{}:{}", self.key_id, self.to_base64())
    }

    /// Whether `signature` is this key's over `message`.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ED25519, &self.bytes)
            .verify(message, signature)
            .is_ok()
    }
}

/// The public keys statements are checked against, by key id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyRing {
    keys: Vec<PublicKey>,
}

impl KeyRing {
    /// A ring of `keys`; the same id twice must be the same key.
    pub fn new(keys: Vec<PublicKey>) -> Result<Self, KeyError> {
        let mut ring: Vec<PublicKey> = Vec::with_capacity(keys.len());
        for k in keys {
            match ring.iter().find(|r| r.key_id == k.key_id) {
                Some(r) if r.bytes != k.bytes => return Err(KeyError::Duplicate(k.key_id)),
                Some(_) => {}
                None => ring.push(k),
            }
        }
        Ok(Self { keys: ring })
    }

    /// The key with `key_id`.
    pub fn get(&self, key_id: &str) -> Option<&PublicKey> {
        self.keys.iter().find(|k| k.key_id == key_id)
    }

    /// The key ids, in order.
    pub fn key_ids(&self) -> Vec<&str> {
        self.keys.iter().map(|k| k.key_id.as_str()).collect()
    }

    /// The keys.
    pub fn keys(&self) -> &[PublicKey] {
        &self.keys
    }
}

/// One key as `GET /api/v1/evidence/keys` publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishedKey {
    /// The id statements name.
    pub key_id: String,
    /// [`ALGORITHM`].
    pub algorithm: String,
    /// Standard base64 of the 32 public key bytes.
    pub public_key: String,
    /// Whether the server signs new statements with it (the rest were rotated out).
    pub current: bool,
}

/// `GET /api/v1/evidence/keys`: every key the server has signed statements with.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PublishedKeys {
    /// The current key first, then the rotated-out ones.
    pub keys: Vec<PublishedKey>,
}

impl PublishedKeys {
    /// The current key of `signer` and the `previous` public keys.
    pub fn new(signer: &Signer, previous: &[PublicKey]) -> Self {
        let entry = |k: &PublicKey, current| PublishedKey {
            key_id: k.key_id.clone(),
            algorithm: ALGORITHM.to_owned(),
            public_key: k.to_base64(),
            current,
        };
        let current = signer.public_key();
        let mut keys = vec![entry(&current, true)];
        keys.extend(
            previous
                .iter()
                .filter(|k| k.key_id != current.key_id)
                .map(|k| entry(k, false)),
        );
        Self { keys }
    }

    /// The keys as a ring to verify with.
    pub fn to_ring(&self) -> Result<KeyRing, KeyError> {
        let mut keys = Vec::with_capacity(self.keys.len());
        for k in &self.keys {
            if k.algorithm != ALGORITHM {
                return Err(KeyError::BadAlgorithm {
                    key_id: k.key_id.clone(),
                    algorithm: k.algorithm.clone(),
                });
            }
            keys.push(PublicKey::from_base64(&k.key_id, &k.public_key)?);
        }
        KeyRing::new(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_with_its_public_key_only() {
        let (signer, seed) = Signer::generate("e1").unwrap();
        let again = Signer::from_seed_base64("e1", &seed).unwrap();
        assert_eq!(signer.public_key(), again.public_key());
        let env = signer.sign(b"{}");
        let sig = base64::engine::general_purpose::STANDARD
            .decode(&env.signatures[0].sig)
            .unwrap();
        let msg = pae(PAYLOAD_TYPE, b"{}");
        assert!(signer.public_key().verifies(&msg, &sig));
        assert!(
            !signer
                .public_key()
                .verifies(&pae(PAYLOAD_TYPE, b"[]"), &sig)
        );
        let (other, _) = Signer::generate("e2").unwrap();
        assert!(!other.public_key().verifies(&msg, &sig));
    }

    #[test]
    fn debug_never_shows_the_key() {
        let (signer, seed) = Signer::generate("e1").unwrap();
        let printed = format!("{signer:?}");
        assert!(
            printed.contains("e1") && !printed.contains(seed.as_str()),
            "{printed}"
        );
    }

    #[test]
    fn bad_keys_and_lists_are_refused() {
        assert!(matches!(
            Signer::from_seed_base64("e1", "c2hvcnQ="),
            Err(KeyError::BadSeed)
        ));
        assert!(matches!(
            Signer::from_seed_base64("bad id", &"A".repeat(44)),
            Err(KeyError::BadKeyId(_))
        ));
        let (a, _) = Signer::generate("a").unwrap();
        let (b, _) = Signer::generate("b").unwrap();
        let list = format!(
            "{}, {}",
            a.public_key().to_entry(),
            b.public_key().to_entry()
        );
        let keys = PublicKey::parse_list(&list).unwrap();
        assert_eq!(keys, vec![a.public_key(), b.public_key()]);
        assert!(PublicKey::parse_list("").unwrap().is_empty());
        assert!(matches!(
            PublicKey::parse_list("nocolon"),
            Err(KeyError::BadEntry(_))
        ));
        assert!(matches!(
            PublicKey::parse_list("a:AAAA"),
            Err(KeyError::BadPublicKey(_))
        ));
        let clash = PublicKey::from_base64("a", &b.public_key().to_base64()).unwrap();
        assert!(matches!(
            KeyRing::new(vec![a.public_key(), clash]),
            Err(KeyError::Duplicate(_))
        ));
    }

    #[test]
    fn published_keys_round_trip_to_a_ring() {
        let (old, _) = Signer::generate("e1").unwrap();
        let (new, _) = Signer::generate("e2").unwrap();
        let published = PublishedKeys::new(&new, &[old.public_key()]);
        assert_eq!(published.keys[0].key_id, "e2");
        assert!(published.keys[0].current && !published.keys[1].current);
        let ring = published.to_ring().unwrap();
        assert_eq!(ring.key_ids(), vec!["e2", "e1"]);
        assert_eq!(ring.get("e1"), Some(&old.public_key()));
    }
}
