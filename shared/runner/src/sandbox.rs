//! The runner sandbox: every process a Run starts (git, the tool, a provisioner, a
//! provider, a command credential) runs inside bubblewrap.
//!
//! A Capsule's configuration is untrusted code, so the child gets: a uid of its own (65534
//! inside a user namespace of its own, no capabilities), its own pid, ipc, uts, cgroup and
//! mount namespaces, a private `/proc`, the system directories read-only, the tool binaries
//! and provider mirror read-only, and exactly one writable directory, the Run's own. The
//! network is shared (providers need it). `--die-with-parent` plus the pid namespace mean a
//! handler killed with SIGKILL takes every process of the Run with it, and nothing a Run
//! starts outlives it. The handler's environment never crosses: the child's environment is
//! the one the runner built from nothing.
//!
//! `TAKOSUMI_SANDBOX=none` runs children directly (only where user namespaces are not
//! available); the handler says so loudly and every Run it executes records it.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use tokio::process::Command;

use crate::RunnerError;
use crate::etc_view::ETC_FILES;

pub use takosumi_core::SandboxMode;

/// The sandbox's settings (server settings, read once).
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// How children are isolated.
    pub mode: SandboxMode,
    /// The bubblewrap binary (`TAKOSUMI_BWRAP_BIN`, default `/usr/bin/bwrap`).
    pub bwrap_bin: PathBuf,
    /// Extra paths every sandbox sees read-only (`TAKOSUMI_SANDBOX_RO_PATHS`, `:`-separated):
    /// a local Git server's repositories for `file://` sources, a provider plugin mirror
    /// the CLI configuration does not name.
    pub ro_paths: Vec<PathBuf>,
    /// Extra paths every sandbox may write (`TAKOSUMI_SANDBOX_RW_PATHS`). Shared between
    /// Runs, so they weaken the isolation between them: for test probes only.
    pub rw_paths: Vec<PathBuf>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            mode: SandboxMode::Bubblewrap,
            bwrap_bin: PathBuf::from("/usr/bin/bwrap"),
            ro_paths: Vec::new(),
            rw_paths: Vec::new(),
        }
    }
}

/// The uid and gid a sandboxed process has inside its user namespace.
pub const SANDBOX_UID: u32 = 65534;

/// One child to start: the program, its arguments, working directory and entire
/// environment, and the one directory it may write.
pub(crate) struct ChildSpec<'a> {
    pub program: &'a Path,
    pub args: Vec<OsString>,
    pub cwd: &'a Path,
    pub env: Vec<(OsString, OsString)>,
    /// The Run's directory: the only writable place (besides a private `/tmp`).
    pub writable: &'a Path,
    /// Paths this child needs to read besides the configured ones (tool binary, CLI config,
    /// provider mirror, a `file://` repository).
    pub readable: Vec<PathBuf>,
    /// A git command's cache entry (a bare repository outside the Run's directory), and
    /// whether it may write there (init and fetch do; resolving and exporting do not).
    pub git_dir: Option<(&'a Path, bool)>,
    /// The runner's copy of the readable `/etc` entries ([`crate::etc_view`]), bound as
    /// `/etc` with one mount; `None` binds each entry of [`ETC_FILES`] itself.
    pub etc: Option<PathBuf>,
    /// The step launcher's binary, bound read-only at [`LAUNCHER_PATH`] (where `program`
    /// then points): at a fixed place, so the sandbox learns nothing of the host's layout.
    pub launcher: Option<&'a Path>,
}

/// Where a step's sandbox sees the launcher ([`crate::launch`]).
pub(crate) const LAUNCHER_PATH: &str = "/run/takosumi/launch";

/// A prepared child and whether it runs inside the sandbox (an interrupt then goes to the
/// sandboxed processes, not to bubblewrap, which would end the sandbox at once).
pub(crate) struct Prepared {
    pub cmd: Command,
    pub sandboxed: bool,
}

impl From<Command> for Prepared {
    fn from(cmd: Command) -> Self {
        Self {
            cmd,
            sandboxed: false,
        }
    }
}

impl SandboxConfig {
    /// The command that starts `spec`: bubblewrap around it, or the program itself.
    pub(crate) fn command(&self, spec: ChildSpec<'_>) -> Prepared {
        match self.mode {
            SandboxMode::None => {
                let mut cmd = Command::new(spec.program);
                cmd.env_clear()
                    .envs(spec.env)
                    .current_dir(spec.cwd)
                    .args(spec.args);
                Prepared {
                    cmd,
                    sandboxed: false,
                }
            }
            SandboxMode::Bubblewrap => {
                let mut cmd = Command::new(&self.bwrap_bin);
                cmd.args(self.bwrap_args(&spec));
                // bubblewrap passes its own environment on: exactly the one built for the child.
                cmd.env_clear().envs(spec.env).current_dir("/");
                cmd.arg("--").arg(spec.program).args(spec.args);
                Prepared {
                    cmd,
                    sandboxed: true,
                }
            }
        }
    }

