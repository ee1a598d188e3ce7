//! The human forms and error lines, checked against API-shaped JSON.

use serde_json::{Value, json};
use takosumi_client::{
    ActivityEntry, Capsule, CapsuleId, Changes, Client, ClientError, Cost, GroupResults, Pool, Run,
    RunEvent, RunGroupId, RunId, RunPage, RunStatus, StateVersionId, TOKEN_ENV, WorkspaceId,
};

use super::*;

fn run_from(extra: Value) -> Run {
    let mut body = json!({
        "id": RunId::new(), "kind": "apply", "status": "applied",
        "workspaceId": WorkspaceId::new(), "capsuleId": CapsuleId::new(),
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    serde_json::from_value(body).unwrap()
}

#[test]
fn run_block_shows_what_matters() {
    let plan_run = RunId::new();
    let sv = StateVersionId::new();
    let run = run_from(json!({
        "planRunId": plan_run,
        "planDigest": "3f2a9c1b0d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5061728394a5b6c7d8e",
        "sourceSnapshot": {"commit": "0123456789abcdef0123456789abcdef01234567", "treeDigest": "x"},
        "changes": {"add": 1, "change": 2, "destroy": 3},
        "stateGeneration": 4,
        "stateVersionId": sv,
        "outputs": {"vpc": "vpc-eu", "zones": ["a", "b"], "count": 2}
    }));
    let text = format_run(&run);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.contains(&"vpc = \"vpc-eu\""), "{text}");
    assert!(lines.contains(&"zones = [\"a\",\"b\"]"), "{text}");
    assert!(lines.contains(&"count = 2"), "{text}");
    assert!(
        text.contains(&format!("run:              {}", run.id)),
        "{text}"
    );
    assert!(text.contains("kind:             apply"), "{text}");
    assert!(text.contains("status:           applied"), "{text}");
    assert!(
        text.contains(&format!("capsule:          {}", run.capsule_id)),
        "{text}"
    );
    assert!(
        text.contains(&format!("plan run:         {plan_run}")),
        "{text}"
    );
    assert!(text.contains("changes:          +1 ~2 -3"), "{text}");
    assert!(text.contains("plan digest:      3f2a9c1b0d4e\n"), "{text}");
    assert!(text.contains("source commit:    0123456789ab\n"), "{text}");
    assert!(text.contains("state generation: 4"), "{text}");
    assert!(text.contains(&format!("state version:    {sv}")), "{text}");
    assert!(!text.contains("error"), "{text}");
}

#[test]
fn run_block_shows_errors_and_holds() {
    let failed = run_from(
        json!({"status": "failed", "error": {"code": "stale_plan", "message": "Plan again."}}),
    );
    let text = format_run(&failed);
    assert!(
        text.contains("error:            Plan again. (stale_plan)"),
        "{text}"
    );

    let held = run_from(
        json!({"kind": "plan", "status": "held", "hold": {"reason": "max_destroy", "details": {"destroy": 5}}}),
    );
    let text = format_run(&held);
    assert!(
        text.contains("held:             max_destroy {\"destroy\":5}"),
        "{text}"
    );

    let minimal = run_from(json!({"kind": "drift_check", "status": "queued", "outputs": null}));
    let text = format_run(&minimal);
    assert_eq!(text.lines().count(), 4, "{text}");
    assert!(text.contains("kind:             drift_check"));
}

#[test]
fn run_block_shows_cancel_and_resolution_from_their_fields() {
    let canceled = run_from(json!({
        "status": "planning", "cancelRequestedAt": "2026-12-07T10:00:00.5Z",
        "canceledBy": "user:tok_ab"
    }));
    let text = format_run(&canceled);
    assert!(
        text.contains("cancel requested: 2026-12-07T10:00:00Z"),
        "{text}"
    );
    assert!(text.contains("canceled by:      user:tok_ab"), "{text}");

    let resolved = run_from(json!({
        "status": "unknown_outcome",
        "resolution": {"action": "restore_held_state", "note": "checked the bucket",
                       "by": "user:tok_cd", "at": "2026-12-07T11:00:00Z"}
    }));
    let text = format_run(&resolved);
    assert!(
        text.contains(
            "resolved:         restore_held_state by user:tok_cd at 2026-12-07T11:00:00Z: checked the bucket"
        ),
        "{text}"
    );
}

#[test]
fn group_results_say_what_happened_to_each_run() {
    let (a, b, c) = (RunId::new(), RunId::new(), RunId::new());
    let done: GroupResults = serde_json::from_value(json!({
        "id": RunGroupId::new(),
        "results": [
            {"runId": a, "status": "queued", "approvals": {"given": 1, "required": 1}},
            {"planRunId": b, "applyRunId": c},
            {"planRunId": c, "error": {"code": "apply_exists", "message": "It has one."}}
        ]
    }))
    .unwrap();
    let text = format_group_results(&done);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            format!("  {a}  approved (1 of 1), queued"),
            format!("  {b}  apply proposed: {c}"),
            format!("  {c}  error: It has one. (apply_exists)"),
        ],
        "{text}"
    );
}

