//! The installed module tree and its digest: what `get` put under
//! `<config_dir>/.terraform/modules`, reduced to one SHA-256 so an apply can prove it runs
//! exactly the modules its plan used.

use std::fs;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::RunnerError;
use crate::tree::{SkipGit, TreeRules, digest_tree, hash_file};

/// Where `get` installs modules, relative to the Capsule directory.
pub const MODULES_DIR: &str = ".terraform/modules";

/// Bound into every module digest so it can never equal a [`crate::tree_digest`] of the
/// same files (the two digests pin different things).
const DOMAIN: &[u8] = b"takosumi-modules-v1\n";

/// The digest of the module tree installed under `<config_dir>/.terraform/modules`.
///
/// Every regular file (path, executable bit, SHA-256 of its bytes) and every link (path,
/// target) counts, in byte order of their paths. Version-control metadata (`.git`,
/// which `get` leaves inside each git module) is skipped at any depth: the tool never
/// reads it, and its content (timestamps, pack layout) differs between two downloads of
/// the same commit, so counting it would make an honest re-download look changed.
/// `modules.json` is part of the tree: it names each module's source, so a module moved
/// to another source changes the digest even when its files do not. It counts in a
/// canonical form (its `Modules` entries sorted by `Key`): the tool writes them in a
/// different order on every run.
///
/// Local-path modules (`./modules/x`) are not installed there: they live in the checkout
/// and are pinned by the source snapshot's tree digest instead.
///
/// No installed tree at all (a tool that wrote nothing) is the digest of nothing,
/// `sha256("")`. A link that leads outside the module tree (the tool links a module whose
/// source is a path on this machine) is refused with [`RunnerError::InvalidDir`]: what it
/// points at is not part of the run and could change under it.
pub fn module_tree_digest(config_dir: &Path) -> Result<String, RunnerError> {
    let root = config_dir.join(MODULES_DIR);
    match fs::symlink_metadata(&root) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(RunnerError::InvalidDir(format!(
                "{MODULES_DIR} is not a directory"
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(hex::encode(Sha256::digest(b"")));
        }
        Err(e) => return Err(RunnerError::io(format!("reading {}", root.display()), e)),
    }
    let root = root
        .canonicalize()
        .map_err(|e| RunnerError::io(format!("resolving {}", root.display()), e))?;
    let rules = TreeRules {
        domain: DOMAIN,
        skip_git: SkipGit::Everywhere,
        link_outside: &|rel| {
            RunnerError::InvalidDir(format!(
                "the installed module entry {MODULES_DIR}/{} links outside the module tree \
                 (a module source that is a path on the server); vendor the module into the \
                 repository and call it by a relative path, or use a git source",
                rel.display()
            ))
        },
        not_a_file: &|rel| {
            RunnerError::InvalidDir(format!(
                "{MODULES_DIR}/{} is not a regular file, directory or link",
                rel.display()
            ))
        },
        file_digest: &|rel, path| {
            if rel == Path::new(MANIFEST) {
                hash_manifest(path)
            } else {
                hash_file(path)
            }
        },
    };
    digest_tree(&root, &rules)
}

/// The tool's record of installed modules, at the top of the module tree.
const MANIFEST: &str = "modules.json";

/// SHA-256 of `modules.json` with its `Modules` entries in `Key` order. A manifest that
/// is not the expected JSON counts as its raw bytes.
fn hash_manifest(path: &Path) -> Result<String, RunnerError> {
    let bytes =
        fs::read(path).map_err(|e| RunnerError::io(format!("reading {}", path.display()), e))?;
    let Ok(mut manifest) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return Ok(hex::encode(Sha256::digest(&bytes)));
    };
    if let Some(modules) = manifest
        .get_mut("Modules")
        .and_then(serde_json::Value::as_array_mut)
    {
        modules.sort_by_cached_key(|m| {
            (
                m.get("Key")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                m.to_string(),
            )
        });
    }
    Ok(hex::encode(Sha256::digest(manifest.to_string().as_bytes())))
}