    fn bwrap_args(&self, spec: &ChildSpec<'_>) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::with_capacity(64);
        let mut push = |items: &[&OsStr]| a.extend(items.iter().map(|s| s.to_os_string()));
        let uid = SANDBOX_UID.to_string();
        push(&[
            "--unshare-all".as_ref(),
            "--share-net".as_ref(),
            "--unshare-user".as_ref(),
            "--uid".as_ref(),
            uid.as_ref(),
            "--gid".as_ref(),
            uid.as_ref(),
            "--cap-drop".as_ref(),
            "ALL".as_ref(),
            "--die-with-parent".as_ref(),
            "--new-session".as_ref(),
            "--hostname".as_ref(),
            "takosumi-run".as_ref(),
            "--ro-bind".as_ref(),
            "/usr".as_ref(),
            "/usr".as_ref(),
        ]);
        for top in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
            match std::fs::read_link(top) {
                // merged /usr: keep the link as it is on the host
                Ok(target) => push(&["--symlink".as_ref(), target.as_os_str(), top.as_ref()]),
                Err(_) if Path::new(top).is_dir() => {
                    push(&["--ro-bind".as_ref(), top.as_ref(), top.as_ref()]);
                }
                Err(_) => {}
            }
        }
        // A path bound later under /etc needs its mount point in the tree bound there,
        // which the read-only copy does not have: then the entries are bound one by one.
        let under_etc = spec
            .readable
            .iter()
            .chain(&self.ro_paths)
            .chain(&self.rw_paths)
            .map(PathBuf::as_path)
            .chain(spec.git_dir.map(|(dir, _)| dir))
            .chain([spec.writable])
            .any(|p| p.starts_with("/etc"));
        match spec.etc.as_ref().filter(|_| !under_etc) {
            Some(view) => push(&["--ro-bind".as_ref(), view.as_os_str(), "/etc".as_ref()]),
            None => {
                for etc in ETC_FILES {
                    push(&["--ro-bind-try".as_ref(), etc.as_ref(), etc.as_ref()]);
                }
            }
        }
        push(&[
            "--proc".as_ref(),
            "/proc".as_ref(),
            "--dev".as_ref(),
            "/dev".as_ref(),
            "--tmpfs".as_ref(),
            "/tmp".as_ref(),
        ]);
        for path in spec.readable.iter().chain(&self.ro_paths) {
            push(&["--ro-bind-try".as_ref(), path.as_os_str(), path.as_os_str()]);
        }
        for path in &self.rw_paths {
            push(&["--bind-try".as_ref(), path.as_os_str(), path.as_os_str()]);
        }
        if let Some(launcher) = spec.launcher {
            push(&[
                "--ro-bind".as_ref(),
                launcher.as_os_str(),
                LAUNCHER_PATH.as_ref(),
            ]);
        }
        if let Some((git_dir, writable)) = spec.git_dir {
            let bind: &OsStr = if writable { "--bind" } else { "--ro-bind" }.as_ref();
            push(&[bind, git_dir.as_os_str(), git_dir.as_os_str()]);
        }
        push(&[
            "--bind".as_ref(),
            spec.writable.as_os_str(),
            spec.writable.as_os_str(),
            // the sandbox's own root (a tmpfs holding the mount points) read-only too
            "--remount-ro".as_ref(),
            "/".as_ref(),
            "--chdir".as_ref(),
            spec.cwd.as_os_str(),
        ]);
        a
    }

    /// Checks that the sandbox can start a process here (bubblewrap installed, user
    /// namespaces allowed). In `none` mode there is nothing to check.
    pub async fn check(&self, scratch: &Path, etc: Option<PathBuf>) -> Result<(), RunnerError> {
        if self.mode == SandboxMode::None {
            return Ok(());
        }
        let spec = ChildSpec {
            program: Path::new("/bin/sh"),
            args: vec!["-c".into(), "exit 0".into()],
            cwd: scratch,
            env: vec![("PATH".into(), crate::TOOL_PATH.into())],
            writable: scratch,
            readable: Vec::new(),
            git_dir: None,
            etc,
            launcher: None,
        };
        let mut cmd = self.command(spec).cmd;
        let out = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| RunnerError::SandboxUnavailable(format!(
                "{} could not be started ({e}): install bubblewrap (Debian package `bubblewrap`) \
                 or set TAKOSUMI_BWRAP_BIN",
                self.bwrap_bin.display()
            )))?;
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr);
            return Err(RunnerError::SandboxUnavailable(format!(
                "bubblewrap could not start a sandbox here ({}); enable unprivileged user \
                 namespaces, or set TAKOSUMI_SANDBOX=none to run Capsules unisolated \
                 (every Run then records sandbox \"none\")",
                why.trim()
            )));
        }
        Ok(())
    }
}

