//! Failover to a standby, on a private primary and a streaming standby of the test's own
//! (never the shared server): producers enqueue in business transactions, a relay moves the
//! outbox into the built-in queue, consumer runners apply the effects through the inbox; the
//! primary is killed (`pg_ctl stop -m immediate`), the standby promoted, and the clients'
//! address (a TCP proxy, standing for a virtual IP, a DNS name or HAProxy) moved to it. Then
//! everything keeps going.
//!
//! - Synchronous replication (`remote_apply`): nothing a producer was told committed is lost,
//!   no effect happens twice, each ordering key's effects keep their order, the outbox drains.
//! - Asynchronous: the commits the standby had not received are lost (measured and printed);
//!   what remains is consistent: every order left has exactly one effect, none twice, the
//!   outbox drains, the doctor is green.
//! - A standby refuses pgbox's writes with a retryable `ReadOnly` error, and the runner never
//!   runs a handler whose inbox row it could not write; the same connections work once the
//!   standby is promoted.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pgbox::doctor::{self, Code, Severity};
use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, DbErrorKind, Envelope, Error, HandlerConnection, Inbox, Message,
    Outbox, Relay, RetryPolicy,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Connection, Executor, PgConnection, PgPool};
use support::brokers::Proxy;
use support::cluster::Cluster;

const TOPIC: &str = "orders";
const PRODUCERS: i32 = 3;
/// Ordering keys per producer.
const KEYS: i32 = 4;

fn options(addr: SocketAddr) -> PgConnectOptions {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(addr.port())
        .username("postgres")
        .database("postgres")
        .ssl_mode(PgSslMode::Disable)
}

async fn pool_at(addr: SocketAddr, connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options(addr))
        .await
        .unwrap()
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A primary and a streaming standby, started off the runtime's threads.
async fn clusters(sync: bool) -> (Cluster, Cluster) {
    tokio::task::spawn_blocking(move || {
        let primary = Cluster::start();
        let standby = Cluster::standby_of(&primary, sync);
        (primary, standby)
    })
    .await
    .unwrap()
}

/// A primary and an asynchronous standby that streams through a proxy (the replication
/// link), which the test can cut.
async fn clusters_with_link() -> (Cluster, Cluster, Proxy) {
    let primary = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let link = Proxy::start(primary.addr()).await;
    let port = link.addr().port();
    let standby = tokio::task::block_in_place(|| Cluster::standby_via(&primary, false, port));
    (primary, standby, link)
}

/// An address nothing listens on.
fn nowhere() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// How the standby replicates.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// `synchronous_commit = remote_apply` with this standby as the synchronous one.
    Sync,
    /// Asynchronous, streaming as fast as it can until the primary dies.
    Async,
    /// Asynchronous, with the replication link cut this long before the primary dies (a
    /// standby that lags by that much: a network problem, a slow disk, a burst of writes).
    AsyncLagging(Duration),
}

/// What the producers know: the sequence numbers each was told committed (an answered
/// COMMIT, or a retry that found its row), and how the failed attempts failed.
#[derive(Default)]
struct Produced {
    committed: BTreeSet<(i32, i32)>,
    /// Attempts whose COMMIT got no answer (the outcome unknown to the producer).
    uncertain: u64,
    errors: BTreeMap<String, u64>,
    /// Orders committed after the promotion.
    after: u64,
    /// The last commit before the primary died, and the first one after.
    last_before: Option<Instant>,
    first_after: Option<Instant>,
}

