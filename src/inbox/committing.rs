//! [`Inbox::process_and_commit`]: pgbox owns the transaction, so BEGIN travels with the claim,
//! a duplicate's read with its ROLLBACK, and the liveness check with COMMIT.
//!
//! A message through [`Inbox::process`] costs BEGIN, the claim, the handler's statements and
//! COMMIT, each a round trip (and a duplicate BEGIN, claim, read, COMMIT). When pgbox opens the
//! transaction itself, `BEGIN; EXECUTE <claim>(…)` goes to the server as one simple query, and
//! the liveness check (when one is owed) with COMMIT: a new message costs one round trip
//! fewer. A duplicate's claim returns nothing; `EXECUTE <read>(…); ROLLBACK` then reads its
//! record (a new statement: under READ COMMITTED it sees a row committed while the claim waited
//! for it) and ends the transaction in the same message: two round trips against four. The
//! read is not sent with the claim: it would cost every new message an executor start-up
//! (measured: 17 µs of server CPU per message, about 10 % of the whole).
//!
//! A simple query carries no parameters, and parsing and planning the claim on every message
//! would cost the server more than the round trip saves. So the claim and the read are
//! prepared statements of the session (`PREPARE`, once per connection, on first use or after
//! something deallocated them), and the values travel as escaped constants (see
//! [`push_literal`]).
//!
//! The transaction is invisible to sqlx's own bookkeeping, so a guard stands in for sqlx's
//! rollback-on-drop: a connection whose transaction was not ended (the future was dropped, a
//! handler panicked, COMMIT or ROLLBACK failed) is closed instead of going back to the pool,
//! and the server rolls the transaction back when the session ends.

use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row};
use tracing::Instrument;

use super::{
    Claim, HandlerConnection, Inbox, Key, Outcome, Statements, Verdict, handler_aborted,
    partitions, run_handler,
};
use crate::error::{Error, Result};
use crate::ident::push_literal;

