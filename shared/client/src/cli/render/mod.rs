//! How the `takosumi` CLI prints. Commands decide what to show and which exit code it
//! means; this layer decides how it looks: `--json` (the API's JSON, pretty, on stdout),
//! the human forms (aligned `label: value` blocks, one line per row, the Run block, event
//! and log lines) and errors (the message, the API's `code`, a hint, and the exit code the
//! error stands for). Results go to stdout; notes, hints and next steps to stderr.

mod evidence;
mod tables;

use std::fmt::Write as _;
use std::io::Write as _;

use serde::Serialize;
use serde_json::{Map, Value};
use takosumi_client::{ClientError, Run, RunEvent, RunStatus, StreamEvent, TOKEN_ENV, URL_ENV};

pub(crate) use evidence::{verified, verify_failed};
pub(crate) use tables::*;

use super::{EXIT_FAILED, EXIT_USAGE};

/// Where a person starts the local stack.
pub(crate) const START_HINT: &str = "is the API running? start it with infra/local/quickstart.sh";

pub(crate) fn print_json<T: Serialize + ?Sized>(value: &T) {
    match serde_json::to_string_pretty(value) {
        Ok(text) => println!("{text}"),
        // Values decoded from JSON always encode again.
        Err(e) => eprintln!("error: the result could not be printed as JSON: {e}"),
    }
}

/// Prints `value` as JSON with `--json`, else its human form.
pub(crate) fn show<T: Serialize + ?Sized>(value: &T, json: bool, human: impl Fn(&T) -> String) {
    if json {
        print_json(value);
    } else {
        print!("{}", human(value));
    }
}

/// One JSON line (for streams printed as they arrive).
pub(crate) fn print_json_line<T: Serialize>(value: &T) {
    if let Ok(line) = serde_json::to_string(value) {
        println!("{line}");
    }
}

pub(crate) fn flush_stdout() {
    let _ = std::io::stdout().flush();
}

const LABEL_WIDTH: usize = 18;

/// A block of aligned `label: value` lines.
#[derive(Default)]
pub(crate) struct Block(pub(crate) String);

impl Block {
    pub(crate) fn line(&mut self, label: &str, value: impl std::fmt::Display) -> &mut Self {
        let label = format!("{label}:");
        let _ = writeln!(self.0, "{label:<LABEL_WIDTH$}{value}");
        self
    }

    /// `name = <json>` lines under a `title:` line.
    pub(crate) fn json_map(&mut self, title: &str, map: &Map<String, Value>) -> &mut Self {
        if map.is_empty() {
            return self;
        }
        let _ = writeln!(self.0, "{title}:");
        for (name, value) in map {
            let _ = writeln!(self.0, "{name} = {value}");
        }
        self
    }
}

/// The first 12 characters of a digest or commit.
fn short(hex: &str) -> &str {
    hex.get(..12).unwrap_or(hex)
}

