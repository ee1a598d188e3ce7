//! Starting a child (git or the tool) in its own process group and collecting what it
//! prints. When the child ends — or the future running it is dropped — whatever is left of
//! its process group (providers, `local-exec` leftovers) is killed.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;

use crate::live::TapState;
use crate::{MaskStream, Masker, RunnerError};

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
    /// Masks the combined log as it arrives (one stream: a secret split across two lines
    /// of the interleaved output is still masked).
    log_mask: Option<MaskStream>,
    /// Masks `stderr` alone.
    stderr_mask: Option<MaskStream>,
    /// Gets what is appended to `output`, as it is (see [`crate::LogTap`]).
    tap: Option<TapState>,
}

impl Sink {
    /// A sink whose human-readable text is masked with `masker` as it arrives. Only the
    /// raw stdout of a JSON step (`StdoutMode::Data`) is kept unmasked: it is parsed,
    /// never logged.
    fn masked(masker: &Masker) -> Self {
        Self {
            log_mask: Some(masker.stream()),
            stderr_mask: Some(masker.stream()),
            ..Self::default()
        }
    }

    fn log_bytes(&mut self, line: &[u8]) {
        let text = match self.log_mask.as_mut() {
            Some(m) => m.push(line),
            None => String::from_utf8_lossy(line).into_owned(),
        };
        self.log(&text);
    }

    fn stderr_bytes(&mut self, line: &[u8]) {
        let text = match self.stderr_mask.as_mut() {
            Some(m) => m.push(line),
            None => String::from_utf8_lossy(line).into_owned(),
        };
        self.push_stderr(&text);
    }

    fn push_stderr(&mut self, text: &str) {
        if self.stderr_truncated {
            return;
        }
        if self.stderr.len() + text.len() > MAX_LOG_BYTES {
            self.stderr_truncated = true;
            self.stderr.push_str("\n[takosumi: output truncated]\n");
        } else {
            self.stderr.push_str(text);
        }
    }

    /// Flushes what the masks held back (the end of the output).
    fn finish_masks(&mut self) {
        if let Some(m) = self.log_mask.take() {
            let rest = m.finish();
            self.log(&rest);
        }
        if let Some(m) = self.stderr_mask.take() {
            let rest = m.finish();
            self.push_stderr(&rest);
        }
    }

    fn log(&mut self, line: &str) {
        if self.log_truncated {
            return;
        }
        if self.output.len() + line.len() > MAX_LOG_BYTES {
            self.log_truncated = true;
            self.output.push_str("\n[takosumi: output truncated]\n");
        } else {
            self.output.push_str(line);
            if let Some(tap) = self.tap.as_mut() {
                tap.feed(line);
            }
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
    signal_group(pgid, "KILL");
}

/// Sends `signal` (`INT`, `KILL`) to every process in group `pgid` (see [`kill_group`]).
fn signal_group(pgid: u32, signal: &str) {
    for kill in ["/bin/kill", "/usr/bin/kill"] {
        if std::path::Path::new(kill).exists() {
            let _ = std::process::Command::new(kill)
                .env_clear()
                .args(["-s", signal, "--", &format!("-{pgid}")])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            return;
        }
    }
}

/// Runs `cmd` (whose environment and working directory the caller set) to completion.
/// What it prints for people (and its stderr) is masked with `masker` as it arrives.
pub(crate) async fn run(
    cmd: Command,
    program: &str,
    mode: StdoutMode,
    masker: &Masker,
) -> Result<Captured, RunnerError> {
    run_interruptible(cmd, program, mode, None, masker).await
}

/// Stops a child when a token fires: SIGINT to its process group first (terraform then
/// finishes the resource operations in flight and writes its state), SIGKILL after `grace`.
#[derive(Clone)]
pub(crate) struct Interrupt {
    pub token: tokio_util::sync::CancellationToken,
    pub grace: Duration,
}

/// What an interrupted child's output ends with.
pub(crate) const INTERRUPTED_MARK: &str = "\n[takosumi: interrupted: the run was canceled]\n";

/// Like [`run`]; when `interrupt` fires the child is interrupted (see [`Interrupt`]) and
/// what it printed until it stopped is returned with its (non-zero) exit code. A token
/// that fired before the start starts nothing: exit code 130 and only the mark.
pub(crate) async fn run_interruptible(
    cmd: Command,
    program: &str,
    mode: StdoutMode,
    interrupt: Option<Interrupt>,
    masker: &Masker,
) -> Result<Captured, RunnerError> {
    run_tapped(cmd, program, mode, interrupt, masker, None).await
}

/// Like [`run_interruptible`]; what is appended to the combined output is also handed to
/// `tap` as it arrives (masked, an exact prefix of the final output).
pub(crate) async fn run_tapped(
    mut cmd: Command,
    program: &str,
    mode: StdoutMode,
    interrupt: Option<Interrupt>,
    masker: &Masker,
    tap: Option<TapState>,
) -> Result<Captured, RunnerError> {
    if let Some(i) = &interrupt
        && i.token.is_cancelled()
    {
        return Ok(Captured {
            exit_code: 130,
            output: INTERRUPTED_MARK.trim_start().to_owned(),
            stdout: Vec::new(),
            stderr: String::new(),
            stdout_overflow: false,
        });
    }
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
    let mut sink = Sink::masked(masker);
    sink.tap = tap;
    let sink = Arc::new(Mutex::new(sink));
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
    let never = tokio_util::sync::CancellationToken::new();
    let token = interrupt.as_ref().map_or(&never, |i| &i.token);
    let mut kill_at: Option<tokio::time::Instant> = None;
    let status: ExitStatus = loop {
        tokio::select! {
            _ = &mut readers, if !readers_done => readers_done = true,
            status = child.wait() => break status.map_err(|e| RunnerError::io(format!("waiting for {program}"), e))?,
            _ = token.cancelled(), if kill_at.is_none() => {
                if let Some(pgid) = guard.0 {
                    signal_group(pgid, "INT");
                }
                let grace = interrupt.as_ref().map_or(Duration::ZERO, |i| i.grace);
                kill_at = Some(tokio::time::Instant::now() + grace);
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or_else(tokio::time::Instant::now)), if kill_at.is_some() => {
                if let Some(pgid) = guard.0 {
                    kill_group(pgid);
                }
                kill_at = Some(tokio::time::Instant::now() + PIPE_GRACE);
            }
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
    let mut sink = std::mem::take(&mut *sink);
    sink.finish_masks();
    if kill_at.is_some() {
        sink.output.push_str(INTERRUPTED_MARK);
    }
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
            Stream::Stdout(StdoutMode::Log) => sink.log_bytes(&line),
            Stream::Stderr => {
                sink.log_bytes(&line);
                sink.stderr_bytes(&line);
            }
        }
    }
}
