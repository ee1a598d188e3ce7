-- run_events.kind holds an `EventKind` (shared/core/src/event.rs). Every kind any release
-- wrote is still one (none was renamed or dropped), so the rows already there pass. The
-- store's unit test `every_text_column_check_lists_its_closed_set` keeps this list equal
-- to `EventKind::ALL`: a kind added there needs a migration that replaces this constraint.
ALTER TABLE run_events ADD CONSTRAINT run_events_kind_check
    CHECK (kind IN ('queued', 'claimed', 'requeued', 'checkout_started', 'environment_prepared',
                    'checked_out', 'tool_started', 'dry_run_scan', 'pin_checked', 'planned',
                    'gate_decision', 'held', 'approved', 'released', 'state_version_written',
                    'state_store_retrying', 'applied', 'failed', 'cancel_requested', 'canceled',
                    'unknown_outcome', 'resolved', 'lease_expired_requeued',
                    'lease_expired_unknown_outcome', 'lease_expired_canceled',
                    'lease_expired_failed', 'wake_up_resent'));
