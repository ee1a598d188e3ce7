//! The client side of the Run record endpoints: cancel a Run, its cost estimate, resolve
//! an `unknown_outcome` apply, a Workspace's Run history and activity (newest first, one
//! page at a time: pass `next_cursor` back unchanged for the next page).

use reqwest::Method;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use takosumi_cost::CostEstimate;

use crate::{
    ActivityPage, CapsuleId, Client, ClientError, Run, RunId, RunKind, RunPage, RunStatus,
    WorkspaceId,
};

/// Filters and paging of [`Client::list_runs`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunQuery {
    /// Only this Capsule's Runs.
    pub capsule: Option<CapsuleId>,
    /// Only this kind.
    pub kind: Option<RunKind>,
    /// Only this status (`Some(RunStatus::UnknownOutcome)` lists what needs a person).
    pub status: Option<RunStatus>,
    /// Page size (1–100; the API's default is 20).
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// A plan's cost estimate (`GET /runs/{run}/cost`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cost {
    /// The Run asked about.
    pub run_id: RunId,
    /// The plan that was estimated (the Run itself, or the plan an Apply Run carries out).
    pub plan_run_id: RunId,
    /// Amounts per resource and in total, and the unpriced resources.
    #[serde(flatten)]
    pub estimate: CostEstimate,
}

impl Client {
    /// `POST /api/v1/runs/{run}/cancel`: a queued or held Run comes back `canceled`; a
    /// running one comes back still running with the request recorded (its handler ends
    /// it `canceled` when the tool stops: [`Client::wait`] for it). A finished Run is
    /// [`ClientError::Api`] with code `run_finished`.
    pub async fn cancel(&self, run: RunId, reason: Option<&str>) -> Result<Run, ClientError> {
        let path = format!("/api/v1/runs/{run}/cancel");
        let mut body = Map::new();
        if let Some(reason) = reason {
            body.insert("reason".into(), Value::String(reason.to_owned()));
        }
        let rb = self.request(Method::POST, &path).json(&body);
        self.execute(Method::POST, &path, rb).await
    }

    /// `GET /api/v1/runs/{run}/cost`: the cost estimate of a planned Run (or of the plan
    /// an Apply Run carries out).
    pub async fn cost(&self, run: RunId) -> Result<Cost, ClientError> {
        let path = format!("/api/v1/runs/{run}/cost");
        self.execute(Method::GET, &path, self.request(Method::GET, &path))
            .await
    }

    /// `POST /api/v1/runs/{run}/resolve` with `mark_resolved`: records that an operator
    /// inspected an `unknown_outcome` apply (admin tokens only).
    pub async fn resolve(&self, run: RunId, note: &str) -> Result<Run, ClientError> {
        let path = format!("/api/v1/runs/{run}/resolve");
        let body = serde_json::json!({ "action": "mark_resolved", "note": note });
        let rb = self.request(Method::POST, &path).json(&body);
        self.execute(Method::POST, &path, rb).await
    }

    /// `POST /api/v1/runs/{run}/resolve` with `restore_held_state`: the state the apply's
    /// tool wrote, kept sealed in the database because object storage would not take it,
    /// becomes the Capsule's next StateVersion (admin tokens only). Codes: `no_held_state`,
    /// `state_generation_changed`, `already_resolved`.
    pub async fn restore_held_state(&self, run: RunId, note: &str) -> Result<Run, ClientError> {
        let path = format!("/api/v1/runs/{run}/resolve");
        let body = serde_json::json!({ "action": "restore_held_state", "note": note });
        let rb = self.request(Method::POST, &path).json(&body);
        self.execute(Method::POST, &path, rb).await
    }

