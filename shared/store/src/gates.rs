//! Rule sets, holds and approvals. A hold and a release are conditional updates like every
//! other transition; an approval is bound to the digest of the plan its approver was shown.

use takosumi_core::{CapsuleId, HoldReason, RunId, WorkspaceId};

use crate::{StoreError, Tx};

/// A stored rule set version.
#[derive(Debug, Clone)]
pub struct StoredRules {
    /// Version number (1, 2, …) within its scope.
    pub version: i32,
    /// The rules (JSON of `takosumi_policy::RuleSet`).
    pub rules: serde_json::Value,
    /// Who set them.
    pub created_by: String,
}

/// Stores a new version of the rules of a Workspace (`capsule_id` None) or a Capsule.
pub async fn set_rules(
    tx: &mut Tx,
    workspace_id: WorkspaceId,
    capsule_id: Option<CapsuleId>,
    rules: &serde_json::Value,
    created_by: &str,
) -> Result<i32, StoreError> {
    let row = sqlx::query!(
        r#"INSERT INTO rule_sets (workspace_id, capsule_id, version, rules, created_by)
           SELECT $1, $2, COALESCE(MAX(version), 0) + 1, $3, $4
             FROM rule_sets WHERE workspace_id = $1 AND capsule_id IS NOT DISTINCT FROM $2
        RETURNING version"#,
        workspace_id.as_uuid(),
        capsule_id.map(|c| c.as_uuid()),
        rules,
        created_by
    )
    .fetch_one(&mut **tx)
    .await?;
    Ok(row.version)
}

/// The rules in force for a Capsule, each scope's latest version: (Workspace's, Capsule's).
pub async fn rules_in_force(
    pool: &sqlx::PgPool,
    workspace_id: WorkspaceId,
    capsule_id: CapsuleId,
) -> Result<(Option<StoredRules>, Option<StoredRules>), StoreError> {
    Ok((
        current_rules(pool, workspace_id, None).await?,
        current_rules(pool, workspace_id, Some(capsule_id)).await?,
    ))
}

/// The current rules of a scope.
pub async fn current_rules<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
    capsule_id: Option<CapsuleId>,
) -> Result<Option<StoredRules>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT version, rules, created_by FROM rule_sets
            WHERE workspace_id = $1 AND capsule_id IS NOT DISTINCT FROM $2
            ORDER BY version DESC LIMIT 1"#,
        workspace_id.as_uuid(),
        capsule_id.map(|c| c.as_uuid())
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| StoredRules {
        version: r.version,
        rules: r.rules,
        created_by: r.created_by,
    }))
}

