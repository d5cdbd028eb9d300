//! Attacks on the test kit (`pgbox::testing`): hostile server URLs, the template a test
//! database is copied from, what `run_until_idle` says when it gives up, the probe's mark
//! with transactions in flight, and fault points at their edges. Public API only.
//!
//! The URL attacks need a process whose server is found from the environment (the kit looks
//! once per process): the parent test starts a private cluster, then runs one `#[ignore]`d
//! child test of this binary with `PGBOX_TEST_DATABASE_URL` set; the child panics when run
//! without its parent.

mod support;

use std::process::Command;
use std::time::Duration;

use pgbox::testing::{
    FaultPoint, FaultPoints, OutboxProbe, TestDatabase, TestError, run_until_idle_within,
};
use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{Consumer, Envelope, HandlerConnection, Inbox, Message, Outbox, Relay, RetryPolicy};
use sqlx::{Connection, PgConnection, PgPool};
use support::cluster::Cluster;

/// The variable a child test reads its scenario's server URL from.
const CHILD_URL: &str = "PGBOX_ATTACK_KIT_CHILD";

/// Runs the `#[ignore]`d test `name` of this binary in a process of its own, with the kit's
/// server URL set to `url`; returns whether it passed, and its output.
fn run_child(name: &str, url: &str) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PGBOX_TEST_DATABASE_URL", url)
        .env(CHILD_URL, url)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("1 passed") || text.contains("1 failed"),
        "the child {name} did not run: {text}"
    );
    (out.status.success(), text)
}

/// The URL a child test was given; panics when it runs without its parent.
fn child_url() -> String {
    std::env::var(CHILD_URL)
        .unwrap_or_else(|_| panic!("run by its parent test (it sets {CHILD_URL}), not alone"))
}

async fn one_message(pool: &PgPool, topic: &str, key: &str) -> uuid::Uuid {
    let mut tx = pool.begin().await.unwrap();
    let id = Outbox::new()
        .enqueue(
            &mut tx,
            Message::json(topic, &serde_json::json!({ "key": key }))
                .unwrap()
                .ordering_key(key),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    id
}

/// Runs `sql` with `psql` on the database of `url`; its unaligned output.
fn psql_on(url: &str, sql: &str) -> String {
    let out = Command::new("psql")
        .args([url, "-XAtc", sql])
        .output()
        .unwrap();
    assert!(out.status.success(), "psql {sql:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn quick_consumer(pool: &PgPool, queue: PgQueue, topic: &str) -> Consumer<PgQueue> {
    Consumer::builder(
        pool.clone(),
        queue,
        topic,
        Inbox::new("attack-kit").unwrap(),
    )
    .poll_interval(Duration::from_millis(50))
    .visibility_timeout(Duration::from_secs(5))
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(10))
            .max_delay(Duration::from_millis(50)),
    )
    .build()
    .unwrap()
}

async fn ok_handler(_: &Envelope, _: &mut HandlerConnection<'_>) -> Result<(), pgbox::Error> {
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Hostile server URLs
// ---------------------------------------------------------------------------------------

/// A URL may name its database in the query string (`?dbname=app`, which libpq and sqlx
/// honour over the path). The kit replaces the path with the test database's name: the
/// query's `dbname` must not take the test's pool, and pgbox's migrations, into `app`.
#[test]
fn finding_a_dbname_in_the_urls_query_takes_the_test_into_the_named_database() {
    let cluster = Cluster::start();
    cluster.psql("CREATE DATABASE app");
    let url = format!("{}?dbname=app", cluster.url("postgres"));
    let (passed, output) = run_child("child_a_test_database_is_the_one_its_pool_reaches", &url);
    let in_app = psql_on(
        &cluster.url("app"),
        "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgbox'",
    );
    let in_admin = psql_on(
        &cluster.url("postgres"),
        "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgbox'",
    );
    assert_eq!(in_admin, "0", "the admin database was not migrated");
    assert_eq!(
        in_app, "0",
        "pgbox's schema was created in `app`, a database the kit did not create"
    );
    assert!(passed, "{output}");
}

#[tokio::test]
#[ignore = "run by its parent test with a hostile server URL"]
async fn child_a_test_database_is_the_one_its_pool_reaches() {
    let _ = child_url();
    let db = TestDatabase::new().await.expect("a test database");
    let current: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(current, db.name(), "the pool reaches the test database");
    let mut other = PgConnection::connect(db.url()).await.unwrap();
    let current: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut other)
        .await
        .unwrap();
    assert_eq!(current, db.name(), "url() names the test database");
    other.close().await.unwrap();
    db.close().await.unwrap();
}

