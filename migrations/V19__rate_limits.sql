-- Rate limits of the consumer runner (`Limit::rate`): one row per (limit, prefix), shared by
-- every runner instance, as a generic cell rate algorithm. `tat` is the theoretical arrival
-- time: a take is allowed when, after it, `tat` is no more than `burst` emission intervals
-- ahead of now; it then advances by one interval. A row whose `tat` has passed is a full
-- bucket, exactly as if the row did not exist, so such rows may be deleted at any time (the
-- runners sweep their own limit's rows): quiet prefixes leave nothing behind.
CREATE TABLE rate_limits (
    name    text        NOT NULL,
    -- The prefix's bytes (empty for a global limit): any string a prefix function returns.
    prefix  bytea       NOT NULL,
    tat     timestamptz NOT NULL,
    PRIMARY KEY (name, prefix)
);

COMMENT ON TABLE rate_limits IS 'pgbox: consumer rate limits, one token bucket per limit and prefix';
