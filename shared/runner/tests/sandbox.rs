//! The sandbox without a real tool: checkouts from local git repositories, and a fake
//! `terraform` (a shell script) that prints what it was given.

mod common;

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::time::{Duration, Instant};

use common::{NETWORK_TF, Repo, runner};
use takosumi_core::Secret;
use takosumi_runner::{Runner, RunnerError, Tool, ToolEnv};

#[tokio::test]
async fn checkout_pins_commits_cleans_and_digests() {
    let repo = Repo::new();
    repo.write("infra/network/main.tf", NETWORK_TF)
        .write(
            "infra/network/.terraform/terraform.tfstate",
            "{\"backend\":{\"type\":\"s3\"}}",
        )
        .write("infra/network/.terraform/modules/modules.json", "{}")
        .write(".terraform/leftover", "x")
        .write("infra/network/.terraform.lock.hcl", "# lock\n")
        .write("scripts/run.sh", "#!/bin/sh\n")
        .chmod("scripts/run.sh", 0o755);
    let first = repo.commit("first");
    repo.write("infra/network/main.tf", &format!("{NETWORK_TF}# v2\n"));
    let second = repo.commit("second");

    let (_base, runner) = runner("/nonexistent/terraform", None);

    // The branch head.
    let wd = runner.workdir("run_head").unwrap();
    let head = runner
        .checkout(&wd, &repo.url(), "main", None, "infra/network")
        .await
        .unwrap();
    assert_eq!(head.commit, second);
    assert_eq!(head.tree_digest.len(), 64);
    assert!(
        wd.config_dir().ends_with("checkout/infra/network"),
        "{}",
        wd.config_dir().display()
    );
    assert!(
        fs::read_to_string(wd.config_dir().join("main.tf"))
            .unwrap()
            .contains("# v2")
    );
    assert!(
        !wd.config_dir().join(".terraform").exists(),
        "a committed .terraform must be removed"
    );
    assert!(!wd.checkout().join(".terraform").exists());
    assert!(
        wd.config_dir().join(".terraform.lock.hcl").exists(),
        "a committed lockfile stays"
    );
    assert_eq!(
        runner.read_lockfile(&wd).unwrap().as_deref(),
        Some(&b"# lock\n"[..])
    );
    assert_eq!(
        fs::metadata(wd.root()).unwrap().permissions().mode() & 0o777,
        0o700
    );

    // A second checkout into the same directory is refused.
    assert!(matches!(
        runner
            .checkout(&wd, &repo.url(), "main", None, "infra/network")
            .await,
        Err(RunnerError::Checkout(_))
    ));

    // Pinned to the first commit, twice: same commit, same digest, other than the head's.
    let wd1 = runner.workdir("run_pin1").unwrap();
    let pinned = runner
        .checkout(&wd1, &repo.url(), "main", Some(&first), "infra/network")
        .await
        .unwrap();
    assert_eq!(pinned.commit, first);
    assert!(
        !fs::read_to_string(wd1.config_dir().join("main.tf"))
            .unwrap()
            .contains("# v2")
    );
    assert_ne!(pinned.tree_digest, head.tree_digest);
    let wd2 = runner.workdir("run_pin2").unwrap();
    let short = &first[..12];
    let again = runner
        .checkout(&wd2, &repo.url(), "main", Some(short), "")
        .await
        .unwrap();
    assert_eq!(
        again, pinned,
        "the digest is deterministic and the commit is the full id"
    );
    assert_eq!(wd2.config_dir(), wd2.checkout().canonicalize().unwrap());

    // A commit the repository does not have.
    let wd3 = runner.workdir("run_missing").unwrap();
    let err = runner
        .checkout(
            &wd3,
            &repo.url(),
            "main",
            Some(&"0123456789abcdef".repeat(2)[..32]),
            "infra/network",
        )
        .await
        .unwrap_err();
    assert!(matches!(err, RunnerError::CommitNotFound(_)), "{err}");
    assert!(!err.retryable());

    // A branch the repository does not have: git's message, not retryable.
    let wd4 = runner.workdir("run_branch").unwrap();
    let err = runner
        .checkout(&wd4, &repo.url(), "nope", None, "")
        .await
        .unwrap_err();
    let RunnerError::Checkout(message) = &err else {
        panic!("{err:?}")
    };
    assert!(message.contains("nope"), "{message}");
    assert!(!err.retryable());

    // Directories: missing, a file, escaping.
    for (label, dir) in [
        ("run_d1", "infra/missing"),
        ("run_d2", "infra/network/main.tf"),
        ("run_d3", "../x"),
        ("run_d4", "/etc"),
    ] {
        let wd = runner.workdir(label).unwrap();
        let err = runner
            .checkout(&wd, &repo.url(), "main", None, dir)
            .await
            .unwrap_err();
        assert!(matches!(err, RunnerError::InvalidDir(_)), "{dir}: {err}");
    }
    assert!(Runner::validate_dir("infra/network").is_ok());
    assert!(Runner::validate_dir("..").is_err());

    // Run directories are gone once dropped.
    let root = wd.root().to_path_buf();
    drop(wd);
    assert!(!root.exists());
}

