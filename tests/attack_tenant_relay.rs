//! Attacks on the tenant relay (`TenantRelay`): database outages while others flow, tenants
//! dropped and re-made mid-round, several relays on the same tenants, the wake-up path with
//! the idle poll pushed out of reach, the tenant header, hostile database names.
//!
//! The promise (rustdoc of `TenantRelay` and its builder), written down before the attack:
//! - tenants are the pgbox schemas matching a list/pattern in given or discovered databases,
//!   listed again every `discover_interval`: new ones served, dropped ones let go;
//! - rounds are exactly a `Relay`'s: per-key order, retries, dead letters; several tenant
//!   relays (or plain relays) may serve the same tenants at once;
//! - fair: at most `rounds_in_flight` rounds, one per tenant, round-robin;
//! - a broken tenant (database away, tables dropped) is reported, retried with a backoff,
//!   the others flow;
//! - every message carries `pgbox-tenant: <database>/<schema>`, replacing the producer's;
//! - a producer committing while its tenant sleeps notifies: no committed message waits for
//!   the idle poll.

mod support;

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbox::transport::{PublishError, Publisher};
use pgbox::{
    CancellationToken, Envelope, Message, Migrator, Outbox, Relay, TENANT_HEADER, TenantHealth,
    TenantRelay,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

/// Records every envelope it is given (duplicates included).
#[derive(Debug, Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Envelope>>>,
    delay: Duration,
}

impl Recorder {
    fn seen(&self) -> Vec<Envelope> {
        self.seen.lock().unwrap().clone()
    }

    fn distinct(&self) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|e| e.id)
            .collect::<HashSet<_>>()
            .len()
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

async fn migrate_schema(pool: &PgPool, schema: &str) {
    let sql = Migrator::new().schema(schema).unwrap().to_sql();
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(pool)
        .await
        .expect("migrate schema");
}

/// Enqueues messages `from..from + n` into `schema`, one transaction, payload
/// `<schema>:<i>`, keyed over `keys` keys.
async fn enqueue(pool: &PgPool, schema: &str, from: usize, n: usize, keys: usize) {
    let outbox = Outbox::with_schema(schema).unwrap();
    let mut tx = pool.begin().await.unwrap();
    for i in from..from + n {
        let message = Message::bytes("events", format!("{schema}:{i}").into_bytes())
            .ordering_key(format!("key-{}", i % keys));
        outbox.enqueue(&mut tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// (schema, index) from a payload `<schema>:<i>`.
fn parse(e: &Envelope) -> (String, usize) {
    let text = String::from_utf8(e.payload.clone()).unwrap();
    let (schema, i) = text.rsplit_once(':').unwrap();
    (schema.to_owned(), i.parse().unwrap())
}

/// Checks: every expected (schema, i) published at least once; the first publications of
/// each (schema, key) in enqueue order; returns the number of doubles.
fn check(seen: &[Envelope], expected: &HashMap<String, usize>) -> usize {
    let mut first: HashSet<uuid::Uuid> = HashSet::new();
    let mut doubles = 0;
    let mut last: HashMap<(String, String), usize> = HashMap::new();
    let mut got: HashMap<String, HashSet<usize>> = HashMap::new();
    for e in seen {
        if !first.insert(e.id) {
            doubles += 1;
            continue;
        }
        let (schema, i) = parse(e);
        got.entry(schema.clone()).or_default().insert(i);
        let key = (schema, e.ordering_key.clone().unwrap_or_default());
        if let Some(before) = last.insert(key.clone(), i) {
            assert!(before < i, "{key:?}: {i} first published after {before}");
        }
    }
    for (schema, n) in expected {
        let got = got.get(schema).map(HashSet::len).unwrap_or(0);
        assert_eq!(got, *n, "{schema}: {got} of {n} published");
    }
    doubles
}

/// Databases created by this test, dropped (WITH FORCE) at the end.
struct OwnDatabases {
    server: String,
    names: Vec<String>,
    pools: Vec<PgPool>,
}

impl OwnDatabases {
    async fn create(names: &[String]) -> Self {
        let server = support::server_url().await;
        let mut admin = PgConnection::connect(&server).await.unwrap();
        let mut pools = Vec::new();
        for name in names {
            let quoted = name.replace('"', "\"\"");
            admin
                .execute(AssertSqlSafe(format!(
                    "CREATE DATABASE \"{quoted}\" TEMPLATE template0"
                )))
                .await
                .unwrap();
            let options = PgConnectOptions::from_str(&server).unwrap().database(name);
            pools.push(
                PgPoolOptions::new()
                    .max_connections(8)
                    .connect_with(options)
                    .await
                    .unwrap(),
            );
        }
        admin.close().await.ok();
        OwnDatabases {
            server,
            names: names.to_vec(),
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
                        let quoted = name.replace('"', "\"\"");
                        let _ = admin
                            .execute(AssertSqlSafe(format!(
                                "DROP DATABASE IF EXISTS \"{quoted}\" WITH (FORCE)"
                            )))
                            .await;
                    }
                }
            });
        })
        .join();
    }
}

