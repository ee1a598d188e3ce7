//! The client side of the evidence endpoints: a Run's signed statement, a
//! Workspace's whole chain, the published keys, and an exported bundle of both. What they
//! mean and how they verify is `takosumi_evidence`, re-exported here.

use reqwest::Method;
pub use takosumi_evidence::{
    BUNDLE_FORMAT, Bundle, ChainHead, PublishedKeys, Report, SignedStatement, StatementPage,
    VerifyError, verify_chain,
};

use crate::{Client, ClientError, RunId, WorkspaceId};

impl Client {
    /// `GET /api/v1/runs/{run}/evidence`: the Run's signed statement (409
    /// `evidence_pending` while it is being signed, `run_not_ended` before the Run ends).
    pub async fn run_evidence(&self, run: RunId) -> Result<SignedStatement, ClientError> {
        let path = format!("/api/v1/runs/{run}/evidence");
        self.execute(Method::GET, &path, self.request(Method::GET, &path))
            .await
    }

    /// `GET /api/v1/workspaces/{ws}/evidence`: one page of the chain, oldest first.
    pub async fn workspace_evidence_page(
        &self,
        ws: WorkspaceId,
        cursor: Option<&str>,
    ) -> Result<StatementPage, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/evidence");
        let mut rb = self.request(Method::GET, &path);
        if let Some(c) = cursor {
            rb = rb.query(&[("cursor", c)]);
        }
        self.execute(Method::GET, &path, rb).await
    }

    /// The Workspace's whole chain, every page, and its head as the server recorded it.
    pub async fn workspace_evidence(
        &self,
        ws: WorkspaceId,
    ) -> Result<(Vec<SignedStatement>, Option<ChainHead>), ClientError> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let page = self.workspace_evidence_page(ws, cursor.as_deref()).await?;
            all.extend(page.statements);
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                None => return Ok((all, page.head)),
            }
        }
    }

    /// `GET /api/v1/evidence/keys`: every public key the server signs or signed with.
    pub async fn evidence_keys(&self) -> Result<PublishedKeys, ClientError> {
        let path = "/api/v1/evidence/keys";
        self.execute(Method::GET, path, self.request(Method::GET, path))
            .await
    }

    /// The Workspace's chain and the published keys as one bundle, for offline
    /// verification.
    pub async fn export_evidence(&self, ws: WorkspaceId) -> Result<Bundle, ClientError> {
        let (statements, head) = self.workspace_evidence(ws).await?;
        let keys = self.evidence_keys().await?;
        Ok(Bundle {
            format: BUNDLE_FORMAT.to_owned(),
            workspace_id: ws.to_string(),
            keys: keys.keys,
            statements: statements.into_iter().map(|s| s.envelope).collect(),
            head,
        })
    }
}
