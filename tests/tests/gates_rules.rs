//! End-to-end (real terraform 1.0.3, the offline null provider, the real API, broker,
//! database and object store): the gates beyond holds and approvals. An apply no rule covers runs in
//! one step (`apply -auto-approve`, nothing saved in between) and its record says so; one a
//! rule covers is planned first and carries out exactly its saved plan. The cost check
//! (`maxMonthlyIncrease`) holds an apply over its limit naming the figures and lists what it
//! could not price. `excludeDryRun` exempts plans from the approval rule only when the
//! dry-run scan is clean. An apply whose plan went stale fails without changing anything.

use std::time::Duration;

use serde_json::{Value, json};
use takosumi_client::{Capsule, NewCapsule, Source};
use takosumi_core::{RunId, RunKind, RunStatus};
use takosumi_tests::{Endpoints, GitRepo, Options, Stack};

/// The rule and Run calls these tests repeat, over [`Stack::call_as`].
struct Api<'a> {
    stack: &'a Stack,
}

impl Api<'_> {
    fn new(stack: &Stack) -> Api<'_> {
        Api { stack }
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Value,
    ) -> anyhow::Result<(u16, Value)> {
        self.stack.call_as(method, path, token, body).await
    }

    async fn rules(&self, path: &str, rules: Value) -> anyhow::Result<Value> {
        let (s, body) = self
            .call("PUT", path, &self.stack.admin_token, rules)
            .await?;
        assert_eq!(s, 200, "{body}");
        Ok(body)
    }

    /// `POST /capsules/{cap}/apply` → (status, Run JSON).
    async fn apply_capsule(
        &self,
        cap: &Capsule,
        token: &str,
        body: Value,
    ) -> anyhow::Result<(u16, Value)> {
        self.call(
            "POST",
            &format!("/api/v1/capsules/{}/apply", cap.id),
            token,
            body,
        )
        .await
    }

    async fn run_json(&self, run: RunId) -> anyhow::Result<Value> {
        let (s, body) = self
            .call(
                "GET",
                &format!("/api/v1/runs/{run}"),
                &self.stack.admin_token,
                Value::Null,
            )
            .await?;
        assert_eq!(s, 200, "{body}");
        Ok(body)
    }
}

async fn capsule_of(
    stack: &Stack,
    repo: &GitRepo,
    ws: Option<takosumi_core::WorkspaceId>,
) -> anyhow::Result<Capsule> {
    let ws = match ws {
        Some(ws) => ws,
        None => {
            stack
                .client
                .create_workspace(&format!(
                    "ws-{}",
                    &uuid::Uuid::new_v4().simple().to_string()[..8]
                ))
                .await?
                .id
        }
    };
    let req = NewCapsule {
        name: format!("nulls-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: "infra/null".into(),
        tool: "terraform".into(),
        vars: serde_json::Map::new(),
    };
    Ok(stack.client.create_capsule(ws, &req).await?)
}

fn bump_revision(repo: &GitRepo, to: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../infra/examples/null/main.tf"
    ))?;
    repo.commit(
        &[(
            "infra/null/main.tf",
            &text.replacen("default = \"1\"", &format!("default = \"{to}\""), 1),
        )],
        "bump",
    )?;
    Ok(())
}

