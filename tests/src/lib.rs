//! The end-to-end test fixture. Every test gets its own Postgres database, RabbitMQ vhost,
//! S3 bucket and private work directory, created here and dropped by [`Stack::stop`].
//! The services are the real ones `infra/local/start.sh` runs (their addresses come from
//! its `env.sh`); the tool is the real terraform, behind a wrapper script that only
//! records each invocation before `exec`-ing it, so tests can count tool starts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use base64::Engine as _;
use takosumi_client::Client;
use takosumi_core::{RunId, Topic};
use takosumi_runtime::{Ctx, Settings, run_worker};
use takosumi_seal::delivery::DeliveryKeyPair;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub mod canary;
pub mod probe;
pub mod seed;
pub mod services;

/// Which steps run inside the test process.
#[derive(Debug, Clone, Copy)]
pub struct Steps {
    /// The API (with relay and reaper).
    pub api: bool,
    /// The plan worker.
    pub plan: bool,
    /// The gate worker.
    pub gate: bool,
    /// The apply worker.
    pub apply: bool,
}

impl Steps {
    /// Everything in-process.
    pub const ALL: Steps = Steps {
        api: true,
        plan: true,
        gate: true,
        apply: true,
    };
    /// Only the API: tests drive the handlers themselves.
    pub const API_ONLY: Steps = Steps {
        api: true,
        plan: false,
        gate: false,
        apply: false,
    };
}

/// Options for a test stack.
#[derive(Debug, Clone)]
pub struct Options {
    /// Steps started in-process.
    pub steps: Steps,
    /// Lease length in seconds.
    pub lease_secs: i64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            steps: Steps::ALL,
            lease_secs: 30,
        }
    }
}

fn env(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} is not set: run the tests through infra/local/test.sh (it starts the stack and sources its env.sh)")
    })
}

/// The shared broker's management API (`infra/local/start.sh`), through which each stack
/// makes and removes its vhost and the first stack of a process removes dead ones'.
#[derive(Clone)]
struct Mgmt {
    url: String,
    user: String,
    password: String,
    http: reqwest::Client,
}

impl Mgmt {
    fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            url: env("TAKOSUMI_RABBITMQ_MGMT_URL")?,
            user: env("TAKOSUMI_RABBITMQ_MGMT_USER")?,
            password: env("TAKOSUMI_RABBITMQ_MGMT_PASSWORD")?,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()?,
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}/api/{path}", self.url))
            .basic_auth(&self.user, Some(&self.password))
    }

    /// Makes `vhost`, with every permission for the management user.
    async fn make_vhost(&self, vhost: &str) -> anyhow::Result<()> {
        self.request(reqwest::Method::PUT, &format!("vhosts/{vhost}"))
            .send()
            .await?
            .error_for_status()?;
        self.request(
            reqwest::Method::PUT,
            &format!("permissions/{vhost}/{}", self.user),
        )
        .json(&serde_json::json!({ "configure": ".*", "write": ".*", "read": ".*" }))
        .send()
        .await?
        .error_for_status()?;
        Ok(())
    }

    async fn delete_vhost(&self, vhost: &str) -> anyhow::Result<()> {
        self.request(reqwest::Method::DELETE, &format!("vhosts/{vhost}"))
            .send()
            .await?;
        Ok(())
    }

    async fn vhosts(&self) -> anyhow::Result<Vec<String>> {
        #[derive(serde::Deserialize)]
        struct Vhost {
            name: String,
        }
        let vhosts: Vec<Vhost> = self
            .request(reqwest::Method::GET, "vhosts")
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(vhosts.into_iter().map(|v| v.name).collect())
    }
}

/// The in-process API's and steps' warnings and errors go to the test's captured output
/// (printed when a test fails): an API 500 logs its whole cause chain there, where a test's
/// assertion only sees "the request failed on our side". `TAKOSUMI_TEST_LOG` sets the filter
/// (default `warn`).
fn init_test_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("TAKOSUMI_TEST_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    });
}

fn short_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// Prefixes of the database, the vhost and the bucket each stack makes, followed by
/// `<pid><sep><id>` where `<sep>` is the prefix's last character (a bucket's name has no
/// `_`): the process that made them, so another can tell a leftover from one in use.
const DB_PREFIX: &str = "takosumi_t_";
const VHOST_PREFIX: &str = "t_";
const BUCKET_PREFIX: &str = "t-";

/// The process id a stack's database, vhost or bucket name carries, if it is one.
fn owner_pid(name: &str, prefix: &str) -> Option<u32> {
    let sep = prefix.chars().last()?;
    let (pid, id) = name.strip_prefix(prefix)?.split_once(sep)?;
    (!id.is_empty()).then_some(())?;
    pid.parse().ok()
}

