//! API tokens. Only the SHA-256 of a token is stored; lookups hash the presented token and
//! find the row by its hash, so no stored value can be replayed and no comparison leaks
//! timing about a stored secret.

use takosumi_core::{Role, TokenId, WorkspaceId};

use crate::StoreError;

/// A token's grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGrant {
    /// The token's id.
    pub id: TokenId,
    /// Its name (for audit).
    pub name: String,
    /// What it may do.
    pub role: Role,
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
    pool: &crate::Pool,
    token: &str,
    name: &str,
    role: takosumi_core::Role,
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
        role.as_str(),
        workspace_id.map(|w| w.as_uuid())
    )
    .fetch_one(pool)
    .await?;
    Ok(TokenId::from_uuid(row.id))
}

/// Finds the live grant for a presented token.
pub async fn find(pool: &crate::Pool, token: &str) -> Result<Option<TokenGrant>, StoreError> {
    Ok(find_by_hash(pool, &hash_token(token))
        .await?
        .map(|live| live.grant))
}

/// A live token's grant and until when it stays live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveGrant {
    /// What it may do.
    pub grant: TokenGrant,
    /// When it expires; `None`: never (it may still be revoked).
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Finds the live grant of a token by its hash ([`hash_token`]).
pub async fn find_by_hash(
    pool: &crate::Pool,
    hash: &[u8],
) -> Result<Option<LiveGrant>, StoreError> {
    let row = sqlx::query!(
        "SELECT id, name, role, workspace_id, expires_at FROM api_tokens
          WHERE token_hash = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())",
        hash
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| LiveGrant {
        grant: GrantRow {
            id: r.id,
            name: r.name,
            role: r.role,
            workspace_id: r.workspace_id,
        }
        .into(),
        expires_at: r.expires_at,
    }))
}

/// The channel a revocation is announced on (`NOTIFY`, delivered at commit), so every
/// API process drops what it cached of the token's grant.
pub const REVOKED_CHANNEL: &str = "takosumi_token_revoked";

/// A role as stored: `api_tokens.role` has a CHECK constraint naming exactly
/// [`Role::ALL`], so a row holds no other; were one ever written around it, it would be
/// read as the least privileged role rather than fail every request.
fn stored_role(name: &str) -> Role {
    name.parse().unwrap_or_else(|e| {
        tracing::error!(error = %e, "a token row holds a role the schema does not allow");
        Role::Viewer
    })
}

/// A live token's grant as read from its row (the token lookup and a session's).
pub(crate) struct GrantRow {
    pub(crate) id: uuid::Uuid,
    pub(crate) name: String,
    pub(crate) role: String,
    pub(crate) workspace_id: Option<uuid::Uuid>,
}

impl From<GrantRow> for TokenGrant {
    fn from(r: GrantRow) -> Self {
        Self {
            id: TokenId::from_uuid(r.id),
            name: r.name,
            role: stored_role(&r.role),
            workspace_id: r.workspace_id.map(WorkspaceId::from_uuid),
        }
    }
}

/// A token as an administrator sees it (never its value or hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenInfo {
    /// `tok_…`.
    pub id: TokenId,
    /// Its name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// The Workspace it is limited to.
    pub workspace_id: Option<WorkspaceId>,
    /// When it was made.
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// Who made it (`user:tok_…`; `None` for a bootstrap or scripted token).
    pub created_by: Option<String>,
    /// When it stops working.
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
    /// When it was revoked.
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Who revoked it.
    pub revoked_by: Option<String>,
}

/// What a new token is.
#[derive(Debug, Clone)]
pub struct NewToken<'a> {
    /// The secret value (only its hash is stored).
    pub token: &'a str,
    /// Its name.
    pub name: &'a str,
    /// Its role.
    pub role: Role,
    /// The Workspace it is limited to.
    pub workspace_id: Option<WorkspaceId>,
    /// When it stops working.
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Who makes it.
    pub created_by: &'a str,
}

