//! Security suite: the role matrix over every endpoint, tampered artifacts, and a canary
//! sweep over everything the system stores, logs and answers. Real API, RabbitMQ,
//! Postgres, S3 server and terraform 1.0.3.
//!
//! Lockfile tampering (a modified artifact, one pointed at another Run's) is covered in
//! `lockfile.rs` (`apply_refuses_each_bad_lockfile_artifact_with_its_code`); the runner
//! sandbox (only the environment it was given, no checkout escapes, the tool's process
//! group killed) in `shared/runner/tests/sandbox.rs`.

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use takosumi_api::{Access, Action, Scope};
use takosumi_client::{Capsule, NewCapsule, PlanRequest, Source};
use takosumi_core::{Outcome, Role, RunId, RunMessage, RunStatus};
use takosumi_seal::Purpose;
use takosumi_seal::delivery::DeliveryKeyPair;
use takosumi_tests::probe::{self, record};
use takosumi_tests::{Endpoints, GitRepo, Options, Stack, Steps};
use takosumi_tests::{canary, keys_env};

async fn register(
    stack: &Stack,
    ws: takosumi_core::WorkspaceId,
    repo: &GitRepo,
    dir: &str,
) -> anyhow::Result<Capsule> {
    let req = NewCapsule {
        name: format!("c-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: dir.into(),
        tool: "terraform".into(),
        vars: json!({ "region": "eu" })
            .as_object()
            .cloned()
            .unwrap_or_default(),
    };
    Ok(stack.client.create_capsule(ws, &req).await?)
}

async fn workspace(stack: &Stack) -> anyhow::Result<takosumi_core::WorkspaceId> {
    Ok(stack
        .client
        .create_workspace(&format!(
            "ws-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .await?
        .id)
}

/// Submits a plan and runs the plan handler for it right here (the stack has no workers).
async fn plan_by_hand(stack: &Stack, capsule: &Capsule) -> anyhow::Result<RunId> {
    let run = stack.client.plan(capsule.id, None).await?;
    let outcome = takosumi_plan::handle(&stack.ctx, RunMessage { run_id: run.id }).await?;
    assert_eq!(outcome, Outcome::Done, "plan by hand");
    Ok(run.id)
}

/// Submits an apply of `plan` and runs the gate and apply handlers for it right here.
async fn apply_by_hand(stack: &Stack, plan: RunId) -> anyhow::Result<takosumi_client::Run> {
    let apply = stack.client.apply(plan, None).await?;
    let msg = RunMessage { run_id: apply.id };
    takosumi_gate::handle(&stack.ctx, msg).await?;
    let _ = takosumi_apply::handle(&stack.ctx, msg).await;
    Ok(stack.client.get_run(apply.id).await?)
}

/// What an endpoint requires of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    /// Anyone, no token (`/healthz`).
    Public,
    /// A signed webhook: a token is no substitute for the signature.
    Webhook,
    /// Any role in the Workspace.
    Read,
    /// Any role, instance-wide: a Workspace-limited token too (it sees only its own).
    InstanceRead,
    /// admin, operator.
    Operate,
    /// admin, operator, agent.
    Submit,
    /// admin of the Workspace.
    Admin,
    /// admin of the whole instance (a token limited to a Workspace may not).
    InstanceAdmin,
    /// The roles a held Run's approval counts from (approver, admin).
    Approve,
    /// A batch approval: 200 for every reader, but only approvers change anything.
    ApproveBatch,
    /// A relay worker's call: only a worker pool's token, never an API token of any role.
    PoolToken,
    /// A dashboard page or form: only a signed-in browser session; an API token of any
    /// role is no session (a page redirects to the sign-in page, a form is refused).
    Session,
}

/// A caller of the matrix.
struct Who {
    label: &'static str,
    /// The `Authorization` header, if any.
    auth: Option<String>,
    role: Option<&'static str>,
    /// Limited to another Workspace.
    scoped: bool,
}

impl Who {
    fn allowed(&self, need: Need) -> bool {
        if matches!(need, Need::PoolToken | Need::Session) {
            return false;
        }
        let Some(role) = self.role else {
            return matches!(need, Need::Public);
        };
        if self.scoped {
            return matches!(need, Need::Public | Need::InstanceRead);
        }
        match need {
            Need::Public | Need::Read | Need::InstanceRead | Need::ApproveBatch => true,
            Need::Webhook => false,
            Need::Operate => matches!(role, "admin" | "operator"),
            Need::Submit => matches!(role, "admin" | "operator" | "agent"),
            Need::Admin | Need::InstanceAdmin => role == "admin",
            Need::Approve => matches!(role, "admin" | "approver"),
            Need::PoolToken | Need::Session => false,
        }
    }

    /// The refusal this caller must get, when not allowed (`None`: an HTML page, no code).
    fn refusal(&self, need: Need, method: &str) -> (u16, Option<&'static str>) {
        if need == Need::Session {
            return (if method == "GET" { 303 } else { 401 }, None);
        }
        if need == Need::Webhook {
            return (401, Some("invalid_signature"));
        }
        if need == Need::PoolToken {
            return (401, Some("unauthorized"));
        }
        if self.role.is_none() {
            return (401, Some("unauthorized"));
        }
        if self.scoped {
            // Another Workspace's resources look like unknown ids; instance-wide
            // actions are forbidden.
            return if need == Need::InstanceAdmin {
                (403, Some("forbidden"))
            } else {
                (404, Some("not_found"))
            };
        }
        if need == Need::ApproveBatch {
            return (200, None);
        }
        (403, None)
    }
}

struct Endpoint {
    method: &'static str,
    /// The route template it exercises.
    template: &'static str,
    path: String,
    body: Option<String>,
    need: Need,
}

/// What the matrix expects of a route's callers, from the access the route declares.
fn need_of(access: Access) -> Need {
    match access {
        Access::Public => Need::Public,
        Access::WebhookSignature => Need::Webhook,
        Access::PoolToken => Need::PoolToken,
        Access::Session => Need::Session,
        Access::Token(Action::Read, Scope::Instance) => Need::InstanceRead,
        Access::Token(Action::Read, _) => Need::Read,
        Access::Token(Action::Operate, _) => Need::Operate,
        Access::Token(Action::Submit, _) => Need::Submit,
        Access::Token(Action::Administer, Scope::Instance) => Need::InstanceAdmin,
        Access::Token(Action::Administer, _) => Need::Admin,
        // A group approval answers every reader, counting only the rule's roles.
        Access::Token(Action::Approve, Scope::RunGroup) => Need::ApproveBatch,
        Access::Token(Action::Approve, _) => Need::Approve,
    }
}

/// The route template a concrete path (query string ignored) is an instance of: literal
/// segments equal, `{…}` segments anything; the most literal match wins.
fn template_of<'a>(
    table: &'a [takosumi_api::Endpoint],
    method: &str,
    path: &str,
) -> Option<&'a takosumi_api::Endpoint> {
    let path = path.split('?').next().unwrap_or_default();
    let segments: Vec<&str> = path.split('/').collect();
    table
        .iter()
        .filter(|r| r.method.as_str() == method)
        .filter_map(|r| {
            let t: Vec<&str> = r.path.split('/').collect();
            if t.len() != segments.len() {
                return None;
            }
            let mut literal = 0;
            for (a, b) in t.iter().zip(&segments) {
                if a.starts_with('{') {
                    continue;
                }
                if a != b {
                    return None;
                }
                literal += 1;
            }
            Some((literal, r))
        })
        .max_by_key(|(literal, _)| *literal)
        .map(|(_, r)| r)
}

