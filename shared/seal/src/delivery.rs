//! Delivery keys: sealing to a worker pool.
//!
//! A relay worker runs on the team's own machines and never holds the server key. What it
//! must receive secretly (a saved plan file, the state, credentials) is sealed to its
//! pool's *delivery key*: an X25519 key pair whose private half only the pool's workers
//! hold and whose public half the control node stores. Sealing is ECIES-shaped: a fresh
//! ephemeral X25519 key per object, HKDF-SHA256 over the shared secret (salted with both
//! public keys, so a swapped ephemeral key derives another key and fails to open) gives an
//! AES-256-GCM key, and the ciphertext is an ordinary [`Sealer`] envelope under the
//! delivery key's id, so purpose and subject (the run id) stay bound as associated data.
//!
//! # Format
//!
//! ```text
//! "TKD1" | ephemeral public key (32 bytes) | a TKS1 envelope whose key id is the delivery key id
//! ```
//!
//! The control node can seal but never open (it has no private key); a worker whose key
//! id is not the one an object names gets [`DeliveryError::WrongKey`], never garbage.

use hkdf::Hkdf;
use sha2::Sha256;
use takosumi_core::Secret;
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use crate::{KEY_LEN, MAGIC, Purpose, SealError, Sealer, validate_key_id};

/// The magic bytes of a delivery envelope (format version 1).
pub const DELIVERY_MAGIC: &[u8; 4] = b"TKD1";
/// Length of an X25519 public key.
pub const PUBLIC_KEY_LEN: usize = 32;
const INFO: &[u8] = b"takosumi delivery key v1";

/// Why a delivery envelope could not be made or opened. Carries no secret bytes.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// A key or key id is malformed.
    #[error("invalid delivery key: {0}")]
    InvalidKey(String),
    /// The object is sealed to another delivery key (by id) than the ones given.
    #[error("sealed to delivery key {key_id:?}, which this worker does not hold")]
    WrongKey {
        /// The key id the object names.
        key_id: String,
    },
    /// Not a delivery envelope.
    #[error("not a delivery envelope")]
    Malformed,
    /// The envelope does not open for this purpose and subject (altered, or moved from
    /// another run).
    #[error("the envelope does not open (altered, or sealed for another run)")]
    Tampered,
    /// Sealing failed (randomness or size).
    #[error("sealing failed: {0}")]
    Seal(#[from] SealError),
}

fn derive(shared: &[u8; 32], ephemeral: &[u8; 32], recipient: &[u8; 32]) -> Zeroizing<Vec<u8>> {
    let mut salt = [0u8; 64];
    salt[..32].copy_from_slice(ephemeral);
    salt[32..].copy_from_slice(recipient);
    let hk = Hkdf::<Sha256>::new(Some(&salt), shared);
    let mut okm = Zeroizing::new(vec![0u8; KEY_LEN]);
    // 32 bytes is always a valid HKDF-SHA256 output length.
    let _ = hk.expand(INFO, &mut okm);
    okm
}

fn random_secret() -> Result<StaticSecret, DeliveryError> {
    use aes_gcm::aead::OsRng;
    use aes_gcm::aead::rand_core::RngCore;
    let mut bytes = Zeroizing::new([0u8; 32]);
    OsRng
        .try_fill_bytes(&mut bytes[..])
        .map_err(|_| DeliveryError::Seal(SealError::Randomness))?;
    Ok(StaticSecret::from(*bytes))
}

/// The public half of a pool's delivery key, as the control node stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryPublicKey {
    /// The key id (same rules as server key ids), written into every envelope.
    pub key_id: String,
    /// The X25519 public key.
    pub public: [u8; PUBLIC_KEY_LEN],
}

impl DeliveryPublicKey {
    /// A public key from its id and 32 raw bytes.
    pub fn new(key_id: &str, public: &[u8]) -> Result<Self, DeliveryError> {
        validate_key_id(key_id).map_err(|e| DeliveryError::InvalidKey(e.to_string()))?;
        let public: [u8; PUBLIC_KEY_LEN] = public.try_into().map_err(|_| {
            DeliveryError::InvalidKey(format!(
                "a delivery public key is {PUBLIC_KEY_LEN} bytes, not {}",
                public.len()
            ))
        })?;
        Ok(Self {
            key_id: key_id.to_owned(),
            public,
        })
    }

