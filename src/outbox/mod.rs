//! The transactional outbox: write messages in the business transaction; the
//! [`Relay`](crate::Relay) publishes them after commit.

mod message;
pub(crate) mod scheduled;
pub(crate) mod trace;
pub(crate) mod wal;

use std::sync::Arc;

use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use crate::pooler::Pooler;
use tracing::Instrument;
use uuid::Uuid;

pub use self::message::{
    DEFAULT_MAX_MESSAGE_BYTES, Envelope, MAX_HEADER_NAME_BYTES, MAX_MESSAGE_BYTES_LIMIT,
    MAX_TOPIC_BYTES, Message,
};
pub use self::scheduled::{MAX_SCHEDULE_DELAY, ScheduleConflict};
pub use self::trace::TRACEPARENT;

use crate::error::Result;
use crate::ident::DEFAULT_SCHEMA;
use crate::ident::Identifier;

/// Advisory-lock class for per-key enqueue locks (two-key form, so it never collides with an
/// application's single-key advisory locks).
pub(crate) const ENQUEUE_LOCK_CLASS: i32 = 0x7062_6f78; // "pbox"

/// Advisory-lock class of the "a relay is asleep" lock, keyed by `hashtext(schema)`.
///
/// Producers do not NOTIFY on every commit: PostgreSQL serialises every notifying commit on
/// one global lock, which halves durable enqueue throughput with many producers. Instead a
/// relay about to sleep takes this lock exclusively (session level), drains once more, and
/// sleeps holding it. Each enqueue statement tries to take it shared (transaction level):
/// - if that succeeds, no relay is asleep; the producer holds the shared lock until it
///   commits, so a relay going to sleep waits for that commit and its final drain sees it;
/// - if it fails, a relay is asleep (or about to be), and the statement NOTIFYs; the
///   notification is delivered at commit and wakes the sleeper.
///
/// Either way no committed message waits for the poll interval while a relay is idle.
pub(crate) const ASLEEP_LOCK_CLASS: i32 = 0x7062_6f7a; // "pboz"

/// The same protocol for the WAL outbox: a sleeping [`WalRelay`](crate::WalRelay) holds
/// `pg_advisory_lock(WAL_ASLEEP_LOCK_CLASS, hashtext(schema))` on its LISTEN connection; a
/// producer's emit takes the shared transaction-level lock when it can (no relay asleep) and
/// otherwise notifies `<schema>.wal`.
pub(crate) const WAL_ASLEEP_LOCK_CLASS: i32 = 0x7062_6f79; // "pboy"

/// The sub-select that takes the per-key enqueue lock of each distinct (topic, ordering key)
/// of the rows `rows` names, sorted (two producers of many keys cannot deadlock), in one
/// aggregate: an INSERT that joins it (`CROSS JOIN`) draws its seqs only after every lock is
/// held, and holding them to commit makes seq order commit order within a key.
pub(crate) fn key_locks_sql(rows: &str) -> String {
    format!(
        "SELECT pg_catalog.count(pg_catalog.pg_advisory_xact_lock({class}, pg_catalog.hashtext(k.topic || pg_catalog.chr(31) || k.ordering_key))) AS n \
         FROM (SELECT DISTINCT topic, ordering_key FROM {rows} WHERE ordering_key IS NOT NULL \
               ORDER BY topic, ordering_key) AS k",
        class = ENQUEUE_LOCK_CLASS,
    )
}

/// The sub-select that notifies `channel` with `payload` only when a relay of `schema` sleeps
/// (its asleep lock of `class` cannot be shared; see [`ASLEEP_LOCK_CLASS`]). The schema is a
/// validated identifier (`[a-z0-9_]`) and the channel and payload pgbox's own, so they can
/// stand as literals.
pub(crate) fn wake_sql(schema: &Identifier, channel: &str, class: i32, payload: &str) -> String {
    format!(
        "SELECT pg_catalog.pg_notify('{channel}', '{payload}') \
         WHERE NOT pg_catalog.pg_try_advisory_xact_lock_shared({class}, pg_catalog.hashtext('{name}'))",
        name = schema.as_str(),
    )
}