async fn send(stack: &Stack, w: &Who, ep: &Endpoint) -> anyhow::Result<probe::Response> {
    let headers: Vec<(&str, &str)> = w
        .auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    probe::call(
        stack,
        ep.method,
        &ep.path,
        None,
        &headers,
        ep.body.as_deref().map(str::as_bytes),
    )
    .await
}

/// The promise: every endpoint that exists, called by tokens of each role (viewer,
/// operator, approver, admin, agent), by an admin token limited to another Workspace,
/// with no token, a wrong token and a malformed header: only what the role allows gets
/// through; everything else is 401/403/404 with a code (a Workspace-limited token sees
/// other Workspaces' resources as unknown) and changes nothing — not a row, not a column.
/// Tokens are stored only as hashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_role_reaches_only_what_it_may() -> anyhow::Result<()> {
    let stack = Stack::start_on(
        Options {
            steps: Steps::API_ONLY,
            ..Options::default()
        },
        &Endpoints {
            // Nothing moves by itself while the matrix runs.
            settings: vec![("TAKOSUMI_STUCK_QUEUED_SECS".into(), "3600".into())],
            ..Endpoints::default()
        },
    )
    .await?;
    let pool = stack.ctx.pool.clone();
    let repo = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let other_ws = workspace(&stack).await?;
    let capsule = register(&stack, ws, &repo, "infra/network").await?;
    let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let mut tokens: Vec<(String, &'static str, bool)> = Vec::new();
    let mut who = vec![
        Who {
            label: "none",
            auth: None,
            role: None,
            scoped: false,
        },
        Who {
            label: "wrong token",
            auth: Some("Bearer tks_not_a_token".into()),
            role: None,
            scoped: false,
        },
        Who {
            label: "malformed header",
            auth: Some("Basic dGFrb3N1bWk6eA==".into()),
            role: None,
            scoped: false,
        },
    ];
    for role in ["viewer", "operator", "approver", "admin", "agent"] {
        let token = format!("tks_matrix_{role}_{id}");
        takosumi_store::tokens::upsert(
            &pool,
            &token,
            &format!("matrix-{role}"),
            role.parse()?,
            None,
        )
        .await?;
        tokens.push((token.clone(), role, false));
        who.push(Who {
            label: role,
            auth: Some(format!("Bearer {token}")),
            role: Some(role),
            scoped: false,
        });
    }
    let scoped = format!("tks_matrix_scoped_{id}");
    takosumi_store::tokens::upsert(&pool, &scoped, "matrix-scoped", Role::Admin, Some(other_ws))
        .await?;
    tokens.push((scoped.clone(), "admin", true));
    who.push(Who {
        label: "admin of another Workspace",
        auth: Some(format!("Bearer {scoped}")),
        role: Some("admin"),
        scoped: true,
    });
    let agent_token = tokens
        .iter()
        .find(|t| t.1 == "agent")
        .map(|t| t.0.clone())
        .unwrap();

    // The fixture: a planned Run, a queued one, an agent's held one, a group, a binding.
    let planned = plan_by_hand(&stack, &capsule).await?;
    let queued = stack.client.plan(capsule.id, None).await?.id;
    let held = probe::call(
        &stack,
        "POST",
        &format!("/api/v1/capsules/{}/plan", capsule.id),
        Some(&agent_token),
        &[],
        None,
    )
    .await?;
    assert_eq!(held.status, 202, "{}", held.text);
    assert_eq!(
        held.json["status"], "held",
        "an agent's plan is held: {}",
        held.text
    );
    let held = held.json["id"].as_str().unwrap().to_owned();
    let group = probe::call(
        &stack,
        "POST",
        &format!("/api/v1/workspaces/{ws}/plan-update"),
        Some(&stack.admin_token),
        &[],
        None,
    )
    .await?;
    assert_eq!(group.status, 202, "{}", group.text);
    let group = group.json["id"].as_str().unwrap().to_owned();
    let binding = probe::call(
        &stack,
        "POST",
        &format!("/api/v1/workspaces/{ws}/provider-bindings"),
        Some(&stack.admin_token),
        &[],
        Some(br#"{"name":"cloud","kind":"env","env":{"CLOUD_TOKEN":"matrix-value"}}"#),
    )
    .await?;
    assert_eq!(binding.status, 201, "{}", binding.text);
    let pb = binding.json["id"].as_str().unwrap().to_owned();
    let worker_pool = probe::call(
        &stack,
        "POST",
        &format!("/api/v1/workspaces/{ws}/pools"),
        Some(&stack.admin_token),
        &[],
        Some(br#"{"name":"matrix-pool"}"#),
    )
    .await?;
    assert_eq!(worker_pool.status, 201, "{}", worker_pool.text);
    let attach_body = format!(r#"{{"bindingId":"{pb}"}}"#);
    let attach = probe::call(
        &stack,
        "POST",
        &format!("/api/v1/capsules/{}/provider-bindings", capsule.id),
        Some(&stack.admin_token),
        &[],
        Some(attach_body.as_bytes()),
    )
    .await?;
    assert!(attach.status < 300, "{}", attach.text);

    let cap = capsule.id;
    let viewer_token = tokens
        .iter()
        .find(|t| t.1 == "viewer")
        .map(|t| t.0.clone())
        .unwrap();
    let sign_in_form = format!("token={viewer_token}&next=/");
    // A token to revoke (a second revocation is 409 `already_revoked`, not a refusal).
    let made_token = takosumi_store::tokens::upsert(
        &pool,
        &format!("tks_matrix_revocable_{id}"),
        "matrix-revocable",
        Role::Viewer,
        None,
    )
    .await?;
    let new_capsule = json!({"name": "n2", "source": {"repo": repo.url(), "branch": "main"}, "dir": "infra/network", "tool": "terraform"}).to_string();
    let e = |method: &'static str, path: String, body: Option<&str>| {
        (method, path, body.map(str::to_owned))
    };
    let fixtures = vec![
        e("GET", "/healthz".into(), None),
        e(
            "POST",
            format!("/api/v1/webhooks/git?workspace={ws}"),
            Some(r#"{"ref":"refs/heads/main"}"#),
        ),
        e(
            "POST",
            "/api/v1/workspaces".into(),
            Some(r#"{"name":"matrix-new"}"#),
        ),
        e("GET", "/api/v1/dead-letters".into(), None),
        e(
            "POST",
            "/api/v1/dead-letters/requeue".into(),
            Some(r#"{"queue":"run.plan"}"#),
        ),
        e(
            "POST",
            "/api/v1/dead-letters/purge".into(),
            Some(r#"{"queue":"run.plan"}"#),
        ),
        e(
            "POST",
            format!("/api/v1/workspaces/{ws}/capsules"),
            Some(&new_capsule),
        ),
        e("GET", format!("/api/v1/capsules/{cap}"), None),
        e("DELETE", format!("/api/v1/capsules/{cap}"), None),
        e("POST", format!("/api/v1/capsules/{cap}/plan"), None),
        e("GET", format!("/api/v1/runs/{planned}"), None),
        e("GET", format!("/api/v1/runs/{planned}/events"), None),
        e("GET", format!("/api/v1/runs/{planned}/logs"), None),
        e("GET", format!("/api/v1/runs/{planned}/cost"), None),
        e("POST", format!("/api/v1/runs/{planned}/apply"), None),
        e("POST", format!("/api/v1/runs/{held}/approve"), None),
        e("POST", format!("/api/v1/runs/{queued}/cancel"), None),
        e(
            "POST",
            format!("/api/v1/runs/{planned}/resolve"),
            Some(r#"{"action":"mark_resolved","note":"checked"}"#),
        ),
        e("GET", format!("/api/v1/workspaces/{ws}/runs"), None),
        e("GET", format!("/api/v1/workspaces/{ws}/activity"), None),
        e("PUT", format!("/api/v1/workspaces/{ws}/rules"), Some("{}")),
        e("GET", format!("/api/v1/workspaces/{ws}/rules"), None),
        e("PUT", format!("/api/v1/capsules/{cap}/rules"), Some("{}")),
        e("GET", format!("/api/v1/capsules/{cap}/rules"), None),
        e(
            "POST",
            format!("/api/v1/workspaces/{ws}/provider-bindings"),
            Some(r#"{"name":"other","kind":"env","env":{"OTHER_TOKEN":"v"}}"#),
        ),
        e(
            "GET",
            format!("/api/v1/workspaces/{ws}/provider-bindings"),
            None,
        ),
        e(
            "POST",
            format!("/api/v1/capsules/{cap}/provider-bindings"),
            Some(&attach_body),
        ),
        e(
            "GET",
            format!("/api/v1/capsules/{cap}/provider-bindings"),
            None,
        ),
        e(
            "DELETE",
            format!("/api/v1/capsules/{cap}/provider-bindings/{pb}"),
            None,
        ),
        e(
            "POST",
            format!("/api/v1/workspaces/{ws}/webhook-secret"),
            None,
        ),
        e(
            "PATCH",
            format!("/api/v1/capsules/{cap}/settings"),
            Some("{}"),
        ),
        e(
            "PATCH",
            format!("/api/v1/workspaces/{ws}/settings"),
            Some("{}"),
        ),
        e("POST", format!("/api/v1/capsules/{cap}/drift-check"), None),
        e("POST", format!("/api/v1/workspaces/{ws}/drift-check"), None),
        e("GET", format!("/api/v1/workspaces/{ws}/drift"), None),
        e("GET", format!("/api/v1/workspaces/{ws}/capsules"), None),
        e("POST", format!("/api/v1/workspaces/{ws}/plan-update"), None),
        e("GET", format!("/api/v1/run-groups/{group}"), None),
        e("POST", format!("/api/v1/run-groups/{group}/approve"), None),
        e("POST", format!("/api/v1/run-groups/{group}/apply"), None),
        e(
            "POST",
            format!("/api/v1/workspaces/{ws}/pools"),
            Some(r#"{"name":"matrix-pool-2"}"#),
        ),
        e(
            "POST",
            "/api/v1/pools/matrix-pool/delivery-key".into(),
            Some(
                r#"{"keyId":"matrix-k1","publicKey":"AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA="}"#,
            ),
        ),
        e(
            "PUT",
            format!("/api/v1/capsules/{cap}/pool"),
            Some(r#"{"pool":null}"#),
        ),
        e("POST", "/api/v1/relay/claim".into(), None),
        e(
            "POST",
            format!("/api/v1/relay/runs/{planned}/progress"),
            Some("{}"),
        ),
        e(
            "POST",
            format!("/api/v1/relay/runs/{planned}/fail"),
            Some(r#"{"code":"plan_failed","message":"x"}"#),
        ),
        e(
            "POST",
            format!("/api/v1/relay/runs/{planned}/scanned"),
            Some(r#"{"scanReport":{"findings":[],"unreadable":[],"modulesRead":[]}}"#),
        ),
        e(
            "POST",
            format!("/api/v1/relay/runs/{planned}/one-step"),
            Some(
                r#"{"commit":"a","treeDigest":"b","toolVersion":{},"providerLockDigest":null,"injectedEnvNames":[]}"#,
            ),
        ),
        // Signed evidence: read like the Run and Workspace records; the public
        // keys are public, a verifier must be able to fetch them from anywhere.
        e("GET", format!("/api/v1/runs/{planned}/evidence"), None),
        e("GET", format!("/api/v1/workspaces/{ws}/evidence"), None),
        e("GET", "/api/v1/evidence/keys".into(), None),
        e("GET", "/api/v1/openapi.json".into(), None),
        e("GET", "/api/v1/workspaces".into(), None),
        // Token management: instance admins only.
        e(
            "POST",
            "/api/v1/tokens".into(),
            Some(r#"{"name":"matrix-made","role":"viewer"}"#),
        ),
        e("GET", "/api/v1/tokens".into(), None),
        e("DELETE", format!("/api/v1/tokens/{made_token}"), None),
        // What a reviewer reads, like the Run record.
        e("GET", format!("/api/v1/runs/{planned}/plan"), None),
        e("GET", format!("/api/v1/runs/{planned}/approvals"), None),
        e("GET", format!("/api/v1/runs/{planned}/stream"), None),
        // The dashboard: its pages and forms need a browser session (an API token is
        // none); signing in and the assets are public.
        e("GET", "/sign-in".into(), None),
        e("POST", "/sign-in".into(), Some(&sign_in_form)),
        e(
            "GET",
            "/assets/{file}".replace("{file}", "dashboard.css"),
            None,
        ),
        e("GET", "/".into(), None),
        e("POST", "/sign-out".into(), Some("csrf=x")),
        e("GET", format!("/workspaces/{ws}"), None),
        e("GET", format!("/capsules/{cap}"), None),
        e("POST", format!("/capsules/{cap}/install"), Some("csrf=x")),
        e("POST", format!("/capsules/{cap}/plan"), Some("csrf=x")),
        e(
            "POST",
            format!("/capsules/{cap}/drift-check"),
            Some("csrf=x"),
        ),
        e("POST", format!("/capsules/{cap}/destroy"), Some("csrf=x")),
        e("GET", format!("/runs/{planned}"), None),
        e("GET", format!("/runs/{planned}/stream"), None),
        e("POST", format!("/runs/{held}/approve"), Some("csrf=x")),
        e("POST", format!("/runs/{planned}/apply"), Some("csrf=x")),
        e("POST", format!("/runs/{queued}/cancel"), Some("csrf=x")),
        e("POST", format!("/runs/{planned}/resolve"), Some("csrf=x")),
        e("POST", format!("/api/v1/capsules/{cap}/apply"), Some("{}")),
        e(
            "PUT",
            format!("/api/v1/relay/runs/{planned}/plan-file"),
            Some("not a plan"),
        ),
        e(
            "POST",
            format!("/api/v1/relay/runs/{planned}/planned"),
            Some("{}"),
        ),
        e(
            "POST",
            format!("/api/v1/relay/runs/{planned}/applied"),
            Some("{}"),
        ),
        e(
            "POST",
            format!("/api/v1/relay/runs/{planned}/canceled"),
            Some("{}"),
        ),
    ];
    // What each endpoint requires comes from the API's own route table (default-deny: a
    // route cannot be mounted without it); a route with no fixture here fails the test.
    let table = takosumi_api::endpoints();
    let mut endpoints = Vec::new();
    for (method, path, body) in fixtures {
        let template = template_of(&table, method, &path)
            .unwrap_or_else(|| panic!("{method} {path} is not a route of the API"));
        endpoints.push(Endpoint {
            method,
            need: need_of(template.access),
            template: template.path,
            path,
            body,
        });
    }
    let uncovered: Vec<String> = table
        .iter()
        .filter(|route| {
            endpoints
                .iter()
                .filter(|e| e.method == route.method.as_str() && e.template == route.path)
                .count()
                != 1
        })
        .map(|route| format!("{} {}", route.method, route.path))
        .collect();
    assert!(
        uncovered.is_empty(),
        "routes without exactly one fixture in the role matrix: {uncovered:?}"
    );

    // Refusals first: each leaves every row and column as it was.
    let mut tried = 0usize;
    let mut refused = 0usize;
    for ep in &endpoints {
        for w in &who {
            if w.allowed(ep.need) {
                continue;
            }
            let before = probe::fingerprint(&pool).await?;
            let r = send(&stack, w, ep).await?;
            tried += 1;
            let (status, code) = w.refusal(ep.need, ep.method);
            let what = format!("{} {} as {}", ep.method, ep.path, w.label);
            assert_eq!(r.status, status, "{what}: {}", r.text);
            if ep.need == Need::Session {
                refused += 1;
                // A signed-in page carries the sign-out form.
                assert!(
                    !r.text.contains("Sign out"),
                    "{what}: a page was served without a session"
                );
            } else if status >= 400 {
                refused += 1;
                let got = r.json["code"].as_str().unwrap_or_default();
                assert!(!got.is_empty(), "{what}: no code: {}", r.text);
                if let Some(code) = code {
                    assert_eq!(got, code, "{what}: {}", r.text);
                }
                assert!(
                    r.json["message"].as_str().is_some_and(|m| !m.is_empty()),
                    "{what}"
                );
            }
            assert_eq!(
                probe::fingerprint(&pool).await?,
                before,
                "{what} changed stored data"
            );
        }
    }
    // Then what each role may do goes through the role check (a state conflict such as
    // 409 `apply_exists` after an earlier caller applied is the endpoint's answer, not a
    // refusal).
    for ep in &endpoints {
        for w in &who {
            if !w.allowed(ep.need) {
                continue;
            }
            if ep.method == "DELETE" && ep.path.contains("/provider-bindings/") {
                // re-attach (as admin) before each detach
                let attach = endpoints
                    .iter()
                    .find(|e| {
                        e.method == "POST"
                            && e.template == "/api/v1/capsules/{cap}/provider-bindings"
                    })
                    .expect("the attach fixture");
                send(&stack, &who[6], attach).await?;
            }
            let r = send(&stack, w, ep).await?;
            tried += 1;
            let what = format!("{} {} as {}", ep.method, ep.path, w.label);
            assert!(
                r.status < 500 && ![401, 403, 404].contains(&r.status),
                "{what} was refused or failed: {} {}",
                r.status,
                r.text
            );
        }
    }
    // A Workspace-limited token works inside its Workspace.
    let own = probe::call(
        &stack,
        "GET",
        &format!("/api/v1/workspaces/{other_ws}/runs"),
        Some(&scoped),
        &[],
        None,
    )
    .await?;
    assert_eq!(own.status, 200, "{}", own.text);
    // Only hashes are stored.
    let dump = probe::dump_tables(&pool).await?;
    for (token, _, _) in &tokens {
        assert!(
            !dump.iter().any(|(_, row)| row.contains(token.as_str())),
            "a token is stored in clear"
        );
    }
    probe::say(&format!(
        "role matrix: {} endpoints × {} callers, {tried} calls, {refused} refused",
        endpoints.len(),
        who.len()
    ));
    record("security", "role matrix: calls", tried);
    record(
        "security",
        "role matrix: refusals checked unchanged",
        refused,
    );
    stack.stop().await
}

/// The promise: tampered artifacts are refused with their code and nothing is applied.
/// A sealed plan swapped for another Run's fails `plan_digest_mismatch` (it does not open
/// under this Run's id); the other Run's plan unsealed and re-sealed under this Run's id
/// opens, but fails `plan_digest_mismatch` (not the reviewed digest); a state object
/// altered in storage, or swapped for another StateVersion's, makes the next plan fail
/// `state_integrity` before any tool starts. The Capsule's generation never moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tampered_plans_and_states_are_refused_with_their_codes() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let ws = workspace(&stack).await?;
    let capsule = register(&stack, ws, &repo, "infra/network").await?;
    let a = plan_by_hand(&stack, &capsule).await?;
    // B plans another region: two plans of the same inputs within one second are the same
    // bytes (the plan file's zip timestamps have one-second resolution), and then B's plan
    // *is* the reviewed one.
    let (s, body) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/plan", capsule.id),
            json!({ "vars": { "region": "us" } }),
        )
        .await?;
    assert_eq!(s, 202, "{body}");
    let b: RunId = body["id"].as_str().unwrap_or_default().parse()?;
    let outcome = takosumi_plan::handle(&stack.ctx, RunMessage { run_id: b }).await?;
    assert_eq!(outcome, Outcome::Done, "plan B by hand");
    let digest_of = |run: RunId| {
        let pool = stack.ctx.pool.clone();
        async move {
            takosumi_store::runs::get(&pool, run)
                .await
                .ok()
                .flatten()
                .and_then(|r| r.plan_digest)
        }
    };
    assert_ne!(
        digest_of(a).await,
        digest_of(b).await,
        "A and B must be different plans"
    );
    let key_of = |run: RunId| {
        let pool = stack.ctx.pool.clone();
        async move {
            takosumi_store::runs::get(&pool, run)
                .await
                .ok()
                .flatten()
                .and_then(|r| r.plan_object_key)
                .expect("a sealed plan")
        }
    };
    let (ka, kb) = (key_of(a).await, key_of(b).await);
    let original_a = stack.ctx.objects.get(&ka, 64 << 20).await?;
    let sealed_b = stack.ctx.objects.get(&kb, 64 << 20).await?;
    let mut refused = 0;

    // 1. Swapped: B's sealed plan at A's key.
    stack.ctx.objects.put(&ka, sealed_b.clone()).await?;
    let run = apply_by_hand(&stack, a).await?;
    assert_eq!(run.status, RunStatus::Failed, "{run:?}");
    assert_eq!(
        run.error.as_ref().map(|e| e.code.as_str()),
        Some("plan_digest_mismatch")
    );
    refused += 1;

    // 2. Re-sealed: B's plan bytes sealed under A's id (opens, but is not what was reviewed).
    let b_bytes = stack
        .ctx
        .sealer
        .unseal(Purpose::Plan, &b.to_string(), &sealed_b)?;
    let resealed = stack
        .ctx
        .sealer
        .seal(Purpose::Plan, &a.to_string(), &b_bytes)?;
    stack.ctx.objects.put(&ka, resealed).await?;
    let run = apply_by_hand(&stack, a).await?;
    assert_eq!(run.status, RunStatus::Failed, "{run:?}");
    assert_eq!(
        run.error.as_ref().map(|e| e.code.as_str()),
        Some("plan_digest_mismatch")
    );
    refused += 1;
    assert_eq!(
        stack.tool_count("apply"),
        0,
        "a tampered plan reached the tool"
    );
    let cap_now = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(cap_now.state_generation, 0);
    stack.ctx.objects.put(&ka, original_a).await?;

    // A real apply (B's intact plan) moves the Capsule to generation 1.
    let applied = apply_by_hand(&stack, b).await?;
    assert_eq!(applied.status, RunStatus::Applied, "{applied:?}");
    let sv = applied.state_version_id.expect("a StateVersion");
    let sv_row = takosumi_store::states::versions::get(&stack.ctx.pool, sv)
        .await?
        .expect("row");
    let good_state = stack.ctx.objects.get(&sv_row.object_key, 64 << 20).await?;

    // 3. The state object altered: the next plan fails `state_integrity`, no tool runs.
    let mut altered = good_state.clone();
    let mid = altered.len() / 2;
    altered[mid] ^= 0x40;
    stack.ctx.objects.put(&sv_row.object_key, altered).await?;
    let inits = stack.tool_count("init");
    let run = stack.client.plan(capsule.id, None).await?;
    let outcome = takosumi_plan::handle(&stack.ctx, RunMessage { run_id: run.id }).await?;
    assert_eq!(
        outcome,
        Outcome::Failed(takosumi_core::FailureCode::StateIntegrity)
    );
    let run = stack.client.get_run(run.id).await?;
    let err = run.error.clone().expect("an error");
    assert_eq!(err.code, "state_integrity", "{run:?}");
    assert!(
        !err.message.contains(&sv_row.object_key),
        "the message names an object key"
    );
    assert_eq!(
        stack.tool_count("init"),
        inits,
        "a tool started on a tampered state"
    );
    refused += 1;

    // 4. Another StateVersion's object (valid, sealed under its own id) in its place.
    let other_cap = register(&stack, ws, &repo, "infra/network").await?;
    let other_plan = plan_by_hand(&stack, &other_cap).await?;
    let other_apply = apply_by_hand(&stack, other_plan).await?;
    let other_sv = takosumi_store::states::versions::get(
        &stack.ctx.pool,
        other_apply.state_version_id.expect("sv"),
    )
    .await?
    .expect("row");
    let foreign = stack
        .ctx
        .objects
        .get(&other_sv.object_key, 64 << 20)
        .await?;
    stack.ctx.objects.put(&sv_row.object_key, foreign).await?;
    let run = stack.client.plan(capsule.id, None).await?;
    let outcome = takosumi_plan::handle(&stack.ctx, RunMessage { run_id: run.id }).await?;
    assert_eq!(
        outcome,
        Outcome::Failed(takosumi_core::FailureCode::StateIntegrity)
    );
    refused += 1;

    // Nothing was applied on top of a tampered artifact.
    let cap_now = stack.client.get_capsule(capsule.id).await?;
    assert_eq!(cap_now.state_generation, 1);
    assert_eq!(cap_now.current_state_version_id, Some(sv));
    assert_eq!(
        stack.tool_count("apply"),
        2,
        "only the two intact applies ran"
    );
    // Put back, the state plans again.
    stack
        .ctx
        .objects
        .put(&sv_row.object_key, good_state)
        .await?;
    let again = plan_by_hand(&stack, &capsule).await?;
    assert_eq!(
        stack.client.get_run(again).await?.status,
        RunStatus::Planned
    );
    record("security", "tampered artifacts refused", refused);
    stack.stop().await
}

/// A Capsule whose plan carries a sensitive variable, a sensitive output whose value is
/// no input (`minted`: only the plan's sensitive marker names it), and whose provisioner
/// prints every credential kind and the sensitive variable; `fail` makes the apply fail
/// after printing them. The defaults let a drift check (which gets no sensitive variables)
/// plan it too.
fn canary_config(fail: bool) -> String {
    let tail = if fail { "; exit 3" } else { "" };
    format!(
        r#"variable "region" {{
  type = string
}}

variable "seed" {{
  type    = string
  default = "none"
}}

variable "db_password" {{
  type      = string
  sensitive = true
  default   = "unset"
}}

locals {{
  minted = "CanaryOut${{substr(sha256(var.seed), 0, 20)}}&<>"
}}

resource "null_resource" "echo" {{
  triggers = {{
    region = var.region
  }}
  provisioner "local-exec" {{
    command     = "echo token=$CANARY_CLOUD_TOKEN tk=$TAKOSUMI_TOKEN cmd=$CMD_CRED pw=$PW{tail}"
    environment = {{ PW = nonsensitive(var.db_password) }}
  }}
}}

output "vpc" {{
  value = "vpc-${{var.region}}"
}}

output "conn" {{
  value     = "postgres://app:${{var.db_password}}@db"
  sensitive = true
}}

output "minted" {{
  value     = local.minted
  sensitive = true
}}
"#
    )
}

/// The value `canary_config`'s `minted` output takes for `seed`.
fn minted(seed: &str) -> String {
    use sha2::Digest;
    let digest = hex::encode(sha2::Sha256::digest(seed.as_bytes()));
    format!("CanaryOut{}&<>", &digest[..20])
}

/// A Capsule of `repo` in `ws` with `vars`.
async fn register_with(
    stack: &Stack,
    ws: takosumi_core::WorkspaceId,
    repo: &GitRepo,
    vars: Value,
) -> anyhow::Result<Capsule> {
    let req = NewCapsule {
        name: format!("c-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
        source: Source {
            repo: repo.url(),
            branch: "main".into(),
        },
        dir: "infra/canary".into(),
        tool: "terraform".into(),
        vars: vars.as_object().cloned().unwrap_or_default(),
    };
    Ok(stack.client.create_capsule(ws, &req).await?)
}

/// The password in a `scheme://user:password@host/…` URL.
fn url_password(url: &str) -> String {
    url.split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, p)| p.to_owned())
        .unwrap_or_else(|| panic!("no password in a settings URL"))
}

/// The services' log files the local stack writes (Postgres, RabbitMQ, the S3 server) and
/// their current lengths: the sweep reads what was appended after this.
fn service_logs() -> Vec<(std::path::PathBuf, u64)> {
    let stack_dir =
        std::env::var("TAKOSUMI_STACK").unwrap_or_else(|_| "/var/tmp/takosumi-stack".into());
    let mut out = Vec::new();
    for dir in [
        "/var/log/postgresql".to_owned(),
        "/var/log/rabbitmq".to_owned(),
        format!("{stack_dir}/logs"),
    ] {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = e.path();
            if path.extension().is_some_and(|x| x == "log")
                && let Ok(meta) = std::fs::metadata(&path)
            {
                out.push((path, meta.len()));
            }
        }
    }
    out
}

/// What `path` got after its first `from` bytes (`None`: unreadable).
fn appended(path: &std::path::Path, from: u64) -> Option<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    f.seek(SeekFrom::Start(from)).ok()?;
    let mut out = Vec::new();
    f.read_to_end(&mut out).ok()?;
    Some(out)
}

/// A relay worker process of a pool, logging at debug level to `log`.
fn spawn_relay_logged(
    stack: &Stack,
    token: &str,
    keys: &str,
    work: &std::path::Path,
    log: &std::path::Path,
) -> anyhow::Result<tokio::process::Child> {
    let env = stack.env_vars();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    Ok(
        tokio::process::Command::new(takosumi_tests::binary("takosumi-relay")?)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", DEBUG_LOG)
            .env("TAKOSUMI_DEPLOY_CONTROL_URL", &stack.api_url)
            .env("TAKOSUMI_POOL_TOKEN", token)
            .env("TAKOSUMI_DELIVERY_KEYS", keys)
            .env("TAKOSUMI_TERRAFORM_BIN", &env["TAKOSUMI_TERRAFORM_BIN"])
            .env("TAKOSUMI_TF_CLI_CONFIG", &env["TAKOSUMI_TF_CLI_CONFIG"])
            .env(
                "TAKOSUMI_SANDBOX_RO_PATHS",
                &env["TAKOSUMI_SANDBOX_RO_PATHS"],
            )
            .env(
                "TAKOSUMI_SANDBOX_RW_PATHS",
                &env["TAKOSUMI_SANDBOX_RW_PATHS"],
            )
            .env("TAKOSUMI_WORK_DIR", work)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::from(file.try_clone()?))
            .stderr(std::process::Stdio::from(file))
            .kill_on_drop(true)
            .spawn()?,
    )
}

/// Every process at debug level, less the libraries' own chatter.
const DEBUG_LOG: &str = "debug,sqlx=warn,lapin=info,aws_smithy_runtime=info,aws_smithy_runtime_api=info,aws_config=info,aws_sdk_s3=info,hyper=info,hyper_util=info,h2=info,rustls=info,tower=info,reqwest=info";

/// Every message published in the stack's vhost, through RabbitMQ's firehose: tracing is
/// turned on for the vhost and a queue bound to `amq.rabbitmq.trace` gets a copy of each
/// publish, whatever its exchange or routing key (step queues, pool queues, dead letters).
struct Tap {
    conn: lapin::Connection,
    channel: lapin::Channel,
}

const TAP_QUEUE: &str = "canary.tap";

impl Tap {
    async fn start(stack: &Stack) -> anyhow::Result<Self> {
        let amqp = stack.env_vars()["TAKOSUMI_AMQP_URL"].clone();
        let vhost = amqp
            .rsplit_once('/')
            .map(|(_, v)| v.to_owned())
            .unwrap_or_default();
        let mgmt = std::env::var("TAKOSUMI_RABBITMQ_MGMT_URL")?;
        reqwest::Client::new()
            .put(format!("{mgmt}/api/vhosts/{vhost}"))
            .basic_auth(
                std::env::var("TAKOSUMI_RABBITMQ_MGMT_USER")?,
                Some(std::env::var("TAKOSUMI_RABBITMQ_MGMT_PASSWORD")?),
            )
            .json(&json!({ "tracing": true }))
            .send()
            .await?
            .error_for_status()?;
        let conn =
            lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        channel
            .queue_declare(
                TAP_QUEUE.into(),
                lapin::options::QueueDeclareOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                TAP_QUEUE.into(),
                "amq.rabbitmq.trace".into(),
                "publish.#".into(),
                lapin::options::QueueBindOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await?;
        Ok(Self { conn, channel })
    }

    /// Closes the tap's connection (before the vhost goes).
    async fn close(self) -> anyhow::Result<()> {
        self.conn.close(200, "done".into()).await?;
        Ok(())
    }

    /// Every copy so far: `(routing key of the copy, properties and headers, body)`.
    async fn drain(&self) -> anyhow::Result<Vec<(String, String, Vec<u8>)>> {
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(
                TAP_QUEUE.into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await?
        {
            let d = m.delivery;
            out.push((
                d.routing_key.to_string(),
                format!("{:?}", d.properties),
                d.data,
            ));
        }
        Ok(out)
    }
}

/// Waits until every Run of `ws` of `kind` is terminal and there are at least `n`.
async fn wait_runs_of(
    stack: &Stack,
    ws: takosumi_core::WorkspaceId,
    kind: takosumi_core::RunKind,
    n: usize,
) -> anyhow::Result<Vec<takosumi_client::Run>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let page = stack
            .client
            .list_runs(
                ws,
                &takosumi_client::RunQuery {
                    kind: Some(kind),
                    limit: Some(100),
                    ..takosumi_client::RunQuery::default()
                },
            )
            .await?;
        if page.runs.len() >= n {
            let mut done = Vec::new();
            for r in &page.runs {
                done.push(stack.wait(r.id).await?);
            }
            return Ok(done);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{} {kind:?} Runs of {ws}, want {n}",
            page.runs.len()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The promise: no credential (of every kind: env, token, command), sensitive variable,
/// sensitive output or secret of the server's own (seal key, evidence key, admin token,
/// database, broker and S3 passwords, a pool's token and delivery key) is ever stored,
/// logged, published or answered in clear or in any common encoding. Runs go through
/// every process kind, each its own logged process at debug level — the API (with its
/// outbox relay and reaper), plan, gate, approve, apply, drift, a sweep pass and a pool's
/// relay worker — a successful apply held for approval, a failed one, a pool's plan and
/// apply, and the sweep's drift checks on the control node and on the pool. Then every
/// canary is searched ([`takosumi_tests::canary`]: raw, base64/base64url at all three
/// alignments, hex, URL- and JSON-escaped) in every process's log, the services' logs
/// (Postgres logging every statement of the test's database with its parameters,
/// RabbitMQ, the S3 server), every message published in the vhost (RabbitMQ's firehose),
/// every row of every table, every stored object's raw bytes (each must be sealed) and
/// every API response: zero hits. Each Run's private directory is gone afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn canary_secrets_appear_nowhere() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps {
            api: false,
            plan: false,
            gate: false,
            apply: false,
        },
        ..Options::default()
    })
    .await?;
    // Postgres logs every statement of this database, with its parameters, from here on
    // (the step processes connect after this): what the processes send it is swept too.
    let db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&stack.ctx.pool)
        .await?;
    sqlx::query(&format!(
        "ALTER DATABASE \"{db}\" SET log_statement = 'all'"
    ))
    .execute(&stack.ctx.pool)
    .await?;
    sqlx::query(&format!(
        "ALTER DATABASE \"{db}\" SET log_parameter_max_length = -1"
    ))
    .execute(&stack.ctx.pool)
    .await?;
    let services = service_logs();
    let tap = Tap::start(&stack).await?;

    let logs = tempfile::tempdir()?;
    let log_of = |p: &str| logs.path().join(format!("{p}.log"));
    let mut procs = Vec::new();
    for step in ["api", "plan", "gate", "approve", "apply", "drift"] {
        procs.push(stack.spawn_process_logged(step, &[("RUST_LOG", DEBUG_LOG)], &log_of(step))?);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while probe::call(&stack, "GET", "/healthz", None, &[], None)
        .await
        .map(|r| r.status)
        .unwrap_or(0)
        != 200
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the API process never answered: {}",
            std::fs::read_to_string(log_of("api")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    // Characters that URL and JSON encoders escape, so those encodings are searched for
    // something that differs from the raw value.
    let cred = format!("CanaryCred{}+/=", &id[..16]);
    let token = format!("CanaryTok{}+/=", &id[16..]);
    let cmd = format!("CanaryCmd{}+/=", &id[..16]);
    let var = format!("CanaryVar{}&+/=", &id[16..]);
    let seed = format!("seed-{id}");
    let out = minted(&seed);
    let relay_cred = format!("CanaryRelayCred{}+/=", &id[..12]);
    let relay_var = format!("CanaryRelayVar{}&+/=", &id[12..24]);
    let relay_seed = format!("relay-seed-{id}");
    let relay_out = minted(&relay_seed);

    let mut sweep = canary::Sweep::new();
    sweep.add("env credential", &cred);
    sweep.add("token credential", &token);
    sweep.add("command credential", &cmd);
    sweep.add("sensitive variable", &var);
    sweep.add("sensitive output", &out);
    sweep.add("pool env credential", &relay_cred);
    sweep.add("pool sensitive variable", &relay_var);
    sweep.add("pool sensitive output", &relay_out);
    let vars = stack.env_vars().clone();
    let b64 = base64::engine::general_purpose::STANDARD;
    sweep.add("seal key", &vars["TAKOSUMI_SEAL_KEY"]);
    sweep.add("seal key (bytes)", b64.decode(&vars["TAKOSUMI_SEAL_KEY"])?);
    sweep.add("evidence key", &vars["TAKOSUMI_EVIDENCE_KEY"]);
    if let Ok(seed) = b64.decode(&vars["TAKOSUMI_EVIDENCE_KEY"]) {
        sweep.add("evidence key (bytes)", seed);
    }
    sweep.add("admin token", &stack.admin_token);
    sweep.add(
        "database password",
        url_password(&vars["TAKOSUMI_DATABASE_URL"]),
    );
    sweep.add("broker password", url_password(&vars["TAKOSUMI_AMQP_URL"]));
    sweep.add("S3 secret key", &vars["TAKOSUMI_S3_SECRET_KEY"]);

    let mut responses: Vec<String> = Vec::new();
    let admin = stack.admin_token.clone();
    let ws = workspace(&stack).await?;
    let good = GitRepo::new(&[("infra/canary/main.tf", &canary_config(false))])?;
    let bad = GitRepo::new(&[("infra/canary/main.tf", &canary_config(true))])?;
    let fixtures = takosumi_tests::fixture_dir()?;
    let cmd_file = fixtures.path().join("cmd-cred");
    std::fs::write(&cmd_file, format!("{cmd}\n"))?;
    let mut bindings = Vec::new();
    for body in [
        json!({"name": "cloud", "kind": "env", "env": {"CANARY_CLOUD_TOKEN": cred}}),
        json!({"name": "ci", "kind": "token", "token": token}),
        json!({"name": "vault", "kind": "command", "command": ["/bin/cat", cmd_file.display().to_string()], "envName": "CMD_CRED"}),
    ] {
        let text = body.to_string();
        let r = probe::call(
            &stack,
            "POST",
            &format!("/api/v1/workspaces/{ws}/provider-bindings"),
            Some(&admin),
            &[],
            Some(text.as_bytes()),
        )
        .await?;
        assert_eq!(r.status, 201, "{}", r.text);
        responses.push(r.text.clone());
        bindings.push(r.json["id"].as_str().unwrap().to_owned());
    }
    let (approver, _) = stack.token("canary-approver", "approver").await?;
    let mut applies = Vec::new();
    let mut all_runs = Vec::new();
    let mut capsules = Vec::new();
    for (repo, held) in [(&good, true), (&bad, false)] {
        let capsule =
            register_with(&stack, ws, repo, json!({ "region": "eu", "seed": seed })).await?;
        capsules.push(capsule.id);
        for pb in &bindings {
            let body = format!(r#"{{"bindingId":"{pb}"}}"#);
            let r = probe::call(
                &stack,
                "POST",
                &format!("/api/v1/capsules/{}/provider-bindings", capsule.id),
                Some(&admin),
                &[],
                Some(body.as_bytes()),
            )
            .await?;
            assert!(r.status < 300, "{}", r.text);
            responses.push(r.text);
        }
        let mut req = PlanRequest::default();
        req.sensitive_vars
            .insert("db_password".into(), Value::String(var.clone()));
        let plan = stack.client.plan_with(capsule.id, None, &req).await?;
        let plan = stack.wait(plan.id).await?;
        assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
        let apply = if held {
            // Held for approval: the approve process releases it.
            let (s, v) = stack
                .call(
                    "POST",
                    &format!("/api/v1/runs/{}/apply", plan.id),
                    json!({ "requireApproval": true }),
                )
                .await?;
            assert_eq!(s, 202, "{v}");
            let run: RunId = v["id"].as_str().unwrap_or_default().parse()?;
            let run = stack.wait(run).await?;
            assert_eq!(run.status, RunStatus::Held, "{run:?}");
            let (s, v) = stack.approve_as(run.id, &approver, json!({})).await?;
            assert_eq!(s, 200, "{v}");
            stack.wait_released(run.id).await?
        } else {
            stack
                .wait(stack.client.apply(plan.id, None).await?.id)
                .await?
        };
        all_runs.extend([plan.id, apply.id]);
        applies.push(apply);
    }
    assert_eq!(applies[0].status, RunStatus::Applied, "{:?}", applies[0]);
    assert_eq!(applies[1].status, RunStatus::Failed, "{:?}", applies[1]);
    // The Runs really had every canary: the tool printed them all (masked), and the
    // sensitive outputs exist.
    let printed = stack.client.logs(applies[0].id).await?;
    assert!(
        printed.contains("token=*** tk=*** cmd=*** pw=***"),
        "{printed}"
    );
    let outputs = applies[0].outputs.clone().unwrap_or_default();
    assert_eq!(outputs["minted"], json!({ "sensitive": true }), "{outputs}");
    assert_eq!(outputs["conn"], json!({ "sensitive": true }), "{outputs}");

    // A pool's Capsule, planned and applied by its relay worker process.
    let pool_ws = workspace(&stack).await?;
    let pool = format!("canary-{}", &id[..8]);
    let key = DeliveryKeyPair::generate("k1")?;
    let (s, created) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{pool_ws}/pools"),
            json!({ "name": pool, "deliveryKey": { "keyId": key.key_id(), "publicKey": b64.encode(key.public().public) } }),
        )
        .await?;
    assert_eq!(s, 201, "{created}");
    let pool_token = created["token"].as_str().unwrap().to_owned();
    let keys = keys_env(&[&key]);
    sweep.add("pool token", &pool_token);
    sweep.add("delivery key", keys.split_once('=').unwrap().1);
    sweep.add("delivery key (bytes)", &key.private_bytes()[..]);
    let relay_work = tempfile::tempdir()?;
    procs.push(spawn_relay_logged(
        &stack,
        &pool_token,
        &keys,
        relay_work.path(),
        &log_of("relay"),
    )?);
    let pool_cap = register_with(
        &stack,
        pool_ws,
        &good,
        json!({ "region": "eu", "seed": relay_seed }),
    )
    .await?;
    capsules.push(pool_cap.id);
    let (s, v) = stack
        .call(
            "POST",
            &format!("/api/v1/workspaces/{pool_ws}/provider-bindings"),
            json!({"name": "cloud", "kind": "env", "env": {"CANARY_CLOUD_TOKEN": relay_cred}}),
        )
        .await?;
    assert_eq!(s, 201, "{v}");
    let (s, v) = stack
        .call(
            "POST",
            &format!("/api/v1/capsules/{}/provider-bindings", pool_cap.id),
            json!({ "bindingId": v["id"] }),
        )
        .await?;
    assert!(s < 300, "{v}");
    let (s, v) = stack
        .call(
            "PUT",
            &format!("/api/v1/capsules/{}/pool", pool_cap.id),
            json!({ "pool": pool }),
        )
        .await?;
    assert_eq!(s, 200, "{v}");
    let mut req = PlanRequest::default();
    req.sensitive_vars
        .insert("db_password".into(), Value::String(relay_var.clone()));
    let plan = stack
        .wait(stack.client.plan_with(pool_cap.id, None, &req).await?.id)
        .await?;
    assert_eq!(plan.status, RunStatus::Planned, "{plan:?}");
    let apply = stack
        .wait(stack.client.apply(plan.id, None).await?.id)
        .await?;
    assert_eq!(apply.status, RunStatus::Applied, "{apply:?}");
    let printed = stack.client.logs(apply.id).await?;
    assert!(printed.contains("token=*** "), "{printed}");
    assert!(printed.contains("pw=***"), "{printed}");
    all_runs.extend([plan.id, apply.id]);

    // The sweep process enqueues both workspaces' drift checks; the drift process and the
    // relay worker run them.
    for w in [ws, pool_ws] {
        let (s, b) = stack
            .call(
                "PATCH",
                &format!("/api/v1/workspaces/{w}/settings"),
                json!({ "driftIntervalSecs": 3600 }),
            )
            .await?;
        assert_eq!(s, 200, "{b}");
    }
    let status = stack
        .spawn_step(
            "sweep",
            &["--once"],
            &[("RUST_LOG", DEBUG_LOG)],
            Some(&log_of("sweep")),
        )?
        .wait()
        .await?;
    assert!(status.success(), "the sweep pass failed: {status}");
    for (w, n) in [(ws, 1), (pool_ws, 1)] {
        for run in wait_runs_of(&stack, w, takosumi_core::RunKind::DriftCheck, n).await? {
            assert_eq!(run.status, RunStatus::Planned, "{run:?}");
            all_runs.push(run.id);
        }
    }

    // Every API response about what happened.
    for run in &all_runs {
        for suffix in ["", "/events", "/logs", "/cost", "/evidence"] {
            let r = probe::call(
                &stack,
                "GET",
                &format!("/api/v1/runs/{run}{suffix}"),
                Some(&admin),
                &[],
                None,
            )
            .await?;
            responses.push(r.text);
        }
    }
    for cap in &capsules {
        for suffix in ["", "/provider-bindings", "/rules"] {
            responses.push(
                probe::call(
                    &stack,
                    "GET",
                    &format!("/api/v1/capsules/{cap}{suffix}"),
                    Some(&admin),
                    &[],
                    None,
                )
                .await?
                .text,
            );
        }
    }
    for suffix in [
        "runs",
        "activity",
        "provider-bindings",
        "drift",
        "rules",
        "evidence",
    ] {
        responses.push(
            probe::call(
                &stack,
                "GET",
                &format!("/api/v1/workspaces/{ws}/{suffix}"),
                Some(&admin),
                &[],
                None,
            )
            .await?
            .text,
        );
    }
    responses.push(
        probe::call(
            &stack,
            "GET",
            "/api/v1/dead-letters",
            Some(&admin),
            &[],
            None,
        )
        .await?
        .text,
    );
    for mut p in procs {
        p.start_kill()?;
        p.wait().await?;
    }

    // Every process's log.
    let mut process_logs = 0;
    for step in [
        "api", "plan", "gate", "approve", "apply", "drift", "sweep", "relay",
    ] {
        let text = std::fs::read(log_of(step))?;
        assert!(!text.is_empty(), "the {step} process logged nothing");
        sweep.check("process log", step, &text);
        process_logs += 1;
    }
    // Every message published in the vhost.
    let messages = tap.drain().await?;
    tap.close().await?;
    assert!(
        messages.len() >= all_runs.len(),
        "the firehose saw {} publishes for {} Runs",
        messages.len(),
        all_runs.len()
    );
    for (key, props, body) in &messages {
        sweep.check("message", key, body);
        sweep.check("message properties", key, props.as_bytes());
    }
    // Every row of every table: a token is stored as its digest, a credential and a
    // sensitive variable sealed, so no canary is exempt anywhere.
    let rows = probe::dump_tables(&stack.ctx.pool).await?;
    let tables: std::collections::BTreeSet<&str> = rows.iter().map(|(t, _)| t.as_str()).collect();
    for (table, row) in &rows {
        sweep.check("table row", table, row.as_bytes());
    }
    // Every object: sealed, and no canary in its raw bytes.
    let objects = probe::dump_objects(&stack).await?;
    assert!(objects.len() >= 4, "plans and applies store objects");
    for (key, bytes) in &objects {
        assert!(
            bytes.starts_with(takosumi_seal::MAGIC) || bytes.starts_with(takosumi_seal::MAGIC_V2),
            "object {key} is not sealed"
        );
        sweep.check("object", key, bytes);
    }
    for r in &responses {
        sweep.check("API response", "", r.as_bytes());
    }
    // The services' logs: what they appended while the test ran. Postgres logged this
    // database's statements with their parameters (so a value sent unsealed is caught).
    let mut service_logs_read = 0;
    for (path, from) in &services {
        let Some(text) = appended(path, *from) else {
            probe::say(&format!("canary sweep: {} is unreadable", path.display()));
            continue;
        };
        if path.starts_with("/var/log/postgresql") {
            let t = String::from_utf8_lossy(&text);
            assert!(
                t.contains(&format!("@{db} LOG:  statement:"))
                    || t.contains(&format!("@{db} LOG:  execute")),
                "Postgres logged no statement of {db} in {}",
                path.display()
            );
        }
        sweep.check("service log", &path.display().to_string(), &text);
        service_logs_read += 1;
    }
    let places = sweep.places().clone();
    let leaks = sweep.leaks().to_vec();
    probe::say(&format!(
        "canary sweep: {} canaries ({:?}) in {places:?} ({} bytes, {} tables, {} messages, {} objects, {service_logs_read} service logs); leaks {}",
        sweep.len(),
        sweep.names(),
        sweep.bytes(),
        tables.len(),
        messages.len(),
        objects.len(),
        leaks.len()
    ));
    record("security", "canary sweep: canaries", sweep.len());
    record("security", "canary sweep: process logs", process_logs);
    record("security", "canary sweep: service logs", service_logs_read);
    record("security", "canary sweep: tables", tables.len());
    record("security", "canary sweep: table rows", rows.len());
    record("security", "canary sweep: objects", objects.len());
    record("security", "canary sweep: messages", messages.len());
    record(
        "security",
        "canary sweep: canaries x places",
        sweep.len() * places.values().sum::<usize>(),
    );
    record("security", "canary sweep: leaks found", leaks.len());
    assert!(leaks.is_empty(), "canary found in: {leaks:#?}");

    // The private directories are gone, after success and after failure.
    let work = std::path::PathBuf::from(&stack.env_vars()["TAKOSUMI_WORK_DIR"]);
    let left = takosumi_tests::leftover_run_dirs(&work);
    assert!(left.is_empty(), "private directories left behind: {left:?}");
    stack.stop().await
}
