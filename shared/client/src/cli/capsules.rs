//! `takosumi capsule create|list|show|set-pool`.

use clap::{Args, Subcommand, ValueEnum};
use takosumi_client::{Client, NewCapsule, Source, WorkspaceId};

use super::CapsuleArg;
use super::Outcome;
use super::pools::{self, SetPoolArgs};
use super::render::{format_capsule, format_capsules, show};
use super::vars::{Var, collect_or_exit, parse_var, parse_var_json};

#[derive(Subcommand)]
pub(crate) enum CapsuleCommand {
    /// Register a Capsule in a Workspace.
    Create(CapsuleCreateArgs),
    /// List a Workspace's Capsules.
    List {
        /// The Workspace (`ws_…`).
        #[arg(long, value_name = "WS")]
        workspace: WorkspaceId,
    },
    /// Show a Capsule.
    Show(CapsuleArg),
    /// Run a Capsule's plans, drift checks and applies on a worker pool (`--none`: on the
    /// control node again).
    SetPool(SetPoolArgs),
}

#[derive(Args)]
pub(crate) struct CapsuleCreateArgs {
    /// The Workspace (`ws_…`).
    #[arg(long, value_name = "WS")]
    pub(crate) workspace: WorkspaceId,
    /// Unique within the Workspace.
    #[arg(long)]
    pub(crate) name: String,
    /// The Git repository URL.
    #[arg(long, value_name = "URL")]
    pub(crate) repo: String,
    /// The branch to plan.
    #[arg(long, default_value = "main")]
    pub(crate) branch: String,
    /// The directory of `.tf`/`.tofu` files inside the repository.
    #[arg(long, default_value = ".")]
    pub(crate) dir: String,
    /// The tool that runs the configuration.
    #[arg(long, value_enum, default_value_t = Tool::Tofu)]
    pub(crate) tool: Tool,
    /// A string input variable (repeatable).
    #[arg(long = "var", value_name = "KEY=VALUE", value_parser = parse_var)]
    pub(crate) vars: Vec<Var>,
    /// An input variable given as JSON, e.g. `--var-json 'zones=["a","b"]'` (repeatable).
    #[arg(long = "var-json", value_name = "KEY=JSON", value_parser = parse_var_json)]
    pub(crate) var_json: Vec<Var>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Tool {
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

pub(crate) async fn run(client: &Client, command: CapsuleCommand, json: bool) -> Outcome {
    match command {
        CapsuleCommand::Create(args) => create(client, args, json).await,
        CapsuleCommand::List { workspace } => {
            show(&client.list_capsules(workspace).await?, json, |l| {
                format_capsules(l)
            });
            Ok(0)
        }
        CapsuleCommand::Show(args) => {
            show(
                &client.get_capsule(args.capsule).await?,
                json,
                format_capsule,
            );
            Ok(0)
        }
        CapsuleCommand::SetPool(args) => pools::set_pool(client, args, json).await,
    }
}

async fn create(client: &Client, args: CapsuleCreateArgs, json: bool) -> Outcome {
    let vars = collect_or_exit(args.vars, args.var_json);
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
    show(&capsule, json, format_capsule);
    Ok(0)
}
