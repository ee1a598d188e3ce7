//! `takosumi-api`: serves the API (with the outbox relay, the reaper and the evidence
//! writer), mints a token, or makes an evidence signing key.

use clap::{Parser, Subcommand};
use takosumi_runtime::{Ctx, Settings, init_telemetry, shutdown_signal};

#[derive(Parser)]
#[command(name = "takosumi-api", about = "Takosumi's HTTP API")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the API on TAKOSUMI_LISTEN (the default).
    Serve,
    /// Apply pending database migrations and exit. Needs only TAKOSUMI_DATABASE_URL (or
    /// _FILE). Every process also migrates when it starts; a deployment runs this first, as
    /// a Job, so a failing migration fails once, there.
    Migrate,
    /// Create an API token and print it once (only its hash is stored).
    CreateToken {
        /// A name for audit.
        #[arg(long)]
        name: String,
        /// viewer, operator, approver, admin or agent.
        #[arg(long, default_value = "admin")]
        role: takosumi_core::Role,
        /// Limit the token to one Workspace (ws_…).
        #[arg(long)]
        workspace: Option<takosumi_core::WorkspaceId>,
    },
    /// Make a new evidence signing key and print it once: the settings that give the API
    /// the key, and its public key in the form TAKOSUMI_EVIDENCE_PREVIOUS_KEYS lists once
    /// the key is rotated out. Needs no other setting.
    EvidenceKeygen {
        /// The id statements signed with it name (1-64 letters, digits, '.', '_', '-').
        #[arg(long)]
        key_id: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::EvidenceKeygen { key_id }) = &cli.command {
        let (signer, seed) = takosumi_evidence::Signer::generate(key_id)?;
        println!("TAKOSUMI_EVIDENCE_KEY={}", seed.as_str());
        println!("TAKOSUMI_EVIDENCE_KEY_ID={}", signer.key_id());
        println!("# public key, for TAKOSUMI_EVIDENCE_PREVIOUS_KEYS after a rotation:");
        println!("# {}", signer.public_key().to_entry());
        return Ok(());
    }
    if let Some(Command::Migrate) = &cli.command {
        // Needs only the database: a migration Job gets no other secret.
        let _telemetry = init_telemetry("api-migrate");
        let vars: std::collections::HashMap<String, String> = std::env::vars().collect();
        let url = takosumi_core::read_secret(&vars, "TAKOSUMI_DATABASE_URL")
            .map_err(anyhow::Error::msg)?
            .ok_or_else(|| {
                anyhow::anyhow!("TAKOSUMI_DATABASE_URL (or TAKOSUMI_DATABASE_URL_FILE) is not set")
            })?;
        let pool = takosumi_store::connect(&url, 1).await?;
        takosumi_store::migrate(&pool).await?;
        tracing::info!("migrations applied");
        return Ok(());
    }
    let settings = Settings::from_env()?;
    let _telemetry = init_telemetry("api");
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            let ctx = Ctx::connect(&settings, "api").await?;
            let listener = tokio::net::TcpListener::bind(&settings.listen).await?;
            takosumi_api::serve(ctx, &settings, listener, shutdown_signal()).await?;
        }
        Command::CreateToken {
            name,
            role,
            workspace,
        } => {
            let pool = takosumi_store::connect(settings.database_url.expose(), 2).await?;
            takosumi_store::migrate(&pool).await?;
            let token = takosumi_api::new_token();
            takosumi_store::tokens::upsert(&pool, &token, &name, role, workspace).await?;
            println!("{token}");
        }
        Command::EvidenceKeygen { .. } | Command::Migrate => {
            unreachable!("handled before the settings are read")
        }
    }
    Ok(())
}
