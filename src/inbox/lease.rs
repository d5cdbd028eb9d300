//! Lease mode: deduplicate a handler whose effect is outside the database.
//!
//! The transactional inbox records a key in the same transaction as the handler's writes. An
//! HTTP call, an email or a write to another store cannot join that transaction. Lease mode
//! marks the key CONSUMING under a lease, runs the effect with no transaction or connection
//! held, then marks it CONSUMED:
//!
//! - [`Inbox::lease`] is one autocommit statement. It answers [`LeaseAttempt::Leased`] (a
//!   new key, or an expired lease taken over), [`LeaseAttempt::Duplicate`] (already
//!   consumed, by either mode) or [`LeaseAttempt::InProgress`] (a live lease elsewhere).
//! - Every lease carries a [`FencingToken`], drawn from a database sequence: it grows with
//!   every lease and takeover and is never reused. [`Lease::complete`], [`Lease::extend`] and
//!   [`Lease::release`] act only while the key is still this token's; a stale holder gets
//!   [`Error::LeaseLost`]. Hand the token to the external call so that the remote side can
//!   refuse a stale holder too.
//! - Expiry is computed and compared by the database (`now()`), never by a client's clock.
//! - Lease state lives in the `inbox` table itself (columns `lease_token`,
//!   `lease_expires_at`), so both modes share one key space per consumer.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;
use tracing::Instrument;

use super::{Duplicate, Inbox, Key, outcome_json};
use crate::error::{Error, Result};
use crate::ident::Identifier;

/// The shortest lease [`Inbox::lease`] and [`Lease::extend`] accept.
pub const MIN_LEASE_TTL: Duration = Duration::from_millis(1);

/// The longest lease accepted: one day. A holder that dies keeps its key this long; long
/// effects should [`extend`](Lease::extend) a shorter lease instead.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// A fencing token: identifies one lease of one key. Every lease and every takeover draws a
/// new token from one database sequence, so a later holder always has a larger token than
/// the holders before it, and a token is never reused (not even after a purge).
///
/// Pass it to the external call, as a version the remote side checks ("refuse any token
/// lower than the highest seen for this resource") or inside an idempotency key, so that a
/// holder that stalled past its lease can be refused there as it is refused here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(i64);

impl FencingToken {
    /// The token as a number (positive).
    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The result of [`Inbox::lease`].
#[derive(Debug)]
#[must_use = "a lease must be completed or released; a duplicate acked; in-progress redelivered"]
pub enum LeaseAttempt {
    /// This caller holds the key until the lease expires: run the effect, then
    /// [`complete`](Lease::complete) (or [`release`](Lease::release) after a failure).
    Leased(Lease),
    /// Already consumed (by a completed lease or by the transactional
    /// [`process`](Inbox::process)), with the stored outcome. Nothing to do: ack.
    Duplicate(Duplicate),
    /// Someone else holds a live lease. Redeliver later, not before `retry_after`.
    InProgress {
        /// When the live lease expires (database clock).
        expires_at: OffsetDateTime,
        /// How long until then, computed by the database (no client clock involved).
        retry_after: Duration,
    },
}

/// The result of [`Inbox::run_leased`].
#[derive(Debug, Clone, PartialEq)]
#[must_use = "tells whether the effect ran; ack unless InProgress"]
pub enum LeasedRun<T> {
    /// The handler ran under the lease with this token, and the key is now consumed.
    Completed {
        /// What the handler returned (stored unless it is JSON `null` or storing is off).
        value: T,
        /// The lease's fencing token.
        token: FencingToken,
    },
    /// Already consumed; the handler did not run.
    Duplicate(Duplicate),
    /// Someone else holds a live lease; the handler did not run. Redeliver later.
    InProgress {
        /// When the live lease expires (database clock).
        expires_at: OffsetDateTime,
        /// How long until then, computed by the database.
        retry_after: Duration,
    },
}

impl<T> LeasedRun<T> {
    /// Whether the message is finished with (everything but [`LeasedRun::InProgress`]).
    pub fn should_ack(&self) -> bool {
        !matches!(self, LeasedRun::InProgress { .. })
    }
}

/// A held lease on one key: its fencing token, its key, and its expiry.
///
/// Holding one holds no connection and no transaction. Dropping it gives nothing up: the
/// lease simply expires, and the next [`Inbox::lease`] of the key after that takes it over.
#[derive(Clone)]
#[must_use = "complete or release the lease"]
pub struct Lease {
    inbox: Inbox,
    key: String,
    token: FencingToken,
    expires_at: OffsetDateTime,
    taken_over_from: Option<FencingToken>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("consumer", &self.inbox.consumer())
            .field("key", &self.key)
            .field("token", &self.token)
            .field("expires_at", &self.expires_at)
            .field("taken_over_from", &self.taken_over_from)
            .finish()
    }
}

