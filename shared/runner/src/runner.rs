//! The runner: checkout, backend override, and every tool step.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::process::Command;

use crate::checkout::{DEFAULT_CACHE_TTL, GitCache};
use crate::process::{self, Captured, StdoutMode};
use crate::sandbox::{self, ChildSpec, Prepared, SandboxConfig};
use crate::source;
use crate::workdir::{self, Workdir};
use crate::{Masker, RunnerError, Tool, ToolEnv, ToolOutput};

/// The only PATH a child process gets.
pub const TOOL_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// The file the backend override is written to, in the Capsule directory.
pub const BACKEND_OVERRIDE_FILE: &str = "zz_takosumi_override.tf";
/// The provider lockfile, in the Capsule directory.
pub const LOCKFILE_NAME: &str = ".terraform.lock.hcl";
/// The largest lockfile accepted (inclusive).
pub const MAX_LOCKFILE_BYTES: u64 = 1_048_576;

/// Where the binaries are and where run directories go. Server settings, read once.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// The terraform binary, if this runner has one.
    pub terraform_bin: Option<PathBuf>,
    /// The tofu binary, if this runner has one.
    pub tofu_bin: Option<PathBuf>,
    /// Given to the tool as `TF_CLI_CONFIG_FILE` (e.g. an offline provider mirror).
    pub cli_config_file: Option<PathBuf>,
    /// Private run directories are created under it (created 0700 if missing).
    pub work_root: PathBuf,
    /// The git binary (`git`, looked up on [`TOOL_PATH`]).
    pub git_bin: PathBuf,
    /// How every child is isolated (bubblewrap unless explicitly `none`).
    pub sandbox: SandboxConfig,
    /// Time limits of git and tool steps.
    pub limits: Limits,
    /// Where checkouts keep their bare repositories (`TAKOSUMI_GIT_CACHE_DIR`, default
    /// `work_root/git-cache`; `off` keeps one inside each Run's directory).
    pub git_cache: GitCache,
    /// The in-sandbox launcher ([`crate::launch`], `TAKOSUMI_LAUNCHER_BIN`; by default
    /// `takosumi-launch` beside this process's binary): a step's tool commands then run in
    /// one sandbox start. `None` (`off`, or not installed) starts one sandbox per command.
    pub launcher_bin: Option<PathBuf>,
}

/// How long each kind of step may run before its process group is killed and the run
/// fails `timed_out` (`TAKOSUMI_LIMIT_<STEP>_SECS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Each git command of a checkout (default 5 min).
    pub checkout: Duration,
    /// `init` and `get` (default 10 min).
    pub init: Duration,
    /// `plan` (default 30 min).
    pub plan: Duration,
    /// `apply` (default 2 h).
    pub apply: Duration,
    /// `show`, `output`, `version` (default 10 min).
    pub other: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            checkout: Duration::from_secs(5 * 60),
            init: Duration::from_secs(10 * 60),
            plan: Duration::from_secs(30 * 60),
            apply: Duration::from_secs(2 * 60 * 60),
            other: Duration::from_secs(10 * 60),
        }
    }
}

impl Limits {
    fn for_step(&self, step: &str) -> Duration {
        match step {
            "init" | "get" => self.init,
            "plan" => self.plan,
            "apply" => self.apply,
            _ => self.other,
        }
    }
}

impl RunnerConfig {
    /// A configuration with terraform only, no CLI config, `git` from [`TOOL_PATH`], the
    /// bubblewrap sandbox and the default limits.
    pub fn new(terraform_bin: impl Into<PathBuf>, work_root: impl Into<PathBuf>) -> Self {
        let work_root = work_root.into();
        Self {
            terraform_bin: Some(terraform_bin.into()),
            tofu_bin: None,
            cli_config_file: None,
            git_cache: GitCache::beside(&work_root),
            work_root,
            git_bin: PathBuf::from("git"),
            sandbox: SandboxConfig::default(),
            limits: Limits::default(),
            launcher_bin: installed_launcher(),
        }
    }

    /// Reads the runner's settings (`TAKOSUMI_TERRAFORM_BIN`, `TAKOSUMI_TOFU_BIN`,
    /// `TAKOSUMI_TF_CLI_CONFIG`, `TAKOSUMI_WORK_DIR`, `TAKOSUMI_SANDBOX`,
    /// `TAKOSUMI_BWRAP_BIN`, `TAKOSUMI_SANDBOX_RO_PATHS`, `TAKOSUMI_SANDBOX_RW_PATHS`,
    /// `TAKOSUMI_LIMIT_{CHECKOUT,INIT,PLAN,APPLY,OTHER}_SECS`, `TAKOSUMI_GIT_CACHE_DIR`,
    /// `TAKOSUMI_GIT_CACHE_TTL_SECS`) through `get`; the same on
    /// the control node and on a relay worker. Problems are named, all at once.
    ///
    /// The seed: "the tofu binary must be on the PATH of the process executing runs …
    /// nothing else is configured". Each tool is looked up once, here, on `PATH` (`get`'s,
    /// else this process's): `tofu` and `terraform`; `TAKOSUMI_TOFU_BIN` /
    /// `TAKOSUMI_TERRAFORM_BIN` override the lookup (a bare name is looked up on `PATH`
    /// too). A tool found nowhere is absent: its Capsules fail `invalid_configuration`
    /// saying so.
    pub fn from_settings(get: impl Fn(&str) -> Option<String>) -> Result<Self, Vec<String>> {
        let mut problems = Vec::new();
        let work_root = get("TAKOSUMI_WORK_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                problems.push("TAKOSUMI_WORK_DIR is not set".to_owned());
                PathBuf::new()
            });
        let search: Option<OsString> = get("PATH")
            .map(OsString::from)
            .or_else(|| std::env::var_os("PATH"));
        let mut cfg = Self::new(PathBuf::new(), work_root);
        cfg.terraform_bin = resolve_tool(
            get("TAKOSUMI_TERRAFORM_BIN"),
            "terraform",
            search.as_deref(),
        );
        cfg.tofu_bin = resolve_tool(get("TAKOSUMI_TOFU_BIN"), "tofu", search.as_deref());
        cfg.cli_config_file = get("TAKOSUMI_TF_CLI_CONFIG").map(PathBuf::from);
        if let Some(mode) = get("TAKOSUMI_SANDBOX") {
            // `bwrap`, the binary's name, is accepted as well as the mode's own.
            match if mode == "bwrap" {
                Ok(crate::SandboxMode::Bubblewrap)
            } else {
                mode.parse()
            } {
                Ok(m) => cfg.sandbox.mode = m,
                Err(e) => problems.push(format!("TAKOSUMI_SANDBOX: {e}")),
            }
        }
        match get("TAKOSUMI_LAUNCHER_BIN").as_deref() {
            None => {}
            Some("off") => cfg.launcher_bin = None,
            Some(bin) if Path::new(bin).is_absolute() => cfg.launcher_bin = Some(bin.into()),
            Some(bin) => problems.push(format!(
                "TAKOSUMI_LAUNCHER_BIN must be an absolute path or `off`, not {bin:?}"
            )),
        }
        if let Some(bin) = get("TAKOSUMI_BWRAP_BIN") {
            cfg.sandbox.bwrap_bin = bin.into();
        }
        for (key, slot) in [
            ("TAKOSUMI_SANDBOX_RO_PATHS", &mut cfg.sandbox.ro_paths),
            ("TAKOSUMI_SANDBOX_RW_PATHS", &mut cfg.sandbox.rw_paths),
        ] {
            if let Some(list) = get(key) {
                match sandbox::parse_path_list(&list) {
                    Ok(paths) => *slot = paths,
                    Err(e) => problems.push(format!("{key}: {e}")),
                }
            }
        }
        for (key, slot) in [
            ("TAKOSUMI_LIMIT_CHECKOUT_SECS", &mut cfg.limits.checkout),
            ("TAKOSUMI_LIMIT_INIT_SECS", &mut cfg.limits.init),
            ("TAKOSUMI_LIMIT_PLAN_SECS", &mut cfg.limits.plan),
            ("TAKOSUMI_LIMIT_APPLY_SECS", &mut cfg.limits.apply),
            ("TAKOSUMI_LIMIT_OTHER_SECS", &mut cfg.limits.other),
        ] {
            if let Some(v) = get(key) {
                match v.parse::<u64>() {
                    Ok(secs) if secs > 0 => *slot = Duration::from_secs(secs),
                    _ => problems.push(format!("{key} must be a whole number of seconds above 0")),
                }
            }
        }
        let ttl = match get("TAKOSUMI_GIT_CACHE_TTL_SECS") {
            None => DEFAULT_CACHE_TTL,
            Some(v) => match v.parse::<u64>() {
                Ok(secs) if secs > 0 => Duration::from_secs(secs),
                _ => {
                    problems.push(
                        "TAKOSUMI_GIT_CACHE_TTL_SECS must be a whole number of seconds above 0"
                            .to_owned(),
                    );
                    DEFAULT_CACHE_TTL
                }
            },
        };
        cfg.git_cache = match get("TAKOSUMI_GIT_CACHE_DIR").as_deref() {
            Some("off") => GitCache::PerRun,
            Some(dir) if !Path::new(dir).is_absolute() => {
                problems.push(format!(
                    "TAKOSUMI_GIT_CACHE_DIR must be an absolute directory or `off`, not {dir:?}"
                ));
                GitCache::PerRun
            }
            Some(dir) => GitCache::Shared {
                root: dir.into(),
                ttl,
            },
            None => GitCache::Shared {
                root: cfg.work_root.join("git-cache"),
                ttl,
            },
        };
        if problems.is_empty() {
            Ok(cfg)
        } else {
            Err(problems)
        }
    }

    /// What a child needs to read besides the system: the tool binaries (and what a linked
    /// one points at), the CLI configuration and the provider directories it names.
    fn readable_paths(&self) -> Vec<PathBuf> {
        let mut paths = Vec::new();
        for bin in self.terraform_bin.iter().chain(&self.tofu_bin) {
            paths.push(bin.clone());
            if let Ok(real) = fs::canonicalize(bin)
                && real != *bin
            {
                paths.push(real);
            }
        }
        if let Some(cli) = &self.cli_config_file {
            paths.push(cli.clone());
            paths.extend(sandbox::cli_config_paths(cli));
        }
        paths.retain(|p| p.is_absolute());
        paths
    }
}

