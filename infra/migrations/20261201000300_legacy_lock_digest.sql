-- Issue 14 / run-model: "Digest-only records from older runners remain undefined (unknown)".
-- Such a record keeps its digest with state 'unknown'; 'none' never has one, 'present'
-- always does. Nothing regenerates the lockfile a digest-only record names.
ALTER TABLE runs DROP CONSTRAINT runs_check;
ALTER TABLE runs ADD CONSTRAINT runs_provider_lock_digest
    CHECK ((provider_lock_state <> 'none' OR provider_lock_digest IS NULL)
       AND (provider_lock_state <> 'present' OR provider_lock_digest IS NOT NULL));
