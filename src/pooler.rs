//! [`Pooler`]: what stands between pgbox and PostgreSQL, and what pgbox does about it.
//!
//! A pooler in **transaction mode** (PgBouncer's `pool_mode = transaction` before 1.21, or
//! with `max_prepared_statements = 0`) hands each transaction, and each autocommit statement,
//! whichever server connection is free. Measured behind Debian's PgBouncer 1.18
//! (`tests/pooler.rs`), with sqlx 0.9:
//!
//! - a **named** prepared statement (sqlx's default: `sqlx_s_N`, cached per client
//!   connection) fails with `prepared statement "sqlx_s_N" already exists` or `does not exist`
//!   when the next transaction lands on another server connection;
//! - an **autocommit** statement with parameters is sent in two steps (parse, then bind and
//!   execute), each ended by a Sync, and the pooler may route the two steps to different
//!   server connections: the bind then runs **another client's statement** with this one's
//!   parameters (an `UPDATE` that failed with a duplicate key of someone else's `INSERT`);
//! - an **unnamed** statement inside an explicit transaction is always right: the transaction
//!   keeps its server connection to the end.
//!
//! With [`Pooler::Transaction`], pgbox sends only unnamed statements, and runs each piece of
//! its own work that is not inside the caller's transaction in a transaction of its own. What
//! needs a session (LISTEN, session advisory locks) needs a direct connection; each component
//! says what it does without one.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use tracing::Instrument;

use crate::error::Result;

