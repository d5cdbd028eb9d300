//! Fan-out: one outbox message, several destinations, each with its own delivery state.
//!
//! A [`Router`] is a [`Publisher`]: the [`Relay`](crate::Relay) (or the
//! [`WalRelay`](crate::WalRelay)) hands it each batch as it would hand a broker. For every
//! destination the batch's messages route to, the router publishes them there at once,
//! concurrently across destinations. A copy a destination does not take (refused, the
//! destination unavailable or slow, or its key already waiting there) becomes a *deferred
//! delivery*: the payload is stored once in `outbox_fanout_messages`, one row per destination
//! in `outbox_fanout_deliveries`, in one transaction of the router's; then the router
//! confirms the whole batch to the relay. [`Router::run`] drains the deferred deliveries.
//!
//! Per destination and ordering key, order holds: a key with a deferred delivery at a
//! destination sends its later messages there into the deferred table too, behind it.

mod deferred;
mod pattern;

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::future::{BoxFuture, join_all};
use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use self::deferred::Statements;
use self::pattern::TopicPattern;
use crate::error::{Error, Result};
use crate::ident::{DEFAULT_SCHEMA, Identifier};
use crate::outbox::Envelope;
use crate::pooler::Pooler;
use crate::relay::publish_in_key_order_within;
use crate::retry::RetryPolicy;
use crate::telemetry;
use crate::transport::{PublishError, PublishErrorKind, Publisher};

/// The header naming a message's extra destinations (comma-separated), set by
/// [`Message::destinations`](crate::Message::destinations).
pub const DESTINATIONS_HEADER: &str = "pgbox-destinations";

/// How long the router waits for one destination's answer to one call, by default: 30 s,
/// below the relay's publish timeout (120 s), so that one hung destination never makes the
/// relay publish everybody's copies again.
pub const DEFAULT_DESTINATION_TIMEOUT: Duration = Duration::from_secs(30);

/// The router's transactions run at READ COMMITTED whatever the session default: the
/// payload-row protocol (see `deferred`) needs each statement's fresh snapshot.
const READ_COMMITTED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// The longest destination name, in bytes.
const MAX_DESTINATION_BYTES: usize = 63;

/// Drain rounds of one [`Router::drain`] call, at most.
const MAX_DRAIN_ROUNDS: usize = 100_000;

/// A publisher behind a name; object-safe, so that one router holds different transports.
trait DynPublisher: Send + Sync {
    fn publish_boxed<'a>(
        &'a self,
        batch: &'a [Envelope],
    ) -> BoxFuture<'a, Vec<std::result::Result<(), PublishError>>>;
    fn atomic(&self) -> bool;
}

impl<P: Publisher> DynPublisher for P {
    fn publish_boxed<'a>(
        &'a self,
        batch: &'a [Envelope],
    ) -> BoxFuture<'a, Vec<std::result::Result<(), PublishError>>> {
        Box::pin(self.publish(batch))
    }

    fn atomic(&self) -> bool {
        self.atomic_batches()
    }
}

/// One destination: its name, its publisher, and whether it is away.
struct Destination {
    name: String,
    publisher: Box<dyn DynPublisher>,
    away: Mutex<Away>,
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Destination")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Publisher for Destination {
    async fn publish(&self, batch: &[Envelope]) -> Vec<std::result::Result<(), PublishError>> {
        // A publisher that panics refuses its batch here: it must not take the relay and
        // every other destination down with it.
        match futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
            self.publisher.publish_boxed(batch),
        ))
        .await
        {
            Ok(results) => results,
            Err(_) => {
                let text = format!("pgbox router: destination {:?} panicked", self.name);
                vec![Err(PublishError::refused(text)); batch.len()]
            }
        }
    }

    fn atomic_batches(&self) -> bool {
        self.publisher.atomic()
    }
}

/// A destination that reported itself unavailable is away until `until`: the router defers
/// its copies without calling it.
#[derive(Debug, Default)]
struct Away {
    /// Unavailable answers in a row.
    failures: u32,
    until: Option<Instant>,
}

/// Builder for a [`Router`]; see [`Router::builder`].
pub struct RouterBuilder {
    pool: PgPool,
    schema: String,
    destinations: Vec<(String, Box<dyn DynPublisher>)>,
    routes: Vec<(String, Vec<String>)>,
    destination_timeout: Duration,
    poll_interval: Duration,
    backoff: RetryPolicy,
    max_attempts: i32,
    batch_size: usize,
    away_backoff: (Duration, Duration),
    pooler: Pooler,
}

