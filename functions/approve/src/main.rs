//! `takosumi-approve`: consumes `run.approve`.

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, init_telemetry, run_worker, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    init_telemetry("approve");
    let ctx = Ctx::connect(&settings, "approve").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_approve::handle(&ctx, msg).await };
    run_worker(ctx, &settings, Topic::Approve, handler, shutdown_signal()).await?;
    Ok(())
}
