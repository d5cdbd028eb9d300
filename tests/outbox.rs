//! Outbox → relay → Postgres transport → consumer → inbox, on a real PostgreSQL.

mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    CancellationToken, Consumer, DeadLetters, Envelope, Error, Inbox, Message, Outbox, Relay,
    RetryPolicy, WakeUp,
};
use sqlx::{Executor, PgPool};
use support::TestDb;

#[derive(serde::Serialize, serde::Deserialize)]
struct Step {
    key: String,
    n: i64,
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Polls `cond` every 20 ms until it holds; panics after `limit`.
async fn eventually<F: AsyncFnMut() -> bool>(limit: Duration, what: &str, mut cond: F) {
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_messages_take_effect_once_each_in_per_key_order() {
    support::init_tracing();
    const KEYS: i64 = 100;
    const PER_KEY: i64 = 100;
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (n bigserial, message_id uuid, key text, step bigint)")
        .await
        .unwrap();

    // Producers: 100 transactions of 100 messages, keys interleaved.
    let outbox = Outbox::new();
    for n in 0..PER_KEY {
        let mut tx = db.pool.begin().await.unwrap();
        let batch = (0..KEYS).map(|k| {
            let key = format!("key-{k}");
            Message::json(
                "steps",
                &Step {
                    key: key.clone(),
                    n,
                },
            )
            .unwrap()
            .ordering_key(key)
        });
        outbox.enqueue_batch(&mut tx, batch).await.unwrap();
        tx.commit().await.unwrap();
    }

    // Each relay and consumer is its own "service instance" with its own pool.
    let pool_of = async |n: u32| {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(n)
            .connect_with(db.options.clone())
            .await
            .unwrap()
    };
    let shutdown = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let pool = pool_of(2).await;
        let relay = Relay::builder(pool.clone(), PgQueue::new(pool))
            .batch_size(200)
            .poll_interval(Duration::from_millis(200))
            .build()
            .unwrap();
        let s = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            relay.run(s).await.unwrap();
            None
        }));
    }
    for _ in 0..3 {
        let pool = pool_of(6).await;
        let consumer = Consumer::builder(
            pool.clone(),
            PgQueue::new(pool),
            "steps",
            Inbox::new("effects").unwrap(),
        )
        .concurrency(4)
        .poll_interval(Duration::from_millis(200))
        .build()
        .unwrap();
        let s = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            let stats = consumer
                .run(
                    async |envelope: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                        let step: Step = envelope.json()?;
                        sqlx::query(
                            "INSERT INTO effects (message_id, key, step) VALUES ($1, $2, $3)",
                        )
                        .bind(envelope.id)
                        .bind(&step.key)
                        .bind(step.n)
                        .execute(&mut *conn)
                        .await
                        .map_err(Error::from)?;
                        Ok::<(), Error>(())
                    },
                    s,
                )
                .await
                .unwrap();
            Some(stats)
        }));
    }
    let total = KEYS * PER_KEY;
    eventually(Duration::from_secs(300), "all effects", async || {
        count(&db.pool, "SELECT count(*) FROM effects").await >= total
    })
    .await;
    shutdown.cancel();
    let mut processed = 0;
    for t in tasks {
        if let Some(stats) = t.await.unwrap() {
            processed += stats.processed;
        }
    }
    assert_eq!(processed as i64, total);
    assert_eq!(count(&db.pool, "SELECT count(*) FROM effects").await, total);
    assert_eq!(
        count(&db.pool, "SELECT count(DISTINCT message_id) FROM effects").await,
        total
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        0
    );
    assert_eq!(count(&db.pool, "SELECT count(*) FROM pgbox.queue").await, 0);
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key, step FROM effects ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (k, n) in rows {
        per_key.entry(k).or_default().push(n);
    }
    let expected: Vec<i64> = (0..PER_KEY).collect();
    for (key, steps) in per_key {
        assert_eq!(steps, expected, "{key} took effect out of enqueue order");
    }
}

