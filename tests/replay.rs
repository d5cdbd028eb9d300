//! Replay of archived messages: filters select exactly the right messages; ids kept make
//! the consumers' inboxes answer Duplicate, fresh ids are processed again; per-key order
//! kept end to end; WAL duplicates replayed once; pacing; resumable; bad input typed.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    Archive, ArchiveRetention, Envelope, Error, Inbox, Message, Outbox, Outcome, REPLAY_ID_HEADER,
    Relay, ReplayCursor,
};
use sqlx::PgPool;
use support::TestDb;

#[derive(Clone, Default)]
struct Recording(Arc<Mutex<Vec<Envelope>>>);

impl Publisher for Recording {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.lock().unwrap().extend_from_slice(batch);
        batch.iter().map(|_| Ok(())).collect()
    }
}

impl Recording {
    fn take(&self) -> Vec<Envelope> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// Writes archive rows directly: `(topic, key, type, archived days ago)`; returns their ids
/// in archive order.
async fn archive_rows(pool: &PgPool, rows: &[(&str, Option<&str>, &str, i32)]) -> Vec<uuid::Uuid> {
    let mut ids = Vec::new();
    for (topic, key, kind, days) in rows {
        let id: uuid::Uuid = sqlx::query_scalar(
            "INSERT INTO pgbox.outbox_archive (source_seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, archived_at) \
             VALUES (0, gen_random_uuid(), $1, $2, '\\x01', 'x', jsonb_build_object('type', $3::text), now(), now() - $4 * interval '1 day') \
             RETURNING message_id",
        )
        .bind(topic)
        .bind(key)
        .bind(kind)
        .bind(days)
        .fetch_one(pool)
        .await
        .unwrap();
        ids.push(id);
    }
    ids
}

async fn outbox_ids(pool: &PgPool) -> Vec<uuid::Uuid> {
    sqlx::query_scalar("SELECT message_id FROM pgbox.outbox ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn clear_outbox(pool: &PgPool) {
    sqlx::query("DELETE FROM pgbox.outbox")
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn filters_select_exactly_the_right_messages() {
    let db = TestDb::migrated().await;
    let ids = archive_rows(
        &db.pool,
        &[
            ("orders", Some("a"), "created", 3),   // 0
            ("orders", Some("b"), "paid", 2),      // 1
            ("orders", None, "created", 1),        // 2
            ("invoices", Some("a"), "created", 1), // 3
            ("orders", Some("a"), "paid", 0),      // 4
        ],
    )
    .await;
    let archive = Archive::new(db.pool.clone());
    let now = time::OffsetDateTime::now_utc();
    let day = time::Duration::days(1);
    let cases: Vec<(pgbox::Replay, Vec<usize>)> = vec![
        (archive.replay(), vec![0, 1, 2, 3, 4]),
        (archive.replay().topic("orders"), vec![0, 1, 2, 4]),
        (archive.replay().ordering_key("a"), vec![0, 3, 4]),
        (
            archive.replay().topic("orders").ordering_key("a"),
            vec![0, 4],
        ),
        (archive.replay().message_type("paid"), vec![1, 4]),
        (
            archive
                .replay()
                .since(now - day * 2 - time::Duration::hours(1)),
            vec![1, 2, 3, 4],
        ),
        (
            archive
                .replay()
                .until(now - day * 2 + time::Duration::hours(1)),
            vec![0, 1],
        ),
        (
            archive
                .replay()
                .topic("orders")
                .since(now - day * 2 + time::Duration::hours(1))
                .until(now - time::Duration::hours(1)),
            vec![2],
        ),
        (
            archive.replay().type_header("x-none").message_type("paid"),
            vec![],
        ),
    ];
    for (replay, expected) in cases {
        clear_outbox(&db.pool).await;
        let expected: Vec<uuid::Uuid> = expected.iter().map(|&i| ids[i]).collect();
        assert_eq!(
            replay.count().await.unwrap(),
            expected.len() as u64,
            "{replay:?}"
        );
        let report = replay.run().await.unwrap();
        assert!(report.complete);
        assert_eq!(report.replayed, expected.len() as u64);
        assert_eq!(outbox_ids(&db.pool).await, expected, "{replay:?}");
    }
}

/// Processes each envelope in the consumer's inbox, keyed by message id; returns how many
/// were processed (the rest were duplicates).
async fn consume(pool: &PgPool, inbox: &Inbox, batch: &[Envelope]) -> usize {
    let mut processed = 0;
    for e in batch {
        let mut tx = pool.begin().await.unwrap();
        let outcome = inbox
            .process(&mut tx, e.id.to_string(), async |_| Ok::<_, Error>(()))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        if matches!(outcome, Outcome::Processed(())) {
            processed += 1;
        }
    }
    processed
}

#[tokio::test]
async fn kept_ids_are_duplicates_to_the_inbox_and_new_ids_are_processed_again() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..10 {
        let m = Message::bytes("orders", vec![i]).ordering_key(format!("k{}", i % 3));
        outbox.enqueue(&mut tx, m).await.unwrap();
    }
    tx.commit().await.unwrap();
    let publisher = Recording::default();
    let relay = Relay::builder(db.pool.clone(), publisher.clone())
        .archive(ArchiveRetention::days(1))
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    let inbox = Inbox::new("billing").unwrap();
    let first = publisher.take();
    assert_eq!(consume(&db.pool, &inbox, &first).await, 10);

    let archive = Archive::new(db.pool.clone());
    // A replay only reads up to the archive's end at its start: the messages it republishes
    // are archived again, and the next replay (same filter) sees two copies of each.
    let report = archive.replay().topic("orders").run().await.unwrap();
    assert_eq!(report.replayed, 10);
    relay.drain().await.unwrap();
    let replayed = publisher.take();
    assert_eq!(
        replayed.iter().map(|e| e.id).collect::<Vec<_>>(),
        first.iter().map(|e| e.id).collect::<Vec<_>>(),
        "same ids, same order"
    );
    let replay_id = report.replay_id.to_string();
    assert!(
        replayed
            .iter()
            .all(|e| e.headers.get(REPLAY_ID_HEADER) == Some(&replay_id))
    );
    assert_eq!(
        consume(&db.pool, &inbox, &replayed).await,
        0,
        "all Duplicate"
    );

    let report = archive
        .replay()
        .topic("orders")
        .max_messages(10)
        .new_ids(true)
        .run()
        .await
        .unwrap();
    assert_eq!(report.replayed, 10);
    assert!(!report.complete, "stopped by max_messages");
    relay.drain().await.unwrap();
    let fresh = publisher.take();
    assert!(fresh.iter().all(|e| first.iter().all(|f| f.id != e.id)));
    assert_eq!(
        fresh.iter().map(|e| e.payload.clone()).collect::<Vec<_>>(),
        first.iter().map(|e| e.payload.clone()).collect::<Vec<_>>()
    );
    assert_eq!(
        consume(&db.pool, &inbox, &fresh).await,
        10,
        "processed again"
    );
}

#[tokio::test]
async fn a_message_still_pending_is_skipped_and_a_wal_duplicate_is_replayed_once() {
    let db = TestDb::migrated().await;
    // A WAL relay that crashed between archiving and advancing archived a message twice
    // (source_seq NULL); a replay publishes it once.
    let id = uuid::Uuid::now_v7();
    for _ in 0..2 {
        sqlx::query(
            "INSERT INTO pgbox.outbox_archive (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
             VALUES ($1, 'wal', 'k', '\\x01', 'x', '{}', now())",
        )
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let archive = Archive::new(db.pool.clone());
    assert_eq!(archive.replay().count().await.unwrap(), 1);
    let report = archive.replay().new_ids(true).run().await.unwrap();
    assert_eq!(report.replayed, 1);
    // Kept ids: the first replay's copy is still pending in the outbox, so nothing is added.
    clear_outbox(&db.pool).await;
    let r1 = archive.replay().run().await.unwrap();
    let r2 = archive.replay().run().await.unwrap();
    assert_eq!((r1.replayed, r2.replayed, r2.skipped), (1, 0, 1));
    assert_eq!(outbox_ids(&db.pool).await, vec![id]);
}

#[tokio::test]
async fn per_key_order_is_kept_end_to_end_into_the_queue_and_replay_resumes() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    for round in 0..4 {
        let mut tx = db.pool.begin().await.unwrap();
        for i in 0..25u32 {
            let n = round * 25 + i;
            let m = Message::bytes("orders", n.to_string().into_bytes())
                .ordering_key(format!("k{}", n % 5));
            outbox.enqueue(&mut tx, m).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let relay = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .batch_size(13)
        .archive(ArchiveRetention::days(1))
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    sqlx::query("DELETE FROM pgbox.queue")
        .execute(&db.pool)
        .await
        .unwrap();
    // Two replays of the same id, resumed from the first one's cursor, in chunks of 7.
    let archive = Archive::new(db.pool.clone());
    let first = archive
        .replay()
        .batch_size(7)
        .max_messages(40)
        .run()
        .await
        .unwrap();
    assert_eq!(first.replayed, 40);
    let cursor = first.cursor.unwrap();
    assert!(cursor > ReplayCursor(0));
    let rest = archive
        .replay()
        .batch_size(7)
        .replay_id(first.replay_id)
        .resume_after(cursor)
        .run()
        .await
        .unwrap();
    assert_eq!(rest.replayed, 60);
    assert!(rest.complete);
    relay.drain().await.unwrap();
    let queued: Vec<(String, Vec<u8>, serde_json::Value)> =
        sqlx::query_as("SELECT ordering_key, payload, headers FROM pgbox.queue ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(queued.len(), 100);
    for key in 0..5u32 {
        let got: Vec<u32> = queued
            .iter()
            .filter(|(k, _, _)| *k == format!("k{key}"))
            .map(|(_, p, _)| String::from_utf8(p.clone()).unwrap().parse().unwrap())
            .collect();
        let want: Vec<u32> = (0..100).filter(|n| n % 5 == key).collect();
        assert_eq!(got, want, "key k{key} in order");
    }
    let id = first.replay_id.to_string();
    assert!(
        queued
            .iter()
            .all(|(_, _, h)| h[REPLAY_ID_HEADER] == id.as_str())
    );
}

#[tokio::test]
async fn the_rate_limit_is_honoured() {
    let db = TestDb::migrated().await;
    let rows: Vec<(&str, Option<&str>, &str, i32)> =
        (0..300).map(|_| ("t", None, "x", 0)).collect();
    archive_rows(&db.pool, &rows).await;
    let started = Instant::now();
    let report = Archive::new(db.pool.clone())
        .replay()
        .rate(1_000)
        .run()
        .await
        .unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(report.replayed, 300);
    let observed = 300.0 / elapsed;
    // Chunks of at most a second's worth, paced on the run's average: 300 at 1000/s take at
    // least 0.2 s (the first chunk goes at once). Generous bound: twice the rate.
    assert!(observed <= 2_000.0, "{observed:.0} msgs/s");
}

#[tokio::test]
async fn bad_input_is_refused_with_typed_errors() {
    let db = TestDb::migrated().await;
    archive_rows(&db.pool, &[("orders", None, "x", 0)]).await;
    let archive = Archive::new(db.pool.clone());
    let now = time::OffsetDateTime::now_utc();
    assert!(matches!(
        archive
            .replay()
            .since(now)
            .until(now - time::Duration::hours(1))
            .count()
            .await,
        Err(Error::InvalidConfig(_))
    ));
    assert!(matches!(
        archive.replay().topic("nope").run().await,
        Err(Error::InvalidField {
            field: "replay topic",
            ..
        })
    ));
    assert!(matches!(
        archive.replay().topic("or\0ders").run().await,
        Err(Error::InvalidField { .. })
    ));
    assert!(matches!(
        archive
            .replay()
            .type_header("ty pe")
            .message_type("x")
            .run()
            .await,
        Err(Error::InvalidField { .. })
    ));
    assert!(matches!(
        archive.replay().batch_size(0).run().await,
        Err(Error::InvalidConfig(_))
    ));
    assert!(matches!(
        archive.replay().rate(0).run().await,
        Err(Error::InvalidConfig(_))
    ));
    assert!(matches!(
        Archive::new(db.pool.clone()).with_schema("x\"; DROP TABLE y; --"),
        Err(Error::InvalidIdentifier { .. })
    ));
    // A hostile value is data, never SQL.
    let hostile = "'); DROP TABLE pgbox.outbox; --";
    assert_eq!(
        archive
            .replay()
            .ordering_key(hostile)
            .message_type(hostile)
            .count()
            .await
            .unwrap(),
        0
    );
    assert!(outbox_ids(&db.pool).await.is_empty());
}
