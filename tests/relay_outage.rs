//! The table relay through a transport outage longer than its whole retry budget
//! (`max_attempts(2)`, millisecond backoffs): no message is dead-lettered, and once the
//! transport is back every message is delivered, in per-key order. One test per transport
//! the relay publishes to: the built-in queue (its pool on another database), RabbitMQ,
//! NATS and Kafka (a tansu broker of the test's own), each reached through a TCP proxy that
//! the test points at a port where nothing listens for the outage. Then what an outage must
//! not do either: an atomic batch refused for one message counts only that message, and an
//! outage shows in the doctor.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[cfg(feature = "nats")]
use pgbox::transport::nats::Nats;
use pgbox::transport::rabbitmq::RabbitMq;
use pgbox::transport::{PgQueue, PublishError, Publisher, Subscriber};
use pgbox::{Envelope, Message, Outbox, Relay, RetryPolicy};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::TestDb;
use support::brokers::{self, Proxy};

/// Forwards to the transport under test and counts the messages it failed to publish (the
/// proof that the outage outlasted the retry budget). Not a queue for the relay's
/// same-database shortcut: every batch goes through `publish`.
struct Counting<P> {
    inner: P,
    failed: Arc<AtomicUsize>,
}

impl<P: Publisher> Publisher for Counting<P> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let results = self.inner.publish(batch).await;
        let failed = results.iter().filter(|r| r.is_err()).count();
        self.failed.fetch_add(failed, Ordering::Relaxed);
        results
    }

    fn atomic_batches(&self) -> bool {
        self.inner.atomic_batches()
    }
}

/// The messages of the scenario, in commit order: (ordering key, payload).
fn messages() -> Vec<(Option<&'static str>, String)> {
    vec![
        (Some("A"), "a1".into()),
        (Some("B"), "b1".into()),
        (None, "u1".into()),
        (Some("A"), "a2".into()),
        (Some("B"), "b2".into()),
        (None, "u2".into()),
        (Some("A"), "a3".into()),
    ]
}

async fn enqueue(pool: &PgPool, topic: &str) {
    let outbox = Outbox::new();
    for (key, payload) in messages() {
        let mut tx = pool.begin().await.unwrap();
        let mut m = Message::bytes(topic, payload.into_bytes());
        if let Some(k) = key {
            m = m.ordering_key(k);
        }
        outbox.enqueue(&mut tx, m).await.unwrap();
        tx.commit().await.unwrap();
    }
}

async fn dead_letters(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox_dead_letters")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// An address where nothing listens (a port bound, then released).
fn nowhere() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
}

/// Runs the relay of `pool` (2 attempts, backoffs of a few milliseconds) while `proxy` leads
/// nowhere, until the failed publishes are more than the retry budget allows for every
/// message that can be offered (or something was dead-lettered); asserts nothing was
/// dead-lettered; then points `proxy` back at `up` and drains. Returns the drain's report.
async fn ride_out_outage<P: Publisher>(
    pool: &PgPool,
    publisher: P,
    proxy: &Proxy,
    up: SocketAddr,
) -> pgbox::DrainReport {
    let failed = Arc::new(AtomicUsize::new(0));
    let relay = Relay::builder(
        pool.clone(),
        Counting {
            inner: publisher,
            failed: failed.clone(),
        },
    )
    .max_attempts(2)
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(5))
            .max_delay(Duration::from_millis(20)),
    )
    .poll_interval(Duration::from_millis(20))
    .build()
    .unwrap();

    proxy.retarget(nowhere());
    proxy.cut();
    // The heads that can be offered: a1, b1, u1, u2. Three failures each is past a budget
    // of two attempts.
    let past_budget = 3 * 4;
    let mut rounds = 0;
    while failed.load(Ordering::Relaxed) < past_budget && dead_letters(pool).await == 0 {
        rounds += 1;
        assert!(rounds <= 2_000, "the relay stopped offering messages");
        relay.relay_once().await.expect("round");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        dead_letters(pool).await,
        0,
        "an outage of the transport dead-lettered messages after {} failed publishes",
        failed.load(Ordering::Relaxed)
    );

    proxy.retarget(up);
    // Bounded: a drain that cannot finish fails the test instead of hanging it.
    let report = tokio::time::timeout(Duration::from_secs(120), relay.drain())
        .await
        .expect("drain finishes once the transport is back")
        .expect("drain");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(dead_letters(pool).await, 0);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "messages left in the outbox: {report:?}");
    report
}