/// Reads a `:`-separated list of absolute paths (empty entries skipped).
pub fn parse_path_list(text: &str) -> Result<Vec<PathBuf>, String> {
    text.split(':')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let path = PathBuf::from(p);
            if path.is_absolute() {
                Ok(path)
            } else {
                Err(format!("{p:?} is not an absolute path"))
            }
        })
        .collect()
}

/// The directories a tool CLI configuration points providers at (`filesystem_mirror`
/// paths, `plugin_cache_dir`): the sandbox must see them read-only. An unreadable or
/// unparsable file yields none (the tool itself will then say what is wrong).
pub(crate) fn cli_config_paths(file: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string(file) else {
        return Vec::new();
    };
    let Ok(body) = hcl::parse(&text) else {
        return Vec::new();
    };
    let mut paths = Vec::new();
    collect_paths(&body, &mut paths);
    paths
}

fn collect_paths(body: &hcl::Body, out: &mut Vec<PathBuf>) {
    for structure in body.iter() {
        match structure {
            hcl::Structure::Attribute(attr) => {
                let key = attr.key.as_str();
                if (key == "path" || key == "plugin_cache_dir")
                    && let hcl::Expression::String(s) = &attr.expr
                    && Path::new(s).is_absolute()
                {
                    out.push(PathBuf::from(s));
                }
            }
            hcl::Structure::Block(block) => collect_paths(&block.body, out),
        }
    }
}

