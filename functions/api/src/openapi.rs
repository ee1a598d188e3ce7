//! The API's OpenAPI 3.1 description, served at `GET /api/v1/openapi.json`.
//!
//! It is built from the route table ([`crate::access::Api`]), not written beside it: every
//! route is mounted with a [`Doc`] (operation id, summary, request and response schemas),
//! and the document lists exactly the table's JSON API routes, so a route cannot be served
//! without appearing here (a route mounted without a doc is left out and
//! `tests/tests/openapi.rs` fails). Schemas are derived (`utoipa::ToSchema`) on the types
//! the handlers read and the wire types (`takosumi-wire`) clients decode; a response still
//! built as inline JSON is described as a free-form object, never as a shape it might not
//! have. Error responses all carry [`ErrorBody`], whose `code` is the closed
//! [`ErrorCode`] enum.
//!
//! Why utoipa (5) and only its core: its derive gives the wire types' schemas, and its
//! `openapi` builders let the document be assembled from our own table. `utoipa-axum`'s
//! router (and aide's `ApiRouter`) would replace [`crate::access::Api`], whose guard and
//! table the role matrix and the fuzzer are generated from; a second router beside it
//! could drift from the first, which is what this must not do.
//!
//! The dashboard's HTML pages, forms and assets are mounted with [`Doc::page`]: they are
//! not part of the JSON API (they answer HTML and redirects, behind a session cookie),
//! so they are kept out of the document.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use axum::http::{HeaderValue, Method, header};
use axum::response::IntoResponse;
use utoipa::ToSchema;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{
    ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
};
use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, InfoBuilder, OpenApi, OpenApiBuilder, Paths, RefOr,
    Required, ResponseBuilder, ResponsesBuilder,
};

use crate::access::{Access, Api, Endpoint};
use crate::error::ErrorBody;

/// Where the document is served.
pub const PATH: &str = "/api/v1/openapi.json";

/// What one route is, for the document.
#[derive(Clone, Debug)]
pub struct Doc {
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    /// A dashboard page, form or asset: not part of the JSON API.
    Page,
    Op(Box<Op>),
}

#[derive(Clone, Debug)]
struct Op {
    id: &'static str,
    summary: &'static str,
    description: Option<&'static str>,
    body: Option<Content>,
    body_required: bool,
    /// Success responses by status.
    ok: BTreeMap<u16, Option<Content>>,
    query: Vec<(&'static str, &'static str)>,
    headers: Vec<(&'static str, &'static str)>,
}

/// A body: its media type and schema, and the named schemas the schema refers to.
#[derive(Clone, Debug)]
struct Content {
    media: &'static str,
    schema: RefOr<Schema>,
    named: Vec<(String, RefOr<Schema>)>,
}

impl Content {
    fn json<T: ToSchema>() -> Self {
        let mut named = Vec::new();
        T::schemas(&mut named);
        let name = T::name();
        let schema = if name.is_empty() {
            T::schema()
        } else {
            named.push((name.to_string(), T::schema()));
            RefOr::Ref(utoipa::openapi::Ref::from_schema_name(name))
        };
        Self {
            media: "application/json",
            schema,
            named,
        }
    }

    fn object(description: &'static str) -> Self {
        Self {
            media: "application/json",
            schema: ObjectBuilder::new()
                .schema_type(Type::Object)
                .description(Some(description))
                .into(),
            named: Vec::new(),
        }
    }

    fn raw(media: &'static str, description: &'static str) -> Self {
        Self {
            media,
            schema: ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some(description))
                .into(),
            named: Vec::new(),
        }
    }
}

impl Doc {
    /// A JSON API operation: its `operationId` and a one-line summary.
    pub fn op(id: &'static str, summary: &'static str) -> Self {
        Self {
            kind: Kind::Op(Box::new(Op {
                id,
                summary,
                description: None,
                body: None,
                body_required: true,
                ok: BTreeMap::new(),
                query: Vec::new(),
                headers: Vec::new(),
            })),
        }
    }

