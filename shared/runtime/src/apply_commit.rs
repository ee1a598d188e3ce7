//! The apply commit, written once so an apply ends the same way whoever executed it: what an apply's tool run becomes on the
//! control node, in one transaction — a new StateVersion with the generation
//! compare-and-set when the tool changed the state (even if it failed), the plan's sealed
//! plan and sensitive variables forgotten, the Run `applied`, `failed` or `canceled` with
//! its event, the Capsule released, and the next waiting apply woken. The apply handler
//! calls it for its own applies, the API's relay endpoint for a relay worker's (`owner` is
//! the claim either way). Sealing the new state is the caller's (the control node retries
//! and holds it in Postgres when storage refuses; see `functions/apply`).

use serde_json::{Value, json};
use takosumi_core::{CapsuleId, EventKind, FailureCode, RunId, StepError};
use takosumi_store::StoreError;
use takosumi_store::{capsules, events, runs, states};

use crate::Ctx;

/// How the apply tool ended.
#[derive(Debug, Clone)]
pub enum ToolEnd {
    /// It applied: the Run is `applied` with these public outputs.
    Applied {
        /// Published (non-sensitive, masked) outputs.
        outputs: Value,
    },
    /// It failed with this exit code: the Run is `failed` (`apply_failed`).
    Failed {
        /// The tool's exit code.
        exit_code: i32,
    },
    /// A cancel interrupted it: the Run is `canceled`; `detail` goes into the event.
    Canceled {
        /// Added to the `canceled` event.
        detail: Value,
    },
    /// It applied, then a later step failed (`message`, masked): the state it wrote is
    /// recorded and current, and only then is the Run `failed` (`after_apply_failed`).
    AfterApplyFailed {
        /// What failed.
        message: String,
    },
}

/// An apply's result, for [`commit_apply`].
pub struct ApplyToCommit<'a> {
    /// The apply Run.
    pub run: &'a runs::Run,
    /// The claim it was run under.
    pub owner: &'a str,
    /// Its Capsule.
    pub capsule_id: CapsuleId,
    /// The generation the plan saw (the claim checked it).
    pub generation: i64,
    /// The plan Run it carried out (`None`: a one-step apply).
    pub plan_run_id: Option<RunId>,
    /// The StateVersion of the state the tool left, already sealed and stored (`None`:
    /// the state did not change), with its size.
    pub state_version: Option<(states::versions::StateVersion, i64)>,
    /// How the tool ended.
    pub end: ToolEnd,
    /// Added to the `applied` event (a relayed apply names its pool).
    pub event_extra: Value,
}

