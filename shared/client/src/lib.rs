//! The typed HTTP client for the Takosumi API, used by the `takosumi` CLI,
//! the end-to-end tests and users' scripts.
//!
//! This crate owns the client side of the API contract: the JSON shapes of Workspaces,
//! Capsules, Runs, Run events and logs as the API serves them (camelCase, decoded
//! tolerantly: fields that do not apply may be `null` or absent, unknown fields are kept),
//! the Bearer-token authentication, the `Idempotency-Key` header on submissions, the
//! mapping of `{"code", "message"}` error bodies to [`ClientError::Api`], and waiting for
//! a Run to settle. It holds no state besides the base URL and the token; the token is never
//! printed by `Debug` and never appears in an error.

#![deny(missing_docs)]

use std::fmt;
use std::time::Duration;

use reqwest::header::HeaderValue;
use reqwest::{Method, RequestBuilder};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use takosumi_core::Secret;

mod bindings;
mod dead_letters;
pub mod evidence;
mod gates;
pub use gates::GroupAction;
mod listing;
mod pools;
mod records;
mod tokens;
mod watch;

pub use bindings::{NewProviderBinding, PlanRequest, ProviderBinding, ProviderBindingId};
pub use dead_letters::{
    DeadLetter, DeadLetterSelection, DeadLetters, DeadQueue, PurgeResult, RequeueResult,
    RequeuedLetter, SkippedLetter,
};
pub use pools::{CreatedPool, DeliveryKey, Pool};
pub use records::{Cost, RunQuery};
pub use takosumi_core::{
    ActorKind, ApplyMode, CapsuleId, CapsuleStatus, Changes, EventKind, ResolutionAction,
    RunGroupId, RunId, RunKind, RunStatus, StateVersionId, TokenId, WorkspaceId,
};
pub use takosumi_cost::{Amounts, CostEstimate, ResourceCost, UnpricedResource};
pub(crate) use takosumi_wire::null_as_default;
pub use takosumi_wire::{
    ActivityEntry, ActivityPage, Actor, ApprovalsView, AttributeDiff, Capsule, CapsuleList,
    EventList, GivenApproval, Hold, LogEntry, LogList, NewCapsule, PlanDiff, PlanView, Resolution,
    ResourceDiff, Run, RunErrorBody, RunEvent, RunGroup, RunPage, Source, SourceSnapshot,
    StreamEvent, UsedBinding, Workspace, WorkspaceList, join_logs,
};
pub use takosumi_wire::{
    ApplySubmitted, ApprovalCount, Approved, GroupResult, GroupResults, GroupStarted, ResultError,
    RulesAnswer, SkippedCapsule,
};
pub use takosumi_wire::{Code, ErrorCode, KnownCode};
pub use takosumi_wire::{CreatedToken, NewToken, TokenList, TokenView};

/// The API's address when `TAKOSUMI_DEPLOY_CONTROL_URL` is not set.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";
/// The environment variable holding the API's base URL.
pub const URL_ENV: &str = "TAKOSUMI_DEPLOY_CONTROL_URL";
/// The environment variable holding the API token.
pub const TOKEN_ENV: &str = "TAKOSUMI_DEPLOY_CONTROL_TOKEN";
/// How often [`Client::wait`] polls the Run.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Consecutive transient failures (transport errors, 502/503/504) [`Client::wait`] rides out
/// before it gives up and returns the last one.
const WAIT_TRANSIENT_ERRORS: u32 = 5;
/// How much of a non-JSON error body is quoted in [`ClientError::Api`]'s message.
const ERROR_SNIPPET_CHARS: usize = 200;

