//! `takosumi evidence …` and `takosumi verify`: signed audit evidence from the command
//! line. `evidence export` writes a Workspace's chain and the public keys as one
//! bundle; `verify` checks signatures, the chain's links and every apply's plan link,
//! either fetching the chain from the API or, with `--bundle`, offline from an exported
//! bundle (no URL, no token). What is checked is `takosumi_evidence::verify_chain`; this
//! module only fetches, reads files and prints.
//!
//! Exit codes: 0 verified; 1 verification failed (the message names the statement and the
//! check that broke) or the API refused; 2 a file could not be read or the arguments are
//! wrong.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use serde_json::json;
use takosumi_client::evidence::{Bundle, PublishedKeys, Report, VerifyError};
use takosumi_client::{Client, ClientError, RunId, WorkspaceId};
use takosumi_evidence::{KeyRing, Verified, verify_run_in_chain};

use super::render::{self, print_json};
use super::{EXIT_FAILED, EXIT_USAGE, Outcome};

/// `takosumi evidence …`
#[derive(Subcommand)]
pub(crate) enum EvidenceCommand {
    /// Write a Workspace's signed statements and the server's public keys as one JSON
    /// bundle, for `takosumi verify --bundle FILE` anywhere, offline.
    Export {
        /// The Workspace (`ws_…`).
        #[arg(long, value_name = "WS")]
        workspace: WorkspaceId,
        /// Write the bundle here instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Print a Run's signed statement (the envelope and the statement it carries).
    Show {
        /// The Run (`run_…`).
        #[arg(value_name = "RUN")]
        run: RunId,
    },
    /// Print the public keys the server signs and signed statements with.
    Keys,
}

/// `takosumi verify [RUN] [--workspace WS] [--bundle FILE] [--keys FILE]`
#[derive(Args)]
pub(crate) struct VerifyArgs {
    /// The Run whose statement to check (with its Workspace's whole chain).
    #[arg(value_name = "RUN", required_unless_present_any = ["workspace", "bundle"])]
    pub(crate) run: Option<RunId>,
    /// Check this Workspace's whole chain.
    #[arg(long, value_name = "WS", conflicts_with = "run")]
    pub(crate) workspace: Option<WorkspaceId>,
    /// Check an exported bundle offline, without the API.
    #[arg(long, value_name = "FILE")]
    pub(crate) bundle: Option<PathBuf>,
    /// Trust only these public keys (the JSON `takosumi evidence keys --json` prints)
    /// rather than the ones the API (or the bundle) carries.
    #[arg(long, value_name = "FILE")]
    pub(crate) keys: Option<PathBuf>,
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<T, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not {what}: {e}", path.display()))
}

fn trusted_keys(path: Option<&Path>) -> Result<Option<KeyRing>, String> {
    let Some(path) = path else { return Ok(None) };
    let keys: PublishedKeys = read_json(path, "a public key list")?;
    keys.to_ring()
        .map(Some)
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn usage(message: &str) -> u8 {
    eprintln!("error: {message}");
    EXIT_USAGE
}

/// `takosumi verify --bundle FILE [RUN]`: needs no API, so it runs before a token is
/// looked for.
pub(crate) fn verify_offline(args: &VerifyArgs, json: bool) -> u8 {
    let Some(path) = &args.bundle else {
        return usage("verify_offline needs --bundle");
    };
    let bundle: Bundle = match read_json(path, "an evidence bundle") {
        Ok(b) => b,
        Err(e) => return usage(&e),
    };
    if let Some(ws) = args.workspace
        && ws.to_string() != bundle.workspace_id
    {
        return failed(
            &VerifyError::WrongWorkspace {
                position: 0,
                run_id: "the bundle".into(),
                found: bundle.workspace_id.clone(),
                expected: ws.to_string(),
            },
            json,
        );
    }
    let keys = match trusted_keys(args.keys.as_deref()) {
        Ok(k) => k,
        Err(e) => return usage(&e),
    };
    let outcome = bundle
        .verify(keys.as_ref())
        .and_then(|report| checked_run(report, args.run));
    report(outcome, json)
}

/// `takosumi verify RUN` / `--workspace WS` against the API.
pub(crate) async fn verify_online(client: &Client, args: &VerifyArgs, json: bool) -> Outcome {
    let keys = match trusted_keys(args.keys.as_deref()) {
        Ok(k) => k,
        Err(e) => return Ok(usage(&e)),
    };
    // The Run's own statement names its Workspace; the chain is fetched whole, so the
    // links before and after the Run are checked too.
    let (ws, served) = match (args.run, args.workspace) {
        (Some(run), _) => {
            let s = client.run_evidence(run).await?;
            match s.workspace_id.parse::<WorkspaceId>() {
                Ok(ws) => (ws, Some(s)),
                Err(_) => {
                    return Ok(failed(
                        &VerifyError::Malformed {
                            position: s.sequence,
                            problem: format!("the API names Workspace {:?}", s.workspace_id),
                        },
                        json,
                    ));
                }
            }
        }
        (None, Some(ws)) => (ws, None),
        (None, None) => return Ok(usage("name a Run, or --workspace WS")),
    };
    let (chain, head) = client.workspace_evidence(ws).await?;
    let ring = match keys {
        Some(k) => k,
        None => match client.evidence_keys().await?.to_ring() {
            Ok(k) => k,
            Err(e) => return Ok(failed(&VerifyError::Keys(e.to_string()), json)),
        },
    };
    let envelopes: Vec<_> = chain.into_iter().map(|s| s.envelope).collect();
    let ws_text = ws.to_string();
    let run_text = args.run.map(|r| r.to_string());
    let outcome = verify_run_in_chain(
        &ws_text,
        &envelopes,
        head.as_ref(),
        &ring,
        run_text.as_deref(),
        served.as_ref().map(|s| &s.envelope),
    );
    Ok(report(outcome, json))
}

/// The report, and the Run's statement when a Run was named.
fn checked_run(
    report: Report,
    run: Option<RunId>,
) -> Result<(Report, Option<Verified>), VerifyError> {
    let v = match run {
        Some(run) => Some(report.require(&run.to_string())?.clone()),
        None => None,
    };
    Ok((report, v))
}

fn failed(err: &VerifyError, json: bool) -> u8 {
    render::verify_failed(err, json);
    EXIT_FAILED
}

fn report(outcome: Result<(Report, Option<Verified>), VerifyError>, json: bool) -> u8 {
    match outcome {
        Ok((report, run)) => {
            render::verified(&report, run.as_ref(), json);
            0
        }
        Err(e) => failed(&e, json),
    }
}

/// `takosumi evidence …`
pub(crate) async fn run(client: &Client, command: EvidenceCommand, json: bool) -> Outcome {
    match command {
        EvidenceCommand::Export { workspace, out } => {
            let bundle = client.export_evidence(workspace).await?;
            let text = serde_json::to_string_pretty(&bundle).map_err(|e| {
                ClientError::Config(format!("the bundle could not be encoded: {e}"))
            })?;
            match out {
                Some(path) => {
                    if let Err(e) = std::fs::write(&path, format!("{text}\n")) {
                        return Ok(usage(&format!("cannot write {}: {e}", path.display())));
                    }
                    if !json {
                        eprintln!(
                            "wrote {} statement(s) of {workspace} and {} key(s) to {}",
                            bundle.statements.len(),
                            bundle.keys.len(),
                            path.display()
                        );
                    }
                }
                None => println!("{text}"),
            }
            Ok(0)
        }
        EvidenceCommand::Show { run } => {
            let s = client.run_evidence(run).await?;
            let statement: serde_json::Value = s
                .envelope
                .payload_bytes()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(serde_json::Value::Null);
            print_json(&json!({ "signed": s, "statement": statement }));
            Ok(0)
        }
        EvidenceCommand::Keys => {
            let keys = client.evidence_keys().await?;
            if json {
                print_json(&keys);
            } else {
                for k in &keys.keys {
                    println!(
                        "{}  {}  {}{}",
                        k.key_id,
                        k.algorithm,
                        k.public_key,
                        if k.current { "  (current)" } else { "" }
                    );
                }
            }
            Ok(0)
        }
    }
}
