//! The `takosumi` commands for gates and detection: `approve`, `rules`, `drift-check`,
//! `plan-update`, `group`.

use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::Value;
use takosumi_client::{
    ApprovalCount, CapsuleId, Client, ClientError, GroupAction, RunGroupId, RunId, WorkspaceId,
};

use super::render::{format_group, format_group_results, print_json, report_waited, show_run};
use super::{CapsuleArg, EXIT_FAILED, Outcome};

/// `approve`.
#[derive(Args)]
pub(crate) struct ApproveArgs {
    /// The held Run (`run_…`).
    #[arg(value_name = "RUN")]
    run: RunId,
    /// The plan digest you reviewed; refused unless it is the Run's.
    #[arg(long)]
    plan_digest: Option<String>,
    /// A note kept with the approval.
    #[arg(long)]
    note: Option<String>,
}

/// `rules`.
#[derive(Args)]
pub(crate) struct RulesArgs {
    /// The Workspace (`ws_…`).
    #[arg(long, conflicts_with = "capsule")]
    workspace: Option<WorkspaceId>,
    /// The Capsule (`cap_…`).
    #[arg(long)]
    capsule: Option<CapsuleId>,
    /// The rules as JSON (`{"maxDestroy": 0, "approval": {"required": 2}, "planGate": "…"}`), `-` for stdin.
    #[arg(long)]
    file: String,
}

/// `drift-check`.
#[derive(Args)]
pub(crate) struct DriftCheckArgs {
    #[command(flatten)]
    capsule: CapsuleArg,
    /// Wait for the check to finish.
    #[arg(long)]
    wait: bool,
    /// How long to wait.
    #[arg(long, default_value_t = 600)]
    timeout_secs: u64,
}

/// `plan-update`.
#[derive(Args)]
pub(crate) struct PlanUpdateArgs {
    /// The Workspace (`ws_…`).
    #[arg(value_name = "WORKSPACE")]
    workspace: WorkspaceId,
    /// Only the Capsules a push marked stale.
    #[arg(long)]
    only_stale: bool,
    /// Drift-check instead of plan.
    #[arg(long)]
    drift: bool,
}

/// `group`.
#[derive(Args)]
pub(crate) struct GroupArgs {
    /// `show`, `approve` or `apply`.
    #[arg(value_enum)]
    action: GroupCommand,
    /// The RunGroup (`rg_…`).
    #[arg(value_name = "GROUP")]
    group: RunGroupId,
}

/// What `group` does with a RunGroup.
#[derive(Clone, Copy, ValueEnum)]
enum GroupCommand {
    Show,
    Approve,
    Apply,
}

impl GroupCommand {
    /// The action the API is asked to take (`None`: only read the group).
    fn api_action(self) -> Option<GroupAction> {
        match self {
            Self::Show => None,
            Self::Approve => Some(GroupAction::Approve),
            Self::Apply => Some(GroupAction::Apply),
        }
    }
}

/// Approves a held Run.
pub(crate) async fn approve(client: &Client, args: ApproveArgs, json: bool) -> Outcome {
    let run = args.run;
    let approved = client
        .approve(run, args.plan_digest.as_deref(), args.note.as_deref())
        .await?;
    if json {
        print_json(&approved);
    } else {
        let ApprovalCount { given, required } = approved.approvals;
        println!(
            "approved {run} ({given} of {required} approvals bound to plan {})",
            approved.run.plan_digest.as_deref().unwrap_or("-")
        );
        if given >= required {
            eprintln!("next: the Run is released; takosumi wait {run}");
        }
    }
    Ok(0)
}

/// Sets the rules of a Workspace or a Capsule from a JSON file (`-` for stdin).
pub(crate) async fn set_rules(client: &Client, args: RulesArgs, json: bool) -> Outcome {
    let file = args.file.as_str();
    let text = if file == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(file)
    }
    .map_err(|e| ClientError::Config(format!("cannot read {file}: {e}")))?;
    let rules: Value = serde_json::from_str(&text)
        .map_err(|e| ClientError::Config(format!("{file} is not JSON: {e}")))?;
    let answer = match (args.workspace, args.capsule) {
        (Some(ws), None) => client.set_workspace_rules(ws, &rules).await?,
        (None, Some(cap)) => client.set_capsule_rules(cap, &rules).await?,
        _ => {
            return Err(ClientError::Config(
                "give exactly one of --workspace or --capsule".into(),
            ));
        }
    };
    if json {
        print_json(&answer);
    } else {
        println!(
            "rules of {} are now version {}",
            answer.scope,
            answer
                .version
                .map_or_else(|| "?".to_owned(), |v| v.to_string())
        );
    }
    Ok(0)
}

/// Starts a drift check of a Capsule.
pub(crate) async fn drift_check(client: &Client, args: DriftCheckArgs, json: bool) -> Outcome {
    let run = client.drift_check(args.capsule.capsule).await?;
    if args.wait {
        let run = client
            .wait(run.id, Duration::from_secs(args.timeout_secs))
            .await?;
        return Ok(report_waited(&run, json));
    }
    show_run(&run, json);
    Ok(0)
}

/// Starts a RunGroup over a Workspace.
pub(crate) async fn start_group(client: &Client, args: PlanUpdateArgs, json: bool) -> Outcome {
    let started = client
        .start_group(args.workspace, args.drift, args.only_stale)
        .await?;
    if json {
        print_json(&started);
    } else {
        println!(
            "run group {} started {} run(s)",
            started.id,
            started.run_ids.len()
        );
        for s in &started.skipped {
            println!("  {}  skipped ({})", s.capsule_id, s.code);
        }
        eprintln!("next: takosumi group show {}", started.id);
    }
    Ok(0)
}

/// Shows, approves or applies a RunGroup.
pub(crate) async fn group(client: &Client, args: GroupArgs, json: bool) -> Outcome {
    let rg = args.group;
    let Some(action) = args.action.api_action() else {
        let group = client.group(rg).await?;
        if json {
            print_json(&group);
        } else {
            print!("{}", format_group(&group));
        }
        return Ok(0);
    };
    let done = client.group_action(rg, action).await?;
    if json {
        print_json(&done);
    } else {
        print!("{}", format_group_results(&done));
    }
    let failed = done.results.iter().any(|r| r.error.is_some());
    Ok(if failed { EXIT_FAILED } else { 0 })
}
