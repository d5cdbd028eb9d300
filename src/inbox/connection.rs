//! The connection a handler runs on: the claim's transaction, watched for failed statements.

use std::fmt;
use std::ops::{Deref, DerefMut};

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Either, Execute, Executor, PgConnection, Postgres, SqlStr};

use crate::pooler::Pooler;

/// The claim's transaction, as a handler sees it. Use it like a `&mut PgConnection`:
/// `sqlx::query(…).execute(&mut *conn)`, or pass `conn` (or `&mut *conn`) where a
/// `&mut PgConnection` is expected.
///
/// **Nested units of work are savepoints.** The connection is inside a transaction sqlx
/// knows about, so `conn.begin()` (or any API that begins a `Transaction` on it) opens a
/// savepoint: its `commit()` releases the savepoint and its `rollback()` undoes only the
/// nested unit, never the inbox's transaction. `BEGIN`, `COMMIT`, `END`, `ROLLBACK` (other
/// than `ROLLBACK TO SAVEPOINT`), `ABORT` and `PREPARE TRANSACTION` sent through the wrapper
/// are refused with an error before they reach the server: they would end the transaction
/// pgbox records the message in. If the transaction was ended anyway (on the raw connection),
/// pgbox finds out before reporting success: [`Error::TransactionEndedInHandler`], never
/// `Processed`.
///
/// Why a wrapper: a statement that fails inside a transaction aborts it, and a handler that
/// swallows that error and returns `Ok` would otherwise be reported as processed while its
/// COMMIT silently rolls back. The wrapper sees every statement sent through it, so pgbox
/// only has to ask the server whether the transaction is alive and still the claiming one
/// (one extra round trip) when a statement failed, or when the handler took the raw
/// connection (through `DerefMut`, e.g. to call a function that wants `&mut PgConnection`, or
/// `conn.begin()`), where it could not watch. A handler that only runs statements through the
/// wrapper, all successful, costs no check at all.
///
/// [`Error::TransactionEndedInHandler`]: crate::Error::TransactionEndedInHandler
pub struct HandlerConnection<'c> {
    conn: &'c mut PgConnection,
    /// A statement sent through the wrapper failed.
    failed: bool,
    /// The raw connection was handed out; what happened on it is unknown.
    unwatched: bool,
    /// Behind a transaction pooler: every statement goes unnamed.
    unnamed: bool,
}

