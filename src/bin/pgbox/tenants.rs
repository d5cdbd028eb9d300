//! `--tenants` and `--databases`: `migrate`, `status` and `doctor` across many pgbox schemas
//! (one per tenant) and many databases, with one line per tenant and a summary.

use std::time::Duration;

use pgbox::doctor::{Doctor, Severity};
use pgbox::{Migrator, sqlx};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::{Failure, fail, print};

/// Which tenants a fleet command covers.
pub(crate) struct Selection {
    /// A `LIKE` pattern over schema names; `None`: the `--schema` alone.
    pub(crate) tenants: Option<String>,
    /// A `LIKE` pattern over database names; `None`: the URL's database alone.
    pub(crate) databases: Option<String>,
    /// `--schema`, used in each database when no `--tenants` pattern is given.
    pub(crate) schema: String,
}

impl Selection {
    pub(crate) fn is_fleet(&self) -> bool {
        self.tenants.is_some() || self.databases.is_some()
    }
}

/// One database and the tenant schemas found in it.
struct Target {
    database: String,
    pool: PgPool,
    schemas: Vec<String>,
    /// Names that matched the pattern but are not valid pgbox schema names (left alone).
    skipped: Vec<String>,
    /// Why the database's schemas could not be listed (it refuses this role's connection,
    /// was dropped, ...): reported as a failed line of its own, never as a skipped name.
    unreadable: Option<String>,
}

/// Schemas matching `pattern` in the pool's database: every schema for `migrate` (a new
/// tenant's schema may hold nothing yet), else only those holding pgbox's history table.
async fn schemas(pool: &PgPool, pattern: &str, for_migrate: bool) -> Result<Vec<String>, Failure> {
    let sql = if for_migrate {
        "SELECT nspname::text FROM pg_catalog.pg_namespace WHERE nspname LIKE $1 \
         AND nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema' ORDER BY 1"
    } else {
        "SELECT n.nspname::text FROM pg_catalog.pg_namespace n \
         WHERE n.nspname LIKE $1 AND EXISTS (SELECT 1 FROM pg_catalog.pg_tables t \
           WHERE t.schemaname = n.nspname AND t.tablename = $2) ORDER BY 1"
    };
    let found: Vec<String> = sqlx::query_scalar(sql)
        .persistent(false)
        .bind(pattern)
        .bind(pgbox::HISTORY_TABLE)
        .fetch_all(pool)
        .await
        .map_err(|e| Failure::from(pgbox::Error::from(e)))?;
    Ok(found)
}

async fn targets(
    url: Option<&str>,
    selection: &Selection,
    for_migrate: bool,
) -> Result<Vec<Target>, Failure> {
    let first = super::connect(url).await?;
    let mut databases: Vec<(String, PgPool)> = Vec::new();
    match &selection.databases {
        None => {
            let name: String = sqlx::query_scalar("SELECT pg_catalog.current_database()::text")
                .persistent(false)
                .fetch_one(&first)
                .await
                .map_err(|e| Failure::from(pgbox::Error::from(e)))?;
            databases.push((name, first));
        }
        Some(pattern) => {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT datname::text FROM pg_catalog.pg_database \
                 WHERE datname LIKE $1 AND datallowconn AND NOT datistemplate ORDER BY 1",
            )
            .persistent(false)
            .bind(pattern)
            .fetch_all(&first)
            .await
            .map_err(|e| Failure::from(pgbox::Error::from(e)))?;
            let options = (*first.connect_options()).clone();
            for name in names {
                let pool = PgPoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_lazy_with(options.clone().database(&name));
                databases.push((name, pool));
            }
        }
    }
    let mut out = Vec::with_capacity(databases.len());
    for (database, pool) in databases {
        let (found, skipped) = match &selection.tenants {
            None => (vec![selection.schema.clone()], Vec::new()),
            Some(pattern) => match schemas(&pool, pattern, for_migrate).await {
                Ok(names) => names
                    .into_iter()
                    .partition(|n| Migrator::new().schema(n).is_ok()),
                Err(e) => {
                    // A database that cannot be read is reported as one failed tenant.
                    out.push(Target {
                        database,
                        pool,
                        schemas: Vec::new(),
                        skipped: Vec::new(),
                        unreadable: Some(e.message),
                    });
                    continue;
                }
            },
        };
        out.push(Target {
            database,
            pool,
            schemas: found,
            skipped,
            unreadable: None,
        });
    }
    Ok(out)
}

