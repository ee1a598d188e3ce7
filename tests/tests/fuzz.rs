//! Bad-input fuzzing of every endpoint with `proptest`: path ids (valid, unknown,
//! another kind's, another owner's, garbage), the `Authorization`, `Idempotency-Key`,
//! `Content-Type` and `X-Takosumi-Claim` headers (including bytes that are not UTF-8) and
//! bodies (random JSON, valid bodies, valid bodies with one field replaced, raw bytes),
//! against the real API, Postgres and object store.
//!
//! Who calls: an admin or viewer API token, a worker pool's token (valid, or revoked,
//! forged or altered), no token or raw `Authorization` bytes; and at the Git webhook, a
//! GitHub or GitLab delivery signed with the Workspace's webhook secret (its body fuzzed
//! and signed as sent, so the event parser gets garbage behind a valid signature),
//! wrongly signed (another secret, the right secret over other bytes, a malformed header)
//! or unsigned, with fuzzed event and delivery id headers. Four cases in ten aim at the
//! relay (mostly the valid pool token and the claim the fixture holds on one of the
//! pool's Runs, claimed again whenever a case ended it) and at the webhook, which a draw
//! over the whole route table would rarely reach.
//!
//! The promises checked on every case: no 5xx (nor a hang); every 4xx says its code and
//! message and leaves every row and object as it was (a relay refusal that ends the
//! claimed Run with the code it answers is how the relay tells a worker its Run failed);
//! an API route refuses anything but an API token (401/403), a relay route anything but
//! a pool token (401), the webhook anything that does not verify; a replayed delivery
//! changes nothing.
//!
//! 1,000 cases by default (CI), over every route of the API's route table;
//! `TAKOSUMI_FUZZ_CASES=<n>` for more. What was tried (inputs by caller, routes hit,
//! answers, relay claims) goes to the suite summary.
//!
//! # A failure is persisted and replays
//!
//! A failing case's seed is appended to `tests/fuzz-regressions.txt` (proptest's
//! `FileFailurePersistence`, one `cc <seed> # shrinks to …` line; commit the file). Every
//! later run replays the seeds in it first, on the run's fresh fixture, before any new
//! case. The failure message shows the request, the minimal failing case, the seed line
//! added and two commands:
//!
//! - `TAKOSUMI_FUZZ_CASES=0 cargo test -p takosumi-tests --test fuzz -- --nocapture`
//!   replays only the persisted seeds;
//! - `PROPTEST_RNG_SEED=<seed> TAKOSUMI_FUZZ_CASES=<n> cargo test …` replays a whole run
//!   (the same cases in the same order, for a failure that needs what earlier accepted
//!   cases changed); every run prints its seed.
//!
//! `PROPTEST_DISABLE_FAILURE_PERSISTENCE=1` neither reads nor writes the file. A seed
//! regenerates its case through the route table's order, so a seed persisted before
//! routes were added or moved may replay as another case (still a valid one).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use proptest::prelude::*;
use proptest::test_runner::{
    Config, FailurePersistence, FileFailurePersistence, RngSeed, TestCaseError, TestError,
    TestRunner,
};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};
use sha2::Sha256;
use takosumi_api::Access;
use takosumi_core::{Role, RunMessage};
use takosumi_seal::delivery::DeliveryKeyPair;
use takosumi_tests::probe::{self, record, say};
use takosumi_tests::{Endpoints, GitRepo, Options, Stack, Steps};

/// Where failing seeds are kept (and replayed from).
const REGRESSIONS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-regressions.txt");

/// How long an answer (and its body) may take: longer is a hang, and a finding.
const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// The worker pool the fixture claims a Run on, and its delivery key id.
const POOL: &str = "fuzz-relay";
const POOL_KEY: &str = "fuzz-k1";

/// One route of the API's route table.
struct Route {
    method: String,
    path: &'static str,
    access: Access,
}

/// Every route (method and path template), from the API's own route table: a new route
/// is fuzzed the day it is mounted.
static ROUTES: std::sync::LazyLock<Vec<Route>> = std::sync::LazyLock::new(|| {
    takosumi_api::endpoints()
        .into_iter()
        .map(|e| Route {
            method: e.method.as_str().to_owned(),
            path: e.path,
            access: e.access,
        })
        .collect()
});

/// The routes only a worker pool's token opens (the relay).
static POOL_ROUTES: std::sync::LazyLock<Vec<usize>> = std::sync::LazyLock::new(|| {
    (0..ROUTES.len())
        .filter(|i| ROUTES[*i].access == Access::PoolToken)
        .collect()
});

/// The routes whose credential is a webhook signature.
static WEBHOOK_ROUTES: std::sync::LazyLock<Vec<usize>> = std::sync::LazyLock::new(|| {
    (0..ROUTES.len())
        .filter(|i| ROUTES[*i].access == Access::WebhookSignature)
        .collect()
});

/// How a path id is filled in.
#[derive(Debug, Clone)]
enum IdPick {
    /// The fixture's real id (on the relay routes, the pool's claimed Run).
    Valid,
    /// A well-formed id nobody created.
    Unknown,
    /// A real id of another kind (`run_…` where a `cap_…` goes).
    OtherKind,
    /// A real id of the right kind the caller has no business with: on the relay routes
    /// the control node's Run (not the pool's); elsewhere the pool's Run, or another
    /// Workspace.
    Foreign,
    /// Anything.
    Garbage(String),
}

#[derive(Debug, Clone)]
enum Auth {
    Admin,
    Viewer,
    /// The fixture pool's token.
    Pool,
    /// The token of a pool that was removed.
    PoolRevoked,
    /// A well-formed token no pool was given.
    PoolForged,
    /// The pool's token with its last character changed.
    PoolAltered,
    Missing,
    Raw(Vec<u8>),
}

