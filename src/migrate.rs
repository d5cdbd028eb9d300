//! Schema migrations: refinery's embedded migrations, applied over a sqlx connection.
//!
//! refinery ships no sqlx driver and takes no lock. pgbox implements refinery's async traits
//! for a sqlx connection and serializes concurrent migrators (five service instances booting
//! at once) with a session advisory lock, so every caller succeeds and exactly one applies
//! each migration. The history table lives inside the pgbox schema, away from an
//! application's own `refinery_schema_history`.

use futures_util::StreamExt;
use refinery_core::Migration;
use refinery_core::traits::r#async::{AsyncMigrate, AsyncQuery, AsyncTransaction};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Postgres, Row};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::ident::Identifier;

/// The migrations this build applies (also read by [`crate::doctor`]).
pub(crate) mod embedded {
    refinery::embed_migrations!("migrations");
}

pub use crate::ident::DEFAULT_SCHEMA;

/// Name of the migration history table, created inside the pgbox schema.
pub const HISTORY_TABLE: &str = "pgbox_migrations";

/// Applies pgbox's migrations to the default schema ([`DEFAULT_SCHEMA`]).
///
/// Safe to call from every instance at start-up: concurrent calls wait for each other and a
/// call with nothing to do is a cheap no-op.
pub async fn migrate(pool: &PgPool) -> Result<MigrationReport> {
    Migrator::new().run(pool).await
}

/// Applies pgbox's migrations, with options.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// let report = pgbox::Migrator::new().schema("messaging")?.run(&pool).await?;
/// println!("applied {} migrations", report.applied.len());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Migrator {
    schema: Identifier,
    partitioning: Option<crate::inbox::InboxPartitioning>,
    grant_to: Vec<Identifier>,
}

impl Default for Migrator {
    fn default() -> Self {
        Self::new()
    }
}

/// One migration that a [`Migrator::run`] applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMigration {
    /// The `V<n>` version number.
    pub version: i32,
    /// The name after `__`.
    pub name: String,
}

/// What a [`Migrator::run`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// The migrations this call applied, oldest first; empty when already up to date.
    pub applied: Vec<AppliedMigration>,
    /// Inbox partitions this call created ([`Migrator::partitioned_inbox`] only).
    pub partitions_created: Vec<String>,
}

/// One schema's outcome in [`Migrator::run_each`].
#[derive(Debug)]
#[non_exhaustive]
pub struct SchemaMigration {
    /// The schema.
    pub schema: String,
    /// What [`Migrator::run`] answered for it.
    pub result: Result<MigrationReport>,
}

impl Migrator {
    /// A migrator for the default schema.
    pub fn new() -> Self {
        Migrator {
            schema: Identifier::pgbox_schema(DEFAULT_SCHEMA).expect("default schema is valid"),
            partitioning: None,
            grant_to: Vec::new(),
        }
    }

    /// Uses `schema` instead of [`DEFAULT_SCHEMA`]. The name is validated, then always quoted.
    pub fn schema(mut self, schema: &str) -> Result<Self> {
        self.schema = Identifier::pgbox_schema(schema)?;
        Ok(self)
    }

    /// Switches the schema to the time-partitioned inbox (see [`InboxPartitioning`]): after
    /// the migrations, records the settings and creates the first partitions. Idempotent:
    /// every instance may pass the same settings at start-up; new settings replace the old
    /// ones for partitions created from then on.
    ///
    /// From then on the plain `inbox` table refuses new claims, so every consumer of the
    /// schema must build its inbox with
    /// [`InboxBuilder::partitioned(true)`](crate::InboxBuilder::partitioned) (a mismatch
    /// fails with [`Error::InboxLayout`]); records already in the plain table keep
    /// deduplicating until they are purged. There is no switching back.
    ///
    /// [`InboxPartitioning`]: crate::InboxPartitioning
    pub fn partitioned_inbox(mut self, partitioning: crate::inbox::InboxPartitioning) -> Self {
        self.partitioning = Some(partitioning);
        self
    }

