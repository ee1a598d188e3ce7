//! `takosumi-relay`: a worker pool's relay worker (see the library docs), or `keygen` to
//! make a delivery key pair.

use base64::Engine as _;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "takosumi-relay",
    about = "A Takosumi worker pool's relay worker"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Claim and run the pool's jobs until SIGTERM (the default).
    Run {
        /// Run at most one job, then exit 0 (a Kubernetes Job); exits 0 as well when no
        /// job comes within --idle-secs.
        #[arg(long)]
        once: bool,
        /// With --once: seconds to wait for a job before exiting.
        #[arg(long, default_value_t = 30, requires = "once")]
        idle_secs: u64,
    },
    /// Make a delivery key pair: prints `TAKOSUMI_DELIVERY_KEYS=<id>=<private>` (keep it on
    /// the worker) and the public key to register with `POST /api/v1/pools/{pool}/delivery-key`.
    Keygen {
        /// The key id (letters, digits, `.`, `_`, `-`).
        #[arg(long)]
        key_id: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Run {
        once: false,
        idle_secs: 30,
    }) {
        Command::Keygen { key_id } => {
            let pair = takosumi_seal::delivery::DeliveryKeyPair::generate(&key_id)?;
            let b64 = base64::engine::general_purpose::STANDARD;
            println!(
                "TAKOSUMI_DELIVERY_KEYS={}={}",
                pair.key_id(),
                b64.encode(&pair.private_bytes()[..])
            );
            println!(
                "{{\"keyId\": \"{}\", \"publicKey\": \"{}\"}}",
                pair.key_id(),
                b64.encode(pair.public().public)
            );
        }
        Command::Run { once, idle_secs } => {
            let settings = takosumi_relay::RelaySettings::from_env()?;
            let _telemetry = takosumi_telemetry::init("relay");
            let shutdown = tokio_util::sync::CancellationToken::new();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                use tokio::signal::unix::{SignalKind, signal};
                if let Ok(mut term) = signal(SignalKind::terminate()) {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                }
                stop.cancel();
            });
            let once = once.then(|| std::time::Duration::from_secs(idle_secs));
            takosumi_relay::run(settings, once, shutdown).await?;
        }
    }
    Ok(())
}