/// Holds a queued Run for people: records the reason and how many approvals release it.
pub async fn hold(
    tx: &mut Tx,
    id: RunId,
    reason: HoldReason,
    details: &serde_json::Value,
    approvals_required: i32,
    approver_roles: &[String],
) -> Result<bool, StoreError> {
    crate::transitions!(Queued => Held);
    let done = sqlx::query!(
        r#"UPDATE runs SET status = 'held', hold_reason = $2, hold_details = $3, gate_decision = 'held',
                  approvals_required = $4, approver_roles = $5, updated_at = now()
            WHERE id = $1 AND status = 'queued' AND gate_decision IS NULL"#,
        id.as_uuid(),
        reason as HoldReason,
        details,
        approvals_required,
        approver_roles
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Releases a held Run back to `queued` with the gate decision `released`.
pub async fn release(tx: &mut Tx, id: RunId) -> Result<bool, StoreError> {
    crate::transitions!(Held => Queued);
    let done = sqlx::query!(
        r#"UPDATE runs SET status = 'queued', gate_decision = 'released', updated_at = now()
            WHERE id = $1 AND status = 'held'"#,
        id.as_uuid()
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Records an approval; `false` when this approver already approved.
pub async fn add_approval(
    tx: &mut Tx,
    run_id: RunId,
    plan_digest: Option<&str>,
    approver_id: &str,
    approver_role: &str,
    note: Option<&str>,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"INSERT INTO approvals (run_id, plan_digest, approver_id, approver_role, note)
           VALUES ($1, $2, $3, $4, $5) ON CONFLICT (run_id, approver_id) DO NOTHING"#,
        run_id.as_uuid(),
        plan_digest,
        approver_id,
        approver_role,
        note
    )
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Distinct approvals of a Run that are bound to `plan_digest` and given by one of
/// `roles`.
pub async fn count_approvals(
    tx: &mut Tx,
    run_id: RunId,
    plan_digest: Option<&str>,
    roles: &[String],
) -> Result<i64, StoreError> {
    let row = sqlx::query!(
        r#"SELECT count(*) as "n!" FROM approvals
            WHERE run_id = $1 AND plan_digest IS NOT DISTINCT FROM $2 AND approver_role = ANY($3)"#,
        run_id.as_uuid(),
        plan_digest,
        roles
    )
    .fetch_one(&mut **tx)
    .await?;
    Ok(row.n)
}

/// One approval given on a Run.
#[derive(Debug, Clone)]
pub struct GivenApproval {
    /// The approver's token id.
    pub approver_id: String,
    /// The role it had.
    pub approver_role: String,
    /// The plan digest the approval is bound to.
    pub plan_digest: Option<String>,
    /// What the approver wrote.
    pub note: Option<String>,
    /// When.
    pub at: chrono::DateTime<chrono::Utc>,
}

/// The approvals given on a Run, oldest first.
pub async fn approvals<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
) -> Result<Vec<GivenApproval>, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT approver_id, approver_role, plan_digest, note, created_at FROM approvals
            WHERE run_id = $1 ORDER BY id"#,
        run_id.as_uuid()
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|a| GivenApproval {
            approver_id: a.approver_id,
            approver_role: a.approver_role,
            plan_digest: a.plan_digest,
            note: a.note,
            at: a.created_at,
        })
        .collect())
}

/// Where the sealed `show -json` of a plan lives (private).
pub async fn set_plan_json_key(tx: &mut Tx, id: RunId, key: &str) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET plan_json_object_key = $2 WHERE id = $1",
        id.as_uuid(),
        key
    )
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The gate's view of a Run's private fields.
pub async fn gate_fields<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<Option<(bool, Option<String>, i32, Vec<String>)>, StoreError> {
    let row = sqlx::query!(
        "SELECT require_approval, plan_json_object_key, approvals_required, approver_roles FROM runs WHERE id = $1",
        id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| {
        (
            r.require_approval,
            r.plan_json_object_key,
            r.approvals_required,
            r.approver_roles,
        )
    }))
}

/// Marks a submission as asking for approval.
pub async fn set_require_approval(tx: &mut Tx, id: RunId) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET require_approval = true WHERE id = $1",
        id.as_uuid()
    )
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A token's name (agent exemptions name tokens).
pub async fn token_name<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    token_id: &str,
) -> Result<Option<String>, StoreError> {
    let Ok(id) = token_id.parse::<takosumi_core::TokenId>() else {
        return Ok(None);
    };
    let row = sqlx::query!("SELECT name FROM api_tokens WHERE id = $1", id.as_uuid())
        .fetch_optional(executor)
        .await?;
    Ok(row.map(|r| r.name))
}

/// Records the dry-run scan's report on a plan Run (audit evidence).
pub async fn set_scan_report<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
    report: &serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query!(
        "UPDATE runs SET scan_report = $2 WHERE id = $1",
        id.as_uuid(),
        report
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// The dry-run scan report of a Run, if one was made.
pub async fn scan_report<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: RunId,
) -> Result<Option<serde_json::Value>, StoreError> {
    let row = sqlx::query!("SELECT scan_report FROM runs WHERE id = $1", id.as_uuid())
        .fetch_optional(executor)
        .await?;
    Ok(row.and_then(|r| r.scan_report))
}
