//! ProviderBindings (named credential sets attached to Capsules) and what a Run was given:
//! its per-run variables, its sealed sensitive variables, and the names of the bindings
//! and variables a step injected.
//!
//! Credential values exist here only sealed (`bytea`, opened by the plan and apply steps
//! with the server key); this module never sees a plaintext value and never returns a
//! sealed blob through anything the API projects.

use chrono::{DateTime, Utc};
use takosumi_core::{BindingKind, CapsuleId, ProviderBindingId, RunId, WorkspaceId};

use crate::{StoreError, Tx};

/// A ProviderBinding without its values.
#[derive(Debug, Clone)]
pub struct Binding {
    /// Its id (`pb_…`).
    pub id: ProviderBindingId,
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// Its name, unique in the Workspace.
    pub name: String,
    /// How its values reach the tool.
    pub kind: BindingKind,
    /// The variables it injects (names only).
    pub env_names: Vec<String>,
    /// Who created it.
    pub created_by: String,
    /// When.
    pub created_at: DateTime<Utc>,
}

/// A binding with its sealed values, for the steps that inject them.
pub struct SealedBinding {
    /// The binding.
    pub binding: Binding,
    /// The values, sealed for purpose `credential` and subject = the binding id.
    pub sealed: Vec<u8>,
}

impl std::fmt::Debug for SealedBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedBinding")
            .field("binding", &self.binding)
            .field("sealed_bytes", &self.sealed.len())
            .finish()
    }
}

/// What a new binding is.
#[derive(Debug, Clone)]
pub struct NewBinding<'a> {
    /// Its id (the sealing subject, so chosen before sealing).
    pub id: ProviderBindingId,
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// Its name.
    pub name: &'a str,
    /// How its values reach the tool.
    pub kind: BindingKind,
    /// The names it injects.
    pub env_names: &'a [String],
    /// The sealed values.
    pub sealed: &'a [u8],
    /// The creating actor.
    pub created_by: &'a str,
}

/// Inserts a binding.
pub async fn create(tx: &mut Tx, new: &NewBinding<'_>) -> Result<Binding, StoreError> {
    let row = sqlx::query!(
        r#"INSERT INTO provider_bindings (id, workspace_id, name, kind, env_names, sealed, created_by)
           VALUES ($1, $2, $3, $4, $5, $6, $7)
           RETURNING created_at"#,
        new.id.as_uuid(),
        new.workspace_id.as_uuid(),
        new.name,
        new.kind as BindingKind,
        new.env_names,
        new.sealed,
        new.created_by
    )
    .fetch_one(tx.db())
    .await?;
    Ok(Binding {
        id: new.id,
        workspace_id: new.workspace_id,
        name: new.name.to_owned(),
        kind: new.kind,
        env_names: new.env_names.to_vec(),
        created_by: new.created_by.to_owned(),
        created_at: row.created_at,
    })
}

/// Reads a binding (without its values).
pub async fn get<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: ProviderBindingId,
) -> Result<Option<Binding>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT id, workspace_id, name, kind AS "kind: BindingKind", env_names, created_by, created_at
             FROM provider_bindings WHERE id = $1"#,
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| Binding {
        id: ProviderBindingId::from_uuid(r.id),
        workspace_id: WorkspaceId::from_uuid(r.workspace_id),
        name: r.name,
        kind: r.kind,
        env_names: r.env_names,
        created_by: r.created_by,
        created_at: r.created_at,
    }))
}

/// A Workspace's bindings, by name.
pub async fn list_for_workspace<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
) -> Result<Vec<Binding>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT id, workspace_id, name, kind AS "kind: BindingKind", env_names, created_by, created_at
             FROM provider_bindings WHERE workspace_id = $1 ORDER BY name"#,
        workspace_id.as_uuid()
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Binding {
            id: ProviderBindingId::from_uuid(r.id),
            workspace_id: WorkspaceId::from_uuid(r.workspace_id),
            name: r.name,
            kind: r.kind,
            env_names: r.env_names,
            created_by: r.created_by,
            created_at: r.created_at,
        })
        .collect())
}

/// The bindings attached to a Capsule, in the order they were attached.
pub async fn for_capsule<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    capsule_id: CapsuleId,
) -> Result<Vec<Binding>, StoreError> {
    Ok(sealed_for_capsule(executor, capsule_id)
        .await?
        .into_iter()
        .map(|s| s.binding)
        .collect())
}

