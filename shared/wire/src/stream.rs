//! Approvals of a Run and the live stream of a Run (`GET /api/v1/runs/{run}/stream`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use takosumi_core::{Role, RunId, RunStatus};

use crate::{Code, RunEvent};

/// `GET /api/v1/runs/{run}/approvals`: what the rule in force needs and who gave what.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalsView {
    /// The Run.
    pub run_id: RunId,
    /// Distinct approvals the hold needs (0: none).
    pub required: i32,
    /// Roles whose approvals count (empty on a Run that was never held).
    #[serde(default)]
    #[schema(value_type = Vec<Role>)]
    pub approver_roles: Vec<Code<Role>>,
    /// Approvals given, oldest first.
    #[serde(default)]
    pub given: Vec<GivenApproval>,
}

/// One approval given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GivenApproval {
    /// The approver's token id.
    pub approver: String,
    /// The role it had.
    #[schema(value_type = Role)]
    pub role: Code<Role>,
    /// The plan digest it approved.
    #[serde(default)]
    pub plan_digest: Option<String>,
    /// What the approver wrote.
    #[serde(default)]
    pub note: Option<String>,
    /// When.
    pub at: DateTime<Utc>,
}

/// One Server-Sent Event of `GET /api/v1/runs/{run}/stream`; its SSE `event:` name is the
/// `type` tag, its `data:` this JSON. The stream sends every event and log chunk so far,
/// then new ones as they are stored, and ends with `end` once the Run settled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum StreamEvent {
    /// An entry of the Run's event record.
    Event {
        /// The entry.
        event: RunEvent,
    },
    /// A chunk of (masked) tool output.
    Log {
        /// The step that printed it.
        step: String,
        /// The text.
        text: String,
    },
    /// The Run's status changed (also sent first).
    Status {
        /// Its status now.
        status: RunStatus,
    },
    /// The Run reached a status it leaves only by a person's action; the stream ends.
    End {
        /// That status.
        status: RunStatus,
    },
}

impl StreamEvent {
    /// The SSE `event:` name.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::Event { .. } => "event",
            StreamEvent::Log { .. } => "log",
            StreamEvent::Status { .. } => "status",
            StreamEvent::End { .. } => "end",
        }
    }
}
