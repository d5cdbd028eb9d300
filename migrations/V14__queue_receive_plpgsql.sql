-- The queue's receive, unchanged in what it does (V6), now in PL/pgSQL. A SQL function that
-- is not inlined (this one has SET clauses, which pin its plan) is planned again on every
-- call; PL/pgSQL keeps the statement's plan for the session. At eight messages per receive
-- the planning was about a third of the statement's time. The search path is pinned as
-- before (pg_catalog is searched first, ahead of the pgbox schema).
CREATE OR REPLACE FUNCTION queue_receive(p_topic text, p_max bigint, p_visibility float8)
RETURNS SETOF queue
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off
SET enable_sort = off
SET enable_seqscan = off
SET jit = off
AS $fn$
BEGIN
    RETURN QUERY
    UPDATE queue AS q
    SET visible_at = now() + make_interval(secs => p_visibility), deliveries = q.deliveries + 1
    WHERE q.seq IN (
        SELECT o.seq FROM queue AS o
        WHERE o.topic = p_topic AND o.visible_at <= now()
          AND (o.ordering_key IS NULL OR (
            NOT EXISTS (SELECT 1 FROM queue AS p
              WHERE p.topic = o.topic AND p.ordering_key = o.ordering_key AND p.seq < o.seq)
            AND NOT EXISTS (SELECT 1 FROM queue_dead_letters AS d
              WHERE d.topic = o.topic AND d.ordering_key = o.ordering_key)))
        ORDER BY o.seq LIMIT p_max FOR UPDATE SKIP LOCKED)
    RETURNING q.*;
END
$fn$;