/// `takosumi-launch` beside this process's binary (or one directory up: a test binary runs
/// from `target/<profile>/deps`), if it is there.
fn installed_launcher() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join(crate::launch::LAUNCHER_NAME))
        .find(|p| p.is_file())
}

/// Where a tool's binary is: the override as given (a bare name is looked up on `path`),
/// else `name` on `path`; `None` when neither names an executable file.
fn resolve_tool(
    configured: Option<String>,
    name: &str,
    path: Option<&std::ffi::OsStr>,
) -> Option<PathBuf> {
    let wanted = configured.unwrap_or_else(|| name.to_owned());
    if wanted.contains('/') {
        return Some(PathBuf::from(wanted));
    }
    let search = path?;
    std::env::split_paths(search)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(&wanted))
        .find(|candidate| {
            use std::os::unix::fs::PermissionsExt;
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// What was executed: the commit and a digest of the checked-out tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceSnapshot {
    /// The full commit id of HEAD after checkout.
    pub commit: String,
    /// [`crate::tree_digest`] of the checkout after `.terraform` directories were removed.
    pub tree_digest: String,
}

/// Runs git and the tool in private run directories. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Runner {
    cfg: Arc<RunnerConfig>,
    /// [`RunnerConfig::readable_paths`], read once (it parses the CLI configuration).
    readable: Arc<Vec<PathBuf>>,
    /// `version -json` by tool binary (path, size, mtime): every tool start costs ~70 ms
    /// here, and the answer only changes when the binary does.
    versions: Arc<std::sync::Mutex<std::collections::HashMap<BinaryKey, Value>>>,
    /// Fires when the run is canceled: see [`Runner::interruptible`].
    pub(crate) interrupt: Option<tokio_util::sync::CancellationToken>,
    /// Receives logged steps' masked output live: see [`Runner::with_log_tap`].
    pub(crate) tap: Option<Arc<dyn crate::LogTap>>,
    /// When this process last looked for expired Git cache entries.
    cache_collected: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    /// The sandboxes' `/etc`, copied once and bound with one mount.
    etc_view: Arc<crate::etc_view::EtcView>,
}

impl Runner {
    /// A runner with this configuration.
    pub fn new(cfg: RunnerConfig) -> Self {
        // A superseded copy of /etc may still be bound by a sandbox started just before:
        // kept until no step could still be running in it.
        let longest = [
            cfg.limits.checkout,
            cfg.limits.init,
            cfg.limits.plan,
            cfg.limits.apply,
            cfg.limits.other,
        ]
        .into_iter()
        .max()
        .unwrap_or_default();
        Self {
            etc_view: Arc::new(crate::etc_view::EtcView::new(
                &cfg.work_root,
                longest + std::time::Duration::from_secs(15 * 60),
            )),
            readable: Arc::new(cfg.readable_paths()),
            cfg: Arc::new(cfg),
            versions: Arc::default(),
            interrupt: None,
            tap: None,
            cache_collected: Arc::default(),
        }
    }

    /// True at most once per `every` (and on the first call): time to collect the cache.
    pub(crate) fn cache_collection_due(&self, every: Duration) -> bool {
        let mut last = self
            .cache_collected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < every) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// The configuration.
    pub fn config(&self) -> &RunnerConfig {
        &self.cfg
    }

    /// How this runner isolates children (recorded on every Run it executes).
    pub fn sandbox_mode(&self) -> crate::SandboxMode {
        self.cfg.sandbox.mode
    }

    /// Checks at start-up that the sandbox works here, and removes what is left under
    /// `work_root` of runs this process no longer holds (a handler killed mid-run left
    /// them; each run directory belongs to the one process that made it, and a restarted
    /// handler holds none). In `none` mode it logs, loudly, that Capsules run unisolated.
    pub async fn start_up(&self) -> Result<(), RunnerError> {
        let root = &self.cfg.work_root;
        workdir::ensure_work_root(root)?;
        tracing::info!(
            terraform = ?self.cfg.terraform_bin,
            tofu = ?self.cfg.tofu_bin,
            "tools resolved (a Capsule whose tool is absent fails invalid_configuration)"
        );
        let removed = workdir::remove_leftovers(root);
        if removed > 0 {
            tracing::info!(removed, work_root = %root.display(), "removed run directories of runs no longer held");
        }
        match self.cfg.sandbox.mode {
            crate::SandboxMode::None => {
                tracing::warn!(
                    "TAKOSUMI_SANDBOX=none: Capsule code (provisioners, providers, external \
                     programs) runs UNISOLATED as this handler's user and can read its \
                     secrets; every Run records sandbox \"none\""
                );
                Ok(())
            }
            crate::SandboxMode::Bubblewrap => {
                let scratch = tempfile::Builder::new()
                    .prefix(&format!("sandbox-check.{}.", workdir::owner_token()))
                    .tempdir_in(root)
                    .map_err(|e| {
                        RunnerError::io(format!("creating a directory under {}", root.display()), e)
                    })?;
                self.cfg
                    .sandbox
                    .check(scratch.path(), self.etc_view.dir())
                    .await?;
                match &self.cfg.launcher_bin {
                    Some(bin) if !bin.is_file() => Err(RunnerError::SandboxUnavailable(format!(
                        "the step launcher {} is not there: install takosumi-launch beside \
                         the handler, point TAKOSUMI_LAUNCHER_BIN at it, or set it to `off` \
                         (one sandbox start per tool command)",
                        bin.display()
                    ))),
                    Some(bin) => {
                        tracing::info!(launcher = %bin.display(), "a step's tool commands run in one sandbox");
                        Ok(())
                    }
                    None => {
                        tracing::info!(
                            "no step launcher (TAKOSUMI_LAUNCHER_BIN=off or not installed): one sandbox start per tool command"
                        );
                        Ok(())
                    }
                }
            }
        }
    }

