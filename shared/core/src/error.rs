//! What a step returns: an [`Outcome`] when it did (or rightly skipped) its work, a
//! [`StepError`] when it could not, saying whether a retry can help. Failure codes that
//! end a Run are [`FailureCode`]s, recorded on the Run for people and scripts.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A machine-readable reason a Run failed. The text form is stable API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCode {
    /// The tool refused the saved plan as stale.
    StalePlan,
    /// The sealed plan no longer matches the digest recorded at plan time.
    PlanDigestMismatch,
    /// The checked-out source differs from the plan's.
    SourceChanged,
    /// The module tree or provider lock differs from the plan's.
    DependencyChanged,
    /// The Capsule's state moved on since the plan.
    StateGenerationChanged,
    /// The provider lockfile differs.
    LockfileMismatch,
    /// The provider lockfile is over 1 MiB.
    LockfileTooLarge,
    /// The Run records a provider lockfile, but its stored artifact (or the reference to
    /// it) is gone.
    LockfileMissing,
    /// The Run's lockfile reference points at an artifact that belongs to another Run.
    LockfileCrossRun,
    /// The plan file is over the relay limit.
    PlanTooLarge,
    /// Checking the source out failed.
    CheckoutFailed,
    /// `init` failed.
    InitFailed,
    /// `plan` failed.
    PlanFailed,
    /// `apply` failed.
    ApplyFailed,
    /// The handler gave up after its bounded attempts.
    AttemptsExhausted,
    /// The Run's configuration is not usable (unknown tool, bad directory).
    InvalidConfiguration,
    /// A pull request's plan declares a data source that acts (or cannot be read in full),
    /// so it is refused rather than run.
    DryRunScanRefused,
    /// A credential of the Capsule's ProviderBindings could not be resolved (a
    /// command-source credential failed, or a binding cannot be opened).
    CredentialFailed,
    /// The Capsule's current StateVersion does not open or does not hash to its recorded
    /// digest (altered, replaced or removed in storage): nothing runs on top of it.
    StateIntegrity,
    /// An earlier apply of the Capsule ended `unknown_outcome` and no operator has resolved
    /// it yet: nothing else is applied until a person has inspected the provider side and
    /// recorded it (`POST /runs/{id}/resolve`).
    CapsuleNeedsInspection,
    /// A git or tool step ran past its time limit and was stopped (for an apply whose tool
    /// had started, the Run is `unknown_outcome` instead).
    TimedOut,
    /// The runner sandbox could not start the Run's processes.
    SandboxUnavailable,
    /// A drift check of a Capsule with nothing applied to compare against (no StateVersion,
    /// or its last apply was a destroy): it never plans the branch head instead.
    NotApplied,
    /// The tool applied, then a later step of the Run failed (reading its outputs): the
    /// state it wrote is recorded and current, the Run failed after it.
    AfterApplyFailed,
}

impl FailureCode {
    /// The stable snake_case code.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StalePlan => "stale_plan",
            Self::PlanDigestMismatch => "plan_digest_mismatch",
            Self::SourceChanged => "source_changed",
            Self::DependencyChanged => "dependency_changed",
            Self::StateGenerationChanged => "state_generation_changed",
            Self::LockfileMismatch => "lockfile_mismatch",
            Self::LockfileTooLarge => "lockfile_too_large",
            Self::LockfileMissing => "lockfile_missing",
            Self::LockfileCrossRun => "lockfile_cross_run",
            Self::PlanTooLarge => "plan_too_large",
            Self::CheckoutFailed => "checkout_failed",
            Self::InitFailed => "init_failed",
            Self::PlanFailed => "plan_failed",
            Self::ApplyFailed => "apply_failed",
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::InvalidConfiguration => "invalid_configuration",
            Self::DryRunScanRefused => "dry_run_scan_refused",
            Self::CredentialFailed => "credential_failed",
            Self::StateIntegrity => "state_integrity",
            Self::CapsuleNeedsInspection => "capsule_needs_inspection",
            Self::TimedOut => "timed_out",
            Self::SandboxUnavailable => "sandbox_unavailable",
            Self::NotApplied => "not_applied",
            Self::AfterApplyFailed => "after_apply_failed",
        }
    }
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a handler did with a message. Every variant means "ack it".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The step ran and committed its result.
    Done,
    /// The step ran and the Run failed with a recorded code.
    Failed(FailureCode),
    /// Nothing to do: the Run is claimed by another handler, already past this step, or
    /// not in a state this step acts on. Duplicate messages end here.
    Skipped(&'static str),
    /// The Run must wait (e.g. another apply holds the Capsule); it will be woken again.
    Deferred(&'static str),
}

/// Why a step could not finish. `retryable()` tells the consumer whether trying again
/// later can help.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A dependency (database, object store, broker) failed in a way that may pass.
    #[error("transient failure: {0}")]
    Transient(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The message names no Run, or a Run this step can never process.
    #[error("message cannot be processed: {0}")]
    Poison(String),
    /// A bug or broken invariant; retrying will not help.
    #[error("internal error: {0}")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl StepError {
    /// Whether trying the same message again later can help.
    pub fn retryable(&self) -> bool {
        matches!(self, Self::Transient(_))
    }

    /// Wraps a transient cause.
    pub fn transient<E: std::error::Error + Send + Sync + 'static>(e: E) -> Self {
        Self::Transient(Box::new(e))
    }

    /// Wraps an internal cause.
    pub fn internal<E: std::error::Error + Send + Sync + 'static>(e: E) -> Self {
        Self::Internal(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_serialize_as_their_text() {
        let json = serde_json::to_string(&FailureCode::StateGenerationChanged).unwrap();
        assert_eq!(json, "\"state_generation_changed\"");
        assert_eq!(
            FailureCode::PlanDigestMismatch.as_str(),
            "plan_digest_mismatch"
        );
        for code in [
            FailureCode::LockfileMissing,
            FailureCode::LockfileCrossRun,
            FailureCode::LockfileTooLarge,
            FailureCode::LockfileMismatch,
        ] {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
        }
        assert_eq!(FailureCode::LockfileMissing.as_str(), "lockfile_missing");
        assert_eq!(FailureCode::LockfileCrossRun.as_str(), "lockfile_cross_run");
    }

    #[test]
    fn only_transient_errors_retry() {
        let io = std::io::Error::other("down");
        assert!(StepError::transient(io).retryable());
        assert!(!StepError::Poison("x".into()).retryable());
    }
}
