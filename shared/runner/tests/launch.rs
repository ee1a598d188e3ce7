//! One sandbox per step: a step's tool commands run one after another in a single
//! bubblewrap start through the launcher (`takosumi-launch`, built beside this test), and
//! what a sandbox per command gave still holds: each command's own environment and
//! streams, nothing left running between commands, interrupts, time limits.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{NETWORK_TF, Repo};
use takosumi_core::Secret;
use takosumi_runner::{Runner, RunnerConfig, RunnerError, Tool, ToolEnv};
use tokio_util::sync::CancellationToken;

/// A fake tool driven by its first argument (`init`, `plan`, …) and `FAKE_MODE`.
const TOOL: &str = r#"#!/bin/sh
echo "NS=$(readlink /proc/self/ns/pid)"
echo "PARENT=$(tr '\0' ' ' < /proc/$PPID/cmdline)"
# opening them is what ptrace-level access would allow (reading mem at 0 fails anyway)
for what in environ mem maps; do
  ( exec 3< "/proc/$PPID/$what" ) 2>/dev/null && echo "LAUNCHER-OPEN $what"
done
# its pipes to the runner: writing frames of its own would be a lie told in its name
( exec 3> "/proc/$PPID/fd/1" ) 2>/dev/null && echo "LAUNCHER-OPEN fd/1"
( exec 3< "/proc/$PPID/fd/0" ) 2>/dev/null && echo "LAUNCHER-OPEN fd/0"
# the probe works: the tool's own entries open
( exec 3< "/proc/self/environ" ) 2>/dev/null && ( exec 3> "/proc/self/fd/1" ) 2>/dev/null && echo "OWN-OPEN"
env | sed 's/^/ENV /'
echo "to-stderr" >&2
case "${FAKE_MODE:-}" in
  leave)
    # a leftover that acts after the command ends: it must not get the chance
    (sleep 0.4; echo late > "$PWD/late") >/dev/null 2>&1 &
    (setsid sleep 25.1357 >/dev/null 2>&1 &)
    ;;
  trap)
    trap 'echo got-int; exit 3' INT
    echo waiting
    sleep 25.2468 & wait
    ;;
  hang:*)
    sleep "${FAKE_MODE#hang:}"
    ;;
esac
exit 0
"#;

fn tool(dir: &Path) -> PathBuf {
    let path = dir.join("fake-terraform");
    fs::write(&path, TOOL).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn launcher() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_takosumi-launch"))
}

fn runner_with(tool: &Path, launcher: Option<PathBuf>) -> (tempfile::TempDir, Runner) {
    let base = tempfile::tempdir().unwrap();
    let mut cfg = RunnerConfig::new(tool, base.path().join("work"));
    cfg.sandbox.ro_paths = vec![common::REPOS_ROOT.into(), tool.parent().unwrap().into()];
    cfg.launcher_bin = launcher;
    cfg.limits.plan = Duration::from_secs(2);
    (base, Runner::new(cfg))
}

fn line<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in {text}"))
}

fn env(mode: &str) -> ToolEnv {
    ToolEnv::new().with_secret_env("FAKE_MODE", Secret::new(mode.to_owned()))
}

