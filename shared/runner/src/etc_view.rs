//! The `/etc` a sandbox sees: a copy of the few host files a child may read
//! ([`ETC_FILES`]), kept by the runner in one directory and bound as the sandbox's whole
//! `/etc` with one mount.
//!
//! Why a copy: bubblewrap re-reads and parses `/proc/self/mountinfo` for every bind it
//! makes, so the ~18 binds of separate `/etc` files cost ~3 ms of every sandbox start
//! (8.9 against 5.5-6.3 ms, BENCHMARKS.md session 15), about seven times per pipeline Run.
//! One directory is one bind.
//!
//! What it must keep:
//! - **nothing more than the list**: the copy holds exactly the listed entries (symlinks
//!   inside a listed directory stay symlinks, resolved in the sandbox as they would be
//!   when bound); never a key, never `/etc/ssl/private`;
//! - **fresh**: the listed entries' metadata (type, size, mtime, inode, mode, link target)
//!   is fingerprinted at most once per [`RECHECK`]; a change (a new `resolv.conf`, new CA
//!   roots) makes a new copy, named by the fingerprint, for sandboxes started from then on;
//! - **never pulled out from under a running sandbox**: a copy is made in a temporary
//!   directory and renamed into place complete; a process marks the copy it uses
//!   (its mtime) at each check; a copy is removed only once unmarked for longer than the
//!   longest step may run, so no sandbox can still have it bound.
//!
//! When a copy cannot be made (an unreadable entry, a full disk), the sandbox falls back to
//! binding the entries one by one: slower, the same view.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};

/// Files and directories under `/etc` a child may read (name resolution, TLS roots, the
/// dynamic linker's cache, Debian's alternatives). Nothing else of `/etc` is visible: no
/// shadow file, no service configuration.
pub(crate) const ETC_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/nsswitch.conf",
    "/etc/services",
    "/etc/protocols",
    "/etc/passwd",
    "/etc/group",
    "/etc/localtime",
    // The public trust stores only, never `/etc/ssl` or `/etc/pki` whole: their `private`
    // directories hold the host's TLS keys (Debian's `ssl-cert-snakeoil.key`, which a
    // Postgres may serve TLS with). The sandbox's uid maps to the runner's, so when the
    // runner is root, a key only root may read is readable in here.
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/pki/ca-trust",
    "/etc/pki/tls/certs",
    "/etc/pki/tls/cert.pem",
    "/etc/pki/tls/openssl.cnf",
];

/// How often the listed entries are looked at again for changes.
pub(crate) const RECHECK: Duration = Duration::from_secs(1);

/// How often the refresher looks: often enough that a sandbox start finds a check younger
/// than [`RECHECK`] and does not wait for one (a start that finds none, the refresher
/// being late on a loaded machine, checks itself), rarely enough to cost no more than
/// checking at starts did (one walk a second while busy).
const REFRESH: Duration = Duration::from_millis(900);

/// The refresher stops after this long without a sandbox start (the next start checks,
/// once, itself, and starts it again): an idle handler does not keep walking `/etc`.
const KEEP_WARM: Duration = Duration::from_secs(30);

/// A directory of the copy never holds more than this many entries: a listed directory
/// that grew past it (or a loop) is not copied, and the per-entry binds are used.
const MAX_ENTRIES: usize = 20_000;

/// The runner's copy of the listed `/etc` entries, shared by its sandboxes.
#[derive(Debug)]
pub(crate) struct EtcView {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `<work root>/etc-view`: one directory per fingerprint.
    root: PathBuf,
    /// Where the listed entries are read from (`/`; a test's own tree).
    host_root: PathBuf,
    /// A copy older than this, unmarked, is no longer bound anywhere.
    keep_unused: Duration,
    /// See [`KEEP_WARM`].
    keep_warm: Duration,
    current: Mutex<Option<Current>>,
    warm: Mutex<Warm>,
}

#[derive(Debug, Clone)]
struct Current {
    checked: Instant,
    fingerprint: String,
    /// `None`: the copy could not be made for this fingerprint (already logged).
    dir: Option<PathBuf>,
}

/// Whether the refresher runs, and when a sandbox last asked for the view.
#[derive(Debug)]
struct Warm {
    asked: Instant,
    refreshing: bool,
}

impl EtcView {
    /// A view kept under `work_root/etc-view` (a name run directories never have), whose
    /// unused copies are removed after `keep_unused`.
    pub(crate) fn new(work_root: &Path, keep_unused: Duration) -> Self {
        Self::with_host_root(work_root, Path::new("/"), keep_unused, KEEP_WARM)
    }

