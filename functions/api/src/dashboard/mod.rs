//! The dashboard: server-rendered pages under `/`, assets under `/assets/` (htmx and the
//! page script vendored into the binary; nothing is fetched from elsewhere).
//!
//! A browser signs in with an API token and gets an HttpOnly, SameSite=Strict session
//! cookie (Secure behind TLS); the token is not kept by the browser or by the server, only
//! the cookie's hash and the token it stands for (`dashboard_sessions`). Every form
//! carries the session's CSRF token, checked (with the request's origin) by the access
//! guard before a handler runs, and every page is sent with a strict
//! Content-Security-Policy.
//!
//! A page reads and acts only through the API: each view and each button is an in-process
//! call of an API route, made as the session's token, so the API's access checks, input
//! checks, masking and audit records apply exactly as they do to the CLI. The dashboard
//! itself decides nothing about access; it hides a button the caller's role could not use.

// A page's refusal is the response to send (a few hundred bytes once per request): boxing
// it would only add an allocation to every error path.
#![allow(clippy::result_large_err)]

mod pages;

use std::sync::LazyLock;

use axum::Router;
use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Path, Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode};
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use takosumi_store::{sessions, tokens};
use tower::ServiceExt;

use crate::access::{Access, Api, Doc};
use crate::auth::{Caller, Prefetched};
use crate::{ApiError, AppState};

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "takosumi_session";
/// How long a sign-in lasts.
const SESSION_TTL_SECS: i64 = 12 * 3600;
/// The largest form a page posts.
const FORM_LIMIT: usize = 64 * 1024;
/// The largest API answer a page reads.
const READ_LIMIT: usize = 32 * 1024 * 1024;

const HTMX_JS: &[u8] = include_bytes!("../../assets/htmx.min.js");
const DASHBOARD_JS: &[u8] = include_bytes!("../../assets/dashboard.js");
const DASHBOARD_CSS: &[u8] = include_bytes!("../../assets/dashboard.css");

/// Sent with every page: nothing runs or loads but this server's own scripts and styles,
/// no page can be framed, and forms post only here.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
                   base-uri 'none'";

/// The dashboard's routes; merged into the API's router (and so into its route table).
pub fn api() -> Api {
    use Method as M;
    Api::new()
        .route(M::GET, "/", Access::Session, pages::workspaces)
        .doc(Doc::page())
        .route(M::GET, "/sign-in", Access::Public, pages::sign_in_form)
        .doc(Doc::page())
        .route(M::POST, "/sign-in", Access::Public, sign_in)
        .doc(Doc::page())
        .route(M::POST, "/sign-out", Access::Session, sign_out)
        .doc(Doc::page())
        .route(
            M::GET,
            "/workspaces/{ws}",
            Access::Session,
            pages::workspace,
        )
        .doc(Doc::page())
        .route(M::GET, "/capsules/{cap}", Access::Session, pages::capsule)
        .doc(Doc::page())
        .route(M::GET, "/runs/{run}", Access::Session, pages::run)
        .doc(Doc::page())
        .route(M::GET, "/runs/{run}/stream", Access::Session, run_stream)
        .doc(Doc::page())
        .merge(actions())
        .route(M::GET, "/assets/{file}", Access::Public, asset)
        .doc(Doc::page())
        .map_router(|r| r.layer(from_fn(page_headers)))
}

/// One route per button, each the API call of the same name.
fn actions() -> Api {
    use CapsuleAction as C;
    use RunAction as R;
    let mut api = Api::new();
    for (path, action) in [
        ("/capsules/{cap}/install", C::Install),
        ("/capsules/{cap}/plan", C::Plan),
        ("/capsules/{cap}/drift-check", C::DriftCheck),
        ("/capsules/{cap}/destroy", C::Destroy),
    ] {
        api = api
            .route(
                Method::POST,
                path,
                Access::Session,
                move |st: State<AppState>, s: Session, cap: Path<String>, body: Bytes| {
                    capsule_action(st, s, cap, action, body)
                },
            )
            .doc(Doc::page());
    }
    for (path, action) in [
        ("/runs/{run}/approve", R::Approve),
        ("/runs/{run}/apply", R::Apply),
        ("/runs/{run}/cancel", R::Cancel),
        ("/runs/{run}/resolve", R::Resolve),
    ] {
        api = api
            .route(
                Method::POST,
                path,
                Access::Session,
                move |st: State<AppState>, s: Session, run: Path<String>, body: Bytes| {
                    run_action(st, s, run, action, body)
                },
            )
            .doc(Doc::page());
    }
    api
}

