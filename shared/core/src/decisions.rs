//! What the gate decided about a Run, why it holds one, and which path an apply submission
//! took: closed sets the store's conditional updates and the steps branch on; and what a
//! plan held before it planned was shown, which its release is bound to.

use serde::{Deserialize, Serialize};

crate::text_enum! {
    /// The gate's decision on a Run (`runs.gate_decision`; `NULL` until the gate decided).
    pub enum GateDecision("gate decision") {
        /// Held for a person (or a dry-run scan's review); the hold reason says why.
        Held = "held",
        /// Released: the Run goes on (an Apply Run to the apply queue).
        Released = "released",
    }
}

crate::text_enum! {
    /// How an apply submission runs (`runs.apply_mode`; `NULL` on the ordinary paths).
    pub enum ApplyMode("apply mode") {
        /// An Apply Run that runs `apply -auto-approve` with no saved plan (it has no plan Run).
        OneStep = "one_step",
        /// A plan Run an apply submission started: once planned, the gate proposes its Apply Run.
        ProposesApply = "proposes_apply",
        /// That plan Run once the gate proposed its Apply Run.
        ProposedApply = "proposed_apply",
    }
}

crate::text_enum! {
    /// What a Capsule is doing or what was detected about it, as the API shows it: the
    /// first that holds, most pressing first.
    pub enum CapsuleStatus("capsule status") {
        /// An apply holds it.
        Applying = "applying",
        /// A push moved its branch past what was planned.
        Stale = "stale",
        /// Its latest finished drift check found reality differing from what was applied.
        Drifted = "drifted",
        /// None of these.
        Ok = "ok",
    }
}

crate::text_enum! {
    /// How an operator resolved an `unknown_outcome` Run (`runs.resolution_action`).
    pub enum ResolutionAction("resolution action") {
        /// Recorded as inspected; the Capsule's state is unchanged.
        MarkResolved = "mark_resolved",
        /// The state the apply held back became the Capsule's state.
        RestoreHeldState = "restore_held_state",
        /// A state file the operator attached became the Capsule's state.
        AttachState = "attach_state",
    }
}

crate::text_enum! {
    /// Why a Run waits for a person (`runs.hold_reason`): the rule that holds it, or what
    /// stands in for one.
    pub enum HoldReason("hold reason") {
        /// The plan deletes more than the `maxDestroy` rule allows (or an automatic apply
        /// deletes anything).
        MaxDestroy = "max_destroy",
        /// The Rego plan gate denied it.
        PlanGate = "plan_gate",
        /// The approval rule covers it.
        ApprovalRule = "approval_rule",
        /// The estimated monthly cost increase is over the limit, or cannot be estimated.
        CostCheck = "cost_check",
        /// Its submission asked for an approval.
        RequireApproval = "require_approval",
        /// An AI agent submitted it.
        AgentRun = "agent_run",
        /// The approval rule exempts plans only when their dry-run scan is clean; this one's is not.
        DryRunScan = "dry_run_scan",
    }
}

/// What a plan (or drift check) held before it planned was shown to the approver, and so
/// what its release is bound to: the commit its dry-run scan read and the digest of the
/// module tree it read. Written into the hold's details (`runs.hold_details`) by the dry-run
/// check, repeated in the `released` event by the approve step, and read back by the plan
/// step, which refuses to plan anything else. The plan step and the approve step run in
/// different processes, so both read this one type.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShownToApprover {
    /// The commit the scan read.
    #[serde(default)]
    pub commit: Option<String>,
    /// The digest of the module tree the scan read (`None`: the configuration has no
    /// remote modules).
    #[serde(default)]
    pub modules_digest: Option<String>,
}

impl ShownToApprover {
    /// What a hold's details showed; nothing for a hold of another kind (or none).
    pub fn of(details: Option<&serde_json::Value>) -> Self {
        details
            .and_then(|d| Self::deserialize(d).ok())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::ShownToApprover;
    use serde_json::json;

    #[test]
    fn what_an_approver_was_shown_reads_back_from_a_holds_details() {
        let shown = ShownToApprover {
            commit: Some("abc".into()),
            modules_digest: Some("sha256:1".into()),
        };
        let mut details = json!({ "stage": "before_plan", "findings": ["data.external.x"] });
        details.as_object_mut().unwrap().extend(
            serde_json::to_value(&shown)
                .unwrap()
                .as_object()
                .unwrap()
                .clone(),
        );
        assert_eq!(details["modulesDigest"], "sha256:1");
        assert_eq!(ShownToApprover::of(Some(&details)), shown);
        // A hold of another kind (the plan gate's, on an Apply Run) showed neither.
        let gate = json!({ "reasons": ["plan_gate"], "planGate": { "deny": ["no"] } });
        assert_eq!(ShownToApprover::of(Some(&gate)), ShownToApprover::default());
        assert_eq!(ShownToApprover::of(None), ShownToApprover::default());
        // A field of the wrong type is not read as a binding.
        let odd = json!({ "commit": 7 });
        assert_eq!(ShownToApprover::of(Some(&odd)), ShownToApprover::default());
    }
}
