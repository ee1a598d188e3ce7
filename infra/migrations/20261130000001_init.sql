-- Takosumi schema: Postgres is the source of truth; messages only wake handlers.

CREATE TYPE run_kind AS ENUM ('plan', 'destroy', 'apply', 'drift_check');
CREATE TYPE run_status AS ENUM (
    'queued', 'held', 'planning', 'planned', 'applying', 'applied', 'failed', 'canceled', 'unknown_outcome'
);
CREATE TYPE actor_kind AS ENUM ('user', 'agent', 'system');

CREATE TABLE workspaces (
    id          uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Only the SHA-256 of a token is stored; the token itself is shown once.
CREATE TABLE api_tokens (
    id            uuid PRIMARY KEY,
    token_hash    bytea NOT NULL UNIQUE,
    name          text NOT NULL,
    role          text NOT NULL CHECK (role IN ('viewer', 'operator', 'approver', 'admin', 'agent')),
    workspace_id  uuid REFERENCES workspaces(id),
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz
);

CREATE TABLE capsules (
    id                        uuid PRIMARY KEY,
    workspace_id              uuid NOT NULL REFERENCES workspaces(id),
    name                      text NOT NULL,
    repo                      text NOT NULL,
    branch                    text NOT NULL,
    dir                       text NOT NULL,
    tool                      text NOT NULL CHECK (tool IN ('tofu', 'terraform')),
    vars                      jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- bumped by exactly one apply at a time: UPDATE … WHERE state_generation = g
    state_generation          bigint NOT NULL DEFAULT 0,
    current_state_version_id  uuid,
    -- the apply that holds the Capsule; set only where none is set
    running_apply_id          uuid,
    stale                     boolean NOT NULL DEFAULT false,
    stale_commit              text,
    created_at                timestamptz NOT NULL DEFAULT now(),
    updated_at                timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, name)
);

CREATE TABLE runs (
    id                    uuid PRIMARY KEY,
    kind                  run_kind NOT NULL,
    status                run_status NOT NULL DEFAULT 'queued',
    workspace_id          uuid NOT NULL REFERENCES workspaces(id),
    capsule_id            uuid NOT NULL REFERENCES capsules(id),
    run_group_id          uuid,
    plan_run_id           uuid REFERENCES runs(id),
    actor_kind            actor_kind NOT NULL,
    actor_id              text NOT NULL,
    auto_apply_requested  boolean NOT NULL DEFAULT false,
    idempotency_key       text,
    -- pins and results
    source_commit         text,
    tree_digest           text,
    tool_version          jsonb,
    plan_digest           text,
    -- private: object keys never leave the store crate's internal projections
    plan_object_key       text,
    lockfile_object_key   text,
    -- 'unknown' (legacy / not recorded), 'none' (provider-free: explicit null), 'present'
    provider_lock_state   text NOT NULL DEFAULT 'unknown' CHECK (provider_lock_state IN ('unknown', 'none', 'present')),
    provider_lock_digest  text,
    dependency_snapshot   text,
    state_generation      bigint,
    changes               jsonb,
    drift                 boolean,
    outputs               jsonb,
    state_version_id      uuid,
    injected_env_names    text[] NOT NULL DEFAULT '{}',
    hold_reason           text,
    hold_details          jsonb,
    gate_decision         text,
    error_code            text,
    error_message         text,
    canceled_by           text,
    canceled_at           timestamptz,
    -- claims
    lease_owner           text,
    lease_until           timestamptz,
    attempts              integer NOT NULL DEFAULT 0,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    finished_at           timestamptz,
    CHECK ((provider_lock_state = 'present') = (provider_lock_digest IS NOT NULL))
);
CREATE UNIQUE INDEX runs_idempotency ON runs (workspace_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX runs_capsule ON runs (capsule_id, created_at);
CREATE INDEX runs_workspace ON runs (workspace_id, created_at);
CREATE INDEX runs_leases ON runs (lease_until) WHERE status IN ('planning', 'applying');
-- one live Apply Run per plan: a second request for the same plan gets the first
CREATE UNIQUE INDEX runs_one_apply_per_plan ON runs (plan_run_id)
    WHERE kind = 'apply' AND status NOT IN ('failed', 'canceled');

CREATE TABLE state_versions (
    id          uuid PRIMARY KEY,
    capsule_id  uuid NOT NULL REFERENCES capsules(id),
    generation  bigint NOT NULL,
    run_id      uuid NOT NULL REFERENCES runs(id),
    object_key  text NOT NULL,
    digest      text NOT NULL,
    size_bytes  bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (capsule_id, generation),
    UNIQUE (run_id)
);

CREATE TABLE run_events (
    id          bigserial PRIMARY KEY,
    run_id      uuid NOT NULL REFERENCES runs(id),
    kind        text NOT NULL,
    actor       text NOT NULL,
    data        jsonb NOT NULL DEFAULT '{}'::jsonb,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX run_events_run ON run_events (run_id, id);

CREATE TABLE run_logs (
    id          bigserial PRIMARY KEY,
    run_id      uuid NOT NULL REFERENCES runs(id),
    step        text NOT NULL,
    chunk       text NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX run_logs_run ON run_logs (run_id, id);

CREATE TABLE activity (
    id            bigserial PRIMARY KEY,
    workspace_id  uuid NOT NULL REFERENCES workspaces(id),
    kind          text NOT NULL,
    subject       text NOT NULL,
    actor         text NOT NULL,
    data          jsonb NOT NULL DEFAULT '{}'::jsonb,
    at            timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX activity_workspace ON activity (workspace_id, id);

-- Transactional outbox: written in the same transaction as the row change it follows.
CREATE TABLE outbox (
    id            bigserial PRIMARY KEY,
    topic         text NOT NULL,
    payload       jsonb NOT NULL,
    available_at  timestamptz NOT NULL DEFAULT now(),
    created_at    timestamptz NOT NULL DEFAULT now(),
    sent_at       timestamptz,
    publish_attempts integer NOT NULL DEFAULT 0
);
CREATE INDEX outbox_pending ON outbox (available_at, id) WHERE sent_at IS NULL;
