//! Batch claims: deduplicate many keys in one statement.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, Postgres, Transaction};

use super::{Inbox, Key};
use crate::error::Result;

/// The plain batch claim's savepoint (see [`Inbox::claim_batch`]).
const SAVEPOINT: &str = "SAVEPOINT pgbox_claim_batch";
const RELEASE: &str = "RELEASE SAVEPOINT pgbox_claim_batch";
const ROLLBACK_TO: &str =
    "ROLLBACK TO SAVEPOINT pgbox_claim_batch; RELEASE SAVEPOINT pgbox_claim_batch";

impl Inbox {
    /// Claims every key on the caller's transaction: a plain `INSERT … SELECT unnest(…)` in
    /// a savepoint (three statements for the whole batch), falling back to
    /// `ON CONFLICT DO NOTHING RETURNING` when the batch holds a key already recorded. A key
    /// held by a live or expired lease (lease mode), or released or purged while the batch
    /// was being claimed, fails the call with
    /// [`Error::KeyInProgress`](crate::Error::KeyInProgress): roll back and retry later.
    /// Returns, per input key and in input order, whether this
    /// transaction claimed it: `false` means it was already recorded, or it repeats an
    /// earlier key of the same batch.
    ///
    /// For consumers that receive batches: claim the batch, apply the effects of the claimed
    /// ones, commit. Keys claimed concurrently by another transaction are waited for (the
    /// inbox's [`Wait`](crate::Wait) setting does not apply here). Every key is validated
    /// before anything is sent.
    ///
    /// If this future is dropped before it returns (a timeout, `select!`), roll the
    /// transaction back: some of the batch's claims may be in it, and committing them would
    /// record keys whose effects never ran.
    pub async fn claim_batch<'k, K>(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<Vec<bool>>
    where
        K: Into<Key<'k>>,
    {
        let keys: Vec<Key<'k>> = keys.into_iter().map(Into::into).collect();
        for key in &keys {
            key.validate()?;
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let key_strs = keys.iter().map(Key::as_str).collect::<Vec<_>>();
        let message_ids = keys.iter().map(Key::message_id).collect::<Vec<_>>();
        if self.inner.partitioned {
            // One function call: the keys' locks in a fixed order, then one INSERT of the
            // keys no partition (and no record of the plain inbox) holds.
            let claimed: Vec<String> =
                sqlx::query_scalar(AssertSqlSafe(self.inner.sql.claim_batch.clone()))
                    .persistent(self.inner.persistent())
                    .bind(&self.inner.consumer)
                    .bind(&key_strs)
                    .bind(&message_ids)
                    .fetch_all(&mut **tx)
                    .await
                    .map_err(|e| self.partitioned_batch_error(e.into()))?;
            return Ok(self.report_batch(&keys, claimed));
        }
        // The common batch has no duplicate: a plain INSERT is a third cheaper than
        // `ON CONFLICT DO NOTHING` (no speculative insertion). It runs in a savepoint, so
        // that a duplicate (a unique violation) rolls back only the attempt; then the
        // conflict-tolerant statement decides key by key.
        //
        // The savepoint is pgbox's own statements, not sqlx's nested `begin`: sqlx 0.9.0's,
        // dropped while its SAVEPOINT awaits the server's answer, queues a top-level
        // ROLLBACK and forgets the caller's transaction, whose `commit()` then answers `Ok`
        // having committed nothing. Dropped here, at worst a savepoint is left in the
        // caller's transaction, which its commit or rollback ends.
        let plain = {
            sqlx::raw_sql(SAVEPOINT).execute(&mut **tx).await?;
            let inserted = sqlx::query(AssertSqlSafe(self.inner.sql.claim_batch_plain.clone()))
                .persistent(self.inner.persistent())
                .bind(&self.inner.consumer)
                .bind(&key_strs)
                .bind(&message_ids)
                .execute(&mut **tx)
                .await;
            match inserted {
                Ok(_) => {
                    sqlx::raw_sql(RELEASE).execute(&mut **tx).await?;
                    true
                }
                Err(e) => {
                    let e = crate::Error::from(e);
                    if e.db_kind() != Some(crate::DbErrorKind::UniqueViolation) {
                        return Err(super::partitions::layout_error(e));
                    }
                    sqlx::raw_sql(ROLLBACK_TO).execute(&mut **tx).await?;
                    false
                }
            }
        };
        let claimed: Vec<String> = if plain {
            key_strs.iter().map(|k| (*k).to_owned()).collect()
        } else {
            let claimed: Vec<String> =
                sqlx::query_scalar(AssertSqlSafe(self.inner.sql.claim_batch.clone()))
                    .persistent(self.inner.persistent())
                    .bind(&self.inner.consumer)
                    .bind(&key_strs)
                    .bind(&message_ids)
                    .fetch_all(&mut **tx)
                    .await?;
            // A key the batch did not claim is reported `false` ("already recorded") only on
            // positive evidence: a committed row without a lease. A key held by a lease (lease
            // mode, not finished), or one whose lease was released or whose row was purged
            // since the statement above, is neither new nor done: reporting it as done would
            // ack its message before its effect happened. The caller retries.
            let unsettled: Option<String> =
                sqlx::query_scalar(AssertSqlSafe(self.inner.sql.batch_unsettled.clone()))
                    .persistent(self.inner.persistent())
                    .bind(&self.inner.consumer)
                    .bind(&key_strs)
                    .bind(&claimed)
                    .fetch_optional(&mut **tx)
                    .await?;
            if let Some(key) = unsettled {
                return Err(crate::Error::KeyInProgress {
                    consumer: self.inner.consumer.clone(),
                    key,
                });
            }
            claimed
        };
        Ok(self.report_batch(&keys, claimed))
    }

    /// The partitioned batch claim's refusal of a key under a lease taken before the switch
    /// (SQLSTATE 55006, the key in the detail) is the plain layout's `KeyInProgress`.
    fn partitioned_batch_error(&self, e: crate::Error) -> crate::Error {
        if let crate::Error::Database {
            source: sqlx::Error::Database(db),
            ..
        } = &e
            && db.code().as_deref() == Some("55006")
            && db
                .message()
                .starts_with("pgbox: a key of the batch is under a lease")
            && let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        {
            return crate::Error::KeyInProgress {
                consumer: self.inner.consumer.clone(),
                key: pg.detail().unwrap_or_default().to_owned(),
            };
        }
        super::partitions::layout_error(e)
    }

    /// Per input key, whether it is among `claimed` (a repeated key counts once).
    fn report_batch(&self, keys: &[Key<'_>], claimed: Vec<String>) -> Vec<bool> {
        let mut fresh: HashSet<String> = claimed.into_iter().collect();
        let result: Vec<bool> = keys.iter().map(|k| fresh.remove(k.as_str())).collect();
        let new = result.iter().filter(|c| **c).count();
        tracing::debug!(
            consumer = %self.inner.consumer,
            keys = keys.len(),
            claimed = new,
            duplicates = keys.len() - new,
            "pgbox batch claimed"
        );
        result
    }
}
