//! The outcome of `takosumi verify`: what was verified (the chain, and the named Run's
//! statement with the plan it carries out), or the check that broke.

use serde_json::json;
use takosumi_client::evidence::{Report, VerifyError};
use takosumi_evidence::Verified;

use super::print_json;

/// Prints the check that broke: JSON on stdout, or a line on stderr.
pub(crate) fn verify_failed(err: &VerifyError, json: bool) {
    if json {
        print_json(&json!({
            "verified": false, "check": err.check(), "position": err.position(),
            "message": err.to_string(),
        }));
    } else {
        eprintln!("verification FAILED: {err}");
    }
}

/// The line that names a verified Run's statement and the plan it carries out.
fn run_line(report: &Report, v: &Verified) -> String {
    let p = &v.statement.predicate;
    let mut line = format!(
        "{}: statement #{} ({} {}), signed by {}",
        p.run_id, v.position, p.kind, p.result.status, v.key_id
    );
    if let Some(plan) = &p.plan_run {
        let plan_pos = report.find(&plan.run_id).map_or(0, |s| s.position);
        line.push_str(&format!(
            "; carries out plan Run {} (statement #{plan_pos}), plan digest {}",
            plan.run_id,
            p.plan_digest.as_deref().unwrap_or("none")
        ));
    } else if let Some(d) = &p.plan_digest {
        line.push_str(&format!("; plan digest {d}"));
    }
    line
}

/// Prints a verified chain, and the named Run's statement.
pub(crate) fn verified(report: &Report, run: Option<&Verified>, json: bool) {
    if json {
        print_json(&json!({
            "verified": true,
            "workspaceId": report.workspace_id,
            "statements": report.statements.len(),
            "head": report.head(),
            "keyIds": report.key_ids(),
            "run": run.map(|v| json!({
                "runId": v.run_id(), "position": v.position, "digest": v.digest, "keyId": v.key_id,
                "statement": v.statement,
            })),
        }));
        return;
    }
    println!(
        "verified: {} statement(s) of {}, signed by {}; head sha256:{}",
        report.statements.len(),
        report.workspace_id,
        report.key_ids().join(", "),
        report.head().unwrap_or_default()
    );
    if let Some(v) = run {
        println!("{}", run_line(report, v));
    }
}