/// A Capsule page's buttons.
#[derive(Debug, Clone, Copy)]
enum CapsuleAction {
    Install,
    Plan,
    DriftCheck,
    Destroy,
}

/// A Run page's buttons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunAction {
    Approve,
    Apply,
    Cancel,
    Resolve,
}

/// A signed-in browser: the token's grant and the session's CSRF token.
#[derive(Debug, Clone)]
pub struct Session {
    /// Who (the token the session was made from).
    pub caller: Caller,
    /// What every form of this session carries.
    pub csrf: String,
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Session>()
            .cloned()
            .ok_or_else(|| see_sign_in("/"))
    }
}

fn csrf_of(session_secret: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"takosumi-dashboard-csrf\0");
    h.update(session_secret.as_bytes());
    hex::encode(h.finalize())
}

fn session_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == SESSION_COOKIE)
        .map(|(_, v)| v.to_owned())
        .filter(|v| !v.is_empty())
}

/// A post from another site: the browser says where the form came from.
fn cross_site(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        return !matches!(site, "same-origin" | "none");
    }
    match (
        headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
        headers.get(header::HOST).and_then(|v| v.to_str().ok()),
    ) {
        (Some(origin), Some(host)) => origin
            .split_once("://")
            .is_none_or(|(_, authority)| authority != host),
        _ => false,
    }
}

/// Only a path of this server (no `//host`, no scheme) is a place to go back to.
fn local_path(next: &str) -> &str {
    if next.starts_with('/') && !next.starts_with("//") && !next.contains('\\') {
        next
    } else {
        "/"
    }
}

fn see_sign_in(next: &str) -> Response {
    let q = serde_urlencoded::to_string([("next", local_path(next))]).unwrap_or_default();
    Redirect::to(&format!("/sign-in?{q}")).into_response()
}

/// The guard of every [`Access::Session`] route: a live session, and for a post, the
/// session's CSRF token in the form and no cross-site origin. The request goes on with
/// the [`Session`] attached.
pub(crate) async fn authenticate(
    st: &AppState,
    mut parts: Parts,
    body: Body,
) -> Result<Request, Response> {
    let secret = session_cookie(&parts.headers);
    let grant = match &secret {
        Some(s) => sessions::find(&st.pool, s)
            .await
            .map_err(|e| ApiError::from(e).into_response())?,
        None => None,
    };
    let (Some(secret), Some(grant)) = (secret, grant) else {
        if parts.method == Method::GET {
            let path = parts
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .to_owned();
            return Err(see_sign_in(&path));
        }
        return Err(pages::problem(
            StatusCode::UNAUTHORIZED,
            "You are not signed in (or your session ended): sign in again.",
        ));
    };
    let csrf = csrf_of(&secret);
    let body = if parts.method == Method::GET || parts.method == Method::HEAD {
        body
    } else {
        if cross_site(&parts.headers) {
            return Err(pages::problem(
                StatusCode::FORBIDDEN,
                "A form from another site was refused.",
            ));
        }
        let bytes = to_bytes(body, FORM_LIMIT)
            .await
            .map_err(|_| pages::problem(StatusCode::PAYLOAD_TOO_LARGE, "The form is too large."))?;
        let given = form_field(&bytes, "csrf").unwrap_or_default();
        if !bool::from(given.as_bytes().ct_eq(csrf.as_bytes())) {
            return Err(pages::problem(
                StatusCode::FORBIDDEN,
                "The form's CSRF token is missing or wrong: reload the page and try again.",
            ));
        }
        Body::from(bytes)
    };
    parts.extensions.insert(Session {
        caller: Caller(grant, Prefetched::Nothing),
        csrf,
    });
    Ok(Request::from_parts(parts, body))
}

