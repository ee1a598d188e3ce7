//! The Run: its kinds, its statuses and which transitions the handlers may make, the
//! change counts a plan reports, and the wake-up message the queues carry.

use serde::{Deserialize, Serialize};

use crate::ids::RunId;

/// What a Run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[cfg_attr(
    feature = "sqlx",
    derive(sqlx::Type),
    sqlx(type_name = "run_kind", rename_all = "snake_case")
)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// A plan of the Capsule's configuration.
    Plan,
    /// A destroy plan (`plan -destroy`).
    Destroy,
    /// Carries out exactly the saved plan of another Run.
    Apply,
    /// A dry-run plan that reports drift.
    DriftCheck,
}

impl RunKind {
    /// The snake_case name used in JSON and SQL.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plan => "plan",
            Self::Destroy => "destroy",
            Self::Apply => "apply",
            Self::DriftCheck => "drift_check",
        }
    }

    /// Whether this kind produces a saved plan that an Apply Run can carry out.
    pub fn is_plan_like(self) -> bool {
        matches!(self, Self::Plan | Self::Destroy | Self::DriftCheck)
    }
}

/// What a pinned apply whose plan went stale tells a person to do, in the seed's words: an
/// apply's proposal is made again (submitted again, it is planned afresh); a reconcile comes
/// from a new drift check.
pub fn stale_plan_advice(plan_kind: RunKind) -> &'static str {
    match plan_kind {
        RunKind::DriftCheck => "run the drift check again and propose the reconcile from it",
        _ => "the proposal has to be made again: submit the apply again, and it is planned afresh",
    }
}

/// Where a Run is. Which status may follow which is [`RunStatus::TRANSITIONS`]; terminal
/// statuses never change again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[cfg_attr(
    feature = "sqlx",
    derive(sqlx::Type),
    sqlx(type_name = "run_status", rename_all = "snake_case")
)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Accepted, waiting for its handler.
    Queued,
    /// Waiting for a person; the hold says why.
    Held,
    /// The plan step is running.
    Planning,
    /// Terminal for plan, destroy and drift-check Runs.
    Planned,
    /// The apply step is running.
    Applying,
    /// Terminal for Apply Runs.
    Applied,
    /// Terminal; the error code says why.
    Failed,
    /// Terminal; who canceled and when is recorded.
    Canceled,
    /// An apply stopped without a recorded result: inspect before applying anything else.
    UnknownOutcome,
}

impl RunStatus {
    /// Every status, in the order a Run meets them.
    pub const ALL: [RunStatus; 9] = [
        Self::Queued,
        Self::Held,
        Self::Planning,
        Self::Planned,
        Self::Applying,
        Self::Applied,
        Self::Failed,
        Self::Canceled,
        Self::UnknownOutcome,
    ];

    /// The status every Run is inserted with (the `runs.status` column's default).
    pub const INITIAL: RunStatus = Self::Queued;

