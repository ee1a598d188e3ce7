//! Signed audit evidence: the record of a Run that can be checked by someone who
//! trusts nothing but a public key.
//!
//! This crate owns, in one place for the server that signs and the client that verifies:
//!
//! - the **statement** written once for every Run that ended ([`Statement`], in the shape of
//!   an in-toto Statement v1 whose predicate is [`RunEvidence`]): digests, names, ids,
//!   versions and codes — never a secret, a variable's value, a log line or a message text;
//! - its **canonical JSON** ([`canonical`]: sorted keys, no whitespace, integers only), whose
//!   SHA-256 is the statement's digest;
//! - the **signature**: Ed25519 (`ring`) over the DSSE pre-authentication encoding of the
//!   canonical bytes, in a DSSE [`Envelope`] naming the key id ([`Signer`], [`PublicKey`],
//!   [`KeyRing`]);
//! - the **chain**: each statement names its Workspace, its position and the digest of the
//!   Workspace's previous statement, and [`verify_chain`] checks signatures, links and that an
//!   apply carries out exactly the plan its plan Run's statement names, saying which link broke
//!   ([`VerifyError`]);
//! - the JSON the API serves and the CLI exports ([`SignedStatement`], [`StatementPage`],
//!   [`PublishedKeys`], [`Bundle`]).
//!
//! It does no I/O (besides asking the operating system for randomness when a key is
//! generated) and never prints key material: `Debug` on [`Signer`] shows only its key id.
#![deny(missing_docs)]

pub mod canonical;
mod envelope;
mod keys;
mod statement;
mod verify;

pub use canonical::{CanonicalError, sha256_hex};
pub use envelope::{Envelope, EnvelopeSignature, PAYLOAD_TYPE, pae};
pub use keys::{
    ALGORITHM, KeyError, KeyRing, PublicKey, PublishedKey, PublishedKeys, Signer, valid_key_id,
};
pub use statement::{
    Actor, Approval, BUNDLE_FORMAT, Bundle, ChainHead, ChainLink, ChangeCounts, GateDecision,
    PREDICATE_TYPE, PlanRunRef, ProviderLock, RuleVersions, RunEvidence, RunResult, STATEMENT_TYPE,
    ScanRef, SignedStatement, SourceRef, StateVersionRef, Statement, StatementPage, Subject,
    ToolRef,
};
pub use verify::{Report, Verified, VerifyError, verify_chain, verify_run_in_chain};
