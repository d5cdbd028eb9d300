//! The time-partitioned inbox: expiry drops whole partitions instead of deleting rows.
//!
//! Opt in per schema with [`Migrator::partitioned_inbox`](crate::Migrator::partitioned_inbox)
//! and build the consumers' inboxes with
//! [`InboxBuilder::partitioned`](crate::InboxBuilder::partitioned). The table
//! `partitioned_inbox` is partitioned by range of `processed_at` (the claiming transaction's
//! start time), one partition per [`InboxPartitioning::every`].
//!
//! PostgreSQL cannot enforce a unique `(consumer, key)` across partitions, so the claim does
//! (migration V10 has the details):
//! 1. it takes a transaction-scoped advisory lock derived from `(consumer, key)`: claims of
//!    one key, to whichever partition each would write, run one after the other;
//! 2. in a new statement, whose READ COMMITTED snapshot is taken after the lock was granted,
//!    it looks the key up in every partition (and in the plain inbox's records from before
//!    the switch);
//! 3. only if none holds the key does it insert, into the partition of its transaction's
//!    start time; each partition's unique index on `(consumer, key)` backs the look-up.
//!
//! A duplicate takes the lock and reads: no row, no transaction id, no WAL. Claims run only
//! under READ COMMITTED: REPEATABLE READ and SERIALIZABLE are refused
//! ([`Error::InboxLayout`]), because their snapshot can predate the lock and miss a holder
//! that committed into another partition (SSI does not track a READ COMMITTED holder, so
//! SERIALIZABLE gives no protection). Lease mode is not available on a partitioned inbox;
//! a lease taken in the plain inbox before the switch keeps working (complete, extend,
//! release), a claim of its key is in progress while it lasts and takes it over once it has
//! expired, and a batch holding its key fails with [`Error::KeyInProgress`].
//!
//! Expiry ([`InboxPartitions::drop_expired`], or the [`Janitor`](crate::janitor::Janitor))
//! detaches a partition concurrently (claims go on) and drops it: no DELETE, no dead tuples,
//! no vacuum. A partition is dropped only when its newest possible row is older than the
//! retention, and never with a retention shorter than
//! [`InboxPartitioning::minimum_retention`], which the database itself enforces.

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;

use crate::error::{Error, Result};
use crate::ident::DEFAULT_SCHEMA;
use crate::ident::Identifier;

/// Settings of the time-partitioned inbox, given to
/// [`Migrator::partitioned_inbox`](crate::Migrator::partitioned_inbox).
///
/// ```
/// use std::time::Duration;
/// let daily = pgbox::InboxPartitioning::every(Duration::from_secs(24 * 3600))
///     .minimum_retention(Duration::from_secs(3 * 24 * 3600))
///     .ahead(3);
/// assert_eq!(daily.width(), Duration::from_secs(86_400));
/// ```
///
/// Every claim looks a key up in every partition: keep the number of live partitions
/// (retention ÷ width, plus [`ahead`](Self::ahead)) in the tens, e.g. daily partitions for a
/// week or two of retention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboxPartitioning {
    every: Duration,
    minimum_retention: Duration,
    ahead: u32,
}

impl InboxPartitioning {
    /// Partitions kept created ahead of the current one, unless told otherwise: 3.
    pub const DEFAULT_AHEAD: u32 = 3;

    /// Default minimum retention (the redelivery window): 1 day.
    pub const DEFAULT_MINIMUM_RETENTION: Duration = Duration::from_secs(24 * 3600);

    /// The widest partition accepted: 366 days.
    pub const MAX_WIDTH: Duration = Duration::from_secs(366 * 24 * 3600);

    /// One partition per `width` of claim time (at least 1 s, whole seconds), aligned on
    /// multiples of it since the Unix epoch. The default minimum retention is
    /// [`DEFAULT_MINIMUM_RETENTION`](Self::DEFAULT_MINIMUM_RETENTION), with
    /// [`DEFAULT_AHEAD`](Self::DEFAULT_AHEAD) partitions created ahead.
    pub fn every(width: Duration) -> Self {
        InboxPartitioning {
            every: width,
            minimum_retention: Self::DEFAULT_MINIMUM_RETENTION,
            ahead: Self::DEFAULT_AHEAD,
        }
    }

