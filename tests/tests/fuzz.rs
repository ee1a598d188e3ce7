//! Bad-input fuzzing of every endpoint with `proptest`: path ids (valid, unknown,
//! another kind's, garbage), the `Authorization`, `Idempotency-Key` and `Content-Type`
//! headers (including bytes that are not UTF-8) and bodies (random JSON, valid bodies
//! with one field replaced, raw bytes), against the real API and Postgres.
//!
//! 1,000 cases by default (CI), over every route of the API's route table; `TAKOSUMI_FUZZ_CASES=<n>` for more.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};
use takosumi_core::RunMessage;
use takosumi_tests::probe::{self, record};
use takosumi_tests::{Endpoints, GitRepo, Options, Stack, Steps};

/// Every route (method and path template), from the API's own route table: a new route
/// is fuzzed the day it is mounted.
static ROUTES: std::sync::LazyLock<Vec<(String, &'static str)>> = std::sync::LazyLock::new(|| {
    takosumi_api::endpoints()
        .into_iter()
        .map(|e| (e.method.as_str().to_owned(), e.path))
        .collect()
});

/// How a path id is filled in.
#[derive(Debug, Clone)]
enum IdPick {
    /// The fixture's real id.
    Valid,
    /// A well-formed id nobody created.
    Unknown,
    /// A real id of another kind (`run_…` where a `cap_…` goes).
    OtherKind,
    /// Anything.
    Garbage(String),
}

#[derive(Debug, Clone)]
enum Auth {
    Admin,
    Viewer,
    Missing,
    Raw(Vec<u8>),
}

#[derive(Debug, Clone)]
enum Body {
    None,
    Json(Value),
    /// A valid body for the route with one field replaced.
    Mutated(String, Value),
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone)]
struct Case {
    route: usize,
    id: IdPick,
    auth: Auth,
    idempotency_key: Option<Vec<u8>>,
    content_type: Option<Vec<u8>>,
    query: Option<String>,
    body: Body,
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
        Just(json!("../../etc/passwd")),
        Just(json!("run_00000000000000000000000000000000")),
        Just(json!("x".repeat(5000))),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z_]{1,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..max)
}

fn case() -> impl Strategy<Value = Case> {
    let id = prop_oneof![
        4 => Just(IdPick::Valid),
        2 => Just(IdPick::Unknown),
        1 => Just(IdPick::OtherKind),
        2 => "(.|\\.\\.|%2e|/){0,30}".prop_map(IdPick::Garbage),
    ];
    let auth = prop_oneof![
        6 => Just(Auth::Admin),
        2 => Just(Auth::Viewer),
        1 => Just(Auth::Missing),
        1 => bytes(80).prop_map(Auth::Raw),
    ];
    let body = prop_oneof![
        2 => Just(Body::None),
        3 => json_value().prop_map(Body::Json),
        4 => ("[a-zA-Z]{1,12}", json_value()).prop_map(|(k, v)| Body::Mutated(k, v)),
        1 => bytes(300).prop_map(Body::Bytes),
    ];
    (
        0..ROUTES.len(),
        id,
        auth,
        prop::option::of(bytes(300)),
        prop::option::of(prop_oneof![
            Just(b"application/json".to_vec()),
            Just(b"text/plain".to_vec()),
            Just(b"application/x-www-form-urlencoded".to_vec()),
            bytes(40),
        ]),
        prop::option::of(prop_oneof![
            Just("limit=0".to_owned()),
            Just("limit=-1".to_owned()),
            Just("limit=99999999999".to_owned()),
            Just("cursor=%ff%fe".to_owned()),
            Just("status=nope&kind=nope".to_owned()),
            "[a-z=&%0-9]{0,30}",
        ]),
        body,
    )
        .prop_map(
            |(route, id, auth, idempotency_key, content_type, query, body)| Case {
                route,
                id,
                auth,
                idempotency_key,
                content_type,
                query,
                body,
            },
        )
}

struct Fixture {
    ids: Vec<(&'static str, String)>,
    admin: String,
    viewer: String,
    repo_url: String,
}

impl Fixture {
    fn id(&self, kind: &str) -> String {
        self.ids
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    fn fill(&self, template: &str, pick: &IdPick) -> Vec<String> {
        template
            .trim_start_matches('/')
            .split('/')
            .map(|seg| {
                let Some(kind) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) else {
                    return seg.to_owned();
                };
                match pick {
                    IdPick::Valid => self.id(kind),
                    IdPick::Unknown => {
                        let prefix = self.id(kind).split('_').next().unwrap_or("x").to_owned();
                        format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
                    }
                    IdPick::OtherKind => {
                        let other = if kind == "run" { "cap" } else { "run" };
                        self.id(other)
                    }
                    IdPick::Garbage(g) => g.clone(),
                }
            })
            .collect()
    }

