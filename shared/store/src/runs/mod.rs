//! Runs and their transitions. Every transition is an `UPDATE … WHERE status = expected`
//! (and, while a step runs, `AND lease_owner = me`): zero rows means "already done, or not
//! yours", which callers treat as an answer, not an error. Which transitions exist at all
//! is `takosumi_core::RunStatus::TRANSITIONS`; each function here checks its own against it.
//!
//! This module holds the row and its pipeline lifecycle (start, claim, record, fail, hand
//! back, reap, wake the next apply). The row's other parts have a module each:
//! [`apply_mode`] (how an apply submission runs), [`cancel`], [`hold`] (held for people and
//! released), [`list`] (a Workspace's history), [`plan_record`] (what a plan keeps beside
//! its status: resource changes, diff, scan report), [`source`] (what a plan checks out)
//! and [`unknown`] (`unknown_outcome` applies and their resolution).

pub mod apply_mode;
pub mod cancel;
pub mod hold;
pub mod list;
pub mod plan_record;
pub mod progress;
mod propose;
pub mod source;
pub mod unknown;

pub use propose::{ApplyProposal, propose_apply};

use chrono::{DateTime, Utc};
use takosumi_core::{
    ActorKind, ApplyMode, CapsuleId, Changes, EventKind, FailureCode, GateDecision, HoldReason,
    ProviderLockState, RunGroupId, RunId, RunKind, RunMessage, RunStatus, StateVersionId, Topic,
    WorkspaceId,
};

use crate::{StoreError, Tx};

/// A Run row, private fields included. Public projections are built from it by the API
/// and must leave out the `*_object_key` fields and the lease.
#[derive(Debug, Clone)]
pub struct Run {
    /// Its id.
    pub id: RunId,
    /// What it does.
    pub kind: RunKind,
    /// Where it is.
    pub status: RunStatus,
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// Its Capsule.
    pub capsule_id: CapsuleId,
    /// Its RunGroup.
    pub run_group_id: Option<RunGroupId>,
    /// For an Apply Run: the plan it carries out.
    pub plan_run_id: Option<RunId>,
    /// Who started it.
    pub actor_kind: ActorKind,
    /// The actor's id (a token id for users and agents).
    pub actor_id: String,
    /// Continue from plan to apply when the plan is clean.
    pub auto_apply_requested: bool,
    /// The commit that was executed.
    pub source_commit: Option<String>,
    /// Digest of the checked-out tree.
    pub tree_digest: Option<String>,
    /// `version -json` of the tool used.
    pub tool_version: Option<serde_json::Value>,
    /// SHA-256 of the saved plan file.
    pub plan_digest: Option<String>,
    /// Private: where the sealed plan lives.
    pub plan_object_key: Option<String>,
    /// Private: where the sealed lockfile lives.
    pub lockfile_object_key: Option<String>,
    /// What the plan recorded of its lockfile.
    pub provider_lock_state: ProviderLockState,
    /// SHA-256 of the lockfile bytes when present.
    pub provider_lock_digest: Option<String>,
    /// Digest over the module tree and the provider lock digest.
    pub dependency_snapshot: Option<String>,
    /// The generation a plan saw / an apply produced.
    pub state_generation: Option<i64>,
    /// Resource changes from `show -json`.
    pub changes: Option<serde_json::Value>,
    /// Drift found (drift checks only).
    pub drift: Option<bool>,
    /// Published outputs.
    pub outputs: Option<serde_json::Value>,
    /// The StateVersion written by this Run.
    pub state_version_id: Option<StateVersionId>,
    /// Names of injected environment variables.
    pub injected_env_names: Vec<String>,
    /// Plain variable values of a Run recorded before values were kept sealed: read by the
    /// pipeline for such a Run, never shown. New Runs keep theirs sealed.
    pub vars: Option<serde_json::Value>,
    /// The names of the Run's plain variables (`None`: the Capsule's, read at execution).
    pub var_names: Option<Vec<String>>,
    /// `[{"id": "pb_…", "name": …}]`: the ProviderBindings a step injected.
    pub provider_bindings: serde_json::Value,
    /// Why it is held.
    pub hold_reason: Option<HoldReason>,
    /// Details of the hold.
    pub hold_details: Option<serde_json::Value>,
    /// The gate's decision, once made.
    pub gate_decision: Option<GateDecision>,
    /// Machine-readable failure code.
    pub error_code: Option<String>,
    /// What a person should do next.
    pub error_message: Option<String>,
    /// Who canceled it.
    pub canceled_by: Option<String>,
    /// When it was canceled.
    pub canceled_at: Option<DateTime<Utc>>,
    /// The handler holding it.
    pub lease_owner: Option<String>,
    /// The sandbox that ran the Run's processes, once executed.
    pub sandbox: Option<takosumi_core::SandboxMode>,
    /// Claims so far.
    pub attempts: i32,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// How an apply submission runs ([`apply_mode`]); `None`: the ordinary paths.
    pub apply_mode: Option<ApplyMode>,
    /// When a cancel was requested of the running step.
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// Who requested it.
    pub cancel_requested_by: Option<String>,
    /// How an `unknown_outcome` Run was resolved, by whom and when.
    pub resolution_action: Option<takosumi_core::ResolutionAction>,
    /// The operator's note on the resolution.
    pub resolution_note: Option<String>,
    /// Who resolved it.
    pub resolved_by: Option<String>,
    /// When.
    pub resolved_at: Option<DateTime<Utc>>,
}