    fn with_host_root(
        work_root: &Path,
        host_root: &Path,
        keep_unused: Duration,
        keep_warm: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                root: work_root.join("etc-view"),
                host_root: host_root.to_path_buf(),
                keep_unused,
                keep_warm,
                current: Mutex::new(None),
                warm: Mutex::new(Warm {
                    asked: Instant::now(),
                    refreshing: false,
                }),
            }),
        }
    }

    /// The directory to bind at the sandbox's `/etc`, up to date within [`RECHECK`];
    /// `None` when no copy can be made (bind the entries one by one).
    ///
    /// The check (the listed entries' metadata, some 700 of them on Debian: 2-3 ms) runs
    /// on a refresher thread while sandboxes keep starting, not in a sandbox start's
    /// path; only the first start (and the first after [`KEEP_WARM`] idle) checks itself.
    pub(crate) fn dir(&self) -> Option<PathBuf> {
        self.keep_refreshing();
        if let Some(c) = self.inner.current()
            && c.checked.elapsed() < RECHECK
        {
            return c.dir;
        }
        self.inner.refresh()
    }

    /// Notes a sandbox start, and starts the refresher unless it runs.
    fn keep_refreshing(&self) {
        let mut warm = lock(&self.inner.warm);
        warm.asked = Instant::now();
        if warm.refreshing {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let started = std::thread::Builder::new()
            .name("etc-view".into())
            .spawn(move || inner.refresher());
        // Without a thread every start checks itself, as the first one does.
        warm.refreshing = started.is_ok();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Inner {
    fn current(&self) -> Option<Current> {
        lock(&self.current).clone()
    }

    /// Checks the listed entries now: the copy for what they are (made if new, marked
    /// used), which sandboxes started from now on bind.
    fn refresh(&self) -> Option<PathBuf> {
        // Read without the lock held: a start meanwhile takes the copy checked before.
        let fingerprint = self.fingerprint();
        let known = self
            .current()
            .filter(|c| c.fingerprint == fingerprint)
            .map(|c| c.dir);
        let dir = match known {
            Some(dir) => dir,
            // Two checks making the same copy at once: the second uses the first's.
            None => self.materialize(&fingerprint),
        };
        if let Some(dir) = &dir {
            mark_used(dir);
        }
        *lock(&self.current) = Some(Current {
            checked: Instant::now(),
            fingerprint,
            dir: dir.clone(),
        });
        dir
    }

    /// The refresher thread: checks every [`REFRESH`] until no sandbox started for
    /// `keep_warm`.
    fn refresher(&self) {
        loop {
            std::thread::sleep(REFRESH);
            {
                let mut warm = lock(&self.warm);
                if warm.asked.elapsed() > self.keep_warm {
                    warm.refreshing = false;
                    return;
                }
            }
            self.refresh();
        }
    }

    fn host(&self, listed: &str) -> PathBuf {
        self.host_root
            .join(listed.strip_prefix('/').unwrap_or(listed))
    }

    /// The listed entries' metadata, as one digest: what a copy is named by.
    fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        for listed in ETC_FILES {
            h.update(listed.as_bytes());
            h.update([0]);
            let src = self.host(listed);
            // the entry itself as bubblewrap would bind it: a link followed
            let Ok(meta) = fs::metadata(&src) else {
                h.update(b"absent\0");
                continue;
            };
            digest_meta(&mut h, &meta, None);
            if meta.is_dir() {
                for entry in walkdir::WalkDir::new(&src)
                    .follow_links(false)
                    .min_depth(1)
                    .sort_by_file_name()
                    .into_iter()
                    .take(MAX_ENTRIES + 1)
                {
                    let Ok(entry) = entry else {
                        h.update(b"unreadable\0");
                        continue;
                    };
                    let rel = entry.path().strip_prefix(&src).unwrap_or(entry.path());
                    h.update(rel.as_os_str().as_encoded_bytes());
                    h.update([0]);
                    match entry.metadata() {
                        Ok(m) => {
                            let link = m
                                .file_type()
                                .is_symlink()
                                .then(|| fs::read_link(entry.path()).ok())
                                .flatten();
                            digest_meta(&mut h, &m, link.as_deref());
                        }
                        Err(_) => h.update(b"unreadable\0"),
                    }
                }
            }
        }
        hex::encode(&h.finalize()[..16])
    }

    /// The copy for `fingerprint`, made now unless a process already made it.
    fn materialize(&self, fingerprint: &str) -> Option<PathBuf> {
        let dir = self.root.join(fingerprint);
        if dir.is_dir() {
            return Some(dir);
        }
        match self.copy_into(&dir) {
            Ok(()) => {
                tracing::info!(dir = %dir.display(), "the sandboxes' /etc copied afresh");
                self.collect_unused(&dir);
                Some(dir)
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "could not copy the sandboxes' /etc; binding its entries one by one"
                );
                None
            }
        }
    }

    fn copy_into(&self, dir: &Path) -> std::io::Result<()> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)?;
        let tmp = tempfile::Builder::new()
            .prefix(".making-")
            .tempdir_in(&self.root)?;
        let etc = tmp.path();
        fs::set_permissions(etc, fs::Permissions::from_mode(0o755))?;
        for listed in ETC_FILES {
            let src = self.host(listed);
            let Ok(meta) = fs::metadata(&src) else {
                continue;
            };
            let rel = listed.strip_prefix("/etc/").unwrap_or(listed);
            let dest = etc.join(rel);
            if let Some(parent) = dest.parent() {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(parent)?;
            }
            if meta.is_dir() {
                copy_tree(&src, &dest)?;
            } else {
                fs::copy(&src, &dest)?;
            }
        }
        let made = tmp.keep();
        match fs::rename(&made, dir) {
            Ok(()) => Ok(()),
            // Another process made the same copy first: use it.
            Err(_) if dir.is_dir() => {
                let _ = fs::remove_dir_all(&made);
                Ok(())
            }
            Err(e) => {
                let _ = fs::remove_dir_all(&made);
                Err(e)
            }
        }
    }

    /// Removes copies (and abandoned half-made ones) unmarked for longer than
    /// `keep_unused`, never `keep`.
    fn collect_unused(&self, keep: &Path) {
        let Ok(listing) = fs::read_dir(&self.root) else {
            return;
        };
        for entry in listing.flatten() {
            let path = entry.path();
            if path == keep {
                continue;
            }
            let unused_for = entry
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|m| m.elapsed().ok());
            if unused_for.is_some_and(|age| age > self.keep_unused) {
                let _ = fs::remove_dir_all(&path);
            }
        }
    }
}

