//! The WAL relay: publishes what [`OutboxMode::Wal`](crate::OutboxMode::Wal) producers emitted,
//! reading a logical replication slot, and moves the slot only past what the transport
//! confirmed.
//!
//! **Reading.** Two readers ([`WalReader`]), one bookkeeping. The default,
//! [`WalReader::Stream`], is a logical replication connection to the slot
//! (`START_REPLICATION SLOT … LOGICAL`, `pgoutput`, `messages 'true'`; the client is the
//! `pgwire-replication` crate, see the `stream` module): the server decodes each change once,
//! as it is flushed, and sends whole transactions in commit order. The relay tells the server
//! how far the slot may move in its standby status updates (every 100 ms), and that position
//! moves only past whole transactions whose messages are all published or dead-lettered, or,
//! with nothing unsettled, to the `wal_end` of the server's last keepalive (every commit
//! before it was received: the server sends a transaction whole at its commit, in WAL order,
//! and streams only flushed WAL, so a commit written but not yet flushed, as asynchronous
//! commits are for up to 3 × `wal_writer_delay`, lies after it). A message the transport
//! refused is offered again from memory; any error ends the session and the reader's lock
//! session, and the next reign starts from the slot's confirmed position (a failover or a
//! slot made anew never makes it skip what the new slot holds; what this relay settled and
//! the server did not record is read again and passed over). A
//! replication connection that stops carrying bytes without breaking (a dropped NAT flow, a
//! partition without a reset) is given up too
//! ([`WalStreamProblem::Silent`](crate::WalStreamProblem::Silent)): the reader looks at the
//! slot's walsender from its lock session at least once a second while it reads, and ends
//! the session when the server ended that walsender (`wal_sender_timeout`) or, half-open,
//! when the idle server has sent WAL the client has not received for 8 s while the relay
//! was not holding back (see the `stream` module; backpressure is never taken for silence).
//! The reader holds at most `max_in_flight_bytes` of decoded transactions (one larger
//! transaction is taken whole) and the client's queue at most 64 more emits. The client's
//! worker answers keepalives and sends status updates while a publish or an outage backoff
//! takes longer than `wal_sender_timeout`. [`run`](WalRelay::run) keeps the session open;
//! [`relay_once`](WalRelay::relay_once) and [`drain`](WalRelay::drain) open it and end it
//! before they return: they send the confirmed position, end the session after it, and wait
//! (about 2 s at most) until the slot shows that position (`confirmed_flush_lsn`) and is
//! free (free between calls). Past that bound they return anyway and log a warning; the next
//! session then starts from the position the server kept, and what lies after it is offered
//! again (at-least-once). It needs a role with `REPLICATION`, a free walsender (`max_wal_senders`), a direct
//! connection (poolers do not pass the replication protocol); it connects with the pool's
//! TLS settings (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`; the `tls` feature). Each
//! refusal is an [`Error::WalStream`], a TLS failure an [`Error::Tls`].
//!
//! [`WalReader::SqlFunctions`] reads with the SQL slot functions
//! (`pg_logical_slot_peek_binary_changes`) on one dedicated connection: a peek decodes whole
//! transactions, in commit order, up to the batch size and up to the WAL *flush* position
//! taken before it; after the transport confirmed them, `pg_replication_slot_advance` moves
//! the slot past their commits. The slot never moves past what a read returned: a read that
//! found nothing moves it at most to the flush position taken before that read. Every peek
//! decodes from the slot's restart position, which moves only at running-transactions
//! records: after a large backlog each read is slow. It serves where replication connections
//! are not available (a managed service without them, a role without `REPLICATION`).
//!
//! Either way, a crash anywhere re-reads from the last confirmed position: at-least-once,
//! with the message ids of the enqueue, which consumers' inboxes absorb.
//!
//! **One reader.** Relays of one slot elect a reader with a session advisory lock on their
//! dedicated connection; the others wait and try again every poll interval. A reader that dies
//! (SIGKILL, a lost connection) releases the lock with its session; the next one continues
//! from the slot's position. The slot itself also refuses a second concurrent reader; the
//! streaming reader checks its lock session at least every second and opens a replication
//! session only while it holds the lock.
//!
//! **Order.** Messages are published in commit order; a publisher that is not atomic gets them
//! in per-key waves, as the table relay does. The slot moves only past whole transactions whose
//! messages were all confirmed.
//!
//! **Failures.** A message the transport refuses is tried again after the relay's backoff; the
//! later messages of its key wait, and waiting is never counted as an attempt. The messages
//! behind it that the transport confirmed are remembered (by WAL position) until the slot
//! passes them, and this relay does not offer them again: each message is published once by
//! a relay, however often an earlier one is refused. Only a new relay (a restart, a crash,
//! another process taking over the slot) publishes again what the slot had not passed. After
//! `max_attempts` refusals of a message in this relay's life, it is moved to
//! `outbox_dead_letters` (with a negative `seq` that is its WAL position: `i64::MIN` plus the
//! position, so dead letters list in WAL order) and the next messages of its key are offered
//! in the same round: unlike the table relay, a WAL dead letter does not hold back later
//! messages of its key, WAL or table-mode. Content under the schema's prefix that pgbox cannot
//! read is dead-lettered the same way (topic `pgbox.undecodable`), never skipped silently; so
//! is a non-transactional message under the prefix (`pg_logical_emit_message(false, …)`:
//! pgbox emits only in transactions). The relay's bookkeeping of a message (its refusals,
//! whether it is published or dead-lettered already) is by WAL position, not message id: a replayed dead
//! letter is a new message, even while the slot has not passed the original.
//!
//! **Other work in the slot.** A slot decodes the whole database's WAL: other schemas'
//! messages and other applications' logical messages (a CDC tool's non-transactional
//! heartbeats) are passed over, and the slot moves past them, also when a whole read holds
//! nothing else. A slot serves one schema: the first reader records its schema in the comment
//! of the slot's publication, and a relay of another schema is refused with
//! [`Error::WalSlot`] naming both (a relay that does not own the publication cannot record
//! it: it logs a warning and reads on, unclaimed).
//!
//! **Outages.** A transport that is unavailable (cannot be reached, does not answer:
//! [`PublishError::unavailable`](crate::transport::PublishError::unavailable)) is not the
//! message's failure: the round backs off, counts nothing, dead-letters nothing, logs one
//! warning, counts `pgbox_wal_relay_publish_unavailable_total` and reports
//! [`WalRoundReport::unavailable`]; the messages wait in the slot for as long as the outage
//! lasts (the slot retains WAL meanwhile: watch `max_slot_wal_keep_size` and the doctor's
//! retained-WAL check).
//!
//! **Replay.** [`DeadLetters::replay`](crate::DeadLetters::replay) emits WAL dead letters into
//! the WAL again, in their original order, in the replay's transaction: this relay publishes
//! them (no table relay is needed), after whatever of their key it published meanwhile.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection, PgPool, Row};
use time::OffsetDateTime;
use tokio::sync::Mutex;
use tracing::Instrument;

use crate::error::{DbErrorKind, Error, Result};
use crate::ident::{DEFAULT_SCHEMA, Identifier};
use crate::outbox::wal::{self, Decoded};
use crate::outbox::{Envelope, WAL_ASLEEP_LOCK_CLASS};
use crate::relay::WakeUp;
use crate::retry::RetryPolicy;
use crate::telemetry;
use crate::transport::Publisher;

use super::slot::check_wal_level;

#[path = "wal_stream.rs"]
mod stream;
pub use super::slot::{WalSlot, WalSlotStatus};

/// What the lock session sees of the slot's walsender: its pid, its `sent_lsn` (NULL when
/// this role may not read it), and whether it waits idle (for WAL, or in its main loop; the
/// names' case changed in PostgreSQL 17).
const WALSENDER_SAMPLE: &str = "SELECT s.active_pid, r.sent_lsn::text, \
       lower(coalesce(a.wait_event, '')) IN ('walsenderwaitforwal', 'walsendermain') \
     FROM pg_catalog.pg_replication_slots s \
     LEFT JOIN pg_catalog.pg_stat_replication r ON r.pid = s.active_pid \
     LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = s.active_pid \
     WHERE s.slot_name = $1";

/// Reads [`WALSENDER_SAMPLE`] on the reader's lock connection.
async fn walsender_sample(conn: &mut PgConnection, slot: &str) -> Result<stream::WalsenderSample> {
    let row: Option<(Option<i32>, Option<String>, bool)> = sqlx::query_as(WALSENDER_SAMPLE)
        .persistent(false)
        .bind(slot)
        .fetch_optional(&mut *conn)
        .await?;
    let (active_pid, sent, idle) = row.unwrap_or((None, None, false));
    Ok(stream::WalsenderSample {
        active_pid,
        sent_lsn: sent.as_deref().and_then(|t| parse_lsn(t).ok()),
        idle,
    })
}

/// Advisory-lock class of the WAL relay's reader election: `pg_try_advisory_lock(class,
/// hashtext(slot))`.
const READER_LOCK_CLASS: i32 = 0x7062_6f77; // "pbow"

