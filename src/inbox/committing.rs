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

use serde::Serialize;
use sqlx::postgres::PgTransactionManager;
use sqlx::{Acquire, PgPool, Postgres, Transaction};
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
    /// savepoints, invalid keys are refused before any SQL runs). If this future is dropped
    /// before it finishes, the transaction rolls back (sqlx's rollback on drop), except in
    /// one window that is sqlx 0.9.0's: dropped while sqlx's `BEGIN` awaits its answer, the
    /// session stays inside a transaction nothing ends (transact-rs/sqlx#4393).
    /// [`process_with_retry`](Self::process_with_retry) and the [`Consumer`](crate::Consumer)
    /// begin on a task of their own and are safe there too.
    ///
    /// Passing a connection that is already inside a transaction (a `&mut Transaction`) is
    /// refused with [`Error::InvalidConfig`]: its commit would only release a savepoint, and
    /// "committed" would be a lie. Use [`process`](Self::process) there.
    pub async fn process_and_commit<'c, A, T, E, F>(
        &self,
        conn: A,
        key: impl Into<Key<'_>>,
        handler: F,
    ) -> std::result::Result<Outcome<T>, E>
    where
        A: Acquire<'c, Database = Postgres>,
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
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> std::result::Result<Verdict<T>, E>,
        T: Serialize,
        E: From<Error>,
    {
        let key = key.into();
        // Refused before a connection is taken from the pool.
        key.validate()?;
        let tx = conn.begin().await.map_err(Error::from)?;
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
    async fn process_or_reject_in_own<T, E, F>(
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
            return Err(Error::InvalidConfig(
                "process_and_commit was given a connection inside a transaction: its commit \
                 would only release a savepoint; use Inbox::process on that transaction"
                    .to_owned(),
            )
            .into());
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
