//! Envelope sealing for Takosumi's private artifacts (plan files and their `show -json`,
//! lockfiles, state files, credentials, a Run's variables, webhook secrets) with AES-256-GCM.
//!
//! This crate owns the sealed byte format, the server's sealing keys (a current key plus
//! older keys still accepted for unsealing during a rotation) and the binding of every
//! sealed object to its *purpose* and *subject* (for example a run id), so a sealed object
//! moved to another run or re-used for another purpose fails to open.
//!
//! It must never print, log or return key material or plaintext: `Debug` on [`Sealer`]
//! shows only key ids, error messages carry no secret bytes, and keys live in zeroizing
//! containers. It does no I/O besides asking the operating system for random nonces and
//! reading and writing the streams a caller hands [`Sealer::seal_stream`] and
//! [`Sealer::unseal_stream`] (the chunked format 2 for artifacts of any size, see `stream`).
//!
//! # Format (version 1, whole objects)
//!
//! ```text
//! "TKS1" | key-id length (1 byte, 1..=64) | key-id (ASCII [A-Za-z0-9._-]) | nonce (12 bytes) | ciphertext + tag (16 bytes)
//! ```
//!
//! The associated data is the header (magic, key-id length, key id), then the purpose and
//! the subject, each length-prefixed so no two (purpose, subject) pairs encode alike.
//!
//! The cipher is `ring`'s AES-256-GCM: standard AES-GCM, so the format does not depend on
//! the implementation (a unit test opens `ring`'s output with RustCrypto `aes-gcm` and the
//! reverse), but `ring` uses the CPU's wide AES/carry-less-multiply paths and seals into one
//! buffer sized for the whole envelope. With RustCrypto's `aes-gcm` and the copies
//! `Aead::encrypt` makes, a 19 MiB plan sealed at ~0.1× `openssl speed` (the bench's figure 5).
#![deny(missing_docs)]

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use takosumi_core::Secret;
use zeroize::Zeroizing;

pub mod delivery;
mod stream;

pub use stream::{CHUNK_LEN, MAGIC_V2, Streamed};

/// The magic bytes every sealed object starts with (format version 1).
pub const MAGIC: &[u8; 4] = b"TKS1";
/// Length of an AES-256 key in bytes.
pub const KEY_LEN: usize = 32;
/// Length of the random AES-GCM nonce in bytes.
pub const NONCE_LEN: usize = 12;
/// Length of the AES-GCM authentication tag in bytes.
pub const TAG_LEN: usize = 16;
/// Longest accepted key id, in characters.
pub const MAX_KEY_ID_LEN: usize = 64;

/// What a sealed object is. The purpose is bound into the associated data, so an object
/// sealed for one purpose cannot be opened as another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// A saved plan file.
    Plan,
    /// The bytes of `.terraform.lock.hcl`.
    Lockfile,
    /// A state file.
    State,
    /// A credential set.
    Credential,
    /// A module tree archive.
    Modules,
}

impl Purpose {
    /// The stable name bound into the associated data.
    pub fn as_str(self) -> &'static str {
        match self {
            Purpose::Plan => "plan",
            Purpose::Lockfile => "lockfile",
            Purpose::State => "state",
            Purpose::Credential => "credential",
            Purpose::Modules => "modules",
        }
    }
}

impl fmt::Display for Purpose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why sealing or unsealing failed. Messages never contain key material or plaintext.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// A key or key id given to [`Sealer`] is unusable; the message says why (never what).
    #[error("invalid sealing key: {0}")]
    InvalidKey(String),
    /// The bytes are not a sealed object of this format (bad magic, bad header, too short).
    #[error("sealed object is malformed")]
    Malformed,
    /// The object was sealed with a key id this sealer does not hold.
    #[error("sealed object uses unknown key id {key_id:?}")]
    UnknownKey {
        /// The key id read from the header (validated to be `[A-Za-z0-9._-]{1,64}`).
        key_id: String,
    },
    /// Authentication failed: the object was modified, or belongs to another subject or
    /// purpose, or was sealed with a different key under the same id.
    #[error(
        "sealed object failed authentication (modified, or bound to another subject or purpose)"
    )]
    Tampered,
    /// The plaintext is beyond what AES-GCM can seal under one nonce.
    #[error("plaintext too large to seal")]
    TooLarge,
    /// The operating system's random number generator failed.
    #[error("random number generator failed")]
    Randomness,
    /// Reading or writing a stream failed ([`Sealer::seal_stream`], [`Sealer::unseal_stream`]).
    #[error("{what} failed: {kind}")]
    Io {
        /// What was being read or written.
        what: &'static str,
        /// The I/O error's kind (its message could name a path; the kind cannot).
        kind: std::io::ErrorKind,
    },
}

