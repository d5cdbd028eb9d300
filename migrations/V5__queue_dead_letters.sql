-- The built-in queue's dead letters hold their ordering key, like the outbox's: while a
-- message of a key is here, later messages of that key are not delivered. Receive looks up
-- each keyed candidate's (topic, ordering_key) in this index; replay moves the message back
-- into the queue under its original seq, ahead of the messages it held back; discard deletes
-- it and releases the key. The index also serves the per-topic dead-letter count of status.
CREATE INDEX queue_dead_letters_key_idx ON queue_dead_letters (topic, ordering_key);

-- Operators name dead letters by message id (list, show, replay, discard).
CREATE INDEX queue_dead_letters_message_id_idx ON queue_dead_letters (message_id);