fn skipped_json(targets: &[Target]) -> Vec<Value> {
    targets
        .iter()
        .flat_map(|t| {
            t.skipped
                .iter()
                .map(|s| json!({"database": t.database, "schema": s}))
        })
        .collect()
}

fn skipped_text(targets: &[Target]) -> String {
    let mut out = String::new();
    for t in targets {
        for s in &t.skipped {
            out.push_str(&format!(
                "{}/{s}: skipped (not a pgbox schema name: lowercase ASCII letters, digits, _)\n",
                t.database
            ));
        }
    }
    out
}

/// `pgbox migrate --tenants/--databases`: every tenant, `jobs` at a time per database; a
/// failed tenant does not stop the others; running it again resumes.
pub(crate) async fn migrate(
    url: Option<&str>,
    selection: &Selection,
    migrator: Migrator,
    jobs: usize,
    json_mode: bool,
) -> Result<(), Failure> {
    let targets = targets(url, selection, true).await?;
    let mut rows = Vec::new();
    let (mut migrated, mut current, mut failed) = (0usize, 0usize, 0usize);
    let mut text = String::new();
    for t in &targets {
        if let Some(e) = &t.unreadable {
            failed += 1;
            text.push_str(&format!(
                "{}: FAILED: database not readable: {e}\n",
                t.database
            ));
            rows.push(json!({
                "database": t.database,
                "schema": null,
                "state": "failed",
                "applied": [],
                "error": format!("database not readable: {e}"),
            }));
        }
        let outcomes = if t.schemas.is_empty() {
            Vec::new()
        } else {
            // Every name was validated by `targets`.
            migrator.run_each(&t.pool, &t.schemas, jobs).await?
        };
        for o in outcomes {
            let (state, line, applied) = match &o.result {
                Ok(r) if r.applied.is_empty() => {
                    current += 1;
                    ("up_to_date", "up to date".to_owned(), Vec::new())
                }
                Ok(r) => {
                    migrated += 1;
                    let first = r.applied.first().map(|m| m.version).unwrap_or_default();
                    let last = r.applied.last().map(|m| m.version).unwrap_or_default();
                    (
                        "migrated",
                        format!("applied {} (V{first}..V{last})", r.applied.len()),
                        r.applied.iter().map(|m| m.version).collect(),
                    )
                }
                Err(e) => {
                    failed += 1;
                    ("failed", format!("FAILED: {e}"), Vec::new())
                }
            };
            text.push_str(&format!("{}/{}: {line}\n", t.database, o.schema));
            rows.push(json!({
                "database": t.database,
                "schema": o.schema,
                "state": state,
                "applied": applied,
                "error": o.result.as_ref().err().map(|e| e.to_string()),
            }));
        }
    }
    let total = migrated + current + failed;
    print(
        json_mode,
        json!({
            "tenants": rows,
            "skipped": skipped_json(&targets),
            "migrated": migrated,
            "up_to_date": current,
            "failed": failed,
        }),
        || {
            format!(
                "{text}{}{total} tenant schema(s) in {} database(s): {migrated} migrated, \
                 {current} up to date, {failed} failed\n",
                skipped_text(&targets),
                targets.len()
            )
        },
    );
    if failed > 0 {
        return Err(fail(
            1,
            format!(
                "{failed} of {total} tenant schemas failed; run the same command again to resume"
            ),
        ));
    }
    Ok(())
}