/// One business transaction: the order row (its natural key makes a retry of an unknown
/// outcome find it instead of ordering twice) and, only with a new row, its message.
/// `Ok(true)`: committed now; `Ok(false)`: an earlier attempt had committed it.
async fn place_order(pool: &PgPool, producer: i32, seq: i32) -> Result<bool, (Error, bool)> {
    let mut tx = pool.begin().await.map_err(|e| (Error::from(e), false))?;
    let inserted =
        sqlx::query("INSERT INTO orders (producer, seq) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(producer)
            .bind(seq)
            .execute(&mut *tx)
            .await
            .map_err(|e| (Error::from(e), false))?
            .rows_affected()
            == 1;
    if inserted {
        let message = Message::json(
            TOPIC,
            &serde_json::json!({ "producer": producer, "seq": seq }),
        )
        .unwrap()
        .ordering_key(format!("p{producer}-k{}", seq % KEYS));
        Outbox::new()
            .enqueue(&mut tx, message)
            .await
            .map_err(|e| (e, false))?;
    }
    tx.commit().await.map_err(|e| (Error::from(e), true))?;
    Ok(inserted)
}

/// Places orders 0, 1, 2, … until `stop`, each retried (bounded) until it is known committed.
async fn producer(
    pool: PgPool,
    id: i32,
    stop: CancellationToken,
    failed_over: Arc<AtomicU64>,
) -> Produced {
    let mut produced = Produced::default();
    let mut seq = 0;
    while !stop.is_cancelled() {
        let started = Instant::now();
        loop {
            match place_order(&pool, id, seq).await {
                Ok(_) => {
                    produced.committed.insert((id, seq));
                    let now = Instant::now();
                    if failed_over.load(Ordering::SeqCst) == 0 {
                        produced.last_before = Some(now);
                    } else {
                        produced.after += 1;
                        produced.first_after.get_or_insert(now);
                    }
                    break;
                }
                Err((e, at_commit)) => {
                    if at_commit {
                        produced.uncertain += 1;
                    }
                    let kind = e
                        .db_kind()
                        .map_or_else(|| "other".to_owned(), |k| k.to_string());
                    *produced.errors.entry(kind).or_default() += 1;
                    assert!(e.is_retryable(), "producer {id}: not retryable: {e}");
                    assert!(
                        started.elapsed() < Duration::from_secs(30),
                        "producer {id}: order {seq} not placed within 30 s: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        seq += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    produced
}

fn backoff() -> RetryPolicy {
    RetryPolicy::new()
        .base_delay(Duration::from_millis(20))
        .max_delay(Duration::from_millis(200))
}

async fn prepare(pool: &PgPool) {
    pgbox::migrate(pool).await.unwrap();
    pool.execute(
        "CREATE TABLE orders (producer int NOT NULL, seq int NOT NULL, PRIMARY KEY (producer, seq)); \
         CREATE TABLE effects (id bigserial PRIMARY KEY, producer int NOT NULL, seq int NOT NULL, \
                               message_id uuid NOT NULL)",
    )
    .await
    .unwrap();
}

/// What one failover run saw.
struct Run {
    committed: usize,
    lost: Vec<(i32, i32)>,
    uncertain: u64,
    errors: BTreeMap<String, u64>,
    unavailable: Duration,
    after_promotion: u64,
    /// Orders committed per second before the kill.
    rate_before: f64,
}

async fn failover_under_load(mode: Mode) -> Run {
    support::init_tracing();
    let sync = mode == Mode::Sync;
    let (primary, standby, link) = match mode {
        Mode::AsyncLagging(_) => {
            let (p, s, l) = clusters_with_link().await;
            (p, s, Some(l))
        }
        _ => {
            let (p, s) = clusters(sync).await;
            (p, s, None)
        }
    };
    let proxy = Proxy::start(primary.addr()).await;
    let pool = pool_at(proxy.addr(), 12).await;
    prepare(&pool).await;

    // The doctor sees the replication as it is.
    let report = doctor::check(&pool, "pgbox").await.unwrap();
    let replication: Vec<_> = report
        .findings
        .iter()
        .filter(|f| f.check() == doctor::Check::Replication)
        .collect();
    assert_eq!(replication.len(), 1, "{report:#?}");
    if sync {
        assert_eq!(replication[0].code, Code::ReplicationOk, "{report:#?}");
        assert!(
            replication[0].message.contains("synchronous"),
            "{report:#?}"
        );
    } else {
        assert_eq!(replication[0].code, Code::AsyncReplication, "{report:#?}");
        assert_eq!(replication[0].severity, Severity::Warning);
        assert!(
            replication[0].advice.contains("synchronous_standby_names"),
            "{report:#?}"
        );
    }

    let shutdown = CancellationToken::new();
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone())
        .poll_interval(Duration::from_millis(50))
        .backoff(backoff())
        .max_attempts(1000)
        .build()
        .unwrap();
    let relay_task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let consumer = Consumer::builder(
            pool.clone(),
            queue.clone(),
            TOPIC,
            Inbox::new("fulfilment").unwrap(),
        )
        .poll_interval(Duration::from_millis(50))
        .backoff(backoff())
        .visibility_timeout(Duration::from_secs(3))
        .max_deliveries(1000)
        .concurrency(4)
        .build()
        .unwrap();
        let s = shutdown.clone();
        consumers.push(tokio::spawn(async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        let body: serde_json::Value = serde_json::from_slice(&e.payload)
                            .map_err(|e| Error::InvalidConfig(e.to_string()))?;
                        sqlx::query(
                            "INSERT INTO effects (producer, seq, message_id) VALUES ($1, $2, $3)",
                        )
                        .bind(body["producer"].as_i64().unwrap() as i32)
                        .bind(body["seq"].as_i64().unwrap() as i32)
                        .bind(e.id)
                        .execute(&mut *conn)
                        .await?;
                        Ok::<_, Error>(())
                    },
                    s,
                )
                .await
        }));
    }
    let stop_producing = CancellationToken::new();
    let failed_over = Arc::new(AtomicU64::new(0));
    let load_started = Instant::now();
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|id| {
            tokio::spawn(producer(
                pool.clone(),
                id,
                stop_producing.clone(),
                failed_over.clone(),
            ))
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(2500)).await;
    if let (Mode::AsyncLagging(lag), Some(link)) = (mode, &link) {
        // The standby stops receiving; the primary carries on without it.
        link.retarget(nowhere());
        link.cut();
        tokio::time::sleep(lag).await;
    }
    // The primary dies; the standby is promoted; the address follows it.
    let killed = Instant::now();
    let load_time = load_started.elapsed().as_secs_f64();
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        standby.promote();
    });
    failed_over.store(1, Ordering::SeqCst);
    proxy.retarget(standby.addr());
    let promoted_in = killed.elapsed();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop_producing.cancel();
    let mut produced = Produced::default();
    for p in producers {
        let p = p.await.unwrap();
        produced.committed.extend(p.committed);
        produced.uncertain += p.uncertain;
        produced.after += p.after;
        for (k, n) in p.errors {
            *produced.errors.entry(k).or_default() += n;
        }
        produced.last_before = produced.last_before.max(p.last_before);
        produced.first_after = match (produced.first_after, p.first_after) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    // Everything committed drains: the outbox is published, the queue consumed.
    let started = Instant::now();
    loop {
        let left = scalar(
            &pool,
            "SELECT (SELECT count(*) FROM pgbox.outbox) + (SELECT count(*) FROM pgbox.queue)",
        )
        .await;
        if left == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{left} messages still in the outbox or the queue 30 s after the failover"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    relay_task.await.unwrap().unwrap();
    for c in consumers {
        let stats = c.await.unwrap().unwrap();
        assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    }

    // What the new primary holds.
    let orders: BTreeSet<(i32, i32)> = sqlx::query_as("SELECT producer, seq FROM orders")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let lost: Vec<(i32, i32)> = produced.committed.difference(&orders).copied().collect();
    let unknown: Vec<_> = orders.difference(&produced.committed).collect();
    assert!(
        unknown.is_empty(),
        "orders no producer saw committed: {unknown:?}"
    );
    // Exactly one effect per order left, none for an order that is gone.
    let doubled = scalar(
        &pool,
        "SELECT count(*) FROM (SELECT 1 FROM effects GROUP BY producer, seq HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(doubled, 0, "an order took effect twice");
    let missing = scalar(
        &pool,
        "SELECT count(*) FROM orders o \
         WHERE NOT EXISTS (SELECT 1 FROM effects e WHERE (e.producer, e.seq) = (o.producer, o.seq))",
    )
    .await;
    assert_eq!(missing, 0, "an order left never took effect");
    let orphans = scalar(
        &pool,
        "SELECT count(*) FROM effects e \
         WHERE NOT EXISTS (SELECT 1 FROM orders o WHERE (e.producer, e.seq) = (o.producer, o.seq))",
    )
    .await;
    assert_eq!(orphans, 0, "an effect of an order that is gone");
    // Per ordering key, the effects were applied in order.
    let out_of_order = scalar(
        &pool,
        &format!(
            "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY producer, seq % {KEYS} \
             ORDER BY id) AS before FROM effects) s WHERE before > seq"
        ),
    )
    .await;
    assert_eq!(out_of_order, 0, "an ordering key's effects out of order");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM pgbox.outbox_dead_letters").await
            + scalar(&pool, "SELECT count(*) FROM pgbox.queue_dead_letters").await,
        0
    );
    assert!(produced.after > 0, "no order placed after the promotion");

    // The doctor on the promoted server: green, and says there is nothing to fail over to.
    let report = doctor::check(&pool, "pgbox").await.unwrap();
    assert_eq!(report.count(Severity::Critical), 0, "{report:#?}");
    let replication = report.with_code(Code::ReplicationOk).next();
    let replication = replication.unwrap_or_else(|| panic!("{report:#?}"));
    assert!(
        replication.message.contains("nothing to fail over to"),
        "{replication:?}"
    );
    for f in report.findings.iter().filter(|f| f.severity > Severity::Ok) {
        eprintln!(
            "doctor after the failover: {} {}: {}",
            f.severity, f.code, f.message
        );
    }
    assert!(report.is_ok(), "{report:#?}");

    let unavailable = match (produced.last_before, produced.first_after) {
        (Some(a), Some(b)) => b.duration_since(a),
        _ => panic!("no commit on one side of the failover"),
    };
    // What was lost is a tail: per producer, consecutive orders, and every order after them
    // was placed on the promoted server (the standby had a prefix of the primary's history).
    for p in 0..PRODUCERS {
        let gone: Vec<i32> = lost.iter().filter(|o| o.0 == p).map(|o| o.1).collect();
        if let (Some(first), Some(last)) = (gone.first(), gone.last()) {
            assert_eq!(
                (last - first + 1) as usize,
                gone.len(),
                "producer {p} lost {gone:?}"
            );
        }
    }
    eprintln!(
        "failover ({mode:?}): promoted {:.0} ms after the kill",
        promoted_in.as_secs_f64() * 1000.0
    );
    Run {
        committed: produced.committed.len(),
        lost,
        uncertain: produced.uncertain,
        errors: produced.errors,
        unavailable,
        after_promotion: produced.after,
        rate_before: (produced.committed.len() as u64 - produced.after) as f64 / load_time,
    }
}

/// The lost orders as ranges per producer: `p0 142..=173, p1 146..=176`.
fn ranges(lost: &[(i32, i32)]) -> String {
    let mut out = Vec::new();
    for p in 0..PRODUCERS {
        let seqs: Vec<i32> = lost.iter().filter(|o| o.0 == p).map(|o| o.1).collect();
        if let (Some(first), Some(last)) = (seqs.first(), seqs.last()) {
            out.push(format!("p{p} {first}..={last}"));
        }
    }
    if out.is_empty() {
        "none".to_owned()
    } else {
        out.join(", ")
    }
}

fn report(mode: &str, run: &Run) {
    eprintln!(
        "failover ({mode}): {} orders committed as far as their producers knew, {} lost \
         ({}); {} commits without an answer (retried, found or redone); producers' failed \
         attempts by kind: {:?}; no commit for {:.0} ms; {} orders after the promotion, all \
         taken effect once",
        run.committed,
        run.lost.len(),
        ranges(&run.lost),
        run.uncertain,
        run.errors,
        run.unavailable.as_secs_f64() * 1000.0,
        run.after_promotion,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_replication_loses_nothing_across_a_failover() {
    let run = failover_under_load(Mode::Sync).await;
    report("sync", &run);
    assert!(
        run.lost.is_empty(),
        "lost under remote_apply: {:?}",
        run.lost
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_replication_loses_at_most_the_unreplicated_tail_and_stays_consistent() {
    let run = failover_under_load(Mode::Async).await;
    report("async", &run);
}

/// A standby that lags: the replication link is cut half a second before the primary dies.
/// The orders of that half second are lost (every one of them, and nothing else); what
/// remains is consistent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_replication_loses_what_a_lagging_standby_had_not_received() {
    let lag = Duration::from_millis(500);
    let run = failover_under_load(Mode::AsyncLagging(lag)).await;
    report("async, standby 500 ms behind", &run);
    eprintln!(
        "failover (async, standby 500 ms behind): {:.0} orders/s committed before the kill; \
         {} lost = {:.0} ms of them",
        run.rate_before,
        run.lost.len(),
        run.lost.len() as f64 / run.rate_before * 1000.0
    );
    assert!(
        !run.lost.is_empty(),
        "nothing lost although the standby missed the last {lag:?}"
    );
}

/// Before a promotion: the runner, the relay and the outbox on the standby fail with a
/// retryable `ReadOnly` error and no handler runs; after it, the same pool (its connections
/// made to the standby) processes every message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_refuses_writes_retryably_and_works_once_promoted() {
    support::init_tracing();
    let (primary, standby) = clusters(false).await;
    let primary_pool = pool_at(primary.addr(), 4).await;
    prepare(&primary_pool).await;
    let mut tx = primary_pool.begin().await.unwrap();
    for i in 0..20 {
        Outbox::new()
            .enqueue(
                &mut tx,
                Message::json(TOPIC, &serde_json::json!({ "producer": 0, "seq": i })).unwrap(),
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let queue_on_primary = PgQueue::new(primary_pool.clone());
    Relay::builder(primary_pool.clone(), queue_on_primary.clone())
        .build()
        .unwrap()
        .drain()
        .await
        .unwrap();
    let standby_pool = pool_at(standby.addr(), 4).await;
    // The standby has the queue.
    let started = Instant::now();
    while scalar(&standby_pool, "SELECT count(*) FROM pgbox.queue").await < 20 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "not replicated"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let read_only = |e: &Error| {
        assert_eq!(e.db_kind(), Some(DbErrorKind::ReadOnly), "{e}");
        assert!(e.is_retryable(), "{e}");
    };
    // The outbox and the relay.
    let mut tx = standby_pool.begin().await.unwrap();
    read_only(
        &Outbox::new()
            .enqueue(&mut tx, Message::bytes(TOPIC, "x"))
            .await
            .unwrap_err(),
    );
    drop(tx);
    let relay_on_standby = Relay::builder(standby_pool.clone(), PgQueue::new(standby_pool.clone()))
        .build()
        .unwrap();
    read_only(&relay_on_standby.relay_once().await.unwrap_err());
    // The doctor says what this server is.
    let report = doctor::check(&standby_pool, "pgbox").await.unwrap();
    let finding = report
        .with_code(Code::ServerIsStandby)
        .next()
        .unwrap_or_else(|| panic!("{report:#?}"));
    assert_eq!(finding.severity, Severity::Critical);
    assert!(finding.advice.contains("primary"), "{finding:?}");
    assert_eq!(report.count(Severity::Critical), 1, "{report:#?}");

    // The runner: messages from the primary's queue, the inbox on the standby. Every claim
    // fails; the handler never runs; the deliveries are nacked, not lost, and not
    // dead-lettered either, however many there were: the messages are fine, the database
    // is not there yet.
    let ran = Arc::new(AtomicU64::new(0));
    let handler = {
        let ran = ran.clone();
        async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
            ran.fetch_add(1, Ordering::SeqCst);
            sqlx::query("INSERT INTO effects (producer, seq, message_id) VALUES (0, 0, $1)")
                .bind(e.id)
                .execute(&mut *conn)
                .await?;
            Ok::<_, Error>(())
        }
    };
    let consumer = Consumer::builder(
        standby_pool.clone(),
        queue_on_primary,
        TOPIC,
        Inbox::new("fulfilment").unwrap(),
    )
    .poll_interval(Duration::from_millis(50))
    .backoff(backoff())
    .visibility_timeout(Duration::from_secs(2))
    .max_deliveries(2)
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (s, h) = (shutdown.clone(), handler.clone());
        async move { consumer.run(h, s).await }
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 0, "a handler ran: {stats:?}");
    assert!(stats.retried >= 20, "{stats:?}");
    assert_eq!(
        stats.processed + stats.duplicates + stats.dead_lettered,
        0,
        "{stats:?}"
    );
    assert_eq!(
        scalar(&primary_pool, "SELECT count(*) FROM pgbox.queue").await,
        20
    );
    let deliveries = scalar(
        &primary_pool,
        "SELECT max(deliveries)::int8 FROM pgbox.queue",
    )
    .await;
    assert!(deliveries > 2, "{deliveries} deliveries: {stats:?}");
    assert_eq!(
        scalar(
            &primary_pool,
            "SELECT count(*) FROM pgbox.queue_dead_letters"
        )
        .await,
        0
    );

    // Promotion. The standby pool's connections were made to a standby; they now write.
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        standby.promote();
    });
    let consumer = Consumer::builder(
        standby_pool.clone(),
        PgQueue::new(standby_pool.clone()),
        TOPIC,
        Inbox::new("fulfilment").unwrap(),
    )
    .poll_interval(Duration::from_millis(50))
    .backoff(backoff())
    .max_deliveries(1000)
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (s, h) = (shutdown.clone(), handler.clone());
        async move { consumer.run(h, s).await }
    });
    let started = Instant::now();
    while scalar(&standby_pool, "SELECT count(*) FROM pgbox.queue").await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the promoted standby's queue did not drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(stats.processed, 20, "{stats:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 20);
    assert_eq!(
        scalar(
            &standby_pool,
            "SELECT count(DISTINCT message_id) FROM effects"
        )
        .await,
        20
    );
    // And the relay and the doctor are at home there.
    relay_on_standby.relay_once().await.unwrap();
    let report = doctor::check(&standby_pool, "pgbox").await.unwrap();
    assert!(
        report.with_code(Code::ReplicationOk).next().is_some(),
        "{report:#?}"
    );
    let mut conn = PgConnection::connect_with(&options(standby.addr()))
        .await
        .unwrap();
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(!in_recovery);
}