/// Records what it was asked to publish; can be told to fail some messages.
#[derive(Default, Clone)]
struct Recorder {
    published: Arc<Mutex<Vec<Envelope>>>,
    poison: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl Publisher for Recorder {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let poison = self.poison.load(Ordering::SeqCst);
        batch
            .iter()
            .map(|e| {
                if poison && e.payload == b"poison" {
                    Err(PublishError::refused("broker refused it"))
                } else {
                    self.published.lock().unwrap().push(e.clone());
                    Ok(())
                }
            })
            .collect()
    }
}

async fn enqueue(pool: &PgPool, messages: Vec<Message>) -> Vec<uuid::Uuid> {
    let mut tx = pool.begin().await.unwrap();
    let ids = Outbox::new()
        .enqueue_batch(&mut tx, messages)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    ids
}

#[tokio::test]
async fn rolled_back_messages_never_appear() {
    let db = TestDb::migrated().await;
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("t", "never"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let recorder = Recorder::default();
    let relay = Relay::builder(db.pool.clone(), recorder.clone())
        .build()
        .unwrap();
    let report = relay.relay_once().await.unwrap();
    assert_eq!(report.claimed, 0);
    assert!(recorder.published.lock().unwrap().is_empty());
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        0
    );
}

/// A publisher that never returns: the relay is stuck mid-batch, holding its claim.
struct Stuck(Arc<tokio::sync::Notify>);
impl Publisher for Stuck {
    async fn publish(&self, _batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.notify_one();
        std::future::pending().await
    }
}

#[tokio::test]
async fn a_relay_aborted_mid_batch_loses_nothing() {
    let db = TestDb::migrated().await;
    let ids = enqueue(
        &db.pool,
        (0..50)
            .map(|i| Message::bytes("t", format!("m{i}")).ordering_key(format!("k{}", i % 5)))
            .collect(),
    )
    .await;
    let entered = Arc::new(tokio::sync::Notify::new());
    let stuck = Relay::builder(db.pool.clone(), Stuck(entered.clone()))
        .build()
        .unwrap();
    let task = tokio::spawn(async move { stuck.relay_once().await });
    entered.notified().await;
    // While the stuck relay holds its batch, a second relay finds nothing of it.
    let recorder = Recorder::default();
    let relay = Relay::builder(db.pool.clone(), recorder.clone())
        .build()
        .unwrap();
    assert_eq!(relay.relay_once().await.unwrap().claimed, 0);
    task.abort();
    let _ = task.await;
    // Its transaction rolled back; everything is published by the live relay.
    eventually(Duration::from_secs(30), "republish", async || {
        relay.relay_once().await.unwrap();
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await == 0
    })
    .await;
    let published: HashSet<_> = recorder
        .published
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(published, ids.into_iter().collect());
}

/// Publishes, but first kills its own relay's connection (the relay is idle in transaction
/// while it publishes).
#[derive(Clone)]
struct Saboteur {
    admin: PgPool,
    armed: Arc<AtomicBool>,
    inner: Recorder,
}
impl Publisher for Saboteur {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        if self.armed.swap(false, Ordering::SeqCst) {
            let killed: i64 = sqlx::query_scalar(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND state = 'idle in transaction'",
            )
            .fetch_one(&self.admin)
            .await
            .unwrap();
            assert_eq!(killed, 1, "expected to find the relay's transaction");
        }
        self.inner.publish(batch).await
    }
}

