//! One run's private directory.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::RunnerError;
use crate::session::Session;

/// A private (0700) directory for one run, wiped and removed when dropped:
///
/// ```text
/// <work_root>/<label>.<random>/
///   checkout/   the git checkout; config_dir() is checkout/<capsule dir>
///   state/      terraform.tfstate — outside the checkout, where the backend override points
///   plan/       tfplan — the saved plan while it is unsealed
///   home/       an empty HOME for git and the tool
/// ```
#[derive(Debug)]
pub struct Workdir {
    root: PathBuf,
    checkout: PathBuf,
    state_path: PathBuf,
    plan_path: PathBuf,
    home: PathBuf,
    label: String,
    config_dir: OnceLock<PathBuf>,
    /// The step's sandbox, started by its first tool command (see [`crate::session`]).
    pub(crate) session: tokio::sync::Mutex<Option<Session>>,
}

impl Workdir {
    /// Creates `<work_root>/<label>.<random>` with mode 0700 and its subdirectories.
    pub(crate) fn create(work_root: &Path, label: &str) -> Result<Self, RunnerError> {
        if label.is_empty()
            || label.len() > 100
            || !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(RunnerError::InvalidLabel(label.to_owned()));
        }
        ensure_work_root(work_root)?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("{label}.{}.", owner_token()))
            .permissions(fs::Permissions::from_mode(0o700))
            .tempdir_in(work_root)
            .map_err(|e| {
                RunnerError::io(
                    format!("creating a run directory under {}", work_root.display()),
                    e,
                )
            })?
            .keep();
        // From here on, Drop cleans up whatever happens.
        let mut wd = Self {
            checkout: dir.join("checkout"),
            state_path: dir.join("state").join("terraform.tfstate"),
            plan_path: dir.join("plan").join("tfplan"),
            home: dir.join("home"),
            label: label.to_owned(),
            config_dir: OnceLock::new(),
            session: tokio::sync::Mutex::new(None),
            root: dir,
        };
        // Not subject to the umask: set it, then check it.
        fs::set_permissions(&wd.root, fs::Permissions::from_mode(0o700))
            .map_err(|e| RunnerError::io(format!("restricting {}", wd.root.display()), e))?;
        let mode = fs::symlink_metadata(&wd.root)
            .map_err(|e| RunnerError::io(format!("inspecting {}", wd.root.display()), e))?
            .permissions()
            .mode();
        if mode & 0o777 != 0o700 {
            return Err(RunnerError::io(
                format!(
                    "run directory {} has mode {:o}, expected 0700",
                    wd.root.display(),
                    mode & 0o777
                ),
                io::Error::from(io::ErrorKind::PermissionDenied),
            ));
        }
        let canonical = wd
            .root
            .canonicalize()
            .map_err(|e| RunnerError::io(format!("resolving {}", wd.root.display()), e))?;
        if canonical != wd.root {
            wd.checkout = canonical.join("checkout");
            wd.state_path = canonical.join("state").join("terraform.tfstate");
            wd.plan_path = canonical.join("plan").join("tfplan");
            wd.home = canonical.join("home");
            wd.root = canonical;
        }
        for sub in ["state", "plan", "home"] {
            let path = wd.root.join(sub);
            fs::DirBuilder::new()
                .mode(0o700)
                .create(&path)
                .map_err(|e| RunnerError::io(format!("creating {}", path.display()), e))?;
        }
        Ok(wd)
    }

    /// The run directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The label (run id) the directory was created for.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The git checkout (`root/checkout`).
    pub fn checkout(&self) -> &Path {
        &self.checkout
    }

    /// The Capsule's directory inside the checkout, resolved at checkout time (the tool's
    /// working directory). Before a checkout: the checkout root.
    pub fn config_dir(&self) -> &Path {
        self.config_dir
            .get()
            .map_or(self.checkout.as_path(), PathBuf::as_path)
    }

    pub(crate) fn set_config_dir(&self, dir: PathBuf) {
        let _ = self.config_dir.set(dir);
    }

    /// The local state file the backend override points at, outside the checkout.
    pub fn state_path(&self) -> &Path {
        &self.state_path
    }

    /// The saved plan (`root/plan/tfplan`).
    pub fn plan_path(&self) -> &Path {
        &self.plan_path
    }

    /// Where the saved plan's sealed copy is staged on its way to or from storage
    /// (`root/plan/tfplan.sealed`, beside the plan, outside the checkout).
    pub fn sealed_plan_path(&self) -> PathBuf {
        self.plan_path.with_extension("sealed")
    }

    /// The empty HOME given to git and the tool.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// Wipes the plan file and removes the directory now, reporting failure (dropping does
    /// the same silently).
    pub fn close(mut self) -> Result<(), RunnerError> {
        let result = self.cleanup();
        self.root = PathBuf::new();
        result
    }

    fn cleanup(&self) -> Result<(), RunnerError> {
        // The step's sandbox ends before its directory goes (no await point holds the lock
        // across a drop; a command still running holds it, and the Workdir outlives it).
        if let Ok(mut session) = self.session.try_lock() {
            session.take();
        }
        if self.root.as_os_str().is_empty() {
            return Ok(());
        }
        if ensure_inside(&self.root, &self.plan_path).is_ok() {
            wipe_file(&self.plan_path)?;
        }
        match fs::remove_dir_all(&self.root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(_) => {
                // Something made a directory read-only (module caches do): open it up, retry.
                make_writable(&self.root);
                fs::remove_dir_all(&self.root)
                    .map_err(|e| RunnerError::io(format!("removing {}", self.root.display()), e))
            }
        }
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        if let Err(e) = self.cleanup() {
            tracing::warn!(error = %e, "could not remove a run directory");
        }
    }
}

