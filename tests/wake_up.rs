//! How an idle relay learns of new messages without a NOTIFY on every commit: producers
//! notify only while a relay sleeps holding the asleep lock. These tests check that no
//! committed message waits for the poll interval, keyed or not, single or batched, while
//! producers race the relay going to sleep; and that producers stay quiet while no relay
//! sleeps.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{CancellationToken, Envelope, Message, Outbox, Relay};
use sqlx::postgres::PgListener;
use support::TestDb;

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Envelope>>>);

impl Publisher for Recorder {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.lock().unwrap().extend_from_slice(batch);
        vec![Ok(()); batch.len()]
    }
}

/// A relay whose poll interval (an hour) can never explain a prompt publication.
fn sleepy_relay(db: &TestDb, recorder: &Recorder) -> Relay<Recorder> {
    Relay::builder(db.pool.clone(), recorder.clone())
        .poll_interval(Duration::from_secs(3600))
        .build()
        .unwrap()
}

async fn wait_for(recorder: &Recorder, n: usize, limit: Duration) -> Duration {
    let start = Instant::now();
    while recorder.0.lock().unwrap().len() < n {
        assert!(
            start.elapsed() < limit,
            "only {} of {n} published after {limit:?}: a committed message waits for the poll interval",
            recorder.0.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_publishes_keyed_and_unkeyed_single_and_batched_messages_promptly() {
    let db = TestDb::migrated().await;
    let recorder = Recorder::default();
    let relay = sleepy_relay(&db, &recorder);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await; // idle, asleep
    let outbox = Outbox::new();
    let shapes: Vec<Vec<Message>> = vec![
        vec![Message::bytes("t", "unkeyed")],
        vec![Message::bytes("t", "keyed").ordering_key("k")],
        vec![
            Message::bytes("t", "b1").ordering_key("k"),
            Message::bytes("t", "b2"),
        ],
    ];
    let mut expected = 0;
    for batch in shapes {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n = batch.len();
        let mut tx = db.pool.begin().await.unwrap();
        if n == 1 {
            outbox
                .enqueue(&mut tx, batch.into_iter().next().unwrap())
                .await
                .unwrap();
        } else {
            outbox.enqueue_batch(&mut tx, batch).await.unwrap();
        }
        tx.commit().await.unwrap();
        expected += n;
        let latency = wait_for(&recorder, expected, Duration::from_secs(10)).await;
        eprintln!("{n} message(s): committed → published in {latency:?}");
    }
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producers_racing_a_relay_going_to_sleep_never_strand_a_message() {
    let db = TestDb::migrated().await;
    let recorder = Recorder::default();
    let shutdown = CancellationToken::new();
    let mut relays = Vec::new();
    for _ in 0..2 {
        let relay = sleepy_relay(&db, &recorder);
        let s = shutdown.clone();
        relays.push(tokio::spawn(async move { relay.run(s).await }));
    }
    // Producers commit at irregular moments, some holding their transaction open after the
    // enqueue, so commits land while relays drain, while they wait for the asleep lock and
    // while they sleep.
    const PRODUCERS: usize = 4;
    const EACH: usize = 60;
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let pool = db.pool.clone();
        producers.push(tokio::spawn(async move {
            let outbox = Outbox::new();
            for i in 0..EACH {
                let mut tx = pool.begin().await.unwrap();
                let m = Message::bytes("t", format!("{p}:{i}"));
                let m = if i % 2 == 0 {
                    m.ordering_key(format!("k{p}"))
                } else {
                    m
                };
                outbox.enqueue(&mut tx, m).await.unwrap();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..8))).await;
                tx.commit().await.unwrap();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..25))).await;
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    let after_last_commit = wait_for(&recorder, PRODUCERS * EACH, Duration::from_secs(10)).await;
    eprintln!("last commit → all published: {after_last_commit:?}");
    shutdown.cancel();
    for r in relays {
        r.await.unwrap().unwrap();
    }
    assert_eq!(recorder.0.lock().unwrap().len(), PRODUCERS * EACH);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_notify_only_while_a_relay_sleeps() {
    let db = TestDb::migrated().await;
    let mut listener = PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("pgbox.outbox").await.unwrap();
    let outbox = Outbox::new();
    let enqueue = async || {
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, Message::bytes("t", "x"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    };
    // No relay asleep: commits are silent.
    for _ in 0..5 {
        enqueue().await;
    }
    let quiet = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(quiet.is_err(), "a producer notified with no relay asleep");

    // A relay drains, then sleeps: the next commit notifies.
    let recorder = Recorder::default();
    let relay = sleepy_relay(&db, &recorder);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    wait_for(&recorder, 5, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    enqueue().await;
    let woke = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    assert!(woke.is_ok(), "no notification while the relay slept");
    wait_for(&recorder, 6, Duration::from_secs(10)).await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_lands_while_the_relay_waits_to_sleep_is_published_at_once() {
    let db = TestDb::migrated().await;
    // A producer enqueues while no relay sleeps (so it will not notify) and stays open.
    let mut producer = db.pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut producer, Message::bytes("t", "late").ordering_key("k"))
        .await
        .unwrap();
    // The relay starts, finds nothing committed, and waits for the producer before sleeping.
    let recorder = Recorder::default();
    let relay = sleepy_relay(&db, &recorder);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    support::wait_for_lock_waiter(&db.pool).await;
    producer.commit().await.unwrap();
    // Nobody notified: only the relay's drain after taking the lock can find it.
    wait_for(&recorder, 1, Duration::from_secs(10)).await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
