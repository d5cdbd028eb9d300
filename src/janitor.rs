//! The janitor: retention and cleanup in small, bounded transactions, by one instance at a
//! time.
//!
//! Every service instance may run a [`Janitor`]; exactly one of them works at any moment: the
//! holder of a **session** advisory lock, keyed by schema, held on a connection of its own
//! (never a pool connection). The others try again every [interval](JanitorBuilder::interval).
//! Each unit of work is one short transaction **on that same connection**: a batch of at most
//! [`batch_size`](JanitorBuilder::batch_size) rows, found through an index, deleted by row
//! address or primary key. Because the lock and the work share one session, a unit can only
//! commit while its session still holds the lock: when the holder's connection is lost (its
//! backend terminated, its process killed), the server rolls back the unit in flight and
//! releases the lock together, and another instance takes over at its next try. The instance
//! that lost it notices before its next unit (each unit first checks, inside its transaction,
//! that its session holds the lock) and takes the lock again before doing any more work.
//!
//! What a pass does, in order:
//! - **inbox retention**, per consumer: rows older than the consumer's retention
//!   ([`consumer_retention`](JanitorBuilder::consumer_retention), else
//!   [`inbox_retention`](JanitorBuilder::inbox_retention)), with the rules of
//!   [`Inbox::purge_older_than`](crate::Inbox::purge_older_than) for lease-mode rows;
//! - **published outbox rows** of audit mode ([`Relay`](crate::Relay)'s `keep_published`),
//!   only when [`published_retention`](JanitorBuilder::published_retention) is set;
//! - **old dead letters** of the outbox and of the built-in queue, only when
//!   [`outbox_dead_letter_retention`](JanitorBuilder::outbox_dead_letter_retention) or
//!   [`queue_dead_letter_retention`](JanitorBuilder::queue_dead_letter_retention) is set:
//!   deleting a dead letter releases its ordering key, exactly as discarding it does;
//! - **consumer hand-backs** (the `hand_backs` table the runner counts deliveries it handed
//!   back in, see [`ConsumerBuilder::max_deliveries`](crate::ConsumerBuilder::max_deliveries))
//!   of messages not handed back for a week;
//! - the **time-partitioned inbox**, if the schema uses it: partitions created ahead, and
//!   partitions older than the longest inbox retention of any consumer detached and dropped
//!   ([`InboxPartitions`](crate::InboxPartitions));
//! - the metrics gauges ([`telemetry::refresh_gauges`](crate::telemetry::refresh_gauges)),
//!   on every instance, holder or not, so that no instance exports stale values.
//!
//! A pass runs at most [`max_batches_per_pass`](JanitorBuilder::max_batches_per_pass) units
//! per task (per consumer, per table) and yields between units; when a task had more, the
//! next pass starts at once instead of after the interval.
//!
//! Takeover is as fast as the server notices that the holder is gone: at once for a killed
//! process (its socket closes), after TCP keepalive for a host that vanished from the
//! network. Set the server's `tcp_keepalives_*` (and, from PostgreSQL 14,
//! `client_connection_check_interval`) if that matters to you.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::error::{DbErrorKind, Error, Result};
use crate::ident::DEFAULT_SCHEMA;
use crate::ident::Identifier;
use crate::inbox::Inbox;
use crate::pooler::Pooler;

/// Advisory-lock class of the janitor lock (two-key form: `pg_advisory_lock(LOCK_CLASS,
/// key)`, with a key derived from the schema name). The two-key form never collides with the
/// migrator's single-key lock, nor with an application's single-key locks. The holder shows
/// in `pg_locks` (`locktype = 'advisory' AND classid = 1885499242 AND objsubid = 2`), and its
/// connection's `application_name` starts with `pgbox-janitor`.
pub const LOCK_CLASS: i32 = 0x7062_6f6a; // "pboj"

/// Default pause between passes, and between attempts to take the lock: 60 s.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

/// Default rows per unit of work (one transaction): 1000.
pub const DEFAULT_BATCH_SIZE: usize = 1_000;

/// Default units per task (one consumer's inbox, one table) in one pass: 100.
pub const DEFAULT_MAX_BATCHES_PER_PASS: u32 = 100;

/// Default inbox retention for every consumer: 7 days.
pub const DEFAULT_INBOX_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Default floor below which an inbox retention is refused: 1 day (as `pgbox purge
/// --min-retention`).
pub const DEFAULT_MIN_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Default `statement_timeout` of each unit of work: 30 s.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The most rows a unit may delete ([`JanitorBuilder::batch_size`]).
pub const MAX_BATCH_SIZE: usize = 10_000;

/// How long rows of one kind are kept.
///
/// A [`Duration`] converts into [`Retention::After`], so setters accept either:
/// `.inbox_retention(Duration::from_secs(86_400))` or `.inbox_retention(Retention::Forever)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Never deleted by the janitor.
    Forever,
    /// Deleted once older than this (by the database clock).
    After(Duration),
}

impl From<Duration> for Retention {
    fn from(age: Duration) -> Self {
        Retention::After(age)
    }
}

/// Builder for a [`Janitor`]; see [`Janitor::builder`] for the defaults.
#[derive(Debug, Clone)]
pub struct JanitorBuilder {
    pool: PgPool,
    schema: String,
    instance: String,
    interval: Duration,
    batch_size: usize,
    max_batches_per_pass: u32,
    batch_pause: Duration,
    statement_timeout: Duration,
    min_retention: Duration,
    inbox_retention: Retention,
    consumer_retention: BTreeMap<String, Retention>,
    published_retention: Retention,
    outbox_dead_letter_retention: Retention,
    queue_dead_letter_retention: Retention,
    refresh_gauges: bool,
    pooler: Pooler,
}

