//! The API's memory of Workspaces it has seen exist, so a Workspace-scoped request (a
//! Run history page, a Capsule listing) does not read `workspaces` again on every call.
//!
//! Only existence is kept, and only once Postgres confirmed it: no statement of Takosumi
//! deletes a Workspace row (`takosumi_store::workspaces` has no delete), so a Workspace
//! seen once exists for as long as the process runs. An id Postgres does not know is looked up every time (a guess fills
//! nothing), and the set stops growing at [`MAX_ENTRIES`] (lookups past it are only not
//! saved). Adding a way to delete a Workspace must clear this set in every API process.

use std::collections::HashSet;
use std::sync::RwLock;

use takosumi_core::WorkspaceId;
use takosumi_store::{Pool, StoreError, workspaces};

/// Workspaces remembered past this many are looked up each time instead.
const MAX_ENTRIES: usize = 100_000;

/// Workspace ids Postgres confirmed exist.
#[derive(Debug, Default)]
pub struct KnownWorkspaces {
    seen: RwLock<HashSet<WorkspaceId>>,
}

impl KnownWorkspaces {
    /// Whether Workspace `id` exists: remembered, else read from Postgres (and remembered
    /// when it does).
    pub async fn exists(&self, pool: &Pool, id: WorkspaceId) -> Result<bool, StoreError> {
        if self.seen.read().is_ok_and(|s| s.contains(&id)) {
            return Ok(true);
        }
        let found = workspaces::get(pool, id).await?.is_some();
        if found {
            self.remember(id);
        }
        Ok(found)
    }

    fn remember(&self, id: WorkspaceId) {
        if let Ok(mut s) = self.seen.write()
            && s.len() < MAX_ENTRIES
        {
            s.insert(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_growing_at_the_cap() {
        let known = KnownWorkspaces::default();
        for _ in 0..MAX_ENTRIES + 10 {
            known.remember(WorkspaceId::new());
        }
        assert_eq!(known.seen.read().map(|s| s.len()).ok(), Some(MAX_ENTRIES));
    }
}