fn run_id(body: &Value) -> anyhow::Result<RunId> {
    Ok(body["id"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no id in {body}"))?
        .parse()?)
}

/// The Apply Run the gate proposed from `plan` (an apply submission planned first).
/// An apply no rule covers runs in one step: one Apply Run with no plan Run, the tool
/// started with `apply -auto-approve` and never with `plan`, the state written and the
/// record saying `applyMode: "one_step"` (gate decision and tool start included). Once a
/// rule covers the Capsule, the same submission is planned first with `-out`, the gate
/// proposes the Apply Run pinned to that saved plan, the rule holds it, and once approved
/// it carries out exactly that plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_uncovered_apply_runs_in_one_step_and_a_covered_one_is_planned_first()
-> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = Api::new(&stack);
    let repo = GitRepo::with_example("null")?;
    let capsule = capsule_of(&stack, &repo, None).await?;

    // Through the client crate (what `takosumi apply-capsule` calls).
    let submitted = stack
        .client
        .apply_capsule(capsule.id, false, Some("one-step-1"))
        .await?;
    assert_eq!(submitted.run.kind, RunKind::Apply, "{submitted:?}");
    assert_eq!(submitted.run.plan_run_id, None);
    assert!(submitted.covered_by.is_empty(), "{submitted:?}");
    let id = submitted.run.id;
    let again = stack
        .client
        .apply_capsule(capsule.id, false, Some("one-step-1"))
        .await?;
    assert_eq!(
        again.run.id, id,
        "the same Idempotency-Key returns the same Run"
    );
    let done = stack.wait(id).await?;
    assert_eq!(done.status, RunStatus::Applied, "{done:?}");
    assert_eq!(done.plan_run_id, None);
    assert!(done.state_version_id.is_some(), "{done:?}");
    assert_eq!(done.state_generation, Some(1));
    assert!(done.source_snapshot.is_some(), "{done:?}");
    assert_eq!(
        done.outputs
            .as_ref()
            .map(|o| o["ids"].as_array().map(Vec::len)),
        Some(Some(2)),
        "{done:?}"
    );
    assert_eq!(
        stack.tool_count("plan"),
        0,
        "a one-step apply saves no plan"
    );
    assert_eq!(
        stack.tool_count_by_run("apply").get(&id.to_string()),
        Some(&1)
    );
    let view = api.run_json(id).await?;
    assert_eq!(view["applyMode"], json!("one_step"), "{view}");
    let events = stack.client.events(id).await?;
    let decision = events
        .iter()
        .find(|e| e.kind == "gate_decision")
        .expect("a gate decision");
    assert_eq!(decision.data["decision"], json!("released"));
    assert_eq!(decision.data["oneStep"], json!(true));
    assert!(
        events.iter().any(|e| e.kind == "tool_started"
            && e.data["command"] == json!("apply")
            && e.data["autoApprove"] == json!(true)
            && e.data["savedPlan"] == json!(false)),
        "{events:?}"
    );

    // A rule covers it now: planned first, the proposal held on its saved plan.
    api.rules(
        &format!("/api/v1/capsules/{}/rules", capsule.id),
        json!({ "maxDestroy": 0 }),
    )
    .await?;
    bump_revision(&repo, "2")?;
    let (s, body) = api
        .apply_capsule(&capsule, &stack.admin_token, json!({}))
        .await?;
    assert_eq!(s, 202, "{body}");
    assert_eq!(body["kind"], json!("plan"), "{body}");
    assert_eq!(body["applyMode"], json!("proposes_apply"), "{body}");
    assert_eq!(body["coveredBy"], json!(["max_destroy"]), "{body}");
    let plan = stack.wait(run_id(&body)?).await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    assert_eq!(stack.tool_count("plan"), 1);
    let apply = stack.proposed_apply(&capsule, plan.id).await?;
    let held = stack.wait(apply).await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    assert_eq!(held.hold.as_ref().unwrap().reason, "max_destroy");
    assert_eq!(held.plan_digest, plan.plan_digest);
    assert_eq!(stack.tool_count("apply"), 1, "a held apply must not run");
    let (approver, _) = api.stack.token("approver", "approver").await?;
    let (s, b) = api
        .stack
        .approve_as(apply, &approver, json!({ "planDigest": plan.plan_digest }))
        .await?;
    assert_eq!(s, 200, "{b}");
    let applied = stack.wait_released(apply).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    assert_eq!(applied.plan_run_id, Some(plan.id));
    assert_eq!(applied.state_generation, Some(2));
    assert!(api.run_json(apply).await?["applyMode"].is_null());
    assert_eq!(
        api.run_json(plan.id).await?["applyMode"],
        json!("proposed_apply")
    );
    // Exactly one apply ran for the pinned path, and it was not a one-step apply.
    let apply_events = stack.client.events(apply).await?;
    assert!(
        apply_events
            .iter()
            .any(|e| e.kind == "pin_checked" && e.data["pin"] == json!("planDigest")),
        "{apply_events:?}"
    );
    assert_eq!(stack.tool_count("apply"), 2);

    // A replayed submission answers what the first did, what covered it included.
    let first = stack
        .client
        .apply_capsule(capsule.id, false, Some("covered-1"))
        .await?;
    assert_eq!(first.run.kind, RunKind::Plan, "{first:?}");
    assert_eq!(first.covered_by, ["max_destroy"], "{first:?}");
    let again = stack
        .client
        .apply_capsule(capsule.id, false, Some("covered-1"))
        .await?;
    assert_eq!(
        (again.run.id, &again.covered_by),
        (first.run.id, &first.covered_by),
        "{again:?}"
    );
    stack.wait(first.run.id).await?;
    stack.stop().await
}

