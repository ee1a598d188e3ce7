//! The Git cache behind every checkout, against real local repositories and the real
//! sandbox: what is fetched, what is reused, what concurrent Runs see, and the `off` mode.

mod common;

use std::fs;
use std::path::Path;

use common::{NETWORK_TF, Repo, runner};
use takosumi_runner::{GitCache, Runner, RunnerConfig, RunnerError};

fn entries(cache: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(cache)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test]
async fn checkouts_reuse_the_entry_and_still_ask_the_remote_what_it_has() {
    let repo = Repo::new();
    repo.write("infra/main.tf", NETWORK_TF);
    let first = repo.commit("first");
    let (base, runner) = runner("/nonexistent/terraform", None);
    let cache = base.path().join("work").join("git-cache");

    let wd = runner.workdir("run_plan").unwrap();
    let planned = runner
        .checkout(&wd, &repo.url(), "main", None, "infra")
        .await
        .unwrap();
    assert_eq!(planned.commit, first);
    assert!(
        !wd.checkout().join(".git").exists(),
        "the checkout holds no repository"
    );
    drop(wd);
    let names = entries(&cache);
    assert_eq!(names.len(), 2, "one entry and its lock: {names:?}");
    assert!(names.iter().any(|n| n.ends_with(".lock")));
    assert!(
        names.iter().all(|n| !n.contains("takosumi-test-repos")),
        "entries are named by a hash, not the URL: {names:?}"
    );

    // A fetch killed midway leaves git's own lock files behind; the next checkout of the
    // entry clears them instead of failing on them forever.
    let entry = cache.join(names.iter().find(|n| !n.ends_with(".lock")).unwrap());
    for left in ["refs/heads/main.lock", "packed-refs.lock", "shallow.lock"] {
        fs::write(entry.join(left), "").unwrap();
    }

    // The branch moves on; a checkout of the branch sees the new head, in the same entry.
    repo.write("infra/main.tf", &format!("{NETWORK_TF}# v2\n"));
    let second = repo.commit("second");
    let wd = runner.workdir("run_replan").unwrap();
    let replanned = runner
        .checkout(&wd, &repo.url(), "main", None, "infra")
        .await
        .unwrap();
    assert_eq!(replanned.commit, second);
    assert_ne!(replanned.tree_digest, planned.tree_digest);
    drop(wd);
    assert_eq!(entries(&cache), names);
    assert!(!entry.join("refs/heads/main.lock").exists());

    // A pinned commit behind the head: its tree is the one planned at the time.
    let wd = runner.workdir("run_old").unwrap();
    let old = runner
        .checkout(&wd, &repo.url(), "main", Some(&first), "infra")
        .await
        .unwrap();
    assert_eq!(old, planned);
    drop(wd);

    // The head is force-pushed away: the cache still holds its objects, but the
    // repository no longer has the commit, so a pinned checkout of it is refused, as a
    // fresh clone would refuse it.
    repo.git(&["reset", "--quiet", "--hard", &first]);
    repo.write("infra/main.tf", &format!("{NETWORK_TF}# v3\n"));
    let third = repo.commit("third");
    let wd = runner.workdir("run_rewritten").unwrap();
    let err = runner
        .checkout(&wd, &repo.url(), "main", Some(&second), "infra")
        .await
        .unwrap_err();
    assert!(matches!(err, RunnerError::CommitNotFound(_)), "{err}");
    drop(wd);
    // A commit the repository never had is CommitNotFound too.
    let wd = runner.workdir("run_missing").unwrap();
    let err = runner
        .checkout(&wd, &repo.url(), "main", Some(&"7".repeat(40)), "infra")
        .await
        .unwrap_err();
    assert!(matches!(err, RunnerError::CommitNotFound(_)), "{err}");
    drop(wd);
    // A commit only a tag reaches is there (a clone has tags too).
    repo.git(&["tag", "kept", &third]);
    repo.git(&["reset", "--quiet", "--hard", &first]);
    let wd = runner.workdir("run_tagged").unwrap();
    let tagged = runner
        .checkout(&wd, &repo.url(), "main", Some(&third), "infra")
        .await
        .unwrap();
    assert_eq!(tagged.commit, third);
    drop(wd);

    // The remote goes away: no answer comes from the cache alone.
    let gone = repo.path().with_extension("moved");
    fs::rename(repo.path(), &gone).unwrap();
    for pin in [None, Some(first.as_str())] {
        let wd = runner.workdir("run_gone").unwrap();
        let err = runner
            .checkout(&wd, &repo.url(), "main", pin, "infra")
            .await
            .unwrap_err();
        assert!(matches!(err, RunnerError::Checkout(_)), "{err}");
    }
    fs::rename(&gone, repo.path()).unwrap();
}

