//! The transport conformance suite: what every [`Publisher`] + [`Subscriber`] pair must do
//! for the relay and the [`Consumer`](crate::Consumer) runner to keep their promises.
//!
//! A transport's tests implement [`Harness`] (a few lines: make a fresh topic, build a
//! publisher and a subscriber, cut their connections, list dead letters) and run every check
//! with [`conformance_tests!`](crate::conformance_tests):
//!
//! ```text
//! async fn harness() -> MyHarness { /* connect to a real broker */ }
//! pgbox::conformance_tests!(harness());
//! ```
//!
//! Each check is also a public `async fn` taking the harness, for running them by hand. A
//! check panics with a message saying what the transport did wrong. Every wait is bounded.
//!
//! The checks:
//! - [`publish_confirms`]: a message reported `Ok` is in the broker (it is received); a
//!   message the broker refuses ([`Harness::refused`]) is reported `Err`.
//! - [`redelivers_after_consumer_dies`]: deliveries a consumer took and never settled come
//!   back to another consumer, with a higher attempt number.
//! - [`nack_delay_is_respected`]: a nack with a delay redelivers no earlier than the delay.
//! - [`attempts_grow_then_dead_letter`]: the attempt counter grows by one per redelivery; a
//!   dead-lettered message is not delivered again and can be inspected.
//! - [`byte_exact`]: message id, topic, ordering key, content type, headers (including
//!   `traceparent`), creation time and payloads from 0 bytes to several MiB arrive unchanged.
//! - [`per_key_order`] (when [`Capabilities::per_key_order`] is claimed): one message per key
//!   in hand at a time, keys in publication order.
//! - [`requeue_keeps_key_order`] (when [`Capabilities::per_key_order`] is claimed): a
//!   message nacked with a zero delay comes back before the later messages of its key,
//!   even those the consumer already holds (a broker's prefetch buffer).
//! - [`survives_cut_connection`]: after the connections are cut, the same publisher and
//!   subscriber instances carry on, and no confirmed message is lost.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::time::{Duration, Instant};

use time::OffsetDateTime;
use uuid::Uuid;

use super::{Publisher, Subscriber};
use crate::outbox::{Envelope, TRACEPARENT};

/// What a transport claims, which decides how some checks run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// At most one message per ordering key is in hand at a time, and a key's messages are
    /// delivered in publication order, also across a nack with a zero delay (a nack with a
    /// delay may let later messages of the key overtake). Checked by [`per_key_order`] and
    /// [`requeue_keeps_key_order`].
    pub per_key_order: bool,
    /// The visibility timeout the checks pass to [`Subscriber::receive`].
    pub visibility: Duration,
    /// Upper bound on how long after a consumer died its unsettled deliveries come back.
    pub redelivery_after_crash: Duration,
    /// The largest payload the checks send (several MiB unless the broker is limited).
    pub max_payload: usize,
    /// A redelivery after the consumer holding a message died counts as attempt 2 or more
    /// (checked by [`redelivers_after_consumer_dies`]). A transport that keeps the count
    /// somewhere the broker under test does not support says `false`, and says so in its
    /// docs.
    pub attempts_survive_consumer_death: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            per_key_order: false,
            visibility: Duration::from_secs(2),
            redelivery_after_crash: Duration::from_secs(10),
            max_payload: 4 << 20,
            attempts_survive_consumer_death: true,
        }
    }
}

impl Capabilities {
    /// Claims (or not) per-key order.
    pub fn per_key_order(mut self, claimed: bool) -> Self {
        self.per_key_order = claimed;
        self
    }

    /// Sets the visibility timeout passed to `receive`.
    pub fn visibility(mut self, visibility: Duration) -> Self {
        self.visibility = visibility;
        self
    }

    /// Sets the bound on redelivery after a consumer died.
    pub fn redelivery_after_crash(mut self, bound: Duration) -> Self {
        self.redelivery_after_crash = bound;
        self
    }

    /// Claims (or not) that attempts are counted across a consumer's death.
    pub fn attempts_survive_consumer_death(mut self, claimed: bool) -> Self {
        self.attempts_survive_consumer_death = claimed;
        self
    }

