//! A broker connection that is re-established on demand after the broker restarts.
//!
//! Callers never wait long on the bus. A caller that finds a live connection takes it
//! without waiting on anything. When the connection is gone, one caller connects (bounded by
//! the connect timeout, 15 s by default); the others wait for that attempt at most the wait
//! timeout (2 s by default) and then fail with a transient error their backoff retries,
//! instead of queueing behind the connect for its whole length.

use std::time::Duration;

use tokio::sync::Mutex;

use crate::{Broker, QueueError};

/// How long one connection attempt (TCP, handshake, topology) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a caller waits for another caller's connection attempt before giving up.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(2);

/// Hands out the current [`Broker`], reconnecting when the last one dropped.
#[derive(Debug)]
pub struct Bus {
    url: String,
    name: String,
    /// The live connection. Held only to read or replace it, never across an await.
    current: std::sync::Mutex<Option<Broker>>,
    /// Held by the one caller that is connecting.
    connecting: Mutex<()>,
    connect_timeout: Duration,
    wait_timeout: Duration,
}

impl Bus {
    /// A bus for `url`; nothing connects until [`Bus::get`].
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: name.into(),
            current: std::sync::Mutex::new(None),
            connecting: Mutex::new(()),
            connect_timeout: CONNECT_TIMEOUT,
            wait_timeout: WAIT_TIMEOUT,
        }
    }

    /// Sets how long one connection attempt may take and how long other callers wait for
    /// it (defaults [`CONNECT_TIMEOUT`] and [`WAIT_TIMEOUT`]).
    pub fn with_timeouts(mut self, connect: Duration, wait: Duration) -> Self {
        self.connect_timeout = connect;
        self.wait_timeout = wait;
        self
    }

    fn live(&self) -> Option<Broker> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().filter(|b| b.is_connected()).cloned()
    }

    /// The live broker, connecting (and declaring the topology) if needed. Fails with a
    /// transient [`QueueError::Refused`] when the connect does not finish within the
    /// connect timeout, or when another caller's connect is still running after the wait
    /// timeout.
    pub async fn get(&self) -> Result<Broker, QueueError> {
        if let Some(b) = self.live() {
            return Ok(b);
        }
        let Ok(_connecting) = tokio::time::timeout(self.wait_timeout, self.connecting.lock()).await
        else {
            return Err(QueueError::Refused(format!(
                "the broker is reconnecting (still connecting after {} ms); try again",
                self.wait_timeout.as_millis()
            )));
        };
        // Whoever held the lock before may have connected meanwhile.
        if let Some(b) = self.live() {
            return Ok(b);
        }
        // A broker that accepts the TCP connection but never finishes the handshake (one
        // still starting) must not hold the connecting caller forever either: give up, and
        // let the caller's backoff try again.
        let broker =
            tokio::time::timeout(self.connect_timeout, Broker::connect(&self.url, &self.name))
                .await
                .map_err(|_| {
                    QueueError::Refused(format!(
                        "no connection to the broker within {} ms",
                        self.connect_timeout.as_millis()
                    ))
                })??;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(broker.clone());
        Ok(broker)
    }

    /// Closes the current connection, if any.
    pub async fn close(&self) {
        let taken = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(b) = taken {
            b.close().await;
        }
    }
}
