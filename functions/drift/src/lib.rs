//! The drift-check step. A drift check is a dry-run plan of what was applied — the commit
//! and the variables of the Run behind the Capsule's current StateVersion (it fails
//! `not_applied` when there is none) — against its current state (`plan -detailed-exitcode
//! -out`, never `-refresh-only`): the
//! tool's exit code says whether anything would change, `show -json` says what; it records
//! `drift: true|false`, and — only when it found drift — keeps its saved plan sealed so a
//! reconcile (`POST /runs/{check}/apply`) carries out exactly the plan shown with the
//! check. A later check of the same Capsule drops the plan an earlier one kept. It never
//! applies anything; the planning itself is the plan step's, shared here.

use takosumi_core::{Outcome, RunKind, RunMessage, StepError};
use takosumi_runtime::Ctx;

/// Handles one `run.drift` wake-up. Safe to run twice (the plan step's claim decides).
pub async fn handle(ctx: &Ctx, msg: RunMessage) -> Result<Outcome, StepError> {
    let run = takosumi_store::runs::get(&ctx.pool, msg.run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("{} does not exist", msg.run_id)))?;
    if run.kind != RunKind::DriftCheck {
        return Err(StepError::Poison(format!(
            "{} is not a drift check",
            msg.run_id
        )));
    }
    takosumi_plan::handle(ctx, msg).await
}