    /// Sets the largest payload sent.
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }
}

/// A dead-lettered message as the transport shows it to an operator.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLettered {
    /// The message.
    pub envelope: Envelope,
    /// The error given to [`Subscriber::dead_letter`], if the transport keeps it.
    pub error: Option<String>,
}

impl DeadLettered {
    /// A dead letter with the error the transport recorded.
    pub fn new(envelope: Envelope, error: Option<String>) -> Self {
        DeadLettered { envelope, error }
    }
}

/// What a transport's tests supply to run the suite against a real broker.
///
/// Set-up failures (cannot connect, cannot declare) should panic with a clear message: a
/// broker that is not there is a failed test, not a skipped one.
pub trait Harness: Send + Sync {
    /// The publishing side.
    type Publisher: Publisher;
    /// The receiving side.
    type Subscriber: Subscriber;

    /// What the transport claims.
    fn capabilities(&self) -> Capabilities;

    /// A topic no other check uses, ready so that a message published to it now is kept
    /// for subscribers (queues declared, streams created...).
    fn fresh_topic(&self) -> impl Future<Output = String> + Send;

    /// A new publisher. Its connections must be among those [`Harness::cut_connections`]
    /// cuts.
    fn publisher(&self) -> impl Future<Output = Self::Publisher> + Send;

    /// A new subscriber, standing for a consumer process. Its connections must be among
    /// those [`Harness::cut_connections`] cuts.
    fn subscriber(&self) -> impl Future<Output = Self::Subscriber> + Send;

    /// The consumer process owning `subscriber` dies without settling what it holds. The
    /// default drops it; transports whose client would settle or close gracefully on drop
    /// should cut its connection instead.
    fn crash(&self, subscriber: Self::Subscriber) -> impl Future<Output = ()> + Send {
        drop(subscriber);
        async {}
    }

    /// Severs the network connections of every publisher and subscriber this harness made,
    /// without their cooperation (a proxy that drops its sockets, a server-side kill).
    fn cut_connections(&self) -> impl Future<Output = ()> + Send;

    /// The dead letters of `topic`, as an operator would inspect them.
    fn dead_letters(&self, topic: &str) -> impl Future<Output = Vec<DeadLettered>> + Send;

    /// A message for `topic` that the broker must refuse (report `Err` for), if the
    /// transport has such a thing (e.g. one no queue is bound to, when publishing is
    /// `mandatory`). `None` skips that part of [`publish_confirms`].
    fn refused(&self, topic: &str) -> impl Future<Output = Option<Envelope>> + Send {
        let _ = topic;
        async { None }
    }
}

/// Generates one `#[tokio::test]` per conformance check, each calling `$harness` (an
/// expression evaluating to a future of a [`Harness`]) for a fresh harness. Needs `tokio`
/// with the `macros` and `rt-multi-thread` features in the calling crate.
#[macro_export]
macro_rules! conformance_tests {
    ($harness:expr) => {
        $crate::conformance_tests!(@one $harness, conformance_publish_confirms, publish_confirms);
        $crate::conformance_tests!(@one $harness, conformance_redelivers_after_consumer_dies, redelivers_after_consumer_dies);
        $crate::conformance_tests!(@one $harness, conformance_nack_delay_is_respected, nack_delay_is_respected);
        $crate::conformance_tests!(@one $harness, conformance_attempts_grow_then_dead_letter, attempts_grow_then_dead_letter);
        $crate::conformance_tests!(@one $harness, conformance_byte_exact, byte_exact);
        $crate::conformance_tests!(@one $harness, conformance_per_key_order, per_key_order);
        $crate::conformance_tests!(@one $harness, conformance_requeue_keeps_key_order, requeue_keeps_key_order);
        $crate::conformance_tests!(@one $harness, conformance_survives_cut_connection, survives_cut_connection);
    };
    (@one $harness:expr, $test:ident, $check:ident) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let harness = $harness.await;
            $crate::transport::conformance::$check(&harness).await;
        }
    };
}