impl JanitorBuilder {
    /// What stands between the janitor's pool and PostgreSQL (default [`Pooler::None`]). The
    /// janitor elects one instance per schema with a session advisory lock, which a pooler in
    /// transaction mode would hand to other clients: with [`Pooler::Transaction`],
    /// [`build`](Self::build) refuses with [`Error::SessionRequired`]. Give the janitor a pool
    /// of direct connections (it needs one connection, and a second while it works).
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// The pgbox schema (default `pgbox`). Janitors of different schemas never wait for each
    /// other.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// A name for this instance in logs and in the lock connection's `application_name`
    /// (default `pid-<process id>`; a pod or host name is more useful).
    pub fn instance_name(mut self, name: impl Into<String>) -> Self {
        self.instance = name.into();
        self
    }

    /// Pause between passes, and how often an instance that does not hold the lock tries to
    /// take it (default 60 s).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Rows deleted per unit of work, each unit its own transaction (default 1000, at most
    /// [`MAX_BATCH_SIZE`]).
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows;
        self
    }

    /// Units per task in one pass (default 100). A task with more to do continues in the next
    /// pass, which then starts without waiting for the interval.
    pub fn max_batches_per_pass(mut self, batches: u32) -> Self {
        self.max_batches_per_pass = batches;
        self
    }

    /// A pause after every unit, to throttle the janitor's write and WAL rate (default none:
    /// it only yields to the runtime).
    pub fn batch_pause(mut self, pause: Duration) -> Self {
        self.batch_pause = pause;
        self
    }

    /// `statement_timeout` of each unit (default 30 s). A unit that exceeds it rolls back and
    /// the pass fails; the next pass tries again.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// The shortest inbox retention [`build`](Self::build) accepts (default 1 day). A key
    /// purged before its last redelivery (broker retries, dead-letter replays, producer
    /// re-sends) is processed again.
    pub fn min_retention(mut self, floor: Duration) -> Self {
        self.min_retention = floor;
        self
    }

    /// Inbox retention of every consumer without an override (default 7 days).
    pub fn inbox_retention(mut self, retention: impl Into<Retention>) -> Self {
        self.inbox_retention = retention.into();
        self
    }

    /// Inbox retention of one consumer, overriding [`inbox_retention`](Self::inbox_retention);
    /// [`Retention::Forever`] keeps its rows.
    pub fn consumer_retention(
        mut self,
        consumer: impl Into<String>,
        retention: impl Into<Retention>,
    ) -> Self {
        self.consumer_retention
            .insert(consumer.into(), retention.into());
        self
    }

    /// How long audit mode's published outbox rows are kept, by `published_at` (default
    /// [`Retention::Forever`]: audit rows are deleted only when you say so). Pending rows are
    /// never touched.
    pub fn published_retention(mut self, retention: impl Into<Retention>) -> Self {
        self.published_retention = retention.into();
        self
    }

    /// How long the outbox's dead letters are kept, by `dead_at` (default
    /// [`Retention::Forever`]). A dead letter holds its ordering key; deleting it releases
    /// the key, as [`DeadLetters::discard`](crate::DeadLetters::discard) does, and the
    /// messages it held back are published.
    pub fn outbox_dead_letter_retention(mut self, retention: impl Into<Retention>) -> Self {
        self.outbox_dead_letter_retention = retention.into();
        self
    }

    /// How long the built-in queue's dead letters are kept, by `dead_at` (default
    /// [`Retention::Forever`]). Deleting one releases its ordering key, as
    /// [`QueueDeadLetters::discard`](crate::transport::QueueDeadLetters::discard) does.
    pub fn queue_dead_letter_retention(mut self, retention: impl Into<Retention>) -> Self {
        self.queue_dead_letter_retention = retention.into();
        self
    }

    /// Sets both [`outbox_dead_letter_retention`](Self::outbox_dead_letter_retention) and
    /// [`queue_dead_letter_retention`](Self::queue_dead_letter_retention).
    pub fn dead_letter_retention(self, retention: impl Into<Retention>) -> Self {
        let retention = retention.into();
        self.outbox_dead_letter_retention(retention)
            .queue_dead_letter_retention(retention)
    }

    /// Whether each pass refreshes the metrics gauges (default true).
    pub fn refresh_gauges(mut self, refresh: bool) -> Self {
        self.refresh_gauges = refresh;
        self
    }

    /// Validates the settings: the schema name, consumer names, sizes, and every inbox
    /// retention against [`min_retention`](Self::min_retention).
    pub fn build(self) -> Result<Janitor> {
        if !self.pooler.keeps_sessions() {
            return Err(Error::SessionRequired {
                component: "janitor",
                reason: "it elects one instance per schema with a session advisory lock, which a \
                         pooler in transaction mode would hand to another client's transaction; \
                         build the janitor on a pool of direct connections"
                    .to_owned(),
            });
        }
        let schema = Identifier::pgbox_schema(&self.schema)?;
        let invalid = |msg: String| Err(Error::InvalidConfig(msg));
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return invalid(format!("janitor batch size must be 1..={MAX_BATCH_SIZE}"));
        }
        if self.max_batches_per_pass == 0 {
            return invalid("janitor max_batches_per_pass must be at least 1".into());
        }
        if self.interval.is_zero() {
            return invalid("janitor interval must be positive".into());
        }
        if self.statement_timeout < Duration::from_millis(1) {
            return invalid("janitor statement timeout must be at least 1 ms".into());
        }
        let inbox_ok = |what: &str, retention: Retention| match retention {
            Retention::After(age) if age.is_zero() || age < self.min_retention => {
                Err(Error::InvalidConfig(format!(
                    "{what} {} is below {} (the retention floor, min_retention): a key \
                     purged before its last redelivery is processed again",
                    duration_words(age),
                    duration_words(self.min_retention)
                )))
            }
            _ => Ok(()),
        };
        inbox_ok("inbox retention", self.inbox_retention)?;
        for (consumer, retention) in &self.consumer_retention {
            Inbox::new(consumer.as_str())?;
            inbox_ok(&format!("inbox retention of {consumer:?}"), *retention)?;
        }
        for (what, retention) in [
            ("published retention", self.published_retention),
            (
                "outbox dead letter retention",
                self.outbox_dead_letter_retention,
            ),
            (
                "queue dead letter retention",
                self.queue_dead_letter_retention,
            ),
        ] {
            if retention == Retention::After(Duration::ZERO) {
                return invalid(format!("janitor {what} must be positive"));
            }
        }
        let connect = (*self.pool.connect_options())
            .clone()
            .application_name(&application_name(&self.instance));
        Ok(Janitor {
            sql: Statements::new(&schema, self.statement_timeout),
            key: lock_key(schema.as_str()),
            schema,
            pool: self.pool,
            connect,
            instance: self.instance,
            interval: self.interval,
            batch_size: self.batch_size as i64,
            max_batches_per_pass: self.max_batches_per_pass,
            batch_pause: self.batch_pause,
            statement_timeout: self.statement_timeout,
            inbox_retention: self.inbox_retention,
            consumer_retention: self.consumer_retention,
            published_retention: self.published_retention,
            outbox_dead_letter_retention: self.outbox_dead_letter_retention,
            queue_dead_letter_retention: self.queue_dead_letter_retention,
            refresh_gauges: self.refresh_gauges,
            session: Mutex::new(None),
            expiry_warned: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// Retention and cleanup for one pgbox schema, safe to run on every instance: one works at a
/// time (see the [module documentation](self)).
///
/// ```no_run
/// use std::time::Duration;
/// use pgbox::janitor::{Janitor, Retention};
///
/// # async fn f(pool: sqlx::PgPool, shutdown: pgbox::CancellationToken) -> pgbox::Result<()> {
/// let janitor = Janitor::builder(pool)
///     .instance_name("billing-7f9c")
///     .inbox_retention(Duration::from_secs(14 * 86_400))
///     .consumer_retention("audit-log", Retention::Forever)
///     .published_retention(Duration::from_secs(30 * 86_400))
///     .build()?;
/// janitor.run(shutdown).await?;
/// # Ok(()) }
/// ```
///
/// Dropping a janitor closes its lock connection, which releases the lock;
/// [`release`](Self::release) does it at once and cleanly.
pub struct Janitor {
    pool: PgPool,
    connect: PgConnectOptions,
    schema: Identifier,
    instance: String,
    key: i32,
    interval: Duration,
    batch_size: i64,
    max_batches_per_pass: u32,
    batch_pause: Duration,
    statement_timeout: Duration,
    inbox_retention: Retention,
    consumer_retention: BTreeMap<String, Retention>,
    published_retention: Retention,
    outbox_dead_letter_retention: Retention,
    queue_dead_letter_retention: Retention,
    refresh_gauges: bool,
    sql: Statements,
    session: Mutex<Option<Session>>,
    /// The warning that this role cannot expire partitions was logged.
    expiry_warned: std::sync::atomic::AtomicBool,
}

/// Everything but the lock connection's options, which hold the database password (sqlx's
/// `PgConnectOptions` shows it in its own `Debug`): the server is named without it.
impl std::fmt::Debug for Janitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Janitor")
            .field("pool", &self.pool)
            .field(
                "server",
                &format_args!(
                    "{}@{}:{}/{}",
                    self.connect.get_username(),
                    self.connect.get_host(),
                    self.connect.get_port(),
                    self.connect.get_database().unwrap_or_default()
                ),
            )
            .field("schema", &self.schema)
            .field("instance", &self.instance)
            .field("key", &self.key)
            .field("interval", &self.interval)
            .field("batch_size", &self.batch_size)
            .field("max_batches_per_pass", &self.max_batches_per_pass)
            .field("batch_pause", &self.batch_pause)
            .field("statement_timeout", &self.statement_timeout)
            .field("inbox_retention", &self.inbox_retention)
            .field("consumer_retention", &self.consumer_retention)
            .field("published_retention", &self.published_retention)
            .field(
                "outbox_dead_letter_retention",
                &self.outbox_dead_letter_retention,
            )
            .field(
                "queue_dead_letter_retention",
                &self.queue_dead_letter_retention,
            )
            .field("refresh_gauges", &self.refresh_gauges)
            .field("sql", &self.sql)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

/// Whether this instance holds the janitor lock, as a pass found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LockStatus {
    /// Another instance holds the lock: this pass did no work.
    #[default]
    NotHeld,
    /// This pass took the lock (first pass, or after the lock was lost or released).
    Acquired,
    /// This instance already held the lock, and its connection is still alive.
    Held,
}

impl LockStatus {
    /// Whether this instance held the lock for the pass.
    pub fn is_held(self) -> bool {
        self != LockStatus::NotHeld
    }
}

/// What one pass ([`Janitor::run_once`]) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PassReport {
    /// Whether this instance held the lock (and so could work).
    pub lock: LockStatus,
    /// The lock connection was found lost (at the start of the pass, or under a unit): the
    /// pass stopped working at that point. The lost unit rolled back; the lock is taken again
    /// before any more work.
    pub lost_lock: bool,
    /// Inbox rows deleted, per consumer (consumers with nothing deleted are absent).
    pub inbox_deleted: BTreeMap<String, u64>,
    /// Published outbox rows (audit mode) deleted.
    pub published_deleted: u64,
    /// Outbox dead letters deleted.
    pub outbox_dead_letters_deleted: u64,
    /// Queue dead letters deleted.
    pub queue_dead_letters_deleted: u64,
    /// Consumer hand-back rows deleted (messages not handed back for a week).
    pub hand_backs_deleted: u64,
    /// Units of work committed.
    pub batches: u64,
    /// Some task reached [`max_batches_per_pass`](JanitorBuilder::max_batches_per_pass)
    /// with a full last batch: there is probably more to delete.
    pub more: bool,
    /// The gauges were refreshed.
    pub gauges_refreshed: bool,
    /// Partitions of the time-partitioned inbox created ahead (schemas switched with
    /// [`Migrator::partitioned_inbox`](crate::Migrator::partitioned_inbox) only).
    pub partitions_created: Vec<String>,
    /// Partitions of the time-partitioned inbox detached and dropped.
    pub partitions_dropped: Vec<String>,
    /// Expiry of the time-partitioned inbox was skipped: the janitor's role does not own
    /// `partitioned_inbox` (an application role; see
    /// [`InboxPartitions::drop_expired`](crate::InboxPartitions::drop_expired)). Partitions
    /// are still created ahead. Run the expiry as the owner (`pgbox partitions drop`).
    pub partitions_expiry_needs_owner: bool,
    /// Partitions of the archive of delivered messages created ahead (once a relay archived
    /// with settings; see [`Archive`](crate::Archive)).
    pub archive_partitions_created: Vec<String>,
    /// Partitions of the archive dropped: every row older than its recorded retention.
    pub archive_partitions_dropped: Vec<String>,
}