impl Run {
    /// The change counts, if recorded.
    pub fn changes(&self) -> Option<Changes> {
        self.changes
            .as_ref()
            .and_then(|c| serde_json::from_value(c.clone()).ok())
    }
}

/// Reads a Run.
pub async fn get<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<Option<Run>, StoreError> {
    // `id = $1`, not `get_many`'s `id = ANY($1)`: Postgres costs a generic plan of the array
    // form for an array of unknown length, above the custom plan for one id, so it planned
    // that statement afresh on every read; this one keeps one plan per session.
    Ok(select_runs!("WHERE id = $1", id.as_uuid())
        .fetch_optional(executor)
        .await?)
}

/// `sqlx::query_as!(Run, …)` over `runs` with the one column list every read of a whole Run
/// shares; `$rest` is the statement after `FROM runs` (a literal, so the query is still
/// checked against the schema). `with $with, from $from`: the same columns read from a
/// relation the statement `$with` names instead (a `WITH … RETURNING *` of `runs`).
macro_rules! select_runs {
    ($rest:literal $(, $arg:expr)* $(,)?) => {
        $crate::runs::select_runs!(@columns "", "FROM runs ", $rest $(, $arg)*)
    };
    (with $with:literal, from $from:literal $(, $arg:expr)* $(,)?) => {
        $crate::runs::select_runs!(@columns $with, $from, "" $(, $arg)*)
    };
    (@columns $with:literal, $from:literal, $rest:literal $(, $arg:expr)*) => {
        sqlx::query_as!(
            $crate::runs::Run,
            $with + r#"SELECT id as "id: takosumi_core::RunId", kind as "kind: takosumi_core::RunKind", status as "status: takosumi_core::RunStatus",
                  workspace_id as "workspace_id: takosumi_core::WorkspaceId", capsule_id as "capsule_id: takosumi_core::CapsuleId",
                  run_group_id as "run_group_id: takosumi_core::RunGroupId", plan_run_id as "plan_run_id: takosumi_core::RunId",
                  actor_kind as "actor_kind: takosumi_core::ActorKind", actor_id, auto_apply_requested,
                  source_commit, tree_digest, tool_version, plan_digest, plan_object_key,
                  lockfile_object_key, provider_lock_state as "provider_lock_state: takosumi_core::ProviderLockState",
                  provider_lock_digest, dependency_snapshot, state_generation, changes, drift, outputs,
                  state_version_id as "state_version_id: takosumi_core::StateVersionId", injected_env_names,
                  vars, var_names, provider_bindings, hold_reason as "hold_reason: takosumi_core::HoldReason", hold_details, gate_decision as "gate_decision: takosumi_core::GateDecision", error_code, error_message, canceled_by,
                  canceled_at, lease_owner, sandbox as "sandbox: takosumi_core::SandboxMode", attempts, created_at, updated_at, apply_mode as "apply_mode: takosumi_core::ApplyMode",
                  cancel_requested_at, cancel_requested_by, resolution_action as "resolution_action: takosumi_core::ResolutionAction", resolution_note,
                  resolved_by, resolved_at
             "# + $from + $rest
            $(, $arg)*
        )
    };
}
pub(crate) use select_runs;

/// Reads Runs in one round trip, in the order of `ids` (a missing id is left out): a
/// page of history costs one query, not one per Run.
pub async fn get_many<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    ids: &[RunId],
) -> Result<Vec<Run>, StoreError> {
    let uuids: Vec<uuid::Uuid> = ids.iter().map(RunId::as_uuid).collect();
    let mut runs = select_runs!("WHERE id = ANY($1)", &uuids)
        .fetch_all(executor)
        .await?;
    if runs.len() > 1 {
        let at: std::collections::HashMap<RunId, usize> =
            ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        runs.sort_by_key(|r| at.get(&r.id).copied().unwrap_or(usize::MAX));
    }
    Ok(runs)
}

