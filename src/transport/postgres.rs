//! The built-in transport: a durable per-topic queue in PostgreSQL.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex as StdMutex, MutexGuard, OnceLock};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};
use time::OffsetDateTime;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::{PublishError, Publisher, Subscriber};
use crate::error::{Error, Result};
use crate::ident::Identifier;
use crate::migrate::DEFAULT_SCHEMA;
use crate::outbox::Envelope;
use crate::pooler::{Pooler, SessionIsolation, Unit};

/// A message received from a [`PgQueue`]. Ack it, nack it, or dead-letter it; if the
/// consumer dies instead, it becomes visible again after the visibility timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery {
    /// The message.
    pub envelope: Envelope,
    /// 1 on the first delivery, 2 on the first redelivery... Also fences acks: an ack from
    /// an earlier delivery of a message that was redelivered since is refused.
    pub delivery: i32,
    /// The queue's own row id.
    pub(crate) queue_seq: i64,
}

/// The built-in PostgreSQL queue. Cheap to clone.
///
/// Per ordering key, at most one message is out for delivery at a time and keys are
/// delivered in publication order; messages without a key flow freely.
#[derive(Debug, Clone)]
pub struct PgQueue {
    pool: PgPool,
    inner: Arc<Statements>,
    pooler: Pooler,
    session_pool: Option<PgPool>,
    acks: Arc<AckGroup>,
    isolation: Arc<SessionIsolation>,
    /// Whether the pool's sessions default to `READ COMMITTED`, learned by the first publish
    /// (see [`Pooler::read_committed_unit`], which the other statements go through).
    publish_read_committed: Arc<OnceLock<bool>>,
    wait_for_flush: bool,
    publish_timeout: Duration,
}

/// How long a publish (or the relay's look at which server the queue is on) may take, by
/// default: as long as RabbitMQ's confirm timeout.
const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// Most acks deleted by one statement.
const MAX_ACKS_PER_STATEMENT: usize = 1000;

/// Acks that arrive together are deleted together: one statement (and one commit) for all
/// the acks made while the previous statement ran, instead of one each. The statement runs
/// in a task of its own, so an ack whose caller stops waiting strands no other.
#[derive(Debug, Default)]
struct AckGroup {
    state: StdMutex<AckGroupState>,
}

#[derive(Debug, Default)]
struct AckGroupState {
    waiting: Vec<WaitingAck>,
    /// A task is deleting, and takes what is waiting when it is done.
    flushing: bool,
}

#[derive(Debug)]
struct WaitingAck {
    seq: i64,
    delivery: i32,
    /// `Some(fresh)`, or `None` when the group's statement failed: the ack then runs alone
    /// and reports its own error.
    answer: oneshot::Sender<Option<bool>>,
}

impl AckGroup {
    fn lock(&self) -> MutexGuard<'_, AckGroupState> {
        // Nothing in the state can be half-updated by a panic: a poisoned lock is fine.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Ends a flushing task's turn however it ends: if it unwinds or is dropped (its runtime
/// shutting down), the acks still waiting are told to run alone, and the next ack starts a
/// new task.
struct FlushTurn {
    group: Arc<AckGroup>,
    finished: bool,
}

impl Drop for FlushTurn {
    fn drop(&mut self) {
        if !self.finished {
            let mut state = self.group.lock();
            state.flushing = false;
            for waiting in state.waiting.drain(..) {
                let _ = waiting.answer.send(None);
            }
        }
    }
}

#[derive(Debug)]
struct Statements {
    schema: Identifier,
    publish: String,
    receive: Receipt,
    ack: Receipt,
    ack_group: Receipt,
    nack: String,
    dead_letter: String,
}

/// A statement that records a receipt (a receive or an ack), in two forms: one whose commit
/// waits for its WAL to reach disk like any other, and one whose commit does not.
#[derive(Debug)]
struct Receipt {
    flushed: String,
    unflushed: String,
}

impl Receipt {
    /// `sql` builds the statement given the text to end its `WHERE` clause with: nothing, or
    /// ` AND` a condition that, evaluated on any row the statement takes, turns
    /// `synchronous_commit` off for the rest of the statement's transaction
    /// (`set_config(..., true)`: local to the transaction, in force at its commit, gone after
    /// it). No row taken means nothing written, so nothing to flush either.
    fn new(sql: impl Fn(&str) -> String) -> Self {
        Receipt {
            flushed: sql(""),
            unflushed: sql(UNFLUSHED_COMMIT),
        }
    }

