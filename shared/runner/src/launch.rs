//! One sandbox per step: the launcher that runs a step's tool commands (`init`, `plan`,
//! `show`, `apply`) one after another inside a single bubblewrap start, and the frames the
//! runner and it exchange.
//!
//! A bubblewrap start (namespaces, mounts, a fresh `/proc`) costs several milliseconds of
//! kernel time, once per command before; a step now pays it once. What a per-command
//! sandbox gave for free the launcher keeps:
//! - each command gets exactly the environment, working directory and arguments the runner
//!   built (nothing of the launcher's own);
//! - each command's stdout and stderr reach the runner as separate streams, as they come;
//! - when a command's first process exits, every other process in the sandbox (a provider,
//!   a `local-exec` leftover, a daemon a hostile configuration forked) is SIGKILLed before
//!   the runner hears the command ended: while the runner reads or seals what a command
//!   left (the lockfile, the saved plan, the state), nothing of the Capsule runs;
//! - the launcher makes itself non-dumpable, so the commands it starts (same uid, same user
//!   namespace) can neither ptrace it nor open its `/proc` entries to act in its place.
//!
//! It runs only as the first process of a fresh pid namespace (it refuses otherwise: it
//! kills every process it can see).
//!
//! Frames, runner → launcher: `R` then the program, the working directory, the arguments
//! and the environment, each a byte string (`u32` big-endian length, bytes) and each list
//! led by its `u32` count; `I` interrupts the running command (SIGINT to every process of
//! the sandbox but the launcher). Launcher → runner: a tag byte, a `u32` length, the
//! payload: `O` stdout bytes, `E` stderr bytes, `F` the command could not start (a
//! message), `X` it ended (its exit code, `i32`, 128 + signal when killed).

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

/// The launcher binary's name (installed beside the step binaries).
pub const LAUNCHER_NAME: &str = "takosumi-launch";

/// The largest frame the runner accepts from a launcher (a launcher sends at most
/// [`CHUNK`] at a time).
pub(crate) const MAX_FRAME: u32 = 1024 * 1024;
/// How much of a command's output one frame carries at most.
const CHUNK: usize = 64 * 1024;

/// Frame tags.
pub(crate) mod tag {
    pub const RUN: u8 = b'R';
    pub const INTERRUPT: u8 = b'I';
    pub const STDOUT: u8 = b'O';
    pub const STDERR: u8 = b'E';
    pub const FAILED: u8 = b'F';
    pub const EXITED: u8 = b'X';
}

/// One command for the launcher to run.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub program: PathBuf,
    pub cwd: PathBuf,
    pub args: Vec<OsString>,
    /// The command's entire environment (it holds secrets: never printed).
    pub env: Vec<(OsString, OsString)>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("program", &self.program)
            .field("cwd", &self.cwd)
            .field("args", &self.args)
            .field("env", &format_args!("<{} entries>", self.env.len()))
            .finish()
    }
}

impl Request {
    /// The `R` frame.
    pub(crate) fn encode(&self) -> Vec<u8> {
        fn bytes(out: &mut Vec<u8>, b: &[u8]) {
            out.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_be_bytes());
            out.extend_from_slice(b);
        }
        let mut out = vec![tag::RUN];
        bytes(&mut out, self.program.as_os_str().as_bytes());
        bytes(&mut out, self.cwd.as_os_str().as_bytes());
        out.extend_from_slice(&(self.args.len() as u32).to_be_bytes());
        for a in &self.args {
            bytes(&mut out, a.as_bytes());
        }
        out.extend_from_slice(&(self.env.len() as u32).to_be_bytes());
        for (k, v) in &self.env {
            bytes(&mut out, k.as_bytes());
            bytes(&mut out, v.as_bytes());
        }
        out
    }

    /// Reads the body of an `R` frame (the tag already read).
    fn decode(input: &mut impl Read) -> io::Result<Self> {
        fn u32_of(input: &mut impl Read) -> io::Result<u32> {
            let mut b = [0u8; 4];
            input.read_exact(&mut b)?;
            Ok(u32::from_be_bytes(b))
        }
        fn bytes(input: &mut impl Read) -> io::Result<OsString> {
            let len = u32_of(input)? as usize;
            let mut b = vec![0u8; len];
            input.read_exact(&mut b)?;
            Ok(OsString::from_vec(b))
        }
        let program = PathBuf::from(bytes(input)?);
        let cwd = PathBuf::from(bytes(input)?);
        let nargs = u32_of(input)?;
        let args = (0..nargs)
            .map(|_| bytes(input))
            .collect::<io::Result<_>>()?;
        let nenv = u32_of(input)?;
        let env = (0..nenv)
            .map(|_| Ok((bytes(input)?, bytes(input)?)))
            .collect::<io::Result<_>>()?;
        Ok(Self {
            program,
            cwd,
            args,
            env,
        })
    }
}

