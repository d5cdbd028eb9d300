//! The WAL relay's archive, on a private `wal_level = logical` cluster: confirmed batches are
//! archived before the slot moves past them; a reader connection dropped between the two
//! archives the batch twice, and a replay publishes each message once.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{
    Archive, ArchiveRetention, Envelope, Message, Outbox, OutboxMode, WalReader, WalRelay,
};
use sqlx::PgPool;

/// Confirms everything; at its first call it first terminates the WAL relay's reader
/// connection (the session holding an advisory lock), so the round dies after the archive
/// and before the slot's advance.
#[derive(Clone)]
struct KillsReaderOnce {
    pool: PgPool,
    armed: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Envelope>>>,
}

impl Publisher for KillsReaderOnce {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        if self.armed.swap(false, Ordering::SeqCst) {
            let killed: i64 = sqlx::query_scalar(
                "SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks AS l \
                 WHERE l.locktype = 'advisory' AND l.granted AND l.pid <> pg_backend_pid()",
            )
            .fetch_one(&self.pool)
            .await
            .unwrap();
            assert_eq!(killed, 1, "the reader's session");
        }
        self.seen.lock().unwrap().extend_from_slice(batch);
        batch.iter().map(|_| Ok(())).collect()
    }
}

async fn archived(pool: &PgPool) -> Vec<(uuid::Uuid, Option<i64>)> {
    sqlx::query_as("SELECT message_id, source_seq FROM pgbox.outbox_archive ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_relay_archives_before_advancing_and_a_crash_between_replays_once() {
    let (_cluster, pool, slot) = support::wal::logical(&[]).await;
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let mut ids = Vec::new();
    let mut tx = pool.begin().await.unwrap();
    for i in 0..6u8 {
        let m = Message::bytes("wal", vec![i])
            .ordering_key(format!("k{}", i % 2))
            .header("type", "t");
        ids.push(wal.enqueue(&mut tx, m).await.unwrap());
    }
    tx.commit().await.unwrap();

    let publisher = KillsReaderOnce {
        pool: pool.clone(),
        armed: Arc::new(AtomicBool::new(true)),
        seen: Arc::default(),
    };
    let relay = WalRelay::builder(pool.clone(), slot.clone(), publisher.clone())
        .reader(WalReader::SqlFunctions)
        .archive(ArchiveRetention::days(1))
        .build()
        .unwrap();
    assert!(
        relay.relay_once().await.is_err(),
        "the advance's connection was dropped"
    );
    let once: Vec<uuid::Uuid> = archived(&pool).await.iter().map(|r| r.0).collect();
    assert_eq!(once, ids, "archived before the advance, in order");
    // A relay started afresh (the crashed process's memory is gone) re-reads from the slot's
    // position: published and archived again.
    drop(relay);
    let relay = WalRelay::builder(pool.clone(), slot.clone(), publisher.clone())
        .reader(WalReader::SqlFunctions)
        .archive(ArchiveRetention::days(1))
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 6);
    let twice = archived(&pool).await;
    assert_eq!(twice.len(), 12);
    assert!(twice.iter().all(|(_, source)| source.is_none()));
    assert_eq!(publisher.seen.lock().unwrap().len(), 12);
    // A third drain finds nothing: the slot moved.
    assert_eq!(relay.drain().await.unwrap().published, 0);

    // Replay (into the WAL outbox, as its producers write): each message once, in order,
    // ids kept.
    let archive = Archive::new(pool.clone());
    assert_eq!(archive.replay().count().await.unwrap(), 6);
    let report = archive.replay().mode(OutboxMode::Wal).run().await.unwrap();
    assert_eq!(report.replayed, 6);
    publisher.seen.lock().unwrap().clear();
    assert_eq!(relay.drain().await.unwrap().published, 6);
    let replayed: Vec<uuid::Uuid> = publisher
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(replayed, ids);
}