impl SealError {
    /// Whether trying again may succeed. No sealing failure is transient.
    pub fn retryable(&self) -> bool {
        match self {
            SealError::InvalidKey(_)
            | SealError::Malformed
            | SealError::UnknownKey { .. }
            | SealError::Tampered
            | SealError::TooLarge => false,
            // An OS RNG failure is an environment fault, not a property of the input, but
            // it is not expected to clear up by itself either.
            SealError::Randomness => false,
            // A local disk or pipe: a full disk or an interrupted read may clear.
            SealError::Io { .. } => true,
        }
    }
}

/// One key: its id and its 32 bytes, zeroed on drop.
struct KeyEntry {
    id: String,
    key: Zeroizing<[u8; KEY_LEN]>,
}

impl KeyEntry {
    fn new(key_id: &str, key: &[u8]) -> Result<Self, SealError> {
        validate_key_id(key_id).map_err(SealError::InvalidKey)?;
        if key.len() != KEY_LEN {
            return Err(SealError::InvalidKey(format!(
                "key {key_id:?} must be exactly {KEY_LEN} bytes, got {} bytes",
                key.len()
            )));
        }
        let mut bytes = Zeroizing::new([0u8; KEY_LEN]);
        bytes.copy_from_slice(key);
        Ok(Self {
            id: key_id.to_owned(),
            key: bytes,
        })
    }

    /// The key schedule is built per call (microseconds) rather than kept, because `ring`
    /// does not zero a schedule on drop and the raw key here is.
    fn cipher(&self) -> LessSafeKey {
        let unbound = UnboundKey::new(&AES_256_GCM, &self.key[..])
            .expect("KeyEntry::new checked the key is exactly 32 bytes");
        LessSafeKey::new(unbound)
    }
}

/// Seals and unseals private artifacts.
///
/// Holds the current key (used for every new seal) and older keys still accepted for
/// unsealing during a rotation grace period. Cheap to clone (keys are shared, not copied);
/// `Debug` shows key ids only.
#[derive(Clone)]
pub struct Sealer {
    /// `keys[0]` is the current key; the rest are previous keys.
    keys: Arc<Vec<KeyEntry>>,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let previous: Vec<&str> = self.keys[1..].iter().map(|k| k.id.as_str()).collect();
        f.debug_struct("Sealer")
            .field("current_key_id", &self.current_key_id())
            .field("previous_key_ids", &previous)
            .finish_non_exhaustive()
    }
}

impl Sealer {
    /// A sealer whose current key is `key` (exactly 32 bytes) under `key_id`
    /// (1 to 64 characters from `[A-Za-z0-9._-]`).
    pub fn new(key_id: &str, key: &Secret<Vec<u8>>) -> Result<Self, SealError> {
        let entry = KeyEntry::new(key_id, key.expose())?;
        Ok(Self {
            keys: Arc::new(vec![entry]),
        })
    }

    /// Like [`Sealer::new`], with the key given as standard base64 (padded; surrounding
    /// whitespace is ignored).
    pub fn from_base64(key_id: &str, key_b64: &Secret<String>) -> Result<Self, SealError> {
        let key = decode_key(key_id, key_b64)?;
        Self::new(key_id, &key)
    }