// ---------------------------------------------------------------------------------------
// Errors

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The API answered with a 4xx/5xx status. `code` is the stable machine-readable code
    /// from the `{"code", "message"}` body (or a code derived from the status when the body
    /// was not one), `message` tells a person what to do next.
    #[error("{message} ({code}, HTTP {status})")]
    Api {
        /// The HTTP status.
        status: u16,
        /// The stable error code (`not_found`, `unauthorized`, …); one this client does not
        /// know (a newer API's) is kept as its text.
        code: Code,
        /// The human message.
        message: String,
    },
    /// The request never got an answer: connection refused, DNS, TLS, timeout.
    #[error("the Takosumi API at {url} could not be reached")]
    Http {
        /// The API base URL the client was configured with.
        url: String,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The API answered with a success status but a body this client cannot read.
    #[error("the API's answer to {request} could not be read")]
    Decode {
        /// The request, e.g. `GET /api/v1/runs/run_…`.
        request: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The client is misconfigured (missing token, bad URL, bad header value); no request
    /// was sent.
    #[error("{0}")]
    Config(String),
    /// [`Client::wait`] gave up before the Run reached a terminal or held status.
    #[error("gave up waiting for {run}: it is still {}", last_status.as_str())]
    Timeout {
        /// The Run waited for.
        run: RunId,
        /// Its status at the last poll.
        last_status: RunStatus,
    },
}

impl ClientError {
    /// The API's error code as its wire string, for [`ClientError::Api`].
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Api { code, .. } => Some(code.as_str()),
            _ => None,
        }
    }

    /// The API's error code, for [`ClientError::Api`] with a code this client knows.
    pub fn known_code(&self) -> Option<ErrorCode> {
        match self {
            Self::Api { code, .. } => code.known(),
            _ => None,
        }
    }

    /// The HTTP status, for [`ClientError::Api`].
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the connection to the API was refused (nothing listens at the URL).
    pub fn is_connection_refused(&self) -> bool {
        let Self::Http { source, .. } = self else {
            return false;
        };
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source);
        while let Some(err) = cause {
            if let Some(io) = err.downcast_ref::<std::io::Error>()
                && io.kind() == std::io::ErrorKind::ConnectionRefused
            {
                return true;
            }
            cause = err.source();
        }
        false
    }

    /// A failure that may pass if the same read is tried again: a transport error or a
    /// 502/503/504 from a proxy in front of the API.
    fn is_transient(&self) -> bool {
        match self {
            Self::Http { .. } => true,
            Self::Api { status, .. } => matches!(status, 502..=504),
            _ => false,
        }
    }

    /// Builds the error for a 4xx/5xx answer from its body.
    fn from_error_body(status: reqwest::StatusCode, body: &[u8]) -> Self {
        #[derive(Deserialize)]
        struct Body {
            code: Code,
            #[serde(default)]
            message: Option<String>,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Shape {
            Flat(Body),
            Nested { error: Body },
        }
        let parsed = serde_json::from_slice::<Shape>(body)
            .ok()
            .map(|shape| match shape {
                Shape::Flat(b) | Shape::Nested { error: b } => b,
            });
        let reason = status.canonical_reason().unwrap_or("error");
        match parsed {
            Some(Body { code, message }) => Self::Api {
                status: status.as_u16(),
                code,
                message: message
                    .filter(|m| !m.is_empty())
                    .unwrap_or_else(|| reason.to_owned()),
            },
            None => {
                let code = match status.as_u16() {
                    // Not an API code: kept as the text scripts have matched on.
                    400 => Code::Other("bad_request".to_owned()),
                    401 => ErrorCode::Unauthorized.into(),
                    403 => ErrorCode::Forbidden.into(),
                    404 => ErrorCode::NotFound.into(),
                    409 => ErrorCode::Conflict.into(),
                    other => Code::Other(format!("http_{other}")),
                };
                let text = String::from_utf8_lossy(body);
                let text = text.trim();
                let message = if text.is_empty() {
                    format!("the API answered {} {reason}", status.as_u16())
                } else {
                    let snippet: String = text.chars().take(ERROR_SNIPPET_CHARS).collect();
                    let more = if text.chars().count() > ERROR_SNIPPET_CHARS {
                        "…"
                    } else {
                        ""
                    };
                    format!(
                        "the API answered {} {reason}: {snippet}{more}",
                        status.as_u16()
                    )
                };
                Self::Api {
                    status: status.as_u16(),
                    code,
                    message,
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Types

#[derive(Deserialize)]
struct EventsBody {
    #[serde(default, deserialize_with = "null_as_default")]
    events: Vec<RunEvent>,
}

#[derive(Deserialize)]
struct LogsBody {
    #[serde(default, deserialize_with = "null_as_default")]
    logs: Vec<LogEntry>,
}

// ---------------------------------------------------------------------------------------
// The client

/// A Takosumi API client: a base URL and a token. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    token: Secret<String>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("base_url", &self.base_url)
            .field("token", &"[redacted]")
            .finish()
    }
}

impl Client {
    /// A client for the API at `base_url` (`http://` or `https://`, optionally with a path
    /// prefix) authenticating with `token`. Sends nothing.
    pub fn new(base_url: &str, token: &str) -> Result<Self, ClientError> {
        let url = reqwest::Url::parse(base_url.trim()).map_err(|e| {
            ClientError::Config(format!("`{base_url}` is not a valid API URL: {e}"))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ClientError::Config(format!(
                "`{base_url}` is not a valid API URL: use http:// or https://"
            )));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(ClientError::Config(format!(
                "`{base_url}` is not a valid API URL: it must not have a query or fragment"
            )));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(ClientError::Config(
                "the API URL must not contain credentials: pass the token separately".to_owned(),
            ));
        }
        if token.is_empty() {
            return Err(ClientError::Config(format!(
                "the API token is empty: set {TOKEN_ENV}"
            )));
        }
        // Never quote the token in the error.
        if HeaderValue::from_str(&format!("Bearer {token}")).is_err()
            || token.chars().any(char::is_whitespace)
        {
            return Err(ClientError::Config(format!(
                "the API token contains characters a token cannot have: check {TOKEN_ENV}"
            )));
        }
        let http = reqwest::Client::builder()
            .user_agent(concat!("takosumi-client/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| {
                ClientError::Config(format!("the HTTP client could not be set up: {e}"))
            })?;
        Ok(Self {
            http,
            base_url: url.as_str().trim_end_matches('/').to_owned(),
            token: Secret::new(token.to_owned()),
        })
    }

    /// A client configured from `TAKOSUMI_DEPLOY_CONTROL_URL` (default
    /// `http://127.0.0.1:8080`) and `TAKOSUMI_DEPLOY_CONTROL_TOKEN` (required).
    pub fn from_env() -> Result<Self, ClientError> {
        let url = match std::env::var(URL_ENV) {
            Ok(url) if !url.trim().is_empty() => url,
            Ok(_) | Err(std::env::VarError::NotPresent) => DEFAULT_URL.to_owned(),
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(ClientError::Config(format!("{URL_ENV} is not valid UTF-8")));
            }
        };
        let token = match std::env::var(TOKEN_ENV) {
            Ok(token) if !token.is_empty() => Secret::new(token),
            Ok(_) | Err(std::env::VarError::NotPresent) => {
                return Err(ClientError::Config(format!(
                    "no API token: set {TOKEN_ENV} to a Takosumi API token"
                )));
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(ClientError::Config(format!(
                    "{TOKEN_ENV} is not valid UTF-8"
                )));
            }
        };
        Self::new(&url, token.expose())
    }

    /// The base URL requests go to (without a trailing slash).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// `POST /api/v1/workspaces` → 201.
    pub async fn create_workspace(&self, name: &str) -> Result<Workspace, ClientError> {
        let path = "/api/v1/workspaces";
        let body = serde_json::json!({ "name": name });
        self.execute(
            Method::POST,
            path,
            self.request(Method::POST, path).json(&body),
        )
        .await
    }

    /// `POST /api/v1/workspaces/{ws}/capsules` → 201.
    pub async fn create_capsule(
        &self,
        ws: WorkspaceId,
        req: &NewCapsule,
    ) -> Result<Capsule, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/capsules");
        self.execute(
            Method::POST,
            &path,
            self.request(Method::POST, &path).json(req),
        )
        .await
    }

    /// `GET /api/v1/capsules/{cap}`.
    pub async fn get_capsule(&self, cap: CapsuleId) -> Result<Capsule, ClientError> {
        let path = format!("/api/v1/capsules/{cap}");
        self.execute(Method::GET, &path, self.request(Method::GET, &path))
            .await
    }

    /// `POST /api/v1/capsules/{cap}/plan` → 202 with the plan Run. The same
    /// `idempotency_key` returns the same Run.
    pub async fn plan(
        &self,
        cap: CapsuleId,
        idempotency_key: Option<&str>,
    ) -> Result<Run, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/plan");
        let rb = self
            .submission(Method::POST, &path, idempotency_key)?
            .json(&serde_json::json!({}));
        self.execute(Method::POST, &path, rb).await
    }

    /// `DELETE /api/v1/capsules/{cap}` → 202 with the destroy plan Run (nothing is
    /// destroyed until that plan is applied).
    pub async fn destroy(
        &self,
        cap: CapsuleId,
        idempotency_key: Option<&str>,
    ) -> Result<Run, ClientError> {
        let path = format!("/api/v1/capsules/{cap}");
        let rb = self.submission(Method::DELETE, &path, idempotency_key)?;
        self.execute(Method::DELETE, &path, rb).await
    }

    /// `POST /api/v1/runs/{run}/apply` → 202 with the Apply Run pinned to `plan_run`.
    pub async fn apply(
        &self,
        plan_run: RunId,
        idempotency_key: Option<&str>,
    ) -> Result<Run, ClientError> {
        let path = format!("/api/v1/runs/{plan_run}/apply");
        let rb = self
            .submission(Method::POST, &path, idempotency_key)?
            .json(&serde_json::json!({}));
        self.execute(Method::POST, &path, rb).await
    }

    /// `GET /api/v1/runs/{run}`.
    pub async fn get_run(&self, run: RunId) -> Result<Run, ClientError> {
        let path = format!("/api/v1/runs/{run}");
        self.execute(Method::GET, &path, self.request(Method::GET, &path))
            .await
    }

    /// `GET /api/v1/runs/{run}/events`: the Run's events in order.
    pub async fn events(&self, run: RunId) -> Result<Vec<RunEvent>, ClientError> {
        let path = format!("/api/v1/runs/{run}/events");
        let body: EventsBody = self
            .execute(Method::GET, &path, self.request(Method::GET, &path))
            .await?;
        Ok(body.events)
    }

    /// `GET /api/v1/runs/{run}/logs`: the Run's masked log chunks in order.
    pub async fn log_entries(&self, run: RunId) -> Result<Vec<LogEntry>, ClientError> {
        let path = format!("/api/v1/runs/{run}/logs");
        let body: LogsBody = self
            .execute(Method::GET, &path, self.request(Method::GET, &path))
            .await?;
        Ok(body.logs)
    }

    /// The Run's masked log as one text, with a `== <step> ==` header wherever the step
    /// changes (see [`join_logs`]).
    pub async fn logs(&self, run: RunId) -> Result<String, ClientError> {
        Ok(join_logs(&self.log_entries(run).await?))
    }

    /// Polls the Run every 200 ms until it is terminal or `held`, and returns it. Gives up
    /// with [`ClientError::Timeout`] after `timeout`. A few consecutive transient failures
    /// (transport errors, 502/503/504) are ridden out; any other error is returned at once.
    pub async fn wait(&self, run: RunId, timeout: Duration) -> Result<Run, ClientError> {
        let now = tokio::time::Instant::now();
        // A huge timeout means "as long as it takes", not an overflow.
        let deadline = now
            .checked_add(timeout)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400));
        let mut last_status: Option<RunStatus> = None;
        let mut transient_errors = 0;
        loop {
            match self.get_run(run).await {
                Ok(current) => {
                    transient_errors = 0;
                    if current.status.is_terminal() || current.status == RunStatus::Held {
                        return Ok(current);
                    }
                    last_status = Some(current.status);
                }
                Err(e) if e.is_transient() && transient_errors + 1 < WAIT_TRANSIENT_ERRORS => {
                    transient_errors += 1;
                    if tokio::time::Instant::now() + POLL_INTERVAL > deadline
                        && last_status.is_none()
                    {
                        // Out of time without ever reading a status: the error is the answer.
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
            if tokio::time::Instant::now() + POLL_INTERVAL > deadline
                && let Some(last_status) = last_status
            {
                return Err(ClientError::Timeout { run, last_status });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base_url))
            .bearer_auth(self.token.expose())
            .header(reqwest::header::ACCEPT, "application/json")
    }

    /// A submission request, with the `Idempotency-Key` header when a key is given.
    fn submission(
        &self,
        method: Method,
        path: &str,
        idempotency_key: Option<&str>,
    ) -> Result<RequestBuilder, ClientError> {
        let rb = self.request(method, path);
        match idempotency_key {
            None => Ok(rb),
            Some(key) => {
                let value = HeaderValue::from_str(key)
                    .ok()
                    .filter(|_| !key.is_empty())
                    .ok_or_else(|| {
                        ClientError::Config(
                            "the idempotency key must be non-empty visible ASCII (it is sent as a header)"
                                .to_owned(),
                        )
                    })?;
                Ok(rb.header("Idempotency-Key", value))
            }
        }
    }

    /// Sends the request; a 2xx body is decoded as `T`, anything else becomes
    /// [`ClientError::Api`].
    async fn execute<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        rb: RequestBuilder,
    ) -> Result<T, ClientError> {
        let http_err = |source| ClientError::Http {
            url: self.base_url.clone(),
            source,
        };
        let response = rb.send().await.map_err(http_err)?;
        let status = response.status();
        let body = response.bytes().await.map_err(http_err)?;
        decode_response(status, &body, &format!("{method} {path}"))
    }
}