/// Each key's payloads in `delivered`, which must hold every message exactly once.
fn assert_all_in_key_order(delivered: &[(Option<String>, String)]) {
    let mut expected: Vec<String> = messages().into_iter().map(|(_, p)| p).collect();
    let mut got: Vec<String> = delivered.iter().map(|(_, p)| p.clone()).collect();
    expected.sort();
    got.sort();
    assert_eq!(got, expected, "every message once: {delivered:?}");
    for key in ["A", "B"] {
        let want: Vec<String> = messages()
            .into_iter()
            .filter(|(k, _)| *k == Some(key))
            .map(|(_, p)| p)
            .collect();
        let seen: Vec<String> = delivered
            .iter()
            .filter(|(k, _)| k.as_deref() == Some(key))
            .map(|(_, p)| p.clone())
            .collect();
        assert_eq!(seen, want, "key {key} in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_outage_longer_than_the_retry_budget_dead_letters_nothing() {
    support::init_tracing();
    let outbox_db = TestDb::migrated().await;
    let queue_db = TestDb::migrated().await;
    let server = brokers::address(&support::server_url().await);
    let proxy = Proxy::start(server).await;
    let through_proxy = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(
            queue_db
                .options
                .clone()
                .host("127.0.0.1")
                .port(proxy.addr().port()),
        )
        .await
        .unwrap();
    let topic = "outage.queue";
    enqueue(&outbox_db.pool, topic).await;

    ride_out_outage(&outbox_db.pool, PgQueue::new(through_proxy), &proxy, server).await;

    let delivered: Vec<(Option<String>, Vec<u8>)> =
        sqlx::query_as("SELECT ordering_key, payload FROM pgbox.queue ORDER BY seq")
            .fetch_all(&queue_db.pool)
            .await
            .unwrap();
    let delivered: Vec<(Option<String>, String)> = delivered
        .into_iter()
        .map(|(k, p)| (k, String::from_utf8(p).unwrap()))
        .collect();
    assert_all_in_key_order(&delivered);
}

/// Receives `n` messages of `topic` from `subscriber`, acking each as it comes (bounded).
async fn receive_all<S: Subscriber>(
    subscriber: &S,
    topic: &str,
    n: usize,
) -> Vec<(Option<String>, String)> {
    let mut delivered = Vec::new();
    for _ in 0..300 {
        if delivered.len() >= n {
            break;
        }
        let batch = subscriber
            .receive(topic, 10, Duration::from_secs(30))
            .await
            .expect("receive");
        for d in batch {
            let e = subscriber.envelope(&d);
            delivered.push((
                e.ordering_key.clone(),
                String::from_utf8(e.payload.clone()).unwrap(),
            ));
            subscriber.ack(&d).await.expect("ack");
        }
    }
    delivered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_outage_longer_than_the_retry_budget_dead_letters_nothing() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::rabbitmq_url().await;
    let up = brokers::address(&url);
    let proxy = Proxy::start(up).await;
    let prefix = format!("pgbox-outage-{}.", uuid::Uuid::now_v7().simple());
    let build = |url: &str| {
        RabbitMq::builder(url)
            .exchange("pgbox-test")
            .queue_prefix(&prefix)
            .queue_expires(Duration::from_secs(600))
            .connect_timeout(Duration::from_secs(2))
            .operation_timeout(Duration::from_secs(2))
            .confirm_timeout(Duration::from_secs(2))
            .build()
            .unwrap()
    };
    let direct = build(&url);
    let topic = "outage.rabbitmq";
    direct.declare_topic(topic).await.unwrap();
    enqueue(&db.pool, topic).await;

    let proxied = build(&brokers::with_address(&url, proxy.addr()));
    ride_out_outage(&db.pool, proxied, &proxy, up).await;

    let delivered = receive_all(&direct, topic, messages().len()).await;
    assert_all_in_key_order(&delivered);
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_longer_than_the_retry_budget_dead_letters_nothing() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::nats_url().await;
    let up = brokers::address(&url);
    let proxy = Proxy::start(up).await;
    let build = |url: &str| {
        Nats::builder(url)
            .stream("PGBOX_TEST")
            .subject_prefix("pgbox-test")
            .max_age(Duration::from_secs(3600))
            .inactive_threshold(Duration::from_secs(600))
            .receive_wait(Duration::from_millis(100))
            .build()
            .unwrap()
    };
    let direct = build(&url);
    let topic = format!("outage-nats-{}", uuid::Uuid::now_v7().simple());
    direct.declare_topic(&topic).await.unwrap();
    enqueue(&db.pool, &topic).await;

    let proxied = build(&brokers::with_address(&url, proxy.addr()));
    // Connected once, so that the outage is a lost connection (the client reconnects by
    // itself; publishes meanwhile time out).
    proxied.max_payload().await.unwrap();
    ride_out_outage(&db.pool, proxied, &proxy, up).await;

    let delivered = receive_all(&direct, &topic, messages().len()).await;
    assert_all_in_key_order(&delivered);
}

/// Into the built-in queue on another database, whose batches are atomic: a batch the queue
/// refuses because of one message (here a trigger of the queue's database refuses it) costs
/// an attempt of that message only. The others are published in the same round, except the
/// later messages of its key, which wait behind it without counting (and, as the table
/// relay's dead letters hold their key, go on waiting until it is replayed or discarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_atomic_batch_refused_for_one_message_counts_only_that_message() {
    support::init_tracing();
    let outbox_db = TestDb::migrated().await;
    let queue_db = TestDb::migrated().await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF NEW.payload = convert_to('poison', 'UTF8') THEN \
             RAISE EXCEPTION 'poison is refused here'; \
           END IF; \
           RETURN NEW; \
         END $$; \
         CREATE TRIGGER refuse_poison BEFORE INSERT ON pgbox.queue \
           FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
    )
    .execute(&queue_db.pool)
    .await
    .unwrap();
    let topic = "refused.one";
    let outbox = Outbox::new();
    let scenario = [
        (Some("A"), "a1"),
        (None, "u1"),
        (Some("B"), "poison"),
        (Some("A"), "a2"),
        (Some("B"), "b2"),
        (None, "u2"),
    ];
    let mut tx = outbox_db.pool.begin().await.unwrap();
    for (key, payload) in scenario {
        let mut m = Message::bytes(topic, payload.as_bytes().to_vec());
        if let Some(k) = key {
            m = m.ordering_key(k);
        }
        outbox.enqueue(&mut tx, m).await.unwrap();
    }
    tx.commit().await.unwrap();

    let relay = Relay::builder(outbox_db.pool.clone(), PgQueue::new(queue_db.pool.clone()))
        .max_attempts(3)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(1)),
        )
        .build()
        .unwrap();
    let round = relay.relay_once().await.unwrap();
    let attempts: Vec<(String, i32)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), attempts FROM pgbox.outbox ORDER BY seq",
    )
    .fetch_all(&outbox_db.pool)
    .await
    .unwrap();
    assert_eq!(
        attempts,
        [("poison".to_owned(), 1), ("b2".to_owned(), 0)],
        "after one round: {round:?}"
    );

    let report = tokio::time::timeout(Duration::from_secs(60), relay.drain())
        .await
        .expect("drain finishes")
        .expect("drain");
    let dead: Vec<String> = sqlx::query_scalar(
        "SELECT convert_from(payload, 'UTF8') FROM pgbox.outbox_dead_letters ORDER BY seq",
    )
    .fetch_all(&outbox_db.pool)
    .await
    .unwrap();
    assert_eq!(dead, ["poison"], "{report:?}");
    let delivered: Vec<(Option<String>, String)> = sqlx::query_as(
        "SELECT ordering_key, convert_from(payload, 'UTF8') FROM pgbox.queue ORDER BY seq",
    )
    .fetch_all(&queue_db.pool)
    .await
    .unwrap();
    let of_key = |k: &str| -> Vec<&str> {
        delivered
            .iter()
            .filter(|(key, _)| key.as_deref() == Some(k))
            .map(|(_, p)| p.as_str())
            .collect()
    };
    assert_eq!(delivered.len(), 4, "{delivered:?}");
    assert_eq!(of_key("A"), ["a1", "a2"]);
    assert!(of_key("B").is_empty(), "{delivered:?}");
    let waiting: Vec<(String, i32)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), attempts FROM pgbox.outbox ORDER BY seq",
    )
    .fetch_all(&outbox_db.pool)
    .await
    .unwrap();
    assert_eq!(
        waiting,
        [("b2".to_owned(), 0)],
        "behind its key's dead letter, uncounted"
    );
}