/// A stack whose price catalogue is the built-in one with `null_resource` priced at
/// `price` a month (`None`: left out, so it is unpriced). The built-in catalogue prices
/// only cloud resources no offline provider can plan; a catalogue file is how a team uses
/// its own prices, and how this test gets a priced resource from the null provider.
async fn stack_with_price(price: Option<f64>) -> anyhow::Result<(Stack, tempfile::TempDir)> {
    let mut catalogue: Value = serde_json::from_str(&std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../infra/pricing/catalogue.json"
    ))?)?;
    let resources = catalogue["resources"].as_object_mut().expect("resources");
    match price {
        Some(p) => {
            resources.insert("null_resource".into(), json!({ "monthly": p }));
        }
        None => {
            resources.remove("null_resource");
        }
    }
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("catalogue.json");
    std::fs::write(&path, serde_json::to_vec(&catalogue)?)?;
    let endpoints = Endpoints {
        settings: vec![(
            "TAKOSUMI_PRICING_CATALOGUE".into(),
            path.display().to_string(),
        )],
        ..Endpoints::default()
    };
    Ok((Stack::start_on(Options::default(), &endpoints).await?, dir))
}

/// The cost check: with `null_resource` at 12.50 a month, a plan creating two adds 25.00 a
/// month; over a `maxMonthlyIncrease` of 20 the apply is held (`cost_check`) and the hold
/// names the limit and the figures; under a limit of 30 the next one is released, and both
/// decisions record the figures and the rule version. A limit that is not an amount is
/// refused when it is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cost_check_holds_an_increase_over_the_limit_naming_the_figures() -> anyhow::Result<()> {
    let (stack, _catalogue) = stack_with_price(Some(12.5)).await?;
    let api = Api::new(&stack);
    let repo = GitRepo::with_example("null")?;
    let capsule = capsule_of(&stack, &repo, None).await?;
    let rules_path = format!("/api/v1/capsules/{}/rules", capsule.id);
    let (s, b) = api
        .call(
            "PUT",
            &rules_path,
            &stack.admin_token,
            json!({ "maxMonthlyIncrease": -1 }),
        )
        .await?;
    assert_eq!((s, b["code"].as_str()), (422, Some("invalid_rules")), "{b}");
    // Approver roles are roles, and an agent's approval never counts.
    for (roles, code, status) in [
        (json!(["aprover"]), "invalid_json", 400),
        (json!(["approver", "agent"]), "invalid_rules", 422),
        (json!([]), "invalid_rules", 422),
    ] {
        let (s, b) = api
            .call(
                "PUT",
                &rules_path,
                &stack.admin_token,
                json!({ "approval": { "required": 1, "approverRoles": roles } }),
            )
            .await?;
        assert_eq!(
            (s, b["code"].as_str()),
            (status, Some(code)),
            "{roles}: {b}"
        );
        assert!(
            b["message"]
                .as_str()
                .unwrap_or_default()
                .contains("approver"),
            "{b}"
        );
    }
    let set = api
        .rules(&rules_path, json!({ "maxMonthlyIncrease": 20 }))
        .await?;
    assert_eq!(set["version"], json!(1), "{set}");

    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let held = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let hold = held.hold.clone().expect("hold");
    assert_eq!(hold.reason, "cost_check");
    let cost = &hold.details["costCheck"];
    assert_eq!(cost["limit"], json!(20.0), "{cost}");
    assert_eq!(cost["increase"], json!(25.0), "{cost}");
    assert_eq!(cost["current"], json!(0.0), "{cost}");
    assert_eq!(cost["proposed"], json!(25.0), "{cost}");
    assert_eq!(cost["currency"], json!("USD"), "{cost}");
    assert_eq!(cost["unpriced"], json!([]), "{cost}");
    let message = cost["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("25.00 USD") && message.contains("limit of 20.00 USD"),
        "{message}"
    );
    assert_eq!(stack.tool_count("apply"), 0, "a held apply must not run");
    let events = stack.client.events(held.id).await?;
    let decision = events
        .iter()
        .find(|e| e.kind == "gate_decision")
        .expect("decision");
    assert_eq!(decision.data["decision"], json!("held"));
    assert_eq!(decision.data["ruleVersions"]["capsule"], json!(1));
    assert_eq!(decision.data["cost"]["increase"], json!(25.0));

    // Under a higher limit the same increase is released, with the figures on record.
    api.rules(&rules_path, json!({ "maxMonthlyIncrease": 30 }))
        .await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    let events = stack.client.events(apply.id).await?;
    let decision = events
        .iter()
        .find(|e| e.kind == "gate_decision")
        .expect("decision");
    assert_eq!(decision.data["decision"], json!("released"));
    assert!(
        decision.data["rules"]
            .as_array()
            .is_some_and(|r| r.contains(&json!("cost_check"))),
        "{}",
        decision.data
    );
    assert_eq!(decision.data["ruleVersions"]["capsule"], json!(2));
    assert_eq!(decision.data["cost"]["increase"], json!(25.0));
    assert_eq!(decision.data["cost"]["limit"], json!(30.0));
    stack.stop().await
}

