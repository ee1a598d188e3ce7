//! The relay worker: runs a worker pool's plans, drift checks and gated applies
//! on the team's own machine, next to its clouds, and reaches the control plane **only**
//! through the API, authenticated with the pool token. It has no database URL and no
//! object-store credentials: it claims its pool's next job over HTTP, checks the source
//! out itself (the repository is the team's; only its URL, branch and pinned commit come
//! from the job), opens what the job carries sealed to the pool's delivery key (the state,
//! credentials, sensitive variables, and for an apply the saved plan file) with the
//! private key only its machine holds, runs the real tool through `takosumi-runner`,
//! streams masked logs and events back, and hands back results: a plan's saved plan file
//! (the control node seals it with the server key) and `show -json`; an apply's new state
//! (the control node seals it and moves the generation with its compare-and-set).
//!
//! It must never log a secret, and never send one anywhere but the endpoint it belongs to.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use base64::Engine as _;
use serde::Serialize;
use serde::de::{DeserializeOwned, IgnoredAny};
use serde_json::{Value, json};
use takosumi_core::{EventKind, RunKind, Secret};
use takosumi_policy::scan::ScanReport;
use takosumi_runner::{Masker, Runner, Tool, ToolEnv, Workdir};
use takosumi_seal::Purpose;
use takosumi_seal::delivery::{DeliveryKeyPair, open_with_any};
use takosumi_steps::{PlanInputs, Planned, ScanVerdict};
use takosumi_wire::relay::{
    AppliedReport, ApplyJob, ClaimAnswer, ClaimRequest, ErrorBody, FailReport, JobName, JobWork,
    LogChunk, NamedClaim, OneStepJob, PlanJob, PlannedReport, ProgressAnswer, ProgressReport,
    RelayJob, RelaySecrets, ScanAnswer, ScanResult, WorkerEvent,
};
use takosumi_wire::{Code, ErrorCode};
use tokio_util::sync::CancellationToken;
use zeroize::Zeroize;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// What a relay worker is configured with.
#[derive(Debug)]
pub struct RelaySettings {
    /// The API's base URL (`TAKOSUMI_DEPLOY_CONTROL_URL`).
    pub api_url: String,
    /// The pool token (`TAKOSUMI_POOL_TOKEN`).
    pub token: Secret<String>,
    /// The delivery key pairs this worker holds, current first (`TAKOSUMI_DELIVERY_KEYS`:
    /// `id=<base64 private key>[,id=<…>]`).
    pub keys: Vec<DeliveryKeyPair>,
    /// Runs the tool inside the sandbox ([`takosumi_runner::RunnerConfig::from_settings`]).
    pub runner: Runner,
}

impl RelaySettings {
    /// Reads the process environment. Refuses to start with a control-plane secret in it
    /// (database or broker URL, object-store credentials, the seal or evidence key), given
    /// directly or as a `_FILE`: a relay worker must not need them, and must not hold them.
    pub fn from_env() -> anyhow::Result<Self> {
        for forbidden in [
            "TAKOSUMI_DATABASE_URL",
            "TAKOSUMI_AMQP_URL",
            "TAKOSUMI_S3_SECRET_KEY",
            "TAKOSUMI_S3_ACCESS_KEY",
            "TAKOSUMI_SEAL_KEY",
            "TAKOSUMI_EVIDENCE_KEY",
        ] {
            for name in [forbidden.to_owned(), format!("{forbidden}_FILE")] {
                anyhow::ensure!(
                    std::env::var_os(&name).is_none(),
                    "{name} is set: a relay worker talks only to the API; unset it"
                );
            }
        }
        let vars: std::collections::HashMap<String, String> = std::env::vars()
            // PATH: where the tools are looked up (RunnerConfig::from_settings)
            .filter(|(k, _)| k.starts_with("TAKOSUMI_") || k == "PATH")
            .collect();
        let get = |k: &str| vars.get(k).filter(|v| !v.is_empty()).cloned();
        let secret = |k: &str| takosumi_core::read_secret(&vars, k).map_err(anyhow::Error::msg);
        let api_url = get("TAKOSUMI_DEPLOY_CONTROL_URL")
            .ok_or_else(|| anyhow::anyhow!("TAKOSUMI_DEPLOY_CONTROL_URL is not set"))?;
        let token = Secret::new(secret("TAKOSUMI_POOL_TOKEN")?.ok_or_else(|| {
            anyhow::anyhow!("TAKOSUMI_POOL_TOKEN (or TAKOSUMI_POOL_TOKEN_FILE) is not set")
        })?);
        let keys = match secret("TAKOSUMI_DELIVERY_KEYS")? {
            None => Vec::new(),
            Some(mut text) => {
                let parsed = parse_keys(&text);
                text.zeroize();
                parsed?
            }
        };
        // The same runner settings as the control node's (one reading, in the runner).
        let runner = Runner::new(
            takosumi_runner::RunnerConfig::from_settings(get)
                .map_err(|p| anyhow::anyhow!("invalid settings: {}", p.join("; ")))?,
        );
        Ok(Self {
            api_url: api_url.trim_end_matches('/').to_owned(),
            token,
            keys,
            runner,
        })
    }
}

/// Parses `id=<base64 private key>[,id=<…>]`. Errors name the key id, never the key.
pub fn parse_keys(text: &str) -> anyhow::Result<Vec<DeliveryKeyPair>> {
    let mut keys = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, b64) = part
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("TAKOSUMI_DELIVERY_KEYS entries are id=<base64>"))?;
        let mut raw = B64
            .decode(b64.trim())
            .map_err(|_| anyhow::anyhow!("delivery key {id:?} is not base64"))?;
        let pair = DeliveryKeyPair::from_private(id.trim(), &raw);
        raw.zeroize();
        keys.push(pair.map_err(|e| anyhow::anyhow!("delivery key {id:?}: {e}"))?);
    }
    Ok(keys)
}

