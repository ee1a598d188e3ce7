-- A Run's Workspace is its Capsule's. Two foreign keys checked each column alone (the
-- Capsule exists, the Workspace exists), so nothing in the database refused a Run naming a
-- Capsule of another Workspace. One key on the pair says what is meant, and implies the
-- Workspace's (a Capsule's Workspace exists: `capsules_workspace_id_fkey`).
--
-- It is also one check per Run written instead of two. Postgres checks a foreign key with a
-- query of its own per row (`SELECT … FOR KEY SHARE`), a quarter of a drift sweep's time
-- (BENCHMARKS.md, session 36): every admission, apply and drift check inserts a Run.
--
-- A Capsule never changes Workspace, so the pair's unique constraint costs one index entry
-- per Capsule added and nothing on the updates that keep a Capsule's row on its page.
ALTER TABLE capsules ADD CONSTRAINT capsules_id_workspace_key UNIQUE (id, workspace_id);
ALTER TABLE runs ADD CONSTRAINT runs_capsule_workspace_fkey
    FOREIGN KEY (capsule_id, workspace_id) REFERENCES capsules (id, workspace_id);
ALTER TABLE runs DROP CONSTRAINT runs_capsule_id_fkey, DROP CONSTRAINT runs_workspace_id_fkey;