/// Writes messages into the outbox table, inside the caller's transaction.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> anyhow::Result<()> {
/// use pgbox::{Message, Outbox};
/// let outbox = Outbox::new();
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE orders SET status = 'paid' WHERE id = 42").execute(&mut *tx).await?;
/// outbox
///     .enqueue(&mut tx, Message::json("payments", &serde_json::json!({"order": 42}))?.ordering_key("order-42"))
///     .await?;
/// tx.commit().await?; // the order update and the message commit together, or neither does
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Outbox {
    schema: Identifier,
    insert: Arc<str>,
    insert_one: Arc<str>,
    insert_one_keyed: Arc<str>,
    max_message_bytes: usize,
    pooler: Pooler,
    mode: OutboxMode,
}

/// Where an [`Outbox`] writes its messages (default [`OutboxMode::Table`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutboxMode {
    /// Rows in the `outbox` table, published by a [`Relay`](crate::Relay): works on every
    /// PostgreSQL, behind any pooler, as any role the grants allow.
    #[default]
    Table,
    /// Logical-decoding messages in the WAL (`pg_logical_emit_message`, transactional),
    /// published by a [`WalRelay`](crate::WalRelay) from a replication slot: no row, no index
    /// entry, nothing to delete or vacuum. Needs `wal_level = logical` and a slot (see
    /// [`WalSlot`](crate::WalSlot)); see the guide's "The outbox" chapter.
    Wal,
}

/// Bytes one enqueue statement may carry in all: a quarter of PostgreSQL's 1 GiB protocol
/// message limit, so escaping and headers never push a statement over it.
const MAX_BATCH_BYTES: usize = 256 * 1024 * 1024;

impl Default for Outbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Outbox {
    /// An outbox in the default schema.
    pub fn new() -> Self {
        Self::build(Identifier::pgbox_schema(DEFAULT_SCHEMA).expect("valid default"))
    }

    /// An outbox in `schema` (validated, then always quoted).
    pub fn with_schema(schema: &str) -> Result<Self> {
        Ok(Self::build(Identifier::pgbox_schema(schema)?))
    }

    /// What stands between this outbox and PostgreSQL (default [`Pooler::None`]). Behind a
    /// pooler in transaction mode, set [`Pooler::Transaction`]: enqueues are then sent as
    /// unnamed statements.
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    fn persistent(&self) -> bool {
        self.pooler.persistent()
    }

