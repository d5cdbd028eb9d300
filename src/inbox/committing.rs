//! [`Inbox::process_and_commit`]: [`process`](Inbox::process) in a transaction pgbox begins
//! and ends itself.
//!
//! The transaction is sqlx's own ([`Acquire::begin`]), never a `BEGIN` sent behind sqlx's back:
//! sqlx then knows the connection is inside a transaction, so a unit of work the handler nests
//! on it (`conn.begin()`, or any API that takes a `&mut Transaction`, pgbox's among them) is a
//! savepoint whose commit or rollback cannot end pgbox's transaction. An earlier version
//! saved a round trip by sending `BEGIN` with the claim as one simple query; a nested unit
//! then got a top-level `BEGIN` (ignored by the server) and its `commit()` ended pgbox's
//! transaction mid-handler (a lost message, or a doubled effect). The round trip is not
//! worth that.
//!
//! sqlx 0.9.0's own begin is not safe to cancel: dropped while its `BEGIN` awaits the
//! server's answer, it queues no `ROLLBACK` (it counts the transaction only once the answer
//! is read), and the session stays inside a transaction nothing ends; the pool then lends
//! that connection on (transact-rs/sqlx#4393). So the transaction is begun where that
//! window cannot be reached: on a connection pgbox takes from the caller's pool, the
//! `BEGIN` runs on a task of its own ([`pooler::begin_on`](crate::pooler::begin_on)), which
//! finishes the begin and rolls back if the caller stops waiting. A connection the caller
//! holds (`&mut PgConnection`) cannot be moved to such a task; what happens there is said
//! on [`Inbox::process_and_commit`].

use futures_util::future::BoxFuture;
use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgTransactionManager;
use sqlx::{Acquire, PgConnection, PgPool, Postgres, Transaction};
use sqlx_core::transaction::TransactionManager;
use tracing::Instrument;

use super::{HandlerConnection, Inbox, Key, Outcome, Verdict};
use crate::error::Error;

impl Inbox {
    /// Begins a transaction on `conn` (a `&PgPool`, or a `&mut PgConnection` the caller
    /// holds), claims `key`, runs `handler` and commits: [`process`](Self::process) with the
    /// transaction's ends handled by pgbox.
    ///
    /// When it returns `Ok`, the transaction is over: committed for
    /// [`Outcome::Processed`] and [`Outcome::Rejected`], rolled back (nothing was written)
    /// for [`Outcome::Duplicate`] and [`Outcome::InProgress`]. Acknowledge the message then.
    /// On `Err`, nothing of it committed, except when COMMIT itself failed in flight (the
    /// connection dropped), when it may have: the redelivery is then settled by the inbox as
    /// usual ([`Outcome::Duplicate`] if it committed).
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
    /// panics roll back, a swallowed failed statement is caught, nested units of work are
    /// savepoints, invalid keys are refused before any SQL runs).
    ///
    /// # Dropped before it finishes
    ///
    /// Given a pool (`&PgPool`), the call takes a connection of its own and begins on a task
    /// of its own: dropped at any point (a client that hung up, a timeout, `select!`), the
    /// transaction rolls back and the connection goes back to the pool outside any
    /// transaction, also when the drop comes while `BEGIN` awaits the server's answer (where
    /// sqlx 0.9.0's own begin leaves the session inside a transaction nothing ends,
    /// transact-rs/sqlx#4393). [`process_with_retry`](Self::process_with_retry) and the
    /// [`Consumer`](crate::Consumer) begin the same way.
    ///
    /// Given a connection you hold (`&mut PgConnection`, `&mut PoolConnection`): once the
    /// call has returned, `Ok` or `Err`, its transaction is over. Dropped before that, it
    /// rolls back (sqlx's rollback on drop), except while its `BEGIN` awaits the server's
    /// answer: a connection pgbox does not own cannot be moved to a task that finishes the
    /// begin, and sqlx 0.9.0 queues no `ROLLBACK` there, so the session may be left inside a
    /// transaction that neither sqlx nor pgbox will end, in which your next statements would
    /// run and never commit. Where a call may be dropped, pass the pool; or do not reuse a
    /// connection whose call did not finish: close it (`PoolConnection::close_on_drop`,
    /// `PoolConnection::close`, `Connection::close`).
    ///
    /// Passing a connection that is already inside a transaction (a `&mut Transaction`) is
    /// refused with [`Error::InvalidConfig`] before anything is sent: its commit would only
    /// release a savepoint, and "committed" would be a lie. Use [`process`](Self::process)
    /// there.
    pub async fn process_and_commit<'c, A, T, E, F>(
        &self,
        conn: A,
        key: impl Into<Key<'_>>,
        handler: F,
    ) -> std::result::Result<Outcome<T>, E>
    where
        A: Acquire<'c, Database = Postgres>,
        A::Connection: BeginsItsOwn<'c>,
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> std::result::Result<T, E>,
        T: Serialize,
        E: From<Error>,
    {
        self.process_or_reject_and_commit(conn, key, async move |conn| {
            handler(conn).await.map(Verdict::Accept)
        })
        .await
    }

    /// [`process_or_reject`](Self::process_or_reject) in a transaction pgbox opens and commits,
    /// as [`process_and_commit`](Self::process_and_commit) does.
    pub async fn process_or_reject_and_commit<'c, A, T, E, F>(
        &self,
        conn: A,
        key: impl Into<Key<'_>>,
        handler: F,
    ) -> std::result::Result<Outcome<T>, E>
    where
        A: Acquire<'c, Database = Postgres>,
        A::Connection: BeginsItsOwn<'c>,
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> std::result::Result<Verdict<T>, E>,
        T: Serialize,
        E: From<Error>,
    {
        let key = key.into();
        // Refused before a connection is taken from the pool.
        key.validate()?;
        // Taking a connection from a pool is safe to cancel (sqlx gives the permit back).
        let conn = conn.acquire().await.map_err(Error::from)?;
        let tx = conn.begin_own().await?;
        self.process_or_reject_in_own(tx, key, handler).await
    }

    /// [`process_or_reject_and_commit`](Self::process_or_reject_and_commit) on a connection of
    /// `pool`, begun by [`pooler::begin`](crate::pooler::begin): dropped while its `BEGIN` is
    /// on the wire, it leaves no open transaction behind on the connection (the consumer
    /// runner's path: a shutdown drops what is in flight).
    pub(crate) async fn process_or_reject_and_commit_on_pool<T, E, F>(
        &self,
        pool: &PgPool,
        key: Key<'_>,
        handler: F,
    ) -> std::result::Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> std::result::Result<Verdict<T>, E>,
        T: Serialize,
        E: From<Error>,
    {
        key.validate()?;
        let tx = crate::pooler::begin(pool, None).await?;
        self.process_or_reject_in_own(tx, key, handler).await
    }

    /// The rest of the `*_and_commit` methods, once their transaction has begun.
    pub(crate) async fn process_or_reject_in_own<T, E, F>(
        &self,
        mut tx: Transaction<'_, Postgres>,
        key: Key<'_>,
        handler: F,
    ) -> std::result::Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> std::result::Result<Verdict<T>, E>,
        T: Serialize,
        E: From<Error>,
    {
        if PgTransactionManager::get_transaction_depth(&tx) != 1 {
            return Err(inside_a_transaction().into());
        }
        let outcome = self.process_or_reject(&mut tx, key, handler).await;
        let committed = match &outcome {
            Ok(Outcome::Processed(_) | Outcome::Rejected(_)) => {
                async { tx.commit().await.map_err(Error::from) }
                    .instrument(tracing::debug_span!("pgbox.inbox.commit"))
                    .await
            }
            // Nothing was written: end the transaction without a commit record.
            Ok(_) | Err(_) => {
                if let Err(e) = tx.rollback().await {
                    // The connection is gone with its transaction; the answer stands.
                    tracing::warn!(error = %e, "pgbox rollback failed");
                }
                Ok(())
            }
        };
        committed?;
        outcome
    }
}