/// How a slot error says that another session reads the slot (SQLSTATE 55006).
const SLOT_IN_USE: &str = "another session reads it";
/// How a replication connection refused for want of a free walsender (SQLSTATE 53300) is
/// reported; often this relay's own previous sessions, not yet exited, hold them.
const NO_FREE_WALSENDER: &str = "no walsender is free";

/// Whether opening a stream failed only because a session that is likely this relay's own
/// earlier one, not yet exited, still holds the slot or a walsender.
fn held_by_an_exiting_session(e: &Error) -> bool {
    match e {
        Error::WalSlot { reason, .. } => reason.starts_with(SLOT_IN_USE),
        Error::WalStream { reason, .. } => reason.starts_with(NO_FREE_WALSENDER),
        _ => false,
    }
}

/// What one [`WalRelay::relay_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalRoundReport {
    /// Messages read from the slot (of this schema).
    pub read: usize,
    /// Published, and the slot moved past them.
    pub published: usize,
    /// Failed; read again next round.
    pub retried: usize,
    /// Moved to `outbox_dead_letters` (refused `max_attempts` times, or unreadable).
    pub dead_lettered: usize,
    /// Not published because the transport was unavailable (could not be reached, did not
    /// answer): an outage. Read again after the backoff; never counted as an attempt, never
    /// dead-lettered.
    pub unavailable: usize,
    /// Whether this relay is the slot's reader (`false`: another relay is; nothing was read).
    pub reader: bool,
}

/// Builder for a [`WalRelay`].
#[derive(Debug)]
pub struct WalRelayBuilder<P> {
    pool: PgPool,
    slot: WalSlot,
    publisher: P,
    schema: String,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    poll_interval: Duration,
    wake_up: WakeUp,
    reader: WalReader,
    max_in_flight_bytes: usize,
    archive: Option<crate::archive::ArchiveRetention>,
}

/// How a [`WalRelay`] reads its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WalReader {
    /// A logical replication connection (`START_REPLICATION … LOGICAL`, `pgoutput`): each
    /// change is decoded once, as it is flushed, and pushed to the relay. Needs a role with
    /// the `REPLICATION` attribute, a `pg_hba.conf` line that admits a replication
    /// connection to the database, a free walsender (`max_wal_senders`), and a direct
    /// connection (a pooler does not pass the replication protocol). TLS as the pool's
    /// settings say (with the `tls` feature).
    #[default]
    Stream,
    /// The SQL slot functions (`pg_logical_slot_peek_binary_changes`,
    /// `pg_replication_slot_advance`) on an ordinary connection: for a server that refuses
    /// replication connections (a managed service without them, a role without
    /// `REPLICATION` but with `pg_use_replication_slots`-style grants).
    /// Every read decodes the slot again from its restart position, which moves only at
    /// running-transactions records: after a large backlog, each read is slow.
    SqlFunctions,
}

impl<P: Publisher> WalRelayBuilder<P> {
    /// How to read the slot (default [`WalReader::Stream`]).
    pub fn reader(mut self, reader: WalReader) -> Self {
        self.reader = reader;
        self
    }

    /// The streaming reader's memory budget: it stops taking decoded transactions from the
    /// replication connection once those it holds unsettled carry this many bytes of message
    /// content (default 32 MiB; a single transaction larger than this is taken whole). The
    /// replication client's queue holds at most 64 more decoded emits.
    pub fn max_in_flight_bytes(mut self, bytes: usize) -> Self {
        self.max_in_flight_bytes = bytes;
        self
    }

    /// Notify-and-poll (default: the reader sleeps under an advisory lock and producers'
    /// emits notify it; needs a direct connection for LISTEN) or poll only.
    pub fn wake_up(mut self, wake_up: WakeUp) -> Self {
        self.wake_up = wake_up;
        self
    }

    /// The pgbox schema whose messages to publish (default `pgbox`): the producers'
    /// [`Outbox`](crate::Outbox) schema. Messages of other schemas in the slot are passed
    /// over, so a slot serves one schema: the first reader records its schema in the
    /// comment of the slot's publication, and a relay of another schema on that slot fails
    /// its rounds with [`Error::WalSlot`] naming both (give each schema its own slot).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The most a round takes at once (default 20,000; whole transactions, so a round may
    /// take more): messages, for the streaming reader; changes decoded per read for the
    /// SQL-function reader (a one-message transaction is three: begin, message, commit),
    /// whose every read decodes the slot from its restart position again, so small reads
    /// cost more per message.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Refusals of one message before it is dead-lettered (default 10). Only a
    /// [refusal](crate::transport::PublishError::refused) counts: neither an outage of the
    /// transport nor waiting behind an earlier message of its key does.
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Delay after a round with a failure (default: 1 s base, doubling, capped at 5 min,
    /// full jitter).
    pub fn backoff(mut self, policy: RetryPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// Archive published messages for `retention` (see [`Archive`](crate::Archive)): after
    /// the transport confirmed a batch and before the slot moves past it, its messages are
    /// inserted into `outbox_archive` in one transaction. A crash between the two publishes
    /// and archives the batch again (replay keeps one copy). The relay records the
    /// retention and creates partitions ahead at its first archiving.
    pub fn archive(mut self, retention: crate::archive::ArchiveRetention) -> Self {
        self.archive = Some(retention);
        self
    }

    /// How often to read the slot when it had nothing (the streaming reader: how long a
    /// round of [`run`](WalRelay::run) waits for the server), and how often a relay that is
    /// not the reader tries to become it (default 100 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<WalRelay<P>> {
        let schema = Identifier::pgbox_schema(&self.schema)?;
        crate::transport::check_call_timeout(&self.publisher, super::DEFAULT_PUBLISH_TIMEOUT)?;
        if self.batch_size == 0 || self.batch_size > 100_000 {
            return Err(Error::InvalidConfig(
                "WAL relay batch size must be 1..=100000".into(),
            ));
        }
        if self.max_attempts < 1 {
            return Err(Error::InvalidConfig(
                "WAL relay max_attempts must be at least 1".into(),
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::InvalidConfig(
                "WAL relay poll interval must be positive".into(),
            ));
        }
        if self.max_in_flight_bytes == 0 {
            return Err(Error::InvalidConfig(
                "WAL relay max_in_flight_bytes must be positive".into(),
            ));
        }
        let dead_letter = format!(
            "INSERT INTO {s}.outbox_dead_letters \
               (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, attempts, last_error) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT DO NOTHING",
            s = schema.quoted()
        );
        Ok(WalRelay {
            pool: self.pool,
            prefix: wal::prefix(schema.as_str()),
            slot: self.slot,
            publisher: Arc::new(self.publisher),
            schema,
            batch_size: self.batch_size,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            poll_interval: self.poll_interval,
            wake_up: self.wake_up,
            kind: self.reader,
            max_in_flight_bytes: self.max_in_flight_bytes,
            archive: self.archive,
            archive_ready: std::sync::atomic::AtomicBool::new(false),
            dead_letter: dead_letter.into(),
            reader: Mutex::new(Reader::default()),
            next_promotion: std::sync::Mutex::new(std::time::Instant::now()),
        })
    }
}

/// The reader's connection (holding the election lock) and what it remembers between rounds.
#[derive(Default)]
struct Reader {
    conn: Option<PgConnection>,
    /// Refusals per message in this relay's life, by WAL position (`seq`): a replayed dead
    /// letter carries its id again, at a new position, and starts afresh.
    attempts: HashMap<i64, i32>,
    /// Messages dead-lettered whose transaction the slot has not passed yet (a message of
    /// another key in it still waits): settled, not offered again when it is read again. By
    /// WAL position, not id: a replay of one of them, read in the same rounds, is a new
    /// message to publish, not a settled one.
    dead: HashSet<i64>,
    /// Messages the transport confirmed whose transaction the slot has not passed yet (a
    /// message of another key in it, or in an earlier transaction, still waits): settled, not
    /// offered again when they are read again, so a refusal does not publish the messages
    /// behind it once more at every retry. By WAL position, as `dead`.
    published: HashSet<i64>,
    /// Consecutive rounds with a failure (for the backoff).
    failing_rounds: u32,
    /// When the retained-WAL gauge was last set.
    retained_checked: Option<std::time::Instant>,
    /// The furthest position this reader moved the slot to.
    advanced_to: u64,
    /// The streaming reader's replication session.
    stream: Option<stream::Stream>,
    /// Consecutive rounds that failed with an error (for the reconnect backoff).
    failed_rounds: u32,
    /// When the streaming reader last found its lock session alive.
    lock_checked: Option<std::time::Instant>,
}

/// How far a round must read before it counts as caught up.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// `run`: read what arrives within a poll interval.
    Continuous,
    /// `relay_once`: up to the flush position at the round's start.
    Now,
    /// `drain`: up to the flush position at the drain's start.
    At(u64),
}

/// Publishes the WAL outbox of one schema from a logical replication slot. Build with
/// [`WalRelay::builder`]; run with [`WalRelay::run`]. See the guide's "The WAL
/// outbox" chapter.
pub struct WalRelay<P> {
    pool: PgPool,
    slot: WalSlot,
    publisher: Arc<P>,
    schema: Identifier,
    prefix: String,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    poll_interval: Duration,
    wake_up: WakeUp,
    kind: WalReader,
    max_in_flight_bytes: usize,
    /// Archiving's settings, when on.
    archive: Option<crate::archive::ArchiveRetention>,
    /// The archive's settings were recorded and its partitions created ahead.
    archive_ready: std::sync::atomic::AtomicBool,
    dead_letter: Arc<str>,
    /// When to look for due scheduled messages next (see [`WalRelay::promote_due`]).
    next_promotion: std::sync::Mutex<std::time::Instant>,
    reader: Mutex<Reader>,
}

impl<P> std::fmt::Debug for WalRelay<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalRelay")
            .field("slot", &self.slot.name())
            .field("schema", &self.schema.as_str())
            .finish_non_exhaustive()
    }
}

