//! Bad input gets a 4xx with a stable code and changes nothing.

use serde_json::{Value, json};
use takosumi_tests::{GitRepo, Options, Stack, Steps};

/// method, path, token, body, expected status, expected code
type Case<'a> = (
    &'a str,
    String,
    Option<&'a str>,
    Option<String>,
    u16,
    &'a str,
);

async fn counts(stack: &Stack) -> anyhow::Result<Vec<i64>> {
    let mut out = Vec::new();
    for table in [
        "workspaces",
        "capsules",
        "runs",
        "outbox",
        "run_events",
        "activity",
        "rule_sets",
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&stack.ctx.pool)
            .await?;
        out.push(n);
    }
    Ok(out)
}

/// Unknown ids, malformed JSON, missing and wrong tokens, invalid fields: each is a 4xx
/// with a code, and no row is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_a_code_and_writes_nothing() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let repo = GitRepo::with_example("network")?;
    let admin = stack.admin_token.clone();
    let (s, ws) = stack
        .request(
            "POST",
            "/api/v1/workspaces",
            Some(&admin),
            Some(r#"{"name":"prod"}"#),
        )
        .await?;
    assert_eq!(s, 201, "{ws}");
    let ws = ws["id"].as_str().unwrap().to_owned();
    let before = counts(&stack).await?;
    let unknown_cap = takosumi_core::CapsuleId::new();
    let unknown_run = takosumi_core::RunId::new();
    let good_capsule = json!({"name":"n","source":{"repo":repo.url(),"branch":"main"},"dir":"infra/network","tool":"terraform","vars":{"region":"eu"}});
    let with = |patch: Value| {
        let mut c = good_capsule.clone();
        for (k, v) in patch.as_object().unwrap() {
            c[k] = v.clone();
        }
        c.to_string()
    };
    let caps = format!("/api/v1/workspaces/{ws}/capsules");
    let cases: Vec<Case> = vec![
        (
            "POST",
            format!("/api/v1/capsules/{unknown_cap}/plan"),
            Some(&admin),
            None,
            404,
            "not_found",
        ),
        (
            "GET",
            format!("/api/v1/runs/{unknown_run}"),
            Some(&admin),
            None,
            404,
            "not_found",
        ),
        (
            "POST",
            format!("/api/v1/runs/{unknown_run}/apply"),
            Some(&admin),
            None,
            404,
            "not_found",
        ),
        (
            "POST",
            "/api/v1/capsules/not-an-id/plan".into(),
            Some(&admin),
            None,
            400,
            "invalid_id",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some("{\"name\": ".into()),
            400,
            "invalid_json",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some(String::new()),
            400,
            "invalid_json",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some(with(json!({"extra": 1}))),
            400,
            "invalid_json",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some(with(json!({"dir": "../etc"}))),
            400,
            "invalid_dir",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some(with(json!({"dir": "/abs"}))),
            400,
            "invalid_dir",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some(with(json!({"tool": "pulumi"}))),
            422,
            "invalid_tool",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some(with(json!({"name": ""}))),
            422,
            "invalid_name",
        ),
        (
            "POST",
            caps.clone(),
            Some(&admin),
            Some(with(json!({"vars": {"bad name": "x"}}))),
            422,
            "invalid_vars",
        ),
        (
            // a NUL in a string anywhere (here inside a list variable) cannot be stored
            // (found by the fuzz suite: it was a 500)
            "POST",
            caps.clone(),
            Some(&admin),
            Some(with(json!({"vars": {"zones": ["a", "b\u{0}"]}}))),
            400,
            "invalid_json",
        ),
        (
            "PUT",
            format!("/api/v1/workspaces/{ws}/rules"),
            Some(&admin),
            Some(json!({"planGate": "package takosumi\u{0}"}).to_string()),
            400,
            "invalid_json",
        ),
        (
            "POST",
            caps.clone(),
            None,
            Some(good_capsule.to_string()),
            401,
            "unauthorized",
        ),
        (
            "POST",
            caps.clone(),
            Some("tks_wrong"),
            Some(good_capsule.to_string()),
            401,
            "unauthorized",
        ),
        (
            "POST",
            "/api/v1/workspaces".into(),
            None,
            Some(r#"{"name":"x"}"#.into()),
            401,
            "unauthorized",
        ),
        (
            "POST",
            "/api/v1/workspaces".into(),
            Some(&admin),
            Some(r#"{"name":"prod"}"#.into()),
            409,
            "workspace_exists",
        ),
        (
            "POST",
            "/api/v1/workspaces".into(),
            Some(&admin),
            Some(r#"{"nme":"x"}"#.into()),
            400,
            "invalid_json",
        ),
        (
            "GET",
            "/api/v1/nothing-here".into(),
            Some(&admin),
            None,
            404,
            "no_such_endpoint",
        ),
        (
            // an id that spells a sub-resource meets a route of other methods
            "PUT",
            "/api/v1/capsules/rules".into(),
            Some(&admin),
            Some("{}".into()),
            405,
            "method_not_allowed",
        ),
    ];
    for (method, path, token, body, want_status, want_code) in cases {
        let (status, body) = stack.request(method, &path, token, body.as_deref()).await?;
        assert_eq!(status, want_status, "{method} {path}: {body}");
        assert_eq!(body["code"], json!(want_code), "{method} {path}: {body}");
        assert!(
            body["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{method} {path}: {body}"
        );
    }
    assert_eq!(
        counts(&stack).await?,
        before,
        "a refused request wrote rows"
    );
    // The text `\u0000` (a backslash, then `u0000`) is no NUL: accepted as it is.
    let (s, body) = stack
        .request(
            "POST",
            &caps,
            Some(&admin),
            Some(&with(json!({"vars": {"path": "C:\\u0000"}}))),
        )
        .await?;
    assert_eq!(s, 201, "{body}");
    let stored: Option<String> =
        sqlx::query_scalar("SELECT vars->>'path' FROM capsules WHERE name = 'n'")
            .fetch_one(&stack.ctx.pool)
            .await?;
    assert_eq!(stored.as_deref(), Some("C:\\u0000"));
    stack.stop().await
}
