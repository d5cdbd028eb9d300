//! The consumer runner: receive from a [`Subscriber`], process through the inbox, ack.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use metrics::{Counter, Histogram};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::{DbErrorKind, Error, Result};
use crate::inbox::{HandlerConnection, Inbox, Key, Lease, LeasedRun, Outcome, Verdict};
use crate::outbox::Envelope;
use crate::outbox::trace::{TRACEPARENT, with_incoming};
use crate::retry::RetryPolicy;
use crate::telemetry;
use crate::transport::Subscriber;
use sqlx::PgPool;

mod batch;
pub(crate) mod hand_backs;
mod limits;

pub use limits::{Limit, MAX_CONCURRENCY_SLOTS, MAX_LIMIT_NAME_BYTES, MAX_RATE_PER_SECOND};

type KeyFn = Arc<dyn Fn(&Envelope) -> String + Send + Sync>;

/// The shortest visibility timeout a [`Consumer`] accepts: below it, a message would be
/// redelivered to another consumer while its handler is still starting.
pub const MIN_VISIBILITY_TIMEOUT: Duration = Duration::from_millis(100);

/// The longest visibility timeout (and poll interval) a [`Consumer`] accepts: one day. A
/// consumer that dies holding a message hides it this long.
pub const MAX_VISIBILITY_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// Builder for a [`Consumer`].
pub struct ConsumerBuilder<S> {
    pool: PgPool,
    source: S,
    topic: String,
    inbox: Inbox,
    concurrency: usize,
    max_deliveries: i32,
    visibility_timeout: Duration,
    backoff: RetryPolicy,
    poll_interval: Duration,
    key: Option<KeyFn>,
    batch_size: usize,
    limits: Vec<Limit>,
}

/// The most messages a [`Consumer`] processes in one transaction
/// ([`ConsumerBuilder::batch_size`]).
pub const MAX_BATCH_SIZE: usize = 1000;

impl<S> fmt::Debug for ConsumerBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("topic", &self.topic)
            .field("consumer", &self.inbox.consumer())
            .finish_non_exhaustive()
    }
}

impl<S: Subscriber> ConsumerBuilder<S> {
    /// Transactions in flight at once (default 8), each on a connection of its own while it
    /// runs, each carrying one message, or up to [`batch_size`](Self::batch_size) of them.
    ///
    /// Under load the runner receives for a quarter of the slots at a time: it receives only
    /// once that many slots are free, so one receive serves several messages, unless the
    /// poll interval has passed since its last receive: then it receives for any free slot.
    /// With a [`batch_size`](Self::batch_size) above 1 a receive already brings a batch per
    /// slot, and the runner receives for any free slot.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// First deliveries processed in one transaction (default 1; at most
    /// [`MAX_BATCH_SIZE`]), for [`Consumer::run`] and [`Consumer::run_or_reject`].
    ///
    /// Each message still goes through [`Inbox::process_or_reject`] with its own key, in
    /// receive order, on the batch's transaction; the batch commits once and then acks every
    /// message in it. That saves a BEGIN and a COMMIT (and its WAL flush) per message.
    ///
    /// - A handler error or panic, or a database error, rolls the whole batch back. The
    ///   failed message is nacked as it would be alone; every other message of the batch
    ///   runs again at once, one per transaction, so a poison message delays its batch
    ///   mates but never fails them. (Their handlers run twice in that case: the first run
    ///   was rolled back.)
    /// - Redeliveries are not batched: they take the one-message path and its
    ///   duplicate check without a transaction.
    /// - A batch is as small as the backlog allows: with few messages waiting, they are
    ///   spread over the free transactions instead.
    /// - The visibility timeout must cover a whole batch: the last message's ack waits for
    ///   every handler before it and the commit.
    ///
    /// Lease mode ([`Consumer::run_leased`]) always runs one message at a time.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Deliveries before a message is dead-lettered (default 10). Those the runner handed back
    /// without running the handler are not the message's and do not count: its key in
    /// progress or leased elsewhere, a [`Limit`] that held it back, the inbox's database away.
    ///
    /// The transport counts every delivery, so the runner takes these off its count before
    /// comparing. Hand-backs of the first kinds are recorded in the inbox's database (table
    /// `hand_backs`, one row per consumer and message), and the instance about to dead-letter
    /// a message reads them there, whichever instance handed it back, before or after a
    /// restart. That read is the only statement they add to a failing delivery, and only to
    /// one about to be dead-lettered. Deliveries that found the database away (or a
    /// hand-back whose record failed) are tallied in the runner's memory only: another
    /// instance, or the same after a restart, counts them as the transport does. The janitor
    /// deletes hand-back rows a week after a message's last hand-back. The count is per
    /// message id: two copies of one message (a relay's duplicate) share it, so a copy may
    /// get more than `n` attempts, never fewer.
    pub fn max_deliveries(mut self, n: i32) -> Self {
        self.max_deliveries = n;
        self
    }

    /// How long a received message stays hidden before it is redelivered to someone else
    /// (default 30 s). Must exceed the handler's worst case.
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        self.visibility_timeout = timeout;
        self
    }

    /// Delay before a failed message is redelivered (default 100 ms base, 1 min cap).
    pub fn backoff(mut self, policy: RetryPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// How often to look for messages without a notification (default 1 s).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The inbox key of a message (default: its message id, which survives re-publishing).
    /// Use a business key when a producer may publish the same event twice under two ids.
    pub fn key(mut self, key: impl Fn(&Envelope) -> String + Send + Sync + 'static) -> Self {
        self.key = Some(Arc::new(key));
        self
    }

    /// Adds a limit that holds across every runner instance: at most so many transactions
    /// in flight, or so many messages a second, globally or per prefix (see [`Limit`]). A
    /// message over a limit waits; it is never failed for it. Limits add up: a message goes
    /// once it is within all of them.
    pub fn limit(mut self, limit: Limit) -> Self {
        self.limits.push(limit);
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Consumer<S>> {
        if self.concurrency == 0 {
            return Err(Error::InvalidConfig(
                "consumer concurrency must be at least 1".into(),
            ));
        }
        if self.max_deliveries < 1 {
            return Err(Error::InvalidConfig(
                "consumer max_deliveries must be at least 1".into(),
            ));
        }
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return Err(Error::InvalidConfig(format!(
                "consumer batch size must be between 1 and {MAX_BATCH_SIZE}, got {}",
                self.batch_size
            )));
        }
        if self.topic.is_empty()
            || self.topic.len() > crate::outbox::MAX_TOPIC_BYTES
            || self.topic.contains('\0')
        {
            return Err(Error::InvalidConfig(format!(
                "consumer topic {:?} must be 1..={} bytes without NUL",
                self.topic,
                crate::outbox::MAX_TOPIC_BYTES
            )));
        }
        if self.poll_interval.is_zero() || self.poll_interval > MAX_VISIBILITY_TIMEOUT {
            return Err(Error::InvalidConfig(format!(
                "consumer poll interval must be positive and at most {MAX_VISIBILITY_TIMEOUT:?}, got {:?}",
                self.poll_interval
            )));
        }
        if self.visibility_timeout < MIN_VISIBILITY_TIMEOUT
            || self.visibility_timeout > MAX_VISIBILITY_TIMEOUT
        {
            return Err(Error::InvalidConfig(format!(
                "consumer visibility timeout must be between {MIN_VISIBILITY_TIMEOUT:?} and {MAX_VISIBILITY_TIMEOUT:?}, got {:?}",
                self.visibility_timeout
            )));
        }
        let limits = limits::Limits::new(self.limits, self.inbox.schema(), self.inbox.pooler())?;
        let hand_backs = hand_backs::HandBacks::new(self.inbox.schema(), self.inbox.pooler())?;
        Ok(Consumer {
            limits,
            pool: self.pool,
            source: self.source,
            topic: self.topic,
            inbox: self.inbox,
            concurrency: self.concurrency,
            max_deliveries: self.max_deliveries,
            visibility_timeout: self.visibility_timeout,
            backoff: self.backoff,
            poll_interval: self.poll_interval,
            key: self.key,
            batch_size: self.batch_size,
            away: std::sync::Mutex::new(AwayTally::default()),
            hand_backs,
        })
    }
}

