//! What a worker reports while and after it runs a job: progress (masked logs and
//! events, the lease renewed), the saved plan file, the plan's record, the applied state,
//! a failure with one of the tool's codes, or a requested cancel carried out.

use super::*;

/// A masker holding every secret value the Run's job carries (its credentials and
/// sensitive variables; for an apply, those of the plan it carries out).
pub(super) async fn run_masker(
    st: &AppState,
    run: &runs::Run,
) -> Result<takosumi_runner::Masker, ApiError> {
    let masker = takosumi_runner::Masker::new();
    let inputs_of = match (run.kind, run.plan_run_id) {
        (takosumi_core::RunKind::Apply, Some(plan)) => runs::get(&st.pool, plan)
            .await?
            .ok_or_else(|| ApiError::not_found(&format!("Run {plan}")))?,
        _ => run.clone(),
    };
    if let Some(mut plain) = secret_inputs(st, &inputs_of, run.capsule_id).await?.secrets {
        let parsed: Result<Value, _> = serde_json::from_slice(&plain);
        plain.zeroize();
        let mut stack = vec![parsed.map_err(internal)?];
        while let Some(v) = stack.pop() {
            match v {
                Value::String(text) if !text.is_empty() => masker.add(&text),
                Value::Array(items) => stack.extend(items),
                Value::Object(map) => stack.extend(map.into_iter().map(|(_, v)| v)),
                _ => {}
            }
        }
    }
    Ok(masker)
}

pub(super) async fn progress(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: ProgressReport = if body.iter().all(u8::is_ascii_whitespace) {
        ProgressReport::default()
    } else {
        crate::extract::parse_worker_body(&body)?
    };
    let actor = format!("handler:{claim}");
    // Only progress a worker may report: what it decided or what the control node
    // records (`approved`, `applied`, `state_version_written`, `gate_decision`, …) is
    // never taken from a worker. The whole request is refused before anything is stored.
    let mut reported = Vec::with_capacity(req.events.len());
    for e in &req.events {
        match e.kind.parse::<EventKind>() {
            // A NUL in the data (a tool's output quoted) is stored as U+FFFD, as the control
            // node's events are (takosumi_core::nul).
            Ok(kind) if kind.reported_by_worker() => reported.push((kind, &e.data)),
            _ => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidEvent,
                    format!(
                        "a worker may report only the event kinds {}; {:?} is not one of them",
                        WORKER_EVENT_KINDS
                            .iter()
                            .map(|k| k.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        e.kind.chars().take(64).collect::<String>()
                    ),
                ));
            }
        }
    }
    let logs: Vec<(&str, String)> = if req.logs.is_empty() {
        Vec::new()
    } else {
        // The worker masked it with the run's secrets before sending; the control node
        // masks it again with the same secrets before storing, so a worker that did not
        // (an old or broken one) cannot put a credential into a stored log.
        let masker = run_masker(&st, &run).await?;
        req.logs
            .iter()
            .map(|l| (l.step.as_str(), masker.mask(&l.text)))
            .collect()
    };
    // All of it or nothing, and a numbered report once (a repeat is answered like the
    // first: the worker only needs to know it arrived).
    runs::progress::record(
        &st.pool,
        run.id,
        &claim,
        &actor,
        runs::progress::Report {
            seq: req.seq,
            events: &reported,
            logs: &logs,
        },
    )
    .await?;
    let renewed = runs::renew_lease(&st.pool, run.id, &claim, RELAY_LEASE_SECS).await?;
    let cancel = takosumi_store::runs::cancel::cancel_requested(&st.pool, run.id, &claim).await?;
    Ok(Json(ProgressAnswer {
        lease_renewed: renewed,
        cancel_requested: cancel,
    }))
}

