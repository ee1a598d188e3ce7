//! What a handler reads from a request before it does anything: the JSON body, an id from
//! the path, the `Idempotency-Key`, a name, and the Workspace, Capsule, Run or RunGroup the
//! path names, loaded and access-checked. Every endpoint answers a bad id, a missing row or
//! a foreign Workspace the same way because they all go through here. The row the access
//! guard already read to find the path's Workspace is taken from the [`Caller`], not read
//! again: one read per request, whichever checks it.

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use takosumi_core::{CapsuleId, RunGroupId, RunId, WorkspaceId};
use takosumi_store::{capsules, groups, runs};

use crate::auth::{Action, Caller, Prefetched};
use crate::error::ErrorCode;
use crate::{ApiError, AppState};

/// The JSON body; an empty one is refused with a hint rather than serde's message, one with
/// a NUL character as [`refuse_nul`] says.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    refuse_nul(body)?;
    parse_worker_body(body)
}

/// A relay worker's JSON body, parsed as [`parse_body`] does but with a NUL character let
/// through: a worker's report carries what the tool printed, where a NUL is data, and each
/// report decides what becomes of it (a log shows it as U+FFFD, an event that holds one is
/// refused as `invalid_event`).
pub(crate) fn parse_worker_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid_json(
            "the request body is empty; send a JSON object",
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_json(format!("the request body is not valid: {e}")))
}

/// An optional JSON body: empty (or only whitespace) is `T::default()`.
pub(crate) fn optional_body<T: DeserializeOwned + Default>(body: &Bytes) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    refuse_nul(body)?;
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_json(format!("the request body is not valid: {e}")))
}

/// Refuses a JSON body with a NUL character in a string (written `\u0000`: JSON has no
/// other way to carry one). Nothing the API stores can hold it (Postgres text and jsonb
/// refuse it), so it is refused before anything reads the body, whatever field it is in.
pub(crate) fn refuse_nul(body: &[u8]) -> Result<(), ApiError> {
    if json_holds_nul(body) {
        return Err(ApiError::invalid_json(
            "a string in the request body holds a NUL character (\\u0000); remove it",
        ));
    }
    Ok(())
}

/// Whether a JSON text has the escape `\u0000`. A backslash appears only inside strings and
/// starts an escape of two characters (or six, `\uXXXX`), so `\\u0000` (a backslash, then
/// the text `u0000`) is not one.
fn json_holds_nul(body: &[u8]) -> bool {
    let mut i = 0;
    while i < body.len() {
        if body[i] == b'\\' {
            if body.get(i + 1) == Some(&b'u') && body.get(i + 2..i + 6) == Some(b"0000") {
                return true;
            }
            i += 2;
        } else {
            i += 1;
        }
    }
    false
}

/// An id from the path or the body: 400 `invalid_id` when it is not one.
pub(crate) fn parse_id<T: std::str::FromStr<Err = takosumi_core::IdParseError>>(
    raw: &str,
) -> Result<T, ApiError> {
    raw.parse().map_err(|e: takosumi_core::IdParseError| {
        ApiError::client(StatusCode::BAD_REQUEST, ErrorCode::InvalidId, e.to_string())
    })
}

/// A page size from the query string: `default` when absent, else a whole number from 1 to
/// `max` (400 `invalid_limit`, naming the range, otherwise).
pub(crate) fn page_limit(raw: Option<&str>, default: i64, max: i64) -> Result<i64, ApiError> {
    let Some(raw) = raw else {
        return Ok(default);
    };
    raw.parse::<i64>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| {
            ApiError::invalid(
                ErrorCode::InvalidLimit,
                format!("limit must be a whole number from 1 to {max}"),
            )
        })
}

/// The `Idempotency-Key` header, if sent.
pub(crate) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = v.to_str().map_err(|_| {
        ApiError::invalid(
            ErrorCode::InvalidIdempotencyKey,
            "Idempotency-Key must be printable text",
        )
    })?;
    if key.is_empty() || key.len() > 200 {
        return Err(ApiError::invalid(
            ErrorCode::InvalidIdempotencyKey,
            "Idempotency-Key must be 1 to 200 characters",
        ));
    }
    Ok(Some(key.to_owned()))
}

