//! Detection settings: a Capsule's automatic update and drift-check interval, and the
//! Workspace's drift-check interval.

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::json;
use takosumi_core::ActivityKind;
use takosumi_store::{activity, capsules, drift};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, views};

pub fn api() -> Api {
    Api::new()
        .route(
            Method::PATCH,
            "/api/v1/capsules/{cap}/settings",
            Access::Token(Action::Operate, Scope::Capsule),
            capsule_settings,
        )
        .doc(
            Doc::op(
                "updateCapsuleSettings",
                "Automatic update and drift-check interval of a Capsule",
            )
            .body::<CapsuleSettings>()
            .ok_object(200, "The settings."),
        )
        .route(
            Method::PATCH,
            "/api/v1/workspaces/{ws}/settings",
            Access::Token(Action::Administer, Scope::Workspace),
            workspace_settings,
        )
        .doc(
            Doc::op(
                "updateWorkspaceSettings",
                "The Workspace's drift-check interval",
            )
            .body::<WorkspaceSettings>()
            .ok_object(200, "The settings."),
        )
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CapsuleSettings {
    /// A push to the Capsule's branch starts a plan that continues to apply when clean.
    #[serde(default)]
    auto_update: Option<bool>,
    /// Seconds between scheduled drift checks (at least 60); `null` uses the Workspace's.
    #[serde(default, deserialize_with = "some_or_null")]
    #[schema(value_type = Option<i32>)]
    drift_interval_secs: Option<Option<i32>>,
}

/// Tells a field set to `null` (clear it) from an absent one (leave it).
fn some_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<i32>>, D::Error> {
    Ok(Some(Option::<i32>::deserialize(d)?))
}

fn check_interval(secs: Option<i32>) -> Result<(), ApiError> {
    match secs {
        Some(s) if s < 60 => Err(ApiError::invalid(
            ErrorCode::InvalidInterval,
            "driftIntervalSecs must be at least 60 (or null)",
        )),
        _ => Ok(()),
    }
}

async fn capsule_settings(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Operate).await?;
    let req: CapsuleSettings = extract::parse_body(&body)?;
    if let Some(secs) = req.drift_interval_secs {
        check_interval(secs)?;
    }
    let mut tx = st.pool.begin().await?;
    if let Some(on) = req.auto_update {
        capsules::set_auto_update(&mut tx, capsule.id, on, &caller.0.id.to_string()).await?;
    }
    if let Some(secs) = req.drift_interval_secs {
        drift::set_capsule_drift_interval(&mut tx, capsule.id, secs).await?;
    }
    activity::append(
        tx.db(),
        capsule.workspace_id,
        ActivityKind::CapsuleSettings,
        &capsule.id.to_string(),
        &caller.actor(),
        json!({ "autoUpdate": req.auto_update, "driftIntervalSecs": req.drift_interval_secs }),
    )
    .await?;
    let shown = capsules::get_shown(tx.db(), capsule.id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Capsule"))?;
    tx.commit().await?;
    Ok(views::capsule_json(&shown, &caller))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WorkspaceSettings {
    #[serde(default, deserialize_with = "some_or_null")]
    #[schema(value_type = Option<i32>)]
    drift_interval_secs: Option<Option<i32>>,
}

async fn workspace_settings(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Administer).await?;
    let req: WorkspaceSettings = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid_json(format!("the request body is not valid: {e}")))?;
    let mut tx = st.pool.begin().await?;
    if let Some(secs) = req.drift_interval_secs {
        check_interval(secs)?;
        drift::set_workspace_drift_interval(&mut tx, ws, secs).await?;
    }
    activity::append(
        tx.db(),
        ws,
        ActivityKind::WorkspaceSettings,
        &ws.to_string(),
        &caller.actor(),
        json!({ "driftIntervalSecs": req.drift_interval_secs }),
    )
    .await?;
    tx.commit().await?;
    Ok(Json(
        json!({ "id": ws, "driftIntervalSecs": req.drift_interval_secs.flatten() }),
    ))
}