#[tokio::test]
async fn a_relay_whose_connection_is_terminated_mid_batch_loses_nothing() {
    let db = TestDb::migrated().await;
    let ids = enqueue(
        &db.pool,
        (0..30)
            .map(|i| Message::bytes("t", format!("m{i}")))
            .collect(),
    )
    .await;
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let saboteur = Saboteur {
        admin: db.pool.clone(),
        armed: Arc::new(AtomicBool::new(true)),
        inner: Recorder::default(),
    };
    let relay = Relay::builder(relay_pool, saboteur.clone())
        .build()
        .unwrap();
    let err = relay
        .relay_once()
        .await
        .expect_err("the connection was terminated");
    assert!(err.is_retryable(), "{err}");
    // Everything is still there, and the next round publishes it (again).
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        30
    );
    eventually(Duration::from_secs(30), "republish", async || {
        let _ = relay.relay_once().await;
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await == 0
    })
    .await;
    let published: Vec<_> = saboteur
        .inner
        .published
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(
        published.len(),
        60,
        "the first batch was published, then published again"
    );
    let unique: HashSet<_> = published.into_iter().collect();
    assert_eq!(unique, ids.into_iter().collect());
}

#[tokio::test]
async fn a_poison_message_is_dead_lettered_holds_its_key_and_replays_in_order() {
    let db = TestDb::migrated().await;
    let mut messages = vec![
        Message::bytes("t", "a1").ordering_key("a"),
        Message::bytes("t", "poison").ordering_key("a"),
        Message::bytes("t", "a3").ordering_key("a"),
        Message::bytes("t", "a4").ordering_key("a"),
    ];
    messages.extend((1..=5).map(|i| Message::bytes("t", format!("b{i}")).ordering_key("b")));
    let ids = enqueue(&db.pool, messages).await;
    let recorder = Recorder::default();
    recorder.poison.store(true, Ordering::SeqCst);
    let relay = Relay::builder(db.pool.clone(), recorder.clone())
        .max_attempts(3)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5)),
        )
        .build()
        .unwrap();
    let dead_letters = DeadLetters::new(db.pool.clone());
    eventually(Duration::from_secs(30), "dead letter", async || {
        relay.relay_once().await.unwrap();
        !dead_letters.list(10).await.unwrap().is_empty()
    })
    .await;
    // Other keys keep flowing while the poison holds key "a".
    for _ in 0..20 {
        relay.relay_once().await.unwrap();
    }
    let bodies = |r: &Recorder| -> Vec<String> {
        r.published
            .lock()
            .unwrap()
            .iter()
            .map(|e| String::from_utf8(e.payload.clone()).unwrap())
            .collect()
    };
    assert_eq!(bodies(&recorder), ["a1", "b1", "b2", "b3", "b4", "b5"]);
    let dead = dead_letters.list(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, ids[1]);
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].last_error.as_deref(), Some("broker refused it"));
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        2,
        "a3 and a4 are held"
    );

    // The broker is fixed; replay publishes the poison message, then the held ones, in order.
    recorder.poison.store(false, Ordering::SeqCst);
    assert_eq!(dead_letters.replay(&[ids[1]]).await.unwrap(), 1);
    eventually(Duration::from_secs(30), "drain", async || {
        relay.relay_once().await.unwrap();
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await == 0
    })
    .await;
    assert_eq!(
        bodies(&recorder),
        ["a1", "b1", "b2", "b3", "b4", "b5", "poison", "a3", "a4"]
    );
    assert!(dead_letters.list(10).await.unwrap().is_empty());
    let republished = recorder.published.lock().unwrap()[6].id;
    assert_eq!(
        republished, ids[1],
        "the message id survives dead-lettering and replay"
    );

    // Discard releases a key without publishing.
    recorder.poison.store(true, Ordering::SeqCst);
    let more = enqueue(
        &db.pool,
        vec![
            Message::bytes("t", "poison").ordering_key("c"),
            Message::bytes("t", "c2").ordering_key("c"),
        ],
    )
    .await;
    eventually(Duration::from_secs(30), "dead letter", async || {
        relay.relay_once().await.unwrap();
        !dead_letters.list(10).await.unwrap().is_empty()
    })
    .await;
    assert_eq!(dead_letters.discard(&[more[0]]).await.unwrap(), 1);
    relay.relay_once().await.unwrap();
    assert_eq!(bodies(&recorder).last().map(String::as_str), Some("c2"));
}

