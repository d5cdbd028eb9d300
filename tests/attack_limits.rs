//! Attacks on the consumer runner's limits (`Limit`, `ConsumerBuilder::limit`).
//!
//! The promise, from `Limit`'s rustdoc: concurrency slots are transaction advisory locks,
//! exact across instances, released by commit, rollback or a dead connection; rate buckets
//! are one row per limit and prefix, exact across instances; `per` / `per_key_prefix` make a
//! limit hold per prefix. A message over a limit **waits**: it is never failed, never counted
//! as a delivery toward `max_deliveries`, never dead-lettered, and its key's order is kept;
//! after a third of the visibility timeout it is handed back uncounted. In a batch every
//! message takes a token and the batch one slot per prefix. Lease mode refuses limits. Bad
//! input is a typed error at build (the crate's rule), and a hostile `search_path` or a
//! transaction-mode pooler changes nothing (the crate's promise for every component).
//!
//! `finding_*` tests showed a defect, fixed since: they stay as its regression test;
//! `holds_*` tests are attacks that held.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{Consumer, ConsumerStats, Envelope, Error, HandlerConnection, Inbox, Limit};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use support::TestDb;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "limited";

async fn database() -> TestDb {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();
    db
}

/// A pool of its own, as another machine's runner would have.
async fn own_pool(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone())
        .await
        .unwrap()
}