/// Whether the root module in `config_dir` calls any module, i.e. whether `get` has
/// anything to download. Reads the files the tool loads from that directory (`*.tf`,
/// `*.tofu` and their `.json` forms); only the root can introduce module calls, since every
/// nested call lives inside a module the root calls.
///
/// Answers `true` whenever it cannot tell (a file it cannot read or parse): then `get`
/// runs as before and reports the problem itself. Skipping `get` saves one tool start
/// (~70 ms) on every plan and apply of a configuration without modules.
pub fn declares_module_calls(config_dir: &Path) -> bool {
    let Ok(entries) = fs::read_dir(config_dir) else {
        return true;
    };
    for entry in entries {
        let Ok(entry) = entry else { return true };
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let json = name.ends_with(".tf.json") || name.ends_with(".tofu.json");
        let hcl = name.ends_with(".tf") || name.ends_with(".tofu");
        if !json && !hcl {
            continue;
        }
        let Ok(text) = fs::read_to_string(entry.path()) else {
            return true;
        };
        let calls = if json {
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(v) => v.get("module").is_some(),
                Err(_) => true,
            }
        } else {
            match hcl::parse(&text) {
                Ok(body) => body.blocks().any(|b| b.identifier() == "module"),
                Err(_) => true,
            }
        };
        if calls {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{PermissionsExt, symlink};

    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }

    /// `get` is skipped only when no file of the root module calls a module; anything
    /// unreadable counts as a call, so the tool still runs and reports it.
    #[test]
    fn module_calls_are_found_in_hcl_and_json_and_doubt_means_yes() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(root, "main.tf", "resource \"null_resource\" \"a\" {}\n");
        write(root, "README.md", "module \"not\" {}");
        write(root, "sub/x.tf", "module \"nested\" { source = \"./y\" }");
        assert!(!declares_module_calls(root));

        write(root, "mods.tofu", "module \"m\" {\n  source = \"./m\"\n}\n");
        assert!(declares_module_calls(root));
        fs::remove_file(root.join("mods.tofu")).unwrap();

        write(root, "x.tf.json", r#"{"module": {"m": {"source": "./m"}}}"#);
        assert!(declares_module_calls(root));
        write(root, "x.tf.json", r#"{"resource": {}}"#);
        assert!(!declares_module_calls(root));

        write(root, "broken.tf", "resource \"a\" {");
        assert!(declares_module_calls(root));
        fs::remove_file(root.join("broken.tf")).unwrap();
        assert!(!declares_module_calls(root));
        assert!(declares_module_calls(&root.join("missing")));
    }

    #[test]
    fn nothing_installed_is_the_digest_of_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            module_tree_digest(dir.path()).unwrap(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn digest_pins_content_and_skips_vcs_metadata() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for d in [a.path(), b.path()] {
            write(d, ".terraform/modules/modules.json", "{\"Modules\":[]}");
            write(d, ".terraform/modules/remote/main.tf", "output \"x\" {}");
        }
        // Two downloads of one commit differ only in their .git directories.
        write(a.path(), ".terraform/modules/remote/.git/index", "one");
        write(b.path(), ".terraform/modules/remote/.git/index", "two");
        write(b.path(), ".terraform/modules/remote/.git/logs/HEAD", "t=2");
        let da = module_tree_digest(a.path()).unwrap();
        assert_eq!(da, module_tree_digest(b.path()).unwrap());
        assert_eq!(da.len(), 64);

        // Any content change is a different tree.
        write(
            b.path(),
            ".terraform/modules/remote/main.tf",
            "output \"y\" {}",
        );
        assert_ne!(da, module_tree_digest(b.path()).unwrap());
        write(
            b.path(),
            ".terraform/modules/remote/main.tf",
            "output \"x\" {}",
        );
        assert_eq!(da, module_tree_digest(b.path()).unwrap());
        // So is an executable bit, an extra file, or another source in modules.json.
        fs::set_permissions(
            b.path().join(".terraform/modules/remote/main.tf"),
            fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        assert_ne!(da, module_tree_digest(b.path()).unwrap());
        write(a.path(), ".terraform/modules/remote/extra.tf", "");
        let with_extra = module_tree_digest(a.path()).unwrap();
        assert_ne!(da, with_extra);
        write(
            a.path(),
            ".terraform/modules/modules.json",
            "{\"Modules\":[1]}",
        );
        assert_ne!(with_extra, module_tree_digest(a.path()).unwrap());
    }

    #[test]
    fn manifest_order_does_not_count_but_sources_do() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let root = r#"{"Key":"","Source":"","Dir":"."}"#;
        let remote = r#"{"Key":"remote","Source":"git::file:///m?ref=main","Dir":".terraform/modules/remote"}"#;
        write(
            a.path(),
            ".terraform/modules/modules.json",
            &format!("{{\"Modules\":[{root},{remote}]}}"),
        );
        write(
            b.path(),
            ".terraform/modules/modules.json",
            &format!("{{\"Modules\":[{remote},{root}]}}"),
        );
        let da = module_tree_digest(a.path()).unwrap();
        assert_eq!(da, module_tree_digest(b.path()).unwrap());
        write(
            b.path(),
            ".terraform/modules/modules.json",
            &format!(
                "{{\"Modules\":[{},{root}]}}",
                remote.replace("ref=main", "ref=v2")
            ),
        );
        assert_ne!(da, module_tree_digest(b.path()).unwrap());
    }

    #[test]
    fn links_outside_the_tree_are_refused() {
        let a = tempfile::tempdir().unwrap();
        write(a.path(), ".terraform/modules/remote/main.tf", "");
        symlink(
            "main.tf",
            a.path().join(".terraform/modules/remote/alias.tf"),
        )
        .unwrap();
        module_tree_digest(a.path()).unwrap();
        symlink("/etc", a.path().join(".terraform/modules/abs")).unwrap();
        assert!(matches!(
            module_tree_digest(a.path()),
            Err(RunnerError::InvalidDir(_))
        ));
        fs::remove_file(a.path().join(".terraform/modules/abs")).unwrap();
        symlink("../../..", a.path().join(".terraform/modules/up")).unwrap();
        assert!(matches!(
            module_tree_digest(a.path()),
            Err(RunnerError::InvalidDir(_))
        ));
    }
}