/// Appends `  <data>` to a line unless the details are empty.
pub(crate) fn push_data(line: &mut String, data: &Value) {
    match data {
        Value::Null => {}
        Value::Object(m) if m.is_empty() => {}
        data => {
            let _ = write!(line, "  {data}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Runs

pub(crate) fn format_run(run: &Run) -> String {
    let mut b = Block::default();
    b.line("run", run.id)
        .line("kind", run.kind.as_str())
        .line("status", run.status.as_str());
    b.line("capsule", run.capsule_id);
    if let Some(plan_run) = run.plan_run_id {
        b.line("plan run", plan_run);
    }
    if let Some(c) = run.changes {
        b.line(
            "changes",
            format!("+{} ~{} -{}", c.add, c.change, c.destroy),
        );
    }
    if let Some(drift) = run.drift {
        b.line("drift", if drift { "yes" } else { "no" });
    }
    if let Some(digest) = &run.plan_digest {
        b.line("plan digest", short(digest));
    }
    if let Some(source) = &run.source_snapshot {
        b.line("source commit", short(&source.commit));
    }
    if let Some(generation) = run.state_generation {
        b.line("state generation", generation);
    }
    if let Some(sv) = run.state_version_id {
        b.line("state version", sv);
    }
    run_outcome_lines(&mut b, run);
    match &run.outputs {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            b.json_map("outputs", map);
        }
        Some(other) => {
            b.line("outputs", other);
        }
    }
    b.0
}

/// The lines of a Run block that say why it stopped: held, canceled, resolved, failed.
fn run_outcome_lines(b: &mut Block, run: &Run) {
    if let Some(hold) = &run.hold {
        match &hold.details {
            Value::Null => b.line("held", &hold.reason),
            Value::Object(m) if m.is_empty() => b.line("held", &hold.reason),
            details => b.line("held", format!("{} {details}", hold.reason)),
        };
    }
    if run.cancel_requested_at.is_some() && run.status != RunStatus::Canceled {
        b.line(
            "cancel requested",
            stamp(run.cancel_requested_at, chrono::SecondsFormat::Secs),
        );
    }
    if let Some(by) = &run.canceled_by {
        b.line("canceled by", by);
    }
    if let Some(r) = &run.resolution {
        b.line(
            "resolved",
            format!(
                "{} by {} at {}: {}",
                r.action,
                r.by.as_deref().unwrap_or_default(),
                stamp(r.at, chrono::SecondsFormat::Secs),
                r.note.as_deref().unwrap_or_default()
            ),
        );
    }
    if let Some(error) = &run.error {
        if error.code.is_empty() {
            b.line("error", &error.message);
        } else {
            b.line("error", format!("{} ({})", error.message, error.code));
        }
    }
}

/// Prints a Run, and in the human form what a person does next with it.
pub(crate) fn show_run(run: &Run, json: bool) {
    if json {
        print_json(run);
        return;
    }
    print!("{}", format_run(run));
    if run.status == RunStatus::Held {
        eprintln!("note: {} is held: it waits for a person", run.id);
    } else if run.status == RunStatus::Planned
        && run.kind.is_plan_like()
        && run.changes.is_some_and(|c| !c.is_empty())
    {
        eprintln!("next: takosumi apply {}", run.id);
    }
}

/// Whether a waited-for Run ended badly (exit 1).
pub(crate) fn ended_badly(status: RunStatus) -> bool {
    matches!(
        status,
        RunStatus::Failed | RunStatus::Canceled | RunStatus::UnknownOutcome
    )
}

/// Shows a Run that was waited for; its end decides the exit code.
pub(crate) fn report_waited(run: &Run, json: bool) -> u8 {
    show_run(run, json);
    if ended_badly(run.status) {
        eprintln!("error: {} ended {}", run.id, run.status.as_str());
        if run.status == RunStatus::UnknownOutcome {
            eprintln!(
                "hint: the apply stopped without a recorded result: inspect the provider side and the \
                 Capsule's current StateVersion before applying anything else"
            );
        }
        return EXIT_FAILED;
    }
    0
}

// ---------------------------------------------------------------------------------------
// Events and logs

/// One line per event: id, time, kind, actor and its details.
pub(crate) fn format_events(events: &[RunEvent]) -> String {
    record_lines(events, |e| {
        let at = stamp(e.at, chrono::SecondsFormat::Millis);
        (
            format!("{:>4}  {at}  {}  {}", e.id, e.kind, e.actor),
            &e.data,
        )
    })
}

/// One line per record: what `head` makes of it, then its details unless they are empty.
pub(crate) fn record_lines<'a, T>(
    records: &'a [T],
    head: impl Fn(&'a T) -> (String, &'a Value),
) -> String {
    let mut out = String::new();
    for record in records {
        let (line, data) = head(record);
        out.push_str(&line);
        push_data(&mut out, data);
        out.push('\n');
    }
    out
}

/// A record's time in UTC (RFC 3339, `Z`), empty when the API gave none.
pub(crate) fn stamp(
    at: Option<chrono::DateTime<chrono::Utc>>,
    precision: chrono::SecondsFormat,
) -> String {
    at.map(|t| t.to_rfc3339_opts(precision, true))
        .unwrap_or_default()
}

/// The time of day of a progress line (now, when the event has none).
pub(crate) fn clock(at: Option<chrono::DateTime<chrono::Utc>>) -> String {
    at.unwrap_or_else(chrono::Utc::now)
        .format("%H:%M:%S%.3f")
        .to_string()
}

/// One progress line for an event: time, kind, actor and its details.
pub(crate) fn event_line(e: &RunEvent) -> String {
    let mut line = format!("{}  {:<22} {}", clock(e.at), e.kind, e.actor);
    push_data(&mut line, &e.data);
    line
}

/// Prints a Run's log as it arrives, with a `== step ==` line wherever the step changes.
#[derive(Default)]
pub(crate) struct LogPrinter {
    step: Option<String>,
}

impl LogPrinter {
    /// Prints a chunk of a step's output as it is.
    pub(crate) fn chunk(&mut self, step: &str, text: &str) {
        if self.step.as_deref() != Some(step) {
            println!("== {step} ==");
            self.step = Some(step.to_owned());
        }
        print!("{text}");
    }

    /// Prints a whole log entry, ending its line.
    pub(crate) fn entry(&mut self, step: &str, text: &str) {
        self.chunk(step, text);
        if !text.ends_with('\n') {
            println!();
        }
    }
}

/// Prints one event of a Run's live stream (`takosumi watch`) and flushes it.
pub(crate) fn print_stream_event(ev: &StreamEvent, json: bool, log: &mut LogPrinter) {
    if json {
        print_json_line(ev);
        return;
    }
    match ev {
        StreamEvent::Event { event } => print!("{}", format_events(std::slice::from_ref(event))),
        StreamEvent::Log { step, text } => log.chunk(step, text),
        StreamEvent::Status { status } => println!("-- {} --", status.as_str()),
        StreamEvent::End { .. } => {}
    }
    flush_stdout();
}

// ---------------------------------------------------------------------------------------
// Errors and exit codes

/// The lines to print for an error and the exit code.
pub(crate) fn render_error(err: &ClientError) -> (Vec<String>, u8) {
    let mut lines = Vec::new();
    let code = match err {
        ClientError::Api {
            status,
            code,
            message,
        } => {
            lines.push(format!("error: {message} ({code})"));
            match status {
                401 => lines.push(format!(
                    "hint: check {TOKEN_ENV} (or --token), or run `takosumi login` with a valid token"
                )),
                403 => lines.push("hint: this token's role does not allow that request".to_owned()),
                _ => {}
            }
            EXIT_FAILED
        }
        ClientError::Http { source, .. } => {
            lines.push(format!("error: {err}: {}", root_cause(source)));
            if err.is_connection_refused() {
                lines.push(format!("hint: {START_HINT}"));
            } else if source.is_timeout() {
                lines.push("hint: the API did not answer in time; try again".to_owned());
            } else {
                lines.push(format!("hint: check the API URL (--url or {URL_ENV})"));
            }
            EXIT_FAILED
        }
        ClientError::Decode { source, .. } => {
            lines.push(format!("error: {err}: {source}"));
            lines.push("hint: the API and this CLI may be different versions".to_owned());
            EXIT_FAILED
        }
        ClientError::Config(message) => {
            lines.push(format!("error: {message}"));
            EXIT_USAGE
        }
        ClientError::Timeout { run, .. } => {
            lines.push(format!("error: {err}"));
            lines.push(format!(
                "hint: keep waiting with `takosumi wait {run} --timeout-secs 1800`"
            ));
            EXIT_FAILED
        }
    };
    (lines, code)
}

/// Prints an error (stderr) and returns its exit code.
pub(crate) fn report_error(err: &ClientError) -> u8 {
    let (lines, code) = render_error(err);
    for line in lines {
        eprintln!("{line}");
    }
    code
}

/// The innermost cause of an error: the part a person can act on ("Connection refused").
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = err;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

#[cfg(test)]
mod tests;
