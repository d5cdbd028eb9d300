//! Consumer limits (`Limit`) across runner instances: two or three `Consumer`s on pools of
//! their own share the database and nothing else. A concurrency limit is never exceeded and
//! is reached (it is not stricter than asked), globally and per prefix; a rate limit holds
//! over every one-second window; a message over a limit waits and is never dead-lettered,
//! key order kept; a slot held by a connection that dies comes back; bad limits are refused.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{Consumer, ConsumerStats, Envelope, Error, HandlerConnection, Inbox, Limit};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use support::TestDb;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "limited";

/// The slots held right now, as the server sees them (class 1885499244 = 0x7062_6f6c,
/// pgbox's "pbol").
const SLOTS_HELD: &str = "SELECT count(*) FROM pg_catalog.pg_locks \
     WHERE locktype = 'advisory' AND classid = 1885499244 AND objsubid = 2 AND granted \
       AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())";

/// What the handlers saw: per prefix, how many ran at once now and at most; at most in all;
/// and the most slots the server showed held while a handler ran.
#[derive(Default)]
struct Probe {
    now: HashMap<String, usize>,
    most: HashMap<String, usize>,
    most_in_all: usize,
    most_slots_held: i64,
}

type Shared = Arc<Mutex<Probe>>;

async fn database() -> TestDb {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute(
            "CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, \
             payload text NOT NULL UNIQUE, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        )
        .await
        .unwrap();
    db
}

/// A pool of its own, as another machine's runner would have.
async fn own_pool(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone())
        .await
        .unwrap()
}

fn payload(e: &Envelope) -> String {
    String::from_utf8(e.payload.clone()).unwrap()
}

