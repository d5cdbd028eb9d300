//! The consumer runner with `batch_size`: many first deliveries through the inbox in one
//! transaction. The same adversarial matrix as the one-message path: duplicates inside a
//! batch, handler errors, panics and swallowed failures in the middle of a batch, nested
//! units and transaction control, every isolation level with concurrent runners on shared
//! keys, both inbox layouts, keys under a lease, a run dropped mid-batch, and runs dropped
//! at any moment (no transaction left open on the pool). Every check is
//! on what committed: effects and inbox records per key.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use pgbox::transport::{Delivery, PgQueue, Subscriber};
use pgbox::{
    Consumer, ConsumerStats, Envelope, Error, HandlerConnection, Inbox, InboxPartitioning,
    LeaseAttempt, Migrator,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgPool};
use support::TestDb;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "jobs";

/// Handler runs per business key, rolled-back runs included.
type Runs = Arc<Mutex<HashMap<String, usize>>>;

async fn enqueue(pool: &PgPool, payloads: &[String]) {
    support::enqueue_and_relay(pool, TOPIC, payloads).await;
}

fn oks(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}:ok")).collect()
}

fn split(e: &Envelope) -> (String, String) {
    let payload = String::from_utf8(e.payload.clone()).unwrap();
    let (key, behaviour) = payload.split_once(':').unwrap();
    (key.to_owned(), behaviour.to_owned())
}

async fn write(conn: &mut sqlx::PgConnection, key: &str, what: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO effects (key, what) VALUES ($1, $2)")
        .bind(key)
        .bind(what)
        .execute(conn)
        .await?;
    Ok(())
}

