//! The answers of the gate and detection endpoints that are not a Run or a Capsule:
//! an approval, a rule set, a RunGroup started, and what a RunGroup's approve or apply did
//! to each of its Runs. The API serializes these types and the client reads them.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use takosumi_core::{CapsuleId, GroupKind, HoldReason, RunGroupId, RunId, RunStatus, WorkspaceId};

use crate::{Code, ErrorCode, Run, null_as_default};

/// How far a held Run's approvals are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApprovalCount {
    /// Distinct approvals bound to the Run's plan digest, of the roles that count.
    pub given: i64,
    /// How many the hold needs.
    pub required: i64,
}

/// `POST /api/v1/runs/{run}/approve`: the Run after the approval, and the count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Approved {
    /// The Run.
    #[serde(flatten)]
    pub run: Run,
    /// The approvals so far.
    pub approvals: ApprovalCount,
}

/// `POST /api/v1/capsules/{cap}/apply`: the Run it started, and what made it plan first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApplySubmitted {
    /// The Run: an Apply Run that runs in one step, or a plan Run whose Apply Run the gate
    /// proposes once it is planned.
    #[serde(flatten)]
    pub run: Run,
    /// The rules that cover the apply, so it plans first (empty: it runs in one step; a
    /// reason newer than this build reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Vec<HoldReason>)]
    pub covered_by: Vec<Code<HoldReason>>,
}

/// `PUT`/`GET …/rules`: a Workspace's or a Capsule's rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RulesAnswer {
    /// The Workspace or Capsule id they apply to.
    pub scope: String,
    /// Their version (`None`: none were ever set).
    #[serde(default)]
    pub version: Option<i64>,
    /// The rules (an empty object when none are set).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub rules: Value,
}

/// A Capsule a RunGroup left out, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SkippedCapsule {
    /// The Capsule.
    pub capsule_id: CapsuleId,
    /// Why (`not_applied`: a drift check of a Capsule never applied).
    #[schema(value_type = String)]
    pub code: Code<ErrorCode>,
}

/// `POST /api/v1/workspaces/{ws}/plan-update` or `…/drift-check`: the RunGroup started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupStarted {
    /// `rg_…`
    pub id: RunGroupId,
    /// The Workspace.
    pub workspace_id: WorkspaceId,
    /// `plan_update` or `drift_check`.
    #[schema(value_type = GroupKind)]
    pub kind: Code<GroupKind>,
    /// The Runs it started, one per Capsule.
    #[serde(default, deserialize_with = "null_as_default")]
    pub run_ids: Vec<RunId>,
    /// The Capsules it left out.
    #[serde(default, deserialize_with = "null_as_default")]
    pub skipped: Vec<SkippedCapsule>,
}

/// Why a RunGroup's action left one of its Runs as it was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResultError {
    /// The stable code, as the single-Run endpoint answers it.
    #[schema(value_type = String)]
    pub code: Code<ErrorCode>,
    /// What to do.
    #[serde(default, deserialize_with = "null_as_default")]
    pub message: String,
}

/// What a RunGroup's approve or apply did to one Run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupResult {
    /// The held Run an approve was for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The planned Run an apply was for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_run_id: Option<RunId>,
    /// The Apply Run proposed for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apply_run_id: Option<RunId>,
    /// The approved Run's status after the approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RunStatus>,
    /// The approved Run's approvals so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvals: Option<ApprovalCount>,
    /// Why the Run was left as it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ResultError>,
}

impl GroupResult {
    /// The Run this result is about.
    pub fn subject(&self) -> Option<RunId> {
        self.run_id.or(self.plan_run_id)
    }
}

/// `POST /api/v1/run-groups/{rg}/approve` or `…/apply`: what it did to each Run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GroupResults {
    /// `rg_…`
    pub id: RunGroupId,
    /// One per Run it acted on.
    #[serde(default, deserialize_with = "null_as_default")]
    pub results: Vec<GroupResult>,
}
