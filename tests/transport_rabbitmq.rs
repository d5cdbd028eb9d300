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
        // No queue is bound for this topic: a mandatory publish comes back.
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
