//! End-to-end (real API, Postgres, RabbitMQ, the S3 server and terraform): the wire
//! contract. The API serializes its own views (borrowed from the row, for speed) and its
//! clients (the CLI, the dashboard, the tests) read them through `takosumi_wire`'s types;
//! a field the API sends that the client types do not name lands in `extra`, where nothing
//! reads it typed. Here every field of a real answer must be one the client types know.

use serde_json::{Value, json};
use takosumi_client::{
    ApplySubmitted, Approved, Capsule, CapsuleList, GroupResults, GroupStarted, NewCapsule,
    RulesAnswer, Run, RunGroup, RunPage, Source,
};
use takosumi_core::{GroupKind, RunStatus, SandboxMode};
use takosumi_tests::{GitRepo, Stack};

const CONFIG: &str = r#"
variable "region" { type = string }
output "vpc" { value = "vpc-${var.region}" }
"#;

/// Decodes `body` as `T` and returns what the client type did not know.
fn unknown_fields<T, F>(what: &str, body: &Value, extra: F) -> anyhow::Result<Vec<String>>
where
    T: serde::de::DeserializeOwned,
    F: Fn(&T) -> Vec<String>,
{
    let decoded: T = serde_json::from_value(body.clone())
        .map_err(|e| anyhow::anyhow!("{what} does not decode: {e}: {body}"))?;
    Ok(extra(&decoded))
}

fn run_extra(r: &Run) -> Vec<String> {
    r.extra.keys().cloned().collect()
}

fn capsule_extra(c: &Capsule) -> Vec<String> {
    c.extra.keys().cloned().collect()
}

