//! The NATS transport against a private 3-node JetStream cluster (streams with three
//! replicas) whose nodes are SIGKILLed mid-run: outbox (business transactions) → relay →
//! JetStream → consumer runner → inbox, with a business effect table. Checks every message
//! took effect exactly once and in order per key, and prints how long publishing stalled.
//! Timings are printed, never asserted.

mod support;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::nats::Nats;
use pgbox::transport::{PublishError, Publisher};
use pgbox::{CancellationToken, Consumer, Envelope, Inbox, Message, Outbox, Relay, RetryPolicy};
use sqlx::{Executor, PgPool};
use support::nats_cluster::{NatsCluster, monitor, stream_leader};

const STREAM: &str = "PGBOX_CLUSTER";
const PREFIX: &str = "pgbox-cluster";
const TOPIC: &str = "orders.paid";
/// Ordering keys (entities); every business transaction emits one message per key.
const KEYS: i64 = 8;
/// Business transactions, one every `PRODUCE_EVERY`.
const TRANSACTIONS: i64 = 400;
const PRODUCE_EVERY: Duration = Duration::from_millis(25);
const N: i64 = KEYS * TRANSACTIONS;
/// Messages the consumer handles at once. One keeps the stream's order per key through the
/// handler; with 8, a backlog (after the publish stall) delivers a key's next messages to
/// concurrent handlers, the later ones are refused and redelivered, and the refusals feed on
/// themselves (measured: 46,901 redeliveries for 3,200 messages, about 40 effects/s for a
/// minute, against 0 and about 230/s with one).
const CONCURRENCY: usize = 1;

/// The two tests start a cluster each; one at a time keeps their timings apart.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn transport(urls: &str) -> Nats {
    Nats::builder(urls)
        .stream(STREAM)
        .subject_prefix(PREFIX)
        .replicas(3)
        // A delivery whose ack went to a dead node comes back after this.
        .ack_wait(Duration::from_secs(5))
        .receive_wait(Duration::from_millis(100))
        .build()
        .expect("valid config")
}

/// A client of our own for stream info, leaders and reading the stream back.
async fn admin(urls: &str) -> async_nats::jetstream::Context {
    let urls: Vec<&str> = urls.split(',').collect();
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(urls)
        .await
        .expect("connect to the cluster");
    async_nats::jetstream::new(client)
}

/// One call of the relay to the publisher.
struct Call {
    start: Instant,
    end: Instant,
    ok: usize,
    failed: usize,
    error: Option<String>,
}

/// The NATS publisher, timing every call and counting its results.
#[derive(Clone)]
struct Timed {
    inner: Nats,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Publisher for Timed {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let start = Instant::now();
        let results = self.inner.publish(batch).await;
        let end = Instant::now();
        let ok = results.iter().filter(|r| r.is_ok()).count();
        let error = results
            .iter()
            .find_map(|r| r.as_ref().err().map(|e| e.to_string()));
        self.calls.lock().unwrap().push(Call {
            start,
            end,
            ok,
            failed: results.len() - ok,
            error,
        });
        results
    }
}

/// The handler's refusal of a message that is ahead of its key's next number: rolled back
/// and redelivered later, as `Inbox::process_in_order` does with `GapPolicy::Wait`.
#[derive(Debug)]
enum HandlerError {
    Pgbox(pgbox::Error),
    Gap { key: String, n: i64, expected: i64 },
}

impl From<pgbox::Error> for HandlerError {
    fn from(e: pgbox::Error) -> Self {
        HandlerError::Pgbox(e)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Pgbox(e) => e.fmt(f),
            HandlerError::Gap { key, n, expected } => {
                write!(f, "{key} #{n} before #{expected}; later")
            }
        }
    }
}

/// What a fault does to the cluster while the pipeline runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL the node leading the stream.
    KillStreamLeader,
    /// SIGKILL a node that leads neither the stream nor its consumer, restart it a few
    /// seconds later, and check it catches up.
    KillFollowerThenRestart,
}

