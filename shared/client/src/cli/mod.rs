//! The `takosumi` command line: the clap definition of every command and the dispatch to
//! the module that carries it out. Each command module takes its parsed arguments and the
//! client, makes its call (or its call and a wait), hands what came back to [`render`],
//! and returns the exit code: 0 when it did what it says, [`EXIT_FAILED`] when the API
//! refused it or a waited-for Run ended badly; a [`ClientError`] it returns is printed by
//! [`render::report_error`], which picks the exit code. [`EXIT_USAGE`] means nothing was
//! sent.

mod capsules;
pub(crate) mod config;
mod dead_letters;
mod evidence;
mod follow;
mod gates;
mod pools;
pub(crate) mod render;
mod resolve;
mod runs;
mod submit;
mod tokens;
mod vars;
mod workspaces;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand};
use takosumi_client::{CapsuleId, Client, ClientError, DEFAULT_URL, RunId, TOKEN_ENV, URL_ENV};

/// Exit code: the API returned an error, or a waited-for Run ended badly.
pub(crate) const EXIT_FAILED: u8 = 1;
/// Exit code: the command line (or the local configuration) is wrong; nothing was sent.
pub(crate) const EXIT_USAGE: u8 = 2;

/// Takosumi: plan, apply and inspect OpenTofu/Terraform Runs.
// No `Debug`: the struct holds the token.
#[derive(Parser)]
#[command(name = "takosumi", version, propagate_version = true)]
pub(crate) struct Cli {
    /// Base URL of the Takosumi API (default: the one `takosumi login` saved, else
    /// http://127.0.0.1:8080).
    #[arg(long, global = true, env = URL_ENV, value_name = "URL")]
    pub(crate) url: Option<String>,
    /// API token (prefer the environment variable: a flag is visible to other local users).
    #[arg(long, global = true, env = TOKEN_ENV, hide_env_values = true, value_name = "TOKEN")]
    pub(crate) token: Option<String>,
    /// Print the API's JSON instead of the human form.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Check a token against the API and save it with the URL for later commands (to
    /// $TAKOSUMI_CONFIG, else ~/.config/takosumi/config.toml, mode 0600). The token is read
    /// from stdin (`printf %s "$TOKEN" | takosumi login --url URL`) unless --token or
    /// TAKOSUMI_DEPLOY_CONTROL_TOKEN gives it; it is never printed.
    Login,
    /// Worker pools: named sets of relay workers that run Capsules' jobs where the
    /// control plane cannot reach.
    Pool {
        #[command(subcommand)]
        command: pools::PoolCommand,
    },
    /// Workspaces: groups of Capsules with shared rules and history.
    Workspace {
        #[command(subcommand)]
        command: workspaces::WorkspaceCommand,
    },
    /// Capsules: a Git repo, a branch and a directory of configuration.
    Capsule {
        #[command(subcommand)]
        command: capsules::CapsuleCommand,
    },
    /// Start a plan Run of a Capsule.
    Plan(submit::PlanArgs),
    /// Install: plan a Capsule and continue to its apply if the plan finishes cleanly
    /// (autoApplyRequested); deletions, an approval rule, the cost check or a plan gate
    /// still stop it for review. With --wait, waits for the plan and then for its apply.
    Install(submit::PlanArgs),
    /// Start a destroy plan Run of a Capsule (nothing is destroyed until it is applied).
    Destroy(submit::DestroyArgs),
    /// Start an Apply Run of exactly the saved plan of a plan, destroy or drift-check Run.
    Apply(submit::ApplyArgs),
    /// Apply a Capsule's branch as it is: in one step (`apply -auto-approve`) when no rule
    /// covers it, else planned first and the apply proposed from the saved plan.
    ApplyCapsule(submit::ApplyCapsuleArgs),
    /// Approve a held Run (the requester cannot approve their own).
    Approve(gates::ApproveArgs),
    /// Set the gate rules of a Workspace or a Capsule from a JSON file (a new version).
    Rules(gates::RulesArgs),
    /// Start a drift check of a Capsule (read-only; it never applies).
    DriftCheck(gates::DriftCheckArgs),
    /// Plan every Capsule of a Workspace (or drift-check them) as one RunGroup.
    PlanUpdate(gates::PlanUpdateArgs),
    /// Show, approve or apply a RunGroup.
    Group(gates::GroupArgs),
    /// Show a Run.
    Status(RunArg),
    /// Print a Run's (masked) log.
    Logs(follow::LogsArgs),
    /// Cancel a Run: a queued or held one ends at once, a running one is interrupted.
    Cancel(runs::CancelArgs),
    /// Show the cost estimate of a plan (or of the plan an Apply Run carries out).
    Cost(RunArg),
    /// List a Workspace's Runs, newest first.
    Runs(runs::RunsArgs),
    /// Show a Workspace's activity record, newest first.
    Activity(runs::ActivityArgs),
    /// Show what the steps could not process: each step queue's dead letters and their
    /// first messages (viewing changes nothing); `requeue` puts them back onto their work
    /// queue, `purge` deletes them (admin tokens).
    DeadLetters(dead_letters::DeadLettersArgs),
    /// Resolve an unknown_outcome apply (admin tokens): record that it was inspected, or
    /// also give the Capsule its state (the held one, or one pulled from the provider side).
    Resolve(resolve::ResolveArgs),
    /// Print a Run's events in order.
    Events(RunArg),
    /// API tokens (instance admins): create one (its value is printed once), list them,
    /// revoke one (effective from its next request).
    Token {
        #[command(subcommand)]
        action: tokens::TokenCommand,
    },
    /// Follow a Run as it goes (its event record and log, live) until it settles; the exit
    /// code is its outcome (0: planned or applied, 1: failed, canceled or unknown outcome).
    Watch(RunArg),
    /// Print a plan's changes resource by resource (sensitive values withheld); for an
    /// Apply Run, the plan it carries out.
    Diff(RunArg),
    /// Signed audit evidence: export a Workspace's chain for offline checks, show a Run's
    /// statement, list the public keys.
    Evidence {
        #[command(subcommand)]
        command: evidence::EvidenceCommand,
    },
    /// Verify signed audit evidence: a Run's statement (`verify RUN`) or a Workspace's
    /// whole chain (`--workspace WS`): every signature, every link, and that each apply
    /// carries out exactly the plan digest its plan Run's statement names. `--bundle FILE`
    /// checks an exported bundle offline (no URL, no token). Exit 1 names the broken link.
    Verify(evidence::VerifyArgs),
    /// Wait until a Run is finished or held, then show it.
    Wait(runs::WaitArgs),
}

