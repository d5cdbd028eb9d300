//! A cheap snapshot of the pipeline: backlog, age of the oldest pending message, dead
//! letters, per topic. Index lookups only, never `count(*)` over the outbox or the queue.

use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;

use crate::error::Result;
use crate::ident::Identifier;

/// Dead letters are counted up to this many per topic (they should be few; the cap keeps
/// the snapshot cheap when they are not).
pub const DEAD_LETTER_COUNT_CAP: i64 = 10_000;

/// Backlogs are counted exactly up to this many per topic, then estimated from sequence
/// numbers (a count past it would read every pending message).
const BACKLOG_COUNT_CAP: i64 = 10_000;

/// One topic's state.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicStatus {
    /// The topic.
    pub topic: String,
    /// Outbox messages not yet published: counted exactly up to 10,000; past that,
    /// estimated from the first and last pending sequence numbers (an upper bound: numbers
    /// of other messages in between, of this topic or another, are counted).
    pub outbox_backlog_estimate: i64,
    /// When the oldest pending outbox message was enqueued.
    pub outbox_oldest_pending: Option<OffsetDateTime>,
    /// Outbox dead letters (capped at [`DEAD_LETTER_COUNT_CAP`]).
    pub outbox_dead_letters: i64,
    /// Messages in the built-in queue (estimated like the outbox backlog).
    pub queue_backlog_estimate: i64,
    /// When the oldest message in the queue was enqueued there.
    pub queue_oldest: Option<OffsetDateTime>,
    /// Queue dead letters (capped at [`DEAD_LETTER_COUNT_CAP`]).
    pub queue_dead_letters: i64,
}

/// A snapshot of every topic with pending messages or dead letters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Status {
    /// Per topic, sorted by name.
    pub topics: Vec<TopicStatus>,
    /// When the snapshot was taken (database clock).
    pub taken_at: OffsetDateTime,
    /// Scheduled messages not yet due and promoted (all topics), counted exactly up to
    /// 10,000 (then 10,000).
    pub scheduled: i64,
    /// When the earliest scheduled message falls due (database clock), if any.
    pub next_scheduled_due: Option<OffsetDateTime>,
}

/// Takes a [`Status`] snapshot of the pgbox tables in `schema`.
pub async fn status(pool: &PgPool, schema: &str) -> Result<Status> {
    let s = Identifier::pgbox_schema(schema)?;
    // Distinct topics by a loose index scan: one index probe per topic, not a table scan.
    let topics_of = |table: &str, index_filter: &str| {
        format!(
            "WITH RECURSIVE t(topic) AS (\
               (SELECT topic FROM {s}.{table} WHERE {index_filter} ORDER BY topic LIMIT 1) \
               UNION ALL \
               SELECT (SELECT topic FROM {s}.{table} WHERE {index_filter} AND topic > t.topic ORDER BY topic LIMIT 1) \
               FROM t WHERE t.topic IS NOT NULL) \
             SELECT topic FROM t WHERE topic IS NOT NULL"
        )
    };
    let sql = format!(
        "SELECT DISTINCT topic FROM (({}) UNION ALL ({}) UNION ALL SELECT topic FROM {s}.outbox_dead_letters \
         UNION ALL SELECT topic FROM {s}.queue_dead_letters) AS all_topics ORDER BY topic",
        topics_of("outbox", "published_at IS NULL"),
        topics_of("queue", "true"),
    );
    let topics: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_all(pool)
        .await?;
    let per_topic = format!(
        "SELECT \
           (SELECT CASE WHEN pg_catalog.count(*) < $3 THEN pg_catalog.count(*) ELSE \
              (SELECT pg_catalog.max(seq) - pg_catalog.min(seq) + 1 FROM {s}.outbox WHERE topic = $1 AND published_at IS NULL) END \
            FROM (SELECT 1 FROM {s}.outbox WHERE topic = $1 AND published_at IS NULL LIMIT $3) b), \
           (SELECT created_at FROM {s}.outbox WHERE topic = $1 AND published_at IS NULL ORDER BY seq LIMIT 1), \
           (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.outbox_dead_letters WHERE topic = $1 LIMIT $2) d), \
           (SELECT CASE WHEN pg_catalog.count(*) < $3 THEN pg_catalog.count(*) ELSE \
              (SELECT pg_catalog.max(seq) - pg_catalog.min(seq) + 1 FROM {s}.queue WHERE topic = $1) END \
            FROM (SELECT 1 FROM {s}.queue WHERE topic = $1 LIMIT $3) b), \
           (SELECT enqueued_at FROM {s}.queue WHERE topic = $1 ORDER BY seq LIMIT 1), \
           (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.queue_dead_letters WHERE topic = $1 LIMIT $2) d), \
           pg_catalog.now()"
    );
    let mut out = Vec::with_capacity(topics.len());
    let mut taken_at = None;
    for topic in topics {
        let row = sqlx::query(AssertSqlSafe(per_topic.clone()))
            .bind(&topic)
            .bind(DEAD_LETTER_COUNT_CAP)
            .bind(BACKLOG_COUNT_CAP)
            .fetch_one(pool)
            .await?;
        taken_at = Some(row.try_get(6)?);
        out.push(TopicStatus {
            topic,
            outbox_backlog_estimate: row.try_get::<Option<i64>, _>(0)?.unwrap_or(0),
            outbox_oldest_pending: row.try_get(1)?,
            outbox_dead_letters: row.try_get(2)?,
            queue_backlog_estimate: row.try_get::<Option<i64>, _>(3)?.unwrap_or(0),
            queue_oldest: row.try_get(4)?,
            queue_dead_letters: row.try_get(5)?,
        });
    }
    let taken_at = match taken_at {
        Some(t) => t,
        None => {
            sqlx::query_scalar("SELECT pg_catalog.now()")
                .fetch_one(pool)
                .await?
        }
    };
    // Both read the due-time index: the count stops at the cap, the earliest is its first
    // entry.
    let (scheduled, next_scheduled_due): (i64, Option<OffsetDateTime>) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.outbox_scheduled LIMIT $1) AS c), \
               (SELECT pg_catalog.min(due_at) FROM {s}.outbox_scheduled)"
        )))
        .bind(DEAD_LETTER_COUNT_CAP)
        .fetch_one(pool)
        .await?;
    Ok(Status {
        topics: out,
        taken_at,
        scheduled,
        next_scheduled_due,
    })
}

