//! After the tool has applied, the result must be recorded; this module is what happens
//! when that is hard.
//!
//! The new state goes to object storage with retries (exponential backoff with jitter,
//! `backon`) well past the object store's own short retries: a storage outage of tens of
//! seconds must not turn an apply that worked into a lost state. If storage still will
//! not take it, the state is kept, sealed exactly as it would have been stored, in
//! Postgres (`held_states`), and the apply ends `unknown_outcome` saying the tool applied
//! and the state could not be stored. Any other fault after the tool ran (reading
//! outputs, the final commit) also ends `unknown_outcome`, never `failed` with "nothing
//! was applied". An `unknown_outcome` apply keeps the Capsule from other applies until an
//! operator resolves it (`takosumi_store::runs::unknown`).
//!
//! The apply handler and the API's relay endpoint (a relay worker's apply) both end an
//! apply through here, so a state is kept the same way whichever ran the tool.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use takosumi_core::{CapsuleId, EventKind, Outcome, RunId, StateVersionId, StepError};
use takosumi_objects::ObjectError;
use takosumi_seal::Purpose;
use takosumi_store::states::held::HeldState;
use takosumi_store::{StoreError, events, runs, states};

use crate::Ctx;
use crate::step::state_key;

/// The tool ran (it may have changed infrastructure) but its result could not be
/// recorded: the apply ends `unknown_outcome` with this message, never `failed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unrecorded(pub String);

/// How long storing the new state is retried before it is held in Postgres instead.
const STATE_STORE_RETRY: Duration = Duration::from_secs(30);

/// How long recording an `unknown_outcome` is retried (the database may be restarting).
const RECORD_RETRY: Duration = Duration::from_secs(30);

fn backoff(total: Duration) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(5))
        .with_total_delay(Some(total))
        .without_max_times()
}

/// Seals the state the tool wrote under a new StateVersion id and puts it in object
/// storage, retrying transient faults for [`STATE_STORE_RETRY`]. When storage will not
/// take it, the sealed state is kept in Postgres and the error says so ([`Unrecorded`]);
/// the caller ends the apply `unknown_outcome` ([`end_unknown_outcome`]). `owner` holds
/// the Run's lease (this handler, or the relay worker's claim).
pub async fn seal_and_store_state(
    ctx: &Ctx,
    owner: &str,
    capsule_id: CapsuleId,
    run_id: RunId,
    generation: i64,
    bytes: &[u8],
) -> Result<(states::versions::StateVersion, i64), Unrecorded> {
    let id = StateVersionId::new();
    let key = state_key(capsule_id, id);
    let size = i64::try_from(bytes.len()).unwrap_or(i64::MAX);
    let sv = states::versions::StateVersion {
        id,
        capsule_id,
        generation: generation + 1,
        run_id,
        object_key: key.clone(),
        digest: takosumi_store::sha256_hex(bytes),
    };
    let sealed = match ctx.sealer.seal(Purpose::State, &id.to_string(), bytes) {
        Ok(sealed) => sealed,
        Err(e) => {
            return Err(Unrecorded(format!(
                "the tool applied, but its new state could not be sealed ({e}); the state was not kept. \
                 Inspect the provider side (the provider's resources are the record now), then resolve this Run"
            )));
        }
    };
    // The key is new (a fresh StateVersion id), so an object already there is this put's
    // own earlier attempt whose answer was lost.
    // The first refusal is also a Run event: whoever watches the Run sees why it stays
    // `applying` (best effort; the retry does not wait on it).
    let announced = std::sync::atomic::AtomicBool::new(false);
    let put = || async {
        let put = ctx.objects.put_if_absent(&key, sealed.clone()).await;
        if let Err(e) = &put
            && e.retryable()
            && !announced.swap(true, std::sync::atomic::Ordering::Relaxed)
            && let Err(store) = events::append(
                &ctx.pool,
                run_id,
                EventKind::StateStoreRetrying,
                &format!("handler:{owner}"),
                serde_json::json!({ "error": e.to_string() }),
            )
            .await
        {
            tracing::warn!(%run_id, error = %store, "could not record the state store's retry");
        }
        put
    };
    let stored = put
        .retry(backoff(STATE_STORE_RETRY))
        .sleep(tokio::time::sleep)
        .when(ObjectError::retryable)
        .notify(|e: &ObjectError, delay: Duration| {
            tracing::warn!(%run_id, error = %e, ?delay, "could not store the new state yet; retrying");
        })
        .await;
    let storage_error = match stored {
        Ok(_) => return Ok((sv, size)),
        Err(e) => e,
    };
    tracing::error!(%run_id, error = %storage_error, "the new state could not be stored; keeping it sealed in the database");
    let held = HeldState {
        state_version_id: id,
        run_id,
        capsule_id,
        generation: generation + 1,
        object_key: key.clone(),
        digest: sv.digest.clone(),
        size_bytes: size,
        reason: storage_error.to_string(),
    };
    let hold = || async { states::held::hold_state(&ctx.pool, &held, &sealed).await };
    let kept = hold
        .retry(backoff(RECORD_RETRY))
        .sleep(tokio::time::sleep)
        .when(StoreError::retryable)
        .await;
    Err(Unrecorded(match kept {
        Ok(()) => format!(
            "the tool applied, but its new state could not be stored in object storage ({storage_error}); \
             the state is kept sealed in the database as held state {id} (generation {} once recovered; \
             the Capsule stays at generation {generation}). Inspect the provider side and the held state, \
             then resolve this Run; no other apply of the Capsule runs until then",
            generation + 1
        ),
        Err(e) => format!(
            "the tool applied, but its new state could not be stored in object storage ({storage_error}) \
             nor kept in the database ({e}); Takosumi has no copy of it. The provider side holds the truth: \
             inspect it, then resolve this Run; no other apply of the Capsule runs until then"
        ),
    }))
}

