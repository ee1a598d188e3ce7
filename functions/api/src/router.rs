//! The API's route table: every module's endpoints merged in one place (the table the
//! guard, the role matrix and the OpenAPI document read), and the answers for no route and
//! a wrong method.

use axum::Router;
use axum::http::StatusCode;

use crate::access::Api;
use crate::error::ErrorCode;
use crate::{ApiError, AppState};

/// Every endpoint the API mounts.
pub fn api() -> Api {
    crate::routes::api()
        .merge(crate::gates::api())
        .merge(crate::one_step::api())
        .merge(crate::webhooks::api())
        .merge(crate::settings::api())
        .merge(crate::drift::api())
        .merge(crate::groups::api())
        .merge(crate::listing::api())
        .merge(crate::bindings::api())
        .merge(crate::records::api())
        .merge(crate::dead_letters::api())
        .merge(crate::pools::api())
        .merge(crate::relay::api())
        .merge(crate::evidence::api())
        .merge(crate::review::api())
        .merge(crate::tokens::api())
        .merge(crate::openapi::api())
        .merge(crate::dashboard::api())
}

/// The routes with the answers for no route and a wrong method.
pub fn router() -> Router<AppState> {
    let (router, _) = api().into_parts();
    router
        .fallback(|| async {
            ApiError::client(
                StatusCode::NOT_FOUND,
                ErrorCode::NoSuchEndpoint,
                "no such endpoint; the API is described at GET /api/v1/openapi.json",
            )
        })
        // An id that happens to spell a sub-resource (`/capsules/rules`) meets a route of
        // other methods: still an answer with a code.
        .method_not_allowed_fallback(|| async {
            ApiError::client(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorCode::MethodNotAllowed,
                "this endpoint does not take that method; the API is described at GET /api/v1/openapi.json",
            )
        })
        .layer(axum::middleware::from_fn(crate::observe::trace))
}
