//! Figures 9 and 10: the two reads and writes that grow with the size of an instance,
//! measured on data generated in SQL in the figure's own database.
//!
//! - **9.** `GET /api/v1/workspaces/{ws}/runs`, a page of 50, with `runs` Runs in the table
//!   (half of them in the Workspace read, the rest spread over nine others): the first
//!   page, a page 100,000 Runs deep (by cursor), one Capsule's history and a rare status.
//!   Load from `wrk` (as figure 6), the API in this process.
//! - **10.** One sweep pass over `capsules` due Capsules, each with an applied StateVersion
//!   to check against: `takosumi_sweep::sweep_once` in this process (the figure), then the
//!   real `takosumi-sweep --once` binary over 10 % of them and over all of them, whose peak
//!   RSS says whether memory stays flat as the count grows.

use std::time::Instant;

use takosumi_tests::{Options, Stack, Steps};

use crate::fig_http::{self, Load};
use crate::report::Report;

/// Workspaces the generated Runs are spread over (the first one is read).
const WORKSPACES: i32 = 10;
/// Capsules per Workspace.
const CAPSULES_PER_WS: i32 = 100;

/// Runs figure 9 with `runs` Runs in the table and `secs` seconds of load per request.
pub async fn list_page(report: &mut Report, runs: usize, secs: u64) -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        lease_secs: 60,
    })
    .await?;
    let result = measure_list(&stack, report, runs, secs).await;
    stack.stop().await?;
    result
}

async fn measure_list(
    stack: &Stack,
    report: &mut Report,
    runs: usize,
    secs: u64,
) -> anyhow::Result<()> {
    let pool = &stack.ctx.pool;
    let t = Instant::now();
    let wss: Vec<uuid::Uuid> = (0..WORKSPACES).map(|_| uuid::Uuid::now_v7()).collect();
    let mut tx = pool.begin().await?;
    // Generating a million rows takes longer than the stack's statement timeout.
    tx.lift_statement_timeout().await?;
    sqlx::query(
        "INSERT INTO workspaces (id, name) SELECT w, 'list-' || ord FROM UNNEST($1::uuid[]) WITH ORDINALITY AS t(w, ord)",
    )
    .bind(&wss)
    .execute(tx.db())
    .await?;
    sqlx::query(
        "INSERT INTO capsules (id, workspace_id, name, repo, branch, dir, tool, vars)
         SELECT gen_random_uuid(), w, 'cap-' || g, 'file:///nonexistent', 'main', 'infra', 'terraform', '{}'::jsonb
           FROM UNNEST($1::uuid[]) AS t(w), generate_series(1, $2) g",
    )
    .bind(&wss)
    .bind(CAPSULES_PER_WS)
    .execute(tx.db())
    .await?;
    // Ended Runs only, written as history: the evidence trigger would queue a statement
    // per Run for the API's evidence writer to sign during the measurement.
    takosumi_tests::seed::evidence_on_insert(&mut tx, false).await?;
    // Run g: half in the first Workspace, the rest round-robin over the others; one a
    // second back in time; kinds and statuses in a plausible mix, 1 in 10,000 unknown.
    sqlx::query(
        r#"WITH caps AS (
               SELECT id, workspace_id,
                      row_number() OVER (PARTITION BY workspace_id ORDER BY id) - 1 AS n,
                      array_position($1::uuid[], workspace_id) - 1 AS w
                 FROM capsules)
           INSERT INTO runs (id, kind, status, workspace_id, capsule_id, actor_kind, actor_id,
                             created_at, updated_at)
           SELECT gen_random_uuid(),
                  (CASE g % 4 WHEN 0 THEN 'apply' WHEN 1 THEN 'drift_check' ELSE 'plan' END)::run_kind,
                  (CASE WHEN g % 10000 = 8 THEN 'unknown_outcome'
                        WHEN g % 20 = 3 THEN 'failed'
                        WHEN g % 4 = 0 THEN 'applied' ELSE 'planned' END)::run_status,
                  c.workspace_id, c.id, 'user', 'bench',
                  now() - make_interval(secs => g), now() - make_interval(secs => g)
             FROM generate_series(1, $2) g
             JOIN caps c
               ON c.w = CASE WHEN g % 2 = 0 THEN 0 ELSE 1 + (g / 2) % ($3 - 1) END
              AND c.n = (g / 7) % $4"#,
    )
    .bind(&wss)
    .bind(i64::try_from(runs)?)
    .bind(i64::from(WORKSPACES))
    .bind(i64::from(CAPSULES_PER_WS))
    .execute(tx.db())
    .await?;
    takosumi_tests::seed::evidence_on_insert(&mut tx, true).await?;
    tx.commit().await?;
    vacuum(pool).await?;
    let seed_s = t.elapsed().as_secs_f64();
    let settled = checkpoint(pool).await;

    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(pool)
        .await?;
    anyhow::ensure!(
        total as usize == runs,
        "generated {total} Runs, wanted {runs}"
    );
    let ws = takosumi_core::WorkspaceId::from_uuid(wss[0]);
    let in_ws: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE workspace_id = $1")
        .bind(wss[0])
        .fetch_one(pool)
        .await?;
    let capsule: uuid::Uuid = sqlx::query_scalar(
        "SELECT capsule_id FROM runs WHERE workspace_id = $1 GROUP BY capsule_id ORDER BY count(*) DESC LIMIT 1",
    )
    .bind(wss[0])
    .fetch_one(pool)
    .await?;
    let capsule = takosumi_core::CapsuleId::from_uuid(capsule);
    // A client's cursor after reading 10,000 Runs of the history, from the API itself.
    let deep = deep_cursor(stack, ws, 100).await?;
    let base = format!("{}/api/v1/workspaces/{ws}/runs", stack.api_url);
    let cases = [
        ("first page", format!("{base}?limit=50")),
        (
            "10,000 deep (cursor)",
            format!("{base}?limit=50&cursor={deep}"),
        ),
        ("one Capsule", format!("{base}?limit=50&capsule={capsule}")),
        (
            "status=unknown_outcome (1 in 10,000)",
            format!("{base}?limit=50&status=unknown_outcome"),
        ),
    ];
    let tmp = tempfile::tempdir()?;
    let wrk = fig_http::which_wrk();
    let mut lines = vec![
        format!(
            "{total} Runs in the table ({in_ws} in the Workspace read, the rest in {} others), {} Capsules, generated in SQL and `VACUUM ANALYZE`d in {seed_s:.0} s; {settled}. Each request: {} against the in-process API, a page of 50 Runs serialised in full.",
            WORKSPACES - 1,
            WORKSPACES * CAPSULES_PER_WS,
            match &wrk {
                Some(_) => format!("wrk -t2 -c{} -d{secs}s --latency", fig_http::CONNECTIONS),
                None => "the bench binary's own load loop (wrk not installed)".to_owned(),
            }
        ),
        String::new(),
        "| request | req/s | p50 | p99 | errors |".to_owned(),
        "|---|---|---|---|---|".to_owned(),
    ];
    for (name, url) in &cases {
        let page: serde_json::Value = reqwest::Client::new()
            .get(url)
            .bearer_auth(&stack.admin_token)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let n = page["runs"].as_array().map_or(0, Vec::len);
        anyhow::ensure!(n > 0, "{name}: the page is empty: {page}");
        let l: Load =
            fig_http::load(&wrk, tmp.path(), &stack.admin_token, "GET", url, secs).await?;
        lines.push(format!(
            "| {name} ({n} Runs) | {:.0} | {:.2} ms | {:.2} ms | {} |",
            l.rps, l.p50, l.p99, l.errors
        ));
        report.row(
            format!("9. `GET /workspaces/{{ws}}/runs`, {name}, {total} Runs"),
            format!(
                "p99 {:.2} ms, {:.0} req/s (p50 {:.2} ms)",
                l.p99, l.rps, l.p50
            ),
            "—",
            "—",
            "p99 ≤ 20 ms",
            Some(l.p99 <= 20.0 && l.errors == 0),
        );
    }
    report.detail("9. Run history page at scale", lines);
    Ok(())
}

