//! The apply step: claims a released Apply Run together with its Capsule, rechecks every
//! pin of the plan it carries out (the sealed plan opens under the plan Run's id and
//! hashes to `planDigest`; the same commit and tree; the same provider lockfile; the
//! same module tree, downloaded again and digested; the Capsule's state generation
//! unchanged), then runs exactly `apply <planfile>`, seals the
//! new state and moves the generation forward by one with a compare-and-set. The plan
//! file is wiped when the apply ends. An apply is never retried automatically once the
//! tool may have started.

use takosumi_core::{EventKind, FailureCode, Outcome, RunId, RunKind, RunMessage, StepError};
use takosumi_runner::{Masker, ToolEnv, Workdir};
use takosumi_runtime::Ctx;
use takosumi_runtime::apply_commit::{self, ApplyCommitError, ApplyToCommit, ToolEnd};
use takosumi_runtime::dependencies::LockfileError;
use takosumi_runtime::plan_commit::{self, PlanFetchError};
use takosumi_runtime::step::runner_err;
use takosumi_steps::ApplyEnd;
use takosumi_store::runs::ApplyClaim;
use takosumi_store::{capsules, runs};

mod one_step;

use takosumi_runtime::unrecorded::{self, Unrecorded};
use takosumi_store::StoreError;

/// Handles one `run.apply` wake-up. Safe to run twice: the claim lets one handler in;
/// a duplicate finds the Run applying or applied and does nothing.
pub async fn handle(ctx: &Ctx, msg: RunMessage) -> Result<Outcome, StepError> {
    let run_id = msg.run_id;
    // The Run and whether its Capsule is on a pool, in one round trip's time.
    let (run, precheck) = tokio::try_join!(
        runs::get(&ctx.pool, run_id),
        runs::claim_precheck(&ctx.pool, run_id)
    )?;
    let run = run.ok_or_else(|| StepError::Poison(format!("{run_id} does not exist")))?;
    if run.kind != RunKind::Apply {
        return Err(StepError::Poison(format!("{run_id} is not an apply run")));
    }
    // An Apply Run without a plan runs in one step: no rule covered it when it was
    // submitted and when the gate released it (see `one_step`).
    let plan_run_id = match run.plan_run_id {
        Some(p) => Some(p),
        None if run.apply_mode == Some(takosumi_core::ApplyMode::OneStep) => None,
        None => return Err(StepError::Poison(format!("{run_id} has no plan"))),
    };

    // A Capsule that names a worker pool applies on that pool's relay workers, never here.
    if precheck.is_some_and(|p| p.on_pool) {
        return Ok(Outcome::Skipped("the Capsule runs on a worker pool"));
    }
    let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
    if plan_run_id.is_none() {
        takosumi_store::runs::apply_mode::pin_current_generation(&mut tx, run_id).await?;
    }
    let claim = takosumi_runtime::step::claim_apply_recorded(
        &mut tx,
        run_id,
        &ctx.owner,
        ctx.lease_secs,
        serde_json::json!({ "step": "apply" }),
        Some(ctx.runner.sandbox_mode()),
    )
    .await?;
    tx.commit().await.map_err(StoreError::from)?;
    match claim {
        ApplyClaim::Claimed => {}
        ApplyClaim::GenerationChanged { .. } => {
            return Ok(Outcome::Failed(FailureCode::StateGenerationChanged));
        }
        // The running apply wakes the oldest waiting one when it ends.
        ApplyClaim::CapsuleBusy => return Ok(Outcome::Deferred("another apply holds the Capsule")),
        ApplyClaim::NotClaimable => return Ok(Outcome::Skipped("not a released, queued apply")),
        ApplyClaim::NeedsInspection { .. } => {
            return Ok(Outcome::Failed(FailureCode::CapsuleNeedsInspection));
        }
    }

    let lease = ctx.keep_lease(run_id);
    let cancel = lease.cancel_requested();
    // The tool's output is stored as it arrives, so the logs show a long apply.
    let step_ctx = ctx.interruptible(cancel.clone()).streaming_logs(run_id);
    let result = match plan_run_id {
        Some(plan_run_id) => apply(&step_ctx, &run, plan_run_id).await,
        None => one_step::apply(&step_ctx, &run).await,
    };
    drop(lease);
    // Canceled before the apply recorded a result (an interrupted init, a refused start):
    // end `canceled`. An interrupted apply tool records its state and ends in `apply`.
    if cancel.is_cancelled() && matches!(result, Err(ApplyError::Fail(..) | ApplyError::Step(_))) {
        let detail = serde_json::json!({ "step": "apply" });
        return ctx
            .cancel_claimed(run_id, Some(run.capsule_id), detail)
            .await;
    }
    match result {
        Ok(outcome) => Ok(outcome),
        Err(ApplyError::AfterTool(message)) => {
            unrecorded::end_unknown_outcome(ctx, &ctx.owner, run_id, run.capsule_id, &message).await
        }
        Err(ApplyError::Fail(code, message)) => {
            ctx.fail_claimed(run_id, Some(run.capsule_id), code, &message)
                .await
        }
        Err(ApplyError::Step(e)) => {
            // Before the tool starts nothing has changed, but an apply is never retried
            // behind a person's back: it fails and says to submit it again.
            let _ = ctx
                .fail_claimed(
                    run_id,
                    Some(run.capsule_id),
                    FailureCode::ApplyFailed,
                    "the apply could not be prepared (a storage or internal fault; nothing was applied); submit the apply again",
                )
                .await;
            Err(e)
        }
    }
}