/// The test handler: what it does is named by the payload's behaviour.
async fn handle(e: &Envelope, conn: &mut HandlerConnection<'_>, runs: &Runs) -> anyhow::Result<()> {
    let (key, behaviour) = split(e);
    let run = {
        let mut runs = runs.lock().unwrap();
        let n = runs.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    match behaviour.as_str() {
        "ok" => write(conn, &key, "outer").await?,
        "poison" => {
            write(conn, &key, "outer").await?;
            return Err(anyhow!("poison message {key}"));
        }
        "panic" => {
            write(conn, &key, "outer").await?;
            panic!("handler panics on {key}");
        }
        "fail-once" => {
            write(conn, &key, "outer").await?;
            anyhow::ensure!(run > 1, "first run of {key} fails");
        }
        // A failed statement whose error the handler swallows.
        "swallow" => {
            let _ = sqlx::raw_sql("SELECT 1/0").execute(&mut *conn).await;
            write(conn, &key, "outer").await.ok();
        }
        "nested-commit-then-error" if run == 1 => {
            let mut nested = conn.begin().await?;
            write(&mut nested, &key, "nested").await?;
            nested.commit().await?;
            return Err(anyhow!("fails after its nested unit committed"));
        }
        "nested-rollback" => {
            let mut nested = conn.begin().await?;
            write(&mut nested, &key, "nested").await?;
            nested.rollback().await?;
            write(conn, &key, "outer").await?;
        }
        "commit-through-the-wrapper" if run == 1 => {
            sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
            write(conn, &key, "outer").await?;
        }
        "commit-behind-the-wrapper" if run == 1 => {
            sqlx::raw_sql("COMMIT").execute(&mut **conn).await?;
        }
        "slow" => {
            write(conn, &key, "outer").await?;
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        _ => write(conn, &key, "outer").await?,
    }
    Ok(())
}

/// A batched consumer of the queue, keyed by the payload's key; 3 deliveries at most.
fn consumer(pool: &PgPool, inbox: Inbox, batch: usize, concurrency: usize) -> Consumer<PgQueue> {
    builder(pool, inbox, batch, concurrency).build().unwrap()
}

fn builder(
    pool: &PgPool,
    inbox: Inbox,
    batch: usize,
    concurrency: usize,
) -> pgbox::ConsumerBuilder<PgQueue> {
    builder_on(pool, PgQueue::new(pool.clone()), inbox, batch, concurrency)
}

/// As [`builder`], with the queue on a pool of its own.
fn builder_on(
    pool: &PgPool,
    queue: PgQueue,
    inbox: Inbox,
    batch: usize,
    concurrency: usize,
) -> pgbox::ConsumerBuilder<PgQueue> {
    Consumer::builder(pool.clone(), queue, TOPIC, inbox)
        .batch_size(batch)
        .concurrency(concurrency)
        .max_deliveries(3)
        .visibility_timeout(Duration::from_secs(60))
        .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
        .poll_interval(Duration::from_millis(20))
        .key(|e: &Envelope| split(e).0)
}

fn spawn<S: Subscriber + 'static>(
    consumer: Consumer<S>,
    runs: Runs,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<pgbox::Result<ConsumerStats>> {
    tokio::spawn(async move {
        consumer
            .run(
                async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                    handle(e, conn, &runs).await
                },
                shutdown,
            )
            .await
    })
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits (at most 60 s) until the queue holds nothing but `dead` dead letters.
async fn settle(pool: &PgPool, dead: i64) {
    let started = Instant::now();
    loop {
        let left = scalar(pool, "SELECT count(*) FROM pgbox.queue").await;
        let dead_now = scalar(pool, "SELECT count(*) FROM pgbox.queue_dead_letters").await;
        if left == 0 && dead_now == dead {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not settled in 60 s: {left} queued, {dead_now} dead letters (expected {dead})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn effects(pool: &PgPool, key: &str, what: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1 AND what = $2")
        .bind(key)
        .bind(what)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn records(pool: &PgPool, table: &str, key: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE consumer = 'batch' AND key = $1"
    )))
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn effects_table(pool: &PgPool) {
    pool.execute("CREATE TABLE effects (key text NOT NULL, what text NOT NULL)")
        .await
        .unwrap();
}

#[tokio::test]
async fn a_batch_commits_its_messages_together_and_each_exactly_once_on_both_layouts() {
    support::init_tracing();
    for partitioned in [false, true] {
        let db = TestDb::empty().await;
        let mut migrator = Migrator::new();
        if partitioned {
            migrator = migrator
                .partitioned_inbox(InboxPartitioning::every(Duration::from_secs(3600)).ahead(2));
        }
        migrator.run(&db.pool).await.unwrap();
        effects_table(&db.pool).await;
        let table = if partitioned {
            "pgbox.partitioned_inbox"
        } else {
            "pgbox.inbox"
        };
        // 50 keys, then 10 of them again under new message ids: duplicates, some in the
        // batch that holds their first delivery, uncommitted.
        let mut payloads = oks("k", 50);
        payloads.extend((0..10).map(|i| format!("k{}:ok", i * 5)));
        enqueue(&db.pool, &payloads).await;
        let inbox = Inbox::builder("batch")
            .partitioned(partitioned)
            .build()
            .unwrap();
        let runs = Runs::default();
        let shutdown = CancellationToken::new();
        let run = spawn(
            consumer(&db.pool, inbox, 16, 2),
            runs.clone(),
            shutdown.clone(),
        );
        settle(&db.pool, 0).await;
        let stats = support::stop_runner(shutdown, run, Duration::from_secs(30)).await;
        let ctx = format!("partitioned {partitioned}: {stats:?}");
        assert_eq!(stats.processed, 50, "{ctx}");
        assert_eq!(stats.duplicates, 10, "{ctx}");
        assert_eq!(stats.retried, 0, "{ctx}");
        for i in 0..50 {
            let key = format!("k{i}");
            assert_eq!(effects(&db.pool, &key, "outer").await, 1, "{ctx}: {key}");
            assert_eq!(records(&db.pool, table, &key).await, 1, "{ctx}: {key}");
        }
        // Batched: the 50 records came from a handful of transactions, not 50.
        let transactions = scalar(
            &db.pool,
            &format!("SELECT count(DISTINCT xmin::text) FROM {table} WHERE consumer = 'batch'"),
        )
        .await;
        assert!(transactions <= 12, "{ctx}: {transactions} transactions");
        assert!(runs.lock().unwrap().values().all(|n| *n == 1), "{ctx}");
    }
}

#[tokio::test]
async fn a_failing_message_rolls_its_batch_back_and_its_batch_mates_take_effect_once() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db.pool).await;
    let mut payloads = Vec::new();
    for (i, bad) in ["poison", "panic", "fail-once", "swallow"]
        .into_iter()
        .enumerate()
    {
        payloads.extend(oks(&format!("g{i}-"), 7));
        payloads.push(format!("{bad}:{bad}"));
    }
    payloads.extend(oks("tail-", 5));
    enqueue(&db.pool, &payloads).await;
    let runs = Runs::default();
    let shutdown = CancellationToken::new();
    let run = spawn(
        consumer(&db.pool, Inbox::new("batch").unwrap(), 16, 1),
        runs.clone(),
        shutdown.clone(),
    );
    // poison, panic and swallow fail every delivery: dead-lettered after 3.
    settle(&db.pool, 3).await;
    let stats = support::stop_runner(shutdown, run, Duration::from_secs(30)).await;
    let good: Vec<String> = payloads
        .iter()
        .map(|p| p.split_once(':').unwrap().0.to_owned())
        .filter(|k| !["poison", "panic", "swallow"].contains(&k.as_str()))
        .collect();
    assert_eq!(stats.processed, good.len() as u64, "{stats:?}");
    assert_eq!(stats.dead_lettered, 3, "{stats:?}");
    assert_eq!(stats.panicked, 3, "{stats:?}");
    for key in &good {
        assert_eq!(effects(&db.pool, key, "outer").await, 1, "{key}");
        assert_eq!(records(&db.pool, "pgbox.inbox", key).await, 1, "{key}");
    }
    for key in ["poison", "panic", "swallow"] {
        assert_eq!(effects(&db.pool, key, "outer").await, 0, "{key}");
        assert_eq!(records(&db.pool, "pgbox.inbox", key).await, 0, "{key}");
    }
    // The batch path ran and was rolled back: batch mates ahead of a failure ran twice,
    // and what their first run wrote is gone (one effect each, above).
    let runs = runs.lock().unwrap();
    let twice = good.iter().filter(|k| runs[*k] == 2).count();
    assert!(twice >= 7, "batch mates run again: {twice} ({runs:?})");
}

#[tokio::test]
async fn nested_units_and_transaction_control_inside_a_batch() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db.pool).await;
    let mut payloads = Vec::new();
    for (i, scenario) in [
        "nested-commit-then-error",
        "nested-rollback",
        "commit-through-the-wrapper",
        "commit-behind-the-wrapper",
    ]
    .into_iter()
    .enumerate()
    {
        payloads.extend(oks(&format!("g{i}-"), 4));
        payloads.push(format!("{scenario}:{scenario}"));
        payloads.extend(oks(&format!("h{i}-"), 3));
    }
    enqueue(&db.pool, &payloads).await;
    let runs = Runs::default();
    let shutdown = CancellationToken::new();
    let run = spawn(
        consumer(&db.pool, Inbox::new("batch").unwrap(), 32, 1),
        runs.clone(),
        shutdown.clone(),
    );
    settle(&db.pool, 0).await;
    let stats = support::stop_runner(shutdown, run, Duration::from_secs(30)).await;
    for p in &payloads {
        let key = p.split_once(':').unwrap().0;
        assert_eq!(records(&db.pool, "pgbox.inbox", key).await, 1, "{key}");
        if key.starts_with('g') || key.starts_with('h') {
            assert_eq!(effects(&db.pool, key, "outer").await, 1, "{key}");
        }
    }
    // A nested unit that committed inside a failed handler never commits.
    let key = "nested-commit-then-error";
    assert_eq!(effects(&db.pool, key, "nested").await, 0);
    assert_eq!(effects(&db.pool, key, "outer").await, 1);
    let key = "nested-rollback";
    assert_eq!(effects(&db.pool, key, "nested").await, 0);
    assert_eq!(effects(&db.pool, key, "outer").await, 1);
    // COMMIT through the handler's connection is refused before it reaches the server.
    assert_eq!(
        effects(&db.pool, "commit-through-the-wrapper", "outer").await,
        1
    );
    assert!(stats.retried >= 2, "{stats:?}");
    assert_eq!(
        stats.processed + stats.duplicates,
        payloads.len() as u64,
        "{stats:?}"
    );
}

