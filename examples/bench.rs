//! pgbox benchmarks: every workload next to its baseline, in the same run, on the same
//! database. See BENCHMARKS.md for the method and the results.
//!
//! ```text
//! cargo run --release --example bench                 # full run
//! cargo run --release --example bench -- --quick      # under two minutes (CI)
//! ```

#[path = "../tests/support/local_pg.rs"]
mod local_pg;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use pgbox::transport::{DiscardPublisher, PgQueue, PublishError, Publisher};
use pgbox::{CancellationToken, Envelope, Error, Inbox, Message, Outbox, Relay, WakeUp};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgPool};

/// pgbox benchmark harness.
#[derive(Parser, Debug, Clone)]
#[command(about)]
struct Args {
    /// Concurrent clients per workload (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    clients: Vec<usize>,
    /// Seconds per workload and client count.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Payload bytes per business row / message.
    #[arg(long, default_value_t = 100)]
    payload: usize,
    /// Keys per batch (I4) and messages per transaction (O1 batch), and relay batch size.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Outbox backlog drained by O2.
    #[arg(long, default_value_t = 200_000)]
    backlog: usize,
    /// Backlog for the peer's O2 drain: sqlxmq's drain rate falls steeply as its backlog grows
    /// (about 340 msgs/s at 200,000 queued on the reference machine), so its full-size run
    /// takes many minutes. Set it to `--backlog` for a like-for-like run.
    #[arg(long, default_value_t = 20_000)]
    peer_backlog: usize,
    /// Short run for CI: clients 1,4, 1 s per workload, 10k backlog.
    #[arg(long)]
    quick: bool,
    /// Only workloads whose id starts with one of these (e.g. `I1,O2`).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

type OpFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;
type Op = Arc<dyn Fn(PgPool, u64) -> OpFuture + Send + Sync>;

struct Sample {
    ops: u64,
    seconds: f64,
    latencies: Vec<Duration>,
    wal_bytes: f64,
}

struct Row {
    id: String,
    clients: usize,
    rate: f64,
    p50: Duration,
    p99: Duration,
    ratio: Option<(f64, String)>,
    wal_per_msg: f64,
    statements: &'static str,
    dead_tuples: Option<i64>,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn wal_lsn(pool: &PgPool) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?)
}

async fn wal_since(pool: &PgPool, from: &str) -> anyhow::Result<f64> {
    Ok(
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8")
            .bind(from)
            .fetch_one(pool)
            .await?,
    )
}

