//! pgbox benchmarks: every workload next to its baseline, in the same run, on the same
//! database. See BENCHMARKS.md for the method and the results.
//!
//! ```text
//! cargo run --release -p pgbox-bench                 # full run
//! cargo run --release -p pgbox-bench -- --quick      # under two minutes (CI)
//! cargo run --release -p pgbox-bench -- --only P     # the time-partitioned inbox (P1-P3)
//! cargo run --release -p pgbox-bench -- --only A1    # the archive: O2 with it off/on, replay
//! cargo run --release -p pgbox-bench -- --only F1    # fan-out: per-destination drain, O1 with the header
//! cargo run --release -p pgbox-bench --features job-queues -- --only J   # the Rust job queues as peers of the built-in queue
//! cargo run --release -p pgbox-bench -- --only CE1   # CloudEvents' encode cost (no database)
//! cargo run --release -p pgbox-bench -- --only T     # the tenant relay (T1-T3)
//! cargo run --release -p pgbox-bench -- --soak       # 30-minute soak on a private cluster
//! ```

mod archive;
mod cloudevents;
mod fanout;
#[cfg(feature = "job-queues")]
mod jobqueues;
#[path = "../../tests/support/local_pg.rs"]
mod local_pg;
mod scheduled;
mod soak;
mod tenants;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use pgbox::transport::{DiscardPublisher, PgQueue, PublishError, Publisher};
use pgbox::{
    CancellationToken, Envelope, Error, Inbox, InboxPartitioning, InboxPartitions, Message,
    Migrator, Outbox, Relay, WakeUp,
};
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
    /// Keys per batch (I4) and messages per transaction (O1 batch).
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Relay batch size (O2, O2k, O3); the library's default is 500.
    #[arg(long, default_value_t = 500)]
    relay_batch: usize,
    /// Turn off sqlx's ping of an idle connection on every pool acquire
    /// (`test_before_acquire`, on by default): one round trip per operation that is not a
    /// statement and not counted in stmts/msg.
    #[arg(long)]
    no_ping: bool,
    /// Network round-trip time to simulate, in milliseconds (e.g. 0.5, a same-zone cloud
    /// network): every connection goes through an in-process TCP proxy that holds each chunk
    /// for half of it in each direction. 0 (the default) connects directly. Localhost round
    /// trips cost next to nothing, which hides what a statement fewer saves in production.
    #[arg(long, default_value_t = 0.0)]
    rtt: f64,
    /// Outbox backlog drained by O2 and O2k.
    #[arg(long, default_value_t = 200_000)]
    backlog: usize,
    /// Backlog for the peer's O2 drain: sqlxmq's drain rate falls steeply as its backlog grows
    /// (about 340 msgs/s at 200,000 queued on the reference machine), so its full-size run
    /// takes many minutes. Set it to `--backlog` for a like-for-like run.
    #[arg(long, default_value_t = 20_000)]
    peer_backlog: usize,
    /// Rows expired per arm by P3 (plain inbox purge vs partition drop).
    #[arg(long, default_value_t = 200_000)]
    expiry_rows: usize,
    /// Short run for CI: clients 1,4, 1 s per workload, 10k backlog, 20k rows for P3.
    #[arg(long)]
    quick: bool,
    /// Only workloads whose id starts with one of these (e.g. `I1,O2`).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    #[command(flatten)]
    soak: soak::SoakArgs,
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
    statements: String,
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

/// `n_dead_tup` of the tables named `table` (in every schema, or in one: `schema.table`) and
/// of their partitions (the partitioned inbox's live partitions; a dropped one has none).
async fn dead_tuples(pool: &PgPool, table: &str) -> anyhow::Result<i64> {
    let (schema, table) = match table.split_once('.') {
        Some((s, t)) => (Some(s), t),
        None => (None, table),
    };
    // Backends flush their statistics at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    dead_tuples_flushed(pool, schema, table).await
}

/// `dead_tuples` without the wait, for statistics already flushed.
async fn dead_tuples_flushed(
    pool: &PgPool,
    schema: Option<&str>,
    table: &str,
) -> anyhow::Result<i64> {
    let mut conn = pool.acquire().await?;
    conn.execute("SELECT pg_stat_clear_snapshot()").await?;
    Ok(sqlx::query_scalar(
        "SELECT coalesce(sum(s.n_dead_tup), 0)::bigint FROM pg_stat_user_tables AS s \
         WHERE ($2::text IS NULL OR s.schemaname = $2) \
           AND (s.relname = $1 OR s.relid IN (SELECT h.inhrelid FROM pg_inherits AS h \
                 JOIN pg_class AS c ON c.oid = h.inhparent WHERE c.relname = $1))",
    )
    .bind(table)
    .bind(schema)
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

/// Whether the harness's pools ping idle connections on acquire (sqlx's default).
static PING: OnceLock<bool> = OnceLock::new();

/// Pool options for every pool the harness measures through.
fn pool_options(max: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(*PING.get().unwrap_or(&true))
}

/// Counts the statements sqlx runs inside a scope, per task, from its `sqlx::query` log
/// events: one per statement, except BEGIN (and SAVEPOINT), which sqlx sends without a log
/// event: each COMMIT, ROLLBACK or RELEASE SAVEPOINT counts one more for the statement that
/// opened it. Not counted: a ROLLBACK that sqlx queues when a transaction is dropped (no
/// operation measured here does that; the relay's empty rounds do, see `drain_backlog`), and
/// pool pings, which are not statements. Nothing is counted, or formatted, outside a scope.
mod statements {
    use std::future::Future;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    use tracing::field::{Field, Visit};
    use tracing::level_filters::LevelFilter;
    use tracing::subscriber::Interest;
    use tracing::{Event, Metadata, Subscriber, span};

    const TARGET: &str = "sqlx::query";

    tokio::task_local! {
        static COUNTER: Arc<AtomicU64>;
    }

    struct Counter;

    impl Subscriber for Counter {
        fn register_callsite(&self, m: &'static Metadata<'static>) -> Interest {
            if m.target() == TARGET {
                Interest::sometimes()
            } else {
                Interest::never()
            }
        }
        fn enabled(&self, m: &Metadata<'_>) -> bool {
            m.target() == TARGET && COUNTER.try_with(|_| ()).is_ok()
        }
        fn max_level_hint(&self) -> Option<LevelFilter> {
            Some(LevelFilter::TRACE)
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, e: &Event<'_>) {
            if e.metadata().target() == TARGET {
                let mut ends = EndsTransaction::default();
                e.record(&mut ends);
                // A transaction's end also counts the BEGIN that sqlx sends without an event;
                // a simple query that starts with its own BEGIN (`process_and_commit`) has
                // that round trip counted already.
                let n = 1 + u64::from(ends.ends) - u64::from(ends.begins);
                let _ = COUNTER.try_with(|c| c.fetch_add(n, Relaxed));
            }
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }

    /// Whether the statement (its `summary` field) ends a transaction or savepoint, and
    /// whether it starts with BEGIN; a simple query of several statements is judged by its
    /// parts.
    #[derive(Default)]
    struct EndsTransaction {
        ends: bool,
        begins: bool,
    }

    impl EndsTransaction {
        fn check(&mut self, field: &Field, text: &str) {
            if field.name() == "summary" {
                let t = text.trim_matches('"').to_ascii_uppercase();
                let mut parts = t.split(';').map(str::trim).filter(|p| !p.is_empty());
                let first = parts.next().unwrap_or("");
                self.begins = first.starts_with("BEGIN");
                self.ends = std::iter::once(first).chain(parts).any(|p| {
                    ["COMMIT", "ROLLBACK", "RELEASE", "END"]
                        .iter()
                        .any(|w| p.starts_with(w))
                });
            }
        }
    }

    impl Visit for EndsTransaction {
        fn record_str(&mut self, field: &Field, value: &str) {
            self.check(field, value);
        }
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            self.check(field, &format!("{value:?}"));
        }
    }

    pub(crate) fn install() -> anyhow::Result<()> {
        tracing::subscriber::set_global_default(Counter)?;
        Ok(())
    }

    /// Runs `f`, counting its statements into `counter`.
    pub(crate) async fn scope<F: Future>(counter: Arc<AtomicU64>, f: F) -> F::Output {
        COUNTER.scope(counter, f).await
    }
}

/// Statements per operation as measured, flagged when it differs from the shape the code
/// is expected to have.
fn format_statements(per_op: f64, msgs: u64, expected: &str) -> String {
    let n = if (per_op - per_op.round()).abs() < 0.01 {
        format!("{}", per_op.round() as u64)
    } else {
        format!("{per_op:.2}")
    };
    let shown = if msgs > 1 {
        format!("{n}/batch")
    } else {
        n.clone()
    };
    if n == expected {
        shown
    } else {
        format!("{shown} (expected {expected})")
    }
}

/// First `i` of the probe that counts statements after a measurement (keys no measured
/// operation uses).
const PROBE_BASE: u64 = 1 << 40;
const PROBE_OPS: u64 = 20;

/// The `pg_advisory_lock` class of the relay's asleep lock (`ASLEEP_LOCK_CLASS` in
/// src/outbox/mod.rs, crate-private), keyed by `hashtext(schema)`.
const ASLEEP_LOCK_CLASS: i32 = 0x7062_6f7a;

/// What runs next to a workload.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Background {
    Nothing,
    /// A relay (no-op publisher, `WakeUp::Notify`, defaults otherwise) started before the
    /// workload and asleep (holding the asleep lock) when the workload starts.
    RelayAsleep,
    /// A session holding the asleep lock throughout and never waking: every producing
    /// commit notifies, as with the per-commit NOTIFY trigger of earlier versions.
    AsleepLockHeld,
}

struct Running {
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
    notifications: Arc<AtomicU64>,
    holder: Option<sqlx::PgConnection>,
}

/// Whether some session holds the asleep lock of schema `pgbox` exclusively.
async fn asleep_lock_held(pool: &PgPool) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND classid::text::bigint = $1 \
           AND objid::text::bigint = (hashtext('pgbox')::bigint & 4294967295) \
           AND mode = 'ExclusiveLock' AND granted)",
    )
    .bind(ASLEEP_LOCK_CLASS as i64)
    .fetch_one(pool)
    .await?)
}