#[tokio::test]
async fn concurrent_batched_runners_on_shared_keys_at_every_isolation_level() {
    support::init_tracing();
    for level in ["read committed", "repeatable read", "serializable"] {
        let db = TestDb::migrated().await;
        effects_table(&db.pool).await;
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    conn.execute(sqlx::AssertSqlSafe(format!(
                        "SET default_transaction_isolation = '{level}'"
                    )))
                    .await?;
                    Ok(())
                })
            })
            .connect_with(db.options.clone())
            .await
            .unwrap();
        // 40 keys, each in 4 messages: duplicates race between batches and runners.
        let payloads: Vec<String> = (0..4)
            .flat_map(|_| (0..40).map(|i| format!("s{i}:ok")))
            .collect();
        enqueue(&db.pool, &payloads).await;
        let runs = Runs::default();
        let shutdown = CancellationToken::new();
        let runners: Vec<_> = (0..2)
            .map(|_| {
                // Serialization failures and deadlocks cost deliveries: never dead-letter.
                // The inbox's transactions run at `level`; the queue's own statements at the
                // server's default (at serializable, a failed ack would strand its message
                // for the visibility timeout, which is not what this test is about).
                let queue = PgQueue::new(db.pool.clone());
                let consumer = builder_on(&pool, queue, Inbox::new("batch").unwrap(), 8, 3)
                    .max_deliveries(1000)
                    .build()
                    .unwrap();
                spawn(consumer, runs.clone(), shutdown.clone())
            })
            .collect();
        settle(&db.pool, 0).await;
        shutdown.cancel();
        let mut total = ConsumerStats::default();
        for run in runners {
            let s = support::stop_runner(shutdown.clone(), run, Duration::from_secs(30)).await;
            total.processed += s.processed;
            total.duplicates += s.duplicates;
        }
        assert_eq!(total.processed, 40, "{level}: {total:?}");
        assert_eq!(total.duplicates, 120, "{level}: {total:?}");
        for i in 0..40 {
            let key = format!("s{i}");
            assert_eq!(effects(&db.pool, &key, "outer").await, 1, "{level}: {key}");
            assert_eq!(
                records(&db.pool, "pgbox.inbox", &key).await,
                1,
                "{level}: {key}"
            );
        }
        pool.close().await;
    }
}

