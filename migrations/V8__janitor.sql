-- The janitor (`pgbox::janitor`) deletes old rows in small batches, each found through an
-- index and deleted by primary key, so that no batch scans a large table.
--
-- Audit mode (`Relay::keep_published(true)`) keeps published rows with `published_at` set;
-- the janitor purges them by age, oldest first. Partial: pending rows (published_at NULL)
-- are never in it, so enqueue and the relay's claim do not maintain it.
--
-- IF NOT EXISTS: building this index locks out writes to the outbox for as long as the build
-- takes. On a large audit-mode table, create it beforehand with the same name and
-- definition, `CREATE INDEX CONCURRENTLY outbox_published_idx ON <schema>.outbox
-- (published_at) WHERE published_at IS NOT NULL`, and this migration leaves it in place.
CREATE INDEX IF NOT EXISTS outbox_published_idx ON outbox (published_at) WHERE published_at IS NOT NULL;

-- Dead letters are purged by age only when the janitor is told to (they hold their ordering
-- keys). Both tables are usually small; the indexes keep each batch a bounded index walk
-- when they are not.
CREATE INDEX IF NOT EXISTS outbox_dead_letters_dead_at_idx ON outbox_dead_letters (dead_at);
CREATE INDEX IF NOT EXISTS queue_dead_letters_dead_at_idx ON queue_dead_letters (dead_at);