/// An envelope for `topic` with a fresh id, for tests (the creation time is rounded to
/// microseconds, PostgreSQL's precision).
pub fn envelope(topic: &str, payload: impl Into<Vec<u8>>) -> Envelope {
    let now = OffsetDateTime::now_utc();
    let created_at = now
        .replace_nanosecond(now.nanosecond() / 1000 * 1000)
        .expect("valid nanosecond");
    Envelope {
        seq: 0,
        id: Uuid::now_v7(),
        topic: topic.to_owned(),
        ordering_key: None,
        payload: payload.into(),
        content_type: "application/octet-stream".into(),
        headers: BTreeMap::new(),
        created_at,
        attempts: 0,
    }
}

const POLL: Duration = Duration::from_millis(20);

/// Receives until `want` deliveries are in hand or `limit` passes; returns what it got.
/// Receive errors are retried (a reconnecting transport may report one).
async fn collect<S: Subscriber>(
    sub: &S,
    topic: &str,
    want: usize,
    visibility: Duration,
    limit: Duration,
) -> Vec<S::Delivery> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < want && start.elapsed() < limit {
        match sub.receive(topic, want - got.len(), visibility).await {
            Ok(batch) if !batch.is_empty() => got.extend(batch),
            Ok(_) => tokio::time::sleep(POLL).await,
            Err(e) => {
                tracing::debug!(error = %e, "conformance: receive failed; retrying");
                tokio::time::sleep(POLL * 5).await;
            }
        }
    }
    got
}

/// Asserts that nothing of `topic` is delivered within `wait`.
async fn assert_quiet<S: Subscriber>(sub: &S, topic: &str, visibility: Duration, wait: Duration) {
    let got = collect(sub, topic, 1, visibility, wait).await;
    if let Some(d) = got.first() {
        panic!(
            "expected no delivery on {topic}, got message {} (attempt {})",
            sub.envelope(d).id,
            sub.attempt(d)
        );
    }
}

async fn publish_all<P: Publisher>(publisher: &P, batch: &[Envelope]) {
    let results = publisher.publish(batch).await;
    assert_eq!(
        results.len(),
        batch.len(),
        "publish returned a result per message"
    );
    for (e, r) in batch.iter().zip(results) {
        if let Err(err) = r {
            panic!("publishing message {} failed: {err}", e.id);
        }
    }
}

async fn ack_all<S: Subscriber>(sub: &S, deliveries: &[S::Delivery]) {
    for d in deliveries {
        let acked = sub.ack(d).await.expect("ack");
        assert!(acked, "ack of a fresh delivery reported stale");
    }
}

fn ids<S: Subscriber>(sub: &S, deliveries: &[S::Delivery]) -> BTreeSet<Uuid> {
    deliveries.iter().map(|d| sub.envelope(d).id).collect()
}

/// A message reported `Ok` is durably in the broker; a refused one is `Err`.
pub async fn publish_confirms<H: Harness>(h: &H) {
    let caps = h.capabilities();
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let sub = h.subscriber().await;
    let batch: Vec<Envelope> = (0..50).map(|i| envelope(&topic, format!("m{i}"))).collect();
    publish_all(&publisher, &batch).await;
    let got = collect(&sub, &topic, 50, caps.visibility, Duration::from_secs(20)).await;
    let want: BTreeSet<Uuid> = batch.iter().map(|e| e.id).collect();
    assert_eq!(
        ids(&sub, &got),
        want,
        "every confirmed message is received once"
    );
    assert_eq!(got.len(), 50, "no message received twice");
    ack_all(&sub, &got).await;

    if let Some(bad) = h.refused(&topic).await {
        let good1 = envelope(&topic, "before");
        let good2 = envelope(&topic, "after");
        let batch = vec![good1, bad, good2];
        let results = publisher.publish(&batch).await;
        assert_eq!(results.len(), 3, "publish returned a result per message");
        assert!(
            results[1].is_err(),
            "a message the broker refused was reported Ok"
        );
        let confirmed: BTreeSet<Uuid> = batch
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|(e, _)| e.id)
            .collect();
        let got = collect(
            &sub,
            &topic,
            confirmed.len(),
            caps.visibility,
            Duration::from_secs(20),
        )
        .await;
        assert_eq!(
            ids(&sub, &got),
            confirmed,
            "the confirmed neighbours of a refused message are received"
        );
        ack_all(&sub, &got).await;
    }
    assert_quiet(&sub, &topic, caps.visibility, Duration::from_millis(500)).await;
}

