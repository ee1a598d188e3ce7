//! The plan step: claims a queued plan or destroy Run, checks the Capsule's source out
//! into a private directory, restores its current state behind a backend override,
//! downloads modules once (`get`), runs `init -get=false` and `plan -out`, counts the
//! changes from `show -json`, seals the plan file and the provider lockfile into object
//! storage (reading the lockfile back to prove it), records the dependency snapshot
//! (module tree digest plus lock digest), and commits the record together with the
//! gate's wake-up. It never applies anything.

use takosumi_core::{
    EventKind, FailureCode, Outcome, RunId, RunKind, RunMessage, RunStatus, StepError,
};
use takosumi_policy::scan::ScanReport;
use takosumi_runner::{Masker, Runner, ToolEnv, Workdir};
use takosumi_runtime::Ctx;
use takosumi_runtime::dry_run::{self, DryRunDecision};
use takosumi_runtime::inputs::check_plan_source;
use takosumi_runtime::plan_commit::{
    self, Committed, PlanPut, PlanToCommit, SealedPlanFile, StoredLockfile, StoredPlan,
};
use takosumi_runtime::step::runner_err;
use takosumi_steps::{PlanInputs, Planned, ScanVerdict};
use takosumi_store::StoreError;
use takosumi_store::capsules::CapsuleOf;
use takosumi_store::runs::source::RunSource;
use takosumi_store::{capsules, events, runs};

/// The kinds of Run this step plans.
const PLAN_KINDS: &[RunKind] = &[RunKind::Plan, RunKind::Destroy, RunKind::DriftCheck];

/// Handles one `run.plan` wake-up. Safe to run twice: a second delivery finds the Run
/// claimed or planned and does nothing; one that arrives at the same moment may check the
/// source out beside the first, loses the claim and writes nothing.
pub async fn handle(ctx: &Ctx, msg: RunMessage) -> Result<Outcome, StepError> {
    let run_id = msg.run_id;
    // Everything the claim and the checkout need, read at once (each read stands alone):
    // the Run; its pre-claim check (claims whose handler vanished; a claim handed back after
    // a transient fault, an outage the handler rode out, does not count; whether its
    // Capsule is on a worker pool); its Capsule (one read gives a consistent
    // (generation, StateVersion) pair); and what it checks out.
    let (run, precheck, capsule, source) = tokio::try_join!(
        runs::get(&ctx.pool, run_id),
        runs::claim_precheck(&ctx.pool, run_id),
        capsules::get_of(&ctx.pool, CapsuleOf::Run(run_id)),
        runs::source::run_source(&ctx.pool, run_id),
    )?;
    let (Some(run), Some(precheck), Some(source)) = (run, precheck, source) else {
        return Err(StepError::Poison(format!("{run_id} does not exist")));
    };
    if !PLAN_KINDS.contains(&run.kind) {
        return Err(StepError::Poison(format!(
            "{run_id} is a {:?} run, not a plan",
            run.kind
        )));
    }
    if run.status != RunStatus::Queued {
        return Ok(Outcome::Skipped(
            "not queued: claimed elsewhere or already planned",
        ));
    }
    let runs::ClaimPrecheck {
        lost_claims: lost,
        on_pool,
    } = precheck;
    // A Capsule that names a worker pool plans on that pool's relay workers, never here.
    if on_pool {
        return Ok(Outcome::Skipped("the Capsule runs on a worker pool"));
    }
    if lost >= ctx.max_attempts {
        let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
        let msg = format!(
            "planning was attempted {lost} times without finishing; check the logs and plan again"
        );
        if runs::fail(&mut tx, run_id, None, FailureCode::AttemptsExhausted, &msg).await? {
            events::append(
                tx.db(),
                run_id,
                EventKind::Failed,
                "system:plan",
                serde_json::json!({ "code": "attempts_exhausted" }),
            )
            .await?;
        }
        tx.commit().await.map_err(StoreError::from)?;
        return Ok(Outcome::Failed(FailureCode::AttemptsExhausted));
    }

    let claim = Claim::start(ctx, run_id, run.attempts + 1);
    // Kept from before the claim is taken: the keeper first acts a second later, and is
    // stopped at once when the Run is not this handler's.
    let lease = ctx.keep_lease(run_id);
    let cancel = lease.cancel_requested();
    let result = plan(
        // The tool's output is stored as it arrives, so the logs show a long plan.
        &ctx.interruptible(cancel.clone()).streaming_logs(run_id),
        &run,
        capsule,
        source,
        &claim,
        &lease.lost(),
    )
    .await;
    drop(lease);
    // Planning that stopped before the pipeline waited for the claim (a source that cannot
    // be planned, a run directory that could not be made) waits for it now: its failure is
    // this handler's to record only on a Run it holds, as when the claim came first.
    let result = match result {
        Err(e) if !matches!(e, PlanError::NotClaimed) => match claim.held().await {
            Ok(false) => Err(PlanError::NotClaimed),
            _ => Err(e),
        },
        other => other,
    };
    // A cancel request interrupted the tool (or came before the commit): end `canceled`.
    if cancel.is_cancelled() && !matches!(result, Ok(Outcome::Done) | Err(PlanError::NotClaimed)) {
        let detail = serde_json::json!({ "step": "plan" });
        return ctx.cancel_claimed(run_id, None, detail).await;
    }
    match result {
        Ok(outcome) => Ok(outcome),
        Err(PlanError::Fail(code, message)) => ctx.fail_claimed(run_id, None, code, &message).await,
        Err(PlanError::NotClaimed) => Ok(Outcome::Skipped("claimed by another handler")),
        Err(PlanError::Step(e)) => {
            if e.retryable() {
                ctx.release_claim(run_id).await;
            } else {
                let _ = ctx
                    .fail_claimed(run_id, None, FailureCode::PlanFailed, "planning failed on our side; the operators have the details. Plan again later.")
                    .await;
            }
            Err(e)
        }
    }
}

