//! The HTTP API, the dashboard and the Git webhook receiver. It authenticates callers,
//! validates input, and writes rows together with their outbox wake-ups in one transaction;
//! it never runs the tool and never shows an object key or a sealed value. It opens sealed
//! objects only to hand them on: to a worker pool, re-sealed to the pool's delivery key
//! (`relay`), a held state an operator restores (`resolve_state`), a webhook secret to
//! check a signature (`webhooks`). Beside it run the outbox relay, the lease reaper, the
//! evidence writer (which signs each ended Run's statement), the dead-letter collector and,
//! on `TAKOSUMI_METRICS_LISTEN`, `/metrics`.

mod access;
mod auth;
mod bindings;
mod dashboard;
mod dead_letters;
mod drift;
mod error;
mod evidence;
mod extract;
mod gates;
mod groups;
mod known_workspaces;
mod listing;
mod observe;
mod one_step;
pub mod openapi;
mod pools;
mod proposals;
mod records;
mod relay;
mod resolve_state;
mod review;
mod router;
mod routes;
mod settings;
mod token_cache;
mod tokens;
mod views;
mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use takosumi_runtime::{Ctx, RuntimeError, Settings, run_reaper};
use takosumi_store::Pool;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use access::{Access, Doc, Endpoint, Scope, endpoints};
pub use auth::{Action, Caller, new_token};
pub use error::{ApiError, ErrorBody, ErrorCode};

/// What every request handler shares: one `Arc`, so the clone each request makes of it
/// (its `Extension`, each `State` extractor) is one reference count, not one per field
/// (session 26: the field-by-field clone and drop were 1.2 % of figure 6's samples).
#[derive(Clone, Debug)]
pub struct AppState(Arc<Shared>);

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The fields of [`AppState`].
#[derive(Debug)]
pub struct Shared {
    /// Postgres.
    pub pool: Pool,
    /// Postgres, for the history listings' statements, planned once per connection
    /// (`takosumi_store::plan_once_pool`).
    pub history: Pool,
    /// Wakes the relay after a commit that wrote outbox rows.
    pub relay_wake: Arc<Notify>,
    /// Seals secrets kept at rest (webhook secrets, credentials) with the server key.
    pub sealer: takosumi_seal::Sealer,
    /// The broker (reconnecting): operators read the dead-letter queues through it.
    pub bus: Arc<takosumi_queue::Bus>,
    /// Object storage: relay workers hand plan files and state through the API.
    pub objects: takosumi_objects::ObjectStore,
    /// The control node's context: relay endpoints commit a relayed Run through the same
    /// functions the step handlers call (the plan commit, the dry-run hold).
    pub ctx: takosumi_runtime::Ctx,
    /// `TAKOSUMI_ALLOW_FILE_REPOS`: Capsules may name local repositories.
    pub allow_file_repos: bool,
    /// The evidence public keys, current and rotated out (`GET /api/v1/evidence/keys`).
    pub evidence_keys: Arc<takosumi_evidence::PublishedKeys>,
    /// Token lookups of the last few seconds, dropped on any revocation.
    pub tokens: Arc<token_cache::TokenCache>,
    /// Workspaces seen to exist (they are never deleted).
    pub workspaces: Arc<known_workspaces::KnownWorkspaces>,
}

/// The API's routes.
pub fn router(state: AppState) -> Router {
    // Every route's guard reads the state from the request (it is mounted before the
    // state exists).
    router::router()
        .layer(axum::middleware::from_fn(observe::measure))
        .layer(axum::Extension(state.clone()))
        .with_state(state)
}

/// Stores `TAKOSUMI_ADMIN_TOKEN` (hashed) as an admin token, if set.
pub async fn bootstrap_admin(pool: &Pool, settings: &Settings) -> Result<(), RuntimeError> {
    if let Some(token) = &settings.admin_token {
        takosumi_store::tokens::upsert(
            pool,
            token.expose(),
            "bootstrap-admin",
            takosumi_core::Role::Admin,
            None,
        )
        .await?;
    }
    Ok(())
}

/// Serves the API on `listener` until `shutdown`, with the relay and reaper beside it.
pub async fn serve(
    ctx: Ctx,
    settings: &Settings,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), RuntimeError> {
    // Refuses to serve without a signing key: Runs would end without evidence.
    let signer = settings.evidence_signer()?;
    bootstrap_admin(&ctx.pool, settings).await?;
    let evidence_keys = Arc::new(takosumi_evidence::PublishedKeys::new(
        &signer,
        &settings.evidence_previous_keys,
    ));
    let background = CancellationToken::new();
    let relay = {
        let bus = ctx.bus.clone();
        tokio::spawn(takosumi_queue::run_relay(
            ctx.pool.clone(),
            move || {
                let bus = bus.clone();
                async move { bus.get().await }
            },
            ctx.relay_wake.clone(),
            background.clone(),
        ))
    };
    let reaper = tokio::spawn(run_reaper(
        ctx.clone(),
        Duration::from_millis(settings.reaper_interval_ms),
        settings.stuck_queued_secs,
        background.clone(),
    ));
    // Moves dead letters out of the broker into Postgres, where operators read them.
    let dead_letters = tokio::spawn(takosumi_queue::run_dead_letter_collector(
        ctx.pool.clone(),
        ctx.bus.clone(),
        background.clone(),
    ));
    let metrics = takosumi_runtime::metrics_server::spawn(
        settings.metrics_listen.as_deref(),
        Some(ctx.pool.clone()),
        background.clone(),
    )
    .await
    .map_err(|e| takosumi_runtime::SettingsError {
        problems: vec![format!("TAKOSUMI_METRICS_LISTEN cannot be bound: {e}")],
    })?;
    let evidence_writer = tokio::spawn(evidence::run_writer(
        ctx.pool.clone(),
        signer,
        background.clone(),
    ));
    let token_cache = Arc::new(token_cache::TokenCache::default());
    let revocations = tokio::spawn(token_cache::listen_for_revocations(
        ctx.pool.clone(),
        token_cache.clone(),
        background.clone(),
    ));
    let app = router(AppState(Arc::new(Shared {
        pool: ctx.pool.clone(),
        history: takosumi_store::plan_once_pool(&ctx.pool, 4),
        relay_wake: ctx.relay_wake.clone(),
        sealer: ctx.sealer.clone(),
        bus: ctx.bus.clone(),
        objects: ctx.objects.clone(),
        ctx: ctx.clone(),
        allow_file_repos: settings.allow_file_repos,
        evidence_keys,
        tokens: token_cache,
        workspaces: Arc::default(),
    })));
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "API listening");
    }
    let stop = shutdown.clone();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "server stopped with an error");
    }
    ctx.relay_wake.notify_one();
    tokio::time::sleep(Duration::from_millis(200)).await;
    background.cancel();
    let _ = relay.await;
    let _ = reaper.await;
    let _ = evidence_writer.await;
    if let Some(metrics) = metrics {
        let _ = metrics.await;
    }
    let _ = dead_letters.await;
    let _ = revocations.await;
    ctx.bus.close().await;
    Ok(())
}