/// One decoded transaction of the slot, or one non-transactional logical message (no
/// messages of ours; unreadable if under this schema's prefix).
struct SlotTransaction {
    /// The position just past its commit (or past the non-transactional message's record):
    /// where the slot moves once it is published.
    end_lsn: u64,
    messages: Vec<Envelope>,
    /// Unreadable content under this schema's prefix.
    unreadable: Vec<Unreadable>,
    /// The content bytes of every emit it carried (ours or not).
    content_bytes: usize,
}

impl SlotTransaction {
    /// The bytes of message content it holds (the streaming reader's budget).
    fn content_bytes(&self) -> usize {
        self.content_bytes
    }
}

/// An emit under this schema's prefix that pgbox cannot read: dead-lettered as it is.
struct Unreadable {
    /// Its dead letter's `seq`: its position in the WAL (see [`wal_seq`]).
    seq: i64,
    /// Its dead letter's message id, derived from the position: the same at every read, so
    /// that a re-read after a crash finds the dead letter it already wrote.
    id: uuid::Uuid,
    content: Vec<u8>,
    reason: String,
}

/// What became of a message in a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Not offered yet.
    Pending,
    /// Confirmed by the transport.
    Published,
    /// Moved to the dead letters (now or in an earlier round).
    Dead,
    /// Refused (attempts left) or not taken by an unavailable transport: read again later,
    /// and the rest of its key waits behind it.
    Waiting,
}

/// The (topic, ordering key) a message's order is kept within, if it has a key.
fn key_of(m: &Envelope) -> Option<(&str, &str)> {
    m.ordering_key.as_deref().map(|k| (m.topic.as_str(), k))
}

impl<P: Publisher> WalRelay<P> {
    /// A WAL relay reading `slot` on `pool` (direct connections: the reader holds a session
    /// of its own) and publishing through `publisher`.
    pub fn builder(pool: PgPool, slot: WalSlot, publisher: P) -> WalRelayBuilder<P> {
        WalRelayBuilder {
            pool,
            slot,
            publisher,
            schema: DEFAULT_SCHEMA.into(),
            batch_size: 20_000,
            max_attempts: 10,
            backoff: RetryPolicy::new()
                .base_delay(Duration::from_secs(1))
                .max_delay(Duration::from_secs(300)),
            poll_interval: Duration::from_millis(100),
            wake_up: WakeUp::Notify,
            reader: WalReader::default(),
            max_in_flight_bytes: 32 << 20,
            archive: None,
        }
    }

    /// Runs until `shutdown` is cancelled: reads and publishes while it is the reader, tries
    /// to become it otherwise. Errors are logged and retried after a backoff (the poll
    /// interval, doubling with each failed round up to 10 s: a lost replication session, or
    /// one whose connection went silent, reconnects and resumes from the position this relay
    /// confirmed; a missing or
    /// invalidated slot, or `wal_level` not `logical`, fails every try: they need an
    /// operator); the relay never gives up on its own.
    ///
    /// The streaming reader keeps its replication session open while it runs: commits
    /// arrive as they are flushed, with no polling and no notification needed.
    pub async fn run(&self, shutdown: tokio_util::sync::CancellationToken) -> Result<()> {
        let result = self.run_rounds(shutdown).await;
        self.end_bounded_call().await;
        result
    }

