//! The fan-out router under the WAL relay: messages written to the WAL outbox reach every
//! routed destination once, in per-key order, and a destination away for its first calls
//! gets its copies from the router's deferred deliveries. On a private cluster with
//! `wal_level = logical`.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{Envelope, Message, Outbox, OutboxMode, Router, WalRelay};

/// (ordering key, payload) of each message a destination took.
type Taken = Arc<Mutex<Vec<(String, u32)>>>;

/// Unavailable for its first `down` calls, then records what it is given.
#[derive(Clone, Default)]
struct Sink {
    down: Arc<AtomicUsize>,
    got: Taken,
}

impl Publisher for Sink {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        if self
            .down
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return vec![Err(PublishError::unavailable("down for now")); batch.len()];
        }
        let mut got = self.got.lock().unwrap();
        for e in batch {
            let n = u32::from_be_bytes(e.payload[..4].try_into().unwrap());
            got.push((e.ordering_key.clone().unwrap_or_default(), n));
        }
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_messages_fan_out_in_key_order_with_a_destination_away() {
    const N: u32 = 300;
    let (_cluster, pool, slot) = support::wal::logical(&[]).await;
    let (steady, away) = (Sink::default(), Sink::default());
    away.down.store(3, Ordering::SeqCst);
    let router = Arc::new(
        Router::builder(pool.clone())
            .destination("steady", steady.clone())
            .destination("away", away.clone())
            .route("wal.*", ["steady", "away"])
            .away_backoff(Duration::from_millis(50), Duration::from_millis(100))
            .build()
            .unwrap(),
    );
    let wal = Outbox::new().mode(OutboxMode::Wal);
    for chunk in 0..N / 50 {
        let mut tx = pool.begin().await.unwrap();
        for i in chunk * 50..(chunk + 1) * 50 {
            wal.enqueue(
                &mut tx,
                Message::bytes("wal.orders", i.to_be_bytes().to_vec())
                    .ordering_key(format!("k{}", i % 7)),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let relay = WalRelay::builder(pool.clone(), slot, router.clone())
        .batch_size(40)
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    assert_eq!(
        steady.got.lock().unwrap().len(),
        N as usize,
        "steady: at once"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while away.got.lock().unwrap().len() < N as usize {
        assert!(
            Instant::now() < deadline,
            "the deferred copies never drained"
        );
        router.drain().await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    for (name, sink) in [("steady", &steady), ("away", &away)] {
        let got = sink.got.lock().unwrap().clone();
        assert_eq!(got.len(), N as usize, "{name}: every message once");
        for k in 0..7 {
            let seen: Vec<u32> = got
                .iter()
                .filter(|(key, _)| *key == format!("k{k}"))
                .map(|(_, n)| *n)
                .collect();
            let want: Vec<u32> = (0..N).filter(|i| i % 7 == k).collect();
            assert_eq!(seen, want, "{name}: key k{k} in commit order");
        }
    }
    let left: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pgbox.outbox_fanout_deliveries), \
                (SELECT count(*) FROM pgbox.outbox_fanout_messages)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(left, (0, 0), "nothing left behind");
}
