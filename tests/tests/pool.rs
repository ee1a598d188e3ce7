//! The connection pool gives a connection back without a round trip when it owes the server
//! nothing, and only once the server has answered when it owes something (the patched
//! release of `shared/vendor/sqlx-core`; `shared/vendor/README.md`).
//!
//! - A statement taken straight from the pool is one round trip: one `Sync` sent per
//!   statement, counted on the wire by a proxy (upstream sqlx sends a second one, its
//!   release ping, for every statement).
//! - A transaction dropped without commit is rolled back as its connection goes back: its
//!   row lock is free at once, not when the connection is next used.
//! - A result dropped half read is read to its end before the connection is used again.
//!
//! Real Postgres (the local stack's), a database of the test's own ([`BareDatabase`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use takosumi_tests::BareDatabase;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// `url` with its host and port replaced by `addr`, without TLS (so a proxy can read it).
fn via(url: &str, addr: std::net::SocketAddr) -> anyhow::Result<String> {
    let (scheme_user, rest) = url
        .rsplit_once('@')
        .ok_or_else(|| anyhow::anyhow!("the database URL has no user part"))?;
    let (_, db) = rest
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("the database URL names no database"))?;
    let db = db.split('?').next().unwrap_or(db);
    Ok(format!("{scheme_user}@{addr}/{db}?sslmode=disable"))
}

/// Frontend messages of one client connection, counted as they pass: the startup message
/// has no type byte, every later one is a type byte and a length that counts itself.
#[derive(Default)]
struct Frontend {
    started: bool,
    buf: Vec<u8>,
}

impl Frontend {
    /// Feeds `bytes` sent by the client; calls `seen` with each whole message's type.
    fn feed(&mut self, bytes: &[u8], mut seen: impl FnMut(u8)) {
        self.buf.extend_from_slice(bytes);
        loop {
            let (header, kind) = if self.started {
                (5, self.buf.first().copied())
            } else {
                (4, Some(0))
            };
            if self.buf.len() < header {
                return;
            }
            let at = header - 4;
            let len = u32::from_be_bytes([
                self.buf[at],
                self.buf[at + 1],
                self.buf[at + 2],
                self.buf[at + 3],
            ]) as usize;
            let whole = at + len;
            if self.buf.len() < whole {
                return;
            }
            self.buf.drain(..whole);
            if self.started {
                seen(kind.unwrap_or(0));
            }
            self.started = true;
        }
    }
}

/// A TCP proxy in front of Postgres that counts the `Sync` messages its clients send.
async fn sync_counting_proxy(
    upstream: std::net::SocketAddr,
) -> anyhow::Result<(std::net::SocketAddr, Arc<AtomicUsize>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let syncs = Arc::new(AtomicUsize::new(0));
    let counted = syncs.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                continue;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                let up = async move {
                    let mut frontend = Frontend::default();
                    let mut chunk = vec![0u8; 16 * 1024];
                    loop {
                        let n = match client_rx.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        frontend.feed(&chunk[..n], |kind| {
                            if kind == b'S' {
                                counted.fetch_add(1, Ordering::SeqCst);
                            }
                        });
                        if server_tx.write_all(&chunk[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
                };
                tokio::join!(up, down);
            });
        }
    });
    Ok((addr, syncs))
}

fn upstream_of(url: &str) -> anyhow::Result<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    let (_, rest) = url
        .rsplit_once('@')
        .ok_or_else(|| anyhow::anyhow!("the database URL has no user part"))?;
    let host_port = rest.split('/').next().unwrap_or(rest);
    host_port
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{host_port} resolves to nothing"))
}

/// Waits until `syncs` has not moved for a while (the pool's release runs in a task of its
/// own), then returns it.
async fn settled(syncs: &AtomicUsize) -> usize {
    let mut last = syncs.load(Ordering::SeqCst);
    loop {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let now = syncs.load(Ordering::SeqCst);
        if now == last {
            return now;
        }
        last = now;
    }
}

