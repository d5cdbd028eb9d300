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
    // As if an older pgbox had migrated it: V14's function is not there yet, nor what the
    // later migrations create (V16's scheduled messages, V17's archive, V18's fan-out,
    // V19's rate limits, V20's hand-backs).
    sqlx::raw_sql(
        "DROP FUNCTION pgbox.queue_receive; \
         DROP TABLE pgbox.outbox_scheduled, pgbox.outbox_archive, pgbox.outbox_archive_settings CASCADE; \
         DROP TABLE pgbox.outbox_fanout_deliveries, pgbox.outbox_fanout_messages; \
         DROP TABLE pgbox.rate_limits, pgbox.hand_backs; \
         DROP SEQUENCE IF EXISTS pgbox.outbox_archive_seq; \
         DROP FUNCTION pgbox.outbox_archive_configure, pgbox.outbox_archive_create_ahead, \
           pgbox.outbox_archive_drop_expired, pgbox.outbox_archive_partitions_create, \
           pgbox.outbox_archive_partition_add, pgbox.outbox_archive_partitions; \
         DELETE FROM pgbox.pgbox_migrations WHERE version >= 14",
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

/// The log lines of this test binary, as a subscriber that shows INFO prints them
/// (with `log` records, refinery's and sqlx's, bridged in as most applications have them).
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn migrating_logs_one_info_line_per_call_and_no_notices() {
    use tracing_subscriber::util::SubscriberInitExt;
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish()
        .try_init()
        .expect("the only subscriber of this test binary");
    let db = TestDb::empty().await;
    let migrator = pgbox::Migrator::new().schema("first_hour_logs").unwrap();
    let first = migrator.run(&db.pool).await.unwrap();
    assert!(!first.applied.is_empty());
    let again = migrator.run(&db.pool).await.unwrap();
    assert!(again.applied.is_empty());

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let ours: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("first_hour_logs"))
        .collect();
    assert_eq!(ours.len(), 2, "one line per call:\n{text}");
    assert!(ours[0].contains("pgbox schema migrated"), "{text}");
    assert!(ours[1].contains("pgbox schema already current"), "{text}");
    for noise in [
        "applying migration",
        "current version",
        "no migrations to apply",
        "already exists, skipping",
    ] {
        assert!(!text.contains(noise), "{noise:?} logged:\n{text}");
    }
}
