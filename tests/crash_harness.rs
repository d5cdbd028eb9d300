//! The crash harness: a producer, two relays and two consumers, each its own process, run
//! against a private PostgreSQL cluster while the test kills them with SIGKILL at random
//! moments (and starts them again) and crash-restarts the server (`pg_ctl restart -m
//! immediate`). Afterwards every produced message has taken effect exactly once, and each
//! ordering key's messages took effect in the order they were produced.
//!
//! The cluster is the test's own (a temporary directory, a free port), never the shared
//! server the other tests use. Every loop is bounded.
//!
//! A WAL run has the producer emit to the WAL (`OutboxMode::Wal`) and the relays read a
//! replication slot (`WalRelay`: one reader, the other takes over when it is killed), with the
//! server crash-restarted as in the first run.
//!
//! One of the two consumers processes up to 16 messages per transaction
//! (`ConsumerBuilder::batch_size`): a kill or a crash mid-batch must lose or double nothing
//! either.
//!
//! A second run puts a private PgBouncer in transaction mode between every process and the
//! server (`Pooler::Transaction` everywhere) and kills and restarts the pooler once, instead
//! of the server.

mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, Envelope, Error, Inbox, Message, Outbox, OutboxMode, Pooler,
    Relay, WalRelay, WalSlot,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use support::cluster::Cluster;
use support::pooler::PgBouncer;

/// Set in a child process: its role (`producer`, `relay`, `consumer` or `batch-consumer`).
const ROLE_ENV: &str = "PGBOX_CRASH_ROLE";
/// Set in a child process: the database it works on.
const URL_ENV: &str = "PGBOX_CRASH_URL";
/// Set in a child process that reaches the server through a pooler in transaction mode.
const POOLER_ENV: &str = "PGBOX_CRASH_POOLER";

/// Set in a child process whose outbox is the WAL.
const WAL_ENV: &str = "PGBOX_CRASH_WAL";
/// The WAL run's replication slot.
const SLOT: &str = "crash";

fn wal_mode() -> bool {
    std::env::var(WAL_ENV).is_ok()
}

/// What the child's URL goes through.
fn pooler() -> Pooler {
    if std::env::var(POOLER_ENV).is_ok() {
        Pooler::Transaction
    } else {
        Pooler::None
    }
}

/// Whether the child's own statements may be named (not behind the pooler).
fn named() -> bool {
    pooler() == Pooler::None
}

/// Messages the producer writes in all, over `KEYS` ordering keys, `PER_TX` per transaction.
const TOTAL: i64 = 2_000;
const KEYS: i64 = 20;
const PER_TX: i64 = 5;
const TOPIC: &str = "crash";

/// A connection to `url`, retried while the server restarts (up to 60 s).
async fn connect(url: &str) -> PgConnection {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match PgConnection::connect(url).await {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("cannot connect to {url}: {e}"),
        }
    }
}

