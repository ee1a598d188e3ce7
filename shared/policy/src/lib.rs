//! Gate rules and their evaluation: `max_destroy`, a Rego `plan_gate` (evaluated with
//! regorus on the saved plan's `show -json` plus Run metadata), approval rules (N distinct
//! approvers of given roles, never the requester), `require_approval` on a submission, and
//! agent runs (held before planning and again before applying, unless exempted). This
//! crate decides; it does no I/O, and its input is the saved plan, never printed text.
#![deny(missing_docs)]

pub mod scan;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use takosumi_core::{Changes, HoldReason, Role};

/// The package a plan gate policy declares; its `deny` set holds the apply.
pub const PLAN_GATE_PACKAGE: &str = "takosumi";

/// Rules set on a Workspace or a Capsule. Absent fields set nothing; a Capsule's rules
/// override its Workspace's field by field.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleSet {
    /// Hold an apply whose saved plan deletes more than this many resources
    /// (a replacement counts as a deletion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_destroy: Option<i64>,
    /// A Rego policy (`package takosumi`); every `deny` message holds the apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_gate: Option<String>,
    /// Applies need approval by distinct people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalRule>,
    /// Token names of agents whose runs take the ordinary path (recorded when used).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agent_exemptions: Vec<String>,
    /// The cost check: hold an apply whose estimated monthly cost increase (the plan's
    /// `proposed - current`, in the price catalogue's currency) is over this amount.
    /// Resources the catalogue cannot price are listed with the figures, never guessed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_monthly_increase: Option<f64>,
    /// Whether plans (dry runs) are exempt from the approval rule. A plan runs provider
    /// code and reads every data source with the run's credentials, so the exemption is
    /// subject to the dry-run scan ([`scan`]): a plan whose configuration declares a data
    /// source that acts, or cannot be read in full, is held as the real run it may be.
    /// `false`: the approval rule holds every plan before it plans. Unset: `true` (an
    /// approval rule is about applies), still subject to the scan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude_dry_run: Option<bool>,
}

/// N-of-M approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApprovalRule {
    /// Distinct approvals needed (at least 1).
    pub required: u32,
    /// Roles whose approvals count (default: `approver`, `admin`; never `agent`).
    #[serde(default = "default_approver_roles")]
    pub approver_roles: Vec<Role>,
}

/// Whose approvals count where no approval rule names roles: approvers and admins.
pub fn default_approver_roles() -> Vec<Role> {
    vec![Role::Approver, Role::Admin]
}

/// A rule set that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The Rego policy does not compile (the message is the compiler's).
    #[error("the plan_gate policy does not compile: {0}")]
    Compile(String),
    /// A field is out of range.
    #[error("{0}")]
    Invalid(String),
    /// Evaluation failed (a runtime error in the policy).
    #[error("the plan_gate policy failed to evaluate: {0}")]
    Eval(String),
}

impl PolicyError {
    /// Rule errors are final: fix the rules.
    pub fn retryable(&self) -> bool {
        false
    }
}