impl<'c> HandlerConnection<'c> {
    pub(crate) fn new(conn: &'c mut PgConnection, pooler: Pooler) -> Self {
        HandlerConnection {
            conn,
            failed: false,
            unwatched: false,
            unnamed: !pooler.persistent(),
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
        match Screened::new(query, self.unnamed) {
            Ok(query) => (&mut *self.conn)
                .fetch_many(query)
                .inspect(move |r| {
                    if r.is_err() {
                        *failed = true;
                    }
                })
                .boxed(),
            Err(refused) => {
                *failed = true;
                futures_util::stream::once(async move { Err(refused) }).boxed()
            }
        }
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
        match Screened::new(query, self.unnamed) {
            Ok(query) => (&mut *self.conn)
                .fetch_optional(query)
                .inspect(move |r| {
                    if r.is_err() {
                        *failed = true;
                    }
                })
                .boxed(),
            Err(refused) => {
                *failed = true;
                futures_util::future::ready(Err(refused)).boxed()
            }
        }
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

/// A connection pgbox's row helpers ([`VersionedTable`](crate::VersionedTable),
/// [`StateTable`](crate::StateTable)) run their statements on: a `PgConnection`, a
/// `Transaction`, a pooled connection, or the handler's [`HandlerConnection`]. Through the
/// handler's connection the statements stay watched, so using a helper inside a handler costs
/// no liveness check (passing `&mut **conn`, the raw connection, would owe one). Sealed.
pub trait ConnectionLike: sealed::Sealed + Send {
    /// The connection, for one statement.
    #[doc(hidden)]
    fn connection(&mut self) -> &mut PgConnection;
    /// That statement failed (inside a transaction, the transaction is aborted).
    #[doc(hidden)]
    fn statement_failed(&mut self) {}
    /// Whether statements on it may be named and cached (not behind a transaction pooler,
    /// as far as the connection knows: the handler's connection knows its inbox's
    /// [`Pooler`](crate::Pooler)).
    #[doc(hidden)]
    fn persistent(&self) -> bool {
        true
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::PgConnection {}
    impl Sealed for sqlx::Transaction<'_, sqlx::Postgres> {}
    impl Sealed for sqlx::pool::PoolConnection<sqlx::Postgres> {}
    impl Sealed for super::HandlerConnection<'_> {}
}

impl ConnectionLike for PgConnection {
    fn connection(&mut self) -> &mut PgConnection {
        self
    }
}

impl ConnectionLike for sqlx::Transaction<'_, Postgres> {
    fn connection(&mut self) -> &mut PgConnection {
        self
    }
}

impl ConnectionLike for sqlx::pool::PoolConnection<Postgres> {
    fn connection(&mut self) -> &mut PgConnection {
        self
    }
}

impl ConnectionLike for HandlerConnection<'_> {
    fn connection(&mut self) -> &mut PgConnection {
        self.conn
    }
    fn statement_failed(&mut self) {
        self.failed = true;
    }
    fn persistent(&self) -> bool {
        !self.unnamed
    }
}

/// A handler's query, taken apart to read its SQL before it is sent, and put back together.
struct Screened {
    sql: SqlStr,
    statement: Option<PgStatement>,
    arguments: Option<Result<Option<PgArguments>, sqlx::error::BoxDynError>>,
    persistent: bool,
}

impl Screened {
    /// The query, unless it would end the claim's transaction: then the error the handler
    /// gets instead of running it.
    fn new<'q, E: Execute<'q, Postgres>>(mut query: E, unnamed: bool) -> Result<Self, sqlx::Error> {
        let arguments = Some(query.take_arguments());
        let persistent = query.persistent() && !unnamed;
        let statement = query.statement().cloned();
        let sql = query.sql();
        if let Some(keyword) = transaction_control(sql.as_str()) {
            tracing::error!(
                statement = keyword,
                "pgbox refused a handler's transaction control: it would end the inbox's transaction"
            );
            return Err(sqlx::Error::InvalidArgument(format!(
                "pgbox: a handler may not send {keyword}: the connection is inside the inbox's \
                 transaction, which pgbox ends itself; nest a unit of work with `conn.begin()` \
                 (a savepoint) instead"
            )));
        }
        Ok(Screened {
            sql,
            statement,
            arguments,
            persistent,
        })
    }
}

impl<'q> Execute<'q, Postgres> for Screened {
    fn sql(self) -> SqlStr {
        self.sql
    }

    fn statement(&self) -> Option<&PgStatement> {
        self.statement.as_ref()
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, sqlx::error::BoxDynError> {
        self.arguments.take().unwrap_or(Ok(None))
    }

    fn persistent(&self) -> bool {
        self.persistent
    }
}

/// A statement the handler's connection refuses: it would end (or pretend to open) the
/// transaction pgbox claimed the key in. Nested units of work are savepoints, which
/// `conn.begin()` (sqlx's nested transaction) and `SAVEPOINT`/`RELEASE`/`ROLLBACK TO` give.
fn transaction_control(sql: &str) -> Option<&'static str> {
    let mut statements = StatementStarts::new(sql);
    while let Some(words) = statements.next_statement() {
        let first = words.first().map(|w| w.to_ascii_uppercase());
        let second = words.get(1).map(|w| w.to_ascii_uppercase());
        let third = words.get(2).map(|w| w.to_ascii_uppercase());
        let refused = match first.as_deref() {
            Some("BEGIN") | Some("START") => Some("BEGIN"),
            Some("COMMIT") | Some("END") => Some("COMMIT"),
            Some("ABORT") => Some("ROLLBACK"),
            Some("ROLLBACK") => {
                // `ROLLBACK [WORK | TRANSACTION] TO [SAVEPOINT] name` undoes a nested unit.
                let to = match second.as_deref() {
                    Some("WORK") | Some("TRANSACTION") => third.as_deref(),
                    other => other,
                };
                (to != Some("TO")).then_some("ROLLBACK")
            }
            Some("PREPARE") if second.as_deref() == Some("TRANSACTION") => {
                Some("PREPARE TRANSACTION")
            }
            _ => None,
        };
        if refused.is_some() {
            return refused;
        }
    }
    None
}

/// Walks SQL text statement by statement, yielding the first three words of each; string
/// literals, quoted identifiers, dollar quotes and comments are skipped, so a `;` or a
/// keyword inside them is not mistaken for a statement.
struct StatementStarts<'a> {
    sql: &'a str,
    at: usize,
}

impl<'a> StatementStarts<'a> {
    fn new(sql: &'a str) -> Self {
        StatementStarts { sql, at: 0 }
    }