/// Any session connected to `template1` (a monitoring agent, `psql template1`, an admin
/// URL naming it) makes `CREATE DATABASE` from that template fail. A test database needs
/// nothing of template1: it must be made all the same.
#[test]
fn finding_a_session_on_template1_makes_every_test_database_fail() {
    let cluster = Cluster::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Another session on template1, held while the child makes its test database.
    let on_template1 = runtime
        .block_on(PgConnection::connect(&cluster.url("template1")))
        .unwrap();
    let (passed, output) = run_child(
        "child_a_test_database_is_the_one_its_pool_reaches",
        &cluster.url("postgres"),
    );
    runtime.block_on(on_template1.close()).unwrap();
    assert!(passed, "{output}");
}

/// Objects someone left in template1 must not appear in a "fresh" test database.
#[test]
fn finding_a_test_database_inherits_what_template1_holds() {
    let cluster = Cluster::start();
    psql_on(
        &cluster.url("template1"),
        "CREATE TABLE stray_in_template1 (id int)",
    );
    let (passed, output) = run_child(
        "child_a_test_database_has_no_table_of_template1",
        &cluster.url("postgres"),
    );
    assert!(passed, "{output}");
}

#[tokio::test]
#[ignore = "run by its parent test with a hostile server URL"]
async fn child_a_test_database_has_no_table_of_template1() {
    let _ = child_url();
    let db = TestDatabase::unmigrated().await.expect("a test database");
    let stray: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('public.stray_in_template1')::text")
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_eq!(stray, None, "a fresh database holds nothing of template1's");
    db.close().await.unwrap();
}

/// A role without CREATEDB: a typed error that says so, not a panic or a hang.
#[test]
fn a_role_without_createdb_gets_a_typed_error() {
    let cluster = Cluster::start();
    cluster.psql("CREATE ROLE kit_no_createdb LOGIN");
    let url = format!(
        "postgres://kit_no_createdb@127.0.0.1:{}/postgres",
        cluster.port()
    );
    let (passed, output) = run_child("child_without_createdb_the_error_is_typed", &url);
    assert!(passed, "{output}");
}

#[tokio::test]
#[ignore = "run by its parent test with a hostile server URL"]
async fn child_without_createdb_the_error_is_typed() {
    let _ = child_url();
    match TestDatabase::new().await {
        Err(TestError::Database { name, reason }) => {
            assert!(name.starts_with("pgbox_test_"), "{name}");
            assert!(reason.contains("permission denied"), "{reason}");
        }
        other => panic!("expected TestError::Database, got {other:?}"),
    }
}

/// A URL that does not answer: `NoServer`, naming the variable, and no other server tried.
#[test]
fn a_url_that_does_not_answer_is_the_error_and_nothing_else_is_tried() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let (passed, output) = run_child("child_no_server_names_the_variable", &url);
    assert!(passed, "{output}");
}

#[tokio::test]
#[ignore = "run by its parent test with a hostile server URL"]
async fn child_no_server_names_the_variable() {
    let _ = child_url();
    match TestDatabase::new().await {
        Err(TestError::NoServer { tried }) => {
            assert!(tried.contains("PGBOX_TEST_DATABASE_URL"), "{tried}");
            assert!(!tried.contains("5432"), "no fallback: {tried}");
        }
        other => panic!("expected TestError::NoServer, got {other:?}"),
    }
}

