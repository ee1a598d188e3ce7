//! The plan commit, written once so a plan ends the same way whoever executed it: what a finished plan, destroy plan or drift
//! check becomes on the control node — the lockfile sealed, stored and read back, the
//! plan JSON sealed, the cost summary masked, and the Run's record with its `planned`
//! event, the gate's wake-up and a drift check's kept plan in one transaction. The plan
//! handler calls it for the Runs it planned itself, the API's relay endpoint for a relay
//! worker's (`owner` is the claim either way).

use serde_json::{Value, json};
use takosumi_core::{FailureCode, RunKind, StepError};
use takosumi_objects::PutOutcome;
use takosumi_runner::{Masker, SourceSnapshot, Workdir, count_changes};
use takosumi_seal::{CHUNK_LEN, Purpose, SealError, Streamed};
use takosumi_store::runs;

use crate::Ctx;
use crate::dependencies::{LockfileError, dependency_snapshot};
use crate::inputs::EnvError;
use crate::step::{lockfile_key, object_err, plan_key};
use takosumi_store::StoreError;

/// The largest plan file that crosses the relay: a relay worker uploads it as one request
/// body, which the API holds in memory to seal. A plan the control node executes has no
/// such limit (it is sealed and stored from its file, in chunks).
pub const MAX_RELAY_PLAN_BYTES: u64 = 19 * 1024 * 1024;

/// A plan file sealed and stored under the Run's claim.
#[derive(Debug, Clone)]
pub struct StoredPlan {
    /// Its object key.
    pub key: String,
    /// SHA-256 hex of the plan file's bytes.
    pub digest: String,
    /// The plan file's size in bytes.
    pub size: u64,
}

/// What a finished plan pipeline produced, for [`commit_plan`].
pub struct PlanToCommit {
    /// The executed commit and tree digest.
    pub source: SourceSnapshot,
    /// `version -json`.
    pub tool_version: Value,
    /// Digest of the installed module tree.
    pub modules_digest: String,
    /// The lockfile stored by [`store_lockfile`], `None` for a provider-free run.
    pub lockfile: Option<StoredLockfile>,
    /// `show -json` of the saved plan.
    pub show: Value,
    /// The sealed, stored plan file; `None` only for a drift check whose plan could not
    /// cross the relay: the check still reports drift, keeps no plan, and drops any plan an
    /// earlier check kept.
    pub plan: Option<StoredPlan>,
    /// A drift check's `-detailed-exitcode` answer.
    pub tool_says_drift: Option<bool>,
    /// Names of every injected variable.
    pub injected_env_names: Vec<String>,
    /// Every secret of the Run (and what the plan marks sensitive): the cost summary
    /// stored in clear goes through it.
    pub masker: Masker,
    /// Added to the `planned` event (a relayed plan names its pool).
    pub event_extra: Value,
    /// The generation of the Capsule state the plan restored (read with the state's
    /// pointer, from the same Capsule row): what the plan is recorded against, so that an
    /// apply landing while it plans makes its own apply fail `state_generation_changed`.
    /// `None` (a relayed job delivered before its API recorded what it sent): the Capsule's
    /// generation at commit.
    pub state_generation: Option<i64>,
}

/// How the commit ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    /// The Run is `planned` and the gate is woken.
    Done,
    /// `owner` no longer held the Run: nothing was recorded.
    LeaseLost,
}

/// How [`store_plan_file`] and [`put_sealed_plan`] ended.
#[derive(Debug)]
pub enum PlanPut {
    /// Sealed and stored.
    Stored(StoredPlan),
    /// An object was already at the claim's key; nothing was written.
    AlreadyThere,
}

/// A saved plan sealed into the run directory's staging file and digested, not stored yet:
/// [`put_sealed_plan`] stores it.
#[derive(Debug)]
pub struct SealedPlanFile {
    staged: std::path::PathBuf,
    streamed: Streamed,
}

fn seal_err(e: SealError) -> StepError {
    if e.retryable() {
        StepError::transient(e)
    } else {
        StepError::internal(e)
    }
}