/// The API, as a pool sees it.
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
    base: String,
    token: Secret<String>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").field("base", &self.base).finish()
    }
}

/// An API answer that is not a success: the status and the `{code, message}` body.
#[derive(Debug, thiserror::Error)]
#[error("{status} {code}: {message}")]
pub struct ApiRefusal {
    /// HTTP status.
    pub status: u16,
    /// The stable code (`unknown` when the body was not the API's).
    pub code: Code,
    /// The message.
    pub message: String,
}

impl Api {
    /// A client for `base` with the pool token.
    pub fn new(base: &str, token: Secret<String>) -> anyhow::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()?,
            base: base.trim_end_matches('/').to_owned(),
            token,
        })
    }

    async fn send<A: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> anyhow::Result<A> {
        let body = self.send_raw(req).await?;
        serde_json::from_slice(&body)
            .map_err(|e| anyhow::anyhow!("the API's answer does not read as expected: {e}"))
    }

    /// A success's body, or the refusal.
    async fn send_raw(&self, req: reqwest::RequestBuilder) -> anyhow::Result<Vec<u8>> {
        let resp = req.bearer_auth(self.token.expose()).send().await?;
        let status = resp.status();
        let body = resp.bytes().await?.to_vec();
        if status.is_success() {
            return Ok(body);
        }
        // A refusal that is not the API's own (a proxy's page) still ends as a refusal.
        let refusal: Option<ErrorBody> = serde_json::from_slice(&body).ok();
        Err(ApiRefusal {
            status: status.as_u16(),
            code: refusal
                .as_ref()
                .map_or_else(|| Code::Other("unknown".to_owned()), |r| r.code.clone()),
            message: refusal.map(|r| r.message).unwrap_or_default(),
        }
        .into())
    }

    /// Claims the pool's next job, waiting up to `wait_secs` for one.
    pub async fn claim(
        &self,
        key_ids: &[String],
        wait_secs: u64,
        sandbox: takosumi_runner::SandboxMode,
    ) -> anyhow::Result<Option<Claimed>> {
        let request = ClaimRequest {
            delivery_key_ids: key_ids.to_vec(),
            wait_secs,
            sandbox: Some(sandbox.as_str().to_owned()),
        };
        let body = self
            .send_raw(
                self.http
                    .post(format!("{}/api/v1/relay/claim", self.base))
                    .json(&request),
            )
            .await?;
        match serde_json::from_slice::<ClaimAnswer>(&body) {
            Ok(answer) => Ok(answer.job.map(|j| Claimed::Job(Box::new(j)))),
            Err(e) => match serde_json::from_slice::<NamedClaim>(&body) {
                Ok(NamedClaim { job: Some(name) }) => Ok(Some(Claimed::Unreadable {
                    name,
                    reason: e.to_string(),
                })),
                _ => Err(anyhow::anyhow!("the claim's answer does not read: {e}")),
            },
        }
    }

    fn run_url(&self, run: &str, what: &str) -> String {
        format!("{}/api/v1/relay/runs/{run}/{what}", self.base)
    }

    /// Posts a report to a Run's relay endpoint under `claim`; `A` is the answer's type
    /// ([`IgnoredAny`] where the worker reads nothing of it).
    pub async fn post<A: DeserializeOwned>(
        &self,
        run: &str,
        claim: &str,
        what: &str,
        body: &impl Serialize,
    ) -> anyhow::Result<A> {
        self.send(
            self.http
                .post(self.run_url(run, what))
                .header("x-takosumi-claim", claim)
                .json(body),
        )
        .await
    }

    /// Uploads the saved plan file; over `max` only its size is sent (the control node
    /// refuses it and fails the Run with the size and the limit).
    pub async fn put_plan(
        &self,
        run: &str,
        claim: &str,
        size: u64,
        bytes: Option<Vec<u8>>,
    ) -> anyhow::Result<IgnoredAny> {
        // An oversized plan is declared by its size alone, never sent.
        let req = self
            .http
            .put(self.run_url(run, "plan-file"))
            .header("x-takosumi-claim", claim)
            .header("x-takosumi-plan-size", size.to_string())
            .header("content-type", "application/octet-stream")
            .body(bytes.unwrap_or_default());
        self.send(req).await
    }
}

/// What a claim brought.
#[derive(Debug)]
pub enum Claimed {
    /// A job to work on.
    Job(Box<RelayJob>),
    /// A job this worker cannot read in full (an API newer or older than the worker): its
    /// Run is failed at once with the reason.
    Unreadable {
        /// Which Run, under which claim.
        name: JobName,
        /// What does not decode.
        reason: String,
    },
}

/// Why a job ended without a result: the code and message the Run fails with.
#[derive(Debug)]
struct JobFailure {
    code: &'static str,
    message: String,
}

/// Not a code the worker reports: the apply tool ran and its outcome is unknown. The
/// worker reports nothing more (never "failed, nothing applied"); the lease runs out and
/// the control node's reaper ends the apply `unknown_outcome`, as for a vanished worker.
const UNKNOWN_OUTCOME: &str = "unknown_outcome";

fn failure(code: &'static str, message: impl Into<String>) -> JobFailure {
    JobFailure {
        code,
        message: message.into(),
    }
}

