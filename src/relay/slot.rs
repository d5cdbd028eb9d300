//! The logical replication slot the WAL relay reads, and its publication.
//!
//! **Failover.** Before PostgreSQL 17 a logical slot lives on the primary only: a promoted
//! standby has no slot, and what producers emitted after the relay's last confirmed position
//! is never published. PostgreSQL 17 has *failover slots*: created with `failover => true`, a
//! standby with `sync_replication_slots = on` (and `hot_standby_feedback = on`, a
//! `primary_slot_name`, a `dbname` in its `primary_conninfo`) keeps a synchronized copy, and
//! on promotion the relay reads on from there. [`WalSlot::create`] makes one by default where
//! the server can (see [`WalSlot::failover`]); `pgbox doctor` checks both sides.

use serde_json::Value;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::error::{Error, Result};
use crate::ident::Identifier;

/// The first PostgreSQL major (as `server_version_num / 10000`) with failover slots.
const FAILOVER_SLOTS_SINCE: i32 = WalSlot::FAILOVER_SLOTS_SINCE;

/// A logical replication slot and the publication of the same name that the WAL relay reads
/// (`pgoutput` needs a publication; this one has no tables, only messages pass).
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// let slot = pgbox::WalSlot::new("pgbox_outbox")?;
/// slot.create(&pool).await?; // idempotent; needs wal_level = logical
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalSlot {
    pub(crate) name: Identifier,
    /// `None`: a failover slot where the server can make one; `Some`: as told.
    failover: Option<bool>,
}

/// What [`WalSlot::status`] reads from `pg_replication_slots`. The fields that PostgreSQL
/// added after 15 are `None` on a server without the column.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalSlotStatus {
    /// Whether a session reads it now (a WAL relay's reader).
    pub active: bool,
    /// WAL the slot keeps from being removed: from its restart position to the server's
    /// current position (on a standby: its replay position), in bytes.
    pub retained_bytes: i64,
    /// `pg_replication_slots.wal_status`: `reserved`, `extended`, `unreserved` or `lost`
    /// (invalidated: the WAL it needed is gone, and so are the messages in it; from 16 on, any
    /// invalidation shows `lost`, [`invalidation`](Self::invalidation) says which).
    pub wal_status: String,
    /// Why the server invalidated the slot, `None` while it is usable. An invalidated slot
    /// never decodes again: drop it, create it, reconcile what it held.
    pub invalidation: Option<WalSlotInvalidation>,
    /// Whether the slot is synchronized to standbys that run `sync_replication_slots` (17+;
    /// `None` before).
    pub failover: Option<bool>,
    /// On a standby: whether this slot is a copy synchronized from the primary (17+; `None`
    /// before). After a promotion the copy stays `synced` and is the new primary's slot.
    pub synced: Option<bool>,
    /// Whether the slot is temporary: on a standby, a synchronized slot stays temporary (and
    /// is dropped at promotion) until the primary's slot has moved past the WAL the standby
    /// could keep for it.
    pub temporary: bool,
    /// Since when no session read the slot (17+; `None` before, and while it is read). 18's
    /// `idle_replication_slot_timeout` counts from here.
    pub inactive_since: Option<OffsetDateTime>,
}

/// Why PostgreSQL invalidated a slot (`pg_replication_slots.invalidation_reason`, 17+; on 15
/// and 16 read from `wal_status` and `conflicting`). Its messages are lost either way.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WalSlotInvalidation {
    /// `wal_removed`: the slot held more than `max_slot_wal_keep_size` and the WAL it needed
    /// was removed (the relay was down or behind for too long).
    WalRemoved,
    /// `rows_removed`: on a standby, the primary vacuumed catalog rows the slot needed
    /// (a synchronized slot whose standby had no `hot_standby_feedback` or no physical slot).
    RowsRemoved,
    /// `wal_level_insufficient`: on a standby, the primary's `wal_level` went below
    /// `logical`.
    WalLevelInsufficient,
    /// `idle_timeout` (18+): no session read the slot for longer than
    /// `idle_replication_slot_timeout` (the relay was down that long).
    IdleTimeout,
    /// 16's `conflicting = true`: a conflict with recovery on a standby (rows removed, or the
    /// primary's `wal_level`), 16 does not say which.
    RecoveryConflict,
    /// A reason this build does not know, in the server's words.
    Other(String),
}