    /// A child of a run, inside the sandbox: `writable` is the only directory it may write.
    pub(crate) fn child<S: AsRef<OsStr>>(
        &self,
        program: &Path,
        args: &[S],
        cwd: &Path,
        env: BTreeMap<String, OsString>,
        writable: &Path,
        git_dir: Option<(&Path, bool)>,
    ) -> Prepared {
        self.child_with(program, args, cwd, env, writable, git_dir, None)
    }

    /// [`Self::child`], with the step launcher bound into the sandbox when given.
    #[allow(clippy::too_many_arguments)]
    fn child_with<S: AsRef<OsStr>>(
        &self,
        program: &Path,
        args: &[S],
        cwd: &Path,
        env: BTreeMap<String, OsString>,
        writable: &Path,
        git_dir: Option<(&Path, bool)>,
        launcher: Option<&Path>,
    ) -> Prepared {
        let readable = (*self.readable).clone();
        let etc = match self.cfg.sandbox.mode {
            crate::SandboxMode::Bubblewrap => self.etc_view.dir(),
            crate::SandboxMode::None => None,
        };
        self.cfg.sandbox.command(ChildSpec {
            etc,
            program,
            args: args.iter().map(|a| a.as_ref().to_os_string()).collect(),
            cwd,
            env: env.into_iter().map(|(k, v)| (k.into(), v)).collect(),
            writable,
            readable,
            git_dir,
            launcher,
        })
    }

    /// The binary for `tool`, or [`RunnerError::ToolNotInstalled`].
    pub fn tool_bin(&self, tool: Tool) -> Result<&Path, RunnerError> {
        match tool {
            Tool::Terraform => self
                .cfg
                .terraform_bin
                .as_deref()
                .ok_or(RunnerError::ToolNotInstalled(Tool::Terraform)),
            Tool::Tofu => self
                .cfg
                .tofu_bin
                .as_deref()
                .ok_or(RunnerError::ToolNotInstalled(Tool::Tofu)),
        }
    }

    /// Creates a private 0700 run directory under `work_root` (created if needed) for the
    /// run `label`. It is wiped and removed when the [`Workdir`] is dropped.
    pub fn workdir(&self, label: &str) -> Result<Workdir, RunnerError> {
        Workdir::create(&self.cfg.work_root, label)
    }

    /// Checks a Capsule directory: relative, without `..`, not absolute, no NUL. `""` and
    /// `"."` mean the repository root.
    pub fn validate_dir(dir: &str) -> Result<(), RunnerError> {
        source::validate_dir(dir)
    }

