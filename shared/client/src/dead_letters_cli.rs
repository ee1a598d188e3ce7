//! `takosumi dead-letters`: what the steps could not process, one block per step queue;
//! `takosumi dead-letters requeue|purge` act on them.

use clap::{Args, Subcommand};
use takosumi_client::{Client, ClientError, DeadLetterSelection, DeadLetters};

/// What to do with dead letters.
#[derive(Debug, Subcommand)]
pub enum DeadLetterAction {
    /// Put the selected dead letters back onto their work queue (each Run gets a fresh
    /// wake-up; one already done ignores it). Messages that are not Run messages stay:
    /// purge them.
    Requeue(SelectArgs),
    /// Delete the selected dead letters for good.
    Purge(SelectArgs),
}

/// Which dead letters: a queue, ids, or all of them (one is required).
#[derive(Debug, Args)]
pub struct SelectArgs {
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

/// Runs a requeue or a purge and prints what it did; exit code 0.
pub async fn act(client: &Client, action: DeadLetterAction, json: bool) -> Result<u8, ClientError> {
    match action {
        DeadLetterAction::Requeue(sel) => {
            let r = client.requeue_dead_letters(&sel.selection()).await?;
            if json {
                crate::print_json(&r);
            } else {
                println!("requeued {}", r.requeued.len());
                for d in &r.requeued {
                    println!("  {}  {}  {}", d.id, d.queue, d.run_id);
                }
                if !r.skipped.is_empty() {
                    println!(
                        "left in place {} (not Run messages: purge them)",
                        r.skipped.len()
                    );
                    for d in &r.skipped {
                        println!("  {}  {}", d.id, d.queue);
                    }
                }
                if r.remaining > 0 {
                    println!("{} more selected: run it again", r.remaining);
                }
            }
        }
        DeadLetterAction::Purge(sel) => {
            let r = client.purge_dead_letters(&sel.selection()).await?;
            if json {
                crate::print_json(&r);
            } else {
                println!("purged {}", r.purged);
            }
        }
    }
    Ok(0)
}

/// Prints every dead-letter queue's depth and its first messages; exit code 0.
pub async fn dead_letters(
    client: &Client,
    limit: Option<u16>,
    json: bool,
) -> Result<u8, ClientError> {
    let dl = client.dead_letters(limit).await?;
    if json {
        crate::print_json(&dl);
    } else {
        print!("{}", format_dead_letters(&dl));
    }
    Ok(0)
}

/// The human form: a line per queue, then its messages indented.
pub fn format_dead_letters(dl: &DeadLetters) -> String {
    let mut out = format!("dead letters: {}\n", dl.total);
    for q in &dl.queues {
        out.push_str(&format!("{}  depth {}", q.dead_letter_queue, q.depth));
        match q.uncollected {
            Some(0) => {}
            Some(n) => out.push_str(&format!("  (+{n} in the broker, not collected yet)")),
            None => out.push_str("  (broker unavailable: uncollected unknown)"),
        }
        out.push('\n');
        for m in &q.messages {
            let why = match (&m.error, &m.broker_reason) {
                (Some(e), _) => e.clone(),
                (None, Some(r)) => format!("broker: {r}"),
                (None, None) => "no reason recorded".to_owned(),
            };
            let body: String = m.body.chars().take(200).collect();
            out.push_str(&format!("  #{}  {body:?}  ({why})\n", m.id));
        }
    }
    out
}