/// One scalar of a query, retried across server restarts.
async fn scalar(url: &str, sql: &'static str) -> i64 {
    for _ in 0..100 {
        let mut conn = connect(url).await;
        match sqlx::query_scalar::<_, i64>(sql).fetch_one(&mut conn).await {
            Ok(v) => return v,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    panic!("{sql} kept failing");
}

async fn pool(url: &str, connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(url)
        .expect("pool options")
}

/// The producer: transactions of `PER_TX` messages, each with its business rows, resuming
/// after a kill from what committed. Returns when all `TOTAL` are produced.
async fn produce(url: &str) {
    let pool = pool(url, 2).await;
    let outbox = Outbox::new().pooler(pooler()).mode(if wal_mode() {
        OutboxMode::Wal
    } else {
        OutboxMode::Table
    });
    loop {
        let attempt = async {
            let mut tx = pool.begin().await?;
            let next: i64 = sqlx::query_scalar("SELECT coalesce(max(n) + 1, 0) FROM produced")
                .persistent(named())
                .fetch_one(&mut *tx)
                .await?;
            if next >= TOTAL {
                return Ok::<bool, Error>(true);
            }
            let last = (next + PER_TX).min(TOTAL);
            sqlx::query("INSERT INTO produced (n) SELECT generate_series($1::bigint, $2 - 1)")
                .persistent(named())
                .bind(next)
                .bind(last)
                .execute(&mut *tx)
                .await?;
            let messages = (next..last).map(|n| {
                Message::json(TOPIC, &n)
                    .expect("a number serializes")
                    .ordering_key(format!("k{}", n % KEYS))
            });
            outbox.enqueue_batch(&mut tx, messages).await?;
            tx.commit().await?;
            Ok(false)
        };
        match attempt.await {
            Ok(true) => return,
            Ok(false) => tokio::time::sleep(Duration::from_millis(40)).await,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// A relay into the built-in queue, started again whenever its run fails.
async fn relay(url: &str) {
    let pool = pool(url, 3).await;
    if wal_mode() {
        let relay = WalRelay::builder(
            pool.clone(),
            WalSlot::new(SLOT).expect("slot name"),
            PgQueue::new(pool),
        )
        .batch_size(200)
        .poll_interval(Duration::from_millis(100))
        .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(100)))
        .build()
        .expect("WAL relay config");
        loop {
            let _ = relay.run(CancellationToken::new()).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let relay = Relay::builder(pool.clone(), PgQueue::new(pool).pooler(pooler()))
        .pooler(pooler())
        .batch_size(50)
        .poll_interval(Duration::from_millis(200))
        .build()
        .expect("relay config");
    loop {
        let _ = relay.run(CancellationToken::new()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A consumer recording each message's effect through the inbox, started again whenever
/// its run fails.
/// `batch`: messages per transaction (the `batch-consumer` role runs 16).
async fn consume(url: &str, batch: usize) {
    let pool = pool(url, 6).await;
    let consumer = Consumer::builder(
        pool.clone(),
        PgQueue::new(pool).pooler(pooler()),
        TOPIC,
        Inbox::builder("effects")
            .pooler(pooler())
            .build()
            .expect("consumer name"),
    )
    .concurrency(4)
    .batch_size(batch)
    .visibility_timeout(Duration::from_secs(2))
    .poll_interval(Duration::from_millis(200))
    .max_deliveries(1_000)
    .build()
    .expect("consumer config");
    loop {
        let _ = consumer
            .run(
                async |envelope: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                    let n: i64 = envelope.json()?;
                    // The effect in a nested unit of work (a savepoint) that also records the
                    // message in a second inbox: a kill or a crash anywhere must leave both
                    // or neither, whatever the nested commit did.
                    let mut unit = sqlx::Connection::begin(&mut **conn).await?;
                    sqlx::query("INSERT INTO effects (n, key, message_id) VALUES ($1, $2, $3)")
                        .persistent(named())
                        .bind(n)
                        .bind(envelope.ordering_key.as_deref())
                        .bind(envelope.id)
                        .execute(&mut *unit)
                        .await
                        .map_err(Error::from)?;
                    let nested = Inbox::builder("followups")
                        .pooler(pooler())
                        .build()?
                        .process(&mut unit, n.to_string(), async |_| Ok::<(), Error>(()))
                        .await?;
                    if !nested.is_processed() {
                        return Err(Error::InvalidConfig(format!("followup {n}: {nested:?}")));
                    }
                    unit.commit().await?;
                    Ok::<(), Error>(())
                },
                CancellationToken::new(),
            )
            .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A child process's body: a no-op in a normal test run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let (Ok(role), Ok(url)) = (std::env::var(ROLE_ENV), std::env::var(URL_ENV)) else {
        return;
    };
    match role.as_str() {
        "producer" => {
            produce(&url).await;
            // Done: stay alive like a service would, until killed.
            std::future::pending::<()>().await;
        }
        "relay" => relay(&url).await,
        "consumer" => consume(&url, 1).await,
        "batch-consumer" => consume(&url, 16).await,
        other => panic!("unknown role {other}"),
    }
}

/// One child process per role instance, started again after each kill.
struct Process {
    role: &'static str,
    child: Child,
    kills: u32,
    mode: Mode,
}

impl Process {
    fn spawn(role: &'static str, url: &str, logs: &Path, mode: Mode) -> Process {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(logs.join(format!("{role}.log")))
            .unwrap();
        let mut command = Command::new(std::env::current_exe().unwrap());
        match mode {
            Mode::Pooler => {
                command.env(POOLER_ENV, "transaction");
            }
            Mode::Wal => {
                command.env(WAL_ENV, "1");
            }
            Mode::Direct => {}
        }
        let child = command
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, role)
            .env(URL_ENV, url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn a child process");
        Process {
            role,
            child,
            kills: 0,
            mode,
        }
    }

    /// SIGKILL, reaped, then started again.
    fn kill_and_restart(&mut self, url: &str, logs: &Path) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let kills = self.kills + 1;
        *self = Process::spawn(self.role, url, logs, self.mode);
        self.kills = kills;
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_killed_and_postgres_crash_restarted_lose_nothing_double_nothing_reorder_nothing()
{
    if std::env::var(ROLE_ENV).is_ok() {
        return; // a child runs only `crash_child`
    }
    harness(Mode::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_outbox_processes_killed_and_postgres_crash_restarted_lose_nothing_double_nothing() {
    if std::env::var(ROLE_ENV).is_ok() {
        return; // a child runs only `crash_child`
    }
    harness(Mode::Wal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_processes_and_the_pooler_killed_lose_nothing_double_nothing() {
    if std::env::var(ROLE_ENV).is_ok() {
        return; // a child runs only `crash_child`
    }
    harness(Mode::Pooler).await;
}

/// How the processes reach the server and where the outbox is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Directly, the table outbox.
    Direct,
    /// Through a private PgBouncer in transaction mode, which is killed and restarted once
    /// (the server is not crash-restarted then).
    Pooler,
    /// Directly, the WAL outbox and `WalRelay`.
    Wal,
}

/// The chaos run.
async fn harness(mode: Mode) {
    let through_pooler = mode == Mode::Pooler;
    let cluster = tokio::task::spawn_blocking(if mode == Mode::Wal {
        Cluster::start_logical
    } else {
        Cluster::start
    })
    .await
    .unwrap();
    // The checks and the set-up go direct; the processes through the pooler if asked.
    let url = cluster.url("crash");
    let mut bouncer = through_pooler.then(|| PgBouncer::start(&cluster, 8));
    let process_url = match &bouncer {
        Some(b) => b.url("crash"),
        None => url.clone(),
    };
    {
        let mut admin = connect(&cluster.url("postgres")).await;
        admin.execute("CREATE DATABASE crash").await.unwrap();
    }
    let setup = pool(&url, 2).await;
    pgbox::migrate(&setup).await.unwrap();
    setup
        .execute(
            "CREATE TABLE produced (n bigint PRIMARY KEY); \
             CREATE TABLE effects (seq bigserial PRIMARY KEY, n bigint NOT NULL, \
                                   key text NOT NULL, message_id uuid NOT NULL)",
        )
        .await
        .unwrap();
    if mode == Mode::Wal {
        WalSlot::new(SLOT).unwrap().create(&setup).await.unwrap();
    }
    setup.close().await;

    let logs = cluster.dir().to_path_buf();
    let mut processes: Vec<Process> = ["producer", "relay", "relay", "consumer", "batch-consumer"]
        .into_iter()
        .map(|role| Process::spawn(role, &process_url, &logs, mode))
        .collect();

    // Chaos for a bounded time: a random process killed every 0.3–1.5 s, the server
    // crash-restarted three times, spread over the period.
    let chaos = Duration::from_secs(30);
    let start = Instant::now();
    let mut restarts = 0;
    let mut kills = 0;
    while start.elapsed() < chaos {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(300..1_500))).await;
        if let Some(b) = bouncer.as_mut() {
            if restarts < 1 && start.elapsed() > chaos / 2 {
                tokio::task::block_in_place(|| b.kill_and_restart());
                restarts += 1;
                continue;
            }
        } else if restarts < 3 && start.elapsed() > chaos * (restarts * 3 + 2) / 10 {
            let c = &cluster;
            tokio::task::block_in_place(|| c.crash_restart());
            restarts += 1;
            continue;
        }
        let i = fastrand::usize(..processes.len());
        processes[i].kill_and_restart(&process_url, &logs);
        kills += 1;
    }
    let restarted = if through_pooler {
        "pooler"
    } else {
        "server crash-"
    };
    eprintln!("chaos over: {kills} processes killed, {restarts} {restarted}restarts; draining");

    // Drain: everything produced, published and consumed, within a bound.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let effects = scalar(&url, "SELECT count(*) FROM effects").await;
        let produced = scalar(&url, "SELECT count(*) FROM produced").await;
        let outbox = scalar(&url, "SELECT count(*) FROM pgbox.outbox").await;
        let queue = scalar(&url, "SELECT count(*) FROM pgbox.queue").await;
        if produced == TOTAL && outbox == 0 && queue == 0 && effects >= TOTAL {
            break;
        }
        if Instant::now() > deadline {
            let mut log = std::fs::read_to_string(logs.join("consumer.log")).unwrap_or_default();
            log += &std::fs::read_to_string(logs.join("batch-consumer.log")).unwrap_or_default();
            let tail: String = log.lines().rev().take(30).collect::<Vec<_>>().join("\n");
            panic!(
                "not drained within 120 s: produced {produced}, outbox {outbox}, \
                 queue {queue}, effects {effects}; consumer log (last lines, newest first):\n{tail}"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(processes);

    let mut conn = connect(&url).await;
    let (total, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT n) FROM effects")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(distinct, TOTAL, "every produced message took effect");
    assert_eq!(total, TOTAL, "no message took effect twice");
    let unproduced: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM effects e WHERE NOT EXISTS (SELECT 1 FROM produced p WHERE p.n = e.n)",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(unproduced, 0, "only committed messages took effect");
    let (followups, distinct_followups): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT key) FROM pgbox.inbox WHERE consumer = 'followups'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        (followups, distinct_followups),
        (TOTAL, TOTAL),
        "the nested unit's inbox record committed exactly with each effect"
    );
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT n, lag(n) OVER (PARTITION BY key ORDER BY seq) AS before \
         FROM effects) e WHERE e.before > e.n",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(out_of_order, 0, "each key's messages took effect in order");
    let dead: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pgbox.outbox_dead_letters) \
              + (SELECT count(*) FROM pgbox.queue_dead_letters)",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(dead, 0, "nothing dead-lettered");
    assert!(kills >= 10, "only {kills} kills");
    assert_eq!(restarts, if through_pooler { 1 } else { 3 });
    if through_pooler {
        let log = cluster.log();
        let prepared: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("prepared statement") || l.contains("bind message"))
            .collect();
        assert!(
            prepared.is_empty(),
            "statements broken by the pooler: {prepared:?}"
        );
    }
    eprintln!("crash harness: {TOTAL} messages, exactly once, in per-key order");
}
