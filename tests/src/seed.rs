//! Data generated in SQL for tests and benchmarks that need more of it than the API could
//! make in the time (tens of thousands of due Capsules).

/// Adds `n` Capsules to a Workspace with an hourly drift interval, each with an applied
/// StateVersion (what the sweep checks drift against), so every one is due.
pub async fn due_capsules(
    pool: &takosumi_store::Pool,
    name: &str,
    n: usize,
) -> anyhow::Result<uuid::Uuid> {
    let ws = uuid::Uuid::now_v7();
    let mut tx = pool.begin().await?;
    tx.lift_statement_timeout().await?;
    sqlx::query("INSERT INTO workspaces (id, name, drift_interval_secs) VALUES ($1, $2, 3600)")
        .bind(ws)
        .bind(name)
        .execute(tx.db())
        .await?;
    sqlx::query(
        "INSERT INTO capsules (id, workspace_id, name, repo, branch, dir, tool, vars)
         SELECT gen_random_uuid(), $1, 'due-' || g, 'file:///nonexistent', 'main', 'infra', 'terraform', '{}'::jsonb
           FROM generate_series(1, $2) g",
    )
    .bind(ws)
    .bind(i32::try_from(n)?)
    .execute(tx.db())
    .await?;
    evidence_on_insert(&mut tx, false).await?;
    sqlx::query(
        "INSERT INTO runs (id, kind, status, workspace_id, capsule_id, actor_kind, actor_id, source_commit)
         SELECT gen_random_uuid(), 'apply', 'applied', workspace_id, id, 'user', 'bench', repeat('a', 40)
           FROM capsules WHERE workspace_id = $1",
    )
    .bind(ws)
    .execute(tx.db())
    .await?;
    evidence_on_insert(&mut tx, true).await?;
    sqlx::query(
        "INSERT INTO state_versions (id, capsule_id, generation, run_id, object_key, digest, size_bytes)
         SELECT gen_random_uuid(), capsule_id, 1, id, 'bench/none', 'none', 0
           FROM runs WHERE workspace_id = $1",
    )
    .bind(ws)
    .execute(tx.db())
    .await?;
    sqlx::query(
        "UPDATE capsules c SET current_state_version_id = sv.id, state_generation = 1,
                               drift_baseline_run_id = sv.run_id
           FROM state_versions sv WHERE sv.capsule_id = c.id AND c.workspace_id = $1",
    )
    .bind(ws)
    .execute(tx.db())
    .await?;
    tx.commit().await?;
    vacuum(pool).await?;
    Ok(ws)
}

/// One Workspace, one Capsule and one queued plan Run in it, written in SQL, for tests and
/// figures about the tables themselves rather than the API; returns the Run's id.
pub async fn one_queued_run(pool: &takosumi_store::Pool, name: &str) -> anyhow::Result<uuid::Uuid> {
    let (ws, capsule, run) = (
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
    );
    sqlx::query(
        "WITH ws AS (INSERT INTO workspaces (id, name) VALUES ($1, $4) RETURNING id),
              cap AS (INSERT INTO capsules (id, workspace_id, name, repo, branch, dir, tool)
                      SELECT $2, id, $4, 'file:///nonexistent', 'main', '.', 'terraform' FROM ws
                      RETURNING id, workspace_id)
         INSERT INTO runs (id, kind, workspace_id, capsule_id, actor_kind, actor_id)
         SELECT $3, 'plan', workspace_id, id, 'user', $4 FROM cap",
    )
    .bind(ws)
    .bind(capsule)
    .bind(run)
    .bind(name)
    .execute(pool)
    .await?;
    Ok(run)
}

/// `VACUUM ANALYZE` on a connection without the stack's statement timeout (a million
/// rows take longer), as autovacuum would have done on an instance this size.
pub async fn vacuum(pool: &takosumi_store::Pool) -> anyhow::Result<()> {
    untimed(pool, "VACUUM ANALYZE").await
}

/// Runs a maintenance statement (`VACUUM`, `CHECKPOINT`) on one of the pool's own
/// connections without the stack's statement timeout, which it restores afterwards.
pub async fn untimed(pool: &takosumi_store::Pool, statement: &str) -> anyhow::Result<()> {
    let mut conn = (**pool).acquire().await?;
    sqlx::query("SET statement_timeout = 0")
        .execute(&mut *conn)
        .await?;
    sqlx::query(statement).execute(&mut *conn).await?;
    sqlx::query("RESET statement_timeout")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Turns the evidence trigger on Run inserts off (`false`) or back on, inside `tx`, for
/// Runs written as history: with it on, each ended Run inserted queues a statement for
/// the evidence writer to sign.
pub async fn evidence_on_insert(tx: &mut takosumi_store::Tx, on: bool) -> anyhow::Result<()> {
    let sql = if on {
        "ALTER TABLE runs ENABLE TRIGGER runs_evidence_on_insert"
    } else {
        "ALTER TABLE runs DISABLE TRIGGER runs_evidence_on_insert"
    };
    sqlx::query(sql).execute(tx.db()).await?;
    Ok(())
}
