//! The one-step apply: an apply no rule covers runs `apply -auto-approve`, which plans and
//! applies in one step with nothing saved in between (seed: "An apply that no rule covers
//! still runs apply -auto-approve"). There is no saved plan to pin, so nothing here is
//! compared with a plan: the branch head is checked out, the Capsule's current state is
//! restored (the claim took the Capsule at the generation it found), modules and providers
//! are installed by a plain `init`, and the Run records what ran (commit, tree, tool
//! version, lockfile digest) and that it ran in one step. A covered apply never comes here:
//! the gate releases a plan-less Apply Run only when no rule, approval request or agent
//! hold covers it, and it takes the pinned path otherwise.

use takosumi_core::{EventKind, Outcome, StepError};
use takosumi_runner::{Masker, Runner, ToolEnv, Workdir};
use takosumi_runtime::Ctx;
use takosumi_runtime::step::runner_err;
use takosumi_steps::{OneStepInputs, OneStepRecord};
use takosumi_store::{capsules, runs};

use crate::{ApplyError, fail, finish};

/// The control node as the one-step apply's host.
struct NodeOneStepHost<'a> {
    ctx: &'a Ctx,
    run: &'a runs::Run,
    capsule: &'a capsules::Capsule,
}

impl takosumi_steps::Host for NodeOneStepHost<'_> {
    type Error = ApplyError;

    async fn event(&self, kind: EventKind, data: serde_json::Value) {
        self.ctx.event(self.run.id, kind, data).await;
    }

    async fn log(&self, step: &'static str, masker: &Masker, text: &str) {
        self.ctx.log(self.run.id, step, masker, text).await;
    }

    async fn restore_state(
        &self,
        _runner: &Runner,
        wd: &Workdir,
    ) -> Result<Option<Vec<u8>>, ApplyError> {
        Ok(self.ctx.restore_state(wd, self.capsule).await?)
    }

    async fn tool_env(&self, wd: &Workdir) -> Result<ToolEnv, ApplyError> {
        Ok(self
            .ctx
            .run_env(self.run.id, self.run, self.capsule, wd)
            .await?)
    }
}

impl takosumi_steps::OneStepHost for NodeOneStepHost<'_> {
    async fn record_one_step(&self, r: &OneStepRecord) -> Result<(), ApplyError> {
        let snapshot = runs::apply_mode::OneStepSnapshot {
            commit: &r.commit,
            tree_digest: &r.tree_digest,
            tool_version: &r.tool_version,
            provider_lock_digest: r.provider_lock_digest.as_deref(),
            injected_env_names: &r.injected_env_names,
        };
        if !runs::apply_mode::record_snapshot(
            &self.ctx.pool,
            self.run.id,
            &self.ctx.owner,
            &snapshot,
        )
        .await?
        {
            return Err(StepError::Internal("lease lost before the one-step apply".into()).into());
        }
        Ok(())
    }
}

pub(crate) async fn apply(ctx: &Ctx, run: &runs::Run) -> Result<Outcome, ApplyError> {
    let run_id = run.id;
    let capsule = capsules::get(&ctx.pool, run.capsule_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("capsule of {run_id} is gone")))?;
    let tool = capsule.tool;
    // The claim pinned the Capsule's generation at that moment and took the Capsule.
    let Some(generation) = runs::get(&ctx.pool, run_id)
        .await?
        .and_then(|r| r.state_generation)
    else {
        return Err(StepError::Internal("one-step apply without a generation".into()).into());
    };
    if capsule.state_generation != generation {
        return Err(fail(
            takosumi_core::FailureCode::StateGenerationChanged,
            "the Capsule's state moved on while this apply started; nothing was applied; submit the apply again",
        ));
    }
    let wd = ctx
        .runner
        .workdir(&run_id.to_string())
        .map_err(runner_err)?;
    let host = NodeOneStepHost {
        ctx,
        run,
        capsule: &capsule,
    };
    let inputs = OneStepInputs {
        tool,
        repo: capsule.repo.clone(),
        branch: capsule.branch.clone(),
        dir: capsule.dir.clone(),
    };
    let out = takosumi_steps::one_step_apply(&host, &ctx.runner, &wd, &inputs).await?;
    finish(ctx, run, &capsule, wd, &out, generation, None).await
}
