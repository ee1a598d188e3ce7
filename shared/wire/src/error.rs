//! The API's error contract: [`ErrorCode`], the closed set of `code`s an error body can
//! carry, and [`ErrorBody`], the body the API answers every error with. Readers that may
//! talk to a newer API (the client, the relay worker, a Run's `error`) hold a code as
//! [`Code`], which keeps a code they do not know as its text.

use std::fmt;
use std::hash::{Hash, Hasher};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use takosumi_core::{EventKind, FailureCode, HoldReason, Tool};

/// Declares [`ErrorCode`] once: the variant, and the wire string it must serialize as (a
/// test checks serde and [`ErrorCode::as_str`] agree).
macro_rules! error_codes {
    ($($variant:ident => $wire:literal,)*) => {
        /// Every `code` an API error body can carry: a closed set, so the OpenAPI
        /// document lists them as an `enum` and a new code cannot appear unlisted.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
        #[serde(rename_all = "snake_case")]
        #[allow(missing_docs)]
        pub enum ErrorCode {
            $($variant,)*
        }

        impl ErrorCode {
            /// Every code.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The wire string (`invalid_id`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }
        }
    };
}

error_codes! {
    AfterApplyFailed => "after_apply_failed",
    AlreadyApproved => "already_approved",
    AlreadyResolved => "already_resolved",
    AlreadyRevoked => "already_revoked",
    ApplyExists => "apply_exists",
    ApplyFailed => "apply_failed",
    AttemptsExhausted => "attempts_exhausted",
    AutoApplyPersonOnly => "auto_apply_person_only",
    BindingExists => "binding_exists",
    CapsuleBusy => "capsule_busy",
    CapsuleExists => "capsule_exists",
    CapsuleNeedsInspection => "capsule_needs_inspection",
    CheckoutFailed => "checkout_failed",
    Conflict => "conflict",
    CostUnavailable => "cost_unavailable",
    CredentialFailed => "credential_failed",
    CurrentStateUnreadable => "current_state_unreadable",
    DeliveryKeyExpired => "delivery_key_expired",
    DeliveryKeyIdUsed => "delivery_key_id_used",
    DeliveryKeyUnknown => "delivery_key_unknown",
    DeliveryKeyUnopenable => "delivery_key_unopenable",
    DependencyChanged => "dependency_changed",
    DryRunScanRefused => "dry_run_scan_refused",
    EnvNameConflict => "env_name_conflict",
    EvidenceMissing => "evidence_missing",
    EvidencePending => "evidence_pending",
    Forbidden => "forbidden",
    HeldStateUnreadable => "held_state_unreadable",
    IdempotencyKeyReused => "idempotency_key_reused",
    InitFailed => "init_failed",
    Internal => "internal",
    InvalidAction => "invalid_action",
    InvalidAutoApply => "invalid_auto_apply",
    InvalidBinding => "invalid_binding",
    InvalidCode => "invalid_code",
    InvalidConfiguration => "invalid_configuration",
    InvalidCursor => "invalid_cursor",
    InvalidDeliveryId => "invalid_delivery_id",
    InvalidDeliveryKey => "invalid_delivery_key",
    InvalidDir => "invalid_dir",
    InvalidEvent => "invalid_event",
    InvalidExpiry => "invalid_expiry",
    InvalidFilter => "invalid_filter",
    InvalidGrace => "invalid_grace",
    InvalidId => "invalid_id",
    InvalidIdempotencyKey => "invalid_idempotency_key",
    InvalidIds => "invalid_ids",
    InvalidInterval => "invalid_interval",
    InvalidJson => "invalid_json",
    InvalidLimit => "invalid_limit",
    InvalidLockfile => "invalid_lockfile",
    InvalidName => "invalid_name",
    InvalidNote => "invalid_note",
    InvalidPolicy => "invalid_policy",
    InvalidQuery => "invalid_query",
    InvalidReport => "invalid_report",
    InvalidRequest => "invalid_request",
    InvalidRole => "invalid_role",
    InvalidRules => "invalid_rules",
    InvalidSandbox => "invalid_sandbox",
    InvalidSelection => "invalid_selection",
    InvalidSignature => "invalid_signature",
    InvalidSource => "invalid_source",
    InvalidState => "invalid_state",
    InvalidTool => "invalid_tool",
    InvalidVars => "invalid_vars",
    LockfileCrossRun => "lockfile_cross_run",
    LockfileMismatch => "lockfile_mismatch",
    LockfileMissing => "lockfile_missing",
    LockfileTooLarge => "lockfile_too_large",
    MethodNotAllowed => "method_not_allowed",
    MissingState => "missing_state",
    NoCancelRequested => "no_cancel_requested",
    NoHeldState => "no_held_state",
    NoKeptPlan => "no_kept_plan",
    NoSelection => "no_selection",
    NoSuchEndpoint => "no_such_endpoint",
    NotAPlan => "not_a_plan",
    NotApplied => "not_applied",
    NotApplying => "not_applying",
    NotFound => "not_found",
    NotHeld => "not_held",
    NotOneStep => "not_one_step",
    NotPlanning => "not_planning",
    NotUnknownOutcome => "not_unknown_outcome",
    NotYourClaim => "not_your_claim",
    PayloadTooLarge => "payload_too_large",
    PlanAlreadyUsed => "plan_already_used",
    PlanDigestMismatch => "plan_digest_mismatch",
    PlanFailed => "plan_failed",
    PlanFileExists => "plan_file_exists",
    PlanFileMissing => "plan_file_missing",
    PlanNotReady => "plan_not_ready",
    PlanTooLarge => "plan_too_large",
    PoolExists => "pool_exists",
    PoolHasNoDeliveryKey => "pool_has_no_delivery_key",
    RunFinished => "run_finished",
    RunInFlight => "run_in_flight",
    RunNotEnded => "run_not_ended",
    SandboxUnavailable => "sandbox_unavailable",
    SelfApproval => "self_approval",
    SourceChanged => "source_changed",
    SpeculativePlan => "speculative_plan",
    StalePlan => "stale_plan",
    StateGenerationChanged => "state_generation_changed",
    StateIntegrity => "state_integrity",
    StateLineageMismatch => "state_lineage_mismatch",
    StateSerialOlder => "state_serial_older",
    StateTooLarge => "state_too_large",
    TimedOut => "timed_out",
    Unauthorized => "unauthorized",
    Unavailable => "unavailable",
    UnexpectedState => "unexpected_state",
    UnknownQueue => "unknown_queue",
    UnknownWorkspace => "unknown_workspace",
    UnsupportedMediaType => "unsupported_media_type",
    WorkspaceExists => "workspace_exists",
    WrongPool => "wrong_pool",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Run failure code answered as an API error (a relayed Run whose inputs cannot be
/// delivered is failed with it, and the worker is told the same code).
impl From<takosumi_core::FailureCode> for ErrorCode {
    fn from(code: takosumi_core::FailureCode) -> Self {
        use takosumi_core::FailureCode as F;
        match code {
            F::StalePlan => Self::StalePlan,
            F::PlanDigestMismatch => Self::PlanDigestMismatch,
            F::SourceChanged => Self::SourceChanged,
            F::DependencyChanged => Self::DependencyChanged,
            F::StateGenerationChanged => Self::StateGenerationChanged,
            F::LockfileMismatch => Self::LockfileMismatch,
            F::LockfileTooLarge => Self::LockfileTooLarge,
            F::LockfileMissing => Self::LockfileMissing,
            F::LockfileCrossRun => Self::LockfileCrossRun,
            F::PlanTooLarge => Self::PlanTooLarge,
            F::CheckoutFailed => Self::CheckoutFailed,
            F::InitFailed => Self::InitFailed,
            F::PlanFailed => Self::PlanFailed,
            F::ApplyFailed => Self::ApplyFailed,
            F::AttemptsExhausted => Self::AttemptsExhausted,
            F::InvalidConfiguration => Self::InvalidConfiguration,
            F::DryRunScanRefused => Self::DryRunScanRefused,
            F::CredentialFailed => Self::CredentialFailed,
            F::StateIntegrity => Self::StateIntegrity,
            F::CapsuleNeedsInspection => Self::CapsuleNeedsInspection,
            F::TimedOut => Self::TimedOut,
            F::SandboxUnavailable => Self::SandboxUnavailable,
            F::NotApplied => Self::NotApplied,
            F::AfterApplyFailed => Self::AfterApplyFailed,
            F::PoolHasNoDeliveryKey => Self::PoolHasNoDeliveryKey,
            F::DeliveryKeyUnopenable => Self::DeliveryKeyUnopenable,
        }
    }
}

/// The body of every API error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// Stable and machine-readable.
    pub code: ErrorCode,
    /// What to do, safe to show.
    pub message: String,
}

/// A closed set of codes a [`Code`] may hold as known: its values and their wire strings.
pub trait KnownCode: Copy + fmt::Debug + 'static {
    /// Every value.
    const ALL: &'static [Self];
    /// The wire string.
    fn wire(self) -> &'static str;
}

