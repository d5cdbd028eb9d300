-- The lease invariants leave the claim's hot path.
--
-- V7 added two CHECK constraints for lease mode's rows (a lease has a token; a row under a
-- lease has no outcome and no rejection). PostgreSQL evaluates every CHECK of a table on every
-- INSERT, and PostgreSQL 15 rebuilds each constraint's expression from its stored text for each
-- statement it runs in: measured with pgbench on this project's claim (one client, prepared,
-- asynchronous commit, five interleaved rounds), the two checks cost the bare claim about 9 %
-- of its rate, on rows that never have a lease.
--
-- Only pgbox's lease statements write the lease columns, and each sets or clears them
-- together. The invariants are now verified where they cost nothing on the claim: `pgbox
-- doctor` (check `inbox_leases`) looks for a row that breaks them, through the partial index
-- that holds only rows under a lease. Dropping a constraint takes a brief ACCESS EXCLUSIVE
-- lock and rewrites nothing.
ALTER TABLE inbox DROP CONSTRAINT IF EXISTS inbox_lease_has_token;
ALTER TABLE inbox DROP CONSTRAINT IF EXISTS inbox_lease_has_no_outcome;