    fn build(schema: Identifier) -> Self {
        // One statement for any batch size. The `locks` sub-select takes the per-key
        // transaction locks (sorted, so two batch producers cannot deadlock) before any row
        // gets its seq: the aggregate must finish before the first row is produced. Holding
        // the lock to commit makes seq order equal commit order within a key.
        let insert = format!(
            "WITH msgs AS (\
               SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[]) \
                 WITH ORDINALITY AS m(message_id, topic, ordering_key, payload, content_type, headers, n)), \
             locks AS ({locks}) \
             INSERT INTO {schema}.outbox (message_id, topic, ordering_key, payload, content_type, headers) \
             SELECT m.message_id, m.topic, m.ordering_key, m.payload, m.content_type, m.headers \
             FROM msgs AS m CROSS JOIN locks ORDER BY m.n",
            locks = key_locks_sql("msgs"),
        );
        // Notify only when a relay sleeps (see ASLEEP_LOCK_CLASS).
        let wake = wake_sql(
            &schema,
            &format!("{}.outbox", schema.as_str()),
            ASLEEP_LOCK_CLASS,
            "",
        );
        let insert = format!("WITH inserted AS ({insert} RETURNING 1) {wake}");
        // One message: a plain INSERT … VALUES, cheaper than the unnest statement.
        let insert_one = format!(
            "WITH inserted AS (\
               INSERT INTO {schema}.outbox (message_id, topic, payload, content_type, headers) \
               VALUES ($1, $2, $3, $4, $5) RETURNING 1) {wake}"
        );
        // One keyed message: the key's lock first (the FROM item is evaluated before the row,
        // and so before its seq is drawn).
        let insert_one_keyed = format!(
            "WITH inserted AS (\
               INSERT INTO {schema}.outbox (message_id, topic, ordering_key, payload, content_type, headers) \
               SELECT $1::uuid, $2::text, $6::text, $3::bytea, $4::text, $5::jsonb \
               FROM (SELECT pg_catalog.pg_advisory_xact_lock({class}, pg_catalog.hashtext($2::text || pg_catalog.chr(31) || $6::text))) AS l \
               RETURNING 1) {wake}",
            class = ENQUEUE_LOCK_CLASS,
        );
        Outbox {
            schema,
            insert: insert.into(),
            insert_one: insert_one.into(),
            insert_one_keyed: insert_one_keyed.into(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            pooler: Pooler::None,
            mode: OutboxMode::Table,
        }
    }

    /// Where messages go (default [`OutboxMode::Table`]). In [`OutboxMode::Wal`], `enqueue`
    /// emits one logical-decoding message per call (an `enqueue_batch` carries all its
    /// messages in one), transactional: it is decoded at commit, in commit order, and never
    /// if the transaction rolls back. Validation and size limits are the same.
    pub fn mode(mut self, mode: OutboxMode) -> Self {
        self.mode = mode;
        self
    }

    /// Emits `messages` as one logical-decoding message of this outbox's schema.
    async fn emit(&self, tx: &mut impl InTransaction, messages: &[Message]) -> Result<()> {
        let content = wal::encode(messages);
        let span = tracing::debug_span!(
            "pgbox.outbox.emit",
            messages = messages.len(),
            bytes = content.len()
        );
        // The emit, then a NOTIFY when a WAL relay sleeps (it holds the WAL asleep lock
        // exclusively; see `WAL_ASLEEP_LOCK_CLASS`). The condition names the CTE's column, so
        // the emit runs whatever it says.
        let done = sqlx::query(
            "WITH e AS MATERIALIZED (\
               SELECT pg_catalog.pg_logical_emit_message(true, $1::text, $2::bytea) AS lsn) \
             SELECT pg_catalog.pg_notify($3::text, '') FROM e \
             WHERE e.lsn IS NOT NULL \
               AND NOT pg_catalog.pg_try_advisory_xact_lock_shared($4::int4, pg_catalog.hashtext($5::text))",
        )
        .persistent(self.persistent())
        .bind(wal::prefix(self.schema.as_str()))
        .bind(content)
        .bind(wal::channel(self.schema.as_str()))
        .bind(WAL_ASLEEP_LOCK_CLASS)
        .bind(self.schema.as_str())
        .execute(tx.connection())
        .instrument(span)
        .await;
        if done.is_err() {
            tx.statement_failed();
        }
        done?;
        Ok(())
    }

    /// The largest message accepted, payload plus headers, in bytes (default
    /// [`DEFAULT_MAX_MESSAGE_BYTES`], at most [`MAX_MESSAGE_BYTES_LIMIT`]). A larger message
    /// is refused with [`Error::TooLarge`](crate::Error::TooLarge) before any SQL is sent,
    /// leaving the caller's transaction usable. Set it to your broker's limit.
    pub fn max_message_bytes(mut self, max: usize) -> Result<Self> {
        if max == 0 || max > MAX_MESSAGE_BYTES_LIMIT {
            return Err(crate::Error::InvalidConfig(format!(
                "outbox max_message_bytes must be 1..={MAX_MESSAGE_BYTES_LIMIT}, got {max}"
            )));
        }
        self.max_message_bytes = max;
        Ok(self)
    }

    /// The schema of the outbox table.
    pub fn schema(&self) -> &str {
        self.schema.as_str()
    }

    /// Writes one message in the caller's transaction; returns its id. If the transaction
    /// rolls back, the message never existed.
    ///
    /// `tx` is a [`Transaction`], or, inside an inbox handler, the handler's
    /// [`HandlerConnection`](crate::HandlerConnection): consume a message and produce the
    /// next in one transaction, with no savepoint.
    ///
    /// ```no_run
    /// use pgbox::{Message, Outbox};
    /// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
    /// let outbox = Outbox::new();
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("UPDATE orders SET status = 'paid' WHERE id = 42")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// // Published (by a relay) if and only if this transaction commits; the ordering key
    /// // keeps this order's messages in order.
    /// let paid = Message::json("payments", &serde_json::json!({ "order": 42 }))?
    ///     .ordering_key("order-42");
    /// outbox.enqueue(&mut tx, paid).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue(&self, tx: &mut impl InTransaction, message: Message) -> Result<Uuid> {
        message.validate(self.max_message_bytes)?;
        if message.schedule.is_some() {
            return self.enqueue_scheduled(tx, message).await;
        }
        let id = message.id;
        if self.mode == OutboxMode::Wal {
            self.emit(tx, &[with_trace_context(message)]).await?;
            tracing::debug!(message_id = %id, "pgbox outbox emitted to the WAL");
            return Ok(id);
        }
        let mut m = with_trace_context(message);
        let span = tracing::debug_span!("pgbox.outbox.enqueue", messages = 1);
        let key = m.ordering_key.take();
        let sql = match key {
            Some(_) => self.insert_one_keyed.clone(),
            None => self.insert_one.clone(),
        };
        let mut query = sqlx::query(AssertSqlSafe(sql))
            .persistent(self.persistent())
            .bind(m.id)
            .bind(m.topic)
            .bind(m.payload)
            .bind(m.content_type)
            .bind(Json(m.headers));
        if let Some(key) = key {
            query = query.bind(key);
        }
        let done = query.execute(tx.connection()).instrument(span).await;
        if done.is_err() {
            tx.statement_failed();
        }
        done?;
        tracing::debug!(message_id = %id, "pgbox outbox enqueued");
        Ok(id)
    }

