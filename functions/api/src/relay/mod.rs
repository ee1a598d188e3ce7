//! The relay protocol: what a relay worker, authenticated with its pool's token,
//! may do — and nothing else. A relay worker has no database URL and no object-store
//! credentials; every row and object it needs goes through here.
//!
//! - `POST /api/v1/relay/claim` claims the pool's next job with the same conditional
//!   updates the control node's handlers use (a plan-like Run `queued` → `planning`; an
//!   Apply Run through `claim_apply`, which also takes the Capsule and checks the
//!   generation) and answers with what the job needs: the source to check out, the
//!   variables, and every secret input (credentials, sensitive variables, the state, the
//!   plan file of an apply) sealed to the pool's delivery key. The lease owner is
//!   `relay:<pool>:<random>`; every later call names it (`X-Takosumi-Claim`).
//!   Why poll instead of consuming `run.*.<pool>` over AMQP: the worker must reach the
//!   control plane only through the API, and Postgres decides who holds a Run anyway; the
//!   pool's queues still receive each wake-up (so the control node's handlers never see
//!   them) and the claim drains them, as a wake-up, before it looks in Postgres.
//! - `POST …/runs/{run}/progress` stores masked logs and events, renews the lease, and
//!   answers whether a cancel was requested.
//! - `PUT …/runs/{run}/plan-file` takes the saved plan file; the control node seals it
//!   with the server key. Over 19 MiB it is refused (413 `plan_too_large`, size and limit
//!   stated) and the Run fails without proposing anything.
//! - `POST …/runs/{run}/planned` records the plan like the plan step does and wakes the gate.
//! - `POST …/runs/{run}/applied` seals the new state and moves the generation with the
//!   compare-and-set, like the apply step.
//! - `POST …/runs/{run}/fail` ends the Run with one of the tool's failure codes;
//!   `POST …/runs/{run}/canceled` ends it `canceled` after a requested cancel stopped the tool.
//!
//! A worker of another pool gets 403 `wrong_pool` for a Run that is not its pool's.

mod claim;
mod jobs;
mod reports;

use std::time::Duration;

use crate::access::{Access, Api, Doc};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, State};
use axum::http::Method;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use base64::Engine as _;
use serde_json::{Map, Value, json};
use takosumi_core::{
    ActivityKind, CapsuleId, EventKind, FailureCode, RunId, RunKind, RunStatus, SandboxMode,
};
use takosumi_runtime::apply_commit::{self, ApplyCommitError, ApplyToCommit, ToolEnd};
use takosumi_runtime::dependencies::LockfileError;
use takosumi_runtime::dry_run::{self, DryRunDecision};
use takosumi_runtime::inputs::{
    CredentialSet, EnvError, Injected, check_plan_source, open_binding, sensitive_vars_subject,
};
use takosumi_runtime::plan_commit::{self, Committed, PlanPut, PlanToCommit, StoredPlan};
use takosumi_runtime::step::plan_key;
use takosumi_runtime::unrecorded::{self, Unrecorded};
use takosumi_seal::Purpose;
use takosumi_seal::delivery::DeliveryPublicKey;
use takosumi_store::pools::{self, WorkerPool};
use takosumi_store::runs::{self, ApplyClaim};
use takosumi_store::{bindings, capsules, events, states};
use takosumi_wire::UsedBinding;
use takosumi_wire::relay::{
    AppliedReport, ApplyJob, BranchSource, ClaimAnswer, ClaimRequest, CommandCredential,
    FailReport, JobWork, OneStepJob, PinnedSource, PlanJob, PlanSource as JobSource, PlannedReport,
    ProgressAnswer, ProgressReport, RelayJob, RelaySecrets, ScanAnswer, ScanResult,
    WORKER_EVENT_KINDS,
};
use zeroize::Zeroize;

use crate::error::ErrorCode;
use crate::{ApiError, AppState};
use claim::*;
use jobs::*;
use reports::*;

