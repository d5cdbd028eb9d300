//! The archive of delivered messages (table relay): what lands in it, when, exactly once;
//! its partitions (created ahead, a default partition that never refuses an insert and is
//! emptied, expiry by dropping whole partitions, never the current one).

mod support;

use std::sync::{Arc, Mutex};

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{Archive, ArchiveRetention, Envelope, Error, Message, Outbox, Relay};
use sqlx::{PgPool, Row};
use support::TestDb;

/// Confirms everything and remembers what it was given.
#[derive(Clone, Default)]
struct Recording(Arc<Mutex<Vec<Envelope>>>);

impl Publisher for Recording {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.lock().unwrap().extend_from_slice(batch);
        batch.iter().map(|_| Ok(())).collect()
    }
}

async fn enqueue(pool: &PgPool, n: usize) -> Vec<uuid::Uuid> {
    let outbox = Outbox::new();
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let mut m = Message::bytes("orders", format!("p{i}").into_bytes())
            .content_type("text/plain")
            .header("type", if i % 2 == 0 { "even" } else { "odd" })
            .header("x-n", i.to_string());
        if i % 3 != 0 {
            m = m.ordering_key(format!("key-{}", i % 4));
        }
        ids.push(outbox.enqueue(&mut tx, m).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

type Row8 = (
    uuid::Uuid,
    String,
    Option<String>,
    Vec<u8>,
    String,
    serde_json::Value,
    time::OffsetDateTime,
);

async fn table(pool: &PgPool, table: &str, order: &str) -> Vec<Row8> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT message_id, topic, ordering_key, payload, content_type, headers, created_at \
         FROM pgbox.{table} ORDER BY {order}"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| {
        (
            r.get(0),
            r.get(1),
            r.get(2),
            r.get(3),
            r.get(4),
            r.get(5),
            r.get(6),
        )
    })
    .collect()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn archive_on_moves_published_messages_with_id_topic_key_payload_headers() {
    let db = TestDb::migrated().await;
    let ids = enqueue(&db.pool, 40).await;
    let before = table(&db.pool, "outbox", "seq").await;
    let publisher = Recording::default();
    let relay = Relay::builder(db.pool.clone(), publisher.clone())
        .batch_size(16)
        .archive(ArchiveRetention::days(7))
        .build()
        .unwrap();
    assert_eq!(relay.drain().await.unwrap().published, 40);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        0
    );
    let archived = table(&db.pool, "outbox_archive", "seq").await;
    assert_eq!(archived, before, "every column kept, in publication order");
    assert_eq!(
        archived.iter().map(|r| r.0).collect::<Vec<_>>(),
        ids,
        "archive order is seq order"
    );
    // The relay recorded the retention and created partitions ahead; nothing in the default.
    let status = Archive::new(db.pool.clone()).status().await.unwrap();
    assert_eq!(status.retention, Some(ArchiveRetention::days(7)));
    assert!(status.partitions.len() >= 4, "{:?}", status.partitions);
    assert_eq!(status.default_rows, 0);
    let now = time::OffsetDateTime::now_utc();
    assert!(
        status
            .partitions
            .iter()
            .any(|p| p.from <= now && now < p.to)
    );
}

#[tokio::test]
async fn archive_off_archives_nothing_and_never_touches_the_archive() {
    let db = TestDb::migrated().await;
    enqueue(&db.pool, 10).await;
    let relay = Relay::builder(db.pool.clone(), Recording::default())
        .build()
        .unwrap();
    assert_eq!(relay.drain().await.unwrap().published, 10);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox_archive").await,
        0
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pgbox.outbox_archive_settings"
        )
        .await,
        0
    );
    // No statement of the relay names the archive: no partition created either.
    assert!(
        Archive::new(db.pool.clone())
            .partitions()
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn archive_and_keep_published_are_refused_together() {
    let db = TestDb::migrated().await;
    let refused = Relay::builder(db.pool.clone(), Recording::default())
        .keep_published(true)
        .archive(ArchiveRetention::days(1))
        .build();
    assert!(matches!(refused, Err(Error::InvalidConfig(_))));
    let bad = Relay::builder(db.pool.clone(), Recording::default())
        .archive(ArchiveRetention::days(0))
        .build();
    assert!(matches!(bad, Err(Error::InvalidConfig(_))));
}

#[tokio::test]
async fn local_move_into_the_queue_archives_from_the_same_delete() {
    let db = TestDb::migrated().await;
    enqueue(&db.pool, 30).await;
    let before = table(&db.pool, "outbox", "seq").await;
    let relay = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .batch_size(7)
        .archive(ArchiveRetention::hours(6))
        .build()
        .unwrap();
    assert_eq!(relay.drain().await.unwrap().published, 30);
    assert_eq!(table(&db.pool, "queue", "seq").await, before);
    assert_eq!(table(&db.pool, "outbox_archive", "seq").await, before);
}

#[cfg(feature = "testing")]
#[tokio::test]
async fn a_round_dying_after_publish_archives_nothing_and_the_retry_archives_once() {
    use pgbox::testing::{FaultPoint, FaultPoints};
    let db = TestDb::migrated().await;
    let ids = enqueue(&db.pool, 12).await;
    let publisher = Recording::default();
    let relay = Relay::builder(db.pool.clone(), publisher.clone())
        .archive(ArchiveRetention::days(1))
        .build()
        .unwrap();
    let faults = FaultPoints::new();
    faults.arm(FaultPoint::RelayAfterPublishBeforeMark, 1);
    assert!(faults.scope(relay.relay_once()).await.is_err());
    assert_eq!(publisher.0.lock().unwrap().len(), 12, "published once");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox_archive").await,
        0,
        "the settle rolled back: nothing archived"
    );
    relay.drain().await.unwrap();
    assert_eq!(publisher.0.lock().unwrap().len(), 24, "published again");
    let archived: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT message_id FROM pgbox.outbox_archive ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(archived, ids, "archived exactly once each");
}

