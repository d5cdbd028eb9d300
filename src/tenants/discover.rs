//! Which databases and tenant schemas there are, and which sleeping tenants have due work:
//! one statement per database for each.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

use crate::error::Result;
use crate::ident::Identifier;

/// Databases on a server whose names match the pattern, that accept connections and are not
/// templates.
const DATABASES: &str = "SELECT datname::text FROM pg_catalog.pg_database \
     WHERE datname LIKE $1 AND datallowconn AND NOT datistemplate ORDER BY datname";

/// The database's name and its pgbox schemas matching the selector (`$1`: a LIKE pattern or
/// NULL, `$2`: names): schemas holding the relay's three tables, so that a schema whose
/// migration is still under way is not picked up half made.
const SCHEMAS: &str = "SELECT pg_catalog.current_database()::text, \
       ARRAY(SELECT n.nspname::text FROM pg_catalog.pg_namespace AS n \
         WHERE (n.nspname LIKE $1 OR n.nspname = ANY($2::text[])) \
           AND (SELECT pg_catalog.count(*) FROM pg_catalog.pg_class AS c \
                WHERE c.relnamespace = n.oid AND c.relkind IN ('r', 'p') \
                  AND c.relname IN ('outbox', 'outbox_dead_letters', 'outbox_scheduled')) = 3 \
         ORDER BY n.nspname)";

/// Schemas per idle-poll statement.
pub(super) const PROBE_CHUNK: usize = 200;

/// Which tenants to serve.
#[derive(Debug, Clone)]
pub(super) struct Selector {
    /// A LIKE pattern on schema names.
    pub(super) pattern: Option<String>,
    /// Schema names.
    pub(super) names: Vec<String>,
}

/// Where the databases come from.
#[derive(Debug, Clone)]
pub(super) struct Sources {
    /// Pools given one by one.
    pub(super) given: Vec<PgPool>,
    /// Servers to list databases on, with the LIKE pattern of their names.
    pub(super) servers: Vec<(PgPool, String)>,
    /// The size of the pool made for each discovered database.
    pub(super) pool_size: u32,
}

/// A database found by a discovery pass.
#[derive(Debug)]
pub(super) struct FoundDb {
    pub(super) name: String,
    pub(super) pool: PgPool,
    /// Made by the relay (closed when the database is let go), not given.
    pub(super) owned: bool,
    /// Its tenant schemas, or why they could not be read (the database is kept as it was).
    pub(super) schemas: std::result::Result<Vec<Identifier>, String>,
}

/// What a discovery pass found: every database to serve now, and the servers whose
/// listing failed (their databases known before are kept).
#[derive(Debug, Default)]
pub(super) struct Found {
    pub(super) databases: Vec<FoundDb>,
    /// Per server (in order): why its listing failed, if it did.
    pub(super) server_errors: Vec<Option<String>>,
    /// Given pools whose database could not be reached (index, error).
    pub(super) given_errors: Vec<(usize, String)>,
}

