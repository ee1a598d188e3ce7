//! A step's sandbox: one bubblewrap start holding the launcher ([`crate::launch`]), which
//! runs the step's tool commands one after another. Kept in the [`crate::Workdir`] it
//! serves; ended (SIGKILL to its process group) when the Workdir closes, when a command
//! is killed (time limit, interrupt grace), or when the launcher stops answering — the
//! next command then starts a new one.

use std::process::Stdio;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::RunnerError;
use crate::launch::{MAX_FRAME, Request, tag};
use crate::process::{self, Captured, Control, GroupGuard, Opts, StdoutMode};
use crate::sandbox::Prepared;
use crate::{Masker, launch};

/// What the launcher's (and bubblewrap's) own stderr keeps, for an error message.
const DIAGNOSTICS_CAP: usize = 4096;

/// A running sandbox with its launcher.
pub(crate) struct Session {
    // Dropped first: SIGKILL to bubblewrap's group, so nothing of the sandbox outlives it.
    guard: GroupGuard,
    _child: Child,
    stdin: ChildStdin,
    frames: BufReader<ChildStdout>,
    diagnostics: Arc<Mutex<String>>,
    /// Killed or out of step with its launcher: never used again.
    broken: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("pgid", &self.guard.0)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Starts bubblewrap around the launcher (`prepared` is the launcher's sandboxed
    /// command, as [`crate::Runner`] builds every child).
    pub(crate) fn start(prepared: Prepared) -> Result<Self, RunnerError> {
        let Prepared { mut cmd, .. } = prepared;
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        let mut child = cmd.spawn().map_err(|source| RunnerError::Spawn {
            program: launch::LAUNCHER_NAME.to_owned(),
            source,
        })?;
        let guard = GroupGuard(child.id());
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(RunnerError::io(
                "starting the step's sandbox",
                std::io::Error::other("no pipes to the launcher"),
            ));
        };
        let diagnostics = Arc::new(Mutex::new(String::new()));
        tokio::spawn(keep_diagnostics(stderr, diagnostics.clone()));
        Ok(Self {
            guard,
            _child: child,
            stdin,
            frames: BufReader::new(stdout),
            diagnostics,
            broken: false,
        })
    }

    /// Whether this session may run another command.
    pub(crate) fn usable(&self) -> bool {
        !self.broken
    }

    /// Runs one command to its end, exactly as [`process::run_tapped`] runs a child of its
    /// own: same streams, masking, interrupt and time limit.
    pub(crate) async fn run(
        &mut self,
        request: &Request,
        program: &str,
        mode: StdoutMode,
        opts: Opts,
        masker: &Masker,
    ) -> Result<Captured, RunnerError> {
        if let Some(done) = process::cancelled_before_start(&opts) {
            return Ok(done);
        }
        let spawn_err = |source| RunnerError::Spawn {
            program: program.to_owned(),
            source,
        };
        // Broken until the command's end is read: a caller that drops this future (a
        // timeout, a canceled run) leaves a command running, and `ender` then ends it all.
        self.broken = true;
        let ender = Ender(self.guard.0);
        if let Err(e) = self.stdin.write_all(&request.encode()).await {
            return Err(spawn_err(self.ended(e)));
        }
        // Duplex ends, not simplex halves: a dropped end is an end of stream, on every
        // path out of `demux`.
        let (out_r, out_w) = tokio::io::duplex(64 * 1024);
        let (err_r, err_w) = tokio::io::duplex(64 * 1024);
        let Self {
            guard,
            stdin,
            frames,
            diagnostics,
            ..
        } = self;
        let wait = demux(frames, out_w, err_w, program, diagnostics);
        let mut ctl = SessionControl {
            guard,
            stdin,
            ended: false,
        };
        let result =
            process::drive(wait, Some(out_r), Some(err_r), &mut ctl, mode, opts, masker).await;
        // A command killed after an interrupt's grace ends `Ok` (its output, exit 137), but
        // its sandbox is gone with it.
        if result.is_ok() && !ctl.ended {
            self.broken = false;
            std::mem::forget(ender);
        }
        // Otherwise out of step with the launcher (or killed): `ender` ends it, and the
        // next command starts anew.
        result
    }

