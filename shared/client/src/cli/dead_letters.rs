//! `takosumi dead-letters`: what the steps could not process, one block per step queue;
//! `takosumi dead-letters requeue|purge` act on them.

use clap::{Args, Subcommand};
use takosumi_client::{Client, DeadLetterSelection};

use super::Outcome;
use super::render::{format_dead_letters, format_requeued, print_json, show};

/// `dead-letters [--limit N] [requeue|purge …]`.
#[derive(Args)]
pub(crate) struct DeadLettersArgs {
    /// Messages shown per queue (at most 50; default 10).
    #[arg(long)]
    limit: Option<u16>,
    #[command(subcommand)]
    action: Option<DeadLetterAction>,
}

/// What to do with dead letters.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadLetterAction {
    /// Put the selected dead letters back onto their work queue (each Run gets a fresh
    /// wake-up; one already done ignores it). Messages that are not Run messages stay:
    /// purge them.
    Requeue(SelectArgs),
    /// Delete the selected dead letters for good.
    Purge(SelectArgs),
}

/// Which dead letters: a queue, ids, or all of them (one is required).
#[derive(Debug, Args)]
pub(crate) struct SelectArgs {
    /// Only this step queue's (`run.plan`).
    #[arg(long)]
    queue: Option<String>,
    /// Only these (the ids `takosumi dead-letters` shows); repeat for more.
    #[arg(long = "id")]
    ids: Vec<i64>,
    /// Every dead letter.
    #[arg(long, conflicts_with_all = ["queue", "ids"])]
    all: bool,
}

impl SelectArgs {
    fn selection(self) -> DeadLetterSelection {
        DeadLetterSelection {
            queue: self.queue,
            ids: (!self.ids.is_empty()).then_some(self.ids),
            all: self.all,
        }
    }
}

/// Shows the dead letters, or requeues or purges them; exit code 0.
pub(crate) async fn run(client: &Client, args: DeadLettersArgs, json: bool) -> Outcome {
    match args.action {
        None => {
            show(
                &client.dead_letters(args.limit).await?,
                json,
                format_dead_letters,
            );
        }
        Some(DeadLetterAction::Requeue(sel)) => {
            let r = client.requeue_dead_letters(&sel.selection()).await?;
            show(&r, json, format_requeued);
        }
        Some(DeadLetterAction::Purge(sel)) => {
            let r = client.purge_dead_letters(&sel.selection()).await?;
            if json {
                print_json(&r);
            } else {
                println!("purged {}", r.purged);
            }
        }
    }
    Ok(0)
}