/// Deliveries held by a consumer that dies come back, to another consumer, with a higher
/// attempt number (unless [`Capabilities::attempts_survive_consumer_death`] is `false`).
pub async fn redelivers_after_consumer_dies<H: Harness>(h: &H) {
    let caps = h.capabilities();
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let batch: Vec<Envelope> = (0..3).map(|i| envelope(&topic, format!("m{i}"))).collect();
    publish_all(&publisher, &batch).await;
    let first = h.subscriber().await;
    let taken = collect(&first, &topic, 3, caps.visibility, Duration::from_secs(20)).await;
    assert_eq!(taken.len(), 3, "the first consumer received the messages");
    for d in &taken {
        assert_eq!(first.attempt(d), 1, "a first delivery is attempt 1");
    }
    drop(taken);
    h.crash(first).await;

    let second = h.subscriber().await;
    let limit = caps.redelivery_after_crash + Duration::from_secs(10);
    let again = collect(&second, &topic, 3, caps.visibility, limit).await;
    let want: BTreeSet<Uuid> = batch.iter().map(|e| e.id).collect();
    assert_eq!(
        ids(&second, &again),
        want,
        "every message the dead consumer held is redelivered"
    );
    let least = if caps.attempts_survive_consumer_death {
        2
    } else {
        1
    };
    for d in &again {
        assert!(
            second.attempt(d) >= least,
            "a redelivery after a consumer died is attempt {}, expected at least {least}",
            second.attempt(d)
        );
    }
    ack_all(&second, &again).await;
    assert_quiet(&second, &topic, caps.visibility, Duration::from_millis(500)).await;
}

/// A nack with a delay redelivers no earlier than the delay.
pub async fn nack_delay_is_respected<H: Harness>(h: &H) {
    let caps = h.capabilities();
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let sub = h.subscriber().await;
    let message = envelope(&topic, "later");
    publish_all(&publisher, std::slice::from_ref(&message)).await;
    let got = collect(&sub, &topic, 1, caps.visibility, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "the message was received");
    let delay = Duration::from_millis(1500);
    let nacked_at = Instant::now();
    let fresh = sub.nack(&got[0], delay, "try later").await.expect("nack");
    assert!(fresh, "nack of a fresh delivery reported stale");
    let again = collect(
        &sub,
        &topic,
        1,
        caps.visibility,
        delay + Duration::from_secs(20),
    )
    .await;
    let elapsed = nacked_at.elapsed();
    assert_eq!(again.len(), 1, "the nacked message came back");
    assert_eq!(sub.envelope(&again[0]).id, message.id);
    assert!(
        elapsed >= delay,
        "redelivered {elapsed:?} after a nack with delay {delay:?}"
    );
    assert_eq!(
        sub.attempt(&again[0]),
        2,
        "the redelivery after a nack is attempt 2"
    );
    ack_all(&sub, &again).await;
}

