//! Command-source credentials: a command whose output is the credential, run fresh for
//! each run, inside the run's private directory, with an environment built from nothing.

use std::time::Duration;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;
use takosumi_core::Secret;

use crate::process::{self, StdoutMode};
use crate::runner::TOOL_PATH;
use crate::{Masker, Runner, RunnerError, Workdir};

/// The most a credential command may print (a credential, not a file).
pub const MAX_CREDENTIAL_BYTES: usize = 64 * 1024;
/// How long a command-source credential may take, on the control node and on a relay
/// worker alike.
pub const CREDENTIAL_COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl Runner {
    /// Runs `argv` (program first; a bare name is looked up on [`TOOL_PATH`]) with only
    /// `PATH` and `HOME` set, in the run's empty HOME, and returns its stdout with
    /// surrounding whitespace trimmed. It is stopped (its whole process group) after
    /// `timeout`. A non-zero exit, a timeout, empty or non-UTF-8 output, or more than
    /// [`MAX_CREDENTIAL_BYTES`] is [`RunnerError::CredentialCommand`]. Nothing the command
    /// prints is logged or put in an error: stdout is the secret and stderr may echo it.
    pub async fn resolve_command(
        &self,
        wd: &Workdir,
        argv: &[String],
        env_name: &str,
        timeout: Duration,
    ) -> Result<Secret<String>, RunnerError> {
        let fail = |reason: String| RunnerError::CredentialCommand {
            env_name: env_name.to_owned(),
            reason,
        };
        let Some((program, args)) = argv.split_first() else {
            return Err(fail("the command is empty".into()));
        };
        // Inside the sandbox a missing program is bubblewrap's exit 1: say what it is.
        let found = if program.contains('/') {
            Path::new(program).is_file()
        } else {
            TOOL_PATH
                .split(':')
                .any(|dir| Path::new(dir).join(program).is_file())
        };
        if !found {
            return Err(fail(format!(
                "it could not be started: {program} was not found (a bare name is looked up on {TOOL_PATH})"
            )));
        }
        let env: BTreeMap<String, OsString> = [
            ("PATH".to_owned(), OsString::from(TOOL_PATH)),
            ("HOME".to_owned(), wd.home().as_os_str().to_owned()),
        ]
        .into();
        // Inside the sandbox like every other child of a run: a command credential is
        // configuration too, and must not see the handler's secrets.
        let cmd = self.child(Path::new(program), args, wd.home(), env, wd.root(), None);
        // Nothing of stderr is kept: the masker for it does not know the value yet.
        let no_secrets = Masker::new();
        let run = process::run(cmd, program, StdoutMode::Data, &no_secrets);
        let captured = match tokio::time::timeout(timeout, run).await {
            Err(_) => {
                return Err(fail(format!(
                    "it did not finish within {} s and was stopped",
                    timeout.as_secs()
                )));
            }
            Ok(Err(RunnerError::Spawn { source, .. })) => {
                return Err(fail(format!("it could not be started: {source}")));
            }
            Ok(Err(e)) => return Err(e),
            Ok(Ok(c)) => c,
        };
        let mut stdout = captured.stdout;
        let result = if captured.exit_code != 0 {
            Err(fail(format!(
                "it exited with code {} (its output is not recorded: it may hold the secret)",
                captured.exit_code
            )))
        } else if captured.stdout_overflow || stdout.len() > MAX_CREDENTIAL_BYTES {
            Err(fail(format!(
                "it printed more than {MAX_CREDENTIAL_BYTES} bytes"
            )))
        } else {
            match std::str::from_utf8(&stdout) {
                Err(_) => Err(fail("its output is not UTF-8 text".into())),
                Ok(text) if text.trim().is_empty() => Err(fail("it printed nothing".into())),
                Ok(text) => Ok(Secret::new(text.trim().to_owned())),
            }
        };
        zeroize::Zeroize::zeroize(&mut stdout);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunnerConfig;

    fn runner() -> (tempfile::TempDir, Runner) {
        let base = tempfile::tempdir().unwrap();
        let cfg = RunnerConfig::new("/nonexistent/terraform", base.path().join("work"));
        (base, Runner::new(cfg))
    }

    fn argv(parts: &[&str]) -> Vec<String> {
        parts.iter().map(|p| (*p).to_owned()).collect()
    }

    #[tokio::test]
    async fn the_output_is_the_credential_and_failures_never_quote_it() {
        let (_base, runner) = runner();
        let wd = runner.workdir("run_cred").unwrap();
        let t = Duration::from_secs(10);
        let ok = runner
            .resolve_command(
                &wd,
                &argv(&["sh", "-c", "printf '  cred-canary-1\\n\\n'"]),
                "X",
                t,
            )
            .await
            .unwrap();
        assert_eq!(ok.expose(), "cred-canary-1");

        // A clean environment in the private HOME: nothing of this process leaks in.
        let env = runner
            .resolve_command(
                &wd,
                &argv(&["sh", "-c", "echo \"$HOME|$PATH|${CARGO:-none}|$(pwd -P)\""]),
                "X",
                t,
            )
            .await
            .unwrap();
        let home = wd.home().display().to_string();
        assert_eq!(env.expose(), &format!("{home}|{TOOL_PATH}|none|{home}"));

        for (cmd, want) in [
            (
                vec![
                    "sh",
                    "-c",
                    "echo cred-canary-2; echo cred-canary-2 >&2; exit 3",
                ],
                "code 3",
            ),
            (vec!["sh", "-c", "true"], "printed nothing"),
            (vec!["/nonexistent/helper"], "could not be started"),
            (vec!["sh", "-c", "printf '\\377\\376'"], "not UTF-8"),
        ] {
            let err = runner
                .resolve_command(&wd, &argv(&cmd), "MY_CRED", t)
                .await
                .unwrap_err();
            let text = format!("{err} {err:?}");
            assert!(text.contains(want), "{text}");
            assert!(text.contains("MY_CRED"), "{text}");
            assert!(!text.contains("cred-canary"), "{text}");
            assert_eq!(
                err.failure_code(),
                Some(takosumi_core::FailureCode::CredentialFailed)
            );
        }
        let err = runner.resolve_command(&wd, &[], "X", t).await.unwrap_err();
        assert!(err.to_string().contains("empty"));

        // Time-limited: a hanging helper is stopped.
        let started = std::time::Instant::now();
        let err = runner
            .resolve_command(
                &wd,
                &argv(&["sleep", "30"]),
                "X",
                Duration::from_millis(300),
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains("did not finish"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
