//! Dashboard sessions. A session id is a random secret held only in the browser's cookie;
//! the row keeps its SHA-256 and the token it was made from, so a stolen database yields
//! nothing to replay and revoking the token ends the session at once.

use takosumi_core::TokenId;

use crate::StoreError;
use crate::tokens::{GrantRow, TokenGrant, hash_token};

/// Stores a new session for `token_id` that ends after `ttl_secs`, and drops expired ones.
pub async fn create(
    pool: &crate::Pool,
    session_secret: &str,
    token_id: TokenId,
    ttl_secs: i64,
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query!("DELETE FROM dashboard_sessions WHERE expires_at < now()")
        .execute(tx.db())
        .await?;
    sqlx::query!(
        r#"INSERT INTO dashboard_sessions (id_hash, token_id, expires_at)
           VALUES ($1, $2, now() + make_interval(secs => $3))"#,
        hash_token(session_secret),
        token_id.as_uuid(),
        ttl_secs as f64
    )
    .execute(tx.db())
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The grant of a live session: not expired, and its token not revoked.
pub async fn find(
    pool: &crate::Pool,
    session_secret: &str,
) -> Result<Option<TokenGrant>, StoreError> {
    let row = sqlx::query_as!(
        GrantRow,
        r#"SELECT t.id, t.name, t.role, t.workspace_id
             FROM dashboard_sessions s JOIN api_tokens t ON t.id = s.token_id
            WHERE s.id_hash = $1 AND s.expires_at > now() AND t.revoked_at IS NULL
              AND (t.expires_at IS NULL OR t.expires_at > now())"#,
        hash_token(session_secret)
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(Into::into))
}

/// Ends a session (sign-out); `false` if there was none.
pub async fn delete(pool: &crate::Pool, session_secret: &str) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        "DELETE FROM dashboard_sessions WHERE id_hash = $1",
        hash_token(session_secret)
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}
