//! What the API's `/metrics` reads from Postgres at scrape time: figures no single process
//! sees (a `--once` Job is gone before any scrape), in four index-friendly aggregate
//! queries.

use takosumi_telemetry::metrics::DbFigures;

use crate::StoreError;

/// The figures of one scrape.
pub async fn figures(pool: &crate::Pool) -> Result<DbFigures, StoreError> {
    let runs = sqlx::query!(
        r#"SELECT kind::text AS "kind!", status::text AS "status!", count(*) AS "n!"
             FROM runs GROUP BY kind, status ORDER BY 1, 2"#
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| (r.kind, r.status, r.n))
    .collect();
    let queued_oldest_age = sqlx::query!(
        r#"SELECT kind::text AS "kind!",
                  extract(epoch FROM now() - min(created_at))::float8 AS "age!"
             FROM runs WHERE status = 'queued' GROUP BY kind ORDER BY 1"#
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| (r.kind, r.age.max(0.0)))
    .collect();
    let outbox = sqlx::query!(
        r#"SELECT count(*) AS "n!",
                  COALESCE(extract(epoch FROM now() - min(available_at) FILTER (WHERE available_at <= now()))::float8, 0)
                    AS "age!"
             FROM outbox WHERE sent_at IS NULL"#
    )
    .fetch_one(pool)
    .await?;
    let held = sqlx::query!(
        r#"SELECT (SELECT count(*) FROM dead_letters) AS "dead!",
                  (SELECT count(*) FROM runs
                    WHERE status = 'unknown_outcome' AND resolved_at IS NULL) AS "unknown!""#
    )
    .fetch_one(pool)
    .await?;
    Ok(DbFigures {
        runs,
        queued_oldest_age,
        outbox_backlog: outbox.n,
        outbox_oldest_age: outbox.age.max(0.0),
        dead_letters: held.dead,
        unknown_outcome: held.unknown,
    })
}