    /// The Run lifecycle: every status change a Run may make, and no other. This is the one
    /// statement of it; every transition function in `takosumi-store` checks its
    /// `(from, to)` against it, and a change here is a change of the lifecycle.
    ///
    /// The table is about statuses only. Which kinds take which path is the callers' and
    /// the SQL conditions' business: plan, destroy and drift-check Runs go through
    /// `planning` to `planned`; Apply Runs through `applying` to `applied`. Changes that
    /// leave the status alone (the gate's decision on a `planned` plan, a cancel request
    /// on a running Run, an operator's resolution of an `unknown_outcome` apply) are not
    /// transitions.
    pub const TRANSITIONS: &'static [(RunStatus, RunStatus)] = &[
        // A step claims it: the plan step or a relay worker takes a plan-like Run; the
        // apply step or a relay worker a released Apply Run, once the Capsule is free.
        (Self::Queued, Self::Planning),
        (Self::Queued, Self::Applying),
        // The gate holds an Apply Run a rule covers; the API holds an agent's plan-like
        // Run at submission, before anything plans.
        (Self::Queued, Self::Held),
        // The dry-run hold: the plan step holds its claimed Run before `init` runs
        // anything, giving its lease back.
        (Self::Planning, Self::Held),
        // Enough approvals release a held Run to the queue it was waiting for.
        (Self::Held, Self::Queued),
        // A plan step hands its claim back after a transient fault, or the reaper takes
        // back a plan whose handler vanished, attempts left. Planning changes nothing
        // outside, so it may run again; an apply may not (no `applying` -> `queued`).
        (Self::Planning, Self::Queued),
        // The step's result, recorded by the lease holder.
        (Self::Planning, Self::Planned),
        (Self::Applying, Self::Applied),
        // A failure with a code: before any step holds the Run (a stale plan, a Capsule
        // needing inspection, attempts used up, a pool that cannot receive it) or by the
        // lease holder (any failure of the step) or the reaper (attempts used up).
        (Self::Queued, Self::Failed),
        (Self::Held, Self::Failed),
        (Self::Planning, Self::Failed),
        (Self::Applying, Self::Failed),
        // A cancel: at once while no step holds the Run, by the lease holder once the tool
        // stopped when it is running.
        (Self::Queued, Self::Canceled),
        (Self::Held, Self::Canceled),
        (Self::Planning, Self::Canceled),
        (Self::Applying, Self::Canceled),
        // An apply stopped without a recorded result (its handler vanished, or the result
        // could not be recorded): nobody knows what the tool did, so it is never retried.
        (Self::Applying, Self::UnknownOutcome),
    ];

    /// Whether the lifecycle ([`RunStatus::TRANSITIONS`]) lets a Run go from `self` to
    /// `next`.
    pub const fn can_become(self, next: RunStatus) -> bool {
        let mut i = 0;
        while i < Self::TRANSITIONS.len() {
            let (from, to) = Self::TRANSITIONS[i];
            if from as u8 == self as u8 && to as u8 == next as u8 {
                return true;
            }
            i += 1;
        }
        false
    }

    /// Terminal statuses never change again: no transition leaves them.
    pub const fn is_terminal(self) -> bool {
        let mut i = 0;
        while i < Self::TRANSITIONS.len() {
            if Self::TRANSITIONS[i].0 as u8 == self as u8 {
                return false;
            }
            i += 1;
        }
        true
    }

    /// The snake_case name used in JSON and SQL.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Held => "held",
            Self::Planning => "planning",
            Self::Planned => "planned",
            Self::Applying => "applying",
            Self::Applied => "applied",
            Self::Failed => "failed",
            Self::Canceled => "canceled",
            Self::UnknownOutcome => "unknown_outcome",
        }
    }
}

/// Who started a Run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[cfg_attr(
    feature = "sqlx",
    derive(sqlx::Type),
    sqlx(type_name = "actor_kind", rename_all = "snake_case")
)]
#[serde(rename_all = "snake_case")]
pub enum ActorKind {
    /// A person with an API token.
    User,
    /// An AI agent's token.
    Agent,
    /// Takosumi itself (a sweep, an automatic update).
    System,
}

impl ActorKind {
    /// Every kind.
    pub const ALL: &'static [Self] = &[Self::User, Self::Agent, Self::System];

    /// Its name as stored and sent.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Agent => "agent",
            Self::System => "system",
        }
    }
}

/// Resource changes counted from `show -json` (a replacement counts once as an add and
/// once as a destroy, as the tool itself reports it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Changes {
    /// Resources to create.
    pub add: i64,
    /// Resources to update in place.
    pub change: i64,
    /// Resources to delete.
    pub destroy: i64,
}

impl Changes {
    /// No resource changes at all.
    pub fn is_empty(&self) -> bool {
        self.add == 0 && self.change == 0 && self.destroy == 0
    }
}

/// The queues, one per step. A message names a Run and nothing else: the Run row is the
/// state, the message only wakes its handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Topic {
    /// `run.plan`: plan and destroy Runs.
    Plan,
    /// `run.gate`: rule decisions on plans and Apply Runs.
    Gate,
    /// `run.approve`: approvals.
    Approve,
    /// `run.apply`: released Apply Runs.
    Apply,
    /// `run.drift`: drift checks.
    Drift,
}

