//! What a step returns: an [`Outcome`] when it did (or rightly skipped) its work, a
//! [`StepError`] when it could not, saying whether a retry can help. Failure codes that
//! end a Run are [`FailureCode`]s, recorded on the Run for people and scripts.

crate::text_enum! {
    /// A machine-readable reason a Run failed. The text form is stable API.
    pub enum FailureCode("failure code") {
        /// The tool refused the saved plan as stale.
        StalePlan = "stale_plan",
        /// The sealed plan no longer matches the digest recorded at plan time.
        PlanDigestMismatch = "plan_digest_mismatch",
        /// The checked-out source differs from the plan's.
        SourceChanged = "source_changed",
        /// The module tree or provider lock differs from the plan's.
        DependencyChanged = "dependency_changed",
        /// The Capsule's state moved on since the plan.
        StateGenerationChanged = "state_generation_changed",
        /// The provider lockfile differs.
        LockfileMismatch = "lockfile_mismatch",
        /// The provider lockfile is over 1 MiB.
        LockfileTooLarge = "lockfile_too_large",
        /// The Run records a provider lockfile, but its stored artifact (or the reference to
        /// it) is gone.
        LockfileMissing = "lockfile_missing",
        /// The Run's lockfile reference points at an artifact that belongs to another Run.
        LockfileCrossRun = "lockfile_cross_run",
        /// The plan file is over the relay limit.
        PlanTooLarge = "plan_too_large",
        /// Checking the source out failed.
        CheckoutFailed = "checkout_failed",
        /// `init` failed.
        InitFailed = "init_failed",
        /// `plan` failed.
        PlanFailed = "plan_failed",
        /// `apply` failed.
        ApplyFailed = "apply_failed",
        /// The handler gave up after its bounded attempts.
        AttemptsExhausted = "attempts_exhausted",
        /// The Run's configuration is not usable (unknown tool, bad directory).
        InvalidConfiguration = "invalid_configuration",
        /// A pull request's plan declares a data source that acts (or cannot be read in full),
        /// so it is refused rather than run.
        DryRunScanRefused = "dry_run_scan_refused",
        /// A credential of the Capsule's ProviderBindings could not be resolved (a
        /// command-source credential failed, or a binding cannot be opened).
        CredentialFailed = "credential_failed",
        /// The Capsule's current StateVersion does not open or does not hash to its recorded
        /// digest (altered, replaced or removed in storage): nothing runs on top of it.
        StateIntegrity = "state_integrity",
        /// An earlier apply of the Capsule ended `unknown_outcome` and no operator has resolved
        /// it yet: nothing else is applied until a person has inspected the provider side and
        /// recorded it (`POST /runs/{id}/resolve`).
        CapsuleNeedsInspection = "capsule_needs_inspection",
        /// A git or tool step ran past its time limit and was stopped (for an apply whose tool
        /// had started, the Run is `unknown_outcome` instead).
        TimedOut = "timed_out",
        /// The runner sandbox could not start the Run's processes.
        SandboxUnavailable = "sandbox_unavailable",
        /// A drift check of a Capsule with nothing applied to compare against (no StateVersion,
        /// or its last apply was a destroy): it never plans the branch head instead.
        NotApplied = "not_applied",
        /// The tool applied, then a later step of the Run failed (reading its outputs): the
        /// state it wrote is recorded and current, the Run failed after it.
        AfterApplyFailed = "after_apply_failed",
        /// A gated apply's Capsule runs on a worker pool that has no delivery key, so its
        /// saved plan cannot be delivered there.
        PoolHasNoDeliveryKey = "pool_has_no_delivery_key",
        /// A relay worker could not open what was sealed to its delivery key.
        DeliveryKeyUnopenable = "delivery_key_unopenable",
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