/// The figures of one run.
struct Figures {
    messages: i64,
    lost: i64,
    doubled: i64,
    /// Effects applied out of order per key (the handler refuses them: must be 0).
    order_violations: i64,
    /// Deliveries that came ahead of their key's next number (refused, redelivered).
    early_deliveries: u64,
    /// Messages found twice in the stream (relay re-publishes the duplicate window missed).
    stream_duplicates: usize,
    /// A key's messages out of publication order in the stream.
    stream_order_violations: usize,
    killed: String,
    new_leader: String,
    /// From the kill to the first successful publish after it.
    stall_from_kill: Duration,
    /// The longest gap between successful relay publishes from 1 s before the kill on.
    longest_publish_gap: Duration,
    failed_publishes: usize,
    publish_errors: Vec<String>,
    /// The longest gap between business effects.
    longest_effect_gap: Duration,
    total: Duration,
}

async fn pipeline(cluster: &mut NatsCluster, fault: Fault) -> Figures {
    let urls = cluster.urls();
    let db = support::TestDb::migrated().await;
    let pool = db.pool.clone();
    pool.execute(
        "CREATE TABLE orders (id bigint PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT clock_timestamp());
         CREATE TABLE effects (applied bigserial PRIMARY KEY, message_id uuid NOT NULL,
             key text NOT NULL, n bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
         CREATE TABLE watermarks (key text PRIMARY KEY, n bigint NOT NULL);",
    )
    .await
    .unwrap();
    for k in 0..KEYS {
        sqlx::query("INSERT INTO watermarks VALUES ($1, 0)")
            .bind(format!("k{k}"))
            .execute(&pool)
            .await
            .unwrap();
    }
    let js = admin(&urls).await;
    // Declare the streams and the consumer before anything is published.
    let consumer_side = transport(&urls);
    consumer_side
        .declare_topic(TOPIC)
        .await
        .expect("declare the streams and the consumer");
    let info = js
        .get_stream(STREAM)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.config.num_replicas, 3, "the stream has three replicas");

    let shutdown = CancellationToken::new();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let relay = Relay::builder(
        pool.clone(),
        Timed {
            inner: transport(&urls),
            calls: calls.clone(),
        },
    )
    .batch_size(100)
    .poll_interval(Duration::from_millis(20))
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(20))
            .max_delay(Duration::from_millis(200)),
    )
    .max_attempts(100_000)
    .build()
    .unwrap();
    let consumer = Consumer::builder(
        pool.clone(),
        consumer_side,
        TOPIC.to_owned(),
        Inbox::new("effects").unwrap(),
    )
    .concurrency(CONCURRENCY)
    .poll_interval(Duration::from_millis(10))
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(10))
            .max_delay(Duration::from_millis(100)),
    )
    .max_deliveries(100_000)
    .build()
    .unwrap();
    let early = Arc::new(AtomicU64::new(0));

    let started = Instant::now();
    let produced = Arc::new(AtomicU64::new(0));
    let producer = tokio::spawn({
        let pool = pool.clone();
        let produced = produced.clone();
        async move {
            let outbox = Outbox::new();
            for t in 0..TRANSACTIONS {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                    .bind(t)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let batch = (0..KEYS).map(|k| {
                    Message::json(
                        TOPIC,
                        &serde_json::json!({ "key": format!("k{k}"), "n": t + 1 }),
                    )
                    .unwrap()
                    .ordering_key(format!("k{k}"))
                });
                outbox.enqueue_batch(&mut tx, batch).await.unwrap();
                tx.commit().await.unwrap();
                produced.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(PRODUCE_EVERY).await;
            }
        }
    });
    let relay_task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    let consumer_task = tokio::spawn({
        let s = shutdown.clone();
        let early = early.clone();
        async move {
            consumer
                .run(
                    async move |msg: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                        let body: serde_json::Value = msg.json()?;
                        let key = body["key"].as_str().expect("key").to_owned();
                        let n = body["n"].as_i64().expect("n");
                        let (watermark,): (i64,) =
                            sqlx::query_as("SELECT n FROM watermarks WHERE key = $1 FOR UPDATE")
                                .bind(&key)
                                .fetch_one(&mut *conn)
                                .await
                                .map_err(pgbox::Error::from)?;
                        if n > watermark + 1 {
                            early.fetch_add(1, Ordering::Relaxed);
                            return Err(HandlerError::Gap {
                                key,
                                n,
                                expected: watermark + 1,
                            });
                        }
                        sqlx::query("INSERT INTO effects (message_id, key, n) VALUES ($1, $2, $3)")
                            .bind(msg.id)
                            .bind(&key)
                            .bind(n)
                            .execute(&mut *conn)
                            .await
                            .map_err(pgbox::Error::from)?;
                        sqlx::query("UPDATE watermarks SET n = greatest(n, $2) WHERE key = $1")
                            .bind(&key)
                            .bind(n)
                            .execute(&mut *conn)
                            .await
                            .map_err(pgbox::Error::from)?;
                        Ok::<(), HandlerError>(())
                    },
                    s,
                )
                .await
        }
    });

    // The fault, once a fifth of the transactions committed and effects are flowing.
    let count = async |pool: &PgPool| -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT count(DISTINCT message_id) FROM effects), \
                    (SELECT count(*) FROM pgbox.outbox)",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let deadline = Duration::from_secs(100);
    while produced.load(Ordering::Relaxed) < (TRANSACTIONS / 5) as u64 || count(&pool).await.0 == 0
    {
        assert!(started.elapsed() < deadline, "no progress before the fault");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let leader = stream_leader(&js, STREAM, Duration::from_secs(10)).await;
    let consumer_leader = consumer_leader(&js).await;
    let victim = match fault {
        Fault::KillStreamLeader => leader.clone(),
        Fault::KillFollowerThenRestart => cluster
            .nodes
            .iter()
            .map(|n| n.name.clone())
            .find(|n| *n != leader && Some(n) != consumer_leader.as_ref())
            .expect("a node leading nothing"),
    };
    let effects_at_kill = count(&pool).await.0;
    let kill_at = Instant::now();
    cluster.kill(&victim);
    eprintln!(
        "{fault:?}: killed {victim} at {:?} (stream leader {leader}, consumer leader \
         {consumer_leader:?}, {} transactions committed, {effects_at_kill} effects)",
        kill_at - started,
        produced.load(Ordering::Relaxed)
    );

    let mut restarted = false;
    let mut next_report = Duration::from_secs(5);
    loop {
        let (effects, pending) = count(&pool).await;
        if effects >= N && pending == 0 && (restarted || fault == Fault::KillStreamLeader) {
            break;
        }
        if fault == Fault::KillFollowerThenRestart
            && !restarted
            && kill_at.elapsed() > Duration::from_secs(3)
        {
            let at = Instant::now();
            cluster.restart(&victim).await;
            restarted = true;
            eprintln!(
                "{fault:?}: restarted {victim}; cluster ready again in {:?}",
                at.elapsed()
            );
        }
        if started.elapsed() >= next_report {
            eprintln!(
                "{fault:?}: {effects} effects, {pending} pending, {} transactions",
                produced.load(Ordering::Relaxed)
            );
            next_report += Duration::from_secs(5);
        }
        if started.elapsed() > deadline {
            panic!(
                "only {effects} of {N} effects ({pending} pending) within {deadline:?}\n{}",
                cluster.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total = started.elapsed();
    tokio::time::timeout(Duration::from_secs(5), producer)
        .await
        .expect("the producer is done")
        .unwrap();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), relay_task)
        .await
        .expect("the relay stops within 30 s of shutdown")
        .unwrap()
        .unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(30), consumer_task)
        .await
        .expect("the consumer stops within 30 s of shutdown")
        .unwrap()
        .unwrap();
    eprintln!("{fault:?}: consumer {stats:?}");

    if fault == Fault::KillFollowerThenRestart {
        caught_up(cluster, &js, &victim).await;
    }
    let new_leader = stream_leader(&js, STREAM, Duration::from_secs(10)).await;

    // Exactly once, and in order per key, in the business table.
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap();
    let (order_violations,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM (SELECT n, lag(n, 1, 0::bigint) OVER (PARTITION BY key ORDER BY applied) AS prev \
         FROM effects) e WHERE n <> prev + 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let (longest_effect_gap,): (f64,) = sqlx::query_as(
        "SELECT coalesce(extract(epoch FROM max(gap))::float8, 0) FROM \
         (SELECT at - lag(at) OVER (ORDER BY at) AS gap FROM effects) g",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox_dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(dead, 0, "nothing dead-lettered by the relay");

    let (stream_duplicates, stream_order_violations) = read_stream(&js).await;

    let calls = calls.lock().unwrap();
    let ok_ends: Vec<Instant> = calls.iter().filter(|c| c.ok > 0).map(|c| c.end).collect();
    let stall_from_kill = ok_ends
        .iter()
        .find(|t| **t > kill_at)
        .map(|t| *t - kill_at)
        .expect("a publish succeeded after the kill");
    let window_start = kill_at - Duration::from_secs(1);
    let longest_publish_gap = ok_ends
        .windows(2)
        .filter(|w| w[1] >= window_start)
        .map(|w| w[1] - w[0].max(window_start))
        .max()
        .unwrap_or_default();
    let failed_publishes = calls.iter().map(|c| c.failed).sum();
    let mut publish_errors: Vec<String> = Vec::new();
    for c in calls.iter() {
        if let Some(e) = &c.error
            && publish_errors.len() < 4
            && !publish_errors.contains(e)
        {
            publish_errors.push(format!("{e} (call took {:?})", c.end - c.start));
        }
    }
    Figures {
        messages: N,
        lost: N - distinct,
        doubled: rows - distinct,
        order_violations,
        early_deliveries: early.load(Ordering::Relaxed),
        stream_duplicates,
        stream_order_violations,
        killed: victim,
        new_leader,
        stall_from_kill,
        longest_publish_gap,
        failed_publishes,
        publish_errors,
        longest_effect_gap: Duration::from_secs_f64(longest_effect_gap),
        total,
    }
}

/// The server leading the topic's durable consumer, if it has a leader now.
async fn consumer_leader(js: &async_nats::jetstream::Context) -> Option<String> {
    let stream = js.get_stream(STREAM).await.ok()?;
    let name = format!("pgbox_{}", pgbox::transport::nats::token(TOPIC));
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(&name).await.ok()?;
    consumer.info().await.ok()?.cluster.as_ref()?.leader.clone()
}

/// Reads the whole stream back in sequence order (from its leader): messages found twice,
/// and a key's numbers out of order.
async fn read_stream(js: &async_nats::jetstream::Context) -> (usize, usize) {
    let mut stream = js.get_stream(STREAM).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut ids = HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    let (mut duplicates, mut violations, mut read) = (0, 0, 0);
    let start = Instant::now();
    for seq in state.first_sequence..=state.last_sequence {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "reading the stream took over 30 s"
        );
        let message = stream.get_raw_message(seq).await.unwrap();
        read += 1;
        let id = message
            .headers
            .get("Nats-Msg-Id")
            .map(|v| v.as_str().to_owned())
            .expect("Nats-Msg-Id");
        if !ids.insert(id) {
            duplicates += 1;
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        let key = body["key"].as_str().unwrap().to_owned();
        let n = body["n"].as_i64().unwrap();
        let prev = last.insert(key, n).unwrap_or(0);
        if n != prev + 1 {
            violations += 1;
        }
    }
    assert_eq!(
        read,
        N as usize + duplicates,
        "the stream holds every message"
    );
    (duplicates, violations)
}

/// After a restart: the stream's info shows `name` current with no lag, and its own copy
/// (its monitoring endpoint) holds as many messages, up to the same sequence, as the
/// leader's; waits up to 30 s.
async fn caught_up(cluster: &NatsCluster, js: &async_nats::jetstream::Context, name: &str) {
    let node = &cluster.nodes[cluster.index(name)];
    let start = Instant::now();
    loop {
        let info = js
            .get_stream(STREAM)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .clone();
        let peer = info
            .cluster
            .as_ref()
            .and_then(|c| c.replicas.iter().find(|p| p.name == name).cloned());
        let own = monitor(node.http_port, "/jsz?streams=true")
            .await
            .and_then(|j| {
                j["account_details"].as_array()?.iter().find_map(|a| {
                    a["stream_detail"]
                        .as_array()?
                        .iter()
                        .find(|s| s["name"] == STREAM)
                        .map(|s| {
                            (
                                s["state"]["messages"].as_u64().unwrap_or(0),
                                s["state"]["last_seq"].as_u64().unwrap_or(0),
                            )
                        })
                })
            });
        let leader = (info.state.messages, info.state.last_sequence);
        let current = peer
            .as_ref()
            .is_some_and(|p| p.current && p.lag.unwrap_or(0) == 0);
        if current && own == Some(leader) {
            eprintln!(
                "{name} caught up in {:?} after the run: {} messages up to sequence {} \
                 on its own copy, as on the leader",
                start.elapsed(),
                leader.0,
                leader.1
            );
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{name} did not catch up within 30 s: peer {peer:?}, its copy {own:?}, \
             leader {leader:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} messages: {} lost, {} doubled, {} order violations in the effects \
             ({} deliveries ahead of their key's turn, refused and redelivered)",
            self.messages, self.lost, self.doubled, self.order_violations, self.early_deliveries
        )?;
        writeln!(
            f,
            "stream: {} duplicates, {} order violations per key",
            self.stream_duplicates, self.stream_order_violations
        )?;
        writeln!(
            f,
            "killed {}; stream leader now {}",
            self.killed, self.new_leader
        )?;
        writeln!(
            f,
            "publish stall: first publish ack {:?} after the kill; longest gap between \
             successful publishes {:?}; {} failed publish results {:?}",
            self.stall_from_kill,
            self.longest_publish_gap,
            self.failed_publishes,
            self.publish_errors
        )?;
        write!(
            f,
            "longest gap between effects {:?}; run took {:?}",
            self.longest_effect_gap, self.total
        )
    }
}

fn check(figures: &Figures) {
    eprintln!("FIGURES\n{figures}");
    assert_eq!(figures.lost, 0, "every message took effect");
    assert_eq!(figures.doubled, 0, "no message took effect twice");
    assert_eq!(figures.order_violations, 0, "effects in order per key");
    assert_eq!(
        figures.stream_order_violations, 0,
        "the relay published each key in order"
    );
}

/// The node leading the stream is SIGKILLed while the relay publishes and the consumer
/// consumes: a new leader takes over, publishing resumes, and every message takes effect
/// exactly once, in order per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_leader_killed_mid_run() {
    support::init_tracing();
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cluster = NatsCluster::start(3).await;
    let figures = pipeline(&mut cluster, Fault::KillStreamLeader).await;
    assert_ne!(figures.new_leader, figures.killed, "a new stream leader");
    check(&figures);
}

/// A node leading nothing is SIGKILLed mid-run and restarted three seconds later: the
/// pipeline goes on, and the node's copy of the stream catches up with the leader's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn follower_killed_and_restarted_catches_up() {
    support::init_tracing();
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cluster = NatsCluster::start(3).await;
    let figures = pipeline(&mut cluster, Fault::KillFollowerThenRestart).await;
    check(&figures);
}
