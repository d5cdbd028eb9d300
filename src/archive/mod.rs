//! The archive of delivered messages, and their replay.
//!
//! Opt in per relay: [`RelayBuilder::archive`](crate::RelayBuilder::archive) (the table
//! outbox) or [`WalRelayBuilder::archive`](crate::WalRelayBuilder::archive) (the WAL outbox).
//! Published messages then land in `outbox_archive` (migration V17) with their id, topic,
//! ordering key, payload, content type, headers and enqueue time, and the time they were
//! archived (the publishing round's transaction start: the publish time).
//!
//! - **Table relay**: the round's settling statement moves the confirmed rows, in the same
//!   statement (`DELETE … RETURNING` feeding the archive's `INSERT`), also when the batch moves
//!   into the built-in queue in the same database (one `DELETE` feeds both inserts). A message
//!   is archived if and only if its publication is settled: exactly once.
//! - **WAL relay**: after the transport confirmed a batch and before the slot moves past it,
//!   its messages are inserted in one transaction. A crash between the two reads the batch
//!   again, publishes it again (at-least-once, as ever) and archives it again: the archive
//!   may hold a WAL message twice, and [`Replay`] keeps only its first copy.
//!
//! Retention drops whole partitions (no `DELETE`, no vacuum): the table is partitioned by
//! archive time, partitions are created ahead by the relay at start and by the
//! [`Janitor`](crate::janitor::Janitor), which also drops the expired ones. A default
//! partition takes any insert no range partition covers, so archiving never fails for want
//! of a partition; creating partitions moves its rows out.
//!
//! [`Archive::replay`] enqueues archived messages into the outbox again (see [`Replay`]).

mod replay;

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;

use crate::error::{Error, Result};
use crate::ident::{DEFAULT_SCHEMA, Identifier};
use crate::outbox::Envelope;

pub use self::replay::{REPLAY_ID_HEADER, Replay, ReplayCursor, ReplayReport};

/// How long delivered messages are archived, and how the archive is partitioned.
///
/// ```
/// use std::time::Duration;
/// let week = pgbox::ArchiveRetention::days(7);
/// assert_eq!(week.retention(), Duration::from_secs(7 * 86_400));
/// assert_eq!(week.width(), Duration::from_secs(86_400));
/// let short = pgbox::ArchiveRetention::hours(6);
/// assert_eq!(short.width(), Duration::from_secs(3_600));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchiveRetention {
    retention: Duration,
    every: Duration,
    ahead: u32,
}

impl ArchiveRetention {
    /// Partitions kept created ahead of the current one, unless told otherwise: 3.
    pub const DEFAULT_AHEAD: u32 = 3;

    /// Keep archived messages `days` days, in daily partitions.
    pub fn days(days: u32) -> Self {
        ArchiveRetention {
            retention: Duration::from_secs(u64::from(days) * 86_400),
            every: Duration::from_secs(86_400),
            ahead: Self::DEFAULT_AHEAD,
        }
    }

    /// Keep archived messages `hours` hours, in hourly partitions.
    pub fn hours(hours: u32) -> Self {
        ArchiveRetention {
            retention: Duration::from_secs(u64::from(hours) * 3_600),
            every: Duration::from_secs(3_600),
            ahead: Self::DEFAULT_AHEAD,
        }
    }

    /// The width of one partition (whole seconds, 1 s to 366 days). A partition is dropped
    /// once its newest possible row is older than the retention, so a message is kept for
    /// the retention and at most one width more.
    pub fn every(mut self, width: Duration) -> Self {
        self.every = width;
        self
    }

    /// Partitions kept created after the current one (1 to 100): the margin for when no
    /// janitor runs. Past it, messages go to the default partition (never refused), which
    /// the next partition creation empties.
    pub fn ahead(mut self, partitions: u32) -> Self {
        self.ahead = partitions;
        self
    }

    /// The retention.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// The width of one partition.
    pub fn width(&self) -> Duration {
        self.every
    }

    /// Partitions kept ahead.
    pub fn partitions_ahead(&self) -> u32 {
        self.ahead
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.every < Duration::from_secs(1)
            || self.every > Duration::from_secs(366 * 86_400)
            || self.every.subsec_nanos() != 0
        {
            return Err(Error::InvalidConfig(format!(
                "archive partition width {:?} must be whole seconds, from 1 s to 366 days",
                self.every
            )));
        }
        if self.retention < Duration::from_secs(1)
            || self.retention > Duration::from_secs(100 * 366 * 86_400)
        {
            return Err(Error::InvalidConfig(format!(
                "archive retention {:?} must be from 1 s to a century",
                self.retention
            )));
        }
        if !(1..=100).contains(&self.ahead) {
            return Err(Error::InvalidConfig(format!(
                "archive partitions ahead must be 1 to 100, not {}",
                self.ahead
            )));
        }
        Ok(())
    }

