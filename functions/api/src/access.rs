//! Default-deny access: every route is mounted through [`Api::route`] with the [`Access`]
//! it requires, and a guard in front of its handler enforces that before the handler runs
//! (authentication, and the caller's role in the Workspace the path names). No route can
//! be mounted without one, and the table of every route with its access ([`endpoints`]) is
//! what the role matrix and the fuzzer are generated from, so a route missing from either
//! cannot exist. Handlers may check more (an approval rule's roles, a pool's own Runs); the
//! guard is the floor.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequestParts, RawPathParams, Request};
use axum::handler::Handler;
use axum::http::Method;
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, on};
use takosumi_core::{CapsuleId, RunGroupId, RunId, WorkspaceId};
use takosumi_store::workspaces::{self, Owned};
use takosumi_store::{capsules, runs};

use crate::auth::{Action, Caller, Prefetched};
pub use crate::openapi::Doc;
use crate::relay::PoolCaller;
use crate::{ApiError, AppState};

/// What a route requires of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Nothing (the health check).
    Public,
    /// An API token whose role allows the action within the Workspace the path names.
    Token(Action, Scope),
    /// A worker pool's token (the relay endpoints); no API token of any role.
    PoolToken,
    /// A Git webhook whose signature the handler checks against the Workspace's secret
    /// (the signature is the credential; a token is no substitute).
    WebhookSignature,
    /// A dashboard page or form: a signed-in browser session (and for anything but a
    /// read, the session's CSRF token). What the page shows or does is an API call made
    /// as the session's token, so the API's own access decides it.
    Session,
}

/// Where a token's role is checked: which path parameter names the Workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Instance-wide: a token limited to one Workspace may only read.
    Instance,
    /// `{ws}`.
    Workspace,
    /// `{cap}`: the Capsule's Workspace.
    Capsule,
    /// `{run}`: the Run's Workspace.
    Run,
    /// `{rg}`: the RunGroup's Workspace.
    RunGroup,
    /// `{pool}`: the worker pool's Workspace.
    Pool,
}

impl Scope {
    fn param(self) -> Option<&'static str> {
        match self {
            Scope::Instance => None,
            Scope::Workspace => Some("ws"),
            Scope::Capsule => Some("cap"),
            Scope::Run => Some("run"),
            Scope::RunGroup => Some("rg"),
            Scope::Pool => Some("pool"),
        }
    }
}

/// One mounted route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Its method.
    pub method: Method,
    /// Its path template (`/api/v1/runs/{run}`).
    pub path: &'static str,
    /// What it requires.
    pub access: Access,
    /// What it is, for the OpenAPI document ([`Api::doc`]); `None`: mounted without one,
    /// which leaves it out of the document (and fails the test that compares the two).
    pub doc: Option<Doc>,
}

/// The API's routes as they are built: the router and the table of what each requires.
pub struct Api {
    router: Router<AppState>,
    endpoints: Vec<Endpoint>,
}

impl Default for Api {
    fn default() -> Self {
        Self::new()
    }
}

impl Api {
    /// No routes.
    pub fn new() -> Self {
        Self {
            router: Router::new(),
            endpoints: Vec::new(),
        }
    }

    /// Mounts `handler` for `method` on `path`, behind the guard for `access`.
    pub fn route<H, T>(
        mut self,
        method: Method,
        path: &'static str,
        access: Access,
        handler: H,
    ) -> Self
    where
        H: Handler<T, AppState>,
        T: 'static,
    {
        if let Access::Token(_, scope) = access
            && let Some(param) = scope.param()
        {
            assert!(
                path.contains(&format!("{{{param}}}")),
                "{method} {path}: scope {scope:?} needs a {{{param}}} parameter"
            );
        }
        let filter = MethodFilter::try_from(method.clone())
            .unwrap_or_else(|_| panic!("{method} cannot be routed"));
        let mut guarded =
            on(filter, handler).route_layer(from_fn(move |req: Request, next: Next| {
                guard(access, req, next)
            }));
        if path.starts_with("/api/") {
            // axum's own rejections (a body over the limit, a path that does not decode)
            // answer in the API's error shape too, as the OpenAPI document says.
            guarded = guarded.layer(axum::middleware::map_response(crate::error::json_rejection));
        }
        self.router = self.router.route(path, guarded);
        self.endpoints.push(Endpoint {
            method,
            path,
            access,
            doc: None,
        });
        self
    }

    /// Describes the route mounted last (its operation, or that it is a dashboard page):
    /// `.route(…).doc(Doc::op("getRun", "…").ok::<wire::Run>(200))`.
    pub fn doc(mut self, doc: Doc) -> Self {
        let last = self
            .endpoints
            .last_mut()
            .expect("`doc` describes the route mounted before it");
        assert!(
            last.doc.is_none(),
            "{} {} is described twice",
            last.method,
            last.path
        );
        last.doc = Some(doc);
        self
    }

