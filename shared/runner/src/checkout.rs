//! Checkouts, through a Git cache kept per repository URL.
//!
//! Every checkout goes through a bare repository kept for its URL (a *cache entry*), so a
//! Run fetches only what is new since the last Run of that repository instead of cloning
//! it: a branch checkout fetches the branch; a pinned checkout (an apply, a drift check)
//! fetches every branch and tag and accepts the commit only while one of them still
//! reaches it, as a fresh clone would. The commit's tree is then exported into the Run's
//! directory through a private index (`read-tree --reset -u`), so the checkout holds no
//! `.git` and nothing that points back at the cache.
//!
//! Sharing an entry between Runs, Capsules and processes is safe because:
//! - an entry is keyed by the SHA-256 of the whole URL, user-info included: a Run reaches
//!   only objects fetched with the same URL and the same credential in it;
//! - git runs in the sandbox with that one entry writable (a fetch, and the export that
//!   follows it in the same sandbox start) or read-only (resolve, a reachability check)
//!   besides the Run's directory; the tool's sandbox never sees the cache;
//! - a checkout holds the entry's lock from its fetch to its export, and garbage
//!   collection removes only an entry whose lock it gets without waiting. The lock file
//!   sits beside the entry, where no sandboxed git can reach it;
//! - a fetch killed midway leaves at most unreferenced objects (git moves a ref last).
//!
//! With the cache off (`TAKOSUMI_GIT_CACHE_DIR=off`) the same code runs with the bare
//! repository inside the Run's directory, removed with it.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use crate::RunnerError;
use crate::runner::{Runner, SourceSnapshot};
use crate::source;
use crate::workdir::Workdir;

/// How long an entry no checkout used is kept (`TAKOSUMI_GIT_CACHE_TTL_SECS`, default 7 days).
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(7 * 24 * 60 * 60);
/// How often a process looks for expired entries while checking out.
const COLLECT_EVERY: Duration = Duration::from_secs(60 * 60);

/// Where a checkout's bare repository lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GitCache {
    /// One entry per repository URL under this directory, shared by every Run.
    Shared {
        /// The cache directory (created 0700).
        root: PathBuf,
        /// Entries unused for this long are removed.
        ttl: Duration,
    },
    /// A bare repository inside each Run's directory, removed with it.
    PerRun,
}

impl GitCache {
    /// The default: a shared cache in `work_root/git-cache` (a name run directories never
    /// have, so start-up's removal of leftovers passes it by).
    pub fn beside(work_root: &Path) -> Self {
        Self::Shared {
            root: work_root.join("git-cache"),
            ttl: DEFAULT_CACHE_TTL,
        }
    }
}

/// An entry's name: the URL's SHA-256, so neither a path nor a credential in the URL
/// reaches the file system.
pub(crate) fn entry_key(repo: &str) -> String {
    hex::encode(&Sha256::digest(repo.as_bytes())[..20])
}

/// A held lock on one cache entry (released when dropped, or when the process dies).
struct EntryLock {
    _file: fs::File,
}

/// Takes `lock_path`, waiting for it. The lock file's mtime is when
/// the entry was last used. A lock file garbage collection removed while this process
/// waited is not the entry's lock any more: take the new one.
fn lock_entry(lock_path: &Path) -> std::io::Result<EntryLock> {
    loop {
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(lock_path)?;
        file.lock()?;
        let held = file.metadata()?;
        match fs::metadata(lock_path) {
            Ok(now) if now.ino() == held.ino() && now.dev() == held.dev() => {
                // Failing to mark the use only makes the entry look older.
                let _ = file.set_modified(SystemTime::now());
                return Ok(EntryLock { _file: file });
            }
            _ => continue,
        }
    }
}