enum PlanError {
    Fail(FailureCode, String),
    Step(StepError),
    /// Another handler claimed the Run (or it left `queued`) while this one checked it out.
    NotClaimed,
}

/// The plan's claim, made beside the checkout rather than before it: its round trip and
/// commit overlap git's sandbox start. It runs on a task of its own from the moment the
/// handler decides to plan (a process start holds the thread that makes it, which must
/// not hold the claim up); the pipeline waits for it before it reports or prepares
/// anything ([`takosumi_steps::Host::claimed`]). A checkout made for a Run another handler
/// claimed goes with its run directory, and nothing else of it is written.
struct Claim {
    /// The claim's attempt (object keys are per claim).
    attempt: i32,
    state: tokio::sync::Mutex<ClaimState>,
}

enum ClaimState {
    Running(tokio::task::JoinHandle<Result<bool, StoreError>>),
    Answered(bool),
    Failed,
}

impl Claim {
    /// Starts claiming the Run: `queued` → `planning`, with the lease and the `claimed`
    /// event (see [`runs::claim`]).
    fn start(ctx: &Ctx, run_id: RunId, attempt: i32) -> Self {
        let (pool, owner, lease_secs) = (ctx.pool.clone(), ctx.owner.clone(), ctx.lease_secs);
        let sandbox = ctx.runner.sandbox_mode();
        let task = tokio::spawn(async move {
            let data = serde_json::json!({ "step": "plan", "attempt": attempt });
            let record = runs::ClaimRecord {
                data: &data,
                sandbox: Some(sandbox),
            };
            runs::claim(
                &pool,
                run_id,
                PLAN_KINDS,
                (RunStatus::Queued, RunStatus::Planning),
                (&owner, lease_secs),
                record,
            )
            .await
        });
        Self {
            attempt,
            state: tokio::sync::Mutex::new(ClaimState::Running(task)),
        }
    }

    /// Waits for the claim's answer: `false` when another handler has the Run or it is no
    /// longer queued. A claim that failed answers its own error the first time and a
    /// retryable one after.
    async fn held(&self) -> Result<bool, StepError> {
        let mut state = self.state.lock().await;
        let answer = match &mut *state {
            ClaimState::Answered(held) => return Ok(*held),
            ClaimState::Failed => {
                return Err(StepError::Transient(
                    "the plan's claim failed; see the error before".into(),
                ));
            }
            ClaimState::Running(task) => task.await,
        };
        match answer {
            Ok(Ok(held)) => {
                *state = ClaimState::Answered(held);
                Ok(held)
            }
            Ok(Err(e)) => {
                *state = ClaimState::Failed;
                Err(e.into())
            }
            Err(e) => {
                *state = ClaimState::Failed;
                Err(StepError::internal(e))
            }
        }
    }
}

impl From<takosumi_runtime::inputs::EnvError> for PlanError {
    fn from(e: takosumi_runtime::inputs::EnvError) -> Self {
        match e {
            takosumi_runtime::inputs::EnvError::Fail(code, message) => Self::Fail(code, message),
            takosumi_runtime::inputs::EnvError::Step(e) => Self::Step(e),
        }
    }
}

impl From<StepError> for PlanError {
    fn from(e: StepError) -> Self {
        Self::Step(e)
    }
}