impl PassReport {
    /// Rows deleted in all, of every kind.
    pub fn deleted(&self) -> u64 {
        self.inbox_deleted.values().sum::<u64>()
            + self.published_deleted
            + self.outbox_dead_letters_deleted
            + self.queue_dead_letters_deleted
            + self.hand_backs_deleted
    }
}

/// The dedicated connection that holds (or tries to take) the lock.
#[derive(Debug)]
struct Session {
    conn: PgConnection,
    held: bool,
    backend_pid: i32,
    /// Set while a statement is in flight: if the future running it is dropped (a cancelled
    /// `run`, a dropped `run_once`), the connection's state is unknown and it is discarded,
    /// which ends the server session, rolls back the unit and releases the lock.
    busy: bool,
}

/// One unit's worth of a task.
#[derive(Debug)]
enum Task<'a> {
    Inbox { consumer: &'a str, age: Duration },
    Published { age: Duration },
    OutboxDeadLetters { age: Duration },
    QueueDeadLetters { age: Duration },
    HandBacks { age: Duration },
}

impl Task<'_> {
    fn name(&self) -> &'static str {
        match self {
            Task::Inbox { .. } => "inbox",
            Task::Published { .. } => "published",
            Task::OutboxDeadLetters { .. } => "outbox_dead_letters",
            Task::QueueDeadLetters { .. } => "queue_dead_letters",
            Task::HandBacks { .. } => "hand_backs",
        }
    }
}

