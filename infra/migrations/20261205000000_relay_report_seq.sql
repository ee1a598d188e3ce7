-- A relay worker numbers the progress reports of a claim (1, 2, …); the API stores each
-- numbered report once, whole, in one transaction, and records here the last number it
-- stored for which claim. A report sent again because its answer was lost (a timeout, a
-- gateway's 504) is then answered without being stored twice, so the worker can send again
-- every report whose answer it did not see instead of dropping it. Meaningful only while
-- `report_claim` is the Run's `lease_owner`: a new claim starts from nothing.
ALTER TABLE runs ADD COLUMN report_claim text, ADD COLUMN report_seq bigint;