/// Removes the lock files a git killed midway left in an entry (`refs/heads/main.lock`,
/// `packed-refs.lock`, `shallow.lock`, …): every later fetch would stop at them. Called
/// only while holding the entry's lock, so no git is running there. Objects a killed
/// fetch left are harmless (nothing refers to them) and stay.
pub(crate) fn clear_stale_git_locks(entry: &Path) {
    let is_lock = |p: &Path| p.extension().is_some_and(|e| e == "lock");
    if let Ok(top) = fs::read_dir(entry) {
        for file in top.flatten() {
            let path = file.path();
            if is_lock(&path) && file.file_type().is_ok_and(|t| t.is_file()) {
                tracing::info!(path = %path.display(), "removing a lock file a killed git left");
                let _ = fs::remove_file(&path);
            }
        }
    }
    for file in walkdir::WalkDir::new(entry.join("refs"))
        .follow_links(false)
        .into_iter()
        .flatten()
    {
        if file.file_type().is_file() && is_lock(file.path()) {
            tracing::info!(path = %file.path().display(), "removing a lock file a killed git left");
            let _ = fs::remove_file(file.path());
        }
    }
}

/// Removes the entries of `root` unused for `ttl` that no checkout holds; returns how
/// many. Never waits for a lock.
pub(crate) fn collect_expired(root: &Path, ttl: Duration) -> usize {
    let Ok(listing) = fs::read_dir(root) else {
        return 0;
    };
    let mut removed = 0;
    for entry in listing.flatten() {
        let name = entry.file_name();
        let Some(key) = name.to_str().and_then(|n| n.strip_suffix(".lock")) else {
            continue;
        };
        let lock_path = entry.path();
        let expired = |meta: &fs::Metadata| {
            meta.modified()
                .ok()
                .and_then(|m| m.elapsed().ok())
                .is_some_and(|age| age >= ttl)
        };
        if !fs::metadata(&lock_path).is_ok_and(|m| expired(&m)) {
            continue;
        }
        let Ok(file) = fs::OpenOptions::new().write(true).open(&lock_path) else {
            continue;
        };
        if file.try_lock().is_err() {
            continue;
        }
        // Used between the check and the lock: keep it.
        if !file.metadata().is_ok_and(|m| expired(&m)) {
            continue;
        }
        let dir = root.join(key);
        if fs::remove_dir_all(&dir).is_ok() || !dir.exists() {
            // Unlinked while held: a waiter finds the path changed and takes a new lock.
            let _ = fs::remove_file(&lock_path);
            removed += 1;
        }
    }
    removed
}

/// The bare repository a checkout uses, and whether it must be mounted into git's sandbox
/// (an entry of the shared cache) or is already inside the Run's directory.
pub(crate) struct GitDir {
    pub path: PathBuf,
    pub mounted: bool,
}