/// Ends a claimed apply whose tool ran but whose result could not be recorded:
/// `unknown_outcome` with `message`, an event, and a wake-up for the next waiting apply
/// (which the Capsule lock then refuses with `capsule_needs_inspection`). Retries the
/// database for [`RECORD_RETRY`]; if it still cannot, the Run stays `applying` and the
/// reaper makes it `unknown_outcome` when its lease runs out. `owner` holds the lease.
pub async fn end_unknown_outcome(
    ctx: &Ctx,
    owner: &str,
    run_id: RunId,
    capsule_id: CapsuleId,
    message: &str,
) -> Result<Outcome, StepError> {
    let record = || async {
        let mut tx = ctx.pool.begin().await?;
        if !runs::unknown::mark_unknown_outcome(&mut tx, run_id, owner, message).await? {
            return Ok(false);
        }
        let held: Vec<String> = states::held::held_ids_for_run(tx.db(), run_id)
            .await?
            .into_iter()
            .map(|id| id.to_string())
            .collect();
        events::append(
            tx.db(),
            run_id,
            EventKind::UnknownOutcome,
            &format!("handler:{owner}"),
            serde_json::json!({ "message": message, "toolStarted": true, "heldStateVersionIds": held }),
        )
        .await?;
        runs::wake_next_apply(&mut tx, capsule_id).await?;
        tx.commit().await?;
        Ok::<bool, StoreError>(true)
    };
    let recorded = record
        .retry(backoff(RECORD_RETRY))
        .sleep(tokio::time::sleep)
        .when(StoreError::retryable)
        .await?;
    if !recorded {
        return Ok(Outcome::Skipped(
            "lease lost before the unknown outcome was recorded",
        ));
    }
    ctx.relay_wake.notify_one();
    tracing::warn!(%run_id, "apply ended unknown_outcome: the tool ran, its result was not recorded");
    Ok(Outcome::Done)
}

/// The plan file is a secret: once its apply ends, the sealed plan and the sealed plan
/// JSON (`json_key`, the plan Run's `plan_json_object_key`; it carries the same values) go
/// too, side by side. A failed delete leaves them sealed.
pub async fn wipe_sealed_plan(
    ctx: &Ctx,
    plan_run_id: RunId,
    plan_key: &str,
    json_key: Option<&str>,
) {
    let plan = async {
        if let Err(e) = ctx.objects.delete(plan_key).await {
            tracing::warn!(%plan_run_id, error = %e, "could not delete the sealed plan; it stays sealed");
        }
    };
    let json = async {
        if let Some(key) = json_key
            && let Err(e) = ctx.objects.delete(key).await
        {
            tracing::warn!(%plan_run_id, error = %e, "could not delete the sealed plan JSON; it stays sealed");
        }
    };
    tokio::join!(plan, json);
}