async fn start_background(
    pool: &PgPool,
    options: &PgConnectOptions,
    kind: Background,
) -> anyhow::Result<Option<Running>> {
    if kind == Background::Nothing {
        return Ok(None);
    }
    let shutdown = CancellationToken::new();
    let notifications = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    // Counts the notifying commits.
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen("pgbox.outbox").await?;
    tasks.push(tokio::spawn({
        let (s, n) = (shutdown.clone(), notifications.clone());
        async move {
            loop {
                tokio::select! {
                    _ = s.cancelled() => return Ok(()),
                    r = listener.recv() => { r?; n.fetch_add(1, Relaxed); }
                }
            }
        }
    }));
    let mut holder = None;
    match kind {
        Background::Nothing => {}
        Background::RelayAsleep => {
            let rpool = pool_options(3).connect_with(options.clone()).await?;
            let relay = Relay::builder(rpool, DiscardPublisher)
                .wake_up(WakeUp::Notify)
                .build()?;
            let s = shutdown.clone();
            tasks.push(tokio::spawn(async move {
                relay.run(s).await?;
                Ok(())
            }));
        }
        Background::AsleepLockHeld => {
            let mut conn = sqlx::PgConnection::connect_with(options).await?;
            sqlx::query("SELECT pg_advisory_lock($1, hashtext('pgbox'))")
                .bind(ASLEEP_LOCK_CLASS)
                .execute(&mut conn)
                .await?;
            holder = Some(conn);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !asleep_lock_held(pool).await? {
        anyhow::ensure!(Instant::now() < deadline, "no relay fell asleep within 5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(Some(Running {
        shutdown,
        tasks,
        notifications,
        holder,
    }))
}

impl Running {
    /// Stops it; the number of notifications seen.
    async fn stop(self) -> anyhow::Result<u64> {
        // Let the last notifications arrive.
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.shutdown.cancel();
        for t in self.tasks {
            t.await??;
        }
        if let Some(conn) = self.holder {
            conn.close().await?;
        }
        Ok(self.notifications.load(Relaxed))
    }
}

struct Bench {
    args: Args,
    pool: PgPool,
    options: PgConnectOptions,
    rows: Vec<Row>,
    baselines: HashMap<(String, usize), f64>,
    /// Runs next to the workloads while set.
    background: Background,
    /// Printed after the table.
    notes: Vec<String>,
}

impl Bench {
    fn wanted(&self, id: &str) -> bool {
        self.args.only.is_empty() || self.args.only.iter().any(|p| id.starts_with(p.as_str()))
    }

    async fn pool_for(&self, clients: usize) -> anyhow::Result<PgPool> {
        Ok(pool_options(clients as u32 + 2)
            .connect_with(self.options.clone())
            .await?)
    }

    /// Runs one workload at every client count; `msgs` messages per op; `statements` is
    /// the statement count per op the code should have (measured after each run by a probe
    /// of `PROBE_OPS` operations, and flagged if different). (Positional arguments keep
    /// each workload's definition on a few lines below.)
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
            let background = start_background(&self.pool, &self.options, self.background).await?;
            let pool = self.pool_for(clients).await?;
            let duration = Duration::from_secs_f64(self.args.duration);
            let sample = measure(&pool, clients, duration, op.clone()).await?;
            pool.close().await;
            if let Some(background) = background {
                let n = background.stop().await?;
                self.notes.push(format!(
                    "{id} @ {clients} clients: {n} notifications for {} committed transactions ({:.1} %)",
                    sample.ops,
                    100.0 * n as f64 / sample.ops.max(1) as f64
                ));
            }
            let rate = (sample.ops * msgs) as f64 / sample.seconds;
            let dead = match table {
                Some(t) => Some(dead_tuples(&self.pool, t).await?),
                None => None,
            };
            // The probe: a few operations to warm the statement cache, then count.
            let probe = self.pool_for(1).await?;
            for j in 0..3 {
                op(probe.clone(), PROBE_BASE + j).await?;
            }
            let counted = Arc::new(AtomicU64::new(0));
            statements::scope(counted.clone(), async {
                for j in 3..3 + PROBE_OPS {
                    op(probe.clone(), PROBE_BASE + j).await?;
                }
                anyhow::Ok(())
            })
            .await?;
            probe.close().await;
            let per_op = counted.load(Relaxed) as f64 / PROBE_OPS as f64;
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
                statements: format_statements(per_op, msgs, statements),
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

/// O1's and W1's operation: BEGIN, a business INSERT, `n` messages through `outbox` (one
/// `enqueue`, or one `enqueue_batch`; keyed over 1000 keys if `keyed`), COMMIT.
fn enqueue_op(outbox: Outbox, payload: Arc<str>, n: usize, keyed: bool) -> Op {
    Arc::new(move |pool, i| {
        let (p, outbox) = (payload.clone(), outbox.clone());
        boxed(async move {
            let mut tx = pool.begin().await?;
            sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
                .bind(format!("k{i}"))
                .bind(&*p)
                .execute(&mut *tx)
                .await?;
            let message = |j: usize| {
                let m = Message::bytes("bench", p.as_bytes().to_vec());
                if keyed {
                    m.ordering_key(format!("e{}", (i as usize * n + j) % 1000))
                } else {
                    m
                }
            };
            if n == 1 {
                outbox.enqueue(&mut tx, message(0)).await?;
            } else {
                outbox.enqueue_batch(&mut tx, (0..n).map(message)).await?;
            }
            tx.commit().await?;
            Ok(())
        })
    })
}

fn boxed<F: Future<Output = anyhow::Result<()>> + Send + 'static>(f: F) -> OpFuture {
    Box::pin(f)
}

/// I1's operation (and P1's): a new key `k{i}` through `inbox.process`, whose handler inserts
/// the business row through the `HandlerConnection` wrapper.
fn process_new(inbox: Inbox, payload: Arc<str>) -> Op {
    Arc::new(move |pool, i| {
        let (p, inbox) = (payload.clone(), inbox.clone());
        boxed(async move {
            let key = format!("k{i}");
            let mut tx = pool.begin().await?;
            let outcome = inbox
                .process(&mut tx, key.as_str(), async |conn| {
                    insert_effect(conn, &key, &p).await
                })
                .await?;
            tx.commit().await?;
            anyhow::ensure!(outcome.is_processed());
            Ok(())
        })
    })
}

/// The I1 handlers' business write.
async fn insert_effect(
    conn: &mut pgbox::HandlerConnection<'_>,
    key: &str,
    payload: &str,
) -> Result<(), Error> {
    sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
        .bind(key)
        .bind(payload)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// I1c's operation: `inbox.process_and_commit`, pgbox opening and committing the transaction
/// (sqlx's BEGIN, the claim, the handler's INSERT, COMMIT: 4 round trips, as `process`).
fn process_and_commit_new(inbox: Inbox, payload: Arc<str>) -> Op {
    Arc::new(move |pool, i| {
        let (p, inbox) = (payload.clone(), inbox.clone());
        boxed(async move {
            let key = format!("k{i}");
            let outcome = inbox
                .process_and_commit(&pool, key.as_str(), async |conn| {
                    insert_effect(conn, &key, &p).await
                })
                .await?;
            anyhow::ensure!(outcome.is_processed());
            Ok(())
        })
    })
}

/// Keys recorded before I2 and P2, cycled through by their operation.
const DUP_KEYS: u64 = 5_000;

/// I2's operation (and P2's): a recorded key through `inbox.process`, a duplicate.
fn process_duplicate(inbox: Inbox) -> Op {
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
    })
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
    if args.soak.soak {
        return soak::run(&args.soak, args.payload).await;
    }
    if args.quick {
        args.clients = vec![1, 4];
        args.duration = 1.0;
        args.backlog = args.backlog.min(10_000);
        args.peer_backlog = args.peer_backlog.min(10_000);
        args.expiry_rows = args.expiry_rows.min(20_000);
    }
    // CE1 needs no database: run it first, and alone when it is all that was asked for.
    let wanted =
        |id: &str| args.only.is_empty() || args.only.iter().any(|p| id.starts_with(p.as_str()));
    if wanted("CE1") {
        cloudevents::run();
        if !args.only.is_empty() && args.only.iter().all(|p| "CE1".starts_with(p.as_str())) {
            return Ok(());
        }
    }
    PING.set(!args.no_ping).expect("set once");
    statements::install()?;
    let mut server = local_pg::database_url()
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    if args.rtt > 0.0 {
        server = delay_proxy::start(&server, Duration::from_secs_f64(args.rtt / 2_000.0)).await?;
        // The timer rounds each hold up to its 1 ms tick: say what the network really is.
        let mut probe = sqlx::PgConnection::connect(&server).await?;
        let mut trips = Vec::new();
        for _ in 0..30 {
            let started = Instant::now();
            probe.execute("SELECT 1").await?;
            trips.push(started.elapsed());
        }
        probe.close().await?;
        trips.sort();
        println!(
            "network: simulated round trip {} ms asked, {:.2} ms measured (median of 30 `SELECT 1`; proxy {server})",
            args.rtt,
            trips[trips.len() / 2].as_secs_f64() * 1e3
        );
    }
    // A database of this run's own, dropped at the end: nothing the bench did not create is
    // ever dropped.
    let database = format!("pgbox_bench_{}", uuid::Uuid::now_v7().simple());
    let mut admin = sqlx::PgConnection::connect(&server).await?;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE \"{database}\""
        )))
        .await?;
    let options = PgConnectOptions::from_str(&server)?.database(&database);
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options.clone())
        .await?;
    let pool08 = peers::pool08(&server, &database).await?;
    pgbox::migrate(&pool).await?;
    pool.execute("CREATE TABLE bench_effects (k text NOT NULL, payload text NOT NULL)")
        .await?;
    peers::setup(&pool, &options).await?;
    fingerprint(&pool).await?;
    println!(
        "run: clients={:?} duration={}s payload={}B batch={} relay-batch={} backlog={} (peer backlog {}) pool ping={}",
        args.clients,
        args.duration,
        args.payload,
        args.batch,
        args.relay_batch,
        args.backlog,
        args.peer_backlog,
        if args.no_ping {
            "off"
        } else {
            "on (sqlx default)"
        }
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
        background: Background::Nothing,
        notes: Vec::new(),
    };

    // S1: scheduled messages (bench/src/scheduled.rs); only when asked for (`--only S1`).
    if bench.args.only.iter().any(|p| p.starts_with('S')) {
        scheduled::run(&bench.options, bench.args.quick).await?;
    }

    // T1-T3: the tenant relay (bench/src/tenants.rs); only when asked for (`--only T`).
    if bench.args.only.iter().any(|p| p.starts_with('T')) {
        tenants::run(&server, bench.args.quick, &bench.args.only).await?;
    }

    // F1: fan-out (bench/src/fanout.rs); only when asked for (`--only F1`).
    if bench.args.only.iter().any(|p| p.starts_with('F')) {
        fanout::run(&bench.options, bench.args.quick).await?;
    }

    // J1, J2: the job-queue peers (bench/src/jobqueues.rs); only when asked for (`--only J`).
    if bench.args.only.iter().any(|p| p.starts_with('J')) {
        #[cfg(not(feature = "job-queues"))]
        anyhow::bail!("J1/J2 need the job-queue peers: add `--features job-queues`");
        #[cfg(feature = "job-queues")]
        jobqueues::run(&server, &database, bench.args.quick).await?;
    }

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

    // I1: new messages through inbox.process: BEGIN, claim (bare INSERT … ON CONFLICT DO
    // NOTHING RETURNING), the handler's INSERT, COMMIT. The handler runs its statement through
    // the HandlerConnection wrapper and it succeeds, so no liveness check is sent, whether
    // verify_transaction is on or off: 4 statements either way.
    for (id, verify, stmts) in [
        ("I1 inbox.process", true, "4"),
        ("I1 inbox.process (no verify)", false, "4"),
    ] {
        let inbox = Inbox::builder("bench").verify_transaction(verify).build()?;
        bench
            .run(
                id,
                1,
                stmts,
                Some("inbox"),
                Some("B0 BEGIN/INSERT/COMMIT"),
                None,
                process_new(inbox, payload.clone()),
            )
            .await?;
    }
    // I1c: the same through `process_and_commit`, which opens sqlx's own transaction (so a
    // handler's nested unit is a savepoint): BEGIN, claim, INSERT, COMMIT.
    bench
        .run(
            "I1c inbox.process_and_commit",
            1,
            "4",
            Some("inbox"),
            Some("B0 BEGIN/INSERT/COMMIT"),
            None,
            process_and_commit_new(Inbox::new("bench")?, payload.clone()),
        )
        .await?;
    // The same handler taking the raw connection (`&mut **conn`, as code that wants a
    // `&mut PgConnection` does): pgbox cannot watch it, so it checks the transaction with
    // a liveness check (one SELECT) after the handler: 5 statements.
    let p = payload.clone();
    let inbox = Inbox::new("bench")?;
    bench
        .run(
            "I1 inbox.process (raw connection: checked)",
            1,
            "5",
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
                            let raw: &mut sqlx::PgConnection = conn;
                            sqlx::query("INSERT INTO bench_effects VALUES ($1, $2)")
                                .bind(&key)
                                .bind(&*p)
                                .execute(raw)
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
    // BEGIN, the claim (inserts nothing; its second branch reads the stored record), COMMIT.
    bench
        .run(
            "I2 inbox.process, 100% duplicates",
            1,
            "3",
            Some("inbox"),
            Some("B0 BEGIN/INSERT/COMMIT"),
            Some(&preload),
            process_duplicate(Inbox::new("bench")?),
        )
        .await?;
    // I2c: duplicates through `process_and_commit`: BEGIN, the claim (inserts nothing, reads
    // the stored record), ROLLBACK.
    let inbox = Inbox::new("bench")?;
    bench
        .run(
            "I2c inbox.process_and_commit, 100% duplicates",
            1,
            "3",
            Some("inbox"),
            Some("B0 BEGIN/INSERT/COMMIT"),
            Some(&preload),
            Arc::new(move |pool, i| {
                let inbox = inbox.clone();
                boxed(async move {
                    let key = format!("k{}", i % DUP_KEYS);
                    let outcome = inbox
                        .process_and_commit(&pool, key.as_str(), async |_c| Ok::<(), Error>(()))
                        .await?;
                    anyhow::ensure!(outcome.is_duplicate(), "expected a duplicate");
                    Ok(())
                })
            }),
        )
        .await?;
    // I2f: the redelivery fast path: one autocommit SELECT (`Inbox::lookup`), no transaction.
    let inbox = Inbox::new("bench")?;
    bench
        .run(
            "I2f inbox.lookup fast path, 100% duplicates",
            1,
            "1",
            Some("inbox"),
            Some("B0 BEGIN/INSERT/COMMIT"),
            Some(&preload),
            Arc::new(move |pool, i| {
                let inbox = inbox.clone();
                boxed(async move {
                    let key = format!("k{}", i % DUP_KEYS);
                    let found = inbox.lookup(&pool, key.as_str()).await?;
                    anyhow::ensure!(found.is_some(), "expected a duplicate");
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
            "5",
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

    // O1: enqueue in the business transaction: BEGIN, business INSERT, enqueue (one
    // statement: `Outbox::enqueue` of one message is an INSERT … VALUES, `enqueue_batch` one
    // unnest INSERT; either way the asleep-lock probe and the NOTIFY, when one is due, ride on
    // it), COMMIT. One message per transaction, unkeyed: with no relay; with a relay asleep
    // (running, idle, WakeUp::Notify: producers notify only while it sleeps, and it wakes and
    // drains); with the asleep lock held by a session that never wakes (every commit
    // notifies, as the NOTIFY trigger of earlier versions did). Then keyed (the per-key
    // advisory lock), and 100 keyed messages per transaction.
    for (id, background, keyed, n) in [
        (
            "O1 enqueue 1 per tx (no relay)",
            Background::Nothing,
            false,
            1usize,
        ),
        (
            "O1 enqueue 1 per tx (relay asleep)",
            Background::RelayAsleep,
            false,
            1,
        ),
        (
            "O1 enqueue 1 per tx (every commit notifies)",
            Background::AsleepLockHeld,
            false,
            1,
        ),
        (
            "O1 enqueue 1 per tx, keyed (1000 keys, no relay)",
            Background::Nothing,
            true,
            1,
        ),
        ("O1 enqueue 100 per tx", Background::Nothing, true, 100),
    ] {
        let p = payload.clone();
        let outbox = Outbox::new();
        bench.background = background;
        bench
            .run(
                id,
                n as u64,
                "4",
                Some("outbox"),
                if n == 1 {
                    Some("B0 BEGIN/INSERT/COMMIT")
                } else {
                    None
                },
                None,
                enqueue_op(outbox, p, n, keyed),
            )
            .await?;
        bench.background = Background::Nothing;
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

    // O2: drain an unkeyed backlog; O2k: a keyed one, over 100 keys and over 1 key. Each
    // relay round is BEGIN (with the plan settings), the keyed-drain lock, claim, DELETE of
    // the published rows, COMMIT. Into the built-in queue the DELETE also inserts the rows
    // into the queue (one statement, and the claim leaves the payloads on the server);
    // published through the queue's pool, the queue's INSERT runs on a connection and in a
    // transaction of its own, with every payload sent back. The final empty round is BEGIN
    // and claim. The non-atomic no-op publisher (`atomic_batches() == false`) gets waves:
    // one call per position in a key's run, which is a broker round trip each with a real
    // broker.
    // A drain slower than 5,000 msgs/s (at least 20 s; 3 s in quick mode) is stopped and
    // reported at the rate it reached.
    let drain_limit = Duration::from_secs_f64(if args.quick {
        3.0
    } else {
        (args.backlog as f64 / 5_000.0).max(20.0)
    });
    let mut drains: Vec<(Option<usize>, Sink)> = vec![
        (None, Sink::Discard),
        (None, Sink::Queue),
        (None, Sink::QueuePublished),
    ];
    for keys in [100usize, 1] {
        for sink in [
            Sink::Discard,
            Sink::Waves,
            Sink::Queue,
            Sink::QueuePublished,
        ] {
            drains.push((Some(keys), sink));
        }
    }
    for (keys, sink) in drains {
        for relays in [1usize, 4] {
            let id = match keys {
                None => format!("O2 drain {} ({})", args.backlog, sink.name()),
                Some(k) => format!(
                    "O2k drain {} over {k} key{} ({})",
                    args.backlog,
                    if k == 1 { "" } else { "s" },
                    sink.name()
                ),
            };
            if !bench.wanted(&id) {
                continue;
            }
            reset(&pool).await?;
            fill_backlog(&pool, args.backlog, keys, &payload).await?;
            let start_lsn = wal_lsn(&pool).await?;
            let d = drain_backlog(
                &bench.options,
                args.backlog,
                relays,
                args.relay_batch,
                sink,
                drain_limit,
            )
            .await?;
            let wal = wal_since(&pool, &start_lsn).await?;
            let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
                .fetch_one(&pool)
                .await?;
            anyhow::ensure!(
                d.timed_out || left == 0,
                "{id}: {left} messages left after the drain"
            );
            let rate = d.published as f64 / d.seconds;
            if d.timed_out {
                bench.notes.push(format!(
                    "{id} @ {relays} relays: stopped after {:.0} s with {} of {} published",
                    d.seconds, d.published, args.backlog
                ));
            }
            if sink == Sink::Waves {
                bench.notes.push(format!(
                    "{id} @ {relays} relays: {} publisher calls for {} messages ({:.1} messages per call)",
                    d.publish_calls,
                    d.published,
                    d.published as f64 / d.publish_calls.max(1) as f64
                ));
            }
            let row = Row {
                id: if d.timed_out {
                    format!("{id} (stopped at {:.0} s)", d.seconds)
                } else {
                    id.clone()
                },
                clients: relays,
                rate,
                p50: Duration::ZERO,
                p99: Duration::ZERO,
                ratio: None,
                wal_per_msg: wal / d.published.max(1) as f64,
                statements: format!(
                    "{:.1}/round × {} rounds ({} published nothing, {} claimed nothing)",
                    d.statements as f64 / d.rounds.max(1) as f64,
                    d.rounds,
                    d.empty_rounds,
                    d.idle_rounds
                ),
                dead_tuples: if keys.is_none() {
                    Some(dead_tuples(&pool, "outbox").await?)
                } else {
                    None
                },
            };
            if keys.is_none() {
                bench
                    .baselines
                    .insert((format!("O2 {}", sink.name()), relays), row.rate);
            }
            print_row(&row);
            bench.rows.push(row);
        }
    }

    // Peer: sqlxmq draining the same backlog with a no-op job.
    if bench.wanted("O2 peer") {
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
                statements: "-".into(),
                dead_tuples: Some(dead_tuples(&pool, "mq_msgs").await?),
            };
            print_row(&row);
            bench.rows.push(row);
        }
    }

    // W: the WAL outbox (`OutboxMode::Wal`, `WalRelay`), only on a server with
    // wal_level = logical (run the whole bench against one, so B0 and O1 are in the same run).
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(&pool)
        .await?;
    if wal_level != "logical" {
        if bench.wanted("W") {
            bench.notes.push(format!(
                "W rows (the WAL outbox) not run: this server has wal_level = {wal_level}; run \
                 the bench with DATABASE_URL on a server with wal_level = logical"
            ));
        }
    } else {
        wal_rows(&mut bench, &pool, &payload, batch, drain_limit).await?;
    }

    // O3: commit → publish latency, from the producer's COMMIT returning to the publisher's
    // call holding the message. First at half the no-op drain rate (capped by what one
    // producer task can commit), unkeyed; then at 100 messages/s, where the relay falls
    // asleep between messages (every message wakes it), unkeyed (O3) and over 10 keys (O3k).
    // NOTIFY (the default) vs poll-only (100 ms).
    let drain = bench
        .baselines
        .get(&("O2 no-op publisher".to_owned(), 1))
        .copied()
        .unwrap_or(2_000.0);
    let busy = (drain / 2.0).min(2_000.0);
    let mut latency_runs: Vec<(&str, Option<usize>, f64)> = vec![("O3", None, busy)];
    latency_runs.push(("O3", None, 100.0));
    latency_runs.push(("O3k", Some(10), 100.0));
    for (prefix, keys, rate) in latency_runs {
        for (wake, poll) in [
            (WakeUp::Notify, Duration::from_secs(1)),
            (WakeUp::Poll, Duration::from_millis(100)),
        ] {
            let id = format!(
                "{prefix} commit→publish ({wake:?}, poll {poll:?}, {}) @ {rate:.0}/s{}",
                match keys {
                    None => "unkeyed".to_owned(),
                    Some(k) => format!("{k} keys"),
                },
                if rate <= 100.0 { ", relay idle" } else { "" }
            );
            if !bench.wanted(&id) {
                continue;
            }
            reset(&pool).await?;
            let row = latency_run(
                &bench.options,
                &payload,
                LatencyRun {
                    id,
                    rate,
                    duration: Duration::from_secs_f64(args.duration.max(2.0)),
                    wake,
                    poll,
                    keys,
                    batch: args.relay_batch,
                    wal: None,
                },
            )
            .await?;
            print_row(&row);
            bench.rows.push(row);
        }
    }

    // P1, P2: the time-partitioned inbox (migration V10) in a schema of its own (1-hour
    // partitions, 2 created ahead, no minimum retention), through an Inbox built with
    // `partitioned(true)`: I1's and I2's operations, unchanged. At each client count the plain
    // inbox's arm (the same operation on `pgbox.inbox`, as in I1 and I2) runs first and the
    // partitioned one right after it, and the partitioned row's ratio is to that arm. The
    // partitioned claim is one statement, a function: advisory lock on (consumer, key),
    // look-up in every partition (each one's unique index) and in the schema's plain inbox,
    // insert into the partition of the transaction's start time; it returns a duplicate's
    // record itself. New: BEGIN, claim, the handler's INSERT, COMMIT; duplicate: BEGIN, claim,
    // COMMIT. The row label gives how many partitions were attached (and so probed).
    let p1_plain = "P1 plain inbox.process (I1 arm)";
    let p2_plain = "P2 plain inbox.process, 100% duplicates (I2 arm)";
    if [p1_plain, p2_plain, "P1 partitioned", "P2 partitioned"]
        .iter()
        .any(|id| bench.wanted(id))
    {
        // The schema is also spelled out in the statements below (`run_each` takes literals).
        const PART_SCHEMA: &str = "pgbox_part";
        Migrator::new()
            .schema(PART_SCHEMA)?
            .partitioned_inbox(
                InboxPartitioning::every(Duration::from_secs(3600))
                    .minimum_retention(Duration::ZERO)
                    .ahead(2),
            )
            .run(&pool)
            .await?;
        let partitions = InboxPartitions::new(pool.clone()).schema(PART_SCHEMA)?;
        let part_inbox = Inbox::builder("bench")
            .schema(PART_SCHEMA)
            .partitioned(true)
            .build()?;
        let clear_part = |pool: PgPool| {
            boxed(async move {
                run_each(
                    &pool,
                    &[
                        "TRUNCATE pgbox_part.partitioned_inbox",
                        "VACUUM (ANALYZE) pgbox_part.partitioned_inbox",
                        "SELECT pg_stat_reset()",
                    ],
                )
                .await
            })
        };
        let preload_part = |pool: PgPool| {
            boxed(async move {
                run_each(
                    &pool,
                    &[
                        "TRUNCATE pgbox_part.partitioned_inbox",
                        "INSERT INTO pgbox_part.partitioned_inbox (consumer, key) \
                         SELECT 'bench', 'k' || g FROM generate_series(0, 4999) g",
                        "VACUUM (ANALYZE) pgbox_part.partitioned_inbox",
                        "SELECT pg_stat_reset()",
                    ],
                )
                .await
            })
        };
        let saved_clients = bench.args.clients.clone();
        for workload in ["P1", "P2"] {
            for &clients in &saved_clients {
                bench.args.clients = vec![clients];
                let live = partitions.list().await?.len();
                if workload == "P1" {
                    bench
                        .run(
                            p1_plain,
                            1,
                            "4",
                            Some("pgbox.inbox"),
                            None,
                            None,
                            process_new(Inbox::new("bench")?, payload.clone()),
                        )
                        .await?;
                    bench
                        .run(
                            &format!("P1 partitioned inbox.process ({live} partitions)"),
                            1,
                            "4",
                            Some("pgbox_part.partitioned_inbox"),
                            Some(p1_plain),
                            Some(&clear_part),
                            process_new(part_inbox.clone(), payload.clone()),
                        )
                        .await?;
                } else {
                    bench
                        .run(
                            p2_plain,
                            1,
                            "3",
                            Some("pgbox.inbox"),
                            None,
                            Some(&preload),
                            process_duplicate(Inbox::new("bench")?),
                        )
                        .await?;
                    bench
                        .run(
                            &format!(
                                "P2 partitioned inbox.process, 100% duplicates ({live} partitions)"
                            ),
                            1,
                            "3",
                            Some("pgbox_part.partitioned_inbox"),
                            Some(p2_plain),
                            Some(&preload_part),
                            process_duplicate(part_inbox.clone()),
                        )
                        .await?;
                }
            }
        }
        bench.args.clients = saved_clients;
        bench.notes.push(format!(
            "P1, P2: partitioned inbox in schema {PART_SCHEMA} (1-hour partitions, 2 ahead); \
             \"N partitions\" is how many were attached when the row ran: each claim probes \
             every one's (consumer, key) index, plus the schema's (empty) plain inbox. A \
             production layout (e.g. daily partitions for two weeks) has several times as many."
        ));
    }
    println!();
    println!(
        "ratio: msgs/s divided by the named baseline's msgs/s at the same client count, same run."
    );

    if bench.wanted("P3") {
        expiry(&pool, &bench.options, args.expiry_rows).await?;
    }
    if bench.wanted("A1") {
        archive::run(&pool, args.quick, args.backlog, args.relay_batch).await?;
    }
    if !bench.notes.is_empty() {
        println!();
        println!("notes:");
        for note in &bench.notes {
            println!("- {note}");
        }
    }
    pool.close().await;
    pool08.close().await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
        )))
        .await?;
    Ok(())
}

/// The backlog for O2: `n` messages, round-robin over `keys` ordering keys (or unkeyed).
async fn fill_backlog(
    pool: &PgPool,
    n: usize,
    keys: Option<usize>,
    payload: &str,
) -> anyhow::Result<()> {
    let outbox = Outbox::new();
    let mut done = 0;
    while done < n {
        let k = (n - done).min(5_000);
        let mut tx = pool.begin().await?;
        outbox
            .enqueue_batch(
                &mut tx,
                (done..done + k).map(|i| {
                    let m = Message::bytes("bench", payload.as_bytes().to_vec());
                    match keys {
                        Some(keys) => m.ordering_key(format!("key{}", i % keys)),
                        None => m,
                    }
                }),
            )
            .await?;
        tx.commit().await?;
        done += k;
    }
    run_each(
        pool,
        &["VACUUM (ANALYZE) pgbox.outbox", "SELECT pg_stat_reset()"],
    )
    .await?;
    Ok(())
}

/// Runs per arm of P3.
const EXPIRY_RUNS: usize = 3;

/// One timed expiry of P3.
struct Expiry {
    seconds: f64,
    rows: u64,
    wal_bytes: f64,
    statements: u64,
    dead_tuples: i64,
    /// Partitions dropped by the timed call (partitioned arm).
    partitions: Option<usize>,
}

impl Expiry {
    fn rate(&self) -> f64 {
        self.rows as f64 / self.seconds
    }

    fn wal_per_row(&self) -> f64 {
        self.wal_bytes / self.rows.max(1) as f64
    }
}

/// After both arms of a P3 run: the dead tuples their expiry left in the inbox table (and
/// its partitions), and a check that no row is left.
async fn expiry_leftovers(
    pool: &PgPool,
    e: &mut Expiry,
    schema: &str,
    table: &str,
) -> anyhow::Result<()> {
    e.dead_tuples = dead_tuples_flushed(pool, Some(schema), table).await?;
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {schema}.{table}"
    )))
    .fetch_one(pool)
    .await?;
    anyhow::ensure!(left == 0, "P3: {left} rows left in {schema}.{table}");
    Ok(())
}

