//! A broker connection that is re-established on demand after the broker restarts.

use std::time::Duration;

use tokio::sync::Mutex;

use crate::{Broker, QueueError};

/// How long one connection attempt (TCP, handshake, topology) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// Hands out the current [`Broker`], reconnecting when the last one dropped.
#[derive(Debug)]
pub struct Bus {
    url: String,
    name: String,
    current: Mutex<Option<Broker>>,
}

impl Bus {
    /// A bus for `url`; nothing connects until [`Bus::get`].
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: name.into(),
            current: Mutex::new(None),
        }
    }

    /// The live broker, connecting (and declaring the topology) if needed.
    pub async fn get(&self) -> Result<Broker, QueueError> {
        let mut current = self.current.lock().await;
        if let Some(b) = current.as_ref().filter(|b| b.is_connected()) {
            return Ok(b.clone());
        }
        // A broker that accepts the TCP connection but never finishes the handshake (one
        // still starting) must not hold every caller of the bus forever: give up, and let
        // the caller's backoff try again.
        let broker = tokio::time::timeout(CONNECT_TIMEOUT, Broker::connect(&self.url, &self.name))
            .await
            .map_err(|_| {
                QueueError::Refused(format!(
                    "no connection to the broker within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ))
            })??;
        *current = Some(broker.clone());
        Ok(broker)
    }

    /// Closes the current connection, if any.
    pub async fn close(&self) {
        if let Some(b) = self.current.lock().await.take() {
            b.close().await;
        }
    }
}
