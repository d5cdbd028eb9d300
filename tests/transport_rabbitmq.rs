//! The RabbitMQ transport against a real broker: the conformance suite, and the whole
//! pipeline (outbox → relay → RabbitMQ → consumer → inbox) with connections cut mid-flight.

mod support;

use std::time::Duration;

use pgbox::Envelope;
use pgbox::transport::conformance::{self, Capabilities, DeadLettered, Harness};
use pgbox::transport::rabbitmq::RabbitMq;
use support::brokers::{self, Proxy};

/// Every connection of the transports under test goes through `proxy`, which can cut them.
struct RabbitHarness {
    url: String,
    proxied: String,
    proxy: Proxy,
    prefix: String,
}

async fn harness() -> RabbitHarness {
    support::init_tracing();
    let url = brokers::rabbitmq_url().await;
    let proxy = Proxy::start(brokers::address(&url)).await;
    let proxied = brokers::with_address(&url, proxy.addr());
    RabbitHarness {
        url,
        proxied,
        proxy,
        prefix: format!("pgbox-test-{}.", uuid::Uuid::now_v7().simple()),
    }
}

impl RabbitHarness {
    fn transport(&self, url: &str) -> RabbitMq {
        RabbitMq::builder(url)
            .exchange("pgbox-test")
            .queue_prefix(&self.prefix)
            // The broker is shared: leave nothing behind for long.
            .queue_expires(Duration::from_secs(600))
            .receive_wait(Duration::from_millis(100))
            // A cut connection can leave an ack waiting: give up on it quickly.
            .operation_timeout(Duration::from_secs(2))
            .build()
            .expect("valid config")
    }
}

impl Harness for RabbitHarness {
    type Publisher = RabbitMq;
    type Subscriber = RabbitMq;

    fn capabilities(&self) -> Capabilities {
        // A dead consumer's messages come back as soon as its connection closes.
        Capabilities::default()
            .per_key_order(true)
            .visibility(Duration::from_secs(30))
            .redelivery_after_crash(Duration::from_secs(5))
    }

    async fn fresh_topic(&self) -> String {
        let topic = format!("t-{}", uuid::Uuid::now_v7().simple());
        let admin = self.transport(&self.url);
        admin.declare_topic(&topic).await.expect("declare topic");
        admin.close().await;
        topic
    }

    async fn publisher(&self) -> RabbitMq {
        self.transport(&self.proxied)
    }

    async fn subscriber(&self) -> RabbitMq {
        self.transport(&self.proxied)
    }

    async fn crash(&self, subscriber: RabbitMq) {
        subscriber.close().await;
    }

    async fn cut_connections(&self) {
        let cut = self.proxy.cut();
        assert!(cut > 0, "no connection to cut");
    }

    async fn dead_letters(&self, topic: &str) -> Vec<DeadLettered> {
        let admin = self.transport(&self.url);
        let dead = admin
            .dead_letters(topic, 100)
            .await
            .expect("list dead letters");
        admin.close().await;
        dead.into_iter()
            .map(|d| DeadLettered::new(d.envelope, d.error))
            .collect()
    }

    async fn refused(&self, topic: &str) -> Option<Envelope> {
        // No queue is bound for this topic: a mandatory publish comes back, reported `Err`
        // (unavailable: the relay retries it, uncounted, until a queue is bound).
        Some(conformance::envelope(
            &format!("{topic}-unbound"),
            "nowhere",
        ))
    }
}

pgbox::conformance_tests!(harness());

/// 1000 messages through relay → RabbitMQ → consumer → inbox while the proxy cuts every
/// connection (publisher's and consumer's) several times: each message takes effect exactly
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipeline_survives_cut_connections_without_loss_or_double_effects() {
    let h = harness().await;
    let topic = h.fresh_topic().await;
    let db = support::TestDb::migrated().await;
    brokers::pipeline_with_cuts(
        &db.pool,
        h.transport(&h.proxied),
        h.transport(&h.proxied),
        &topic,
        &h.proxy,
    )
    .await;
}

/// The consumer process of `pipeline_survives_a_consumer_killed_mid_batch`; a no-op in a
/// normal test run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_consumer_process() {
    let h = harness().await;
    brokers::child_consumer(|prefix| {
        RabbitMq::builder(&h.url)
            .exchange("pgbox-test")
            .queue_prefix(prefix)
            .queue_expires(Duration::from_secs(600))
            .receive_wait(Duration::from_millis(100))
            .build()
            .unwrap()
    })
    .await;
}

