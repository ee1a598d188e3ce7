//! The client side of credentials and per-run variables: ProviderBindings (create, list,
//! attach to a Capsule, detach) and a plan submission with variables. Credential values
//! and sensitive variables are sent once and never come back; `Debug` never shows them.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use reqwest::Method;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
pub use takosumi_core::ProviderBindingId;

use crate::{CapsuleId, Client, ClientError, Run, WorkspaceId, null_as_default};

/// The values of a new ProviderBinding (the body of
/// `POST /api/v1/workspaces/{ws}/provider-bindings`).
#[derive(Clone, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum NewProviderBinding {
    /// Environment entries, name → value (e.g. cloud keys).
    Env {
        /// The binding's name.
        name: String,
        /// The entries.
        env: BTreeMap<String, String>,
    },
    /// One token, exposed to the tool as `TAKOSUMI_TOKEN`.
    Token {
        /// The binding's name.
        name: String,
        /// The token.
        token: String,
    },
    /// A command run for every plan and apply; its trimmed output becomes `env_name`.
    Command {
        /// The binding's name.
        name: String,
        /// Program and arguments.
        command: Vec<String>,
        /// The variable its output is exposed as.
        #[serde(rename = "envName")]
        env_name: String,
    },
}

impl fmt::Debug for NewProviderBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, name) = match self {
            Self::Env { name, .. } => ("env", name),
            Self::Token { name, .. } => ("token", name),
            Self::Command { name, .. } => ("command", name),
        };
        f.debug_struct("NewProviderBinding")
            .field("kind", &kind)
            .field("name", name)
            .finish_non_exhaustive()
    }
}

/// A ProviderBinding as the API shows it: names only, never values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderBinding {
    /// `pb_…`.
    pub id: ProviderBindingId,
    /// Its Workspace.
    #[serde(default)]
    pub workspace_id: Option<WorkspaceId>,
    /// Its name.
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    /// `env`, `token` or `command`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub kind: String,
    /// The variables it injects.
    #[serde(default, deserialize_with = "null_as_default")]
    pub env_names: Vec<String>,
    /// When it was created.
    #[serde(default)]
    pub created_at: Option<DateTime<Utc>>,
    /// Fields this client does not know yet.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The optional body of a plan submission: variables merged over the Capsule's for this
/// Run only, and sensitive variables (sealed at rest, masked in logs, recorded by name).
#[derive(Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanRequest {
    /// Per-run variables (not secret: stored on the Run). `null` unsets a Capsule default.
    #[serde(skip_serializing_if = "Map::is_empty")]
    pub vars: Map<String, Value>,
    /// Sensitive variables.
    #[serde(skip_serializing_if = "Map::is_empty")]
    pub sensitive_vars: Map<String, Value>,
    /// An install: continue to the apply when the plan finishes cleanly (the gate still
    /// stops deletions and every rule for review).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub auto_apply_requested: bool,
}

impl fmt::Debug for PlanRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanRequest")
            .field("vars", &self.vars)
            .field(
                "sensitive_vars",
                &self.sensitive_vars.keys().collect::<Vec<_>>(),
            )
            .field("auto_apply_requested", &self.auto_apply_requested)
            .finish()
    }
}

#[derive(Deserialize)]
struct BindingList {
    #[serde(default, deserialize_with = "null_as_default")]
    bindings: Vec<ProviderBinding>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AttachedList {
    #[serde(default, deserialize_with = "null_as_default")]
    provider_bindings: Vec<ProviderBinding>,
}

impl Client {
    /// `POST /api/v1/capsules/{cap}/plan` with variables → 202 with the plan Run.
    pub async fn plan_with(
        &self,
        cap: CapsuleId,
        idempotency_key: Option<&str>,
        req: &PlanRequest,
    ) -> Result<Run, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/plan");
        let rb = self
            .submission(Method::POST, &path, idempotency_key)?
            .json(req);
        self.execute(Method::POST, &path, rb).await
    }

    /// `POST /api/v1/workspaces/{ws}/provider-bindings` → 201 (names only come back).
    pub async fn create_provider_binding(
        &self,
        ws: WorkspaceId,
        binding: &NewProviderBinding,
    ) -> Result<ProviderBinding, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/provider-bindings");
        let rb = self.request(Method::POST, &path).json(binding);
        self.execute(Method::POST, &path, rb).await
    }

    /// `GET /api/v1/workspaces/{ws}/provider-bindings`.
    pub async fn list_provider_bindings(
        &self,
        ws: WorkspaceId,
    ) -> Result<Vec<ProviderBinding>, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/provider-bindings");
        let body: BindingList = self
            .execute(Method::GET, &path, self.request(Method::GET, &path))
            .await?;
        Ok(body.bindings)
    }

    /// `POST /api/v1/capsules/{cap}/provider-bindings` → what is attached afterwards.
    pub async fn attach_provider_binding(
        &self,
        cap: CapsuleId,
        binding: ProviderBindingId,
    ) -> Result<Vec<ProviderBinding>, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/provider-bindings");
        let rb = self
            .request(Method::POST, &path)
            .json(&serde_json::json!({ "bindingId": binding }));
        let body: AttachedList = self.execute(Method::POST, &path, rb).await?;
        Ok(body.provider_bindings)
    }

    /// `GET /api/v1/capsules/{cap}/provider-bindings`.
    pub async fn capsule_provider_bindings(
        &self,
        cap: CapsuleId,
    ) -> Result<Vec<ProviderBinding>, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/provider-bindings");
        let body: AttachedList = self
            .execute(Method::GET, &path, self.request(Method::GET, &path))
            .await?;
        Ok(body.provider_bindings)
    }

    /// `DELETE /api/v1/capsules/{cap}/provider-bindings/{pb}` → what is still attached.
    pub async fn detach_provider_binding(
        &self,
        cap: CapsuleId,
        binding: ProviderBindingId,
    ) -> Result<Vec<ProviderBinding>, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/provider-bindings/{binding}");
        let body: AttachedList = self
            .execute(Method::DELETE, &path, self.request(Method::DELETE, &path))
            .await?;
        Ok(body.provider_bindings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_match_the_api_and_debug_hides_values() {
        let env = NewProviderBinding::Env {
            name: "aws".into(),
            env: BTreeMap::from([("AWS_SECRET_ACCESS_KEY".into(), "canary-1".into())]),
        };
        assert_eq!(
            serde_json::to_value(&env).unwrap(),
            serde_json::json!({"kind": "env", "name": "aws", "env": {"AWS_SECRET_ACCESS_KEY": "canary-1"}})
        );
        let cmd = NewProviderBinding::Command {
            name: "vault".into(),
            command: vec!["cat".into(), "/x".into()],
            env_name: "X".into(),
        };
        assert_eq!(
            serde_json::to_value(&cmd).unwrap(),
            serde_json::json!({"kind": "command", "name": "vault", "command": ["cat", "/x"], "envName": "X"})
        );
        let token = NewProviderBinding::Token {
            name: "t".into(),
            token: "canary-2".into(),
        };
        let mut req = PlanRequest::default();
        assert_eq!(serde_json::to_value(&req).unwrap(), serde_json::json!({}));
        req.sensitive_vars
            .insert("pw".into(), Value::String("canary-3".into()));
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            serde_json::json!({"sensitiveVars": {"pw": "canary-3"}})
        );
        let shown = format!("{env:?} {cmd:?} {token:?} {req:?}");
        assert!(!shown.contains("canary"), "{shown}");
    }
}
