//! Fan-out through a `Router`: one enqueue reaches several destinations, each with its own
//! delivery state. A destination that is down, refuses, or hangs holds only its own copies
//! (and, for a refusal, only that key there); per-key order holds at every destination; the
//! deferred payloads are gone once every destination has its copy.

mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    CancellationToken, DESTINATIONS_HEADER, Envelope, Message, Migrator, Outbox, Relay,
    RetryPolicy, Router, RouterBuilder,
};
use sqlx::{PgPool, Row};
use support::TestDb;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Up,
    Unavailable,
    Hang,
}

#[derive(Debug)]
struct Inner {
    mode: Mutex<Mode>,
    got: Mutex<Vec<Envelope>>,
    refuse: Mutex<HashSet<Uuid>>,
    calls: AtomicUsize,
}

/// A destination that records what it receives and can be switched to refuse a message,
/// to be unavailable, or to never answer. Clones share their state (one broker).
#[derive(Debug, Clone)]
struct TestDest(Arc<Inner>);

impl TestDest {
    fn new() -> Self {
        TestDest(Arc::new(Inner {
            mode: Mutex::new(Mode::Up),
            got: Mutex::new(Vec::new()),
            refuse: Mutex::new(HashSet::new()),
            calls: AtomicUsize::new(0),
        }))
    }

    fn set(&self, mode: Mode) {
        *self.0.mode.lock().unwrap() = mode;
    }

    fn refuse(&self, id: Uuid, refuse: bool) {
        let mut set = self.0.refuse.lock().unwrap();
        if refuse {
            set.insert(id);
        } else {
            set.remove(&id);
        }
    }

    fn got(&self) -> Vec<Envelope> {
        self.0.got.lock().unwrap().clone()
    }
}

impl Publisher for TestDest {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.calls.fetch_add(1, Ordering::SeqCst);
        let mode = *self.0.mode.lock().unwrap();
        match mode {
            Mode::Hang => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                vec![Err(PublishError::unavailable("hung")); batch.len()]
            }
            Mode::Unavailable => vec![Err(PublishError::unavailable("broker down")); batch.len()],
            Mode::Up => {
                let refuse = self.0.refuse.lock().unwrap().clone();
                let mut got = self.0.got.lock().unwrap();
                batch
                    .iter()
                    .map(|m| {
                        if refuse.contains(&m.id) {
                            Err(PublishError::refused(format!("message {} refused", m.id)))
                        } else {
                            got.push(m.clone());
                            Ok(())
                        }
                    })
                    .collect()
            }
        }
    }
}

/// `n` messages on `topic`, keys `k0..k{keys}` round robin, payload `key:i` (i counts per
/// key), `per_tx` messages per transaction. Returns the messages' ids in enqueue order.
async fn enqueue(pool: &PgPool, topic: &str, n: usize, keys: usize, per_tx: usize) -> Vec<Uuid> {
    let outbox = Outbox::new();
    let mut ids = Vec::with_capacity(n);
    let mut counters = vec![0usize; keys];
    let mut i = 0;
    while i < n {
        let mut tx = pool.begin().await.unwrap();
        for _ in 0..per_tx.min(n - i) {
            let k = i % keys;
            let message = Message::bytes(topic, format!("k{k}:{}", counters[k]).into_bytes())
                .ordering_key(format!("k{k}"));
            counters[k] += 1;
            ids.push(message.id());
            outbox.enqueue(&mut tx, message).await.unwrap();
            i += 1;
        }
        tx.commit().await.unwrap();
    }
    ids
}

/// Per key, the sequence numbers received, in arrival order.
fn by_key(got: &[Envelope]) -> BTreeMap<String, Vec<usize>> {
    let mut out: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for e in got {
        let text = String::from_utf8(e.payload.clone()).unwrap();
        let (key, n) = text.split_once(':').unwrap();
        out.entry(key.to_owned())
            .or_default()
            .push(n.parse().unwrap());
    }
    out
}