/// Lease SQL, built once per inbox with the schema validated and quoted.
#[derive(Debug)]
pub(super) struct LeaseStatements {
    lease: Arc<str>,
    complete: Arc<str>,
    extend: Arc<str>,
    release: Arc<str>,
}

impl LeaseStatements {
    pub(super) fn new(schema: &Identifier) -> Self {
        let s = schema.quoted();
        // complete, extend and release: one statement each. The guarded write touches the
        // row only if it is still under this token's lease; the LEFT JOIN reads what holds
        // the key otherwise, for the error (same snapshot, so it may predate a concurrent
        // change; it is only reported).
        let current = format!(
            "FROM (SELECT 1) AS one LEFT JOIN {s}.inbox AS i ON i.consumer = $1 AND i.key = $2"
        );
        LeaseStatements {
            lease: format!(
                "SELECT r_state, r_token, r_previous_token, r_expires_at, r_remaining_us, \
                        r_processed_at, r_message_id, r_outcome, r_rejection \
                 FROM {s}.inbox_lease($1, $2, $3, $4)"
            )
            .into(),
            complete: format!(
                "WITH done AS (\
                   UPDATE {s}.inbox SET outcome = $4, lease_expires_at = NULL, processed_at = pg_catalog.now() \
                   WHERE consumer = $1 AND key = $2 AND lease_token = $3 \
                     AND lease_expires_at IS NOT NULL RETURNING 1) \
                 SELECT (SELECT pg_catalog.count(*) FROM done), i.lease_token, i.lease_expires_at IS NOT NULL \
                 {current}"
            )
            .into(),
            extend: format!(
                "WITH done AS (\
                   UPDATE {s}.inbox SET lease_expires_at = pg_catalog.clock_timestamp() + $4 * interval '1 microsecond' \
                   WHERE consumer = $1 AND key = $2 AND lease_token = $3 \
                     AND lease_expires_at IS NOT NULL RETURNING lease_expires_at) \
                 SELECT (SELECT lease_expires_at FROM done), i.lease_token {current}"
            )
            .into(),
            release: format!(
                "WITH done AS (\
                   DELETE FROM {s}.inbox \
                   WHERE consumer = $1 AND key = $2 AND lease_token = $3 \
                     AND lease_expires_at IS NOT NULL RETURNING 1) \
                 SELECT (SELECT pg_catalog.count(*) FROM done), i.lease_token {current}"
            )
            .into(),
        }
    }
}

/// The TTL in microseconds, or a typed error.
pub(crate) fn ttl_micros(ttl: Duration) -> Result<i64> {
    if !(MIN_LEASE_TTL..=MAX_LEASE_TTL).contains(&ttl) {
        return Err(Error::InvalidLeaseTtl {
            ttl,
            min: MIN_LEASE_TTL,
            max: MAX_LEASE_TTL,
        });
    }
    // At most one day: fits.
    Ok(ttl.as_micros() as i64)
}

fn micros(us: i64) -> Duration {
    Duration::from_micros(us.max(0) as u64)
}

impl Inbox {
    /// Takes a lease on `key` for `ttl` (database clock), in one autocommit statement: the
    /// start of lease mode, for a handler whose effect is outside the database.
    ///
    /// - [`LeaseAttempt::Leased`]: the key was new, or its lease had expired and is taken
    ///   over (with a larger [`FencingToken`]; the previous holder's completion will be
    ///   refused). Run the effect, then [`Lease::complete`] it.
    /// - [`LeaseAttempt::Duplicate`]: consumed already, by either mode. A pure read.
    /// - [`LeaseAttempt::InProgress`]: a live lease elsewhere. A pure read.
    ///
    /// No transaction or connection is held after it returns. (The call itself waits only
    /// behind another session's write of the same key: a lease call, a purge, or, when the
    /// two modes are mixed on one key, a `process` transaction's uncommitted claim, until
    /// that transaction ends.) Bad input (a TTL outside
    /// [`MIN_LEASE_TTL`]..=[`MAX_LEASE_TTL`], an invalid key) is refused before any SQL; a
    /// state pgbox cannot read is an error ([`Error::LeaseStateUnreadable`]), never a lease.
    pub async fn lease(
        &self,
        pool: &PgPool,
        key: impl Into<Key<'_>>,
        ttl: Duration,
    ) -> Result<LeaseAttempt> {
        let key = key.into();
        key.validate()?;
        let ttl_us = ttl_micros(ttl)?;
        let span = tracing::info_span!(
            "pgbox.inbox.lease",
            consumer = %self.inner.consumer,
            key = %key.as_str(),
            message_id = key.message_id(),
        );
        async {
            if self.inner.partitioned {
                return Err(Error::InboxLayout(
                    "lease mode is not available on the partitioned inbox; use a plain-inbox schema for consumers with external effects".into(),
                ));
            }
            let mut unit = self.inner.pooler.unit(pool).await?;
            let row = sqlx::query(AssertSqlSafe(self.inner.lease_sql.lease.clone()))
                .persistent(self.inner.persistent())
                .bind(&self.inner.consumer)
                .bind(key.as_str())
                .bind(key.message_id())
                .bind(ttl_us)
                .fetch_optional(&mut *unit)
                .await
                .map_err(|e| super::partitions::layout_error(e.into()))?;
            unit.finish().await?;
            let row =
                row.ok_or_else(|| self.unreadable(key.as_str(), "the lease call returned no row"))?;
            self.decode_lease(&row, key.as_str())
        }
        .instrument(span)
        .await
    }

