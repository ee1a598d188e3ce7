//! The OpenAPI 3.1 document at `GET /api/v1/openapi.json`: it lists every route
//! of the API's table with its method and nothing else (a route mounted without a doc
//! fails here), every error `code`, and is a well-formed 3.1 document whose `$ref`s all
//! resolve; and the API keeps it: schemathesis, run against a real stack with it, finds no
//! 5xx and no answer that violates the document.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value, json};
use takosumi_client::{NewCapsule, NewToken, Source};
use takosumi_tests::{GitRepo, Options, Stack, Steps};

async fn api_stack() -> anyhow::Result<Stack> {
    Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await
}

async fn fetch(stack: &Stack) -> anyhow::Result<Value> {
    let resp = reqwest::get(format!("{}/api/v1/openapi.json", stack.api_url)).await?;
    assert_eq!(resp.status(), 200, "the document is public");
    Ok(resp.json().await?)
}

/// The operations a document lists, as `METHOD path`.
fn operations(doc: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        for (method, _) in item.as_object().into_iter().flatten() {
            if ["get", "put", "post", "delete", "patch", "head", "options"]
                .contains(&method.as_str())
            {
                out.insert(format!("{} {path}", method.to_uppercase()));
            }
        }
    }
    out
}

/// A `#/…` JSON pointer into `doc`.
fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    doc.pointer(reference.strip_prefix('#')?)
}

fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get("$ref") {
                out.push(r);
            }
            m.values().for_each(|v| refs(v, out));
        }
        Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// Every JSON API route of the table is in the document with its method, nothing else is;
/// the dashboard's pages are not; every error code is in the error schema's enum; the
/// document is OpenAPI 3.1 and every `$ref` in it resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_document_lists_every_route_and_error_code() -> anyhow::Result<()> {
    let stack = api_stack().await?;
    let doc = fetch(&stack).await?;

    let undocumented: Vec<String> = takosumi_api::endpoints()
        .iter()
        .filter(|e| e.doc.is_none())
        .map(|e| format!("{} {}", e.method, e.path))
        .collect();
    assert!(
        undocumented.is_empty(),
        "routes mounted without `.doc(…)` (so missing from the OpenAPI document): {undocumented:?}"
    );
    let api: BTreeSet<String> = takosumi_api::endpoints()
        .iter()
        .filter(|e| e.doc.as_ref().is_some_and(|d| d.is_api()))
        .map(|e| format!("{} {}", e.method, e.path))
        .collect();
    let listed = operations(&doc);
    let missing: Vec<_> = api.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&api).collect();
    assert!(
        missing.is_empty(),
        "routes missing from the document: {missing:?}"
    );
    assert!(extra.is_empty(), "operations no route serves: {extra:?}");
    assert!(listed.contains("GET /api/v1/runs/{run}"));
    assert!(listed.contains("GET /api/v1/openapi.json"));
    // The dashboard (HTML behind a session) is not part of the JSON API.
    for page in [
        "GET /",
        "GET /sign-in",
        "GET /runs/{run}",
        "GET /assets/{file}",
    ] {
        assert!(!listed.contains(page), "{page} is a dashboard page");
    }

    // Unique operation ids.
    let mut ids = BTreeSet::new();
    for (_, item) in doc["paths"].as_object().into_iter().flatten() {
        for (_, op) in item.as_object().into_iter().flatten() {
            let id = op["operationId"].as_str().unwrap_or_default().to_owned();
            assert!(!id.is_empty(), "an operation without an id: {op}");
            assert!(ids.insert(id.clone()), "operationId {id} used twice");
        }
    }

    // Every error code, as an enum of the error body.
    let codes: BTreeSet<&str> = doc["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for code in takosumi_api::ErrorCode::ALL {
        assert!(codes.contains(code.as_str()), "{code:?} missing: {codes:?}");
    }
    assert_eq!(codes.len(), takosumi_api::ErrorCode::ALL.len());
    assert_eq!(
        doc["components"]["schemas"]["ErrorBody"]["properties"]["code"]["$ref"],
        "#/components/schemas/ErrorCode"
    );

    // OpenAPI 3.1, security schemes, and every reference resolves.
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "{}",
        doc["openapi"]
    );
    let schemes = &doc["components"]["securitySchemes"];
    for s in ["bearerToken", "poolToken", "webhookSignature"] {
        assert!(schemes[s].is_object(), "security scheme {s}: {schemes}");
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(!all.is_empty());
    let dangling: Vec<_> = all.iter().filter(|r| resolve(&doc, r).is_none()).collect();
    assert!(dangling.is_empty(), "unresolved $refs: {dangling:?}");
    // A route's access shows as its security requirement.
    assert_eq!(
        doc["paths"]["/api/v1/runs/{run}"]["get"]["security"],
        json!([{ "bearerToken": [] }])
    );
    assert_eq!(
        doc["paths"]["/api/v1/relay/claim"]["post"]["security"],
        json!([{ "poolToken": [] }])
    );
    assert!(doc["paths"]["/api/v1/evidence/keys"]["get"]["security"].is_null());

    stack.stop().await
}

