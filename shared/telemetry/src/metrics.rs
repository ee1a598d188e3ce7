//! The process's Prometheus metrics. What a process measures itself (HTTP requests, step
//! durations, queue lag, reaper actions) lives in [`global`]; what only Postgres knows
//! (Runs by kind and status, the outbox backlog, dead letters, Runs needing inspection)
//! the API adds at scrape time as [`DbFigures`], so the figures of short-lived `--once`
//! Jobs, which no scraper sees, are still there. [`render`] writes both in the
//! OpenMetrics text format Prometheus scrapes.

use std::sync::LazyLock;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// An HTTP request's labels: the route template (`/api/v1/runs/{run}`, never the path
/// with its ids, so the label set stays small), the method and the status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    /// The matched route template, or `unmatched`.
    pub route: String,
    /// The method.
    pub method: String,
    /// The response status.
    pub status: u16,
}

/// A route's labels for its latency histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    /// The matched route template, or `unmatched`.
    pub route: String,
    /// The method.
    pub method: String,
}

/// A step's labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    /// `plan`, `gate`, `approve`, `apply`, `drift`.
    pub step: String,
}

/// A step's outcome labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepOutcomeLabels {
    /// `plan`, `gate`, `approve`, `apply`, `drift`.
    pub step: String,
    /// `done`, `failed`, `skipped`, `deferred`, `error`.
    pub outcome: String,
}

/// A reaper action's labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// What the reaper did (`requeued`, `unknown_outcome`, `failed`, `woken`, …).
    pub action: String,
}

type Hist = Family<RouteLabels, Histogram, fn() -> Histogram>;
type StepHist<L> = Family<L, Histogram, fn() -> Histogram>;

/// What this process measures.
#[derive(Debug)]
pub struct Metrics {
    /// `takosumi_http_requests_total{route,method,status}`.
    pub http_requests: Family<HttpLabels, Counter>,
    /// `takosumi_http_request_duration_seconds{route,method}`.
    pub http_duration: Hist,
    /// `takosumi_step_duration_seconds{step,outcome}`: one message's handling.
    pub step_duration: StepHist<StepOutcomeLabels>,
    /// `takosumi_queue_lag_seconds{step}`: from the commit of a wake-up's outbox row to
    /// its handler taking it.
    pub queue_lag: StepHist<StepLabels>,
    /// `takosumi_reaper_actions_total{action}`.
    pub reaper_actions: Family<ActionLabels, Counter>,
}

fn latency_buckets() -> Histogram {
    // 1 ms … ~16 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

fn step_buckets() -> Histogram {
    // 5 ms … ~45 min: a gate takes milliseconds, an apply may take most of an hour.
    Histogram::new(exponential_buckets(0.005, 2.0, 20))
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
        http_requests: Family::default(),
        http_duration: Family::new_with_constructor(latency_buckets),
        step_duration: Family::new_with_constructor(step_buckets),
        queue_lag: Family::new_with_constructor(step_buckets),
        reaper_actions: Family::default(),
    });
    &METRICS
}