/// What `X-Takosumi-Claim` says.
#[derive(Debug, Clone)]
enum ClaimPick {
    /// The claim the fixture holds on the pool's Run.
    Current,
    /// A well-formed claim of the same pool that holds nothing.
    Stale,
    Raw(Vec<u8>),
}

#[derive(Debug, Clone, Copy)]
enum Sender {
    GitHub,
    GitLab,
}

#[derive(Debug, Clone)]
enum Signature {
    /// GitHub: the HMAC-SHA256 of exactly the body sent, keyed with the Workspace's
    /// webhook secret; GitLab: the secret as the token.
    Signed,
    /// Signed with another secret.
    OtherSecret,
    /// GitHub: the right secret over other bytes; GitLab: the secret less its last byte.
    Altered,
    /// A header value that is no signature at all.
    Malformed(Vec<u8>),
    Unsigned,
}

#[derive(Debug, Clone)]
enum DeliveryPick {
    /// A new id every time.
    Fresh,
    /// The same id every time: the second delivery is a replay.
    Fixed,
    Raw(Vec<u8>),
}

/// A Git host's delivery: signature, event and delivery id headers.
#[derive(Debug, Clone)]
struct Webhook {
    sender: Sender,
    signature: Signature,
    /// `X-GitHub-Event` / `X-Gitlab-Event`; `None`: no header (a push).
    event: Option<String>,
    delivery: Option<DeliveryPick>,
}

#[derive(Debug, Clone)]
enum Body {
    None,
    Json(Value),
    /// A valid body for the route.
    Valid,
    /// A valid body for the route with one field replaced (or added).
    Mutated(Field, Value),
    Bytes(Vec<u8>),
}

/// Which field of a valid body a mutation sets.
#[derive(Debug, Clone)]
enum Field {
    /// One of the body's own fields (its n-th, counting round).
    Own(usize),
    /// A field the body does not have.
    New(String),
}

#[derive(Debug, Clone)]
struct Case {
    route: usize,
    id: IdPick,
    auth: Auth,
    claim: Option<ClaimPick>,
    webhook: Option<Webhook>,
    idempotency_key: Option<Vec<u8>>,
    content_type: Option<Vec<u8>>,
    query: Option<String>,
    body: Body,
}

impl Case {
    fn route(&self) -> &'static Route {
        &ROUTES[self.route]
    }

    /// Who is calling, as the suite summary counts it.
    fn caller(&self) -> &'static str {
        if self.route().access == Access::WebhookSignature {
            return match self.webhook.as_ref().map(|w| &w.signature) {
                Some(Signature::Signed) => "webhook signed",
                Some(Signature::Unsigned) | None => "webhook unsigned",
                Some(_) => "webhook wrongly signed",
            };
        }
        match self.auth {
            Auth::Admin => "admin token",
            Auth::Viewer => "viewer token",
            Auth::Pool => "pool token (valid)",
            Auth::PoolRevoked | Auth::PoolForged | Auth::PoolAltered => "pool token (invalid)",
            Auth::Missing => "no token",
            Auth::Raw(_) => "raw Authorization",
        }
    }
}

/// The summary's caller kinds, in the order they are shown.
const CALLERS: [&str; 9] = [
    "admin token",
    "viewer token",
    "pool token (valid)",
    "pool token (invalid)",
    "webhook signed",
    "webhook wrongly signed",
    "webhook unsigned",
    "no token",
    "raw Authorization",
];

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

fn garbage_id() -> impl Strategy<Value = IdPick> {
    "(.|\\.\\.|%2e|/){0,30}".prop_map(IdPick::Garbage)
}

fn body() -> impl Strategy<Value = Body> {
    let field = prop_oneof![
        (0..16usize).prop_map(Field::Own),
        "[a-zA-Z]{1,12}".prop_map(Field::New),
    ];
    prop_oneof![
        2 => Just(Body::None),
        3 => json_value().prop_map(Body::Json),
        1 => Just(Body::Valid),
        4 => (field, json_value()).prop_map(|(k, v)| Body::Mutated(k, v)),
        1 => bytes(300).prop_map(Body::Bytes),
    ]
}

fn claim() -> impl Strategy<Value = ClaimPick> {
    prop_oneof![
        6 => Just(ClaimPick::Current),
        1 => Just(ClaimPick::Stale),
        1 => bytes(60).prop_map(ClaimPick::Raw),
    ]
}

fn bad_pool_token() -> impl Strategy<Value = Auth> {
    prop_oneof![
        Just(Auth::PoolRevoked),
        Just(Auth::PoolForged),
        Just(Auth::PoolAltered),
    ]
}

fn content_type() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop::option::of(prop_oneof![
        Just(b"application/json".to_vec()),
        Just(b"text/plain".to_vec()),
        Just(b"application/x-www-form-urlencoded".to_vec()),
        bytes(40),
    ])
}

fn query() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("limit=0".to_owned()),
        Just("limit=-1".to_owned()),
        Just("limit=99999999999".to_owned()),
        Just("cursor=%ff%fe".to_owned()),
        Just("status=nope&kind=nope".to_owned()),
        Just("workspace=ws_00000000000000000000000000000000".to_owned()),
        "[a-z=&%0-9]{0,30}",
    ]
}

/// Any route, any caller.
fn any_case() -> impl Strategy<Value = Case> {
    let id = prop_oneof![
        4 => Just(IdPick::Valid),
        2 => Just(IdPick::Unknown),
        1 => Just(IdPick::OtherKind),
        1 => Just(IdPick::Foreign),
        2 => garbage_id(),
    ];
    let auth = prop_oneof![
        6 => Just(Auth::Admin),
        2 => Just(Auth::Viewer),
        1 => Just(Auth::Pool),
        1 => bad_pool_token(),
        1 => Just(Auth::Missing),
        1 => bytes(80).prop_map(Auth::Raw),
    ];
    (
        0..ROUTES.len(),
        id,
        auth,
        prop::option::weighted(0.1, claim()),
        prop::option::of(bytes(300)),
        content_type(),
        prop::option::of(query()),
        body(),
    )
        .prop_map(
            |(route, id, auth, claim, idempotency_key, content_type, query, body)| Case {
                route,
                id,
                auth,
                claim,
                webhook: None,
                idempotency_key,
                content_type,
                query,
                body,
            },
        )
}

