-- The dry-run scan's report (findings by address, unreadable parts, modules read), kept as
-- audit evidence on the plan Run it was made for and shown with the approval.
ALTER TABLE runs ADD COLUMN scan_report jsonb;
