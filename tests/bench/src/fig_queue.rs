//! Figure 8: queue latency, from a wake-up's commit to the handler's claim, read from the
//! Run events: for the plan step `queued` (written with the outbox row in the API's
//! transaction) → `claimed`; for the apply step the gate's `gate_decision` (written with
//! the apply wake-up) → `claimed`. It spans the outbox relay, RabbitMQ, the consumer and the
//! handler's first read and claim transaction.

use crate::fig_overhead::QueueSamples;
use crate::fig_throughput::LoadQueue;
use crate::report::Report;
use crate::stats::Summary;

/// Adds figure 8 from the samples the other figures collected.
pub fn report(report: &mut Report, idle: Option<&QueueSamples>, load: Option<&LoadQueue>) {
    let mut lines = vec![
        "| samples | step | n | median | p95 | p99 | max |".to_owned(),
        "|---|---|---|---|---|---|---|".to_owned(),
    ];
    let mut add = |what: &str, step: &str, v: &[f64]| {
        if let Some(s) = Summary::of(v) {
            lines.push(format!(
                "| {what} | {step} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
                s.n, s.median, s.p95, s.p99, s.max
            ));
        }
    };
    let mut value = Vec::new();
    if let Some(q) = idle {
        add(
            "idle (figure 1–2 runs, one at a time)",
            "plan: queued → claimed",
            &q.plan,
        );
        add(
            "idle",
            "  of which queued → relay pickup (outbox sent_at)",
            &q.relay_pickup,
        );
        add(
            "idle",
            "  of which relay pickup → claimed",
            &q.broker_to_claim,
        );
        add("idle", "apply: gate_decision → claimed", &q.apply);
        add(
            "idle",
            "gate step on an apply: queued → gate_decision",
            &q.gate,
        );
        if let Some(s) = Summary::of(&q.plan) {
            value.push(format!("idle plan {}", s.ms_median_p99()));
        }
        if let Some(s) = Summary::of(&q.apply) {
            value.push(format!("idle apply {}", s.ms_median_p99()));
        }
    }
    if let Some(q) = load {
        let what = format!("under load (figure 3, {}/step, backlog included)", q.procs);
        add(&what, "plan: queued → claimed", &q.plan);
        add(&what, "apply: gate_decision → claimed", &q.apply);
        if let Some(s) = Summary::of(&q.plan) {
            value.push(format!("loaded plan {}", s.ms_median_p99()));
        }
    }
    if value.is_empty() {
        return;
    }
    report.row(
        "8. queue latency, wake-up commit → handler claim (median / p99)",
        value.join("; "),
        "—",
        "—",
        "median and p99 (no target set)",
        None,
    );
    report.detail("8. queue latency", lines);
}