    /// After the migrations, grants the application role `role` what pgbox's components need
    /// on this schema, and nothing more: `USAGE` on the schema, per table the
    /// `SELECT`/`INSERT`/`UPDATE`/`DELETE` the inbox, outbox, relay, built-in queue, janitor
    /// and doctor run, `USAGE` on lease mode's token sequence, `EXECUTE` on the functions
    /// they call (see the README's "Least-privilege roles"). No `CREATE`, no ownership, no
    /// role membership. May be called more than once, for several roles.
    ///
    /// The grants are applied on every [`run`](Migrator::run) (and written into
    /// [`to_sql`](Migrator::to_sql)'s script), whether or not a migration was pending: `GRANT`
    /// is idempotent, and objects a later migration adds are granted by the run that adds
    /// them. Run the migrator as the schema's owner (the role that creates pgbox's objects);
    /// the role must exist.
    ///
    /// `role` is validated like a schema name (lowercase ASCII, digits, `_`; quoted in SQL);
    /// `public` is refused: it would grant every role.
    pub fn grant_to(mut self, role: &str) -> Result<Self> {
        let role = crate::grants::role(role)?;
        if !self.grant_to.contains(&role) {
            self.grant_to.push(role);
        }
        Ok(self)
    }

    /// The roles [`grant_to`](Migrator::grant_to) named, in order.
    pub fn grant_roles(&self) -> impl Iterator<Item = &str> {
        self.grant_to.iter().map(Identifier::as_str)
    }

    /// The schema this migrator targets.
    pub fn schema_name(&self) -> &str {
        self.schema.as_str()
    }

    /// Applies every pending migration.
    ///
    /// Holds a session advisory lock (derived from the schema name) on one pooled connection
    /// while it works; on any error, or if this future is dropped before it completes, that
    /// connection is closed rather than returned to the pool, which releases the lock.
    ///
    /// That lock needs a session of its own: a pool that goes through a pooler in transaction
    /// mode (found by the doctor's probe, when the pool can lend two connections) is refused
    /// with [`Error::SessionRequired`] before anything is locked or applied.
    pub async fn run(&self, pool: &PgPool) -> Result<MigrationReport> {
        self.run_probed(pool, true).await
    }

    /// [`run`](Migrator::run), with the pooler probe only when `probe` ([`run_each`]
    /// probes once, before its jobs take the pool's connections).
    ///
    /// [`run_each`]: Migrator::run_each
    async fn run_probed(&self, pool: &PgPool, probe: bool) -> Result<MigrationReport> {
        let span = tracing::info_span!("pgbox.migrate", schema = self.schema.as_str());
        async {
            if probe && crate::pooler::shares_sessions(pool).await? == Some(true) {
                return Err(session_required());
            }
            let mut guard = SessionGuard(Some(pool.acquire().await?));
            let conn = guard.0.as_mut().expect("just set");
            let report = self.run_locked(conn).await?;
            // Success: the lock was released, the connection may go back to the pool.
            drop(guard.0.take());
            // What an operator needs, once per call; each migration is at DEBUG.
            match (report.applied.first(), report.applied.last()) {
                (Some(first), Some(last)) => tracing::info!(
                    applied = report.applied.len(),
                    from = first.version,
                    to = last.version,
                    "pgbox schema migrated"
                ),
                _ => tracing::info!(applied = 0, "pgbox schema already current"),
            }
            Ok(report)
        }
        .instrument(span)
        .await
    }