/// Seals (chunked format, `takosumi_seal::Sealer::seal_stream`) the run directory's saved
/// plan into its staging file beside it, digesting the plan on the way; memory stays
/// bounded whatever the plan's size. What is sealed here is what the record's digest names:
/// call it before anything else of the Capsule runs. The control node's plans; a relay
/// worker's upload goes through [`store_plan_file`].
pub async fn seal_plan_file(
    ctx: &Ctx,
    run_id: takosumi_core::RunId,
    wd: &Workdir,
) -> Result<SealedPlanFile, StepError> {
    let sealer = ctx.sealer.clone();
    let subject = run_id.to_string();
    let staged = wd.sealed_plan_path();
    let (plan, dst) = (wd.plan_path().to_owned(), staged.clone());
    let streamed = tokio::task::spawn_blocking(move || {
        let src = std::fs::File::open(&plan).map_err(|e| SealError::Io {
            what: "opening the saved plan",
            kind: e.kind(),
        })?;
        let dst = takosumi_runner::create_private_file(&dst).map_err(|e| SealError::Io {
            what: "staging the sealed plan",
            kind: e.kind(),
        })?;
        sealer.seal_stream(Purpose::Plan, &subject, src, std::io::BufWriter::new(dst))
    })
    .await
    .map_err(StepError::internal)?
    .map_err(seal_err)?;
    Ok(SealedPlanFile { staged, streamed })
}

/// Stores a plan [`seal_plan_file`] sealed under the Run's claim (`attempt`), uploaded from
/// its staging file in parts, then removes the staging file. It may run beside Capsule code
/// (`show -json`): a staged copy altered or swapped meanwhile either does not open (the seal
/// is authenticated and bound to the Run) or does not match the digest taken while sealing,
/// and the apply checks both ([`fetch_plan_file`]): it could fail this plan's apply, never
/// change what is applied.
pub async fn put_sealed_plan(
    ctx: &Ctx,
    run_id: takosumi_core::RunId,
    attempt: i32,
    sealed: SealedPlanFile,
) -> Result<PlanPut, StepError> {
    let key = plan_key(run_id, attempt);
    let put = ctx.objects.put_file_if_absent(&key, &sealed.staged).await;
    let _ = std::fs::remove_file(&sealed.staged);
    plan_put(put, key, &sealed.streamed)
}

/// Seals and stores a relay worker's uploaded plan (already held to
/// [`MAX_RELAY_PLAN_BYTES`]) under the Run's claim (`attempt`), digesting it on the way,
/// sealed as [`seal_plan_file`] seals the control node's.
pub async fn store_plan_file(
    ctx: &Ctx,
    run_id: takosumi_core::RunId,
    attempt: i32,
    bytes: &[u8],
) -> Result<PlanPut, StepError> {
    let key = plan_key(run_id, attempt);
    let mut sealed = Vec::with_capacity(bytes.len() + bytes.len() / CHUNK_LEN * 16 + 128);
    let streamed = ctx
        .sealer
        .seal_stream(Purpose::Plan, &run_id.to_string(), bytes, &mut sealed)
        .map_err(seal_err)?;
    let put = ctx.objects.put_if_absent(&key, sealed).await;
    plan_put(put, key, &streamed)
}

fn plan_put(
    put: Result<PutOutcome, takosumi_objects::ObjectError>,
    key: String,
    streamed: &Streamed,
) -> Result<PlanPut, StepError> {
    Ok(match put.map_err(object_err)? {
        PutOutcome::Created => PlanPut::Stored(StoredPlan {
            key,
            digest: streamed.sha256_hex(),
            size: streamed.len,
        }),
        PutOutcome::AlreadyExists => PlanPut::AlreadyThere,
    })
}

/// Why [`fetch_plan_file`] could not give the reviewed plan.
#[derive(Debug)]
pub enum PlanFetchError {
    /// No object at the key.
    Missing,
    /// Sealed with a key this server does not hold.
    UnknownKey,
    /// It does not open for this plan Run (altered, or moved from another Run).
    DoesNotOpen,
    /// It opened, but its bytes are not the reviewed digest.
    DigestMismatch,
    /// A storage or local fault.
    Step(StepError),
}