    /// Also accept `key` under `key_id` for unsealing (a key being rotated out). New seals
    /// keep using the current key. Key ids must be distinct.
    pub fn with_previous_key(self, key_id: &str, key: &Secret<Vec<u8>>) -> Result<Self, SealError> {
        let entry = KeyEntry::new(key_id, key.expose())?;
        if self.keys.iter().any(|k| k.id == key_id) {
            return Err(SealError::InvalidKey(format!(
                "key id {key_id:?} is already in use"
            )));
        }
        // Rebuild the key list (keys are not `Clone`; copy them into fresh zeroizing slots).
        let mut keys: Vec<KeyEntry> = Vec::with_capacity(self.keys.len() + 1);
        for k in self.keys.iter() {
            keys.push(KeyEntry::new(&k.id, &k.key[..])?);
        }
        keys.push(entry);
        Ok(Self {
            keys: Arc::new(keys),
        })
    }

    /// The id of the key new seals use.
    pub fn current_key_id(&self) -> &str {
        &self.keys[0].id
    }

    /// Seals `plaintext` for `purpose` and `subject` (e.g. a run id) with the current key
    /// and a fresh random nonce.
    pub fn seal(
        &self,
        purpose: Purpose,
        subject: &str,
        plaintext: &[u8],
    ) -> Result<Vec<u8>, SealError> {
        let key = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| SealError::Randomness)?;

        // One allocation for the whole envelope; the plaintext is copied once and
        // encrypted where it lies.
        let header_len = MAGIC.len() + 1 + key.id.len();
        let body = header_len + NONCE_LEN;
        let mut out = Vec::with_capacity(body + plaintext.len() + TAG_LEN);
        write_header(&mut out, &key.id);
        out.extend_from_slice(&nonce);
        let aad = associated_data(&out[..header_len], purpose, subject);
        out.extend_from_slice(plaintext);
        let tag = key
            .cipher()
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&aad),
                &mut out[body..],
            )
            .map_err(|_| SealError::TooLarge)?;
        out.extend_from_slice(tag.as_ref());
        Ok(out)
    }

    /// Opens an object sealed by [`Sealer::seal`] (or, whole, by [`Sealer::seal_stream`])
    /// for the same `purpose` and `subject`, with the current key or one of the previous keys.
    pub fn unseal(
        &self,
        purpose: Purpose,
        subject: &str,
        sealed: &[u8],
    ) -> Result<Vec<u8>, SealError> {
        if sealed.starts_with(MAGIC_V2) {
            let mut out = Vec::with_capacity(sealed.len());
            self.unseal_stream(purpose, subject, sealed, &mut out)?;
            return Ok(out);
        }
        let parsed = parse(sealed)?;
        let key = self
            .keys
            .iter()
            .find(|k| k.id == parsed.key_id)
            .ok_or_else(|| SealError::UnknownKey {
                key_id: parsed.key_id.to_owned(),
            })?;
        let aad = associated_data(parsed.header, purpose, subject);
        let nonce =
            Nonce::try_assume_unique_for_key(parsed.nonce).map_err(|_| SealError::Malformed)?;
        let mut buf = parsed.ciphertext.to_vec();
        let plain_len = key
            .cipher()
            .open_in_place(nonce, Aad::from(&aad), &mut buf)
            .map_err(|_| SealError::Tampered)?
            .len();
        buf.truncate(plain_len);
        Ok(buf)
    }
}

/// The parts of a sealed object, borrowed from its bytes.
struct Parsed<'a> {
    header: &'a [u8],
    key_id: &'a str,
    nonce: &'a [u8],
    ciphertext: &'a [u8],
}

fn parse(sealed: &[u8]) -> Result<Parsed<'_>, SealError> {
    let rest = sealed
        .strip_prefix(&MAGIC[..])
        .ok_or(SealError::Malformed)?;
    let (&id_len, rest) = rest.split_first().ok_or(SealError::Malformed)?;
    let id_len = usize::from(id_len);
    if id_len == 0 || id_len > MAX_KEY_ID_LEN || rest.len() < id_len + NONCE_LEN + TAG_LEN {
        return Err(SealError::Malformed);
    }
    let (id_bytes, rest) = rest.split_at(id_len);
    let key_id = std::str::from_utf8(id_bytes).map_err(|_| SealError::Malformed)?;
    validate_key_id(key_id).map_err(|_| SealError::Malformed)?;
    let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
    Ok(Parsed {
        header: &sealed[..MAGIC.len() + 1 + id_len],
        key_id,
        nonce,
        ciphertext,
    })
}

