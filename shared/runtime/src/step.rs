//! Pieces the plan and apply steps share: ending a Run, restoring a Capsule's state into
//! the private directory, the object keys of sealed artifacts.

use takosumi_core::{CapsuleId, EventKind, FailureCode, Outcome, RunId, StateVersionId, StepError};
use takosumi_objects::ObjectError;
use takosumi_runner::{RunnerError, Workdir};
use takosumi_seal::Purpose;
use takosumi_store::{StoreError, capsules::Capsule, events, runs, states};

use crate::Ctx;
use crate::inputs::EnvError;

/// Largest state file Takosumi moves (state is not relayed, but bounded all the same).
pub const MAX_STATE_BYTES: u64 = 256 * 1024 * 1024;

/// Object key of a Run's sealed plan file for one claim (`attempt`): a retried plan never
/// collides with what an earlier, vanished attempt may have written.
pub fn plan_key(run_id: RunId, attempt: i32) -> String {
    format!("runs/{run_id}/plan.{attempt}.sealed")
}

/// Object key of a Run's sealed provider lockfile.
pub fn lockfile_key(run_id: RunId, attempt: i32) -> String {
    format!("runs/{run_id}/lockfile.{attempt}.sealed")
}

/// Object key of a sealed StateVersion.
pub fn state_key(capsule_id: CapsuleId, sv: StateVersionId) -> String {
    format!("states/{capsule_id}/{sv}.sealed")
}

/// Maps an object-store error to a step error.
pub fn object_err(e: ObjectError) -> StepError {
    if e.retryable() {
        StepError::transient(e)
    } else {
        StepError::internal(e)
    }
}

/// Maps a runner error that carries no Run failure code.
pub fn runner_err(e: RunnerError) -> StepError {
    if e.retryable() {
        StepError::transient(e)
    } else {
        StepError::internal(e)
    }
}

/// [`runs::hand_back`] (the row and its `requeued` event in one transaction); a failure
/// is logged (the reaper takes the Run back when the lease runs out). The control node's
/// handlers and the relay endpoint both hand back through it.
pub async fn hand_back(pool: &takosumi_store::Pool, run_id: RunId, owner: &str) {
    let handed = async {
        let mut tx = pool.begin().await?;
        let done = runs::hand_back(
            &mut tx,
            run_id,
            owner,
            "transient fault; the step is retried",
        )
        .await?;
        tx.commit().await?;
        Ok::<bool, takosumi_store::StoreError>(done)
    };
    if let Err(e) = handed.await {
        tracing::warn!(%run_id, error = %e, "could not hand the run back; the reaper will");
    }
}

/// Claims a released apply for `owner` (see [`runs::claim_apply`]) and records, in the
/// same transaction, what the claim found: `claimed` (with `data`, and the `sandbox` that
/// executes it, written by the claim's own statement) or a `failed` event naming the generation change or the unresolved Run
/// that keeps the Capsule from applies. One implementation for the apply handler and the
/// relay endpoint.
pub async fn claim_apply_recorded(
    tx: &mut takosumi_store::Tx,
    run_id: RunId,
    owner: &str,
    lease_secs: i64,
    data: serde_json::Value,
    sandbox: Option<takosumi_core::SandboxMode>,
) -> Result<runs::ApplyClaim, StepError> {
    let record = runs::ClaimRecord {
        data: &data,
        sandbox,
    };
    let claim = runs::claim_apply(tx, run_id, owner, lease_secs, record).await?;
    let actor = format!("handler:{owner}");
    let failed = match &claim {
        runs::ApplyClaim::Claimed => None,
        runs::ApplyClaim::GenerationChanged { planned, current } => Some(serde_json::json!({
            "code": FailureCode::StateGenerationChanged,
            "plannedGeneration": planned,
            "currentGeneration": current,
            "toolStarted": false,
        })),
        runs::ApplyClaim::NeedsInspection { blocking } => Some(serde_json::json!({
            "code": FailureCode::CapsuleNeedsInspection,
            "unresolvedRunId": blocking,
            "toolStarted": false,
        })),
        runs::ApplyClaim::CapsuleBusy | runs::ApplyClaim::NotClaimable => None,
    };
    if let Some(failed) = failed {
        events::append(tx.db(), run_id, EventKind::Failed, &actor, failed).await?;
    }
    Ok(claim)
}