/// Runs `op` from `clients` tasks for `duration`; `per_op` messages per call.
async fn measure(
    pool: &PgPool,
    clients: usize,
    duration: Duration,
    op: Op,
) -> anyhow::Result<Sample> {
    let next = Arc::new(AtomicU64::new(0));
    let start_lsn = wal_lsn(pool).await?;
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (pool, op, next) = (pool.clone(), op.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while Instant::now() < deadline {
                let i = next.fetch_add(1, Relaxed);
                let t = Instant::now();
                op(pool.clone(), i).await?;
                latencies.push(t.elapsed());
            }
            anyhow::Ok(latencies)
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let wal_bytes = wal_since(pool, &start_lsn).await?;
    latencies.sort();
    Ok(Sample {
        ops: latencies.len() as u64,
        seconds,
        latencies,
        wal_bytes,
    })
}

async fn dead_tuples(pool: &PgPool, table: &str) -> anyhow::Result<i64> {
    // Backends flush their statistics at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut conn = pool.acquire().await?;
    conn.execute("SELECT pg_stat_clear_snapshot()").await?;
    Ok(sqlx::query_scalar(
        "SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(&mut *conn)
    .await?)
}

/// Runs statements one by one (VACUUM refuses to run in the implicit transaction of a
/// multi-statement query).
async fn run_each(pool: &PgPool, statements: &[&'static str]) -> anyhow::Result<()> {
    for s in statements {
        sqlx::raw_sql(*s).execute(pool).await?;
    }
    Ok(())
}

async fn reset(pool: &PgPool) -> anyhow::Result<()> {
    run_each(
        pool,
        &[
            "TRUNCATE bench_effects, pgbox.inbox, pgbox.outbox, pgbox.outbox_dead_letters, pgbox.queue, inbox_messages",
            "SELECT mq_clear_all()",
            "VACUUM (ANALYZE) bench_effects",
            "VACUUM (ANALYZE) pgbox.inbox",
            "VACUUM (ANALYZE) pgbox.outbox",
            "VACUUM (ANALYZE) inbox_messages",
            "VACUUM (ANALYZE) mq_msgs",
            "SELECT pg_stat_reset()",
        ],
    )
    .await
}

struct Bench {
    args: Args,
    pool: PgPool,
    options: PgConnectOptions,
    rows: Vec<Row>,
    baselines: HashMap<(String, usize), f64>,
}

impl Bench {
    fn wanted(&self, id: &str) -> bool {
        self.args.only.is_empty() || self.args.only.iter().any(|p| id.starts_with(p.as_str()))
    }

    async fn pool_for(&self, clients: usize) -> anyhow::Result<PgPool> {
        Ok(PgPoolOptions::new()
            .max_connections(clients as u32 + 2)
            .connect_with(self.options.clone())
            .await?)
    }

    /// Runs one workload at every client count; `msgs` messages per op. (Positional
    /// arguments keep each workload's definition on a few lines below.)
    #[allow(clippy::too_many_arguments)]
    async fn run(
        &mut self,
        id: &str,
        msgs: u64,
        statements: &'static str,
        table: Option<&str>,
        baseline: Option<&str>,
        setup: Option<&(dyn Fn(PgPool) -> OpFuture + Sync)>,
        op: Op,
    ) -> anyhow::Result<()> {
        if !self.wanted(id) {
            return Ok(());
        }
        for &clients in &self.args.clients.clone() {
            reset(&self.pool).await?;
            if let Some(setup) = setup {
                setup(self.pool.clone()).await?;
            }
            let pool = self.pool_for(clients).await?;
            let duration = Duration::from_secs_f64(self.args.duration);
            let sample = measure(&pool, clients, duration, op.clone()).await?;
            pool.close().await;
            let rate = (sample.ops * msgs) as f64 / sample.seconds;
            let dead = match table {
                Some(t) => Some(dead_tuples(&self.pool, t).await?),
                None => None,
            };
            self.baselines.insert((id.to_owned(), clients), rate);
            let ratio = baseline.and_then(|b| {
                self.baselines
                    .get(&(b.to_owned(), clients))
                    .map(|r| (rate / r, b.to_owned()))
            });
            let row = Row {
                id: id.to_owned(),
                clients,
                rate,
                p50: percentile(&sample.latencies, 0.50),
                p99: percentile(&sample.latencies, 0.99),
                ratio,
                wal_per_msg: sample.wal_bytes / (sample.ops * msgs).max(1) as f64,
                statements,
                dead_tuples: dead,
            };
            print_row(&row);
            self.rows.push(row);
        }
        Ok(())
    }
}

fn print_header() {
    println!(
        "| workload | clients | msgs/s | p50 | p99 | ratio | WAL B/msg | stmts/msg | dead tuples |"
    );
    println!("|---|---:|---:|---:|---:|---|---:|---|---:|");
}

fn print_row(r: &Row) {
    let ratio = match &r.ratio {
        Some((x, b)) => format!("{x:.2}× {b}"),
        None => "baseline".into(),
    };
    println!(
        "| {} | {} | {:.0} | {:.2} ms | {:.2} ms | {} | {:.0} | {} | {} |",
        r.id,
        r.clients,
        r.rate,
        r.p50.as_secs_f64() * 1e3,
        r.p99.as_secs_f64() * 1e3,
        ratio,
        r.wal_per_msg,
        r.statements,
        r.dead_tuples.map_or("-".into(), |d| d.to_string())
    );
}

fn boxed<F: Future<Output = anyhow::Result<()>> + Send + 'static>(f: F) -> OpFuture {
    Box::pin(f)
}

async fn fingerprint(pool: &PgPool) -> anyhow::Result<()> {
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(pool)
        .await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings WHERE source NOT IN ('default', 'override') \
         AND name NOT IN ('application_name', 'client_encoding', 'DateStyle', 'TimeZone', \
         'lc_messages', 'lc_monetary', 'lc_numeric', 'lc_time', 'default_text_search_config', \
         'extra_float_digits') ORDER BY name",
    )
    .fetch_all(pool)
    .await?;
    let git = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    println!(
        "fingerprint: cpus={} postgres={} git={} build={}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        version,
        if git.is_empty() { "?" } else { &git },
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    let settings: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("settings: {}", settings.join(" "));
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.clients = vec![1, 4];
        args.duration = 1.0;
        args.backlog = args.backlog.min(10_000);
        args.peer_backlog = args.peer_backlog.min(10_000);
    }
    let server = local_pg::database_url()
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let mut admin = sqlx::PgConnection::connect(&server).await?;
    admin
        .execute("DROP DATABASE IF EXISTS pgbox_bench WITH (FORCE)")
        .await?;
    admin.execute("CREATE DATABASE pgbox_bench").await?;
    admin.close().await?;
    let options = PgConnectOptions::from_str(&server)?.database("pgbox_bench");
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options.clone())
        .await?;
    let pool08 = peers::pool08(&server, "pgbox_bench").await?;
    pgbox::migrate(&pool).await?;
    pool.execute("CREATE TABLE bench_effects (k text NOT NULL, payload text NOT NULL)")
        .await?;
    peers::setup(&pool, &options).await?;
    fingerprint(&pool).await?;
    println!(
        "run: clients={:?} duration={}s payload={}B batch={} backlog={}",
        args.clients, args.duration, args.payload, args.batch, args.backlog
    );
    println!();
    print_header();

    let payload: Arc<str> = "x".repeat(args.payload).into();
    let batch = args.batch;
    let mut bench = Bench {
        args: args.clone(),
        pool: pool.clone(),
        options,
        rows: Vec::new(),
        baselines: HashMap::new(),
    };

    // B0: the business write alone.
    let p = payload.clone();
    bench
        .run(
            "B0 autocommit INSERT",
            1,
            "1",
            Some("bench_effects"),
            None,
            None,
            Arc::new(move |pool, i| {
                let p = p.clone();
                boxed(async move {
                    sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
                        .bind(format!("k{i}"))
                        .bind(&*p)
                        .execute(&pool)
                        .await?;
                    Ok(())
                })
            }),
        )
        .await?;
    let p = payload.clone();
    bench
        .run(
            "B0 BEGIN/INSERT/COMMIT",
            1,
            "3",
            Some("bench_effects"),
            None,
            None,
            Arc::new(move |pool, i| {
                let p = p.clone();
                boxed(async move {
                    let mut tx = pool.begin().await?;
                    sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
                        .bind(format!("k{i}"))
                        .bind(&*p)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(())
                })
            }),
        )
        .await?;

    // I1: new messages through inbox.process, with and without the liveness check.
    for (id, verify, stmts) in [
        ("I1 inbox.process", true, "5"),
        ("I1 inbox.process (no verify)", false, "4"),
    ] {
        let p = payload.clone();
        let inbox = Inbox::builder("bench").verify_transaction(verify).build()?;
        bench
            .run(
                id,
                1,
                stmts,
                Some("inbox"),
                Some("B0 BEGIN/INSERT/COMMIT"),
                None,
                Arc::new(move |pool, i| {
                    let (p, inbox) = (p.clone(), inbox.clone());
                    boxed(async move {
                        let key = format!("k{i}");
                        let mut tx = pool.begin().await?;
                        let outcome = inbox
                            .process(&mut tx, key.as_str(), async |conn| {
                                sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
                                    .bind(&key)
                                    .bind(&*p)
                                    .execute(&mut *conn)
                                    .await
                                    .map_err(Error::from)?;
                                Ok::<(), Error>(())
                            })
                            .await?;
                        tx.commit().await?;
                        anyhow::ensure!(outcome.is_processed());
                        Ok(())
                    })
                }),
            )
            .await?;
    }
    let p = payload.clone();
    bench
        .run(
            "I1 hand-fused single statement",
            1,
            "1",
            Some("inbox"),
            Some("B0 autocommit INSERT"),
            None,
            Arc::new(move |pool, i| {
                let p = p.clone();
                boxed(async move {
                    sqlx::query(
                        "WITH c AS (INSERT INTO pgbox.inbox (consumer, key) VALUES ('bench', $1) \
                       ON CONFLICT (consumer, key) DO NOTHING RETURNING key) \
                     INSERT INTO bench_effects SELECT key, $2 FROM c",
                    )
                    .bind(format!("k{i}"))
                    .bind(&*p)
                    .execute(&pool)
                    .await?;
                    Ok(())
                })
            }),
        )
        .await?;

    // I2: 100 % duplicates.
    const DUP_KEYS: u64 = 5_000;
    let preload = |pool: PgPool| {
        boxed(async move {
            sqlx::query(
                "INSERT INTO pgbox.inbox (consumer, key) SELECT 'bench', 'k' || g FROM generate_series(0, 4999) g",
            )
            .execute(&pool)
            .await?;
            run_each(
                &pool,
                &["VACUUM (ANALYZE) pgbox.inbox", "SELECT pg_stat_reset()"],
            )
            .await?;
            Ok(())
        })
    };
    let inbox = Inbox::new("bench")?;
    bench
        .run(
            "I2 inbox.process, 100% duplicates",
            1,
            "3",
            Some("inbox"),
            Some("B0 BEGIN/INSERT/COMMIT"),
            Some(&preload),
            Arc::new(move |pool, i| {
                let inbox = inbox.clone();
                boxed(async move {
                    let mut tx = pool.begin().await?;
                    let key = format!("k{}", i % DUP_KEYS);
                    let outcome = inbox
                        .process(&mut tx, key.as_str(), async |_c| Ok::<(), Error>(()))
                        .await?;
                    tx.commit().await?;
                    anyhow::ensure!(outcome.is_duplicate(), "expected a duplicate");
                    Ok(())
                })
            }),
        )
        .await?;

    // Peer: txbox, on I1 and I2, used as its README says.
    let p = payload.clone();
    bench
        .run(
            "I1 peer txbox 0.2.0",
            1,
            "4",
            Some("inbox_messages"),
            Some("B0 BEGIN/INSERT/COMMIT"),
            None,
            Arc::new(move |pool, i| {
                let p = p.clone();
                boxed(async move {
                    anyhow::ensure!(peers::txbox_process(&pool, &format!("k{i}"), &p).await?);
                    Ok(())
                })
            }),
        )
        .await?;
    let p = payload.clone();
    let preload_txbox = move |pool: PgPool| {
        let p = p.clone();
        boxed(async move {
            for i in 0..DUP_KEYS {
                peers::txbox_process(&pool, &format!("k{i}"), &p).await?;
            }
            run_each(
                &pool,
                &["VACUUM (ANALYZE) inbox_messages", "SELECT pg_stat_reset()"],
            )
            .await?;
            Ok(())
        })
    };
    let p = payload.clone();
    bench
        .run(
            "I2 peer txbox 0.2.0, 100% duplicates",
            1,
            "3",
            Some("inbox_messages"),
            Some("B0 BEGIN/INSERT/COMMIT"),
            Some(&preload_txbox),
            Arc::new(move |pool, i| {
                let p = p.clone();
                boxed(async move {
                    let processed =
                        peers::txbox_process(&pool, &format!("k{}", i % DUP_KEYS), &p).await?;
                    anyhow::ensure!(!processed, "expected a duplicate");
                    Ok(())
                })
            }),
        )
        .await?;

    // I4: batch dedup on one connection.
    let saved_clients = std::mem::replace(&mut bench.args.clients, vec![1]);
    let p = payload.clone();
    bench
        .run(
            &format!("B0 batch INSERT x{batch}"),
            batch as u64,
            "3",
            None,
            None,
            None,
            Arc::new(move |pool, i| {
                let p = p.clone();
                boxed(async move {
                    let keys: Vec<String> =
                        (0..batch as u64).map(|j| format!("k{i}-{j}")).collect();
                    let mut tx = pool.begin().await?;
                    sqlx::query("INSERT INTO bench_effects SELECT k, $2 FROM unnest($1::text[]) k")
                        .bind(&keys)
                        .bind(&*p)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(())
                })
            }),
        )
        .await?;
    let inbox = Inbox::new("bench")?;
    bench
        .run(
            &format!("I4 claim_batch x{batch}"),
            batch as u64,
            "3",
            Some("inbox"),
            Some(&format!("B0 batch INSERT x{batch}")),
            None,
            Arc::new(move |pool, i| {
                let inbox = inbox.clone();
                boxed(async move {
                    let keys: Vec<String> =
                        (0..batch as u64).map(|j| format!("k{i}-{j}")).collect();
                    let mut tx = pool.begin().await?;
                    let claimed = inbox.claim_batch(&mut tx, keys.iter()).await?;
                    tx.commit().await?;
                    anyhow::ensure!(claimed.iter().all(|c| *c));
                    Ok(())
                })
            }),
        )
        .await?;
    bench.args.clients = saved_clients;

    // O1: enqueue in the business transaction.
    for (id, n, stmts) in [
        ("O1 enqueue 1 per tx", 1usize, "4"),
        ("O1 enqueue 100 per tx", 100, "4"),
    ] {
        let p = payload.clone();
        let outbox = Outbox::new();
        bench
            .run(
                id,
                n as u64,
                stmts,
                Some("outbox"),
                if n == 1 {
                    Some("B0 BEGIN/INSERT/COMMIT")
                } else {
                    None
                },
                None,
                Arc::new(move |pool, i| {
                    let (p, outbox) = (p.clone(), outbox.clone());
                    boxed(async move {
                        let mut tx = pool.begin().await?;
                        sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
                            .bind(format!("k{i}"))
                            .bind(&*p)
                            .execute(&mut *tx)
                            .await?;
                        let messages = (0..n).map(|j| {
                            Message::bytes("bench", p.as_bytes().to_vec())
                                .ordering_key(format!("e{}", (i as usize * n + j) % 1000))
                        });
                        outbox.enqueue_batch(&mut tx, messages).await?;
                        tx.commit().await?;
                        Ok(())
                    })
                }),
            )
            .await?;
    }

    // Peer: sqlxmq, on O1, used as its README says (one `spawn` per job, in the transaction).
    for (id, n) in [
        ("O1 peer sqlxmq 0.6.0 enqueue 1 per tx", 1usize),
        ("O1 peer sqlxmq 0.6.0 enqueue 100 per tx", 100),
    ] {
        let (p, pool08) = (payload.clone(), pool08.clone());
        bench
            .run(id, n as u64, if n == 1 { "4" } else { "103" }, Some("mq_msgs"), if n == 1 { Some("B0 BEGIN/INSERT/COMMIT") } else { Some("O1 enqueue 100 per tx") }, None, Arc::new(move |_pool, i| {
                let (p, pool08) = (p.clone(), pool08.clone());
                boxed(async move { peers::sqlxmq_enqueue(&pool08, &format!("k{i}"), n, &p).await })
            }))
            .await?;
    }

    // O2: drain a backlog.
    if bench.wanted("O2") {
        for (name, transport) in [("no-op publisher", false), ("built-in queue", true)] {
            for &relays in &[1usize, 4] {
                reset(&pool).await?;
                fill_backlog(&pool, args.backlog, &payload).await?;
                let start_lsn = wal_lsn(&pool).await?;
                let started = Instant::now();
                let mut tasks = Vec::new();
                for _ in 0..relays {
                    let rpool = PgPoolOptions::new()
                        .max_connections(3)
                        .connect_with(bench.options.clone())
                        .await?;
                    let batch = args.batch;
                    tasks.push(tokio::spawn(async move {
                        if transport {
                            let relay = Relay::builder(rpool.clone(), PgQueue::new(rpool))
                                .batch_size(batch)
                                .build()?;
                            while relay.relay_once().await?.claimed > 0 {}
                        } else {
                            let relay = Relay::builder(rpool, DiscardPublisher)
                                .batch_size(batch)
                                .build()?;
                            while relay.relay_once().await?.claimed > 0 {}
                        }
                        anyhow::Ok(())
                    }));
                }
                for t in tasks {
                    t.await??;
                }
                let seconds = started.elapsed().as_secs_f64();
                let wal = wal_since(&pool, &start_lsn).await?;
                let row = Row {
                    id: format!("O2 drain {} ({name})", args.backlog),
                    clients: relays,
                    rate: args.backlog as f64 / seconds,
                    p50: Duration::ZERO,
                    p99: Duration::ZERO,
                    ratio: None,
                    wal_per_msg: wal / args.backlog as f64,
                    statements: "3/batch",
                    dead_tuples: Some(dead_tuples(&pool, "outbox").await?),
                };
                bench
                    .baselines
                    .insert((format!("O2 {name}"), relays), row.rate);
                print_row(&row);
                bench.rows.push(row);
            }
        }
    }

    // Peer: sqlxmq draining the same backlog with a no-op job.
    if bench.wanted("O2") {
        for &(min, max) in &[(16usize, 32usize), (50, 100)] {
            reset(&pool).await?;
            peers::sqlxmq_fill(&pool08, args.peer_backlog, &payload).await?;
            let start_lsn = wal_lsn(&pool).await?;
            let rate = peers::sqlxmq_drain(&pool08, args.peer_backlog, min, max).await?;
            let wal = wal_since(&pool, &start_lsn).await?;
            let row = Row {
                id: format!(
                    "O2 peer sqlxmq 0.6.0 drain {} (no-op job, concurrency {min}..{max})",
                    args.peer_backlog
                ),
                clients: 1,
                rate,
                p50: Duration::ZERO,
                p99: Duration::ZERO,
                ratio: bench
                    .baselines
                    .get(&("O2 no-op publisher".to_owned(), 1))
                    .map(|b| (rate / b, "O2 no-op publisher (pgbox, 1 relay)".to_owned())),
                wal_per_msg: wal / args.peer_backlog as f64,
                statements: "-",
                dead_tuples: Some(dead_tuples(&pool, "mq_msgs").await?),
            };
            print_row(&row);
            bench.rows.push(row);
        }
    }

    // O3: commit → publish latency at half the no-op drain rate (capped by what one
    // producer task can commit), NOTIFY vs poll-only.
    if bench.wanted("O3") {
        let drain = bench
            .baselines
            .get(&("O2 no-op publisher".to_owned(), 1))
            .copied()
            .unwrap_or(2_000.0);
        let rate = (drain / 2.0).min(2_000.0);
        for (wake, poll) in [
            (WakeUp::Notify, Duration::from_secs(1)),
            (WakeUp::Poll, Duration::from_millis(100)),
        ] {
            reset(&pool).await?;
            let row = latency_run(
                &bench.options,
                &payload,
                rate,
                Duration::from_secs_f64(args.duration.max(2.0)),
                wake,
                poll,
            )
            .await?;
            print_row(&row);
            bench.rows.push(row);
        }
    }
    println!();
    println!(
        "ratio: msgs/s divided by the named baseline's msgs/s at the same client count, same run."
    );
    Ok(())
}

