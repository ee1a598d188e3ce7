//! Helpers shared by the integration tests: throw-away git repositories and runners.
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use takosumi_runner::{Runner, RunnerConfig};

/// The configuration every test Capsule starts from (the quick start's example).
pub const NETWORK_TF: &str =
    "variable \"region\" { type = string }\noutput \"vpc\" { value = \"vpc-${var.region}\" }\n";

/// A git repository in a temporary directory, branch `main`.
pub struct Repo {
    dir: tempfile::TempDir,
}

/// Where test repositories live: the one directory the runner sandbox is told to show
/// read-only (`file://` sources must be visible inside it).
pub const REPOS_ROOT: &str = "/tmp/takosumi-test-repos";

impl Repo {
    pub fn new() -> Self {
        fs::create_dir_all(REPOS_ROOT).unwrap();
        let dir = tempfile::tempdir_in(REPOS_ROOT).unwrap();
        let repo = Self { dir };
        repo.git(&["init", "--quiet", "-b", "main"]);
        repo
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn url(&self) -> String {
        format!("file://{}", self.dir.path().display())
    }

    pub fn write(&self, rel: &str, content: &str) -> &Self {
        let path = self.dir.path().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
        self
    }

    pub fn chmod(&self, rel: &str, mode: u32) -> &Self {
        fs::set_permissions(self.dir.path().join(rel), fs::Permissions::from_mode(mode)).unwrap();
        self
    }

    pub fn remove(&self, rel: &str) -> &Self {
        fs::remove_file(self.dir.path().join(rel)).unwrap();
        self
    }

    /// Commits everything; returns the commit id.
    pub fn commit(&self, message: &str) -> String {
        self.git(&["add", "-A"]);
        self.git(&["commit", "--quiet", "--no-verify", "-m", message]);
        self.git(&["rev-parse", "HEAD"])
    }

    /// Runs git in the repository with an environment of its own; returns trimmed stdout.
    pub fn git(&self, args: &[&str]) -> String {
        let out = Command::new("git")
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", self.dir.path())
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .args([
                "-c",
                "user.name=Takosumi Test",
                "-c",
                "user.email=test@takosumi.invalid",
                "-c",
                "commit.gpgsign=false",
            ])
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }
}

/// A runner whose run directories live in a fresh temporary directory.
pub fn runner(
    terraform_bin: impl Into<PathBuf>,
    cli_config: Option<PathBuf>,
) -> (tempfile::TempDir, Runner) {
    let base = tempfile::tempdir().unwrap();
    let terraform_bin: PathBuf = terraform_bin.into();
    let mut cfg = RunnerConfig::new(&terraform_bin, base.path().join("work"));
    cfg.cli_config_file = cli_config;
    cfg.sandbox.ro_paths.push(REPOS_ROOT.into());
    // test tools are wrapper scripts that exec a neighbour
    if let Some(dir) = terraform_bin.parent().filter(|d| d.is_absolute()) {
        cfg.sandbox.ro_paths.push(dir.to_path_buf());
    }
    (base, Runner::new(cfg))
}

/// `TAKOSUMI_TERRAFORM_BIN` and `TAKOSUMI_TF_CLI_CONFIG`, or `None` (the test prints
/// "skipped" and returns).
pub fn terraform_from_env() -> Option<(PathBuf, Option<PathBuf>)> {
    let bin = std::env::var_os("TAKOSUMI_TERRAFORM_BIN").filter(|v| !v.is_empty())?;
    let cli = std::env::var_os("TAKOSUMI_TF_CLI_CONFIG")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    Some((PathBuf::from(bin), cli))
}
