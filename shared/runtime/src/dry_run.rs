//! `exclude_dry_run`: whether a plan (a dry run) plans freely under the approval rule.
//! A plan runs provider code and reads every data source with the run's credentials, so
//! its exemption is subject to the dry-run scan made just before: a plan whose
//! configuration declares an `external`, `aws_lambda_invocation` or writing `http` data
//! source, or that could not be read in full, is held as the real run it may be, before
//! `init` and `plan` run anything, naming each finding by address; the approver sees the
//! scan report in `hold.details`. With `excludeDryRun: false` the approval rule holds
//! every plan. Once a person releases it, the plan runs on the commit they were shown; if
//! the branch moved meanwhile it fails and says to plan again.

//!
//! One implementation for both hosts: the plan handler calls it for the Runs it claims,
//! the API's relay endpoint for a relay worker's (`owner` is the claim either way).

use serde::Serialize;
use serde_json::json;
use takosumi_core::{ActivityKind, EventKind, FailureCode, HoldReason, RunKind, ShownToApprover};
use takosumi_policy::scan::ScanReport;
use takosumi_policy::{ApprovalRule, RuleSet};
use takosumi_store::{Pool, activity, events, rules, runs};

use crate::inputs::EnvError;
use takosumi_store::StoreError;

/// The stage a plan held by its dry-run scan was held at.
const BEFORE_PLAN: &str = "before_plan";

/// A plan held before it planned, as its hold's details record it and the approver reads it.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct BeforePlanHold<'a> {
    reasons: [HoldReason; 1],
    stage: &'static str,
    dry_run: bool,
    message: &'static str,
    findings: &'a [String],
    dry_run_scan: serde_json::Value,
    /// What its release is bound to (read back by the plan step and the approve step).
    #[serde(flatten)]
    shown: &'a ShownToApprover,
    approval_rule: &'a ApprovalRule,
    exclude_dry_run: Option<bool>,
    rule_versions: rules::RuleVersions,
}

/// What the dry-run check decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DryRunDecision {
    /// The plan runs now.
    Proceed,
    /// The Run is held for a person, before anything planned.
    Held,
    /// `owner` no longer holds the Run (the reaper took it back); nothing changed.
    LeaseLost,
}

/// Applies the approval rule's dry-run hold to a plan `owner` holds the claim of.
pub async fn check(
    pool: &Pool,
    owner: &str,
    run: &runs::Run,
    report: &ScanReport,
    commit: &str,
) -> Result<DryRunDecision, EnvError> {
    let modules_digest = report.modules_digest.as_deref();
    // A drift check is a dry run too: the scan decides it as it decides a plan.
    if !matches!(
        run.kind,
        RunKind::Plan | RunKind::Destroy | RunKind::DriftCheck
    ) {
        return Ok(DryRunDecision::Proceed);
    }
    if run.gate_decision == Some(takosumi_core::GateDecision::Released) {
        // A person released it before it planned: it runs the commit and the module tree
        // they were shown (modules are fetched again, so a module source that moved is
        // refused here rather than planned unscanned).
        let shown = ShownToApprover::of(run.hold_details.as_ref());
        if let Some(shown) = &shown.commit
            && shown != commit
        {
            return Err(EnvError::Fail(
                FailureCode::SourceChanged,
                format!(
                    "the branch moved from {shown} to {commit} after this plan was released; nothing was planned. Plan again, and the new commit is scanned and decided afresh"
                ),
            ));
        }
        if let (Some(shown), Some(now)) = (&shown.modules_digest, modules_digest)
            && shown != now
        {
            return Err(EnvError::Fail(
                FailureCode::DependencyChanged,
                format!(
                    "the modules fetched now digest to {now}, not to the {shown} the dry-run scan read and the approver released; nothing was planned. Plan again, and the modules are scanned and decided afresh"
                ),
            ));
        }
        return Ok(DryRunDecision::Proceed);
    }
    let in_force = rules::rules_in_force(pool, run.workspace_id, run.capsule_id).await?;
    let rules = RuleSet::layered(
        in_force.capsule.as_ref().map(|r| &r.rules),
        in_force.workspace.as_ref().map(|r| &r.rules),
    )
    .map_err(|e| EnvError::Step(takosumi_core::StepError::internal(e)))?;
    let Some(reason) = rules.dry_run_hold(report.is_clean()) else {
        return Ok(DryRunDecision::Proceed);
    };
    let Some(approval) = &rules.approval else {
        return Ok(DryRunDecision::Proceed);
    };
    let findings: Vec<String> = report
        .findings
        .iter()
        .map(ToString::to_string)
        .chain(report.unreadable.iter().map(ToString::to_string))
        .collect();
    let why = if reason == HoldReason::DryRunScan {
        "the approval rule exempts plans (excludeDryRun) only when the dry-run scan finds nothing that acts when planned; this one is held as the real run it may be"
    } else {
        "the approval rule covers plans too (excludeDryRun: false)"
    };
    let shown = ShownToApprover {
        commit: Some(commit.to_owned()),
        modules_digest: modules_digest.map(str::to_owned),
    };
    let details = serde_json::to_value(BeforePlanHold {
        reasons: [reason],
        stage: BEFORE_PLAN,
        dry_run: true,
        message: why,
        findings: &findings,
        dry_run_scan: report.to_json(),
        shown: &shown,
        approval_rule: approval,
        exclude_dry_run: rules.exclude_dry_run,
        rule_versions: in_force.versions(),
    })
    .map_err(|e| EnvError::Step(takosumi_core::StepError::internal(e)))?;
    let required = i32::try_from(approval.required.max(1)).unwrap_or(1);
    let mut tx = pool.begin().await.map_err(StoreError::from)?;
    if !runs::hold::hold_claimed(
        &mut tx,
        run.id,
        owner,
        reason,
        &details,
        required,
        &approval.approver_roles,
    )
    .await?
    {
        return Ok(DryRunDecision::LeaseLost);
    }
    let actor = format!("handler:{owner}");
    events::append(
        tx.db(),
        run.id,
        EventKind::Held,
        &actor,
        json!({ "reason": reason, "stage": BEFORE_PLAN, "findings": findings, "commit": shown.commit, "modulesDigest": shown.modules_digest }),
    )
    .await?;
    activity::append(
        tx.db(),
        run.workspace_id,
        ActivityKind::RunHeld,
        &run.id.to_string(),
        &actor,
        json!({ "reason": reason }),
    )
    .await?;
    tx.commit().await.map_err(StoreError::from)?;
    Ok(DryRunDecision::Held)
}
