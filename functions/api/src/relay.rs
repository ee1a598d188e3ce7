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
use takosumi_core::{CapsuleId, EventKind, FailureCode, RunId, RunKind, RunStatus};
use takosumi_runtime::apply_commit::{self, ApplyCommitError, ApplyToCommit, ToolEnd};
use takosumi_runtime::dependencies::LockfileError;
use takosumi_runtime::dry_run::{self, DryRunDecision};
use takosumi_runtime::inputs::{
    CredentialSet, EnvError, Injected, open_binding, sensitive_vars_subject,
};
use takosumi_runtime::plan_commit::{
    self, Committed, PlanPut, PlanSource, PlanToCommit, StoredPlan,
};
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

/// Drains the pool's queues: their messages are wake-ups, and the claim below looks in
/// Postgres whatever they say. Best effort: a broker fault never stops a claim.
async fn drain_wakeups(st: &AppState, pool: &WorkerPool) {
    let Ok(broker) = st.bus.get().await else {
        return;
    };
    let Ok(ch) = broker.channel().await else {
        return;
    };
    for queue in takosumi_queue::Topology::pool_queues(&pool.name) {
        for _ in 0..100 {
            let got = ch
                .basic_get(
                    queue.clone().into(),
                    lapin::options::BasicGetOptions { no_ack: true },
                )
                .await;
            if !matches!(got, Ok(Some(_))) {
                break;
            }
        }
    }
    let _ = ch.close(200, "drained".into()).await;
}

