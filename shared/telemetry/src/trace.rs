//! W3C trace context (`traceparent`, version 00). The API takes the caller's (or starts
//! a trace), the Run row keeps it, every outbox row of the Run copies it, the relay puts
//! it in the AMQP message's headers and the consumer makes it the parent of the step's
//! span: one trace id from `POST /plan` to the apply handler's last log line.

use std::fmt;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The HTTP and AMQP header name.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A parsed `traceparent`: `00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
}

impl TraceParent {
    /// Parses a header value; `None` for anything that is not a valid version-00 value
    /// (all-zero ids are invalid), in which case the caller starts a new trace, as the
    /// W3C recommendation says.
    pub fn parse(value: &str) -> Option<Self> {
        let value = value.trim();
        let mut parts = value.split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != "00" {
            return None;
        }
        let lower_hex = |s: &str, n: usize| {
            s.len() == n
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if !lower_hex(trace, 32) || !lower_hex(span, 16) || !lower_hex(flags, 2) {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        let mut flag = [0u8; 1];
        hex::decode_to_slice(trace, &mut trace_id).ok()?;
        hex::decode_to_slice(span, &mut span_id).ok()?;
        hex::decode_to_slice(flags, &mut flag).ok()?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            flags: flag[0],
        })
    }

    /// A new trace (sampled), for a request that brought none.
    pub fn new_root() -> Self {
        let mut trace_id: [u8; 16] = rand::random();
        let mut span_id: [u8; 8] = rand::random();
        trace_id[0] |= 1; // never all zero
        span_id[0] |= 1;
        Self {
            trace_id,
            span_id,
            flags: 1,
        }
    }

    /// The trace id, 32 lower-case hex digits.
    pub fn trace_id(&self) -> String {
        hex::encode(self.trace_id)
    }

    /// The trace id's bytes (as OTLP carries it).
    pub fn trace_id_bytes(&self) -> [u8; 16] {
        self.trace_id
    }

    fn otel_context(&self) -> opentelemetry::Context {
        opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            TraceFlags::new(self.flags),
            true,
            TraceState::default(),
        ))
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.span_id),
            self.flags
        )
    }
}

tokio::task_local! {
    static CURRENT: TraceParent;
}

/// Runs `f` (an HTTP request's handling) with `trace` as the current trace context, so
/// the Run a handler creates keeps it ([`current_trace`]) without every function between
/// the router and the insert passing it along.
pub async fn with_trace<F: std::future::Future>(trace: TraceParent, f: F) -> F::Output {
    CURRENT.scope(trace, f).await
}

/// The trace context of the request being handled, if any.
pub fn current_trace() -> Option<TraceParent> {
    CURRENT.try_with(|t| *t).ok()
}

/// The span of one HTTP request: its log lines carry `trace_id`; exported, it is a child
/// of the caller's span.
pub fn request_span(method: &str, path: &str, trace: &TraceParent) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        %method,
        %path,
        trace_id = %trace.trace_id(),
    );
    let _ = span.set_parent(trace.otel_context());
    span
}

/// The span of one step handling one message: every log line inside carries the step,
/// the Run id and the trace id (the Run's, when the message brought one).
pub fn step_span(
    step: &str,
    run_id: &dyn fmt::Display,
    trace: Option<&TraceParent>,
) -> tracing::Span {
    let span = tracing::info_span!(
        "step",
        %step,
        %run_id,
        trace_id = tracing::field::Empty,
    );
    if let Some(trace) = trace {
        span.record("trace_id", tracing::field::display(trace.trace_id()));
        let _ = span.set_parent(trace.otel_context());
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_it_prints_and_refuses_the_rest() {
        let t = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the W3C example");
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            t.to_string(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        let root = TraceParent::new_root();
        assert_eq!(TraceParent::parse(&root.to_string()), Some(root));
        assert_ne!(root.trace_id(), TraceParent::new_root().trace_id());
    }
}
