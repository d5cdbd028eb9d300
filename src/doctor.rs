//! Health checks with advice: what `pgbox doctor` runs.
//!
//! [`check`] (or a configured [`Doctor`]) inspects one pgbox schema and the server around it
//! and returns a [`Report`]: one [`Finding`] per problem, or one `ok` finding per check when
//! there is none. Every finding has a [`Severity`], a stable machine [`Code`], a message that
//! says what was found (with the numbers), and advice that says what to do.
//!
//! ```no_run
//! # use std::time::Duration;
//! # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
//! use pgbox::doctor::{Doctor, Severity};
//!
//! let report = Doctor::new()
//!     .schema("pgbox")?
//!     .xmin_age_warn(Duration::from_secs(60))
//!     .check(&pool)
//!     .await?;
//! for finding in report.findings.iter().filter(|f| f.severity > Severity::Ok) {
//!     eprintln!("{} {}: {}\n  {}", finding.severity, finding.code, finding.message, finding.advice);
//! }
//! # Ok(()) }
//! ```
//!
//! The checks, in report order:
//!
//! - **Migrations** ([`Check::Migrations`]): the history in `<schema>.pgbox_migrations` (written
//!   by `pgbox::migrate` and by the [`Migrator::to_sql`] script alike) against the migrations
//!   embedded in this build: pending ones, a history this build's migrator would refuse
//!   (an edited migration, a gap), and a schema newer than this build (a warning).
//! - **Tables and indexes** ([`Check::Indexes`]): every table and index pgbox's applied
//!   migrations create is present, valid and ready (`pg_index.indisvalid`, `indisready`); the
//!   expected set is a static list per migration version, so an index a later migration adds is
//!   expected only once that migration is applied. Invalid leftovers of a failed
//!   `CREATE INDEX CONCURRENTLY` on pgbox's tables are reported too.
//! - **Bloat** ([`Check::Bloat`]): dead rows per table (`pg_stat_user_tables`) and the size of
//!   each table and B-tree index against an estimate of the size its live rows need (from
//!   `pg_class`, `pg_stats` and the block size). These are **estimates**, not `pgstattuple`
//!   measurements (no extension is needed); the main fork only, TOAST excluded.
//! - **The xmin horizon** ([`Check::XminHorizon`]), the first cause of queue bloat: VACUUM
//!   cannot remove a row version that some snapshot may still see, so one old transaction
//!   makes every deleted outbox and queue row stay. The oldest transactions of this database
//!   holding an xid or a snapshot (`pg_stat_activity`), prepared transactions
//!   (`pg_prepared_xacts`), replication slots (`pg_replication_slots.xmin`, and `catalog_xmin`
//!   of an inactive slot of this database), and standbys' `hot_standby_feedback` (walsenders'
//!   `backend_xmin`). Sessions are judged by age in time, slots and walsenders by age in
//!   transaction ids (they have no start time). A role without `pg_monitor` (or
//!   `pg_read_all_stats`) cannot see other roles' sessions; the `ok` finding then says how
//!   many were hidden.
//! - **The notification queue** ([`Check::NotificationQueue`]): `pg_notification_queue_usage()`.
//!   When the queue is full, every transaction that notifies fails at commit.
//! - **Dead letters** ([`Check::DeadLetters`]): the outbox's and the built-in queue's, counted up
//!   to [`DEAD_LETTER_COUNT_CAP`] each.
//!
//! **Heartbeats**: pgbox's relays and consumers record no heartbeat in the database today, so
//! the doctor cannot tell whether they are running and reports nothing about them;
//! `pgbox status` (the age of the oldest pending message) is the signal to watch.
//!
//! **Cost.** Catalog and statistics views, `LIMIT`ed or index-backed lookups: nothing counts
//! the outbox, the queue or the inbox. The checks run in one read-only transaction with a
//! statement and lock timeout ([`Doctor::statement_timeout`]), so a table locked by a long
//! `ALTER` or `VACUUM FULL` makes the doctor fail fast instead of waiting behind it.
//!
//! [`Migrator::to_sql`]: crate::Migrator::to_sql

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use serde::ser::{Serialize, SerializeStruct, Serializer};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::error::{Error, Result};
use crate::ident::Identifier;
use crate::migrate::{DEFAULT_SCHEMA, HISTORY_TABLE, Migrator};
use crate::status::DEAD_LETTER_COUNT_CAP;

// The versions, names and checksums this build would apply.
use crate::migrate::embedded;

/// How serious a [`Finding`] is. Ordered: `Ok < Warning < Critical`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    /// Nothing to do.
    Ok,
    /// Degrading, or about to: act soon.
    Warning,
    /// Broken, or about to be: act now.
    Critical,
}

impl Severity {
    /// `ok`, `warning` or `critical`.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Warning => "warning",
            Severity::Critical => "critical",
        }
    }
}

/// Which check produced a [`Finding`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Check {
    /// Applied migrations against this build's (`migrations`).
    Migrations,
    /// pgbox's tables and indexes present and valid (`indexes`).
    Indexes,
    /// Dead rows and estimated table and index bloat (`bloat`).
    Bloat,
    /// What holds back the xmin horizon (`xmin_horizon`).
    XminHorizon,
    /// `pg_notification_queue_usage()` (`notification_queue`).
    NotificationQueue,
    /// Dead letters waiting (`dead_letters`).
    DeadLetters,
    /// Partitions of the time-partitioned inbox created ahead (`inbox_partitions`; only in
    /// schemas that use it).
    InboxPartitions,
    /// Rows under a lease keep lease mode's invariants (`inbox_leases`): a lease has a
    /// fencing token, and a key under a lease has no outcome and no rejection yet.
    InboxLeases,
}

impl Check {
    /// The check's stable name (in parentheses above).
    pub fn as_str(self) -> &'static str {
        match self {
            Check::Migrations => "migrations",
            Check::Indexes => "indexes",
            Check::Bloat => "bloat",
            Check::XminHorizon => "xmin_horizon",
            Check::NotificationQueue => "notification_queue",
            Check::DeadLetters => "dead_letters",
            Check::InboxPartitions => "inbox_partitions",
            Check::InboxLeases => "inbox_leases",
        }
    }
}

/// What a [`Finding`] is about: a stable machine code (its [`Code::as_str`], in parentheses
/// below, is what `pgbox doctor --json` prints). Codes are never renamed; new ones may be
/// added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Code {
    /// Every migration of this build is applied (`migrations_current`; ok).
    MigrationsCurrent,
    /// The schema has no pgbox migration history (`not_migrated`; critical).
    NotMigrated,
    /// Migrations of this build newer than the schema's are not applied
    /// (`migrations_pending`; critical).
    MigrationsPending,
    /// The history differs from this build's migrations (an applied migration whose name or
    /// checksum differs, or one of this build's migrations older than the newest applied one
    /// that was never applied): this build's migrator refuses the schema
    /// (`migration_diverged`; critical).
    MigrationDiverged,
    /// The schema has migrations this build does not know: it is newer than this binary
    /// (`schema_newer_than_binary`; warning).
    SchemaNewerThanBinary,
    /// Every expected table and index is present and valid (`indexes_valid`; ok).
    IndexesValid,
    /// A table the applied migrations create is missing (`missing_table`; critical).
    MissingTable,
    /// An index the applied migrations create is missing (`missing_index`; critical).
    MissingIndex,
    /// An index is invalid or not ready (`invalid_index`; critical for pgbox's own indexes, a
    /// warning for another invalid index on pgbox's tables).
    InvalidIndex,
    /// No table or index is over the bloat thresholds (`bloat_low`; ok).
    BloatLow,
    /// Many dead rows in a table (`dead_tuples`; warning).
    DeadTuples,
    /// A table is much larger than its live rows need, by estimate (`table_bloat`; warning).
    TableBloat,
    /// An index is much larger than its entries need, by estimate (`index_bloat`; warning).
    IndexBloat,
    /// Nothing holds the xmin horizon back beyond the thresholds (`xmin_horizon_ok`; ok).
    XminHorizonOk,
    /// A transaction of this database has held an xid or snapshot for long
    /// (`long_transaction`; warning or critical).
    LongTransaction,
    /// A prepared (two-phase) transaction of this database is old
    /// (`prepared_transaction`; warning or critical).
    PreparedTransaction,
    /// A replication slot holds back the xmin horizon (`replication_slot_xmin`; warning or
    /// critical).
    ReplicationSlotXmin,
    /// A standby's `hot_standby_feedback` holds back the xmin horizon
    /// (`standby_feedback_xmin`; warning or critical).
    StandbyFeedbackXmin,
    /// The notification queue is nearly empty (`notification_queue_ok`; ok).
    NotificationQueueOk,
    /// The notification queue is filling up (`notification_queue_filling`; warning or
    /// critical).
    NotificationQueueFilling,
    /// No dead letters (`no_dead_letters`; ok).
    NoDeadLetters,
    /// Outbox dead letters are waiting (`outbox_dead_letters`; warning).
    OutboxDeadLetters,
    /// Dead letters of the built-in queue are waiting (`queue_dead_letters`; warning).
    QueueDeadLetters,
    /// The partitioned inbox has partitions ahead (`inbox_partitions_ok`; ok).
    InboxPartitionsOk,
    /// The partitioned inbox is running out of partitions (`inbox_partitions_running_out`;
    /// warning with less than one partition ahead, critical when none covers now: every
    /// claim fails).
    InboxPartitionsRunningOut,
    /// Every row under a lease has its token and no outcome (`inbox_leases_consistent`; ok).
    InboxLeasesConsistent,
    /// A row under a lease lacks its token or already has an outcome or a rejection
    /// (`inbox_lease_inconsistent`; critical): something other than pgbox's lease statements
    /// wrote it.
    InboxLeaseInconsistent,
}