#[tokio::test]
async fn a_key_under_a_live_lease_waits_and_an_expired_one_is_taken_over_in_a_batch() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db.pool).await;
    let inbox = Inbox::new("batch").unwrap();
    let lease = |attempt: LeaseAttempt| match attempt {
        LeaseAttempt::Leased(lease) => lease,
        other => panic!("expected a lease, got {other:?}"),
    };
    let live = lease(
        inbox
            .lease(&db.pool, "live", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let _expired = lease(
        inbox
            .lease(&db.pool, "expired", Duration::from_millis(1))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut payloads = oks("a", 5);
    payloads.push("live:ok".into());
    payloads.extend(oks("b", 5));
    payloads.push("expired:ok".into());
    payloads.extend(oks("c", 5));
    enqueue(&db.pool, &payloads).await;
    let runs = Runs::default();
    let shutdown = CancellationToken::new();
    let consumer = builder(&db.pool, inbox.clone(), 32, 1)
        .max_deliveries(1000)
        .backoff(
            pgbox::RetryPolicy::new()
                .base_delay(Duration::from_millis(10))
                .max_delay(Duration::from_millis(50)),
        )
        .build()
        .unwrap();
    let run = spawn(consumer, runs.clone(), shutdown.clone());
    // Everything but the live lease's key takes effect; that one keeps coming back.
    let started = Instant::now();
    while scalar(&db.pool, "SELECT count(*) FROM effects").await < 16
        || scalar(&db.pool, "SELECT count(*) FROM pgbox.queue").await > 1
    {
        assert!(started.elapsed() < Duration::from_secs(30), "stuck");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(effects(&db.pool, "expired", "outer").await, 1);
    assert_eq!(effects(&db.pool, "live", "outer").await, 0);
    // The live lease's message is still there, coming back.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM pgbox.queue").await,
        1
    );
    // The holder finishes: the key's message is then a duplicate, acked without running.
    live.complete(&db.pool, &()).await.unwrap();
    settle(&db.pool, 0).await;
    let stats = support::stop_runner(shutdown, run, Duration::from_secs(30)).await;
    assert_eq!(stats.processed, 16, "{stats:?}");
    assert_eq!(stats.duplicates, 1, "{stats:?}");
    assert!(stats.retried >= 1, "{stats:?}");
    assert_eq!(effects(&db.pool, "live", "outer").await, 0);
    assert!(!runs.lock().unwrap().contains_key("live"));
}

#[tokio::test]
async fn a_run_dropped_mid_batch_commits_nothing_of_it_and_a_new_run_finishes_once() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db.pool).await;
    let mut payloads = oks("a", 10);
    payloads.push("stuck:slow".into());
    payloads.extend(oks("b", 5));
    enqueue(&db.pool, &payloads).await;
    let runs = Runs::default();
    let shutdown = CancellationToken::new();
    let short = |pool: &PgPool| {
        builder(pool, Inbox::new("batch").unwrap(), 32, 1)
            .visibility_timeout(Duration::from_millis(500))
            .build()
            .unwrap()
    };
    let run = spawn(short(&db.pool), runs.clone(), shutdown.clone());
    // The batch is inside the slow handler, its first 10 messages written, uncommitted.
    let started = Instant::now();
    while !runs.lock().unwrap().contains_key("stuck") {
        assert!(started.elapsed() < Duration::from_secs(30), "never reached");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    run.abort();
    let _ = run.await;
    assert_eq!(scalar(&db.pool, "SELECT count(*) FROM effects").await, 0);
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM pgbox.inbox").await,
        0
    );
    // A new run (the slow message now quick) finishes every message, once.
    runs.lock().unwrap().clear();
    let shutdown = CancellationToken::new();
    let fast = tokio::spawn({
        let consumer = short(&db.pool);
        let shutdown = shutdown.clone();
        async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        write(conn, &split(e).0, "outer").await?;
                        Ok::<(), Error>(())
                    },
                    shutdown,
                )
                .await
        }
    });
    settle(&db.pool, 0).await;
    support::stop_runner(shutdown, fast, Duration::from_secs(30)).await;
    for p in &payloads {
        let key = p.split_once(':').unwrap().0;
        assert_eq!(effects(&db.pool, key, "outer").await, 1, "{key}");
    }
}

