//! Attack on the table relay's outage handling (issue 34, defects 11-12).
//!
//! The promise under attack (README "The outbox", "Guarantees, and where they end", the
//! rustdoc of `PublishError`, `Relay` and commit a74d1ab):
//! - A transport outage never dead-letters. Each transport sorts its publish errors into
//!   unavailable (could not be reached, did not answer, lost its connection) and refused (the
//!   broker answered and refused this message, or it is malformed or too large). Only
//!   refusals count toward `max_attempts`.
//! - During an outage messages wait in the outbox untouched; the relay backs their topic off,
//!   logs one warning per round, and publishes in order once the transport answers.
//!   `Relay::drain` waits through an outage.
//! - Per-key commit order; a dead letter holds its key; a key stops at its first failure;
//!   at-least-once (duplicates only as re-publishes of a message).
//!
//! Every outage here outlasts the whole retry budget (`max_attempts(2)`, millisecond
//! backoffs). Real brokers are reached through a TCP proxy started by the test, which can
//! refuse, accept-and-hang, freeze a connection when a given request goes through it (the
//! peer never answers it), cut a connection mid-batch, or slow every byte.

mod support;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[cfg(feature = "nats")]
use pgbox::transport::nats::Nats;
use pgbox::transport::rabbitmq::RabbitMq;
use pgbox::transport::{PgQueue, PublishError, Publisher, Subscriber};
use pgbox::{CancellationToken, DeadLetters, Envelope, Message, Outbox, Relay, RetryPolicy};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::TestDb;
use support::brokers;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

// ---------------------------------------------------------------------------------------
// A TCP proxy with outage shapes.

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Forward to the target.
    Forward,
    /// Accept, then close at once (the way to the broker is refused).
    Refuse,
    /// Accept and never answer (a load balancer whose backend is gone).
    Hang,
    /// Forward, delaying every chunk in both directions.
    Slow(Duration),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum OnMarker {
    /// Forward the chunk that holds the marker, then never forward anything on that
    /// connection again, either way, and keep it open (the peer went silent mid-request).
    Freeze,
    /// Forward the chunk that holds the marker, then close the connection (cut mid-batch).
    Cut,
}

struct ProxyState {
    target: SocketAddr,
    mode: Mutex<Mode>,
    marker: Mutex<Option<(Vec<u8>, OnMarker)>>,
    fired: AtomicUsize,
    conns: Mutex<Vec<AbortHandle>>,
}

struct Px {
    addr: SocketAddr,
    state: Arc<ProxyState>,
    accept: AbortHandle,
}

impl Px {
    async fn start(target: SocketAddr) -> Px {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ProxyState {
            target,
            mode: Mutex::new(Mode::Forward),
            marker: Mutex::new(None),
            fired: AtomicUsize::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let st = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let mode = *st.mode.lock().unwrap();
                let st2 = st.clone();
                let task = tokio::spawn(async move {
                    match mode {
                        Mode::Refuse => drop(client),
                        Mode::Hang => {
                            let mut client = client;
                            let mut buf = [0u8; 4096];
                            // Read and discard, never answer; hold the socket open.
                            loop {
                                match client.read(&mut buf).await {
                                    Ok(0) | Err(_) => {
                                        std::future::pending::<()>().await;
                                    }
                                    Ok(_) => {}
                                }
                            }
                        }
                        Mode::Forward | Mode::Slow(_) => {
                            let Ok(server) = TcpStream::connect(st2.target).await else {
                                return;
                            };
                            let _ = client.set_nodelay(true);
                            let _ = server.set_nodelay(true);
                            pump(client, server, st2).await;
                        }
                    }
                });
                let mut conns = st.conns.lock().unwrap();
                conns.retain(|c| !c.is_finished());
                conns.push(task.abort_handle());
            }
        })
        .abort_handle();
        Px {
            addr,
            state,
            accept,
        }
    }

    fn set_mode(&self, mode: Mode) {
        *self.state.mode.lock().unwrap() = mode;
    }

    /// The next client→server chunk holding `marker` fires `action` (once).
    fn arm(&self, marker: &[u8], action: OnMarker) {
        *self.state.marker.lock().unwrap() = Some((marker.to_vec(), action));
    }

    fn fired(&self) -> usize {
        self.state.fired.load(Ordering::SeqCst)
    }

    /// Closes every open connection (frozen ones included).
    fn cut(&self) {
        let conns: Vec<AbortHandle> = self.state.conns.lock().unwrap().drain(..).collect();
        for c in conns {
            c.abort();
        }
    }
}

impl Drop for Px {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

async fn pump(client: TcpStream, server: TcpStream, st: Arc<ProxyState>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let frozen = Arc::new(AtomicBool::new(false));
    let cut = Arc::new(tokio::sync::Notify::new());
    let up = {
        let st = st.clone();
        let frozen = frozen.clone();
        let cut = cut.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match cr.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if frozen.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                let mode = *st.mode.lock().unwrap();
                if let Mode::Slow(d) = mode {
                    tokio::time::sleep(d).await;
                }
                let action = {
                    let mut m = st.marker.lock().unwrap();
                    match m.as_ref() {
                        Some((needle, action)) if contains(&buf[..n], needle) => {
                            let a = *action;
                            *m = None;
                            st.fired.fetch_add(1, Ordering::SeqCst);
                            Some(a)
                        }
                        _ => None,
                    }
                };
                if sw.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                match action {
                    Some(OnMarker::Freeze) => {
                        frozen.store(true, Ordering::SeqCst);
                        std::future::pending::<()>().await;
                    }
                    Some(OnMarker::Cut) => {
                        cut.notify_one();
                        return;
                    }
                    None => {}
                }
            }
        }
    };
    let down = {
        let st = st.clone();
        let frozen = frozen.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match sr.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if frozen.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                let mode = *st.mode.lock().unwrap();
                if let Mode::Slow(d) = mode {
                    tokio::time::sleep(d).await;
                }
                if cw.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = cut.notified() => {}
    }
}