impl From<takosumi_steps::PlanError<JobFailure>> for JobFailure {
    fn from(e: takosumi_steps::PlanError<JobFailure>) -> Self {
        match e {
            takosumi_steps::PlanError::Fail(code, message) => failure(code.as_str(), message),
            takosumi_steps::PlanError::Runner(e) => internal(e),
            takosumi_steps::PlanError::Host(f) => f,
            takosumi_steps::PlanError::AfterTool(message) => failure(UNKNOWN_OUTCOME, message),
        }
    }
}

/// One claimed job being worked on.
struct Job<'a> {
    api: &'a Api,
    run: String,
    claim: String,
    /// Progress the API has not answered yet (see [`Unsent`]): sent ahead of the next
    /// progress, and before the job's final report. Held while progress is sent, so the
    /// Run's record keeps the order it happened in.
    unsent: tokio::sync::Mutex<Unsent>,
}

/// The claim's numbered progress reports whose answer the worker has not seen, oldest
/// first. Each keeps its number when sent again: the API stores a number once, so a report
/// that did arrive (its answer lost) is not recorded twice, and one that did not is.
#[derive(Debug, Default)]
struct Unsent {
    /// The number the last report made got (the first is 1).
    last_seq: u64,
    queue: std::collections::VecDeque<ProgressReport>,
}

impl Unsent {
    /// Numbers `report` and puts it last.
    fn push(&mut self, mut report: ProgressReport) {
        self.last_seq += 1;
        report.seq = Some(self.last_seq);
        self.queue.push_back(report);
    }
}

/// At most this much progress waits for an API that does not answer; beyond it the oldest
/// reports are dropped (with a warning): the lease (60 s) bounds how long the API can be away.
const MAX_UNSENT_EVENTS: usize = 256;
const MAX_UNSENT_LOG_BYTES: usize = 512 * 1024;

impl<'a> Job<'a> {
    fn new(api: &'a Api, run: String, claim: String) -> Self {
        Self {
            api,
            run,
            claim,
            unsent: tokio::sync::Mutex::new(Unsent::default()),
        }
    }

    async fn progress(&self, report: &ProgressReport) -> anyhow::Result<ProgressAnswer> {
        self.api
            .post(&self.run, &self.claim, "progress", report)
            .await
    }

    /// Sends `report` after whatever progress the API has not answered before, in order.
    /// What the API did not answer, or could not serve now, waits to be sent again (with
    /// its number, so it is stored once whether or not the first copy arrived); what the
    /// API refused is dropped with a warning (it would be refused again).
    async fn send_progress(&self, report: ProgressReport, what: &str) {
        let mut unsent = self.unsent.lock().await;
        unsent.push(report);
        while let Some(next) = unsent.queue.front() {
            match self.progress(next).await {
                Ok(_) => {}
                Err(e) if worth_reporting_again(&e) => {
                    tracing::warn!(run = %self.run, error = %e, "no answer to a progress report ({what}); kept to send it again");
                    bound_unsent(&self.run, &mut unsent.queue);
                    return;
                }
                Err(e) => {
                    tracing::warn!(run = %self.run, error = %e, "the API refused a progress report; it is dropped");
                }
            }
            unsent.queue.pop_front();
        }
    }

    /// Sends the progress the API has not answered, again for a while if it still does
    /// not: called before the job's final report, so the Run's record has everything the
    /// worker saw, and in order. What still does not go through is dropped, and the report
    /// goes on (it matters more).
    async fn flush_progress(&self) {
        let mut unsent = self.unsent.lock().await;
        while let Some(next) = unsent.queue.pop_front() {
            let send = || self.progress(&next);
            if let Err(e) = send
                .retry(report_backoff())
                .sleep(tokio::time::sleep)
                .when(worth_reporting_again)
                .await
            {
                let (events, logs) = unsent
                    .queue
                    .iter()
                    .fold((next.events.len(), next.logs.len()), |(e, l), r| {
                        (e + r.events.len(), l + r.logs.len())
                    });
                if worth_reporting_again(&e) {
                    tracing::warn!(run = %self.run, error = %e, events, logs, "progress the API never took is dropped");
                    unsent.queue.clear();
                    return;
                }
                tracing::warn!(run = %self.run, error = %e, events = next.events.len(), logs = next.logs.len(), "the API refused a progress report; it is dropped");
            }
        }
    }

    async fn event(&self, kind: EventKind, data: Value) {
        // The API refuses a whole report with any other kind (`invalid_event`).
        debug_assert!(
            kind.reported_by_worker(),
            "a relay worker reported {kind}, which only the control node records"
        );
        let report = ProgressReport {
            events: vec![WorkerEvent::new(kind, data)],
            ..ProgressReport::default()
        };
        self.send_progress(report, "event").await;
    }

    async fn log(&self, step: &str, masker: &Masker, text: &str) {
        if text.is_empty() {
            return;
        }
        let report = ProgressReport {
            logs: vec![LogChunk {
                step: step.to_owned(),
                text: masker.mask(text),
            }],
            ..ProgressReport::default()
        };
        self.send_progress(report, "log").await;
    }

    /// Renews the lease until aborted (every call to `progress` renews it); `lost` fires
    /// when the control node says the claim is no longer this worker's (the tool is
    /// interrupted then too), `cancel` when someone asked to cancel the Run.
    fn keep_lease(
        &self,
        every: Duration,
        cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let (api, run, claim, token) = (
            self.api.clone(),
            self.run.clone(),
            self.claim.clone(),
            cancel,
        );
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let answer = api
                    .post::<ProgressAnswer>(&run, &claim, "progress", &ProgressReport::default())
                    .await;
                match answer {
                    Ok(a) if !a.lease_renewed => {
                        token.cancel();
                        return;
                    }
                    Ok(a) if a.cancel_requested => {
                        tracing::info!(%run, "cancel requested: interrupting the tool");
                        token.cancel();
                    }
                    Ok(_) => {}
                    Err(e) => {
                        if e.downcast_ref::<ApiRefusal>().is_some() {
                            token.cancel();
                            return;
                        }
                        tracing::warn!(%run, error = %e, "lease renewal failed; will retry");
                    }
                }
            }
        })
    }
}