/// Payloads `<prefix>:<n>`, interleaved by prefix; `keyed`: with `<prefix>` as their ordering
/// key (the queue then hands out one message of a prefix at a time, in order).
async fn enqueue(pool: &PgPool, prefixes: &[&str], per_prefix: usize, keyed: bool) {
    let outbox = pgbox::Outbox::new();
    let mut tx = pool.begin().await.unwrap();
    for n in 0..per_prefix {
        for p in prefixes {
            let mut message = pgbox::Message::bytes(TOPIC, format!("{p}:{n}").as_bytes());
            if keyed {
                message = message.ordering_key(*p);
            }
            outbox.enqueue(&mut tx, message).await.unwrap();
        }
    }
    tx.commit().await.unwrap();
    let relay = pgbox::Relay::builder(pool.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap();
    let total = prefixes.len() * per_prefix;
    let mut relayed = 0;
    for _ in 0..100 {
        relayed += relay.relay_once().await.unwrap().published;
        if relayed == total {
            return;
        }
    }
    panic!("relayed {relayed} of {total}");
}

fn builder(pool: &PgPool, concurrency: usize) -> pgbox::ConsumerBuilder<PgQueue> {
    Consumer::builder(
        pool.clone(),
        PgQueue::new(pool.clone()),
        TOPIC,
        Inbox::new("limited").unwrap(),
    )
    .concurrency(concurrency)
    .poll_interval(Duration::from_millis(20))
    .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
    .key(payload)
}

/// Runs `consumer` with a handler that records what runs at once, holds `hold`, and writes
/// its effect (once per payload: a second run would break the UNIQUE and fail loudly).
fn spawn(
    consumer: Consumer<PgQueue>,
    probe: Shared,
    hold: Duration,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<pgbox::Result<ConsumerStats>> {
    tokio::spawn(async move {
        consumer
            .run(
                async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                    let text = payload(e);
                    let prefix = text.split(':').next().unwrap().to_owned();
                    {
                        let mut p = probe.lock().unwrap();
                        let now = p.now.entry(prefix.clone()).or_default();
                        *now += 1;
                        let now = *now;
                        let most = p.most.entry(prefix.clone()).or_default();
                        *most = (*most).max(now);
                        let all: usize = p.now.values().sum();
                        p.most_in_all = p.most_in_all.max(all);
                    }
                    let held: i64 = sqlx::query_scalar(SLOTS_HELD).fetch_one(&mut *conn).await?;
                    tokio::time::sleep(hold).await;
                    {
                        let mut p = probe.lock().unwrap();
                        p.most_slots_held = p.most_slots_held.max(held);
                        *p.now.get_mut(&prefix).unwrap() -= 1;
                    }
                    sqlx::query("INSERT INTO effects (key, payload) VALUES ($1, $2)")
                        .bind(&prefix)
                        .bind(&text)
                        .execute(&mut *conn)
                        .await?;
                    Ok::<(), Error>(())
                },
                shutdown,
            )
            .await
    })
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs `consumers` until `n` effects committed and the queue is empty (at most 120 s), then
/// stops them; returns their stats.
async fn run_all(
    db: &TestDb,
    consumers: Vec<Consumer<PgQueue>>,
    probe: &Shared,
    hold: Duration,
    n: i64,
) -> Vec<ConsumerStats> {
    let shutdown = CancellationToken::new();
    let runs: Vec<_> = consumers
        .into_iter()
        .map(|c| spawn(c, probe.clone(), hold, shutdown.clone()))
        .collect();
    assert!(
        support::settled(&db.pool, n, Duration::from_secs(120)).await,
        "all {n} messages handled"
    );
    let mut stats = Vec::new();
    for run in runs {
        stats.push(support::stop_runner(shutdown.clone(), run, Duration::from_secs(30)).await);
    }
    stats
}

#[tokio::test]
async fn global_concurrency_holds_across_instances_and_is_reached() {
    let db = database().await;
    enqueue(&db.pool, &["a", "b", "c", "d"], 6, false).await;
    let probe = Shared::default();
    let mut consumers = Vec::new();
    for _ in 0..3 {
        let pool = own_pool(&db).await;
        consumers.push(
            builder(&pool, 4)
                .limit(Limit::concurrency("global", 3))
                .build()
                .unwrap(),
        );
    }
    run_all(&db, consumers, &probe, Duration::from_millis(150), 24).await;
    assert_eq!(count(&db.pool, SLOTS_HELD).await, 0, "no slot left held");
    let p = probe.lock().unwrap();
    assert_eq!(
        p.most_in_all, 3,
        "at most 3 at once across 3 runners of 4, and 3 reached"
    );
    assert!(
        p.most_slots_held <= 3,
        "server-side: {} slots",
        p.most_slots_held
    );
    assert!(p.most_slots_held >= 1);
}

#[tokio::test]
async fn per_prefix_concurrency_is_reached_by_each_prefix_at_once() {
    let db = database().await;
    enqueue(&db.pool, &["a", "b"], 12, false).await;
    let probe = Shared::default();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let pool = own_pool(&db).await;
        consumers.push(
            builder(&pool, 6)
                // The inbox key is the payload, `a:<n>`: its prefix is the tenant.
                .limit(Limit::concurrency("tenant", 2).per_key_prefix(':'))
                .build()
                .unwrap(),
        );
    }
    run_all(&db, consumers, &probe, Duration::from_millis(150), 24).await;
    let p = probe.lock().unwrap();
    assert_eq!(p.most.get("a"), Some(&2), "prefix a: {:?}", p.most);
    assert_eq!(p.most.get("b"), Some(&2), "prefix b: {:?}", p.most);
    assert_eq!(p.most_in_all, 4, "both prefixes at their limit at once");
    assert!(
        p.most_slots_held <= 4,
        "server-side: {} slots",
        p.most_slots_held
    );
}

#[tokio::test]
async fn per_prefix_by_a_function_of_the_envelope() {
    let db = database().await;
    enqueue(&db.pool, &["x", "y"], 8, false).await;
    let probe = Shared::default();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let pool = own_pool(&db).await;
        consumers.push(
            builder(&pool, 4)
                .limit(
                    Limit::concurrency("by-payload", 1)
                        .per(|e: &Envelope| payload(e).split(':').next().unwrap().to_owned()),
                )
                .batch_size(3)
                .build()
                .unwrap(),
        );
    }
    run_all(&db, consumers, &probe, Duration::from_millis(50), 16).await;
    let p = probe.lock().unwrap();
    assert_eq!(p.most.get("x"), Some(&1), "{:?}", p.most);
    assert_eq!(p.most.get("y"), Some(&1), "{:?}", p.most);
}