impl WalSlotInvalidation {
    /// The server's name for it (`wal_removed`, `rows_removed`, `wal_level_insufficient`,
    /// `idle_timeout`), `recovery_conflict` for 16's `conflicting`.
    pub fn as_str(&self) -> &str {
        match self {
            WalSlotInvalidation::WalRemoved => "wal_removed",
            WalSlotInvalidation::RowsRemoved => "rows_removed",
            WalSlotInvalidation::WalLevelInsufficient => "wal_level_insufficient",
            WalSlotInvalidation::IdleTimeout => "idle_timeout",
            WalSlotInvalidation::RecoveryConflict => "recovery_conflict",
            WalSlotInvalidation::Other(reason) => reason,
        }
    }

    /// What happened, in words (for messages and logs).
    pub fn describe(&self) -> String {
        match self {
            WalSlotInvalidation::WalRemoved => {
                "the WAL it needed was removed (it held more than max_slot_wal_keep_size)".into()
            }
            WalSlotInvalidation::RowsRemoved => "the primary removed catalog rows it needed \
                 (the standby ran without hot_standby_feedback or without a physical slot)"
                .into(),
            WalSlotInvalidation::WalLevelInsufficient => {
                "the primary's wal_level is no longer logical".into()
            }
            WalSlotInvalidation::IdleTimeout => "no session read it for longer than \
                 idle_replication_slot_timeout"
                .into(),
            WalSlotInvalidation::RecoveryConflict => {
                "a conflict with recovery on this standby (removed rows or the primary's \
                 wal_level)"
                    .into()
            }
            WalSlotInvalidation::Other(reason) => format!("{reason:?}"),
        }
    }

    /// From a `pg_replication_slots` row as JSON (columns differ between majors).
    fn from_row(row: &Value, wal_status: &str) -> Option<Self> {
        match row.get("invalidation_reason") {
            // 17+: the server says.
            Some(Value::String(reason)) => Some(Self::from_reason(reason)),
            Some(_) => None,
            None if row.get("conflicting") == Some(&Value::Bool(true)) => {
                Some(WalSlotInvalidation::RecoveryConflict)
            }
            None if wal_status == "lost" => Some(WalSlotInvalidation::WalRemoved),
            None => None,
        }
    }

    fn from_reason(reason: &str) -> Self {
        match reason {
            "wal_removed" => WalSlotInvalidation::WalRemoved,
            "rows_removed" => WalSlotInvalidation::RowsRemoved,
            "wal_level_insufficient" => WalSlotInvalidation::WalLevelInsufficient,
            "idle_timeout" => WalSlotInvalidation::IdleTimeout,
            other => WalSlotInvalidation::Other(other.to_owned()),
        }
    }
}