/// Runs jobs until `shutdown`, or with `once` (an idle limit) one job at most: it returns
/// after that job, or when none came within the limit. Each claim long-polls; a broken
/// connection backs off.
pub async fn run(
    settings: RelaySettings,
    once: Option<Duration>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let started = tokio::time::Instant::now();
    // Before any claim: a worker whose sandbox cannot work here must not take a job.
    settings.runner.start_up().await?;
    let api = Api::new(&settings.api_url, settings.token.clone())?;
    let key_ids: Vec<String> = settings
        .keys
        .iter()
        .map(|k| k.key_id().to_owned())
        .collect();
    let mut backoff = Duration::from_millis(250);
    while !shutdown.is_cancelled() {
        let claimed = tokio::select! {
            c = api.claim(&key_ids, 5, settings.runner.sandbox_mode()) => c,
            () = shutdown.cancelled() => break,
        };
        match claimed {
            Ok(Some(claimed)) => {
                backoff = Duration::from_millis(250);
                let (run, done) = match claimed {
                    Claimed::Job(job) => {
                        let run = job.run_id;
                        tracing::info!(%run, kind = job.work.kind().as_str(), "claimed a job");
                        (run, work(&api, &settings, &job).await)
                    }
                    Claimed::Unreadable { name, reason } => {
                        tracing::error!(run = %name.run_id, %reason, "claimed a job this worker cannot read");
                        (name.run_id, fail_unreadable(&api, &name, &reason).await)
                    }
                };
                if let Err(e) = done {
                    tracing::error!(%run, error = %e, "job ended with an error");
                }
                if once.is_some() {
                    break;
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %e, "claim failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
        if once.is_some_and(|idle| started.elapsed() >= idle) {
            tracing::info!("--once: no job came; exiting");
            break;
        }
    }
    Ok(())
}

/// Fails the Run of a job this worker cannot read, rather than leave it to its lease.
async fn fail_unreadable(api: &Api, name: &JobName, reason: &str) -> anyhow::Result<()> {
    let report = FailReport {
        code: "invalid_configuration".to_owned(),
        message: format!(
            "the relay worker cannot read the job ({reason}); run a relay worker of the API's version and submit the run again"
        ),
    };
    api.post::<IgnoredAny>(&name.run_id.to_string(), &name.claim, "fail", &report)
        .await?;
    Ok(())
}

/// Works one claimed job to its end: a result or a failure reported to the control node.
pub async fn work(api: &Api, settings: &RelaySettings, job: &RelayJob) -> anyhow::Result<()> {
    let job_ref = Job::new(api, job.run_id.to_string(), job.claim.clone());
    // Every 2 s: renews the lease (60 s) and notices a cancel request about as fast as the
    // control node's own handlers do (1 s).
    let cancel = CancellationToken::new();
    let keeper = job_ref.keep_lease(Duration::from_secs(2), cancel.clone());
    let runner = settings.runner.interruptible(cancel.clone());
    let wd = runner.workdir(&job_ref.run)?;
    let result = match &job.work {
        JobWork::Plan(p) => plan(&job_ref, settings, &runner, job, p, &wd).await,
        JobWork::Apply(a) => apply(&job_ref, settings, &runner, job, Pinned::Plan(a), &wd).await,
        JobWork::OneStep(o) => {
            apply(&job_ref, settings, &runner, job, Pinned::OneStep(o), &wd).await
        }
    };
    keeper.abort();
    let _ = wd.close();
    // A plan's or apply's own report flushed it already; a failure's report is next.
    job_ref.flush_progress().await;
    if cancel.is_cancelled() && result.is_err() {
        // The tool was interrupted (or never started): the Run ends `canceled` if a cancel
        // was requested; a lost claim answers `not_your_claim` and there is nothing to do.
        match api
            .post::<IgnoredAny>(&job_ref.run, &job_ref.claim, "canceled", &json!({}))
            .await
        {
            Ok(_) => {
                tracing::info!(run = %job_ref.run, "job canceled");
                return Ok(());
            }
            Err(e) => tracing::info!(run = %job_ref.run, error = %e, "not ended as canceled"),
        }
    }
    match result {
        Ok(()) => Ok(()),
        Err(f) if f.code == UNKNOWN_OUTCOME => {
            tracing::warn!(run = %job_ref.run, reason = %f.message, "apply outcome unknown: reporting nothing; the lease runs out and the control node ends it unknown_outcome");
            Ok(())
        }
        Err(f) => {
            tracing::info!(run = %job_ref.run, code = f.code, "job failed");
            let report = FailReport {
                code: f.code.to_owned(),
                message: f.message,
            };
            api.post::<IgnoredAny>(&job_ref.run, &job_ref.claim, "fail", &report)
                .await?;
            Ok(())
        }
    }
}

/// Opens a base64 delivery envelope of the job with this worker's keys. A plan (or state,
/// or credentials) sealed to a key the worker does not hold fails the Run with
/// `delivery_key_unopenable`: never silently.
fn open(
    settings: &RelaySettings,
    job: &RelayJob,
    field: &str,
    sealed: Option<&str>,
    purpose: Purpose,
) -> Result<Option<Vec<u8>>, JobFailure> {
    let Some(b64) = sealed else {
        return Ok(None);
    };
    let run = job.run_id.to_string();
    let sealed = B64.decode(b64).map_err(|_| {
        failure(
            "delivery_key_unopenable",
            format!("the job's {field} is not base64"),
        )
    })?;
    open_with_any(&settings.keys, purpose, &run, &sealed)
        .map(Some)
        .map_err(|e| {
            failure(
                "delivery_key_unopenable",
                format!("the job's {field} does not open on this worker ({e}); load the pool's current delivery key, then submit the run again"),
            )
        })
}

/// The tool environment: the job's variables, and the secrets it delivered sealed.
async fn tool_env(
    settings: &RelaySettings,
    runner: &Runner,
    wd: &Workdir,
    job: &RelayJob,
) -> Result<ToolEnv, JobFailure> {
    let mut env = ToolEnv::new()
        .with_variables(&job.vars)
        .map_err(|e| failure("invalid_configuration", e.to_string()))?;
    let sealed = job.secrets.as_deref();
    if let Some(mut plain) = open(settings, job, "secrets", sealed, Purpose::Credential)? {
        let parsed: Result<RelaySecrets, _> = serde_json::from_slice(&plain);
        plain.zeroize();
        // Not the decoding error: serde's may quote the value it could not read.
        let secrets = parsed.map_err(|_| {
            failure(
                "credential_failed",
                "the delivered credentials are not readable",
            )
        })?;
        if let Some(sv) = &secrets.sensitive_vars {
            env = env
                .with_sensitive_variables(sv)
                .map_err(|e| failure("invalid_configuration", e.to_string()))?;
        }
        for (k, v) in secrets.env {
            env = env.with_secret_env(&k, Secret::new(v));
        }
        // Command credentials run here, in this run's private directory inside the
        // sandbox, exactly as on the control node (the control node checked the name).
        for c in &secrets.commands {
            let value = runner
                .resolve_command(
                    wd,
                    &c.command,
                    &c.env_name,
                    takosumi_runner::CREDENTIAL_COMMAND_TIMEOUT,
                )
                .await
                .map_err(|e| failure("credential_failed", format!("{}: {e}", c.what)))?;
            env = env.with_secret_env(&c.env_name, value);
        }
    }
    Ok(env)
}

/// [`tool_env`], reported as the control node reports it (`environment_prepared`, names
/// only), at the same point of the pipeline.
async fn prepared_env(
    job: &Job<'_>,
    settings: &RelaySettings,
    spec: &RelayJob,
    runner: &Runner,
    wd: &Workdir,
) -> Result<ToolEnv, JobFailure> {
    let env = tool_env(settings, runner, wd, spec).await?;
    job.event(
        EventKind::EnvironmentPrepared,
        json!({ "providerBindings": spec.provider_bindings, "injectedEnvNames": env.names() }),
    )
    .await;
    Ok(env)
}

fn internal(e: impl std::fmt::Display) -> JobFailure {
    failure("plan_failed", format!("the relay worker failed: {e}"))
}

/// The relay worker as the plan pipeline's host: inputs from the job (sealed to this
/// worker's delivery key), progress and decisions through the API.
struct RelayHost<'a> {
    job: &'a Job<'a>,
    settings: &'a RelaySettings,
    spec: &'a RelayJob,
    /// The job's runner (interruptible by a cancel): command credentials run through it.
    runner: &'a Runner,
    /// The largest plan file the job may send (a plan job's limit; 0 otherwise).
    max_plan_bytes: u64,
    /// The plan file as read before `show -json` ran, when within that limit.
    plan_file: std::sync::Mutex<Option<Vec<u8>>>,
}

impl takosumi_steps::Host for RelayHost<'_> {
    type Error = JobFailure;

    async fn event(&self, kind: EventKind, data: Value) {
        self.job.event(kind, data).await;
    }

    async fn log(&self, step: &'static str, masker: &Masker, text: &str) {
        self.job.log(step, masker, text).await;
    }

    async fn restore_state(
        &self,
        runner: &Runner,
        wd: &Workdir,
    ) -> Result<Option<Vec<u8>>, JobFailure> {
        let sealed = self.spec.state.as_deref();
        let state = open(self.settings, self.spec, "state", sealed, Purpose::State)?;
        if let Some(state) = &state {
            runner.restore_state(wd, state).map_err(internal)?;
        }
        Ok(state)
    }

    async fn tool_env(&self, wd: &Workdir) -> Result<ToolEnv, JobFailure> {
        prepared_env(self.job, self.settings, self.spec, self.runner, wd).await
    }
}

impl takosumi_steps::ApplyHost for RelayHost<'_> {
    async fn place_plan(&self, wd: &Workdir) -> Result<(), JobFailure> {
        let JobWork::Apply(work) = &self.spec.work else {
            return Err(internal("a job without a plan has no plan to place"));
        };
        // The saved plan, sealed to this pool's delivery key; it must hash to the reviewed
        // digest.
        let mut plan_bytes = open(
            self.settings,
            self.spec,
            "plan",
            Some(&work.plan),
            Purpose::Plan,
        )?
        .ok_or_else(|| failure("delivery_key_unopenable", "the job carries no plan file"))?;
        if sha256_hex(&plan_bytes) != work.plan_digest {
            plan_bytes.zeroize();
            return Err(failure(
                "stale_plan",
                "the delivered plan does not match the reviewed digest; nothing was applied; plan again",
            ));
        }
        let written = self.runner.write_plan_file(wd, &plan_bytes);
        plan_bytes.zeroize();
        written.map_err(internal)
    }

    async fn install_lockfile(&self, wd: &Workdir) -> Result<Option<String>, JobFailure> {
        // A one-step apply has no plan and so no lockfile of its own.
        let JobWork::Apply(pinned) = &self.spec.work else {
            return Ok(None);
        };
        if let Some(b64) = &pinned.lockfile {
            let bytes = B64.decode(b64).map_err(internal)?;
            std::fs::write(wd.config_dir().join(takosumi_runner::LOCKFILE_NAME), bytes)
                .map_err(internal)?;
        }
        Ok(pinned.provider_lock_digest.clone())
    }

    /// The job does not carry the plan's JSON: the worker runs `show -json` itself.
    async fn plan_show(&self) -> Option<Value> {
        None
    }

    async fn after_tool(&self) {}
}

