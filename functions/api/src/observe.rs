//! What every request leaves for operators: its trace context (the caller's `traceparent`,
//! or a new trace) as the current one while it is handled, so a Run it creates carries it
//! to every step; its span, so its log lines carry the trace id; and its count and latency
//! by route template in `/metrics`.

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use takosumi_telemetry::{TRACEPARENT_HEADER, TraceParent, metrics, request_span, with_trace};
use tracing::Instrument as _;

/// The trace context and span of a request (every route, the dashboard's in-process calls
/// included: each is a request of its own).
pub async fn trace(req: Request, next: Next) -> Response {
    let trace = req
        .headers()
        .get(TRACEPARENT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse)
        .unwrap_or_else(TraceParent::new_root);
    let span = request_span(req.method().as_str(), req.uri().path(), &trace);
    with_trace(trace, next.run(req).instrument(span)).await
}

/// Counts the request by route template (never the path with its ids), method and status.
pub async fn measure(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().clone();
    let started = tokio::time::Instant::now();
    let response = next.run(req).await;
    metrics::global().observe_request(
        &route,
        method.as_str(),
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}