    /// Records these settings and creates partitions ahead (through the `SECURITY DEFINER`
    /// `outbox_archive_configure`, so an application role may). Returns the partitions
    /// created.
    ///
    /// `lengthen_only` (a relay starting): where settings are recorded, only a longer
    /// retention or margin is taken, so a relay never shortens what another relay or an
    /// explicit [`Archive::configure`] set.
    pub(crate) async fn apply(
        &self,
        pool: &PgPool,
        schema: &Identifier,
        lengthen_only: bool,
    ) -> Result<Vec<String>> {
        let sql = format!(
            "SELECT * FROM {}.outbox_archive_configure(\
               $1 * interval '1 microsecond', $2 * interval '1 microsecond', $3, $4)",
            schema.quoted()
        );
        // Rare (a relay's start, an operator's call): an unnamed statement in a transaction of
        // its own, right behind a pooler in transaction mode too (see `crate::pooler`).
        let mut tx = crate::pooler::begin(pool, None).await?;
        let created = sqlx::query_scalar(AssertSqlSafe(sql))
            .persistent(false)
            .bind(micros(self.every))
            .bind(micros(self.retention))
            .bind(self.ahead as i32)
            .bind(lengthen_only)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(created)
    }

    /// A relay's start: records these settings, lengthening only (see [`Self::apply`]), and
    /// logs what the archive keeps. A relay asking for less than what another relay or
    /// [`Archive::configure`] set gets the longer retention, and the log says so (the
    /// retention asked for is not the one in force).
    pub(crate) async fn prepare_for_relay(&self, pool: &PgPool, schema: &Identifier) -> Result<()> {
        let created = self.apply(pool, schema, true).await?;
        let sql = format!(
            "SELECT (extract(epoch FROM retention) * 1000000)::int8 FROM {}.outbox_archive_settings",
            schema.quoted()
        );
        let kept: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .persistent(false)
            .fetch_optional(pool)
            .await?;
        let kept = kept.map(|us| Duration::from_micros(us.max(0) as u64));
        match kept {
            Some(kept) if kept > self.retention => tracing::warn!(
                schema = schema.as_str(),
                asked = ?self.retention,
                kept = ?kept,
                "pgbox relay archives published messages, for longer than it asked: the archive's \
                 retention was set longer (by another relay or Archive::configure); relays only \
                 lengthen it, Archive::configure shortens it"
            ),
            _ => tracing::info!(
                schema = schema.as_str(),
                retention = ?self.retention,
                created = created.len(),
                "pgbox relay archives published messages"
            ),
        }
        Ok(())
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// The columns an archive row is written with, in this order.
const ARCHIVE_COLUMNS: &str =
    "source_seq, message_id, topic, ordering_key, payload, content_type, headers, created_at";

/// The table relay's settling statement with archiving on: the confirmed rows (`$1`, seqs)
/// leave the outbox and enter the archive in one statement, in seq order; with
/// `queue_schema`, the same `DELETE` also feeds the built-in queue's insert. The statement's
/// row count is the archive insert's (one per settled row).
pub(crate) fn settle_sql(s: &Identifier, queue_schema: Option<&Identifier>) -> String {
    let moved = format!(
        "moved AS (DELETE FROM {s}.outbox WHERE seq = ANY($1) \
           RETURNING seq, message_id, topic, ordering_key, payload, content_type, headers, created_at)"
    );
    let queued = match queue_schema {
        Some(q) => format!(
            ", queued AS (INSERT INTO {q}.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
               SELECT message_id, topic, ordering_key, payload, content_type, headers, created_at \
               FROM moved ORDER BY seq)"
        ),
        None => String::new(),
    };
    format!(
        "WITH {moved}{queued} \
         INSERT INTO {s}.outbox_archive ({ARCHIVE_COLUMNS}) \
         SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at \
         FROM moved ORDER BY seq"
    )
}

/// Advisory-lock class of the archive's order lock, keyed by `hashtext(schema)`.
const ARCHIVE_ORDER_CLASS: i32 = 0x7062_6f61; // "pboa"

/// Taken (transaction level) before a transaction draws archive `seq`s, and held until it
/// commits: archiving transactions then commit in `seq` order, so a replay that read up to
/// some `seq` has seen every row below it (a row drawn earlier but committed later would be
/// skipped by a replay resumed past it). Costs the relays' archiving rounds their concurrency
/// between the archive insert and the commit.
pub(crate) fn order_lock_sql(schema: &Identifier) -> String {
    format!(
        "SELECT pg_catalog.pg_advisory_xact_lock({ARCHIVE_ORDER_CLASS}, pg_catalog.hashtext('{name}'))",
        name = schema.as_str()
    )
}

/// Archives messages the WAL relay's transport confirmed, in the given order, in one
/// transaction (under the archive's order lock).
pub(crate) async fn archive_envelopes(
    pool: &PgPool,
    schema: &Identifier,
    messages: &[&Envelope],
) -> Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    let n = messages.len();
    let (mut ids, mut topics, mut keys, mut payloads, mut types, mut headers, mut created) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for m in messages {
        ids.push(m.id);
        topics.push(m.topic.as_str());
        keys.push(m.ordering_key.as_deref());
        payloads.push(m.payload.as_slice());
        types.push(m.content_type.as_str());
        headers.push(sqlx::types::Json(&m.headers));
        created.push(m.created_at);
    }
    let sql = format!(
        "INSERT INTO {s}.outbox_archive ({ARCHIVE_COLUMNS}) \
         SELECT NULL, m.id, m.topic, m.key, m.payload, m.content_type, m.headers, m.created_at \
         FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::timestamptz[]) \
           WITH ORDINALITY AS m(id, topic, key, payload, content_type, headers, created_at, n) \
         ORDER BY m.n",
        s = schema.quoted()
    );
    let mut tx = crate::pooler::begin(pool, None).await?;
    sqlx::query(AssertSqlSafe(order_lock_sql(schema)))
        .execute(&mut *tx)
        .await?;
    sqlx::query(AssertSqlSafe(sql))
        .bind(ids)
        .bind(topics)
        .bind(keys)
        .bind(payloads)
        .bind(types)
        .bind(headers)
        .bind(created)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// One range partition of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArchivePartition {
    /// The table's name (in the pgbox schema).
    pub name: String,
    /// Messages archived from this time (inclusive)...
    pub from: OffsetDateTime,
    /// ...to this time (exclusive).
    pub to: OffsetDateTime,
    /// The planner's row estimate (`pg_class.reltuples`), `None` before the first ANALYZE.
    pub rows_estimate: Option<i64>,
}