/// What axum itself refuses (a body over a route's limit, a path segment that is not
/// UTF-8) answers with the API's error body, as the document says of every error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn axum_rejections_answer_the_error_body() -> anyhow::Result<()> {
    let stack = api_stack().await?;
    let big = format!("{{\"name\": \"{}\"}}", "a".repeat(3 * 1024 * 1024));
    let (s, body) = stack
        .request(
            "POST",
            "/api/v1/workspaces",
            Some(&stack.admin_token),
            Some(&big),
        )
        .await?;
    assert_eq!(s, 413, "{body}");
    assert_eq!(body["code"], "payload_too_large", "{body}");
    assert!(body["message"].is_string(), "{body}");
    let (s, body) = stack
        .request("GET", "/api/v1/runs/%FF", Some(&stack.admin_token), None)
        .await?;
    assert_eq!(s, 400, "{body}");
    assert!(body["code"].is_string(), "{body}");
    stack.stop().await
}

fn schemathesis() -> PathBuf {
    if let Ok(p) = std::env::var("TAKOSUMI_SCHEMATHESIS") {
        return p.into();
    }
    let cache =
        std::env::var("TAKOSUMI_CACHE").unwrap_or_else(|_| "/var/tmp/takosumi-cache".to_owned());
    PathBuf::from(cache).join("schemathesis-4.32.5/bin/schemathesis")
}

/// Gives each path parameter an example naming a real object, so schemathesis reaches the
/// handlers behind the id checks (its generated values still try everything else).
fn with_examples(mut doc: Value, ids: &Map<String, Value>) -> Value {
    if let Some(paths) = doc["paths"].as_object_mut() {
        for item in paths.values_mut() {
            for op in item
                .as_object_mut()
                .into_iter()
                .flat_map(|m| m.values_mut())
            {
                let params = op.get_mut("parameters").and_then(Value::as_array_mut);
                for p in params.into_iter().flatten() {
                    if p["in"] == "path"
                        && let Some(id) = p["name"].as_str().and_then(|n| ids.get(n))
                    {
                        p["example"] = id.clone();
                    }
                }
            }
        }
    }
    doc
}

/// schemathesis (from PyPI, installed by `infra/local/install.sh`) against a real stack (the
/// API and the plan, gate and apply steps with terraform) with a Workspace, a Capsule, a
/// plan Run that was applied, a RunGroup, a token and a worker pool to find: no answer
/// is a 5xx, every answer's status is one the document lists and its body matches the
/// document's schema. Sent as the bootstrap admin, and the relay operations as the pool's
/// token. The Git webhook is exercised only unsigned (schemathesis cannot sign a body with
/// the Workspace's secret): it answers 401, as documented.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemathesis_finds_no_server_error_and_no_schema_violation() -> anyhow::Result<()> {
    let bin = schemathesis();
    assert!(
        bin.exists(),
        "{} is missing: run infra/local/install.sh (it installs schemathesis from PyPI)",
        bin.display()
    );
    let stack = Stack::start().await?;
    let ws = stack.client.create_workspace("ws-openapi").await?;
    let repo = GitRepo::with_example("network")?;
    let cap = stack
        .client
        .create_capsule(
            ws.id,
            &NewCapsule {
                name: "network".into(),
                source: Source {
                    repo: repo.url(),
                    branch: "main".into(),
                },
                dir: "infra/network".into(),
                tool: "terraform".into(),
                vars: json!({ "region": "eu" })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
            },
        )
        .await?;
    // A plan that was applied: its plan, cost, approvals, evidence and the Capsule's state
    // are real answers, not 404s or 409s.
    let (run, _apply) = stack.plan_and_apply(cap.id).await?;
    let token = stack
        .client
        .create_token(&NewToken {
            name: "openapi".into(),
            role: "viewer".into(),
            workspace_id: None,
            expires_in_days: None,
        })
        .await?;
    let (s, pool) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{}/pools", ws.id),
            json!({ "name": "openapi-pool" }),
        )
        .await?;
    assert_eq!(s, 201, "{pool}");

    let (s, group) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{}/plan-update", ws.id),
            json!({}),
        )
        .await?;
    assert_eq!(s, 202, "{group}");

    let mut ids = Map::new();
    ids.insert("rg".into(), group["id"].clone());
    ids.insert("ws".into(), json!(ws.id));
    ids.insert("cap".into(), json!(cap.id));
    ids.insert("run".into(), json!(run.id));
    ids.insert("pool".into(), json!("openapi-pool"));
    ids.insert("token".into(), json!(token.info.id));
    let doc = with_examples(fetch(&stack).await?, &ids);
    let dir = tempfile::tempdir()?;
    let spec = dir.path().join("openapi.json");
    std::fs::write(&spec, serde_json::to_vec_pretty(&doc)?)?;

    let pool_token = pool["token"].as_str().unwrap_or_default().to_owned();
    assert!(!pool_token.is_empty(), "{pool}");
    // Everything but the relay as the admin; the relay as the pool (the admin's token is
    // refused there, as documented, and never reaches a handler).
    let admin = run_schemathesis(
        &bin,
        &spec,
        &stack.api_url,
        &stack.admin_token,
        &["--exclude-path-regex", "^/api/v1/relay/"],
    )
    .await?;
    let relay = run_schemathesis(
        &bin,
        &spec,
        &stack.api_url,
        &pool_token,
        &["--include-path-regex", "^/api/v1/relay/"],
    )
    .await?;
    assert!(
        admin && relay,
        "schemathesis found failures; its output is above"
    );

    // The checks bite: with a document that says a Run's status can only be `queued`,
    // schemathesis refuses the planned Run `GET /runs/{run}` answers.
    let mut wrong = doc.clone();
    wrong["components"]["schemas"]["RunStatus"]["enum"] = json!(["queued"]);
    let wrong_spec = dir.path().join("wrong.json");
    std::fs::write(&wrong_spec, serde_json::to_vec_pretty(&wrong)?)?;
    let passed = run_schemathesis(
        &bin,
        &wrong_spec,
        &stack.api_url,
        &stack.admin_token,
        &["--include-operation-id", "getRun"],
    )
    .await?;
    assert!(
        !passed,
        "schemathesis passed an answer the document does not allow"
    );
    stack.stop().await
}