#[tokio::test]
async fn rate_holds_over_every_second_across_instances() {
    const RATE: f64 = 10.0;
    const BURST: u32 = 2;
    const N: usize = 40;
    let db = database().await;
    enqueue(&db.pool, &["a", "b", "c", "d"], N / 4, false).await;
    let probe = Shared::default();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let pool = own_pool(&db).await;
        consumers.push(
            builder(&pool, 4)
                .limit(Limit::rate("rate", RATE).burst(BURST))
                .build()
                .unwrap(),
        );
    }
    run_all(&db, consumers, &probe, Duration::ZERO, N as i64).await;
    let at: Vec<f64> =
        sqlx::query_scalar("SELECT EXTRACT(EPOCH FROM at)::float8 FROM effects ORDER BY at")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(at.len(), N);
    // Every window [t, t + 1 s) starting at a handled message: at most BURST + RATE − 1
    // tokens can be taken in it, so one message of slack covers the gap between taking a
    // token and the handler's clock reading.
    let most = most_in_a_second(&at);
    assert!(
        most as f64 <= RATE + f64::from(BURST),
        "{most} messages within one second, over {RATE}/s with a burst of {BURST}"
    );
    // The limit is a rate, not a cap on the total: all went, at the rate's pace.
    let span = at[N - 1] - at[0];
    let least = (N as f64 - f64::from(BURST) - 1.0) / RATE - 0.2;
    assert!(
        span >= least,
        "{N} messages in {span:.2} s, under {least:.2} s"
    );
    // Buckets are rows of the pgbox schema, one for the global limit.
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.rate_limits").await,
        1
    );
}

/// The most of `at` (sorted seconds) within any window [t, t + 1 s) starting at one of them.
fn most_in_a_second(at: &[f64]) -> usize {
    (0..at.len())
        .map(|i| at[i..].iter().take_while(|t| **t < at[i] + 1.0).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn per_prefix_rate_holds_for_each_prefix() {
    const RATE: f64 = 8.0;
    let db = database().await;
    enqueue(&db.pool, &["p", "q"], 16, false).await;
    let probe = Shared::default();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let pool = own_pool(&db).await;
        consumers.push(
            builder(&pool, 4)
                .limit(Limit::rate("tenant-rate", RATE).per_key_prefix(':'))
                .build()
                .unwrap(),
        );
    }
    run_all(&db, consumers, &probe, Duration::ZERO, 32).await;
    for prefix in ["p", "q"] {
        let at: Vec<f64> = sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM at)::float8 FROM effects WHERE key = $1 ORDER BY at",
        )
        .bind(prefix)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(at.len(), 16);
        let most = most_in_a_second(&at);
        assert!(
            most as f64 <= RATE + 1.0,
            "prefix {prefix}: {most} in one second"
        );
        let span = at[15] - at[0];
        assert!(
            span >= 14.0 / RATE - 0.2,
            "prefix {prefix}: 16 in {span:.2} s"
        );
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.rate_limits").await,
        2,
        "one bucket per prefix"
    );
}