// Each closed set a reader holds as a `Code`: its values and names are its own.
macro_rules! known_codes {
    ($($set:ty),+ $(,)?) => {$(
        impl KnownCode for $set {
            const ALL: &'static [Self] = <$set>::ALL;
            fn wire(self) -> &'static str {
                self.as_str()
            }
        }
    )+};
}

impl KnownCode for takosumi_core::Role {
    const ALL: &'static [Self] = &takosumi_core::Role::ALL;
    fn wire(self) -> &'static str {
        self.as_str()
    }
}

known_codes!(
    ErrorCode,
    FailureCode,
    Tool,
    EventKind,
    HoldReason,
    takosumi_core::ResolutionAction,
    takosumi_core::CapsuleStatus,
    takosumi_core::ActorKind,
    takosumi_core::SandboxMode,
    takosumi_core::GroupKind,
    takosumi_core::BindingKind,
    takosumi_core::ActivityKind,
);

/// A code as a reader of the API holds it: one of the codes this build knows, or the text
/// of one it does not (an API newer than the reader answers codes added since), so the
/// reader can still show and compare it. It reads and writes as the bare string, compares
/// by its wire string, and equals a `&str` or a `K` with that string.
#[derive(Debug, Clone)]
pub enum Code<K = ErrorCode> {
    /// A code this build knows.
    Known(K),
    /// Any other text, as received.
    Other(String),
}