    /// The redelivery window: no retention shorter than this is accepted by expiry, so no
    /// partition holding a claim younger than this is ever dropped. A key forgotten before
    /// its last redelivery (broker retries, dead-letter replays, producer re-sends) would be
    /// processed again.
    pub fn minimum_retention(mut self, window: Duration) -> Self {
        self.minimum_retention = window;
        self
    }

    /// How many partitions to keep created after the current one (1 to 1000). Claims fail
    /// with [`Error::InboxLayout`] if time runs past the last partition: the
    /// [`Janitor`](crate::janitor::Janitor) (or [`InboxPartitions::create_ahead`]) keeps
    /// them coming; this many are the margin for when it is not running.
    pub fn ahead(mut self, partitions: u32) -> Self {
        self.ahead = partitions;
        self
    }

    /// The width of one partition.
    pub fn width(&self) -> Duration {
        self.every
    }

    /// The configured minimum retention.
    pub fn minimum_retention_window(&self) -> Duration {
        self.minimum_retention
    }

    /// Partitions kept ahead.
    pub fn partitions_ahead(&self) -> u32 {
        self.ahead
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.every < Duration::from_secs(1)
            || self.every > Self::MAX_WIDTH
            || self.every.subsec_nanos() != 0
        {
            return Err(Error::InvalidConfig(format!(
                "partition width {:?} must be whole seconds, from 1 s to 366 days",
                self.every
            )));
        }
        if self.minimum_retention > Duration::from_secs(100 * 366 * 24 * 3600) {
            return Err(Error::InvalidConfig(format!(
                "minimum retention {:?} is longer than a century",
                self.minimum_retention
            )));
        }
        if !(1..=1000).contains(&self.ahead) {
            return Err(Error::InvalidConfig(format!(
                "partitions ahead must be 1 to 1000, not {}",
                self.ahead
            )));
        }
        Ok(())
    }

    /// Switches `schema` to the partitioned inbox (or updates its settings) and creates the
    /// first partitions; returns the partitions created. The migrator has called
    /// [`validate`](Self::validate) before it took its lock.
    pub(crate) async fn apply(
        &self,
        conn: &mut sqlx::PgConnection,
        schema: &Identifier,
    ) -> Result<Vec<String>> {
        let sql = format!(
            "SELECT * FROM {}.enable_partitioned_inbox(\
               $1 * interval '1 microsecond', $2 * interval '1 microsecond', $3)",
            schema.quoted()
        );
        let created: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(micros(self.every))
            .bind(micros(self.minimum_retention))
            .bind(self.ahead as i32)
            .fetch_all(conn)
            .await?;
        tracing::info!(
            schema = schema.as_str(),
            every = ?self.every,
            minimum_retention = ?self.minimum_retention,
            ahead = self.ahead,
            created = created.len(),
            "pgbox partitioned inbox enabled"
        );
        Ok(created)
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// One partition of the partitioned inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxPartition {
    /// The table's name (in the pgbox schema).
    pub name: String,
    /// Claims from this time (inclusive)...
    pub from: OffsetDateTime,
    /// ...to this time (exclusive).
    pub to: OffsetDateTime,
    /// The planner's row estimate (`pg_class.reltuples`), `None` before the first ANALYZE.
    pub rows_estimate: Option<i64>,
}

/// Administration of a schema's partitioned inbox: list, create ahead, expire.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// use std::time::Duration;
/// let partitions = pgbox::InboxPartitions::new(pool);
/// partitions.create_ahead().await?;
/// let dropped = partitions.drop_expired(Duration::from_secs(7 * 24 * 3600)).await?;
/// println!("dropped {} partitions", dropped.len());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct InboxPartitions {
    pool: PgPool,
    schema: Identifier,
}