/// What stands between pgbox and PostgreSQL (default [`Pooler::None`]).
///
/// Set it on every component that reaches PostgreSQL through a pooler in transaction mode;
/// see the guide's "Poolers" chapter (guide/src/pooler.md) for what each
/// component does there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Pooler {
    /// A direct connection, or a pooler in session mode (a client keeps its server
    /// connection for as long as it is connected): prepared statements are named and cached
    /// per connection, as sqlx does by default.
    #[default]
    None,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction` without prepared
    /// statement tracking): only unnamed statements, only inside transactions, no session
    /// state.
    Transaction,
}

impl Pooler {
    /// Whether sqlx may name (and cache) pgbox's prepared statements.
    pub(crate) fn persistent(self) -> bool {
        self == Pooler::None
    }

    /// Whether a session (LISTEN, a session advisory lock) survives between transactions.
    pub(crate) fn keeps_sessions(self) -> bool {
        self == Pooler::None
    }

    /// A connection for a piece of pgbox's own work outside the caller's transaction: a
    /// pooled connection as it is, or, behind a transaction pooler, a transaction on it that
    /// [`Unit::finish`] commits (dropped unfinished, it rolls back).
    pub(crate) async fn unit(self, pool: &PgPool) -> Result<Unit> {
        Ok(match self {
            Pooler::None => Unit::Plain(pool.acquire().await?),
            Pooler::Transaction => Unit::Transaction(begin(pool, None).await?),
        })
    }

    /// Like [`unit`](Self::unit), but the unit runs at `READ COMMITTED` whatever isolation
    /// level the pool's sessions default to (`default_transaction_isolation`, set by the
    /// server, the database, the role or the pool's `after_connect`). For pgbox's own short
    /// statements that pick rows with `FOR UPDATE SKIP LOCKED` and change them (the queue's
    /// receive, ack, nack): at `REPEATABLE READ` or `SERIALIZABLE`, a row changed by another
    /// session since the statement's snapshot fails the statement with a serialization
    /// error instead of being skipped or re-read, and a failed ack leaves its message hidden
    /// until its visibility timeout.
    ///
    /// `default` caches what the pool's sessions default to: learned once (one query on the
    /// first call), a pool at `READ COMMITTED` keeps plain autocommit statements, any other
    /// level gets a `BEGIN ISOLATION LEVEL READ COMMITTED` transaction. Behind a transaction
    /// pooler the unit is a transaction anyway and always begins that way. The level is read
    /// on one connection, once: a default changed later (`ALTER ROLE ... SET`, a session
    /// `SET` left on a pooled connection) is not seen until the component is rebuilt.
    pub(crate) async fn read_committed_unit(
        self,
        pool: &PgPool,
        default: &SessionIsolation,
    ) -> Result<Unit> {
        const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";
        if self == Pooler::Transaction {
            return Ok(Unit::Transaction(begin(pool, Some(BEGIN)).await?));
        }
        let read_committed = match default.0.get() {
            Some(known) => *known,
            None => {
                let mut conn = pool.acquire().await?;
                let level: String = sqlx::query_scalar(
                    "SELECT pg_catalog.current_setting('default_transaction_isolation')",
                )
                .fetch_one(&mut *conn)
                .await?;
                let read_committed = level == "read committed";
                if !read_committed {
                    tracing::debug!(
                        default_transaction_isolation = level,
                        "pgbox runs its queue statements in READ COMMITTED transactions"
                    );
                }
                let _ = default.0.set(read_committed);
                if read_committed {
                    return Ok(Unit::Plain(conn));
                }
                drop(conn);
                read_committed
            }
        };
        Ok(if read_committed {
            Unit::Plain(pool.acquire().await?)
        } else {
            Unit::Transaction(begin(pool, Some(BEGIN)).await?)
        })
    }
}

/// Begins a transaction on a connection of `pool` (with `statement`, else a plain `BEGIN`),
/// safe to cancel.
///
/// sqlx 0.9.0's own begin is not: cancelled while it waits for the answer to its `BEGIN`
/// (a shutdown, a timeout, a `select!`, a client that hung up), it leaves the server session
/// inside a transaction that nothing ends, and the pool lends the connection on. Whoever
/// takes it next runs inside that transaction: its autocommit statements are never
/// committed and hold their locks, and behind a transaction pooler the session pins a
/// server connection to one client (transact-rs/sqlx#4393, fixed upstream after 0.9.0).
///
/// Here the connection is taken by the caller (a wait for a connection is safe to drop, and
/// a caller that gives up stops waiting), and only the `BEGIN` runs on a task of its own: if
/// the caller stops waiting then, the task still finishes the begin and drops the
/// transaction, which sqlx rolls back before the connection goes back to the pool.
pub(crate) async fn begin(
    pool: &PgPool,
    statement: Option<&'static str>,
) -> Result<Transaction<'static, Postgres>> {
    begin_on(pool.acquire().await?, statement).await
}

/// [`begin`] on a connection already taken from its pool: the `BEGIN` runs on a task of its
/// own, which, if the caller stops waiting, finishes the begin and drops the transaction
/// (sqlx then rolls it back before the connection goes back to the pool).
pub(crate) async fn begin_on(
    conn: PoolConnection<Postgres>,
    statement: Option<&'static str>,
) -> Result<Transaction<'static, Postgres>> {
    let task = tokio::spawn(
        // sqlx's `Pool::begin` is this call on a connection it has just acquired.
        Transaction::begin(conn, statement.map(sqlx::SqlSafeStr::into_sql_str)).in_current_span(),
    );
    match task.await {
        Ok(begun) => Ok(begun?),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(sqlx::Error::Io(std::io::Error::other(
            "the runtime shut down while a transaction was beginning",
        ))
        .into()),
    }
}

/// The isolation level a pool's sessions default to, once learned: see
/// [`Pooler::read_committed_unit`]. Shared by the clones of the component that owns it.
#[derive(Debug, Default)]
pub(crate) struct SessionIsolation(std::sync::OnceLock<bool>);

/// See [`Pooler::unit`].
pub(crate) enum Unit {
    Plain(PoolConnection<Postgres>),
    Transaction(Transaction<'static, Postgres>),
}

impl Unit {
    /// Ends the unit: commits its transaction, if it has one.
    pub(crate) async fn finish(self) -> Result<()> {
        if let Unit::Transaction(tx) = self {
            tx.commit().await?;
        }
        Ok(())
    }
}

impl Deref for Unit {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        match self {
            Unit::Plain(conn) => conn,
            Unit::Transaction(tx) => tx,
        }
    }
}

impl DerefMut for Unit {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Unit::Plain(conn) => conn,
            Unit::Transaction(tx) => tx,
        }
    }
}

/// Whether `pool`'s connections share server sessions, the mark of a pooler in transaction
/// (or statement) mode.
///
/// Two connections of the pool take turns: one sets a session setting to a random value and
/// reports its server backend (`pg_backend_pid()` and the server's start time), the other
/// reads the setting and reports its backend. Sessions are shared when any of these is seen:
///
/// - the value set on one connection read on the other;
/// - the same backend behind both connections (two live direct connections never share one);
/// - one connection behind two different backends of the same server over the probe (a
///   direct connection, or a pooler in session mode, keeps its backend for as long as it is
///   connected; a pooler that sends reads to another server is not counted).
///
/// A pooler in transaction mode shows one of them at almost every turn: it hands the next
/// statement either the server connection the other client just released (PgBouncer reuses
/// the most recently released one by default) or another one. The probe is made up to
/// [`PROBE_ATTEMPTS`] times: `Some(true)` is never a false alarm, and `Some(false)` after
/// every turn saw nothing is a miss only on a pooler that, for every turn, kept each client
/// on a server connection of its own. `None`: the pool could not lend a second connection
/// within 2 seconds.
///
/// Every statement uses the simple protocol, which any pooler passes through whole; the
/// setting (`pgbox.pooler_probe`) is reset afterwards and inert.
pub(crate) async fn shares_sessions(pool: &PgPool) -> Result<Option<bool>> {
    let mut first = pool.acquire().await?;
    // A pool busy with other work may free a connection shortly: wait a little for one.
    let second = match pool.try_acquire() {
        Some(conn) => Some(conn),
        None => tokio::time::timeout(std::time::Duration::from_secs(2), pool.acquire())
            .await
            .ok()
            .transpose()?,
    };
    let Some(mut second) = second else {
        tracing::debug!("pgbox pooler probe: no second connection within 2 s");
        return Ok(None);
    };
    // The backend each connection was last seen on: (server start time, pid).
    let mut backends: [Option<(String, i32)>; 2] = [None, None];
    let mut evidence = None;
    for attempt in 0..PROBE_ATTEMPTS {
        let marker = uuid::Uuid::now_v7().simple().to_string();
        let (writer, reader) = (attempt % 2, 1 - attempt % 2);
        let (w, r) = if writer == 0 {
            (&mut first, &mut second)
        } else {
            (&mut second, &mut first)
        };
        // Only [0-9a-f] in the marker: safe as a literal.
        let written = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SELECT pg_catalog.pg_postmaster_start_time()::text, pg_catalog.pg_backend_pid(), \
             pg_catalog.set_config('pgbox.pooler_probe', '{marker}', false)"
        )))
        .fetch_one(&mut **w)
        .await?;
        let read = sqlx::raw_sql(
            "SELECT pg_catalog.pg_postmaster_start_time()::text, pg_catalog.pg_backend_pid(), \
             pg_catalog.current_setting('pgbox.pooler_probe', true)",
        )
        .fetch_one(&mut **r)
        .await?;
        let backend = |row: &sqlx::postgres::PgRow| -> Result<(String, i32)> {
            Ok((sqlx::Row::try_get(row, 0)?, sqlx::Row::try_get(row, 1)?))
        };
        let (written_on, read_on) = (backend(&written)?, backend(&read)?);
        let value: Option<String> = sqlx::Row::try_get(&read, 2)?;
        tracing::trace!(
            attempt,
            writer_pid = written_on.1,
            reader_pid = read_on.1,
            seen = value.as_deref() == Some(marker.as_str()),
            "pgbox pooler probe"
        );
        if value.as_deref() == Some(marker.as_str()) {
            evidence = Some("a setting made on one connection was read on the other");
        } else if written_on == read_on {
            evidence = Some("both connections ran on the same server backend");
        } else if [(writer, &written_on), (reader, &read_on)].into_iter().any(
            |(i, (started, pid))| {
                // Two backends of the same server: a pooler that splits reads from writes
                // (to a standby, another server) may keep sessions all the same.
                backends[i]
                    .as_ref()
                    .is_some_and(|(was_started, was_pid)| was_started == started && was_pid != pid)
            },
        ) {
            evidence = Some("one connection ran on two backends of the same server");
        }
        backends[writer] = Some(written_on);
        backends[reader] = Some(read_on);
        if evidence.is_some() {
            break;
        }
    }
    for conn in [&mut first, &mut second] {
        sqlx::raw_sql("SELECT pg_catalog.set_config('pgbox.pooler_probe', '', false)")
            .execute(&mut **conn)
            .await?;
    }
    tracing::debug!(
        shared = evidence.is_some(),
        evidence = evidence.unwrap_or("none"),
        "pgbox pooler probe"
    );
    Ok(Some(evidence.is_some()))
}

/// How many times [`shares_sessions`] looks before it answers that sessions are not shared.
const PROBE_ATTEMPTS: usize = 6;

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The places allowed to begin a transaction some other way than [`super::begin`]:
    /// each on a connection that is never handed back to a pool in an unknown state (the
    /// begin itself; the migrator's session, closed on drop; the janitor's own session,
    /// thrown away after a failed pass; a connection the caller holds, documented).
    const OTHER_BEGINS: &[(&str, usize)] = &[
        ("pooler.rs", 1),
        ("migrate.rs", 1),
        ("janitor.rs", 1),
        ("inbox/committing.rs", 1),
    ];

    fn begins_in(dir: &Path, root: &Path, found: &mut Vec<(String, usize, String)>) {
        for entry in std::fs::read_dir(dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                begins_in(&path, root, found);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read source");
            let name = path
                .strip_prefix(root)
                .expect("under src")
                .to_string_lossy()
                .replace('\\', "/");
            // Library code only: a file's unit tests follow its `#[cfg(test)]`.
            let library = text.split("#[cfg(test)]").next().unwrap_or_default();
            for (n, line) in library.lines().enumerate() {
                let code = line.trim_start();
                if code.starts_with("//") {
                    continue;
                }
                let begins = code.contains(".begin()")
                    || code.contains(".begin_with(")
                    || code.contains("Transaction::begin(");
                if begins && (code.contains(".await") || code.contains("Transaction::begin(")) {
                    found.push((name.clone(), n + 1, code.to_owned()));
                }
            }
        }
    }

    /// sqlx 0.9.0's own begin, dropped while its `BEGIN` is on the wire, leaves the session
    /// inside a transaction that the pool then lends on (#34.13, and `DeadLetters::replay`
    /// after it). Every transaction pgbox begins on a pool goes through `pooler::begin`;
    /// this keeps a new call site from slipping back to `pool.begin()`.
    #[test]
    fn every_begin_on_a_pool_goes_through_pooler_begin() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut found = Vec::new();
        begins_in(&root, &root, &mut found);
        let mut unexpected = Vec::new();
        for (file, allowed) in OTHER_BEGINS {
            let here: Vec<_> = found.iter().filter(|(f, _, _)| f == file).collect();
            if here.len() != *allowed {
                unexpected.push(format!(
                    "{file}: {} begins, {allowed} allowed: {here:?}",
                    here.len()
                ));
            }
        }
        for site in &found {
            if !OTHER_BEGINS.iter().any(|(f, _)| *f == site.0) {
                unexpected.push(format!("{}:{}: {}", site.0, site.1, site.2));
            }
        }
        assert!(
            unexpected.is_empty(),
            "begin a transaction on a pool with pooler::begin (drop-safe), not sqlx's begin: {unexpected:#?}"
        );
    }
}
