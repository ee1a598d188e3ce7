//! `takosumi resolve`: closing an `unknown_outcome` apply once a person has inspected the
//! provider side (admin tokens), optionally giving the Capsule a state: the one held in
//! the database, or a state file pulled from the provider side. A state file's content is
//! never printed, only its size, and what the API recorded (digest, serial, lineage, the
//! new StateVersion and generation).

use std::path::{Path, PathBuf};

use clap::Args;
use takosumi_client::{Client, ClientError, ResolutionAction, Run, RunId};

use super::Outcome;
use super::render::show_run;

/// `resolve`.
#[derive(Args)]
pub(crate) struct ResolveArgs {
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
    attach_state: Option<PathBuf>,
}

/// The largest state file the CLI sends (the API's limit).
const MAX_STATE_FILE_BYTES: u64 = 8 * 1024 * 1024;

/// `takosumi resolve RUN --note … [--restore-held-state | --attach-state FILE]`.
pub(crate) async fn resolve(client: &Client, args: ResolveArgs, json: bool) -> Outcome {
    let (run, note) = (args.run, args.note.as_str());
    let now = match (args.restore_held_state, &args.attach_state) {
        (true, _) => client.restore_held_state(run, note).await?,
        (false, Some(file)) => attach_state(client, run, note, file).await?,
        (false, None) => client.resolve(run, note).await?,
    };
    show_run(&now, json);
    if !json {
        let action = now.resolution.as_ref().map(|r| &r.action);
        match (action, now.state_version_id) {
            (Some(how), Some(sv)) if how.known() != Some(ResolutionAction::MarkResolved) => {
                eprintln!(
                    "resolved {} ({how}): StateVersion {sv} is now the Capsule's state (generation {}); plan again to see where the provider side stands",
                    now.id,
                    now.state_generation
                        .map_or_else(|| "?".to_owned(), |g| g.to_string())
                )
            }
            _ => eprintln!(
                "resolved {}: recorded as inspected; the Capsule's state is unchanged",
                now.id
            ),
        }
    }
    Ok(0)
}

/// `--attach-state FILE`: a file over the API's limit is refused before it is read; the
/// bytes sent are wiped after the call.
async fn attach_state(
    client: &Client,
    run: RunId,
    note: &str,
    file: &Path,
) -> Result<Run, ClientError> {
    let unreadable = |e: std::io::Error| {
        ClientError::Config(format!(
            "cannot read the state file {}: {e}",
            file.display()
        ))
    };
    let size = std::fs::metadata(file).map_err(unreadable)?.len();
    if size > MAX_STATE_FILE_BYTES {
        return Err(ClientError::Config(format!(
            "the state file {} is {size} bytes; the limit is {MAX_STATE_FILE_BYTES} bytes (8 MiB); nothing was sent",
            file.display()
        )));
    }
    let mut bytes = std::fs::read(file).map_err(unreadable)?;
    let sent = client.attach_state(run, note, &bytes).await;
    bytes.iter_mut().for_each(|b| *b = 0);
    sent.map_err(|e| match e {
        ClientError::Config(m) => {
            ClientError::Config(format!("{m} ({}); nothing was sent", file.display()))
        }
        other => other,
    })
}
