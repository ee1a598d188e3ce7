//! Starting a child (git or the tool) in its own process group and collecting what it
//! prints. When the child ends — or the future running it is dropped — whatever is left of
//! its process group (providers, `local-exec` leftovers) is killed.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::process::Signal;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

use crate::live::TapState;
use crate::sandbox::{self, Prepared};
use crate::{MaskStream, Masker, RunnerError};

/// Combined output kept for people (larger output is truncated with a marker).
pub(crate) const MAX_LOG_BYTES: usize = 16 * 1024 * 1024;
/// stdout kept for machine-readable steps (`show -json` of a big plan can be large).
pub(crate) const MAX_STDOUT_BYTES: usize = 256 * 1024 * 1024;
/// The longest line kept; the rest of a longer line is dropped (memory stays bounded
/// whatever a child prints).
pub(crate) const MAX_LINE_BYTES: usize = 64 * 1024;
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
            self.stderr.push_str(TRUNCATED_MARK);
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
            self.output.push_str(TRUNCATED_MARK);
        } else {
            self.output.push_str(line);
            if let Some(tap) = self.tap.as_mut() {
                tap.feed(line);
            }
        }
    }
}

/// What a capped output ends with: the cap, stated.
pub(crate) const TRUNCATED_MARK: &str =
    "\n[takosumi: output truncated: a step's log is capped at 16 MiB]\n";
/// What replaces the rest of an over-long line.
const LINE_CUT_MARK: &[u8] = b" [takosumi: line cut at 64 KiB]\n";

/// Kills the child's process group when dropped (after exit or on cancellation).
pub(crate) struct GroupGuard(pub(crate) Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            kill_group(pgid);
        }
    }
}

/// SIGKILL to every process left in group `pgid`. The group id cannot be reused while a
/// member lives, so this never hits an unrelated process.
pub(crate) fn kill_group(pgid: u32) {
    signal_group(pgid, Signal::KILL);
}

/// Sends `signal` to every process in group `pgid` (see [`kill_group`]). A system call, not
/// kill(1): every sandbox's end passes here, and a process start costs milliseconds.
fn signal_group(pgid: u32, signal: Signal) {
    if let Some(group) = pid(pgid) {
        // ESRCH: the group is already gone, which is what was asked.
        let _ = rustix::process::kill_process_group(group, signal);
    }
}

/// Interrupts a child: SIGINT to its process group; for a sandboxed child to the processes
/// inside only (bubblewrap itself would die of it and take the sandbox down at once,
/// before the tool could finish the operations in flight and write its state).
fn interrupt_child(pgid: u32, sandboxed: bool) {
    if sandboxed {
        for p in sandbox::descendants_of(pgid) {
            if let Some(p) = pid(p) {
                let _ = rustix::process::kill_process(p, Signal::INT);
            }
        }
    } else {
        signal_group(pgid, Signal::INT);
    }
}

/// A process (or group) id as the kernel takes it; `None` for 0 and ids past `i32`, which
/// would name the caller's own group or every process.
fn pid(raw: u32) -> Option<rustix::process::Pid> {
    i32::try_from(raw)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
}

/// Runs `cmd` (whose environment and working directory the caller set) to completion.
/// What it prints for people (and its stderr) is masked with `masker` as it arrives.
pub(crate) async fn run(
    cmd: impl Into<Prepared>,
    program: &str,
    mode: StdoutMode,
    masker: &Masker,
) -> Result<Captured, RunnerError> {
    run_tapped(cmd.into(), program, mode, Opts::default(), masker).await
}