impl InboxPartitions {
    /// The partitioned inbox of the default schema.
    pub fn new(pool: PgPool) -> Self {
        InboxPartitions {
            pool,
            schema: Identifier::pgbox_schema(DEFAULT_SCHEMA).expect("default schema is valid"),
        }
    }

    /// Uses `schema` instead of the default.
    pub fn schema(mut self, schema: &str) -> Result<Self> {
        self.schema = Identifier::pgbox_schema(schema)?;
        Ok(self)
    }

    /// The settings, or `None` when the schema has not been switched to the partitioned
    /// inbox.
    pub async fn settings(&self) -> Result<Option<InboxPartitioning>> {
        let sql = format!(
            "SELECT (extract(epoch FROM every) * 1000000)::int8, \
                    (extract(epoch FROM minimum_retention) * 1000000)::int8, ahead \
             FROM {}.inbox_partitioning",
            self.schema.quoted()
        );
        let row = sqlx::query(AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let every: i64 = row.try_get(0)?;
        let minimum: i64 = row.try_get(1)?;
        let ahead: i32 = row.try_get(2)?;
        let duration = |us: i64| Duration::from_micros(us.max(0) as u64);
        Ok(Some(InboxPartitioning {
            every: duration(every),
            minimum_retention: duration(minimum),
            ahead: ahead.max(0) as u32,
        }))
    }

    /// The attached partitions, oldest first.
    pub async fn list(&self) -> Result<Vec<InboxPartition>> {
        let partitions = range_partitions(&self.pool, &self.schema, "inbox_partitions").await?;
        Ok(partitions
            .into_iter()
            .map(|p| InboxPartition {
                name: p.name,
                from: p.from,
                to: p.to,
                rows_estimate: p.rows_estimate,
            })
            .collect())
    }

    /// Creates the partitions missing up to [`InboxPartitioning::ahead`] after the current
    /// one; returns their names. Safe to call from many instances at once.
    ///
    /// Works for an application role without `CREATE` or ownership: it calls
    /// `inbox_partitions_create_ahead()`, a `SECURITY DEFINER` function owned by the role that
    /// ran the migrations, which takes no argument and runs with a pinned `search_path`. The
    /// role needs `EXECUTE` on it ([`Migrator::grant_to`](crate::Migrator::grant_to)).
    pub async fn create_ahead(&self) -> Result<Vec<String>> {
        let sql = format!(
            "SELECT * FROM {}.inbox_partitions_create_ahead()",
            self.schema.quoted()
        );
        let created: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| layout_error(e.into()))?;
        if !created.is_empty() {
            tracing::info!(schema = self.schema.as_str(), created = ?created, "pgbox inbox partitions created");
        }
        Ok(created)
    }

