-- A relay claims the wake-ups it publishes for a short while (`outbox::claim_due`) instead
-- of holding their row locks in a transaction while it publishes: a pass is two autocommit
-- statements (the claim, the mark) where it was four (BEGIN, the lock, the mark, COMMIT),
-- and a pass that finds nothing is one. Other relays skip a row while its claim runs; a
-- relay that dies before its mark leaves the row pending, published again once the claim
-- lapses. Not indexed: setting it is a HOT update.
ALTER TABLE outbox ADD COLUMN claimed_until timestamptz;
