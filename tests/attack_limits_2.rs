//! Attacks on the consumer limits' hand-backs and rate takes (branch limits-fix): `Limit`,
//! `ConsumerBuilder::max_deliveries`, the `hand_backs` table (V20).
//!
//! The promise, written before reading the code (rustdoc of `Limit` and `max_deliveries`,
//! guide "Many tenants"):
//! 1. A message over a limit waits; it is never failed, never counted as a delivery toward
//!    `max_deliveries`, never dead-lettered, and its key's order is kept.
//! 2. Hand-backs (a limit, "in progress elsewhere", "leased elsewhere") are recorded in the
//!    database, so that no instance counts them, before or after a restart; a message whose
//!    handler really fails is dead-lettered at exactly `max_deliveries` real attempts.
//! 3. A wait never overruns the visibility timeout: at a third of it the message is handed
//!    back; a per-prefix rate wait over 1 s is handed back at once with the bucket's wait.
//! 4. Concurrency is exact across instances; rate is at most burst + rate × t + k in any
//!    window t over every instance; a message takes the tokens of all its rate limits
//!    together, all or none.
//!
//! `finding_*` tests fail on today's code (ignored so that the branch stays green);
//! `holds_*` tests are attacks that held.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// Advisory locks of pgbox's slot class ("pbol") held in this database.
const SLOTS_HELD: &str = "SELECT count(*) FROM pg_catalog.pg_locks \
     WHERE locktype = 'advisory' AND classid = 1885499244 AND objsubid = 2 AND granted \
       AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())";

/// Instance H: takes the only slot of `Limit::concurrency("one", 1)` with message "hold" and
/// keeps it until `release` is notified. Returns once the slot is held (H stops receiving).
async fn hold_the_slot(
    db: &TestDb,
) -> (
    Arc<tokio::sync::Notify>,
    CancellationToken,
    tokio::task::JoinHandle<pgbox::Result<ConsumerStats>>,
) {
    support::enqueue_and_relay(&db.pool, TOPIC, &["hold".to_owned()]).await;
    let release = Arc::new(tokio::sync::Notify::new());
    let stop_h = CancellationToken::new();
    let h_pool = own_pool(db).await;
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
    stop_h.cancel();
    (release, stop_h, h_run)
}

