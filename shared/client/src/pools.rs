//! The client side of worker pools: create a pool, rotate its delivery key, and
//! move a Capsule onto a pool or back to the control node.
//!
//! A pool's token is answered once, at creation (the API keeps only its SHA-256), so
//! [`Client::create_pool`] hands it back wrapped in a [`Secret`]: it is never printed by
//! `Debug` and the caller decides, visibly, where it goes.

use chrono::{DateTime, Utc};
use reqwest::Method;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use takosumi_core::Secret;

use crate::{Capsule, CapsuleId, Client, ClientError, WorkspaceId};

/// A worker pool as the API shows it: names and key ids, never the token or a key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    /// `pool_…`
    pub id: String,
    /// Its unique name (it names the pool's queues).
    pub name: String,
    /// The Workspace whose Capsules may run on it.
    pub workspace_id: WorkspaceId,
    /// The delivery key applies are sealed to; `None`: applies from this pool fail.
    #[serde(default)]
    pub delivery_key_id: Option<String>,
    /// The key it replaced, still accepted until `previous_key_until`.
    #[serde(default)]
    pub previous_key_id: Option<String>,
    /// When the previous key stops being accepted.
    #[serde(default)]
    pub previous_key_until: Option<DateTime<Utc>>,
    /// The queues its relay workers are woken on.
    #[serde(default)]
    pub queues: Vec<String>,
    /// Fields this client does not know, kept so they can be printed as received.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A pool just created, with its token: the only time the API shows it.
pub struct CreatedPool {
    /// The pool.
    pub pool: Pool,
    /// The pool token its relay workers authenticate with.
    pub token: Secret<String>,
}

impl std::fmt::Debug for CreatedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreatedPool")
            .field("pool", &self.pool)
            .field("token", &self.token)
            .finish()
    }
}

/// A delivery public key: an id and the X25519 public key, standard base64.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryKey {
    /// The key id (letters, digits, `.`, `_`, `-`).
    pub key_id: String,
    /// 32 bytes, standard base64 (`takosumi-relay keygen` prints it).
    pub public_key: String,
}

impl Client {
    /// `POST /api/v1/workspaces/{ws}/pools` (admin): creates a pool, with a delivery key
    /// if one is given, and returns it with its token.
    pub async fn create_pool(
        &self,
        ws: WorkspaceId,
        name: &str,
        delivery_key: Option<&DeliveryKey>,
    ) -> Result<CreatedPool, ClientError> {
        #[derive(Deserialize)]
        struct Answer {
            #[serde(flatten)]
            pool: Pool,
            token: String,
        }
        let path = format!("/api/v1/workspaces/{ws}/pools");
        let mut body = json!({ "name": name });
        if let Some(key) = delivery_key {
            body["deliveryKey"] = json!(key);
        }
        let rb = self.request(Method::POST, &path).json(&body);
        let answer: Answer = self.execute(Method::POST, &path, rb).await?;
        Ok(CreatedPool {
            pool: answer.pool,
            token: Secret::new(answer.token),
        })
    }

    /// `POST /api/v1/pools/{pool}/delivery-key`: makes `key` the pool's delivery key; the
    /// old one stays accepted for `grace_secs` (the API's default when `None`).
    pub async fn rotate_pool_key(
        &self,
        pool: &str,
        key: &DeliveryKey,
        grace_secs: Option<i64>,
    ) -> Result<Pool, ClientError> {
        let path = format!("/api/v1/pools/{}/delivery-key", path_segment(pool));
        let mut body = json!(key);
        if let Some(g) = grace_secs {
            body["graceSecs"] = json!(g);
        }
        let rb = self.request(Method::POST, &path).json(&body);
        self.execute(Method::POST, &path, rb).await
    }

    /// `PUT /api/v1/capsules/{cap}/pool`: runs the Capsule's plans, drift checks and
    /// applies on the named pool, or (`None`) on the control node again.
    pub async fn set_capsule_pool(
        &self,
        cap: CapsuleId,
        pool: Option<&str>,
    ) -> Result<Capsule, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/pool");
        let rb = self
            .request(Method::PUT, &path)
            .json(&json!({ "pool": pool }));
        self.execute(Method::PUT, &path, rb).await
    }
}

/// Percent-encodes a pool name for a URL path, so a name the API would refuse still
/// reaches it (and is refused there with its code) instead of changing the path.
fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_pool_debug_hides_the_token() {
        let created = CreatedPool {
            pool: serde_json::from_value(json!({
                "id": "pool_1", "name": "edge", "workspaceId": WorkspaceId::new(),
                "deliveryKeyId": null, "queues": ["run.plan.edge"]
            }))
            .unwrap(),
            token: Secret::new("tks_canary_42".to_owned()),
        };
        assert!(!format!("{created:?}").contains("canary"));
        assert_eq!(path_segment("edge.1"), "edge.1");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }
}