/// Counts of what a [`Consumer::run`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Handler ran and committed.
    pub processed: u64,
    /// Skipped by the inbox as already processed (then acked).
    pub duplicates: u64,
    /// Rejected by the handler for good (then acked): [`Consumer::run_or_reject`] only.
    pub rejected: u64,
    /// Failed and sent back for redelivery.
    pub retried: u64,
    /// Of the failures, how many were handler panics (each also counted as retried or
    /// dead-lettered).
    pub panicked: u64,
    /// Moved to the queue's dead letters.
    pub dead_lettered: u64,
}

/// Runs a handler for every message of a topic, exactly once in effect.
///
/// Per delivery: begin → [`Inbox::process`] (key from the builder, default the message id)
/// → commit → ack. A handler error rolls back and nacks with backoff; after
/// `max_deliveries` the message is dead-lettered. A crash between commit and ack only means
/// a redelivery, which the inbox reports as a duplicate and which is then acked. With
/// [`ConsumerBuilder::batch_size`], first deliveries share a transaction: begin → `process`
/// per message → commit → ack them all together.
///
/// Every run records its counts, its handler durations and its receive lag as metrics
/// labelled with the consumer and the topic (see [`telemetry`](crate::telemetry)); install
/// the recorder before starting the run.
///
/// ```no_run
/// use pgbox::transport::PgQueue;
/// use pgbox::{CancellationToken, Consumer, Envelope, HandlerConnection, Inbox};
/// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// let queue = PgQueue::new(pool.clone());
/// let consumer = Consumer::builder(pool.clone(), queue, "payments", Inbox::new("points")?)
///     .concurrency(4)
///     .build()?;
/// let stats = consumer
///     .run(
///         async |message: &Envelope, conn: &mut HandlerConnection<'_>| {
///             let body: serde_json::Value = message.json()?;
///             // Commits with the inbox row: once per message, however often it is delivered.
///             sqlx::query("INSERT INTO points (order_id, points) VALUES ($1, 30)")
///                 .bind(body["order"].as_i64())
///                 .execute(&mut *conn)
///                 .await?;
///             Ok::<(), pgbox::Error>(())
///         },
///         CancellationToken::new(),
///     )
///     .await?;
/// println!("{} processed, {} duplicates absorbed", stats.processed, stats.duplicates);
/// # Ok(()) }
/// ```
pub struct Consumer<S> {
    pool: PgPool,
    source: S,
    topic: String,
    inbox: Inbox,
    concurrency: usize,
    max_deliveries: i32,
    visibility_timeout: Duration,
    backoff: RetryPolicy,
    poll_interval: Duration,
    key: Option<KeyFn>,
    batch_size: usize,
    limits: limits::Limits,
    /// Deliveries of each message this runner handed back without running the handler.
    away: std::sync::Mutex<AwayTally>,
    /// The same, recorded in the database for every instance (of the not-attempted kinds).
    hand_backs: hand_backs::HandBacks,
}

/// Per message id, the deliveries this runner handed back without the message having
/// failed: the inbox's database was away, or the key was in progress or leased elsewhere (the
/// handler did not run). They are not the message's failures, so they are taken off its
/// delivery number before `max_deliveries` is compared. Kept per copy: the relay is at least
/// once, so two copies of a message can share its id, each with its own delivery numbers; a
/// delivery continues the track whose last delivery was the one before it (or the nearest
/// below), so each copy is dead-lettered after `max_deliveries` failures of its own (two
/// copies whose tracks are alike may swap them: the failures in all stay the same). In
/// memory; the hand-backs recorded in the database (`recorded`) are also counted there for
/// every instance (see `hand_backs`), and are read before a message is dead-lettered. Forgotten once the message is settled in the inbox (processed,
/// rejected, a duplicate); a dead letter ends its copy's track. Bounded: [`AwayTally::COPIES`]
/// tracks per message (more are counted as the transport does), and at [`AwayTally::MAX`]
/// messages those not seen for an hour are forgotten, and while it stays full no new message
/// is tallied.
#[derive(Debug, Default)]
struct AwayTally(std::collections::HashMap<uuid::Uuid, (Vec<Track>, Instant)>);

/// One copy's deliveries: the last one's number, how many were not its failures, and how
/// many of those were recorded in the database's hand-backs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Track {
    last: i32,
    away: i32,
    recorded: i32,
}

impl AwayTally {
    const MAX: usize = 100_000;
    const COPIES: usize = 16;

    /// Delivery `delivery` of `id` settled: not the message's failure (`away`; also in the
    /// database's hand-backs if `recorded`) or its own. Returns the delivery's number among
    /// the message's own, this one included when it is its own, and how many of the copy's
    /// deliveries taken off were recorded.
    fn settle(&mut self, id: uuid::Uuid, delivery: i32, away: bool, recorded: bool) -> (i32, i32) {
        if self.0.len() >= Self::MAX && !self.0.contains_key(&id) {
            self.0
                .retain(|_, (_, seen)| seen.elapsed() < Duration::from_secs(3600));
            if self.0.len() >= Self::MAX {
                return (delivery, 0);
            }
        }
        let (tracks, seen) = self.0.entry(id).or_insert((Vec::new(), Instant::now()));
        *seen = Instant::now();
        let at = tracks
            .iter()
            .position(|t| t.last == delivery - 1)
            .or_else(|| {
                tracks
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.last < delivery)
                    .max_by_key(|(_, t)| t.last)
                    .map(|(i, _)| i)
            });
        let track = match at {
            Some(i) => &mut tracks[i],
            None if tracks.len() < Self::COPIES => {
                tracks.push(Track {
                    last: 0,
                    away: 0,
                    recorded: 0,
                });
                tracks.last_mut().expect("just pushed")
            }
            None => return (delivery, 0),
        };
        track.last = delivery;
        if away {
            track.away = track.away.saturating_add(1);
            if recorded {
                track.recorded = track.recorded.saturating_add(1);
            }
        }
        (delivery - track.away, track.recorded)
    }

    /// The copy whose delivery `delivery` was dead-lettered is gone.
    fn end(&mut self, id: &uuid::Uuid, delivery: i32) {
        if let Some((tracks, _)) = self.0.get_mut(id) {
            // Of the tracks at that delivery, the one with the most failures of its own.
            if let Some(i) = tracks
                .iter()
                .enumerate()
                .filter(|(_, t)| t.last == delivery)
                .min_by_key(|(_, t)| t.away)
                .map(|(i, _)| i)
            {
                tracks.swap_remove(i);
            }
            if tracks.is_empty() {
                self.0.remove(id);
            }
        }
    }

    fn forget(&mut self, id: &uuid::Uuid) {
        self.0.remove(id);
    }
}

