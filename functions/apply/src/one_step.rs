//! The one-step apply: an apply no rule covers runs `apply -auto-approve`, which plans and
//! applies in one step with nothing saved in between (seed: "An apply that no rule covers
//! still runs apply -auto-approve"). There is no saved plan to pin, so nothing here is
//! compared with a plan: the branch head is checked out, the Capsule's current state is
//! restored (the claim took the Capsule at the generation it found), modules and providers
//! are installed by a plain `init`, and the Run records what ran (commit, tree, tool
//! version, lockfile digest) and that it ran in one step. A covered apply never comes here:
//! the gate releases a plan-less Apply Run only when no rule, approval request or agent
//! hold covers it, and it takes the pinned path otherwise.

use takosumi_core::{Outcome, StepError};
use takosumi_runner::{RunnerError, Tool};
use takosumi_runtime::Ctx;
use takosumi_runtime::step::{runner_err, store_err};
use takosumi_store::{apply_modes, capsules, runs};

use crate::{ApplyError, fail, finish, log_result, tool_failure};

pub(crate) async fn apply(ctx: &Ctx, run: &runs::Run) -> Result<Outcome, ApplyError> {
    let run_id = run.id;
    let capsule = capsules::get(&ctx.pool, run.capsule_id)
        .await
        .map_err(store_err)?
        .ok_or_else(|| StepError::Poison(format!("capsule of {run_id} is gone")))?;
    let tool: Tool = capsule
        .tool
        .parse()
        .map_err(|e| tool_failure(e, "the Capsule's tool"))?;
    // The claim pinned the Capsule's generation at that moment and took the Capsule.
    let Some(generation) = runs::get(&ctx.pool, run_id)
        .await
        .map_err(store_err)?
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
    ctx.event(
        run_id,
        "checkout_started",
        serde_json::json!({ "branch": capsule.branch, "oneStep": true }),
    )
    .await;
    let source = ctx
        .runner
        .checkout(&wd, &capsule.repo, &capsule.branch, None, &capsule.dir)
        .await
        .map_err(|e| tool_failure(e, "checking out the source failed"))?;
    ctx.event(
        run_id,
        "checked_out",
        serde_json::json!({ "commit": source.commit, "treeDigest": source.tree_digest }),
    )
    .await;
    let restored = ctx.restore_state(&wd, &capsule).await?;
    ctx.runner.write_backend_override(&wd).map_err(runner_err)?;
    let env = ctx.run_env(run_id, run, &capsule, &wd).await?;
    let tool_version = ctx
        .runner
        .version(tool, &env)
        .await
        .map_err(|e| tool_failure(e, "reading the tool version"))?;

    ctx.event(
        run_id,
        "tool_started",
        serde_json::json!({ "command": "init" }),
    )
    .await;
    let init = ctx.runner.init(&wd, tool, &env).await;
    log_result(ctx, env.masker(), run_id, "init", &init).await;
    init.map_err(|e| tool_failure(e, "init failed"))?;
    let lock_digest = match ctx.runner.read_lockfile(&wd) {
        Ok(l) => l.as_deref().map(takosumi_store::sha256_hex),
        Err(e @ RunnerError::LockfileTooLarge { .. }) => {
            return Err(fail(
                takosumi_core::FailureCode::LockfileTooLarge,
                e.to_string(),
            ));
        }
        Err(e) => return Err(runner_err(e).into()),
    };
    let names = env.names();
    let snapshot = apply_modes::OneStepSnapshot {
        commit: &source.commit,
        tree_digest: &source.tree_digest,
        tool_version: &tool_version,
        provider_lock_digest: lock_digest.as_deref(),
        injected_env_names: &names,
    };
    if !apply_modes::record_snapshot(&ctx.pool, run_id, &ctx.owner, &snapshot)
        .await
        .map_err(store_err)?
    {
        return Err(StepError::Internal("lease lost before the one-step apply".into()).into());
    }

    ctx.event(
        run_id,
        "tool_started",
        serde_json::json!({ "command": "apply", "oneStep": true, "autoApprove": true, "savedPlan": false }),
    )
    .await;
    let applied = ctx
        .runner
        .apply_auto_approve(&wd, tool, &env)
        .await
        .map_err(crate::apply_tool_err)?;
    ctx.log(run_id, "apply", env.masker(), &applied.output)
        .await;
    let out = takosumi_steps::ApplyOutput {
        applied,
        restored,
        env,
    };
    finish(ctx, run, &capsule, wd, tool, &out, generation, None).await
}
