//! Public projections. Object keys, leases and lockfile bytes never appear here.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Map, Value};
use takosumi_core::{
    ActorKind, CapsuleId, CapsuleStatus, HoldReason, ProviderLockState, RunGroupId, RunId, RunKind,
    RunStatus, SandboxMode, StateVersionId, Tool, WorkspaceId,
};
use takosumi_store::capsules::{Capsule, Shown};
use takosumi_store::runs::Run;

use crate::auth::{Action, Caller};

/// A Run as the API shows it, serialized straight from the row (a history page is 50 of
/// them; building a `Value` per Run cost more than the query). Every endpoint that
/// answers with a Run answers with this.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunView<'a> {
    id: RunId,
    kind: RunKind,
    status: RunStatus,
    workspace_id: WorkspaceId,
    capsule_id: CapsuleId,
    run_group_id: Option<RunGroupId>,
    plan_run_id: Option<RunId>,
    plan_digest: Option<&'a str>,
    source_snapshot: Option<SnapshotView<'a>>,
    tool_version: Option<&'a Value>,
    /// Absent = unknown (legacy, or not planned yet); null = provider-free (recorded).
    #[serde(skip_serializing_if = "Option::is_none")]
    provider_lock_digest: Option<Option<&'a str>>,
    dependency_snapshot: Option<&'a str>,
    state_generation: Option<i64>,
    changes: Option<&'a Value>,
    drift: Option<bool>,
    outputs: Option<&'a Value>,
    state_version_id: Option<StateVersionId>,
    hold: Option<HoldView<'a>>,
    error: Option<ErrorView<'a>>,
    actor: ActorView<'a>,
    auto_apply_requested: bool,
    /// Names, not values.
    injected_env_names: &'a [String],
    /// `bubblewrap` | `none` (a runner started unisolated), null before execution.
    sandbox: Option<SandboxMode>,
    /// Ids and names of the credential sets used; their values are never stored here.
    provider_bindings: &'a Value,
    /// Names, not values (the seed's record keeps "the names of the injected environment
    /// variables — values are not stored"): the values stay sealed where the pipeline
    /// reads them. `null`: the Capsule's variables, named once a step ran.
    var_names: Option<Vec<&'a str>>,
    attempts: i32,
    canceled_by: Option<&'a str>,
    #[serde(serialize_with = "time::opt_rfc3339")]
    canceled_at: Option<DateTime<Utc>>,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
    #[serde(serialize_with = "time::rfc3339")]
    updated_at: DateTime<Utc>,
    #[serde(serialize_with = "time::opt_rfc3339")]
    cancel_requested_at: Option<DateTime<Utc>>,
    cancel_requested_by: Option<&'a str>,
    /// How an `unknown_outcome` Run was resolved.
    resolution: Option<ResolutionView<'a>>,
    /// How an apply submission ran: `one_step` (apply -auto-approve, no saved plan) or a
    /// plan it proposed its apply from; null for the ordinary paths.
    apply_mode: Option<takosumi_core::ApplyMode>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SnapshotView<'a> {
    commit: &'a str,
    tree_digest: Option<&'a str>,
}

#[derive(Serialize)]
struct HoldView<'a> {
    reason: HoldReason,
    details: Option<&'a Value>,
}

#[derive(Serialize)]
struct ErrorView<'a> {
    code: &'a str,
    message: Option<&'a str>,
}

#[derive(Serialize)]
struct ActorView<'a> {
    kind: ActorKind,
    id: &'a str,
}

#[derive(Serialize)]
struct ResolutionView<'a> {
    action: takosumi_core::ResolutionAction,
    note: Option<&'a str>,
    by: Option<&'a str>,
    #[serde(serialize_with = "time::rfc3339")]
    at: DateTime<Utc>,
}

