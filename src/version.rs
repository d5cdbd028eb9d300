//! Optimistic versioning: compare-and-set on a business row guarded by a version column.
//!
//! ```sql
//! UPDATE accounts SET balance = $3, version = version + 1 WHERE id = $1 AND version = $2
//! ```
//!
//! Zero rows means someone else changed the row since it was read (or it is gone): the
//! update reports [`Error::VersionConflict`] with the version actually found, or
//! [`Error::RowNotFound`]. A conflict is retryable: re-read and re-apply, in a new transaction,
//! for example with [`Inbox::process_with_retry`](crate::Inbox::process_with_retry).

use sqlx::postgres::PgArguments;
use sqlx::{Arguments, AssertSqlSafe, Encode, Postgres, Row, Type};

use crate::error::{Error, Result};
use crate::ident::{Identifier, TableRef};
use crate::inbox::ConnectionLike;

/// A table whose rows carry an integer (`bigint`) version column. Names are validated once
/// and always quoted; values are always bound parameters.
///
/// ```no_run
/// # async fn f(conn: &mut sqlx::PgConnection) -> pgbox::Result<()> {
/// let accounts = pgbox::VersionedTable::new("accounts")?; // columns `id` and `version`
/// let (balance, version): (i64, i64) =
///     sqlx::query_as("SELECT balance, version FROM accounts WHERE id = $1")
///         .bind(7_i64).fetch_one(&mut *conn).await?;
/// let new_version = accounts
///     .update(7_i64, version)
///     .set("balance", balance + 100)
///     .execute(conn)
///     .await?; // Err(Error::VersionConflict { .. }) if another writer got there first
/// # let _ = new_version; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct VersionedTable {
    table: TableRef,
    id: Identifier,
    version: Identifier,
}

impl VersionedTable {
    /// The table `name` (resolved through `search_path` unless [`schema`](Self::schema) is
    /// set), with columns `id` and `version`.
    pub fn new(name: &str) -> Result<Self> {
        Ok(VersionedTable {
            table: TableRef::new(name)?,
            id: Identifier::new("column", "id")?,
            version: Identifier::new("column", "version")?,
        })
    }

    /// Qualifies the table with a schema.
    pub fn schema(mut self, schema: &str) -> Result<Self> {
        self.table = self.table.in_schema(schema)?;
        Ok(self)
    }

    /// The primary-key column (default `id`).
    pub fn id_column(mut self, column: &str) -> Result<Self> {
        self.id = Identifier::new("column", column)?;
        Ok(self)
    }

    /// The version column (default `version`), a `bigint`.
    pub fn version_column(mut self, column: &str) -> Result<Self> {
        self.version = Identifier::new("column", column)?;
        Ok(self)
    }

    /// Starts a compare-and-set of row `id`, expected to be at `expected_version`.
    pub fn update<'q, I>(&self, id: I, expected_version: i64) -> VersionedUpdate<'_>
    where
        I: Encode<'q, Postgres> + Type<Postgres> + Clone + 'q,
    {
        let mut id_args = PgArguments::default();
        let mut error = id_args.add(id.clone()).err();
        let mut args = PgArguments::default();
        if let Err(e) = args.add(id) {
            error.get_or_insert(e);
        }
        if let Err(e) = args.add(expected_version) {
            error.get_or_insert(e);
        }
        VersionedUpdate {
            table: self,
            expected: expected_version,
            assignments: String::new(),
            args,
            id_args,
            next_param: 3,
            error: error.map(|e| Error::from(sqlx::Error::Encode(e))),
        }
    }

    /// The row's current version, `None` if there is no such row.
    pub async fn current_version<'q, I>(
        &self,
        conn: &mut impl ConnectionLike,
        id: I,
    ) -> Result<Option<i64>>
    where
        I: Encode<'q, Postgres> + Type<Postgres> + 'q,
    {
        let mut args = PgArguments::default();
        args.add(id).map_err(sqlx::Error::Encode)?;
        self.read_version(conn, args).await
    }

    async fn read_version(
        &self,
        conn: &mut impl ConnectionLike,
        id_args: PgArguments,
    ) -> Result<Option<i64>> {
        let sql = format!(
            "SELECT {v} FROM {t} WHERE {id} = $1",
            v = self.version,
            t = self.qualified(),
            id = self.id
        );
        let read = sqlx::query_scalar_with(AssertSqlSafe(sql), id_args)
            .persistent(conn.persistent())
            .fetch_optional(conn.connection())
            .await;
        if read.is_err() {
            conn.statement_failed();
        }
        Ok(read?)
    }

    fn qualified(&self) -> String {
        self.table.to_string()
    }
}