fn form_field(body: &[u8], name: &str) -> Option<String> {
    serde_urlencoded::from_bytes::<Vec<(String, String)>>(body)
        .ok()?
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}

async fn page_headers(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    resp
}

async fn asset(Path(file): Path<String>) -> Response {
    let (body, kind) = match file.as_str() {
        "htmx.min.js" => (HTMX_JS, "text/javascript; charset=utf-8"),
        "dashboard.js" => (DASHBOARD_JS, "text/javascript; charset=utf-8"),
        "dashboard.css" => (DASHBOARD_CSS, "text/css; charset=utf-8"),
        _ => return pages::problem(StatusCode::NOT_FOUND, "No such asset."),
    };
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

// ---- signing in and out -----------------------------------------------------------

#[derive(Deserialize)]
struct SignInForm {
    #[serde(default)]
    token: String,
    #[serde(default)]
    next: String,
}

async fn sign_in(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    if cross_site(&headers) {
        return pages::problem(
            StatusCode::FORBIDDEN,
            "A sign-in from another site was refused.",
        );
    }
    let form: SignInForm = match serde_urlencoded::from_bytes(&body) {
        Ok(f) => f,
        Err(_) => return pages::sign_in_page(Some("The form was not readable."), "/"),
    };
    let next = local_path(&form.next).to_owned();
    let token = form.token.trim();
    if token.is_empty() {
        return pages::sign_in_page(Some("Paste an API token to sign in."), &next);
    }
    let grant = match tokens::find(&st.pool, token).await {
        Ok(Some(g)) => g,
        Ok(None) => {
            return pages::sign_in_page(Some("That token is not valid (or was revoked)."), &next);
        }
        Err(e) => return ApiError::from(e).into_response(),
    };
    let secret = {
        use rand::RngCore;
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        hex::encode(bytes)
    };
    if let Err(e) = sessions::create(&st.pool, &secret, grant.id, SESSION_TTL_SECS).await {
        return ApiError::from(e).into_response();
    }
    tracing::info!(token = %grant.id, role = %grant.role, "dashboard sign-in");
    let secure = if behind_tls(&headers) { "; Secure" } else { "" };
    let cookie = format!(
        "{SESSION_COOKIE}={secret}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_TTL_SECS}{secure}"
    );
    let mut resp = Redirect::to(&next).into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

fn behind_tls(headers: &HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|p| p.eq_ignore_ascii_case("https"))
}

async fn sign_out(State(st): State<AppState>, headers: HeaderMap) -> Response {
    if let Some(secret) = session_cookie(&headers)
        && let Err(e) = sessions::delete(&st.pool, &secret).await
    {
        return ApiError::from(e).into_response();
    }
    let mut resp = Redirect::to("/sign-in").into_response();
    resp.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("takosumi_session=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    resp
}

// ---- calling the API ----------------------------------------------------------------

/// The API's routes, called in-process as the session's token.
static ROUTES: LazyLock<Router<AppState>> = LazyLock::new(crate::router::router);

/// An API answer.
pub(crate) struct Reply {
    status: StatusCode,
    body: Bytes,
}

impl Reply {
    /// The answer decoded, or the API's refusal as a page.
    fn decode<T: DeserializeOwned>(self) -> Result<T, Response> {
        if !self.status.is_success() {
            return Err(self.problem());
        }
        serde_json::from_slice(&self.body).map_err(|e| {
            tracing::error!(error = %e, "the dashboard could not read an API answer");
            pages::problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The page failed on our side; the operators have the details.",
            )
        })
    }

    /// The API's `{code, message}` as a page with the same status.
    fn problem(&self) -> Response {
        pages::problem(self.status, &api_message(self.status, &self.body))
    }
}

/// What the API said, safe to show (its error bodies are written to be).
fn api_message(status: StatusCode, body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct ErrorBody {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) if !e.message.is_empty() => format!("{} ({})", e.message, e.code),
        _ => format!("The request failed ({status})."),
    }
}