    /// Writes `config_dir/zz_takosumi_override.tf` pointing a `local` backend at
    /// [`Workdir::state_path`], so state stays with Takosumi whatever backend the
    /// repository declares. The path is written relative to the Capsule directory
    /// (`../../state/terraform.tfstate`): a saved plan carries its backend configuration,
    /// and the apply runs in another run directory. Files that would shadow it (`zz_takosumi_override.tofu`, …)
    /// are removed; an override file loaded after it that declares a backend or `cloud`
    /// block is refused ([`RunnerError::InvalidDir`]).
    pub fn write_backend_override(&self, wd: &Workdir) -> Result<(), RunnerError> {
        let dir = wd.config_dir();
        for shadow in [
            "zz_takosumi_override.tf.json",
            "zz_takosumi_override.tofu",
            "zz_takosumi_override.tofu.json",
        ] {
            let path = dir.join(shadow);
            if fs::symlink_metadata(&path).is_ok() {
                fs::remove_file(&path)
                    .map_err(|e| RunnerError::io(format!("removing {}", path.display()), e))?;
            }
        }
        let listing = fs::read_dir(dir)
            .map_err(|e| RunnerError::io(format!("listing {}", dir.display()), e))?;
        for entry in listing {
            let entry =
                entry.map_err(|e| RunnerError::io(format!("listing {}", dir.display()), e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name <= BACKEND_OVERRIDE_FILE || !is_override_file(name) {
                continue;
            }
            let text = fs::read_to_string(entry.path()).unwrap_or_default();
            if declares_backend(&text) {
                return Err(RunnerError::InvalidDir(format!(
                    "{name} declares a backend or cloud block after Takosumi's override; \
                     Takosumi keeps the state itself: remove that block"
                )));
            }
        }
        // Relative to the Capsule directory, not absolute: a saved plan records its
        // backend configuration and `apply <plan>` uses that one, so the path must mean
        // the same in the apply's run directory as in the plan's.
        let state = relative_state_path(wd)?;
        let body = format!(
            "# Written by Takosumi for this run: the state stays with Takosumi whatever backend\n\
             # the repository declares.\n\
             terraform {{\n  backend \"local\" {{\n    path = \"{}\"\n  }}\n}}\n",
            hcl_escape(&state)
        );
        workdir::write_private(&dir.join(BACKEND_OVERRIDE_FILE), body.as_bytes())
    }

    /// Puts a state file (a StateVersion's bytes) where the backend override reads it.
    pub fn restore_state(&self, wd: &Workdir, state: &[u8]) -> Result<(), RunnerError> {
        workdir::ensure_inside(wd.root(), wd.state_path())?;
        workdir::write_private(wd.state_path(), state)
    }

    /// The state file the tool left, or `None` if there is none.
    pub fn read_state(&self, wd: &Workdir) -> Result<Option<Vec<u8>>, RunnerError> {
        workdir::ensure_inside(wd.root(), wd.state_path())?;
        workdir::read_optional(wd.state_path())
    }

    /// The raw bytes of `config_dir/.terraform.lock.hcl`, `None` if absent (a
    /// provider-free run), [`RunnerError::LockfileTooLarge`] over 1 MiB.
    pub fn read_lockfile(&self, wd: &Workdir) -> Result<Option<Vec<u8>>, RunnerError> {
        let path = wd.config_dir().join(LOCKFILE_NAME);
        workdir::ensure_inside(wd.root(), &path)?;
        let meta = match fs::metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(RunnerError::io(format!("reading {}", path.display()), e)),
        };
        if meta.len() > MAX_LOCKFILE_BYTES {
            return Err(RunnerError::LockfileTooLarge { size: meta.len() });
        }
        let bytes = workdir::read_optional(&path)?;
        match bytes {
            Some(bytes) if bytes.len() as u64 > MAX_LOCKFILE_BYTES => {
                Err(RunnerError::LockfileTooLarge {
                    size: bytes.len() as u64,
                })
            }
            other => Ok(other),
        }
    }

    /// `<tool> version -json`, parsed; run in a throw-away HOME under `work_root`.
    /// The answer is kept per binary (path, size, modification time), so a replaced binary
    /// is asked again.
    pub async fn version(&self, tool: Tool, env: &ToolEnv) -> Result<Value, RunnerError> {
        let key = BinaryKey::of(self.tool_bin(tool)?);
        if let Some(known) = key.as_ref().and_then(|k| self.cached_version(k)) {
            return Ok(known);
        }
        let mut value = self.ask_version(tool, env).await?;
        // Which binary ran is part of the record, beside its version.
        if let Some(obj) = value.as_object_mut() {
            obj.insert(
                "path".into(),
                Value::String(self.tool_bin(tool)?.display().to_string()),
            );
        }
        if let Some(key) = key {
            self.versions
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(key, value.clone());
        }
        Ok(value)
    }

    fn cached_version(&self, key: &BinaryKey) -> Option<Value> {
        self.versions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    async fn ask_version(&self, tool: Tool, env: &ToolEnv) -> Result<Value, RunnerError> {
        let root = &self.cfg.work_root;
        fs::create_dir_all(root)
            .map_err(|e| RunnerError::io(format!("creating {}", root.display()), e))?;
        let home = tempfile::Builder::new()
            .prefix(&format!("version.{}.", workdir::owner_token()))
            .tempdir_in(root)
            .map_err(|e| {
                RunnerError::io(format!("creating a directory under {}", root.display()), e)
            })?;
        let cmd = self.tool_command(
            tool,
            home.path(),
            home.path(),
            home.path(),
            env,
            &["version", "-json"],
        )?;
        let captured = self
            .run_tool(cmd, tool, "version", StdoutMode::Data)
            .await?;
        json_result("version", captured)
    }

    /// `init -input=false -no-color` in the Capsule directory.
    pub async fn init(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
    ) -> Result<ToolOutput, RunnerError> {
        let args = ["init", "-input=false", "-no-color"];
        checked(
            "init",
            self.run_wd_tool(wd, tool, env, &args, "init", StdoutMode::Log)
                .await?,
        )
    }

    /// `init -input=false -no-color -get=false` in the Capsule directory: installs
    /// providers against the modules [`Self::get_modules`] already put in place, and
    /// downloads no module itself, so init cannot resolve a module version again.
    pub async fn init_without_get(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
    ) -> Result<ToolOutput, RunnerError> {
        let args = ["init", "-input=false", "-no-color", "-get=false"];
        checked(
            "init",
            self.run_wd_tool(wd, tool, env, &args, "init", StdoutMode::Log)
                .await?,
        )
    }

    /// `get -no-color` in the Capsule directory: downloads every module the configuration
    /// calls into `config_dir/.terraform/modules`, once, with the run's own environment
    /// (built from nothing, like every tool step). It installs no provider. Digest the
    /// result with [`crate::module_tree_digest`].
    pub async fn get_modules(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
    ) -> Result<ToolOutput, RunnerError> {
        let args = ["get", "-no-color"];
        checked(
            "get",
            self.run_wd_tool(wd, tool, env, &args, "get", StdoutMode::Log)
                .await?,
        )
    }

    /// `plan -input=false -no-color [-destroy] -out=<plan_path>`.
    pub async fn plan(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
        destroy: bool,
    ) -> Result<ToolOutput, RunnerError> {
        let mut out = OsString::from("-out=");
        out.push(wd.plan_path());
        let mut args: Vec<&OsStr> = vec![
            "plan".as_ref(),
            "-input=false".as_ref(),
            "-no-color".as_ref(),
        ];
        if destroy {
            args.push("-destroy".as_ref());
        }
        args.push(&out);
        checked(
            "plan",
            self.run_wd_tool(wd, tool, env, &args, "plan", StdoutMode::Log)
                .await?,
        )
    }

    /// A drift check's dry-run plan: `plan -input=false -no-color -detailed-exitcode
    /// -out=<plan_path>` (never `-refresh-only`: a reconcile applies this plan). Exit code 2
    /// is success with changes; the answer is whether the tool said there were changes.
    pub async fn plan_detailed(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
    ) -> Result<(ToolOutput, bool), RunnerError> {
        let mut out = OsString::from("-out=");
        out.push(wd.plan_path());
        let args: [&OsStr; 5] = [
            "plan".as_ref(),
            "-input=false".as_ref(),
            "-no-color".as_ref(),
            "-detailed-exitcode".as_ref(),
            &out,
        ];
        let mut captured = self
            .run_wd_tool(wd, tool, env, &args, "plan", StdoutMode::Log)
            .await?;
        let changes = captured.exit_code == 2;
        if changes {
            captured.exit_code = 0;
        }
        checked("plan", captured).map(|o| (o, changes))
    }

    /// `show -json <plan_path>`, parsed. It holds sensitive values: never log it.
    pub async fn show_json(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
    ) -> Result<Value, RunnerError> {
        let args: [&OsStr; 3] = [
            "show".as_ref(),
            "-json".as_ref(),
            wd.plan_path().as_os_str(),
        ];
        json_result(
            "show",
            self.run_wd_tool(wd, tool, env, &args, "show", StdoutMode::Data)
                .await?,
        )
    }

    /// `apply -input=false -no-color <plan_path>`. Returns the output whatever the exit
    /// code: check [`ToolOutput::exit_code`] and [`crate::is_stale_plan`].
    pub async fn apply(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
    ) -> Result<ToolOutput, RunnerError> {
        let args: [&OsStr; 4] = [
            "apply".as_ref(),
            "-input=false".as_ref(),
            "-no-color".as_ref(),
            wd.plan_path().as_os_str(),
        ];
        let captured = self
            .run_wd_tool(wd, tool, env, &args, "apply", StdoutMode::Log)
            .await?;
        Ok(tool_output(captured))
    }

    /// `apply -input=false -no-color -auto-approve`: plans and applies in one step with
    /// nothing saved in between. Only for an apply no rule covers (a covered one carries
    /// out exactly its saved plan with [`Self::apply`]). Returns the output whatever the
    /// exit code.
    pub async fn apply_auto_approve(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
    ) -> Result<ToolOutput, RunnerError> {
        let args = ["apply", "-input=false", "-no-color", "-auto-approve"];
        let captured = self
            .run_wd_tool(wd, tool, env, &args, "apply", StdoutMode::Log)
            .await?;
        Ok(tool_output(captured))
    }

    /// Puts an unsealed plan at `plan_path` (mode 0600) for apply.
    pub fn write_plan_file(&self, wd: &Workdir, bytes: &[u8]) -> Result<(), RunnerError> {
        workdir::ensure_inside(wd.root(), wd.plan_path())?;
        workdir::write_private(wd.plan_path(), bytes)
    }

    /// The saved plan's size in bytes.
    pub fn plan_file_size(&self, wd: &Workdir) -> Result<u64, RunnerError> {
        workdir::ensure_inside(wd.root(), wd.plan_path())?;
        fs::metadata(wd.plan_path())
            .map(|m| m.len())
            .map_err(|e| RunnerError::io(format!("reading {}", wd.plan_path().display()), e))
    }

    /// The saved plan's bytes (to digest and seal).
    pub fn read_plan_file(&self, wd: &Workdir) -> Result<Vec<u8>, RunnerError> {
        workdir::ensure_inside(wd.root(), wd.plan_path())?;
        fs::read(wd.plan_path())
            .map_err(|e| RunnerError::io(format!("reading {}", wd.plan_path().display()), e))
    }

    /// Overwrites the plan file with zeros, then removes it. No plan file is fine.
    pub fn wipe_plan_file(&self, wd: &Workdir) -> Result<(), RunnerError> {
        workdir::ensure_inside(wd.root(), wd.plan_path())?;
        workdir::wipe_file(wd.plan_path())
    }

    /// [`Self::wipe_plan_file`] on the blocking pool: its sync to the disk holds no async
    /// thread, and whatever runs beside it goes on.
    pub async fn wipe_plan_file_async(&self, wd: &Workdir) -> Result<(), RunnerError> {
        workdir::ensure_inside(wd.root(), wd.plan_path())?;
        let path = wd.plan_path().to_owned();
        tokio::task::spawn_blocking(move || workdir::wipe_file(&path))
            .await
            .map_err(|e| RunnerError::io("wiping the plan file", std::io::Error::other(e)))?
    }

    // ---- processes ------------------------------------------------------------------

    /// The tool's entire environment: the fixed entries, then the run's own.
    pub(crate) fn tool_env(
        &self,
        home: &Path,
        env: &ToolEnv,
    ) -> Result<BTreeMap<String, OsString>, RunnerError> {
        let mut vars: BTreeMap<String, OsString> = BTreeMap::new();
        vars.insert("PATH".into(), TOOL_PATH.into());
        vars.insert("HOME".into(), home.as_os_str().to_owned());
        vars.insert("CHECKPOINT_DISABLE".into(), "1".into());
        vars.insert("TF_IN_AUTOMATION".into(), "1".into());
        vars.insert("TF_INPUT".into(), "0".into());
        // Terraform releases built with panicwrap (0.x and 1.0 among them) otherwise start
        // twice per command: a parent that only waits to print a crash report, and the real
        // process. One Go start is ~25 ms of every init, plan, show and apply; a panic still
        // reaches the captured stderr with its stack. Releases without panicwrap (and
        // OpenTofu) ignore the name.
        vars.insert("TF_FORK".into(), "0".into());
        if let Some(cli) = &self.cfg.cli_config_file {
            vars.insert("TF_CLI_CONFIG_FILE".into(), cli.as_os_str().to_owned());
        }
        for (name, value) in env.entries()? {
            vars.insert(name.to_owned(), value.into());
        }
        Ok(vars)
    }

    /// A tool command with nothing inherited: environment from [`Self::tool_env`] only.
    /// It carries the environment's masker, so whatever runs it masks the output.
    pub(crate) fn tool_command<S: AsRef<OsStr>>(
        &self,
        tool: Tool,
        home: &Path,
        cwd: &Path,
        writable: &Path,
        env: &ToolEnv,
        args: &[S],
    ) -> Result<ToolCommand, RunnerError> {
        let vars = self.tool_env(home, env)?;
        let cmd = self.child(self.tool_bin(tool)?, args, cwd, vars, writable, None);
        Ok(ToolCommand {
            cmd,
            masker: env.masker().clone(),
        })
    }

    fn wd_command<S: AsRef<OsStr>>(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
        args: &[S],
    ) -> Result<ToolCommand, RunnerError> {
        self.tool_command(tool, wd.home(), wd.config_dir(), wd.root(), env, args)
    }

    /// Runs a tool command in the Capsule directory: inside the step's sandbox (one start
    /// for all of a step's commands, see [`crate::launch`]) when there is a launcher and a
    /// sandbox, otherwise as a child of its own.
    async fn run_wd_tool<S: AsRef<OsStr>>(
        &self,
        wd: &Workdir,
        tool: Tool,
        env: &ToolEnv,
        args: &[S],
        step: &'static str,
        mode: StdoutMode,
    ) -> Result<Captured, RunnerError> {
        let launcher = match (&self.cfg.launcher_bin, self.cfg.sandbox.mode) {
            (Some(bin), crate::SandboxMode::Bubblewrap) => bin,
            _ => {
                let cmd = self.wd_command(wd, tool, env, args)?;
                return self.run_tool(cmd, tool, step, mode).await;
            }
        };
        let program = self.tool_bin(tool)?;
        let request = crate::launch::Request {
            program: program.to_owned(),
            cwd: wd.config_dir().to_owned(),
            args: args.iter().map(|a| a.as_ref().to_os_string()).collect(),
            env: self
                .tool_env(wd.home(), env)?
                .into_iter()
                .map(|(k, v)| (k.into(), v))
                .collect(),
        };
        let mut slot = wd.session.lock().await;
        let session = self.session_in(&mut slot, wd, launcher)?;
        let shown = program.display().to_string();
        tracing::debug!(%tool, step, "starting the tool in the step's sandbox");
        let captured = session
            .run(&request, &shown, mode, self.step_opts(step), env.masker())
            .await?;
        tracing::debug!(%tool, step, exit_code = captured.exit_code, "the tool ended");
        Ok(captured)
    }

    /// The step's sandbox in `slot`, started when there is none (or it broke).
    fn session_in<'s>(
        &self,
        slot: &'s mut Option<crate::session::Session>,
        wd: &Workdir,
        launcher: &Path,
    ) -> Result<&'s mut crate::session::Session, RunnerError> {
        if let Some(session) = slot.take().filter(crate::session::Session::usable) {
            return Ok(slot.insert(session));
        }
        // The launcher's own environment: a PATH, nothing of the handler's.
        let vars = BTreeMap::from([("PATH".to_owned(), OsString::from(TOOL_PATH))]);
        let no_args: [&str; 0] = [];
        let prepared = self.child_with(
            Path::new(sandbox::LAUNCHER_PATH),
            &no_args,
            wd.root(),
            vars,
            wd.root(),
            None,
            Some(launcher),
        );
        Ok(slot.insert(crate::session::Session::start(prepared)?))
    }