    fn sql(&self, wait_for_flush: bool) -> AssertSqlSafe<String> {
        AssertSqlSafe(if wait_for_flush {
            self.flushed.clone()
        } else {
            self.unflushed.clone()
        })
    }
}

const UNFLUSHED_COMMIT: &str =
    " AND pg_catalog.set_config('synchronous_commit', 'off', true) IS NOT NULL";

const COLUMNS: &str =
    "seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, deliveries";

impl PgQueue {
    /// The queue in the default schema.
    pub fn new(pool: PgPool) -> Self {
        Self::build(
            pool,
            Identifier::pgbox_schema(DEFAULT_SCHEMA).expect("valid default"),
        )
    }

    /// The queue in `schema`.
    pub fn with_schema(pool: PgPool, schema: &str) -> Result<Self> {
        Ok(Self::build(pool, Identifier::pgbox_schema(schema)?))
    }

    fn build(pool: PgPool, schema: Identifier) -> Self {
        let s = &schema;
        let inner = Statements {
            publish: format!(
                "INSERT INTO {s}.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::timestamptz[])"
            ),
            // Head of each key only, and not while the key has a dead letter: a later
            // message of a key waits while an earlier one is in the table (invisible, in
            // flight, or waiting out a nack delay) or dead-lettered. The statement lives in
            // the `queue_receive` function (migration V6), which pins its plan.
            receive: Receipt::new(|unflushed| {
                format!("SELECT {COLUMNS} FROM {s}.queue_receive($1, $2, $3) WHERE true{unflushed}")
            }),
            ack: Receipt::new(|unflushed| {
                format!("DELETE FROM {s}.queue WHERE seq = $1 AND deliveries = $2{unflushed}")
            }),
            // `seq = ANY` keeps the plan on the primary key whatever the statistics say;
            // the pair fences each ack to its own delivery.
            ack_group: Receipt::new(|unflushed| {
                format!(
                    "DELETE FROM {s}.queue AS q WHERE q.seq = ANY($1::bigint[]) \
                     AND (q.seq, q.deliveries) IN (SELECT a.seq, a.deliveries \
                       FROM ROWS FROM (pg_catalog.unnest($1::bigint[]), pg_catalog.unnest($2::integer[])) \
                         AS a(seq, deliveries)){unflushed} \
                     RETURNING q.seq, q.deliveries"
                )
            }),
            nack: format!(
                "UPDATE {s}.queue SET visible_at = pg_catalog.now() + pg_catalog.make_interval(secs => $3), last_error = $4 \
                 WHERE seq = $1 AND deliveries = $2"
            ),
            dead_letter: format!(
                "WITH moved AS (DELETE FROM {s}.queue WHERE seq = $1 AND deliveries = $2 RETURNING *) \
                 INSERT INTO {s}.queue_dead_letters \
                   (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, deliveries, last_error) \
                 SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, deliveries, $3 \
                 FROM moved"
            ),
            schema,
        };
        PgQueue {
            pool,
            inner: Arc::new(inner),
            pooler: Pooler::None,
            session_pool: None,
            acks: Arc::default(),
            isolation: Arc::default(),
            publish_read_committed: Arc::default(),
            wait_for_flush: false,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
        }
    }

