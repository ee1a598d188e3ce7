-- Where a Capsule's wake-ups go, as a view the statements that queue a wake-up join
-- (`outbox::enqueue`, a Run's start, the gate's release, the plan's record): the lookup is
-- still written once, and the planner inlines it into each statement.
--
-- `capsule_wake_topic` (20261207000001) did the same as a `LANGUAGE sql` function, which
-- Postgres cannot inline (its body holds a subquery): every statement that called it parsed
-- and planned the function's body again, ~0.2 ms of Postgres's time each (pgbench, prepared:
-- 0.24-0.32 ms a call against 0.05-0.06 for the join written out), a quarter of an
-- admission's. It stays, for a process of the previous release still running during an
-- upgrade, now over the view and in PL/pgSQL, which keeps its plan for the session.

CREATE VIEW capsule_wake_routes AS
    SELECT c.id AS capsule_id, p.name AS pool_name
      FROM capsules c
      LEFT JOIN worker_pools p ON p.id = c.pool_id;

CREATE OR REPLACE FUNCTION capsule_wake_topic(topic text, capsule uuid) RETURNS text
    LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN wake_topic(topic, (SELECT pool_name FROM capsule_wake_routes WHERE capsule_id = capsule));
END $$;