    fn ended(&self, e: std::io::Error) -> std::io::Error {
        ended_error(&self.diagnostics, &e.to_string())
    }
}

fn ended_error(diagnostics: &Mutex<String>, what: &str) -> std::io::Error {
    let said = diagnostics
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .trim()
        .to_owned();
    std::io::Error::other(if said.is_empty() {
        format!("the step's sandbox ended ({what})")
    } else {
        format!("the step's sandbox ended ({what}): {said}")
    })
}

/// SIGKILL to the session's process group when dropped (see [`Session::run`]).
struct Ender(Option<u32>);

impl Drop for Ender {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            process::kill_group(pgid);
        }
    }
}

struct SessionControl<'a> {
    guard: &'a GroupGuard,
    stdin: &'a mut ChildStdin,
    /// The sandbox was killed, or the launcher stopped listening.
    ended: bool,
}

impl Control for SessionControl<'_> {
    fn kill(&mut self) {
        self.ended = true;
        if let Some(pgid) = self.guard.0 {
            process::kill_group(pgid);
        }
    }

    async fn interrupt(&mut self) {
        if self.stdin.write_all(&[tag::INTERRUPT]).await.is_err() {
            // The launcher is gone: nothing inside is left to interrupt.
            self.ended = true;
        }
    }
}

/// Routes the launcher's frames for one command into its two streams until it reports
/// the command's end; the streams close when this returns.
async fn demux<W1, W2>(
    frames: &mut BufReader<ChildStdout>,
    mut out: W1,
    mut err: W2,
    program: &str,
    diagnostics: &Mutex<String>,
) -> Result<i32, RunnerError>
where
    W1: tokio::io::AsyncWrite + Unpin,
    W2: tokio::io::AsyncWrite + Unpin,
{
    let ended =
        |what: &str| RunnerError::io(format!("running {program}"), ended_error(diagnostics, what));
    // A reader that stopped (an over-long output is drained, never refused) does not stop
    // the frames: what no one reads is dropped.
    let (mut out_open, mut err_open) = (true, true);
    loop {
        let t = frames.read_u8().await.map_err(|e| ended(&e.to_string()))?;
        let len = frames.read_u32().await.map_err(|e| ended(&e.to_string()))?;
        if len > MAX_FRAME {
            return Err(ended("a frame over the size limit"));
        }
        let mut payload = vec![0u8; len as usize];
        frames
            .read_exact(&mut payload)
            .await
            .map_err(|e| ended(&e.to_string()))?;
        match t {
            tag::STDOUT if out_open => out_open = out.write_all(&payload).await.is_ok(),
            tag::STDERR if err_open => err_open = err.write_all(&payload).await.is_ok(),
            tag::STDOUT | tag::STDERR => {}
            tag::EXITED => {
                let code: [u8; 4] = payload
                    .as_slice()
                    .try_into()
                    .map_err(|_| ended("a malformed exit frame"))?;
                let _ = out.shutdown().await;
                let _ = err.shutdown().await;
                return Ok(i32::from_be_bytes(code));
            }
            tag::FAILED => {
                return Err(RunnerError::Spawn {
                    program: program.to_owned(),
                    source: std::io::Error::other(String::from_utf8_lossy(&payload).into_owned()),
                });
            }
            _ => return Err(ended("an unknown frame")),
        }
    }
}

async fn keep_diagnostics(mut from: impl AsyncRead + Unpin, into: Arc<Mutex<String>>) {
    let mut buf = [0u8; 1024];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let mut kept = into
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if kept.len() < DIAGNOSTICS_CAP {
            kept.push_str(&String::from_utf8_lossy(&buf[..n]));
            let mut cut = DIAGNOSTICS_CAP.min(kept.len());
            while !kept.is_char_boundary(cut) {
                cut -= 1;
            }
            kept.truncate(cut);
        }
    }
}
