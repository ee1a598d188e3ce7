//! The local stack's S3-protocol server: `s3s-fs` (a file-system object store) served the way
//! its own binary serves it, with one difference: every accepted connection has TCP_NODELAY.
//!
//! Why: s3s-fs's binary leaves Nagle's algorithm on. A GET answer goes out as two writes (the
//! head, then the body streamed from the file); on a kept-alive connection the second write
//! waits for the client to acknowledge the first, and the client delays that acknowledgement
//! (Linux: 40 ms) because it has nothing to send. Every object fetch on a reused connection then
//! took ~42 ms instead of ~0.3 ms (the ~46 ms seen fetching a sealed plan). The AWS SDK already
//! sets TCP_NODELAY on its side; the server side has to as well.
//!
//! The command line is s3s-fs's: `s3s-fs --host H --port P --access-key K --secret-key S DIR`.

use clap::Parser;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::host::MultiDomain;
use s3s::service::S3ServiceBuilder;
use s3s_fs::FileSystem;
use std::path::PathBuf;
use tokio::net::TcpListener;

#[derive(Debug, Parser)]
#[command(version, about = "s3s-fs with TCP_NODELAY (Takosumi's local S3 server)")]
struct Opt {
    /// Host name to listen on.
    #[arg(long, default_value = "localhost")]
    host: String,
    /// Port number to listen on.
    #[arg(long, default_value = "8014")]
    port: u16,
    /// Access key used for authentication (with --secret-key).
    #[arg(long, requires = "secret_key")]
    access_key: Option<String>,
    /// Secret key used for authentication (with --access-key).
    #[arg(long, requires = "access_key")]
    secret_key: Option<String>,
    /// Domain names used for virtual-hosted-style requests.
    #[arg(long)]
    domain: Vec<String>,
    /// Root directory of stored data.
    root: PathBuf,
}

#[tokio::main]
async fn main() -> s3s_fs::Result {
    let opt = Opt::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_ansi(false)
        .init();

    let mut b = S3ServiceBuilder::new(FileSystem::new(opt.root)?);
    if let (Some(ak), Some(sk)) = (opt.access_key, opt.secret_key) {
        b.set_auth(SimpleAuth::from_single(ak, sk));
    }
    if !opt.domain.is_empty() {
        b.set_host(MultiDomain::new(&opt.domain)?);
    }
    let service = b.build();

    let listener = TcpListener::bind((opt.host.as_str(), opt.port)).await?;
    tracing::info!("server is running at http://{}", listener.local_addr()?);
    let http = ConnBuilder::new(TokioExecutor::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        let socket = tokio::select! {
            res = listener.accept() => match res {
                Ok((socket, _)) => socket,
                Err(err) => {
                    tracing::error!("error accepting connection: {err}");
                    continue;
                }
            },
            _ = ctrl_c.as_mut() => break,
        };
        if let Err(err) = socket.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY not set: {err}");
        }
        let conn = http.serve_connection(TokioIo::new(socket), service.clone());
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    tokio::select! {
        () = graceful.shutdown() => {},
        () = tokio::time::sleep(std::time::Duration::from_secs(10)) => {},
    }
    Ok(())
}