impl Runner {
    /// Checks out `commit` (or the head of `branch`) of `repo` into `wd.checkout()`
    /// through the Git cache ([`RunnerError::CommitNotFound`] if the repository does not
    /// have the commit), removes every `.terraform` entry, digests the tree and resolves
    /// `dir` as the Capsule directory ([`RunnerError::InvalidDir`] unless it is a
    /// directory inside the checkout). Links pointing outside the checkout are refused.
    pub async fn checkout(
        &self,
        wd: &Workdir,
        repo: &str,
        branch: &str,
        commit: Option<&str>,
        dir: &str,
    ) -> Result<SourceSnapshot, RunnerError> {
        Self::validate_dir(dir)?;
        source::validate_repo(repo)?;
        source::validate_branch(branch)?;
        if let Some(commit) = commit {
            source::validate_commit(commit)?;
        }
        if fs::symlink_metadata(wd.checkout()).is_ok() {
            return Err(RunnerError::Checkout(
                "this run directory already holds a checkout".into(),
            ));
        }
        let (git_dir, lock_path) = match &self.config().git_cache {
            GitCache::Shared { root, ttl } => {
                crate::workdir::ensure_work_root(root)?;
                self.collect_cache_now_and_then(root, *ttl);
                let key = entry_key(repo);
                (
                    GitDir {
                        path: root.join(&key),
                        mounted: true,
                    },
                    Some(root.join(format!("{key}.lock"))),
                )
            }
            GitCache::PerRun => (
                GitDir {
                    path: wd.root().join("git"),
                    mounted: false,
                },
                None,
            ),
        };
        // One checkout of an entry at a time: a fetch moves its refs.
        let _held = match lock_path {
            None => None,
            Some(path) => {
                let shown = path.display().to_string();
                let locked = tokio::task::spawn_blocking(move || lock_entry(&path))
                    .await
                    .map_err(|e| {
                        RunnerError::io(
                            format!("locking {shown}"),
                            std::io::Error::other(e.to_string()),
                        )
                    })?;
                Some(locked.map_err(|e| RunnerError::io(format!("locking {shown}"), e))?)
            }
        };
        if git_dir.mounted {
            clear_stale_git_locks(&git_dir.path);
        }
        self.ensure_bare(wd, &git_dir, repo).await?;
        let head = match commit {
            None => {
                // Fetch and export in one sandbox start; the export takes the fetched ref,
                // whose commit is read afterwards (the entry's lock keeps it from moving).
                let fetched = self
                    .fetch_and_export(
                        wd,
                        &git_dir,
                        repo,
                        &[&branch_refspec(branch)],
                        &format!("refs/heads/{branch}"),
                    )
                    .await?;
                fetched?;
                // Read from the entry's files: a git start in the sandbox costs more than
                // the lookup. git itself answers what this does not read.
                match read_branch_ref(&git_dir.path, branch) {
                    Some(commit) => Some(commit),
                    None => {
                        self.resolve_commit(wd, &git_dir, &format!("refs/heads/{branch}"))
                            .await?
                    }
                }
                .ok_or_else(|| {
                    RunnerError::Checkout(format!(
                        "the branch {branch:?} has no commit after fetching it"
                    ))
                })?
            }
            Some(commit) if commit.len() == 40 || commit.len() == 64 => {
                let full = commit.to_ascii_lowercase();
                let fetched = self
                    .fetch_and_export(wd, &git_dir, repo, &[ALL_HEADS, ALL_TAGS], &full)
                    .await?;
                if let Err(export) = fetched {
                    // Most often a commit the repository never had (or lost with its
                    // branch): git answers which.
                    return match self.resolve_commit(wd, &git_dir, &full).await? {
                        None => Err(RunnerError::CommitNotFound(full)),
                        Some(_) => Err(export),
                    };
                }
                self.check_reachable(wd, &git_dir, branch, &full).await?;
                full
            }
            Some(short) => {
                let full = self.fetch_pinned(wd, &git_dir, repo, short).await?;
                self.check_reachable(wd, &git_dir, branch, &full).await?;
                self.export_tree(wd, &git_dir, &full, repo).await?;
                full
            }
        };

        let checkout = wd.checkout().to_path_buf();
        let dir_owned = dir.to_owned();
        let (tree_digest, config_dir) = tokio::task::spawn_blocking(move || {
            source::remove_dot_terraform(&checkout)?;
            let digest = source::tree_digest(&checkout)?;
            let config_dir = source::resolve_config_dir(&checkout, &dir_owned)?;
            Ok::<_, RunnerError>((digest, config_dir))
        })
        .await
        .map_err(|e| {
            RunnerError::io(
                "digesting the checkout",
                std::io::Error::other(e.to_string()),
            )
        })??;
        wd.set_config_dir(config_dir);
        tracing::debug!(label = wd.label(), commit = %head, "checked out");
        Ok(SourceSnapshot {
            commit: head,
            tree_digest,
        })
    }

    /// A pinned commit given short: every branch and tag fetched (pruning what the remote
    /// deleted), then the commit's full id, [`RunnerError::CommitNotFound`] if the cache
    /// has no such commit.
    async fn fetch_pinned(
        &self,
        wd: &Workdir,
        git_dir: &GitDir,
        repo: &str,
        commit: &str,
    ) -> Result<String, RunnerError> {
        self.fetch(wd, git_dir, repo, &[ALL_HEADS, ALL_TAGS])
            .await?;
        self.resolve_commit(wd, git_dir, commit)
            .await?
            .ok_or_else(|| RunnerError::CommitNotFound(commit.to_owned()))
    }

    /// A pinned commit is accepted only while one of the repository's branches or tags
    /// (all fetched just before) still reaches it, as a fresh clone would: a commit
    /// force-pushed away is gone even though the cache still holds its objects, and a
    /// reviewed commit someone removed is not applied. When the Capsule's branch still
    /// points at the commit (an apply soon after its plan) that is read from the entry's
    /// ref files, without asking git which refs contain it.
    async fn check_reachable(
        &self,
        wd: &Workdir,
        git_dir: &GitDir,
        branch: &str,
        full: &str,
    ) -> Result<(), RunnerError> {
        if read_branch_ref(&git_dir.path, branch).as_deref() == Some(full) {
            return Ok(());
        }
        let mut args = git_dir.git_dir_args();
        args.extend(
            [
                "for-each-ref",
                "--count=1",
                "--format=%(refname)",
                "--contains",
                full,
                "refs/heads",
                "refs/tags",
            ]
            .into_iter()
            .map(OsString::from),
        );
        // An object the cache does not have is an error exit: not found either way.
        let found = self
            .git_captured(wd, wd.root(), &args, git_dir.mount(false), None)
            .await?;
        if found.exit_code != 0 || found.stdout.iter().all(u8::is_ascii_whitespace) {
            return Err(RunnerError::CommitNotFound(full.to_owned()));
        }
        Ok(())
    }