#[tokio::test]
async fn an_insert_with_no_partition_lands_in_the_default_and_is_moved_out() {
    let db = TestDb::migrated().await;
    // No settings, no partitions: the first archived message has no range partition.
    assert!(
        Archive::new(db.pool.clone())
            .partitions()
            .await
            .unwrap()
            .is_empty()
    );
    sqlx::query(
        "INSERT INTO pgbox.outbox_archive (message_id, topic, payload, content_type, headers, created_at, archived_at) \
         SELECT gen_random_uuid(), 't', '\\x00', 'x', '{}', now(), t \
         FROM unnest(ARRAY[now(), now() + interval '40 days', now() + interval '40 days 1 hour', \
                           '2026-01-01 00:00:00+00'::timestamptz]) AS t",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let archive = Archive::new(db.pool.clone());
    assert_eq!(archive.status().await.unwrap().default_rows, 4);
    let created = archive.create_ahead().await.unwrap();
    assert!(created.len() >= 5, "{created:?}");
    let status = archive.status().await.unwrap();
    assert_eq!(status.default_rows, 0, "moved out of the default");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox_archive").await,
        4,
        "none lost"
    );
    // Partitions never overlap (ATTACH would have refused), and a later call creates none.
    assert!(archive.create_ahead().await.unwrap().is_empty());
}

#[tokio::test]
async fn expiry_drops_exactly_the_expired_partitions_and_never_the_current_one() {
    let db = TestDb::migrated().await;
    let archive = Archive::new(db.pool.clone());
    archive
        .configure(ArchiveRetention::days(2).ahead(2))
        .await
        .unwrap();
    // Partitions for the last five days (as the owner: the test's role), each with a row.
    sqlx::query("SELECT pgbox.outbox_archive_partitions_create(now() - interval '5 days')")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO pgbox.outbox_archive (message_id, topic, payload, content_type, headers, created_at, archived_at) \
         SELECT gen_random_uuid(), 't', '\\x00', 'x', '{}', now(), now() - d * interval '1 day' \
         FROM generate_series(0, 5) AS d",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    archive.create_ahead().await.unwrap();
    let before = archive.partitions().await.unwrap();
    let cutoff: time::OffsetDateTime = sqlx::query_scalar("SELECT now() - interval '2 days'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let expected: Vec<String> = before
        .iter()
        .filter(|p| p.to <= cutoff)
        .map(|p| p.name.clone())
        .collect();
    assert!(expected.len() >= 3, "{before:?}");
    let dropped = archive.drop_expired().await.unwrap();
    assert_eq!(dropped, expected);
    let after = archive.partitions().await.unwrap();
    let now = time::OffsetDateTime::now_utc();
    assert!(
        after.iter().any(|p| p.from <= now && now < p.to),
        "current kept"
    );
    assert_eq!(after.len(), before.len() - expected.len());
    // Every row younger than the retention is still there.
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pgbox.outbox_archive WHERE archived_at > now() - interval '2 days'"
        )
        .await,
        2
    );
    assert!(archive.drop_expired().await.unwrap().is_empty());
}

#[tokio::test]
async fn the_janitor_keeps_archive_partitions_ahead_and_drops_expired_ones() {
    let db = TestDb::migrated().await;
    let archive = Archive::new(db.pool.clone());
    archive.configure(ArchiveRetention::days(1)).await.unwrap();
    sqlx::query("SELECT pgbox.outbox_archive_partitions_create(now() - interval '4 days')")
        .execute(&db.pool)
        .await
        .unwrap();
    let janitor = pgbox::janitor::Janitor::builder(db.pool.clone())
        .build()
        .unwrap();
    let report = janitor.run_once().await.unwrap();
    assert!(
        report.archive_partitions_dropped.len() >= 2,
        "{:?}",
        report.archive_partitions_dropped
    );
    let now = time::OffsetDateTime::now_utc();
    let left = archive.partitions().await.unwrap();
    assert!(left.iter().any(|p| p.from <= now && now < p.to));
    assert!(left.iter().all(|p| p.to > now - time::Duration::days(1)));
}
