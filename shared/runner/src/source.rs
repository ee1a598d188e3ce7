//! The checked-out source: input validation, cleaning, and the tree digest.

use std::fs;
use std::path::{Component, Path, PathBuf};

use crate::RunnerError;
use crate::tree::{SkipGit, TreeRules, digest_tree, hash_file, walk_error};

/// A Capsule directory: relative, no `..`, no NUL or control characters. `""` and `"."`
/// mean the repository root.
pub(crate) fn validate_dir(dir: &str) -> Result<(), RunnerError> {
    if dir.chars().any(|c| c == '\0' || c.is_control()) {
        return Err(RunnerError::InvalidDir(
            "the directory contains a NUL or control character".into(),
        ));
    }
    if dir.starts_with('/') || dir.starts_with('\\') {
        return Err(RunnerError::InvalidDir(format!(
            "{dir:?} is absolute; give a path relative to the repository root"
        )));
    }
    for component in Path::new(dir).components() {
        match component {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => {
                return Err(RunnerError::InvalidDir(format!(
                    "{dir:?} contains \"..\"; it must stay inside the repository"
                )));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(RunnerError::InvalidDir(format!(
                    "{dir:?} is absolute; give a path relative to the repository root"
                )));
            }
        }
    }
    Ok(())
}

fn plain_text(what: &str, value: &str) -> Result<(), RunnerError> {
    if value.is_empty() {
        return Err(RunnerError::Checkout(format!("the {what} is empty")));
    }
    if value.starts_with('-') {
        return Err(RunnerError::Checkout(format!(
            "the {what} must not start with '-'"
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(RunnerError::Checkout(format!(
            "the {what} contains a control character"
        )));
    }
    Ok(())
}

pub(crate) fn validate_repo(repo: &str) -> Result<(), RunnerError> {
    plain_text("repository URL", repo)?;
    if repo.contains("::") {
        // `ext::`, `fd::` and other remote helpers given by name.
        return Err(RunnerError::Checkout(
            "remote-helper URLs (`<helper>::…`) are not allowed".into(),
        ));
    }
    Ok(())
}

/// Why a repository URL is refused as a Capsule's source: the message says
/// which forms are accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RepoUrlRefused(pub String);

/// Which repository URLs a Capsule may name: `https://host/path`, `ssh://[user@]host/path`
/// and scp-style `user@host:path`; local repositories (`file://…` or an absolute path)
/// only when the server allows them (`TAKOSUMI_ALLOW_FILE_REPOS`, for local use). A URL
/// carrying a password or token (`https://user:token@…`) is refused: credentials reach
/// the runner as ProviderBindings, never inside a URL that is stored and shown.
pub fn check_repo_url(repo: &str, allow_file: bool) -> Result<(), RepoUrlRefused> {
    const FORMS: &str = "give https://host/path, ssh://[user@]host/path or user@host:path";
    let refuse = |why: String| Err(RepoUrlRefused(format!("source.repo {why}; {FORMS}")));
    if repo.is_empty() {
        return refuse("is empty".into());
    }
    if repo.starts_with('-') || repo.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return refuse(
            "must not start with '-' or contain whitespace or control characters".into(),
        );
    }
    if repo.contains("::") {
        return refuse("names a remote helper (`<helper>::…`)".into());
    }
    let local = |what: &str| {
        if allow_file {
            Ok(())
        } else {
            Err(RepoUrlRefused(format!(
                "source.repo is {what}; local repositories are accepted only when the server sets TAKOSUMI_ALLOW_FILE_REPOS=true (for local use); {FORMS}"
            )))
        }
    };
    if let Some((scheme, rest)) = repo.split_once("://") {
        let authority = rest.split('/').next().unwrap_or_default();
        match scheme.to_ascii_lowercase().as_str() {
            "https" | "ssh" => {}
            "file" => return local("a file:// URL"),
            other => return refuse(format!("uses {other}://, which is not accepted")),
        }
        if authority.is_empty() {
            return refuse("names no host".into());
        }
        if let Some((userinfo, _)) = authority.rsplit_once('@')
            && (scheme.eq_ignore_ascii_case("https") || userinfo.contains(':'))
        {
            return refuse(
                "carries credentials (`user:secret@` or `user@` in the URL); remove them and attach the credential to the Capsule as a ProviderBinding".into(),
            );
        }
        return Ok(());
    }
    if repo.starts_with('/') {
        return local("a local path");
    }
    // scp-style `[user@]host:path` (git's own rule: a ':' before any '/')
    let head = repo.split('/').next().unwrap_or(repo);
    let host_path = match head.rsplit_once('@') {
        Some((user, _)) if user.is_empty() || user.contains(':') => {
            return refuse("carries credentials (`user:secret@`) or an empty user".into());
        }
        Some((user, _)) => &repo[user.len() + 1..],
        None => repo,
    };
    if let Some((host, path)) = host_path.split_once(':')
        && !host.is_empty()
        && !host.contains('/')
        && !path.is_empty()
    {
        return Ok(());
    }
    refuse("is not a URL Takosumi accepts".into())
}

/// `repo` with any userinfo replaced by `***`: how a URL stored before the check above is
/// shown (never with its credentials).
pub fn redact_repo_url(repo: &str) -> String {
    if let Some((scheme, rest)) = repo.split_once("://") {
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        // an ssh user name (`git@`) is not a secret; anything else before '@' may be
        if let Some((user, host)) = authority.rsplit_once('@')
            && (!scheme.eq_ignore_ascii_case("ssh") || user.contains(':'))
        {
            return format!("{scheme}://***@{host}{path}");
        }
    }
    repo.to_owned()
}

pub(crate) fn validate_branch(branch: &str) -> Result<(), RunnerError> {
    plain_text("branch", branch)?;
    if branch.chars().any(char::is_whitespace) {
        return Err(RunnerError::Checkout(
            "the branch contains whitespace".into(),
        ));
    }
    Ok(())
}

/// A commit id: 4 to 64 hex digits.
pub(crate) fn validate_commit(commit: &str) -> Result<(), RunnerError> {
    if (4..=64).contains(&commit.len()) && commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(RunnerError::Checkout(format!(
            "{commit:?} is not a commit id (4 to 64 hex digits)"
        )))
    }
}

/// Replaces the user-info of `scheme://user:pass@host` with `***` wherever `repo` appears.
pub(crate) fn redact_url(message: &str, repo: &str) -> String {
    let Some(scheme_end) = repo.find("://") else {
        return message.to_owned();
    };
    let rest = &repo[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return message.to_owned();
    };
    let userinfo = &rest[..at];
    if userinfo.is_empty() {
        return message.to_owned();
    }
    message.replace(userinfo, "***")
}

/// Removes every `.terraform` entry (directory, file or link) below `root`, outside the
/// top-level `.git`. Returns how many were removed.
pub(crate) fn remove_dot_terraform(root: &Path) -> Result<usize, RunnerError> {
    let mut found = Vec::new();
    let mut walk = walkdir::WalkDir::new(root)
        .follow_links(false)
        .min_depth(1)
        .into_iter();
    while let Some(entry) = walk.next() {
        let entry = entry.map_err(|e| walk_error(root, e))?;
        let name = entry.file_name();
        if entry.depth() == 1 && name == ".git" {
            if entry.file_type().is_dir() {
                walk.skip_current_dir();
            }
            continue;
        }
        if name == ".terraform" {
            if entry.file_type().is_dir() {
                walk.skip_current_dir();
            }
            found.push((entry.path().to_path_buf(), entry.file_type().is_dir()));
        }
    }
    for (path, is_dir) in &found {
        let result = if *is_dir {
            fs::remove_dir_all(path)
        } else {
            fs::remove_file(path)
        };
        result.map_err(|e| RunnerError::io(format!("removing {}", path.display()), e))?;
    }
    Ok(found.len())
}

/// SHA-256 hex over the sorted list of (relative path, kind, content SHA-256) of every file
/// and symbolic link below `root`, except the top-level `.git` (see [`crate::tree`]). Kind
/// is `x` for an executable file, `f` for another file, `l` for a link (hashed over its
/// target text, never followed). Directories contribute only through their contents.
/// Refuses a link that points outside `root`: the tool must never read past the checkout.
pub fn tree_digest(root: &Path) -> Result<String, RunnerError> {
    let canonical_root = root
        .canonicalize()
        .map_err(|e| RunnerError::io(format!("resolving {}", root.display()), e))?;
    let rules = TreeRules {
        domain: b"",
        skip_git: SkipGit::AtRoot,
        link_outside: &|rel| {
            RunnerError::LinkOutside(format!(
                "the link {} points outside the checkout; a Capsule's files must stay inside \
                 its repository: replace the link with the file itself",
                rel.display()
            ))
        },
        not_a_file: &|rel| {
            RunnerError::Checkout(format!(
                "{} is not a regular file, directory or link",
                rel.display()
            ))
        },
        file_digest: &|_, path| hash_file(path),
    };
    digest_tree(&canonical_root, &rules)
}

/// `checkout/dir`, which must exist, be a directory, and resolve inside the checkout.
pub(crate) fn resolve_config_dir(checkout: &Path, dir: &str) -> Result<PathBuf, RunnerError> {
    validate_dir(dir)?;
    let root = checkout
        .canonicalize()
        .map_err(|e| RunnerError::io(format!("resolving {}", checkout.display()), e))?;
    let joined = if dir.is_empty() {
        root.clone()
    } else {
        root.join(dir)
    };
    let resolved = joined.canonicalize().map_err(|_| {
        RunnerError::InvalidDir(format!("{dir:?} does not exist in the repository"))
    })?;
    if !resolved.starts_with(&root) {
        return Err(RunnerError::InvalidDir(format!(
            "{dir:?} resolves outside the checkout"
        )));
    }
    if resolved
        .strip_prefix(&root)
        .is_ok_and(|rel| rel.starts_with(".git"))
    {
        return Err(RunnerError::InvalidDir(format!("{dir:?} is inside .git")));
    }
    if !resolved.is_dir() {
        return Err(RunnerError::InvalidDir(format!(
            "{dir:?} is not a directory"
        )));
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{PermissionsExt, symlink};

    use super::*;
    use crate::tree::tests::write;

    #[test]
    fn repo_urls_are_accepted_only_in_the_stated_forms() {
        for ok in [
            "https://github.com/acme/infra.git",
            "https://git.example.com:8443/acme/infra",
            "ssh://git@github.com/acme/infra.git",
            "ssh://github.com:2222/acme/infra",
            "git@github.com:acme/infra.git",
            "host.example:infra",
        ] {
            check_repo_url(ok, false).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for (bad, says) in [
            ("https://user:token@github.com/acme/infra", "credentials"),
            ("https://token@github.com/acme/infra", "credentials"),
            ("ssh://git:pw@github.com/acme/infra", "credentials"),
            ("git:pw@github.com:acme/infra", "credentials"),
            ("http://github.com/acme/infra", "http://"),
            ("git://github.com/acme/infra", "git://"),
            ("ext::sh -c id", "whitespace"),
            ("fd::3", "remote helper"),
            ("file:///srv/repo", "TAKOSUMI_ALLOW_FILE_REPOS"),
            ("/srv/repo", "TAKOSUMI_ALLOW_FILE_REPOS"),
            ("-uhttps://x", "'-'"),
            ("relative/dir", "not a URL"),
            ("https:///path", "no host"),
            ("", "empty"),
        ] {
            let e = check_repo_url(bad, false).expect_err(bad).0;
            assert!(e.contains(says), "{bad}: {e}");
            assert!(
                bad.is_empty() || !e.contains(bad),
                "the refusal quotes the URL: {e}"
            );
        }
        check_repo_url("file:///srv/repo", true).unwrap();
        check_repo_url("/srv/repo", true).unwrap();
        check_repo_url("https://u:t@h/p", true).unwrap_err();
    }

    #[test]
    fn stored_urls_are_shown_without_credentials() {
        assert_eq!(
            redact_repo_url("https://user:s3cret@github.com/acme/infra"),
            "https://***@github.com/acme/infra"
        );
        assert_eq!(
            redact_repo_url("git@github.com:acme/x"),
            "git@github.com:acme/x"
        );
        assert_eq!(redact_repo_url("https://h/p"), "https://h/p");
        assert_eq!(redact_repo_url("ssh://git@h/p"), "ssh://git@h/p");
        assert_eq!(redact_repo_url("ssh://git:pw@h/p"), "ssh://***@h/p");
    }

    #[test]
    fn dirs() {
        for ok in [
            "",
            ".",
            "infra/network",
            "./infra",
            "infra/./network",
            "a b/c",
            "infra/",
        ] {
            validate_dir(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        for bad in [
            "..",
            "../x",
            "infra/../../x",
            "infra/..",
            "/etc",
            "/",
            "a\0b",
            "a\nb",
            "\\x",
        ] {
            assert!(
                matches!(validate_dir(bad), Err(RunnerError::InvalidDir(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn checkout_inputs() {
        validate_repo("file:///tmp/repo").unwrap();
        validate_repo("https://git.example/x.git").unwrap();
        for bad in ["", "-uupload-pack=x", "ext::sh -c x", "a\nb"] {
            assert!(validate_repo(bad).is_err(), "{bad:?}");
        }
        validate_branch("main").unwrap();
        validate_branch("feature/x").unwrap();
        for bad in ["", "--orphan", "a b"] {
            assert!(validate_branch(bad).is_err(), "{bad:?}");
        }
        validate_commit("0123abcd").unwrap();
        validate_commit(&"a".repeat(40)).unwrap();
        for bad in ["", "abc", "HEAD", "--detach", &"a".repeat(65)] {
            assert!(validate_commit(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn urls_are_redacted() {
        let repo = "https://bot:tok3n@git.example/x.git";
        let msg = "fatal: unable to access 'https://bot:tok3n@git.example/x.git/': 403";
        let out = redact_url(msg, repo);
        assert!(!out.contains("tok3n"), "{out}");
        assert_eq!(redact_url("plain", "file:///tmp/r"), "plain");
    }

    #[test]
    fn tree_digest_is_deterministic_and_sensitive() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        // Same tree, created in a different order, with different .git contents.
        write(
            a.path(),
            "infra/network/main.tf",
            "output \"x\" { value = 1 }\n",
            0o644,
        );
        write(a.path(), "README.md", "hi\n", 0o644);
        write(a.path(), "bin/run.sh", "#!/bin/sh\n", 0o755);
        write(a.path(), ".git/HEAD", "ref: refs/heads/main\n", 0o644);
        write(b.path(), "bin/run.sh", "#!/bin/sh\n", 0o755);
        write(b.path(), "README.md", "hi\n", 0o644);
        write(
            b.path(),
            "infra/network/main.tf",
            "output \"x\" { value = 1 }\n",
            0o644,
        );
        write(b.path(), ".git/HEAD", "ref: refs/heads/other\n", 0o644);
        fs::create_dir_all(b.path().join("empty/dir")).unwrap();
        let da = tree_digest(a.path()).unwrap();
        assert_eq!(da.len(), 64);
        assert_eq!(da, tree_digest(a.path()).unwrap());
        assert_eq!(da, tree_digest(b.path()).unwrap());

        // The exec bit counts.
        fs::set_permissions(
            b.path().join("bin/run.sh"),
            fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let db = tree_digest(b.path()).unwrap();
        assert_ne!(da, db);
        fs::set_permissions(
            b.path().join("bin/run.sh"),
            fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        assert_eq!(da, tree_digest(b.path()).unwrap());

        // Content counts; so does a rename.
        write(b.path(), "README.md", "hi!\n", 0o644);
        assert_ne!(da, tree_digest(b.path()).unwrap());
        write(b.path(), "README.md", "hi\n", 0o644);
        fs::rename(b.path().join("README.md"), b.path().join("README.txt")).unwrap();
        assert_ne!(da, tree_digest(b.path()).unwrap());
    }

    #[test]
    fn links_must_stay_inside() {
        let a = tempfile::tempdir().unwrap();
        write(a.path(), "infra/main.tf", "", 0o644);
        symlink("main.tf", a.path().join("infra/alias.tf")).unwrap();
        symlink("../infra", a.path().join("infra/self")).unwrap();
        let d1 = tree_digest(a.path()).unwrap();
        assert_eq!(d1, tree_digest(a.path()).unwrap());

        symlink("/etc/passwd", a.path().join("infra/passwd.tf")).unwrap();
        let err = tree_digest(a.path()).unwrap_err();
        assert!(matches!(err, RunnerError::LinkOutside(_)), "{err}");
        assert_eq!(
            err.failure_code(),
            Some(takosumi_core::FailureCode::InvalidConfiguration)
        );
        fs::remove_file(a.path().join("infra/passwd.tf")).unwrap();
        symlink("../../../outside", a.path().join("infra/up")).unwrap();
        assert!(matches!(
            tree_digest(a.path()),
            Err(RunnerError::LinkOutside(_))
        ));
        fs::remove_file(a.path().join("infra/up")).unwrap();
        assert_eq!(d1, tree_digest(a.path()).unwrap());
    }

    #[test]
    fn dot_terraform_is_removed_everywhere() {
        let a = tempfile::tempdir().unwrap();
        write(a.path(), ".terraform/x", "", 0o644);
        write(
            a.path(),
            "infra/network/.terraform/terraform.tfstate",
            "{}",
            0o644,
        );
        write(
            a.path(),
            "infra/network/.terraform/providers/p/bin",
            "",
            0o755,
        );
        write(a.path(), "infra/network/main.tf", "", 0o644);
        write(a.path(), "infra/.terraform.lock.hcl", "", 0o644);
        write(a.path(), ".git/.terraform/keep", "", 0o644);
        write(a.path(), "mod/.terraform", "a file", 0o644);
        assert_eq!(remove_dot_terraform(a.path()).unwrap(), 3);
        assert!(!a.path().join(".terraform").exists());
        assert!(!a.path().join("infra/network/.terraform").exists());
        assert!(!a.path().join("mod/.terraform").exists());
        assert!(a.path().join("infra/network/main.tf").exists());
        assert!(a.path().join("infra/.terraform.lock.hcl").exists());
        assert!(a.path().join(".git/.terraform/keep").exists());
    }

    #[test]
    fn config_dir_resolution() {
        let a = tempfile::tempdir().unwrap();
        write(a.path(), "infra/network/main.tf", "", 0o644);
        write(a.path(), "file.tf", "", 0o644);
        fs::create_dir_all(a.path().join(".git/objects")).unwrap();
        symlink("/tmp", a.path().join("escape")).unwrap();
        let root = a.path().canonicalize().unwrap();
        assert_eq!(resolve_config_dir(a.path(), "").unwrap(), root);
        assert_eq!(resolve_config_dir(a.path(), ".").unwrap(), root);
        assert_eq!(
            resolve_config_dir(a.path(), "infra/network").unwrap(),
            root.join("infra/network")
        );
        for bad in ["missing", "file.tf", "escape", "../x", ".git/objects"] {
            assert!(
                matches!(
                    resolve_config_dir(a.path(), bad),
                    Err(RunnerError::InvalidDir(_))
                ),
                "{bad}"
            );
        }
    }
}