/// The built-in queue, counting how many of its acks are in flight at once.
struct AckCounting {
    queue: PgQueue,
    in_flight: AtomicUsize,
    /// The most at once, shared with the test.
    most: Arc<AtomicUsize>,
}

impl Subscriber for AckCounting {
    type Delivery = Delivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> pgbox::Result<Vec<Delivery>> {
        self.queue.receive(topic, max, visibility).await
    }

    fn envelope<'d>(&self, delivery: &'d Delivery) -> &'d Envelope {
        self.queue.envelope(delivery)
    }

    fn attempt(&self, delivery: &Delivery) -> i32 {
        self.queue.attempt(delivery)
    }

    async fn ack(&self, delivery: &Delivery) -> pgbox::Result<bool> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        let acked = self.queue.ack(delivery).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        acked
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration, error: &str) -> pgbox::Result<bool> {
        self.queue.nack(delivery, delay, error).await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> pgbox::Result<bool> {
        self.queue.dead_letter(delivery, error).await
    }
}

/// A committed batch is acked all at once (the queue then deletes it in one or two
/// statements), not one ack after another: with one task, every ack in flight together
/// belongs to one batch.
#[tokio::test]
async fn a_committed_batch_is_acked_all_at_once() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db.pool).await;
    enqueue(&db.pool, &oks("k", 8)).await;
    let most = Arc::new(AtomicUsize::new(0));
    let source = AckCounting {
        queue: PgQueue::new(db.pool.clone()),
        in_flight: AtomicUsize::new(0),
        most: most.clone(),
    };
    let consumer = Consumer::builder(db.pool.clone(), source, TOPIC, Inbox::new("batch").unwrap())
        .batch_size(8)
        .concurrency(1)
        .poll_interval(Duration::from_millis(20))
        .key(|e: &Envelope| split(e).0)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = spawn(consumer, Runs::default(), shutdown.clone());
    settle(&db.pool, 0).await;
    let stats = support::stop_runner(shutdown, run, Duration::from_secs(30)).await;
    assert_eq!(stats.processed, 8, "{stats:?}");
    assert_eq!(
        most.load(Ordering::SeqCst),
        8,
        "the batch's eight acks were not in flight together"
    );
}