impl Code {
    /// The stable machine code, e.g. `missing_index`.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::MigrationsCurrent => "migrations_current",
            Code::NotMigrated => "not_migrated",
            Code::MigrationsPending => "migrations_pending",
            Code::MigrationDiverged => "migration_diverged",
            Code::SchemaNewerThanBinary => "schema_newer_than_binary",
            Code::IndexesValid => "indexes_valid",
            Code::MissingTable => "missing_table",
            Code::MissingIndex => "missing_index",
            Code::InvalidIndex => "invalid_index",
            Code::BloatLow => "bloat_low",
            Code::DeadTuples => "dead_tuples",
            Code::TableBloat => "table_bloat",
            Code::IndexBloat => "index_bloat",
            Code::XminHorizonOk => "xmin_horizon_ok",
            Code::LongTransaction => "long_transaction",
            Code::PreparedTransaction => "prepared_transaction",
            Code::ReplicationSlotXmin => "replication_slot_xmin",
            Code::StandbyFeedbackXmin => "standby_feedback_xmin",
            Code::NotificationQueueOk => "notification_queue_ok",
            Code::NotificationQueueFilling => "notification_queue_filling",
            Code::NoDeadLetters => "no_dead_letters",
            Code::OutboxDeadLetters => "outbox_dead_letters",
            Code::QueueDeadLetters => "queue_dead_letters",
            Code::InboxPartitionsOk => "inbox_partitions_ok",
            Code::InboxPartitionsRunningOut => "inbox_partitions_running_out",
            Code::InboxLeasesConsistent => "inbox_leases_consistent",
            Code::InboxLeaseInconsistent => "inbox_lease_inconsistent",
        }
    }

    /// The check this code belongs to.
    pub fn check(self) -> Check {
        match self {
            Code::MigrationsCurrent
            | Code::NotMigrated
            | Code::MigrationsPending
            | Code::MigrationDiverged
            | Code::SchemaNewerThanBinary => Check::Migrations,
            Code::IndexesValid | Code::MissingTable | Code::MissingIndex | Code::InvalidIndex => {
                Check::Indexes
            }
            Code::BloatLow | Code::DeadTuples | Code::TableBloat | Code::IndexBloat => Check::Bloat,
            Code::XminHorizonOk
            | Code::LongTransaction
            | Code::PreparedTransaction
            | Code::ReplicationSlotXmin
            | Code::StandbyFeedbackXmin => Check::XminHorizon,
            Code::NotificationQueueOk | Code::NotificationQueueFilling => Check::NotificationQueue,
            Code::NoDeadLetters | Code::OutboxDeadLetters | Code::QueueDeadLetters => {
                Check::DeadLetters
            }
            Code::InboxPartitionsOk | Code::InboxPartitionsRunningOut => Check::InboxPartitions,
            Code::InboxLeasesConsistent | Code::InboxLeaseInconsistent => Check::InboxLeases,
        }
    }
}

/// Shown and serialized as their stable names (`as_str`).
macro_rules! named_by_as_str {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    )*};
}

named_by_as_str!(Severity, Check, Code);

/// One thing the doctor found.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Finding {
    /// How serious it is.
    pub severity: Severity,
    /// What it is about (stable).
    pub code: Code,
    /// What it names, when it names one thing: an index or table name, `pid 1234`, a slot
    /// name, a migration (`V8__outbox_published`).
    pub subject: Option<String>,
    /// What was found, with the numbers.
    pub message: String,
    /// What to do about it.
    pub advice: String,
    /// The numbers behind the message, as a JSON object (e.g. `pid`, `age_seconds`,
    /// `table`, `bytes`): for scripts and dashboards. Keys are added, never renamed.
    pub details: Value,
}

impl Finding {
    /// The check that produced it.
    pub fn check(&self) -> Check {
        self.code.check()
    }

    fn new(severity: Severity, code: Code, message: String, advice: String) -> Self {
        Finding {
            severity,
            code,
            subject: None,
            message,
            advice,
            details: json!({}),
        }
    }

    fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    fn details(mut self, details: Value) -> Self {
        self.details = details;
        self
    }
}

impl Serialize for Finding {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Finding", 7)?;
        st.serialize_field("severity", &self.severity)?;
        st.serialize_field("check", &self.check())?;
        st.serialize_field("code", &self.code)?;
        st.serialize_field("subject", &self.subject)?;
        st.serialize_field("message", &self.message)?;
        st.serialize_field("advice", &self.advice)?;
        st.serialize_field("details", &self.details)?;
        st.end()
    }
}

/// What [`check`] found: every check's findings, in check order.
///
/// Serializes (serde) as `{"schema", "taken_at", "status", "findings": [{"severity",
/// "check", "code", "subject", "message", "advice", "details"}]}`, `status` being
/// [`Report::severity`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Report {
    /// The pgbox schema checked.
    pub schema: String,
    /// When the checks ran (database clock).
    pub taken_at: OffsetDateTime,
    /// The findings: problems, or one `ok` finding per check that found none.
    pub findings: Vec<Finding>,
}

impl Report {
    /// The worst severity found ([`Severity::Ok`] when there are no findings).
    pub fn severity(&self) -> Severity {
        self.findings
            .iter()
            .map(|f| f.severity)
            .max()
            .unwrap_or(Severity::Ok)
    }

    /// Whether every finding is ok.
    pub fn is_ok(&self) -> bool {
        self.severity() == Severity::Ok
    }

    /// How many findings have this severity.
    pub fn count(&self, severity: Severity) -> usize {
        self.findings
            .iter()
            .filter(|f| f.severity == severity)
            .count()
    }

    /// The findings with this code.
    pub fn with_code(&self, code: Code) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |f| f.code == code)
    }

    /// Whether the schema has no pgbox migration history at all ([`Code::NotMigrated`]).
    pub fn not_migrated(&self) -> bool {
        self.with_code(Code::NotMigrated).next().is_some()
    }
}

impl Serialize for Report {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Report", 4)?;
        st.serialize_field("schema", &self.schema)?;
        st.serialize_field(
            "taken_at",
            &self.taken_at.format(&Rfc3339).unwrap_or_default(),
        )?;
        st.serialize_field("status", &self.severity())?;
        st.serialize_field("findings", &self.findings)?;
        st.end()
    }
}

/// Checks the pgbox tables in `schema` with the default thresholds ([`Doctor::new`]).
pub async fn check(pool: &PgPool, schema: &str) -> Result<Report> {
    Doctor::new().schema(schema)?.check(pool).await
}

/// The doctor, with its thresholds. Every setter documents its default.
#[derive(Debug, Clone)]
pub struct Doctor {
    schema: Identifier,
    xmin_age_warn: Duration,
    xmin_age_critical: Duration,
    xid_age_warn: i64,
    xid_age_critical: i64,
    notification_queue_warn: f64,
    notification_queue_critical: f64,
    dead_rows_warn: i64,
    dead_ratio_warn: f64,
    bloat_min_bytes: i64,
    bloat_ratio_warn: f64,
    statement_timeout: Duration,
}

impl Default for Doctor {
    fn default() -> Self {
        Self::new()
    }
}

impl Doctor {
    /// A doctor for the default schema ([`DEFAULT_SCHEMA`]) with the default thresholds.
    pub fn new() -> Self {
        Doctor {
            schema: Identifier::pgbox_schema(DEFAULT_SCHEMA).expect("default schema is valid"),
            xmin_age_warn: Duration::from_secs(5 * 60),
            xmin_age_critical: Duration::from_secs(60 * 60),
            xid_age_warn: 1_000_000,
            xid_age_critical: 100_000_000,
            notification_queue_warn: 0.5,
            notification_queue_critical: 0.9,
            dead_rows_warn: 100_000,
            dead_ratio_warn: 0.5,
            bloat_min_bytes: 32 << 20,
            bloat_ratio_warn: 0.5,
            statement_timeout: Duration::from_secs(10),
        }
    }

    /// Checks `schema` instead of [`DEFAULT_SCHEMA`]. The name is validated like
    /// [`Migrator::schema`]'s.
    pub fn schema(mut self, schema: &str) -> Result<Self> {
        self.schema = Identifier::pgbox_schema(schema)?;
        Ok(self)
    }

    /// A transaction (or prepared transaction) of this database that has held an xid or a
    /// snapshot this long is a warning. Default 5 minutes.
    pub fn xmin_age_warn(mut self, age: Duration) -> Self {
        self.xmin_age_warn = age;
        self
    }

    /// ... and this long, critical. Default 1 hour. When below the warning age, this one wins.
    pub fn xmin_age_critical(mut self, age: Duration) -> Self {
        self.xmin_age_critical = age;
        self
    }

    /// A replication slot or standby feedback whose xmin is this many transaction ids old is
    /// a warning (an inactive slot holding an xmin always is). Default 1,000,000.
    pub fn xid_age_warn(mut self, xids: i64) -> Self {
        self.xid_age_warn = xids;
        self
    }

    /// ... and this many, critical. Default 100,000,000 (half of PostgreSQL's default
    /// `autovacuum_freeze_max_age`).
    pub fn xid_age_critical(mut self, xids: i64) -> Self {
        self.xid_age_critical = xids;
        self
    }

