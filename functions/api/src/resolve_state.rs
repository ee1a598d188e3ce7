//! The operator actions that resolve an `unknown_outcome` apply by giving the Capsule a
//! state (`POST /runs/{id}/resolve`, admin only; `mark_resolved` lives in `records`).
//!
//! - `restore_held_state`: the state the apply's tool wrote, kept sealed in `held_states`
//!   because object storage would not take it, becomes the Capsule's next StateVersion.
//!   It keeps the StateVersion id it was sealed under (the seal's subject does not change,
//!   so the sealed bytes are copied as they are, after checking they open and hash to the
//!   recorded digest), and it is written against the generation the apply started from.
//! - `attach_state`: a Terraform state (format version 4) the operator pulled from the
//!   provider side is checked (format, size, lineage against the Capsule's current state,
//!   serial not older), sealed under a new StateVersion id and stored as the next
//!   StateVersion, against the generation that lineage check read. It is stored as the
//!   compact re-serialization of the JSON received (the API parses the request; the
//!   digest is of the stored bytes), which Terraform reads like its own pretty form.
//!
//! Both write through the generation compare-and-set, and resolve the Run in the same
//! transaction with a conditional update, so a second request (or a racing one) finds the
//! Run resolved or the generation moved and changes nothing. The state's content never
//! appears in a log, event, error or response: only its digest, serial, lineage and size.

use axum::http::StatusCode;
use serde_json::{Value, json};
use takosumi_core::{ActivityKind, EventKind, ResolutionAction, StateVersionId};
use takosumi_objects::{ObjectError, PutOutcome};
use takosumi_runtime::step::{MAX_STATE_BYTES, state_key};
use takosumi_seal::Purpose;
use takosumi_store::states::versions::{self, StateVersion};
use takosumi_store::{activity, capsules, events, runs, states};
use zeroize::Zeroize;

use crate::error::ErrorCode;
use crate::{ApiError, AppState};

/// The largest state `attach_state` takes (its compact JSON).
pub(crate) const MAX_ATTACHED_STATE_BYTES: usize = 8 * 1024 * 1024;
/// The largest resolve request body: an attached state and room for the note.
pub(crate) const RESOLVE_BODY_LIMIT: usize = MAX_ATTACHED_STATE_BYTES + 64 * 1024;

fn internal(e: impl std::error::Error + Send + Sync + 'static) -> ApiError {
    ApiError::Internal {
        transient: false,
        source: Box::new(e),
    }
}

fn object_error(e: ObjectError) -> ApiError {
    ApiError::Internal {
        transient: e.retryable(),
        source: Box::new(e),
    }
}

/// 413 for a state over [`MAX_ATTACHED_STATE_BYTES`].
pub(crate) fn too_large(size: Option<usize>) -> ApiError {
    let what = match size {
        Some(n) => format!("the attached state is {n} bytes"),
        None => "the request is larger than an attached state may be".to_owned(),
    };
    ApiError::client(
        StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::StateTooLarge,
        format!(
            "{what}; the limit is {MAX_ATTACHED_STATE_BYTES} bytes (8 MiB). Nothing was changed"
        ),
    )
}

/// What Takosumi reads from a state: never its content.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    lineage: String,
    serial: u64,
}

fn invalid_state(what: &str) -> ApiError {
    ApiError::invalid(
        ErrorCode::InvalidState,
        format!(
            "state must be a Terraform state in format version 4 (the JSON `terraform state pull` prints): {what}. Nothing was changed"
        ),
    )
}

/// Checks the shape of a format-version-4 state. The messages name fields, never values.
fn identity(state: &Value) -> Result<Identity, ApiError> {
    let Value::Object(m) = state else {
        return Err(invalid_state("it is not a JSON object"));
    };
    if m.get("version").and_then(Value::as_u64) != Some(4) {
        return Err(invalid_state("`version` must be the number 4"));
    }
    let lineage = match m.get("lineage") {
        Some(Value::String(s)) if !s.trim().is_empty() && s.len() <= 200 => s.clone(),
        _ => return Err(invalid_state("`lineage` must be a non-empty string")),
    };
    let Some(serial) = m.get("serial").and_then(Value::as_u64) else {
        return Err(invalid_state(
            "`serial` must be a non-negative whole number",
        ));
    };
    if !m.get("resources").is_some_and(Value::is_array) {
        return Err(invalid_state("`resources` must be an array"));
    }
    Ok(Identity { lineage, serial })
}