#[tokio::test]
async fn batch_size_is_checked() {
    let db = TestDb::migrated().await;
    for bad in [0, pgbox::MAX_BATCH_SIZE + 1] {
        let built = Consumer::builder(
            db.pool.clone(),
            PgQueue::new(db.pool.clone()),
            TOPIC,
            Inbox::new("batch").unwrap(),
        )
        .batch_size(bad)
        .build();
        match built {
            Err(Error::InvalidConfig(m)) => assert!(m.contains("batch size"), "{m}"),
            other => panic!("batch size {bad}: {other:?}"),
        }
    }
}

/// A run dropped at any moment (its task aborted, a `select!` that took another branch)
/// leaves no transaction open on the inbox's pool. sqlx 0.9.0's own begin, dropped while its
/// `BEGIN` awaits the answer, leaves the session inside a transaction nothing ends, and the
/// pool lends it on (transact-rs/sqlx#4393); the runner begins on a task of its own. Runs on
/// a one-connection pool, one message at a time and in batches, are dropped after 0 to 30 ms;
/// after each, the connection, back in the pool, must be outside any transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_at_any_moment_leaves_no_transaction_open() {
    let db = TestDb::migrated().await;
    enqueue(&db.pool, &oks("k", 400)).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url())
        .await
        .unwrap();
    let runs = Runs::default();
    let mut dropped = 0;
    for batch in [1, 8] {
        for micros in (0..30_000).step_by(150) {
            let consumer = builder_on(
                &pool,
                PgQueue::new(db.pool.clone()),
                Inbox::new("dropped").unwrap(),
                batch,
                1,
            )
            .visibility_timeout(Duration::from_secs(1))
            .build()
            .unwrap();
            let run = consumer.run(
                async |e: &Envelope, conn: &mut HandlerConnection<'_>| handle(e, conn, &runs).await,
                CancellationToken::new(),
            );
            let until = Instant::now() + Duration::from_micros(micros);
            tokio::select! {
                biased;
                r = run => panic!("the run ended by itself: {r:?}"),
                _ = async {
                    while Instant::now() < until {
                        tokio::task::yield_now().await;
                    }
                } => dropped += 1,
            }
            let mut conn = pool.acquire().await.unwrap();
            // One simple-protocol statement: its own transaction starts with it, unless one
            // was left open before.
            let row = sqlx::raw_sql("SELECT now() <> statement_timestamp(), now()::text")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            let (inside, since): (bool, String) =
                (sqlx::Row::get(&row, 0), sqlx::Row::get(&row, 1));
            assert!(
                !inside,
                "after a run (batch {batch}) dropped at {micros} µs, the connection is inside \
                 a transaction begun at {since}"
            );
        }
    }
    assert!(dropped > 0);
    assert!(
        runs.lock().unwrap().len() > 10,
        "the runs processed messages between drops: {}",
        runs.lock().unwrap().len()
    );
}