/// An outage is visible to an operator in the doctor: the messages wait in the outbox,
/// uncounted, and the age of the oldest one is a `outbox_stalled` finding (a warning, then
/// critical), naming its topic and saying it was never refused. A young backlog is no
/// finding, and none is left once the transport is back and the outbox drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_shows_in_the_doctor_as_a_stalled_outbox() {
    use pgbox::doctor::{Code, Doctor, Severity};

    support::init_tracing();
    let db = TestDb::migrated().await;
    let topic = "outage.doctor";
    enqueue(&db.pool, topic).await;
    let stalled = |report: &pgbox::doctor::Report| -> Vec<pgbox::doctor::Finding> {
        report.with_code(Code::OutboxStalled).cloned().collect()
    };
    let report = Doctor::new().check(&db.pool).await.unwrap();
    assert!(stalled(&report).is_empty(), "{report:#?}");

    // The relay's broker cannot be reached.
    let down = RabbitMq::builder(format!("amqp://guest:guest@{}/%2f", nowhere()))
        .connect_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let relay = Relay::builder(db.pool.clone(), down)
        .max_attempts(1)
        .build()
        .unwrap();
    let round = relay.relay_once().await.unwrap();
    assert!(
        round.unavailable > 0 && round.published + round.retried + round.dead_lettered == 0,
        "{round:?}"
    );
    // Older than the thresholds below.
    tokio::time::sleep(Duration::from_millis(20)).await;

    let report = Doctor::new()
        .outbox_age_warn(Duration::from_millis(10))
        .check(&db.pool)
        .await
        .unwrap();
    let found = stalled(&report);
    assert_eq!(found.len(), 1, "{report:#?}");
    let f = &found[0];
    assert_eq!(f.severity, Severity::Warning);
    assert_eq!(f.subject.as_deref(), Some(topic));
    assert_eq!(f.details["attempts"], 0);
    assert_eq!(f.details["pending"], messages().len());
    assert!(f.message.contains("never refused"), "{}", f.message);
    assert!(f.advice.contains("transport unavailable"), "{}", f.advice);

    let report = Doctor::new()
        .outbox_age_warn(Duration::from_millis(1))
        .outbox_age_critical(Duration::from_millis(10))
        .check(&db.pool)
        .await
        .unwrap();
    let found = stalled(&report);
    assert_eq!(found.len(), 1, "{report:#?}");
    assert_eq!(found[0].severity, Severity::Critical);

    // Back: drained, nothing stalled.
    let back = Relay::builder(db.pool.clone(), pgbox::transport::DiscardPublisher)
        .build()
        .unwrap();
    let drained = tokio::time::timeout(Duration::from_secs(60), back.drain())
        .await
        .expect("drain finishes")
        .unwrap();
    assert_eq!(drained.dead_lettered, 0, "{drained:?}");
    let report = Doctor::new()
        .outbox_age_warn(Duration::from_millis(1))
        .check(&db.pool)
        .await
        .unwrap();
    assert!(stalled(&report).is_empty(), "{report:#?}");
}

