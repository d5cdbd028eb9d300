-- The time-partitioned inbox (opt-in: `Migrator::partitioned_inbox`, or
-- `SELECT enable_partitioned_inbox(...)` for plain-SQL installs). This migration only
-- creates the machinery: an empty partitioned table and its functions cost nothing until a
-- schema is switched to it.
--
-- Expiry is a partition drop: no DELETE, no dead tuples, no vacuum. PostgreSQL cannot
-- enforce a unique (consumer, key) across the partitions of a table partitioned by time, so
-- the claim makes uniqueness hold another way:
-- 1. every claim of one (consumer, key) first takes a transaction-scoped advisory lock
--    derived from it, so claims of a key run one after the other, whatever partition each
--    would write to; the lock is held until the claiming transaction ends;
-- 2. then, in a new statement (READ COMMITTED: a new snapshot, taken after the lock was
--    granted, so it sees every earlier holder's commit), it looks the key up in every live
--    partition, and in the plain inbox (records written before the switch);
-- 3. only if none holds the key does it insert, into the partition of its transaction's
--    start time. Each partition also has a unique (consumer, key) index: a second line of
--    defence, and the index of the look-up.
-- A duplicate takes the lock and reads: no row written, no transaction id, no WAL.
--
-- REPEATABLE READ is refused: its snapshot can predate the lock, so step 2 could miss a
-- holder that committed into another partition. SERIALIZABLE is accepted: its
-- serializable-snapshot checks see the read of step 2 and a concurrent insert into any
-- partition as a conflict, and abort one transaction with a retryable serialization failure.

CREATE TABLE inbox_partitioning (
    singleton         boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    -- Width of each partition.
    every             interval    NOT NULL CHECK (every >= interval '1 second'),
    -- The redelivery window: no partition holding a claim younger than this is ever dropped.
    minimum_retention interval    NOT NULL CHECK (minimum_retention >= interval '0'),
    -- Partitions kept created ahead of the current one.
    ahead             integer     NOT NULL CHECK (ahead BETWEEN 1 AND 1000),
    enabled_at        timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE inbox_partitioning IS 'pgbox: settings of the time-partitioned inbox (one row once enabled)';

CREATE TABLE partitioned_inbox (
    consumer     text        NOT NULL,
    key          text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    message_id   text,
    outcome      jsonb,
    rejection    text
) PARTITION BY RANGE (processed_at);

COMMENT ON TABLE partitioned_inbox IS 'pgbox: the inbox, partitioned by time (expiry drops partitions)';

-- The advisory lock of one (consumer, key): 64 bits of a hash of an unambiguous encoding
-- (the consumer's length first), so that different pairs collide only by chance (and a
-- collision only makes two claims wait for each other).
CREATE FUNCTION partitioned_inbox_lock_id(p_consumer text, p_key text)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtextextended(length(p_consumer)::text || ':' || p_consumer || p_key, 7062) $$;

-- One claim: lock, look up everywhere, insert if new. Same columns as the plain claim.
-- p_lock_timeout NULL waits for a concurrent holder for as long as it takes; otherwise the
-- wait is bounded (a subtransaction turns the timeout into "in progress").
CREATE FUNCTION partitioned_inbox_claim(
    p_consumer     text,
    p_key          text,
    p_message_id   text,
    p_lock_timeout text
)
RETURNS TABLE (
    r_claimed      boolean,
    r_in_progress  boolean,
    r_processed_at timestamptz,
    r_message_id   text,
    r_outcome      jsonb,
    r_rejection    text,
    r_xact         text
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
DECLARE
    v_lock     bigint := partitioned_inbox_lock_id(p_consumer, p_key);
    v_previous text;
BEGIN
    IF current_setting('transaction_isolation') = 'repeatable read' THEN
        RAISE EXCEPTION 'pgbox: the partitioned inbox cannot claim under REPEATABLE READ'
            USING ERRCODE = '0A000',
                  HINT = 'claim under READ COMMITTED (the default) or SERIALIZABLE';
    END IF;
    IF p_lock_timeout IS NULL THEN
        PERFORM pg_advisory_xact_lock(v_lock);
    ELSIF NOT pg_try_advisory_xact_lock(v_lock) THEN
        v_previous := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_lock_timeout, true);
        BEGIN
            PERFORM pg_advisory_xact_lock(v_lock);
        EXCEPTION WHEN lock_not_available THEN
            PERFORM set_config('lock_timeout', v_previous, true);
            RETURN QUERY SELECT false, true, NULL::timestamptz, NULL::text, NULL::jsonb,
                                NULL::text, NULL::text;
            RETURN;
        END;
        PERFORM set_config('lock_timeout', v_previous, true);
    END IF;
    -- A new statement: under READ COMMITTED its snapshot is taken now, after the lock.
    RETURN QUERY
        (SELECT false, false, i.processed_at, i.message_id, i.outcome, i.rejection, NULL::text
         FROM partitioned_inbox AS i
         WHERE i.consumer = p_consumer AND i.key = p_key
         UNION ALL
         -- A record of the plain inbox, from before the switch; one under a lease (lease
         -- mode, unfinished) is in progress.
         SELECT false, i.lease_expires_at IS NOT NULL, i.processed_at, i.message_id,
                i.outcome, i.rejection, NULL::text
         FROM inbox AS i
         WHERE i.consumer = p_consumer AND i.key = p_key)
        LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
        INSERT INTO partitioned_inbox AS i (consumer, key, message_id)
        VALUES (p_consumer, p_key, p_message_id)
        RETURNING true, false, i.processed_at, i.message_id, NULL::jsonb, NULL::text,
                  pg_current_xact_id()::text;
END
$fn$;

-- A batch: the keys' locks in one fixed order (hash order, so two batches sharing keys
-- cannot deadlock on each other), then one INSERT of the keys no partition holds. Returns
-- the keys this transaction claimed; a key repeated in the batch is claimed once.
CREATE FUNCTION partitioned_inbox_claim_batch(
    p_consumer    text,
    p_keys        text[],
    p_message_ids text[]
)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    IF current_setting('transaction_isolation') = 'repeatable read' THEN
        RAISE EXCEPTION 'pgbox: the partitioned inbox cannot claim under REPEATABLE READ'
            USING ERRCODE = '0A000',
                  HINT = 'claim under READ COMMITTED (the default) or SERIALIZABLE';
    END IF;
    PERFORM pg_advisory_xact_lock(l.id)
    FROM unnest(ARRAY(
        SELECT DISTINCT partitioned_inbox_lock_id(p_consumer, k) FROM unnest(p_keys) AS k
        ORDER BY 1)) AS l(id);
    RETURN QUERY
        INSERT INTO partitioned_inbox AS i (consumer, key, message_id)
        SELECT p_consumer, k.key, k.message_id
        FROM (SELECT DISTINCT ON (u.key) u.key, u.message_id
              FROM unnest(p_keys, p_message_ids) WITH ORDINALITY AS u(key, message_id, n)
              ORDER BY u.key, u.n) AS k
        WHERE NOT EXISTS (SELECT 1 FROM partitioned_inbox AS p
                          WHERE p.consumer = p_consumer AND p.key = k.key)
          AND NOT EXISTS (SELECT 1 FROM inbox AS p
                          WHERE p.consumer = p_consumer AND p.key = k.key)
        RETURNING i.key;
END
$fn$;

-- The partitions, oldest first: name and bounds, read from the catalog.
CREATE FUNCTION inbox_partitions()
RETURNS TABLE (r_name text, r_from timestamptz, r_to timestamptz)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
SET datestyle = 'ISO, YMD'
AS $fn$
    SELECT c.relname::text,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
    FROM pg_inherits AS h
    JOIN pg_class AS c ON c.oid = h.inhrelid
    WHERE h.inhparent = 'partitioned_inbox'::regclass AND NOT h.inhdetachpending
    ORDER BY 2
$fn$;

-- Creates the partitions missing between the one holding p_at and `ahead` partitions after
-- it, each as a plain table with its unique index and a CHECK of its bounds, then attached
-- (ATTACH takes a lock that lets claims go on; the CHECK spares it a scan). Partitions
-- follow on from the newest one, so changing `every` never makes two overlap; after a gap
-- (nothing created for a long time) the chain restarts at p_at. Returns the names created.
CREATE FUNCTION inbox_partitions_create(p_at timestamptz)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET datestyle = 'ISO, YMD'
AS $fn$
DECLARE
    v_settings inbox_partitioning%ROWTYPE;
    v_from     timestamptz;
    v_to       timestamptz;
    v_until    timestamptz;
    v_name     text;
BEGIN
    SELECT * INTO v_settings FROM inbox_partitioning;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgbox: the partitioned inbox is not enabled in schema %', current_schema()
            USING ERRCODE = '55000';
    END IF;
    -- Serializes concurrent creators (two instances starting at once).
    PERFORM pg_advisory_xact_lock(partitioned_inbox_lock_id('pgbox:partitions', current_schema()));
    SELECT max(r_to) INTO v_from FROM inbox_partitions();
    IF v_from IS NULL OR v_from <= p_at - v_settings.every THEN
        -- Aligned on multiples of `every` since the epoch, so bounds are round numbers.
        v_from := to_timestamp(floor(extract(epoch FROM p_at)
                                     / extract(epoch FROM v_settings.every))
                               * extract(epoch FROM v_settings.every));
    END IF;
    v_until := p_at + v_settings.every * v_settings.ahead;
    WHILE v_from <= v_until LOOP
        v_to := v_from + v_settings.every;
        v_name := 'partitioned_inbox_p' || to_char(v_from AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS');
        EXECUTE format(
            'CREATE TABLE %I (LIKE partitioned_inbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS, '
            'CONSTRAINT %I CHECK (processed_at >= %L AND processed_at < %L))',
            v_name, v_name || '_bounds', v_from, v_to);
        EXECUTE format('CREATE UNIQUE INDEX %I ON %I (consumer, key)', v_name || '_key', v_name);
        EXECUTE format('ALTER TABLE partitioned_inbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       v_name, v_from, v_to);
        EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', v_name, v_name || '_bounds');
        RETURN NEXT v_name;
        v_from := v_to;
    END LOOP;
END
$fn$;

-- The partitions whose every row is older than p_retention (upper bound at or before
-- now() - p_retention), oldest first: the ones expiry may detach and drop. Refuses a
-- retention shorter than the configured minimum (the redelivery window).
CREATE FUNCTION inbox_partitions_expired(p_retention interval)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET datestyle = 'ISO, YMD'
AS $fn$
DECLARE
    v_minimum interval;
BEGIN
    SELECT minimum_retention INTO v_minimum FROM inbox_partitioning;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgbox: the partitioned inbox is not enabled in schema %', current_schema()
            USING ERRCODE = '55000';
    END IF;
    IF p_retention IS NULL OR p_retention < v_minimum THEN
        RAISE EXCEPTION 'pgbox: retention % is shorter than the partitioned inbox''s minimum %',
                        p_retention, v_minimum
            USING ERRCODE = '22023',
                  HINT = 'a partition dropped before the redelivery window ends lets a redelivered message run again';
    END IF;
    RETURN QUERY SELECT r_name FROM inbox_partitions() WHERE r_to <= now() - p_retention ORDER BY r_to;
END
$fn$;

-- Switches this schema to the partitioned inbox, or changes its settings; creates the first
-- partitions. From then on the plain inbox takes no new claims (a NOT VALID CHECK refuses
-- new rows and leaves existing ones be): an Inbox still built for the plain table fails
-- loudly instead of deduplicating against the wrong table. Its existing records keep
-- deduplicating: the partitioned claim looks there too, until they are purged.
CREATE FUNCTION enable_partitioned_inbox(p_every interval, p_minimum_retention interval, p_ahead integer)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    INSERT INTO inbox_partitioning (every, minimum_retention, ahead)
    VALUES (p_every, p_minimum_retention, p_ahead)
    ON CONFLICT (singleton) DO UPDATE
        SET every = EXCLUDED.every, minimum_retention = EXCLUDED.minimum_retention,
            ahead = EXCLUDED.ahead;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = 'inbox'::regclass AND conname = 'inbox_partitioned_mode') THEN
        ALTER TABLE inbox ADD CONSTRAINT inbox_partitioned_mode CHECK (false) NOT VALID;
    END IF;
    RETURN QUERY SELECT * FROM inbox_partitions_create(now());
END
$fn$;