/// Calls an API route as `session`'s token. `nonce`: the form's one-time value, sent as
/// the Idempotency-Key so a form sent twice submits once.
pub(crate) async fn call(
    st: &AppState,
    session: &Session,
    method: Method,
    uri: &str,
    body: Option<Value>,
    nonce: Option<&str>,
) -> Result<Response, Response> {
    let mut req = Request::builder().method(method).uri(uri);
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    if let Some(n) = nonce.filter(|n| !n.is_empty() && n.len() <= 64) {
        req = req.header("idempotency-key", format!("dashboard-{n}"));
    }
    let req = req
        .body(Body::from(body.map(|b| b.to_string()).unwrap_or_default()))
        .map_err(|_| pages::problem(StatusCode::BAD_REQUEST, "That address is not valid."))?;
    Ok(dispatch(st, session, req).await)
}

/// Runs `req` through the API's routes as `session`'s token.
async fn dispatch(st: &AppState, session: &Session, mut req: Request) -> Response {
    req.extensions_mut().insert(session.caller.clone());
    req.extensions_mut().insert(st.clone());
    let routes = ROUTES.clone().with_state(st.clone());
    match routes.oneshot(req).await {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

/// [`call`], read whole.
pub(crate) async fn read(
    st: &AppState,
    session: &Session,
    method: Method,
    uri: &str,
    body: Option<Value>,
    nonce: Option<&str>,
) -> Result<Reply, Response> {
    let resp = call(st, session, method, uri, body, nonce).await?;
    let status = resp.status();
    let body = to_bytes(resp.into_body(), READ_LIMIT).await.map_err(|_| {
        pages::problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The API's answer was too large to show.",
        )
    })?;
    Ok(Reply { status, body })
}

/// `GET uri` decoded as `T`, or the refusal as a page.
pub(crate) async fn get<T: DeserializeOwned>(
    st: &AppState,
    session: &Session,
    uri: &str,
) -> Result<T, Response> {
    read(st, session, Method::GET, uri, None, None)
        .await?
        .decode()
}

/// `GET uri` decoded as `T`; `None` for an answer of 4xx (not applicable to this Run).
pub(crate) async fn get_optional<T: DeserializeOwned>(
    st: &AppState,
    session: &Session,
    uri: &str,
) -> Result<Option<T>, Response> {
    let reply = read(st, session, Method::GET, uri, None, None).await?;
    if reply.status.is_client_error() {
        return Ok(None);
    }
    reply.decode().map(Some)
}

// ---- actions --------------------------------------------------------------------------

#[derive(Deserialize, Default)]
struct ActionForm {
    #[serde(default)]
    nonce: String,
    #[serde(rename = "planDigest", default)]
    plan_digest: String,
    #[serde(default)]
    note: String,
}

fn action_form(body: &Bytes) -> ActionForm {
    serde_urlencoded::from_bytes(body).unwrap_or_default()
}

/// Where an action leads: the Run it started, or back to `fallback`.
fn after(reply: Reply, fallback: &str) -> Response {
    if !reply.status.is_success() {
        return reply.problem();
    }
    #[derive(Deserialize)]
    struct Started {
        id: takosumi_core::RunId,
    }
    match serde_json::from_slice::<Started>(&reply.body) {
        Ok(s) => Redirect::to(&format!("/runs/{}", s.id)).into_response(),
        Err(_) => Redirect::to(fallback).into_response(),
    }
}

async fn capsule_action(
    State(st): State<AppState>,
    session: Session,
    Path(cap): Path<String>,
    action: CapsuleAction,
    body: Bytes,
) -> Response {
    let form = action_form(&body);
    let (method, uri, body) = match action {
        CapsuleAction::Install => (
            Method::POST,
            format!("/api/v1/capsules/{cap}/plan"),
            Some(json!({ "autoApplyRequested": true })),
        ),
        CapsuleAction::Plan => (Method::POST, format!("/api/v1/capsules/{cap}/plan"), None),
        CapsuleAction::DriftCheck => (
            Method::POST,
            format!("/api/v1/capsules/{cap}/drift-check"),
            None,
        ),
        CapsuleAction::Destroy => (Method::DELETE, format!("/api/v1/capsules/{cap}"), None),
    };
    match read(&st, &session, method, &uri, body, Some(&form.nonce)).await {
        Ok(reply) => after(reply, &format!("/capsules/{cap}")),
        Err(page) => page,
    }
}

async fn run_action(
    State(st): State<AppState>,
    session: Session,
    Path(run): Path<String>,
    action: RunAction,
    body: Bytes,
) -> Response {
    let form = action_form(&body);
    let note = Some(form.note.trim()).filter(|n| !n.is_empty());
    let (uri, body) = match action {
        RunAction::Approve => (
            format!("/api/v1/runs/{run}/approve"),
            // Bound to the digest the page showed: a plan that changed since is refused.
            Some(
                json!({ "planDigest": Some(form.plan_digest.as_str()).filter(|d| !d.is_empty()), "note": note }),
            ),
        ),
        RunAction::Apply => (format!("/api/v1/runs/{run}/apply"), None),
        RunAction::Cancel => (
            format!("/api/v1/runs/{run}/cancel"),
            Some(json!({ "reason": note })),
        ),
        RunAction::Resolve => (
            format!("/api/v1/runs/{run}/resolve"),
            Some(json!({ "action": "mark_resolved", "note": note })),
        ),
    };
    let back = format!("/runs/{run}");
    match read(&st, &session, Method::POST, &uri, body, Some(&form.nonce)).await {
        // Approving, cancelling and resolving stay on the Run; an apply goes to the new one.
        Ok(reply) if action == RunAction::Apply => after(reply, &back),
        Ok(reply) if reply.status.is_success() => Redirect::to(&back).into_response(),
        Ok(reply) => reply.problem(),
        Err(page) => page,
    }
}

/// The Run's live stream, as the API serves it to the session's token.
async fn run_stream(
    State(st): State<AppState>,
    session: Session,
    Path(run): Path<String>,
    headers: HeaderMap,
) -> Response {
    let uri = format!("/api/v1/runs/{run}/stream");
    let mut req = Request::builder().method(Method::GET).uri(&uri);
    if let Some(last) = headers.get("last-event-id") {
        req = req.header("last-event-id", last);
    }
    let Ok(req) = req.body(Body::empty()) else {
        return pages::problem(StatusCode::BAD_REQUEST, "That address is not valid.");
    };
    dispatch(&st, &session, req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_paths_are_places_to_return_to() {
        assert_eq!(local_path("/runs/run_1"), "/runs/run_1");
        for bad in [
            "//evil.example/x",
            "https://evil.example",
            "evil",
            "/\\evil",
            "",
        ] {
            assert_eq!(local_path(bad), "/", "{bad}");
        }
    }

    #[test]
    fn a_cross_site_form_is_recognised() {
        let mut h = HeaderMap::new();
        assert!(
            !cross_site(&h),
            "no origin information: the CSRF token decides"
        );
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8080"),
        );
        assert!(!cross_site(&h));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert!(cross_site(&h));
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(cross_site(&h));
        h.insert("sec-fetch-site", HeaderValue::from_static("same-origin"));
        assert!(!cross_site(&h));
    }

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; takosumi_session=abc; b=2"),
        );
        assert_eq!(session_cookie(&h).as_deref(), Some("abc"));
        assert_ne!(csrf_of("abc"), csrf_of("abd"));
        assert!(!csrf_of("abc").contains("abc"));
    }
}
