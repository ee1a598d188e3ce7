//! The command line as clap reads it: defaults, global flags, and ids that are refused
//! before anything is sent.

use clap::CommandFactory;
use clap::error::ErrorKind;
use serde_json::json;
use takosumi_client::{CapsuleId, RunId, WorkspaceId};

use super::capsules::{CapsuleCommand, CapsuleCreateArgs, Tool};
use super::*;

#[test]
fn cli_definition_is_consistent() {
    Cli::command().debug_assert();
}

fn capsule_create(cli: Cli) -> CapsuleCreateArgs {
    let Command::Capsule {
        command: CapsuleCommand::Create(args),
    } = cli.command
    else {
        panic!("wrong command");
    };
    args
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
    let args = capsule_create(cli);
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
    let Command::Wait(args) = cli.command else {
        panic!("wrong command")
    };
    assert_eq!((args.run, args.timeout_secs), (run, 600));

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
    let Command::Plan(args) = cli.command else {
        panic!("wrong command")
    };
    assert_eq!(args.capsule.capsule, cap);
    assert!(args.submit.wait);
    assert_eq!(args.submit.idempotency_key.as_deref(), Some("k1"));

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
    let args = capsule_create(cli);
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
