//! What a newcomer meets in the first hour: errors that say what to do.
//!
//! Forgetting `pgbox::migrate`, or running a newer pgbox against a schema an older one
//! migrated, fails on pgbox's own missing objects; every such error keeps its SQLSTATE and
//! kind and says to run the migrations.

mod support;

use std::time::Duration;

use pgbox::transport::PgQueue;
use pgbox::{DbErrorKind, Error, Inbox, Message, Outbox, Relay};
use support::TestDb;

/// The error says to migrate, in the three ways there are.
fn assert_says_migrate(what: &str, e: &Error) {
    let text = e.to_string();
    eprintln!("{what}: {text}");
    for wanted in ["pgbox::migrate(&pool)", "Migrator", "pgbox migrate"] {
        assert!(
            text.contains(wanted),
            "{what}: {wanted:?} missing in: {text}"
        );
    }
}

#[tokio::test]
async fn every_first_call_on_an_unmigrated_database_says_to_migrate() {
    let db = TestDb::empty().await;

    // The inbox.
    let inbox = Inbox::new("first-hour").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let e = inbox
        .process(&mut tx, "k1", async |_conn| Ok::<_, Error>(()))
        .await
        .expect_err("no inbox table");
    drop(tx);
    assert_says_migrate("inbox.process", &e);
    // Nothing lost: the kind and the SQLSTATE are still there.
    assert_eq!(e.db_kind(), Some(DbErrorKind::MissingSchema), "{e}");
    assert_eq!(e.sqlstate().as_deref(), Some("42P01"), "{e}");

    // The outbox.
    let mut tx = db.pool.begin().await.unwrap();
    let e = Outbox::new()
        .enqueue(&mut tx, Message::bytes("orders", "o1"))
        .await
        .expect_err("no outbox table");
    drop(tx);
    assert_says_migrate("outbox.enqueue", &e);
    assert_eq!(e.db_kind(), Some(DbErrorKind::MissingSchema), "{e}");

    // A relay round.
    let relay = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .build()
        .unwrap();
    let e = relay.relay_once().await.expect_err("no outbox table");
    assert_says_migrate("relay.relay_once", &e);

    // The consumer's source: the built-in queue.
    let e = PgQueue::new(db.pool.clone())
        .receive("orders", 1, Duration::from_secs(30))
        .await
        .expect_err("no queue");
    assert_says_migrate("queue.receive", &e);

    // Another schema than the default: the same.
    let e = Outbox::with_schema("billing")
        .unwrap()
        .enqueue(
            &mut db.pool.begin().await.unwrap(),
            Message::bytes("orders", "o1"),
        )
        .await
        .expect_err("no schema billing");
    assert_says_migrate("outbox in schema billing", &e);
}

#[tokio::test]
async fn a_schema_missing_a_newer_migration_says_to_migrate() {
    let db = TestDb::migrated().await;
    // As if an older pgbox had migrated it: V14's function is not there yet.
    sqlx::raw_sql(
        "DROP FUNCTION pgbox.queue_receive; DELETE FROM pgbox.pgbox_migrations WHERE version >= 14",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let e = PgQueue::new(db.pool.clone())
        .receive("orders", 1, Duration::from_secs(30))
        .await
        .expect_err("no queue_receive function");
    assert_says_migrate("queue.receive on an older schema", &e);
    assert_eq!(e.sqlstate().as_deref(), Some("42883"), "{e}");

    // The migrations bring it back.
    pgbox::migrate(&db.pool).await.unwrap();
    PgQueue::new(db.pool.clone())
        .receive("orders", 1, Duration::from_secs(30))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_missing_table_of_the_application_is_not_blamed_on_pgbox() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("first-hour").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let e = inbox
        .process(&mut tx, "k1", async |conn| {
            sqlx::query("INSERT INTO app_orders VALUES (1)")
                .execute(&mut *conn)
                .await?;
            Ok::<_, Error>(())
        })
        .await
        .expect_err("no table app_orders");
    assert_eq!(e.db_kind(), Some(DbErrorKind::MissingSchema), "{e}");
    assert!(!e.to_string().contains("pgbox migrate"), "{e}");
}