impl std::fmt::Display for WalSlotInvalidation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The major version of the server (`server_version_num / 10000`) and whether it is a
/// standby.
pub(crate) async fn server_major_and_recovery(conn: &mut PgConnection) -> Result<(i32, bool)> {
    let row = sqlx::raw_sql(
        "SELECT pg_catalog.current_setting('server_version_num')::int4 / 10000, \
                pg_catalog.pg_is_in_recovery()",
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

impl WalSlot {
    /// The first PostgreSQL major (as `server_version_num / 10000`) with failover slots.
    pub(crate) const FAILOVER_SLOTS_SINCE: i32 = 17;

    /// The slot `name` (validated: lowercase ASCII letters, digits and `_`).
    pub fn new(name: &str) -> Result<Self> {
        Ok(WalSlot {
            name: Identifier::new("replication slot", name)?,
            failover: None,
        })
    }

    /// Whether [`create`](Self::create) makes a *failover* slot (PostgreSQL 17+:
    /// `pg_create_logical_replication_slot(…, failover => true)`), which standbys running
    /// `sync_replication_slots = on` keep a synchronized copy of, so that the relay reads on
    /// from a promoted standby.
    ///
    /// **Default (not called): a failover slot wherever the server can make one**, that is on
    /// a 17+ primary; on 15 and 16 a plain slot (they have no failover slots: a failover
    /// loses the slot and what producers emitted after its last confirmed position). A
    /// failover slot costs nothing without standbys; with them, what it needs
    /// (`synchronized_standby_slots` on the primary naming each standby's physical slot,
    /// under which the relay reads only WAL those standbys have) is what `pgbox doctor`
    /// checks. `true`: required, `create` fails with [`Error::WalSlot`] on 15/16, on a
    /// standby, and when the slot exists without failover. `false`: a plain slot everywhere.
    ///
    /// An existing slot is never changed: PostgreSQL 17 turns failover on only through a
    /// replication connection (`ALTER_REPLICATION_SLOT <slot> (FAILOVER true)`), which sqlx
    /// cannot open. The default then logs a warning with the command (`psql
    /// 'dbname='\''<db>'\'' replication=database' -c 'ALTER_REPLICATION_SLOT "<slot>" (FAILOVER
    /// true)'`, quoted for a POSIX shell, to run while no relay reads the slot); `pgbox doctor`
    /// reports it (`wal_slot_not_failover`).
    pub fn failover(mut self, failover: bool) -> Self {
        self.failover = Some(failover);
        self
    }

    /// The slot's name.
    pub fn name(&self) -> &str {
        self.name.as_str()
    }

    /// Creates the publication and the slot if they do not exist; a failover slot on a
    /// PostgreSQL 17+ primary unless told otherwise ([`failover`](Self::failover)). Fails
    /// with [`Error::WalLevel`] unless the server runs with `wal_level = logical`. Needs the
    /// `REPLICATION` attribute (or superuser) and `CREATE` on the database; run it as the
    /// owner, like the migrations. Messages emitted before the slot exists are not kept.
    ///
    /// Safe to call from several processes at once (services starting together): the check
    /// and the create run under a transaction-level advisory lock keyed on the slot's name,
    /// so every caller succeeds and one creates. Fails with [`Error::WalSlot`] on a standby
    /// (create it on the primary; a 17+ standby with `sync_replication_slots = on` keeps a
    /// synchronized copy, which a slot made here would block), and when a slot of this name
    /// exists that the relay cannot read: a physical slot, a logical slot of another plugin
    /// than `pgoutput`, or one of another database (slot names are cluster-wide: pick another
    /// name).
    pub async fn create(&self, pool: &PgPool) -> Result<()> {
        self.create_if_absent(pool).await.map(|_| ())
    }

    /// [`create`](Self::create), saying whether this call created the slot (`false`: it
    /// existed, and is one the relay can read).
    pub async fn create_if_absent(&self, pool: &PgPool) -> Result<bool> {
        let mut tx = crate::pooler::begin(pool, None).await?;
        check_wal_level(&mut tx).await?;
        let (major, in_recovery) = server_major_and_recovery(&mut tx).await?;
        if in_recovery {
            return Err(self.on_standby_error(major));
        }
        let failover = self.failover_on(major, in_recovery)?;
        // Serializes concurrent creates of this name (released at commit or rollback). The
        // publication is created in this first transaction; the slot in a second one, since
        // PostgreSQL refuses to create a logical slot in a transaction that has written.
        self.lock(&mut tx).await?;
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1)",
        )
        .persistent(false)
        .bind(self.name())
        .fetch_one(&mut *tx)
        .await?;
        if !exists {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE PUBLICATION {}",
                self.name.quoted()
            )))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;

        let mut tx = crate::pooler::begin(pool, None).await?;
        self.lock(&mut tx).await?;
        let existing: Option<Value> = sqlx::query_scalar(
            "SELECT pg_catalog.jsonb_build_object(\
                'slot', pg_catalog.to_jsonb(s), \
                'this_database', s.database IS NOT DISTINCT FROM pg_catalog.current_database(), \
                'current_database', pg_catalog.current_database()::text) \
             FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1",
        )
        .persistent(false)
        .bind(self.name())
        .fetch_optional(&mut *tx)
        .await?;
        let created = match existing {
            None if major >= FAILOVER_SLOTS_SINCE => {
                sqlx::query(
                    "SELECT 1 FROM pg_catalog.pg_create_logical_replication_slot(\
                       $1, 'pgoutput', false, false, $2)",
                )
                .persistent(false)
                .bind(self.name())
                .bind(failover)
                .execute(&mut *tx)
                .await?;
                tracing::info!(slot = self.name(), failover, "pgbox WAL slot created");
                true
            }
            None => {
                sqlx::query(
                    "SELECT 1 FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')",
                )
                .persistent(false)
                .bind(self.name())
                .execute(&mut *tx)
                .await?;
                tracing::info!(slot = self.name(), "pgbox WAL slot created");
                true
            }
            Some(found) => {
                self.check_existing(&found)?;
                let row = found.get("slot").cloned().unwrap_or(Value::Null);
                if failover && row.get("failover") == Some(&Value::Bool(false)) {
                    let database = found
                        .get("current_database")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    let how = enable_failover_advice(self.name(), database);
                    if self.failover == Some(true) {
                        return Err(Error::WalSlot {
                            slot: self.name().to_owned(),
                            reason: format!("it exists without failover: {how}"),
                        });
                    }
                    tracing::warn!(
                        slot = self.name(),
                        "pgbox WAL slot exists without failover: a failover to a standby loses \
                         it. {how}"
                    );
                }
                false
            }
        };
        tx.commit().await?;
        Ok(created)
    }

    /// Takes the transaction-level advisory lock that serializes creates of this slot.
    async fn lock(&self, conn: &mut PgConnection) -> Result<()> {
        sqlx::query("SELECT pg_catalog.pg_advisory_xact_lock($1)")
            .persistent(false)
            .bind(create_lock_key(self.name()))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// An existing slot of this name must be one the relay reads: logical, `pgoutput`, in
    /// this database. `found` is `{slot, this_database, current_database}`.
    fn check_existing(&self, found: &Value) -> Result<()> {
        let row = found.get("slot").cloned().unwrap_or(Value::Null);
        let text = |key: &str| {
            row.get(key)
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_owned()
        };
        let what = if text("slot_type") != "logical" {
            Some(format!(
                "a {} replication slot of this name exists",
                text("slot_type")
            ))
        } else if text("plugin") != "pgoutput" {
            Some(format!(
                "a logical slot of this name exists with output plugin {:?} (the WAL relay \
                 reads pgoutput)",
                text("plugin")
            ))
        } else if found.get("this_database") != Some(&Value::Bool(true)) {
            Some(format!(
                "a logical slot of this name exists in database {:?}, not in this one ({:?}): \
                 slot names are cluster-wide, and a slot decodes only its own database",
                text("database"),
                found
                    .get("current_database")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
            ))
        } else {
            None
        };
        match what {
            None => Ok(()),
            Some(what) => Err(Error::WalSlot {
                slot: self.name().to_owned(),
                reason: format!(
                    "{what}; the WAL relay cannot read it. Pick another name for this \
                     database's slot (WalSlot::new, `pgbox wal create-slot --slot <name>`, and \
                     the same name for its relay), or drop that slot if nothing uses it"
                ),
            }),
        }
    }

    /// `create` on a standby: the slot belongs on the primary.
    fn on_standby_error(&self, major: i32) -> Error {
        let version = if major >= FAILOVER_SLOTS_SINCE {
            "on PostgreSQL 17+, a standby with sync_replication_slots = on keeps a \
             synchronized copy of the primary's failover slot, and a slot created here under \
             the same name would block that synchronization"
        } else {
            "before PostgreSQL 17, logical slots live on the primary only (a failover loses \
             them)"
        };
        Error::WalSlot {
            slot: self.name().to_owned(),
            reason: format!(
                "this server is a standby (pg_is_in_recovery()): create the slot on the \
                 primary; {version}"
            ),
        }
    }

    /// How to turn failover on for the existing slot `slot` of `database` (17+), for the
    /// doctor's advice.
    pub(crate) fn enable_failover_advice(slot: &str, database: &str) -> String {
        enable_failover_advice(slot, database)
    }

    /// Whether `create` makes a failover slot on this server.
    fn failover_on(&self, major: i32, in_recovery: bool) -> Result<bool> {
        match self.failover {
            Some(false) => Ok(false),
            None => Ok(major >= FAILOVER_SLOTS_SINCE && !in_recovery),
            Some(true) if major < FAILOVER_SLOTS_SINCE => Err(Error::WalSlot {
                slot: self.name().to_owned(),
                reason: format!(
                    "a failover slot needs PostgreSQL {FAILOVER_SLOTS_SINCE} or later; this \
                     server is {major}, whose slots exist on the primary only (a failover \
                     loses the slot)"
                ),
            }),
            Some(true) if in_recovery => Err(Error::WalSlot {
                slot: self.name().to_owned(),
                reason: "a failover slot is created on the primary; this server is a standby \
                         (it keeps a synchronized copy of the primary's failover slots with \
                         sync_replication_slots = on)"
                    .to_owned(),
            }),
            Some(true) => Ok(true),
        }
    }

    /// Drops the slot and the publication, if they exist. What the slot held unpublished is
    /// gone with it. Fails while a relay reads the slot (the slot is active), and on a
    /// standby for a synchronized slot (drop it on the primary).
    pub async fn drop(&self, pool: &PgPool) -> Result<()> {
        let mut conn = pool.acquire().await?;
        sqlx::query(
            "SELECT pg_catalog.pg_drop_replication_slot(slot_name) \
             FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
        )
        .persistent(false)
        .bind(self.name())
        .execute(&mut *conn)
        .await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP PUBLICATION IF EXISTS {}",
            self.name.quoted()
        )))
        .execute(&mut *conn)
        .await?;
        Ok(())
    }

    /// The slot's state, `None` if it does not exist. Works on a standby too (a synchronized
    /// copy of a failover slot).
    pub async fn status(&self, pool: &PgPool) -> Result<Option<WalSlotStatus>> {
        let mut tx = crate::pooler::begin(pool, None).await?;
        let status = self.read_status(&mut tx).await?;
        tx.commit().await?;
        Ok(status)
    }

    /// [`status`](Self::status) on `conn` (the WAL relay's reader sets its gauge with it).
    /// The row is read as JSON: the columns differ between majors (16 added `conflicting`,
    /// 17 `invalidation_reason`, `failover`, `synced`, `inactive_since`).
    pub(crate) async fn read_status(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Option<WalSlotStatus>> {
        let row = sqlx::query(
            "SELECT s.active, \
                    coalesce(pg_catalog.pg_wal_lsn_diff(CASE WHEN pg_catalog.pg_is_in_recovery() \
                        THEN pg_catalog.pg_last_wal_replay_lsn() \
                        ELSE pg_catalog.pg_current_wal_lsn() END, s.restart_lsn), 0)::int8, \
                    coalesce(s.wal_status, 'lost'), s.temporary, pg_catalog.to_jsonb(s) \
             FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1",
        )
        .persistent(false)
        .bind(self.name())
        .fetch_optional(&mut *conn)
        .await?;
        row.map(|r| {
            let wal_status: String = r.try_get(2)?;
            let json: Value = r.try_get(4)?;
            Ok(WalSlotStatus {
                active: r.try_get(0)?,
                retained_bytes: r.try_get(1)?,
                invalidation: WalSlotInvalidation::from_row(&json, &wal_status),
                wal_status,
                failover: json.get("failover").and_then(Value::as_bool),
                synced: json.get("synced").and_then(Value::as_bool),
                temporary: r.try_get(3)?,
                inactive_since: json
                    .get("inactive_since")
                    .and_then(Value::as_str)
                    .and_then(|t| OffsetDateTime::parse(t, &Rfc3339).ok()),
            })
        })
        .transpose()
    }
}