/// How a unit (or any statement on the lock connection) ended.
enum Step<T> {
    Done(T),
    /// The lock connection is gone or no longer holds the lock; it was discarded.
    Lost,
    Failed(Error),
}

/// The lock is this session's: checked inside each unit's transaction, before its delete.
const LOCK_HELD: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks \
     WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid() AND granted \
       AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 2)";

#[derive(Debug)]
struct Statements {
    /// Opens a unit: its own statement timeout, and plans pinned to the index walks (with
    /// stale statistics, the planner may prefer reading the whole table and sorting it).
    begin: String,
    consumers: String,
    inbox: String,
    published: String,
    outbox_dead_letters: String,
    queue_dead_letters: String,
    hand_backs: String,
}

impl Statements {
    fn new(s: &Identifier, statement_timeout: Duration) -> Self {
        let dead_letters = |table: &str| {
            format!(
                "DELETE FROM {s}.{table} WHERE seq = ANY(ARRAY(\
                   SELECT seq FROM {s}.{table} \
                   WHERE dead_at < pg_catalog.now() - pg_catalog.make_interval(secs => $1) \
                   ORDER BY dead_at LIMIT $2 FOR UPDATE SKIP LOCKED)) \
                 RETURNING message_id"
            )
        };
        Statements {
            begin: format!(
                "BEGIN; SET LOCAL statement_timeout = '{}ms'; SET LOCAL enable_seqscan = off; \
                 SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL jit = off",
                statement_timeout.as_millis().max(1)
            ),
            // A loose index scan over the primary key: one probe per consumer, however many
            // rows each has (as `inbox_status` does).
            consumers: format!(
                "WITH RECURSIVE c(consumer) AS (\
                   (SELECT consumer FROM {s}.inbox ORDER BY consumer LIMIT 1) \
                   UNION ALL \
                   SELECT (SELECT consumer FROM {s}.inbox WHERE consumer > c.consumer ORDER BY consumer LIMIT 1) \
                   FROM c WHERE c.consumer IS NOT NULL) \
                 SELECT consumer FROM c WHERE consumer IS NOT NULL"
            ),
            // The statement of `Inbox::purge_older_than`, one batch: a live lease is never
            // deleted, an expired one only by the time it was leased or taken over.
            inbox: crate::inbox::purge_batch_sql(s),
            // Walks outbox_published_idx (V8); pending rows (published_at NULL) are not in
            // it and never match.
            published: format!(
                "DELETE FROM {s}.outbox WHERE seq = ANY(ARRAY(\
                   SELECT seq FROM {s}.outbox \
                   WHERE published_at IS NOT NULL \
                     AND published_at < pg_catalog.now() - pg_catalog.make_interval(secs => $1) \
                   ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED))"
            ),
            // Deleting the row is what releases its ordering key (as `discard` does); a
            // concurrent replay or discard of the same row waits for the unit, then finds
            // it gone.
            outbox_dead_letters: dead_letters("outbox_dead_letters"),
            queue_dead_letters: dead_letters("queue_dead_letters"),
            // Walks hand_backs_at_idx (V20).
            hand_backs: crate::consumer::hand_backs::purge_batch_sql(s),
        }
    }
}

