//! Figure 11: the outbox relay's rate. `n` due wake-ups, generated in SQL as one sweep
//! pass leaves them (figure 10: one `run.drift` row per check), are published by
//! `takosumi_queue::relay_once` passes until none is due, as a `--once` process flushes
//! its outbox (`flush_outbox`) and a relay drains a backlog. No goal of its own: a sweep's
//! checks are planned only once their wake-ups are out, so this is the rest of a sweep's
//! wall time after figure 10.

use std::time::Instant;

use lapin::options::{QueueDeclareOptions, QueuePurgeOptions};
use lapin::types::FieldTable;

use crate::report::Report;

/// The queue the wake-ups go to (a sweep's drift checks), which nothing consumes here.
const QUEUE: &str = "run.drift";

/// Runs figure 11 over `n` wake-ups.
pub async fn run(report: &mut Report, n: usize) -> anyhow::Result<()> {
    let stack = crate::harness::quiet_stack().await?;
    let result = measure(&stack, report, n).await;
    stack.stop().await?;
    result
}

async fn measure(
    stack: &takosumi_tests::Stack,
    report: &mut Report,
    n: usize,
) -> anyhow::Result<()> {
    let pool = &stack.ctx.pool;
    let broker = stack.ctx.bus.get().await?;
    let channel = broker.channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let depth = async || -> anyhow::Result<u32> {
        let q = channel
            .queue_declare(QUEUE.into(), passive, FieldTable::default())
            .await?;
        Ok(q.message_count())
    };
    channel
        .queue_purge(QUEUE.into(), QueuePurgeOptions::default())
        .await?;
    let t = Instant::now();
    sqlx::query(
        "INSERT INTO outbox (topic, payload, traceparent)
         SELECT $2, jsonb_build_object('runId', 'run_' || replace(uuid_v7()::text, '-', '')),
                '00-' || md5(g::text) || '-' || substr(md5(g::text), 1, 16) || '-01'
           FROM generate_series(1, $1) g",
    )
    .bind(i64::try_from(n)?)
    .bind(QUEUE)
    .execute(&**pool)
    .await?;
    let seed_s = t.elapsed().as_secs_f64();
    let settled = crate::fig_scale::checkpoint(pool).await;

    let t = Instant::now();
    let (mut sent, mut passes) = (0usize, 0usize);
    loop {
        let k = takosumi_queue::relay_once(pool, &broker).await?;
        if k == 0 {
            break;
        }
        sent += k;
        passes += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    let unsent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
        .fetch_one(&**pool)
        .await?;
    let queued = depth().await?;
    anyhow::ensure!(
        sent == n && unsent == 0 && queued as usize == n,
        "the relay sent {sent} of {n} wake-ups ({unsent} left unsent, {queued} in {QUEUE})"
    );
    channel
        .queue_purge(QUEUE.into(), QueuePurgeOptions::default())
        .await?;
    sqlx::query("DELETE FROM outbox").execute(&**pool).await?;
    report.row(
        format!("11. outbox relay, {n} due wake-ups published (`relay_once` passes)"),
        format!("{:.0} ms", secs * 1000.0),
        "—",
        format!("{:.0} wake-ups/s", n as f64 / secs),
        "— (a sweep's checks wait for it)",
        None,
    );
    report.detail(
        "11. outbox relay",
        vec![format!(
            "{n} due `{QUEUE}` wake-ups with a trace context each, generated in SQL in {seed_s:.1} s, {settled}; published in {passes} passes of up to {} (claim, publish with confirms, mark sent); the broker held {queued} persistent messages afterwards (purged).",
            takosumi_queue::BATCH
        )],
    );
    Ok(())
}