fn payload(e: &Envelope) -> String {
    String::from_utf8(e.payload.clone()).unwrap()
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

/// Runs `consumer`, writing one effect row per payload.
fn spawn(
    consumer: Consumer<PgQueue>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<pgbox::Result<ConsumerStats>> {
    tokio::spawn(async move {
        consumer
            .run(
                async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                    record(conn, &payload(e)).await
                },
                shutdown,
            )
            .await
    })
}

async fn record(conn: &mut HandlerConnection<'_>, text: &str) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (payload) VALUES ($1)")
        .bind(text)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits (at most `limit`) until `payload` took effect or was dead-lettered; returns
/// (effects of it, dead letters of it).
async fn outcome_of(pool: &PgPool, payload: &str, limit: Duration) -> (i64, i64) {
    let started = Instant::now();
    loop {
        let (done, dead): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM effects WHERE payload = $1), \
                    (SELECT count(*) FROM pgbox.queue_dead_letters WHERE payload = $2)",
        )
        .bind(payload)
        .bind(payload.as_bytes())
        .fetch_one(pool)
        .await
        .unwrap();
        if done + dead > 0 || started.elapsed() > limit {
            return (done, dead);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Advisory locks of pgbox's slot class ("pbol") held in this database.
const SLOTS_HELD: &str = "SELECT count(*) FROM pg_catalog.pg_locks \
     WHERE locktype = 'advisory' AND classid = 1885499244 AND objsubid = 2 AND granted \
       AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())";

/// Finding 1. A message handed back for a limit is "never counted as a delivery toward
/// `max_deliveries`" — but the transport counts every hand-back, and only the runner that
/// handed it back knows (its tally is in memory). The message then reaches another instance
/// (or the same process after a restart, a deploy, a scale-down) with a delivery number far
/// above `max_deliveries`, and its first real failure (one transient error) dead-letters it.
#[tokio::test]
async fn finding_limit_handbacks_count_toward_max_deliveries_on_another_instance() {
    let db = database().await;
    // Instance H takes the only slot and holds it until released.
    support::enqueue_and_relay(&db.pool, TOPIC, &["hold".to_owned()]).await;
    let release = Arc::new(tokio::sync::Notify::new());
    let stop_h = CancellationToken::new();
    let h_pool = own_pool(&db).await;
    let h = builder(&h_pool, 1)
        .limit(Limit::concurrency("one", 1))
        .build()
        .unwrap();
    let h_run = {
        let (release, stop) = (release.clone(), stop_h.clone());
        tokio::spawn(async move {
            h.run(
                async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                    let _ = tokio::time::timeout(Duration::from_secs(60), release.notified()).await;
                    record(conn, &payload(e)).await
                },
                stop,
            )
            .await
        })
    };
    let started = Instant::now();
    while count(&db.pool, SLOTS_HELD).await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "H took no slot"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // H stops receiving; its handler still holds the slot.
    stop_h.cancel();

    // Instance A: its message waits for the slot and is handed back, uncounted, again and
    // again (a visibility timeout of 300 ms: a hand-back every 100 ms or so).
    support::enqueue_and_relay(&db.pool, TOPIC, &["m".to_owned()]).await;
    let stop_a = CancellationToken::new();
    let a_pool = own_pool(&db).await;
    let a = builder(&a_pool, 1)
        .max_deliveries(3)
        .visibility_timeout(Duration::from_millis(300))
        .limit(Limit::concurrency("one", 1))
        .build()
        .unwrap();
    let a_run = spawn(a, stop_a.clone());
    let started = Instant::now();
    loop {
        let deliveries: i64 = count(
            &db.pool,
            "SELECT coalesce(max(deliveries), 0)::int8 FROM pgbox.queue WHERE payload = 'm'",
        )
        .await;
        if deliveries >= 6 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "m was handed back only {deliveries} times"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a_stats = support::stop_runner(stop_a, a_run, Duration::from_secs(30)).await;
    assert_eq!(a_stats.dead_lettered, 0);
    assert_eq!(a_stats.processed, 0, "the slot was held: {a_stats:?}");
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;

    // Instance B (the same settings): the handler fails once (a transient error), then works.
    // Of m's deliveries only that one is its own: 1 of 3.
    let failed_once = Arc::new(AtomicBool::new(false));
    let stop_b = CancellationToken::new();
    let b_pool = own_pool(&db).await;
    let b = builder(&b_pool, 1)
        .max_deliveries(3)
        .visibility_timeout(Duration::from_millis(300))
        .limit(Limit::concurrency("one", 1))
        .build()
        .unwrap();
    let b_run = {
        let (failed_once, stop) = (failed_once.clone(), stop_b.clone());
        tokio::spawn(async move {
            b.run(
                async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                    if !failed_once.swap(true, Ordering::SeqCst) {
                        return Err(Error::InvalidConfig("a transient failure".into()));
                    }
                    record(conn, &payload(e)).await
                },
                stop,
            )
            .await
        })
    };
    let (done, dead) = outcome_of(&db.pool, "m", Duration::from_secs(60)).await;
    let b_stats = support::stop_runner(stop_b, b_run, Duration::from_secs(30)).await;
    let deliveries: Vec<i32> =
        sqlx::query_scalar("SELECT deliveries FROM pgbox.queue_dead_letters WHERE payload = 'm'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (done, dead),
        (1, 0),
        "m failed once of max_deliveries 3 and was dead-lettered at delivery {deliveries:?}: \
         its hand-backs for the limit were counted ({b_stats:?})"
    );
}

/// A schema ahead of pg_catalog on the path, shadowing the catalog functions the limits'
/// statements call unqualified: `unnest` (the slot try-lock) and `statement_timestamp` (the
/// rate bucket). Each shadow raises.
const EVIL: &str = r#"
CREATE SCHEMA evil;
GRANT USAGE ON SCHEMA evil TO PUBLIC;
CREATE FUNCTION evil.unnest(anyarray) RETURNS SETOF anyelement LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil unnest()'; END $$;
CREATE FUNCTION evil.statement_timestamp() RETURNS timestamptz LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil statement_timestamp()'; END $$;
"#;

/// Runs one message through a consumer with `limit` on a pool whose `search_path` puts
/// `evil` ahead of pg_catalog; returns (effects, dead letters, the dead letter's error).
async fn through_a_hostile_search_path(limit: Limit) -> (i64, i64, Option<String>) {
    let db = database().await;
    sqlx::raw_sql(EVIL).execute(&db.pool).await.unwrap();
    support::enqueue_and_relay(&db.pool, TOPIC, &["h".to_owned()]).await;
    let hostile = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(
            db.options
                .clone()
                .options([("search_path", "evil, pg_catalog, public")]),
        )
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let consumer = builder(&hostile, 1)
        .max_deliveries(2)
        .limit(limit)
        .build()
        .unwrap();
    let run = spawn(consumer, stop.clone());
    let outcome = outcome_of(&db.pool, "h", Duration::from_secs(30)).await;
    support::stop_runner(stop, run, Duration::from_secs(30)).await;
    let error: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM pgbox.queue_dead_letters")
            .fetch_optional(&db.pool)
            .await
            .unwrap()
            .flatten();
    (outcome.0, outcome.1, error)
}

/// Finding 2a. The crate promises that a hostile `search_path` changes nothing (see
/// tests/least_privilege.rs, which shadows `unnest` too); the slot statement calls `unnest`
/// unqualified, so every delivery fails with "evil unnest()" and is dead-lettered.
#[tokio::test]
async fn finding_a_hostile_search_path_breaks_concurrency_limits() {
    let outcome = through_a_hostile_search_path(Limit::concurrency("slots", 2)).await;
    assert_eq!(
        (outcome.0, outcome.1),
        (1, 0),
        "(effects, dead letters) under a hostile search_path: {:?}",
        outcome.2
    );
}

/// Finding 2b. The same for rate limits: the bucket statement and the sweep call
/// `statement_timestamp()` unqualified.
#[tokio::test]
async fn finding_a_hostile_search_path_breaks_rate_limits() {
    let outcome = through_a_hostile_search_path(Limit::rate("tokens", 100.0)).await;
    assert_eq!(
        (outcome.0, outcome.1),
        (1, 0),
        "(effects, dead letters) under a hostile search_path: {:?}",
        outcome.2
    );
}

/// Finding 3. A rate limit `validate` accepts (positive, finite, at most the maximum) whose
/// interval or burst span overflows PostgreSQL's interval or timestamp range: every take
/// fails with a database error, counted as the message's failure and dead-lettered — a
/// message over a limit is "never failed, never dead-lettered", and bad input is a typed
/// error at build.
#[tokio::test]
async fn finding_an_extreme_rate_is_accepted_then_dead_letters() {
    let mut broken = Vec::new();
    for (n, limit) in [
        // One message per 300 000 years: the interval alone overflows.
        Limit::rate("glacial", 1e-13),
        // One message per 115 days with a burst of a million: the span overflows.
        Limit::rate("seasonal", 1e-7).burst(1_000_000),
    ]
    .into_iter()
    .enumerate()
    {
        let db = database().await;
        let built = builder(&db.pool, 1)
            .max_deliveries(2)
            .limit(limit.clone())
            .build();
        let consumer = match built {
            Err(Error::InvalidConfig(_)) => continue,
            Err(e) => panic!("{limit:?}: not a typed config error: {e}"),
            Ok(consumer) => consumer,
        };
        let text = format!("x{n}");
        support::enqueue_and_relay(&db.pool, TOPIC, std::slice::from_ref(&text)).await;
        let stop = CancellationToken::new();
        let run = spawn(consumer, stop.clone());
        // The message waits (the bucket is full for the first one, so it should go), or is
        // handed back; it must not be dead-lettered.
        let (_, dead) = outcome_of(&db.pool, &text, Duration::from_secs(20)).await;
        support::stop_runner(stop, run, Duration::from_secs(30)).await;
        let error: Option<String> =
            sqlx::query_scalar("SELECT last_error FROM pgbox.queue_dead_letters")
                .fetch_optional(&db.pool)
                .await
                .unwrap()
                .flatten();
        if dead != 0 {
            broken.push(format!("{limit:?}: {error:?}"));
        }
    }
    assert!(
        broken.is_empty(),
        "accepted at build, and their messages were dead-lettered: {broken:#?}"
    );
}

/// Prefix functions that return odd strings (empty, NUL-bearing, 1 MiB, different ones for
/// one key on each call): every message is handled once, none failed, no slot left held.
#[tokio::test]
async fn holds_odd_prefixes() {
    let db = database().await;
    let payloads: Vec<String> = (0..12).map(|i| format!("odd{i}")).collect();
    support::enqueue_and_relay(&db.pool, TOPIC, &payloads).await;
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let pool = own_pool(&db).await;
    let consumer = builder(&pool, 4)
        .batch_size(3)
        .max_deliveries(1)
        .limit(Limit::concurrency("odd-slots", 1).per({
            let calls = calls.clone();
            move |e: &Envelope| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                match (payload(e).len() + n) % 4 {
                    0 => String::new(),
                    1 => "a\0b".to_owned(),
                    2 => "x".repeat(1 << 20),
                    _ => format!("{n}"),
                }
            }
        }))
        .limit(
            Limit::rate("odd-rate", 1000.0)
                .burst(5)
                .per(|e: &Envelope| {
                    let mut s = payload(e);
                    s.push('\0');
                    s.repeat(1000)
                }),
        )
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let run = spawn(consumer, stop.clone());
    assert!(support::settled(&db.pool, 12, Duration::from_secs(60)).await);
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    assert_eq!(stats.processed, 12, "{stats:?}");
    assert_eq!(stats.dead_lettered + stats.panicked, 0, "{stats:?}");
    assert_eq!(count(&db.pool, SLOTS_HELD).await, 0);
    // Long prefixes are stored cut, with a hash: the rows stay small.
    let longest = count(
        &db.pool,
        "SELECT coalesce(max(octet_length(prefix)), 0)::int8 FROM pgbox.rate_limits",
    )
    .await;
    assert!(longest <= 264, "a stored prefix of {longest} bytes");
}

/// The application's own transaction advisory locks, in both key forms, on the same numbers
/// as pgbox's slot class: `pg_advisory_xact_lock(bigint)` of the class shifted, and
/// `(int, int)` of a neighbouring class, held the whole time, do not block the limit.
#[tokio::test]
async fn holds_application_advisory_locks_beside_slots() {
    let db = database().await;
    let payloads: Vec<String> = (0..6).map(|i| format!("app{i}")).collect();
    support::enqueue_and_relay(&db.pool, TOPIC, &payloads).await;
    let mut app = db.connect().await;
    app.execute("BEGIN").await.unwrap();
    // Every key of the (class, key) pairs pgbox could use, in the bigint space; and the
    // neighbouring int classes over a range of keys.
    app.execute(
        "SELECT pg_advisory_xact_lock((1885499244::int8 << 32) | k) FROM generate_series(0, 2000) k; \
         SELECT pg_advisory_xact_lock(1885499243, k), pg_advisory_xact_lock(1885499245, k) \
           FROM generate_series(-1000, 1000) k",
    )
    .await
    .unwrap();
    let pool = own_pool(&db).await;
    let consumer = builder(&pool, 2)
        .limit(Limit::concurrency("app", 2))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let run = spawn(consumer, stop.clone());
    assert!(support::settled(&db.pool, 6, Duration::from_secs(60)).await);
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    assert_eq!(stats.processed, 6);
    app.execute("ROLLBACK").await.unwrap();
}

/// Finding 4. Behind PgBouncer in transaction mode, with every component told so
/// (`Pooler::Transaction` on the queue and the inbox), a consumer with limits: the crate
/// sends only unnamed statements there, each inside a transaction — but the limits' take
/// statements are named prepared statements (sqlx's cache), and the rate take runs as an
/// autocommit statement on the pool. Every message must still take effect once, with no
/// delivery failed for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn finding_limits_behind_a_transaction_pooler() {
    behind_a_transaction_pooler(true).await;
}