// ---------------------------------------------------------------------------------------
// Scenario and checks.

/// The scenario's messages in commit order: (key, payload). Payloads are unique markers.
fn scenario() -> Vec<(Option<&'static str>, String)> {
    let mut v = Vec::new();
    for i in 1..=4 {
        for k in ["A", "B", "C"] {
            v.push((Some(k), format!("pgbox-atk-{k}-{i:02}-zq")));
        }
        v.push((None, format!("pgbox-atk-U-{i:02}-zq")));
    }
    v
}

async fn enqueue_all(pool: &PgPool, topic: &str, msgs: &[(Option<&str>, String)]) {
    let outbox = Outbox::new();
    for (key, payload) in msgs {
        let mut tx = pool.begin().await.unwrap();
        let mut m = Message::bytes(topic, payload.clone().into_bytes());
        if let Some(k) = key {
            m = m.ordering_key(*k);
        }
        outbox.enqueue(&mut tx, m).await.unwrap();
        tx.commit().await.unwrap();
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn dead_letters(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM pgbox.outbox_dead_letters").await
}

async fn attempts_sum(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT coalesce(sum(attempts), 0)::bigint FROM pgbox.outbox",
    )
    .await
}

/// Lost, doubled, reordered: what `delivered` (payloads in arrival order) shows against
/// `expected` (commit order with keys).
#[derive(Debug, Default)]
struct Tally {
    lost: Vec<String>,
    doubled: usize,
    reordered: Vec<String>,
}

fn tally(expected: &[(Option<&str>, String)], delivered: &[String]) -> Tally {
    let mut t = Tally::default();
    let got: HashSet<&String> = delivered.iter().collect();
    t.doubled = delivered.len() - got.len();
    for (_, p) in expected {
        if !got.contains(p) {
            t.lost.push(p.clone());
        }
    }
    // Per key, first arrivals must follow commit order.
    let pos: HashMap<&String, usize> = {
        let mut m = HashMap::new();
        for (i, p) in delivered.iter().enumerate() {
            m.entry(p).or_insert(i);
        }
        m
    };
    let mut keys: HashMap<&str, Vec<&String>> = HashMap::new();
    for (k, p) in expected {
        if let Some(k) = k {
            keys.entry(k).or_default().push(p);
        }
    }
    for (k, ps) in keys {
        let firsts: Vec<usize> = ps.iter().filter_map(|p| pos.get(p).copied()).collect();
        if firsts.windows(2).any(|w| w[0] > w[1]) {
            t.reordered.push(format!("{k}: {firsts:?}"));
        }
    }
    t
}

fn assert_clean(t: &Tally, what: &str) {
    assert!(
        t.lost.is_empty() && t.reordered.is_empty(),
        "{what}: lost {:?}, reordered {:?} (doubled {})",
        t.lost,
        t.reordered,
        t.doubled
    );
}

fn quick<P: Publisher>(pool: &PgPool, publisher: P) -> Relay<P> {
    Relay::builder(pool.clone(), publisher)
        .max_attempts(2)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(5))
                .max_delay(Duration::from_millis(20)),
        )
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap()
}

/// Counts the failed publishes that went through (the proof an outage outlasted the budget).
struct Counting<P> {
    inner: P,
    failed: Arc<AtomicUsize>,
    unavailable: Arc<AtomicUsize>,
}