enum ApplyError {
    Fail(FailureCode, String),
    Step(StepError),
    /// The tool ran (it may have changed infrastructure) but its result could not be
    /// recorded: the apply ends `unknown_outcome` with this message, never `failed`.
    AfterTool(String),
}

impl From<Unrecorded> for ApplyError {
    fn from(Unrecorded(message): Unrecorded) -> Self {
        Self::AfterTool(message)
    }
}

impl From<takosumi_runtime::inputs::EnvError> for ApplyError {
    fn from(e: takosumi_runtime::inputs::EnvError) -> Self {
        match e {
            takosumi_runtime::inputs::EnvError::Fail(code, message) => Self::Fail(code, message),
            takosumi_runtime::inputs::EnvError::Step(e) => Self::Step(e),
        }
    }
}

impl From<StepError> for ApplyError {
    fn from(e: StepError) -> Self {
        Self::Step(e)
    }
}

impl From<StoreError> for ApplyError {
    fn from(e: StoreError) -> Self {
        Self::Step(e.into())
    }
}

fn fail(code: FailureCode, message: impl Into<String>) -> ApplyError {
    ApplyError::Fail(code, message.into())
}

async fn apply(ctx: &Ctx, run: &runs::Run, plan_run_id: RunId) -> Result<Outcome, ApplyError> {
    let run_id = run.id;
    // The plan, its sealed JSON's key and the Capsule, in one round trip's time.
    let (plan_run, plan_fields, capsule) = tokio::try_join!(
        runs::get(&ctx.pool, plan_run_id),
        runs::hold::gate_fields(&ctx.pool, plan_run_id),
        capsules::get(&ctx.pool, run.capsule_id),
    )?;
    let plan_run =
        plan_run.ok_or_else(|| StepError::Poison(format!("plan {plan_run_id} is gone")))?;
    let capsule =
        capsule.ok_or_else(|| StepError::Poison(format!("capsule of {run_id} is gone")))?;
    let tool = capsule.tool;
    let (Some(plan_digest), Some(commit), Some(tree_digest), Some(generation)) = (
        plan_run.plan_digest.as_deref(),
        plan_run.source_commit.as_deref(),
        plan_run.tree_digest.as_deref(),
        plan_run.state_generation,
    ) else {
        return Err(fail(
            FailureCode::StalePlan,
            "the plan Run has no complete record; plan again",
        ));
    };

    // Pin 1 is checked when the pipeline places the plan (NodeApplyHost::place_plan).
    let Some(plan_key) = plan_run.plan_object_key.as_deref() else {
        return Err(fail(
            FailureCode::StalePlan,
            "the saved plan was already used or wiped; plan again and apply the new plan",
        ));
    };
    let wd = ctx
        .runner
        .workdir(&run_id.to_string())
        .map_err(runner_err)?;

    // Pins 1–6 and the tool: the pipeline both hosts run (takosumi_steps::apply).
    let host = NodeApplyHost {
        ctx,
        run_id,
        capsule: &capsule,
        plan_run: &plan_run,
        generation,
        plan_key,
        plan_json_key: plan_fields.and_then(|f| f.plan_json_object_key),
        plan_digest,
    };
    let inputs = takosumi_steps::ApplyInputs {
        tool,
        repo: capsule.repo.clone(),
        branch: capsule.branch.clone(),
        commit: commit.to_owned(),
        tree_digest: tree_digest.to_owned(),
        dir: capsule.dir.clone(),
        dependency_snapshot: plan_run.dependency_snapshot.clone(),
        plan_kind: plan_run.kind,
        plan_digest: plan_digest.to_owned(),
    };
    let out = takosumi_steps::apply(&host, &ctx.runner, &wd, inputs).await?;
    finish(ctx, run, &capsule, wd, &out, generation, Some(plan_run_id)).await
}

impl From<takosumi_steps::PlanError<ApplyError>> for ApplyError {
    fn from(e: takosumi_steps::PlanError<ApplyError>) -> Self {
        match e {
            takosumi_steps::PlanError::Fail(code, message) => Self::Fail(code, message),
            takosumi_steps::PlanError::Runner(e) => Self::Step(runner_err(e)),
            takosumi_steps::PlanError::Host(e) => e,
            takosumi_steps::PlanError::AfterTool(message) => Self::AfterTool(message),
        }
    }
}