/// The largest plan file that crosses the relay: the limit the plan commit holds an upload to.
pub const MAX_RELAY_PLAN_BYTES: u64 = takosumi_runtime::plan_commit::MAX_RELAY_PLAN_BYTES;
/// Claims of a plan-like Run by relay workers before it fails `attempts_exhausted`.
pub const RELAY_MAX_ATTEMPTS: i32 = 3;
/// A relay claim's lease; the worker renews it with `progress` well within it.
pub const RELAY_LEASE_SECS: i64 = 60;
/// Body limit of the upload endpoints: a bit over the plan limit so an oversized plan is
/// measured and refused with its size rather than cut off.
const UPLOAD_LIMIT: usize = 64 * 1024 * 1024;
const MAX_STATE_BYTES: u64 = 256 * 1024 * 1024;
const MAX_SEALED_PLAN: u64 = MAX_RELAY_PLAN_BYTES + 4096;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/relay/claim",
            Access::PoolToken,
            claim,
        )
        .doc(
            Doc::op("relayClaim", "A relay worker claims its pool's next job")
                .object_body("The worker's identity and keys.")
                .ok_object(200, "`{\"job\": …}`, `null` when there is none."),
        )
        .route(
            Method::POST,
            "/api/v1/relay/runs/{run}/progress",
            Access::PoolToken,
            progress,
        )
        .doc(
            Doc::op(
                "relayProgress",
                "Events and log chunks of a claimed Run; answers whether a cancel was asked",
            )
            .object_body("Events and log chunks.")
            .ok_object(200, "Whether to stop."),
        )
        .route(
            Method::PUT,
            "/api/v1/relay/runs/{run}/plan-file",
            Access::PoolToken,
            plan_file,
        )
        .doc(
            Doc::op(
                "relayPlanFile",
                "The sealed plan file of a claimed plan Run",
            )
            .raw_body("application/octet-stream", "The plan file.")
            .ok_object(200, "Stored."),
        )
        .route(
            Method::POST,
            "/api/v1/relay/runs/{run}/scanned",
            Access::PoolToken,
            scanned,
        )
        .doc(
            Doc::op("relayScanned", "A dry-run scan's result")
                .object_body("The scan.")
                .ok_object(200, "Recorded."),
        )
        .route(
            Method::POST,
            "/api/v1/relay/runs/{run}/one-step",
            Access::PoolToken,
            one_step,
        )
        .doc(Doc::op("relayOneStep", "The apply job of a one-step Run").ok_object(200, "The job."))
        .route(
            Method::POST,
            "/api/v1/relay/runs/{run}/planned",
            Access::PoolToken,
            planned,
        )
        .doc(
            Doc::op("relayPlanned", "A plan Run's result")
                .object_body("The plan's record.")
                .ok_object(200, "Recorded."),
        )
        .route(
            Method::POST,
            "/api/v1/relay/runs/{run}/applied",
            Access::PoolToken,
            applied,
        )
        .doc(
            Doc::op(
                "relayApplied",
                "An apply Run's result and the state it wrote",
            )
            .object_body("The apply's record.")
            .ok_object(200, "Recorded."),
        )
        .route(
            Method::POST,
            "/api/v1/relay/runs/{run}/fail",
            Access::PoolToken,
            fail,
        )
        .doc(
            Doc::op("relayFail", "A claimed Run failed")
                .object_body("The failure code and message.")
                .ok_object(200, "Recorded."),
        )
        .route(
            Method::POST,
            "/api/v1/relay/runs/{run}/canceled",
            Access::PoolToken,
            canceled,
        )
        .doc(
            Doc::op(
                "relayCanceled",
                "A claimed Run stopped on a requested cancel",
            )
            .ok_object(200, "Recorded."),
        )
        .map_router(|r| r.layer(DefaultBodyLimit::max(UPLOAD_LIMIT)))
}