async fn wait_until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    for _ in 0..secs * 20 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("waited {secs} s for {what}");
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::now_v7().simple().to_string()[20..]
    )
}

/// Terminates every other backend of database `name`.
async fn terminate(admin: &PgPool, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(name)
    .fetch_one(admin)
    .await
    .unwrap_or(0)
}

/// A tenant database's connections are terminated again and again while its keyed backlog
/// drains and another database's tenants take new messages: nothing lost, first
/// publications in key order, the other database flows meanwhile, and once the terminations
/// stop the hit database drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_a_database_away_again_and_again_loses_nothing_and_keeps_key_order() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_out");
    let names = vec![format!("{prefix}_hit"), format!("{prefix}_calm")];
    let dbs = OwnDatabases::create(&names).await;
    let mut expected = HashMap::new();
    for (d, pool) in dbs.pools.iter().enumerate() {
        for s in 0..3 {
            let schema = format!("t{d}_{s}");
            migrate_schema(pool, &schema).await;
            enqueue(pool, &schema, 0, 400, 7).await;
            expected.insert(schema, 400);
        }
    }
    let server = PgPool::connect(&support::server_url().await).await.unwrap();
    let recorder = Recorder {
        delay: Duration::from_millis(3),
        ..Recorder::default()
    };
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .discover_databases(server.clone(), format!("{prefix}_%"))
            .discover_interval(Duration::from_millis(200))
            .idle_poll_interval(Duration::from_millis(200))
            .batch_size(20)
            .rounds_in_flight(2)
            .build()
            .unwrap(),
    );
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    // The hit database away, again and again, for ~4 s; the calm one takes new messages.
    let mut killed = 0;
    for round in 0..20 {
        killed += terminate(&server, &names[0]).await;
        enqueue(&dbs.pools[1], "t1_0", 400 + round * 10, 10, 7).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    *expected.get_mut("t1_0").unwrap() += 200;
    let calm_during: usize = recorder
        .seen()
        .iter()
        .filter(|e| parse(e).0.starts_with("t1_"))
        .count();
    assert!(
        calm_during >= 1400,
        "the calm database stalled: {calm_during} of 1400"
    );
    let total: usize = expected.values().sum();
    wait_until("every message published", 50, || {
        recorder.distinct() >= total
    })
    .await;
    stop.cancel();
    run.await.unwrap().unwrap();
    let doubles = check(&recorder.seen(), &expected);
    eprintln!("terminated {killed} backends; {doubles} doubles (rounds that did not commit)");
}