impl fmt::Debug for RouterBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterBuilder")
            .field("schema", &self.schema)
            .field(
                "destinations",
                &self.destinations.iter().map(|d| &d.0).collect::<Vec<_>>(),
            )
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl RouterBuilder {
    /// What stands between the router's pool and PostgreSQL (default [`Pooler::None`]).
    /// With [`Pooler::Transaction`] its statements go unnamed, as the relay's do.
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// The pgbox schema holding the deferred deliveries (default `pgbox`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Adds a destination: a name (1 to 63 bytes of ASCII letters, digits, `_`, `-`),
    /// used in routes, in [`Message::destinations`](crate::Message::destinations), in the
    /// deferred table and as the metrics' `destination` label, and the publisher behind it.
    pub fn destination<P: Publisher + 'static>(
        mut self,
        name: impl Into<String>,
        publisher: P,
    ) -> Self {
        self.destinations.push((name.into(), Box::new(publisher)));
        self
    }

    /// Routes topics matching `pattern` to `destinations`. Patterns are dot-separated
    /// segments: `*` matches exactly one segment, `>` as the last segment one or more, any
    /// other segment itself. Routes add up: a topic goes to the union of every matching
    /// route's destinations (and of its message's [`DESTINATIONS_HEADER`]).
    pub fn route<I, S>(mut self, pattern: impl Into<String>, destinations: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.routes.push((
            pattern.into(),
            destinations.into_iter().map(Into::into).collect(),
        ));
        self
    }

    /// How long one call of one destination may take before its messages are deferred
    /// (default [`DEFAULT_DESTINATION_TIMEOUT`]). Keep it below the relay's publish timeout.
    pub fn destination_timeout(mut self, timeout: Duration) -> Self {
        self.destination_timeout = timeout;
        self
    }

    /// How often [`Router::run`] looks for due deferred deliveries when it found none
    /// (default 1 s).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The delay before a deferred delivery a destination refused is tried again (default:
    /// 500 ms doubling to 60 s, jittered). Its `max_attempts` plays no part: see
    /// [`max_attempts`](Self::max_attempts).
    pub fn backoff(mut self, policy: RetryPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// Refusals of one delivery by its destination before it is dead (default 10). Outages
    /// (unavailable, timed out) never count.
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Deferred deliveries one drain round publishes to one destination, at most
    /// (default 500).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How long a destination that answered "unavailable" is left alone: `initial` after
    /// its first such answer, doubling with each further one up to `max` (default 1 s to
    /// 30 s). Meanwhile its copies are deferred without calling it.
    pub fn away_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.away_backoff = (initial, max);
        self
    }

    /// Validates the configuration: names (well-formed, not twice), patterns, routes that
    /// name only known destinations, and the settings.
    pub fn build(self) -> Result<Router> {
        let schema = Identifier::pgbox_schema(&self.schema)?;
        let invalid = |text: String| Err(Error::InvalidConfig(text));
        if self.destinations.is_empty() {
            return invalid("a router needs at least one destination".into());
        }
        let mut destinations: Vec<Destination> = Vec::with_capacity(self.destinations.len());
        for (name, publisher) in self.destinations {
            if let Some(reason) = bad_destination_name(&name) {
                return invalid(format!("destination name {name:?}: {reason}"));
            }
            if destinations.iter().any(|d| d.name == name) {
                return invalid(format!("destination {name:?} is added twice"));
            }
            destinations.push(Destination {
                name,
                publisher,
                away: Mutex::new(Away::default()),
            });
        }
        let mut routes = Vec::with_capacity(self.routes.len());
        for (pattern, names) in self.routes {
            let parsed = TopicPattern::parse(&pattern)?;
            if names.is_empty() {
                return invalid(format!("route {pattern:?} names no destination"));
            }
            let mut targets = Vec::with_capacity(names.len());
            for name in &names {
                match destinations.iter().position(|d| &d.name == name) {
                    Some(i) => targets.push(i),
                    None => {
                        return invalid(format!(
                            "route {pattern:?} names destination {name:?}, which was not added"
                        ));
                    }
                }
            }
            routes.push((parsed, targets));
        }
        if self.destination_timeout.is_zero() {
            return invalid("destination_timeout must be positive".into());
        }
        if self.poll_interval.is_zero() {
            return invalid("poll_interval must be positive".into());
        }
        if self.max_attempts < 1 {
            return invalid("max_attempts must be at least 1".into());
        }
        if self.batch_size == 0 {
            return invalid("batch_size must be at least 1".into());
        }
        let (initial, max) = self.away_backoff;
        if initial.is_zero() || max < initial {
            return invalid("away_backoff needs 0 < initial <= max".into());
        }
        Ok(Router {
            sql: Statements::new(&schema),
            pool: self.pool,
            schema,
            destinations,
            routes,
            destination_timeout: self.destination_timeout,
            poll_interval: self.poll_interval,
            backoff: self.backoff,
            max_attempts: self.max_attempts,
            batch_size: self.batch_size,
            away_backoff: self.away_backoff,
            persistent: self.pooler.persistent(),
        })
    }
}

/// A destination's error as stored: PostgreSQL text holds no NUL byte (escaped, as the
/// relay does), else the write fails and takes the whole batch or drain round with it.
fn error_text(e: &PublishError) -> String {
    e.message().replace('\0', "\\0")
}

/// Why `name` cannot name a destination, if it cannot.
fn bad_destination_name(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("must not be empty");
    }
    if name.len() > MAX_DESTINATION_BYTES {
        return Some("longer than 63 bytes");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Some("may contain only ASCII letters, digits, '_' and '-'");
    }
    None
}

