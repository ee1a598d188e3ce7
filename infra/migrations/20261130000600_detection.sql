-- Detection: Git webhooks mark Capsules stale (and, with automatic update, start a plan
-- that may continue to apply only when clean), RunGroups collect Runs started together,
-- pull-request plans are speculative and never applicable.

CREATE TABLE run_groups (
    id            uuid PRIMARY KEY,
    workspace_id  uuid NOT NULL REFERENCES workspaces(id),
    kind          text NOT NULL CHECK (kind IN ('plan_update', 'drift_check')),
    created_by    text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);

-- The HMAC secret GitHub (X-Hub-Signature-256) or GitLab (X-Gitlab-Token) push events of
-- this Workspace are verified with, sealed with the server key.
ALTER TABLE workspaces ADD COLUMN webhook_secret_sealed bytea;

ALTER TABLE capsules
    ADD COLUMN auto_update     boolean NOT NULL DEFAULT false,
    -- the user on whose behalf automatic updates run
    ADD COLUMN auto_update_by  text;

ALTER TABLE runs
    -- a pull request's plan: a dry run of the PR head, never applicable
    ADD COLUMN speculative     boolean NOT NULL DEFAULT false,
    -- the ref and commit a webhook-started plan must check out (NULL: the Capsule's branch head)
    ADD COLUMN source_ref      text,
    ADD COLUMN pinned_commit   text;