/// Two tenant relays and a plain relay serve the same tenants at once, while producers keep
/// enqueueing: every message published, no double (every round commits), first
/// publications in key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_two_tenant_relays_and_a_plain_relay_on_the_same_tenants() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_two");
    let names = vec![format!("{prefix}_0")];
    let dbs = OwnDatabases::create(&names).await;
    let pool = dbs.pools[0].clone();
    let mut expected = HashMap::new();
    for s in 0..4 {
        let schema = format!("t_{s}");
        migrate_schema(&pool, &schema).await;
        enqueue(&pool, &schema, 0, 300, 5).await;
        expected.insert(schema, 300);
    }
    let recorder = Recorder::default();
    let stop = CancellationToken::new();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let relay = TenantRelay::builder(recorder.clone())
            .database(pool.clone())
            .schema_pattern("t\\_%")
            .discover_interval(Duration::from_millis(300))
            .idle_poll_interval(Duration::from_millis(300))
            .batch_size(25)
            .rounds_in_flight(2)
            .build()
            .unwrap();
        let stop = stop.clone();
        runs.push(tokio::spawn(async move { relay.run(stop).await }));
    }
    let plain = Relay::builder(pool.clone(), recorder.clone())
        .schema("t_0")
        .batch_size(25)
        .build()
        .unwrap();
    let plain_run = tokio::spawn({
        let stop = stop.clone();
        async move { plain.run(stop).await }
    });
    for round in 0..20 {
        for s in 0..4 {
            enqueue(&pool, &format!("t_{s}"), 300 + round * 5, 5, 5).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for n in expected.values_mut() {
        *n += 100;
    }
    let total: usize = expected.values().sum();
    wait_until("every message published", 40, || {
        recorder.distinct() >= total
    })
    .await;
    stop.cancel();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    plain_run.await.unwrap().unwrap();
    let doubles = check(&recorder.seen(), &expected);
    assert_eq!(doubles, 0, "published twice although every round committed");
}

/// With the idle poll out of reach (10 min), producers commit while their tenants fall
/// asleep and wake: every message must still be published, by a notification or the final
/// look under the lock, never by the idle poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_no_wake_up_lost_while_tenants_fall_asleep() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_wake");
    let names = vec![format!("{prefix}_0")];
    let dbs = OwnDatabases::create(&names).await;
    let pool = dbs.pools[0].clone();
    for s in 0..4 {
        migrate_schema(&pool, &format!("w_{s}")).await;
    }
    let recorder = Recorder::default();
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(pool.clone())
            .discover_interval(Duration::from_millis(500))
            .idle_poll_interval(Duration::from_secs(600))
            .rounds_in_flight(2)
            .build()
            .unwrap(),
    );
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    wait_until("tenants served and asleep", 20, || {
        let s = relay.status();
        s.len() == 4 && s.iter().all(|t| t.asleep)
    })
    .await;
    // Producers at staggered, varied gaps: some commit while the tenant sleeps, some while
    // its round runs, some while it is falling asleep again.
    let mut producers = Vec::new();
    for p in 0..8usize {
        let pool = pool.clone();
        producers.push(tokio::spawn(async move {
            let schema = format!("w_{}", p % 4);
            for i in 0..15usize {
                enqueue(&pool, &schema, (p / 4) * 1000 + i, 1, 1000).await;
                let gap = ((p * 7 + i * 13) % 40) as u64;
                tokio::time::sleep(Duration::from_millis(gap)).await;
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    let total = 120;
    let mut waited = 0;
    while recorder.distinct() < total && waited < 600 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
    }
    stop.cancel();
    run.await.unwrap().unwrap();
    let seen = recorder.seen();
    let got: HashSet<(String, usize)> = seen.iter().map(parse).collect();
    let mut missing = Vec::new();
    for p in 0..8usize {
        for i in 0..15usize {
            let id = (format!("w_{}", p % 4), (p / 4) * 1000 + i);
            if !got.contains(&id) {
                missing.push(id);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "30 s after the producers, {} messages still wait for the idle poll: {missing:?}",
        missing.len()
    );
    let ids: HashSet<uuid::Uuid> = seen.iter().map(|e| e.id).collect();
    assert_eq!(
        ids.len(),
        seen.len(),
        "published twice although every round committed"
    );
}

/// A tenant's schema dropped (CASCADE) while its backlog drains, then made again at once
/// under the same name with new messages: the new messages are all published, once, and
/// the tenant is healthy again; the other tenant is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_a_schema_dropped_mid_round_and_made_again_under_the_same_name() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_drop");
    let names = vec![format!("{prefix}_0")];
    let dbs = OwnDatabases::create(&names).await;
    let pool = dbs.pools[0].clone();
    migrate_schema(&pool, "gone").await;
    migrate_schema(&pool, "stays").await;
    enqueue(&pool, "gone", 0, 2000, 3).await;
    enqueue(&pool, "stays", 0, 200, 3).await;
    let recorder = Recorder {
        delay: Duration::from_millis(20),
        ..Recorder::default()
    };
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .database(pool.clone())
            .discover_interval(Duration::from_millis(300))
            .idle_poll_interval(Duration::from_millis(300))
            .batch_size(20)
            .rounds_in_flight(2)
            .build()
            .unwrap(),
    );
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    wait_until("a part of the backlog", 20, || {
        recorder
            .seen()
            .iter()
            .filter(|e| parse(e).0 == "gone")
            .count()
            >= 100
    })
    .await;
    pool.execute("DROP SCHEMA gone CASCADE").await.unwrap();
    migrate_schema(&pool, "gone").await;
    enqueue(&pool, "gone", 10_000, 50, 3).await;
    wait_until("the re-made schema's messages", 40, || {
        let got: HashSet<usize> = recorder
            .seen()
            .iter()
            .map(parse)
            .filter(|(s, i)| s == "gone" && *i >= 10_000)
            .map(|(_, i)| i)
            .collect();
        got.len() == 50
    })
    .await;
    wait_until("the tenant healthy", 20, || {
        relay
            .status()
            .iter()
            .any(|t| t.schema == "gone" && t.health == TenantHealth::Healthy)
    })
    .await;
    stop.cancel();
    run.await.unwrap().unwrap();
    let seen = recorder.seen();
    let new: Vec<uuid::Uuid> = seen
        .iter()
        .filter(|e| {
            let (s, i) = parse(e);
            s == "gone" && i >= 10_000
        })
        .map(|e| e.id)
        .collect();
    assert_eq!(
        new.len(),
        50,
        "the re-made schema's messages published twice"
    );
    let stays: HashSet<usize> = seen
        .iter()
        .map(parse)
        .filter(|(s, _)| s == "stays")
        .map(|(_, i)| i)
        .collect();
    assert_eq!(stays.len(), 200);
}

/// A producer's own tenant header, in any case, does not reach the consumer beside the
/// relay's: a consumer matching header names without case (HTTP, CloudEvents bindings)
/// would read the forged one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_1_a_producers_tenant_header_in_another_case_survives() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_hdr");
    let names = vec![format!("{prefix}_0")];
    let dbs = OwnDatabases::create(&names).await;
    let pool = dbs.pools[0].clone();
    migrate_schema(&pool, "acme").await;
    let outbox = Outbox::with_schema("acme").unwrap();
    let mut tx = pool.begin().await.unwrap();
    for forged in ["pgbox-tenant", "Pgbox-Tenant", "PGBOX-TENANT"] {
        let message =
            Message::bytes("events", b"acme:0".to_vec()).header(forged, "other_db/victim");
        outbox.enqueue(&mut tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let recorder = Recorder::default();
    let relay = TenantRelay::builder(recorder.clone())
        .database(pool.clone())
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 3);
    let real = format!("{}/acme", names[0]);
    for e in recorder.seen() {
        let tenant: Vec<(&String, &String)> = e
            .headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(TENANT_HEADER))
            .collect();
        assert_eq!(
            tenant,
            vec![(&TENANT_HEADER.to_owned(), &real)],
            "a forged tenant header reaches the consumer"
        );
    }
}

/// Databases with hostile names (uppercase, quotes, spaces, 63 bytes) matching the pattern
/// are served: their tenants' messages published with the right header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_hostile_database_names() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_nm");
    let mut long = format!("{prefix}_L");
    while long.len() < 63 {
        long.push('x');
    }
    let names = vec![
        format!("{prefix}_Upper \"Quo'te\""),
        long,
        format!("{prefix}_%_lit\\"),
    ];
    let dbs = OwnDatabases::create(&names).await;
    for pool in &dbs.pools {
        migrate_schema(pool, "acme").await;
        enqueue(pool, "acme", 0, 10, 2).await;
    }
    let server = PgPool::connect(&support::server_url().await).await.unwrap();
    let recorder = Recorder::default();
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .discover_databases(server, format!("{prefix}\\_%"))
            .discover_interval(Duration::from_millis(300))
            .idle_poll_interval(Duration::from_millis(300))
            .rounds_in_flight(2)
            .build()
            .unwrap(),
    );
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    wait_until("every database's messages", 30, || {
        recorder.distinct() >= 30
    })
    .await;
    // Asleep: the listener of each database works.
    wait_until("every tenant asleep", 20, || {
        let s = relay.status();
        s.len() == 3 && s.iter().all(|t| t.asleep)
    })
    .await;
    for pool in &dbs.pools {
        enqueue(pool, "acme", 100, 1, 1).await;
    }
    wait_until("woken by notifications", 20, || recorder.distinct() >= 33).await;
    stop.cancel();
    run.await.unwrap().unwrap();
    for name in &names {
        let header = format!("{name}/acme");
        let n = recorder
            .seen()
            .iter()
            .filter(|e| e.headers.get(TENANT_HEADER) == Some(&header))
            .count();
        assert_eq!(n, 11, "{name}");
    }
}