impl<K: KnownCode> Code<K> {
    /// The code `text` names: [`Code::Known`] when it is one of `K`'s.
    pub fn new(text: impl Into<String>) -> Self {
        let text = text.into();
        match K::ALL.iter().find(|k| k.wire() == text) {
            Some(k) => Self::Known(*k),
            None => Self::Other(text),
        }
    }

    /// The wire string.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Known(k) => k.wire(),
            Self::Other(text) => text,
        }
    }

    /// The known code, if it is one.
    pub fn known(&self) -> Option<K> {
        match self {
            Self::Known(k) => Some(*k),
            Self::Other(_) => None,
        }
    }

    /// Whether the code is the empty string (a body that carried none).
    pub fn is_empty(&self) -> bool {
        self.as_str().is_empty()
    }
}

/// No code: what a body that carries `null` or nothing reads as.
impl<K> Default for Code<K> {
    fn default() -> Self {
        Self::Other(String::new())
    }
}

impl<K: KnownCode> From<K> for Code<K> {
    fn from(k: K) -> Self {
        Self::Known(k)
    }
}

impl<K: KnownCode> From<&str> for Code<K> {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl<K: KnownCode> From<String> for Code<K> {
    fn from(text: String) -> Self {
        Self::new(text)
    }
}

impl<K: KnownCode> fmt::Display for Code<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, not `write_str`, so widths in a caller's format apply.
        f.pad(self.as_str())
    }
}

// By wire string, so `Other("not_found")` (built by hand) still equals the known code.
impl<K: KnownCode> PartialEq for Code<K> {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl<K: KnownCode> Eq for Code<K> {}

impl<K: KnownCode> Hash for Code<K> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl<K: KnownCode> PartialEq<K> for Code<K> {
    fn eq(&self, other: &K) -> bool {
        self.as_str() == other.wire()
    }
}

impl<K: KnownCode> PartialEq<str> for Code<K> {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl<K: KnownCode> PartialEq<&str> for Code<K> {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl<K: KnownCode> Serialize for Code<K> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de, K: KnownCode> Deserialize<'de> for Code<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Self::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire strings tests and clients match on are what serde writes.
    #[test]
    fn codes_serialize_as_their_wire_strings() {
        for code in ErrorCode::ALL {
            assert_eq!(
                serde_json::to_value(code).unwrap(),
                code.as_str(),
                "{code:?}"
            );
        }
    }

    /// A code the reader knows reads as itself; one it does not keeps its text; both write
    /// back the string they were read from.
    #[test]
    fn codes_read_known_and_unknown() {
        let known: Code = serde_json::from_str(r#""not_your_claim""#).unwrap();
        assert_eq!(known, Code::Known(ErrorCode::NotYourClaim));
        assert_eq!(known, ErrorCode::NotYourClaim);
        assert_eq!(known, "not_your_claim");
        assert_eq!(known.known(), Some(ErrorCode::NotYourClaim));

        let newer: Code = serde_json::from_str(r#""added_later""#).unwrap();
        assert_eq!(newer, Code::Other("added_later".into()));
        assert_eq!(newer.known(), None);
        assert_eq!(newer.to_string(), "added_later");
        assert_eq!(serde_json::to_string(&newer).unwrap(), r#""added_later""#);

        let failure: Code<FailureCode> = serde_json::from_str(r#""stale_plan""#).unwrap();
        assert_eq!(failure, FailureCode::StalePlan);
        let outside: Code<FailureCode> = serde_json::from_str(r#""unknown_outcome""#).unwrap();
        assert_eq!(outside, "unknown_outcome");

        assert_eq!(
            Code::<ErrorCode>::Other("not_found".into()),
            ErrorCode::NotFound
        );
        assert_eq!(
            format!("[{:<10}]", Code::<ErrorCode>::new("conflict")),
            "[conflict  ]"
        );
    }
}
