//! The `takosumi` commands that read and steer the Run record: watching a Run as it moves
//! (`--watch`, `logs --follow`), `cancel`, `cost`, `resolve`, `runs` and `activity`.
//!
//! Exit codes follow the rest of the CLI: 0 when the command did what it says, 1 when the
//! API refused it or a Run that was followed to its end ended `failed`, `canceled` or
//! `unknown_outcome` (for `cancel --wait`: when it ended anything but `canceled`).

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use serde_json::Value;
use takosumi_client::{
    ActivityEntry, Client, ClientError, Cost, Run, RunEvent, RunId, RunKind, RunPage, RunQuery,
    RunStatus, WorkspaceId,
};

use crate::{EXIT_FAILED, ended_badly, kind_str, print_json, report_waited, show_run};

/// How often a watched Run is read.
const WATCH_POLL: Duration = Duration::from_millis(500);
/// How often a followed log is read.
const FOLLOW_POLL: Duration = Duration::from_secs(1);
/// Consecutive failed reads a watch rides out (an API restart) before it gives up.
const WATCH_ERRORS: u32 = 5;

fn clock(at: Option<chrono::DateTime<chrono::Utc>>) -> String {
    at.unwrap_or_else(chrono::Utc::now)
        .format("%H:%M:%S%.3f")
        .to_string()
}

fn flush() {
    let _ = std::io::stdout().flush();
}

/// One progress line for an event: time, kind, actor and its details.
pub(crate) fn event_line(e: &RunEvent) -> String {
    let mut line = format!("{}  {:<22} {}", clock(e.at), e.kind, e.actor);
    match &e.data {
        Value::Null => {}
        Value::Object(m) if m.is_empty() => {}
        data => {
            let _ = write!(line, "  {data}");
        }
    }
    line
}

/// Whether a read failure is worth retrying while following a Run.
fn transient(e: &ClientError) -> bool {
    matches!(e, ClientError::Http { .. })
        || matches!(e, ClientError::Api { status, .. } if matches!(status, 502..=504))
}

