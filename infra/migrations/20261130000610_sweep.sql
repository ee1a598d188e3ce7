-- Scheduled, read-only drift sweeps: an interval per Workspace (default for its Capsules)
-- or per Capsule, and when the sweep last enqueued a check for a Capsule. The sweep
-- claims due Capsules with FOR UPDATE SKIP LOCKED and moves last_drift_enqueued_at in the
-- same statement, so several sweepers never enqueue the same Capsule twice.
ALTER TABLE workspaces ADD COLUMN drift_interval_secs integer CHECK (drift_interval_secs >= 60);
ALTER TABLE capsules
    ADD COLUMN drift_interval_secs    integer CHECK (drift_interval_secs >= 60),
    ADD COLUMN last_drift_enqueued_at timestamptz;
CREATE INDEX runs_open_drift_checks ON runs (capsule_id)
    WHERE kind = 'drift_check' AND status IN ('queued', 'held', 'planning');