#[tokio::test]
async fn concurrent_checkouts_of_one_repository_share_its_entry() {
    let repo = Repo::new();
    repo.write("main.tf", NETWORK_TF);
    let commit = repo.commit("first");
    let (base, runner) = runner("/nonexistent/terraform", None);
    let runs: Vec<_> = (0..6)
        .map(|i| {
            let runner = runner.clone();
            let url = repo.url();
            let commit = commit.clone();
            tokio::spawn(async move {
                let wd = runner.workdir(&format!("run_{i}")).unwrap();
                // half follow the branch (fetching), half are pinned (reading)
                let pin = (i % 2 == 0).then_some(commit.as_str());
                runner.checkout(&wd, &url, "main", pin, "").await
            })
        })
        .collect();
    let mut seen = Vec::new();
    for run in runs {
        seen.push(run.await.unwrap().unwrap());
    }
    assert!(seen.iter().all(|s| *s == seen[0]), "{seen:?}");
    assert_eq!(seen[0].commit, commit);
    assert_eq!(
        entries(&base.path().join("work").join("git-cache")).len(),
        2
    );
}

#[tokio::test]
async fn with_the_cache_off_the_repository_lives_and_dies_with_the_run() {
    let repo = Repo::new();
    repo.write("main.tf", NETWORK_TF);
    let commit = repo.commit("first");
    let base = tempfile::tempdir().unwrap();
    let mut cfg = RunnerConfig::new("/nonexistent/terraform", base.path().join("work"));
    cfg.sandbox.ro_paths.push(common::REPOS_ROOT.into());
    cfg.git_cache = GitCache::PerRun;
    let runner = Runner::new(cfg);
    let (_shared_base, shared) = common::runner("/nonexistent/terraform", None);

    let wd = runner.workdir("run_off").unwrap();
    let off = runner
        .checkout(&wd, &repo.url(), "main", Some(&commit), "")
        .await
        .unwrap();
    assert!(wd.root().join("git").join("HEAD").is_file());
    let root = wd.root().to_path_buf();
    drop(wd);
    assert!(!root.exists());
    assert!(!base.path().join("work").join("git-cache").exists());
    // the same source, the same snapshot, whichever way it was fetched
    let wd = shared.workdir("run_shared").unwrap();
    let cached = shared
        .checkout(&wd, &repo.url(), "main", Some(&commit), "")
        .await
        .unwrap();
    assert_eq!(off, cached);
}

#[test]
fn the_cache_is_configured_by_settings() {
    let get = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| (*v).to_owned())
        }
    };
    let cfg = RunnerConfig::from_settings(get(&[("TAKOSUMI_WORK_DIR", "/w")])).unwrap();
    assert_eq!(
        cfg.git_cache,
        GitCache::Shared {
            root: "/w/git-cache".into(),
            ttl: takosumi_runner::DEFAULT_CACHE_TTL
        }
    );
    let cfg = RunnerConfig::from_settings(get(&[
        ("TAKOSUMI_WORK_DIR", "/w"),
        ("TAKOSUMI_GIT_CACHE_DIR", "/c"),
        ("TAKOSUMI_GIT_CACHE_TTL_SECS", "60"),
    ]))
    .unwrap();
    assert_eq!(
        cfg.git_cache,
        GitCache::Shared {
            root: "/c".into(),
            ttl: std::time::Duration::from_secs(60)
        }
    );
    let cfg = RunnerConfig::from_settings(get(&[
        ("TAKOSUMI_WORK_DIR", "/w"),
        ("TAKOSUMI_GIT_CACHE_DIR", "off"),
    ]))
    .unwrap();
    assert_eq!(cfg.git_cache, GitCache::PerRun);
    let problems = RunnerConfig::from_settings(get(&[
        ("TAKOSUMI_WORK_DIR", "/w"),
        ("TAKOSUMI_GIT_CACHE_DIR", "relative"),
        ("TAKOSUMI_GIT_CACHE_TTL_SECS", "soon"),
    ]))
    .unwrap_err();
    assert_eq!(problems.len(), 2, "{problems:?}");
}