/// The keys of `raw` (at any depth) that are gone once it is decoded as `T` and encoded
/// again: the fields `T` does not name. (A type that keeps unknown fields in `extra` writes
/// them back: check its `extra` instead.)
fn unnamed_keys<T>(what: &str, raw: &Value) -> anyhow::Result<(T, Vec<String>)>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    fn walk(raw: &Value, back: &Value, at: &str, out: &mut Vec<String>) {
        match (raw, back) {
            (Value::Object(r), Value::Object(b)) => {
                for (k, v) in r {
                    match b.get(k) {
                        Some(bv) => walk(v, bv, &format!("{at}.{k}"), out),
                        None => out.push(format!("{at}.{k}")),
                    }
                }
            }
            (Value::Array(r), Value::Array(b)) => {
                for (i, (v, bv)) in r.iter().zip(b).enumerate() {
                    walk(v, bv, &format!("{at}[{i}]"), out);
                }
            }
            _ => {}
        }
    }
    let decoded: T = serde_json::from_value(raw.clone())
        .map_err(|e| anyhow::anyhow!("{what} does not decode: {e}: {raw}"))?;
    let back = serde_json::to_value(&decoded)?;
    let mut out = Vec::new();
    walk(raw, &back, what, &mut out);
    Ok((decoded, out))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_field_the_api_answers_with_is_one_the_client_types_name() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    let repo = GitRepo::new(&[("infra/net/main.tf", CONFIG)])?;
    let ws = stack.client.create_workspace("contract").await?;
    let cap = stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "net".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra/net".into(),
                tool: "terraform".into(),
                vars: json!({ "region": "eu" }).as_object().cloned().unwrap(),
            },
        )
        .await?;
    let plan = stack
        .wait(stack.client.plan(cap.id, None).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");

    let get = |path: String| {
        let stack = &stack;
        async move {
            let (status, body) = stack.call("GET", &path, Value::Null).await?;
            anyhow::ensure!(status == 200, "{path}: {status} {body}");
            anyhow::Ok(body)
        }
    };
    let mut unknown = Vec::new();
    for run in [plan.id, apply.id] {
        let path = format!("/api/v1/runs/{run}");
        let body = get(path.clone()).await?;
        // A Run's answer names every field, null where it does not apply: this reads all.
        assert!(
            body["resolution"].is_null() && body["canceledBy"].is_null(),
            "{body}"
        );
        for field in unknown_fields::<Run, _>(&path, &body, run_extra)? {
            unknown.push(format!("{path}: {field}"));
        }
    }
    let path = format!("/api/v1/workspaces/{}/runs", ws.id);
    let page = get(path.clone()).await?;
    let decoded: RunPage = serde_json::from_value(page.clone())?;
    assert_eq!(decoded.runs.len(), 2, "{page}");
    for (i, run) in decoded.runs.iter().enumerate() {
        for field in run_extra(run) {
            unknown.push(format!("{path} runs[{i}]: {field}"));
        }
    }
    let path = format!("/api/v1/capsules/{}", cap.id);
    let own = get(path.clone()).await?;
    for field in unknown_fields::<Capsule, _>(&path, &own, capsule_extra)? {
        unknown.push(format!("{path}: {field}"));
    }
    let path = format!("/api/v1/workspaces/{}/capsules", ws.id);
    let list = get(path.clone()).await?;
    let decoded: CapsuleList = serde_json::from_value(list.clone())?;
    assert_eq!(decoded.capsules.len(), 1, "{list}");
    for field in capsule_extra(&decoded.capsules[0]) {
        unknown.push(format!("{path} capsules[0]: {field}"));
    }
    assert!(
        unknown.is_empty(),
        "fields the API sends that the client types do not name (add them to takosumi_wire): {unknown:?}"
    );

    // The gate and group answers: rules, an approval, a RunGroup started, read and acted on.
    let rules_path = format!("/api/v1/capsules/{}/rules", cap.id);
    let (s, body) = stack
        .call_as(
            "PUT",
            &rules_path,
            &stack.admin_token,
            json!({ "approval": { "required": 1 } }),
        )
        .await?;
    assert_eq!(s, 200, "{body}");
    let (answer, missing) = unnamed_keys::<RulesAnswer>("PUT rules", &body)?;
    assert_eq!(answer.version, Some(1), "{body}");
    unknown.extend(missing);
    let (_, missing) = unnamed_keys::<RulesAnswer>("GET rules", &get(rules_path).await?)?;
    unknown.extend(missing);

    let (_, requester) = stack.token("requester", "operator").await?;
    let (approver, _) = stack.token("approver", "approver").await?;
    let planned = stack.wait(requester.plan(cap.id, None).await?.id).await?;
    let held = stack
        .wait(requester.apply(planned.id, None).await?.id)
        .await?;
    assert_eq!(held.status, RunStatus::Held, "{held:?}");
    let (s, body) = stack.approve_as(held.id, &approver, json!({})).await?;
    assert_eq!(s, 200, "{body}");
    let (approved, missing) = unnamed_keys::<Approved>("approve", &body)?;
    unknown.extend(missing);
    unknown.extend(
        run_extra(&approved.run)
            .into_iter()
            .map(|k| format!("approve: {k}")),
    );
    assert_eq!(
        (approved.approvals.given, approved.approvals.required),
        (1, 1),
        "{body}"
    );
    stack.wait(held.id).await?;

    let (s, body) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/apply", cap.id),
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{body}");
    let (submitted, missing) = unnamed_keys::<ApplySubmitted>("apply capsule", &body)?;
    unknown.extend(missing);
    unknown.extend(
        run_extra(&submitted.run)
            .into_iter()
            .map(|k| format!("apply capsule: {k}")),
    );
    assert_eq!(submitted.covered_by, ["approval_rule"], "{body}");
    stack.wait(submitted.run.id).await?;

    let (s, body) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{}/plan-update", ws.id),
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{body}");
    let (started, missing) = unnamed_keys::<GroupStarted>("plan-update", &body)?;
    unknown.extend(missing);
    assert_eq!(started.run_ids.len(), 1, "{body}");
    // Closed sets read as the values this build knows, not as text it kept.
    assert_eq!(started.kind.known(), Some(GroupKind::PlanUpdate), "{body}");
    stack.wait(started.run_ids[0]).await?;
    let group_path = format!("/api/v1/run-groups/{}", started.id);
    let (group, missing) = unnamed_keys::<RunGroup>("run group", &get(group_path.clone()).await?)?;
    unknown.extend(missing);
    assert_eq!(group.kind.known(), Some(GroupKind::PlanUpdate));
    for run in &group.runs {
        assert_eq!(
            run.sandbox.as_ref().and_then(|s| s.known()),
            Some(SandboxMode::Bubblewrap),
            "{run:?}"
        );
        unknown.extend(
            run_extra(run)
                .into_iter()
                .map(|k| format!("run group: {k}")),
        );
    }
    let (s, body) = stack
        .call("POST", &format!("{group_path}/apply"), json!({}))
        .await?;
    assert_eq!(s, 202, "{body}");
    let (applied, missing) = unnamed_keys::<GroupResults>("group apply", &body)?;
    unknown.extend(missing);
    assert!(
        applied.results.len() == 1 && applied.results[0].apply_run_id.is_some(),
        "{body}"
    );
    let (s, body) = stack
        .call("POST", &format!("{group_path}/apply"), json!({}))
        .await?;
    assert_eq!(s, 202, "{body}");
    let (again, missing) = unnamed_keys::<GroupResults>("group apply again", &body)?;
    unknown.extend(missing);
    assert!(
        again.results.iter().all(|r| r.error.is_some()),
        "a plan already proposed is refused, with its code: {body}"
    );
    assert!(
        unknown.is_empty(),
        "fields the API sends that the client types do not name (add them to takosumi_wire): {unknown:?}"
    );

    // One view of a Capsule whichever answer carries it.
    assert_eq!(list["capsules"][0], own, "{list}");
    let shown = &decoded.capsules[0];
    assert_eq!(
        (
            shown.status.as_str(),
            shown.drift,
            shown.pool.as_deref(),
            shown.var_names.as_slice()
        ),
        ("ok", None, None, ["region".to_owned()].as_slice()),
        "{shown:?}"
    );
    stack.stop().await
}
