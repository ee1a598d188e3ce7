-- Tokens managed over the API (issue 19): an expiry, and who created and revoked each one.
-- Token management of instance-wide tokens is recorded in the activity without a Workspace.
ALTER TABLE api_tokens
    ADD COLUMN expires_at  timestamptz,
    ADD COLUMN created_by  text,
    ADD COLUMN revoked_by  text;
ALTER TABLE activity ALTER COLUMN workspace_id DROP NOT NULL;
