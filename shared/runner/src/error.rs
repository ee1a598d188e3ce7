//! The runner's error type. Messages name steps, paths and variable names, never values:
//! a tool's captured output travels in [`RunnerError::ToolFailed::output`] (masked with the
//! run's masker as it was read) and is left out of both `Display` and `Debug`.

use std::fmt;
use std::io;

use takosumi_core::FailureCode;

use crate::Tool;

/// Everything that can go wrong while preparing or running the tool.
#[derive(thiserror::Error)]
pub enum RunnerError {
    /// A file-system operation in the run's private directory failed.
    #[error("{context}: {source}")]
    Io {
        /// What the runner was doing (names a path, never file contents).
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The Capsule directory is not a relative directory inside the checkout.
    #[error("invalid directory: {0}")]
    InvalidDir(String),
    /// A run-directory label (a run id) that cannot be used as a file name.
    #[error("invalid work directory label {0:?}: use letters, digits, '_' and '-' (at most 100)")]
    InvalidLabel(String),
    /// A variable cannot be passed as `TF_VAR_<name>` (bad name or unusable value).
    #[error("variable {name:?} cannot be passed to the tool: {reason}")]
    InvalidVariable {
        /// The variable's name (never its value).
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// An injected environment entry is reserved by the runner or not a valid entry.
    #[error("environment entry {name:?} cannot be injected: {reason}")]
    InvalidEnv {
        /// The entry's name (never its value).
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// `tool` is neither `terraform` nor `tofu`.
    #[error("unknown tool {0:?}: expected \"terraform\" or \"tofu\"")]
    UnknownTool(String),
    /// The Capsule names a tool this runner has no binary for.
    #[error("{0} is not installed on this runner: put `{0}` on the PATH of the process executing runs, or name its binary with TAKOSUMI_{bin}_BIN", bin = .0.env_name())]
    ToolNotInstalled(Tool),
    /// The tool or git binary could not be started.
    #[error("could not start {program}: {source}")]
    Spawn {
        /// The program's path.
        program: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Cloning or checking out the source failed; the message is git's own (it may name the
    /// repository URL, with any user-info removed).
    #[error("checkout failed: {0}")]
    Checkout(String),
    /// A link in the checkout points outside it (the tool must never read past the
    /// checkout): the repository has to change, so the run's configuration is invalid.
    #[error("{0}")]
    LinkOutside(String),
    /// A command-source credential could not be resolved. The reason never quotes what
    /// the command printed: its output may be the secret itself.
    #[error("the credential command for {env_name} failed: {reason}")]
    CredentialCommand {
        /// The variable the command's output was meant for.
        env_name: String,
        /// What went wrong (exit code, timeout, empty output), never the output.
        reason: String,
    },
    /// The pinned commit does not exist in the repository (any longer).
    #[error("commit {0} was not found in the repository")]
    CommitNotFound(String),
    /// A tool step exited non-zero. `output` is the combined output, masked with the run's
    /// masker as it was read; it is still kept out of `Display`/`Debug`.
    #[error("`{step}` exited with code {exit_code}")]
    ToolFailed {
        /// `get`, `init`, `plan`, `show`, `output` or `version`.
        step: &'static str,
        /// The exit code (128 + signal number when killed by a signal).
        exit_code: i32,
        /// Combined output (for JSON steps: stderr only), masked as it was read.
        output: String,
    },
    /// A JSON step printed something that is not JSON.
    #[error("`{step}` did not print valid JSON: {source}")]
    BadJson {
        /// The step.
        step: &'static str,
        /// The parse error (positions only, no content).
        #[source]
        source: serde_json::Error,
    },
    /// A JSON step printed more than the runner accepts.
    #[error("`{step}` printed more than {limit} bytes")]
    OutputTooLarge {
        /// The step.
        step: &'static str,
        /// The limit in bytes.
        limit: usize,
    },
    /// The sandbox cannot start processes on this machine (see [`crate::SandboxConfig::check`]).
    #[error("the runner sandbox is unavailable: {0}")]
    SandboxUnavailable(String),
    /// A git or tool step ran past its time limit; its whole process group was killed.
    #[error("`{step}` did not finish within its time limit of {limit_secs} s and was stopped")]
    TimedOut {
        /// The step (`checkout`, `init`, `plan`, `apply`, …).
        step: &'static str,
        /// The limit, in seconds.
        limit_secs: u64,
    },
    /// `.terraform.lock.hcl` is larger than 1 MiB.
    #[error(
        "the provider lockfile is {size} bytes, over the 1 MiB (1048576 bytes) limit; \
         remove unused providers or hashes and plan again"
    )]
    LockfileTooLarge {
        /// The lockfile's size in bytes.
        size: u64,
    },
}

impl RunnerError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// Whether trying the same step again later can help (transient I/O, a network
    /// failure while cloning). Configuration errors, tool failures and oversized
    /// artifacts are final.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Io { .. } => true,
            Self::Checkout(message) => is_transient_git_failure(message),
            Self::InvalidDir(_)
            | Self::InvalidLabel(_)
            | Self::InvalidVariable { .. }
            | Self::InvalidEnv { .. }
            | Self::UnknownTool(_)
            | Self::ToolNotInstalled(_)
            | Self::Spawn { .. }
            | Self::CommitNotFound(_)
            | Self::LinkOutside(_)
            | Self::CredentialCommand { .. }
            | Self::ToolFailed { .. }
            | Self::BadJson { .. }
            | Self::OutputTooLarge { .. }
            | Self::SandboxUnavailable(_)
            | Self::TimedOut { .. }
            | Self::LockfileTooLarge { .. } => false,
        }
    }

    /// The Run failure code this error suggests, if it ends a Run by itself. `None` for
    /// errors the caller classifies (I/O, a missing binary, unreadable JSON).
    pub fn failure_code(&self) -> Option<FailureCode> {
        match self {
            Self::InvalidDir(_)
            | Self::InvalidLabel(_)
            | Self::InvalidVariable { .. }
            | Self::InvalidEnv { .. }
            | Self::UnknownTool(_)
            | Self::ToolNotInstalled(_)
            | Self::LinkOutside(_) => Some(FailureCode::InvalidConfiguration),
            Self::CredentialCommand { .. } => Some(FailureCode::CredentialFailed),
            Self::Checkout(_) => Some(FailureCode::CheckoutFailed),
            Self::CommitNotFound(_) => Some(FailureCode::SourceChanged),
            Self::ToolFailed { step, .. } => match *step {
                "init" | "get" => Some(FailureCode::InitFailed),
                "plan" | "show" => Some(FailureCode::PlanFailed),
                "apply" | "output" => Some(FailureCode::ApplyFailed),
                _ => None,
            },
            Self::LockfileTooLarge { .. } => Some(FailureCode::LockfileTooLarge),
            Self::TimedOut { .. } => Some(FailureCode::TimedOut),
            Self::SandboxUnavailable(_) => Some(FailureCode::SandboxUnavailable),
            Self::Io { .. }
            | Self::Spawn { .. }
            | Self::BadJson { .. }
            | Self::OutputTooLarge { .. } => None,
        }
    }
}