    /// A body the route accepts, as a JSON object to mutate.
    fn valid_body(&self, template: &str) -> Value {
        match template {
            "/api/v1/workspaces" => json!({ "name": "fuzz" }),
            "/api/v1/tokens" => json!({ "name": "fuzz", "role": "viewer" }),
            "/api/v1/workspaces/{ws}/capsules" => json!({
                "name": "fuzzed", "source": { "repo": self.repo_url, "branch": "main" },
                "dir": "infra/network", "tool": "terraform", "vars": { "region": "eu" }
            }),
            "/api/v1/capsules/{cap}/plan" => json!({ "vars": { "region": "us" } }),
            "/api/v1/runs/{run}/approve" => json!({ "note": "ok" }),
            "/api/v1/runs/{run}/cancel" => json!({ "reason": "fuzz" }),
            "/api/v1/runs/{run}/resolve" => json!({ "action": "mark_resolved", "note": "n" }),
            "/api/v1/workspaces/{ws}/provider-bindings" => {
                json!({ "name": "b", "kind": "env", "env": { "A_TOKEN": "v" } })
            }
            "/api/v1/capsules/{cap}/provider-bindings" => json!({ "bindingId": self.id("pb") }),
            "/api/v1/capsules/{cap}/settings" => json!({ "autoUpdate": false }),
            "/api/v1/workspaces/{ws}/settings" => json!({}),
            "/api/v1/workspaces/{ws}/plan-update" => json!({ "onlyStale": true }),
            "/api/v1/workspaces/{ws}/pools" => json!({ "name": "fuzz-pool" }),
            "/api/v1/capsules/{cap}/pool" => json!({ "pool": null }),
            "/api/v1/relay/runs/{run}/fail" => json!({ "code": "plan_failed", "message": "m" }),
            "/api/v1/dead-letters/requeue" | "/api/v1/dead-letters/purge" => {
                json!({ "queue": "run.plan" })
            }
            _ => json!({}),
        }
    }
}

async fn run_case(stack: &Stack, fx: &Fixture, c: &Case) -> Result<(), TestCaseError> {
    let (method, template) = (ROUTES[c.route].0.as_str(), ROUTES[c.route].1);
    let mut url =
        reqwest::Url::parse(&stack.api_url).map_err(|e| TestCaseError::fail(e.to_string()))?;
    {
        let mut segs = url
            .path_segments_mut()
            .map_err(|()| TestCaseError::fail("base URL"))?;
        for seg in fx.fill(template, &c.id) {
            segs.push(&seg);
        }
    }
    let query = match (template, &c.query) {
        ("/api/v1/webhooks/git", None) => Some(format!("workspace={}", fx.id("ws"))),
        (_, q) => q.clone(),
    };
    url.set_query(query.as_deref());
    let mut headers = HeaderMap::new();
    let auth: Option<Vec<u8>> = match &c.auth {
        Auth::Admin => Some(format!("Bearer {}", fx.admin).into_bytes()),
        Auth::Viewer => Some(format!("Bearer {}", fx.viewer).into_bytes()),
        Auth::Missing => None,
        Auth::Raw(b) => Some(b.clone()),
    };
    let mut add = |name: &'static str, v: &[u8]| {
        if let Ok(v) = HeaderValue::from_bytes(v) {
            headers.insert(HeaderName::from_static(name), v);
        }
    };
    if let Some(a) = &auth {
        add("authorization", a);
    }
    if let Some(k) = &c.idempotency_key {
        add("idempotency-key", k);
    }
    if let Some(t) = &c.content_type {
        add("content-type", t);
    }
    let body: Option<Vec<u8>> = match &c.body {
        Body::None => None,
        Body::Json(v) => Some(v.to_string().into_bytes()),
        Body::Mutated(k, v) => {
            let mut b = fx.valid_body(template);
            if let Some(o) = b.as_object_mut() {
                o.insert(k.clone(), v.clone());
            }
            Some(b.to_string().into_bytes())
        }
        Body::Bytes(b) => Some(b.clone()),
    };
    let http = reqwest::Client::new();
    let m = reqwest::Method::from_bytes(method.as_bytes())
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut req = http.request(m, url.clone()).headers(headers);
    if let Some(b) = body {
        req = req.body(b);
    }
    let before = probe::fingerprint(&stack.ctx.pool)
        .await
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let resp = req
        .send()
        .await
        .map_err(|e| TestCaseError::fail(format!("{method} {url}: {e}")))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    prop_assert!(status < 500, "{method} {url}: {status} {text}");
    if status >= 400 {
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let coded = v["code"].as_str().is_some_and(|c| !c.is_empty())
            && v["message"].as_str().is_some_and(|m| !m.is_empty());
        // A dashboard page answers in HTML: a page that says what went wrong.
        let page = !template.starts_with("/api/")
            && template != "/healthz"
            && text.contains("data-testid=\"problem\"");
        prop_assert!(
            coded || page,
            "{method} {url}: {status} without a code and message: {text}"
        );
        let after = probe::fingerprint(&stack.ctx.pool)
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(
            after,
            before,
            "{} {}: {} changed stored data",
            method,
            url,
            status
        );
    }
    Ok(())
}

