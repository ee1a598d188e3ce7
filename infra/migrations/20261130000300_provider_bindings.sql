-- Credentials and variables: ProviderBindings (named credential sets attached to
-- Capsules), per-run variables, and what each Run was given (names, never values).

-- A named credential set of a Workspace. Its values are sealed with the server key
-- (AES-256-GCM, purpose `credential`, subject = the binding id) and stored only as
-- `sealed`; `env_names` are the variable names it injects (not secret).
CREATE TABLE provider_bindings (
    id            uuid PRIMARY KEY,
    workspace_id  uuid NOT NULL REFERENCES workspaces(id),
    name          text NOT NULL,
    kind          text NOT NULL CHECK (kind IN ('env', 'token', 'command')),
    env_names     text[] NOT NULL,
    sealed        bytea NOT NULL,
    created_by    text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, name)
);

-- Which bindings a Capsule's runs get, resolved fresh for every plan and apply.
CREATE TABLE capsule_provider_bindings (
    capsule_id   uuid NOT NULL REFERENCES capsules(id),
    binding_id   uuid NOT NULL REFERENCES provider_bindings(id),
    attached_by  text NOT NULL,
    attached_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (capsule_id, binding_id)
);
CREATE INDEX capsule_provider_bindings_binding ON capsule_provider_bindings (binding_id);

-- The non-secret variables a plan Run is planned with: the Capsule's defaults with the
-- submission's overrides merged over them (NULL for Runs from before this column: the
-- Capsule's variables apply). Sensitive variables are never stored here.
ALTER TABLE runs ADD COLUMN vars jsonb;
-- `[{"id": "pb_…", "name": "…"}]`: the ProviderBindings a step injected.
ALTER TABLE runs ADD COLUMN provider_bindings jsonb NOT NULL DEFAULT '[]'::jsonb;

-- A plan Run's sensitive variables, sealed (purpose `credential`, subject
-- `<run id>/sensitive-vars`). Read by the plan that injects them and the apply that masks
-- them; removed when the apply of that plan ends.
CREATE TABLE run_sensitive_vars (
    run_id  uuid PRIMARY KEY REFERENCES runs(id),
    names   text[] NOT NULL,
    sealed  bytea NOT NULL
);
