//! The wire contract: the JSON shapes that cross a process boundary between the API and
//! its clients (the CLI, the dashboard, users' scripts, the relay worker), as serde types
//! and nothing else. The API's dashboard reads its own API through these types, so a field
//! the API renames breaks a build, not a page.
//!
//! Decoding of the client types is tolerant: fields that do not apply may be `null` or
//! absent, and unknown fields are kept in `extra` so they can be printed as received. The
//! relay protocol ([`relay`]) is strict about the fields a job needs.

#![deny(missing_docs)]

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use takosumi_core::{
    ActivityKind, ActorKind, ApplyMode, BindingKind, CapsuleId, CapsuleStatus, Changes, EventKind,
    FailureCode, GroupKind, HoldReason, ProviderBindingId, ResolutionAction, RunGroupId, RunId,
    RunKind, RunStatus, SandboxMode, StateVersionId, Tool, WorkspaceId,
};

mod error;
mod gates;
mod plan;
pub mod relay;
mod stream;
mod tokens;

pub use error::{Code, ErrorBody, ErrorCode, KnownCode};
pub use gates::{
    ApplySubmitted, ApprovalCount, Approved, GroupResult, GroupResults, GroupStarted, ResultError,
    RulesAnswer, SkippedCapsule,
};
pub use plan::{AttributeDiff, PlanDiff, PlanView, ResourceDiff};
pub use stream::{ApprovalsView, GivenApproval, StreamEvent};
pub use tokens::{CreatedToken, NewToken, TokenList, TokenView};

/// A Workspace: a group of Capsules with shared rules and history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Workspace {
    /// `ws_…`
    pub id: WorkspaceId,
    /// Its unique name.
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    /// Fields this client does not know, kept so they can be printed as received.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// Where a Capsule's configuration lives.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Source {
    /// The Git URL.
    #[serde(default, deserialize_with = "null_as_default")]
    pub repo: String,
    /// The branch that is planned.
    #[serde(default, deserialize_with = "null_as_default")]
    pub branch: String,
}

/// The body of `POST /api/v1/workspaces/{ws}/capsules`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NewCapsule {
    /// Unique within the Workspace.
    pub name: String,
    /// Repository and branch.
    pub source: Source,
    /// The directory of `.tf`/`.tofu` files inside the repository.
    pub dir: String,
    /// `tofu` or `terraform`.
    pub tool: String,
    /// Input variables.
    #[schema(value_type = Object)]
    pub vars: Map<String, Value>,
}

/// A registered Capsule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Capsule {
    /// `cap_…`
    pub id: CapsuleId,
    /// The Workspace it belongs to.
    pub workspace_id: WorkspaceId,
    /// Unique within the Workspace.
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    /// Repository and branch.
    #[serde(default, deserialize_with = "null_as_default")]
    pub source: Source,
    /// The configuration directory inside the repository.
    #[serde(default, deserialize_with = "null_as_default")]
    pub dir: String,
    /// The tool its Runs use (a tool newer than this build reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Tool)]
    pub tool: Code<Tool>,
    /// Input variables.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Object)]
    pub vars: Map<String, Value>,
    /// Bumped by every StateVersion an apply writes.
    #[serde(default, deserialize_with = "null_as_default")]
    pub state_generation: i64,
    /// The StateVersion the Capsule is at, if any apply wrote one.
    #[serde(default)]
    pub current_state_version_id: Option<StateVersionId>,
    /// What it is doing or what was detected, the first that holds (a status newer than
    /// this build reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = CapsuleStatus)]
    pub status: Code<CapsuleStatus>,
    /// The branch moved past what was planned (a push was seen).
    #[serde(default, deserialize_with = "null_as_default")]
    pub stale: bool,
    /// The latest drift check found reality differing from what was applied.
    #[serde(default, deserialize_with = "null_as_default")]
    pub drifted: bool,
    /// What the latest finished drift check found: `Some(true)` drift, `Some(false)` none,
    /// `None` no check finished yet.
    #[serde(default)]
    pub drift: Option<bool>,
    /// The worker pool its Runs go to; `None`: the control node's own queues.
    #[serde(default)]
    pub pool: Option<String>,
    /// The names of every variable (values only in `vars`, and only where shown).
    #[serde(default, deserialize_with = "null_as_default")]
    pub var_names: Vec<String>,
    /// Variables whose values are not shown: sensitive in the configuration, not planned
    /// yet, or the caller's role may not edit the Capsule.
    #[serde(default, deserialize_with = "null_as_default")]
    pub withheld_vars: Vec<String>,
    /// When it was registered.
    #[serde(default)]
    pub created_at: Option<DateTime<Utc>>,
    /// Fields this client does not know, kept so they can be printed as received.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// The commit a Run executed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceSnapshot {
    /// The Git commit.
    #[serde(default, deserialize_with = "null_as_default")]
    pub commit: String,
    /// A digest of the checked-out tree.
    #[serde(default)]
    pub tree_digest: Option<String>,
}