/// Lineage and serial of the Capsule's current state, opened and checked the way a plan
/// restores it. `None`: the Capsule has no state yet.
async fn current_identity(
    st: &AppState,
    current: Option<StateVersionId>,
) -> Result<Option<(StateVersionId, Identity)>, ApiError> {
    let Some(sv_id) = current else {
        return Ok(None);
    };
    let sv = versions::get(&st.pool, sv_id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Capsule's current StateVersion"))?;
    let unreadable = || {
        ApiError::conflict(
            ErrorCode::CurrentStateUnreadable,
            format!(
                "the Capsule's current state ({sv_id}, generation {}) cannot be read back intact, so the attached state's lineage cannot be checked against it; nothing was changed",
                sv.generation
            ),
        )
    };
    let sealed = match st.objects.get(&sv.object_key, MAX_STATE_BYTES).await {
        Ok(s) => s,
        Err(ObjectError::NotFound) => return Err(unreadable()),
        Err(e) => return Err(object_error(e)),
    };
    let Ok(mut plain) = st
        .sealer
        .unseal(Purpose::State, &sv_id.to_string(), &sealed)
    else {
        return Err(unreadable());
    };
    let parsed = (takosumi_store::sha256_hex(&plain) == sv.digest)
        .then(|| serde_json::from_slice::<Value>(&plain).ok())
        .flatten();
    plain.zeroize();
    let Some(value) = parsed else {
        return Err(unreadable());
    };
    let id = identity(&value).map_err(|_| unreadable())?;
    Ok(Some((sv_id, id)))
}

/// What a resolution writes, beside the Run's resolution itself.
struct Written<'a> {
    action: ResolutionAction,
    note: &'a str,
    sv: StateVersion,
    size: i64,
    /// The generation the compare-and-set expects.
    expected: i64,
    /// Safe facts about the state for the record (digest, serial, lineage…).
    facts: Value,
    /// The held state this is, if any.
    held: Option<StateVersionId>,
}

enum Refused {
    AlreadyResolved,
    GenerationMoved { now: i64 },
    CapsuleBusy,
}

/// Resolves the Run, inserts the StateVersion and moves the generation, with the events
/// and activity, in one transaction; any refusal rolls all of it back.
async fn commit(
    st: &AppState,
    run: &runs::Run,
    actor: &str,
    w: &Written<'_>,
) -> Result<(), ApiError> {
    let refused = {
        let mut tx = st.pool.begin().await?;
        if !runs::unknown::resolve_unknown(&mut tx, run.id, w.action, actor, w.note).await? {
            Some(Refused::AlreadyResolved)
        } else {
            let written = versions::record_written(
                &mut tx,
                &w.sv,
                w.size,
                w.expected,
                versions::Writer::Resolution { by: w.action },
                actor,
                run.workspace_id,
            )
            .await?;
            if written {
                runs::unknown::set_run_state_version(&mut tx, run.id, w.sv.id, w.sv.generation)
                    .await?;
                if let Some(held) = w.held {
                    states::held::mark_held_stored(&mut tx, held).await?;
                }
                let mut facts = w.facts.clone();
                facts["stateVersionId"] = json!(w.sv.id);
                facts["generation"] = json!(w.sv.generation);
                let mut event = facts.clone();
                event["action"] = json!(w.action);
                event["note"] = json!(w.note);
                events::append(tx.db(), run.id, EventKind::Resolved, actor, event.clone()).await?;
                event["capsuleId"] = json!(run.capsule_id);
                activity::append(
                    tx.db(),
                    run.workspace_id,
                    ActivityKind::RunResolved,
                    &run.id.to_string(),
                    actor,
                    event,
                )
                .await?;
                tx.commit().await?;
                None
            } else {
                drop(tx);
                let capsule = capsules::get(&st.pool, run.capsule_id)
                    .await?
                    .ok_or_else(|| ApiError::not_found("the Capsule"))?;
                Some(if capsule.state_generation != w.expected {
                    Refused::GenerationMoved {
                        now: capsule.state_generation,
                    }
                } else {
                    Refused::CapsuleBusy
                })
            }
        }
    };
    match refused {
        None => Ok(()),
        Some(Refused::AlreadyResolved) => Err(already_resolved(run)),
        Some(Refused::GenerationMoved { now }) => Err(generation_moved(w.expected, now)),
        Some(Refused::CapsuleBusy) => Err(ApiError::conflict(
            ErrorCode::CapsuleBusy,
            "an apply holds the Capsule right now; nothing was changed. Try again when it ends",
        )),
    }
}