    async fn run_rounds(&self, shutdown: tokio_util::sync::CancellationToken) -> Result<()> {
        let mut listener: Option<PgListener> = None;
        let streaming = self.kind == WalReader::Stream;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let (wait, idle_reader) = match self.round_once(Target::Continuous).await {
                Ok((report, _)) if report.retried > 0 || report.unavailable > 0 => {
                    let rounds = self.reader.lock().await.failing_rounds;
                    (self.backoff.delay_after(rounds), false)
                }
                // The streaming reader waits for the server's next event in its read.
                Ok((report, _)) if streaming && report.reader => (Duration::ZERO, false),
                // Read more at once when this round had messages, or when it did not reach
                // the flush position (a read full of other work's WAL).
                Ok((report, caught_up)) if report.read > 0 || (report.reader && !caught_up) => {
                    (Duration::ZERO, false)
                }
                Ok((report, _)) => (self.sleep_for(), report.reader),
                Err(e) => {
                    let failed = self.reader.lock().await.failed_rounds.clamp(1, 16);
                    let wait = self
                        .poll_interval
                        .saturating_mul(1 << (failed - 1).min(10))
                        .min(Duration::from_secs(10))
                        .max(self.poll_interval);
                    tracing::warn!(slot = self.slot.name(), error = %e, retry_in = ?wait, "pgbox WAL relay round failed; will retry");
                    (wait, false)
                }
            };
            if wait.is_zero() {
                continue;
            }
            // The reader with nothing to read sleeps under the asleep lock, so that producers
            // notify it; everyone else (and a reader without LISTEN) polls.
            if idle_reader && self.wake_up == WakeUp::Notify {
                if listener.is_none() {
                    match crate::listen::listen(&self.pool, &wal::channel(self.schema.as_str()))
                        .await
                    {
                        Ok(l) => listener = Some(l),
                        Err(e) => {
                            tracing::warn!(error = %e, "pgbox WAL relay cannot LISTEN; polling")
                        }
                    }
                }
                if let Some(l) = listener.as_mut() {
                    match self.sleep(l, &shutdown).await {
                        Ok(()) => continue,
                        Err(e) => {
                            tracing::warn!(error = %e, "pgbox WAL relay lost its LISTEN connection; polling");
                            // Dropping the connection releases the asleep lock.
                            listener = None;
                        }
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Emits due scheduled messages into the WAL (each batch's delete and emit in one
    /// transaction: exactly once), when one may be due (or `force`): at most once a poll
    /// interval, or when the earliest scheduled message falls due. They then arrive through
    /// the slot like any message. Returns how many it emitted.
    async fn promote_due(&self, force: bool) -> Result<usize> {
        let now = std::time::Instant::now();
        if !force && *self.next_promotion.lock().expect("next promotion") > now {
            return Ok(0);
        }
        let moved =
            crate::outbox::scheduled::promote_into_wal(&self.pool, &self.schema, self.batch_size)
                .await?;
        let next = now
            + crate::outbox::scheduled::wait_before_next_look(
                &self.pool,
                &crate::outbox::scheduled::next_due_sql(&self.schema),
                true,
                moved,
                self.batch_size,
                self.poll_interval,
            )
            .await?;
        *self.next_promotion.lock().expect("next promotion") = next;
        if moved > 0 {
            tracing::debug!(
                messages = moved,
                "pgbox WAL relay emitted due scheduled messages"
            );
        }
        Ok(moved)
    }

    /// How long to sleep at most: a poll interval, or less when a scheduled message falls
    /// due sooner.
    fn sleep_for(&self) -> Duration {
        let next = *self.next_promotion.lock().expect("next promotion");
        next.saturating_duration_since(std::time::Instant::now())
            .clamp(Duration::from_millis(1), self.poll_interval)
    }

    /// Takes the asleep lock (waiting at most a poll interval for producers in flight, which
    /// hold it shared), reads once more (what committed before it was taken), and then waits
    /// for a producer's notification, the poll interval, or shutdown; releases the lock.
    async fn sleep(
        &self,
        listener: &mut PgListener,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<()> {
        let schema = self.schema.as_str();
        let asleep = crate::listen::take_asleep_lock(
            listener,
            WAL_ASLEEP_LOCK_CLASS,
            schema,
            self.poll_interval,
        )
        .await?;
        if !asleep {
            // Producers stayed in flight for a whole poll interval: just read again.
            return Ok(());
        }
        let recheck = self.round_once(Target::Now).await;
        if matches!(&recheck, Ok((r, true)) if r.read == 0 && r.reader) {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(self.sleep_for()) => {}
                n = listener.try_recv() => {
                    if let Ok(Some(n)) = &n
                        && n.payload() == crate::outbox::scheduled::SCHEDULED_NOTICE
                    {
                        *self.next_promotion.lock().expect("next promotion") = std::time::Instant::now();
                    }
                    if let Ok(Some(_)) = n {
                        tracing::trace!("pgbox WAL relay woken by a producer");
                    }
                }
            }
        }
        crate::listen::release_asleep_lock(listener, WAL_ASLEEP_LOCK_CLASS, schema).await?;
        recheck.map(|_| ())
    }

    /// Publishes until the slot has nothing more of this schema, then returns what it did:
    /// it returns after a round that found nothing of this schema in a read that reached the
    /// flush position taken before it (every message of this schema committed before that
    /// round is published or dead-lettered). A read full of other work's WAL (other
    /// schemas' messages, other applications' logical messages) is not the end: the slot
    /// moves past it and `drain` reads on. Fails if another relay is the reader, or as a
    /// round fails (a replication connection gone silent fails it with
    /// [`WalStreamProblem::Silent`](crate::WalStreamProblem::Silent) within the bounds the
    /// module docs give). Refusals and outages are waited out with the backoff: while the
    /// transport is unavailable, `drain` keeps waiting (bound it with a timeout if it must
    /// return).
    pub async fn drain(&self) -> Result<WalRoundReport> {
        let result = self.drain_rounds().await;
        self.end_bounded_call().await;
        result
    }

    async fn drain_rounds(&self) -> Result<WalRoundReport> {
        // What is due now goes into the WAL before the drain's target is taken.
        while self.promote_due(true).await? >= self.batch_size {}
        let target = match self.kind {
            WalReader::Stream => Target::At(self.flush_position().await?),
            WalReader::SqlFunctions => Target::Now,
        };
        let mut total = WalRoundReport::default();
        loop {
            let (round, caught_up) = self.round_once(target).await?;
            if !round.reader {
                return Err(Error::WalSlot {
                    slot: self.slot.name().to_owned(),
                    reason: "another relay is its reader".into(),
                });
            }
            total.reader = true;
            total.read += round.read;
            total.published += round.published;
            total.retried += round.retried;
            total.dead_lettered += round.dead_lettered;
            total.unavailable += round.unavailable;
            if round.retried > 0 || round.unavailable > 0 {
                let rounds = self.reader.lock().await.failing_rounds;
                tokio::time::sleep(self.backoff.delay_after(rounds)).await;
                continue;
            }
            if round.read == 0 && caught_up {
                return Ok(total);
            }
        }
    }

    /// One round: become the reader if no relay is, read a batch of whole transactions,
    /// publish them, move the slot past the confirmed ones.
    ///
    /// The streaming reader opens its replication session for the call and ends it before
    /// returning, after sending the confirmed position; it waits (about 2 s at most) until
    /// the slot shows that position and is free (free between calls, as with the
    /// SQL-function reader; past the bound it returns anyway and logs a warning, see the
    /// module docs); [`run`](Self::run) keeps the session open.
    pub async fn relay_once(&self) -> Result<WalRoundReport> {
        let result = self.round_once(Target::Now).await.map(|(report, _)| report);
        self.end_bounded_call().await;
        result
    }

    /// With archiving on, once: records the retention and creates partitions ahead (a
    /// failure is logged and tried again; archiving goes on into the default partition).
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
                tracing::warn!(error = %e, "pgbox WAL relay could not prepare the archive's partitions; will retry")
            }
        }
    }

    /// The server's WAL flush position now.
    async fn flush_position(&self) -> Result<u64> {
        let text: String = sqlx::query_scalar("SELECT pg_catalog.pg_current_wal_flush_lsn()::text")
            .persistent(false)
            .fetch_one(&self.pool)
            .await?;
        parse_lsn(&text).map_err(|e| self.protocol_error(e))
    }

    /// After `relay_once` or `drain`: ends the streaming reader's session after sending the
    /// confirmed position, and waits (about 2 s at most) until the slot shows that position
    /// and is free.
    async fn end_bounded_call(&self) {
        let mut reader = self.reader.lock().await;
        self.close_stream(&mut reader).await;
    }

    async fn close_stream(&self, reader: &mut Reader) {
        let Some(stream) = reader.stream.take() else {
            return;
        };
        stream.close(Duration::from_secs(2)).await;
        let Some(conn) = reader.conn.as_mut() else {
            return;
        };
        let confirmed = reader.advanced_to;
        let mut shown = None;
        for _ in 0..200 {
            let row: Option<(bool, Option<String>)> = sqlx::query_as(
                "SELECT active, confirmed_flush_lsn::text \
                 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
            )
            .persistent(false)
            .bind(self.slot.name())
            .fetch_optional(&mut *conn)
            .await
            .unwrap_or(None);
            // Gone, or unreadable: the next call reports it.
            let Some((active, kept)) = row else {
                return;
            };
            let kept = kept.as_deref().and_then(|t| parse_lsn(t).ok()).unwrap_or(0);
            shown = Some(kept);
            if !active && kept >= confirmed {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if let Some(kept) = shown.filter(|&kept| kept < confirmed) {
            tracing::warn!(
                slot = self.slot.name(),
                confirmed = %format_lsn(confirmed),
                kept = %format_lsn(kept),
                "pgbox WAL relay: the server did not show the confirmed position within 2 s; \
                 the next read starts from the position it kept and offers again what lies after it"
            );
        }
    }

    /// [`relay_once`](Self::relay_once), and whether the round's read reached the flush
    /// position taken before it with everything in it settled (nothing of this schema left
    /// up to there).
    async fn round_once(&self, target: Target) -> Result<(WalRoundReport, bool)> {
        self.promote_due(false).await?;
        let span = tracing::debug_span!("pgbox.wal_relay.round", slot = self.slot.name());
        let mut reader = self.reader.lock().await;
        let result = self.round(&mut reader, target).instrument(span).await;
        if result.is_err() {
            // A broken connection (or one whose state is unknown) is not reused: its session,
            // and with it the reader's lock, ends; so does the replication session (the next
            // reign resumes from the slot's confirmed position).
            reader.stream = None;
            if let Some(conn) = reader.conn.take() {
                let _ = conn.close().await;
            }
            reader.failed_rounds = reader.failed_rounds.saturating_add(1);
        } else {
            reader.failed_rounds = 0;
        }
        result
    }

    /// The streaming reader's read: whole transactions received and not yet settled, the
    /// position the slot may move to once they all are (a keepalive's: every commit before
    /// it was received), and whether that reached the round's target.
    async fn read_stream(
        &self,
        reader: &mut Reader,
        target: Target,
    ) -> Result<(Vec<SlotTransaction>, Option<u64>, bool)> {
        let slot = self.slot.name();
        // A round cancelled while it held transactions: they are not in memory any more, so
        // start again from what this reader settled (the server skips what lies before).
        if reader.stream.as_ref().is_some_and(|s| s.taken()) {
            reader.stream = None;
        }
        // The election: the replication session is opened, and kept, only while this relay's
        // lock session lives (the slot itself refuses a second session meanwhile, so a lock
        // lost under a running session is found here, within a second). The same look, from
        // the lock session, tells whether the replication session still carries bytes (see
        // the `stream` module: a silent connection is given up, and the next round
        // reconnects).
        if reader.stream.is_none()
            || reader
                .lock_checked
                .is_none_or(|at| at.elapsed() >= Duration::from_secs(1))
        {
            let conn = reader.conn.as_mut().expect("the reader's connection");
            match reader.stream.as_mut() {
                Some(stream) => {
                    let sample = walsender_sample(conn, slot).await?;
                    stream.check_alive(slot, sample)?;
                }
                None => conn.ping().await?,
            }
            reader.lock_checked = Some(std::time::Instant::now());
        }
        if reader.stream.is_none() {
            // This relay holds the reader's lock, so a session that still has the slot is
            // almost surely this relay's own previous one (a round cancelled, a session
            // ended), whose walsender has not exited yet: wait for it, briefly. The same for
            // walsenders all taken: cancelled sessions of this relay may still hold them.
            let mut tries = 0;
            let mut stream = loop {
                match stream::Stream::open(
                    &self.pool.connect_options(),
                    slot,
                    self.prefix.clone(),
                    reader.advanced_to,
                )
                .await
                {
                    Err(e) if tries < 50 && held_by_an_exiting_session(&e) => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => break other?,
                }
            };
            // The walsender that took the slot for this session.
            let conn = reader.conn.as_mut().expect("the reader's connection");
            stream.check_alive(slot, walsender_sample(conn, slot).await?)?;
            reader.stream = Some(stream);
        }
        let target = match target {
            Target::Continuous => None,
            Target::At(lsn) => Some(lsn),
            Target::Now => Some(self.flush_position().await?),
        };
        let wait = match target {
            // Continuous: at most until a scheduled message falls due.
            None => self.sleep_for(),
            // A bounded call waits for the server to decode up to its target.
            Some(_) => self.poll_interval.max(Duration::from_secs(2)),
        };
        let stream = reader.stream.as_mut().expect("just opened");
        stream
            .read(slot, self.batch_size, self.max_in_flight_bytes, wait, |s| {
                target.is_some_and(|t| s.seen() >= t)
            })
            .await?;
        let transactions = stream.take_pending();
        let seen = stream.seen();
        let reached = target.is_some_and(|t| seen >= t);
        Ok((transactions, (seen > 0).then_some(seen), reached))
    }

    async fn round(&self, reader: &mut Reader, target: Target) -> Result<(WalRoundReport, bool)> {
        let mut report = WalRoundReport::default();
        if reader.conn.is_none() {
            let options = self.pool.connect_options();
            // A refused login or certificate is typed as `connect` types it, not a database
            // error (a rotated password, an expired certificate).
            let mut conn = options
                .connect()
                .await
                .map_err(|e| crate::connect::session_connect_error(&options, e))?;
            check_wal_level(&mut conn).await?;
            let locked: bool = sqlx::query_scalar(
                "SELECT pg_catalog.pg_try_advisory_lock($1, pg_catalog.hashtext($2))",
            )
            .persistent(false)
            .bind(READER_LOCK_CLASS)
            .bind(self.slot.name())
            .fetch_one(&mut conn)
            .await?;
            if !locked {
                let _ = conn.close().await;
                return Ok((report, false));
            }
            // Under the reader's lock: no relay of another schema claims the slot meanwhile.
            if let Err(e) = self.claim(&mut conn).await {
                let _ = conn.close().await;
                return Err(e);
            }
            tracing::info!(
                slot = self.slot.name(),
                "pgbox WAL relay is the slot's reader"
            );
            reader.conn = Some(conn);
            // A session of an earlier reign (the lock was lost meanwhile) is not reused.
            reader.stream = None;
            // A new reign starts from the slot's own position, not from what this relay
            // confirmed in an earlier one: the server may have changed meanwhile (a failover
            // to a standby that had not received it, a slot created anew), and starting past
            // the slot's position would skip what it holds. What this relay already settled
            // is still remembered by position, so reading it again publishes nothing twice.
            reader.advanced_to = 0;
        }
        report.reader = true;
        let slot_label = [("slot", self.slot.name().to_owned())];
        if reader
            .retained_checked
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(5))
        {
            reader.retained_checked = Some(std::time::Instant::now());
            let conn = reader.conn.as_mut().expect("the reader's connection");
            // An invalidated slot has no restart position: no figure then.
            if let Some(status) = self.slot.read_status(conn).await?
                && status.wal_status != "lost"
            {
                metrics::gauge!(telemetry::WAL_SLOT_RETAINED_BYTES, &slot_label)
                    .set(status.retained_bytes as f64);
            }
        }
        let (transactions, covered, reached) = match self.kind {
            WalReader::SqlFunctions => {
                let conn = reader.conn.as_mut().expect("just set");
                let (transactions, covered) = self.read(conn).await?;
                (transactions, covered, covered.is_some())
            }
            WalReader::Stream => self.read_stream(reader, target).await?,
        };
        let Some(last_read) = transactions.last().map(|t| t.end_lsn) else {
            // Nothing of ours commits before `covered` (the flush position before the read,
            // or the streaming server's keepalive position): move the slot there, never
            // further, so that it neither holds other work's WAL nor decodes it again at
            // every read.
            if let Some(lsn) = covered
                && reader.advanced_to < lsn
            {
                self.advance(reader, lsn).await?;
            }
            if let Some(stream) = reader.stream.as_mut() {
                stream.restore(Vec::new(), 0);
            }
            return Ok((report, reached));
        };
        let batch: Vec<&Envelope> = transactions.iter().flat_map(|t| &t.messages).collect();
        report.read = batch.len()
            + transactions
                .iter()
                .map(|t| t.unreadable.len())
                .sum::<usize>();
        // What became of each message this round. A message dead-lettered, or confirmed by the
        // transport, in an earlier round whose transaction the slot has not passed yet is
        // settled already: it is not offered again.
        let mut fates: Vec<Fate> = batch
            .iter()
            .map(|m| {
                if reader.dead.contains(&m.seq) {
                    Fate::Dead
                } else if reader.published.contains(&m.seq) {
                    Fate::Published
                } else {
                    Fate::Pending
                }
            })
            .collect();
        // Keys whose next message must wait for a later round: a message refused (and not yet
        // out of attempts), or not taken because the transport is unavailable.
        let mut held: HashSet<(&str, &str)> = HashSet::new();
        let mut first_refusal: Option<String> = None;
        let mut first_outage: Option<String> = None;
        // Passes: a message dead-lettered in a pass no longer holds its key, so the messages
        // of its key that were not offered behind it are offered in the next pass. Each pass
        // after the first follows a dead letter: at most one pass per message, plus one.
        for _ in 0..=batch.len() {
            let offer: Vec<usize> = (0..batch.len())
                .filter(|&i| {
                    fates[i] == Fate::Pending
                        && !key_of(batch[i]).is_some_and(|k| held.contains(&k))
                })
                .collect();
            if offer.is_empty() {
                break;
            }
            let envelopes: Vec<Envelope> = offer.iter().map(|&i| batch[i].clone()).collect();
            let results = super::publish_in_key_order(&*self.publisher, &envelopes).await;
            let mut died = false;
            for (&i, result) in offer.iter().zip(results) {
                let m = batch[i];
                match result {
                    Some(Ok(())) => {
                        reader.attempts.remove(&m.seq);
                        reader.published.insert(m.seq);
                        fates[i] = Fate::Published;
                    }
                    // An outage is not the message's failure: not counted, never a dead letter.
                    Some(Err(e)) if e.is_unavailable() => {
                        tracing::debug!(message_id = %m.id, error = e.message(), "pgbox WAL publish: transport unavailable");
                        first_outage.get_or_insert_with(|| e.message().to_owned());
                        report.unavailable += 1;
                        fates[i] = Fate::Waiting;
                        held.extend(key_of(m));
                    }
                    Some(Err(e)) => {
                        let attempts = reader.attempts.entry(m.seq).or_insert(0);
                        *attempts += 1;
                        let attempts = *attempts;
                        if attempts >= self.max_attempts {
                            let conn = reader.conn.as_mut().expect("the reader's connection");
                            self.dead_letter_message(conn, m, attempts, e.message())
                                .await?;
                            tracing::error!(message_id = %m.id, attempts, error = e.message(), "pgbox WAL message failed for the last time; dead-lettered");
                            reader.attempts.remove(&m.seq);
                            reader.dead.insert(m.seq);
                            report.dead_lettered += 1;
                            fates[i] = Fate::Dead;
                            died = true;
                        } else {
                            tracing::debug!(message_id = %m.id, attempts, error = e.message(), "pgbox WAL publish refused; will read again");
                            first_refusal.get_or_insert_with(|| e.message().to_owned());
                            report.retried += 1;
                            fates[i] = Fate::Waiting;
                            held.extend(key_of(m));
                        }
                    }
                    // Not offered: an earlier message of its key failed in this pass. Never
                    // an attempt of its own; offered again in a later pass or round.
                    None => {}
                }
            }
            if !died {
                break;
            }
        }
        // The slot moves past the leading transactions whose messages are all published or
        // dead-lettered; the first with a message still waiting, and everything after it,
        // is read again.
        let mut advance_to = None;
        let mut confirmed: Vec<&Envelope> = Vec::new();
        let mut passed = 0;
        let mut offset = 0;
        let mut settled = 0;
        for t in &transactions {
            let fate = &fates[offset..offset + t.messages.len()];
            if fate
                .iter()
                .any(|f| !matches!(f, Fate::Published | Fate::Dead))
            {
                break;
            }
            offset += t.messages.len();
            for (m, f) in t.messages.iter().zip(fate) {
                if *f == Fate::Published {
                    confirmed.push(m);
                }
            }
            for u in &t.unreadable {
                let conn = reader.conn.as_mut().expect("the reader's connection");
                self.dead_letter_unreadable(conn, u).await?;
                report.dead_lettered += 1;
            }
            advance_to = Some(t.end_lsn);
            passed = offset;
            settled += 1;
        }
        // Everything read is settled: the slot may move to `covered` (the flush position
        // before the read, or the streaming server's keepalive position), as after a read
        // that found nothing.
        let all_settled = settled == transactions.len();
        if all_settled {
            advance_to = advance_to.max(covered);
        }
        let caught_up = all_settled && reached;
        report.published = confirmed.len();
        if self.archive.is_some() && !confirmed.is_empty() {
            // Before the slot moves past them: a crash between archives them again after the
            // re-read (replay keeps the first copy); never not at all.
            self.prepare_archive().await;
            crate::archive::archive_envelopes(&self.pool, &self.schema, &confirmed).await?;
        }
        if let Some(lsn) = advance_to {
            self.advance(reader, lsn).await?;
            for m in &batch[..passed] {
                reader.dead.remove(&m.seq);
                reader.published.remove(&m.seq);
            }
        }
        let now = OffsetDateTime::now_utc();
        for m in confirmed {
            let labels = [
                ("slot", self.slot.name().to_owned()),
                ("topic", m.topic.clone()),
            ];
            metrics::counter!(telemetry::WAL_RELAY_PUBLISHED, &labels).increment(1);
            metrics::histogram!(telemetry::WAL_RELAY_PUBLISH_LAG, &labels)
                .record(telemetry::seconds_between(m.created_at, now));
        }
        if report.retried > 0 {
            metrics::counter!(telemetry::WAL_RELAY_RETRIED, &slot_label)
                .increment(report.retried as u64);
        }
        if report.dead_lettered > 0 {
            metrics::counter!(telemetry::WAL_RELAY_DEAD_LETTERED, &slot_label)
                .increment(report.dead_lettered as u64);
        }
        // One line per round, however many messages a failure touched (each message has its
        // debug line above).
        if report.unavailable > 0 {
            metrics::counter!(telemetry::WAL_RELAY_UNAVAILABLE, &slot_label)
                .increment(report.unavailable as u64);
            tracing::warn!(
                slot = self.slot.name(),
                messages = report.unavailable,
                error = first_outage.as_deref().unwrap_or(""),
                "pgbox WAL relay: the transport is unavailable; backing off (an outage: no attempt counted, nothing dead-lettered)"
            );
        }
        if report.retried > 0 {
            tracing::warn!(
                slot = self.slot.name(),
                messages = report.retried,
                error = first_refusal.as_deref().unwrap_or(""),
                "pgbox WAL publish refused; will read again"
            );
        }
        if report.retried > 0 || report.unavailable > 0 {
            reader.failing_rounds += 1;
        } else {
            reader.failing_rounds = 0;
        }
        tracing::debug!(
            read = report.read,
            published = report.published,
            up_to = %format_lsn(advance_to.unwrap_or(last_read)),
            "pgbox WAL relay round"
        );
        if let Some(stream) = reader.stream.as_mut() {
            // What was not settled is offered again from memory, after the backoff.
            let settled_bytes = transactions[..settled]
                .iter()
                .map(SlotTransaction::content_bytes)
                .sum();
            stream.restore(
                transactions.into_iter().skip(settled).collect(),
                settled_bytes,
            );
        }
        Ok((report, caught_up))
    }
    /// Ties the slot to this relay's schema, or refuses it when it is another schema's: a
    /// slot has one position, and a relay passes over (and moves the slot past) the messages
    /// of other schemas, so a second schema's relay on the same slot would find them gone.
    /// The claim is the comment of the slot's publication ([`slot_claim`]), written by the
    /// first reader; a publication that does not exist is left to the read to report.
    async fn claim(&self, conn: &mut PgConnection) -> Result<()> {
        let slot = self.slot.name();
        let comment: Option<Option<String>> = sqlx::query_scalar(
            "SELECT pg_catalog.obj_description(oid, 'pg_publication') \
             FROM pg_catalog.pg_publication WHERE pubname = $1",
        )
        .persistent(false)
        .bind(slot)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(comment) = comment else {
            return Ok(());
        };
        let ours = slot_claim(self.schema.as_str());
        match comment {
            Some(c) if c == ours => Ok(()),
            Some(c) => {
                let reason = match c.strip_prefix(SLOT_CLAIM_PREFIX) {
                    Some(other) => format!(
                        "it is schema {other}'s (its publication's comment says so), and this \
                         relay publishes schema {}: a slot serves one schema (a relay passes \
                         over other schemas' messages, and they would be lost); give each \
                         schema a slot of its own",
                        self.schema.as_str()
                    ),
                    None => format!(
                        "its publication has a comment pgbox did not write ({c:?}); pgbox \
                         records there the one schema that reads the slot (schema {} here): \
                         remove it (COMMENT ON PUBLICATION {} IS NULL) or use another slot",
                        self.schema.as_str(),
                        self.slot.name.quoted()
                    ),
                };
                Err(Error::WalSlot {
                    slot: slot.to_owned(),
                    reason,
                })
            }
            None => {
                // The schema name is a validated identifier: a literal without quoting issues.
                let sql = format!(
                    "COMMENT ON PUBLICATION {} IS '{ours}'",
                    self.slot.name.quoted()
                );
                match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *conn).await {
                    Ok(_) => {
                        tracing::info!(
                            slot,
                            schema = self.schema.as_str(),
                            "pgbox WAL slot claimed for its schema"
                        );
                        Ok(())
                    }
                    Err(e) => {
                        let e = Error::from(e);
                        if e.db_kind() != Some(DbErrorKind::InsufficientPrivilege) {
                            return Err(e);
                        }
                        // Not the publication's owner: read on, unclaimed (as before this
                        // release); a relay run once as the owner claims it.
                        tracing::warn!(slot, schema = self.schema.as_str(), error = %e, "pgbox WAL relay cannot claim its slot for its schema (not the publication's owner); a relay of another schema on this slot would not be refused");
                        Ok(())
                    }
                }
            }
        }
    }

    /// Moves the slot past `lsn` (never backwards: an earlier position is a no-op). The
    /// streaming reader tells the server in its next status update (within 100 ms).
    async fn advance(&self, reader: &mut Reader, lsn: u64) -> Result<()> {
        reader.advanced_to = reader.advanced_to.max(lsn);
        if let Some(stream) = reader.stream.as_mut() {
            stream.confirm(lsn);
            return Ok(());
        }
        let conn = reader.conn.as_mut().expect("the reader's connection");
        sqlx::query("SELECT 1 FROM pg_catalog.pg_replication_slot_advance($1, $2::text::pg_lsn)")
            .persistent(false)
            .bind(self.slot.name())
            .bind(format_lsn(lsn))
            .execute(&mut *conn)
            .await
            .map_err(|e| self.slot_error(e.into()))?;
        Ok(())
    }

    /// Decodes up to a batch of whole transactions from the slot, without consuming them. A
    /// non-transactional logical message is returned as a transaction of its own, ending at
    /// its position (see [`SlotTransaction`]).
    ///
    /// Also returns the WAL position the read covered completely, when it did: every
    /// transaction whose commit record starts before it was returned (fewer changes than the
    /// batch size). Moving the slot there when nothing of ours was in it keeps the slot from
    /// holding the WAL of other work forever, and each read from decoding it again.
    ///
    /// The read is bounded by the *flush* position, taken before it: the slot functions
    /// decode only flushed WAL, and whatever starts before that bound is decoded whole. The
    /// write position (`pg_current_wal_lsn`) can be past a commit that is written but not
    /// flushed (asynchronous commits wait up to 3 × `wal_writer_delay`): a read bounded by it
    /// returns nothing of that commit, and moving the slot to it, however late the advance
    /// arrives (the server clamps it to the flush position *then*), skips the commit for good.
    async fn read(&self, conn: &mut PgConnection) -> Result<(Vec<SlotTransaction>, Option<u64>)> {
        let limit = i32::try_from(self.batch_size).unwrap_or(i32::MAX);
        let rows = sqlx::query(
            "WITH upto AS MATERIALIZED (SELECT pg_catalog.pg_current_wal_flush_lsn() AS lsn) \
             SELECT upto.lsn::text, c.data FROM upto LEFT JOIN LATERAL \
               pg_catalog.pg_logical_slot_peek_binary_changes($1, upto.lsn, $2, \
                 'proto_version', '1', 'publication_names', $1, 'messages', 'true') AS c ON true",
        )
        .persistent(false)
        .bind(self.slot.name())
        .bind(limit)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| self.slot_error(e.into()))?;
        let upto = match rows.first() {
            Some(row) => {
                parse_lsn(&row.try_get::<String, _>(0)?).map_err(|e| self.protocol_error(e))?
            }
            None => return Ok((Vec::new(), None)),
        };
        let changes = rows
            .iter()
            .filter(|r| matches!(r.try_get::<Option<Vec<u8>>, _>(1), Ok(Some(_))))
            .count();
        let covered = (changes < limit as usize).then_some(upto);
        let mut transactions = Vec::new();
        let mut assembler = TxAssembler::new(self.prefix.clone());
        for row in rows {
            let Some(data) = row.try_get::<Option<Vec<u8>>, _>(1)? else {
                continue;
            };
            let done = match pgoutput::parse(&data).map_err(|e| self.protocol_error(e))? {
                pgoutput::Change::Begin { commit_ts } => {
                    assembler.begin_at(commit_ts);
                    None
                }
                pgoutput::Change::Message {
                    lsn,
                    prefix,
                    content,
                } => assembler
                    .message(lsn, prefix, content)
                    .map_err(|e| self.protocol_error(e))?,
                pgoutput::Change::Commit { end_lsn } => assembler.commit(end_lsn),
                pgoutput::Change::Other => None,
            };
            transactions.extend(done);
        }
        Ok((transactions, covered))
    }

    async fn dead_letter_message(
        &self,
        conn: &mut PgConnection,
        m: &Envelope,
        attempts: i32,
        error: &str,
    ) -> Result<()> {
        let inserted = sqlx::query(AssertSqlSafe(self.dead_letter.clone()))
            .persistent(false)
            .bind(m.seq)
            .bind(m.id)
            .bind(&m.topic)
            .bind(&m.ordering_key)
            .bind(&m.payload)
            .bind(&m.content_type)
            .bind(sqlx::types::Json(&m.headers))
            .bind(m.created_at)
            .bind(attempts)
            .bind(error.replace('\0', "\\0"))
            .execute(&mut *conn)
            .await?
            .rows_affected();
        self.check_dead_letter(conn, inserted, m.seq, m.id).await
    }

    /// A dead letter that was not inserted must be the same message's, written by an earlier
    /// read of the same transaction (the relay stopped before the slot moved past it). A
    /// position taken by another message would drop this one silently: refuse instead.
    async fn check_dead_letter(
        &self,
        conn: &mut PgConnection,
        inserted: u64,
        seq: i64,
        id: uuid::Uuid,
    ) -> Result<()> {
        if inserted == 1 {
            return Ok(());
        }
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {}.outbox_dead_letters WHERE message_id = $1)",
            self.schema.quoted()
        );
        let there: bool = sqlx::query_scalar(AssertSqlSafe(sql))
            .persistent(false)
            .bind(id)
            .fetch_one(&mut *conn)
            .await?;
        if there {
            return Ok(());
        }
        Err(Error::WalSlot {
            slot: self.slot.name().to_owned(),
            reason: format!(
                "dead letter seq {seq} of message {id} is taken by another message; nothing \
                 was skipped (the slot stays before it)"
            ),
        })
    }

    async fn dead_letter_unreadable(&self, conn: &mut PgConnection, u: &Unreadable) -> Result<()> {
        let (content, reason) = (&u.content, &u.reason);
        tracing::error!(
            slot = self.slot.name(),
            seq = u.seq,
            reason,
            "pgbox WAL message under this schema's prefix is unreadable; dead-lettered"
        );
        let inserted = sqlx::query(AssertSqlSafe(self.dead_letter.clone()))
            .persistent(false)
            .bind(u.seq)
            .bind(u.id)
            .bind("pgbox.undecodable")
            .bind(None::<String>)
            .bind(content)
            .bind("application/octet-stream")
            .bind(sqlx::types::Json(BTreeMap::<String, String>::new()))
            .bind(OffsetDateTime::now_utc())
            .bind(0i32)
            .bind(format!("unreadable WAL message: {reason}"))
            .execute(&mut *conn)
            .await?
            .rows_affected();
        self.check_dead_letter(conn, inserted, u.seq, u.id).await
    }

    /// A slot-function error in words: missing, invalidated, or read by someone else.
    fn slot_error(&self, e: Error) -> Error {
        let slot = self.slot.name().to_owned();
        let Error::Database { source, .. } = &e else {
            return e;
        };
        let Some(db) = source.as_database_error() else {
            return e;
        };
        let message = db.message().to_owned();
        match db.code().as_deref() {
            Some("42704") => Error::WalSlot {
                slot,
                reason: format!(
                    "it does not exist ({message}); create it with WalSlot::create or `pgbox wal create-slot`"
                ),
            },
            Some("55006") => Error::WalSlot {
                slot,
                reason: format!("{SLOT_IN_USE} ({message})"),
            },
            Some("55000")
                if message.contains("can no longer get changes")
                    // PostgreSQL 18: "can no longer access replication slot".
                    || message.contains("can no longer access")
                    || message.contains("invalidated") =>
            {
                Error::WalSlot {
                    slot,
                    reason: format!(
                        "it was invalidated ({message}): the WAL it needed was removed \
                         (max_slot_wal_keep_size), and the messages in it are lost; drop and \
                         create the slot, and reconcile what producers committed since its \
                         last confirmed position"
                    ),
                }
            }
            _ if e.db_kind() == Some(DbErrorKind::Other)
                && message.contains("replication slot") =>
            {
                Error::WalSlot {
                    slot,
                    reason: message,
                }
            }
            _ => e,
        }
    }

    fn protocol_error(&self, reason: String) -> Error {
        Error::WalSlot {
            slot: self.slot.name().to_owned(),
            reason: format!("unexpected pgoutput data: {reason}"),
        }
    }
}