    /// How long a [`publish`](Publisher::publish) may take, from waiting for a connection to
    /// the commit (default 30 s). A publish that has not finished by then is reported unavailable (an outage: the relay counts no attempt and
    /// tries again after its backoff), and its connection is closed, never handed back to the
    /// pool: a database that stopped answering mid-request (a host that died with the request
    /// in hand, a middlebox that black-holes an open connection) would otherwise hold the
    /// relay's round, its row locks and its keyed-drain lock for good. The relay's look at
    /// which server the queue's pool reaches, made before each round, has the same bound.
    ///
    /// A publish cut off by the timeout may still have committed (the answer to the
    /// `COMMIT` was what went missing): its messages are published again, as after any lost
    /// connection, and the consumer's inbox absorbs the duplicates. Zero is refused
    /// ([`Error::InvalidConfig`]).
    pub fn publish_timeout(mut self, timeout: Duration) -> Result<Self> {
        if timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "queue publish timeout must be positive".into(),
            ));
        }
        self.publish_timeout = timeout;
        Ok(self)
    }

    /// What stands between the queue's pool and PostgreSQL (default [`Pooler::None`]). With
    /// [`Pooler::Transaction`], every statement goes unnamed and in a transaction of its own,
    /// and a consumer's wake-up (`LISTEN`) needs a direct connection: give one with
    /// [`session_pool`](Self::session_pool), or consumers poll.
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// Whether receives and acks wait, at commit, for their WAL to reach disk (default
    /// `false`).
    ///
    /// A receive records that a message is out for delivery; an ack, that it is done with.
    /// By default both commit with `synchronous_commit = off`: PostgreSQL answers before
    /// their WAL is flushed, which spares one flush (the most expensive part of a commit on
    /// most disks) per receive and per group of acks. What this can cost: if PostgreSQL
    /// crashes, or fails over to a standby that had not received them, the receipts of the
    /// last moments (up to three times `wal_writer_delay`, 600 ms by default) are undone, and
    /// those messages are delivered again (an undone ack's message once its visibility
    /// timeout runs out). That is a redelivery like any other, which the
    /// [`Inbox`](crate::Inbox) answers with `Duplicate`; nothing is lost and nothing is
    /// reordered, because WAL is only ever lost from its end, and any later commit that does
    /// wait for its flush (a handler's inbox transaction, a producer's) makes every receipt
    /// before it durable too. Publishing into the queue, nacks and dead-lettering always
    /// wait for the flush.
    ///
    /// Set `true` when redeliveries after a crash cost more than the flushes, for example a
    /// consumer whose handler is not behind an inbox.
    pub fn wait_for_flush(mut self, wait: bool) -> Self {
        self.wait_for_flush = wait;
        self
    }

    /// A pool of direct (session) connections for consumers' `LISTEN`, when the queue's own
    /// pool goes through a pooler in transaction mode.
    pub fn session_pool(mut self, pool: PgPool) -> Self {
        self.session_pool = Some(pool);
        self
    }

    /// The pool the queue lives in.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema the queue's tables are in.
    pub(crate) fn schema_identifier(&self) -> &Identifier {
        &self.inner.schema
    }

    /// The `LISTEN` channel notified when messages arrive.
    pub fn channel(&self) -> String {
        format!("{}.queue", self.inner.schema.as_str())
    }

    /// Takes up to `max` visible messages of `topic`, hiding them for `visibility`.
    pub async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> Result<Vec<Delivery>> {
        let mut unit = self.unit().await?;
        let rows = sqlx::query(self.inner.receive.sql(self.wait_for_flush))
            .persistent(self.pooler.persistent())
            .bind(topic)
            .bind(i64::try_from(max).unwrap_or(i64::MAX))
            .bind(visibility.as_secs_f64())
            .fetch_all(&mut *unit)
            .await?;
        unit.finish().await?;
        let mut deliveries = rows
            .iter()
            .map(decode_delivery)
            .collect::<Result<Vec<_>>>()?;
        deliveries.sort_by_key(|d| d.queue_seq);
        Ok(deliveries)
    }

    /// Deletes a delivered message. `false` if this delivery is stale (the message was
    /// redelivered since, or already acked).
    ///
    /// Acks made at the same time (the runner's handlers finishing together) are deleted by
    /// one statement; `Ok` means this message's row is deleted and committed (flushed to
    /// disk only with [`wait_for_flush`](Self::wait_for_flush)).
    pub async fn ack(&self, delivery: &Delivery) -> Result<bool> {
        let (answer, answered) = oneshot::channel();
        let lead = {
            let mut state = self.acks.lock();
            state.waiting.push(WaitingAck {
                seq: delivery.queue_seq,
                delivery: delivery.delivery,
                answer,
            });
            !std::mem::replace(&mut state.flushing, true)
        };
        if lead {
            tokio::spawn(self.clone().flush_acks());
        }
        let fresh = match answered.await {
            Ok(Some(fresh)) => fresh,
            _ => self.ack_alone(delivery).await?,
        };
        tracing::debug!(message_id = %delivery.envelope.id, fresh, "pgbox queue ack");
        Ok(fresh)
    }

    /// Deletes what acks are waiting, a group at a time, until none is.
    async fn flush_acks(self) {
        let mut turn = FlushTurn {
            group: self.acks.clone(),
            finished: false,
        };
        loop {
            let group: Vec<WaitingAck> = {
                let mut state = self.acks.lock();
                if state.waiting.is_empty() {
                    state.flushing = false;
                    turn.finished = true;
                    return;
                }
                let n = state.waiting.len().min(MAX_ACKS_PER_STATEMENT);
                state.waiting.drain(..n).collect()
            };
            let seqs: Vec<i64> = group.iter().map(|w| w.seq).collect();
            let deliveries: Vec<i32> = group.iter().map(|w| w.delivery).collect();
            let deleted: Result<Vec<(i64, i32)>> = async {
                let mut unit = self.unit().await?;
                let rows = sqlx::query_as(self.inner.ack_group.sql(self.wait_for_flush))
                    .persistent(self.pooler.persistent())
                    .bind(&seqs)
                    .bind(&deliveries)
                    .fetch_all(&mut *unit)
                    .await?;
                unit.finish().await?;
                Ok(rows)
            }
            .await;
            match deleted {
                Ok(rows) => {
                    tracing::trace!(acks = group.len(), "pgbox queue acks deleted together");
                    let mut deleted: HashSet<(i64, i32)> = rows.into_iter().collect();
                    for waiting in group {
                        // `remove`: the same delivery acked twice in one group is fresh once.
                        let fresh = deleted.remove(&(waiting.seq, waiting.delivery));
                        let _ = waiting.answer.send(Some(fresh));
                    }
                }
                Err(e) => {
                    tracing::debug!(acks = group.len(), error = %e, "pgbox queue group ack failed; each ack runs alone");
                    for waiting in group {
                        let _ = waiting.answer.send(None);
                    }
                }
            }
        }
    }

    /// One ack, one statement: what an ack falls back to when its group's statement failed,
    /// so that it reports its own error.
    async fn ack_alone(&self, delivery: &Delivery) -> Result<bool> {
        let mut unit = self.unit().await?;
        let done = sqlx::query(self.inner.ack.sql(self.wait_for_flush))
            .persistent(self.pooler.persistent())
            .bind(delivery.queue_seq)
            .bind(delivery.delivery)
            .execute(&mut *unit)
            .await?;
        unit.finish().await?;
        Ok(done.rows_affected() == 1)
    }

    /// Makes the message visible again after `delay`, recording `error`.
    pub async fn nack(&self, delivery: &Delivery, delay: Duration, error: &str) -> Result<bool> {
        let mut unit = self.unit().await?;
        let done = sqlx::query(AssertSqlSafe(self.inner.nack.clone()))
            .persistent(self.pooler.persistent())
            .bind(delivery.queue_seq)
            .bind(delivery.delivery)
            .bind(delay.as_secs_f64())
            .bind(error.replace('\0', "\\0"))
            .execute(&mut *unit)
            .await?;
        unit.finish().await?;
        tracing::info!(message_id = %delivery.envelope.id, ?delay, error, "pgbox queue nack; will redeliver");
        Ok(done.rows_affected() == 1)
    }

    /// Operator access to this queue's dead letters (list, replay, discard).
    pub fn dead_letters(&self) -> QueueDeadLetters {
        QueueDeadLetters {
            pool: self.pool.clone(),
            schema: self.inner.schema.clone(),
        }
    }

    /// Moves the message to `queue_dead_letters`. Until it is replayed or discarded (see
    /// [`QueueDeadLetters`]), later messages of its ordering key are not delivered.
    pub async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool> {
        let mut unit = self.unit().await?;
        let done = sqlx::query(AssertSqlSafe(self.inner.dead_letter.clone()))
            .persistent(self.pooler.persistent())
            .bind(delivery.queue_seq)
            .bind(delivery.delivery)
            .bind(error.replace('\0', "\\0"))
            .execute(&mut *unit)
            .await?;
        unit.finish().await?;
        tracing::warn!(message_id = %delivery.envelope.id, deliveries = delivery.delivery, error, "pgbox queue message dead-lettered");
        Ok(done.rows_affected() == 1)
    }
}

