//! How the consumer runner receives: under load, one receive serves several messages (a
//! handler finishing wakes a receive only once a quarter of the slots are free), and yet a
//! free slot never idles for longer than a poll interval behind handlers that run long.
//! Both are checked on what the runner did (receives counted by a wrapping subscriber,
//! effects committed), over the built-in queue on a real database.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pgbox::transport::{Delivery, PgQueue, Subscriber};
use pgbox::{Consumer, Envelope, HandlerConnection, Inbox};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use support::TestDb;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "jobs";

/// The built-in queue, counting the receives that returned messages, the messages they
/// returned, and the receives that asked for a single message; with or without the queue's
/// wake-up channel.
struct CountingReceives {
    queue: PgQueue,
    receives: Arc<AtomicUsize>,
    received: Arc<AtomicUsize>,
    asked_for_one: Arc<AtomicUsize>,
    wake_up: bool,
}

impl Subscriber for CountingReceives {
    type Delivery = Delivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> pgbox::Result<Vec<Delivery>> {
        if max == 1 {
            self.asked_for_one.fetch_add(1, Ordering::SeqCst);
        }
        let got = self.queue.receive(topic, max, visibility).await?;
        if !got.is_empty() {
            self.receives.fetch_add(1, Ordering::SeqCst);
            self.received.fetch_add(got.len(), Ordering::SeqCst);
        }
        Ok(got)
    }

    fn envelope<'d>(&self, delivery: &'d Delivery) -> &'d Envelope {
        self.queue.envelope(delivery)
    }

    fn attempt(&self, delivery: &Delivery) -> i32 {
        self.queue.attempt(delivery)
    }

    async fn ack(&self, delivery: &Delivery) -> pgbox::Result<bool> {
        self.queue.ack(delivery).await
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration, error: &str) -> pgbox::Result<bool> {
        self.queue.nack(delivery, delay, error).await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> pgbox::Result<bool> {
        self.queue.dead_letter(delivery, error).await
    }

    fn wake_channel(&self) -> Option<(PgPool, String)> {
        if self.wake_up {
            self.queue.wake_channel()
        } else {
            None
        }
    }
}

/// A pool wide enough for `concurrency` open transactions plus the receive and the acks.
async fn wide_pool(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(24)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone())
        .await
        .unwrap()
}

async fn enqueue(pool: &PgPool, payloads: &[String]) {
    support::enqueue_and_relay(pool, TOPIC, payloads).await;
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn effects_table(pool: &PgPool) {
    pool.execute("CREATE TABLE effects (key text PRIMARY KEY)")
        .await
        .unwrap();
}

/// A backlog consumed by 8 handlers that each take a few milliseconds: handlers finish one
/// at a time, and receiving for each single free slot would cost one receive per message.
/// The runner waits for a quarter of the slots (2 of 8), so a receive brings about two.
#[tokio::test]
async fn under_load_one_receive_serves_several_messages() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let pool = wide_pool(&db).await;
    effects_table(&pool).await;
    let n = 400;
    let payloads: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
    enqueue(&pool, &payloads).await;
    let receives = Arc::new(AtomicUsize::new(0));
    let received = Arc::new(AtomicUsize::new(0));
    let asked_for_one = Arc::new(AtomicUsize::new(0));
    let source = CountingReceives {
        queue: PgQueue::new(pool.clone()),
        receives: receives.clone(),
        received: received.clone(),
        asked_for_one: asked_for_one.clone(),
        wake_up: true,
    };
    // A poll interval longer than the run: every receive but the first is woken by handlers
    // finishing.
    let consumer = Consumer::builder(pool.clone(), source, TOPIC, Inbox::new("load").unwrap())
        .concurrency(8)
        .poll_interval(Duration::from_secs(600))
        .key(|e: &Envelope| String::from_utf8_lossy(&e.payload).into_owned())
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        // Spread the finishing times, as real handlers do.
                        let pause = 1 + e.payload.iter().map(|b| u64::from(*b)).sum::<u64>() % 4;
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
                            .bind(String::from_utf8_lossy(&e.payload).into_owned())
                            .execute(&mut **conn)
                            .await?;
                        Ok::<(), anyhow::Error>(())
                    },
                    shutdown,
                )
                .await
        }
    });
    assert!(
        support::settled(&pool, n, Duration::from_secs(120)).await,
        "{} of {n} effects",
        count(&pool, "SELECT count(*) FROM effects").await
    );
    let stats = support::stop_runner(shutdown, run, Duration::from_secs(60)).await;
    assert_eq!(stats.processed, n as u64, "{stats:?}");
    let receives = receives.load(Ordering::SeqCst);
    let received = received.load(Ordering::SeqCst);
    assert_eq!(received, n as usize, "each message received once");
    // A quarter of 8 is 2: under load no receive asks for a single message.
    assert_eq!(
        asked_for_one.load(Ordering::SeqCst),
        0,
        "receives asked for one message"
    );
    // One receive per free slot would make this 1.0 (the first receive aside).
    let per_receive = received as f64 / receives as f64;
    eprintln!("{received} messages in {receives} receives ({per_receive:.2} per receive)");
    assert!(
        per_receive >= 1.7,
        "{received} messages in {receives} receives ({per_receive:.2} per receive)"
    );
}