/// Builds [`SlotTransaction`]s from decoded changes in the order pgoutput sends them (both
/// readers): begin, the transaction's logical messages, commit; a logical message outside a
/// transaction is a transaction of its own.
struct TxAssembler {
    /// This schema's prefix: messages under it are ours.
    prefix: String,
    current: Option<(OffsetDateTime, SlotTransaction)>,
}

impl TxAssembler {
    fn new(prefix: String) -> Self {
        TxAssembler {
            prefix,
            current: None,
        }
    }

    /// Whether a transaction's begin was read and its commit not yet.
    fn in_transaction(&self) -> bool {
        self.current.is_some()
    }

    fn begin_at(&mut self, commit_ts: OffsetDateTime) {
        self.current = Some((
            commit_ts,
            SlotTransaction {
                end_lsn: 0,
                messages: Vec::new(),
                unreadable: Vec::new(),
                content_bytes: 0,
            },
        ));
    }

    /// A begin whose commit time is in microseconds since 2000-01-01.
    fn begin(&mut self, commit_micros: i64) -> std::result::Result<(), String> {
        let micros = commit_micros.saturating_add(pgoutput::PG_EPOCH_MICROS);
        let commit_ts = OffsetDateTime::from_unix_timestamp_nanos(i128::from(micros) * 1000)
            .map_err(|e| e.to_string())?;
        self.begin_at(commit_ts);
        Ok(())
    }

