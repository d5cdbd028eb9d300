//! The relay: publishes committed outbox messages through a [`Publisher`].
//!
//! Each round is one transaction: claim a batch with `FOR UPDATE SKIP LOCKED`, publish it,
//! delete what was confirmed (or mark it published, in audit mode), reschedule what failed,
//! dead-letter what failed too often, commit. Consequences:
//! - several relays share the work without publishing a message twice in the normal path
//!   (the row locks keep them apart);
//! - a relay that dies mid-batch loses nothing: its transaction rolls back and the messages
//!   are claimed again (and published again; the consumer's inbox absorbs the duplicate);
//! - per ordering key only the oldest pending message is ever claimed, and not while an
//!   earlier one of its key sits in the dead letters, so a key's messages go out one at a
//!   time in commit order, while other keys flow in parallel.

mod dead_letters;

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgPool, Row};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use self::dead_letters::{DeadLetter, DeadLetters};

use crate::error::{Error, Result};
use crate::ident::Identifier;
use crate::migrate::DEFAULT_SCHEMA;
use crate::outbox::Envelope;
use crate::retry::RetryPolicy;
use crate::transport::{PublishError, Publisher};

/// How a relay learns that there is work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WakeUp {
    /// `LISTEN` for the outbox's notification (one per committed transaction), and poll at
    /// the poll interval as a fallback. The default.
    #[default]
    Notify,
    /// Poll only, at the poll interval: for PgBouncer in transaction-pooling mode, where
    /// `LISTEN` does not work.
    Poll,
}

/// Builder for a [`Relay`].
#[derive(Debug)]
pub struct RelayBuilder<P> {
    pool: PgPool,
    publisher: P,
    schema: String,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    poll_interval: Duration,
    wake_up: WakeUp,
    keep_published: bool,
}