/// The control node as the pinned apply's host.
struct NodeApplyHost<'a> {
    ctx: &'a Ctx,
    run_id: RunId,
    capsule: &'a capsules::Capsule,
    plan_run: &'a runs::Run,
    /// The generation the plan saw (the claim checked it).
    generation: i64,
    /// The plan Run's sealed plan, wiped once the tool ran.
    plan_key: &'a str,
    /// The plan Run's sealed `show -json` (none: an older plan's, or none kept), read
    /// before the tool runs and wiped with the plan.
    plan_json_key: Option<String>,
    /// The reviewed plan's digest.
    plan_digest: &'a str,
}

impl takosumi_steps::Host for NodeApplyHost<'_> {
    type Error = ApplyError;

    async fn event(&self, kind: EventKind, data: serde_json::Value) {
        self.ctx.event(self.run_id, kind, data).await;
    }

    async fn log(&self, step: &'static str, masker: &Masker, text: &str) {
        self.ctx.log(self.run_id, step, masker, text).await;
    }

    async fn restore_state(
        &self,
        _runner: &takosumi_runner::Runner,
        wd: &Workdir,
    ) -> Result<Option<Vec<u8>>, ApplyError> {
        // Pin 3: the state the plan saw (the claim checked the generation; restore it).
        let restored = self.ctx.restore_state(wd, self.capsule).await?;
        if self.capsule.state_generation != self.generation {
            return Err(fail(
                FailureCode::StateGenerationChanged,
                format!(
                    "the Capsule's state moved on since the plan; nothing was applied; {}",
                    takosumi_core::stale_plan_advice(self.plan_run.kind)
                ),
            ));
        }
        Ok(restored)
    }

    async fn tool_env(&self, wd: &Workdir) -> Result<ToolEnv, ApplyError> {
        // The plan's variables and sensitive variables, and the Capsule's credentials
        // resolved fresh for this apply; every secret is in the masker before a tool starts.
        Ok(self
            .ctx
            .run_env(self.run_id, self.plan_run, self.capsule, wd)
            .await?)
    }
}

impl takosumi_steps::ApplyHost for NodeApplyHost<'_> {
    async fn place_plan(&self, wd: &Workdir) -> Result<(), ApplyError> {
        // Pin 1: the sealed plan opens under the plan Run's id and hashes to planDigest.
        // Streamed from storage into the run directory: memory stays bounded whatever the
        // plan's size.
        let (plan_run_id, digest) = (self.plan_run.id, self.plan_digest);
        let fetched =
            plan_commit::fetch_plan_file(self.ctx, plan_run_id, self.plan_key, digest, wd).await;
        let refused = match fetched {
            Ok(()) => None,
            Err(PlanFetchError::Missing) => {
                Some("the sealed plan file is missing from storage; plan again")
            }
            Err(PlanFetchError::UnknownKey) => {
                Some("the sealed plan was sealed with a key this server does not hold; plan again")
            }
            Err(PlanFetchError::DoesNotOpen) => Some(
                "the sealed plan file does not open for this plan (altered, or moved from another run); nothing was applied; plan again",
            ),
            Err(PlanFetchError::DigestMismatch) => Some(
                "the saved plan does not match the digest that was reviewed; nothing was applied; plan again",
            ),
            Err(PlanFetchError::Step(e)) => return Err(e.into()),
        };
        if let Some(message) = refused {
            return Err(fail(FailureCode::PlanDigestMismatch, message));
        }
        self.ctx
            .event(
                self.run_id,
                EventKind::PinChecked,
                serde_json::json!({ "pin": "planDigest", "planDigest": digest }),
            )
            .await;
        Ok(())
    }

    async fn install_lockfile(&self, wd: &Workdir) -> Result<Option<String>, ApplyError> {
        // Pin 4: the provider lockfile the plan recorded, installed before init.
        install_lockfile(self.ctx, wd, self.plan_run).await
    }

    async fn plan_show(&self) -> Option<serde_json::Value> {
        // Sealed with the server key beside the plan file, by the same plan step: what
        // `show -json` of the verified plan file would print. Unreadable, the tool is asked.
        let Some(key) = self.plan_json_key.as_deref() else {
            tracing::warn!(run_id = %self.run_id, "the plan kept no sealed JSON; running show -json instead");
            return None;
        };
        match plan_commit::read_plan_json_at(self.ctx, self.plan_run.id, key).await {
            Ok(show) => Some(show),
            Err(e) => {
                tracing::warn!(run_id = %self.run_id, error = %e, "the plan's sealed JSON is unreadable; running show -json instead");
                None
            }
        }
    }

    async fn after_tool(&self) {
        let json = self.plan_json_key.as_deref();
        unrecorded::wipe_sealed_plan(self.ctx, self.plan_run.id, self.plan_key, json).await;
    }
}