impl<P: Publisher> Publisher for Counting<P> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let results = self.inner.publish(batch).await;
        for r in &results {
            if let Err(e) = r {
                self.failed.fetch_add(1, Ordering::Relaxed);
                if e.is_unavailable() {
                    self.unavailable.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        results
    }
    fn atomic_batches(&self) -> bool {
        self.inner.atomic_batches()
    }
}

fn counting<P: Publisher>(inner: P) -> (Counting<P>, Arc<AtomicUsize>) {
    let failed = Arc::new(AtomicUsize::new(0));
    (
        Counting {
            inner,
            failed: failed.clone(),
            unavailable: Arc::default(),
        },
        failed,
    )
}

/// Rounds of `relay` until `failed` passed `past` (or something was dead-lettered); bounded.
async fn rounds_until_failed<P: Publisher>(
    pool: &PgPool,
    relay: &Relay<P>,
    failed: &AtomicUsize,
    past: usize,
) {
    for _ in 0..600 {
        if failed.load(Ordering::Relaxed) >= past || dead_letters(pool).await > 0 {
            return;
        }
        let _ = relay.relay_once().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the relay offered too few messages: {} failed publishes",
        failed.load(Ordering::Relaxed)
    );
}

async fn drain_bounded<P: Publisher>(relay: &Relay<P>, secs: u64) -> pgbox::DrainReport {
    tokio::time::timeout(Duration::from_secs(secs), relay.drain())
        .await
        .unwrap_or_else(|_| {
            panic!("drain did not finish within {secs} s although the transport answers again")
        })
        .expect("drain")
}

async fn queue_payloads(pool: &PgPool) -> Vec<String> {
    let rows: Vec<Vec<u8>> = sqlx::query_scalar("SELECT payload FROM pgbox.queue ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap();
    rows.into_iter()
        .map(|p| String::from_utf8(p).unwrap())
        .collect()
}

async fn receive_payloads<S: Subscriber>(s: &S, topic: &str, unique: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut idle = 0;
    for _ in 0..400 {
        if seen.len() >= unique {
            // A few more receives for stray duplicates.
            idle += 1;
            if idle > 3 {
                break;
            }
        }
        let batch = s
            .receive(topic, 50, Duration::from_secs(30))
            .await
            .expect("receive");
        for d in batch {
            let p = String::from_utf8(s.envelope(&d).payload.clone()).unwrap();
            seen.insert(p.clone());
            out.push(p);
            s.ack(&d).await.expect("ack");
        }
    }
    out
}

fn nowhere() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
}

// ---------------------------------------------------------------------------------------
// The built-in queue on another database, through the proxy.

async fn queue_through(proxy: &Px, queue_db: &TestDb) -> PgQueue {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(
            queue_db
                .options
                .clone()
                .host("127.0.0.1")
                .port(proxy.addr.port()),
        )
        .await
        .unwrap();
    PgQueue::new(pool)
}

/// The queue's database receives a publish and goes silent (a host that died with the request
/// in hand, a middlebox that black-holes an open connection). Every new connection is
/// answered from the start: the transport answers again. The relay must count that as
/// "did not answer" (unavailable) and go on. It used to wait forever on the silent
/// connection, holding its round's transaction, row locks and the keyed-drain lock; now the
/// queue's publish timeout (30 s by default) reports it unavailable and closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_that_stops_answering_mid_publish_is_an_outage_the_relay_recovers_from() {
    support::init_tracing();
    let outbox_db = TestDb::migrated().await;
    let queue_db = TestDb::migrated().await;
    let server = brokers::address(&support::server_url().await);
    let proxy = Px::start(server).await;
    let queue = queue_through(&proxy, &queue_db).await;
    let msgs = scenario();
    enqueue_all(&outbox_db.pool, "atk.q.silent", &msgs).await;
    // The first batch's publish carries every head, "A-01" among them.
    proxy.arm(b"pgbox-atk-A-01-zq", OnMarker::Freeze);
    let relay = quick(&outbox_db.pool, queue);

    let relay = Arc::new(relay);
    let draining = tokio::spawn({
        let relay = relay.clone();
        async move { relay.drain().await }
    });
    // Bounded: 60 s, far past every timeout of the other transports (RabbitMQ's confirm
    // timeout defaults to 30 s).
    for _ in 0..600 {
        if draining.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(proxy.fired(), 1, "the publish went through the proxy");
    let finished = draining.is_finished();
    let oid_sql = "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database \
                   WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.granted";
    let advisory = count(&outbox_db.pool, oid_sql).await;
    let idle_in_tx = count(
        &outbox_db.pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND state = 'idle in transaction'",
    )
    .await;
    // Another relay, with a healthy way to the same queue, meanwhile: it gets nothing to do.
    let healthy = quick(&outbox_db.pool, PgQueue::new(queue_db.pool.clone()));
    let other = if finished {
        None
    } else {
        Some(healthy.relay_once().await.expect("round"))
    };
    let left = count(&outbox_db.pool, "SELECT count(*) FROM pgbox.outbox").await;
    assert!(
        finished,
        "the relay still waits, 60 s after one request went unanswered, though every new \
         connection to the queue's database is answered: its round holds {advisory} advisory \
         lock(s) (the keyed-drain lock) and {idle_in_tx} outbox transaction(s) idle in \
         transaction; a second relay with a healthy pool to the same queue claimed {:?} of \
         the {left} messages left",
        other.map(|r| r.claimed)
    );
    let drained = draining.await.unwrap();
    let report = drained.expect("drain");
    assert_eq!(report.dead_lettered, 0);
    assert_clean(
        &tally(&msgs, &queue_payloads(&queue_db.pool).await),
        "queue",
    );
}

/// The queue's publish timeout on its own, short: the publish that went silent is reported
/// unavailable within it, and its connection is closed rather than handed back to the pool
/// (sqlx's release check would wait on it for good, holding the pool's only slot): the next
/// publish, on the same one-connection pool, goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_publish_timeout_closes_the_silent_connection_and_frees_its_pool_slot() {
    support::init_tracing();
    let queue_db = TestDb::migrated().await;
    let server = brokers::address(&support::server_url().await);
    let proxy = Px::start(server).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(20))
        .connect_with(
            queue_db
                .options
                .clone()
                .host("127.0.0.1")
                .port(proxy.addr.port()),
        )
        .await
        .unwrap();
    let queue = PgQueue::new(pool)
        .publish_timeout(Duration::from_secs(1))
        .unwrap();
    let envelope = |payload: &str| {
        let mut e =
            pgbox::transport::conformance::envelope("atk.q.timeout", payload.as_bytes().to_vec());
        e.ordering_key = Some("k".into());
        e
    };
    proxy.arm(b"pgbox-atk-silent-zq", OnMarker::Freeze);
    let silent = tokio::time::timeout(
        Duration::from_secs(30),
        queue.publish(&[envelope("pgbox-atk-silent-zq")]),
    )
    .await
    .expect("the publish returns within its timeout");
    assert_eq!(proxy.fired(), 1, "the publish went through the proxy");
    let error = silent[0].as_ref().expect_err("no answer is not a success");
    assert!(error.is_unavailable(), "no answer is an outage: {error}");
    let next = tokio::time::timeout(
        Duration::from_secs(30),
        queue.publish(&[envelope("pgbox-atk-after-zq")]),
    )
    .await
    .expect("the next publish returns");
    assert!(
        next[0].is_ok(),
        "the pool's only slot was freed for the next publish: {:?}",
        next[0]
    );
    assert!(
        queue_payloads(&queue_db.pool)
            .await
            .contains(&"pgbox-atk-after-zq".to_owned())
    );
    assert!(matches!(
        PgQueue::new(queue_db.pool.clone()).publish_timeout(Duration::ZERO),
        Err(pgbox::Error::InvalidConfig(_))
    ));
}