/// A snapshot of the archive: settings, partitions, and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArchiveStatus {
    /// The settings last recorded by a relay (or [`Archive::configure`]); `None` if no relay
    /// ever archived with settings.
    pub retention: Option<ArchiveRetention>,
    /// The range partitions, oldest first.
    pub partitions: Vec<ArchivePartition>,
    /// Rows in the default partition (archived while no range partition covered their
    /// time): 0 in steady state; the next partition creation moves them.
    pub default_rows: i64,
    /// The oldest archive time held, if any.
    pub oldest: Option<OffsetDateTime>,
    /// The newest archive time held, if any.
    pub newest: Option<OffsetDateTime>,
    /// The highest archive position (cursor) held, if any.
    pub last_seq: Option<i64>,
}

/// Administration of a schema's archive, and the entry to replay.
///
/// Reading it and replaying need `SELECT` on `outbox_archive` and `INSERT` on `outbox`, which
/// the application role has ([`Migrator::grant_to`](crate::Migrator::grant_to)); replay is
/// an operator's act: give it to the roles you let re-publish messages.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// let archive = pgbox::Archive::new(pool);
/// let status = archive.status().await?;
/// println!("{} partitions", status.partitions.len());
/// let report = archive.replay().topic("payments").ordering_key("order-42").run().await?;
/// println!("replayed {}", report.replayed);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Archive {
    pool: PgPool,
    schema: Identifier,
}

impl Archive {
    /// The archive of the default schema.
    pub fn new(pool: PgPool) -> Self {
        Archive {
            pool,
            schema: Identifier::pgbox_schema(DEFAULT_SCHEMA).expect("default schema is valid"),
        }
    }

    /// Uses `schema` instead of the default (validated).
    pub fn with_schema(mut self, schema: &str) -> Result<Self> {
        self.schema = Identifier::pgbox_schema(schema)?;
        Ok(self)
    }

