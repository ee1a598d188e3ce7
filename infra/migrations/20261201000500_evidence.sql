-- Signed audit evidence (issue 20): one signed statement per ended Run, chained per Workspace.
--
-- A Run ends in many places (every step's commit, cancels, the reaper, relay endpoints), so
-- the one place that notices is this trigger: the transaction that gives a Run its terminal
-- status also queues it in evidence_pending and wakes the writer (NOTIFY is delivered at
-- commit). The API's evidence writer drains the queue per Workspace under a lock on the
-- Workspace's chain head, signs each statement and advances the head in one transaction.

-- Ended Runs whose statement is not written yet, in the order they ended.
CREATE TABLE evidence_pending (
    id            bigserial PRIMARY KEY,
    run_id        uuid NOT NULL UNIQUE REFERENCES runs(id),
    workspace_id  uuid NOT NULL REFERENCES workspaces(id),
    queued_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX evidence_pending_workspace ON evidence_pending (workspace_id, id);

-- The signed statements. `statement` is the canonical JSON exactly as signed; `digest`,
-- `sequence` and `previous_digest` are an index for paging: a verifier reads them from the
-- statement itself.
CREATE TABLE evidence_statements (
    run_id           uuid PRIMARY KEY REFERENCES runs(id),
    workspace_id     uuid NOT NULL REFERENCES workspaces(id),
    sequence         bigint NOT NULL CHECK (sequence > 0),
    digest           text NOT NULL,
    previous_digest  text,
    statement        text NOT NULL,
    key_id           text NOT NULL,
    signature        text NOT NULL,
    signed_at        timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, sequence)
);

-- Each Workspace's chain head: the row the writer locks, so statements are appended one at
-- a time whatever number of API processes run the writer.
CREATE TABLE evidence_heads (
    workspace_id  uuid PRIMARY KEY REFERENCES workspaces(id),
    sequence      bigint NOT NULL DEFAULT 0,
    digest        text
);

CREATE FUNCTION evidence_run_ended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO evidence_pending (run_id, workspace_id) VALUES (NEW.id, NEW.workspace_id)
        ON CONFLICT (run_id) DO NOTHING;
    PERFORM pg_notify('takosumi_evidence', '');
    RETURN NULL;
END
$$;

-- Terminal statuses never change again, so each Run is queued once.
CREATE TRIGGER runs_evidence_on_end AFTER UPDATE OF status ON runs FOR EACH ROW
    WHEN (NEW.status IN ('planned', 'applied', 'failed', 'canceled', 'unknown_outcome')
          AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION evidence_run_ended();
CREATE TRIGGER runs_evidence_on_insert AFTER INSERT ON runs FOR EACH ROW
    WHEN (NEW.status IN ('planned', 'applied', 'failed', 'canceled', 'unknown_outcome'))
    EXECUTE FUNCTION evidence_run_ended();

-- Runs that ended before evidence existed get their statements too, oldest first.
INSERT INTO evidence_pending (run_id, workspace_id)
SELECT id, workspace_id FROM runs
 WHERE status IN ('planned', 'applied', 'failed', 'canceled', 'unknown_outcome')
 ORDER BY COALESCE(finished_at, updated_at), created_at, id;
