//! The `takosumi` commands for gates and detection: `approve`, `rules`, `drift-check`,
//! `plan-update`, `group`.

use std::time::Duration;

use serde_json::Value;
use takosumi_client::{CapsuleId, Client, ClientError, RunGroupId, RunId, WorkspaceId};

use crate::{EXIT_FAILED, print_json, report_waited, show_run};

/// Approves a held Run.
pub(crate) async fn approve(
    client: &Client,
    run: RunId,
    plan_digest: Option<&str>,
    note: Option<&str>,
    json: bool,
) -> Result<u8, ClientError> {
    let v = client.approve(run, plan_digest, note).await?;
    if json {
        print_json(&v);
    } else {
        let given = &v["approvals"]["given"];
        let required = &v["approvals"]["required"];
        println!(
            "approved {run} ({given} of {required} approvals bound to plan {})",
            v["planDigest"].as_str().unwrap_or("-")
        );
        if given.as_i64() >= required.as_i64() {
            eprintln!("next: the Run is released; takosumi wait {run}");
        }
    }
    Ok(0)
}

/// Sets the rules of a Workspace or a Capsule from a JSON file (`-` for stdin).
pub(crate) async fn set_rules(
    client: &Client,
    ws: Option<WorkspaceId>,
    cap: Option<CapsuleId>,
    file: &str,
    json: bool,
) -> Result<u8, ClientError> {
    let text = if file == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(file)
    }
    .map_err(|e| ClientError::Config(format!("cannot read {file}: {e}")))?;
    let rules: Value = serde_json::from_str(&text)
        .map_err(|e| ClientError::Config(format!("{file} is not JSON: {e}")))?;
    let v = match (ws, cap) {
        (Some(ws), None) => client.set_workspace_rules(ws, &rules).await?,
        (None, Some(cap)) => client.set_capsule_rules(cap, &rules).await?,
        _ => {
            return Err(ClientError::Config(
                "give exactly one of --workspace or --capsule".into(),
            ));
        }
    };
    if json {
        print_json(&v);
    } else {
        println!(
            "rules of {} are now version {}",
            v["scope"].as_str().unwrap_or("?"),
            v["version"]
        );
    }
    Ok(0)
}

/// Starts a drift check of a Capsule.
pub(crate) async fn drift_check(
    client: &Client,
    cap: CapsuleId,
    wait: Option<Duration>,
    json: bool,
) -> Result<u8, ClientError> {
    let run = client.drift_check(cap).await?;
    if let Some(t) = wait {
        let run = client.wait(run.id, t).await?;
        return Ok(report_waited(&run, json));
    }
    show_run(&run, json);
    Ok(0)
}

/// Starts a RunGroup over a Workspace.
pub(crate) async fn start_group(
    client: &Client,
    ws: WorkspaceId,
    drift: bool,
    only_stale: bool,
    json: bool,
) -> Result<u8, ClientError> {
    let v = client.start_group(ws, drift, only_stale).await?;
    if json {
        print_json(&v);
    } else {
        let runs = v["runIds"].as_array().map_or(0, Vec::len);
        println!(
            "run group {} started {runs} run(s)",
            v["id"].as_str().unwrap_or("?")
        );
        eprintln!(
            "next: takosumi group show {}",
            v["id"].as_str().unwrap_or("?")
        );
    }
    Ok(0)
}

/// Shows, approves or applies a RunGroup.
pub(crate) async fn group(
    client: &Client,
    rg: RunGroupId,
    action: Option<&str>,
    json: bool,
) -> Result<u8, ClientError> {
    let v = client.group(rg, action).await?;
    if json {
        print_json(&v);
        return Ok(0);
    }
    let mut failed = false;
    if let Some(runs) = v["runs"].as_array() {
        println!("run group {rg} ({})", v["kind"].as_str().unwrap_or("?"));
        for r in runs {
            println!(
                "  {}  {:<12} {:<16} {}",
                r["id"].as_str().unwrap_or("?"),
                r["kind"].as_str().unwrap_or("?"),
                r["status"].as_str().unwrap_or("?"),
                r["capsuleId"].as_str().unwrap_or("?")
            );
        }
    }
    if let Some(results) = v["results"].as_array() {
        for r in results {
            if let Some(e) = r.get("error") {
                failed = true;
                println!(
                    "  {}  error: {} ({})",
                    r["runId"]
                        .as_str()
                        .or(r["planRunId"].as_str())
                        .unwrap_or("?"),
                    e["message"].as_str().unwrap_or(""),
                    e["code"].as_str().unwrap_or("")
                );
            } else {
                println!("  {}", r);
            }
        }
    }
    Ok(if failed { EXIT_FAILED } else { 0 })
}