impl RuleSet {
    /// Checks a rule set before it is stored: a policy that fails to compile is rejected
    /// when it is set, not when an apply meets it.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if let Some(n) = self.max_destroy
            && n < 0
        {
            return Err(PolicyError::Invalid("maxDestroy must be 0 or more".into()));
        }
        if let Some(a) = &self.approval {
            if a.required == 0 || a.required > 20 {
                return Err(PolicyError::Invalid(
                    "approval.required must be between 1 and 20".into(),
                ));
            }
            // An agent's Runs are held for a person, so an agent's approval never counts.
            if a.approver_roles.is_empty() || a.approver_roles.contains(&Role::Agent) {
                return Err(PolicyError::Invalid(
                    "approval.approverRoles must name one or more of viewer, operator, approver and admin (an agent's approval never counts)".into(),
                ));
            }
        }
        if let Some(p) = &self.plan_gate {
            compile(p)?;
        }
        if let Some(m) = self.max_monthly_increase
            && !(m.is_finite() && (0.0..1e9).contains(&m))
        {
            return Err(PolicyError::Invalid(
                "maxMonthlyIncrease must be an amount from 0 up to 1e9 (the price catalogue's currency, per month)".into(),
            ));
        }
        Ok(())
    }

    /// The rules in force for a Capsule from their stored JSON: the Capsule's own over its
    /// Workspace's. A stored set that no longer reads is an error, never "no rules": reading
    /// it as empty would release what a rule holds.
    pub fn layered(
        capsule: Option<&Value>,
        workspace: Option<&Value>,
    ) -> Result<RuleSet, PolicyError> {
        let read = |v: Option<&Value>| -> Result<RuleSet, PolicyError> {
            v.map(|v| {
                serde_json::from_value(v.clone())
                    .map_err(|e| PolicyError::Invalid(format!("stored rules do not read: {e}")))
            })
            .transpose()
            .map(Option::unwrap_or_default)
        };
        Ok(read(capsule)?.over(&read(workspace)?))
    }

    /// This rule set over `base`: each field set here wins.
    pub fn over(&self, base: &RuleSet) -> RuleSet {
        RuleSet {
            max_destroy: self.max_destroy.or(base.max_destroy),
            plan_gate: self.plan_gate.clone().or_else(|| base.plan_gate.clone()),
            approval: self.approval.clone().or_else(|| base.approval.clone()),
            agent_exemptions: if self.agent_exemptions.is_empty() {
                base.agent_exemptions.clone()
            } else {
                self.agent_exemptions.clone()
            },
            max_monthly_increase: self.max_monthly_increase.or(base.max_monthly_increase),
            exclude_dry_run: self.exclude_dry_run.or(base.exclude_dry_run),
        }
    }

    /// Whether any rule could hold an apply.
    pub fn covers_applies(&self) -> bool {
        !self.covering_rules().is_empty()
    }

    /// The rules that cover an apply (could hold it): an apply one of them covers is
    /// planned first with `-out` and decided on its saved plan; an apply none covers runs
    /// in one step (`apply -auto-approve`).
    pub fn covering_rules(&self) -> Vec<HoldReason> {
        let mut rules = Vec::new();
        if self.max_destroy.is_some() {
            rules.push(HoldReason::MaxDestroy);
        }
        if self.plan_gate.is_some() {
            rules.push(HoldReason::PlanGate);
        }
        if self.approval.is_some() {
            rules.push(HoldReason::ApprovalRule);
        }
        if self.max_monthly_increase.is_some() {
            rules.push(HoldReason::CostCheck);
        }
        rules
    }

    /// How the rules treat a plan (dry run) before it plans, given its dry-run scan:
    /// `None` when it plans freely, or the hold reason (`approval_rule` when the approval
    /// rule covers dry runs, `dry_run_scan` when the exemption does not hold because the
    /// scan found a data source that acts or something it could not read).
    pub fn dry_run_hold(&self, scan_clean: bool) -> Option<HoldReason> {
        self.approval.as_ref()?;
        if self.exclude_dry_run == Some(false) {
            Some(HoldReason::ApprovalRule)
        } else if !scan_clean {
            Some(HoldReason::DryRunScan)
        } else {
            None
        }
    }
}

fn engine(policy: &str) -> Result<regorus::Engine, PolicyError> {
    let mut engine = regorus::Engine::new();
    engine
        .add_policy("plan_gate.rego".to_owned(), policy.to_owned())
        .map_err(|e| PolicyError::Compile(e.to_string()))?;
    Ok(engine)
}

fn compile(policy: &str) -> Result<(), PolicyError> {
    let mut e = engine(policy)?;
    // Evaluating against an empty input surfaces undefined-reference errors now.
    e.set_input(regorus::Value::new_object());
    e.eval_rule(format!("data.{PLAN_GATE_PACKAGE}.deny"))
        .map(|_| ())
        .map_err(|e| PolicyError::Compile(e.to_string()))
}

