//! `takosumi-approve`: consumes `run.approve` (`--once`: one Run's worth, then exit).

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, WorkerMode, init_telemetry, run_step, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mode = WorkerMode::from_args("takosumi-approve");
    let settings = Settings::from_env()?;
    let _telemetry = init_telemetry("approve");
    let ctx = Ctx::connect(&settings, "approve").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_approve::handle(&ctx, msg).await };
    run_step(
        ctx,
        &settings,
        Topic::Approve,
        handler,
        mode,
        shutdown_signal(),
    )
    .await?;
    Ok(())
}