/// The bindings attached to a Capsule with their sealed values, in attachment order.
pub async fn sealed_for_capsule<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    capsule_id: CapsuleId,
) -> Result<Vec<SealedBinding>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT b.id, b.workspace_id, b.name, b.kind AS "kind: BindingKind", b.env_names, b.created_by, b.created_at, b.sealed
             FROM capsule_provider_bindings c
             JOIN provider_bindings b ON b.id = c.binding_id
            WHERE c.capsule_id = $1
            ORDER BY c.attached_at, b.id"#,
        capsule_id.as_uuid()
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| SealedBinding {
            binding: Binding {
                id: ProviderBindingId::from_uuid(r.id),
                workspace_id: WorkspaceId::from_uuid(r.workspace_id),
                name: r.name,
                kind: r.kind,
                env_names: r.env_names,
                created_by: r.created_by,
                created_at: r.created_at,
            },
            sealed: r.sealed,
        })
        .collect())
}

/// Attaches a binding to a Capsule. `false`: it was already attached (nothing changed).
pub async fn attach(
    tx: &mut Tx,
    capsule_id: CapsuleId,
    binding_id: ProviderBindingId,
    attached_by: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"INSERT INTO capsule_provider_bindings (capsule_id, binding_id, attached_by)
           VALUES ($1, $2, $3) ON CONFLICT (capsule_id, binding_id) DO NOTHING"#,
        capsule_id.as_uuid(),
        binding_id.as_uuid(),
        attached_by
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Detaches a binding from a Capsule. `false`: it was not attached.
pub async fn detach(
    tx: &mut Tx,
    capsule_id: CapsuleId,
    binding_id: ProviderBindingId,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "DELETE FROM capsule_provider_bindings WHERE capsule_id = $1 AND binding_id = $2",
        capsule_id.as_uuid(),
        binding_id.as_uuid()
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Settles a plan Run's variables at its claim when its submission set none (a webhook's
/// plan, a drift check): from then on the record names what it planned with and its apply
/// reads the same values. Only once; `false` if they were already set.
pub async fn settle_run_vars<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
    names: &[String],
    sealed: &[u8],
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET vars_sealed = $2, var_names = $3, updated_at = now()
            WHERE id = $1 AND vars IS NULL AND vars_sealed IS NULL"#,
        run_id.as_uuid(),
        sealed,
        names
    )
    .execute(executor)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A Run's sealed variables, if it was submitted with its own.
pub async fn sealed_run_vars<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
) -> Result<Option<Vec<u8>>, StoreError> {
    let row = sqlx::query!(
        "SELECT vars_sealed FROM runs WHERE id = $1",
        run_id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.and_then(|r| r.vars_sealed))
}

/// Stores a plan Run's sealed sensitive variables (once).
pub async fn put_sensitive_vars(
    tx: &mut Tx,
    run_id: RunId,
    names: &[String],
    sealed: &[u8],
) -> Result<(), StoreError> {
    sqlx::query!(
        "INSERT INTO run_sensitive_vars (run_id, names, sealed) VALUES ($1, $2, $3)",
        run_id.as_uuid(),
        names,
        sealed
    )
    .execute(tx.db())
    .await?;
    Ok(())
}

/// A Run's sealed sensitive variables: `(names, sealed)`, if it has any.
pub async fn sensitive_vars<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
) -> Result<Option<(Vec<String>, Vec<u8>)>, StoreError> {
    let row = sqlx::query!(
        "SELECT names, sealed FROM run_sensitive_vars WHERE run_id = $1",
        run_id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| (r.names, r.sealed)))
}

/// Records what a running step injected: the bindings (`[{id, name}]`), the names of every
/// injected variable, and the names of the plain variables it ran with (an apply shows its
/// plan's; never their values). Only for the lease holder of a running step.
/// `state_generation`, when given, is the generation of the Capsule state delivered with a
/// relayed plan's job: the generation its plan is recorded against (see
/// `takosumi_runtime::plan_commit::PlanToCommit::state_generation`).
pub async fn record_run_env<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
    owner: &str,
    provider_bindings: &serde_json::Value,
    injected_env_names: &[String],
    var_names: &[String],
    state_generation: Option<i64>,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"UPDATE runs SET provider_bindings = $3, injected_env_names = $4,
                  var_names = COALESCE(var_names, $5),
                  state_generation = COALESCE($6, state_generation), updated_at = now()
            WHERE id = $1 AND lease_owner = $2 AND status IN ('planning', 'applying')"#,
        run_id.as_uuid(),
        owner,
        provider_bindings,
        injected_env_names,
        var_names,
        state_generation
    )
    .execute(executor)
    .await?;
    Ok(done.rows_affected() == 1)
}
