//! The logical replication slot the WAL relay reads, and its publication.

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

use crate::error::{Error, Result};
use crate::ident::Identifier;

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
}

/// What [`WalSlot::status`] reads from `pg_replication_slots`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalSlotStatus {
    /// Whether a session reads it now (a WAL relay's reader).
    pub active: bool,
    /// WAL the slot keeps from being removed: from its restart position to the server's
    /// current position, in bytes.
    pub retained_bytes: i64,
    /// `pg_replication_slots.wal_status`: `reserved`, `extended`, `unreserved` or `lost`
    /// (invalidated: the WAL it needed is gone, and so are the messages in it).
    pub wal_status: String,
}

impl WalSlot {
    /// The slot `name` (validated: lowercase ASCII letters, digits and `_`).
    pub fn new(name: &str) -> Result<Self> {
        Ok(WalSlot {
            name: Identifier::new("replication slot", name)?,
        })
    }

    /// The slot's name.
    pub fn name(&self) -> &str {
        self.name.as_str()
    }

    /// Creates the publication and the slot if they do not exist. Fails with
    /// [`Error::WalLevel`] unless the server runs with `wal_level = logical`. Needs the
    /// `REPLICATION` attribute (or superuser) and `CREATE` on the database; run it as the
    /// owner, like the migrations. Messages emitted before the slot exists are not kept.
    pub async fn create(&self, pool: &PgPool) -> Result<()> {
        let mut conn = pool.acquire().await?;
        check_wal_level(&mut conn).await?;
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1)",
        )
        .persistent(false)
        .bind(self.name())
        .fetch_one(&mut *conn)
        .await?;
        if !exists {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE PUBLICATION {}",
                self.name.quoted()
            )))
            .execute(&mut *conn)
            .await?;
        }
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1)",
        )
        .persistent(false)
        .bind(self.name())
        .fetch_one(&mut *conn)
        .await?;
        if !exists {
            sqlx::query(
                "SELECT 1 FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')",
            )
            .persistent(false)
            .bind(self.name())
            .execute(&mut *conn)
            .await?;
            tracing::info!(slot = self.name(), "pgbox WAL slot created");
        }
        Ok(())
    }

    /// Drops the slot and the publication, if they exist. What the slot held unpublished is
    /// gone with it. Fails while a relay reads the slot (the slot is active).
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

    /// The slot's state, `None` if it does not exist.
    pub async fn status(&self, pool: &PgPool) -> Result<Option<WalSlotStatus>> {
        let mut tx = crate::pooler::begin(pool, None).await?;
        let status = self.read_status(&mut tx).await?;
        tx.commit().await?;
        Ok(status)
    }

    /// [`status`](Self::status) on `conn` (the WAL relay's reader sets its gauge with it).
    pub(crate) async fn read_status(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Option<WalSlotStatus>> {
        let row = sqlx::query(
            "SELECT active, \
                    coalesce(pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), restart_lsn), 0)::int8, \
                    coalesce(wal_status, 'lost') \
             FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
        )
        .persistent(false)
        .bind(self.name())
        .fetch_optional(&mut *conn)
        .await?;
        row.map(|r| {
            Ok(WalSlotStatus {
                active: r.try_get(0)?,
                retained_bytes: r.try_get(1)?,
                wal_status: r.try_get(2)?,
            })
        })
        .transpose()
    }
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