impl takosumi_steps::OneStepHost for RelayHost<'_> {
    async fn record_one_step(
        &self,
        record: &takosumi_steps::OneStepRecord,
    ) -> Result<(), JobFailure> {
        self.job
            .api
            .post::<IgnoredAny>(&self.job.run, &self.job.claim, "one-step", record)
            .await
            .map_err(|e| {
                failure(
                    "apply_failed",
                    format!("the one-step apply could not be recorded; nothing was applied: {e}"),
                )
            })?;
        Ok(())
    }
}

impl takosumi_steps::PlanHost for RelayHost<'_> {
    async fn record_scan(&self, report: &Value) -> Result<(), JobFailure> {
        // The report as audit evidence, recorded at once (a refused plan keeps it too),
        // while the event is reported.
        let scan_report: ScanReport = serde_json::from_value(report.clone()).map_err(internal)?;
        let body = ScanResult {
            scan_report,
            commit: None,
        };
        let recorded =
            self.job
                .api
                .post::<IgnoredAny>(&self.job.run, &self.job.claim, "scanned", &body);
        let ((), recorded) = tokio::join!(
            self.job.event(EventKind::DryRunScan, report.clone()),
            recorded
        );
        recorded.map_err(internal)?;
        Ok(())
    }

    async fn keep_plan_file(&self, wd: &Workdir, size: u64) -> Result<(), JobFailure> {
        // Only a plan within the relay's limit is read into memory (and sent).
        if size <= self.max_plan_bytes {
            let bytes = self.runner.read_plan_file(wd).map_err(internal)?;
            *self
                .plan_file
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(bytes);
        }
        Ok(())
    }

    async fn keep_lockfile(&self, _lockfile: Option<&[u8]>) -> Result<(), JobFailure> {
        // It crosses with the plan: the control node stores and reads it back at commit.
        Ok(())
    }

    async fn after_scan(
        &self,
        report: &ScanReport,
        commit: &str,
    ) -> Result<ScanVerdict, JobFailure> {
        let body = ScanResult {
            scan_report: report,
            commit: Some(commit.to_owned()),
        };
        let answer = match self
            .job
            .api
            .post::<ScanAnswer>(&self.job.run, &self.job.claim, "scanned", &body)
            .await
        {
            Ok(answer) => answer,
            // The control node ended the Run with its code (the branch moved after a
            // release): the worker stops, with nothing more to report.
            Err(e)
                if e.downcast_ref::<ApiRefusal>()
                    .is_some_and(|r| r.code != ErrorCode::NotYourClaim) =>
            {
                return Ok(ScanVerdict::Held);
            }
            Err(e) => return Err(internal(e)),
        };
        Ok(if answer.hold {
            ScanVerdict::Held
        } else {
            ScanVerdict::Proceed
        })
    }
}

