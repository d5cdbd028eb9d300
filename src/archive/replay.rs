//! Replay: archived messages enqueued into the outbox again, through the normal relay path.

use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, Row};
use time::OffsetDateTime;
use uuid::Uuid;

use super::Archive;
use crate::error::{Error, Result};
use crate::outbox::{ASLEEP_LOCK_CLASS, MAX_TOPIC_BYTES, Message, Outbox, key_locks_sql, wake_sql};
use crate::{MAX_HEADER_NAME_BYTES, OutboxMode};

/// The header every replayed message carries: the replay's id (a UUID), so a handler can tell
/// a replay from the first delivery.
pub const REPLAY_ID_HEADER: &str = "pgbox-replay-id";

/// Where a replay stopped: every selected message archived at or before this position was
/// replayed. Give it to [`Replay::resume_after`] to go on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplayCursor(pub i64);

/// What [`Replay::run`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The replay's id, in every replayed message's [`REPLAY_ID_HEADER`].
    pub replay_id: Uuid,
    /// Messages enqueued into the outbox.
    pub replayed: u64,
    /// Messages selected but not enqueued: their id is still pending in the outbox (kept ids
    /// only; they will be published by the relay anyway).
    pub skipped: u64,
    /// Chunks (transactions) committed.
    pub chunks: u64,
    /// Where it stopped; `None` if nothing was selected.
    pub cursor: Option<ReplayCursor>,
    /// Whether every selected message up to the archive's end (as of the start) was
    /// replayed; `false` when [`Replay::max_messages`] stopped it first.
    pub complete: bool,
}

/// A replay of archived messages into the outbox, built by [`Archive::replay`].
///
/// Selected by topic, ordering key, type (a header) and archive time (the publish time); the
/// messages are enqueued in archive order, which keeps each ordering key's order, in chunks
/// of [`batch_size`](Self::batch_size), each its own transaction: a failure leaves the
/// chunks before it committed, and the report (or the error's log) says where to resume.
/// The replay reads the archive up to its end as of the start: messages archived meanwhile
/// (the replayed ones among them, once published) are not replayed again.
///
/// By default a replayed message keeps its id: a consumer's inbox that processed it answers
/// Duplicate (inbox-safe). [`new_ids`](Self::new_ids) gives fresh UUIDv7 ids, to have them
/// processed again. Either way each carries [`REPLAY_ID_HEADER`]. A message the WAL relay
/// archived twice (a crash between its publish and the slot's advance) is replayed once.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// use time::macros::datetime;
/// let report = pgbox::Archive::new(pool)
///     .replay()
///     .topic("payments")
///     .since(datetime!(2026-11-01 00:00 UTC))
///     .rate(5_000)
///     .run()
///     .await?;
/// println!("{} replayed, resume after {:?}", report.replayed, report.cursor);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Replay {
    archive: Archive,
    topic: Option<String>,
    key: Option<String>,
    type_header: String,
    message_type: Option<String>,
    since: Option<OffsetDateTime>,
    until: Option<OffsetDateTime>,
    new_ids: bool,
    rate: Option<u32>,
    batch_size: usize,
    after: ReplayCursor,
    max_messages: Option<u64>,
    mode: OutboxMode,
    replay_id: Uuid,
}

impl Replay {
    /// The header [`message_type`](Self::message_type) reads unless told otherwise
    /// ([`type_header`](Self::type_header)).
    pub const DEFAULT_TYPE_HEADER: &str = "type";

    /// Chunk size unless told otherwise.
    pub const DEFAULT_BATCH_SIZE: usize = 1_000;

    /// The largest chunk accepted.
    pub const MAX_BATCH_SIZE: usize = 10_000;

    pub(super) fn new(archive: Archive) -> Self {
        Replay {
            archive,
            topic: None,
            key: None,
            type_header: Self::DEFAULT_TYPE_HEADER.to_owned(),
            message_type: None,
            since: None,
            until: None,
            new_ids: false,
            rate: None,
            batch_size: Self::DEFAULT_BATCH_SIZE,
            after: ReplayCursor(0),
            max_messages: None,
            mode: OutboxMode::Table,
            replay_id: Uuid::now_v7(),
        }
    }

    /// Only messages of this topic. A topic the archive holds no message of is refused
    /// ([`Error::InvalidField`]): a typo would otherwise replay nothing, silently.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// Only messages with this ordering key.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Only messages whose type header ([`type_header`](Self::type_header), default
    /// [`DEFAULT_TYPE_HEADER`](Self::DEFAULT_TYPE_HEADER)) has this value.
    pub fn message_type(mut self, value: impl Into<String>) -> Self {
        self.message_type = Some(value.into());
        self
    }

    /// The header [`message_type`](Self::message_type) reads (e.g. a CloudEvents type
    /// header).
    pub fn type_header(mut self, name: impl Into<String>) -> Self {
        self.type_header = name.into();
        self
    }

