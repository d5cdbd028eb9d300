-- pgbox in-order processing: the highest sequence number each consumer has applied per
-- entity. Messages with seq <= last_seq are stale; seq = last_seq + 1 is next; anything
-- higher is a gap. Concurrent deliveries for one entity serialize on this row's lock.
CREATE TABLE sequence_watermarks (
    consumer   text        NOT NULL,
    entity     text        NOT NULL,
    last_seq   bigint      NOT NULL CHECK (last_seq >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT sequence_watermarks_pkey PRIMARY KEY (consumer, entity)
);

COMMENT ON TABLE sequence_watermarks IS 'pgbox: per-entity sequence watermark of each consumer';