/// The relay: a pool token (mostly the valid one), mostly the fixture's claim.
fn pool_case() -> impl Strategy<Value = Case> {
    let id = prop_oneof![
        6 => Just(IdPick::Valid),
        2 => Just(IdPick::Foreign),
        1 => Just(IdPick::Unknown),
        1 => garbage_id(),
    ];
    let auth = prop_oneof![
        6 => Just(Auth::Pool),
        3 => bad_pool_token(),
        1 => Just(Auth::Admin),
        1 => Just(Auth::Missing),
    ];
    (
        prop::sample::select(POOL_ROUTES.clone()),
        id,
        auth,
        prop::option::weighted(0.85, claim()),
        prop::option::weighted(0.1, bytes(100)),
        content_type(),
        body(),
    )
        .prop_map(
            |(route, id, auth, claim, idempotency_key, content_type, body)| Case {
                route,
                id,
                auth,
                claim,
                webhook: None,
                idempotency_key,
                content_type,
                query: None,
                body,
            },
        )
}

/// The Git webhook: signed, wrongly signed or unsigned deliveries of fuzzed events.
fn webhook_case() -> impl Strategy<Value = Case> {
    let sender = prop_oneof![Just(Sender::GitHub), Just(Sender::GitLab)];
    let signature = prop_oneof![
        5 => Just(Signature::Signed),
        1 => Just(Signature::OtherSecret),
        1 => Just(Signature::Altered),
        1 => bytes(80).prop_map(Signature::Malformed),
        2 => Just(Signature::Unsigned),
    ];
    let event = prop::option::weighted(
        0.8,
        prop_oneof![
            3 => Just("push".to_owned()),
            2 => Just("pull_request".to_owned()),
            1 => Just("ping".to_owned()),
            2 => Just("Push Hook".to_owned()),
            2 => Just("Merge Request Hook".to_owned()),
            1 => "[a-zA-Z_ ]{0,20}",
        ],
    );
    let delivery = prop::option::weighted(
        0.7,
        prop_oneof![
            3 => Just(DeliveryPick::Fresh),
            1 => Just(DeliveryPick::Fixed),
            1 => bytes(300).prop_map(DeliveryPick::Raw),
        ],
    );
    let auth = prop_oneof![
        6 => Just(Auth::Missing),
        1 => Just(Auth::Admin),
        1 => Just(Auth::Viewer),
        1 => Just(Auth::Pool),
        1 => bytes(80).prop_map(Auth::Raw),
    ];
    (
        prop::sample::select(WEBHOOK_ROUTES.clone()),
        auth,
        (sender, signature, event, delivery).prop_map(|(sender, signature, event, delivery)| {
            Webhook {
                sender,
                signature,
                event,
                delivery,
            }
        }),
        prop::option::weighted(0.2, bytes(100)),
        content_type(),
        prop::option::weighted(0.15, query()),
        body(),
    )
        .prop_map(
            |(route, auth, webhook, idempotency_key, content_type, query, body)| Case {
                route,
                id: IdPick::Valid,
                auth,
                claim: None,
                webhook: Some(webhook),
                idempotency_key,
                content_type,
                query,
                body,
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    prop_oneof![
        6 => any_case(),
        2 => pool_case(),
        2 => webhook_case(),
    ]
}

struct Fixture {
    ids: Vec<(&'static str, String)>,
    admin: String,
    viewer: String,
    repo_url: String,
    /// The head of the repository's `main` (a push names it).
    commit: String,
    /// The fixture pool's token, one of a removed pool, and one never issued.
    pool_token: String,
    revoked_pool_token: String,
    forged_pool_token: String,
    /// The pool's Capsule.
    pooled_capsule: String,
    /// The public half of the pool's delivery key, standard base64, and the id it is
    /// registered under now (a case that rotates the pool's key makes the fixture
    /// register it again, under a new id).
    pool_public_key: String,
    pool_key_id: Mutex<String>,
    /// The pool's Run the fixture holds a claim on, and the claim (its lease owner).
    held: Mutex<Held>,
    /// The Workspace's webhook secret (an accepted rotation replaces it).
    webhook_secret: Mutex<String>,
}

/// A claim on one of the pool's Runs.
#[derive(Debug, Clone, Default)]
struct Held {
    run: String,
    claim: String,
    /// Claims made (the first, and each one made after a case ended the last).
    claims: usize,
    /// A new claim could not be made (a case left the pool unable to claim): no more tries.
    exhausted: bool,
}

/// A request as sent.
struct Request {
    method: reqwest::Method,
    url: reqwest::Url,
    headers: HeaderMap,
    body: Option<Vec<u8>>,
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn hub_signature(secret: &[u8], body: &[u8]) -> String {
    // HMAC takes a key of any length.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("any key length");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

impl Fixture {
    fn pool_key_id(&self) -> String {
        self.pool_key_id
            .lock()
            .map(|k| k.clone())
            .unwrap_or_default()
    }

    fn held(&self) -> Held {
        self.held.lock().map(|h| h.clone()).unwrap_or_default()
    }

    fn id(&self, kind: &str) -> String {
        if kind == "pool_run" {
            return self.held().run;
        }
        self.ids
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    fn fill(&self, template: &str, pick: &IdPick) -> Vec<String> {
        let relay = template.starts_with("/api/v1/relay/");
        template
            .trim_start_matches('/')
            .split('/')
            .map(|seg| {
                let Some(kind) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) else {
                    return seg.to_owned();
                };
                let unknown = || {
                    let prefix = self.id(kind).split('_').next().unwrap_or("x").to_owned();
                    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
                };
                match pick {
                    IdPick::Valid if relay && kind == "run" => self.id("pool_run"),
                    IdPick::Valid => self.id(kind),
                    IdPick::Unknown => unknown(),
                    IdPick::OtherKind => {
                        let other = if kind == "run" { "cap" } else { "run" };
                        self.id(other)
                    }
                    IdPick::Foreign => match kind {
                        "run" if relay => self.id("run"),
                        "run" => self.id("pool_run"),
                        "ws" => self.id("other_ws"),
                        _ => unknown(),
                    },
                    IdPick::Garbage(g) => g.clone(),
                }
            })
            .collect()
    }

    /// The webhook event a valid delivery of `event` carries.
    fn valid_event(&self, event: Option<&str>) -> Value {
        let repository = json!({ "clone_url": self.repo_url });
        match event.map(str::to_ascii_lowercase).as_deref() {
            None | Some("push" | "push hook") => json!({
                "ref": "refs/heads/main", "after": self.commit, "repository": repository
            }),
            Some("pull_request" | "merge request hook") => json!({
                "action": "opened",
                "pull_request": {
                    "base": { "ref": "main" },
                    "head": { "ref": "fuzz-feature", "sha": self.commit }
                },
                "repository": repository
            }),
            Some(_) => json!({ "zen": "fuzz" }),
        }
    }

    /// A body the route accepts, as a JSON object to mutate.
    fn valid_body(&self, template: &str, c: &Case) -> Value {
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
            "/api/v1/pools/{pool}/delivery-key" => json!({
                "keyId": "fuzz-k2", "publicKey": base64::engine::general_purpose::STANDARD.encode([7u8; 32]),
                "graceSecs": 60
            }),
            "/api/v1/capsules/{cap}/pool" => json!({ "pool": null }),
            "/api/v1/relay/claim" => {
                json!({ "deliveryKeyIds": [self.pool_key_id()], "waitSecs": 0 })
            }
            "/api/v1/relay/runs/{run}/progress" => json!({
                "events": [{ "kind": "tool_started", "data": { "command": "plan" } }],
                "logs": [{ "step": "plan", "text": "fuzz\n" }]
            }),
            "/api/v1/relay/runs/{run}/plan-file" => json!("a plan file"),
            "/api/v1/relay/runs/{run}/scanned" => json!({
                "scanReport": { "findings": [], "unreadable": [], "modulesRead": [] }
            }),
            "/api/v1/relay/runs/{run}/planned" => json!({
                "sourceCommit": self.commit, "treeDigest": "fuzz",
                "toolVersion": { "terraform_version": "1.9.0" },
                "show": { "format_version": "1.2", "resource_changes": [] },
                "lockfile": null, "modulesDigest": "fuzz"
            }),
            "/api/v1/relay/runs/{run}/applied" => {
                json!({ "success": false, "exitCode": 1, "state": null })
            }
            "/api/v1/relay/runs/{run}/fail" => json!({ "code": "plan_failed", "message": "m" }),
            "/api/v1/dead-letters/requeue" | "/api/v1/dead-letters/purge" => {
                json!({ "queue": "run.plan" })
            }
            "/api/v1/webhooks/git" => {
                self.valid_event(c.webhook.as_ref().and_then(|w| w.event.as_deref()))
            }
            _ => json!({}),
        }
    }

    fn request(&self, api_url: &str, c: &Case) -> Result<Request, TestCaseError> {
        let route = c.route();
        let mut url = reqwest::Url::parse(api_url).map_err(fail)?;
        {
            let mut segs = url.path_segments_mut().map_err(|()| fail("base URL"))?;
            for seg in self.fill(route.path, &c.id) {
                segs.push(&seg);
            }
        }
        let query = match (route.access, &c.query) {
            (Access::WebhookSignature, None) => Some(format!("workspace={}", self.id("ws"))),
            (_, q) => q.clone(),
        };
        url.set_query(query.as_deref());
        let body: Option<Vec<u8>> = match &c.body {
            Body::None => None,
            Body::Json(v) => Some(v.to_string().into_bytes()),
            Body::Valid => Some(self.valid_body(route.path, c).to_string().into_bytes()),
            Body::Mutated(field, v) => {
                let mut b = self.valid_body(route.path, c);
                if let Some(o) = b.as_object_mut() {
                    let key = match field {
                        Field::Own(n) if !o.is_empty() => o.keys().nth(n % o.len()).cloned(),
                        Field::Own(_) => None,
                        Field::New(k) => Some(k.clone()),
                    };
                    o.insert(key.unwrap_or_else(|| "fuzz".to_owned()), v.clone());
                }
                Some(b.to_string().into_bytes())
            }
            Body::Bytes(b) => Some(b.clone()),
        };
        let mut headers = HeaderMap::new();
        let mut add = |name: &'static str, v: &[u8]| {
            if let Ok(v) = HeaderValue::from_bytes(v) {
                headers.insert(HeaderName::from_static(name), v);
            }
        };
        let bearer = |t: &str| Some(format!("Bearer {t}").into_bytes());
        let auth: Option<Vec<u8>> = match &c.auth {
            Auth::Admin => bearer(&self.admin),
            Auth::Viewer => bearer(&self.viewer),
            Auth::Pool => bearer(&self.pool_token),
            Auth::PoolRevoked => bearer(&self.revoked_pool_token),
            Auth::PoolForged => bearer(&self.forged_pool_token),
            Auth::PoolAltered => {
                let mut t = self.pool_token.clone();
                let last = if t.pop() == Some('0') { '1' } else { '0' };
                t.push(last);
                bearer(&t)
            }
            Auth::Missing => None,
            Auth::Raw(b) => Some(b.clone()),
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
        match &c.claim {
            None => {}
            Some(ClaimPick::Current) => add("x-takosumi-claim", self.held().claim.as_bytes()),
            Some(ClaimPick::Stale) => add("x-takosumi-claim", b"relay:fuzz-relay:000000000000"),
            Some(ClaimPick::Raw(b)) => add("x-takosumi-claim", b),
        }
        if let Some(w) = &c.webhook {
            let secret = self
                .webhook_secret
                .lock()
                .map_err(|_| fail("secret lock"))?
                .clone();
            let sent = body.as_deref().unwrap_or_default();
            let other = "whsec_not_this_workspaces_secret";
            match (w.sender, &w.signature) {
                (_, Signature::Unsigned) => {}
                (Sender::GitHub, Signature::Signed) => add(
                    "x-hub-signature-256",
                    hub_signature(secret.as_bytes(), sent).as_bytes(),
                ),
                (Sender::GitHub, Signature::OtherSecret) => add(
                    "x-hub-signature-256",
                    hub_signature(other.as_bytes(), sent).as_bytes(),
                ),
                (Sender::GitHub, Signature::Altered) => {
                    let mut bytes = sent.to_vec();
                    bytes.push(b' ');
                    add(
                        "x-hub-signature-256",
                        hub_signature(secret.as_bytes(), &bytes).as_bytes(),
                    );
                }
                (Sender::GitHub, Signature::Malformed(b)) => add("x-hub-signature-256", b),
                (Sender::GitLab, Signature::Signed) => add("x-gitlab-token", secret.as_bytes()),
                (Sender::GitLab, Signature::OtherSecret) => add("x-gitlab-token", other.as_bytes()),
                (Sender::GitLab, Signature::Altered) => add(
                    "x-gitlab-token",
                    &secret.as_bytes()[..secret.len().saturating_sub(1)],
                ),
                (Sender::GitLab, Signature::Malformed(b)) => add("x-gitlab-token", b),
            }
            let (event_header, delivery_header) = match w.sender {
                Sender::GitHub => ("x-github-event", "x-github-delivery"),
                Sender::GitLab => ("x-gitlab-event", "x-gitlab-event-uuid"),
            };
            if let Some(e) = &w.event {
                add(event_header, e.as_bytes());
            }
            match &w.delivery {
                None => {}
                Some(DeliveryPick::Fresh) => {
                    add(delivery_header, uuid::Uuid::new_v4().to_string().as_bytes())
                }
                Some(DeliveryPick::Fixed) => add(delivery_header, b"fuzz-delivery-1"),
                Some(DeliveryPick::Raw(b)) => add(delivery_header, b),
            }
        }
        let method = reqwest::Method::from_bytes(route.method.as_bytes()).map_err(fail)?;
        Ok(Request {
            method,
            url,
            headers,
            body,
        })
    }
}

impl Fixture {
    /// Keeps a claim held on one of the pool's Runs: when a case ended the last one (the
    /// worker failed or canceled it, an operator canceled it), plans the pool's Capsule
    /// and claims it as a worker would, so the relay's handlers keep getting a live claim.
    /// Runs before a case's snapshot, never inside it.
    async fn hold_a_claim(&self, stack: &Stack) -> anyhow::Result<()> {
        let held = self.held();
        if held.exhausted {
            return Ok(());
        }
        if held.claims > 0 {
            let id: uuid::Uuid = held.run.trim_start_matches("run_").parse()?;
            let owner: Option<String> =
                sqlx::query_scalar("SELECT lease_owner FROM runs WHERE id = $1")
                    .bind(id)
                    .fetch_one(&stack.ctx.pool)
                    .await?;
            if owner.as_deref() == Some(held.claim.as_str()) {
                return Ok(());
            }
        }
        let planned = probe::call(
            stack,
            "POST",
            &format!("/api/v1/capsules/{}/plan", self.pooled_capsule),
            Some(&self.admin),
            &[],
            None,
        )
        .await?;
        let claim = |key_id: String| {
            let body = json!({ "deliveryKeyIds": [key_id], "waitSecs": 5 }).to_string();
            async move {
                probe::call(
                    stack,
                    "POST",
                    "/api/v1/relay/claim",
                    Some(&self.pool_token),
                    &[],
                    Some(body.as_bytes()),
                )
                .await
            }
        };
        let mut claimed = claim(self.pool_key_id()).await?;
        if claimed.status == 409 {
            // A case rotated the pool's delivery key: register the fixture's again.
            let key_id = format!("fuzz-fixture-{}", held.claims);
            let body =
                json!({ "keyId": key_id, "publicKey": self.pool_public_key, "graceSecs": 0 });
            let rotated = probe::call(
                stack,
                "POST",
                &format!("/api/v1/pools/{POOL}/delivery-key"),
                Some(&self.admin),
                &[],
                Some(body.to_string().as_bytes()),
            )
            .await?;
            if rotated.status == 200 {
                *self
                    .pool_key_id
                    .lock()
                    .map_err(|_| anyhow::anyhow!("key lock"))? = key_id.clone();
            }
            claimed = claim(key_id).await?;
        }
        let job = &claimed.json["job"];
        let mut h = self.held.lock().map_err(|_| anyhow::anyhow!("held lock"))?;
        match (job["runId"].as_str(), job["claim"].as_str()) {
            (Some(run), Some(claim)) if planned.status == 202 && claimed.status == 200 => {
                h.run = run.to_owned();
                h.claim = claim.to_owned();
                h.claims += 1;
            }
            _ => {
                say(&format!(
                    "[fuzz] no new claim on the pool's Run (plan {}, claim {} {}); the relay keeps the last",
                    planned.status, claimed.status, claimed.text
                ));
                h.exhausted = true;
            }
        }
        Ok(())
    }
}

/// What was tried, for the suite summary.
#[derive(Default)]
struct Tally {
    by_caller: BTreeMap<&'static str, usize>,
    routes: BTreeSet<usize>,
    accepted: usize,
    refused: usize,
    relay_calls_accepted: usize,
    signed_deliveries_accepted: usize,
}

/// Every row (less what changes on its own) and every stored object's key.
async fn snapshot(stack: &Stack) -> Result<(BTreeMap<String, String>, Vec<String>), TestCaseError> {
    let rows = probe::fingerprint(&stack.ctx.pool).await.map_err(fail)?;
    let mut objects = stack.ctx.objects.list("").await.map_err(fail)?;
    objects.sort();
    Ok((rows, objects))
}

/// Whether the refused relay call ended the pool's claimed Run with the code it answered:
/// the relay's way to tell a worker its Run failed (a plan over the limit, a dependency
/// that changed), which the refusal's own record is.
async fn ended_the_claimed_run(
    stack: &Stack,
    fx: &Fixture,
    c: &Case,
    answer: &Value,
) -> Result<bool, TestCaseError> {
    if !c.route().path.starts_with("/api/v1/relay/runs/")
        || !matches!(c.id, IdPick::Valid)
        || !matches!(c.auth, Auth::Pool)
        || !matches!(c.claim, Some(ClaimPick::Current))
    {
        return Ok(false);
    }
    let id: uuid::Uuid = fx
        .id("pool_run")
        .trim_start_matches("run_")
        .parse()
        .map_err(fail)?;
    let (status, code): (String, Option<String>) =
        sqlx::query_as("SELECT status::text, error_code FROM runs WHERE id = $1")
            .bind(id)
            .fetch_one(&stack.ctx.pool)
            .await
            .map_err(fail)?;
    Ok(status == "failed" && code.is_some() && code.as_deref() == answer["code"].as_str())
}

async fn run_case(
    stack: &Stack,
    fx: &Fixture,
    tally: &Mutex<Tally>,
    c: &Case,
) -> Result<(), TestCaseError> {
    fx.hold_a_claim(stack).await.map_err(fail)?;
    let route = c.route();
    let (method, template) = (route.method.as_str(), route.path);
    let r = fx.request(&stack.api_url, c)?;
    let url = r.url.clone();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(fail)?;
    let mut req = http.request(r.method, r.url).headers(r.headers);
    if let Some(b) = r.body {
        req = req.body(b);
    }
    let before = snapshot(stack).await?;
    let resp = tokio::time::timeout(ANSWER_WITHIN, req.send())
        .await
        .map_err(|_| fail(format!("{method} {url}: no answer in {ANSWER_WITHIN:?}")))?
        .map_err(|e| fail(format!("{method} {url}: {e}")))?;
    let status = resp.status().as_u16();
    // A live Run's event stream lasts as long as the Run: the answer is that it streams.
    let streams = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    let text = if streams && status < 400 {
        String::new()
    } else {
        tokio::time::timeout(ANSWER_WITHIN, resp.text())
            .await
            .map_err(|_| fail(format!("{method} {url}: {status}, the body never ended")))?
            .unwrap_or_default()
    };
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    {
        let mut t = tally.lock().map_err(|_| fail("tally lock"))?;
        *t.by_caller.entry(c.caller()).or_default() += 1;
        t.routes.insert(c.route);
        if status < 400 {
            t.accepted += 1;
            t.relay_calls_accepted += usize::from(route.access == Access::PoolToken);
            t.signed_deliveries_accepted += usize::from(c.caller() == "webhook signed");
        } else {
            t.refused += 1;
        }
    }
    prop_assert!(status < 500, "{method} {url}: {status} {text}");
    // An accepted rotation of the webhook secret: later deliveries are signed with the new one.
    if template == "/api/v1/workspaces/{ws}/webhook-secret"
        && status == 201
        && v["workspaceId"].as_str() == Some(fx.id("ws").as_str())
        && let Some(s) = v["secret"].as_str()
    {
        *fx.webhook_secret.lock().map_err(|_| fail("secret lock"))? = s.to_owned();
    }
    // Who may not: path ids that route (not garbage) meet the guard before any handler.
    let routed = !matches!(c.id, IdPick::Garbage(_));
    match route.access {
        Access::Token(..) if routed && !matches!(c.auth, Auth::Admin | Auth::Viewer) => {
            prop_assert!(
                status == 401 || status == 403,
                "{method} {url}: {status} to a caller with no API token ({}): {text}",
                c.caller()
            );
        }
        Access::PoolToken if routed && !matches!(c.auth, Auth::Pool) => {
            prop_assert!(
                status == 401,
                "{method} {url}: {status} to a caller with no pool token ({}): {text}",
                c.caller()
            );
        }
        Access::WebhookSignature if c.caller() != "webhook signed" => {
            prop_assert!(
                status >= 400,
                "{method} {url}: {status} to a delivery whose signature does not verify ({}): {text}",
                c.caller()
            );
        }
        _ => {}
    }
    if status >= 400 {
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
        let after = snapshot(stack).await?;
        if after != before {
            prop_assert!(
                ended_the_claimed_run(stack, fx, c, &v).await?,
                "{method} {url}: {status} changed stored data ({}): {text}",
                changed(&before, &after)
            );
        }
    } else if v["duplicate"] == json!(true) {
        // A replayed delivery is answered, and changes nothing.
        let after = snapshot(stack).await?;
        prop_assert!(
            after == before,
            "{method} {url}: a replayed delivery changed stored data ({}): {text}",
            changed(&before, &after)
        );
    }
    Ok(())
}

/// Which tables (and whether the objects) differ.
fn changed(
    before: &(BTreeMap<String, String>, Vec<String>),
    after: &(BTreeMap<String, String>, Vec<String>),
) -> String {
    let mut what: Vec<String> = after
        .0
        .iter()
        .filter(|(t, d)| before.0.get(*t) != Some(*d))
        .map(|(t, _)| t.clone())
        .collect();
    if before.1 != after.1 {
        what.push("objects".into());
    }
    what.join(", ")
}

/// The seed lines of the persistence file.
fn persisted_seeds() -> Vec<String> {
    std::fs::read_to_string(REGRESSIONS)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("cc "))
        .map(str::to_owned)
        .collect()
}

/// The promise: no input makes the API fail on its side, and a refused input changes
/// nothing. Random path ids, headers (valid and not, UTF-8 or not), query strings and
/// bodies against every endpoint, as every kind of caller: zero 5xx; every 4xx is JSON
/// with a code and a message and leaves every row, column and object as it was; a caller
/// without the route's credential (an API token, the pool's token, a verifying webhook
/// signature) is refused; a replayed delivery changes nothing.
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
                settings: vec![
                    ("TAKOSUMI_STUCK_QUEUED_SECS".into(), "3600".into()),
                    // The pool's claimed Run outlives its lease (the fuzz takes longer):
                    // a reaper taking it back would change rows under a refused request.
                    // One pass at start, none during the cases.
                    ("TAKOSUMI_REAPER_INTERVAL_MS".into(), "86400000".into()),
                ],
                ..Endpoints::default()
            },
        )
        .await?;
        let repo = GitRepo::with_example("network")?;
        let commit = repo.commit(&[("README.md", "fuzz\n")], "fuzz")?;
        let ws = stack.client.create_workspace("fuzz-ws").await?;
        let other_ws = stack.client.create_workspace("fuzz-other").await?;
        let new_capsule = |name: &str| takosumi_client::NewCapsule {
            name: name.into(),
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
        };
        let capsule = stack
            .client
            .create_capsule(ws.id, &new_capsule("fuzz"))
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
        takosumi_store::tokens::upsert(&stack.ctx.pool, &viewer, "fuzz-viewer", Role::Viewer, None)
            .await?;
        let revocable = takosumi_store::tokens::upsert(
            &stack.ctx.pool,
            &format!("tks_fuzz_revocable_{}", uuid::Uuid::new_v4().simple()),
            "fuzz-revocable",
            Role::Viewer,
            None,
        )
        .await?;
        let secret = probe::call(
            &stack,
            "POST",
            &format!("/api/v1/workspaces/{}/webhook-secret", ws.id),
            Some(&stack.admin_token),
            &[],
            None,
        )
        .await?;
        anyhow::ensure!(secret.status == 201, "webhook secret: {}", secret.text);
        // A worker pool with a Capsule whose plan the fixture claims as a worker would:
        // the relay routes get a Run held by a claim the cases can name.
        let key = DeliveryKeyPair::generate(POOL_KEY)?;
        let pool_token = create_pool(&stack, ws.id, POOL, Some(&key)).await?;
        // A pool that is removed: its token is what a decommissioned worker still holds.
        let revoked_pool_token = create_pool(&stack, ws.id, "fuzz-removed", None).await?;
        sqlx::query("DELETE FROM worker_pools WHERE name = 'fuzz-removed'")
            .execute(&stack.ctx.pool)
            .await?;
        let pooled = stack
            .client
            .create_capsule(ws.id, &new_capsule("fuzz-pooled"))
            .await?;
        let moved = probe::call(
            &stack,
            "PUT",
            &format!("/api/v1/capsules/{}/pool", pooled.id),
            Some(&stack.admin_token),
            &[],
            Some(json!({ "pool": POOL }).to_string().as_bytes()),
        )
        .await?;
        anyhow::ensure!(moved.status == 200, "capsule pool: {}", moved.text);
        let fx = Fixture {
            ids: vec![
                ("token", revocable.to_string()),
                ("file", "dashboard.css".to_owned()),
                ("ws", ws.id.to_string()),
                ("other_ws", other_ws.id.to_string()),
                ("cap", capsule.id.to_string()),
                ("run", run.id.to_string()),
                ("pool", POOL.to_owned()),
                (
                    "rg",
                    group.json["id"].as_str().unwrap_or_default().to_owned(),
                ),
                ("pb", pb.json["id"].as_str().unwrap_or_default().to_owned()),
            ],
            admin: stack.admin_token.clone(),
            viewer,
            repo_url: repo.url(),
            commit,
            pool_token,
            revoked_pool_token,
            forged_pool_token: format!("tks_{}", "0f".repeat(20)),
            pooled_capsule: pooled.id.to_string(),
            pool_public_key: base64::engine::general_purpose::STANDARD.encode(key.public().public),
            pool_key_id: Mutex::new(POOL_KEY.to_owned()),
            held: Mutex::new(Held::default()),
            webhook_secret: Mutex::new(
                secret.json["secret"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ),
        };
        fx.hold_a_claim(&stack).await?;
        anyhow::ensure!(fx.held().claims == 1, "no claim on the pool's Run");
        // The repository outlives the cases (valid capsule bodies point at it).
        anyhow::Ok((stack, fx, repo))
    })?;
    rt.block_on(credentials_work(&stack, &fx))?;

    let cases: u32 = std::env::var("TAKOSUMI_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let defaults = Config::default();
    // PROPTEST_RNG_SEED replays a whole run; otherwise a new seed, printed.
    let seed = match defaults.rng_seed {
        RngSeed::Fixed(s) => s,
        RngSeed::Random => uuid::Uuid::new_v4().as_u64_pair().0,
    };
    // PROPTEST_DISABLE_FAILURE_PERSISTENCE leaves the file alone.
    let persistence: Option<Box<dyn FailurePersistence>> = defaults
        .failure_persistence
        .is_some()
        .then(|| Box::new(FileFailurePersistence::Direct(REGRESSIONS)) as _);
    let persisted = if persistence.is_some() {
        persisted_seeds()
    } else {
        Vec::new()
    };
    say(&format!(
        "[fuzz] {cases} cases, PROPTEST_RNG_SEED={seed}; {} persisted failure(s) from {REGRESSIONS} replay first",
        persisted.len()
    ));
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: persistence,
        rng_seed: RngSeed::Fixed(seed),
        max_shrink_iters: 64,
        ..defaults
    });
    let tally = Mutex::new(Tally::default());
    let tried = std::sync::atomic::AtomicUsize::new(0);
    let started = std::time::Instant::now();
    let result = runner.run(&case(), |c| {
        tried.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        rt.block_on(run_case(&stack, &fx, &tally, &c))
    });
    let tried = tried.into_inner();
    let tally = tally.into_inner().unwrap_or_default();
    record("fuzz", "inputs tried", tried);
    for caller in CALLERS {
        record(
            "fuzz",
            &format!("inputs: {caller}"),
            tally.by_caller.get(caller).copied().unwrap_or(0),
        );
    }
    record(
        "fuzz",
        "routes hit",
        format!("{} of {}", tally.routes.len(), ROUTES.len()),
    );
    record("fuzz", "answered 2xx/3xx", tally.accepted);
    record("fuzz", "refused 4xx", tally.refused);
    record(
        "fuzz",
        "relay calls accepted (valid pool token)",
        tally.relay_calls_accepted,
    );
    record(
        "fuzz",
        "signed deliveries accepted",
        tally.signed_deliveries_accepted,
    );
    record("fuzz", "relay claims held for the cases", fx.held().claims);
    record(
        "fuzz",
        "5xx or changed-on-4xx found",
        usize::from(result.is_err()),
    );
    say(&format!(
        "[fuzz] {tried} inputs in {:.0} s",
        started.elapsed().as_secs_f64()
    ));
    rt.block_on(stack.stop())?;
    result.map_err(|e| {
        let added: Vec<String> = persisted_seeds()
            .into_iter()
            .filter(|l| !persisted.contains(l))
            .collect();
        let (why, case) = match &e {
            TestError::Fail(why, case) => (why.to_string(), format!("{case:#?}")),
            TestError::Abort(why) => (why.to_string(), "(aborted)".to_owned()),
        };
        let persisted_as = if added.is_empty() {
            "not persisted (a persisted seed failed again, or persistence is off)".to_owned()
        } else {
            let seeds: Vec<String> = added
                .iter()
                .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
                .collect();
            format!("persisted to {REGRESSIONS} as `{}` (commit it)", seeds.join("`, `"))
        };
        anyhow::anyhow!(
            "fuzz: {why}\nminimal failing case: {case}\n{persisted_as}\n\
             replay the persisted failures: TAKOSUMI_FUZZ_CASES=0 cargo test -p takosumi-tests --test fuzz -- --nocapture\n\
             replay this whole run: PROPTEST_RNG_SEED={seed} TAKOSUMI_FUZZ_CASES={cases} cargo test -p takosumi-tests --test fuzz -- --nocapture"
        )
    })
}