/// The attempt counter grows by one per redelivery; a dead-lettered message is not
/// delivered again and shows up in the dead letters with its payload and error.
pub async fn attempts_grow_then_dead_letter<H: Harness>(h: &H) {
    const LIMIT: i32 = 4;
    let caps = h.capabilities();
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let sub = h.subscriber().await;
    let mut message = envelope(&topic, b"poison \x00\xff".to_vec());
    message.headers.insert("kind".into(), "poison".into());
    publish_all(&publisher, std::slice::from_ref(&message)).await;
    for expected in 1..=LIMIT {
        let got = collect(&sub, &topic, 1, caps.visibility, Duration::from_secs(20)).await;
        assert_eq!(got.len(), 1, "delivery {expected} arrived");
        let d = &got[0];
        assert_eq!(sub.envelope(d).id, message.id);
        assert_eq!(
            sub.attempt(d),
            expected,
            "attempt counter after {} nacks",
            expected - 1
        );
        if expected < LIMIT {
            let fresh = sub
                .nack(d, Duration::from_millis(10), "failed")
                .await
                .expect("nack");
            assert!(fresh, "nack of a fresh delivery reported stale");
        } else {
            let fresh = sub
                .dead_letter(d, "gave up after 4 attempts")
                .await
                .expect("dead_letter");
            assert!(fresh, "dead_letter of a fresh delivery reported stale");
        }
    }
    assert_quiet(&sub, &topic, caps.visibility, Duration::from_secs(1)).await;
    let start = Instant::now();
    let dead = loop {
        let dead = h.dead_letters(&topic).await;
        if !dead.is_empty() || start.elapsed() > Duration::from_secs(10) {
            break dead;
        }
        tokio::time::sleep(POLL * 5).await;
    };
    assert_eq!(dead.len(), 1, "one dead letter on {topic}");
    let d = &dead[0];
    assert_eq!(d.envelope.id, message.id);
    assert_eq!(d.envelope.payload, message.payload);
    assert_eq!(d.envelope.headers, message.headers);
    if let Some(error) = &d.error {
        assert_eq!(error, "gave up after 4 attempts");
    }
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = vec![0u8; len];
    rng.fill(&mut out);
    out
}

/// Ids, topic, ordering key, content type, headers, creation time and payloads (0 bytes to
/// several MiB, every byte value) arrive unchanged.
pub async fn byte_exact<H: Harness>(h: &H) {
    let caps = h.capabilities();
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let sub = h.subscriber().await;
    let mut sizes = vec![0, 1, 256, 64 << 10, 1 << 20, caps.max_payload];
    sizes.retain(|&s| s <= caps.max_payload);
    sizes.dedup();
    let mut batch = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let payload = if size == 256 {
            (0..=255u8).collect()
        } else {
            pseudo_random(size, i as u64)
        };
        let mut e = envelope(&topic, payload);
        e.content_type = [
            "application/octet-stream",
            "application/json; charset=utf-8",
        ][i % 2]
            .into();
        e.headers.insert(
            TRACEPARENT.into(),
            format!("00-{:032x}-{:016x}-01", 0xabcdef_u128 + i as u128, 0x42 + i),
        );
        e.headers
            .insert("tracestate".into(), "vendor=a:b,other=c".into());
        e.headers.insert("empty".into(), String::new());
        e.headers
            .insert("Unicode-Ключ".into(), "значение ✓ \"quoted\"".into());
        if i % 2 == 0 {
            e.ordering_key = Some(format!("key-{i} with spaces/ü"));
        }
        batch.push(e);
    }
    // Big payloads one at a time: a transport may cap a batch's size, not a message's.
    for e in &batch {
        publish_all(&publisher, std::slice::from_ref(e)).await;
    }
    let got = collect(
        &sub,
        &topic,
        batch.len(),
        caps.visibility,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(got.len(), batch.len(), "every message arrived");
    let sent: HashMap<Uuid, &Envelope> = batch.iter().map(|e| (e.id, e)).collect();
    for d in &got {
        let e = sub.envelope(d);
        let want = sent
            .get(&e.id)
            .unwrap_or_else(|| panic!("unexpected message id {}", e.id));
        assert_eq!(e.topic, want.topic, "topic");
        assert_eq!(e.ordering_key, want.ordering_key, "ordering key");
        assert_eq!(e.content_type, want.content_type, "content type");
        assert_eq!(e.headers, want.headers, "headers");
        assert_eq!(e.created_at, want.created_at, "creation time");
        assert!(
            e.payload == want.payload,
            "payload of {} bytes arrived as {} different bytes",
            want.payload.len(),
            e.payload.len()
        );
    }
    ack_all(&sub, &got).await;
}

