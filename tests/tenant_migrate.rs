//! Migrations across many tenants: `Migrator::run_each` and the CLI's `--tenants` and
//! `--databases` for `migrate`, `status` and `doctor`. A failed tenant does not stop the
//! others; an interrupted run is finished by running it again; a bad name refuses the call
//! before anything is applied.

mod support;

use std::process::{Command, Output};
use std::time::Duration;

use pgbox::{Error, Migrator};
use sqlx::{Connection, Executor, PgConnection};
use support::TestDb;

fn pgbox(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .expect("run pgbox")
}

fn stdout_json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON on stdout ({e}): {:?} / stderr {:?}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

async fn history_len(db: &TestDb, schema: &str) -> usize {
    Migrator::new()
        .schema(schema)
        .unwrap()
        .applied(&db.pool)
        .await
        .unwrap()
        .len()
}

#[tokio::test]
async fn run_each_migrates_every_tenant_and_a_second_run_applies_nothing() {
    let db = TestDb::empty().await;
    let tenants: Vec<String> = (0..24).map(|i| format!("tenant_{i:03}")).collect();
    let first = Migrator::new()
        .run_each(&db.pool, &tenants, 4)
        .await
        .unwrap();
    assert_eq!(first.len(), tenants.len());
    let full = first[0].result.as_ref().unwrap().applied.len();
    assert!(full >= 18, "every migration applied: {full}");
    for (outcome, name) in first.iter().zip(&tenants) {
        assert_eq!(
            &outcome.schema, name,
            "outcomes come back in the order given"
        );
        assert_eq!(outcome.result.as_ref().unwrap().applied.len(), full);
        assert_eq!(history_len(&db, name).await, full);
    }
    let again = Migrator::new()
        .run_each(&db.pool, &tenants, 4)
        .await
        .unwrap();
    assert!(
        again
            .iter()
            .all(|o| o.result.as_ref().unwrap().applied.is_empty()),
        "a second run finds every tenant current"
    );
    // A name given twice is migrated once.
    let twice = Migrator::new()
        .run_each(&db.pool, ["tenant_dup", "tenant_dup"], 2)
        .await
        .unwrap();
    assert_eq!(twice.len(), 1);
}

#[tokio::test]
async fn a_bad_name_refuses_the_whole_call_before_anything_is_applied() {
    let db = TestDb::empty().await;
    for bad in [
        "",
        "Tenant",
        "t;drop",
        "t\0x",
        "pg_catalog",
        &"t".repeat(200),
    ] {
        let err = Migrator::new()
            .run_each(&db.pool, ["good_one", bad], 2)
            .await
            .expect_err(bad);
        assert!(
            matches!(
                err,
                Error::InvalidIdentifier { .. } | Error::InvalidConfig(_)
            ),
            "{bad:?}: {err:?}"
        );
    }
    let created: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'good_one'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(created, 0, "nothing was applied for the good name either");
}

#[tokio::test]
async fn one_broken_tenant_fails_alone_and_the_others_are_migrated() {
    let db = TestDb::empty().await;
    // A schema already holding a table of pgbox's name, of another shape: V1 fails there.
    db.pool
        .execute("CREATE SCHEMA tenant_b; CREATE TABLE tenant_b.inbox (x int)")
        .await
        .unwrap();
    let out = Migrator::new()
        .run_each(&db.pool, ["tenant_a", "tenant_b", "tenant_c"], 2)
        .await
        .unwrap();
    assert!(out[0].result.is_ok(), "{:?}", out[0].result);
    assert!(out[1].result.is_err(), "the broken tenant's own error");
    assert!(out[2].result.is_ok(), "{:?}", out[2].result);
    assert_eq!(history_len(&db, "tenant_b").await, 0, "its V1 rolled back");
    assert!(history_len(&db, "tenant_c").await > 0);
}