#[test]
fn capsule_block_names_withheld_variables_and_the_pool() {
    let c: Capsule = serde_json::from_value(json!({
        "id": CapsuleId::new(), "workspaceId": WorkspaceId::new(), "name": "net",
        "status": "drifted", "drifted": true, "drift": true, "pool": "eu-pool",
        "vars": {"region": "eu"}, "varNames": ["db_password", "region"],
        "withheldVars": ["db_password"]
    }))
    .unwrap();
    let text = format_capsule(&c);
    assert!(
        text.contains("status:") && text.contains("drifted"),
        "{text}"
    );
    assert!(
        text.contains("withheld vars:") && text.contains("db_password (sensitive"),
        "{text}"
    );
    assert!(
        text.contains("worker pool:") && text.contains("eu-pool"),
        "{text}"
    );
}

#[test]
fn waited_runs_decide_the_exit_code() {
    for s in [
        RunStatus::Failed,
        RunStatus::Canceled,
        RunStatus::UnknownOutcome,
    ] {
        assert!(ended_badly(s));
    }
    for s in [RunStatus::Planned, RunStatus::Applied, RunStatus::Held] {
        assert!(!ended_badly(s));
    }
    let _ = Changes::default();
}

#[test]
fn errors_print_message_code_and_hint() {
    let err = ClientError::Api {
        status: 401,
        code: "unauthorized".into(),
        message: "invalid token".into(),
    };
    let (lines, code) = render_error(&err);
    assert_eq!(lines[0], "error: invalid token (unauthorized)");
    assert!(lines[1].contains(TOKEN_ENV));
    assert_eq!(code, 1);

    let err = ClientError::Api {
        status: 404,
        code: "not_found".into(),
        message: "no such run".into(),
    };
    let (lines, code) = render_error(&err);
    assert_eq!(
        (lines, code),
        (vec!["error: no such run (not_found)".to_owned()], 1)
    );

    let (lines, code) = render_error(&ClientError::Config("no API token".into()));
    assert_eq!((lines, code), (vec!["error: no API token".to_owned()], 2));

    let run = RunId::new();
    let (lines, code) = render_error(&ClientError::Timeout {
        run,
        last_status: RunStatus::Applying,
    });
    assert!(lines[0].contains("still applying"));
    assert!(lines[1].contains(&format!("takosumi wait {run}")));
    assert_eq!(code, 1);
}

#[tokio::test]
async fn refused_connections_point_at_the_quickstart() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let client = Client::new(&format!("http://127.0.0.1:{port}"), "t").unwrap();
    let err = client.get_run(RunId::new()).await.unwrap_err();
    let (lines, code) = render_error(&err);
    assert!(lines[0].starts_with(&format!(
        "error: the Takosumi API at http://127.0.0.1:{port} could not be reached: "
    )));
    assert!(lines[0].to_lowercase().contains("refused"), "{lines:?}");
    assert_eq!(lines[1], format!("hint: {START_HINT}"));
    assert_eq!(code, 1);
}

