//! The Run: its kinds, its statuses and which transitions the handlers may make, the
//! change counts a plan reports, and the wake-up message the queues carry.

use serde::{Deserialize, Serialize};

use crate::ids::RunId;

/// What a Run does.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type, utoipa::ToSchema,
)]
#[sqlx(type_name = "run_kind", rename_all = "snake_case")]
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

/// Where a Run is. Terminal statuses never change again.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type, utoipa::ToSchema,
)]
#[sqlx(type_name = "run_status", rename_all = "snake_case")]
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
    /// Terminal statuses never change again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Planned | Self::Applied | Self::Failed | Self::Canceled | Self::UnknownOutcome
        )
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
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type, utoipa::ToSchema,
)]
#[sqlx(type_name = "actor_kind", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum ActorKind {
    /// A person with an API token.
    User,
    /// An AI agent's token.
    Agent,
    /// Takosumi itself (a sweep, an automatic update).
    System,
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