    /// Fetches `refspecs` (as [`Self::fetch`]) and exports `what` (a full ref name or
    /// commit id) into `wd.checkout()` (as [`Self::export_tree`]) in one sandbox start:
    /// each start costs more than the git command it runs. The entry is writable for the
    /// whole script, the export included; the export writes only the Run's directory.
    /// `Ok(Err(_))`: the fetch worked and the export did not (`what` may not exist).
    async fn fetch_and_export(
        &self,
        wd: &Workdir,
        git_dir: &GitDir,
        repo: &str,
        refspecs: &[&str],
        what: &str,
    ) -> Result<Result<(), RunnerError>, RunnerError> {
        // Exit 101: the fetch failed; 102: the export did.
        const SCRIPT: &str = r#"gd=$1 repo=$2 what=$3 wt=$4 idx=$5
shift 5
g "$gd" fetch --quiet --no-tags --prune --no-write-fetch-head -- "$repo" "$@" || exit 101
export GIT_INDEX_FILE="$idx"
g "$gd" "$wt" read-tree --reset -u "$what" || exit 102
"#;
        self.create_checkout_dir(wd)?;
        let index = wd.root().join("checkout.index");
        let mut args = git_dir.git_dir_args();
        args.push(repo.into());
        args.push(what.into());
        args.push(format!("--work-tree={}", wd.checkout().display()).into());
        args.push(index.as_os_str().to_owned());
        args.extend(refspecs.iter().map(OsString::from));
        let cmd = self.git_script_command(wd, SCRIPT, &args, git_dir.mount(true));
        let result = self.run_git(cmd).await;
        let _ = fs::remove_file(&index);
        let captured = result?;
        match captured.exit_code {
            0 => Ok(Ok(())),
            102 => Ok(Err(self.git_failure(&captured, repo))),
            _ => Err(self.git_failure(&captured, repo)),
        }
    }

    fn create_checkout_dir(&self, wd: &Workdir) -> Result<(), RunnerError> {
        fs::DirBuilder::new()
            .mode(0o700)
            .create(wd.checkout())
            .map_err(|e| RunnerError::io(format!("creating {}", wd.checkout().display()), e))
    }

    /// `git init --bare` unless the entry is one already.
    async fn ensure_bare(
        &self,
        wd: &Workdir,
        git_dir: &GitDir,
        repo: &str,
    ) -> Result<(), RunnerError> {
        if git_dir.path.join("HEAD").is_file() {
            return Ok(());
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&git_dir.path)
            .map_err(|e| RunnerError::io(format!("creating {}", git_dir.path.display()), e))?;
        let args: [&OsStr; 4] = [
            "init".as_ref(),
            "--bare".as_ref(),
            "--quiet".as_ref(),
            git_dir.path.as_os_str(),
        ];
        self.git(wd, wd.root(), &args, repo, git_dir.mount(true), None)
            .await
            .map(drop)
    }

    /// Fetches `refspecs` of `repo` into the bare repository, whole history (after the
    /// first fetch only what is new arrives), removing refs the remote no longer has.
    async fn fetch(
        &self,
        wd: &Workdir,
        git_dir: &GitDir,
        repo: &str,
        refspecs: &[&str],
    ) -> Result<(), RunnerError> {
        let mut args: Vec<OsString> = git_dir.git_dir_args();
        args.extend(
            [
                "fetch",
                "--quiet",
                "--no-tags",
                "--prune",
                "--no-write-fetch-head",
                "--",
                repo,
            ]
            .into_iter()
            .map(OsString::from),
        );
        args.extend(refspecs.iter().map(OsString::from));
        self.git(wd, wd.root(), &args, repo, git_dir.mount(true), None)
            .await
            .map(drop)
    }

