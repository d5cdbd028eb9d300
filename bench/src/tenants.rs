//! T1–T3: one `TenantRelay` serving many tenant schemas and databases.
//!
//! - **T1, idle cost and a new tenant.** 1,000 tenant schemas in one database plus 10
//!   databases with one tenant each (`--quick`: 100 + 3), every tenant idle, served by one
//!   tenant relay. Over an idle window: the relay's connections, the CPU of this process and
//!   of those connections' PostgreSQL backends, and the transactions per second it costs the
//!   server. Then a tenant is created and migrated while the relay runs, one message is
//!   enqueued at once: the time until the publisher has it, from the migration's end.
//! - **T2, a quiet tenant beside a backlog.** One tenant holds a backlog of 1,000,000
//!   messages (`--quick`: 100,000); another enqueues one message every 20 ms while the backlog
//!   drains. The quiet tenant's commit → publish latency (p50, p99, max), through the tenant
//!   relay (with every T1 tenant still served), and through two dedicated `Relay`s (one per
//!   schema) as the baseline.
//! - **T3, one tenant's throughput.** A backlog committed at once in one tenant, the relay
//!   already running: commit → last message published, through the tenant relay and through a
//!   dedicated `Relay`, interleaved, medians of 3.
//!
//! The publisher accepts everything at once (no broker): what is measured is the relays.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{CancellationToken, Envelope, Message, Migrator, Outbox, Relay, TenantRelay};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use uuid::Uuid;

const APP: &str = "pgbox-bench-tenants";

/// Accepts every message; notes when the watched ones (topics `quiet` and `fresh`) arrived,
/// and counts the `bulk` ones.
#[derive(Clone, Default)]
struct Stamp {
    seen: Arc<Mutex<HashMap<Uuid, Instant>>>,
    count: Arc<AtomicU64>,
}