impl fmt::Debug for RunnerError {
    // Hand-written so a `{:?}` of a tool failure cannot print the tool's output at all.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ToolFailed {
                step,
                exit_code,
                output,
            } => f
                .debug_struct("ToolFailed")
                .field("step", step)
                .field("exit_code", exit_code)
                .field("output_bytes", &output.len())
                .finish(),
            Self::Io { context, source } => f
                .debug_struct("Io")
                .field("context", context)
                .field("source", source)
                .finish(),
            other => write!(f, "RunnerError({other})"),
        }
    }
}

/// Git failures worth retrying: the network or the remote, not the request.
fn is_transient_git_failure(message: &str) -> bool {
    const TRANSIENT: &[&str] = &[
        "Could not resolve host",
        "Connection refused",
        "Connection reset",
        "Connection timed out",
        "timed out",
        "Temporary failure",
        "early EOF",
        "the remote end hung up unexpectedly",
        "RPC failed",
        "Network is unreachable",
        "returned error: 5",
        "Resource temporarily unavailable",
    ];
    TRANSIENT.iter().any(|t| message.contains(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_output_never_in_display_or_debug() {
        let e = RunnerError::ToolFailed {
            step: "plan",
            exit_code: 1,
            output: "canary-secret-91".into(),
        };
        assert!(!format!("{e} {e:?}").contains("canary"));
        assert!(!e.retryable());
        assert_eq!(e.failure_code(), Some(FailureCode::PlanFailed));
    }

    #[test]
    fn transient_checkout_failures_retry() {
        assert!(
            RunnerError::Checkout(
                "fatal: unable to access 'https://x/': Could not resolve host: x".into()
            )
            .retryable()
        );
        assert!(
            !RunnerError::Checkout("fatal: Remote branch nope not found in upstream origin".into())
                .retryable()
        );
        assert!(!RunnerError::CommitNotFound("abc".into()).retryable());
        assert!(RunnerError::io("x", io::Error::other("disk")).retryable());
    }
}
