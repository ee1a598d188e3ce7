//! What the fault and security suites look at from outside: every table's rows and
//! counts, every stored object, raw API calls (status, JSON and the raw body), and the
//! suite summary each test adds its figures to.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use serde_json::Value;

use crate::Stack;

/// Every table of the stack's database (the `public` schema, less sqlx's bookkeeping).
pub async fn tables(pool: &takosumi_store::Pool) -> anyhow::Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' \
         AND tablename <> '_sqlx_migrations' ORDER BY tablename",
    )
    .fetch_all(pool)
    .await?)
}

/// Row count of every table: a refused request must leave all of them as they were.
pub async fn row_counts(pool: &takosumi_store::Pool) -> anyhow::Result<BTreeMap<String, i64>> {
    let mut out = BTreeMap::new();
    for t in tables(pool).await? {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{t}\""))
            .fetch_one(pool)
            .await?;
        out.insert(t, n);
    }
    Ok(out)
}

/// Columns that change on their own, not because of a request: the relay claiming an
/// outbox row and stamping it as published.
const VOLATILE: [&str; 3] = ["sent_at", "publish_attempts", "claimed_until"];

/// Tables written on their own, not by the request being checked: the evidence writer's,
/// after a Run ended (a request that ended a Run moments before another one is checked
/// would otherwise look as if the second had changed them), and the dead-letter
/// collector's, whenever a step dead-letters a message. Only those write them.
const WRITTEN_IN_BACKGROUND: [&str; 4] = [
    "evidence_pending",
    "evidence_statements",
    "evidence_heads",
    "dead_letters",
];

/// A digest of every row of every table (`row_to_json`, in a stable order, less the
/// [`VOLATILE`] columns), for "nothing changed" checks that also catch an UPDATE.
pub async fn fingerprint(pool: &takosumi_store::Pool) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let volatile: Vec<String> = VOLATILE.iter().map(|c| (*c).to_owned()).collect();
    for t in tables(pool).await? {
        if WRITTEN_IN_BACKGROUND.contains(&t.as_str()) {
            continue;
        }
        let rows: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT (row_to_json(x)::jsonb - $1::text[])::text FROM \"{t}\" x ORDER BY 1"
        ))
        .bind(&volatile)
        .fetch_all(pool)
        .await?;
        out.insert(t, takosumi_store::sha256_hex(rows.join("\n").as_bytes()));
    }
    Ok(out)
}

/// Every row of every table as JSON text: `(table, row)`.
pub async fn dump_tables(pool: &takosumi_store::Pool) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for t in tables(pool).await? {
        let rows: Vec<String> =
            sqlx::query_scalar(&format!("SELECT row_to_json(x)::text FROM \"{t}\" x"))
                .fetch_all(pool)
                .await?;
        out.extend(rows.into_iter().map(|r| (t.clone(), r)));
    }
    Ok(out)
}

/// Every object of the stack's bucket, raw bytes: `(key, bytes)`.
pub async fn dump_objects(stack: &Stack) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for key in stack.ctx.objects.list("").await? {
        let bytes = stack.ctx.objects.get(&key, 256 << 20).await?;
        out.push((key, bytes));
    }
    Ok(out)
}

/// A raw API response.
#[derive(Debug, Clone)]
pub struct Response {
    /// HTTP status.
    pub status: u16,
    /// The body parsed as JSON (`Null` when it is not JSON).
    pub json: Value,
    /// The body as text.
    pub text: String,
}

/// Calls the stack's API with `method`, `path`, an optional bearer token, extra headers
/// and an optional raw body (sent as `application/json`).
pub async fn call(
    stack: &Stack,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> anyhow::Result<Response> {
    // A redirect is an answer to check (the dashboard's sign-in), not to follow.
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let method = reqwest::Method::from_bytes(method.as_bytes())?;
    let mut req = http.request(method, format!("{}{path}", stack.api_url));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req
            .header("content-type", "application/json")
            .body(b.to_vec());
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let text = resp.text().await?;
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    Ok(Response { status, json, text })
}

/// Where the suite summary is collected: `TAKOSUMI_SUITE_SUMMARY`, or
/// `takosumi-suite-summary.tsv` in the cargo target directory (`infra/local/test.sh`
/// empties it before the tests and prints it as a table after them).
pub fn summary_path() -> PathBuf {
    if let Ok(p) = std::env::var("TAKOSUMI_SUITE_SUMMARY") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    // target/<profile>/deps/<test binary>
    let target = exe
        .ancestors()
        .nth(3)
        .map_or_else(std::env::temp_dir, PathBuf::from);
    target.join("takosumi-suite-summary.tsv")
}

/// Adds one figure to the suite summary (`suite`, `what`, `value`) and prints it at once,
/// past the test harness's capture, so a run shows each figure as it is measured.
pub fn record(suite: &str, what: &str, value: impl std::fmt::Display) {
    let line = format!("{suite}\t{what}\t{value}");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(summary_path())
    {
        let _ = writeln!(f, "{line}");
    }
    let _ = writeln!(
        std::io::stdout().lock(),
        "[suite] {suite}: {what} = {value}"
    );
}

/// Prints a line past the test harness's capture (a suite's one-line result).
pub fn say(line: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}