/// Resources the catalogue cannot price are never guessed: they are left out of the
/// figures and listed by address with the reason, on the decision's record. (With only the
/// null provider offline, a plan cannot mix priced and unpriced resources, so the hold
/// message listing them is pinned by the policy crate's unit test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cost_check_lists_unpriced_resources_and_never_guesses() -> anyhow::Result<()> {
    let (stack, _catalogue) = stack_with_price(None).await?;
    let api = Api::new(&stack);
    let repo = GitRepo::with_example("null")?;
    let capsule = capsule_of(&stack, &repo, None).await?;
    api.rules(
        &format!("/api/v1/workspaces/{}/rules", capsule.workspace_id),
        json!({ "maxMonthlyIncrease": 0 }),
    )
    .await?;
    let plan = stack
        .wait(stack.client.plan(capsule.id, None).await?.id)
        .await?;
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    let events = stack.client.events(apply.id).await?;
    let decision = events
        .iter()
        .find(|e| e.kind == "gate_decision")
        .expect("decision");
    let cost = &decision.data["cost"];
    assert_eq!(cost["increase"], json!(0.0), "{cost}");
    assert_eq!(cost["complete"], json!(false), "{cost}");
    let unpriced: Vec<&str> = cost["unpriced"]
        .as_array()
        .expect("unpriced")
        .iter()
        .filter_map(|u| u["address"].as_str())
        .collect();
    assert_eq!(
        unpriced,
        vec!["null_resource.node[0]", "null_resource.node[1]"]
    );
    assert!(
        cost["message"]
            .as_str()
            .unwrap_or_default()
            .contains("null_resource.node[0] (the price catalogue has no price for null_resource)"),
        "{cost}"
    );
    assert_eq!(decision.data["ruleVersions"]["workspace"], json!(1));
    stack.stop().await
}

const ACTING: &str = r#"
data "external" "lookup" {
  program = ["sh", "-c", "echo {}"]
}

module "network" {
  source = "./network"
}
"#;

const HOOK: &str = r#"
data "http" "hook" {
  url    = "https://example.invalid/hook"
  method = "POST"
}
"#;