async fn plan(
    job: &Job<'_>,
    settings: &RelaySettings,
    runner: &Runner,
    spec: &RelayJob,
    work: &PlanJob,
    wd: &Workdir,
) -> Result<(), JobFailure> {
    let kind = work.kind;
    let src = &work.source;
    let inputs = PlanInputs {
        kind,
        tool: spec.tool,
        repo: src.repo.clone(),
        branch: src.branch.clone(),
        commit: src.commit.clone(),
        dir: src.dir.clone(),
        speculative: work.speculative,
    };
    let host = RelayHost {
        job,
        settings,
        spec,
        runner,
        max_plan_bytes: work.max_plan_bytes,
        plan_file: std::sync::Mutex::new(None),
    };
    let out = match takosumi_steps::plan(&host, runner, wd, &inputs).await? {
        // The control node holds the Run for a person; the worker is done with it.
        Planned::Held => return Ok(()),
        Planned::Done(out) => *out,
    };
    let max = work.max_plan_bytes;
    let size = out.plan_size;
    // An oversized drift check still reports what it found; only its plan stays behind.
    let plan_not_kept = (kind == RunKind::DriftCheck && size > max).then_some(size);
    if plan_not_kept.is_none() {
        // What was read before `show` ran; nothing for a plan over the relay's limit.
        let bytes = host
            .plan_file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let put = job.api.put_plan(&job.run, &job.claim, size, bytes).await;
        let _ = runner.wipe_plan_file(wd);
        match put {
            Ok(_) => {}
            // The control node refused it and failed the Run itself (the size and the limit
            // are in its message): nothing more to report.
            Err(e)
                if e.downcast_ref::<ApiRefusal>()
                    .is_some_and(|r| r.code == ErrorCode::PlanTooLarge) =>
            {
                tracing::info!(run = %job.run, "plan file over the relay limit: refused");
                return Ok(());
            }
            Err(e) => return Err(internal(e)),
        }
    }
    let _ = runner.wipe_plan_file(wd);
    let body = PlannedReport {
        source_commit: out.source.commit,
        tree_digest: out.source.tree_digest,
        tool_version: out.tool_version,
        show: out.show,
        lockfile: out.lockfile.map(|l| B64.encode(l)),
        modules_digest: out.modules_digest,
        scan_report: None,
        tool_says_drift: out.tool_says_drift,
        plan_not_kept,
    };
    job.flush_progress().await;
    let posted = job
        .api
        .post::<IgnoredAny>(&job.run, &job.claim, "planned", &body)
        .await;
    match posted {
        Ok(_) => Ok(()),
        // The control node failed the Run with its code (a lockfile that does not read
        // back, …): nothing more to report.
        Err(e)
            if e.downcast_ref::<ApiRefusal>().is_some_and(|r| {
                r.code != ErrorCode::NotYourClaim && r.code != ErrorCode::PlanFileMissing
            }) =>
        {
            tracing::info!(run = %job.run, error = %e, "the control node ended the plan");
            Ok(())
        }
        Err(e) => Err(internal(e)),
    }
}

