//! Canceling a run while the tool works: a runner made [`Runner::interruptible`] stops
//! its long tool steps when the run's cancel token fires. The tool gets SIGINT first —
//! terraform/tofu then stop starting new operations, finish the ones in flight and write
//! their state, which is what an apply canceled mid-way must keep — and SIGKILL (to the
//! whole process group) once the grace period is over. Short, read-only steps (`version`,
//! `show`, `output`) are never interrupted: they run after the tool's work is done, and
//! cutting them off could lose the record of work already applied.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::Runner;
use crate::process::Interrupt;

/// How long `init`, `get` and `plan` may take to stop after SIGINT.
const GRACE: Duration = Duration::from_secs(10);
/// How long `apply` may take: operations already sent to a provider are allowed to finish
/// so their result reaches the state file.
const APPLY_GRACE: Duration = Duration::from_secs(300);

impl Runner {
    /// A runner (sharing this one's configuration) whose `init`, `get`, `plan` and `apply`
    /// are interrupted when `token` fires; a step started after it fired does not start
    /// at all. The interrupted step's output ends with a note saying so, and its exit code
    /// is non-zero: callers check [`Runner::interrupted`] to tell a cancel from a failure.
    pub fn interruptible(&self, token: CancellationToken) -> Runner {
        let mut runner = self.clone();
        runner.interrupt = Some(token);
        runner
    }

    /// Whether this runner's cancel token fired.
    pub fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(CancellationToken::is_cancelled)
    }

    /// The interrupt for one tool step, if it is one that may be interrupted.
    pub(crate) fn interrupt_for(&self, step: &str) -> Option<Interrupt> {
        let token = self.interrupt.clone()?;
        let grace = match step {
            "init" | "get" | "plan" => GRACE,
            "apply" => APPLY_GRACE,
            _ => return None,
        };
        Some(Interrupt { token, grace })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::process::Command;

    use super::*;
    use crate::process::{INTERRUPTED_MARK, StdoutMode, run_interruptible};

    fn interrupt(grace_ms: u64) -> Interrupt {
        Interrupt {
            token: CancellationToken::new(),
            grace: Duration::from_millis(grace_ms),
        }
    }

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("/bin/sh");
        cmd.env_clear()
            .env("PATH", crate::TOOL_PATH)
            .args(["-c", script]);
        cmd
    }

    /// A child that honours SIGINT stops at once, and its output says it was interrupted.
    #[tokio::test]
    async fn sigint_stops_the_child_first() {
        // A SIGINT this process ignores (a shell's background job starts so) would be
        // ignored by the child too, which then cannot trap it; a handled one is reset to
        // the default at exec, as in the step binaries, which all handle SIGINT.
        let _handled =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).unwrap();
        let i = interrupt(20_000);
        let token = i.token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            token.cancel();
        });
        let started = Instant::now();
        let c = run_interruptible(
            sh("echo started; trap 'echo got-int; exit 3' INT; sleep 30 & wait"),
            "sh",
            StdoutMode::Log,
            Some(i),
            &crate::Masker::new(),
        )
        .await
        .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(c.exit_code, 3, "the trap ran: SIGINT came first");
        assert!(c.output.contains("started"), "{}", c.output);
        assert!(c.output.contains("got-int"), "{}", c.output);
        assert!(c.output.ends_with(INTERRUPTED_MARK), "{}", c.output);
    }

    /// A child that ignores SIGINT is killed (with its whole group) once the grace is over.
    #[tokio::test]
    async fn sigkill_after_the_grace_period() {
        let i = interrupt(300);
        let token = i.token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            token.cancel();
        });
        let started = Instant::now();
        let c = run_interruptible(
            sh("trap '' INT; sleep 30"),
            "sh",
            StdoutMode::Log,
            Some(i),
            &crate::Masker::new(),
        )
        .await
        .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(c.exit_code, 128 + 9);
        assert!(c.output.ends_with(INTERRUPTED_MARK));
    }

    /// A step whose token already fired starts nothing.
    #[tokio::test]
    async fn fired_token_starts_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        let i = interrupt(1000);
        i.token.cancel();
        let c = run_interruptible(
            sh(&format!("touch '{}'", marker.display())),
            "sh",
            StdoutMode::Log,
            Some(i),
            &crate::Masker::new(),
        )
        .await
        .unwrap();
        assert_eq!(c.exit_code, 130);
        assert!(!marker.exists());
    }

    /// Only the long steps are interrupted, and only on an interruptible runner.
    #[test]
    fn only_long_steps_are_interruptible() {
        let runner = Runner::new(crate::RunnerConfig::new("/bin/false", "/tmp"));
        assert!(runner.interrupt_for("plan").is_none());
        assert!(!runner.interrupted());
        let token = CancellationToken::new();
        let r = runner.interruptible(token.clone());
        for step in ["init", "get", "plan", "apply"] {
            assert!(r.interrupt_for(step).is_some(), "{step}");
        }
        for step in ["version", "show", "output"] {
            assert!(r.interrupt_for(step).is_none(), "{step}");
        }
        assert!(!r.interrupted());
        token.cancel();
        assert!(r.interrupted());
        assert!(!runner.interrupted());
    }
}