#[tokio::test]
async fn links_out_of_the_checkout_are_refused() {
    let repo = Repo::new();
    repo.write("infra/main.tf", NETWORK_TF);
    symlink("/etc/hostname", repo.path().join("infra/host.tf")).unwrap();
    repo.commit("escape");
    let (_base, runner) = runner("/nonexistent/terraform", None);
    let wd = runner.workdir("run_link").unwrap();
    let err = runner
        .checkout(&wd, &repo.url(), "main", None, "infra")
        .await
        .unwrap_err();
    let RunnerError::LinkOutside(message) = &err else {
        panic!("{err:?}")
    };
    assert!(message.contains("outside the checkout"), "{message}");
    assert_eq!(
        err.failure_code(),
        Some(takosumi_core::FailureCode::InvalidConfiguration),
        "a repository with a link out of the checkout is an invalid configuration"
    );

    let repo = Repo::new();
    repo.write("real/main.tf", NETWORK_TF);
    symlink("real", repo.path().join("alias")).unwrap();
    symlink("/tmp", repo.path().join("tmp")).unwrap();
    repo.commit("dir link");
    repo.remove("tmp");
    repo.commit("drop tmp link");
    let wd = runner.workdir("run_alias").unwrap();
    runner
        .checkout(&wd, &repo.url(), "main", None, "alias")
        .await
        .unwrap();
    assert!(wd.config_dir().ends_with("checkout/real"));
}

/// A fake `terraform`: `version`/`show` print JSON, everything else prints its
/// arguments, working directory and whole environment. `FAKE_EXIT` sets the exit code.
const FAKE_TOOL: &str = r#"#!/bin/sh
case "$1" in
  version) echo '{"terraform_version":"0.0.0-fake","platform":"linux_amd64"}'; exit 0 ;;
  show) echo '{"resource_changes":[{"change":{"actions":["delete","create"]}}]}'; echo 'show-stderr' >&2; exit "${FAKE_EXIT:-0}" ;;
  sleep) sleep "$2" & echo $! > "$HOME/pid"; wait; exit 0 ;;
  daemon) sleep "$2" & echo "bg=$!"; exit 0 ;;
esac
echo "ARGS=$*"
echo "CWD=$(pwd -P)"
echo "stderr-line" >&2
sleep 0.05
env | sed 's/^/ENV /'
echo "TOKEN_SHA=$(printf %s "${MY_TOKEN:-}" | sha256sum | cut -c1-64)"
exit "${FAKE_EXIT:-0}"
"#;