/// A tansu broker of this test's own, advertised at `proxy`'s address (so every client
/// connection goes through the proxy); killed, and its directory removed, on drop.
#[cfg(feature = "kafka")]
struct OwnKafka {
    child: std::process::Child,
    dir: std::path::PathBuf,
}

#[cfg(feature = "kafka")]
impl Drop for OwnKafka {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_outage_longer_than_the_retry_budget_dead_letters_nothing() {
    use pgbox::transport::kafka::Kafka;

    support::init_tracing();
    let db = TestDb::migrated().await;
    let tansu = tokio::task::spawn_blocking(brokers::kafka::tansu)
        .await
        .unwrap()
        .expect("the tansu broker");
    let listen = nowhere();
    let proxy = Proxy::start(listen).await;
    let dir = std::env::temp_dir().join(format!(
        "pgbox-kafka-outage-{}",
        uuid::Uuid::now_v7().simple()
    ));
    let _broker = OwnKafka {
        child: brokers::kafka::spawn(&tansu, listen, proxy.addr(), &dir).expect("start tansu"),
        dir,
    };
    let build = || {
        Kafka::builder(proxy.addr().to_string())
            .partitions(2)
            .session_timeout(Duration::from_secs(3))
            .receive_wait(Duration::from_millis(100))
            .build()
            .unwrap()
    };
    let direct = build();
    let topic = "outage.kafka";
    // Bounded: tansu answers within seconds of its start.
    let mut declared = Err(pgbox::Error::InvalidConfig("not tried".into()));
    for _ in 0..60 {
        declared = direct.declare_topic(topic).await;
        if declared.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    declared.expect("declare the topic on tansu");
    enqueue(&db.pool, topic).await;

    // Each publish during the outage waits out the producer's message.timeout.ms (30 s).
    let relay_transport = build();
    relay_transport.declare_topic(topic).await.unwrap();
    ride_out_outage(&db.pool, relay_transport, &proxy, listen).await;

    let delivered = receive_all(&direct, topic, messages().len()).await;
    assert_all_in_key_order(&delivered);
}

/// What a publisher delivered: (ordering key, payload), in arrival order.
type Delivered = Arc<std::sync::Mutex<Vec<(Option<String>, String)>>>;

/// A user-written publisher that stops answering (it waits on a peer that went silent) until
/// `answer` is set; then it publishes and records what it got.
#[derive(Clone, Default)]
struct Silent {
    answer: Arc<std::sync::atomic::AtomicBool>,
    calls: Arc<AtomicUsize>,
    delivered: Delivered,
}

impl Publisher for Silent {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if !self.answer.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        let mut delivered = self.delivered.lock().unwrap();
        for e in batch {
            delivered.push((
                e.ordering_key.clone(),
                String::from_utf8(e.payload.clone()).unwrap(),
            ));
        }
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        false
    }
}

/// A publisher that never answers holds up a round for the relay's publish timeout, not for
/// good: its messages come back unavailable (no attempt counted, nothing dead-lettered, the
/// round's locks released), and once it answers again the relay publishes everything in
/// key order. Without the bound the round waited forever, holding the keyed-drain lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_never_answers_is_an_outage_bounded_by_the_publish_timeout() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    enqueue(&db.pool, "silent.publisher").await;
    let publisher = Silent::default();
    let relay = Relay::builder(db.pool.clone(), publisher.clone())
        .max_attempts(2)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(5))
                .max_delay(Duration::from_millis(20)),
        )
        .poll_interval(Duration::from_millis(20))
        .publish_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    // More rounds than the retry budget allows for, each given up on.
    for _ in 0..4 {
        let round = tokio::time::timeout(Duration::from_secs(30), relay.relay_once())
            .await
            .expect("a round returns though its publisher never answers")
            .expect("round");
        assert_eq!(round.dead_lettered, 0);
        assert_eq!(round.retried, 0, "no answer counts no attempt");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(publisher.calls.load(Ordering::Relaxed) >= 2);
    let attempts: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(attempts), 0)::bigint FROM pgbox.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 0);
    assert_eq!(dead_letters(&db.pool).await, 0);
    publisher.answer.store(true, Ordering::Relaxed);
    let report = tokio::time::timeout(Duration::from_secs(60), relay.drain())
        .await
        .expect("drain")
        .expect("drain");
    assert_eq!(report.dead_lettered, 0);
    let delivered = publisher.delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), messages().len());
    assert_all_in_key_order(&delivered);
    assert!(
        Relay::builder(db.pool.clone(), Silent::default())
            .publish_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
}