/// What a new Run starts with.
#[derive(Debug, Clone)]
pub struct NewRun {
    /// Its id, chosen before the row exists so what is sealed for the Run (its
    /// variables, bound to its id) is written with the row.
    pub id: RunId,
    /// Kind.
    pub kind: RunKind,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Capsule.
    pub capsule_id: CapsuleId,
    /// Group.
    pub run_group_id: Option<RunGroupId>,
    /// The plan an Apply Run carries out.
    pub plan_run_id: Option<RunId>,
    /// Actor kind.
    pub actor_kind: ActorKind,
    /// Actor id.
    pub actor_id: String,
    /// Continue to apply when clean.
    pub auto_apply_requested: bool,
    /// The submission's `Idempotency-Key`.
    pub idempotency_key: Option<String>,
    /// The submission asked for a person's approval whatever the rules say (the gate
    /// reads it; not part of the Run's view).
    pub require_approval: bool,
    /// The W3C `traceparent` of the request that made it; `None` takes the plan's (an
    /// apply a step makes continues its plan's trace).
    pub traceparent: Option<String>,
    /// The variables its submission set, sealed; `None` leaves them to be settled at its
    /// claim (a webhook's plan, a drift check, an apply: it reads its plan's).
    pub vars: Option<SealedVars>,
}

/// A Run's variables as its submission set them: their names, and the values sealed for
/// the Run (`takosumi_runtime::inputs::seal_run_vars`).
#[derive(Debug, Clone)]
pub struct SealedVars {
    /// The names, sorted: what the record shows.
    pub names: Vec<String>,
    /// The values, sealed.
    pub sealed: Vec<u8>,
}

/// What a new Run's start records beside its row: who started it, what its `queued` event
/// and the Workspace's `run_started` activity say, and the queue that wakes it.
#[derive(Debug)]
pub struct Start<'a> {
    /// Who started it, as events and activity name an actor (`token:…`, `handler:…`).
    pub actor: &'a str,
    /// The `queued` event's data.
    pub event: serde_json::Value,
    /// The `run_started` activity's data.
    pub activity: serde_json::Value,
    /// The wake-up; `None` when the caller holds the Run instead (an agent's Run).
    pub wake: Option<Topic>,
}

/// Starts a Run: the row, its `queued` event, the Workspace's `run_started`
/// activity and its wake-up, in one statement (in the caller's transaction when it passes
/// one: a Run started alone needs none), and answers the row as written. The one way a
/// Run is created (the sweep's bulk drift checks write the same four in one statement per
/// batch).
pub async fn start<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    new: &NewRun,
    start: Start<'_>,
) -> Result<Run, StoreError> {
    // The row takes the column's default status, which is where the lifecycle starts.
    const _: () = assert!(matches!(RunStatus::INITIAL, RunStatus::Queued));
    let id = new.id;
    // The row, its event, its activity entry and its wake-up are one statement (one round
    // trip, where four appends cost four), and it reads the row back as it wrote it: a
    // submission that changes nothing after the start answers without a second read. An
    // Apply Run copies its plan's pins so the record shows what it is bound to from the
    // start.
    Ok(select_runs!(
        with r#"WITH run AS (
               INSERT INTO runs (id, kind, workspace_id, capsule_id, run_group_id, plan_run_id, actor_kind,
                                 actor_id, auto_apply_requested, idempotency_key, require_approval,
                                 source_commit, tree_digest, plan_digest, state_generation,
                                 provider_lock_state, provider_lock_digest, dependency_snapshot, tool_version,
                                 changes, injected_env_names, traceparent, var_names, vars_sealed)
               SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $21,
                      p.source_commit, p.tree_digest, p.plan_digest, p.state_generation,
                      COALESCE(p.provider_lock_state, 'unknown'), p.provider_lock_digest, p.dependency_snapshot,
                      p.tool_version, p.changes, COALESCE(p.injected_env_names, '{}'),
                      COALESCE($11, p.traceparent), $17, $18
                 FROM (SELECT 1) one
                 LEFT JOIN runs p ON p.id = $6
               RETURNING *),
           queued AS (
               INSERT INTO run_events (run_id, kind, actor, data)
               SELECT id, $12, $13, $14 FROM run),
           wake AS (
               -- routed as `outbox::enqueue` routes it
               INSERT INTO outbox (topic, payload, traceparent)
               SELECT wake_topic($19, w.pool_name), $20, run.traceparent
                 FROM run
                 LEFT JOIN capsule_wake_routes w ON w.capsule_id = run.capsule_id
                WHERE $19::text IS NOT NULL),
           started AS (
               INSERT INTO activity (workspace_id, kind, subject, actor, data)
               SELECT workspace_id, 'run_started', $15, $13, $16 FROM run)
           "#,
        from "FROM run",
        id.as_uuid(),
        new.kind as RunKind,
        new.workspace_id.as_uuid(),
        new.capsule_id.as_uuid(),
        new.run_group_id.map(|g| g.as_uuid()),
        new.plan_run_id.map(|p| p.as_uuid()),
        new.actor_kind as ActorKind,
        new.actor_id,
        new.auto_apply_requested,
        new.idempotency_key,
        new.traceparent,
        EventKind::Queued as EventKind,
        start.actor,
        start.event,
        id.to_string(),
        start.activity,
        new.vars.as_ref().map(|v| v.names.as_slice()),
        new.vars.as_ref().map(|v| v.sealed.as_slice()),
        start.wake.map(Topic::queue_name),
        RunMessage { run_id: id }.to_json(),
        new.require_approval,
    )
    .fetch_one(executor)
    .await?)
}

