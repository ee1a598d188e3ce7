//! A plan's changes as a reviewer reads them (`GET /api/v1/runs/{run}/plan`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use takosumi_core::RunId;

/// `GET /api/v1/runs/{run}/plan`: the diff of the plan a Run made or carries out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlanView {
    /// The Run asked about.
    pub run_id: RunId,
    /// The Run whose plan it is (itself, or the plan an apply carries out).
    pub plan_run_id: RunId,
    /// The plan file's digest (what an approval is bound to).
    #[serde(default)]
    pub plan_digest: Option<String>,
    /// `null` until the plan is recorded (and for plans recorded before diffs were kept).
    #[serde(default)]
    pub diff: Option<PlanDiff>,
}

/// A plan's changes resource by resource, as a reviewer reads them: what `show -json`
/// says, with every attribute its `*_sensitive` markers cover withheld and values that are
/// only known after apply marked as such. (Callers also run it through the Run's
/// masker, which withholds any known secret wherever it appears.)
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlanDiff {
    /// Resources the plan changes, in the order `show -json` lists them.
    pub resources: Vec<ResourceDiff>,
    /// How many changing resources were left out past the runner's limit.
    pub omitted: usize,
    /// Root module outputs the plan changes (their values masked like attributes).
    #[serde(default)]
    pub outputs: Vec<AttributeDiff>,
}

/// One resource's change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceDiff {
    /// `aws_instance.web[0]`.
    pub address: String,
    /// `create`, `update`, `delete`, `replace` (delete and create, either order) or `read`.
    pub action: String,
    /// Whether a replacement creates the new object before deleting the old one.
    #[serde(default)]
    pub create_before_destroy: bool,
    /// The tool's reason (`replace_because_cannot_update`, …), when it gives one.
    pub reason: Option<String>,
    /// The attributes that change (all of them for a create or a delete).
    pub attributes: Vec<AttributeDiff>,
    /// How many attributes were left out past the runner's limit.
    #[serde(default)]
    pub omitted_attributes: usize,
}

/// One attribute's change. `before`/`after` are absent when withheld or unknown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttributeDiff {
    /// Its name.
    pub name: String,
    /// The value before (null: none).
    pub before: Option<Value>,
    /// The value after.
    pub after: Option<Value>,
    /// A sensitive value: both sides withheld.
    #[serde(default)]
    pub sensitive: bool,
    /// Known only after apply.
    #[serde(default)]
    pub unknown: bool,
    /// Changing it forces the replacement.
    #[serde(default)]
    pub forces_replacement: bool,
}