/// Runs instance A (the slot held by H) until every queued copy of "m" has had at least
/// `deliveries` deliveries, all of them hand-backs; then stops it gracefully, or kills it
/// (its task aborted and its pool closed, as a crashed process) when `crash`.
async fn hand_back_m(db: &TestDb, deliveries: i64, visibility: Duration, crash: bool) {
    let stop_a = CancellationToken::new();
    let a_pool = own_pool(db).await;
    let a = builder(&a_pool, 2)
        .max_deliveries(3)
        .visibility_timeout(visibility)
        .limit(Limit::concurrency("one", 1))
        .build()
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let a_run = {
        let (ran, stop) = (ran.clone(), stop_a.clone());
        tokio::spawn(async move {
            a.run(
                async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                    ran.fetch_add(1, Ordering::SeqCst);
                    record(conn, &payload(e)).await
                },
                stop,
            )
            .await
        })
    };
    let started = Instant::now();
    loop {
        let least: i64 = count(
            &db.pool,
            "SELECT coalesce(min(deliveries), 0)::int8 FROM pgbox.queue WHERE payload = 'm'",
        )
        .await;
        if least >= deliveries {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "m was handed back only {least} times"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if crash {
        // Mid-wait: the waits take most of the time (a third of the visibility timeout each).
        tokio::time::sleep(visibility / 6).await;
        a_run.abort();
        let _ = a_run.await;
        a_pool.close().await;
    } else {
        let stats = support::stop_runner(stop_a, a_run, Duration::from_secs(30)).await;
        assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the slot was held");
}

/// Instance B: the slot is free; m's handler always fails. Returns (handler runs of m, its
/// dead letters' `deliveries`) once every copy of m is dead-lettered (or after `limit`).
async fn fail_m_until_dead(
    db: &TestDb,
    copies: i64,
    visibility: Duration,
    limit: Duration,
) -> (usize, Vec<i32>) {
    let stop_b = CancellationToken::new();
    let b_pool = own_pool(db).await;
    let b = builder(&b_pool, 1)
        .max_deliveries(3)
        .visibility_timeout(visibility)
        .limit(Limit::concurrency("one", 1))
        .build()
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let b_run = {
        let (ran, stop) = (ran.clone(), stop_b.clone());
        tokio::spawn(async move {
            b.run(
                async move |e: &Envelope, _conn: &mut HandlerConnection<'_>| {
                    if payload(e) == "m" {
                        ran.fetch_add(1, Ordering::SeqCst);
                    }
                    Err::<(), _>(Error::InvalidConfig("the handler fails".into()))
                },
                stop,
            )
            .await
        })
    };
    let started = Instant::now();
    while count(
        &db.pool,
        "SELECT count(*) FROM pgbox.queue_dead_letters WHERE payload = 'm'",
    )
    .await
        < copies
        && started.elapsed() < limit
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    support::stop_runner(stop_b, b_run, Duration::from_secs(30)).await;
    let dead: Vec<i32> = sqlx::query_scalar(
        "SELECT deliveries FROM pgbox.queue_dead_letters WHERE payload = 'm' ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    (ran.load(Ordering::SeqCst), dead)
}

/// Brief idea 1: m is handed back on instance A (several times), A stops, then on instance
/// B m's handler fails every time: m is dead-lettered after exactly `max_deliveries` (3)
/// real attempts — not earlier (its hand-backs counted), not never.
#[tokio::test]
async fn holds_handbacks_on_another_instance_then_exactly_max_real_attempts() {
    let db = database().await;
    let visibility = Duration::from_millis(600);
    let (release, stop_h, h_run) = hold_the_slot(&db).await;
    support::enqueue_and_relay(&db.pool, TOPIC, &["m".to_owned()]).await;
    hand_back_m(&db, 5, visibility, false).await;
    let handed_back: i64 = count(
        &db.pool,
        "SELECT max(deliveries)::int8 FROM pgbox.queue WHERE payload = 'm'",
    )
    .await;
    let recorded: i64 = count(
        &db.pool,
        "SELECT coalesce(sum(count), 0)::int8 FROM pgbox.hand_backs",
    )
    .await;
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;
    let (runs, dead) = fail_m_until_dead(&db, 1, visibility, Duration::from_secs(30)).await;
    assert_eq!(
        (runs, dead.clone()),
        (3, vec![handed_back as i32 + 3]),
        "m had {handed_back} hand-backs ({recorded} recorded), then its handler ran {runs} times \
         before its dead letter {dead:?}; max_deliveries is 3"
    );
}

/// Restarts: instance A is killed (a crash, an OOM kill, a deploy's SIGKILL) while m waits
/// for the slot. That delivery was no attempt (the handler never ran), yet nothing records
/// it: the transport counts it when the visibility timeout brings m back, and instance B
/// then dead-letters m after fewer than `max_deliveries` real attempts.
#[tokio::test]
#[ignore = "finding 4: a runner killed while a message waits for a limit: that delivery counts toward max_deliveries"]
async fn finding_a_runner_killed_during_a_limit_wait_counts_that_delivery() {
    let db = database().await;
    // Waits of 1 s each (a third of 3 s): the kill lands 0.5 s into one.
    let visibility = Duration::from_secs(3);
    let (release, stop_h, h_run) = hold_the_slot(&db).await;
    support::enqueue_and_relay(&db.pool, TOPIC, &["m".to_owned()]).await;
    hand_back_m(&db, 3, visibility, true).await;
    let delivered: i64 = count(
        &db.pool,
        "SELECT max(deliveries)::int8 FROM pgbox.queue WHERE payload = 'm'",
    )
    .await;
    let recorded: i64 = count(
        &db.pool,
        "SELECT coalesce(sum(count), 0)::int8 FROM pgbox.hand_backs",
    )
    .await;
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;
    let (runs, dead) = fail_m_until_dead(&db, 1, visibility, Duration::from_secs(30)).await;
    assert_eq!(
        runs, 3,
        "m was delivered {delivered} times on A, all waits for the slot ({recorded} hand-backs \
         recorded, the last wait cut by the kill); on B its handler ran {runs} times before \
         its dead letter {dead:?}; max_deliveries is 3"
    );
}

/// Copies: the relay delivers at least once, so two copies of one message (the same id)
/// can sit in the queue. `hand_backs` holds one count per message id. Finding 3 was that
/// one copy's hand-backs were taken off the other's deliveries and a copy's dead letter
/// deleted the other's count: one copy was dead-lettered after 2 real attempts. Now the
/// count stays until the janitor's purge: no copy is dead-lettered before `max_deliveries`
/// (3) failures of its own (one may get more). Both copies are handed back while the slot
/// is held, then their handler fails every time.
#[tokio::test]
async fn holds_two_copies_of_a_message_each_get_max_deliveries_real_attempts() {
    let db = database().await;
    let visibility = Duration::from_millis(600);
    let (release, stop_h, h_run) = hold_the_slot(&db).await;
    support::enqueue_and_relay(&db.pool, TOPIC, &["m".to_owned()]).await;
    // The relay's duplicate (a crash between publish and mark): the same message again.
    db.pool
        .execute(
            "INSERT INTO pgbox.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
             SELECT message_id, topic, ordering_key, payload, content_type, headers, created_at \
               FROM pgbox.queue WHERE payload = 'm'",
        )
        .await
        .unwrap();
    hand_back_m(&db, 3, visibility, false).await;
    let handed_back: Vec<i32> =
        sqlx::query_scalar("SELECT deliveries FROM pgbox.queue WHERE payload = 'm' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;
    let (runs, dead) = fail_m_until_dead(&db, 2, visibility, Duration::from_secs(30)).await;
    assert_eq!(
        dead.len(),
        2,
        "both copies are dead-lettered in the end: {dead:?}"
    );
    let mut dead_sorted = dead.clone();
    dead_sorted.sort();
    let mut handed_sorted = handed_back.clone();
    handed_sorted.sort();
    for (d, h) in dead_sorted.iter().zip(&handed_sorted) {
        assert!(
            *d >= h + 3,
            "two copies handed back {handed_back:?} times, then failing: {runs} handler runs, \
             dead-lettered at deliveries {dead:?}: a copy went to the dead letters before 3 \
             failures of its own"
        );
    }
    assert!(
        runs >= 6,
        "{runs} handler runs for two copies with max_deliveries 3"
    );
}

/// Every take of every rate limit, recorded by a trigger in table `takes`: when, which
/// bucket, by which transaction, and how many tokens it got (intervals of `interval`
/// microseconds, per limit name).
async fn record_takes(db: &TestDb, intervals: &[(&str, i64)]) {
    let cases: String = intervals
        .iter()
        .map(|(name, micros)| format!("WHEN '{name}' THEN {micros}"))
        .collect::<Vec<_>>()
        .join(" ");
    let sql = format!(
        "CREATE TABLE takes (at timestamptz NOT NULL DEFAULT clock_timestamp(), name text, \
                             prefix bytea, xid xid8, op text, got int8 NOT NULL);
         CREATE FUNCTION record_take() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           INSERT INTO takes (name, prefix, xid, op, got) VALUES (NEW.name, NEW.prefix,
             pg_current_xact_id(), TG_OP,
             (EXTRACT(EPOCH FROM NEW.tat - GREATEST(
                 CASE WHEN TG_OP = 'UPDATE' THEN OLD.tat END, statement_timestamp()))
              * 1e6 / (CASE NEW.name {cases} END))::int8);
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

/// Many rate limits on one message, several runners: a global rate and a per-tenant rate
/// (the tenant from the key), three instances. Every bucket stays within burst + rate × t
/// over every window of its takes (the database's own record of them), and a message takes
/// the tokens of both limits in one transaction or none (the only exception documented:
/// a bucket's first row inserted by two takes at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_two_rate_limits_all_or_none_across_three_instances() {
    let db = database().await;
    const GLOBAL: f64 = 25.0;
    const TENANT: f64 = 5.0;
    record_takes(&db, &[("global", 40_000), ("tenant", 200_000)]).await;
    let mut payloads = Vec::new();
    for n in 0..12 {
        for t in ["a", "b", "c", "d"] {
            payloads.push(format!("{t}:{n}"));
        }
    }
    support::enqueue_and_relay(&db.pool, TOPIC, &payloads).await;
    let mut runs = Vec::new();
    let stop = CancellationToken::new();
    for _ in 0..3 {
        let pool = own_pool(&db).await;
        let consumer = builder(&pool, 4)
            .visibility_timeout(Duration::from_secs(6))
            .limit(Limit::rate("global", GLOBAL))
            .limit(Limit::rate("tenant", TENANT).per_key_prefix(':'))
            .build()
            .unwrap();
        let stop = stop.clone();
        runs.push(tokio::spawn(async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        record(conn, &payload(e)).await
                    },
                    stop,
                )
                .await
        }));
    }
    let done = support::settled(&db.pool, payloads.len() as i64, Duration::from_secs(40)).await;
    stop.cancel();
    for run in runs {
        tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    assert!(done, "not every message went through in 40 s");
    // Each bucket: in every window [t_i, t_j] of its takes, tokens ≤ 1 + rate × (t_j - t_i).
    let takes: Vec<(String, Vec<u8>, f64, i64)> = sqlx::query_as(
        "SELECT name, prefix, EXTRACT(EPOCH FROM at)::float8, got FROM takes ORDER BY name, prefix, at",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut worst = (0.0f64, String::new());
    for bucket in takes.chunk_by(|a, b| (&a.0, &a.1) == (&b.0, &b.1)) {
        let rate = if bucket[0].0 == "global" {
            GLOBAL
        } else {
            TENANT
        };
        for i in 0..bucket.len() {
            let mut tokens = 0;
            for j in i..bucket.len() {
                tokens += bucket[j].3;
                let over = tokens as f64 - (1.0 + rate * (bucket[j].2 - bucket[i].2));
                if over > worst.0 {
                    worst = (
                        over,
                        format!(
                            "{} {:?}: {tokens} tokens in {:.3} s",
                            bucket[0].0,
                            String::from_utf8_lossy(&bucket[0].1),
                            bucket[j].2 - bucket[i].2
                        ),
                    );
                }
            }
        }
    }
    // One token of slack: the trigger reads the clock a little after the statement's time.
    assert!(
        worst.0 <= 1.0,
        "over the bound by {:.2}: {}",
        worst.0,
        worst.1
    );
    // All or none: a transaction that moved one bucket moved the other.
    let lone: i64 = count(
        &db.pool,
        "SELECT count(*) FROM (SELECT xid FROM takes GROUP BY xid HAVING count(DISTINCT name) = 1) x",
    )
    .await;
    let first_rows: i64 = count(&db.pool, "SELECT count(*) FROM takes WHERE op = 'INSERT'").await;
    let messages = payloads.len() as i64;
    let global_tokens: i64 = count(
        &db.pool,
        "SELECT coalesce(sum(got), 0)::int8 FROM takes WHERE name = 'global'",
    )
    .await;
    assert!(
        lone <= first_rows,
        "{lone} takes moved one limit's bucket alone ({first_rows} first rows); \
         {global_tokens} global tokens for {messages} messages"
    );
}

/// NATS: the transport's visibility timeout is the consumer's `ack_wait`; the runner waits
/// for a limit up to a third of its own `visibility_timeout` (default 30 s), which it does
/// not compare with the transport's. With `ack_wait` 2 s (a service with fast handlers), m
/// waits 10 s for the slot and JetStream redelivers it meanwhile: every redelivery is a
/// delivery of m that is neither an attempt nor a recorded hand-back. Once the slot is free
/// and m's handler fails, m should still get `max_deliveries` (3) real attempts.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "finding 2: NATS ack_wait under the runner's limit wait: waits redelivered, counted, m dead-lettered 2-3 times"]
async fn finding_nats_ack_wait_under_the_limit_wait_counts_waits_as_deliveries() {
    use pgbox::transport::nats::Nats;
    let db = database().await;
    let url = support::brokers::nats_url().await;
    let tag = uuid::Uuid::now_v7().simple().to_string();
    let nats = Nats::builder(&url)
        .stream(format!("ATKLIM{tag}"))
        .subject_prefix(format!("atk-lim-{tag}"))
        .max_age(Duration::from_secs(600))
        .inactive_threshold(Duration::from_secs(600))
        .ack_wait(Duration::from_secs(2))
        .receive_wait(Duration::from_millis(100))
        .build()
        .unwrap();
    let (release, stop_h, h_run) = hold_the_slot(&db).await;
    let outbox = pgbox::Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, pgbox::Message::bytes(TOPIC, b"m".as_slice()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = pgbox::Relay::builder(db.pool.clone(), nats.clone())
        .build()
        .unwrap();
    assert_eq!(relay.relay_once().await.unwrap().published, 1);

    let pool = own_pool(&db).await;
    let consumer = Consumer::builder(
        pool.clone(),
        nats.clone(),
        TOPIC,
        Inbox::new("limited").unwrap(),
    )
    .concurrency(4)
    .max_deliveries(3)
    .poll_interval(Duration::from_millis(20))
    .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
    .key(payload)
    .limit(Limit::concurrency("one", 1))
    .build()
    .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let run = {
        let (ran, stop) = (ran.clone(), stop.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    async move |_e: &Envelope, _conn: &mut HandlerConnection<'_>| {
                        ran.fetch_add(1, Ordering::SeqCst);
                        Err::<(), _>(Error::InvalidConfig("the handler fails".into()))
                    },
                    stop,
                )
                .await
        })
    };
    // The slot stays held for 7 s: m waits (and waits again when redelivered).
    tokio::time::sleep(Duration::from_secs(7)).await;
    let recorded_while_held: i64 = count(
        &db.pool,
        "SELECT coalesce(sum(count), 0)::int8 FROM pgbox.hand_backs",
    )
    .await;
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;
    // Then m's handler fails every time, with a short backoff: 3 attempts take well under
    // 15 s (a wait in flight ends by 10 s after its delivery).
    let started = Instant::now();
    while ran.load(Ordering::SeqCst) < 3 && started.elapsed() < Duration::from_secs(25) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    let recorded: i64 = count(
        &db.pool,
        "SELECT coalesce(sum(count), 0)::int8 FROM pgbox.hand_backs",
    )
    .await;
    let runs = ran.load(Ordering::SeqCst);
    assert_eq!(
        (runs, stats.dead_lettered),
        (3, 1),
        "m's handler ran {runs} times, {} dead letters ({recorded_while_held} hand-backs \
         recorded while the slot was held 7 s, {recorded} at the end; {stats:?})",
        stats.dead_lettered
    );
}

/// Shadows of the catalog functions the hand-back statements call, each raising.
const EVIL: &str = r#"
CREATE SCHEMA evil;
GRANT USAGE ON SCHEMA evil TO PUBLIC;
CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil now()'; END $$;
CREATE FUNCTION evil.set_config(text, text, boolean) RETURNS text LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil set_config()'; END $$;
CREATE FUNCTION evil.statement_timestamp() RETURNS timestamptz LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil statement_timestamp()'; END $$;
CREATE FUNCTION evil.unnest(anyarray) RETURNS SETOF anyelement LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil unnest()'; END $$;
CREATE FUNCTION evil.make_interval(years integer DEFAULT 0, months integer DEFAULT 0,
    weeks integer DEFAULT 0, days integer DEFAULT 0, hours integer DEFAULT 0,
    mins integer DEFAULT 0, secs double precision DEFAULT 0) RETURNS interval
  LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'evil make_interval()'; END $$;
CREATE TABLE evil.hand_backs (LIKE pgbox.hand_backs);
GRANT ALL ON ALL TABLES IN SCHEMA evil TO PUBLIC;
"#;

/// The application role (`Migrator::grant_to`, nothing more) with a hostile `search_path`
/// (`evil` ahead of pg_catalog, with its own `now()`, `set_config()`, `hand_backs`...):
/// every hand-back of m is recorded in pgbox's table (none in evil's), and the janitor,
/// as the same role and path, purges a row a week old.
#[tokio::test]
async fn holds_hand_backs_as_the_application_role_with_a_hostile_search_path() {
    use sqlx::Connection;
    let db = database().await;
    let role = format!(
        "pgbox_atk_{}",
        &uuid::Uuid::now_v7().simple().to_string()[16..]
    );
    let server = support::server_url().await;
    let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE ROLE \"{role}\" LOGIN")))
        .await
        .unwrap();
    pgbox::Migrator::new()
        .grant_to(&role)
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{EVIL} GRANT SELECT, INSERT ON public.effects TO \"{role}\";"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let hostile = PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(
            db.options
                .clone()
                .username(&role)
                .options([("search_path", "evil, pg_catalog, public")]),
        )
        .await
        .unwrap();
    let (release, stop_h, h_run) = hold_the_slot(&db).await;
    support::enqueue_and_relay(&db.pool, TOPIC, &["m".to_owned()]).await;
    let stop = CancellationToken::new();
    let consumer = builder(&hostile, 1)
        .max_deliveries(2)
        .visibility_timeout(Duration::from_millis(600))
        .limit(Limit::concurrency("one", 1))
        .limit(Limit::rate("rate", 1000.0))
        .build()
        .unwrap();
    let run = {
        let stop = stop.clone();
        tokio::spawn(async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        record(conn, &payload(e)).await
                    },
                    stop,
                )
                .await
        })
    };
    let started = Instant::now();
    while count(
        &db.pool,
        "SELECT coalesce(max(deliveries), 0)::int8 FROM pgbox.queue WHERE payload = 'm'",
    )
    .await
        < 4
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "m not handed back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    let delivered: i64 = count(
        &db.pool,
        "SELECT max(deliveries)::int8 FROM pgbox.queue WHERE payload = 'm'",
    )
    .await;
    let recorded: i64 = count(
        &db.pool,
        "SELECT coalesce(sum(count), 0)::int8 FROM pgbox.hand_backs",
    )
    .await;
    let evil: i64 = count(&db.pool, "SELECT count(*) FROM evil.hand_backs").await;
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!((recorded, evil), (delivered, 0), "{stats:?}");
    // The janitor, as the role through the same path, purges a row not handed back for 8 days.
    db.pool
        .execute("UPDATE pgbox.hand_backs SET at = now() - interval '8 days'")
        .await
        .unwrap();
    let report = pgbox::janitor::Janitor::builder(hostile.clone())
        .build()
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.hand_backs_deleted, 1, "{report:?}");
    hostile.close().await;
    // The role's grants go with it.
    db.pool
        .execute(sqlx::AssertSqlSafe(format!("DROP OWNED BY \"{role}\"")))
        .await
        .unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("DROP ROLE \"{role}\"")))
        .await
        .unwrap();
}