    /// Applies this migrator's migrations, partitioning and grants to each of `schemas` (one
    /// pgbox schema per tenant), up to `jobs` schemas at a time, and reports each schema's
    /// outcome in the order given. The schema set with [`schema`](Migrator::schema) is not
    /// used.
    ///
    /// - Every name is validated before anything is applied: one bad name refuses the whole
    ///   call ([`Error::InvalidIdentifier`]), so a typo never migrates half a list.
    /// - One schema's failure (a refused history, a lost connection, a missing privilege) is
    ///   that schema's [`SchemaMigration::result`]; the others are still migrated.
    /// - Resumable: each schema is migrated as [`run`](Migrator::run) does (its own lock, each
    ///   migration in a transaction of its own), so a run that was interrupted is finished by
    ///   running it again: schemas already current answer with nothing applied, at the cost
    ///   of one lock and one read of their history each. Two runs at once wait for each other
    ///   schema by schema.
    /// - Each schema holds one of `pool`'s connections while it is migrated: `jobs` is
    ///   bounded by 1 below and by the pool's size above.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
    /// let tenants = ["tenant_acme", "tenant_globex"];
    /// let outcomes = pgbox::Migrator::new().run_each(&pool, tenants, 4).await?;
    /// for tenant in &outcomes {
    ///     if let Err(e) = &tenant.result {
    ///         eprintln!("{}: {e}", tenant.schema);
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn run_each<I, S>(
        &self,
        pool: &PgPool,
        schemas: I,
        jobs: usize,
    ) -> Result<Vec<SchemaMigration>>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut migrators = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for schema in schemas {
            let migrator = self.clone().schema(schema.as_ref())?;
            if seen.insert(migrator.schema.as_str().to_owned()) {
                migrators.push(migrator);
            }
        }
        let jobs = jobs.clamp(1, (pool.options().get_max_connections() as usize).max(1));
        let total = migrators.len();
        // The pooler probe needs two of the pool's connections: once, here, while the pool is
        // free. Probed per schema, `jobs` at the pool's size would leave every probe without a
        // second connection, and each would go ahead through a transaction-mode pooler. A
        // probe that fails (the server away) leaves each schema to fail on its own.
        let through_pooler = match total {
            0 => false,
            _ => matches!(crate::pooler::shares_sessions(pool).await, Ok(Some(true))),
        };
        let mut done = 0usize;
        let outcomes: Vec<SchemaMigration> = futures_util::stream::iter(migrators)
            .map(|migrator| async move {
                let result = if through_pooler {
                    Err(session_required())
                } else {
                    migrator.run_probed(pool, false).await
                };
                SchemaMigration {
                    schema: migrator.schema.as_str().to_owned(),
                    result,
                }
            })
            .buffered(jobs)
            .inspect(|outcome| {
                done += 1;
                if let Err(e) = &outcome.result {
                    tracing::warn!(schema = %outcome.schema, error = %e, done, total, "pgbox tenant schema not migrated");
                }
            })
            .collect()
            .await;
        let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
        tracing::info!(schemas = total, failed, "pgbox tenant schemas migrated");
        Ok(outcomes)
    }

    async fn run_locked(&self, conn: &mut PoolConnection<Postgres>) -> Result<MigrationReport> {
        if let Some(partitioning) = &self.partitioning {
            partitioning.validate()?;
        }
        let lock_key = advisory_lock_key(self.schema.as_str());
        sqlx::query("SELECT pg_catalog.pg_advisory_lock($1)")
            .bind(lock_key)
            .execute(&mut **conn)
            .await?;
        // The idempotent DDL (`IF NOT EXISTS`, here and refinery's history table) answers a
        // re-run with NOTICEs ("already exists, skipping") that land in the application's
        // log: quiet for this session's migration work, reset before the connection is reused.
        sqlx::raw_sql("SET client_min_messages = warning")
            .execute(&mut **conn)
            .await?;
        // `CREATE SCHEMA IF NOT EXISTS` checks the database's CREATE privilege before it looks
        // for the schema: a schema's owner without that privilege (a schema per tenant made by
        // a DBA) could never migrate. Only a missing schema is created.
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
        )
        .bind(self.schema.as_str())
        .fetch_one(&mut **conn)
        .await?;
        if !exists {
            let create = format!("CREATE SCHEMA IF NOT EXISTS {}", self.schema.quoted());
            sqlx::raw_sql(AssertSqlSafe(create))
                .execute(&mut **conn)
                .await?;
        }

        let applied = self.apply_pending(conn).await?;
        let partitions_created = match &self.partitioning {
            Some(partitioning) => partitioning.apply(conn, &self.schema).await?,
            None => Vec::new(),
        };
        for role in &self.grant_to {
            let grants = crate::grants::grant_sql(&self.schema, role);
            sqlx::raw_sql(AssertSqlSafe(format!("BEGIN;\n{grants}COMMIT;")))
                .execute(&mut **conn)
                .await?;
        }

        sqlx::raw_sql("RESET client_min_messages")
            .execute(&mut **conn)
            .await?;
        sqlx::query("SELECT pg_catalog.pg_advisory_unlock($1)")
            .bind(lock_key)
            .execute(&mut **conn)
            .await?;
        Ok(MigrationReport {
            applied,
            partitions_created,
        })
    }

    /// Applies the migrations the schema lacks, each in a transaction of its own with its
    /// history row, as refinery's runner would, but without its INFO line per step (it logs
    /// through `log`, which most applications' subscribers show): pgbox logs each migration at
    /// DEBUG and [`run`](Migrator::run) one INFO line per call. A history that is not a plain
    /// prefix of this build's migrations (an edited, unknown or skipped migration) goes to
    /// refinery's runner, whose checks refuse it ([`Error::Migration`]).
    async fn apply_pending(&self, conn: &mut PgConnection) -> Result<Vec<AppliedMigration>> {
        let history = self.history_table();
        let mut ours = embedded::migrations::runner().get_migrations().clone();
        ours.sort_by_key(|m| m.version());
        let mut db = SqlxMigrationConnection {
            conn,
            schema: &self.schema,
        };
        db.execute([history_table_ddl(&history).as_str()].into_iter())
            .await?;
        let found: Vec<Migration> = db
            .query(&format!(
                "SELECT version, name, applied_on, checksum FROM {history} ORDER BY version"
            ))
            .await?;
        let plain_prefix = found.len() <= ours.len()
            && found.iter().zip(&ours).all(|(a, m)| {
                a.version() == m.version() && a.name() == m.name() && a.checksum() == m.checksum()
            });
        if !plain_prefix {
            let mut runner = embedded::migrations::runner();
            runner.set_migration_table_name(&history);
            let report = runner
                .run_async(&mut db)
                .await
                .map_err(|e| Error::Migration(Box::new(e)))?;
            return Ok(report
                .applied_migrations()
                .iter()
                .map(|m| AppliedMigration {
                    version: m.version(),
                    name: m.name().to_owned(),
                })
                .collect());
        }
        let mut applied = Vec::new();
        for m in &ours[found.len()..] {
            tracing::debug!(
                version = m.version(),
                name = m.name(),
                "applying pgbox migration"
            );
            let record = history_row_sql(&history, m);
            let sql = m.sql().unwrap_or_default();
            db.execute([sql, record.as_str()].into_iter())
                .await
                .inspect_err(|e| {
                    tracing::warn!(
                        version = m.version(),
                        name = m.name(),
                        error = %e,
                        "pgbox migration failed; rolled back"
                    );
                })?;
            applied.push(AppliedMigration {
                version: m.version(),
                name: m.name().to_owned(),
            });
        }
        Ok(applied)
    }

    /// The migrations already applied to this schema, oldest first (empty if none).
    ///
    /// Safe through a pooler in transaction mode: one transaction, unnamed statements.
    pub async fn applied(&self, pool: &PgPool) -> Result<Vec<AppliedMigration>> {
        let mut tx = crate::pooler::begin(pool, None).await?;
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = $1 AND tablename = $2)",
        )
        .persistent(false)
        .bind(self.schema.as_str())
        .bind(HISTORY_TABLE)
        .fetch_one(&mut *tx)
        .await?;
        if !exists {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT version, name FROM {} ORDER BY version",
            self.history_table()
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        rows.iter()
            .map(|r| {
                Ok(AppliedMigration {
                    version: r.try_get(0)?,
                    name: r.try_get(1)?,
                })
            })
            .collect()
    }

    /// All migrations as one plain SQL script, for teams that run their own migration tool.
    ///
    /// The script takes the same advisory lock as [`Migrator::run`] (for its own transaction
    /// only), creates the schema, points `search_path` at it for that transaction only, and
    /// applies every migration in order. It also records each migration in pgbox's history
    /// table ([`HISTORY_TABLE`]) exactly as [`Migrator::run`] does (version, name, time
    /// applied, checksum), so a schema installed from this script is a pgbox schema like any
    /// other: the `pgbox` CLI accepts it, and a later [`Migrator::run`] or `pgbox migrate`
    /// applies only migrations that are newer than the script.
    ///
    /// Run it once, on a schema without pgbox tables: it creates them unconditionally, so a
    /// second run fails (and, being one transaction, changes nothing).
    ///
    /// With [`grant_to`](Migrator::grant_to), the script ends with the grants, in the same
    /// transaction.
    pub fn to_sql(&self) -> String {
        let mut migrations = embedded::migrations::runner().get_migrations().clone();
        // In version order: the embedded list follows file names, where V10 sorts before V2.
        migrations.sort_by_key(|m| m.version());
        let history = self.history_table();
        let mut out = format!(
            "-- pgbox schema {schema}: {n} migration(s). Run once, in one transaction.\n\
             BEGIN;\n\
             -- Waits for a concurrent `pgbox migrate` of this schema, and makes it wait.\n\
             SELECT pg_catalog.pg_advisory_xact_lock({lock});\n\
             CREATE SCHEMA IF NOT EXISTS {schema};\n\
             SET LOCAL search_path TO {schema}, pg_temp;\n\
             -- pgbox's migration history (refinery's layout), so `pgbox migrate` sees what\n\
             -- this script applied.\n\
             {create_history}\n",
            schema = self.schema.quoted(),
            n = migrations.len(),
            lock = advisory_lock_key(self.schema.as_str()),
            create_history = history_table_ddl(&history),
        );
        for m in &migrations {
            out.push_str(&format!("\n-- V{}__{}\n", m.version(), m.name()));
            out.push_str(m.sql().unwrap_or_default().trim_end());
            out.push('\n');
            out.push_str(&history_row_sql(&history, m));
            out.push('\n');
        }
        for role in &self.grant_to {
            out.push('\n');
            out.push_str(&crate::grants::grant_sql(&self.schema, role));
        }
        out.push_str("\nCOMMIT;\n");
        out
    }

    fn history_table(&self) -> String {
        format!("{}.\"{HISTORY_TABLE}\"", self.schema.quoted())
    }
}