impl From<StoreError> for PlanError {
    fn from(e: StoreError) -> Self {
        Self::Step(e.into())
    }
}

impl From<takosumi_steps::PlanError<PlanError>> for PlanError {
    fn from(e: takosumi_steps::PlanError<PlanError>) -> Self {
        match e {
            takosumi_steps::PlanError::Fail(code, message) => Self::Fail(code, message),
            takosumi_steps::PlanError::Runner(e) => Self::Step(runner_err(e)),
            takosumi_steps::PlanError::Host(e) => e,
            // only an apply tool ends this way
            takosumi_steps::PlanError::AfterTool(message) => {
                Self::Fail(FailureCode::PlanFailed, message)
            }
        }
    }
}

/// The control node as the plan pipeline's host: inputs from Postgres and S3, progress
/// into the Run's events and log.
struct NodeHost<'a> {
    ctx: &'a Ctx,
    run: &'a runs::Run,
    capsule: &'a capsules::Capsule,
    /// What the Run checks out (its variables are settled from it).
    source: &'a RunSource,
    /// The claim, made beside the checkout.
    claim: &'a Claim,
    /// Set when the dry-run check held the Run (or found the lease lost).
    stopped: std::sync::Mutex<Option<Outcome>>,
    /// The lockfile as stored and read back, before the plan ran.
    lockfile: std::sync::Mutex<Option<StoredLockfile>>,
    /// The plan file as sealed before `show -json` ran, until stored.
    sealed: std::sync::Mutex<Option<SealedPlanFile>>,
    /// The plan file as sealed before `show -json` ran, and stored.
    plan: std::sync::Mutex<Option<StoredPlan>>,
}

/// What a pipeline callback left in `slot`, taken out.
fn take<T>(slot: &std::sync::Mutex<Option<T>>) -> Option<T> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

impl NodeHost<'_> {
    /// Deletes what the pipeline kept (lockfile, sealed plan) when it stopped before the
    /// commit: no record will reference them.
    async fn discard_kept(&self) {
        let plan = take(&self.plan).map(|p| p.key);
        let lockfile = take(&self.lockfile).map(|l| l.key);
        plan_commit::discard_unrecorded(
            self.ctx,
            self.run.id,
            [plan, lockfile].into_iter().flatten(),
        )
        .await;
    }
}

impl takosumi_steps::Host for NodeHost<'_> {
    type Error = PlanError;

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
    ) -> Result<Option<Vec<u8>>, PlanError> {
        Ok(self.ctx.restore_state(wd, self.capsule).await?)
    }

    async fn claimed(&self) -> Result<(), PlanError> {
        if self.claim.held().await? {
            Ok(())
        } else {
            Err(PlanError::NotClaimed)
        }
    }

    async fn tool_env(&self, wd: &Workdir) -> Result<ToolEnv, PlanError> {
        // Settled here, beside the checkout: nothing before the environment reads them.
        self.ctx
            .settle_plan_vars(self.run, self.capsule, self.source)
            .await?;
        // Variables, sensitive variables and the Capsule's credentials, resolved now;
        // every secret is in the masker before any tool starts.
        Ok(self
            .ctx
            .run_env(self.run.id, self.run, self.capsule, wd)
            .await?)
    }
}

