//! Listings: `GET /workspaces` (the Workspaces the caller's token can see) and
//! `GET /workspaces/{ws}/capsules`. Read-only; a token limited to one Workspace sees only
//! that one, and another Workspace's Capsules answer 404 as an unknown id would.

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::response::IntoResponse;
use serde_json::json;
use takosumi_store::{capsules, workspaces};

use crate::auth::{Action, Caller};
use crate::{ApiError, AppState, extract, views};

pub fn api() -> Api {
    Api::new()
        .route(
            Method::GET,
            "/api/v1/workspaces",
            Access::Token(Action::Read, Scope::Instance),
            list_workspaces,
        )
        .doc(
            Doc::op("listWorkspaces", "The Workspaces the token can see")
                .ok::<takosumi_wire::WorkspaceList>(200),
        )
        .route(
            Method::GET,
            "/api/v1/workspaces/{ws}/capsules",
            Access::Token(Action::Read, Scope::Workspace),
            list_capsules,
        )
        .doc(
            Doc::op("listCapsules", "The Workspace's Capsules")
                .ok::<takosumi_wire::CapsuleList>(200),
        )
}

async fn list_workspaces(
    State(st): State<AppState>,
    caller: Caller,
) -> Result<impl IntoResponse, ApiError> {
    caller.require(Action::Read, None)?;
    let list = workspaces::list(&st.pool, caller.0.workspace_id).await?;
    let items: Vec<_> = list
        .iter()
        .map(|w| json!({ "id": w.id, "name": w.name, "createdAt": w.created_at }))
        .collect();
    Ok(Json(json!({ "workspaces": items })))
}

async fn list_capsules(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let list = capsules::shown(&st.pool, capsules::ShownOf::Workspace(ws)).await?;
    let items: Vec<_> = list
        .iter()
        .map(|c| views::CapsuleView::for_caller(c, &caller))
        .collect();
    Ok(Json(json!({ "workspaceId": ws, "capsules": items })))
}