/// "A message one limit holds back takes no token of the others": m needs a rate token and
/// the only concurrency slot, which H holds for 3 s. m's tokens are taken before its slot
/// is tried, so every wait for the slot spends one, though m never goes.
#[tokio::test]
#[ignore = "finding 5: a message the concurrency limit holds back has taken rate tokens first"]
async fn finding_a_message_the_concurrency_limit_holds_back_spends_rate_tokens() {
    let db = database().await;
    record_takes(&db, &[("r", 500_000)]).await;
    let (release, stop_h, h_run) = hold_the_slot(&db).await;
    support::enqueue_and_relay(&db.pool, TOPIC, &["m".to_owned()]).await;
    let pool = own_pool(&db).await;
    let consumer = builder(&pool, 1)
        .visibility_timeout(Duration::from_millis(600))
        .limit(Limit::concurrency("one", 1))
        .limit(Limit::rate("r", 2.0))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let run = {
        let stop = stop.clone();
        tokio::spawn(async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        record(conn, &payload(e)).await
                    },
                    stop,
                )
                .await
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    let tokens: i64 = count(
        &db.pool,
        "SELECT coalesce(sum(got), 0)::int8 FROM takes WHERE name = 'r'",
    )
    .await;
    let delivered: i64 = count(
        &db.pool,
        "SELECT max(deliveries)::int8 FROM pgbox.queue WHERE payload = 'm'",
    )
    .await;
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;
    assert_eq!(stats.processed, 0, "{stats:?}");
    assert_eq!(
        tokens, 0,
        "m never went (the slot was held; {delivered} deliveries), yet took {tokens} tokens \
         of rate limit r (2/s) in 3 s"
    );
}

