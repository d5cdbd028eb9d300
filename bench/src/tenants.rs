//! T: the tenant relay (`TenantRelay`), one process for many tenant schemas and databases.
//!
//! - T1: 1,000 schemas in 10 databases (100 in quick mode, 2 databases), all idle: the
//!   relay's CPU (this process, and its PostgreSQL backends, from /proc) over 10 s, its
//!   connections; then a new tenant created and migrated while it runs: from its first
//!   message's commit to its publication.
//! - T2: a quiet tenant's commit→publish latency (p50, p99) while another tenant drains a
//!   backlog of 1,000,000 rows (100,000 in quick mode) inserted with one statement.
//! - T3: one tenant's drain rate through the tenant relay vs a dedicated `Relay` (ratio).
//!
//! The databases are this run's own (`pgbox_bench_t_<id>_<i>`, copies of a template
//! `pgbox_bench_tt_<id>` holding the migrated schemas), dropped at the end.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{CancellationToken, Envelope, Message, Migrator, Outbox, Relay, TenantRelay};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

/// Counts what it publishes, and when each message of one topic was published.
#[derive(Default)]
struct Counting {
    published: AtomicU64,
    watched: Mutex<HashMap<uuid::Uuid, Instant>>,
}

#[derive(Clone, Default)]
struct Sink(Arc<Counting>);

impl Publisher for Sink {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.published.fetch_add(batch.len() as u64, Relaxed);
        let now = Instant::now();
        let mut watched = self.0.watched.lock().unwrap();
        for e in batch.iter().filter(|e| e.topic == "watched") {
            watched.insert(e.id, now);
        }
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

/// CPU seconds (user + system) of process `pid` ("self" for this one), from /proc.
fn cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces), from the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the ')'.
    (ticks(11) + ticks(12)) / 100.0
}

async fn backend_pids(pool: &PgPool, app: &str) -> anyhow::Result<Vec<i32>> {
    Ok(
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(app)
            .fetch_all(pool)
            .await?,
    )
}

struct Databases {
    server: String,
    names: Vec<String>,
}

impl Databases {
    async fn drop_all(&self) {
        if let Ok(mut admin) = PgConnection::connect(&self.server).await {
            for name in &self.names {
                let _ = admin
                    .execute(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                    )))
                    .await;
            }
        }
    }
}

async fn migrate_schema(pool: &PgPool, schema: &str) -> anyhow::Result<()> {
    let sql = Migrator::new().schema(schema)?.to_sql();
    sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
    Ok(())
}

async fn pool_on(server: &str, database: &str, app: &str, size: u32) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(server)?
        .database(database)
        .application_name(app);
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await?)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub(crate) async fn run(server: &str, quick: bool) -> anyhow::Result<()> {
    let id = uuid::Uuid::now_v7().simple().to_string()[20..].to_owned();
    let prefix = format!("pgbox_bench_t_{id}");
    let (databases, per_db) = if quick { (2, 50) } else { (10, 100) };
    let dbs = Databases {
        server: server.to_owned(),
        names: (0..databases)
            .map(|i| format!("{prefix}_{i}"))
            .chain(std::iter::once(format!("pgbox_bench_tt_{id}")))
            .collect(),
    };
    let result = arms(server, &prefix, &dbs, databases, per_db, quick).await;
    dbs.drop_all().await;
    result
}

