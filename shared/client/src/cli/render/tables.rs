//! The human forms of the API's records other than a single Run: blocks for one record
//! (a Capsule, a Workspace, a pool) and one line per row for lists (Runs, activity,
//! Capsules, tokens, dead letters), the cost table and the plan diff.

use std::fmt::Write as _;

use serde_json::Value;
use takosumi_client::{
    ActivityEntry, ApprovalCount, AttributeDiff, Capsule, Cost, DeadLetters, GroupResults,
    PlanView, Pool, RequeueResult, RunGroup, RunPage, TokenView, Workspace,
};

use super::{Block, record_lines, stamp};

pub(crate) fn format_workspace(w: &Workspace) -> String {
    let mut b = Block::default();
    b.line("workspace", w.id).line("name", &w.name);
    b.0
}

pub(crate) fn format_workspaces(list: &[Workspace]) -> String {
    list.iter().fold(String::new(), |mut out, w| {
        let _ = writeln!(out, "{}  {}", w.id, w.name);
        out
    })
}

pub(crate) fn format_capsule(c: &Capsule) -> String {
    let mut b = Block::default();
    b.line("capsule", c.id)
        .line("workspace", c.workspace_id)
        .line("name", &c.name);
    b.line(
        "source",
        format!("{} (branch {})", c.source.repo, c.source.branch),
    );
    b.line("dir", &c.dir).line("tool", &c.tool);
    if !c.status.is_empty() {
        b.line("status", &c.status);
    }
    b.line("state generation", c.state_generation);
    match c.current_state_version_id {
        Some(sv) => b.line("state version", sv),
        None => b.line("state version", "(none)"),
    };
    if c.stale || c.drifted {
        let both = [(c.stale, "stale"), (c.drifted, "drifted")]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, what)| *what)
            .collect::<Vec<_>>()
            .join(", ");
        b.line("detected", both);
    }
    b.json_map("vars", &c.vars);
    if !c.withheld_vars.is_empty() {
        b.line(
            "withheld vars",
            format!(
                "{} (sensitive in the configuration, not planned yet, or your role may not edit the Capsule)",
                c.withheld_vars.join(", ")
            ),
        );
    }
    if let Some(pool) = &c.pool {
        b.line("worker pool", pool);
    }
    b.0
}

pub(crate) fn format_capsules(list: &[Capsule]) -> String {
    list.iter().fold(String::new(), |mut out, c| {
        let _ = writeln!(
            out,
            "{}  {}  {}  {}  {}#{}:{}",
            c.id, c.name, c.status, c.tool, c.source.repo, c.source.branch, c.dir
        );
        out
    })
}

/// One line per token: id, role, name, scope and whether it still works (never a value).
pub(crate) fn format_tokens(all: &[TokenView]) -> String {
    let mut out = String::new();
    for t in all {
        let state = match (&t.revoked_at, &t.expires_at) {
            (Some(at), _) => format!("revoked {}", at.to_rfc3339()),
            (None, Some(at)) => format!("expires {}", at.to_rfc3339()),
            (None, None) => "no expiry".into(),
        };
        let scope = t
            .workspace_id
            .map(|w| w.to_string())
            .unwrap_or_else(|| "instance".into());
        let _ = writeln!(
            out,
            "{}  {:<9} {:<24} {scope}  {state}",
            t.id,
            t.role.as_str(),
            t.name
        );
    }
    out
}

/// The human form of a pool: its names and key ids (it holds no secret).
pub(crate) fn format_pool(p: &Pool) -> String {
    let mut b = Block::default();
    b.line("pool", &p.id)
        .line("name", &p.name)
        .line("workspace", p.workspace_id);
    match &p.delivery_key_id {
        Some(k) => b.line("delivery key", k),
        None => b.line("delivery key", "(none: applies from this pool fail)"),
    };
    if let Some(prev) = &p.previous_key_id {
        match p.previous_key_until {
            Some(until) => b.line(
                "previous key",
                format!("{prev} (accepted until {})", until.to_rfc3339()),
            ),
            None => b.line("previous key", prev),
        };
    }
    if !p.queues.is_empty() {
        b.line("queues", p.queues.join(", "));
    }
    b.0
}

/// One line per Run of a page.
pub(crate) fn format_runs(page: &RunPage) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<36}  {:<11} {:<15} {:<36}  CREATED",
        "RUN", "KIND", "STATUS", "CAPSULE"
    );
    for r in &page.runs {
        let created = stamp(r.created_at, chrono::SecondsFormat::Secs);
        let _ = writeln!(
            out,
            "{:<36}  {:<11} {:<15} {:<36}  {created}",
            r.id.to_string(),
            r.kind.as_str(),
            r.status.as_str(),
            r.capsule_id.to_string()
        );
    }
    out
}

/// One line per activity entry.
pub(crate) fn format_activity(entries: &[ActivityEntry]) -> String {
    record_lines(entries, |e| {
        let at = stamp(e.at, chrono::SecondsFormat::Millis);
        (
            format!("{at}  {:<22} {}  {}", e.kind, e.subject, e.actor),
            &e.data,
        )
    })
}

fn money(x: f64) -> String {
    format!("{x:.2}")
}

fn signed(x: f64) -> String {
    if x >= 0.0 {
        format!("+{x:.2}")
    } else {
        format!("{x:.2}")
    }
}

