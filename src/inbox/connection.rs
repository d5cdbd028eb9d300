//! The connection a handler runs on: the claim's transaction, watched for failed statements.

use std::fmt;
use std::ops::{Deref, DerefMut};

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Either, Execute, Executor, PgConnection, Postgres, SqlStr};

/// The claim's transaction, as a handler sees it. Use it like a `&mut PgConnection`:
/// `sqlx::query(…).execute(&mut *conn)`, or pass `conn` (or `&mut *conn`) where a
/// `&mut PgConnection` is expected.
///
/// Why a wrapper: a statement that fails inside a transaction aborts it, and a handler that
/// swallows that error and returns `Ok` would otherwise be reported as processed while its
/// COMMIT silently rolls back. The wrapper sees every statement sent through it, so pgbox
/// only has to ask the server whether the transaction is alive (one extra round trip) when a
/// statement failed, or when the handler took the raw connection (through `DerefMut`, e.g.
/// to call a function that wants `&mut PgConnection`), where it could not watch. A handler
/// that only runs statements through the wrapper, all successful, costs no check at all.
pub struct HandlerConnection<'c> {
    conn: &'c mut PgConnection,
    /// A statement sent through the wrapper failed.
    failed: bool,
    /// The raw connection was handed out; what happened on it is unknown.
    unwatched: bool,
}

impl<'c> HandlerConnection<'c> {
    pub(crate) fn new(conn: &'c mut PgConnection) -> Self {
        HandlerConnection {
            conn,
            failed: false,
            unwatched: false,
        }
    }

    /// The connection, for a statement pgbox itself sends on the handler's behalf (an
    /// outbox enqueue): it stays watched, and the caller reports a failure.
    pub(crate) fn watched(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// A statement sent on the handler's behalf failed.
    pub(crate) fn mark_failed(&mut self) {
        self.failed = true;
    }

    /// Whether the transaction may have been aborted behind the handler's back: then the
    /// inbox checks before reporting success.
    pub(crate) fn needs_check(&self) -> bool {
        self.failed || self.unwatched
    }
}

impl fmt::Debug for HandlerConnection<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerConnection")
            .field("failed", &self.failed)
            .field("unwatched", &self.unwatched)
            .finish_non_exhaustive()
    }
}

impl Deref for HandlerConnection<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn
    }
}

impl DerefMut for HandlerConnection<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.unwatched = true;
        self.conn
    }
}

impl<'c> Executor<'c> for &'c mut HandlerConnection<'_> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let failed = &mut self.failed;
        (&mut *self.conn)
            .fetch_many(query)
            .inspect(move |r| {
                if r.is_err() {
                    *failed = true;
                }
            })
            .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let failed = &mut self.failed;
        (&mut *self.conn)
            .fetch_optional(query)
            .inspect(move |r| {
                if r.is_err() {
                    *failed = true;
                }
            })
            .boxed()
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, sqlx::Error>>
    where
        'c: 'e,
    {
        let failed = &mut self.failed;
        (&mut *self.conn)
            .prepare_with(sql, parameters)
            .inspect(move |r| {
                if r.is_err() {
                    *failed = true;
                }
            })
            .boxed()
    }

    fn describe<'e>(
        self,
        sql: SqlStr,
    ) -> BoxFuture<'e, Result<sqlx_core::describe::Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        let failed = &mut self.failed;
        (&mut *self.conn)
            .describe(sql)
            .inspect(move |r| {
                if r.is_err() {
                    *failed = true;
                }
            })
            .boxed()
    }
}