    /// Starts the step's sandbox now (see [`crate::launch`]), so that bubblewrap sets it up
    /// while the checkout runs instead of when the first tool command starts. Nothing to do
    /// without a launcher, or when it runs already; a failure here is met again, and
    /// reported, by the first tool command.
    pub fn start_step_sandbox(&self, wd: &Workdir) {
        let (Some(launcher), crate::SandboxMode::Bubblewrap) =
            (&self.cfg.launcher_bin, self.cfg.sandbox.mode)
        else {
            return;
        };
        if let Ok(mut slot) = wd.session.try_lock() {
            let _ = self.session_in(&mut slot, wd, launcher);
        }
    }

    async fn run_tool(
        &self,
        cmd: ToolCommand,
        tool: Tool,
        step: &'static str,
        mode: StdoutMode,
    ) -> Result<Captured, RunnerError> {
        let program = self.tool_bin(tool)?.display().to_string();
        tracing::debug!(%tool, step, "starting the tool");
        let ToolCommand { cmd, masker } = cmd;
        let captured =
            process::run_tapped(cmd, &program, mode, self.step_opts(step), &masker).await?;
        tracing::debug!(%tool, step, exit_code = captured.exit_code, "the tool ended");
        Ok(captured)
    }

    /// How a tool command of `step` is driven, in its own sandbox or in the step's: the
    /// step's interrupt, live-output tap and time limit.
    fn step_opts(&self, step: &'static str) -> process::Opts {
        process::Opts {
            interrupt: self.interrupt_for(step),
            tap: self.tap_for(step),
            limit: Some((step, self.cfg.limits.for_step(step))),
        }
    }

    /// A git command with nothing inherited.
    pub(crate) fn git_command<S: AsRef<OsStr>>(
        &self,
        wd: &Workdir,
        cwd: &Path,
        args: &[S],
        git_dir: Option<(&Path, bool)>,
        index_file: Option<&Path>,
    ) -> Prepared {
        let mut env = git_env(wd);
        if let Some(index) = index_file {
            env.insert("GIT_INDEX_FILE".into(), index.as_os_str().to_owned());
        }
        let mut all: Vec<OsString> = GIT_OPTIONS
            .iter()
            .flat_map(|o| ["-c", o])
            .map(OsString::from)
            .collect();
        all.extend(args.iter().map(|a| a.as_ref().to_os_string()));
        self.child(&self.cfg.git_bin, &all, cwd, env, wd.root(), git_dir)
    }

