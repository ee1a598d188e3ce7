//! `takosumi`: the command-line client of the Takosumi API. It mirrors the API:
//! every command is one call (or a call plus a wait), prints the result in a compact human
//! form or, with `--json`, as JSON, and exits 0 on success, 1 when the API returned an error
//! or a waited-for (watched, followed) Run ended `failed`/`canceled`/`unknown_outcome`, 2 on
//! usage errors. The commands are in [`cli`].

mod cli;

use std::process::ExitCode;

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = cli::Cli::parse();
    if let Some(code) = cli::run_without_token(&args).await {
        return ExitCode::from(code);
    }
    let client = cli::config::client(args.url, args.token);
    let outcome = cli::run(&client, args.command, args.json).await;
    ExitCode::from(outcome.unwrap_or_else(|err| cli::render::report_error(&err)))
}