/// A failed insert into the queue, by whose fault: the queue's database not reachable or not
/// answering (connection lost or refused, pool exhausted, a standby, a cancelled or
/// conflicting statement: all retryable; out of resources) is an outage; the rest (a missing table or grant,
/// a value the server refuses) is the batch's refusal.
fn publish_error(e: &Error) -> PublishError {
    let unavailable = match e {
        Error::Database { kind, source } => {
            kind.is_retryable()
                || matches!(source, sqlx::Error::PoolClosed)
                // Class 53, insufficient resources: a full disk, no memory, too many
                // connections.
                || matches!(source, sqlx::Error::Database(db)
                    if db.code().is_some_and(|c| c.starts_with("53")))
        }
        Error::Connect { .. } => true,
        _ => false,
    } || e.needs_migration(); // the queue's schema not migrated (yet): no message's fault
    if unavailable {
        PublishError::unavailable(e.to_string())
    } else {
        PublishError::refused(e.to_string())
    }
}

fn decode_delivery(row: &PgRow) -> Result<Delivery> {
    let deliveries: i32 = row.try_get("deliveries")?;
    let envelope = Envelope::from_row(row, deliveries - 1)?;
    Ok(Delivery {
        queue_seq: envelope.seq,
        envelope,
        delivery: deliveries,
    })
}