    /// A `/bin/sh -c script` with git's environment, started like [`Self::git_command`]
    /// (one sandbox start for several git commands). `args` are the script's positional
    /// parameters; the script runs git as `"$GIT"` followed by the `-c` [`GIT_OPTIONS`].
    pub(crate) fn git_script_command<S: AsRef<OsStr>>(
        &self,
        wd: &Workdir,
        script: &str,
        args: &[S],
        git_dir: Option<(&Path, bool)>,
    ) -> Prepared {
        let mut env = git_env(wd);
        env.insert("GIT".into(), self.cfg.git_bin.as_os_str().to_owned());
        // The options as the script's own text: constants, no quote in any of them.
        let options: String = GIT_OPTIONS.iter().map(|o| format!(" -c '{o}'")).collect();
        let full = format!("g() {{ \"$GIT\"{options} \"$@\"; }}\n{script}");
        let mut all: Vec<OsString> = vec!["-c".into(), full.into(), "sh".into()];
        all.extend(args.iter().map(|a| a.as_ref().to_os_string()));
        self.child(
            Path::new("/bin/sh"),
            &all,
            wd.root(),
            env,
            wd.root(),
            git_dir,
        )
    }

    pub(crate) async fn git_captured<S: AsRef<OsStr>>(
        &self,
        wd: &Workdir,
        cwd: &Path,
        args: &[S],
        git_dir: Option<(&Path, bool)>,
        index_file: Option<&Path>,
    ) -> Result<Captured, RunnerError> {
        self.run_git(self.git_command(wd, cwd, args, git_dir, index_file))
            .await
    }

    /// Runs a prepared git command (or git script) to its end, within the checkout's time
    /// limit, stdout captured.
    pub(crate) async fn run_git(&self, cmd: Prepared) -> Result<Captured, RunnerError> {
        let program = self.cfg.git_bin.display().to_string();
        // git prints no run secrets (a URL's user-info is redacted from its errors).
        let opts = process::Opts {
            limit: Some(("checkout", self.cfg.limits.checkout)),
            ..process::Opts::default()
        };
        process::run_tapped(cmd, &program, StdoutMode::Data, opts, &Masker::new()).await
    }

    /// Runs git; a non-zero exit becomes [`RunnerError::Checkout`] with git's stderr.
    pub(crate) async fn git<S: AsRef<OsStr>>(
        &self,
        wd: &Workdir,
        cwd: &Path,
        args: &[S],
        repo: &str,
        git_dir: Option<(&Path, bool)>,
        index_file: Option<&Path>,
    ) -> Result<Captured, RunnerError> {
        let captured = self
            .git_captured(wd, cwd, args, git_dir, index_file)
            .await?;
        if captured.exit_code != 0 {
            return Err(self.git_failure(&captured, repo));
        }
        Ok(captured)
    }

    /// A failed git command as [`RunnerError::Checkout`]: its stderr (the last 4,000
    /// bytes), the URL's user-info redacted, and what to do when a `file://` repository
    /// is outside the sandbox's view.
    pub(crate) fn git_failure(&self, captured: &Captured, repo: &str) -> RunnerError {
        let mut message = captured.stderr.trim().to_owned();
        if message.is_empty() {
            message = format!("git exited with code {}", captured.exit_code);
        }
        if message.len() > 4000 {
            let mut cut = message.len() - 4000;
            while !message.is_char_boundary(cut) {
                cut += 1;
            }
            message = format!("…{}", &message[cut..]);
        }
        let mut message = source::redact_url(&message, repo);
        if let Some(path) = repo.strip_prefix("file://")
            && self.cfg.sandbox.mode == crate::SandboxMode::Bubblewrap
            && !self
                .cfg
                .sandbox
                .ro_paths
                .iter()
                .any(|r| Path::new(path).starts_with(r))
        {
            message.push_str(&format!(
                " (a file:// repository is visible to the runner sandbox only under \
                 TAKOSUMI_SANDBOX_RO_PATHS; add {path}'s directory there)"
            ));
        }
        RunnerError::Checkout(message)
    }
}

/// The `-c` options every git command runs with.
const GIT_OPTIONS: [&str; 7] = [
    "protocol.ext.allow=never",
    "protocol.fd.allow=never",
    "core.sshCommand=ssh -o BatchMode=yes",
    "advice.detachedHead=false",
    // what a fetched repository brings never runs, and no fetch waits on a repack
    "core.hooksPath=/dev/null",
    "gc.auto=0",
    // Without it every fetch starts `git maintenance run --auto` after it, a process
    // (1.5-3 ms of each checkout here) that, with `gc.auto=0`, has nothing to do.
    "maintenance.auto=false",
];