/// Times `expire` on `own`, a pool of one connection of its own, warmed up by the caller
/// (the statements prepared, the backend's catalog caches loaded): wall time, WAL,
/// statements. Then closes `own` and waits for its backend to exit: an exiting backend
/// flushes its statistics before it leaves `pg_stat_activity`, so `dead_tuples_flushed`
/// sees all of them without a wait.
async fn timed_expiry<Fut, T>(
    pool: &PgPool,
    own: PgPool,
    expire: Fut,
) -> anyhow::Result<(T, f64, f64, u64)>
where
    Fut: Future<Output = pgbox::Result<T>>,
{
    let pid = backend_pid(&own).await?;
    let counted = Arc::new(AtomicU64::new(0));
    let start_lsn = wal_lsn(pool).await?;
    let started = Instant::now();
    let result = statements::scope(counted.clone(), expire).await?;
    let seconds = started.elapsed().as_secs_f64();
    let wal_bytes = wal_since(pool, &start_lsn).await?;
    close_and_wait(pool, own, pid).await?;
    Ok((result, seconds, wal_bytes, counted.load(Relaxed)))
}

/// The backend of `own`, a pool of one connection.
async fn backend_pid(own: &PgPool) -> anyhow::Result<i32> {
    Ok(sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(own)
        .await?)
}