    fn decode_lease(&self, row: &PgRow, key: &str) -> Result<LeaseAttempt> {
        let state: Option<String> = row.try_get(0)?;
        let missing = |what: &str| self.unreadable(key, &format!("{what} missing"));
        match state.as_deref() {
            Some("leased") => {
                let token: Option<i64> = row.try_get(1)?;
                let previous: Option<i64> = row.try_get(2)?;
                let expires_at: Option<OffsetDateTime> = row.try_get(3)?;
                let lease = Lease {
                    inbox: self.clone(),
                    key: key.to_owned(),
                    token: FencingToken(token.ok_or_else(|| missing("token"))?),
                    expires_at: expires_at.ok_or_else(|| missing("expiry"))?,
                    taken_over_from: previous.map(FencingToken),
                };
                match lease.taken_over_from {
                    Some(previous) => {
                        metrics::counter!(
                            crate::telemetry::INBOX_LEASE_TAKEOVERS,
                            "consumer" => self.inner.consumer.clone()
                        )
                        .increment(1);
                        tracing::warn!(
                            token = %lease.token,
                            previous_token = %previous,
                            expires_at = %super::rfc3339(lease.expires_at),
                            "pgbox expired lease taken over; the previous holder's completion will be refused"
                        )
                    }
                    None => tracing::info!(
                        token = %lease.token,
                        expires_at = %super::rfc3339(lease.expires_at),
                        "pgbox lease taken"
                    ),
                }
                Ok(LeaseAttempt::Leased(lease))
            }
            Some("duplicate") => {
                let duplicate = Duplicate {
                    first_processed_at: row
                        .try_get::<Option<OffsetDateTime>, _>(5)?
                        .ok_or_else(|| missing("processed_at"))?,
                    message_id: row.try_get(6)?,
                    outcome: row.try_get(7)?,
                    rejection: row.try_get(8)?,
                };
                tracing::info!(
                    first_processed_at = %super::rfc3339(duplicate.first_processed_at),
                    rejected = duplicate.was_rejected(),
                    "pgbox duplicate skipped (lease mode)"
                );
                Ok(LeaseAttempt::Duplicate(duplicate))
            }
            Some("in_progress") => {
                let expires_at: Option<OffsetDateTime> = row.try_get(3)?;
                let remaining: Option<i64> = row.try_get(4)?;
                let expires_at = expires_at.ok_or_else(|| missing("expiry"))?;
                let retry_after = micros(remaining.ok_or_else(|| missing("remaining time"))?);
                tracing::info!(%expires_at, ?retry_after, "pgbox key leased elsewhere; redeliver later");
                Ok(LeaseAttempt::InProgress {
                    expires_at,
                    retry_after,
                })
            }
            Some("contended") => Err(Error::ConcurrentClaim {
                consumer: self.inner.consumer.clone(),
                key: key.to_owned(),
            }),
            other => Err(self.unreadable(key, &format!("unknown lease state {other:?}"))),
        }
    }

    fn unreadable(&self, key: &str, detail: &str) -> Error {
        Error::LeaseStateUnreadable {
            consumer: self.inner.consumer.clone(),
            key: key.to_owned(),
            detail: detail.to_owned(),
        }
    }