/// Follows a just-submitted Run until it is finished or held: every status change and
/// every event is printed as it happens (human form only), then the Run as `wait` shows
/// it. The exit code is the Run's outcome.
pub(crate) async fn watch(
    client: &Client,
    run: Run,
    timeout: Duration,
    json: bool,
) -> Result<u8, ClientError> {
    let deadline = tokio::time::Instant::now() + timeout;
    if !json {
        println!(
            "{}  {} {} of {}",
            clock(None),
            run.id,
            kind_str(run.kind),
            run.capsule_id
        );
        flush();
    }
    let mut last_status: Option<RunStatus> = None;
    let mut seen = 0usize;
    let mut errors = 0u32;
    loop {
        let step = async {
            let now = client.get_run(run.id).await?;
            let events = client.events(run.id).await?;
            Ok::<_, ClientError>((now, events))
        };
        let (now, events) = match step.await {
            Ok(v) => {
                errors = 0;
                v
            }
            Err(e) if transient(&e) && errors + 1 < WATCH_ERRORS => {
                errors += 1;
                tokio::time::sleep(WATCH_POLL).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if !json {
            for e in events.iter().skip(seen) {
                println!("{}", event_line(e));
            }
            if last_status != Some(now.status) {
                println!("{}  status: {}", clock(None), now.status.as_str());
            }
            flush();
        }
        seen = seen.max(events.len());
        last_status = Some(now.status);
        if now.status.is_terminal() || now.status == RunStatus::Held {
            return Ok(report_waited(&now, json));
        }
        if tokio::time::Instant::now() + WATCH_POLL > deadline {
            return Err(ClientError::Timeout {
                run: run.id,
                last_status: now.status,
            });
        }
        tokio::time::sleep(WATCH_POLL).await;
    }
}

/// Prints a Run's log and keeps printing what is added until the Run is finished or held.
/// With `--json`, one log entry per line. The exit code is the Run's outcome.
pub(crate) async fn follow_logs(
    client: &Client,
    run: RunId,
    json: bool,
) -> Result<u8, ClientError> {
    let mut printed = 0usize;
    let mut step: Option<String> = None;
    let mut errors = 0u32;
    loop {
        // The status is read before the log: once it is final, the log read after it is
        // complete.
        let read = async {
            let now = client.get_run(run).await?;
            let entries = client.log_entries(run).await?;
            Ok::<_, ClientError>((now, entries))
        };
        let (now, entries) = match read.await {
            Ok(v) => {
                errors = 0;
                v
            }
            Err(e) if transient(&e) && errors + 1 < WATCH_ERRORS => {
                errors += 1;
                tokio::time::sleep(FOLLOW_POLL).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        for entry in entries.iter().skip(printed) {
            if json {
                if let Ok(line) = serde_json::to_string(entry) {
                    println!("{line}");
                }
                continue;
            }
            if step.as_deref() != Some(entry.step.as_str()) {
                println!("== {} ==", entry.step);
                step = Some(entry.step.clone());
            }
            print!("{}", entry.text);
            if !entry.text.ends_with('\n') {
                println!();
            }
        }
        printed = printed.max(entries.len());
        flush();
        if now.status.is_terminal() || now.status == RunStatus::Held {
            if ended_badly(now.status) {
                eprintln!("error: {} ended {}", now.id, now.status.as_str());
                return Ok(EXIT_FAILED);
            }
            if now.status == RunStatus::Held {
                eprintln!("note: {} is held: it waits for a person", now.id);
            }
            return Ok(0);
        }
        tokio::time::sleep(FOLLOW_POLL).await;
    }
}

/// `takosumi cancel RUN [--wait]`.
pub(crate) async fn cancel(
    client: &Client,
    run: RunId,
    reason: Option<&str>,
    wait: Option<Duration>,
    json: bool,
) -> Result<u8, ClientError> {
    let now = client.cancel(run, reason).await?;
    let Some(timeout) = wait.filter(|_| now.status != RunStatus::Canceled) else {
        show_run(&now, json);
        if !json && now.status != RunStatus::Canceled {
            eprintln!(
                "note: cancel requested: the handler interrupts the tool and the Run ends canceled when it stops (takosumi wait {run})"
            );
        }
        return Ok(0);
    };
    let end = client.wait(run, timeout).await?;
    show_run(&end, json);
    if end.status == RunStatus::Canceled {
        return Ok(0);
    }
    eprintln!(
        "error: {run} ended {} before the cancel took effect",
        end.status.as_str()
    );
    Ok(EXIT_FAILED)
}

fn money(x: f64) -> String {
    format!("{x:.2}")
}

fn signed(x: f64) -> String {
    if x >= 0.0 {
        format!("+{x:.2}")
    } else {
        format!("{x:.2}")
    }
}

/// The human form of a cost estimate.
pub(crate) fn format_cost(c: &Cost) -> String {
    let e = &c.estimate;
    let mut out = String::new();
    let _ = writeln!(out, "plan run:         {}", c.plan_run_id);
    let _ = writeln!(
        out,
        "amounts:          {} per {} (catalogue of {})",
        e.currency, e.period, e.catalogue_as_of
    );
    let width = e
        .resources
        .iter()
        .map(|r| r.address.len())
        .chain(e.unpriced.iter().map(|u| u.address.len()))
        .chain(std::iter::once(8))
        .max()
        .unwrap_or(8);
    let _ = writeln!(
        out,
        "{:<width$}  {:<14} {:>10} {:>10} {:>10}",
        "RESOURCE", "ACTIONS", "CURRENT", "PROPOSED", "DELTA"
    );
    for r in &e.resources {
        let _ = writeln!(
            out,
            "{:<width$}  {:<14} {:>10} {:>10} {:>10}",
            r.address,
            r.actions.join(","),
            money(r.amounts.current),
            money(r.amounts.proposed),
            signed(r.amounts.delta)
        );
    }
    let _ = writeln!(
        out,
        "{:<width$}  {:<14} {:>10} {:>10} {:>10}",
        "total",
        "",
        money(e.total.current),
        money(e.total.proposed),
        signed(e.total.delta)
    );
    if !e.unpriced.is_empty() {
        let _ = writeln!(out, "unpriced (left out of the total):");
        for u in &e.unpriced {
            let _ = writeln!(
                out,
                "  {} ({}): {}",
                u.address,
                u.actions.join(","),
                u.reason
            );
        }
    }
    if e.truncated {
        let _ = writeln!(
            out,
            "note: the plan has more resources than were summarized"
        );
    }
    out
}

/// `takosumi cost RUN`.
pub(crate) async fn cost(client: &Client, run: RunId, json: bool) -> Result<u8, ClientError> {
    let c = client.cost(run).await?;
    if json {
        print_json(&c);
    } else {
        print!("{}", format_cost(&c));
    }
    Ok(0)
}

/// One line per Run of a page.
pub(crate) fn format_runs(page: &RunPage) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<36}  {:<11} {:<15} {:<36}  CREATED",
        "RUN", "KIND", "STATUS", "CAPSULE"
    );
    for r in &page.runs {
        let created = r
            .created_at
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<36}  {:<11} {:<15} {:<36}  {created}",
            r.id.to_string(),
            kind_str(r.kind),
            r.status.as_str(),
            r.capsule_id.to_string()
        );
    }
    out
}