/// Before each round into the built-in queue, the relay asks the queue's pool which server
/// it reaches. That question goes unanswered here (the connection freezes on it): the round
/// gives up on it within the queue's publish timeout, publishes through the queue's pool as
/// to any transport, and the relay drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_round_gives_up_on_a_queue_that_does_not_say_which_server_it_is() {
    support::init_tracing();
    let outbox_db = TestDb::migrated().await;
    let queue_db = TestDb::migrated().await;
    let server = brokers::address(&support::server_url().await);
    let proxy = Px::start(server).await;
    let queue = queue_through(&proxy, &queue_db)
        .await
        .publish_timeout(Duration::from_secs(1))
        .unwrap();
    let msgs = scenario();
    enqueue_all(&outbox_db.pool, "atk.q.identify", &msgs).await;
    proxy.arm(b"pg_postmaster_start_time", OnMarker::Freeze);
    let relay = quick(&outbox_db.pool, queue);
    let report = drain_bounded(&relay, 60).await;
    assert_eq!(proxy.fired(), 1, "the question went through the proxy");
    assert_eq!(report.dead_lettered, 0);
    assert_clean(
        &tally(&msgs, &queue_payloads(&queue_db.pool).await),
        "queue",
    );
}

/// The queue's database is up and answers, but does not take connections for a while
/// (`ALTER DATABASE .. ALLOW_CONNECTIONS false`, maintenance: SQLSTATE 55000 at login). That
/// is "could not be reached", as a RabbitMQ or NATS login refusal is for those transports
/// (any failure to connect is unavailable there). The queue's publish error classification
/// used to read it as a refusal of every message (the halving search refused each message
/// alone, and everything was dead-lettered within `max_attempts(2)`); any failure to get a
/// connection is now unavailable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_database_not_accepting_connections_is_an_outage_that_dead_letters_nothing() {
    support::init_tracing();
    let outbox_db = TestDb::migrated().await;
    let queue_db = TestDb::migrated().await;
    let msgs = scenario();
    enqueue_all(&outbox_db.pool, "atk.q.login", &msgs).await;
    let queue_pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(queue_db.options.clone());
    let (publisher, failed) = counting(PgQueue::new(queue_pool));
    let relay = quick(&outbox_db.pool, publisher);
    let admin = &outbox_db.pool;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{}\" ALLOW_CONNECTIONS false",
        queue_db.name
    )))
    .execute(admin)
    .await
    .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&queue_db.name)
        .execute(admin)
        .await
        .unwrap();
    rounds_until_failed(&outbox_db.pool, &relay, &failed, 3 * 16).await;
    let dead = dead_letters(&outbox_db.pool).await;
    let last_error: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM pgbox.outbox_dead_letters LIMIT 1")
            .fetch_optional(&outbox_db.pool)
            .await
            .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{}\" ALLOW_CONNECTIONS true",
        queue_db.name
    )))
    .execute(admin)
    .await
    .unwrap();
    let report = drain_bounded(&relay, 60).await;
    assert_eq!(
        dead,
        0,
        "the queue's database refusing logins dead-lettered {dead} of {} messages ({:?}); \
         once it took connections again the drain published {} and held {}",
        msgs.len(),
        last_error,
        report.published,
        report.held
    );
}

/// The queue's database refuses connections, then accepts and never answers, then is cut
/// mid-batch, all for longer than the budget; then back. Nothing dead-lettered, lost or
/// reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_refused_hung_and_cut_outages_lose_and_dead_letter_nothing() {
    support::init_tracing();
    let outbox_db = TestDb::migrated().await;
    let queue_db = TestDb::migrated().await;
    let server = brokers::address(&support::server_url().await);
    let proxy = Px::start(server).await;
    let queue = queue_through(&proxy, &queue_db).await;
    let msgs = scenario();
    enqueue_all(&outbox_db.pool, "atk.q.shapes", &msgs).await;
    let (publisher, failed) = counting(queue);
    let relay = quick(&outbox_db.pool, publisher);

    for (i, mode) in [Mode::Refuse, Mode::Hang].into_iter().enumerate() {
        proxy.set_mode(mode);
        proxy.cut();
        rounds_until_failed(&outbox_db.pool, &relay, &failed, (i + 1) * 3 * 16).await;
        assert_eq!(dead_letters(&outbox_db.pool).await, 0, "{mode:?}");
        assert_eq!(attempts_sum(&outbox_db.pool).await, 0, "{mode:?}");
    }
    // Cut mid-batch: the connection carrying B-02 is closed right after it was sent.
    proxy.set_mode(Mode::Forward);
    proxy.cut();
    proxy.arm(b"pgbox-atk-B-01-zq", OnMarker::Cut);
    let report = drain_bounded(&relay, 120).await;
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(dead_letters(&outbox_db.pool).await, 0);
    assert_clean(
        &tally(&msgs, &queue_payloads(&queue_db.pool).await),
        "queue",
    );
}

// ---------------------------------------------------------------------------------------
// RabbitMQ and NATS through the proxy.

fn rabbit(url: &str, prefix: &str) -> RabbitMq {
    RabbitMq::builder(url)
        .exchange("pgbox-test")
        .queue_prefix(prefix)
        .queue_expires(Duration::from_secs(600))
        .connect_timeout(Duration::from_secs(1))
        .operation_timeout(Duration::from_secs(1))
        .confirm_timeout(Duration::from_secs(1))
        .build()
        .unwrap()
}

#[cfg(feature = "nats")]
fn nats(url: &str) -> Nats {
    Nats::builder(url)
        .stream("PGBOX_TEST")
        .subject_prefix("pgbox-test")
        .max_age(Duration::from_secs(3600))
        .inactive_threshold(Duration::from_secs(600))
        .receive_wait(Duration::from_millis(100))
        .build()
        .unwrap()
}