/// The Run a previous submission with the same `Idempotency-Key` created.
pub async fn find_by_idempotency_key<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
    key: &str,
) -> Result<Option<RunId>, StoreError> {
    let row = sqlx::query!(
        "SELECT id FROM runs WHERE workspace_id = $1 AND idempotency_key = $2",
        workspace_id.as_uuid(),
        key
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| RunId::from_uuid(r.id)))
}

/// The live (not failed, not canceled) Apply Run of a plan, if any.
pub async fn live_apply_of<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    plan_run_id: RunId,
) -> Result<Option<RunId>, StoreError> {
    let row = sqlx::query!(
        "SELECT id FROM runs WHERE plan_run_id = $1 AND kind = 'apply' AND status NOT IN ('failed', 'canceled')",
        plan_run_id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| RunId::from_uuid(r.id)))
}

/// What a step checks before it claims a Run: how many of its claims were lost
/// (`attempts - handbacks`, what `max_attempts` bounds; claims handed back after a
/// transient fault are not counted) and whether its Capsule runs on a worker pool. `None`:
/// no such Run.
pub async fn claim_precheck<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    id: RunId,
) -> Result<Option<ClaimPrecheck>, StoreError> {
    Ok(sqlx::query_as!(
        ClaimPrecheck,
        r#"SELECT r.attempts - r.handbacks AS "lost_claims!", c.pool_id IS NOT NULL AS "on_pool!"
             FROM runs r JOIN capsules c ON c.id = r.capsule_id WHERE r.id = $1"#,
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?)
}

/// See [`claim_precheck`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimPrecheck {
    /// Claims whose handler vanished.
    pub lost_claims: i32,
    /// The Capsule runs on a worker pool (its relay workers claim it).
    pub on_pool: bool,
}

/// What a claim records about itself, in its own statement: a `claimed` event by
/// `handler:{owner}` with `data`, and the sandbox that executes the Run (`None`: a relay
/// worker that did not say, shown as unknown).
#[derive(Debug, Clone, Copy)]
pub struct ClaimRecord<'a> {
    /// The `claimed` event's data (`step`, `attempt`, a relay worker's `pool`…).
    pub data: &'a serde_json::Value,
    /// The sandbox mode of the host that claimed it.
    pub sandbox: Option<takosumi_core::SandboxMode>,
}