/// The cursor a client holds after reading `pages` pages of 100 of the Workspace's history.
async fn deep_cursor(
    stack: &Stack,
    ws: takosumi_core::WorkspaceId,
    pages: usize,
) -> anyhow::Result<String> {
    let mut q = takosumi_client::RunQuery {
        limit: Some(100),
        ..Default::default()
    };
    for _ in 0..pages {
        let page = stack.client.list_runs(ws, &q).await?;
        q.cursor = Some(
            page.next_cursor
                .ok_or_else(|| anyhow::anyhow!("the history ended before {pages} pages"))?,
        );
    }
    q.cursor
        .ok_or_else(|| anyhow::anyhow!("no cursor after {pages} pages"))
}

/// Runs figure 10 over `capsules` due Capsules.
pub async fn sweep(report: &mut Report, capsules: usize) -> anyhow::Result<()> {
    let stack = crate::harness::quiet_stack().await?;
    let result = measure_sweep(&stack, report, capsules).await;
    stack.stop().await?;
    result
}

/// Adds `n` due Capsules (see [`takosumi_tests::seed::due_capsules`]).
pub(crate) async fn seed_due(stack: &Stack, name: &str, n: usize) -> anyhow::Result<uuid::Uuid> {
    takosumi_tests::seed::due_capsules(&stack.ctx.pool, name, n).await
}

async fn vacuum(pool: &takosumi_store::Pool) -> anyhow::Result<()> {
    takosumi_tests::seed::vacuum(pool).await
}

