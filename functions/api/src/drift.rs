//! Drift checks: of one Capsule, of a whole Workspace (a RunGroup of checks), and the
//! Workspace's drift rolled up by what changed. A drift check only reports; it never
//! starts an apply.

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde_json::{Value, json};
use takosumi_core::RunKind;
use takosumi_store::{drift, runs};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, proposals, views};

pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/capsules/{cap}/drift-check",
            Access::Token(Action::Submit, Scope::Capsule),
            capsule_drift_check,
        )
        .doc(Doc::op("driftCheckCapsule", "Start a drift-check Run").ok::<takosumi_wire::Run>(202))
        .route(
            Method::POST,
            "/api/v1/workspaces/{ws}/drift-check",
            Access::Token(Action::Submit, Scope::Workspace),
            workspace_drift_check,
        )
        .doc(
            Doc::op(
                "driftCheckWorkspace",
                "A drift-check Run per Capsule, as a RunGroup",
            )
            .ok::<takosumi_wire::GroupStarted>(202),
        )
        .route(
            Method::GET,
            "/api/v1/workspaces/{ws}/drift",
            Access::Token(Action::Read, Scope::Workspace),
            workspace_drift,
        )
        .doc(
            Doc::op("getWorkspaceDrift", "Each Capsule's latest drift check")
                .ok_object(200, "Drift by Capsule."),
        )
}

async fn capsule_drift_check(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Submit).await?;
    // Reality is compared with what was applied; a Capsule never applied (or destroyed)
    // has nothing to drift from, and planning its branch instead would report changes
    // nobody applied.
    if capsule.drift_baseline_run_id.is_none() {
        return Err(ApiError::conflict(
            ErrorCode::NotApplied,
            format!("Capsule {}: {}", capsule.id, runs::source::NOT_APPLIED),
        ));
    }
    let hold_for = proposals::agent_to_hold(&st, &caller, &capsule).await?;
    let mut tx = st.pool.begin().await?;
    let start = proposals::RunStart {
        kind: RunKind::DriftCheck,
        capsule: &capsule,
        group: None,
        actor_kind: proposals::actor_kind(&caller),
        actor_id: caller.0.id.to_string(),
        actor: caller.actor(),
        auto_apply: false,
        hold_for,
    };
    let id = proposals::start_run(&mut tx, &start).await?;
    let run = proposals::commit_started(&st, tx, id).await?;
    Ok((StatusCode::ACCEPTED, views::run_json(&run)))
}

async fn workspace_drift_check(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    crate::groups::start_group(&st, &caller, ws, RunKind::DriftCheck, false).await
}

/// Drifted Capsules rolled up by what changed: Capsules whose latest check would change
/// the same set of (resource address, action) pairs — read from the check's `show -json`
/// resource changes, never from counts or printed text — are one row, listing each
/// Capsule with its check. Two Capsules that each drift by one replacement of different
/// resources are two rows; the same address drifting the same way in both is one.
async fn workspace_drift(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let drifted = drift::drifted_capsules(&st.pool, ws).await?;
    let mut rows: Vec<(Value, Vec<Value>)> = Vec::new();
    for d in drifted {
        let key = drift_key(d.resource_changes.as_ref());
        let entry = json!({ "capsuleId": d.capsule_id, "runId": d.run_id, "changes": d.changes });
        match rows.iter_mut().find(|(k, _)| *k == key) {
            Some((_, list)) => list.push(entry),
            None => rows.push((key, vec![entry])),
        }
    }
    let rows: Vec<Value> = rows
        .into_iter()
        .map(|(k, list)| json!({ "drift": k, "capsules": list }))
        .collect();
    Ok(Json(json!({ "workspaceId": ws, "drifted": rows })))
}

/// The rollup key of a drift check: the sorted, de-duplicated (address, type, action)
/// of every resource the check's plan would change (no-op and read left out), and whether
/// the stored summary was truncated (then the key names only the resources it kept). A
/// check whose plan changes only outputs has an empty resource list.
fn drift_key(resource_changes: Option<&Value>) -> Value {
    let summary: takosumi_cost::PlanResources = resource_changes
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default();
    let mut items: Vec<(String, String, String)> = summary
        .resources
        .iter()
        .filter_map(|r| {
            let acts: Vec<&str> = r.actions.iter().map(String::as_str).collect();
            let action = match acts.as_slice() {
                [] | ["no-op"] | ["read"] => return None,
                ["delete", "create"] | ["create", "delete"] => "replace".to_owned(),
                [one] => (*one).to_owned(),
                many => many.join("+"),
            };
            Some((r.address.clone(), r.resource_type.clone(), action))
        })
        .collect();
    items.sort();
    items.dedup();
    let resources: Vec<Value> = items
        .into_iter()
        .map(|(address, resource_type, action)| {
            json!({ "address": address, "type": resource_type, "action": action })
        })
        .collect();
    json!({ "resources": resources, "truncated": summary.truncated })
}
