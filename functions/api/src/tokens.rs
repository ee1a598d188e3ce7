//! Token management (`/api/v1/tokens`, instance admins only): make a token with a name,
//! role, optional Workspace limit and expiry — its value is answered once and only its
//! hash is kept — list them (never a value), and revoke one, effective from the next
//! request (every request and dashboard session looks the token up). Each change is
//! recorded in the activity (the Workspace's for a limited token, instance-wide otherwise)
//! in the same transaction.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{Method, StatusCode};
use axum::response::IntoResponse;
use serde_json::json;
use takosumi_core::{ActivityKind, Role, TokenId};
use takosumi_store::{activity, tokens, workspaces};
use takosumi_wire::{CreatedToken, NewToken, TokenList, TokenView};

use crate::access::{Access, Api, Doc, Scope};
use crate::auth::{Action, Caller, new_token};
use crate::error::ErrorCode;
use crate::extract::{parse_body, parse_id};
use crate::{ApiError, AppState};

/// The longest token name.
const MAX_NAME_CHARS: usize = 100;
/// The furthest expiry.
const MAX_DAYS: u32 = 3650;

/// The token endpoints; merged into the API's router.
pub fn api() -> Api {
    let admin = Access::Token(Action::Administer, Scope::Instance);
    Api::new()
        .route(Method::POST, "/api/v1/tokens", admin, create)
        .doc(
            Doc::op("createToken", "Make an API token (its value answered once)")
                .body::<takosumi_wire::NewToken>()
                .ok::<takosumi_wire::CreatedToken>(201),
        )
        .route(Method::GET, "/api/v1/tokens", admin, list)
        .doc(
            Doc::op("listTokens", "Every API token (never a value)")
                .ok::<takosumi_wire::TokenList>(200),
        )
        .route(Method::DELETE, "/api/v1/tokens/{token}", admin, revoke)
        .doc(
            Doc::op(
                "revokeToken",
                "Revoke a token: refused from its next request on",
            )
            .ok::<takosumi_wire::TokenView>(200),
        )
}

fn view(t: tokens::TokenInfo) -> TokenView {
    TokenView {
        id: t.id,
        name: t.name,
        role: t.role,
        workspace_id: t.workspace_id,
        created_at: t.created_at,
        created_by: t.created_by,
        expires_at: t.expires_at,
        revoked_at: t.revoked_at,
        revoked_by: t.revoked_by,
    }
}

async fn create(
    State(st): State<AppState>,
    caller: Caller,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    caller.require(Action::Administer, None)?;
    let req: NewToken = parse_body(&body)?;
    let name = req.name.trim();
    if name.is_empty()
        || name.chars().count() > MAX_NAME_CHARS
        || name.chars().any(char::is_control)
    {
        return Err(ApiError::invalid(
            ErrorCode::InvalidName,
            format!("name: 1 to {MAX_NAME_CHARS} printable characters"),
        ));
    }
    let Ok(role) = req.role.parse::<Role>() else {
        return Err(ApiError::invalid(
            ErrorCode::InvalidRole,
            format!("role: one of {}", Role::ALL.map(Role::as_str).join(", ")),
        ));
    };
    let expires_at = match req.expires_in_days {
        None => None,
        Some(d) if (1..=MAX_DAYS).contains(&d) => {
            Some(chrono::Utc::now() + chrono::Duration::days(i64::from(d)))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidExpiry,
                format!("expiresInDays: 1 to {MAX_DAYS}"),
            ));
        }
    };
    if let Some(ws) = req.workspace_id
        && workspaces::get(&st.pool, ws).await?.is_none()
    {
        return Err(ApiError::invalid(
            ErrorCode::UnknownWorkspace,
            format!("Workspace {ws} does not exist"),
        ));
    }
    let secret = new_token();
    let actor = caller.actor();
    let mut tx = st.pool.begin().await?;
    let info = tokens::create(
        &mut tx,
        &tokens::NewToken {
            token: &secret,
            name,
            role,
            workspace_id: req.workspace_id,
            expires_at,
            created_by: &actor,
        },
    )
    .await?;
    record(&mut tx, &info, ActivityKind::TokenCreated, &actor).await?;
    tx.commit().await?;
    tracing::info!(token = %info.id, role = %info.role, by = %actor, "token created");
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            token: secret,
            info: view(info),
        }),
    ))
}

async fn record(
    tx: &mut takosumi_store::Tx,
    t: &tokens::TokenInfo,
    kind: ActivityKind,
    actor: &str,
) -> Result<(), ApiError> {
    let data = json!({ "name": t.name, "role": t.role, "expiresAt": t.expires_at });
    let subject = t.id.to_string();
    match t.workspace_id {
        Some(ws) => activity::append(tx.db(), ws, kind, &subject, actor, data).await?,
        None => activity::append_instance(tx.db(), kind, &subject, actor, data).await?,
    }
    Ok(())
}

async fn list(State(st): State<AppState>, caller: Caller) -> Result<impl IntoResponse, ApiError> {
    caller.require(Action::Administer, None)?;
    let all = tokens::list(&st.pool, None).await?;
    Ok(Json(TokenList {
        tokens: all.into_iter().map(view).collect(),
    }))
}

async fn revoke(
    State(st): State<AppState>,
    caller: Caller,
    Path(token): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    caller.require(Action::Administer, None)?;
    let id: TokenId = parse_id(&token)?;
    let actor = caller.actor();
    let mut tx = st.pool.begin().await?;
    let Some(info) = tokens::revoke(&mut tx, id, &actor).await? else {
        return Err(match tokens::get(&st.pool, id).await? {
            Some(_) => ApiError::conflict(
                ErrorCode::AlreadyRevoked,
                format!("{id} is already revoked"),
            ),
            None => ApiError::not_found(&format!("token {id}")),
        });
    };
    record(&mut tx, &info, ActivityKind::TokenRevoked, &actor).await?;
    tx.commit().await?;
    // This process refuses it from the next request on; the others when the commit's
    // notification reaches them.
    st.tokens.clear();
    tracing::info!(token = %id, by = %actor, "token revoked");
    Ok(Json(view(info)))
}
