-- Which sandbox executed a Run's processes (issue 13): `bubblewrap`, or `none` where a
-- runner was explicitly started without isolation. NULL: not executed yet (or a legacy row).
ALTER TABLE runs ADD COLUMN sandbox text CHECK (sandbox IN ('bubblewrap', 'none'));
