//! The relay: publishes committed outbox messages through a [`Publisher`].
//!
//! Each round is one transaction: claim a batch with `FOR UPDATE SKIP LOCKED`, publish it,
//! delete what was confirmed (or mark it published, in audit mode), reschedule what failed,
//! dead-letter what failed too often, commit. Consequences:
//! - several relays share the work without publishing a message twice in the normal path
//!   (the row locks keep them apart);
//! - a relay that dies mid-batch loses nothing: its transaction rolls back and the messages
//!   are claimed again (and published again; the consumer's inbox absorbs the duplicate);
//! - into the built-in queue on the relay's own database (see [`Publisher::as_pg_queue`]), the
//!   batch is moved into the queue by the round's own transaction, so a round that does not
//!   commit leaves no copy there;
//! - keyed messages are claimed by one relay at a time (the holder of a per-round advisory
//!   lock; the others take unkeyed messages meanwhile): per ordering key, a round claims a run
//!   of consecutive messages starting at the key's oldest pending one (none while that one
//!   waits out a backoff or sits in the dead letters), and publishes them in commit order,
//!   stopping the key at its first failure; other keys flow in parallel.

mod dead_letters;
mod slot;
pub(crate) mod wal;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgListener, PgRow};
use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use self::dead_letters::{DeadLetter, DeadLetters};
pub use self::slot::WalSlotInvalidation;
pub use self::wal::{WalReader, WalRelay, WalRelayBuilder, WalRoundReport, WalSlot, WalSlotStatus};

use crate::error::{Error, Result};
use crate::ident::DEFAULT_SCHEMA;
use crate::ident::Identifier;
use crate::outbox::{ASLEEP_LOCK_CLASS, Envelope};
use crate::pooler::Pooler;
use crate::retry::RetryPolicy;
use crate::telemetry;
use crate::transport::{PublishError, Publisher};

/// How a relay learns that there is work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WakeUp {
    /// Sleep on `LISTEN`, holding the asleep lock, so that producers notify only while a relay
    /// sleeps (never on every commit); poll at the poll interval as a fallback. The default.
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
    publisher: Arc<P>,
    schema: String,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    poll_interval: Duration,
    wake_up: WakeUp,
    keep_published: bool,
    pooler: Pooler,
    session_pool: Option<PgPool>,
    publish_timeout: Duration,
    archive: Option<crate::archive::ArchiveRetention>,
    /// The `pgbox-tenant` header's value, when the relay serves one tenant of a
    /// [`TenantRelay`](crate::TenantRelay).
    tenant: Option<String>,
}

/// How long one call of [`Publisher::publish`] may take before the relay gives up on it, by
/// default: four times the built-in transports' own bounds (30 s each), so it only catches
/// a publisher that never answers.
pub(crate) const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(120);

impl<P: Publisher> RelayBuilder<P> {
    /// What stands between the relay's pool and PostgreSQL (default [`Pooler::None`]).
    ///
    /// With [`Pooler::Transaction`] the relay's statements go unnamed, and its wake-up (a
    /// `LISTEN` and a session advisory lock it sleeps under) needs a direct connection: give
    /// one with [`session_pool`](Self::session_pool), or the relay polls (as
    /// [`WakeUp::Poll`]), logging so once at start. It never takes the session lock through
    /// the pooler, which would hand it to another client's transaction.
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// A pool of direct (session) connections for the wake-up's `LISTEN` connection, when the
    /// relay's own pool goes through a pooler in transaction mode. One connection is used.
    pub fn session_pool(mut self, pool: PgPool) -> Self {
        self.session_pool = Some(pool);
        self
    }

    /// The pgbox schema (default `pgbox`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Messages claimed per round (default 500).
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

    /// Archive published messages for `retention` (see [`Archive`](crate::Archive)): the
    /// round's settling statement moves them from the outbox into `outbox_archive` (also
    /// when the batch moves into the built-in queue in the same database: one `DELETE` feeds
    /// both inserts), so a message is archived exactly when its publication is settled. The
    /// relay records the retention and creates partitions ahead at its first round; the
    /// [`Janitor`](crate::janitor::Janitor) keeps them coming and drops expired ones.
    ///
    /// Not with [`keep_published`](Self::keep_published): both keep published messages,
    /// one in the outbox, the other beside it; [`build`](Self::build) refuses the pair.
    pub fn archive(mut self, retention: crate::archive::ArchiveRetention) -> Self {
        self.archive = Some(retention);
        self
    }

