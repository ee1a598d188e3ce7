//! Detection and groups: signed Git webhooks mark Capsules stale (and start an
//! automatic-update plan only where a person enabled it; a pull request gets a speculative
//! plan that can never be applied), drift checks of a Capsule or a whole Workspace, and
//! RunGroups (plan-update, approve and apply a group at once, each Run's record kept).
//! Detection never starts an apply.
//!
//! A webhook delivery is processed once: its id (see [`delivery_id`]) is recorded per
//! Workspace in the transaction that carries its effect, and a replay of a signed delivery
//! answers `200 {"duplicate": true}` and changes nothing (no stale mark, activity line or
//! Run). A delivery that names no id is processed each time it arrives.

use std::sync::atomic::{AtomicI64, Ordering};

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::Method;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use hmac::{Hmac, Mac};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::Sha256;
use takosumi_core::{ActorKind, CapsuleId, RunKind, RunStatus, WorkspaceId};
use takosumi_seal::Purpose;
use takosumi_store::{Tx, activity, capsules, detection, runs};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, proposals, views};

pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/workspaces/{ws}/webhook-secret",
            Access::Token(Action::Administer, Scope::Workspace),
            create_webhook_secret,
        )
        .doc(
            Doc::op(
                "createWebhookSecret",
                "A new Git webhook secret for the Workspace (shown once)",
            )
            .ok_object(201, "The secret and the webhook URL."),
        )
        .route(
            Method::POST,
            "/api/v1/webhooks/git",
            Access::WebhookSignature,
            git_webhook,
        )
        .doc(
            Doc::op("gitWebhook", "A signed Git push or pull-request event")
                .object_body("The Git host's event payload.")
                .query("workspace", "The Workspace id the webhook was made for.")
                .ok_object(200, "A ping, or a replayed delivery.")
                .ok_object(202, "What the event started."),
        )
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
            .ok_object(202, "The RunGroup, its Runs and the Capsules skipped."),
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
        .route(
            Method::POST,
            "/api/v1/workspaces/{ws}/plan-update",
            Access::Token(Action::Submit, Scope::Workspace),
            plan_update,
        )
        .doc(
            Doc::op("planUpdateWorkspace", "A RunGroup of plan Runs")
                .optional_body::<PlanUpdate>()
                .ok_object(202, "The RunGroup and its Runs."),
        )
        .route(
            Method::GET,
            "/api/v1/run-groups/{rg}",
            Access::Token(Action::Read, Scope::RunGroup),
            get_group,
        )
        .doc(Doc::op("getRunGroup", "A RunGroup and its Runs").ok::<takosumi_wire::RunGroup>(200))
        .route(
            Method::POST,
            "/api/v1/run-groups/{rg}/approve",
            Access::Token(Action::Approve, Scope::RunGroup),
            approve_group,
        )
        .doc(
            Doc::op("approveRunGroup", "Approve every held Run of the group")
                .ok_object(200, "What was approved, and what was not with why."),
        )
        .route(
            Method::POST,
            "/api/v1/run-groups/{rg}/apply",
            Access::Token(Action::Submit, Scope::RunGroup),
            apply_group,
        )
        .doc(
            Doc::op(
                "applyRunGroup",
                "Propose the apply of every planned Run of the group",
            )
            .ok_object(202, "The Apply Runs, and what was not proposed with why."),
        )
}

// ---- webhooks -------------------------------------------------------------------------

async fn create_webhook_secret(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Administer).await?;
    let secret = format!("whsec_{}", crate::new_token().trim_start_matches("tks_"));
    let sealed = st
        .sealer
        .seal(
            Purpose::Credential,
            &format!("{ws}:webhook"),
            secret.as_bytes(),
        )
        .map_err(|e| ApiError::Internal {
            transient: false,
            source: Box::new(e),
        })?;
    let mut tx = st.pool.begin().await?;
    detection::set_webhook_secret(&mut tx, ws, &sealed).await?;
    activity::append(
        &mut *tx,
        ws,
        "webhook_secret_set",
        &ws.to_string(),
        &caller.actor(),
        json!({}),
    )
    .await?;
    tx.commit().await?;
    // Shown once; only the sealed form is kept.
    Ok((
        StatusCode::CREATED,
        Json(
            json!({ "workspaceId": ws, "secret": secret, "url": format!("/api/v1/webhooks/git?workspace={ws}") }),
        ),
    ))
}

#[derive(Deserialize)]
struct WebhookQuery {
    workspace: Option<String>,
}

