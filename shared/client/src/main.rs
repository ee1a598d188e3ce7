//! `takosumi`: the command-line client of the Takosumi API. It mirrors the API:
//! every command is one call (or a call plus a wait), prints the result in a compact human
//! form or, with `--json`, as JSON, and exits 0 on success, 1 when the API returned an error
//! or a waited-for (watched, followed) Run ended `failed`/`canceled`/`unknown_outcome`, 2 on
//! usage errors.

mod config_cli;
mod dead_letters_cli;
mod evidence_cli;
mod gates_cli;
mod pools_cli;
mod records_cli;

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use serde::Serialize;
use serde_json::{Map, Value};
use takosumi_client::{
    Capsule, CapsuleId, Client, ClientError, DEFAULT_URL, NewCapsule, Run, RunEvent, RunGroupId,
    RunId, RunKind, RunStatus, Source, TOKEN_ENV, URL_ENV, Workspace, WorkspaceId,
};

/// Exit code: the API returned an error, or a waited-for Run ended badly.
const EXIT_FAILED: u8 = 1;
/// Exit code: the command line (or the local configuration) is wrong; nothing was sent.
const EXIT_USAGE: u8 = 2;

/// Where a person starts the local stack.
const START_HINT: &str = "is the API running? start it with infra/local/quickstart.sh";