async fn claim(
    State(st): State<AppState>,
    caller: PoolCaller,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let pool = caller.0;
    let req: ClaimRequest = if body.iter().all(u8::is_ascii_whitespace) {
        ClaimRequest::default()
    } else {
        crate::extract::parse_body(&body)?
    };
    let key = delivery_key_for(&pool, &req.delivery_key_ids)?;
    let sandbox = match req.sandbox.as_deref() {
        None => None,
        Some(s @ ("bubblewrap" | "none")) => Some(s),
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidSandbox,
                "sandbox is \"bubblewrap\" or \"none\"",
            ));
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(req.wait_secs.min(20));
    loop {
        drain_wakeups(&st, &pool).await;
        if let Some(job) = claim_once(&st, &pool, key.as_ref(), sandbox).await? {
            return Ok(Json(ClaimAnswer { job: Some(job) }));
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Json(ClaimAnswer { job: None }));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn new_owner(pool: &WorkerPool) -> String {
    format!(
        "relay:{}:{}",
        pool.name,
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A claimed job, or why the Run failed at once instead.
enum Prepared {
    Job(Box<RelayJob>),
    Failed,
}

/// Fails a released apply the pool cannot run, before anyone claims it, with its code and
/// a `failed` event naming the pool; a Run another caller already ended is left alone.
async fn fail_unclaimed(
    st: &AppState,
    pool: &WorkerPool,
    run_id: RunId,
    code: FailureCode,
    message: &str,
) -> Result<(), ApiError> {
    let mut tx = st.pool.begin().await?;
    if runs::fail(&mut tx, run_id, None, code, message).await? {
        events::append(
            &mut *tx,
            run_id,
            EventKind::Failed,
            &format!("relay:{}", pool.name),
            json!({ "code": code, "message": message }),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

async fn claim_once(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    sandbox: Option<&str>,
) -> Result<Option<RelayJob>, ApiError> {
    // Applies first: a held Capsule waits for them.
    for (run_id, has_plan) in pools::released_applies(&st.pool, pool.id).await? {
        // A one-step apply (no rule covers it) has no saved plan to deliver; the worker
        // runs `apply -auto-approve` on the branch head through the same pipeline as the
        // control node, and hands the result back like any apply.
        if has_plan && key.is_none() {
            let message = format!(
                "worker pool {:?} has no delivery key, so the saved plan cannot be delivered to it and a gated apply cannot run there; register a delivery key (POST /api/v1/pools/{}/delivery-key) and propose the apply again, or run the Capsule on the control node (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}})",
                pool.name, pool.name
            );
            fail_unclaimed(
                st,
                pool,
                run_id,
                FailureCode::PoolHasNoDeliveryKey,
                &message,
            )
            .await?;
            continue;
        }
        if !has_plan
            && takosumi_store::runs::apply_mode::get(&st.pool, run_id).await?
                != Some(takosumi_core::ApplyMode::OneStep)
        {
            fail_unclaimed(
                st,
                pool,
                run_id,
                FailureCode::InvalidConfiguration,
                "an Apply Run without a plan that is not a one-step apply cannot run; submit the apply again",
            )
            .await?;
            continue;
        }
        let owner = new_owner(pool);
        let mut tx = st.pool.begin().await?;
        if !has_plan {
            // As the control node's apply handler: a one-step apply applies on top of the
            // generation current when it is claimed.
            takosumi_store::runs::apply_mode::pin_current_generation(&mut tx, run_id).await?;
        }
        let claimed = takosumi_runtime::step::claim_apply_recorded(
            &mut tx,
            run_id,
            &owner,
            RELAY_LEASE_SECS,
            json!({ "step": "apply", "pool": pool.name }),
            sandbox,
        )
        .await
        .map_err(internal)?;
        tx.commit().await?;
        if claimed != ApplyClaim::Claimed {
            continue;
        }
        let job = if has_plan {
            apply_job(st, pool, key, run_id, &owner).await
        } else {
            one_step_job(st, pool, key, run_id, &owner).await
        };
        match job {
            Ok(Prepared::Job(job)) => return Ok(Some(*job)),
            Ok(Prepared::Failed) => continue,
            Err(e) => {
                let _ = end_failed(
                    st,
                    run_id,
                    &owner,
                    FailureCode::ApplyFailed,
                    "the apply could not be prepared for the relay (a storage or internal fault; nothing was applied); submit the apply again",
                )
                .await;
                return Err(e);
            }
        }
    }
    let owner = new_owner(pool);
    let mut tx = st.pool.begin().await?;
    let Some(run_id) = pools::claim_next_plan(&mut tx, pool.id, &owner, RELAY_LEASE_SECS).await?
    else {
        return Ok(None);
    };
    takosumi_runtime::step::record_claimed(
        &mut tx,
        run_id,
        &owner,
        json!({ "step": "plan", "pool": pool.name }),
        sandbox,
    )
    .await
    .map_err(internal)?;
    tx.commit().await?;
    match plan_job(st, pool, key, run_id, &owner).await {
        Ok(Prepared::Job(job)) => Ok(Some(*job)),
        Ok(Prepared::Failed) => Ok(None),
        Err(e) => {
            // Hand it back, counted like the control node's: nothing ran.
            takosumi_runtime::step::hand_back(&st.pool, run_id, &owner).await;
            Err(e)
        }
    }
}

/// The failure a refused input ends its Run with: the environment's own failure code (a
/// binding that does not open, a clashing variable); anything else [`secret_inputs`] refuses
/// for (its Capsule gone) is the Run's configuration.
fn refusal_code(code: ErrorCode) -> FailureCode {
    code.as_str()
        .parse()
        .unwrap_or(FailureCode::InvalidConfiguration)
}

/// The secret inputs of a step: credentials, sensitive variables and command credentials,
/// as [`RelaySecrets`] plaintext JSON, or `Err(message)` when they cannot be delivered to a
/// relay.
async fn secret_inputs(
    st: &AppState,
    inputs_of: &runs::Run,
    capsule_id: CapsuleId,
) -> Result<RelayInputs, ApiError> {
    // The same opening and the same clash rules as the control node's environment
    // (`Ctx::run_env`): a binding that does not open is `credential_failed`, a variable
    // two sources set is refused, never overwritten.
    let refused = |e: EnvError| match e {
        EnvError::Fail(code, message) => {
            ApiError::client(StatusCode::CONFLICT, code.into(), message)
        }
        EnvError::Step(e) => internal(e),
    };
    let mut names = Vec::new();
    let mut sensitive = None;
    if let Some((sv_names, sealed)) = bindings::sensitive_vars(&st.pool, inputs_of.id).await? {
        let mut plain = st
            .sealer
            .unseal(
                Purpose::Credential,
                &sensitive_vars_subject(inputs_of.id),
                &sealed,
            )
            .map_err(internal)?;
        let parsed: Result<Map<String, Value>, _> = serde_json::from_slice(&plain);
        plain.zeroize();
        sensitive = Some(parsed.map_err(internal)?);
        names.extend(sv_names.into_iter().map(|n| format!("TF_VAR_{n}")));
    }
    let capsule = capsules::get(&st.pool, capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Capsule {capsule_id}")))?;
    let vars = st
        .ctx
        .run_variables(inputs_of, &capsule)
        .await
        .map_err(refused)?;
    let mut taken = Injected::new(
        vars.keys()
            .map(|k| format!("TF_VAR_{k}"))
            .chain(names.iter().cloned()),
    );
    let mut env = std::collections::BTreeMap::new();
    let mut commands = Vec::new();
    let mut used = Vec::new();
    for sealed in bindings::sealed_for_capsule(&st.pool, capsule_id).await? {
        let b = &sealed.binding;
        let (what, set) = open_binding(&st.sealer, &sealed).map_err(refused)?;
        let entries: Vec<(String, String)> = match (&set, set.static_entries()) {
            (_, Some(entries)) => entries,
            // A command credential runs where the tool runs: on the worker, inside its
            // sandbox, for every run (delivered sealed like any credential).
            (CredentialSet::Command { command, env_name }, None) => {
                taken.claim(env_name, &what).map_err(refused)?;
                names.push(env_name.clone());
                commands.push(CommandCredential {
                    what: what.clone(),
                    command: command.clone(),
                    env_name: env_name.clone(),
                });
                Vec::new()
            }
            (_, None) => Vec::new(),
        };
        for (k, v) in entries {
            taken.claim(&k, &what).map_err(refused)?;
            env.insert(k.clone(), v);
            names.push(k);
        }
        used.push(UsedBinding {
            id: b.id,
            name: b.name.clone(),
            kind: b.kind.clone(),
        });
    }
    // Every injected name, the plain variables' included, as the control node records.
    names.extend(vars.keys().map(|k| format!("TF_VAR_{k}")));
    names.sort();
    names.dedup();
    let secrets = if env.is_empty() && sensitive.is_none() && commands.is_empty() {
        None
    } else {
        let bundle = RelaySecrets {
            env,
            sensitive_vars: sensitive,
            commands,
        };
        Some(serde_json::to_vec(&bundle).map_err(internal)?)
    };
    Ok(RelayInputs {
        secrets,
        used,
        names,
        vars,
    })
}

/// What a relayed step is delivered besides its source: the secrets (credential values and
/// sensitive variables, JSON, sealed to the pool's key before they leave), the bindings'
/// ids and names, every injected variable name, and the plain variables.
struct RelayInputs {
    secrets: Option<Vec<u8>>,
    used: Vec<UsedBinding>,
    names: Vec<String>,
    vars: Map<String, Value>,
}

impl RelayInputs {
    fn var_names(&self) -> Vec<String> {
        self.vars.keys().cloned().collect()
    }

    /// Records on the claimed Run what its job is delivered (names only).
    async fn record_on(&self, st: &AppState, run_id: RunId, owner: &str) -> Result<(), ApiError> {
        let used = serde_json::to_value(&self.used).map_err(internal)?;
        bindings::record_run_env(
            &st.pool,
            run_id,
            owner,
            &used,
            &self.names,
            &self.var_names(),
        )
        .await?;
        Ok(())
    }

    /// The secrets, sealed to the delivery key (`None`: there are none).
    fn sealed_secrets(
        &self,
        key: Option<&DeliveryPublicKey>,
        run_id: RunId,
    ) -> Result<Option<String>, ApiError> {
        match &self.secrets {
            Some(s) => seal_to(key, Purpose::Credential, run_id, s),
            None => Ok(None),
        }
    }
}

fn no_key_message(pool: &WorkerPool, what: &str) -> String {
    format!(
        "worker pool {:?} has no delivery key, so {what} cannot be delivered to it; register a delivery key (POST /api/v1/pools/{}/delivery-key) or run the Capsule on the control node",
        pool.name, pool.name
    )
}

/// Seals `plain` to the delivery key, base64 (`None`: the pool has no key; the callers
/// fail the Run `pool_has_no_delivery_key` before anything would need it).
fn seal_to(
    key: Option<&DeliveryPublicKey>,
    purpose: Purpose,
    run_id: RunId,
    plain: &[u8],
) -> Result<Option<String>, ApiError> {
    key.map(|k| seal_with(k, purpose, run_id, plain))
        .transpose()
}

/// Seals `plain` to `key`, base64.
fn seal_with(
    key: &DeliveryPublicKey,
    purpose: Purpose,
    run_id: RunId,
    plain: &[u8],
) -> Result<String, ApiError> {
    let sealed = key
        .seal(purpose, &run_id.to_string(), plain)
        .map_err(internal)?;
    Ok(B64.encode(sealed))
}

/// The Capsule's current state, opened with the server key and checked against its digest.
async fn current_state(
    st: &AppState,
    capsule: &capsules::Capsule,
) -> Result<Option<Vec<u8>>, ApiError> {
    let Some(sv_id) = capsule.current_state_version_id else {
        return Ok(None);
    };
    let sv = states::versions::get(&st.pool, sv_id)
        .await?
        .ok_or_else(|| internal(takosumi_store::StoreError::NotFound("state version")))?;
    let sealed = st
        .objects
        .get(&sv.object_key, MAX_STATE_BYTES)
        .await
        .map_err(object_error)?;
    let state = st
        .sealer
        .unseal(Purpose::State, &sv_id.to_string(), &sealed)
        .map_err(internal)?;
    if takosumi_store::sha256_hex(&state) != sv.digest {
        return Err(internal(takosumi_store::StoreError::Conflict(
            "state object does not match its digest",
        )));
    }
    Ok(Some(state))
}

async fn end_failed(
    st: &AppState,
    run_id: RunId,
    owner: &str,
    code: FailureCode,
    message: &str,
) -> Result<bool, ApiError> {
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    let mut tx = st.pool.begin().await?;
    let done = runs::fail(&mut tx, run_id, Some(owner), code, message).await?;
    if done {
        if run.kind == RunKind::Apply {
            runs::release_capsule_and_wake_next(&mut tx, run.capsule_id, run_id).await?;
        }
        events::append(
            &mut *tx,
            run_id,
            EventKind::Failed,
            &format!("handler:{owner}"),
            json!({ "code": code, "message": message }),
        )
        .await?;
    }
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok(done)
}

async fn plan_job(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run_id: RunId,
    owner: &str,
) -> Result<Prepared, ApiError> {
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    // A plan whose workers keep vanishing (the reaper hands it back each time) ends,
    // like on the control node, after a bounded number of claims.
    if run.attempts > RELAY_MAX_ATTEMPTS {
        let message = format!(
            "planning was attempted {} times on worker pool {:?} without finishing; check the relay workers' logs and plan again",
            run.attempts - 1,
            pool.name
        );
        end_failed(st, run_id, owner, FailureCode::AttemptsExhausted, &message).await?;
        return Ok(Prepared::Failed);
    }
    let capsule = capsules::get(&st.pool, run.capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Capsule {}", run.capsule_id)))?;
    let source = match st.ctx.plan_source(&run, &capsule).await {
        Ok(source) => source,
        Err(EnvError::Fail(code, message)) => {
            end_failed(st, run_id, owner, code, &message).await?;
            return Ok(Prepared::Failed);
        }
        Err(EnvError::Step(e)) => return Err(internal(e)),
    };
    let Some((inputs, state)) = delivered_inputs(st, pool, key, &run, &capsule, owner).await?
    else {
        return Ok(Prepared::Failed);
    };
    let work = JobWork::Plan(PlanJob {
        kind: run.kind,
        attempt: run.attempts,
        source: JobSource {
            repo: capsule.repo.clone(),
            branch: source.source_ref.unwrap_or_else(|| capsule.branch.clone()),
            commit: source.pinned_commit,
            dir: capsule.dir.clone(),
        },
        max_plan_bytes: MAX_RELAY_PLAN_BYTES,
        // A pull request's plan: refused rather than run when the dry-run scan finds a
        // data source that acts when planned (the worker scans before `plan`).
        speculative: source.speculative,
    });
    job(run_id, owner, &capsule, key, inputs, state.as_deref(), work)
}

/// A job: what every kind carries (the sealed payloads sealed to `key` now), and `work`.
fn job(
    run_id: RunId,
    owner: &str,
    capsule: &capsules::Capsule,
    key: Option<&DeliveryPublicKey>,
    inputs: RelayInputs,
    state: Option<&[u8]>,
    work: JobWork,
) -> Result<Prepared, ApiError> {
    let secrets = inputs.sealed_secrets(key, run_id)?;
    let state = match state {
        Some(s) => seal_to(key, Purpose::State, run_id, s)?,
        None => None,
    };
    Ok(Prepared::Job(Box::new(RelayJob {
        run_id,
        claim: owner.to_owned(),
        lease_secs: RELAY_LEASE_SECS,
        tool: capsule.tool,
        vars: inputs.vars,
        delivery_key_id: key.map(|k| k.key_id.clone()),
        // ids and names of the credential sets delivered (never their values)
        provider_bindings: inputs.used,
        secrets,
        state,
        work,
    })))
}

async fn apply_job(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run_id: RunId,
    owner: &str,
) -> Result<Prepared, ApiError> {
    let Some(key) = key else {
        end_failed(
            st,
            run_id,
            owner,
            FailureCode::PoolHasNoDeliveryKey,
            &no_key_message(pool, "the saved plan"),
        )
        .await?;
        return Ok(Prepared::Failed);
    };
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    let Some(plan_run_id) = run.plan_run_id else {
        end_failed(
            st,
            run_id,
            owner,
            FailureCode::InvalidConfiguration,
            "an apply without a saved plan cannot run on a worker pool; run it on the control node",
        )
        .await?;
        return Ok(Prepared::Failed);
    };
    let plan_run = runs::get(&st.pool, plan_run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {plan_run_id}")))?;
    let capsule = capsules::get(&st.pool, run.capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Capsule {}", run.capsule_id)))?;
    let (Some(plan_digest), Some(commit), Some(tree), Some(plan_key_s)) = (
        plan_run.plan_digest.clone(),
        plan_run.source_commit.clone(),
        plan_run.tree_digest.clone(),
        plan_run.plan_object_key.clone(),
    ) else {
        end_failed(st, run_id, owner, FailureCode::StalePlan, "the saved plan was already used or wiped, or its record is incomplete; plan again and apply the new plan").await?;
        return Ok(Prepared::Failed);
    };
    // Pin 1, on the control node: the sealed plan opens under the plan Run's id and hashes
    // to the reviewed digest before it is re-sealed to the pool.
    let sealed = match st.objects.get(&plan_key_s, MAX_SEALED_PLAN).await {
        Ok(s) => s,
        Err(takosumi_objects::ObjectError::NotFound) => {
            end_failed(
                st,
                run_id,
                owner,
                FailureCode::PlanDigestMismatch,
                "the sealed plan file is missing from storage; plan again",
            )
            .await?;
            return Ok(Prepared::Failed);
        }
        Err(e) => return Err(object_error(e)),
    };
    let Ok(mut plan_bytes) = st
        .sealer
        .unseal(Purpose::Plan, &plan_run_id.to_string(), &sealed)
    else {
        end_failed(st, run_id, owner, FailureCode::PlanDigestMismatch, "the sealed plan file does not open for this plan (altered, or moved from another run); nothing was applied; plan again").await?;
        return Ok(Prepared::Failed);
    };
    if takosumi_store::sha256_hex(&plan_bytes) != plan_digest {
        plan_bytes.zeroize();
        end_failed(st, run_id, owner, FailureCode::PlanDigestMismatch, "the saved plan does not match the digest that was reviewed; nothing was applied; plan again").await?;
        return Ok(Prepared::Failed);
    }
    let sealed_plan = seal_with(key, Purpose::Plan, run_id, &plan_bytes)?;
    plan_bytes.zeroize();
    // Decided as the apply handler decides it (`Ctx::planned_lockfile`).
    let lockfile = match st.ctx.planned_lockfile(&plan_run).await {
        Ok(found) => found.map(|(bytes, _)| B64.encode(bytes)),
        Err(LockfileError::Refused(code, message)) => {
            end_failed(st, run_id, owner, code, &message).await?;
            return Ok(Prepared::Failed);
        }
        Err(LockfileError::Step(e)) => return Err(internal(e)),
    };
    let inputs = match secret_inputs(st, &plan_run, capsule.id).await {
        Ok(s) => s,
        Err(ApiError::Client { code, message, .. }) => {
            end_failed(st, run_id, owner, refusal_code(code), &message).await?;
            return Ok(Prepared::Failed);
        }
        Err(e) => return Err(e),
    };
    let state = current_state(st, &capsule).await?;
    inputs.record_on(st, run_id, owner).await?;
    events::append(
        &st.pool,
        run_id,
        EventKind::PinChecked,
        &format!("handler:{owner}"),
        json!({ "pin": "planDigest", "planDigest": plan_digest, "deliveredTo": key.key_id }),
    )
    .await?;
    let work = JobWork::Apply(Box::new(ApplyJob {
        plan_run_id,
        plan_digest,
        source: PinnedSource {
            repo: capsule.repo.clone(),
            branch: capsule.branch.clone(),
            commit,
            tree_digest: tree,
            dir: capsule.dir.clone(),
        },
        dependency_snapshot: plan_run.dependency_snapshot,
        plan_kind: plan_run.kind,
        provider_lock_digest: plan_run.provider_lock_digest,
        lockfile,
        state_generation: plan_run.state_generation,
        plan: sealed_plan,
    }));
    job(
        run_id,
        owner,
        &capsule,
        Some(key),
        inputs,
        state.as_deref(),
        work,
    )
}

/// What a plan-side or one-step job delivers besides its source: the Run's inputs and the
/// Capsule's state, recorded on the Run (names only). `None`: the Run was failed with its
/// code (a credential that does not open, or a pool without a delivery key for secrets or
/// state).
async fn delivered_inputs(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run: &runs::Run,
    capsule: &capsules::Capsule,
    owner: &str,
) -> Result<Option<(RelayInputs, Option<Vec<u8>>)>, ApiError> {
    let inputs = match secret_inputs(st, run, capsule.id).await {
        Ok(s) => s,
        Err(ApiError::Client { code, message, .. }) => {
            end_failed(st, run.id, owner, refusal_code(code), &message).await?;
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let state = current_state(st, capsule).await?;
    if key.is_none() && (inputs.secrets.is_some() || state.is_some()) {
        let what = if state.is_some() {
            "the Capsule's state"
        } else {
            "the Capsule's credentials"
        };
        end_failed(
            st,
            run.id,
            owner,
            FailureCode::PoolHasNoDeliveryKey,
            &no_key_message(pool, what),
        )
        .await?;
        return Ok(None);
    }
    inputs.record_on(st, run.id, owner).await?;
    Ok(Some((inputs, state)))
}

/// A one-step apply's job: the branch, the Capsule's state and credentials (sealed to the
/// pool's key; a pool without one can run it only when there is neither), and its
/// variables.
async fn one_step_job(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run_id: RunId,
    owner: &str,
) -> Result<Prepared, ApiError> {
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    let capsule = capsules::get(&st.pool, run.capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Capsule {}", run.capsule_id)))?;
    let Some((inputs, state)) = delivered_inputs(st, pool, key, &run, &capsule, owner).await?
    else {
        return Ok(Prepared::Failed);
    };
    let work = JobWork::OneStep(OneStepJob {
        source: BranchSource {
            repo: capsule.repo.clone(),
            branch: capsule.branch.clone(),
            dir: capsule.dir.clone(),
        },
        state_generation: run.state_generation,
    });
    job(run_id, owner, &capsule, key, inputs, state.as_deref(), work)
}

/// A relayed one-step apply's record of what it is about to apply (the control node's
/// `runs::apply_mode::record_snapshot`), before its tool starts.
async fn one_step(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    if run.kind != RunKind::Apply || run.plan_run_id.is_some() || run.status != RunStatus::Applying
    {
        return Err(ApiError::conflict(
            ErrorCode::NotOneStep,
            format!("{} is not a one-step apply in progress", run.id),
        ));
    }
    let r: takosumi_steps::OneStepRecord = crate::extract::parse_body(&body)?;
    let snapshot = takosumi_store::runs::apply_mode::OneStepSnapshot {
        commit: &r.commit,
        tree_digest: &r.tree_digest,
        tool_version: &r.tool_version,
        provider_lock_digest: r.provider_lock_digest.as_deref(),
        injected_env_names: &r.injected_env_names,
    };
    if !takosumi_store::runs::apply_mode::record_snapshot(&st.pool, run.id, &claim, &snapshot)
        .await?
    {
        return Err(ApiError::conflict(
            ErrorCode::NotYourClaim,
            "the lease was lost before the one-step apply",
        ));
    }
    Ok(Json(json!({ "runId": run.id, "recorded": true })))
}

/// Loads the Run and checks it is the caller's pool's and held by `claim`.
async fn held_run(
    st: &AppState,
    pool: &WorkerPool,
    raw: &str,
    headers: &HeaderMap,
) -> Result<(runs::Run, String), ApiError> {
    let id: RunId = crate::extract::parse_id(raw)?;
    let run = runs::get(&st.pool, id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {id}")))?;
    let run_pool = pools::of_capsule(&st.pool, run.capsule_id).await?;
    if run_pool.as_ref().map(|p| p.id) != Some(pool.id) {
        return Err(ApiError::forbidden_code(
            ErrorCode::WrongPool,
            format!("{id} does not run on worker pool {:?}", pool.name),
        ));
    }
    let claim = headers
        .get("x-takosumi-claim")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if claim.is_empty() || run.lease_owner.as_deref() != Some(claim.as_str()) {
        return Err(ApiError::conflict(
            ErrorCode::NotYourClaim,
            format!(
                "{id} is not held by this claim (finished, canceled, or taken back after the lease ran out)"
            ),
        ));
    }
    Ok((run, claim))
}

/// A masker holding every secret value the Run's job carries (its credentials and
/// sensitive variables; for an apply, those of the plan it carries out).
async fn run_masker(st: &AppState, run: &runs::Run) -> Result<takosumi_runner::Masker, ApiError> {
    let masker = takosumi_runner::Masker::new();
    let inputs_of = match (run.kind, run.plan_run_id) {
        (takosumi_core::RunKind::Apply, Some(plan)) => runs::get(&st.pool, plan)
            .await?
            .ok_or_else(|| ApiError::not_found(&format!("Run {plan}")))?,
        _ => run.clone(),
    };
    if let Some(mut plain) = secret_inputs(st, &inputs_of, run.capsule_id).await?.secrets {
        let parsed: Result<Value, _> = serde_json::from_slice(&plain);
        plain.zeroize();
        let mut stack = vec![parsed.map_err(internal)?];
        while let Some(v) = stack.pop() {
            match v {
                Value::String(text) if !text.is_empty() => masker.add(&text),
                Value::Array(items) => stack.extend(items),
                Value::Object(map) => stack.extend(map.into_iter().map(|(_, v)| v)),
                _ => {}
            }
        }
    }
    Ok(masker)
}

async fn progress(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: ProgressReport = if body.iter().all(u8::is_ascii_whitespace) {
        ProgressReport::default()
    } else {
        crate::extract::parse_body(&body)?
    };
    let actor = format!("handler:{claim}");
    // Only progress a worker may report: what it decided or what the control node
    // records (`approved`, `applied`, `state_version_written`, `gate_decision`, …) is
    // never taken from a worker. The whole request is refused before anything is stored.
    let mut reported = Vec::with_capacity(req.events.len());
    for e in &req.events {
        match e.kind.parse::<EventKind>() {
            Ok(kind) if kind.reported_by_worker() => reported.push((kind, &e.data)),
            _ => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidEvent,
                    format!(
                        "a worker may report only the event kinds {}; {:?} is not one of them",
                        WORKER_EVENT_KINDS
                            .iter()
                            .map(|k| k.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        e.kind.chars().take(64).collect::<String>()
                    ),
                ));
            }
        }
    }
    for (kind, data) in reported {
        events::append(&st.pool, run.id, kind, &actor, data.clone()).await?;
    }
    if !req.logs.is_empty() {
        // The worker masked it with the run's secrets before sending; the control node
        // masks it again with the same secrets before storing, so a worker that did not
        // (an old or broken one) cannot put a credential into a stored log.
        let masker = run_masker(&st, &run).await?;
        for l in &req.logs {
            let text = masker.mask(&l.text);
            takosumi_store::logs::append(&st.pool, run.id, &l.step, &text).await?;
        }
    }
    let renewed = runs::renew_lease(&st.pool, run.id, &claim, RELAY_LEASE_SECS).await?;
    let cancel = takosumi_store::runs::cancel::cancel_requested(&st.pool, run.id, &claim).await?;
    Ok(Json(ProgressAnswer {
        lease_renewed: renewed,
        cancel_requested: cancel,
    }))
}

async fn plan_file(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    if !run.kind.is_plan_like() || run.status != RunStatus::Planning {
        return Err(ApiError::conflict(
            ErrorCode::NotPlanning,
            format!("{} is not planning", run.id),
        ));
    }
    // A worker that measured an oversized plan says so without sending it.
    let declared: u64 = headers
        .get("x-takosumi-plan-size")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let size = declared.max(body.len() as u64);
    if size > MAX_RELAY_PLAN_BYTES {
        let mib = MAX_RELAY_PLAN_BYTES / (1024 * 1024);
        let message = if run.kind == RunKind::DriftCheck {
            format!(
                "the drift check's saved plan is {size} bytes, over the {MAX_RELAY_PLAN_BYTES}-byte ({mib} MiB) limit of a plan file crossing the relay; the check keeps no plan, so a reconcile cannot be proposed from it. Run it on a queue the control node executes (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}}) or split the configuration"
            )
        } else {
            format!(
                "the saved plan is {size} bytes, over the {MAX_RELAY_PLAN_BYTES}-byte ({mib} MiB) limit of a plan file crossing the relay; no apply can be proposed from it. Run it on a queue the control node executes (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}}) or split the configuration"
            )
        };
        end_failed(&st, run.id, &claim, FailureCode::PlanTooLarge, &message).await?;
        return Err(ApiError::client(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::PlanTooLarge,
            message,
        ));
    }
    if body.is_empty() {
        return Err(ApiError::invalid_json(
            "send the saved plan file as the body",
        ));
    }
    // One object per claim: a second upload in the same claim replaces nothing.
    let stored = takosumi_runtime::plan_commit::store_plan_file(
        &st.ctx,
        run.id,
        run.attempts,
        PlanSource::Bytes(&body),
    )
    .await;
    drop(body);
    let digest = match stored.map_err(|e| ApiError::Internal {
        transient: e.retryable(),
        source: Box::new(e),
    })? {
        PlanPut::Stored(plan) => plan.digest,
        PlanPut::AlreadyThere => {
            return Err(ApiError::conflict(
                ErrorCode::PlanFileExists,
                "the plan file of this claim was already uploaded",
            ));
        }
    };
    Ok(Json(json!({ "planDigest": digest, "size": size })))
}

/// Why an oversized relayed drift check kept no plan (its `planned` event, and the 409 a
/// reconcile from it gets).
fn drift_plan_not_kept(size: u64) -> String {
    let mib = MAX_RELAY_PLAN_BYTES / (1024 * 1024);
    format!(
        "the drift check's saved plan is {size} bytes, over the {MAX_RELAY_PLAN_BYTES}-byte ({mib} MiB) limit of a plan file crossing the relay; the check reports its drift but keeps no plan, so a reconcile cannot be proposed from it. Run the check on a queue the control node executes (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}}) and reconcile from that check, or split the configuration"
    )
}

/// Ends a claimed relayed Run the way an [`EnvError`] says: a failure code fails it (and
/// the worker is told so), a fault is ours.
async fn env_error(st: &AppState, run_id: RunId, claim: &str, e: EnvError) -> ApiError {
    match e {
        EnvError::Fail(code, message) => {
            if let Err(e) = end_failed(st, run_id, claim, code, &message).await {
                return e;
            }
            ApiError::conflict(code.into(), message)
        }
        EnvError::Step(e) => internal(e),
    }
}

/// A relayed plan's commit: the same [`plan_commit::commit_plan`] the plan handler calls.
async fn planned(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: PlannedReport = crate::extract::parse_body(&body)?;
    drop(body);
    let run_id = run.id;
    let mut event_extra = json!({ "pool": caller.0.name });
    let plan = match req.plan_not_kept {
        Some(size) => {
            if run.kind != RunKind::DriftCheck || size <= MAX_RELAY_PLAN_BYTES {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidReport,
                    format!(
                        "planNotKept is for a drift check whose plan file is over {MAX_RELAY_PLAN_BYTES} bytes; upload the plan file (PUT …/plan-file) instead"
                    ),
                ));
            }
            event_extra["planNotKept"] = json!(drift_plan_not_kept(size));
            None
        }
        None => {
            let key = plan_key(run_id, run.attempts);
            let sealed = match st.objects.get(&key, MAX_SEALED_PLAN).await {
                Ok(s) => s,
                Err(takosumi_objects::ObjectError::NotFound) => {
                    return Err(ApiError::conflict(
                        ErrorCode::PlanFileMissing,
                        "upload the plan file (PUT …/plan-file) first",
                    ));
                }
                Err(e) => return Err(object_error(e)),
            };
            let mut plan_bytes = st
                .sealer
                .unseal(Purpose::Plan, &run_id.to_string(), &sealed)
                .map_err(internal)?;
            let digest = takosumi_store::sha256_hex(&plan_bytes);
            let size = plan_bytes.len() as u64;
            plan_bytes.zeroize();
            Some(StoredPlan { key, digest, size })
        }
    };
    let plan_digest = plan.as_ref().map(|p| p.digest.clone());
    let lockfile = match &req.lockfile {
        None => None,
        Some(b64) => {
            let bytes = B64.decode(b64).map_err(|_| {
                ApiError::invalid(ErrorCode::InvalidLockfile, "lockfile must be base64")
            })?;
            match plan_commit::store_lockfile(&st.ctx, run_id, run.attempts, &bytes).await {
                Ok(stored) => Some(stored),
                Err(e) => return Err(env_error(&st, run_id, &claim, e).await),
            }
        }
    };
    if let Some(report) = &req.scan_report {
        takosumi_store::runs::plan_record::set_scan_report(&st.pool, run_id, report).await?;
    }
    let masker = run_masker(&st, &run).await?;
    let committed = plan_commit::commit_plan(
        &st.ctx,
        &run,
        &claim,
        run.attempts,
        PlanToCommit {
            source: takosumi_runner::SourceSnapshot {
                commit: req.source_commit,
                tree_digest: req.tree_digest,
            },
            tool_version: req.tool_version,
            modules_digest: req.modules_digest,
            lockfile,
            show: req.show,
            plan,
            tool_says_drift: req.tool_says_drift,
            injected_env_names: run.injected_env_names.clone(),
            masker,
            event_extra,
        },
    )
    .await;
    match committed {
        Ok(Committed::Done) => {}
        Ok(Committed::LeaseLost) => {
            return Err(ApiError::conflict(
                ErrorCode::NotYourClaim,
                "the lease was lost before the plan was recorded",
            ));
        }
        Err(e) => return Err(env_error(&st, run_id, &claim, e).await),
    }
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    Ok(Json(
        json!({ "runId": run_id, "status": "planned", "planDigest": plan_digest, "changes": run.changes }),
    ))
}

/// A relayed plan's dry-run scan: recorded on the Run at once, and, when the worker asks,
/// decided by the same [`dry_run::check`] the plan handler calls (before `init` and `plan`
/// run anything on the worker). `{"hold": true}`: the Run is held; the worker stops.
async fn scanned(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: ScanResult<takosumi_policy::scan::ScanReport> = crate::extract::parse_body(&body)?;
    takosumi_store::runs::plan_record::set_scan_report(
        &st.pool,
        run.id,
        &req.scan_report.to_json(),
    )
    .await?;
    let Some(commit) = req.commit else {
        return Ok(Json(ScanAnswer { hold: false }));
    };
    match dry_run::check(&st.pool, &claim, &run, &req.scan_report, &commit).await {
        Ok(DryRunDecision::Proceed) => Ok(Json(ScanAnswer { hold: false })),
        Ok(DryRunDecision::Held) => Ok(Json(ScanAnswer { hold: true })),
        Ok(DryRunDecision::LeaseLost) => Err(ApiError::conflict(
            ErrorCode::NotYourClaim,
            "the lease was lost before the dry-run decision",
        )),
        Err(e) => Err(env_error(&st, run.id, &claim, e).await),
    }
}

/// Failure codes a relay worker may end its Run with (the tool's and the pins').
const WORKER_CODES: [FailureCode; 16] = [
    FailureCode::DryRunScanRefused,
    FailureCode::TimedOut,
    FailureCode::SandboxUnavailable,
    FailureCode::CheckoutFailed,
    FailureCode::InitFailed,
    FailureCode::PlanFailed,
    FailureCode::ApplyFailed,
    FailureCode::SourceChanged,
    FailureCode::DependencyChanged,
    FailureCode::LockfileMismatch,
    FailureCode::LockfileTooLarge,
    FailureCode::InvalidConfiguration,
    FailureCode::CredentialFailed,
    FailureCode::StalePlan,
    FailureCode::DeliveryKeyUnopenable,
    FailureCode::PlanTooLarge,
];

async fn fail(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: FailReport = crate::extract::parse_body(&body)?;
    let Some(code) = WORKER_CODES.into_iter().find(|c| c.as_str() == req.code) else {
        let names: Vec<&str> = WORKER_CODES.iter().map(|c| c.as_str()).collect();
        return Err(ApiError::invalid(
            ErrorCode::InvalidCode,
            format!("code must be one of {names:?}"),
        ));
    };
    let message: String = req.message.chars().take(2000).collect();
    end_failed(&st, run.id, &claim, code, &message).await?;
    Ok(Json(
        json!({ "runId": run.id, "status": "failed", "code": code }),
    ))
}

async fn applied(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    if run.kind != RunKind::Apply || run.status != RunStatus::Applying {
        return Err(ApiError::conflict(
            ErrorCode::NotApplying,
            format!("{} is not applying", run.id),
        ));
    }
    let req: AppliedReport = crate::extract::parse_body(&body)?;
    drop(body);
    let run_id = run.id;
    // A pinned apply moves the generation its plan saw; a one-step apply the one its
    // claim found.
    let plan_run = match run.plan_run_id {
        Some(id) => Some(
            runs::get(&st.pool, id)
                .await?
                .ok_or_else(|| ApiError::not_found("the plan Run"))?,
        ),
        None => None,
    };
    let plan_run_id = plan_run.as_ref().map(|p| p.id);
    let generation = plan_run
        .as_ref()
        .map_or(run.state_generation, |p| p.state_generation)
        .unwrap_or_default();
    let capsule_id = run.capsule_id;
    let mut state = match &req.state {
        None => None,
        Some(b64) => Some(
            B64.decode(b64)
                .map_err(|_| ApiError::invalid(ErrorCode::InvalidState, "state must be base64"))?,
        ),
    };
    // Sealed and stored before anything is committed, as the apply handler does it: with
    // retries, else held sealed in Postgres and the apply ends unknown_outcome.
    let sv = match &state {
        Some(bytes) => match unrecorded::seal_and_store_state(
            &st.ctx, &claim, capsule_id, run_id, generation, bytes,
        )
        .await
        {
            Ok(sv) => Some(sv),
            Err(Unrecorded(message)) => {
                state.as_mut().map(Zeroize::zeroize);
                unrecorded::end_unknown_outcome(&st.ctx, &claim, run_id, capsule_id, &message)
                    .await
                    .map_err(internal)?;
                return Ok(Json(
                    json!({ "runId": run_id, "status": "unknown_outcome", "stateGeneration": generation }),
                ));
            }
        },
        None => None,
    };
    if let Some(s) = state.as_mut() {
        s.zeroize();
    }
    let end = if let (true, Some(message)) = (req.success, &req.outputs_error) {
        // A worker's text, masked again here like a relayed log.
        let message = run_masker(&st, &run).await?.mask(message);
        ToolEnd::AfterApplyFailed { message }
    } else if req.success {
        let outputs = if req.outputs.is_object() {
            req.outputs.clone()
        } else {
            json!({})
        };
        ToolEnd::Applied { outputs }
    } else {
        ToolEnd::Failed {
            exit_code: req.exit_code.unwrap_or(1),
        }
    };
    // The same commit as the apply handler's.
    let new_generation = match apply_commit::commit_apply(
        &st.ctx,
        ApplyToCommit {
            run: &run,
            owner: &claim,
            capsule_id,
            generation,
            plan_run_id,
            state_version: sv,
            end,
            event_extra: json!({ "pool": caller.0.name }),
        },
    )
    .await
    {
        Ok(g) => g,
        Err(ApplyCommitError::LeaseLost) => {
            return Err(ApiError::conflict(
                ErrorCode::NotYourClaim,
                "the lease was lost while applying",
            ));
        }
        Err(e) => return Err(internal(e)),
    };
    if let Some(plan_run) = &plan_run
        && let Some(key) = &plan_run.plan_object_key
    {
        unrecorded::wipe_sealed_plan(&st.ctx, plan_run.id, key).await;
    }
    Ok(Json(
        json!({ "runId": run_id, "status": if req.success { "applied" } else { "failed" }, "stateGeneration": new_generation }),
    ))
}

/// Fails a just-proposed Apply Run `pool_has_no_delivery_key` when its Capsule runs on a
/// pool with no delivery key (the saved plan could never be delivered). `true`: it failed.
pub(crate) async fn fail_if_pool_has_no_key(
    tx: &mut takosumi_store::Tx,
    run_id: RunId,
    capsule_id: CapsuleId,
) -> Result<bool, ApiError> {
    let Some(pool) = pools::of_capsule(&mut **tx, capsule_id).await? else {
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
        &mut **tx,
        run_id,
        EventKind::Failed,
        "system:relay",
        json!({ "code": code, "message": message }),
    )
    .await?;
    Ok(true)
}

/// The worker stopped the tool because a cancel was requested (`progress` said so): the
/// Run ends `canceled` with who asked, as on the control node. An apply lets go of its
/// Capsule and wakes the next waiting apply. Only a requested cancel can end this way.
async fn canceled(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let mut tx = st.pool.begin().await?;
    let Some(done) = takosumi_store::runs::cancel::cancel_claimed(&mut tx, run.id, &claim).await?
    else {
        return Err(ApiError::conflict(
            ErrorCode::NoCancelRequested,
            format!("no cancel of {} was requested", run.id),
        ));
    };
    if run.kind == RunKind::Apply {
        runs::release_capsule_and_wake_next(&mut tx, run.capsule_id, run.id).await?;
    }
    let actor = format!("handler:{claim}");
    events::append(
        &mut *tx,
        run.id,
        EventKind::Canceled,
        &actor,
        json!({ "canceledBy": done.by, "whileRunning": true, "pool": caller.0.name }),
    )
    .await?;
    takosumi_store::activity::append(
        &mut *tx,
        done.workspace_id,
        "run_canceled",
        &run.id.to_string(),
        &done.by,
        json!({ "whileRunning": true }),
    )
    .await?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok(Json(json!({ "runId": run.id, "status": "canceled" })))
}