impl<'a> RunView<'a> {
    /// The view of `r`.
    pub fn of(r: &'a Run) -> Self {
        Self {
            id: r.id,
            kind: r.kind,
            status: r.status,
            workspace_id: r.workspace_id,
            capsule_id: r.capsule_id,
            run_group_id: r.run_group_id,
            plan_run_id: r.plan_run_id,
            plan_digest: r.plan_digest.as_deref(),
            source_snapshot: r.source_commit.as_deref().map(|commit| SnapshotView {
                commit,
                tree_digest: r.tree_digest.as_deref(),
            }),
            tool_version: r.tool_version.as_ref(),
            provider_lock_digest: match r.provider_lock_state {
                ProviderLockState::None => Some(None),
                ProviderLockState::Present => Some(r.provider_lock_digest.as_deref()),
                ProviderLockState::Unknown => None,
            },
            dependency_snapshot: r.dependency_snapshot.as_deref(),
            state_generation: r.state_generation,
            changes: r.changes.as_ref(),
            drift: r.drift,
            outputs: r.outputs.as_ref(),
            state_version_id: r.state_version_id,
            hold: r.hold_reason.map(|reason| HoldView {
                reason,
                details: r.hold_details.as_ref(),
            }),
            error: r.error_code.as_deref().map(|code| ErrorView {
                code,
                message: r.error_message.as_deref(),
            }),
            actor: ActorView {
                kind: r.actor_kind,
                id: &r.actor_id,
            },
            auto_apply_requested: r.auto_apply_requested,
            injected_env_names: &r.injected_env_names,
            sandbox: r.sandbox,
            provider_bindings: &r.provider_bindings,
            var_names: match &r.var_names {
                Some(names) => Some(names.iter().map(String::as_str).collect()),
                None => r
                    .vars
                    .as_ref()
                    .and_then(Value::as_object)
                    .map(|m| m.keys().map(String::as_str).collect()),
            },
            attempts: r.attempts,
            canceled_by: r.canceled_by.as_deref(),
            canceled_at: r.canceled_at,
            created_at: r.created_at,
            updated_at: r.updated_at,
            cancel_requested_at: r.cancel_requested_at,
            cancel_requested_by: r.cancel_requested_by.as_deref(),
            resolution: match (r.resolution_action, r.resolved_at) {
                (Some(action), Some(at)) => Some(ResolutionView {
                    action,
                    note: r.resolution_note.as_deref(),
                    by: r.resolved_by.as_deref(),
                    at,
                }),
                _ => None,
            },
            apply_mode: r.apply_mode,
        }
    }
}

/// A Run answer, serialized at once (the view borrows the row).
pub fn run_json(r: &Run) -> axum::response::Response {
    axum::response::IntoResponse::into_response(axum::Json(RunView::of(r)))
}

/// A Capsule's variables as `caller_may_edit` sees them: every name, and a value only for
/// a variable its configuration does not declare `sensitive` (as its plans read it: before
/// the first plan, none is known, so none is shown) and only to a role that may edit the
/// Capsule. `(shown, withheld names)`.
fn capsule_vars(c: &Capsule, caller_may_edit: bool) -> (Map<String, Value>, Vec<String>) {
    let mut shown = Map::new();
    let mut withheld = Vec::new();
    for (name, value) in c.vars.as_object().into_iter().flatten() {
        let declared_plain = c
            .sensitive_var_names
            .as_ref()
            .is_some_and(|sensitive| !sensitive.contains(name));
        if caller_may_edit && declared_plain {
            shown.insert(name.clone(), value.clone());
        } else {
            withheld.push(name.clone());
        }
    }
    (shown, withheld)
}

/// A Capsule as the API shows it: every answer that carries a Capsule (one, a list, a
/// change's result) serializes this, from [`takosumi_store::capsules::shown`], so a list
/// says `drifted` exactly where the Capsule's own page does. Its variables as
/// [`capsule_vars`] says.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CapsuleView<'a> {
    id: CapsuleId,
    workspace_id: WorkspaceId,
    name: &'a str,
    source: SourceView<'a>,
    dir: &'a str,
    tool: Tool,
    vars: Map<String, Value>,
    var_names: Vec<&'a str>,
    withheld_vars: Vec<String>,
    state_generation: i64,
    current_state_version_id: Option<StateVersionId>,
    /// `applying`, `stale`, `drifted` or `ok`: the first that holds.
    status: CapsuleStatus,
    // `stale` (the branch moved past what was planned) and `drifted` (reality moved away
    // from what was applied) are independent; `status` shows the first that holds.
    stale: bool,
    drifted: bool,
    /// The latest finished drift check's finding; null: none finished yet.
    drift: Option<bool>,
    /// The worker pool's name; null: the control node's own queues.
    pool: Option<&'a str>,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

