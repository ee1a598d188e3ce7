//! The pages. Each reads what it shows through the API as the session's token (see the
//! module above) and renders it with maud, which escapes every value it is given; no
//! page carries inline script or style (the CSP forbids both).

use std::collections::HashSet;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};
use serde::Deserialize;
use serde_json::Value;
use takosumi_core::{CapsuleStatus, RunId, RunKind, RunStatus, WorkspaceId};
use takosumi_cost::CostEstimate;
use takosumi_evidence::{ChainHead, SignedStatement, StatementPage, verify_run_in_chain};
use takosumi_wire::{
    ActivityPage, ApprovalsView, AttributeDiff, Capsule, CapsuleList, Code, EventList, LogList,
    PlanView, Run, RunPage, WorkspaceList,
};

use super::{Session, get, get_optional};
use crate::AppState;
use crate::auth::Action;

fn page(title: &str, session: Option<&Session>, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                // htmx must not inject styles or evaluate anything (the CSP would refuse).
                meta name="htmx-config" content=r#"{"includeIndicatorStyles":false,"allowEval":false,"allowScriptTags":false}"#;
                title { (title) " · Takosumi" }
                link rel="stylesheet" href="/assets/dashboard.css";
                script src="/assets/htmx.min.js" defer {}
                script src="/assets/dashboard.js" defer {}
            }
            body {
                header.top {
                    a.brand href="/" { "Takosumi" }
                    @if let Some(s) = session {
                        span.who data-testid="who" {
                            (s.caller.0.name) " · " (s.caller.0.role)
                        }
                        form.inline method="post" action="/sign-out" {
                            input type="hidden" name="csrf" value=(s.csrf);
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main { (content) }
            }
        }
    }
}

fn render(status: StatusCode, markup: Markup) -> Response {
    (status, Html(markup.into_string())).into_response()
}

/// A page that says what went wrong (the API's message when it refused).
pub(super) fn problem(status: StatusCode, message: &str) -> Response {
    render(
        status,
        page(
            "Problem",
            None,
            html! {
                section.problem role="alert" {
                    h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
                    p data-testid="problem" { (message) }
                    p { a href="/" { "Back to the Workspaces" } }
                }
            },
        ),
    )
}

// ---- sign-in --------------------------------------------------------------------------

#[derive(Deserialize, Default)]
pub(super) struct NextQuery {
    #[serde(default)]
    next: String,
}

pub(super) async fn sign_in_form(q: Result<Query<NextQuery>, QueryRejection>) -> Response {
    let next = q.map(|Query(q)| q.next).unwrap_or_default();
    sign_in_page(None, super::local_path(&next))
}

pub(super) fn sign_in_page(error: Option<&str>, next: &str) -> Response {
    render(
        if error.is_some() {
            StatusCode::UNAUTHORIZED
        } else {
            StatusCode::OK
        },
        page(
            "Sign in",
            None,
            html! {
                section.signin {
                    h1 { "Sign in" }
                    p { "Paste an API token (" code { "takosumi login" } " uses the same ones). \
                         The browser keeps only a session cookie, never the token." }
                    @if let Some(e) = error { p.error role="alert" data-testid="problem" { (e) } }
                    form method="post" action="/sign-in" autocomplete="off" {
                        input type="hidden" name="next" value=(next);
                        label for="token" { "API token" }
                        input #token type="password" name="token" required autocomplete="off";
                        button type="submit" { "Sign in" }
                    }
                }
            },
        ),
    )
}

// ---- shared pieces --------------------------------------------------------------------

