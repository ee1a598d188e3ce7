-- Webhook replay (issue 15): a delivery id (GitHub's X-GitHub-Delivery, GitLab's
-- Idempotency-Key or X-Gitlab-Event-UUID) is processed once per Workspace. The id is
-- inserted in the same transaction as the delivery's effect (stale marks, activity, Runs),
-- so a replay finds it and changes nothing, and a delivery whose effect rolled back can be
-- delivered again. Ids older than the retention are pruned by later deliveries.
CREATE TABLE webhook_deliveries (
    workspace_id  uuid NOT NULL REFERENCES workspaces(id) ON DELETE CASCADE,
    delivery_id   text NOT NULL CHECK (length(delivery_id) BETWEEN 1 AND 300),
    received_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, delivery_id)
);
CREATE INDEX webhook_deliveries_received_at ON webhook_deliveries (received_at);
