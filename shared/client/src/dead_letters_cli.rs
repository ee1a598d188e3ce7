//! `takosumi dead-letters`: what the steps could not process, one block per step queue.

use takosumi_client::{Client, ClientError, DeadLetters};

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
        out.push_str(&format!("{}  depth {}\n", q.dead_letter_queue, q.depth));
        for m in &q.messages {
            let why = match (&m.error, &m.broker_reason) {
                (Some(e), _) => e.clone(),
                (None, Some(r)) => format!("broker: {r}"),
                (None, None) => "no reason recorded".to_owned(),
            };
            let body: String = m.body.chars().take(200).collect();
            out.push_str(&format!("  {body:?}  ({why})\n"));
        }
    }
    out
}