    /// A dashboard page, form or asset (HTML, a session cookie): left out of the document.
    pub fn page() -> Self {
        Self { kind: Kind::Page }
    }

    fn edit(mut self, f: impl FnOnce(&mut Op)) -> Self {
        match &mut self.kind {
            Kind::Op(op) => f(op),
            Kind::Page => panic!("a dashboard page has no operation to describe"),
        }
        self
    }

    /// A longer description.
    pub fn describe(self, text: &'static str) -> Self {
        self.edit(|op| op.description = Some(text))
    }

    /// A JSON request body of type `T` (required).
    pub fn body<T: ToSchema>(self) -> Self {
        self.edit(|op| op.body = Some(Content::json::<T>()))
    }

    /// A JSON request body of type `T` that may be left out.
    pub fn optional_body<T: ToSchema>(self) -> Self {
        self.edit(|op| {
            op.body = Some(Content::json::<T>());
            op.body_required = false;
        })
    }

    /// A JSON object request body whose fields the handler checks itself.
    pub fn object_body(self, description: &'static str) -> Self {
        self.edit(|op| op.body = Some(Content::object(description)))
    }

    /// A request body that is not JSON (a plan file, a state file).
    pub fn raw_body(self, media: &'static str, description: &'static str) -> Self {
        self.edit(|op| op.body = Some(Content::raw(media, description)))
    }

    /// A success answer with a JSON body of type `T`.
    pub fn ok<T: ToSchema>(self, status: u16) -> Self {
        self.edit(|op| {
            op.ok.insert(status, Some(Content::json::<T>()));
        })
    }

    /// A success answer whose JSON object is built inline: described as free-form.
    pub fn ok_object(self, status: u16, description: &'static str) -> Self {
        self.edit(|op| {
            op.ok.insert(status, Some(Content::object(description)));
        })
    }

    /// A success answer with no body.
    pub fn ok_empty(self, status: u16) -> Self {
        self.edit(|op| {
            op.ok.insert(status, None);
        })
    }

    /// A success answer that is not JSON (a Server-Sent Events stream).
    pub fn ok_raw(self, status: u16, media: &'static str, description: &'static str) -> Self {
        self.edit(|op| {
            op.ok.insert(status, Some(Content::raw(media, description)));
        })
    }

    /// A Server-Sent Events stream whose events' `data:` is the JSON of `T`: described
    /// event by event (`event`, `id`, `data`), as OpenAPI tools read `text/event-stream`.
    pub fn ok_sse<T: ToSchema>(self, status: u16, events: &[&'static str]) -> Self {
        let data = Content::json::<T>();
        let event = ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(events.iter().copied()))
            .description(Some("The SSE `event:` name."));
        // JSON Schema 2020-12's `contentSchema`, which utoipa's builder does not have.
        let mut content_schema = utoipa::openapi::extensions::Extensions::default();
        content_schema.insert(
            "contentSchema".to_owned(),
            serde_json::to_value(&data.schema).unwrap_or_default(),
        );
        let payload = ObjectBuilder::new()
            .schema_type(Type::String)
            .content_media_type("application/json")
            .extensions(Some(content_schema))
            .description(Some("The event's JSON (its `contentSchema`)."));
        let schema: RefOr<Schema> = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property("event", event)
            .property(
                "id",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .description(Some("A cursor to resume from (`Last-Event-ID`).")),
            )
            .property("data", payload)
            .property("retry", ObjectBuilder::new().schema_type(Type::Integer))
            .description(Some(
                "One Server-Sent Event; its `data:` is the JSON of the `contentSchema` type.",
            ))
            .into();
        self.edit(|op| {
            op.ok.insert(
                status,
                Some(Content {
                    media: "text/event-stream",
                    schema,
                    named: data.named,
                }),
            );
        })
    }

