//! Logs stored as the run goes: a step's runner hands the tool's masked output to a
//! [`LiveLog`] as it arrives (see [`takosumi_runner::LogTap`]), and a writer task appends
//! it to the run's log in batches — at most every [`FLUSH_INTERVAL`] or every
//! [`FLUSH_BYTES`] — so `GET /runs/{id}/logs` shows a long plan or apply while it works
//! without one database write per line.
//!
//! When the step ends, [`Ctx::log`] stores what was not handed over live (the rest of a
//! plan, once the plan's own sensitive values are in the masker) and waits until the
//! writer has written everything before it, so the log is complete, in order, before the
//! step commits its result.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use takosumi_core::RunId;
use takosumi_runner::LogTap;
use tokio::sync::{mpsc, oneshot};

use crate::Ctx;

/// The longest a live chunk waits before it is written.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// Buffered bytes that are written at once, whatever the time.
pub const FLUSH_BYTES: usize = 64 * 1024;

enum Msg {
    Chunk(String, String),
    Flush(oneshot::Sender<()>),
}

/// One run's live log: the tap its runner feeds and the queue of its writer task.
pub struct LiveLog {
    run_id: RunId,
    tx: mpsc::UnboundedSender<Msg>,
    /// Bytes of each step's current output handed over live.
    streamed: Mutex<HashMap<String, usize>>,
}

impl std::fmt::Debug for LiveLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveLog")
            .field("run_id", &self.run_id)
            .finish_non_exhaustive()
    }
}

impl LogTap for LiveLog {
    fn start(&self, step: &str) {
        self.streamed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(step.to_owned(), 0);
    }

    fn chunk(&self, step: &str, text: &str) {
        *self
            .streamed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(step.to_owned())
            .or_default() += text.len();
        let _ = self.tx.send(Msg::Chunk(step.to_owned(), text.to_owned()));
    }
}

impl LiveLog {
    /// A live log for `run_id` whose writer task appends to `pool` until the log is
    /// dropped (it writes what it holds first).
    fn spawn(pool: takosumi_store::Pool, run_id: RunId) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(writer(pool, run_id, rx));
        Arc::new(Self {
            run_id,
            tx,
            streamed: Mutex::new(HashMap::new()),
        })
    }

    /// How much of `step`'s current output went live; forgets it.
    fn take_streamed(&self, step: &str) -> usize {
        self.streamed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(step)
            .unwrap_or(0)
    }

    /// Queues `rest` (already masked) after everything handed over so far and waits until
    /// all of it is written.
    async fn finish(&self, step: &str, rest: String) {
        if !rest.is_empty() {
            let _ = self.tx.send(Msg::Chunk(step.to_owned(), rest));
        }
        let (done, wait) = oneshot::channel();
        if self.tx.send(Msg::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

/// Appends buffered chunks, one row per run of the same step.
async fn write(pool: &takosumi_store::Pool, run_id: RunId, rows: &mut Vec<(String, String)>) {
    // Progress: committed without waiting for the disk ([`takosumi_store::progress`]).
    if let Err(e) = takosumi_store::logs::append_progress(pool, run_id, rows).await {
        tracing::warn!(%run_id, rows = rows.len(), error = %e, "could not store live log");
    }
    rows.clear();
}

async fn writer(pool: takosumi_store::Pool, run_id: RunId, mut rx: mpsc::UnboundedReceiver<Msg>) {
    let mut rows: Vec<(String, String)> = Vec::new();
    let mut bytes = 0usize;
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let msg = tokio::select! {
            msg = rx.recv() => msg,
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => {
                write(&pool, run_id, &mut rows).await;
                (bytes, deadline) = (0, None);
                continue;
            }
        };
        let (step, text) = match msg {
            None => {
                write(&pool, run_id, &mut rows).await;
                return;
            }
            Some(Msg::Flush(done)) => {
                write(&pool, run_id, &mut rows).await;
                (bytes, deadline) = (0, None);
                let _ = done.send(());
                continue;
            }
            Some(Msg::Chunk(step, text)) => (step, text),
        };
        bytes += text.len();
        match rows.last_mut() {
            Some((last, chunk)) if *last == step => chunk.push_str(&text),
            _ => rows.push((step, text)),
        }
        deadline.get_or_insert_with(|| tokio::time::Instant::now() + FLUSH_INTERVAL);
        if bytes >= FLUSH_BYTES {
            write(&pool, run_id, &mut rows).await;
            (bytes, deadline) = (0, None);
        }
    }
}

impl Ctx {
    /// This context for one run's step, with its tool output stored as it arrives (see
    /// the module docs). [`Ctx::log`] then stores only what did not go live.
    pub fn streaming_logs(&self, run_id: RunId) -> Ctx {
        let live = LiveLog::spawn(self.pool.clone(), run_id);
        let mut ctx = self.clone();
        ctx.runner = self.runner.with_log_tap(live.clone());
        ctx.live_log = Some(live);
        ctx
    }

    /// The part of `step`'s output `text` that did not go live, masked with `masker`,
    /// stored after what did; returns once everything is written. `false` when this
    /// context does not stream `run_id`'s logs.
    pub(crate) async fn finish_live_log(
        &self,
        run_id: RunId,
        step: &str,
        masker: &takosumi_runner::Masker,
        text: &str,
    ) -> bool {
        let Some(live) = self.live_log.as_ref().filter(|l| l.run_id == run_id) else {
            return false;
        };
        let done = live.take_streamed(step);
        // What went live is an exact prefix of the output; anything else stores it all.
        let rest = text.get(done..).unwrap_or(text);
        live.finish(step, masker.mask(rest)).await;
        true
    }
}