/// What the test kit's `run_until_idle` looks at.
#[cfg(feature = "testing")]
impl<S> Consumer<S> {
    pub(crate) fn source(&self) -> &S {
        &self.source
    }

    pub(crate) fn topic(&self) -> &str {
        &self.topic
    }
}

impl<S> fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("topic", &self.topic)
            .field("consumer", &self.inbox.consumer())
            .field("concurrency", &self.concurrency)
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}

/// An ack for a delivery its transaction is done with: the receive loop runs it beside the
/// handlers, outside their slots (see [`Consumer::drive`]).
type Ack<'a> = std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// What a unit of deliveries came to once its transaction ended: how each was settled, and
/// the acks of those the inbox settled, still to be made.
struct Handled<'a> {
    settled: Vec<Settled>,
    acks: Vec<Ack<'a>>,
}

enum Settled {
    Processed,
    Duplicate,
    Rejected,
    Retried,
    DeadLettered,
    /// A panic, then retried (`false`) or dead-lettered (`true`).
    Panicked(bool),
}

impl<S: Subscriber> Consumer<S> {
    /// A consumer of `topic` from `source`, deduplicating through `inbox` in the database
    /// of `pool` (the database its handler writes to, which need not be the transport's).
    pub fn builder(
        pool: PgPool,
        source: S,
        topic: impl Into<String>,
        inbox: Inbox,
    ) -> ConsumerBuilder<S> {
        ConsumerBuilder {
            pool,
            source,
            topic: topic.into(),
            inbox,
            concurrency: 8,
            max_deliveries: 10,
            visibility_timeout: Duration::from_secs(30),
            backoff: RetryPolicy::new()
                .base_delay(Duration::from_millis(100))
                .max_delay(Duration::from_secs(60)),
            poll_interval: Duration::from_secs(1),
            key: None,
            batch_size: 1,
            limits: Vec::new(),
        }
    }

