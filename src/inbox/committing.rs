//! [`Inbox::process_and_commit`]: pgbox owns the transaction, so BEGIN and the claim travel in
//! one message and the liveness check rides with COMMIT.
//!
//! A message through [`Inbox::process`] costs BEGIN, the claim, the handler's statements and
//! COMMIT, each a round trip. When pgbox opens the transaction itself, BEGIN and the claim go
//! to the server as one simple query (which carries no parameters: the consumer, key and
//! message id travel as escaped constants, see [`push_literal`]), and so do the liveness
//! check and COMMIT. A new message then costs one round trip fewer, and a duplicate costs two
//! (BEGIN with the claim, which reads the stored record in the same call; ROLLBACK).
//!
//! The transaction is invisible to sqlx's own bookkeeping, so a guard stands in for sqlx's
//! rollback-on-drop: a connection whose transaction was not ended (the future was dropped, a
//! handler panicked, COMMIT or ROLLBACK failed) is closed instead of going back to the pool,
//! and the server rolls the transaction back when the session ends.

use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres};
use tracing::Instrument;

use super::{
    Claim, HandlerConnection, Inbox, Key, Outcome, Verdict, handler_aborted, partitions,
    run_handler,
};
use crate::error::{Error, Result};
use crate::ident::push_literal;

impl Inbox {
    /// Opens a transaction on a connection from `pool`, claims `key`, runs `handler` and
    /// commits: [`process`](Self::process) with the transaction's ends handled by pgbox, one
    /// round trip cheaper for a new message and two for a duplicate.
    ///
    /// When it returns `Ok`, the transaction is over: committed for
    /// [`Outcome::Processed`] and [`Outcome::Rejected`], rolled back (nothing was written)
    /// for [`Outcome::Duplicate`] and [`Outcome::InProgress`]. Acknowledge the message then.
    /// On `Err`, nothing of it committed, except when COMMIT itself failed in flight (the
    /// connection dropped), when it may have: the redelivery is then settled by the inbox as
    /// usual.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool) -> Result<(), pgbox::Error> {
    /// let inbox = pgbox::Inbox::new("points")?;
    /// let outcome = inbox
    ///     .process_and_commit(&pool, "order-42", async |conn| {
    ///         sqlx::query("UPDATE accounts SET points = points + 10 WHERE id = 7")
    ///             .execute(&mut *conn)
    ///             .await?;
    ///         Ok::<_, pgbox::Error>(())
    ///     })
    ///     .await?;
    /// if outcome.should_ack() {
    ///     // ack the broker delivery
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// The transaction starts with a plain `BEGIN`: the server's default isolation level.
    /// Everything [`process`](Self::process) promises holds here too (handler errors and
    /// panics roll back, a swallowed failed statement is caught, invalid keys are refused
    /// before any SQL runs). If this future is dropped before it finishes, the connection is
    /// closed rather than returned to the pool, which rolls the transaction back.
    pub async fn process_and_commit<T, E, F>(
        &self,
        pool: &PgPool,
        key: impl Into<Key<'_>>,
        handler: F,
    ) -> std::result::Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> std::result::Result<T, E>,
        T: Serialize,
        E: From<Error>,
    {
        self.process_or_reject_and_commit(pool, key, async move |conn| {
            handler(conn).await.map(Verdict::Accept)
        })
        .await
    }