    /// Only messages archived (published) at or after this time.
    pub fn since(mut self, at: OffsetDateTime) -> Self {
        self.since = Some(at);
        self
    }

    /// Only messages archived (published) before this time.
    pub fn until(mut self, at: OffsetDateTime) -> Self {
        self.until = Some(at);
        self
    }

    /// Fresh UUIDv7 ids instead of the archived ones (default `false`: ids kept, so the
    /// consumers' inboxes answer Duplicate). With `true` the messages are processed again.
    pub fn new_ids(mut self, fresh: bool) -> Self {
        self.new_ids = fresh;
        self
    }

    /// At most this many messages per second on average (default: as fast as the database
    /// takes them): chunks of at most a tenth of a second's worth, each started no earlier
    /// than the rate allows since the replay's start.
    pub fn rate(mut self, per_second: u32) -> Self {
        self.rate = Some(per_second);
        self
    }

    /// Messages per chunk, each chunk one transaction (default
    /// [`DEFAULT_BATCH_SIZE`](Self::DEFAULT_BATCH_SIZE)).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Goes on after `cursor` (a previous report's [`ReplayReport::cursor`]). Keep the
    /// replay id with [`replay_id`](Self::replay_id) to mark the messages as one replay.
    pub fn resume_after(mut self, cursor: ReplayCursor) -> Self {
        self.after = cursor;
        self
    }

    /// Stops after this many messages selected (the report is then not `complete`, unless no
    /// selected message was left).
    pub fn max_messages(mut self, n: u64) -> Self {
        self.max_messages = Some(n);
        self
    }

    /// Where the replayed messages go: the outbox table (default) or, for a WAL outbox,
    /// logical-decoding messages ([`OutboxMode::Wal`]).
    pub fn mode(mut self, mode: OutboxMode) -> Self {
        self.mode = mode;
        self
    }

    /// The replay's id (default: a fresh UUIDv7).
    pub fn replay_id(mut self, id: Uuid) -> Self {
        self.replay_id = id;
        self
    }

    /// The replay's id.
    pub fn id(&self) -> Uuid {
        self.replay_id
    }