/// The history table as refinery creates it (`CREATE TABLE IF NOT EXISTS`, `int4` versions,
/// text columns); [`Migrator::run`] asserts the same statement before it reads the table.
fn history_table_ddl(history: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {history}(\
         version int4 PRIMARY KEY, \
         name VARCHAR(255), \
         applied_on VARCHAR(255), \
         checksum VARCHAR(255));"
    )
}

/// The history row refinery writes when it applies `m`: the checksum as a decimal string, the
/// time applied as RFC 3339 in UTC (here the server's clock, at the time the script runs).
fn history_row_sql(history: &str, m: &Migration) -> String {
    format!(
        "INSERT INTO {history} (version, name, applied_on, checksum) VALUES \
         ({version}, {name}, \
         pg_catalog.to_char(pg_catalog.clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
         '{checksum}');",
        version = m.version(),
        name = sql_literal(m.name()),
        checksum = m.checksum(),
    )
}

/// A string as an SQL literal (standard-conforming strings: only `'` needs doubling).
fn sql_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// What a migration through a pooler in transaction mode is refused with.
fn session_required() -> Error {
    Error::SessionRequired {
        component: "migrations",
        reason: "they hold a session advisory lock while they apply, and this pool's \
                 connections go through a pooler in transaction mode, which would \
                 hand that lock to other clients' transactions; migrate on a direct \
                 connection (the server's own address)"
            .to_owned(),
    }
}

