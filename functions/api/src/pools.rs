//! Worker pools, the administration side: create a pool (admin; its token is
//! shown once, only its SHA-256 is stored), rotate its delivery key (the previous key
//! stays deliverable for a grace period), and set the pool a Capsule runs on. With no
//! pool a Capsule runs on the control node's own queues, as before.

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};
use takosumi_core::ActivityKind;
use takosumi_seal::delivery::DeliveryPublicKey;
use takosumi_store::activity;
use takosumi_store::pools::{self, WorkerPool};

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract, views};

/// How long a rotated-out delivery key is still delivered to, unless the rotation says.
pub const DEFAULT_GRACE_SECS: i64 = 24 * 3600;

pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/workspaces/{ws}/pools",
            Access::Token(Action::Administer, Scope::Workspace),
            create_pool,
        )
        .doc(
            Doc::op(
                "createPool",
                "A worker pool for the Workspace (its token is answered once)",
            )
            .body::<NewPool>()
            .ok_object(201, "The pool and its token."),
        )
        .route(
            Method::POST,
            "/api/v1/pools/{pool}/delivery-key",
            Access::Token(Action::Administer, Scope::Pool),
            rotate_key,
        )
        .doc(
            Doc::op("rotateDeliveryKey", "Register a pool's new delivery key")
                .body::<KeyBody>()
                .ok_object(200, "The pool's keys."),
        )
        .route(
            Method::PUT,
            "/api/v1/capsules/{cap}/pool",
            Access::Token(Action::Operate, Scope::Capsule),
            set_capsule_pool,
        )
        .doc(
            Doc::op(
                "setCapsulePool",
                "Which worker pool runs a Capsule (`null`: the control node)",
            )
            .body::<SetPool>()
            .ok_object(200, "The Capsule's pool."),
        )
}