    /// How long one call of the publisher may take (default 2 min). A call that has not answered by then is dropped, and its messages are
    /// reported unavailable: an outage, never counted as an attempt, their topic backed off.
    /// Without a bound, a publisher that never answers (a user-written one waiting on a
    /// peer that went silent) would hold the round's transaction, its row locks and the
    /// keyed-drain lock for good, and no other relay could publish a keyed message.
    ///
    /// The built-in transports bound their own calls (30 s by default: RabbitMQ's confirm
    /// timeout, the queue's [`publish_timeout`](crate::transport::PgQueue::publish_timeout),
    /// Kafka's `message.timeout.ms`); keep this above theirs. A dropped call may have
    /// published some of its messages: they are published again (at-least-once; the
    /// consumer's inbox absorbs the duplicates). Zero is refused at [`build`](Self::build).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// Marks every message this relay publishes (or moves into the built-in queue) with the
    /// [`TENANT_HEADER`](crate::TENANT_HEADER) `value`.
    pub(crate) fn tenant(mut self, value: String) -> Self {
        self.tenant = Some(value);
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Relay<P>> {
        let schema = Identifier::pgbox_schema(&self.schema)?;
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
        if self.publish_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "relay publish timeout must be positive".into(),
            ));
        }
        crate::transport::check_call_timeout(&*self.publisher, self.publish_timeout)?;
        if let Some(archive) = &self.archive {
            archive.validate()?;
            if self.keep_published {
                return Err(Error::InvalidConfig(
                    "relay archive and keep_published exclude each other: the archive keeps \
                     published messages (choose one)"
                        .into(),
                ));
            }
        }
        let mut sql = Statements::new(&schema, self.keep_published, self.batch_size);
        if self.archive.is_some() {
            sql.done = crate::archive::settle_sql(&schema, None);
        }
        let into_queue = self.publisher.as_pg_queue().map(|queue| {
            let queue_schema = queue.schema_identifier();
            IntoQueue {
                queue_schema: queue_schema.as_str().to_owned(),
                keyed_lock: keyed_lock_into_queue_sql(&sql.keyed_lock),
                move_batch: match self.archive {
                    Some(_) => crate::archive::settle_sql(&schema, Some(queue_schema)),
                    None => move_sql(&sql.done, queue_schema, self.tenant.is_some()),
                },
            }
        });
        let mut wake_up = self.wake_up;
        let listen_pool = match (self.pooler.keeps_sessions(), self.session_pool) {
            (_, Some(session)) => session,
            (true, None) => self.pool.clone(),
            (false, None) => {
                if wake_up == WakeUp::Notify {
                    tracing::info!(
                        "pgbox relay behind a transaction pooler without a session pool: \
                         polling every {:?} (LISTEN and the relay's session lock need a direct \
                         connection: RelayBuilder::session_pool)",
                        self.poll_interval
                    );
                }
                wake_up = WakeUp::Poll;
                self.pool.clone()
            }
        };
        Ok(Relay {
            listen_pool,
            persistent: self.pooler.persistent(),
            pooler: self.pooler,
            pool: self.pool,
            publisher: self.publisher,
            tenant: self.tenant,
            schema,
            batch_size: self.batch_size,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            poll_interval: self.poll_interval,
            publish_timeout: self.publish_timeout,
            wake_up,
            sql: Arc::new(sql),
            into_queue,
            moving: std::sync::atomic::AtomicU8::new(0),
            outages: std::sync::Mutex::default(),
            next_promotion: std::sync::Mutex::new(Instant::now()),
            archive: self.archive,
            archive_ready: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// Advisory-lock class of the keyed-drain lock, keyed by `hashtext(schema)` and held for one
/// round. Only its holder claims keyed rows; relays running rounds at the same time take
/// unkeyed rows only. A relay claiming a key's later rows while another holds its earlier
/// ones would have to drop them (they may not overtake), and holding their row locks it would
/// in turn block the head-holder's next round: measured, four relays drained a keyed backlog
/// twenty times slower than one.
const KEYED_DRAIN_CLASS: i32 = 0x7062_6f6b; // "pbok"

/// A round's BEGIN, with the claim's plan pinned in the same round trip: the cheap plan walks
/// the pending rows in seq order and stops after a batch. With statistics that lag a backlog
/// (an outbox swings from empty to 200,000 rows faster than ANALYZE follows) the planner
/// would rather read and sort the whole backlog, seconds per round. `jit = off` because the
/// disabled plan types make every cost look huge, which would otherwise trigger compilation.
const PINNED_BEGIN: &str = "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
     SET LOCAL enable_sort = off; SET LOCAL jit = off";

#[derive(Debug)]
struct Statements {
    claim: String,
    claim_unkeyed: String,
    /// `claim` and `claim_unkeyed` without the payloads, for rounds that move messages into
    /// a queue in the same database (the payloads go from table to table on the server).
    claim_local: String,
    claim_unkeyed_local: String,
    keyed_lock: String,
    done: String,
    retry: String,
    dead: String,
    /// Seconds until the next pending message is due (0 or less: due now), NULL when none
    /// is pending. A message never tried is due whatever its `available_at`.
    next_due: String,
    /// Messages held behind a dead-lettered message of their key.
    held: String,
    /// Moves due scheduled messages into the outbox (see [`crate::outbox::scheduled`]).
    promote: String,
    /// Seconds until the earliest scheduled message is due.
    scheduled_next_due: String,
    /// The archive's order lock, taken before an archiving round settles (see
    /// `archive::order_lock_sql`).
    archive_order_lock: String,
}

impl Statements {
    fn new(s: &Identifier, keep_published: bool, batch_size: usize) -> Self {
        Statements {
            // Keyed rows are claimed only by the relay that holds the keyed-drain lock for
            // its round (see `KEYED_DRAIN_CLASS`), so no other transaction ever holds a row of
            // a key: a key's claimed rows are exactly its oldest pending ones, in order.
            // `blocked`: keys whose head waits out a backoff (few rows, a partial index).
            // `c`: due rows in commit order, keyed ones only while their key is neither
            // blocked nor dead-lettered. A row never tried is due whatever its
            // `available_at` (its producer's transaction start, which is not in `seq` order:
            // skipping it for one round would let a later row of its key overtake it). The
            // LIMIT is a literal: with `$1` the statement is planned anew every round.
            claim: claim_sql(s, batch_size, CLAIMED_COLUMNS),
            claim_unkeyed: claim_unkeyed_sql(s, batch_size, CLAIMED_COLUMNS),
            claim_local: claim_sql(s, batch_size, CLAIMED_COLUMNS_LOCAL),
            claim_unkeyed_local: claim_unkeyed_sql(s, batch_size, CLAIMED_COLUMNS_LOCAL),
            keyed_lock: format!(
                "SELECT pg_catalog.pg_try_advisory_xact_lock({KEYED_DRAIN_CLASS}, pg_catalog.hashtext('{name}'))",
                name = s.as_str()
            ),
            done: if keep_published {
                format!("UPDATE {s}.outbox SET published_at = pg_catalog.now() WHERE seq = ANY($1)")
            } else {
                format!("DELETE FROM {s}.outbox WHERE seq = ANY($1)")
            },
            retry: format!(
                "UPDATE {s}.outbox AS o SET attempts = o.attempts + 1, last_error = f.error, \
                   available_at = pg_catalog.now() + pg_catalog.make_interval(secs => f.delay) \
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
            // Messages held behind a dead-lettered message of their key wait for its replay
            // or discard, not for a relay: they do not count as pending.
            next_due: format!(
                "SELECT extract(epoch FROM pg_catalog.min(CASE WHEN o.attempts = 0 THEN pg_catalog.now() ELSE o.available_at END) - pg_catalog.now())::float8 \
                 FROM {s}.outbox AS o \
                 WHERE o.published_at IS NULL \
                   AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {s}.outbox_dead_letters AS d \
                     WHERE d.topic = o.topic AND d.ordering_key = o.ordering_key AND d.seq > 0))"
            ),
            held: format!(
                "SELECT pg_catalog.count(*) FROM {s}.outbox AS o \
                 WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL \
                   AND EXISTS (SELECT 1 FROM {s}.outbox_dead_letters AS d \
                     WHERE d.topic = o.topic AND d.ordering_key = o.ordering_key AND d.seq > 0)"
            ),
            promote: crate::outbox::scheduled::promote_sql(s, batch_size),
            scheduled_next_due: crate::outbox::scheduled::next_due_sql(s),
            archive_order_lock: crate::archive::order_lock_sql(s),
        }
    }
}

/// The columns a round claims, as [`Envelope::from_row`] reads them.
const CLAIMED_COLUMNS: &str =
    "seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, attempts";
/// The same without the payload, for a round that moves its batch into a queue in the same
/// database: the payload is copied from table to table on the server.
const CLAIMED_COLUMNS_LOCAL: &str = "seq, message_id, topic, ordering_key, ''::pg_catalog.bytea AS payload, \
     content_type, headers, created_at, attempts";

/// The claim of the relay that holds the keyed-drain lock (see [`Statements::new`]).
fn claim_sql(s: &Identifier, batch_size: usize, columns: &str) -> String {
    format!(
        "WITH blocked AS MATERIALIZED (\
           SELECT DISTINCT b.topic, b.ordering_key FROM {s}.outbox AS b \
           WHERE b.attempts > 0 AND b.published_at IS NULL AND b.available_at > pg_catalog.now()) \
         SELECT {columns} \
         FROM {s}.outbox AS o \
         WHERE o.published_at IS NULL AND (o.attempts = 0 OR o.available_at <= pg_catalog.now()) \
           AND o.topic <> ALL($1::text[]) \
           AND (o.ordering_key IS NULL OR (\
             NOT EXISTS (SELECT 1 FROM blocked AS b \
               WHERE b.topic = o.topic AND b.ordering_key = o.ordering_key) \
             AND NOT EXISTS (SELECT 1 FROM {s}.outbox_dead_letters AS d \
               WHERE d.topic = o.topic AND d.ordering_key = o.ordering_key AND d.seq > 0))) \
         ORDER BY o.seq LIMIT {batch_size} FOR UPDATE SKIP LOCKED"
    )
}

/// The claim of a relay whose round did not get the keyed-drain lock: unkeyed rows only.
fn claim_unkeyed_sql(s: &Identifier, batch_size: usize, columns: &str) -> String {
    format!(
        "SELECT {columns} \
         FROM {s}.outbox AS o \
         WHERE o.published_at IS NULL AND o.ordering_key IS NULL \
           AND (o.attempts = 0 OR o.available_at <= pg_catalog.now()) \
           AND o.topic <> ALL($1::text[]) \
         ORDER BY o.seq LIMIT {batch_size} FOR UPDATE SKIP LOCKED"
    )
}

/// The keyed-drain lock's statement (`keyed_lock`) for a relay into the built-in queue: also
/// which server run and database the round's transaction is on, and whether its role may
/// insert into the queue (`$1`: the queue's schema), looked up by name in the catalogs so that
/// a schema the role may not use reads as "may not" rather than failing the round.
fn keyed_lock_into_queue_sql(keyed_lock: &str) -> String {
    format!(
        "{keyed_lock}, \
           pg_catalog.pg_postmaster_start_time(), pg_catalog.current_database()::text, \
           EXISTS (SELECT FROM pg_catalog.pg_class AS c \
             JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = 'queue' AND c.relkind IN ('r', 'p') \
               AND pg_catalog.has_schema_privilege(n.oid, 'USAGE') \
               AND pg_catalog.has_table_privilege(c.oid, 'INSERT'))"
    )
}

/// The statement that moves a round's confirmed rows from the outbox into the queue in
/// `queue_schema`: the round's own settling statement (`done`: the DELETE, or in audit mode
/// the `published_at` UPDATE, of `seq = ANY($1)`) feeds the queue's INSERT, in seq order so
/// that the queue keeps each key's order.
///
/// With `tenant`, the `pgbox-tenant` header is merged into each row's headers from `$2`.
fn move_sql(done: &str, queue_schema: &Identifier, tenant: bool) -> String {
    let headers = if tenant {
        format!(
            "headers || pg_catalog.jsonb_build_object('{}', $2::text)",
            crate::TENANT_HEADER
        )
    } else {
        "headers".to_owned()
    };
    format!(
        "WITH moved AS ({done} \
           RETURNING seq, message_id, topic, ordering_key, payload, content_type, headers, created_at) \
         INSERT INTO {queue_schema}.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
         SELECT message_id, topic, ordering_key, payload, content_type, {headers}, created_at \
         FROM moved ORDER BY seq"
    )
}

/// What [`Relay::drain`] did, over all its rounds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Rounds run (the last one found nothing).
    pub rounds: usize,
    /// Messages published by this relay.
    pub published: usize,
    /// Failed publishes, rescheduled (and published or dead-lettered by a later round).
    pub retried: usize,
    /// Messages moved to the dead letters.
    pub dead_lettered: usize,
    /// Messages left in the outbox when it returned, held behind a dead-lettered message of
    /// their ordering key: published once that one is replayed or discarded.
    pub held: usize,
    /// Publishes that found the transport unavailable (an outage: retried, never counted as
    /// an attempt, never dead-lettered).
    pub unavailable: usize,
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
    /// Not published because the transport was unavailable: left in the outbox as they were
    /// (no attempt counted), their topic backed off.
    pub unavailable: usize,
}

/// Publishes outbox messages. Build with [`Relay::builder`]; run with [`Relay::run`].
///
/// Committed messages are published at least once, in order per ordering key; a transport
/// that is away holds them (no attempt counted) until it is back.
///
/// ```no_run
/// use pgbox::transport::PgQueue;
/// use pgbox::{CancellationToken, Relay};
/// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// // Into the built-in Postgres queue (here in the same database; any `Publisher` works).
/// let relay = Relay::builder(pool.clone(), PgQueue::new(pool.clone())).build()?;
/// let shutdown = CancellationToken::new();
/// // Woken by each commit's NOTIFY, polling as a fallback, until `shutdown` is cancelled.
/// relay.run(shutdown).await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Relay<P> {
    pool: PgPool,
    /// Where the wake-up's LISTEN connection comes from (the relay's pool unless a session
    /// pool was given).
    listen_pool: PgPool,
    /// What stands between its pool and PostgreSQL.
    pooler: Pooler,
    /// Whether its statements may be named (not behind a transaction pooler).
    persistent: bool,
    publisher: Arc<P>,
    schema: Identifier,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    poll_interval: Duration,
    publish_timeout: Duration,
    wake_up: WakeUp,
    sql: Arc<Statements>,
    /// When the publisher is the built-in queue: the keyed-drain lock's statement that also
    /// says which server run and database the round is on and whether it may insert into
    /// the queue, and the statement that moves a batch into the queue.
    into_queue: Option<IntoQueue>,
    /// Whether the last round moved its batch (1) or published it (2), 0 before the first:
    /// a change is logged once.
    moving: std::sync::atomic::AtomicU8,
    /// Topics whose transport was unavailable at their last publish: not claimed until their
    /// outage backoff expires (see [`Outages`]).
    outages: std::sync::Mutex<Outages>,
    /// When to look for due scheduled messages next: when the earliest falls due, at most a
    /// poll interval ahead, and at once after a producer scheduled one.
    next_promotion: std::sync::Mutex<Instant>,
    /// Archiving's settings, when on.
    archive: Option<crate::archive::ArchiveRetention>,
    /// The archive's settings were recorded and its partitions created ahead.
    archive_ready: std::sync::atomic::AtomicBool,
    /// The `pgbox-tenant` header's value, when serving one tenant of a
    /// [`TenantRelay`](crate::TenantRelay).
    tenant: Option<String>,
}

#[derive(Debug)]
struct IntoQueue {
    queue_schema: String,
    keyed_lock: String,
    move_batch: String,
}

impl<P: Publisher> Relay<P> {
    /// A relay over `pool` publishing through `publisher`, with defaults.
    pub fn builder(pool: PgPool, publisher: P) -> RelayBuilder<P> {
        Self::shared(pool, Arc::new(publisher))
    }

    /// [`builder`](Self::builder) with a publisher shared with other relays (the
    /// [`TenantRelay`](crate::TenantRelay)'s tenants).
    pub(crate) fn shared(pool: PgPool, publisher: Arc<P>) -> RelayBuilder<P> {
        RelayBuilder {
            pool,
            publisher,
            tenant: None,
            schema: DEFAULT_SCHEMA.into(),
            batch_size: 500,
            max_attempts: 10,
            backoff: RetryPolicy::new()
                .base_delay(Duration::from_secs(1))
                .max_delay(Duration::from_secs(300)),
            poll_interval: Duration::from_secs(1),
            wake_up: WakeUp::Notify,
            keep_published: false,
            pooler: Pooler::None,
            session_pool: None,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            archive: None,
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
                match crate::listen::listen(&self.listen_pool, &self.channel()).await {
                    Ok(l) => listener = Some(l),
                    Err(e) => tracing::warn!(error = %e, "pgbox relay cannot LISTEN; polling"),
                }
            }
            if !self.run_rounds(&shutdown).await {
                return Ok(());
            }
            let wait = tokio::time::sleep(self.sleep_for());
            let mut lost_listener = false;
            match listener.as_mut() {
                Some(l) => match self.fall_asleep(l).await {
                    // Asleep: producers that commit from now on notify. Sleep until one
                    // does, or the poll interval passes (backoffs expire without a notice).
                    Ok(true) => {
                        // Scheduled while this relay was awake: no notice came.
                        if let Err(e) = self.refresh_next_promotion().await {
                            tracing::warn!(error = %e, "pgbox relay cannot read the next due time");
                        }
                        if !self.run_rounds(&shutdown).await {
                            return Ok(());
                        }
                        let wait = tokio::time::sleep(self.sleep_for());
                        tokio::select! {
                            _ = shutdown.cancelled() => return Ok(()),
                            _ = wait => {}
                            // Ok(None): the connection dropped and notifications may have
                            // been missed; the drain at the top of the loop covers them.
                            n = l.try_recv() => match n {
                                Ok(Some(n)) => {
                                    if n.payload() == crate::outbox::scheduled::SCHEDULED_NOTICE {
                                        self.promote_soon();
                                    }
                                    tracing::trace!("pgbox relay woken by a producer");
                                }
                                Ok(None) => lost_listener = true,
                                Err(e) => {
                                    tracing::warn!(error = %e, "pgbox relay lost its LISTEN connection");
                                    lost_listener = true;
                                }
                            },
                        }
                        if !lost_listener && let Err(e) = self.wake(l).await {
                            tracing::warn!(error = %e, "pgbox relay lost its LISTEN connection");
                            lost_listener = true;
                        }
                    }
                    // Producers were still in flight for a whole poll interval: poll.
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "pgbox relay lost its LISTEN connection");
                        lost_listener = true;
                    }
                },
                None => {
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = wait => {}
                    }
                }
            }
            if lost_listener {
                // Dropping the connection also releases the asleep lock.
                listener = None;
            }
        }
    }

    /// How long the relay may sleep: a poll interval, or less when a scheduled message falls
    /// due sooner.
    fn sleep_for(&self) -> Duration {
        let next = *self.next_promotion.lock().expect("next promotion");
        next.saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), self.poll_interval)
    }

    /// Brings the next look for due scheduled messages forward to the earliest due time, if
    /// that is sooner: run once the asleep lock is held, it sees what producers scheduled
    /// while the relay was awake (they sent no notice). One probe of the due-time index.
    async fn refresh_next_promotion(&self) -> Result<()> {
        let seconds = crate::outbox::scheduled::next_due(
            &self.pool,
            &self.sql.scheduled_next_due,
            self.persistent,
        )
        .await?;
        if let Some(s) = seconds {
            let at = Instant::now()
                + Duration::from_secs_f64(s.clamp(0.0, self.poll_interval.as_secs_f64()));
            let mut next = self.next_promotion.lock().expect("next promotion");
            if at < *next {
                *next = at;
            }
        }
        Ok(())
    }

    /// Looks for due scheduled messages at the next round.
    pub(crate) fn promote_soon(&self) {
        *self.next_promotion.lock().expect("next promotion") = Instant::now();
    }

    /// Moves due scheduled messages into the outbox, when one may be due (or `force`): a
    /// statement that finds nothing due is one probe of the due-time index, and runs at most
    /// once a poll interval, or when the earliest scheduled message falls due, or after a
    /// producer scheduled one. Returns how many it moved.
    async fn promote_due(&self, force: bool) -> Result<usize> {
        let now = Instant::now();
        if !force && *self.next_promotion.lock().expect("next promotion") > now {
            return Ok(0);
        }
        let moved = crate::outbox::scheduled::promote_into_table(
            &self.pool,
            &self.sql.promote,
            self.persistent,
        )
        .await?;
        let next = now
            + crate::outbox::scheduled::wait_before_next_look(
                &self.pool,
                &self.sql.scheduled_next_due,
                self.persistent,
                moved,
                self.batch_size,
                self.poll_interval,
            )
            .await?;
        *self.next_promotion.lock().expect("next promotion") = next;
        if moved > 0 {
            tracing::debug!(
                messages = moved,
                "pgbox relay promoted due scheduled messages"
            );
        }
        Ok(moved)
    }

    /// Publishes rounds while they make progress: a round that published anything may have
    /// unblocked the next messages of its keys, and a full round means there is more.
    /// `false` if shutdown was requested.
    /// Rounds while they find work; `false` once `shutdown` is cancelled.
    async fn run_rounds(&self, shutdown: &CancellationToken) -> bool {
        loop {
            if shutdown.is_cancelled() {
                return false;
            }
            match self.relay_once().await {
                Ok(report) if report.published > 0 || report.claimed == self.batch_size => {}
                Ok(_) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, retryable = e.is_retryable(), "pgbox relay round failed; will retry");
                    return true;
                }
            }
        }
    }

    /// Takes the asleep lock on the LISTEN connection (see the outbox's enqueue protocol):
    /// waits for producers that saw no sleeping relay to commit, at most one poll interval.
    /// `Ok(false)` if they did not within it.
    async fn fall_asleep(&self, listener: &mut PgListener) -> Result<bool> {
        let asleep = crate::listen::take_asleep_lock(
            listener,
            ASLEEP_LOCK_CLASS,
            self.schema.as_str(),
            self.poll_interval,
        )
        .await?;
        if asleep {
            // Notifications buffered while awake were covered by the drain before this one.
            tracing::trace!("pgbox relay asleep");
        }
        Ok(asleep)
    }

    /// Releases the asleep lock: producers stop notifying.
    async fn wake(&self, listener: &mut PgListener) -> Result<()> {
        crate::listen::release_asleep_lock(listener, ASLEEP_LOCK_CLASS, self.schema.as_str()).await
    }

    /// Publishes until the outbox has nothing left to publish, then returns what it did: for
    /// tests, batch jobs and a shutdown that should leave nothing behind.
    ///
    /// "Nothing left" is read from the table, not from one empty round: a round that claims
    /// nothing while messages are pending (another relay holds them, or holds the keyed-drain
    /// lock for their keys) waits and looks again, and a message waiting out a retry backoff
    /// is waited for (at most a poll interval at a time) until it is published or
    /// dead-lettered after `max_attempts`. Several relays may drain at once; each returns
    /// when the outbox is empty. A round's error is returned as it is (the messages of that
    /// round are published again by the next round or relay).
    pub async fn drain(&self) -> Result<DrainReport> {
        let span = tracing::info_span!("pgbox.relay.drain", schema = self.schema.as_str());
        async {
            let mut total = DrainReport::default();
            self.promote_due(true).await?;
            loop {
                let round = self.relay_once().await?;
                total.rounds += 1;
                total.published += round.published;
                total.retried += round.retried;
                total.dead_lettered += round.dead_lettered;
                total.unavailable += round.unavailable;
                if round.claimed > 0 || self.promote_due(true).await? > 0 {
                    continue;
                }
                let mut unit = self.pooler.unit(&self.pool).await?;
                let next_due: Option<f64> =
                    sqlx::query_scalar(AssertSqlSafe(self.sql.next_due.clone()))
                        .persistent(self.persistent)
                        .fetch_one(&mut *unit)
                        .await?;
                let Some(seconds) = next_due else {
                    let held: i64 = sqlx::query_scalar(AssertSqlSafe(self.sql.held.clone()))
                        .persistent(self.persistent)
                        .fetch_one(&mut *unit)
                        .await?;
                    unit.finish().await?;
                    total.held = usize::try_from(held).unwrap_or(usize::MAX);
                    tracing::info!(
                        held = total.held,
                        published = total.published,
                        dead_lettered = total.dead_lettered,
                        rounds = total.rounds,
                        "pgbox relay drained the outbox"
                    );
                    return Ok(total);
                };
                unit.finish().await?;
                // Due now but not claimable: another relay has it, or its topic waits out an
                // outage; look again shortly (an outage's backoff, at most a poll interval).
                let mut wait = Duration::from_secs_f64(seconds.max(0.0))
                    .clamp(Duration::from_millis(5), self.poll_interval);
                if let Some(outage) = self.outages.lock().expect("outages").next_expiry() {
                    wait = wait.max(outage.min(self.poll_interval));
                }
                tokio::time::sleep(wait).await;
            }
        }
        .instrument(span)
        .await
    }

    /// One round: claim, publish, settle, commit. Returns what it did.
    ///
    /// Records the relay's metrics (see [`telemetry`](crate::telemetry)) once the round has
    /// committed: what a failed round published is published again, and counted then.
    pub async fn relay_once(&self) -> Result<RoundReport> {
        let started = Instant::now();
        let result = match self.promote_due(false).await {
            Ok(_) => self.round().await,
            Err(e) => Err(e),
        };
        match &result {
            Ok(report) if report.claimed > 0 => {
                metrics::histogram!(telemetry::RELAY_ROUND_DURATION).record(started.elapsed());
            }
            Ok(_) => {}
            Err(_) => metrics::counter!(telemetry::RELAY_ROUND_ERRORS).increment(1),
        }
        result
    }

    async fn round(&self) -> Result<RoundReport> {
        let span = tracing::debug_span!("pgbox.relay.round");
        async {
            self.prepare_archive().await;
            // Into the built-in queue: which server run and database the queue's pool is on,
            // asked every round, so that a pool moved to another server is followed. Not
            // answering, it is published to (and fails) as any transport would.
            let queue_side = match (&self.into_queue, self.publisher.as_pg_queue()) {
                (Some(_), Some(queue)) => {
                    match queue.server_identity().await {
                        Ok(there) => Some(there),
                        Err(e) => {
                            tracing::debug!(error = %e, "pgbox relay cannot reach the queue's pool");
                            None
                        }
                    }
                }
                _ => None,
            };
            let mut tx = crate::pooler::begin(&self.pool, Some(PINNED_BEGIN)).await?;
            let (keyed, local) = match (&self.into_queue, queue_side) {
                (Some(into), Some(there)) => {
                    let row = sqlx::query(AssertSqlSafe(into.keyed_lock.clone()))
                        .persistent(self.persistent)
                        .bind(&into.queue_schema)
                        .fetch_one(&mut *tx)
                        .await?;
                    let here: (OffsetDateTime, String) = (row.try_get(1)?, row.try_get(2)?);
                    let may_insert: bool = row.try_get(3)?;
                    let local = here == there && may_insert;
                    self.note_path(local, here == there, may_insert, &into.queue_schema);
                    (row.try_get(0)?, local.then_some(into.move_batch.as_str()))
                }
                _ => {
                    let keyed: bool =
                        sqlx::query_scalar(AssertSqlSafe(self.sql.keyed_lock.clone()))
                            .persistent(self.persistent)
                            .fetch_one(&mut *tx)
                            .await?;
                    (keyed, None)
                }
            };
            let claim = match (keyed, local.is_some()) {
                (true, false) => &self.sql.claim,
                (false, false) => &self.sql.claim_unkeyed,
                (true, true) => &self.sql.claim_local,
                (false, true) => &self.sql.claim_unkeyed_local,
            };
            let in_outage = self.outages.lock().expect("outages").current();
            let rows = sqlx::query(AssertSqlSafe(claim.clone()))
                .persistent(self.persistent)
                .bind(&in_outage)
                .fetch_all(&mut *tx)
                .await?;
            let mut report = RoundReport {
                claimed: rows.len(),
                ..RoundReport::default()
            };
            if rows.is_empty() {
                return Ok(report);
            }
            let mut batch = rows.iter().map(decode).collect::<Result<Vec<_>>>()?;
            if let Some(tenant) = &self.tenant {
                for message in &mut batch {
                    // A producer's own tenant header goes in any case: a consumer matching
                    // header names without case (HTTP, CloudEvents) must not read it.
                    message
                        .headers
                        .retain(|name, _| !name.eq_ignore_ascii_case(crate::TENANT_HEADER));
                    message
                        .headers
                        .insert(crate::TENANT_HEADER.to_owned(), tenant.clone());
                }
            }
            tracing::debug!(messages = batch.len(), "pgbox relay claimed");
            #[cfg(feature = "opentelemetry")]
            crate::otel::link_producer_traces(
                &tracing::Span::current(),
                batch.iter().map(|e| (e.id, &e.headers)),
            );
            // Into a queue in this database, the batch moves at the settling below, in this
            // transaction: it cannot fail apart from the round, and commits with it.
            let results = match local {
                Some(_) => vec![Some(Ok(())); batch.len()],
                None => self.publish_in_key_order(&batch).await,
            };
            #[cfg(feature = "testing")]
            {
                // The test kit's fault point: die after the publish, before the settling.
                let point = crate::testing::FaultPoint::RelayAfterPublishBeforeMark;
                if crate::testing::hit(point) {
                    return Err(crate::testing::crash(point));
                }
            }
            let confirmed_at = OffsetDateTime::now_utc();
            let mut tally = Tally::default();
            let (mut done, mut retry, mut dead) = (Vec::new(), Vec::new(), Vec::new());
            let mut unavailable: Option<PublishError> = None;
            for (message, result) in batch.iter().zip(results) {
                // Not attempted: an earlier message of its key failed in this round. Left as
                // it is: nothing is counted against it.
                let Some(result) = result else { continue };
                let counts = tally.topic(&message.topic);
                match result {
                    // An outage, not this message's failure: it stays in the outbox as it
                    // was (no attempt counted, never dead-lettered) and its topic backs off.
                    Err(error) if error.is_unavailable() => {
                        tracing::debug!(message_id = %message.id, topic = %message.topic, %error, "pgbox publish: transport unavailable");
                        counts.unavailable += 1;
                        unavailable.get_or_insert(error);
                    }
                    Ok(()) => {
                        tracing::debug!(message_id = %message.id, topic = %message.topic, "pgbox published");
                        done.push(message.seq);
                        counts
                            .lags
                            .push(telemetry::seconds_between(message.created_at, confirmed_at));
                    }
                    Err(error) => {
                        let error = error.to_string();
                        let attempt = message.attempts + 1;
                        let error = error.replace('\0', "\\0");
                        if attempt >= self.max_attempts {
                            tracing::error!(message_id = %message.id, attempt, error, "pgbox publish failed for the last time; dead-lettered");
                            dead.push((message.seq, error));
                            counts.dead_lettered += 1;
                        } else {
                            let delay = self.backoff.delay_after(attempt as u32);
                            // One warning per round below; each message at debug.
                            tracing::debug!(message_id = %message.id, attempt, ?delay, error, "pgbox publish failed; will retry");
                            retry.push((message.seq, error, delay.as_secs_f64()));
                            counts.retried += 1;
                        }
                    }
                }
            }
            if !done.is_empty() {
                if self.archive.is_some() {
                    // Archive seqs are drawn below: commit them in seq order (see
                    // `archive::order_lock_sql`).
                    sqlx::query(AssertSqlSafe(self.sql.archive_order_lock.clone()))
                        .persistent(self.persistent)
                        .execute(&mut *tx)
                        .await?;
                }
                let settle = local.unwrap_or(&self.sql.done);
                let mut settle = sqlx::query(AssertSqlSafe(settle.to_owned()))
                    .persistent(self.persistent)
                    .bind(&done);
                if local.is_some()
                    && self.archive.is_none()
                    && let Some(tenant) = &self.tenant
                {
                    settle = settle.bind(tenant);
                }
                let settled = settle.execute(&mut *tx).await?;
                // The round holds every claimed row locked: all of them move, or the round
                // rolls back rather than commit a partial move.
                if local.is_some() && settled.rows_affected() != done.len() as u64 {
                    return Err(Error::Database {
                        kind: crate::DbErrorKind::Other,
                        source: sqlx::Error::Protocol(format!(
                            "moved {} of {} claimed messages into the queue",
                            settled.rows_affected(),
                            done.len()
                        )),
                    });
                }
            }
            report.unavailable = tally.unavailable();
            self.note_outages(&tally, unavailable.as_ref());
            if let Some((_, first_error, first_delay)) = retry.first() {
                // One line for the round, not one per message (each message has its debug
                // line above).
                tracing::warn!(
                    messages = retry.len(),
                    error = %first_error,
                    next_attempt_in = ?Duration::from_secs_f64(*first_delay),
                    "pgbox publish failed; will retry"
                );
            }
            if !retry.is_empty() {
                let (seqs, rest): (Vec<i64>, Vec<(String, f64)>) =
                    retry.into_iter().map(|(s, e, d)| (s, (e, d))).unzip();
                let (errors, delays): (Vec<String>, Vec<f64>) = rest.into_iter().unzip();
                report.retried = seqs.len();
                sqlx::query(AssertSqlSafe(self.sql.retry.clone()))
                    .persistent(self.persistent)
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
                    .persistent(self.persistent)
                    .bind(&seqs)
                    .bind(&errors)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            report.published = done.len();
            tally.record();
            Ok(report)
        }
        .instrument(span)
        .await
    }
}

