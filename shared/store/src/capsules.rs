//! Capsules: what to run (repo, branch, directory, tool, variables) and the state
//! generation every apply moves forward by exactly one; a Workspace's Capsules, the
//! staleness a push marks and automatic update.

use chrono::{DateTime, Utc};
use takosumi_core::{CapsuleId, RunId, StateVersionId, Tool, WorkspaceId};

use crate::{StoreError, Tx};

/// A Capsule row.
#[derive(Debug, Clone)]
pub struct Capsule {
    /// Its id.
    pub id: CapsuleId,
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// Its name, unique in the Workspace.
    pub name: String,
    /// The Git repository URL.
    pub repo: String,
    /// The branch that is planned.
    pub branch: String,
    /// The configuration directory inside the repository.
    pub dir: String,
    /// `tofu` or `terraform`.
    pub tool: Tool,
    /// Per-run variables (a JSON object).
    pub vars: serde_json::Value,
    /// The generation of the current state.
    pub state_generation: i64,
    /// The current StateVersion, if any apply has written one.
    pub current_state_version_id: Option<StateVersionId>,
    /// The apply that holds the Capsule right now.
    pub running_apply_id: Option<RunId>,
    /// What a drift check compares reality with: the Run whose plan the current
    /// StateVersion carried out (written with the state by
    /// `states::versions::record_written`); `None` when nothing was applied, the
    /// StateVersion records no commit, or the last apply was a destroy.
    pub drift_baseline_run_id: Option<RunId>,
    /// A push moved the branch since the last plan.
    pub stale: bool,
    /// The variables its configuration declares `sensitive = true`, as its latest plan
    /// read them (`None`: never planned, so unknown).
    pub sensitive_var_names: Option<Vec<String>>,
    /// When it was registered.
    pub created_at: DateTime<Utc>,
}

/// `query_as!` of a Capsule's columns (`capsules c`) into `$row` ([`Capsule`], or a row
/// that adds `$more` columns), then `$rest` (joins, `WHERE`, `ORDER BY`): the column list
/// is written once.
macro_rules! select_capsules {
    ($row:ty, $more:literal, $rest:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $row,
            r#"SELECT c.id as "id: CapsuleId", c.workspace_id as "workspace_id: WorkspaceId", c.name,
                      c.repo, c.branch, c.dir, c.tool as "tool: Tool", c.vars, c.state_generation,
                      c.current_state_version_id as "current_state_version_id: StateVersionId",
                      c.running_apply_id as "running_apply_id: RunId",
                      c.drift_baseline_run_id as "drift_baseline_run_id: RunId", c.stale,
                      c.sensitive_var_names, c.created_at"# + $more + " FROM capsules c " + $rest
            $(, $arg)*
        )
    };
}

/// What registering a Capsule needs.
#[derive(Debug, Clone)]
pub struct NewCapsule<'a> {
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// Its name.
    pub name: &'a str,
    /// Git URL.
    pub repo: &'a str,
    /// Branch.
    pub branch: &'a str,
    /// Directory (validated by the caller).
    pub dir: &'a str,
    /// `tofu` or `terraform`.
    pub tool: Tool,
    /// Variables.
    pub vars: &'a serde_json::Value,
}

/// Inserts a Capsule.
pub async fn create(tx: &mut Tx, new: &NewCapsule<'_>) -> Result<CapsuleId, StoreError> {
    let id = CapsuleId::new();
    sqlx::query!(
        r#"INSERT INTO capsules (id, workspace_id, name, repo, branch, dir, tool, vars)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"#,
        id.as_uuid(),
        new.workspace_id.as_uuid(),
        new.name,
        new.repo,
        new.branch,
        new.dir,
        new.tool as Tool,
        new.vars
    )
    .execute(tx.db())
    .await?;
    Ok(id)
}

/// Reads a Capsule.
pub async fn get<'e, E>(executor: E, id: CapsuleId) -> Result<Option<Capsule>, StoreError>
where
    E: sqlx::PgExecutor<'e>,
{
    get_of(executor, CapsuleOf::Id(id)).await
}