/// A logical replication slot left in a test database (a WAL outbox's test that did not
/// clean up) must not keep the database, nor the slot holding WAL on the server.
#[test]
fn a_logical_slot_left_in_a_test_database_goes_with_it() {
    let cluster = Cluster::start_logical();
    let (passed, output) = run_child(
        "child_a_slot_left_behind_does_not_keep_the_database",
        &cluster.url("postgres"),
    );
    let slots = cluster.psql("SELECT count(*) FROM pg_replication_slots");
    let dbs = cluster.psql("SELECT count(*) FROM pg_database WHERE datname LIKE 'pgbox_test_%'");
    assert!(passed, "{output}");
    assert_eq!((slots.as_str(), dbs.as_str()), ("0", "0"));
}

#[tokio::test]
#[ignore = "run by its parent test with a hostile server URL"]
async fn child_a_slot_left_behind_does_not_keep_the_database() {
    let _ = child_url();
    let db = TestDatabase::new().await.expect("a test database");
    sqlx::query("SELECT pg_create_logical_replication_slot('kit_attack_slot', 'test_decoding')")
        .execute(db.pool())
        .await
        .unwrap();
    db.close().await.expect("closed, slot and all");
}

// ---------------------------------------------------------------------------------------
// run_until_idle: what it says when it gives up
// ---------------------------------------------------------------------------------------

/// A relay whose every round fails at an armed fault point never goes idle: `NotIdle` must
/// say the relay is what is pending, not "0 message(s) still in the queue".
#[tokio::test]
async fn finding_not_idle_blames_an_empty_queue_when_the_relay_never_finished() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool().clone();
    let broker = TestDatabase::new().await.unwrap();
    one_message(&pool, "kit", "a").await;
    let queue = PgQueue::new(broker.pool().clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = quick_consumer(&pool, queue, "kit");
    let faults = FaultPoints::new();
    faults.arm(FaultPoint::RelayAfterPublishBeforeMark, u32::MAX);
    let result = faults
        .scope(run_until_idle_within(
            Duration::from_secs(1),
            &relay,
            &consumer,
            ok_handler,
        ))
        .await;
    let Err(TestError::NotIdle { state, .. }) = result else {
        panic!("expected NotIdle, got {result:?}");
    };
    assert!(faults.fired(FaultPoint::RelayAfterPublishBeforeMark) > 0);
    assert!(
        state.contains("relay"),
        "the state says what was pending: {state}"
    );
    broker.close().await.unwrap();
    db.close().await.unwrap();
}

/// A publisher that never succeeds (the broker is away): the relay's drain waits for it,
/// so `run_until_idle` must still end at its limit with a state that names the relay, not
/// "a handler has not returned" (no handler ever ran).
struct AlwaysAway;

impl Publisher for AlwaysAway {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        batch
            .iter()
            .map(|_| Err(PublishError::unavailable("the broker is away")))
            .collect()
    }
}

#[tokio::test]
async fn finding_not_idle_blames_a_handler_when_the_relay_cannot_publish() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool().clone();
    one_message(&pool, "kit", "a").await;
    let relay = Relay::builder(pool.clone(), AlwaysAway).build().unwrap();
    let consumer = quick_consumer(&pool, PgQueue::new(pool.clone()), "kit");
    let result = run_until_idle_within(Duration::from_secs(1), &relay, &consumer, ok_handler).await;
    let Err(TestError::NotIdle { state, .. }) = result else {
        panic!("expected NotIdle, got {result:?}");
    };
    assert!(
        !state.contains("handler"),
        "no handler ran; the relay is what is pending: {state}"
    );
    assert!(state.contains("relay"), "{state}");
    db.close().await.unwrap();
}