fn write_header(out: &mut Vec<u8>, key_id: &str) {
    out.extend_from_slice(MAGIC);
    // Key ids are validated to 1..=64 ASCII characters, so the length fits in a byte.
    out.push(key_id.len() as u8);
    out.extend_from_slice(key_id.as_bytes());
}

fn associated_data(header: &[u8], purpose: Purpose, subject: &str) -> Vec<u8> {
    let purpose = purpose.as_str().as_bytes();
    let subject = subject.as_bytes();
    let mut aad = Vec::with_capacity(header.len() + 16 + purpose.len() + subject.len());
    aad.extend_from_slice(header);
    aad.extend_from_slice(&(purpose.len() as u64).to_be_bytes());
    aad.extend_from_slice(purpose);
    aad.extend_from_slice(&(subject.len() as u64).to_be_bytes());
    aad.extend_from_slice(subject);
    aad
}

fn validate_key_id(key_id: &str) -> Result<(), String> {
    if key_id.is_empty() || key_id.len() > MAX_KEY_ID_LEN {
        return Err(format!(
            "key id must be 1 to {MAX_KEY_ID_LEN} characters, got {}",
            key_id.chars().count()
        ));
    }
    if !key_id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err("key id may contain only A-Z, a-z, 0-9, '.', '_' and '-'".to_owned());
    }
    Ok(())
}

