//! `takosumi-apply`: consumes `run.apply` (`--once`: one Run's worth, then exit).

use takosumi_core::Topic;
use takosumi_runtime::{Ctx, Settings, WorkerMode, init_telemetry, run_step, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mode = WorkerMode::from_args("takosumi-apply");
    let settings = Settings::from_env()?;
    let _telemetry = init_telemetry("apply");
    let ctx = Ctx::connect(&settings, "apply").await?;
    let handler = |ctx: Ctx, msg| async move { takosumi_apply::handle(&ctx, msg).await };
    run_step(
        ctx,
        &settings,
        Topic::Apply,
        handler,
        mode,
        shutdown_signal(),
    )
    .await?;
    Ok(())
}