fn digest_meta(h: &mut Sha256, meta: &fs::Metadata, link: Option<&Path>) {
    let kind: u8 = if meta.file_type().is_symlink() {
        b'l'
    } else if meta.is_dir() {
        b'd'
    } else {
        b'f'
    };
    h.update([kind]);
    for n in [
        meta.len(),
        meta.ino(),
        meta.dev(),
        u64::from(meta.mode()),
        meta.mtime() as u64,
        meta.mtime_nsec() as u64,
    ] {
        h.update(n.to_le_bytes());
    }
    if let Some(link) = link {
        h.update(link.as_os_str().as_encoded_bytes());
    }
    h.update([0]);
}

/// Copies the directory `src` to `dest`: directories and regular files, symlinks as
/// symlinks (they resolve inside the sandbox, as they would in a bind of `src`).
fn copy_tree(src: &Path, dest: &Path) -> std::io::Result<()> {
    let mut entries = 0usize;
    for entry in walkdir::WalkDir::new(src).follow_links(false) {
        let entry = entry.map_err(std::io::Error::other)?;
        entries += 1;
        if entries > MAX_ENTRIES {
            return Err(std::io::Error::other(format!(
                "{} holds more than {MAX_ENTRIES} entries",
                src.display()
            )));
        }
        let rel = entry
            .path()
            .strip_prefix(src)
            .map_err(std::io::Error::other)?;
        let to = dest.join(rel);
        let kind = entry.file_type();
        if kind.is_dir() {
            fs::DirBuilder::new().mode(0o755).create(&to)?;
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(entry.path())?, &to)?;
        } else if kind.is_file() {
            fs::copy(entry.path(), &to)?;
        }
        // sockets, fifos, devices: nothing a child needs from /etc
    }
    Ok(())
}

