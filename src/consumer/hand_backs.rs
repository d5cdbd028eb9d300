//! The consumer runner's hand-backs, counted in the inbox's database (`hand_backs`, V20):
//! deliveries handed back without running the handler (a limit waited too long, the key in
//! progress or leased elsewhere). The transport counts them as deliveries, each its own way
//! (NATS cannot take one back), so every instance records its hand-backs here, and the one
//! about to dead-letter a message reads how many of its deliveries were hand-backs. Only
//! the rare paths touch the table: a hand-back (one upsert), a delivery about to be
//! dead-lettered (one read). The janitor deletes rows not handed back for [`RETENTION`]; a
//! dead letter keeps its row, so that another copy of the message (the same id) counts
//! them too: one count per message id, not per copy, errs on more attempts, never fewer.

use std::time::Duration;

use sqlx::PgPool;

use crate::error::Result;
use crate::ident::Identifier;
use crate::pooler::Pooler;

/// How long a message's hand-backs are remembered after its last one: a week, far beyond
/// the longest visibility timeout and backoff; the janitor deletes older rows. A message
/// redelivered after that counts its earlier hand-backs as the transport does.
pub(crate) const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The statements on one schema's `hand_backs`.
#[derive(Debug)]
pub(super) struct HandBacks {
    record: String,
    count: String,
    pooler: Pooler,
}

impl HandBacks {
    pub(super) fn new(schema: &str, pooler: Pooler) -> Result<Self> {
        let s = Identifier::new("schema", schema)?;
        Ok(HandBacks {
            // Not waiting for the WAL flush (for this statement's transaction alone, as the
            // rate limits' take): a hand-back lost in a server crash only counts as the
            // transport counts it.
            record: format!(
                "WITH up AS (\
                   INSERT INTO {s}.hand_backs AS h (consumer, message_id, count, at) \
                   VALUES ($1, $2, 1, pg_catalog.now()) \
                   ON CONFLICT (consumer, message_id) DO UPDATE \
                   SET count = h.count OPERATOR(pg_catalog.+) 1, at = pg_catalog.now() \
                   RETURNING 1) \
                 SELECT pg_catalog.set_config('synchronous_commit', 'off', true) FROM up"
            ),
            count: format!(
                "SELECT count FROM {s}.hand_backs \
                  WHERE consumer OPERATOR(pg_catalog.=) $1 AND message_id OPERATOR(pg_catalog.=) $2"
            ),
            pooler,
        })
    }

    /// One more hand-back of message `id` by `consumer`.
    pub(super) async fn record(&self, pool: &PgPool, consumer: &str, id: uuid::Uuid) -> Result<()> {
        // Behind a transaction pooler, a transaction of its own (its setting ends with it).
        let mut unit = self.pooler.unit(pool).await?;
        sqlx::query(sqlx::AssertSqlSafe(self.record.as_str()))
            .bind(consumer)
            .bind(id)
            .persistent(self.pooler.persistent())
            .execute(&mut *unit)
            .await?;
        unit.finish().await
    }

    /// How many hand-backs of message `id` by `consumer` every instance recorded.
    pub(super) async fn count(&self, pool: &PgPool, consumer: &str, id: uuid::Uuid) -> Result<i32> {
        let mut unit = self.pooler.unit(pool).await?;
        let n: Option<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(self.count.as_str()))
            .bind(consumer)
            .bind(id)
            .persistent(self.pooler.persistent())
            .fetch_optional(&mut *unit)
            .await?;
        unit.finish().await?;
        Ok(n.unwrap_or(0))
    }
}

/// The janitor's purge, one batch: rows whose last hand-back is older than `$1` seconds, at
/// most `$2`, oldest first (walking `hand_backs_at_idx`).
pub(crate) fn purge_batch_sql(s: &Identifier) -> String {
    format!(
        "DELETE FROM {s}.hand_backs WHERE ctid = ANY(ARRAY(\
           SELECT ctid FROM {s}.hand_backs \
           WHERE at < pg_catalog.now() - pg_catalog.make_interval(secs => $1) \
           ORDER BY at LIMIT $2 FOR UPDATE SKIP LOCKED)) \
           AND at < pg_catalog.now() - pg_catalog.make_interval(secs => $1)"
    )
}
