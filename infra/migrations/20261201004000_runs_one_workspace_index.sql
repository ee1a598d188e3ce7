-- runs_workspace_newest (workspace_id, created_at DESC, id DESC) serves every read that
-- runs_workspace (workspace_id, created_at) did (a btree reads both ways), so the older
-- index only cost each Run insert and update a second write (issue 17).
DROP INDEX IF EXISTS runs_workspace;