async fn fill_backlog(pool: &PgPool, n: usize, payload: &str) -> anyhow::Result<()> {
    let outbox = Outbox::new();
    let mut left = n;
    while left > 0 {
        let k = left.min(5_000);
        let mut tx = pool.begin().await?;
        outbox
            .enqueue_batch(
                &mut tx,
                (0..k).map(|_| Message::bytes("bench", payload.as_bytes().to_vec())),
            )
            .await?;
        tx.commit().await?;
        left -= k;
    }
    run_each(
        pool,
        &["VACUUM (ANALYZE) pgbox.outbox", "SELECT pg_stat_reset()"],
    )
    .await?;
    Ok(())
}

/// Records when each message was published.
#[derive(Clone, Default)]
struct Stopwatch(Arc<Mutex<HashMap<uuid::Uuid, Instant>>>);

impl Publisher for Stopwatch {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let now = Instant::now();
        let mut seen = self.0.lock().unwrap();
        for e in batch {
            seen.insert(e.id, now);
        }
        vec![Ok(()); batch.len()]
    }
}

async fn latency_run(
    options: &PgConnectOptions,
    payload: &str,
    rate: f64,
    duration: Duration,
    wake: WakeUp,
    poll: Duration,
) -> anyhow::Result<Row> {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.clone())
        .await?;
    let stopwatch = Stopwatch::default();
    let relay = Relay::builder(pool.clone(), stopwatch.clone())
        .wake_up(wake)
        .poll_interval(poll)
        .build()?;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let outbox = Outbox::new();
    let mut committed = HashMap::new();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let started = Instant::now();
    let mut next = started;
    while started.elapsed() < duration {
        let mut tx = pool.begin().await?;
        let id = outbox
            .enqueue(
                &mut tx,
                Message::bytes("latency", payload.as_bytes().to_vec()),
            )
            .await?;
        tx.commit().await?;
        committed.insert(id, Instant::now());
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
    let sent = committed.len();
    let drain_deadline = Instant::now() + Duration::from_secs(10);
    while stopwatch.0.lock().unwrap().len() < sent && Instant::now() < drain_deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    task.await??;
    let published = stopwatch.0.lock().unwrap();
    let mut latencies: Vec<Duration> = committed
        .iter()
        .filter_map(|(id, at)| published.get(id).map(|p| p.saturating_duration_since(*at)))
        .collect();
    latencies.sort();
    Ok(Row {
        id: format!("O3 commit→publish ({wake:?}, poll {poll:?}) @ {rate:.0}/s"),
        clients: 1,
        rate: sent as f64 / duration.as_secs_f64(),
        p50: percentile(&latencies, 0.50),
        p99: percentile(&latencies, 0.99),
        ratio: None,
        wal_per_msg: 0.0,
        statements: "-",
        dead_tuples: None,
    })
}

