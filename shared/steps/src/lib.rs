//! The pipelines, written once so both executors keep the same rules: what a plan, a destroy plan and a drift check
//! do with the tool, from the checkout to the saved plan, whether the control node or a
//! relay worker executes them. Only where inputs come from and where progress and
//! results go differ; that is the [`PlanHost`] each side implements (the control node:
//! Postgres, S3 and the seal key; the relay worker: the API with its pool token).
//!
//! A seed rule implemented here holds on both paths: drift checks plan with
//! `-detailed-exitcode`; a pull request's plan that the dry-run scan flags is refused;
//! the approval rule's dry-run hold is asked before `init` and `plan` run anything; the
//! lockfile is read right after `init`; the saved plan is kept before `show -json` starts
//! any provider; failures carry a [`FailureCode`].

use std::future::Future;

use serde_json::{Value, json};
use takosumi_core::{EventKind, FailureCode, RunKind, sha256_hex};
use takosumi_policy::scan::ScanReport;
use takosumi_runner::{
    Masker, Runner, RunnerError, SourceSnapshot, Tool, ToolEnv, ToolOutput, Workdir,
};

/// What a plan pipeline runs on: the Capsule's source, the Run's kind, and whether it is a
/// pull request's (speculative) plan.
#[derive(Debug, Clone)]
pub struct PlanInputs {
    /// plan, destroy or drift_check.
    pub kind: RunKind,
    /// The Capsule's tool.
    pub tool: Tool,
    /// Repository URL.
    pub repo: String,
    /// Branch to check out.
    pub branch: String,
    /// A pinned commit (a webhook's, a drift check's applied commit), if any.
    pub commit: Option<String>,
    /// The Capsule's directory.
    pub dir: String,
    /// A pull request's plan: refused when the dry-run scan finds anything.
    pub speculative: bool,
}

/// What the host decided after the dry-run scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanVerdict {
    /// Plan on.
    Proceed,
    /// The Run is held for a person (the approval rule's dry-run hold); nothing more runs.
    Held,
}

/// Where a pipeline's inputs come from and its progress goes: what every pipeline needs
/// of its host.
pub trait Host: Sync {
    /// The host's own failure (a database, the API), passed through untouched.
    type Error: Send;

    /// Records an event on the Run; a failure to record is the host's to log.
    fn event(&self, kind: EventKind, data: Value) -> impl Future<Output = ()> + Send;

    /// Stores tool output, masked with `masker`.
    fn log(
        &self,
        step: &'static str,
        masker: &Masker,
        text: &str,
    ) -> impl Future<Output = ()> + Send;