const CHILD_ENV: &str = "PGBOX_ATK_TENANT_CHILD";

/// The relay process of `holds_sigkill_of_a_tenant_relay_process`: serves every tenant of
/// the databases `<prefix>_%` into the queue of the hub database, for at most 60 s. A no-op
/// in a normal run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_tenant_relay() {
    let Ok(args) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut args = args.split(' ');
    let (server, hub, prefix) = (
        args.next().unwrap().to_owned(),
        args.next().unwrap().to_owned(),
        args.next().unwrap().to_owned(),
    );
    let server = PgPool::connect(&server).await.unwrap();
    let hub = PgPool::connect(&hub).await.unwrap();
    let relay = TenantRelay::builder(pgbox::transport::PgQueue::new(hub))
        .discover_databases(server, format!("{prefix}\\_%"))
        .discover_interval(Duration::from_millis(200))
        .idle_poll_interval(Duration::from_millis(200))
        .batch_size(30)
        .rounds_in_flight(3)
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let _ = tokio::time::timeout(Duration::from_secs(60), relay.run(stop)).await;
}

/// A process running a tenant relay over six tenants in two databases (keyed backlogs),
/// publishing into the queue of another database, is SIGKILLed twice mid-flow, then a new
/// relay drains: every message in the queue, the first copies in key order per tenant, and
/// doubles only from rounds cut before their commit (an inbox absorbs them by message id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_sigkill_of_a_tenant_relay_process() {
    support::init_tracing();
    let hub = support::TestDb::migrated().await;
    let prefix = unique("pgbox_atk_kill");
    let names = vec![format!("{prefix}_0"), format!("{prefix}_1")];
    let dbs = OwnDatabases::create(&names).await;
    let mut expected: HashMap<String, usize> = HashMap::new();
    for (d, pool) in dbs.pools.iter().enumerate() {
        for s in 0..3 {
            let schema = format!("k{d}_{s}");
            migrate_schema(pool, &schema).await;
            for part in 0..3 {
                enqueue(pool, &schema, part * 300, 300, 6).await;
            }
            expected.insert(format!("{}/{schema}", names[d]), 900);
        }
    }
    let total: i64 = expected.values().sum::<usize>() as i64;
    let server_url = support::server_url().await;
    let queued = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pgbox.queue")
            .fetch_one(&hub.pool)
            .await
            .unwrap()
    };
    let mut kills = Vec::new();
    for k in 0..2 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_tenant_relay",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ENV, format!("{server_url} {} {prefix}", hub.url()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let before = queued().await;
        let target = before + total / 5;
        for _ in 0..600 {
            if queued().await >= target {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        child.kill().unwrap();
        child.wait().unwrap();
        kills.push(queued().await);
        assert!(kills[k] < total, "killed only after everything moved");
    }
    // Sessions of the killed process may linger a moment: the drain waits for their locks.
    let relay = TenantRelay::builder(pgbox::transport::PgQueue::new(hub.pool.clone()))
        .discover_databases(
            PgPool::connect(&server_url).await.unwrap(),
            format!("{prefix}\\_%"),
        )
        .batch_size(50)
        .rounds_in_flight(2)
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.tenants, 6);
    assert_eq!(report.broken, 0);
    let rows: Vec<(uuid::Uuid, String, String, Option<String>)> = sqlx::query_as(
        "SELECT message_id, ordering_key, convert_from(payload, 'UTF8'), headers->>'pgbox-tenant' \
         FROM pgbox.queue ORDER BY seq",
    )
    .fetch_all(&hub.pool)
    .await
    .unwrap();
    let mut ids = HashSet::new();
    let mut doubles = 0;
    let mut last: HashMap<(String, String), usize> = HashMap::new();
    let mut per_tenant: HashMap<String, usize> = HashMap::new();
    for (id, key, payload, tenant) in &rows {
        if !ids.insert(*id) {
            doubles += 1;
            continue;
        }
        let tenant = tenant.clone().expect("tenant header");
        let n: usize = payload.rsplit_once(':').unwrap().1.parse().unwrap();
        *per_tenant.entry(tenant.clone()).or_default() += 1;
        if let Some(before) = last.insert((tenant.clone(), key.clone()), n) {
            assert!(
                before < n,
                "{tenant} {key}: {n} first queued after {before}"
            );
        }
    }
    assert_eq!(per_tenant, expected);
    let mut left = 0i64;
    for (d, pool) in dbs.pools.iter().enumerate() {
        for s in 0..3 {
            {
                let sql =
                    format!("SELECT count(*) FROM k{d}_{s}.outbox WHERE published_at IS NULL");
                left += sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
                    .fetch_one(pool)
                    .await
                    .unwrap();
            }
        }
    }
    assert_eq!(left, 0, "messages left unpublished");
    eprintln!("killed at {kills:?} of {total} queued; {doubles} doubles");
}