/// Fetches a plan Run's sealed plan into the run directory's staging file, unseals it
/// chunk by chunk into its saved plan and checks it is exactly the reviewed digest; on
/// any failure the saved plan is wiped. Memory stays bounded whatever the plan's size. Reads
/// both sealed formats (the first cut's whole-object seals too).
pub async fn fetch_plan_file(
    ctx: &Ctx,
    plan_run: takosumi_core::RunId,
    key: &str,
    digest: &str,
    wd: &Workdir,
) -> Result<(), PlanFetchError> {
    let scratch = &wd.sealed_plan_path();
    let fetched = ctx.objects.get_to_file(key, scratch, u64::MAX).await;
    match fetched {
        Ok(_) => {}
        Err(takosumi_objects::ObjectError::NotFound) => return Err(PlanFetchError::Missing),
        Err(e) => {
            let _ = std::fs::remove_file(scratch);
            return Err(PlanFetchError::Step(object_err(e)));
        }
    }
    let sealer = ctx.sealer.clone();
    let subject = plan_run.to_string();
    let (plan_path, staged) = (wd.plan_path().to_owned(), scratch.clone());
    let opened = tokio::task::spawn_blocking(move || -> Result<String, SealError> {
        let io = |what| {
            move |e: std::io::Error| SealError::Io {
                what,
                kind: e.kind(),
            }
        };
        let dst = takosumi_runner::create_private_file(&plan_path)
            .map_err(io("writing the saved plan"))?;
        let mut dst = std::io::BufWriter::new(dst);
        let mut src = std::fs::File::open(&staged).map_err(io("opening the sealed plan"))?;
        let mut magic = [0u8; 4];
        let n = std::io::Read::read(&mut src, &mut magic).map_err(io("reading the sealed plan"))?;
        if &magic[..n] == takosumi_seal::MAGIC_V2.as_slice() {
            std::io::Seek::rewind(&mut src).map_err(io("reading the sealed plan"))?;
            let streamed = sealer.unseal_stream(Purpose::Plan, &subject, src, &mut dst)?;
            std::io::Write::flush(&mut dst).map_err(io("writing the saved plan"))?;
            return Ok(streamed.sha256_hex());
        }
        // A whole-object seal from before chunking (at most the old 19 MiB limit).
        let sealed = std::fs::read(&staged).map_err(io("reading the sealed plan"))?;
        let mut plain = sealer.unseal(Purpose::Plan, &subject, &sealed)?;
        std::io::Write::write_all(&mut dst, &plain).map_err(io("writing the saved plan"))?;
        std::io::Write::flush(&mut dst).map_err(io("writing the saved plan"))?;
        let digest = takosumi_store::sha256_hex(&plain);
        zeroize::Zeroize::zeroize(&mut plain);
        Ok(digest)
    })
    .await
    .map_err(|e| PlanFetchError::Step(StepError::internal(e)));
    let _ = std::fs::remove_file(scratch);
    let result = match opened? {
        Ok(got) if got == digest => return Ok(()),
        Ok(_) => PlanFetchError::DigestMismatch,
        Err(SealError::UnknownKey { .. }) => PlanFetchError::UnknownKey,
        Err(e @ SealError::Io { .. }) => PlanFetchError::Step(StepError::transient(e)),
        Err(_) => PlanFetchError::DoesNotOpen,
    };
    let _ = ctx.runner.wipe_plan_file(wd);
    Err(result)
}

/// A provider lockfile sealed, stored and read back under the Run's claim.
#[derive(Debug, Clone)]
pub struct StoredLockfile {
    /// Its object key.
    pub key: String,
    /// SHA-256 hex of its bytes.
    pub digest: String,
}

/// Lockfile continuity: the raw bytes right after `init`, sealed and stored under the
/// claim (`attempt`), then read back: the plan succeeds only when the stored artifact
/// reads back as exactly these bytes (an object that was already there, or was altered,
/// is caught here), and over 1 MiB it fails `lockfile_too_large`.
pub async fn store_lockfile(
    ctx: &Ctx,
    run_id: takosumi_core::RunId,
    attempt: i32,
    bytes: &[u8],
) -> Result<StoredLockfile, EnvError> {
    if bytes.len() as u64 > takosumi_runner::MAX_LOCKFILE_BYTES {
        return Err(EnvError::Fail(
            FailureCode::LockfileTooLarge,
            format!(
                "the provider lockfile is {} bytes, over the {}-byte limit",
                bytes.len(),
                takosumi_runner::MAX_LOCKFILE_BYTES
            ),
        ));
    }
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
    match ctx.load_lockfile(run_id, Some(&key), &digest).await {
        Ok(_) => Ok(StoredLockfile { key, digest }),
        Err(LockfileError::Refused(code, message)) => Err(EnvError::Fail(code, message)),
        Err(LockfileError::Step(e)) => Err(EnvError::Step(e)),
    }
}

