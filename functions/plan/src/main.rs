//! `takosumi-plan`: consumes `run.plan`.

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, init_telemetry, run_worker, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    init_telemetry("plan");
    let ctx = Ctx::connect(&settings, "plan").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_plan::handle(&ctx, msg).await };
    run_worker(ctx, &settings, Topic::Plan, handler, shutdown_signal()).await?;
    Ok(())
}