/// Seven handlers wait until a message that is not yet published has been handled; an
/// eighth finishes at once. The one free slot is below the quarter the runner waits for, and
/// the queue has no wake-up channel here, so only the poll interval can receive the late
/// message into it. A runner that waited for the quarter regardless would never receive it:
/// the seven would wait out their 30 s and fail.
#[tokio::test]
async fn a_free_slot_is_filled_behind_handlers_that_run_long() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let pool = wide_pool(&db).await;
    effects_table(&pool).await;
    let mut first: Vec<String> = (0..7).map(|i| format!("wait{i}")).collect();
    first.push("quick".into());
    enqueue(&pool, &first).await;
    let (release, released) = tokio::sync::watch::channel(false);
    let release = Arc::new(release);
    let receives = Arc::new(AtomicUsize::new(0));
    let received = Arc::new(AtomicUsize::new(0));
    let source = CountingReceives {
        queue: PgQueue::new(pool.clone()),
        receives: receives.clone(),
        received: received.clone(),
        asked_for_one: Arc::default(),
        // No wake-up channel: only the poll interval can bring the late message in.
        wake_up: false,
    };
    let consumer = Consumer::builder(pool.clone(), source, TOPIC, Inbox::new("long").unwrap())
        .concurrency(8)
        .poll_interval(Duration::from_millis(100))
        .key(|e: &Envelope| String::from_utf8_lossy(&e.payload).into_owned())
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        let key = String::from_utf8_lossy(&e.payload).into_owned();
                        if key.starts_with("wait") {
                            let mut released = released.clone();
                            tokio::time::timeout(
                                Duration::from_secs(30),
                                released.wait_for(|r| *r),
                            )
                            .await
                            .map_err(|_| anyhow::anyhow!("{key}: never released"))??;
                        } else if key == "late" {
                            release.send_replace(true);
                        }
                        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
                            .bind(&key)
                            .execute(&mut **conn)
                            .await?;
                        Ok::<(), anyhow::Error>(())
                    },
                    shutdown,
                )
                .await
        }
    });
    // All eight in hand, the quick one done: seven slots busy, one free.
    let started = Instant::now();
    while count(&pool, "SELECT count(*) FROM effects").await < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "quick never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(received.load(Ordering::SeqCst), 8, "all eight in hand");
    enqueue(&pool, &["late".to_owned()]).await;
    assert!(
        support::settled(&pool, 9, Duration::from_secs(20)).await,
        "the late message never got the free slot: {} of 9 effects",
        count(&pool, "SELECT count(*) FROM effects").await
    );
    let stats = support::stop_runner(shutdown, run, Duration::from_secs(60)).await;
    assert_eq!(stats.processed, 9, "{stats:?}");
    assert_eq!(stats.retried, 0, "{stats:?}");
}