/// Fails every publish of topic `fail`, hangs on topic `hang`, publishes the rest.
#[derive(Debug, Clone, Default)]
struct Picky {
    ok: Recorder,
}

impl Publisher for Picky {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        if batch.iter().any(|e| e.topic == "hang") {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        let mut out = Vec::new();
        for e in batch {
            if e.topic == "fail" {
                out.push(Err(PublishError::refused("topic refuses everything")));
            } else {
                self.ok.seen.lock().unwrap().push(e.clone());
                out.push(Ok(()));
            }
        }
        out
    }
}

/// One tenant's topic fails every publish, another's hangs: with two rounds in flight the
/// other tenants' messages all flow, the failing tenant's are dead-lettered after their
/// attempts, the hanging tenant's stay in its outbox (never dead-lettered by timeouts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_a_publisher_failing_or_hanging_for_one_tenants_topic() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_pub");
    let names = vec![format!("{prefix}_0")];
    let dbs = OwnDatabases::create(&names).await;
    let pool = dbs.pools[0].clone();
    let outbox_of = |s: &str| Outbox::with_schema(s).unwrap();
    for (schema, topic) in [("fails", "fail"), ("hangs", "hang")] {
        migrate_schema(&pool, schema).await;
        let mut tx = pool.begin().await.unwrap();
        for i in 0..20 {
            let m = Message::bytes(topic, format!("{schema}:{i}").into_bytes());
            outbox_of(schema).enqueue(&mut tx, m).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let mut expected = HashMap::new();
    for s in 0..4 {
        let schema = format!("fine_{s}");
        migrate_schema(&pool, &schema).await;
        enqueue(&pool, &schema, 0, 100, 3).await;
        expected.insert(schema, 100);
    }
    let picky = Picky::default();
    let relay = Arc::new(
        TenantRelay::builder(picky.clone())
            .database(pool.clone())
            .discover_interval(Duration::from_millis(300))
            .idle_poll_interval(Duration::from_millis(300))
            .batch_size(10)
            .rounds_in_flight(2)
            .max_attempts(2)
            .backoff(
                pgbox::RetryPolicy::new()
                    .base_delay(Duration::from_millis(10))
                    .max_delay(Duration::from_millis(20)),
            )
            .publish_timeout(Duration::from_millis(500))
            .build()
            .unwrap(),
    );
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    wait_until("the fine tenants' messages", 40, || {
        picky.ok.distinct() >= 400
    })
    .await;
    let dead = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM fails.outbox_dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    for _ in 0..400 {
        if dead().await == 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), run).await;
    assert_eq!(check(&picky.ok.seen(), &expected), 0);
    assert_eq!(
        dead().await,
        20,
        "the failing topic's messages dead-lettered"
    );
    let hang_dead: i64 = sqlx::query_scalar("SELECT count(*) FROM hangs.outbox_dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    let hang_left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM hangs.outbox WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    eprintln!("hanging topic: {hang_dead} dead-lettered, {hang_left} left in the outbox");
}

const GAUGE_CHILD_ENV: &str = "PGBOX_ATK_TENANT_GAUGE_CHILD";

/// The process of `finding_2_two_relays_in_a_process_overwrite_the_tenants_gauge`: its own
/// metrics recorder, two tenant relays (three tenants and one), both drained; the
/// `pgbox_tenant_relay_tenants{state="healthy"}` gauge must show the four tenants served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_two_relays_gauge() {
    let Ok(url) = std::env::var(GAUGE_CHILD_ENV) else {
        return;
    };
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    let a = TenantRelay::builder(Recorder::default())
        .database(pool.clone())
        .schemas(["g_0", "g_1", "g_2"])
        .build()
        .unwrap();
    let b = TenantRelay::builder(Recorder::default())
        .database(pool.clone())
        .schemas(["g_3"])
        .build()
        .unwrap();
    assert_eq!(a.drain().await.unwrap().tenants, 3);
    assert_eq!(b.drain().await.unwrap().tenants, 1);
    let healthy = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find_map(|(key, _, _, value)| {
            let key = key.key();
            let healthy = key.name() == pgbox::telemetry::TENANT_RELAY_TENANTS
                && key.labels().any(|l| l.value() == "healthy");
            match (healthy, value) {
                (true, metrics_util::debugging::DebugValue::Gauge(g)) => Some(g.into_inner()),
                _ => None,
            }
        })
        .expect("the tenants gauge");
    assert_eq!(healthy, 4.0, "healthy tenants served in this process");
}