/// Every message of `n` over `keys` keys arrived exactly once, in order per key.
fn assert_exactly_once_in_order(what: &str, got: &[Envelope], n: usize, keys: usize) {
    let ids: HashSet<Uuid> = got.iter().map(|e| e.id).collect();
    assert_eq!(ids.len(), got.len(), "{what}: duplicates");
    assert_eq!(got.len(), n, "{what}: {} of {n} messages", got.len());
    for (key, seen) in by_key(got) {
        let expected: Vec<usize> = (0..seen.len()).collect();
        assert_eq!(seen, expected, "{what}: key {key} out of order");
    }
    assert_eq!(by_key(got).len(), keys.min(n), "{what}: keys");
}

/// Every message arrived at least once and, per key, the first arrivals are in order
/// (a re-publish repeats a run it already sent: the inbox absorbs it).
fn assert_all_in_order(what: &str, got: &[Envelope], n: usize) {
    let mut first: Vec<Envelope> = Vec::new();
    let mut seen = HashSet::new();
    for e in got {
        if seen.insert(e.id) {
            first.push(e.clone());
        }
    }
    assert_eq!(first.len(), n, "{what}: {} of {n} messages", first.len());
    for (key, seen) in by_key(&first) {
        let expected: Vec<usize> = (0..seen.len()).collect();
        assert_eq!(seen, expected, "{what}: key {key} out of order");
    }
}

fn builder(pool: &PgPool, a: &TestDest, b: &TestDest, c: &TestDest) -> RouterBuilder {
    Router::builder(pool.clone())
        .destination("a", a.clone())
        .destination("b", b.clone())
        .destination("c", c.clone())
        .route("orders.>", ["a", "b", "c"])
        .away_backoff(Duration::from_millis(20), Duration::from_millis(100))
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5)),
        )
        .poll_interval(Duration::from_millis(20))
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM pgbox.{table}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn deferred_left(pool: &PgPool) -> (i64, i64) {
    (
        count(pool, "outbox_fanout_deliveries").await,
        count(pool, "outbox_fanout_messages").await,
    )
}

#[tokio::test]
async fn one_enqueue_reaches_three_destinations_exactly_once_in_key_order() {
    let db = TestDb::migrated().await;
    Migrator::new()
        .schema("points")
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let (a, b) = (TestDest::new(), TestDest::new());
    let router = Arc::new(
        Router::builder(db.pool.clone())
            .destination("a", a.clone())
            .destination("b", b.clone())
            .destination(
                "points",
                PgQueue::with_schema(db.pool.clone(), "points").unwrap(),
            )
            .route("orders.*", ["a", "b"])
            .route("orders.created", ["points"])
            .build()
            .unwrap(),
    );
    enqueue(&db.pool, "orders.created", 300, 7, 25).await;
    let relay = Relay::builder(db.pool.clone(), router.clone())
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 300);
    assert_exactly_once_in_order("a", &a.got(), 300, 7);
    assert_exactly_once_in_order("b", &b.got(), 300, 7);
    let rows = sqlx::query("SELECT message_id, payload FROM points.queue ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let in_queue: Vec<Envelope> = rows
        .iter()
        .map(|r| Envelope::new(r.get(0), "orders.created", r.get::<Vec<u8>, _>(1)))
        .collect();
    assert_exactly_once_in_order("points", &in_queue, 300, 7);
    // Nothing was deferred: every destination took its copy at once.
    assert_eq!(deferred_left(&db.pool).await, (0, 0));
}

#[tokio::test]
async fn a_destination_down_longer_than_every_budget_holds_only_its_own_copies() {
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    c.set(Mode::Unavailable);
    let router = Arc::new(
        builder(&db.pool, &a, &b, &c)
            .max_attempts(2)
            .build()
            .unwrap(),
    );
    let relay = Relay::builder(db.pool.clone(), router.clone())
        .max_attempts(2)
        .build()
        .unwrap();
    enqueue(&db.pool, "orders.placed", 400, 10, 40).await;
    let started = Instant::now();
    let report = relay.drain().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!((report.published, report.dead_lettered), (400, 0));
    assert_exactly_once_in_order("a", &a.got(), 400, 10);
    assert_exactly_once_in_order("b", &b.got(), 400, 10);
    assert!(c.got().is_empty());
    // The away destination was called about once, not once per batch.
    let calls = c.0.calls.load(Ordering::SeqCst);
    assert!(calls <= 3, "c was called {calls} times while away");

    // Far longer than every retry budget: drains find it unavailable, never count it.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let r = router.drain().await.unwrap();
        assert_eq!(r.dead, 0);
    }
    let status = router.status().await.unwrap();
    let c_status = status.iter().find(|s| s.destination == "c").unwrap();
    assert_eq!((c_status.deferred, c_status.dead), (400, 0));
    assert!(
        status
            .iter()
            .filter(|s| s.destination != "c")
            .all(|s| s.deferred == 0)
    );
    assert_eq!(count(&db.pool, "outbox_dead_letters").await, 0);
    assert_eq!(count(&db.pool, "outbox").await, 0);

    c.set(Mode::Up);
    tokio::time::sleep(Duration::from_millis(120)).await;
    let r = router.drain().await.unwrap();
    assert_eq!(r.delivered, 400);
    assert_exactly_once_in_order("c", &c.got(), 400, 10);
    assert_eq!(
        deferred_left(&db.pool).await,
        (0, 0),
        "payload rows left behind"
    );
}

