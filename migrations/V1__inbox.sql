-- pgbox inbox: one row per (consumer, key) that a consumer has finished with.
--
-- Unqualified names resolve to the pgbox schema: the migrator runs every migration with
-- `SET LOCAL search_path` pointing at it (see `pgbox::Migrator`).
--
-- No serial column: `INSERT ... ON CONFLICT DO NOTHING` would burn a sequence value on every
-- duplicate. The primary key is the dedup arbiter.
CREATE TABLE inbox (
    consumer     text        NOT NULL,
    key          text        NOT NULL,
    -- Database clock (transaction start), never the application host's.
    processed_at timestamptz NOT NULL DEFAULT now(),
    -- The broker's message id, for diagnostics only: dedup is by (consumer, key).
    message_id   text,
    -- What the handler returned (JSON), handed back to every duplicate.
    outcome      jsonb,
    -- Set when the handler rejected the message for good.
    rejection    text,
    CONSTRAINT inbox_pkey PRIMARY KEY (consumer, key)
);

-- Retention purges delete by age: `WHERE processed_at < $cutoff` in bounded batches.
CREATE INDEX inbox_processed_at_idx ON inbox (processed_at);

COMMENT ON TABLE inbox IS 'pgbox: messages each consumer has processed or rejected';

-- Claim with a bounded wait, in one round trip. A concurrent, uncommitted claim of the same
-- key makes the INSERT wait on the unique index; `lock_timeout` bounds that wait, and the
-- exception block (a subtransaction) turns the timeout into "in progress" without aborting
-- the caller's transaction. The caller's own lock_timeout is restored before returning.
CREATE FUNCTION inbox_claim_bounded(
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
    r_rejection    text
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
        RETURNING true, false, i.processed_at, i.message_id
        INTO r_claimed, r_in_progress, r_processed_at, r_message_id;
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
        SELECT false, false, i.processed_at, i.message_id, i.outcome, i.rejection
        FROM inbox AS i
        WHERE i.consumer = p_consumer AND i.key = p_key;
END
$fn$;