/// Commits what an apply did, whichever path it took: a new StateVersion (generation
/// compare-and-set) when the tool changed the state, even if it failed, then the Run's
/// result and the next waiting apply's wake-up, in one transaction. A pinned apply's plan
/// (`plan_run_id`) forgets its sealed plan and sensitive variables in the same commit.
///
/// The tool has run by now, so any fault here ends the apply `unknown_outcome`
/// ([`ApplyError::AfterTool`]), never `failed` with "nothing was applied".
#[allow(clippy::too_many_arguments)]
async fn finish(
    ctx: &Ctx,
    run: &runs::Run,
    capsule: &capsules::Capsule,
    wd: Workdir,
    out: &takosumi_steps::ApplyOutput,
    generation: i64,
    plan_run_id: Option<RunId>,
) -> Result<Outcome, ApplyError> {
    let recorded = record_result(ctx, run, capsule, wd, out, generation, plan_run_id).await;
    recorded.map_err(|e| match e {
        ApplyError::AfterTool(message) => ApplyError::AfterTool(message),
        ApplyError::Fail(_, message) => ApplyError::AfterTool(format!(
            "the tool ran, but its result could not be recorded: {message}. Inspect the provider side \
             and the Capsule's current StateVersion, then resolve this Run"
        )),
        ApplyError::Step(e) => ApplyError::AfterTool(format!(
            "the tool ran, but its result could not be recorded ({e}). Inspect the provider side \
             and the Capsule's current StateVersion, then resolve this Run"
        )),
    })
}

#[allow(clippy::too_many_arguments)]
async fn record_result(
    ctx: &Ctx,
    run: &runs::Run,
    capsule: &capsules::Capsule,
    wd: Workdir,
    out: &takosumi_steps::ApplyOutput,
    generation: i64,
    plan_run_id: Option<RunId>,
) -> Result<Outcome, ApplyError> {
    let run_id = run.id;
    // The state the tool wrote is read (and sealed) before anything else can fail: a failed
    // apply, or one whose outputs cannot be read, still records what it committed.
    let (changed_state, end) =
        takosumi_steps::read_apply_result(&ctx.runner, &wd, out).map_err(runner_err)?;
    let sv = match &changed_state {
        Some(bytes) => Some(
            unrecorded::seal_and_store_state(
                ctx, &ctx.owner, capsule.id, run_id, generation, bytes,
            )
            .await?,
        ),
        None => None,
    };
    let (end, outcome) = match end {
        ApplyEnd::Applied { outputs } => (ToolEnd::Applied { outputs }, Outcome::Done),
        // A canceled apply commits its (canceled) result: that is done, not a failure.
        ApplyEnd::Failed { exit_code } if ctx.runner.interrupted() => (
            ToolEnd::Canceled {
                detail: serde_json::json!({ "step": "apply", "exitCode": exit_code }),
            },
            Outcome::Done,
        ),
        ApplyEnd::Failed { exit_code } => (
            ToolEnd::Failed { exit_code },
            Outcome::Failed(FailureCode::ApplyFailed),
        ),
        ApplyEnd::OutputsUnreadable { message } => (
            ToolEnd::AfterApplyFailed { message },
            Outcome::Failed(FailureCode::AfterApplyFailed),
        ),
    };
    apply_commit::commit_apply(
        ctx,
        ApplyToCommit {
            run,
            owner: &ctx.owner,
            capsule_id: capsule.id,
            generation,
            plan_run_id,
            state_version: sv,
            end,
            event_extra: serde_json::Value::Null,
        },
    )
    .await
    .map_err(|e| match e {
        ApplyCommitError::Step(e) => ApplyError::Step(e),
        other => ApplyError::Step(StepError::Internal(other.to_string().into())),
    })?;
    wd.close().map_err(runner_err)?;
    Ok(outcome)
}

/// Puts the plan's recorded lockfile in place before init; returns its digest (`None`
/// for a provider-free plan).
async fn install_lockfile(
    ctx: &Ctx,
    wd: &Workdir,
    plan_run: &runs::Run,
) -> Result<Option<String>, ApplyError> {
    match ctx.planned_lockfile(plan_run).await {
        Ok(None) => Ok(None),
        Ok(Some((bytes, digest))) => {
            std::fs::write(wd.config_dir().join(".terraform.lock.hcl"), &bytes)
                .map_err(StepError::internal)?;
            Ok(Some(digest))
        }
        Err(LockfileError::Refused(code, message)) => Err(fail(code, message)),
        Err(LockfileError::Step(e)) => Err(e.into()),
    }
}