impl<P: Publisher> RelayBuilder<P> {
    /// The pgbox schema (default `pgbox`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Messages claimed per round (default 100).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Publish attempts before a message is dead-lettered (default 10).
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Delay between attempts of one message (default: 1 s base, doubling, capped at 5 min,
    /// full jitter).
    pub fn backoff(mut self, policy: RetryPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// How often to look for work without a notification (default 1 s). Also the bound on
    /// how late a message whose backoff expired is picked up.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Notify-and-poll (default) or poll only.
    pub fn wake_up(mut self, wake_up: WakeUp) -> Self {
        self.wake_up = wake_up;
        self
    }

    /// Keep published rows, with `published_at` set, instead of deleting them (audit mode;
    /// twice the writes; purge them yourself).
    pub fn keep_published(mut self, keep: bool) -> Self {
        self.keep_published = keep;
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Relay<P>> {
        let schema = Identifier::new("schema", &self.schema)?;
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(Error::InvalidConfig(
                "relay batch size must be 1..=10000".into(),
            ));
        }
        if self.max_attempts < 1 {
            return Err(Error::InvalidConfig(
                "relay max_attempts must be at least 1".into(),
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::InvalidConfig(
                "relay poll interval must be positive".into(),
            ));
        }
        let sql = Statements::new(&schema, self.keep_published);
        Ok(Relay {
            pool: self.pool,
            publisher: Arc::new(self.publisher),
            schema,
            batch_size: self.batch_size,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            poll_interval: self.poll_interval,
            wake_up: self.wake_up,
            sql: Arc::new(sql),
        })
    }
}

#[derive(Debug)]
struct Statements {
    claim: String,
    done: String,
    retry: String,
    dead: String,
}

impl Statements {
    fn new(s: &Identifier, keep_published: bool) -> Self {
        Statements {
            claim: format!(
                "SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, attempts \
                 FROM {s}.outbox AS o \
                 WHERE o.published_at IS NULL AND o.available_at <= now() \
                   AND (o.ordering_key IS NULL OR (\
                     NOT EXISTS (SELECT 1 FROM {s}.outbox AS p \
                       WHERE p.topic = o.topic AND p.ordering_key = o.ordering_key \
                         AND p.published_at IS NULL AND p.seq < o.seq) \
                     AND NOT EXISTS (SELECT 1 FROM {s}.outbox_dead_letters AS d \
                       WHERE d.topic = o.topic AND d.ordering_key = o.ordering_key))) \
                 ORDER BY o.seq LIMIT $1 FOR UPDATE SKIP LOCKED"
            ),
            done: if keep_published {
                format!("UPDATE {s}.outbox SET published_at = now() WHERE seq = ANY($1)")
            } else {
                format!("DELETE FROM {s}.outbox WHERE seq = ANY($1)")
            },
            retry: format!(
                "UPDATE {s}.outbox AS o SET attempts = o.attempts + 1, last_error = f.error, \
                   available_at = now() + make_interval(secs => f.delay) \
                 FROM unnest($1::bigint[], $2::text[], $3::float8[]) AS f(seq, error, delay) \
                 WHERE o.seq = f.seq"
            ),
            dead: format!(
                "WITH moved AS (DELETE FROM {s}.outbox AS o USING unnest($1::bigint[], $2::text[]) AS f(seq, error) \
                   WHERE o.seq = f.seq RETURNING o.*, f.error AS final_error) \
                 INSERT INTO {s}.outbox_dead_letters \
                   (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, attempts, last_error) \
                 SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, attempts + 1, final_error \
                 FROM moved"
            ),
        }
    }
}

/// What one relay round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RoundReport {
    /// Messages claimed.
    pub claimed: usize,
    /// Published and removed (or marked).
    pub published: usize,
    /// Failed and rescheduled.
    pub retried: usize,
    /// Failed for the last time and moved to the dead letters.
    pub dead_lettered: usize,
}

/// Publishes outbox messages. Build with [`Relay::builder`]; run with [`Relay::run`].
#[derive(Debug)]
pub struct Relay<P> {
    pool: PgPool,
    publisher: Arc<P>,
    schema: Identifier,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    poll_interval: Duration,
    wake_up: WakeUp,
    sql: Arc<Statements>,
}

impl<P: Publisher> Relay<P> {
    /// A relay over `pool` publishing through `publisher`, with defaults.
    pub fn builder(pool: PgPool, publisher: P) -> RelayBuilder<P> {
        RelayBuilder {
            pool,
            publisher,
            schema: DEFAULT_SCHEMA.into(),
            batch_size: 100,
            max_attempts: 10,
            backoff: RetryPolicy::new()
                .base_delay(Duration::from_secs(1))
                .max_delay(Duration::from_secs(300)),
            poll_interval: Duration::from_secs(1),
            wake_up: WakeUp::Notify,
            keep_published: false,
        }
    }

    /// The `LISTEN` channel the outbox notifies.
    pub fn channel(&self) -> String {
        format!("{}.outbox", self.schema.as_str())
    }

    /// Runs until `shutdown` is cancelled. The batch in hand is finished (published and
    /// committed) before it returns. Database errors are logged and retried after the poll
    /// interval; the relay never gives up on its own.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let mut listener = None;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            if self.wake_up == WakeUp::Notify && listener.is_none() {
                match crate::listen::listen(&self.pool, &self.channel()).await {
                    Ok(l) => listener = Some(l),
                    Err(e) => tracing::warn!(error = %e, "pgbox relay cannot LISTEN; polling"),
                }
            }
            // Drain: full batches mean there is probably more.
            loop {
                if shutdown.is_cancelled() {
                    return Ok(());
                }
                match self.relay_once().await {
                    Ok(report) if report.claimed == self.batch_size => continue,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, retryable = e.is_retryable(), "pgbox relay round failed; will retry");
                        break;
                    }
                }
            }
            let wait = tokio::time::sleep(self.poll_interval);
            let mut lost_listener = false;
            match listener.as_mut() {
                Some(l) => {
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = wait => {}
                        // Ok(None): the connection dropped and notifications may have been
                        // missed; the drain at the top of the loop covers them.
                        n = l.try_recv() => if let Err(e) = n {
                            tracing::warn!(error = %e, "pgbox relay lost its LISTEN connection");
                            lost_listener = true;
                        },
                    }
                }
                None => {
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = wait => {}
                    }
                }
            }
            if lost_listener {
                listener = None;
            }
        }
    }

    /// One round: claim, publish, settle, commit. Returns what it did.
    pub async fn relay_once(&self) -> Result<RoundReport> {
        let span = tracing::debug_span!("pgbox.relay.round");
        async {
            let mut tx = self.pool.begin().await?;
            let rows = sqlx::query(AssertSqlSafe(self.sql.claim.clone()))
                .bind(i64::try_from(self.batch_size).unwrap_or(i64::MAX))
                .fetch_all(&mut *tx)
                .await?;
            let mut report = RoundReport {
                claimed: rows.len(),
                ..RoundReport::default()
            };
            if rows.is_empty() {
                return Ok(report);
            }
            let batch = rows.iter().map(decode).collect::<Result<Vec<_>>>()?;
            tracing::debug!(messages = batch.len(), "pgbox relay claimed");
            let mut results = self.publisher.publish(&batch).await;
            if results.len() != batch.len() {
                let msg = format!(
                    "publisher returned {} results for {} messages",
                    results.len(),
                    batch.len()
                );
                results = vec![Err(PublishError(msg)); batch.len()];
            }
            let (mut done, mut retry, mut dead) = (Vec::new(), Vec::new(), Vec::new());
            for (message, result) in batch.iter().zip(results) {
                match result {
                    Ok(()) => {
                        tracing::debug!(message_id = %message.id, topic = %message.topic, "pgbox published");
                        done.push(message.seq);
                    }
                    Err(PublishError(error)) => {
                        let attempt = message.attempts + 1;
                        let error = error.replace('\0', "\\0");
                        if attempt >= self.max_attempts {
                            tracing::error!(message_id = %message.id, attempt, error, "pgbox publish failed for the last time; dead-lettered");
                            dead.push((message.seq, error));
                        } else {
                            let delay = self.backoff.delay_after(attempt as u32);
                            tracing::warn!(message_id = %message.id, attempt, ?delay, error, "pgbox publish failed; will retry");
                            retry.push((message.seq, error, delay.as_secs_f64()));
                        }
                    }
                }
            }
            if !done.is_empty() {
                sqlx::query(AssertSqlSafe(self.sql.done.clone()))
                    .bind(&done)
                    .execute(&mut *tx)
                    .await?;
            }
            if !retry.is_empty() {
                let (seqs, rest): (Vec<i64>, Vec<(String, f64)>) =
                    retry.into_iter().map(|(s, e, d)| (s, (e, d))).unzip();
                let (errors, delays): (Vec<String>, Vec<f64>) = rest.into_iter().unzip();
                report.retried = seqs.len();
                sqlx::query(AssertSqlSafe(self.sql.retry.clone()))
                    .bind(&seqs)
                    .bind(&errors)
                    .bind(&delays)
                    .execute(&mut *tx)
                    .await?;
            }
            if !dead.is_empty() {
                let (seqs, errors): (Vec<i64>, Vec<String>) = dead.into_iter().unzip();
                report.dead_lettered = seqs.len();
                sqlx::query(AssertSqlSafe(self.sql.dead.clone()))
                    .bind(&seqs)
                    .bind(&errors)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            report.published = done.len();
            Ok(report)
        }
        .instrument(span)
        .await
    }
}

fn decode(row: &PgRow) -> Result<Envelope> {
    Envelope::from_row(row, row.try_get("attempts")?)
}