impl Janitor {
    /// A janitor over `pool`, with defaults: schema `pgbox`, a pass every
    /// [60 s](DEFAULT_INTERVAL), [1000](DEFAULT_BATCH_SIZE) rows per unit,
    /// [100](DEFAULT_MAX_BATCHES_PER_PASS) units per task per pass, inbox retention
    /// [7 days](DEFAULT_INBOX_RETENTION) with a floor of [1 day](DEFAULT_MIN_RETENTION),
    /// published rows and dead letters kept forever, gauges refreshed.
    ///
    /// The pool's connect options also open the janitor's own lock connection, which is not
    /// taken from the pool.
    pub fn builder(pool: PgPool) -> JanitorBuilder {
        JanitorBuilder {
            pool,
            schema: DEFAULT_SCHEMA.into(),
            instance: format!("pid-{}", std::process::id()),
            interval: DEFAULT_INTERVAL,
            batch_size: DEFAULT_BATCH_SIZE,
            max_batches_per_pass: DEFAULT_MAX_BATCHES_PER_PASS,
            batch_pause: Duration::ZERO,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            min_retention: DEFAULT_MIN_RETENTION,
            inbox_retention: Retention::After(DEFAULT_INBOX_RETENTION),
            consumer_retention: BTreeMap::new(),
            published_retention: Retention::Forever,
            outbox_dead_letter_retention: Retention::Forever,
            queue_dead_letter_retention: Retention::Forever,
            refresh_gauges: true,
            pooler: Pooler::None,
        }
    }

    /// The schema this janitor cleans.
    pub fn schema_name(&self) -> &str {
        self.schema.as_str()
    }