/// Which Capsule [`get_of`] reads.
#[derive(Debug, Clone, Copy)]
pub enum CapsuleOf {
    /// The Capsule with this id.
    Id(CapsuleId),
    /// The Capsule this Run belongs to: read beside the Run itself, not after it.
    Run(RunId),
}

/// Reads a Capsule by its id or by one of its Runs (one statement for both).
pub async fn get_of<'e, E>(executor: E, of: CapsuleOf) -> Result<Option<Capsule>, StoreError>
where
    E: sqlx::PgExecutor<'e>,
{
    let (id, run) = match of {
        CapsuleOf::Id(id) => (Some(id.as_uuid()), None),
        CapsuleOf::Run(run) => (None, Some(run.as_uuid())),
    };
    // The Run's lookup is an init plan COALESCE evaluates only when no id is given.
    Ok(select_capsules!(
        Capsule,
        "",
        "WHERE c.id = COALESCE($1, (SELECT capsule_id FROM runs WHERE id = $2))",
        id,
        run
    )
    .fetch_optional(executor)
    .await?)
}

/// A Capsule as the API shows it: its row, what its latest finished drift check found and
/// the worker pool it runs on, read together so every answer that shows a Capsule shows
/// the same thing.
#[derive(Debug, Clone)]
pub struct Shown {
    /// The row.
    pub capsule: Capsule,
    /// The latest finished drift check's finding (`None`: no check finished yet).
    pub drift: Option<bool>,
    /// The name of its worker pool (`None`: the control node's own queues).
    pub pool: Option<String>,
}

struct ShownRow {
    id: CapsuleId,
    workspace_id: WorkspaceId,
    name: String,
    repo: String,
    branch: String,
    dir: String,
    tool: Tool,
    vars: serde_json::Value,
    state_generation: i64,
    current_state_version_id: Option<StateVersionId>,
    running_apply_id: Option<RunId>,
    drift_baseline_run_id: Option<RunId>,
    stale: bool,
    sensitive_var_names: Option<Vec<String>>,
    created_at: DateTime<Utc>,
    drift: Option<bool>,
    pool: Option<String>,
}

impl From<ShownRow> for Shown {
    fn from(r: ShownRow) -> Self {
        Self {
            capsule: Capsule {
                id: r.id,
                workspace_id: r.workspace_id,
                name: r.name,
                repo: r.repo,
                branch: r.branch,
                dir: r.dir,
                tool: r.tool,
                vars: r.vars,
                state_generation: r.state_generation,
                current_state_version_id: r.current_state_version_id,
                running_apply_id: r.running_apply_id,
                drift_baseline_run_id: r.drift_baseline_run_id,
                stale: r.stale,
                sensitive_var_names: r.sensitive_var_names,
                created_at: r.created_at,
            },
            drift: r.drift,
            pool: r.pool,
        }
    }
}

/// Which Capsules [`shown`] reads.
#[derive(Debug, Clone, Copy)]
pub enum ShownOf {
    /// This one.
    Capsule(CapsuleId),
    /// Every Capsule of this Workspace, oldest first.
    Workspace(WorkspaceId),
}

/// Capsules as the API shows them ([`Shown`]), in one statement: the drift finding is the
/// newest finished (`planned`) drift check's, found through `runs_capsule_newest`.
pub async fn shown<'e, E>(executor: E, of: ShownOf) -> Result<Vec<Shown>, StoreError>
where
    E: sqlx::PgExecutor<'e>,
{
    let (id, ws) = match of {
        ShownOf::Capsule(id) => (Some(id.as_uuid()), None),
        ShownOf::Workspace(ws) => (None, Some(ws.as_uuid())),
    };
    let rows = select_capsules!(
        ShownRow,
        r#", (SELECT r.drift FROM runs r
              WHERE r.capsule_id = c.id AND r.kind = 'drift_check' AND r.status = 'planned'
              ORDER BY r.created_at DESC, r.id DESC LIMIT 1) as "drift?",
            p.name as "pool?""#,
        r#"LEFT JOIN worker_pools p ON p.id = c.pool_id
           WHERE c.id = $1 OR c.workspace_id = $2
           ORDER BY c.created_at, c.id"#,
        id,
        ws
    )
    .fetch_all(executor)
    .await?;
    Ok(rows.into_iter().map(Shown::from).collect())
}