    /// Processes messages until `shutdown` is cancelled, then finishes the ones in hand and
    /// returns what it did. The handler gets the message and the transaction's connection.
    /// Acks still unanswered a visibility timeout after the last transaction ended (a broker
    /// or database that stopped answering) are given up: those messages come back and are
    /// answered as duplicates.
    pub async fn run<F, E>(&self, handler: F, shutdown: CancellationToken) -> Result<ConsumerStats>
    where
        F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<(), E> + Clone,
        E: From<Error> + fmt::Display,
    {
        self.run_or_reject(
            async move |envelope: &Envelope, conn: &mut HandlerConnection<'_>| {
                handler(envelope, conn).await.map(Verdict::Accept)
            },
            shutdown,
        )
        .await
    }

    /// Like [`run`](Self::run), for handlers that may refuse a message for good by returning
    /// [`Verdict::Reject`]: the inbox row commits with the reason (see
    /// [`Inbox::process_or_reject`]), the message is acked, and later deliveries of its key
    /// are duplicates. Counted in [`ConsumerStats::rejected`].
    pub async fn run_or_reject<F, E>(
        &self,
        handler: F,
        shutdown: CancellationToken,
    ) -> Result<ConsumerStats>
    where
        F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<Verdict<()>, E> + Clone,
        E: From<Error> + fmt::Display,
    {
        let metrics = RunMetrics::new(self.inbox.consumer(), &self.topic, &self.limits);
        self.drive(
            self.batch_size,
            |unit| self.handle_unit(unit, handler.clone(), &metrics),
            &metrics,
            shutdown,
        )
        .await
    }

    /// Lease mode for a topic whose handler's effect is outside the database (an HTTP call,
    /// an email): per delivery, [`Inbox::run_leased`] with a lease of `ttl`, then ack.
    ///
    /// The handler gets the message and the [`Lease`] (its fencing token for the external
    /// call; [`Lease::extend`] for a long effect); no transaction or connection is held
    /// while it runs. Success completes the key and acks; a duplicate (consumed by either
    /// mode) acks; an error or a panic releases the lease and nacks with backoff, then
    /// dead-letters after `max_deliveries`, as [`run`](Self::run) does. A key leased
    /// elsewhere is nacked until that lease can have expired (at least the backoff), and a
    /// completion refused because the lease was lost ([`Error::LeaseLost`]) is nacked: the
    /// redelivery finds the key consumed by the new holder, or leases it again.
    pub async fn run_leased<F, E>(
        &self,
        handler: F,
        ttl: Duration,
        shutdown: CancellationToken,
    ) -> Result<ConsumerStats>
    where
        F: AsyncFnOnce(&Envelope, &mut Lease) -> Result<(), E> + Clone,
        E: From<Error> + fmt::Display,
    {
        crate::inbox::lease_ttl_micros(ttl)?;
        if !self.limits.is_empty() {
            return Err(Error::InvalidConfig(
                "consumer limits apply to run and run_or_reject; lease mode does not take them"
                    .into(),
            ));
        }
        let metrics = RunMetrics::new(self.inbox.consumer(), &self.topic, &self.limits);
        self.drive(
            1,
            |unit: Vec<S::Delivery>| async {
                let mut handled = Handled {
                    settled: Vec::with_capacity(unit.len()),
                    acks: Vec::new(),
                };
                for delivery in unit {
                    let (settled, ack) = self
                        .handle_leased(delivery, handler.clone(), ttl, &metrics)
                        .await;
                    handled.settled.push(settled);
                    handled.acks.extend(ack);
                }
                handled
            },
            &metrics,
            shutdown,
        )
        .await
    }

    /// The receive loop shared by [`run_or_reject`](Self::run_or_reject) and
    /// [`run_leased`](Self::run_leased): `handle` settles a unit of up to `batch` deliveries
    /// (one transaction's worth), and at most `concurrency` units are in flight.
    ///
    /// A unit holds its slot while its transaction is open, not while its acks are made: once
    /// it has committed, its acks join a set of their own, run beside the handlers, and the
    /// slot takes the next delivery. Receiving while acks are still out keeps per-key order
    /// only because every transport holds a key from handing out a message until that
    /// message is settled, and lets no later message of the key overtake one it holds back
    /// (RabbitMQ's receive keeps a key's messages behind its held ones even when the key is
    /// released mid-receive). While the set holds `concurrency` × `batch` acks or more,
    /// nothing more is received; units already in flight may still add theirs, so it never
    /// holds twice that. At shutdown, acks still out a visibility timeout after the last
    /// unit ended are abandoned (logged): their messages come back and are answered as
    /// duplicates.
    async fn drive<'a, H, Fut>(
        &'a self,
        batch: usize,
        handle: H,
        metrics: &RunMetrics,
        shutdown: CancellationToken,
    ) -> Result<ConsumerStats>
    where
        H: Fn(Vec<S::Delivery>) -> Fut,
        Fut: Future<Output = Handled<'a>>,
    {
        let mut stats = ConsumerStats::default();
        let mut in_flight = FuturesUnordered::new();
        let mut acking: FuturesUnordered<Ack<'a>> = FuturesUnordered::new();
        let max_acking = self.concurrency * batch;
        // When the acks still out at shutdown are given up (see above).
        let mut abandon_acks_at: Option<tokio::time::Instant> = None;
        // The wake-up channel, when the source has one. Lost or never made, the listener is
        // made again with backoff (the server restarted, a failover, a network blip): a
        // consumer that stopped listening would wait out every poll interval for as long as
        // it lives. Meanwhile the receive at the top of the loop keeps polling, so nothing
        // is missed, only later.
        let wake_channel = self.source.wake_channel();
        let mut listener = None;
        let mut relisten = Relisten::default();
        // Consecutive failed receives (the database or the broker is away).
        let mut receive_failures: u32 = 0;
        // Under load, handlers finish one at a time, and receiving for each single free slot
        // costs a receive statement (a fetch, a poll) per message. So the loop receives only
        // once a quarter of the slots are free, unless the poll timer has fired since the
        // last receive (`eager`): the timer runs from the last receive and is not restarted
        // by handlers finishing or by notifications, so a free slot idles at most one poll
        // interval behind handlers that run long. A batched runner's receive already brings a
        // batch per free slot, so it receives for any free slot.
        let refill_at = if batch > 1 {
            1
        } else {
            refill_threshold(self.concurrency)
        };
        let mut eager = true;
        let mut next_poll = tokio::time::Instant::now();
        loop {
            let stopping = shutdown.is_cancelled();
            if stopping && in_flight.is_empty() {
                if acking.is_empty() {
                    return Ok(stats);
                }
                let at = *abandon_acks_at
                    .get_or_insert_with(|| tokio::time::Instant::now() + self.visibility_timeout);
                if tokio::time::Instant::now() >= at {
                    tracing::warn!(
                        acks = acking.len(),
                        "pgbox consumer stopping with acks that did not finish within the visibility timeout; their messages will be redelivered and answered as duplicates"
                    );
                    return Ok(stats);
                }
            }
            if listener.is_none()
                && !stopping
                && let Some((pool, channel)) = &wake_channel
                && relisten.due()
            {
                listener = relisten.attempt(pool, channel).await;
            }
            let free = if acking.len() >= max_acking {
                0
            } else {
                self.concurrency - in_flight.len()
            };
            if !stopping && free > 0 && (eager || free >= refill_at) {
                // Keep driving the handlers in flight while receiving: they may hold the
                // pool's connections, and the receive may be waiting for one of them.
                let receive =
                    self.source
                        .receive(&self.topic, free * batch, self.visibility_timeout);
                tokio::pin!(receive);
                // A shutdown abandons a receive that is still waiting (a broker's receive
                // may wait for messages, or for a reconnect): whatever it had taken is not
                // acked and comes back after the visibility timeout or with the channel.
                let received = loop {
                    tokio::select! {
                        r = &mut receive => break Some(r),
                        Some(handled) = in_flight.next(), if !in_flight.is_empty() => {
                            count_all(&mut stats, handled, &mut acking, metrics);
                        }
                        Some(()) = acking.next(), if !acking.is_empty() => {}
                        _ = shutdown.cancelled() => break None,
                    }
                };
                let Some(received) = received else { continue };
                if received.is_err() {
                    receive_failures += 1;
                } else if receive_failures > 0 {
                    tracing::info!(
                        failures = receive_failures,
                        "pgbox consumer receiving again"
                    );
                    receive_failures = 0;
                }
                eager = false;
                next_poll = tokio::time::Instant::now()
                    + receive_backoff(self.poll_interval, receive_failures);
                match received {
                    Ok(received) if !received.is_empty() => {
                        // Spread over the free transactions, at most `batch` per unit: a
                        // short backlog runs in parallel, a long one in full batches.
                        let per_unit = received.len().div_ceil(free).clamp(1, batch);
                        let mut received = received.into_iter().peekable();
                        while received.peek().is_some() {
                            in_flight.push(handle(received.by_ref().take(per_unit).collect()));
                        }
                        if in_flight.len() < self.concurrency {
                            continue; // there may be more right away
                        }
                    }
                    Ok(_) => {}
                    // Don't spin on a database or broker that is down: fall through to the
                    // wait, which grows while the failures last.
                    Err(e) => {
                        if receive_failures == 1 {
                            tracing::warn!(error = %e, "pgbox consumer receive failed; retrying with backoff");
                        } else {
                            tracing::debug!(error = %e, failures = receive_failures, "pgbox consumer receive failed again");
                        }
                    }
                }
            }
            let mut lost_listener = false;
            tokio::select! {
                Some(handled) = in_flight.next(), if !in_flight.is_empty() => {
                    count_all(&mut stats, handled, &mut acking, metrics);
                }
                Some(()) = acking.next(), if !acking.is_empty() => {}
                _ = shutdown.cancelled(), if !stopping => {}
                _ = async {
                    match abandon_acks_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
                _ = tokio::time::sleep_until(next_poll) => {
                    eager = true;
                    next_poll = tokio::time::Instant::now()
                        + receive_backoff(self.poll_interval, receive_failures);
                }
                // Ok(None) means the connection dropped and reconnects on the next call;
                // missed notifications are covered by the receive at the top of the loop.
                n = async { listener.as_mut().expect("guarded").try_recv().await },
                    if listener.is_some() && !stopping =>
                {
                    if let Err(e) = n {
                        tracing::warn!(error = %e, "pgbox consumer lost LISTEN; polling until it is back");
                        lost_listener = true;
                    }
                }
            }
            if lost_listener {
                listener = None;
            }
        }
    }

    /// One delivery in a transaction of its own (its receipt already recorded). Settled by
    /// the inbox (processed, rejected, a duplicate), it comes back with its ack still to make.
    async fn handle<F, E>(
        &self,
        delivery: S::Delivery,
        handler: F,
        metrics: &RunMetrics,
    ) -> (Settled, Option<Ack<'_>>)
    where
        F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<Verdict<()>, E>,
        E: From<Error> + fmt::Display,
    {
        let envelope = self.source.envelope(&delivery);
        let attempt = self.source.attempt(&delivery);
        let id = envelope.id;
        let key = match self.key_of(envelope) {
            Ok(key) => key,
            Err(message) => {
                let settled = self
                    .panicked(&delivery, format!("key function: {message}"))
                    .await;
                return (settled, None);
            }
        };
        let prefixes = match self.limits.prefixes(envelope, &key) {
            Ok(prefixes) => prefixes,
            Err(message) => {
                let settled = self
                    .panicked(&delivery, format!("limit prefix function: {message}"))
                    .await;
                return (settled, None);
            }
        };
        let span = handle_span(envelope, attempt, "transaction");
        // `Ok`: settled in the inbox, to be acked; `Err`: settled by a nack or a dead letter.
        let settled: std::result::Result<Settled, Settled> = async {
            // A redelivery was often processed already (the ack was lost, or the visibility
            // timeout expired just after the commit): one autocommit read settles it, without
            // a transaction. `None` or an error: take the normal path, which decides.
            if attempt > 1
                && let Ok(Some(_)) = self
                    .inbox
                    .lookup_on_pool(&self.pool, Key::new(key.as_str()))
                    .await
            {
                return Ok(Settled::Duplicate);
            }
            // A panicking handler is a failed delivery like any other: the transaction was
            // aborted and is rolled back as the unwind drops it; the message is nacked or
            // dead-lettered, and the runner and the other messages in flight carry on.
            let process = self.process(&key, &prefixes, envelope, handler, metrics);
            let result = match AssertUnwindSafe(process).catch_unwind().await {
                Ok(result) => result,
                Err(panic) => {
                    let message = panic_message(panic.as_ref());
                    return Err(self.panicked(&delivery, message).await);
                }
            };
            match result {
                Ok(Outcome::Processed(())) => Ok(Settled::Processed),
                Ok(Outcome::Duplicate(_)) => Ok(Settled::Duplicate),
                Ok(Outcome::Rejected(_)) => Ok(Settled::Rejected),
                Ok(Outcome::InProgress) => {
                    metrics.in_progress.increment(1);
                    Err(self
                        .retry_not_attempted(&delivery, "in progress elsewhere", Duration::ZERO)
                        .await)
                }
                // Waited its share of the visibility timeout for a limit (or its bucket's
                // wait is long): handed back, uncounted, before the visibility timeout could
                // hand it to someone else, not to come back before its limit may let it go.
                Err(Failure::Limited(delay)) => {
                    Err(self.retry_not_attempted(&delivery, LIMITED, delay).await)
                }
                Err(Failure::Database(e)) if database_away(&e) => {
                    // Not the message's fault: never dead-lettered for it (a failover would
                    // otherwise use up its deliveries while the handler never ran).
                    metrics.handler_errors.increment(1);
                    Err(self.retry_while_away(&delivery, &e).await)
                }
                Err(e) => {
                    metrics.handler_errors.increment(1);
                    Err(self.retry(&delivery, &e.to_string()).await)
                }
            }
        }
        .instrument(span.clone())
        .await;
        self.then_ack(settled, id, delivery, span)
    }

    /// A delivery settled in the inbox (`Ok`) is forgotten by the away tally and comes back
    /// with its ack still to make; one settled by a nack or a dead letter (`Err`) without.
    fn then_ack(
        &self,
        settled: std::result::Result<Settled, Settled>,
        id: uuid::Uuid,
        delivery: S::Delivery,
        span: tracing::Span,
    ) -> (Settled, Option<Ack<'_>>) {
        match settled {
            Ok(settled) => {
                self.away.lock().expect("away tally").forget(&id);
                (settled, Some(self.ack_later(delivery, span)))
            }
            Err(settled) => (settled, None),
        }
    }

    /// The ack of a delivery the inbox settled, to be run by the receive loop. Committed
    /// but not acked (the ack failed, or the runner died first): the redelivery is a
    /// duplicate.
    fn ack_later(&self, delivery: S::Delivery, span: tracing::Span) -> Ack<'_> {
        Box::pin(
            async move {
                if let Err(e) = self.ack_settled(&delivery).await {
                    tracing::warn!(error = %e, "pgbox ack failed; the redelivery will be absorbed");
                }
            }
            .instrument(span),
        )
    }

    /// Acks a delivery the inbox settled (processed, rejected, a duplicate). With the test
    /// kit's `consumer.after_handler_commit_before_ack` fault point armed, hands it back
    /// unacked instead, as a runner that died there would.
    async fn ack_settled(&self, delivery: &S::Delivery) -> Result<bool> {
        #[cfg(feature = "testing")]
        {
            let point = crate::testing::FaultPoint::ConsumerAfterHandlerCommitBeforeAck;
            if crate::testing::hit(point) {
                let crash = crate::testing::crash(point).to_string();
                return self.source.nack(delivery, Duration::ZERO, &crash).await;
            }
        }
        self.source.ack(delivery).await
    }

    /// The inbox key of `envelope`: the configured key function's, or the message id. A
    /// panicking key function (an `unwrap` on a payload field) is caught like a panicking
    /// handler, so one bad message cannot take the runner down.
    fn key_of(&self, envelope: &Envelope) -> std::result::Result<String, String> {
        match &self.key {
            Some(f) => std::panic::catch_unwind(AssertUnwindSafe(|| f(envelope)))
                .map_err(|panic| panic_message(panic.as_ref())),
            None => Ok(envelope.id.to_string()),
        }
    }

    /// A handler panicked: a failed delivery, logged at error level, then nacked or
    /// dead-lettered like an error.
    async fn panicked(&self, delivery: &S::Delivery, message: String) -> Settled {
        tracing::error!(
            message_id = %self.source.envelope(delivery).id,
            delivery = self.source.attempt(delivery),
            panic = %message,
            "pgbox handler panicked; delivery failed"
        );
        let error = format!("handler panicked: {message}");
        match self.retry(delivery, &error).await {
            Settled::DeadLettered => Settled::Panicked(true),
            _ => Settled::Panicked(false),
        }
    }

    async fn handle_leased<F, E>(
        &self,
        delivery: S::Delivery,
        handler: F,
        ttl: Duration,
        metrics: &RunMetrics,
    ) -> (Settled, Option<Ack<'_>>)
    where
        F: AsyncFnOnce(&Envelope, &mut Lease) -> Result<(), E>,
        E: From<Error> + fmt::Display,
    {
        let envelope = self.source.envelope(&delivery);
        let attempt = self.source.attempt(&delivery);
        let id = envelope.id;
        metrics.received(envelope, attempt);
        let key = match self.key_of(envelope) {
            Ok(key) => key,
            Err(message) => {
                let settled = self
                    .panicked(&delivery, format!("key function: {message}"))
                    .await;
                return (settled, None);
            }
        };
        let span = handle_span(envelope, attempt, "lease");
        // `Ok`: settled in the inbox, to be acked; `Err`: settled by a nack or a dead letter.
        let settled: std::result::Result<Settled, Settled> = async {
            // No redelivery shortcut: the lease statement is itself one autocommit read for
            // a consumed key.
            let key = Key::new(key.as_str()).with_message_id(envelope.id.to_string());
            let incoming = envelope.headers.get(TRACEPARENT).cloned();
            let run = with_incoming(
                incoming,
                // pgbox's failures (the lease, its completion) apart from the handler's, as
                // in `process`: a database that is away is not the message's failure.
                self.inbox.run_leased::<_, Failure<E>, _>(
                    &self.pool,
                    key,
                    ttl,
                    async |lease: &mut Lease| {
                        let _timer = metrics.time_handler();
                        handler(envelope, lease).await.map_err(Failure::Handler)
                    },
                ),
            );
            let result = match AssertUnwindSafe(run).catch_unwind().await {
                Ok(result) => result,
                // run_leased released the lease before resuming the panic.
                Err(panic) => {
                    let message = panic_message(panic.as_ref());
                    return Err(self.panicked(&delivery, message).await);
                }
            };
            match result {
                Ok(LeasedRun::Completed { .. }) => Ok(Settled::Processed),
                Ok(LeasedRun::Duplicate(_)) => Ok(Settled::Duplicate),
                Ok(LeasedRun::InProgress { retry_after, .. }) => {
                    metrics.in_progress.increment(1);
                    Err(self
                        .retry_not_attempted(&delivery, "leased elsewhere", retry_after)
                        .await)
                }
                Err(Failure::Database(e)) if database_away(&e) => {
                    metrics.handler_errors.increment(1);
                    Err(self.retry_while_away(&delivery, &e).await)
                }
                Err(e) => {
                    metrics.handler_errors.increment(1);
                    Err(self.retry(&delivery, &e.to_string()).await)
                }
            }
        }
        .instrument(span.clone())
        .await;
        self.then_ack(settled, id, delivery, span)
    }

    /// One delivery through the inbox. pgbox's own failures (the claim, the commit) stay
    /// apart from the handler's, so that a database that is away is told from a bad message.
    async fn process<F, E>(
        &self,
        key: &str,
        prefixes: &limits::Prefixes,
        envelope: &Envelope,
        handler: F,
        metrics: &RunMetrics,
    ) -> Result<Outcome<()>, Failure<E>>
    where
        F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<Verdict<()>, E>,
        E: From<Error>,
    {
        let key = Key::new(key).with_message_id(envelope.id.to_string());
        // Messages the handler enqueues continue this message's trace.
        let incoming = envelope.headers.get(TRACEPARENT).cloned();
        let run = async |conn: &mut HandlerConnection<'_>| {
            let _timer = metrics.time_handler();
            handler(envelope, conn).await.map_err(Failure::Handler)
        };
        if self.limits.is_empty() {
            // `process_and_commit` on a transaction begun by `pooler::begin` (safe to drop
            // mid-`BEGIN`): sqlx's own transaction, so the handler's nested units are
            // savepoints.
            return with_incoming(
                incoming,
                self.inbox
                    .process_or_reject_and_commit_on_pool(&self.pool, key, run),
            )
            .await;
        }
        key.validate()?;
        let deadline = self.limit_deadline();
        // Tokens before the transaction: no connection is held while a bucket refills.
        if self.limits.has_rates()
            && let limits::Waited::HandBack(delay) = self
                .limits
                .take_tokens(&self.pool, prefixes, deadline, &metrics.limit_waits)
                .await?
        {
            return Err(Failure::Limited(delay));
        }
        let mut tx = crate::pooler::begin(&self.pool, None).await?;
        // Slots on the unit's own transaction: its COMMIT or ROLLBACK (or a lost
        // connection) frees them.
        if self.limits.has_slots()
            && let limits::Waited::HandBack(delay) = self
                .limits
                .take_slots(
                    &mut tx,
                    prefixes,
                    &mut limits::Held::new(),
                    deadline,
                    &metrics.limit_waits,
                )
                .await?
        {
            return Err(Failure::Limited(delay));
        }
        with_incoming(incoming, self.inbox.process_or_reject_in_own(tx, key, run)).await
    }

    /// Until when a unit may wait for its limits: a third of the visibility timeout, so
    /// that the handler still has the rest before the message is redelivered.
    fn limit_deadline(&self) -> Instant {
        Instant::now() + self.visibility_timeout / 3
    }

    /// The inbox's database refused or lost the delivery's transaction (see
    /// [`database_away`]): nacked with the backoff, never dead-lettered, however many
    /// deliveries it has had.
    async fn retry_while_away(&self, delivery: &S::Delivery, error: &Error) -> Settled {
        let attempt = self.source.attempt(delivery);
        self.away.lock().expect("away tally").settle(
            self.source.envelope(delivery).id,
            attempt,
            true,
            false,
        );
        let delay = self.backoff.delay_after(attempt.max(1) as u32);
        if error.needs_migration() {
            // Lasts until someone acts: say so where an operator looks.
            tracing::warn!(error = %error, delivery = attempt, "pgbox inbox tables missing; redelivering later");
        } else {
            tracing::debug!(error = %error, delivery = attempt, "pgbox inbox database unavailable; redelivering later");
        }
        match self.source.nack(delivery, delay, &error.to_string()).await {
            Ok(_) => Settled::Retried,
            Err(e) => {
                tracing::warn!(error = %e, "pgbox nack failed");
                Settled::Retried
            }
        }
    }

    /// The handler did not run: the key is in progress or leased elsewhere (another copy of
    /// the message, or a lease an outage left), or a limit held it back. Not the message's
    /// failure: nacked with at least `min_delay`, never dead-lettered for it, and not counted
    /// (see `AwayTally`), by any instance: the hand-back is recorded in the database before
    /// the nack makes the message visible again.
    async fn retry_not_attempted(
        &self,
        delivery: &S::Delivery,
        error: &str,
        min_delay: Duration,
    ) -> Settled {
        let id = self.source.envelope(delivery).id;
        let attempt = self.source.attempt(delivery);
        let recorded = match self
            .hand_backs
            .record(&self.pool, self.inbox.consumer(), id)
            .await
        {
            Ok(()) => true,
            Err(e) => {
                // Counted by this runner alone (another instance counts it as the
                // transport does).
                tracing::debug!(error = %e, "pgbox hand-back not recorded");
                false
            }
        };
        let (own, _) = self
            .away
            .lock()
            .expect("away tally")
            .settle(id, attempt, true, recorded);
        let delay = self
            .backoff
            .delay_after(own.max(1) as u32)
            .max(min_delay.min(MAX_VISIBILITY_TIMEOUT));
        match self.source.nack(delivery, delay, error).await {
            Ok(_) => Settled::Retried,
            Err(e) => {
                tracing::warn!(error = %e, "pgbox nack failed");
                Settled::Retried
            }
        }
    }

    /// A delivery about to be dead-lettered: `own` of its deliveries were its own as this
    /// runner counted them, `recorded` of those it took off being hand-backs it recorded in
    /// the database. The database's count of the message's hand-backs (every instance's)
    /// replaces those: fewer own deliveries when other instances handed it back too. The
    /// database away, this runner's count stands.
    async fn own_across_instances(&self, id: uuid::Uuid, own: i32, recorded: i32) -> i32 {
        match self
            .hand_backs
            .count(&self.pool, self.inbox.consumer(), id)
            .await
        {
            Ok(all) => own.saturating_add(recorded) - all.max(recorded),
            Err(e) => {
                tracing::debug!(error = %e, "pgbox hand-backs not read; counting this runner's");
                own
            }
        }
    }

    async fn retry(&self, delivery: &S::Delivery, error: &str) -> Settled {
        self.retry_not_before(delivery, error, Duration::ZERO).await
    }

    /// Like [`retry`](Self::retry), with the nack delay at least `min_delay` (capped at the
    /// longest visibility timeout).
    async fn retry_not_before(
        &self,
        delivery: &S::Delivery,
        error: &str,
        min_delay: Duration,
    ) -> Settled {
        // Only the message's own deliveries count: not those an outage of the inbox's
        // database used up (see `AwayTally`).
        let id = self.source.envelope(delivery).id;
        let delivered = self.source.attempt(delivery);
        let (mut attempt, recorded) = self
            .away
            .lock()
            .expect("away tally")
            .settle(id, delivered, false, false);
        if attempt >= self.max_deliveries {
            attempt = self.own_across_instances(id, attempt, recorded).await;
        }
        let outcome = if attempt >= self.max_deliveries {
            // Only this copy's track ends: another copy of the message may still come.
            self.away.lock().expect("away tally").end(&id, delivered);
            // The message's hand-backs stay (the janitor deletes them): another copy of it
            // (the same id, a relay's duplicate) is counted with them, so that no copy is
            // dead-lettered before `max_deliveries` attempts of its own; a copy may get more.
            self.source
                .dead_letter(delivery, error)
                .await
                .map(|_| Settled::DeadLettered)
        } else {
            let delay = self
                .backoff
                .delay_after(attempt.max(1) as u32)
                .max(min_delay.min(MAX_VISIBILITY_TIMEOUT));
            self.source
                .nack(delivery, delay, error)
                .await
                .map(|_| Settled::Retried)
        };
        outcome.unwrap_or_else(|e| {
            // The visibility timeout will bring it back.
            tracing::warn!(error = %e, "pgbox nack failed");
            Settled::Retried
        })
    }
}

