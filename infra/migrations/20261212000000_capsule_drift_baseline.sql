-- A Capsule's drift baseline, on its own row: the Run whose plan a drift check compares
-- reality with (the plan the last apply carried out, or a one-step apply itself), or NULL
-- when there is nothing to compare with (no StateVersion, one whose apply records no
-- commit, or a destroy, after which nothing the configuration declares is meant to exist).
--
-- It was derived on every read from the current StateVersion, its apply Run and that Run's
-- plan: three index lookups per Capsule in each sweep batch (about an eighth of a batch's
-- time, BENCHMARKS.md, session 36) for a fact that changes only when a state is written.
-- `states::versions::record_written`, the one statement that moves a Capsule's state,
-- now writes it beside `current_state_version_id`; the sweep, the API's drift-check
-- admission and the plan step read it.
--
-- The key is never updated by the sweep's marks, so they stay HOT updates and check nothing
-- (a foreign key is checked only when its column changes). Runs are never deleted.
ALTER TABLE capsules ADD COLUMN drift_baseline_run_id uuid REFERENCES runs (id);

UPDATE capsules c
   SET drift_baseline_run_id = COALESCE(p.id, a.id)
  FROM state_versions sv
  JOIN runs a ON a.id = sv.run_id
  LEFT JOIN runs p ON p.id = a.plan_run_id
 WHERE sv.id = c.current_state_version_id
   AND a.source_commit IS NOT NULL
   AND p.kind IS DISTINCT FROM 'destroy';