#[tokio::test]
async fn an_idle_relay_wakes_on_notify_long_before_its_poll_interval() {
    let db = TestDb::migrated().await;
    for (wake_up, poll) in [
        (WakeUp::Notify, Duration::from_secs(60)),
        (WakeUp::Poll, Duration::from_millis(300)),
    ] {
        let recorder = Recorder::default();
        let relay = Relay::builder(db.pool.clone(), recorder.clone())
            .wake_up(wake_up)
            .poll_interval(poll)
            .build()
            .unwrap();
        let shutdown = CancellationToken::new();
        let s = shutdown.clone();
        let task = tokio::spawn(async move { relay.run(s).await });
        // Let the relay go idle (first drain done, listening).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        enqueue(&db.pool, vec![Message::bytes("t", "hello")]).await;
        eventually(Duration::from_secs(20), "publish", async || {
            !recorder.published.lock().unwrap().is_empty()
        })
        .await;
        let latency = started.elapsed();
        eprintln!("{wake_up:?}: committed → published in {latency:?}");
        // Loose bounds; precise figures belong to the benchmark. With a 60 s poll interval,
        // anything under 10 s can only be the notification.
        assert!(
            latency < Duration::from_secs(10),
            "{wake_up:?} took {latency:?}"
        );
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn status_reports_backlog_age_and_dead_letters_per_topic() {
    let db = TestDb::migrated().await;
    let empty = pgbox::status(&db.pool, "pgbox").await.unwrap();
    assert!(empty.topics.is_empty());

    enqueue(
        &db.pool,
        (0..5)
            .map(|i| Message::bytes("orders", format!("o{i}")))
            .collect(),
    )
    .await;
    enqueue(
        &db.pool,
        vec![Message::bytes("refunds", "poison").ordering_key("r")],
    )
    .await;
    let recorder = Recorder::default();
    recorder.poison.store(true, Ordering::SeqCst);
    let relay = Relay::builder(db.pool.clone(), recorder.clone())
        .max_attempts(1)
        .batch_size(2)
        .build()
        .unwrap();
    relay.relay_once().await.unwrap(); // publishes o0, o1 only (batch of 2)

    let status = pgbox::status(&db.pool, "pgbox").await.unwrap();
    let topics: Vec<_> = status.topics.iter().map(|t| t.topic.as_str()).collect();
    assert_eq!(topics, ["orders", "refunds"]);
    let orders = &status.topics[0];
    assert_eq!(orders.outbox_backlog_estimate, 3);
    assert!(orders.outbox_oldest_pending.unwrap() <= status.taken_at);
    assert_eq!(orders.outbox_dead_letters, 0);
    relay.relay_once().await.unwrap();
    relay.relay_once().await.unwrap();
    let status = pgbox::status(&db.pool, "pgbox").await.unwrap();
    let refunds = status.topics.iter().find(|t| t.topic == "refunds").unwrap();
    assert_eq!(refunds.outbox_dead_letters, 1);
    assert_eq!(refunds.outbox_backlog_estimate, 0);
    assert!(matches!(
        pgbox::status(&db.pool, "Bad Schema").await,
        Err(Error::InvalidIdentifier { .. })
    ));
}

#[tokio::test]
async fn trace_context_travels_from_a_consumed_message_to_the_messages_it_causes() {
    let db = TestDb::migrated().await;
    let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    // A message arrives in the queue carrying a trace.
    let recorder = Recorder::default();
    enqueue(
        &db.pool,
        vec![Message::bytes("orders", "o1").header("traceparent", incoming)],
    )
    .await;
    let relay = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .build()
        .unwrap();
    relay.relay_once().await.unwrap();

    // Its handler enqueues a follow-up in the same transaction.
    let consumer = Consumer::builder(
        db.pool.clone(),
        PgQueue::new(db.pool.clone()),
        "orders",
        Inbox::new("c").unwrap(),
    )
    .poll_interval(Duration::from_millis(50))
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let run = tokio::spawn(async move {
        consumer
            .run(
                async |_m: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                    // Through the handler's own connection, in the inbox's transaction.
                    Outbox::new()
                        .enqueue(conn, Message::bytes("invoices", "i1"))
                        .await?;
                    Ok::<(), Error>(())
                },
                s,
            )
            .await
    });
    let follow_up = Relay::builder(db.pool.clone(), recorder.clone())
        .build()
        .unwrap();
    eventually(Duration::from_secs(20), "follow-up", async || {
        follow_up.relay_once().await.unwrap();
        !recorder.published.lock().unwrap().is_empty()
    })
    .await;
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let published = recorder.published.lock().unwrap()[0].clone();
    let traceparent = published
        .headers
        .get(pgbox::TRACEPARENT)
        .expect("propagated");
    assert!(
        traceparent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
        "{traceparent}"
    );
    assert_ne!(traceparent, incoming, "a new parent id for the new hop");

    // Outside any span and handler: no header. An explicit header is kept as given.
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("x", "plain"))
        .await
        .unwrap();
    Outbox::new()
        .enqueue(
            &mut tx,
            Message::bytes("x", "explicit").header("traceparent", incoming),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let headers: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), headers->>'traceparent' FROM pgbox.outbox WHERE topic = 'x' ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        headers,
        vec![
            ("plain".into(), None),
            ("explicit".into(), Some(incoming.into()))
        ]
    );
}