    /// `pg_notification_queue_usage()` at or above this fraction is a warning. Default 0.5.
    pub fn notification_queue_warn(mut self, fraction: f64) -> Self {
        self.notification_queue_warn = fraction;
        self
    }

    /// ... and at or above this one, critical. Default 0.9.
    pub fn notification_queue_critical(mut self, fraction: f64) -> Self {
        self.notification_queue_critical = fraction;
        self
    }

    /// A table with at least this many dead rows (by `pg_stat_user_tables`)... Default
    /// 100,000.
    pub fn dead_rows_warn(mut self, rows: i64) -> Self {
        self.dead_rows_warn = rows;
        self
    }

    /// ... making up at least this fraction of its rows, is a warning. Default 0.5.
    pub fn dead_ratio_warn(mut self, fraction: f64) -> Self {
        self.dead_ratio_warn = fraction;
        self
    }

    /// Tables and indexes smaller than this are never reported as bloated. Default 32 MiB.
    pub fn bloat_min_bytes(mut self, bytes: i64) -> Self {
        self.bloat_min_bytes = bytes;
        self
    }

    /// A table or index whose estimated wasted share of its size is at least this fraction
    /// is a warning. Default 0.5.
    pub fn bloat_ratio_warn(mut self, fraction: f64) -> Self {
        self.bloat_ratio_warn = fraction;
        self
    }

