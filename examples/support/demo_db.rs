//! Where the examples keep their data: never in a database or schema they did not create.
//!
//! Without `DATABASE_URL`, an example works in a database of its own, `pgbox_demo` (or
//! `PGBOX_DEMO_DATABASE`), on the server the tests would use (a reachable local one, else a
//! throwaway cluster): created if missing and marked with a comment. A database of that name
//! without the mark belongs to someone else and is refused. With `DATABASE_URL`, the example
//! uses that database as given. Either way, the schemas an example resets are dropped only if
//! they carry the mark of the examples; a schema of the same name made by anyone else stops the
//! example with an error, untouched.

use anyhow::{Context, bail};
use sqlx::{Connection, PgConnection, PgPool};

use crate::local_pg;

/// The comment that marks a database or schema as the examples' own.
const MARK: &str = "created by the pgbox examples; safe to drop";

/// The database the example runs in, as a URL (see the module docs).
pub async fn demo_url() -> anyhow::Result<String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.is_empty()
    {
        return Ok(url);
    }
    let server = local_pg::database_url()
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let name = std::env::var("PGBOX_DEMO_DATABASE").unwrap_or_else(|_| "pgbox_demo".into());
    let mut admin = PgConnection::connect(&server)
        .await
        .with_context(|| format!("connect to {server}"))?;
    let comment: Option<Option<String>> = sqlx::query_scalar(
        "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1",
    )
    .bind(&name)
    .fetch_optional(&mut admin)
    .await?;
    match comment {
        Some(Some(c)) if c == MARK => {}
        Some(_) => bail!(
            "a database named {name:?} exists and was not created by pgbox's examples: refusing \
             to touch it (set PGBOX_DEMO_DATABASE to another name, or DATABASE_URL)"
        ),
        None => {
            let quoted = quote_ident(&name)?;
            let created = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {quoted}")))
                .execute(&mut admin)
                .await;
            match created {
                Ok(_) => {}
                // Another example created it at the same moment: check its mark again.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {
                    return Box::pin(demo_url()).await;
                }
                Err(e) => return Err(e).context(format!("create the demo database {name:?}")),
            }
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "COMMENT ON DATABASE {quoted} IS '{MARK}'"
            )))
            .execute(&mut admin)
            .await?;
            eprintln!("pgbox example: created the database {name:?} for its data");
        }
    }
    admin.close().await.ok();
    let mut url = url::Url::parse(&server).context("the server's URL")?;
    url.set_path(&name);
    Ok(url.to_string())
}

/// Drops and recreates `schemas`, each only if it is the examples' own (or absent): a schema
/// of one of these names made by anyone else is an error, and nothing is dropped.
pub async fn reset_schemas(pool: &PgPool, schemas: &[&str]) -> anyhow::Result<()> {
    let mut existing = Vec::new();
    for schema in schemas {
        let comment: Option<Option<String>> = sqlx::query_scalar(
            "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = $1",
        )
        .bind(schema)
        .fetch_optional(pool)
        .await?;
        let Some(comment) = comment else { continue };
        existing.push(*schema);
        if comment.as_deref() != Some(MARK) {
            bail!(
                "the schema {schema:?} exists in this database and was not created by pgbox's \
                 examples: refusing to drop it. Run the example in a database of its own (unset \
                 DATABASE_URL to use pgbox_demo, or point DATABASE_URL at an empty database)"
            );
        }
    }
    // `DROP SCHEMA ... CASCADE` also drops what others built on these schemas' objects
    // elsewhere (a view, a foreign key, a column of one of their types): refused, named.
    let outside: Vec<String> = sqlx::query_scalar(DEPENDENTS_OUTSIDE)
        .bind(&existing)
        .fetch_all(pool)
        .await?;
    if !outside.is_empty() {
        bail!(
            "objects outside the examples' schemas depend on them, and resetting {} would \
             drop them too: {}. Drop those yourself if they are leftovers, or run the example \
             in a database of its own (DATABASE_URL)",
            existing.join(", "),
            outside.join("; ")
        );
    }
    for schema in schemas {
        let quoted = quote_ident(schema)?;
        // Only what exists is dropped: no "does not exist, skipping" notices on a first run.
        let drop = if existing.contains(schema) {
            format!("DROP SCHEMA {quoted} CASCADE; ")
        } else {
            String::new()
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL client_min_messages = warning; {drop}CREATE SCHEMA {quoted}; \
             COMMENT ON SCHEMA {quoted} IS '{MARK}'"
        )))
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// What depends on an object of the schemas `$1` (a relation, a type, a function, the schema
/// itself) from outside them: the objects `DROP SCHEMA ... CASCADE` would take with it. A
/// view's rule, a trigger, a default and a policy belong to their table's schema; an object
/// of no schema counts as outside.
const DEPENDENTS_OUTSIDE: &str = "
WITH ours AS (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = ANY($1::text[])),
dependents AS (
  SELECT o.identity,
    CASE d.classid
      WHEN 'pg_catalog.pg_rewrite'::regclass THEN (SELECT c.relnamespace
        FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_class c ON c.oid = r.ev_class
        WHERE r.oid = d.objid)
      WHEN 'pg_catalog.pg_trigger'::regclass THEN (SELECT c.relnamespace
        FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
        WHERE t.oid = d.objid)
      WHEN 'pg_catalog.pg_attrdef'::regclass THEN (SELECT c.relnamespace
        FROM pg_catalog.pg_attrdef a JOIN pg_catalog.pg_class c ON c.oid = a.adrelid
        WHERE a.oid = d.objid)
      WHEN 'pg_catalog.pg_policy'::regclass THEN (SELECT c.relnamespace
        FROM pg_catalog.pg_policy p JOIN pg_catalog.pg_class c ON c.oid = p.polrelid
        WHERE p.oid = d.objid)
      ELSE (SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname = o.schema)
    END AS nsp
  FROM pg_catalog.pg_depend d
  CROSS JOIN LATERAL pg_catalog.pg_identify_object(d.classid, d.objid, d.objsubid) o
  -- Internal dependencies (a table's TOAST table, a view's rule on its view) are part of it.
  WHERE d.deptype <> 'i' AND ((d.refclassid = 'pg_catalog.pg_class'::regclass AND d.refobjid IN
          (SELECT oid FROM pg_catalog.pg_class WHERE relnamespace IN (SELECT oid FROM ours)))
     OR (d.refclassid = 'pg_catalog.pg_type'::regclass AND d.refobjid IN
          (SELECT oid FROM pg_catalog.pg_type WHERE typnamespace IN (SELECT oid FROM ours)))
     OR (d.refclassid = 'pg_catalog.pg_proc'::regclass AND d.refobjid IN
          (SELECT oid FROM pg_catalog.pg_proc WHERE pronamespace IN (SELECT oid FROM ours)))
     OR (d.refclassid = 'pg_catalog.pg_namespace'::regclass AND d.refobjid IN (SELECT oid FROM ours)))
)
SELECT DISTINCT identity FROM dependents
WHERE nsp IS NULL OR nsp NOT IN (SELECT oid FROM ours)
ORDER BY identity";