/// Owns the migrating connection. Unless the run completed, dropping it (on an error, or when
/// the caller drops the `run` future, e.g. on a start-up timeout) closes the connection
/// instead of returning it to the pool: the server then ends the session, which releases the
/// advisory lock and rolls back any half-applied migration.
struct SessionGuard(Option<PoolConnection<Postgres>>);

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}

/// A stable 64-bit lock id per schema (FNV-1a), so migrators of different schemas never
/// wait for each other.
fn advisory_lock_key(schema: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"pgbox-migrate:".iter().chain(schema.as_bytes()) {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash as i64
}

/// refinery's async driver traits, implemented for a sqlx connection. Each `execute` batch is
/// one transaction whose `search_path` is the pgbox schema.
struct SqlxMigrationConnection<'c> {
    conn: &'c mut PgConnection,
    schema: &'c Identifier,
}

impl AsyncTransaction for SqlxMigrationConnection<'_> {
    type Error = sqlx::Error;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &'a mut self,
        queries: T,
    ) -> std::result::Result<usize, Self::Error> {
        let mut tx = self.conn.begin().await?;
        // pg_temp last: otherwise it is searched first, and a session's temporary table
        // could shadow a pgbox table inside functions created here.
        let set_path = format!("SET LOCAL search_path TO {}, pg_temp", self.schema.quoted());
        sqlx::raw_sql(AssertSqlSafe(set_path))
            .execute(&mut *tx)
            .await?;
        let mut count = 0;
        for query in queries {
            // Simple-query protocol: a migration file may hold many statements.
            sqlx::raw_sql(AssertSqlSafe(query.to_owned()))
                .execute(&mut *tx)
                .await?;
            count += 1;
        }
        tx.commit().await?;
        Ok(count)
    }
}