    /// Runs `handler` under a lease on `key`: the whole lease-mode pattern in one call.
    ///
    /// Takes the lease ([`Inbox::lease`]); on [`Duplicate`](LeasedRun::Duplicate) or
    /// [`InProgress`](LeasedRun::InProgress) the handler does not run. Otherwise the handler
    /// gets the lease (its [`token`](Lease::token) for the external call, its
    /// [`extend`](Lease::extend) for a long effect), with no transaction or connection held.
    ///
    /// - `Ok(value)`: the key is completed with `value` as its outcome (stored unless it is
    ///   JSON `null` or storing is off) and [`LeasedRun::Completed`] is returned. If the
    ///   lease was lost meanwhile, [`Error::LeaseLost`] is returned instead: the effect may
    ///   have happened, and the new holder decides (its remote call sees a newer token).
    /// - An error, or a panic: the lease is released (the next delivery leases the key
    ///   again), then the error is returned unchanged or the panic resumes.
    /// - If this future is dropped mid-handler, nothing is recorded; the lease expires.
    pub async fn run_leased<T, E, F>(
        &self,
        pool: &PgPool,
        key: impl Into<Key<'_>>,
        ttl: Duration,
        handler: F,
    ) -> Result<LeasedRun<T>, E>
    where
        F: AsyncFnOnce(&mut Lease) -> Result<T, E>,
        T: Serialize,
        E: From<Error>,
    {
        let mut lease = match self.lease(pool, key, ttl).await? {
            LeaseAttempt::Leased(lease) => lease,
            LeaseAttempt::Duplicate(d) => return Ok(LeasedRun::Duplicate(d)),
            LeaseAttempt::InProgress {
                expires_at,
                retry_after,
            } => {
                return Ok(LeasedRun::InProgress {
                    expires_at,
                    retry_after,
                });
            }
        };
        let span = tracing::info_span!(
            "pgbox.inbox.run_leased",
            consumer = %self.inner.consumer,
            key = %lease.key,
            token = %lease.token,
        );
        async move {
            let result = AssertUnwindSafe(handler(&mut lease)).catch_unwind().await;
            match result {
                Ok(Ok(value)) => {
                    let json = match self.lease_outcome(&value) {
                        Ok(json) => json,
                        Err(e) => {
                            // The effect has happened: releasing would let the next delivery
                            // lease the key again, with a new token (a new idempotency key),
                            // and repeat it. Complete without an outcome, then report.
                            tracing::error!(error = %e, "pgbox leased handler's outcome cannot be stored; completing without it");
                            lease.complete_json(pool, None).await?;
                            return Err(e.into());
                        }
                    };
                    lease.complete_json(pool, json).await?;
                    Ok(LeasedRun::Completed {
                        value,
                        token: lease.token,
                    })
                }
                Ok(Err(error)) => {
                    tracing::warn!("pgbox leased handler failed; releasing the lease");
                    lease.release_quietly(pool).await;
                    Err(error)
                }
                Err(panic) => {
                    tracing::error!("pgbox leased handler panicked; releasing the lease");
                    lease.release_quietly(pool).await;
                    std::panic::resume_unwind(panic);
                }
            }
        }
        .instrument(span)
        .await
    }

    /// The outcome as stored: `None` when it is JSON `null` or storing is off.
    fn lease_outcome<T: Serialize + ?Sized>(&self, value: &T) -> Result<Option<serde_json::Value>> {
        if !self.inner.store_outcomes {
            return Ok(None);
        }
        Ok(Some(outcome_json(value)?).filter(|j| !j.is_null()))
    }
}

impl Lease {
    /// The leased key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token: larger than that of every earlier lease of this key.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// When the lease expires (database clock), as of the last lease or extension.
    pub fn expires_at(&self) -> OffsetDateTime {
        self.expires_at
    }

    /// The token of the expired lease this one took over, if it did.
    pub fn taken_over_from(&self) -> Option<FencingToken> {
        self.taken_over_from
    }

    /// An idempotency key for the external call, derived from the fencing token:
    /// `"<consumer>:<token>"` (at most 148 bytes). Unique per lease in this database, so a
    /// retry of the call by the same holder is deduplicated by the remote side, while a
    /// takeover's call carries another key and a larger token. To make the effect happen
    /// once across holders, the remote side must also refuse or dedup by the business
    /// resource (see the guide's "Effects outside the database" chapter).
    pub fn idempotency_key(&self) -> String {
        format!("{}:{}", self.inbox.consumer(), self.token)
    }

