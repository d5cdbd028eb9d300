-- The queue's key index holds keyed rows only, as the outbox's has since V6. Receive looks a
-- key up only for a keyed row (`p.ordering_key = o.ordering_key`, never true for NULL), so
-- an unkeyed message, the common case, no longer pays an entry in it: one index entry fewer
-- on every publish into the queue and on every delivery's update.
DROP INDEX queue_key_idx;
CREATE INDEX queue_key_idx ON queue (topic, ordering_key, seq) WHERE ordering_key IS NOT NULL;