/// Two tenant relays in one process (say one per region): each sets the process-wide
/// `pgbox_tenant_relay_tenants` gauge to its own count, so the last one to finish a round
/// wins and the gauge shows 1 of the 4 tenants served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_2_two_relays_in_a_process_overwrite_the_tenants_gauge() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_gauge");
    let names = vec![format!("{prefix}_0")];
    let dbs = OwnDatabases::create(&names).await;
    for s in 0..4 {
        migrate_schema(&dbs.pools[0], &format!("g_{s}")).await;
    }
    let server = support::server_url().await;
    let url = PgConnectOptions::from_str(&server)
        .unwrap()
        .database(&names[0]);
    let url = format!(
        "postgres://{}@{}:{}/{}",
        url.get_username(),
        url.get_host(),
        url.get_port(),
        names[0]
    );
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_two_relays_gauge",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(GAUGE_CHILD_ENV, url)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "the child failed:\n{}",
        text.lines()
            .filter(|l| l.contains("assert") || l.contains("left") || l.contains("right"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A served database dropped WITH (FORCE) while its backlog drains: its tenants are let go,
/// the other database flows on, and a database made again under the same name is served
/// from scratch (its new messages all published once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_a_database_dropped_with_force_while_served_and_made_again() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_dropdb");
    let names = vec![format!("{prefix}_0"), format!("{prefix}_1")];
    let dbs = OwnDatabases::create(&names).await;
    for pool in &dbs.pools {
        migrate_schema(pool, "acme").await;
        enqueue(pool, "acme", 0, 1000, 3).await;
    }
    let server = PgPool::connect(&support::server_url().await).await.unwrap();
    let recorder = Recorder {
        delay: Duration::from_millis(10),
        ..Recorder::default()
    };
    let relay = Arc::new(
        TenantRelay::builder(recorder.clone())
            .discover_databases(server.clone(), format!("{prefix}\\_%"))
            .discover_interval(Duration::from_millis(200))
            .idle_poll_interval(Duration::from_millis(200))
            .batch_size(20)
            .rounds_in_flight(2)
            .build()
            .unwrap(),
    );
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    let hdr = |i: usize| format!("{}/acme", names[i]);
    let of = |r: &Recorder, h: &str| {
        r.seen()
            .iter()
            .filter(|e| e.headers.get(TENANT_HEADER).map(String::as_str) == Some(h))
            .map(|e| e.id)
            .collect::<HashSet<_>>()
            .len()
    };
    wait_until("a part of database 1's backlog", 20, || {
        of(&recorder, &hdr(1)) >= 100
    })
    .await;
    dbs.pools[1].close().await;
    let quoted = names[1].replace('"', "\"\"");
    server
        .execute(AssertSqlSafe(format!(
            "DROP DATABASE \"{quoted}\" WITH (FORCE)"
        )))
        .await
        .unwrap();
    wait_until("database 1 let go", 20, || {
        relay.status().iter().all(|t| t.database != names[1])
    })
    .await;
    server
        .execute(AssertSqlSafe(format!(
            "CREATE DATABASE \"{quoted}\" TEMPLATE template0"
        )))
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&support::server_url().await)
        .unwrap()
        .database(&names[1]);
    let again = PgPool::connect_with(options).await.unwrap();
    migrate_schema(&again, "acme").await;
    enqueue(&again, "acme", 50_000, 30, 3).await;
    wait_until("the new database's messages", 30, || {
        recorder
            .seen()
            .iter()
            .filter(|e| parse(e).1 >= 50_000)
            .map(|e| e.id)
            .collect::<HashSet<_>>()
            .len()
            == 30
    })
    .await;
    wait_until("database 0 drained", 40, || of(&recorder, &hdr(0)) == 1000).await;
    stop.cancel();
    run.await.unwrap().unwrap();
    again.close().await;
    let new = recorder
        .seen()
        .iter()
        .filter(|e| parse(e).1 >= 50_000)
        .count();
    assert_eq!(new, 30, "the new database's messages published twice");
}

