//! Client calls for gates and detection: approvals (bound to the plan digest the approver
//! reviewed), rules, drift checks and RunGroups.

use reqwest::Method;
use serde_json::{Value, json};
use takosumi_core::{CapsuleId, RunGroupId, RunId, WorkspaceId};

use crate::{
    ApplySubmitted, Approved, Client, ClientError, GroupResults, GroupStarted, RulesAnswer, Run,
    RunGroup,
};

/// What a RunGroup is asked to do to its Runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupAction {
    /// Approve every held Run (each bound to its own plan digest).
    Approve,
    /// Propose an apply of every planned Run (each pinned to its own plan).
    Apply,
}

impl GroupAction {
    fn path(self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Apply => "apply",
        }
    }
}

impl Client {
    /// `POST /api/v1/runs/{run}/approve`: one person's approval of a held Run. With
    /// `plan_digest`, the API refuses it unless it is the digest of the Run's plan.
    pub async fn approve(
        &self,
        run: RunId,
        plan_digest: Option<&str>,
        note: Option<&str>,
    ) -> Result<Approved, ClientError> {
        let path = format!("/api/v1/runs/{run}/approve");
        let body = json!({ "planDigest": plan_digest, "note": note });
        let body: Value = Value::Object(
            body.as_object()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter(|(_, v)| !v.is_null())
                .collect(),
        );
        let rb = self.request(Method::POST, &path).json(&body);
        self.execute(Method::POST, &path, rb).await
    }

    /// `POST /api/v1/capsules/{cap}/apply`: apply the Capsule's branch as it is. When no
    /// rule covers the apply this is one Apply Run that runs `apply -auto-approve`, nothing
    /// saved in between (`applyMode: "one_step"`); when one does (or `require_approval`), it
    /// is a plan Run (`applyMode: "proposes_apply"`) whose Apply Run the gate proposes, pinned
    /// to its saved plan, once it is planned.
    pub async fn apply_capsule(
        &self,
        cap: CapsuleId,
        require_approval: bool,
        idempotency_key: Option<&str>,
    ) -> Result<ApplySubmitted, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/apply");
        let rb = self
            .submission(Method::POST, &path, idempotency_key)?
            .json(&json!({ "requireApproval": require_approval }));
        self.execute(Method::POST, &path, rb).await
    }

    /// `PUT /api/v1/workspaces/{ws}/rules`: a new version of the Workspace's rules.
    pub async fn set_workspace_rules(
        &self,
        ws: WorkspaceId,
        rules: &Value,
    ) -> Result<RulesAnswer, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/rules");
        let rb = self.request(Method::PUT, &path).json(rules);
        self.execute(Method::PUT, &path, rb).await
    }

    /// `PUT /api/v1/capsules/{cap}/rules`: a new version of the Capsule's rules.
    pub async fn set_capsule_rules(
        &self,
        cap: CapsuleId,
        rules: &Value,
    ) -> Result<RulesAnswer, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/rules");
        let rb = self.request(Method::PUT, &path).json(rules);
        self.execute(Method::PUT, &path, rb).await
    }

    /// `POST /api/v1/capsules/{cap}/drift-check`: a drift-check Run.
    pub async fn drift_check(&self, cap: CapsuleId) -> Result<Run, ClientError> {
        let path = format!("/api/v1/capsules/{cap}/drift-check");
        let rb = self.request(Method::POST, &path).json(&json!({}));
        self.execute(Method::POST, &path, rb).await
    }

    /// `POST /api/v1/workspaces/{ws}/drift-check` or `/plan-update`: a RunGroup.
    pub async fn start_group(
        &self,
        ws: WorkspaceId,
        drift: bool,
        only_stale: bool,
    ) -> Result<GroupStarted, ClientError> {
        let (path, body) = if drift {
            (format!("/api/v1/workspaces/{ws}/drift-check"), json!({}))
        } else {
            (
                format!("/api/v1/workspaces/{ws}/plan-update"),
                json!({ "onlyStale": only_stale }),
            )
        };
        let rb = self.request(Method::POST, &path).json(&body);
        self.execute(Method::POST, &path, rb).await
    }

    /// `GET /api/v1/run-groups/{rg}`: the group and where each of its Runs is.
    pub async fn group(&self, rg: RunGroupId) -> Result<RunGroup, ClientError> {
        let path = format!("/api/v1/run-groups/{rg}");
        self.execute(Method::GET, &path, self.request(Method::GET, &path))
            .await
    }

    /// `POST /api/v1/run-groups/{rg}/approve` or `…/apply`: what it did to each Run.
    pub async fn group_action(
        &self,
        rg: RunGroupId,
        action: GroupAction,
    ) -> Result<GroupResults, ClientError> {
        let path = format!("/api/v1/run-groups/{rg}/{}", action.path());
        let rb = self.request(Method::POST, &path).json(&json!({}));
        self.execute(Method::POST, &path, rb).await
    }
}