    /// An optional query parameter (a string the handler parses).
    pub fn query(self, name: &'static str, description: &'static str) -> Self {
        self.edit(|op| op.query.push((name, description)))
    }

    /// An optional request header.
    pub fn header(self, name: &'static str, description: &'static str) -> Self {
        self.edit(|op| op.headers.push((name, description)))
    }

    /// Whether this is a JSON API operation (and so in the document).
    pub fn is_api(&self) -> bool {
        matches!(self.kind, Kind::Op(_))
    }

    /// Its `operationId` (none for a page).
    pub fn operation_id(&self) -> Option<&'static str> {
        match &self.kind {
            Kind::Op(op) => Some(op.id),
            Kind::Page => None,
        }
    }
}

/// Docs compare by what they are called: the table's equality is about routes.
impl PartialEq for Doc {
    fn eq(&self, other: &Self) -> bool {
        self.operation_id() == other.operation_id()
    }
}

impl Eq for Doc {}

const BEARER: &str = "bearerToken";
const POOL: &str = "poolToken";
const WEBHOOK: &str = "webhookSignature";

/// The error statuses a route may answer, by what it requires: a sensible default set
/// (every error body is [`ErrorBody`]; its `code` says which case it is).
fn error_statuses(e: &Endpoint, has_body: bool) -> Vec<(u16, &'static str)> {
    let mut out = Vec::new();
    match e.access {
        Access::Public | Access::Session => {}
        Access::Token(..) | Access::PoolToken => {
            out.push((400, "malformed input (`invalid_id`, `invalid_json`, …)"));
            out.push((401, "no valid token (`unauthorized`)"));
            out.push((403, "the token's role may not do this (`forbidden`, …)"));
            out.push((404, "nothing by that id, or not visible to this token"));
            out.push((409, "the resource's state does not allow it now"));
            out.push((422, "well-formed input that is not acceptable"));
        }
        Access::WebhookSignature => {
            out.push((400, "malformed delivery"));
            out.push((401, "the signature does not verify (`unauthorized`)"));
            out.push((404, "no such Workspace"));
            out.push((409, "the delivery conflicts with what is recorded"));
            out.push((422, "a delivery that is not acceptable"));
        }
    }
    if has_body {
        out.push((413, "the body is over the endpoint's limit"));
    }
    if e.access != Access::Public {
        out.push((
            500,
            "a bug of ours (`internal`); the operators have the details",
        ));
    }
    out.push((
        503,
        "a dependency is unavailable (`unavailable`); try again",
    ));
    out
}

/// What the route's guard requires, in words (from the same table entry it enforces).
fn access_text(access: Access) -> String {
    use crate::access::Scope;
    use crate::auth::Action;
    match access {
        Access::Public => "Access: public (no token).".to_owned(),
        Access::Session => "Access: a dashboard session.".to_owned(),
        Access::PoolToken => "Access: a worker pool's token; no API token.".to_owned(),
        Access::WebhookSignature => {
            "Access: the Git host's signature with the Workspace's webhook secret.".to_owned()
        }
        Access::Token(action, scope) => {
            let action = match action {
                Action::Read => "read",
                Action::Operate => "operate",
                Action::Submit => "submit",
                Action::Administer => "administer",
                Action::Approve => "approve (the rule in force decides whose approval counts)",
            };
            let scope = match scope {
                Scope::Instance => "the instance (a token limited to one Workspace may only read)",
                Scope::Workspace => "the Workspace `{ws}`",
                Scope::Capsule => "the Capsule's Workspace",
                Scope::Run => "the Run's Workspace",
                Scope::RunGroup => "the RunGroup's Workspace",
                Scope::Pool => "the pool's Workspace",
            };
            format!("Access: an API token whose role may {action} in {scope}.")
        }
    }
}

fn reason(status: u16) -> &'static str {
    axum::http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("answer")
}