/// Refused, accepted-and-hung, frozen mid-publish, cut mid-batch and flapping outages of one
/// broker, each longer than the budget, then back.
async fn broker_outage_shapes<P: Publisher, S: Subscriber>(
    pool: &PgPool,
    proxied: P,
    direct: &S,
    proxy: &Px,
    topic: &str,
) {
    let msgs = scenario();
    enqueue_all(pool, topic, &msgs).await;
    let (publisher, failed) = counting(proxied);
    let relay = quick(pool, publisher);
    let mut past = 0;
    for mode in [Mode::Refuse, Mode::Hang] {
        proxy.set_mode(mode);
        proxy.cut();
        past += 3 * 7;
        rounds_until_failed(pool, &relay, &failed, past).await;
        assert_eq!(dead_letters(pool).await, 0, "{mode:?}");
        assert_eq!(attempts_sum(pool).await, 0, "{mode:?}");
    }
    // Flapping: up for a round, down for two, ten times; a freeze and a cut mid-batch.
    proxy.arm(b"pgbox-atk-C-01-zq", OnMarker::Cut);
    for i in 0..10 {
        proxy.set_mode(Mode::Forward);
        let _ = relay.relay_once().await;
        if i == 3 {
            proxy.arm(b"pgbox-atk-A-03-zq", OnMarker::Cut);
        }
        proxy.set_mode(if i % 2 == 0 { Mode::Refuse } else { Mode::Hang });
        proxy.cut();
        for _ in 0..2 {
            let _ = relay.relay_once().await;
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(dead_letters(pool).await, 0, "flap {i}");
    }
    proxy.set_mode(Mode::Forward);
    proxy.cut();
    let report = drain_bounded(&relay, 180).await;
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(dead_letters(pool).await, 0);
    let delivered = receive_payloads(direct, topic, msgs.len()).await;
    let t = tally(&msgs, &delivered);
    eprintln!("{topic}: {t:?}");
    assert_clean(&t, topic);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_outage_shapes_lose_reorder_and_dead_letter_nothing() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::rabbitmq_url().await;
    let proxy = Px::start(brokers::address(&url)).await;
    let prefix = format!("pgbox-atk-{}.", uuid::Uuid::now_v7().simple());
    let direct = rabbit(&url, &prefix);
    let topic = "atk.rabbit.shapes";
    direct.declare_topic(topic).await.unwrap();
    let proxied = rabbit(&brokers::with_address(&url, proxy.addr), &prefix);
    broker_outage_shapes(&db.pool, proxied, &direct, &proxy, topic).await;
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_shapes_lose_reorder_and_dead_letter_nothing() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::nats_url().await;
    let proxy = Px::start(brokers::address(&url)).await;
    let direct = nats(&url);
    let topic = format!("atk-nats-{}", uuid::Uuid::now_v7().simple());
    direct.declare_topic(&topic).await.unwrap();
    let proxied = nats(&brokers::with_address(&url, proxy.addr));
    proxied.max_payload().await.unwrap();
    broker_outage_shapes(&db.pool, proxied, &direct, &proxy, &topic).await;
}

/// The broker receives a publish and goes silent on that connection; new connections are
/// answered. The relay must give up on the silent one and publish through a new one.
async fn broker_silent_mid_publish<P: Publisher, S: Subscriber>(
    pool: &PgPool,
    proxied: P,
    direct: &S,
    proxy: &Px,
    topic: &str,
    bound: u64,
) {
    let msgs = scenario();
    enqueue_all(pool, topic, &msgs).await;
    proxy.arm(b"pgbox-atk-A-01-zq", OnMarker::Freeze);
    let relay = quick(pool, proxied);
    let report = drain_bounded(&relay, bound).await;
    assert_eq!(proxy.fired(), 1);
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    let delivered = receive_payloads(direct, topic, msgs.len()).await;
    let t = tally(&msgs, &delivered);
    eprintln!("{topic}: {t:?}");
    assert_clean(&t, topic);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_silent_mid_publish_is_an_outage_the_relay_recovers_from() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::rabbitmq_url().await;
    let proxy = Px::start(brokers::address(&url)).await;
    let prefix = format!("pgbox-atk-{}.", uuid::Uuid::now_v7().simple());
    let direct = rabbit(&url, &prefix);
    let topic = "atk.rabbit.silent";
    direct.declare_topic(topic).await.unwrap();
    let proxied = rabbit(&brokers::with_address(&url, proxy.addr), &prefix);
    broker_silent_mid_publish(&db.pool, proxied, &direct, &proxy, topic, 60).await;
}

/// NATS keeps using a connection that went silent until its own pings give up on it (the
/// transport does not replace it on publish timeouts, as the RabbitMQ one does).
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_silent_mid_publish_is_an_outage_the_relay_recovers_from() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::nats_url().await;
    let proxy = Px::start(brokers::address(&url)).await;
    let direct = nats(&url);
    let topic = format!("atk-nats-silent-{}", uuid::Uuid::now_v7().simple());
    direct.declare_topic(&topic).await.unwrap();
    let proxied = nats(&brokers::with_address(&url, proxy.addr));
    proxied.max_payload().await.unwrap();
    broker_silent_mid_publish(&db.pool, proxied, &direct, &proxy, &topic, 300).await;
}

