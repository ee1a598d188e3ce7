//! `takosumi token create|list|revoke`: API tokens, for instance admins. A new token's
//! value is printed once, on stdout, and never again.

use clap::Subcommand;
use takosumi_client::{Client, NewToken, TokenId, WorkspaceId};

use super::Outcome;
use super::render::{format_tokens, print_json, show};

#[derive(Subcommand)]
pub(crate) enum TokenCommand {
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
        id: TokenId,
    },
}

pub(crate) async fn run(client: &Client, action: TokenCommand, json: bool) -> Outcome {
    match action {
        TokenCommand::Create {
            name,
            role,
            workspace,
            expires_in_days,
        } => {
            let made = client
                .create_token(&NewToken {
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
                print!("{}", format_tokens(&all));
            }
        }
        TokenCommand::Revoke { id } => {
            let t = client.revoke_token(id).await?;
            show(&t, json, |t| format!("revoked {} ({})\n", t.id, t.name));
        }
    }
    Ok(0)
}