fn alive(marker: &str) -> bool {
    let want = format!("sleep\0{marker}\0").into_bytes();
    fs::read_dir("/proc").unwrap().flatten().any(|e| {
        let p = e.path();
        fs::read(p.join("cmdline")).is_ok_and(|c| c == want)
            && fs::read_to_string(p.join("stat")).is_ok_and(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
    })
}

/// Whether no `sleep <marker>` is left within a second.
async fn gone_soon(marker: &str) -> bool {
    for _ in 0..50 {
        if !alive(marker) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

async fn checked_out(runner: &Runner, label: &str) -> takosumi_runner::Workdir {
    let repo = Repo::new();
    repo.write("main.tf", NETWORK_TF);
    repo.commit("init");
    let wd = runner.workdir(label).unwrap();
    runner
        .checkout(&wd, &repo.url(), "main", None, "")
        .await
        .unwrap();
    wd
}

#[tokio::test]
async fn a_steps_commands_share_one_sandbox_and_each_gets_only_its_own_environment() {
    let tools = tempfile::tempdir().unwrap();
    let tool = tool(tools.path());
    let (_base, runner) = runner_with(&tool, Some(launcher()));
    let wd = checked_out(&runner, "run_one").await;

    let first_env =
        ToolEnv::new().with_secret_env("FIRST_ONLY", Secret::new("canary-first-4410".into()));
    let init = runner.init(&wd, Tool::Terraform, &first_env).await.unwrap();
    let plan = runner
        .plan(&wd, Tool::Terraform, &ToolEnv::new(), false)
        .await
        .unwrap();
    // one pid namespace for both: one sandbox start, the launcher the tool's parent
    assert_eq!(line(&init.output, "NS="), line(&plan.output, "NS="));
    assert!(
        line(&plan.output, "PARENT=").contains("/run/takosumi/launch"),
        "{}",
        plan.output
    );
    // the launcher's /proc entries are closed to the commands it runs (non-dumpable)
    assert!(!init.output.contains("LAUNCHER-OPEN"), "{}", init.output);
    assert!(init.output.contains("OWN-OPEN"), "{}", init.output);
    // each command's environment is the one built for it: nothing of the one before,
    // nothing of the launcher's
    let vars = |out: &str| -> Vec<String> {
        out.lines()
            .filter_map(|l| l.strip_prefix("ENV "))
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_owned()))
            .collect()
    };
    assert!(vars(&init.output).contains(&"FIRST_ONLY".to_owned()));
    assert!(
        !vars(&plan.output).contains(&"FIRST_ONLY".to_owned()),
        "{}",
        plan.output
    );
    // the secret reached the tool and was masked on its way out; stderr is its own stream
    assert!(
        !init.output.contains("canary-first-4410"),
        "{}",
        init.output
    );
    assert!(
        init.output.contains("ENV FIRST_ONLY=***"),
        "{}",
        init.output
    );
    assert!(plan.output.contains("to-stderr"), "{}", plan.output);
    assert_eq!(
        vars(&plan.output),
        vars(&init.output)
            .into_iter()
            .filter(|v| v != "FIRST_ONLY")
            .collect::<Vec<_>>()
    );

    // Without a launcher each command has a sandbox of its own (the setting `off`).
    let (_base2, per_command) = runner_with(&tool, None);
    let wd2 = checked_out(&per_command, "run_two").await;
    let a = per_command
        .init(&wd2, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    let b = per_command
        .plan(&wd2, Tool::Terraform, &ToolEnv::new(), false)
        .await
        .unwrap();
    assert_ne!(line(&a.output, "NS="), line(&b.output, "NS="));
    assert!(!line(&b.output, "PARENT=").contains("/run/takosumi/launch"));
}

#[tokio::test]
async fn nothing_a_command_left_runs_once_the_runner_hears_it_ended() {
    let tools = tempfile::tempdir().unwrap();
    let tool = tool(tools.path());
    let (_base, runner) = runner_with(&tool, Some(launcher()));
    let wd = checked_out(&runner, "run_leave").await;
    runner
        .init(&wd, Tool::Terraform, &env("leave"))
        .await
        .unwrap();
    // The runner now reads and seals what the command wrote: nothing of the Capsule may
    // run meanwhile (a plan file rewritten after it was sealed, a link swapped in).
    assert!(
        !alive("25.1357"),
        "a detached leftover survived the command"
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !wd.config_dir().join("late").exists(),
        "a leftover wrote after the command ended"
    );
    // and the sandbox still serves the next command
    let plan = runner
        .plan(&wd, Tool::Terraform, &ToolEnv::new(), false)
        .await
        .unwrap();
    assert!(plan.output.contains("NS="));
}

#[tokio::test]
async fn an_interrupt_reaches_the_command_and_the_sandbox_serves_the_next() {
    // A SIGINT this process ignores (a shell's background job starts so) would reach the
    // sandbox ignored, and the command could not trap it; a handled one is reset to the
    // default at exec, as in the step binaries, which all handle SIGINT.
    let _handled =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).unwrap();
    let tools = tempfile::tempdir().unwrap();
    let tool = tool(tools.path());
    let (_base, runner) = runner_with(&tool, Some(launcher()));
    let wd = checked_out(&runner, "run_int").await;
    let before = runner
        .init(&wd, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    let token = CancellationToken::new();
    let interruptible = runner.interruptible(token.clone());
    let cancel = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        token.cancel();
    };
    let trap = env("trap");
    let (planned, ()) = tokio::join!(
        interruptible.plan(&wd, Tool::Terraform, &trap, false),
        cancel
    );
    let err = planned.unwrap_err();
    let RunnerError::ToolFailed { output, .. } = &err else {
        panic!("{err:?}");
    };
    // SIGINT reached the tool (it trapped it and exited 3), the mark says why it ended
    assert!(output.contains("got-int"), "{output}");
    assert!(output.contains("interrupted"), "{output}");
    assert!(!alive("25.2468"));
    let after = runner
        .init(&wd, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    assert_eq!(
        line(&before.output, "NS="),
        line(&after.output, "NS="),
        "the same sandbox"
    );
}

#[tokio::test]
async fn a_command_past_its_limit_ends_its_sandbox_and_the_next_gets_a_new_one() {
    let tools = tempfile::tempdir().unwrap();
    let tool = tool(tools.path());
    let (_base, runner) = runner_with(&tool, Some(launcher()));
    let wd = checked_out(&runner, "run_limit").await;
    let before = runner
        .init(&wd, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    let started = Instant::now();
    let err = runner
        .plan(&wd, Tool::Terraform, &env("hang:25.3579"), false)
        .await
        .unwrap_err();
    assert!(
        matches!(err, RunnerError::TimedOut { step: "plan", .. }),
        "{err:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(
        gone_soon("25.3579").await,
        "the hanging command survived its limit"
    );
    let after = runner
        .init(&wd, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    assert_ne!(
        line(&before.output, "NS="),
        line(&after.output, "NS="),
        "a new sandbox"
    );
}

#[tokio::test]
async fn a_dropped_step_ends_its_sandbox() {
    let tools = tempfile::tempdir().unwrap();
    let tool = tool(tools.path());
    let (_base, runner) = runner_with(&tool, Some(launcher()));
    let wd = checked_out(&runner, "run_drop").await;
    let cut = tokio::time::timeout(
        Duration::from_millis(400),
        runner.plan(&wd, Tool::Terraform, &env("hang:25.4680"), false),
    )
    .await;
    assert!(cut.is_err(), "the step should have been cut off");
    assert!(
        gone_soon("25.4680").await,
        "the command outlived the step that dropped it"
    );
    // the Workdir is usable again with a new sandbox
    runner
        .init(&wd, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
}

#[test]
fn the_launcher_is_found_beside_the_binary_or_set() {
    // `RunnerConfig::new` finds it beside this test's binary (target/<profile>/deps → ..)
    let cfg = RunnerConfig::new("/t", "/w");
    assert_eq!(
        cfg.launcher_bin
            .as_deref()
            .map(fs::canonicalize)
            .map(Result::unwrap),
        Some(fs::canonicalize(launcher()).unwrap())
    );
    let get = |k: &str| match k {
        "TAKOSUMI_WORK_DIR" => Some("/w".to_owned()),
        "TAKOSUMI_LAUNCHER_BIN" => Some("off".to_owned()),
        _ => None,
    };
    assert_eq!(RunnerConfig::from_settings(get).unwrap().launcher_bin, None);
    let relative = |k: &str| match k {
        "TAKOSUMI_WORK_DIR" => Some("/w".to_owned()),
        "TAKOSUMI_LAUNCHER_BIN" => Some("launch".to_owned()),
        _ => None,
    };
    let problems = RunnerConfig::from_settings(relative).unwrap_err();
    assert!(
        problems.iter().any(|p| p.contains("TAKOSUMI_LAUNCHER_BIN")),
        "{problems:?}"
    );
}

/// Host pids of launchers serving `wd` (their working directory is the Run's directory).
fn launchers_of(wd: &takosumi_runner::Workdir) -> Vec<u32> {
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == b"/run/takosumi/launch\0")
                && fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|d| d == wd.root())
        })
        .collect()
}

#[tokio::test]
async fn the_steps_sandbox_starts_beside_the_checkout_and_serves_every_command() {
    let tools = tempfile::tempdir().unwrap();
    let tool = tool(tools.path());
    let (_base, runner) = runner_with(&tool, Some(launcher()));
    let repo = Repo::new();
    repo.write("main.tf", NETWORK_TF);
    repo.commit("init");
    let wd = runner.workdir("run_early").unwrap();
    runner.start_step_sandbox(&wd);
    runner
        .checkout(&wd, &repo.url(), "main", None, "")
        .await
        .unwrap();
    let mut started = Vec::new();
    for _ in 0..50 {
        started = launchers_of(&wd);
        if !started.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        started.len(),
        1,
        "one launcher before any tool command: {started:?}"
    );
    // a second call starts nothing more
    runner.start_step_sandbox(&wd);
    runner
        .init(&wd, Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    runner
        .plan(&wd, Tool::Terraform, &ToolEnv::new(), false)
        .await
        .unwrap();
    assert_eq!(
        launchers_of(&wd),
        started,
        "the same launcher ran both commands"
    );
    wd.close().unwrap();
    let running = |p: &u32| {
        fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
    };
    for _ in 0..50 {
        if !started.iter().any(running) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !started.iter().any(running),
        "the launcher outlived its Workdir"
    );
}