/// Unix seconds of the last logged bad signature: bad requests leave one audit line a
/// minute, never a row.
static LAST_BAD_SIGNATURE_LOG: AtomicI64 = AtomicI64::new(0);

fn audit_bad_signature(ws: &str) {
    let now = chrono::Utc::now().timestamp();
    let last = LAST_BAD_SIGNATURE_LOG.load(Ordering::Relaxed);
    if now - last >= 60
        && LAST_BAD_SIGNATURE_LOG
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(
            workspace = ws,
            "git webhook refused: bad or missing signature (further refusals this minute are not logged)"
        );
    }
}

fn verify(secret: &[u8], headers: &HeaderMap, body: &[u8]) -> bool {
    if let Some(sig) = headers
        .get("x-hub-signature-256")
        .and_then(|v| v.to_str().ok())
    {
        let Some(hex_sig) = sig.strip_prefix("sha256=") else {
            return false;
        };
        let Ok(given) = hex::decode(hex_sig) else {
            return false;
        };
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else {
            return false;
        };
        mac.update(body);
        // verify_slice compares in constant time.
        return mac.verify_slice(&given).is_ok();
    }
    if let Some(token) = headers.get("x-gitlab-token").and_then(|v| v.to_str().ok()) {
        use subtle::ConstantTimeEq;
        return token.as_bytes().ct_eq(secret).into();
    }
    false
}

/// The delivery's id, namespaced by sender: GitHub's `X-GitHub-Delivery` (kept when a
/// person redelivers), else GitLab's `Idempotency-Key` (GitLab 17.4 and later; kept across
/// its retries) or `X-Gitlab-Event-UUID`. `None` when the sender names none: such a
/// delivery is still processed, every time it arrives (its effects are idempotent marks
/// and activity lines, plus an automatic-update or speculative plan per delivery), so a
/// sender that can replay should send an id. An id that is empty, longer than 256 bytes or
/// not visible ASCII is refused (400) rather than guessed at.
fn delivery_id(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let gitlab = headers.contains_key("x-gitlab-token") || headers.contains_key("x-gitlab-event");
    let named = if let Some(v) = headers.get("x-github-delivery") {
        Some(("github", v))
    } else if gitlab {
        headers
            .get("idempotency-key")
            .or_else(|| headers.get("x-gitlab-event-uuid"))
            .map(|v| ("gitlab", v))
    } else {
        None
    };
    let Some((sender, value)) = named else {
        return Ok(None);
    };
    let id = value.to_str().unwrap_or_default().trim();
    if id.is_empty() || id.len() > 256 || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::client(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidDeliveryId,
            "the delivery id header must be 1 to 256 visible ASCII characters",
        ));
    }
    Ok(Some(format!("{sender}:{id}")))
}

/// Claims the delivery id in the transaction that carries the delivery's effect; the
/// answer to give instead when it was processed before (the caller then drops the
/// transaction, so nothing of the replay is written).
async fn replayed(
    tx: &mut Tx,
    ws: WorkspaceId,
    event: &str,
    delivery: Option<&str>,
) -> Result<Option<(StatusCode, Json<Value>)>, ApiError> {
    let Some(id) = delivery else {
        return Ok(None);
    };
    if detection::record_delivery(tx, ws, id).await? {
        return Ok(None);
    }
    tracing::info!(workspace = %ws, delivery = id, event, "git webhook replayed: ignored");
    Ok(Some((
        StatusCode::OK,
        Json(json!({ "event": event, "duplicate": true, "deliveryId": id })),
    )))
}

fn normalize_repo(url: &str) -> String {
    let u = url.trim().trim_end_matches('/');
    let u = u.strip_suffix(".git").unwrap_or(u);
    u.to_ascii_lowercase()
}

fn repo_urls(payload: &Value) -> Vec<String> {
    let mut urls = Vec::new();
    for obj in [&payload["repository"], &payload["project"]] {
        for key in [
            "clone_url",
            "ssh_url",
            "git_url",
            "html_url",
            "url",
            "git_http_url",
            "git_ssh_url",
            "web_url",
        ] {
            if let Some(u) = obj[key].as_str() {
                urls.push(normalize_repo(u));
            }
        }
    }
    urls
}