    /// Puts the Capsule's current state where the backend override reads it; returns the
    /// bytes restored (an apply compares the state it leaves with them).
    fn restore_state(
        &self,
        runner: &Runner,
        wd: &Workdir,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, Self::Error>> + Send;

    /// The tool's environment (variables, sensitive variables, credentials), every secret
    /// in its masker. Asked while a plan's checkout runs (it must not read the checkout), before
    /// any tool starts.
    fn tool_env(&self, wd: &Workdir) -> impl Future<Output = Result<ToolEnv, Self::Error>> + Send;

    /// Waits for the host's hold on the Run, for a host that takes it beside the checkout
    /// rather than before the pipeline starts (the control node's plan claim: its round
    /// trip and commit then overlap git's sandbox start). Nothing is reported, restored or
    /// resolved before it answers; an error (the Run is not this host's) stops the pipeline
    /// once the checkout has ended, with nothing reported. The default: the Run is held
    /// already.
    fn claimed(&self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }
}

/// What a plan pipeline needs of its host besides [`Host`].
pub trait PlanHost: Host {
    /// Records the dry-run scan report on the Run (its audit evidence), as soon as it is
    /// made: a plan refused for it keeps it too. Reports the `dry_run_scan` event with it
    /// (the report is its data): a host that writes both at once saves a round trip.
    fn record_scan(&self, report: &Value) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Keeps the provider lockfile read right after `init` (`None`: a provider-free run)
    /// before the plan runs: the control node stores it and reads it back, and a refusal
    /// ends the Run before the tool plans.
    fn keep_lockfile(
        &self,
        lockfile: Option<&[u8]>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Keeps the saved plan file (`size` bytes at the run directory's `plan_path()`) once
    /// the plan wrote it and before `show -json` runs: `show` starts the configuration's
    /// providers, which could rewrite the file while it runs. Kept here, the plan that is
    /// sealed (and later applied) is the one `show` then reads and the reviewer sees; read
    /// after `show`, it could be another.
    fn keep_plan_file(
        &self,
        wd: &Workdir,
        size: u64,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Stores what [`Self::keep_plan_file`] kept, while `show -json` runs: only what is
    /// read from the plan file must precede `show`, not the upload. A host that sends the
    /// plan later keeps the default, which does nothing.
    fn store_kept_plan(&self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Decides whether the plan runs now (the approval rule's dry-run hold). A hold binds
    /// the commit and the module tree the scan read (`report.modules_digest`): once
    /// released, the plan runs exactly those, never modules nobody scanned.
    fn after_scan(
        &self,
        report: &ScanReport,
        commit: &str,
    ) -> impl Future<Output = Result<ScanVerdict, Self::Error>> + Send;
}

/// What a pinned apply needs of its host besides [`Host`].
pub trait ApplyHost: Host {
    /// Puts the reviewed saved plan at the run directory's `plan_path()`, checked against
    /// its digest (a failure names the pin), and reports that pin. Runs beside the checkout,
    /// which neither reads nor writes the plan file: its fetch and unsealing do not delay git.
    fn place_plan(&self, wd: &Workdir) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Installs the provider lockfile the plan recorded into the Capsule directory, before
    /// init; returns its digest (`None`: the plan was provider-free).
    fn install_lockfile(
        &self,
        wd: &Workdir,
    ) -> impl Future<Output = Result<Option<String>, Self::Error>> + Send;

    /// The saved plan's `show -json` as its plan sealed it, when this host has it: the
    /// apply then learns the plan's sensitive values without starting the tool a second
    /// time. `None` runs `show -json` on the saved plan instead. Asked while `init` runs.
    fn plan_show(&self) -> impl Future<Output = Option<Value>> + Send;

    /// Called once the apply tool has run (whatever its result): the saved plan is used up.
    /// Runs beside the local plan file's wipe and the storing of the tool's output.
    fn after_tool(&self) -> impl Future<Output = ()> + Send;
}

/// Why a pipeline stopped.
#[derive(Debug)]
pub enum PlanError<E> {
    /// The Run fails with this code and message (for a person: what to do next).
    Fail(FailureCode, String),
    /// The runner failed in a way that names no Run failure (I/O, unreadable JSON): the
    /// host decides (retry, or fail on our side).
    Runner(RunnerError),
    /// The host failed.
    Host(E),
    /// The apply tool ran (it may have changed infrastructure) but did not end normally
    /// (stopped at its time limit): the outcome is unknown, never "nothing was applied".
    AfterTool(String),
}

/// What a finished plan pipeline hands the host to commit.
pub struct PlanOutput {
    /// The commit that was executed and the tree digest.
    pub source: SourceSnapshot,
    /// `version -json`.
    pub tool_version: Value,
    /// Digest of the installed module tree.
    pub modules_digest: String,
    /// The dry-run scan report (audit evidence).
    pub scan_report: Value,
    /// The lockfile's raw bytes right after `init`, `None` for a provider-free run.
    pub lockfile: Option<Vec<u8>>,
    /// `show -json` of the saved plan (holds sensitive values: seal it).
    pub show: Value,
    /// The saved plan's size in bytes. The file itself stays at the run directory's
    /// `plan_path()` for the host to seal and store (or hand over); dropping the
    /// directory wipes it.
    pub plan_size: u64,
    /// A drift check's answer from `-detailed-exitcode` (exit 2), `None` otherwise.
    pub tool_says_drift: Option<bool>,
    /// Names of every injected variable.
    pub injected_env_names: Vec<String>,
    /// The environment's masker: every credential, sensitive variable and value the plan
    /// marks sensitive.
    pub masker: Masker,
}

/// How a plan pipeline ended.
pub enum Planned {
    /// The tool planned; commit this.
    Done(Box<PlanOutput>),
    /// The host held the Run after the dry-run scan.
    Held,
}

/// A runner error as the Run's failure when it names one (`what` says what was being
/// done), else passed to the host.
pub fn tool_failure<E>(e: RunnerError, what: &str) -> PlanError<E> {
    match e.failure_code() {
        Some(code) => PlanError::Fail(code, format!("{what}: {e}; see the run's logs")),
        None => PlanError::Runner(e),
    }
}

/// Runs `work` while `kind` is recorded: the event's round trip does not delay the work, and
/// whatever is reported next still follows it (both are done when this returns). Only for
/// events that are progress, not evidence a later decision reads.
async fn beside_event<H: Host, T>(
    host: &H,
    kind: EventKind,
    data: Value,
    work: impl Future<Output = T>,
) -> T {
    let ((), out) = tokio::join!(host.event(kind, data), work);
    out
}

/// Runs a tool command while its `tool_started` event is recorded (see [`beside_event`]).
async fn tool_started<H: Host, T>(host: &H, command: &str, work: impl Future<Output = T>) -> T {
    beside_event(
        host,
        EventKind::ToolStarted,
        json!({ "command": command }),
        work,
    )
    .await
}

async fn log_result<H: Host>(
    host: &H,
    step: &'static str,
    masker: &Masker,
    result: &Result<ToolOutput, RunnerError>,
) {
    match result {
        Ok(out) => host.log(step, masker, &out.output).await,
        Err(RunnerError::ToolFailed { output, .. }) => host.log(step, masker, output).await,
        Err(_) => {}
    }
}

/// The checkout, and beside it (neither reads the checkout) the Capsule's state restored
/// (its bytes returned) and the tool's environment (every secret in its masker); then the
/// backend override (written into the checked-out directory) and the tool's version. All
/// before any module or provider is installed.
///
/// Reports `checkout_started` (with `started`), then `environment_prepared` (the host's),
/// then `checked_out`: in this order on every host, however the two overlap, and all after
/// [`Host::claimed`] answered (the checkout does not wait for it).
async fn checkout_and_prepare<H: Host>(
    host: &H,
    runner: &Runner,
    wd: &Workdir,
    tool: Tool,
    (repo, branch, commit, dir): (&str, &str, Option<&str>, &str),
    started: Value,
) -> Result<(SourceSnapshot, Option<Vec<u8>>, ToolEnv, Value), PlanError<H::Error>> {
    let fetch = async {
        runner
            .checkout(wd, repo, branch, commit, dir)
            .await
            .map_err(|e| tool_failure(e, "checking out the source failed"))
    };
    // `checkout_started` is written while git already works; it still precedes the
    // `environment_prepared` this future reports.
    // Outer error: the Run is not the host's. Inner: preparing it failed.
    let beside = async {
        host.claimed().await?;
        host.event(EventKind::CheckoutStarted, started).await;
        // The step's tool sandbox starts beside the checkout's, not after it, and not
        // before it either: a process start holds the thread that makes it, so started
        // first it would delay git's, which everything after waits for. By the time the
        // event is written git's sandbox is on its way; this one is ready long before
        // `init` needs it.
        runner.start_step_sandbox(wd);
        let prepared = async {
            let restored = host
                .restore_state(runner, wd)
                .await
                .map_err(PlanError::Host)?;
            let env = host.tool_env(wd).await.map_err(PlanError::Host)?;
            Ok((restored, env))
        };
        Ok(prepared.await)
    };
    // Boxed: the two futures inline make a step's future type too deep for the compiler.
    // Both run to their end (a failed checkout does not cut `checkout_started` short);
    // a Run the host does not hold ends here whatever else happened, and otherwise the
    // checkout's error is the one reported.
    let (source, beside) = tokio::join!(Box::pin(fetch), Box::pin(beside));
    let beside = beside.map_err(PlanError::Host)?;
    let (source, (restored, env)) = (source?, beside?);
    let tool_version = beside_event(
        host,
        EventKind::CheckedOut,
        json!({ "commit": source.commit, "treeDigest": source.tree_digest }),
        async {
            runner
                .write_backend_override(wd)
                .map_err(|e| tool_failure(e, "writing the backend override"))?;
            runner
                .version(tool, &env)
                .await
                .map_err(|e| tool_failure(e, "reading the tool version"))
        },
    )
    .await?;
    Ok((source, restored, env, tool_version))
}

/// Plan, destroy plan or drift check: checkout (state and environment beside it) → backend
/// override → version → modules → dry-run scan (refusal, hold) → init → lockfile → plan →
/// the saved plan kept → `show -json` (the kept plan stored beside it).
pub async fn plan<H: PlanHost>(
    host: &H,
    runner: &Runner,
    wd: &Workdir,
    inputs: &PlanInputs,
) -> Result<Planned, PlanError<H::Error>> {
    let tool = inputs.tool;
    let (source, _, env, tool_version) = checkout_and_prepare(
        host,
        runner,
        wd,
        tool,
        (
            &inputs.repo,
            &inputs.branch,
            inputs.commit.as_deref(),
            &inputs.dir,
        ),
        json!({ "branch": inputs.branch, "commit": inputs.commit }),
    )
    .await?;
    let masker = env.masker();

    // Modules are downloaded once, here, into the private checkout (a committed
    // `.terraform` was removed by the checkout); init then resolves nothing again. A
    // configuration that calls no module skips `get` (one tool start less), and the
    // apply skips it the same way, so the digests agree wherever each ran.
    if takosumi_runner::declares_module_calls(wd.config_dir()) {
        let got = tool_started(host, "get", runner.get_modules(wd, tool, &env)).await;
        log_result(host, "get", masker, &got).await;
        got.map_err(|e| tool_failure(e, "downloading modules failed"))?;
    }
    let modules_digest = takosumi_runner::module_tree_digest(wd.config_dir())
        .map_err(|e| tool_failure(e, "reading the installed modules"))?;

    // The dry-run scan reads the configuration and every module `get` installed for data
    // sources that act when planned; its report is the plan's audit evidence, and a pull
    // request's plan that declares one (or cannot be read in full) is refused, not run.
    let modules_dir = wd.config_dir().join(".terraform").join("modules");
    let report = takosumi_policy::scan::scan_in_checkout(
        wd.checkout(),
        wd.config_dir(),
        modules_dir.is_dir().then_some(modules_dir.as_path()),
    );
    let mut report = report;
    // what the scan read: the report is evidence of exactly this module tree
    report.modules_digest = Some(modules_digest.clone());
    let scan_report = report.to_json();
    host.record_scan(&scan_report)
        .await
        .map_err(PlanError::Host)?;
    if inputs.speculative && !report.is_clean() {
        let named: Vec<String> = report
            .findings
            .iter()
            .map(|f| f.address.clone())
            .chain(report.unreadable.iter().map(|u| u.what.clone()))
            .collect();
        return Err(PlanError::Fail(
            FailureCode::DryRunScanRefused,
            format!(
                "a pull request's plan is refused rather than run: {} may act when planned or could not be read; review it and plan it from the branch once merged",
                named.join(", ")
            ),
        ));
    }
    // Under the approval rule a plan plans freely only when the scan is clean; otherwise
    // the host holds it here, before init and plan run anything.
    if host
        .after_scan(&report, &source.commit)
        .await
        .map_err(PlanError::Host)?
        == ScanVerdict::Held
    {
        return Ok(Planned::Held);
    }

    let init = tool_started(host, "init", runner.init_without_get(wd, tool, &env)).await;
    // A failed init's output is stored here; a successful one's beside the lockfile below.
    if init.is_err() {
        log_result(host, "init", masker, &init).await;
    }
    let init = init.map_err(|e| tool_failure(e, "init failed"))?;

    // Lockfile continuity: the raw bytes right after init, or an explicit null.
    let lockfile = match runner.read_lockfile(wd) {
        Ok(l) => l,
        Err(e) => {
            host.log("init", masker, &init.output).await;
            return Err(match e {
                RunnerError::LockfileTooLarge { .. } => {
                    PlanError::Fail(FailureCode::LockfileTooLarge, e.to_string())
                }
                e => tool_failure(e, "reading the provider lockfile"),
            });
        }
    };
    // init's output is stored while the lockfile is kept: neither waits for the other.
    let ((), kept) = tokio::join!(
        host.log("init", masker, &init.output),
        host.keep_lockfile(lockfile.as_deref())
    );
    kept.map_err(PlanError::Host)?;

    let destroy = inputs.kind == RunKind::Destroy;
    let drift_check = inputs.kind == RunKind::DriftCheck;
    // A drift check asks the tool itself whether anything would change (exit code 2 of
    // `-detailed-exitcode`); `show -json` then says what.
    let mut tool_says_drift = None;
    let planned = beside_event(
        host,
        EventKind::ToolStarted,
        json!({ "command": "plan", "destroy": destroy, "detailedExitcode": drift_check }),
        async {
            if drift_check {
                runner
                    .plan_detailed(wd, tool, &env)
                    .await
                    .map(|(out, changes)| {
                        tool_says_drift = Some(changes);
                        out
                    })
            } else {
                runner.plan(wd, tool, &env, destroy).await
            }
        },
    )
    .await;
    if planned.is_err() {
        log_result(host, "plan", masker, &planned).await;
    }
    let planned = planned.map_err(|e| tool_failure(e, "plan failed"))?;
    let plan_size = runner
        .plan_file_size(wd)
        .map_err(|e| tool_failure(e, "reading the saved plan file"))?;
    host.keep_plan_file(wd, plan_size)
        .await
        .map_err(PlanError::Host)?;
    let (stored, show) = tokio::join!(host.store_kept_plan(), runner.show_json(wd, tool, &env));
    stored.map_err(PlanError::Host)?;
    // The plan printed before `show -json` could name its sensitive values: they join the
    // masker first, and the plan's output is stored after.
    if let Ok(show) = &show {
        masker.add_plan_sensitive(show);
    }
    host.log("plan", masker, &planned.output).await;
    let show = show.map_err(|e| tool_failure(e, "reading the saved plan"))?;
    Ok(Planned::Done(Box::new(PlanOutput {
        source,
        tool_version,
        modules_digest,
        scan_report,
        lockfile,
        show,
        plan_size,
        tool_says_drift,
        injected_env_names: env.names(),
        masker: masker.clone(),
    })))
}

/// What a pinned apply runs: the plan's commit and tree and its dependency snapshot. The
/// host puts the saved plan at the run directory's `plan_path()` (its digest checked
/// against the reviewed one, [`ApplyHost::place_plan`]); the pipeline wipes it once the
/// tool ran.
pub struct ApplyInputs {
    /// The Capsule's tool.
    pub tool: Tool,
    /// Repository URL.
    pub repo: String,
    /// Branch the commit is on.
    pub branch: String,
    /// The plan's commit.
    pub commit: String,
    /// The plan's tree digest.
    pub tree_digest: String,
    /// The Capsule's directory.
    pub dir: String,
    /// The plan's dependency snapshot (`None`: made by an older runner; refused).
    pub dependency_snapshot: Option<String>,
    /// The plan Run's kind (a drift check's plan is a reconcile).
    pub plan_kind: RunKind,
    /// The reviewed plan's digest, which the host checked the saved plan against.
    pub plan_digest: String,
}

/// What the apply tool did, for the host to record.
pub struct ApplyOutput {
    /// The tool's result (its exit code and masked output).
    pub applied: ToolOutput,
    /// The state restored before the tool ran.
    pub restored: Option<Vec<u8>>,
    /// The environment, its masker holding every secret (to mask the outputs).
    pub env: ToolEnv,
}

/// How an apply ended, read right after the tool ran.
#[derive(Debug)]
pub enum ApplyEnd {
    /// It applied: these are its public outputs (non-sensitive, masked).
    Applied {
        /// The outputs.
        outputs: Value,
    },
    /// The tool failed with this exit code.
    Failed {
        /// The exit code.
        exit_code: i32,
    },
    /// The tool applied, but its outputs could not be read or are too large to record
    /// ([`takosumi_runner::MAX_OUTPUTS_BYTES`]): the Run fails after the state
    /// it wrote is recorded ("a lifecycle failure after apply can leave the applied state
    /// current").
    OutputsUnreadable {
        /// What failed (masked).
        message: String,
    },
}

/// What an apply left: the state the tool wrote (when it differs from the one restored,
/// `None` otherwise) and how it ended. Read once, here, for both hosts; the state is read
/// first, so a failure after it cannot lose it. The outputs come from that state file (the
/// map `output -json` would print, without starting the tool again).
pub fn read_apply_result(
    runner: &Runner,
    wd: &Workdir,
    out: &ApplyOutput,
) -> Result<(Option<Vec<u8>>, ApplyEnd), RunnerError> {
    let state = runner.read_state(wd)?;
    if !out.applied.success() {
        let changed = state.filter(|s| Some(s) != out.restored.as_ref());
        return Ok((
            changed,
            ApplyEnd::Failed {
                exit_code: out.applied.exit_code,
            },
        ));
    }
    let end = applied_outputs(state.as_deref(), out.env.masker());
    let changed = state.filter(|s| Some(s) != out.restored.as_ref());
    Ok((changed, end))
}

/// The public outputs of a successful apply, from the state it left (none without a state).
fn applied_outputs(state: Option<&[u8]>, masker: &Masker) -> ApplyEnd {
    let outputs = match state.map(takosumi_runner::state_outputs).transpose() {
        Ok(outputs) => outputs.unwrap_or_default(),
        // Only where it failed: serde's own message can quote a string of the state.
        Err(e) => {
            return ApplyEnd::OutputsUnreadable {
                message: format!(
                    "reading the outputs from the state the apply wrote failed ({:?} error at line {}, column {})",
                    e.classify(),
                    e.line(),
                    e.column()
                ),
            };
        }
    };
    let mut public = Value::Object(takosumi_runner::public_outputs(&outputs));
    // An output built from a secret the configuration does not mark sensitive.
    masker.mask_json(&mut public);
    let size = public.to_string().len();
    if size > takosumi_runner::MAX_OUTPUTS_BYTES {
        return ApplyEnd::OutputsUnreadable {
            message: format!(
                "the outputs are {size} bytes as JSON, more than the {} a Run record keeps",
                takosumi_runner::MAX_OUTPUTS_BYTES
            ),
        };
    }
    ApplyEnd::Applied { outputs: public }
}

/// A pinned apply: the reviewed plan file placed (its digest checked), and beside it the
/// plan's commit and tree checked out; the state (its generation) restored and the
/// environment prepared beside the checkout too, as a plan does → backend override → the
/// plan's lockfile → the plan's modules (`dependency_changed` unless they digest to the
/// plan's snapshot) → init (`lockfile_mismatch` if it changed the lockfile) → the saved
/// plan's sensitive values into the masker → `apply <plan>`.
///
/// Pins are reported in one order on every host: `planDigest` (the host's), then
/// `environment_prepared`, then `sourceSnapshot`, then `dependencySnapshot`. A pin the
/// host checks beside the checkout fails the Run before a checkout's failure does.
pub async fn apply<H: ApplyHost>(
    host: &H,
    runner: &Runner,
    wd: &Workdir,
    inputs: ApplyInputs,
) -> Result<ApplyOutput, PlanError<H::Error>> {
    let tool = inputs.tool;
    // The tool's sandbox is set up while git runs. Started just before the checkout, its
    // start delays git's a little (a plan starts it once its first event is written, see
    // `checkout_and_prepare`); an apply writes nothing before its checkout.
    runner.start_step_sandbox(wd);
    let checkout = runner.checkout(
        wd,
        &inputs.repo,
        &inputs.branch,
        Some(&inputs.commit),
        &inputs.dir,
    );
    // Nothing here reads the checkout: the plan file, the state and the environment each
    // have their own place in the run directory (see `checkout_and_prepare`).
    let beside = async {
        host.place_plan(wd).await?;
        let restored = host.restore_state(runner, wd).await?;
        let env = host.tool_env(wd).await?;
        Ok((restored, env))
    };
    // Boxed: the two futures inline make a step's future type too deep for the compiler.
    let (source, beside) = tokio::join!(Box::pin(checkout), Box::pin(beside));
    let (restored, env) = beside.map_err(PlanError::Host)?;
    let source = match source {
        Ok(s) => s,
        Err(e @ RunnerError::CommitNotFound(_)) => {
            return Err(PlanError::Fail(
                FailureCode::SourceChanged,
                format!("{e}; plan again from the current branch"),
            ));
        }
        Err(e) => return Err(tool_failure(e, "checking out the planned commit failed")),
    };
    if source.commit != inputs.commit || source.tree_digest != inputs.tree_digest {
        return Err(PlanError::Fail(
            FailureCode::SourceChanged,
            "the checked-out source differs from the plan's; plan again".into(),
        ));
    }
    let expected_lock = beside_event(
        host,
        EventKind::PinChecked,
        json!({ "pin": "sourceSnapshot", "commit": inputs.commit }),
        async {
            runner
                .write_backend_override(wd)
                .map_err(|e| tool_failure(e, "writing the backend override"))?;
            host.install_lockfile(wd).await.map_err(PlanError::Host)
        },
    )
    .await?;
    let masker = env.masker();

    // The plan's modules, downloaded again and accepted only when they digest (with the
    // lock digest) to the plan's dependency snapshot: a module source that moved since
    // the plan is caught here, before init, so nothing is applied.
    let Some(planned) = inputs.dependency_snapshot.as_deref() else {
        return Err(PlanError::Fail(
            FailureCode::DependencyChanged,
            "the plan has no dependency snapshot (made by an older runner); nothing was applied; plan again".into(),
        ));
    };
    if takosumi_runner::declares_module_calls(wd.config_dir()) {
        let got = tool_started(host, "get", runner.get_modules(wd, tool, &env)).await;
        log_result(host, "get", masker, &got).await;
        match got {
            Ok(_) => {}
            Err(RunnerError::ToolFailed { .. }) => {
                return Err(PlanError::Fail(
                    FailureCode::DependencyChanged,
                    "the modules the plan used could not be downloaded again (see the run's logs); nothing was applied; plan again".into(),
                ));
            }
            Err(e) => return Err(tool_failure(e, "downloading modules failed")),
        }
    }
    let modules = takosumi_runner::module_tree_digest(wd.config_dir())
        .map_err(|e| tool_failure(e, "reading the installed modules"))?;
    if dependency_snapshot(&modules, expected_lock.as_deref()) != planned {
        return Err(PlanError::Fail(
            FailureCode::DependencyChanged,
            "the modules downloaded for this apply differ from the ones the plan used (a module source changed since the plan); nothing was applied; plan again".into(),
        ));
    }
    // init starts once the pin holds; the pin and init's start are recorded beside it, in
    // that order. The plan's sealed `show -json` is read meanwhile (neither needs the other).
    let recorded = async {
        host.event(
            EventKind::PinChecked,
            json!({ "pin": "dependencySnapshot", "dependencySnapshot": planned }),
        )
        .await;
        host.event(EventKind::ToolStarted, json!({ "command": "init" }))
            .await;
    };
    let ((), init, sealed_show) = tokio::join!(
        recorded,
        runner.init_without_get(wd, tool, &env),
        host.plan_show()
    );
    log_result(host, "init", masker, &init).await;
    init.map_err(|e| tool_failure(e, "init failed"))?;
    let lock_after = runner
        .read_lockfile(wd)
        .map_err(|e| tool_failure(e, "reading the provider lockfile"))?;
    if lock_after.as_deref().map(sha256_hex) != expected_lock {
        return Err(PlanError::Fail(
            FailureCode::LockfileMismatch,
            "init changed the provider lockfile the plan recorded; plan again".into(),
        ));
    }

    // Everything the saved plan marks sensitive joins the masker before apply prints: from
    // the plan's own sealed `show -json` when the host has it, else from the tool.
    let show = match sealed_show {
        Some(show) => show,
        None => {
            // `show` starts the configuration's providers, which could rewrite the saved
            // plan while they run: what `apply` reads must still be the file the host
            // verified against the reviewed digest.
            let show = runner.show_json(wd, tool, &env).await.map_err(|e| match e.failure_code() {
                Some(_) => PlanError::Fail(
                    FailureCode::ApplyFailed,
                    format!("reading the saved plan before applying failed: {e}; nothing was applied; plan again"),
                ),
                None => PlanError::Runner(e),
            })?;
            let after = runner
                .read_plan_file(wd)
                .map_err(|e| tool_failure(e, "reading the saved plan after show"))?;
            if sha256_hex(&after) != inputs.plan_digest {
                return Err(PlanError::Fail(
                    FailureCode::ApplyFailed,
                    "the saved plan changed while `show -json` ran (something the configuration started rewrote it); nothing was applied; plan again".into(),
                ));
            }
            show
        }
    };
    masker.add_plan_sensitive(&show);
    drop(show);
    host.event(EventKind::ToolStarted, json!({ "command": "apply" }))
        .await;
    let applied = runner.apply(wd, tool, &env).await;
    // The plan is used up: the local file's wipe (a sync to the disk), the host's and the
    // tool's output stored, side by side; all are done before anything is recorded.
    let wipe = async {
        let _ = runner.wipe_plan_file_async(wd).await;
    };
    let log = async {
        if let Ok(a) = &applied {
            host.log("apply", masker, &a.output).await;
        }
    };
    tokio::join!(wipe, host.after_tool(), log);
    let applied = match applied {
        Ok(a) => a,
        // Killed mid-run at its time limit: it may have changed infrastructure.
        Err(RunnerError::TimedOut { limit_secs, .. }) => {
            return Err(apply_timed_out(limit_secs));
        }
        Err(e) => return Err(PlanError::Runner(e)),
    };
    if !applied.success() && takosumi_runner::is_stale_plan(&applied) {
        return Err(PlanError::Fail(
            FailureCode::StalePlan,
            format!(
                "the tool refused the saved plan as stale (the state changed after the plan); nothing was applied; {}",
                takosumi_core::stale_plan_advice(inputs.plan_kind)
            ),
        ));
    }
    Ok(ApplyOutput {
        applied,
        restored,
        env,
    })
}

/// The dependency snapshot: a digest over the module tree digest and the provider lock
/// digest (`null` for a provider-free run). A plan records it; an apply must match it.
pub fn dependency_snapshot(modules_digest: &str, lock_digest: Option<&str>) -> String {
    sha256_hex(
        format!(
            "modules:{modules_digest}\nlock:{}",
            lock_digest.unwrap_or("null")
        )
        .as_bytes(),
    )
}

/// An apply killed at its time limit may have changed infrastructure: its outcome is unknown.
fn apply_timed_out<E>(limit_secs: u64) -> PlanError<E> {
    PlanError::AfterTool(format!(
        "the apply ran past its time limit of {limit_secs} s (TAKOSUMI_LIMIT_APPLY_SECS) and was stopped mid-run: what it changed is unknown; inspect the provider side and the Capsule's current StateVersion, then resolve this Run"
    ))
}

/// Whether a saved plan would change anything: a resource action other than no-op/read,
/// or an output change.
pub fn drift_found(show: &Value) -> bool {
    let resources = show["resource_changes"].as_array().is_some_and(|rcs| {
        rcs.iter().any(|rc| {
            rc["change"]["actions"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|x| !matches!(x.as_str(), Some("no-op") | Some("read")))
            })
        })
    });
    let outputs = show["output_changes"].as_object().is_some_and(|o| {
        o.values().any(|c| {
            c["actions"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x.as_str() != Some("no-op")))
        })
    });
    resources || outputs
}

/// A drift check's verdict: drift when the tool's exit code says the plan changes
/// something, or `show -json` does; either one saying so counts, so a disagreement can
/// never hide drift. `None` for other kinds.
pub fn drift_verdict(tool_says_drift: Option<bool>, show: &Value) -> Option<bool> {
    tool_says_drift.map(|tool| tool || drift_found(show))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_is_either_the_tool_or_the_plan_json() {
        let no_op = json!({ "resource_changes": [{ "change": { "actions": ["no-op"] } }] });
        let replace =
            json!({ "resource_changes": [{ "change": { "actions": ["delete", "create"] } }] });
        let output = json!({ "output_changes": { "vpc": { "actions": ["update"] } } });
        assert!(!drift_found(&no_op));
        assert!(drift_found(&replace));
        assert!(drift_found(&output));
        assert_eq!(drift_verdict(None, &replace), None);
        assert_eq!(drift_verdict(Some(false), &no_op), Some(false));
        assert_eq!(drift_verdict(Some(true), &no_op), Some(true));
        assert_eq!(drift_verdict(Some(false), &replace), Some(true));
    }

    #[test]
    fn unreadable_outputs_never_quote_the_state() {
        // serde's own message would quote this string ("invalid type: string …").
        let canary = br#""canary-d81f3a-secret""#;
        let ApplyEnd::OutputsUnreadable { message } = applied_outputs(Some(canary), &Masker::new())
        else {
            panic!("a state that is a JSON string has no readable outputs")
        };
        assert!(!message.contains("canary-d81f3a-secret"), "{message}");
        assert!(message.contains("line 1"), "{message}");
        let ApplyEnd::Applied { outputs } = applied_outputs(None, &Masker::new()) else {
            panic!("no state: no outputs")
        };
        assert_eq!(outputs, json!({}));
    }
}

/// What a one-step apply runs: the Capsule's branch as it is.
#[derive(Debug, Clone)]
pub struct OneStepInputs {
    /// The Capsule's tool.
    pub tool: Tool,
    /// Repository URL.
    pub repo: String,
    /// Branch whose head is applied.
    pub branch: String,
    /// The Capsule's directory.
    pub dir: String,
}

/// What a one-step apply ran, recorded before the tool applies (names only, never values).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OneStepRecord {
    /// The commit applied.
    pub commit: String,
    /// Its tree digest.
    pub tree_digest: String,
    /// `version -json`.
    pub tool_version: Value,
    /// SHA-256 of the lockfile after init (`None`: no lockfile).
    pub provider_lock_digest: Option<String>,
    /// Every injected variable's name.
    pub injected_env_names: Vec<String>,
}

/// What a one-step apply needs of its host besides [`Host`].
pub trait OneStepHost: Host {
    /// Records what is about to be applied; the tool starts only after it is recorded.
    fn record_one_step(
        &self,
        record: &OneStepRecord,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// The one-step apply (an apply no rule covers, seed: "still runs apply -auto-approve"),
/// written once for both hosts: the branch head (state and environment beside it) → backend
/// override → version → plain `init` → the lockfile's digest → the record → `apply -auto-approve`.
/// Nothing is saved in between and nothing is compared with a plan: there is none.
pub async fn one_step_apply<H: OneStepHost>(
    host: &H,
    runner: &Runner,
    wd: &Workdir,
    inputs: &OneStepInputs,
) -> Result<ApplyOutput, PlanError<H::Error>> {
    let tool = inputs.tool;
    let (source, restored, env, tool_version) = checkout_and_prepare(
        host,
        runner,
        wd,
        tool,
        (&inputs.repo, &inputs.branch, None, &inputs.dir),
        json!({ "branch": inputs.branch, "oneStep": true }),
    )
    .await?;
    let masker = env.masker();
    host.event(EventKind::ToolStarted, json!({ "command": "init" }))
        .await;
    let init = runner.init(wd, tool, &env).await;
    log_result(host, "init", masker, &init).await;
    init.map_err(|e| tool_failure(e, "init failed"))?;
    let provider_lock_digest = match runner.read_lockfile(wd) {
        Ok(l) => l.as_deref().map(sha256_hex),
        Err(e @ RunnerError::LockfileTooLarge { .. }) => {
            return Err(PlanError::Fail(
                FailureCode::LockfileTooLarge,
                e.to_string(),
            ));
        }
        Err(e) => return Err(PlanError::Runner(e)),
    };
    host.record_one_step(&OneStepRecord {
        commit: source.commit.clone(),
        tree_digest: source.tree_digest.clone(),
        tool_version,
        provider_lock_digest,
        injected_env_names: env.names(),
    })
    .await
    .map_err(PlanError::Host)?;
    host.event(
        EventKind::ToolStarted,
        json!({ "command": "apply", "oneStep": true, "autoApprove": true, "savedPlan": false }),
    )
    .await;
    let applied = match runner.apply_auto_approve(wd, tool, &env).await {
        Ok(a) => a,
        Err(RunnerError::TimedOut { limit_secs, .. }) => {
            return Err(apply_timed_out(limit_secs));
        }
        Err(e) => return Err(PlanError::Runner(e)),
    };
    host.log("apply", masker, &applied.output).await;
    Ok(ApplyOutput {
        applied,
        restored,
        env,
    })
}