    /// Detaches and drops every partition whose rows are all older than `retention`
    /// (its upper bound at or before `now() - retention`), oldest first; returns them.
    ///
    /// A retention shorter than the configured
    /// [`minimum_retention`](InboxPartitioning::minimum_retention) is refused by the
    /// database, before anything is dropped. Each partition is detached `CONCURRENTLY`
    /// (claims are never blocked) and then dropped; a detach or drop left half-done by a
    /// crash is finished by the next call.
    ///
    /// Needs the owner of `partitioned_inbox` (the role that ran the migrations, or a member
    /// of it): `DETACH ... CONCURRENTLY` cannot run inside a `SECURITY DEFINER` function.
    /// Another role gets [`DbErrorKind::InsufficientPrivilege`](crate::DbErrorKind) before
    /// anything is detached (see [`InboxPartitions::can_drop`]).
    pub async fn drop_expired(&self, retention: Duration) -> Result<Vec<InboxPartition>> {
        let s = self.schema.quoted();
        // As a role that does not own the table, fail here, with the server's own
        // insufficient_privilege error, before anything is looked up or detached.
        if !self.can_drop().await? {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "DO $$ BEGIN RAISE EXCEPTION 'must be owner of table {s_lit}.partitioned_inbox to drop its partitions' \
                 USING ERRCODE = '42501', HINT = 'run the expiry (pgbox partitions drop, or the janitor) as the role that ran pgbox''s migrations'; END $$",
                s_lit = self.schema.as_str()
            )))
            .execute(&self.pool)
            .await?;
        }
        self.finish_interrupted().await?;
        let expired_sql =
            format!("SELECT * FROM {s}.inbox_partitions_expired($1 * interval '1 microsecond')");
        let expired: Vec<String> = sqlx::query_scalar(AssertSqlSafe(expired_sql))
            .bind(micros(retention))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| layout_error(e.into()))?;
        if expired.is_empty() {
            return Ok(Vec::new());
        }
        let listed = self.list().await?;
        let mut dropped = Vec::new();
        for name in expired {
            let table = partition_name(&name)?;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {s}.partitioned_inbox DETACH PARTITION {s}.{table} CONCURRENTLY"
            )))
            .execute(&self.pool)
            .await?;
            sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {s}.{table}")))
                .execute(&self.pool)
                .await?;
            let partition = listed.iter().find(|p| p.name == name).cloned();
            tracing::info!(
                schema = self.schema.as_str(),
                partition = %name,
                rows_estimate = partition.as_ref().and_then(|p| p.rows_estimate),
                "pgbox inbox partition dropped"
            );
            if let Some(p) = partition {
                dropped.push(p);
            }
        }
        Ok(dropped)
    }

    /// Finishes what an interrupted [`drop_expired`](Self::drop_expired) left: a detach
    /// still pending (finalized), a detached partition not yet dropped (dropped). Only
    /// tables named like pgbox's partitions are touched.
    /// Whether the connected role may detach and drop partitions: it owns
    /// `partitioned_inbox`, or is a member of its owner.
    pub async fn can_drop(&self) -> Result<bool> {
        let sql = format!(
            "SELECT pg_catalog.pg_has_role(c.relowner, 'USAGE') FROM pg_catalog.pg_class AS c \
             WHERE c.oid = '{}.partitioned_inbox'::pg_catalog.regclass",
            self.schema.quoted()
        );
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await?
            .unwrap_or(false))
    }

    async fn finish_interrupted(&self) -> Result<()> {
        let s = self.schema.quoted();
        let pending: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT c.relname::text FROM pg_catalog.pg_inherits AS h JOIN pg_catalog.pg_class AS c ON c.oid = h.inhrelid \
             WHERE h.inhparent = '{s}.partitioned_inbox'::regclass AND h.inhdetachpending"
        )))
        .fetch_all(&self.pool)
        .await?;
        for name in pending {
            let table = partition_name(&name)?;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {s}.partitioned_inbox DETACH PARTITION {s}.{table} FINALIZE"
            )))
            .execute(&self.pool)
            .await?;
        }
        let detached: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_catalog.pg_class AS c \
             JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind = 'r' AND NOT c.relispartition \
               AND c.relname ~ '^partitioned_inbox_p[0-9]{8}t[0-9]{6}$'",
        )
        .bind(self.schema.as_str())
        .fetch_all(&self.pool)
        .await?;
        for name in detached {
            let table = partition_name(&name)?;
            sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {s}.{table}")))
                .execute(&self.pool)
                .await?;
            tracing::info!(partition = %name, "pgbox detached inbox partition dropped");
        }
        Ok(())
    }
}

/// A partition name read from the catalog, checked against the pattern pgbox creates before
/// it goes into DDL.
fn partition_name(name: &str) -> Result<String> {
    let rest = name.strip_prefix("partitioned_inbox_p").unwrap_or("");
    let ok = rest.len() == 15
        && rest.bytes().enumerate().all(|(i, b)| {
            if i == 8 {
                b == b't'
            } else {
                b.is_ascii_digit()
            }
        });
    if !ok {
        return Err(Error::InvalidIdentifier {
            what: "inbox partition",
            name: name.to_owned(),
            reason: "not a partition name pgbox creates (partitioned_inbox_pYYYYMMDDtHHMMSS)",
        });
    }
    Ok(Identifier::new("inbox partition", name)?.quoted())
}

