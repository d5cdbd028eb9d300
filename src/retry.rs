//! Bounded retries with jittered exponential backoff, for transactions that lose a race
//! (version conflicts, serialization failures, deadlocks, lost connections).

use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::inbox::{Inbox, Key, Outcome};

/// How often and how patiently to retry. Defaults: 8 attempts, 10 ms base delay, 1 s cap.
///
/// The delay before attempt `n + 1` is drawn uniformly from `0..=min(cap, base * 2^(n-1))`
/// ("full jitter"), so competing workers spread out instead of colliding again in lockstep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 8,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Total attempts including the first (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The delay scale of the first retry.
    pub fn base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// The longest delay between two attempts.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// Attempts allowed in total.
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// A jittered delay to wait after failed attempt number `attempt` (1-based).
    pub fn delay_after(&self, attempt: u32) -> Duration {
        let exp = self
            .base_delay
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let ceiling = exp.min(self.max_delay);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(fastrand::u64(0..=nanos))
    }
}

/// Errors that can say whether retrying the transaction may help. Implement it for your
/// handler's error type to use [`Inbox::process_with_retry`]; delegate to
/// [`Error::is_retryable`] for the pgbox errors it wraps.
pub trait Retryable {
    /// Whether a fresh attempt may succeed.
    fn is_retryable(&self) -> bool;
}

impl Retryable for Error {
    fn is_retryable(&self) -> bool {
        Error::is_retryable(self)
    }
}

impl Inbox {
    /// [`process`](Inbox::process) in a transaction of its own, retried on retryable errors.
    ///
    /// Each attempt begins a fresh transaction, claims `key`, runs `handler` and commits.
    /// When an attempt fails with an error whose [`Retryable::is_retryable`] is true (a
    /// [`Error::VersionConflict`] from a versioned update, a serialization failure, a
    /// deadlock, a dropped connection), it is rolled back, and after a jittered delay the
    /// handler runs again — re-reading what it needs, since the claim rolled back with it.
    /// So a message that lost a race still takes effect exactly once.
    ///
    /// The handler is cloned for each attempt; a closure that captures only references (or
    /// other `Clone` values) is `Clone` automatically.
    pub async fn process_with_retry<T, E, F>(
        &self,
        pool: &PgPool,
        key: impl Into<Key<'_>>,
        policy: &RetryPolicy,
        handler: F,
    ) -> Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut crate::HandlerConnection<'_>) -> Result<T, E> + Clone,
        T: Serialize,
        E: From<Error> + Retryable,
    {
        let key = key.into();
        let mut attempt = 1;
        loop {
            let result = self.attempt(pool, &key, handler.clone()).await;
            match result {
                Err(e) if e.is_retryable() && attempt < policy.max_attempts => {
                    let delay = policy.delay_after(attempt);
                    tracing::info!(
                        consumer = self.consumer(),
                        key = key.as_str(),
                        attempt,
                        ?delay,
                        "pgbox retrying after a retryable failure"
                    );
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}

impl Inbox {
    /// One attempt of [`Inbox::process_with_retry`]: begin, process, commit (or roll back
    /// what wrote nothing), as [`Inbox::process_and_commit`] does.
    async fn attempt<T, E, F>(
        &self,
        pool: &PgPool,
        key: &Key<'_>,
        handler: F,
    ) -> Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut crate::HandlerConnection<'_>) -> Result<T, E>,
        T: Serialize,
        E: From<Error>,
    {
        // Begun with pgbox's cancel-safe begin (see `pooler::begin`): `process_with_retry`
        // always has a pool, so a drop mid-`BEGIN` cannot leave a transaction open.
        self.process_or_reject_and_commit_on_pool(pool, key.clone(), async move |conn| {
            handler(conn).await.map(crate::Verdict::Accept)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_stay_under_the_cap() {
        let p = RetryPolicy::new()
            .base_delay(Duration::from_millis(10))
            .max_delay(Duration::from_millis(100));
        for attempt in 1..40 {
            let ceiling = Duration::from_millis(10 * (1u64 << (attempt - 1).min(20)))
                .min(Duration::from_millis(100));
            for _ in 0..50 {
                assert!(p.delay_after(attempt) <= ceiling);
            }
        }
        // Jitter: not every draw is the same.
        let draws: std::collections::HashSet<_> = (0..50).map(|_| p.delay_after(5)).collect();
        assert!(draws.len() > 1);
        assert_eq!(RetryPolicy::new().max_attempts(0).attempts(), 1);
    }
}
