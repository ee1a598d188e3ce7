-- Where a wake-up for a Run of `capsule` is published: `wake_topic` given the pool the
-- Capsule names, if any. Every statement that queues a Run's wake-up in the same statement
-- as its change (`outbox::enqueue`, a Run's start, the gate's release, the plan's record)
-- calls this, so the lookup is written once as the routing is.
CREATE FUNCTION capsule_wake_topic(topic text, capsule uuid) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN wake_topic(topic, (SELECT p.name FROM capsules c
                                JOIN worker_pools p ON p.id = c.pool_id
                               WHERE c.id = capsule));