impl takosumi_steps::PlanHost for NodeHost<'_> {
    async fn record_scan(&self, report: &serde_json::Value) -> Result<(), PlanError> {
        takosumi_store::runs::plan_record::set_scan_report_progress(
            &self.ctx.pool,
            self.run.id,
            report,
            &self.ctx.actor(),
        )
        .await?;
        Ok(())
    }

    async fn keep_lockfile(&self, lockfile: Option<&[u8]>) -> Result<(), PlanError> {
        if let Some(bytes) = lockfile {
            let stored =
                plan_commit::store_lockfile(self.ctx, self.run.id, self.claim.attempt, bytes)
                    .await?;
            *self
                .lockfile
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(stored);
        }
        Ok(())
    }

    async fn keep_plan_file(&self, wd: &Workdir, _size: u64) -> Result<(), PlanError> {
        // Any size: sealed from the file here, uploaded in parts beside `show` (only the
        // relay has a limit).
        let sealed = plan_commit::seal_plan_file(self.ctx, self.run.id, wd).await?;
        *self
            .sealed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(sealed);
        Ok(())
    }

    async fn store_kept_plan(&self) -> Result<(), PlanError> {
        let sealed = take(&self.sealed).ok_or_else(|| {
            StepError::Internal("the plan pipeline stored a plan file it did not keep".into())
        })?;
        let stored =
            plan_commit::put_sealed_plan(self.ctx, self.run.id, self.claim.attempt, sealed).await?;
        let plan = match stored {
            PlanPut::Stored(plan) => plan,
            // Most often this put's own earlier try, whose answer was lost when the storage
            // server went away mid-request: never trusted, retried under a new claim and key.
            PlanPut::AlreadyThere => {
                return Err(PlanError::Step(StepError::Transient(
                    format!(
                        "sealed plan for attempt {} already exists",
                        self.claim.attempt
                    )
                    .into(),
                )));
            }
        };
        *self
            .plan
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(plan);
        Ok(())
    }

    async fn after_scan(
        &self,
        report: &ScanReport,
        commit: &str,
    ) -> Result<ScanVerdict, PlanError> {
        let decided =
            dry_run::check(&self.ctx.pool, &self.ctx.owner, self.run, report, commit).await?;
        let stopped = match decided {
            DryRunDecision::Proceed => return Ok(ScanVerdict::Proceed),
            DryRunDecision::Held => Outcome::Done,
            DryRunDecision::LeaseLost => {
                Outcome::Skipped("lease lost before the hold; the reaper re-queued the run")
            }
        };
        *self
            .stopped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(stopped);
        Ok(ScanVerdict::Held)
    }
}

async fn plan(
    ctx: &Ctx,
    run: &runs::Run,
    capsule: Option<capsules::Capsule>,
    source: RunSource,
    claim: &Claim,
    lost: &tokio_util::sync::CancellationToken,
) -> Result<Outcome, PlanError> {
    let run_id = run.id;
    let capsule =
        capsule.ok_or_else(|| StepError::Poison(format!("capsule of {run_id} is gone")))?;
    let tool = capsule.tool;
    let wd = ctx
        .runner
        .workdir(&run_id.to_string())
        .map_err(runner_err)?;

    // A webhook-started plan checks out exactly the pushed (or pull request head) commit;
    // a drift check, the commit that was last applied.
    check_plan_source(&source)?;
    let inputs = PlanInputs {
        kind: run.kind,
        tool,
        repo: capsule.repo.clone(),
        branch: source
            .source_ref
            .clone()
            .unwrap_or_else(|| capsule.branch.clone()),
        commit: source.pinned_commit.clone(),
        dir: capsule.dir.clone(),
        speculative: source.speculative,
    };
    let host = NodeHost {
        ctx,
        run,
        capsule: &capsule,
        source: &source,
        claim,
        stopped: std::sync::Mutex::new(None),
        lockfile: std::sync::Mutex::new(None),
        sealed: std::sync::Mutex::new(None),
        plan: std::sync::Mutex::new(None),
    };
    let planned = match takosumi_steps::plan(&host, &ctx.runner, &wd, &inputs).await {
        Ok(planned) => planned,
        Err(e) => {
            host.discard_kept().await;
            return Err(e.into());
        }
    };
    let out = match planned {
        Planned::Held => {
            let stopped = take(&host.stopped);
            return Ok(stopped.unwrap_or(Outcome::Done));
        }
        Planned::Done(out) => *out,
    };
    // The plan file (sealed and stored) is wiped when the run directory goes, after the
    // commit: a wipe syncs to disk, which the Run's `planned` need not wait for.
    if lost.is_cancelled() || ctx.runner.interrupted() {
        host.discard_kept().await;
        return Ok(Outcome::Skipped(
            "lease lost while planning; the reaper re-queued the run",
        ));
    }
    let plan = take(&host.plan).ok_or_else(|| {
        StepError::Internal("the plan pipeline finished without keeping its plan file".into())
    })?;
    let lockfile = take(&host.lockfile);
    let committed = plan_commit::commit_plan(
        ctx,
        run,
        &ctx.owner,
        claim.attempt,
        PlanToCommit {
            source: out.source,
            tool_version: out.tool_version,
            modules_digest: out.modules_digest,
            lockfile,
            show: out.show,
            plan: Some(plan),
            tool_says_drift: out.tool_says_drift,
            injected_env_names: out.injected_env_names,
            masker: out.masker,
            event_extra: serde_json::Value::Null,
            // The Capsule row the state was restored from (NodeHost::restore_state).
            state_generation: Some(capsule.state_generation),
        },
    )
    .await?;
    if committed == Committed::LeaseLost {
        return Ok(Outcome::Skipped(
            "lease lost before commit; the reaper re-queued the run",
        ));
    }
    wd.close().map_err(runner_err)?;
    Ok(Outcome::Done)
}