#[test]
fn the_frontend_parser_counts_whole_messages_only() {
    let mut f = Frontend::default();
    let mut seen = Vec::new();
    // A startup message (length 8), then Sync, then half of a Query.
    let bytes = [
        0, 0, 0, 8, 0, 3, 0, 0, b'S', 0, 0, 0, 4, b'Q', 0, 0, 0, 8, b'a',
    ];
    f.feed(&bytes, |k| seen.push(k));
    assert_eq!(seen, vec![b'S']);
    f.feed(&[b'b', b'c', 0, b'S', 0, 0], |k| seen.push(k));
    assert_eq!(seen, vec![b'S', b'Q']);
    f.feed(&[0, 4], |k| seen.push(k));
    assert_eq!(seen, vec![b'S', b'Q', b'S']);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_taken_from_the_pool_is_one_round_trip() -> anyhow::Result<()> {
    let db = BareDatabase::create().await?;
    let (proxy, syncs) = sync_counting_proxy(upstream_of(&db.url)?).await?;
    let pool = takosumi_store::connect(&via(&db.url, proxy)?, 1).await?;
    // The first run of a statement prepares it; count from the second on.
    let one: i32 = sqlx::query_scalar("SELECT $1::int4")
        .bind(1)
        .fetch_one(&pool)
        .await?;
    assert_eq!(one, 1);
    let before = settled(&syncs).await;
    const STATEMENTS: usize = 20;
    for i in 0..STATEMENTS {
        let got: i32 = sqlx::query_scalar("SELECT $1::int4")
            .bind(i as i32)
            .fetch_one(&pool)
            .await?;
        assert_eq!(got, i as i32);
    }
    let sent = settled(&syncs).await - before;
    assert_eq!(
        sent, STATEMENTS,
        "{STATEMENTS} statements taken from the pool sent {sent} Syncs: a connection went back with a ping"
    );
    // A connection taken for a few statements: one Sync each, nothing on its return.
    let before = settled(&syncs).await;
    {
        let mut conn = pool.acquire().await?;
        for i in 0..3 {
            let got: i32 = sqlx::query_scalar("SELECT $1::int4")
                .bind(i)
                .fetch_one(conn.db())
                .await?;
            assert_eq!(got, i);
        }
    }
    let sent = settled(&syncs).await - before;
    assert_eq!(
        sent, 3,
        "three statements on one acquired connection sent {sent} Syncs"
    );
    pool.close().await;
    db.drop_now().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transaction_is_rolled_back_as_its_connection_goes_back() -> anyhow::Result<()> {
    let db = BareDatabase::create().await?;
    let pool = takosumi_store::connect(&db.url, 1).await?;
    let other = takosumi_store::connect(&db.url, 1).await?;
    sqlx::query("CREATE TABLE held (id int PRIMARY KEY, n int)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO held VALUES (1, 0)")
        .execute(&pool)
        .await?;
    {
        let mut tx = pool.begin().await?;
        sqlx::query("UPDATE held SET n = 1 WHERE id = 1")
            .execute(tx.db())
            .await?;
        // Dropped without commit: sqlx queues the ROLLBACK on the connection.
    }
    // Nothing else uses `pool`: the lock is free only if the rollback was sent as the
    // connection went back.
    let t0 = Instant::now();
    loop {
        let locked = sqlx::query("SELECT n FROM held WHERE id = 1 FOR UPDATE NOWAIT")
            .fetch_one(&other)
            .await;
        match locked {
            Ok(_) => break,
            Err(_) if t0.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => anyhow::bail!(
                "the dropped transaction's row lock was still held after {:?}: {e}",
                t0.elapsed()
            ),
        }
    }
    let n: i32 = sqlx::query_scalar("SELECT n FROM held WHERE id = 1")
        .fetch_one(&other)
        .await?;
    assert_eq!(n, 0, "the dropped transaction's update was kept");
    // The connection that rolled back serves the next statement outside any transaction.
    sqlx::query("UPDATE held SET n = 2 WHERE id = 1")
        .execute(&pool)
        .await?;
    let n: i32 = sqlx::query_scalar("SELECT n FROM held WHERE id = 1")
        .fetch_one(&other)
        .await?;
    assert_eq!(n, 2, "a statement after the rollback was left uncommitted");
    pool.close().await;
    other.close().await;
    db.drop_now().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_dropped_half_read_is_read_to_its_end_before_reuse() -> anyhow::Result<()> {
    let db = BareDatabase::create().await?;
    let pool = takosumi_store::connect(&db.url, 1).await?;
    {
        let mut rows =
            sqlx::query_scalar::<_, i32>("SELECT g FROM generate_series(1, 200000) g").fetch(&pool);
        let first = rows.try_next().await?;
        assert_eq!(first, Some(1));
        // Dropped with most of the result unread.
    }
    for i in 0..5 {
        let got: i32 = sqlx::query_scalar("SELECT $1::int4 + 1")
            .bind(i)
            .fetch_one(&pool)
            .await?;
        assert_eq!(
            got,
            i + 1,
            "a statement after a half-read result read its rows"
        );
    }
    pool.close().await;
    db.drop_now().await
}