    /// A logical message at `lsn` (the end of its record). Returns the transaction of its own
    /// that a non-transactional message is.
    fn message(
        &mut self,
        lsn: u64,
        prefix: &str,
        content: &[u8],
    ) -> std::result::Result<Option<SlotTransaction>, String> {
        let Some((commit_ts, t)) = self.current.as_mut() else {
            // A non-transactional message (`pg_logical_emit_message(false, …)`), decoded
            // where it was written, between the transactions that commit before and after
            // it: the slot moves past it as past a transaction (a read full of them still
            // moves the slot). pgbox emits only in transactions: one under this schema's
            // prefix is unreadable.
            let mut t = SlotTransaction {
                end_lsn: lsn,
                messages: Vec::new(),
                unreadable: Vec::new(),
                content_bytes: content.len(),
            };
            if prefix == self.prefix {
                let seq = wal_seq(lsn, content.len(), 0)?;
                t.unreadable.push(Unreadable {
                    seq,
                    id: unreadable_id(seq),
                    content: content.to_vec(),
                    reason: "a non-transactional message (pgbox emits only in transactions)".into(),
                });
            }
            return Ok(Some(t));
        };
        t.content_bytes += content.len();
        if prefix != self.prefix {
            return Ok(None);
        }
        match wal::decode(content) {
            Ok(decoded) => {
                for (i, d) in decoded.into_iter().enumerate() {
                    let seq = wal_seq(lsn, content.len(), i)?;
                    t.messages.push(envelope(d, seq, *commit_ts));
                }
            }
            Err(reason) => {
                let seq = wal_seq(lsn, content.len(), 0)?;
                t.unreadable.push(Unreadable {
                    seq,
                    id: unreadable_id(seq),
                    content: content.to_vec(),
                    reason,
                });
            }
        }
        Ok(None)
    }

