-- The operator actions that resolve an unknown_outcome apply. Besides `mark_resolved`
-- (the operator inspected and records it), `restore_held_state` makes the state the
-- apply's tool wrote, kept in `held_states`, the Capsule's next StateVersion, and
-- `attach_state` stores a state the operator pulled from the provider side as the next
-- StateVersion. Both write through the generation compare-and-set; the StateVersion they
-- wrote is the Run's `state_version_id`.
ALTER TABLE runs DROP CONSTRAINT runs_resolution_action_check;
ALTER TABLE runs ADD CONSTRAINT runs_resolution_action_check
    CHECK (resolution_action IN ('mark_resolved', 'restore_held_state', 'attach_state'));
