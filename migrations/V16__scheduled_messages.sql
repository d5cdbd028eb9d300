-- Scheduled messages: written in the producer's transaction, held here until they are due,
-- then moved into `outbox` (table outbox: by the Relay, under the key's enqueue lock) or
-- emitted into the WAL (WAL outbox: by the WalRelay, the delete and the emit in one
-- transaction). The `outbox` table and its claim are not touched: no due-time column or index
-- there, so the immediate path costs what it did.
CREATE TABLE outbox_scheduled (
    -- Scheduling order: the tie-break among messages due at the same time. A replacement
    -- under a schedule key keeps the row, and so its place.
    sched_seq     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Assigned at enqueue (UUIDv7), kept through promotion.
    message_id    uuid        NOT NULL,
    topic         text        NOT NULL,
    ordering_key  text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- Database clock: not promoted before this.
    due_at        timestamptz NOT NULL,
    -- At most one pending message per (topic, schedule_key).
    schedule_key  text
);

-- Promotion walks the due rows in due order; the relay's sleep reads the earliest.
CREATE INDEX outbox_scheduled_due_idx ON outbox_scheduled (due_at, sched_seq);
CREATE UNIQUE INDEX outbox_scheduled_key_idx ON outbox_scheduled (topic, schedule_key)
    WHERE schedule_key IS NOT NULL;