impl<P: Publisher> Relay<P> {
    /// With archiving on, once: records the retention and creates the archive's partitions
    /// ahead. A failure is logged and tried again next round; archiving goes on meanwhile
    /// (into the default partition if no range partition covers the time).
    async fn prepare_archive(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(retention) = &self.archive else {
            return;
        };
        if self.archive_ready.load(Relaxed) {
            return;
        }
        match retention.prepare_for_relay(&self.pool, &self.schema).await {
            Ok(()) => self.archive_ready.store(true, Relaxed),
            Err(e) => {
                tracing::warn!(error = %e, "pgbox relay could not prepare the archive's partitions; will retry")
            }
        }
    }

    /// Logs which way the batches go into the built-in queue when it changes (and at the
    /// first round).
    fn note_path(&self, local: bool, same_database: bool, may_insert: bool, queue_schema: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = if local { 1 } else { 2 };
        if self.moving.swap(now, Relaxed) == now {
            return;
        }
        if local {
            tracing::info!(
                queue_schema,
                "pgbox relay moves batches into the built-in queue in its own transactions (same database)"
            );
        } else {
            tracing::info!(
                queue_schema,
                same_database,
                may_insert,
                "pgbox relay publishes into the built-in queue through the queue's pool"
            );
        }
    }

    /// Backs off the topics whose transport was unavailable this round (the relay's backoff
    /// after as many rounds of outage in a row, at least a poll interval), with one line
    /// for the round; ends the outage of a topic the transport answered for again.
    fn note_outages(&self, tally: &Tally<'_>, first_error: Option<&PublishError>) {
        let now = Instant::now();
        let mut outages = self.outages.lock().expect("outages");
        let mut topics = Vec::new();
        let mut retry_in = Duration::ZERO;
        for t in &tally.0 {
            let labels = [("topic", t.topic.to_owned())];
            if t.unavailable > 0 {
                let outage = outages.0.entry(t.topic.to_owned()).or_insert(Outage {
                    rounds: 0,
                    since: now,
                    until: now,
                });
                outage.rounds = outage.rounds.saturating_add(1);
                let delay = self
                    .backoff
                    .delay_after(outage.rounds)
                    .max(self.poll_interval);
                outage.until = now + delay;
                retry_in = retry_in.max(delay);
                metrics::gauge!(telemetry::RELAY_TRANSPORT_UNAVAILABLE, &labels).set(1.0);
                topics.push(t.topic);
            } else if (!t.lags.is_empty() || t.retried > 0 || t.dead_lettered > 0)
                && let Some(outage) = outages.0.remove(t.topic)
            {
                metrics::gauge!(telemetry::RELAY_TRANSPORT_UNAVAILABLE, &labels).set(0.0);
                tracing::info!(
                    topic = t.topic,
                    lasted = ?now.duration_since(outage.since),
                    "pgbox relay: the transport answers again"
                );
            }
        }
        if let Some(error) = first_error {
            tracing::warn!(
                messages = tally.unavailable(),
                ?topics,
                %error,
                next_attempt_in = ?retry_in,
                "pgbox relay: transport unavailable; the messages wait in the outbox \
                 (an outage counts no attempt and dead-letters nothing)"
            );
        }
    }