pub(super) async fn plan_file(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    if !run.kind.is_plan_like() || run.status != RunStatus::Planning {
        return Err(ApiError::conflict(
            ErrorCode::NotPlanning,
            format!("{} is not planning", run.id),
        ));
    }
    // A worker that measured an oversized plan says so without sending it.
    let declared: u64 = headers
        .get("x-takosumi-plan-size")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let size = declared.max(body.len() as u64);
    if size > MAX_RELAY_PLAN_BYTES {
        let mib = MAX_RELAY_PLAN_BYTES / (1024 * 1024);
        let message = if run.kind == RunKind::DriftCheck {
            format!(
                "the drift check's saved plan is {size} bytes, over the {MAX_RELAY_PLAN_BYTES}-byte ({mib} MiB) limit of a plan file crossing the relay; the check keeps no plan, so a reconcile cannot be proposed from it. Run it on a queue the control node executes (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}}) or split the configuration"
            )
        } else {
            format!(
                "the saved plan is {size} bytes, over the {MAX_RELAY_PLAN_BYTES}-byte ({mib} MiB) limit of a plan file crossing the relay; no apply can be proposed from it. Run it on a queue the control node executes (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}}) or split the configuration"
            )
        };
        end_failed(&st, run.id, &claim, FailureCode::PlanTooLarge, &message).await?;
        return Err(ApiError::client(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::PlanTooLarge,
            message,
        ));
    }
    if body.is_empty() {
        return Err(ApiError::invalid_json(
            "send the saved plan file as the body",
        ));
    }
    // One object per claim: a second upload in the same claim replaces nothing.
    let stored =
        takosumi_runtime::plan_commit::store_plan_file(&st.ctx, run.id, run.attempts, &body).await;
    drop(body);
    let digest = match stored.map_err(|e| ApiError::Internal {
        transient: e.retryable(),
        source: Box::new(e),
    })? {
        PlanPut::Stored(plan) => plan.digest,
        PlanPut::AlreadyThere => {
            return Err(ApiError::conflict(
                ErrorCode::PlanFileExists,
                "the plan file of this claim was already uploaded",
            ));
        }
    };
    Ok(Json(json!({ "planDigest": digest, "size": size })))
}

/// Why an oversized relayed drift check kept no plan (its `planned` event, and the 409 a
/// reconcile from it gets).
pub(super) fn drift_plan_not_kept(size: u64) -> String {
    let mib = MAX_RELAY_PLAN_BYTES / (1024 * 1024);
    format!(
        "the drift check's saved plan is {size} bytes, over the {MAX_RELAY_PLAN_BYTES}-byte ({mib} MiB) limit of a plan file crossing the relay; the check reports its drift but keeps no plan, so a reconcile cannot be proposed from it. Run the check on a queue the control node executes (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}}) and reconcile from that check, or split the configuration"
    )
}

/// Ends a claimed relayed Run the way an [`EnvError`] says: a failure code fails it (and
/// the worker is told so), a fault is ours.
pub(super) async fn env_error(st: &AppState, run_id: RunId, claim: &str, e: EnvError) -> ApiError {
    match e {
        EnvError::Fail(code, message) => {
            if let Err(e) = end_failed(st, run_id, claim, code, &message).await {
                return e;
            }
            ApiError::conflict(code.into(), message)
        }
        EnvError::Step(e) => internal(e),
    }
}

/// A relayed plan's commit: the same [`plan_commit::commit_plan`] the plan handler calls.
pub(super) async fn planned(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: PlannedReport = crate::extract::parse_worker_body(&body)?;
    drop(body);
    let run_id = run.id;
    let mut event_extra = json!({ "pool": caller.0.name });
    let plan = match req.plan_not_kept {
        Some(size) => {
            if run.kind != RunKind::DriftCheck || size <= MAX_RELAY_PLAN_BYTES {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidReport,
                    format!(
                        "planNotKept is for a drift check whose plan file is over {MAX_RELAY_PLAN_BYTES} bytes; upload the plan file (PUT …/plan-file) instead"
                    ),
                ));
            }
            event_extra["planNotKept"] = json!(drift_plan_not_kept(size));
            None
        }
        None => {
            let key = plan_key(run_id, run.attempts);
            let sealed = match st.objects.get(&key, MAX_SEALED_PLAN).await {
                Ok(s) => s,
                Err(takosumi_objects::ObjectError::NotFound) => {
                    return Err(ApiError::conflict(
                        ErrorCode::PlanFileMissing,
                        "upload the plan file (PUT …/plan-file) first",
                    ));
                }
                Err(e) => return Err(object_error(e)),
            };
            let mut plan_bytes = st
                .sealer
                .unseal(Purpose::Plan, &run_id.to_string(), &sealed)
                .map_err(internal)?;
            let digest = takosumi_store::sha256_hex(&plan_bytes);
            let size = plan_bytes.len() as u64;
            plan_bytes.zeroize();
            Some(StoredPlan { key, digest, size })
        }
    };
    let plan_digest = plan.as_ref().map(|p| p.digest.clone());
    let lockfile = match &req.lockfile {
        None => None,
        Some(b64) => {
            let bytes = B64.decode(b64).map_err(|_| {
                ApiError::invalid(ErrorCode::InvalidLockfile, "lockfile must be base64")
            })?;
            match plan_commit::store_lockfile(&st.ctx, run_id, run.attempts, &bytes).await {
                Ok(stored) => Some(stored),
                Err(e) => return Err(env_error(&st, run_id, &claim, e).await),
            }
        }
    };
    if let Some(report) = &req.scan_report {
        takosumi_store::runs::plan_record::set_scan_report(&st.pool, run_id, report).await?;
    }
    let masker = run_masker(&st, &run).await?;
    let committed = plan_commit::commit_plan(
        &st.ctx,
        &run,
        &claim,
        run.attempts,
        PlanToCommit {
            source: takosumi_runner::SourceSnapshot {
                commit: req.source_commit,
                tree_digest: req.tree_digest,
            },
            tool_version: req.tool_version,
            modules_digest: req.modules_digest,
            lockfile,
            show: req.show,
            plan,
            tool_says_drift: req.tool_says_drift,
            injected_env_names: run.injected_env_names.clone(),
            masker,
            event_extra,
            // Recorded when the job was delivered, with the state it carried.
            state_generation: run.state_generation,
        },
    )
    .await;
    match committed {
        Ok(Committed::Done) => {}
        Ok(Committed::LeaseLost) => {
            return Err(ApiError::conflict(
                ErrorCode::NotYourClaim,
                "the lease was lost before the plan was recorded",
            ));
        }
        Err(e) => return Err(env_error(&st, run_id, &claim, e).await),
    }
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    Ok(Json(
        json!({ "runId": run_id, "status": "planned", "planDigest": plan_digest, "changes": run.changes }),
    ))
}