/// Relay → broker → consumer process → inbox, with the consumer process killed with SIGKILL
/// mid-batch and a new one started: each message takes effect exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipeline_survives_a_consumer_killed_mid_batch() {
    let h = harness().await;
    let topic = h.fresh_topic().await;
    let db = support::TestDb::migrated().await;
    brokers::pipeline_with_killed_consumer(
        &db.pool,
        &db.url(),
        h.transport(&h.url),
        &topic,
        "child_consumer_process",
        &h.prefix,
    )
    .await;
}

/// The payment/points example over this broker keeps its invariants under every fault flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_points_example_keeps_its_invariants() {
    support::init_tracing();
    let db = support::TestDb::empty().await;
    brokers::payment_points_on(&db.pool, &db.url(), "rabbitmq").await;
}

/// The handler's error in [`consumer_zero_delay_retry_keeps_key_order`].
#[derive(Debug)]
struct Failed(String);

impl From<pgbox::Error> for Failed {
    fn from(e: pgbox::Error) -> Self {
        Failed(e.to_string())
    }
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Messages of `queue` the broker has not sent to a consumer yet (`queue.declare` passive:
/// its message count leaves out delivered, unacked messages).
async fn ready(url: &str, queue: &str) -> u32 {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare");
    let _ = conn.close(200, "done".into()).await;
    q.message_count()
}

/// The `Consumer` runner over RabbitMQ, with a backoff that always draws a zero delay (so a
/// failure is a requeue in place): the first attempt of a1 fails once every message has
/// been sent to the consumer (a2 and a3 are in its prefetch buffer), and the handler still
/// sees key a as a1, a1, a2, a3. One message at a time, so that no receive is waiting when
/// a1 is nacked (a waiting receive would take the returning a1 before looking at the held
/// messages again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_zero_delay_retry_keeps_key_order() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use pgbox::transport::Publisher;
    use pgbox::{CancellationToken, Consumer, Inbox, RetryPolicy};

    let h = harness().await;
    let topic = h.fresh_topic().await;
    let db = support::TestDb::migrated().await;
    let mut batch = Vec::new();
    for n in 1..=3 {
        for k in ["a", "b"] {
            let mut e = conformance::envelope(&topic, format!("{k}{n}"));
            e.ordering_key = Some(k.to_owned());
            batch.push(e);
        }
    }
    let publisher = h.transport(&h.url);
    for r in publisher.publish(&batch).await {
        r.expect("published");
    }
    publisher.close().await;

    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let all_sent: Arc<AtomicBool> = Arc::default();
    let subscriber = h.transport(&h.url);
    let queue = subscriber.queue_name(&topic);
    let consumer = Consumer::builder(
        db.pool.clone(),
        subscriber,
        topic.clone(),
        Inbox::new("zero-delay").unwrap(),
    )
    .concurrency(1)
    .poll_interval(Duration::from_millis(10))
    // Full jitter under a zero ceiling: every retry is a nack with a zero delay.
    .backoff(RetryPolicy::new().base_delay(Duration::ZERO))
    .max_deliveries(5)
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let seen = seen.clone();
        let all_sent = all_sent.clone();
        let shutdown = shutdown.clone();
        let url = h.url.clone();
        async move {
            consumer
                .run(
                    async move |msg: &Envelope, _conn: &mut pgbox::HandlerConnection<'_>| {
                        let name = String::from_utf8(msg.payload.clone()).unwrap();
                        let first_a1 = {
                            let mut seen = seen.lock().unwrap();
                            let first = name == "a1" && !seen.contains(&name);
                            seen.push(name);
                            first
                        };
                        if !first_a1 {
                            return Ok(());
                        }
                        // Bounded: with a prefetch of 100 the broker sends all six at once.
                        let start = Instant::now();
                        while start.elapsed() < Duration::from_secs(20) {
                            if ready(&url, &queue).await == 0 {
                                all_sent.store(true, Ordering::Relaxed);
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Err(Failed("the first attempt of a1 fails".into()))
                    },
                    shutdown,
                )
                .await
        }
    });