/// One discovery pass: each server's database list, then each database's schemas, one
/// statement each. `known` are the pools of databases discovered before (reused, and kept
/// when their server cannot be listed).
pub(super) async fn discover(
    sources: &Sources,
    selector: &Selector,
    known: &HashMap<String, PgPool>,
) -> Found {
    let mut found = Found::default();
    let mut pools: Vec<(Option<usize>, PgPool, bool)> = sources
        .given
        .iter()
        .enumerate()
        .map(|(i, p)| (Some(i), p.clone(), false))
        .collect();
    for (server, pattern) in &sources.servers {
        let listed: std::result::Result<Vec<String>, sqlx::Error> = sqlx::query_scalar(DATABASES)
            .bind(pattern)
            .fetch_all(server)
            .await;
        match listed {
            Ok(names) => {
                found.server_errors.push(None);
                for name in names {
                    let pool = known
                        .get(&name)
                        .cloned()
                        .unwrap_or_else(|| database_pool(server, &name, sources.pool_size));
                    pools.push((None, pool, true));
                }
            }
            Err(e) => {
                found.server_errors.push(Some(e.to_string()));
                // Keep what this server gave before; the database names tell whose they
                // are only by pattern, which is enough: the same pool is reused.
                for (name, pool) in known {
                    if like(pattern, name) {
                        pools.push((None, pool.clone(), true));
                    }
                }
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (given, pool, owned) in pools {
        let read: std::result::Result<(String, Vec<String>), sqlx::Error> = sqlx::query_as(SCHEMAS)
            .bind(selector.pattern.as_deref())
            .bind(&selector.names)
            .fetch_one(&pool)
            .await;
        let (name, schemas) = match read {
            Ok((name, schemas)) => (name, Ok(schemas)),
            Err(e) => match (given, pool.connect_options().get_database()) {
                (_, Some(name)) => (name.to_owned(), Err(e.to_string())),
                (Some(i), None) => {
                    found.given_errors.push((i, e.to_string()));
                    continue;
                }
                (None, None) => continue,
            },
        };
        if !seen.insert(name.clone()) {
            continue; // given and discovered both: served once
        }
        let schemas = schemas.map(|names| {
            names
                .iter()
                .filter_map(|s| match Identifier::pgbox_schema(s) {
                    Ok(id) => Some(id),
                    Err(e) => {
                        tracing::debug!(schema = %s, error = %e, "pgbox tenant relay skips a schema whose name pgbox does not accept");
                        None
                    }
                })
                .collect()
        });
        found.databases.push(FoundDb {
            name,
            pool,
            owned,
            schemas,
        });
    }
    found
}

/// A small, lazily connected pool on database `name` of `server`'s server, with its
/// connect options otherwise (user, TLS, application name).
fn database_pool(server: &PgPool, name: &str, size: u32) -> PgPool {
    let options = (*server.connect_options()).clone().database(name);
    PgPoolOptions::new()
        .max_connections(size)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(10))
        .idle_timeout(Some(Duration::from_secs(60)))
        .connect_lazy_with(options)
}

/// SQL's LIKE (with `%`, `_` and `\` escapes), to keep the databases of a server whose
/// listing failed.
fn like(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some(('%', rest)) => (0..=n.len()).any(|i| go(rest, &n[i..])),
            Some(('_', rest)) => !n.is_empty() && go(rest, &n[1..]),
            Some(('\\', rest)) if !rest.is_empty() => {
                n.first() == Some(&rest[0]) && go(&rest[1..], &n[1..])
            }
            Some((c, rest)) => n.first() == Some(c) && go(rest, &n[1..]),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    go(&p, &n)
}

/// The schemas among `schemas` that have due work: a pending message due now (or never
/// tried), or a scheduled message due. One statement (`UNION ALL` of `EXISTS` probes, each
/// an index probe) for up to [`PROBE_CHUNK`] schemas, prepared (planned once per connection
/// while the tenants stay the same).
///
/// A statement the database refuses (a tenant's table dropped, renamed or no longer
/// granted) is split in halves and each half probed again, down to single schemas: a schema
/// whose own probe fails is returned among the due ones, so that a round finds out whether
/// it is broken (and a broken tenant is left out of later probes), while the others are
/// told apart by their probes, not given a round each. Any other error (the database out of
/// reach) fails the whole call.
pub(super) async fn due(pool: &PgPool, schemas: &[Identifier]) -> Result<Vec<String>> {
    let mut due = Vec::new();
    let mut todo: Vec<&[Identifier]> = schemas.chunks(PROBE_CHUNK).rev().collect();
    // Bounded: each split halves a slice, so at most 2 * schemas.len() statements.
    while let Some(chunk) = todo.pop() {
        match probe(pool, chunk).await {
            Ok(found) => due.extend(found),
            Err(sqlx::Error::Database(e)) => {
                if let [one] = chunk {
                    tracing::debug!(schema = one.as_str(), error = %e, "pgbox tenant relay: a tenant's probe fails; it gets a round");
                    due.push(one.as_str().to_owned());
                } else {
                    let (a, b) = chunk.split_at(chunk.len() / 2);
                    todo.push(b);
                    todo.push(a);
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(due)
}

/// One probe statement for `chunk`.
async fn probe(
    pool: &PgPool,
    chunk: &[Identifier],
) -> std::result::Result<Vec<String>, sqlx::Error> {
    let sql = chunk
        .iter()
        .map(|s| {
            // The name as a literal, not a parameter: a statement without parameters
            // gets its generic plan at once (with 200 parameters PostgreSQL would plan
            // the first five executions anew, ~25 ms each per 100 tenants). Safe: an
            // Identifier holds only lowercase ASCII letters, digits and '_'.
            format!(
                "SELECT '{name}'::text WHERE EXISTS (SELECT 1 FROM {s}.outbox AS o \
                   WHERE o.published_at IS NULL \
                     AND (o.attempts = 0 OR o.available_at <= pg_catalog.now())) \
                 OR EXISTS (SELECT 1 FROM {s}.outbox_scheduled AS c \
                   WHERE c.due_at <= pg_catalog.now())",
                name = s.as_str()
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    // Prepared (the default): while the set of sleeping tenants stays the same, the
    // statement is planned once per connection, not every poll.
    sqlx::query_scalar::<_, String>(AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
}

#[cfg(test)]
mod tests {
    use super::like;

    #[test]
    fn like_matches_as_postgres_does() {
        assert!(like("tenant_db_%", "tenant_db_1"));
        assert!(like("tenant\\_db%", "tenant_db"));
        assert!(!like("tenant\\_db%", "tenantxdb"));
        assert!(like("t_n", "tan"));
        assert!(!like("t_n", "tn"));
        assert!(!like("tenant_db_%", "other"));
    }
}
