//! Listings: the Workspaces this token can see and a Workspace's Capsules.

use reqwest::Method;
use serde::Deserialize;

use crate::{Capsule, Client, ClientError, Workspace, WorkspaceId};

#[derive(Deserialize)]
struct WorkspacesBody {
    #[serde(default)]
    workspaces: Vec<Workspace>,
}

#[derive(Deserialize)]
struct CapsulesBody {
    #[serde(default)]
    capsules: Vec<Capsule>,
}

impl Client {
    /// `GET /api/v1/workspaces`: every Workspace the token can see, oldest first.
    pub async fn list_workspaces(&self) -> Result<Vec<Workspace>, ClientError> {
        let path = "/api/v1/workspaces";
        let body: WorkspacesBody = self
            .execute(Method::GET, path, self.request(Method::GET, path))
            .await?;
        Ok(body.workspaces)
    }

    /// `GET /api/v1/workspaces/{ws}/capsules`: the Workspace's Capsules, oldest first.
    pub async fn list_capsules(&self, ws: WorkspaceId) -> Result<Vec<Capsule>, ClientError> {
        let path = format!("/api/v1/workspaces/{ws}/capsules");
        let body: CapsulesBody = self
            .execute(Method::GET, &path, self.request(Method::GET, &path))
            .await?;
        Ok(body.capsules)
    }
}