    /// The full id of `spec` as a commit in the bare repository, `None` if it has none.
    async fn resolve_commit(
        &self,
        wd: &Workdir,
        git_dir: &GitDir,
        spec: &str,
    ) -> Result<Option<String>, RunnerError> {
        let mut args = git_dir.git_dir_args();
        args.extend(
            ["rev-parse", "--verify", "--quiet"]
                .into_iter()
                .map(OsString::from),
        );
        args.push(format!("{spec}^{{commit}}").into());
        let found = self
            .git_captured(wd, wd.root(), &args, git_dir.mount(false), None)
            .await?;
        let full = String::from_utf8_lossy(&found.stdout).trim().to_owned();
        Ok((found.exit_code == 0 && !full.is_empty()).then_some(full))
    }

    /// Writes `commit`'s tree into `wd.checkout()` through an index file in the Run's
    /// directory (the cache stays read-only).
    async fn export_tree(
        &self,
        wd: &Workdir,
        git_dir: &GitDir,
        commit: &str,
        repo: &str,
    ) -> Result<(), RunnerError> {
        self.create_checkout_dir(wd)?;
        let index = wd.root().join("checkout.index");
        let mut args = git_dir.git_dir_args();
        args.push(format!("--work-tree={}", wd.checkout().display()).into());
        args.extend(
            ["read-tree", "--reset", "-u", commit]
                .into_iter()
                .map(OsString::from),
        );
        let result = self
            .git(
                wd,
                wd.checkout(),
                &args,
                repo,
                git_dir.mount(false),
                Some(&index),
            )
            .await;
        let _ = fs::remove_file(&index);
        result.map(drop)
    }

    /// At start-up and then at most hourly: removes expired cache entries.
    fn collect_cache_now_and_then(&self, root: &Path, ttl: Duration) {
        if !self.cache_collection_due(COLLECT_EVERY) {
            return;
        }
        let root = root.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let removed = collect_expired(&root, ttl);
            if removed > 0 {
                tracing::info!(removed, cache = %root.display(), "removed unused git cache entries");
            }
        });
    }
}

impl GitDir {
    fn git_dir_args(&self) -> Vec<OsString> {
        let mut arg = OsString::from("--git-dir=");
        arg.push(&self.path);
        vec![arg]
    }

    /// How git's sandbox sees the entry: writable for init and fetch, read-only otherwise;
    /// nothing to add when the repository is inside the Run's directory.
    fn mount(&self, writable: bool) -> Option<(&Path, bool)> {
        self.mounted.then_some((self.path.as_path(), writable))
    }
}

/// The commit `refs/heads/<branch>` names in the bare repository at `git_dir`, read from its
/// loose ref file or `packed-refs`. git refuses to point a branch at anything but a commit, so
/// the id is one. `None` when this cannot tell (a branch name with `.`/`..`/empty components,
/// a ref store in another format, a link where a file should be): ask git instead.
fn read_branch_ref(git_dir: &Path, branch: &str) -> Option<String> {
    let normal = branch
        .split('/')
        .all(|c| !c.is_empty() && c != "." && c != "..");
    if !normal || branch.contains('\0') {
        return None;
    }
    let refname = format!("refs/heads/{branch}");
    let object_id = |s: &str| {
        let s = s.trim();
        (matches!(s.len(), 40 | 64) && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| s.to_owned())
    };
    let loose = git_dir.join(&refname);
    match fs::symlink_metadata(&loose) {
        Ok(meta) if meta.is_file() => {
            return fs::read_to_string(&loose).ok().and_then(|s| object_id(&s));
        }
        Ok(_) => return None,
        Err(_) => {}
    }
    let packed = git_dir.join("packed-refs");
    if !fs::symlink_metadata(&packed).is_ok_and(|m| m.is_file()) {
        return None;
    }
    fs::read_to_string(&packed)
        .ok()?
        .lines()
        .filter(|line| !line.starts_with('#') && !line.starts_with('^'))
        .find_map(|line| {
            let (id, name) = line.split_once(' ')?;
            (name == refname).then(|| object_id(id)).flatten()
        })
}

