//! [`Inbox::process_and_commit`]: pgbox owns the transaction, so BEGIN and the claim travel in
//! one message and the liveness check rides with COMMIT.
//!
//! A message through [`Inbox::process`] costs BEGIN, the claim, the handler's statements and
//! COMMIT, each a round trip. When pgbox opens the transaction itself, BEGIN and the claim go
//! to the server as one simple query, and so do the liveness check and COMMIT: a new message
//! costs one round trip fewer.
//!
//! A simple query carries no parameters, and parsing and planning the claim on every message
//! would cost the server more than the round trip saves. So the claim is a prepared
//! statement of the session (`PREPARE`, once per connection, on first use or after something
//! deallocated it), and the simple query is `BEGIN; EXECUTE <claim>(<consumer>, <key>,
//! <message id>)`, the values as escaped constants (see [`push_literal`]).
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
    /// round trip cheaper (BEGIN travels with the claim).
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

    /// `BEGIN; EXECUTE <claim>(<consumer>, <key>, <message id>[, <lock timeout>])`, and the
    /// claim's `PREPARE`, for when the session does not have it yet.
    fn begin_and_claim_sql(&self, key: &Key<'_>) -> Result<(String, String)> {
        let sql = &self.inner.sql;
        let lock_timeout = self.lock_timeout();
        let (claim, types) = match lock_timeout {
            None => (&sql.claim, "text, text, text"),
            Some(_) => (&sql.claim_bounded, "text, text, text, text"),
        };
        let name = prepared_name(claim);
        let mut text = String::with_capacity(48 + key.as_str().len());
        text.push_str("BEGIN; EXECUTE ");
        text.push_str(&name);
        text.push('(');
        push_literal(&mut text, &self.inner.consumer)?;
        text.push_str(", ");
        push_literal(&mut text, key.as_str())?;
        text.push_str(", ");
        match key.message_id() {
            Some(id) => push_literal(&mut text, id)?,
            None => text.push_str("NULL"),
        }
        if let Some(timeout) = lock_timeout {
            text.push_str(", ");
            push_literal(&mut text, &timeout)?;
        }
        text.push(')');
        let prepare = format!("PREPARE {name} ({types}) AS {claim}");
        Ok((text, prepare))
    }
}

/// The session-level name of a prepared claim: derived from its text (which names the
/// schema), so two inboxes on one connection share a statement exactly when they share the
/// SQL. FNV-1a: stable across processes and builds, unlike the standard library's hasher.
fn prepared_name(sql: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in sql.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("pgbox_claim_{hash:016x}")
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
    async fn begin(
        pool: &PgPool,
        (begin_and_claim, prepare): (String, String),
        inbox: &Inbox,
    ) -> Result<Self> {
        let conn = pool.acquire().await?;
        let mut tx = OwnedTransaction {
            conn,
            open: true,
            claim_row: None,
        };
        let started = std::time::Instant::now();
        let mut prepared_now = false;
        let row = loop {
            tx.open = true;
            let row = sqlx::raw_sql(AssertSqlSafe(begin_and_claim.clone()))
                .fetch_optional(&mut *tx.conn)
                .await
                .map_err(Error::from);
            match row {
                Ok(row) => break row,
                // BEGIN ran and EXECUTE failed: roll back, whatever the reason.
                Err(e) => {
                    tx.rollback().await;
                    if tx.open || prepared_now || !is_missing_statement(&e) {
                        return Err(partitions::layout_error(e));
                    }
                }
            }
            // This session has not prepared the claim yet (a new connection, or something
            // deallocated it): prepare it and try again, once.
            tracing::debug!("pgbox preparing the claim on this connection");
            sqlx::raw_sql(AssertSqlSafe(prepare.clone()))
                .execute(&mut *tx.conn)
                .await?;
            prepared_now = true;
        };
        metrics::histogram!(
            crate::telemetry::INBOX_CLAIM_DURATION,
            "consumer" => inbox.inner.consumer.clone()
        )
        .record(started.elapsed());
        tx.claim_row = row;
        Ok(tx)
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

/// SQLSTATE 26000, `invalid_sql_statement_name`: EXECUTE of a statement the session does not
/// have.
fn is_missing_statement(e: &Error) -> bool {
    match e {
        Error::Database {
            source: sqlx::Error::Database(db),
            ..
        } => db.code().as_deref() == Some("26000"),
        _ => false,
    }
}

impl Drop for OwnedTransaction {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}
