//! Attacks on migrations across tenants (`Migrator::run_each`, the CLI's `--tenants` and
//! `--databases`). Promise under attack (rustdoc of `run_each`, guide/src/cli.md "Many
//! tenants at once"):
//! - every name validated first; one schema's failure is that schema's result; resumable;
//!   two runs at once wait for each other schema by schema; `jobs` bounded by the pool;
//! - the CLI: a failing tenant is reported on its line, the others go on, exit 1 for
//!   `migrate`/`status` if any failed; an invalid matching name is skipped, never touched;
//!   the password never printed;
//! - the migrator runs as the schema's owner (least privilege: no `CREATE` needed elsewhere).
//!
//! `finding_*` tests show a defect; `holds_*` tests are attacks that held.

mod support;

use std::process::{Command, Output};
use std::time::Duration;

use pgbox::Migrator;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection};
use support::TestDb;

fn pgbox(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .expect("run pgbox")
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Databases and a login role made for one test; dropped (databases first) at the end.
struct Fixture {
    server: String,
    databases: Vec<String>,
    role: String,
}

impl Fixture {
    async fn create(prefix: &str, n: usize) -> Fixture {
        let server = support::server_url().await;
        let mut admin = PgConnection::connect(&server).await.unwrap();
        let databases: Vec<String> = (0..n).map(|i| format!("{prefix}_{i}")).collect();
        for name in &databases {
            admin
                .execute(sqlx::AssertSqlSafe(format!(
                    "CREATE DATABASE \"{name}\" TEMPLATE template0"
                )))
                .await
                .unwrap();
        }
        let role = format!("{prefix}_role");
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE ROLE \"{role}\" LOGIN")))
            .await
            .unwrap();
        admin.close().await.ok();
        Fixture {
            server,
            databases,
            role,
        }
    }

    /// The URL of database `i`, as `user` (with `password` when given).
    fn url(&self, i: usize, user: Option<&str>, password: Option<&str>) -> String {
        let mut url = url::Url::parse(&self.server).unwrap();
        url.set_path(&self.databases[i]);
        if let Some(user) = user {
            url.set_username(user).unwrap();
        }
        if password.is_some() {
            url.set_password(password).unwrap();
        }
        url.to_string()
    }

    async fn admin(&self, i: usize) -> PgConnection {
        PgConnection::connect(&self.url(i, None, None))
            .await
            .unwrap()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let server = self.server.clone();
        let databases = self.databases.clone();
        let role = self.role.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&server).await {
                    for name in databases {
                        let _ = admin
                            .execute(sqlx::AssertSqlSafe(format!(
                                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                            )))
                            .await;
                    }
                    let _ = admin
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP OWNED BY \"{role}\"; DROP ROLE IF EXISTS \"{role}\""
                        )))
                        .await;
                }
            });
        })
        .join();
    }
}

/// Least privilege: a DBA creates each tenant's schema owned by the application's owner role
/// and keeps `CREATE` on the database to itself. The migrator runs "as the schema's owner"
/// (its rustdoc), yet every tenant fails: `CREATE SCHEMA IF NOT EXISTS` checks the
/// database's `CREATE` privilege before it looks whether the schema exists.
#[tokio::test]
async fn finding_schema_owner_without_database_create_cannot_migrate_its_tenants() {
    let fx = Fixture::create(&unique("pgbox_atkmig"), 1).await;
    let role = fx.role.clone();
    let mut admin = fx.admin(0).await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "REVOKE CREATE ON DATABASE \"{db}\" FROM PUBLIC; \
             CREATE SCHEMA tenant_a AUTHORIZATION \"{role}\"; \
             CREATE SCHEMA tenant_b AUTHORIZATION \"{role}\"",
            db = fx.databases[0]
        )))
        .await
        .unwrap();
    admin.close().await.ok();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&fx.url(0, Some(&role), None))
        .await
        .unwrap();
    let out = Migrator::new()
        .run_each(&pool, ["tenant_a", "tenant_b"], 2)
        .await
        .unwrap();
    let errors: Vec<String> = out
        .iter()
        .filter_map(|o| {
            o.result
                .as_ref()
                .err()
                .map(|e| format!("{}: {e}", o.schema))
        })
        .collect();
    pool.close().await;
    assert!(
        errors.is_empty(),
        "the owner of the tenant schemas could not migrate them: {errors:?}"
    );
}