    /// Runs passes until `shutdown` is cancelled: one pass, then the interval (no wait when
    /// the pass left more to do). An instance that does not hold the lock tries again every
    /// interval. Errors are logged and the pass retried after the interval; the janitor never
    /// gives up on its own.
    ///
    /// Shutdown is prompt: a unit in flight is abandoned (its transaction rolls back with the
    /// connection), then the lock is released.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        tracing::info!(schema = self.schema.as_str(), instance = %self.instance, "pgbox janitor started");
        loop {
            let pass = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                pass = self.run_once() => pass,
            };
            let wait = match pass {
                Ok(report) if report.more && report.lock.is_held() && !report.lost_lock => {
                    Duration::ZERO
                }
                Ok(_) => self.interval,
                Err(e) => {
                    tracing::warn!(
                        schema = self.schema.as_str(),
                        error = %e,
                        retryable = e.is_retryable(),
                        "pgbox janitor pass failed; will retry"
                    );
                    self.interval
                }
            };
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        if let Err(e) = self.release().await {
            tracing::debug!(error = %e, "pgbox janitor: lock connection closed uncleanly");
        }
        tracing::info!(schema = self.schema.as_str(), instance = %self.instance, "pgbox janitor stopped");
        Ok(())
    }

    /// One pass: checks or takes the lock; if this instance holds it, runs the units; then
    /// refreshes the gauges (whether or not it holds the lock).
    ///
    /// Returns an error when the pass could not start (no connection) or a unit failed for
    /// another reason than a lost lock (a statement timeout, a missing schema); the units
    /// committed before it stay committed. A lost lock is not an error: the report says
    /// [`lost_lock`](PassReport::lost_lock).
    ///
    /// Cancel-safe: if this future is dropped mid-unit, the next call discards the lock
    /// connection (the server rolls the unit back and releases the lock) and starts over.
    pub async fn run_once(&self) -> Result<PassReport> {
        let span = tracing::info_span!(
            "pgbox.janitor.pass",
            schema = self.schema.as_str(),
            instance = %self.instance
        );
        async {
            if crate::pooler::shares_sessions(&self.pool).await? == Some(true) {
                return Err(Error::SessionRequired {
                    component: "janitor",
                    reason: "it elects one instance per schema with a session advisory lock, and \
                             this pool's connections go through a pooler in transaction mode, \
                             which would hand that lock to other clients' transactions; build \
                             the janitor on a pool of direct connections"
                        .to_owned(),
                });
            }
            let mut report = PassReport::default();
            let worked = self.work(&mut report).await;
            if self.refresh_gauges {
                match crate::telemetry::refresh_gauges(&self.pool, self.schema.as_str()).await {
                    Ok(()) => report.gauges_refreshed = true,
                    Err(e) => {
                        tracing::warn!(error = %e, "pgbox janitor could not refresh the gauges")
                    }
                }
            }
            worked?;
            if report.deleted() > 0 {
                tracing::info!(
                    deleted = report.deleted(),
                    inbox = report.inbox_deleted.values().sum::<u64>(),
                    published = report.published_deleted,
                    outbox_dead_letters = report.outbox_dead_letters_deleted,
                    queue_dead_letters = report.queue_dead_letters_deleted,
                    batches = report.batches,
                    more = report.more,
                    "pgbox janitor pass"
                );
            } else {
                tracing::debug!(lock = ?report.lock, lost_lock = report.lost_lock, "pgbox janitor pass: nothing deleted");
            }
            Ok(report)
        }
        .instrument(span)
        .await
    }

    /// Releases the lock, if this instance holds it, and closes the lock connection. Another
    /// instance takes over at its next try; a later pass of this one takes the lock again if
    /// it is free. [`run`](Self::run) calls this when it stops.
    pub async fn release(&self) -> Result<()> {
        let mut slot = self.session.lock().await;
        let Some(mut session) = slot.take() else {
            return Ok(());
        };
        if session.busy {
            // Unknown state: dropping the connection ends the session on the server.
            return Ok(());
        }
        if session.held {
            // Logged before the unlock: no other instance can work before this line.
            tracing::info!(
                schema = self.schema.as_str(),
                instance = %self.instance,
                backend_pid = session.backend_pid,
                "pgbox janitor releasing the lock"
            );
            sqlx::query("SELECT pg_catalog.pg_advisory_unlock($1, $2)")
                .bind(LOCK_CLASS)
                .bind(self.key)
                .execute(&mut session.conn)
                .await?;
        }
        session.conn.close().await?;
        Ok(())
    }

    /// The pass's work, under the session mutex.
    async fn work(&self, report: &mut PassReport) -> Result<()> {
        let mut slot = self.session.lock().await;
        report.lock = self.ensure_lock(&mut slot, report).await?;
        if !report.lock.is_held() {
            return Ok(());
        }

        let Some(session) = slot.as_mut() else {
            return Ok(());
        };
        session.busy = true;
        let listed = tokio::time::timeout(
            self.op_bound(),
            sqlx::query_scalar(AssertSqlSafe(self.sql.consumers.clone()))
                .fetch_all(&mut session.conn),
        )
        .await;
        session.busy = false;
        let consumers: Vec<String> = match self.settle(&mut slot, flatten(listed)).await {
            Step::Done(c) => c,
            Step::Lost => {
                report.lost_lock = true;
                return Ok(());
            }
            Step::Failed(e) => return Err(e),
        };

        let mut tasks = Vec::new();
        for consumer in &consumers {
            let retention = self
                .consumer_retention
                .get(consumer)
                .copied()
                .unwrap_or(self.inbox_retention);
            if let Retention::After(age) = retention {
                tasks.push(Task::Inbox { consumer, age });
            }
        }
        if let Retention::After(age) = self.published_retention {
            tasks.push(Task::Published { age });
        }
        if let Retention::After(age) = self.outbox_dead_letter_retention {
            tasks.push(Task::OutboxDeadLetters { age });
        }
        if let Retention::After(age) = self.queue_dead_letter_retention {
            tasks.push(Task::QueueDeadLetters { age });
        }
        tasks.push(Task::HandBacks {
            age: crate::consumer::hand_backs::RETENTION,
        });

        for task in &tasks {
            for batch in 1..=self.max_batches_per_pass {
                let deleted = match self.unit(&mut slot, task).await {
                    Step::Done(n) => n,
                    Step::Lost => {
                        report.lost_lock = true;
                        return Ok(());
                    }
                    Step::Failed(e) => return Err(e),
                };
                report.batches += 1;
                match task {
                    Task::Inbox { consumer, .. } if deleted > 0 => {
                        *report
                            .inbox_deleted
                            .entry((*consumer).to_owned())
                            .or_default() += deleted
                    }
                    Task::Inbox { .. } => {}
                    Task::Published { .. } => report.published_deleted += deleted,
                    Task::OutboxDeadLetters { .. } => report.outbox_dead_letters_deleted += deleted,
                    Task::QueueDeadLetters { .. } => report.queue_dead_letters_deleted += deleted,
                    Task::HandBacks { .. } => report.hand_backs_deleted += deleted,
                }
                let full = deleted >= self.batch_size as u64;
                if full && batch == self.max_batches_per_pass {
                    report.more = true;
                }
                // Between units: let the rest of the process (and, with a pause, the
                // server's replicas and vacuum) breathe.
                if self.batch_pause.is_zero() || deleted == 0 {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(self.batch_pause).await;
                }
                if !full {
                    break;
                }
            }
        }
        self.maintain_partitions(report).await?;
        self.maintain_archive(report).await
    }

    /// The archive of delivered messages, once a relay recorded its retention: partitions
    /// created ahead (the default partition's rows moved out), expired ones dropped. Both go
    /// through `SECURITY DEFINER` functions, so the application role may run them.
    async fn maintain_archive(&self, report: &mut PassReport) -> Result<()> {
        let archive = crate::Archive::new(self.pool.clone()).with_schema(self.schema.as_str())?;
        match archive.settings().await {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(()),
            Err(e) if e.db_kind() == Some(DbErrorKind::MissingSchema) => return Ok(()),
            Err(e) => return Err(e),
        }
        report.archive_partitions_created = archive.create_ahead().await?;
        report.archive_partitions_dropped = archive.drop_expired().await?;
        Ok(())
    }

    /// The partitioned inbox, if the schema uses it: partitions created ahead, and expired
    /// ones detached and dropped. Retention is the longest configured for any consumer
    /// (partitions hold every consumer's keys); none is dropped if any consumer keeps its
    /// keys forever. Runs on the pool: a concurrent detach cannot run in a transaction, and
    /// the database functions are safe to call from several sessions at once.
    async fn maintain_partitions(&self, report: &mut PassReport) -> Result<()> {
        let partitions =
            crate::inbox::InboxPartitions::new(self.pool.clone()).schema(self.schema.as_str())?;
        match partitions.settings().await {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(()),
            Err(e) if e.db_kind() == Some(DbErrorKind::MissingSchema) => return Ok(()),
            Err(e) => return Err(e),
        }
        report.partitions_created = partitions.create_ahead().await?;
        if let Some(retention) = self.partition_retention() {
            if !partitions.can_drop().await? {
                report.partitions_expiry_needs_owner = true;
                if !self
                    .expiry_warned
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        schema = self.schema.as_str(),
                        "pgbox janitor: this role does not own partitioned_inbox, so it creates \
                         partitions ahead but drops none; run `pgbox partitions drop` as the \
                         role that ran the migrations"
                    );
                }
                return Ok(());
            }
            report.partitions_dropped = partitions
                .drop_expired(retention)
                .await?
                .into_iter()
                .map(|p| p.name)
                .collect();
        }
        Ok(())
    }

    /// The retention of the partitioned inbox: the longest of every consumer's.
    fn partition_retention(&self) -> Option<Duration> {
        let mut longest = match self.inbox_retention {
            Retention::Forever => return None,
            Retention::After(age) => age,
        };
        for retention in self.consumer_retention.values() {
            match retention {
                Retention::Forever => return None,
                Retention::After(age) => longest = longest.max(*age),
            }
        }
        Some(longest)
    }

    /// Makes sure this instance holds the lock, if it can: checks a held lock's connection,
    /// re-acquiring after a loss, or tries to take a free one.
    async fn ensure_lock(
        &self,
        slot: &mut Option<Session>,
        report: &mut PassReport,
    ) -> Result<LockStatus> {
        if slot.as_ref().is_some_and(|s| s.busy) {
            // A previous pass was dropped mid-statement.
            let session = slot.take().expect("checked");
            if session.held {
                report.lost_lock = true;
                self.lost(&session, "a pass was cancelled mid-unit");
            }
        }
        if let Some(session) = slot.as_mut().filter(|s| s.held) {
            session.busy = true;
            let checked =
                tokio::time::timeout(self.op_bound(), check_held(&mut session.conn, self.key))
                    .await;
            session.busy = false;
            match self.settle(slot, flatten(checked)).await {
                Step::Done(true) => return Ok(LockStatus::Held),
                Step::Done(false) => {
                    // Alive but not holding it: nothing in pgbox unlocks it, so start over.
                    let session = slot.take().expect("present after a statement");
                    self.lost(&session, "the lock is no longer held by its connection");
                    report.lost_lock = true;
                }
                Step::Lost => report.lost_lock = true,
                Step::Failed(e) => return Err(e),
            }
        }
        // A waiting instance keeps its connection between tries; if that connection died
        // meanwhile (a restart, an idle timeout), try once more on a fresh one.
        let mut fresh = false;
        loop {
            if slot.is_none() {
                *slot = Some(self.connect().await?);
                fresh = true;
            }
            let session = slot.as_mut().expect("present");
            session.busy = true;
            let tried = tokio::time::timeout(
                self.op_bound(),
                sqlx::query_scalar("SELECT pg_catalog.pg_try_advisory_lock($1, $2)")
                    .bind(LOCK_CLASS)
                    .bind(self.key)
                    .fetch_one(&mut session.conn),
            )
            .await;
            session.busy = false;
            return match self.settle(slot, flatten(tried)).await {
                Step::Done(true) => {
                    let session = slot.as_mut().expect("present after a statement");
                    session.held = true;
                    tracing::info!(
                        schema = self.schema.as_str(),
                        instance = %self.instance,
                        backend_pid = session.backend_pid,
                        "pgbox janitor took the lock"
                    );
                    Ok(LockStatus::Acquired)
                }
                Step::Done(false) => {
                    tracing::debug!(
                        schema = self.schema.as_str(),
                        instance = %self.instance,
                        "pgbox janitor waits: another instance holds the lock"
                    );
                    Ok(LockStatus::NotHeld)
                }
                Step::Lost | Step::Failed(_) if slot.is_none() && !fresh => continue,
                Step::Lost => Ok(LockStatus::NotHeld),
                Step::Failed(e) => Err(e),
            };
        }
    }

    /// Opens the dedicated lock connection.
    async fn connect(&self) -> Result<Session> {
        let connect = async {
            let mut conn = PgConnection::connect_with(&self.connect)
                .await
                .map_err(|e| crate::connect::session_connect_error(&self.connect, e))?;
            let backend_pid: i32 = sqlx::query_scalar("SELECT pg_catalog.pg_backend_pid()")
                .fetch_one(&mut conn)
                .await?;
            Ok::<_, Error>(Session {
                conn,
                held: false,
                backend_pid,
                busy: false,
            })
        };
        match tokio::time::timeout(self.op_bound(), connect).await {
            Ok(session) => session,
            Err(_) => Err(Error::from(sqlx::Error::PoolTimedOut)),
        }
    }

    /// One unit: a transaction on the lock connection that checks the lock, deletes one
    /// batch and commits.
    async fn unit(&self, slot: &mut Option<Session>, task: &Task<'_>) -> Step<u64> {
        let span = tracing::debug_span!(
            "pgbox.janitor.unit",
            task = task.name(),
            consumer = tracing::field::Empty
        );
        if let Task::Inbox { consumer, .. } = task {
            span.record("consumer", *consumer);
        }
        let Some(session) = slot.as_mut() else {
            return Step::Lost;
        };
        session.busy = true;
        let done = tokio::time::timeout(
            self.op_bound(),
            self.delete_batch(&mut session.conn, task)
                .instrument(span.clone()),
        )
        .await;
        session.busy = false;
        match self.settle(slot, flatten(done)).await {
            Step::Done(Some((deleted, ids))) => {
                let _entered = span.enter();
                tracing::debug!(deleted, "pgbox janitor batch");
                if !ids.is_empty() {
                    // Like `discard`: a warning with the count, the ids at debug.
                    tracing::warn!(
                        table = task.name(),
                        deleted,
                        "pgbox janitor deleted old dead letters, releasing their ordering keys"
                    );
                    tracing::debug!(?ids, "pgbox janitor deleted dead letters: ids");
                }
                Step::Done(deleted)
            }
            Step::Done(None) => {
                let session = slot.take().expect("present after a statement");
                self.lost(&session, "its connection no longer holds the lock");
                Step::Lost
            }
            Step::Lost => Step::Lost,
            Step::Failed(e) => Step::Failed(e),
        }
    }

    /// The unit's transaction: `None` (rolled back) if this session does not hold the lock,
    /// else the rows deleted (and the message ids, for dead letters).
    async fn delete_batch(
        &self,
        conn: &mut PgConnection,
        task: &Task<'_>,
    ) -> Result<Option<(u64, Vec<Uuid>)>> {
        let sql = &self.sql;
        let mut tx = conn.begin_with(AssertSqlSafe(sql.begin.clone())).await?;
        if !check_held(&mut tx, self.key).await? {
            return Ok(None);
        }
        let (deleted, ids) = match task {
            Task::Inbox { consumer, age } => {
                let n = sqlx::query(AssertSqlSafe(sql.inbox.clone()))
                    .bind(*consumer)
                    .bind(age.as_secs_f64())
                    .bind(self.batch_size)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                (n, Vec::new())
            }
            Task::HandBacks { age } | Task::Published { age } => {
                let statement = match task {
                    Task::HandBacks { .. } => &sql.hand_backs,
                    _ => &sql.published,
                };
                let n = sqlx::query(AssertSqlSafe(statement.clone()))
                    .bind(age.as_secs_f64())
                    .bind(self.batch_size)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                (n, Vec::new())
            }
            Task::OutboxDeadLetters { age } | Task::QueueDeadLetters { age } => {
                let statement = match task {
                    Task::OutboxDeadLetters { .. } => &sql.outbox_dead_letters,
                    _ => &sql.queue_dead_letters,
                };
                let ids: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(statement.clone()))
                    .bind(age.as_secs_f64())
                    .bind(self.batch_size)
                    .fetch_all(&mut *tx)
                    .await?;
                (ids.len() as u64, ids)
            }
        };
        tx.commit().await?;
        Ok(Some((deleted, ids)))
    }

    /// How long any one operation on the lock connection may take: past the statement
    /// timeout the server has given up; past this, the connection has.
    fn op_bound(&self) -> Duration {
        self.statement_timeout + Duration::from_secs(10)
    }

    /// Turns the result of an operation on the lock connection into a [`Step`]. `Err(None)`
    /// is an operation that timed out. A failure that leaves the connection unusable, or
    /// unable to show that it still holds the lock it held, discards the session: the lock
    /// is [`Step::Lost`] (or, if it was not held, the error is returned).
    async fn settle<T>(
        &self,
        slot: &mut Option<Session>,
        result: std::result::Result<T, Option<Error>>,
    ) -> Step<T> {
        let error = match result {
            Ok(value) => return Step::Done(value),
            Err(error) => error,
        };
        let Some(session) = slot.as_mut() else {
            return Step::Lost;
        };
        let alive = match &error {
            Some(e) if e.db_kind() != Some(DbErrorKind::ConnectionLost) => {
                // A statement failed on a live connection (a timeout, a missing table): is
                // the session still there, and still the holder if it was?
                let held = session.held;
                let check = check_held(&mut session.conn, self.key);
                matches!(
                    tokio::time::timeout(Duration::from_secs(5), check).await,
                    Ok(Ok(h)) if h || !held
                )
            }
            _ => false,
        };
        if alive {
            return Step::Failed(error.expect("alive only after an error"));
        }
        let session = slot.take().expect("checked");
        if session.held {
            let why = match &error {
                Some(e) => format!("its connection failed: {e}"),
                None => "its connection stopped answering".to_owned(),
            };
            self.lost(&session, &why);
            Step::Lost
        } else {
            match error {
                Some(e) => Step::Failed(e),
                None => Step::Lost,
            }
        }
    }

    fn lost(&self, session: &Session, why: &str) {
        if session.held {
            tracing::warn!(
                schema = self.schema.as_str(),
                instance = %self.instance,
                backend_pid = session.backend_pid,
                why,
                "pgbox janitor lost the lock; it stops working until it takes the lock again"
            );
        }
    }
}