/// Removes the databases, vhosts and buckets of stacks whose test process is gone: a test
/// that fails returns before [`Stack::stop`], and what it made stayed. Left to pile up, they
/// slowed the shared broker until it stopped creating vhosts at all (every quorum queue of
/// every leftover vhost is a Raft group it keeps running), and the buckets' sealed plans and
/// states filled the disk (2.7 GB on one machine). Once per process, before its first stack;
/// a failure here is logged, never a test's.
async fn remove_leftovers(admin_url: &str, mgmt: Option<&Mgmt>, s3_endpoint: &str) {
    static DONE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    DONE.get_or_init(|| async {
        let gone = |pid: u32| !Path::new(&format!("/proc/{pid}")).exists();
        let dropped = async {
            let admin = takosumi_store::connect(admin_url, 1).await?;
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT datname FROM pg_database WHERE starts_with(datname, $1)",
            )
            .bind(DB_PREFIX)
            .fetch_all(&admin)
            .await?;
            let mut dropped = 0;
            for name in names {
                if owner_pid(&name, DB_PREFIX).is_some_and(gone) {
                    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                        .execute(&admin)
                        .await?;
                    dropped += 1;
                }
            }
            admin.close().await;
            anyhow::Ok(dropped)
        }
        .await;
        let deleted = async {
            let Some(mgmt) = mgmt else {
                return anyhow::Ok(0);
            };
            let mut deleted = 0;
            for name in mgmt.vhosts().await? {
                if owner_pid(&name, VHOST_PREFIX).is_some_and(gone) {
                    mgmt.delete_vhost(&name).await?;
                    deleted += 1;
                }
            }
            anyhow::Ok(deleted)
        }
        .await;
        let emptied = async {
            let store = takosumi_objects::ObjectStore::connect(&s3_config(s3_endpoint, "")?).await;
            let mut emptied = 0;
            for name in store.list_buckets(BUCKET_PREFIX).await? {
                if owner_pid(&name, BUCKET_PREFIX).is_some_and(gone) {
                    remove_bucket(&store.in_bucket(&name)).await;
                    emptied += 1;
                }
            }
            anyhow::Ok(emptied)
        }
        .await;
        match (dropped, deleted, emptied) {
            (Ok(0), Ok(0), Ok(0)) => {}
            (Ok(dbs), Ok(vhosts), Ok(buckets)) => {
                eprintln!(
                    "removed what dead test processes left: {dbs} databases, {vhosts} vhosts, {buckets} buckets"
                );
            }
            (dbs, vhosts, buckets) => eprintln!(
                "could not remove what dead test processes left: databases {:?}, vhosts {:?}, buckets {:?}",
                dbs.err(),
                vhosts.err(),
                buckets.err()
            ),
        }
    })
    .await;
}

/// A running, isolated Takosumi.
/// What a CLI run printed and how it exited.
#[derive(Debug, Clone)]
pub struct CliOutput {
    /// The exit code (-1: killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

pub struct Stack {
    /// The settings every in-process step uses.
    pub settings: Settings,
    /// A step context for calling handlers directly and reading private rows.
    pub ctx: Ctx,
    /// An admin API client.
    pub client: Client,
    /// The API's base URL.
    pub api_url: String,
    /// The admin token.
    pub admin_token: String,
    env_vars: HashMap<String, String>,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    db_name: String,
    vhost: String,
    /// Postgres admin URL the database was created through (dropped through it too).
    pg_admin_url: String,
    /// The shared broker's management API when `vhost` was made there (and is deleted by
    /// `stop`); `None` on a broker of the stack's own.
    mgmt: Option<Mgmt>,
    work: tempfile::TempDir,
    tool_log: PathBuf,
    pause_file: PathBuf,
    tool_cwd_log: PathBuf,
}

/// Where a stack's services are when they are not the shared ones `infra/local/start.sh`
/// runs. The restart tests run their own Postgres, RabbitMQ and S3 server
/// ([`services`]) so that restarting them cannot disturb other tests running at the
/// same time. `None` keeps the shared service.
#[derive(Debug, Clone, Default)]
pub struct Endpoints {
    /// Postgres URL of a superuser, on any database (each stack creates its own).
    pub pg_admin_url: Option<String>,
    /// A broker URL used as it is: the broker is the stack's own, no vhost is created.
    pub amqp_url: Option<String>,
    /// The S3 endpoint (same access key and secret as the shared one).
    pub s3_endpoint: Option<String>,
    /// `TAKOSUMI_*` settings set last, over the fixture's (e.g. a shorter
    /// `TAKOSUMI_STUCK_QUEUED_SECS` for a test that loses wake-ups on purpose).
    pub settings: Vec<(String, String)>,
}

impl Stack {
    /// Messages waiting in the broker's dead-letter queues (every step queue's and every
    /// worker pool's), not yet collected into Postgres.
    pub async fn uncollected_dead_letters(&self) -> anyhow::Result<u32> {
        let queues =
            takosumi_queue::collected_queues(&self.ctx.pool, &takosumi_queue::Topology::load())
                .await?;
        let depths = self
            .ctx
            .bus
            .get()
            .await?
            .dead_letter_depths(&queues)
            .await?;
        Ok(depths.iter().map(|q| q.depth).sum())
    }

    /// Starts a stack with all steps in-process.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(Options::default()).await
    }

    /// Starts a stack.
    pub async fn start_with(opts: Options) -> anyhow::Result<Self> {
        Self::start_with_tool(opts, None).await
    }

    /// Starts a stack whose steps run `tool` as their terraform binary, directly, with no
    /// recording wrapper (the benchmarks use it to time the bare tool or a no-op one; the
    /// wrapper's extra `sh` start per call would be counted as Takosumi's). `None` is the
    /// default: the real terraform behind the recording wrapper.
    pub async fn start_with_tool(opts: Options, tool: Option<&Path>) -> anyhow::Result<Self> {
        Self::start_inner(opts, tool, &Endpoints::default()).await
    }

    /// Starts a stack on the given services (the restart tests' private ones).
    pub async fn start_on(opts: Options, endpoints: &Endpoints) -> anyhow::Result<Self> {
        Self::start_inner(opts, None, endpoints).await
    }