/// A name people give a Workspace, Capsule, binding or pool: 1-64 letters, digits, `-`,
/// `_` or `.`, starting with a letter or digit.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
}

/// The Workspace `raw` names, where the caller may do `action`. A token of another
/// Workspace is told it does not exist before anything is looked up; a role that may not
/// do `action` is refused only once the Workspace is known to exist, so an unknown id is
/// 404 whoever asks.
pub(crate) async fn workspace(
    st: &AppState,
    caller: &Caller,
    raw: &str,
    action: Action,
) -> Result<WorkspaceId, ApiError> {
    let ws: WorkspaceId = parse_id(raw)?;
    caller.require(Action::Read, Some(ws))?;
    let known = matches!(caller.1, Prefetched::Workspace(read) if read == ws)
        || st.workspaces.exists(&st.pool, ws).await?;
    if !known {
        return Err(ApiError::not_found(&format!("Workspace {ws}")));
    }
    caller.require(action, Some(ws))?;
    Ok(ws)
}

/// The Capsule `raw` names, where the caller may do `action` in its Workspace (a token of
/// another Workspace is told it does not exist).
pub(crate) async fn capsule(
    st: &AppState,
    caller: &Caller,
    raw: &str,
    action: Action,
) -> Result<capsules::Capsule, ApiError> {
    let id: CapsuleId = parse_id(raw)?;
    let capsule = match &caller.1 {
        Prefetched::Capsule(read) if read.id == id => capsules::Capsule::clone(read),
        _ => capsules::get(&st.pool, id)
            .await?
            .ok_or_else(|| ApiError::not_found(&format!("Capsule {id}")))?,
    };
    caller.require(Action::Read, Some(capsule.workspace_id))?;
    caller.require(action, Some(capsule.workspace_id))?;
    Ok(capsule)
}

/// The Run `raw` names, where the caller may do `action` in its Workspace.
pub(crate) async fn run(
    st: &AppState,
    caller: &Caller,
    raw: &str,
    action: Action,
) -> Result<runs::Run, ApiError> {
    let id: RunId = parse_id(raw)?;
    let run = match &caller.1 {
        Prefetched::Run(read) if read.id == id => runs::Run::clone(read),
        _ => runs::get(&st.pool, id)
            .await?
            .ok_or_else(|| ApiError::not_found(&format!("Run {id}")))?,
    };
    caller.require(Action::Read, Some(run.workspace_id))?;
    caller.require(action, Some(run.workspace_id))?;
    Ok(run)
}

/// The RunGroup `raw` names, where the caller may do `action` in its Workspace.
pub(crate) async fn run_group(
    st: &AppState,
    caller: &Caller,
    raw: &str,
    action: Action,
) -> Result<groups::RunGroup, ApiError> {
    let id: RunGroupId = parse_id(raw)?;
    let group = groups::group(&st.pool, id)
        .await?
        .ok_or_else(|| ApiError::not_found(&format!("RunGroup {id}")))?;
    caller.require(Action::Read, Some(group.workspace_id))?;
    caller.require(action, Some(group.workspace_id))?;
    Ok(group)
}

#[cfg(test)]
mod tests {
    use super::json_holds_nul;

    #[test]
    fn a_nul_escape_is_found_and_an_escaped_backslash_is_not_one() {
        assert!(json_holds_nul(br#"{"a":"x\u0000y"}"#));
        assert!(json_holds_nul(br#"{"a\u0000":1}"#));
        assert!(json_holds_nul(br#"["\\\u0000"]"#));
        assert!(!json_holds_nul(br#"{"a":"x\\u0000y"}"#));
        assert!(json_holds_nul(br#"{"a":"\u00000"}"#));
        assert!(!json_holds_nul(br#"{"a":"\u0001 \u1000"}"#));
        assert!(!json_holds_nul(br#"{"a":"\u0010","b":"u0000"}"#));
    }
}