/// Why a Run waits for a person.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Hold {
    /// The rule that holds it (a reason newer than this build reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = HoldReason)]
    pub reason: Code<HoldReason>,
    /// Reason-specific details.
    #[serde(default)]
    pub details: Value,
}

/// Why a Run failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunErrorBody {
    /// Machine-readable (`stale_plan`, `plan_failed`, …).
    // A FailureCode, or `unknown_outcome` (a status's code, not a failure's), or a code
    // newer than this build: the last two read as text, so the schema says string.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = String)]
    pub code: Code<FailureCode>,
    /// What a person should do next.
    #[serde(default, deserialize_with = "null_as_default")]
    pub message: String,
}

/// Who started a Run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Actor {
    /// `user`, `agent` or `system` (a kind newer than this build reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = ActorKind)]
    pub kind: Code<ActorKind>,
    /// The token or component id.
    #[serde(default, deserialize_with = "null_as_default")]
    pub id: String,
}

/// A Run as the API serves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Run {
    /// `run_…`
    pub id: RunId,
    /// plan, destroy, apply or drift_check.
    pub kind: RunKind,
    /// Where the Run is.
    pub status: RunStatus,
    /// The Workspace.
    pub workspace_id: WorkspaceId,
    /// The Capsule.
    pub capsule_id: CapsuleId,
    /// The RunGroup it was started in, if any.
    #[serde(default)]
    pub run_group_id: Option<RunGroupId>,
    /// For an Apply Run: the plan, destroy or drift-check Run it carries out.
    #[serde(default)]
    pub plan_run_id: Option<RunId>,
    /// SHA-256 hex of the saved plan file.
    #[serde(default)]
    pub plan_digest: Option<String>,
    /// The commit that was executed.
    #[serde(default)]
    pub source_snapshot: Option<SourceSnapshot>,
    /// `version -json` of the tool binary used.
    #[serde(default)]
    pub tool_version: Option<Value>,
    /// SHA-256 hex of `.terraform.lock.hcl`: `None` when the field was absent (unknown, a
    /// legacy record), `Some(None)` when it was `null` (a provider-free run),
    /// `Some(Some(hex))` otherwise.
    #[serde(
        default,
        deserialize_with = "present_or_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_lock_digest: Option<Option<String>>,
    /// Digest over the module tree and the provider lock the plan used.
    #[serde(default)]
    pub dependency_snapshot: Option<String>,
    /// The Capsule generation the plan saw / the apply produced.
    #[serde(default)]
    pub state_generation: Option<i64>,
    /// Resource changes of a plan.
    #[serde(default)]
    pub changes: Option<Changes>,
    /// For a drift check: whether drift was found.
    #[serde(default)]
    pub drift: Option<bool>,
    /// Published (non-sensitive) outputs: `name → value`.
    #[serde(default)]
    pub outputs: Option<Value>,
    /// The StateVersion this Run wrote, if any.
    #[serde(default)]
    pub state_version_id: Option<StateVersionId>,
    /// Why the Run is held.
    #[serde(default)]
    pub hold: Option<Hold>,
    /// Why the Run failed.
    #[serde(default)]
    pub error: Option<RunErrorBody>,
    /// Who started it.
    #[serde(default)]
    pub actor: Option<Actor>,
    /// Continue from plan to apply if the plan finishes cleanly.
    #[serde(default, deserialize_with = "null_as_default")]
    pub auto_apply_requested: bool,
    /// Names of every injected variable (never values).
    #[serde(default, deserialize_with = "null_as_default")]
    pub injected_env_names: Vec<String>,
    /// The sandbox that ran its processes: `bubblewrap`, or `none` on a runner started
    /// without isolation; absent before it ran.
    #[serde(default)]
    #[schema(value_type = Option<SandboxMode>)]
    pub sandbox: Option<Code<SandboxMode>>,
    /// When the Run was created.
    #[serde(default)]
    pub created_at: Option<DateTime<Utc>>,
    /// When the Run last changed.
    #[serde(default)]
    pub updated_at: Option<DateTime<Utc>>,
    /// The ProviderBindings the Run's step injected (ids and names; never values).
    #[serde(default, deserialize_with = "null_as_default")]
    pub provider_bindings: Vec<UsedBinding>,
    /// The names of the plain variables the Run is planned with (`None` when not recorded
    /// yet); their values are never served.
    #[serde(default)]
    pub var_names: Option<Vec<String>>,
    /// How many times a step claimed it.
    #[serde(default, deserialize_with = "null_as_default")]
    pub attempts: i32,
    /// Who canceled it.
    #[serde(default)]
    pub canceled_by: Option<String>,
    /// When it was canceled.
    #[serde(default)]
    pub canceled_at: Option<DateTime<Utc>>,
    /// When a cancel of the running Run was asked for (the step stops at its next check).
    #[serde(default)]
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// Who asked for it.
    #[serde(default)]
    pub cancel_requested_by: Option<String>,
    /// How an `unknown_outcome` Run was resolved; `None` while it is not.
    #[serde(default)]
    pub resolution: Option<Resolution>,
    /// How an apply submission ran: `one_step` or a plan it proposed its apply from; `None`
    /// for the ordinary paths (a mode newer than this build reads as `None`).
    #[serde(default, deserialize_with = "known_or_none")]
    pub apply_mode: Option<ApplyMode>,
    /// Fields this client does not know, kept so they can be printed as received.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// How an operator resolved an `unknown_outcome` Run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Resolution {
    /// What was done (an action newer than this build reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = ResolutionAction)]
    pub action: Code<ResolutionAction>,
    /// What the operator checked.
    #[serde(default)]
    pub note: Option<String>,
    /// Who resolved it.
    #[serde(default)]
    pub by: Option<String>,
    /// When.
    #[serde(default)]
    pub at: Option<DateTime<Utc>>,
}