/// Flattens a timed operation's result for [`Janitor::settle`]: `Err(None)` is a timeout.
fn flatten<T, E: Into<Error>>(
    timed: std::result::Result<std::result::Result<T, E>, tokio::time::error::Elapsed>,
) -> std::result::Result<T, Option<Error>> {
    match timed {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Some(e.into())),
        Err(_) => Err(None),
    }
}

/// Whether this connection's session holds the janitor lock of schema key `key`.
async fn check_held(conn: &mut PgConnection, key: i32) -> Result<bool> {
    Ok(sqlx::query_scalar(LOCK_HELD)
        .bind(i64::from(LOCK_CLASS as u32))
        .bind(i64::from(key as u32))
        .fetch_one(conn)
        .await?)
}

/// A retention in words for refusals (`1 day`, `12 hours`, `1 hour 30 minutes`): people read
/// these, and `86400s` has to be worked out. Whole seconds, or milliseconds below one.
fn duration_words(d: Duration) -> String {
    let mut secs = d.as_secs();
    if secs == 0 {
        return format!("{} ms", d.as_millis());
    }
    let mut parts = Vec::new();
    for (unit, size) in [
        ("day", 86_400),
        ("hour", 3600),
        ("minute", 60),
        ("second", 1),
    ] {
        let n = secs / size;
        secs %= size;
        match n {
            0 => {}
            1 => parts.push(format!("1 {unit}")),
            n => parts.push(format!("{n} {unit}s")),
        }
    }
    parts.join(" ")
}

