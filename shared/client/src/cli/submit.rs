//! The commands that submit a Run: `plan`, `install`, `destroy`, `apply` and
//! `apply-capsule`, and what follows a submission: nothing (the Run is shown with the
//! command that waits for it), `--wait` (its end decides the exit code) or `--watch`
//! (every status change and event as it happens, then the same).

use std::time::Duration;

use clap::Args;
use takosumi_client::{
    Client, ClientError, Code, PlanRequest, Run, RunId, RunKind, RunQuery, RunStatus,
};

use super::render::{report_waited, show_run};
use super::vars::{Var, collect_or_exit, parse_plan_var, parse_var_json};
use super::{CapsuleArg, EXIT_FAILED, Outcome, follow};

/// What a submission does once the API has taken it.
#[derive(Args)]
pub(crate) struct SubmitArgs {
    /// Wait until the Run is finished or held, then show it.
    #[arg(long)]
    pub(crate) wait: bool,
    /// Like `--wait`, printing every status change and event as it happens.
    #[arg(long, conflicts_with = "wait")]
    pub(crate) watch: bool,
    /// With `--wait` or `--watch`: give up after this many seconds.
    #[arg(long, default_value_t = 600, value_name = "SECS")]
    pub(crate) timeout_secs: u64,
    /// Submitting again with the same key returns the same Run.
    #[arg(long, value_name = "KEY")]
    pub(crate) idempotency_key: Option<String>,
}

impl SubmitArgs {
    fn key(&self) -> Option<&str> {
        self.idempotency_key.as_deref()
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_secs)
    }
}

/// `plan` and `install`.
#[derive(Args)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    pub(crate) capsule: CapsuleArg,
    /// A variable for this Run only, `NAME=VALUE` (repeatable); a value that is a JSON
    /// list or map (`zones=["a","b"]`, `tags={"env":"prod"}`) is passed as one.
    #[arg(long = "var", value_name = "NAME=VALUE", value_parser = parse_plan_var)]
    pub(crate) vars: Vec<Var>,
    /// A variable for this Run only given as JSON, `NAME=JSON` (repeatable).
    #[arg(long = "var-json", value_name = "NAME=JSON", value_parser = parse_var_json)]
    pub(crate) var_json: Vec<Var>,
    #[command(flatten)]
    pub(crate) submit: SubmitArgs,
}

/// `destroy`.
#[derive(Args)]
pub(crate) struct DestroyArgs {
    #[command(flatten)]
    capsule: CapsuleArg,
    #[command(flatten)]
    submit: SubmitArgs,
}

/// `apply`.
#[derive(Args)]
pub(crate) struct ApplyArgs {
    /// The planned Run (`run_…`).
    #[arg(value_name = "RUN")]
    run: RunId,
    #[command(flatten)]
    submit: SubmitArgs,
}

/// `apply-capsule`.
#[derive(Args)]
pub(crate) struct ApplyCapsuleArgs {
    #[command(flatten)]
    capsule: CapsuleArg,
    /// Hold the apply for a person whatever the rules say (it is planned first).
    #[arg(long)]
    require_approval: bool,
    #[command(flatten)]
    submit: SubmitArgs,
}

pub(crate) async fn plan(client: &Client, args: PlanArgs, json: bool) -> Outcome {
    let vars = collect_or_exit(args.vars, args.var_json);
    let (capsule, submit) = (args.capsule.capsule, args.submit);
    let run = if vars.is_empty() {
        client.plan(capsule, submit.key()).await?
    } else {
        let req = PlanRequest {
            vars,
            ..Default::default()
        };
        client.plan_with(capsule, submit.key(), &req).await?
    };
    finish_submission(client, run, &submit, json).await
}

