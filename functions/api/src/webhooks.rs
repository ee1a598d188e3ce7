//! Signed Git webhooks: a push marks the Capsules on its branch stale (and starts an
//! automatic-update plan only where a person enabled it); a pull request gets a
//! speculative plan of each Capsule on its base branch, which can never be applied. A
//! webhook never starts an apply. Also the Workspace's webhook secret.
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
use takosumi_core::{ActivityKind, ActorKind, CapsuleId, RunKind, WorkspaceId};
use takosumi_seal::Purpose;
use takosumi_store::{Tx, activity, capsules, runs, webhooks};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, proposals};

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
}

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
    webhooks::set_webhook_secret(&mut tx, ws, &sealed).await?;
    activity::append(
        tx.db(),
        ws,
        ActivityKind::WebhookSecretSet,
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
    if webhooks::record_delivery(tx, ws, id).await? {
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

/// What the webhook reads of a GitHub or GitLab delivery: each host names the same facts
/// its own way (a push's commit is `after`, or GitLab's `checkout_sha`; a pull request is
/// `pull_request`, a merge request `object_attributes`). Whatever else a delivery carries
/// is ignored; a named field of another type is an `invalid_event`.
#[derive(Debug, Default, Deserialize)]
struct Delivery {
    #[serde(default, rename = "ref")]
    git_ref: Option<String>,
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    checkout_sha: Option<String>,
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    pull_request: Option<Change>,
    #[serde(default)]
    object_attributes: Option<Change>,
    #[serde(default)]
    repository: Option<RepoUrls>,
    #[serde(default)]
    project: Option<RepoUrls>,
}

/// A pull request (GitHub) or merge request (GitLab).
#[derive(Debug, Default, Deserialize)]
struct Change {
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    base: Option<BranchRef>,
    #[serde(default)]
    head: Option<BranchRef>,
    #[serde(default)]
    target_branch: Option<String>,
    #[serde(default)]
    source_branch: Option<String>,
    #[serde(default)]
    last_commit: Option<LastCommit>,
}

#[derive(Debug, Default, Deserialize)]
struct BranchRef {
    #[serde(default, rename = "ref")]
    name: Option<String>,
    #[serde(default)]
    sha: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct LastCommit {
    #[serde(default)]
    id: Option<String>,
}

/// Every URL a host gives its repository by (GitHub: `repository`; GitLab: `project`).
#[derive(Debug, Default, Deserialize)]
struct RepoUrls {
    #[serde(default)]
    clone_url: Option<String>,
    #[serde(default)]
    ssh_url: Option<String>,
    #[serde(default)]
    git_url: Option<String>,
    #[serde(default)]
    html_url: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    git_http_url: Option<String>,
    #[serde(default)]
    git_ssh_url: Option<String>,
    #[serde(default)]
    web_url: Option<String>,
}

impl Delivery {
    /// The repository's URLs, normalized.
    fn repo_urls(&self) -> Vec<String> {
        [&self.repository, &self.project]
            .into_iter()
            .flatten()
            .flat_map(|r| {
                [
                    &r.clone_url,
                    &r.ssh_url,
                    &r.git_url,
                    &r.html_url,
                    &r.url,
                    &r.git_http_url,
                    &r.git_ssh_url,
                    &r.web_url,
                ]
            })
            .flatten()
            .map(|u| normalize_repo(u))
            .collect()
    }

    /// The pull or merge request.
    fn change(&self) -> Option<&Change> {
        self.pull_request
            .as_ref()
            .or(self.object_attributes.as_ref())
    }
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
    let sealed = webhooks::webhook_secret(&st.pool, ws).await?;
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
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&body) {
        return Err(ApiError::invalid_json(format!(
            "the event is not JSON: {e}"
        )));
    }
    // Only a push or a pull request is read; any other event is answered without it.
    let read = || {
        serde_json::from_slice::<Delivery>(&body).map_err(|e| {
            ApiError::invalid(
                ErrorCode::InvalidEvent,
                format!("the event's fields are not a push or pull request's: {e}"),
            )
        })
    };
    let event = headers
        .get("x-github-event")
        .or_else(|| headers.get("x-gitlab-event"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("push")
        .to_ascii_lowercase();
    match event.as_str() {
        "ping" => Ok((StatusCode::OK, Json(json!({ "event": "ping" })))),
        "push" | "push hook" => push(&st, ws, &read()?, delivery.as_deref()).await,
        "pull_request" | "merge request hook" => {
            pull_request(&st, ws, &read()?, delivery.as_deref()).await
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
    payload: &Delivery,
    delivery: Option<&str>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let git_ref = payload.git_ref.as_deref().unwrap_or_default();
    let Some(branch) = git_ref.strip_prefix("refs/heads/") else {
        return Ok((
            StatusCode::ACCEPTED,
            Json(json!({ "event": "push", "ignored": "not a branch" })),
        ));
    };
    let commit = payload
        .after
        .as_deref()
        .or(payload.checkout_sha.as_deref())
        .unwrap_or_default();
    if commit.len() < 7 || !commit.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidEvent,
            "the push names no commit (`after`)",
        ));
    }
    let targets = capsules_pushed_to(st, ws, branch, payload).await?;
    let ids: Vec<CapsuleId> = targets.iter().map(|t| t.id).collect();
    let mut tx = st.pool.begin().await?;
    if let Some(duplicate) = replayed(&mut tx, ws, "push", delivery).await? {
        return Ok(duplicate);
    }
    capsules::mark_stale(&mut tx, &ids, commit).await?;
    activity::append(
        tx.db(),
        ws,
        ActivityKind::WebhookPush,
        branch,
        "system:webhook",
        json!({ "branch": branch, "commit": commit, "capsules": ids }),
    )
    .await?;
    // Automatic update is the one exception: a plan that continues to apply only if clean.
    let mut started = Vec::new();
    for t in targets.iter().filter(|t| t.auto_update) {
        let Some(capsule) = capsules::get(tx.db(), t.id).await? else {
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
        runs::source::set_run_source(&mut tx, id, branch, commit, false).await?;
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
    payload: &Delivery,
    delivery: Option<&str>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let none = Change::default();
    let pr = payload.change().unwrap_or(&none);
    let action = payload
        .action
        .as_deref()
        .or(pr.action.as_deref())
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
    let base = pr
        .base
        .as_ref()
        .and_then(|b| b.name.as_deref())
        .or(pr.target_branch.as_deref())
        .unwrap_or_default();
    let head_ref = pr
        .head
        .as_ref()
        .and_then(|h| h.name.as_deref())
        .or(pr.source_branch.as_deref())
        .unwrap_or_default();
    let head_sha = pr
        .head
        .as_ref()
        .and_then(|h| h.sha.as_deref())
        .or(pr.last_commit.as_ref().and_then(|c| c.id.as_deref()))
        .unwrap_or_default();
    if head_ref.is_empty() || head_sha.len() < 7 || !head_sha.chars().all(|c| c.is_ascii_hexdigit())
    {
        return Err(ApiError::invalid(
            ErrorCode::InvalidEvent,
            "the pull request names no head branch and commit",
        ));
    }
    let targets = capsules_pushed_to(st, ws, base, payload).await?;
    let mut tx = st.pool.begin().await?;
    if let Some(duplicate) = replayed(&mut tx, ws, "pull_request", delivery).await? {
        return Ok(duplicate);
    }
    let mut started = Vec::new();
    for t in &targets {
        let Some(capsule) = capsules::get(tx.db(), t.id).await? else {
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
        runs::source::set_run_source(&mut tx, id, head_ref, head_sha, true).await?;
        started.push(id);
    }
    activity::append(
        tx.db(),
        ws,
        ActivityKind::WebhookPullRequest,
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

/// The Workspace's Capsules on `branch` of a repository the event names (by any of its URLs).
async fn capsules_pushed_to(
    st: &AppState,
    ws: WorkspaceId,
    branch: &str,
    payload: &Delivery,
) -> Result<Vec<webhooks::PushTarget>, ApiError> {
    let urls = payload.repo_urls();
    Ok(webhooks::capsules_on_branch(&st.pool, ws, branch)
        .await?
        .into_iter()
        .filter(|t| urls.contains(&normalize_repo(&t.repo)))
        .collect())
}