/// Records every take of a rate limit in table `takes`: when, and how many tokens it got
/// (how far it moved the bucket's arrival time, in intervals of `interval_micros`).
async fn record_takes(db: &TestDb, interval_micros: i64) {
    let sql = format!(
        "CREATE TABLE takes (at timestamptz NOT NULL DEFAULT clock_timestamp(), got int8 NOT NULL);
         CREATE FUNCTION record_take() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           INSERT INTO takes (got) VALUES (
             (EXTRACT(EPOCH FROM NEW.tat - GREATEST(
                 CASE WHEN TG_OP = 'UPDATE' THEN OLD.tat END, statement_timestamp()))
              * 1e6 / {interval_micros})::int8);
           RETURN NULL;
         END $$;
         CREATE TRIGGER record_take AFTER INSERT OR UPDATE ON pgbox.rate_limits
           FOR EACH ROW EXECUTE FUNCTION record_take();"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&db.pool)
        .await
        .unwrap();
}

/// Runs two instances of `limit` (a rate of `rate` with `burst`, taking up to `k` ahead) on
/// `n` messages, handlers holding `hold`; checks the bound on every window and returns the
/// takes (tokens each got).
async fn two_instances_within_the_bound(
    (rate, burst, k): (f64, u32, usize),
    n: usize,
    concurrency: usize,
    hold: Duration,
) -> Vec<i64> {
    let db = database().await;
    let interval = (1e6 / rate).ceil() as i64;
    record_takes(&db, interval).await;
    enqueue(&db.pool, &["a", "b", "c", "d"], n / 4, false).await;
    let probe = Shared::default();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let pool = own_pool(&db).await;
        consumers.push(
            builder(&pool, concurrency)
                .limit(Limit::rate("ahead", rate).burst(burst))
                .build()
                .unwrap(),
        );
    }
    run_all(&db, consumers, &probe, hold, n as i64).await;
    let at: Vec<f64> =
        sqlx::query_scalar("SELECT EXTRACT(EPOCH FROM at)::float8 FROM effects ORDER BY at")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(at.len(), n);
    // Effects are written at the end of each handler: one message of slack for the gap
    // between a token and the effect's clock reading (as above). Over shorter windows that
    // gap (a busy machine) would be more than a message.
    let most = most_in_a_second(&at);
    let bound = f64::from(burst) + rate + k as f64;
    assert!(
        most as f64 <= bound + 1.0,
        "{most} messages within 1 s, over {burst} + {rate} × 1 + {k}"
    );
    let spread = at[n - 1] - at[0];
    let least = (n as f64 - f64::from(burst) - k as f64 - 1.0) / rate - 0.2;
    assert!(
        spread >= least,
        "{n} messages in {spread:.2} s, under {least:.2} s"
    );
    sqlx::query_scalar("SELECT got FROM takes ORDER BY at")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_rate_with_a_burst_takes_ahead_and_holds_across_instances() {
    // 200/s: one token per 5 ms; up to 10 (50 ms) taken at once, burst 20.
    const N: usize = 240;
    let takes = two_instances_within_the_bound((200.0, 20, 10), N, 8, Duration::ZERO).await;
    let tokens: i64 = takes.iter().sum();
    assert!(
        tokens >= N as i64,
        "{tokens} tokens counted for {N} messages"
    );
    assert!(
        takes.iter().all(|got| (1..=10).contains(got)),
        "a take over k: {takes:?}"
    );
    // How many a take gets follows the runners' demand (a busy machine asks for fewer),
    // but some take got more than one.
    assert!(
        takes.len() < N && takes.iter().any(|got| *got > 1),
        "{} takes for {N} messages: tokens were not taken ahead",
        takes.len()
    );
}

#[tokio::test]
async fn tokens_dropped_after_their_window_are_not_spent() {
    // Handlers hold 70 ms, longer than the 50 ms a token taken ahead lasts: tokens left
    // when the handlers are busy lapse, stay counted, and let nothing more through.
    const N: usize = 120;
    let takes =
        two_instances_within_the_bound((200.0, 20, 10), N, 4, Duration::from_millis(70)).await;
    let tokens: i64 = takes.iter().sum();
    assert!(
        tokens > N as i64,
        "{tokens} tokens counted for {N} messages: none dropped, the test proves nothing"
    );
}

/// With the default burst of 1 (and a low rate), every message takes one token of its own.
#[tokio::test]
async fn burst_one_takes_one_token_per_message() {
    const N: usize = 12;
    let takes = two_instances_within_the_bound((40.0, 1, 1), N, 4, Duration::ZERO).await;
    assert_eq!(takes, vec![1; N], "one token per take");
}

#[tokio::test]
async fn over_the_limit_waits_is_never_dead_lettered_and_keeps_key_order() {
    let db = database().await;
    enqueue(&db.pool, &["k1", "k2", "k3"], 5, true).await;
    // The runners' metrics, on this test's thread (its runtime's only one): the runners
    // register them when they start, on their tasks here.
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let probe = Shared::default();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let pool = own_pool(&db).await;
        consumers.push(
            builder(&pool, 4)
                .max_deliveries(1)
                // A short visibility timeout: many waits run out (a third of it) and the
                // delivery is handed back, uncounted, again and again.
                .visibility_timeout(Duration::from_millis(600))
                .limit(Limit::concurrency("one", 1))
                .limit(Limit::rate("rate", 20.0))
                .build()
                .unwrap(),
        );
    }
    let stats = run_all(&db, consumers, &probe, Duration::from_millis(60), 15).await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.queue_dead_letters").await,
        0
    );
    assert_eq!(stats.iter().map(|s| s.dead_lettered).sum::<u64>(), 0);
    assert_eq!(
        stats.iter().map(|s| s.processed).sum::<u64>(),
        15,
        "{stats:?}"
    );
    assert!(
        stats.iter().map(|s| s.retried).sum::<u64>() > 0,
        "the limit did bind and hand deliveries back: {stats:?}"
    );
    assert_eq!(probe.lock().unwrap().most_in_all, 1);
    // Each wait is counted, per limit, once per delivery that waited.
    let waits: HashMap<String, u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key();
            let limit = key
                .labels()
                .find(|l| l.key() == "limit")?
                .value()
                .to_owned();
            match value {
                metrics_util::debugging::DebugValue::Counter(n)
                    if key.name() == pgbox::telemetry::CONSUMER_LIMIT_WAITS =>
                {
                    Some((limit, n))
                }
                _ => None,
            }
        })
        .collect();
    let retried: u64 = stats.iter().map(|s| s.retried).sum();
    assert!(
        waits.get("one").is_some_and(|n| *n > 0),
        "the slot limit bound: {waits:?}"
    );
    assert!(
        waits.values().sum::<u64>() >= retried,
        "every delivery handed back for a limit waited first: {waits:?}, {stats:?}"
    );
    // Per key, committed in enqueue order.
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT key, payload FROM effects ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut next: HashMap<String, usize> = HashMap::new();
    for (key, text) in rows {
        let n: usize = text.split(':').nth(1).unwrap().parse().unwrap();
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(n, *expected, "key {key} out of order");
        *expected += 1;
    }
}

