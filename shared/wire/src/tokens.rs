//! API tokens managed over the API (`/api/v1/tokens`, instance admins only).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use takosumi_core::{Role, TokenId, WorkspaceId};

/// The body of `POST /api/v1/tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewToken {
    /// A name for audit (1–100 printable characters).
    pub name: String,
    /// `viewer`, `operator`, `approver`, `admin` or `agent`.
    pub role: String,
    /// Limit it to one Workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_id: Option<WorkspaceId>,
    /// It stops working after this many days (1–3650); none: until revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_days: Option<u32>,
}

/// A token as an administrator sees it: never its value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenView {
    /// `tok_…`.
    pub id: TokenId,
    /// Its name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// The Workspace it is limited to.
    #[serde(default)]
    pub workspace_id: Option<WorkspaceId>,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// Who made it.
    #[serde(default)]
    pub created_by: Option<String>,
    /// When it stops working.
    #[serde(default)]
    pub expires_at: Option<DateTime<Utc>>,
    /// When it was revoked.
    #[serde(default)]
    pub revoked_at: Option<DateTime<Utc>>,
    /// Who revoked it.
    #[serde(default)]
    pub revoked_by: Option<String>,
}

/// `201` of `POST /api/v1/tokens`: the token's value, shown this once (never by `Debug`).
#[derive(Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CreatedToken {
    /// The value to send as `Authorization: Bearer …` (not stored anywhere: only its hash).
    pub token: String,
    /// What it is.
    #[serde(flatten)]
    pub info: TokenView,
}

/// `GET /api/v1/tokens`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenList {
    /// Newest first.
    #[serde(default)]
    pub tokens: Vec<TokenView>,
}

impl std::fmt::Debug for CreatedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreatedToken")
            .field("token", &"<redacted>")
            .field("info", &self.info)
            .finish()
    }
}
