//! A schema installed from the exported SQL (`pgbox migrate --print-sql`,
//! `Migrator::to_sql()`) is a pgbox schema like one `pgbox migrate` built: the CLI accepts
//! it, and `migrate` afterwards finds nothing to do.

mod support;

use std::process::{Command, Output};

use pgbox::{AppliedMigration, Migrator};
use sqlx::{AssertSqlSafe, Connection, PgConnection};
use support::TestDb;

fn pgbox_cli(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgbox"));
    cmd.args(args).env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("run pgbox")
}

fn ok(o: &Output, what: &str) -> String {
    assert_eq!(
        o.status.code(),
        Some(0),
        "{what}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output, what: &str) -> serde_json::Value {
    let text = ok(o, what);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"))
}

/// Applies a script the way a team's own tool or `psql -f` would: one plain connection,
/// simple-query protocol, no pgbox code involved.
async fn apply_plain(db: &TestDb, script: &str) {
    let mut conn = PgConnection::connect_with(&db.options).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(script.to_owned()))
        .execute(&mut conn)
        .await
        .expect("the exported script applies");
    conn.close().await.unwrap();
}

/// (version, name, checksum) of a schema's history, as refinery reads it.
async fn history(db: &TestDb, schema: &str) -> Vec<(i32, String, String)> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT version, name, checksum FROM \"{schema}\".pgbox_migrations ORDER BY version"
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Every migration pgbox has, from a schema that `migrate` built.
async fn all_migrations(db: &TestDb) -> Vec<AppliedMigration> {
    let reference = Migrator::new().schema("reference").unwrap();
    let report = reference.run(&db.pool).await.unwrap();
    assert!(!report.applied.is_empty());
    report.applied
}

fn cli_accepts_the_schema(url: &str, schema: &str) {
    let status = json(
        &pgbox_cli(Some(url), &["status", "--schema", schema, "--json"]),
        "status",
    );
    assert_eq!(status["schema"], schema);
    let dead = json(
        &pgbox_cli(
            Some(url),
            &["dead-letters", "list", "--schema", schema, "--json"],
        ),
        "dead-letters list",
    );
    assert_eq!(dead, serde_json::json!([]));
    let purged = json(
        &pgbox_cli(
            Some(url),
            &["purge", "--older-than", "7d", "--schema", schema, "--json"],
        ),
        "purge",
    );
    assert_eq!(purged["total"], 0);
}

#[tokio::test]
async fn cli_accepts_a_schema_installed_from_print_sql_and_migrate_then_is_a_no_op() {
    let db = TestDb::empty().await;
    let url = db.url();
    let all = all_migrations(&db).await;

    // The operator's route: print the SQL, hand it to another tool.
    let script = ok(
        &pgbox_cli(None, &["migrate", "--print-sql"]),
        "migrate --print-sql",
    );
    apply_plain(&db, &script).await;

    cli_accepts_the_schema(&url, "pgbox");

    // migrate afterwards: nothing to apply, twice; the process and the library agree.
    let first = json(&pgbox_cli(Some(&url), &["migrate", "--json"]), "migrate");
    assert_eq!(first["applied"], serde_json::json!([]), "{first}");
    let second = ok(&pgbox_cli(Some(&url), &["migrate"]), "second migrate");
    assert!(second.contains("up to date"), "{second}");
    assert!(pgbox::migrate(&db.pool).await.unwrap().applied.is_empty());
    assert_eq!(Migrator::new().applied(&db.pool).await.unwrap(), all);
    // The history says what refinery would have written: same versions, names, checksums.
    assert_eq!(history(&db, "pgbox").await, history(&db, "reference").await);

    // And the schema works: an inbox claim against it.
    let inbox = pgbox::Inbox::new("c").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    assert!(matches!(
        inbox.claim(&mut tx, "k").await.unwrap(),
        pgbox::Claim::Claimed(_)
    ));
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn library_to_sql_installs_a_schema_that_migrate_and_the_cli_recognize() {
    let db = TestDb::empty().await;
    let url = db.url();
    let all = all_migrations(&db).await;

    let byhand = Migrator::new().schema("byhand").unwrap();
    apply_plain(&db, &byhand.to_sql()).await;

    cli_accepts_the_schema(&url, "byhand");
    assert_eq!(byhand.applied(&db.pool).await.unwrap(), all);
    assert_eq!(
        history(&db, "byhand").await,
        history(&db, "reference").await
    );

    assert!(byhand.run(&db.pool).await.unwrap().applied.is_empty());
    let cli = json(
        &pgbox_cli(Some(&url), &["migrate", "--schema", "byhand", "--json"]),
        "migrate",
    );
    assert_eq!(cli["applied"], serde_json::json!([]), "{cli}");
    assert!(byhand.run(&db.pool).await.unwrap().applied.is_empty());
    assert_eq!(byhand.applied(&db.pool).await.unwrap(), all);
}