    /// Seals `plaintext` to this key for `purpose` and `subject` (e.g. the run id).
    pub fn seal(
        &self,
        purpose: Purpose,
        subject: &str,
        plaintext: &[u8],
    ) -> Result<Vec<u8>, DeliveryError> {
        let ephemeral = random_secret()?;
        let ephemeral_public = PublicKey::from(&ephemeral);
        let shared = ephemeral.diffie_hellman(&PublicKey::from(self.public));
        let key = derive(shared.as_bytes(), ephemeral_public.as_bytes(), &self.public);
        let sealer = Sealer::new(&self.key_id, &Secret::new(key.to_vec()))?;
        let inner = sealer.seal(purpose, subject, plaintext)?;
        let mut out = Vec::with_capacity(4 + PUBLIC_KEY_LEN + inner.len());
        out.extend_from_slice(DELIVERY_MAGIC);
        out.extend_from_slice(ephemeral_public.as_bytes());
        out.extend_from_slice(&inner);
        Ok(out)
    }
}

/// The key id a delivery envelope names, without opening it.
pub fn envelope_key_id(sealed: &[u8]) -> Result<String, DeliveryError> {
    let inner = sealed
        .strip_prefix(&DELIVERY_MAGIC[..])
        .and_then(|r| r.get(PUBLIC_KEY_LEN..))
        .ok_or(DeliveryError::Malformed)?;
    let rest = inner
        .strip_prefix(&MAGIC[..])
        .ok_or(DeliveryError::Malformed)?;
    let (&len, rest) = rest.split_first().ok_or(DeliveryError::Malformed)?;
    let id = rest
        .get(..usize::from(len))
        .ok_or(DeliveryError::Malformed)?;
    let id = std::str::from_utf8(id).map_err(|_| DeliveryError::Malformed)?;
    validate_key_id(id).map_err(|_| DeliveryError::Malformed)?;
    Ok(id.to_owned())
}

/// A worker's delivery key pair. `Debug` shows the key id only; the private half is
/// zeroized on drop.
pub struct DeliveryKeyPair {
    key_id: String,
    secret: StaticSecret,
}

impl std::fmt::Debug for DeliveryKeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryKeyPair")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl DeliveryKeyPair {
    /// A new random key pair under `key_id`.
    pub fn generate(key_id: &str) -> Result<Self, DeliveryError> {
        validate_key_id(key_id).map_err(|e| DeliveryError::InvalidKey(e.to_string()))?;
        Ok(Self {
            key_id: key_id.to_owned(),
            secret: random_secret()?,
        })
    }

    /// A key pair from its 32-byte private key.
    pub fn from_private(key_id: &str, private: &[u8]) -> Result<Self, DeliveryError> {
        validate_key_id(key_id).map_err(|e| DeliveryError::InvalidKey(e.to_string()))?;
        let bytes: Zeroizing<[u8; 32]> = Zeroizing::new(
            private
                .try_into()
                .map_err(|_| DeliveryError::InvalidKey("a private key is 32 bytes".into()))?,
        );
        Ok(Self {
            key_id: key_id.to_owned(),
            secret: StaticSecret::from(*bytes),
        })
    }

    /// The key id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The 32 private bytes (to store in the worker's key file; never send them).
    pub fn private_bytes(&self) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(self.secret.to_bytes())
    }

    /// The public half, to register with the control node.
    pub fn public(&self) -> DeliveryPublicKey {
        DeliveryPublicKey {
            key_id: self.key_id.clone(),
            public: *PublicKey::from(&self.secret).as_bytes(),
        }
    }

    /// Opens an envelope sealed to this key for `purpose` and `subject`.
    pub fn open(
        &self,
        purpose: Purpose,
        subject: &str,
        sealed: &[u8],
    ) -> Result<Vec<u8>, DeliveryError> {
        let named = envelope_key_id(sealed)?;
        if named != self.key_id {
            return Err(DeliveryError::WrongKey { key_id: named });
        }
        let ephemeral: [u8; 32] = sealed[4..4 + PUBLIC_KEY_LEN]
            .try_into()
            .map_err(|_| DeliveryError::Malformed)?;
        let inner = &sealed[4 + PUBLIC_KEY_LEN..];
        let shared = self.secret.diffie_hellman(&PublicKey::from(ephemeral));
        let own_public = *PublicKey::from(&self.secret).as_bytes();
        let key = derive(shared.as_bytes(), &ephemeral, &own_public);
        let sealer = Sealer::new(&self.key_id, &Secret::new(key.to_vec()))?;
        sealer
            .unseal(purpose, subject, inner)
            .map_err(|_| DeliveryError::Tampered)
    }
}