/// `takosumi runs WORKSPACE`.
pub(crate) async fn runs(
    client: &Client,
    ws: WorkspaceId,
    q: &RunQuery,
    json: bool,
) -> Result<u8, ClientError> {
    let page = client.list_runs(ws, q).await?;
    if json {
        print_json(&page);
        return Ok(0);
    }
    print!("{}", format_runs(&page));
    if page.unknown_outcome_count > 0 {
        eprintln!(
            "attention: {} unknown_outcome Run(s) need a person: `takosumi runs {ws} --status unknown_outcome`, then `takosumi resolve RUN --note …` once checked",
            page.unknown_outcome_count
        );
    }
    if let Some(cursor) = &page.next_cursor {
        eprintln!("next page: takosumi runs {ws} --cursor {cursor}");
    }
    Ok(0)
}

/// One line per activity entry.
pub(crate) fn format_activity(entries: &[ActivityEntry]) -> String {
    let mut out = String::new();
    for e in entries {
        let at =
            e.at.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
                .unwrap_or_default();
        let _ = write!(out, "{at}  {:<22} {}  {}", e.kind, e.subject, e.actor);
        match &e.data {
            Value::Null => {}
            Value::Object(m) if m.is_empty() => {}
            data => {
                let _ = write!(out, "  {data}");
            }
        }
        out.push('\n');
    }
    out
}

/// `takosumi activity WORKSPACE`.
pub(crate) async fn activity(
    client: &Client,
    ws: WorkspaceId,
    kind: Option<&str>,
    limit: Option<u32>,
    cursor: Option<&str>,
    json: bool,
) -> Result<u8, ClientError> {
    let page = client.activity(ws, kind, limit, cursor).await?;
    if json {
        print_json(&page);
        return Ok(0);
    }
    print!("{}", format_activity(&page.activity));
    if let Some(cursor) = &page.next_cursor {
        eprintln!("next page: takosumi activity {ws} --cursor {cursor}");
    }
    Ok(0)
}

/// How `takosumi resolve` resolves the Run.
pub(crate) enum Resolution {
    /// Only record that it was inspected.
    MarkResolved,
    /// `--restore-held-state`.
    RestoreHeldState,
    /// `--attach-state FILE`.
    AttachState(std::path::PathBuf),
}

/// The largest state file the CLI sends (the API's limit).
const MAX_STATE_FILE_BYTES: u64 = 8 * 1024 * 1024;

/// `takosumi resolve RUN --note … [--restore-held-state | --attach-state FILE]`. The state
/// file's content is never printed, only its size, and what the API recorded (digest,
/// serial, lineage, the new StateVersion and generation).
pub(crate) async fn resolve(
    client: &Client,
    run: RunId,
    note: &str,
    how: Resolution,
    json: bool,
) -> Result<u8, ClientError> {
    let now = match how {
        Resolution::MarkResolved => client.resolve(run, note).await?,
        Resolution::RestoreHeldState => client.restore_held_state(run, note).await?,
        Resolution::AttachState(file) => {
            let size = std::fs::metadata(&file)
                .map_err(|e| {
                    ClientError::Config(format!(
                        "cannot read the state file {}: {e}",
                        file.display()
                    ))
                })?
                .len();
            if size > MAX_STATE_FILE_BYTES {
                return Err(ClientError::Config(format!(
                    "the state file {} is {size} bytes; the limit is {MAX_STATE_FILE_BYTES} bytes (8 MiB); nothing was sent",
                    file.display()
                )));
            }
            let mut bytes = std::fs::read(&file).map_err(|e| {
                ClientError::Config(format!(
                    "cannot read the state file {}: {e}",
                    file.display()
                ))
            })?;
            let sent = client.attach_state(run, note, &bytes).await;
            bytes.iter_mut().for_each(|b| *b = 0);
            sent.map_err(|e| match e {
                ClientError::Config(m) => {
                    ClientError::Config(format!("{m} ({}); nothing was sent", file.display()))
                }
                other => other,
            })?
        }
    };
    show_run(&now, json);
    if !json {
        let action = now.extra["resolution"]["action"].as_str().unwrap_or("?");
        match (action, now.state_version_id) {
            ("mark_resolved", _) | (_, None) => eprintln!(
                "resolved {}: recorded as inspected; the Capsule's state is unchanged",
                now.id
            ),
            (how, Some(sv)) => eprintln!(
                "resolved {} ({how}): StateVersion {sv} is now the Capsule's state (generation {}); plan again to see where the provider side stands",
                now.id,
                now.state_generation
                    .map_or_else(|| "?".to_owned(), |g| g.to_string())
            ),
        }
    }
    Ok(0)
}

