//! Bearer-token authentication and role checks. Tokens are stored as SHA-256 hashes and
//! looked up by hash, so no stored value can be replayed and no comparison runs over a
//! stored secret.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use takosumi_core::{Role, WorkspaceId};
use takosumi_store::tokens::TokenGrant;
use takosumi_store::{capsules, runs};

use crate::error::ErrorCode;
use crate::{ApiError, AppState};

/// The caller, authenticated, and the row the route's guard read to learn which Workspace
/// the path names (so the handler does not read it a second time).
#[derive(Debug, Clone)]
pub struct Caller(pub TokenGrant, pub(crate) Prefetched);

/// What the access guard read of the resource the path names, for [`crate::extract`].
#[derive(Debug, Clone, Default)]
pub(crate) enum Prefetched {
    /// Nothing (an instance-wide route, or a scope whose row the handler reads itself).
    #[default]
    Nothing,
    /// The Workspace exists.
    Workspace(WorkspaceId),
    /// The Capsule, as read.
    Capsule(Arc<capsules::Capsule>),
    /// The Run, as read.
    Run(Arc<runs::Run>),
}

/// What an endpoint needs the caller to be allowed to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Read records.
    Read,
    /// Register Capsules and change what they run.
    Operate,
    /// Submit plans and applies (agents may; their Runs are held for people).
    Submit,
    /// Create Workspaces, tokens.
    Administer,
    /// Approve a held Run or a RunGroup: any role of the Workspace may ask, and the rule
    /// in force decides whose approval counts (the handler checks it against the rule).
    Approve,
}

impl Caller {
    /// `user:tok_…` / `agent:tok_…` for events and activity.
    pub fn actor(&self) -> String {
        format!(
            "{}:{}",
            if self.0.role == Role::Agent {
                "agent"
            } else {
                "user"
            },
            self.0.id
        )
    }

    /// Whether the role allows `action` within `workspace`, without refusing anything (what
    /// a view shows depends on it).
    pub fn may(&self, action: Action, workspace: Option<WorkspaceId>) -> bool {
        self.require(action, workspace).is_ok()
    }

    /// Checks the role allows `action` within `workspace` (`None`: instance-wide).
    pub fn require(&self, action: Action, workspace: Option<WorkspaceId>) -> Result<(), ApiError> {
        let g = &self.0;
        // Same answer as an unknown id: a token must not learn what other Workspaces hold.
        if let (Some(scope), Some(ws)) = (g.workspace_id, workspace)
            && scope != ws
        {
            return Err(ApiError::not_found("the resource"));
        }
        if workspace.is_none() && g.workspace_id.is_some() && action != Action::Read {
            return Err(ApiError::forbidden(
                "this token is limited to one Workspace",
            ));
        }
        let allowed = match action {
            Action::Read | Action::Approve => true,
            Action::Operate => matches!(g.role, Role::Admin | Role::Operator),
            Action::Submit => matches!(g.role, Role::Admin | Role::Operator | Role::Agent),
            Action::Administer => g.role == Role::Admin,
        };
        if allowed {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "the {} role may not do this",
                g.role
            )))
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        // The route's guard authenticated the request already.
        if let Some(caller) = parts.extensions.get::<Caller>() {
            return Ok(caller.clone());
        }
        let unauthorized =
            |m: &str| ApiError::client(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, m);
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(|| {
                unauthorized("missing Authorization header: send `Authorization: Bearer <token>`")
            })?;
        let value = header
            .to_str()
            .map_err(|_| unauthorized("the Authorization header is not valid text"))?;
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| unauthorized("the Authorization header must be `Bearer <token>`"))?;
        let grant = state
            .tokens
            .find(&state.pool, token)
            .await?
            .ok_or_else(|| unauthorized("the token is not valid"))?;
        Ok(Caller(grant, Prefetched::Nothing))
    }
}

/// A new random token: `tks_` and 40 hex digits.
pub fn new_token() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 20];
    rand::rng().fill_bytes(&mut bytes);
    format!("tks_{}", hex::encode(bytes))
}