fn nonce() -> String {
    use rand::RngCore;
    let mut b = [0u8; 16];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

/// A button that posts `action` with the session's CSRF token and a one-time nonce.
fn action_button(s: &Session, action: &str, label: &str, extra: Markup) -> Markup {
    html! {
        form.inline method="post" action=(action) {
            input type="hidden" name="csrf" value=(s.csrf);
            input type="hidden" name="nonce" value=(nonce());
            (extra)
            button type="submit" data-action=(label) { (label) }
        }
    }
}

fn status_badge(status: RunStatus) -> Markup {
    html! { span class={ "badge status-" (status.as_str()) } data-testid="status" { (status.as_str()) } }
}

fn changes(run: &Run) -> Markup {
    html! {
        @if let Some(c) = &run.changes {
            span.changes title="to add, to change, to destroy" {
                span.add { "+" (c.add) } " " span.change { "~" (c.change) } " " span.destroy { "−" (c.destroy) }
            }
        } @else { span.muted { "—" } }
    }
}

fn when(at: Option<chrono::DateTime<chrono::Utc>>) -> String {
    at.map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_default()
}

/// Any JSON the API gave (hold details, rules, drift rollups) as nested lists.
fn value(v: &Value) -> Markup {
    html! {
        @match v {
            Value::Object(m) if m.is_empty() => span.muted { "{}" },
            Value::Object(m) => dl.json {
                @for (k, v) in m { dt { (k) } dd { (value(v)) } }
            },
            Value::Array(a) if a.is_empty() => span.muted { "none" },
            Value::Array(a) => ol.json { @for v in a { li { (value(v)) } } },
            Value::String(s) => code { (s) },
            Value::Null => span.muted { "null" },
            other => code { (other.to_string()) },
        }
    }
}

fn runs_table(runs: &[Run]) -> Markup {
    html! {
        table.runs {
            thead { tr { th { "Run" } th { "Kind" } th { "Status" } th { "Changes" } th { "Actor" } th { "Created" } } }
            tbody {
                @for r in runs {
                    tr {
                        td { a href={ "/runs/" (r.id) } { (r.id) } }
                        td { (r.kind.as_str()) }
                        td { (status_badge(r.status)) }
                        td { (changes(r)) }
                        td { @if let Some(a) = &r.actor { (a.kind) ":" (a.id) } }
                        td { (when(r.created_at)) }
                    }
                }
                @if runs.is_empty() { tr { td colspan="6" .muted { "No Runs." } } }
            }
        }
    }
}

// ---- pages ----------------------------------------------------------------------------

pub(super) async fn workspaces(State(st): State<AppState>, s: Session) -> Response {
    let list: WorkspaceList = match get(&st, &s, "/api/v1/workspaces").await {
        Ok(l) => l,
        Err(p) => return p,
    };
    render(
        StatusCode::OK,
        page(
            "Workspaces",
            Some(&s),
            html! {
                h1 { "Workspaces" }
                ul.cards {
                    @for w in &list.workspaces {
                        li { a href={ "/workspaces/" (w.id) } { (w.name) } " " span.muted { (w.id) } }
                    }
                    @if list.workspaces.is_empty() { li.muted { "No Workspaces yet (" code { "takosumi workspace create" } ")." } }
                }
            },
        ),
    )
}

#[derive(Deserialize, Default)]
pub(super) struct RunFilters {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    capsule: String,
    #[serde(default)]
    cursor: String,
}

impl RunFilters {
    fn query(&self) -> String {
        let pairs: Vec<(&str, &str)> = [
            ("kind", self.kind.as_str()),
            ("status", self.status.as_str()),
            ("capsule", self.capsule.as_str()),
            ("cursor", self.cursor.as_str()),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .collect();
        serde_urlencoded::to_string(pairs).unwrap_or_default()
    }
}

/// What a Capsule row says: the API's status, or that an apply of it needs inspection.
fn capsule_state(c: &Capsule, inspect: &HashSet<String>) -> &'static str {
    if inspect.contains(&c.id.to_string()) {
        return "needs-inspection";
    }
    match c.status.known() {
        Some(CapsuleStatus::Applying) => "applying",
        Some(CapsuleStatus::Drifted) => "drifted",
        Some(CapsuleStatus::Stale) => "stale",
        _ if c.drifted => "drifted",
        _ => "ok",
    }
}

pub(super) async fn workspace(
    State(st): State<AppState>,
    s: Session,
    Path(ws): Path<String>,
    filters: Result<Query<RunFilters>, QueryRejection>,
) -> Response {
    let filters = filters.map(|Query(f)| f).unwrap_or_default();
    let base = format!("/api/v1/workspaces/{ws}");
    let capsules: CapsuleList = match get(&st, &s, &format!("{base}/capsules")).await {
        Ok(c) => c,
        Err(p) => return p,
    };
    let runs: RunPage = match get(&st, &s, &format!("{base}/runs?{}", filters.query())).await {
        Ok(r) => r,
        Err(p) => return p,
    };
    let unknown: RunPage = match get(
        &st,
        &s,
        &format!("{base}/runs?status=unknown_outcome&limit=100"),
    )
    .await
    {
        Ok(r) => r,
        Err(p) => return p,
    };
    let inspect: HashSet<String> = unknown
        .runs
        .iter()
        .filter(|r| r.resolution.is_none())
        .map(|r| r.capsule_id.to_string())
        .collect();
    let activity: ActivityPage = match get(&st, &s, &format!("{base}/activity?limit=15")).await {
        Ok(a) => a,
        Err(p) => return p,
    };
    let drift: Option<Value> = match get_optional(&st, &s, &format!("{base}/drift")).await {
        Ok(d) => d,
        Err(p) => return p,
    };
    let next = runs.next_cursor.as_ref().map(|c| {
        let f = RunFilters {
            cursor: c.clone(),
            kind: filters.kind.clone(),
            status: filters.status.clone(),
            capsule: filters.capsule.clone(),
        };
        format!("/workspaces/{ws}?{}", f.query())
    });
    let kinds = ["", "plan", "destroy", "apply", "drift_check"];
    let statuses = [
        "",
        "queued",
        "planning",
        "planned",
        "held",
        "applying",
        "applied",
        "failed",
        "canceled",
        "unknown_outcome",
    ];
    render(
        StatusCode::OK,
        page(
            "Workspace",
            Some(&s),
            html! {
                h1 { "Workspace " span.muted { (ws) } }
                @if runs.unknown_outcome_count > 0 {
                    p.banner.danger role="alert" {
                        (runs.unknown_outcome_count) " apply Run(s) ended "
                        strong { "unknown_outcome" } ": inspect them (filter by status below)."
                    }
                }
                section {
                    h2 { "Capsules" }
                    table.capsules {
                        thead { tr { th { "Capsule" } th { "State" } th { "Source" } th { "Generation" } } }
                        tbody {
                            @for c in &capsules.capsules {
                                @let state = capsule_state(c, &inspect);
                                tr data-capsule=(c.name) {
                                    td { a href={ "/capsules/" (c.id) } { (c.name) } }
                                    td { span class={ "badge cap-" (state) } data-testid="capsule-state" { (state) } }
                                    td { code { (c.source.repo) } " @ " (c.source.branch) " / " (c.dir) }
                                    td { (c.state_generation) }
                                }
                            }
                        }
                    }
                }
                section #runs {
                    h2 { "Runs" }
                    form.filters method="get" action={ "/workspaces/" (ws) }
                        hx-get={ "/workspaces/" (ws) } hx-target="#runs" hx-select="#runs"
                        hx-swap="outerHTML" hx-push-url="true" {
                        label { "Kind " select name="kind" {
                            @for k in kinds { option value=(k) selected[filters.kind == k] { @if k.is_empty() { "any" } @else { (k) } } }
                        } }
                        label { "Status " select name="status" {
                            @for v in statuses { option value=(v) selected[filters.status == v] { @if v.is_empty() { "any" } @else { (v) } } }
                        } }
                        label { "Capsule " select name="capsule" {
                            option value="" { "any" }
                            @for c in &capsules.capsules {
                                @let id = c.id.to_string();
                                option value=(id) selected[filters.capsule == id] { (c.name) }
                            }
                        } }
                        button type="submit" { "Filter" }
                    }
                    (runs_table(&runs.runs))
                    @if let Some(next) = next {
                        p { a href=(next) hx-get=(next) hx-target="#runs" hx-select="#runs" hx-swap="outerHTML" hx-push-url="true" { "Older Runs →" } }
                    }
                }
                section {
                    h2 { "Drift" }
                    @if let Some(d) = &drift { (value(d)) } @else { p.muted { "No drift checks yet." } }
                }
                section {
                    h2 { "Activity" }
                    ul.activity {
                        @for a in &activity.activity {
                            li { span.muted { (when(a.at)) } " " strong { (a.kind) } " " code { (a.subject) } " by " (a.actor) }
                        }
                    }
                }
            },
        ),
    )
}