/// Publishes each message to several destinations, each with its own delivery state.
///
/// The router is a [`Publisher`]: put it under a [`Relay`](crate::Relay) or a
/// [`WalRelay`](crate::WalRelay), and run [`Router::run`] beside it to drain the copies it
/// deferred. The enqueue path is unchanged: the outbox row is the payload, written once.
///
/// - **Routing**: the destinations of a message are the union of the routes matching its
///   topic and the names in its [`DESTINATIONS_HEADER`] (see
///   [`Message::destinations`](crate::Message::destinations)). A message with an unknown
///   name there, or with no destination at all, is refused: the relay retries it and
///   dead-letters it after its `max_attempts` (replayable), never drops it.
/// - **Isolation**: per batch, every destination is called concurrently, each call bounded
///   by the [destination timeout](RouterBuilder::destination_timeout). A copy a destination
///   refuses, times out on or is unavailable for is stored as a deferred delivery (one
///   transaction per batch), and the batch is confirmed to the relay: the other destinations
///   are never held. A destination that answered "unavailable" is *away* for a backoff,
///   during which its copies are deferred without calling it.
/// - **Order per destination and key**: a key with a deferred delivery at a destination
///   has its later messages deferred there too, behind it; the drain publishes a key's
///   deferred deliveries in order, from the head. A dead delivery holds its key at its
///   destination only.
/// - **At least once**: if the deferral cannot be written, the batch is reported
///   unavailable and the relay publishes it again (duplicates at the destinations that took
///   it; the consumers' inbox absorbs them), as after a relay crash.
///
/// ```no_run
/// # async fn example(pool: pgbox::sqlx::PgPool) -> pgbox::Result<()> {
/// use std::sync::Arc;
/// use pgbox::transport::PgQueue;
/// use pgbox::{CancellationToken, Relay, Router};
///
/// let router = Arc::new(
///     Router::builder(pool.clone())
///         .destination("points", PgQueue::with_schema(pool.clone(), "points")?)
///         .destination("audit", PgQueue::with_schema(pool.clone(), "audit")?)
///         .route("payments.*", ["points"])
///         .route("payments.refund", ["audit"])
///         .build()?,
/// );
/// let relay = Relay::builder(pool.clone(), router.clone()).build()?;
/// let token = CancellationToken::new();
/// tokio::try_join!(relay.run(token.clone()), router.run(token.clone()))?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Router {
    pool: PgPool,
    schema: Identifier,
    destinations: Vec<Destination>,
    /// Patterns and the indexes of their destinations.
    routes: Vec<(TopicPattern, Vec<usize>)>,
    sql: Statements,
    destination_timeout: Duration,
    poll_interval: Duration,
    backoff: RetryPolicy,
    max_attempts: i32,
    batch_size: usize,
    away_backoff: (Duration, Duration),
    /// Whether its statements may be named (not behind a transaction pooler).
    persistent: bool,
}

/// A copy a destination did not take: to be stored as a deferred delivery.
#[derive(Debug)]
struct Deferral {
    /// Position in the batch.
    index: usize,
    destination: usize,
    /// 1 when the destination refused it, else 0.
    attempts: i32,
    error: Option<String>,
}

/// Per destination: deferred deliveries, dead ones, and whether the router sees it away.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DestinationStatus {
    /// The destination's name.
    pub destination: String,
    /// Deferred deliveries waiting (not dead).
    pub deferred: i64,
    /// Dead deliveries (each holds its key at this destination).
    pub dead: i64,
    /// Age of the oldest deferred or dead delivery, if any.
    pub oldest: Option<Duration>,
    /// Whether this router currently leaves the destination alone after an outage.
    pub away: bool,
    /// Whether this router has the destination. `false`: deferred deliveries of a
    /// destination since removed from the configuration, which nothing drains; deliver them
    /// by adding it back, or let them go with [`Router::forget_destination`].
    pub configured: bool,
}

/// A dead deferred delivery: a message one destination refused `max_attempts` times.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FanoutDeadLetter {
    /// The message id.
    pub message_id: Uuid,
    /// Its topic.
    pub topic: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// Refusals counted.
    pub attempts: i32,
    /// The destination's last refusal.
    pub last_error: Option<String>,
    /// When the copy was first deferred.
    pub deferred_at: OffsetDateTime,
    /// When it was declared dead.
    pub dead_at: OffsetDateTime,
}

/// What [`Router::drain`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FanoutDrainReport {
    /// Deferred deliveries published and removed.
    pub delivered: u64,
    /// Refusals rescheduled with backoff.
    pub retried: u64,
    /// Deliveries declared dead.
    pub dead: u64,
    /// Drain calls that found a destination unavailable (its deliveries stay, uncounted).
    pub unavailable: u64,
}

impl FanoutDrainReport {
    fn add(&mut self, other: &FanoutDrainReport) {
        self.delivered += other.delivered;
        self.retried += other.retried;
        self.dead += other.dead;
        self.unavailable += other.unavailable;
    }

    fn did_something(&self) -> bool {
        self.delivered + self.retried + self.dead > 0
    }
}

impl Router {
    /// A builder; `pool` reaches the database holding the deferred deliveries (the pgbox
    /// schema, migrated).
    pub fn builder(pool: PgPool) -> RouterBuilder {
        RouterBuilder {
            pool,
            schema: DEFAULT_SCHEMA.to_owned(),
            destinations: Vec::new(),
            routes: Vec::new(),
            destination_timeout: DEFAULT_DESTINATION_TIMEOUT,
            poll_interval: Duration::from_secs(1),
            backoff: RetryPolicy::new()
                .base_delay(Duration::from_millis(500))
                .max_delay(Duration::from_secs(60)),
            max_attempts: 10,
            batch_size: 500,
            away_backoff: (Duration::from_secs(1), Duration::from_secs(30)),
            pooler: Pooler::None,
        }
    }