/// A failed delivery: pgbox's (claiming, recording, committing) or the handler's.
enum Failure<E> {
    Database(Error),
    Handler(E),
    /// The unit waited its share of the visibility timeout for a [`Limit`], or its bucket's
    /// wait is long: to be handed back, not to come back before this.
    Limited(Duration),
}

/// The error a delivery handed back for a [`Limit`] is nacked with.
const LIMITED: &str = "waited too long for a consumer limit";

impl<E> From<Error> for Failure<E> {
    fn from(e: Error) -> Self {
        Failure::Database(e)
    }
}

impl<E: fmt::Display> fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Database(e) => e.fmt(f),
            Failure::Handler(e) => e.fmt(f),
            Failure::Limited(_) => f.write_str(LIMITED),
        }
    }
}

/// The inbox's database cannot take the delivery now, whatever the message: the connection
/// was lost (a restart, a failover, a network cut), no connection could be had, the server
/// only allows reads (a standby), or pgbox's tables there are missing (not migrated yet).
/// The delivery waits, uncounted, instead of using up its deliveries while no handler ran.
fn database_away(e: &Error) -> bool {
    matches!(
        e.db_kind(),
        Some(DbErrorKind::ConnectionLost | DbErrorKind::PoolTimedOut | DbErrorKind::ReadOnly)
    ) || e.needs_migration()
}