    /// Bounds each statement of the check, and each lock wait (then an error). Default 10 s.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("notification_queue_warn", self.notification_queue_warn),
            (
                "notification_queue_critical",
                self.notification_queue_critical,
            ),
            ("dead_ratio_warn", self.dead_ratio_warn),
            ("bloat_ratio_warn", self.bloat_ratio_warn),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(Error::InvalidConfig(format!(
                    "doctor: {name} must be a fraction between 0 and 1, got {v}"
                )));
            }
        }
        if self.statement_timeout < Duration::from_millis(1) {
            return Err(Error::InvalidConfig(
                "doctor: statement_timeout must be at least 1 ms".into(),
            ));
        }
        Ok(())
    }

    /// Runs every check. A schema with no pgbox migration history gives a report with the
    /// single critical finding [`Code::NotMigrated`] (see [`Report::not_migrated`]). Errors
    /// are the database's (connection, timeouts) and an invalid configuration.
    pub async fn check(&self, pool: &PgPool) -> Result<Report> {
        self.validate()?;
        let schema = self.schema.as_str().to_owned();
        // The same test the CLI's other commands make: a history table with rows.
        let applied = Migrator::new().schema(&schema)?.applied(pool).await?;
        if applied.is_empty() {
            let taken_at = sqlx::query_scalar("SELECT now()").fetch_one(pool).await?;
            let finding = Finding::new(
                Severity::Critical,
                Code::NotMigrated,
                format!(
                    "schema {} has no pgbox migration history ({HISTORY_TABLE} is missing or empty)",
                    self.schema
                ),
                format!(
                    "Run `pgbox migrate --schema {schema}` (or `pgbox::migrate` at start-up), or \
                     apply `pgbox migrate --print-sql --schema {schema}` with your own tool. If \
                     your services use another schema, pass it with --schema."
                ),
            )
            .subject(schema.clone());
            return Ok(Report {
                schema,
                taken_at,
                findings: vec![finding],
            });
        }

        let mut tx = pool.begin().await?;
        let ms = self.statement_timeout.as_millis().min(i32::MAX as u128);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET TRANSACTION READ ONLY; SET LOCAL statement_timeout = {ms}; \
             SET LOCAL lock_timeout = {ms}"
        )))
        .execute(&mut *tx)
        .await?;
        let taken_at: OffsetDateTime = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *tx)
            .await?;

        let (mut findings, versions) = self.check_migrations(&mut tx).await?;
        let (index_findings, tables) = self.check_indexes(&mut tx, &versions).await?;
        findings.extend(index_findings);
        let (xmin_findings, horizon_held) = self.check_xmin_horizon(&mut tx).await?;
        findings.extend(self.check_bloat(&mut tx, &tables, horizon_held).await?);
        findings.extend(xmin_findings);
        findings.push(self.check_notification_queue(&mut tx).await?);
        findings.extend(self.check_dead_letters(&mut tx, &tables).await?);
        if versions.contains(&10) {
            findings.extend(self.check_inbox_partitions(&mut tx).await?);
        }
        if versions.contains(&7) {
            findings.push(self.check_inbox_leases(&mut tx).await?);
        }
        tx.commit().await?;
        Ok(Report {
            schema,
            taken_at,
            findings,
        })
    }

    async fn check_migrations(
        &self,
        conn: &mut PgConnection,
    ) -> Result<(Vec<Finding>, BTreeSet<i32>)> {
        let s = &self.schema;
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT version, name, checksum FROM {s}.\"{HISTORY_TABLE}\" ORDER BY version"
        )))
        .fetch_all(&mut *conn)
        .await?;
        let mut applied = BTreeMap::new();
        for row in rows {
            let version: i32 = row.try_get(0)?;
            let name: Option<String> = row.try_get(1)?;
            let checksum: Option<String> = row.try_get(2)?;
            applied.insert(
                version,
                (name.unwrap_or_default(), checksum.unwrap_or_default()),
            );
        }
        let mut embedded: Vec<(i32, String, u64)> = embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| (m.version(), m.name().to_owned(), m.checksum()))
            .collect();
        embedded.sort_by_key(|m| m.0);
        let versions: BTreeSet<i32> = applied.keys().copied().collect();
        let newest_applied = versions.last().copied().unwrap_or(0);
        let newest_known = embedded.last().map_or(0, |m| m.0);
        let label = |v: i32, name: &str| format!("V{v}__{name}");
        let schema = s.as_str();

        let mut findings = Vec::new();
        let mut diverged = Vec::new();
        let mut pending = Vec::new();
        for (version, name, checksum) in &embedded {
            match applied.get(version) {
                Some((applied_name, applied_checksum)) => {
                    if applied_name != name || *applied_checksum != checksum.to_string() {
                        diverged.push(format!(
                            "{} was applied as {} with checksum {}, this build has checksum {}",
                            label(*version, name),
                            label(*version, applied_name),
                            if applied_checksum.is_empty() {
                                "(none)"
                            } else {
                                applied_checksum
                            },
                            checksum
                        ));
                    }
                }
                None if *version < newest_applied => diverged.push(format!(
                    "{} was never applied, yet V{newest_applied} was",
                    label(*version, name)
                )),
                None => pending.push(label(*version, name)),
            }
        }
        let unknown: Vec<i32> = versions
            .iter()
            .copied()
            .filter(|v| !embedded.iter().any(|m| m.0 == *v))
            .collect();
        let (newer, missing_here): (Vec<i32>, Vec<i32>) =
            unknown.iter().partition(|v| **v > newest_known);
        for v in &missing_here {
            diverged.push(format!(
                "V{v}__{} is applied but this build has no V{v}",
                applied[v].0
            ));
        }

        if !diverged.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Critical,
                    Code::MigrationDiverged,
                    format!(
                        "the migration history of schema {s} differs from this build's \
                         migrations: {}",
                        diverged.join("; ")
                    ),
                    "`pgbox migrate` and `pgbox::migrate` of this build refuse this schema, so \
                     services that migrate at start-up fail to start. Find out which pgbox \
                     release built the schema (its history is in the pgbox_migrations table) \
                     and run that release, or restore the migration files this build was \
                     changed from; never edit an applied migration."
                        .to_owned(),
                )
                .details(json!({ "problems": diverged })),
            );
        }
        if !pending.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Critical,
                    Code::MigrationsPending,
                    format!(
                        "{} migration(s) of this build are not applied to schema {s} \
                         (newest applied: V{newest_applied}): {}",
                        pending.len(),
                        pending.join(", ")
                    ),
                    format!(
                        "Run `pgbox migrate --schema {schema}` with this build (or deploy a \
                         service that calls `pgbox::migrate` at start-up): code of this pgbox \
                         version uses what those migrations create. If your services run an \
                         older pgbox than this binary, run the doctor of their version instead."
                    ),
                )
                .subject(pending[0].clone())
                .details(json!({ "pending": pending, "newest_applied": newest_applied })),
            );
        }
        if !newer.is_empty() {
            let list: Vec<String> = newer.iter().map(|v| label(*v, &applied[v].0)).collect();
            findings.push(
                Finding::new(
                    Severity::Warning,
                    Code::SchemaNewerThanBinary,
                    format!(
                        "schema {s} has {} migration(s) newer than this build knows \
                         (this build's newest is V{newest_known}): {}",
                        list.len(),
                        list.join(", ")
                    ),
                    "This binary is older than the schema: upgrade it to the pgbox release of \
                     your newest service. Do not run `pgbox migrate` or start services that \
                     call `pgbox::migrate` with this build: its migrator refuses a history \
                     with migrations it does not have. The other checks still apply."
                        .to_owned(),
                )
                .subject(list[0].clone())
                .details(json!({ "newer": list, "newest_known": newest_known })),
            );
        }
        if findings.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Ok,
                    Code::MigrationsCurrent,
                    format!(
                        "all {} migrations of this build are applied to schema {s} (newest \
                         V{newest_applied}, checksums match)",
                        embedded.len()
                    ),
                    "Nothing to do.".to_owned(),
                )
                .details(json!({ "applied": versions.len(), "newest": newest_applied })),
            );
        }
        Ok((findings, versions))
    }

    async fn check_indexes(
        &self,
        conn: &mut PgConnection,
        versions: &BTreeSet<i32>,
    ) -> Result<(Vec<Finding>, Vec<&'static str>)> {
        let s = &self.schema;
        let present_tables: BTreeSet<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')",
        )
        .bind(s.as_str())
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
        let rows = sqlx::query(
            "SELECT ic.relname::text, t.relname::text, i.indisvalid, i.indisready \
             FROM pg_index i \
             JOIN pg_class ic ON ic.oid = i.indexrelid \
             JOIN pg_class t ON t.oid = i.indrelid \
             JOIN pg_namespace n ON n.oid = t.relnamespace \
             WHERE n.nspname = $1",
        )
        .bind(s.as_str())
        .fetch_all(&mut *conn)
        .await?;
        // (index, table) -> (valid, ready)
        let mut present = BTreeMap::new();
        for row in rows {
            let index: String = row.try_get(0)?;
            let table: String = row.try_get(1)?;
            present.insert((index, table), (row.try_get(2)?, row.try_get(3)?));
        }

        let mut findings = Vec::new();
        let mut tables = Vec::new();
        for t in TABLES.iter().filter(|t| versions.contains(&t.since)) {
            if present_tables.contains(t.name) {
                tables.push(t.name);
                continue;
            }
            findings.push(
                Finding::new(
                    Severity::Critical,
                    Code::MissingTable,
                    format!(
                        "table {s}.{} is missing (created by migration V{}; its history says \
                         it is applied)",
                        t.name, t.since
                    ),
                    format!(
                        "The schema was changed outside pgbox's migrations. Restore the table \
                         from a backup, or recreate it with the statements of migration V{} and \
                         later ones (`pgbox migrate --print-sql --schema {}` shows them); \
                         `pgbox migrate` will not, as its history says it is applied.",
                        t.since,
                        s.as_str()
                    ),
                )
                .subject(t.name)
                .details(json!({ "table": t.name, "since": t.since })),
            );
        }

        let mut expected_count = 0;
        let mut expected_names = BTreeSet::new();
        for ix in INDEXES.iter().filter(|ix| ix.expected(versions)) {
            expected_names.insert(ix.name);
            if !tables.contains(&ix.table) {
                continue; // reported as a missing table
            }
            expected_count += 1;
            match present.get(&(ix.name.to_owned(), ix.table.to_owned())) {
                None => findings.push(
                    Finding::new(
                        Severity::Critical,
                        Code::MissingIndex,
                        format!(
                            "index {s}.{} on table {} is missing (created by migration V{}; \
                             it serves {}): those queries now scan the table",
                            ix.name, ix.table, ix.since, ix.serves
                        ),
                        ix.recreate_advice(s),
                    )
                    .subject(ix.name)
                    .details(json!({ "index": ix.name, "table": ix.table, "since": ix.since })),
                ),
                Some((valid, ready)) if !valid || !ready => findings.push(
                    Finding::new(
                        Severity::Critical,
                        Code::InvalidIndex,
                        invalid_message(s, ix.name, ix.table, *ready, Some(ix.serves)),
                        format!(
                            "Rebuild it without blocking writes: `REINDEX INDEX CONCURRENTLY \
                             {s}.{};`. A failed CREATE INDEX CONCURRENTLY or REINDEX \
                             CONCURRENTLY typically leaves such an index behind; if the rebuild \
                             fails too, its error says why (a unique index fails on duplicate \
                             rows).",
                            ix.name
                        ),
                    )
                    .subject(ix.name)
                    .details(json!({
                        "index": ix.name, "table": ix.table,
                        "indisvalid": valid, "indisready": ready,
                    })),
                ),
                Some(_) => {}
            }
        }
        // Other invalid indexes on pgbox's tables (leftovers such as `<name>_ccnew`) cost
        // every write and serve no read.
        for ((index, table), (valid, ready)) in &present {
            if (*valid && *ready)
                || expected_names.contains(index.as_str())
                || !tables.contains(&table.as_str())
            {
                continue;
            }
            findings.push(
                Finding::new(
                    Severity::Warning,
                    Code::InvalidIndex,
                    invalid_message(s, index, table, *ready, None),
                    format!(
                        "It is not one of pgbox's indexes: probably a leftover of a failed \
                         CREATE INDEX CONCURRENTLY or REINDEX CONCURRENTLY. If nobody is \
                         building it right now, drop it: `DROP INDEX CONCURRENTLY \
                         {s}.\"{index}\";`"
                    ),
                )
                .subject(index.clone())
                .details(json!({
                    "index": index, "table": table, "indisvalid": valid, "indisready": ready,
                })),
            );
        }
        if findings.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Ok,
                    Code::IndexesValid,
                    format!(
                        "all {} tables and {expected_count} indexes the applied migrations \
                         create are present, valid and ready",
                        tables.len()
                    ),
                    "Nothing to do.".to_owned(),
                )
                .details(json!({ "tables": tables.len(), "indexes": expected_count })),
            );
        }
        Ok((findings, tables))
    }

    async fn check_xmin_horizon(&self, conn: &mut PgConnection) -> Result<(Vec<Finding>, bool)> {
        let warn = self.xmin_age_warn.as_secs_f64();
        let crit = self.xmin_age_critical.as_secs_f64();
        let time_severity = |age: f64| {
            if age >= crit {
                Severity::Critical
            } else if age >= warn {
                Severity::Warning
            } else {
                Severity::Ok
            }
        };
        let xid_severity = |age: i64| {
            if age >= self.xid_age_critical {
                Severity::Critical
            } else if age >= self.xid_age_warn {
                Severity::Warning
            } else {
                Severity::Ok
            }
        };
        let mut findings = Vec::new();

        // Sessions of this database holding an xid or a snapshot. Since PostgreSQL 14, only
        // these (and the cluster-wide holders below) hold back vacuum of this database's
        // tables; autovacuum workers never do; walsenders are judged below.
        let rows = sqlx::query(
            "SELECT pid, coalesce(application_name, ''), coalesce(state, ''), \
                    coalesce(usename::text, ''), coalesce(host(client_addr), 'local'), \
                    extract(epoch FROM clock_timestamp() - xact_start)::float8, \
                    greatest(age(backend_xid), age(backend_xmin))::int8, \
                    backend_xid IS NOT NULL \
             FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL) \
               AND backend_type NOT IN ('autovacuum worker', 'walsender') \
             ORDER BY xact_start NULLS LAST LIMIT 20",
        )
        .fetch_all(&mut *conn)
        .await?;
        let hidden: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query = '<insufficient privilege>'",
        )
        .fetch_one(&mut *conn)
        .await?;
        let mut oldest = Value::Null;
        let mut reported = 0;
        for (i, row) in rows.iter().enumerate() {
            let pid: i32 = row.try_get(0)?;
            let app: String = row.try_get(1)?;
            let state: String = row.try_get(2)?;
            let user: String = row.try_get(3)?;
            let client: String = row.try_get(4)?;
            let age: Option<f64> = row.try_get(5)?;
            let xid_age: Option<i64> = row.try_get(6)?;
            let has_xid: bool = row.try_get(7)?;
            let age = age.unwrap_or(0.0);
            let details = json!({
                "pid": pid, "application_name": app, "state": state, "user": user,
                "client": client, "age_seconds": age, "xid_age": xid_age,
                "holds": if has_xid { "xid" } else { "snapshot" },
            });
            if i == 0 {
                oldest = details.clone();
            }
            let severity = time_severity(age);
            if severity == Severity::Ok {
                break; // ordered by age
            }
            reported += 1;
            if reported > 5 {
                continue;
            }
            let doing = if state.starts_with("idle in transaction") {
                format!(
                    "It is {state}: the application opened a transaction and stopped talking \
                     (a missing commit, or a connection returned to a pool mid-transaction). \
                     Commit or roll back in the application \"{app}\". To end it now: \
                     `SELECT pg_terminate_backend({pid});`. To stop it recurring: `ALTER ROLE \
                     {user} SET idle_in_transaction_session_timeout = '{}';`.",
                    postgres_interval(self.xmin_age_warn)
                )
            } else {
                format!(
                    "It is {state}: a long statement, or a session that keeps its \
                     transaction open between statements. See what it runs: `SELECT query, \
                     query_start FROM pg_stat_activity WHERE pid = {pid};`. Cancel the \
                     statement: `SELECT pg_cancel_backend({pid});`, or end the session: \
                     `SELECT pg_terminate_backend({pid});`. Bound such work with \
                     statement_timeout, or run it on a replica without hot_standby_feedback."
                )
            };
            findings.push(
                Finding::new(
                    severity,
                    Code::LongTransaction,
                    format!(
                        "pid {pid} (application \"{app}\", user {user}, client {client}, \
                         state \"{state}\") has held a transaction open for {} (holding {}; \
                         {} transaction ids assigned since): until it ends, VACUUM cannot \
                         remove rows deleted since it began, so pgbox's outbox, queue and \
                         inbox bloat",
                        human_duration(age),
                        if has_xid { "an xid" } else { "a snapshot" },
                        xid_age.map_or_else(|| "?".into(), group_digits),
                    ),
                    doing,
                )
                .subject(format!("pid {pid}"))
                .details(details),
            );
        }
        if reported > 5 {
            findings.push(
                Finding::new(
                    findings
                        .iter()
                        .map(|f| f.severity)
                        .max()
                        .unwrap_or(Severity::Warning),
                    Code::LongTransaction,
                    format!(
                        "{} more transactions over the threshold (the 5 oldest are listed)",
                        reported - 5
                    ),
                    "Deal with the oldest first: the horizon is the oldest one's.".to_owned(),
                )
                .details(json!({ "more": reported - 5 })),
            );
        }

        // Prepared transactions: they survive restarts and hold their xid until someone
        // commits or rolls them back.
        let prepared = sqlx::query(
            "SELECT gid, owner::text, \
                    extract(epoch FROM clock_timestamp() - prepared)::float8, \
                    age(transaction)::int8 \
             FROM pg_prepared_xacts WHERE database = current_database() \
             ORDER BY prepared LIMIT 5",
        )
        .fetch_all(&mut *conn)
        .await?;
        let mut prepared_count = 0;
        for row in &prepared {
            let gid: String = row.try_get(0)?;
            let owner: String = row.try_get(1)?;
            let age: f64 = row.try_get(2)?;
            let xid_age: i64 = row.try_get(3)?;
            prepared_count += 1;
            let severity = time_severity(age);
            if severity == Severity::Ok {
                continue;
            }
            let gid_literal = gid.replace('\'', "''");
            findings.push(
                Finding::new(
                    severity,
                    Code::PreparedTransaction,
                    format!(
                        "prepared transaction '{gid}' (owner {owner}) was prepared {} ago \
                         ({} transaction ids): it holds back the xmin horizon until it is \
                         committed or rolled back, across restarts",
                        human_duration(age),
                        group_digits(xid_age)
                    ),
                    format!(
                        "Ask the transaction manager that prepared it whether it committed; \
                         then, as its owner or a superuser, `COMMIT PREPARED '{gid_literal}';` \
                         or `ROLLBACK PREPARED '{gid_literal}';`."
                    ),
                )
                .subject(gid.clone())
                .details(
                    json!({ "gid": gid, "owner": owner, "age_seconds": age, "xid_age": xid_age }),
                ),
            );
        }

        // Replication slots: `xmin` (physical slots with hot_standby_feedback) holds back
        // every database; `catalog_xmin` (logical slots) only catalogs, which matters here
        // when the slot is abandoned.
        let slots = sqlx::query(
            "SELECT slot_name::text, slot_type, active, \
                    age(xmin)::int8, age(catalog_xmin)::int8, coalesce(database::text, '') \
             FROM pg_replication_slots \
             WHERE xmin IS NOT NULL \
                OR (catalog_xmin IS NOT NULL AND NOT active AND database = current_database()) \
             ORDER BY greatest(age(xmin), age(catalog_xmin)) DESC LIMIT 5",
        )
        .fetch_all(&mut *conn)
        .await?;
        for row in &slots {
            let name: String = row.try_get(0)?;
            let kind: String = row.try_get(1)?;
            let active: bool = row.try_get(2)?;
            let xmin_age: Option<i64> = row.try_get(3)?;
            let catalog_age: Option<i64> = row.try_get(4)?;
            let age = xmin_age.or(catalog_age).unwrap_or(0);
            let mut severity = xid_severity(age);
            if !active && severity == Severity::Ok {
                severity = Severity::Warning;
            }
            if severity == Severity::Ok {
                continue;
            }
            let which = if xmin_age.is_some() {
                "xmin (every table of the cluster)"
            } else {
                "catalog_xmin (system catalogs)"
            };
            let name_literal = name.replace('\'', "''");
            findings.push(
                Finding::new(
                    severity,
                    Code::ReplicationSlotXmin,
                    format!(
                        "{} replication slot '{name}' ({}) holds back the {which} horizon by {} \
                         transaction ids",
                        kind,
                        if active { "active" } else { "inactive" },
                        group_digits(age)
                    ),
                    if active {
                        format!(
                            "Its consumer is connected but its xmin is old: a long query on a \
                             standby with hot_standby_feedback = on, or a consumer that does not \
                             confirm progress. Find that query on the standby and end it, or \
                             bound standby queries with statement_timeout; as a last resort \
                             turn hot_standby_feedback off (standby queries may then be \
                             cancelled). Slot: '{name_literal}'."
                        )
                    } else {
                        format!(
                            "Nothing is connected to it, so nothing will advance it (it also \
                             keeps WAL). If its standby or consumer is gone for good, drop it: \
                             `SELECT pg_drop_replication_slot('{name_literal}');`; otherwise \
                             bring the consumer back."
                        )
                    },
                )
                .subject(name.clone())
                .details(json!({
                    "slot": name, "slot_type": kind, "active": active,
                    "xmin_age": xmin_age, "catalog_xmin_age": catalog_age,
                })),
            );
        }

        // Standbys with hot_standby_feedback and no slot: their walsender carries the xmin.
        let walsenders = sqlx::query(
            "SELECT pid, coalesce(application_name, ''), coalesce(host(client_addr), 'local'), \
                    age(backend_xmin)::int8 \
             FROM pg_stat_activity \
             WHERE backend_type = 'walsender' AND backend_xmin IS NOT NULL \
             ORDER BY age(backend_xmin) DESC LIMIT 5",
        )
        .fetch_all(&mut *conn)
        .await?;
        for row in &walsenders {
            let pid: i32 = row.try_get(0)?;
            let app: String = row.try_get(1)?;
            let client: String = row.try_get(2)?;
            let age: i64 = row.try_get(3)?;
            let severity = xid_severity(age);
            if severity == Severity::Ok {
                continue;
            }
            findings.push(
                Finding::new(
                    severity,
                    Code::StandbyFeedbackXmin,
                    format!(
                        "standby \"{app}\" ({client}, walsender pid {pid}) holds back the xmin \
                         horizon by {} transaction ids through hot_standby_feedback",
                        group_digits(age)
                    ),
                    "A long query on that standby holds it. Find and end it there, bound \
                     standby queries with statement_timeout, or turn hot_standby_feedback off \
                     on the standby (its queries may then be cancelled by replay)."
                        .to_owned(),
                )
                .subject(format!("pid {pid}"))
                .details(json!({ "pid": pid, "application_name": app, "client": client, "xid_age": age })),
            );
        }

        let held = !findings.is_empty();
        if !held {
            let mut message = match oldest.get("pid") {
                Some(pid) => format!(
                    "nothing holds back the xmin horizon beyond {}: the oldest transaction of \
                     this database holding an xid or snapshot is pid {pid}, {} old",
                    human_duration(warn),
                    human_duration(oldest["age_seconds"].as_f64().unwrap_or(0.0)),
                ),
                None => "nothing holds back the xmin horizon: no other transaction of this \
                         database holds an xid or snapshot"
                    .to_owned(),
            };
            message.push_str(&format!(
                "; {prepared_count} prepared transaction(s), {} replication slot(s) and {} \
                 standby(s) holding an xmin, all under the thresholds",
                slots.len(),
                walsenders.len()
            ));
            let mut advice = "Nothing to do.".to_owned();
            if hidden > 0 {
                message.push_str(&format!(
                    "; {hidden} session(s) of other roles were hidden from this role"
                ));
                advice = "Grant this role pg_monitor (or pg_read_all_stats) so that the doctor \
                          sees every session's transaction."
                    .to_owned();
            }
            findings.push(
                Finding::new(Severity::Ok, Code::XminHorizonOk, message, advice).details(json!({
                    "oldest_transaction": oldest,
                    "hidden_sessions": hidden,
                })),
            );
        }
        Ok((findings, held))
    }

    async fn check_bloat(
        &self,
        conn: &mut PgConnection,
        tables: &[&'static str],
        horizon_held: bool,
    ) -> Result<Vec<Finding>> {
        let s = &self.schema;
        let names: Vec<String> = tables.iter().map(|t| (*t).to_owned()).collect();
        let table_rows = sqlx::query(
            "SELECT c.relname::text, pg_relation_size(c.oid)::int8, \
                    coalesce(st.n_live_tup, 0)::int8, coalesce(st.n_dead_tup, 0)::int8, \
                    extract(epoch FROM clock_timestamp() \
                        - greatest(st.last_autovacuum, st.last_vacuum))::float8, \
                    (SELECT sum(ps.avg_width)::int8 FROM pg_stats ps \
                       WHERE ps.schemaname = n.nspname AND ps.tablename = c.relname \
                         AND NOT ps.inherited), \
                    (SELECT count(*) FROM pg_attribute a \
                       WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)::int8, \
                    current_setting('block_size')::int8 \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_stat_user_tables st ON st.relid = c.oid \
             WHERE n.nspname = $1 AND c.relname = ANY($2) AND c.relkind IN ('r', 'p') \
             ORDER BY 1",
        )
        .bind(s.as_str())
        .bind(&names)
        .fetch_all(&mut *conn)
        .await?;
        let index_rows = sqlx::query(
            "SELECT ic.relname::text, t.relname::text, pg_relation_size(ic.oid)::int8, \
                    ic.reltuples::float8, \
                    (SELECT sum(coalesce(ps.avg_width, \
                                CASE WHEN a.attlen > 0 THEN a.attlen ELSE 16 END))::int8 \
                       FROM unnest(i.indkey::int2[]) AS k(attnum) \
                       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
                       LEFT JOIN pg_stats ps ON ps.schemaname = n.nspname \
                            AND ps.tablename = t.relname AND ps.attname = a.attname \
                            AND NOT ps.inherited), \
                    current_setting('block_size')::int8 \
             FROM pg_index i \
             JOIN pg_class ic ON ic.oid = i.indexrelid \
             JOIN pg_class t ON t.oid = i.indrelid \
             JOIN pg_namespace n ON n.oid = t.relnamespace \
             JOIN pg_am am ON am.oid = ic.relam \
             WHERE n.nspname = $1 AND t.relname = ANY($2) AND am.amname = 'btree' \
               AND i.indisvalid \
             ORDER BY 2, 1",
        )
        .bind(s.as_str())
        .bind(&names)
        .fetch_all(&mut *conn)
        .await?;

        let horizon_note = if horizon_held {
            "First deal with what holds back the xmin horizon (the xmin_horizon findings): \
             VACUUM cannot remove these rows while it lasts. "
        } else {
            ""
        };
        let mut findings = Vec::new();
        let (mut live_total, mut dead_total, mut heap_bytes, mut index_bytes) = (0, 0, 0, 0);
        let mut unestimated = Vec::new();
        for row in &table_rows {
            let table: String = row.try_get(0)?;
            let bytes: i64 = row.try_get(1)?;
            let live: i64 = row.try_get(2)?;
            let dead: i64 = row.try_get(3)?;
            let since_vacuum: Option<f64> = row.try_get(4)?;
            let width: Option<i64> = row.try_get(5)?;
            let columns: i64 = row.try_get(6)?;
            let block: i64 = row.try_get(7)?;
            live_total += live;
            dead_total += dead;
            heap_bytes += bytes;
            let vacuumed = since_vacuum.map_or_else(
                || "never vacuumed since statistics were reset".to_owned(),
                |s| format!("last vacuumed {} ago", human_duration(s)),
            );
            let dead_ratio = if live + dead > 0 {
                dead as f64 / (live + dead) as f64
            } else {
                0.0
            };
            if dead >= self.dead_rows_warn && dead > 0 && dead_ratio >= self.dead_ratio_warn {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::DeadTuples,
                        format!(
                            "table {s}.{table} has ~{} dead rows against ~{} live ({:.0}% dead; \
                             {vacuumed}; estimates from pg_stat_user_tables)",
                            group_digits(dead),
                            group_digits(live),
                            dead_ratio * 100.0
                        ),
                        format!(
                            "{horizon_note}Otherwise autovacuum is not keeping up with this \
                             queue-like table: `VACUUM (VERBOSE) {s}.{table};` now, and let \
                             autovacuum start sooner: `ALTER TABLE {s}.{table} SET \
                             (autovacuum_vacuum_scale_factor = 0, \
                             autovacuum_vacuum_threshold = 10000, \
                             autovacuum_vacuum_cost_delay = 0);`."
                        ),
                    )
                    .subject(table.clone())
                    .details(json!({
                        "table": table, "live_rows": live, "dead_rows": dead,
                        "dead_ratio": dead_ratio, "seconds_since_vacuum": since_vacuum,
                    })),
                );
            }
            if bytes < self.bloat_min_bytes.max(1) {
                continue;
            }
            let Some(expected) = estimate_heap_bytes(live, width, columns, block) else {
                unestimated.push(table.clone());
                continue;
            };
            let waste = (bytes - expected).max(0) as f64 / bytes as f64;
            if waste >= self.bloat_ratio_warn {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::TableBloat,
                        format!(
                            "table {s}.{table} takes {} where its ~{} live rows need about {} \
                             (~{:.0}% free or dead space; an estimate from pg_class and pg_stats, \
                             not a pgstattuple measurement)",
                            human_bytes(bytes),
                            group_digits(live),
                            human_bytes(expected),
                            waste * 100.0
                        ),
                        format!(
                            "{horizon_note}VACUUM makes that space reusable but does not shrink \
                             the file, and a queue table usually grows back into it. If it \
                             stays this large after `VACUUM {s}.{table};` and the space is \
                             needed, rewrite it online with pg_repack, or with `VACUUM FULL \
                             {s}.{table};` in a maintenance window (it locks the table for its \
                             duration)."
                        ),
                    )
                    .subject(table.clone())
                    .details(json!({
                        "table": table, "bytes": bytes, "estimated_bytes": expected,
                        "estimated_waste_ratio": waste, "live_rows": live,
                    })),
                );
            }
        }
        for row in &index_rows {
            let index: String = row.try_get(0)?;
            let table: String = row.try_get(1)?;
            let bytes: i64 = row.try_get(2)?;
            let entries: f64 = row.try_get(3)?;
            let width: Option<i64> = row.try_get(4)?;
            let block: i64 = row.try_get(5)?;
            index_bytes += bytes;
            if bytes < self.bloat_min_bytes.max(1) {
                continue;
            }
            let Some(expected) = estimate_btree_bytes(entries, width.unwrap_or(16), block) else {
                unestimated.push(index.clone());
                continue;
            };
            let waste = (bytes - expected).max(0) as f64 / bytes as f64;
            if waste >= self.bloat_ratio_warn {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::IndexBloat,
                        format!(
                            "index {s}.{index} on {table} takes {} where its ~{} entries need \
                             about {} (~{:.0}% wasted; an estimate from pg_class and pg_stats)",
                            human_bytes(bytes),
                            group_digits(entries as i64),
                            human_bytes(expected),
                            waste * 100.0
                        ),
                        format!(
                            "{horizon_note}Rebuild it without blocking writes: `REINDEX INDEX \
                             CONCURRENTLY {s}.{index};`."
                        ),
                    )
                    .subject(index.clone())
                    .details(json!({
                        "index": index, "table": table, "bytes": bytes,
                        "estimated_bytes": expected, "estimated_waste_ratio": waste,
                        "entries": entries,
                    })),
                );
            }
        }
        if findings.is_empty() {
            let mut message = format!(
                "pgbox's {} tables hold ~{} live and ~{} dead rows in {} (indexes {}); none is \
                 over the bloat thresholds (estimates from pg_stat_user_tables, pg_class and \
                 pg_stats, not pgstattuple measurements)",
                table_rows.len(),
                group_digits(live_total),
                group_digits(dead_total),
                human_bytes(heap_bytes),
                human_bytes(index_bytes)
            );
            let mut advice = "Nothing to do.".to_owned();
            if !unestimated.is_empty() {
                message.push_str(&format!(
                    "; no size estimate for {} (no statistics yet)",
                    unestimated.join(", ")
                ));
                advice = format!(
                    "For size estimates, let autovacuum analyze them, or run ANALYZE on {s}'s \
                     tables."
                );
            }
            findings.push(
                Finding::new(Severity::Ok, Code::BloatLow, message, advice).details(json!({
                    "tables": table_rows.len(), "live_rows": live_total, "dead_rows": dead_total,
                    "table_bytes": heap_bytes, "index_bytes": index_bytes,
                    "not_estimated": unestimated,
                })),
            );
        }
        Ok(findings)
    }

    async fn check_notification_queue(&self, conn: &mut PgConnection) -> Result<Finding> {
        let usage: f64 = sqlx::query_scalar("SELECT pg_notification_queue_usage()")
            .fetch_one(&mut *conn)
            .await?;
        let severity = if usage >= self.notification_queue_critical {
            Severity::Critical
        } else if usage >= self.notification_queue_warn {
            Severity::Warning
        } else {
            Severity::Ok
        };
        let percent = usage * 100.0;
        let finding = if severity == Severity::Ok {
            Finding::new(
                severity,
                Code::NotificationQueueOk,
                format!("the notification queue is {percent:.1}% full"),
                "Nothing to do.".to_owned(),
            )
        } else {
            Finding::new(
                severity,
                Code::NotificationQueueFilling,
                format!(
                    "the notification queue is {percent:.1}% full: when it is full, every \
                     transaction that sends a NOTIFY (pgbox's wake-ups among them) fails at commit"
                ),
                "The queue is only freed up to the oldest notification some listening session \
                 has not read yet: a session that LISTENs and sits in a long transaction holds \
                 it (see the xmin_horizon findings, or pg_stat_activity for an old xact_start). \
                 End that transaction or session (pg_terminate_backend); the queue drains by \
                 itself afterwards."
                    .to_owned(),
            )
        };
        Ok(finding.details(json!({ "usage": usage })))
    }

    /// Partitions ahead of now, in a schema that uses the partitioned inbox (no finding
    /// otherwise).
    async fn check_inbox_partitions(&self, conn: &mut PgConnection) -> Result<Option<Finding>> {
        let s = &self.schema;
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT (SELECT ahead FROM {s}.inbox_partitioning), \
                    count(*) FILTER (WHERE r_from > now()), \
                    coalesce(bool_or(now() >= r_from AND now() < r_to), false), \
                    max(r_to) \
             FROM {s}.inbox_partitions()"
        )))
        .fetch_one(&mut *conn)
        .await?;
        let Some(wanted): Option<i32> = row.try_get(0)? else {
            return Ok(None);
        };
        let ahead: i64 = row.try_get(1)?;
        let covers_now: bool = row.try_get(2)?;
        let until: Option<OffsetDateTime> = row.try_get(3)?;
        let until_text = until
            .and_then(|t| t.format(&Rfc3339).ok())
            .unwrap_or_else(|| "never".to_owned());
        let details = json!({ "ahead": ahead, "configured_ahead": wanted, "covers_now": covers_now, "until": until_text });
        let finding = if !covers_now {
            Finding::new(
                Severity::Critical,
                Code::InboxPartitionsRunningOut,
                format!("no partition of the partitioned inbox covers now (the last ends {until_text}): every claim fails"),
                "Create partitions now: `pgbox partitions create` (or InboxPartitions::create_ahead), \
                 then keep a Janitor running on some instance: it creates them ahead on every pass."
                    .to_owned(),
            )
        } else if ahead < 1 {
            Finding::new(
                Severity::Warning,
                Code::InboxPartitionsRunningOut,
                format!(
                    "the partitioned inbox has no partition after the current one (it ends {until_text})"
                ),
                "Run `pgbox partitions create`, and make sure a Janitor runs on some instance: \
                 when the current partition ends, every claim fails until the next exists."
                    .to_owned(),
            )
        } else {
            Finding::new(
                Severity::Ok,
                Code::InboxPartitionsOk,
                format!("{ahead} partition(s) ahead, until {until_text}"),
                "Nothing to do.".to_owned(),
            )
        };
        Ok(Some(finding.details(details)))
    }

    /// Lease mode's invariants, which V7 enforced with CHECK constraints and V11 moved here
    /// (the constraints cost every claim): only rows under a lease can break them, and the
    /// partial index `inbox_leases_idx` holds exactly those, so this reads only them.
    async fn check_inbox_leases(&self, conn: &mut PgConnection) -> Result<Finding> {
        let s = &self.schema;
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT count(*), min(consumer || ' / ' || key) FROM {s}.inbox \
             WHERE lease_expires_at IS NOT NULL \
               AND (lease_token IS NULL OR outcome IS NOT NULL OR rejection IS NOT NULL)"
        )))
        .fetch_one(&mut *conn)
        .await?;
        let broken: i64 = row.try_get(0)?;
        let example: Option<String> = row.try_get(1)?;
        let finding = if broken == 0 {
            Finding::new(
                Severity::Ok,
                Code::InboxLeasesConsistent,
                "every key under a lease has its token and no outcome".to_owned(),
                "Nothing to do.".to_owned(),
            )
        } else {
            Finding::new(
                Severity::Critical,
                Code::InboxLeaseInconsistent,
                format!(
                    "{broken} key(s) under a lease lack a token or already have an outcome or a \
                     rejection (e.g. {})",
                    example.as_deref().unwrap_or("?")
                ),
                "Only pgbox's lease statements should write lease_token, lease_expires_at, \
                 outcome and rejection. Find what else wrote these rows; a key stays in progress \
                 until its lease expires and is taken over."
                    .to_owned(),
            )
            .subject("inbox")
        };
        Ok(finding.details(json!({ "inconsistent": broken })))
    }

    async fn check_dead_letters(
        &self,
        conn: &mut PgConnection,
        tables: &[&'static str],
    ) -> Result<Vec<Finding>> {
        let s = &self.schema;
        let schema = s.as_str();
        let mut findings = Vec::new();
        let mut checked = Vec::new();
        for (table, code, what, flag) in [
            (
                "outbox_dead_letters",
                Code::OutboxDeadLetters,
                "outbox dead letters (messages the relay gave up publishing)",
                "",
            ),
            (
                "queue_dead_letters",
                Code::QueueDeadLetters,
                "dead letters in the built-in queue (messages consumers gave up on)",
                " --queue",
            ),
        ] {
            if !tables.contains(&table) {
                continue;
            }
            checked.push(table);
            let row = sqlx::query(AssertSqlSafe(format!(
                "SELECT (SELECT count(*) FROM (SELECT 1 FROM {s}.{table} LIMIT $1) d)::int8, \
                        (SELECT extract(epoch FROM clock_timestamp() - dead_at)::float8 \
                           FROM {s}.{table} ORDER BY seq LIMIT 1), \
                        (SELECT topic FROM {s}.{table} ORDER BY seq LIMIT 1)"
            )))
            .bind(DEAD_LETTER_COUNT_CAP)
            .fetch_one(&mut *conn)
            .await?;
            let n: i64 = row.try_get(0)?;
            if n == 0 {
                continue;
            }
            let first_age: Option<f64> = row.try_get(1)?;
            let first_topic: Option<String> = row.try_get(2)?;
            let count = if n >= DEAD_LETTER_COUNT_CAP {
                format!("{}+", group_digits(n))
            } else {
                group_digits(n)
            };
            findings.push(
                Finding::new(
                    Severity::Warning,
                    code,
                    format!(
                        "{count} {what} are waiting; the earliest enqueued (topic \"{}\") died {} \
                         ago. Each holds back the later messages of its ordering key",
                        first_topic.as_deref().unwrap_or("?"),
                        first_age.map_or_else(|| "?".to_owned(), human_duration),
                    ),
                    format!(
                        "Look at them with `pgbox dead-letters{flag} list --schema {schema}` \
                         (and `show ID`), fix the cause (the last_error column), then \
                         `pgbox dead-letters{flag} replay ID…` (or `replay --all`) to send them \
                         again in their original order, or `discard ID…` to drop them for good."
                    ),
                )
                .subject(table)
                .details(
                    json!({ "table": table, "count": n, "capped": n >= DEAD_LETTER_COUNT_CAP }),
                ),
            );
        }
        if findings.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Ok,
                    Code::NoDeadLetters,
                    format!("no dead letters in {}", checked.join(" or ")),
                    "Nothing to do.".to_owned(),
                )
                .details(json!({ "tables": checked })),
            );
        }
        Ok(findings)
    }
}