/// The control for finding 4: the same consumer without limits, through the same pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holds_the_same_consumer_without_limits_behind_a_transaction_pooler() {
    behind_a_transaction_pooler(false).await;
}

async fn behind_a_transaction_pooler(limited: bool) {
    use pgbox::Pooler;
    use support::cluster::Cluster;
    use support::pooler::PgBouncer;

    const N: i64 = 60;
    support::init_tracing();
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let bouncer = PgBouncer::start(&cluster, 3);
    let direct = PgPoolOptions::new()
        .max_connections(3)
        .connect(&cluster.url("postgres"))
        .await
        .unwrap();
    pgbox::migrate(&direct).await.unwrap();
    direct
        .execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();
    let payloads: Vec<String> = (0..N).map(|i| format!("pooled{i}")).collect();
    support::enqueue_and_relay(&direct, TOPIC, &payloads).await;
    let log_before = cluster.log().len();

    let pooled = PgPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&bouncer.url("postgres"))
        .await
        .unwrap();
    let consumer = Consumer::builder(
        pooled.clone(),
        PgQueue::new(pooled.clone()).pooler(Pooler::Transaction),
        TOPIC,
        Inbox::builder("limited")
            .pooler(Pooler::Transaction)
            .build()
            .unwrap(),
    )
    .concurrency(6)
    .max_deliveries(3)
    .poll_interval(Duration::from_millis(20))
    .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
    .key(payload);
    let consumer = if limited {
        consumer
            .limit(Limit::concurrency("pooled-slots", 3))
            .limit(Limit::rate("pooled-rate", 1000.0).burst(20))
    } else {
        consumer
    }
    .build()
    .unwrap();
    let stop = CancellationToken::new();
    let run = spawn(consumer, stop.clone());
    let started = Instant::now();
    while count(&direct, "SELECT count(*) FROM effects").await
        + count(&direct, "SELECT count(*) FROM pgbox.queue_dead_letters").await
        < N
        && started.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    let effects = count(&direct, "SELECT count(*) FROM effects").await;
    let dead = count(&direct, "SELECT count(*) FROM pgbox.queue_dead_letters").await;
    let why: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT last_error FROM pgbox.queue_dead_letters WHERE last_error IS NOT NULL",
    )
    .fetch_all(&direct)
    .await
    .unwrap();
    let log = cluster.log();
    let errors: Vec<&str> = log[log_before..]
        .lines()
        .filter(|l| l.contains("ERROR:"))
        .take(5)
        .collect();
    assert!(
        effects == N && dead == 0 && stats.retried == 0 && errors.is_empty(),
        "{effects} of {N} took effect, {dead} dead letters ({why:?}), {stats:?}; server errors: {errors:#?}"
    );
}

