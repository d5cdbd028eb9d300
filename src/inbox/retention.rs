//! Retention: delete old inbox rows in bounded, index-backed batches.

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool};

use super::Inbox;
use crate::error::{Error, Result};
use crate::ident::Identifier;

/// Rows deleted per statement by [`Inbox::purge_older_than`]: small enough to keep each
/// transaction short and its locks few, large enough to purge millions of rows quickly.
pub const PURGE_BATCH_ROWS: i64 = 5_000;

impl Inbox {
    /// Deletes this consumer's rows recorded more than `older_than` ago (database clock),
    /// in batches of [`PURGE_BATCH_ROWS`], each its own short transaction. Returns the number
    /// of rows deleted. Works behind a pooler in transaction mode when the inbox is built with
    /// [`Pooler::Transaction`](crate::Pooler::Transaction).
    ///
    /// A message redelivered after its row is purged is processed again: `older_than` must
    /// exceed the longest redelivery window (broker retries, dead-letter replays, producer
    /// re-sends). Rows claimed by in-flight transactions are never touched, since they are
    /// not yet committed.
    ///
    /// Lease mode's rows are covered: a completed lease by its completion time; a CONSUMING
    /// row (an abandoned lease) only once its lease has expired, by the time it was leased or
    /// taken over. A live lease is never purged. Purging an expired lease only forgets the
    /// mark: the next delivery leases the key anew, with a larger fencing token.
    pub async fn purge_older_than(&self, pool: &PgPool, older_than: Duration) -> Result<u64> {
        if older_than.is_zero() {
            return Err(Error::InvalidConfig(
                "purge retention must be greater than zero".into(),
            ));
        }
        let sql = purge_batch_sql(&self.inner.schema);
        let mut total = 0;
        loop {
            // Behind a transaction pooler, each batch in a transaction of its own and unnamed:
            // an autocommit statement with parameters may be split across server connections.
            let mut unit = self.inner.pooler.unit(pool).await?;
            let deleted = sqlx::query(AssertSqlSafe(sql.clone()))
                .persistent(self.inner.persistent())
                .bind(&self.inner.consumer)
                .bind(older_than.as_secs_f64())
                .bind(PURGE_BATCH_ROWS)
                .execute(&mut *unit)
                .await?
                .rows_affected();
            unit.finish().await?;
            total += deleted;
            if deleted < PURGE_BATCH_ROWS as u64 {
                break;
            }
        }
        tracing::info!(consumer = %self.inner.consumer, deleted = total, ?older_than, "pgbox inbox purged");
        Ok(total)
    }
}

/// One purge batch of the inbox in `schema`: `$1` consumer, `$2` age in seconds, `$3` rows at
/// most. Shared by [`Inbox::purge_older_than`] and the janitor.
///
/// The ctid subquery walks inbox_consumer_processed_at_idx (a live lease is filtered out, and
/// rechecked under the row lock if it changes meanwhile); SKIP LOCKED leaves rows that a
/// concurrent purge is deleting to that purge.
pub(crate) fn purge_batch_sql(schema: &Identifier) -> String {
    let schema = schema.quoted();
    format!(
        "DELETE FROM {schema}.inbox WHERE ctid = ANY(ARRAY(\
           SELECT ctid FROM {schema}.inbox \
           WHERE processed_at < pg_catalog.now() - pg_catalog.make_interval(secs => $2) AND consumer = $1 \
             AND (lease_expires_at IS NULL OR lease_expires_at <= pg_catalog.now()) \
           ORDER BY processed_at LIMIT $3 FOR UPDATE SKIP LOCKED))"
    )
}