impl Publisher for PgQueue {
    /// Inserts the batch into the queue, all or nothing, within the
    /// [publish timeout](PgQueue::publish_timeout).
    ///
    /// Unavailable (an outage, never counted as an attempt): no connection (refused, a login
    /// the server turns away: `57P03` starting up, `55000` not accepting connections, `3D000`
    /// no such database, class `28` authentication; the pool's own timeout), a failed
    /// `BEGIN`, a lost connection, no answer within the timeout, and an insert failing for
    /// the server's state (a standby, a cancelled or conflicting statement, class `53` out
    /// of resources). Refused: what the server answers to the insert itself (a missing
    /// table or grant, a value it refuses).
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let result = self.publish_within_timeout(batch).await;
        vec![result; batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }

    fn as_pg_queue(&self) -> Option<&PgQueue> {
        Some(self)
    }
}

/// A connection of the queue's pool that is closed, not handed back to the pool, unless
/// [`keep`](Self::keep) says it is in a known state: a publish cut off (by its timeout, or
/// by its caller dropping it) may have left it mid-request, mid-transaction, or waiting on a
/// peer that will never answer (sqlx's own check on release would wait on it for good,
/// holding a slot of the pool).
struct Borrowed {
    conn: Option<PoolConnection<Postgres>>,
}

impl Borrowed {
    fn new(conn: PoolConnection<Postgres>) -> Self {
        Borrowed { conn: Some(conn) }
    }

    fn conn(&mut self) -> &mut sqlx::PgConnection {
        self.conn
            .as_mut()
            .expect("a borrowed connection until dropped")
    }

    /// The connection is in a known state (idle, outside any transaction): back to the
    /// pool.
    fn keep(mut self) {
        drop(self.conn.take());
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            // A graceful close bounded by sqlx (5 s), then the socket is dropped.
            conn.close_on_drop();
        }
    }
}

/// Takes a connection of `pool` by `deadline`; every failure (none within the deadline, a
/// refused connection or login, the pool's own timeout) is the database not being
/// reachable, whatever its SQLSTATE.
async fn borrow_by(
    pool: &PgPool,
    deadline: tokio::time::Instant,
    limit: Duration,
) -> std::result::Result<Borrowed, String> {
    match tokio::time::timeout_at(deadline, pool.acquire()).await {
        Ok(Ok(conn)) => Ok(Borrowed::new(conn)),
        Ok(Err(e)) => Err(format!(
            "cannot get a connection to the queue's database: {}",
            Error::from(e)
        )),
        Err(_) => Err(format!(
            "no connection to the queue's database within {limit:?}"
        )),
    }
}

/// Why a publish failed before the database answered its insert: the connection's state
/// (an outage), or the insert (classified by [`publish_error`]).
enum PublishFault {
    Session(Error),
    Insert(Error),
}