    /// The schema.
    pub fn schema(&self) -> &str {
        self.schema.as_str()
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(crate) fn schema_identifier(&self) -> &Identifier {
        &self.schema
    }

    /// Records `retention` as the archive's settings and creates partitions ahead; returns
    /// the partitions created. A relay built with `archive(..)` does this at start.
    pub async fn configure(&self, retention: ArchiveRetention) -> Result<Vec<String>> {
        retention.validate()?;
        retention.apply(&self.pool, &self.schema, false).await
    }

    /// The recorded settings, if any.
    pub async fn settings(&self) -> Result<Option<ArchiveRetention>> {
        let sql = format!(
            "SELECT (extract(epoch FROM retention) * 1000000)::int8, \
                    (extract(epoch FROM every) * 1000000)::int8, ahead \
             FROM {}.outbox_archive_settings",
            self.schema.quoted()
        );
        let Some(row) = sqlx::query(AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await?
        else {
            return Ok(None);
        };
        let d = |us: i64| Duration::from_micros(us.max(0) as u64);
        Ok(Some(ArchiveRetention {
            retention: d(row.try_get(0)?),
            every: d(row.try_get(1)?),
            ahead: row.try_get::<i32, _>(2)?.max(0) as u32,
        }))
    }

    /// The range partitions, oldest first.
    pub async fn partitions(&self) -> Result<Vec<ArchivePartition>> {
        let partitions = crate::inbox::partitions::range_partitions(
            &self.pool,
            &self.schema,
            "outbox_archive_partitions",
        )
        .await?;
        Ok(partitions
            .into_iter()
            .map(|p| ArchivePartition {
                name: p.name,
                from: p.from,
                to: p.to,
                rows_estimate: p.rows_estimate,
            })
            .collect())
    }

    /// Settings, partitions, and the span of what is archived.
    pub async fn status(&self) -> Result<ArchiveStatus> {
        let s = self.schema.quoted();
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT (SELECT pg_catalog.count(*) FROM {s}.outbox_archive_default)::int8, \
                    (SELECT pg_catalog.min(archived_at) FROM {s}.outbox_archive), \
                    (SELECT pg_catalog.max(archived_at) FROM {s}.outbox_archive), \
                    (SELECT pg_catalog.max(seq) FROM {s}.outbox_archive)"
        )))
        .fetch_one(&self.pool)
        .await?;
        Ok(ArchiveStatus {
            retention: self.settings().await?,
            partitions: self.partitions().await?,
            default_rows: row.try_get(0)?,
            oldest: row.try_get(1)?,
            newest: row.try_get(2)?,
            last_seq: row.try_get(3)?,
        })
    }

    /// Moves any rows out of the default partition and creates the partitions missing up
    /// to the configured number ahead (daily, 3 ahead, before any settings are recorded);
    /// returns their names. Safe to call from many instances at once.
    pub async fn create_ahead(&self) -> Result<Vec<String>> {
        let sql = format!(
            "SELECT * FROM {}.outbox_archive_create_ahead()",
            self.schema.quoted()
        );
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?)
    }

    /// Drops the partitions whose every row is older than the recorded retention, oldest
    /// first; returns their names. Never the current partition; nothing before settings are
    /// recorded. Each drop waits at most 5 s for its lock (what it could not lock is left to
    /// the next call).
    pub async fn drop_expired(&self) -> Result<Vec<String>> {
        let sql = format!(
            "SELECT * FROM {}.outbox_archive_drop_expired()",
            self.schema.quoted()
        );
        let dropped: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?;
        if !dropped.is_empty() {
            tracing::info!(schema = self.schema.as_str(), dropped = ?dropped, "pgbox archive partitions dropped");
        }
        Ok(dropped)
    }

    /// A replay of archived messages into the outbox (see [`Replay`]).
    pub fn replay(&self) -> Replay {
        Replay::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_is_validated() {
        assert!(ArchiveRetention::days(7).validate().is_ok());
        assert!(ArchiveRetention::hours(1).validate().is_ok());
        assert!(ArchiveRetention::days(0).validate().is_err());
        assert!(ArchiveRetention::days(1).ahead(0).validate().is_err());
        assert!(
            ArchiveRetention::days(1)
                .every(Duration::from_millis(1500))
                .validate()
                .is_err()
        );
    }

    #[test]
    fn settling_feeds_archive_and_queue_from_one_delete() {
        let s = Identifier::pgbox_schema("pgbox").unwrap();
        let sql = settle_sql(&s, Some(&s));
        assert_eq!(sql.matches("DELETE FROM").count(), 1);
        assert!(sql.contains("INSERT INTO \"pgbox\".queue"));
        assert!(sql.contains("INSERT INTO \"pgbox\".outbox_archive"));
        assert!(!settle_sql(&s, None).contains(".queue"));
    }
}