/// A broker that answers, slowly (every chunk delayed 40 ms: at 150 ms the drain took 37 s
/// alone and more than 180 s beside the file's other tests in CI), during a whole drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_slow_broker_delivers_everything_in_order() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::rabbitmq_url().await;
    let proxy = Px::start(brokers::address(&url)).await;
    let prefix = format!("pgbox-atk-{}.", uuid::Uuid::now_v7().simple());
    let direct = rabbit(&url, &prefix);
    let topic = "atk.rabbit.slow";
    direct.declare_topic(topic).await.unwrap();
    let proxied = rabbit(&brokers::with_address(&url, proxy.addr), &prefix);
    proxy.set_mode(Mode::Slow(Duration::from_millis(40)));
    let msgs = scenario();
    enqueue_all(&db.pool, topic, &msgs).await;
    let relay = quick(&db.pool, proxied);
    let report = drain_bounded(&relay, 180).await;
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    let t = tally(&msgs, &receive_payloads(&direct, topic, msgs.len()).await);
    eprintln!("slow: {t:?}");
    assert_clean(&t, "slow rabbitmq");
}

/// An outage of one topic's route only: the topic's queue does not exist (not declared yet,
/// or deleted and about to be re-declared) for longer than the retry budget, while the
/// broker and every other topic are fine. The README (RabbitMQ, "Queues are declared by the
/// consumer side") says the relay "retries them with backoff, and nothing is dropped"; NATS
/// treats the same situation (no stream takes the subject) as an outage. A returned
/// (unroutable) message used to be refused, and dead-lettered after `max_attempts` returns;
/// it is now unavailable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_topic_without_its_queue_yet_is_an_outage_that_dead_letters_nothing() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let url = brokers::rabbitmq_url().await;
    let prefix = format!("pgbox-atk-{}.", uuid::Uuid::now_v7().simple());
    let direct = rabbit(&url, &prefix);
    let topic = format!("atk.rabbit.noroute.{}", uuid::Uuid::now_v7().simple());
    let topic = topic.as_str();
    let msgs = scenario();
    enqueue_all(&db.pool, topic, &msgs).await;
    let (publisher, failed) = counting(rabbit(&url, &prefix));
    let relay = quick(&db.pool, publisher);
    rounds_until_failed(&db.pool, &relay, &failed, 3 * 7).await;
    let dead = dead_letters(&db.pool).await;
    // The route comes back.
    direct.declare_topic(topic).await.unwrap();
    let report = drain_bounded(&relay, 60).await;
    assert_eq!(
        dead, 0,
        "a topic whose queue is not there yet (route outage, broker up) dead-lettered {dead} \
         messages within a retry budget of 2; after the queue was declared the drain held \
         {} behind them",
        report.held
    );
}

// ---------------------------------------------------------------------------------------
// A user-written publisher (no broker), scripted.

#[derive(Default)]
struct FakeState {
    /// Topics whose transport is unavailable.
    down: HashSet<String>,
    /// Payloads to refuse at their next publish.
    refuse: HashSet<String>,
    delivered: Vec<(String, String)>,
    calls: usize,
}

#[derive(Clone, Default)]
struct Fake {
    st: Arc<Mutex<FakeState>>,
    atomic: bool,
}

impl Fake {
    fn down(&self, topic: &str, down: bool) {
        let mut st = self.st.lock().unwrap();
        if down {
            st.down.insert(topic.to_owned());
        } else {
            st.down.remove(topic);
        }
    }
    fn delivered(&self, topic: &str) -> Vec<String> {
        self.st
            .lock()
            .unwrap()
            .delivered
            .iter()
            .filter(|(t, _)| t == topic)
            .map(|(_, p)| p.clone())
            .collect()
    }
    fn calls(&self) -> usize {
        self.st.lock().unwrap().calls
    }
}

impl Publisher for Fake {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let mut st = self.st.lock().unwrap();
        st.calls += 1;
        batch
            .iter()
            .map(|e| {
                let p = String::from_utf8(e.payload.clone()).unwrap();
                if st.down.contains(&e.topic) {
                    Err(PublishError::unavailable("connection refused"))
                } else if st.refuse.remove(&p) {
                    Err(PublishError::refused("refused"))
                } else {
                    st.delivered.push((e.topic.clone(), p));
                    Ok(())
                }
            })
            .collect()
    }
    fn atomic_batches(&self) -> bool {
        self.atomic
    }
}

async fn attempts_of(pool: &PgPool, payload: &str) -> Option<i32> {
    sqlx::query_scalar("SELECT attempts FROM pgbox.outbox WHERE payload = $1")
        .bind(payload.as_bytes())
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// An atomic publisher reports, for one key's run in one call, the head unavailable and the
/// next message refused. The README: "a key stops at its first failure"; the head's failure
/// is an outage. The second message's refusal must not count (else it would be
/// dead-lettered during the outage and hold its key, the earlier message behind it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomic_batch_refusal_behind_an_unavailable_head_is_not_counted() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    struct Mix;
    impl Publisher for Mix {
        async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
            batch
                .iter()
                .map(|e| match e.payload.as_slice() {
                    b"a2" => Err(PublishError::refused("refused")),
                    _ => Err(PublishError::unavailable("no answer")),
                })
                .collect()
        }
        fn atomic_batches(&self) -> bool {
            true
        }
    }
    let msgs: Vec<(Option<&str>, String)> = vec![
        (Some("A"), "a1".into()),
        (Some("A"), "a2".into()),
        (Some("A"), "a3".into()),
    ];
    enqueue_all(&db.pool, "atk.mix", &msgs).await;
    let relay = quick(&db.pool, Mix);
    for _ in 0..40 {
        let _ = relay.relay_once().await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let a2 = attempts_of(&db.pool, "a2").await;
    let dead = dead_letters(&db.pool).await;
    assert!(
        dead == 0 && a2 == Some(0),
        "during an outage of the key's head, the message behind it was counted (attempts \
         {a2:?}) and {dead} dead-lettered; a1 now waits behind a2's dead letter"
    );
}