    /// The "notify a sleeping relay: look for due scheduled messages" sub-select (one value)
    /// of a scheduled enqueue or a reschedule.
    fn scheduled_wake(&self) -> String {
        let (channel, class) = match self.mode {
            OutboxMode::Table => (
                format!("{}.outbox", self.schema.as_str()),
                ASLEEP_LOCK_CLASS,
            ),
            OutboxMode::Wal => (wal::channel(self.schema.as_str()), WAL_ASLEEP_LOCK_CLASS),
        };
        // A sleeping relay recomputes when to wake: this message may be due before then.
        wake_sql(&self.schema, &channel, class, scheduled::SCHEDULED_NOTICE)
    }

    /// Writes a scheduled message into `outbox_scheduled` (both modes: in WAL mode it is
    /// emitted when the [`WalRelay`](crate::WalRelay) promotes it).
    async fn enqueue_scheduled(
        &self,
        tx: &mut impl InTransaction,
        message: Message,
    ) -> Result<Uuid> {
        let wake = self.scheduled_wake();
        let span = tracing::debug_span!("pgbox.outbox.schedule");
        let id = scheduled::insert(
            &self.schema,
            &wake,
            self.persistent(),
            tx,
            with_trace_context(message),
        )
        .instrument(span)
        .await?;
        tracing::debug!(message_id = %id, "pgbox outbox scheduled");
        Ok(id)
    }

    /// Cancels the message pending under (`topic`, `schedule_key`) (see
    /// [`Message::schedule_key`]) in the caller's transaction: `true` if there was one (it
    /// is gone if the transaction commits), `false` if none is pending, e.g. because it was
    /// already due and promoted (handed to the relay: too late to cancel). A cancel racing
    /// the relay's promotion: whoever commits first wins (the cancel waits for a promotion
    /// in flight, then finds nothing).
    pub async fn cancel_scheduled(
        &self,
        tx: &mut impl InTransaction,
        topic: &str,
        schedule_key: &str,
    ) -> Result<bool> {
        crate::inbox::Key::new(schedule_key).validate()?;
        scheduled::cancel(&self.schema, self.persistent(), tx, topic, schedule_key).await
    }

    /// Moves the message pending under (`topic`, `schedule_key`) to be due at `at` (database
    /// clock; the past is "now"), in the caller's transaction: `true` if there was one,
    /// `false` as for [`cancel_scheduled`](Self::cancel_scheduled).
    pub async fn reschedule(
        &self,
        tx: &mut impl InTransaction,
        topic: &str,
        schedule_key: &str,
        at: time::OffsetDateTime,
    ) -> Result<bool> {
        crate::inbox::Key::new(schedule_key).validate()?;
        scheduled::reschedule(
            &self.schema,
            &self.scheduled_wake(),
            self.persistent(),
            tx,
            topic,
            schedule_key,
            at,
        )
        .await
    }

