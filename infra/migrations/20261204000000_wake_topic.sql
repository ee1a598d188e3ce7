-- Where a Run's wake-up is published: a Capsule that names a worker pool wakes the pool's
-- own queue (`run.plan.<pool>`, `run.apply.<pool>`, `run.drift.<pool>`), which the control
-- node's handlers never consume; gate and approve stay on the control node. One definition
-- for every statement that queues a wake-up (`outbox::enqueue`, a Run's start, the sweep),
-- so a wake-up cannot be routed one way on one path and another way on the other.
CREATE FUNCTION wake_topic(topic text, pool_name text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN topic IN ('run.plan', 'run.apply', 'run.drift') AND pool_name IS NOT NULL
                THEN topic || '.' || pool_name ELSE topic END;