    /// `POST /api/v1/runs/{run}/resolve` with `attach_state`: `state` (the bytes of a
    /// Terraform state file, format version 4, pulled from the provider side) becomes the
    /// Capsule's next StateVersion (admin tokens only). The bytes are sent as they are;
    /// bytes that are not JSON are refused here, without a request and without quoting
    /// them. Codes: `invalid_state`, `state_lineage_mismatch`, `state_serial_older`,
    /// `state_too_large`, `state_generation_changed`, `already_resolved`.
    pub async fn attach_state(
        &self,
        run: RunId,
        note: &str,
        state: &[u8],
    ) -> Result<Run, ClientError> {
        let Ok(text) = std::str::from_utf8(state) else {
            return Err(ClientError::Config(
                "the state is not a JSON document (it is not UTF-8 text)".into(),
            ));
        };
        if serde_json::from_str::<serde::de::IgnoredAny>(text).is_err() {
            return Err(ClientError::Config(
                "the state is not a JSON document; give the file `terraform state pull` wrote"
                    .into(),
            ));
        }
        let note = serde_json::to_string(note)
            .map_err(|_| ClientError::Config("the note cannot be sent as JSON".into()))?;
        let body = format!(r#"{{"action":"attach_state","note":{note},"state":{text}}}"#);
        let path = format!("/api/v1/runs/{run}/resolve");
        let rb = self
            .request(Method::POST, &path)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
        self.execute(Method::POST, &path, rb).await
    }

    /// `GET /api/v1/workspaces/{ws}/runs`: one page of the Workspace's Runs, newest first.
    pub async fn list_runs(&self, ws: WorkspaceId, q: &RunQuery) -> Result<RunPage, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/runs");
        let mut params: Vec<(&str, String)> = Vec::new();
        if let Some(c) = q.capsule {
            params.push(("capsule", c.to_string()));
        }
        if let Some(k) = q.kind {
            params.push(("kind", enum_text(&k)));
        }
        if let Some(s) = q.status {
            params.push(("status", s.as_str().to_owned()));
        }
        if let Some(l) = q.limit {
            params.push(("limit", l.to_string()));
        }
        if let Some(c) = &q.cursor {
            params.push(("cursor", c.clone()));
        }
        let rb = self.request(Method::GET, &path).query(&params);
        self.execute(Method::GET, &path, rb).await
    }

    /// `GET /api/v1/workspaces/{ws}/activity`: one page of the Workspace's activity,
    /// newest first, optionally of one `kind`.
    pub async fn activity(
        &self,
        ws: WorkspaceId,
        kind: Option<&str>,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<ActivityPage, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/activity");
        let mut params: Vec<(&str, String)> = Vec::new();
        if let Some(k) = kind {
            params.push(("kind", k.to_owned()));
        }
        if let Some(l) = limit {
            params.push(("limit", l.to_string()));
        }
        if let Some(c) = cursor {
            params.push(("cursor", c.to_owned()));
        }
        let rb = self.request(Method::GET, &path).query(&params);
        self.execute(Method::GET, &path, rb).await
    }
}

/// A unit enum's serde name (`drift_check`).
fn enum_text<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn pages_and_costs_decode() {
        let run = RunId::new();
        let page: RunPage = serde_json::from_value(json!({
            "workspaceId": WorkspaceId::new(),
            "runs": [{"id": run, "kind": "plan", "status": "canceled",
                      "workspaceId": WorkspaceId::new(), "capsuleId": CapsuleId::new(),
                      "cancelRequestedAt": null}],
            "nextCursor": "abcd", "unknownOutcomeCount": 2
        }))
        .unwrap();
        assert_eq!(page.runs[0].id, run);
        assert_eq!(page.next_cursor.as_deref(), Some("abcd"));
        assert_eq!(page.unknown_outcome_count, 2);

        let cost: Cost = serde_json::from_value(json!({
            "runId": run, "planRunId": run, "currency": "USD", "period": "month",
            "catalogueAsOf": "2026-11", "catalogueNote": "n",
            "resources": [{"address": "null_resource.a", "type": "null_resource", "actions": ["create"],
                           "current": 0.0, "proposed": 0.0, "delta": 0.0}],
            "unpriced": [{"address": "x.y", "type": "x", "actions": ["create"], "reason": "no price"}],
            "total": {"current": 0.0, "proposed": 0.0, "delta": 0.0},
            "complete": false, "truncated": false
        }))
        .unwrap();
        assert_eq!(cost.estimate.resources[0].address, "null_resource.a");
        assert_eq!(cost.estimate.unpriced[0].reason, "no price");
        assert_eq!(enum_text(&RunKind::DriftCheck), "drift_check");
    }
}