    let start = Instant::now();
    while seen.lock().unwrap().len() < 7 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the handler saw only {:?} within 60 s",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the consumer stops within 30 s of shutdown")
        .unwrap()
        .unwrap();
    assert!(
        all_sent.load(Ordering::Relaxed),
        "the broker sent every message before a1 failed"
    );
    let seen = seen.lock().unwrap().clone();
    let of = |k: char| -> Vec<&str> {
        seen.iter()
            .filter(|n| n.starts_with(k))
            .map(String::as_str)
            .collect()
    };
    assert_eq!(
        of('a'),
        ["a1", "a1", "a2", "a3"],
        "key a as the handler saw it (all: {seen:?})"
    );
    assert_eq!(of('b'), ["b1", "b2", "b3"], "key b (all: {seen:?})");
    assert_eq!((stats.processed, stats.retried), (6, 1), "{stats:?}");
}

/// Declares `topic`'s queue under `prefix` as pgbox does, plus `x-delivery-limit` when
/// given, and its dead-letter queue only when `with_dead` (so that publishing a dead-letter
/// copy fails). Every queue expires after ten minutes unused.
async fn own_topology(
    url: &str,
    rabbit: &RabbitMq,
    topic: &str,
    delivery_limit: Option<i64>,
    with_dead: bool,
) {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString};

    let (queue, dead) = (rabbit.queue_name(topic), rabbit.dead_letter_queue(topic));
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let expires = AMQPValue::LongLongInt(600_000);
    let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
    channel
        .exchange_declare(
            "pgbox-test".into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare exchange");
    if with_dead {
        let mut args = FieldTable::default();
        args.insert("x-expires".into(), expires.clone());
        channel
            .queue_declare(dead.as_str().into(), durable, args)
            .await
            .expect("declare dead-letter queue");
    }
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert("x-dead-letter-exchange".into(), text(""));
    args.insert("x-dead-letter-routing-key".into(), text(&dead));
    args.insert("x-expires".into(), expires);
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    if let Some(limit) = delivery_limit {
        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
    }
    channel
        .queue_declare(queue.as_str().into(), durable, args)
        .await
        .expect("declare queue");
    channel
        .queue_bind(
            queue.as_str().into(),
            "pgbox-test".into(),
            topic.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind queue");
    let _ = conn.close(200, "declared".into()).await;
}

impl RabbitHarness {
    /// A transport that leaves the topology to the test, with a 1 s operation timeout.
    fn undeclaring(&self, url: &str) -> RabbitMq {
        RabbitMq::builder(url)
            .exchange("pgbox-test")
            .queue_prefix(&self.prefix)
            .declare(false)
            .receive_wait(Duration::from_millis(100))
            .operation_timeout(Duration::from_secs(1))
            .build()
            .expect("valid config")
    }
}

/// Publishes a1 and a2 of key a to `topic`, receives a1 from `sub`, and waits (bounded)
/// until the broker has sent a2 to `sub` too (it is in the prefetch buffer). Returns a1 and
/// the ids of a1 and a2.
async fn a1_in_hand_a2_prefetched(
    h: &RabbitHarness,
    sub: &RabbitMq,
    topic: &str,
) -> (pgbox::transport::rabbitmq::RabbitDelivery, [uuid::Uuid; 2]) {
    use pgbox::transport::{Publisher, Subscriber};
    use std::time::Instant;

    let batch: Vec<Envelope> = ["a1", "a2"]
        .into_iter()
        .map(|n| {
            let mut e = conformance::envelope(topic, n);
            e.ordering_key = Some("a".into());
            e
        })
        .collect();
    let publisher = h.undeclaring(&h.url);
    for r in publisher.publish(&batch).await {
        r.expect("published");
    }
    publisher.close().await;
    let start = Instant::now();
    let a1 = loop {
        assert!(start.elapsed() < Duration::from_secs(20), "a1 not received");
        let mut got = sub
            .receive(topic, 8, Duration::from_secs(30))
            .await
            .expect("receive");
        if let Some(d) = got.pop() {
            assert!(got.is_empty(), "one message of key a at a time");
            break d;
        }
    };
    assert_eq!(a1.envelope().id, batch[0].id);
    while ready(&h.url, &sub.queue_name(topic)).await > 0 {
        assert!(start.elapsed() < Duration::from_secs(20), "a2 not sent");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (a1, [batch[0].id, batch[1].id])
}

/// The next delivery of `topic` from `sub` (bounded: 30 s), which must be alone.
async fn next_one(sub: &RabbitMq, topic: &str) -> pgbox::transport::rabbitmq::RabbitDelivery {
    use pgbox::transport::Subscriber;
    let start = std::time::Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "nothing received within 30 s"
        );
        let mut got = sub
            .receive(topic, 8, Duration::from_secs(30))
            .await
            .expect("receive");
        if let Some(d) = got.pop() {
            assert!(got.is_empty(), "one message of the key at a time");
            return d;
        }
    }
}

