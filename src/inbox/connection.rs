//! The connection a handler runs on: the claim's transaction, watched for failed statements.

use std::fmt;
use std::ops::{Deref, DerefMut};

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use sqlx::postgres::{
    PgArguments, PgQueryResult, PgRow, PgStatement, PgTransactionManager, PgTypeInfo,
};
use sqlx::{Either, Execute, Executor, PgConnection, Postgres, SqlStr};
use sqlx_core::transaction::TransactionManager;

use crate::pooler::Pooler;

/// The claim's transaction, as a handler sees it. Use it like a `&mut PgConnection`:
/// `sqlx::query(…).execute(&mut *conn)`, or pass `conn` (or `&mut *conn`) where a
/// `&mut PgConnection` is expected.
///
/// **Nested units of work are savepoints.** The connection is inside a transaction sqlx
/// knows about, so `conn.begin()` (or any API that begins a `Transaction` on it) opens a
/// savepoint: its `commit()` releases the savepoint and its `rollback()` undoes only the
/// nested unit, never the inbox's transaction. pgbox compares sqlx's transaction depth
/// with the claim's level (no round trip), and these are never reported `Processed`:
///
/// - *A nested `begin` that fails or is given up.* sqlx 0.9.0 then rolls back the level
///   *enclosing* the nested unit (a `SAVEPOINT` refused in an aborted transaction, or a
///   `begin` dropped while its `SAVEPOINT` awaits the answer, queues a top-level `ROLLBACK`):
///   the inbox's transaction is over. From then on every statement through the wrapper, and
///   every pgbox row helper on it, is refused before anything is sent (so nothing runs, let
///   alone commits, outside the transaction), and the handler's `Ok` becomes
///   [`Error::TransactionEndedInHandler`]. Return the error instead of carrying on.
/// - *A nested unit left open* (`mem::forget`, a leaked `Box`): the caller's commit would
///   only release its savepoint. pgbox rolls the open units back, aborts the transaction and
///   reports [`Error::TransactionEndedInHandler`]; with `process_and_commit` the pool gets
///   the connection back outside any transaction.
/// - *`ROLLBACK TO` a savepoint older than the claim* (one the caller took before calling
///   [`Inbox::process`](crate::Inbox::process) on a nested unit): it undoes the claim while
///   the transaction goes on. After a `ROLLBACK TO` through the wrapper (or any use of the
///   raw connection), the liveness check also asks for the claim's row, written in this
///   transaction: gone, the answer is [`Error::TransactionEndedInHandler`]. A handler that
///   sends no `ROLLBACK TO` pays nothing for this.
/// - *Transaction control inside a nested unit* (a `COMMIT` or `ROLLBACK` sent on the unit)
///   is reported as [`Error::TransactionEndedInHandler`] too, not as the database error of the
///   unit's own `RELEASE`/`ROLLBACK TO` that followed it.
///
/// **Nothing sent through the wrapper ends the inbox's transaction.** Two rules give this:
///
/// - *One statement per call, enforced by the server.* Every query goes out with the
///   extended protocol (Parse, Bind, Execute), `sqlx::raw_sql` and plain `&str` queries
///   included, and the server refuses a text that holds more than one statement (SQLSTATE
///   `42601`, "cannot insert multiple commands into a prepared statement"). So
///   `SELECT E'\''; COMMIT; …` fails as a whole, whatever its quotes, escapes,
///   `standard_conforming_strings`, Unicode identifiers or dollar tags. Send a script's
///   statements one call at a time. (A refused text aborts the transaction like any failed
///   statement: a handler that swallows the error and returns `Ok` gets
///   [`Error::TransactionAbortedInHandler`], never `Processed`.)
/// - *That one statement may not be transaction control.* `BEGIN`, `START`, `COMMIT`,
///   `END`, `ROLLBACK` (other than `ROLLBACK TO SAVEPOINT`), `ABORT` and `PREPARE
///   TRANSACTION` are refused with an error before they reach the server. Every statement of
///   PostgreSQL's grammar that ends a transaction begins with one of these keywords, and
///   pgbox reads the words before it the way the server's lexer does (whitespace, `--` and
///   nested `/* */` comments, empty statements); a differential test against a real server
///   checks this on generated texts. `DO` blocks and procedures that `COMMIT` are refused by
///   the server inside a transaction block.
///
/// **The raw connection is not covered.** A statement sent on `&mut **conn` (the
/// `PgConnection` behind the wrapper), or inside a nested unit from `conn.begin()` (its
/// `Transaction` sits on the raw connection), goes out unread. If it ends the transaction and the
/// handler returns `Ok`, pgbox finds out before reporting anything:
/// [`Error::TransactionEndedInHandler`], never `Processed`. If the handler returns an error
/// instead, what it did up to the `COMMIT` has already committed together with the inbox
/// row, so the redelivery is a duplicate: never send transaction control there.
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
/// [`Error::TransactionAbortedInHandler`]: crate::Error::TransactionAbortedInHandler
pub struct HandlerConnection<'c> {
    conn: &'c mut PgConnection,
    /// sqlx's transaction depth when the handler got the connection: the claim's level.
    depth: usize,
    /// A statement sent through the wrapper failed (and whether it lost the connection).
    failed: Failed,
    /// The raw connection was handed out; what happened on it is unknown.
    unwatched: bool,
    /// A `ROLLBACK TO` went through the wrapper: it may have named a savepoint older than
    /// the claim, so the claim's row is checked before success is reported. (On the raw
    /// connection statements are not read: there only the transaction is checked, which
    /// keeps that common path free of a read of the inbox row.)
    rolled_back_to: bool,
    /// Behind a transaction pooler: every statement goes unnamed.
    unnamed: bool,
}

