//! Defects found by reviewing the second wave, each pinned by a test that failed before its
//! fix: a lease granted already expired after waiting on a row lock, and the relay letting a
//! later message of a key overtake an earlier one whose producer started later.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbox::transport::{PublishError, Publisher};
use pgbox::{Envelope, Inbox, LeaseAttempt, Message, Outbox, Relay};
use sqlx::Executor;
use support::TestDb;
use time::OffsetDateTime;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_waited_on_the_row_lock_still_gets_its_whole_ttl() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("waits").unwrap();
    let ttl = Duration::from_secs(1);

    // A transactional claim of the key holds its row lock, then rolls back after longer than
    // the lease's TTL.
    let mut blocker = db.pool.begin().await.unwrap();
    blocker
        .execute("INSERT INTO pgbox.inbox (consumer, key) VALUES ('waits', 'k')")
        .await
        .unwrap();
    let lease = tokio::spawn({
        let (inbox, pool) = (inbox.clone(), db.pool.clone());
        async move { inbox.lease(&pool, "k", ttl).await }
    });
    support::wait_for_lock_waiter(&db.pool).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    blocker.rollback().await.unwrap();

    let LeaseAttempt::Leased(lease) = lease.await.unwrap().unwrap() else {
        panic!("the key was free once the claim rolled back");
    };
    let db_now: OffsetDateTime = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        lease.expires_at() > db_now,
        "granted already expired: expires {} at {db_now}",
        lease.expires_at()
    );
    // So nobody can take it over yet.
    assert!(
        matches!(
            inbox.lease(&db.pool, "k", ttl).await.unwrap(),
            LeaseAttempt::InProgress { .. }
        ),
        "a second holder got a lease the first still holds"
    );
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Envelope>>>);

impl Publisher for Recorder {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.lock().unwrap().extend(batch.iter().cloned());
        batch.iter().map(|_| Ok(())).collect()
    }
}

#[tokio::test]
async fn a_message_never_tried_is_not_overtaken_by_a_later_one_of_its_key() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue_batch(
            &mut tx,
            ["first", "second"].map(|p| Message::bytes("t", p).ordering_key("k")),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // What a producer whose transaction started after the relay's round gets: an
    // `available_at` (its transaction's start) later than the round's now(), on the key's
    // earlier row.
    db.pool
        .execute(
            "UPDATE pgbox.outbox SET available_at = now() + interval '1 hour' \
             WHERE seq = (SELECT min(seq) FROM pgbox.outbox)",
        )
        .await
        .unwrap();
    let recorder = Recorder::default();
    let relay = Relay::builder(db.pool.clone(), recorder.clone())
        .build()
        .unwrap();
    relay.relay_once().await.unwrap();
    let order: Vec<Vec<u8>> = recorder
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.payload.clone())
        .collect();
    assert_eq!(order, vec![b"first".to_vec(), b"second".to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_key_function_is_a_failed_delivery_not_a_dead_runner() {
    use pgbox::transport::PgQueue;
    use pgbox::{CancellationToken, Consumer, Error};

    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for p in ["a", "no-key", "b"] {
        outbox
            .enqueue(&mut tx, Message::bytes("jobs", p))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let queue = PgQueue::new(db.pool.clone());
    Relay::builder(db.pool.clone(), queue.clone())
        .build()
        .unwrap()
        .relay_once()
        .await
        .unwrap();
    let consumer = Consumer::builder(db.pool.clone(), queue, "jobs", Inbox::new("keys").unwrap())
        // The business key comes from the payload; one payload has none.
        .key(|e: &Envelope| {
            let text = String::from_utf8(e.payload.clone()).unwrap();
            assert_ne!(text, "no-key", "a payload without its business key");
            format!("order-{text}")
        })
        .max_deliveries(2)
        .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let s = shutdown.clone();
        async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                        sqlx::query("INSERT INTO effects VALUES ($1)")
                            .bind(String::from_utf8(e.payload.clone()).unwrap())
                            .execute(&mut *conn)
                            .await
                            .map_err(Error::from)?;
                        Ok::<(), Error>(())
                    },
                    s,
                )
                .await
        }
    });
    let dead_letters = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM pgbox.queue_dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    for _ in 0..1_000 {
        if dead_letters().await >= 1 || run.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = run
        .await
        .expect("the runner survived the key function's panics")
        .unwrap();
    assert_eq!(stats.processed, 2);
    assert_eq!(stats.panicked, 2, "two deliveries, each panicked");
    assert_eq!(stats.dead_lettered, 1);
    let error: String = sqlx::query_scalar(
        "SELECT last_error FROM pgbox.queue_dead_letters WHERE payload = 'no-key'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(error.contains("key function"), "{error}");
}