pub(crate) fn already_resolved(run: &runs::Run) -> ApiError {
    ApiError::conflict(
        ErrorCode::AlreadyResolved,
        format!(
            "{} was already resolved; nothing was changed. See its events for how",
            run.id
        ),
    )
}

fn generation_moved(expected: i64, now: i64) -> ApiError {
    ApiError::conflict(
        ErrorCode::StateGenerationChanged,
        format!(
            "the Capsule's state moved to generation {now} since this state was based on generation {expected}; \
             nothing was changed. Inspect the Capsule's current StateVersion, then attach a state pulled from \
             the provider side or mark the Run resolved"
        ),
    )
}

/// `restore_held_state`: see the module docs.
pub(crate) async fn restore_held_state(
    st: &AppState,
    run: &runs::Run,
    actor: &str,
    note: &str,
) -> Result<(), ApiError> {
    let Some(held) = states::held::latest_held(&st.pool, run.id).await? else {
        return Err(ApiError::conflict(
            ErrorCode::NoHeldState,
            format!(
                "{} has no held state (its state was stored, or the tool wrote none, or it could not be kept); \
                 attach a state pulled from the provider side (`attach_state`) or mark it resolved",
                run.id
            ),
        ));
    };
    let expected = held.generation - 1;
    let capsule = capsules::get(&st.pool, run.capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Capsule"))?;
    if capsule.state_generation != expected {
        return Err(generation_moved(expected, capsule.state_generation));
    }
    // The held bytes must open under their own id and hash to the recorded digest before
    // they become anybody's state.
    let Ok(mut plain) = st.sealer.unseal(
        Purpose::State,
        &held.state_version_id.to_string(),
        &held.sealed,
    ) else {
        return Err(ApiError::conflict(
            ErrorCode::HeldStateUnreadable,
            "the held state does not open with this server's keys; nothing was changed. Attach a state pulled from the provider side instead",
        ));
    };
    let intact = takosumi_store::sha256_hex(&plain) == held.digest;
    let facts = serde_json::from_slice::<Value>(&plain)
        .ok()
        .and_then(|v| identity(&v).ok());
    plain.zeroize();
    if !intact {
        return Err(ApiError::conflict(
            ErrorCode::HeldStateUnreadable,
            "the held state does not match its recorded digest; nothing was changed. Attach a state pulled from the provider side instead",
        ));
    }
    // Its key was never written by anything else: an object already there is an earlier
    // attempt of this same put (or the apply's put whose answer was lost), with these bytes.
    match st
        .objects
        .put_if_absent(&held.object_key, held.sealed.clone())
        .await
        .map_err(object_error)?
    {
        PutOutcome::Created => {}
        PutOutcome::AlreadyExists => {
            let there = st
                .objects
                .get(&held.object_key, MAX_STATE_BYTES)
                .await
                .map_err(object_error)?;
            if there != held.sealed {
                return Err(internal(takosumi_store::StoreError::Conflict(
                    "another object already has the held state's key",
                )));
            }
        }
    }
    let sv = StateVersion {
        id: held.state_version_id,
        capsule_id: run.capsule_id,
        generation: held.generation,
        run_id: run.id,
        object_key: held.object_key.clone(),
        digest: held.digest.clone(),
    };
    let w = Written {
        action: ResolutionAction::RestoreHeldState,
        note,
        sv,
        size: held.size_bytes,
        expected,
        facts: json!({
            "digest": held.digest,
            "sizeBytes": held.size_bytes,
            "serial": facts.as_ref().map(|f| f.serial),
            "lineage": facts.as_ref().map(|f| f.lineage.clone()),
            "heldStates": held.count,
        }),
        held: Some(held.state_version_id),
    };
    // The object stays on a refusal: it is the held state's own key, and a racing
    // request that won may point its StateVersion at it.
    commit(st, run, actor, &w).await
}

/// `attach_state`: see the module docs. `state` is dropped before anything is stored.
pub(crate) async fn attach_state(
    st: &AppState,
    run: &runs::Run,
    actor: &str,
    note: &str,
    state: Value,
) -> Result<(), ApiError> {
    let id = identity(&state)?;
    let mut bytes = serde_json::to_vec(&state).map_err(internal)?;
    drop(state);
    if bytes.len() > MAX_ATTACHED_STATE_BYTES {
        let n = bytes.len();
        bytes.zeroize();
        return Err(too_large(Some(n)));
    }
    let result = attach_bytes(st, run, actor, note, &id, &bytes).await;
    bytes.zeroize();
    result
}

async fn attach_bytes(
    st: &AppState,
    run: &runs::Run,
    actor: &str,
    note: &str,
    id: &Identity,
    bytes: &[u8],
) -> Result<(), ApiError> {
    let capsule = capsules::get(&st.pool, run.capsule_id)
        .await?
        .ok_or_else(|| ApiError::not_found("the Capsule"))?;
    let expected = capsule.state_generation;
    if let Some((current_id, current)) =
        current_identity(st, capsule.current_state_version_id).await?
    {
        if current.lineage != id.lineage {
            return Err(ApiError::conflict(
                ErrorCode::StateLineageMismatch,
                format!(
                    "the attached state's lineage is {} but the Capsule's current state ({current_id}) has lineage {}: \
                     it is the state of another configuration or workspace; nothing was changed",
                    id.lineage, current.lineage
                ),
            ));
        }
        if id.serial < current.serial {
            return Err(ApiError::conflict(
                ErrorCode::StateSerialOlder,
                format!(
                    "the attached state's serial {} is older than the Capsule's current state's ({current_id}, serial {}); \
                     pull the newest state from the provider side; nothing was changed",
                    id.serial, current.serial
                ),
            ));
        }
    }
    let sv_id = StateVersionId::new();
    let key = state_key(run.capsule_id, sv_id);
    let sealed = st
        .sealer
        .seal(Purpose::State, &sv_id.to_string(), bytes)
        .map_err(internal)?;
    st.objects
        .put_if_absent(&key, sealed)
        .await
        .map_err(object_error)?;
    let size = i64::try_from(bytes.len()).unwrap_or(i64::MAX);
    let digest = takosumi_store::sha256_hex(bytes);
    let w = Written {
        action: ResolutionAction::AttachState,
        note,
        sv: StateVersion {
            id: sv_id,
            capsule_id: run.capsule_id,
            generation: expected + 1,
            run_id: run.id,
            object_key: key.clone(),
            digest: digest.clone(),
        },
        size,
        expected,
        facts: json!({
            "digest": digest, "sizeBytes": size, "serial": id.serial, "lineage": id.lineage,
        }),
        held: None,
    };
    let committed = commit(st, run, actor, &w).await;
    if committed.is_err() {
        // Nothing points at the new object: it goes (a fresh key, only this request's).
        if let Err(e) = st.objects.delete(&key).await {
            tracing::warn!(run_id = %run.id, error = %e, "could not delete an attached state that was not recorded; it stays sealed");
        }
    }
    committed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_takes_a_version_4_state_and_never_echoes_values() {
        let ok = json!({"version": 4, "lineage": "l-1", "serial": 3, "resources": [], "terraform_version": "1.0.3"});
        assert_eq!(
            identity(&ok).ok(),
            Some(Identity {
                lineage: "l-1".into(),
                serial: 3
            })
        );
        for bad in [
            json!("canary-secret"),
            json!({"version": 3, "lineage": "l", "serial": 1, "resources": []}),
            json!({"version": "4", "lineage": "l", "serial": 1, "resources": []}),
            json!({"version": 4, "lineage": 7, "serial": 1, "resources": []}),
            json!({"version": 4, "lineage": "", "serial": 1, "resources": []}),
            json!({"version": 4, "lineage": "l", "serial": -1, "resources": []}),
            json!({"version": 4, "lineage": "l", "serial": "canary-secret", "resources": []}),
            json!({"version": 4, "lineage": "l", "serial": 1, "resources": {"canary-secret": 1}}),
        ] {
            let Err(ApiError::Client {
                status,
                code,
                message,
            }) = identity(&bad)
            else {
                panic!("accepted {bad}");
            };
            assert_eq!(
                (status, code),
                (StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::InvalidState)
            );
            assert!(!message.contains("canary-secret"), "{message}");
        }
    }
}
