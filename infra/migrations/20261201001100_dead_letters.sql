-- Dead letters (issue 15): what the steps could not process, kept where operators can look
-- without touching the broker. The API's collector consumes every step queue's dead-letter
-- queue and moves each message here (the row is committed before the message is acked), so
-- viewing is a SELECT, and an operator's requeue (an outbox wake-up in the transaction that
-- deletes the row) or purge (a DELETE) is one transaction.
CREATE TABLE dead_letters (
    id                bigserial PRIMARY KEY,
    -- The step queue it was meant for (`run.plan`).
    queue             text NOT NULL,
    -- The body, cut at 64 KiB (a wake-up is a few dozen bytes; a foreign body anything).
    body              bytea NOT NULL,
    body_truncated    boolean NOT NULL DEFAULT false,
    -- The Run it names, when the body is a Run message (only those can be requeued).
    run_id            uuid,
    -- Why a step gave up (`x-takosumi-error`), or why the broker dead-lettered it
    -- (`x-death` reason: `rejected`, `delivery_limit`, …).
    error             text,
    broker_reason     text,
    message_id        text,
    collected_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_letters_queue ON dead_letters (queue, id);
