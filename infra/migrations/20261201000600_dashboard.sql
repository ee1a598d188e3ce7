-- The dashboard (issue 18). A browser signs in with an API token and gets a session cookie; only
-- the cookie's SHA-256 is kept, with the token it stands for, so revoking the token ends every
-- session made from it. The token itself is never stored by the browser or here.
CREATE TABLE dashboard_sessions (
    id_hash     bytea PRIMARY KEY,
    token_id    uuid NOT NULL REFERENCES api_tokens(id) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX dashboard_sessions_expiry ON dashboard_sessions (expires_at);

-- A plan's resource-by-resource diff from its `show -json`, masked when the plan is recorded
-- (sensitive attributes and every known secret value withheld), so a reviewer reads it without
-- anything unsealing the plan's JSON.
ALTER TABLE runs ADD COLUMN plan_diff jsonb;