/// Consume → produce in one transaction: a handler enqueues through its own
/// `HandlerConnection` (no savepoint). A handler that fails after enqueuing leaves no message;
/// one that succeeds leaves exactly one, committed with its inbox row.
#[tokio::test]
async fn a_handler_enqueues_through_its_connection_in_the_inbox_transaction() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("chain").unwrap();
    let outbox = Outbox::new();

    let mut tx = db.pool.begin().await.unwrap();
    let failed = inbox
        .process(&mut tx, "order-1", async |conn| -> Result<(), Error> {
            outbox
                .enqueue(conn, Message::bytes("invoices", "first try"))
                .await?;
            Err(Error::InvalidConfig(
                "the handler fails after enqueuing".into(),
            ))
        })
        .await;
    assert!(failed.is_err());
    tx.rollback().await.unwrap();
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        0
    );

    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "order-1", async |conn| -> Result<(), Error> {
            outbox
                .enqueue_batch(
                    conn,
                    ["a", "b"].map(|p| Message::bytes("invoices", p).ordering_key("order-1")),
                )
                .await?;
            Ok(())
        })
        .await
        .unwrap();
    assert!(outcome.is_processed());
    // Nothing visible before the commit, both after it.
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        0
    );
    tx.commit().await.unwrap();
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        2
    );
}

/// Another topic's traffic between two pending messages of a topic is not that topic's
/// backlog (found by the attack on the alert rules: 2 pending messages around 5,000 of
/// another topic were reported as a backlog of 5,002, and the backlog alert advised scaling
/// the relay).
#[tokio::test]
async fn status_counts_a_topics_backlog_not_the_traffic_of_others_between() {
    let db = TestDb::migrated().await;
    enqueue(&db.pool, vec![Message::bytes("slow", "first")]).await;
    enqueue(
        &db.pool,
        (0..2_000)
            .map(|i| Message::bytes("busy", format!("b{i}")))
            .collect(),
    )
    .await;
    enqueue(&db.pool, vec![Message::bytes("slow", "second")]).await;
    // The busy topic's messages are published (a relay that serves it keeps up).
    sqlx::query("UPDATE pgbox.outbox SET published_at = now() WHERE topic = 'busy'")
        .execute(&db.pool)
        .await
        .unwrap();
    let status = pgbox::status(&db.pool, "pgbox").await.unwrap();
    let slow = status.topics.iter().find(|t| t.topic == "slow").unwrap();
    assert_eq!(slow.outbox_backlog_estimate, 2, "{status:?}");
}