    /// The first words of the next statement, `None` at the end of the text.
    fn next_statement(&mut self) -> Option<Vec<&'a str>> {
        let bytes = self.sql.as_bytes();
        if self.at >= bytes.len() {
            return None;
        }
        let mut words = Vec::new();
        while self.at < bytes.len() {
            let b = bytes[self.at];
            match b {
                b';' => {
                    self.at += 1;
                    return Some(words);
                }
                b'\'' | b'"' => self.skip_quoted(b),
                b'-' if bytes.get(self.at + 1) == Some(&b'-') => {
                    while self.at < bytes.len() && bytes[self.at] != b'\n' {
                        self.at += 1;
                    }
                }
                b'/' if bytes.get(self.at + 1) == Some(&b'*') => self.skip_block_comment(),
                b'$' if self.skip_dollar_quoted() => {}
                _ if b.is_ascii_alphabetic() || b == b'_' => {
                    let start = self.at;
                    while self.at < bytes.len()
                        && (bytes[self.at].is_ascii_alphanumeric()
                            || bytes[self.at] == b'_'
                            || bytes[self.at] == b'$')
                    {
                        self.at += 1;
                    }
                    if words.len() < 3 {
                        words.push(&self.sql[start..self.at]);
                    }
                }
                _ => self.at += 1,
            }
        }
        Some(words)
    }

    /// Past a `'…'` or `"…"` (a doubled quote stays inside).
    fn skip_quoted(&mut self, quote: u8) {
        let bytes = self.sql.as_bytes();
        self.at += 1;
        while self.at < bytes.len() {
            if bytes[self.at] == quote {
                if bytes.get(self.at + 1) == Some(&quote) {
                    self.at += 2;
                    continue;
                }
                self.at += 1;
                return;
            }
            self.at += 1;
        }
    }

    /// Past a `/* … */` comment; PostgreSQL nests them.
    fn skip_block_comment(&mut self) {
        let bytes = self.sql.as_bytes();
        let mut depth = 0usize;
        while self.at < bytes.len() {
            if bytes[self.at] == b'/' && bytes.get(self.at + 1) == Some(&b'*') {
                depth += 1;
                self.at += 2;
            } else if bytes[self.at] == b'*' && bytes.get(self.at + 1) == Some(&b'/') {
                depth -= 1;
                self.at += 2;
                if depth == 0 {
                    return;
                }
            } else {
                self.at += 1;
            }
        }
    }

    /// Past a `$tag$ … $tag$` body if one starts here (a `$1` parameter does not).
    fn skip_dollar_quoted(&mut self) -> bool {
        let rest = &self.sql[self.at..];
        let Some(close) = rest[1..].find('$') else {
            return false;
        };
        let tag = &rest[..close + 2];
        let valid_tag = tag[1..tag.len() - 1]
            .bytes()
            .enumerate()
            .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
        if !valid_tag {
            return false;
        }
        match rest[tag.len()..].find(tag) {
            Some(end) => self.at += tag.len() + end + tag.len(),
            None => self.at = self.sql.len(),
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::transaction_control;

    #[test]
    fn statements_that_end_or_open_a_transaction_are_found() {
        for sql in [
            "COMMIT",
            "commit work",
            "  END",
            "ROLLBACK",
            "rollback transaction",
            "ABORT",
            "BEGIN",
            "start transaction isolation level serializable",
            "PREPARE TRANSACTION 'x'",
            "COMMIT PREPARED 'x'",
            "INSERT INTO t VALUES (1); COMMIT",
            "/* a comment */ COMMIT",
            "-- a comment\nROLLBACK",
            "/* nested /* comment */ still */ END",
            "SELECT ';'; commit",
        ] {
            assert!(transaction_control(sql).is_some(), "{sql:?} passed");
        }
    }

    #[test]
    fn ordinary_statements_and_nested_units_pass() {
        for sql in [
            "INSERT INTO t VALUES ('COMMIT; ROLLBACK')",
            "UPDATE t SET a = CASE WHEN b THEN 1 ELSE 2 END",
            "SELECT \"commit\" FROM t",
            "DO $$BEGIN RAISE NOTICE 'x'; END$$",
            "DO $body$ BEGIN PERFORM 1; COMMIT; END $body$",
            "SAVEPOINT s1",
            "RELEASE SAVEPOINT s1",
            "ROLLBACK TO SAVEPOINT s1",
            "rollback to s1",
            "ROLLBACK WORK TO SAVEPOINT s1",
            "PREPARE q AS SELECT $1",
            "SELECT $1, $2 WHERE x = 'it''s; commit'",
            "SELECT 1 -- ; commit",
            "",
            ";;",
        ] {
            assert_eq!(transaction_control(sql), None, "{sql:?} refused");
        }
    }
}