/// How to turn failover on for an existing slot `slot` of `database` on 17+: a replication
/// connection, or a drop and a create. The printed command is safe to paste into a POSIX shell
/// for any database and slot name: the database is a quoted libpq conninfo value, the slot a
/// quoted identifier of the replication command, and each argument is single-quoted for the
/// shell.
fn enable_failover_advice(slot: &str, database: &str) -> String {
    let conninfo = format!("dbname={} replication=database", conninfo_value(database));
    let command = format!(
        "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
        quote_identifier(slot)
    );
    format!(
        "PostgreSQL 17 has no SQL function to turn failover on for an existing slot; a \
         replication connection does, while no relay reads the slot (stop the relays for a \
         moment): psql {} -c {} (as a role with REPLICATION). Without one: stop producers and \
         relays, let the relay drain the slot (WalRelay::drain), `pgbox wal drop-slot --slot \
         {slot}`, `pgbox wal create-slot --slot {slot}` (a failover slot by default on 17+), \
         start them again (messages emitted between the drop and the create would not be kept)",
        shell_quote(&conninfo),
        shell_quote(&command),
    )
}

/// `value` as a single-quoted libpq conninfo value (`\` and `'` backslash-escaped).
fn conninfo_value(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// `name` as a double-quoted SQL (and replication command) identifier.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `arg` as one single-quoted POSIX shell word (`'` becomes `'\''`): nothing in it expands.
fn shell_quote(arg: &str) -> String {
    format!("'{}'", arg.replace('\'', "'\\''"))
}

/// The advisory lock key serializing [`WalSlot::create`] of the slot `name` (FNV-1a, like
/// the migrations' lock, under its own prefix).
fn create_lock_key(name: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"pgbox-wal-slot:".iter().chain(name.as_bytes()) {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash as i64
}

/// `wal_level` must be `logical` for logical decoding.
pub(crate) async fn check_wal_level(conn: &mut PgConnection) -> Result<()> {
    let level: String = sqlx::raw_sql("SELECT pg_catalog.current_setting('wal_level')")
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    if level != "logical" {
        return Err(Error::WalLevel { actual: level });
    }
    Ok(())
}