/// `excludeDryRun`: under an approval rule a plan whose scan is clean plans freely, but one
/// whose configuration declares data sources that act (an `external` one, and an `http`
/// POST in a called module) is held before `init` or `plan` run anything, as the real run it
/// may be, naming each finding by address; the approver sees the scan report on the held
/// Run. A person's release lets it go on (here its providers are not in the offline mirror,
/// so init then fails: proof it ran only after the release). `excludeDryRun: false` makes
/// the approval rule hold every plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exclude_dry_run_exempts_plans_only_when_the_scan_is_clean() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = Api::new(&stack);
    let clean_repo = GitRepo::with_example("null")?;
    let clean = capsule_of(&stack, &clean_repo, None).await?;
    let acting_repo = GitRepo::with_example("null")?;
    acting_repo.commit(
        &[
            ("infra/null/lookup.tf", ACTING),
            ("infra/null/network/main.tf", HOOK),
        ],
        "data sources that act",
    )?;
    let acting = capsule_of(&stack, &acting_repo, Some(clean.workspace_id)).await?;
    api.rules(
        &format!("/api/v1/workspaces/{}/rules", clean.workspace_id),
        json!({ "approval": { "required": 1 }, "excludeDryRun": true }),
    )
    .await?;

    let planned = stack
        .wait(stack.client.plan(clean.id, None).await?.id)
        .await?;
    assert_eq!(
        planned.status,
        RunStatus::Planned,
        "a clean scan plans freely: {planned:?}"
    );
    let (init_before, plan_before) = (stack.tool_count("init"), stack.tool_count("plan"));

    let held = stack
        .wait(stack.client.plan(acting.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    assert_eq!(
        takosumi_store::runs::claim_precheck(&stack.ctx.pool, held.id)
            .await?
            .map(|p| p.lost_claims),
        Some(0),
        "a dry-run hold ends its claim cleanly: it costs the Run none of its attempts"
    );
    let hold = held.hold.clone().expect("hold");
    assert_eq!(hold.reason, "dry_run_scan");
    assert_eq!(hold.details["stage"], json!("before_plan"));
    let addresses: Vec<&str> = hold.details["dryRunScan"]["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter_map(|f| f["address"].as_str())
        .collect();
    assert!(addresses.contains(&"data.external.lookup"), "{addresses:?}");
    assert!(
        addresses.contains(&"module.network.data.http.hook"),
        "{addresses:?}"
    );
    let named = hold.details["findings"].to_string();
    assert!(
        named.contains("data.external.lookup runs a program")
            && named.contains("module.network.data.http.hook sends an HTTP POST request"),
        "{named}"
    );
    assert_eq!(
        (stack.tool_count("init"), stack.tool_count("plan")),
        (init_before, plan_before),
        "a held dry run must not run init or plan"
    );
    // What the approver is shown: the held Run's record carries the scan's findings.
    let view = api.run_json(held.id).await?;
    assert_eq!(view["hold"]["reason"], json!("dry_run_scan"), "{view}");
    assert!(
        view["hold"]["details"]["dryRunScan"]["findings"]
            .as_array()
            .is_some_and(|f| f.len() == 2),
        "{view}"
    );

    let (approver, _) = api.stack.token("approver", "approver").await?;
    let (s, b) = api.stack.approve_as(held.id, &approver, json!({})).await?;
    assert_eq!(s, 200, "{b}");
    let after = stack.wait_released(held.id).await?;
    assert_eq!(after.status, RunStatus::Failed, "{after:?}");
    assert_eq!(
        after.error.as_ref().unwrap().code,
        "init_failed",
        "{after:?}"
    );
    assert_eq!(stack.tool_count("init"), init_before + 1);

    // excludeDryRun: false — the approval rule holds every plan, a clean one included.
    api.rules(
        &format!("/api/v1/capsules/{}/rules", clean.id),
        json!({ "excludeDryRun": false }),
    )
    .await?;
    let held = stack
        .wait(stack.client.plan(clean.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    assert_eq!(held.hold.as_ref().unwrap().reason, "approval_rule");
    assert_eq!(
        held.hold.as_ref().unwrap().details["dryRunScan"]["clean"],
        json!(true)
    );
    let (s, b) = api.stack.approve_as(held.id, &approver, json!({})).await?;
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        stack.wait_released(held.id).await?.status,
        RunStatus::Planned
    );
    stack.stop().await
}

/// A held dry run binds its modules: the scan report and the hold carry the
/// digest of the module tree the scan read, and the release names it. A module source that
/// moves while the plan is held is fetched again after the release, digests differently and
/// is refused (`dependency_changed`) before `init` runs anything: never modules nobody
/// scanned.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_released_dry_run_plans_only_the_modules_its_scan_read() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = Api::new(&stack);
    let module = GitRepo::new(&[("main.tf", "resource \"null_resource\" \"m\" {}\n")])?;
    let repo = GitRepo::with_example("null")?;
    repo.commit(
        &[(
            "infra/null/lookup.tf",
            &format!(
                "data \"external\" \"lookup\" {{\n  program = [\"sh\", \"-c\", \"echo {{}}\"]\n}}\nmodule \"remote\" {{\n  source = \"git::{}?ref=main\"\n}}\n",
                module.url()
            ),
        )],
        "acting, with a remote module",
    )?;
    let cap = capsule_of(&stack, &repo, None).await?;
    api.rules(
        &format!("/api/v1/workspaces/{}/rules", cap.workspace_id),
        json!({ "approval": { "required": 1 }, "excludeDryRun": true }),
    )
    .await?;
    let held = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let details = held.hold.clone().unwrap().details;
    let scanned = details["modulesDigest"]
        .as_str()
        .expect("the hold binds the modules");
    assert!(!scanned.is_empty());
    assert_eq!(details["dryRunScan"]["modulesDigest"], json!(scanned));
    let init_before = stack.tool_count("init");

    // The module's branch moves while the plan waits for a person.
    module.commit(
        &[("extra.tf", "resource \"null_resource\" \"unscanned\" {}\n")],
        "moved",
    )?;
    let (approver, _) = api.stack.token("approver", "approver").await?;
    let (s, b) = api.stack.approve_as(held.id, &approver, json!({})).await?;
    assert_eq!(s, 200, "{b}");
    let after = stack.wait_released(held.id).await?;
    assert_eq!(after.status, RunStatus::Failed, "{after:?}");
    let error = after.error.clone().unwrap();
    assert_eq!(error.code, "dependency_changed", "{error:?}");
    assert!(error.message.contains(scanned), "{}", error.message);
    assert_eq!(
        stack.tool_count("init"),
        init_before,
        "init ran on unscanned modules"
    );
    let events = stack.client.events(held.id).await?;
    let released = events
        .iter()
        .find(|e| e.kind == "released")
        .expect("released");
    assert_eq!(released.data["modulesDigest"], json!(scanned));
    stack.stop().await
}

/// "A drift check is a dry run": the approval rule's dry-run decision covers it as it covers
/// a plan. Under `excludeDryRun: false` a drift check is held before it plans, with its
/// scan report and the commit it would check; once released it checks and reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dry_run_decision_covers_drift_checks() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = Api::new(&stack);
    let repo = GitRepo::with_example("null")?;
    let cap = capsule_of(&stack, &repo, None).await?;
    let (_, applied) = stack.plan_and_apply(cap.id).await?;
    api.rules(
        &format!("/api/v1/capsules/{}/rules", cap.id),
        json!({ "approval": { "required": 1 }, "excludeDryRun": false }),
    )
    .await?;
    let plans_before = stack.tool_count("plan");
    let held = stack
        .wait(stack.client.drift_check(cap.id).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let hold = held.hold.clone().unwrap();
    assert_eq!(hold.reason, "approval_rule");
    assert_eq!(hold.details["stage"], json!("before_plan"));
    assert_eq!(hold.details["dryRunScan"]["clean"], json!(true));
    assert_eq!(
        hold.details["commit"],
        json!(applied.source_snapshot.clone().unwrap().commit)
    );
    assert_eq!(
        stack.tool_count("plan"),
        plans_before,
        "a held check planned"
    );
    let (approver, _) = api.stack.token("approver", "approver").await?;
    let (s, b) = api.stack.approve_as(held.id, &approver, json!({})).await?;
    assert_eq!(s, 200, "{b}");
    let checked = stack.wait_released(held.id).await?;
    assert_eq!(
        (checked.status, checked.drift),
        (RunStatus::Planned, Some(false)),
        "{checked:?}"
    );
    stack.stop().await
}

/// A Rego plan gate that denies creating anything.
const NO_CREATES: &str = r#"package takosumi
deny contains msg if {
    some rc in input.resource_changes
    "create" in rc.change.actions
    msg := sprintf("%s would be created", [rc.address])
}
"#;

/// The seed: "When a user starts an install … the Run records autoApplyRequested: continue
/// from plan to apply if the plan finishes cleanly. A plan with deletions, an approval
/// policy, a billing check, or another policy gate still stops for review." Installs ask
/// for it on the plan submission (the CLI's `install`, the dashboard's Install): a clean one
/// applies; deletions, an approval rule, the cost check and a plan gate each stop the
/// proposed apply for review. An agent cannot ask for it, nor can a destroy plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_install_applies_a_clean_plan_and_stops_for_review_otherwise() -> anyhow::Result<()> {
    let (stack, _catalogue) = stack_with_price(Some(12.5)).await?;
    let api = Api::new(&stack);
    let install = |cap: Capsule| {
        let stack = &stack;
        async move {
            let (s, b) = stack
                .call(
                    "POST",
                    &format!("/api/v1/capsules/{}/plan", cap.id),
                    json!({ "autoApplyRequested": true }),
                )
                .await?;
            assert_eq!(s, 202, "{b}");
            assert_eq!(b["autoApplyRequested"], json!(true), "{b}");
            let plan = stack.wait(run_id(&b)?).await?;
            assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
            let apply = stack
                .wait(stack.proposed_apply(&cap, plan.id).await?)
                .await?;
            anyhow::Ok(apply)
        }
    };

    let repo = GitRepo::with_example("null")?;
    let clean = capsule_of(&stack, &repo, None).await?;
    let ws = clean.workspace_id;
    let applied = install(clean.clone()).await?;
    assert_eq!(
        applied.status,
        RunStatus::Applied,
        "a clean install applies: {applied:?}"
    );

    bump_revision(&repo, "2")?;
    let deleting = install(clean).await?;
    assert_eq!(deleting.status, RunStatus::Held, "{deleting:?}");
    assert_eq!(deleting.hold.as_ref().unwrap().reason, "max_destroy");

    for (rules, reason) in [
        (json!({ "approval": { "required": 1 } }), "approval_rule"),
        (json!({ "maxMonthlyIncrease": 20 }), "cost_check"),
        (json!({ "planGate": NO_CREATES }), "plan_gate"),
    ] {
        let repo = GitRepo::with_example("null")?;
        let cap = capsule_of(&stack, &repo, Some(ws)).await?;
        api.rules(&format!("/api/v1/capsules/{}/rules", cap.id), rules)
            .await?;
        let held = install(cap).await?;
        assert_eq!(held.status, RunStatus::Held, "{reason}: {held:?}");
        assert_eq!(held.hold.as_ref().unwrap().reason, reason, "{held:?}");
    }

    let repo = GitRepo::with_example("null")?;
    let cap = capsule_of(&stack, &repo, Some(ws)).await?;
    let (agent, _) = stack.token("copilot", "agent").await?;
    let (s, b) = api
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/plan", cap.id),
            &agent,
            json!({ "autoApplyRequested": true }),
        )
        .await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (403, Some("auto_apply_person_only")),
        "{b}"
    );
    let (s, b) = api
        .call(
            "DELETE",
            &format!("/api/v1/capsules/{}", cap.id),
            &stack.admin_token,
            json!({ "autoApplyRequested": true }),
        )
        .await?;
    assert_eq!(
        (s, b["code"].as_str()),
        (422, Some("invalid_auto_apply")),
        "{b}"
    );
    stack.stop().await
}