    async fn start_inner(
        opts: Options,
        tool: Option<&Path>,
        endpoints: &Endpoints,
    ) -> anyhow::Result<Self> {
        init_test_logging();
        let id = format!("{}_{}", std::process::id(), short_id());
        let work = tempfile::tempdir()?;
        // A database of its own.
        let db_name = format!("{DB_PREFIX}{id}");
        let admin_url = match &endpoints.pg_admin_url {
            Some(url) => url.clone(),
            None => env("TAKOSUMI_PG_ADMIN_URL")?,
        };
        // The shared broker's management API, when the stack makes a vhost there.
        let mgmt = match endpoints.amqp_url {
            Some(_) => None,
            None => Some(Mgmt::from_env()?),
        };
        let s3_endpoint = match &endpoints.s3_endpoint {
            Some(url) => url.clone(),
            None => env("TAKOSUMI_S3_ENDPOINT")?,
        };
        if endpoints.pg_admin_url.is_none() {
            remove_leftovers(&admin_url, mgmt.as_ref(), &s3_endpoint).await;
        }
        let admin = takosumi_store::connect(&admin_url, 1).await?;
        sqlx::query(&format!("CREATE DATABASE {db_name}"))
            .execute(&admin)
            .await?;
        admin.close().await;
        let database_url = replace_db(&admin_url, &db_name);
        // A vhost of its own (or a broker of its own).
        let vhost = format!("{VHOST_PREFIX}{id}");
        let amqp_url = if let Some(url) = &endpoints.amqp_url {
            url.clone()
        } else {
            mgmt.as_ref()
                .context("the shared broker's management API")?
                .make_vhost(&vhost)
                .await?;
            let amqp_base = env("TAKOSUMI_AMQP_URL")?;
            format!(
                "{}/{vhost}",
                amqp_base
                    .rsplit_once('/')
                    .map_or(amqp_base.as_str(), |(b, _)| b)
            )
        };
        // The real terraform behind a recording wrapper. It runs inside the runner
        // sandbox, so what it records goes to the one directory the test's sandboxes may
        // write besides their own (`probe/`, TAKOSUMI_SANDBOX_RW_PATHS), never the runs'.
        let probe = work.path().join("probe");
        std::fs::create_dir(&probe)?;
        let tool_log = probe.join("tool.log");
        let pause_file = probe.join("pause-plan");
        let tool_cwd_log = probe.join("tool-cwd.log");
        let wrapper = probe.join("terraform");
        let real = env("TAKOSUMI_TERRAFORM_BIN")?;
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\necho \"$1\" >> '{log}'\necho \"$1 $PWD\" >> '{cwd_log}'\nif [ \"$1\" = plan ] && [ -f '{pause}' ]; then echo paused >> '{log}'; n=0; while [ -f '{pause}' ] && [ $n -lt 1200 ]; do sleep 0.1; n=$((n+1)); done; fi\nexec '{real}' \"$@\"\n",
                log = tool_log.display(),
                cwd_log = tool_cwd_log.display(),
                pause = pause_file.display(),
            ),
        )?;
        set_executable(&wrapper)?;
        let tool_bin = tool.unwrap_or(&wrapper);
        // Visible read-only in every sandbox: the test repositories and fixtures, the real
        // tool's directory and the one a given tool wrapper lives in.
        let mut ro_paths = vec![FIXTURES_ROOT.to_owned()];
        for bin in [Path::new(&real), tool_bin] {
            if let Some(dir) = bin.parent() {
                ro_paths.push(dir.display().to_string());
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let api_url = format!("http://{}", listener.local_addr()?);
        let admin_token = format!("tks_test_{}", short_id());
        // An evidence signing key of its own: a test may sign with it (to forge a statement
        // the server could have signed) and rotate it.
        let (_, evidence_key) = takosumi_evidence::Signer::generate("test-evidence-1")?;
        let mut vars: HashMap<String, String> = HashMap::new();
        for (k, v) in [
            ("TAKOSUMI_DATABASE_URL", database_url),
            ("TAKOSUMI_AMQP_URL", amqp_url),
            ("TAKOSUMI_S3_ENDPOINT", s3_endpoint),
            ("TAKOSUMI_S3_REGION", env("TAKOSUMI_S3_REGION")?),
            ("TAKOSUMI_S3_ACCESS_KEY", env("TAKOSUMI_S3_ACCESS_KEY")?),
            ("TAKOSUMI_S3_SECRET_KEY", env("TAKOSUMI_S3_SECRET_KEY")?),
            // (no `_` in a bucket's name)
            (
                "TAKOSUMI_S3_BUCKET",
                format!("{BUCKET_PREFIX}{}", id.replace('_', "-")),
            ),
            ("TAKOSUMI_SEAL_KEY", env("TAKOSUMI_SEAL_KEY")?),
            ("TAKOSUMI_SEAL_KEY_ID", "test-1".to_owned()),
            ("TAKOSUMI_EVIDENCE_KEY", evidence_key.to_string()),
            ("TAKOSUMI_EVIDENCE_KEY_ID", "test-evidence-1".to_owned()),
            ("TAKOSUMI_TERRAFORM_BIN", tool_bin.display().to_string()),
            ("TAKOSUMI_SANDBOX_RO_PATHS", ro_paths.join(":")),
            // the test repositories are local paths
            ("TAKOSUMI_ALLOW_FILE_REPOS", "true".to_owned()),
            ("TAKOSUMI_SANDBOX_RW_PATHS", probe.display().to_string()),
            ("TAKOSUMI_TF_CLI_CONFIG", env("TAKOSUMI_TF_CLI_CONFIG")?),
            (
                "TAKOSUMI_WORK_DIR",
                work.path().join("runs").display().to_string(),
            ),
            ("TAKOSUMI_ADMIN_TOKEN", admin_token.clone()),
            (
                "TAKOSUMI_LISTEN",
                api_url.trim_start_matches("http://").to_owned(),
            ),
            ("TAKOSUMI_LEASE_SECS", opts.lease_secs.to_string()),
            ("TAKOSUMI_REAPER_INTERVAL_MS", "300".to_owned()),
            ("TAKOSUMI_STUCK_QUEUED_SECS", "20".to_owned()),
        ] {
            vars.insert(k.to_owned(), v);
        }
        for (k, v) in &endpoints.settings {
            vars.insert(k.clone(), v.clone());
        }
        let settings = Settings::from_map(&vars)?;
        let ctx = Ctx::connect(&settings, "test").await?;
        takosumi_api::bootstrap_admin(&ctx.pool, &settings).await?;
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();
        if opts.steps.api {
            let (ctx, settings, stop) = (
                Ctx::connect(&settings, "api").await?,
                settings.clone(),
                shutdown.clone(),
            );
            tasks.push(tokio::spawn(async move {
                if let Err(e) = takosumi_api::serve(ctx, &settings, listener, stop).await {
                    eprintln!("api stopped: {e}");
                }
            }));
        }
        // The drift step shares the plan step's code: it runs whenever the planner does.
        // The approve step runs whenever the gate does.
        let steps: [(bool, Topic); 5] = [
            (opts.steps.plan, Topic::Plan),
            (opts.steps.plan, Topic::Drift),
            (opts.steps.gate, Topic::Approve),
            (opts.steps.gate, Topic::Gate),
            (opts.steps.apply, Topic::Apply),
        ];
        for (on, topic) in steps {
            if on {
                tasks.push(spawn_step(&settings, topic, shutdown.clone()).await?);
            }
        }
        let client = Client::new(&api_url, &admin_token)?;
        Ok(Self {
            settings,
            ctx,
            client,
            api_url,
            admin_token,
            env_vars: vars,
            shutdown,
            tasks,
            db_name,
            vhost,
            pg_admin_url: admin_url,
            mgmt,
            work,
            tool_log,
            pause_file,
            tool_cwd_log,
        })
    }

    /// The `TAKOSUMI_*` environment a step process of this stack needs.
    pub fn env_vars(&self) -> &HashMap<String, String> {
        &self.env_vars
    }

    /// Every tool invocation so far: its first argument (`version`, `init`, `plan`, …).
    pub fn tool_invocations(&self) -> Vec<String> {
        std::fs::read_to_string(&self.tool_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// How many times the tool was started with `command`.
    pub fn tool_count(&self, command: &str) -> usize {
        self.tool_invocations()
            .iter()
            .filter(|c| *c == command)
            .count()
    }

    /// While set, every `plan` the tool runs waits first (to kill a handler mid-plan), at
    /// most 120 s. Unsetting it lets the plans waiting now go on within 0.1 s, so a test
    /// can hold a plan in flight and then let it finish.
    pub fn pause_plans(&self, on: bool) -> anyhow::Result<()> {
        if on {
            std::fs::write(&self.pause_file, b"")?;
        } else if self.pause_file.exists() {
            std::fs::remove_file(&self.pause_file)?;
        }
        Ok(())
    }

    /// How many times the tool was started with `command` for each Run, keyed by the
    /// `run_…` id in the tool's working directory (each Run's private directory is named
    /// after it). Invocations outside a Run's directory are not counted.
    pub fn tool_count_by_run(&self, command: &str) -> HashMap<String, usize> {
        let text = std::fs::read_to_string(&self.tool_cwd_log).unwrap_or_default();
        let mut counts = HashMap::new();
        for line in text.lines() {
            let Some((cmd, cwd)) = line.split_once(' ') else {
                continue;
            };
            if cmd != command {
                continue;
            }
            if let Some(run) = run_id_in(cwd) {
                *counts.entry(run).or_insert(0) += 1;
            }
        }
        counts
    }

    /// Starts a step as its real binary (`takosumi-plan`, …) in its own process.
    pub fn spawn_process(&self, step: &str) -> anyhow::Result<tokio::process::Child> {
        self.spawn_process_with(step, &[])
    }

    /// Like [`Stack::spawn_process`], with `extra` variables set last (e.g. `RUST_LOG`,
    /// `TAKOSUMI_CONCURRENCY`), so a benchmark can quiet the logs or size the process.
    pub fn spawn_process_with(
        &self,
        step: &str,
        extra: &[(&str, &str)],
    ) -> anyhow::Result<tokio::process::Child> {
        self.spawn_step(step, &[], extra, None)
    }

    /// Like [`Stack::spawn_process_with`], with the process's stderr (its log) appended
    /// to `log`, so a test can read what the process logged (the canary sweep does).
    pub fn spawn_process_logged(
        &self,
        step: &str,
        extra: &[(&str, &str)],
        log: &Path,
    ) -> anyhow::Result<tokio::process::Child> {
        self.spawn_step(step, &[], extra, Some(log))
    }

    /// Starts the step binary `takosumi-<step>` with command-line `args` (`--once`, …),
    /// the stack's settings and `extra` variables set last; its output goes to `log`
    /// (appended) or, without one, stderr to the test's.
    pub fn spawn_step(
        &self,
        step: &str,
        args: &[&str],
        extra: &[(&str, &str)],
        log: Option<&Path>,
    ) -> anyhow::Result<tokio::process::Child> {
        let bin = binary(&format!("takosumi-{step}"))?;
        let (stdout, stderr) = match log {
            Some(log) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)?;
                (Stdio::from(file.try_clone()?), Stdio::from(file))
            }
            None => (Stdio::null(), Stdio::inherit()),
        };
        let child = tokio::process::Command::new(bin)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .envs(&self.env_vars)
            .envs(extra.iter().copied())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()?;
        Ok(child)
    }

    /// A raw API request, for tests that check status codes and error bodies the typed
    /// client would hide: `(status, JSON body or Null)`. `token` `None` sends no
    /// `Authorization` header; `body` is sent as-is (malformed JSON included) with a JSON
    /// content type, and `None` sends no body.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> anyhow::Result<(u16, serde_json::Value)> {
        let method = reqwest::Method::from_bytes(method.as_bytes())?;
        let mut req = reqwest::Client::new().request(method, format!("{}{path}", self.api_url));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_owned());
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        Ok((status, resp.json().await.unwrap_or(serde_json::Value::Null)))
    }

    /// [`Stack::request`] as the admin with a JSON body (`Null`: no body).
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<(u16, serde_json::Value)> {
        let text = (!body.is_null()).then(|| body.to_string());
        self.request(method, path, Some(&self.admin_token), text.as_deref())
            .await
    }

    /// [`Stack::request`] with `token` and `body` sent as JSON (`Null` too).
    pub async fn call_as(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<(u16, serde_json::Value)> {
        self.request(method, path, Some(token), Some(&body.to_string()))
            .await
    }

    /// `POST /runs/{run}/approve` as `token`.
    pub async fn approve_as(
        &self,
        run: RunId,
        token: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<(u16, serde_json::Value)> {
        self.call_as("POST", &format!("/api/v1/runs/{run}/approve"), token, body)
            .await
    }

    /// Runs the `takosumi` CLI against this stack as the bootstrap admin, in a clean
    /// environment (no saved login, nothing inherited).
    pub async fn cli(&self, args: &[&str]) -> anyhow::Result<CliOutput> {
        let out = tokio::process::Command::new(binary("takosumi")?)
            .env_clear()
            .env("TAKOSUMI_DEPLOY_CONTROL_URL", &self.api_url)
            .env("TAKOSUMI_DEPLOY_CONTROL_TOKEN", &self.admin_token)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await?;
        Ok(CliOutput {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// A new API token named `name` with `role` (no Workspace scope), and a client using it.
    pub async fn token(&self, name: &str, role: &str) -> anyhow::Result<(String, Client)> {
        let token = format!(
            "tks_{name}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        takosumi_store::tokens::upsert(&self.ctx.pool, &token, name, role.parse()?, None).await?;
        let client = Client::new(&self.api_url, &token)?;
        Ok((token, client))
    }

    /// Signs in to the dashboard with `token` through its sign-in form, as a person does,
    /// and returns the session's `Cookie` header value (`takosumi_session=…`).
    pub async fn dashboard_session(&self, token: &str) -> anyhow::Result<String> {
        let signed = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()?
            .post(format!("{}/sign-in", self.api_url))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}&next=/"))
            .send()
            .await?;
        anyhow::ensure!(
            signed.status() == 303,
            "the sign-in answered {}",
            signed.status()
        );
        signed
            .headers()
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok()?.split(';').next())
            .find(|c| c.starts_with("takosumi_session="))
            .map(str::to_owned)
            .context("the sign-in set no session cookie")
    }

    /// Polls a Run until it is terminal (or held).
    pub async fn wait(&self, run: RunId) -> anyhow::Result<takosumi_client::Run> {
        Ok(self.client.wait(run, Duration::from_secs(90)).await?)
    }

    /// A plan overtaken by an apply, on whichever executes the Capsule's Runs (the control
    /// node or a relay worker): a first plan is made from generation 0; a second one is held
    /// in the tool's `plan` (restored from generation 0) while the first is applied (the
    /// Capsule moves to generation 1), then let go. The second is recorded against the
    /// generation it planned from, 0, and so its apply is refused
    /// `state_generation_changed` before the tool starts (not left to terraform's own
    /// stale-plan check). The Capsule must plan something to create from an empty state.
    pub async fn check_an_overtaken_plan_keeps_its_generation(
        &self,
        capsule: takosumi_core::CapsuleId,
    ) -> anyhow::Result<()> {
        use takosumi_core::RunStatus;
        let first = self.wait(self.client.plan(capsule, None).await?.id).await?;
        anyhow::ensure!(first.status == RunStatus::Planned, "{first:?}");
        anyhow::ensure!(first.state_generation == Some(0), "{first:?}");
        self.pause_plans(true)?;
        let second = self.client.plan(capsule, None).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !self.tool_invocations().iter().any(|l| l == "paused") {
            if tokio::time::Instant::now() > deadline {
                self.pause_plans(false)?;
                bail!(
                    "the second plan never started: {:?}",
                    self.tool_invocations()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let applied = self.wait(self.client.apply(first.id, None).await?.id).await;
        self.pause_plans(false)?;
        let applied = applied?;
        anyhow::ensure!(applied.status == RunStatus::Applied, "{applied:?}");
        anyhow::ensure!(applied.state_generation == Some(1), "{applied:?}");

        let second = self.wait(second.id).await?;
        anyhow::ensure!(second.status == RunStatus::Planned, "{second:?}");
        anyhow::ensure!(
            second.state_generation == Some(0),
            "the overtaken plan must name the generation it planned from: {:?}",
            second.state_generation
        );
        let planned = self.client.events(second.id).await?;
        let planned = planned
            .iter()
            .find(|e| e.kind == "planned")
            .context("a planned event")?;
        anyhow::ensure!(
            planned.data["stateGeneration"] == serde_json::json!(0),
            "{planned:?}"
        );
        let applies_before = self.tool_count("apply");
        let refused = self
            .wait(self.client.apply(second.id, None).await?.id)
            .await?;
        anyhow::ensure!(refused.status == RunStatus::Failed, "{refused:?}");
        anyhow::ensure!(
            refused
                .error
                .as_ref()
                .is_some_and(|e| e.code == "state_generation_changed"),
            "{refused:?}"
        );
        anyhow::ensure!(
            self.tool_count("apply") == applies_before,
            "the tool's apply started for a stale plan"
        );
        Ok(())
    }

    /// Waits until a Run that was just approved leaves `held` (the approve step releases it
    /// asynchronously), then until it is terminal or held again.
    pub async fn wait_released(&self, run: RunId) -> anyhow::Result<takosumi_client::Run> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let r = self.client.get_run(run).await?;
            if r.status != takosumi_core::RunStatus::Held || tokio::time::Instant::now() > deadline
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.wait(run).await
    }

    /// Stops everything, drops the database and vhost, and empties and deletes the bucket
    /// (the test's sealed plans, states and evidence; best effort: the test's result does
    /// not depend on it).
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
        }
        self.ctx.bus.close().await;
        self.ctx.pool.close().await;
        let admin = takosumi_store::connect(&self.pg_admin_url, 1).await?;
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.db_name
        ))
        .execute(&admin)
        .await?;
        admin.close().await;
        if let Some(mgmt) = &self.mgmt {
            mgmt.delete_vhost(&self.vhost).await?;
        }
        remove_bucket(&self.ctx.objects).await;
        drop(self.work);
        Ok(())
    }
}

/// The object store settings of the local stack's S3 server (its keys from `env.sh`) for
/// `bucket`.
pub fn s3_config(
    endpoint: &str,
    bucket: &str,
) -> anyhow::Result<takosumi_objects::ObjectStoreConfig> {
    Ok(takosumi_objects::ObjectStoreConfig {
        endpoint: Some(endpoint.to_owned()),
        region: env("TAKOSUMI_S3_REGION")?,
        access_key: env("TAKOSUMI_S3_ACCESS_KEY")?,
        secret_key: takosumi_core::Secret::new(env("TAKOSUMI_S3_SECRET_KEY")?),
        bucket: bucket.to_owned(),
        timeouts: takosumi_objects::ObjectTimeouts::default(),
    })
}

/// Deletes `objects`' bucket with every object in it; what fails is left and said.
async fn remove_bucket(objects: &takosumi_objects::ObjectStore) {
    if let Err(e) = objects.delete_bucket().await {
        eprintln!("could not delete bucket {}: {e}", objects.bucket());
    }
}

async fn spawn_step(
    settings: &Settings,
    topic: Topic,
    shutdown: CancellationToken,
) -> anyhow::Result<JoinHandle<()>> {
    let ctx = Ctx::connect(settings, topic.queue_name()).await?;
    let mut settings = settings.clone();
    // In-process steps share the test process's metrics with the in-process API, which
    // serves them; only the API binds TAKOSUMI_METRICS_LISTEN.
    settings.metrics_listen = None;
    Ok(tokio::spawn(async move {
        let result = match topic {
            Topic::Plan => {
                run_worker(
                    ctx,
                    &settings,
                    topic,
                    |c: Ctx, m| async move { takosumi_plan::handle(&c, m).await },
                    shutdown,
                )
                .await
            }
            Topic::Drift => {
                run_worker(
                    ctx,
                    &settings,
                    topic,
                    |c: Ctx, m| async move { takosumi_drift::handle(&c, m).await },
                    shutdown,
                )
                .await
            }
            Topic::Approve => {
                run_worker(
                    ctx,
                    &settings,
                    topic,
                    |c: Ctx, m| async move { takosumi_approve::handle(&c, m).await },
                    shutdown,
                )
                .await
            }
            Topic::Gate => {
                run_worker(
                    ctx,
                    &settings,
                    topic,
                    |c: Ctx, m| async move { takosumi_gate::handle(&c, m).await },
                    shutdown,
                )
                .await
            }
            _ => {
                run_worker(
                    ctx,
                    &settings,
                    topic,
                    |c: Ctx, m| async move { takosumi_apply::handle(&c, m).await },
                    shutdown,
                )
                .await
            }
        };
        if let Err(e) = result {
            eprintln!("{topic:?} worker stopped: {e}");
        }
    }))
}

/// The first `run_` + 32 hex digits in `text`.
fn run_id_in(text: &str) -> Option<String> {
    let mut rest = text;
    while let Some(at) = rest.find("run_") {
        let cand = &rest[at..];
        let body = cand.get(4..36)?;
        if body.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Some(cand[..36].to_owned());
        }
        rest = &rest[at + 4..];
    }
    None
}

