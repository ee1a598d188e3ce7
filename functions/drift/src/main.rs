//! `takosumi-drift`: consumes `run.drift`.

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, init_telemetry, run_worker, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    init_telemetry("drift");
    let ctx = Ctx::connect(&settings, "drift").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_drift::handle(&ctx, msg).await };
    run_worker(ctx, &settings, Topic::Drift, handler, shutdown_signal()).await?;
    Ok(())
}