pub(crate) async fn install(client: &Client, args: PlanArgs, json: bool) -> Outcome {
    let req = PlanRequest {
        vars: collect_or_exit(args.vars, args.var_json),
        auto_apply_requested: true,
        ..Default::default()
    };
    let submit = args.submit;
    let plan = client
        .plan_with(args.capsule.capsule, submit.key(), &req)
        .await?;
    if !submit.wait {
        return finish_submission(client, plan, &submit, json).await;
    }
    install_wait(client, plan, &submit, json).await
}

pub(crate) async fn destroy(client: &Client, args: DestroyArgs, json: bool) -> Outcome {
    let run = client
        .destroy(args.capsule.capsule, args.submit.key())
        .await?;
    finish_submission(client, run, &args.submit, json).await
}

pub(crate) async fn apply(client: &Client, args: ApplyArgs, json: bool) -> Outcome {
    let run = client.apply(args.run, args.submit.key()).await?;
    finish_submission(client, run, &args.submit, json).await
}

pub(crate) async fn apply_capsule(client: &Client, args: ApplyCapsuleArgs, json: bool) -> Outcome {
    let capsule = args.capsule.capsule;
    let submitted = client
        .apply_capsule(capsule, args.require_approval, args.submit.key())
        .await?;
    let run = submitted.run;
    if !json && run.kind != RunKind::Apply {
        let rules: Vec<&str> = submitted.covered_by.iter().map(Code::as_str).collect();
        eprintln!(
            "a rule covers this apply ({}): {} plans first, and the gate proposes the apply from its saved plan (takosumi runs {} --capsule {capsule})",
            rules.join(", "),
            run.id,
            run.workspace_id
        );
    }
    finish_submission(client, run, &args.submit, json).await
}

async fn finish_submission(client: &Client, run: Run, submit: &SubmitArgs, json: bool) -> Outcome {
    if submit.watch {
        return follow::watch(client, run, submit.timeout(), json).await;
    }
    if submit.wait {
        let run = client.wait(run.id, submit.timeout()).await?;
        return Ok(report_waited(&run, json));
    }
    show_run(&run, json);
    if !json && !run.status.is_terminal() && run.status != RunStatus::Held {
        eprintln!("next: takosumi wait {}", run.id);
    }
    Ok(0)
}

/// `install --wait`: the plan, then the Apply Run the gate proposed from it (held for
/// review, or applied).
async fn install_wait(client: &Client, plan: Run, submit: &SubmitArgs, json: bool) -> Outcome {
    let deadline = tokio::time::Instant::now() + submit.timeout();
    let plan = client.wait(plan.id, submit.timeout()).await?;
    if plan.status != RunStatus::Planned {
        return Ok(report_waited(&plan, json));
    }
    if !json {
        eprintln!("planned {}; waiting for the apply it proposes", plan.id);
    }
    loop {
        if let Some(apply) = proposed_apply(client, &plan).await? {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let apply = client.wait(apply.id, left).await?;
            if apply.status == RunStatus::Held && !json {
                eprintln!(
                    "{} is held for review ({}): see `takosumi status {}`",
                    apply.id,
                    apply
                        .hold
                        .as_ref()
                        .map(|h| h.reason.as_str())
                        .unwrap_or("held"),
                    apply.id
                );
            }
            return Ok(report_waited(&apply, json));
        }
        if tokio::time::Instant::now() >= deadline {
            eprintln!(
                "error: no apply was proposed from {} within {} s; see `takosumi events {}`",
                plan.id, submit.timeout_secs, plan.id
            );
            return Ok(EXIT_FAILED);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The Apply Run the gate proposed from a plan, once there is one.
async fn proposed_apply(client: &Client, plan: &Run) -> Result<Option<Run>, ClientError> {
    let query = RunQuery {
        capsule: Some(plan.capsule_id),
        kind: Some(RunKind::Apply),
        limit: Some(20),
        ..Default::default()
    };
    let page = client.list_runs(plan.workspace_id, &query).await?;
    Ok(page
        .runs
        .into_iter()
        .find(|r| r.plan_run_id == Some(plan.id)))
}