/// Takosumi: plan, apply and inspect OpenTofu/Terraform Runs.
// No `Debug`: the struct holds the token.
#[derive(Parser)]
#[command(name = "takosumi", version, propagate_version = true)]
struct Cli {
    /// Base URL of the Takosumi API (default: the one `takosumi login` saved, else
    /// http://127.0.0.1:8080).
    #[arg(long, global = true, env = URL_ENV, value_name = "URL")]
    url: Option<String>,
    /// API token (prefer the environment variable: a flag is visible to other local users).
    #[arg(long, global = true, env = TOKEN_ENV, hide_env_values = true, value_name = "TOKEN")]
    token: Option<String>,
    /// Print the API's JSON instead of the human form.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a token against the API and save it with the URL for later commands (to
    /// $TAKOSUMI_CONFIG, else ~/.config/takosumi/config.toml, mode 0600). The token is read
    /// from stdin (`printf %s "$TOKEN" | takosumi login --url URL`) unless --token or
    /// TAKOSUMI_DEPLOY_CONTROL_TOKEN gives it; it is never printed.
    Login,
    /// Worker pools: named sets of relay workers that run Capsules' jobs where the
    /// control plane cannot reach.
    Pool {
        #[command(subcommand)]
        command: pools_cli::PoolCommand,
    },
    /// Workspaces: groups of Capsules with shared rules and history.
    Workspace {
        #[command(subcommand)]
        command: WorkspaceCommand,
    },
    /// Capsules: a Git repo, a branch and a directory of configuration.
    Capsule {
        #[command(subcommand)]
        command: CapsuleCommand,
    },
    /// Start a plan Run of a Capsule.
    Plan {
        /// The Capsule (`cap_…`).
        #[arg(value_name = "CAPSULE")]
        capsule: CapsuleId,
        /// A variable for this Run only, `NAME=VALUE` (repeatable); a value that is a JSON
        /// list or map (`zones=["a","b"]`, `tags={"env":"prod"}`) is passed as one.
        #[arg(long = "var", value_name = "NAME=VALUE", value_parser = parse_plan_var)]
        vars: Vec<Var>,
        /// A variable for this Run only given as JSON, `NAME=JSON` (repeatable).
        #[arg(long = "var-json", value_name = "NAME=JSON", value_parser = parse_var_json)]
        var_json: Vec<Var>,
        #[command(flatten)]
        submit: SubmitArgs,
    },
    /// Install: plan a Capsule and continue to its apply if the plan finishes cleanly
    /// (autoApplyRequested); deletions, an approval rule, the cost check or a plan gate
    /// still stop it for review. With --wait, waits for the plan and then for its apply.
    Install {
        /// The Capsule (`cap_…`).
        #[arg(value_name = "CAPSULE")]
        capsule: CapsuleId,
        /// A variable for this Run only, `NAME=VALUE` (repeatable).
        #[arg(long = "var", value_name = "NAME=VALUE", value_parser = parse_plan_var)]
        vars: Vec<Var>,
        /// A variable for this Run only given as JSON, `NAME=JSON` (repeatable).
        #[arg(long = "var-json", value_name = "NAME=JSON", value_parser = parse_var_json)]
        var_json: Vec<Var>,
        #[command(flatten)]
        submit: SubmitArgs,
    },
    /// Start a destroy plan Run of a Capsule (nothing is destroyed until it is applied).
    Destroy {
        /// The Capsule (`cap_…`).
        #[arg(value_name = "CAPSULE")]
        capsule: CapsuleId,
        #[command(flatten)]
        submit: SubmitArgs,
    },
    /// Start an Apply Run of exactly the saved plan of a plan, destroy or drift-check Run.
    Apply {
        /// The planned Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
        #[command(flatten)]
        submit: SubmitArgs,
    },
    /// Apply a Capsule's branch as it is: in one step (`apply -auto-approve`) when no rule
    /// covers it, else planned first and the apply proposed from the saved plan.
    ApplyCapsule {
        /// The Capsule (`cap_…`).
        #[arg(value_name = "CAPSULE")]
        capsule: CapsuleId,
        /// Hold the apply for a person whatever the rules say (it is planned first).
        #[arg(long)]
        require_approval: bool,
        #[command(flatten)]
        submit: SubmitArgs,
    },
    /// Approve a held Run (the requester cannot approve their own).
    Approve {
        /// The held Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
        /// The plan digest you reviewed; refused unless it is the Run's.
        #[arg(long)]
        plan_digest: Option<String>,
        /// A note kept with the approval.
        #[arg(long)]
        note: Option<String>,
    },
    /// Set the gate rules of a Workspace or a Capsule from a JSON file (a new version).
    Rules {
        /// The Workspace (`ws_…`).
        #[arg(long, conflicts_with = "capsule")]
        workspace: Option<WorkspaceId>,
        /// The Capsule (`cap_…`).
        #[arg(long)]
        capsule: Option<CapsuleId>,
        /// The rules as JSON (`{"maxDestroy": 0, "approval": {"required": 2}, "planGate": "…"}`), `-` for stdin.
        #[arg(long)]
        file: String,
    },
    /// Start a drift check of a Capsule (read-only; it never applies).
    DriftCheck {
        /// The Capsule (`cap_…`).
        #[arg(value_name = "CAPSULE")]
        capsule: CapsuleId,
        /// Wait for the check to finish.
        #[arg(long)]
        wait: bool,
        /// How long to wait.
        #[arg(long, default_value_t = 600)]
        timeout_secs: u64,
    },
    /// Plan every Capsule of a Workspace (or drift-check them) as one RunGroup.
    PlanUpdate {
        /// The Workspace (`ws_…`).
        #[arg(value_name = "WORKSPACE")]
        workspace: WorkspaceId,
        /// Only the Capsules a push marked stale.
        #[arg(long)]
        only_stale: bool,
        /// Drift-check instead of plan.
        #[arg(long)]
        drift: bool,
    },
    /// Show, approve or apply a RunGroup.
    Group {
        /// `show`, `approve` or `apply`.
        #[arg(value_parser = ["show", "approve", "apply"])]
        action: String,
        /// The RunGroup (`rg_…`).
        #[arg(value_name = "GROUP")]
        group: RunGroupId,
    },
    /// Show a Run.
    Status {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
    },
    /// Print a Run's (masked) log.
    Logs {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
        /// Keep printing what is added until the Run is finished or held (exit code: its
        /// outcome).
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Cancel a Run: a queued or held one ends at once, a running one is interrupted.
    Cancel {
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
    },
    /// Show the cost estimate of a plan (or of the plan an Apply Run carries out).
    Cost {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
    },
    /// List a Workspace's Runs, newest first.
    Runs {
        /// The Workspace (`ws_…`).
        #[arg(value_name = "WORKSPACE")]
        workspace: WorkspaceId,
        /// Only this Capsule's Runs.
        #[arg(long, value_name = "CAPSULE")]
        capsule: Option<CapsuleId>,
        /// Only this kind: plan, destroy, apply, drift_check.
        #[arg(long, value_parser = records_cli::parse_kind)]
        kind: Option<RunKind>,
        /// Only this status (e.g. unknown_outcome: the Runs that need a person).
        #[arg(long, value_parser = records_cli::parse_status)]
        status: Option<RunStatus>,
        /// Runs per page (1-100).
        #[arg(long)]
        limit: Option<u32>,
        /// The next page, as printed by the previous one.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show a Workspace's activity record, newest first.
    Activity {
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
    },
    /// Show what the steps could not process: each step queue's dead letters and their
    /// first messages (viewing changes nothing); `requeue` puts them back onto their work
    /// queue, `purge` deletes them (admin tokens).
    DeadLetters {
        /// Messages shown per queue (at most 50; default 10).
        #[arg(long)]
        limit: Option<u16>,
        #[command(subcommand)]
        action: Option<dead_letters_cli::DeadLetterAction>,
    },
    /// Resolve an unknown_outcome apply (admin tokens): record that it was inspected, or
    /// also give the Capsule its state (the held one, or one pulled from the provider side).
    Resolve {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
        /// What was checked: the provider side, the Capsule's current StateVersion.
        #[arg(long)]
        note: String,
        /// Make the state the apply wrote, held in the database because object storage
        /// would not take it, the Capsule's next StateVersion.
        #[arg(long, conflicts_with = "attach_state")]
        restore_held_state: bool,
        /// Make this state file (`terraform state pull` output, format version 4) the
        /// Capsule's next StateVersion.
        #[arg(long, value_name = "FILE")]
        attach_state: Option<std::path::PathBuf>,
    },
    /// Print a Run's events in order.
    Events {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
    },
    /// API tokens (instance admins): create one (its value is printed once), list them,
    /// revoke one (effective from its next request).
    Token {
        #[command(subcommand)]
        action: TokenCommand,
    },
    /// Follow a Run as it goes (its event record and log, live) until it settles; the exit
    /// code is its outcome (0: planned or applied, 1: failed, canceled or unknown outcome).
    Watch {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
    },
    /// Print a plan's changes resource by resource (sensitive values withheld); for an
    /// Apply Run, the plan it carries out.
    Diff {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
    },
    /// Signed audit evidence: export a Workspace's chain for offline checks, show a Run's
    /// statement, list the public keys.
    Evidence {
        #[command(subcommand)]
        command: evidence_cli::EvidenceCommand,
    },
    /// Verify signed audit evidence: a Run's statement (`verify RUN`) or a Workspace's
    /// whole chain (`--workspace WS`): every signature, every link, and that each apply
    /// carries out exactly the plan digest its plan Run's statement names. `--bundle FILE`
    /// checks an exported bundle offline (no URL, no token). Exit 1 names the broken link.
    Verify(evidence_cli::VerifyArgs),
    /// Wait until a Run is finished or held, then show it.
    Wait {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 600, value_name = "SECS")]
        timeout_secs: u64,
    },
}

#[derive(Subcommand)]
enum WorkspaceCommand {
    /// Create a Workspace.
    Create {
        /// Its unique name.
        name: String,
    },
    /// List the Workspaces this token can see.
    List,
}

#[derive(Subcommand)]
enum CapsuleCommand {
    /// Register a Capsule in a Workspace.
    Create(CapsuleCreateArgs),
    /// List a Workspace's Capsules.
    List {
        /// The Workspace (`ws_…`).
        #[arg(long, value_name = "WS")]
        workspace: WorkspaceId,
    },
    /// Show a Capsule.
    Show {
        /// The Capsule (`cap_…`).
        #[arg(value_name = "CAPSULE")]
        capsule: CapsuleId,
    },
    /// Run a Capsule's plans, drift checks and applies on a worker pool (`--none`: on the
    /// control node again).
    SetPool(pools_cli::SetPoolArgs),
}