/// A ProviderBinding a Run used, as the Run records it (`providerBindings`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UsedBinding {
    /// `pb_…`.
    pub id: ProviderBindingId,
    /// Its name.
    pub name: String,
    /// `env`, `token` or `command`.
    #[serde(default)]
    #[schema(value_type = BindingKind)]
    pub kind: Code<BindingKind>,
}

/// One entry of a Run's ordered event record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunEvent {
    /// Order within the Run.
    pub id: i64,
    /// What happened (`queued`, `claimed`, `tool_started`, …; a kind newer than this build
    /// reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = EventKind)]
    pub kind: Code<EventKind>,
    /// Who did it (`user:tok_…`, `handler:plan`, …); an `{kind, id}` object is read as
    /// `kind:id`.
    #[serde(default, deserialize_with = "actor_text")]
    pub actor: String,
    /// Details.
    #[serde(default)]
    pub data: Value,
    /// When.
    #[serde(default)]
    pub at: Option<DateTime<Utc>>,
    /// Fields this client does not know, kept so they can be printed as received.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// One chunk of a Run's (masked) log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LogEntry {
    /// The step that printed it (`init`, `plan`, `apply`, …).
    #[serde(default, deserialize_with = "null_as_default")]
    pub step: String,
    /// The text.
    #[serde(default, alias = "chunk", deserialize_with = "null_as_default")]
    pub text: String,
}

/// One page of a Workspace's Runs, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunPage {
    /// The Runs.
    #[serde(default, deserialize_with = "null_as_default")]
    pub runs: Vec<Run>,
    /// Pass it back for the next page; `None` on the last page.
    #[serde(default)]
    pub next_cursor: Option<String>,
    /// The Workspace's `unknown_outcome` Runs no operator has resolved yet.
    #[serde(default, deserialize_with = "null_as_default")]
    pub unknown_outcome_count: i64,
}

