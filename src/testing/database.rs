//! A fresh database per test.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use super::{TestError, server};
use crate::Migrator;

/// Every test database's name starts with this; the kit drops no database whose name does
/// not (and none it did not create).
pub const TEST_DATABASE_PREFIX: &str = "pgbox_test_";

/// Connections in a test database's pool.
const MAX_CONNECTIONS: u32 = 10;

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A throwaway database for one test: created empty under a unique name, migrated with
/// pgbox's schema (unless asked not to), dropped by [`close`](Self::close) or, failing that,
/// when dropped.
///
/// Where the server comes from, looked for once per test process:
/// 1. `PGBOX_TEST_DATABASE_URL`, else `DATABASE_URL`, when set: that server (the URL's
///    database is where the kit connects to create and drop the test databases, so the role
///    needs `CREATEDB`);
/// 2. else a server on `127.0.0.1:5432` that lets the `postgres` role in without a password;
/// 3. else a private cluster started from the distribution's binaries (`$PG_BIN`, else the
///    newest `/usr/lib/postgresql/*/bin`; `initdb` runs as the `postgres` user when the tests
///    run as root) in a temporary directory on a free port, with durability off, shared by
///    the process's tests and stopped (its directory removed) once the process has exited.
///
/// When none works, [`TestError::NoServer`] says what was tried and why each failed.
///
/// Safety: the name is `pgbox_test_` followed by the process id, a counter and random
/// digits; creating it fails rather than reuse a database that exists, and the kit drops
/// only the database it created, by that name.
///
/// ```no_run
/// # async fn f() -> Result<(), pgbox::testing::TestError> {
/// let db = pgbox::testing::TestDatabase::new().await?;
/// sqlx::query("SELECT 1").execute(db.pool()).await?;
/// db.close().await?;
/// # Ok(()) }
/// ```
pub struct TestDatabase {
    name: String,
    url: String,
    admin_url: String,
    pool: PgPool,
    closed: bool,
}

/// The URLs without their password (the server's URL may hold one).
impl std::fmt::Debug for TestDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDatabase")
            .field("name", &self.name)
            .field("url", &crate::secret::redact_url(&self.url))
            .field("admin_url", &crate::secret::redact_url(&self.admin_url))
            .field("pool", &self.pool)
            .field("closed", &self.closed)
            .finish()
    }
}

impl TestDatabase {
    /// A fresh database migrated with pgbox's schema in the default schema (`pgbox`).
    pub async fn new() -> Result<Self, TestError> {
        Self::create(Some(Migrator::new())).await
    }

    /// A fresh database migrated by `migrator` (another schema, a partitioned inbox...).
    pub async fn with_migrator(migrator: Migrator) -> Result<Self, TestError> {
        Self::create(Some(migrator)).await
    }

    /// A fresh, empty database: no pgbox schema (to test your own migrations first).
    pub async fn unmigrated() -> Result<Self, TestError> {
        Self::create(None).await
    }

    async fn create(migrator: Option<Migrator>) -> Result<Self, TestError> {
        let admin_url = server::server_url().await?;
        let name = format!(
            "{TEST_DATABASE_PREFIX}{}_{}_{:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            fastrand::u32(..)
        );
        check_name(&name)?;
        let failed = |reason: String| TestError::Database {
            name: name.clone(),
            reason,
        };
        let url = with_database(&admin_url, &name).map_err(&failed)?;
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .map_err(|e| failed(format!("connect to the server: {e}")))?;
        // From template0: a test database holds nothing of what template1 may have been
        // given, and a session connected to template1 (the kit's own, when the URL names
        // it) cannot make the copy fail.
        let created = sqlx::query(AssertSqlSafe(format!(
            "CREATE DATABASE \"{name}\" TEMPLATE template0"
        )))
        .execute(&mut admin)
        .await;
        let _ = admin.close().await;
        created.map_err(|e| failed(format!("CREATE DATABASE: {e}")))?;
        // From here on the database is ours: drop it on every way out.
        let mut db = TestDatabase {
            pool: PgPoolOptions::new()
                .max_connections(MAX_CONNECTIONS)
                .acquire_timeout(Duration::from_secs(30))
                .connect_lazy(&url)
                .map_err(|e| failed(format!("pool: {e}")))?,
            name,
            url,
            admin_url,
            closed: false,
        };
        // The pool must reach the database just made, and nothing else, before anything
        // (the migrations first) runs there: a URL can name a database other ways than its
        // path.
        let failed = |reason: String| TestError::Database {
            name: db.name.clone(),
            reason,
        };
        let reached: Result<String, TestError> =
            match sqlx::query_scalar("SELECT pg_catalog.current_database()")
                .fetch_one(&db.pool)
                .await
            {
                Ok(current) if current == db.name => Ok(current),
                Ok(current) => Err(failed(format!(
                    "the test database's URL reaches database {current:?}, not the test \
                     database: remove what names a database from the server's URL"
                ))),
                Err(e) => Err(failed(format!("connect to the test database: {e}"))),
            };
        let migrated = match (reached, migrator) {
            (Err(e), _) => Err(e),
            (Ok(_), Some(migrator)) => migrator
                .run(&db.pool)
                .await
                .map(|_| ())
                .map_err(TestError::from),
            (Ok(_), None) => Ok(()),
        };
        if let Err(e) = migrated {
            db.closed = true;
            db.pool.close().await;
            let _ = db.drop_database().await;
            return Err(e);
        }
        Ok(db)
    }

