//! Private service instances for the restart tests: a Postgres cluster, a RabbitMQ node
//! and an s3s-fs server that belong to one test alone. Restarting the shared services
//! that `infra/local/start.sh` runs would break every other test (and every other
//! developer's run) using them at the same time; a private instance can be stopped and
//! started at will. Each is started the way `infra/local/start.sh` starts the shared one
//! (same binaries, same flags), on free loopback ports, with its data in a directory under
//! `/var/tmp` that is removed when it is dropped. They need root, like `start.sh`: the
//! servers run as their own `postgres` and `rabbitmq` users.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A free TCP port on 127.0.0.1 (free when asked; the server binds it right after).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Whether something accepts connections on 127.0.0.1:`port`.
pub fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(300),
    )
    .is_ok()
}

fn wait_until(what: &str, secs: u64, mut ok: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("{what} not ready after {secs} s")
}

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let out = cmd
        .current_dir("/")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A directory under /var/tmp owned by `user` (the servers cannot read a root-only tempdir).
fn owned_dir(prefix: &str, user: &str) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")?;
    run(
        Command::new("chown").arg(user).arg(dir.path()),
        "chown of a private service directory",
    )?;
    Ok(dir)
}

/// A Postgres cluster of its own (`initdb` + `pg_ctl`, trust auth on 127.0.0.1).
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    /// Creates and starts a cluster whose superuser is `takosumi`.
    pub fn start() -> anyhow::Result<Self> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .context("no PostgreSQL server installed (run infra/local/install.sh)")?
            .filter_map(Result::ok)
            .map(|e| e.path().join("bin"))
            .filter(|p| p.join("initdb").is_file())
            .max_by_key(|p| {
                p.parent()
                    .and_then(Path::file_name)
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.parse::<u32>().ok())
                    .unwrap_or(0)
            })
            .context("no initdb under /usr/lib/postgresql/*/bin")?;
        let dir = owned_dir("takosumi-pg-", "postgres")?;
        let pg = Self {
            port: free_port()?,
            bin,
            dir,
        };
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(pg.bin.join("initdb"))
                .arg("-D")
                .arg(pg.data())
                .args(["-U", "takosumi", "--auth=trust", "-E", "UTF8", "--no-sync"]),
            "initdb",
        )?;
        pg.start_server()?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn pg_ctl(&self, args: &[&str]) -> anyhow::Result<()> {
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(self.bin.join("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .args(args),
            "pg_ctl",
        )
    }

    fn start_server(&self) -> anyhow::Result<()> {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("postgres.log");
        self.pg_ctl(&[
            "-l",
            log.to_str().unwrap_or("/dev/null"),
            "-o",
            &opts,
            "-w",
            "-t",
            "60",
            "start",
        ])
    }

    /// A superuser URL (on the `postgres` database).
    pub fn admin_url(&self) -> String {
        format!("postgres://takosumi@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (`-m fast`: open sessions are ended, as a restart does).
    pub fn stop(&self) -> anyhow::Result<()> {
        self.pg_ctl(&["-m", "fast", "-w", "-t", "60", "stop"])
    }

    /// Starts it again on the same port with the same data.
    pub fn start_again(&self) -> anyhow::Result<()> {
        self.start_server()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "-t", "30", "stop"]);
    }
}

const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";
const RABBIT_HOME: &str = "/var/lib/rabbitmq";

/// A RabbitMQ node of its own: its own node name, AMQP and distribution ports, data and
/// logs; no plugins (the management API is not needed: the node has only `/`).
pub struct PrivateRabbit {
    dir: tempfile::TempDir,
    node: String,
    port: u16,
}