/// Claims a Run of one of `kinds` for a step: `from` → `to`, with a lease, and writes its
/// [`ClaimRecord`] in the same statement. `false`: someone else has it, the step is done,
/// or the Run is of another kind (a wake-up sent to the wrong queue claims nothing);
/// nothing is written then. A pair the Run lifecycle does not have is refused
/// ([`StoreError::Transition`]) before the database is asked.
pub async fn claim<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
    kinds: &[RunKind],
    (from, to): (RunStatus, RunStatus),
    (owner, lease_secs): (&str, i64),
    record: ClaimRecord<'_>,
) -> Result<bool, StoreError> {
    debug_assert!(
        from.can_become(to),
        "claim {from:?} -> {to:?} is not in the Run lifecycle"
    );
    crate::check_transition(from, to)?;
    // One statement: the claim and its record land together or not at all, without a
    // transaction's round trips around them.
    let done = sqlx::query!(
        r#"WITH claimed AS (
               UPDATE runs SET status = $3, lease_owner = $4,
                      lease_until = now() + make_interval(secs => $5::bigint::double precision),
                      attempts = attempts + 1, sandbox = COALESCE($7, sandbox), updated_at = now()
                WHERE id = $1 AND status = $2 AND kind = ANY($6)
            RETURNING id)
           INSERT INTO run_events (run_id, kind, actor, data)
           SELECT id, 'claimed', 'handler:' || $4, $8 FROM claimed"#,
        id.as_uuid(),
        from as RunStatus,
        to as RunStatus,
        owner,
        lease_secs,
        kinds as &[RunKind],
        record.sandbox as Option<takosumi_core::SandboxMode>,
        record.data
    )
    .execute(executor)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Hands a planning Run `owner` holds back to the queue after a transient fault (or a job
/// that could not be prepared), with its `requeued` event, in the caller's transaction: the
/// hand-back is counted (`handbacks`), so it does not use up the Run's attempts, which bound
/// handlers that vanished. The wake-up is the caller's (its message goes back to the
/// queue, or the relay worker asks again). `false`: not `owner`'s, nothing written.
pub async fn hand_back(
    tx: &mut Tx,
    id: RunId,
    owner: &str,
    reason: &str,
) -> Result<bool, StoreError> {
    crate::transitions!(Planning => Queued);
    let done = sqlx::query!(
        r#"UPDATE runs SET status = 'queued', lease_owner = NULL, lease_until = NULL,
                  handbacks = handbacks + 1, updated_at = now()
            WHERE id = $1 AND lease_owner = $2 AND status = 'planning'"#,
        id.as_uuid(),
        owner
    )
    .execute(tx.db())
    .await?;
    if done.rows_affected() != 1 {
        return Ok(false);
    }
    crate::events::append(
        tx.db(),
        id,
        EventKind::Requeued,
        &format!("handler:{owner}"),
        serde_json::json!({ "reason": reason }),
    )
    .await?;
    Ok(true)
}

/// Extends the lease while the step still holds it. `false`: the lease was lost (the
/// reaper took the Run back, or it was canceled); the step must stop.
pub async fn renew_lease(
    pool: &crate::Pool,
    id: RunId,
    owner: &str,
    lease_secs: i64,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET lease_until = now() + make_interval(secs => $3::bigint::double precision)
            WHERE id = $1 AND lease_owner = $2 AND status IN ('planning', 'applying')"#,
        id.as_uuid(),
        owner,
        lease_secs
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A finished plan's record.
#[derive(Debug, Clone)]
pub struct PlanRecord {
    /// Commit executed.
    pub source_commit: String,
    /// Tree digest.
    pub tree_digest: String,
    /// Tool version JSON.
    pub tool_version: serde_json::Value,
    /// SHA-256 of the plan file; `None` only for a drift check whose plan was not kept
    /// (too large to cross the relay).
    pub plan_digest: Option<String>,
    /// Private: sealed plan object (`None` as `plan_digest`).
    pub plan_object_key: Option<String>,
    /// Private: sealed lockfile object (when a lockfile exists).
    pub lockfile_object_key: Option<String>,
    /// Lockfile digest; `None` = provider-free (explicit null).
    pub provider_lock_digest: Option<String>,
    /// Dependency snapshot digest.
    pub dependency_snapshot: String,
    /// Generation the plan saw.
    pub state_generation: i64,
    /// Changes.
    pub changes: Changes,
    /// Drift (drift checks only).
    pub drift: Option<bool>,
    /// Injected variable names.
    pub injected_env_names: Vec<String>,
    /// The resource-change summary for cost estimates (`takosumi_cost`), masked.
    pub resource_changes: serde_json::Value,
    /// The masked resource-by-resource diff a reviewer reads.
    pub plan_diff: serde_json::Value,
    /// Private: the sealed `show -json` object the gate reads.
    pub plan_json_object_key: String,
}

/// `planning` → `planned` with the record, only for the lease holder, with its `planned`
/// event (`event` is its data) and the gate's wake-up in the same statement.
pub async fn record_plan(
    tx: &mut Tx,
    id: RunId,
    owner: &str,
    rec: &PlanRecord,
    event: &serde_json::Value,
) -> Result<bool, StoreError> {
    crate::transitions!(Planning => Planned);
    let changes = serde_json::to_value(rec.changes).unwrap_or_default();
    // Read from the tool's `show -json`, which carries the Capsule's values as they are.
    let tool_version = takosumi_core::json_without_nul(&rec.tool_version);
    let resource_changes = takosumi_core::json_without_nul(&rec.resource_changes);
    let plan_diff = takosumi_core::json_without_nul(&rec.plan_diff);
    let event = takosumi_core::json_without_nul(event);
    let lock_state = ProviderLockState::of_digest(rec.provider_lock_digest.as_deref());
    let done = sqlx::query_scalar!(
        r#"WITH planned AS (
               UPDATE runs SET status = 'planned', source_commit = $3, tree_digest = $4, tool_version = $5,
                      plan_digest = $6, plan_object_key = $7, lockfile_object_key = $8,
                      provider_lock_state = $9, provider_lock_digest = $10, dependency_snapshot = $11,
                      state_generation = $12, changes = $13, drift = $14, injected_env_names = $15,
                      resource_changes = $16, plan_diff = $17, plan_json_object_key = $18,
                      lease_owner = NULL, lease_until = NULL, updated_at = now(), finished_at = now()
                WHERE id = $1 AND status = 'planning' AND lease_owner = $2
               RETURNING id, capsule_id, traceparent),
           event AS (
               INSERT INTO run_events (run_id, kind, actor, data)
               SELECT id, $19, $20, $21 FROM planned)
           -- routed as `outbox::enqueue` routes it
           INSERT INTO outbox (topic, payload, traceparent)
           SELECT wake_topic($22, w.pool_name), $23, planned.traceparent
             FROM planned
             LEFT JOIN capsule_wake_routes w ON w.capsule_id = planned.capsule_id
           RETURNING 1 AS "recorded!""#,
        id.as_uuid(),
        owner,
        rec.source_commit,
        rec.tree_digest,
        tool_version.as_ref(),
        rec.plan_digest,
        rec.plan_object_key,
        rec.lockfile_object_key,
        lock_state as ProviderLockState,
        rec.provider_lock_digest,
        rec.dependency_snapshot,
        rec.state_generation,
        changes,
        rec.drift,
        &rec.injected_env_names,
        resource_changes.as_ref(),
        plan_diff.as_ref(),
        rec.plan_json_object_key,
        EventKind::Planned as EventKind,
        format!("handler:{owner}"),
        event.as_ref(),
        Topic::Gate.queue_name(),
        RunMessage { run_id: id }.to_json(),
    )
    .fetch_optional(tx.db())
    .await?;
    Ok(done.is_some())
}

/// Ends a Run `failed` with a code and a message saying what to do. With `owner`, only
/// the lease holder may; without, only a Run no step holds (queued or held).
pub async fn fail(
    tx: &mut Tx,
    id: RunId,
    owner: Option<&str>,
    code: FailureCode,
    message: &str,
) -> Result<bool, StoreError> {
    // Without an owner: a Run no step holds; with one: the lease holder's running Run.
    crate::transitions!(Queued => Failed, Held => Failed, Planning => Failed, Applying => Failed);
    // A message may quote the tool (masked), which prints what the Capsule makes it print.
    let message = takosumi_core::without_nul(message);
    let done = sqlx::query!(
        r#"UPDATE runs SET status = 'failed', error_code = $3, error_message = $4,
                  lease_owner = NULL, lease_until = NULL, updated_at = now(), finished_at = now()
            WHERE id = $1
              AND CASE WHEN $2::text IS NULL THEN status IN ('queued', 'held')
                       ELSE status IN ('planning', 'applying') AND lease_owner = $2 END"#,
        id.as_uuid(),
        owner,
        code.as_str(),
        message.as_ref()
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// How an apply claim ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApplyClaim {
    /// This handler holds the Run and the Capsule; the generation matched.
    Claimed,
    /// Another apply holds the Capsule; the Run stays queued.
    CapsuleBusy,
    /// The Capsule's state moved on since the plan: the Run failed, the tool never ran.
    GenerationChanged {
        /// What the plan saw.
        planned: i64,
        /// What the Capsule is at.
        current: i64,
    },
    /// Not a released, queued Apply Run (done, claimed elsewhere, or never released).
    NotClaimable,
    /// An earlier apply of the Capsule (`blocking`) ended `unknown_outcome` and is not
    /// resolved: the Run failed `capsule_needs_inspection`, the tool never ran.
    NeedsInspection {
        /// The unresolved `unknown_outcome` apply.
        blocking: RunId,
    },
}

/// Claims an Apply Run: in one transaction, takes the Run (`queued` → `applying`, with its
/// [`ClaimRecord`]), takes the Capsule (only where no apply holds it) and checks the
/// generation the plan saw.
pub async fn claim_apply(
    tx: &mut Tx,
    id: RunId,
    owner: &str,
    lease_secs: i64,
    record: ClaimRecord<'_>,
) -> Result<ApplyClaim, StoreError> {
    let row = sqlx::query!(
        r#"SELECT capsule_id, state_generation,
                  (SELECT p.kind FROM runs p WHERE p.id = runs.plan_run_id) as "plan_kind: RunKind"
             FROM runs
            WHERE id = $1 AND kind = 'apply' AND status = 'queued' AND gate_decision = 'released'
            FOR UPDATE OF runs"#,
        id.as_uuid()
    )
    .fetch_optional(tx.db())
    .await?;
    let Some(row) = row else {
        return Ok(ApplyClaim::NotClaimable);
    };
    let capsule_id = CapsuleId::from_uuid(row.capsule_id);
    let Some(current) = crate::capsules::take_for_apply(tx, capsule_id, id).await? else {
        return Ok(ApplyClaim::CapsuleBusy);
    };
    // An unresolved unknown_outcome apply keeps the Capsule from any other apply until a
    // person has inspected it: this apply is refused, the tool never starts. Asked only
    // once the Capsule is taken: the take finds it free only after the apply that held it
    // committed letting go, which an apply ending unknown_outcome does in the transaction
    // that records the outcome, so this later statement sees that outcome. Asked before
    // the take (as it once was), the outcome could commit between the two statements: the
    // check missed it, the take found the Capsule free, and a second apply ran.
    if let Some(blocking) = unknown::unresolved_unknown_apply(tx.db(), capsule_id).await? {
        crate::capsules::release_apply(tx, capsule_id, id).await?;
        let message = unknown::needs_inspection_message(blocking);
        fail(tx, id, None, FailureCode::CapsuleNeedsInspection, &message).await?;
        return Ok(ApplyClaim::NeedsInspection { blocking });
    }
    let planned = row.state_generation.ok_or(StoreError::Conflict(
        "apply run without a planned generation",
    ))?;
    if planned != current {
        crate::capsules::release_apply(tx, capsule_id, id).await?;
        let message = format!(
            "the Capsule's state moved from generation {planned} to {current} after this plan was made; \
             nothing was applied; {}",
            takosumi_core::stale_plan_advice(row.plan_kind.unwrap_or(RunKind::Plan))
        );
        fail(tx, id, None, FailureCode::StateGenerationChanged, &message).await?;
        return Ok(ApplyClaim::GenerationChanged { planned, current });
    }
    if !claim(
        tx.db(),
        id,
        &[RunKind::Apply],
        (RunStatus::Queued, RunStatus::Applying),
        (owner, lease_secs),
        record,
    )
    .await?
    {
        return Err(StoreError::Conflict("apply run changed while locked"));
    }
    Ok(ApplyClaim::Claimed)
}

/// `applying` → `applied` with outputs and the StateVersion, only for the lease holder, with
/// its `applied` event (`event` is its data) in the same statement.
pub async fn record_apply(
    tx: &mut Tx,
    id: RunId,
    owner: &str,
    outputs: &serde_json::Value,
    state_version_id: Option<StateVersionId>,
    generation: i64,
    event: &serde_json::Value,
) -> Result<bool, StoreError> {
    crate::transitions!(Applying => Applied);
    let outputs = takosumi_core::json_without_nul(outputs);
    let event = takosumi_core::json_without_nul(event);
    let actor = format!("handler:{owner}");
    let done = sqlx::query_scalar!(
        r#"WITH applied AS (
               UPDATE runs SET status = 'applied', outputs = $3, state_version_id = $4, state_generation = $5,
                      lease_owner = NULL, lease_until = NULL, updated_at = now(), finished_at = now()
                WHERE id = $1 AND status = 'applying' AND lease_owner = $2
               RETURNING id)
           INSERT INTO run_events (run_id, kind, actor, data)
           SELECT id, $6, $7, $8 FROM applied
           RETURNING 1 AS "recorded!""#,
        id.as_uuid(),
        owner,
        outputs.as_ref(),
        state_version_id.map(|s| s.as_uuid()),
        generation,
        EventKind::Applied as EventKind,
        actor,
        event.as_ref()
    )
    .fetch_optional(tx.db())
    .await?;
    Ok(done.is_some())
}

/// Forgets where a plan's sealed file was, once it has been wiped or will never be applied,
/// and with it the plan's sealed sensitive variables (they serve only its apply): one
/// statement.
pub async fn clear_plan_object(tx: &mut Tx, id: RunId) -> Result<(), StoreError> {
    sqlx::query!(
        "WITH cleared AS (
             UPDATE runs SET plan_object_key = NULL, updated_at = now() WHERE id = $1)
         DELETE FROM run_sensitive_vars WHERE run_id = $1",
        id.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(())
}

/// Wakes the oldest released Apply Run still waiting for the Capsule (a wake-up in the
/// caller's transaction), if there is one: what follows every end of an apply that held it.
pub async fn wake_next_apply(tx: &mut Tx, capsule_id: CapsuleId) -> Result<(), StoreError> {
    if let Some(next) = next_waiting_apply(tx, capsule_id).await? {
        crate::outbox::enqueue(tx, Topic::Apply, next).await?;
    }
    Ok(())
}

/// An apply that held the Capsule ended without a new StateVersion: lets go of the Capsule
/// (only if this apply holds it) and wakes the next apply waiting for it, in the caller's
/// transaction.
pub async fn release_capsule_and_wake_next(
    tx: &mut Tx,
    capsule_id: CapsuleId,
    run_id: RunId,
) -> Result<(), StoreError> {
    crate::capsules::release_apply(tx, capsule_id, run_id).await?;
    wake_next_apply(tx, capsule_id).await
}

/// The oldest released Apply Run of a Capsule still waiting for it.
async fn next_waiting_apply(
    tx: &mut Tx,
    capsule_id: CapsuleId,
) -> Result<Option<RunId>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT id FROM runs
            WHERE capsule_id = $1 AND kind = 'apply' AND status = 'queued' AND gate_decision = 'released'
            ORDER BY created_at LIMIT 1"#,
        capsule_id.as_uuid()
    )
    .fetch_optional(tx.db())
    .await?;
    Ok(row.map(|r| RunId::from_uuid(r.id)))
}