    async fn publish_in_key_order(
        &self,
        batch: &[Envelope],
    ) -> Vec<Option<Result<(), PublishError>>> {
        publish_in_key_order_within(&*self.publisher, batch, self.publish_timeout).await
    }
}

/// The topics a relay found its transport unavailable for, until it answers again.
#[derive(Debug, Default)]
struct Outages(HashMap<String, Outage>);

#[derive(Debug)]
struct Outage {
    /// Rounds in a row that found the transport unavailable for the topic.
    rounds: u32,
    since: Instant,
    /// The topic is not claimed before this.
    until: Instant,
}

impl Outages {
    /// The topics not to claim now.
    fn current(&self) -> Vec<String> {
        let now = Instant::now();
        self.0
            .iter()
            .filter(|(_, o)| o.until > now)
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// How long until the first of the current outages' backoffs ends.
    fn next_expiry(&self) -> Option<Duration> {
        let now = Instant::now();
        self.0
            .values()
            .filter(|o| o.until > now)
            .map(|o| o.until - now)
            .min()
    }
}

/// Publishes `batch` (in seq order, keyed runs starting at their key's head) so that no
/// message reaches the transport before an earlier message of its key was confirmed.
/// `None`: not attempted, because an earlier message of its key failed.
///
/// A publisher whose batches are atomic and ordered gets the whole batch in one call.
/// Others get waves: the first message of every key (and every unkeyed message), then
/// the second of every key whose first was confirmed, and so on.
///
/// Each call of the publisher is bounded by [`DEFAULT_PUBLISH_TIMEOUT`] (see
/// [`publish_in_key_order_within`]).
pub(crate) async fn publish_in_key_order<P: Publisher>(
    publisher: &P,
    batch: &[Envelope],
) -> Vec<Option<Result<(), PublishError>>> {
    publish_in_key_order_within(publisher, batch, DEFAULT_PUBLISH_TIMEOUT).await
}

/// [`publish_in_key_order`] with each call of the publisher bounded by `limit`: a call that
/// does not answer within it reports its messages unavailable.
pub(crate) async fn publish_in_key_order_within<P: Publisher>(
    publisher: &P,
    batch: &[Envelope],
    limit: Duration,
) -> Vec<Option<Result<(), PublishError>>> {
    let mut results: Vec<Option<Result<(), PublishError>>> = vec![None; batch.len()];
    if publisher.atomic_batches() {
        results = publish_atomic(publisher, batch, limit).await;
    } else {
        // Position of each message within its key's run in this batch.
        let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
        let positions: Vec<usize> = batch
            .iter()
            .map(|m| match &m.ordering_key {
                None => 0,
                Some(k) => {
                    let n = seen.entry((m.topic.as_str(), k.as_str())).or_insert(0);
                    *n += 1;
                    *n - 1
                }
            })
            .collect();
        let waves = positions.iter().copied().max().map_or(0, |m| m + 1);
        let mut failed: HashSet<(&str, &str)> = HashSet::new();
        for wave in 0..waves {
            let members: Vec<usize> = (0..batch.len())
                .filter(|&i| positions[i] == wave)
                .filter(|&i| match &batch[i].ordering_key {
                    None => true,
                    Some(k) => !failed.contains(&(batch[i].topic.as_str(), k.as_str())),
                })
                .collect();
            if members.is_empty() {
                break;
            }
            let envelopes: Vec<Envelope> = members.iter().map(|&i| batch[i].clone()).collect();
            let wave_results = checked_publish(publisher, &envelopes, limit).await;
            for (&i, result) in members.iter().zip(wave_results) {
                if result.is_err()
                    && let Some(k) = &batch[i].ordering_key
                {
                    failed.insert((batch[i].topic.as_str(), k.as_str()));
                }
                results[i] = Some(result);
            }
        }
    }
    // An atomic publisher reports one result for all; still, never let a later message
    // of a key count as published after an earlier one failed.
    let mut failed: HashSet<(&str, &str)> = HashSet::new();
    for (m, slot) in batch.iter().zip(results.iter_mut()) {
        let Some(k) = &m.ordering_key else { continue };
        let key = (m.topic.as_str(), k.as_str());
        if failed.contains(&key) {
            if matches!(slot, Some(Ok(()))) {
                tracing::error!(message_id = %m.id, "pgbox publisher confirmed a message after an earlier one of its key failed; it may arrive out of order");
            }
        } else if matches!(slot, Some(Err(_)) | None) {
            failed.insert(key);
        }
    }
    results
}

/// `batch` through a publisher whose batches are atomic: in one call, and when the
/// transport refuses it, the message at fault is found by halving, so that only that message
/// counts a failed attempt.
///
/// A refused atomic batch published nothing, so its parts can be offered again, in order: a
/// refused part of several messages is halved (its first half first), a refused single
/// message is the one at fault. A message is offered only while no earlier message of its
/// key failed (otherwise `None`: not attempted, nothing counted), so per-key order holds. An
/// outage ends the search: what was not offered yet reports it too (it waits, uncounted).
/// Costs one call when the batch goes through, and about two per halving level (the
/// logarithm of the batch size) per message at fault otherwise.
async fn publish_atomic<P: Publisher>(
    publisher: &P,
    batch: &[Envelope],
    limit: Duration,
) -> Vec<Option<Result<(), PublishError>>> {
    let mut results: Vec<Option<Result<(), PublishError>>> = vec![None; batch.len()];
    let mut failed: HashSet<(&str, &str)> = HashSet::new();
    let mut outage: Option<PublishError> = None;
    // Ranges of `batch` still to offer, the next one last. Bounded: each refused range of
    // several messages is replaced by two with fewer messages each.
    let mut todo: Vec<std::ops::Range<usize>> = std::iter::once(0..batch.len()).collect();
    while let Some(range) = todo.pop() {
        let members: Vec<usize> = range
            .clone()
            .filter(|&i| {
                batch[i]
                    .ordering_key
                    .as_deref()
                    .is_none_or(|k| !failed.contains(&(batch[i].topic.as_str(), k)))
            })
            .collect();
        if members.is_empty() {
            continue;
        }
        if let Some(error) = &outage {
            for &i in &members {
                results[i] = Some(Err(error.clone()));
            }
            continue;
        }
        let got = if members.len() == batch.len() {
            checked_publish(publisher, batch, limit).await
        } else {
            let part: Vec<Envelope> = members.iter().map(|&i| batch[i].clone()).collect();
            checked_publish(publisher, &part, limit).await
        };
        let refused = got
            .iter()
            .any(|r| r.as_ref().is_err_and(|e| !e.is_unavailable()));
        if refused && members.len() > 1 {
            let middle = members[members.len() / 2];
            tracing::debug!(
                messages = members.len(),
                "pgbox publish: an atomic batch was refused; offering its halves to find the message at fault"
            );
            todo.push(middle..range.end);
            todo.push(range.start..middle);
            continue;
        }
        for (&i, result) in members.iter().zip(got) {
            if let Err(error) = &result {
                if let Some(k) = &batch[i].ordering_key {
                    failed.insert((batch[i].topic.as_str(), k.as_str()));
                }
                if error.is_unavailable() {
                    outage.get_or_insert_with(|| error.clone());
                }
            }
            results[i] = Some(result);
        }
    }
    results
}

/// One publisher call, bounded by `limit` (past it, every message is unavailable: the
/// publisher did not answer); a result list of the wrong length fails every message.
async fn checked_publish<P: Publisher>(
    publisher: &P,
    batch: &[Envelope],
    limit: Duration,
) -> Vec<Result<(), PublishError>> {
    let Ok(results) = tokio::time::timeout(limit, publisher.publish(batch)).await else {
        let msg =
            format!("the publisher did not answer within the relay's publish timeout ({limit:?})");
        return vec![Err(PublishError::unavailable(msg)); batch.len()];
    };
    if results.len() == batch.len() {
        return results;
    }
    let msg = format!(
        "publisher returned {} results for {} messages",
        results.len(),
        batch.len()
    );
    vec![Err(PublishError::refused(msg)); batch.len()]
}

/// What a round did per topic, recorded once it commits. A round's topics are few: a linear
/// search beats hashing, and nothing is allocated per message but the lag.
#[derive(Default)]
struct Tally<'a>(Vec<TopicTally<'a>>);