    /// [`process_or_reject`](Self::process_or_reject) in a transaction pgbox opens and commits,
    /// as [`process_and_commit`](Self::process_and_commit) does.
    pub async fn process_or_reject_and_commit<T, E, F>(
        &self,
        pool: &PgPool,
        key: impl Into<Key<'_>>,
        handler: F,
    ) -> std::result::Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> std::result::Result<Verdict<T>, E>,
        T: Serialize,
        E: From<Error>,
    {
        let key = key.into();
        key.validate()?;
        let begin_and_claim = self.begin_and_claim_sql(&key)?;
        let span = tracing::info_span!(
            "pgbox.inbox.process",
            consumer = %self.inner.consumer,
            key = %key.as_str(),
            message_id = key.message_id(),
        );
        async move {
            let mut tx = OwnedTransaction::begin(pool, begin_and_claim, self).await?;
            let row = tx.claim_row.take();
            let claim = match self.settle_claim(tx.conn(), row, &key).await {
                Ok(claim) => claim,
                Err(e) => {
                    tx.rollback().await;
                    return Err(partitions::layout_error(e).into());
                }
            };
            let claimed = match claim {
                Claim::Claimed(claimed) => claimed,
                Claim::Duplicate(duplicate) => {
                    tx.rollback().await;
                    return Ok(Outcome::Duplicate(duplicate));
                }
                Claim::InProgress => {
                    tx.rollback().await;
                    return Ok(Outcome::InProgress);
                }
            };
            let (verdict, needs_check) = match run_handler(tx.conn(), handler).await {
                Ok(done) => done,
                Err(e) => {
                    tx.rollback().await;
                    return Err(e);
                }
            };
            let recorded = self
                .record_verdict(tx.conn(), &claimed, verdict, needs_check)
                .await;
            let (outcome, check_owed) = match recorded {
                Ok(recorded) => recorded,
                Err(e) => {
                    tx.rollback().await;
                    return Err(e.into());
                }
            };
            // A statement that fails here ends the simple query before COMMIT runs, leaving
            // the transaction aborted: the check costs no round trip of its own.
            let commit = if check_owed {
                "SELECT 1; COMMIT"
            } else {
                "COMMIT"
            };
            if let Err(e) = tx.finish(commit).await {
                let e = handler_aborted(e);
                if matches!(e, Error::TransactionAbortedInHandler) {
                    tx.rollback().await;
                }
                return Err(e.into());
            }
            if outcome.is_processed() {
                tracing::debug!("pgbox message processed and committed");
            }
            Ok(outcome)
        }
        .instrument(span)
        .await
    }

    /// `BEGIN; SELECT * FROM <claim function>(<consumer>, <key>, <message id>[, <timeout>])`.
    fn begin_and_claim_sql(&self, key: &Key<'_>) -> Result<String> {
        let sql = &self.inner.sql;
        let lock_timeout = self.lock_timeout();
        let prefix = match lock_timeout {
            None => &sql.begin_claim.0,
            Some(_) => &sql.begin_claim_bounded,
        };
        let mut text = String::with_capacity(prefix.len() + key.as_str().len() + 96);
        text.push_str(prefix);
        push_literal(&mut text, &self.inner.consumer)?;
        text.push_str(", ");
        push_literal(&mut text, key.as_str())?;
        text.push_str(", ");
        match key.message_id() {
            Some(id) => push_literal(&mut text, id)?,
            None => text.push_str("NULL"),
        }
        match lock_timeout {
            None => text.push_str(sql.begin_claim.1),
            Some(timeout) => {
                text.push_str(", ");
                push_literal(&mut text, &timeout)?;
                text.push(')');
            }
        }
        Ok(text)
    }
}

/// A transaction pgbox opened with a simple query, on a pooled connection that is closed
/// instead of returned to the pool unless the transaction was ended.
struct OwnedTransaction {
    conn: PoolConnection<Postgres>,
    open: bool,
    /// The claim's row, from the message that began the transaction.
    claim_row: Option<sqlx::postgres::PgRow>,
}

impl OwnedTransaction {
    async fn begin(pool: &PgPool, begin_and_claim: String, inbox: &Inbox) -> Result<Self> {
        let conn = pool.acquire().await?;
        let mut tx = OwnedTransaction {
            conn,
            open: true,
            claim_row: None,
        };
        let started = std::time::Instant::now();
        let row = sqlx::raw_sql(AssertSqlSafe(begin_and_claim))
            .fetch_optional(&mut *tx.conn)
            .await;
        metrics::histogram!(
            crate::telemetry::INBOX_CLAIM_DURATION,
            "consumer" => inbox.inner.consumer.clone()
        )
        .record(started.elapsed());
        match row {
            Ok(row) => {
                tx.claim_row = row;
                Ok(tx)
            }
            Err(e) => {
                // BEGIN ran and the claim failed: the transaction is open and aborted.
                tx.rollback().await;
                Err(partitions::layout_error(e.into()))
            }
        }
    }

    fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Ends the transaction with `statement` (COMMIT, possibly after a check). On failure the
    /// transaction may still be open; the caller rolls back or lets the guard close it.
    async fn finish(&mut self, statement: &'static str) -> Result<()> {
        sqlx::raw_sql(statement).execute(&mut *self.conn).await?;
        self.open = false;
        Ok(())
    }

    /// Rolls back. If even that fails, the connection is closed on drop, which ends the
    /// transaction on the server.
    async fn rollback(&mut self) {
        if !self.open {
            return;
        }
        match sqlx::raw_sql("ROLLBACK").execute(&mut *self.conn).await {
            Ok(_) => self.open = false,
            Err(e) => tracing::warn!(error = %e, "pgbox rollback failed; closing the connection"),
        }
    }
}

impl Drop for OwnedTransaction {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}