impl Ctx {
    /// Ends a claimed Run `failed` (only while this process holds its lease), records the
    /// event, and, for an apply, lets go of the Capsule and wakes the next waiting apply.
    pub async fn fail_claimed(
        &self,
        run_id: RunId,
        capsule_for_apply: Option<CapsuleId>,
        code: FailureCode,
        message: &str,
    ) -> Result<Outcome, StepError> {
        let mut tx = self.pool.begin().await.map_err(StoreError::from)?;
        let done = runs::fail(&mut tx, run_id, Some(&self.owner), code, message).await?;
        if !done {
            return Ok(Outcome::Skipped(
                "lease lost before the failure was recorded",
            ));
        }
        if let Some(capsule_id) = capsule_for_apply {
            runs::release_capsule_and_wake_next(&mut tx, capsule_id, run_id).await?;
        }
        let actor = self.actor();
        events::append(
            tx.db(),
            run_id,
            EventKind::Failed,
            &actor,
            serde_json::json!({ "code": code, "message": message }),
        )
        .await?;
        tx.commit().await.map_err(StoreError::from)?;
        self.relay_wake.notify_one();
        tracing::info!(%run_id, %code, "run failed");
        Ok(Outcome::Failed(code))
    }

    /// Hands a claimed Run back to the queue after a transient fault, so the retried
    /// message can claim it at once instead of waiting for the lease to expire. The
    /// hand-back is counted (`handbacks`) so that it does not use up the Run's attempts:
    /// those bound handlers that vanished, not outages a handler rode out.
    pub async fn release_claim(&self, run_id: RunId) {
        hand_back(&self.pool, run_id, &self.owner).await;
    }

    /// Writes the Capsule's current state (as of the generation read with `capsule`) into
    /// the private directory. Returns the bytes restored. A state object that is missing,
    /// does not open under its StateVersion's id, or does not hash to the recorded digest
    /// (altered or swapped in storage) fails the Run `state_integrity` before any tool
    /// starts: planning or applying on top of a state nobody recorded is never safe.
    pub async fn restore_state(
        &self,
        wd: &Workdir,
        capsule: &Capsule,
    ) -> Result<Option<Vec<u8>>, EnvError> {
        let Some(sv_id) = capsule.current_state_version_id else {
            return Ok(None);
        };
        let sv = states::versions::get(&self.pool, sv_id)
            .await?
            .ok_or_else(|| StepError::internal(StoreError::NotFound("state version")))?;
        let refused = |what: &str| {
            EnvError::Fail(
                FailureCode::StateIntegrity,
                format!(
                    "the Capsule's current state ({sv_id}, generation {}) {what}; nothing ran. \
                     Restore the state object, or resolve the Capsule's state, before planning again",
                    sv.generation
                ),
            )
        };
        let sealed = match self.objects.get(&sv.object_key, MAX_STATE_BYTES).await {
            Ok(sealed) => sealed,
            Err(ObjectError::NotFound) => return Err(refused("is missing from storage")),
            Err(e) => return Err(object_err(e).into()),
        };
        let Ok(state) = self
            .sealer
            .unseal(Purpose::State, &sv_id.to_string(), &sealed)
        else {
            return Err(refused(
                "does not open with this server's keys under its own id (altered or moved in storage)",
            ));
        };
        if takosumi_store::sha256_hex(&state) != sv.digest {
            return Err(refused(
                "does not match its recorded digest (altered in storage)",
            ));
        }
        self.runner.restore_state(wd, &state).map_err(runner_err)?;
        Ok(Some(state))
    }
}
