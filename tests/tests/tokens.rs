//! End-to-end: tokens managed over the API (real API and Postgres). An instance admin
//! makes a Workspace-limited token whose value is answered once and stored only as a hash;
//! it works in its Workspace and sees another as unknown; the list never shows a value;
//! revoking it refuses its very next request and ends a dashboard session made from it;
//! an expired token is refused; each change is in the activity; bad input changes nothing;
//! a Workspace admin or an operator may not manage tokens; the CLI does the same.

use serde_json::{Value, json};
use takosumi_client::{Client, ErrorCode, NewToken};
use takosumi_tests::probe;
use takosumi_tests::{Options, Stack, Steps};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admins_make_list_and_revoke_tokens() -> anyhow::Result<()> {
    let stack = Stack::start_with(Options {
        steps: Steps::API_ONLY,
        ..Options::default()
    })
    .await?;
    let ws = stack.client.create_workspace("ws-tokens").await?;
    let other = stack.client.create_workspace("ws-tokens-other").await?;

    let made = stack
        .client
        .create_token(&NewToken {
            name: "ci".into(),
            role: "viewer".into(),
            workspace_id: Some(ws.id),
            expires_in_days: Some(30),
        })
        .await?;
    assert!(made.token.starts_with("tks_"), "{made:?}");
    assert!(
        !format!("{made:?}").contains(&made.token),
        "Debug shows the value"
    );
    assert_eq!(made.info.workspace_id, Some(ws.id));
    assert!(made.info.expires_at.is_some());
    let limited = Client::new(&stack.api_url, &made.token)?;
    assert!(limited.list_runs(ws.id, &Default::default()).await.is_ok());
    let err = limited
        .list_runs(other.id, &Default::default())
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");

    // The list never carries a value, and nothing stores one.
    let (s, list) = stack.call("GET", "/api/v1/tokens", Value::Null).await?;
    assert_eq!(s, 200);
    assert!(!list.to_string().contains(&made.token));
    assert!(
        list["tokens"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["id"] == json!(made.info.id))),
        "{list}"
    );
    let dump = probe::dump_tables(&stack.ctx.pool).await?;
    assert!(!dump.iter().any(|(_, row)| row.contains(&made.token)));

    // A dashboard session made from it ends when it is revoked.
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let cookie = stack.dashboard_session(&made.token).await?;
    let page = |cookie: String| {
        let http = http.clone();
        let url = format!("{}/workspaces/{}", stack.api_url, ws.id);
        async move { http.get(url).header("cookie", cookie).send().await }
    };
    assert_eq!(page(cookie.clone()).await?.status(), 200);

    let revoked = stack.client.revoke_token(made.info.id).await?;
    assert!(revoked.revoked_at.is_some());
    assert!(
        revoked
            .revoked_by
            .as_deref()
            .is_some_and(|b| b.starts_with("user:"))
    );
    let err = limited
        .list_runs(ws.id, &Default::default())
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(401), "revoked at once: {err}");
    assert_eq!(
        page(cookie).await?.status(),
        303,
        "the session ended with the token"
    );
    let again = stack.client.revoke_token(made.info.id).await.unwrap_err();
    assert_eq!(again.known_code(), Some(ErrorCode::AlreadyRevoked));

    // Both changes are in the Workspace's activity.
    let activity = stack.client.activity(ws.id, None, None, None).await?;
    let kinds: Vec<&str> = activity.activity.iter().map(|a| a.kind.as_str()).collect();
    assert!(
        kinds.contains(&"token_created") && kinds.contains(&"token_revoked"),
        "{kinds:?}"
    );

    // A token revoked by another API process: this one cached its grant a moment ago and
    // drops it when the revocation's notification arrives, well before the cache's TTL.
    let elsewhere = stack
        .client
        .create_token(&NewToken {
            name: "elsewhere".into(),
            role: "viewer".into(),
            workspace_id: None,
            expires_in_days: None,
        })
        .await?;
    let by_elsewhere = Client::new(&stack.api_url, &elsewhere.token)?;
    by_elsewhere.list_workspaces().await?;
    let mut tx = stack.ctx.pool.begin().await?;
    takosumi_store::tokens::revoke(&mut tx, elsewhere.info.id, "user:another-api").await?;
    tx.commit().await?;
    let revoked_at = std::time::Instant::now();
    let refused_after = loop {
        match by_elsewhere.list_workspaces().await {
            Err(e) if e.status() == Some(401) => break revoked_at.elapsed(),
            Err(e) => return Err(e.into()),
            Ok(_) => {}
        }
        assert!(
            revoked_at.elapsed() < std::time::Duration::from_secs(3),
            "served for 3 s after another process revoked it (the cache keeps a grant 5 s)"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    println!("refused {refused_after:?} after another process revoked it");

    // An expired token is refused.
    let short = stack
        .client
        .create_token(&NewToken {
            name: "short".into(),
            role: "operator".into(),
            workspace_id: None,
            expires_in_days: Some(1),
        })
        .await?;
    sqlx::query("UPDATE api_tokens SET expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(short.info.id.as_uuid())
        .execute(&stack.ctx.pool)
        .await?;
    let err = Client::new(&stack.api_url, &short.token)?
        .list_workspaces()
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(401), "{err}");

    // Bad input is refused with its code and changes nothing; only instance admins manage.
    for (body, code) in [
        (json!({ "name": "", "role": "viewer" }), "invalid_name"),
        (json!({ "name": "x", "role": "root" }), "invalid_role"),
        (
            json!({ "name": "x", "role": "viewer", "expiresInDays": 0 }),
            "invalid_expiry",
        ),
        (
            json!({ "name": "x", "role": "viewer", "workspaceId": takosumi_core::WorkspaceId::new() }),
            "unknown_workspace",
        ),
        (
            json!({ "name": "x", "role": "viewer", "extra": 1 }),
            "invalid_json",
        ),
    ] {
        let before = probe::fingerprint(&stack.ctx.pool).await?;
        let (s, answer) = stack.call("POST", "/api/v1/tokens", body.clone()).await?;
        assert!((400..500).contains(&s), "{body}: {s} {answer}");
        assert_eq!(answer["code"], code, "{body}: {answer}");
        assert_eq!(probe::fingerprint(&stack.ctx.pool).await?, before, "{body}");
    }
    let ws_admin = stack
        .client
        .create_token(&NewToken {
            name: "ws-admin".into(),
            role: "admin".into(),
            workspace_id: Some(ws.id),
            expires_in_days: None,
        })
        .await?;
    let (operator, _) = stack.token("tok-operator", "operator").await?;
    for token in [&ws_admin.token, &operator] {
        let (s, answer) = stack
            .call_as(
                "POST",
                "/api/v1/tokens",
                token,
                json!({ "name": "x", "role": "admin" }),
            )
            .await?;
        assert_eq!(s, 403, "{answer}");
    }

    // The CLI: create prints the value once, list shows it without, revoke ends it.
    let cli = async |args: &[&str]| {
        let out = stack.cli(args).await?;
        anyhow::Ok((out.code, out.stdout))
    };
    let (code, out) = cli(&[
        "token", "create", "--name", "from-cli", "--role", "approver",
    ])
    .await?;
    assert_eq!(code, 0, "{out}");
    let value = out.trim().to_owned();
    assert!(value.starts_with("tks_"), "{out}");
    let (code, listed) = cli(&["token", "list"]).await?;
    assert_eq!(code, 0);
    assert!(
        listed.contains("from-cli") && !listed.contains(&value),
        "{listed}"
    );
    let id = Client::new(&stack.api_url, &value)?;
    assert!(id.list_workspaces().await.is_ok());
    let tok_id = listed
        .lines()
        .find(|l| l.contains("from-cli"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default()
        .to_owned();
    let (code, out) = cli(&["token", "revoke", &tok_id]).await?;
    assert_eq!(code, 0, "{out}");
    assert_eq!(id.list_workspaces().await.unwrap_err().status(), Some(401));
    stack.stop().await
}
