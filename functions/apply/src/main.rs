//! `takosumi-apply`: consumes `run.apply`.

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, init_telemetry, run_worker, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    init_telemetry("apply");
    let ctx = Ctx::connect(&settings, "apply").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_apply::handle(&ctx, msg).await };
    run_worker(ctx, &settings, Topic::Apply, handler, shutdown_signal()).await?;
    Ok(())
}
