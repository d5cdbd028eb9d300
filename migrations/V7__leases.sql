-- Lease mode: for effects outside the database (an HTTP call, an email), a key is marked
-- CONSUMING under a lease with a fencing token and an expiry, the effect runs with no
-- transaction open, and the key is then marked CONSUMED, in the same `inbox` table and key
-- space as the transactional path:
--
--   lease_expires_at IS NOT NULL  -> CONSUMING (a live lease, or an expired one that the next
--                                    `lease` call takes over);
--   lease_expires_at IS NULL      -> processed (by `process`, or a completed lease).
--
-- lease_token is the fencing token of the lease that holds the key or that completed it
-- (NULL for keys recorded by `process`). Tokens come from one sequence, so they grow with
-- every lease and takeover and are never reused, even after a row is purged or released.
-- Every expiry is computed and compared with the database clock (now()), never a client's.
--
-- Nullable columns without defaults: adding them rewrites nothing. The CHECKs are NOT VALID
-- (existing rows have neither column, so they hold; new rows are checked).
ALTER TABLE inbox
    ADD COLUMN lease_token      bigint,
    ADD COLUMN lease_expires_at timestamptz;

ALTER TABLE inbox ADD CONSTRAINT inbox_lease_has_token
    CHECK (lease_expires_at IS NULL OR lease_token IS NOT NULL) NOT VALID;
ALTER TABLE inbox ADD CONSTRAINT inbox_lease_has_no_outcome
    CHECK (lease_expires_at IS NULL OR (outcome IS NULL AND rejection IS NULL)) NOT VALID;

CREATE SEQUENCE inbox_lease_token_seq AS bigint;

-- Status (live and expired leases per consumer) and nothing else: only CONSUMING rows are in
-- it, so it stays small, and rows written by `process` never enter it.
CREATE INDEX inbox_leases_idx ON inbox (consumer, lease_expires_at)
    WHERE lease_expires_at IS NOT NULL;

-- The bounded transactional claim reports a CONSUMING row as in progress, like `read` does.
CREATE OR REPLACE FUNCTION inbox_claim_bounded(
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
    v_previous text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', p_lock_timeout, true);
    BEGIN
        INSERT INTO inbox AS i (consumer, key, message_id)
        VALUES (p_consumer, p_key, p_message_id)
        ON CONFLICT (consumer, key) DO NOTHING
        RETURNING true, false, i.processed_at, i.message_id, pg_current_xact_id()::text
        INTO r_claimed, r_in_progress, r_processed_at, r_message_id, r_xact;
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', v_previous, true);
        r_claimed := false;
        r_in_progress := true;
        RETURN NEXT;
        RETURN;
    END;
    PERFORM set_config('lock_timeout', v_previous, true);
    IF r_claimed THEN
        RETURN NEXT;
        RETURN;
    END IF;
    -- Read committed: this statement's fresh snapshot sees the row we just waited for.
    RETURN QUERY
        SELECT false, i.lease_expires_at IS NOT NULL, i.processed_at, i.message_id, i.outcome,
               i.rejection, NULL::text
        FROM inbox AS i
        WHERE i.consumer = p_consumer AND i.key = p_key;
END
$fn$;

-- Takes a lease on (consumer, key) for p_ttl_us microseconds, in one autocommit call.
--
-- r_state: 'leased' (r_token, r_expires_at; r_previous_token when an expired lease was taken
-- over), 'duplicate' (the stored record), 'in_progress' (r_expires_at, r_remaining_us: how
-- long the live lease has left, by the database clock), or 'contended' (the row changed under
-- every attempt; the caller gets a retryable error).
--
-- A consumed key or a live lease is answered by a plain read: no write, no WAL. Only an
-- absent key or an expired lease is written, each with a guarded statement; when that
-- statement finds the row changed (a concurrent lease, takeover, completion or release), the
-- loop reads again with a new snapshot. Each round is progress by another session; the loop
-- is bounded all the same.
CREATE FUNCTION inbox_lease(
    p_consumer   text,
    p_key        text,
    p_message_id text,
    p_ttl_us     bigint
)
RETURNS TABLE (
    r_state          text,
    r_token          bigint,
    r_previous_token bigint,
    r_expires_at     timestamptz,
    r_remaining_us   bigint,
    r_processed_at   timestamptz,
    r_message_id     text,
    r_outcome        jsonb,
    r_rejection      text
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
DECLARE
    v_ttl   interval := p_ttl_us * interval '1 microsecond';
    v_row   inbox%ROWTYPE;
    v_round integer;
BEGIN
    IF p_ttl_us IS NULL OR p_ttl_us < 1 THEN
        RAISE EXCEPTION 'pgbox: lease ttl must be positive' USING ERRCODE = '22023';
    END IF;
    FOR v_round IN 1..4 LOOP
        SELECT * INTO v_row FROM inbox AS i WHERE i.consumer = p_consumer AND i.key = p_key;
        IF NOT FOUND THEN
            INSERT INTO inbox AS i (consumer, key, message_id, lease_token, lease_expires_at)
            VALUES (p_consumer, p_key, p_message_id, nextval('inbox_lease_token_seq'), now() + v_ttl)
            ON CONFLICT (consumer, key) DO NOTHING
            RETURNING i.lease_token, i.lease_expires_at INTO r_token, r_expires_at;
            IF FOUND THEN
                r_state := 'leased';
                RETURN NEXT;
                RETURN;
            END IF;
        ELSIF v_row.lease_expires_at IS NULL THEN
            r_state := 'duplicate';
            r_processed_at := v_row.processed_at;
            r_message_id := v_row.message_id;
            r_outcome := v_row.outcome;
            r_rejection := v_row.rejection;
            RETURN NEXT;
            RETURN;
        ELSIF v_row.lease_expires_at > now() THEN
            r_state := 'in_progress';
            r_expires_at := v_row.lease_expires_at;
            r_remaining_us := floor(extract(epoch FROM v_row.lease_expires_at - now()) * 1000000);
            RETURN NEXT;
            RETURN;
        ELSE
            -- Expired: take it over, only from the lease we read (the token is unique), and
            -- only while it is still expired. The new token is drawn after the row lock, so
            -- it exceeds the old one; greatest() keeps that true even if the sequence was
            -- ever set back (a restore, a switchover that does not carry sequences).
            UPDATE inbox AS i
            SET lease_token = greatest(nextval('inbox_lease_token_seq'), i.lease_token + 1),
                lease_expires_at = now() + v_ttl,
                processed_at = now(),
                message_id = p_message_id
            WHERE i.consumer = p_consumer AND i.key = p_key
              AND i.lease_token = v_row.lease_token
              AND i.lease_expires_at IS NOT NULL AND i.lease_expires_at <= now()
            RETURNING i.lease_token, i.lease_expires_at INTO r_token, r_expires_at;
            IF FOUND THEN
                r_state := 'leased';
                r_previous_token := v_row.lease_token;
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
    END LOOP;
    r_state := 'contended';
    RETURN NEXT;
END
$fn$;