/// A Run whose lease expired, and what the reaper made of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reaped {
    /// The Run.
    pub id: RunId,
    /// Its kind.
    pub kind: RunKind,
    /// Its status now: `queued` (will be retried), `failed` (attempts exhausted),
    /// `canceled` (a plan someone asked to cancel) or `unknown_outcome` (an apply).
    pub status: RunStatus,
}

/// Takes back Runs whose handler vanished. A plan (which changes no infrastructure) is
/// queued again, up to `max_attempts` claims (claims a handler handed back itself after
/// a transient fault do not count); an apply becomes `unknown_outcome` and is
/// never re-applied automatically. Safe to run from many processes at once.
pub async fn reap_expired(tx: &mut Tx, max_attempts: i32) -> Result<Vec<Reaped>, StoreError> {
    crate::transitions!(
        Planning => Queued,
        Planning => Failed,
        Planning => Canceled,
        Applying => UnknownOutcome
    );
    let rows = sqlx::query!(
        r#"SELECT id, kind as "kind: RunKind", status as "status: RunStatus",
                  attempts - handbacks as "attempts!", capsule_id,
                  cancel_requested_at IS NOT NULL as "cancel_requested!"
             FROM runs
            WHERE status IN ('planning', 'applying') AND lease_until < now()
            ORDER BY lease_until
            LIMIT 100
            FOR UPDATE SKIP LOCKED"#
    )
    .fetch_all(tx.db())
    .await?;
    let mut reaped = Vec::with_capacity(rows.len());
    for r in rows {
        let id = RunId::from_uuid(r.id);
        let status = if r.status == RunStatus::Applying {
            // Even with a cancel requested: the tool may have changed infrastructure.
            RunStatus::UnknownOutcome
        } else if r.cancel_requested {
            // Someone asked to cancel the plan its vanished handler held: it ends as
            // asked, rather than being queued again for a handler to cancel once it starts.
            RunStatus::Canceled
        } else if r.attempts >= max_attempts {
            RunStatus::Failed
        } else {
            RunStatus::Queued
        };
        debug_assert!(
            r.status.can_become(status),
            "the reaper would move {id} {:?} -> {status:?}, which the Run lifecycle does not allow",
            r.status
        );
        let (code, message): (Option<&str>, Option<String>) = match status {
            RunStatus::UnknownOutcome => (
                Some("unknown_outcome"),
                Some(
                    "the apply stopped without a recorded result; inspect the provider side and the Capsule's \
                     current StateVersion before applying anything else"
                        .to_owned(),
                ),
            ),
            RunStatus::Failed => (
                Some(FailureCode::AttemptsExhausted.as_str()),
                Some(format!("the handler stopped {max_attempts} times while running this step; check the logs, then submit it again")),
            ),
            _ => (None, None),
        };
        // Conditional like every transition: the row is locked, but the update still says
        // which status and expired lease it takes the Run from.
        let done = sqlx::query!(
            r#"UPDATE runs SET status = $2, lease_owner = NULL, lease_until = NULL, error_code = $3,
                      error_message = $4, updated_at = now(),
                      canceled_by = CASE WHEN $2 = 'canceled'::run_status THEN cancel_requested_by ELSE canceled_by END,
                      canceled_at = CASE WHEN $2 = 'canceled'::run_status THEN now() ELSE canceled_at END,
                      finished_at = CASE WHEN $2 IN ('queued'::run_status) THEN NULL ELSE now() END
                WHERE id = $1 AND status = $5 AND lease_until < now()"#,
            id.as_uuid(),
            status as RunStatus,
            code,
            message,
            r.status as RunStatus
        )
        .execute(tx.db())
        .await?;
        if done.rows_affected() == 0 {
            continue;
        }
        if r.status == RunStatus::Applying {
            crate::capsules::release_apply(tx, CapsuleId::from_uuid(r.capsule_id), id).await?;
        }
        reaped.push(Reaped {
            id,
            kind: r.kind,
            status,
        });
    }
    Ok(reaped)
}

