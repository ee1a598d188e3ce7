//! API tokens. Only the SHA-256 of a token is stored; lookups hash the presented token and
//! find the row by its hash, so no stored value can be replayed and no comparison leaks
//! timing about a stored secret.

use takosumi_core::{TokenId, WorkspaceId};

use crate::StoreError;

/// A token's grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGrant {
    /// The token's id.
    pub id: TokenId,
    /// Its name (for audit).
    pub name: String,
    /// `viewer`, `operator`, `approver`, `admin` or `agent`.
    pub role: String,
    /// The Workspace it is limited to; `None` for an instance-wide token.
    pub workspace_id: Option<WorkspaceId>,
}

/// SHA-256 of a presented token.
pub fn hash_token(token: &str) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(token.as_bytes()).to_vec()
}

/// Stores a token's hash with its grant; an existing hash keeps its row (bootstrap is
/// idempotent).
pub async fn upsert(
    pool: &sqlx::PgPool,
    token: &str,
    name: &str,
    role: &str,
    workspace_id: Option<WorkspaceId>,
) -> Result<TokenId, StoreError> {
    let id = TokenId::new();
    let hash = hash_token(token);
    let row = sqlx::query!(
        r#"INSERT INTO api_tokens (id, token_hash, name, role, workspace_id)
           VALUES ($1, $2, $3, $4, $5)
           ON CONFLICT (token_hash) DO UPDATE SET token_hash = EXCLUDED.token_hash
           RETURNING id"#,
        id.as_uuid(),
        hash,
        name,
        role,
        workspace_id.map(|w| w.as_uuid())
    )
    .fetch_one(pool)
    .await?;
    Ok(TokenId::from_uuid(row.id))
}

/// Finds the live grant for a presented token.
pub async fn find(pool: &sqlx::PgPool, token: &str) -> Result<Option<TokenGrant>, StoreError> {
    let hash = hash_token(token);
    let row = sqlx::query!(
        "SELECT id, name, role, workspace_id FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL",
        hash
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| TokenGrant {
        id: TokenId::from_uuid(r.id),
        name: r.name,
        role: r.role,
        workspace_id: r.workspace_id.map(WorkspaceId::from_uuid),
    }))
}
