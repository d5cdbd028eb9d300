-- Re-pin the functions' search_path: the migrator now runs with `search_path = <schema>,
-- pg_temp`, so a session's temporary table named like a pgbox table can never shadow it.
ALTER FUNCTION inbox_claim_bounded(text, text, text, text) SET search_path FROM CURRENT;
ALTER FUNCTION outbox_notify() SET search_path FROM CURRENT;
ALTER FUNCTION queue_notify() SET search_path FROM CURRENT;

-- Retention purges run per consumer and by age: (consumer, processed_at) serves
-- `WHERE consumer = $1 AND processed_at < $2 ORDER BY processed_at` directly, where the old
-- processed_at-only index walked every other consumer's old rows too.
CREATE INDEX inbox_consumer_processed_at_idx ON inbox (consumer, processed_at);
DROP INDEX inbox_processed_at_idx;