/// A dead-letter that fails (here: no dead-letter queue, so the copy is unroutable) requeues
/// the message in place, and it still comes back before the next message of its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_dead_letter_requeues_ahead_of_its_key() {
    use pgbox::transport::Subscriber;

    let h = harness().await;
    let topic = format!("t-{}", uuid::Uuid::now_v7().simple());
    let sub = h.undeclaring(&h.url);
    own_topology(&h.url, &sub, &topic, None, false).await;
    let (a1, [id1, id2]) = a1_in_hand_a2_prefetched(&h, &sub, &topic).await;
    assert!(
        sub.dead_letter(&a1, "give up").await.is_err(),
        "dead-lettering to a missing queue failed"
    );
    drop(a1);
    let again = next_one(&sub, &topic).await;
    assert_eq!(
        (again.envelope().id, again.attempt()),
        (id1, 2),
        "a1 again before a2"
    );
    assert!(sub.ack(&again).await.expect("ack"));
    let a2 = next_one(&sub, &topic).await;
    assert_eq!(a2.envelope().id, id2);
    assert!(sub.ack(&a2).await.expect("ack"));
}

/// A message requeued in place that never comes back (the quorum queue dead-letters it at
/// its delivery limit) holds its key no longer than the operation timeout: the next message
/// of the key, already in the consumer's prefetch buffer, is then handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeued_message_that_never_returns_holds_its_key_only_until_the_bound() {
    use pgbox::transport::Subscriber;

    let h = harness().await;
    let topic = format!("t-{}", uuid::Uuid::now_v7().simple());
    let sub = h.undeclaring(&h.url);
    // A delivery limit of 0: the first requeue dead-letters the message.
    own_topology(&h.url, &sub, &topic, Some(0), true).await;
    let (a1, [id1, id2]) = a1_in_hand_a2_prefetched(&h, &sub, &topic).await;
    assert!(sub.nack(&a1, Duration::ZERO, "again").await.expect("nack"));
    drop(a1);
    // Bounded by next_one; without the bound, key a would stay held for good.
    let a2 = next_one(&sub, &topic).await;
    assert_eq!(a2.envelope().id, id2, "a2 after a1 was dropped");
    assert!(sub.ack(&a2).await.expect("ack"));
    let start = std::time::Instant::now();
    let dead = loop {
        let dead = sub.dead_letters(&topic, 10).await.expect("dead letters");
        if !dead.is_empty() || start.elapsed() > Duration::from_secs(10) {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ids: Vec<_> = dead.iter().map(|d| d.envelope.id).collect();
    assert_eq!(ids, [id1], "the broker dead-lettered a1");
}

/// The broker closes the publishing channel over one message of a batch (here 406
/// PRECONDITION_FAILED: over its `max_message_size`, 128 MiB by default), and every confirm
/// still pending on that channel fails with the same error. Only that message is refused
/// (counts an attempt at the relay); the others of the batch are published all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_closed_over_one_message_refuses_that_message_only() {
    use pgbox::transport::{PublishErrorKind, Publisher, Subscriber};

    let h = harness().await;
    let topic = h.fresh_topic().await;
    let rabbit = h.transport(&h.url);
    let batch = [
        conformance::envelope(&topic, "before"),
        conformance::envelope(&topic, vec![7u8; (128 << 20) + 1]),
        conformance::envelope(&topic, "after"),
        conformance::envelope(&topic, "last"),
    ];
    let results = rabbit.publish(&batch).await;
    let kinds: Vec<Option<PublishErrorKind>> = results
        .iter()
        .map(|r| r.as_ref().err().map(|e| e.kind()))
        .collect();
    assert_eq!(
        kinds,
        [None, Some(PublishErrorKind::Refused), None, None],
        "{results:?}"
    );

    // The three are in the queue (a message acked before the channel closed may be there
    // twice: at least once).
    let mut got = std::collections::BTreeSet::new();
    for _ in 0..50 {
        if got.len() == 3 {
            break;
        }
        for d in rabbit
            .receive(&topic, 10, Duration::from_secs(30))
            .await
            .unwrap()
        {
            got.insert(String::from_utf8(d.envelope().payload.clone()).unwrap());
            rabbit.ack(&d).await.unwrap();
        }
    }
    let want: std::collections::BTreeSet<String> =
        ["before", "after", "last"].map(String::from).into();
    assert_eq!(got, want);
    rabbit.close().await;
}