/// How long one schemathesis run may take. The admin's run took 25 s on an idle two-core
/// machine and 48 s beside three busy processes, but over 100 s on one CI machine (the Runs
/// its POSTs start plan with terraform beside it); a deadline is for a hang, not for speed.
const SCHEMATHESIS_DEADLINE: Duration = Duration::from_secs(300);

/// Runs schemathesis on `spec` against `url` with `token`; prints its output, answers
/// whether it passed. A run past the deadline is killed and fails with what it printed.
async fn run_schemathesis(
    bin: &std::path::Path,
    spec: &std::path::Path,
    url: &str,
    token: &str,
    filter: &[&str],
) -> anyhow::Result<bool> {
    use tokio::io::AsyncReadExt;

    let started = std::time::Instant::now();
    let mut child = tokio::process::Command::new(bin)
        .current_dir(spec.parent().unwrap_or(std::path::Path::new(".")))
        .env("NO_COLOR", "1")
        .arg("run")
        .arg(spec)
        .args(["--url", url])
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        ])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args(["--max-examples", "15", "--seed", "19"])
        // One worker: CPython 3.11's `ast.parse` is not thread-safe, and hypothesis calls it
        // while describing strategies ("AST constructor recursion depth mismatch").
        .args(["--workers", "1", "--request-timeout", "10"])
        .args(["--suppress-health-check", "all"])
        .args(filter)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // Read while it runs, so what it printed is there to show if it has to be killed.
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let out = tokio::spawn(async move {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf).await;
        buf
    });
    let err = tokio::spawn(async move {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf).await;
        buf
    });
    let status = match tokio::time::timeout(SCHEMATHESIS_DEADLINE, child.wait()).await {
        Ok(status) => Some(status?),
        Err(_) => {
            child.kill().await?;
            None
        }
    };
    let (out, err) = (out.await?, err.await?);
    eprintln!(
        "schemathesis {filter:?} took {:.0} s (exit {:?}):\n{}\n{}",
        started.elapsed().as_secs_f64(),
        status.and_then(|s| s.code()),
        clipped(&String::from_utf8_lossy(&out)),
        clipped(&String::from_utf8_lossy(&err))
    );
    match status {
        Some(status) => Ok(status.success()),
        None => anyhow::bail!(
            "schemathesis {filter:?} did not finish in {} s; what it printed is above",
            SCHEMATHESIS_DEADLINE.as_secs()
        ),
    }
}

/// Output with each line cut to 1,000 characters (a traceback can quote whole sources).
fn clipped(text: &str) -> String {
    text.lines()
        .map(|l| match l.char_indices().nth(1000) {
            Some((i, _)) => format!("{}…", &l[..i]),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}
