-- Issue 14, "names, not values": a Run's variables are kept sealed where the pipeline reads
-- them (vars_sealed, with the server key); its record carries their names only.
ALTER TABLE runs ADD COLUMN var_names text[];
ALTER TABLE runs ADD COLUMN vars_sealed bytea;
UPDATE runs SET var_names = ARRAY(SELECT jsonb_object_keys(vars) ORDER BY 1)
 WHERE vars IS NOT NULL AND jsonb_typeof(vars) = 'object';
-- Finished Runs no step will read again lose their plain values; a queued, held or
-- planned Run keeps them until it is used (the pipeline reads them as before).
UPDATE runs SET vars = NULL
 WHERE vars IS NOT NULL
   AND status IN ('applied', 'failed', 'canceled', 'unknown_outcome')
   AND NOT (kind IN ('plan', 'destroy', 'drift_check') AND plan_object_key IS NOT NULL);
-- What the Capsule's configuration declares `sensitive = true`, as its latest plan read
-- it; NULL: not planned yet (every value is withheld until then).
ALTER TABLE capsules ADD COLUMN sensitive_var_names text[];
