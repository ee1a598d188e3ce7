-- runs.hold_reason holds a `HoldReason` (shared/core/src/decisions.rs), the rule that held
-- the Run; the names have not changed since the column was added. The store's unit test
-- `every_text_column_check_lists_its_closed_set` keeps this list equal to `HoldReason::ALL`:
-- a reason added there needs a migration that replaces this constraint.
ALTER TABLE runs ADD CONSTRAINT runs_hold_reason_check
    CHECK (hold_reason IS NULL OR hold_reason IN ('max_destroy', 'plan_gate', 'approval_rule',
                                                  'cost_check', 'require_approval', 'agent_run',
                                                  'dry_run_scan'));