/// Two tenant relays on the same idle tenants (the doc allows it, say for availability):
/// once both have drained, an idle tenant should cost no round. The second relay cannot take
/// the asleep locks the first holds, takes that for "a producer in flight" and runs a round
/// per idle tenant every idle poll interval, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_3_a_second_relay_runs_a_round_per_idle_tenant_every_idle_poll() {
    support::init_tracing();
    let prefix = unique("pgbox_atk_idle2");
    let names = vec![format!("{prefix}_0")];
    let dbs = OwnDatabases::create(&names).await;
    let pool = dbs.pools[0].clone();
    for s in 0..10 {
        migrate_schema(&pool, &format!("i_{s}")).await;
    }
    let stop = CancellationToken::new();
    let mut relays = Vec::new();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let relay = Arc::new(
            TenantRelay::builder(Recorder::default())
                .database(pool.clone())
                .discover_interval(Duration::from_secs(60))
                .idle_poll_interval(Duration::from_millis(200))
                .rounds_in_flight(2)
                .build()
                .unwrap(),
        );
        relays.push(relay.clone());
        let stop = stop.clone();
        runs.push(tokio::spawn(async move { relay.run(stop).await }));
    }
    // Settled: every tenant asleep in one relay or the other, and the awake polls' backoff
    // at its cap (the idle poll interval).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rounds = || -> u64 {
        relays
            .iter()
            .flat_map(|r| r.status())
            .map(|t| t.rounds)
            .sum()
    };
    let before = rounds();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first = rounds() - before;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = rounds();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let later = rounds() - before;
    eprintln!("idle rounds: {first} in a second, {later} in a second 3 s later");
    let idle_rounds = first + later;
    for (i, r) in relays.iter().enumerate() {
        let s = r.status();
        eprintln!(
            "relay {i}: {} asleep of {}, rounds {}",
            s.iter().filter(|t| t.asleep).count(),
            s.len(),
            s.iter().map(|t| t.rounds).sum::<u64>()
        );
    }
    stop.cancel();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    assert_eq!(
        idle_rounds, 0,
        "rounds run for 10 idle tenants in two seconds by two relays"
    );
}
