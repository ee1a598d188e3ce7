//! The commands that follow a Run as it moves: `logs` (and `logs --follow`), `watch` (the
//! API's live stream) and a submission's `--watch` (polling the Run and its events). A
//! followed Run's end is the exit code: 0 planned, applied or held; 1 `failed`, `canceled`
//! or `unknown_outcome`.

use std::time::Duration;

use clap::Args;
use serde_json::json;
use takosumi_client::{Client, ClientError, Run, RunId, RunStatus};

use super::EXIT_FAILED;
use super::Outcome;
use super::render::{
    LogPrinter, clock, ended_badly, event_line, flush_stdout, print_json, print_json_line,
    print_stream_event, report_waited,
};

/// How often a watched Run is read.
const WATCH_POLL: Duration = Duration::from_millis(500);
/// How often a followed log is read.
const FOLLOW_POLL: Duration = Duration::from_secs(1);
/// Consecutive failed reads a watch rides out (an API restart) before it gives up.
const WATCH_ERRORS: u32 = 5;

/// `logs`.
#[derive(Args)]
pub(crate) struct LogsArgs {
    /// The Run (`run_…`).
    #[arg(value_name = "RUN")]
    run: RunId,
    /// Keep printing what is added until the Run is finished or held (exit code: its
    /// outcome).
    #[arg(long, short = 'f')]
    follow: bool,
}

/// `takosumi logs RUN [--follow]`.
pub(crate) async fn logs(client: &Client, args: LogsArgs, json: bool) -> Outcome {
    if args.follow {
        return follow_logs(client, args.run, json).await;
    }
    if json {
        print_json(&json!({ "logs": client.log_entries(args.run).await? }));
    } else {
        let text = client.logs(args.run).await?;
        print!("{text}");
        if !text.is_empty() && !text.ends_with('\n') {
            println!();
        }
    }
    Ok(0)
}

/// `takosumi watch RUN`: the API's live stream of the Run's events, log and status.
pub(crate) async fn watch_stream(client: &Client, run: RunId, json: bool) -> Outcome {
    let mut log = LogPrinter::default();
    let status = client
        .watch(run, |ev| print_stream_event(ev, json, &mut log))
        .await?;
    flush_stdout();
    Ok(match status {
        RunStatus::Planned | RunStatus::Applied => 0,
        _ => {
            eprintln!("error: {run} ended {}", status.as_str());
            EXIT_FAILED
        }
    })
}

/// Whether a read failure is worth retrying while following a Run.
fn transient(e: &ClientError) -> bool {
    matches!(e, ClientError::Http { .. })
        || matches!(e, ClientError::Api { status, .. } if matches!(status, 502..=504))
}

/// Counts consecutive failed reads while following a Run: a transient one is ridden out
/// (after a pause) until there have been too many in a row.
struct Retries {
    errors: u32,
    pause: Duration,
}

impl Retries {
    fn new(pause: Duration) -> Self {
        Self { errors: 0, pause }
    }

    /// `Ok(Some(v))` to go on with, `Ok(None)` to read again, or the error to give up on.
    async fn check<T>(&mut self, read: Result<T, ClientError>) -> Result<Option<T>, ClientError> {
        match read {
            Ok(v) => {
                self.errors = 0;
                Ok(Some(v))
            }
            Err(e) if transient(&e) && self.errors + 1 < WATCH_ERRORS => {
                self.errors += 1;
                tokio::time::sleep(self.pause).await;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// Follows a just-submitted Run until it is finished or held: every status change and
/// every event is printed as it happens (human form only), then the Run as `wait` shows
/// it. The exit code is the Run's outcome.
pub(crate) async fn watch(client: &Client, run: Run, timeout: Duration, json: bool) -> Outcome {
    let deadline = tokio::time::Instant::now() + timeout;
    if !json {
        println!(
            "{}  {} {} of {}",
            clock(None),
            run.id,
            run.kind.as_str(),
            run.capsule_id
        );
        flush_stdout();
    }
    let mut last_status: Option<RunStatus> = None;
    let mut seen = 0usize;
    let mut retries = Retries::new(WATCH_POLL);
    loop {
        let read = async {
            let now = client.get_run(run.id).await?;
            let events = client.events(run.id).await?;
            Ok::<_, ClientError>((now, events))
        };
        let Some((now, events)) = retries.check(read.await).await? else {
            continue;
        };
        if !json {
            for e in events.iter().skip(seen) {
                println!("{}", event_line(e));
            }
            if last_status != Some(now.status) {
                println!("{}  status: {}", clock(None), now.status.as_str());
            }
            flush_stdout();
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
async fn follow_logs(client: &Client, run: RunId, json: bool) -> Outcome {
    let mut printed = 0usize;
    let mut log = LogPrinter::default();
    let mut retries = Retries::new(FOLLOW_POLL);
    loop {
        // The status is read before the log: once it is final, the log read after it is
        // complete.
        let read = async {
            let now = client.get_run(run).await?;
            let entries = client.log_entries(run).await?;
            Ok::<_, ClientError>((now, entries))
        };
        let Some((now, entries)) = retries.check(read.await).await? else {
            continue;
        };
        for entry in entries.iter().skip(printed) {
            if json {
                print_json_line(entry);
            } else {
                log.entry(&entry.step, &entry.text);
            }
        }
        printed = printed.max(entries.len());
        flush_stdout();
        if now.status.is_terminal() || now.status == RunStatus::Held {
            return Ok(followed_to_the_end(&now));
        }
        tokio::time::sleep(FOLLOW_POLL).await;
    }
}

/// The exit code of a log followed to the Run's end, with what a person needs to know.
fn followed_to_the_end(now: &Run) -> u8 {
    if ended_badly(now.status) {
        eprintln!("error: {} ended {}", now.id, now.status.as_str());
        return EXIT_FAILED;
    }
    if now.status == RunStatus::Held {
        eprintln!("note: {} is held: it waits for a person", now.id);
    }
    0
}
