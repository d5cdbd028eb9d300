//! One tenant relay serves many pgbox schemas in several databases: every message once, in
//! order per key per tenant, marked with its tenant; tenants come and go while it runs; a
//! broken tenant is reported and the others flow; a quiet tenant is not starved by a
//! backlog; idle tenants cost no connection each; a relay dropped mid-round loses and
//! doubles nothing.

mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    CancellationToken, Envelope, Message, Migrator, Outbox, TENANT_HEADER, TenantHealth,
    TenantRelay,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool, Row};
use support::TestDb;

/// Records what it is given; optionally slow (a transport's round trip).
#[derive(Debug, Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Envelope>>>,
    delay: Duration,
}

impl Recorder {
    fn slow(delay: Duration) -> Self {
        Recorder {
            delay,
            ..Recorder::default()
        }
    }

    fn seen(&self) -> Vec<Envelope> {
        self.seen.lock().unwrap().clone()
    }

    fn count_of(&self, tenant: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.headers.get(TENANT_HEADER).map(String::as_str) == Some(tenant))
            .count()
    }
}

impl Publisher for Recorder {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.seen.lock().unwrap().extend(batch.iter().cloned());
        vec![Ok(()); batch.len()]
    }
}

/// Migrates pgbox into `schema` (one script, one round trip).
async fn migrate_schema(pool: &PgPool, schema: &str) {
    let sql = Migrator::new().schema(schema).unwrap().to_sql();
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(pool)
        .await
        .expect("migrate schema");
}

/// Enqueues `n` messages into `schema` in one transaction, keyed over `keys` keys, payload
/// `<i>` for i in `from..from + n`.
async fn enqueue_from(pool: &PgPool, schema: &str, from: usize, n: usize, keys: usize) {
    let outbox = Outbox::with_schema(schema).unwrap();
    let mut tx = pool.begin().await.unwrap();
    for i in from..from + n {
        let message = Message::bytes("events", i.to_string().into_bytes())
            .ordering_key(format!("key-{}", i % keys));
        outbox.enqueue(&mut tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn enqueue(pool: &PgPool, schema: &str, n: usize, keys: usize) {
    enqueue_from(pool, schema, 0, n, keys).await
}

/// Every message exactly once, and per (tenant, key) in enqueue order.
fn check_once_in_order(seen: &[Envelope], expected: &HashMap<String, usize>) {
    let mut ids = HashSet::new();
    for e in seen {
        assert!(ids.insert(e.id), "message {} published twice", e.id);
    }
    let mut last: HashMap<(String, String), i64> = HashMap::new();
    let mut per_tenant: HashMap<String, usize> = HashMap::new();
    for e in seen {
        let tenant = e.headers.get(TENANT_HEADER).expect("tenant header").clone();
        *per_tenant.entry(tenant.clone()).or_default() += 1;
        let n: i64 = String::from_utf8(e.payload.clone())
            .unwrap()
            .parse()
            .unwrap();
        let key = (tenant, e.ordering_key.clone().unwrap());
        if let Some(before) = last.insert(key.clone(), n) {
            assert!(before < n, "{key:?}: {n} published after {before}");
        }
    }
    assert_eq!(&per_tenant, expected);
}

/// Databases this test creates on the server (named `<prefix>_<i>`), dropped at the end.
struct OwnDatabases {
    server: String,
    names: Vec<String>,
    pools: Vec<PgPool>,
}

impl OwnDatabases {
    async fn create(prefix: &str, n: usize) -> Self {
        let server = support::server_url().await;
        let mut admin = PgConnection::connect(&server).await.unwrap();
        let mut names = Vec::new();
        let mut pools = Vec::new();
        for i in 0..n {
            let name = format!("{prefix}_{i}");
            admin
                .execute(AssertSqlSafe(format!(
                    "CREATE DATABASE \"{name}\" TEMPLATE template0"
                )))
                .await
                .unwrap();
            let options = PgConnectOptions::from_str(&server).unwrap().database(&name);
            pools.push(
                PgPoolOptions::new()
                    .max_connections(8)
                    .connect_with(options)
                    .await
                    .unwrap(),
            );
            names.push(name);
        }
        admin.close().await.ok();
        OwnDatabases {
            server,
            names,
            pools,
        }
    }
}

impl Drop for OwnDatabases {
    fn drop(&mut self) {
        let server = self.server.clone();
        let names = self.names.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&server).await {
                    for name in names {
                        let _ = admin
                            .execute(AssertSqlSafe(format!(
                                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                            )))
                            .await;
                    }
                }
            });
        })
        .join();
    }
}

