//! Validated SQL identifiers: the only way a name reaches an SQL string in pgbox.

use std::fmt;

use crate::error::{Error, Result};

/// PostgreSQL truncates identifiers longer than this many bytes (NAMEDATALEN - 1); pgbox
/// refuses them instead.
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// The schema pgbox uses unless told otherwise. (Here, below every module that names a
/// schema, so that none of them has to import the migrator for it.)
pub const DEFAULT_SCHEMA: &str = "pgbox";

/// The longest name of a schema that holds pgbox's own tables. pgbox's `NOTIFY` channels are
/// named `<schema>.outbox` and `<schema>.queue`, and a channel name has the same 63-byte
/// limit as an identifier: a longer schema would make every enqueue fail at its NOTIFY.
pub const MAX_PGBOX_SCHEMA_BYTES: usize = MAX_IDENTIFIER_BYTES - ".outbox".len();

/// A schema, table or column name that passed validation and is always rendered quoted.
///
/// Accepted: 1 to 63 bytes of lowercase ASCII letters, digits and `_`, not starting with a
/// digit, and not starting with `pg_` (reserved by PostgreSQL). Uppercase is refused rather
/// than silently folded, so `Pgbox` and `pgbox` can never name two different things.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Identifier {
    name: String,
}

impl Identifier {
    /// Validates `name`; `what` ("schema", "table", "column") goes into the error message.
    pub fn new(what: &'static str, name: &str) -> Result<Self> {
        let invalid = |reason| Error::InvalidIdentifier {
            what,
            name: name.to_owned(),
            reason,
        };
        if name.is_empty() {
            return Err(invalid("must not be empty"));
        }
        if name.len() > MAX_IDENTIFIER_BYTES {
            return Err(invalid(
                "longer than 63 bytes (PostgreSQL would truncate it)",
            ));
        }
        if name.as_bytes()[0].is_ascii_digit() {
            return Err(invalid("must not start with a digit"));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(invalid(
                "only lowercase ASCII letters, digits and '_' are allowed",
            ));
        }
        if name.starts_with("pg_") {
            return Err(invalid(
                "names starting with 'pg_' are reserved by PostgreSQL",
            ));
        }
        Ok(Identifier {
            name: name.to_owned(),
        })
    }

    /// Validates the name of a schema holding pgbox's tables: an identifier of at most
    /// [`MAX_PGBOX_SCHEMA_BYTES`] bytes, so that its notification channels fit.
    pub(crate) fn pgbox_schema(name: &str) -> Result<Self> {
        let schema = Identifier::new("schema", name)?;
        if name.len() > MAX_PGBOX_SCHEMA_BYTES {
            return Err(Error::InvalidIdentifier {
                what: "schema",
                name: name.to_owned(),
                reason: "longer than 56 bytes: pgbox schemas leave room for the \".outbox\" suffix of their 63-byte NOTIFY channel",
            });
        }
        remember_pgbox_schema(name);
        Ok(schema)
    }

    /// The bare name, as stored in catalogs (`pg_namespace.nspname`, ...).
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// The name double-quoted for SQL. Validation already excludes `"`, quoting keeps
    /// keywords such as `user` or `order` usable.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.name)
    }
}

impl fmt::Display for Identifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.quoted())
    }
}

impl fmt::Debug for Identifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identifier({})", self.quoted())
    }
}

/// A table, optionally schema-qualified: the table name of the business-row helpers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableRef {
    schema: Option<Identifier>,
    table: Identifier,
}

impl TableRef {
    /// An unqualified table, resolved through `search_path`.
    pub(crate) fn new(table: &str) -> Result<Self> {
        Ok(TableRef {
            schema: None,
            table: Identifier::new("table", table)?,
        })
    }

    /// Qualifies the table with `schema`.
    pub(crate) fn in_schema(mut self, schema: &str) -> Result<Self> {
        self.schema = Some(Identifier::new("schema", schema)?);
        Ok(self)
    }
}

impl fmt::Display for TableRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.table),
            None => write!(f, "{}", self.table),
        }
    }
}

/// The schemas this process has named as holding pgbox's tables (any pgbox value built
/// with a schema: an inbox, an outbox, a queue, a relay, the migrator...). An error about a
/// missing object says "run the migrations" only in one of these: an application's own
/// schema with a table named like pgbox's (`orders.inbox`) gets no such advice.
static PGBOX_SCHEMAS: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// At most this many names are remembered (a process that builds values for many tenants
/// keeps the first ones; the hint then also checks the object's name).
const REMEMBERED_SCHEMAS_CAP: usize = 4096;

fn remember_pgbox_schema(name: &str) {
    let mut known = PGBOX_SCHEMAS.lock().unwrap_or_else(|p| p.into_inner());
    if known.len() < REMEMBERED_SCHEMAS_CAP && !known.contains(name) {
        known.insert(name.to_owned());
    }
}

/// Whether `name` is [`DEFAULT_SCHEMA`] or a schema this process has used for pgbox's tables.
pub(crate) fn is_pgbox_schema(name: &str) -> bool {
    name == DEFAULT_SCHEMA
        || PGBOX_SCHEMAS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_lowercase_names_and_keywords() {
        for ok in [
            "pgbox",
            "a",
            "_private",
            "order",
            "points_v2",
            &"x".repeat(63),
        ] {
            let id = Identifier::new("schema", ok).unwrap();
            assert_eq!(id.quoted(), format!("\"{ok}\""));
        }
    }

    #[test]
    fn refuses_names_that_could_escape_or_be_folded() {
        for bad in [
            "",
            "Pgbox",
            "pg\"box",
            "a;drop table x",
            "1abc",
            "pg_catalog",
            "naïve",
            "a b",
            "a\0b",
            &"x".repeat(64),
        ] {
            assert!(
                matches!(
                    Identifier::new("schema", bad),
                    Err(Error::InvalidIdentifier { .. })
                ),
                "{bad:?} was accepted"
            );
        }
    }
}
