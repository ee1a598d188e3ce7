//! API errors: "your input" (4xx, a stable code and a safe message) versus "ours" (5xx:
//! the full cause chain goes to the log, the body says only that it failed).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Declares [`ErrorCode`] once: the variant, and the wire string it must serialize as (a
/// test checks serde and [`ErrorCode::as_str`] agree).
macro_rules! error_codes {
    ($($variant:ident => $wire:literal,)*) => {
        /// Every `code` an API error body can carry: a closed set, so the OpenAPI
        /// document lists them as an `enum` and a new code cannot appear unlisted.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
        #[serde(rename_all = "snake_case")]
        #[allow(missing_docs)]
        pub enum ErrorCode {
            $($variant,)*
        }

        impl ErrorCode {
            /// Every code.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The wire string (`invalid_id`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }
        }
    };
}

error_codes! {
    AfterApplyFailed => "after_apply_failed",
    AlreadyApproved => "already_approved",
    AlreadyResolved => "already_resolved",
    AlreadyRevoked => "already_revoked",
    ApplyExists => "apply_exists",
    ApplyFailed => "apply_failed",
    AttemptsExhausted => "attempts_exhausted",
    AutoApplyPersonOnly => "auto_apply_person_only",
    BindingExists => "binding_exists",
    CapsuleBusy => "capsule_busy",
    CapsuleExists => "capsule_exists",
    CapsuleNeedsInspection => "capsule_needs_inspection",
    CheckoutFailed => "checkout_failed",
    Conflict => "conflict",
    CostUnavailable => "cost_unavailable",
    CredentialFailed => "credential_failed",
    CurrentStateUnreadable => "current_state_unreadable",
    DeliveryKeyExpired => "delivery_key_expired",
    DeliveryKeyIdUsed => "delivery_key_id_used",
    DeliveryKeyUnknown => "delivery_key_unknown",
    DeliveryKeyUnopenable => "delivery_key_unopenable",
    DependencyChanged => "dependency_changed",
    DryRunScanRefused => "dry_run_scan_refused",
    EnvNameConflict => "env_name_conflict",
    EvidenceMissing => "evidence_missing",
    EvidencePending => "evidence_pending",
    Forbidden => "forbidden",
    HeldStateUnreadable => "held_state_unreadable",
    IdempotencyKeyReused => "idempotency_key_reused",
    InitFailed => "init_failed",
    Internal => "internal",
    InvalidAction => "invalid_action",
    InvalidAutoApply => "invalid_auto_apply",
    InvalidBinding => "invalid_binding",
    InvalidCode => "invalid_code",
    InvalidConfiguration => "invalid_configuration",
    InvalidCursor => "invalid_cursor",
    InvalidDeliveryId => "invalid_delivery_id",
    InvalidDeliveryKey => "invalid_delivery_key",
    InvalidDir => "invalid_dir",
    InvalidEvent => "invalid_event",
    InvalidExpiry => "invalid_expiry",
    InvalidFilter => "invalid_filter",
    InvalidGrace => "invalid_grace",
    InvalidId => "invalid_id",
    InvalidIdempotencyKey => "invalid_idempotency_key",
    InvalidIds => "invalid_ids",
    InvalidInterval => "invalid_interval",
    InvalidJson => "invalid_json",
    InvalidLimit => "invalid_limit",
    InvalidLockfile => "invalid_lockfile",
    InvalidName => "invalid_name",
    InvalidNote => "invalid_note",
    InvalidPolicy => "invalid_policy",
    InvalidQuery => "invalid_query",
    InvalidReport => "invalid_report",
    InvalidRequest => "invalid_request",
    InvalidRole => "invalid_role",
    InvalidRules => "invalid_rules",
    InvalidSandbox => "invalid_sandbox",
    InvalidSelection => "invalid_selection",
    InvalidSignature => "invalid_signature",
    InvalidSource => "invalid_source",
    InvalidState => "invalid_state",
    InvalidTool => "invalid_tool",
    InvalidVars => "invalid_vars",
    LockfileCrossRun => "lockfile_cross_run",
    LockfileMismatch => "lockfile_mismatch",
    LockfileMissing => "lockfile_missing",
    LockfileTooLarge => "lockfile_too_large",
    MethodNotAllowed => "method_not_allowed",
    MissingState => "missing_state",
    NoCancelRequested => "no_cancel_requested",
    NoHeldState => "no_held_state",
    NoKeptPlan => "no_kept_plan",
    NoSelection => "no_selection",
    NoSuchEndpoint => "no_such_endpoint",
    NotAPlan => "not_a_plan",
    NotApplied => "not_applied",
    NotApplying => "not_applying",
    NotFound => "not_found",
    NotHeld => "not_held",
    NotOneStep => "not_one_step",
    NotPlanning => "not_planning",
    NotUnknownOutcome => "not_unknown_outcome",
    NotYourClaim => "not_your_claim",
    PayloadTooLarge => "payload_too_large",
    PlanAlreadyUsed => "plan_already_used",
    PlanDigestMismatch => "plan_digest_mismatch",
    PlanFailed => "plan_failed",
    PlanFileExists => "plan_file_exists",
    PlanFileMissing => "plan_file_missing",
    PlanNotReady => "plan_not_ready",
    PlanTooLarge => "plan_too_large",
    PoolExists => "pool_exists",
    PoolHasNoDeliveryKey => "pool_has_no_delivery_key",
    RunFinished => "run_finished",
    RunInFlight => "run_in_flight",
    RunNotEnded => "run_not_ended",
    SandboxUnavailable => "sandbox_unavailable",
    SelfApproval => "self_approval",
    SourceChanged => "source_changed",
    SpeculativePlan => "speculative_plan",
    StalePlan => "stale_plan",
    StateGenerationChanged => "state_generation_changed",
    StateIntegrity => "state_integrity",
    StateLineageMismatch => "state_lineage_mismatch",
    StateSerialOlder => "state_serial_older",
    StateTooLarge => "state_too_large",
    TimedOut => "timed_out",
    Unauthorized => "unauthorized",
    Unavailable => "unavailable",
    UnexpectedState => "unexpected_state",
    UnknownQueue => "unknown_queue",
    UnknownWorkspace => "unknown_workspace",
    UnsupportedMediaType => "unsupported_media_type",
    WorkspaceExists => "workspace_exists",
    WrongPool => "wrong_pool",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Run failure code answered as an API error (a relayed Run whose inputs cannot be
/// delivered is failed with it, and the worker is told the same code).
impl From<takosumi_core::FailureCode> for ErrorCode {
    fn from(code: takosumi_core::FailureCode) -> Self {
        use takosumi_core::FailureCode as F;
        match code {
            F::StalePlan => Self::StalePlan,
            F::PlanDigestMismatch => Self::PlanDigestMismatch,
            F::SourceChanged => Self::SourceChanged,
            F::DependencyChanged => Self::DependencyChanged,
            F::StateGenerationChanged => Self::StateGenerationChanged,
            F::LockfileMismatch => Self::LockfileMismatch,
            F::LockfileTooLarge => Self::LockfileTooLarge,
            F::LockfileMissing => Self::LockfileMissing,
            F::LockfileCrossRun => Self::LockfileCrossRun,
            F::PlanTooLarge => Self::PlanTooLarge,
            F::CheckoutFailed => Self::CheckoutFailed,
            F::InitFailed => Self::InitFailed,
            F::PlanFailed => Self::PlanFailed,
            F::ApplyFailed => Self::ApplyFailed,
            F::AttemptsExhausted => Self::AttemptsExhausted,
            F::InvalidConfiguration => Self::InvalidConfiguration,
            F::DryRunScanRefused => Self::DryRunScanRefused,
            F::CredentialFailed => Self::CredentialFailed,
            F::StateIntegrity => Self::StateIntegrity,
            F::CapsuleNeedsInspection => Self::CapsuleNeedsInspection,
            F::TimedOut => Self::TimedOut,
            F::SandboxUnavailable => Self::SandboxUnavailable,
            F::NotApplied => Self::NotApplied,
            F::AfterApplyFailed => Self::AfterApplyFailed,
            F::PoolHasNoDeliveryKey => Self::PoolHasNoDeliveryKey,
            F::DeliveryKeyUnopenable => Self::DeliveryKeyUnopenable,
        }
    }
}

/// The body of every API error response.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// Stable and machine-readable.
    pub code: ErrorCode,
    /// What to do, safe to show.
    pub message: String,
}

/// An error an endpoint returns.
#[derive(Debug)]
pub enum ApiError {
    /// 400/401/403/404/409/422 with a stable code.
    Client {
        /// HTTP status.
        status: StatusCode,
        /// Stable machine-readable code.
        code: ErrorCode,
        /// What to do, safe to show.
        message: String,
    },
    /// 500/503: logged in full, opaque in the body.
    Internal {
        /// Whether the failure may pass (503) or is a bug (500).
        transient: bool,
        /// The cause, logged only.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl ApiError {
    /// A client error.
    pub fn client(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Client {
            status,
            code,
            message: message.into(),
        }
    }
    /// 400 `invalid_json`.
    pub fn invalid_json(message: impl Into<String>) -> Self {
        Self::client(StatusCode::BAD_REQUEST, ErrorCode::InvalidJson, message)
    }
    /// 422 with a code.
    pub fn invalid(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::client(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }
    /// 404 `not_found`.
    pub fn not_found(what: &str) -> Self {
        Self::client(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            format!("{what} was not found"),
        )
    }
    /// 409 with a code.
    pub fn conflict(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::client(StatusCode::CONFLICT, code, message)
    }
    /// 403 `forbidden`.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::client(StatusCode::FORBIDDEN, ErrorCode::Forbidden, message)
    }
    /// 500: a bug of ours (logged in full, opaque in the body).
    pub fn internal(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Internal {
            transient: false,
            source: Box::new(e),
        }
    }
    /// 403 with a specific code.
    pub fn forbidden_code(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::client(StatusCode::FORBIDDEN, code, message)
    }
}

/// Gives an answer axum made itself (an extractor's rejection: plain text, e.g. a body over
/// the route's limit) the API's error shape; every other answer passes unchanged.
pub(crate) async fn json_rejection(resp: Response) -> Response {
    let status = resp.status();
    let plain = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain"));
    if !status.is_client_error() || !plain {
        return resp;
    }
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::PayloadTooLarge,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
        _ => ErrorCode::InvalidRequest,
    };
    // A rejection's text says what was wrong with the request (never anything of ours).
    let text = axum::body::to_bytes(resp.into_body(), 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("bad request")
            .to_owned()
    } else {
        text
    };
    ApiError::client(status, code, message).into_response()
}

impl From<takosumi_store::StoreError> for ApiError {
    fn from(e: takosumi_store::StoreError) -> Self {
        Self::Internal {
            transient: e.retryable(),
            source: Box::new(e),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        takosumi_store::StoreError::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Client {
                status,
                code,
                message,
            } => (status, Json(ErrorBody { code, message })).into_response(),
            Self::Internal { transient, source } => {
                let mut chain = source.to_string();
                let mut cur = source.source();
                while let Some(c) = cur {
                    chain.push_str(": ");
                    chain.push_str(&c.to_string());
                    cur = c.source();
                }
                tracing::error!(error = %chain, "request failed");
                let (status, code, message) = if transient {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        ErrorCode::Unavailable,
                        "a dependency is unavailable; try again shortly",
                    )
                } else {
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        ErrorCode::Internal,
                        "the request failed on our side; the operators have the details",
                    )
                };
                (
                    status,
                    Json(ErrorBody {
                        code,
                        message: message.into(),
                    }),
                )
                    .into_response()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorCode;

    /// The wire strings tests and clients match on are what serde writes.
    #[test]
    fn codes_serialize_as_their_wire_strings() {
        for code in ErrorCode::ALL {
            assert_eq!(
                serde_json::to_value(code).unwrap(),
                code.as_str(),
                "{code:?}"
            );
        }
    }
}
