//! Attacks on scheduled messages (issue 36): the promises of guide/src/scheduled.md and the
//! rustdoc of `Message::deliver_at`/`deliver_after`/`schedule_key`, `ScheduleConflict`,
//! `Outbox::cancel_scheduled`/`reschedule`, promotion by the `Relay`. Real PostgreSQL, a
//! database per test.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{CancellationToken, Envelope, Message, Outbox, Relay, ScheduleConflict};
use sqlx::PgPool;
use support::TestDb;
use time::OffsetDateTime;
use uuid::Uuid;

fn relay(pool: &PgPool) -> Relay<PgQueue> {
    Relay::builder(pool.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap()
}

/// Payloads in the built-in queue, in its order, for `topic`.
async fn queued(pool: &PgPool, topic: &str) -> Vec<String> {
    sqlx::query_scalar::<_, Vec<u8>>(
        "SELECT payload FROM pgbox.queue WHERE topic = $1 ORDER BY seq",
    )
    .bind(topic)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|p| String::from_utf8(p).unwrap())
    .collect()
}

async fn schedule(pool: &PgPool, m: Message) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let id = Outbox::new().enqueue(&mut tx, m).await.unwrap();
    tx.commit().await.unwrap();
    id
}

async fn drain(pool: &PgPool) {
    tokio::time::timeout(Duration::from_secs(10), relay(pool).drain())
        .await
        .expect("drain within 10 s")
        .unwrap();
}

/// Two due messages of one ordering key, `first` due before `second`, under schedule keys
/// `a` and `b`.
async fn two_due_of_one_key(pool: &PgPool, topic: &str) {
    let now = OffsetDateTime::now_utc();
    schedule(
        pool,
        Message::bytes(topic, "first")
            .ordering_key("order-1")
            .schedule_key("a")
            .deliver_at(now - time::Duration::minutes(10)),
    )
    .await;
    schedule(
        pool,
        Message::bytes(topic, "second")
            .ordering_key("order-1")
            .schedule_key("b")
            .deliver_at(now - time::Duration::minutes(5)),
    )
    .await;
}

/// Promise: "among scheduled messages of one key: due time, then scheduling order". A
/// producer that merely tries to schedule again under `KeepExisting` (first wins: it changes
/// nothing) holds the pending row's lock until it commits; promotion's `FOR UPDATE SKIP
/// LOCKED` skips that row but promotes the later message of the same ordering key, which is
/// then published first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_keep_existing_producer_in_flight_lets_a_later_message_of_the_key_overtake() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    two_due_of_one_key(pool, "keep").await;
    let mut producer = pool.begin().await.unwrap();
    let kept = Outbox::new()
        .enqueue(
            &mut producer,
            Message::bytes("keep", "ignored")
                .ordering_key("order-1")
                .schedule_key("a")
                .on_schedule_conflict(ScheduleConflict::KeepExisting)
                .deliver_after(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    drain(pool).await;
    producer.commit().await.unwrap();
    drain(pool).await;
    let got = queued(pool, "keep").await;
    assert_eq!(got.len(), 2, "{got:?}");
    let _ = kept;
    assert_eq!(
        got,
        ["first", "second"],
        "per key: due time order; the KeepExisting producer changed nothing"
    );
}

/// The same through a cancel that is rolled back: nothing changed, yet the order of the key
/// is broken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_cancel_rolled_back_lets_a_later_message_of_the_key_overtake() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    two_due_of_one_key(pool, "cancel").await;
    let mut producer = pool.begin().await.unwrap();
    assert!(
        Outbox::new()
            .cancel_scheduled(&mut producer, "cancel", "a")
            .await
            .unwrap()
    );
    drain(pool).await;
    producer.rollback().await.unwrap();
    drain(pool).await;
    assert_eq!(queued(pool, "cancel").await, ["first", "second"]);
}

/// A publisher that records what it was given (payload, when), taking `slow` on a payload
/// named "slow": keeps the relay awake in a round.
#[derive(Clone)]
struct Recording {
    got: Arc<Mutex<Vec<(String, Instant)>>>,
    slow: Duration,
}