/// Stores a new token (in the caller's transaction, beside its activity entry).
pub async fn create(tx: &mut crate::Tx, t: &NewToken<'_>) -> Result<TokenInfo, StoreError> {
    let row = sqlx::query_as!(
        TokenRow,
        r#"INSERT INTO api_tokens (id, token_hash, name, role, workspace_id, expires_at, created_by)
           VALUES ($1, $2, $3, $4, $5, $6, $7)
           RETURNING id, name, role, workspace_id, created_at, created_by, expires_at, revoked_at, revoked_by"#,
        TokenId::new().as_uuid(),
        hash_token(t.token),
        t.name,
        t.role.as_str(),
        t.workspace_id.map(|w| w.as_uuid()),
        t.expires_at,
        t.created_by
    )
    .fetch_one(tx.db())
    .await?;
    Ok(row.into())
}

/// Every token, or those limited to `workspace`, newest first.
pub async fn list(
    pool: &crate::Pool,
    workspace: Option<WorkspaceId>,
) -> Result<Vec<TokenInfo>, StoreError> {
    let rows = sqlx::query_as!(
        TokenRow,
        r#"SELECT id, name, role, workspace_id, created_at, created_by, expires_at, revoked_at, revoked_by
             FROM api_tokens WHERE $1::uuid IS NULL OR workspace_id = $1
            ORDER BY created_at DESC, id"#,
        workspace.map(|w| w.as_uuid())
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(Into::into).collect())
}

/// The token `id`, revoked or not.
pub async fn get(pool: &crate::Pool, id: TokenId) -> Result<Option<TokenInfo>, StoreError> {
    let row = sqlx::query_as!(
        TokenRow,
        r#"SELECT id, name, role, workspace_id, created_at, created_by, expires_at, revoked_at, revoked_by
             FROM api_tokens WHERE id = $1"#,
        id.as_uuid()
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(Into::into))
}

/// Revokes a live token, once: `None` when it is unknown or already revoked. Every request
/// and dashboard session made with it is refused from the next one on.
pub async fn revoke(
    tx: &mut crate::Tx,
    id: TokenId,
    by: &str,
) -> Result<Option<TokenInfo>, StoreError> {
    let row = sqlx::query_as!(
        TokenRow,
        r#"UPDATE api_tokens SET revoked_at = now(), revoked_by = $2
            WHERE id = $1 AND revoked_at IS NULL
           RETURNING id, name, role, workspace_id, created_at, created_by, expires_at, revoked_at, revoked_by"#,
        id.as_uuid(),
        by
    )
    .fetch_optional(tx.db())
    .await?;
    if row.is_some() {
        // Sent when the revocation commits, never before; not at all if it rolls back.
        sqlx::query!("SELECT pg_notify($1, $2)", REVOKED_CHANNEL, id.to_string())
            .execute(tx.db())
            .await?;
    }
    Ok(row.map(Into::into))
}

struct TokenRow {
    id: uuid::Uuid,
    name: String,
    role: String,
    workspace_id: Option<uuid::Uuid>,
    created_at: chrono::DateTime<chrono::Utc>,
    created_by: Option<String>,
    expires_at: Option<chrono::DateTime<chrono::Utc>>,
    revoked_at: Option<chrono::DateTime<chrono::Utc>>,
    revoked_by: Option<String>,
}

impl From<TokenRow> for TokenInfo {
    fn from(r: TokenRow) -> Self {
        Self {
            id: TokenId::from_uuid(r.id),
            name: r.name,
            role: stored_role(&r.role),
            workspace_id: r.workspace_id.map(WorkspaceId::from_uuid),
            created_at: r.created_at,
            created_by: r.created_by,
            expires_at: r.expires_at,
            revoked_at: r.revoked_at,
            revoked_by: r.revoked_by,
        }
    }
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
