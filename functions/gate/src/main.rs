//! `takosumi-gate`: consumes `run.gate`.

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, init_telemetry, run_worker, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    init_telemetry("gate");
    let ctx = Ctx::connect(&settings, "gate").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_gate::handle(&ctx, msg).await };
    run_worker(ctx, &settings, Topic::Gate, handler, shutdown_signal()).await?;
    Ok(())
}
