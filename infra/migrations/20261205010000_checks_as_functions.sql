-- The CHECKs on the two tables every step writes (runs, run_events) call a function instead
-- of holding their expression. Postgres turns each CHECK's stored expression text back into
-- a tree on every INSERT and UPDATE statement (the text is not cached; session 19's profile of
-- an admission, BENCHMARKS.md), and a list of names is long text: run_events_kind_check was
-- 5.7 KB, the seven on runs 7.7 KB, some 25 and 50 µs of every event and every Run write. A
-- call is a few hundred bytes, and PL/pgSQL keeps a function's compiled body and its
-- expression's plan for the session. Same rules, same constraint names; the rows already
-- there pass them. The store's unit test `every_text_column_check_lists_its_closed_set`
-- reads a closed set's list from the function a CHECK calls, so a name added to an enum in
-- Rust needs a migration that replaces that function (`CREATE OR REPLACE FUNCTION`).

CREATE FUNCTION run_event_kind_valid(kind text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN kind IN ('queued', 'claimed', 'requeued', 'checkout_started', 'environment_prepared',
                    'checked_out', 'tool_started', 'dry_run_scan', 'pin_checked', 'planned',
                    'gate_decision', 'held', 'approved', 'released', 'state_version_written',
                    'state_store_retrying', 'applied', 'failed', 'cancel_requested', 'canceled',
                    'unknown_outcome', 'resolved', 'lease_expired_requeued',
                    'lease_expired_unknown_outcome', 'lease_expired_canceled',
                    'lease_expired_failed', 'wake_up_resent');
END $$;

CREATE FUNCTION run_hold_reason_valid(hold_reason text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN hold_reason IS NULL OR hold_reason IN ('max_destroy', 'plan_gate', 'approval_rule',
                                                  'cost_check', 'require_approval', 'agent_run',
                                                  'dry_run_scan');
END $$;

CREATE FUNCTION run_apply_mode_valid(apply_mode text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN apply_mode IN ('one_step', 'proposes_apply', 'proposed_apply');
END $$;

CREATE FUNCTION run_provider_lock_state_valid(provider_lock_state text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN provider_lock_state IN ('unknown', 'none', 'present');
END $$;

CREATE FUNCTION run_resolution_action_valid(resolution_action text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN resolution_action IN ('mark_resolved', 'restore_held_state', 'attach_state');
END $$;

CREATE FUNCTION run_sandbox_valid(sandbox text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN sandbox IN ('bubblewrap', 'none');
END $$;

-- 'none' never has a lockfile digest and 'present' always has one; 'unknown' (a legacy
-- record) may keep one.
CREATE FUNCTION run_provider_lock_digest_valid(provider_lock_state text,
                                               provider_lock_digest text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN (provider_lock_state <> 'none' OR provider_lock_digest IS NULL)
       AND (provider_lock_state <> 'present' OR provider_lock_digest IS NOT NULL);
END $$;

-- A resolution is recorded whole: its action, when and by whom, or none of them.
CREATE FUNCTION run_resolution_complete(resolution_action text, resolved_at timestamptz,
                                        resolved_by text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN (resolution_action IS NULL) = (resolved_at IS NULL)
       AND (resolved_at IS NULL) = (resolved_by IS NULL);
END $$;

ALTER TABLE run_events
    DROP CONSTRAINT run_events_kind_check,
    ADD CONSTRAINT run_events_kind_check CHECK (run_event_kind_valid(kind));

ALTER TABLE runs
    DROP CONSTRAINT runs_hold_reason_check,
    ADD CONSTRAINT runs_hold_reason_check CHECK (run_hold_reason_valid(hold_reason)),
    DROP CONSTRAINT runs_apply_mode_check,
    ADD CONSTRAINT runs_apply_mode_check CHECK (run_apply_mode_valid(apply_mode)),
    DROP CONSTRAINT runs_provider_lock_state_check,
    ADD CONSTRAINT runs_provider_lock_state_check
        CHECK (run_provider_lock_state_valid(provider_lock_state)),
    DROP CONSTRAINT runs_resolution_action_check,
    ADD CONSTRAINT runs_resolution_action_check
        CHECK (run_resolution_action_valid(resolution_action)),
    DROP CONSTRAINT runs_sandbox_check,
    ADD CONSTRAINT runs_sandbox_check CHECK (run_sandbox_valid(sandbox)),
    DROP CONSTRAINT runs_provider_lock_digest,
    ADD CONSTRAINT runs_provider_lock_digest
        CHECK (run_provider_lock_digest_valid(provider_lock_state, provider_lock_digest)),
    DROP CONSTRAINT runs_resolution_complete,
    ADD CONSTRAINT runs_resolution_complete
        CHECK (run_resolution_complete(resolution_action, resolved_at, resolved_by));