/// An empty database of a test's own on the stack's Postgres, for a test that needs Postgres
/// and nothing else of a [`Stack`]. Named as a stack's database, so one a failed test leaves
/// is removed with theirs; [`BareDatabase::drop_now`] drops it.
pub struct BareDatabase {
    admin: takosumi_store::Pool,
    name: String,
    /// Its URL (the stack's admin URL with this database).
    pub url: String,
}

impl BareDatabase {
    /// Creates it.
    pub async fn create() -> anyhow::Result<Self> {
        let admin_url = env("TAKOSUMI_PG_ADMIN_URL")?;
        let admin = takosumi_store::connect(&admin_url, 1).await?;
        let name = format!("{DB_PREFIX}{}_{}", std::process::id(), short_id());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await?;
        let url = replace_db(&admin_url, &name);
        Ok(Self { admin, name, url })
    }

    /// Drops it, closing whatever connections are still open to it.
    pub async fn drop_now(self) -> anyhow::Result<()> {
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&self.admin)
        .await?;
        self.admin.close().await;
        Ok(())
    }
}

fn replace_db(url: &str, db: &str) -> String {
    match url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{db}"),
        None => url.to_owned(),
    }
}

#[cfg(unix)]
fn set_executable(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// A workspace binary next to the test executable (`infra/local/test.sh` builds them first),
/// or beside the running binary itself (the bench binary lives in `target/release/`, next
/// to the step binaries it spawns).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let own_dir = exe.parent().context("executable has no parent directory")?;
    if own_dir.join(name).is_file() {
        return Ok(own_dir.join(name));
    }
    let dir = own_dir
        .parent()
        .context("test executable has no target directory")?;
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{} is missing: build the binaries first (`cargo build --workspace --bins`, as infra/local/test.sh does)",
            path.display()
        );
    }
    Ok(path)
}