/// Every branch and every tag, as a clone has them.
const ALL_HEADS: &str = "+refs/heads/*:refs/heads/*";
const ALL_TAGS: &str = "+refs/tags/*:refs/tags/*";

fn branch_refspec(branch: &str) -> String {
    format!("+refs/heads/{branch}:refs/heads/{branch}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_branch_ref_is_read_loose_or_packed_and_anything_odd_is_left_to_git() {
        let dir = tempfile::tempdir().unwrap();
        let git = dir.path();
        let a = "a".repeat(40);
        let b = "0123456789abcdef0123456789abcdef01234567";
        fs::create_dir_all(git.join("refs/heads/team")).unwrap();
        fs::write(git.join("refs/heads/main"), format!("{a}\n")).unwrap();
        fs::write(
            git.join("packed-refs"),
            format!("# pack-refs with: peeled fully-peeled sorted\n{b} refs/heads/team/x\n^{a}\n"),
        )
        .unwrap();
        assert_eq!(read_branch_ref(git, "main"), Some(a.clone()));
        assert_eq!(read_branch_ref(git, "team/x"), Some(b.to_owned()));
        assert_eq!(read_branch_ref(git, "absent"), None, "git is asked");
        for odd in ["../main", "team/../main", "./main", "team//x", ""] {
            assert_eq!(read_branch_ref(git, odd), None, "{odd:?}");
        }
        fs::write(git.join("refs/heads/short"), "abc\n").unwrap();
        assert_eq!(read_branch_ref(git, "short"), None, "not an object id");
        std::os::unix::fs::symlink(git.join("refs/heads/main"), git.join("refs/heads/link"))
            .unwrap();
        assert_eq!(read_branch_ref(git, "link"), None, "a link is left to git");
    }

    #[test]
    fn entries_are_keyed_by_the_whole_url() {
        let plain = entry_key("https://git.example/acme/infra.git");
        let with_token = entry_key("https://bot:tok3n@git.example/acme/infra.git");
        let other_token = entry_key("https://bot:other@git.example/acme/infra.git");
        assert_ne!(plain, with_token);
        assert_ne!(with_token, other_token);
        assert_eq!(plain, entry_key("https://git.example/acme/infra.git"));
        assert_eq!(plain.len(), 40);
        assert!(plain.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn collection_removes_only_expired_unheld_entries() {
        let root = tempfile::tempdir().unwrap();
        let make = |key: &str, age: Duration| {
            fs::create_dir(root.path().join(key)).unwrap();
            fs::write(root.path().join(key).join("HEAD"), "ref: refs/heads/main\n").unwrap();
            let lock = fs::File::create(root.path().join(format!("{key}.lock"))).unwrap();
            lock.set_modified(SystemTime::now() - age).unwrap();
        };
        let day = Duration::from_secs(24 * 60 * 60);
        make("fresh", Duration::ZERO);
        make("old", 8 * day);
        make("held", 8 * day);
        let held = lock_entry_without_touching(&root.path().join("held.lock"));

        assert_eq!(collect_expired(root.path(), 7 * day), 1);
        assert!(root.path().join("fresh").is_dir());
        assert!(!root.path().join("old").exists());
        assert!(!root.path().join("old.lock").exists());
        assert!(root.path().join("held").is_dir(), "a held entry stays");
        drop(held);
        // A process another test starts can hold a copy of the lock's descriptor for the
        // moment between its fork and exec; collection never waits, so it takes the entry
        // on a later pass (in service: the next hourly one).
        let mut removed = 0;
        for _ in 0..50 {
            removed = collect_expired(root.path(), 7 * day);
            if removed == 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(removed, 1);
        assert!(!root.path().join("held").exists());
    }

    #[test]
    fn a_lock_taken_after_collection_is_a_new_file() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("k.lock");
        drop(lock_entry(&path).unwrap());
        fs::remove_file(&path).unwrap();
        let _second = lock_entry(&path).unwrap();
        assert!(path.exists(), "the lock file is made again");
        // held: collection, which never waits, leaves it
        let file = fs::OpenOptions::new().write(true).open(&path).unwrap();
        assert!(file.try_lock().is_err());
    }

    fn lock_entry_without_touching(path: &Path) -> fs::File {
        let file = fs::OpenOptions::new().write(true).open(path).unwrap();
        file.lock_shared().unwrap();
        file
    }
}