/// A stale proposal: two applies submitted under an approval rule are each planned first
/// and held; the second is approved and applied, so the first one's plan no longer matches
/// the state. Approving the first then fails it (`state_generation_changed`) without
/// starting the tool or writing any state, and its record says to make the proposal again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_proposal_fails_without_changing_anything() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = Api::new(&stack);
    let repo = GitRepo::with_example("null")?;
    let capsule = capsule_of(&stack, &repo, None).await?;
    api.rules(
        &format!("/api/v1/capsules/{}/rules", capsule.id),
        json!({ "approval": { "required": 1 } }),
    )
    .await?;
    let (op_token, _) = api.stack.token("requester", "operator").await?;
    let (approver, _) = api.stack.token("approver", "approver").await?;

    let mut proposals = Vec::new();
    for _ in 0..2 {
        let (s, body) = api.apply_capsule(&capsule, &op_token, json!({})).await?;
        assert_eq!(s, 202, "{body}");
        assert_eq!(body["coveredBy"], json!(["approval_rule"]), "{body}");
        let plan = stack.wait(run_id(&body)?).await?;
        assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
        let apply = stack.proposed_apply(&capsule, plan.id).await?;
        let held = stack.wait(apply).await?;
        assert_eq!(held.status, RunStatus::Held, "{held:?}");
        assert_eq!(held.hold.as_ref().unwrap().reason, "approval_rule");
        proposals.push(held);
    }
    let (s, b) = api
        .stack
        .approve_as(proposals[0].id, &op_token, json!({}))
        .await?;
    assert_eq!((s, b["code"].as_str()), (403, Some("self_approval")), "{b}");

    api.stack
        .approve_as(proposals[1].id, &approver, json!({}))
        .await?;
    let applied = stack.wait_released(proposals[1].id).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    let sv = applied.state_version_id;
    assert!(sv.is_some());

    api.stack
        .approve_as(proposals[0].id, &approver, json!({}))
        .await?;
    let stale = stack.wait_released(proposals[0].id).await?;
    assert_eq!(stale.status, RunStatus::Failed, "{stale:?}");
    let error = stale.error.clone().expect("error");
    assert_eq!(error.code, "state_generation_changed");
    assert!(
        error
            .message
            .contains("submit the apply again, and it is planned afresh"),
        "the seed's words: {}",
        error.message
    );
    assert_eq!(stale.state_version_id, None);
    assert_eq!(
        stack.tool_count("apply"),
        1,
        "a stale plan must not be applied"
    );
    assert!(
        !stack
            .tool_count_by_run("apply")
            .contains_key(&proposals[0].id.to_string())
    );
    // Nothing changed: the Capsule's state is still the one the other apply wrote.
    let cap = api
        .call(
            "GET",
            &format!("/api/v1/capsules/{}", capsule.id),
            &stack.admin_token,
            Value::Null,
        )
        .await?
        .1;
    assert_eq!(cap["currentStateVersionId"], json!(sv), "{cap}");
    stack.stop().await
}