#[tokio::test]
async fn a_slot_comes_back_when_its_holder_connection_is_terminated() {
    let db = database().await;
    enqueue(&db.pool, &["hold"], 1, false).await;
    let release = Arc::new(tokio::sync::Notify::new());
    let shutdown = CancellationToken::new();
    let holder_pool = own_pool(&db).await;
    let holder = builder(&holder_pool, 1)
        .limit(Limit::concurrency("only", 1))
        .build()
        .unwrap();
    let holding = {
        let release = release.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            holder
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        // Waits (bounded) until the test releases it: its slot is held.
                        let _ =
                            tokio::time::timeout(Duration::from_secs(60), release.notified()).await;
                        sqlx::query("INSERT INTO effects (key, payload) VALUES ('hold', $1)")
                            .bind(payload(e))
                            .execute(&mut *conn)
                            .await?;
                        Ok::<(), Error>(())
                    },
                    shutdown,
                )
                .await
        })
    };
    let mut holder_pid = None;
    for _ in 0..500 {
        holder_pid = sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_catalog.pg_locks \
             WHERE locktype = 'advisory' AND classid = 1885499244 AND granted \
               AND database = (SELECT oid FROM pg_catalog.pg_database \
                                WHERE datname = current_database())",
        )
        .fetch_optional(&db.pool)
        .await
        .unwrap();
        if holder_pid.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let holder_pid = holder_pid.expect("the holder took the slot");

    // Another instance, with a message of its own: it waits for the slot.
    enqueue(&db.pool, &["after"], 1, false).await;
    let other_pool = own_pool(&db).await;
    let other = builder(&other_pool, 1)
        .limit(Limit::concurrency("only", 1))
        .build()
        .unwrap();
    let probe = Shared::default();
    let other_run = spawn(other, probe.clone(), Duration::ZERO, shutdown.clone());
    // It cannot run while the slot is held (a generous look, not a timing claim: it fails
    // only if the limit let it through).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM effects WHERE key = 'after'").await,
        0,
        "ran while the only slot was held"
    );
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(holder_pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(terminated);
    let started = Instant::now();
    while count(&db.pool, "SELECT count(*) FROM effects WHERE key = 'after'").await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The holder's handler finds its connection gone; its message comes back and is handled.
    release.notify_waiters();
    assert!(support::settled(&db.pool, 2, Duration::from_secs(90)).await);
    support::stop_runner(shutdown.clone(), other_run, Duration::from_secs(30)).await;
    support::stop_runner(shutdown, holding, Duration::from_secs(30)).await;
    assert_eq!(count(&db.pool, SLOTS_HELD).await, 0);
}

#[tokio::test]
async fn bad_limits_are_typed_errors() {
    let db = TestDb::migrated().await;
    let bad = [
        Limit::concurrency("x", 0),
        Limit::concurrency("", 1),
        Limit::concurrency("a\0b", 1),
        Limit::concurrency("n".repeat(pgbox::MAX_LIMIT_NAME_BYTES + 1), 1),
        Limit::concurrency("x", pgbox::MAX_CONCURRENCY_SLOTS + 1),
        Limit::rate("x", 0.0),
        Limit::rate("x", f64::INFINITY),
        Limit::rate("x", 1.0).burst(0),
    ];
    for limit in bad {
        let built = builder(&db.pool, 1).limit(limit.clone()).build();
        assert!(
            matches!(built, Err(Error::InvalidConfig(_))),
            "{limit:?} accepted"
        );
    }
    let twice = builder(&db.pool, 1)
        .limit(Limit::concurrency("x", 1))
        .limit(Limit::concurrency("x", 2))
        .build();
    assert!(matches!(twice, Err(Error::InvalidConfig(_))));
    // Lease mode refuses limits rather than ignoring them.
    let consumer = builder(&db.pool, 1)
        .limit(Limit::rate("x", 1.0))
        .build()
        .unwrap();
    let leased = consumer
        .run_leased(
            async |_: &Envelope, _: &mut pgbox::Lease| Ok::<(), Error>(()),
            Duration::from_secs(10),
            CancellationToken::new(),
        )
        .await;
    assert!(matches!(leased, Err(Error::InvalidConfig(_))));
}