/// What 30 s of a consumer with two rate limits came to: a global 20 a second, and per
/// tenant one every 100 s. Tenant `slow` has a backlog of 10 at the head of the queue; ten
/// other tenants have one message each, within every limit (at 20 a second they need half a
/// second). Each token taken is counted by a trigger (a row of `rate_limits` inserted or
/// moved on). Returns (other tenants' messages that went, all that went, global tokens
/// taken, stats).
async fn a_throttled_backlog_at_the_head() -> (i64, i64, i64, ConsumerStats) {
    let db = database().await;
    db.pool
        .execute(
            "CREATE TABLE taken (name text PRIMARY KEY, n int8 NOT NULL); \
             CREATE FUNCTION count_taken() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               INSERT INTO public.taken VALUES (NEW.name, 1) \
               ON CONFLICT (name) DO UPDATE SET n = taken.n + 1; RETURN NULL; END $$; \
             CREATE TRIGGER count_taken AFTER INSERT OR UPDATE ON pgbox.rate_limits \
               FOR EACH ROW EXECUTE FUNCTION count_taken()",
        )
        .await
        .unwrap();
    let mut payloads: Vec<String> = (0..10).map(|i| format!("slow:{i}")).collect();
    payloads.extend((0..10).map(|i| format!("t{i}:0")));
    support::enqueue_and_relay(&db.pool, TOPIC, &payloads).await;
    let pool = own_pool(&db).await;
    let consumer = builder(&pool, 4)
        .visibility_timeout(Duration::from_millis(600))
        .limit(Limit::rate("global", 20.0))
        .limit(Limit::rate("tenant", 0.01).per_key_prefix(':'))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let run = spawn(consumer, stop.clone());
    let others = "SELECT count(*) FROM effects WHERE payload NOT LIKE 'slow:%'";
    let started = Instant::now();
    while count(&db.pool, others).await < 10 && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    let went = count(&db.pool, others).await;
    let processed = count(&db.pool, "SELECT count(*) FROM effects").await;
    let global = count(
        &db.pool,
        "SELECT coalesce(sum(n), 0)::int8 FROM taken WHERE name = 'global'",
    )
    .await;
    (went, processed, global, stats)
}