#[derive(Serialize)]
struct SourceView<'a> {
    repo: String,
    branch: &'a str,
}

/// A Capsule answer for `caller`, serialized at once (the view borrows the row).
pub fn capsule_json(shown: &Shown, caller: &Caller) -> axum::response::Response {
    axum::response::IntoResponse::into_response(axum::Json(CapsuleView::for_caller(shown, caller)))
}

impl<'a> CapsuleView<'a> {
    /// The view of `shown` as `caller` sees it: variable values only for a role that may
    /// edit (operate) the Capsule.
    pub fn for_caller(shown: &'a Shown, caller: &Caller) -> Self {
        let caller_may_edit = caller.may(Action::Operate, Some(shown.capsule.workspace_id));
        let c = &shown.capsule;
        let (vars, withheld_vars) = capsule_vars(c, caller_may_edit);
        let drifted = shown.drift == Some(true);
        let status = if c.running_apply_id.is_some() {
            CapsuleStatus::Applying
        } else if c.stale {
            CapsuleStatus::Stale
        } else if drifted {
            CapsuleStatus::Drifted
        } else {
            CapsuleStatus::Ok
        };
        Self {
            id: c.id,
            workspace_id: c.workspace_id,
            name: &c.name,
            source: SourceView {
                repo: takosumi_runner::redact_repo_url(&c.repo),
                branch: &c.branch,
            },
            dir: &c.dir,
            tool: c.tool,
            vars,
            var_names: c
                .vars
                .as_object()
                .into_iter()
                .flat_map(|m| m.keys().map(String::as_str))
                .collect(),
            withheld_vars,
            state_generation: c.state_generation,
            current_state_version_id: c.current_state_version_id,
            status,
            stale: c.stale,
            drifted,
            drift: shown.drift,
            pool: shown.pool.as_deref(),
            created_at: c.created_at,
        }
    }
}

/// Times as the API writes them.
pub(crate) mod time {
    use chrono::{DateTime, SecondsFormat, Utc};
    use serde::Serializer;

    /// RFC 3339 in UTC with `Z` and as many fraction digits as the time has: exactly what
    /// chrono's own `Serialize` writes, formatted once and handed over whole (chrono's goes
    /// through `collect_str`, which feeds the JSON writer's escaping a piece at a time; a
    /// history page has a hundred and more of them).
    pub(crate) fn rfc3339<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::AutoSi, true))
    }

    /// [`rfc3339`], or null.
    pub(crate) fn opt_rfc3339<S: Serializer>(
        t: &Option<DateTime<Utc>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => rfc3339(t, s),
            None => s.serialize_none(),
        }
    }

    #[cfg(test)]
    mod tests {
        use chrono::TimeZone;

        use super::*;

        #[derive(serde::Serialize)]
        struct Ours(#[serde(serialize_with = "rfc3339")] DateTime<Utc>);

        #[test]
        fn writes_what_chrono_writes() {
            let whole = Utc.with_ymd_and_hms(2026, 12, 4, 20, 45, 12).unwrap();
            for nanos in [0, 120_000_000, 123_456_000, 123_456_789, 1] {
                let t = whole + chrono::Duration::nanoseconds(nanos);
                let ours = serde_json::to_string(&Ours(t)).unwrap();
                assert_eq!(ours, serde_json::to_string(&t).unwrap());
                let back: DateTime<Utc> = serde_json::from_str(&ours).unwrap();
                assert_eq!(back, t);
            }
            assert_eq!(
                serde_json::to_string(&Ours(whole)).unwrap(),
                "\"2026-12-04T20:45:12Z\""
            );
        }
    }
}