/// Counts a unit whose transaction ended and hands its acks to the loop's set.
fn count_all<'a>(
    stats: &mut ConsumerStats,
    handled: Handled<'a>,
    acking: &mut FuturesUnordered<Ack<'a>>,
    metrics: &RunMetrics,
) {
    for one in handled.settled {
        count(stats, one, metrics);
    }
    acking.extend(handled.acks);
}

fn count(stats: &mut ConsumerStats, settled: Settled, metrics: &RunMetrics) {
    match settled {
        Settled::Processed => {
            stats.processed += 1;
            metrics.processed.increment(1);
        }
        Settled::Duplicate => {
            stats.duplicates += 1;
            metrics.duplicates.increment(1);
        }
        Settled::Rejected => {
            stats.rejected += 1;
            metrics.rejected.increment(1);
        }
        Settled::Retried => {
            stats.retried += 1;
            metrics.retried.increment(1);
        }
        Settled::DeadLettered => {
            stats.dead_lettered += 1;
            metrics.dead_lettered.increment(1);
        }
        Settled::Panicked(dead) => {
            stats.panicked += 1;
            metrics.panics.increment(1);
            if dead {
                stats.dead_lettered += 1;
                metrics.dead_lettered.increment(1);
            } else {
                stats.retried += 1;
                metrics.retried.increment(1);
            }
        }
    }
}