/// Where test repositories and fixtures live: the directory every test sandbox sees
/// read-only (`TAKOSUMI_SANDBOX_RO_PATHS`), so `file://` sources, credential scripts and
/// input files are reachable from inside a Run. Never a run directory.
pub const FIXTURES_ROOT: &str = "/tmp/takosumi-test-fixtures";

/// What is left in a work directory besides what the runner keeps between Runs on
/// purpose (the Git cache `git-cache`, the sandboxes' `/etc` copy `etc-view`): the run
/// directories a finished Run should have removed.
pub fn leftover_run_dirs(work_dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(work_dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|n| n != "git-cache" && n != "etc-view")
                .collect()
        })
        .unwrap_or_default()
}

/// A new directory under [`FIXTURES_ROOT`], removed when dropped.
pub fn fixture_dir() -> anyhow::Result<tempfile::TempDir> {
    std::fs::create_dir_all(FIXTURES_ROOT)?;
    Ok(tempfile::tempdir_in(FIXTURES_ROOT)?)
}

/// A throwaway Git repository served as a `file://` URL.
pub struct GitRepo {
    dir: tempfile::TempDir,
}

impl GitRepo {
    /// A repository whose first commit on `main` holds `files`.
    pub fn new(files: &[(&str, &str)]) -> anyhow::Result<Self> {
        let dir = fixture_dir()?;
        git(dir.path(), &["init", "-q", "-b", "main"])?;
        let repo = Self { dir };
        repo.commit(files, "initial")?;
        Ok(repo)
    }

