//! `takosumi workspace create|list`.

use clap::Subcommand;
use takosumi_client::Client;

use super::Outcome;
use super::render::{format_workspace, format_workspaces, show};

#[derive(Subcommand)]
pub(crate) enum WorkspaceCommand {
    /// Create a Workspace.
    Create {
        /// Its unique name.
        name: String,
    },
    /// List the Workspaces this token can see.
    List,
}

pub(crate) async fn run(client: &Client, command: WorkspaceCommand, json: bool) -> Outcome {
    match command {
        WorkspaceCommand::Create { name } => {
            show(
                &client.create_workspace(&name).await?,
                json,
                format_workspace,
            );
        }
        WorkspaceCommand::List => {
            show(&client.list_workspaces().await?, json, |l| {
                format_workspaces(l)
            });
        }
    }
    Ok(0)
}