/// A queued Run whose wake-up was lost: what the reaper needs to send it again.
#[derive(Debug, Clone, Copy)]
pub struct StuckRun {
    /// The Run.
    pub id: RunId,
    /// Its kind (which queue wakes it).
    pub kind: RunKind,
    /// The gate's decision, if it made one (a released apply goes to the apply queue).
    pub gate_decision: Option<GateDecision>,
}

/// Queued Runs that nothing has touched for `idle_secs` and that have no wake-up pending:
/// their message was lost (a handler died between ack and claim). Returns them so the
/// caller can enqueue a new wake-up in the same transaction.
pub async fn stuck_queued(tx: &mut Tx, idle_secs: i64) -> Result<Vec<StuckRun>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT r.id, r.kind as "kind: RunKind", r.gate_decision as "gate_decision: GateDecision" FROM runs r
            WHERE r.status = 'queued'
              AND r.updated_at < now() - make_interval(secs => $1::bigint::double precision)
              AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.sent_at IS NULL AND o.payload->>'runId' = 'run_' || replace(r.id::text, '-', ''))
            ORDER BY r.updated_at
            LIMIT 100
            FOR UPDATE OF r SKIP LOCKED"#,
        idle_secs
    )
    .fetch_all(tx.db())
    .await?;
    let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.id).collect();
    // Nearly every pass finds none: no statement for nothing.
    if !ids.is_empty() {
        sqlx::query!(
            "UPDATE runs SET updated_at = now() WHERE id = ANY($1)",
            &ids
        )
        .execute(tx.db())
        .await?;
    }
    Ok(rows
        .into_iter()
        .map(|r| StuckRun {
            id: RunId::from_uuid(r.id),
            kind: r.kind,
            gate_decision: r.gate_decision,
        })
        .collect())
}

/// Points a (failed) Run at the StateVersion its partial apply wrote.
pub async fn set_state_version(
    tx: &mut Tx,
    id: RunId,
    sv: StateVersionId,
) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET state_version_id = $2 WHERE id = $1",
        id.as_uuid(),
        sv.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(())
}