/// The launcher's main: serves `R` frames from stdin until it closes, then ends every
/// process left and exits. Returns the process's exit code.
pub fn serve() -> i32 {
    // Only the first process of a fresh pid namespace (bubblewrap's init is 1, its command
    // 2) may end "every other process it can see".
    if std::process::id() > 2 {
        eprintln!(
            "{LAUNCHER_NAME}: runs only inside the runner's sandbox (a pid namespace of its own)"
        );
        return 2;
    }
    // The commands run as the same uid: without this, one could ptrace the launcher (or
    // open its /proc/<pid>/mem) and act in its place between commands.
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        eprintln!("{LAUNCHER_NAME}: cannot make itself non-dumpable: {e}");
        return 2;
    }
    let out = Arc::new(Mutex::new(io::stdout()));
    let (tx, rx) = std::sync::mpsc::channel::<Request>();
    // stdin is read on its own thread so an interrupt arrives while a command runs.
    std::thread::spawn(move || {
        let mut stdin = io::stdin().lock();
        loop {
            let mut t = [0u8; 1];
            if stdin.read_exact(&mut t).is_err() {
                break;
            }
            match t[0] {
                tag::RUN => match Request::decode(&mut stdin) {
                    Ok(req) => {
                        if tx.send(req).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                },
                tag::INTERRUPT => signal_others(rustix::process::Signal::INT),
                _ => break,
            }
        }
        // The runner is gone (or spoke nonsense): nothing of the sandbox outlives it.
        kill_others();
        std::process::exit(0);
    });
    for req in rx {
        run(req, &out);
    }
    0
}

fn run(req: Request, out: &Arc<Mutex<io::Stdout>>) {
    let spawned = Command::new(&req.program)
        .args(&req.args)
        .env_clear()
        .envs(req.env)
        .current_dir(&req.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let msg = format!("{e}");
            send(out, tag::FAILED, msg.as_bytes());
            return;
        }
    };
    let pumps = [
        child
            .stdout
            .take()
            .map(|s| pump(s, tag::STDOUT, out.clone())),
        child
            .stderr
            .take()
            .map(|s| pump(s, tag::STDERR, out.clone())),
    ];
    let code = match child.wait() {
        Ok(status) => status
            .code()
            .or_else(|| status.signal().map(|s| 128 + s))
            .unwrap_or(-1),
        Err(_) => -1,
    };
    // Whatever the command left (and whatever still holds its pipes) goes before the
    // runner hears it ended.
    kill_others();
    for p in pumps.into_iter().flatten() {
        let _ = p.join();
    }
    send(out, tag::EXITED, &code.to_be_bytes());
}

fn pump(
    mut from: impl Read + Send + 'static,
    t: u8,
    out: Arc<Mutex<io::Stdout>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => send(&out, t, &buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    })
}

fn send(out: &Mutex<io::Stdout>, t: u8, payload: &[u8]) {
    let mut frame = Vec::with_capacity(payload.len() + 5);
    frame.push(t);
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    let mut out = out
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if out.write_all(&frame).and_then(|()| out.flush()).is_err() {
        // The runner stopped reading: it is gone.
        drop(out);
        kill_others();
        std::process::exit(0);
    }
}

/// Every live process of the sandbox but the launcher and the namespace's init (zombies
/// hold nothing and are reaped by their new parent).
fn others() -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| p != me && p != 1)
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|stat| {
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next());
                !matches!(state, Some("Z" | "X") | None)
            })
        })
        .collect()
}

fn signal_others(signal: rustix::process::Signal) {
    for p in others() {
        if let Some(pid) = rustix::process::Pid::from_raw(p) {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }
}

/// SIGKILLs every other process until none is left (one may fork while the first round
/// runs).
fn kill_others() {
    for round in 0..1000 {
        let left = others();
        if left.is_empty() {
            return;
        }
        for p in left {
            if let Some(pid) = rustix::process::Pid::from_raw(p) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        std::thread::sleep(std::time::Duration::from_micros(if round < 10 {
            200
        } else {
            2000
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_survives_its_frame_byte_for_byte() {
        let req = Request {
            program: "/usr/bin/terraform".into(),
            cwd: "/w/r/checkout/net".into(),
            args: vec!["plan".into(), OsString::from_vec(vec![0xff, b'-', 0])],
            env: vec![
                ("TF_VAR_x".into(), "a\nb=c".into()),
                ("E".into(), "".into()),
            ],
        };
        let frame = req.encode();
        assert_eq!(frame[0], tag::RUN);
        let back = Request::decode(&mut &frame[1..]).unwrap();
        assert_eq!(back, req);
        // a cut frame is an error, not a shorter request
        assert!(Request::decode(&mut &frame[1..frame.len() - 1]).is_err());
    }

    #[test]
    fn a_requests_debug_names_no_value() {
        let req = Request {
            program: "/t".into(),
            cwd: "/".into(),
            args: vec![],
            env: vec![("TF_VAR_pw".into(), "canary-9f2c".into())],
        };
        let shown = format!("{req:?}");
        assert!(!shown.contains("canary-9f2c"), "{shown}");
        assert!(!shown.contains("TF_VAR_pw"), "{shown}");
    }

    #[test]
    fn the_launcher_refuses_to_run_outside_a_pid_namespace() {
        // the test process is not pid 1 or 2 of a namespace: it must not kill anything
        assert_eq!(serve(), 2);
    }
}