/// Opens `sealed` with whichever of `keys` it names (a worker keeps its previous key for
/// the rotation grace).
pub fn open_with_any(
    keys: &[DeliveryKeyPair],
    purpose: Purpose,
    subject: &str,
    sealed: &[u8],
) -> Result<Vec<u8>, DeliveryError> {
    let named = envelope_key_id(sealed)?;
    match keys.iter().find(|k| k.key_id == named) {
        Some(k) => k.open(purpose, subject, sealed),
        None => Err(DeliveryError::WrongKey { key_id: named }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a pool's key pair seals opens only with that pair, for the same purpose and
    /// run; another pool's key, another run, another purpose or a flipped byte fail with
    /// a named error, never with garbage.
    #[test]
    fn sealing_to_a_delivery_key_round_trips_and_binds() {
        let pair = DeliveryKeyPair::generate("pool-a-1").unwrap();
        let public = pair.public();
        let plan = b"a saved plan file with a secret-canary inside".repeat(100);
        let sealed = public.seal(Purpose::Plan, "run_1", &plan).unwrap();
        assert!(sealed.starts_with(DELIVERY_MAGIC));
        assert!(!sealed.windows(13).any(|w| w == b"secret-canary"));
        assert_eq!(envelope_key_id(&sealed).unwrap(), "pool-a-1");
        assert_eq!(pair.open(Purpose::Plan, "run_1", &sealed).unwrap(), plan);
        // Two seals of the same bytes differ (fresh ephemeral key and nonce).
        assert_ne!(sealed, public.seal(Purpose::Plan, "run_1", &plan).unwrap());

        assert!(matches!(
            pair.open(Purpose::Plan, "run_2", &sealed),
            Err(DeliveryError::Tampered)
        ));
        assert!(matches!(
            pair.open(Purpose::State, "run_1", &sealed),
            Err(DeliveryError::Tampered)
        ));
        // Another pool's key with the same id derives another key.
        let other = DeliveryKeyPair::generate("pool-a-1").unwrap();
        assert!(matches!(
            other.open(Purpose::Plan, "run_1", &sealed),
            Err(DeliveryError::Tampered)
        ));
        let other_id = DeliveryKeyPair::generate("pool-b-1").unwrap();
        assert!(matches!(
            other_id.open(Purpose::Plan, "run_1", &sealed),
            Err(DeliveryError::WrongKey { key_id }) if key_id == "pool-a-1"
        ));
        for at in [5, 40, sealed.len() - 1] {
            let mut bad = sealed.clone();
            bad[at] ^= 1;
            assert!(
                pair.open(Purpose::Plan, "run_1", &bad).is_err(),
                "byte {at}"
            );
        }
        assert!(matches!(
            pair.open(Purpose::Plan, "run_1", b"TKS1junk"),
            Err(DeliveryError::Malformed)
        ));
    }

    /// Rotation: a worker holding its previous and current key opens envelopes sealed to
    /// either; once the previous key is dropped, an old envelope fails `WrongKey`.
    #[test]
    fn rotation_keeps_the_previous_key_until_it_is_dropped() {
        let old = DeliveryKeyPair::generate("k1").unwrap();
        let new = DeliveryKeyPair::generate("k2").unwrap();
        let to_old = old.public().seal(Purpose::Plan, "r", b"old").unwrap();
        let to_new = new.public().seal(Purpose::Plan, "r", b"new").unwrap();
        let restored = DeliveryKeyPair::from_private("k1", &old.private_bytes()[..]).unwrap();
        assert_eq!(restored.public(), old.public());
        let both = [new, restored];
        assert_eq!(
            open_with_any(&both, Purpose::Plan, "r", &to_old).unwrap(),
            b"old"
        );
        assert_eq!(
            open_with_any(&both, Purpose::Plan, "r", &to_new).unwrap(),
            b"new"
        );
        let [new, _] = both;
        assert!(matches!(
            open_with_any(&[new], Purpose::Plan, "r", &to_old),
            Err(DeliveryError::WrongKey { .. })
        ));
        assert!(!format!("{old:?}").contains(&hex_of(&old.private_bytes()[..])));
        assert!(DeliveryPublicKey::new("k", &[0u8; 31]).is_err());
        assert!(DeliveryPublicKey::new("bad id!", &[0u8; 32]).is_err());
    }

    fn hex_of(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}