#[derive(Args)]
struct CapsuleCreateArgs {
    /// The Workspace (`ws_…`).
    #[arg(long, value_name = "WS")]
    workspace: WorkspaceId,
    /// Unique within the Workspace.
    #[arg(long)]
    name: String,
    /// The Git repository URL.
    #[arg(long, value_name = "URL")]
    repo: String,
    /// The branch to plan.
    #[arg(long, default_value = "main")]
    branch: String,
    /// The directory of `.tf`/`.tofu` files inside the repository.
    #[arg(long, default_value = ".")]
    dir: String,
    /// The tool that runs the configuration.
    #[arg(long, value_enum, default_value_t = Tool::Tofu)]
    tool: Tool,
    /// A string input variable (repeatable).
    #[arg(long = "var", value_name = "KEY=VALUE", value_parser = parse_var)]
    vars: Vec<Var>,
    /// An input variable given as JSON, e.g. `--var-json 'zones=["a","b"]'` (repeatable).
    #[arg(long = "var-json", value_name = "KEY=JSON", value_parser = parse_var_json)]
    var_json: Vec<Var>,
}

#[derive(Args)]
struct SubmitArgs {
    /// Wait until the Run is finished or held, then show it.
    #[arg(long)]
    wait: bool,
    /// Like `--wait`, printing every status change and event as it happens.
    #[arg(long, conflicts_with = "wait")]
    watch: bool,
    /// With `--wait` or `--watch`: give up after this many seconds.
    #[arg(long, default_value_t = 600, value_name = "SECS")]
    timeout_secs: u64,
    /// Submitting again with the same key returns the same Run.
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Tool {
    /// OpenTofu.
    Tofu,
    /// Terraform.
    Terraform,
}

impl Tool {
    fn as_str(self) -> &'static str {
        match self {
            Self::Tofu => "tofu",
            Self::Terraform => "terraform",
        }
    }
}

/// One `--var` / `--var-json`.
#[derive(Debug, Clone, PartialEq)]
struct Var {
    key: String,
    value: Value,
}

fn split_var(s: &str) -> Result<(&str, &str), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not KEY=VALUE"))?;
    if key.is_empty() {
        return Err(format!("`{s}` has an empty variable name"));
    }
    if key.chars().any(char::is_whitespace) {
        return Err(format!("variable name `{key}` contains whitespace"));
    }
    Ok((key, value))
}

fn parse_var(s: &str) -> Result<Var, String> {
    let (key, value) = split_var(s)?;
    Ok(Var {
        key: key.to_owned(),
        value: Value::String(value.to_owned()),
    })
}

/// `--var` of a plan: a string, or a list or map when the value is one in JSON.
fn parse_plan_var(s: &str) -> Result<Var, String> {
    let (key, value) = split_var(s)?;
    let trimmed = value.trim_start();
    let value = if trimmed.starts_with('[') || trimmed.starts_with('{') {
        serde_json::from_str(value).map_err(|e| {
            format!("the value of `{key}` looks like a JSON list or map but is not valid JSON ({e}); fix it, or pass a string with --var-json '{key}=\"…\"'")
        })?
    } else {
        Value::String(value.to_owned())
    };
    Ok(Var {
        key: key.to_owned(),
        value,
    })
}

fn parse_var_json(s: &str) -> Result<Var, String> {
    let (key, value) = split_var(s)?;
    let value = serde_json::from_str(value)
        .map_err(|e| format!("the value of `{key}` is not valid JSON: {e}"))?;
    Ok(Var {
        key: key.to_owned(),
        value,
    })
}