/// A relayed plan's dry-run scan: recorded on the Run at once, and, when the worker asks,
/// decided by the same [`dry_run::check`] the plan handler calls (before `init` and `plan`
/// run anything on the worker). `{"hold": true}`: the Run is held; the worker stops.
pub(super) async fn scanned(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: ScanResult<takosumi_policy::scan::ScanReport> =
        crate::extract::parse_worker_body(&body)?;
    takosumi_store::runs::plan_record::set_scan_report(
        &st.pool,
        run.id,
        &req.scan_report.to_json(),
    )
    .await?;
    let Some(commit) = req.commit else {
        return Ok(Json(ScanAnswer { hold: false }));
    };
    match dry_run::check(&st.pool, &claim, &run, &req.scan_report, &commit).await {
        Ok(DryRunDecision::Proceed) => Ok(Json(ScanAnswer { hold: false })),
        Ok(DryRunDecision::Held) => Ok(Json(ScanAnswer { hold: true })),
        Ok(DryRunDecision::LeaseLost) => Err(ApiError::conflict(
            ErrorCode::NotYourClaim,
            "the lease was lost before the dry-run decision",
        )),
        Err(e) => Err(env_error(&st, run.id, &claim, e).await),
    }
}

/// Failure codes a relay worker may end its Run with (the tool's and the pins').
pub(super) const WORKER_CODES: [FailureCode; 16] = [
    FailureCode::DryRunScanRefused,
    FailureCode::TimedOut,
    FailureCode::SandboxUnavailable,
    FailureCode::CheckoutFailed,
    FailureCode::InitFailed,
    FailureCode::PlanFailed,
    FailureCode::ApplyFailed,
    FailureCode::SourceChanged,
    FailureCode::DependencyChanged,
    FailureCode::LockfileMismatch,
    FailureCode::LockfileTooLarge,
    FailureCode::InvalidConfiguration,
    FailureCode::CredentialFailed,
    FailureCode::StalePlan,
    FailureCode::DeliveryKeyUnopenable,
    FailureCode::PlanTooLarge,
];

pub(super) async fn fail(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let req: FailReport = crate::extract::parse_worker_body(&body)?;
    let Some(code) = WORKER_CODES.into_iter().find(|c| c.as_str() == req.code) else {
        let names: Vec<&str> = WORKER_CODES.iter().map(|c| c.as_str()).collect();
        return Err(ApiError::invalid(
            ErrorCode::InvalidCode,
            format!("code must be one of {names:?}"),
        ));
    };
    let message: String = req.message.chars().take(2000).collect();
    end_failed(&st, run.id, &claim, code, &message).await?;
    Ok(Json(
        json!({ "runId": run.id, "status": "failed", "code": code }),
    ))
}

