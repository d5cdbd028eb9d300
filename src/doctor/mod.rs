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
//! - **Outbox backlog** ([`Check::OutboxBacklog`]): the age of the oldest unpublished message
//!   of the table outbox (warning from [`Doctor::outbox_age_warn`], default 5 minutes;
//!   critical from [`Doctor::outbox_age_critical`], default 1 hour). A relay that is down, or
//!   whose transport is unavailable, shows here: an outage counts no attempt and dead-letters
//!   nothing, so the messages wait in the outbox and their age is the signal. No finding
//!   while the oldest is younger than the warning age. (The WAL outbox's oldest unpublished
//!   commit is reported by the WAL slots check.)
//! - **Replication** ([`Check::Replication`]): whether a failover can lose commits pgbox already
//!   acknowledged. A primary with standbys (`pg_stat_replication`) whose commits do not wait
//!   for one (`synchronous_standby_names` empty, or `synchronous_commit` not `on`,
//!   `remote_write` or `remote_apply`) is a warning: a failover loses what the standby had not
//!   received. A server in recovery (a standby) is critical: pgbox cannot write there. A
//!   primary without standbys is ok (there is nothing to fail over to).
//! - **Grants** ([`Check::Grants`]): the application role ([`Doctor::application_role`], or the
//!   role running the doctor) holds every privilege pgbox's components need on the schema
//!   (`has_schema_privilege`, `has_table_privilege`, `has_sequence_privilege`,
//!   `has_function_privilege`), the list [`Migrator::grant_to`] grants. A missing one is
//!   critical: the operations needing it fail with
//!   [`DbErrorKind::InsufficientPrivilege`](crate::DbErrorKind::InsufficientPrivilege). When
//!   the role running the doctor lacks one, the checks after this one (which read pgbox's
//!   tables) are skipped.
//! - **Pooler** ([`Check::Pooler`]): whether the pool's connections go through a pooler in
//!   transaction mode: one connection sets a session setting to a random value, a second one
//!   reads it; only a pooler handing one client's server session to another shows it there.
//!   A warning then, with what each component needs (`Pooler::Transaction`, direct
//!   connections for the janitor, migrations and LISTEN). It can miss on a busy pooler; it
//!   never raises a false alarm.
//! - **WAL slots** ([`Check::WalSlots`]): every logical replication slot of this database (the
//!   WAL outbox's): the WAL it retains (warning from [`Doctor::wal_slot_retained_warn`],
//!   default 1 GiB), the age of its oldest unpublished commit when no session reads it (a
//!   peek of one change; warning from the xmin age threshold), and an invalidated slot
//!   (`wal_status = lost`: critical, its messages are gone; the reason typed from 17's
//!   `invalidation_reason`). And whether the slot survives a failover, per version: on 15
//!   and 16 with standbys, it does not (`wal_slot_lost_at_failover`); on a 17+ primary
//!   with standbys, a slot without failover is lost (`wal_slot_not_failover`), a failover
//!   slot needs `synchronized_standby_slots` naming each standby's physical slot
//!   (`failover_slot_unguarded`, `synchronized_standby_slot_unusable`,
//!   `standby_without_slot`); on a 17+ standby, the settings slot synchronization needs
//!   (`slot_sync_not_configured`) and whether the slot is synchronized there
//!   (`wal_slot_not_synced`, `wal_slot_failover_ready`); on 18, an
//!   `idle_replication_slot_timeout` below [`Doctor::wal_relay_outage_tolerance`]
//!   (`idle_slot_timeout`). Logical walsenders (a streaming relay) are not counted as
//!   standbys, here and in the replication check.
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