/// The check a handler's run leaves owed before success may be reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Every statement went through the wrapper and succeeded: nothing to check.
    None,
    /// The transaction is alive and still the claiming one (a statement failed, or the raw
    /// connection was handed out).
    Alive,
    /// That, and the claim's row is still there: a `ROLLBACK TO` went through the wrapper.
    /// Costs one index look-up more, inside the same round trip.
    AliveAndClaimed,
}

/// Where sqlx's transaction depth stands after the handler, against the claim's level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nesting {
    /// At the claim's level: every nested unit the handler opened was ended.
    Level,
    /// Below it: sqlx rolled back (or queued a rollback of) the level the claim is in, as it
    /// does when a nested `begin` fails or is dropped while its `SAVEPOINT` is on the wire.
    Below,
    /// Above it by this many levels: nested units left open (leaked, forgotten), whose
    /// savepoints a commit would only release.
    Above(usize),
}

/// Whether a statement sent through the handler's connection failed, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Failed {
    No,
    Yes,
    ConnectionLost,
}

impl Failed {
    /// Records a statement's error (the worst one seen stays).
    fn note(&mut self, error: &sqlx::Error) {
        let this = if crate::DbErrorKind::classify(error) == crate::DbErrorKind::ConnectionLost {
            Failed::ConnectionLost
        } else {
            Failed::Yes
        };
        *self = (*self).max(this);
    }
}

impl<'c> HandlerConnection<'c> {
    pub(crate) fn new(conn: &'c mut PgConnection, pooler: Pooler) -> Self {
        HandlerConnection {
            depth: PgTransactionManager::get_transaction_depth(conn),
            conn,
            failed: Failed::No,
            unwatched: false,
            rolled_back_to: false,
            unnamed: !pooler.persistent(),
        }
    }

    /// sqlx's transaction depth now, against the claim's level.
    pub(crate) fn nesting(&self) -> Nesting {
        let now = PgTransactionManager::get_transaction_depth(self.conn);
        match now.cmp(&self.depth) {
            std::cmp::Ordering::Equal => Nesting::Level,
            std::cmp::Ordering::Less => Nesting::Below,
            std::cmp::Ordering::Greater => Nesting::Above(now - self.depth),
        }
    }

    /// The error a statement gets instead of being sent once sqlx has rolled back the
    /// claim's level: sending anything would first flush sqlx's queued `ROLLBACK` and then
    /// run the statement outside the inbox's transaction (in autocommit at the top level).
    fn refusal_if_ended(&mut self) -> Option<sqlx::Error> {
        if self.nesting() != Nesting::Below {
            return None;
        }
        self.failed = self.failed.max(Failed::Yes);
        tracing::error!(
            "pgbox refused a handler's statement: the inbox's transaction was rolled back under it \
             (a nested unit's begin failed or was given up)"
        );
        Some(sqlx::Error::InvalidArgument(
            "pgbox: the inbox's transaction was rolled back inside the handler (sqlx rolls back \
             the enclosing transaction when a nested `begin` fails or is dropped before it \
             finishes); nothing more can be sent on this connection: return an error"
                .to_owned(),
        ))
    }

