-- The complete Run record: cancel requests, the resource-change summary cost estimates
-- are computed from, and the operator's resolution of an unknown_outcome apply.

-- A running step cannot be stopped by the API directly: the API records the request and
-- the handler holding the lease notices it, interrupts the tool and ends the Run
-- `canceled` (copying these into canceled_by / canceled_at).
ALTER TABLE runs
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN cancel_requested_by text;

-- Written by the plan step from `show -json`: address, type, actions and only the few
-- attributes the price catalogue needs (never a value the plan marks sensitive).
ALTER TABLE runs
    ADD COLUMN resource_changes jsonb;

-- An unknown_outcome apply stays unknown_outcome (terminal statuses never change); an
-- operator who inspected the provider side records what they did here.
ALTER TABLE runs
    ADD COLUMN resolution_action text CHECK (resolution_action IN ('mark_resolved')),
    ADD COLUMN resolution_note   text,
    ADD COLUMN resolved_by       text,
    ADD COLUMN resolved_at       timestamptz,
    ADD CONSTRAINT runs_resolution_complete
        CHECK ((resolution_action IS NULL) = (resolved_at IS NULL) AND (resolved_at IS NULL) = (resolved_by IS NULL));

-- Workspace history, newest first with keyset pagination on (created_at, id).
CREATE INDEX runs_workspace_newest ON runs (workspace_id, created_at DESC, id DESC);
-- The unresolved unknown_outcome Runs a Workspace must look at.
CREATE INDEX runs_unresolved_unknown ON runs (workspace_id)
    WHERE status = 'unknown_outcome' AND resolved_at IS NULL;