/// What a command comes to: its exit code, or the error [`render::report_error`] prints.
pub(crate) type Outcome = Result<u8, ClientError>;

/// A command's one Run.
#[derive(Args)]
pub(crate) struct RunArg {
    /// The Run (`run_…`).
    #[arg(value_name = "RUN")]
    pub(crate) run: RunId,
}

/// A command's one Capsule.
#[derive(Args)]
pub(crate) struct CapsuleArg {
    /// The Capsule (`cap_…`).
    #[arg(value_name = "CAPSULE")]
    pub(crate) capsule: CapsuleId,
}

/// Stops with a usage error (exit 2): the command line cannot be carried out as given.
pub(crate) fn usage_error(kind: ErrorKind, message: impl std::fmt::Display) -> ! {
    Cli::command().error(kind, message).exit()
}

/// Runs the commands that need no API token: `login` (it checks the token it is given) and
/// offline verification, which trusts nothing but a bundle and keys. `None` for the rest.
pub(crate) async fn run_without_token(cli: &Cli) -> Option<u8> {
    match &cli.command {
        Command::Verify(args) if args.bundle.is_some() => {
            Some(evidence::verify_offline(args, cli.json))
        }
        Command::Login => {
            let url = cli.url.clone().unwrap_or_else(|| DEFAULT_URL.to_owned());
            Some(config::login(&url, cli.token.clone(), cli.json).await)
        }
        _ => None,
    }
}

/// Runs a command against the API; the exit code, or the error to report.
pub(crate) async fn run(client: &Client, command: Command, json: bool) -> Outcome {
    match command {
        // `login` needs no client and is run by `run_without_token`; never here.
        Command::Login => Ok(EXIT_USAGE),
        Command::Pool { command } => pools::run(client, command, json).await,
        Command::Workspace { command } => workspaces::run(client, command, json).await,
        Command::Capsule { command } => capsules::run(client, command, json).await,
        Command::Plan(args) => submit::plan(client, args, json).await,
        Command::Install(args) => submit::install(client, args, json).await,
        Command::Destroy(args) => submit::destroy(client, args, json).await,
        Command::Apply(args) => submit::apply(client, args, json).await,
        Command::ApplyCapsule(args) => submit::apply_capsule(client, args, json).await,
        Command::Approve(args) => gates::approve(client, args, json).await,
        Command::Rules(args) => gates::set_rules(client, args, json).await,
        Command::DriftCheck(args) => gates::drift_check(client, args, json).await,
        Command::PlanUpdate(args) => gates::start_group(client, args, json).await,
        Command::Group(args) => gates::group(client, args, json).await,
        Command::Status(args) => runs::status(client, args.run, json).await,
        Command::Logs(args) => follow::logs(client, args, json).await,
        Command::Cancel(args) => runs::cancel(client, args, json).await,
        Command::Cost(args) => runs::cost(client, args.run, json).await,
        Command::Runs(args) => runs::runs(client, args, json).await,
        Command::Activity(args) => runs::activity(client, args, json).await,
        Command::DeadLetters(args) => dead_letters::run(client, args, json).await,
        Command::Resolve(args) => resolve::resolve(client, args, json).await,
        Command::Events(args) => runs::events(client, args.run, json).await,
        Command::Token { action } => tokens::run(client, action, json).await,
        Command::Watch(args) => follow::watch_stream(client, args.run, json).await,
        Command::Diff(args) => runs::diff(client, args.run, json).await,
        Command::Evidence { command } => evidence::run(client, command, json).await,
        Command::Verify(args) => evidence::verify_online(client, &args, json).await,
        Command::Wait(args) => runs::wait(client, args, json).await,
    }
}

#[cfg(test)]
mod tests;