/// A matching database this role may not connect to: `migrate --databases --tenants`
/// reports it as a "skipped" schema name, counts no failure and exits 0, so a fleet
/// migration that left a whole database behind looks successful.
#[tokio::test]
async fn finding_unreachable_database_is_not_a_failure_for_migrate_status_or_doctor() {
    let prefix = unique("pgbox_atkmig");
    let fx = Fixture::create(&prefix, 2).await;
    let role = fx.role.clone();
    for i in 0..2 {
        let mut admin = fx.admin(i).await;
        admin
            .execute(sqlx::AssertSqlSafe(format!(
                "GRANT CREATE ON DATABASE \"{db}\" TO \"{role}\"; \
                 CREATE SCHEMA acme_t1 AUTHORIZATION \"{role}\"",
                db = fx.databases[i]
            )))
            .await
            .unwrap();
        admin.close().await.ok();
    }
    // Database 1: its tenant exists, but this role may no longer connect to it.
    let mut admin = fx.admin(1).await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "REVOKE CONNECT ON DATABASE \"{}\" FROM PUBLIC",
            fx.databases[1]
        )))
        .await
        .unwrap();
    admin.close().await.ok();

    let secret = "s3cret_Pw_9f1";
    let url = fx.url(0, Some(&role), Some(secret));
    let pattern = format!("{prefix}\\_%");
    let mut codes = Vec::new();
    for command in ["migrate", "status", "doctor"] {
        let out = pgbox(
            &url,
            &["--databases", &pattern, "--tenants", "acme\\_%", command],
        );
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !stdout.contains(secret) && !stderr.contains(secret),
            "the password is printed: {stdout} / {stderr}"
        );
        codes.push((command, out.status.code(), stdout, stderr));
    }
    let wrong: Vec<_> = codes
        .iter()
        .filter(|(command, code, _, _)| match *command {
            // The doctor's worst over every tenant: anything but "all ok".
            "doctor" => *code == Some(0),
            _ => *code != Some(1),
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "a database that could not be reached is not a failure: {wrong:#?}"
    );
}

