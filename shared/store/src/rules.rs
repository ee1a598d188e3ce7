//! Rule sets: the versioned approval rules of a Workspace or a Capsule.

use takosumi_core::{CapsuleId, WorkspaceId};

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
    .fetch_one(tx.db())
    .await?;
    Ok(row.version)
}

/// The rules in force for a Capsule: each scope's latest version.
#[derive(Debug, Clone, Default)]
pub struct RulesInForce {
    /// The Workspace's rules.
    pub workspace: Option<StoredRules>,
    /// The Capsule's own rules.
    pub capsule: Option<StoredRules>,
}

/// The versions of the rules a decision was made under, as its record names them (`None`:
/// no rules set at that scope).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RuleVersions {
    /// The Workspace's.
    pub workspace: Option<i32>,
    /// The Capsule's own.
    pub capsule: Option<i32>,
}

impl RulesInForce {
    /// The version of each scope's rules.
    pub fn versions(&self) -> RuleVersions {
        RuleVersions {
            workspace: self.workspace.as_ref().map(|r| r.version),
            capsule: self.capsule.as_ref().map(|r| r.version),
        }
    }
}

/// The rules in force for a Capsule, each scope's latest version, in one statement (the
/// view `rules_in_force`, migration `20261205020000_rules_in_force.sql`).
pub async fn rules_in_force(
    pool: &crate::Pool,
    workspace_id: WorkspaceId,
    capsule_id: CapsuleId,
) -> Result<RulesInForce, StoreError> {
    let rows = sqlx::query!(
        r#"SELECT capsule_id IS NOT NULL AS "capsule_scope!", version as "version!",
                  rules as "rules!", created_by as "created_by!"
             FROM rules_in_force
            WHERE workspace_id = $1 AND (capsule_id IS NULL OR capsule_id = $2)"#,
        workspace_id.as_uuid(),
        capsule_id.as_uuid()
    )
    .fetch_all(pool)
    .await?;
    let mut in_force = RulesInForce::default();
    for row in rows {
        let stored = Some(StoredRules {
            version: row.version,
            rules: row.rules,
            created_by: row.created_by,
        });
        if row.capsule_scope {
            in_force.capsule = stored;
        } else {
            in_force.workspace = stored;
        }
    }
    Ok(in_force)
}

/// The current rules of a scope.
pub async fn current_rules<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
    capsule_id: Option<CapsuleId>,
) -> Result<Option<StoredRules>, StoreError> {
    let row = sqlx::query!(
        r#"SELECT version as "version!", rules as "rules!", created_by as "created_by!"
             FROM rules_in_force
            WHERE workspace_id = $1 AND capsule_id IS NOT DISTINCT FROM $2"#,
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