struct TopicTally<'a> {
    topic: &'a str,
    /// Commit→publish lag of each published message, seconds.
    lags: Vec<f64>,
    retried: u64,
    dead_lettered: u64,
    /// Publishes that found the transport unavailable.
    unavailable: u64,
}

impl<'a> Tally<'a> {
    fn unavailable(&self) -> usize {
        self.0.iter().map(|t| t.unavailable as usize).sum()
    }

    fn topic(&mut self, topic: &'a str) -> &mut TopicTally<'a> {
        let i = match self.0.iter().position(|t| t.topic == topic) {
            Some(i) => i,
            None => {
                self.0.push(TopicTally {
                    topic,
                    lags: Vec::new(),
                    retried: 0,
                    dead_lettered: 0,
                    unavailable: 0,
                });
                self.0.len() - 1
            }
        };
        &mut self.0[i]
    }

    fn record(self) {
        for t in self.0 {
            let labels = [("topic", t.topic.to_owned())];
            if !t.lags.is_empty() {
                metrics::counter!(telemetry::RELAY_PUBLISHED, &labels)
                    .increment(t.lags.len() as u64);
                let lag = metrics::histogram!(telemetry::RELAY_PUBLISH_LAG, &labels);
                for seconds in t.lags {
                    lag.record(seconds);
                }
            }
            if t.retried > 0 {
                metrics::counter!(telemetry::RELAY_RETRIED, &labels).increment(t.retried);
            }
            if t.dead_lettered > 0 {
                metrics::counter!(telemetry::RELAY_DEAD_LETTERED, &labels)
                    .increment(t.dead_lettered);
            }
            if t.unavailable > 0 {
                metrics::counter!(telemetry::RELAY_UNAVAILABLE, &labels).increment(t.unavailable);
            }
        }
    }
}

fn decode(row: &PgRow) -> Result<Envelope> {
    Envelope::from_row(row, row.try_get("attempts")?)
}
