//! What a claimed job carries: the source, the variables and every secret input sealed
//! to the pool's delivery key, for a plan, an apply (with its saved plan) or a one-step
//! apply.

use super::*;

/// The secret inputs of a step: credentials, sensitive variables and command credentials,
/// as [`RelaySecrets`] plaintext JSON, or `Err(message)` when they cannot be delivered to a
/// relay.
pub(super) async fn secret_inputs(
    st: &AppState,
    inputs_of: &runs::Run,
    capsule_id: CapsuleId,
) -> Result<RelayInputs, ApiError> {
    // The same opening and the same clash rules as the control node's environment
    // (`Ctx::run_env`): a binding that does not open is `credential_failed`, a variable
    // two sources set is refused, never overwritten.
    let refused = |e: EnvError| match e {
        EnvError::Fail(code, message) => {
            ApiError::client(StatusCode::CONFLICT, code.into(), message)
        }
        EnvError::Step(e) => internal(e),
    };
    let mut names = Vec::new();
    let mut sensitive = None;
    if let Some((sv_names, sealed)) = bindings::sensitive_vars(&st.pool, inputs_of.id).await? {
        let mut plain = st
            .sealer
            .unseal(
                Purpose::Credential,
                &sensitive_vars_subject(inputs_of.id),
                &sealed,
            )
            .map_err(internal)?;
        let parsed: Result<Map<String, Value>, _> = serde_json::from_slice(&plain);
        plain.zeroize();
        sensitive = Some(parsed.map_err(internal)?);
        names.extend(sv_names.into_iter().map(|n| format!("TF_VAR_{n}")));
    }
    let capsule = capsules::get(&st.pool, capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Capsule {capsule_id}")))?;
    let vars = st
        .ctx
        .run_variables(inputs_of, &capsule)
        .await
        .map_err(refused)?;
    let mut taken = Injected::new(
        vars.keys()
            .map(|k| format!("TF_VAR_{k}"))
            .chain(names.iter().cloned()),
    );
    let mut env = std::collections::BTreeMap::new();
    let mut commands = Vec::new();
    let mut used = Vec::new();
    for sealed in bindings::sealed_for_capsule(&st.pool, capsule_id).await? {
        let b = &sealed.binding;
        let (what, set) = open_binding(&st.sealer, &sealed).map_err(refused)?;
        let entries: Vec<(String, String)> = match (&set, set.static_entries()) {
            (_, Some(entries)) => entries,
            // A command credential runs where the tool runs: on the worker, inside its
            // sandbox, for every run (delivered sealed like any credential).
            (CredentialSet::Command { command, env_name }, None) => {
                taken.claim(env_name, &what).map_err(refused)?;
                names.push(env_name.clone());
                commands.push(CommandCredential {
                    what: what.clone(),
                    command: command.clone(),
                    env_name: env_name.clone(),
                });
                Vec::new()
            }
            (_, None) => Vec::new(),
        };
        for (k, v) in entries {
            taken.claim(&k, &what).map_err(refused)?;
            env.insert(k.clone(), v);
            names.push(k);
        }
        used.push(UsedBinding {
            id: b.id,
            name: b.name.clone(),
            kind: b.kind.into(),
        });
    }
    // Every injected name, the plain variables' included, as the control node records.
    names.extend(vars.keys().map(|k| format!("TF_VAR_{k}")));
    names.sort();
    names.dedup();
    let secrets = if env.is_empty() && sensitive.is_none() && commands.is_empty() {
        None
    } else {
        let bundle = RelaySecrets {
            env,
            sensitive_vars: sensitive,
            commands,
        };
        Some(serde_json::to_vec(&bundle).map_err(internal)?)
    };
    Ok(RelayInputs {
        secrets,
        used,
        names,
        vars,
    })
}

/// What a relayed step is delivered besides its source: the secrets (credential values and
/// sensitive variables, JSON, sealed to the pool's key before they leave), the bindings'
/// ids and names, every injected variable name, and the plain variables.
pub(super) struct RelayInputs {
    pub(super) secrets: Option<Vec<u8>>,
    used: Vec<UsedBinding>,
    names: Vec<String>,
    vars: Map<String, Value>,
}

impl RelayInputs {
    fn var_names(&self) -> Vec<String> {
        self.vars.keys().cloned().collect()
    }

    /// Records on the claimed Run what its job is delivered (names only) and, for a plan,
    /// the generation of the state delivered with it (what the plan is recorded against).
    async fn record_on(
        &self,
        st: &AppState,
        run_id: RunId,
        owner: &str,
        plan_generation: Option<i64>,
    ) -> Result<(), ApiError> {
        let used = serde_json::to_value(&self.used).map_err(internal)?;
        bindings::record_run_env(
            &st.pool,
            run_id,
            owner,
            &used,
            &self.names,
            &self.var_names(),
            plan_generation,
        )
        .await?;
        Ok(())
    }

    /// The secrets, sealed to the delivery key (`None`: there are none).
    fn sealed_secrets(
        &self,
        key: Option<&DeliveryPublicKey>,
        run_id: RunId,
    ) -> Result<Option<String>, ApiError> {
        match &self.secrets {
            Some(s) => seal_to(key, Purpose::Credential, run_id, s),
            None => Ok(None),
        }
    }
}

pub(super) fn no_key_message(pool: &WorkerPool, what: &str) -> String {
    format!(
        "worker pool {:?} has no delivery key, so {what} cannot be delivered to it; register a delivery key (POST /api/v1/pools/{}/delivery-key) or run the Capsule on the control node",
        pool.name, pool.name
    )
}

/// Seals `plain` to the delivery key, base64 (`None`: the pool has no key; the callers
/// fail the Run `pool_has_no_delivery_key` before anything would need it).
pub(super) fn seal_to(
    key: Option<&DeliveryPublicKey>,
    purpose: Purpose,
    run_id: RunId,
    plain: &[u8],
) -> Result<Option<String>, ApiError> {
    key.map(|k| seal_with(k, purpose, run_id, plain))
        .transpose()
}

/// Seals `plain` to `key`, base64.
pub(super) fn seal_with(
    key: &DeliveryPublicKey,
    purpose: Purpose,
    run_id: RunId,
    plain: &[u8],
) -> Result<String, ApiError> {
    let sealed = key
        .seal(purpose, &run_id.to_string(), plain)
        .map_err(internal)?;
    Ok(B64.encode(sealed))
}

/// The Capsule's current state, opened with the server key and checked against its digest.
pub(super) async fn current_state(
    st: &AppState,
    capsule: &capsules::Capsule,
) -> Result<Option<Vec<u8>>, ApiError> {
    let Some(sv_id) = capsule.current_state_version_id else {
        return Ok(None);
    };
    let sv = states::versions::get(&st.pool, sv_id)
        .await?
        .ok_or_else(|| internal(takosumi_store::StoreError::NotFound("state version")))?;
    let sealed = st
        .objects
        .get(&sv.object_key, MAX_STATE_BYTES)
        .await
        .map_err(object_error)?;
    let state = st
        .sealer
        .unseal(Purpose::State, &sv_id.to_string(), &sealed)
        .map_err(internal)?;
    if takosumi_store::sha256_hex(&state) != sv.digest {
        return Err(internal(takosumi_store::StoreError::Conflict(
            "state object does not match its digest",
        )));
    }
    Ok(Some(state))
}

pub(super) async fn end_failed(
    st: &AppState,
    run_id: RunId,
    owner: &str,
    code: FailureCode,
    message: &str,
) -> Result<bool, ApiError> {
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    let mut tx = st.pool.begin().await?;
    let done = runs::fail(&mut tx, run_id, Some(owner), code, message).await?;
    if done {
        if run.kind == RunKind::Apply {
            runs::release_capsule_and_wake_next(&mut tx, run.capsule_id, run_id).await?;
        }
        events::append(
            tx.db(),
            run_id,
            EventKind::Failed,
            &format!("handler:{owner}"),
            json!({ "code": code, "message": message }),
        )
        .await?;
    }
    tx.commit().await?;
    st.relay_wake.notify_one();
    Ok(done)
}

pub(super) async fn plan_job(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run_id: RunId,
    owner: &str,
) -> Result<Prepared, ApiError> {
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    // A plan whose workers keep vanishing (the reaper hands it back each time) ends,
    // like on the control node, after a bounded number of claims.
    if run.attempts > RELAY_MAX_ATTEMPTS {
        let message = format!(
            "planning was attempted {} times on worker pool {:?} without finishing; check the relay workers' logs and plan again",
            run.attempts - 1,
            pool.name
        );
        end_failed(st, run_id, owner, FailureCode::AttemptsExhausted, &message).await?;
        return Ok(Prepared::Failed);
    }
    let (capsule, source) = tokio::try_join!(
        capsules::get(&st.pool, run.capsule_id),
        takosumi_store::runs::source::run_source(&st.pool, run_id)
    )?;
    let capsule =
        capsule.ok_or_else(|| ApiError::not_found(&format!("Capsule {}", run.capsule_id)))?;
    let source = source.ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    let settled = async {
        check_plan_source(&source)?;
        st.ctx.settle_plan_vars(&run, &capsule, &source).await
    };
    match settled.await {
        Ok(()) => {}
        Err(EnvError::Fail(code, message)) => {
            end_failed(st, run_id, owner, code, &message).await?;
            return Ok(Prepared::Failed);
        }
        Err(EnvError::Step(e)) => return Err(internal(e)),
    }
    let Some((inputs, state)) = delivered_inputs(st, pool, key, &run, &capsule, owner).await?
    else {
        return Ok(Prepared::Failed);
    };
    let work = JobWork::Plan(PlanJob {
        kind: run.kind,
        attempt: run.attempts,
        source: JobSource {
            repo: capsule.repo.clone(),
            branch: source.source_ref.unwrap_or_else(|| capsule.branch.clone()),
            commit: source.pinned_commit,
            dir: capsule.dir.clone(),
        },
        max_plan_bytes: MAX_RELAY_PLAN_BYTES,
        // A pull request's plan: refused rather than run when the dry-run scan finds a
        // data source that acts when planned (the worker scans before `plan`).
        speculative: source.speculative,
    });
    job(run_id, owner, &capsule, key, inputs, state.as_deref(), work)
}

/// A job: what every kind carries (the sealed payloads sealed to `key` now), and `work`.
pub(super) fn job(
    run_id: RunId,
    owner: &str,
    capsule: &capsules::Capsule,
    key: Option<&DeliveryPublicKey>,
    inputs: RelayInputs,
    state: Option<&[u8]>,
    work: JobWork,
) -> Result<Prepared, ApiError> {
    let secrets = inputs.sealed_secrets(key, run_id)?;
    let state = match state {
        Some(s) => seal_to(key, Purpose::State, run_id, s)?,
        None => None,
    };
    Ok(Prepared::Job(Box::new(RelayJob {
        run_id,
        claim: owner.to_owned(),
        lease_secs: RELAY_LEASE_SECS,
        tool: capsule.tool,
        vars: inputs.vars,
        delivery_key_id: key.map(|k| k.key_id.clone()),
        // ids and names of the credential sets delivered (never their values)
        provider_bindings: inputs.used,
        secrets,
        state,
        work,
    })))
}

pub(super) async fn apply_job(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run_id: RunId,
    owner: &str,
) -> Result<Prepared, ApiError> {
    let Some(key) = key else {
        end_failed(
            st,
            run_id,
            owner,
            FailureCode::PoolHasNoDeliveryKey,
            &no_key_message(pool, "the saved plan"),
        )
        .await?;
        return Ok(Prepared::Failed);
    };
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    let Some(plan_run_id) = run.plan_run_id else {
        end_failed(
            st,
            run_id,
            owner,
            FailureCode::InvalidConfiguration,
            "an apply without a saved plan cannot run on a worker pool; run it on the control node",
        )
        .await?;
        return Ok(Prepared::Failed);
    };
    let plan_run = runs::get(&st.pool, plan_run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {plan_run_id}")))?;
    let capsule = capsules::get(&st.pool, run.capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Capsule {}", run.capsule_id)))?;
    let (Some(plan_digest), Some(commit), Some(tree), Some(plan_key_s)) = (
        plan_run.plan_digest.clone(),
        plan_run.source_commit.clone(),
        plan_run.tree_digest.clone(),
        plan_run.plan_object_key.clone(),
    ) else {
        end_failed(st, run_id, owner, FailureCode::StalePlan, "the saved plan was already used or wiped, or its record is incomplete; plan again and apply the new plan").await?;
        return Ok(Prepared::Failed);
    };
    // Pin 1, on the control node: the sealed plan opens under the plan Run's id and hashes
    // to the reviewed digest before it is re-sealed to the pool.
    let sealed = match st.objects.get(&plan_key_s, MAX_SEALED_PLAN).await {
        Ok(s) => s,
        Err(takosumi_objects::ObjectError::NotFound) => {
            end_failed(
                st,
                run_id,
                owner,
                FailureCode::PlanDigestMismatch,
                "the sealed plan file is missing from storage; plan again",
            )
            .await?;
            return Ok(Prepared::Failed);
        }
        Err(e) => return Err(object_error(e)),
    };
    let Ok(mut plan_bytes) = st
        .sealer
        .unseal(Purpose::Plan, &plan_run_id.to_string(), &sealed)
    else {
        end_failed(st, run_id, owner, FailureCode::PlanDigestMismatch, "the sealed plan file does not open for this plan (altered, or moved from another run); nothing was applied; plan again").await?;
        return Ok(Prepared::Failed);
    };
    if takosumi_store::sha256_hex(&plan_bytes) != plan_digest {
        plan_bytes.zeroize();
        end_failed(st, run_id, owner, FailureCode::PlanDigestMismatch, "the saved plan does not match the digest that was reviewed; nothing was applied; plan again").await?;
        return Ok(Prepared::Failed);
    }
    let sealed_plan = seal_with(key, Purpose::Plan, run_id, &plan_bytes)?;
    plan_bytes.zeroize();
    // Decided as the apply handler decides it (`Ctx::planned_lockfile`).
    let lockfile = match st.ctx.planned_lockfile(&plan_run).await {
        Ok(found) => found.map(|(bytes, _)| B64.encode(bytes)),
        Err(LockfileError::Refused(code, message)) => {
            end_failed(st, run_id, owner, code, &message).await?;
            return Ok(Prepared::Failed);
        }
        Err(LockfileError::Step(e)) => return Err(internal(e)),
    };
    let inputs = match secret_inputs(st, &plan_run, capsule.id).await {
        Ok(s) => s,
        Err(ApiError::Client { code, message, .. }) => {
            end_failed(st, run_id, owner, refusal_code(code), &message).await?;
            return Ok(Prepared::Failed);
        }
        Err(e) => return Err(e),
    };
    let state = current_state(st, &capsule).await?;
    inputs.record_on(st, run_id, owner, None).await?;
    events::append(
        &st.pool,
        run_id,
        EventKind::PinChecked,
        &format!("handler:{owner}"),
        json!({ "pin": "planDigest", "planDigest": plan_digest, "deliveredTo": key.key_id }),
    )
    .await?;
    let work = JobWork::Apply(Box::new(ApplyJob {
        plan_run_id,
        plan_digest,
        source: PinnedSource {
            repo: capsule.repo.clone(),
            branch: capsule.branch.clone(),
            commit,
            tree_digest: tree,
            dir: capsule.dir.clone(),
        },
        dependency_snapshot: plan_run.dependency_snapshot,
        plan_kind: plan_run.kind,
        provider_lock_digest: plan_run.provider_lock_digest,
        lockfile,
        state_generation: plan_run.state_generation,
        plan: sealed_plan,
    }));
    job(
        run_id,
        owner,
        &capsule,
        Some(key),
        inputs,
        state.as_deref(),
        work,
    )
}

/// What a plan-side or one-step job delivers besides its source: the Run's inputs and the
/// Capsule's state, recorded on the Run (names only). `None`: the Run was failed with its
/// code (a credential that does not open, or a pool without a delivery key for secrets or
/// state).
pub(super) async fn delivered_inputs(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run: &runs::Run,
    capsule: &capsules::Capsule,
    owner: &str,
) -> Result<Option<(RelayInputs, Option<Vec<u8>>)>, ApiError> {
    let inputs = match secret_inputs(st, run, capsule.id).await {
        Ok(s) => s,
        Err(ApiError::Client { code, message, .. }) => {
            end_failed(st, run.id, owner, refusal_code(code), &message).await?;
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let state = current_state(st, capsule).await?;
    if key.is_none() && (inputs.secrets.is_some() || state.is_some()) {
        let what = if state.is_some() {
            "the Capsule's state"
        } else {
            "the Capsule's credentials"
        };
        end_failed(
            st,
            run.id,
            owner,
            FailureCode::PoolHasNoDeliveryKey,
            &no_key_message(pool, what),
        )
        .await?;
        return Ok(None);
    }
    // A plan is recorded against the generation of the state it is sent: the Capsule row
    // `current_state` read it from. A one-step apply's generation was pinned by its claim.
    let plan_generation = run.kind.is_plan_like().then_some(capsule.state_generation);
    inputs.record_on(st, run.id, owner, plan_generation).await?;
    Ok(Some((inputs, state)))
}

/// A one-step apply's job: the branch, the Capsule's state and credentials (sealed to the
/// pool's key; a pool without one can run it only when there is neither), and its
/// variables.
pub(super) async fn one_step_job(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    run_id: RunId,
    owner: &str,
) -> Result<Prepared, ApiError> {
    let run = runs::get(&st.pool, run_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {run_id}")))?;
    let capsule = capsules::get(&st.pool, run.capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Capsule {}", run.capsule_id)))?;
    let Some((inputs, state)) = delivered_inputs(st, pool, key, &run, &capsule, owner).await?
    else {
        return Ok(Prepared::Failed);
    };
    let work = JobWork::OneStep(OneStepJob {
        source: BranchSource {
            repo: capsule.repo.clone(),
            branch: capsule.branch.clone(),
            dir: capsule.dir.clone(),
        },
        state_generation: run.state_generation,
    });
    job(run_id, owner, &capsule, key, inputs, state.as_deref(), work)
}

/// A relayed one-step apply's record of what it is about to apply (the control node's
/// `runs::apply_mode::record_snapshot`), before its tool starts.
pub(super) async fn one_step(
    State(st): State<AppState>,
    caller: PoolCaller,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let (run, claim) = held_run(&st, &caller.0, &run, &headers).await?;
    if run.kind != RunKind::Apply || run.plan_run_id.is_some() || run.status != RunStatus::Applying
    {
        return Err(ApiError::conflict(
            ErrorCode::NotOneStep,
            format!("{} is not a one-step apply in progress", run.id),
        ));
    }
    let r: takosumi_steps::OneStepRecord = crate::extract::parse_worker_body(&body)?;
    let snapshot = takosumi_store::runs::apply_mode::OneStepSnapshot {
        commit: &r.commit,
        tree_digest: &r.tree_digest,
        tool_version: &r.tool_version,
        provider_lock_digest: r.provider_lock_digest.as_deref(),
        injected_env_names: &r.injected_env_names,
    };
    if !takosumi_store::runs::apply_mode::record_snapshot(&st.pool, run.id, &claim, &snapshot)
        .await?
    {
        return Err(ApiError::conflict(
            ErrorCode::NotYourClaim,
            "the lease was lost before the one-step apply",
        ));
    }
    Ok(Json(json!({ "runId": run.id, "recorded": true })))
}

/// Loads the Run and checks it is the caller's pool's and held by `claim`.
pub(super) async fn held_run(
    st: &AppState,
    pool: &WorkerPool,
    raw: &str,
    headers: &HeaderMap,
) -> Result<(runs::Run, String), ApiError> {
    let id: RunId = crate::extract::parse_id(raw)?;
    let run = runs::get(&st.pool, id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("Run {id}")))?;
    let run_pool = pools::of_capsule(&st.pool, run.capsule_id).await?;
    if run_pool.as_ref().map(|p| p.id) != Some(pool.id) {
        return Err(ApiError::forbidden_code(
            ErrorCode::WrongPool,
            format!("{id} does not run on worker pool {:?}", pool.name),
        ));
    }
    let claim = headers
        .get("x-takosumi-claim")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if claim.is_empty() || run.lease_owner.as_deref() != Some(claim.as_str()) {
        return Err(ApiError::conflict(
            ErrorCode::NotYourClaim,
            format!(
                "{id} is not held by this claim (finished, canceled, or taken back after the lease ran out)"
            ),
        ));
    }
    Ok((run, claim))
}
