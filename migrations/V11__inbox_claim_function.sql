-- The unbounded claim as one function call, so that a claim and the reading of a duplicate's
-- record cost one statement, and so that the claim can travel in the same message as BEGIN
-- (`Inbox::process_and_commit`).
--
-- Exactly one row comes back:
-- - claimed: r_claimed true, with the claiming transaction's id (xid8 as text);
-- - a committed row holds the key: r_claimed false and that row's record (r_in_progress true
--   for a key under a lease, lease mode's CONSUMING);
-- - the committed row that held the key is gone by the time it is read (purged, or a lease
--   released, between the two statements): every column NULL, reported as a concurrent claim
--   to retry.
--
-- Each statement of a plpgsql function takes a new snapshot under READ COMMITTED, so the
-- read sees a row committed while the INSERT waited on it. Under REPEATABLE READ or
-- SERIALIZABLE the INSERT raises a serialization failure instead, as a bare INSERT does.
-- No EXCEPTION block: a duplicate starts no subtransaction and assigns no transaction id.
CREATE FUNCTION inbox_claim(
    p_consumer     text,
    p_key          text,
    p_message_id   text,
    OUT r_claimed      boolean,
    OUT r_in_progress  boolean,
    OUT r_processed_at timestamptz,
    OUT r_message_id   text,
    OUT r_outcome      jsonb,
    OUT r_rejection    text,
    OUT r_xact         text
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    INSERT INTO inbox AS i (consumer, key, message_id)
    VALUES (p_consumer, p_key, p_message_id)
    ON CONFLICT (consumer, key) DO NOTHING
    RETURNING true, false, i.processed_at, i.message_id, pg_current_xact_id()::text
    INTO r_claimed, r_in_progress, r_processed_at, r_message_id, r_xact;
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT false, i.lease_expires_at IS NOT NULL, i.processed_at, i.message_id, i.outcome,
           i.rejection
    INTO r_claimed, r_in_progress, r_processed_at, r_message_id, r_outcome, r_rejection
    FROM inbox AS i
    WHERE i.consumer = p_consumer AND i.key = p_key;
END
$fn$;

COMMENT ON FUNCTION inbox_claim(text, text, text) IS
    'pgbox: claim a key, or read the record of the committed row holding it, in one call';