/// Every descendant of `leader` (bubblewrap), found through `/proc`: an interrupt goes
/// to these, so the tool inside can finish what it is doing while the sandbox stays up.
/// By process tree, not process group: the sandboxed program runs in a session of its own
/// (`--new-session`). The sandbox's init (bubblewrap's second process, pid 1 inside)
/// ignores a signal it has no handler for, so it stays.
pub(crate) fn descendants_of(leader: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: comm may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parent_of.push((pid, ppid));
        }
    }
    let mut found = Vec::new();
    let mut frontier = vec![leader];
    while let Some(p) = frontier.pop() {
        for (pid, ppid) in &parent_of {
            if *ppid == p && !found.contains(pid) {
                found.push(*pid);
                frontier.push(*pid);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_lists() {
        assert_eq!(
            parse_path_list("/a::/b/c").unwrap(),
            vec![PathBuf::from("/a"), PathBuf::from("/b/c")]
        );
        assert!(parse_path_list("/a:rel").is_err());
    }

    #[test]
    fn mirror_paths_are_read_from_the_cli_config() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rc");
        std::fs::write(
            &file,
            "plugin_cache_dir = \"/cache/p\"\nprovider_installation {\n  filesystem_mirror {\n    path = \"/m/mirror\"\n    include = [\"*/*\"]\n  }\n}\n",
        )
        .unwrap();
        assert_eq!(
            cli_config_paths(&file),
            vec![PathBuf::from("/cache/p"), PathBuf::from("/m/mirror")]
        );
        assert!(cli_config_paths(&dir.path().join("missing")).is_empty());
    }

    #[tokio::test]
    async fn a_runner_without_a_working_sandbox_refuses_to_start_unless_told_none() {
        let dir = tempfile::tempdir().unwrap();
        let missing = SandboxConfig {
            bwrap_bin: "/nonexistent/bwrap".into(),
            ..SandboxConfig::default()
        };
        let err = missing.check(dir.path(), None).await.unwrap_err();
        assert!(matches!(err, RunnerError::SandboxUnavailable(_)), "{err:?}");
        assert!(err.to_string().contains("install bubblewrap"), "{err}");
        // `none` is an explicit choice: nothing to check.
        let none = SandboxConfig {
            mode: SandboxMode::None,
            ..missing
        };
        none.check(dir.path(), None).await.unwrap();
        // Where bubblewrap is installed (CI installs it), the real probe passes.
        if std::path::Path::new("/usr/bin/bwrap").exists() {
            SandboxConfig::default()
                .check(dir.path(), None)
                .await
                .unwrap();
        }
    }

    #[test]
    fn only_the_run_directory_is_writable() {
        let cfg = SandboxConfig {
            ro_paths: vec!["/srv/git".into()],
            ..SandboxConfig::default()
        };
        let p = cfg.command(ChildSpec {
            program: Path::new("/usr/bin/terraform"),
            args: vec!["plan".into()],
            cwd: Path::new("/w/run_1/checkout"),
            env: vec![("PATH".into(), "/usr/bin".into())],
            writable: Path::new("/w/run_1"),
            readable: vec!["/opt/tf".into()],
            git_dir: None,
            etc: None,
            launcher: None,
        });
        assert!(p.sandboxed);
        let args: Vec<String> = p
            .cmd
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let joined = args.join(" ");
        for needed in [
            "--unshare-all",
            "--share-net",
            "--die-with-parent",
            "--cap-drop ALL",
            "--uid 65534",
            "--proc /proc",
            "--bind /w/run_1 /w/run_1",
            "--ro-bind-try /srv/git /srv/git",
            "--ro-bind-try /opt/tf /opt/tf",
            "--chdir /w/run_1/checkout -- /usr/bin/terraform plan",
        ] {
            assert!(joined.contains(needed), "{needed} missing from {joined}");
        }
        // the only writable bind is the run directory
        assert_eq!(args.iter().filter(|a| *a == "--bind").count(), 1);
        assert!(!joined.contains("/etc/shadow"));
        // The host's TLS keys stay out: the public trust stores only.
        for arg in &args {
            assert!(
                !arg.contains("private") && arg != "/etc/ssl" && arg != "/etc/pki",
                "{arg} in {joined}"
            );
        }
        assert_eq!(
            p.cmd.as_std().get_envs().count(),
            1,
            "only the built environment"
        );
    }

    #[test]
    fn a_git_cache_entry_is_bound_as_asked() {
        let cfg = SandboxConfig::default();
        let args = |writable: bool| -> String {
            cfg.command(ChildSpec {
                program: Path::new("git"),
                args: vec!["fetch".into()],
                cwd: Path::new("/w/run_1"),
                env: Vec::new(),
                writable: Path::new("/w/run_1"),
                readable: Vec::new(),
                launcher: None,
                git_dir: Some((Path::new("/w/git-cache/ab"), writable)),
                etc: None,
            })
            .cmd
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
        };
        let fetch = args(true);
        assert!(
            fetch.contains("--bind /w/git-cache/ab /w/git-cache/ab"),
            "{fetch}"
        );
        let export = args(false);
        assert!(
            export.contains("--ro-bind /w/git-cache/ab /w/git-cache/ab"),
            "{export}"
        );
        assert!(!export.contains("--bind /w/git-cache"), "{export}");
        // never the whole cache: only the one entry
        assert!(!fetch.contains("/w/git-cache "), "{fetch}");
    }

    #[test]
    fn the_runners_etc_copy_is_one_bind() {
        // bubblewrap's arguments for a plan whose /etc is the runner's copy
        let args_with_view = |cfg: SandboxConfig| -> Vec<String> {
            cfg.command(ChildSpec {
                program: Path::new("/usr/bin/terraform"),
                args: vec!["plan".into()],
                cwd: Path::new("/w/run_1"),
                env: Vec::new(),
                writable: Path::new("/w/run_1"),
                readable: Vec::new(),
                launcher: None,
                git_dir: None,
                etc: Some("/w/etc-view/0123".into()),
            })
            .cmd
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
        };
        let args = args_with_view(SandboxConfig::default());
        let joined = args.join(" ");
        assert!(
            joined.contains("--ro-bind /w/etc-view/0123 /etc"),
            "{joined}"
        );
        // no entry of /etc bound on its own besides
        assert_eq!(
            args.iter().filter(|a| a.starts_with("/etc")).count(),
            1,
            "{joined}"
        );

        // an operator's read-only path under /etc: the entries bound one by one, so its
        // mount point can be made
        let joined = args_with_view(SandboxConfig {
            ro_paths: vec!["/etc/takosumi/terraformrc".into()],
            ..SandboxConfig::default()
        })
        .join(" ");
        assert!(!joined.contains("/w/etc-view"), "{joined}");
        assert!(
            joined.contains("--ro-bind-try /etc/resolv.conf /etc/resolv.conf"),
            "{joined}"
        );
    }
}
