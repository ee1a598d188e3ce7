//! The one walk that turns a directory into a SHA-256, and the one rule for the links in
//! it. Both digests that pin what a Run executes go through it: the checkout's
//! ([`crate::tree_digest`]) and the installed modules' ([`crate::module_tree_digest`]).
//! A link is checked here for both, so a rule made stricter for one holds for the other.
//!
//! Every regular file counts as (path, executable bit, SHA-256 of its bytes) and every
//! link as (path, SHA-256 of its target text, never followed), in byte order of their
//! paths; directories count only through what they hold. What the digests pin is stored
//! with every plan and compared by its apply, so the bytes hashed here must not change.

use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::RunnerError;

/// Which `.git` entries a walk passes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SkipGit {
    /// Only the root's own (a checkout: a `.git` deeper down is the repository's content).
    AtRoot,
    /// Any, at any depth (installed modules: `get` leaves one inside each git module, and
    /// its bytes differ between two downloads of the same commit).
    Everywhere,
}

/// What differs between the two digests; everything else is the same walk.
pub(crate) struct TreeRules<'a> {
    /// Bytes hashed before the entries, so two kinds of digest never collide.
    pub domain: &'a [u8],
    /// Which `.git` entries count.
    pub skip_git: SkipGit,
    /// The error for a link leading outside the root, given its path relative to it.
    pub link_outside: &'a dyn Fn(&Path) -> RunnerError,
    /// The error for an entry that is no file, directory or link, given its relative path.
    pub not_a_file: &'a dyn Fn(&Path) -> RunnerError,
    /// The digest of one file: its relative path (a manifest may be read in a canonical
    /// form) and where it is.
    pub file_digest: &'a dyn Fn(&Path, &Path) -> Result<String, RunnerError>,
}

/// The digest of everything below `root` (already canonical) under `rules`.
pub(crate) fn digest_tree(root: &Path, rules: &TreeRules<'_>) -> Result<String, RunnerError> {
    let mut entries: Vec<(Vec<u8>, u8, String)> = Vec::new();
    let mut walk = walkdir::WalkDir::new(root)
        .follow_links(false)
        .min_depth(1)
        .into_iter();
    while let Some(entry) = walk.next() {
        let entry = entry.map_err(|e| walk_error(root, e))?;
        let skipped = entry.file_name() == ".git"
            && (rules.skip_git == SkipGit::Everywhere || entry.depth() == 1);
        if skipped {
            if entry.file_type().is_dir() {
                walk.skip_current_dir();
            }
            continue;
        }
        let path = entry.path();
        let rel = path.strip_prefix(root).map_err(|_| {
            RunnerError::Checkout(format!("{} is outside {}", path.display(), root.display()))
        })?;
        let rel_bytes = rel.as_os_str().as_bytes().to_vec();
        let file_type = entry.file_type();
        if file_type.is_symlink() {
            let target = fs::read_link(path)
                .map_err(|e| RunnerError::io(format!("reading link {}", path.display()), e))?;
            if !link_stays_inside(root, path, &target) {
                return Err((rules.link_outside)(rel));
            }
            entries.push((
                rel_bytes,
                b'l',
                hex::encode(Sha256::digest(target.as_os_str().as_bytes())),
            ));
        } else if file_type.is_file() {
            let meta = entry.metadata().map_err(|e| walk_error(root, e))?;
            let kind = if meta.permissions().mode() & 0o111 != 0 {
                b'x'
            } else {
                b'f'
            };
            entries.push((rel_bytes, kind, (rules.file_digest)(rel, path)?));
        } else if !file_type.is_dir() {
            return Err((rules.not_a_file)(rel));
        }
    }
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let mut tree = Sha256::new();
    tree.update(rules.domain);
    for (path, kind, digest) in &entries {
        tree.update(path);
        tree.update([0u8, *kind, 0u8]);
        tree.update(digest.as_bytes());
        tree.update(b"\n");
    }
    Ok(hex::encode(tree.finalize()))
}