/// Marks a copy as in use now (its mtime): collection keeps it while any process does.
fn mark_used(dir: &Path) {
    if let Ok(f) = fs::File::open(dir) {
        let _ = f.set_modified(SystemTime::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_tree() -> tempfile::TempDir {
        let host = tempfile::tempdir().unwrap();
        let etc = host.path().join("etc");
        fs::create_dir_all(etc.join("ssl/certs")).unwrap();
        fs::create_dir_all(etc.join("ssl/private")).unwrap();
        fs::write(
            etc.join("ssl/private/host.key"),
            "-----BEGIN PRIVATE KEY-----",
        )
        .unwrap();
        fs::write(etc.join("ssl/certs/ca.pem"), "CA").unwrap();
        std::os::unix::fs::symlink("ca.pem", etc.join("ssl/certs/abcd.0")).unwrap();
        fs::write(etc.join("resolv.conf"), "nameserver 10.0.0.1\n").unwrap();
        fs::write(etc.join("shadow"), "root:secret").unwrap();
        fs::write(etc.join("hosts-target"), "127.0.0.1 localhost\n").unwrap();
        std::os::unix::fs::symlink(etc.join("hosts-target"), etc.join("hosts")).unwrap();
        host
    }

    fn all_files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = walkdir::WalkDir::new(dir)
            .min_depth(1)
            .into_iter()
            .flatten()
            .map(|e| e.path().strip_prefix(dir).unwrap().display().to_string())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn the_copy_holds_the_listed_entries_and_nothing_else() {
        let host = host_tree();
        let work = tempfile::tempdir().unwrap();
        let view =
            EtcView::with_host_root(work.path(), host.path(), Duration::from_secs(60), KEEP_WARM);
        let dir = view.dir().expect("a copy");
        assert_eq!(
            all_files(&dir),
            [
                "hosts",
                "resolv.conf",
                "ssl",
                "ssl/certs",
                "ssl/certs/abcd.0",
                "ssl/certs/ca.pem"
            ]
        );
        // a listed link is followed, a link inside a listed directory kept
        assert_eq!(
            fs::read_to_string(dir.join("hosts")).unwrap(),
            "127.0.0.1 localhost\n"
        );
        assert_eq!(
            fs::read_link(dir.join("ssl/certs/abcd.0")).unwrap(),
            Path::new("ca.pem")
        );
        // asked again within the recheck interval: the same copy, nothing re-read
        assert_eq!(view.dir().unwrap(), dir);
    }

    #[test]
    fn a_changed_entry_makes_a_new_copy_and_the_old_one_stays_until_unused() {
        let host = host_tree();
        let work = tempfile::tempdir().unwrap();
        let view = EtcView::with_host_root(
            work.path(),
            host.path(),
            Duration::from_secs(3600),
            KEEP_WARM,
        );
        let first = view.dir().unwrap();
        // a resolver rewritten in place, as DHCP clients do
        fs::write(host.path().join("etc/resolv.conf"), "nameserver 10.9.9.9\n").unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        let second = view.dir().unwrap();
        assert_ne!(first, second);
        assert_eq!(
            fs::read_to_string(second.join("resolv.conf")).unwrap(),
            "nameserver 10.9.9.9\n"
        );
        // a sandbox started a moment ago may still have the first bound
        assert_eq!(
            fs::read_to_string(first.join("resolv.conf")).unwrap(),
            "nameserver 10.0.0.1\n"
        );

        // once unused for longer than any step runs, it is collected at the next copy
        let quick = EtcView::with_host_root(work.path(), host.path(), Duration::ZERO, KEEP_WARM);
        fs::write(host.path().join("etc/resolv.conf"), "nameserver 10.7.7.7\n").unwrap();
        let third = quick.dir().unwrap();
        assert!(third.is_dir());
        assert!(!first.exists() && !second.exists());
    }

    #[test]
    fn the_view_is_named_by_what_it_holds() {
        let host = host_tree();
        let work = tempfile::tempdir().unwrap();
        let a =
            EtcView::with_host_root(work.path(), host.path(), Duration::from_secs(60), KEEP_WARM);
        let b =
            EtcView::with_host_root(work.path(), host.path(), Duration::from_secs(60), KEEP_WARM);
        // two processes sharing a work root share the copy
        assert_eq!(a.dir().unwrap(), b.dir().unwrap());
        assert_eq!(
            fs::read_dir(work.path().join("etc-view")).unwrap().count(),
            1
        );
    }

    #[test]
    fn a_change_is_picked_up_by_the_refresher_not_by_a_sandbox_start() {
        let host = host_tree();
        let work = tempfile::tempdir().unwrap();
        let warm = Duration::from_millis(1500);
        let view = EtcView::with_host_root(work.path(), host.path(), Duration::from_secs(60), warm);
        let first = view.dir().unwrap();
        fs::write(host.path().join("etc/resolv.conf"), "nameserver 10.9.9.9\n").unwrap();
        // Nothing asks meanwhile: the refresher makes the new copy within a couple of its
        // rounds (watched rather than slept on: a loaded machine runs it late), and a start
        // then takes it without checking (a check younger than RECHECK).
        let deadline = std::time::Instant::now() + REFRESH * 2 + Duration::from_secs(5);
        let current = loop {
            let current = view.inner.current().unwrap();
            if current.dir.as_ref() != Some(&first) {
                break current;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the refresher never picked up the change"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let second = current.dir.clone().unwrap();
        assert!(current.checked.elapsed() < RECHECK);
        assert_eq!(view.dir().unwrap(), second);
        assert_eq!(
            fs::read_to_string(second.join("resolv.conf")).unwrap(),
            "nameserver 10.9.9.9\n"
        );
        // No start for longer than `keep_warm`: the refresher stops, and the next start
        // checks itself (and starts it again).
        std::thread::sleep(warm + RECHECK + REFRESH * 2);
        assert!(!lock(&view.inner.warm).refreshing);
        let idle_since = view.inner.current().unwrap().checked;
        assert!(
            idle_since.elapsed() > RECHECK,
            "the refresher kept checking"
        );
        assert_eq!(view.dir().unwrap(), second);
        assert!(view.inner.current().unwrap().checked > idle_since);
        assert!(lock(&view.inner.warm).refreshing);
    }
}
