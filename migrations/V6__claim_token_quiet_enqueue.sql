-- A claim token identifies the claiming transaction exactly: the bounded claim now also
-- returns the transaction's 64-bit id (`pg_current_xact_id()`, never reused), which the
-- outcome and rejection updates compare against. Evaluated only when the INSERT wrote a
-- row, so a duplicate still assigns no transaction id.
DROP FUNCTION inbox_claim_bounded(text, text, text, text);

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
        SELECT false, false, i.processed_at, i.message_id, i.outcome, i.rejection, NULL::text
        FROM inbox AS i
        WHERE i.consumer = p_consumer AND i.key = p_key;
END
$fn$;

-- No NOTIFY per producing transaction: every notifying commit takes PostgreSQL's global
-- notify lock, which serialises producers. The enqueue statements notify only while a relay
-- sleeps (see `ASLEEP_LOCK_CLASS` in src/outbox/mod.rs).
DROP TRIGGER outbox_notify ON outbox;
DROP FUNCTION outbox_notify();

-- The queue's receive, as a function so that its plan can be pinned. The cheap plan walks
-- `queue_topic_idx` in seq order and stops after `p_max` deliverable rows (keyed rows only
-- when they are their key's oldest and the key has no dead letter). With stale statistics
-- (a queue's size swings faster than ANALYZE follows) the planner would rather read every
-- row of the topic and sort them, which costs 100 ms per receive at 8,000 queued rows; the
-- function's own settings keep it on the index walk. Not inlined (it has SET clauses), so
-- the settings apply to its statement only.
CREATE FUNCTION queue_receive(p_topic text, p_max bigint, p_visibility float8)
RETURNS SETOF queue
LANGUAGE sql
SET search_path FROM CURRENT
SET enable_bitmapscan = off
SET enable_sort = off
SET enable_seqscan = off
SET jit = off
AS $fn$
    UPDATE queue AS q
    SET visible_at = now() + make_interval(secs => p_visibility), deliveries = q.deliveries + 1
    WHERE q.seq IN (
        SELECT o.seq FROM queue AS o
        WHERE o.topic = p_topic AND o.visible_at <= now()
          AND (o.ordering_key IS NULL OR (
            NOT EXISTS (SELECT 1 FROM queue AS p
              WHERE p.topic = o.topic AND p.ordering_key = o.ordering_key AND p.seq < o.seq)
            AND NOT EXISTS (SELECT 1 FROM queue_dead_letters AS d
              WHERE d.topic = o.topic AND d.ordering_key = o.ordering_key)))
        ORDER BY o.seq LIMIT p_max FOR UPDATE SKIP LOCKED)
    RETURNING q.*
$fn$;

-- Rows waiting out a publish backoff: the failed heads of their keys, a handful at any time.
-- The relay reads them once per round to hold their keys back.
CREATE INDEX outbox_backoff_idx ON outbox (topic, ordering_key) WHERE attempts > 0 AND published_at IS NULL;

-- Keyed rows are drained by one relay at a time (the holder of a per-round advisory lock);
-- the others take unkeyed rows only, through their own index. The key index now holds keyed
-- rows only, so an unkeyed row still costs the same number of index entries.
CREATE INDEX outbox_unkeyed_idx ON outbox (seq) WHERE published_at IS NULL AND ordering_key IS NULL;
DROP INDEX outbox_key_idx;
CREATE INDEX outbox_key_idx ON outbox (topic, ordering_key, seq)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;