/// Turns the database's refusals that mean "wrong inbox layout" into
/// [`Error::InboxLayout`], with what to do; other errors pass through.
pub(crate) fn layout_error(e: Error) -> Error {
    let Error::Database {
        source: sqlx::Error::Database(db),
        ..
    } = &e
    else {
        return e;
    };
    let code = db.code().unwrap_or_default();
    let message = db.message();
    let constraint = db.constraint().unwrap_or_default();
    let problem = match &*code {
        "23514" if constraint == "inbox_partitioned_mode" => {
            "this schema's inbox is time-partitioned: build the Inbox with InboxBuilder::partitioned(true)"
        }
        "23514" if message.starts_with("no partition of relation") => {
            "no partition of the partitioned inbox covers this transaction's start time: \
             run the Janitor (or InboxPartitions::create_ahead), or, if this schema was never \
             switched with Migrator::partitioned_inbox, build the Inbox without partitioned(true)"
        }
        "0A000" if message.starts_with("pgbox: the partitioned inbox cannot claim") => {
            return Error::InboxLayout(format!(
                "{}: its look-up must see every claim committed before the key's lock was \
                 granted, which only READ COMMITTED (the default) does; claim under READ \
                 COMMITTED, or use the plain inbox",
                message.trim_start_matches("pgbox: ")
            ));
        }
        "55000" if message.starts_with("pgbox: the partitioned inbox is not enabled") => {
            "this schema has not been switched to the partitioned inbox (Migrator::partitioned_inbox)"
        }
        "22023" if message.starts_with("pgbox: retention") => {
            return Error::InvalidConfig(format!(
                "{message}: a partition dropped before the redelivery window ends lets a redelivered message run again"
            ));
        }
        _ => return e,
    };
    Error::InboxLayout(problem.to_owned())
}

/// One range partition as `<schema>.<lister>()` lists it, with the planner's row estimate.
pub(crate) struct RangePartition {
    pub(crate) name: String,
    pub(crate) from: OffsetDateTime,
    pub(crate) to: OffsetDateTime,
    pub(crate) rows_estimate: Option<i64>,
}

/// The range partitions a pgbox listing function of `schema` returns (`inbox_partitions`,
/// `outbox_archive_partitions`: columns `r_name, r_from, r_to`), oldest first.
pub(crate) async fn range_partitions(
    pool: &PgPool,
    schema: &Identifier,
    lister: &'static str,
) -> Result<Vec<RangePartition>> {
    let sql = format!(
        "SELECT p.r_name, p.r_from, p.r_to, c.reltuples::int8 \
         FROM {s}.{lister}() AS p \
         JOIN pg_catalog.pg_class AS c ON c.relname = p.r_name \
           AND c.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = $1) \
         ORDER BY p.r_from",
        s = schema.quoted()
    );
    let rows = sqlx::query(AssertSqlSafe(sql))
        .bind(schema.as_str())
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| {
            let rows: i64 = r.try_get(3)?;
            Ok(RangePartition {
                name: r.try_get(0)?,
                from: r.try_get(1)?,
                to: r.try_get(2)?,
                rows_estimate: (rows >= 0).then_some(rows),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_names_are_checked_before_ddl() {
        assert!(partition_name("partitioned_inbox_p20261122t190316").is_ok());
        for bad in [
            "partitioned_inbox_p20261122t19031",
            "partitioned_inbox_p20261122x190316",
            "inbox",
            "partitioned_inbox_p20261122t190316; DROP TABLE x",
            "partitioned_inbox_p2026112\"t190316",
        ] {
            assert!(partition_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_are_validated() {
        let day = Duration::from_secs(86_400);
        assert!(InboxPartitioning::every(day).validate().is_ok());
        assert!(
            InboxPartitioning::every(Duration::from_millis(500))
                .validate()
                .is_err()
        );
        assert!(
            InboxPartitioning::every(Duration::from_millis(1500))
                .validate()
                .is_err()
        );
        assert!(InboxPartitioning::every(day * 400).validate().is_err());
        assert!(InboxPartitioning::every(day).ahead(0).validate().is_err());
        assert!(
            InboxPartitioning::every(day)
                .ahead(1001)
                .validate()
                .is_err()
        );
    }
}
