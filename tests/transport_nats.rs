//! The NATS JetStream transport against a real server: the conformance suite, and the
//! whole pipeline (outbox → relay → JetStream → consumer → inbox) with connections cut
//! mid-flight.

mod support;

use std::time::Duration;

use pgbox::Envelope;
use pgbox::transport::conformance::{self, Capabilities, DeadLettered, Harness};
use pgbox::transport::nats::Nats;
use support::brokers::{self, Proxy};

/// Every connection of the transports under test goes through `proxy`, which can cut them.
struct NatsHarness {
    url: String,
    proxied: String,
    proxy: Proxy,
    max_payload: usize,
}

/// Visibility timeout of the test consumers.
const ACK_WAIT: Duration = Duration::from_secs(2);

async fn harness() -> NatsHarness {
    support::init_tracing();
    let url = brokers::nats_url().await;
    let proxy = Proxy::start(brokers::address(&url)).await;
    let proxied = brokers::with_address(&url, proxy.addr());
    let admin = transport(&url);
    let max_payload = admin.max_payload().await.expect("connect to NATS");
    NatsHarness {
        url,
        proxied,
        proxy,
        max_payload,
    }
}

/// One stream for all tests on the shared server (each test uses its own topics); it
/// forgets messages after an hour, and idle test consumers go after ten minutes.
fn transport(url: &str) -> Nats {
    Nats::builder(url)
        .stream("PGBOX_TEST")
        .subject_prefix("pgbox-test")
        .max_age(Duration::from_secs(3600))
        .inactive_threshold(Duration::from_secs(600))
        .ack_wait(ACK_WAIT)
        .receive_wait(Duration::from_millis(100))
        .build()
        .expect("valid config")
}

impl Harness for NatsHarness {
    type Publisher = Nats;
    type Subscriber = Nats;

    fn capabilities(&self) -> Capabilities {
        // Leave room for the headers within the server's max_payload.
        Capabilities::default()
            .per_key_order(false)
            .visibility(ACK_WAIT)
            .redelivery_after_crash(ACK_WAIT + Duration::from_secs(1))
            .max_payload(self.max_payload - (64 << 10))
    }

    async fn fresh_topic(&self) -> String {
        let topic = format!("t.{}", uuid::Uuid::now_v7().simple());
        transport(&self.url)
            .declare_topic(&topic)
            .await
            .expect("declare topic");
        topic
    }

    async fn publisher(&self) -> Nats {
        transport(&self.proxied)
    }

    async fn subscriber(&self) -> Nats {
        transport(&self.proxied)
    }

    async fn cut_connections(&self) {
        let cut = self.proxy.cut();
        assert!(cut > 0, "no connection to cut");
    }

    async fn dead_letters(&self, topic: &str) -> Vec<DeadLettered> {
        transport(&self.url)
            .dead_letters(topic, 100)
            .await
            .expect("list dead letters")
            .into_iter()
            .map(|d| DeadLettered::new(d.envelope, d.error))
            .collect()
    }

    async fn refused(&self, topic: &str) -> Option<Envelope> {
        // Over the server's max_payload.
        Some(conformance::envelope(
            topic,
            vec![7u8; self.max_payload + 1],
        ))
    }
}

pgbox::conformance_tests!(harness());

/// 1000 messages through relay → JetStream → consumer → inbox while the proxy cuts every
/// connection (publisher's and consumer's) several times: each message takes effect
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipeline_survives_cut_connections_without_loss_or_double_effects() {
    let h = harness().await;
    let topic = h.fresh_topic().await;
    let db = support::TestDb::migrated().await;
    brokers::pipeline_with_cuts(
        &db.pool,
        transport(&h.proxied),
        transport(&h.proxied),
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
    brokers::child_consumer(|_| transport(&h.url)).await;
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
        transport(&h.url),
        &topic,
        "child_consumer_process",
        "",
    )
    .await;
}

/// The payment/points example over this broker keeps its invariants under every fault flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_points_example_keeps_its_invariants() {
    support::init_tracing();
    let db = support::TestDb::empty().await;
    brokers::payment_points_on(&db.pool, &db.url(), "nats").await;
}

/// JetStream's answer to a publish it cannot take right now (a 503 API error: "JetStream
/// system temporarily unavailable" while a cluster has no quorum, "insufficient resources",
/// JetStream not enabled) is an outage, not a refusal of the message: the relay backs off
/// and never dead-letters it. A 4xx answer about the message stays a refusal. The stream is
/// stood in for by a plain subscriber on the subjects that answers each publish as
/// JetStream does (the server's own condition cannot be brought about on demand).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_503_is_an_outage_and_a_4xx_a_refusal() {
    use futures_util::StreamExt;
    use pgbox::transport::{PublishErrorKind, Publisher};

    support::init_tracing();
    let url = brokers::nats_url().await;
    let prefix = format!("pgbox-503-{}", uuid::Uuid::now_v7().simple());
    let nats = Nats::builder(&url)
        .subject_prefix(&prefix)
        // No stream takes these subjects: the responder below answers instead.
        .declare(false)
        .build()
        .unwrap();
    let client = async_nats::connect(&url).await.unwrap();
    let mut requests = client.subscribe(format!("{prefix}.>")).await.unwrap();
    client.flush().await.unwrap();
    let responder = tokio::spawn({
        let client = client.clone();
        async move {
            while let Some(request) = requests.next().await {
                let Some(reply) = request.reply else { continue };
                let answer = if request.subject.as_str().ends_with(".unavailable") {
                    r#"{"type":"io.nats.jetstream.api.v1.pub_ack","error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}"#
                } else {
                    r#"{"type":"io.nats.jetstream.api.v1.pub_ack","error":{"code":400,"err_code":10060,"description":"expected stream does not match"}}"#
                };
                client.publish(reply, answer.into()).await.unwrap();
            }
        }
    });

    let results = nats
        .publish(&[
            conformance::envelope("unavailable", "a"),
            conformance::envelope("refused", "b"),
        ])
        .await;
    responder.abort();
    let kinds: Vec<Option<PublishErrorKind>> = results
        .iter()
        .map(|r| r.as_ref().err().map(|e| e.kind()))
        .collect();
    assert_eq!(
        kinds,
        [
            Some(PublishErrorKind::Unavailable),
            Some(PublishErrorKind::Refused)
        ],
        "{results:?}"
    );
}