/// A caller authenticated with a pool token.
#[derive(Debug, Clone)]
pub struct PoolCaller(pub WorkerPool);

impl FromRequestParts<AppState> for PoolCaller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        // The route's guard authenticated the request already.
        if let Some(caller) = parts.extensions.get::<PoolCaller>() {
            return Ok(caller.clone());
        }
        let unauthorized =
            |m: &str| ApiError::client(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, m);
        let token = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| unauthorized("send `Authorization: Bearer <pool token>`"))?;
        let pool = pools::find_by_token(&state.pool, token)
            .await?
            .ok_or_else(|| unauthorized("the token is not a worker pool's token"))?;
        Ok(PoolCaller(pool))
    }
}

fn internal(e: impl std::error::Error + Send + Sync + 'static) -> ApiError {
    ApiError::Internal {
        transient: false,
        source: Box::new(e),
    }
}

fn object_error(e: takosumi_objects::ObjectError) -> ApiError {
    ApiError::Internal {
        transient: e.retryable(),
        source: Box::new(e),
    }
}

/// Which of the pool's keys to seal this worker's secrets to. `Ok(None)`: the pool has
/// no delivery key. A worker that holds none of the pool's deliverable keys is refused
/// before anything is claimed (it could open nothing it is sent).
fn delivery_key_for(
    pool: &WorkerPool,
    held: &[String],
) -> Result<Option<DeliveryPublicKey>, ApiError> {
    let (Some(id), Some(public)) = (&pool.delivery_key_id, &pool.delivery_public_key) else {
        return Ok(None);
    };
    let key = |id: &str, public: &[u8]| DeliveryPublicKey::new(id, public).map_err(internal);
    if held.iter().any(|h| h == id) {
        return Ok(Some(key(id, public)?));
    }
    if let (Some(prev), Some(prev_public)) = (&pool.previous_key_id, &pool.previous_public_key)
        && held.iter().any(|h| h == prev)
    {
        if pool
            .previous_key_until
            .is_some_and(|until| until > chrono::Utc::now())
        {
            return Ok(Some(key(prev, prev_public)?));
        }
        return Err(ApiError::conflict(
            ErrorCode::DeliveryKeyExpired,
            format!(
                "this worker holds delivery key {prev:?}, rotated out of pool {:?} and past its grace; load the pool's current key {id:?} and claim again",
                pool.name
            ),
        ));
    }
    Err(ApiError::conflict(
        ErrorCode::DeliveryKeyUnknown,
        format!(
            "this worker holds none of pool {:?}'s delivery keys (current {id:?}); load the current key and claim again",
            pool.name
        ),
    ))
}

/// Fails a just-proposed Apply Run `pool_has_no_delivery_key` when its Capsule runs on a
/// pool with no delivery key (the saved plan could never be delivered). `true`: it failed.
pub(crate) async fn fail_if_pool_has_no_key(
    tx: &mut takosumi_store::Tx,
    run_id: RunId,
    capsule_id: CapsuleId,
) -> Result<bool, ApiError> {
    let Some(pool) = pools::of_capsule(tx.db(), capsule_id).await? else {
        return Ok(false);
    };
    if pool.delivery_key_id.is_some() {
        return Ok(false);
    }
    let message = format!(
        "worker pool {:?} has no delivery key, so the saved plan cannot be delivered to it and a gated apply cannot run there; register a delivery key (POST /api/v1/pools/{}/delivery-key) and propose the apply again, or run the Capsule on a queue the control node executes (PUT /api/v1/capsules/{capsule_id}/pool {{\"pool\": null}})",
        pool.name, pool.name
    );
    let code = FailureCode::PoolHasNoDeliveryKey;
    runs::fail(tx, run_id, None, code, &message).await?;
    events::append(
        tx.db(),
        run_id,
        EventKind::Failed,
        "system:relay",
        json!({ "code": code, "message": message }),
    )
    .await?;
    Ok(true)
}
