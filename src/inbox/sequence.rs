//! In-order processing per entity: a watermark of the highest sequence number applied.

use sqlx::{AssertSqlSafe, PgConnection, Postgres, Transaction};
use tracing::Instrument;

use super::{HandlerConnection, Inbox, Key, run_handler};
use crate::error::{Error, Result};

/// What [`Inbox::process_in_order`] does when a message's sequence number is beyond the next
/// expected one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GapPolicy {
    /// Return [`Sequenced::Gap`] without running the handler, so the caller redelivers the
    /// message later, after the missing ones. The default: nothing is ever skipped.
    #[default]
    Wait,
    /// Run the handler anyway and move the watermark to this message; the missing numbers
    /// become stale if they arrive later. For streams where only the latest state matters.
    SkipAhead,
}

/// The result of [`Inbox::process_in_order`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Sequenced<T> {
    /// The handler ran and the watermark moved to this message's number. `skipped` counts
    /// numbers jumped over under [`GapPolicy::SkipAhead`] (0 otherwise).
    Processed {
        /// What the handler returned.
        value: T,
        /// Sequence numbers skipped to get here.
        skipped: i64,
    },
    /// Already applied, or older than what was applied: nothing ran, nothing was written.
    /// Acknowledge it.
    Stale {
        /// The entity's watermark.
        watermark: i64,
    },
    /// Earlier numbers are missing: nothing ran. Redeliver it later.
    Gap {
        /// The sequence number the entity needs next.
        expected: i64,
    },
}

impl Inbox {
    /// Runs `handler` for message `seq` of `entity` only if it is the next one in order, on
    /// the caller's transaction, and advances the entity's watermark in that transaction.
    ///
    /// Sequence numbers start at 1 per entity. `seq <= watermark` is [`Sequenced::Stale`]
    /// (this doubles as deduplication: no inbox key is needed), `watermark + 1` runs the
    /// handler, and larger numbers follow the inbox's [`GapPolicy`]. Concurrent deliveries
    /// for one entity serialize on the watermark row; different entities never block each
    /// other. Handler errors and panics abort the transaction, as in [`Inbox::process`].
    pub async fn process_in_order<T, E, F>(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        entity: impl Into<Key<'_>>,
        seq: i64,
        handler: F,
    ) -> Result<Sequenced<T>, E>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> Result<T, E>,
        E: From<Error>,
    {
        let entity = entity.into();
        entity.validate()?;
        if seq < 1 {
            return Err(Error::InvalidSequence(seq).into());
        }
        let span = tracing::info_span!(
            "pgbox.inbox.in_order",
            consumer = %self.inner.consumer,
            entity = %entity.as_str(),
            seq,
        );
        async move {
            let (watermark, xact) = self.lock_watermark(tx, entity.as_str()).await?;
            let skipped = seq - watermark - 1;
            if skipped < 0 {
                tracing::info!(watermark, "pgbox stale sequence number skipped");
                return Ok(Sequenced::Stale { watermark });
            }
            if skipped > 0 && self.inner.gap_policy == GapPolicy::Wait {
                tracing::info!(
                    expected = watermark + 1,
                    "pgbox sequence gap; redeliver later"
                );
                return Ok(Sequenced::Gap {
                    expected: watermark + 1,
                });
            }
            // The watermark UPDATE right after doubles as the liveness check, and names the
            // transaction that locked the watermark: no row means the handler ended it.
            let (value, _) = run_handler(tx, self.inner.pooler, handler).await?;
            let advanced = sqlx::query(AssertSqlSafe(self.inner.sql.advance_watermark.clone()))
                .persistent(self.inner.persistent())
                .bind(&self.inner.consumer)
                .bind(entity.as_str())
                .bind(seq)
                .bind(&xact)
                .execute(&mut **tx)
                .await
                .map_err(|e| super::handler_aborted(Error::from(e)))?;
            if advanced.rows_affected() != 1 {
                tracing::error!("pgbox: the watermark's transaction was ended inside the handler");
                return Err(Error::TransactionEndedInHandler.into());
            }
            if skipped > 0 {
                tracing::warn!(skipped, "pgbox sequence gap skipped by policy");
            }
            tracing::debug!("pgbox in-order message processed");
            Ok(Sequenced::Processed { value, skipped })
        }
        .instrument(span)
        .await
    }

    /// Locks the entity's watermark row (creating it at 0 on first sight) and returns it,
    /// with the locking transaction's id.
    async fn lock_watermark(&self, conn: &mut PgConnection, entity: &str) -> Result<(i64, String)> {
        let lock = async |conn: &mut PgConnection| -> Result<Option<(i64, String)>> {
            Ok(
                sqlx::query_as(AssertSqlSafe(self.inner.sql.lock_watermark.clone()))
                    .persistent(self.inner.persistent())
                    .bind(&self.inner.consumer)
                    .bind(entity)
                    .fetch_optional(conn)
                    .await?,
            )
        };
        if let Some(watermark) = lock(conn).await? {
            return Ok(watermark);
        }
        // First message for this entity. A concurrent first delivery makes this insert wait
        // and then do nothing; either way the row exists afterwards.
        sqlx::query(AssertSqlSafe(self.inner.sql.create_watermark.clone()))
            .persistent(self.inner.persistent())
            .bind(&self.inner.consumer)
            .bind(entity)
            .execute(&mut *conn)
            .await?;
        lock(conn).await?.ok_or_else(|| Error::ConcurrentClaim {
            consumer: self.inner.consumer.clone(),
            key: entity.to_owned(),
        })
    }
}
