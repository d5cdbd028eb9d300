-- Deliveries the consumer runner handed back without running the handler (a limit waited
-- too long, the key in progress or leased elsewhere): not the message's failures, so not
-- counted toward `max_deliveries`. One row per (consumer, message id), written by whichever
-- runner instance handed the delivery back, read by the one about to dead-letter it, so that
-- the count holds across instances and restarts whatever the transport counts. `at` is the
-- last hand-back: the janitor deletes rows not handed back for a week (a dead letter keeps
-- its row: another copy of the message, the same id, counts it too).
CREATE TABLE hand_backs (
    consumer   text        NOT NULL,
    message_id uuid        NOT NULL,
    count      integer     NOT NULL,
    at         timestamptz NOT NULL,
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX hand_backs_at_idx ON hand_backs (at);

COMMENT ON TABLE hand_backs IS 'pgbox: consumer deliveries handed back uncounted, per consumer and message';