/// Which apply a job is.
enum Pinned<'a> {
    /// The pinned apply of a delivered, reviewed plan.
    Plan(&'a ApplyJob),
    /// A one-step apply of the branch head.
    OneStep(&'a OneStepJob),
}

async fn apply(
    job: &Job<'_>,
    settings: &RelaySettings,
    runner: &Runner,
    spec: &RelayJob,
    which: Pinned<'_>,
    wd: &Workdir,
) -> Result<(), JobFailure> {
    let tool = spec.tool;
    let host = RelayHost {
        job,
        settings,
        spec,
        runner,
        max_plan_bytes: 0,
        plan_file: std::sync::Mutex::new(None),
    };
    let out = match which {
        Pinned::OneStep(work) => {
            // No rule covers it: the branch head, `apply -auto-approve`, nothing saved.
            let src = &work.source;
            let inputs = takosumi_steps::OneStepInputs {
                tool,
                repo: src.repo.clone(),
                branch: src.branch.clone(),
                dir: src.dir.clone(),
            };
            takosumi_steps::one_step_apply(&host, runner, wd, &inputs).await
        }
        Pinned::Plan(work) => pinned_apply(&host, runner, work, wd, tool).await,
    }
    .map_err(|e| match e {
        takosumi_steps::PlanError::Runner(e) => {
            failure("apply_failed", format!("the tool could not be run: {e}"))
        }
        other => JobFailure::from(other),
    })?;
    report_applied(job, runner, wd, out).await
}

/// The pinned apply of a delivered, reviewed plan.
async fn pinned_apply(
    host: &RelayHost<'_>,
    runner: &Runner,
    work: &ApplyJob,
    wd: &Workdir,
    tool: Tool,
) -> Result<takosumi_steps::ApplyOutput, takosumi_steps::PlanError<JobFailure>> {
    // The delivered plan is placed (and checked) by the pipeline, beside the checkout
    // (RelayHost::place_plan).
    let src = &work.source;
    let inputs = takosumi_steps::ApplyInputs {
        tool,
        repo: src.repo.clone(),
        branch: src.branch.clone(),
        commit: src.commit.clone(),
        tree_digest: src.tree_digest.clone(),
        dir: src.dir.clone(),
        dependency_snapshot: work.dependency_snapshot.clone(),
        // what a stale plan's message advises (a reconcile comes from a new check)
        plan_kind: work.plan_kind,
        plan_digest: work.plan_digest.clone(),
    };
    takosumi_steps::apply(host, runner, wd, inputs).await
}

/// What the apply left, handed back to the control node (which seals and records it).
async fn report_applied(
    job: &Job<'_>,
    runner: &Runner,
    wd: &Workdir,
    out: takosumi_steps::ApplyOutput,
) -> Result<(), JobFailure> {
    let (changed, end) = takosumi_steps::read_apply_result(runner, wd, &out).map_err(|e| {
        failure(
            UNKNOWN_OUTCOME,
            format!("the tool ran, but the state it left could not be read: {e}"),
        )
    })?;
    let (outputs, outputs_error) = match end {
        takosumi_steps::ApplyEnd::Applied { outputs } => (outputs, None),
        takosumi_steps::ApplyEnd::Failed { .. } => (Value::Null, None),
        takosumi_steps::ApplyEnd::OutputsUnreadable { message } => (Value::Null, Some(message)),
    };
    let body = AppliedReport {
        success: out.applied.success(),
        exit_code: Some(out.applied.exit_code),
        state: changed.map(|s| B64.encode(s)),
        outputs,
        outputs_error,
    };
    // The tool has changed infrastructure and only this report carries its new state: an
    // API that is restarting (no answer, or a gateway's 502-504) is asked again for a
    // while. Its lease still ends the wait: once the control node ended the Run, the
    // report is refused and not repeated.
    job.flush_progress().await;
    let send = || {
        job.api
            .post::<IgnoredAny>(&job.run, &job.claim, "applied", &body)
    };
    send.retry(report_backoff())
        .sleep(tokio::time::sleep)
        .when(worth_reporting_again)
        .notify(|e: &anyhow::Error, delay: Duration| {
            tracing::warn!(run = %job.run, error = %e, ?delay, "the API did not take the apply's report yet; sending it again");
        })
        .await
        .map_err(|e| {
            failure(
                UNKNOWN_OUTCOME,
                format!("the tool ran, but its result could not be handed back: {e}"),
            )
        })?;
    Ok(())
}

/// How long an apply's report, and the progress the API missed before any report, are
/// sent again while the API does not answer.
const REPORT_RETRY: Duration = Duration::from_secs(60);

fn report_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(5))
        .with_total_delay(Some(REPORT_RETRY))
        .without_max_times()
}