/// The human form of a cost estimate: a row per priced resource, the total, then what
/// could not be priced.
pub(crate) fn format_cost(c: &Cost) -> String {
    let e = &c.estimate;
    let mut out = String::new();
    let _ = writeln!(out, "plan run:         {}", c.plan_run_id);
    let _ = writeln!(
        out,
        "amounts:          {} per {} (catalogue of {})",
        e.currency, e.period, e.catalogue_as_of
    );
    let width = e
        .resources
        .iter()
        .map(|r| r.address.len())
        .chain(e.unpriced.iter().map(|u| u.address.len()))
        .chain(std::iter::once(8))
        .max()
        .unwrap_or(8);
    let mut row = |cells: [&str; 5]| {
        let [address, actions, current, proposed, delta] = cells;
        let _ = writeln!(
            out,
            "{address:<width$}  {actions:<14} {current:>10} {proposed:>10} {delta:>10}"
        );
    };
    row(["RESOURCE", "ACTIONS", "CURRENT", "PROPOSED", "DELTA"]);
    for r in &e.resources {
        row([
            &r.address,
            &r.actions.join(","),
            &money(r.amounts.current),
            &money(r.amounts.proposed),
            &signed(r.amounts.delta),
        ]);
    }
    row([
        "total",
        "",
        &money(e.total.current),
        &money(e.total.proposed),
        &signed(e.total.delta),
    ]);
    if !e.unpriced.is_empty() {
        let _ = writeln!(out, "unpriced (left out of the total):");
        for u in &e.unpriced {
            let _ = writeln!(
                out,
                "  {} ({}): {}",
                u.address,
                u.actions.join(","),
                u.reason
            );
        }
    }
    if e.truncated {
        let _ = writeln!(
            out,
            "note: the plan has more resources than were summarized"
        );
    }
    out
}

/// `takosumi diff`: one block per resource, `name: before -> after` per attribute.
pub(crate) fn format_diff(view: &PlanView) -> String {
    let mut out = String::new();
    let Some(diff) = &view.diff else {
        return format!("{}: no plan recorded\n", view.plan_run_id);
    };
    let shown = |a: &AttributeDiff, v: &Option<Value>| -> String {
        if a.sensitive {
            "(sensitive)".into()
        } else if let Some(v) = v {
            v.to_string()
        } else {
            "null".into()
        }
    };
    for r in &diff.resources {
        let _ = writeln!(out, "{} {}", r.action, r.address);
        for a in &r.attributes {
            let after = if a.unknown && !a.sensitive {
                "(known after apply)".to_owned()
            } else {
                shown(a, &a.after)
            };
            let forces = if a.forces_replacement {
                "  # forces replacement"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "    {}: {} -> {after}{forces}",
                a.name,
                shown(a, &a.before)
            );
        }
    }
    for a in &diff.outputs {
        let _ = writeln!(
            out,
            "output {}: {} -> {}",
            a.name,
            shown(a, &a.before),
            shown(a, &a.after)
        );
    }
    if diff.resources.is_empty() && diff.outputs.is_empty() {
        out.push_str("no changes\n");
    }
    out
}

/// The human form: a line per queue, then its messages indented.
pub(crate) fn format_dead_letters(dl: &DeadLetters) -> String {
    let mut out = format!("dead letters: {}\n", dl.total);
    for q in &dl.queues {
        out.push_str(&format!("{}  depth {}", q.dead_letter_queue, q.depth));
        match q.uncollected {
            Some(0) => {}
            Some(n) => out.push_str(&format!("  (+{n} in the broker, not collected yet)")),
            None => out.push_str("  (broker unavailable: uncollected unknown)"),
        }
        out.push('\n');
        for m in &q.messages {
            let why = match (&m.error, &m.broker_reason) {
                (Some(e), _) => e.clone(),
                (None, Some(r)) => format!("broker: {r}"),
                (None, None) => "no reason recorded".to_owned(),
            };
            let body: String = m.body.chars().take(200).collect();
            out.push_str(&format!("  #{}  {body:?}  ({why})\n", m.id));
        }
    }
    out
}

/// What a requeue moved, what it left in place, and whether to run it again.
pub(crate) fn format_requeued(r: &RequeueResult) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "requeued {}", r.requeued.len());
    for d in &r.requeued {
        let _ = writeln!(out, "  {}  {}  {}", d.id, d.queue, d.run_id);
    }
    if !r.skipped.is_empty() {
        let _ = writeln!(
            out,
            "left in place {} (not Run messages: purge them)",
            r.skipped.len()
        );
        for d in &r.skipped {
            let _ = writeln!(out, "  {}  {}", d.id, d.queue);
        }
    }
    if r.remaining > 0 {
        let _ = writeln!(out, "{} more selected: run it again", r.remaining);
    }
    out
}

/// A RunGroup's Runs, one line each.
pub(crate) fn format_group(g: &RunGroup) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "run group {} ({})", g.id, g.kind);
    for r in &g.runs {
        let _ = writeln!(
            out,
            "  {}  {:<12} {:<16} {}",
            r.id,
            r.kind.as_str(),
            r.status.as_str(),
            r.capsule_id
        );
    }
    out
}

/// What a RunGroup's approve or apply did to each Run (an error per line).
pub(crate) fn format_group_results(done: &GroupResults) -> String {
    let mut out = String::new();
    for r in &done.results {
        let subject = r
            .subject()
            .map_or_else(|| "?".to_owned(), |id| id.to_string());
        let _ = match (&r.error, r.apply_run_id, r.approvals) {
            (Some(e), _, _) => writeln!(out, "  {subject}  error: {} ({})", e.message, e.code),
            (None, Some(apply), _) => writeln!(out, "  {subject}  apply proposed: {apply}"),
            (None, None, Some(ApprovalCount { given, required })) => writeln!(
                out,
                "  {subject}  approved ({given} of {required}){}",
                r.status
                    .map(|s| format!(", {}", s.as_str()))
                    .unwrap_or_default()
            ),
            (None, None, None) => writeln!(out, "  {subject}  done"),
        };
    }
    out
}