impl PgQueue {
    async fn publish_within_timeout(&self, batch: &[Envelope]) -> Result<(), PublishError> {
        let limit = self.publish_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let mut conn = borrow_by(&self.pool, deadline, limit)
            .await
            .map_err(PublishError::unavailable)?;
        match tokio::time::timeout_at(deadline, self.insert_batch(conn.conn(), batch)).await {
            Ok(Ok(())) => {
                conn.keep();
                Ok(())
            }
            // Failed: the connection may be inside an aborted transaction; it is closed.
            Ok(Err(PublishFault::Session(e))) => Err(PublishError::unavailable(format!(
                "the queue's database: {e}"
            ))),
            Ok(Err(PublishFault::Insert(e))) => Err(publish_error(&e)),
            Err(_) => Err(PublishError::unavailable(format!(
                "the queue's database did not answer within the publish timeout ({limit:?}); \
                 its connection is closed"
            ))),
        }
    }

    /// The batch's insert on `conn`: one autocommit statement when it fits one and the
    /// session runs at `READ COMMITTED`, else a `READ COMMITTED` transaction (several
    /// statements stay all or nothing; behind a transaction pooler every statement is in
    /// one).
    async fn insert_batch(
        &self,
        conn: &mut sqlx::PgConnection,
        batch: &[Envelope],
    ) -> std::result::Result<(), PublishFault> {
        let chunks = chunk_by_bytes(batch, MAX_STATEMENT_BYTES);
        let plain = match (self.pooler, chunks.len()) {
            (Pooler::None, 1) => self
                .session_reads_committed(conn)
                .await
                .map_err(PublishFault::Session)?,
            _ => false,
        };
        if plain {
            return self
                .insert(conn, chunks[0])
                .await
                .map_err(PublishFault::Insert);
        }
        sqlx::raw_sql("BEGIN ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *conn)
            .await
            .map_err(|e| PublishFault::Session(e.into()))?;
        for chunk in &chunks {
            self.insert(conn, chunk)
                .await
                .map_err(PublishFault::Insert)?;
        }
        // The commit's answer is the batch's: a deferred check refuses it here.
        sqlx::raw_sql("COMMIT")
            .execute(&mut *conn)
            .await
            .map_err(|e| PublishFault::Insert(e.into()))?;
        Ok(())
    }

    /// Whether the pool's sessions default to `READ COMMITTED` (asked once, on `conn`).
    async fn session_reads_committed(&self, conn: &mut sqlx::PgConnection) -> Result<bool> {
        if let Some(known) = self.publish_read_committed.get() {
            return Ok(*known);
        }
        let level: String = sqlx::query_scalar(
            "SELECT pg_catalog.current_setting('default_transaction_isolation')",
        )
        .fetch_one(&mut *conn)
        .await?;
        let read_committed = level == "read committed";
        let _ = self.publish_read_committed.set(read_committed);
        Ok(read_committed)
    }

    /// Which server run and database the queue's pool reaches, within the publish timeout
    /// (its connection closed if it does not answer in time). Behind a transaction pooler the
    /// statement runs in a transaction of its own: sqlx prepares an unnamed statement in one
    /// round trip and runs it in the next, which a pooler may send to another server.
    pub(crate) async fn server_identity(&self) -> Result<(OffsetDateTime, String)> {
        let limit = self.publish_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let timed_out = |what: String| {
            Error::from(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                what,
            )))
        };
        let mut conn = borrow_by(&self.pool, deadline, limit)
            .await
            .map_err(timed_out)?;
        let in_transaction = !self.pooler.keeps_sessions();
        let persistent = self.pooler.persistent();
        let asked = async {
            let conn = conn.conn();
            if in_transaction {
                sqlx::raw_sql("BEGIN").execute(&mut *conn).await?;
            }
            let row = sqlx::query(
                "SELECT pg_catalog.pg_postmaster_start_time(), pg_catalog.current_database()::text",
            )
            .persistent(persistent)
            .fetch_one(&mut *conn)
            .await?;
            if in_transaction {
                sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
            }
            Ok::<_, Error>((row.try_get(0)?, row.try_get(1)?))
        };
        match tokio::time::timeout_at(deadline, asked).await {
            Ok(Ok(there)) => {
                conn.keep();
                Ok(there)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(timed_out(format!(
                "the queue's database did not answer within {limit:?}"
            ))),
        }
    }
}

/// Payload bytes per queue INSERT: well under PostgreSQL's 1 GiB protocol message limit.
const MAX_STATEMENT_BYTES: usize = 64 * 1024 * 1024;

