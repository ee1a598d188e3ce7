-- A Capsule's row is rewritten far more often than Capsules are added: every sweep marks it
-- (`last_drift_enqueued_at`), every apply sets and clears `running_apply_id` and moves its
-- state version, every push may mark it stale. None of those columns is indexed, so each
-- rewrite can be a HOT update (no new entry in either index, the new version on the same
-- page), but only if the page has room: packed full (the default fill factor, 100), every
-- one of them was a cold update, a new version on another page and two index entries. With
-- a tenth of each page kept free, a sweep's batch of 2,000 marks took 10-14 ms instead of
-- 41-52 (scratch database, 100,000 Capsules; BENCHMARKS.md, session 34). Pages already
-- written keep their layout until their rows move; new and moved rows get the room.
ALTER TABLE capsules SET (fillfactor = 90);