/// Writes out what the figure's data generation left in Postgres's buffers and WAL
/// (`CHECKPOINT`), so the timed part starts as on an instance that holds this data, not
/// one still settling a bulk load: generating the data writes ~0.5-1 GB of WAL, and the
/// checkpoint that starts on its own (stock `max_wal_size`) then spreads its writes over
/// the next 20-50 s, through the timed part or not, by chance (BENCHMARKS.md, sessions 34
/// and 35). What the timed part itself writes still counts, full-page images included:
/// after a checkpoint every page's first change writes the whole page, as on an instance
/// whose last sweep or page read was before its last checkpoint. Says what it did, for
/// the figure's notes; a role that may not checkpoint (`pg_checkpoint`) only skips it.
pub(crate) async fn checkpoint(pool: &takosumi_store::Pool) -> String {
    let t = Instant::now();
    match takosumi_tests::seed::untimed(pool, "CHECKPOINT").await {
        Ok(()) => format!(
            "then a `CHECKPOINT` ({:.1} s) before anything is timed",
            t.elapsed().as_secs_f64()
        ),
        Err(e) => format!("no `CHECKPOINT` before the timed part ({e})"),
    }
}

/// Checks enqueued for the Workspace's Capsules.
async fn checks_of(stack: &Stack, ws: uuid::Uuid) -> anyhow::Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT capsule_id) FROM runs WHERE workspace_id = $1 AND kind = 'drift_check'",
    )
    .bind(ws)
    .fetch_one(&stack.ctx.pool)
    .await?)
}

async fn measure_sweep(stack: &Stack, report: &mut Report, capsules: usize) -> anyhow::Result<()> {
    let t = Instant::now();
    let ws = seed_due(stack, "sweep-scale", capsules).await?;
    let seed_s = t.elapsed().as_secs_f64();
    let settled = checkpoint(&stack.ctx.pool).await;
    let t = Instant::now();
    let n = takosumi_sweep::sweep_once(&stack.ctx).await?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let (checks, distinct) = checks_of(stack, ws).await?;
    anyhow::ensure!(
        n as usize == capsules && checks == n && distinct == n,
        "sweep_once enqueued {n} ({checks} checks, {distinct} Capsules) for {capsules} due Capsules"
    );
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE topic = 'run.drift'")
        .fetch_one(&stack.ctx.pool)
        .await?;
    anyhow::ensure!(outbox == n, "{outbox} wake-ups for {n} checks");
    // The binary below flushes the outbox it finds: only its own wake-ups.
    sqlx::query("DELETE FROM outbox")
        .execute(&stack.ctx.pool)
        .await?;
    report.row(
        format!("10. sweep of {capsules} due Capsules (`sweep_once`, one pass)"),
        format!("{ms:.0} ms"),
        "—",
        format!("{:.0} Capsules/s", capsules as f64 / (ms / 1000.0)),
        "≤ 5 s, memory flat",
        Some(ms <= 5000.0),
    );
    // The binary, over a tenth and over all of them (new Workspaces, so every one is due):
    // its peak RSS is what "memory flat" is judged by.
    let mut lines = vec![format!(
        "{capsules} due Capsules with an applied StateVersion each, generated in SQL in {seed_s:.0} s, {settled}; `sweep_once` walks them in {} ranges side by side, claiming {} per statement (about {} statements).",
        takosumi_sweep::WALKS,
        takosumi_sweep::BATCH,
        (capsules as u64).div_ceil(takosumi_sweep::BATCH as u64)
    )];
    let mut peaks = Vec::new();
    for count in [capsules / 10, capsules] {
        let ws = seed_due(stack, &format!("sweep-bin-{count}"), count).await?;
        let t = Instant::now();
        let child = stack.spawn_step("sweep", &["--once"], &[("RUST_LOG", "warn")], None)?;
        let pid = child.id().unwrap_or_default();
        let (status, peak) = crate::procfs::wait_with_peak(child, pid).await?;
        let secs = t.elapsed().as_secs_f64();
        anyhow::ensure!(status.success(), "takosumi-sweep --once exited {status}");
        let (checks, _) = checks_of(stack, ws).await?;
        anyhow::ensure!(
            checks as usize == count,
            "takosumi-sweep --once enqueued {checks} checks for {count} due Capsules"
        );
        let unsent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            .fetch_one(&stack.ctx.pool)
            .await?;
        lines.push(format!(
            "`takosumi-sweep --once` over {count} due Capsules: {secs:.2} s wall (process start, connect, sweep, outbox flush), {unsent} wake-ups left unpublished, peak RSS {:.1} MiB.",
            peak as f64 / 1024.0
        ));
        peaks.push(peak);
    }
    let flat = peaks[1] as f64 <= peaks[0] as f64 * 1.25 + 2048.0;
    report.row(
        format!(
            "10. sweep process peak RSS, {} → {capsules} due Capsules",
            capsules / 10
        ),
        format!(
            "{:.1} → {:.1} MiB",
            peaks[0] as f64 / 1024.0,
            peaks[1] as f64 / 1024.0
        ),
        "—",
        format!("{:.2}×", peaks[1] as f64 / peaks[0].max(1) as f64),
        "flat (≤ 1.25× + 2 MiB for 10× the Capsules)",
        Some(flat),
    );
    report.detail("10. sweep at scale", lines);
    Ok(())
}