/// `<pid>-<start time>` of this process: a run directory is named with it, so a handler
/// that starts can tell the directories of live processes (another handler sharing the
/// work root) from those a killed process left behind, even when a pid is reused.
pub(crate) fn owner_token() -> String {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN
        .get_or_init(|| {
            let pid = std::process::id();
            format!("{pid}-{}", start_time(pid).unwrap_or(0))
        })
        .clone()
}

/// Field 22 of `/proc/<pid>/stat`: when the process started (clock ticks since boot).
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn owner_alive(token: &str) -> bool {
    let Some((pid, start)) = token.split_once('-') else {
        return false;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return false;
    };
    start_time(pid) == Some(start)
}

/// Removes every run directory under `work_root` whose owning process is gone (see
/// [`owner_token`]); returns how many. Entries of live processes, and anything not named
/// like a run directory, stay.
pub(crate) fn remove_leftovers(work_root: &Path) -> usize {
    let Ok(entries) = fs::read_dir(work_root) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let mut parts = name.splitn(3, '.');
        let (Some(_label), Some(token), Some(_random)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if !token.contains('-') || owner_alive(token) {
            continue;
        }
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !is_dir {
            continue;
        }
        let _ = wipe_file(&path.join("plan").join("tfplan"));
        if fs::remove_dir_all(&path).is_err() {
            make_writable(&path);
            let _ = fs::remove_dir_all(&path);
        }
        if !path.exists() {
            removed += 1;
        }
    }
    removed
}

/// Refuses `path` unless it lies inside `root` without passing through a link: the
/// sandboxed tool writes in the run directory, and a link it left (`state -> /var/…`)
/// must not make the handler read, write or wipe a file outside. Nothing of the Capsule's
/// code runs when the handler reads (a step's launcher, idle between commands, killed every
/// other process before it reported the command's end; git, which may be exporting the
/// checkout meanwhile, writes only inside `checkout/`), so nothing can swap a link in after
/// the check.
pub(crate) fn ensure_inside(root: &Path, path: &Path) -> Result<(), RunnerError> {
    let outside = || {
        RunnerError::LinkOutside(format!(
            "{} is reached through a link; the run's directory was tampered with",
            path.display()
        ))
    };
    let rel = path.strip_prefix(root).map_err(|_| outside())?;
    let mut at = root.to_path_buf();
    for part in rel.components() {
        at.push(part);
        match fs::symlink_metadata(&at) {
            Ok(meta) if meta.file_type().is_symlink() => return Err(outside()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(RunnerError::io(format!("inspecting {}", at.display()), e)),
        }
    }
    Ok(())
}

pub(crate) fn ensure_work_root(work_root: &Path) -> Result<(), RunnerError> {
    if work_root.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(work_root)
        .map_err(|e| RunnerError::io(format!("creating {}", work_root.display()), e))
}

fn make_writable(root: &Path) {
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .into_iter()
        .flatten()
    {
        if entry.file_type().is_dir() {
            let _ = fs::set_permissions(entry.path(), fs::Permissions::from_mode(0o700));
        }
    }
}

/// Writes `bytes` to a new file at `path` with mode 0600, replacing any file there.
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<(), RunnerError> {
    let ctx = || format!("writing {}", path.display());
    let tmp = path.with_extension("tmp-takosumi");
    let _ = fs::remove_file(&tmp);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| RunnerError::io(ctx(), e))?;
    file.write_all(bytes)
        .map_err(|e| RunnerError::io(ctx(), e))?;
    // No fsync: a run directory is scratch that dies with the run (after a crash nothing
    // reads it again), and a sync here cost ~1 ms on the way to every tool command.
    drop(file);
    fs::rename(&tmp, path).map_err(|e| RunnerError::io(ctx(), e))
}

