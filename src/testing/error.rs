//! The test kit's error.

use std::time::Duration;

/// What went wrong in the test kit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestError {
    /// No PostgreSQL server could be found or started. `tried` lists each way that was tried
    /// and why it did not work.
    #[error("no PostgreSQL server for the tests; tried:\n{tried}")]
    NoServer {
        /// One line per way tried.
        tried: String,
    },

    /// The server was found, but a test database could not be made or dropped there (the
    /// role cannot create databases, the server refused the connection...).
    #[error("test database {name:?}: {reason}")]
    Database {
        /// The test database's name.
        name: String,
        /// What failed.
        reason: String,
    },

    /// [`run_until_idle`](super::run_until_idle) did not see the relay and the consumer idle
    /// in time: a handler that keeps failing, a message waiting out a long backoff, a
    /// visibility timeout longer than the limit...
    #[error("not idle after {waited:?}: {state}")]
    NotIdle {
        /// How long it waited.
        waited: Duration,
        /// What was still pending when it gave up.
        state: String,
    },

    /// An error of pgbox's (a migration, a relay round, the consumer's run, a query).
    #[error(transparent)]
    Pgbox(#[from] crate::Error),
}

impl From<sqlx::Error> for TestError {
    fn from(e: sqlx::Error) -> Self {
        TestError::Pgbox(e.into())
    }
}