/// A run's metric handles (see [`telemetry`]), registered once when the run starts: counting
/// a message is then an atomic add, with no key built and no registry lookup.
struct RunMetrics {
    processed: Counter,
    duplicates: Counter,
    rejected: Counter,
    in_progress: Counter,
    retried: Counter,
    dead_lettered: Counter,
    handler_errors: Counter,
    panics: Counter,
    batch_rollbacks: Counter,
    /// Per limit, in the consumer's order.
    limit_waits: Vec<Counter>,
    handler_duration: Histogram,
    receive_lag: Histogram,
}

impl RunMetrics {
    fn new(consumer: &str, topic: &str, limits: &limits::Limits) -> Self {
        let labels = [
            ("consumer", consumer.to_owned()),
            ("topic", topic.to_owned()),
        ];
        RunMetrics {
            processed: metrics::counter!(telemetry::CONSUMER_PROCESSED, &labels),
            duplicates: metrics::counter!(telemetry::CONSUMER_DUPLICATES, &labels),
            rejected: metrics::counter!(telemetry::CONSUMER_REJECTED, &labels),
            in_progress: metrics::counter!(telemetry::CONSUMER_IN_PROGRESS, &labels),
            retried: metrics::counter!(telemetry::CONSUMER_RETRIED, &labels),
            dead_lettered: metrics::counter!(telemetry::CONSUMER_DEAD_LETTERED, &labels),
            handler_errors: metrics::counter!(telemetry::CONSUMER_HANDLER_ERRORS, &labels),
            panics: metrics::counter!(telemetry::CONSUMER_HANDLER_PANICS, &labels),
            batch_rollbacks: metrics::counter!(telemetry::CONSUMER_BATCH_ROLLBACKS, &labels),
            limit_waits: limits
                .names()
                .map(|name| {
                    let labels = [
                        ("consumer", consumer.to_owned()),
                        ("topic", topic.to_owned()),
                        ("limit", name.to_owned()),
                    ];
                    metrics::counter!(telemetry::CONSUMER_LIMIT_WAITS, &labels)
                })
                .collect(),
            handler_duration: metrics::histogram!(telemetry::CONSUMER_HANDLER_DURATION, &labels),
            receive_lag: metrics::histogram!(telemetry::CONSUMER_RECEIVE_LAG, &labels),
        }
    }