impl PrivateRabbit {
    /// Starts the node and waits until the broker application runs.
    pub fn start() -> anyhow::Result<Self> {
        let dir = owned_dir("takosumi-rabbit-", "rabbitmq")?;
        let plugins = dir.path().join("enabled_plugins");
        std::fs::write(&plugins, "[].\n")?;
        run(
            Command::new("chown").arg("rabbitmq").arg(&plugins),
            "chown of enabled_plugins",
        )?;
        let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
        let rabbit = Self {
            node: format!("tks{id}@localhost"),
            port: free_port()?,
            dir,
        };
        let dist = free_port()?;
        let d = rabbit.dir.path().display().to_string();
        let script = format!(
            "RABBITMQ_NODENAME={node} RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT={port} \
             RABBITMQ_DIST_PORT={dist} RABBITMQ_MNESIA_BASE={d}/mnesia RABBITMQ_LOG_BASE={d}/log \
             RABBITMQ_ENABLED_PLUGINS_FILE={d}/enabled_plugins RABBITMQ_PID_FILE={d}/pid \
             {RABBIT_BIN}/rabbitmq-server -detached",
            node = rabbit.node,
            port = rabbit.port,
        );
        rabbit.as_rabbitmq(&script, "rabbitmq-server -detached")?;
        let started = Instant::now();
        loop {
            if rabbit.ctl(&["-q", "await_startup"]).is_ok() && port_open(rabbit.port) {
                break;
            }
            if started.elapsed() > Duration::from_secs(90) {
                bail!("private RabbitMQ node did not start: see {d}/log");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(rabbit)
    }

    fn as_rabbitmq(&self, script: &str, what: &str) -> anyhow::Result<()> {
        run(
            Command::new("su")
                .args(["rabbitmq", "-s", "/bin/sh", "-c"])
                .arg(format!("cd {RABBIT_HOME} && HOME={RABBIT_HOME} {script}")),
            what,
        )
    }

    fn ctl(&self, args: &[&str]) -> anyhow::Result<()> {
        self.as_rabbitmq(
            &format!(
                "{RABBIT_BIN}/rabbitmqctl -n {} {}",
                self.node,
                args.join(" ")
            ),
            "rabbitmqctl",
        )
    }

    /// The AMQP URL (guest on loopback, vhost `/`).
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Stops the broker application (every connection is closed; the node, its queues and
    /// their persistent messages stay).
    pub fn stop_app(&self) -> anyhow::Result<()> {
        self.ctl(&["-q", "stop_app"])
    }

    /// Starts the broker application again and waits until it accepts connections.
    pub fn start_app(&self) -> anyhow::Result<()> {
        self.ctl(&["-q", "start_app"])?;
        wait_until("the private RabbitMQ port", 60, || port_open(self.port))
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        if self.ctl(&["-q", "stop"]).is_err()
            && let Ok(pid) = std::fs::read_to_string(self.dir.path().join("pid"))
        {
            let _ = Command::new("kill")
                .args(["-9", pid.trim()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// An s3s-fs server of its own, started as `infra/local/start.sh` starts the shared one
/// (`s3s-fs --host 127.0.0.1 --port P --access-key K --secret-key S DIR`, every folder of
/// DIR a bucket); its objects stay on disk across a kill and a restart.
pub struct PrivateS3 {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    access_key: String,
    secret_key: String,
    child: Option<Child>,
}

impl PrivateS3 {
    /// Starts s3s-fs with the shared server's access key and secret (from `env.sh`).
    pub fn start() -> anyhow::Result<Self> {
        let bin = std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .map(|p| p.join("s3s-fs"))
            .find(|p| p.is_file())
            .or_else(|| {
                let cache = std::env::var("TAKOSUMI_CACHE")
                    .unwrap_or_else(|_| "/var/tmp/takosumi-cache".to_owned());
                let p = Path::new(&cache).join("cargo-bin/bin/s3s-fs");
                p.is_file().then_some(p)
            })
            .context("s3s-fs not found: run infra/local/install.sh")?;
        let mut s3 = Self {
            dir: tempfile::Builder::new()
                .prefix("takosumi-s3-")
                .tempdir_in("/var/tmp")?,
            bin,
            port: free_port()?,
            access_key: std::env::var("TAKOSUMI_S3_ACCESS_KEY")
                .context("TAKOSUMI_S3_ACCESS_KEY is not set (source env.sh)")?,
            secret_key: std::env::var("TAKOSUMI_S3_SECRET_KEY")
                .context("TAKOSUMI_S3_SECRET_KEY is not set (source env.sh)")?,
            child: None,
        };
        s3.start_server()?;
        Ok(s3)
    }

    fn start_server(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("s3s.log"))?;
        let data = self.dir.path().join("data");
        std::fs::create_dir_all(&data)?;
        let child = Command::new(&self.bin)
            .args(["--host", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .args([
                "--access-key",
                &self.access_key,
                "--secret-key",
                &self.secret_key,
            ])
            .arg(&data)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting s3s-fs")?;
        self.child = Some(child);
        wait_until("the private s3s-fs", 15, || port_open(self.port))
    }

    /// The endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The directory the server keeps its buckets in (one directory per bucket), for
    /// tests that make storage refuse writes under one prefix.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// SIGKILLs the server (a crash: nothing is flushed or closed politely).
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts it again on the same port with the same data directory.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        self.start_server()
    }
}

impl Drop for PrivateS3 {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// The processes whose parent is `parent` (from `/proc/*/stat`).
fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                        // pid (comm) state ppid …; comm may hold spaces: read after the last ')'.
                        s.rsplit_once(')')
                            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                            .and_then(|p| p.parse::<u32>().ok())
                            == Some(parent)
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `pid` still runs (a zombie does not: it has released everything but its slot).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false)
    })
}

fn signal(sig: &str, pid: u32) -> anyhow::Result<()> {
    let out = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .output()?;
    if !out.status.success() {
        bail!(
            "kill -{sig} {pid}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Hard crashes for the restart suite: nothing is flushed, no session is ended politely.
impl PrivatePostgres {
    /// SIGKILLs the postmaster and every process it started (backends, checkpointer, WAL
    /// writer, …), as losing the machine would, and waits until they are gone; returns the
    /// pids. The postmaster is stopped (SIGSTOP) first, so it cannot start a backend between
    /// the listing and the kill. [`PrivatePostgres::start_again`] then recovers from the WAL.
    pub fn kill_hard(&self) -> anyhow::Result<Vec<u32>> {
        let lock = std::fs::read_to_string(self.data().join("postmaster.pid"))
            .context("reading postmaster.pid")?;
        let postmaster: u32 = lock
            .lines()
            .next()
            .context("empty postmaster.pid")?
            .trim()
            .parse()?;
        signal("STOP", postmaster)?;
        let mut pids = vec![postmaster];
        pids.extend(children_of(postmaster));
        for pid in &pids {
            signal("KILL", *pid)?;
        }
        // Gone means reaped, not just dead: a new postmaster refuses to start while the
        // pid in postmaster.pid still exists, and a zombie's does until its parent (here
        // init, which adopted it) reaps it.
        wait_until("the killed Postgres processes to be reaped", 30, || {
            pids.iter()
                .all(|p| !Path::new(&format!("/proc/{p}")).exists())
                && !port_open(self.port)
        })?;
        Ok(pids)
    }
}

impl PrivateRabbit {
    /// SIGKILLs the node's Erlang VM (`beam.smp`, its pid from the node's pid file) and
    /// waits until it is gone and its AMQP port closed. Unlike [`PrivateRabbit::stop_app`]
    /// nothing is closed politely: queues recover from their logs when the node starts again
    /// ([`PrivateRabbit::start_node_again`]).
    pub fn kill_node(&self) -> anyhow::Result<u32> {
        let pid: u32 = std::fs::read_to_string(self.dir.path().join("pid"))
            .context("reading the node's pid file")?
            .trim()
            .parse()?;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() != "beam.smp" {
            bail!("pid {pid} from the node's pid file is {comm:?}, not beam.smp");
        }
        signal("KILL", pid)?;
        wait_until("the killed RabbitMQ node to be gone", 30, || {
            !alive(pid) && !port_open(self.port)
        })?;
        Ok(pid)
    }

    /// Starts the killed node again (same name, AMQP port, data and logs; a new
    /// distribution port) and waits until the broker application accepts connections.
    pub fn start_node_again(&self) -> anyhow::Result<()> {
        let d = self.dir.path().display().to_string();
        let script = format!(
            "RABBITMQ_NODENAME={node} RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT={port} \
             RABBITMQ_DIST_PORT={dist} RABBITMQ_MNESIA_BASE={d}/mnesia RABBITMQ_LOG_BASE={d}/log \
             RABBITMQ_ENABLED_PLUGINS_FILE={d}/enabled_plugins RABBITMQ_PID_FILE={d}/pid \
             {RABBIT_BIN}/rabbitmq-server -detached",
            node = self.node,
            port = self.port,
            dist = free_port()?,
        );
        self.as_rabbitmq(&script, "rabbitmq-server -detached (again)")?;
        let started = Instant::now();
        loop {
            if self.ctl(&["-q", "await_startup"]).is_ok() && port_open(self.port) {
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(90) {
                bail!("the private RabbitMQ node did not start again: see {d}/log");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}