impl Topic {
    /// Every topic, for declaring the topology.
    pub const ALL: [Topic; 5] = [
        Self::Plan,
        Self::Gate,
        Self::Approve,
        Self::Apply,
        Self::Drift,
    ];

    /// The queue (and routing key) name.
    pub fn queue_name(self) -> &'static str {
        match self {
            Self::Plan => "run.plan",
            Self::Gate => "run.gate",
            Self::Approve => "run.approve",
            Self::Apply => "run.apply",
            Self::Drift => "run.drift",
        }
    }

    /// Parses a queue name back to its topic.
    pub fn from_queue_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.queue_name() == name)
    }
}

/// The body of every queue message: which Run to look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunMessage {
    /// The Run to wake up.
    pub run_id: RunId,
}

impl RunMessage {
    /// Parses a message body; anything else is a poison message.
    pub fn from_bytes(body: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }

    /// The JSON body.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "runId": self.run_id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actor_kinds_are_named_as_serialized() {
        for k in ActorKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
        }
    }

    #[test]
    fn terminal_statuses() {
        for s in [
            RunStatus::Planned,
            RunStatus::Applied,
            RunStatus::Failed,
            RunStatus::Canceled,
            RunStatus::UnknownOutcome,
        ] {
            assert!(s.is_terminal(), "{s:?}");
        }
        for s in [
            RunStatus::Queued,
            RunStatus::Held,
            RunStatus::Planning,
            RunStatus::Applying,
        ] {
            assert!(!s.is_terminal(), "{s:?}");
        }
    }

    /// Every status change `takosumi-store` makes, by the function that makes it (read from
    /// their `UPDATE runs SET status = … WHERE … status …` statements). When a store
    /// function starts or stops making one, this list changes with it.
    const STORE_TRANSITIONS: &[(&str, RunStatus, RunStatus)] = {
        use RunStatus::*;
        &[
            ("runs::claim (plan step)", Queued, Planning),
            ("runs::claim (via runs::claim_apply)", Queued, Applying),
            ("pools::claim_next_plan", Queued, Planning),
            ("runs::hand_back", Planning, Queued),
            ("runs::record_plan", Planning, Planned),
            ("runs::record_apply", Applying, Applied),
            ("runs::fail (no owner)", Queued, Failed),
            ("runs::fail (no owner)", Held, Failed),
            ("runs::fail (lease holder)", Planning, Failed),
            ("runs::fail (lease holder)", Applying, Failed),
            ("runs::reap_expired", Planning, Queued),
            ("runs::reap_expired", Planning, Failed),
            ("runs::reap_expired", Planning, Canceled),
            ("runs::reap_expired", Applying, UnknownOutcome),
            ("runs::hold::hold", Queued, Held),
            ("runs::hold::release", Held, Queued),
            ("runs::hold::hold_claimed", Planning, Held),
            ("runs::cancel::cancel_waiting", Queued, Canceled),
            ("runs::cancel::cancel_waiting", Held, Canceled),
            ("runs::cancel::cancel_claimed", Planning, Canceled),
            ("runs::cancel::cancel_claimed", Applying, Canceled),
            (
                "runs::unknown::mark_unknown_outcome",
                Applying,
                UnknownOutcome,
            ),
        ]
    };

    #[test]
    fn the_table_allows_exactly_what_the_store_does() {
        for &(function, from, to) in STORE_TRANSITIONS {
            assert!(
                from.can_become(to),
                "{function} moves a Run {from:?} -> {to:?}, which the lifecycle does not allow"
            );
        }
        for &(from, to) in RunStatus::TRANSITIONS {
            assert!(
                STORE_TRANSITIONS
                    .iter()
                    .any(|&(_, f, t)| (f, t) == (from, to)),
                "the lifecycle allows {from:?} -> {to:?}, which no store function makes"
            );
        }
        for from in RunStatus::ALL {
            for to in RunStatus::ALL {
                let declared = RunStatus::TRANSITIONS.contains(&(from, to));
                assert_eq!(from.can_become(to), declared, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn the_table_has_no_duplicates_and_no_self_transitions() {
        for (i, &(from, to)) in RunStatus::TRANSITIONS.iter().enumerate() {
            assert_ne!(from, to, "{from:?} -> itself is no transition");
            assert!(
                !RunStatus::TRANSITIONS[i + 1..].contains(&(from, to)),
                "{from:?} -> {to:?} is declared twice"
            );
        }
    }

    #[test]
    fn terminal_statuses_go_nowhere() {
        for from in RunStatus::ALL {
            let leaves = RunStatus::ALL.into_iter().filter(|&to| from.can_become(to));
            if from.is_terminal() {
                assert_eq!(leaves.count(), 0, "terminal {from:?} has a way out");
            } else {
                assert!(
                    leaves.count() > 0,
                    "{from:?} is not terminal but goes nowhere"
                );
            }
        }
        assert!(!RunStatus::INITIAL.is_terminal());
    }

    #[test]
    fn every_status_is_reachable_and_every_run_can_end() {
        // Reachable from where a Run starts.
        let mut reached = vec![RunStatus::INITIAL];
        let mut i = 0;
        while i < reached.len() {
            for &(from, to) in RunStatus::TRANSITIONS {
                if from == reached[i] && !reached.contains(&to) {
                    reached.push(to);
                }
            }
            i += 1;
        }
        for s in RunStatus::ALL {
            assert!(reached.contains(&s), "{s:?} cannot be reached from queued");
        }
        // Every status not terminal can still end: failed and canceled are always one
        // step away, whatever the Run is waiting for or doing.
        for s in RunStatus::ALL.into_iter().filter(|s| !s.is_terminal()) {
            assert!(s.can_become(RunStatus::Failed), "{s:?} cannot fail");
            assert!(
                s.can_become(RunStatus::Canceled),
                "{s:?} cannot be canceled"
            );
        }
    }

    #[test]
    fn an_apply_is_never_retried_automatically() {
        // Applying goes on to an end, never back to a queue or a hold: the tool may have
        // changed the provider side.
        for to in [RunStatus::Queued, RunStatus::Held, RunStatus::Planning] {
            assert!(!RunStatus::Applying.can_become(to), "applying -> {to:?}");
        }
        // And nothing becomes `unknown_outcome` but an apply that was running.
        for from in RunStatus::ALL {
            assert_eq!(
                from.can_become(RunStatus::UnknownOutcome),
                from == RunStatus::Applying,
                "{from:?} -> unknown_outcome"
            );
        }
    }

    #[test]
    fn all_lists_every_status_once() {
        // An exhaustive match: a new status does not compile here until it has a place in
        // `ALL` (and so in the lifecycle tests above).
        let place = |s: RunStatus| match s {
            RunStatus::Queued => 0,
            RunStatus::Held => 1,
            RunStatus::Planning => 2,
            RunStatus::Planned => 3,
            RunStatus::Applying => 4,
            RunStatus::Applied => 5,
            RunStatus::Failed => 6,
            RunStatus::Canceled => 7,
            RunStatus::UnknownOutcome => 8,
        };
        for (i, s) in RunStatus::ALL.into_iter().enumerate() {
            assert_eq!(place(s), i, "{s:?}");
            assert_eq!(
                serde_json::to_value(s).unwrap(),
                serde_json::json!(s.as_str())
            );
        }
    }

    #[test]
    fn messages_round_trip_and_reject_garbage() {
        let m = RunMessage {
            run_id: RunId::new(),
        };
        let bytes = serde_json::to_vec(&m.to_json()).unwrap();
        assert_eq!(RunMessage::from_bytes(&bytes).unwrap(), m);
        assert!(RunMessage::from_bytes(b"{\"runId\":\"cap_x\"}").is_err());
        assert!(RunMessage::from_bytes(b"not json").is_err());
    }

    #[test]
    fn topics_round_trip() {
        for t in Topic::ALL {
            assert_eq!(Topic::from_queue_name(t.queue_name()), Some(t));
        }
    }
}