#[tokio::test]
async fn a_refused_message_holds_only_its_key_at_its_destination_until_redelivered() {
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    let router = Arc::new(
        builder(&db.pool, &a, &b, &c)
            .max_attempts(3)
            .build()
            .unwrap(),
    );
    let relay = Relay::builder(db.pool.clone(), router.clone())
        .build()
        .unwrap();
    // Keys k0, k1 alternate: ids[2] is k0's second message.
    let ids = {
        let outbox = Outbox::new();
        let mut ids = Vec::new();
        let messages: Vec<Message> = (0..20)
            .map(|i| {
                Message::bytes("orders.x", format!("k{}:{}", i % 2, i / 2).into_bytes())
                    .ordering_key(format!("k{}", i % 2))
            })
            .collect();
        for m in &messages {
            ids.push(m.id());
        }
        c.refuse(ids[2], true);
        let mut tx = db.pool.begin().await.unwrap();
        for m in messages {
            outbox.enqueue(&mut tx, m).await.unwrap();
        }
        tx.commit().await.unwrap();
        ids
    };
    relay.drain().await.unwrap();
    assert_exactly_once_in_order("a", &a.got(), 20, 2);
    assert_exactly_once_in_order("b", &b.got(), 20, 2);
    let at_c = by_key(&c.got());
    assert_eq!(
        at_c["k1"],
        (0..10).collect::<Vec<_>>(),
        "the other key flows"
    );
    assert_eq!(at_c["k0"], vec![0], "the refused key stops at its refusal");

    // Refused max_attempts times in all: dead, still holding k0 at c only.
    let mut dead = Vec::new();
    for _ in 0..200 {
        router.drain().await.unwrap();
        dead = router.dead_letters("c", 10).await.unwrap();
        if !dead.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, ids[2]);
    assert_eq!(dead[0].attempts, 3);
    assert!(dead[0].last_error.as_deref().unwrap().contains("refused"));
    assert_eq!(by_key(&c.got())["k0"], vec![0]);
    let status = router.status().await.unwrap();
    let c_status = status.iter().find(|s| s.destination == "c").unwrap();
    assert_eq!((c_status.deferred, c_status.dead), (8, 1));

    c.refuse(ids[2], false);
    assert!(router.redeliver("c", ids[2]).await.unwrap());
    assert!(
        !router.redeliver("c", ids[2]).await.unwrap(),
        "not dead any more"
    );
    let r = router.drain().await.unwrap();
    assert_eq!(r.delivered, 9);
    assert_exactly_once_in_order("c", &c.got(), 20, 2);
    assert_eq!(deferred_left(&db.pool).await, (0, 0));
    assert!(router.redeliver("nope", ids[2]).await.is_err());
}

#[tokio::test]
async fn a_discarded_dead_delivery_releases_its_key_and_its_payload() {
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    let router = Arc::new(
        builder(&db.pool, &a, &b, &c)
            .max_attempts(1)
            .build()
            .unwrap(),
    );
    let relay = Relay::builder(db.pool.clone(), router.clone())
        .build()
        .unwrap();
    let first = Message::bytes("orders.x", b"k0:0".to_vec()).ordering_key("k0");
    let id = first.id();
    c.refuse(id, true);
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, first).await.unwrap();
    let second = Message::bytes("orders.x", b"k0:1".to_vec()).ordering_key("k0");
    outbox.enqueue(&mut tx, second).await.unwrap();
    tx.commit().await.unwrap();
    relay.drain().await.unwrap();
    router.drain().await.unwrap();
    // max_attempts 1: dead at its first refusal.
    assert_eq!(router.dead_letters("c", 10).await.unwrap().len(), 1);
    assert!(c.got().is_empty());
    assert!(router.discard("c", id).await.unwrap());
    router.drain().await.unwrap();
    assert_eq!(by_key(&c.got())["k0"], vec![1]);
    assert_eq!(deferred_left(&db.pool).await, (0, 0));
}

