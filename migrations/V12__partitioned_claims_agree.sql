-- The time-partitioned inbox's claims agree with the plain inbox's on every key, under every
-- isolation level they accept.
--
-- 1. Only READ COMMITTED. The claim's look-up must see every holder that committed before the
--    per-key lock was granted. Under REPEATABLE READ and SERIALIZABLE the snapshot is the
--    transaction's, taken before the lock: the look-up can miss a holder that committed
--    meanwhile into another partition, where no unique index sees the new row. (SSI does not
--    help against a READ COMMITTED holder, which it does not track: a SERIALIZABLE claim
--    racing a READ COMMITTED one across a partition boundary processed the key twice.) Both
--    levels are refused, with the same error the plain layout's users can act on.
-- 2. Keys under a lease taken in the plain inbox before the switch: the single claim reports
--    a live lease in progress and takes an expired one over (the plain row is deleted and the
--    claim is recorded in the partitioned table, in this transaction: the stale holder's
--    complete, extend and release then find no lease and are refused); the batch claim
--    refuses the call for such a key (live or expired), as the plain layout's batch does,
--    instead of reporting it as already recorded.
-- 3. The switch refused new rows of the plain inbox with a NOT VALID `CHECK (false)`, which
--    PostgreSQL also applies to UPDATEs: completing, extending or releasing a lease taken
--    before the switch failed with a raw check violation. A trigger now refuses only INSERTs,
--    with the same SQLSTATE and constraint name, so the layout mismatch still reads the same.

CREATE FUNCTION inbox_refuse_new_claims()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    RAISE EXCEPTION 'new row for relation "inbox" violates check constraint "inbox_partitioned_mode"'
        USING ERRCODE = '23514',
              CONSTRAINT = 'inbox_partitioned_mode',
              TABLE = 'inbox',
              HINT = 'this schema''s inbox is time-partitioned: claim through the partitioned inbox';
END
$fn$;

-- Installs the INSERT-only refusal (replacing the constraint of an earlier switch).
CREATE FUNCTION inbox_refuse_new_claims_install()
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_constraint
               WHERE conrelid = 'inbox'::regclass AND conname = 'inbox_partitioned_mode') THEN
        ALTER TABLE inbox DROP CONSTRAINT inbox_partitioned_mode;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = 'inbox'::regclass AND tgname = 'inbox_partitioned_mode') THEN
        CREATE TRIGGER inbox_partitioned_mode BEFORE INSERT ON inbox
            FOR EACH ROW EXECUTE FUNCTION inbox_refuse_new_claims();
    END IF;
END
$fn$;

-- A schema already switched: move it to the trigger now.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_constraint
               WHERE conrelid = 'inbox'::regclass AND conname = 'inbox_partitioned_mode') THEN
        PERFORM inbox_refuse_new_claims_install();
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION enable_partitioned_inbox(p_every interval, p_minimum_retention interval, p_ahead integer)
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
    PERFORM inbox_refuse_new_claims_install();
    RETURN QUERY SELECT * FROM inbox_partitions_create(now());
END
$fn$;

-- Refuses every isolation level but READ COMMITTED (see 1. above).
CREATE FUNCTION partitioned_inbox_check_isolation()
RETURNS void
LANGUAGE plpgsql
AS $fn$
DECLARE
    v_level text := current_setting('transaction_isolation');
BEGIN
    IF v_level <> 'read committed' THEN
        RAISE EXCEPTION 'pgbox: the partitioned inbox cannot claim under %', upper(v_level)
            USING ERRCODE = '0A000',
                  HINT = 'claim under READ COMMITTED (the default), or use the plain inbox';
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION partitioned_inbox_claim(
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
    v_plain    inbox%ROWTYPE;
BEGIN
    PERFORM partitioned_inbox_check_isolation();
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
    -- New statements: under READ COMMITTED each snapshot is taken now, after the lock.
    RETURN QUERY
        SELECT false, false, i.processed_at, i.message_id, i.outcome, i.rejection, NULL::text
        FROM partitioned_inbox AS i
        WHERE i.consumer = p_consumer AND i.key = p_key
        LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    -- A record of the plain inbox, from before the switch.
    SELECT * INTO v_plain FROM inbox AS i WHERE i.consumer = p_consumer AND i.key = p_key;
    IF FOUND THEN
        IF v_plain.lease_expires_at IS NULL THEN
            RETURN QUERY SELECT false, false, v_plain.processed_at, v_plain.message_id,
                                v_plain.outcome, v_plain.rejection, NULL::text;
            RETURN;
        END IF;
        -- Under a lease (lease mode, unfinished): in progress while it lasts, or while its
        -- holder has the row locked; an expired one is taken over by this claim.
        DELETE FROM inbox AS i
        WHERE i.ctid = (SELECT l.ctid FROM inbox AS l
                        WHERE l.consumer = p_consumer AND l.key = p_key
                          AND l.lease_expires_at IS NOT NULL AND l.lease_expires_at <= now()
                        FOR UPDATE SKIP LOCKED);
        IF NOT FOUND THEN
            RETURN QUERY SELECT false, true, v_plain.processed_at, v_plain.message_id,
                                NULL::jsonb, NULL::text, NULL::text;
            RETURN;
        END IF;
        RAISE LOG 'pgbox: the expired lease of key % (consumer %) was taken over by a claim', p_key, p_consumer;
    END IF;
    RETURN QUERY
        INSERT INTO partitioned_inbox AS i (consumer, key, message_id)
        VALUES (p_consumer, p_key, p_message_id)
        RETURNING true, false, i.processed_at, i.message_id, NULL::jsonb, NULL::text,
                  pg_current_xact_id()::text;
END
$fn$;

CREATE OR REPLACE FUNCTION partitioned_inbox_claim_batch(
    p_consumer    text,
    p_keys        text[],
    p_message_ids text[]
)
RETURNS SETOF text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
DECLARE
    v_leased text;
BEGIN
    PERFORM partitioned_inbox_check_isolation();
    PERFORM pg_advisory_xact_lock(l.id)
    FROM unnest(ARRAY(
        SELECT DISTINCT partitioned_inbox_lock_id(p_consumer, k) FROM unnest(p_keys) AS k
        ORDER BY 1)) AS l(id);
    -- A key under a lease taken before the switch is neither new nor done: refuse the batch
    -- for it, as the plain layout does, rather than report it recorded.
    SELECT k INTO v_leased FROM unnest(p_keys) AS k
    WHERE NOT EXISTS (SELECT 1 FROM partitioned_inbox AS p
                      WHERE p.consumer = p_consumer AND p.key = k)
      AND EXISTS (SELECT 1 FROM inbox AS p
                  WHERE p.consumer = p_consumer AND p.key = k AND p.lease_expires_at IS NOT NULL)
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgbox: a key of the batch is under a lease'
            USING ERRCODE = '55006',
                  DETAIL = v_leased,
                  HINT = 'roll back and retry the batch later';
    END IF;
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
