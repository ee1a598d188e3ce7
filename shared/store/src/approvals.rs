//! Approvals given on held Runs. An approval is bound to the digest of the plan its
//! approver was shown; the holds they release are [`crate::runs::hold`].

use takosumi_core::{Role, RunId};

use crate::{StoreError, Tx};

/// Records an approval; `false` when this approver already approved.
pub async fn add_approval(
    tx: &mut Tx,
    run_id: RunId,
    plan_digest: Option<&str>,
    approver_id: &str,
    approver_role: Role,
    note: Option<&str>,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        r#"INSERT INTO approvals (run_id, plan_digest, approver_id, approver_role, note)
           VALUES ($1, $2, $3, $4, $5) ON CONFLICT (run_id, approver_id) DO NOTHING"#,
        run_id.as_uuid(),
        plan_digest,
        approver_id,
        approver_role.as_str(),
        note
    )
    .execute(tx.db())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Distinct approvals of a Run that are bound to `plan_digest` and given by one of
/// `roles`.
pub async fn count_approvals(
    tx: &mut Tx,
    run_id: RunId,
    plan_digest: Option<&str>,
    roles: &[Role],
) -> Result<i64, StoreError> {
    let row = sqlx::query!(
        r#"SELECT count(*) as "n!" FROM approvals
            WHERE run_id = $1 AND plan_digest IS NOT DISTINCT FROM $2 AND approver_role = ANY($3)"#,
        run_id.as_uuid(),
        plan_digest,
        &crate::runs::hold::role_names(roles) as &[&str]
    )
    .fetch_one(tx.db())
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
    Ok(approvals_of(executor, &[run_id])
        .await?
        .remove(&run_id)
        .unwrap_or_default())
}

/// The approvals given on each of `runs`, oldest first, in one read (the evidence writer
/// reads a batch of ended Runs at once); a Run with none has no entry.
pub async fn approvals_of<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    runs: &[RunId],
) -> Result<std::collections::HashMap<RunId, Vec<GivenApproval>>, StoreError> {
    let ids: Vec<uuid::Uuid> = runs.iter().map(RunId::as_uuid).collect();
    let rows = sqlx::query!(
        r#"SELECT run_id as "run_id: RunId", approver_id, approver_role, plan_digest, note,
                  created_at
             FROM approvals WHERE run_id = ANY($1) ORDER BY id"#,
        &ids
    )
    .fetch_all(executor)
    .await?;
    let mut given = std::collections::HashMap::<RunId, Vec<GivenApproval>>::new();
    for a in rows {
        given.entry(a.run_id).or_default().push(GivenApproval {
            approver_id: a.approver_id,
            approver_role: a.approver_role,
            plan_digest: a.plan_digest,
            note: a.note,
            at: a.created_at,
        });
    }
    Ok(given)
}