/// Finding 5. A message that got the global token and then finds its tenant's bucket empty
/// for longer than its deadline is handed back with the global token spent, and is
/// redelivered after the plain backoff (the bucket's answer, "100 s", is dropped), to take
/// another. Its tenant's backlog spends the global rate.
#[tokio::test]
async fn finding_a_throttled_prefix_spends_the_global_rate() {
    let (_, processed, global, stats) = a_throttled_backlog_at_the_head().await;
    assert!(
        global <= processed,
        "{processed} messages went and {global} global tokens were taken: the rest went to \
         messages of `slow` that were handed back ({stats:?})"
    );
}

/// Finding 6. The same run: the other tenants' messages, within every limit, wait behind the
/// throttled backlog: it is handed back after a few milliseconds of backoff, visible again at
/// the head of the queue, and received before them, over and over. (30 s is sixty times what
/// they need at the global rate: a liveness bound, not a timing claim.)
#[tokio::test]
async fn finding_a_throttled_backlog_starves_other_prefixes() {
    let (went, _, global, stats) = a_throttled_backlog_at_the_head().await;
    assert_eq!(
        went, 10,
        "of 10 messages within every limit, {went} went in 30 s; {global} global tokens \
         were taken ({stats:?})"
    );
}

/// A server crash (every backend killed, WAL replayed) in the middle of a run with a
/// concurrency and a rate limit: the slots come back (advisory locks die with the server),
/// the buckets are not stuck, every message takes effect once, none is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holds_a_server_crash_mid_run() {
    use support::cluster::Cluster;

    const N: i64 = 30;
    support::init_tracing();
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&cluster.url("postgres"))
        .await
        .unwrap();
    pgbox::migrate(&pool).await.unwrap();
    pool.execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();
    let payloads: Vec<String> = (0..N).map(|i| format!("c{}:{i}", i % 3)).collect();
    support::enqueue_and_relay(&pool, TOPIC, &payloads).await;
    let consumer = builder(&pool, 4)
        .max_deliveries(2)
        .limit(Limit::concurrency("crash-slots", 2))
        .limit(Limit::rate("crash-rate", 50.0).burst(2).per_key_prefix(':'))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        record(conn, &payload(e)).await
                    },
                    stop,
                )
                .await
        }
    });
    let effects = async |pool: &PgPool| {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects")
            .fetch_one(pool)
            .await
            .unwrap_or(-1)
    };
    let started = Instant::now();
    while effects(&pool).await < N / 3 {
        assert!(started.elapsed() < Duration::from_secs(60), "no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.crash_restart())
        .await
        .unwrap();
    // The pool's connections died with the server: wait until a statement gets through
    // (`settled` below panics on an error).
    let started = Instant::now();
    while effects(&pool).await < 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "no server");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    while !support::settled(&pool, N, Duration::from_millis(200)).await {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{} of {N} took effect after the crash",
            effects(&pool).await
        );
    }
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(count(&pool, SLOTS_HELD).await, 0);
}