#[tokio::test]
async fn an_interrupted_run_is_finished_by_running_it_again() {
    let db = TestDb::empty().await;
    let tenants: Vec<String> = (0..60).map(|i| format!("resume_{i:03}")).collect();
    let full = Migrator::new()
        .schema("resume_probe")
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap()
        .applied
        .len();
    // Cut the run off once a few tenants are complete: the task is aborted mid-flight (as a
    // killed deploy job's would be), whatever migration it is in.
    let run = {
        let (pool, tenants) = (db.pool.clone(), tenants.clone());
        tokio::spawn(async move { Migrator::new().run_each(&pool, &tenants, 1).await })
    };
    let mut complete_before = Vec::new();
    for _ in 0..3_000 {
        complete_before.clear();
        for t in &tenants {
            if history_len(&db, t).await == full {
                complete_before.push(t.clone());
            }
        }
        if complete_before.len() >= 3 || run.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    run.abort();
    let _ = run.await;
    assert!(
        complete_before.len() >= 3,
        "the run made progress before the cut"
    );
    let mut complete_at_cut = 0;
    for t in &tenants {
        if history_len(&db, t).await == full {
            complete_at_cut += 1;
        }
    }
    assert!(
        complete_at_cut < tenants.len(),
        "the cut left tenants for the re-run"
    );
    let out = Migrator::new()
        .run_each(&db.pool, &tenants, 2)
        .await
        .unwrap();
    for t in &tenants {
        assert_eq!(
            history_len(&db, t).await,
            full,
            "{t} complete after the re-run"
        );
    }
    for o in &out {
        if complete_before.contains(&o.schema) {
            assert!(
                o.result.as_ref().unwrap().applied.is_empty(),
                "{} was complete before the cut and is not migrated again",
                o.schema
            );
        }
    }
}

/// Two databases made for this test (the pattern must select them and nothing else).
struct Databases {
    server: String,
    names: Vec<String>,
}

impl Databases {
    async fn create(prefix: &str, n: usize) -> Databases {
        let server = support::server_url().await;
        let mut admin = PgConnection::connect(&server).await.unwrap();
        let names: Vec<String> = (0..n).map(|i| format!("{prefix}_{i}")).collect();
        for name in &names {
            admin
                .execute(sqlx::AssertSqlSafe(format!(
                    "CREATE DATABASE \"{name}\" TEMPLATE template0"
                )))
                .await
                .unwrap();
        }
        admin.close().await.ok();
        Databases { server, names }
    }

    fn url(&self, i: usize) -> String {
        let mut url = url::Url::parse(&self.server).unwrap();
        url.set_path(&self.names[i]);
        url.to_string()
    }
}

impl Drop for Databases {
    fn drop(&mut self) {
        let server = self.server.clone();
        let names = self.names.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&server).await {
                    for name in names {
                        let _ = admin
                            .execute(sqlx::AssertSqlSafe(format!(
                                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                            )))
                            .await;
                    }
                }
            });
        })
        .join();
    }
}

#[tokio::test]
async fn the_cli_migrates_checks_and_reports_every_tenant_of_every_database() {
    let prefix = format!(
        "pgbox_tmig_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let dbs = Databases::create(&prefix, 2).await;
    // Tenant schemas exist (empty, as a sign-up would create them) before the migration.
    for i in 0..2 {
        let mut conn = PgConnection::connect(&dbs.url(i)).await.unwrap();
        conn.execute("CREATE SCHEMA acme_t1; CREATE SCHEMA acme_t2; CREATE SCHEMA other")
            .await
            .unwrap();
        conn.close().await.ok();
    }
    let pattern = format!("{prefix}\\_%");
    let args = [
        "--json",
        "--databases",
        &pattern,
        "--tenants",
        "acme\\_%",
        "migrate",
        "--jobs",
        "2",
    ];
    let out = pgbox(&dbs.url(0), &args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = stdout_json(&out);
    assert_eq!(report["migrated"], 4, "{report}");
    assert_eq!(report["failed"], 0);
    let tenants = report["tenants"].as_array().unwrap();
    let mut seen: Vec<String> = tenants
        .iter()
        .map(|t| {
            format!(
                "{}/{}",
                t["database"].as_str().unwrap(),
                t["schema"].as_str().unwrap()
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            format!("{prefix}_0/acme_t1"),
            format!("{prefix}_0/acme_t2"),
            format!("{prefix}_1/acme_t1"),
            format!("{prefix}_1/acme_t2"),
        ],
        "the schema `other` is not a tenant"
    );
    // Again: nothing to do, and it says so.
    let again = stdout_json(&pgbox(&dbs.url(0), &args));
    assert_eq!(again["up_to_date"], 4, "{again}");

    // A tenant broken by hand: its status fails alone, exit 1 names it.
    let mut conn = PgConnection::connect(&dbs.url(1)).await.unwrap();
    conn.execute("DROP TABLE acme_t2.outbox CASCADE")
        .await
        .unwrap();
    conn.close().await.ok();
    let status = pgbox(
        &dbs.url(0),
        &[
            "--json",
            "--databases",
            &pattern,
            "--tenants",
            "acme\\_%",
            "status",
        ],
    );
    assert_eq!(
        status.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let body = stdout_json(&status);
    assert_eq!(body["failed"], 1, "{body}");
    let ok = body["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["ok"] == true)
        .count();
    assert_eq!(ok, 3, "the other tenants are still reported: {body}");

    // The doctor across tenants: the broken one makes the exit status non-zero, every tenant
    // has its report.
    let doctor = pgbox(
        &dbs.url(0),
        &[
            "--json",
            "--databases",
            &pattern,
            "--tenants",
            "acme\\_%",
            "doctor",
        ],
    );
    assert_ne!(doctor.status.code(), Some(0));
    let body = stdout_json(&doctor);
    assert_eq!(body["tenants"].as_array().unwrap().len(), 4, "{body}");

    // Plain text: one line per tenant, then a summary.
    let text = pgbox(
        &dbs.url(0),
        &["--databases", &pattern, "--tenants", "acme\\_%", "migrate"],
    );
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("4 tenant schema(s) in 2 database(s)"),
        "{text}"
    );
}

#[tokio::test]
async fn the_cli_refuses_tenant_flags_where_they_do_not_apply() {
    let db = TestDb::migrated().await;
    let out = pgbox(&db.url(), &["--tenants", "x%", "dead-letters", "list"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = pgbox(&db.url(), &["--tenants", "x%", "migrate", "--jobs", "0"]);
    assert_eq!(out.status.code(), Some(2));
}
