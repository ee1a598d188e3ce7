//! The client side of what a reviewer reads: a plan's diff, a Run's approvals, and the
//! Run's live stream (Server-Sent Events, `GET /runs/{run}/stream`), which `takosumi
//! watch` follows and the dashboard's pages follow too.

use std::time::Duration;

use reqwest::Method;

use crate::{ApprovalsView, Client, ClientError, PlanView, RunId, RunStatus, StreamEvent};

/// Consecutive failed (re)connections a watch rides out.
const RECONNECTS: u32 = 5;

impl Client {
    /// `GET /api/v1/runs/{run}/plan`: the plan's diff, resource by resource, masked.
    pub async fn plan_view(&self, run: RunId) -> Result<PlanView, ClientError> {
        let path = format!("/api/v1/runs/{run}/plan");
        self.execute(Method::GET, &path, self.request(Method::GET, &path))
            .await
    }

    /// `GET /api/v1/runs/{run}/approvals`: what the hold needs and who approved.
    pub async fn approvals(&self, run: RunId) -> Result<ApprovalsView, ClientError> {
        let path = format!("/api/v1/runs/{run}/approvals");
        self.execute(Method::GET, &path, self.request(Method::GET, &path))
            .await
    }

    /// Follows the Run's stream, calling `on` for every event, until the Run settles;
    /// returns that status. A dropped connection is resumed where it was
    /// (`Last-Event-ID`), so nothing is shown twice.
    pub async fn watch(
        &self,
        run: RunId,
        mut on: impl FnMut(&StreamEvent),
    ) -> Result<RunStatus, ClientError> {
        let path = format!("/api/v1/runs/{run}/stream");
        let mut last_id: Option<String> = None;
        let mut failures = 0u32;
        let mut last_status = RunStatus::Queued;
        loop {
            let mut rb = self
                .request(Method::GET, &path)
                .header(reqwest::header::ACCEPT, "text/event-stream")
                // A stream lasts as long as the Run: the client's request timeout is for
                // ordinary calls.
                .timeout(Duration::from_secs(3600));
            if let Some(id) = &last_id {
                rb = rb.header("last-event-id", id);
            }
            let http_err = |source| ClientError::Http {
                url: self.base_url().to_owned(),
                source,
            };
            let mut resp = match rb.send().await {
                Ok(r) => r,
                Err(_) if failures + 1 < RECONNECTS => {
                    failures += 1;
                    pause(failures).await;
                    continue;
                }
                Err(e) => return Err(http_err(e)),
            };
            if !resp.status().is_success() {
                let status = resp.status();
                let body = resp.bytes().await.map_err(http_err)?;
                return Err(ClientError::from_error_body(status, &body));
            }
            let mut parser = SseParser::default();
            loop {
                let chunk = match resp.chunk().await {
                    Ok(Some(c)) => c,
                    Ok(None) => break,
                    Err(_) => break,
                };
                failures = 0;
                for (id, data) in parser.feed(&String::from_utf8_lossy(&chunk)) {
                    if id.is_some() {
                        last_id = id;
                    }
                    let Ok(event) = serde_json::from_str::<StreamEvent>(&data) else {
                        continue;
                    };
                    on(&event);
                    match event {
                        StreamEvent::End { status } => return Ok(status),
                        StreamEvent::Status { status } => last_status = status,
                        _ => {}
                    }
                }
            }
            // The server ends a long stream, or the connection dropped: resume.
            failures += 1;
            if failures >= RECONNECTS {
                return Err(ClientError::Timeout { run, last_status });
            }
            pause(failures).await;
        }
    }
}

async fn pause(attempt: u32) {
    tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
}

/// Reads `text/event-stream`: `id:` and `data:` fields, an event per blank line.
#[derive(Default)]
struct SseParser {
    line: String,
    id: Option<String>,
    data: Vec<String>,
}

impl SseParser {
    fn feed(&mut self, text: &str) -> Vec<(Option<String>, String)> {
        let mut out = Vec::new();
        for c in text.chars() {
            if c != '\n' {
                self.line.push(c);
                continue;
            }
            let line = std::mem::take(&mut self.line);
            let line = line.strip_suffix('\r').unwrap_or(&line);
            if line.is_empty() {
                if !self.data.is_empty() {
                    out.push((self.id.take(), self.data.join("\n")));
                    self.data.clear();
                }
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "data" => self.data.push(value.to_owned()),
                "id" => self.id = Some(value.to_owned()),
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_read_across_chunk_boundaries() {
        let mut p = SseParser::default();
        assert!(p.feed("event: log\nid: 3.4\ndata: {\"type\":").is_empty());
        let got = p.feed("\"log\"}\n\n: keep-alive\n\ndata: x\r\n\r\n");
        assert_eq!(
            got,
            vec![
                (Some("3.4".to_owned()), "{\"type\":\"log\"}".to_owned()),
                (None, "x".to_owned())
            ]
        );
    }
}