/// Closes `own` and waits for its backend `pid` to exit: an exiting backend flushes its
/// statistics before it leaves `pg_stat_activity`.
async fn close_and_wait(pool: &PgPool, own: PgPool, pid: i32) -> anyhow::Result<()> {
    own.close().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let gone: bool =
            sqlx::query_scalar("SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(pid)
                .fetch_one(pool)
                .await?;
        if gone {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "P3: backend {pid} still there after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// P3's plain arm, in a schema of its own (`pgbox_expiry_plain`, plain inbox): `rows` inbox
/// rows recorded an hour ago (one bulk INSERT … SELECT generate_series into the emptied
/// table), vacuumed, a CHECKPOINT, then `Inbox::purge_older_than(60 s)` (DELETEs of 5,000
/// rows each) timed. The table is emptied and filled on a connection that is gone before the
/// purge: a backend flushes a TRUNCATE's statistics (which zero the table's dead tuples) up to
/// 10 s late, which could wipe the purge's count. Nothing else touches the table.
async fn expire_plain(
    pool: &PgPool,
    options: &PgConnectOptions,
    rows: usize,
) -> anyhow::Result<Expiry> {
    let prep = pool_options(1).connect_with(options.clone()).await?;
    let prep_pid = backend_pid(&prep).await?;
    run_each(&prep, &["TRUNCATE pgbox_expiry_plain.inbox"]).await?;
    let filled = sqlx::query(
        "INSERT INTO pgbox_expiry_plain.inbox (consumer, key, processed_at) \
         SELECT 'bench', 'k' || g, now() - interval '1 hour' FROM generate_series(1, $1) AS g",
    )
    .bind(rows as i64)
    .execute(&prep)
    .await?
    .rows_affected();
    anyhow::ensure!(filled == rows as u64, "P3: {filled} of {rows} rows filled");
    run_each(
        &prep,
        &["VACUUM (ANALYZE) pgbox_expiry_plain.inbox", "CHECKPOINT"],
    )
    .await?;
    close_and_wait(pool, prep, prep_pid).await?;
    let own = pool_options(1).connect_with(options.clone()).await?;
    // Warm-up: the same statement for a consumer that has no rows.
    let warm_up = Inbox::builder("bench-warm-up")
        .schema("pgbox_expiry_plain")
        .build()?;
    warm_up
        .purge_older_than(&own, Duration::from_secs(60))
        .await?;
    let inbox = Inbox::builder("bench")
        .schema("pgbox_expiry_plain")
        .build()?;
    let (deleted, seconds, wal_bytes, statements) = timed_expiry(
        pool,
        own.clone(),
        inbox.purge_older_than(&own, Duration::from_secs(60)),
    )
    .await?;
    anyhow::ensure!(
        deleted == rows as u64,
        "P3: purge deleted {deleted} of {rows} rows"
    );
    Ok(Expiry {
        seconds,
        rows: deleted,
        wal_bytes,
        statements,
        dead_tuples: 0,
        partitions: None,
    })
}

/// The first half of P3's partitioned arm: `rows` rows inserted with the default
/// `processed_at` (one bulk INSERT … SELECT generate_series, so one 1-second partition),
/// vacuumed. The schema keeps one partition ahead, and the fill waits for the start of the
/// one `create_ahead` made last, so its partition is the newest: the timed drop cannot take
/// an empty one created ahead along with it. Returns the partition's lower bound.
async fn fill_partitioned(
    pool: &PgPool,
    partitions: &InboxPartitions,
    rows: usize,
) -> anyhow::Result<time::OffsetDateTime> {
    partitions.create_ahead().await?;
    let newest = partitions.list().await?.pop();
    let newest = newest.ok_or_else(|| anyhow::anyhow!("P3: no partition created"))?;
    let until: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM $1::timestamptz - clock_timestamp())::float8",
    )
    .bind(newest.from)
    .fetch_one(pool)
    .await?;
    tokio::time::sleep(Duration::from_secs_f64(until.max(0.0) + 0.01)).await;
    let filled = sqlx::query(
        "INSERT INTO pgbox_expiry_part.partitioned_inbox (consumer, key) \
         SELECT 'bench', 'k' || g FROM generate_series(1, $1) AS g",
    )
    .bind(rows as i64)
    .execute(pool)
    .await?
    .rows_affected();
    anyhow::ensure!(filled == rows as u64, "P3: {filled} of {rows} rows filled");
    run_each(
        pool,
        &["VACUUM (ANALYZE) pgbox_expiry_part.partitioned_inbox"],
    )
    .await?;
    let holder: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT c.relname::text FROM pgbox_expiry_part.partitioned_inbox AS i \
         JOIN pg_class AS c ON c.oid = i.tableoid",
    )
    .fetch_all(pool)
    .await?;
    let listed = partitions.list().await?;
    let (Some(holder), 1) = (
        listed.iter().find(|p| holder.contains(&p.name)),
        holder.len(),
    ) else {
        anyhow::bail!("P3: rows filled into {holder:?}, not one partition of {listed:?}");
    };
    anyhow::ensure!(
        listed.last() == Some(holder),
        "P3: the filled partition is not the newest: {listed:?}"
    );
    Ok(holder.from)
}

