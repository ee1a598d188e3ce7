//! What Takosumi tells its operators, in one place: the process's log subscriber (with
//! OTLP trace export when `OTEL_EXPORTER_OTLP_ENDPOINT` is set), the W3C trace context a
//! Run carries from the HTTP request that made it through its outbox rows and queue
//! messages into every step's span ([`TraceParent`], [`step_span`]), and the process's
//! Prometheus metrics ([`metrics`]).
#![deny(missing_docs)]

pub mod metrics;
mod trace;

pub use trace::{
    TRACEPARENT_HEADER, TraceParent, current_trace, request_span, step_span, with_trace,
};

use opentelemetry::trace::TracerProvider as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Keeps the trace exporter of [`init`] alive; dropping it sends what is still buffered
/// (a `--once` Job exits right after its Run, and its spans must not be lost with it).
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("telemetry: the trace exporter did not shut down cleanly: {e}");
        }
    }
}

/// Starts the process's logging: JSON lines when `TAKOSUMI_LOG_FORMAT=json`, text
/// otherwise, the level from `RUST_LOG` (default `info`), on stderr. Every line inside a
/// step or a request carries that span's fields (`run_id`, `trace_id`). With
/// `OTEL_EXPORTER_OTLP_ENDPOINT` set, spans are also exported over OTLP/HTTP (protobuf)
/// with `service.name` = `takosumi-<service>`; without it nothing is exported.
pub fn init(service: &str) -> Telemetry {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,lapin=warn,aws=warn"));
    let json = std::env::var("TAKOSUMI_LOG_FORMAT").is_ok_and(|v| v == "json");
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").is_ok_and(|v| !v.is_empty());
    let mut problem = None;
    let provider = if endpoint {
        match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
        {
            Ok(exporter) => Some(
                opentelemetry_sdk::trace::SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(
                        opentelemetry_sdk::Resource::builder()
                            .with_service_name(format!("takosumi-{service}"))
                            .build(),
                    )
                    .build(),
            ),
            Err(e) => {
                problem = Some(e.to_string());
                None
            }
        }
    } else {
        None
    };
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("takosumi")));
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    // Colours only for a person at a terminal: a log file or collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = if json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .try_init()
    } else {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(ansi)
                    .with_writer(std::io::stderr),
            )
            .try_init()
    };
    if let Some(problem) = problem {
        tracing::warn!(%problem, "OTEL_EXPORTER_OTLP_ENDPOINT is set but no exporter could be made: spans are not exported");
    }
    tracing::info!(service, otlp = provider.is_some(), "starting");
    Telemetry { provider }
}