/// Creates a worker pool (with `key`'s public half, if any); returns its token.
async fn create_pool(
    stack: &Stack,
    ws: takosumi_core::WorkspaceId,
    name: &str,
    key: Option<&DeliveryKeyPair>,
) -> anyhow::Result<String> {
    let mut body = json!({ "name": name });
    if let Some(k) = key {
        body["deliveryKey"] = json!({
            "keyId": k.key_id(),
            "publicKey": base64::engine::general_purpose::STANDARD.encode(k.public().public)
        });
    }
    let r = probe::call(
        stack,
        "POST",
        &format!("/api/v1/workspaces/{ws}/pools"),
        Some(&stack.admin_token),
        &[],
        Some(body.to_string().as_bytes()),
    )
    .await?;
    anyhow::ensure!(r.status == 201, "pool {name}: {}", r.text);
    Ok(r.json["token"].as_str().unwrap_or_default().to_owned())
}

/// The fuzz's own credentials do what they say before any case relies on them: a signed
/// delivery verifies and a wrongly signed one does not, the pool token opens the relay
/// with the fixture's claim and no API route.
async fn credentials_work(stack: &Stack, fx: &Fixture) -> anyhow::Result<()> {
    let at = |path: &str| {
        ROUTES
            .iter()
            .position(|r| r.path == path)
            .ok_or_else(|| anyhow::anyhow!("no route {path}"))
    };
    let base = Case {
        route: at("/api/v1/webhooks/git")?,
        id: IdPick::Valid,
        auth: Auth::Missing,
        claim: None,
        webhook: None,
        idempotency_key: None,
        content_type: None,
        query: None,
        body: Body::Valid,
    };
    let ping = |sender, signature| Webhook {
        sender,
        signature,
        event: Some("ping".into()),
        delivery: None,
    };
    let checks = [
        (
            Case {
                webhook: Some(ping(Sender::GitHub, Signature::Signed)),
                ..base.clone()
            },
            200,
        ),
        (
            Case {
                webhook: Some(ping(Sender::GitLab, Signature::Signed)),
                ..base.clone()
            },
            200,
        ),
        (
            Case {
                webhook: Some(ping(Sender::GitHub, Signature::Altered)),
                ..base.clone()
            },
            401,
        ),
        (
            Case {
                route: at("/api/v1/relay/runs/{run}/progress")?,
                auth: Auth::Pool,
                claim: Some(ClaimPick::Current),
                body: Body::None,
                ..base.clone()
            },
            200,
        ),
        (
            Case {
                route: at("/api/v1/relay/runs/{run}/progress")?,
                auth: Auth::PoolRevoked,
                claim: Some(ClaimPick::Current),
                body: Body::None,
                ..base.clone()
            },
            401,
        ),
        (
            Case {
                route: at("/api/v1/workspaces/{ws}/runs")?,
                auth: Auth::Pool,
                body: Body::None,
                ..base.clone()
            },
            401,
        ),
    ];
    let http = reqwest::Client::new();
    for (c, want) in checks {
        let r = fx
            .request(&stack.api_url, &c)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut req = http.request(r.method, r.url.clone()).headers(r.headers);
        if let Some(b) = r.body {
            req = req.body(b);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        anyhow::ensure!(
            status == want,
            "{} {}: {status} {text}",
            c.route().method,
            r.url
        );
    }
    Ok(())
}