/// A handler that enqueues two messages for every one it handles never lets the outbox
/// empty: bounded, `NotIdle`.
#[tokio::test]
async fn a_handler_that_enqueues_forever_is_bounded() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool().clone();
    one_message(&pool, "kit", "seed").await;
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = quick_consumer(&pool, queue, "kit");
    let result = run_until_idle_within(
        Duration::from_secs(2),
        &relay,
        &consumer,
        async |_: &Envelope, conn: &mut HandlerConnection<'_>| {
            for key in ["x", "y"] {
                Outbox::new()
                    .enqueue(
                        conn,
                        Message::json("kit", &serde_json::json!({ "key": key }))?,
                    )
                    .await?;
            }
            Ok::<_, pgbox::Error>(())
        },
    )
    .await;
    assert!(
        matches!(result, Err(TestError::NotIdle { .. })),
        "{result:?}"
    );
    db.close().await.unwrap();
}

/// A consumer of another topic than the one published: idle at once (only its topic is
/// waited for), and the other topic's message is left in the queue, untouched.
#[tokio::test]
async fn a_consumer_of_another_topic_is_idle_and_leaves_the_message() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool().clone();
    one_message(&pool, "published", "a").await;
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = quick_consumer(&pool, queue, "other");
    let report = run_until_idle_within(Duration::from_secs(10), &relay, &consumer, ok_handler)
        .await
        .unwrap();
    assert_eq!((report.published, report.consumer.processed), (1, 0));
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgbox.queue WHERE topic = 'published'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, 1);
    db.close().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// The probe's mark with transactions in flight
// ---------------------------------------------------------------------------------------

/// A transaction begun before the mark that enqueues after it and commits: seen. One that
/// enqueued before the mark: not the probe's business, even when it commits after. A
/// rolled-back nextval leaves a gap that hides nothing.
#[tokio::test]
async fn the_probe_mark_is_a_position_not_a_time() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool().clone();
    let enqueue = async |tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, key: &str| {
        Outbox::new()
            .enqueue(
                tx,
                Message::json("kit", &serde_json::json!({}))
                    .unwrap()
                    .ordering_key(key),
            )
            .await
            .unwrap()
    };
    let mut early = pool.begin().await.unwrap();
    enqueue(&mut early, "before-mark").await;
    let mut late = pool.begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *late).await.unwrap();
    let mut gone = pool.begin().await.unwrap();
    let probe = OutboxProbe::start(&pool).await.unwrap();
    enqueue(&mut gone, "rolled-back").await;
    gone.rollback().await.unwrap();
    enqueue(&mut late, "after-mark").await;
    // Its own uncommitted message, seen inside; nothing committed yet, outside.
    probe
        .enqueued_in(&mut late)
        .await
        .unwrap()
        .assert_enqueued("kit", Some("after-mark"));
    probe.enqueued().await.unwrap().assert_nothing_enqueued();
    early.commit().await.unwrap();
    late.commit().await.unwrap();
    let seen = probe.enqueued().await.unwrap();
    assert_eq!(seen.len(), 1, "{seen}");
    seen.assert_enqueued("kit", Some("after-mark"));
    db.close().await.unwrap();
}