/// Waits (bounded) until `done` holds; panics with `what` otherwise.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..1200 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("waited 60 s for {what}");
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::now_v7().simple().to_string()[20..]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_schemas_in_three_discovered_databases_publish_every_message_once_in_key_order() {
    support::init_tracing();
    let prefix = unique("pgbox_tn");
    let dbs = OwnDatabases::create(&prefix, 3).await;
    let mut expected = HashMap::new();
    for s in 0..50 {
        let i = s % 3;
        let schema = format!("tenant_{s}");
        migrate_schema(&dbs.pools[i], &schema).await;
        let n = 20 + s;
        enqueue(&dbs.pools[i], &schema, n, 3).await;
        expected.insert(format!("{}/{schema}", dbs.names[i]), n);
    }
    let server = PgPoolOptions::new()
        .max_connections(2)
        .connect(&dbs.server)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .discover_databases(server, format!("{prefix}\\_%"))
            .schema_pattern("tenant\\_%")
            .batch_size(7)
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let total: usize = expected.values().sum();
    wait_until("every message", || recorder.seen().len() >= total).await;
    // A little longer: a message published twice would show.
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    check_once_in_order(&recorder.seen(), &expected);
    let status = relay.status();
    assert_eq!(status.len(), 50);
    assert!(status.iter().all(|s| s.health == TenantHealth::Healthy));
    assert_eq!(
        status.iter().map(|s| s.published).sum::<u64>(),
        total as u64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_created_while_running_is_served_and_a_dropped_one_is_let_go() {
    support::init_tracing();
    let db = TestDb::empty().await;
    for s in ["tenant_a", "tenant_b"] {
        migrate_schema(&db.pool, s).await;
    }
    let recorder = Recorder::default();
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(db.pool.clone())
            .discover_interval(Duration::from_millis(200))
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let name = db.name.clone();
    wait_until("both tenants asleep", || {
        relay.status().iter().filter(|s| s.asleep).count() == 2
    })
    .await;

    // Created and migrated while it runs.
    migrate_schema(&db.pool, "tenant_c").await;
    enqueue(&db.pool, "tenant_c", 5, 2).await;
    let c = format!("{name}/tenant_c");
    wait_until("the new tenant's messages", || recorder.count_of(&c) == 5).await;

    // Dropped while it runs (asleep, its lock held): let go; the others go on.
    sqlx::query("DROP SCHEMA tenant_a CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_until("the dropped tenant let go", || {
        relay.status().iter().all(|s| s.schema != "tenant_a")
    })
    .await;
    enqueue(&db.pool, "tenant_b", 4, 2).await;
    let b = format!("{name}/tenant_b");
    wait_until("the other tenant's messages", || recorder.count_of(&b) == 4).await;
    // Its asleep lock was released with it: the tenant relay holds none for tenant_a.
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
           AND classid = x'70626f7a'::int::oid AND objid = hashtext('tenant_a')::oid",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(held, 0, "the dropped tenant's asleep lock is still held");
    assert!(!task.is_finished(), "the relay stopped on its own");
    shutdown.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(relay.status().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_tenant_is_reported_and_the_others_flow() {
    support::init_tracing();
    let db = TestDb::empty().await;
    for s in ["tenant_ok", "tenant_bad"] {
        migrate_schema(&db.pool, s).await;
    }
    enqueue(&db.pool, "tenant_bad", 3, 1).await;
    // A migration gone wrong: the relay's claim cannot run there.
    sqlx::query("ALTER TABLE tenant_bad.outbox RENAME COLUMN attempts TO attempts_lost")
        .execute(&db.pool)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(db.pool.clone())
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let broken = || {
        relay
            .status()
            .into_iter()
            .any(|s| s.schema == "tenant_bad" && matches!(s.health, TenantHealth::Broken { .. }))
    };
    wait_until("the broken tenant reported", broken).await;
    let ok = format!("{}/tenant_ok", db.name);
    for round in 1..=3 {
        enqueue(&db.pool, "tenant_ok", 2, 1).await;
        wait_until("the healthy tenant's messages", || {
            recorder.count_of(&ok) == 2 * round
        })
        .await;
    }
    assert!(broken(), "the broken tenant recovered by itself");
    let bad = relay
        .status()
        .into_iter()
        .find(|s| s.schema == "tenant_bad")
        .unwrap();
    assert!(
        bad.last_error.as_deref().unwrap().contains("attempts"),
        "{bad:?}"
    );
    // Repaired, it flows again.
    sqlx::query("ALTER TABLE tenant_bad.outbox RENAME COLUMN attempts_lost TO attempts")
        .execute(&db.pool)
        .await
        .unwrap();
    let bad = format!("{}/tenant_bad", db.name);
    wait_until("the repaired tenant's messages", || {
        recorder.count_of(&bad) == 3
    })
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    assert!(
        relay
            .status()
            .iter()
            .all(|s| s.health == TenantHealth::Healthy)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenant_is_served_while_a_large_backlog_is_far_from_drained() {
    support::init_tracing();
    let db = TestDb::empty().await;
    for s in ["tenant_busy", "tenant_quiet"] {
        migrate_schema(&db.pool, s).await;
    }
    const BACKLOG: usize = 50_000;
    sqlx::query(
        "INSERT INTO tenant_busy.outbox (message_id, topic, payload, content_type) \
         SELECT gen_random_uuid(), 'bulk', convert_to(g::text, 'UTF8'), 'text/plain' \
         FROM generate_series(1, 50000) AS g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Each publish call takes 10 ms: the backlog needs 100 rounds, a second at least.
    let recorder = Recorder::slow(Duration::from_millis(10));
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(db.pool.clone())
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let busy = format!("{}/tenant_busy", db.name);
    let quiet = format!("{}/tenant_quiet", db.name);
    wait_until("the backlog started", || recorder.count_of(&busy) > 0).await;
    const QUIET: usize = 20;
    for _ in 0..QUIET {
        enqueue(&db.pool, "tenant_quiet", 1, 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    wait_until("the quiet tenant's messages", || {
        recorder.count_of(&quiet) == QUIET
    })
    .await;
    let busy_then = recorder.count_of(&busy);
    assert!(
        busy_then < BACKLOG / 2,
        "the quiet tenant was served only after {busy_then} of the backlog's {BACKLOG} messages"
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_idle_tenants_hold_a_constant_number_of_connections() {
    support::init_tracing();
    let db = TestDb::empty().await;
    let mut migrations = tokio::task::JoinSet::new();
    for s in 0..200 {
        let pool = db.pool.clone();
        migrations.spawn(async move { migrate_schema(&pool, &format!("tenant_{s}")).await });
        if migrations.len() >= 4 {
            migrations.join_next().await.unwrap().unwrap();
        }
    }
    migrations.join_all().await;
    let app = unique("tenant_relay");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options.clone().application_name(&app))
        .await
        .unwrap();
    let relay = Arc::new(
        TenantRelay::builder(Recorder::default())
            .database(pool)
            .rounds_in_flight(4)
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    wait_until("every tenant asleep", || {
        let s = relay.status();
        s.len() == 200 && s.iter().all(|s| s.asleep)
    })
    .await;
    for _ in 0..3 {
        let connections: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(&app)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert!(
            connections <= 4 + 1,
            "{connections} connections for 200 idle tenants (pool 4 + 1 listener)"
        );
        let locks: Vec<(String, i64)> = sqlx::query_as(
            "SELECT l.mode, count(*) \
             FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid) \
             WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.granted \
               AND l.classid = x'70626f7a'::int::oid \
             GROUP BY 1 ORDER BY 1",
        )
        .bind(&app)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            locks,
            vec![("ExclusiveLock".to_owned(), 200)],
            "one asleep lock per sleeping tenant"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_dropped_mid_round_loses_and_doubles_nothing_in_the_queue() {
    support::init_tracing();
    let db = TestDb::migrated().await; // the queue, in schema pgbox
    let schemas = ["tenant_x", "tenant_y", "tenant_z"];
    let mut expected = BTreeMap::new();
    for s in schemas {
        migrate_schema(&db.pool, s).await;
        for t in 0..4 {
            enqueue_from(&db.pool, s, t * 500, 500, 5).await;
        }
        expected.insert(format!("{}/{s}", db.name), 2000i64);
    }
    let total: i64 = expected.values().sum();
    let build = || {
        TenantRelay::builder(PgQueue::new(db.pool.clone()))
            .database(db.pool.clone())
            .schema_pattern("tenant\\_%")
            .batch_size(50)
            .build()
            .unwrap()
    };
    let queued = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pgbox.queue")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let relay = build();
    let task = tokio::spawn(async move { relay.run(CancellationToken::new()).await });
    for _ in 0..1200 {
        if queued().await > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    let _ = task.await;
    let moved = queued().await;
    assert!(
        moved > 0 && moved < total,
        "dropped after {moved} of {total}"
    );

    let report = build().drain().await.unwrap();
    assert_eq!(report.tenants, 3);
    assert_eq!(report.broken, 0);
    let rows = sqlx::query(
        "SELECT message_id, ordering_key, convert_from(payload, 'UTF8'), headers->>'pgbox-tenant' \
         FROM pgbox.queue ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut ids = HashSet::new();
    let mut last: HashMap<(String, String), i64> = HashMap::new();
    let mut per_tenant: BTreeMap<String, i64> = BTreeMap::new();
    for row in &rows {
        let id: uuid::Uuid = row.get(0);
        assert!(ids.insert(id), "message {id} in the queue twice");
        let tenant: String = row.get::<Option<String>, _>(3).expect("tenant header");
        let key: String = row.get(1);
        let n: i64 = row.get::<String, _>(2).parse().unwrap();
        *per_tenant.entry(tenant.clone()).or_default() += 1;
        if let Some(before) = last.insert((tenant.clone(), key.clone()), n) {
            assert!(before < n, "{tenant} {key}: {n} after {before}");
        }
    }
    assert_eq!(per_tenant, expected);
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM tenant_x.outbox) + (SELECT count(*) FROM tenant_y.outbox) \
           + (SELECT count(*) FROM tenant_z.outbox)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(left, 0);
}

#[tokio::test]
async fn bad_settings_are_refused() {
    let db = TestDb::empty().await;
    let e = TenantRelay::builder(Recorder::default())
        .build()
        .unwrap_err();
    assert!(matches!(e, pgbox::Error::InvalidConfig(_)), "{e:?}");
    let e = TenantRelay::builder(Recorder::default())
        .database(db.pool.clone())
        .schemas(["Bad\"name"])
        .build()
        .unwrap_err();
    assert!(matches!(e, pgbox::Error::InvalidIdentifier { .. }), "{e:?}");
    let e = TenantRelay::builder(Recorder::default())
        .database(db.pool.clone())
        .rounds_in_flight(50)
        .build()
        .unwrap_err();
    assert!(matches!(e, pgbox::Error::InvalidConfig(_)), "{e:?}");
    let e = TenantRelay::builder(Recorder::default())
        .database(db.pool.clone())
        .discover_interval(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(matches!(e, pgbox::Error::InvalidConfig(_)), "{e:?}");
}

/// Rounds run so far for the tenants of `tenants` (all tenants but these when `except`).
fn rounds_of(relay: &TenantRelay<Recorder>, tenants: &[&str], except: bool) -> u64 {
    relay
        .status()
        .iter()
        .filter(|s| tenants.contains(&s.schema.as_str()) != except)
        .map(|s| s.rounds)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tenants_get_no_round_and_a_quiet_one_does_not_wait_behind_them() {
    support::init_tracing();
    let db = TestDb::empty().await;
    const IDLE: usize = 100;
    let mut migrations = tokio::task::JoinSet::new();
    for s in 0..IDLE {
        let pool = db.pool.clone();
        migrations.spawn(async move { migrate_schema(&pool, &format!("tenant_{s:03}")).await });
        if migrations.len() >= 4 {
            migrations.join_next().await.unwrap().unwrap();
        }
    }
    migrations.join_all().await;
    // Named to sort after the idle ones: the order discovery lists them in.
    for s in ["tenant_x_busy", "tenant_x_quiet"] {
        migrate_schema(&db.pool, s).await;
    }
    sqlx::query(
        "INSERT INTO tenant_x_busy.outbox (message_id, topic, payload, content_type) \
         SELECT gen_random_uuid(), 'bulk', convert_to(g::text, 'UTF8'), 'text/plain' \
         FROM generate_series(1, 100000) AS g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    enqueue(&db.pool, "tenant_x_quiet", 1, 1).await;
    let recorder = Recorder::default();
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(db.pool.clone())
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let busy = format!("{}/tenant_x_busy", db.name);
    let quiet = format!("{}/tenant_x_quiet", db.name);
    let named = ["tenant_x_busy", "tenant_x_quiet"];
    wait_until("every tenant found", || relay.status().len() == IDLE + 2).await;
    // The quiet tenant's messages, one at a time: how many rounds of the other tenants ran
    // between its commit and its publish.
    let mut waited_rounds = Vec::new();
    wait_until("the quiet tenant's first message", || {
        recorder.count_of(&quiet) == 1
    })
    .await;
    waited_rounds.push(rounds_of(&relay, &["tenant_x_quiet"], true));
    for i in 1..30 {
        let before = rounds_of(&relay, &["tenant_x_quiet"], true);
        enqueue_from(&db.pool, "tenant_x_quiet", i, 1, 1).await;
        wait_until("a quiet message", || recorder.count_of(&quiet) == i + 1).await;
        waited_rounds.push(rounds_of(&relay, &["tenant_x_quiet"], true) - before);
    }
    wait_until("every tenant asleep", || {
        relay.status().iter().filter(|s| s.asleep).count() >= IDLE
    })
    .await;
    let busy_then = recorder.count_of(&busy);
    let idle_rounds = rounds_of(&relay, &named, true);
    shutdown.cancel();
    task.await.unwrap().unwrap();
    eprintln!("rounds of other tenants while each quiet message waited: {waited_rounds:?}");
    // Before, every tenant got a round when found and another once asleep (its final look):
    // 200 rounds of idle tenants queued ahead of the quiet tenant's every round at start.
    assert_eq!(
        idle_rounds, 0,
        "tenants with nothing to do ran {idle_rounds} rounds"
    );
    let worst = *waited_rounds.iter().max().unwrap();
    assert!(
        worst <= 40,
        "a quiet message waited {worst} rounds of other tenants (all: {waited_rounds:?})"
    );
    assert!(
        busy_then < 100_000,
        "the backlog drained first: {busy_then}"
    );
}

/// Starts a relay over `db` (idle poll 200 ms, no rediscovery during the test) and waits
/// until its `n` tenants are asleep.
async fn idle_relay(
    db: &TestDb,
    n: usize,
) -> (
    Arc<TenantRelay<Recorder>>,
    Recorder,
    CancellationToken,
    tokio::task::JoinHandle<pgbox::Result<()>>,
) {
    let recorder = Recorder::default();
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(db.pool.clone())
            .discover_interval(Duration::from_secs(60))
            .idle_poll_interval(Duration::from_millis(200))
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    wait_until("every tenant asleep", || {
        let s = relay.status();
        s.len() == n && s.iter().all(|t| t.asleep)
    })
    .await;
    (relay, recorder, shutdown, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_listener_costs_idle_tenants_no_round_and_they_fall_asleep_again() {
    support::init_tracing();
    let db = TestDb::empty().await;
    const N: usize = 20;
    for s in 0..N {
        migrate_schema(&db.pool, &format!("lost_{s:02}")).await;
    }
    let (relay, recorder, shutdown, task) = idle_relay(&db, N).await;
    let before = rounds_of(&relay, &[], true);
    // The listener is the session holding the tenants' asleep locks.
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM \
           (SELECT DISTINCT l.pid FROM pg_locks AS l JOIN pg_database AS d ON d.oid = l.database \
            WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database() \
              AND l.pid <> pg_backend_pid()) AS h",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "the listener's session was not found");
    wait_until("the listener lost", || {
        relay.status().iter().any(|t| !t.asleep)
    })
    .await;
    wait_until("every tenant asleep again", || {
        relay.status().iter().all(|t| t.asleep)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_rounds = rounds_of(&relay, &[], true) - before;
    // Still woken by its producers once asleep again.
    enqueue(&db.pool, "lost_07", 1, 1).await;
    let tenant = format!("{}/lost_07", db.name);
    wait_until("the message after the loss", || {
        recorder.count_of(&tenant) == 1
    })
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    // Before, the loss queued a round for every tenant of the database.
    assert_eq!(
        before, 0,
        "idle tenants ran rounds before the listener was lost"
    );
    assert_eq!(
        idle_rounds, 0,
        "idle tenants ran {idle_rounds} rounds after the listener was lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_probe_gives_a_round_only_to_the_tenant_it_failed_on() {
    support::init_tracing();
    let db = TestDb::empty().await;
    const N: usize = 10;
    for s in 0..N {
        migrate_schema(&db.pool, &format!("probe_{s:02}")).await;
    }
    let (relay, _recorder, shutdown, task) = idle_relay(&db, N).await;
    let before = rounds_of(&relay, &["probe_03"], true);
    // The probe's statement names every tenant's outbox: it fails for all of them.
    sqlx::query("ALTER TABLE probe_03.outbox RENAME TO outbox_gone")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_until("the tenant without an outbox broken", || {
        relay
            .status()
            .iter()
            .any(|t| t.schema == "probe_03" && t.health != TenantHealth::Healthy)
    })
    .await;
    // A few idle polls more.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let others = rounds_of(&relay, &["probe_03"], true) - before;
    let healthy = relay
        .status()
        .iter()
        .filter(|t| t.health == TenantHealth::Healthy)
        .count();
    shutdown.cancel();
    task.await.unwrap().unwrap();
    sqlx::query("ALTER TABLE probe_03.outbox_gone RENAME TO outbox")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        healthy,
        N - 1,
        "only the tenant without an outbox is broken"
    );
    // Before, a failed probe gave every tenant it asked about a round.
    assert_eq!(
        others, 0,
        "tenants whose probe did not fail ran {others} rounds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_busy_tenants_on_one_slot_take_turns_round_by_round() {
    support::init_tracing();
    let db = TestDb::empty().await;
    const BACKLOG: usize = 1_000;
    const BATCH: usize = 50;
    for s in ["tenant_a", "tenant_b"] {
        migrate_schema(&db.pool, s).await;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.outbox (message_id, topic, payload, content_type) \
             SELECT gen_random_uuid(), 'bulk', convert_to(g::text, 'UTF8'), 'text/plain' \
             FROM generate_series(1, {BACKLOG}) AS g"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // One slot: a tenant whose turn went on while the other waited would publish its whole
    // backlog in one run.
    let recorder = Recorder::slow(Duration::from_millis(2));
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(db.pool.clone())
            .rounds_in_flight(1)
            .batch_size(BATCH)
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    wait_until("both backlogs published", || {
        recorder.seen().len() >= 2 * BACKLOG
    })
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    let seen = recorder.seen();
    assert_eq!(seen.len(), 2 * BACKLOG, "a message published twice");
    // Runs of messages of one tenant, in publish order; the last one may hold the rest of
    // one backlog once the other is done.
    let mut runs: Vec<(String, usize)> = Vec::new();
    for e in &seen {
        let tenant = e.headers.get(TENANT_HEADER).cloned().unwrap_or_default();
        match runs.last_mut() {
            Some((t, n)) if *t == tenant => *n += 1,
            _ => runs.push((tenant, 1)),
        }
    }
    let longest = runs[..runs.len() - 1]
        .iter()
        .map(|(_, n)| *n)
        .max()
        .unwrap_or(0);
    // One round each in turn; two when the other tenant fell due just after the busy one
    // looked whether anyone waited.
    assert!(
        longest <= 2 * BATCH,
        "one tenant published {longest} messages in a row while the other waited for the slot \
         (runs: {:?})",
        runs.iter().map(|(_, n)| n).collect::<Vec<_>>()
    );
    assert!(runs.len() >= 10, "the tenants did not take turns: {runs:?}");
}
