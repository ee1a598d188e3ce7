//! The plan step: claims a queued plan or destroy Run, checks the Capsule's source out
//! into a private directory, restores its current state behind a backend override,
//! downloads modules once (`get`), runs `init -get=false` and `plan -out`, counts the
//! changes from `show -json`, seals the plan file and the provider lockfile into object
//! storage (reading the lockfile back to prove it), records the dependency snapshot
//! (module tree digest plus lock digest), and commits the record together with the
//! gate's wake-up. It never applies anything.

use takosumi_core::{
    Changes, FailureCode, Outcome, RunKind, RunMessage, RunStatus, StepError, Topic,
};
use takosumi_objects::PutOutcome;
use takosumi_runner::{Masker, RunnerError, Tool, count_changes};
use takosumi_runtime::Ctx;
use takosumi_runtime::dependencies::{
    LockfileError, dependency_snapshot, installed_modules_digest,
};
use takosumi_runtime::step::{lockfile_key, object_err, plan_key, runner_err, store_err};
use takosumi_seal::Purpose;
use takosumi_store::{capsules, events, outbox, runs};

mod dry_run;

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
    if !matches!(
        run.kind,
        RunKind::Plan | RunKind::Destroy | RunKind::DriftCheck
    ) {
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
    // A Capsule that names a worker pool plans on that pool's relay workers (issue 8).
    if takosumi_store::pools::of_capsule(&ctx.pool, run.capsule_id)
        .await
        .map_err(store_err)?
        .is_some()
    {
        return Ok(Outcome::Skipped("the Capsule runs on a worker pool"));
    }
    // Claims whose handler vanished; a claim handed back after a transient fault (an
    // outage the handler rode out) does not count.
    let lost = runs::lost_claims(&ctx.pool, run_id)
        .await
        .map_err(store_err)?;
    if lost >= ctx.max_attempts {
        let mut tx = ctx.pool.begin().await.map_err(|e| store_err(e.into()))?;
        let msg = format!(
            "planning was attempted {lost} times without finishing; check the logs and plan again"
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
    ctx.record_claimed(
        &mut tx,
        run_id,
        serde_json::json!({ "step": "plan", "attempt": run.attempts + 1 }),
    )
    .await?;
    tx.commit().await.map_err(|e| store_err(e.into()))?;
    let attempt = run.attempts + 1;

    let lease = ctx.keep_lease(run_id);
    let cancel = lease.cancel_requested();
    let result = plan(
        // The tool's output is stored as it arrives, so the logs show a long plan.
        &ctx.interruptible(cancel.clone()).streaming_logs(run_id),
        &run,
        attempt,
        &lease.lost(),
    )
    .await;
    drop(lease);
    // A cancel request interrupted the tool (or came before the commit): end `canceled`.
    if cancel.is_cancelled() && !matches!(result, Ok(Outcome::Done)) {
        let detail = serde_json::json!({ "step": "plan" });
        return ctx.cancel_claimed(run_id, None, detail).await;
    }
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

    // A webhook-started plan checks out exactly the pushed (or pull request head) commit.
    let (source_ref, pinned_commit, _) = takosumi_store::detection::run_source(&ctx.pool, run_id)
        .await
        .map_err(store_err)?;
    let branch = source_ref.unwrap_or_else(|| capsule.branch.clone());
    ctx.event(
        run_id,
        "checkout_started",
        serde_json::json!({ "branch": branch, "commit": pinned_commit }),
    )
    .await;
    let source = ctx
        .runner
        .checkout(
            &wd,
            &capsule.repo,
            &branch,
            pinned_commit.as_deref(),
            &capsule.dir,
        )
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
    // Variables, sensitive variables and the Capsule's credentials, resolved now; every
    // secret is in the masker before any tool starts.
    let env = ctx.run_env(run_id, run, &capsule, &wd).await?;
    let tool_version = ctx
        .runner
        .version(tool, &env)
        .await
        .map_err(|e| tool_failure(e, "reading the tool version"))?;

    // Modules are downloaded once, here, into the private checkout (a committed
    // `.terraform` was removed by the checkout); init then resolves nothing again.
    // A configuration that calls no module has nothing to download: `get` is skipped
    // (one tool start less), and the apply skips it the same way, so the digests agree.
    if takosumi_runner::declares_module_calls(wd.config_dir()) {
        ctx.event(
            run_id,
            "tool_started",
            serde_json::json!({ "command": "get" }),
        )
        .await;
        let got = ctx.runner.get_modules(&wd, tool, &env).await;
        log_result(ctx, env.masker(), run, "get", &got).await;
        got.map_err(|e| tool_failure(e, "downloading modules failed"))?;
    }
    let modules_digest = installed_modules_digest(&wd)
        .await
        .map_err(|e| tool_failure(e, "reading the installed modules"))?;

    // The dry-run scan reads the configuration and every module `get` installed for data
    // sources that act when planned; its report is the plan's audit evidence, and a pull
    // request's plan that declares one (or cannot be read in full) is refused, not run.
    let modules_dir = wd.config_dir().join(".terraform").join("modules");
    let report = takosumi_policy::scan::scan_in_checkout(
        wd.checkout(),
        wd.config_dir(),
        modules_dir.is_dir().then_some(modules_dir.as_path()),
    );
    let report_json = report.to_json();
    takosumi_store::gates::set_scan_report(&ctx.pool, run_id, &report_json)
        .await
        .map_err(store_err)?;
    ctx.event(run_id, "dry_run_scan", report_json.clone()).await;
    let (_, _, speculative) = takosumi_store::detection::run_source(&ctx.pool, run_id)
        .await
        .map_err(store_err)?;
    if speculative && !report.is_clean() {
        let named: Vec<String> = report
            .findings
            .iter()
            .map(|f| f.address.clone())
            .chain(report.unreadable.iter().map(|u| u.what.clone()))
            .collect();
        return Err(PlanError::Fail(
            FailureCode::DryRunScanRefused,
            format!(
                "a pull request's plan is refused rather than run: {} may act when planned or could not be read; review it and plan it from the branch once merged",
                named.join(", ")
            ),
        ));
    }
    // exclude_dry_run: under the approval rule a plan plans freely only when the scan is
    // clean; otherwise it is held here, before init and plan run anything.
    if let Some(outcome) = dry_run::check(ctx, run, &report, &source.commit).await? {
        return Ok(outcome);
    }

    ctx.event(
        run_id,
        "tool_started",
        serde_json::json!({ "command": "init" }),
    )
    .await;
    let init = ctx.runner.init_without_get(&wd, tool, &env).await;
    log_result(ctx, env.masker(), run, "init", &init).await;
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
            let digest = takosumi_store::sha256_hex(bytes);
            // The plan succeeds only when the stored artifact reads back as exactly these
            // bytes: an object that was already there, or was altered, is caught here.
            match ctx.load_lockfile(run_id, Some(&key), &digest).await {
                Ok(_) => {}
                Err(LockfileError::Refused(code, message)) => {
                    return Err(PlanError::Fail(code, message));
                }
                Err(LockfileError::Step(e)) => return Err(e.into()),
            }
            (Some(digest), Some(key))
        }
    };

    ctx.event(
        run_id,
        "tool_started",
        serde_json::json!({
            "command": "plan",
            "destroy": run.kind == RunKind::Destroy,
            "detailedExitcode": run.kind == RunKind::DriftCheck,
        }),
    )
    .await;
    // A drift check asks the tool itself whether anything would change (exit code 2 of
    // `-detailed-exitcode`); `show -json` then says what.
    let mut tool_says_drift = None;
    let planned = if run.kind == RunKind::DriftCheck {
        ctx.runner
            .plan_detailed(&wd, tool, &env)
            .await
            .map(|(out, changes)| {
                tool_says_drift = Some(changes);
                out
            })
    } else {
        ctx.runner
            .plan(&wd, tool, &env, run.kind == RunKind::Destroy)
            .await
    };
    if planned.is_err() {
        log_result(ctx, env.masker(), run, "plan", &planned).await;
    }
    let planned = planned.map_err(|e| tool_failure(e, "plan failed"))?;
    let show = ctx.runner.show_json(&wd, tool, &env).await;
    // The plan printed before `show -json` could name its sensitive values: they join the
    // masker first, and the plan's output is stored after.
    if let Ok(show) = &show {
        env.masker().add_plan_sensitive(show);
    }
    ctx.log(run_id, "plan", env.masker(), &planned.output).await;
    let show = show.map_err(|e| tool_failure(e, "reading the saved plan"))?;
    let changes: Changes = count_changes(&show);
    // What a cost estimate needs, without a sensitive value (see takosumi_core::cost).
    let mut resources = serde_json::to_value(takosumi_core::cost::summarize(
        &show,
        takosumi_core::cost::Catalogue::embedded(),
    ))
    .map_err(StepError::internal)?;
    env.masker().mask_json(&mut resources);
    // The gate reads the saved plan's JSON, never printed text; it holds sensitive values,
    // so it is sealed like the plan file itself.
    let show_key = format!("runs/{run_id}/show.{attempt}.sealed");
    let show_bytes = serde_json::to_vec(&show).map_err(StepError::internal)?;
    let sealed_show = ctx
        .sealer
        .seal(Purpose::Plan, &format!("{run_id}:show"), &show_bytes)
        .map_err(StepError::internal)?;
    drop(show_bytes);
    ctx.objects
        .put_if_absent(&show_key, sealed_show)
        .await
        .map_err(object_err)?;

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
        // Keys are unique per claim, so the object is never trusted. It is most often this
        // put's own earlier try, whose answer was lost when the storage server went away
        // mid-request: a transient fault, so the plan is retried under a new claim (and
        // a new key) instead of failing the Run.
        return Err(StepError::Transient(
            format!("sealed plan for attempt {attempt} already exists").into(),
        )
        .into());
    }

    let dependency_snapshot = dependency_snapshot(&modules_digest, lock_digest.as_deref());

    if lost.is_cancelled() || ctx.runner.interrupted() {
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
        // A drift check reports drift when the tool's exit code says the plan changes
        // something; `show -json` (resource or output changes) must agree, and either one
        // saying so counts, so a disagreement can never hide drift.
        drift: tool_says_drift.map(|tool| tool || drift_found(&show)),
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
    takosumi_store::records::set_resource_changes(&mut tx, run_id, &resources)
        .await
        .map_err(store_err)?;
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
    takosumi_store::gates::set_plan_json_key(&mut tx, run_id, &show_key)
        .await
        .map_err(store_err)?;
    // A drift check replaces the plan an earlier check kept, and keeps its own only when it
    // found drift (that plan is what a reconcile carries out).
    let mut dropped = Vec::new();
    if run.kind == RunKind::DriftCheck {
        dropped = takosumi_store::detection::drop_kept_drift_plans(&mut tx, capsule.id, run_id)
            .await
            .map_err(store_err)?;
        if record.drift != Some(true) {
            runs::clear_plan_object(&mut tx, run_id)
                .await
                .map_err(store_err)?;
            dropped.push(record.plan_object_key.clone());
        }
    }
    outbox::enqueue(&mut tx, Topic::Gate, run_id)
        .await
        .map_err(store_err)?;
    tx.commit().await.map_err(|e| store_err(e.into()))?;
    ctx.relay_wake.notify_one();
    for key in dropped {
        if let Err(e) = ctx.objects.delete(&key).await {
            tracing::warn!(%run_id, error = %e, "could not delete a replaced drift plan; it stays sealed");
        }
    }
    wd.close().map_err(runner_err)?;
    Ok(Outcome::Done)
}

async fn log_result(
    ctx: &Ctx,
    masker: &Masker,
    run: &runs::Run,
    step: &str,
    result: &Result<takosumi_runner::ToolOutput, RunnerError>,
) {
    match result {
        Ok(out) => ctx.log(run.id, step, masker, &out.output).await,
        Err(RunnerError::ToolFailed { output, .. }) => ctx.log(run.id, step, masker, output).await,
        Err(_) => {}
    }
}

/// Whether a saved plan would change anything: a resource action other than no-op/read,
/// or an output change.
fn drift_found(show: &serde_json::Value) -> bool {
    let resources = show["resource_changes"].as_array().is_some_and(|rcs| {
        rcs.iter().any(|rc| {
            rc["change"]["actions"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|x| !matches!(x.as_str(), Some("no-op") | Some("read")))
            })
        })
    });
    let outputs = show["output_changes"].as_object().is_some_and(|o| {
        o.values().any(|c| {
            c["actions"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x.as_str() != Some("no-op")))
        })
    });
    resources || outputs
}