/// A per-prefix concurrency limit's backlog at the head of the queue: a global rate (4/s)
/// and a per-tenant concurrency of 1; tenant a has 20 messages (slow handlers, 2 s each)
/// ahead of tenant b's 8, runner concurrency 8. The promise (`Limit`): a message whose
/// per-prefix concurrency limit has no free slot for a second is handed back, "so a prefix's
/// backlog at the head of the queue does not hold the runner's slots while other prefixes'
/// messages could go". But a's messages, handed back for 1 s, are visible again ahead of
/// b's and fill the runner's slots again; and each of their waits first takes a token of
/// the global rate, so they spend it too. a runs one message at a time (0.5 tokens/s); b
/// needs 2 s at the rest of the rate. Bound: 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "finding 1: a tenant's backlog held by its per-prefix concurrency fills the runner and spends the global rate: other tenants starve"]
async fn finding_a_per_tenant_concurrency_backlog_starves_other_tenants() {
    let db = database().await;
    record_takes(&db, &[("global", 250_000)]).await;
    let mut payloads: Vec<String> = (0..20).map(|n| format!("a:{n}")).collect();
    payloads.extend((0..8).map(|n| format!("b:{n}")));
    support::enqueue_and_relay(&db.pool, TOPIC, &payloads).await;
    let pool = own_pool(&db).await;
    let consumer = builder(&pool, 8)
        .visibility_timeout(Duration::from_secs(6))
        .limit(Limit::rate("global", 4.0))
        .limit(Limit::concurrency("tenant", 1).per_key_prefix(':'))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let run = {
        let stop = stop.clone();
        tokio::spawn(async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        let p = payload(e);
                        if p.starts_with("a:") {
                            tokio::time::sleep(Duration::from_secs(2)).await;
                        }
                        record(conn, &p).await
                    },
                    stop,
                )
                .await
        })
    };
    let started = Instant::now();
    while count(
        &db.pool,
        "SELECT count(*) FROM effects WHERE payload LIKE 'b:%'",
    )
    .await
        < 8
        && started.elapsed() < Duration::from_secs(15)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b_done = count(
        &db.pool,
        "SELECT count(*) FROM effects WHERE payload LIKE 'b:%'",
    )
    .await;
    let a_done = count(
        &db.pool,
        "SELECT count(*) FROM effects WHERE payload LIKE 'a:%'",
    )
    .await;
    let tokens: i64 = count(&db.pool, "SELECT coalesce(sum(got), 0)::int8 FROM takes").await;
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), run).await;
    assert_eq!(
        b_done,
        8,
        "after 15 s: {b_done} of b's 8 messages, {a_done} of a's; {tokens} global tokens taken \
         for {} messages that went",
        a_done + b_done
    );
}

