//! What a Run event records (`run_events.kind`): a closed set, written by the store, the
//! runtime, the steps and the API, and a few of them reported by a relay worker.

crate::text_enum! {
    /// The kind of a Run event: a step or transition of the Run's ordered record.
    pub enum EventKind("event kind") {
        /// The Run was created (its `queued` start; the sweep writes it in SQL too).
        Queued = "queued",
        /// A step claimed it.
        Claimed = "claimed",
        /// A step handed it back to the queue after a transient fault.
        Requeued = "requeued",
        /// The checkout began.
        CheckoutStarted = "checkout_started",
        /// Variables and credentials were prepared (names only).
        EnvironmentPrepared = "environment_prepared",
        /// The source was checked out (commit and tree digest).
        CheckedOut = "checked_out",
        /// The tool started a command (`init`, `get`, `plan`, `apply`, …).
        ToolStarted = "tool_started",
        /// The dry-run scan's report.
        DryRunScan = "dry_run_scan",
        /// A pin (source snapshot, dependency snapshot, plan digest) was checked.
        PinChecked = "pin_checked",
        /// The plan was recorded.
        Planned = "planned",
        /// The gate recorded its decision.
        GateDecision = "gate_decision",
        /// Held for people.
        Held = "held",
        /// An approval was given.
        Approved = "approved",
        /// Released from a hold.
        Released = "released",
        /// The apply's new StateVersion was written.
        StateVersionWritten = "state_version_written",
        /// Storing the new state failed; it is being tried again.
        StateStoreRetrying = "state_store_retrying",
        /// The apply was recorded.
        Applied = "applied",
        /// The Run failed.
        Failed = "failed",
        /// A cancel was requested of the running step.
        CancelRequested = "cancel_requested",
        /// The Run was canceled.
        Canceled = "canceled",
        /// The apply ended without a recorded result.
        UnknownOutcome = "unknown_outcome",
        /// An operator resolved an `unknown_outcome` apply.
        Resolved = "resolved",
        /// The reaper queued a plan again whose handler vanished.
        LeaseExpiredRequeued = "lease_expired_requeued",
        /// The reaper ended an apply whose handler vanished `unknown_outcome`.
        LeaseExpiredUnknownOutcome = "lease_expired_unknown_outcome",
        /// The reaper ended a plan someone asked to cancel whose handler vanished.
        LeaseExpiredCanceled = "lease_expired_canceled",
        /// The reaper failed a plan whose handlers vanished too often.
        LeaseExpiredFailed = "lease_expired_failed",
        /// The reaper sent a lost wake-up again.
        WakeUpResent = "wake_up_resent",
    }
}

impl EventKind {
    /// The kinds a relay worker may report (`POST …/progress`): what it observed while
    /// working. What the control node decides or records (`approved`, `applied`,
    /// `state_version_written`, `gate_decision`, …) is never taken from a worker.
    pub const WORKER: &'static [Self] = &[
        Self::CheckoutStarted,
        Self::EnvironmentPrepared,
        Self::CheckedOut,
        Self::ToolStarted,
        Self::DryRunScan,
        Self::PinChecked,
    ];

    /// Whether a relay worker may report this kind ([`Self::WORKER`]).
    pub fn reported_by_worker(self) -> bool {
        Self::WORKER.contains(&self)
    }
}

#[cfg(test)]
mod tests {
    use super::EventKind;

    #[test]
    fn a_worker_reports_only_what_it_observed() {
        for decided in [
            EventKind::Queued,
            EventKind::Claimed,
            EventKind::Planned,
            EventKind::GateDecision,
            EventKind::Approved,
            EventKind::Applied,
            EventKind::StateVersionWritten,
            EventKind::Failed,
            EventKind::Canceled,
        ] {
            assert!(!decided.reported_by_worker(), "{decided}");
        }
    }
}
