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

use crate::error::Result;

/// What stands between pgbox and PostgreSQL (default [`Pooler::None`]).
///
/// Set it on every component that reaches PostgreSQL through a pooler in transaction mode;
/// see the README's "Running in production: poolers, roles, failover" for what each
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
            Pooler::Transaction => Unit::Transaction(pool.begin().await?),
        })
    }
}

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
/// (or statement) mode: one connection sets a session setting to a random value, a second
/// connection of the pool reads it. A direct connection or a pooler in session mode never
/// shows the value there; a pooler in transaction mode does whenever it hands the second
/// connection the server connection the first one just released (PgBouncer reuses the most
/// recently released one by default, but another client, or a server connection it opened
/// meanwhile, can take that turn). So the probe is made up to [`PROBE_ATTEMPTS`] times, the
/// two connections taking turns at writing: `Some(true)` is never a false alarm, and
/// `Some(false)` after every attempt missed is a miss only on a pooler busy with other
/// clients. `None`: the pool could not lend a second connection within 2 seconds.
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
        return Ok(None);
    };
    let mut seen = false;
    for attempt in 0..PROBE_ATTEMPTS {
        let (writer, reader) = if attempt % 2 == 0 {
            (&mut first, &mut second)
        } else {
            (&mut second, &mut first)
        };
        let marker = uuid::Uuid::now_v7().simple().to_string();
        // Only [0-9a-f] in the marker: safe as a literal.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SELECT pg_catalog.set_config('pgbox.pooler_probe', '{marker}', false)"
        )))
        .execute(&mut **writer)
        .await?;
        let row = sqlx::raw_sql("SELECT pg_catalog.current_setting('pgbox.pooler_probe', true)")
            .fetch_optional(&mut **reader)
            .await?;
        let value: Option<String> = match row {
            Some(row) => sqlx::Row::try_get(&row, 0)?,
            None => None,
        };
        if value.as_deref() == Some(marker.as_str()) {
            seen = true;
            break;
        }
    }
    for conn in [&mut first, &mut second] {
        sqlx::raw_sql("SELECT pg_catalog.set_config('pgbox.pooler_probe', '', false)")
            .execute(&mut **conn)
            .await?;
    }
    Ok(Some(seen))
}

/// How many times [`shares_sessions`] looks before it answers that sessions are not shared.
const PROBE_ATTEMPTS: usize = 6;