/// One entry of a Workspace's activity record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActivityEntry {
    /// Order within the record.
    pub id: i64,
    /// `capsule_registered`, `run_started`, `run_canceled`, `state_version_written`, … (a
    /// kind newer than this build reads as its text).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = ActivityKind)]
    pub kind: Code<ActivityKind>,
    /// The id it is about.
    #[serde(default, deserialize_with = "null_as_default")]
    pub subject: String,
    /// Who did it.
    #[serde(default, deserialize_with = "null_as_default")]
    pub actor: String,
    /// Details.
    #[serde(default)]
    pub data: Value,
    /// When.
    #[serde(default)]
    pub at: Option<DateTime<Utc>>,
}

/// One page of a Workspace's activity, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActivityPage {
    /// The entries.
    #[serde(default, deserialize_with = "null_as_default")]
    pub activity: Vec<ActivityEntry>,
    /// Pass it back for the next page; `None` on the last page.
    #[serde(default)]
    pub next_cursor: Option<String>,
}

/// `GET /api/v1/run-groups/{rg}`: Runs started together, and where each is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunGroup {
    /// `rg_…`
    pub id: RunGroupId,
    /// The Workspace.
    pub workspace_id: WorkspaceId,
    /// `plan_update` or `drift_check`.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = GroupKind)]
    pub kind: Code<GroupKind>,
    /// Who started it.
    #[serde(default, deserialize_with = "null_as_default")]
    pub created_by: String,
    /// When.
    #[serde(default)]
    pub created_at: Option<DateTime<Utc>>,
    /// Its Runs.
    #[serde(default, deserialize_with = "null_as_default")]
    pub runs: Vec<Run>,
}

/// `GET /api/v1/workspaces`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkspaceList {
    /// The Workspaces the token can see.
    #[serde(default, deserialize_with = "null_as_default")]
    pub workspaces: Vec<Workspace>,
}

/// `GET /api/v1/workspaces/{ws}/capsules`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CapsuleList {
    /// The Workspace's Capsules.
    #[serde(default, deserialize_with = "null_as_default")]
    pub capsules: Vec<Capsule>,
}

/// `GET /api/v1/runs/{run}/events`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventList {
    /// The Run's event record, in order.
    #[serde(default, deserialize_with = "null_as_default")]
    pub events: Vec<RunEvent>,
}

/// `GET /api/v1/runs/{run}/logs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LogList {
    /// The Run's (masked) log, in order.
    #[serde(default, deserialize_with = "null_as_default")]
    pub logs: Vec<LogEntry>,
}

/// Joins log chunks into one text, with a `== <step> ==` header wherever the step changes.
pub fn join_logs(entries: &[LogEntry]) -> String {
    let mut out = String::new();
    let mut current: Option<&str> = None;
    for entry in entries {
        if current != Some(entry.step.as_str()) {
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str("== ");
            out.push_str(&entry.step);
            out.push_str(" ==\n");
            current = Some(&entry.step);
        }
        out.push_str(&entry.text);
    }
    out
}

/// A closed-set value this build knows, or `None` (absent, `null`, or a value added after
/// this build: the reader still decodes the record).
fn known_or_none<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: std::str::FromStr,
{
    Ok(Option::<String>::deserialize(d)?.and_then(|text| text.parse().ok()))
}

/// Reads `null` as the type's default.
pub fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// With `#[serde(default)]`: absent → `None`, `null` → `Some(None)`.
fn present_or_null<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

/// An event actor as text, whether the API sends `"user:tok_…"` or `{kind, id}`.
fn actor_text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Text(String),
        Object {
            #[serde(default)]
            kind: String,
            #[serde(default)]
            id: String,
        },
    }
    Ok(match Option::<Repr>::deserialize(d)? {
        None => String::new(),
        Some(Repr::Text(text)) => text,
        Some(Repr::Object { kind, id }) if id.is_empty() => kind,
        Some(Repr::Object { kind, id }) => format!("{kind}:{id}"),
    })
}
