//! The pooler: whether the pool's connections keep their sessions, or go through a pooler in
//! transaction mode that hands each transaction whichever server connection is free.
//!
//! The probe: one connection sets a session setting to a random value; a second connection of
//! the pool reads it. Only a pooler that hands one client's server session to another shows
//! the value there. It can miss (a busy pooler may give the second connection another server
//! connection), never raise a false alarm.

use super::*;

impl Doctor {
    pub(super) async fn check_pooler(&self, pool: &PgPool) -> Result<Finding> {
        let seen = crate::pooler::shares_sessions(pool).await?;
        let details = json!({ "probed": seen.is_some() });
        Ok(match seen {
            Some(true) => Finding::new(
                Severity::Warning,
                Code::TransactionPooler,
                "this pool's connections go through a pooler in transaction mode: a session \
                 setting made on one connection was seen on another, so server sessions are \
                 shared between clients (PgBouncer pool_mode = transaction, or statement)"
                    .to_owned(),
                "Build pgbox's components with Pooler::Transaction (inbox, outbox, relay, \
                 queue), which sends only unnamed statements inside transactions; give the \
                 relay and the queue a session_pool of direct connections for LISTEN (else \
                 they poll); run migrations and the janitor on a direct connection. Your own \
                 statements need .persistent(false) and a transaction. See the README, \
                 \"Behind a pooler in transaction mode\"."
                    .to_owned(),
            ),
            Some(false) => Finding::new(
                Severity::Ok,
                Code::PoolerOk,
                "sessions stay with their connection (a direct connection, or a pooler in \
                 session mode)"
                    .to_owned(),
                "Nothing to do. (The probe can miss a busy pooler in transaction mode: if one \
                 is in between, configure pgbox for it as the README's \"Behind a pooler in \
                 transaction mode\" says.)"
                    .to_owned(),
            ),
            None => Finding::new(
                Severity::Ok,
                Code::PoolerOk,
                "not probed: the pool could not lend a second connection".to_owned(),
                "Give the doctor a pool of at least two connections to probe for a pooler in \
                 transaction mode."
                    .to_owned(),
            ),
        }
        .details(details))
    }
}
