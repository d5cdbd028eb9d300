-- The archive of delivered messages (opt-in: `RelayBuilder::archive`, `WalRelayBuilder::archive`).
-- This migration only creates the machinery: an empty partitioned table costs nothing until a
-- relay archives into it.
--
-- Retention is a partition drop, never DELETE + VACUUM. The table is partitioned by range of
-- `archived_at` (the archiving transaction's start time), one partition per `every`, created
-- ahead by the relay at start and by the janitor.
--
-- An insert never fails for want of a partition: a DEFAULT partition takes what no range
-- partition covers (the janitor stopped for longer than `ahead` partitions last). It is not a
-- place rows stay: creating partitions first moves the default's rows into range partitions
-- made for them (under a lock on the default partition only: inserts routed to a range
-- partition go on), so the default partition is empty in steady state and the next expiry
-- drops its rows with their partition. Creating partitions on demand instead would put DDL
-- (and its locks) in the relay's settling statement, or make it retry.

CREATE TABLE outbox_archive_settings (
    singleton     boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    -- Width of each partition.
    every         interval    NOT NULL CHECK (every >= interval '1 second'),
    -- Archived messages are kept at least this long; a partition is dropped once its newest
    -- possible row is older.
    retention     interval    NOT NULL CHECK (retention >= interval '1 second'),
    -- Partitions kept created ahead of the current one.
    ahead         integer     NOT NULL CHECK (ahead BETWEEN 1 AND 100),
    configured_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE outbox_archive_settings IS 'pgbox: settings of the archive of delivered messages (one row once configured)';

-- Archive order. Drawn at archiving, in each round's seq order; a key's later messages are
-- archived by a later round, so per key this is publication order.
CREATE SEQUENCE outbox_archive_seq AS bigint;

CREATE TABLE outbox_archive (
    seq           bigint      NOT NULL DEFAULT nextval('outbox_archive_seq'),
    -- The outbox row's seq (table relay); NULL for the WAL relay, which may archive a
    -- message twice after a crash (replay keeps the first copy).
    source_seq    bigint,
    message_id    uuid        NOT NULL,
    topic         text        NOT NULL,
    ordering_key  text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL,
    headers       jsonb       NOT NULL,
    created_at    timestamptz NOT NULL,
    -- When it was archived: the publishing round's transaction start (the publish time).
    archived_at   timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (archived_at);

ALTER SEQUENCE outbox_archive_seq OWNED BY outbox_archive.seq;

COMMENT ON TABLE outbox_archive IS 'pgbox: delivered messages, partitioned by time (expiry drops partitions)';

-- Replay reads in archive order (filters apply on the way: a replay reads its range once).
-- The WAL relay's rows (source_seq NULL, possibly archived twice) are looked up by id, to
-- replay the first copy only; the table relay's never are, and pay for no second index.
CREATE INDEX outbox_archive_seq_idx ON outbox_archive (seq);
CREATE INDEX outbox_archive_wal_message_idx ON outbox_archive (message_id) WHERE source_seq IS NULL;

CREATE TABLE outbox_archive_default PARTITION OF outbox_archive DEFAULT;

-- The range partitions, oldest first: name and bounds, read from the catalog.
CREATE FUNCTION outbox_archive_partitions()
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
    WHERE h.inhparent = 'outbox_archive'::regclass AND NOT h.inhdetachpending
      AND c.relname <> 'outbox_archive_default'
    ORDER BY 2
$fn$;

-- One range partition [p_from, p_to): created as a plain table with a CHECK of its bounds,
-- filled with the default partition's rows of that range (moved), then attached (the CHECK
-- spares ATTACH a scan; the default partition, locked by the caller, is checked empty there).
CREATE FUNCTION outbox_archive_partition_add(p_from timestamptz, p_to timestamptz)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET datestyle = 'ISO, YMD'
AS $fn$
DECLARE
    v_name text := 'outbox_archive_p' || to_char(p_from AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS');
BEGIN
    EXECUTE format(
        'CREATE TABLE %I (LIKE outbox_archive INCLUDING DEFAULTS, '
        'CONSTRAINT %I CHECK (archived_at >= %L AND archived_at < %L))',
        v_name, v_name || '_bounds', p_from, p_to);
    EXECUTE format(
        'WITH moved AS (DELETE FROM outbox_archive_default WHERE archived_at >= %L AND archived_at < %L RETURNING *) '
        'INSERT INTO %I SELECT * FROM moved',
        p_from, p_to, v_name);
    EXECUTE format('ALTER TABLE outbox_archive ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   v_name, p_from, p_to);
    EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', v_name, v_name || '_bounds');
    RETURN v_name;
END
$fn$;

-- Moves every row of the default partition into range partitions made for it, then creates
-- the partitions missing from the one holding p_at to `ahead` after it. Without settings:
-- daily partitions, 3 ahead. Returns the names created.
CREATE FUNCTION outbox_archive_partitions_create(p_at timestamptz)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET datestyle = 'ISO, YMD'
AS $fn$
DECLARE
    v_every interval := interval '1 day';
    v_ahead integer := 3;
    v_min   timestamptz;
    v_from  timestamptz;
    v_to    timestamptz;
    v_until timestamptz;
BEGIN
    SELECT every, ahead INTO v_every, v_ahead FROM outbox_archive_settings;
    IF NOT FOUND THEN
        v_every := interval '1 day';
        v_ahead := 3;
    END IF;
    -- Serializes concurrent creators (two relays starting at once, a janitor).
    PERFORM pg_advisory_xact_lock(hashtextextended('pgbox:archive:' || current_schema(), 7062));
    -- Inserts routed to the default partition wait for this transaction; others go on.
    LOCK TABLE outbox_archive_default IN ACCESS EXCLUSIVE MODE;
    -- Each round moves at least the oldest row of the default partition: bounded.
    LOOP
        SELECT min(archived_at) INTO v_min FROM outbox_archive_default;
        EXIT WHEN v_min IS NULL;
        -- The aligned bucket of the oldest row, cut to the gap between the partitions
        -- around it (none covers v_min, or the row would not be in the default partition).
        v_from := to_timestamp(floor(extract(epoch FROM v_min) / extract(epoch FROM v_every))
                               * extract(epoch FROM v_every));
        v_to := v_from + v_every;
        v_from := greatest(v_from, (SELECT max(r_to) FROM outbox_archive_partitions() WHERE r_to <= v_min));
        v_to := least(v_to, (SELECT min(r_from) FROM outbox_archive_partitions() WHERE r_from > v_min));
        RETURN NEXT outbox_archive_partition_add(v_from, v_to);
    END LOOP;
    -- Then every bucket from the one holding p_at to `ahead` after it that no partition
    -- covers (cut to the gaps between existing ones: changing `every` never makes two
    -- overlap). Each turn moves v_from forward: bounded.
    v_from := to_timestamp(floor(extract(epoch FROM p_at) / extract(epoch FROM v_every))
                           * extract(epoch FROM v_every));
    v_until := p_at + v_every * v_ahead;
    WHILE v_from <= v_until LOOP
        SELECT r_to INTO v_to FROM outbox_archive_partitions() WHERE r_from <= v_from AND r_to > v_from;
        IF FOUND THEN
            v_from := v_to;
            CONTINUE;
        END IF;
        v_to := least(v_from + v_every,
                      (SELECT min(r_from) FROM outbox_archive_partitions() WHERE r_from > v_from));
        RETURN NEXT outbox_archive_partition_add(v_from, v_to);
        v_from := v_to;
    END LOOP;
END
$fn$;

-- For the relay's and the janitor's role: creates partitions ahead (SECURITY DEFINER, owned
-- by the migrating role; no argument; pinned search_path).
CREATE FUNCTION outbox_archive_create_ahead()
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM outbox_archive_partitions_create(pg_catalog.now());
END
$fn$;

REVOKE ALL ON FUNCTION outbox_archive_create_ahead() FROM PUBLIC;

-- For the relay's role: records the archive's settings (the relay built with `archive(..)`
-- calls it at start) and creates partitions ahead. The table's CHECKs validate them.
CREATE FUNCTION outbox_archive_configure(p_every interval, p_retention interval, p_ahead integer,
                                         p_lengthen_only boolean DEFAULT false)
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $fn$
BEGIN
    IF p_lengthen_only THEN
        -- A relay starting: its settings apply only where nothing is recorded, and its
        -- retention and margin may only lengthen what is (another relay, or an operator's
        -- explicit configure, may keep messages longer; a relay never shortens that).
        INSERT INTO outbox_archive_settings (every, retention, ahead)
        VALUES (p_every, p_retention, p_ahead)
        ON CONFLICT (singleton) DO UPDATE
            SET retention = GREATEST(outbox_archive_settings.retention, EXCLUDED.retention),
                ahead = GREATEST(outbox_archive_settings.ahead, EXCLUDED.ahead),
                configured_at = pg_catalog.now()
            WHERE outbox_archive_settings.retention < EXCLUDED.retention
               OR outbox_archive_settings.ahead < EXCLUDED.ahead;
    ELSE
        INSERT INTO outbox_archive_settings (every, retention, ahead)
        VALUES (p_every, p_retention, p_ahead)
        ON CONFLICT (singleton) DO UPDATE
            SET every = EXCLUDED.every, retention = EXCLUDED.retention, ahead = EXCLUDED.ahead,
                configured_at = pg_catalog.now()
            WHERE (outbox_archive_settings.every, outbox_archive_settings.retention,
                   outbox_archive_settings.ahead) IS DISTINCT FROM
                  (EXCLUDED.every, EXCLUDED.retention, EXCLUDED.ahead);
    END IF;
    RETURN QUERY SELECT * FROM outbox_archive_partitions_create(pg_catalog.now());
END
$fn$;

REVOKE ALL ON FUNCTION outbox_archive_configure(interval, interval, integer, boolean) FROM PUBLIC;

-- For the janitor's role: drops the partitions whose every row is older than the configured
-- retention (upper bound at or before now() - retention), oldest first; never the current
-- one (retention is at least a second). A plain DROP: DETACH ... CONCURRENTLY is refused on
-- a table with a default partition. The DROP's lock on the archive waits at most 5 s (a
-- relay's settling statement queued behind it waits as long); a partition it could not lock
-- is left to the next pass.
CREATE FUNCTION outbox_archive_drop_expired()
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $fn$
DECLARE
    v_retention interval;
    v_name      text;
BEGIN
    SELECT retention INTO v_retention FROM outbox_archive_settings;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('pgbox:archive:' || current_schema(), 7062));
    PERFORM set_config('lock_timeout', '5s', true);
    FOR v_name IN
        SELECT r_name FROM outbox_archive_partitions()
        WHERE r_to <= pg_catalog.now() - v_retention ORDER BY r_from
    LOOP
        -- Each drop in its own subtransaction: a partition whose lock is not granted within
        -- the timeout is skipped (left to the next pass), the others still go.
        BEGIN
            EXECUTE format('DROP TABLE %I', v_name);
            RETURN NEXT v_name;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'pgbox: archive partition % is in use; left to the next pass', v_name;
        END;
    END LOOP;
END
$fn$;

REVOKE ALL ON FUNCTION outbox_archive_drop_expired() FROM PUBLIC;