/// `pgbox status --tenants/--databases`: one line per tenant, totals over its topics.
pub(crate) async fn status(
    url: Option<&str>,
    selection: &Selection,
    json_mode: bool,
) -> Result<(), Failure> {
    let targets = targets(url, selection, false).await?;
    let mut rows = Vec::new();
    let mut text = String::new();
    let mut broken = 0usize;
    for t in &targets {
        if let Some(e) = &t.unreadable {
            broken += 1;
            text.push_str(&format!(
                "{}: FAILED: database not readable: {e}\n",
                t.database
            ));
            rows.push(json!({
                "database": t.database, "schema": null, "ok": false,
                "error": format!("database not readable: {e}"),
            }));
        }
        for schema in &t.schemas {
            match pgbox::status(&t.pool, schema).await {
                Ok(s) => {
                    let backlog: i64 = s.topics.iter().map(|x| x.outbox_backlog_estimate).sum();
                    let dead: i64 = s
                        .topics
                        .iter()
                        .map(|x| x.outbox_dead_letters + x.queue_dead_letters)
                        .sum();
                    let queued: i64 = s.topics.iter().map(|x| x.queue_backlog_estimate).sum();
                    let oldest = s
                        .topics
                        .iter()
                        .filter_map(|x| x.outbox_oldest_pending)
                        .min();
                    let age = oldest.map(|o| (s.taken_at - o).as_seconds_f64().max(0.0));
                    text.push_str(&format!(
                        "{}/{schema}: outbox ~{backlog}{}, queue ~{queued}, dead letters {dead}\n",
                        t.database,
                        age.map(|a| format!(" (oldest {a:.1}s)"))
                            .unwrap_or_default()
                    ));
                    rows.push(json!({
                        "database": t.database, "schema": schema, "ok": true,
                        "topics": s.topics.len(),
                        "outbox_backlog_estimate": backlog,
                        "outbox_oldest_pending_age_seconds": age,
                        "queue_backlog_estimate": queued,
                        "dead_letters": dead,
                    }));
                }
                Err(e) => {
                    broken += 1;
                    text.push_str(&format!("{}/{schema}: FAILED: {e}\n", t.database));
                    rows.push(json!({
                        "database": t.database, "schema": schema, "ok": false,
                        "error": e.to_string(),
                    }));
                }
            }
        }
    }
    let total = rows.len();
    print(
        json_mode,
        json!({"tenants": rows, "skipped": skipped_json(&targets), "failed": broken}),
        || {
            format!(
                "{text}{}{total} tenant schema(s), {broken} unreadable\n",
                skipped_text(&targets)
            )
        },
    );
    if broken > 0 {
        return Err(fail(
            1,
            format!("{broken} of {total} tenant schemas could not be read"),
        ));
    }
    Ok(())
}

/// `pgbox doctor --tenants/--databases`: each tenant's worst finding; the exit status is the
/// worst over all (8 critical, 7 warnings, 4 a tenant not migrated, 0 all ok).
pub(crate) async fn doctor(
    url: Option<&str>,
    selection: &Selection,
    template: Doctor,
    json_mode: bool,
) -> Result<(), Failure> {
    let targets = targets(url, selection, false).await?;
    let mut rows = Vec::new();
    let mut text = String::new();
    let mut worst = 0u8;
    let rank = |code: u8| match code {
        8 => 4,
        7 => 3,
        4 => 2,
        1 => 1,
        _ => 0,
    };
    for t in &targets {
        if let Some(e) = &t.unreadable {
            if rank(1) > rank(worst) {
                worst = 1;
            }
            text.push_str(&format!(
                "{}: FAILED: database not readable: {e}\n",
                t.database
            ));
            rows.push(json!({
                "database": t.database, "schema": null,
                "error": format!("database not readable: {e}"), "exit_code": 1,
            }));
        }
        for schema in &t.schemas {
            let doctor = template.clone().schema(schema)?;
            let (code, row, line) = match doctor.check(&t.pool).await {
                Ok(report) => {
                    let code = super::doctor_exit_code(&report);
                    let worst_finding = report
                        .findings
                        .iter()
                        .filter(|f| f.severity != Severity::Ok)
                        .max_by_key(|f| f.severity);
                    let line = match worst_finding {
                        None if report.not_migrated() => "not migrated".to_owned(),
                        None => "ok".to_owned(),
                        Some(f) => format!(
                            "{} critical, {} warning(s); worst: {}",
                            report.count(Severity::Critical),
                            report.count(Severity::Warning),
                            f.message
                        ),
                    };
                    let mut value = serde_json::to_value(&report).expect("json");
                    value["database"] = json!(t.database);
                    value["exit_code"] = json!(code);
                    (code, value, line)
                }
                Err(e) => (
                    1,
                    json!({"database": t.database, "schema": schema, "error": e.to_string(), "exit_code": 1}),
                    format!("FAILED: {e}"),
                ),
            };
            if rank(code) > rank(worst) {
                worst = code;
            }
            text.push_str(&format!("{}/{schema}: {line}\n", t.database));
            rows.push(row);
        }
    }
    let total = rows.len();
    print(
        json_mode,
        json!({"tenants": rows, "skipped": skipped_json(&targets), "exit_code": worst}),
        || {
            format!(
                "{text}{}{total} tenant schema(s) checked\n",
                skipped_text(&targets)
            )
        },
    );
    if worst != 0 {
        return Err(fail(
            worst,
            format!("doctor: at least one of {total} tenant schemas needs attention"),
        ));
    }
    Ok(())
}
