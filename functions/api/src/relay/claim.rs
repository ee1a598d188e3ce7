//! Claiming a pool's next job: the wake-ups drained, the conditional claim, and a Run
//! that cannot be handed out failed before any worker sees it.

use super::*;

/// Drains the pool's queues: their messages are wake-ups, and the claim below looks in
/// Postgres whatever they say. Best effort: a broker fault never stops a claim.
pub(super) async fn drain_wakeups(st: &AppState, pool: &WorkerPool) {
    let Ok(broker) = st.bus.get().await else {
        return;
    };
    let Ok(ch) = broker.channel().await else {
        return;
    };
    for queue in takosumi_queue::Topology::pool_queues(&pool.name) {
        for _ in 0..100 {
            let got = ch
                .basic_get(
                    queue.clone().into(),
                    lapin::options::BasicGetOptions { no_ack: true },
                )
                .await;
            if !matches!(got, Ok(Some(_))) {
                break;
            }
        }
    }
    let _ = ch.close(200, "drained".into()).await;
}

pub(super) async fn claim(
    State(st): State<AppState>,
    caller: PoolCaller,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let pool = caller.0;
    let req: ClaimRequest = if body.iter().all(u8::is_ascii_whitespace) {
        ClaimRequest::default()
    } else {
        crate::extract::parse_worker_body(&body)?
    };
    let key = delivery_key_for(&pool, &req.delivery_key_ids)?;
    let sandbox = match req.sandbox.as_deref().map(str::parse::<SandboxMode>) {
        None => None,
        Some(Ok(mode)) => Some(mode),
        // The worker's text is not echoed: the message names what it may say.
        Some(Err(e)) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidSandbox,
                format!("sandbox is one of {}", e.names),
            ));
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(req.wait_secs.min(20));
    loop {
        drain_wakeups(&st, &pool).await;
        if let Some(job) = claim_once(&st, &pool, key.as_ref(), sandbox).await? {
            return Ok(Json(ClaimAnswer { job: Some(job) }));
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Json(ClaimAnswer { job: None }));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub(super) fn new_owner(pool: &WorkerPool) -> String {
    format!(
        "relay:{}:{}",
        pool.name,
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A claimed job, or why the Run failed at once instead.
pub(super) enum Prepared {
    Job(Box<RelayJob>),
    Failed,
}

/// Fails a released apply the pool cannot run, before anyone claims it, with its code and
/// a `failed` event naming the pool; a Run another caller already ended is left alone.
pub(super) async fn fail_unclaimed(
    st: &AppState,
    pool: &WorkerPool,
    run_id: RunId,
    code: FailureCode,
    message: &str,
) -> Result<(), ApiError> {
    let mut tx = st.pool.begin().await?;
    if runs::fail(&mut tx, run_id, None, code, message).await? {
        events::append(
            tx.db(),
            run_id,
            EventKind::Failed,
            &format!("relay:{}", pool.name),
            json!({ "code": code, "message": message }),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

pub(super) async fn claim_once(
    st: &AppState,
    pool: &WorkerPool,
    key: Option<&DeliveryPublicKey>,
    sandbox: Option<SandboxMode>,
) -> Result<Option<RelayJob>, ApiError> {
    // Applies first: a held Capsule waits for them.
    for (run_id, has_plan) in pools::released_applies(&st.pool, pool.id).await? {
        // A one-step apply (no rule covers it) has no saved plan to deliver; the worker
        // runs `apply -auto-approve` on the branch head through the same pipeline as the
        // control node, and hands the result back like any apply.
        if has_plan && key.is_none() {
            let message = format!(
                "worker pool {:?} has no delivery key, so the saved plan cannot be delivered to it and a gated apply cannot run there; register a delivery key (POST /api/v1/pools/{}/delivery-key) and propose the apply again, or run the Capsule on the control node (PUT /api/v1/capsules/{{id}}/pool {{\"pool\": null}})",
                pool.name, pool.name
            );
            fail_unclaimed(
                st,
                pool,
                run_id,
                FailureCode::PoolHasNoDeliveryKey,
                &message,
            )
            .await?;
            continue;
        }
        if !has_plan
            && takosumi_store::runs::apply_mode::get(&st.pool, run_id).await?
                != Some(takosumi_core::ApplyMode::OneStep)
        {
            fail_unclaimed(
                st,
                pool,
                run_id,
                FailureCode::InvalidConfiguration,
                "an Apply Run without a plan that is not a one-step apply cannot run; submit the apply again",
            )
            .await?;
            continue;
        }
        let owner = new_owner(pool);
        let mut tx = st.pool.begin().await?;
        if !has_plan {
            // As the control node's apply handler: a one-step apply applies on top of the
            // generation current when it is claimed.
            takosumi_store::runs::apply_mode::pin_current_generation(&mut tx, run_id).await?;
        }
        let claimed = takosumi_runtime::step::claim_apply_recorded(
            &mut tx,
            run_id,
            &owner,
            RELAY_LEASE_SECS,
            json!({ "step": "apply", "pool": pool.name }),
            sandbox,
        )
        .await
        .map_err(internal)?;
        tx.commit().await?;
        if claimed != ApplyClaim::Claimed {
            continue;
        }
        let job = if has_plan {
            apply_job(st, pool, key, run_id, &owner).await
        } else {
            one_step_job(st, pool, key, run_id, &owner).await
        };
        match job {
            Ok(Prepared::Job(job)) => return Ok(Some(*job)),
            Ok(Prepared::Failed) => continue,
            Err(e) => {
                let _ = end_failed(
                    st,
                    run_id,
                    &owner,
                    FailureCode::ApplyFailed,
                    "the apply could not be prepared for the relay (a storage or internal fault; nothing was applied); submit the apply again",
                )
                .await;
                return Err(e);
            }
        }
    }
    let owner = new_owner(pool);
    let data = json!({ "step": "plan", "pool": pool.name });
    let record = takosumi_store::runs::ClaimRecord {
        data: &data,
        sandbox,
    };
    let Some(run_id) =
        pools::claim_next_plan(&st.pool, pool.id, &owner, RELAY_LEASE_SECS, record).await?
    else {
        return Ok(None);
    };
    match plan_job(st, pool, key, run_id, &owner).await {
        Ok(Prepared::Job(job)) => Ok(Some(*job)),
        Ok(Prepared::Failed) => Ok(None),
        Err(e) => {
            // Hand it back, counted like the control node's: nothing ran.
            takosumi_runtime::step::hand_back(&st.pool, run_id, &owner).await;
            Err(e)
        }
    }
}

/// The failure a refused input ends its Run with: the environment's own failure code (a
/// binding that does not open, a clashing variable); anything else [`secret_inputs`] refuses
/// for (its Capsule gone) is the Run's configuration.
pub(super) fn refusal_code(code: ErrorCode) -> FailureCode {
    code.as_str()
        .parse()
        .unwrap_or(FailureCode::InvalidConfiguration)
}