    /// Marks the key consumed, storing `outcome` (unless it is JSON `null` or storing is off)
    /// for later duplicates of either mode. One statement.
    ///
    /// Only if the key is still under this token's lease (an expired lease nobody took over
    /// still counts): otherwise [`Error::LeaseLost`], and nothing is written. Completing
    /// twice with the same token succeeds (a retry after a lost reply). Outcomes that
    /// cannot be stored (NUL, NaN) are refused before any SQL; the lease is kept.
    pub async fn complete<T: Serialize + ?Sized>(&self, pool: &PgPool, outcome: &T) -> Result<()> {
        let json = self.inbox.lease_outcome(outcome)?;
        self.complete_json(pool, json).await
    }

    async fn complete_json(&self, pool: &PgPool, json: Option<serde_json::Value>) -> Result<()> {
        let mut unit = self.inbox.inner.pooler.unit(pool).await?;
        let row = sqlx::query(AssertSqlSafe(self.inbox.inner.lease_sql.complete.clone()))
            .persistent(self.inbox.inner.persistent())
            .bind(self.inbox.consumer())
            .bind(&self.key)
            .bind(self.token.0)
            .bind(json.map(sqlx::types::Json))
            .fetch_one(&mut *unit)
            .await?;
        unit.finish().await?;
        let done: i64 = row.try_get(0)?;
        let current: Option<i64> = row.try_get(1)?;
        let consuming: Option<bool> = row.try_get(2)?;
        if done == 1 {
            tracing::info!(
                consumer = %self.inbox.consumer(),
                key = %self.key,
                token = %self.token,
                "pgbox lease completed"
            );
            return Ok(());
        }
        if current == Some(self.token.0) && consuming == Some(false) {
            tracing::debug!(token = %self.token, "pgbox lease already completed by this token");
            return Ok(());
        }
        Err(self.lost("completion", current))
    }

    /// Gives the key up after a failed effect, so that the next delivery leases it again.
    /// One statement; [`Error::LeaseLost`] if the lease was no longer this token's.
    pub async fn release(&self, pool: &PgPool) -> Result<()> {
        let mut unit = self.inbox.inner.pooler.unit(pool).await?;
        let row = sqlx::query(AssertSqlSafe(self.inbox.inner.lease_sql.release.clone()))
            .persistent(self.inbox.inner.persistent())
            .bind(self.inbox.consumer())
            .bind(&self.key)
            .bind(self.token.0)
            .fetch_one(&mut *unit)
            .await?;
        unit.finish().await?;
        let done: i64 = row.try_get(0)?;
        if done == 1 {
            tracing::info!(
                consumer = %self.inbox.consumer(),
                key = %self.key,
                token = %self.token,
                "pgbox lease released"
            );
            return Ok(());
        }
        Err(self.lost("release", row.try_get(1)?))
    }

    async fn release_quietly(&self, pool: &PgPool) {
        if let Err(e) = self.release(pool).await {
            tracing::warn!(error = %e, "pgbox could not release the lease; it will expire");
        }
    }

    /// Heartbeat: the lease now expires `ttl` from now (database clock). Returns the new
    /// expiry. One statement; [`Error::LeaseLost`] if another holder took the key over (or
    /// it was completed, released or purged). An expired lease nobody took over is still
    /// this token's and can be extended.
    pub async fn extend(&mut self, pool: &PgPool, ttl: Duration) -> Result<OffsetDateTime> {
        let ttl_us = ttl_micros(ttl)?;
        let mut unit = self.inbox.inner.pooler.unit(pool).await?;
        let row = sqlx::query(AssertSqlSafe(self.inbox.inner.lease_sql.extend.clone()))
            .persistent(self.inbox.inner.persistent())
            .bind(self.inbox.consumer())
            .bind(&self.key)
            .bind(self.token.0)
            .bind(ttl_us)
            .fetch_one(&mut *unit)
            .await?;
        unit.finish().await?;
        let expires_at: Option<OffsetDateTime> = row.try_get(0)?;
        match expires_at {
            Some(expires_at) => {
                self.expires_at = expires_at;
                tracing::debug!(
                    consumer = %self.inbox.consumer(),
                    key = %self.key,
                    token = %self.token,
                    %expires_at,
                    "pgbox lease extended"
                );
                Ok(expires_at)
            }
            None => Err(self.lost("extension", row.try_get(1)?)),
        }
    }

    fn lost(&self, what: &'static str, current: Option<i64>) -> Error {
        let current = current.filter(|t| *t != self.token.0);
        tracing::warn!(
            consumer = %self.inbox.consumer(),
            key = %self.key,
            token = %self.token,
            current_token = current,
            action = what,
            "pgbox lease lost: {what} refused"
        );
        Error::LeaseLost {
            consumer: self.inbox.consumer().to_owned(),
            key: self.key.clone(),
            token: self.token.0,
            current,
        }
    }
}