/// Why the commit did not happen.
#[derive(Debug, thiserror::Error)]
pub enum ApplyCommitError {
    /// `owner` no longer held the Run.
    #[error("the lease was lost while applying")]
    LeaseLost,
    /// The Capsule's generation moved while this apply held it (a broken invariant).
    #[error("the Capsule's generation moved while this apply held it")]
    GenerationMoved,
    /// The database failed.
    #[error(transparent)]
    Step(#[from] StepError),
}

impl From<StoreError> for ApplyCommitError {
    fn from(e: StoreError) -> Self {
        Self::Step(e.into())
    }
}

/// Commits an apply (see the module documentation). Returns the Capsule's generation
/// after it.
pub async fn commit_apply(ctx: &Ctx, c: ApplyToCommit<'_>) -> Result<i64, ApplyCommitError> {
    let run_id = c.run.id;
    let actor = format!("handler:{}", c.owner);
    let sv_id = c.state_version.as_ref().map(|(s, _)| s.id);
    let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
    let new_generation = match &c.state_version {
        Some((sv, size)) => {
            let recorded = states::versions::record_written(
                &mut tx,
                sv,
                *size,
                c.generation,
                states::versions::Writer::Apply,
                &actor,
                c.run.workspace_id,
            )
            .await?;
            if !recorded {
                return Err(ApplyCommitError::GenerationMoved);
            }
            sv.generation
        }
        None => {
            capsules::release_apply(&mut tx, c.capsule_id, run_id).await?;
            c.generation
        }
    };
    if let Some(plan_run_id) = c.plan_run_id {
        // The plan's sealed sensitive variables go with its plan file.
        runs::clear_plan_object(&mut tx, plan_run_id).await?;
    }
    match &c.end {
        ToolEnd::Applied { outputs } => {
            let mut data = json!({ "generation": new_generation });
            if let (Some(d), Some(extra)) = (data.as_object_mut(), c.event_extra.as_object()) {
                d.extend(extra.clone());
            }
            if !runs::record_apply(
                &mut tx,
                run_id,
                c.owner,
                outputs,
                sv_id,
                new_generation,
                &data,
            )
            .await?
            {
                return Err(ApplyCommitError::LeaseLost);
            }
        }
        ToolEnd::Canceled { detail } => {
            // Canceled mid-tool: the state the interrupted tool wrote is recorded above.
            let mut detail = detail.clone();
            if let Some(d) = detail.as_object_mut() {
                d.insert("stateVersionId".into(), json!(sv_id));
            }
            if !crate::cancel::cancel_claimed_in(&mut tx, c.owner, run_id, None, detail).await? {
                return Err(ApplyCommitError::LeaseLost);
            }
            record_state_version(&mut tx, run_id, sv_id).await?;
        }
        ToolEnd::AfterApplyFailed { message } => {
            let message = match sv_id {
                Some(sv) => format!(
                    "the tool applied and the state it wrote is recorded as StateVersion {sv} (now the Capsule's current state, generation {new_generation}); then {message}. The applied state is current: check the Run's logs and the Capsule's outputs before anything else, and do not repeat the apply"
                ),
                None => format!(
                    "the tool applied without changing the state; then {message}. Check the Run's logs before anything else, and do not repeat the apply"
                ),
            };
            let code = FailureCode::AfterApplyFailed;
            let data = json!({ "code": code, "stateVersionId": sv_id, "afterApply": true });
            fail_after_tool(&mut tx, c.owner, run_id, sv_id, code, &message, data).await?;
        }
        ToolEnd::Failed { exit_code } => {
            let message = if sv_id.is_some() {
                "apply failed after changing state; a new StateVersion was recorded. Check the logs and the provider side before planning again"
            } else {
                "apply failed; check the run's logs, then plan again"
            };
            let code = FailureCode::ApplyFailed;
            let data = json!({ "code": code, "exitCode": exit_code });
            fail_after_tool(&mut tx, c.owner, run_id, sv_id, code, message, data).await?;
        }
    }
    runs::wake_next_apply(&mut tx, c.capsule_id).await?;
    tx.commit().await.map_err(StoreError::from)?;
    ctx.relay_wake.notify_one();
    Ok(new_generation)
}

/// Fails a Run whose tool ran, with the StateVersion it left (already recorded) on it, and
/// its `failed` event.
async fn fail_after_tool(
    tx: &mut takosumi_store::Tx,
    owner: &str,
    run_id: RunId,
    sv: Option<takosumi_core::StateVersionId>,
    code: FailureCode,
    message: &str,
    data: Value,
) -> Result<(), ApplyCommitError> {
    if !runs::fail(tx, run_id, Some(owner), code, message).await? {
        return Err(ApplyCommitError::LeaseLost);
    }
    record_state_version(tx, run_id, sv).await?;
    events::append(
        tx.db(),
        run_id,
        EventKind::Failed,
        &format!("handler:{owner}"),
        data,
    )
    .await?;
    Ok(())
}

async fn record_state_version(
    tx: &mut takosumi_store::Tx,
    run_id: RunId,
    sv: Option<takosumi_core::StateVersionId>,
) -> Result<(), StepError> {
    if let Some(sv) = sv {
        runs::set_state_version(tx, run_id, sv).await?;
    }
    Ok(())
}