impl AsyncQuery<Vec<Migration>> for SqlxMigrationConnection<'_> {
    async fn query<'a>(
        &'a mut self,
        query: &'a str,
    ) -> std::result::Result<Vec<Migration>, Self::Error> {
        let rows = sqlx::raw_sql(AssertSqlSafe(query.to_owned()))
            .fetch_all(&mut *self.conn)
            .await?;
        rows.into_iter()
            .map(|row| {
                let applied_on: String = row.try_get(2)?;
                let checksum: String = row.try_get(3)?;
                let applied_on = OffsetDateTime::parse(&applied_on, &Rfc3339)
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
                let checksum = checksum
                    .parse::<u64>()
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
                Ok(Migration::applied(
                    row.try_get(0)?,
                    row.try_get(1)?,
                    applied_on,
                    checksum,
                ))
            })
            .collect()
    }
}

impl AsyncMigrate for SqlxMigrationConnection<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_differ_per_schema_and_are_stable() {
        assert_eq!(advisory_lock_key("pgbox"), advisory_lock_key("pgbox"));
        assert_ne!(advisory_lock_key("pgbox"), advisory_lock_key("pgbox2"));
    }

    #[test]
    fn plain_sql_targets_the_configured_schema() {
        let sql = Migrator::new().schema("billing").unwrap().to_sql();
        assert!(sql.contains("CREATE SCHEMA IF NOT EXISTS \"billing\""));
        assert!(sql.contains("SET LOCAL search_path TO \"billing\", pg_temp"));
        assert!(sql.contains("CREATE TABLE inbox"));
        assert!(sql.trim_end().ends_with("COMMIT;"));
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"billing\".\"pgbox_migrations\""));
        assert!(sql.contains("INSERT INTO \"billing\".\"pgbox_migrations\""));
        // In version order, not file-name order (where V10 sorts before V2).
        let versions: Vec<i32> = sql
            .lines()
            .filter_map(|l| l.strip_prefix("-- V")?.split("__").next()?.parse().ok())
            .collect();
        assert!(versions.len() >= 11, "{versions:?}");
        assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    }
}