/// The peers, pinned in Cargo.toml: txbox (inbox; sqlx 0.9, our pool type) and sqlxmq
/// (transactional job queue used as an outbox; sqlx 0.8, its own pool).
mod peers {
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use sqlx::PgPool;
    use sqlx::postgres::PgConnectOptions;
    use sqlxmq::{CurrentJob, JobRegistry, job};
    use txbox::postgres::PgInbox;
    use txbox::{ConsumerId, InboxExt, MessageId, Outcome};

    pub(crate) async fn pool08(server: &str, database: &str) -> anyhow::Result<sqlx08::PgPool> {
        let mut url = url::Url::parse(server)?;
        url.set_path(database);
        Ok(sqlx08::postgres::PgPoolOptions::new()
            .max_connections(20)
            .connect(url.as_str())
            .await?)
    }

    /// txbox's own migration (its README), and sqlxmq's migration files as shipped in its
    /// crate (its README says to copy them into your migrations; we read them from cargo's
    /// registry instead of vendoring them).
    pub(crate) async fn setup(pool: &PgPool, _options: &PgConnectOptions) -> anyhow::Result<()> {
        PgInbox::new(pool.clone()).migrate().await?;
        let home = std::env::var("CARGO_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|_| {
                PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cargo")
            });
        let mut dirs = Vec::new();
        for registry in std::fs::read_dir(home.join("registry/src"))? {
            let dir = registry?.path().join("sqlxmq-0.6.0/migrations");
            if dir.is_dir() {
                dirs.push(dir);
            }
        }
        let dir = dirs
            .pop()
            .ok_or_else(|| anyhow::anyhow!("sqlxmq-0.6.0 sources not found in {home:?}"))?;
        let mut ups: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with(".up.sql"))
            .collect();
        ups.sort();
        let mut tx = pool.begin().await?;
        for up in ups {
            sqlx::raw_sql(sqlx::AssertSqlSafe(std::fs::read_to_string(&up)?))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// One message through txbox: claim + the business insert in one transaction.
    pub(crate) async fn txbox_process(
        pool: &PgPool,
        key: &str,
        payload: &str,
    ) -> anyhow::Result<bool> {
        let consumer = PgInbox::new(pool.clone()).consumer(ConsumerId::try_from("bench")?);
        let id = MessageId::try_from(key)?;
        let (k, p) = (key.to_owned(), payload.to_owned());
        let outcome = consumer
            .process(&id, move |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
                        .bind(k)
                        .bind(p)
                        .execute(&mut *conn)
                        .await?;
                    Ok::<_, txbox::HandlerError>(())
                })
            })
            .await?;
        Ok(matches!(outcome, Outcome::Processed(())))
    }

    #[derive(Default)]
    pub(crate) struct Drained(AtomicUsize);

    #[job(channel_name = "bench")]
    async fn bench_noop(
        mut current_job: CurrentJob,
        drained: Arc<Drained>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>> {
        current_job.complete().await?;
        drained.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The business insert plus `n` jobs in one transaction.
    pub(crate) async fn sqlxmq_enqueue(
        pool: &sqlx08::PgPool,
        key: &str,
        n: usize,
        payload: &str,
    ) -> anyhow::Result<()> {
        let mut tx = pool.begin().await?;
        sqlx08::query("INSERT INTO bench_effects VALUES ($1, $2)")
            .bind(key)
            .bind(payload)
            .execute(&mut *tx)
            .await?;
        for _ in 0..n {
            bench_noop
                .builder()
                .set_raw_bytes(payload.as_bytes())
                .spawn(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn sqlxmq_fill(
        pool: &sqlx08::PgPool,
        n: usize,
        payload: &str,
    ) -> anyhow::Result<()> {
        let mut left = n;
        while left > 0 {
            let chunk = left.min(1_000);
            let mut tx = pool.begin().await?;
            for _ in 0..chunk {
                bench_noop
                    .builder()
                    .set_raw_bytes(payload.as_bytes())
                    .spawn(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            left -= chunk;
        }
        Ok(())
    }

    /// Runs sqlxmq's job runner until `n` jobs completed; messages per second.
    pub(crate) async fn sqlxmq_drain(
        pool: &sqlx08::PgPool,
        n: usize,
        min: usize,
        max: usize,
    ) -> anyhow::Result<f64> {
        let drained = Arc::new(Drained::default());
        let mut registry = JobRegistry::new(&[bench_noop]);
        registry.set_context(drained.clone());
        let started = Instant::now();
        let mut runner = registry
            .runner(pool)
            .set_concurrency(min, max)
            .set_channel_names(&["bench"])
            .run()
            .await?;
        while drained.0.load(Ordering::Relaxed) < n {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(600),
                "sqlxmq drain timed out"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        runner.stop().await;
        Ok(rate)
    }
}