/// The root module's variables the configuration declares `sensitive = true`, from
/// `show -json` (`configuration.root_module.variables.<name>.sensitive`).
pub fn declared_sensitive_vars(show: &Value) -> Vec<String> {
    show.pointer("/configuration/root_module/variables")
        .and_then(Value::as_object)
        .map(|vars| {
            vars.iter()
                .filter(|(_, v)| v.get("sensitive") == Some(&Value::Bool(true)))
                .map(|(k, _)| k.clone())
                .collect()
        })
        .unwrap_or_default()
}

/// Commits a plan `owner` holds the claim of. See the module documentation.
pub async fn commit_plan(
    ctx: &Ctx,
    run: &runs::Run,
    owner: &str,
    attempt: i32,
    p: PlanToCommit,
) -> Result<Committed, EnvError> {
    let run_id = run.id;
    if p.plan.is_none() && run.kind != RunKind::DriftCheck {
        return Err(EnvError::Step(StepError::Poison(format!(
            "{run_id} is a {:?} and cannot be recorded without its plan file",
            run.kind
        ))));
    }
    let (lock_digest, lock_key) = match p.lockfile {
        None => (None, None),
        Some(l) => (Some(l.digest), Some(l.key)),
    };
    let changes = count_changes(&p.show);
    // What a cost estimate needs, without a sensitive value (see takosumi_cost).
    let mut resources = serde_json::to_value(takosumi_cost::summarize(
        &p.show,
        takosumi_cost::Catalogue::embedded(),
    ))
    .map_err(StepError::internal)?;
    p.masker.add_plan_sensitive(&p.show);
    p.masker.mask_json(&mut resources);
    // What a reviewer reads (the dashboard's Run page, `takosumi diff`): masked like the
    // summary, so nothing has to unseal the plan's JSON to show it.
    let mut diff =
        serde_json::to_value(takosumi_runner::plan_diff(&p.show)).map_err(StepError::internal)?;
    p.masker.mask_json(&mut diff);
    // The gate reads the saved plan's JSON, never printed text; it holds sensitive values,
    // so it is sealed like the plan file itself.
    let show_key = format!("runs/{run_id}/show.{attempt}.sealed");
    let show_bytes = serde_json::to_vec(&p.show).map_err(StepError::internal)?;
    let sealed_show = ctx
        .sealer
        .seal(Purpose::Plan, &format!("{run_id}:show"), &show_bytes)
        .map_err(StepError::internal)?;
    drop(show_bytes);

    // A drift check reports drift when the tool's exit code says the plan changes
    // something, or `show -json` does (see takosumi_steps::drift_verdict). A check that
    // reports no exit code (an older worker) is judged by `show -json` alone.
    let tool_says_drift = p
        .tool_says_drift
        .or((run.kind == RunKind::DriftCheck).then_some(false));
    let drift = takosumi_steps::drift_verdict(tool_says_drift, &p.show);
    let sensitive_vars = declared_sensitive_vars(&p.show);
    let plan_digest = p.plan.as_ref().map(|p| p.digest.clone());
    let plan_object_key = p.plan.as_ref().map(|p| p.key.clone());
    let dependency_snapshot = dependency_snapshot(&p.modules_digest, lock_digest.as_deref());

    // The record's statements run while the sealed JSON is stored; the transaction commits
    // only once the object is there (the record names it).
    let put_show = ctx.objects.put_if_absent(&show_key, sealed_show);
    let write = async {
        let state_generation = match p.state_generation {
            Some(generation) => generation,
            None => {
                takosumi_store::capsules::get(&ctx.pool, run.capsule_id)
                    .await?
                    .ok_or_else(|| StepError::Poison(format!("capsule of {run_id} is gone")))?
                    .state_generation
            }
        };
        let record = runs::PlanRecord {
            source_commit: p.source.commit.clone(),
            tree_digest: p.source.tree_digest.clone(),
            tool_version: p.tool_version,
            plan_digest,
            plan_object_key,
            lockfile_object_key: lock_key,
            provider_lock_digest: lock_digest,
            dependency_snapshot,
            state_generation,
            changes,
            drift,
            injected_env_names: p.injected_env_names,
            resource_changes: resources,
            plan_diff: diff,
            plan_json_object_key: show_key.clone(),
        };
        let mut data = json!({ "changes": changes, "planDigest": record.plan_digest, "stateGeneration": state_generation });
        if let (Some(d), Some(extra)) = (data.as_object_mut(), p.event_extra.as_object()) {
            d.extend(extra.clone());
        }
        let mut tx = ctx.pool.begin().await.map_err(StoreError::from)?;
        // The record, its `planned` event and the gate's wake-up.
        if !runs::record_plan(&mut tx, run_id, owner, &record, &data).await? {
            return Ok::<_, EnvError>(Err(record));
        }
        takosumi_store::capsules::add_sensitive_var_names(&mut tx, run.capsule_id, &sensitive_vars)
            .await?;
        // A drift check replaces the plan an earlier check kept, and keeps its own only when
        // it found drift (that plan is what a reconcile carries out).
        let mut dropped = Vec::new();
        if run.kind == RunKind::DriftCheck {
            dropped = takosumi_store::drift::drop_kept_drift_plans(&mut tx, run.capsule_id, run_id)
                .await?;
            if record.drift != Some(true)
                && let Some(key) = &record.plan_object_key
            {
                runs::clear_plan_object(&mut tx, run_id).await?;
                dropped.push(key.clone());
            }
        }
        Ok(Ok((tx, dropped)))
    };
    let (put, written) = tokio::join!(put_show, write);
    // Either failing drops the transaction uncommitted.
    let written = written?;
    put.map_err(object_err)?;
    let (tx, dropped) = match written {
        Ok(written) => written,
        Err(record) => {
            // This claim's objects: the Run is another claim's now, under other keys.
            let claim = [
                record.plan_object_key,
                record.lockfile_object_key,
                Some(record.plan_json_object_key),
            ];
            discard_unrecorded(ctx, run_id, claim.into_iter().flatten()).await;
            return Ok(Committed::LeaseLost);
        }
    };
    tx.commit().await.map_err(StoreError::from)?;
    ctx.relay_wake.notify_one();
    for key in dropped {
        if let Err(e) = ctx.objects.delete(&key).await {
            tracing::warn!(%run_id, error = %e, "could not delete a replaced drift plan; it stays sealed");
        }
    }
    Ok(Committed::Done)
}

