-- A state an apply's tool wrote but Takosumi could not store in object storage (after
-- retrying): kept here, sealed exactly as it would have been stored (AES-256-GCM under
-- the server key, bound to `state_version_id`), so the state is never lost. The apply
-- ends `unknown_outcome`; the Capsule's generation does not move and its applies stay
-- refused (`capsule_needs_inspection`) until an operator resolves the Run. `stored_at`
-- is set once the sealed bytes were put in object storage after all.
CREATE TABLE held_states (
    state_version_id uuid PRIMARY KEY,
    run_id           uuid NOT NULL REFERENCES runs(id),
    capsule_id       uuid NOT NULL REFERENCES capsules(id),
    generation       bigint NOT NULL,
    object_key       text NOT NULL,
    digest           text NOT NULL,
    size_bytes       bigint NOT NULL,
    sealed           bytea NOT NULL,
    reason           text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    stored_at        timestamptz
);
CREATE INDEX held_states_capsule ON held_states (capsule_id);
-- The Capsule lock check: a Capsule's unresolved unknown_outcome applies.
CREATE INDEX runs_unresolved_unknown_capsule ON runs (capsule_id)
    WHERE status = 'unknown_outcome' AND resolved_at IS NULL;

-- Claims a handler handed back itself after a transient fault (storage, database or
-- broker away for a moment). `attempts` counts every claim (it keys the claim's private
-- objects, so it never goes back); `attempts - handbacks` counts the claims whose
-- handler vanished, which is what `max_attempts` bounds: an outage must not use up a
-- Run's attempts and fail it.
ALTER TABLE runs ADD COLUMN handbacks integer NOT NULL DEFAULT 0;