/// The second half: once the partition is more than 2 s old (its rows more than 1 s past
/// its upper bound), the older (empty) partitions are dropped untimed, and then
/// `InboxPartitions::drop_expired(1 s)` timed, after a CHECKPOINT.
async fn expire_partitioned(
    pool: &PgPool,
    options: &PgConnectOptions,
    from: time::OffsetDateTime,
    rows: usize,
) -> anyhow::Result<Expiry> {
    let age = |pool: PgPool| async move {
        sqlx::query_scalar::<_, f64>(
            "SELECT extract(epoch FROM clock_timestamp() - $1::timestamptz)::float8",
        )
        .bind(from)
        .fetch_one(&pool)
        .await
    };
    let mut partition_age = age(pool.clone()).await?;
    if partition_age < 2.05 {
        tokio::time::sleep(Duration::from_secs_f64(2.05 - partition_age)).await;
        partition_age = age(pool.clone()).await?;
    }
    let own = pool_options(1).connect_with(options.clone()).await?;
    let own_partitions = InboxPartitions::new(own.clone()).schema("pgbox_expiry_part")?;
    // Untimed, and the warm-up: a retention of the partition's age drops the (empty)
    // partitions ending at or before its start, at least the one `create_ahead` made before it.
    let older = own_partitions
        .drop_expired(Duration::from_micros((partition_age * 1e6) as u64))
        .await?;
    anyhow::ensure!(
        older.iter().all(|p| p.to <= from),
        "P3: the untimed drop took the filled partition: {older:?}"
    );
    run_each(pool, &["CHECKPOINT"]).await?;
    let (dropped, seconds, wal_bytes, statements) = timed_expiry(
        pool,
        own.clone(),
        own_partitions.drop_expired(Duration::from_secs(1)),
    )
    .await?;
    Ok(Expiry {
        seconds,
        rows: rows as u64,
        wal_bytes,
        statements,
        dead_tuples: 0,
        partitions: Some(dropped.len()),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// P3: expiry of `rows` rows, plain inbox (batched DELETE) vs partitioned inbox (detach and
/// drop), `EXPIRY_RUNS` timed runs of each arm, interleaved; printed as a table of its own.
/// The partitioned fill of each run precedes the plain arm's timed purge, so that its
/// partition ages while the plain arm runs.
async fn expiry(pool: &PgPool, options: &PgConnectOptions, rows: usize) -> anyhow::Result<()> {
    Migrator::new()
        .schema("pgbox_expiry_plain")?
        .run(pool)
        .await?;
    Migrator::new()
        .schema("pgbox_expiry_part")?
        .partitioned_inbox(
            InboxPartitioning::every(Duration::from_secs(1))
                .minimum_retention(Duration::ZERO)
                .ahead(1),
        )
        .run(pool)
        .await?;
    let partitions = InboxPartitions::new(pool.clone()).schema("pgbox_expiry_part")?;
    let plain_id = "P3 plain Inbox::purge_older_than(60 s)";
    let part_id = "P3 partitioned InboxPartitions::drop_expired(1 s)";
    println!();
    println!(
        "P3 expiry of {rows} rows per inbox: {EXPIRY_RUNS} timed runs per arm, interleaved \
         (plain, partitioned, plain, …); each after a CHECKPOINT"
    );
    println!();
    println!(
        "| workload | run | rows | seconds | rows/s | ratio | WAL B/row | stmts | dead tuples |"
    );
    println!("|---|---|---:|---:|---:|---|---:|---:|---:|");
    let print = |id: &str, run: &str, e: &Expiry, ratio: &str| {
        println!(
            "| {id} | {run} | {} | {:.3} | {:.0} | {ratio} | {:.2} | {} | {} |",
            e.rows,
            e.seconds,
            e.rate(),
            e.wal_per_row(),
            e.statements,
            e.dead_tuples
        );
    };
    let (mut plain, mut part) = (Vec::new(), Vec::new());
    for run in 1..=EXPIRY_RUNS {
        let from = fill_partitioned(pool, &partitions, rows).await?;
        let mut p = expire_plain(pool, options, rows).await?;
        let mut e = expire_partitioned(pool, options, from, rows).await?;
        expiry_leftovers(pool, &mut p, "pgbox_expiry_plain", "inbox").await?;
        expiry_leftovers(pool, &mut e, "pgbox_expiry_part", "partitioned_inbox").await?;
        print(plain_id, &run.to_string(), &p, "-");
        plain.push(p);
        let dropped = e.partitions.unwrap_or(0);
        print(
            &format!(
                "{part_id}: {dropped} partition{} dropped",
                if dropped == 1 { "" } else { "s" }
            ),
            &run.to_string(),
            &e,
            "-",
        );
        part.push(e);
    }
    let summary = |runs: &[Expiry]| Expiry {
        seconds: median(runs.iter().map(|e| e.seconds).collect()),
        rows: runs[0].rows,
        wal_bytes: median(runs.iter().map(|e| e.wal_bytes).collect()),
        statements: median(runs.iter().map(|e| e.statements as f64).collect()) as u64,
        dead_tuples: median(runs.iter().map(|e| e.dead_tuples as f64).collect()) as i64,
        partitions: None,
    };
    let (plain, part) = (summary(&plain), summary(&part));
    let runs = format!("median of {EXPIRY_RUNS}");
    print(plain_id, &runs, &plain, "baseline");
    print(
        part_id,
        &runs,
        &part,
        &format!("{:.1}× P3 plain", part.rate() / plain.rate()),
    );
    println!();
    println!(
        "P3: plain inbox in schema pgbox_expiry_plain, partitioned inbox in schema \
         pgbox_expiry_part (1-second partitions, 1 ahead, no minimum retention; the untimed \
         drop of the empty partition before the filled one precedes the timed call). seconds: \
         wall time of the one call that expires all the rows; rows/s: rows ÷ seconds; WAL B/row: \
         pg_wal_lsn_diff over the call ÷ rows (cluster-wide: includes whatever else the server \
         writes meanwhile); dead tuples: n_dead_tup of the table (and its attached partitions) \
         afterwards; ratio: median partitioned rows/s ÷ median plain rows/s."
    );
    Ok(())
}

/// Where O2 publishes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// `DiscardPublisher`: atomic batches, one call per round.
    Discard,
    /// `Waves`: a no-op that is not atomic, so the relay publishes keyed runs in waves.
    Waves,
    /// The built-in `PgQueue` in the outbox's database: the relay moves each batch into it
    /// inside its round (one statement, payloads stay on the server).
    Queue,
    /// The same queue behind a wrapper that does not name it (`as_pg_queue` is `None`): the
    /// relay publishes through the queue's pool, in a transaction of the queue's own, as it
    /// did before it moved batches (the baseline of `Queue`).
    QueuePublished,
}

/// Forwards to a `PgQueue` without naming it: the relay publishes through it.
struct Forwarding(PgQueue);

impl Publisher for Forwarding {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.publish(batch).await
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

impl Sink {
    fn name(self) -> &'static str {
        match self {
            Sink::Discard => "no-op publisher",
            Sink::Waves => "no-op publisher, non-atomic",
            Sink::Queue => "built-in queue",
            Sink::QueuePublished => "built-in queue, published through its pool",
        }
    }
}

/// Accepts everything, like `DiscardPublisher`, but does not declare atomic batches, so the
/// relay hands it keyed runs in waves; counts its calls.
#[derive(Clone, Default)]
struct Waves(Arc<AtomicU64>);

impl Publisher for Waves {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.fetch_add(1, Relaxed);
        vec![Ok(()); batch.len()]
    }
}

struct Drain {
    seconds: f64,
    published: usize,
    rounds: u64,
    /// Rounds that published nothing.
    empty_rounds: u64,
    /// Rounds that claimed nothing (their dropped transaction's queued ROLLBACK is not
    /// counted by `statements`).
    idle_rounds: u64,
    statements: u64,
    publish_calls: u64,
    timed_out: bool,
}

/// Shared by the relays of one drain.
#[derive(Clone)]
struct DrainState {
    target: usize,
    deadline: Instant,
    published: Arc<AtomicUsize>,
    rounds: Arc<AtomicU64>,
    empty_rounds: Arc<AtomicU64>,
    idle_rounds: Arc<AtomicU64>,
}

/// Rounds until the backlog is published (by any relay) or the deadline passes. A round that
/// claims nothing (everything left is locked by other relays) is retried after 1 ms.
async fn relay_rounds<P: Publisher>(relay: Relay<P>, s: DrainState) -> anyhow::Result<()> {
    while s.published.load(Relaxed) < s.target && Instant::now() < s.deadline {
        let r = relay.relay_once().await?;
        s.rounds.fetch_add(1, Relaxed);
        s.published.fetch_add(r.published, Relaxed);
        if r.published == 0 {
            s.empty_rounds.fetch_add(1, Relaxed);
        }
        if r.claimed == 0 {
            s.idle_rounds.fetch_add(1, Relaxed);
            if s.published.load(Relaxed) < s.target {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
    Ok(())
}

async fn drain_backlog(
    options: &PgConnectOptions,
    backlog: usize,
    relays: usize,
    batch: usize,
    sink: Sink,
    limit: Duration,
) -> anyhow::Result<Drain> {
    let statements = Arc::new(AtomicU64::new(0));
    let waves = Waves::default();
    let mut pools = Vec::new();
    for _ in 0..relays {
        pools.push(pool_options(3).connect_with(options.clone()).await?);
    }
    let started = Instant::now();
    let state = DrainState {
        target: backlog,
        deadline: started + limit,
        published: Arc::new(AtomicUsize::new(0)),
        rounds: Arc::new(AtomicU64::new(0)),
        empty_rounds: Arc::new(AtomicU64::new(0)),
        idle_rounds: Arc::new(AtomicU64::new(0)),
    };
    let mut tasks = Vec::new();
    for rpool in pools {
        let (state, waves) = (state.clone(), waves.clone());
        let work = async move {
            match sink {
                Sink::Discard => {
                    let relay = Relay::builder(rpool, DiscardPublisher)
                        .batch_size(batch)
                        .build()?;
                    relay_rounds(relay, state).await
                }
                Sink::Waves => {
                    let relay = Relay::builder(rpool, waves).batch_size(batch).build()?;
                    relay_rounds(relay, state).await
                }
                Sink::Queue => {
                    let relay = Relay::builder(rpool.clone(), PgQueue::new(rpool))
                        .batch_size(batch)
                        .build()?;
                    relay_rounds(relay, state).await
                }
                Sink::QueuePublished => {
                    let queue = Forwarding(PgQueue::new(rpool.clone()));
                    let relay = Relay::builder(rpool, queue).batch_size(batch).build()?;
                    relay_rounds(relay, state).await
                }
            }
        };
        tasks.push(tokio::spawn(statements::scope(statements.clone(), work)));
    }
    for t in tasks {
        t.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let published = state.published.load(Relaxed);
    Ok(Drain {
        seconds,
        published,
        rounds: state.rounds.load(Relaxed),
        empty_rounds: state.empty_rounds.load(Relaxed),
        idle_rounds: state.idle_rounds.load(Relaxed),
        // An idle round: BEGIN (counted by none of sqlx's events), claim, ROLLBACK (queued).
        statements: statements.load(Relaxed) + 2 * state.idle_rounds.load(Relaxed),
        publish_calls: waves.0.load(Relaxed),
        timed_out: published < backlog,
    })
}

/// Records when each message was first handed to the publisher.
#[derive(Clone, Default)]
struct Stopwatch(Arc<Mutex<HashMap<uuid::Uuid, Instant>>>);

impl Publisher for Stopwatch {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let now = Instant::now();
        let mut seen = self.0.lock().unwrap();
        for e in batch {
            seen.entry(e.id).or_insert(now);
        }
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

/// A no-op publisher that counts what it took (W2).
#[derive(Clone, Default)]
struct Counting(Arc<std::sync::atomic::AtomicUsize>);

impl Publisher for Counting {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0
            .fetch_add(batch.len(), std::sync::atomic::Ordering::Relaxed);
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

struct LatencyRun {
    id: String,
    rate: f64,
    duration: Duration,
    wake: WakeUp,
    poll: Duration,
    keys: Option<usize>,
    batch: usize,
    /// The WAL outbox and a `WalRelay` on this slot, instead of the table and `Relay`.
    wal: Option<WalRun>,
}

/// A W3 run's WAL relay: its slot, its reader, and how many producers emit into the WAL at
/// full rate beside the measured one.
struct WalRun {
    slot: pgbox::WalSlot,
    reader: pgbox::WalReader,
    load: usize,
}

async fn latency_run(
    options: &PgConnectOptions,
    payload: &str,
    run: LatencyRun,
) -> anyhow::Result<Row> {
    let pool = pool_options(4).connect_with(options.clone()).await?;
    let stopwatch = Stopwatch::default();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let (task, outbox) = match &run.wal {
        None => {
            let relay = Relay::builder(pool.clone(), stopwatch.clone())
                .wake_up(run.wake)
                .poll_interval(run.poll)
                .batch_size(run.batch)
                .build()?;
            let task = tokio::spawn(async move { relay.run(s).await });
            (task, Outbox::new())
        }
        Some(wal) => {
            let relay = pgbox::WalRelay::builder(pool.clone(), wal.slot.clone(), stopwatch.clone())
                .reader(wal.reader)
                .wake_up(run.wake)
                .poll_interval(run.poll)
                .build()?;
            let task = tokio::spawn(async move { relay.run(s).await });
            (task, Outbox::new().mode(pgbox::OutboxMode::Wal))
        }
    };
    // Producers at full rate beside the measured one (W3 under load): 1-message
    // transactions into the WAL as fast as they commit.
    let load_stop = CancellationToken::new();
    let mut load = Vec::new();
    let load_pool = match run.wal.as_ref().map(|w| w.load).unwrap_or(0) {
        0 => None,
        n => Some(
            pool_options(n as u32 + 1)
                .connect_with(options.clone())
                .await?,
        ),
    };
    if let Some(load_pool) = &load_pool {
        for _ in 0..run.wal.as_ref().map(|w| w.load).unwrap_or(0) {
            let (pool, stop, p) = (load_pool.clone(), load_stop.clone(), payload.to_owned());
            load.push(tokio::spawn(async move {
                let outbox = Outbox::new().mode(pgbox::OutboxMode::Wal);
                while !stop.is_cancelled() {
                    let mut tx = pool.begin().await?;
                    outbox
                        .enqueue(&mut tx, Message::bytes("load", p.as_bytes().to_vec()))
                        .await?;
                    tx.commit().await?;
                }
                anyhow::Ok(())
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut committed = HashMap::new();
    let interval = Duration::from_secs_f64(1.0 / run.rate);
    let started = Instant::now();
    let mut next = started;
    let mut i = 0usize;
    while started.elapsed() < run.duration {
        let mut tx = pool.begin().await?;
        let mut message = Message::bytes("latency", payload.as_bytes().to_vec());
        if let Some(keys) = run.keys {
            message = message.ordering_key(format!("key{}", i % keys));
        }
        let id = outbox.enqueue(&mut tx, message).await?;
        tx.commit().await?;
        // The clock starts when COMMIT has returned: from then on the producer considers
        // the message sent.
        committed.insert(id, Instant::now());
        i += 1;
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
    let sent = committed.len();
    load_stop.cancel();
    for l in load {
        l.await??;
    }
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
    let missing = sent - latencies.len();
    Ok(Row {
        id: if missing > 0 {
            format!("{} ({missing} of {sent} not published within 10 s)", run.id)
        } else {
            run.id
        },
        clients: 1,
        rate: sent as f64 / run.duration.as_secs_f64(),
        p50: percentile(&latencies, 0.50),
        p99: percentile(&latencies, 0.99),
        ratio: None,
        wal_per_msg: 0.0,
        statements: "-".into(),
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

/// `--rtt`: a TCP proxy in front of the server that delays every chunk by a fixed one-way
/// time, in both directions, keeping order (a network's latency, not its bandwidth).
mod delay_proxy {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::mpsc;
    use tokio::time::Instant;

    /// Starts the proxy; returns `server` with its host and port replaced by the proxy's.
    pub(crate) async fn start(server: &str, one_way: Duration) -> anyhow::Result<String> {
        let mut url = url::Url::parse(server)?;
        let upstream = format!(
            "{}:{}",
            url.host_str().unwrap_or("127.0.0.1"),
            url.port().unwrap_or(5432)
        );
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::spawn(pump(cr, sw, one_way));
                    tokio::spawn(pump(sr, cw, one_way));
                });
            }
        });
        url.set_host(Some("127.0.0.1"))?;
        url.set_port(Some(port))
            .map_err(|()| anyhow::anyhow!("cannot set the proxy's port"))?;
        Ok(url.to_string())
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        delay: Duration,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let writer = tokio::spawn(async move {
            while let Some((due, chunk)) = rx.recv().await {
                tokio::time::sleep_until(due).await;
                if to.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            let _ = to.shutdown().await;
        });
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        drop(tx);
        let _ = writer.await;
    }
}

/// The W rows: enqueue into the WAL (no relay, and with a WAL relay draining beside it), and
/// the WAL relay's drain of 1-message and 100-message transactions.
async fn wal_rows(
    bench: &mut Bench,
    pool: &PgPool,
    payload: &Arc<str>,
    batch: usize,
    drain_limit: Duration,
) -> anyhow::Result<()> {
    let slot = pgbox::WalSlot::new("pgbox_bench")?;
    slot.create(pool).await?;
    let relay_pool = pool_options(3).connect_with(bench.options.clone()).await?;
    // Each W row starts from an empty slot whose restart position is recent: drained, then a
    // CHECKPOINT (which logs the running-transactions record PostgreSQL moves a slot's
    // restart position past), then drained again. Otherwise a row pays for re-decoding the
    // WAL of the row before it (BENCHMARKS.md, run 9, measures that effect).
    let empty_slot = async || -> anyhow::Result<()> {
        let relay =
            pgbox::WalRelay::builder(relay_pool.clone(), slot.clone(), DiscardPublisher).build()?;
        relay.drain().await?;
        sqlx::raw_sql("CHECKPOINT").execute(pool).await?;
        relay.drain().await?;
        Ok(())
    };
    for (id, n, draining) in [
        ("W1 WAL enqueue 1 per tx (no relay)", 1usize, false),
        ("W1 WAL enqueue 1 per tx (WAL relay draining)", 1, true),
        ("W1 WAL enqueue 100 per tx", batch, false),
    ] {
        if !bench.wanted(id) {
            continue;
        }
        empty_slot().await?;
        let shutdown = CancellationToken::new();
        let relay_task = draining.then(|| {
            let relay =
                pgbox::WalRelay::builder(relay_pool.clone(), slot.clone(), DiscardPublisher)
                    .build()
                    .expect("WAL relay");
            let s = shutdown.clone();
            tokio::spawn(async move { relay.run(s).await })
        });
        let p = payload.clone();
        let outbox = Outbox::new().mode(pgbox::OutboxMode::Wal);
        bench
            .run(
                id,
                n as u64,
                "4",
                Some("outbox"),
                Some(if n == 1 {
                    "B0 BEGIN/INSERT/COMMIT"
                } else {
                    "O1 enqueue 100 per tx"
                }),
                None,
                enqueue_op(outbox, p, n, true),
            )
            .await?;
        shutdown.cancel();
        if let Some(task) = relay_task {
            task.await??;
        }
    }

    // W3: commit → publish latency through the WAL relay at 100 messages/s: the streaming
    // reader (pushed by the server), idle and with 4 producers at full rate beside it; the
    // SQL-function reader woken by the producers' NOTIFY (polling every second besides), and
    // polling only, every 100 and 10 ms; and with the same load, woken by NOTIFY.
    use pgbox::WalReader::{SqlFunctions, Stream};
    for (reader, wake, poll_ms, load) in [
        (Stream, WakeUp::Notify, 100u64, 0usize),
        (Stream, WakeUp::Notify, 100, 4),
        (SqlFunctions, WakeUp::Notify, 1000, 0),
        (SqlFunctions, WakeUp::Poll, 100, 0),
        (SqlFunctions, WakeUp::Poll, 10, 0),
        (SqlFunctions, WakeUp::Notify, 1000, 4),
    ] {
        let how = match reader {
            Stream => "stream".to_owned(),
            _ => format!("SQL functions, {wake:?}, poll {poll_ms} ms"),
        };
        let beside = if load > 0 {
            format!(", {load} producers at full rate beside")
        } else {
            String::new()
        };
        let id = format!("W3 WAL commit → publish ({how}) @ 100/s{beside}");
        if !bench.wanted(&id) {
            continue;
        }
        empty_slot().await?;
        let row = latency_run(
            &bench.options,
            payload,
            LatencyRun {
                id,
                rate: 100.0,
                duration: Duration::from_secs_f64(bench.args.duration.max(2.0)),
                wake,
                poll: Duration::from_millis(poll_ms),
                keys: None,
                batch: bench.args.relay_batch,
                wal: Some(WalRun {
                    slot: slot.clone(),
                    reader,
                    load,
                }),
            },
        )
        .await?;
        print_row(&row);
        bench.rows.push(row);
    }

    // W2: the WAL relay's drain of a backlog emitted by 16 producers, right after it was
    // emitted (the slot's restart position at its start), by each reader.
    for (per_tx, reader) in [
        (1usize, Stream),
        (1, SqlFunctions),
        (100, Stream),
        (100, SqlFunctions),
    ] {
        let how = match reader {
            Stream => "stream",
            _ => "SQL functions",
        };
        let id = format!(
            "W2 WAL drain {} in {per_tx}-message transactions ({how}, no-op publisher)",
            bench.args.backlog
        );
        if !bench.wanted(&id) {
            continue;
        }
        empty_slot().await?;
        let total = bench.args.backlog;
        let transactions = total / per_tx;
        let mut fillers = Vec::new();
        for f in 0..16 {
            let (pool, p) = (pool.clone(), payload.clone());
            fillers.push(tokio::spawn(async move {
                let outbox = Outbox::new().mode(pgbox::OutboxMode::Wal);
                let mut t = f;
                while t < transactions {
                    let mut tx = pool.begin().await?;
                    outbox
                        .enqueue_batch(
                            &mut tx,
                            (0..per_tx).map(|_| Message::bytes("bench", p.as_bytes().to_vec())),
                        )
                        .await?;
                    tx.commit().await?;
                    t += 16;
                }
                anyhow::Ok(())
            }));
        }
        for f in fillers {
            f.await??;
        }
        let start_lsn = wal_lsn(pool).await?;
        // The relay's defaults (20,000 per read), `drain` (one replication session for the
        // stream; a peek and an advance per round for the SQL functions).
        let counted = Counting::default();
        let relay = pgbox::WalRelay::builder(relay_pool.clone(), slot.clone(), counted.clone())
            .reader(reader)
            .build()?;
        let started = Instant::now();
        let timed_out = match tokio::time::timeout(drain_limit, relay.drain()).await {
            Ok(result) => {
                result?;
                false
            }
            Err(_) => true,
        };
        let published = counted.0.load(std::sync::atomic::Ordering::Relaxed);
        let seconds = started.elapsed().as_secs_f64();
        drop(relay);
        if timed_out {
            // What the cut-off drain left: emptied before the next row.
            empty_slot().await?;
        }
        let wal = wal_since(pool, &start_lsn).await?;
        anyhow::ensure!(
            timed_out || published == transactions * per_tx,
            "{id}: {published} of {} published",
            transactions * per_tx
        );
        let row = Row {
            id: if timed_out {
                format!("{id} (stopped at {seconds:.0} s)")
            } else {
                id.clone()
            },
            clients: 1,
            rate: published as f64 / seconds,
            p50: Duration::ZERO,
            p99: Duration::ZERO,
            ratio: bench
                .baselines
                .get(&("O2 no-op publisher".to_owned(), 1))
                .map(|b| {
                    (
                        published as f64 / seconds / b,
                        "O2 no-op publisher (table relay)".to_owned(),
                    )
                }),
            wal_per_msg: wal / published.max(1) as f64,
            statements: match reader {
                Stream => "one replication session".to_owned(),
                _ => "peek + advance per round".to_owned(),
            },
            dead_tuples: Some(dead_tuples(pool, "outbox").await?),
        };
        print_row(&row);
        bench.rows.push(row);
    }
    relay_pool.close().await;
    slot.drop(pool).await?;
    Ok(())
}