/// Turns a status and body into the decoded value or the API error.
fn decode_response<T: DeserializeOwned>(
    status: reqwest::StatusCode,
    body: &[u8],
    request: &str,
) -> Result<T, ClientError> {
    if !status.is_success() {
        return Err(ClientError::from_error_body(status, body));
    }
    serde_json::from_slice(body).map_err(|source| ClientError::Decode {
        request: request.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::StatusCode;
    use serde_json::{Map, Value, json};

    fn ids() -> (RunId, WorkspaceId, CapsuleId) {
        (RunId::new(), WorkspaceId::new(), CapsuleId::new())
    }

    fn minimal_run_json() -> Value {
        let (run, ws, cap) = ids();
        json!({"id": run, "kind": "plan", "status": "queued", "workspaceId": ws, "capsuleId": cap})
    }

    #[test]
    fn full_run_decodes() {
        let (run, ws, cap) = ids();
        let plan_run = RunId::new();
        let rg = RunGroupId::new();
        let sv = StateVersionId::new();
        let body = json!({
            "id": run, "kind": "apply", "status": "applied", "workspaceId": ws, "capsuleId": cap,
            "runGroupId": rg, "planRunId": plan_run,
            "planDigest": "3f2a9c1b0d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5061728394a5b6c7d8e",
            "sourceSnapshot": {"commit": "0123456789abcdef0123456789abcdef01234567", "treeDigest": "abc"},
            "toolVersion": {"terraform_version": "1.9.0"},
            "providerLockDigest": "feed",
            "dependencySnapshot": "dep",
            "stateGeneration": 3,
            "changes": {"add": 1, "change": 2, "destroy": 0},
            "drift": null,
            "outputs": {"vpc": "vpc-eu"},
            "stateVersionId": sv,
            "hold": null,
            "error": null,
            "actor": {"kind": "user", "id": "tok_1"},
            "autoApplyRequested": true,
            "injectedEnvNames": ["AWS_ACCESS_KEY_ID"],
            "createdAt": "2026-11-30T10:00:00Z",
            "updatedAt": "2026-11-30T10:01:00.123456Z",
            "providerBindings": [{"id": "pb_0123456789abcdef0123456789abcdef", "name": "aws", "kind": "env"}],
            "futureField": {"added": "later"}
        });
        let run_v: Run = serde_json::from_value(body).unwrap();
        assert_eq!(run_v.id, run);
        assert_eq!(run_v.kind, RunKind::Apply);
        assert_eq!(run_v.status, RunStatus::Applied);
        assert_eq!(run_v.workspace_id, ws);
        assert_eq!(run_v.capsule_id, cap);
        assert_eq!(run_v.run_group_id, Some(rg));
        assert_eq!(run_v.plan_run_id, Some(plan_run));
        assert_eq!(run_v.source_snapshot.as_ref().unwrap().commit.len(), 40);
        assert_eq!(run_v.provider_lock_digest, Some(Some("feed".to_owned())));
        assert_eq!(run_v.state_generation, Some(3));
        assert_eq!(
            run_v.changes,
            Some(Changes {
                add: 1,
                change: 2,
                destroy: 0
            })
        );
        assert_eq!(run_v.drift, None);
        assert_eq!(run_v.outputs.as_ref().unwrap()["vpc"], "vpc-eu");
        assert_eq!(run_v.state_version_id, Some(sv));
        assert_eq!(run_v.actor.as_ref().unwrap().kind, "user");
        assert!(run_v.auto_apply_requested);
        assert_eq!(run_v.injected_env_names, ["AWS_ACCESS_KEY_ID"]);
        assert!(run_v.created_at.is_some() && run_v.updated_at.is_some());
        assert_eq!(run_v.provider_bindings.len(), 1);
        assert_eq!(run_v.provider_bindings[0].name, "aws");
        // Unknown fields are kept and printed back.
        assert_eq!(run_v.extra.len(), 1, "{:?}", run_v.extra);
        let back = serde_json::to_value(&run_v).unwrap();
        assert_eq!(back["futureField"]["added"], "later");
        assert_eq!(back["providerBindings"][0]["name"], "aws");
        assert_eq!(back["planRunId"], json!(plan_run));
    }

    #[test]
    fn minimal_run_decodes() {
        let run: Run = serde_json::from_value(minimal_run_json()).unwrap();
        assert_eq!(run.status, RunStatus::Queued);
        assert_eq!(run.plan_run_id, None);
        assert_eq!(run.provider_lock_digest, None);
        assert_eq!(run.changes, None);
        assert!(!run.auto_apply_requested);
        assert!(run.injected_env_names.is_empty());
        assert!(run.extra.is_empty());
    }

    #[test]
    fn nulls_where_fields_do_not_apply() {
        let mut body = minimal_run_json();
        for field in [
            "runGroupId",
            "planRunId",
            "planDigest",
            "sourceSnapshot",
            "toolVersion",
            "dependencySnapshot",
            "stateGeneration",
            "changes",
            "drift",
            "outputs",
            "stateVersionId",
            "hold",
            "error",
            "actor",
            "autoApplyRequested",
            "injectedEnvNames",
            "createdAt",
            "updatedAt",
        ] {
            body[field] = Value::Null;
        }
        let run: Run = serde_json::from_value(body).unwrap();
        assert_eq!(run.source_snapshot, None);
        assert!(!run.auto_apply_requested);
        assert!(run.extra.is_empty());
    }

    #[test]
    fn provider_lock_digest_absent_null_and_present() {
        let absent: Run = serde_json::from_value(minimal_run_json()).unwrap();
        assert_eq!(absent.provider_lock_digest, None);

        let mut body = minimal_run_json();
        body["providerLockDigest"] = Value::Null;
        let null: Run = serde_json::from_value(body).unwrap();
        assert_eq!(null.provider_lock_digest, Some(None));

        let mut body = minimal_run_json();
        body["providerLockDigest"] = json!("e3b0c442");
        let present: Run = serde_json::from_value(body).unwrap();
        assert_eq!(
            present.provider_lock_digest,
            Some(Some("e3b0c442".to_owned()))
        );

        // And the distinction survives printing back.
        let out = serde_json::to_value(&absent).unwrap();
        assert!(out.get("providerLockDigest").is_none());
        let out = serde_json::to_value(&null).unwrap();
        assert_eq!(out.get("providerLockDigest"), Some(&Value::Null));
    }

    #[test]
    fn held_and_failed_runs_decode() {
        let mut body = minimal_run_json();
        body["status"] = json!("held");
        body["hold"] = json!({"reason": "max_destroy", "details": {"destroy": 4, "max": 1}});
        let run: Run = serde_json::from_value(body).unwrap();
        assert_eq!(run.hold.unwrap().reason, "max_destroy");

        let mut body = minimal_run_json();
        body["status"] = json!("failed");
        body["error"] = json!({"code": "stale_plan", "message": "plan again"});
        let run: Run = serde_json::from_value(body).unwrap();
        assert_eq!(run.error.unwrap().code, "stale_plan");
    }

    #[test]
    fn capsule_decodes_tolerantly() {
        let (_, ws, cap) = ids();
        let full = json!({
            "id": cap, "workspaceId": ws, "name": "network",
            "source": {"repo": "https://git.example/infra.git", "branch": "main"},
            "dir": "infra/network", "tool": "tofu", "vars": {"region": "eu"},
            "stateGeneration": 2, "currentStateVersionId": StateVersionId::new(), "status": "ok", "stale": true,
            "futureField": false
        });
        let c: Capsule = serde_json::from_value(full).unwrap();
        assert_eq!(c.source.branch, "main");
        assert_eq!(c.vars["region"], "eu");
        assert_eq!(c.state_generation, 2);
        assert!(c.current_state_version_id.is_some());
        assert!(c.stale && !c.drifted);
        assert_eq!(c.extra["futureField"], false, "unknown fields are kept");

        let minimal = json!({"id": cap, "workspaceId": ws, "name": "n", "currentStateVersionId": null, "vars": null});
        let c: Capsule = serde_json::from_value(minimal).unwrap();
        assert_eq!(c.state_generation, 0);
        assert!(c.vars.is_empty());
        assert_eq!(c.current_state_version_id, None);
    }

    #[test]
    fn new_capsule_serializes_as_the_api_expects() {
        let mut vars = Map::new();
        vars.insert("region".into(), json!("eu"));
        let req = NewCapsule {
            name: "network".into(),
            source: Source {
                repo: "https://git.example/infra.git".into(),
                branch: "main".into(),
            },
            dir: "infra/network".into(),
            tool: "tofu".into(),
            vars,
        };
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            json!({"name": "network", "source": {"repo": "https://git.example/infra.git", "branch": "main"},
                   "dir": "infra/network", "tool": "tofu", "vars": {"region": "eu"}})
        );
    }

    #[test]
    fn events_and_logs_decode() {
        let body: EventsBody = serde_json::from_value(json!({"events": [
            {"id": 1, "kind": "queued", "actor": "user:tok_1", "data": {}, "at": "2026-11-30T10:00:00Z"},
            {"id": 2, "kind": "claimed", "actor": {"kind": "handler", "id": "plan"}, "data": null, "at": "2026-11-30T10:00:01Z"},
            {"id": 3, "kind": "a_kind_from_a_newer_server", "actor": "system:x", "at": "2026-11-30T10:00:02Z"},
            {"id": 4, "kind": null, "actor": "system:x", "at": "2026-11-30T10:00:03Z"}
        ]}))
        .unwrap();
        assert_eq!(body.events[0].actor, "user:tok_1");
        assert_eq!(body.events[0].kind, EventKind::Queued);
        assert_eq!(body.events[1].actor, "handler:plan");
        assert_eq!(body.events[1].data, Value::Null);
        // A kind this build does not know still decodes, as its text.
        assert_eq!(body.events[2].kind.known(), None);
        assert_eq!(body.events[2].kind, "a_kind_from_a_newer_server");
        assert!(body.events[3].kind.is_empty());

        let body: LogsBody = serde_json::from_value(json!({"logs": [
            {"step": "init", "text": "Initializing"},
            {"step": "init", "text": "...\n"},
            {"step": "plan", "chunk": "Plan: 1 to add\n"},
            {"step": "init", "text": "again"}
        ]}))
        .unwrap();
        assert_eq!(
            join_logs(&body.logs),
            "== init ==\nInitializing...\n== plan ==\nPlan: 1 to add\n== init ==\nagain"
        );
        assert_eq!(join_logs(&[]), "");
    }

    #[test]
    fn error_bodies_become_api_errors() {
        let body = br#"{"code":"not_found","message":"no run run_0123 in this workspace"}"#;
        let err =
            decode_response::<Run>(StatusCode::NOT_FOUND, body, "GET /api/v1/runs/x").unwrap_err();
        match &err {
            ClientError::Api {
                status,
                code,
                message,
            } => {
                assert_eq!(*status, 404);
                assert_eq!(*code, ErrorCode::NotFound);
                assert_eq!(message, "no run run_0123 in this workspace");
            }
            other => panic!("expected Api, got {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            "no run run_0123 in this workspace (not_found, HTTP 404)"
        );
        assert_eq!(err.code(), Some("not_found"));
        assert_eq!(err.known_code(), Some(ErrorCode::NotFound));

        let nested = br#"{"error":{"code":"unauthorized","message":"bad token"}}"#;
        let err = decode_response::<Run>(StatusCode::UNAUTHORIZED, nested, "GET x").unwrap_err();
        assert_eq!(err.known_code(), Some(ErrorCode::Unauthorized));
        assert_eq!(err.status(), Some(401));

        let html = b"<html>Bad Gateway</html>";
        let err = decode_response::<Run>(StatusCode::BAD_GATEWAY, html, "GET x").unwrap_err();
        assert_eq!(err.code(), Some("http_502"));
        assert_eq!(err.known_code(), None);
        assert!(err.to_string().contains("Bad Gateway"), "{err}");
        assert!(err.is_transient());

        let err = decode_response::<Run>(StatusCode::UNAUTHORIZED, b"", "GET x").unwrap_err();
        assert_eq!(err.known_code(), Some(ErrorCode::Unauthorized));

        // A code added to a newer API than this client still reads, and prints, as sent.
        let newer = br#"{"code":"added_later","message":"try the new thing"}"#;
        let err = decode_response::<Run>(StatusCode::CONFLICT, newer, "GET x").unwrap_err();
        assert_eq!(err.code(), Some("added_later"));
        assert_eq!(err.known_code(), None);
        assert_eq!(err.to_string(), "try the new thing (added_later, HTTP 409)");
    }

    #[test]
    fn success_bodies_that_do_not_decode_are_decode_errors() {
        let err = decode_response::<Run>(StatusCode::OK, b"{}", "GET /api/v1/runs/x").unwrap_err();
        assert!(matches!(err, ClientError::Decode { .. }), "{err:?}");
        assert!(err.to_string().contains("GET /api/v1/runs/x"));
        let ok: Workspace = decode_response(
            StatusCode::CREATED,
            json!({"id": WorkspaceId::new(), "name": "prod"})
                .to_string()
                .as_bytes(),
            "POST",
        )
        .unwrap();
        assert_eq!(ok.name, "prod");
    }

    #[test]
    fn debug_never_shows_the_token() {
        let client = Client::new("http://127.0.0.1:8080/", "canary-5e1b9a").unwrap();
        let debug = format!("{client:?}");
        assert!(!debug.contains("canary"), "{debug}");
        assert!(debug.contains("127.0.0.1:8080"));
        assert_eq!(client.base_url(), "http://127.0.0.1:8080");
    }

    #[test]
    fn bad_configuration_is_rejected_without_echoing_the_token() {
        assert!(matches!(
            Client::new("not a url", "t"),
            Err(ClientError::Config(_))
        ));
        assert!(matches!(
            Client::new("ftp://host", "t"),
            Err(ClientError::Config(_))
        ));
        assert!(matches!(
            Client::new("http://u:p@host", "t"),
            Err(ClientError::Config(_))
        ));
        assert!(matches!(
            Client::new("http://host", ""),
            Err(ClientError::Config(_))
        ));
        let err = Client::new("http://host", "canary 77\n").unwrap_err();
        assert!(!err.to_string().contains("canary"));
        let prefixed = Client::new("https://example.org/takosumi/", "t").unwrap();
        assert_eq!(prefixed.base_url(), "https://example.org/takosumi");
    }

    #[test]
    fn bad_idempotency_keys_are_rejected_locally() {
        let client = Client::new("http://127.0.0.1:8080", "t").unwrap();
        assert!(
            client
                .submission(Method::POST, "/x", Some("ok-key-1"))
                .is_ok()
        );
        assert!(matches!(
            client.submission(Method::POST, "/x", Some("bad\nkey")),
            Err(ClientError::Config(_))
        ));
        assert!(matches!(
            client.submission(Method::POST, "/x", Some("")),
            Err(ClientError::Config(_))
        ));
    }

    #[test]
    fn timeout_names_the_run_and_status() {
        let run = RunId::new();
        let err = ClientError::Timeout {
            run,
            last_status: RunStatus::Planning,
        };
        assert_eq!(
            err.to_string(),
            format!("gave up waiting for {run}: it is still planning")
        );
    }

    /// One request the fake API saw.
    #[derive(Debug)]
    struct Seen {
        method: String,
        path: String,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Seen {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }
    }

    /// A minimal HTTP/1.1 server answering each connection with the next canned response
    /// (the last one repeats), recording what it saw.
    async fn fake_api(
        responses: Vec<(u16, Value)>,
    ) -> (String, std::sync::Arc<std::sync::Mutex<Vec<Seen>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            let mut i = 0;
            loop {
                let (mut sock, _) = listener.accept().await.unwrap();
                let mut buf = Vec::new();
                let head_end = loop {
                    let mut chunk = [0u8; 4096];
                    let n = sock.read(&mut chunk).await.unwrap();
                    assert!(n > 0, "client closed early");
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break pos + 4;
                    }
                };
                let head = String::from_utf8(buf[..head_end].to_vec()).unwrap();
                let mut lines = head.lines();
                let mut request_line = lines.next().unwrap().split(' ');
                let (method, path) = (
                    request_line.next().unwrap().to_owned(),
                    request_line.next().unwrap().to_owned(),
                );
                let headers: Vec<(String, String)> = lines
                    .filter_map(|l| l.split_once(':'))
                    .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
                    .collect();
                let len: usize = headers
                    .iter()
                    .find(|(n, _)| n == "content-length")
                    .map(|(_, v)| v.parse().unwrap())
                    .unwrap_or(0);
                while buf.len() < head_end + len {
                    let mut chunk = [0u8; 4096];
                    let n = sock.read(&mut chunk).await.unwrap();
                    buf.extend_from_slice(&chunk[..n]);
                }
                let body = String::from_utf8(buf[head_end..head_end + len].to_vec()).unwrap();
                log.lock().unwrap().push(Seen {
                    method,
                    path,
                    headers,
                    body,
                });
                let (status, json) = &responses[i.min(responses.len() - 1)];
                i += 1;
                let payload = json.to_string();
                let answer = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
                    payload.len()
                );
                sock.write_all(answer.as_bytes()).await.unwrap();
                let _ = sock.shutdown().await;
            }
        });
        (url, seen)
    }

    fn run_json(run: RunId, status: &str) -> Value {
        json!({"id": run, "kind": "plan", "status": status, "workspaceId": WorkspaceId::new(), "capsuleId": CapsuleId::new()})
    }

    #[tokio::test]
    async fn submissions_send_token_idempotency_key_and_path() {
        let run = RunId::new();
        let cap = CapsuleId::new();
        let (url, seen) = fake_api(vec![(202, run_json(run, "queued"))]).await;
        let client = Client::new(&url, "tok-canary-1").unwrap();
        let got = client.plan(cap, Some("key-1")).await.unwrap();
        assert_eq!(got.id, run);
        let _ = client.destroy(cap, None).await.unwrap();
        let _ = client.apply(run, Some("key-2")).await.unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(
            (seen[0].method.as_str(), seen[0].path.as_str()),
            ("POST", format!("/api/v1/capsules/{cap}/plan").as_str())
        );
        assert_eq!(seen[0].header("authorization"), Some("Bearer tok-canary-1"));
        assert_eq!(seen[0].header("idempotency-key"), Some("key-1"));
        assert_eq!(seen[0].body, "{}");
        assert_eq!(
            (seen[1].method.as_str(), seen[1].path.as_str()),
            ("DELETE", format!("/api/v1/capsules/{cap}").as_str())
        );
        assert_eq!(seen[1].header("idempotency-key"), None);
        assert_eq!(
            (seen[2].method.as_str(), seen[2].path.as_str()),
            ("POST", format!("/api/v1/runs/{run}/apply").as_str())
        );
        assert_eq!(seen[2].header("idempotency-key"), Some("key-2"));
    }

    #[tokio::test]
    async fn workspaces_and_capsules_round_trip_over_http() {
        let ws = WorkspaceId::new();
        let cap = CapsuleId::new();
        let capsule = json!({"id": cap, "workspaceId": ws, "name": "network",
            "source": {"repo": "r", "branch": "main"}, "dir": ".", "tool": "tofu", "vars": {"region": "eu"},
            "stateGeneration": 0, "currentStateVersionId": null, "status": "ok"});
        let (url, seen) = fake_api(vec![
            (201, json!({"id": ws, "name": "prod"})),
            (201, capsule.clone()),
            (200, capsule),
        ])
        .await;
        let client = Client::new(&url, "t").unwrap();
        assert_eq!(client.create_workspace("prod").await.unwrap().id, ws);
        let mut vars = Map::new();
        vars.insert("region".into(), json!("eu"));
        let req = NewCapsule {
            name: "network".into(),
            source: Source {
                repo: "r".into(),
                branch: "main".into(),
            },
            dir: ".".into(),
            tool: "tofu".into(),
            vars,
        };
        assert_eq!(client.create_capsule(ws, &req).await.unwrap().id, cap);
        assert_eq!(client.get_capsule(cap).await.unwrap().vars["region"], "eu");
        let seen = seen.lock().unwrap();
        assert_eq!(seen[0].path, "/api/v1/workspaces");
        assert_eq!(
            serde_json::from_str::<Value>(&seen[0].body).unwrap(),
            json!({"name": "prod"})
        );
        assert_eq!(seen[1].path, format!("/api/v1/workspaces/{ws}/capsules"));
        assert_eq!(
            serde_json::from_str::<Value>(&seen[1].body).unwrap()["source"]["branch"],
            "main"
        );
        assert_eq!(
            (seen[2].method.as_str(), seen[2].path.as_str()),
            ("GET", format!("/api/v1/capsules/{cap}").as_str())
        );
    }

    #[tokio::test]
    async fn api_errors_arrive_as_api_errors() {
        let (url, _) = fake_api(vec![(
            404,
            json!({"code": "not_found", "message": "no such run"}),
        )])
        .await;
        let client = Client::new(&url, "t").unwrap();
        let err = client.get_run(RunId::new()).await.unwrap_err();
        assert!(
            matches!(&err, ClientError::Api { status: 404, code, .. } if code == "not_found"),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn logs_and_events_over_http() {
        let run = RunId::new();
        let (url, seen) = fake_api(vec![
            (200, json!({"logs": [{"step": "init", "text": "ok\n"}, {"step": "plan", "text": "Plan: 1 to add\n"}]})),
            (200, json!({"events": [{"id": 1, "kind": "queued", "actor": "user:tok_1", "data": {}, "at": "2026-11-30T10:00:00Z"}]})),
        ])
        .await;
        let client = Client::new(&url, "t").unwrap();
        assert_eq!(
            client.logs(run).await.unwrap(),
            "== init ==\nok\n== plan ==\nPlan: 1 to add\n"
        );
        assert_eq!(client.events(run).await.unwrap()[0].kind, "queued");
        let seen = seen.lock().unwrap();
        assert_eq!(seen[0].path, format!("/api/v1/runs/{run}/logs"));
        assert_eq!(seen[1].path, format!("/api/v1/runs/{run}/events"));
    }

    #[tokio::test]
    async fn wait_polls_until_terminal_or_held() {
        let run = RunId::new();
        let (url, seen) = fake_api(vec![
            (200, run_json(run, "queued")),
            (200, run_json(run, "planning")),
            (200, run_json(run, "planned")),
        ])
        .await;
        let client = Client::new(&url, "t").unwrap();
        let done = client.wait(run, Duration::from_secs(10)).await.unwrap();
        assert_eq!(done.status, RunStatus::Planned);
        assert_eq!(seen.lock().unwrap().len(), 3);

        let (url, _) = fake_api(vec![
            (200, run_json(run, "planning")),
            (200, run_json(run, "held")),
        ])
        .await;
        let client = Client::new(&url, "t").unwrap();
        assert_eq!(
            client
                .wait(run, Duration::from_secs(10))
                .await
                .unwrap()
                .status,
            RunStatus::Held
        );
    }

    #[tokio::test]
    async fn wait_rides_out_a_proxy_blip_but_not_an_api_error() {
        let run = RunId::new();
        let (url, _) = fake_api(vec![
            (503, json!({"code": "unavailable", "message": "restarting"})),
            (200, run_json(run, "planned")),
        ])
        .await;
        let client = Client::new(&url, "t").unwrap();
        assert_eq!(
            client
                .wait(run, Duration::from_secs(10))
                .await
                .unwrap()
                .status,
            RunStatus::Planned
        );

        let (url, _) = fake_api(vec![(
            404,
            json!({"code": "not_found", "message": "no such run"}),
        )])
        .await;
        let client = Client::new(&url, "t").unwrap();
        let err = client.wait(run, Duration::from_secs(10)).await.unwrap_err();
        assert_eq!(err.code(), Some("not_found"));
    }

    #[tokio::test]
    async fn wait_times_out_with_the_last_status() {
        let run = RunId::new();
        let (url, _) = fake_api(vec![(200, run_json(run, "applying"))]).await;
        let client = Client::new(&url, "t").unwrap();
        let started = std::time::Instant::now();
        let err = client
            .wait(run, Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ClientError::Timeout { run: r, last_status: RunStatus::Applying } if r == run),
            "{err:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn unreachable_api_is_an_http_error() {
        // Bind then drop a listener so the port is (almost certainly) closed.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let client = Client::new(&format!("http://127.0.0.1:{port}"), "t").unwrap();
        let err = client.get_run(RunId::new()).await.unwrap_err();
        assert!(matches!(err, ClientError::Http { .. }), "{err:?}");
        assert!(err.is_connection_refused(), "{err:?}");
        assert!(err.to_string().contains(&format!("127.0.0.1:{port}")));
    }
}