    /// The commit of the current transaction, ending at `end_lsn`.
    fn commit(&mut self, end_lsn: u64) -> Option<SlotTransaction> {
        let (_, mut t) = self.current.take()?;
        t.end_lsn = end_lsn;
        Some(t)
    }
}

/// How the comment of a slot's publication names the schema whose relay reads it.
const SLOT_CLAIM_PREFIX: &str = "pgbox WAL outbox of schema ";

/// The comment of the publication of a slot that `schema`'s relay reads (schema names are
/// validated identifiers: no quote to escape). [`DeadLetters::replay`](crate::DeadLetters)
/// looks for a live slot unclaimed or claimed by its schema.
pub(crate) fn slot_claim(schema: &str) -> String {
    format!("{SLOT_CLAIM_PREFIX}{schema}")
}

/// WAL outbox `seq`s are below this: `i64::MIN` plus a WAL position under 2⁶². (Earlier
/// releases wrote minus the position times 1,024 minus the index modulo 1,024: between this
/// and 0, later messages lower.)
pub(crate) const WAL_SEQ_CEILING: i64 = i64::MIN / 2;

/// The `seq` of the `index`th message of the emit whose WAL record ends at `end_lsn` (the
/// position pgoutput reports for a logical-decoding message) and carries `content_len` bytes:
/// `i64::MIN` plus the position `end_lsn - content_len + index`.
///
/// Injective, and increasing in WAL order: the record holds its content, so the positions
/// `end_lsn - content_len ..= end_lsn` lie inside it (past its start, which the record's
/// header precedes), and records do not overlap. An emit of `count` messages carries at
/// least 33 bytes per message, so every index fits. An unreadable emit takes index 0.
/// Negative, below [`WAL_SEQ_CEILING`], so it never meets a table outbox `seq` (an
/// identity, from 1). Fails, rather than wraps, past 2⁶² (4 EiB of WAL).
fn wal_seq(end_lsn: u64, content_len: usize, index: usize) -> std::result::Result<i64, String> {
    let content_len = content_len as u64;
    let index = index as u64;
    let position = end_lsn
        .checked_sub(content_len)
        .filter(|_| index <= content_len)
        .and_then(|start| start.checked_add(index))
        .filter(|&p| p < 1 << 62)
        .ok_or_else(|| {
            format!(
                "message {index} of an emit of {content_len} bytes ending at {} has no position",
                format_lsn(end_lsn)
            )
        })?;
    Ok(i64::MIN + position as i64)
}

