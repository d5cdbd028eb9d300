//! Batch claims: deduplicate many keys in one statement.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, Postgres, Transaction};

use super::{Inbox, Key};
use crate::error::Result;

impl Inbox {
    /// Claims every key in one statement (`unnest` + `ON CONFLICT DO NOTHING RETURNING`) on
    /// the caller's transaction. Returns, per input key and in input order, whether this
    /// transaction claimed it: `false` means it was already recorded, or it repeats an
    /// earlier key of the same batch.
    ///
    /// For consumers that receive batches: claim the batch, apply the effects of the claimed
    /// ones, commit. Keys claimed concurrently by another transaction are waited for (the
    /// inbox's [`Wait`](crate::Wait) setting does not apply here). Every key is validated
    /// before anything is sent.
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
        let claimed: Vec<String> =
            sqlx::query_scalar(AssertSqlSafe(self.inner.sql.claim_batch.clone()))
                .bind(&self.inner.consumer)
                .bind(keys.iter().map(Key::as_str).collect::<Vec<_>>())
                .bind(keys.iter().map(Key::message_id).collect::<Vec<_>>())
                .fetch_all(&mut **tx)
                .await?;
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
        Ok(result)
    }
}
