//! A broker connection that is re-established on demand after the broker restarts.

use tokio::sync::Mutex;

use crate::{Broker, QueueError};

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
        let broker = Broker::connect(&self.url, &self.name).await?;
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