    /// Adds `other`'s routes.
    pub fn merge(mut self, other: Api) -> Self {
        self.router = self.router.merge(other.router);
        self.endpoints.extend(other.endpoints);
        self
    }

    /// Applies `f` to the routes mounted so far (a body limit, say); the table is kept.
    pub fn map_router(mut self, f: impl FnOnce(Router<AppState>) -> Router<AppState>) -> Self {
        self.router = f(self.router);
        self
    }

    /// The router and the table.
    pub fn into_parts(self) -> (Router<AppState>, Vec<Endpoint>) {
        (self.router, self.endpoints)
    }
}

/// Every route the API mounts, with what it requires (the role matrix and the fuzzer read
/// this; nothing else decides).
pub fn endpoints() -> Vec<Endpoint> {
    crate::router::api().into_parts().1
}

/// The guard in front of every handler. The handler's own `Caller` / `PoolCaller`
/// extractors reuse what it authenticated.
async fn guard(access: Access, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let Some(st) = parts.extensions.get::<AppState>().cloned() else {
        // Mounted without `router(state)`: refuse rather than serve unchecked.
        return ApiError::forbidden("this endpoint has no access check in this server")
            .into_response();
    };
    if access == Access::Session {
        return match crate::dashboard::authenticate(&st, parts, body).await {
            Ok(req) => next.run(req).await,
            Err(refused) => refused,
        };
    }
    let checked: Result<(), ApiError> = async {
        match access {
            Access::Public | Access::WebhookSignature | Access::Session => Ok(()),
            Access::PoolToken => {
                let caller = PoolCaller::from_request_parts(&mut parts, &st).await?;
                parts.extensions.insert(caller);
                Ok(())
            }
            Access::Token(action, scope) => {
                let caller = Caller::from_request_parts(&mut parts, &st).await?;
                let params: HashMap<String, String> =
                    match RawPathParams::from_request_parts(&mut parts, &st).await {
                        Ok(p) => p
                            .iter()
                            .map(|(k, v)| (k.to_owned(), v.to_owned()))
                            .collect(),
                        Err(_) => HashMap::new(),
                    };
                let mut caller = caller;
                match workspace_of(&st, scope, &params).await? {
                    Named::Instance => caller.require(action, None)?,
                    Named::Workspace(ws, read) => {
                        caller.require(action, Some(ws))?;
                        caller.1 = read;
                    }
                    // An id that does not parse or names nothing: the handler answers it
                    // (400 / 404) exactly as for any caller, revealing nothing more.
                    Named::Unknown => {}
                }
                parts.extensions.insert(caller);
                Ok(())
            }
        }
    }
    .await;
    match checked {
        Ok(()) => next.run(Request::from_parts(parts, body)).await,
        Err(e) => e.into_response(),
    }
}

enum Named {
    Instance,
    Workspace(WorkspaceId, Prefetched),
    Unknown,
}

/// The Workspace the path names, with the row the guard read to learn it when the path
/// names a Workspace, Capsule or Run: the handler's [`crate::extract`] takes that row from
/// the [`Caller`] instead of reading it again.
async fn workspace_of(
    st: &AppState,
    scope: Scope,
    params: &HashMap<String, String>,
) -> Result<Named, ApiError> {
    let Some(param) = scope.param() else {
        return Ok(Named::Instance);
    };
    let Some(raw) = params.get(param) else {
        return Ok(Named::Unknown);
    };
    let named = match scope {
        Scope::Instance => return Ok(Named::Instance),
        Scope::Workspace => match raw.parse::<WorkspaceId>() {
            Ok(id) => st
                .workspaces
                .exists(&st.pool, id)
                .await?
                .then_some(Named::Workspace(id, Prefetched::Workspace(id))),
            Err(_) => None,
        },
        Scope::Capsule => match raw.parse::<CapsuleId>() {
            Ok(id) => capsules::get(&st.pool, id)
                .await?
                .map(|c| Named::Workspace(c.workspace_id, Prefetched::Capsule(Arc::new(c)))),
            Err(_) => None,
        },
        Scope::Run => match raw.parse::<RunId>() {
            Ok(id) => runs::get(&st.pool, id)
                .await?
                .map(|r| Named::Workspace(r.workspace_id, Prefetched::Run(Arc::new(r)))),
            Err(_) => None,
        },
        Scope::RunGroup => match raw.parse::<RunGroupId>() {
            Ok(id) => workspaces::owner_of(&st.pool, Owned::RunGroup(id))
                .await?
                .map(|ws| Named::Workspace(ws, Prefetched::Nothing)),
            Err(_) => None,
        },
        Scope::Pool => workspaces::owner_of(&st.pool, Owned::Pool(raw))
            .await?
            .map(|ws| Named::Workspace(ws, Prefetched::Nothing)),
    };
    Ok(named.unwrap_or(Named::Unknown))
}