    /// The destinations' names, in the order they were added.
    pub fn destinations(&self) -> impl Iterator<Item = &str> {
        self.destinations.iter().map(|d| d.name.as_str())
    }

    /// The indexes of `message`'s destinations (sorted), or why it has none it may go to.
    fn targets(&self, message: &Envelope) -> std::result::Result<Vec<usize>, String> {
        let mut targets: Vec<usize> = Vec::new();
        for (pattern, to) in &self.routes {
            if pattern.matches(&message.topic) {
                targets.extend(to);
            }
        }
        if let Some(names) = message.headers.get(DESTINATIONS_HEADER) {
            for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                match self.destinations.iter().position(|d| d.name == name) {
                    Some(i) => targets.push(i),
                    None => {
                        return Err(format!(
                            "pgbox router: message {} (topic {:?}) names destination {name:?} in its {DESTINATIONS_HEADER} header; the router has no such destination",
                            message.id, message.topic
                        ));
                    }
                }
            }
        }
        targets.sort_unstable();
        targets.dedup();
        if targets.is_empty() {
            return Err(format!(
                "pgbox router: no route matches topic {:?} and message {} names no destination: nothing to deliver it to",
                message.topic, message.id
            ));
        }
        Ok(targets)
    }

    /// Whether destination `d` is away now.
    fn is_away(&self, d: usize) -> bool {
        let away = self.destinations[d]
            .away
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        away.until.is_some_and(|until| until > Instant::now())
    }

    /// Records destination `d`'s latest answer: an outage sends it away (longer each time
    /// in a row), anything else brings it back.
    fn record_answer(&self, d: usize, unavailable: bool) {
        let mut away = self.destinations[d]
            .away
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if unavailable {
            away.failures = away.failures.saturating_add(1);
            let (initial, max) = self.away_backoff;
            let delay = initial
                .saturating_mul(1u32 << away.failures.saturating_sub(1).min(16))
                .min(max);
            away.until = Some(Instant::now() + delay);
            tracing::warn!(
                destination = %self.destinations[d].name,
                away_for = ?delay,
                "pgbox router: destination unavailable; deferring its copies without calling it meanwhile"
            );
        } else if away.failures > 0 {
            tracing::info!(destination = %self.destinations[d].name, "pgbox router: destination answers again");
            *away = Away::default();
        }
    }

    /// The whole batch through every destination; see [`Router`].
    async fn publish_batch(
        &self,
        batch: &[Envelope],
    ) -> Vec<std::result::Result<(), PublishError>> {
        // Route first: a batch with an unroutable message publishes nothing (the relay
        // treats the router as atomic and offers the batch again in halves, to find it).
        let mut targets: Vec<Vec<usize>> = Vec::with_capacity(batch.len());
        let mut unroutable = false;
        let mut routed: Vec<std::result::Result<(), PublishError>> =
            Vec::with_capacity(batch.len());
        for message in batch {
            match self.targets(message) {
                Ok(t) => {
                    targets.push(t);
                    routed.push(Ok(()));
                }
                Err(text) => {
                    tracing::warn!(message_id = %message.id, topic = %message.topic, "{text}");
                    unroutable = true;
                    targets.push(Vec::new());
                    routed.push(Err(PublishError::refused(text)));
                }
            }
        }
        if unroutable {
            return routed
                .into_iter()
                .map(|r| {
                    r.and(Err(PublishError::refused(
                        "pgbox router: not published, another message of its batch is unroutable",
                    )))
                })
                .collect();
        }

        let held = match self.held_keys(batch, &targets).await {
            Ok(held) => held,
            Err(e) => {
                let text = format!("pgbox router: could not read the deferred deliveries: {e}");
                tracing::warn!("{text}");
                return vec![Err(PublishError::unavailable(text)); batch.len()];
            }
        };

        let calls = (0..self.destinations.len()).map(|d| {
            let members: Vec<usize> = (0..batch.len())
                .filter(|&i| targets[i].contains(&d))
                .collect();
            self.publish_to(d, batch, members, &held)
        });
        let mut deferrals: Vec<Deferral> = join_all(calls).await.into_iter().flatten().collect();
        if deferrals.is_empty() {
            return vec![Ok(()); batch.len()];
        }
        deferrals.sort_by_key(|f| (f.index, f.destination));
        match self.write_deferrals(batch, &deferrals).await {
            Ok(()) => {
                for f in &deferrals {
                    metrics::counter!(
                        telemetry::FANOUT_DEFERRED,
                        "destination" => self.destinations[f.destination].name.clone()
                    )
                    .increment(1);
                }
                vec![Ok(()); batch.len()]
            }
            Err(e) => {
                let text = format!(
                    "pgbox router: could not store {} deferred deliveries: {e}",
                    deferrals.len()
                );
                tracing::warn!("{text}");
                vec![Err(PublishError::unavailable(text)); batch.len()]
            }
        }
    }

    /// The (destination, topic, key) triples of the batch that already have a deferred
    /// delivery: one query.
    async fn held_keys(
        &self,
        batch: &[Envelope],
        targets: &[Vec<usize>],
    ) -> Result<HashSet<(usize, String, String)>> {
        let mut asked: HashSet<(usize, &str, &str)> = HashSet::new();
        for (message, to) in batch.iter().zip(targets) {
            let Some(key) = message.ordering_key.as_deref() else {
                continue;
            };
            for &d in to {
                asked.insert((d, message.topic.as_str(), key));
            }
        }
        if asked.is_empty() {
            return Ok(HashSet::new());
        }
        let (mut names, mut topics, mut keys) = (Vec::new(), Vec::new(), Vec::new());
        for (d, topic, key) in &asked {
            names.push(self.destinations[*d].name.as_str());
            topics.push(*topic);
            keys.push(*key);
        }
        let rows = sqlx::query(AssertSqlSafe(self.sql.held.as_str()))
            .persistent(self.persistent)
            .bind(&names)
            .bind(&topics)
            .bind(&keys)
            .fetch_all(&self.pool)
            .await?;
        let mut held = HashSet::with_capacity(rows.len());
        for row in rows {
            let name: String = row.try_get(0)?;
            if let Some(d) = self.destinations.iter().position(|x| x.name == name) {
                held.insert((d, row.try_get(1)?, row.try_get(2)?));
            }
        }
        Ok(held)
    }

    /// The batch's `members` to destination `d`; what it did not take, as deferrals.
    async fn publish_to(
        &self,
        d: usize,
        batch: &[Envelope],
        members: Vec<usize>,
        held: &HashSet<(usize, String, String)>,
    ) -> Vec<Deferral> {
        if members.is_empty() {
            return Vec::new();
        }
        let defer = |index: usize, attempts: i32, error: Option<String>| Deferral {
            index,
            destination: d,
            attempts,
            error,
        };
        if self.is_away(d) {
            return members.into_iter().map(|i| defer(i, 0, None)).collect();
        }
        // The look-up builds an owned key: skipped when no key is held (the usual case).
        let (waiting, sending): (Vec<usize>, Vec<usize>) = members.into_iter().partition(|&i| {
            !held.is_empty()
                && batch[i]
                    .ordering_key
                    .as_ref()
                    .is_some_and(|k| held.contains(&(d, batch[i].topic.clone(), k.clone())))
        });
        let mut out: Vec<Deferral> = waiting.into_iter().map(|i| defer(i, 0, None)).collect();
        if sending.is_empty() {
            return out;
        }
        let envelopes: Vec<Envelope> = sending.iter().map(|&i| batch[i].clone()).collect();
        // The whole call (every key wave, every halving) within the destination timeout, not
        // only each call: else a slow destination outlasts the relay's publish timeout.
        let results = tokio::time::timeout(
            self.destination_timeout,
            publish_in_key_order_within(
                &self.destinations[d],
                &envelopes,
                self.destination_timeout,
            ),
        )
        .await
        .unwrap_or_else(|_| {
            let text = format!(
                "pgbox router: destination {:?} did not take its copies within the destination timeout ({:?})",
                self.destinations[d].name, self.destination_timeout
            );
            vec![Some(Err(PublishError::unavailable(text))); envelopes.len()]
        });
        let mut unavailable = false;
        for (&i, result) in sending.iter().zip(results) {
            match result {
                Some(Ok(())) => {}
                Some(Err(e)) if e.kind() == PublishErrorKind::Refused => {
                    out.push(defer(i, 1, Some(error_text(&e))));
                }
                Some(Err(e)) => {
                    unavailable = true;
                    out.push(defer(i, 0, Some(error_text(&e))));
                }
                None => out.push(defer(i, 0, None)),
            }
        }
        self.record_answer(d, unavailable);
        out
    }

    /// Stores the deferrals in one transaction: payloads once (in message_id order, see
    /// `deferred`), then one delivery per (message, destination) in batch order.
    async fn write_deferrals(&self, batch: &[Envelope], deferrals: &[Deferral]) -> Result<()> {
        let mut messages: Vec<&Envelope> = deferrals.iter().map(|f| &batch[f.index]).collect();
        messages.sort_by_key(|m| m.id);
        messages.dedup_by_key(|m| m.id);
        let mut headers = Vec::with_capacity(messages.len());
        for m in &messages {
            headers.push(serde_json::to_string(&m.headers).map_err(Error::SerializePayload)?);
        }
        let mut tx = crate::pooler::begin(&self.pool, Some(READ_COMMITTED)).await?;
        sqlx::query(AssertSqlSafe(self.sql.insert_messages.as_str()))
            .persistent(self.persistent)
            .bind(messages.iter().map(|m| m.id).collect::<Vec<_>>())
            .bind(messages.iter().map(|m| m.seq).collect::<Vec<_>>())
            .bind(
                messages
                    .iter()
                    .map(|m| m.topic.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                messages
                    .iter()
                    .map(|m| m.ordering_key.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(
                messages
                    .iter()
                    .map(|m| m.payload.as_slice())
                    .collect::<Vec<_>>(),
            )
            .bind(
                messages
                    .iter()
                    .map(|m| m.content_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(&headers)
            .bind(messages.iter().map(|m| m.created_at).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
        let delays: Vec<f64> = deferrals
            .iter()
            .map(|f| {
                if f.attempts > 0 {
                    self.backoff.delay_after(f.attempts as u32).as_secs_f64()
                } else {
                    0.0
                }
            })
            .collect();
        sqlx::query(AssertSqlSafe(self.sql.insert_deliveries.as_str()))
            .persistent(self.persistent)
            .bind(
                deferrals
                    .iter()
                    .map(|f| self.destinations[f.destination].name.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                deferrals
                    .iter()
                    .map(|f| batch[f.index].id)
                    .collect::<Vec<_>>(),
            )
            .bind(
                deferrals
                    .iter()
                    .map(|f| batch[f.index].topic.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                deferrals
                    .iter()
                    .map(|f| batch[f.index].ordering_key.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(deferrals.iter().map(|f| f.attempts).collect::<Vec<_>>())
            .bind(
                deferrals
                    .iter()
                    .map(|f| f.error.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(&delays)
            .bind(self.max_attempts)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Drains the deferred deliveries until `shutdown` is cancelled: per destination, a loop
    /// of drain rounds (each destination on its own, so a slow one holds no other), sleeping
    /// the poll interval when nothing was due. Database errors are logged and retried after
    /// the poll interval.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let loops = (0..self.destinations.len()).map(|d| self.run_destination(d, &shutdown));
        join_all(loops).await;
        Ok(())
    }

    async fn run_destination(&self, d: usize, shutdown: &CancellationToken) {
        while !shutdown.is_cancelled() {
            let busy = if self.is_away(d) {
                false
            } else {
                match self.drain_round(d).await {
                    Ok(report) => report.did_something(),
                    Err(e) => {
                        tracing::warn!(destination = %self.destinations[d].name, error = %e, "pgbox router: drain round failed");
                        false
                    }
                }
            };
            if !busy {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(self.poll_interval) => {}
                }
            }
        }
    }

    /// Drains until no deferred delivery of a destination that is not away is due (for
    /// tests and batch jobs). Bounded: at most 100,000 rounds.
    pub async fn drain(&self) -> Result<FanoutDrainReport> {
        let mut total = FanoutDrainReport::default();
        for _ in 0..MAX_DRAIN_ROUNDS {
            let mut progress = false;
            for d in 0..self.destinations.len() {
                if self.is_away(d) {
                    continue;
                }
                let report = self.drain_round(d).await?;
                progress |= report.did_something();
                total.add(&report);
            }
            if !progress {
                break;
            }
        }
        Ok(total)
    }

    /// One drain round of destination `d`: under its drain lock, claim a run per key from
    /// the key's head, publish it in key order, delete what was confirmed (and payloads left
    /// without deliveries), back off or kill what was refused. Nothing counts an outage.
    async fn drain_round(&self, d: usize) -> Result<FanoutDrainReport> {
        let dest = &self.destinations[d];
        let mut report = FanoutDrainReport::default();
        let due: bool = sqlx::query_scalar(AssertSqlSafe(self.sql.due.as_str()))
            .persistent(self.persistent)
            .bind(&dest.name)
            .fetch_one(&self.pool)
            .await?;
        if !due {
            return Ok(report);
        }
        let mut tx = crate::pooler::begin(&self.pool, Some(READ_COMMITTED)).await?;
        let locked: bool = sqlx::query_scalar(AssertSqlSafe(self.sql.drain_lock.as_str()))
            .persistent(self.persistent)
            .bind(format!(
                "pgbox-fanout-drain:{}.{}",
                self.schema.as_str(),
                dest.name
            ))
            .fetch_one(&mut *tx)
            .await?;
        if !locked {
            return Ok(report);
        }
        let rows = sqlx::query(AssertSqlSafe(self.sql.claim.as_str()))
            .persistent(self.persistent)
            .bind(&dest.name)
            .bind(i64::try_from(self.batch_size).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            return Ok(report);
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut envelopes = Vec::with_capacity(rows.len());
        for row in &rows {
            ids.push(row.try_get::<i64, _>("id")?);
            envelopes.push(Envelope::from_row(row, row.try_get("attempts")?)?);
        }
        let results = publish_in_key_order_within(dest, &envelopes, self.destination_timeout).await;
        let mut done: Vec<Uuid> = Vec::new();
        let (mut retry_ids, mut retry_errors, mut retry_delays) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut unavailable = false;
        for ((id, envelope), result) in ids.iter().zip(&envelopes).zip(results) {
            match result {
                Some(Ok(())) => done.push(envelope.id),
                Some(Err(e)) if e.kind() == PublishErrorKind::Refused => {
                    retry_ids.push(*id);
                    retry_errors.push(error_text(&e));
                    let attempt = u32::try_from(envelope.attempts + 1).unwrap_or(1);
                    retry_delays.push(self.backoff.delay_after(attempt).as_secs_f64());
                }
                Some(Err(_)) => unavailable = true,
                None => {}
            }
        }
        self.record_answer(d, unavailable);
        if unavailable {
            report.unavailable += 1;
        }
        if !done.is_empty() {
            sqlx::query(AssertSqlSafe(self.sql.lock_messages.as_str()))
                .persistent(self.persistent)
                .bind(&done)
                .execute(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(self.sql.delete_deliveries.as_str()))
                .persistent(self.persistent)
                .bind(&dest.name)
                .bind(&done)
                .execute(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(self.sql.delete_orphans.as_str()))
                .persistent(self.persistent)
                .bind(&done)
                .execute(&mut *tx)
                .await?;
            report.delivered = done.len() as u64;
        }
        if !retry_ids.is_empty() {
            let dead: Vec<bool> = sqlx::query_scalar(AssertSqlSafe(self.sql.retry.as_str()))
                .persistent(self.persistent)
                .bind(&retry_ids)
                .bind(&retry_errors)
                .bind(&retry_delays)
                .bind(self.max_attempts)
                .fetch_all(&mut *tx)
                .await?;
            report.dead = dead.iter().filter(|&&x| x).count() as u64;
            report.retried = dead.len() as u64 - report.dead;
        }
        tx.commit().await?;
        let label = || dest.name.clone();
        if report.delivered > 0 {
            metrics::counter!(telemetry::FANOUT_DELIVERED_DEFERRED, "destination" => label())
                .increment(report.delivered);
        }
        if report.dead > 0 {
            tracing::warn!(destination = %dest.name, dead = report.dead, "pgbox router: deferred deliveries dead after max_attempts refusals; they hold their keys at this destination");
            metrics::counter!(telemetry::FANOUT_DEAD, "destination" => label())
                .increment(report.dead);
        }
        Ok(report)
    }

    /// Per destination: deferred and dead deliveries, the oldest's age, and whether this
    /// router sees it away. Counts the deliveries (operator use, not a hot path).
    pub async fn status(&self) -> Result<Vec<DestinationStatus>> {
        let rows = sqlx::query(AssertSqlSafe(self.sql.status.as_str()))
            .persistent(self.persistent)
            .fetch_all(&self.pool)
            .await?;
        let mut out = Vec::with_capacity(self.destinations.len());
        let read = |status: &mut DestinationStatus, row: &sqlx::postgres::PgRow| -> Result<()> {
            status.deferred = row.try_get("deferred")?;
            status.dead = row.try_get("dead")?;
            status.oldest = row
                .try_get::<Option<f64>, _>("oldest")?
                .map(|s| Duration::from_secs_f64(s.max(0.0)));
            Ok(())
        };
        for (d, dest) in self.destinations.iter().enumerate() {
            let mut status = DestinationStatus {
                destination: dest.name.clone(),
                deferred: 0,
                dead: 0,
                oldest: None,
                away: self.is_away(d),
                configured: true,
            };
            for row in &rows {
                if row.try_get::<&str, _>("destination")? == dest.name {
                    read(&mut status, row)?;
                }
            }
            out.push(status);
        }
        // Rows of destinations this router does not have (removed from its configuration).
        for row in &rows {
            let name: String = row.try_get("destination")?;
            if self.destinations.iter().all(|d| d.name != name) {
                let mut status = DestinationStatus {
                    destination: name,
                    deferred: 0,
                    dead: 0,
                    oldest: None,
                    away: false,
                    configured: false,
                };
                read(&mut status, row)?;
                out.push(status);
            }
        }
        Ok(out)
    }

    /// Lets go of every deferred delivery of `destination`, a destination this router does
    /// not have (one removed from its configuration: see
    /// [`DestinationStatus::configured`]), and of the payloads no other delivery needs.
    /// Returns how many deliveries went. A destination the router has is refused
    /// ([`Error::InvalidConfig`]): discard its dead deliveries one by one instead.
    pub async fn forget_destination(&self, destination: &str) -> Result<u64> {
        if self.destinations.iter().any(|d| d.name == destination) {
            return Err(Error::InvalidConfig(format!(
                "destination {destination:?} is configured: the router delivers its copies \
                 (discard dead ones with Router::discard)"
            )));
        }
        let mut total = 0;
        // In chunks, each its own transaction under the payload rows' locks (as the drain).
        loop {
            let mut tx = crate::pooler::begin(&self.pool, Some(READ_COMMITTED)).await?;
            let ids: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(self.sql.forget_ids.as_str()))
                .persistent(self.persistent)
                .bind(destination)
                .fetch_all(&mut *tx)
                .await?;
            if ids.is_empty() {
                tx.commit().await?;
                return Ok(total);
            }
            sqlx::query(AssertSqlSafe(self.sql.lock_messages.as_str()))
                .persistent(self.persistent)
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
            let done = sqlx::query(AssertSqlSafe(self.sql.delete_deliveries.as_str()))
                .persistent(self.persistent)
                .bind(destination)
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(self.sql.delete_orphans.as_str()))
                .persistent(self.persistent)
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            total += done.rows_affected();
            tracing::warn!(
                destination,
                deliveries = done.rows_affected(),
                "pgbox router: forgot deferred deliveries of a destination it does not have"
            );
        }
    }

    fn known(&self, destination: &str) -> Result<()> {
        if self.destinations.iter().any(|d| d.name == destination) {
            Ok(())
        } else {
            Err(Error::InvalidConfig(format!(
                "the router has no destination {destination:?}"
            )))
        }
    }

    /// Up to `limit` dead deliveries of `destination`, oldest first.
    pub async fn dead_letters(
        &self,
        destination: &str,
        limit: i64,
    ) -> Result<Vec<FanoutDeadLetter>> {
        self.known(destination)?;
        let rows = sqlx::query(AssertSqlSafe(self.sql.dead_letters.as_str()))
            .persistent(self.persistent)
            .bind(destination)
            .bind(limit.max(0))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(FanoutDeadLetter {
                    message_id: r.try_get("message_id")?,
                    topic: r.try_get("topic")?,
                    ordering_key: r.try_get("ordering_key")?,
                    attempts: r.try_get("attempts")?,
                    last_error: r.try_get("last_error")?,
                    deferred_at: r.try_get("deferred_at")?,
                    dead_at: r.try_get("dead_at")?,
                })
            })
            .collect()
    }

    /// Makes a dead delivery pending again, attempts reset: the drain publishes it (first
    /// of its key there). Returns whether there was such a dead delivery.
    pub async fn redeliver(&self, destination: &str, message_id: Uuid) -> Result<bool> {
        self.known(destination)?;
        let done = sqlx::query(AssertSqlSafe(self.sql.redeliver.as_str()))
            .persistent(self.persistent)
            .bind(destination)
            .bind(message_id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes a dead delivery (the destination never gets that copy; its key there is
    /// released), and the payload with it if no other destination waits for it. Returns
    /// whether there was such a dead delivery.
    pub async fn discard(&self, destination: &str, message_id: Uuid) -> Result<bool> {
        self.known(destination)?;
        let ids = [message_id];
        let mut tx = crate::pooler::begin(&self.pool, Some(READ_COMMITTED)).await?;
        sqlx::query(AssertSqlSafe(self.sql.lock_messages.as_str()))
            .persistent(self.persistent)
            .bind(&ids[..])
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query(AssertSqlSafe(self.sql.discard.as_str()))
            .persistent(self.persistent)
            .bind(destination)
            .bind(message_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(self.sql.delete_orphans.as_str()))
            .persistent(self.persistent)
            .bind(&ids[..])
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }
}

impl Publisher for Router {
    async fn publish(&self, batch: &[Envelope]) -> Vec<std::result::Result<(), PublishError>> {
        self.publish_batch(batch).await
    }

    /// The router calls each destination in key order itself; the relay hands it whole
    /// batches. A batch with an unroutable message publishes nothing, as an atomic batch.
    fn atomic_batches(&self) -> bool {
        true
    }

    /// The destinations' bound: a relay refuses a publish timeout that is not longer.
    fn call_timeout(&self) -> Option<Duration> {
        Some(self.destination_timeout)
    }
}

/// The router shared with its drain loop (`router.run` beside the relay): the same.
impl Publisher for Arc<Router> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<std::result::Result<(), PublishError>> {
        Router::publish(self, batch).await
    }

    fn atomic_batches(&self) -> bool {
        Router::atomic_batches(self)
    }

    fn call_timeout(&self) -> Option<Duration> {
        Router::call_timeout(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(routes: &[(&str, &[&str])]) -> Result<Router> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/none")
            .unwrap();
        let mut b = Router::builder(pool)
            .destination("a", crate::transport::DiscardPublisher)
            .destination("b", crate::transport::DiscardPublisher)
            .destination("c", crate::transport::DiscardPublisher);
        for (p, to) in routes {
            b = b.route(*p, to.iter().copied());
        }
        b.build()
    }

    fn envelope(topic: &str, header: Option<&str>) -> Envelope {
        let mut e = Envelope::new(Uuid::now_v7(), topic, Vec::new());
        if let Some(h) = header {
            e.headers.insert(DESTINATIONS_HEADER.into(), h.into());
        }
        e
    }

    #[tokio::test]
    async fn routes_add_up_with_the_header() {
        let r = router(&[
            ("payments.*", &["a", "b"]),
            ("payments.refund", &["c"]),
            ("audit.>", &["c"]),
        ])
        .unwrap();
        assert_eq!(
            r.targets(&envelope("payments.refund", None)),
            Ok(vec![0, 1, 2])
        );
        assert_eq!(
            r.targets(&envelope("payments.charge", None)),
            Ok(vec![0, 1])
        );
        assert_eq!(r.targets(&envelope("audit.x.y", None)), Ok(vec![2]));
        assert_eq!(
            r.targets(&envelope("audit.x", Some("a, b"))),
            Ok(vec![0, 1, 2])
        );
        assert_eq!(r.targets(&envelope("other", Some("b"))), Ok(vec![1]));
        let unknown = r
            .targets(&envelope("payments.charge", Some("a,zz")))
            .unwrap_err();
        assert!(
            unknown.contains("\"zz\"") && unknown.contains("payments.charge"),
            "{unknown}"
        );
        let unrouted = r.targets(&envelope("other", None)).unwrap_err();
        assert!(unrouted.contains("\"other\""), "{unrouted}");
    }

    #[tokio::test]
    async fn bad_configuration_is_refused_at_build() {
        assert!(router(&[("a.*", &["nope"])]).is_err());
        assert!(router(&[("a..b", &["a"])]).is_err());
        assert!(router(&[("a.>.b", &["a"])]).is_err());
        assert!(router(&[("a", &[])]).is_err());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/none")
            .unwrap();
        let twice = Router::builder(pool.clone())
            .destination("a", crate::transport::DiscardPublisher)
            .destination("a", crate::transport::DiscardPublisher)
            .build();
        assert!(twice.unwrap_err().to_string().contains("twice"));
        for bad in ["", "a,b", "a b", "ü"] {
            let r = Router::builder(pool.clone())
                .destination(bad, crate::transport::DiscardPublisher)
                .build();
            assert!(r.is_err(), "{bad:?} accepted");
        }
    }
}