/// Rows are counted per consumer up to this many (an index-only scan that stops there).
pub const INBOX_COUNT_CAP: i64 = 1_000_000;

/// One consumer's inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerInbox {
    /// The consumer name.
    pub consumer: String,
    /// Rows recorded (counted up to [`INBOX_COUNT_CAP`]).
    pub rows: i64,
    /// The oldest row (what the next purge would delete first).
    pub oldest_processed_at: Option<OffsetDateTime>,
    /// The newest row (is the consumer alive?).
    pub newest_processed_at: Option<OffsetDateTime>,
    /// Keys under a live lease (lease mode's CONSUMING, not yet expired), counted up to
    /// [`LEASE_COUNT_CAP`].
    pub live_leases: i64,
    /// Keys under an expired lease: abandoned by a holder that crashed or stalled, taken
    /// over by the next delivery, purged by age (counted up to [`LEASE_COUNT_CAP`]).
    pub expired_leases: i64,
    /// The earliest expiry among the keys under a lease: in the past when some lease was
    /// abandoned (since then).
    pub earliest_lease_expiry: Option<OffsetDateTime>,
}

/// Leases are counted per consumer and state up to this many (a scan of the small partial
/// index of leased keys that stops there).
pub const LEASE_COUNT_CAP: i64 = 10_000;

/// Per-consumer inbox summary of the pgbox tables in `schema`, with live and expired leases:
/// index lookups only (leases through the partial index `inbox_leases_idx`).
pub async fn inbox_status(pool: &PgPool, schema: &str) -> Result<Vec<ConsumerInbox>> {
    let s = Identifier::pgbox_schema(schema)?;
    let consumers = format!(
        "WITH RECURSIVE c(consumer) AS (\
           (SELECT consumer FROM {s}.inbox ORDER BY consumer LIMIT 1) \
           UNION ALL \
           SELECT (SELECT consumer FROM {s}.inbox WHERE consumer > c.consumer ORDER BY consumer LIMIT 1) \
           FROM c WHERE c.consumer IS NOT NULL) \
         SELECT consumer FROM c WHERE consumer IS NOT NULL"
    );
    let names: Vec<String> = sqlx::query_scalar(AssertSqlSafe(consumers))
        .fetch_all(pool)
        .await?;
    let per_consumer = format!(
        "SELECT \
           (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.inbox WHERE consumer = $1 LIMIT $2) n), \
           (SELECT processed_at FROM {s}.inbox WHERE consumer = $1 ORDER BY processed_at LIMIT 1), \
           (SELECT processed_at FROM {s}.inbox WHERE consumer = $1 ORDER BY processed_at DESC LIMIT 1), \
           (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.inbox \
              WHERE consumer = $1 AND lease_expires_at > pg_catalog.now() LIMIT $3) l), \
           (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.inbox \
              WHERE consumer = $1 AND lease_expires_at <= pg_catalog.now() LIMIT $3) e), \
           (SELECT lease_expires_at FROM {s}.inbox \
              WHERE consumer = $1 AND lease_expires_at IS NOT NULL ORDER BY lease_expires_at LIMIT 1)"
    );
    let mut out = Vec::with_capacity(names.len());
    for consumer in names {
        let row = sqlx::query(AssertSqlSafe(per_consumer.clone()))
            .bind(&consumer)
            .bind(INBOX_COUNT_CAP)
            .bind(LEASE_COUNT_CAP)
            .fetch_one(pool)
            .await?;
        out.push(ConsumerInbox {
            consumer,
            rows: row.try_get(0)?,
            oldest_processed_at: row.try_get(1)?,
            newest_processed_at: row.try_get(2)?,
            live_leases: row.try_get(3)?,
            expired_leases: row.try_get(4)?,
            earliest_lease_expiry: row.try_get(5)?,
        });
    }
    Ok(out)
}