/// Deletes objects a plan claim stored that no Run record references: the claim stopped
/// before its commit (the tool failed after the plan file or lockfile was kept, the lease
/// was lost) and nothing would ever read or delete them. Keys are per claim
/// ([`crate::step::plan_key`]), so a later claim of the same Run never shares one. Best
/// effort: an object that cannot be deleted stays sealed, and the failure is logged.
pub async fn discard_unrecorded(
    ctx: &Ctx,
    run_id: takosumi_core::RunId,
    keys: impl IntoIterator<Item = String>,
) {
    for key in keys {
        if let Err(e) = ctx.objects.delete(&key).await {
            tracing::warn!(%run_id, %key, error = %e, "could not delete an unrecorded plan object; it stays sealed");
        }
    }
}

/// The largest sealed `show -json` read back.
const MAX_PLAN_JSON: u64 = 64 * 1024 * 1024;

/// The saved plan's `show -json`, sealed by the plan step under `<plan run id>:show` (the
/// gate's policy input; the apply's sensitive values, instead of running `show` again).
pub async fn read_plan_json(
    ctx: &Ctx,
    plan_run_id: takosumi_core::RunId,
) -> Result<serde_json::Value, StepError> {
    let fields = takosumi_store::runs::hold::gate_fields(&ctx.pool, plan_run_id)
        .await?
        .ok_or_else(|| StepError::Poison(format!("plan {plan_run_id} vanished")))?;
    let key = fields.plan_json_object_key.ok_or_else(|| {
        StepError::Internal(format!("plan {plan_run_id} kept no plan JSON").into())
    })?;
    read_plan_json_at(ctx, plan_run_id, &key).await
}

/// [`read_plan_json`] when its key (the plan Run's `plan_json_object_key`) is known.
pub async fn read_plan_json_at(
    ctx: &Ctx,
    plan_run_id: takosumi_core::RunId,
    key: &str,
) -> Result<serde_json::Value, StepError> {
    let sealed = ctx
        .objects
        .get(key, MAX_PLAN_JSON)
        .await
        .map_err(object_err)?;
    let bytes = ctx
        .sealer
        .unseal(Purpose::Plan, &format!("{plan_run_id}:show"), &sealed)
        .map_err(StepError::internal)?;
    serde_json::from_slice(&bytes).map_err(StepError::internal)
}
