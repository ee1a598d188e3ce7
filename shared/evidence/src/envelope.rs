//! The DSSE envelope a statement travels in: the canonical statement bytes (base64), their
//! payload type, and the signatures over the DSSE pre-authentication encoding, each naming
//! its key id. The same envelope in-toto tools read.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// The payload type of an in-toto statement.
pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";

/// A DSSE envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope {
    /// [`PAYLOAD_TYPE`].
    pub payload_type: String,
    /// The canonical statement bytes, standard base64.
    pub payload: String,
    /// The signatures (Takosumi writes exactly one).
    pub signatures: Vec<EnvelopeSignature>,
}

/// One signature of an [`Envelope`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvelopeSignature {
    /// The signing key's id (DSSE spells it `keyid`).
    pub keyid: String,
    /// The Ed25519 signature over [`pae`], standard base64.
    pub sig: String,
}

impl Envelope {
    /// An envelope around `statement` (canonical bytes) signed with `signature` by `key_id`.
    pub fn new(statement: &[u8], key_id: &str, signature: &[u8]) -> Self {
        let b64 = base64::engine::general_purpose::STANDARD;
        Self {
            payload_type: PAYLOAD_TYPE.to_owned(),
            payload: b64.encode(statement),
            signatures: vec![EnvelopeSignature {
                keyid: key_id.to_owned(),
                sig: b64.encode(signature),
            }],
        }
    }

    /// The payload bytes (`None`: not base64).
    pub fn payload_bytes(&self) -> Option<Vec<u8>> {
        base64::engine::general_purpose::STANDARD
            .decode(self.payload.as_bytes())
            .ok()
    }
}

/// DSSE's pre-authentication encoding: what is actually signed, so a signature over a
/// statement can never be read as one over another payload type.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + payload_type.len() + 32);
    out.extend_from_slice(b"DSSEv1 ");
    out.extend_from_slice(payload_type.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload_type.as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pae_is_the_dsse_encoding() {
        // The DSSE specification's own example.
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world".to_vec()
        );
    }
}