    /// A repository holding one of `infra/examples/*` at `infra/<name>`.
    pub fn with_example(name: &str) -> anyhow::Result<Self> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../infra/examples")
            .join(name)
            .join("main.tf");
        let text =
            std::fs::read_to_string(&src).with_context(|| format!("reading {}", src.display()))?;
        Self::new(&[(&format!("infra/{name}/main.tf"), &text)])
    }

    /// Writes `files` and commits them; returns the commit id.
    pub fn commit(&self, files: &[(&str, &str)], message: &str) -> anyhow::Result<String> {
        for (path, text) in files {
            let p = self.dir.path().join(path);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(p, text)?;
        }
        git(self.dir.path(), &["add", "-A"])?;
        git(
            self.dir.path(),
            &[
                "-c",
                "user.email=t@takosumi.test",
                "-c",
                "user.name=test",
                "commit",
                "-q",
                "-m",
                message,
            ],
        )?;
        let out = std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(self.dir.path())
            .output()?;
        Ok(String::from_utf8(out.stdout)?.trim().to_owned())
    }

    /// Rewrites the last commit (a force-push): the old commit is no longer on any branch,
    /// so a clone over `file://` cannot fetch it. Returns the new commit id.
    pub fn rewrite_last_commit(&self) -> anyhow::Result<String> {
        git(
            self.dir.path(),
            &[
                "-c",
                "user.email=t@takosumi.test",
                "-c",
                "user.name=test",
                "commit",
                "--amend",
                "-q",
                "--allow-empty",
                "-m",
                "rewritten",
            ],
        )?;
        let out = std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(self.dir.path())
            .output()?;
        Ok(String::from_utf8(out.stdout)?.trim().to_owned())
    }

    /// The repository's URL.
    pub fn url(&self) -> String {
        format!("file://{}", self.dir.path().display())
    }
}