#[tokio::test]
async fn a_hung_destination_delays_the_others_by_at_most_its_timeout() {
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    c.set(Mode::Hang);
    let router = Arc::new(
        builder(&db.pool, &a, &b, &c)
            .destination_timeout(Duration::from_millis(300))
            .away_backoff(Duration::from_secs(5), Duration::from_secs(5))
            .build()
            .unwrap(),
    );
    let relay = Relay::builder(db.pool.clone(), router.clone())
        .batch_size(50)
        .build()
        .unwrap();
    enqueue(&db.pool, "orders.x", 500, 5, 50).await;
    let started = Instant::now();
    relay.drain().await.unwrap();
    let took = started.elapsed();
    // One call waits out the timeout; then c is away and not called again.
    assert!(took < Duration::from_secs(3), "the others waited {took:?}");
    assert_eq!(c.0.calls.load(Ordering::SeqCst), 1);
    assert_exactly_once_in_order("a", &a.got(), 500, 5);
    assert_exactly_once_in_order("b", &b.got(), 500, 5);
    assert_eq!(count(&db.pool, "outbox_fanout_deliveries").await, 500);
}

#[tokio::test]
async fn routes_and_header_addressing_pick_destinations_and_unroutable_messages_are_dead_lettered()
{
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    let router = Arc::new(
        Router::builder(db.pool.clone())
            .destination("a", a.clone())
            .destination("b", b.clone())
            .destination("c", c.clone())
            .route("payments.*", ["a"])
            .route("payments.refund", ["b"])
            .route("audit.>", ["c"])
            .build()
            .unwrap(),
    );
    let relay = Relay::builder(db.pool.clone(), router.clone())
        .max_attempts(1)
        .build()
        .unwrap();
    let outbox = Outbox::new();
    let m = |topic: &str| Message::bytes(topic, topic.as_bytes().to_vec());
    let sent = [
        m("payments.charge"),
        m("payments.refund"),
        m("audit.x.y"),
        m("audit"),
        m("other").destinations(["b", "c"]),
        m("payments.charge.extra"),
        m("payments.charge").destinations(["zz"]),
    ];
    let ids: Vec<Uuid> = sent.iter().map(Message::id).collect();
    let mut tx = db.pool.begin().await.unwrap();
    for message in sent {
        outbox.enqueue(&mut tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
    relay.drain().await.unwrap();
    let topics = |d: &TestDest| -> Vec<(Uuid, String)> {
        let mut v: Vec<_> = d.got().iter().map(|e| (e.id, e.topic.clone())).collect();
        v.sort();
        v
    };
    let want = |ix: &[usize]| -> Vec<(Uuid, String)> {
        let mut v: Vec<_> = ix
            .iter()
            .map(|&i| {
                let t = [
                    "payments.charge",
                    "payments.refund",
                    "audit.x.y",
                    "audit",
                    "other",
                    "payments.charge.extra",
                    "payments.charge",
                ][i];
                (ids[i], t.to_owned())
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(topics(&a), want(&[0, 1]));
    assert_eq!(topics(&b), want(&[1, 4]));
    assert_eq!(topics(&c), want(&[2, 4]));
    assert_eq!(
        c.got().iter().find(|e| e.id == ids[4]).unwrap().headers[DESTINATIONS_HEADER],
        "b,c"
    );
    let dead: BTreeMap<Uuid, String> =
        sqlx::query("SELECT message_id, last_error FROM pgbox.outbox_dead_letters")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(
        dead[&ids[3]].contains("no route matches topic \"audit\""),
        "{dead:?}"
    );
    assert!(
        dead[&ids[5]].contains("\"payments.charge.extra\""),
        "{dead:?}"
    );
    assert!(dead[&ids[6]].contains("destination \"zz\""), "{dead:?}");
}

/// The relay dies after the router committed its deferrals and before the relay's own
/// commit: the batch is published again; nothing is lost, per-key order holds everywhere.
#[derive(Debug)]
struct DiesState {
    router: Arc<Router>,
    armed: std::sync::atomic::AtomicBool,
    reached: tokio::sync::Notify,
}

#[derive(Debug, Clone)]
struct DiesAfterRouter(Arc<DiesState>);

impl Publisher for DiesAfterRouter {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let results = self.0.router.publish(batch).await;
        if self.0.armed.swap(false, Ordering::SeqCst) {
            self.0.reached.notify_one();
            std::future::pending::<()>().await;
        }
        results
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn a_relay_killed_after_the_router_committed_loses_nothing_and_keeps_order() {
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    c.set(Mode::Unavailable);
    let router = Arc::new(builder(&db.pool, &a, &b, &c).build().unwrap());
    let state = Arc::new(DiesState {
        router: router.clone(),
        armed: std::sync::atomic::AtomicBool::new(false),
        reached: tokio::sync::Notify::new(),
    });
    let wrapper = DiesAfterRouter(state.clone());
    enqueue(&db.pool, "orders.x", 100, 4, 100).await;
    // A first batch goes through normally, then the relay dies mid-round.
    let relay = Relay::builder(db.pool.clone(), wrapper)
        .batch_size(30)
        .build()
        .unwrap();
    relay.relay_once().await.unwrap();
    state.armed.store(true, Ordering::SeqCst);
    let task = tokio::spawn(async move { relay.relay_once().await });
    state.reached.notified().await;
    task.abort();
    let _ = task.await;
    assert_eq!(
        count(&db.pool, "outbox").await,
        70,
        "the dead round did not commit"
    );
    assert!(
        count(&db.pool, "outbox_fanout_deliveries").await >= 60,
        "the router's did"
    );

    let relay = Relay::builder(db.pool.clone(), router.clone())
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    c.set(Mode::Up);
    tokio::time::sleep(Duration::from_millis(120)).await;
    router.drain().await.unwrap();
    assert_all_in_order("a", &a.got(), 100);
    assert_all_in_order("b", &b.got(), 100);
    // c's copies were deferred; the re-publish met them (one delivery per message there).
    assert_exactly_once_in_order("c", &c.got(), 100, 4);
    assert_eq!(
        a.got().len(),
        130,
        "a got the dead round's 30 twice, nothing else twice"
    );
    assert_eq!(deferred_left(&db.pool).await, (0, 0));
}

#[tokio::test]
async fn two_relay_router_pairs_with_a_flapping_destination_lose_and_double_nothing() {
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    let pairs: Vec<(Arc<Router>, Relay<Arc<Router>>)> = (0..2)
        .map(|_| {
            let router = Arc::new(builder(&db.pool, &a, &b, &c).build().unwrap());
            let relay = Relay::builder(db.pool.clone(), router.clone())
                .poll_interval(Duration::from_millis(20))
                .batch_size(40)
                .build()
                .unwrap();
            (router, relay)
        })
        .collect();
    let token = CancellationToken::new();
    let mut tasks = Vec::new();
    for (router, relay) in pairs {
        let t = token.clone();
        tasks.push(tokio::spawn(async move {
            tokio::try_join!(relay.run(t.clone()), router.run(t.clone())).unwrap();
        }));
    }
    let flapping = {
        let c = c.clone();
        let t = token.clone();
        tokio::spawn(async move {
            let mut up = false;
            while !t.is_cancelled() {
                c.set(if up { Mode::Up } else { Mode::Unavailable });
                up = !up;
                tokio::time::sleep(Duration::from_millis(37)).await;
            }
        })
    };
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                let outbox = Outbox::new();
                for i in 0..150 {
                    let mut tx = pool.begin().await.unwrap();
                    let key = format!("p{p}k{}", i % 5);
                    let n = i / 5;
                    let m = Message::bytes("orders.x", format!("{key}:{n}").into_bytes())
                        .ordering_key(key);
                    outbox.enqueue(&mut tx, m).await.unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for p in producers {
        p.await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline
        && (count(&db.pool, "outbox").await > 0 || a.got().len() < 600 || b.got().len() < 600)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    flapping.abort();
    let _ = flapping.await;
    c.set(Mode::Up);
    while Instant::now() < deadline && deferred_left(&db.pool).await != (0, 0) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    token.cancel();
    for t in tasks {
        t.await.unwrap();
    }
    assert_exactly_once_in_order("a", &a.got(), 600, 20);
    assert_exactly_once_in_order("b", &b.got(), 600, 20);
    assert_exactly_once_in_order("c", &c.got(), 600, 20);
    assert_eq!(deferred_left(&db.pool).await, (0, 0));
    assert_eq!(count(&db.pool, "outbox_dead_letters").await, 0);
}

#[tokio::test]
async fn destinations_settling_the_last_copies_of_a_message_at_once_leave_no_payload_behind() {
    let db = TestDb::migrated().await;
    let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
    for d in [&a, &b, &c] {
        d.set(Mode::Unavailable);
    }
    let router = Arc::new(
        builder(&db.pool, &a, &b, &c)
            .batch_size(20)
            .poll_interval(Duration::from_millis(1))
            .build()
            .unwrap(),
    );
    let relay = Relay::builder(db.pool.clone(), router.clone())
        .build()
        .unwrap();
    enqueue(&db.pool, "orders.x", 1000, 1000, 100).await;
    relay.drain().await.unwrap();
    assert_eq!(deferred_left(&db.pool).await, (3000, 1000));
    for d in [&a, &b, &c] {
        d.set(Mode::Up);
    }
    tokio::time::sleep(Duration::from_millis(120)).await;
    // The three destinations' drain loops run side by side, settling the same messages.
    let token = CancellationToken::new();
    let run = {
        let router = router.clone();
        let t = token.clone();
        tokio::spawn(async move { router.run(t).await })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && count(&db.pool, "outbox_fanout_deliveries").await > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    token.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(
        deferred_left(&db.pool).await,
        (0, 0),
        "orphaned payload rows"
    );
    for (name, d) in [("a", &a), ("b", &b), ("c", &c)] {
        assert_exactly_once_in_order(name, &d.got(), 1000, 1000);
    }
}

/// An application role with only the grants `Migrator::grant_to` applies runs the router:
/// defer, drain, status, dead letters, redeliver and discard.
#[tokio::test]
async fn the_router_runs_as_the_application_role() {
    use sqlx::{Connection, Executor};
    let db = TestDb::empty().await;
    let role = format!("pgbox_fan_{}", &Uuid::now_v7().simple().to_string()[16..]);
    let server = support::server_url().await;
    let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE ROLE \"{role}\" LOGIN")))
        .await
        .unwrap();
    Migrator::new()
        .grant_to(&role)
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let app = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options.clone().username(&role))
        .await
        .unwrap();
    let outcome = {
        let app = app.clone();
        async move {
            let (a, b, c) = (TestDest::new(), TestDest::new(), TestDest::new());
            c.set(Mode::Unavailable);
            let router = Arc::new(builder(&app, &a, &b, &c).max_attempts(1).build().unwrap());
            let relay = Relay::builder(app.clone(), router.clone()).build().unwrap();
            let ids = enqueue(&app, "orders.x", 10, 2, 10).await;
            relay.drain().await.unwrap();
            assert_eq!(deferred_left(&app).await, (10, 10));
            c.set(Mode::Up);
            c.refuse(ids[0], true);
            c.refuse(ids[1], true);
            tokio::time::sleep(Duration::from_millis(120)).await;
            router.drain().await.unwrap();
            assert_eq!(router.dead_letters("c", 10).await.unwrap().len(), 2);
            assert_eq!(router.status().await.unwrap().len(), 3);
            assert!(router.discard("c", ids[0]).await.unwrap());
            c.refuse(ids[1], false);
            assert!(router.redeliver("c", ids[1]).await.unwrap());
            router.drain().await.unwrap();
            assert_eq!(c.got().len(), 9);
            assert_eq!(deferred_left(&app).await, (0, 0));
        }
    };
    let result = tokio::spawn(outcome).await;
    app.close().await;
    let mut in_db = sqlx::PgConnection::connect_with(&db.options).await.unwrap();
    in_db
        .execute(sqlx::AssertSqlSafe(format!("DROP OWNED BY \"{role}\"")))
        .await
        .unwrap();
    in_db.close().await.ok();
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS \"{role}\""
        )))
        .await
        .unwrap();
    result.unwrap();
}
