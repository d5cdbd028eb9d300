-- Least-privilege roles and a pinned search_path for every pgbox function.
--
-- 1. Two functions ran with the caller's search_path: `partitioned_inbox_check_isolation`
--    (V12) and `partitioned_inbox_lock_id` (V10). A caller whose path puts another schema
--    ahead of pg_catalog (`SET search_path = evil, pg_catalog, public`) could make them call
--    that schema's `current_setting`, `upper`, `length` or `hashtextextended`. The first is
--    pinned like every other pgbox function (the migration's path: the pgbox schema, then
--    pg_temp; pg_catalog is then searched first). The second is a SQL function that
--    PostgreSQL inlines into the batch claim; a SET clause would stop that, so its body names
--    pg_catalog's functions and operators instead (the same functions: the same lock ids).
ALTER FUNCTION partitioned_inbox_check_isolation() SET search_path FROM CURRENT;

CREATE OR REPLACE FUNCTION partitioned_inbox_lock_id(p_consumer text, p_key text)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.hashtextextended(
          pg_catalog.length(p_consumer)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
          OPERATOR(pg_catalog.||) p_consumer OPERATOR(pg_catalog.||) p_key, 7062) $$;

-- 2. Creating partitions ahead as the application role. Creating a table in the schema and
--    attaching it to `partitioned_inbox` need the schema's CREATE privilege and the
--    ownership of `partitioned_inbox`, which an application role should not have. This
--    function runs as its owner (the role that ran the migrations), takes no argument (it
--    creates the partitions the settings call for, around the database's clock: nothing a
--    caller chooses), and pins its search_path to the pgbox schema then pg_temp (pg_catalog
--    is searched first; pg_temp last, so a caller's temporary table shadows nothing). Only
--    roles named by `pgbox migrate --grant-to` may call it: PUBLIC's default EXECUTE is
--    revoked.
--
--    Dropping expired partitions is not offered this way: `DETACH PARTITION ... CONCURRENTLY`
--    (which lets claims go on) cannot run inside a function, and a plain DETACH would stop
--    every claim while it waits for its lock. Expiry stays with the owner of the table.
CREATE FUNCTION inbox_partitions_create_ahead()
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM inbox_partitions_create(pg_catalog.now());
END
$fn$;

REVOKE ALL ON FUNCTION inbox_partitions_create_ahead() FROM PUBLIC;
