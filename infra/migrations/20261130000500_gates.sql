-- Gate rules (versioned per Workspace and per Capsule) and approvals bound to a plan digest.

CREATE TABLE rule_sets (
    id            bigserial PRIMARY KEY,
    workspace_id  uuid NOT NULL REFERENCES workspaces(id),
    -- NULL: the Workspace's rules; set: the Capsule's (they override field by field)
    capsule_id    uuid REFERENCES capsules(id),
    version       integer NOT NULL,
    rules         jsonb NOT NULL,
    created_by    text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX rule_sets_version ON rule_sets (workspace_id, COALESCE(capsule_id, '00000000-0000-0000-0000-000000000000'::uuid), version);

CREATE TABLE approvals (
    id            bigserial PRIMARY KEY,
    run_id        uuid NOT NULL REFERENCES runs(id),
    -- the digest of the saved plan the approver was shown; an approval never moves to another plan
    plan_digest   text,
    approver_id   text NOT NULL,
    approver_role text NOT NULL,
    note          text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (run_id, approver_id)
);

ALTER TABLE runs
    ADD COLUMN require_approval     boolean NOT NULL DEFAULT false,
    ADD COLUMN approvals_required   integer NOT NULL DEFAULT 0,
    ADD COLUMN approver_roles       text[] NOT NULL DEFAULT '{}',
    -- private: the sealed `show -json` of the saved plan, read by the gate
    ADD COLUMN plan_json_object_key text;