/// The message id of an unreadable emit's dead letter: a UUID (version 8) carrying its
/// position, the same at every read.
fn unreadable_id(seq: i64) -> uuid::Uuid {
    let p = seq.wrapping_sub(i64::MIN) as u64;
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&(p >> 16).to_be_bytes()[2..]);
    b[6] = 0x80 | ((p >> 12) & 0x0f) as u8;
    b[7] = (p >> 4) as u8;
    b[8] = 0x80 | (p & 0x0f) as u8;
    b[9..].copy_from_slice(b"pgbxwal");
    uuid::Uuid::from_bytes(b)
}

/// The envelope of a message read from the WAL at `seq` (see [`wal_seq`]).
fn envelope(d: Decoded, seq: i64, commit_ts: OffsetDateTime) -> Envelope {
    let mut e = Envelope::new(d.id, d.topic, d.payload);
    e.seq = seq;
    e.ordering_key = d.ordering_key;
    e.content_type = d.content_type;
    e.headers = d.headers;
    e.created_at = commit_ts;
    e
}

/// The commit time a pgoutput Begin message carries, `None` for any other change (the
/// doctor's age of a slot's oldest unpublished commit).
pub(crate) fn begin_commit_time(data: &[u8]) -> Option<OffsetDateTime> {
    match pgoutput::parse(data) {
        Ok(pgoutput::Change::Begin { commit_ts }) => Some(commit_ts),
        _ => None,
    }
}

fn parse_lsn(text: &str) -> std::result::Result<u64, String> {
    let (high, low) = text
        .split_once('/')
        .ok_or_else(|| format!("not an LSN: {text:?}"))?;
    let high = u64::from_str_radix(high, 16).map_err(|e| e.to_string())?;
    let low = u64::from_str_radix(low, 16).map_err(|e| e.to_string())?;
    Ok((high << 32) | low)
}

fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// The pgoutput (protocol version 1) messages the WAL relay reads: begin, commit, and
/// logical-decoding messages. A publication with no tables sends nothing else.
mod pgoutput {
    use time::OffsetDateTime;

    pub(super) enum Change<'a> {
        Begin {
            commit_ts: OffsetDateTime,
        },
        Message {
            lsn: u64,
            prefix: &'a str,
            content: &'a [u8],
        },
        Commit {
            end_lsn: u64,
        },
        Other,
    }

    /// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
    pub(super) const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

    pub(super) fn parse(data: &[u8]) -> Result<Change<'_>, String> {
        let (&kind, rest) = data.split_first().ok_or("an empty change")?;
        let mut r = rest;
        match kind {
            b'B' => {
                let _final_lsn = u64_be(&mut r)?;
                let ts = u64_be(&mut r)? as i64;
                let micros = ts.saturating_add(PG_EPOCH_MICROS);
                let commit_ts =
                    OffsetDateTime::from_unix_timestamp_nanos(i128::from(micros) * 1000)
                        .map_err(|e| e.to_string())?;
                Ok(Change::Begin { commit_ts })
            }
            b'M' => {
                let _flags = take(&mut r, 1)?;
                let lsn = u64_be(&mut r)?;
                let end = r
                    .iter()
                    .position(|&b| b == 0)
                    .ok_or("an unterminated prefix")?;
                let prefix = std::str::from_utf8(&r[..end]).map_err(|e| e.to_string())?;
                r = &r[end + 1..];
                let len =
                    u32::from_be_bytes(take(&mut r, 4)?.try_into().expect("4 bytes")) as usize;
                let content = take(&mut r, len)?;
                Ok(Change::Message {
                    lsn,
                    prefix,
                    content,
                })
            }
            b'C' => {
                let _flags = take(&mut r, 1)?;
                let _commit_lsn = u64_be(&mut r)?;
                let end_lsn = u64_be(&mut r)?;
                Ok(Change::Commit { end_lsn })
            }
            _ => Ok(Change::Other),
        }
    }

    fn take<'a>(r: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
        if r.len() < n {
            return Err(format!(
                "truncated change: {n} bytes needed, {} left",
                r.len()
            ));
        }
        let (head, tail) = r.split_at(n);
        *r = tail;
        Ok(head)
    }

    fn u64_be(r: &mut &[u8]) -> Result<u64, String> {
        Ok(u64::from_be_bytes(take(r, 8)?.try_into().expect("8 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::Message;

    /// A tiny deterministic generator (xorshift64*): generated cases without a dependency.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// The smallest message the format can carry: what bounds an emit's count by its size.
    fn smallest() -> Message {
        let mut m = Message::bytes("", Vec::new());
        m.content_type = String::new();
        m
    }

    #[test]
    fn an_emit_carries_at_least_33_bytes_per_message() {
        for n in [1usize, 2, 1023, 1024, 1025, 5000] {
            let messages = vec![smallest(); n];
            assert!(wal::encode(&messages).len() >= 9 + 33 * n, "{n}");
        }
    }

    /// Emits of every size across 1,024 and beyond, readable and not, laid out as WAL records
    /// (header, prefix, content, page headers, alignment) from LSNs near the boundaries: every
    /// `seq` is distinct, increases in WAL order, stays below the ceiling; past 2⁶² the
    /// derivation fails instead of wrapping.
    #[test]
    fn wal_seqs_are_injective_and_in_wal_order_across_batch_sizes_and_lsn_boundaries() {
        let sizes = [1usize, 2, 1023, 1024, 1025, 2048, 5000];
        let starts = [
            0x28u64,
            0xFFFF_0000,
            0xFFFF_FFFF - 40,
            0x1_0000_0000,
            0x7FFF_FFFF_FFFF,
            (1 << 62) - 400_000,
        ];
        let mut g = Gen(0x9E37_79B9_7F4A_7C15);
        for &start in &starts {
            for round in 0..20 {
                let mut lsn = start + g.below(64);
                let mut seen: Vec<i64> = Vec::new();
                let mut overflowed = false;
                for _ in 0..12 {
                    let unreadable = g.below(5) == 0;
                    let count = if unreadable {
                        0
                    } else if round % 2 == 0 {
                        sizes[g.below(sizes.len() as u64) as usize]
                    } else {
                        1 + g.below(3000) as usize
                    };
                    let content_len = if unreadable {
                        g.below(100) as usize
                    } else {
                        9 + 33 * count + g.below(5000) as usize
                    };
                    // Record header (24) + logical message header (~16) + prefix + content,
                    // maybe a page header or two, aligned to 8.
                    let size = 24 + 16 + 13 + content_len as u64 + 24 * g.below(3);
                    let end = lsn + size;
                    let indexes: Vec<usize> = if unreadable {
                        vec![0]
                    } else {
                        (0..count).collect()
                    };
                    for i in indexes {
                        match wal_seq(end, content_len, i) {
                            Ok(seq) => {
                                assert!(seq < WAL_SEQ_CEILING, "{seq}");
                                let position = seq.wrapping_sub(i64::MIN) as u64;
                                assert!(position > lsn && position <= end, "inside its record");
                                if let Some(&last) = seen.last() {
                                    assert!(seq > last, "in WAL order: {last} then {seq}");
                                }
                                seen.push(seq);
                            }
                            Err(e) => {
                                assert!(end - content_len as u64 + i as u64 >= 1 << 62, "{e}");
                                overflowed = true;
                            }
                        }
                    }
                    lsn = (end + 7) & !7;
                }
                let distinct: HashSet<i64> = seen.iter().copied().collect();
                assert_eq!(distinct.len(), seen.len());
                if start < 1 << 40 {
                    assert!(!overflowed);
                }
            }
        }
        // An index beyond the content (a malformed count) has no position, and neither has an
        // emit longer than the WAL before it.
        assert!(wal_seq(1000, 10, 11).is_err());
        assert!(wal_seq(10, 11, 0).is_err());
        assert!(wal_seq(u64::MAX, 0, 0).is_err());
    }

    /// The earlier derivation (minus the position times 1,024 minus the index modulo 1,024)
    /// gave messages i and i + 1,024 of one emit one `seq`; this one gives each its own.
    #[test]
    fn messages_1024_apart_in_one_emit_have_different_seqs() {
        let content_len = 9 + 40 * 1500;
        let end = 0x15C_78E8 + content_len as u64 + 64;
        let seqs: HashSet<i64> = (0..1500)
            .map(|i| wal_seq(end, content_len, i).unwrap())
            .collect();
        assert_eq!(seqs.len(), 1500);
    }

    #[test]
    fn unreadable_ids_are_distinct_version_8_uuids() {
        let mut g = Gen(7);
        let mut ids = HashSet::new();
        for p in (0..2000u64).chain((0..2000).map(|_| g.below(1 << 62))) {
            let id = unreadable_id(i64::MIN + p as i64);
            assert_eq!(id.get_version_num(), 8);
            assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
            assert_eq!(
                unreadable_id(i64::MIN + p as i64),
                id,
                "the same at every read"
            );
            ids.insert((p, id));
        }
        let distinct: HashSet<uuid::Uuid> = ids.iter().map(|(_, id)| *id).collect();
        let positions: HashSet<u64> = ids.iter().map(|(p, _)| *p).collect();
        assert_eq!(distinct.len(), positions.len());
    }
}