#[test]
fn events_print_one_line_each() {
    let events: Vec<RunEvent> = serde_json::from_value(json!([
        {"id": 1, "kind": "queued", "actor": "user:tok_1", "data": {}, "at": "2026-11-30T10:00:00Z"},
        {"id": 2, "kind": "held", "actor": "handler:gate", "data": {"reason": "max_destroy"}, "at": "2026-11-30T10:00:01.5Z"}
    ]))
    .unwrap();
    let text = format_events(&events);
    assert_eq!(
        text,
        "   1  2026-11-30T10:00:00.000Z  queued  user:tok_1\n   2  2026-11-30T10:00:01.500Z  held  handler:gate  {\"reason\":\"max_destroy\"}\n"
    );
}
#[test]
fn cost_table_shows_amounts_totals_and_unpriced() {
    let run = RunId::new();
    let c: Cost = serde_json::from_value(json!({
        "runId": run, "planRunId": run, "currency": "USD", "period": "month",
        "catalogueAsOf": "2026-11", "catalogueNote": "n",
        "resources": [{"address": "aws_instance.web", "type": "aws_instance", "actions": ["update"],
                       "current": 7.59, "proposed": 60.74, "delta": 53.15},
                      {"address": "aws_instance.old", "type": "aws_instance", "actions": ["delete"],
                       "current": 15.18, "proposed": 0.0, "delta": -15.18}],
        "unpriced": [{"address": "aws_s3_bucket.logs", "type": "aws_s3_bucket", "actions": ["create"],
                      "reason": "the price catalogue has no price for aws_s3_bucket"}],
        "total": {"current": 22.77, "proposed": 60.74, "delta": 37.97},
        "complete": false, "truncated": false
    }))
    .unwrap();
    let text = format_cost(&c);
    assert!(text.contains("USD per month"), "{text}");
    let web = text
        .lines()
        .find(|l| l.starts_with("aws_instance.web"))
        .unwrap();
    assert!(
        web.contains("7.59") && web.contains("60.74") && web.contains("+53.15"),
        "{web}"
    );
    let old = text
        .lines()
        .find(|l| l.starts_with("aws_instance.old"))
        .unwrap();
    assert!(old.contains("-15.18"), "{old}");
    let total = text.lines().find(|l| l.starts_with("total")).unwrap();
    assert!(
        total.contains("22.77") && total.contains("+37.97"),
        "{total}"
    );
    assert!(text.contains("aws_s3_bucket.logs (create): the price catalogue has no price"));
}

#[test]
fn runs_and_activity_print_one_line_each() {
    let page: RunPage = serde_json::from_value(json!({
        "runs": [{"id": RunId::new(), "kind": "drift_check", "status": "unknown_outcome",
                  "workspaceId": WorkspaceId::new(), "capsuleId": CapsuleId::new(),
                  "createdAt": "2026-11-30T10:00:00Z"}],
        "nextCursor": null, "unknownOutcomeCount": 1
    }))
    .unwrap();
    let text = format_runs(&page);
    assert_eq!(text.lines().count(), 2);
    assert!(text.contains("drift_check") && text.contains("unknown_outcome"));
    assert!(text.contains("2026-11-30T10:00:00Z"));

    let entries: Vec<ActivityEntry> = serde_json::from_value(json!([
        {"id": 2, "kind": "run_started", "subject": "run_x", "actor": "user:tok_1",
         "data": {"kind": "plan"}, "at": "2026-11-30T10:00:00Z"}
    ]))
    .unwrap();
    assert_eq!(
        format_activity(&entries),
        "2026-11-30T10:00:00.000Z  run_started            run_x  user:tok_1  {\"kind\":\"plan\"}\n"
    );
}

#[test]
fn event_lines_carry_kind_actor_and_data() {
    let e: RunEvent = serde_json::from_value(json!(
        {"id": 3, "kind": "tool_started", "actor": "handler:plan-1", "data": {"command": "plan"},
         "at": "2026-11-30T10:00:01.5Z"}
    ))
    .unwrap();
    assert_eq!(
        event_line(&e),
        "10:00:01.500  tool_started           handler:plan-1  {\"command\":\"plan\"}"
    );
}
#[test]
fn pool_block_names_keys_but_no_token() {
    let p: Pool = serde_json::from_value(json!({
        "id": "pool_1", "name": "edge", "workspaceId": WorkspaceId::new(),
        "deliveryKeyId": "k2", "previousKeyId": "k1",
        "previousKeyUntil": "2026-12-01T10:00:00Z",
        "queues": ["run.plan.edge", "run.apply.edge"]
    }))
    .unwrap();
    let text = format_pool(&p);
    assert!(text.contains("delivery key:     k2\n"), "{text}");
    assert!(
        text.contains("previous key:     k1 (accepted until 2026-12-01T10:00:00+00:00)"),
        "{text}"
    );
    assert!(
        text.contains("queues:           run.plan.edge, run.apply.edge"),
        "{text}"
    );
}