async fn arms(
    server: &str,
    prefix: &str,
    dbs: &Databases,
    databases: usize,
    per_db: usize,
    quick: bool,
) -> anyhow::Result<()> {
    // One template holding `per_db` migrated tenant schemas, copied into each database.
    let mut admin = PgConnection::connect(server).await?;
    let template = &dbs.names[databases];
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE \"{template}\"")))
        .await?;
    {
        let pool = pool_on(server, template, "pgbox-bench-setup", 4).await?;
        for s in 0..per_db {
            migrate_schema(&pool, &format!("tenant_{s}")).await?;
        }
        pool.close().await;
    }
    for name in &dbs.names[..databases] {
        admin
            .execute(AssertSqlSafe(format!(
                "CREATE DATABASE \"{name}\" TEMPLATE \"{template}\""
            )))
            .await?;
    }
    let tenants = databases * per_db;

    // T1: idle cost.
    let app = format!("pgbox-bench-t1-{}", &prefix[prefix.len() - 6..]);
    let server_pool = {
        let options = PgConnectOptions::from_str(server)?.application_name(&app);
        PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await?
    };
    let observer = PgPoolOptions::new()
        .max_connections(2)
        .connect(server)
        .await?;
    let sink = Sink::default();
    let relay = Arc::new(
        TenantRelay::builder(sink.clone())
            .discover_databases(server_pool, format!("{}\\_%", prefix.replace('_', "\\_")))
            .schema_pattern("tenant\\_%")
            .build()?,
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    let started = Instant::now();
    loop {
        let s = relay.status();
        if s.len() == tenants && s.iter().all(|s| s.asleep) {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "T1: {} of {tenants} tenants asleep after 10 min",
            s.iter().filter(|s| s.asleep).count()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "T1 {tenants} tenants in {databases} databases: all asleep {:.1} s after start",
        started.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pids = backend_pids(&observer, &app).await?;
    let (cpu0, pg0) = (
        cpu_seconds("self"),
        pids.iter()
            .map(|p| cpu_seconds(&p.to_string()))
            .sum::<f64>(),
    );
    let window = 10.0;
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let (cpu1, pg1) = (
        cpu_seconds("self"),
        pids.iter()
            .map(|p| cpu_seconds(&p.to_string()))
            .sum::<f64>(),
    );
    let connections = backend_pids(&observer, &app).await?.len();
    println!(
        "T1 idle: relay process {:.2}% of a core, its PostgreSQL backends {:.2}% (over {window} s); \
         {connections} connections ({databases} listeners + rounds' pools + 1 server listing)",
        (cpu1 - cpu0) / window * 100.0,
        (pg1 - pg0) / window * 100.0,
    );
    let db0 = pool_on(server, &dbs.names[0], "pgbox-bench-producer", 4).await?;
    for n in 0..3 {
        let schema = format!("tenant_new_{n}");
        migrate_schema(&db0, &schema).await?;
        let migrated = Instant::now();
        let outbox = Outbox::with_schema(&schema)?;
        let mut tx = db0.begin().await?;
        let id = outbox
            .enqueue(&mut tx, Message::bytes("watched", b"x".to_vec()))
            .await?;
        tx.commit().await?;
        let committed = Instant::now();
        let published = loop {
            if let Some(at) = sink.0.watched.lock().unwrap().get(&id) {
                break *at;
            }
            anyhow::ensure!(
                committed.elapsed() < Duration::from_secs(60),
                "T1: the new tenant's message was not published within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        println!(
            "T1 new tenant {n}: first message published {:.0} ms after its commit ({:.0} ms after the migration)",
            (published - committed).as_secs_f64() * 1e3,
            (published - migrated).as_secs_f64() * 1e3,
        );
    }
    shutdown.cancel();
    task.await??;

    // T2: a quiet tenant beside a large backlog.
    let backlog: i64 = if quick { 100_000 } else { 1_000_000 };
    sqlx::query(
        "INSERT INTO tenant_0.outbox (message_id, topic, payload, content_type) \
         SELECT gen_random_uuid(), 'bulk', '\\x00'::bytea, 'application/octet-stream' \
         FROM generate_series(1, $1) AS g",
    )
    .bind(backlog)
    .execute(&db0)
    .await?;
    db0.execute("VACUUM ANALYZE tenant_0.outbox").await?;
    let sink = Sink::default();
    let relay = Arc::new(
        TenantRelay::builder(sink.clone())
            .database(pool_on(server, &dbs.names[0], "pgbox-bench-t2", 4).await?)
            .schema_pattern("tenant\\_%")
            .build()?,
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    let drain_started = Instant::now();
    let outbox = Outbox::with_schema("tenant_1")?;
    let mut commits = Vec::new();
    while sink.0.published.load(Relaxed) < backlog as u64 * 9 / 10 && commits.len() < 2000 {
        let mut tx = db0.begin().await?;
        let id = outbox
            .enqueue(&mut tx, Message::bytes("watched", b"q".to_vec()))
            .await?;
        tx.commit().await?;
        commits.push((id, Instant::now()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while sink.0.watched.lock().unwrap().len() < commits.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let during = sink.0.published.load(Relaxed);
    let mut lags: Vec<f64> = {
        let watched = sink.0.watched.lock().unwrap();
        commits
            .iter()
            .filter_map(|(id, at)| watched.get(id).map(|p| (*p - *at).as_secs_f64() * 1e3))
            .collect()
    };
    shutdown.cancel();
    task.await??;
    println!(
        "T2 quiet tenant beside a {backlog}-row backlog: {} messages, commit→publish p50 {:.1} ms, \
         p99 {:.1} ms, max {:.1} ms ({during} backlog messages published in {:.1} s meanwhile)",
        lags.len(),
        percentile(&mut lags, 0.5),
        percentile(&mut lags, 0.99),
        percentile(&mut lags, 1.0),
        drain_started.elapsed().as_secs_f64(),
    );

    // T3: one tenant's drain rate, tenant relay vs dedicated relay.
    let rows: i64 = if quick { 50_000 } else { 200_000 };
    let mut rates = Vec::new();
    for arm in [
        "tenant relay",
        "dedicated relay",
        "tenant relay",
        "dedicated relay",
    ] {
        db0.execute("TRUNCATE tenant_2.outbox").await?;
        sqlx::query(
            "INSERT INTO tenant_2.outbox (message_id, topic, payload, content_type) \
             SELECT gen_random_uuid(), 'bulk', '\\x00'::bytea, 'application/octet-stream' \
             FROM generate_series(1, $1) AS g",
        )
        .bind(rows)
        .execute(&db0)
        .await?;
        db0.execute("VACUUM ANALYZE tenant_2.outbox").await?;
        let sink = Sink::default();
        let pool = pool_on(server, &dbs.names[0], "pgbox-bench-t3", 4).await?;
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        let task = if arm == "tenant relay" {
            let relay = TenantRelay::builder(sink.clone())
                .database(pool)
                .schemas(["tenant_2"])
                .build()?;
            let shutdown = shutdown.clone();
            tokio::spawn(async move { relay.run(shutdown).await })
        } else {
            let relay = Relay::builder(pool, sink.clone())
                .schema("tenant_2")
                .build()?;
            let shutdown = shutdown.clone();
            tokio::spawn(async move { relay.run(shutdown).await })
        };
        while sink.0.published.load(Relaxed) < rows as u64 {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(600),
                "T3: not drained in 10 min"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let rate = rows as f64 / started.elapsed().as_secs_f64();
        shutdown.cancel();
        task.await??;
        println!("T3 {arm}: {rows} messages drained at {rate:.0} msg/s");
        rates.push((arm, rate));
    }
    let mean = |name: &str| {
        let v: Vec<f64> = rates.iter().filter(|r| r.0 == name).map(|r| r.1).collect();
        v.iter().sum::<f64>() / v.len() as f64
    };
    println!(
        "T3 ratio tenant/dedicated: {:.2}",
        mean("tenant relay") / mean("dedicated relay")
    );
    Ok(())
}