impl Inbox {
    /// Opens a transaction on a connection from `pool`, claims `key`, runs `handler` and
    /// commits: [`process`](Self::process) with the transaction's ends handled by pgbox, one
    /// round trip cheaper for a new message (BEGIN travels with the claim) and two for a
    /// duplicate (the read of its record travels too).
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
        let span = self.process_span(&key);
        async move {
            let mut tx = OwnedTransaction::begin(pool, begin_and_claim, self).await?;
            let claim = match (tx.claimed, tx.claim_row.take()) {
                // Claimed, or the bounded claim's own answer (in progress, or the record).
                (true, Some(row)) => self.settle_claim(tx.conn(), Some(row), &key).await,
                // The bare claim inserted nothing: a committed row holds the key.
                (true, None) => self.settle_duplicate(&mut tx, &key).await,
                (false, _) => self.claim_validated(tx.conn(), &key).await,
            };
            let claim = match claim {
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
    /// claim's and the read's `PREPARE`s, for when the session does not have them yet.
    fn begin_and_claim_sql(&self, key: &Key<'_>) -> Result<(String, [&str; 2])> {
        let prepared = &self.inner.prepared;
        let lock_timeout = self.lock_timeout();
        let claim = match lock_timeout {
            None => &prepared.claim,
            Some(_) => &prepared.claim_bounded,
        };
        let read = &prepared.read;
        let mut text = String::with_capacity(96 + 2 * key.as_str().len());
        text.push_str("BEGIN; ");
        self.push_execute(&mut text, claim, key)?;
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
        Ok((text, [&claim.prepare, &read.prepare]))
    }

    /// `EXECUTE <statement>(<consumer>, <key>` (the caller adds any further arguments and the
    /// closing parenthesis).
    fn push_execute(&self, text: &mut String, statement: &Prepared, key: &Key<'_>) -> Result<()> {
        text.push_str("EXECUTE ");
        text.push_str(&statement.name);
        text.push('(');
        push_literal(text, &self.inner.consumer)?;
        text.push_str(", ");
        push_literal(text, key.as_str())
    }

    /// After a bare claim that inserted nothing: the duplicate, read by `EXECUTE <read>(…);
    /// ROLLBACK` in one message. A record under a lease, or gone since the claim, is settled
    /// the long way in a new transaction, as `process` settles it.
    async fn settle_duplicate(&self, tx: &mut OwnedTransaction, key: &Key<'_>) -> Result<Claim> {
        if let Some(duplicate) = self.read_and_roll_back(tx, key).await? {
            return Ok(Claim::Duplicate(duplicate));
        }
        tx.restart().await?;
        self.claim_validated(tx.conn(), key).await
    }

    /// `EXECUTE <read>(…); ROLLBACK`: the duplicate, or `None` when the record is under a
    /// lease or gone (the transaction is over either way).
    async fn read_and_roll_back(
        &self,
        tx: &mut OwnedTransaction,
        key: &Key<'_>,
    ) -> Result<Option<super::Duplicate>> {
        let read = &self.inner.prepared.read;
        let mut text = String::with_capacity(64 + key.as_str().len());
        self.push_execute(&mut text, read, key)?;
        text.push_str("); ROLLBACK");
        let rows = match sqlx::raw_sql(AssertSqlSafe(text))
            .fetch_all(tx.conn())
            .await
            .map_err(Error::from)
        {
            Ok(rows) => rows,
            Err(e) if has_code(&e, "26000") => {
                // Deallocated since the claim ran: the transaction is aborted. Roll back,
                // prepare the read again, and settle the long way.
                tx.rollback().await;
                if tx.open {
                    return Err(e);
                }
                prepare(tx.conn(), &read.prepare).await?;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        tx.open = false;
        let Some(row) = rows.into_iter().next() else {
            return Ok(None);
        };
        // Under a lease: not for `decode_claim`, which would report it in progress; the
        // caller settles it (perhaps taking an expired lease over).
        if row.try_get::<Option<bool>, _>(1)? == Some(true) {
            return Ok(None);
        }
        match self.decode_claim(&row, key)? {
            Claim::Duplicate(duplicate) => Ok(Some(duplicate)),
            _ => Ok(None),
        }
    }
}

/// `PREPARE`s `statement` on `conn`; one the session already has is fine.
async fn prepare(conn: &mut PgConnection, statement: &str) -> Result<()> {
    match sqlx::raw_sql(AssertSqlSafe(statement.to_owned()))
        .execute(conn)
        .await
        .map_err(Error::from)
    {
        Ok(_) => Ok(()),
        // duplicate_prepared_statement: this one was still there.
        Err(e) if has_code(&e, "42P05") => Ok(()),
        Err(e) => Err(e),
    }
}

/// A statement as the session prepares it: its name and its `PREPARE`.
#[derive(Debug)]
struct Prepared {
    name: String,
    prepare: String,
}

impl Prepared {
    /// The name derives from the text (which names the schema), so two inboxes on one
    /// connection share a statement exactly when they share the SQL. FNV-1a: stable across
    /// processes and builds, unlike the standard library's hasher.
    fn new(sql: &str, types: &str) -> Self {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in sql.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let name = format!("pgbox_{hash:016x}");
        let prepare = format!("PREPARE {name} ({types}) AS {sql}");
        Prepared { name, prepare }
    }
}

/// The claims and the read, as `process_and_commit` prepares them; built once per inbox.
#[derive(Debug)]
pub(super) struct PreparedStatements {
    claim: Prepared,
    claim_bounded: Prepared,
    read: Prepared,
}

impl PreparedStatements {
    pub(super) fn new(sql: &Statements) -> Self {
        PreparedStatements {
            claim: Prepared::new(&sql.claim, "text, text, text"),
            claim_bounded: Prepared::new(&sql.claim_bounded, "text, text, text, text"),
            read: Prepared::new(&sql.read, "text, text"),
        }
    }
}

/// A transaction pgbox opened with a simple query, on a pooled connection that is closed
/// instead of returned to the pool unless the transaction was ended.
struct OwnedTransaction {
    conn: PoolConnection<Postgres>,
    open: bool,
    /// Whether the message that began the transaction claimed too (false after the
    /// fallback to a bare BEGIN).
    claimed: bool,
    /// The claim's row, from the message that began the transaction.
    claim_row: Option<sqlx::postgres::PgRow>,
}

/// Whether the fallback was already reported (once per process is enough).
static FALLBACK_REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl OwnedTransaction {
    async fn begin(
        pool: &PgPool,
        (begin_and_claim, prepares): (String, [&str; 2]),
        inbox: &Inbox,
    ) -> Result<Self> {
        let conn = pool.acquire().await?;
        let mut tx = OwnedTransaction {
            conn,
            open: true,
            claimed: true,
            claim_row: None,
        };
        let started = std::time::Instant::now();
        let mut prepared_now = false;
        let rows = loop {
            tx.open = true;
            let rows = sqlx::raw_sql(AssertSqlSafe(begin_and_claim.clone()))
                .fetch_all(&mut *tx.conn)
                .await
                .map_err(Error::from);
            match rows {
                Ok(rows) => break rows,
                // BEGIN ran and an EXECUTE failed: roll back, whatever the reason.
                Err(e) => {
                    tx.rollback().await;
                    if tx.open || !has_code(&e, "26000") {
                        return Err(partitions::layout_error(e));
                    }
                    if prepared_now {
                        // Prepared, and gone again at once: the session does not keep what
                        // it prepares (a pooler in transaction mode hands each statement to
                        // another server connection). Fall back to BEGIN alone; the claim
                        // then goes through the extended protocol like `process`'s.
                        if !FALLBACK_REPORTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                            tracing::warn!(
                                "pgbox: this connection does not keep session-prepared statements \
                                 (a pooler in transaction mode?); process_and_commit sends BEGIN \
                                 and the claim separately, one round trip more"
                            );
                        }
                        tx.open = true;
                        sqlx::raw_sql("BEGIN").execute(&mut *tx.conn).await?;
                        tx.claimed = false;
                        return Ok(tx);
                    }
                }
            }
            // This session lacks a statement (a new connection, or something deallocated
            // it): prepare what is missing and try again, once.
            tracing::debug!("pgbox preparing the claim on this connection");
            for statement in prepares {
                prepare(&mut tx.conn, statement).await?;
            }
            prepared_now = true;
        };
        metrics::histogram!(
            crate::telemetry::INBOX_CLAIM_DURATION,
            "consumer" => inbox.inner.consumer.clone()
        )
        .record(started.elapsed());
        // The claim's row: none from the bare INSERT on a conflict; the bounded claim answers
        // every call (claimed, in progress, or the record).
        tx.claim_row = rows.into_iter().next();
        Ok(tx)
    }

    fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// A new transaction on the same connection, after the last one ended (a plain BEGIN;
    /// the claim then goes through the extended protocol, as `process`'s does).
    async fn restart(&mut self) -> Result<()> {
        debug_assert!(!self.open);
        self.open = true;
        self.claimed = false;
        sqlx::raw_sql("BEGIN").execute(&mut *self.conn).await?;
        Ok(())
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

/// Whether `e` is a server error with this SQLSTATE (26000, `invalid_sql_statement_name`:
/// EXECUTE of a statement the session does not have; 42P05, `duplicate_prepared_statement`).
fn has_code(e: &Error, code: &str) -> bool {
    match e {
        Error::Database {
            source: sqlx::Error::Database(db),
            ..
        } => db.code().as_deref() == Some(code),
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