/// The lock connection's `application_name`: how operators find the holder in
/// `pg_stat_activity`. PostgreSQL keeps 63 bytes of it.
fn application_name(instance: &str) -> String {
    let mut name = format!("pgbox-janitor {instance}");
    while name.len() > 63 {
        name.pop();
    }
    name
}

/// The second half of the lock id, per schema (FNV-1a folded to 32 bits). A different key
/// space from the migrator's single 64-bit key: the two-key form cannot collide with it.
fn lock_key(schema: &str) -> i32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"pgbox-janitor:".iter().chain(schema.as_bytes()) {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash ^ (hash >> 32)) as u32 as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_differ_per_schema_and_are_stable() {
        assert_eq!(lock_key("pgbox"), lock_key("pgbox"));
        assert_ne!(lock_key("pgbox"), lock_key("billing"));
    }

    #[test]
    fn application_names_fit_the_server_limit() {
        assert_eq!(application_name("a"), "pgbox-janitor a");
        assert_eq!(application_name(&"x".repeat(100)).len(), 63);
    }

    #[test]
    fn retentions_are_written_in_words() {
        let secs = Duration::from_secs;
        assert_eq!(duration_words(secs(86_400)), "1 day");
        assert_eq!(duration_words(secs(3600)), "1 hour");
        assert_eq!(
            duration_words(secs(2 * 86_400 + 12 * 3600)),
            "2 days 12 hours"
        );
        assert_eq!(duration_words(secs(90)), "1 minute 30 seconds");
        assert_eq!(duration_words(Duration::from_millis(250)), "250 ms");
    }
}