impl Publisher for Stamp {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let now = Instant::now();
        {
            let mut seen = self.seen.lock().unwrap();
            for e in batch {
                if e.topic != "bulk" {
                    seen.entry(e.id).or_insert(now);
                }
            }
        }
        let bulk = batch.iter().filter(|e| e.topic == "bulk").count();
        self.count.fetch_add(bulk as u64, Relaxed);
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

impl Stamp {
    fn at(&self, id: &Uuid) -> Option<Instant> {
        self.seen.lock().unwrap().get(id).copied()
    }
}

/// The databases of this run, dropped at the end (also on error).
struct Databases {
    server: String,
    names: Vec<String>,
}

impl Drop for Databases {
    fn drop(&mut self) {
        let server = self.server.clone();
        let names = std::mem::take(&mut self.names);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
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

fn bulk(i: usize) -> Message {
    let m = Message::bytes("bulk", vec![b'x'; 100]);
    if i.is_multiple_of(2) {
        m.ordering_key(format!("key-{}", i % 100))
    } else {
        m
    }
}

/// Enqueues `n` bulk messages into `schema`, `chunk` per transaction.
async fn backlog(pool: &PgPool, schema: &str, n: usize, chunk: usize) -> anyhow::Result<()> {
    let outbox = Outbox::with_schema(schema)?;
    let mut done = 0;
    while done < n {
        let take = chunk.min(n - done);
        let mut tx = pool.begin().await?;
        outbox
            .enqueue_batch(&mut tx, (done..done + take).map(bulk))
            .await?;
        tx.commit().await?;
        done += take;
    }
    Ok(())
}

/// Clock ticks of CPU (user + system) of process `pid` (`self` for this one), from /proc.
fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

async fn relay_backends(admin: &PgPool) -> anyhow::Result<Vec<i32>> {
    Ok(
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(APP)
            .fetch_all(admin)
            .await?,
    )
}

async fn commits(admin: &PgPool, prefix: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT coalesce(sum(xact_commit + xact_rollback), 0)::int8 FROM pg_stat_database \
         WHERE datname LIKE $1 || '%'",
    )
    .bind(prefix)
    .fetch_one(admin)
    .await?)
}

/// A tenant relay over every database of this run and every `tenant_%` schema in them.
fn tenant_relay(
    stamp: &Stamp,
    server: &PgConnectOptions,
    prefix: &str,
) -> anyhow::Result<TenantRelay<Stamp>> {
    Ok(TenantRelay::builder(stamp.clone())
        .discover_databases(
            PgPoolOptions::new()
                .max_connections(2)
                .connect_lazy_with(server.clone().application_name(APP)),
            format!("{}%", prefix.replace('_', "\\_")),
        )
        .schema_pattern("tenant\\_%")
        .build()?)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs T1–T3; `only` (`--only`) narrows them: `T` runs all three, `T2` only T2 (T1's tenants
/// are still created and served, its idle window and new tenant are skipped).
pub(crate) async fn run(server: &str, quick: bool, only: &[String]) -> anyhow::Result<()> {
    let wanted = |arm: &str| only.iter().any(|p| arm.starts_with(p.as_str()));
    let (schemas, databases, idle_secs, t2_backlog, t3_backlog) = if quick {
        (100usize, 3usize, 10u64, 100_000usize, 20_000usize)
    } else {
        (1_000, 10, 30, 1_000_000, 100_000)
    };
    let id = &Uuid::now_v7().simple().to_string()[..12];
    let prefix = format!("pgbox_bench_t_{id}_");
    let main_db = format!("{prefix}main");
    let mut dbs = Databases {
        server: server.to_owned(),
        names: Vec::new(),
    };
    let server_options: PgConnectOptions = server.parse()?;
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(server_options.clone())
        .await?;
    let mut names = vec![main_db.clone()];
    names.extend((0..databases).map(|i| format!("{prefix}d{i:02}")));
    for name in &names {
        admin
            .execute(AssertSqlSafe(format!(
                "CREATE DATABASE \"{name}\" TEMPLATE template0"
            )))
            .await?;
        dbs.names.push(name.clone());
    }
    let pool_of = |db: &str, n: u32| {
        PgPoolOptions::new()
            .max_connections(n)
            .connect_lazy_with(server_options.clone().database(db))
    };
    let main = pool_of(&main_db, 4);
    let tenant = |i: usize| format!("tenant_{i:04}");
    let started = Instant::now();
    let tenants: Vec<String> = (0..schemas).map(tenant).collect();
    for outcome in Migrator::new().run_each(&main, &tenants, 2).await? {
        outcome.result?;
    }
    for name in &names[1..] {
        let pool = pool_of(name, 1);
        Migrator::new().schema(&tenant(0))?.run(&pool).await?;
        pool.close().await;
    }
    println!(
        "T: {schemas} tenant schemas in {main_db} and one in each of {databases} databases, \
         migrated in {:.0} s",
        started.elapsed().as_secs_f64()
    );

    // --- T1: idle cost, then a new tenant ------------------------------------------------
    let stamp = Stamp::default();
    let relay = Arc::new(tenant_relay(&stamp, &server_options, &prefix)?);
    let shutdown = CancellationToken::new();
    let task = {
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let all = schemas + databases;
    let waited = Instant::now();
    while relay.status().len() < all && waited.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "T1: {} of {all} tenants found {:.1} s after the start",
        relay.status().len(),
        waited.elapsed().as_secs_f64()
    );
    // Settle: every tenant asleep (its start-up work done), then 10 s more, so that the idle
    // window counts no start-up (pg_stat_database is also flushed lazily).
    while relay.status().iter().filter(|s| s.asleep).count() < all
        && waited.elapsed() < Duration::from_secs(600)
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "T1: {} of {all} tenants asleep {:.1} s after the start",
        relay.status().iter().filter(|s| s.asleep).count(),
        waited.elapsed().as_secs_f64()
    );
    if wanted("T1") {
        t1_idle_and_new_tenant(&relay, &stamp, &admin, &main, &prefix, idle_secs).await?;
    }
    // T2 starts relays of its own: this one stops first.
    shutdown.cancel();
    let _ = task.await?;
    if wanted("T2") {
        t2_quiet_beside_backlog(
            &stamp,
            &server_options,
            &prefix,
            &main,
            &main_db,
            &tenant(1),
            &tenant(2),
            quick,
            t2_backlog,
            &pool_of,
        )
        .await?;
    }
    if wanted("T3") {
        t3_one_tenant(
            &stamp,
            &server_options,
            &prefix,
            &main,
            &main_db,
            &tenant(3),
            t3_backlog,
            &pool_of,
        )
        .await?;
    }
    drop(dbs);
    Ok(())
}

/// T1's idle window over every tenant asleep, then a tenant created while the relay runs.
async fn t1_idle_and_new_tenant(
    relay: &TenantRelay<Stamp>,
    stamp: &Stamp,
    admin: &PgPool,
    main: &PgPool,
    prefix: &str,
    idle_secs: u64,
) -> anyhow::Result<()> {
    tokio::time::sleep(Duration::from_secs(10)).await;
    let pids = relay_backends(admin).await?;
    let ticks =
        |pids: &[i32]| -> u64 { pids.iter().filter_map(|p| cpu_ticks(&p.to_string())).sum() };
    let (self0, pg0, tx0, t0) = (
        cpu_ticks("self").unwrap_or(0),
        ticks(&pids),
        commits(admin, prefix).await?,
        Instant::now(),
    );
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let (self1, pg1, tx1, secs) = (
        cpu_ticks("self").unwrap_or(0),
        ticks(&pids),
        commits(admin, prefix).await?,
        t0.elapsed().as_secs_f64(),
    );
    let asleep = relay.status().iter().filter(|s| s.asleep).count();
    // Clock ticks are 1/100 s on Linux.
    println!(
        "T1 idle over {secs:.0} s: {} connections (application_name {APP}), {asleep} of {} \
         tenants asleep; CPU: this process {:.2} %, its backends {:.2} %; {:.1} \
         transactions/s on the tenants' databases (pg_stat_database, flushed lazily)",
        pids.len(),
        relay.status().len(),
        (self1 - self0) as f64 / secs,
        (pg1 - pg0) as f64 / secs,
        (tx1 - tx0) as f64 / secs,
    );
    let fresh = "tenant_new";
    Migrator::new().schema(fresh)?.run(main).await?;
    let migrated = Instant::now();
    let mut tx = main.begin().await?;
    let msg = Outbox::with_schema(fresh)?
        .enqueue(&mut tx, Message::bytes("fresh", b"hello".to_vec()))
        .await?;
    tx.commit().await?;
    let committed = Instant::now();
    let mut published = None;
    while migrated.elapsed() < Duration::from_secs(60) {
        if let Some(at) = stamp.at(&msg) {
            published = Some(at);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    match published {
        Some(at) => println!(
            "T1 new tenant: first message published {:.2} s after its schema was migrated \
             ({:.2} s after its commit); target ≤ 5 s",
            at.duration_since(migrated).as_secs_f64(),
            at.duration_since(committed).as_secs_f64()
        ),
        None => println!("T1 new tenant: NOT published within 60 s"),
    }

    Ok(())
}

/// T2: a quiet tenant's commit → publish latency while another tenant drains a backlog.
#[allow(clippy::too_many_arguments)]
async fn t2_quiet_beside_backlog(
    stamp: &Stamp,
    server_options: &PgConnectOptions,
    prefix: &str,
    main: &PgPool,
    main_db: &str,
    busy: &str,
    quiet: &str,
    quick: bool,
    t2_backlog: usize,
    pool_of: &impl Fn(&str, u32) -> PgPool,
) -> anyhow::Result<()> {
    for arm in ["tenant relay", "dedicated relays"] {
        let filled = Instant::now();
        backlog(main, busy, t2_backlog, 10_000).await?;
        main.execute(AssertSqlSafe(format!("VACUUM ANALYZE {busy}.outbox")))
            .await?;
        println!(
            "T2 [{arm}]: {t2_backlog} messages in {busy}'s outbox ({:.0} s to write)",
            filled.elapsed().as_secs_f64()
        );
        let before = stamp.count.load(Relaxed);
        let stop = CancellationToken::new();
        let mut relays = Vec::new();
        if arm == "tenant relay" {
            let r = tenant_relay(stamp, server_options, prefix)?;
            let s = stop.clone();
            relays.push(tokio::spawn(async move { r.run(s).await }));
        } else {
            for schema in [busy, quiet] {
                let r = Relay::builder(pool_of(main_db, 4), stamp.clone())
                    .schema(schema)
                    .build()?;
                let s = stop.clone();
                relays.push(tokio::spawn(async move { r.run(s).await }));
            }
        }
        let outbox = Outbox::with_schema(quiet)?;
        let mut sent: Vec<(Uuid, Instant)> = Vec::new();
        let drain_started = Instant::now();
        let limit = Duration::from_secs(if quick { 120 } else { 600 });
        while stamp.count.load(Relaxed) - before < t2_backlog as u64
            && drain_started.elapsed() < limit
        {
            let mut tx = main.begin().await?;
            let id = outbox
                .enqueue(&mut tx, Message::bytes("quiet", b"q".to_vec()))
                .await?;
            tx.commit().await?;
            sent.push((id, Instant::now()));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let drained = drain_started.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.cancel();
        for r in relays {
            r.await??;
        }
        let mut lat: Vec<f64> = sent
            .iter()
            .filter_map(|(id, at)| {
                stamp
                    .at(id)
                    .map(|p| p.saturating_duration_since(*at).as_secs_f64() * 1e3)
            })
            .collect();
        let missing = sent.len() - lat.len();
        // The first messages are committed while the relay starts (the tenant relay first
        // lists its tenants): their latencies apart, and the p99 of those after the first
        // second. With quick's hundred messages, the p99 is their second largest.
        let ms = |(id, at): &(Uuid, Instant)| {
            stamp
                .at(id)
                .map(|p| p.saturating_duration_since(*at).as_secs_f64() * 1e3)
        };
        let first: Vec<String> = sent
            .iter()
            .take(5)
            .map(|m| ms(m).map_or("-".to_owned(), |v| format!("{v:.0}")))
            .collect();
        let mut later: Vec<f64> = sent
            .iter()
            .filter(|(_, at)| at.duration_since(drain_started) >= Duration::from_secs(1))
            .filter_map(ms)
            .collect();
        later.sort_by(f64::total_cmp);
        println!(
            "T2 [{arm}]: the first 5 quiet messages {} ms; p99 of those committed after the \
             first second {:.1} ms ({} messages)",
            first.join(", "),
            percentile(&later, 0.99),
            later.len()
        );
        lat.sort_by(f64::total_cmp);
        println!(
            "T2 [{arm}]: backlog drained in {drained:.1} s ({:.0}/s); quiet tenant {} messages, \
             commit → publish p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms{}",
            t2_backlog as f64 / drained,
            sent.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            lat.last().copied().unwrap_or(f64::NAN),
            if missing > 0 {
                format!(", {missing} NOT published")
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// T3: one tenant's backlog through the tenant relay and through a dedicated `Relay`.
#[allow(clippy::too_many_arguments)]
async fn t3_one_tenant(
    stamp: &Stamp,
    server_options: &PgConnectOptions,
    prefix: &str,
    main: &PgPool,
    main_db: &str,
    solo: &str,
    t3_backlog: usize,
    pool_of: &impl Fn(&str, u32) -> PgPool,
) -> anyhow::Result<()> {
    let mut arms: HashMap<&str, Vec<f64>> = HashMap::new();
    for _rep in 0..3 {
        for arm in ["dedicated", "tenant relay"] {
            let stop = CancellationToken::new();
            let handle = if arm == "dedicated" {
                let r = Relay::builder(pool_of(main_db, 4), stamp.clone())
                    .schema(solo)
                    .build()?;
                let s = stop.clone();
                tokio::spawn(async move { r.run(s).await })
            } else {
                let r = tenant_relay(stamp, server_options, prefix)?;
                let s = stop.clone();
                tokio::spawn(async move { r.run(s).await })
            };
            // Let it find its tenants and fall asleep.
            tokio::time::sleep(Duration::from_secs(if arm == "dedicated" { 1 } else { 5 })).await;
            let before = stamp.count.load(Relaxed);
            backlog(main, solo, t3_backlog, t3_backlog).await?;
            let committed = Instant::now();
            let limit = Duration::from_secs(300);
            while stamp.count.load(Relaxed) - before < t3_backlog as u64
                && committed.elapsed() < limit
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let rate = t3_backlog as f64 / committed.elapsed().as_secs_f64();
            stop.cancel();
            handle.await??;
            arms.entry(arm).or_default().push(rate);
        }
    }
    let dedicated = median(arms["dedicated"].clone());
    let shared = median(arms["tenant relay"].clone());
    println!(
        "T3: {t3_backlog} messages committed at once in one tenant: dedicated Relay {dedicated:.0}/s, \
         tenant relay {shared:.0}/s (medians of 3, interleaved): {:.2}× (target ≥ 0.9×)",
        shared / dedicated
    );
    Ok(())
}