fn invalid_message(
    s: &Identifier,
    index: &str,
    table: &str,
    ready: bool,
    serves: Option<&str>,
) -> String {
    let state = if ready {
        "invalid (indisvalid = false): it is maintained on every write but never used to read"
    } else {
        "not ready (indisready = false): it is neither maintained nor used"
    };
    match serves {
        Some(serves) => format!(
            "index {s}.{index} on table {table} is {state}; it serves {serves}, so those \
             queries scan the table"
        ),
        None => format!("index {s}.\"{index}\" on table {table} is {state}"),
    }
}

/// What a table's live rows need, heap main fork: tuple header (23 bytes and a null bitmap,
/// aligned), data (the analyzed average widths, aligned), a 4-byte line pointer, in pages of
/// `block - 24` usable bytes. `None` without statistics for a non-empty table.
fn estimate_heap_bytes(live: i64, width: Option<i64>, columns: i64, block: i64) -> Option<i64> {
    if live <= 0 {
        return Some(0);
    }
    let width = width?;
    let header = maxalign(23 + (columns + 7) / 8);
    let row = header + maxalign(width) + 4;
    let per_page = ((block - 24) / row).max(1);
    let pages = (live + per_page - 1) / per_page;
    Some(pages * block)
}

/// What a B-tree's entries need: an 8-byte index tuple header plus the aligned key, a 4-byte
/// line pointer, leaf pages filled to the default fillfactor of 90%, about 1% of internal
/// pages, and the metapage. Deduplication (PostgreSQL 13+) only makes real indexes smaller.
/// `None` when the entry count is unknown (`reltuples` = -1: never vacuumed or analyzed).
fn estimate_btree_bytes(entries: f64, width: i64, block: i64) -> Option<i64> {
    if entries < 0.0 {
        return None;
    }
    if entries == 0.0 {
        return Some(block); // the metapage
    }
    let entry = (8 + maxalign(width) + 4) as f64;
    let usable = (block - 24 - 16) as f64 * 0.9;
    let leaves = (entries * entry / usable).ceil().max(1.0);
    let pages = (leaves * 1.01).ceil() as i64 + 1;
    Some(pages * block)
}