/// Whether the link at `link` (below `root`, which is canonical) to `target` stays inside
/// `root`: relative, inside as written (`..` taken lexically from the link's directory),
/// and, when it resolves at all, inside after following every link on the way.
pub(crate) fn link_stays_inside(root: &Path, link: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut lexical = PathBuf::new();
    for component in link.parent().unwrap_or(root).join(target).components() {
        match component {
            Component::ParentDir => {
                if !lexical.pop() {
                    return false;
                }
            }
            Component::CurDir => {}
            other => lexical.push(other.as_os_str()),
        }
    }
    if !lexical.starts_with(root) {
        return false;
    }
    match link.canonicalize() {
        Ok(resolved) => resolved.starts_with(root),
        // a link to nothing reads nothing
        Err(_) => true,
    }
}

/// SHA-256 (hex) of a file's bytes, read in 64 KiB pieces.
pub(crate) fn hash_file(path: &Path) -> Result<String, RunnerError> {
    let mut file = fs::File::open(path)
        .map_err(|e| RunnerError::io(format!("reading {}", path.display()), e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| RunnerError::io(format!("reading {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// A walk's error, naming where it happened.
pub(crate) fn walk_error(root: &Path, e: walkdir::Error) -> RunnerError {
    let context = format!("walking {}", e.path().unwrap_or(root).display());
    let source = e
        .into_io_error()
        .unwrap_or_else(|| std::io::Error::other("file-system loop"));
    RunnerError::io(context, source)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// Writes `text` to `root/rel` (its directories made) with `mode`.
    pub(crate) fn write(root: &Path, rel: &str, text: &str, mode: u32) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, text).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// Both digests are stored with every plan and compared by its apply (and by applies
    /// made after an upgrade): a fixed tree keeps the digests it had when the two were
    /// separate walks. These values were taken from that code before it was folded here.
    #[test]
    fn digests_are_the_ones_stored_plans_carry() {
        let a = tempfile::tempdir().unwrap();
        let r = a.path();
        write(r, "infra/main.tf", "output \"x\" { value = 1 }\n", 0o644);
        write(r, "bin/run.sh", "#!/bin/sh\n", 0o755);
        write(r, ".git/HEAD", "ref: refs/heads/main\n", 0o644);
        write(r, "vendor/.git/HEAD", "nested\n", 0o644);
        symlink("main.tf", r.join("infra/alias.tf")).unwrap();
        let m = r.join("infra/.terraform/modules");
        write(
            &m,
            "modules.json",
            r#"{"Modules":[{"Key":"b","Source":"s2"},{"Key":"a","Source":"s1"}]}"#,
            0o644,
        );
        write(&m, "net/main.tf", "variable \"v\" {}\n", 0o644);
        write(&m, "net/tool", "x", 0o755);
        write(&m, "net/.git/HEAD", "ref\n", 0o644);
        symlink("main.tf", m.join("net/alias.tf")).unwrap();
        assert_eq!(
            crate::tree_digest(r).unwrap(),
            "75c218dac462327b86fb8702a4bf45e0d8691200cf2c11906035bab9162293df"
        );
        assert_eq!(
            crate::module_tree_digest(&r.join("infra")).unwrap(),
            "ccb80297c337f239ec438f790b9d672147627d2c5391f292bd8eedb62203b803"
        );
    }

    #[test]
    fn a_link_stays_inside_as_written_and_resolved() {
        let a = tempfile::tempdir().unwrap();
        let root = a.path().canonicalize().unwrap();
        write(&root, "d/main.tf", "", 0o644);
        let link = root.join("d/l");
        for (target, inside) in [
            ("main.tf", true),
            ("../d/main.tf", true),
            ("./missing", true),
            ("..", true),
            ("../..", false),
            ("../../x", false),
            ("/etc/passwd", false),
        ] {
            assert_eq!(
                link_stays_inside(&root, &link, Path::new(target)),
                inside,
                "{target}"
            );
        }
        // Inside as written, outside once resolved: the link it goes through leaves.
        symlink("/etc", root.join("d/out")).unwrap();
        symlink("out/passwd", &link).unwrap();
        assert!(!link_stays_inside(&root, &link, Path::new("out/passwd")));
    }
}