mod backlog;
mod bloat;
mod format;
mod grants;
mod horizon;
mod pooler;
mod replication;
mod schema;
mod slots;

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
    /// The oldest unpublished message of the table outbox, by age (`outbox_backlog`; a
    /// finding only when it is old).
    OutboxBacklog,
    /// Partitions of the time-partitioned inbox created ahead (`inbox_partitions`; only in
    /// schemas that use it).
    InboxPartitions,
    /// Rows under a lease keep lease mode's invariants (`inbox_leases`): a lease has a
    /// fencing token, and a key under a lease has no outcome and no rejection yet.
    InboxLeases,
    /// Whether a failover can lose acknowledged commits, and whether this server is a
    /// standby (`replication`).
    Replication,
    /// Whether the pool's connections go through a pooler in transaction mode (`pooler`).
    Pooler,
    /// The application role holds every privilege pgbox's components need (`grants`).
    Grants,
    /// The logical replication slots of this database: WAL they retain, invalidated ones
    /// (`wal_slots`).
    WalSlots,
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
            Check::OutboxBacklog => "outbox_backlog",
            Check::InboxPartitions => "inbox_partitions",
            Check::InboxLeases => "inbox_leases",
            Check::Replication => "replication",
            Check::Pooler => "pooler",
            Check::WalSlots => "wal_slots",
            Check::Grants => "grants",
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
    /// The oldest unpublished outbox message is older than [`Doctor::outbox_age_warn`]
    /// (`outbox_stalled`; warning, critical from [`Doctor::outbox_age_critical`]): no relay
    /// runs, or its transport is unavailable (an outage), or it refuses the message.
    OutboxStalled,
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
    /// No standby, or commits wait for a synchronous standby: a failover loses no
    /// acknowledged commit (`replication_ok`; ok).
    ReplicationOk,
    /// Standbys stream from this primary but commits do not wait for any of them (or the
    /// named synchronous standby is not connected, and commits wait): a failover can lose
    /// acknowledged messages (`async_replication`; warning).
    AsyncReplication,
    /// This server is a standby (in recovery): pgbox cannot write here (`standby_server`;
    /// critical).
    ServerIsStandby,
    /// Sessions stay with their connections, or the probe could not run (`pooler_ok`; ok).
    PoolerOk,
    /// The pool's connections share server sessions: a pooler in transaction mode is in
    /// between (`transaction_pooler`; warning). pgbox's components need
    /// [`Pooler::Transaction`](crate::Pooler::Transaction), and the session holders (janitor,
    /// migrations, LISTEN) a direct connection.
    TransactionPooler,
    /// The application role holds every privilege pgbox needs (`grants_complete`; ok).
    GrantsComplete,
    /// The application role lacks a privilege pgbox needs, or does not exist
    /// (`missing_grant`; critical): the operations needing it fail.
    MissingGrant,
    /// No logical slot, or each within the thresholds (`wal_slots_ok`; ok).
    WalSlotsOk,
    /// A logical slot retains much WAL, or its oldest unpublished commit is old: its reader
    /// (the WAL relay) is down or behind (`wal_slot_behind`; warning).
    WalSlotBehind,
    /// A logical slot was invalidated: the messages in the WAL it lost are gone
    /// (`wal_slot_invalidated`; critical). Its `details.invalidation_reason` says why
    /// (`wal_removed`, `rows_removed`, `wal_level_insufficient`, `idle_timeout`).
    WalSlotInvalidated,
    /// PostgreSQL 17+, a primary with standbys: a logical slot without failover, lost at a
    /// failover (`wal_slot_not_failover`; warning).
    WalSlotNotFailover,
    /// PostgreSQL 15 or 16 with standbys (or on a standby): logical slots live on the
    /// primary only, a failover loses the slot (`wal_slot_lost_at_failover`; warning).
    WalSlotLostAtFailover,
    /// A 17+ primary with failover slots whose `synchronized_standby_slots` does not name the
    /// physical slot of every streaming standby: the relay may publish what a standby has
    /// not received (`failover_slot_unguarded`; warning).
    FailoverSlotUnguarded,
    /// A slot named in `synchronized_standby_slots` is missing, invalidated or inactive:
    /// decoding of failover slots waits for it, the WAL relay stalls
    /// (`synchronized_standby_slot_unusable`; critical).
    SynchronizedStandbySlotUnusable,
    /// A standby streams from a 17+ primary with failover slots without a physical slot: it
    /// cannot synchronize them (`standby_without_slot`; warning).
    StandbyWithoutSlot,
    /// A 17+ standby lacks a setting slot synchronization needs (`sync_replication_slots`,
    /// `hot_standby_feedback`, `primary_slot_name`, a `dbname` in `primary_conninfo`,
    /// `wal_level = logical`): each one missing is named (`slot_sync_not_configured`;
    /// warning).
    SlotSyncNotConfigured,
    /// On a 17+ standby: the WAL outbox's slot is absent, temporary (not yet persistent),
    /// not a synchronized copy, or invalidated: a promotion now would have no usable slot
    /// (`wal_slot_not_synced`; warning).
    WalSlotNotSynced,
    /// On a 17+ standby: the WAL outbox's slot is synchronized here and survives a promotion
    /// (`wal_slot_failover_ready`; ok).
    WalSlotFailoverReady,
    /// PostgreSQL 18+: `idle_replication_slot_timeout` is set below
    /// [`Doctor::wal_relay_outage_tolerance`]: a relay down that long loses its slot
    /// (`idle_slot_timeout`; warning).
    IdleSlotTimeout,
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
            Code::OutboxStalled => "outbox_stalled",
            Code::InboxPartitionsOk => "inbox_partitions_ok",
            Code::InboxPartitionsRunningOut => "inbox_partitions_running_out",
            Code::InboxLeasesConsistent => "inbox_leases_consistent",
            Code::InboxLeaseInconsistent => "inbox_lease_inconsistent",
            Code::ReplicationOk => "replication_ok",
            Code::AsyncReplication => "async_replication",
            Code::ServerIsStandby => "standby_server",
            Code::PoolerOk => "pooler_ok",
            Code::TransactionPooler => "transaction_pooler",
            Code::WalSlotsOk => "wal_slots_ok",
            Code::WalSlotBehind => "wal_slot_behind",
            Code::WalSlotInvalidated => "wal_slot_invalidated",
            Code::WalSlotNotFailover => "wal_slot_not_failover",
            Code::WalSlotLostAtFailover => "wal_slot_lost_at_failover",
            Code::FailoverSlotUnguarded => "failover_slot_unguarded",
            Code::SynchronizedStandbySlotUnusable => "synchronized_standby_slot_unusable",
            Code::StandbyWithoutSlot => "standby_without_slot",
            Code::SlotSyncNotConfigured => "slot_sync_not_configured",
            Code::WalSlotNotSynced => "wal_slot_not_synced",
            Code::WalSlotFailoverReady => "wal_slot_failover_ready",
            Code::IdleSlotTimeout => "idle_slot_timeout",
            Code::GrantsComplete => "grants_complete",
            Code::MissingGrant => "missing_grant",
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
            Code::OutboxStalled => Check::OutboxBacklog,
            Code::InboxPartitionsOk | Code::InboxPartitionsRunningOut => Check::InboxPartitions,
            Code::InboxLeasesConsistent | Code::InboxLeaseInconsistent => Check::InboxLeases,
            Code::ReplicationOk | Code::AsyncReplication | Code::ServerIsStandby => {
                Check::Replication
            }
            Code::GrantsComplete | Code::MissingGrant => Check::Grants,
            Code::PoolerOk | Code::TransactionPooler => Check::Pooler,
            Code::WalSlotsOk
            | Code::WalSlotBehind
            | Code::WalSlotInvalidated
            | Code::WalSlotNotFailover
            | Code::WalSlotLostAtFailover
            | Code::FailoverSlotUnguarded
            | Code::SynchronizedStandbySlotUnusable
            | Code::StandbyWithoutSlot
            | Code::SlotSyncNotConfigured
            | Code::WalSlotNotSynced
            | Code::WalSlotFailoverReady
            | Code::IdleSlotTimeout => Check::WalSlots,
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
    application_role: Option<Identifier>,
    wal_slot_retained_warn: i64,
    wal_relay_outage_tolerance: Duration,
    outbox_age_warn: Duration,
    outbox_age_critical: Duration,
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
            application_role: None,
            wal_slot_retained_warn: 1024 * 1024 * 1024,
            wal_relay_outage_tolerance: Duration::from_secs(24 * 60 * 60),
            outbox_age_warn: Duration::from_secs(5 * 60),
            outbox_age_critical: Duration::from_secs(60 * 60),
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

    /// WAL a logical slot may retain before it is a warning (default 1 GiB).
    pub fn wal_slot_retained_warn(mut self, bytes: i64) -> Self {
        self.wal_slot_retained_warn = bytes;
        self
    }

    /// The longest WAL relay outage you would tolerate without losing the slot (default 1
    /// day). On PostgreSQL 18, `idle_replication_slot_timeout` invalidates a slot that no
    /// session has read for that long (checked at checkpoints): the relay down longer loses
    /// the slot and every message not yet published in it. A timeout set (non-zero) below
    /// this is a warning ([`Code::IdleSlotTimeout`]).
    pub fn wal_relay_outage_tolerance(mut self, outage: Duration) -> Self {
        self.wal_relay_outage_tolerance = outage;
        self
    }

    /// The oldest unpublished message of the table outbox this old is a warning
    /// ([`Code::OutboxStalled`]): no relay publishes it, or the relay's transport is
    /// unavailable (an outage keeps messages waiting, uncounted), or the transport refuses it.
    /// Default 5 minutes; set it above the longest backlog your relay drains in normal
    /// running.
    pub fn outbox_age_warn(mut self, age: Duration) -> Self {
        self.outbox_age_warn = age;
        self
    }

    /// ... and this old, critical. Default 1 hour. When below the warning age, this one wins.
    pub fn outbox_age_critical(mut self, age: Duration) -> Self {
        self.outbox_age_critical = age;
        self
    }

    /// Bounds each statement of the check, and each lock wait (then an error). Default 10 s.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Checks the grants of `role` (the role your services connect as) instead of the role
    /// running the doctor ([`Check::Grants`]). Validated like [`Migrator::grant_to`]'s role.
    pub fn application_role(mut self, role: &str) -> Result<Self> {
        self.application_role = Some(crate::grants::role(role)?);
        Ok(self)
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
        let applied = match Migrator::new().schema(&schema)?.applied(pool).await {
            // The role running the doctor cannot read the history: report its grants.
            Err(e) if e.db_kind() == Some(crate::DbErrorKind::InsufficientPrivilege) => {
                let mut conn = pool.acquire().await?;
                let findings = self.check_grants(&mut conn, None).await?;
                let taken_at = sqlx::query_scalar("SELECT pg_catalog.now()")
                    .persistent(false)
                    .fetch_one(&mut *conn)
                    .await?;
                return Ok(Report {
                    schema,
                    taken_at,
                    findings,
                });
            }
            other => other?,
        };
        if applied.is_empty() {
            let mut tx = crate::pooler::begin(pool, None).await?;
            let taken_at = sqlx::query_scalar("SELECT pg_catalog.now()")
                .persistent(false)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
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

        let mut tx = crate::pooler::begin(pool, None).await?;
        let ms = self.statement_timeout.as_millis().min(i32::MAX as u128);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET TRANSACTION READ ONLY; SET LOCAL statement_timeout = {ms}; \
             SET LOCAL lock_timeout = {ms}"
        )))
        .execute(&mut *tx)
        .await?;
        let taken_at: OffsetDateTime = sqlx::query_scalar("SELECT pg_catalog.now()")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;

        let (mut findings, versions) = self.check_migrations(&mut tx).await?;
        // Before the checks that read pgbox's tables: as a role lacking their grants, they
        // would fail on the first one.
        let grant_findings = self.check_grants(&mut tx, Some(&versions)).await?;
        let running: String = sqlx::query_scalar("SELECT current_user::text")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        let running_role_lacks = self
            .application_role
            .as_ref()
            .is_none_or(|r| r.as_str() == running)
            && grant_findings.iter().any(|f| f.code == Code::MissingGrant);
        if running_role_lacks {
            findings.extend(grant_findings);
            tx.commit().await?;
            return Ok(Report {
                schema,
                taken_at,
                findings,
            });
        }
        let (index_findings, tables) = self.check_indexes(&mut tx, &versions).await?;
        findings.extend(index_findings);
        let (xmin_findings, horizon_held) = self.check_xmin_horizon(&mut tx).await?;
        findings.extend(self.check_bloat(&mut tx, &tables, horizon_held).await?);
        findings.extend(xmin_findings);
        findings.push(self.check_notification_queue(&mut tx).await?);
        findings.extend(self.check_dead_letters(&mut tx, &tables).await?);
        if tables.contains(&"outbox") {
            findings.extend(self.check_outbox_backlog(&mut tx).await?);
        }
        if versions.contains(&10) {
            findings.extend(self.check_inbox_partitions(&mut tx).await?);
        }
        if versions.contains(&7) {
            findings.push(self.check_inbox_leases(&mut tx).await?);
        }
        findings.push(self.check_replication(&mut tx).await?);
        findings.extend(grant_findings);
        tx.commit().await?;
        findings.push(self.check_pooler(pool).await?);
        findings.extend(self.check_wal_slots(pool).await?);
        Ok(Report {
            schema,
            taken_at,
            findings,
        })
    }
}