fn maxalign(n: i64) -> i64 {
    (n + 7) / 8 * 8
}

/// A duration as a PostgreSQL setting value accepts it: whole seconds, at least one.
fn postgres_interval(d: Duration) -> String {
    format!("{}s", d.as_secs().max(1))
}

fn human_duration(secs: f64) -> String {
    let s = secs.max(0.0);
    let whole = s as u64;
    if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{}m {:02}s", whole / 60, whole % 60)
    } else if s < 86_400.0 {
        format!("{}h {:02}m", whole / 3600, whole % 3600 / 60)
    } else {
        format!("{}d {:02}h", whole / 86_400, whole % 86_400 / 3600)
    }
}

fn human_bytes(bytes: i64) -> String {
    let b = bytes.max(0) as f64;
    if b < 1024.0 {
        format!("{bytes} B")
    } else if b < 1024.0 * 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else if b < 1024.0 * 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.1} GiB", b / (1024.0 * 1024.0 * 1024.0))
    }
}

fn group_digits(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A table pgbox's migrations create, from the version that creates it.
struct ExpectedTable {
    name: &'static str,
    since: i32,
}

#[rustfmt::skip]
const TABLES: &[ExpectedTable] = &[
    ExpectedTable { name: "inbox", since: 1 },
    ExpectedTable { name: "sequence_watermarks", since: 2 },
    ExpectedTable { name: "outbox", since: 3 },
    ExpectedTable { name: "outbox_dead_letters", since: 3 },
    ExpectedTable { name: "queue", since: 3 },
    ExpectedTable { name: "queue_dead_letters", since: 3 },
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum IndexKind {
    PrimaryKey,
    Unique,
    Plain,
}

/// An index pgbox's migrations create: expected once migration `since` is applied, until
/// migration `dropped_in` (which drops or replaces it) is.
struct ExpectedIndex {
    table: &'static str,
    name: &'static str,
    since: i32,
    dropped_in: Option<i32>,
    kind: IndexKind,
    /// Columns and predicate, as in the migration.
    definition: &'static str,
    /// What reads it (for the message).
    serves: &'static str,
}

impl ExpectedIndex {
    fn expected(&self, applied: &BTreeSet<i32>) -> bool {
        applied.contains(&self.since) && self.dropped_in.is_none_or(|v| !applied.contains(&v))
    }

    fn recreate_advice(&self, s: &Identifier) -> String {
        let (name, table) = (self.name, self.table);
        let def = self.definition;
        match self.kind {
            IndexKind::Plain => format!(
                "Recreate it without blocking writes: `CREATE INDEX CONCURRENTLY {name} ON \
                 {s}.{table} {def};`."
            ),
            IndexKind::PrimaryKey | IndexKind::Unique => {
                let constraint = if self.kind == IndexKind::PrimaryKey {
                    "PRIMARY KEY"
                } else {
                    "UNIQUE"
                };
                format!(
                    "Recreate the index without blocking writes, then the constraint on it: \
                     `CREATE UNIQUE INDEX CONCURRENTLY {name} ON {s}.{table} {def};` then \
                     `ALTER TABLE {s}.{table} ADD CONSTRAINT {name} {constraint} USING INDEX \
                     {name};` (if the index fails on duplicate rows, remove those first)."
                )
            }
        }
    }
}

const fn index(
    table: &'static str,
    name: &'static str,
    since: i32,
    kind: IndexKind,
    definition: &'static str,
    serves: &'static str,
) -> ExpectedIndex {
    ExpectedIndex {
        table,
        name,
        since,
        dropped_in: None,
        kind,
        definition,
        serves,
    }
}

const fn until(mut ix: ExpectedIndex, dropped_in: i32) -> ExpectedIndex {
    ix.dropped_in = Some(dropped_in);
    ix
}

use IndexKind::{Plain, PrimaryKey, Unique};

/// Every index of migrations/V1..V8. A new migration that creates or drops an index adds a
/// line here (the unit test below fails until it does).
#[rustfmt::skip]
const INDEXES: &[ExpectedIndex] = &[
    // V1
    index("inbox", "inbox_pkey", 1, PrimaryKey, "(consumer, key)",
        "the inbox's dedup: every claim"),
    until(index("inbox", "inbox_processed_at_idx", 1, Plain, "(processed_at)",
        "retention purges by age"), 4),
    // V2
    index("sequence_watermarks", "sequence_watermarks_pkey", 2, PrimaryKey,
        "(consumer, entity)", "in-order processing's watermark per entity"),
    // V3
    index("outbox", "outbox_pkey", 3, PrimaryKey, "(seq)", "the relay's claims by seq"),
    index("outbox", "outbox_message_id_key", 3, Unique, "(message_id)",
        "message ids' uniqueness"),
    until(index("outbox", "outbox_key_idx", 3, Plain,
        "(topic, ordering_key, seq) WHERE published_at IS NULL",
        "the relay's head-of-key lookups"), 6),
    index("outbox", "outbox_pending_idx", 3, Plain, "(seq) WHERE published_at IS NULL",
        "the relay's scan of pending messages"),
    index("outbox", "outbox_topic_idx", 3, Plain, "(topic, seq) WHERE published_at IS NULL",
        "per-topic status"),
    index("outbox_dead_letters", "outbox_dead_letters_pkey", 3, PrimaryKey, "(seq)",
        "replays at the original position"),
    index("outbox_dead_letters", "outbox_dead_letters_message_id_key", 3, Unique,
        "(message_id)", "lookups of dead letters by message id"),
    index("outbox_dead_letters", "outbox_dead_letters_key_idx", 3, Plain,
        "(topic, ordering_key)", "holding back the later messages of a dead letter's key"),
    index("queue", "queue_pkey", 3, PrimaryKey, "(seq)", "acks and nacks by seq"),
    index("queue", "queue_topic_idx", 3, Plain, "(topic, seq)",
        "receive's walk of a topic in order"),
    index("queue", "queue_key_idx", 3, Plain, "(topic, ordering_key, seq)",
        "receive's head-of-key checks"),
    index("queue_dead_letters", "queue_dead_letters_pkey", 3, PrimaryKey, "(seq)",
        "replays at the original position"),
    // V4
    index("inbox", "inbox_consumer_processed_at_idx", 4, Plain, "(consumer, processed_at)",
        "retention purges per consumer and status"),
    // V5
    index("queue_dead_letters", "queue_dead_letters_key_idx", 5, Plain,
        "(topic, ordering_key)", "receive's check that a key has no dead letter"),
    index("queue_dead_letters", "queue_dead_letters_message_id_idx", 5, Plain,
        "(message_id)", "lookups of dead letters by message id"),
    // V6
    index("outbox", "outbox_backoff_idx", 6, Plain,
        "(topic, ordering_key) WHERE attempts > 0 AND published_at IS NULL",
        "the relay's lookup of keys waiting out a backoff"),
    index("outbox", "outbox_unkeyed_idx", 6, Plain,
        "(seq) WHERE published_at IS NULL AND ordering_key IS NULL",
        "relays taking unkeyed messages"),
    index("outbox", "outbox_key_idx", 6, Plain,
        "(topic, ordering_key, seq) WHERE published_at IS NULL AND ordering_key IS NOT NULL",
        "the relay's head-of-key lookups"),
    // V7
    index("inbox", "inbox_leases_idx", 7, Plain,
        "(consumer, lease_expires_at) WHERE lease_expires_at IS NOT NULL",
        "status's lease counts"),
    // V8
    index("outbox", "outbox_published_idx", 8, Plain,
        "(published_at) WHERE published_at IS NOT NULL",
        "the janitor's purge of published rows kept in audit mode"),
    index("outbox_dead_letters", "outbox_dead_letters_dead_at_idx", 8, Plain, "(dead_at)",
        "the janitor's purge of dead letters by age"),
    index("queue_dead_letters", "queue_dead_letters_dead_at_idx", 8, Plain, "(dead_at)",
        "the janitor's purge of dead letters by age"),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// `CREATE [UNIQUE] INDEX [CONCURRENTLY] [IF NOT EXISTS] name` and `DROP INDEX [IF
    /// EXISTS] name` in a migration, in order.
    fn index_statements(sql: &str) -> Vec<(bool, String)> {
        let words: Vec<String> = sql
            .lines()
            .map(|l| l.split("--").next().unwrap_or(""))
            .flat_map(|l| l.split_whitespace())
            .map(|w| w.trim_end_matches(';').to_ascii_lowercase())
            .collect();
        let mut out = Vec::new();
        for i in 0..words.len() {
            let create = words[i] == "create";
            if !(create || words[i] == "drop") {
                continue;
            }
            let mut j = i + 1;
            if create && words.get(j).map(String::as_str) == Some("unique") {
                j += 1;
            }
            if words.get(j).map(String::as_str) != Some("index") {
                continue;
            }
            j += 1;
            while matches!(
                words.get(j).map(String::as_str),
                Some("concurrently" | "if" | "not" | "exists")
            ) {
                j += 1;
            }
            if let Some(name) = words.get(j) {
                out.push((create, name.clone()));
            }
        }
        out
    }

    #[test]
    fn the_expected_indexes_match_the_migrations() {
        for m in embedded::migrations::runner().get_migrations() {
            let v = m.version();
            for (create, name) in index_statements(m.sql().unwrap_or_default()) {
                let listed = if create {
                    INDEXES.iter().any(|ix| ix.name == name && ix.since == v)
                } else {
                    INDEXES
                        .iter()
                        .any(|ix| ix.name == name && ix.dropped_in == Some(v))
                };
                assert!(
                    listed,
                    "migration V{v} {} index {name}: add it to INDEXES in src/doctor.rs",
                    if create { "creates" } else { "drops" }
                );
            }
        }
        for ix in INDEXES.iter().filter(|ix| ix.kind == Plain) {
            let Some(m) = embedded::migrations::runner()
                .get_migrations()
                .iter()
                .find(|m| m.version() == ix.since)
                .cloned()
            else {
                continue; // a migration this build does not have
            };
            assert!(
                index_statements(m.sql().unwrap_or_default()).contains(&(true, ix.name.into())),
                "INDEXES lists {} as created by V{}, which does not create it",
                ix.name,
                ix.since
            );
        }
    }

    #[test]
    fn expected_indexes_follow_the_applied_versions() {
        let upto = |n: i32| (1..=n).collect::<BTreeSet<i32>>();
        let names = |n: i32| -> Vec<&str> {
            INDEXES
                .iter()
                .filter(|ix| ix.expected(&upto(n)))
                .map(|ix| ix.name)
                .collect()
        };
        assert!(names(3).contains(&"inbox_processed_at_idx"));
        assert!(!names(4).contains(&"inbox_processed_at_idx"));
        assert_eq!(
            names(7).iter().filter(|n| **n == "outbox_key_idx").count(),
            1
        );
        assert_eq!(names(7).len(), 20);
        assert!(!names(7).contains(&"outbox_published_idx"));
        assert!(names(8).contains(&"outbox_published_idx"));
        assert_eq!(names(8).len(), 23);
    }

    #[test]
    fn estimates_and_formatting() {
        assert_eq!(estimate_heap_bytes(0, None, 10, 8192), Some(0));
        assert_eq!(estimate_heap_bytes(10, None, 10, 8192), None);
        // 100 rows of 40 bytes + 24 header + 4 pointer fit one page.
        assert_eq!(estimate_heap_bytes(100, Some(40), 6, 8192), Some(8192));
        assert_eq!(estimate_btree_bytes(-1.0, 8, 8192), None);
        assert!(estimate_btree_bytes(1_000_000.0, 8, 8192).unwrap() > 20 << 20);
        assert_eq!(group_digits(1_234_567), "1,234,567");
        assert_eq!(group_digits(-12), "-12");
        assert_eq!(human_duration(3725.0), "1h 02m");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert!(Severity::Critical > Severity::Warning && Severity::Warning > Severity::Ok);
    }
}