/// Creates (or replaces) a file only its owner can read and write.
pub fn create_private_file(path: &Path) -> io::Result<fs::File> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// Reads `path`; `None` if it does not exist.
pub(crate) fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, RunnerError> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(RunnerError::io(format!("reading {}", path.display()), e)),
    }
}

/// Overwrites the file with zeros, syncs, removes it. A missing file is fine.
pub(crate) fn wipe_file(path: &Path) -> Result<(), RunnerError> {
    let ctx = || format!("wiping {}", path.display());
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(RunnerError::io(ctx(), e)),
    };
    if meta.is_file() {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| RunnerError::io(ctx(), e))?;
        let zeros = vec![0u8; 64 * 1024];
        let mut left = meta.len();
        while left > 0 {
            let n = usize::try_from(left.min(zeros.len() as u64)).unwrap_or(zeros.len());
            file.write_all(&zeros[..n])
                .map_err(|e| RunnerError::io(ctx(), e))?;
            left -= n as u64;
        }
        file.sync_all().map_err(|e| RunnerError::io(ctx(), e))?;
    }
    fs::remove_file(path).map_err(|e| RunnerError::io(ctx(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_directory_lifecycle() {
        let base = tempfile::tempdir().unwrap();
        let work_root = base.path().join("runs/nested");
        let wd = Workdir::create(&work_root, "run_01J-x").unwrap();
        let root = wd.root().to_path_buf();
        assert!(root.starts_with(work_root.canonicalize().unwrap()));
        assert!(
            root.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("run_01J-x.")
        );
        assert_eq!(
            fs::metadata(&root).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert!(wd.home().is_dir());
        assert!(wd.state_path().parent().unwrap().is_dir());
        assert!(!wd.state_path().starts_with(wd.checkout()));
        assert_eq!(wd.plan_path(), root.join("plan/tfplan"));
        assert_eq!(wd.config_dir(), wd.checkout());

        write_private(wd.plan_path(), b"plan-bytes").unwrap();
        assert_eq!(
            fs::metadata(wd.plan_path()).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // A read-only directory does not stop the cleanup.
        fs::create_dir_all(root.join("checkout/ro/sub")).unwrap();
        fs::set_permissions(root.join("checkout/ro"), fs::Permissions::from_mode(0o500)).unwrap();
        drop(wd);
        assert!(!root.exists());

        let wd = Workdir::create(&work_root, "second").unwrap();
        let root = wd.root().to_path_buf();
        wd.close().unwrap();
        assert!(!root.exists());
    }

    #[test]
    fn labels_are_checked() {
        let base = tempfile::tempdir().unwrap();
        for bad in ["", "../x", "a/b", "a b", ".", &"x".repeat(101)] {
            assert!(
                matches!(
                    Workdir::create(base.path(), bad),
                    Err(RunnerError::InvalidLabel(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn wipe_zeroes_then_removes() {
        let base = tempfile::tempdir().unwrap();
        let p = base.path().join("f");
        wipe_file(&p).unwrap();
        write_private(&p, &[7u8; 100_000]).unwrap();
        assert_eq!(read_optional(&p).unwrap().unwrap().len(), 100_000);
        wipe_file(&p).unwrap();
        assert!(!p.exists());
        assert_eq!(read_optional(&p).unwrap(), None);
    }
}
