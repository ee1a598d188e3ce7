-- A Workspace's history filtered by status or kind, and one Capsule's history, each read
-- newest first from an index in the listing's own order: filtered on the Workspace's one
-- index instead, a rare status read the whole Workspace (30 s at 500,000 Runs).
-- runs_capsule_newest replaces runs_capsule (capsule_id, created_at), which it serves in
-- both directions, so a Run insert writes one index more than before, not two.
CREATE INDEX runs_workspace_status_newest ON runs (workspace_id, status, created_at DESC, id DESC);
CREATE INDEX runs_workspace_kind_newest ON runs (workspace_id, kind, created_at DESC, id DESC);
CREATE INDEX runs_capsule_newest ON runs (capsule_id, created_at DESC, id DESC);
DROP INDEX IF EXISTS runs_capsule;