/// Merges `--var` and `--var-json`; a name given twice is an error.
fn collect_vars(vars: Vec<Var>, var_json: Vec<Var>) -> Result<Map<String, Value>, String> {
    let mut out = Map::new();
    for Var { key, value } in vars.into_iter().chain(var_json) {
        if out.contains_key(&key) {
            return Err(format!("variable `{key}` is given more than once"));
        }
        out.insert(key, value);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Human output

const LABEL_WIDTH: usize = 18;

/// A block of aligned `label: value` lines.
#[derive(Default)]
struct Block(String);

impl Block {
    fn line(&mut self, label: &str, value: impl std::fmt::Display) -> &mut Self {
        let label = format!("{label}:");
        let _ = writeln!(self.0, "{label:<LABEL_WIDTH$}{value}");
        self
    }

    /// `name = <json>` lines under a `title:` line.
    fn json_map(&mut self, title: &str, map: &Map<String, Value>) -> &mut Self {
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

fn kind_str(kind: RunKind) -> &'static str {
    match kind {
        RunKind::Plan => "plan",
        RunKind::Destroy => "destroy",
        RunKind::Apply => "apply",
        RunKind::DriftCheck => "drift_check",
    }
}

fn short(hex: &str) -> &str {
    hex.get(..12).unwrap_or(hex)
}

fn format_run(run: &Run) -> String {
    let mut b = Block::default();
    b.line("run", run.id)
        .line("kind", kind_str(run.kind))
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
    if let Some(hold) = &run.hold {
        match &hold.details {
            Value::Null => b.line("held", &hold.reason),
            Value::Object(m) if m.is_empty() => b.line("held", &hold.reason),
            details => b.line("held", format!("{} {details}", hold.reason)),
        };
    }
    if let Some(at) = run.extra.get("cancelRequestedAt").and_then(Value::as_str)
        && run.status != RunStatus::Canceled
    {
        b.line("cancel requested", at);
    }
    if let Some(by) = run.extra.get("canceledBy").and_then(Value::as_str) {
        b.line("canceled by", by);
    }
    if let Some(Value::Object(r)) = run.extra.get("resolution") {
        let text = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or_default();
        b.line(
            "resolved",
            format!(
                "{} by {} at {}: {}",
                text("action"),
                text("by"),
                text("at"),
                text("note")
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

fn format_capsule(c: &Capsule) -> String {
    let mut b = Block::default();
    b.line("capsule", c.id)
        .line("workspace", c.workspace_id)
        .line("name", &c.name);
    b.line(
        "source",
        format!("{} (branch {})", c.source.repo, c.source.branch),
    );
    b.line("dir", &c.dir).line("tool", &c.tool);
    if !c.status.is_empty() {
        b.line("status", &c.status);
    }
    b.line("state generation", c.state_generation);
    match c.current_state_version_id {
        Some(sv) => b.line("state version", sv),
        None => b.line("state version", "(none)"),
    };
    if c.stale || c.drifted {
        let both = [(c.stale, "stale"), (c.drifted, "drifted")]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, what)| *what)
            .collect::<Vec<_>>()
            .join(", ");
        b.line("detected", both);
    }
    b.json_map("vars", &c.vars);
    if let Some(withheld) = c.extra.get("withheldVars").and_then(|v| v.as_array())
        && !withheld.is_empty()
    {
        let names: Vec<&str> = withheld.iter().filter_map(|n| n.as_str()).collect();
        b.line(
            "withheld vars",
            format!(
                "{} (sensitive in the configuration, not planned yet, or your role may not edit the Capsule)",
                names.join(", ")
            ),
        );
    }
    b.0
}

fn format_workspace(w: &Workspace) -> String {
    let mut b = Block::default();
    b.line("workspace", w.id).line("name", &w.name);
    b.0
}

fn format_events(events: &[RunEvent]) -> String {
    let mut out = String::new();
    for e in events {
        let at =
            e.at.map(|at| at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
                .unwrap_or_default();
        let _ = write!(out, "{:>4}  {at}  {}  {}", e.id, e.kind, e.actor);
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

#[derive(Subcommand)]
enum TokenCommand {
    /// Make a token: `--name ci --role operator [--workspace ws_…] [--expires-in-days 90]`.
    Create {
        /// A name for audit.
        #[arg(long)]
        name: String,
        /// viewer, operator, approver, admin or agent.
        #[arg(long)]
        role: String,
        /// Limit it to one Workspace.
        #[arg(long, value_name = "WS")]
        workspace: Option<WorkspaceId>,
        /// It stops working after this many days.
        #[arg(long, value_name = "DAYS")]
        expires_in_days: Option<u32>,
    },
    /// List every token (never a value).
    List,
    /// Revoke a token by id (`tok_…`).
    Revoke {
        /// The token's id.
        #[arg(value_name = "TOKEN_ID")]
        id: takosumi_client::TokenId,
    },
}

async fn token_command(
    client: &Client,
    action: TokenCommand,
    json: bool,
) -> Result<u8, ClientError> {
    match action {
        TokenCommand::Create {
            name,
            role,
            workspace,
            expires_in_days,
        } => {
            let made = client
                .create_token(&takosumi_client::NewToken {
                    name,
                    role,
                    workspace_id: workspace,
                    expires_in_days,
                })
                .await?;
            if json {
                print_json(&made);
            } else {
                println!("{}", made.token);
                eprintln!(
                    "token {} ({}, role {}) created: the value above is shown only now",
                    made.info.id, made.info.name, made.info.role
                );
            }
        }
        TokenCommand::List => {
            let all = client.list_tokens().await?;
            if json {
                print_json(&serde_json::json!({ "tokens": all }));
            } else {
                for t in all {
                    let state = match (&t.revoked_at, &t.expires_at) {
                        (Some(at), _) => format!("revoked {}", at.to_rfc3339()),
                        (None, Some(at)) => format!("expires {}", at.to_rfc3339()),
                        (None, None) => "no expiry".into(),
                    };
                    let scope = t
                        .workspace_id
                        .map(|w| w.to_string())
                        .unwrap_or_else(|| "instance".into());
                    println!("{}  {:<9} {:<24} {scope}  {state}", t.id, t.role, t.name);
                }
            }
        }
        TokenCommand::Revoke { id } => {
            let t = client.revoke_token(id).await?;
            if json {
                print_json(&t);
            } else {
                println!("revoked {} ({})", t.id, t.name);
            }
        }
    }
    Ok(0)
}

fn print_stream_event(ev: &takosumi_client::StreamEvent, json: bool, step: &mut Option<String>) {
    use takosumi_client::StreamEvent as E;
    if json {
        if let Ok(line) = serde_json::to_string(ev) {
            println!("{line}");
        }
        return;
    }
    match ev {
        E::Event { event } => print!("{}", format_events(std::slice::from_ref(event))),
        E::Log { step: s, text } => {
            if step.as_deref() != Some(s.as_str()) {
                println!("== {s} ==");
                *step = Some(s.clone());
            }
            print!("{text}");
        }
        E::Status { status } => println!("-- {} --", status.as_str()),
        E::End { .. } => {}
    }
    flush_stdout();
}

fn flush_stdout() {
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
}

/// `takosumi diff`: one block per resource, `name: before -> after` per attribute.
fn format_diff(view: &takosumi_client::PlanView) -> String {
    let mut out = String::new();
    let Some(diff) = &view.diff else {
        return format!("{}: no plan recorded\n", view.plan_run_id);
    };
    let shown = |a: &takosumi_client::AttributeDiff, v: &Option<Value>| -> String {
        if a.sensitive {
            "(sensitive)".into()
        } else if let Some(v) = v {
            v.to_string()
        } else {
            "null".into()
        }
    };
    for r in &diff.resources {
        let _ = writeln!(out, "{} {}", r.action, r.address);
        for a in &r.attributes {
            let after = if a.unknown && !a.sensitive {
                "(known after apply)".to_owned()
            } else {
                shown(a, &a.after)
            };
            let forces = if a.forces_replacement {
                "  # forces replacement"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "    {}: {} -> {after}{forces}",
                a.name,
                shown(a, &a.before)
            );
        }
    }
    for a in &diff.outputs {
        let _ = writeln!(
            out,
            "output {}: {} -> {}",
            a.name,
            shown(a, &a.before),
            shown(a, &a.after)
        );
    }
    if diff.resources.is_empty() && diff.outputs.is_empty() {
        out.push_str("no changes\n");
    }
    out
}

fn print_json<T: Serialize>(value: &T) {
    match serde_json::to_string_pretty(value) {
        Ok(text) => println!("{text}"),
        // Values decoded from JSON always encode again.
        Err(e) => eprintln!("error: the result could not be printed as JSON: {e}"),
    }
}

// ---------------------------------------------------------------------------------------
// Errors and exit codes

/// The lines to print for an error and the exit code.
fn render_error(err: &ClientError) -> (Vec<String>, u8) {
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

/// The innermost cause of an error: the part a person can act on ("Connection refused").
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = err;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// Whether a waited-for Run ended badly (exit 1).
fn ended_badly(status: RunStatus) -> bool {
    matches!(
        status,
        RunStatus::Failed | RunStatus::Canceled | RunStatus::UnknownOutcome
    )
}

// ---------------------------------------------------------------------------------------
// Commands

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Offline verification trusts nothing but a bundle and keys: no API, no token.
    if let Command::Verify(args) = &cli.command
        && args.bundle.is_some()
    {
        return ExitCode::from(evidence_cli::verify_offline(args, cli.json));
    }
    if let Command::Login = cli.command {
        let url = cli.url.clone().unwrap_or_else(|| DEFAULT_URL.to_owned());
        return ExitCode::from(config_cli::login(&url, cli.token.clone(), cli.json).await);
    }
    // Flags and the environment first, then what `takosumi login` saved.
    let saved = if cli.token.as_deref().is_none_or(str::is_empty) || cli.url.is_none() {
        match config_cli::path().map(|p| config_cli::load(&p)) {
            Ok(Ok(saved)) => saved,
            Ok(Err(message)) => Cli::command().error(ErrorKind::Io, message).exit(),
            Err(_) => config_cli::Config::default(),
        }
    } else {
        config_cli::Config::default()
    };
    let url = cli
        .url
        .clone()
        .or(saved.url)
        .unwrap_or_else(|| DEFAULT_URL.to_owned());
    let Some(token) = cli.token.clone().filter(|t| !t.is_empty()).or(saved.token) else {
        Cli::command()
            .error(
                ErrorKind::MissingRequiredArgument,
                format!("no API token: run `takosumi login`, or set {TOKEN_ENV} (or pass --token)"),
            )
            .exit();
    };
    let client = match Client::new(&url, &token) {
        Ok(client) => client,
        Err(err) => Cli::command()
            .error(ErrorKind::InvalidValue, err.to_string())
            .exit(),
    };
    match run(&client, cli.command, cli.json).await {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            let (lines, code) = render_error(&err);
            for line in lines {
                eprintln!("{line}");
            }
            ExitCode::from(code)
        }
    }
}

async fn run(client: &Client, command: Command, json: bool) -> Result<u8, ClientError> {
    match command {
        Command::Workspace {
            command: WorkspaceCommand::Create { name },
        } => {
            let ws = client.create_workspace(&name).await?;
            if json {
                print_json(&ws);
            } else {
                print!("{}", format_workspace(&ws));
            }
            Ok(0)
        }
        Command::Capsule {
            command: CapsuleCommand::Create(args),
        } => {
            let vars = match collect_vars(args.vars, args.var_json) {
                Ok(vars) => vars,
                Err(message) => Cli::command()
                    .error(ErrorKind::ArgumentConflict, message)
                    .exit(),
            };
            let req = NewCapsule {
                name: args.name,
                source: Source {
                    repo: args.repo,
                    branch: args.branch,
                },
                dir: args.dir,
                tool: args.tool.as_str().to_owned(),
                vars,
            };
            let capsule = client.create_capsule(args.workspace, &req).await?;
            show_capsule(&capsule, json);
            Ok(0)
        }
        Command::Login => Ok(EXIT_USAGE),
        Command::Workspace {
            command: WorkspaceCommand::List,
        } => {
            let list = client.list_workspaces().await?;
            if json {
                print_json(&list);
            } else {
                for w in &list {
                    println!("{}  {}", w.id, w.name);
                }
            }
            Ok(0)
        }
        Command::Capsule {
            command: CapsuleCommand::List { workspace },
        } => {
            let list = client.list_capsules(workspace).await?;
            if json {
                print_json(&list);
            } else {
                for c in &list {
                    println!(
                        "{}  {}  {}  {}  {}#{}:{}",
                        c.id, c.name, c.status, c.tool, c.source.repo, c.source.branch, c.dir
                    );
                }
            }
            Ok(0)
        }
        Command::Capsule {
            command: CapsuleCommand::Show { capsule },
        } => {
            show_capsule(&client.get_capsule(capsule).await?, json);
            Ok(0)
        }
        Command::Plan {
            capsule,
            vars,
            var_json,
            submit,
        } => {
            let vars = match collect_vars(vars, var_json) {
                Ok(vars) => vars,
                Err(message) => Cli::command()
                    .error(ErrorKind::ArgumentConflict, message)
                    .exit(),
            };
            let run = if vars.is_empty() {
                client
                    .plan(capsule, submit.idempotency_key.as_deref())
                    .await?
            } else {
                let req = takosumi_client::PlanRequest {
                    vars,
                    ..Default::default()
                };
                client
                    .plan_with(capsule, submit.idempotency_key.as_deref(), &req)
                    .await?
            };
            finish_submission(client, run, &submit, json).await
        }
        Command::Install {
            capsule,
            vars,
            var_json,
            submit,
        } => {
            let vars = match collect_vars(vars, var_json) {
                Ok(vars) => vars,
                Err(message) => Cli::command()
                    .error(ErrorKind::ArgumentConflict, message)
                    .exit(),
            };
            let req = takosumi_client::PlanRequest {
                vars,
                auto_apply_requested: true,
                ..Default::default()
            };
            let plan = client
                .plan_with(capsule, submit.idempotency_key.as_deref(), &req)
                .await?;
            if !submit.wait {
                return finish_submission(client, plan, &submit, json).await;
            }
            install_wait(client, plan, &submit, json).await
        }
        Command::Destroy { capsule, submit } => {
            let run = client
                .destroy(capsule, submit.idempotency_key.as_deref())
                .await?;
            finish_submission(client, run, &submit, json).await
        }
        Command::Apply { run, submit } => {
            let run = client.apply(run, submit.idempotency_key.as_deref()).await?;
            finish_submission(client, run, &submit, json).await
        }
        Command::Status { run } => {
            show_run(&client.get_run(run).await?, json);
            Ok(0)
        }
        Command::Logs { run, follow: true } => records_cli::follow_logs(client, run, json).await,
        Command::Logs { run, follow: false } => {
            if json {
                print_json(&serde_json::json!({ "logs": client.log_entries(run).await? }));
            } else {
                let text = client.logs(run).await?;
                print!("{text}");
                if !text.is_empty() && !text.ends_with('\n') {
                    println!();
                }
            }
            Ok(0)
        }
        Command::Cancel {
            run,
            reason,
            wait,
            timeout_secs,
        } => {
            let wait = wait.then(|| Duration::from_secs(timeout_secs));
            records_cli::cancel(client, run, reason.as_deref(), wait, json).await
        }
        Command::Cost { run } => records_cli::cost(client, run, json).await,
        Command::ApplyCapsule {
            capsule,
            require_approval,
            submit,
        } => {
            let run = client
                .apply_capsule(capsule, require_approval, submit.idempotency_key.as_deref())
                .await?;
            if !json && run.kind != takosumi_client::RunKind::Apply {
                eprintln!(
                    "a rule covers this apply: {} plans first, and the gate proposes the apply from its saved plan (takosumi runs {} --capsule {capsule})",
                    run.id, run.workspace_id
                );
            }
            finish_submission(client, run, &submit, json).await
        }
        Command::Approve {
            run,
            plan_digest,
            note,
        } => gates_cli::approve(client, run, plan_digest.as_deref(), note.as_deref(), json).await,
        Command::Rules {
            workspace,
            capsule,
            file,
        } => gates_cli::set_rules(client, workspace, capsule, &file, json).await,
        Command::DriftCheck {
            capsule,
            wait,
            timeout_secs,
        } => {
            gates_cli::drift_check(
                client,
                capsule,
                wait.then(|| Duration::from_secs(timeout_secs)),
                json,
            )
            .await
        }
        Command::PlanUpdate {
            workspace,
            only_stale,
            drift,
        } => gates_cli::start_group(client, workspace, drift, only_stale, json).await,
        Command::Group { action, group } => {
            let action = (action != "show").then_some(action.as_str());
            gates_cli::group(client, group, action, json).await
        }
        Command::Runs {
            workspace,
            capsule,
            kind,
            status,
            limit,
            cursor,
        } => {
            let q = takosumi_client::RunQuery {
                capsule,
                kind,
                status,
                limit,
                cursor,
            };
            records_cli::runs(client, workspace, &q, json).await
        }
        Command::Activity {
            workspace,
            kind,
            limit,
            cursor,
        } => {
            records_cli::activity(
                client,
                workspace,
                kind.as_deref(),
                limit,
                cursor.as_deref(),
                json,
            )
            .await
        }
        Command::Resolve {
            run,
            note,
            restore_held_state,
            attach_state,
        } => {
            let how = match (restore_held_state, attach_state) {
                (true, _) => records_cli::Resolution::RestoreHeldState,
                (false, Some(file)) => records_cli::Resolution::AttachState(file),
                (false, None) => records_cli::Resolution::MarkResolved,
            };
            records_cli::resolve(client, run, &note, how, json).await
        }
        Command::DeadLetters {
            limit,
            action: None,
        } => dead_letters_cli::dead_letters(client, limit, json).await,
        Command::DeadLetters {
            action: Some(action),
            ..
        } => dead_letters_cli::act(client, action, json).await,
        Command::Pool { command } => pools_cli::pool(client, command, json).await,
        Command::Evidence { command } => evidence_cli::evidence(client, command, json).await,
        Command::Verify(args) => evidence_cli::verify_online(client, &args, json).await,
        Command::Capsule {
            command: CapsuleCommand::SetPool(args),
        } => pools_cli::set_pool(client, args, json).await,
        Command::Token { action } => token_command(client, action, json).await,
        Command::Watch { run } => {
            let mut step: Option<String> = None;
            let status = client
                .watch(run, |ev| print_stream_event(ev, json, &mut step))
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
        Command::Diff { run } => {
            let view = client.plan_view(run).await?;
            if json {
                print_json(&view);
            } else {
                print!("{}", format_diff(&view));
            }
            Ok(0)
        }
        Command::Events { run } => {
            let events = client.events(run).await?;
            if json {
                print_json(&serde_json::json!({ "events": events }));
            } else {
                print!("{}", format_events(&events));
            }
            Ok(0)
        }
        Command::Wait { run, timeout_secs } => {
            let run = client.wait(run, Duration::from_secs(timeout_secs)).await?;
            Ok(report_waited(&run, json))
        }
    }
}

async fn finish_submission(
    client: &Client,
    run: Run,
    submit: &SubmitArgs,
    json: bool,
) -> Result<u8, ClientError> {
    if submit.watch {
        let timeout = Duration::from_secs(submit.timeout_secs);
        return records_cli::watch(client, run, timeout, json).await;
    }
    if submit.wait {
        let run = client
            .wait(run.id, Duration::from_secs(submit.timeout_secs))
            .await?;
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
async fn install_wait(
    client: &Client,
    plan: Run,
    submit: &SubmitArgs,
    json: bool,
) -> Result<u8, ClientError> {
    let timeout = Duration::from_secs(submit.timeout_secs);
    let deadline = tokio::time::Instant::now() + timeout;
    let plan = client.wait(plan.id, timeout).await?;
    if plan.status != RunStatus::Planned {
        return Ok(report_waited(&plan, json));
    }
    if !json {
        eprintln!("planned {}; waiting for the apply it proposes", plan.id);
    }
    let query = takosumi_client::RunQuery {
        capsule: Some(plan.capsule_id),
        kind: Some(RunKind::Apply),
        limit: Some(20),
        ..Default::default()
    };
    loop {
        let page = client.list_runs(plan.workspace_id, &query).await?;
        if let Some(apply) = page
            .runs
            .into_iter()
            .find(|r| r.plan_run_id == Some(plan.id))
        {
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

/// Shows a Run that was waited for; its end decides the exit code.
fn report_waited(run: &Run, json: bool) -> u8 {
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

fn show_run(run: &Run, json: bool) {
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

fn show_capsule(capsule: &Capsule, json: bool) {
    if json {
        print_json(capsule);
    } else {
        print!("{}", format_capsule(capsule));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use takosumi_client::{Changes, StateVersionId};

    fn run_from(extra: Value) -> Run {
        let mut body = json!({
            "id": RunId::new(), "kind": "apply", "status": "applied",
            "workspaceId": WorkspaceId::new(), "capsuleId": CapsuleId::new(),
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn vars_parse() {
        assert_eq!(
            parse_var("region=eu").unwrap(),
            Var {
                key: "region".into(),
                value: json!("eu")
            }
        );
        assert_eq!(parse_var("conn=a=b").unwrap().value, json!("a=b"));
        assert_eq!(parse_var("empty=").unwrap().value, json!(""));
        assert!(parse_var("noequals").is_err());
        assert!(parse_var("=x").is_err());
        assert!(parse_var("a b=x").is_err());

        assert_eq!(
            parse_var_json("zones=[\"a\",\"b\"]").unwrap().value,
            json!(["a", "b"])
        );
        assert_eq!(parse_var_json("n=3").unwrap().value, json!(3));
        assert_eq!(parse_var_json("s=\"text\"").unwrap().value, json!("text"));
        let err = parse_var_json("bad={").unwrap_err();
        assert!(err.contains("`bad` is not valid JSON"), "{err}");

        let vars = collect_vars(
            vec![parse_var("a=1").unwrap()],
            vec![parse_var_json("b=2").unwrap()],
        )
        .unwrap();
        assert_eq!(Value::Object(vars), json!({"a": "1", "b": 2}));
        let dup = collect_vars(
            vec![parse_var("a=1").unwrap()],
            vec![parse_var_json("a=2").unwrap()],
        );
        assert!(dup.unwrap_err().contains("`a`"));
    }

    #[test]
    fn capsule_create_parses() {
        let ws = WorkspaceId::new();
        let cli = Cli::try_parse_from([
            "takosumi",
            "--token",
            "t",
            "capsule",
            "create",
            "--workspace",
            &ws.to_string(),
            "--name",
            "network",
            "--repo",
            "https://git.example/infra.git",
            "--dir",
            "infra/network",
            "--tool",
            "terraform",
            "--var",
            "region=eu",
            "--var-json",
            "zones=[1,2]",
        ])
        .unwrap();
        let Command::Capsule {
            command: CapsuleCommand::Create(args),
        } = cli.command
        else {
            panic!("wrong command");
        };
        assert_eq!(args.workspace, ws);
        assert_eq!(args.branch, "main");
        assert_eq!(args.tool, Tool::Terraform);
        assert_eq!(args.vars.len(), 1);
        assert_eq!(args.var_json[0].value, json!([1, 2]));
    }

    #[test]
    fn defaults_and_global_flags() {
        let run = RunId::new();
        let cli = Cli::try_parse_from(["takosumi", "wait", &run.to_string(), "--json"]).unwrap();
        assert!(cli.json);
        let Command::Wait {
            run: parsed,
            timeout_secs,
        } = cli.command
        else {
            panic!("wrong command")
        };
        assert_eq!((parsed, timeout_secs), (run, 600));

        let cap = CapsuleId::new();
        let cli = Cli::try_parse_from([
            "takosumi",
            "plan",
            &cap.to_string(),
            "--wait",
            "--idempotency-key",
            "k1",
        ])
        .unwrap();
        let Command::Plan {
            capsule, submit, ..
        } = cli.command
        else {
            panic!("wrong command")
        };
        assert_eq!(capsule, cap);
        assert!(submit.wait);
        assert_eq!(submit.idempotency_key.as_deref(), Some("k1"));

        let cli = Cli::try_parse_from([
            "takosumi",
            "capsule",
            "create",
            "--workspace",
            &WorkspaceId::new().to_string(),
            "--name",
            "n",
            "--repo",
            "r",
        ])
        .unwrap();
        let Command::Capsule {
            command: CapsuleCommand::Create(args),
        } = cli.command
        else {
            panic!("wrong command")
        };
        assert_eq!((args.dir.as_str(), args.tool), (".", Tool::Tofu));
    }

    #[test]
    fn bad_ids_are_rejected_before_any_request() {
        let cap = CapsuleId::new().to_string();
        for argv in [
            vec!["takosumi", "status", "nope"],
            vec!["takosumi", "apply", &cap],
            vec!["takosumi", "plan", "run_0123"],
            vec![
                "takosumi",
                "capsule",
                "create",
                "--workspace",
                "prod",
                "--name",
                "n",
                "--repo",
                "r",
            ],
        ] {
            let err = Cli::try_parse_from(&argv)
                .err()
                .unwrap_or_else(|| panic!("{argv:?} parsed"));
            assert_eq!(err.kind(), ErrorKind::ValueValidation, "{argv:?}");
            assert_eq!(err.exit_code(), 2);
            assert!(err.to_string().contains("is not a valid"), "{err}");
        }
        let err = Cli::try_parse_from(["takosumi", "status", "cap_x"])
            .err()
            .unwrap();
        assert!(err.to_string().contains("run_"), "{err}");
    }

    #[test]
    fn run_block_shows_what_matters() {
        let plan_run = RunId::new();
        let sv = StateVersionId::new();
        let run = run_from(json!({
            "planRunId": plan_run,
            "planDigest": "3f2a9c1b0d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5061728394a5b6c7d8e",
            "sourceSnapshot": {"commit": "0123456789abcdef0123456789abcdef01234567", "treeDigest": "x"},
            "changes": {"add": 1, "change": 2, "destroy": 3},
            "stateGeneration": 4,
            "stateVersionId": sv,
            "outputs": {"vpc": "vpc-eu", "zones": ["a", "b"], "count": 2}
        }));
        let text = format_run(&run);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"vpc = \"vpc-eu\""), "{text}");
        assert!(lines.contains(&"zones = [\"a\",\"b\"]"), "{text}");
        assert!(lines.contains(&"count = 2"), "{text}");
        assert!(
            text.contains(&format!("run:              {}", run.id)),
            "{text}"
        );
        assert!(text.contains("kind:             apply"), "{text}");
        assert!(text.contains("status:           applied"), "{text}");
        assert!(
            text.contains(&format!("capsule:          {}", run.capsule_id)),
            "{text}"
        );
        assert!(
            text.contains(&format!("plan run:         {plan_run}")),
            "{text}"
        );
        assert!(text.contains("changes:          +1 ~2 -3"), "{text}");
        assert!(text.contains("plan digest:      3f2a9c1b0d4e\n"), "{text}");
        assert!(text.contains("source commit:    0123456789ab\n"), "{text}");
        assert!(text.contains("state generation: 4"), "{text}");
        assert!(text.contains(&format!("state version:    {sv}")), "{text}");
        assert!(!text.contains("error"), "{text}");
    }

    #[test]
    fn run_block_shows_errors_and_holds() {
        let failed = run_from(
            json!({"status": "failed", "error": {"code": "stale_plan", "message": "Plan again."}}),
        );
        let text = format_run(&failed);
        assert!(
            text.contains("error:            Plan again. (stale_plan)"),
            "{text}"
        );

        let held = run_from(
            json!({"kind": "plan", "status": "held", "hold": {"reason": "max_destroy", "details": {"destroy": 5}}}),
        );
        let text = format_run(&held);
        assert!(
            text.contains("held:             max_destroy {\"destroy\":5}"),
            "{text}"
        );

        let minimal = run_from(json!({"kind": "drift_check", "status": "queued", "outputs": null}));
        let text = format_run(&minimal);
        assert_eq!(text.lines().count(), 4, "{text}");
        assert!(text.contains("kind:             drift_check"));
    }

    #[test]
    fn waited_runs_decide_the_exit_code() {
        for s in [
            RunStatus::Failed,
            RunStatus::Canceled,
            RunStatus::UnknownOutcome,
        ] {
            assert!(ended_badly(s));
        }
        for s in [RunStatus::Planned, RunStatus::Applied, RunStatus::Held] {
            assert!(!ended_badly(s));
        }
        let _ = Changes::default();
    }

    #[test]
    fn errors_print_message_code_and_hint() {
        let err = ClientError::Api {
            status: 401,
            code: "unauthorized".into(),
            message: "invalid token".into(),
        };
        let (lines, code) = render_error(&err);
        assert_eq!(lines[0], "error: invalid token (unauthorized)");
        assert!(lines[1].contains(TOKEN_ENV));
        assert_eq!(code, 1);

        let err = ClientError::Api {
            status: 404,
            code: "not_found".into(),
            message: "no such run".into(),
        };
        let (lines, code) = render_error(&err);
        assert_eq!(
            (lines, code),
            (vec!["error: no such run (not_found)".to_owned()], 1)
        );

        let (lines, code) = render_error(&ClientError::Config("no API token".into()));
        assert_eq!((lines, code), (vec!["error: no API token".to_owned()], 2));

        let run = RunId::new();
        let (lines, code) = render_error(&ClientError::Timeout {
            run,
            last_status: RunStatus::Applying,
        });
        assert!(lines[0].contains("still applying"));
        assert!(lines[1].contains(&format!("takosumi wait {run}")));
        assert_eq!(code, 1);
    }

    #[tokio::test]
    async fn refused_connections_point_at_the_quickstart() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let client = Client::new(&format!("http://127.0.0.1:{port}"), "t").unwrap();
        let err = client.get_run(RunId::new()).await.unwrap_err();
        let (lines, code) = render_error(&err);
        assert!(lines[0].starts_with(&format!(
            "error: the Takosumi API at http://127.0.0.1:{port} could not be reached: "
        )));
        assert!(lines[0].to_lowercase().contains("refused"), "{lines:?}");
        assert_eq!(lines[1], format!("hint: {START_HINT}"));
        assert_eq!(code, 1);
    }

    #[test]
    fn events_print_one_line_each() {
        let events: Vec<RunEvent> = serde_json::from_value(json!([
            {"id": 1, "kind": "queued", "actor": "user:tok_1", "data": {}, "at": "2026-11-30T10:00:00Z"},
            {"id": 2, "kind": "held", "actor": "handler:gate", "data": {"reason": "max_destroy"}, "at": "2026-11-30T10:00:01.5Z"}
        ]))
        .unwrap();
        let text = format_events(&events);
        assert_eq!(
            text,
            "   1  2026-11-30T10:00:00.000Z  queued  user:tok_1\n   2  2026-11-30T10:00:01.500Z  held  handler:gate  {\"reason\":\"max_destroy\"}\n"
        );
    }
}