/// `--kind` values.
pub(crate) fn parse_kind(s: &str) -> Result<RunKind, String> {
    serde_json::from_value(Value::String(s.to_owned()))
        .map_err(|_| format!("`{s}` is not a Run kind: plan, destroy, apply or drift_check"))
}

/// `--status` values.
pub(crate) fn parse_status(s: &str) -> Result<RunStatus, String> {
    serde_json::from_value(Value::String(s.to_owned())).map_err(|_| {
        format!(
            "`{s}` is not a Run status: queued, held, planning, planned, applying, applied, failed, canceled or unknown_outcome"
        )
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use takosumi_client::{CapsuleId, WorkspaceId};

    use super::*;

    #[test]
    fn cost_table_shows_amounts_totals_and_unpriced() {
        let run = RunId::new();
        let c: Cost = serde_json::from_value(json!({
            "runId": run, "planRunId": run, "currency": "USD", "period": "month",
            "catalogueAsOf": "2026-11", "catalogueNote": "n",
            "resources": [{"address": "aws_instance.web", "type": "aws_instance", "actions": ["update"],
                           "current": 7.59, "proposed": 60.74, "delta": 53.15},
                          {"address": "aws_instance.old", "type": "aws_instance", "actions": ["delete"],
                           "current": 15.18, "proposed": 0.0, "delta": -15.18}],
            "unpriced": [{"address": "aws_s3_bucket.logs", "type": "aws_s3_bucket", "actions": ["create"],
                          "reason": "the price catalogue has no price for aws_s3_bucket"}],
            "total": {"current": 22.77, "proposed": 60.74, "delta": 37.97},
            "complete": false, "truncated": false
        }))
        .unwrap();
        let text = format_cost(&c);
        assert!(text.contains("USD per month"), "{text}");
        let web = text
            .lines()
            .find(|l| l.starts_with("aws_instance.web"))
            .unwrap();
        assert!(
            web.contains("7.59") && web.contains("60.74") && web.contains("+53.15"),
            "{web}"
        );
        let old = text
            .lines()
            .find(|l| l.starts_with("aws_instance.old"))
            .unwrap();
        assert!(old.contains("-15.18"), "{old}");
        let total = text.lines().find(|l| l.starts_with("total")).unwrap();
        assert!(
            total.contains("22.77") && total.contains("+37.97"),
            "{total}"
        );
        assert!(text.contains("aws_s3_bucket.logs (create): the price catalogue has no price"));
    }

    #[test]
    fn runs_and_activity_print_one_line_each() {
        let page: RunPage = serde_json::from_value(json!({
            "runs": [{"id": RunId::new(), "kind": "drift_check", "status": "unknown_outcome",
                      "workspaceId": WorkspaceId::new(), "capsuleId": CapsuleId::new(),
                      "createdAt": "2026-11-30T10:00:00Z"}],
            "nextCursor": null, "unknownOutcomeCount": 1
        }))
        .unwrap();
        let text = format_runs(&page);
        assert_eq!(text.lines().count(), 2);
        assert!(text.contains("drift_check") && text.contains("unknown_outcome"));
        assert!(text.contains("2026-11-30T10:00:00Z"));

        let entries: Vec<ActivityEntry> = serde_json::from_value(json!([
            {"id": 2, "kind": "run_started", "subject": "run_x", "actor": "user:tok_1",
             "data": {"kind": "plan"}, "at": "2026-11-30T10:00:00Z"}
        ]))
        .unwrap();
        assert_eq!(
            format_activity(&entries),
            "2026-11-30T10:00:00.000Z  run_started            run_x  user:tok_1  {\"kind\":\"plan\"}\n"
        );
    }

    #[test]
    fn filters_parse_by_api_names() {
        assert_eq!(parse_kind("destroy").unwrap(), RunKind::Destroy);
        assert_eq!(
            parse_status("unknown_outcome").unwrap(),
            RunStatus::UnknownOutcome
        );
        assert!(parse_kind("Plan").is_err());
        assert!(
            parse_status("done")
                .unwrap_err()
                .contains("unknown_outcome")
        );
    }

    #[test]
    fn event_lines_carry_kind_actor_and_data() {
        let e: RunEvent = serde_json::from_value(json!(
            {"id": 3, "kind": "tool_started", "actor": "handler:plan-1", "data": {"command": "plan"},
             "at": "2026-11-30T10:00:01.5Z"}
        ))
        .unwrap();
        assert_eq!(
            event_line(&e),
            "10:00:01.500  tool_started           handler:plan-1  {\"command\":\"plan\"}"
        );
    }
}