pub(super) async fn capsule(
    State(st): State<AppState>,
    s: Session,
    Path(cap): Path<String>,
) -> Response {
    let c: Capsule = match get(&st, &s, &format!("/api/v1/capsules/{cap}")).await {
        Ok(c) => c,
        Err(p) => return p,
    };
    let ws = c.workspace_id;
    let base = format!("/api/v1/workspaces/{ws}/runs?capsule={}", c.id);
    let applied: RunPage = match get(
        &st,
        &s,
        &format!("{base}&kind=apply&status=applied&limit=1"),
    )
    .await
    {
        Ok(r) => r,
        Err(p) => return p,
    };
    let recent: RunPage = match get(&st, &s, &format!("{base}&limit=10")).await {
        Ok(r) => r,
        Err(p) => return p,
    };
    let rules: Option<Value> =
        match get_optional(&st, &s, &format!("/api/v1/capsules/{}/rules", c.id)).await {
            Ok(r) => r,
            Err(p) => return p,
        };
    let current = applied.runs.first();
    let may_submit = s.caller.may(Action::Submit, Some(ws));
    let may_operate = s.caller.may(Action::Operate, Some(ws));
    let prefix = format!("/capsules/{}", c.id);
    render(
        StatusCode::OK,
        page(
            &c.name,
            Some(&s),
            html! {
                p.crumbs { a href={ "/workspaces/" (ws) } { "Workspace" } " / Capsule" }
                h1 { (c.name) " " span class={ "badge cap-" (c.status) } data-testid="capsule-state" { (c.status) } }
                p { code { (c.source.repo) } " @ " (c.source.branch) " / " (c.dir) " · " (c.tool) }
                @if may_submit {
                    div.actions {
                        (action_button(&s, &format!("{prefix}/install"), "Install", html!{}))
                        (action_button(&s, &format!("{prefix}/plan"), "Plan", html!{}))
                        @if may_operate { (action_button(&s, &format!("{prefix}/drift-check"), "Drift check", html!{})) }
                        (action_button(&s, &format!("{prefix}/destroy"), "Destroy", html!{}))
                    }
                }
                section {
                    h2 { "Current state" }
                    p {
                        "Generation " (c.state_generation)
                        @if let Some(sv) = &c.current_state_version_id { " · StateVersion " code { (sv) } }
                    }
                    @if let Some(r) = current {
                        p { "Applied by " a href={ "/runs/" (r.id) } { (r.id) } " at " (when(r.updated_at)) }
                        (outputs(r))
                    } @else { p.muted { "Nothing applied yet." } }
                }
                section {
                    h2 { "Variables" }
                    ul { @for (k, v) in &c.vars { li { code { (k) } " = " (value(v)) } } }
                    @if !c.withheld_vars.is_empty() {
                        p.muted { "Withheld (sensitive, or your role may not see them): " @for n in &c.withheld_vars { code { (n) } " " } }
                    }
                }
                section {
                    h2 { "Rules in force" }
                    @if let Some(r) = &rules { (value(r)) } @else { p.muted { "None." } }
                }
                section {
                    h2 { "Recent Runs" }
                    (runs_table(&recent.runs))
                }
            },
        ),
    )
}