fn fake_tool(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("fake-terraform");
    fs::write(&path, FAKE_TOOL).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn env_of(output: &str) -> Vec<(String, String)> {
    output
        .lines()
        .filter_map(|l| l.strip_prefix("ENV "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[tokio::test]
async fn the_tool_sees_only_the_environment_the_runner_built() {
    let tools = tempfile::tempdir().unwrap();
    let fake = fake_tool(tools.path());
    let repo = Repo::new();
    repo.write("infra/network/main.tf", NETWORK_TF);
    repo.commit("init");
    let (_base, runner) = runner(&fake, Some("/nonexistent/takosumi-test.tfrc".into()));
    let wd = runner.workdir("run_fake").unwrap();
    runner
        .checkout(&wd, &repo.url(), "main", None, "infra/network")
        .await
        .unwrap();
    runner.write_backend_override(&wd).unwrap();

    let vars = serde_json::json!({"region": "eu", "zones": ["a", "b"]});
    let env = ToolEnv::new()
        .with_variables(vars.as_object().unwrap())
        .unwrap()
        .with_secret_env("MY_TOKEN", Secret::new("tok-canary".into()));
    assert_eq!(env.names(), ["MY_TOKEN", "TF_VAR_region", "TF_VAR_zones"]);
    let out = runner.init(&wd, Tool::Terraform, &env).await.unwrap();
    assert_eq!(out.exit_code, 0);
    assert!(
        out.output.contains("ARGS=init -input=false -no-color"),
        "{}",
        out.output
    );
    assert!(
        out.output
            .contains(&format!("CWD={}", wd.config_dir().display()))
    );
    assert_eq!(out.stderr, "stderr-line\n");
    // Both streams reach the combined output (their relative order depends on scheduling
    // between the two pipes, so it is not asserted).
    assert!(
        out.output.contains("stderr-line") && out.output.contains("ENV "),
        "{}",
        out.output
    );

    let seen = env_of(&out.output);
    let get = |k: &str| seen.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("PATH"), Some("/usr/local/bin:/usr/bin:/bin"));
    assert_eq!(get("HOME"), wd.home().to_str());
    assert_eq!(get("CHECKPOINT_DISABLE"), Some("1"));
    assert_eq!(get("TF_IN_AUTOMATION"), Some("1"));
    assert_eq!(get("TF_INPUT"), Some("0"));
    assert_eq!(get("TF_FORK"), Some("0"));
    assert_eq!(
        get("TF_CLI_CONFIG_FILE"),
        Some("/nonexistent/takosumi-test.tfrc")
    );
    assert_eq!(get("TF_VAR_region"), Some("eu"));
    assert_eq!(get("TF_VAR_zones"), Some(r#"["a","b"]"#));
    // The tool got the credential, and what it printed of it is masked: the value
    // never leaves the runner, only its digest (printed by the fake) shows it arrived.
    assert_eq!(get("MY_TOKEN"), Some("***"));
    assert!(!out.output.contains("tok-canary"), "{}", out.output);
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(b"tok-canary"))
    };
    assert!(
        out.output.contains(&format!("TOKEN_SHA={sha}")),
        "{}",
        out.output
    );
    // Only those (plus what sh itself sets); nothing of this process's environment
    // (cargo's CARGO_*, a machine-wide TF_CLI_CONFIG_FILE, …) reaches the tool.
    let allowed = [
        "PATH",
        "HOME",
        "CHECKPOINT_DISABLE",
        "TF_IN_AUTOMATION",
        "TF_INPUT",
        "TF_FORK",
        "TF_CLI_CONFIG_FILE",
        "TF_VAR_region",
        "TF_VAR_zones",
        "MY_TOKEN",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
    ];
    for (name, _) in &seen {
        assert!(allowed.contains(&name.as_str()), "unexpected entry {name}");
    }
    assert!(std::env::vars_os().count() > 0);
    for (name, value) in std::env::vars() {
        if !allowed.contains(&name.as_str()) {
            assert!(
                !out.output.contains(&format!("ENV {name}={value}")),
                "{name} leaked"
            );
        }
    }

    // plan: -out in the run directory, -destroy when asked.
    let out = runner.plan(&wd, Tool::Terraform, &env, true).await.unwrap();
    let expected = format!(
        "ARGS=plan -input=false -no-color -destroy -out={}",
        wd.plan_path().display()
    );
    assert!(out.output.contains(&expected), "{}", out.output);

    // A failing step carries its output; Display does not.
    let failing = env
        .clone()
        .with_secret_env("FAKE_EXIT", Secret::new("3".into()));
    let err = runner
        .init(&wd, Tool::Terraform, &failing)
        .await
        .unwrap_err();
    let RunnerError::ToolFailed {
        step,
        exit_code,
        output,
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!((*step, *exit_code), ("init", 3));
    assert!(output.contains("MY_TOKEN=***"), "{output}");
    assert!(
        !output.contains("tok-canary"),
        "a failure's output is masked too"
    );
    assert!(!format!("{err} {err:?}").contains("tok-canary"));
    assert!(!err.retryable());

    // apply reports the exit code instead of failing.
    let out = runner.apply(&wd, Tool::Terraform, &failing).await.unwrap();
    assert_eq!(out.exit_code, 3);
    assert!(out.output.contains(&format!(
        "ARGS=apply -input=false -no-color {}",
        wd.plan_path().display()
    )));

    // JSON steps: stdout parsed, stderr only in failures.
    let show = runner.show_json(&wd, Tool::Terraform, &env).await.unwrap();
    let changes = takosumi_runner::count_changes(&show);
    assert_eq!((changes.add, changes.change, changes.destroy), (1, 0, 1));
    let err = runner
        .show_json(&wd, Tool::Terraform, &failing)
        .await
        .unwrap_err();
    let RunnerError::ToolFailed {
        step: "show",
        output,
        ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(output, "show-stderr\n");
    let version = runner
        .version(Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    assert_eq!(version["terraform_version"], "0.0.0-fake");

    // No tofu here; a reserved entry stops the tool before it starts.
    assert!(matches!(
        runner.init(&wd, Tool::Tofu, &env).await,
        Err(RunnerError::ToolNotInstalled(Tool::Tofu))
    ));
    let bad = ToolEnv::new().with_secret_env("TF_CLI_ARGS", Secret::new("-lock=false".into()));
    assert!(matches!(
        runner.init(&wd, Tool::Terraform, &bad).await,
        Err(RunnerError::InvalidEnv { .. })
    ));
}

/// Host pids of `sleep <marker>` (pids printed inside the sandbox are its own namespace's).
fn sleepers(marker: &str) -> Vec<u32> {
    let want = format!("sleep\0{marker}\0").into_bytes();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want))
        .filter(|pid| !is_gone(*pid))
        .collect()
}

async fn wait_no_sleepers(marker: &str) -> bool {
    for _ in 0..50 {
        if sleepers(marker).is_empty() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

fn is_gone(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // A zombie waiting for its reaper has ended too.
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn leftover_and_cancelled_processes_are_killed() {
    let tools = tempfile::tempdir().unwrap();
    let fake = fake_tool(tools.path());
    let repo = Repo::new();
    repo.write("main.tf", NETWORK_TF);
    repo.commit("init");

    // A background child keeping stdout open does not hold the step up, and dies.
    let wrapper = tools.path().join("daemon-terraform");
    fs::write(
        &wrapper,
        format!("#!/bin/sh\nexec {} daemon 29.1234\n", fake.display()),
    )
    .unwrap();
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).unwrap();
    let (_base2, daemon_runner) = runner(&wrapper, None);
    let wd2 = daemon_runner.workdir("run_daemon").unwrap();
    daemon_runner
        .checkout(&wd2, &repo.url(), "main", None, "")
        .await
        .unwrap();
    let started = Instant::now();
    let out = daemon_runner
        .apply(&wd2, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(out.output.lines().any(|l| l.starts_with("bg=")));
    assert!(
        wait_no_sleepers("29.1234").await,
        "the background process survived: {:?}",
        sleepers("29.1234")
    );

    // Dropping a running step (a timeout, a cancelled run) kills the tool and its whole
    // group (the pid is the tool's child, not the tool).
    let sleeper = tools.path().join("sleep-terraform");
    fs::write(
        &sleeper,
        format!("#!/bin/sh\nexec {} sleep 28.4321\n", fake.display()),
    )
    .unwrap();
    fs::set_permissions(&sleeper, fs::Permissions::from_mode(0o755)).unwrap();
    let (_base3, sleep_runner) = runner(&sleeper, None);
    let wd3 = sleep_runner.workdir("run_sleep").unwrap();
    sleep_runner
        .checkout(&wd3, &repo.url(), "main", None, "")
        .await
        .unwrap();
    let started = Instant::now();
    let result = tokio::time::timeout(
        Duration::from_millis(500),
        sleep_runner.init(&wd3, Tool::Terraform, &ToolEnv::new()),
    )
    .await;
    assert!(result.is_err(), "the step should have been cut off");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(
        fs::read_to_string(wd3.home().join("pid")).is_ok(),
        "the tool started its child"
    );
    assert!(
        wait_no_sleepers("28.4321").await,
        "the tool's child survived the cancelled step: {:?}",
        sleepers("28.4321")
    );
}

/// What a hostile configuration tries from inside a run, as a fake tool: every attempt is
/// reported, and the test asserts each one failed.
const HOSTILE_TOOL: &str = r#"#!/bin/sh
echo "UID=$(id -u)"
grep CapEff /proc/self/status | sed 's/^/CAP /'
echo "PROCS=$(ls /proc | grep -c '^[0-9]')"
for f in /proc/[0-9]*/environ; do cat "$f" 2>/dev/null | tr '\0' '\n'; done | sed 's/^/SEEN /'
cat "$OTHER_RUN_FILE" 2>/dev/null | sed 's/^/SEEN /'
cat /var/tmp/takosumi-stack/secrets 2>/dev/null | sed 's/^/SEEN /'
ls /var/tmp 2>/dev/null | sed 's/^/VARTMP /'
ls -R "$GIT_CACHE" 2>/dev/null | sed 's/^/CACHE /'
(echo x > "$GIT_CACHE/pwned") 2>/dev/null && echo "WROTE $GIT_CACHE"
cat /etc/shadow 2>/dev/null | sed 's/^/SEEN /'
ls -A /etc /etc/ssl 2>/dev/null | sed 's/^/ETC /'
ls -A "$WORK_ROOT" 2>/dev/null | sed 's/^/WORKROOT /'
for target in /usr/pwned /etc/pwned /etc/ssl/pwned /etc/hosts "$OUTSIDE_DIR/pwned"; do
  if (echo x > "$target") 2>/dev/null; then echo "WROTE $target"; fi
done
echo x > "$PWD/inside" && echo "WROTE-INSIDE"
(setsid sleep 27.9876 >/dev/null 2>&1 &)
echo done
"#;

#[tokio::test]
async fn a_run_cannot_reach_the_handler_other_runs_or_the_host() {
    let tools = tempfile::tempdir().unwrap();
    let tool = tools.path().join("hostile-terraform");
    fs::write(&tool, HOSTILE_TOOL).unwrap();
    fs::set_permissions(&tool, fs::Permissions::from_mode(0o755)).unwrap();
    let repo = Repo::new();
    repo.write("main.tf", NETWORK_TF);
    repo.commit("init");
    let (base, runner) = runner(&tool, None);

    // A process of the host with a canary in its environment (as the handler's secrets are).
    let mut host = std::process::Command::new("sleep")
        .arg("30")
        .env("TAKOSUMI_SEAL_KEY", "canary-host-env-5521")
        .spawn()
        .unwrap();
    // Another run, in flight, with a private file.
    let other = runner.workdir("run_other").unwrap();
    let other_file = other.home().join("secret");
    fs::write(&other_file, "canary-other-run-7734").unwrap();
    let outside = base.path().join("outside");
    fs::create_dir(&outside).unwrap();

    let wd = runner.workdir("run_hostile").unwrap();
    runner
        .checkout(&wd, &repo.url(), "main", None, "")
        .await
        .unwrap();
    // The Git cache holds the repository now; the tool must see none of it.
    let cache = base.path().join("work").join("git-cache");
    assert!(
        fs::read_dir(&cache).unwrap().count() >= 2,
        "an entry and its lock"
    );
    let env = ToolEnv::new()
        .with_secret_env(
            "OTHER_RUN_FILE",
            Secret::new(other_file.display().to_string()),
        )
        .with_secret_env("OUTSIDE_DIR", Secret::new(outside.display().to_string()))
        .with_secret_env("GIT_CACHE", Secret::new(cache.display().to_string()))
        .with_secret_env(
            "WORK_ROOT",
            Secret::new(base.path().join("work").display().to_string()),
        );
    let out = runner.apply(&wd, Tool::Terraform, &env).await.unwrap();
    let _ = host.kill();
    let _ = host.wait();
    let text = out.output;
    assert!(text.contains("done"), "{text}");
    let line = |p: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(p))
            .unwrap_or_else(|| panic!("no {p} in {text}"))
            .trim()
            .to_owned()
    };
    assert_eq!(line("UID="), takosumi_runner::SANDBOX_UID.to_string());
    assert_eq!(line("CAP CapEff:"), "0000000000000000");
    // its own pid namespace: the shell, the sandbox's init, a few helpers — not the host's
    let procs: usize = line("PROCS=").parse().unwrap();
    assert!(procs < 10, "{procs} processes visible");
    assert!(!text.contains("canary-host-env"), "{text}");
    assert!(!text.contains("canary-other-run"), "{text}");
    assert!(!text.contains("SEAL_KEY=canary"), "{text}");
    assert!(!text.contains("VARTMP "), "/var/tmp is visible: {text}");
    assert!(!text.contains("CACHE "), "the Git cache is visible: {text}");
    assert!(!cache.join("pwned").exists());
    assert!(!text.contains("root:"), "/etc/shadow is readable: {text}");
    // /etc holds the listed entries only (the runner's one-bind copy of them)
    let etc: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("ETC "))
        .filter(|l| !l.is_empty() && !l.ends_with(':'))
        .collect();
    assert!(etc.contains(&"passwd") && etc.contains(&"certs"), "{etc:?}");
    for hidden in ["shadow", "private", "sudoers", "ssh", "gshadow"] {
        assert!(!etc.contains(&hidden), "/etc shows {hidden}: {etc:?}");
    }
    // the work root shows the run's own directory (its mount point), nothing else of it:
    // not other runs, the Git cache or the /etc copy
    let in_root: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("WORKROOT "))
        .collect();
    assert!(
        in_root.iter().all(|n| n.starts_with("run_hostile.")),
        "the work root is visible: {in_root:?}"
    );
    assert!(
        !text.contains("WROTE /"),
        "wrote outside its directory: {text}"
    );
    assert!(text.contains("WROTE-INSIDE"), "{text}");
    assert!(!outside.join("pwned").exists());
    // The environment the tool saw holds only what the runner built.
    let seen: Vec<&str> = text.lines().filter(|l| l.starts_with("SEEN ")).collect();
    assert!(
        seen.iter()
            .all(|l| !l.contains("CARGO") && !l.contains("TAKOSUMI_")),
        "{seen:?}"
    );
    // Nothing it started outlives the step, even in a new session.
    assert!(
        wait_no_sleepers("27.9876").await,
        "a process of the run survived it: {:?}",
        sleepers("27.9876")
    );
}

#[tokio::test]
async fn a_hanging_tool_is_stopped_at_its_limit_and_nothing_of_it_remains() {
    let tools = tempfile::tempdir().unwrap();
    let tool = tools.path().join("hang-terraform");
    fs::write(
        &tool,
        "#!/bin/sh
(sleep 26.5432 &)
sleep 26.5432
",
    )
    .unwrap();
    fs::set_permissions(&tool, fs::Permissions::from_mode(0o755)).unwrap();
    let repo = Repo::new();
    repo.write("main.tf", NETWORK_TF);
    repo.commit("init");
    let base = tempfile::tempdir().unwrap();
    let mut cfg = takosumi_runner::RunnerConfig::new(&tool, base.path().join("work"));
    cfg.sandbox.ro_paths = vec![common::REPOS_ROOT.into(), tools.path().to_path_buf()];
    cfg.limits.plan = Duration::from_secs(1);
    let runner = Runner::new(cfg);
    let wd = runner.workdir("run_hang").unwrap();
    runner
        .checkout(&wd, &repo.url(), "main", None, "")
        .await
        .unwrap();
    let started = Instant::now();
    let err = runner
        .plan(&wd, Tool::Terraform, &ToolEnv::new(), false)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            RunnerError::TimedOut {
                step: "plan",
                limit_secs: 1
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.failure_code(),
        Some(takosumi_core::FailureCode::TimedOut)
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(
        wait_no_sleepers("26.5432").await,
        "the hanging tool survived: {:?}",
        sleepers("26.5432")
    );
}

#[tokio::test]
async fn a_starting_runner_removes_directories_of_runs_no_process_holds() {
    let (base, runner) = runner("/nonexistent/terraform", None);
    let held = runner.workdir("run_held").unwrap();
    let root = base.path().join("work");
    // left by a killed handler: pid 999999 with a start time that cannot match
    let dead = root.join("run_dead.999999-1.abc123");
    fs::create_dir_all(dead.join("plan")).unwrap();
    fs::write(dead.join("plan").join("tfplan"), "sealed? no: a plan").unwrap();
    let unrelated = root.join("notes");
    fs::create_dir_all(&unrelated).unwrap();
    runner.start_up().await.unwrap();
    assert!(!dead.exists(), "a dead owner's run directory stays");
    assert!(held.root().exists(), "a live run's directory was removed");
    assert!(unrelated.exists());
}