    /// A pool of connections to this database (at most 10).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The database's URL, for a component that connects on its own (a `PgPool` of other
    /// settings, a CLI under test).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's name (`pgbox_test_…`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Closes the pool and drops the database (`WITH (FORCE)`: connections still open to it
    /// are ended, elsewhere or still checked out of this pool, not waited for). Prefer it to
    /// letting the value drop: an error is returned here, while a drop can only log it. A
    /// `close` cut short (its future dropped) leaves the database to the drop.
    pub async fn close(mut self) -> Result<(), TestError> {
        // The pool is closed to new work the moment `close` is called. Its idle connections
        // are closed gracefully, but one still checked out (a transaction the test holds, a
        // task it did not stop) is not waited for, which would be forever: the drop's
        // `FORCE` ends it.
        let closing = self.pool.close();
        if self.pool.num_idle() == self.pool.size() as usize {
            closing.await;
        } else {
            drop(closing);
        }
        let dropped = self.drop_database().await;
        // Only now: a close cut short (its future dropped before this point) leaves the
        // database to `Drop`, as an unclosed one.
        self.closed = true;
        dropped
    }

    async fn drop_database(&self) -> Result<(), TestError> {
        drop_database(&self.admin_url, &self.name).await
    }
}

impl Drop for TestDatabase {
    /// Drops the database if [`close`](Self::close) did not: on a thread of its own with a
    /// runtime of its own (a drop cannot await, and may run on a runtime that is shutting
    /// down), waited for, so that the database is gone when the test returns.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?
                .block_on(drop_database(&admin_url, &name))
                .map_err(|e| e.to_string())
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(database = %self.name, error = %e, "pgbox test kit: could not drop a test database")
            }
            Err(_) => {
                tracing::warn!(database = %self.name, "pgbox test kit: dropping a test database panicked")
            }
        }
    }
}

/// Drops the test database `name` (checked again: only a name of the kit's form).
async fn drop_database(admin_url: &str, name: &str) -> Result<(), TestError> {
    check_name(name)?;
    let failed = |reason: String| TestError::Database {
        name: name.to_owned(),
        reason,
    };
    let mut admin = PgConnection::connect(admin_url)
        .await
        .map_err(|e| failed(format!("connect to the server: {e}")))?;
    let dropped = sqlx::query(AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await;
    let _ = admin.close().await;
    dropped.map_err(|e| failed(format!("DROP DATABASE: {e}")))?;
    Ok(())
}

/// A test database's name: the prefix, then `[a-z0-9_]`, at most 63 bytes.
fn check_name(name: &str) -> Result<(), TestError> {
    let ok = name.len() <= 63
        && name.len() > TEST_DATABASE_PREFIX.len()
        && name.starts_with(TEST_DATABASE_PREFIX)
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(TestError::Database {
            name: name.to_owned(),
            reason: "not a test database name (pgbox_test_ then [a-z0-9_], 63 bytes at most)"
                .into(),
        })
    }
}

/// `url` with its database (the path) replaced by `database`; the query string is kept but
/// for a `dbname` parameter, which would name the database in the path's place.
fn with_database(url: &str, database: &str) -> Result<String, String> {
    let scheme_end = url
        .find("://")
        .filter(|_| url.starts_with("postgres://") || url.starts_with("postgresql://"))
        .ok_or("the server's address must be a postgres:// URL")?
        + 3;
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let query = tail.find('?').map_or("", |at| &tail[at + 1..]);
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let key = pair.split('=').next().unwrap_or_default();
            !pair.is_empty() && crate::percent::decode_query(key) != "dbname"
        })
        .collect();
    let query = if kept.is_empty() {
        String::new()
    } else {
        format!("?{}", kept.join("&"))
    };
    Ok(format!(
        "{}{authority}/{database}{query}",
        &url[..scheme_end]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_of_a_url_is_replaced_and_the_rest_kept() {
        let cases = [
            (
                "postgres://postgres@127.0.0.1:5432/postgres",
                "postgres://postgres@127.0.0.1:5432/pgbox_test_1",
            ),
            (
                "postgresql://u:p%2F@h/db?sslmode=disable&options=-c%20a%3Db",
                "postgresql://u:p%2F@h/pgbox_test_1?sslmode=disable&options=-c%20a%3Db",
            ),
            ("postgres://h:1", "postgres://h:1/pgbox_test_1"),
            (
                "postgres://h?sslmode=require",
                "postgres://h/pgbox_test_1?sslmode=require",
            ),
        ];
        for (url, expected) in cases {
            assert_eq!(
                with_database(url, "pgbox_test_1").unwrap(),
                expected,
                "{url}"
            );
        }
        assert!(with_database("host=h dbname=d", "pgbox_test_1").is_err());
        // A `dbname` parameter would name the database in the path's place: dropped,
        // however it is spelled.
        for url in [
            "postgres://h/postgres?dbname=app",
            "postgres://h/postgres?db%6Eame=app",
            "postgres://h/postgres?sslmode=disable&dbname=app",
        ] {
            let replaced = with_database(url, "pgbox_test_1").unwrap();
            assert!(
                replaced == "postgres://h/pgbox_test_1"
                    || replaced == "postgres://h/pgbox_test_1?sslmode=disable",
                "{url}: {replaced}"
            );
        }
    }

    #[test]
    fn only_names_of_the_kits_form_pass() {
        assert!(check_name("pgbox_test_12_0_abcdef01").is_ok());
        for bad in [
            "postgres",
            "pgbox_test_",
            "pgbox_test_X",
            "pgbox_test_a\"; DROP DATABASE postgres; --",
            "app_pgbox_test_1",
            &format!("pgbox_test_{}", "a".repeat(60)),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
