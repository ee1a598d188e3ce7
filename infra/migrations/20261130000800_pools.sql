-- Worker pools (issue 8): a named set of relay workers that run a Capsule's plans, drift
-- checks and applies near the team's clouds, talking to the control plane only over the
-- API with the pool's token. Only the SHA-256 of the pool token is stored.
CREATE TABLE worker_pools (
    id                      uuid PRIMARY KEY,
    -- globally unique: it names the pool's queues (run.plan.<name>, …)
    name                    text NOT NULL UNIQUE,
    workspace_id            uuid NOT NULL REFERENCES workspaces(id),
    token_hash              bytea NOT NULL UNIQUE,
    -- X25519 public key (32 bytes) plan files and secret inputs are sealed to; NULL: the
    -- pool cannot receive a plan file, so it cannot run a gated apply
    delivery_key_id         text,
    delivery_public_key     bytea CHECK (delivery_public_key IS NULL OR length(delivery_public_key) = 32),
    -- the key before the last rotation, still delivered to until previous_key_until
    previous_key_id         text,
    previous_public_key     bytea CHECK (previous_public_key IS NULL OR length(previous_public_key) = 32),
    previous_key_until      timestamptz,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now()
);

-- NULL: the control node's own queues execute the Capsule (as before pools existed).
ALTER TABLE capsules ADD COLUMN pool_id uuid REFERENCES worker_pools(id);