    /// Writes many messages in one statement, in the given order; returns their ids. `tx` as
    /// for [`enqueue`](Self::enqueue).
    pub async fn enqueue_batch(
        &self,
        tx: &mut impl InTransaction,
        messages: impl IntoIterator<Item = Message>,
    ) -> Result<Vec<Uuid>> {
        let messages: Vec<Message> = messages.into_iter().collect();
        let mut total = 0usize;
        for m in &messages {
            m.validate(self.max_message_bytes)?;
            total += m.size();
        }
        if total > MAX_BATCH_BYTES {
            return Err(crate::Error::TooLarge {
                what: "batch",
                len: total,
                max: MAX_BATCH_BYTES,
            });
        }
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        if messages.iter().any(|m| m.schedule.is_some()) {
            // Scheduled ones go to `outbox_scheduled`, one statement each; the others in one
            // batch. Ids in the given order.
            let mut ids = Vec::with_capacity(messages.len());
            let mut immediate = Vec::new();
            let mut slots = Vec::new();
            for m in messages {
                if m.schedule.is_some() {
                    ids.push(self.enqueue_scheduled(tx, m).await?);
                } else {
                    slots.push(ids.len());
                    ids.push(m.id);
                    immediate.push(m);
                }
            }
            let got = Box::pin(self.enqueue_batch(tx, immediate)).await?;
            for (slot, id) in slots.into_iter().zip(got) {
                ids[slot] = id;
            }
            return Ok(ids);
        }
        let n = messages.len();
        if self.mode == OutboxMode::Wal {
            let messages: Vec<Message> = messages.into_iter().map(with_trace_context).collect();
            self.emit(tx, &messages).await?;
            tracing::debug!(messages = n, "pgbox outbox emitted to the WAL");
            return Ok(messages.iter().map(|m| m.id).collect());
        }
        let mut ids = Vec::with_capacity(n);
        let mut topics = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut types = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        for m in messages {
            let m = with_trace_context(m);
            ids.push(m.id);
            topics.push(m.topic);
            keys.push(m.ordering_key);
            payloads.push(m.payload);
            types.push(m.content_type);
            headers.push(Json(m.headers));
        }
        let span = tracing::debug_span!("pgbox.outbox.enqueue", messages = n);
        let done = sqlx::query(AssertSqlSafe(self.insert.clone()))
            .persistent(self.persistent())
            .bind(&ids)
            .bind(&topics)
            .bind(&keys)
            .bind(&payloads)
            .bind(&types)
            .bind(&headers)
            .execute(tx.connection())
            .instrument(span)
            .await;
        if done.is_err() {
            tx.statement_failed();
        }
        done?;
        tracing::debug!(messages = n, "pgbox outbox enqueued");
        Ok(ids)
    }
}

/// Where [`Outbox::enqueue`] may write: a connection inside a transaction, so that the
/// message commits or rolls back with the caller's business writes. Implemented for
/// [`Transaction`] and for the [`HandlerConnection`](crate::HandlerConnection) that inbox
/// handlers get (always inside `process`'s transaction); sealed.
pub trait InTransaction: sealed::Sealed + Send {
    /// The connection, for one statement (refused before it is sent when the handler's
    /// transaction was rolled back under it: see [`HandlerConnection`](crate::HandlerConnection)).
    #[doc(hidden)]
    fn connection(&mut self) -> crate::inbox::OneStatement<'_>;
    /// That statement failed (the transaction is aborted).
    #[doc(hidden)]
    fn statement_failed(&mut self) {}
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::Transaction<'_, sqlx::Postgres> {}
    impl Sealed for crate::HandlerConnection<'_> {}
}

impl InTransaction for Transaction<'_, Postgres> {
    fn connection(&mut self) -> crate::inbox::OneStatement<'_> {
        crate::ConnectionLike::connection(self)
    }
}

impl InTransaction for crate::HandlerConnection<'_> {
    // Watched like a statement sent through the wrapper: a failed enqueue makes the inbox
    // check that the transaction is still alive before it reports success, and after a
    // nested unit rolled the transaction back the enqueue is refused before it is sent
    // (else it would commit on its own and the relay publish a message of work that never
    // committed).
    fn connection(&mut self) -> crate::inbox::OneStatement<'_> {
        crate::ConnectionLike::connection(self)
    }
    fn statement_failed(&mut self) {
        self.mark_failed();
    }
}

/// Continues the current trace: adds `traceparent` unless the message has one.
fn with_trace_context(mut m: Message) -> Message {
    if !m.headers.contains_key(TRACEPARENT)
        && let Some(traceparent) = trace::outgoing()
    {
        m.headers.insert(TRACEPARENT.to_owned(), traceparent);
    }
    m
}
