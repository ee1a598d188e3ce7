//! Figure 4. First **a stand-in**, written before the sweep function existed: it times the
//! database work a sweep has to do to enqueue a drift check for each of 10,000 Capsules:
//! read the due Capsules, then per batch of 1,000, in one transaction, insert the queued
//! `drift_check` Runs, their `queued` events and their `run.drift` outbox rows (what the
//! API writes for one submission, set-based). Publishing is the relay's work afterwards and
//! is not counted; nothing consumes `run.drift` here. Then the real sweep
//! (`takosumi_sweep::sweep_once`, one pass) over 10,000 other Capsules that are all due,
//! in a Workspace with a drift interval (the stand-in's Workspace has none, so the sweep
//! does not see its Capsules).

use std::time::Instant;

use takosumi_core::{RunId, RunMessage};
use takosumi_tests::Stack;

use crate::report::Report;

/// Runs figure 4 with `capsules` Capsules in batches of `batch`.
pub async fn run(report: &mut Report, capsules: usize, batch: usize) -> anyhow::Result<()> {
    let stack = crate::harness::quiet_stack().await?;
    let result = measure(&stack, report, capsules, batch).await;
    stack.stop().await?;
    result
}

async fn measure(
    stack: &Stack,
    report: &mut Report,
    capsules: usize,
    batch: usize,
) -> anyhow::Result<()> {
    let pool = &stack.ctx.pool;
    let ws = uuid::Uuid::now_v7();
    sqlx::query("INSERT INTO workspaces (id, name) VALUES ($1, 'sweep-bench')")
        .bind(ws)
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO capsules (id, workspace_id, name, repo, branch, dir, tool, vars)
         SELECT gen_random_uuid(), $1, 'cap-' || g, 'file:///nonexistent', 'main', 'infra', 'terraform', '{}'::jsonb
           FROM generate_series(1, $2) g",
    )
    .bind(ws)
    .bind(i32::try_from(capsules)?)
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE capsules").execute(pool).await?;

    let t = Instant::now();
    let due: Vec<(uuid::Uuid, uuid::Uuid)> =
        sqlx::query_as("SELECT id, workspace_id FROM capsules ORDER BY id")
            .fetch_all(pool)
            .await?;
    let read_ms = t.elapsed().as_secs_f64() * 1000.0;
    let mut batch_ms = Vec::new();
    for chunk in due.chunks(batch.max(1)) {
        let b = Instant::now();
        let ids: Vec<RunId> = chunk.iter().map(|_| RunId::new()).collect();
        let run_ids: Vec<uuid::Uuid> = ids.iter().map(RunId::as_uuid).collect();
        let caps: Vec<uuid::Uuid> = chunk.iter().map(|(c, _)| *c).collect();
        let wss: Vec<uuid::Uuid> = chunk.iter().map(|(_, w)| *w).collect();
        let payloads: Vec<serde_json::Value> = ids
            .iter()
            .map(|r| RunMessage { run_id: *r }.to_json())
            .collect();
        let mut tx = pool.begin().await?;
        sqlx::query(
            "INSERT INTO runs (id, kind, status, workspace_id, capsule_id, actor_kind, actor_id)
             SELECT r, 'drift_check', 'queued', w, c, 'system', 'sweep'
               FROM UNNEST($1::uuid[], $2::uuid[], $3::uuid[]) AS t(r, w, c)",
        )
        .bind(&run_ids)
        .bind(&wss)
        .bind(&caps)
        .execute(tx.db())
        .await?;
        sqlx::query(
            "INSERT INTO run_events (run_id, kind, actor, data)
             SELECT r, 'queued', 'system:sweep', '{\"kind\":\"drift_check\"}'::jsonb FROM UNNEST($1::uuid[]) AS t(r)",
        )
        .bind(&run_ids)
        .execute(tx.db())
        .await?;
        sqlx::query(
            "INSERT INTO outbox (topic, payload) SELECT 'run.drift', p FROM UNNEST($1::jsonb[]) AS t(p)",
        )
        .bind(&payloads)
        .execute(tx.db())
        .await?;
        tx.commit().await?;
        batch_ms.push(b.elapsed().as_secs_f64() * 1000.0);
    }
    let total = t.elapsed().as_secs_f64() * 1000.0;
    let queued: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM runs WHERE kind = 'drift_check' AND status = 'queued'",
    )
    .fetch_one(pool)
    .await?;
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE topic = 'run.drift'")
        .fetch_one(pool)
        .await?;
    anyhow::ensure!(
        queued as usize == capsules && outbox as usize == capsules,
        "stand-in enqueued {queued} runs and {outbox} outbox rows for {capsules} Capsules"
    );
    report.row(
        format!("4. sweep enqueue, {capsules} Capsules (**stand-in**: the equivalent DB work, written before the sweep existed)"),
        format!("{:.0} ms", total),
        "—",
        format!("{:.0} Capsules/s", capsules as f64 / (total / 1000.0)),
        "≤ 1 s",
        Some(total <= 1000.0),
    );
    let bs = crate::stats::Summary::of(&batch_ms);
    let real = real_sweep(stack, capsules).await?;
    report.row(
        format!("4. sweep enqueue, {capsules} Capsules (`takosumi_sweep::sweep_once`)"),
        format!("{real:.0} ms"),
        format!("stand-in below: {total:.0} ms"),
        format!("{:.0} Capsules/s", capsules as f64 / (real / 1000.0)),
        "≤ 1 s",
        Some(real <= 1000.0),
    );
    report.detail(
        "4. sweep stand-in",
        vec![format!(
            "Read {capsules} due Capsules: {read_ms:.1} ms; {} transactions of {batch} (Runs + `queued` events + outbox rows): median {:.1} ms, max {:.1} ms each; total {total:.0} ms.",
            batch_ms.len(),
            bs.map_or(f64::NAN, |s| s.median),
            bs.map_or(f64::NAN, |s| s.max),
        )],
    );
    Ok(())
}

/// Seeds `capsules` due Capsules (each with an applied StateVersion, as the sweep needs)
/// and times one `sweep_once` pass over them; checks it enqueued one check per Capsule.
async fn real_sweep(stack: &Stack, capsules: usize) -> anyhow::Result<f64> {
    crate::fig_scale::seed_due(stack, "sweep-real", capsules).await?;
    let t = Instant::now();
    let n = takosumi_sweep::sweep_once(&stack.ctx).await?;
    let elapsed = t.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(
        n as usize == capsules,
        "sweep_once enqueued {n} checks for {capsules} due Capsules"
    );
    Ok(elapsed)
}