fn git(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let status = std::process::Command::new("git")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("git {args:?} failed");
    }
    Ok(())
}

/// `TAKOSUMI_DELIVERY_KEYS` for a relay worker holding `keys` (current first).
pub fn keys_env(keys: &[&DeliveryKeyPair]) -> String {
    keys.iter()
        .map(|k| {
            format!(
                "{}={}",
                k.key_id(),
                base64::engine::general_purpose::STANDARD.encode(&k.private_bytes()[..])
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// A relay worker process: the API's URL, the pool token, the delivery keys and the tool.
/// Nothing else: no database URL, no S3 setting, no server key.
pub fn spawn_relay(
    stack: &Stack,
    token: &str,
    keys: &str,
    work: &Path,
) -> anyhow::Result<tokio::process::Child> {
    spawn_relay_via(stack, &stack.api_url, token, keys, work)
}

/// [`spawn_relay`] reaching the API at `api_url` (a gateway in front of it).
pub fn spawn_relay_via(
    stack: &Stack,
    api_url: &str,
    token: &str,
    keys: &str,
    work: &Path,
) -> anyhow::Result<tokio::process::Child> {
    let env = stack.env_vars();
    Ok(tokio::process::Command::new(binary("takosumi-relay")?)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .env("TAKOSUMI_DEPLOY_CONTROL_URL", api_url)
        .env("TAKOSUMI_POOL_TOKEN", token)
        .env("TAKOSUMI_DELIVERY_KEYS", keys)
        .env("TAKOSUMI_TERRAFORM_BIN", &env["TAKOSUMI_TERRAFORM_BIN"])
        .env("TAKOSUMI_TF_CLI_CONFIG", &env["TAKOSUMI_TF_CLI_CONFIG"])
        .env(
            "TAKOSUMI_SANDBOX_RO_PATHS",
            &env["TAKOSUMI_SANDBOX_RO_PATHS"],
        )
        .env(
            "TAKOSUMI_SANDBOX_RW_PATHS",
            &env["TAKOSUMI_SANDBOX_RW_PATHS"],
        )
        .env("TAKOSUMI_WORK_DIR", work)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?)
}

/// A Capsule that drifts without a cloud: a `null_resource` whose trigger reads an
/// out-of-band state file (`var.input_state`, written with [`watched_input`]); change that
/// file and the next plan replaces the resource (terraform 1.0.3 has no `terraform_data`).
pub const WATCHED_CONFIG: &str = r#"
variable "input_state" { type = string }
data "terraform_remote_state" "input" {
  backend = "local"
  config = { path = var.input_state }
}
resource "null_resource" "watched" {
  triggers = { value = data.terraform_remote_state.input.outputs.value }
}
"#;

/// The out-of-band state file [`WATCHED_CONFIG`] reads, with output `value`.
pub fn watched_input(value: &str) -> String {
    serde_json::json!({
        "version": 4, "terraform_version": "1.0.3", "serial": 1, "lineage": "takosumi-test-input",
        "outputs": { "value": { "value": value, "type": "string" } }, "resources": []
    })
    .to_string()
}

impl Stack {
    /// A new Workspace (a random name) with one Capsule `name` of `repo`'s `dir` on
    /// `main`, run with terraform, with `vars` (a JSON object; anything else is none).
    pub async fn new_capsule(
        &self,
        repo: &GitRepo,
        name: &str,
        dir: &str,
        vars: serde_json::Value,
    ) -> anyhow::Result<takosumi_client::Capsule> {
        let ws = self
            .client
            .create_workspace(&format!("ws-{}", &short_id()[..8]))
            .await?;
        let req = takosumi_client::NewCapsule {
            name: name.into(),
            source: takosumi_client::Source {
                repo: repo.url(),
                branch: "main".into(),
            },
            dir: dir.into(),
            tool: "terraform".into(),
            vars: vars.as_object().cloned().unwrap_or_default(),
        };
        Ok(self.client.create_capsule(ws.id, &req).await?)
    }

    /// The Apply Run the gate proposed from `plan` (an install's, a webhook's automatic
    /// update), once there is one: within 90 s, or an error.
    pub async fn proposed_apply(
        &self,
        cap: &takosumi_client::Capsule,
        plan: RunId,
    ) -> anyhow::Result<RunId> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let page = self
                .client
                .list_runs(
                    cap.workspace_id,
                    &takosumi_client::RunQuery {
                        capsule: Some(cap.id),
                        kind: Some(takosumi_core::RunKind::Apply),
                        limit: Some(100),
                        ..takosumi_client::RunQuery::default()
                    },
                )
                .await?;
            if let Some(r) = page.runs.iter().find(|r| r.plan_run_id == Some(plan)) {
                return Ok(r.id);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the gate proposed no apply from {plan}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Plans `capsule`, applies that plan, and returns both finished Runs, asserting the
    /// plan `planned` and the apply `applied`.
    pub async fn plan_and_apply(
        &self,
        capsule: takosumi_core::CapsuleId,
    ) -> anyhow::Result<(takosumi_client::Run, takosumi_client::Run)> {
        let plan = self.wait(self.client.plan(capsule, None).await?.id).await?;
        anyhow::ensure!(
            plan.status == takosumi_core::RunStatus::Planned,
            "the plan did not plan: {plan:?}"
        );
        let apply = self
            .wait(self.client.apply(plan.id, None).await?.id)
            .await?;
        anyhow::ensure!(
            apply.status == takosumi_core::RunStatus::Applied,
            "the apply did not apply: {apply:?}"
        );
        Ok((plan, apply))
    }
}

/// A `.tf` file of comments that makes a saved plan about `mib` MiB: the plan file carries
/// the configuration, and this text is incompressible (base64 of a hash chain), so
/// deflate keeps about 3/4 of it (measured: 8,204,000 bytes of such text gave a
/// 6,187,492-byte plan).
pub fn plan_filler(mib: u64) -> String {
    use base64::Engine as _;
    use sha2::Digest;
    let mut big = String::from("# filler: the saved plan carries the configuration\n");
    let mut block = [0u8; 32];
    let mut line = Vec::with_capacity(96 * 48);
    for i in 0u64..(mib * 1024 * 1024 / 32) {
        block = sha2::Sha256::digest([&block[..], &i.to_le_bytes()].concat()).into();
        line.extend_from_slice(&block);
        if line.len() >= 48 * 32 {
            big.push_str("# ");
            big.push_str(&base64::engine::general_purpose::STANDARD.encode(&line));
            big.push('\n');
            line.clear();
        }
    }
    big
}

/// Host pids of processes whose command line is exactly `argv`.
pub fn processes_exactly(argv: &[&str]) -> Vec<u32> {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want)
                })
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                        !s.rsplit(')')
                            .next()
                            .unwrap_or("")
                            .trim_start()
                            .starts_with('Z')
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leftover_is_known_by_the_process_in_its_name() {
        assert_eq!(
            owner_pid("takosumi_t_4242_0123456789ab", DB_PREFIX),
            Some(4242)
        );
        assert_eq!(owner_pid("t_17_0123456789ab", VHOST_PREFIX), Some(17));
        assert_eq!(owner_pid("t-17-0123456789ab", BUCKET_PREFIX), Some(17));
        // a bucket of the fixture before buckets carried the process: not known as one
        assert_eq!(owner_pid("t-0123456789ab", BUCKET_PREFIX), None);
        assert_eq!(owner_pid("t_17_0123456789ab", BUCKET_PREFIX), None);
        // names of the fixture before it named its process, and anything else: not ours
        assert_eq!(owner_pid("takosumi_t_0123456789ab", DB_PREFIX), None);
        assert_eq!(owner_pid("t_abc_0123", VHOST_PREFIX), None);
        assert_eq!(owner_pid("t_12_", VHOST_PREFIX), None);
        assert_eq!(owner_pid("takosumi", DB_PREFIX), None);
        assert_eq!(owner_pid("/", VHOST_PREFIX), None);
    }
}
