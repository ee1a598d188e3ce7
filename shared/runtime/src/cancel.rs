//! Ending a claimed Run `canceled`: the step noticed the cancel request (through its
//! [`crate::LeaseGuard`]), its tool was interrupted, and the Run ends with who asked and
//! when, an event and an activity entry. An apply also lets go of its Capsule and wakes
//! the next waiting apply, exactly as a failed apply does.

use takosumi_core::{ActivityKind, CapsuleId, EventKind, Outcome, RunId, StepError, WorkspaceId};
use takosumi_store::{Tx, activity, events, runs};
use tokio_util::sync::CancellationToken;

use crate::Ctx;
use takosumi_store::StoreError;

impl Ctx {
    /// This context with a runner whose long tool steps stop when `cancel` fires (see
    /// [`takosumi_runner::Runner::interruptible`]). Everything else is shared.
    pub fn interruptible(&self, cancel: CancellationToken) -> Ctx {
        let mut ctx = self.clone();
        ctx.runner = self.runner.interruptible(cancel);
        ctx
    }

    /// Ends a claimed Run `canceled` (only while this process holds its lease and a cancel
    /// was requested), in its own transaction. `detail` goes into the `canceled` event.
    pub async fn cancel_claimed(
        &self,
        run_id: RunId,
        capsule_for_apply: Option<CapsuleId>,
        detail: serde_json::Value,
    ) -> Result<Outcome, StepError> {
        let mut tx = self.pool.begin().await.map_err(StoreError::from)?;
        if !self
            .cancel_claimed_in(&mut tx, run_id, capsule_for_apply, detail)
            .await?
        {
            return Ok(Outcome::Skipped(
                "lease lost before the cancel was recorded",
            ));
        }
        tx.commit().await.map_err(StoreError::from)?;
        self.relay_wake.notify_one();
        tracing::info!(%run_id, "run canceled");
        Ok(Outcome::Done)
    }

    /// [`Ctx::cancel_claimed`] inside the caller's transaction (an apply records the state
    /// the interrupted tool wrote in the same one). `false`: not this holder's to end.
    pub async fn cancel_claimed_in(
        &self,
        tx: &mut Tx,
        run_id: RunId,
        capsule_for_apply: Option<CapsuleId>,
        detail: serde_json::Value,
    ) -> Result<bool, StepError> {
        cancel_claimed_in(tx, &self.owner, run_id, capsule_for_apply, detail).await
    }
}

/// Ends a Run `owner` holds the claim of `canceled`, inside the caller's transaction (see
/// [`Ctx::cancel_claimed_in`]; the relay endpoints end a worker's Run through it too).
pub async fn cancel_claimed_in(
    tx: &mut Tx,
    owner: &str,
    run_id: RunId,
    capsule_for_apply: Option<CapsuleId>,
    detail: serde_json::Value,
) -> Result<bool, StepError> {
    let Some(canceled) = runs::cancel::cancel_claimed(tx, run_id, owner).await? else {
        return Ok(false);
    };
    if let Some(capsule_id) = capsule_for_apply {
        runs::release_capsule_and_wake_next(tx, capsule_id, run_id).await?;
    }
    let actor = format!("handler:{owner}");
    let mut data = serde_json::json!({ "canceledBy": canceled.by, "whileRunning": true });
    if let (Some(map), serde_json::Value::Object(extra)) = (data.as_object_mut(), detail) {
        map.extend(extra);
    }
    events::append(tx.db(), run_id, EventKind::Canceled, &actor, data).await?;
    record_activity(tx, canceled.workspace_id, run_id, &canceled.by).await?;
    Ok(true)
}

async fn record_activity(
    tx: &mut Tx,
    workspace_id: WorkspaceId,
    run_id: RunId,
    by: &str,
) -> Result<(), StepError> {
    activity::append(
        tx.db(),
        workspace_id,
        ActivityKind::RunCanceled,
        &run_id.to_string(),
        by,
        serde_json::json!({ "whileRunning": true }),
    )
    .await
    .map_err(StepError::from)
}
