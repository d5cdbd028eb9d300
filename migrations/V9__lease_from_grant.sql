-- Leases are granted for their whole TTL, counted from when the lease is granted.
--
-- V7's `inbox_lease` computed the expiry from now(), the time its statement started. A call
-- that waited on the key's row lock (behind a transactional claim of the same key that had
-- not committed yet, or a purge batch) came back `leased` with part of its TTL, or all of
-- it, already gone, and the next caller could take the key over at once: two holders
-- running the effect together. The expiry now counts from clock_timestamp() when the row is
-- written, and starts again if that write waited for a lock.

CREATE OR REPLACE FUNCTION inbox_lease(
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
    v_now   timestamptz;
BEGIN
    IF p_ttl_us IS NULL OR p_ttl_us < 1 THEN
        RAISE EXCEPTION 'pgbox: lease ttl must be positive' USING ERRCODE = '22023';
    END IF;
    -- Expiries are computed from clock_timestamp(), not now(): now() is when the statement
    -- started, and a call that waited on the row lock (behind a transactional claim of the
    -- same key, or a purge batch) would otherwise hand out a lease already partly or wholly
    -- expired, which the next caller could take over at once.
    FOR v_round IN 1..4 LOOP
        SELECT * INTO v_row FROM inbox AS i WHERE i.consumer = p_consumer AND i.key = p_key;
        v_now := clock_timestamp();
        IF NOT FOUND THEN
            INSERT INTO inbox AS i
                (consumer, key, message_id, lease_token, lease_expires_at, processed_at)
            VALUES (p_consumer, p_key, p_message_id, nextval('inbox_lease_token_seq'),
                    v_now + v_ttl, v_now)
            ON CONFLICT (consumer, key) DO NOTHING
            RETURNING i.lease_token, i.lease_expires_at INTO r_token, r_expires_at;
            IF FOUND THEN
                r_state := 'leased';
                EXIT;
            END IF;
        ELSIF v_row.lease_expires_at IS NULL THEN
            r_state := 'duplicate';
            r_processed_at := v_row.processed_at;
            r_message_id := v_row.message_id;
            r_outcome := v_row.outcome;
            r_rejection := v_row.rejection;
            RETURN NEXT;
            RETURN;
        ELSIF v_row.lease_expires_at > v_now THEN
            r_state := 'in_progress';
            r_expires_at := v_row.lease_expires_at;
            r_remaining_us := floor(extract(epoch FROM v_row.lease_expires_at - v_now) * 1000000);
            RETURN NEXT;
            RETURN;
        ELSE
            -- Expired: take it over, only from the lease we read (the token is unique), and
            -- only while it is still expired. The new token is drawn after the row lock, so
            -- it exceeds the old one; greatest() keeps that true even if the sequence was
            -- ever set back (a restore, a switchover that does not carry sequences).
            UPDATE inbox AS i
            SET lease_token = greatest(nextval('inbox_lease_token_seq'), i.lease_token + 1),
                lease_expires_at = v_now + v_ttl,
                processed_at = v_now,
                message_id = p_message_id
            WHERE i.consumer = p_consumer AND i.key = p_key
              AND i.lease_token = v_row.lease_token
              AND i.lease_expires_at IS NOT NULL AND i.lease_expires_at <= v_now
            RETURNING i.lease_token, i.lease_expires_at INTO r_token, r_expires_at;
            IF FOUND THEN
                r_state := 'leased';
                r_previous_token := v_row.lease_token;
                EXIT;
            END IF;
        END IF;
    END LOOP;
    IF r_state = 'leased' THEN
        -- The INSERT or UPDATE may have waited for a row lock after its expiry was
        -- computed: start the lease's time again from now (the row is ours, no wait), so
        -- that no lease is handed out shorter than asked.
        IF clock_timestamp() > v_now + interval '1 millisecond' THEN
            v_now := clock_timestamp();
            UPDATE inbox AS i
            SET lease_expires_at = v_now + v_ttl, processed_at = v_now
            WHERE i.consumer = p_consumer AND i.key = p_key AND i.lease_token = r_token
            RETURNING i.lease_expires_at INTO r_expires_at;
        END IF;
        RETURN NEXT;
        RETURN;
    END IF;
    r_state := 'contended';
    RETURN NEXT;
END
$fn$;
