//! `GET /metrics` (Prometheus / OpenMetrics text) on its own listener,
//! `TAKOSUMI_METRICS_LISTEN`: kept off the API's port so it is never exposed where the API
//! is, and served by the long-running step processes too. The API passes its pool and
//! adds the figures only Postgres has ([`takosumi_store::stats`]); a step process serves
//! only what it measured itself.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use takosumi_store::Pool;
use takosumi_telemetry::metrics;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `/metrics` on `listener` until `shutdown`; with `db`, Postgres's figures too.
pub async fn serve(listener: TcpListener, db: Option<Pool>, shutdown: CancellationToken) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "metrics listening");
    }
    let app = Router::new().route("/metrics", get(scrape)).with_state(db);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
    if let Err(e) = served {
        tracing::warn!(error = %e, "metrics listener stopped");
    }
}

/// Binds `TAKOSUMI_METRICS_LISTEN` (when set) and serves it in the background.
pub async fn spawn(
    listen: Option<&str>,
    db: Option<Pool>,
    shutdown: CancellationToken,
) -> Result<Option<tokio::task::JoinHandle<()>>, std::io::Error> {
    let Some(listen) = listen else {
        return Ok(None);
    };
    let listener = TcpListener::bind(listen).await?;
    Ok(Some(tokio::spawn(serve(listener, db, shutdown))))
}

async fn scrape(State(db): State<Option<Pool>>) -> impl IntoResponse {
    let figures = match &db {
        None => None,
        Some(pool) => match takosumi_store::stats::figures(pool).await {
            Ok(f) => Some(f),
            Err(e) => {
                // A scrape that cannot read Postgres fails whole: a partial answer would
                // read as "no Runs, no backlog".
                tracing::warn!(error = %e, "metrics: Postgres figures unavailable");
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                    "postgres unavailable\n".to_owned(),
                );
            }
        },
    };
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        metrics::render(figures.as_ref()),
    )
}