fn http_method(m: &Method) -> HttpMethod {
    match *m {
        Method::GET => HttpMethod::Get,
        Method::POST => HttpMethod::Post,
        Method::PUT => HttpMethod::Put,
        Method::PATCH => HttpMethod::Patch,
        Method::DELETE => HttpMethod::Delete,
        Method::HEAD => HttpMethod::Head,
        Method::OPTIONS => HttpMethod::Options,
        _ => panic!("{m} has no OpenAPI operation"),
    }
}

/// The path parameters of a template (`/runs/{run}` → `run`).
fn path_params(path: &str) -> Vec<&str> {
    path.split('/')
        .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .collect()
}

fn param_description(name: &str) -> &'static str {
    match name {
        "ws" => "A Workspace id (`ws_…`).",
        "cap" => "A Capsule id (`cap_…`).",
        "run" => "A Run id (`run_…`).",
        "rg" => "A RunGroup id (`rg_…`).",
        "pb" => "A ProviderBinding id (`pb_…`).",
        "pool" => "A worker pool's name.",
        "token" => "A token id (`tok_…`).",
        _ => "A path parameter.",
    }
}

/// A path parameter's schema: an id's pattern where it names one.
fn param_schema(name: &str) -> RefOr<Schema> {
    use takosumi_core::{CapsuleId, ProviderBindingId, RunGroupId, RunId, TokenId, WorkspaceId};
    use utoipa::PartialSchema;
    match name {
        "ws" => WorkspaceId::schema(),
        "cap" => CapsuleId::schema(),
        "run" => RunId::schema(),
        "rg" => RunGroupId::schema(),
        "pb" => ProviderBindingId::schema(),
        "token" => TokenId::schema(),
        _ => string_schema(),
    }
}

fn string_schema() -> RefOr<Schema> {
    ObjectBuilder::new().schema_type(Type::String).into()
}

