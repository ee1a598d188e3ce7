//! The plan step: claims a queued plan or destroy Run, checks the Capsule's source out
//! into a private directory, restores its current state behind a backend override, runs
//! `init` and `plan -out`, counts the changes from `show -json`, seals the plan file and
//! the provider lockfile into object storage, and commits the record together with the
//! gate's wake-up. It never applies anything.

use takosumi_core::{
    Changes, FailureCode, Outcome, RunKind, RunMessage, RunStatus, StepError, Topic,
};
use takosumi_objects::PutOutcome;
use takosumi_runner::{RunnerError, Tool, ToolEnv, count_changes};
use takosumi_runtime::Ctx;
use takosumi_runtime::step::{lockfile_key, object_err, plan_key, runner_err, store_err};
use takosumi_seal::Purpose;
use takosumi_store::{capsules, events, outbox, runs};

/// The largest plan file that may be relayed (DESIGN §3).
pub const MAX_PLAN_BYTES: u64 = 19 * 1024 * 1024;

/// Handles one `run.plan` wake-up. Safe to run twice: a second delivery finds the Run
/// claimed or planned and does nothing.
pub async fn handle(ctx: &Ctx, msg: RunMessage) -> Result<Outcome, StepError> {
    let run_id = msg.run_id;
    let run = runs::get(&ctx.pool, run_id)
        .await
        .map_err(store_err)?
        .ok_or_else(|| StepError::Poison(format!("{run_id} does not exist")))?;
    if !matches!(run.kind, RunKind::Plan | RunKind::Destroy) {
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
    if run.attempts >= ctx.max_attempts {
        let mut tx = ctx.pool.begin().await.map_err(|e| store_err(e.into()))?;
        let msg = format!(
            "planning was attempted {} times without finishing; check the logs and plan again",
            run.attempts
        );
        if runs::fail(&mut tx, run_id, None, FailureCode::AttemptsExhausted, &msg)
            .await
            .map_err(store_err)?
        {
            events::append(
                &mut *tx,
                run_id,
                "failed",
                "system:plan",
                serde_json::json!({ "code": "attempts_exhausted" }),
            )
            .await
            .map_err(store_err)?;
        }
        tx.commit().await.map_err(|e| store_err(e.into()))?;
        return Ok(Outcome::Failed(FailureCode::AttemptsExhausted));
    }

    let mut tx = ctx.pool.begin().await.map_err(|e| store_err(e.into()))?;
    if !runs::claim(
        &mut tx,
        run_id,
        RunStatus::Queued,
        RunStatus::Planning,
        &ctx.owner,
        ctx.lease_secs,
    )
    .await
    .map_err(store_err)?
    {
        return Ok(Outcome::Skipped("claimed by another handler"));
    }
    let actor = format!("handler:{}", ctx.owner);
    events::append(
        &mut *tx,
        run_id,
        "claimed",
        &actor,
        serde_json::json!({ "step": "plan", "attempt": run.attempts + 1 }),
    )
    .await
    .map_err(store_err)?;
    tx.commit().await.map_err(|e| store_err(e.into()))?;
    let attempt = run.attempts + 1;

    let lease = ctx.keep_lease(run_id);
    let result = plan(ctx, &run, attempt, &lease.lost()).await;
    drop(lease);
    match result {
        Ok(outcome) => Ok(outcome),
        Err(PlanError::Fail(code, message)) => ctx.fail_claimed(run_id, None, code, &message).await,
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
}

impl From<StepError> for PlanError {
    fn from(e: StepError) -> Self {
        Self::Step(e)
    }
}

fn tool_failure(e: RunnerError, what: &str) -> PlanError {
    match e.failure_code() {
        Some(code) => PlanError::Fail(code, format!("{what}: {e}; see the run's logs")),
        None => PlanError::Step(runner_err(e)),
    }
}

async fn plan(
    ctx: &Ctx,
    run: &runs::Run,
    attempt: i32,
    lost: &tokio_util::sync::CancellationToken,
) -> Result<Outcome, PlanError> {
    let run_id = run.id;
    // One read gives a consistent (generation, StateVersion) pair.
    let capsule = capsules::get(&ctx.pool, run.capsule_id)
        .await
        .map_err(store_err)?
        .ok_or_else(|| StepError::Poison(format!("capsule of {run_id} is gone")))?;
    let tool: Tool = capsule
        .tool
        .parse()
        .map_err(|e| tool_failure(e, "the Capsule's tool"))?;
    let wd = ctx
        .runner
        .workdir(&run_id.to_string())
        .map_err(runner_err)?;

    ctx.event(
        run_id,
        "checkout_started",
        serde_json::json!({ "branch": capsule.branch }),
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

    ctx.restore_state(&wd, &capsule).await?;
    ctx.runner.write_backend_override(&wd).map_err(runner_err)?;
    let vars = capsule.vars.as_object().cloned().unwrap_or_default();
    let env = ToolEnv::new()
        .with_variables(&vars)
        .map_err(|e| tool_failure(e, "a Capsule variable"))?;
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
    log_result(ctx, run, "init", &init).await;
    init.map_err(|e| tool_failure(e, "init failed"))?;

    // Lockfile continuity: the raw bytes right after init, or an explicit null.
    let lockfile = match ctx.runner.read_lockfile(&wd) {
        Ok(l) => l,
        Err(e @ RunnerError::LockfileTooLarge { .. }) => {
            return Err(PlanError::Fail(
                FailureCode::LockfileTooLarge,
                e.to_string(),
            ));
        }
        Err(e) => return Err(runner_err(e).into()),
    };
    let (lock_digest, lock_key) = match &lockfile {
        None => (None, None),
        Some(bytes) => {
            let key = lockfile_key(run_id, attempt);
            let sealed = ctx
                .sealer
                .seal(Purpose::Lockfile, &run_id.to_string(), bytes)
                .map_err(StepError::internal)?;
            ctx.objects
                .put_if_absent(&key, sealed)
                .await
                .map_err(object_err)?;
            (Some(takosumi_store::sha256_hex(bytes)), Some(key))
        }
    };

    ctx.event(
        run_id,
        "tool_started",
        serde_json::json!({ "command": "plan", "destroy": run.kind == RunKind::Destroy }),
    )
    .await;
    let planned = ctx
        .runner
        .plan(&wd, tool, &env, run.kind == RunKind::Destroy)
        .await;
    log_result(ctx, run, "plan", &planned).await;
    planned.map_err(|e| tool_failure(e, "plan failed"))?;

    let show = ctx
        .runner
        .show_json(&wd, tool, &env)
        .await
        .map_err(|e| tool_failure(e, "reading the saved plan"))?;
    let changes: Changes = count_changes(&show);

    let plan_bytes = ctx.runner.read_plan_file(&wd).map_err(runner_err)?;
    let size = plan_bytes.len() as u64;
    if size > MAX_PLAN_BYTES {
        return Err(PlanError::Fail(
            FailureCode::PlanTooLarge,
            format!(
                "the saved plan is {size} bytes, over the {MAX_PLAN_BYTES}-byte (19 MiB) limit; split the configuration or run it on a queue the control node executes"
            ),
        ));
    }
    let plan_digest = takosumi_store::sha256_hex(&plan_bytes);
    let key = plan_key(run_id, attempt);
    let sealed = ctx
        .sealer
        .seal(Purpose::Plan, &run_id.to_string(), &plan_bytes)
        .map_err(StepError::internal)?;
    drop(plan_bytes);
    if ctx
        .objects
        .put_if_absent(&key, sealed)
        .await
        .map_err(object_err)?
        == PutOutcome::AlreadyExists
    {
        // Keys are unique per claim, so this is another writer's object: never trust it.
        return Err(StepError::Internal(
            format!("sealed plan for attempt {attempt} already exists").into(),
        )
        .into());
    }

    let modules = wd.config_dir().join(".terraform").join("modules");
    let modules_digest = if modules.is_dir() {
        takosumi_runner::tree_digest(&modules).map_err(runner_err)?
    } else {
        takosumi_store::sha256_hex(b"")
    };
    let dependency_snapshot = takosumi_store::sha256_hex(
        format!(
            "modules:{modules_digest}\nlock:{}",
            lock_digest.as_deref().unwrap_or("null")
        )
        .as_bytes(),
    );

    if lost.is_cancelled() {
        return Ok(Outcome::Skipped(
            "lease lost while planning; the reaper re-queued the run",
        ));
    }
    let record = runs::PlanRecord {
        source_commit: source.commit.clone(),
        tree_digest: source.tree_digest.clone(),
        tool_version,
        plan_digest: plan_digest.clone(),
        plan_object_key: key,
        lockfile_object_key: lock_key,
        provider_lock_digest: lock_digest,
        dependency_snapshot,
        state_generation: capsule.state_generation,
        changes,
        drift: None,
        injected_env_names: env.names(),
    };
    let mut tx = ctx.pool.begin().await.map_err(|e| store_err(e.into()))?;
    if !runs::record_plan(&mut tx, run_id, &ctx.owner, &record)
        .await
        .map_err(store_err)?
    {
        return Ok(Outcome::Skipped(
            "lease lost before commit; the reaper re-queued the run",
        ));
    }
    let actor = format!("handler:{}", ctx.owner);
    events::append(
        &mut *tx,
        run_id,
        "planned",
        &actor,
        serde_json::json!({ "changes": changes, "planDigest": plan_digest, "stateGeneration": capsule.state_generation }),
    )
    .await
    .map_err(store_err)?;
    outbox::enqueue(&mut tx, Topic::Gate, run_id)
        .await
        .map_err(store_err)?;
    tx.commit().await.map_err(|e| store_err(e.into()))?;
    ctx.relay_wake.notify_one();
    wd.close().map_err(runner_err)?;
    Ok(Outcome::Done)
}

async fn log_result(
    ctx: &Ctx,
    run: &runs::Run,
    step: &str,
    result: &Result<takosumi_runner::ToolOutput, RunnerError>,
) {
    match result {
        Ok(out) => ctx.log(run.id, step, &out.output).await,
        Err(RunnerError::ToolFailed { output, .. }) => ctx.log(run.id, step, output).await,
        Err(_) => {}
    }
}
