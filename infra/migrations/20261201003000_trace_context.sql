-- W3C trace context (issue 19): the Run keeps the traceparent of the request that made it
-- (or of its plan, for an apply a step made); each outbox row of the Run copies it, and the
-- relay sends it as the message's `traceparent` header.
ALTER TABLE runs ADD COLUMN traceparent text;
ALTER TABLE outbox ADD COLUMN traceparent text;