/// Hostile names matching `--tenants '%'`: uppercase, spaces, quotes, Unicode, a 57-byte
/// name, a name with `%` and `_`: each is listed as skipped and nothing is created in it;
/// the valid one is migrated.
#[tokio::test]
async fn holds_hostile_schema_names_are_skipped_and_untouched() {
    let db = TestDb::empty().await;
    let long = format!("t{}", "a".repeat(56));
    let hostile = [
        "Tenant_Up".to_owned(),
        "tenant x".to_owned(),
        "tenant\"q".to_owned(),
        "tenant_é".to_owned(),
        "tenant%_".to_owned(),
        "tenant;drop".to_owned(),
        long.clone(),
    ];
    let mut conn = db.connect().await;
    for name in &hostile {
        let quoted = name.replace('"', "\"\"");
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{quoted}\"")))
            .await
            .unwrap();
    }
    conn.execute("CREATE SCHEMA tenant_ok").await.unwrap();
    let out = pgbox(&db.url(), &["--json", "--tenants", "%", "migrate"]);
    let body: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stderr));
    });
    assert!(out.status.success(), "{body}");
    let skipped: Vec<&str> = body["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["schema"].as_str().unwrap())
        .collect();
    for name in &hostile {
        assert!(
            skipped.contains(&name.as_str()),
            "{name:?} not skipped: {body}"
        );
        let tables: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = $1")
                .bind(name)
                .fetch_one(&mut conn)
                .await
                .unwrap();
        assert_eq!(tables, 0, "{name:?} was touched");
    }
    let migrated: Vec<&str> = body["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["schema"].as_str().unwrap())
        .collect();
    assert!(migrated.contains(&"tenant_ok"), "{body}");
    assert!(
        !migrated.iter().any(|s| s.starts_with("pg_")) && !migrated.contains(&"information_schema"),
        "{body}"
    );
    conn.close().await.ok();
}

/// `jobs` far above a small pool, many schemas: the database never sees more of the pool's
/// connections than its size, and every tenant is migrated.
#[tokio::test]
async fn holds_jobs_above_pool_size_never_exceed_the_pool() {
    let db = TestDb::empty().await;
    let app = format!("atk_run_each_{}", uuid::Uuid::new_v4().simple());
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect_with(db.options.clone().application_name(&app))
        .await
        .unwrap();
    let tenants: Vec<String> = (0..40).map(|i| format!("tenant_{i:03}")).collect();
    let most = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let watch = {
        let admin = db.pool.clone();
        let app = app.clone();
        let most = most.clone();
        tokio::spawn(async move {
            for _ in 0..200_000 {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE application_name = $1",
                )
                .bind(&app)
                .fetch_one(&admin)
                .await
                .unwrap();
                most.fetch_max(n, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let out = Migrator::new().run_each(&pool, &tenants, 64).await.unwrap();
    watch.abort();
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(most > 0, "the watcher saw the pool's connections");
    assert!(most <= 3, "{most} connections");
    assert_eq!(out.len(), tenants.len());
    let failed: Vec<_> = out.iter().filter(|o| o.result.is_err()).collect();
    assert!(failed.is_empty(), "{failed:?}");
    pool.close().await;
}

/// Two `pgbox migrate --tenants` processes at once over the same tenants: both succeed and
/// each migration is recorded once per tenant.
#[tokio::test]
async fn holds_two_cli_migrations_at_once() {
    let db = TestDb::empty().await;
    let mut conn = db.connect().await;
    for i in 0..12 {
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA tnt_{i:02}")))
            .await
            .unwrap();
    }
    let url = db.url();
    let spawn = |url: String| {
        std::thread::spawn(move || {
            pgbox(
                &url,
                &["--json", "--tenants", "tnt\\_%", "migrate", "--jobs", "2"],
            )
        })
    };
    let (a, b) = (spawn(url.clone()), spawn(url));
    for out in [a.join().unwrap(), b.join().unwrap()] {
        assert!(
            out.status.success(),
            "{} / {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let full = Migrator::new()
        .schema("tnt_00")
        .unwrap()
        .applied(&db.pool)
        .await
        .unwrap()
        .len();
    for i in 0..12 {
        let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM tnt_{i:02}.pgbox_migrations"
        )))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(rows as usize, full, "tnt_{i:02}");
    }
    conn.close().await.ok();
}

/// A `pgbox migrate --tenants` process SIGKILLed mid-run (some tenants done, one maybe
/// half-way), then the same command again: it succeeds and every tenant holds every migration
/// exactly once.
#[tokio::test]
async fn holds_sigkilled_cli_migrate_is_finished_by_running_it_again() {
    let db = TestDb::empty().await;
    let mut conn = db.connect().await;
    for i in 0..30 {
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA kil_{i:02}")))
            .await
            .unwrap();
    }
    let args = ["--json", "--tenants", "kil\\_%", "migrate", "--jobs", "2"];
    let mut child = Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", db.url())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait (bounded) until a few tenants have their history, then kill the process.
    let mut started = 0i64;
    for _ in 0..2_000 {
        started = sqlx::query_scalar(
            "SELECT count(*) FROM pg_catalog.pg_tables \
             WHERE schemaname LIKE 'kil\\_%' AND tablename = 'pgbox_migrations'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if started >= 3 || child.try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(started > 0, "the first run never started");
    let again = pgbox(&db.url(), &args);
    assert!(
        again.status.success(),
        "{} / {}",
        String::from_utf8_lossy(&again.stdout),
        String::from_utf8_lossy(&again.stderr)
    );
    let full = Migrator::new()
        .schema("kil_29")
        .unwrap()
        .applied(&db.pool)
        .await
        .unwrap()
        .len();
    assert!(full >= 18, "{full}");
    for i in 0..30 {
        let (rows, distinct): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT version) FROM kil_{i:02}.pgbox_migrations"
        )))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            (rows as usize, distinct as usize),
            (full, full),
            "kil_{i:02}"
        );
    }
    conn.close().await.ok();
}

/// Through PgBouncer in transaction mode, `run` refuses ([`pgbox::Error::SessionRequired`]:
/// its advisory lock needs a session). `run_each` with `jobs` = the pool's size (the
/// documented bound) keeps every connection busy, so each schema's pooler probe finds no
/// second connection, gives up, and the migration goes ahead through the pooler.
#[tokio::test]
async fn finding_run_each_with_jobs_at_pool_size_migrates_through_a_transaction_pooler() {
    use support::cluster::Cluster;
    use support::pooler::PgBouncer;
    let cluster = Cluster::start();
    let bouncer = PgBouncer::start(&cluster, 4);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&bouncer.url("postgres"))
        .await
        .unwrap();
    // Baseline: one schema at a time, the pooler is found and refused.
    let alone = Migrator::new()
        .schema("solo")
        .unwrap()
        .run(&pool)
        .await
        .expect_err("run through a transaction pooler");
    assert!(
        matches!(alone, pgbox::Error::SessionRequired { .. }),
        "{alone:?}"
    );
    let tenants = ["t_a", "t_b", "t_c", "t_d"];
    let out = Migrator::new().run_each(&pool, tenants, 2).await.unwrap();
    let went_ahead: Vec<String> = out
        .iter()
        .filter(|o| !matches!(o.result, Err(pgbox::Error::SessionRequired { .. })))
        .map(|o| {
            format!(
                "{}: {:?}",
                o.schema,
                o.result.as_ref().map(|r| r.applied.len())
            )
        })
        .collect();
    pool.close().await;
    assert!(
        went_ahead.is_empty(),
        "migrated through a transaction-mode pooler: {went_ahead:?}"
    );
}

/// `grant_to` across tenants: the application role gets pgbox's grants on every schema of
/// the list (and a re-run with nothing pending still grants).
#[tokio::test]
async fn holds_grant_to_applies_to_every_tenant() {
    let fx = Fixture::create(&unique("pgbox_atkmig"), 1).await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&fx.url(0, None, None))
        .await
        .unwrap();
    let tenants = ["gr_a", "gr_b", "gr_c"];
    Migrator::new().run_each(&pool, tenants, 2).await.unwrap();
    let out = Migrator::new()
        .grant_to(&fx.role)
        .unwrap()
        .run_each(&pool, tenants, 3)
        .await
        .unwrap();
    assert!(out.iter().all(|o| o.result.is_ok()), "{out:?}");
    for t in tenants {
        let (usage, insert): (bool, bool) = sqlx::query_as(
            "SELECT has_schema_privilege($1, $2, 'USAGE'), \
             has_table_privilege($1, $2 || '.outbox', 'INSERT')",
        )
        .bind(&fx.role)
        .bind(t)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(usage && insert, "{t}: usage {usage}, insert {insert}");
    }
    pool.close().await;
}
