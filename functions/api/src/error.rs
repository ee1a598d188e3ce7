//! API errors: "your input" (4xx, a stable code and a safe message) versus "ours" (5xx:
//! the full cause chain goes to the log, the body says only that it failed). The codes and
//! the body are the wire contract's ([`ErrorCode`], [`ErrorBody`]).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
pub use takosumi_wire::{ErrorBody, ErrorCode};

/// An error an endpoint returns.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400/401/403/404/409/422 with a stable code.
    #[error("{status} {code}: {message}")]
    Client {
        /// HTTP status.
        status: StatusCode,
        /// Stable machine-readable code.
        code: ErrorCode,
        /// What to do, safe to show.
        message: String,
    },
    /// 500/503: logged in full, opaque in the body.
    #[error("the request failed on our side (transient: {transient})")]
    Internal {
        /// Whether the failure may pass (503) or is a bug (500).
        transient: bool,
        /// The cause, logged only.
        #[source]
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
    /// 409 `conflict`: a request with the same Idempotency-Key made its Run in a
    /// transaction that has not committed yet, so there is nothing to replay yet.
    pub fn idempotency_key_in_flight() -> Self {
        Self::conflict(
            ErrorCode::Conflict,
            "a concurrent request with this Idempotency-Key is in progress; retry",
        )
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
