-- Fan-out (`Router`): one outbox message, several destinations. A destination that does not
-- take its copy right away (down, refusing, slow, or holding the message's key) gets a
-- deferred delivery here; the router's own loop drains them. The outbox and its enqueue path
-- are not touched.

-- Each deferred message's payload, once, whatever the number of destinations waiting for it.
-- Deleted with its last delivery (under this row's lock: see the router's settle statements).
CREATE TABLE outbox_fanout_messages (
    message_id    uuid        PRIMARY KEY,
    -- The outbox row's seq (0 from the WAL relay), handed on unchanged.
    source_seq    bigint      NOT NULL,
    topic         text        NOT NULL,
    ordering_key  text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL
);

COMMENT ON TABLE outbox_fanout_messages IS 'pgbox: payloads of messages with deferred fan-out deliveries';

-- One row per (message, destination) not yet delivered. `id` is drawn in the order the
-- router deferred them (publication order per key): per destination and key, the lowest id
-- is the key's head there, and nothing behind it is delivered before it.
CREATE TABLE outbox_fanout_deliveries (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination   text        NOT NULL,
    message_id    uuid        NOT NULL REFERENCES outbox_fanout_messages (message_id),
    -- Copied from the message: the head lookup reads the index alone.
    topic         text        NOT NULL,
    ordering_key  text,
    -- Refusals by the destination; outages never count.
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    deferred_at   timestamptz NOT NULL DEFAULT now(),
    -- Not tried again before this (a refusal's backoff).
    available_at  timestamptz NOT NULL DEFAULT now(),
    -- Set at the router's max_attempts: the delivery waits for an operator, and holds its
    -- key at its destination only.
    dead_at       timestamptz,
    UNIQUE (destination, message_id)
);

COMMENT ON TABLE outbox_fanout_deliveries IS 'pgbox: deferred fan-out deliveries, one per message and destination';

-- The router's publish asks, per batch, which (destination, topic, key) have a delivery
-- pending; the drain asks whether a row has an earlier, blocked one of its key.
CREATE INDEX outbox_fanout_deliveries_key_idx
    ON outbox_fanout_deliveries (destination, topic, ordering_key, id)
    WHERE ordering_key IS NOT NULL;
-- The drain claims in id order per destination (the UNIQUE index serves lookups by message).
CREATE INDEX outbox_fanout_deliveries_claim_idx
    ON outbox_fanout_deliveries (destination, id);
