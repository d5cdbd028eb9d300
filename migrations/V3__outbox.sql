-- pgbox outbox: messages written in the producer's business transaction, published by the
-- relay, then deleted (or kept, in audit mode, with published_at set).
CREATE TABLE outbox (
    -- Publication order. Per ordering key this is commit order: enqueue takes a transaction
    -- advisory lock on (topic, ordering_key), so two producers of one key serialize.
    seq           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Assigned at enqueue (UUIDv7), kept through every re-publish: the consumers' dedup key.
    message_id    uuid        NOT NULL UNIQUE,
    topic         text        NOT NULL,
    -- The entity the message is about; NULL for messages with no order to keep.
    ordering_key  text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- Retry backoff: not published before this.
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    -- Audit mode only: when the relay published it. Pending rows have NULL.
    published_at  timestamptz
);

-- Head-of-key lookups ("is there an earlier message of this key?") and per-topic status.
CREATE INDEX outbox_key_idx ON outbox (topic, ordering_key, seq) WHERE published_at IS NULL;
CREATE INDEX outbox_pending_idx ON outbox (seq) WHERE published_at IS NULL;
CREATE INDEX outbox_topic_idx ON outbox (topic, seq) WHERE published_at IS NULL;

-- Messages that failed every attempt. While one is here, later messages of its ordering key
-- are held back; replay moves it back (same seq, same message_id) ahead of them.
CREATE TABLE outbox_dead_letters (
    seq           bigint      PRIMARY KEY,
    message_id    uuid        NOT NULL UNIQUE,
    topic         text        NOT NULL,
    ordering_key  text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL,
    headers       jsonb       NOT NULL,
    created_at    timestamptz NOT NULL,
    attempts      integer     NOT NULL,
    last_error    text,
    dead_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_dead_letters_key_idx ON outbox_dead_letters (topic, ordering_key);

-- Wake relays when messages commit. Statement-level, and PostgreSQL folds identical
-- notifications of one transaction into one: one wake-up per transaction, not per row.
CREATE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.outbox', '');
    RETURN NULL;
END
$fn$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

-- The built-in transport: a durable queue per topic. The relay publishes into it; consumers
-- receive with a visibility timeout, ack (delete), or nack (delay). Deliveries count attempts
-- and fence late acks from an earlier delivery.
CREATE TABLE queue (
    seq           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    uuid        NOT NULL,
    topic         text        NOT NULL,
    ordering_key  text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL,
    headers       jsonb       NOT NULL,
    created_at    timestamptz NOT NULL,
    enqueued_at   timestamptz NOT NULL DEFAULT now(),
    visible_at    timestamptz NOT NULL DEFAULT now(),
    deliveries    integer     NOT NULL DEFAULT 0,
    last_error    text
);
CREATE INDEX queue_topic_idx ON queue (topic, seq);
CREATE INDEX queue_key_idx ON queue (topic, ordering_key, seq);

CREATE TABLE queue_dead_letters (
    seq           bigint      PRIMARY KEY,
    message_id    uuid        NOT NULL,
    topic         text        NOT NULL,
    ordering_key  text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL,
    headers       jsonb       NOT NULL,
    created_at    timestamptz NOT NULL,
    deliveries    integer     NOT NULL,
    last_error    text,
    dead_at       timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION queue_notify() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.queue', '');
    RETURN NULL;
END
$fn$;

CREATE TRIGGER queue_notify AFTER INSERT ON queue
    FOR EACH STATEMENT EXECUTE FUNCTION queue_notify();