    /// The end-to-end lag, on first deliveries only: a redelivery's lag is mostly its
    /// backoff or visibility timeout.
    fn received(&self, envelope: &Envelope, attempt: i32) {
        if attempt <= 1 {
            self.receive_lag
                .record(telemetry::seconds_since(envelope.created_at));
        }
    }

    /// Records the handler's duration when dropped: after it returns, fails or panics.
    fn time_handler(&self) -> HandlerTimer<'_> {
        HandlerTimer(&self.handler_duration, Instant::now())
    }
}

struct HandlerTimer<'a>(&'a Histogram, Instant);

impl Drop for HandlerTimer<'_> {
    fn drop(&mut self) {
        self.0.record(self.1.elapsed());
    }
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// How many of `concurrency` slots must be free before a handler finishing wakes a receive:
/// a quarter, at least one.
fn refill_threshold(concurrency: usize) -> usize {
    concurrency.div_ceil(4).max(1)
}

/// The wait before the next receive: the poll interval, doubled per consecutive failure up
/// to 30 s (never below the poll interval), with jitter once failing.
fn receive_backoff(poll_interval: Duration, failures: u32) -> Duration {
    if failures == 0 {
        return poll_interval;
    }
    let cap = Duration::from_secs(30).max(poll_interval);
    poll_interval
        .saturating_mul(1 << failures.min(8))
        .min(cap)
        .mul_f64(0.75 + fastrand::f64() / 4.0)
        .max(poll_interval)
}

/// When to try LISTEN again after it failed: exponential backoff from 100 ms to 30 s, with
/// jitter; a warning on the first failure and on recovery, debug lines in between.
#[derive(Debug, Default)]
struct Relisten {
    failures: u32,
    not_before: Option<tokio::time::Instant>,
}

impl Relisten {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(30);
    /// A connect that hangs (a server that accepts TCP but does not answer) must not hold up
    /// the receive loop and the handlers it drives.
    const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

    fn due(&self) -> bool {
        self.not_before
            .is_none_or(|at| tokio::time::Instant::now() >= at)
    }

    async fn attempt(
        &mut self,
        pool: &sqlx::PgPool,
        channel: &str,
    ) -> Option<sqlx::postgres::PgListener> {
        let made =
            tokio::time::timeout(Self::CONNECT_TIMEOUT, crate::listen::listen(pool, channel))
                .await
                .unwrap_or_else(|_| {
                    Err(Error::Database {
                        kind: crate::DbErrorKind::ConnectionLost,
                        source: sqlx::Error::PoolTimedOut,
                    })
                });
        match made {
            Ok(listener) => {
                if self.failures > 0 {
                    tracing::info!(
                        failures = self.failures,
                        "pgbox consumer listening again; wake-ups are immediate"
                    );
                }
                *self = Relisten::default();
                Some(listener)
            }
            Err(e) => {
                self.failures += 1;
                let exp = Self::FIRST.saturating_mul(1 << self.failures.min(9));
                let delay = exp.min(Self::MAX).mul_f64(0.5 + fastrand::f64() / 2.0);
                self.not_before = Some(tokio::time::Instant::now() + delay);
                if self.failures == 1 {
                    tracing::warn!(error = %e, ?delay, "pgbox consumer cannot LISTEN; polling, and trying again with backoff");
                } else {
                    tracing::debug!(error = %e, failures = self.failures, ?delay, "pgbox consumer still cannot LISTEN");
                }
                None
            }
        }
    }
}

/// The span of one message's handling (`mode`: "transaction", "batch" or "lease"), joined
/// to the producer's trace when OpenTelemetry is on. Made before it is entered: its parent
/// is fixed then.
fn handle_span(envelope: &Envelope, attempt: i32, mode: &'static str) -> tracing::Span {
    let span = tracing::info_span!(
        "pgbox.consumer.handle",
        topic = %envelope.topic,
        message_id = %envelope.id,
        delivery = attempt,
        mode,
        traceparent = envelope.headers.get(TRACEPARENT).map(String::as_str),
    );
    #[cfg(feature = "opentelemetry")]
    crate::otel::join_producer_trace(&span, &envelope.headers);
    span
}

#[cfg(test)]
mod away_tally_tests {
    use super::{AwayTally, Track};

    #[test]
    fn counts_each_copy_own_deliveries_and_forgets() {
        let id = uuid::Uuid::now_v7();
        let mut tally = AwayTally::default();
        // Two copies away at deliveries 1 to 3, interleaved.
        for n in 1..=3 {
            assert_eq!(tally.settle(id, n, true, false).0, 0);
            assert_eq!(tally.settle(id, n, true, false).0, 0);
        }
        // Copy one fails at 4 while copy two is still away; then both fail.
        assert_eq!(tally.settle(id, 4, false, false).0, 1);
        assert_eq!(tally.settle(id, 4, true, false).0, 0);
        assert_eq!(tally.settle(id, 5, false, false).0, 2);
        assert_eq!(tally.settle(id, 5, false, false).0, 1);
        tally.end(&id, 5);
        assert_eq!(
            tally.0[&id].0,
            vec![Track {
                last: 5,
                away: 4,
                recorded: 0
            }]
        );
        // A delivery this runner did not see (a crash): the nearest track below.
        assert_eq!(tally.settle(id, 7, false, false).0, 3);
        tally.forget(&id);
        assert_eq!(tally.settle(id, 9, false, false).0, 9);
        tally.forget(&id);
        for _ in 0..AwayTally::COPIES {
            tally.settle(id, 1, true, false);
        }
        assert_eq!(
            tally.settle(id, 1, true, false).0,
            1,
            "more copies than tracked"
        );
        assert_eq!(tally.0[&id].0.len(), AwayTally::COPIES);
        // Hand-backs recorded in the database are told apart from the others.
        let other = uuid::Uuid::now_v7();
        assert_eq!(tally.settle(other, 1, true, true), (0, 1));
        assert_eq!(tally.settle(other, 2, true, false), (0, 1));
        assert_eq!(tally.settle(other, 3, true, true), (0, 2));
        assert_eq!(tally.settle(other, 4, false, false), (1, 2));
    }
}
