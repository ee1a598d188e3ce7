-- Sent outbox rows are pruned once they are older than the relay's retention
-- (`outbox::prune_sent`): before, every wake-up ever sent stayed in the table, three or so per
-- pipeline Run. This index finds the expired ones by when they were sent, so a prune reads
-- only what it deletes however many recent rows there are.
CREATE INDEX outbox_sent ON outbox (sent_at) WHERE sent_at IS NOT NULL;
