//! The API's cache of token lookups: a presented token's grant, kept a few seconds so a
//! client's requests do not each read `api_tokens` again.
//!
//! What keeps it honest:
//! - Keyed by the token's SHA-256 (what `api_tokens` stores), never the token itself.
//! - Only live grants are kept (a refused token is looked up every time, so guessing fills
//!   nothing), each until the sooner of [`TTL`] and the token's own expiry.
//! - A revocation is announced with `NOTIFY` when it commits
//!   ([`tokens::REVOKED_CHANNEL`]); every API process listens and drops its whole cache
//!   on one, and again whenever its listening connection was lost (it may have missed
//!   one). [`TTL`] bounds what a process that never heard could serve.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::Utc;
use sqlx::postgres::PgListener;
use takosumi_store::tokens::{self, TokenGrant};
use takosumi_store::{Pool, StoreError};
use tokio_util::sync::CancellationToken;

/// How long a looked-up grant is served without reading `api_tokens` again.
pub const TTL: Duration = Duration::from_secs(5);

/// Grants cached past this many are not cached (the cache then only saves less).
const MAX_ENTRIES: usize = 10_000;

/// Live grants by token hash, each with the instant it stops being served.
#[derive(Debug, Default)]
pub struct TokenCache {
    entries: Mutex<HashMap<Vec<u8>, (TokenGrant, Instant)>>,
}

impl TokenCache {
    /// The live grant of `token`: from the cache, else from Postgres (and then cached).
    pub async fn find(&self, pool: &Pool, token: &str) -> Result<Option<TokenGrant>, StoreError> {
        let hash = tokens::hash_token(token);
        let now = Instant::now();
        if let Some(grant) = self
            .lock()
            .get(&hash)
            .and_then(|(grant, until)| (now < *until).then(|| grant.clone()))
        {
            return Ok(Some(grant));
        }
        let Some(live) = tokens::find_by_hash(pool, &hash).await? else {
            self.lock().remove(&hash);
            return Ok(None);
        };
        let mut until = now + TTL;
        if let Some(expires) = live.expires_at {
            let left = (expires - Utc::now()).to_std().unwrap_or(Duration::ZERO);
            until = until.min(now + left);
        }
        let mut entries = self.lock();
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, (_, u)| now < *u);
        }
        if entries.len() < MAX_ENTRIES {
            entries.insert(hash, (live.grant.clone(), until));
        }
        Ok(Some(live.grant))
    }

    /// Forgets every cached grant.
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, (TokenGrant, Instant)>> {
        // A panic while holding the lock left a map, not a broken invariant.
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Clears `cache` on every revocation any API process commits, until `shutdown`.
pub async fn listen_for_revocations(
    pool: Pool,
    cache: std::sync::Arc<TokenCache>,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let listener = async {
            let mut l = PgListener::connect_with(&pool).await?;
            l.listen(tokens::REVOKED_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            _ = shutdown.cancelled() => return,
            l = listener => match l {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for token revocations; retrying");
                    cache.clear();
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            },
        };
        // Whatever was revoked before the listener was up is not announced to it.
        cache.clear();
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(_)) => cache.clear(),
                // The connection was lost (it reconnects on the next call): a revocation
                // may have gone unheard meanwhile.
                Ok(None) => cache.clear(),
                Err(e) => {
                    tracing::warn!(error = %e, "lost the token revocation listener; reconnecting");
                    cache.clear();
                    break;
                }
            }
        }
    }
}