/// With per-key order claimed: at most one message of a key in hand at a time, and each
/// key's messages in publication order. A no-op for transports that do not claim it.
pub async fn per_key_order<H: Harness>(h: &H) {
    let caps = h.capabilities();
    if !caps.per_key_order {
        tracing::info!("conformance: per-key order not claimed; skipped");
        return;
    }
    const KEYS: usize = 5;
    const PER_KEY: usize = 20;
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let sub = h.subscriber().await;
    let mut batch = Vec::new();
    for n in 0..PER_KEY {
        for k in 0..KEYS {
            let mut e = envelope(&topic, format!("{k}:{n}"));
            e.ordering_key = Some(format!("k{k}"));
            batch.push(e);
        }
    }
    publish_all(&publisher, &batch).await;
    let mut next = [0usize; KEYS];
    let mut in_hand: Vec<S<H>> = Vec::new();
    type S<H> = <<H as Harness>::Subscriber as Subscriber>::Delivery;
    let start = Instant::now();
    let mut done = 0;
    while done < KEYS * PER_KEY {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "per-key order: only {done} of {} messages after 60 s",
            KEYS * PER_KEY
        );
        let got = sub
            .receive(&topic, 8, caps.visibility)
            .await
            .expect("receive");
        for d in got {
            let e = sub.envelope(&d);
            let body = String::from_utf8(e.payload.clone()).expect("utf-8");
            let (k, n) = body.split_once(':').expect("k:n");
            let (k, n): (usize, usize) = (k.parse().unwrap(), n.parse().unwrap());
            assert!(
                !in_hand
                    .iter()
                    .any(|h| sub.envelope(h).ordering_key == e.ordering_key),
                "two messages of key k{k} in hand at once"
            );
            assert_eq!(n, next[k], "key k{k} delivered out of order");
            next[k] += 1;
            in_hand.push(d);
        }
        // Settle in an order unlike the delivery order: newest first, half of them.
        let settle = in_hand.len().div_ceil(2);
        for d in in_hand.split_off(in_hand.len() - settle).into_iter().rev() {
            assert!(sub.ack(&d).await.expect("ack"), "ack reported stale");
            done += 1;
        }
        if settle == 0 {
            tokio::time::sleep(POLL).await;
        }
    }
}

/// With per-key order claimed: a message nacked with a zero delay is delivered again before
/// the later messages of its key, including those the subscriber already received from the
/// broker (prefetched) while it was in hand. A no-op for transports that do not claim it.
pub async fn requeue_keeps_key_order<H: Harness>(h: &H) {
    let caps = h.capabilities();
    if !caps.per_key_order {
        tracing::info!("conformance: per-key order not claimed; skipped");
        return;
    }
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let sub = h.subscriber().await;
    // Two keys interleaved, in one batch: a1 b1 a2 b2 a3 b3.
    let mut batch = Vec::new();
    for n in 1..=3 {
        for k in ["a", "b"] {
            let mut e = envelope(&topic, format!("{k}{n}"));
            e.ordering_key = Some(k.to_owned());
            batch.push(e);
        }
    }
    publish_all(&publisher, &batch).await;
    let name = |sub: &H::Subscriber, d: &S<H>| {
        String::from_utf8(sub.envelope(d).payload.clone()).expect("utf-8")
    };
    type S<H> = <<H as Harness>::Subscriber as Subscriber>::Delivery;

    // The heads of both keys, a1 and b1.
    let heads = collect(&sub, &topic, 2, caps.visibility, Duration::from_secs(20)).await;
    let mut names: Vec<String> = heads.iter().map(|d| name(&sub, d)).collect();
    names.sort();
    assert_eq!(names, ["a1", "b1"], "the heads of the two keys come first");
    let (a1, b1): (Vec<_>, Vec<_>) = heads.into_iter().partition(|d| name(&sub, d) == "a1");
    // Settling b1 lets b2 out. b2 was published after a2, so once b2 is here a2 has reached
    // this subscriber too (on a broker that sends ahead, it waits in the prefetch buffer).
    ack_all(&sub, &b1).await;
    let b2 = collect(&sub, &topic, 1, caps.visibility, Duration::from_secs(20)).await;
    assert_eq!(b2.len(), 1, "b2 arrived");
    assert_eq!(
        name(&sub, &b2[0]),
        "b2",
        "only b2 may come while a1 is in hand"
    );
    ack_all(&sub, &b2).await;

    let fresh = sub
        .nack(&a1[0], Duration::ZERO, "again")
        .await
        .expect("nack");
    assert!(fresh, "nack of a fresh delivery reported stale");
    drop(a1);

    // What comes next, each settled as soon as it arrives: a1 again, then a2, a3 (and b3).
    let mut order: Vec<(String, i32)> = Vec::new();
    let start = Instant::now();
    while order.len() < 4 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "after the nack only {order:?} arrived within 30 s"
        );
        let got = sub
            .receive(&topic, 8, caps.visibility)
            .await
            .expect("receive");
        if got.is_empty() {
            tokio::time::sleep(POLL).await;
        }
        for d in &got {
            order.push((name(&sub, d), sub.attempt(d)));
        }
        ack_all(&sub, &got).await;
    }
    let key_a: Vec<&str> = order
        .iter()
        .filter(|(n, _)| n.starts_with('a'))
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        key_a,
        ["a1", "a2", "a3"],
        "key a after a1 was nacked with a zero delay (all deliveries: {order:?})"
    );
    let again = order.iter().find(|(n, _)| n == "a1").expect("a1 again");
    assert_eq!(again.1, 2, "the redelivery of a1 is attempt 2");
    assert_quiet(&sub, &topic, caps.visibility, Duration::from_millis(500)).await;
}