/// A probe of another schema sees that schema's outbox only.
#[tokio::test]
async fn a_probe_of_another_schema_sees_only_that_outbox() {
    let db = TestDatabase::with_migrator(pgbox::Migrator::new().schema("billing").unwrap())
        .await
        .unwrap();
    pgbox::Migrator::new().run(db.pool()).await.unwrap();
    let pool = db.pool().clone();
    let billing = OutboxProbe::start_in(&pool, "billing").await.unwrap();
    let default = OutboxProbe::start(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    Outbox::with_schema("billing")
        .unwrap()
        .enqueue(
            &mut tx,
            Message::json("invoices", &serde_json::json!({})).unwrap(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    billing
        .enqueued()
        .await
        .unwrap()
        .assert_enqueued("invoices", None);
    default.enqueued().await.unwrap().assert_nothing_enqueued();
    db.close().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Fault points at their edges
// ---------------------------------------------------------------------------------------

/// Armed 0 times: nothing armed. Armed outside a scope, reached outside it: no effect.
/// Reached in a task spawned inside the scope: no effect (documented). Armed to the
/// maximum and disarmed: stops. Into the queue of the relay's own database, a faulted round
/// sends nothing and loses nothing.
#[tokio::test]
async fn fault_points_act_only_when_armed_in_scope_and_lose_nothing() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool().clone();
    for key in ["a", "b", "c"] {
        one_message(&pool, "kit", key).await;
    }
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let faults = FaultPoints::new();
    let point = FaultPoint::RelayAfterPublishBeforeMark;
    faults.arm(point, 0);
    assert_eq!(faults.armed(point), 0);

    faults.arm(point, u32::MAX);
    faults.arm(point, 5);
    assert_eq!(faults.armed(point), u32::MAX, "saturates");
    // In a task spawned inside the scope: not in effect.
    let spawned = faults
        .scope(async {
            let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
            tokio::spawn(async move { relay.relay_once().await.map(|r| r.claimed) })
                .await
                .unwrap()
        })
        .await;
    assert_eq!(faults.fired(point), 0, "{spawned:?}");
    one_message(&pool, "kit", "d").await;
    assert!(faults.scope(relay.relay_once()).await.is_err());
    assert!(faults.scope(relay.relay_once()).await.is_err());
    assert_eq!(faults.fired(point), 2);
    // Outside the scope: no effect, though armed.
    relay.relay_once().await.unwrap();
    faults.disarm(point);
    faults.scope(relay.drain()).await.unwrap();
    assert_eq!(faults.fired(point), 2);
    let in_queue: Vec<String> =
        sqlx::query_scalar("SELECT ordering_key FROM pgbox.queue ORDER BY ordering_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(in_queue, ["a", "b", "c", "d"], "each once, none lost");
    db.close().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Cleanup: close and drop with connections in hand, panics, runtimes shut down
// ---------------------------------------------------------------------------------------

async fn database_exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `close()` while the test still holds a connection of the pool (an open transaction, a
/// consumer task it did not stop): the docs say connections still open are ended; it must
/// not wait for them, which is forever. (The bound only tells a hang from an answer.)
#[tokio::test]
async fn finding_close_waits_forever_for_a_connection_the_test_still_holds() {
    let watcher = TestDatabase::unmigrated().await.unwrap();
    let db = TestDatabase::new().await.unwrap();
    let name = db.name().to_owned();
    let mut tx = db.pool().begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(20), db.close()).await;
    let Ok(closed) = closed else {
        drop_by_hand(&watcher, &name).await;
        panic!("close() still waits for the transaction the test holds");
    };
    closed.unwrap();
    assert!(!database_exists(watcher.pool(), &name).await);
    assert!(tx.commit().await.is_err(), "its connection was ended");
    watcher.close().await.unwrap();
}

/// Drops a test database this test made, by hand, when the kit left it: so that a failing
/// finding leaves nothing behind on the server.
async fn drop_by_hand(watcher: &TestDatabase, name: &str) {
    assert!(name.starts_with("pgbox_test_") && name.bytes().all(|b| b != b'"'));
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
    )))
    .execute(watcher.pool())
    .await
    .unwrap();
}

/// A `close()` cut short (its future dropped: a `timeout` or `select!` around it, a test
/// that ends while it runs) must still leave the database to be dropped, as an unclosed one
/// is. (A zero timeout drops it after its first poll, which cannot finish a `DROP
/// DATABASE`.)
#[tokio::test]
async fn finding_a_close_cut_short_leaves_the_database_behind() {
    let watcher = TestDatabase::unmigrated().await.unwrap();
    let db = TestDatabase::new().await.unwrap();
    let name = db.name().to_owned();
    let cut = tokio::time::timeout(Duration::ZERO, db.close()).await;
    assert!(cut.is_err(), "cut short");
    let left = database_exists(watcher.pool(), &name).await;
    drop_by_hand(&watcher, &name).await;
    assert!(!left, "{name} was left behind");
    watcher.close().await.unwrap();
}

/// Dropped (not closed) while a transaction of its pool is open, on the test's
/// current-thread runtime: no deadlock, and the database is gone when `drop` returns.
#[tokio::test]
async fn a_drop_with_a_transaction_open_on_a_current_thread_runtime_removes_the_database() {
    let watcher = TestDatabase::unmigrated().await.unwrap();
    let db = TestDatabase::new().await.unwrap();
    let name = db.name().to_owned();
    let mut tx = db.pool().begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    drop(db);
    assert!(!database_exists(watcher.pool(), &name).await);
    drop(tx);
    watcher.close().await.unwrap();
}

/// A test that panics, and a runtime shut down with a test database alive in one of its
/// tasks: both drop the database.
#[tokio::test]
async fn a_panicking_test_and_a_runtime_shut_down_drop_their_databases() {
    let watcher = TestDatabase::unmigrated().await.unwrap();
    let (names, mut named) = tokio::sync::mpsc::unbounded_channel::<String>();
    let sender = names.clone();
    let panicked = tokio::spawn(async move {
        let db = TestDatabase::new().await.unwrap();
        sender.send(db.name().to_owned()).unwrap();
        panic!("the test under test fails");
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    let first = named.recv().await.unwrap();

    let sender = names.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (ready, made) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let db = TestDatabase::new().await.unwrap();
            sender.send(db.name().to_owned()).unwrap();
            ready.send(()).unwrap();
            std::future::pending::<()>().await;
            drop(db);
        });
        runtime.block_on(async {
            for _ in 0..600 {
                if made.try_recv().is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            panic!("the task made no database");
        });
        // Shut down with the task (and its database) still alive.
        drop(runtime);
    })
    .join()
    .unwrap();
    let second = named.recv().await.unwrap();
    for name in [first, second] {
        assert!(
            !database_exists(watcher.pool(), &name).await,
            "{name} was dropped"
        );
    }
    watcher.close().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// The probe's assertions with messages near the limits
// ---------------------------------------------------------------------------------------

/// A topic of the longest allowed size, a key of newlines and quotes, a payload that is
/// not UTF-8: found as they are, and a failed assertion lists them, escaped.
#[tokio::test]
async fn the_probe_finds_and_lists_messages_at_the_limits() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool().clone();
    let topic = "t".repeat(pgbox::MAX_TOPIC_BYTES);
    let key = "line\nbreak \"quoted\" ✓";
    let probe = OutboxProbe::start(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(
            &mut tx,
            Message::bytes(topic.as_str(), vec![0xff, 0xfe, 0x00]).ordering_key(key),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let seen = probe.enqueued().await.unwrap();
    let found = seen.assert_enqueued(&topic, Some(key));
    assert_eq!(found.payload, [0xff, 0xfe, 0x00]);
    assert!(found.json::<serde_json::Value>().is_err());
    let listed = std::panic::catch_unwind(|| seen.assert_enqueued(&topic, None))
        .err()
        .and_then(|p| p.downcast::<String>().ok())
        .expect("a panic with a message");
    assert!(
        listed.contains("\\n") && listed.contains(&topic),
        "{listed}"
    );
    let listed = std::panic::catch_unwind(|| seen.assert_nothing_enqueued())
        .err()
        .and_then(|p| p.downcast::<String>().ok())
        .expect("a panic with a message");
    assert!(listed.contains("3 bytes"), "{listed}");
    db.close().await.unwrap();
}