/// Consecutive slices of `batch` whose payloads add up to at most `max` bytes (a single
/// larger message gets a slice of its own).
fn chunk_by_bytes(batch: &[Envelope], max: usize) -> Vec<&[Envelope]> {
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, e) in batch.iter().enumerate() {
        if i > start && bytes + e.payload.len() > max {
            chunks.push(&batch[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += e.payload.len();
    }
    chunks.push(&batch[start..]);
    chunks
}

impl PgQueue {
    /// A unit for one of the queue's statements: at `READ COMMITTED` whatever the pool's
    /// sessions default to (see [`Pooler::read_committed_unit`]).
    async fn unit(&self) -> Result<Unit> {
        self.pooler
            .read_committed_unit(&self.pool, &self.isolation)
            .await
    }

    async fn insert(&self, conn: &mut sqlx::PgConnection, batch: &[Envelope]) -> Result<()> {
        sqlx::query(AssertSqlSafe(self.inner.publish.clone()))
            .persistent(self.pooler.persistent())
            .bind(batch.iter().map(|e| e.id).collect::<Vec<_>>())
            .bind(batch.iter().map(|e| e.topic.as_str()).collect::<Vec<_>>())
            .bind(
                batch
                    .iter()
                    .map(|e| e.ordering_key.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(
                batch
                    .iter()
                    .map(|e| e.payload.as_slice())
                    .collect::<Vec<_>>(),
            )
            .bind(
                batch
                    .iter()
                    .map(|e| e.content_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(batch.iter().map(|e| Json(&e.headers)).collect::<Vec<_>>())
            .bind(batch.iter().map(|e| e.created_at).collect::<Vec<_>>())
            .execute(conn)
            .await?;
        Ok(())
    }
}

impl Subscriber for PgQueue {
    type Delivery = Delivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> Result<Vec<Delivery>> {
        PgQueue::receive(self, topic, max, visibility).await
    }

    fn envelope<'d>(&self, delivery: &'d Delivery) -> &'d Envelope {
        &delivery.envelope
    }

    fn attempt(&self, delivery: &Delivery) -> i32 {
        delivery.delivery
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool> {
        PgQueue::ack(self, delivery).await
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration, error: &str) -> Result<bool> {
        PgQueue::nack(self, delivery, delay, error).await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool> {
        PgQueue::dead_letter(self, delivery, error).await
    }

    fn wake_channel(&self) -> Option<(PgPool, String)> {
        match (&self.session_pool, self.pooler.keeps_sessions()) {
            (Some(session), _) => Some((session.clone(), self.channel())),
            (None, true) => Some((self.pool.clone(), self.channel())),
            // LISTEN through a transaction pooler hears nothing reliably: poll.
            (None, false) => None,
        }
    }
}

/// A message of the built-in queue that a consumer gave up on (see [`PgQueue::dead_letter`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueDeadLetter {
    /// Its original queue position; replay puts it back there.
    pub seq: i64,
    /// Its id (the outbox's message id).
    pub message_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Ordering key: later messages of this key are not delivered until it is replayed or
    /// discarded.
    pub ordering_key: Option<String>,
    /// Headers.
    pub headers: BTreeMap<String, String>,
    /// Payload size in bytes.
    pub payload_bytes: i32,
    /// Deliveries made before it was dead-lettered.
    pub deliveries: i32,
    /// The error it was dead-lettered with.
    pub last_error: Option<String>,
    /// When the producer enqueued it.
    pub created_at: OffsetDateTime,
    /// When it was dead-lettered.
    pub dead_at: OffsetDateTime,
}

/// Operator access to the built-in queue's dead letters, the counterpart of
/// [`DeadLetters`](crate::DeadLetters) for the outbox.
///
/// A dead letter holds its ordering key: [`PgQueue::receive`] delivers no later message of
/// that key until the dead letter is [replayed](Self::replay) (back at its original position,
/// so it is delivered first and the held messages follow in order) or
/// [discarded](Self::discard). Messages are named by message id; if the queue held a message
/// twice (a repeated publish) and both copies were dead-lettered, an id names both.
#[derive(Debug, Clone)]
pub struct QueueDeadLetters {
    pool: PgPool,
    schema: Identifier,
}

const DEAD_LETTER_COLUMNS: &str = "seq, message_id, topic, ordering_key, headers, \
     octet_length(payload) AS payload_bytes, deliveries, last_error, created_at, dead_at";

impl QueueDeadLetters {
    /// Dead letters of the queue in the default schema.
    pub fn new(pool: PgPool) -> Self {
        QueueDeadLetters {
            pool,
            schema: Identifier::new("schema", DEFAULT_SCHEMA).expect("valid default"),
        }
    }

    /// Dead letters of the queue in `schema`.
    pub fn with_schema(pool: PgPool, schema: &str) -> Result<Self> {
        Ok(QueueDeadLetters {
            pool,
            schema: Identifier::pgbox_schema(schema)?,
        })
    }

    /// Up to `limit` dead letters, oldest (lowest queue position) first.
    pub async fn list(&self, limit: i64) -> Result<Vec<QueueDeadLetter>> {
        let sql = format!(
            "SELECT {DEAD_LETTER_COLUMNS} FROM {}.queue_dead_letters ORDER BY seq LIMIT $1",
            self.schema
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(decode_dead_letter).collect()
    }

    /// One dead letter and its payload, if it exists (the oldest, if the id names several).
    pub async fn get(&self, id: Uuid) -> Result<Option<(QueueDeadLetter, Vec<u8>)>> {
        let sql = format!(
            "SELECT {DEAD_LETTER_COLUMNS}, payload FROM {}.queue_dead_letters \
             WHERE message_id = $1 ORDER BY seq LIMIT 1",
            self.schema
        );
        let row = sqlx::query(AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| Ok((decode_dead_letter(&r)?, r.try_get("payload")?)))
            .transpose()
    }

    /// Moves these dead letters back into the queue at their original positions (same
    /// `seq`), visible at once and with a fresh delivery count: each is delivered before the
    /// messages its key held back. Returns how many of the distinct `ids` were found.
    pub async fn replay(&self, ids: &[Uuid]) -> Result<u64> {
        let s = &self.schema;
        let sql = format!(
            "WITH moved AS (DELETE FROM {s}.queue_dead_letters WHERE message_id = ANY($1) RETURNING *), \
             back AS (\
               INSERT INTO {s}.queue (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at) \
               OVERRIDING SYSTEM VALUE \
               SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at FROM moved \
               RETURNING message_id) \
             SELECT pg_catalog.count(DISTINCT message_id) FROM back"
        );
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(ids)
            .fetch_one(&self.pool)
            .await?;
        let n = n as u64;
        tracing::info!(
            schema = s.as_str(),
            requested = ids.len(),
            replayed = n,
            "pgbox queue dead letters replayed"
        );
        tracing::debug!(?ids, "pgbox queue dead letters replayed: ids");
        Ok(n)
    }

    /// Replays every dead letter.
    pub async fn replay_all(&self) -> Result<u64> {
        let sql = format!(
            "SELECT DISTINCT message_id FROM {}.queue_dead_letters",
            self.schema
        );
        let ids: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?;
        self.replay(&ids).await
    }

    /// Deletes these dead letters for good, releasing their ordering keys. Returns how many
    /// of the distinct `ids` were found.
    pub async fn discard(&self, ids: &[Uuid]) -> Result<u64> {
        let s = &self.schema;
        let sql = format!(
            "WITH gone AS (DELETE FROM {s}.queue_dead_letters WHERE message_id = ANY($1) RETURNING message_id) \
             SELECT pg_catalog.count(DISTINCT message_id) FROM gone"
        );
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(ids)
            .fetch_one(&self.pool)
            .await?;
        let n = n as u64;
        tracing::warn!(
            schema = s.as_str(),
            requested = ids.len(),
            discarded = n,
            "pgbox queue dead letters discarded"
        );
        tracing::debug!(?ids, "pgbox queue dead letters discarded: ids");
        Ok(n)
    }
}

fn decode_dead_letter(r: &PgRow) -> Result<QueueDeadLetter> {
    let headers: Json<BTreeMap<String, String>> = r.try_get("headers")?;
    Ok(QueueDeadLetter {
        seq: r.try_get("seq")?,
        message_id: r.try_get("message_id")?,
        topic: r.try_get("topic")?,
        ordering_key: r.try_get("ordering_key")?,
        headers: headers.0,
        payload_bytes: r.try_get("payload_bytes")?,
        deliveries: r.try_get("deliveries")?,
        last_error: r.try_get("last_error")?,
        created_at: r.try_get("created_at")?,
        dead_at: r.try_get("dead_at")?,
    })
}