/// After the connections are cut, the same publisher and subscriber carry on (reconnecting
/// as needed), and every message confirmed before or after the cut is received.
pub async fn survives_cut_connection<H: Harness>(h: &H) {
    let caps = h.capabilities();
    let topic = h.fresh_topic().await;
    let publisher = h.publisher().await;
    let sub = h.subscriber().await;
    let before: Vec<Envelope> = (0..10).map(|i| envelope(&topic, format!("b{i}"))).collect();
    publish_all(&publisher, &before).await;
    let got = collect(&sub, &topic, 10, caps.visibility, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 10, "received before the cut");
    // Settle half; the other half is in hand when the connection goes.
    ack_all(&sub, &got[..5]).await;
    let mut pending: BTreeSet<Uuid> = ids(&sub, &got[5..]);
    drop(got);

    h.cut_connections().await;

    // Publish after the cut the way the relay does: retry what failed, bounded.
    let after: Vec<Envelope> = (0..10).map(|i| envelope(&topic, format!("a{i}"))).collect();
    let mut unconfirmed: Vec<Envelope> = after;
    let start = Instant::now();
    while !unconfirmed.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "publisher did not recover within 30 s of the cut"
        );
        let results = publisher.publish(&unconfirmed).await;
        assert_eq!(results.len(), unconfirmed.len());
        let mut failed = Vec::new();
        for (e, r) in unconfirmed.into_iter().zip(results) {
            match r {
                Ok(()) => {
                    pending.insert(e.id);
                }
                Err(err) => {
                    tracing::debug!(error = %err, "conformance: publish after cut failed; retrying");
                    failed.push(e);
                }
            }
        }
        unconfirmed = failed;
        if !unconfirmed.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let limit = caps.redelivery_after_crash + caps.visibility + Duration::from_secs(30);
    let start = Instant::now();
    while !pending.is_empty() {
        assert!(
            start.elapsed() < limit,
            "{} confirmed messages not received within {limit:?} of the cut",
            pending.len()
        );
        match sub.receive(&topic, 20, caps.visibility).await {
            Ok(batch) => {
                for d in &batch {
                    pending.remove(&sub.envelope(d).id);
                    // An ack may fail right after a reconnect; redelivery covers it.
                    let _ = sub.ack(d).await;
                }
                if batch.is_empty() {
                    tokio::time::sleep(POLL).await;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "conformance: receive after cut failed; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