/// Evaluates a plan gate: the `deny` messages (empty = allowed).
pub fn plan_gate_denials(policy: &str, input: &Value) -> Result<Vec<String>, PolicyError> {
    let mut e = engine(policy)?;
    let input = regorus::Value::from_json_str(&input.to_string())
        .map_err(|e| PolicyError::Eval(e.to_string()))?;
    e.set_input(input);
    let out = e
        .eval_rule(format!("data.{PLAN_GATE_PACKAGE}.deny"))
        .map_err(|e| PolicyError::Eval(e.to_string()))?;
    let json: Value = serde_json::to_value(&out).map_err(|e| PolicyError::Eval(e.to_string()))?;
    let mut messages: Vec<String> = match json {
        Value::Array(items) => items
            .into_iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .collect(),
        Value::String(s) => vec![s],
        Value::Null => vec![],
        Value::Object(m) if m.is_empty() => vec![],
        other => vec![other.to_string()],
    };
    messages.retain(|m| m != "\"<undefined>\"" && m != "<undefined>");
    messages.sort();
    Ok(messages)
}

/// What the gate knows about the apply it decides on.
#[derive(Debug, Clone)]
pub struct GateInput<'a> {
    /// Change counts of the saved plan.
    pub changes: Changes,
    /// The saved plan's `show -json` (only needed for a plan gate).
    pub plan_json: Option<&'a Value>,
    /// Run metadata given to the Rego policy as `input.run`.
    pub run: Value,
    /// The submission asked for approval.
    pub require_approval: bool,
    /// An AI agent submitted it, and no exemption covers it.
    pub agent: bool,
    /// It continues a plan automatically (autoApplyRequested): deletions stop it.
    pub auto_apply: bool,
    /// The plan's cost estimate (needed for the cost check; `None` when the plan kept no
    /// resource summary, which holds an apply the cost check covers).
    pub cost: Option<&'a takosumi_cost::CostEstimate>,
}

/// The gate's decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// No rule holds it.
    Release {
        /// What was checked (for the audit record).
        checked: Vec<String>,
    },
    /// Held for a person: the first reason and every rule's details.
    Hold {
        /// `max_destroy`, `plan_gate`, `approval_rule`, `require_approval`, `agent_run`.
        reason: HoldReason,
        /// Every finding, for the approver.
        details: Value,
        /// Approvals needed to release it.
        approvals_required: u32,
        /// Roles whose approvals count.
        approver_roles: Vec<Role>,
    },
}

/// What the cost check records: the limit, the estimate's figures, every resource the
/// catalogue could not price (left out of the figures, never guessed), and a sentence naming
/// them for the approver.
pub fn cost_finding(limit: f64, est: &takosumi_cost::CostEstimate) -> Value {
    let unpriced: Vec<Value> = est
        .unpriced
        .iter()
        .map(|u| json!({ "address": u.address, "type": u.resource_type, "reason": u.reason }))
        .collect();
    let mut message = format!(
        "the estimated monthly cost increase is {:.2} {cur} ({:.2} -> {:.2} {cur} per {}), over the limit of {limit:.2} {cur}",
        est.total.delta,
        est.total.current,
        est.total.proposed,
        est.period,
        cur = est.currency
    );
    if !est.unpriced.is_empty() {
        let names: Vec<String> = est
            .unpriced
            .iter()
            .map(|u| format!("{} ({})", u.address, u.reason))
            .collect();
        message.push_str(&format!(
            "; not priced, so left out of these figures: {}",
            names.join(", ")
        ));
    }
    if est.truncated {
        message.push_str("; the plan has more resources than the estimate covers");
    }
    json!({
        "limit": limit,
        "increase": est.total.delta,
        "current": est.total.current,
        "proposed": est.total.proposed,
        "currency": est.currency,
        "period": est.period,
        "complete": est.complete,
        "unpriced": unpriced,
        "message": message,
    })
}