/// One Capsule as the API shows it ([`shown`]).
pub async fn get_shown<'e, E>(executor: E, id: CapsuleId) -> Result<Option<Shown>, StoreError>
where
    E: sqlx::PgExecutor<'e>,
{
    Ok(shown(executor, ShownOf::Capsule(id))
        .await?
        .into_iter()
        .next())
}

/// The Capsules of a Workspace (only the stale ones when asked).
pub async fn workspace_capsules(
    pool: &crate::Pool,
    ws: WorkspaceId,
    only_stale: bool,
) -> Result<Vec<CapsuleId>, StoreError> {
    let rows = sqlx::query!(
        "SELECT id FROM capsules WHERE workspace_id = $1 AND (stale OR NOT $2) ORDER BY created_at, id",
        ws.as_uuid(),
        only_stale
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| CapsuleId::from_uuid(r.id))
        .collect())
}

/// Records which variables the configuration a plan just read declares sensitive, added to
/// those earlier plans saw: once a configuration marked a variable sensitive its value stays
/// withheld (a pull request's plan cannot unmark one).
pub async fn add_sensitive_var_names(
    tx: &mut Tx,
    id: CapsuleId,
    names: &[String],
) -> Result<(), StoreError> {
    // Most plans add nothing: no statement then, and no new row version (nor row lock) of
    // the Capsule per plan.
    if names.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        r#"UPDATE capsules SET sensitive_var_names = ARRAY(
                  SELECT DISTINCT n FROM unnest(COALESCE(sensitive_var_names, '{}') || $2::text[]) n ORDER BY n)
            WHERE id = $1 AND NOT COALESCE(sensitive_var_names, '{}') @> $2::text[]"#,
        id.as_uuid(),
        names
    )
    .execute(tx.db())
    .await?;
    Ok(())
}

/// Marks Capsules stale with the pushed commit.
pub async fn mark_stale(tx: &mut Tx, ids: &[CapsuleId], commit: &str) -> Result<u64, StoreError> {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|c| c.as_uuid()).collect();
    let done = sqlx::query!(
        "UPDATE capsules SET stale = true, stale_commit = $2, updated_at = now() WHERE id = ANY($1)",
        &ids,
        commit
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected())
}

/// Turns automatic update on or off, recording on whose behalf it runs.
pub async fn set_auto_update(
    tx: &mut Tx,
    id: CapsuleId,
    on: bool,
    by: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "UPDATE capsules SET auto_update = $2, auto_update_by = CASE WHEN $2 THEN $3 ELSE NULL END, updated_at = now() WHERE id = $1",
        id.as_uuid(),
        on,
        by
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Takes the Capsule for an apply: only where no other apply holds it. Returns the
/// current generation, or `None` when another apply holds it.
pub async fn take_for_apply(
    tx: &mut Tx,
    id: CapsuleId,
    run_id: RunId,
) -> Result<Option<i64>, StoreError> {
    let row = sqlx::query!(
        r#"UPDATE capsules SET running_apply_id = $2, updated_at = now()
            WHERE id = $1 AND (running_apply_id IS NULL OR running_apply_id = $2)
        RETURNING state_generation"#,
        id.as_uuid(),
        run_id.as_uuid()
    )
    .fetch_optional(tx.db())
    .await?;
    Ok(row.map(|r| r.state_generation))
}

/// Lets go of the Capsule, only if this apply holds it.
pub async fn release_apply(tx: &mut Tx, id: CapsuleId, run_id: RunId) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "UPDATE capsules SET running_apply_id = NULL, updated_at = now() WHERE id = $1 AND running_apply_id = $2",
        id.as_uuid(),
        run_id.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}