/// The refusal of a connection that is already inside a transaction.
fn inside_a_transaction() -> Error {
    Error::InvalidConfig(
        "process_and_commit was given a connection inside a transaction: its commit would \
         only release a savepoint; use Inbox::process on that transaction"
            .to_owned(),
    )
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::pool::PoolConnection<sqlx::Postgres> {}
    impl Sealed for &mut sqlx::PgConnection {}
}

/// What an [`Acquire`] lends that [`Inbox::process_and_commit`] can begin its transaction
/// on: a connection taken from a pool ([`PoolConnection`], what `&PgPool` lends), which
/// pgbox owns for the call, or a connection the caller holds (`&mut PgConnection`, what
/// `&mut PgConnection`, `&mut PoolConnection` and `&mut Transaction` lend).
///
/// Sealed: every [`Acquire`] of sqlx's for PostgreSQL lends one of these two, so a caller
/// that names a concrete type never sees this bound; code generic over `Acquire` adds
/// `A::Connection: BeginsItsOwn<'c>` beside `A: Acquire<'c, Database = Postgres>`.
#[diagnostic::on_unimplemented(
    message = "pgbox cannot begin its own transaction on `{Self}`",
    label = "`process_and_commit` and the other `*_and_commit` calls take a pool or a connection",
    note = "pass the pool (`inbox.process_and_commit(&pool, ...)`), a `&mut PgConnection` or a `&mut PoolConnection`",
    note = "inside a transaction of your own (`pool.begin()`), call `process(&mut tx, ...)` instead",
    note = "a pool or connection of another sqlx version than pgbox's does not fit either: `cargo tree -i sqlx` lists the versions"
)]
pub trait BeginsItsOwn<'c>: sealed::Sealed + Send {
    /// Begins the transaction of a `*_and_commit` call on this connection.
    #[doc(hidden)]
    // A boxed future, as sqlx's own `Acquire::begin`: an `impl Future` here is not seen as
    // `Send` for every lifetime (rust-lang/rust#100013), and callers spawn these calls.
    fn begin_own(self) -> BoxFuture<'c, crate::Result<Transaction<'c, Postgres>>>;
}

impl<'c> BeginsItsOwn<'c> for PoolConnection<Postgres> {
    /// On a task of its own: dropped at any point, nothing is left open (see
    /// [`pooler::begin_on`](crate::pooler::begin_on)).
    fn begin_own(self) -> BoxFuture<'c, crate::Result<Transaction<'c, Postgres>>> {
        Box::pin(async move {
            if PgTransactionManager::get_transaction_depth(&self) != 0 {
                return Err(inside_a_transaction());
            }
            crate::pooler::begin_on(self, None).await
        })
    }
}

impl<'c> BeginsItsOwn<'c> for &'c mut PgConnection {
    /// sqlx's begin, on the caller's connection: see "Dropped before it finishes" on
    /// [`Inbox::process_and_commit`] for the window this leaves.
    fn begin_own(self) -> BoxFuture<'c, crate::Result<Transaction<'c, Postgres>>> {
        Box::pin(async move {
            // Refused before anything is sent: `begin` would open a savepoint.
            if PgTransactionManager::get_transaction_depth(self) != 0 {
                return Err(inside_a_transaction());
            }
            Ok(Transaction::begin(self, None).await?)
        })
    }
}