/// A compare-and-set being built by [`VersionedTable::update`]. Column names are validated
/// as they are added; the first problem is reported by [`execute`](Self::execute).
#[derive(Debug)]
#[must_use = "nothing is written until `execute`"]
pub struct VersionedUpdate<'t> {
    table: &'t VersionedTable,
    expected: i64,
    assignments: String,
    args: PgArguments,
    id_args: PgArguments,
    next_param: usize,
    error: Option<Error>,
}

impl VersionedUpdate<'_> {
    /// `column = value`.
    pub fn set<'q, T>(self, column: &str, value: T) -> Self
    where
        T: Encode<'q, Postgres> + Type<Postgres> + 'q,
    {
        self.assign(column, value, false)
    }

    /// `column = column + delta`: the seed example "add 100 to the balance".
    pub fn add<'q, T>(self, column: &str, delta: T) -> Self
    where
        T: Encode<'q, Postgres> + Type<Postgres> + 'q,
    {
        self.assign(column, delta, true)
    }

    fn assign<'q, T>(mut self, column: &str, value: T, relative: bool) -> Self
    where
        T: Encode<'q, Postgres> + Type<Postgres> + 'q,
    {
        if self.error.is_some() {
            return self;
        }
        let column = match Identifier::new("column", column) {
            Ok(c) => c,
            Err(e) => {
                self.error = Some(e);
                return self;
            }
        };
        if column == self.table.version || column == self.table.id {
            self.error = Some(Error::InvalidIdentifier {
                what: "column",
                name: column.as_str().to_owned(),
                reason: "the id and version columns are managed by the compare-and-set",
            });
            return self;
        }
        if let Err(e) = self.args.add(value) {
            self.error = Some(sqlx::Error::Encode(e).into());
            return self;
        }
        let n = self.next_param;
        self.next_param += 1;
        if relative {
            self.assignments
                .push_str(&format!("{column} = {column} + ${n}, "));
        } else {
            self.assignments.push_str(&format!("{column} = ${n}, "));
        }
        self
    }

    /// Runs the compare-and-set in one statement; returns the new version.
    ///
    /// Errors: [`Error::VersionConflict`] (retryable) with the version found,
    /// [`Error::RowNotFound`], or an input error from `set`/`add`.
    pub async fn execute(self, conn: &mut impl ConnectionLike) -> Result<i64> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let t = self.table;
        let (v, id, table) = (&t.version, &t.id, t.qualified());
        // The second sub-select reads the version when nothing matched, in the same round trip.
        let sql = format!(
            "WITH updated AS (\
               UPDATE {table} SET {assignments}{v} = {v} + 1 \
               WHERE {id} = $1 AND {v} = $2 RETURNING {v}) \
             SELECT (SELECT {v} FROM updated), (SELECT {v} FROM {table} WHERE {id} = $1)",
            assignments = self.assignments,
        );
        let row = sqlx::query_with(AssertSqlSafe(sql), self.args)
            .persistent(conn.persistent())
            .fetch_one(conn.connection())
            .await;
        if row.is_err() {
            conn.statement_failed();
        }
        let row = row?;
        let new_version: Option<i64> = row.try_get(0)?;
        let mut current: Option<i64> = row.try_get(1)?;
        if let Some(new_version) = new_version {
            tracing::debug!(table = %table, new_version, "pgbox versioned update applied");
            return Ok(new_version);
        }
        if current == Some(self.expected) {
            // The row changed while this statement waited for its lock: the statement's
            // snapshot still shows the old version. Read the committed one.
            current = t.read_version(conn, self.id_args).await?;
        }
        match current {
            None => Err(Error::RowNotFound { table }),
            Some(actual) => {
                tracing::info!(table = %table, expected = self.expected, actual, "pgbox version conflict");
                Err(Error::VersionConflict {
                    table,
                    expected: self.expected,
                    actual,
                })
            }
        }
    }
}
