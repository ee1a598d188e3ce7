-- A time-ordered (version 7) uuid made in SQL, as the services make every other id
-- (`Uuid::now_v7()`: 48 bits of Unix milliseconds, then random bits), for the rows a
-- statement makes in bulk: the sweep's drift-check Runs (`drift::sweep_due`).
--
-- Their ids were random (`gen_random_uuid()`, version 4), the only Run ids that were: each
-- landed on a random page of the Runs' primary key (and of the events' index by Run), so a
-- pass over 100,000 due Capsules touched every page of those indexes and, after a
-- checkpoint, wrote each one whole to the WAL once more. Time-ordered ids go to the right
-- of the index. Measured (one backend, 100,000 due Capsules after a `CHECKPOINT`): 11,000
-- full-page images instead of 17,000, 226-241 MB of WAL instead of 250-280, 7.0-7.9 s
-- instead of 7.6-9.8 (BENCHMARKS.md, session 35).
--
-- Postgres 15 has no `uuidv7()` (18 does). The version-4 uuid keeps its random bits and its
-- variant; its first 48 bits become the milliseconds and its version nibble 0111. A plain
-- expression in a `LANGUAGE sql` function, so the planner inlines it.
CREATE FUNCTION uuid_v7() RETURNS uuid
    LANGUAGE sql VOLATILE AS $$
    SELECT encode(
               set_bit(set_bit(
                   overlay(uuid_send(gen_random_uuid())
                           PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                           FROM 1 FOR 6),
                   52, 1), 53, 1),
               'hex')::uuid
$$;