fn outputs(r: &Run) -> Markup {
    html! {
        @if let Some(Value::Object(o)) = r.outputs.as_ref().filter(|o| o.as_object().is_some_and(|m| !m.is_empty())) {
            table.outputs data-testid="outputs" {
                thead { tr { th { "Output" } th { "Value" } } }
                tbody {
                    @for (k, v) in o {
                        tr {
                            td { code { (k) } }
                            td {
                                @if v.get("sensitive").and_then(Value::as_bool) == Some(true) {
                                    span.muted { "(sensitive)" }
                                } @else { (value(v)) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn diff_section(plan: Option<&PlanView>) -> Markup {
    html! {
        section #plan {
            h2 { "Plan" }
            @match plan.and_then(|p| p.diff.as_ref()) {
                None => p.muted { "No plan recorded." },
                Some(d) if d.resources.is_empty() && d.outputs.is_empty() => p data-testid="no-changes" { "No changes." },
                Some(d) => {
                    @for r in &d.resources {
                        details.resource open data-address=(r.address) {
                            summary {
                                span class={ "action act-" (r.action) } { (action_label(&r.action, r.create_before_destroy)) }
                                " " code { (r.address) }
                                @if let Some(reason) = &r.reason { " " span.muted { "(" (reason) ")" } }
                            }
                            table.attrs {
                                @for a in &r.attributes {
                                    tr.forces[a.forces_replacement] {
                                        td { code { (a.name) } @if a.forces_replacement { " " span.forces-label { "forces replacement" } } }
                                        (change_cells(a))
                                    }
                                }
                            }
                            @if r.omitted_attributes > 0 { p.muted { (r.omitted_attributes) " more attributes not shown." } }
                        }
                    }
                    @if d.omitted > 0 { p.muted { (d.omitted) " more resources not shown." } }
                    @if !d.outputs.is_empty() {
                        h3 { "Outputs" }
                        table.attrs data-testid="output-changes" {
                            @for a in &d.outputs {
                                tr {
                                    td { code { (a.name) } }
                                    (change_cells(a))
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Before → after of one attribute or output, withheld when sensitive.
fn change_cells(a: &AttributeDiff) -> Markup {
    html! {
        td { @if a.sensitive { span.muted { "(sensitive)" } } @else { (opt_value(a.before.as_ref())) } }
        td { "→" }
        td {
            @if a.sensitive { span.muted { "(sensitive)" } }
            @else if a.unknown { span.muted { "(known after apply)" } }
            @else { (opt_value(a.after.as_ref())) }
        }
    }
}

fn action_label(action: &str, create_before_destroy: bool) -> &'static str {
    match action {
        "create" => "+ create",
        "update" => "~ update",
        "delete" => "− destroy",
        "replace" if create_before_destroy => "+/− replace (create first)",
        "replace" => "−/+ replace",
        "read" => "<= read",
        _ => "?",
    }
}

fn opt_value(v: Option<&Value>) -> Markup {
    match v {
        Some(v) => value(v),
        None => html! { span.muted { "—" } },
    }
}

/// The Run's evidence statement checked against the Workspace's chain and the server's
/// published keys: a line that says it verified, or which check failed.
async fn evidence_result(st: &AppState, s: &Session, run: &Run) -> Result<Markup, Response> {
    if !run.status.is_terminal() {
        return Ok(html! { p.muted { "Written when the Run ends." } });
    }
    let uri = format!("/api/v1/runs/{}/evidence", run.id);
    let reply = super::read(st, s, axum::http::Method::GET, &uri, None, None).await?;
    let served: SignedStatement = match reply.status {
        // `evidence_pending`: the writer has not signed it yet.
        StatusCode::CONFLICT => return Ok(evidence_pending(run.id)),
        // `evidence_missing` (a deleted statement) and the like: said, not waited for.
        status if status.is_client_error() => {
            return Ok(html! {
                p.banner.danger #evidence data-testid="evidence" {
                    "✗ " (super::api_message(status, &reply.body))
                }
            });
        }
        _ => reply.decode()?,
    };
    let ws = run.workspace_id;
    let mut envelopes = Vec::new();
    let mut cursor: Option<String> = None;
    let head: Option<ChainHead> = loop {
        let q = cursor
            .as_deref()
            .map(|c| format!("?cursor={}", urlencode(c)))
            .unwrap_or_default();
        let page: StatementPage =
            get(st, s, &format!("/api/v1/workspaces/{ws}/evidence{q}")).await?;
        envelopes.extend(page.statements.into_iter().map(|x| x.envelope));
        match page.next_cursor {
            Some(n) => cursor = Some(n),
            None => break page.head,
        }
    };
    let ring = st.evidence_keys.to_ring();
    let outcome = ring.map_err(|e| e.to_string()).and_then(|ring| {
        verify_run_in_chain(
            &ws.to_string(),
            &envelopes,
            head.as_ref(),
            &ring,
            Some(&run.id.to_string()),
            Some(&served.envelope),
        )
        .map_err(|e| e.to_string())
    });
    Ok(match outcome {
        Ok((report, Some(v))) => html! {
            p.verified #evidence data-testid="evidence" {
                "✓ Verified: statement " (v.position) " of " (report.statements.len())
                " in the Workspace's chain, signed by key " code { (v.key_id) } ", digest " code { (short(&v.digest)) }
            }
        },
        Ok((_, None)) => html! { p.muted #evidence { "Not in the chain." } },
        Err(e) => {
            html! { p.banner.danger #evidence data-testid="evidence" { "✗ Verification failed: " (e) } }
        }
    })
}

/// The writer signs ended Runs in bursts, so a page rendered as its Run settles can come
/// before the Run's statement: this line fetches the page again each second and swaps in
/// its own replacement (`#evidence`) until the statement is there.
fn evidence_pending(run: RunId) -> Markup {
    html! {
        p.muted #evidence hx-get={ "/runs/" (run) } hx-trigger="load delay:1s"
            hx-select="#evidence" hx-swap="outerHTML" { "Being signed…" }
    }
}

fn urlencode(s: &str) -> String {
    serde_urlencoded::to_string([("", s)])
        .unwrap_or_default()
        .trim_start_matches('=')
        .to_owned()
}

fn short(digest: &str) -> &str {
    digest.get(..16).unwrap_or(digest)
}

pub(super) async fn run(
    State(st): State<AppState>,
    s: Session,
    Path(id): Path<String>,
) -> Response {
    let base = format!("/api/v1/runs/{id}");
    let run: Run = match get(&st, &s, &base).await {
        Ok(r) => r,
        Err(p) => return p,
    };
    let events: EventList = match get(&st, &s, &format!("{base}/events")).await {
        Ok(e) => e,
        Err(p) => return p,
    };
    let logs: LogList = match get(&st, &s, &format!("{base}/logs")).await {
        Ok(l) => l,
        Err(p) => return p,
    };
    let plan: Option<PlanView> = match get_optional(&st, &s, &format!("{base}/plan")).await {
        Ok(p) => p,
        Err(p) => return p,
    };
    let approvals: ApprovalsView = match get(&st, &s, &format!("{base}/approvals")).await {
        Ok(a) => a,
        Err(p) => return p,
    };
    let cost: Option<CostEstimate> = if matches!(run.kind, RunKind::Plan | RunKind::Destroy) {
        match get_optional(&st, &s, &format!("{base}/cost")).await {
            Ok(c) => c,
            Err(p) => return p,
        }
    } else {
        None
    };
    let evidence = match evidence_result(&st, &s, &run).await {
        Ok(e) => e,
        Err(p) => return p,
    };
    let followed_by = match followed_by(&st, &s, &run).await {
        Ok(f) => f,
        Err(p) => return p,
    };
    let title = format!("{} {}", run.kind.as_str(), run.id);
    let body = run_page(
        &s,
        &run,
        RunParts {
            events: &events,
            logs: &logs,
            plan: plan.as_ref(),
            approvals: &approvals,
            cost: cost.as_ref(),
            evidence,
            followed_by: &followed_by,
        },
    );
    render(StatusCode::OK, page(&title, Some(&s), body))
}

/// The apply Runs that carry out this plan.
async fn followed_by(st: &AppState, s: &Session, run: &Run) -> Result<Vec<Run>, Response> {
    if run.kind == RunKind::Apply || run.status != RunStatus::Planned {
        return Ok(Vec::new());
    }
    let page: RunPage = get(
        st,
        s,
        &format!(
            "/api/v1/workspaces/{}/runs?capsule={}&kind=apply&limit=20",
            run.workspace_id, run.capsule_id
        ),
    )
    .await?;
    Ok(page
        .runs
        .into_iter()
        .filter(|a| a.plan_run_id == Some(run.id))
        .collect())
}

/// What a Run page shows besides the Run.
struct RunParts<'a> {
    events: &'a EventList,
    logs: &'a LogList,
    plan: Option<&'a PlanView>,
    approvals: &'a ApprovalsView,
    cost: Option<&'a CostEstimate>,
    evidence: Markup,
    followed_by: &'a [Run],
}

fn run_page(s: &Session, run: &Run, parts: RunParts<'_>) -> Markup {
    let RunParts {
        events,
        logs,
        plan,
        approvals,
        cost,
        evidence,
        followed_by,
    } = parts;
    let ws: WorkspaceId = run.workspace_id;
    let me = s.caller.0.id.to_string();
    let requester = run.actor.as_ref().map(|a| a.id.as_str()) == Some(me.as_str());
    let already = approvals.given.iter().any(|a| a.approver == me);
    let may_approve = run.status == RunStatus::Held
        && !requester
        && !already
        && approvals
            .approver_roles
            .iter()
            .any(|r| *r == s.caller.0.role)
        && s.caller.may(Action::Approve, Some(ws));
    let may_apply = run.status == RunStatus::Planned
        && matches!(
            run.kind,
            RunKind::Plan | RunKind::Destroy | RunKind::DriftCheck
        )
        && run.plan_digest.is_some()
        && s.caller.may(Action::Submit, Some(ws));
    let may_cancel = !run.status.is_terminal() && s.caller.may(Action::Operate, Some(ws));
    let unresolved = run.status == RunStatus::UnknownOutcome && run.resolution.is_none();
    let may_resolve = unresolved && s.caller.may(Action::Administer, Some(ws));
    let prefix = format!("/runs/{}", run.id);
    let full_log = takosumi_wire::join_logs(&logs.logs);
    html! {
        (page_head(run))
        @if unresolved {
            section.banner.danger role="alert" data-testid="unknown-outcome" {
                h2 { "Outcome unknown" }
                p { "The apply was interrupted where Takosumi cannot tell what the tool changed. \
                     Inspect the provider side and the Capsule's current StateVersion before anything else runs; \
                     then record what you found (" code { "takosumi resolve " (run.id) } " can also attach a state)." }
                @if may_resolve {
                    (action_button(s, &format!("{prefix}/resolve"), "Mark resolved", html! {
                        label { "Note " input type="text" name="note" required maxlength="2000"; }
                    }))
                }
            }
        }
        div.actions {
            @if may_approve {
                (action_button(s, &format!("{prefix}/approve"), "Approve", html! {
                    input type="hidden" name="planDigest" value=(run.plan_digest.clone().unwrap_or_default());
                    span.muted { "plan " code data-testid="approve-digest" { (run.plan_digest.as_deref().map(short).unwrap_or("—")) } " " }
                }))
            }
            @if may_apply { (action_button(s, &format!("{prefix}/apply"), "Apply", html!{})) }
            @if may_cancel { (action_button(s, &format!("{prefix}/cancel"), "Cancel", html!{})) }
        }
        @for a in followed_by {
            p.banner data-testid="followed-by" { "Carried out by " a href={ "/runs/" (a.id) } { (a.kind.as_str()) " " (a.id) } " " (status_badge(a.status)) }
        }
        @if let Some(h) = &run.hold {
            section.hold data-testid="hold" {
                h2 { @if run.status == RunStatus::Held { "Held: " } @else { "Was held: " } (h.reason) }
                (value(&h.details))
            }
        }
        @if run.status == RunStatus::Held || !approvals.given.is_empty() {
            section {
                h2 { "Approvals" }
                p { (approvals.given.len()) " given; " (approvals.required) " needed from "
                    @if approvals.approver_roles.is_empty() { "any approving role" } @else { (approvals.approver_roles.iter().map(Code::as_str).collect::<Vec<_>>().join(", ")) } }
                ul { @for a in &approvals.given { li { code { (a.approver) } " (" (a.role) ") at " (when(Some(a.at)))
                    " for plan " code { (a.plan_digest.as_deref().map(short).unwrap_or("—")) } } } }
            }
        }
        @if let Some(e) = &run.error {
            section.banner.danger data-testid="error" { strong { (e.code) } ": " (e.message) }
        }
        (diff_section(plan))
        @if let Some(c) = cost {
            section {
                h2 { "Cost" }
                p { (c.currency) " per " (c.period) ": " (format!("{:.2}", c.total.current)) " → " (format!("{:.2}", c.total.proposed))
                    " (" (format!("{:+.2}", c.total.delta)) ")" @if !c.complete { " · " span.muted { (c.unpriced.len()) " resource(s) unpriced" } } }
            }
        }
        (outputs(run))
        section {
            h2 { "Timeline" }
            ol.timeline #events {
                @for e in &events.events {
                    li data-event=(e.kind) { span.muted { (when(e.at)) } " " strong { (e.kind) } " " span.muted { (e.actor) } }
                }
            }
        }
        section {
            h2 { "Log" }
            // While the Run goes, the page script follows its stream: the stream starts from
            // the beginning (the script replaces what the page was rendered with), resumes
            // where it was after a reconnect, and the page reloads when the Run settles.
            pre #log data-stream={ (prefix) "/stream" } data-terminal=(run.status.is_terminal()) { (full_log) }
        }
        section {
            h2 { "Evidence" }
            (evidence)
        }
        section.record {
            h2 { "Record" }
            dl {
                dt { "Plan digest" } dd { code { (run.plan_digest.as_deref().unwrap_or("—")) } }
                @if let Some(src) = &run.source_snapshot { dt { "Source" } dd { code { (src.commit) } } }
                dt { "Auto-apply requested" } dd { (run.auto_apply_requested) }
                dt { "Sandbox" } dd { (run.sandbox.as_ref().map_or("—", |s| s.as_str())) }
                dt { "Injected env (names)" } dd { (run.injected_env_names.join(", ")) }
                @if let Some(p) = run.plan_run_id { dt { "Carries out" } dd { a href={ "/runs/" (p) } { (p) } } }
            }
        }
    }
}

fn page_head(run: &Run) -> Markup {
    html! {
        p.crumbs {
            a href={ "/workspaces/" (run.workspace_id) } { "Workspace" } " / "
            a href={ "/capsules/" (run.capsule_id) } { "Capsule" } " / Run"
        }
        h1 { (run.kind.as_str()) " " code { (run.id) } " " (status_badge(run.status)) " " (changes(run)) }
        @if let Some(a) = &run.actor { p.muted { "by " (a.kind) ":" (a.id) " · " (when(run.created_at)) } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_being_signed_fetches_itself_until_it_is_there() {
        let run: RunId = "run_0000000000000000000000000000000a"
            .parse()
            .expect("a run id");
        let html = evidence_pending(run).into_string();
        for part in [
            r#"id="evidence""#,
            &format!(r#"hx-get="/runs/{run}""#),
            r##"hx-select="#evidence""##,
            r#"hx-swap="outerHTML""#,
            r#"hx-trigger="load delay:1s""#,
        ] {
            assert!(html.contains(part), "{part} missing from {html}");
        }
    }
}