/// git's whole environment: nothing inherited, no prompt, no system or global config.
fn git_env(wd: &Workdir) -> BTreeMap<String, OsString> {
    [
        ("PATH", OsStr::new(TOOL_PATH)),
        ("HOME", wd.home().as_os_str()),
        ("GIT_TERMINAL_PROMPT", OsStr::new("0")),
        ("GIT_CONFIG_NOSYSTEM", OsStr::new("1")),
        ("GIT_CONFIG_GLOBAL", OsStr::new("/dev/null")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// A tool command and the masker its output goes through: the only way a tool step is
/// started (`run_tool` takes this, not a bare `Command`), so no step can forget to mask.
pub(crate) struct ToolCommand {
    cmd: Prepared,
    masker: Masker,
}

impl std::ops::Deref for ToolCommand {
    type Target = Command;

    fn deref(&self) -> &Command {
        &self.cmd.cmd
    }
}

impl std::ops::DerefMut for ToolCommand {
    fn deref_mut(&mut self) -> &mut Command {
        &mut self.cmd.cmd
    }
}

fn tool_output(c: Captured) -> ToolOutput {
    ToolOutput {
        exit_code: c.exit_code,
        output: c.output,
        stderr: c.stderr,
    }
}

fn checked(step: &'static str, c: Captured) -> Result<ToolOutput, RunnerError> {
    if c.exit_code != 0 {
        return Err(RunnerError::ToolFailed {
            step,
            exit_code: c.exit_code,
            output: c.output,
        });
    }
    Ok(tool_output(c))
}

fn json_result(step: &'static str, c: Captured) -> Result<Value, RunnerError> {
    if c.exit_code != 0 {
        // stdout may hold values; stderr has the error.
        return Err(RunnerError::ToolFailed {
            step,
            exit_code: c.exit_code,
            output: c.stderr,
        });
    }
    if c.stdout_overflow {
        return Err(RunnerError::OutputTooLarge {
            step,
            limit: process::MAX_STDOUT_BYTES,
        });
    }
    serde_json::from_slice(&c.stdout).map_err(|source| RunnerError::BadJson { step, source })
}

/// The state path relative to the Capsule directory (both live in the run directory).
fn relative_state_path(wd: &Workdir) -> Result<String, RunnerError> {
    let inside = wd.config_dir().strip_prefix(wd.root()).map_err(|_| {
        RunnerError::InvalidDir(format!(
            "{} is outside the run directory",
            wd.config_dir().display()
        ))
    })?;
    let state = wd
        .state_path()
        .strip_prefix(wd.root())
        .ok()
        .and_then(Path::to_str)
        .ok_or_else(|| RunnerError::InvalidDir("the state path is not UTF-8".into()))?;
    let mut rel = "../".repeat(inside.components().count());
    rel.push_str(state);
    Ok(rel)
}

/// `override.tf`, `*_override.tf` and their `.tf.json` / `.tofu` / `.tofu.json` forms.
fn is_override_file(name: &str) -> bool {
    [".tf", ".tf.json", ".tofu", ".tofu.json"]
        .iter()
        .any(|ext| {
            name.strip_suffix(ext)
                .is_some_and(|stem| stem == "override" || stem.ends_with("_override"))
        })
}

/// A `backend "…"` / `cloud {` block (HCL) or a `"backend"` / `"cloud"` key (JSON).
fn declares_backend(text: &str) -> bool {
    let bytes = text.as_bytes();
    let followed_by = |end: usize, chars: &[u8]| {
        bytes[end..]
            .iter()
            .find(|b| !b.is_ascii_whitespace())
            .is_some_and(|b| chars.contains(b))
    };
    for (word, next) in [("backend", b"\"".as_slice()), ("cloud", b"{".as_slice())] {
        for (i, _) in text.match_indices(word) {
            let end = i + word.len();
            let before = if i == 0 { b' ' } else { bytes[i - 1] };
            let after = bytes.get(end).copied().unwrap_or(b' ');
            if before == b'"' && after == b'"' && followed_by(end + 1, b":") {
                return true;
            }
            let word_start = !(before.is_ascii_alphanumeric() || before == b'_' || before == b'-');
            let word_end = !(after.is_ascii_alphanumeric() || after == b'_' || after == b'-');
            if word_start && word_end && followed_by(end, next) {
                return true;
            }
        }
    }
    false
}

/// Escapes a string for an HCL quoted literal (no interpolation, no directives).
fn hcl_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '$' | '%' if chars.peek() == Some(&'{') => {
                out.push(c);
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// Identifies one build of a tool binary without reading it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct BinaryKey {
    path: PathBuf,
    len: u64,
    modified: std::time::SystemTime,
}

impl BinaryKey {
    fn of(path: &Path) -> Option<Self> {
        let meta = fs::metadata(path).ok()?;
        Some(Self {
            path: path.to_owned(),
            len: meta.len(),
            modified: meta.modified().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use takosumi_core::Secret;

    use super::*;

    fn make_runner(cli: Option<&str>) -> (tempfile::TempDir, Runner) {
        let base = tempfile::tempdir().unwrap();
        let mut cfg = RunnerConfig::new("/opt/terraform", base.path().join("work"));
        cfg.cli_config_file = cli.map(PathBuf::from);
        // The environment is the same either way (bubblewrap passes its own on); without
        // the sandbox the command's program and directory are the tool's own, to check.
        cfg.sandbox.mode = crate::SandboxMode::None;
        (base, Runner::new(cfg))
    }

    /// `version -json` starts the tool once per binary; a replaced binary is asked again.
    #[tokio::test]
    async fn version_is_asked_once_per_binary() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let bin = base.path().join("terraform");
        let probe = base.path().join("probe");
        fs::create_dir(&probe).unwrap();
        let count = probe.join("count");
        let script = |v: &str| {
            format!(
                "#!/bin/sh\necho x >> {}\necho '{{\"terraform_version\":\"{v}\"}}'\n",
                count.display()
            )
        };
        fs::write(&bin, script("1.0.3")).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        let mut cfg = RunnerConfig::new(&bin, base.path().join("work"));
        // the count is written from inside the sandbox
        cfg.sandbox.rw_paths.push(probe.clone());
        let runner = Runner::new(cfg);
        let env = ToolEnv::new();
        let calls = || {
            fs::read_to_string(&count)
                .unwrap_or_default()
                .lines()
                .count()
        };

        for _ in 0..3 {
            let v = runner.version(Tool::Terraform, &env).await.unwrap();
            assert_eq!(v["terraform_version"], "1.0.3");
        }
        assert_eq!(calls(), 1);

        // A new build (different size) is a different binary.
        fs::write(&bin, script("1.0.30")).unwrap();
        let v = runner.version(Tool::Terraform, &env).await.unwrap();
        assert_eq!(v["terraform_version"], "1.0.30");
        assert_eq!(calls(), 2);
    }

    #[test]
    fn tool_environment_is_built_from_nothing() {
        let (_base, runner) = make_runner(Some("/etc/takosumi/terraformrc"));
        let wd = runner.workdir("run_env").unwrap();
        let env = ToolEnv::new()
            .with_variables(serde_json::json!({"region": "eu"}).as_object().unwrap())
            .unwrap()
            .with_secret_env("AWS_SECRET_ACCESS_KEY", Secret::new("canary-s3cr3t".into()));
        let cmd = runner
            .wd_command(&wd, Tool::Terraform, &env, &["plan"])
            .unwrap();
        let std = cmd.as_std();
        let envs: BTreeMap<String, Option<String>> = std
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_str().unwrap().to_owned(),
                    v.map(|v| v.to_str().unwrap().to_owned()),
                )
            })
            .collect();
        let keys: Vec<&str> = envs.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "AWS_SECRET_ACCESS_KEY",
                "CHECKPOINT_DISABLE",
                "HOME",
                "PATH",
                "TF_CLI_CONFIG_FILE",
                "TF_FORK",
                "TF_INPUT",
                "TF_IN_AUTOMATION",
                "TF_VAR_region",
            ]
        );
        assert_eq!(envs["TF_FORK"].as_deref(), Some("0"));
        assert_eq!(envs["PATH"].as_deref(), Some(TOOL_PATH));
        assert_eq!(envs["HOME"].as_deref(), wd.home().to_str());
        assert_eq!(envs["CHECKPOINT_DISABLE"].as_deref(), Some("1"));
        assert_eq!(
            envs["TF_CLI_CONFIG_FILE"].as_deref(),
            Some("/etc/takosumi/terraformrc")
        );
        assert_eq!(envs["TF_VAR_region"].as_deref(), Some("eu"));
        assert_eq!(std.get_current_dir(), Some(wd.config_dir()));
        assert_eq!(std.get_program(), "/opt/terraform");

        // Without a CLI config, none is named; the run's CHECKPOINT_DISABLE wins.
        let (_base2, plain) = make_runner(None);
        let env = ToolEnv::new().with_secret_env("CHECKPOINT_DISABLE", Secret::new("false".into()));
        let vars = plain.tool_env(wd.home(), &env).unwrap();
        assert!(!vars.contains_key("TF_CLI_CONFIG_FILE"));
        assert_eq!(vars["CHECKPOINT_DISABLE"], "false");

        // A refused entry stops the tool from starting at all.
        let bad = ToolEnv::new().with_secret_env("TF_CLI_ARGS", Secret::new("-x".into()));
        assert!(matches!(
            runner.wd_command(&wd, Tool::Terraform, &bad, &["plan"]),
            Err(RunnerError::InvalidEnv { .. })
        ));
        assert!(matches!(
            runner.wd_command(&wd, Tool::Tofu, &ToolEnv::new(), &["plan"]),
            Err(RunnerError::ToolNotInstalled(Tool::Tofu))
        ));
    }

    #[test]
    fn git_environment_is_built_from_nothing() {
        let (_base, runner) = make_runner(None);
        let wd = runner.workdir("run_git").unwrap();
        let cmd = runner.git_command(&wd, wd.root(), &["status"], None, None);
        let keys: Vec<String> = cmd
            .cmd
            .as_std()
            .get_envs()
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            keys,
            [
                "GIT_CONFIG_GLOBAL",
                "GIT_CONFIG_NOSYSTEM",
                "GIT_TERMINAL_PROMPT",
                "HOME",
                "PATH"
            ]
        );
    }

    #[test]
    fn no_git_command_starts_background_maintenance() {
        let (_base, runner) = make_runner(None);
        let wd = runner.workdir("run_git").unwrap();
        let args = |p: &Prepared| -> String {
            p.cmd
                .as_std()
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let one = runner.git_command(&wd, wd.root(), &["fetch"], None, None);
        assert!(
            args(&one).contains("-c maintenance.auto=false fetch"),
            "{}",
            args(&one)
        );
        let script = runner.git_script_command(&wd, "g fetch", &["x"], None);
        assert!(
            args(&script).contains("-c 'maintenance.auto=false'"),
            "{}",
            args(&script)
        );
    }

    #[test]
    fn tool_binaries() {
        let (_base, runner) = make_runner(None);
        assert_eq!(
            runner.tool_bin(Tool::Terraform).unwrap(),
            Path::new("/opt/terraform")
        );
        assert!(matches!(
            runner.tool_bin(Tool::Tofu),
            Err(RunnerError::ToolNotInstalled(Tool::Tofu))
        ));
        let mut cfg = runner.config().clone();
        cfg.tofu_bin = Some("/opt/tofu".into());
        assert_eq!(
            Runner::new(cfg).tool_bin(Tool::Tofu).unwrap(),
            Path::new("/opt/tofu")
        );
    }

    #[test]
    fn tools_are_found_on_path_unless_a_setting_names_them() {
        use std::os::unix::fs::PermissionsExt;
        let bin = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let exec = |dir: &Path, name: &str, mode: u32| {
            let p = dir.join(name);
            fs::write(&p, "#!/bin/sh\n").unwrap();
            fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
            p
        };
        let tofu = exec(bin.path(), "tofu", 0o755);
        exec(other.path(), "terraform", 0o644); // not executable: skipped
        let tf = exec(bin.path(), "terraform", 0o755);
        let path =
            std::env::join_paths(["relative/dir".as_ref(), other.path(), bin.path()]).unwrap();
        let settings = |extra: &[(&str, &str)]| {
            let mut map: std::collections::HashMap<String, String> = [
                ("TAKOSUMI_WORK_DIR", "/tmp/w"),
                ("PATH", path.to_str().unwrap()),
            ]
            .iter()
            .chain(extra)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
            map.retain(|_, v| !v.is_empty());
            RunnerConfig::from_settings(|k| map.get(k).cloned()).unwrap()
        };
        let found = settings(&[]);
        assert_eq!(found.tofu_bin.as_deref(), Some(tofu.as_path()));
        assert_eq!(found.terraform_bin.as_deref(), Some(tf.as_path()));
        let named = settings(&[("TAKOSUMI_TOFU_BIN", "/opt/tofu-1.8/tofu")]);
        assert_eq!(
            named.tofu_bin.as_deref(),
            Some(Path::new("/opt/tofu-1.8/tofu"))
        );
        let by_name = settings(&[("TAKOSUMI_TERRAFORM_BIN", "tofu")]);
        assert_eq!(by_name.terraform_bin.as_deref(), Some(tofu.as_path()));
        let none = settings(&[("PATH", "/nonexistent")]);
        assert!(none.tofu_bin.is_none() && none.terraform_bin.is_none());
        let err = Runner::new(none)
            .tool_bin(Tool::Tofu)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("put `tofu` on the PATH") && err.contains("TAKOSUMI_TOFU_BIN"),
            "{err}"
        );
    }

    #[test]
    fn sandbox_setting_is_read_once_and_a_wrong_one_is_named() {
        let settings = |mode: &str| {
            RunnerConfig::from_settings(|k| match k {
                "TAKOSUMI_WORK_DIR" => Some("/tmp/w".to_owned()),
                "TAKOSUMI_SANDBOX" => Some(mode.to_owned()),
                _ => None,
            })
        };
        for (text, mode) in [
            ("bubblewrap", crate::SandboxMode::Bubblewrap),
            ("bwrap", crate::SandboxMode::Bubblewrap),
            ("none", crate::SandboxMode::None),
        ] {
            assert_eq!(settings(text).unwrap().sandbox.mode, mode, "{text}");
        }
        let problems = settings("docker").unwrap_err();
        assert!(
            problems.iter().any(|p| p.starts_with("TAKOSUMI_SANDBOX: ")
                && p.contains("\"docker\"")
                && p.contains("bubblewrap, none")),
            "{problems:?}"
        );
    }

    #[test]
    fn override_detection() {
        for yes in [
            "override.tf",
            "x_override.tf",
            "a_override.tf.json",
            "override.tofu",
            "b_override.tofu.json",
        ] {
            assert!(is_override_file(yes), "{yes}");
        }
        for no in ["main.tf", "overrides.tf", "xoverride.tf", "override.txt"] {
            assert!(!is_override_file(no), "{no}");
        }
        assert!(declares_backend("terraform {\n  backend \"s3\" {}\n}"));
        assert!(declares_backend("terraform { backend    \"s3\" {} }"));
        assert!(declares_backend(
            "terraform {\n  cloud {\n organization = \"x\" } }"
        ));
        assert!(declares_backend(
            r#"{"terraform": {"backend": {"s3": {}}}}"#
        ));
        assert!(!declares_backend(
            "variable \"backend_url\" {}\noutput \"cloud_id\" { value = 1 }"
        ));
        assert!(!declares_backend("locals { backend = 1 }"));
    }

    #[test]
    fn hcl_strings_are_escaped() {
        assert_eq!(hcl_escape(r#"/a/"b"\c"#), r#"/a/\"b\"\\c"#);
        assert_eq!(hcl_escape("/a/${x}/%{y}/$z"), "/a/$${x}/%%{y}/$z");
    }

    #[test]
    fn lockfile_limits() {
        let (_base, runner) = make_runner(None);
        let wd = runner.workdir("run_lock").unwrap();
        fs::create_dir_all(wd.config_dir()).unwrap();
        assert_eq!(runner.read_lockfile(&wd).unwrap(), None);
        let path = wd.config_dir().join(LOCKFILE_NAME);
        fs::write(&path, b"").unwrap();
        assert_eq!(runner.read_lockfile(&wd).unwrap(), Some(Vec::new()));
        fs::write(&path, vec![b'#'; 1_048_576]).unwrap();
        assert_eq!(runner.read_lockfile(&wd).unwrap().unwrap().len(), 1_048_576);
        fs::write(&path, vec![b'#'; 1_048_577]).unwrap();
        assert!(matches!(
            runner.read_lockfile(&wd),
            Err(RunnerError::LockfileTooLarge { size: 1_048_577 })
        ));
    }

    #[test]
    fn backend_override_file() {
        let (_base, runner) = make_runner(None);
        let wd = runner.workdir("run_override").unwrap();
        let dir = wd.config_dir().to_path_buf();
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("main.tf"), "terraform {\n  backend \"s3\" {}\n}\n").unwrap();
        fs::write(
            dir.join("a_override.tf"),
            "terraform {\n  backend \"s3\" {}\n}\n",
        )
        .unwrap();
        fs::write(dir.join("zz_takosumi_override.tofu"), "terraform {}\n").unwrap();
        runner.write_backend_override(&wd).unwrap();
        let text = fs::read_to_string(dir.join(BACKEND_OVERRIDE_FILE)).unwrap();
        assert!(text.contains("backend \"local\""));
        assert!(
            text.contains("path = \"../state/terraform.tfstate\""),
            "{text}"
        );
        assert_eq!(
            wd.config_dir()
                .join("../state/terraform.tfstate")
                .parent()
                .unwrap()
                .canonicalize()
                .unwrap(),
            wd.state_path().parent().unwrap()
        );
        assert!(!dir.join("zz_takosumi_override.tofu").exists());

        fs::write(
            dir.join("zzz_override.tf"),
            "terraform {\n  backend \"s3\" {}\n}\n",
        )
        .unwrap();
        assert!(matches!(
            runner.write_backend_override(&wd),
            Err(RunnerError::InvalidDir(_))
        ));
        fs::write(dir.join("zzz_override.tf"), "output \"x\" { value = 1 }\n").unwrap();
        runner.write_backend_override(&wd).unwrap();
    }

    #[test]
    fn plan_file_round_trip() {
        let (_base, runner) = make_runner(None);
        let wd = runner.workdir("run_plan").unwrap();
        assert!(runner.read_plan_file(&wd).is_err());
        runner.write_plan_file(&wd, b"PK\x03\x04plan").unwrap();
        assert_eq!(runner.read_plan_file(&wd).unwrap(), b"PK\x03\x04plan");
        runner.wipe_plan_file(&wd).unwrap();
        assert!(!wd.plan_path().exists());
        runner.wipe_plan_file(&wd).unwrap();

        assert_eq!(runner.read_state(&wd).unwrap(), None);
        runner.restore_state(&wd, b"{\"version\":4}").unwrap();
        assert_eq!(runner.read_state(&wd).unwrap().unwrap(), b"{\"version\":4}");
    }
}