    /// A statement sent on the handler's behalf failed.
    pub(crate) fn mark_failed(&mut self) {
        self.failed = self.failed.max(Failed::Yes);
    }

    /// A statement sent through the wrapper lost the connection (the server or the network
    /// went away under the handler): whatever the handler then returned, the database was
    /// away, not the message at fault.
    pub(crate) fn connection_lost(&self) -> bool {
        self.failed == Failed::ConnectionLost
    }

    /// What the inbox must check before reporting success: whether the transaction may have
    /// been aborted or ended behind the handler's back, and whether a `ROLLBACK TO` may have
    /// undone the claim.
    pub(crate) fn needs_check(&self) -> Check {
        if self.rolled_back_to {
            Check::AliveAndClaimed
        } else if self.failed != Failed::No || self.unwatched {
            Check::Alive
        } else {
            Check::None
        }
    }
}

impl fmt::Debug for HandlerConnection<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerConnection")
            .field("failed", &self.failed)
            .field("unwatched", &self.unwatched)
            .field("rolled_back_to", &self.rolled_back_to)
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
        if let Some(refused) = self.refusal_if_ended() {
            return futures_util::stream::once(async move { Err(refused) }).boxed();
        }
        let failed = &mut self.failed;
        match Screened::new(query, self.unnamed, &mut self.rolled_back_to) {
            Ok(query) => (&mut *self.conn)
                .fetch_many(query)
                .inspect(move |r| {
                    if let Err(e) = r {
                        failed.note(e);
                    }
                })
                .boxed(),
            Err(refused) => {
                *failed = (*failed).max(Failed::Yes);
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
        if let Some(refused) = self.refusal_if_ended() {
            return futures_util::future::ready(Err(refused)).boxed();
        }
        let failed = &mut self.failed;
        match Screened::new(query, self.unnamed, &mut self.rolled_back_to) {
            Ok(query) => (&mut *self.conn)
                .fetch_optional(query)
                .inspect(move |r| {
                    if let Err(e) = r {
                        failed.note(e);
                    }
                })
                .boxed(),
            Err(refused) => {
                *failed = (*failed).max(Failed::Yes);
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
        if let Some(refused) = self.refusal_if_ended() {
            return futures_util::future::ready(Err(refused)).boxed();
        }
        let failed = &mut self.failed;
        (&mut *self.conn)
            .prepare_with(sql, parameters)
            .inspect(move |r| {
                if let Err(e) = r {
                    failed.note(e);
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
        if let Some(refused) = self.refusal_if_ended() {
            return futures_util::future::ready(Err(refused)).boxed();
        }
        let failed = &mut self.failed;
        (&mut *self.conn)
            .describe(sql)
            .inspect(move |r| {
                if let Err(e) = r {
                    failed.note(e);
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
    /// The connection, for one statement (refused before it is sent when the handler's
    /// transaction was rolled back under it: see [`HandlerConnection`]).
    #[doc(hidden)]
    fn connection(&mut self) -> OneStatement<'_>;
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
    fn connection(&mut self) -> OneStatement<'_> {
        OneStatement {
            conn: self,
            refused: None,
        }
    }
}

impl ConnectionLike for sqlx::Transaction<'_, Postgres> {
    fn connection(&mut self) -> OneStatement<'_> {
        OneStatement {
            conn: self,
            refused: None,
        }
    }
}

impl ConnectionLike for sqlx::pool::PoolConnection<Postgres> {
    fn connection(&mut self) -> OneStatement<'_> {
        OneStatement {
            conn: self,
            refused: None,
        }
    }
}

impl ConnectionLike for HandlerConnection<'_> {
    fn connection(&mut self) -> OneStatement<'_> {
        let refused = self.refusal_if_ended();
        OneStatement {
            conn: self.conn,
            refused,
        }
    }
    fn statement_failed(&mut self) {
        self.failed = self.failed.max(Failed::Yes);
    }
    fn persistent(&self) -> bool {
        !self.unnamed
    }
}

/// The executor [`ConnectionLike::connection`] lends for one statement: the connection, or
/// the error the statement gets instead of being sent.
#[doc(hidden)]
#[derive(Debug)]
pub struct OneStatement<'a> {
    conn: &'a mut PgConnection,
    refused: Option<sqlx::Error>,
}

impl<'a> Executor<'a> for OneStatement<'a> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'a: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        match self.refused {
            None => self.conn.fetch_many(query),
            Some(refused) => futures_util::stream::once(async move { Err(refused) }).boxed(),
        }
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'a: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        match self.refused {
            None => self.conn.fetch_optional(query),
            Some(refused) => futures_util::future::ready(Err(refused)).boxed(),
        }
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, sqlx::Error>>
    where
        'a: 'e,
    {
        match self.refused {
            None => self.conn.prepare_with(sql, parameters),
            Some(refused) => futures_util::future::ready(Err(refused)).boxed(),
        }
    }

    fn describe<'e>(
        self,
        sql: SqlStr,
    ) -> BoxFuture<'e, Result<sqlx_core::describe::Describe<Postgres>, sqlx::Error>>
    where
        'a: 'e,
    {
        match self.refused {
            None => self.conn.describe(sql),
            Some(refused) => futures_util::future::ready(Err(refused)).boxed(),
        }
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
    fn new<'q, E: Execute<'q, Postgres>>(
        mut query: E,
        unnamed: bool,
        rolled_back_to: &mut bool,
    ) -> Result<Self, sqlx::Error> {
        // A query without arguments (`raw_sql`, a `&str`) would go out as a simple Query
        // message, in which the server runs every statement of the text. Empty arguments
        // send it through Parse/Bind/Execute instead, where the server refuses a second
        // statement: a COMMIT cannot hide behind a quote, an escape or a tag pgbox misread.
        let arguments = match query.take_arguments() {
            Ok(None) => Ok(Some(PgArguments::default())),
            other => other,
        };
        let arguments = Some(arguments);
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
        if rolls_back_to_a_savepoint(sql.as_str()) {
            // It may name a savepoint older than the claim (the caller's, holding the claim
            // in a nested unit) and undo the claim while the transaction goes on.
            *rolled_back_to = true;
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
///
/// Only the first words of the text are read: the text goes to the server as one
/// extended-protocol statement (see [`Screened::new`]), which the server refuses to hold a
/// second statement, and the grammar's transaction statements all begin with their keyword.
/// What may stand before it is what the server's lexer skips (whitespace, comments, empty
/// statements), read the way it reads them.
fn transaction_control(sql: &str) -> Option<&'static str> {
    let words = leading_words(sql);
    let word = |i: usize| words.get(i).map(|w| w.to_ascii_uppercase());
    let second = word(1);
    match word(0).as_deref() {
        Some("BEGIN") | Some("START") => Some("BEGIN"),
        Some("COMMIT") | Some("END") => Some("COMMIT"),
        Some("ABORT") => Some("ROLLBACK"),
        Some("ROLLBACK") => {
            // `ROLLBACK [WORK | TRANSACTION] TO [SAVEPOINT] name` undoes a nested unit.
            let to = match second.as_deref() {
                Some("WORK") | Some("TRANSACTION") => word(2),
                _ => second,
            };
            (to.as_deref() != Some("TO")).then_some("ROLLBACK")
        }
        Some("PREPARE") if second.as_deref() == Some("TRANSACTION") => Some("PREPARE TRANSACTION"),
        _ => None,
    }
}

/// Whether `sql` is `ROLLBACK [WORK | TRANSACTION] TO …`, read as [`transaction_control`]
/// reads it.
fn rolls_back_to_a_savepoint(sql: &str) -> bool {
    let words = leading_words(sql);
    let is = |i: usize, w: &str| words.get(i).is_some_and(|x| x.eq_ignore_ascii_case(w));
    is(0, "ROLLBACK") && (is(1, "TO") || ((is(1, "WORK") || is(1, "TRANSACTION")) && is(2, "TO")))
}

/// The first three words of the first statement of `sql`, as PostgreSQL's lexer reads them
/// (`scan.l`): whitespace is `[ \t\n\r\f\v]`; a `--` comment runs to `\n` or `\r`; `/* */`
/// comments nest; empty statements (`;`) before the first word are dropped by the grammar.
/// A word is `[A-Za-z\x80-\xff_][A-Za-z\x80-\xff_0-9$]*`: a non-ASCII letter or a `$` is
/// part of it, so `COMMITé` is one identifier, never the keyword. Reading stops at anything
/// else (a quote, an operator): no transaction statement has one before its deciding words.
fn leading_words(sql: &str) -> Vec<&str> {
    let bytes = sql.as_bytes();
    let word_start = |b: u8| b.is_ascii_alphabetic() || b == b'_' || b >= 0x80;
    let word_rest = |b: u8| word_start(b) || b.is_ascii_digit() || b == b'$';
    let mut words = Vec::new();
    let mut at = 0;
    while at < bytes.len() && words.len() < 3 {
        match bytes[at] {
            b' ' | b'\t' | b'\n' | b'\r' | b'\x0c' | b'\x0b' => at += 1,
            b';' if words.is_empty() => at += 1,
            b'-' if bytes.get(at + 1) == Some(&b'-') => {
                while at < bytes.len() && bytes[at] != b'\n' && bytes[at] != b'\r' {
                    at += 1;
                }
            }
            b'/' if bytes.get(at + 1) == Some(&b'*') => at = past_block_comment(bytes, at),
            b if word_start(b) => {
                let start = at;
                while at < bytes.len() && word_rest(bytes[at]) {
                    at += 1;
                }
                // A word ends on an ASCII byte or at the end, both char boundaries.
                words.push(&sql[start..at]);
            }
            _ => break,
        }
    }
    words
}

/// The position past the `/* … */` comment starting at `at` (the end of the text if it is
/// not closed, where the server reports an error); comments nest.
fn past_block_comment(bytes: &[u8], mut at: usize) -> usize {
    let mut depth = 0usize;
    while at < bytes.len() {
        if bytes[at] == b'/' && bytes.get(at + 1) == Some(&b'*') {
            depth += 1;
            at += 2;
        } else if bytes[at] == b'*' && bytes.get(at + 1) == Some(&b'/') {
            depth -= 1;
            at += 2;
            if depth == 0 {
                return at;
            }
        } else {
            at += 1;
        }
    }
    at
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
            "PREPARE/**/TRANSACTION 'x'",
            "COMMIT PREPARED 'x'",
            "ROLLBACK PREPARED 'x'",
            "/* a comment */ COMMIT",
            "-- a comment\nROLLBACK",
            "-- a comment ended by a carriage return\rCOMMIT",
            "/* nested /* comment */ still */ END",
            "/*/ not closed by this slash */ END",
            "; ;COMMIT",
            "\x0b\x0cEND",
            "COMMIT;",
            "COMMIT'x'",
            "ROLLBACK \"TO\" s1",
            "ROLLBACK; TO s1",
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
            "\"COMMIT\"",
            "DO $$BEGIN RAISE NOTICE 'x'; END$$",
            "DO $body$ BEGIN PERFORM 1; COMMIT; END $body$",
            "SAVEPOINT s1",
            "RELEASE SAVEPOINT s1",
            "ROLLBACK TO SAVEPOINT s1",
            "rollback to s1",
            "ROLLBACK WORK TO SAVEPOINT s1",
            "ROLLBACK /* c */ TO s1",
            "PREPARE q AS SELECT $1",
            "PREPARE \"TRANSACTION\" AS SELECT 1",
            "SELECT $1, $2 WHERE x = 'it''s; commit'",
            "SELECT 1 -- ; commit",
            // Identifiers, not keywords: a non-ASCII letter or a `$` belongs to the word.
            "COMMITé",
            "éCOMMIT",
            "COMMIT$",
            "\u{a0}COMMIT",
            "",
            ";;",
        ] {
            assert_eq!(transaction_control(sql), None, "{sql:?} refused");
        }
    }

    #[test]
    fn a_second_statement_is_left_to_the_server() {
        // The text goes out as one extended-protocol statement, which the server refuses
        // to hold two; reading past the first statement would be guessing at quotes.
        for sql in [
            "INSERT INTO t VALUES (1); COMMIT",
            r"SELECT E'\''; COMMIT; SELECT 'x'",
            "SELECT 1 AS é$$; COMMIT; SELECT 1 AS ê$$",
        ] {
            assert_eq!(transaction_control(sql), None, "{sql:?}");
        }
    }
}