/// A pool as the API shows it: names and key ids, never the token or a key.
pub fn view(p: &WorkerPool) -> Value {
    json!({
        "id": format!("pool_{}", p.id.simple()),
        "name": p.name,
        "workspaceId": p.workspace_id,
        "deliveryKeyId": p.delivery_key_id,
        "previousKeyId": p.previous_key_id,
        "previousKeyUntil": p.previous_key_until,
        "queues": takosumi_queue::Topology::pool_queues(&p.name),
        "createdAt": p.created_at,
    })
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KeyBody {
    key_id: String,
    /// The X25519 public key, standard base64 (32 bytes).
    public_key: String,
    #[serde(default)]
    grace_secs: Option<i64>,
}

fn parse_key(k: &KeyBody) -> Result<DeliveryPublicKey, ApiError> {
    let raw = base64::engine::general_purpose::STANDARD
        .decode(k.public_key.trim())
        .map_err(|_| {
            ApiError::invalid(ErrorCode::InvalidDeliveryKey, "publicKey must be base64")
        })?;
    DeliveryPublicKey::new(&k.key_id, &raw)
        .map_err(|e| ApiError::invalid(ErrorCode::InvalidDeliveryKey, e.to_string()))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NewPool {
    name: String,
    #[serde(default)]
    delivery_key: Option<KeyBody>,
}

/// Declares the pool's queues (and their dead-letter queues) so the outbox relay can
/// publish its wake-ups (publishes are mandatory: an unroutable one is refused).
async fn declare_queues(st: &AppState, name: &str) -> Result<(), ApiError> {
    let unavailable = |e: takosumi_queue::QueueError| ApiError::Internal {
        transient: true,
        source: Box::new(e),
    };
    let broker = st.bus.get().await.map_err(unavailable)?;
    let ch = broker.channel().await.map_err(unavailable)?;
    for queue in takosumi_queue::Topology::pool_queues(name) {
        broker
            .topology()
            .declare_queue(&ch, &queue)
            .await
            .map_err(|e| unavailable(e.into()))?;
    }
    let _ = ch.close(200, "pool queues declared".into()).await;
    Ok(())
}

async fn create_pool(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Administer).await?;
    let req: NewPool = extract::parse_body(&body)?;
    if !extract::valid_name(&req.name) || req.name.len() > 48 {
        return Err(ApiError::invalid(
            ErrorCode::InvalidName,
            "a pool name is 1-48 letters, digits, '-', '_' or '.', starting with a letter or digit (it names the pool's queues)",
        ));
    }
    let key = req.delivery_key.as_ref().map(parse_key).transpose()?;
    // The queues first: a pool whose wake-ups cannot be published must not exist.
    declare_queues(&st, &req.name).await?;
    let token = crate::auth::new_token();
    let mut tx = st.pool.begin().await?;
    let pool = match pools::create(
        &mut tx,
        &req.name,
        ws,
        &token,
        key.as_ref().map(|k| (k.key_id.as_str(), &k.public[..])),
    )
    .await
    {
        Ok(p) => p,
        Err(e) if e.is_unique_violation() => {
            return Err(ApiError::conflict(
                ErrorCode::PoolExists,
                format!("a worker pool named {:?} already exists", req.name),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    activity::append(
        tx.db(),
        ws,
        ActivityKind::PoolCreated,
        &pool.name,
        &caller.actor(),
        json!({ "name": pool.name, "deliveryKeyId": pool.delivery_key_id }),
    )
    .await?;
    tx.commit().await?;
    let mut body = view(&pool);
    // Shown once: only its hash is stored.
    body["token"] = json!(token);
    Ok((StatusCode::CREATED, Json(body)))
}

async fn rotate_key(
    State(st): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let pool = pools::by_name(&st.pool, &name)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("worker pool {name:?}")))?;
    caller.require(Action::Read, Some(pool.workspace_id))?;
    caller.require(Action::Administer, Some(pool.workspace_id))?;
    let req: KeyBody = extract::parse_body(&body)?;
    let key = parse_key(&req)?;
    let grace = req.grace_secs.unwrap_or(DEFAULT_GRACE_SECS);
    if !(0..=30 * 24 * 3600).contains(&grace) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidGrace,
            "graceSecs is 0 to 2592000 (30 days)",
        ));
    }
    let mut tx = st.pool.begin().await?;
    let rotated =
        match pools::rotate_delivery_key(&mut tx, pool.id, &key.key_id, &key.public, grace).await {
            Ok(p) => p,
            Err(takosumi_store::StoreError::Conflict(_)) => {
                return Err(ApiError::conflict(
                    ErrorCode::DeliveryKeyIdUsed,
                    format!(
                        "the pool uses (or last used) key id {:?}; give the new key a new id",
                        key.key_id
                    ),
                ));
            }
            Err(e) => return Err(e.into()),
        };
    activity::append(
        tx.db(),
        pool.workspace_id,
        ActivityKind::PoolDeliveryKeyRotated,
        &pool.name,
        &caller.actor(),
        json!({ "deliveryKeyId": rotated.delivery_key_id, "previousKeyId": rotated.previous_key_id, "previousKeyUntil": rotated.previous_key_until }),
    )
    .await?;
    tx.commit().await?;
    Ok(Json(view(&rotated)))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SetPool {
    /// A pool name, or `null` for the control node's own queues.
    pool: Option<String>,
}

async fn set_capsule_pool(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Operate).await?;
    let req: SetPool = extract::parse_body(&body)?;
    let pool = match &req.pool {
        None => None,
        Some(name) => {
            let p = pools::by_name(&st.pool, name)
                .await?
                .filter(|p| p.workspace_id == capsule.workspace_id)
                .ok_or_else(|| {
                    ApiError::not_found(&format!("worker pool {name:?} in this Workspace"))
                })?;
            Some(p)
        }
    };
    let mut tx = st.pool.begin().await?;
    if !pools::set_capsule_pool(&mut tx, capsule.id, pool.as_ref().map(|p| p.id)).await? {
        return Err(ApiError::client(
            StatusCode::CONFLICT,
            ErrorCode::RunInFlight,
            "a Run of this Capsule is queued, held, planning or applying; it keeps the runner it started on: wait until it ends (or cancel it), then move the Capsule",
        ));
    }
    activity::append(
        tx.db(),
        capsule.workspace_id,
        ActivityKind::CapsulePoolSet,
        &capsule.id.to_string(),
        &caller.actor(),
        json!({ "pool": req.pool }),
    )
    .await?;
    let shown = takosumi_store::capsules::get_shown(tx.db(), capsule.id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Capsule"))?;
    tx.commit().await?;
    Ok(views::capsule_json(&shown, &caller))
}