/// Behind PgBouncer in transaction mode (`Pooler::Transaction` on the inbox and queue): every
/// hand-back is recorded (its own short transaction), none is counted, and the hand-back's
/// `synchronous_commit = off` does not stay on a server connection for the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_hand_backs_behind_a_transaction_pooler() {
    use pgbox::Pooler;
    use support::cluster::Cluster;
    use support::pooler::PgBouncer;

    support::init_tracing();
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let bouncer = PgBouncer::start(&cluster, 3);
    let direct = PgPoolOptions::new()
        .max_connections(4)
        .connect(&cluster.url("postgres"))
        .await
        .unwrap();
    pgbox::migrate(&direct).await.unwrap();
    direct
        .execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();
    // H, directly on the server, holds the only slot.
    support::enqueue_and_relay(&direct, TOPIC, &["hold".to_owned()]).await;
    let release = Arc::new(tokio::sync::Notify::new());
    let stop_h = CancellationToken::new();
    let h = builder(&direct, 1)
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
    while count(&direct, "SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND classid = 1885499244 AND granted").await == 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "H took no slot");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop_h.cancel();
    support::enqueue_and_relay(&direct, TOPIC, &["m".to_owned()]).await;
    let pooled = PgPoolOptions::new()
        .max_connections(6)
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
    .concurrency(2)
    .max_deliveries(2)
    .visibility_timeout(Duration::from_millis(600))
    .poll_interval(Duration::from_millis(20))
    .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
    .key(payload)
    .limit(Limit::concurrency("one", 1))
    .limit(Limit::rate("rate", 1000.0))
    .build()
    .unwrap();
    let stop = CancellationToken::new();
    let run = {
        let stop = stop.clone();
        tokio::spawn(async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        record(conn, &payload(e)).await
                    },
                    stop,
                )
                .await
        })
    };
    let started = Instant::now();
    while count(
        &direct,
        "SELECT coalesce(max(deliveries), 0)::int8 FROM pgbox.queue WHERE payload = 'm'",
    )
    .await
        < 5
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "m not handed back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = support::stop_runner(stop, run, Duration::from_secs(30)).await;
    let delivered = count(
        &direct,
        "SELECT max(deliveries)::int8 FROM pgbox.queue WHERE payload = 'm'",
    )
    .await;
    let recorded = count(
        &direct,
        "SELECT coalesce(sum(count), 0)::int8 FROM pgbox.hand_backs",
    )
    .await;
    let mut settings = Vec::new();
    for _ in 0..6 {
        let s: String = sqlx::query_scalar("SHOW synchronous_commit")
            .persistent(false)
            .fetch_one(&pooled)
            .await
            .unwrap();
        settings.push(s);
    }
    release.notify_waiters();
    support::stop_runner(stop_h, h_run, Duration::from_secs(30)).await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(recorded, delivered, "{stats:?}");
    assert!(settings.iter().all(|s| s == "on"), "{settings:?}");
}