/// Decides on an apply.
pub fn decide(rules: &RuleSet, input: &GateInput<'_>) -> Result<Decision, PolicyError> {
    let mut findings = serde_json::Map::new();
    let mut reasons: Vec<HoldReason> = Vec::new();
    let mut checked = Vec::new();
    if let Some(limit) = rules.max_destroy {
        checked.push(HoldReason::MaxDestroy.to_string());
        if input.changes.destroy > limit {
            reasons.push(HoldReason::MaxDestroy);
            findings.insert(
                "maxDestroy".into(),
                json!({ "limit": limit, "destroy": input.changes.destroy }),
            );
        }
    }
    if let Some(policy) = &rules.plan_gate {
        checked.push(HoldReason::PlanGate.to_string());
        let mut gate_input = input.plan_json.cloned().unwrap_or_else(|| json!({}));
        if let Value::Object(m) = &mut gate_input {
            m.insert("run".into(), input.run.clone());
            m.insert(
                "changes".into(),
                serde_json::to_value(input.changes).unwrap_or_default(),
            );
            // The plan's cost estimate, when the gate made one (`input.cost.total.delta`).
            if let Some(cost) = input.cost {
                m.insert(
                    "cost".into(),
                    serde_json::to_value(cost).unwrap_or_default(),
                );
            }
        }
        let denials = plan_gate_denials(policy, &gate_input)?;
        if !denials.is_empty() {
            reasons.push(HoldReason::PlanGate);
            findings.insert("planGate".into(), json!({ "deny": denials }));
        }
    }
    if let Some(limit) = rules.max_monthly_increase {
        checked.push(HoldReason::CostCheck.to_string());
        match input.cost {
            Some(est) if est.total.delta <= limit => {}
            Some(est) => {
                reasons.push(HoldReason::CostCheck);
                findings.insert("costCheck".into(), cost_finding(limit, est));
            }
            None => {
                reasons.push(HoldReason::CostCheck);
                findings.insert(
                    "costCheck".into(),
                    json!({ "limit": limit, "message": "this plan kept no resource summary, so its cost cannot be estimated; plan again" }),
                );
            }
        }
    }
    if input.auto_apply && input.changes.destroy > 0 && !reasons.contains(&HoldReason::MaxDestroy) {
        reasons.push(HoldReason::MaxDestroy);
        findings.insert(
            "maxDestroy".into(),
            json!({ "limit": 0, "destroy": input.changes.destroy, "autoApply": "an automatic apply stops for review when the plan deletes anything" }),
        );
    }
    if input.require_approval {
        reasons.push(HoldReason::RequireApproval);
        findings.insert("requireApproval".into(), json!(true));
    }
    if input.agent {
        reasons.push(HoldReason::AgentRun);
        findings.insert("agentRun".into(), json!(true));
    }
    if let Some(a) = &rules.approval {
        checked.push(HoldReason::ApprovalRule.to_string());
        reasons.push(HoldReason::ApprovalRule);
        findings.insert(
            "approvalRule".into(),
            json!({ "required": a.required, "approverRoles": a.approver_roles }),
        );
    }
    let Some(first) = reasons.first().copied() else {
        return Ok(Decision::Release { checked });
    };
    let required = rules.approval.as_ref().map_or(1, |a| a.required.max(1));
    let roles = rules
        .approval
        .as_ref()
        .map_or_else(default_approver_roles, |a| a.approver_roles.clone());
    findings.insert("reasons".into(), json!(reasons));
    Ok(Decision::Hold {
        reason: first,
        details: Value::Object(findings),
        approvals_required: required,
        approver_roles: roles,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Capsule's stored rules win field by field over the Workspace's; a stored set
    /// that no longer reads is an error, never an empty (releasing) rule set.
    #[test]
    fn layered_rules_prefer_the_capsule_and_refuse_unreadable_sets() {
        let ws = json!({"maxDestroy": 5, "maxMonthlyIncrease": 100.0});
        let cap = json!({"maxDestroy": 1});
        let r = RuleSet::layered(Some(&cap), Some(&ws)).unwrap();
        assert_eq!(r.max_destroy, Some(1));
        assert_eq!(r.max_monthly_increase, Some(100.0));
        assert_eq!(RuleSet::layered(None, None).unwrap().max_destroy, None);
        let bad = json!({"maxDestroy": "many"});
        assert!(RuleSet::layered(Some(&bad), Some(&ws)).is_err());
        assert!(RuleSet::layered(None, Some(&json!({"unknownRule": 1}))).is_err());
    }

    fn input(destroy: i64) -> GateInput<'static> {
        GateInput {
            changes: Changes {
                add: 1,
                change: 0,
                destroy,
            },
            plan_json: None,
            run: json!({}),
            require_approval: false,
            agent: false,
            auto_apply: false,
            cost: None,
        }
    }

    #[test]
    fn no_rules_release() {
        assert!(matches!(
            decide(&RuleSet::default(), &input(5)).unwrap(),
            Decision::Release { .. }
        ));
    }

    #[test]
    fn max_destroy_holds_only_above_the_limit() {
        let rules = RuleSet {
            max_destroy: Some(1),
            ..RuleSet::default()
        };
        assert!(matches!(
            decide(&rules, &input(1)).unwrap(),
            Decision::Release { .. }
        ));
        match decide(&rules, &input(2)).unwrap() {
            Decision::Hold {
                reason, details, ..
            } => {
                assert_eq!(reason, "max_destroy");
                assert_eq!(details["maxDestroy"]["destroy"], 2);
            }
            other => panic!("{other:?}"),
        }
    }

    const POLICY: &str = r#"package takosumi
deny contains msg if {
    some rc in input.resource_changes
    rc.type == "null_resource"
    "delete" in rc.change.actions
    msg := sprintf("%s may not be deleted", [rc.address])
}
"#;

    #[test]
    fn rego_deny_and_allow() {
        let plan = json!({ "resource_changes": [
            { "address": "null_resource.a", "type": "null_resource", "change": { "actions": ["delete", "create"] } }
        ]});
        let denials = plan_gate_denials(POLICY, &plan).unwrap();
        assert_eq!(
            denials,
            vec!["null_resource.a may not be deleted".to_owned()]
        );
        let clean = json!({ "resource_changes": [
            { "address": "null_resource.a", "type": "null_resource", "change": { "actions": ["create"] } }
        ]});
        assert!(plan_gate_denials(POLICY, &clean).unwrap().is_empty());
        let rules = RuleSet {
            plan_gate: Some(POLICY.into()),
            ..RuleSet::default()
        };
        let i = GateInput {
            plan_json: Some(&plan),
            ..input(1)
        };
        assert!(matches!(
            decide(&rules, &i).unwrap(),
            Decision::Hold {
                reason: HoldReason::PlanGate,
                ..
            }
        ));
    }

    #[test]
    fn a_policy_that_does_not_compile_is_rejected_when_set() {
        let rules = RuleSet {
            plan_gate: Some("package takosumi\ndeny contains msg if {".into()),
            ..RuleSet::default()
        };
        assert!(matches!(rules.validate(), Err(PolicyError::Compile(_))));
        let ok = RuleSet {
            plan_gate: Some(POLICY.into()),
            ..RuleSet::default()
        };
        ok.validate().unwrap();
    }

    #[test]
    fn approver_roles_are_roles_and_never_an_agent() {
        let read = |roles: Value| {
            serde_json::from_value::<RuleSet>(
                json!({ "approval": { "required": 1, "approverRoles": roles } }),
            )
        };
        let rules = read(json!(["operator", "admin"])).unwrap();
        assert_eq!(
            rules.approval.as_ref().unwrap().approver_roles,
            [Role::Operator, Role::Admin]
        );
        rules.validate().unwrap();
        let default: RuleSet =
            serde_json::from_value(json!({ "approval": { "required": 1 } })).unwrap();
        assert_eq!(
            default.approval.unwrap().approver_roles,
            [Role::Approver, Role::Admin]
        );
        // A name that is not a role does not read, naming the roles there are.
        let err = read(json!(["aprover"])).unwrap_err().to_string();
        assert!(err.contains("aprover") && err.contains("approver"), "{err}");
        for refused in [json!([]), json!(["admin", "agent"])] {
            let err = read(refused.clone())
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(err.contains("approverRoles"), "{refused}: {err}");
        }
    }

    #[test]
    fn approval_and_agent_holds() {
        let rules = RuleSet {
            approval: Some(ApprovalRule {
                required: 2,
                approver_roles: default_approver_roles(),
            }),
            ..RuleSet::default()
        };
        match decide(&rules, &input(0)).unwrap() {
            Decision::Hold {
                reason,
                approvals_required,
                ..
            } => {
                assert_eq!(reason, "approval_rule");
                assert_eq!(approvals_required, 2);
            }
            other => panic!("{other:?}"),
        }
        let agent = GateInput {
            agent: true,
            ..input(0)
        };
        assert!(matches!(
            decide(&RuleSet::default(), &agent).unwrap(),
            Decision::Hold {
                reason: HoldReason::AgentRun,
                ..
            }
        ));
    }

    #[test]
    fn automatic_applies_stop_on_deletions() {
        let clean = GateInput {
            auto_apply: true,
            ..input(0)
        };
        assert!(matches!(
            decide(&RuleSet::default(), &clean).unwrap(),
            Decision::Release { .. }
        ));
        let deleting = GateInput {
            auto_apply: true,
            ..input(1)
        };
        match decide(&RuleSet::default(), &deleting).unwrap() {
            Decision::Hold {
                reason, details, ..
            } => {
                assert_eq!(reason, "max_destroy");
                assert_eq!(details["maxDestroy"]["limit"], 0);
            }
            other => panic!("{other:?}"),
        }
    }

    fn estimate(delta: f64, unpriced: &[&str]) -> takosumi_cost::CostEstimate {
        use takosumi_cost::{Amounts, CostEstimate, UnpricedResource};
        CostEstimate {
            currency: "USD".into(),
            period: "month".into(),
            catalogue_as_of: "test".into(),
            catalogue_note: String::new(),
            resources: vec![],
            unpriced: unpriced
                .iter()
                .map(|a| UnpricedResource {
                    address: (*a).into(),
                    resource_type: "aws_thing".into(),
                    actions: vec!["create".into()],
                    reason: "the price catalogue has no price for aws_thing".into(),
                })
                .collect(),
            total: Amounts {
                current: 10.0,
                proposed: 10.0 + delta,
                delta,
            },
            complete: unpriced.is_empty(),
            truncated: false,
        }
    }

    /// The cost check holds only above the limit, names the figures, and lists every
    /// unpriced resource by address and reason (left out of the figures, never guessed); a
    /// plan with no summary is held rather than waved through.
    #[test]
    fn cost_check_holds_over_the_limit_and_lists_unpriced() {
        let rules = RuleSet {
            max_monthly_increase: Some(50.0),
            ..RuleSet::default()
        };
        assert_eq!(rules.covering_rules(), vec!["cost_check"]);
        let under = estimate(50.0, &["aws_thing.a"]);
        let i = GateInput {
            cost: Some(&under),
            ..input(0)
        };
        assert!(matches!(
            decide(&rules, &i).unwrap(),
            Decision::Release { .. }
        ));
        let over = estimate(60.5, &["aws_thing.a", "module.m.aws_thing.b"]);
        let i = GateInput {
            cost: Some(&over),
            ..input(0)
        };
        match decide(&rules, &i).unwrap() {
            Decision::Hold {
                reason, details, ..
            } => {
                assert_eq!(reason, "cost_check");
                let c = &details["costCheck"];
                assert_eq!(c["increase"], json!(60.5));
                assert_eq!(c["limit"], json!(50.0));
                assert_eq!(c["unpriced"].as_array().unwrap().len(), 2);
                assert_eq!(
                    c["message"],
                    json!(
                        "the estimated monthly cost increase is 60.50 USD (10.00 -> 70.50 USD per month), over the limit of 50.00 USD; not priced, so left out of these figures: aws_thing.a (the price catalogue has no price for aws_thing), module.m.aws_thing.b (the price catalogue has no price for aws_thing)"
                    )
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decide(&rules, &input(0)).unwrap(),
            Decision::Hold {
                reason: HoldReason::CostCheck,
                ..
            }
        ));
        let bad = RuleSet {
            max_monthly_increase: Some(f64::NAN),
            ..RuleSet::default()
        };
        assert!(bad.validate().is_err());
    }

    /// A plan gate reads the cost estimate as `input.cost`.
    #[test]
    fn rego_reads_the_cost_estimate() {
        let policy = "package takosumi\ndeny contains msg if {\n    input.cost.total.delta > 5\n    msg := sprintf(\"costs %v more a month\", [input.cost.total.delta])\n}\n";
        let rules = RuleSet {
            plan_gate: Some(policy.into()),
            ..RuleSet::default()
        };
        rules.validate().unwrap();
        let plan = json!({});
        let est = estimate(7.5, &[]);
        let i = GateInput {
            plan_json: Some(&plan),
            cost: Some(&est),
            ..input(0)
        };
        match decide(&rules, &i).unwrap() {
            Decision::Hold { details, .. } => {
                assert_eq!(
                    details["planGate"]["deny"],
                    json!(["costs 7.5 more a month"])
                );
            }
            other => panic!("{other:?}"),
        }
        let cheap = estimate(1.0, &[]);
        let i = GateInput {
            plan_json: Some(&plan),
            cost: Some(&cheap),
            ..input(0)
        };
        assert!(matches!(
            decide(&rules, &i).unwrap(),
            Decision::Release { .. }
        ));
    }

    /// `excludeDryRun`: only an approval rule covers dry runs; exempt (the default) only
    /// when the scan is clean, never with `excludeDryRun: false`.
    #[test]
    fn dry_runs_are_exempt_only_when_the_scan_is_clean() {
        let approval = Some(ApprovalRule {
            required: 1,
            approver_roles: default_approver_roles(),
        });
        assert_eq!(RuleSet::default().dry_run_hold(false), None);
        let rules = RuleSet {
            approval: approval.clone(),
            ..RuleSet::default()
        };
        assert_eq!(rules.dry_run_hold(true), None);
        assert_eq!(rules.dry_run_hold(false), Some(HoldReason::DryRunScan));
        let strict = RuleSet {
            approval,
            exclude_dry_run: Some(false),
            ..RuleSet::default()
        };
        assert_eq!(strict.dry_run_hold(true), Some(HoldReason::ApprovalRule));
    }

    #[test]
    fn capsule_rules_override_workspace_rules() {
        let ws = RuleSet {
            max_destroy: Some(0),
            approval: Some(ApprovalRule {
                required: 1,
                approver_roles: default_approver_roles(),
            }),
            ..RuleSet::default()
        };
        let cap = RuleSet {
            max_destroy: Some(5),
            ..RuleSet::default()
        };
        let eff = cap.over(&ws);
        assert_eq!(eff.max_destroy, Some(5));
        assert!(eff.approval.is_some());
    }
}
