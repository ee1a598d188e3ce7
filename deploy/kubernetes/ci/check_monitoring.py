#!/usr/bin/env python3
"""Checks deploy/prometheus/alerts.yaml and deploy/grafana/takosumi.json.

    check_monitoring.py DEPLOY_DIR

- alerts.yaml is a Prometheus rule file: groups of rules, each an alert (or record) with an
  `expr` that parses as PromQL (`promql-parser`, PyPI), `for` a duration, a severity label and a
  summary; every alert in REQUIRED_ALERTS is there;
- the dashboard is Grafana JSON with a title, uid and panels whose queries parse as PromQL
  (Grafana's `$__rate_interval` and `$namespace` substituted first);
- both use only the metric names Takosumi exports (below), histograms through `_bucket`,
  `_sum` or `_count`.
Exits 1 after listing every problem."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import promql_parser
import yaml

COUNTERS = {"takosumi_http_requests_total", "takosumi_reaper_actions_total"}
GAUGES = {
    "takosumi_runs",
    "takosumi_queued_oldest_age_seconds",
    "takosumi_outbox_backlog",
    "takosumi_outbox_oldest_age_seconds",
    "takosumi_dead_letters",
    "takosumi_unknown_outcome_runs",
}
HISTOGRAMS = {
    "takosumi_http_request_duration_seconds",
    "takosumi_step_duration_seconds",
    "takosumi_queue_lag_seconds",
}
KNOWN = COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
REQUIRED_ALERTS = {
    "TakosumiOutboxStalled": "takosumi_outbox_oldest_age_seconds",
    "TakosumiDeadLetters": "takosumi_dead_letters",
    "TakosumiUnknownOutcomeRuns": "takosumi_unknown_outcome_runs",
    "TakosumiApiErrors": "takosumi_http_requests_total",
    "TakosumiQueueLagHigh": "takosumi_queue_lag_seconds_bucket",
}
RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}

problems: list[str] = []


def check_expr(where: str, expr: str) -> set[str]:
    try:
        promql_parser.parse(expr)
    except Exception as e:  # the parser raises a plain ValueError-like error
        problems.append(f"{where}: PromQL does not parse: {e}")
    names = set(re.findall(r"\btakosumi_[a-z_]+\b", expr))
    for n in sorted(names - KNOWN):
        problems.append(f"{where}: {n} is not a metric Takosumi exports")
    if not names:
        problems.append(f"{where}: uses no Takosumi metric")
    return names


def main() -> int:
    deploy = pathlib.Path(sys.argv[1])
    rules_file = deploy / "prometheus/alerts.yaml"
    doc = yaml.safe_load(rules_file.read_text())
    alerts: dict[str, set[str]] = {}
    if not isinstance(doc, dict) or set(doc) != {"groups"} or not isinstance(doc["groups"], list):
        problems.append(f"{rules_file}: must be a mapping with only `groups:` (a list)")
        doc = {"groups": []}
    for g in doc["groups"]:
        gname = g.get("name")
        if not gname:
            problems.append(f"{rules_file}: a group has no name")
        for i, r in enumerate(g.get("rules") or []):
            where = f"alerts.yaml {gname}[{i}] {r.get('alert') or r.get('record')}"
            for k in set(r) - RULE_KEYS:
                problems.append(f"{where}: unknown key {k!r}")
            if bool(r.get("alert")) == bool(r.get("record")):
                problems.append(f"{where}: needs exactly one of alert, record")
            if not isinstance(r.get("expr"), str):
                problems.append(f"{where}: expr is missing")
                continue
            names = check_expr(where, r["expr"])
            if r.get("alert"):
                alerts[r["alert"]] = names
                if "for" in r and not re.fullmatch(r"(\d+(ms|s|m|h|d|w|y))+", str(r["for"])):
                    problems.append(f"{where}: `for` {r['for']!r} is not a duration")
                if (r.get("labels") or {}).get("severity") not in ("critical", "warning", "info"):
                    problems.append(f"{where}: labels.severity must be critical, warning or info")
                if not (r.get("annotations") or {}).get("summary"):
                    problems.append(f"{where}: annotations.summary is missing")
    for name, metric in REQUIRED_ALERTS.items():
        if name not in alerts:
            problems.append(f"alerts.yaml: alert {name} is missing")
        elif metric not in alerts[name]:
            problems.append(f"alerts.yaml: alert {name} does not use {metric}")

    dash_file = deploy / "grafana/takosumi.json"
    try:
        dash = json.loads(dash_file.read_text())
    except json.JSONDecodeError as e:
        problems.append(f"{dash_file}: not JSON: {e}")
        dash = {}
    for k in ("title", "uid", "panels", "schemaVersion"):
        if k not in dash:
            problems.append(f"takosumi.json: {k} is missing")
    used: set[str] = set()
    queries = 0
    for p in dash.get("panels") or []:
        for t in p.get("targets") or []:
            expr = t.get("expr", "")
            concrete = expr.replace("$__rate_interval", "5m").replace("$namespace", ".*")
            used |= check_expr(f"takosumi.json panel {p.get('title')!r} {t.get('refId')}", concrete)
            queries += 1
    for h in sorted(HISTOGRAMS):
        if not any(u.startswith(h) for u in used):
            problems.append(f"takosumi.json: no panel shows {h}")
    for n in sorted((COUNTERS | GAUGES) - used):
        problems.append(f"takosumi.json: no panel shows {n}")

    for p in problems:
        print(f"check-monitoring: {p}", file=sys.stderr)
    print(f"check-monitoring: {len(alerts)} alerts, {queries} dashboard queries: "
          f"{len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
