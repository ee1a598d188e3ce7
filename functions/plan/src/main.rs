//! `takosumi-plan`: consumes `run.plan` (`--once`: one Run's worth, then exit).

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, WorkerMode, init_telemetry, run_step, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mode = WorkerMode::from_args("takosumi-plan");
    let settings = Settings::from_env()?;
    let _telemetry = init_telemetry("plan");
    let ctx = Ctx::connect(&settings, "plan").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_plan::handle(&ctx, msg).await };
    run_step(
        ctx,
        &settings,
        Topic::Plan,
        handler,
        mode,
        shutdown_signal(),
    )
    .await?;
    Ok(())
}