/// The OpenAPI document of `endpoints`: every one with an API [`Doc`], nothing else.
pub fn document(endpoints: &[Endpoint]) -> OpenApi {
    let mut paths = Paths::new();
    let mut components = ComponentsBuilder::new();
    let mut named: BTreeMap<String, RefOr<Schema>> = BTreeMap::new();
    let mut collect = |c: &Content| {
        for (name, schema) in &c.named {
            named.entry(name.clone()).or_insert_with(|| schema.clone());
        }
    };
    let error = Content::json::<ErrorBody>();
    collect(&error);
    for e in endpoints {
        let Some(Doc {
            kind: Kind::Op(op), ..
        }) = &e.doc
        else {
            continue;
        };
        let access = access_text(e.access);
        let description = match op.description {
            Some(d) => format!("{d}\n\n{access}"),
            None => access,
        };
        let mut b = OperationBuilder::new()
            .operation_id(Some(op.id))
            .summary(Some(op.summary))
            .description(Some(description));
        for p in path_params(e.path) {
            b = b.parameter(
                ParameterBuilder::new()
                    .name(p)
                    .parameter_in(ParameterIn::Path)
                    .required(Required::True)
                    .description(Some(param_description(p)))
                    .schema(Some(param_schema(p))),
            );
        }
        for (name, description) in &op.query {
            b = b.parameter(
                ParameterBuilder::new()
                    .name(*name)
                    .parameter_in(ParameterIn::Query)
                    .required(Required::False)
                    .description(Some(*description))
                    .schema(Some(string_schema())),
            );
        }
        for (name, description) in &op.headers {
            b = b.parameter(
                ParameterBuilder::new()
                    .name(*name)
                    .parameter_in(ParameterIn::Header)
                    .required(Required::False)
                    .description(Some(*description))
                    .schema(Some(string_schema())),
            );
        }
        if let Some(body) = &op.body {
            collect(body);
            b = b.request_body(Some(
                RequestBodyBuilder::new()
                    .content(
                        body.media,
                        ContentBuilder::new()
                            .schema(Some(body.schema.clone()))
                            .build(),
                    )
                    .required(Some(if op.body_required {
                        Required::True
                    } else {
                        Required::False
                    }))
                    .build(),
            ));
        }
        let mut responses = ResponsesBuilder::new();
        for (status, content) in &op.ok {
            let mut r = ResponseBuilder::new().description(reason(*status));
            if let Some(c) = content {
                collect(c);
                r = r.content(
                    c.media,
                    ContentBuilder::new().schema(Some(c.schema.clone())).build(),
                );
            }
            responses = responses.response(status.to_string(), r.build());
        }
        for (status, description) in error_statuses(e, op.body.is_some()) {
            if op.ok.contains_key(&status) {
                continue;
            }
            responses = responses.response(
                status.to_string(),
                ResponseBuilder::new()
                    .description(description)
                    .content(
                        error.media,
                        ContentBuilder::new()
                            .schema(Some(error.schema.clone()))
                            .build(),
                    )
                    .build(),
            );
        }
        b = b.responses(responses.build());
        let scheme = match e.access {
            Access::Token(..) => Some(BEARER),
            Access::PoolToken => Some(POOL),
            Access::WebhookSignature => Some(WEBHOOK),
            Access::Public | Access::Session => None,
        };
        if let Some(s) = scheme {
            b = b.security(SecurityRequirement::new(s, Vec::<String>::new()));
        }
        paths.add_path_operation(e.path, vec![http_method(&e.method)], b.build());
    }
    for (name, schema) in named {
        components = components.schema(name, schema);
    }
    let components = components
        .security_scheme(
            BEARER,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An API token (`tks_…`): `Authorization: Bearer <token>`. Its role and \
                         Workspace limit decide what it may do.",
                    ))
                    .build(),
            ),
        )
        .security_scheme(
            POOL,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A worker pool's token, as `Authorization: Bearer <pool token>`: only \
                         the relay endpoints take it, and no API token is accepted there.",
                    ))
                    .build(),
            ),
        )
        .security_scheme(
            WEBHOOK,
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-Hub-Signature-256",
                "The Git host's signature of the delivery with the Workspace's webhook \
                 secret: GitHub's `X-Hub-Signature-256: sha256=<HMAC-SHA256>` or GitLab's \
                 `X-Gitlab-Token`.",
            ))),
        )
        .build();
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("Takosumi API")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "The deploy control plane's JSON API (camelCase). Errors are \
                     `{\"code\", \"message\"}` with a stable `code`.",
                ))
                .build(),
        )
        .paths(paths)
        .components(Some(components))
        .build()
}

/// The document of the API's own routes, as JSON.
pub fn json() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        let (_, endpoints) = crate::router::api().into_parts();
        document(&endpoints)
            .to_pretty_json()
            .expect("the OpenAPI document serializes")
    })
}

/// `GET /api/v1/openapi.json`: public, since it shows only the API's shape.
pub fn api() -> Api {
    Api::new()
        .route(Method::GET, PATH, Access::Public, || async {
            let mut resp = json().into_response();
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        })
        .doc(
            Doc::op(
                "getOpenApi",
                "This document: the API's OpenAPI 3.1 description",
            )
            .ok_object(200, "An OpenAPI 3.1 document."),
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;
    use utoipa::PartialSchema;

    /// Every error code is in the error schema's enum.
    #[test]
    fn error_codes_are_listed() {
        let doc = serde_json::to_value(document(&crate::access::endpoints())).unwrap();
        let codes = &doc["components"]["schemas"]["ErrorCode"]["enum"];
        for code in ErrorCode::ALL {
            assert!(
                codes.as_array().unwrap().iter().any(|c| c == code.as_str()),
                "{code:?} missing from {codes}"
            );
        }
        let _ = ErrorCode::schema();
    }
}