async fn git_webhook(
    State(st): State<AppState>,
    Query(q): Query<WebhookQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let unauthorized = || {
        ApiError::client(
            StatusCode::UNAUTHORIZED,
            ErrorCode::InvalidSignature,
            "the webhook signature does not verify",
        )
    };
    let raw_ws = q.workspace.unwrap_or_default();
    let Ok(ws) = raw_ws.parse::<WorkspaceId>() else {
        audit_bad_signature(&raw_ws);
        return Err(unauthorized());
    };
    let sealed = detection::webhook_secret(&st.pool, ws).await?;
    let secret = sealed.and_then(|s| {
        st.sealer
            .unseal(Purpose::Credential, &format!("{ws}:webhook"), &s)
            .ok()
    });
    let Some(secret) = secret else {
        audit_bad_signature(&raw_ws);
        return Err(unauthorized());
    };
    if !verify(&secret, &headers, &body) {
        audit_bad_signature(&raw_ws);
        return Err(unauthorized());
    }
    let delivery = delivery_id(&headers)?;
    let payload: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid_json(format!("the event is not JSON: {e}")))?;
    let event = headers
        .get("x-github-event")
        .or_else(|| headers.get("x-gitlab-event"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("push")
        .to_ascii_lowercase();
    match event.as_str() {
        "ping" => Ok((StatusCode::OK, Json(json!({ "event": "ping" })))),
        "push" | "push hook" => push(&st, ws, &payload, delivery.as_deref()).await,
        "pull_request" | "merge request hook" => {
            pull_request(&st, ws, &payload, delivery.as_deref()).await
        }
        other => Ok((
            StatusCode::ACCEPTED,
            Json(json!({ "event": other, "ignored": true })),
        )),
    }
}

async fn push(
    st: &AppState,
    ws: WorkspaceId,
    payload: &Value,
    delivery: Option<&str>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let git_ref = payload["ref"].as_str().unwrap_or_default();
    let Some(branch) = git_ref.strip_prefix("refs/heads/") else {
        return Ok((
            StatusCode::ACCEPTED,
            Json(json!({ "event": "push", "ignored": "not a branch" })),
        ));
    };
    let commit = payload["after"]
        .as_str()
        .or_else(|| payload["checkout_sha"].as_str())
        .unwrap_or_default();
    if commit.len() < 7 || !commit.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidEvent,
            "the push names no commit (`after`)",
        ));
    }
    let urls = repo_urls(payload);
    let targets: Vec<_> = detection::capsules_on_branch(&st.pool, ws, branch)
        .await?
        .into_iter()
        .filter(|t| urls.contains(&normalize_repo(&t.repo)))
        .collect();
    let ids: Vec<CapsuleId> = targets.iter().map(|t| t.id).collect();
    let mut tx = st.pool.begin().await?;
    if let Some(duplicate) = replayed(&mut tx, ws, "push", delivery).await? {
        return Ok(duplicate);
    }
    detection::mark_stale(&mut tx, &ids, commit).await?;
    activity::append(
        &mut *tx,
        ws,
        "webhook_push",
        branch,
        "system:webhook",
        json!({ "branch": branch, "commit": commit, "capsules": ids }),
    )
    .await?;
    // Automatic update is the one exception: a plan that continues to apply only if clean.
    let mut started = Vec::new();
    for t in targets.iter().filter(|t| t.auto_update) {
        let Some(capsule) = capsules::get(&mut *tx, t.id).await? else {
            continue;
        };
        let on_behalf = t.auto_update_by.clone().unwrap_or_default();
        let id = proposals::start_run(
            &mut tx,
            &proposals::RunStart {
                kind: RunKind::Plan,
                capsule: &capsule,
                group: None,
                actor_kind: ActorKind::System,
                actor_id: format!("auto-update:{on_behalf}"),
                actor: format!("system:auto-update on behalf of {on_behalf}"),
                auto_apply: true,
                hold_for: None,
            },
        )
        .await?;
        detection::set_run_source(&mut tx, id, branch, commit, false).await?;
        started.push(id);
    }
    tx.commit().await?;
    if !started.is_empty() {
        st.relay_wake.notify_one();
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "event": "push", "stale": ids, "autoUpdatePlans": started })),
    ))
}