/// How a child may be stopped early, and where its output goes live.
#[derive(Default)]
pub(crate) struct Opts {
    /// Stops the child when fired (see [`Interrupt`]).
    pub interrupt: Option<Interrupt>,
    /// Gets the combined output as it arrives.
    pub tap: Option<TapState>,
    /// The step's name and time limit: past it the whole group is killed and the run
    /// ends [`RunnerError::TimedOut`].
    pub limit: Option<(&'static str, Duration)>,
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
#[cfg(test)]
pub(crate) async fn run_interruptible(
    cmd: impl Into<Prepared>,
    program: &str,
    mode: StdoutMode,
    interrupt: Option<Interrupt>,
    masker: &Masker,
) -> Result<Captured, RunnerError> {
    let opts = Opts {
        interrupt,
        ..Opts::default()
    };
    run_tapped(cmd.into(), program, mode, opts, masker).await
}

/// Like [`run_interruptible`]; what is appended to the combined output is also handed to
/// `tap` as it arrives (masked, an exact prefix of the final output).
pub(crate) async fn run_tapped(
    prepared: Prepared,
    program: &str,
    mode: StdoutMode,
    opts: Opts,
    masker: &Masker,
) -> Result<Captured, RunnerError> {
    let Prepared { mut cmd, sandboxed } = prepared;
    if let Some(done) = cancelled_before_start(&opts) {
        return Ok(done);
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
    let mut ctl = ChildControl {
        guard: GroupGuard(child.id()),
        sandboxed,
    };
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let wait = async {
        let status: ExitStatus = child
            .wait()
            .await
            .map_err(|e| RunnerError::io(format!("waiting for {program}"), e))?;
        Ok(status
            .code()
            .or_else(|| status.signal().map(|s| 128 + s))
            .unwrap_or(-1))
    };
    drive(wait, stdout, stderr, &mut ctl, mode, opts, masker).await
}

/// A token that fired before the start starts nothing: exit code 130 and only the mark.
pub(crate) fn cancelled_before_start(opts: &Opts) -> Option<Captured> {
    let i = opts.interrupt.as_ref()?;
    i.token.is_cancelled().then(|| Captured {
        exit_code: 130,
        output: INTERRUPTED_MARK.trim_start().to_owned(),
        stdout: Vec::new(),
        stderr: String::new(),
        stdout_overflow: false,
    })
}

/// How a running command is stopped: the whole of it at once (past its time limit, or
/// after an interrupt's grace), or asked to stop (an interrupt).
pub(crate) trait Control {
    /// SIGKILL to everything the command runs in.
    fn kill(&mut self);
    /// SIGINT to the command's processes (not to a sandbox around them).
    fn interrupt(&mut self) -> impl std::future::Future<Output = ()> + Send;
}

/// A child started on its own (its own process group; bubblewrap around it or not).
struct ChildControl {
    guard: GroupGuard,
    sandboxed: bool,
}

impl Control for ChildControl {
    fn kill(&mut self) {
        if let Some(pgid) = self.guard.0 {
            kill_group(pgid);
        }
    }

    async fn interrupt(&mut self) {
        if let Some(pgid) = self.guard.0 {
            interrupt_child(pgid, self.sandboxed);
        }
    }
}

/// Runs a started command to its end: reads its two streams into the masked sink while
/// `wait` gives its exit code, and applies the interrupt and the time limit of `opts`.
/// One implementation for a child started on its own and a command run by a step's
/// sandbox launcher ([`crate::session`]).
pub(crate) async fn drive<W, O, E, C>(
    wait: W,
    stdout: Option<O>,
    stderr: Option<E>,
    ctl: &mut C,
    mode: StdoutMode,
    opts: Opts,
    masker: &Masker,
) -> Result<Captured, RunnerError>
where
    W: std::future::Future<Output = Result<i32, RunnerError>>,
    O: AsyncRead + Unpin,
    E: AsyncRead + Unpin,
    C: Control,
{
    let Opts {
        interrupt,
        tap,
        limit,
    } = opts;
    let mut sink = Sink::masked(masker);
    sink.tap = tap;
    let sink = Arc::new(Mutex::new(sink));
    let readers = async {
        tokio::join!(
            read_stream(stdout, sink.clone(), Stream::Stdout(mode)),
            read_stream(stderr, sink.clone(), Stream::Stderr),
        )
    };
    let mut readers = std::pin::pin!(readers);
    let mut wait = std::pin::pin!(wait);
    let mut readers_done = false;
    let never = tokio_util::sync::CancellationToken::new();
    let token = interrupt.as_ref().map_or(&never, |i| &i.token);
    let mut kill_at: Option<tokio::time::Instant> = None;
    let deadline = limit.map(|(_, d)| tokio::time::Instant::now() + d);
    let mut timed_out = false;
    let status = loop {
        tokio::select! {
            _ = &mut readers, if !readers_done => readers_done = true,
            status = &mut wait => break status,
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() && !timed_out => {
                // Past the limit: no grace, the whole group goes (a pid namespace's
                // processes die with its first process).
                timed_out = true;
                ctl.kill();
            }
            _ = token.cancelled(), if kill_at.is_none() => {
                ctl.interrupt().await;
                let grace = interrupt.as_ref().map_or(Duration::ZERO, |i| i.grace);
                kill_at = Some(tokio::time::Instant::now() + grace);
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or_else(tokio::time::Instant::now)), if kill_at.is_some() => {
                ctl.kill();
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
        ctl.kill();
        let _ = tokio::time::timeout(PIPE_GRACE, &mut readers).await;
    }
    if timed_out && let Some((step, limit)) = limit {
        return Err(RunnerError::TimedOut {
            step,
            limit_secs: limit.as_secs(),
        });
    }
    let exit_code = match status {
        Ok(code) => code,
        // We killed it after an interrupt's grace: it ended the way SIGKILL ends things.
        Err(_) if kill_at.is_some() => 128 + 9,
        Err(e) => return Err(e),
    };
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

/// Reads up to and including the next `\n` into `line`, keeping at most `cap` bytes of it
/// (a longer line ends with [`LINE_CUT_MARK`]). Returns the bytes consumed; 0 at the end.
async fn read_line_capped<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<usize> {
    let mut consumed = 0;
    let mut cut = false;
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            break;
        }
        let (chunk, done) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (&buf[..=i], true),
            None => (buf, false),
        };
        let n = chunk.len();
        let room = cap.saturating_sub(line.len());
        if chunk.len() <= room {
            line.extend_from_slice(chunk);
        } else {
            line.extend_from_slice(&chunk[..room]);
            cut = true;
        }
        reader.consume(n);
        consumed += n;
        if done {
            break;
        }
    }
    if cut {
        line.extend_from_slice(LINE_CUT_MARK);
    }
    Ok(consumed)
}

/// Reads a data stdout whole into the sink, up to [`MAX_STDOUT_BYTES`]; past that the rest
/// is drained and dropped and the overflow is flagged (the caller refuses the output).
async fn read_data<R: AsyncRead + Unpin>(reader: &mut BufReader<R>, sink: &Mutex<Sink>) {
    let mut data = Vec::new();
    let mut overflow = false;
    loop {
        let chunk = match reader.fill_buf().await {
            Ok([]) | Err(_) => break,
            Ok(chunk) => chunk,
        };
        let n = chunk.len();
        if data.len() + n > MAX_STDOUT_BYTES {
            overflow = true;
        } else {
            data.extend_from_slice(chunk);
        }
        reader.consume(n);
    }
    let mut sink = sink.lock().unwrap_or_else(|e| e.into_inner());
    sink.stdout = data;
    sink.stdout_overflow |= overflow;
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
    if let Stream::Stdout(StdoutMode::Data) = stream {
        // Machine-readable output is one document (`show -json` prints a single line of
        // tens of MB): kept whole up to its own cap, never cut at the line cap.
        read_data(&mut reader, &sink).await;
        return;
    }
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        match read_line_capped(&mut reader, &mut line, MAX_LINE_BYTES).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut sink = sink.lock().unwrap_or_else(|e| e.into_inner());
        match stream {
            Stream::Stdout(StdoutMode::Data) => unreachable!("read by read_data"),
            Stream::Stdout(StdoutMode::Log) => sink.log_bytes(&line),
            Stream::Stderr => {
                sink.log_bytes(&line);
                sink.stderr_bytes(&line);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn data_stdout_is_kept_whole_past_the_line_cap() {
        // one line, well over the line cap: `show -json` of a big plan
        let doc = format!("{{\"v\":\"{}\"}}\n", "y".repeat(MAX_LINE_BYTES * 3));
        let sink = Arc::new(Mutex::new(Sink::default()));
        read_stream(
            Some(doc.as_bytes()),
            sink.clone(),
            Stream::Stdout(StdoutMode::Data),
        )
        .await;
        let sink = sink.lock().unwrap();
        assert!(!sink.stdout_overflow);
        assert_eq!(sink.stdout, doc.as_bytes());
        let parsed: serde_json::Value = serde_json::from_slice(&sink.stdout).unwrap();
        assert_eq!(parsed["v"].as_str().unwrap().len(), MAX_LINE_BYTES * 3);
    }

    #[tokio::test]
    async fn an_over_long_line_is_cut_and_says_so() {
        let long = [b'x'; 200];
        let input = [&long[..], b"\nshort\n", b"tail-without-newline"].concat();
        let mut reader = tokio::io::BufReader::with_capacity(16, &input[..]);
        let mut line = Vec::new();
        let n = read_line_capped(&mut reader, &mut line, 50).await.unwrap();
        assert_eq!(n, 201, "the whole line is consumed");
        assert!(line.starts_with(&[b'x'; 50]));
        assert!(
            line.ends_with(LINE_CUT_MARK),
            "{}",
            String::from_utf8_lossy(&line)
        );
        assert_eq!(line.len(), 50 + LINE_CUT_MARK.len());
        line.clear();
        read_line_capped(&mut reader, &mut line, 50).await.unwrap();
        assert_eq!(line, b"short\n");
        line.clear();
        read_line_capped(&mut reader, &mut line, 50).await.unwrap();
        assert_eq!(line, b"tail-without-newline");
        line.clear();
        assert_eq!(
            read_line_capped(&mut reader, &mut line, 50).await.unwrap(),
            0
        );
    }

    #[test]
    fn a_capped_log_states_its_cap() {
        let mut sink = Sink::default();
        sink.log(&"y".repeat(MAX_LOG_BYTES - 10));
        sink.log(&"z".repeat(100));
        sink.log("more");
        assert!(sink.output.ends_with(TRUNCATED_MARK));
        assert!(TRUNCATED_MARK.contains("16 MiB"));
        assert!(sink.output.len() <= MAX_LOG_BYTES + TRUNCATED_MARK.len());
    }
}