fn decode_key(key_id: &str, key_b64: &Secret<String>) -> Result<Secret<Vec<u8>>, SealError> {
    // The decoder's own error names the offending byte, so it is replaced by a message
    // that says nothing about the key's content.
    base64::engine::general_purpose::STANDARD
        .decode(key_b64.expose().trim())
        .map(Secret::new)
        .map_err(|_| SealError::InvalidKey(format!("key {key_id:?} is not valid standard base64")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUBJECT: &str = "run_01J9ZQ4V7Y8K2M3N4P5Q6R7S8T";

    fn key(byte: u8) -> Secret<Vec<u8>> {
        Secret::new(vec![byte; KEY_LEN])
    }

    fn sealer() -> Sealer {
        Sealer::new("k1", &key(7)).unwrap()
    }

    #[test]
    fn purpose_names_are_stable() {
        let all = [
            (Purpose::Plan, "plan"),
            (Purpose::Lockfile, "lockfile"),
            (Purpose::State, "state"),
            (Purpose::Credential, "credential"),
            (Purpose::Modules, "modules"),
        ];
        for (p, name) in all {
            assert_eq!(p.as_str(), name);
            assert_eq!(p.to_string(), name);
        }
    }

    /// Objects sealed before the cipher moved to `ring` (RustCrypto `aes-gcm`) still open,
    /// and what `ring` seals is standard AES-256-GCM that `aes-gcm` opens.
    #[test]
    fn ring_and_rustcrypto_aes_gcm_agree_on_the_format() {
        use aes_gcm::aead::{Aead, Payload};
        use aes_gcm::{Aes256Gcm, KeyInit};
        let s = sealer();
        let rc = Aes256Gcm::new_from_slice(&[7u8; KEY_LEN]).unwrap();
        let plain: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();

        let sealed = s.seal(Purpose::Plan, SUBJECT, &plain).unwrap();
        let parsed = parse(&sealed).unwrap();
        let aad = associated_data(parsed.header, Purpose::Plan, SUBJECT);
        let opened = rc
            .decrypt(
                aes_gcm::Nonce::from_slice(parsed.nonce),
                Payload {
                    msg: parsed.ciphertext,
                    aad: &aad,
                },
            )
            .unwrap();
        assert_eq!(opened, plain);

        let mut old = Vec::new();
        write_header(&mut old, s.current_key_id());
        let header_len = old.len();
        let nonce = [9u8; NONCE_LEN];
        old.extend_from_slice(&nonce);
        let aad = associated_data(&old[..header_len], Purpose::State, SUBJECT);
        let ct = rc
            .encrypt(
                aes_gcm::Nonce::from_slice(&nonce),
                Payload {
                    msg: &plain,
                    aad: &aad,
                },
            )
            .unwrap();
        old.extend_from_slice(&ct);
        assert_eq!(s.unseal(Purpose::State, SUBJECT, &old).unwrap(), plain);
        assert!(matches!(
            s.unseal(Purpose::Plan, SUBJECT, &old),
            Err(SealError::Tampered)
        ));
    }

    #[test]
    fn round_trips_various_sizes() {
        let s = sealer();
        let big: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
        for plaintext in [&b""[..], b"x", b"hello plan", &big[..]] {
            let sealed = s.seal(Purpose::Plan, SUBJECT, plaintext).unwrap();
            assert_eq!(
                sealed.len(),
                MAGIC.len() + 1 + 2 + NONCE_LEN + plaintext.len() + TAG_LEN
            );
            assert!(sealed.starts_with(b"TKS1\x02k1"));
            let opened = s.unseal(Purpose::Plan, SUBJECT, &sealed).unwrap();
            assert_eq!(opened, plaintext);
        }
    }

    #[test]
    fn clone_shares_keys_and_works() {
        let s = sealer();
        let c = s.clone();
        let sealed = s.seal(Purpose::State, SUBJECT, b"state").unwrap();
        assert_eq!(
            c.unseal(Purpose::State, SUBJECT, &sealed).unwrap(),
            b"state"
        );
    }

    #[test]
    fn sealer_is_send_sync_clone() {
        fn check<T: Send + Sync + Clone + 'static>() {}
        check::<Sealer>();
    }

    #[test]
    fn wrong_subject_is_tampered() {
        let s = sealer();
        let sealed = s.seal(Purpose::Plan, SUBJECT, b"plan bytes").unwrap();
        let err = s.unseal(Purpose::Plan, "run_other", &sealed).unwrap_err();
        assert!(matches!(err, SealError::Tampered), "{err:?}");
        let err = s.unseal(Purpose::Plan, "", &sealed).unwrap_err();
        assert!(matches!(err, SealError::Tampered), "{err:?}");
    }

    #[test]
    fn wrong_purpose_is_tampered() {
        let s = sealer();
        let sealed = s.seal(Purpose::Plan, SUBJECT, b"plan bytes").unwrap();
        for other in [
            Purpose::Lockfile,
            Purpose::State,
            Purpose::Credential,
            Purpose::Modules,
        ] {
            let err = s.unseal(other, SUBJECT, &sealed).unwrap_err();
            assert!(matches!(err, SealError::Tampered), "{other}: {err:?}");
        }
    }

    #[test]
    fn purpose_and_subject_cannot_be_shifted_into_each_other() {
        // The length prefixes keep ("plan", "x") and ("planx", "") style confusions apart
        // even if a future purpose name were a prefix of another.
        let a = associated_data(b"h", Purpose::Plan, "x");
        let mut b = b"h".to_vec();
        b.extend_from_slice(&5u64.to_be_bytes());
        b.extend_from_slice(b"planx");
        b.extend_from_slice(&0u64.to_be_bytes());
        assert_ne!(a, b);
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let s = sealer();
        let sealed = s
            .seal(Purpose::Lockfile, SUBJECT, b"provider \"x\" {}")
            .unwrap();
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0xff;
            let err = s.unseal(Purpose::Lockfile, SUBJECT, &bad).unwrap_err();
            assert!(
                matches!(err, SealError::Tampered | SealError::Malformed),
                "byte {i}: {err:?}"
            );
        }
    }

    #[test]
    fn every_single_bit_flip_is_rejected() {
        // A one-bit flip inside the key id can turn it into another well-formed id, which
        // is then reported as unknown; everywhere else it is Tampered or Malformed.
        let s = sealer();
        let sealed = s.seal(Purpose::Lockfile, SUBJECT, b"abc").unwrap();
        let key_id_range = MAGIC.len() + 1..MAGIC.len() + 1 + 2;
        for i in 0..sealed.len() {
            for bit in 0..8 {
                let mut bad = sealed.clone();
                bad[i] ^= 1 << bit;
                let err = s.unseal(Purpose::Lockfile, SUBJECT, &bad).unwrap_err();
                let ok = match err {
                    SealError::Tampered | SealError::Malformed => true,
                    SealError::UnknownKey { .. } => key_id_range.contains(&i) || i == MAGIC.len(),
                    _ => false,
                };
                assert!(ok, "byte {i} bit {bit}: {err:?}");
            }
        }
    }

    #[test]
    fn truncated_is_rejected() {
        let s = sealer();
        let sealed = s.seal(Purpose::Plan, SUBJECT, b"0123456789").unwrap();
        let min = MAGIC.len() + 1 + 2 + NONCE_LEN + TAG_LEN;
        for len in 0..sealed.len() {
            let err = s
                .unseal(Purpose::Plan, SUBJECT, &sealed[..len])
                .unwrap_err();
            if len < min {
                // Too short to hold a header, nonce and tag.
                assert!(matches!(err, SealError::Malformed), "len {len}: {err:?}");
            } else {
                // Structurally complete but the tag no longer matches.
                assert!(matches!(err, SealError::Tampered), "len {len}: {err:?}");
            }
        }
    }

    #[test]
    fn garbage_is_malformed() {
        let s = sealer();
        for bad in [
            &b""[..],
            b"TKS",
            b"TKS0\x02k1aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            b"TKS1\x00aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            b"TKS1\x02k/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            b"TKS1\x41aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ] {
            let err = s.unseal(Purpose::Plan, SUBJECT, bad).unwrap_err();
            assert!(matches!(err, SealError::Malformed), "{bad:?}: {err:?}");
        }
    }

    #[test]
    fn unknown_key_id() {
        let other = Sealer::new("k2", &key(9)).unwrap();
        let sealed = other.seal(Purpose::Plan, SUBJECT, b"p").unwrap();
        let err = sealer()
            .unseal(Purpose::Plan, SUBJECT, &sealed)
            .unwrap_err();
        match err {
            SealError::UnknownKey { key_id } => assert_eq!(key_id, "k2"),
            e => panic!("expected UnknownKey, got {e:?}"),
        }
    }

    #[test]
    fn same_id_different_key_is_tampered() {
        let other = Sealer::new("k1", &key(9)).unwrap();
        let sealed = other.seal(Purpose::Plan, SUBJECT, b"p").unwrap();
        let err = sealer()
            .unseal(Purpose::Plan, SUBJECT, &sealed)
            .unwrap_err();
        assert!(matches!(err, SealError::Tampered), "{err:?}");
    }

    #[test]
    fn rotation_accepts_previous_keys_and_seals_with_current() {
        let old = Sealer::new("2024-01", &key(1)).unwrap();
        let sealed_old = old.seal(Purpose::State, SUBJECT, b"old state").unwrap();

        let rotated = Sealer::new("2025-06", &key(2))
            .unwrap()
            .with_previous_key("2024-01", &key(1))
            .unwrap();
        assert_eq!(rotated.current_key_id(), "2025-06");
        assert_eq!(
            rotated
                .unseal(Purpose::State, SUBJECT, &sealed_old)
                .unwrap(),
            b"old state"
        );

        let sealed_new = rotated.seal(Purpose::State, SUBJECT, b"new state").unwrap();
        assert!(sealed_new.starts_with(b"TKS1\x072025-06"));
        assert_eq!(
            rotated
                .unseal(Purpose::State, SUBJECT, &sealed_new)
                .unwrap(),
            b"new state"
        );
        // The old-only sealer cannot open what the rotated one seals.
        assert!(matches!(
            old.unseal(Purpose::State, SUBJECT, &sealed_new),
            Err(SealError::UnknownKey { .. })
        ));
        // Without the grace key the old object is unknown.
        let no_grace = Sealer::new("2025-06", &key(2)).unwrap();
        assert!(matches!(
            no_grace.unseal(Purpose::State, SUBJECT, &sealed_old),
            Err(SealError::UnknownKey { .. })
        ));
    }

    #[test]
    fn duplicate_key_ids_are_rejected() {
        let err = sealer().with_previous_key("k1", &key(3)).unwrap_err();
        assert!(matches!(err, SealError::InvalidKey(_)), "{err:?}");
        let err = sealer()
            .with_previous_key("k0", &key(3))
            .unwrap()
            .with_previous_key("k0", &key(4))
            .unwrap_err();
        assert!(matches!(err, SealError::InvalidKey(_)), "{err:?}");
    }

    #[test]
    fn two_seals_differ() {
        let s = sealer();
        let a = s.seal(Purpose::Plan, SUBJECT, b"same").unwrap();
        let b = s.seal(Purpose::Plan, SUBJECT, b"same").unwrap();
        assert_ne!(a, b);
        let nonce = |x: &[u8]| x[7..7 + NONCE_LEN].to_vec();
        assert_ne!(nonce(&a), nonce(&b));
    }

    #[test]
    fn key_validation() {
        for len in [0usize, 1, 16, 31, 33, 64] {
            let err = Sealer::new("k", &Secret::new(vec![0u8; len])).unwrap_err();
            assert!(matches!(err, SealError::InvalidKey(_)), "len {len}");
        }
        let long = "a".repeat(MAX_KEY_ID_LEN);
        assert!(Sealer::new(&long, &key(1)).is_ok());
        assert!(Sealer::new("A-z.0_9", &key(1)).is_ok());
        for bad in [
            "",
            &"a".repeat(MAX_KEY_ID_LEN + 1),
            "k 1",
            "k/1",
            "ключ",
            "k\n",
        ] {
            let err = Sealer::new(bad, &key(1)).unwrap_err();
            assert!(matches!(err, SealError::InvalidKey(_)), "{bad:?}");
        }
        let err = sealer()
            .with_previous_key("ok", &Secret::new(vec![1u8; 31]))
            .unwrap_err();
        assert!(matches!(err, SealError::InvalidKey(_)));
        let err = sealer().with_previous_key("not ok", &key(1)).unwrap_err();
        assert!(matches!(err, SealError::InvalidKey(_)));
    }

    #[test]
    fn from_base64() {
        let raw: Vec<u8> = (0u8..32).collect();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&raw);
        let a = Sealer::from_base64("k1", &Secret::new(format!("{b64}\n"))).unwrap();
        let b = Sealer::new("k1", &Secret::new(raw)).unwrap();
        let sealed = a.seal(Purpose::Credential, SUBJECT, b"creds").unwrap();
        assert_eq!(
            b.unseal(Purpose::Credential, SUBJECT, &sealed).unwrap(),
            b"creds"
        );

        let short = base64::engine::general_purpose::STANDARD.encode([1u8; 16]);
        let err = Sealer::from_base64("k1", &Secret::new(short)).unwrap_err();
        assert!(matches!(err, SealError::InvalidKey(_)));

        // A decoding error must not echo the (secret) input.
        let canary = "CANARY$SECRET!";
        let err = Sealer::from_base64("k1", &Secret::new(canary.to_owned())).unwrap_err();
        let text = format!("{err} {err:?}");
        assert!(!text.contains("CANARY") && !text.contains('$'), "{text}");
    }

    #[test]
    fn debug_and_errors_never_show_key_bytes() {
        // A recognisable key: its bytes, hex and base64 must not appear anywhere.
        let canary: Vec<u8> = b"CANARY-KEY-0123456789abcdefghijk".to_vec();
        assert_eq!(canary.len(), KEY_LEN);
        let prev: Vec<u8> = b"PREVKEY-CANARY-0123456789abcdefg".to_vec();
        let s = Sealer::new("cur", &Secret::new(canary.clone()))
            .unwrap()
            .with_previous_key("old", &Secret::new(prev.clone()))
            .unwrap();
        let dbg = format!("{s:?} {s:#?}");
        assert!(dbg.contains("cur") && dbg.contains("old"), "{dbg}");
        for needle in ["CANARY", "PREVKEY", "67, 65, 78", "0x43", "4341", "Q0FOQV"] {
            assert!(!dbg.contains(needle), "{needle} in {dbg}");
        }

        let sealed = s.seal(Purpose::Plan, SUBJECT, b"PLAINTEXT-CANARY").unwrap();
        let errs = [
            s.unseal(Purpose::Plan, "run_x", &sealed).unwrap_err(),
            s.unseal(Purpose::Plan, SUBJECT, &sealed[..10]).unwrap_err(),
        ];
        for e in errs {
            let text = format!("{e} {e:?}");
            assert!(!text.contains("CANARY"), "{text}");
            assert!(!e.retryable());
        }
    }
}