async fn pull_request(
    st: &AppState,
    ws: WorkspaceId,
    payload: &Value,
    delivery: Option<&str>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let pr = if payload["pull_request"].is_object() {
        &payload["pull_request"]
    } else {
        &payload["object_attributes"]
    };
    let action = payload["action"]
        .as_str()
        .or_else(|| pr["action"].as_str())
        .unwrap_or("opened");
    if !matches!(
        action,
        "opened" | "synchronize" | "reopened" | "open" | "update"
    ) {
        return Ok((
            StatusCode::ACCEPTED,
            Json(json!({ "event": "pull_request", "ignored": action })),
        ));
    }
    let base = pr["base"]["ref"]
        .as_str()
        .or_else(|| pr["target_branch"].as_str())
        .unwrap_or_default();
    let head_ref = pr["head"]["ref"]
        .as_str()
        .or_else(|| pr["source_branch"].as_str())
        .unwrap_or_default();
    let head_sha = pr["head"]["sha"]
        .as_str()
        .or_else(|| pr["last_commit"]["id"].as_str())
        .unwrap_or_default();
    if head_ref.is_empty() || head_sha.len() < 7 || !head_sha.chars().all(|c| c.is_ascii_hexdigit())
    {
        return Err(ApiError::invalid(
            ErrorCode::InvalidEvent,
            "the pull request names no head branch and commit",
        ));
    }
    let urls = repo_urls(payload);
    let targets: Vec<_> = detection::capsules_on_branch(&st.pool, ws, base)
        .await?
        .into_iter()
        .filter(|t| urls.contains(&normalize_repo(&t.repo)))
        .collect();
    let mut tx = st.pool.begin().await?;
    if let Some(duplicate) = replayed(&mut tx, ws, "pull_request", delivery).await? {
        return Ok(duplicate);
    }
    let mut started = Vec::new();
    for t in &targets {
        let Some(capsule) = capsules::get(&mut *tx, t.id).await? else {
            continue;
        };
        let id = proposals::start_run(
            &mut tx,
            &proposals::RunStart {
                kind: RunKind::Plan,
                capsule: &capsule,
                group: None,
                actor_kind: ActorKind::System,
                actor_id: "webhook:pull_request".into(),
                actor: "system:webhook".into(),
                auto_apply: false,
                hold_for: None,
            },
        )
        .await?;
        detection::set_run_source(&mut tx, id, head_ref, head_sha, true).await?;
        started.push(id);
    }
    activity::append(
        &mut *tx,
        ws,
        "webhook_pull_request",
        head_ref,
        "system:webhook",
        json!({ "head": head_sha, "speculativePlans": started }),
    )
    .await?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "event": "pull_request", "speculativePlans": started })),
    ))
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
    let req: CapsuleSettings = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid_json(format!("the request body is not valid: {e}")))?;
    if let Some(secs) = req.drift_interval_secs {
        check_interval(secs)?;
    }
    let mut tx = st.pool.begin().await?;
    if let Some(on) = req.auto_update {
        detection::set_auto_update(&mut tx, capsule.id, on, &caller.0.id.to_string()).await?;
    }
    if let Some(secs) = req.drift_interval_secs {
        detection::set_capsule_drift_interval(&mut tx, capsule.id, secs).await?;
    }
    activity::append(
        &mut *tx,
        capsule.workspace_id,
        "capsule_settings",
        &capsule.id.to_string(),
        &caller.actor(),
        json!({ "autoUpdate": req.auto_update, "driftIntervalSecs": req.drift_interval_secs }),
    )
    .await?;
    let capsule = capsules::get(&mut *tx, capsule.id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Capsule"))?;
    tx.commit().await?;
    Ok(Json(views::capsule(
        &capsule,
        caller.may(Action::Operate, Some(capsule.workspace_id)),
    )))
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
        detection::set_workspace_drift_interval(&mut tx, ws, secs).await?;
    }
    activity::append(
        &mut *tx,
        ws,
        "workspace_settings",
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

// ---- drift checks and groups ---------------------------------------------------------

async fn capsule_drift_check(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Submit).await?;
    // Reality is compared with what was applied; a Capsule never applied (or destroyed)
    // has nothing to drift from, and planning its branch instead would report changes
    // nobody applied.
    if !has_baseline(&st, capsule.id).await? {
        return Err(ApiError::conflict(
            ErrorCode::NotApplied,
            format!("Capsule {}: {}", capsule.id, detection::NOT_APPLIED),
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
    let run = runs::get(&mut *tx, id)
        .await?
        .ok_or_else(|| ApiError::not_found("the new Run"))?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok((StatusCode::ACCEPTED, views::run_json(&run)))
}

async fn has_baseline(st: &AppState, capsule: CapsuleId) -> Result<bool, ApiError> {
    Ok(detection::applied_baseline(&st.pool, capsule)
        .await?
        .is_some_and(|b| !b.destroyed))
}

async fn start_group(
    st: &AppState,
    caller: &Caller,
    ws: WorkspaceId,
    kind: RunKind,
    only_stale: bool,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    caller.require(Action::Submit, Some(ws))?;
    let ids = detection::workspace_capsules(&st.pool, ws, only_stale).await?;
    let group_kind = if kind == RunKind::DriftCheck {
        "drift_check"
    } else {
        "plan_update"
    };
    let mut tx = st.pool.begin().await?;
    let group = detection::create_group(&mut tx, ws, group_kind, &caller.actor()).await?;
    let mut created = Vec::new();
    let mut skipped = Vec::new();
    for id in ids {
        let Some(capsule) = capsules::get(&mut *tx, id).await? else {
            continue;
        };
        if kind == RunKind::DriftCheck && !has_baseline(st, capsule.id).await? {
            skipped.push(json!({ "capsuleId": capsule.id, "code": "not_applied" }));
            continue;
        }
        let hold_for = proposals::agent_to_hold(st, caller, &capsule).await?;
        let start = proposals::RunStart {
            kind,
            capsule: &capsule,
            group: Some(group),
            actor_kind: proposals::actor_kind(caller),
            actor_id: caller.0.id.to_string(),
            actor: caller.actor(),
            auto_apply: false,
            hold_for,
        };
        created.push(proposals::start_run(&mut tx, &start).await?);
    }
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok((
        StatusCode::ACCEPTED,
        Json(
            json!({ "id": group, "workspaceId": ws, "kind": group_kind, "runIds": created, "skipped": skipped }),
        ),
    ))
}

async fn workspace_drift_check(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    start_group(&st, &caller, ws, RunKind::DriftCheck, false).await
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PlanUpdate {
    #[serde(default)]
    only_stale: bool,
}

async fn plan_update(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let req: PlanUpdate = if body.iter().all(u8::is_ascii_whitespace) {
        PlanUpdate::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::invalid_json(format!("the request body is not valid: {e}")))?
    };
    start_group(&st, &caller, ws, RunKind::Plan, req.only_stale).await
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
    let drifted = detection::drifted_capsules(&st.pool, ws).await?;
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

async fn get_group(
    State(st): State<AppState>,
    caller: Caller,
    Path(rg): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let group = extract::run_group(&st, &caller, &rg, Action::Read).await?;
    let ids = detection::group_runs(&st.pool, group.id).await?;
    let runs = runs::get_many(&st.pool, &ids).await?;
    let items: Vec<views::RunView<'_>> = runs.iter().map(views::RunView::of).collect();
    Ok(Json(
        json!({ "id": group.id, "workspaceId": group.workspace_id, "kind": group.kind, "createdBy": group.created_by, "createdAt": group.created_at, "runs": items }),
    ))
}

/// Approves every held Run of the group, each with its own approval record (bound to
/// its own plan digest); Runs this caller may not approve are listed with the reason.
async fn approve_group(
    State(st): State<AppState>,
    caller: Caller,
    Path(rg): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let group = extract::run_group(&st, &caller, &rg, Action::Read).await?;
    let mut results = Vec::new();
    for id in detection::group_runs(&st.pool, group.id).await? {
        let Some(run) = runs::get(&st.pool, id).await? else {
            continue;
        };
        if run.status != RunStatus::Held {
            continue;
        }
        match crate::gates::approve_run(&st, &caller, &run, None, None).await {
            Ok(v) => results
                .push(json!({ "runId": id, "status": v["status"], "approvals": v["approvals"] })),
            Err(ApiError::Client { code, message, .. }) => {
                results.push(json!({ "runId": id, "error": { "code": code, "message": message } }))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Json(json!({ "id": group.id, "results": results })))
}

/// Proposes an apply for each planned Run of the group, each pinned to its own plan.
async fn apply_group(
    State(st): State<AppState>,
    caller: Caller,
    Path(rg): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let group = extract::run_group(&st, &caller, &rg, Action::Submit).await?;
    let mut results = Vec::new();
    for id in detection::group_runs(&st.pool, group.id).await? {
        let Some(run) = runs::get(&st.pool, id).await? else {
            continue;
        };
        if !run.kind.is_plan_like() || run.status != RunStatus::Planned {
            continue;
        }
        match proposals::propose_apply(&st, &caller, &run, None, false).await {
            Ok(apply) => results.push(json!({ "planRunId": id, "applyRunId": apply.id })),
            Err(ApiError::Client { code, message, .. }) => results
                .push(json!({ "planRunId": id, "error": { "code": code, "message": message } })),
            Err(e) => return Err(e),
        }
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "id": group.id, "results": results })),
    ))
}