/// The promise: no input makes the API fail on its side, and a refused input changes
/// nothing. Random path ids, headers (valid and not, UTF-8 or not), query strings and
/// bodies against every endpoint: zero 5xx; every 4xx is JSON with a code and a message
/// and leaves every row and column as it was.
#[test]
fn fuzzed_requests_never_fail_on_our_side_nor_change_anything_when_refused() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let (stack, fx, _repo) = rt.block_on(async {
        let stack = Stack::start_on(
            Options {
                steps: Steps::API_ONLY,
                ..Options::default()
            },
            &Endpoints {
                settings: vec![("TAKOSUMI_STUCK_QUEUED_SECS".into(), "3600".into())],
                ..Endpoints::default()
            },
        )
        .await?;
        let repo = GitRepo::with_example("network")?;
        let ws = stack.client.create_workspace("fuzz-ws").await?;
        let capsule = stack
            .client
            .create_capsule(
                ws.id,
                &takosumi_client::NewCapsule {
                    name: "fuzz".into(),
                    source: takosumi_client::Source {
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
        let run = stack.client.plan(capsule.id, None).await?;
        takosumi_plan::handle(&stack.ctx, RunMessage { run_id: run.id }).await?;
        let group = probe::call(
            &stack,
            "POST",
            &format!("/api/v1/workspaces/{}/plan-update", ws.id),
            Some(&stack.admin_token),
            &[],
            None,
        )
        .await?;
        let pb = probe::call(
            &stack,
            "POST",
            &format!("/api/v1/workspaces/{}/provider-bindings", ws.id),
            Some(&stack.admin_token),
            &[],
            Some(br#"{"name":"fuzz","kind":"env","env":{"FUZZ_TOKEN":"v"}}"#),
        )
        .await?;
        let viewer = format!("tks_fuzz_viewer_{}", uuid::Uuid::new_v4().simple());
        takosumi_store::tokens::upsert(&stack.ctx.pool, &viewer, "fuzz-viewer", "viewer", None)
            .await?;
        let revocable = takosumi_store::tokens::upsert(
            &stack.ctx.pool,
            &format!("tks_fuzz_revocable_{}", uuid::Uuid::new_v4().simple()),
            "fuzz-revocable",
            "viewer",
            None,
        )
        .await?;
        let fx = Fixture {
            ids: vec![
                ("token", revocable.to_string()),
                ("file", "dashboard.css".to_owned()),
                ("ws", ws.id.to_string()),
                ("cap", capsule.id.to_string()),
                ("run", run.id.to_string()),
                (
                    "rg",
                    group.json["id"].as_str().unwrap_or_default().to_owned(),
                ),
                ("pb", pb.json["id"].as_str().unwrap_or_default().to_owned()),
            ],
            admin: stack.admin_token.clone(),
            viewer,
            repo_url: repo.url(),
        };
        // The repository outlives the cases (valid capsule bodies point at it).
        anyhow::Ok((stack, fx, repo))
    })?;
    let cases: u32 = std::env::var("TAKOSUMI_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 64,
        ..Config::default()
    });
    let tried = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&case(), |c| {
        tried.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        rt.block_on(run_case(&stack, &fx, &c))
    });
    let tried = tried.into_inner();
    record("fuzz", "inputs tried", tried);
    record(
        "fuzz",
        "5xx or changed-on-4xx found",
        usize::from(result.is_err()),
    );
    rt.block_on(stack.stop())?;
    result.map_err(|e| anyhow::anyhow!("{e}"))
}