pub(super) async fn applied(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    if run.kind != RunKind::Apply || run.status != RunStatus::Applying {
        return Err(ApiError::conflict(
            ErrorCode::NotApplying,
            format!("{} is not applying", run.id),
        ));
    }
    let req: AppliedReport = crate::extract::parse_worker_body(&body)?;
    drop(body);
    let run_id = run.id;
    // A pinned apply moves the generation its plan saw; a one-step apply the one its
    // claim found.
    let plan_run = match run.plan_run_id {
        Some(id) => Some(
            runs::get(&st.pool, id)
                .await?
                .ok_or_else(|| ApiError::not_found("the plan Run"))?,
        ),
        None => None,
    };
    let plan_run_id = plan_run.as_ref().map(|p| p.id);
    let generation = plan_run
        .as_ref()
        .map_or(run.state_generation, |p| p.state_generation)
        .unwrap_or_default();
    let capsule_id = run.capsule_id;
    let mut state = match &req.state {
        None => None,
        Some(b64) => Some(
            B64.decode(b64)
                .map_err(|_| ApiError::invalid(ErrorCode::InvalidState, "state must be base64"))?,
        ),
    };
    // Sealed and stored before anything is committed, as the apply handler does it: with
    // retries, else held sealed in Postgres and the apply ends unknown_outcome.
    let sv = match &state {
        Some(bytes) => match unrecorded::seal_and_store_state(
            &st.ctx, &claim, capsule_id, run_id, generation, bytes,
        )
        .await
        {
            Ok(sv) => Some(sv),
            Err(Unrecorded(message)) => {
                state.as_mut().map(Zeroize::zeroize);
                unrecorded::end_unknown_outcome(&st.ctx, &claim, run_id, capsule_id, &message)
                    .await
                    .map_err(internal)?;
                return Ok(Json(
                    json!({ "runId": run_id, "status": "unknown_outcome", "stateGeneration": generation }),
                ));
            }
        },
        None => None,
    };
    if let Some(s) = state.as_mut() {
        s.zeroize();
    }
    let end = if let (true, Some(message)) = (req.success, &req.outputs_error) {
        // A worker's text, masked again here like a relayed log.
        let message = run_masker(&st, &run).await?.mask(message);
        ToolEnd::AfterApplyFailed { message }
    } else if req.success {
        let outputs = if req.outputs.is_object() {
            req.outputs.clone()
        } else {
            json!({})
        };
        ToolEnd::Applied { outputs }
    } else {
        ToolEnd::Failed {
            exit_code: req.exit_code.unwrap_or(1),
        }
    };
    // The same commit as the apply handler's.
    let new_generation = match apply_commit::commit_apply(
        &st.ctx,
        ApplyToCommit {
            run: &run,
            owner: &claim,
            capsule_id,
            generation,
            plan_run_id,
            state_version: sv,
            end,
            event_extra: json!({ "pool": caller.0.name }),
        },
    )
    .await
    {
        Ok(g) => g,
        Err(ApplyCommitError::LeaseLost) => {
            return Err(ApiError::conflict(
                ErrorCode::NotYourClaim,
                "the lease was lost while applying",
            ));
        }
        Err(e) => return Err(internal(e)),
    };
    if let Some(plan_run) = &plan_run
        && let Some(key) = &plan_run.plan_object_key
    {
        let fields = takosumi_store::runs::hold::gate_fields(&st.ctx.pool, plan_run.id).await;
        let json_key = fields.ok().flatten().and_then(|f| f.plan_json_object_key);
        unrecorded::wipe_sealed_plan(&st.ctx, plan_run.id, key, json_key.as_deref()).await;
    }
    Ok(Json(
        json!({ "runId": run_id, "status": if req.success { "applied" } else { "failed" }, "stateGeneration": new_generation }),
    ))
}

/// The worker stopped the tool because a cancel was requested (`progress` said so): the
/// Run ends `canceled` with who asked, as on the control node. An apply lets go of its
/// Capsule and wakes the next waiting apply. Only a requested cancel can end this way.
pub(super) async fn canceled(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    let mut tx = st.pool.begin().await?;
    let Some(done) = takosumi_store::runs::cancel::cancel_claimed(&mut tx, run.id, &claim).await?
    else {
        return Err(ApiError::conflict(
            ErrorCode::NoCancelRequested,
            format!("no cancel of {} was requested", run.id),
        ));
    };
    if run.kind == RunKind::Apply {
        runs::release_capsule_and_wake_next(&mut tx, run.capsule_id, run.id).await?;
    }
    let actor = format!("handler:{claim}");
    events::append(
        tx.db(),
        run.id,
        EventKind::Canceled,
        &actor,
        json!({ "canceledBy": done.by, "whileRunning": true, "pool": caller.0.name }),
    )
    .await?;
    takosumi_store::activity::append(
        tx.db(),
        done.workspace_id,
        ActivityKind::RunCanceled,
        &run.id.to_string(),
        &done.by,
        json!({ "whileRunning": true }),
    )
    .await?;
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok(Json(json!({ "runId": run.id, "status": "canceled" })))
}
