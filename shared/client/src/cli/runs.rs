//! The commands that read a Run and a Workspace's record: `status`, `wait`, `events`,
//! `diff`, `cost`, `cancel`, `runs` and `activity`.
//!
//! Exit codes follow the rest of the CLI: 0 when the command did what it says, 1 when the
//! API refused it or a waited-for Run ended `failed`, `canceled` or `unknown_outcome` (for
//! `cancel --wait`: when it ended anything but `canceled`).

use std::time::Duration;

use clap::Args;
use serde_json::{Value, json};
use takosumi_client::{CapsuleId, Client, RunId, RunKind, RunQuery, RunStatus, WorkspaceId};

use super::EXIT_FAILED;
use super::Outcome;
use super::render::{
    format_activity, format_cost, format_diff, format_events, format_runs, print_json,
    report_waited, show, show_run,
};

/// `wait`.
#[derive(Args)]
pub(crate) struct WaitArgs {
    /// The Run (`run_…`).
    #[arg(value_name = "RUN")]
    pub(crate) run: RunId,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600, value_name = "SECS")]
    pub(crate) timeout_secs: u64,
}

/// `cancel`.
#[derive(Args)]
pub(crate) struct CancelArgs {
    /// The Run (`run_…`).
    #[arg(value_name = "RUN")]
    run: RunId,
    /// Why (recorded with the cancel).
    #[arg(long)]
    reason: Option<String>,
    /// Wait until the Run has ended (exit 1 unless it ended canceled).
    #[arg(long)]
    wait: bool,
    /// With `--wait`: give up after this many seconds.
    #[arg(long, default_value_t = 600, value_name = "SECS")]
    timeout_secs: u64,
}

/// `runs`.
#[derive(Args)]
pub(crate) struct RunsArgs {
    /// The Workspace (`ws_…`).
    #[arg(value_name = "WORKSPACE")]
    workspace: WorkspaceId,
    /// Only this Capsule's Runs.
    #[arg(long, value_name = "CAPSULE")]
    capsule: Option<CapsuleId>,
    /// Only this kind: plan, destroy, apply, drift_check.
    #[arg(long, value_parser = parse_kind)]
    kind: Option<RunKind>,
    /// Only this status (e.g. unknown_outcome: the Runs that need a person).
    #[arg(long, value_parser = parse_status)]
    status: Option<RunStatus>,
    /// Runs per page (1-100).
    #[arg(long)]
    limit: Option<u32>,
    /// The next page, as printed by the previous one.
    #[arg(long)]
    cursor: Option<String>,
}

/// `activity`.
#[derive(Args)]
pub(crate) struct ActivityArgs {
    /// The Workspace (`ws_…`).
    #[arg(value_name = "WORKSPACE")]
    workspace: WorkspaceId,
    /// Only this kind of entry (e.g. state_version_written).
    #[arg(long)]
    kind: Option<String>,
    /// Entries per page (1-100).
    #[arg(long)]
    limit: Option<u32>,
    /// The next page, as printed by the previous one.
    #[arg(long)]
    cursor: Option<String>,
}

pub(crate) async fn status(client: &Client, run: RunId, json: bool) -> Outcome {
    show_run(&client.get_run(run).await?, json);
    Ok(0)
}

pub(crate) async fn wait(client: &Client, args: WaitArgs, json: bool) -> Outcome {
    let run = client
        .wait(args.run, Duration::from_secs(args.timeout_secs))
        .await?;
    Ok(report_waited(&run, json))
}

pub(crate) async fn events(client: &Client, run: RunId, json: bool) -> Outcome {
    let events = client.events(run).await?;
    if json {
        print_json(&json!({ "events": events }));
    } else {
        print!("{}", format_events(&events));
    }
    Ok(0)
}

pub(crate) async fn diff(client: &Client, run: RunId, json: bool) -> Outcome {
    show(&client.plan_view(run).await?, json, format_diff);
    Ok(0)
}

pub(crate) async fn cost(client: &Client, run: RunId, json: bool) -> Outcome {
    show(&client.cost(run).await?, json, format_cost);
    Ok(0)
}

/// `takosumi cancel RUN [--wait]`.
pub(crate) async fn cancel(client: &Client, args: CancelArgs, json: bool) -> Outcome {
    let run = args.run;
    let now = client.cancel(run, args.reason.as_deref()).await?;
    if !args.wait || now.status == RunStatus::Canceled {
        show_run(&now, json);
        if !json && now.status != RunStatus::Canceled {
            eprintln!(
                "note: cancel requested: the handler interrupts the tool and the Run ends canceled when it stops (takosumi wait {run})"
            );
        }
        return Ok(0);
    }
    let end = client
        .wait(run, Duration::from_secs(args.timeout_secs))
        .await?;
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

/// `takosumi runs WORKSPACE`.
pub(crate) async fn runs(client: &Client, args: RunsArgs, json: bool) -> Outcome {
    let ws = args.workspace;
    let q = RunQuery {
        capsule: args.capsule,
        kind: args.kind,
        status: args.status,
        limit: args.limit,
        cursor: args.cursor,
    };
    let page = client.list_runs(ws, &q).await?;
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

/// `takosumi activity WORKSPACE`.
pub(crate) async fn activity(client: &Client, args: ActivityArgs, json: bool) -> Outcome {
    let ws = args.workspace;
    let page = client
        .activity(ws, args.kind.as_deref(), args.limit, args.cursor.as_deref())
        .await?;
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

/// `--kind` values.
fn parse_kind(s: &str) -> Result<RunKind, String> {
    serde_json::from_value(Value::String(s.to_owned()))
        .map_err(|_| format!("`{s}` is not a Run kind: plan, destroy, apply or drift_check"))
}

/// `--status` values.
fn parse_status(s: &str) -> Result<RunStatus, String> {
    serde_json::from_value(Value::String(s.to_owned())).map_err(|_| {
        format!(
            "`{s}` is not a Run status: queued, held, planning, planned, applying, applied, failed, canceled or unknown_outcome"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