/// Whether a report that failed may be sent again: the API did not answer (the request
/// may never have arrived), or it (or a gateway in front of it) answered that it cannot
/// serve now (502-504). Any other refusal is final: the same report would be refused
/// again. A report that did arrive and is sent again is refused (the claim is over).
fn worth_reporting_again(e: &anyhow::Error) -> bool {
    match e.downcast_ref::<ApiRefusal>() {
        Some(refusal) => matches!(refusal.status, 502..=504),
        None => e
            .downcast_ref::<reqwest::Error>()
            .is_some_and(|e| e.is_connect() || e.is_timeout() || e.is_request() || e.is_body()),
    }
}

/// Keeps the progress waiting for the API within [`MAX_UNSENT_EVENTS`] and
/// [`MAX_UNSENT_LOG_BYTES`], the oldest reports dropped first (the newest always stays).
fn bound_unsent(run: &str, queue: &mut std::collections::VecDeque<ProgressReport>) {
    let mut events: usize = queue.iter().map(|r| r.events.len()).sum();
    let mut bytes: usize = queue
        .iter()
        .flat_map(|r| &r.logs)
        .map(|l| l.text.len())
        .sum();
    let mut dropped = 0usize;
    while queue.len() > 1 && (events > MAX_UNSENT_EVENTS || bytes > MAX_UNSENT_LOG_BYTES) {
        if let Some(oldest) = queue.pop_front() {
            events -= oldest.events.len();
            bytes -= oldest.logs.iter().map(|l| l.text.len()).sum::<usize>();
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::warn!(%run, dropped, "too much progress waiting for the API; the oldest reports are dropped");
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An apply's report is sent again only when the API did not answer or said it cannot
    /// serve now; its own refusals (the claim is over, the report is bad) are final.
    #[tokio::test]
    async fn only_an_unanswered_report_is_sent_again() {
        for status in [502, 503, 504] {
            assert!(
                worth_reporting_again(&refusal(status, "unknown")),
                "{status}"
            );
        }
        assert!(worth_reporting_again(&refusal(503, "unavailable")));
        for (status, code) in [
            (409, "conflict"),
            (404, "not_found"),
            (400, "invalid_input"),
            (500, "internal"),
        ] {
            assert!(
                !worth_reporting_again(&refusal(status, code)),
                "{status} {code}"
            );
        }
        assert!(!worth_reporting_again(&anyhow::anyhow!(
            "the API's answer does not read as expected"
        )));
        assert!(worth_reporting_again(&unanswered().await));
    }

    /// The API's (or a gateway's) refusal with `status` and `code`.
    fn refusal(status: u16, code: &str) -> anyhow::Error {
        ApiRefusal {
            status,
            code: Code::new(code),
            message: String::new(),
        }
        .into()
    }

    /// A request to a port nothing listens on (1): it never arrived.
    async fn unanswered() -> anyhow::Error {
        reqwest::Client::new()
            .post("http://127.0.0.1:1/api/v1/relay/runs/r/progress")
            .send()
            .await
            .unwrap_err()
            .into()
    }

    /// Reports are numbered in the order they are made, and what waits for the API is
    /// bounded, the oldest reports dropped first, the newest kept whatever its size.
    #[test]
    fn unsent_progress_is_numbered_and_bounded_oldest_first() {
        let mut unsent = Unsent::default();
        for i in 0..MAX_UNSENT_EVENTS + 3 {
            unsent.push(ProgressReport {
                events: vec![WorkerEvent::new(EventKind::ToolStarted, json!({ "i": i }))],
                ..ProgressReport::default()
            });
        }
        assert_eq!(unsent.queue[0].seq, Some(1));
        assert_eq!(unsent.queue[5].seq, Some(6));
        bound_unsent("run_x", &mut unsent.queue);
        assert_eq!(unsent.queue.len(), MAX_UNSENT_EVENTS);
        assert_eq!(unsent.queue[0].events[0].data["i"], json!(3));
        assert_eq!(unsent.queue[0].seq, Some(4));

        let mut unsent = Unsent::default();
        for i in 0..4 {
            unsent.push(ProgressReport {
                logs: vec![LogChunk {
                    step: "apply".into(),
                    text: format!("{i}").repeat(MAX_UNSENT_LOG_BYTES / 3),
                }],
                ..ProgressReport::default()
            });
        }
        bound_unsent("run_x", &mut unsent.queue);
        assert_eq!(unsent.queue.len(), 3);
        assert!(unsent.queue[0].logs[0].text.starts_with('1'));
        assert_eq!(unsent.last_seq, 4);

        let mut unsent = Unsent::default();
        unsent.push(ProgressReport {
            logs: vec![LogChunk {
                step: "apply".into(),
                text: "x".repeat(MAX_UNSENT_LOG_BYTES * 2),
            }],
            ..ProgressReport::default()
        });
        bound_unsent("run_x", &mut unsent.queue);
        assert_eq!(unsent.queue.len(), 1, "the newest report stays");
    }

    /// The key list a worker is started with parses, keeps its order (current first), and
    /// an error names the key id, never the key.
    #[test]
    fn delivery_keys_parse_and_errors_hide_the_key() {
        let a = DeliveryKeyPair::generate("k1").unwrap();
        let b = DeliveryKeyPair::generate("k0").unwrap();
        let text = format!(
            "k1={}, k0={}",
            B64.encode(&a.private_bytes()[..]),
            B64.encode(&b.private_bytes()[..])
        );
        let keys = parse_keys(&text).unwrap();
        assert_eq!(
            keys.iter().map(|k| k.key_id()).collect::<Vec<_>>(),
            ["k1", "k0"]
        );
        assert_eq!(keys[0].public(), a.public());
        let err = parse_keys("k2=c2VjcmV0LWNhbmFyeQ==")
            .unwrap_err()
            .to_string();
        assert!(err.contains("k2") && !err.contains("c2VjcmV0"), "{err}");
    }
}
