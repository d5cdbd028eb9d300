//! Scheduled messages (`Message::deliver_at`, `deliver_after`, `schedule_key`): held in
//! `outbox_scheduled` until the database's clock says they are due, then promoted into the
//! outbox, where they take their place in their key's order. Real PostgreSQL throughout.

mod support;

use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{CancellationToken, Error, Message, Outbox, Relay, ScheduleConflict};
use sqlx::PgPool;
use support::TestDb;
use time::OffsetDateTime;
use uuid::Uuid;

fn relay(pool: &PgPool) -> Relay<PgQueue> {
    Relay::builder(pool.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap()
}

/// Payloads in the queue, in its order, for `topic`.
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

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn pending(pool: &PgPool) -> i64 {
    scalar(pool, "SELECT count(*) FROM pgbox.outbox_scheduled").await
}

async fn schedule(pool: &PgPool, m: Message) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let id = Outbox::new().enqueue(&mut tx, m).await.unwrap();
    tx.commit().await.unwrap();
    id
}

/// Drains until `topic` holds `n` messages in the queue; panics after `limit`.
async fn drain_until(pool: &PgPool, topic: &str, n: usize, limit: Duration) -> Duration {
    let relay = relay(pool);
    let started = Instant::now();
    loop {
        relay.drain().await.unwrap();
        if queued(pool, topic).await.len() >= n {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "{topic}: not {n} messages within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_publishes_at_the_due_time_never_before_even_with_a_long_poll_interval() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    // A poll interval far beyond the delay: only the relay's due-time wake-up can be in time.
    let relay = Relay::builder(pool.clone(), PgQueue::new(pool.clone()))
        .poll_interval(Duration::from_secs(30))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    // Let the relay fall asleep first: the schedule then has to wake it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let id = schedule(
        pool,
        Message::bytes("later", "in 1.5 s").deliver_after(Duration::from_millis(1500)),
    )
    .await;
    let due: OffsetDateTime =
        sqlx::query_scalar("SELECT due_at FROM pgbox.outbox_scheduled WHERE message_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    let started = Instant::now();
    loop {
        if let Some((queued_id, at)) = sqlx::query_as::<_, (Uuid, OffsetDateTime)>(
            "SELECT message_id, enqueued_at FROM pgbox.queue WHERE topic = 'later'",
        )
        .fetch_optional(pool)
        .await
        .unwrap()
        {
            assert_eq!(queued_id, id, "the id is kept through promotion");
            assert!(at >= due, "published at {at}, before its due time {due}");
            assert!(
                at - due < time::Duration::seconds(2),
                "published {} after its due time",
                at - due
            );
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "not published within 6 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(pending(pool).await, 0);
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_clock_decides_a_skewed_application_clock_does_not() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    // An application clock one hour fast: "in 1 s" by it is an hour and a second away by the
    // server's clock, and is not published now.
    let skewed_now = OffsetDateTime::now_utc() + time::Duration::hours(1);
    schedule(
        pool,
        Message::bytes("skew", "fast clock").deliver_at(skewed_now + time::Duration::seconds(1)),
    )
    .await;
    // One hour slow: "an hour ago by the app" is due now by the server.
    let slow_now = OffsetDateTime::now_utc() - time::Duration::hours(1);
    schedule(
        pool,
        Message::bytes("skew", "slow clock").deliver_at(slow_now),
    )
    .await;
    // deliver_after: computed on the server from the enqueuing statement's timestamp.
    let before: OffsetDateTime = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap();
    let id = schedule(
        pool,
        Message::bytes("after", "x").deliver_after(Duration::from_secs(600)),
    )
    .await;
    let after: OffsetDateTime = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap();
    let due: OffsetDateTime =
        sqlx::query_scalar("SELECT due_at FROM pgbox.outbox_scheduled WHERE message_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    let ten = time::Duration::minutes(10);
    assert!(
        before + ten <= due && due <= after + ten,
        "{before} .. {after} + 10 min vs {due}"
    );
    relay(pool).drain().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    relay(pool).drain().await.unwrap();
    assert_eq!(queued(pool, "skew").await, ["slow clock"]);
    assert_eq!(pending(pool).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_message_takes_its_place_in_its_key_at_promotion_and_holds_nothing_back() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let outbox = Outbox::new();
    schedule(
        pool,
        Message::bytes("orders", "reminder")
            .ordering_key("order-1")
            .deliver_after(Duration::from_millis(800)),
    )
    .await;
    // Committed after the scheduled one, before its due time: published first, at once.
    schedule(
        pool,
        Message::bytes("orders", "paid").ordering_key("order-1"),
    )
    .await;
    relay(pool).drain().await.unwrap();
    assert_eq!(queued(pool, "orders").await, ["paid"]);
    drain_until(pool, "orders", 2, Duration::from_secs(5)).await;
    // Committed after the promotion: published after it.
    schedule(
        pool,
        Message::bytes("orders", "shipped").ordering_key("order-1"),
    )
    .await;
    relay(pool).drain().await.unwrap();
    assert_eq!(
        queued(pool, "orders").await,
        ["paid", "reminder", "shipped"]
    );

    // A producer of the key in flight when the scheduled one falls due: promotion leaves the
    // key for a later round (its enqueue lock is taken) and promotes everything else, so seq
    // order stays commit order and nothing else waits for that producer.
    schedule(
        pool,
        Message::bytes("orders", "second reminder")
            .ordering_key("order-1")
            .deliver_at(OffsetDateTime::now_utc() - time::Duration::hours(1)),
    )
    .await;
    schedule(
        pool,
        Message::bytes("orders", "unrelated")
            .ordering_key("order-2")
            .deliver_at(OffsetDateTime::now_utc() - time::Duration::hours(1)),
    )
    .await;
    let mut producer = pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut producer,
            Message::bytes("orders", "refunded").ordering_key("order-1"),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), relay(pool).drain())
        .await
        .expect("a producer in flight does not hold the relay")
        .unwrap();
    assert_eq!(
        queued(pool, "orders").await,
        ["paid", "reminder", "shipped", "unrelated"],
        "the other key's message went; the held key's waits"
    );
    assert_eq!(
        pending(pool).await,
        1,
        "the held key's message is still scheduled"
    );
    producer.commit().await.unwrap();
    relay(pool).drain().await.unwrap();
    assert_eq!(
        queued(pool, "orders").await,
        [
            "paid",
            "reminder",
            "shipped",
            "unrelated",
            "refunded",
            "second reminder"
        ]
    );
    // Among scheduled messages of one key: due time, then scheduling order.
    let now = OffsetDateTime::now_utc() - time::Duration::minutes(5);
    let mut tx = pool.begin().await.unwrap();
    for (payload, at) in [
        ("c", now + time::Duration::seconds(2)),
        ("a", now),
        ("b", now),
    ] {
        outbox
            .enqueue(
                &mut tx,
                Message::bytes("due-order", payload)
                    .ordering_key("k")
                    .deliver_at(at),
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    relay(pool).drain().await.unwrap();
    assert_eq!(queued(pool, "due-order").await, ["a", "b", "c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_keys_replace_keep_the_due_time_keep_the_first_and_cancel_transactionally() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let outbox = Outbox::new();
    let row = |key: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (Uuid, Vec<u8>, OffsetDateTime)>(
                "SELECT message_id, payload, due_at FROM pgbox.outbox_scheduled \
                 WHERE topic = 't' AND schedule_key = $1",
            )
            .bind(key)
            .fetch_optional(&pool)
            .await
            .unwrap()
            .map(|(id, p, due)| (id, String::from_utf8(p).unwrap(), due))
        }
    };
    let at = |minutes| OffsetDateTime::now_utc() + time::Duration::minutes(minutes);
    let keyed = |key: &str, payload: &str, minutes, conflict| {
        Message::bytes("t", payload.to_owned())
            .schedule_key(key)
            .deliver_at(at(minutes))
            .on_schedule_conflict(conflict)
    };

    // Replace (debounce): new payload, new due time.
    schedule(pool, keyed("r", "r1", 10, ScheduleConflict::Replace)).await;
    let (_, _, first_due) = row("r").await.unwrap();
    let id = schedule(pool, keyed("r", "r2", 20, ScheduleConflict::Replace)).await;
    let (got, payload, due) = row("r").await.unwrap();
    assert_eq!((got, payload.as_str()), (id, "r2"));
    assert!(due > first_due + time::Duration::minutes(9));

    // Replace keeping the due time (throttle).
    schedule(pool, keyed("k", "k1", 10, ScheduleConflict::Replace)).await;
    let (_, _, kept) = row("k").await.unwrap();
    let id = schedule(
        pool,
        keyed("k", "k2", 30, ScheduleConflict::ReplaceKeepDueTime),
    )
    .await;
    assert_eq!(row("k").await.unwrap(), (id, "k2".to_owned(), kept));

    // Keep the existing one (first wins): enqueue returns the pending message's id.
    let first = schedule(pool, keyed("e", "e1", 10, ScheduleConflict::Replace)).await;
    let got = schedule(pool, keyed("e", "e2", 1, ScheduleConflict::KeepExisting)).await;
    assert_eq!(got, first);
    assert_eq!(row("e").await.unwrap().1, "e1");

    // A replace rolled back leaves the pending message as it was.
    let before = row("r").await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, keyed("r", "r3", 40, ScheduleConflict::Replace))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(row("r").await.unwrap(), before);

    // Cancel: rolled back, nothing changes; committed, it is gone; again: false.
    let mut tx = pool.begin().await.unwrap();
    assert!(outbox.cancel_scheduled(&mut tx, "t", "r").await.unwrap());
    tx.rollback().await.unwrap();
    assert!(row("r").await.is_some());
    let mut tx = pool.begin().await.unwrap();
    assert!(outbox.cancel_scheduled(&mut tx, "t", "r").await.unwrap());
    assert!(!outbox.cancel_scheduled(&mut tx, "t", "r").await.unwrap());
    tx.commit().await.unwrap();
    assert!(row("r").await.is_none());
    // Another topic's key of the same name is another key.
    let mut tx = pool.begin().await.unwrap();
    assert!(
        !outbox
            .cancel_scheduled(&mut tx, "other", "k")
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();

    // Reschedule into the past: due now, published.
    let mut tx = pool.begin().await.unwrap();
    assert!(
        outbox
            .reschedule(&mut tx, "t", "k", OffsetDateTime::UNIX_EPOCH)
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    relay(pool).drain().await.unwrap();
    assert_eq!(queued(pool, "t").await, ["k2"]);
    // Promoted: no longer pending, so a cancel finds nothing and a new one is scheduled
    // anew.
    let mut tx = pool.begin().await.unwrap();
    assert!(!outbox.cancel_scheduled(&mut tx, "t", "k").await.unwrap());
    tx.commit().await.unwrap();
    schedule(pool, keyed("k", "k3", 10, ScheduleConflict::KeepExisting)).await;
    assert_eq!(row("k").await.unwrap().1, "k3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tasks_replacing_one_schedule_key_leave_exactly_one_pending_and_no_error() {
    let db = TestDb::migrated().await;
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                let outbox = Outbox::new();
                for j in 0..5 {
                    let conflict = match (i + j) % 3 {
                        0 => ScheduleConflict::Replace,
                        1 => ScheduleConflict::ReplaceKeepDueTime,
                        _ => ScheduleConflict::KeepExisting,
                    };
                    let mut tx = pool.begin().await.unwrap();
                    outbox
                        .enqueue(
                            &mut tx,
                            Message::bytes("debounce", format!("{i}-{j}"))
                                .schedule_key("user-7")
                                .deliver_after(Duration::from_secs(60))
                                .on_schedule_conflict(conflict),
                        )
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(pending(&db.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_promoting_at_once_neither_double_nor_lose() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let past = OffsetDateTime::now_utc() - time::Duration::minutes(1);
    let mut tx = pool.begin().await.unwrap();
    let messages = (0..3000).map(|i| {
        let m = Message::bytes("many", format!("{i}")).deliver_at(past);
        if i % 3 == 0 {
            m.ordering_key(format!("key-{}", i % 7))
        } else {
            m
        }
    });
    let ids = Outbox::new()
        .enqueue_batch(&mut tx, messages)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids.len(), 3000);
    let small = |pool: &PgPool| {
        Relay::builder(pool.clone(), PgQueue::new(pool.clone()))
            .batch_size(100)
            .build()
            .unwrap()
    };
    let (a, b) = (small(pool), small(pool));
    let (ra, rb) = tokio::join!(a.drain(), b.drain());
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.published + rb.published, 3000, "{ra:?} {rb:?}");
    assert_eq!(pending(pool).await, 0);
    assert_eq!(scalar(pool, "SELECT count(*) FROM pgbox.queue").await, 3000);
    assert_eq!(
        scalar(pool, "SELECT count(DISTINCT message_id) FROM pgbox.queue").await,
        3000
    );
    let kept: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgbox.queue WHERE message_id = ANY($1)")
            .bind(&ids)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(kept, 3000, "every id kept through promotion");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_connection_drops_in_promotion_moves_nothing_and_the_next_moves_it_once() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    schedule(
        pool,
        Message::bytes("crash", "due")
            .ordering_key("k")
            .deliver_at(OffsetDateTime::UNIX_EPOCH),
    )
    .await;
    // Hold the outbox table against writes: the promotion statement, which inserts into it,
    // stops inside, waiting for the lock.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE pgbox.outbox IN SHARE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let promoting = tokio::spawn({
        let pool = pool.clone();
        async move { relay(&pool).relay_once().await }
    });
    support::wait_for_lock_waiter(pool).await;
    // Drop the promoting relay's connection mid-statement.
    let killed: i64 = scalar(
        pool,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
    )
    .await;
    assert_eq!(killed, 1);
    assert!(promoting.await.unwrap().is_err(), "the round failed");
    holder.rollback().await.unwrap();
    assert_eq!(pending(pool).await, 1, "nothing was moved");
    assert_eq!(scalar(pool, "SELECT count(*) FROM pgbox.outbox").await, 0);
    relay(pool).drain().await.unwrap();
    assert_eq!(queued(pool, "crash").await, ["due"]);
    assert_eq!(pending(pool).await, 0);
    assert_eq!(scalar(pool, "SELECT count(*) FROM pgbox.outbox").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_replace_racing_promotion_first_commit_wins_and_nothing_is_lost() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let outbox = Outbox::new();
    let due_now = |payload: &str| {
        Message::bytes("race", payload.to_owned())
            .schedule_key("s")
            .deliver_at(OffsetDateTime::UNIX_EPOCH)
    };
    // Cancel first (uncommitted): promotion skips the locked row; the cancel commits; nothing
    // is published.
    schedule(pool, due_now("cancelled")).await;
    let mut tx = pool.begin().await.unwrap();
    assert!(outbox.cancel_scheduled(&mut tx, "race", "s").await.unwrap());
    relay(pool).drain().await.unwrap();
    tx.commit().await.unwrap();
    relay(pool).drain().await.unwrap();
    assert!(queued(pool, "race").await.is_empty());
    // Promotion first: the cancel finds nothing.
    schedule(pool, due_now("promoted")).await;
    relay(pool).drain().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(!outbox.cancel_scheduled(&mut tx, "race", "s").await.unwrap());
    tx.commit().await.unwrap();
    assert_eq!(queued(pool, "race").await, ["promoted"]);
    // A replace waiting on a row being taken off (as a promotion does) is scheduled anew
    // once that commits: neither is lost.
    schedule(
        pool,
        Message::bytes("race", "old")
            .schedule_key("s")
            .deliver_after(Duration::from_secs(3600)),
    )
    .await;
    let mut taker = pool.begin().await.unwrap();
    sqlx::query("DELETE FROM pgbox.outbox_scheduled WHERE schedule_key = 's'")
        .execute(&mut *taker)
        .await
        .unwrap();
    let replacing = tokio::spawn({
        let pool = pool.clone();
        async move {
            schedule(
                &pool,
                Message::bytes("race", "new")
                    .schedule_key("s")
                    .deliver_after(Duration::from_secs(3600)),
            )
            .await
        }
    });
    support::wait_for_lock_waiter(pool).await;
    taker.commit().await.unwrap();
    let id = replacing.await.unwrap();
    let pending_id: Uuid = sqlx::query_scalar(
        "SELECT message_id FROM pgbox.outbox_scheduled WHERE schedule_key = 's'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(pending_id, id);
}

#[tokio::test]
async fn bad_schedules_are_refused_before_any_sql_and_the_transaction_stays_usable() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    let later = |m: Message| m.deliver_after(Duration::from_secs(1));
    let bad = [
        (later(Message::bytes("t", "x").schedule_key("")), "empty"),
        (later(Message::bytes("t", "x").schedule_key("a\0b")), "nul"),
        (
            later(Message::bytes("t", "x").schedule_key("k".repeat(pgbox::MAX_KEY_BYTES + 1))),
            "long",
        ),
        (
            Message::bytes("t", "x").deliver_after(Duration::from_secs(101 * 365 * 86_400)),
            "huge",
        ),
        (Message::bytes("t", "x").schedule_key("k"), "no due time"),
        (
            Message::bytes("t", "x").on_schedule_conflict(ScheduleConflict::KeepExisting),
            "no due time",
        ),
    ];
    for (m, what) in bad {
        let err = outbox.enqueue(&mut tx, m).await.unwrap_err();
        match what {
            "empty" => assert!(matches!(err, Error::EmptyKey), "{err:?}"),
            "nul" => assert!(matches!(err, Error::KeyContainsNul { .. }), "{err:?}"),
            "long" => assert!(matches!(err, Error::KeyTooLong { .. }), "{err:?}"),
            _ => assert!(matches!(err, Error::InvalidField { .. }), "{what}: {err:?}"),
        }
    }
    assert!(matches!(
        outbox.cancel_scheduled(&mut tx, "t", "").await,
        Err(Error::EmptyKey)
    ));
    // Still usable: a schedule in the distant past is due now, the maximum delay is taken.
    outbox
        .enqueue(
            &mut tx,
            Message::bytes("t", "ancient").deliver_at(OffsetDateTime::new_utc(
                time::Date::from_calendar_date(-9999, time::Month::January, 1).unwrap(),
                time::Time::MIDNIGHT,
            )),
        )
        .await
        .unwrap();
    outbox
        .enqueue(
            &mut tx,
            Message::bytes("t", "far").deliver_after(pgbox::MAX_SCHEDULE_DELAY),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    relay(&db.pool).drain().await.unwrap();
    assert_eq!(queued(&db.pool, "t").await, ["ancient"]);
    let status = pgbox::status(&db.pool, "pgbox").await.unwrap();
    assert_eq!(status.scheduled, 1);
    assert!(status.next_scheduled_due.unwrap() > status.taken_at + time::Duration::days(36_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_role_of_grant_to_schedules_replaces_cancels_and_promotes() {
    use sqlx::{Connection, Executor};
    let db = TestDb::empty().await;
    let role = format!(
        "pgbox_sched_{}",
        &uuid::Uuid::now_v7().simple().to_string()[16..]
    );
    let server = support::server_url().await;
    let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE ROLE \"{role}\" LOGIN")))
        .await
        .unwrap();
    let (owner, options, app_role) = (db.pool.clone(), db.options.clone(), role.clone());
    let outcome = async move {
        pgbox::Migrator::new()
            .grant_to(&app_role)
            .unwrap()
            .run(&owner)
            .await
            .unwrap();
        let app = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options.username(&app_role))
            .await
            .unwrap();
        let outbox = Outbox::new();
        let mut tx = app.begin().await.unwrap();
        for payload in ["first", "second"] {
            outbox
                .enqueue(
                    &mut tx,
                    Message::bytes("app", payload)
                        .schedule_key("s")
                        .deliver_after(Duration::from_secs(3600)),
                )
                .await
                .unwrap();
        }
        assert!(
            outbox
                .reschedule(&mut tx, "app", "s", OffsetDateTime::UNIX_EPOCH)
                .await
                .unwrap()
        );
        outbox
            .enqueue(
                &mut tx,
                Message::bytes("app", "cancelled")
                    .schedule_key("c")
                    .deliver_after(Duration::ZERO),
            )
            .await
            .unwrap();
        assert!(outbox.cancel_scheduled(&mut tx, "app", "c").await.unwrap());
        tx.commit().await.unwrap();
        relay(&app).drain().await.unwrap();
        assert_eq!(queued(&app, "app").await, ["second"]);
        let status = pgbox::status(&app, "pgbox").await.unwrap();
        assert_eq!(status.scheduled, 0);
        app.close().await;
    };
    let result = tokio::spawn(outcome).await;
    // Clean up what this test created, whatever happened.
    db.pool
        .execute(sqlx::AssertSqlSafe(format!("DROP OWNED BY \"{role}\"")))
        .await
        .unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("DROP ROLE \"{role}\"")))
        .await
        .unwrap();
    result.unwrap();
}