/// An agent's apply submission is held before anything plans (planning runs provider code
/// with the server's credentials); once a person releases it, it plans, and the apply it
/// proposes, the agent's own, is held again with the saved plan: two approvals. A person's
/// submission with `requireApproval` is planned first the same way and its proposed apply
/// waits for a person although no rule covers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_and_require_approval_submissions_are_planned_first_and_held() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let api = Api::new(&stack);
    let repo = GitRepo::with_example("null")?;
    let capsule = capsule_of(&stack, &repo, None).await?;
    let (agent, _) = api.stack.token("copilot", "agent").await?;
    let (approver, _) = api.stack.token("human", "approver").await?;

    let (s, body) = api.apply_capsule(&capsule, &agent, json!({})).await?;
    assert_eq!(s, 202, "{body}");
    assert_eq!(body["kind"], json!("plan"), "{body}");
    assert_eq!(body["coveredBy"], json!(["agent_run"]), "{body}");
    let plan_id = run_id(&body)?;
    let held = stack.wait(plan_id).await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    assert_eq!(held.hold.as_ref().unwrap().reason, "agent_run");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        stack.tool_count("plan"),
        0,
        "an agent's plan ran before a release"
    );
    let (s, b) = api.stack.approve_as(plan_id, &approver, json!({})).await?;
    assert_eq!(s, 200, "{b}");
    let planned = stack.wait_released(plan_id).await?;
    assert_eq!(planned.status, RunStatus::Planned, "{planned:?}");
    let apply = stack.proposed_apply(&capsule, plan_id).await?;
    let held = stack.wait(apply).await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    assert_eq!(held.hold.as_ref().unwrap().reason, "agent_run");
    assert_eq!(stack.tool_count("apply"), 0);
    let (s, b) = api
        .stack
        .approve_as(
            apply,
            &approver,
            json!({ "planDigest": planned.plan_digest }),
        )
        .await?;
    assert_eq!(s, 200, "{b}");
    let applied = stack.wait_released(apply).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    assert_eq!(applied.plan_run_id, Some(plan_id));

    let (s, body) = api
        .apply_capsule(
            &capsule,
            &stack.admin_token,
            json!({ "requireApproval": true }),
        )
        .await?;
    assert_eq!(s, 202, "{body}");
    assert_eq!(body["coveredBy"], json!(["require_approval"]), "{body}");
    let plan = stack.wait(run_id(&body)?).await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack.proposed_apply(&capsule, plan.id).await?;
    let held = stack.wait(apply).await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    assert_eq!(held.hold.as_ref().unwrap().reason, "require_approval");
    api.stack.approve_as(apply, &approver, json!({})).await?;
    assert_eq!(stack.wait_released(apply).await?.status, RunStatus::Applied);
    // Bad input changes nothing.
    let (s, b) = api
        .apply_capsule(&capsule, &stack.admin_token, json!({ "autoApprove": true }))
        .await?;
    assert_eq!((s, b["code"].as_str()), (400, Some("invalid_json")), "{b}");
    stack.stop().await
}
