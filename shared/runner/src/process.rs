//! Starting a child (git or the tool) in its own process group and collecting what it
//! prints. When the child ends — or the future running it is dropped — whatever is left of
//! its process group (providers, `local-exec` leftovers) is killed.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;

use crate::RunnerError;

/// Combined output kept for people (larger output is truncated with a marker).
pub(crate) const MAX_LOG_BYTES: usize = 16 * 1024 * 1024;
/// stdout kept for machine-readable steps (`show -json` of a big plan can be large).
pub(crate) const MAX_STDOUT_BYTES: usize = 256 * 1024 * 1024;
/// How long to wait for the pipes to close after the child exited.
const PIPE_GRACE: Duration = Duration::from_secs(5);

/// Everything a child printed.
pub(crate) struct Captured {
    pub exit_code: i32,
    /// Interleaved lines (stdout only if it was asked for).
    pub output: String,
    /// Raw stdout, when captured separately.
    pub stdout: Vec<u8>,
    pub stderr: String,
    pub stdout_overflow: bool,
}

/// Where stdout goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum StdoutMode {
    /// Into the combined log (human-readable steps).
    Log,
    /// Into `Captured::stdout` only (JSON steps: it may hold sensitive values).
    Data,
}

#[derive(Default)]
struct Sink {
    output: String,
    stdout: Vec<u8>,
    stderr: String,
    log_truncated: bool,
    stderr_truncated: bool,
    stdout_overflow: bool,
}

impl Sink {
    fn log(&mut self, line: &str) {
        if self.log_truncated {
            return;
        }
        if self.output.len() + line.len() > MAX_LOG_BYTES {
            self.log_truncated = true;
            self.output.push_str("\n[takosumi: output truncated]\n");
        } else {
            self.output.push_str(line);
        }
    }
}

/// Kills the child's process group when dropped (after exit or on cancellation).
struct GroupGuard(Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            kill_group(pgid);
        }
    }
}

/// SIGKILL to every process left in group `pgid`. The group id cannot be reused while a
/// member lives, so this never hits an unrelated process. Without `unsafe` (forbidden in
/// this workspace) there is no `killpg`: use kill(1).
fn kill_group(pgid: u32) {
    for kill in ["/bin/kill", "/usr/bin/kill"] {
        if std::path::Path::new(kill).exists() {
            let _ = std::process::Command::new(kill)
                .env_clear()
                .args(["-s", "KILL", "--", &format!("-{pgid}")])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            return;
        }
    }
}

/// Runs `cmd` (whose environment and working directory the caller set) to completion.
pub(crate) async fn run(
    mut cmd: Command,
    program: &str,
    mode: StdoutMode,
) -> Result<Captured, RunnerError> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    let mut child = cmd.spawn().map_err(|source| RunnerError::Spawn {
        program: program.to_owned(),
        source,
    })?;
    let guard = GroupGuard(child.id());
    let sink = Arc::new(Mutex::new(Sink::default()));
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let readers = async {
        tokio::join!(
            read_stream(stdout, sink.clone(), Stream::Stdout(mode)),
            read_stream(stderr, sink.clone(), Stream::Stderr),
        )
    };
    let mut readers = std::pin::pin!(readers);
    let mut readers_done = false;
    let status: ExitStatus = loop {
        tokio::select! {
            _ = &mut readers, if !readers_done => readers_done = true,
            status = child.wait() => break status.map_err(|e| RunnerError::io(format!("waiting for {program}"), e))?,
        }
    };
    if !readers_done
        && tokio::time::timeout(Duration::from_millis(200), &mut readers)
            .await
            .is_err()
    {
        // Something the child left behind still holds the pipes: end the group, drain.
        if let Some(pgid) = guard.0 {
            kill_group(pgid);
        }
        let _ = tokio::time::timeout(PIPE_GRACE, &mut readers).await;
    }
    let exit_code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1);
    let mut sink = sink.lock().unwrap_or_else(|e| e.into_inner());
    let sink = std::mem::take(&mut *sink);
    Ok(Captured {
        exit_code,
        output: sink.output,
        stdout: sink.stdout,
        stderr: sink.stderr,
        stdout_overflow: sink.stdout_overflow,
    })
}

#[derive(Clone, Copy)]
enum Stream {
    Stdout(StdoutMode),
    Stderr,
}

async fn read_stream<R: AsyncRead + Unpin>(
    pipe: Option<R>,
    sink: Arc<Mutex<Sink>>,
    stream: Stream,
) {
    let Some(pipe) = pipe else { return };
    let mut reader = BufReader::new(pipe);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut sink = sink.lock().unwrap_or_else(|e| e.into_inner());
        match stream {
            Stream::Stdout(StdoutMode::Data) => {
                if sink.stdout.len() + line.len() > MAX_STDOUT_BYTES {
                    sink.stdout_overflow = true;
                } else {
                    sink.stdout.extend_from_slice(&line);
                }
            }
            Stream::Stdout(StdoutMode::Log) => sink.log(&String::from_utf8_lossy(&line)),
            Stream::Stderr => {
                let text = String::from_utf8_lossy(&line);
                sink.log(&text);
                if !sink.stderr_truncated {
                    if sink.stderr.len() + text.len() > MAX_LOG_BYTES {
                        sink.stderr_truncated = true;
                        sink.stderr.push_str("\n[takosumi: output truncated]\n");
                    } else {
                        sink.stderr.push_str(&text);
                    }
                }
            }
        }
    }
}