/// Creates those of `schemas` that are missing, marked as the examples' own (so that a demo
/// may reset them later); schemas of the examples that exist are left as they are. A schema
/// of one of these names made by anyone else is an error: the example does not move its
/// tables (or pgbox's) into it.
pub async fn ensure_schemas(pool: &PgPool, schemas: &[&str]) -> anyhow::Result<()> {
    for schema in schemas {
        let quoted = quote_ident(schema)?;
        let comment: Option<Option<String>> = sqlx::query_scalar(
            "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = $1",
        )
        .bind(schema)
        .fetch_optional(pool)
        .await?;
        match comment {
            Some(Some(c)) if c == MARK => continue,
            Some(_) => bail!(
                "the schema {schema:?} exists in this database and was not created by pgbox's \
                 examples: refusing to use it. Run the example in a database of its own (an \
                 empty database in DATABASE_URL, or the demo's pgbox_demo)"
            ),
            None => {}
        }
        // One implicit transaction (no BEGIN: a failure leaves no block open on the pooled
        // connection). Two services starting at once: one creates, the other finds it taken
        // (42P06, or 23505 from the catalog's unique index).
        let created = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {quoted}; COMMENT ON SCHEMA {quoted} IS '{MARK}'"
        )))
        .execute(pool)
        .await;
        match created {
            Ok(_) => {}
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("42P06" | "23505")) => {}
            Err(e) => return Err(e).context(format!("create the schema {schema:?}")),
        }
    }
    Ok(())
}

/// Stops with a message naming the owner when `table` (`schema.table`) exists without every
/// one of `columns`: a table of the same name made by another example (or an older version
/// of this one), whose layout every statement would trip over with a raw SQL error.
pub async fn check_layout(
    pool: &PgPool,
    example: &str,
    table: &str,
    columns: &[&str],
) -> anyhow::Result<()> {
    let (schema, name) = table
        .split_once('.')
        .with_context(|| format!("{table:?} is not schema.table"))?;
    let found: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = $2",
    )
    .bind(schema)
    .bind(name)
    .fetch_all(pool)
    .await?;
    let missing: Vec<&str> = columns
        .iter()
        .copied()
        .filter(|c| !found.iter().any(|f| f == c))
        .collect();
    if !found.is_empty() && !missing.is_empty() {
        bail!(
            "the table {table} belongs to {example}, but the one in this database has another \
             layout (no column {}): another program, or an older version of the example, made \
             it. Drop the schema if it is a leftover (`DROP SCHEMA {schema} CASCADE`), or run \
             the example in a database of its own (DATABASE_URL)",
            missing.join(", ")
        );
    }
    Ok(())
}

/// A lower-case name as a quoted identifier; anything else is refused.
fn quote_ident(name: &str) -> anyhow::Result<String> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !valid {
        bail!("{name:?} is not a plain lower-case name");
    }
    Ok(format!("\"{name}\""))
}