impl Metrics {
    /// Counts one HTTP request.
    pub fn observe_request(&self, route: &str, method: &str, status: u16, took: Duration) {
        self.http_requests
            .get_or_create(&HttpLabels {
                route: route.to_owned(),
                method: method.to_owned(),
                status,
            })
            .inc();
        self.http_duration
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
                method: method.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    /// Records one handled message.
    pub fn observe_step(&self, step: &str, outcome: &str, took: Duration) {
        self.step_duration
            .get_or_create(&StepOutcomeLabels {
                step: step.to_owned(),
                outcome: outcome.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    /// Records a message's wait between its commit and its handler.
    pub fn observe_queue_lag(&self, step: &str, lag: Duration) {
        self.queue_lag
            .get_or_create(&StepLabels {
                step: step.to_owned(),
            })
            .observe(lag.as_secs_f64());
    }

    /// Counts reaper actions.
    pub fn count_reaper(&self, action: &str, n: u64) {
        if n > 0 {
            self.reaper_actions
                .get_or_create(&ActionLabels {
                    action: action.to_owned(),
                })
                .inc_by(n);
        }
    }
}

/// Runs by kind and status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabels {
    /// `plan`, `apply`, `destroy`, `drift_check`.
    pub kind: String,
    /// `queued`, `planning`, … (the Run status).
    pub status: String,
}

/// A Run kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `plan`, `apply`, `destroy`, `drift_check`.
    pub kind: String,
}

/// What the API reads from Postgres for a scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DbFigures {
    /// `(kind, status, count)`.
    pub runs: Vec<(String, String, i64)>,
    /// `(kind, seconds)`: the oldest queued Run of each kind that has one.
    pub queued_oldest_age: Vec<(String, f64)>,
    /// Outbox rows not yet published.
    pub outbox_backlog: i64,
    /// Age of the oldest unpublished outbox row (0 when none).
    pub outbox_oldest_age: f64,
    /// Dead letters held for operators.
    pub dead_letters: i64,
    /// Runs that ended `unknown_outcome` and are not resolved.
    pub unknown_outcome: i64,
}

/// The metrics text: this process's own figures, and `db`'s when given (the API's).
pub fn render(db: Option<&DbFigures>) -> String {
    let m = global();
    let mut registry = Registry::default();
    registry.register(
        "takosumi_http_requests",
        "HTTP requests by route template, method and status",
        m.http_requests.clone(),
    );
    registry.register(
        "takosumi_http_request_duration_seconds",
        "HTTP request latency by route template and method",
        m.http_duration.clone(),
    );
    registry.register(
        "takosumi_step_duration_seconds",
        "How long a step took to handle one message, by step and outcome",
        m.step_duration.clone(),
    );
    registry.register(
        "takosumi_queue_lag_seconds",
        "From the commit of a wake-up to its handler taking it, by step",
        m.queue_lag.clone(),
    );
    registry.register(
        "takosumi_reaper_actions",
        "What the lease reaper did, by action",
        m.reaper_actions.clone(),
    );
    if let Some(db) = db {
        let runs = Family::<RunLabels, Gauge>::default();
        for (kind, status, n) in &db.runs {
            runs.get_or_create(&RunLabels {
                kind: kind.clone(),
                status: status.clone(),
            })
            .set(*n);
        }
        registry.register("takosumi_runs", "Runs by kind and status (Postgres)", runs);
        let oldest = Family::<KindLabels, Gauge<f64, AtomicU64>>::default();
        for (kind, age) in &db.queued_oldest_age {
            oldest
                .get_or_create(&KindLabels { kind: kind.clone() })
                .set(*age);
        }
        registry.register(
            "takosumi_queued_oldest_age_seconds",
            "Age of the oldest queued Run by kind (Postgres): work no handler has taken",
            oldest,
        );
        let gauge = |v: i64| {
            let g = Gauge::<i64>::default();
            g.set(v);
            g
        };
        registry.register(
            "takosumi_outbox_backlog",
            "Outbox rows not yet published",
            gauge(db.outbox_backlog),
        );
        let age = Gauge::<f64, AtomicU64>::default();
        age.set(db.outbox_oldest_age);
        registry.register(
            "takosumi_outbox_oldest_age_seconds",
            "Age of the oldest unpublished outbox row",
            age,
        );
        registry.register(
            "takosumi_dead_letters",
            "Dead letters held for operators (requeue or purge them)",
            gauge(db.dead_letters),
        );
        registry.register(
            "takosumi_unknown_outcome_runs",
            "Runs that ended unknown_outcome and wait for an operator to resolve them",
            gauge(db.unknown_outcome),
        );
    }
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_what_was_observed_with_db_figures() {
        global().observe_request("/api/v1/runs/{run}", "GET", 200, Duration::from_millis(3));
        global().observe_step("plan", "done", Duration::from_millis(1500));
        let text = render(Some(&DbFigures {
            runs: vec![("plan".into(), "planned".into(), 7)],
            queued_oldest_age: vec![("apply".into(), 2.5)],
            outbox_backlog: 3,
            outbox_oldest_age: 1.25,
            dead_letters: 1,
            unknown_outcome: 2,
        }));
        for want in [
            r#"takosumi_http_requests_total{route="/api/v1/runs/{run}",method="GET",status="200"} 1"#,
            r#"takosumi_step_duration_seconds_count{step="plan",outcome="done"} 1"#,
            r#"takosumi_runs{kind="plan",status="planned"} 7"#,
            r#"takosumi_queued_oldest_age_seconds{kind="apply"} 2.5"#,
            "takosumi_outbox_backlog 3",
            "takosumi_outbox_oldest_age_seconds 1.25",
            "takosumi_dead_letters 1",
            "takosumi_unknown_outcome_runs 2",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        assert!(!render(None).contains("takosumi_runs{"));
    }
}