    fn validate(&self) -> Result<()> {
        let text = |field: &'static str, v: &Option<String>, max: usize| -> Result<()> {
            if let Some(v) = v {
                if v.is_empty() {
                    return Err(Error::InvalidField {
                        field,
                        reason: "is empty",
                    });
                }
                if v.len() > max {
                    return Err(Error::InvalidField {
                        field,
                        reason: "is too long",
                    });
                }
                if v.contains('\0') {
                    return Err(Error::InvalidField {
                        field,
                        reason: "contains NUL",
                    });
                }
            }
            Ok(())
        };
        text("replay topic", &self.topic, MAX_TOPIC_BYTES)?;
        text("replay ordering key", &self.key, crate::MAX_KEY_BYTES)?;
        text("replay type", &self.message_type, 64 * 1024)?;
        let h = &self.type_header;
        if h.is_empty()
            || h.len() > MAX_HEADER_NAME_BYTES
            || h.chars()
                .any(|c| c.is_control() || c.is_whitespace() || c == ':')
        {
            return Err(Error::InvalidField {
                field: "replay type header",
                reason: "must be 1 to 255 bytes, without control characters, whitespace or ':'",
            });
        }
        if let (Some(since), Some(until)) = (self.since, self.until)
            && since >= until
        {
            return Err(Error::InvalidConfig(format!(
                "replay since {since} is not before until {until}"
            )));
        }
        if self.batch_size == 0 || self.batch_size > Self::MAX_BATCH_SIZE {
            return Err(Error::InvalidConfig(format!(
                "replay batch size must be 1..={}",
                Self::MAX_BATCH_SIZE
            )));
        }
        if self.rate == Some(0) {
            return Err(Error::InvalidConfig("replay rate must be positive".into()));
        }
        Ok(())
    }

    /// The filter over `outbox_archive AS a`, `$1` cursor, `$2` end, `$3` topic, `$4` key,
    /// `$5` type header, `$6` type, `$7` since, `$8` until. A WAL message archived twice is
    /// selected at its first copy only (table-relay rows, `source_seq` set, are never
    /// archived twice and skip the look-up).
    fn filter(&self) -> String {
        let s = self.archive.schema_identifier().quoted();
        format!(
            "a.seq > $1 AND a.seq <= $2 \
             AND ($3::text IS NULL OR a.topic = $3) \
             AND ($4::text IS NULL OR a.ordering_key = $4) \
             AND ($6::text IS NULL OR a.headers ->> $5::text = $6) \
             AND ($7::timestamptz IS NULL OR a.archived_at >= $7) \
             AND ($8::timestamptz IS NULL OR a.archived_at < $8) \
             AND (a.source_seq IS NOT NULL OR NOT EXISTS (SELECT 1 FROM {s}.outbox_archive AS b \
                  WHERE b.message_id = a.message_id AND b.source_seq IS NULL AND b.seq < a.seq))"
        )
    }

    fn bind<'q>(
        &'q self,
        q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        after: i64,
        end: i64,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        q.bind(after)
            .bind(end)
            .bind(self.topic.as_deref())
            .bind(self.key.as_deref())
            .bind(self.type_header.as_str())
            .bind(self.message_type.as_deref())
            .bind(self.since)
            .bind(self.until)
    }

    /// Validates, checks the topic is known, and reads the archive's end.
    async fn prepare(&self) -> Result<i64> {
        self.validate()?;
        let s = self.archive.schema_identifier().quoted();
        let pool = self.archive.pool();
        if let Some(topic) = &self.topic {
            let known: bool = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT EXISTS (SELECT 1 FROM {s}.outbox_archive WHERE topic = $1)"
            )))
            .bind(topic)
            .fetch_one(pool)
            .await?;
            if !known {
                return Err(Error::InvalidField {
                    field: "replay topic",
                    reason: "no archived message has this topic",
                });
            }
        }
        let end: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT pg_catalog.max(seq) FROM {s}.outbox_archive"
        )))
        .fetch_one(pool)
        .await?;
        Ok(end.unwrap_or(0))
    }

    /// Dry run: how many messages [`run`](Self::run) would select (at most
    /// [`max_messages`](Self::max_messages)). Enqueues nothing.
    pub async fn count(&self) -> Result<u64> {
        let end = self.prepare().await?;
        let s = self.archive.schema_identifier().quoted();
        let sql = format!(
            "SELECT pg_catalog.count(*) FROM {s}.outbox_archive AS a WHERE {}",
            self.filter()
        );
        let n: i64 = self
            .bind(sqlx::query(AssertSqlSafe(sql)), self.after.0, end)
            .fetch_one(self.archive.pool())
            .await?
            .try_get(0)?;
        let n = n.max(0) as u64;
        Ok(self.max_messages.map_or(n, |m| n.min(m)))
    }

    /// Enqueues the selected messages into the outbox, chunk by chunk, each chunk its own
    /// transaction, paced to [`rate`](Self::rate). Returns what it did and where it stopped.
    pub async fn run(&self) -> Result<ReplayReport> {
        let end = self.prepare().await?;
        let mut report = ReplayReport {
            replay_id: self.replay_id,
            replayed: 0,
            skipped: 0,
            chunks: 0,
            cursor: None,
            complete: false,
        };
        let mut after = self.after.0;
        let started = Instant::now();
        let mut selected: u64 = 0;
        // Bounded: each chunk advances the cursor past at least one archive row, and the
        // cursor never passes `end`.
        loop {
            let mut limit = self.batch_size as u64;
            if let Some(rate) = self.rate {
                // A tenth of a second's worth per chunk: bursts stay small.
                limit = limit.min((u64::from(rate) / 10).max(1));
            }
            if let Some(max) = self.max_messages {
                if selected >= max {
                    // Complete if nothing selected is left (max_messages exactly what was
                    // left is not a stop short of the end).
                    report.complete = !self.any_left(after, end).await?;
                    break;
                }
                limit = limit.min(max - selected);
            }
            let chunk = match self.mode {
                OutboxMode::Wal => self.chunk_wal(after, end, limit).await?,
                _ => self.chunk_table(after, end, limit).await?,
            };
            let Some(last) = chunk.last else {
                report.complete = true;
                break;
            };
            after = last;
            selected += chunk.picked;
            report.chunks += 1;
            report.replayed += chunk.inserted;
            report.skipped += chunk.picked - chunk.inserted;
            report.cursor = Some(ReplayCursor(last));
            if chunk.picked < limit {
                report.complete = true;
                break;
            }
            if let Some(rate) = self.rate {
                // Paced on the whole run: no faster than `rate` on average since the start.
                let due = Duration::from_secs_f64(selected as f64 / f64::from(rate));
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
        }
        tracing::info!(
            replay_id = %self.replay_id,
            replayed = report.replayed,
            skipped = report.skipped,
            cursor = ?report.cursor,
            complete = report.complete,
            "pgbox replay"
        );
        Ok(report)
    }

    /// Whether any selected message is left after `after` (up to `end`).
    async fn any_left(&self, after: i64, end: i64) -> Result<bool> {
        let s = self.archive.schema_identifier().quoted();
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {s}.outbox_archive AS a WHERE {})",
            self.filter()
        );
        Ok(self
            .bind(sqlx::query(AssertSqlSafe(sql)), after, end)
            .fetch_one(self.archive.pool())
            .await?
            .try_get(0)?)
    }

    /// One chunk into the outbox table, in one statement: selected, locked per key as an
    /// enqueue locks (so the seqs follow archive order within a key), inserted, and the
    /// sleeping relay woken.
    async fn chunk_table(&self, after: i64, end: i64, limit: u64) -> Result<Chunk> {
        let s = self.archive.schema_identifier().quoted();
        let name = self.archive.schema_identifier().as_str();
        let sql = format!(
            "WITH picked AS MATERIALIZED (\
               SELECT a.seq, a.message_id, a.topic, a.ordering_key, a.payload, a.content_type, a.headers, \
                      pg_catalog.row_number() OVER (ORDER BY a.seq) AS n \
               FROM {s}.outbox_archive AS a WHERE {filter} ORDER BY a.seq LIMIT $9), \
             locks AS ({locks}), \
             ins AS (\
               INSERT INTO {s}.outbox (message_id, topic, ordering_key, payload, content_type, headers) \
               SELECT COALESCE(($11::uuid[])[p.n], p.message_id), p.topic, p.ordering_key, p.payload, p.content_type, \
                      p.headers || pg_catalog.jsonb_build_object('{REPLAY_ID_HEADER}', $10::text) \
               FROM picked AS p CROSS JOIN locks ORDER BY p.seq \
               ON CONFLICT (message_id) DO NOTHING RETURNING 1), \
             wake AS ({wake} AND EXISTS (SELECT 1 FROM ins)) \
             SELECT (SELECT pg_catalog.count(*) FROM picked)::int8, (SELECT pg_catalog.max(seq) FROM picked), \
                    (SELECT pg_catalog.count(*) FROM ins)::int8, (SELECT pg_catalog.count(*) FROM wake)::int8",
            filter = self.filter(),
            locks = key_locks_sql("picked"),
            wake = wake_sql(
                self.archive.schema_identifier(),
                &format!("{name}.outbox"),
                ASLEEP_LOCK_CLASS,
                "",
            ),
        );
        let ids: Option<Vec<Uuid>> = self
            .new_ids
            .then(|| (0..limit).map(|_| Uuid::now_v7()).collect());
        let row = self
            .bind(sqlx::query(AssertSqlSafe(sql)), after, end)
            .bind(limit as i64)
            .bind(self.replay_id.to_string())
            .bind(ids)
            .fetch_one(self.archive.pool())
            .await?;
        let picked: i64 = row.try_get(0)?;
        let inserted: i64 = row.try_get(2)?;
        Ok(Chunk {
            picked: picked.max(0) as u64,
            last: row.try_get(1)?,
            inserted: inserted.max(0) as u64,
        })
    }

    /// One chunk emitted to the WAL through [`Outbox`] in WAL mode, in one transaction.
    async fn chunk_wal(&self, after: i64, end: i64, limit: u64) -> Result<Chunk> {
        let s = self.archive.schema_identifier().quoted();
        let sql = format!(
            "SELECT a.seq, a.message_id, a.topic, a.ordering_key, a.payload, a.content_type, a.headers \
             FROM {s}.outbox_archive AS a WHERE {filter} ORDER BY a.seq LIMIT $9",
            filter = self.filter()
        );
        let rows = self
            .bind(sqlx::query(AssertSqlSafe(sql)), after, end)
            .bind(limit as i64)
            .fetch_all(self.archive.pool())
            .await?;
        let Some(last) = rows.last() else {
            return Ok(Chunk::default());
        };
        let last: i64 = last.try_get(0)?;
        let mut messages = Vec::with_capacity(rows.len());
        for r in &rows {
            let headers: sqlx::types::Json<std::collections::BTreeMap<String, String>> =
                r.try_get(6)?;
            let mut m = Message::bytes(r.try_get::<String, _>(2)?, r.try_get::<Vec<u8>, _>(4)?)
                .content_type(r.try_get::<String, _>(5)?);
            if let Some(key) = r.try_get::<Option<String>, _>(3)? {
                m = m.ordering_key(key);
            }
            m.headers = headers.0;
            m.headers
                .insert(REPLAY_ID_HEADER.to_owned(), self.replay_id.to_string());
            if !self.new_ids {
                m.id = r.try_get(1)?;
            }
            messages.push(m);
        }
        let outbox = Outbox::with_schema(self.archive.schema())?.mode(OutboxMode::Wal);
        let mut tx = crate::pooler::begin(self.archive.pool(), None).await?;
        outbox.enqueue_batch(&mut tx, messages).await?;
        tx.commit().await?;
        Ok(Chunk {
            picked: rows.len() as u64,
            last: Some(last),
            inserted: rows.len() as u64,
        })
    }
}

#[derive(Debug, Default)]
struct Chunk {
    picked: u64,
    last: Option<i64>,
    inserted: u64,
}