impl Publisher for Recording {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        for e in batch {
            let p = String::from_utf8_lossy(&e.payload).into_owned();
            if p == "slow" {
                tokio::time::sleep(self.slow).await;
            }
            self.got.lock().unwrap().push((p, Instant::now()));
        }
        vec![Ok(()); batch.len()]
    }
}

async fn wait_for(
    got: &Arc<Mutex<Vec<(String, Instant)>>>,
    payload: &str,
    limit: Duration,
) -> Option<Instant> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Some((_, at)) = got.lock().unwrap().iter().find(|(p, _)| p == payload) {
            return Some(*at);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

fn spawn_relay(
    pool: &PgPool,
    got: &Arc<Mutex<Vec<(String, Instant)>>>,
    poll: Duration,
    slow: Duration,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<pgbox::Result<()>>,
) {
    let relay = Relay::builder(
        pool.clone(),
        Recording {
            got: got.clone(),
            slow,
        },
    )
    .poll_interval(poll)
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    (shutdown, run)
}

/// Promise: the relay looks for due messages "when the earliest pending one falls due (it
/// sleeps until then, not a whole poll interval) ... and at once when a producer scheduled
/// a message while it slept". A message scheduled while the relay is awake (publishing a
/// round) sends no notice, and the relay's next look stays where it was planned before: a
/// whole poll interval away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_message_scheduled_while_the_relay_is_awake_waits_a_whole_poll_interval() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let got = Arc::new(Mutex::new(Vec::new()));
    let (shutdown, run) = spawn_relay(pool, &got, Duration::from_secs(20), Duration::from_secs(2));
    // Asleep with nothing scheduled: its next look is a poll interval away.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Wake it with an immediate message that keeps it publishing for 2 s.
    schedule(pool, Message::bytes("t", "slow")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Scheduled while it is awake, due in 200 ms.
    let at = Instant::now();
    schedule(
        pool,
        Message::bytes("t", "soon").deliver_after(Duration::from_millis(200)),
    )
    .await;
    let published = wait_for(&got, "soon", Duration::from_secs(8)).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let published = published.map(|p| p - at);
    assert!(
        published.is_some_and(|d| d < Duration::from_secs(5)),
        "due in 200 ms, published after {published:?} (None: not within 8 s; poll interval 20 s)"
    );
}

/// `reschedule` to now while the relay sleeps towards a far due time (long poll interval):
/// no notice, so the message waits for the poll interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_reschedule_to_now_does_not_wake_a_sleeping_relay() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let got = Arc::new(Mutex::new(Vec::new()));
    let (shutdown, run) = spawn_relay(pool, &got, Duration::from_secs(20), Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(500)).await;
    schedule(
        pool,
        Message::bytes("r", "moved")
            .schedule_key("k")
            .deliver_after(Duration::from_secs(3600)),
    )
    .await;
    // Let the relay take the notice, look, and fall asleep again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let at = Instant::now();
    let mut tx = pool.begin().await.unwrap();
    assert!(
        Outbox::new()
            .reschedule(&mut tx, "r", "k", OffsetDateTime::now_utc())
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    let published = wait_for(&got, "moved", Duration::from_secs(8)).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let published = published.map(|p| p - at);
    assert!(
        published.is_some_and(|d| d < Duration::from_secs(5)),
        "rescheduled to now, published after {published:?} (None: not within 8 s; poll interval 20 s)"
    );
}

/// The control: a message scheduled while the relay sleeps wakes it (the notice) and is
/// published at its due time, not after the poll interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_a_message_scheduled_while_the_relay_sleeps_is_published_at_its_due_time() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let got = Arc::new(Mutex::new(Vec::new()));
    let (shutdown, run) = spawn_relay(pool, &got, Duration::from_secs(20), Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let at = Instant::now();
    schedule(
        pool,
        Message::bytes("s", "past").deliver_at(OffsetDateTime::UNIX_EPOCH),
    )
    .await;
    schedule(
        pool,
        Message::bytes("s", "soon").deliver_after(Duration::from_millis(700)),
    )
    .await;
    let past = wait_for(&got, "past", Duration::from_secs(8)).await;
    let soon = wait_for(&got, "soon", Duration::from_secs(8)).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let past = past.map(|p| p - at);
    let soon = soon.map(|p| p - at);
    assert!(past.is_some_and(|d| d < Duration::from_secs(2)), "{past:?}");
    assert!(
        soon.is_some_and(|d| d >= Duration::from_millis(600) && d < Duration::from_secs(3)),
        "{soon:?}"
    );
}

/// Scans of `outbox_scheduled` (sequential and index) counted by the server.
async fn scans(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT (coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::int8 FROM pg_stat_user_tables \
         WHERE relname = 'outbox_scheduled'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Runs a relay (own pool, poll interval 5 s) for 2 s and returns how many scans of
/// `outbox_scheduled` it made (its connections closed, so that their counters are flushed).
async fn scans_of_a_relay_for_2s(db: &TestDb) -> i64 {
    let before = scans(&db.pool).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let (shutdown, run) = spawn_relay(&pool, &got, Duration::from_secs(5), Duration::ZERO);
    tokio::time::sleep(Duration::from_secs(2)).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    pool.close().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("SELECT pg_catalog.pg_stat_clear_snapshot()")
        .execute(&db.pool)
        .await
        .unwrap();
    scans(&db.pool).await - before
}

/// Promise: "It looks for due messages only when one may be due ... With nothing due, the
/// look is one probe of the due-time index." A due message whose row a producer holds (a
/// `KeepExisting` enqueue, a cancel or a reschedule in a transaction still open) cannot be
/// promoted; the relay computes "due now" again and again and loops on a 1 ms sleep,
/// running its promotion and probes hundreds of times a second for as long as the producer's
/// transaction lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_due_row_held_by_an_open_producer_transaction_makes_the_relay_spin() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    // Control: one pending message an hour away: the relay looks once a poll interval.
    schedule(
        pool,
        Message::bytes("spin", "later")
            .schedule_key("later")
            .deliver_after(Duration::from_secs(3600)),
    )
    .await;
    let idle = scans_of_a_relay_for_2s(&db).await;
    // A due one, held by a producer's open transaction (it cancels it, then goes on working).
    schedule(
        pool,
        Message::bytes("spin", "due")
            .schedule_key("due")
            .deliver_at(OffsetDateTime::UNIX_EPOCH),
    )
    .await;
    let mut producer = pool.begin().await.unwrap();
    assert!(
        Outbox::new()
            .cancel_scheduled(&mut producer, "spin", "due")
            .await
            .unwrap()
    );
    let held = scans_of_a_relay_for_2s(&db).await;
    eprintln!("scans: idle {idle}, held {held}");
    producer.commit().await.unwrap();
    assert!(
        held < 200,
        "a relay with a poll interval of 5 s scanned outbox_scheduled {held} times in 2 s while \
         a due row was held ({idle} times with nothing due)"
    );
}

/// The WAL relay's promotion (`take_due_sql`): the same skip, the same overtaking, in the
/// WAL's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_wal_a_held_due_message_is_overtaken_by_a_later_one_of_its_key() {
    use pgbox::{OutboxMode, WalRelay};
    let (_cluster, pool, slot) = support::wal::logical(&[]).await;
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let now = OffsetDateTime::now_utc();
    let mut tx = pool.begin().await.unwrap();
    for (payload, key, ago) in [("first", "a", 10), ("second", "b", 5)] {
        wal.enqueue(
            &mut tx,
            Message::bytes("w", payload)
                .ordering_key("order-1")
                .schedule_key(key)
                .deliver_at(now - time::Duration::minutes(ago)),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let mut producer = pool.begin().await.unwrap();
    assert!(
        wal.reschedule(&mut producer, "w", "a", now - time::Duration::minutes(20))
            .await
            .unwrap()
    );
    let relay = WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), relay.drain())
        .await
        .unwrap()
        .unwrap();
    producer.rollback().await.unwrap();
    let started = Instant::now();
    loop {
        tokio::time::timeout(Duration::from_secs(20), relay.drain())
            .await
            .unwrap()
            .unwrap();
        let got = queued(&pool, "w").await;
        if got.len() == 2 {
            assert_eq!(got, ["first", "second"]);
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `KeepExisting` returns the pending message's id; once the pending one was promoted, the
/// new one is scheduled anew and its own id is returned. Replace in one batch: one pending,
/// the last; the ids returned for the batch name what is pending or published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_keep_existing_returns_the_pending_id_and_a_batch_with_one_key_twice_keeps_one() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let outbox = Outbox::new();
    let first = schedule(
        pool,
        Message::bytes("k", "first")
            .schedule_key("s")
            .deliver_after(Duration::from_secs(3600)),
    )
    .await;
    let second = Message::bytes("k", "second")
        .schedule_key("s")
        .on_schedule_conflict(ScheduleConflict::KeepExisting)
        .deliver_at(OffsetDateTime::UNIX_EPOCH);
    let second_id = second.id();
    assert_eq!(schedule(pool, second).await, first);
    assert_ne!(first, second_id);
    // Due now, promoted: the next KeepExisting meets nothing and is its own.
    let mut tx = pool.begin().await.unwrap();
    assert!(
        outbox
            .reschedule(&mut tx, "k", "s", OffsetDateTime::UNIX_EPOCH)
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    drain(pool).await;
    let third = Message::bytes("k", "third")
        .schedule_key("s")
        .on_schedule_conflict(ScheduleConflict::KeepExisting)
        .deliver_at(OffsetDateTime::UNIX_EPOCH);
    let third_id = third.id();
    assert_eq!(schedule(pool, third).await, third_id);
    drain(pool).await;
    assert_eq!(queued(pool, "k").await, ["first", "third"]);

    // A batch: immediate, keyed, two under one schedule key (Replace), then KeepExisting.
    let batch = vec![
        Message::bytes("b", "x1")
            .schedule_key("one")
            .ordering_key("o")
            .deliver_at(OffsetDateTime::UNIX_EPOCH),
        Message::bytes("b", "now").ordering_key("o"),
        Message::bytes("b", "x2")
            .schedule_key("one")
            .ordering_key("o")
            .deliver_at(OffsetDateTime::UNIX_EPOCH),
        Message::bytes("b", "x3")
            .schedule_key("one")
            .ordering_key("o")
            .on_schedule_conflict(ScheduleConflict::KeepExisting)
            .deliver_at(OffsetDateTime::UNIX_EPOCH),
    ];
    let x2 = batch[2].id();
    let mut tx = pool.begin().await.unwrap();
    let ids = outbox.enqueue_batch(&mut tx, batch).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids.len(), 4);
    assert_eq!(
        ids[3], x2,
        "KeepExisting in the batch returns the pending one"
    );
    drain(pool).await;
    assert_eq!(queued(pool, "b").await, ["now", "x2"]);
    let published: Vec<Uuid> =
        sqlx::query_scalar("SELECT message_id FROM pgbox.queue WHERE topic = 'b' ORDER BY seq")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(published[1], x2);
}

/// Keys at the documented limit (1,024 bytes of multi-byte UTF-8) and one byte over; due
/// times at the ends of `OffsetDateTime`; status counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_keys_at_the_limit_extreme_due_times_and_status() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let outbox = Outbox::new();
    // "€" is 3 bytes, "😀" 4: 340 * 3 + 4 = 1,024.
    let key = format!("{}😀", "€".repeat(340));
    assert_eq!(key.len(), 1024);
    let over = format!("{}😀", "€".repeat(341));
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut tx,
            Message::bytes("x".repeat(255), "max")
                .schedule_key(key.clone())
                .deliver_at(time::Date::MAX.midnight().assume_utc()),
        )
        .await
        .unwrap();
    let err = outbox
        .enqueue(
            &mut tx,
            Message::bytes("t", "over")
                .schedule_key(over.clone())
                .deliver_after(Duration::from_secs(1)),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, pgbox::Error::KeyTooLong { .. }), "{err:?}");
    assert!(outbox.cancel_scheduled(&mut tx, "t", &over).await.is_err());
    outbox
        .enqueue(
            &mut tx,
            Message::bytes("min", "min").deliver_at(
                time::Date::MIN
                    .midnight()
                    .assume_offset(time::UtcOffset::from_hms(-23, 59, 59).unwrap()),
            ),
        )
        .await
        .unwrap();
    // Nearly-too-long delays: a nanosecond under the maximum.
    outbox
        .enqueue(
            &mut tx,
            Message::bytes("far", "far")
                .deliver_after(pgbox::MAX_SCHEDULE_DELAY - Duration::from_nanos(1)),
        )
        .await
        .unwrap();
    assert!(
        outbox
            .enqueue(
                &mut tx,
                Message::bytes("far", "too far")
                    .deliver_after(pgbox::MAX_SCHEDULE_DELAY + Duration::from_nanos(1)),
            )
            .await
            .is_err()
    );
    tx.commit().await.unwrap();
    drain(pool).await;
    assert_eq!(queued(pool, "min").await, ["min"]);
    let status = pgbox::status(pool, "pgbox").await.unwrap();
    assert_eq!(status.scheduled, 2);
    let mut tx = pool.begin().await.unwrap();
    assert!(
        outbox
            .cancel_scheduled(&mut tx, &"x".repeat(255), &key)
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    assert_eq!(pgbox::status(pool, "pgbox").await.unwrap().scheduled, 1);
}

/// The WAL relay (default streaming reader), idle: a message scheduled due in 200 ms while
/// the reader waits in its read is promoted within a poll interval of its due time. (Found:
/// the streaming reader never sleeps under the WAL asleep lock, so a scheduled enqueue does
/// not notify it; with a 10 s poll interval the message waited 10 s. The guide now states the
/// bound: one poll interval, 100 ms by default.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_wal_streaming_reader_promotes_within_a_poll_interval_of_the_due_time() {
    use pgbox::{OutboxMode, WalRelay};
    let (_cluster, pool, slot) = support::wal::logical(&[]).await;
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let got = Arc::new(Mutex::new(Vec::new()));
    let relay = WalRelay::builder(
        pool.clone(),
        slot.clone(),
        Recording {
            got: got.clone(),
            slow: Duration::ZERO,
        },
    )
    .poll_interval(Duration::from_secs(2))
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at = Instant::now();
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue(
        &mut tx,
        Message::bytes("t", "soon").deliver_after(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let published = wait_for(&got, "soon", Duration::from_secs(8)).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let published = published.map(|p| p - at);
    assert!(
        published.is_some_and(|d| d >= Duration::from_millis(200) && d < Duration::from_secs(5)),
        "due in 200 ms, published after {published:?} (None: not within 8 s; poll interval 2 s)"
    );
}

/// Promise: a scheduled message "never holds back its key's other messages", and pending
/// scheduled messages "cost the immediate path nothing". A producer's transaction that
/// enqueued a message of key K and is still open holds K's enqueue lock; a due scheduled
/// message of K makes the promotion wait for that lock, and the relay runs promotion before
/// every round: nothing else (other keys, other topics, unkeyed) is published until the
/// producer's transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_long_producer_transaction_on_a_due_key_stalls_the_whole_relay() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let got = Arc::new(Mutex::new(Vec::new()));
    let (shutdown, run) = spawn_relay(pool, &got, Duration::from_secs(1), Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut producer = pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(
            &mut producer,
            Message::bytes("orders", "paid").ordering_key("order-1"),
        )
        .await
        .unwrap();
    schedule(
        pool,
        Message::bytes("orders", "reminder")
            .ordering_key("order-1")
            .deliver_at(OffsetDateTime::UNIX_EPOCH),
    )
    .await;
    // The relay has been woken by the schedule and is promoting (before the fix: waiting
    // for the producer's key lock).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let at = Instant::now();
    schedule(pool, Message::bytes("other", "unrelated")).await;
    let published = wait_for(&got, "unrelated", Duration::from_secs(4)).await;
    producer.commit().await.unwrap();
    let reminder = wait_for(&got, "reminder", Duration::from_secs(5)).await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert!(reminder.is_some());
    let published = published.map(|p| p - at);
    assert!(
        published.is_some_and(|d| d < Duration::from_secs(2)),
        "an unrelated message waited {published:?} (None: over 4 s, until the producer of \
         another key committed)"
    );
}