/// A refused message, then an outage longer than the budget: the refused one keeps its one
/// attempt, its key stays held (nothing of it published), and after the outage the key goes
/// out in order; nothing dead-lettered. Keyed and unkeyed, two topics, one of them down
/// only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_then_outage_keeps_the_count_and_the_key_held() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let msgs = scenario();
    enqueue_all(&db.pool, "atk.fake.down", &msgs).await;
    enqueue_all(&db.pool, "atk.fake.up", &msgs).await;
    let fake = Fake::default();
    fake.st
        .lock()
        .unwrap()
        .refuse
        .insert("pgbox-atk-A-01-zq".into());
    let relay = quick(&db.pool, fake.clone());
    // Round 1: A-01 of both topics: one refused (whichever comes first), the rest published.
    relay.relay_once().await.unwrap();
    let refused: i64 = count(
        &db.pool,
        "SELECT count(*) FROM pgbox.outbox WHERE attempts = 1",
    )
    .await;
    assert_eq!(refused, 1);
    let refused_topic: String =
        sqlx::query_scalar("SELECT topic FROM pgbox.outbox WHERE attempts = 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    fake.down(&refused_topic, true);
    for _ in 0..60 {
        let _ = relay.relay_once().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(dead_letters(&db.pool).await, 0);
    assert_eq!(attempts_sum(&db.pool).await, 1, "only the refusal counted");
    assert!(
        !fake
            .delivered(&refused_topic)
            .iter()
            .any(|p| p.contains("-A-")),
        "key A published while its head waits"
    );
    fake.down(&refused_topic, false);
    let report = drain_bounded(&relay, 60).await;
    assert_eq!(report.dead_lettered, 0);
    for topic in ["atk.fake.down", "atk.fake.up"] {
        let t = tally(&msgs, &fake.delivered(topic));
        assert_eq!(t.doubled, 0);
        assert_clean(&t, topic);
    }
}

/// A dead letter holds its key through an outage: replayed during the outage, it goes out
/// first once the transport answers, the held ones after it, nothing counted meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_replayed_during_an_outage_goes_first_after_it() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let msgs = scenario();
    let topic = "atk.fake.replay";
    enqueue_all(&db.pool, topic, &msgs).await;
    let fake = Fake::default();
    let relay = quick(&db.pool, fake.clone());
    for _ in 0..2 {
        fake.st
            .lock()
            .unwrap()
            .refuse
            .insert("pgbox-atk-B-01-zq".into());
        let _ = relay.relay_once().await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(dead_letters(&db.pool).await, 1);
    fake.down(topic, true);
    let dl = DeadLetters::new(db.pool.clone());
    assert_eq!(dl.replay_all().await.unwrap(), 1);
    for _ in 0..40 {
        let _ = relay.relay_once().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(dead_letters(&db.pool).await, 0);
    fake.down(topic, false);
    let report = drain_bounded(&relay, 60).await;
    assert_eq!(report.dead_lettered, 0);
    let t = tally(&msgs, &fake.delivered(topic));
    assert_clean(&t, topic);
}

/// Relays restarted every round during an outage (the backoff lives in memory): none counts
/// an attempt or dead-letters; each new relay makes one call before backing off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_restarted_during_an_outage_count_nothing_and_lose_nothing() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let msgs = scenario();
    let topic = "atk.fake.restart";
    enqueue_all(&db.pool, topic, &msgs).await;
    let fake = Fake::default();
    fake.down(topic, true);
    for _ in 0..30 {
        let relay = quick(&db.pool, fake.clone());
        for _ in 0..3 {
            let _ = relay.relay_once().await;
        }
    }
    assert!(
        fake.calls() <= 30 * 2,
        "restarted relays hammered: {} calls",
        fake.calls()
    );
    assert_eq!(attempts_sum(&db.pool).await, 0);
    assert_eq!(dead_letters(&db.pool).await, 0);
    fake.down(topic, false);
    let relay = quick(&db.pool, fake.clone());
    drain_bounded(&relay, 60).await;
    let t = tally(&msgs, &fake.delivered(topic));
    assert_eq!(t.doubled, 0);
    assert_clean(&t, topic);
}

/// Three relays running at once (run, not drain) through a transport flapping every few
/// tens of milliseconds, atomic and not; then up. Nothing lost, doubled, reordered or
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_relays_through_a_flapping_transport() {
    support::init_tracing();
    for atomic in [false, true] {
        let db = TestDb::migrated().await;
        let msgs = scenario();
        let topic = "atk.fake.flap";
        enqueue_all(&db.pool, topic, &msgs).await;
        enqueue_all(&db.pool, topic, &msgs[..0]).await;
        let fake = Fake {
            atomic,
            ..Fake::default()
        };
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();
        for _ in 0..3 {
            let relay = quick(&db.pool, fake.clone());
            let s = shutdown.clone();
            tasks.push(tokio::spawn(async move { relay.run(s).await }));
        }
        for i in 0..60 {
            fake.down(topic, i % 3 != 0);
            if i == 20 {
                // More work arriving mid-outage.
                let more: Vec<(Option<&str>, String)> = scenario()
                    .into_iter()
                    .map(|(k, p)| (k, p.replace("zq", "late")))
                    .collect();
                enqueue_all(&db.pool, topic, &more).await;
            }
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        fake.down(topic, false);
        let relay = quick(&db.pool, fake.clone());
        drain_bounded(&relay, 60).await;
        shutdown.cancel();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let mut all = msgs.clone();
        all.extend(
            scenario()
                .into_iter()
                .map(|(k, p)| (k, p.replace("zq", "late"))),
        );
        assert_eq!(dead_letters(&db.pool).await, 0, "atomic {atomic}");
        let t = tally(&all, &fake.delivered(topic));
        assert_eq!(t.doubled, 0, "atomic {atomic}");
        assert_clean(&t, &format!("atomic {atomic}"));
    }
}

// ---------------------------------------------------------------------------------------
// Builders accepting settings that void a guarantee.

/// librdkafka reads `topic.<name>` as the default topic configuration's `<name>` (it strips
/// the prefix when the global name is unknown). `KafkaBuilder::build` used to guard
/// `partitioner`, `queuing.strategy` and `auto.offset.reset` by their bare names only.
#[cfg(feature = "kafka")]
#[test]
fn kafka_builder_refuses_guarded_settings_under_their_topic_prefix() {
    use pgbox::transport::kafka::Kafka;
    let mut accepted = Vec::new();
    for (key, value) in [
        ("topic.partitioner", "random"),
        ("topic.queuing.strategy", "lifo"),
        ("topic.auto.offset.reset", "latest"),
    ] {
        let bare = key.trim_start_matches("topic.");
        assert!(
            Kafka::builder("127.0.0.1:9")
                .set(bare, value)
                .build()
                .is_err(),
            "{bare}={value} is refused by its bare name"
        );
        if Kafka::builder("127.0.0.1:9")
            .set(key, value)
            .build()
            .is_ok()
        {
            accepted.push(format!(
                "{key}={value} (librdkafka's effective {bare}: {:?})",
                effective_topic_setting(key, value, bare)
            ));
        }
    }
    assert!(
        accepted.is_empty(),
        "KafkaBuilder::build accepted guarantee-voiding settings: {accepted:?}"
    );
}

/// The class of the one above: a setting pgbox owns or guards, under another name librdkafka
/// reads it by (an alias, a `topic.` prefix, the legacy topic-level `enable.auto.commit`), or
/// a setting pgbox sets itself under a name that would race with pgbox's (librdkafka's
/// aliases are separate keys of `ClientConfig`'s map, applied in no set order). Each is
/// refused, naming the setting; what pgbox leaves to the user is still accepted.
#[cfg(feature = "kafka")]
#[test]
fn kafka_builder_refuses_owned_and_guarded_settings_under_their_aliases() {
    use pgbox::transport::kafka::Kafka;
    let (mut accepted, mut unnamed) = (Vec::new(), Vec::new());
    for (key, value) in [
        ("topic.acks", "1"),
        ("topic.request.required.acks", "0"),
        ("topic.enable.auto.commit", "true"),
        ("topic.auto.commit.enable", "true"),
        ("delivery.timeout.ms", "0"),
        ("topic.message.timeout.ms", "0"),
        ("topic.delivery.timeout.ms", "0"),
        ("queue.buffering.max.ms", "1000"),
        ("linger.ms", "1000"),
        ("metadata.broker.list", "127.0.0.1:9"),
    ] {
        match Kafka::builder("127.0.0.1:9").set(key, value).build() {
            Ok(_) => accepted.push(format!("{key}={value}")),
            Err(e @ pgbox::Error::InvalidConfig(_)) if e.to_string().contains(key) => {}
            Err(e) => unnamed.push(format!("{key}={value}: {e}")),
        }
    }
    assert!(
        accepted.is_empty() && unnamed.is_empty(),
        "KafkaBuilder::build accepted settings pgbox owns or guards, under another name: \
         {accepted:?}; refused them without naming the setting: {unnamed:?}"
    );
    for (key, value) in [
        ("topic.auto.offset.reset", "earliest"),
        ("topic.partitioner", "murmur2_random"),
        ("max.in.flight", "5"),
        ("retries", "5"),
        ("topic.compression.codec", "lz4"),
        ("topic.metadata.refresh.interval.ms", "1000"),
    ] {
        let built = Kafka::builder("127.0.0.1:9").set(key, value).build();
        assert!(built.is_ok(), "{key}={value}: {:?}", built.err());
    }
}

/// What librdkafka's default topic configuration holds for `bare` after `key` = `value` was
/// set on the global configuration (as `ClientConfig::set` does).
#[cfg(feature = "kafka")]
fn effective_topic_setting(key: &str, value: &str, bare: &str) -> String {
    use rdkafka::bindings as rd;
    use std::ffi::{CStr, CString};
    unsafe {
        let conf = rd::rd_kafka_conf_new();
        let mut err = [0 as std::os::raw::c_char; 512];
        let k = CString::new(key).unwrap();
        let v = CString::new(value).unwrap();
        let res = rd::rd_kafka_conf_set(conf, k.as_ptr(), v.as_ptr(), err.as_mut_ptr(), err.len());
        assert_eq!(res, rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK, "{key}");
        let topic = rd::rd_kafka_conf_get_default_topic_conf(conf);
        assert!(!topic.is_null());
        let name = CString::new(bare).unwrap();
        let mut buf = [0 as std::os::raw::c_char; 256];
        let mut size = buf.len();
        let got = rd::rd_kafka_topic_conf_get(topic, name.as_ptr(), buf.as_mut_ptr(), &mut size);
        let out = if got == rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
            CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
        } else {
            format!("unknown ({got:?})")
        };
        rd::rd_kafka_conf_destroy(conf);
        out
    }
}

#[test]
fn rabbitmq_builder_refuses_zero_timeouts() {
    for f in [
        RabbitMq::builder("amqp://x").confirm_timeout(Duration::ZERO),
        RabbitMq::builder("amqp://x").operation_timeout(Duration::ZERO),
        RabbitMq::builder("amqp://x").connect_timeout(Duration::ZERO),
    ] {
        assert!(f.build().is_err());
    }
}

#[tokio::test]
async fn relay_builder_refuses_zero_attempts_and_poll() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .unwrap();
    assert!(
        Relay::builder(pool.clone(), Fake::default())
            .max_attempts(0)
            .build()
            .is_err()
    );
    assert!(
        Relay::builder(pool, Fake::default())
            .poll_interval(Duration::ZERO)
            .build()
            .is_err()
    );
}

#[allow(dead_code)]
fn unused() {
    let _ = nowhere();
}
