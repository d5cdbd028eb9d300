//! Migrations: concurrent start-up, idempotence, and where the history lives.

mod support;

use pgbox::{Error, Migrator};
use support::TestDb;

#[tokio::test]
async fn five_concurrent_migrators_on_a_fresh_database_all_succeed() {
    let db = TestDb::empty().await;
    let mut tasks = Vec::new();
    for _ in 0..5 {
        // Separate pools, as five service instances would have.
        let options = db.options.clone();
        tasks.push(tokio::spawn(async move {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect_with(options)
                .await
                .unwrap();
            pgbox::migrate(&pool).await
        }));
    }
    let mut applied = Vec::new();
    for t in tasks {
        let report = t
            .await
            .unwrap()
            .expect("every concurrent migrator succeeds");
        applied.push(report.applied.len());
    }
    let total = Migrator::new().applied(&db.pool).await.unwrap().len();
    assert!(total >= 1);
    applied.sort();
    // Exactly one instance applied everything; the others found nothing to do.
    assert_eq!(applied, vec![0, 0, 0, 0, total], "{applied:?}");

    // A second run is a no-op.
    let again = pgbox::migrate(&db.pool).await.unwrap();
    assert!(again.applied.is_empty());
}

#[tokio::test]
async fn history_lives_in_the_pgbox_schema_not_next_to_the_applications() {
    let db = TestDb::empty().await;
    pgbox::migrate(&db.pool).await.unwrap();
    let tables: Vec<(String, String)> = sqlx::query_as(
        "SELECT schemaname::text, tablename::text FROM pg_tables \
         WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(tables.contains(&("pgbox".into(), "pgbox_migrations".into())));
    assert!(tables.contains(&("pgbox".into(), "inbox".into())));
    assert!(
        tables.iter().all(|(schema, _)| schema == "pgbox"),
        "pgbox created tables outside its schema: {tables:?}"
    );
}

#[tokio::test]
async fn two_schemas_in_one_database_are_independent() {
    let db = TestDb::empty().await;
    let a = Migrator::new().schema("svc_a").unwrap();
    let b = Migrator::new().schema("svc_b").unwrap();
    let (ra, rb) = tokio::join!(a.run(&db.pool), b.run(&db.pool));
    assert!(!ra.unwrap().applied.is_empty());
    assert!(!rb.unwrap().applied.is_empty());
    assert_eq!(
        a.applied(&db.pool).await.unwrap(),
        b.applied(&db.pool).await.unwrap()
    );
}

#[tokio::test]
async fn plain_sql_script_builds_the_same_schema() {
    let db = TestDb::empty().await;
    let script = Migrator::new().schema("byhand").unwrap().to_sql();
    sqlx::raw_sql(sqlx::AssertSqlSafe(script))
        .execute(&db.pool)
        .await
        .unwrap();
    // The inbox works against the hand-migrated schema, including the bounded claim.
    let inbox = pgbox::Inbox::builder("c")
        .schema("byhand")
        .wait(pgbox::Wait::NoWait)
        .build()
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    assert!(matches!(
        inbox.claim(&mut tx, "k").await.unwrap(),
        pgbox::Claim::Claimed(_)
    ));
    tx.commit().await.unwrap();
    // search_path was only changed for the script's own transaction.
    let path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!path.contains("byhand"), "{path}");
}

#[tokio::test]
async fn an_edited_migration_is_refused() {
    let db = TestDb::empty().await;
    pgbox::migrate(&db.pool).await.unwrap();
    sqlx::query("UPDATE pgbox.pgbox_migrations SET checksum = '1' WHERE version = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = pgbox::migrate(&db.pool).await.unwrap_err();
    assert!(matches!(err, Error::Migration(_)), "{err}");
    // The failed run released its advisory lock: another run does not hang.
    let again = tokio::time::timeout(std::time::Duration::from_secs(10), pgbox::migrate(&db.pool))
        .await
        .expect("the advisory lock was left held");
    assert!(again.is_err());
}

#[tokio::test]
async fn migrating_an_unreachable_server_is_a_connection_error() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/postgres")
        .unwrap();
    let err = pgbox::migrate(&pool).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
}

#[tokio::test]
async fn a_cancelled_migration_never_leaves_the_advisory_lock_held() {
    let db = TestDb::empty().await;
    // Cancel runs at many points, some of them while the lock is held.
    for i in 0..80u64 {
        let _ = tokio::time::timeout(
            std::time::Duration::from_micros(i * 250),
            pgbox::migrate(&db.pool),
        )
        .await;
    }
    // Closed sessions end asynchronously on the server; give them a moment.
    let mut held: i64 = -1;
    for _ in 0..100 {
        held = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database \
             WHERE l.locktype = 'advisory' AND d.datname = current_database()",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if held == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        held, 0,
        "a cancelled migrate left its advisory lock on a pooled connection"
    );
    tokio::time::timeout(std::time::Duration::from_secs(10), pgbox::migrate(&db.pool))
        .await
        .expect("migrate blocked on a leaked lock")
        .unwrap();
}
