//! Soak: the whole pipeline for a long while at a fixed offered load, on a private cluster
//! with autovacuum on, watched minute by minute (issue 38).
//!
//! Producers (tokio tasks on a token schedule) commit a business row and one keyed outbox
//! message per transaction; a [`Relay`] drains the outbox into the built-in [`PgQueue`]; a
//! [`Consumer`] runner takes each message through the inbox into a one-row effect (a
//! per-key counter); a [`Janitor`] purges inbox rows after a short retention. Unless
//! `--soak-rate` fixes it, the offered load is 70 % of an E1 capacity measured first on the
//! same cluster (the messages the consumer handles while producers run at full speed, after
//! the first seconds).
//!
//! Every minute: messages handled/s, enqueue commit → effect commit p50/p99, this process's
//! RSS, each pgbox table's (and the effect table's) size, index size and dead tuples, and
//! WAL bytes per message. At the end: a verdict per criterion, `soak.md`, `soak.csv` and
//! `soak.svg` in `--soak-out`. Run once per release, not in CI:
//!
//! ```text
//! cargo run --release -p pgbox-bench -- --soak                  # 30 minutes, 2 of warm-up
//! cargo run --release -p pgbox-bench -- --soak --soak-minutes 4 --soak-warmup-minutes 1
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::janitor::Janitor;
use pgbox::transport::{PgQueue, Subscriber};
use pgbox::{
    CancellationToken, Consumer, Envelope, HandlerConnection, Inbox, Message, Outbox, Relay,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgPool};

use crate::local_pg;

/// Soak mode's options (flattened into the harness's arguments).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct SoakArgs {
    /// Run the soak (whole pipeline at a fixed load on a private cluster) instead of the
    /// workloads; see bench/src/soak.rs.
    #[arg(long)]
    pub(crate) soak: bool,
    /// Length of the soak, warm-up included, in minutes.
    #[arg(long, default_value_t = 30)]
    soak_minutes: u32,
    /// Minutes at the start left out of the verdict.
    #[arg(long, default_value_t = 2)]
    soak_warmup_minutes: u32,
    /// Offered load in messages/s, instead of 70 % of a measured E1 capacity.
    #[arg(long)]
    soak_rate: Option<f64>,
    /// Where soak.md, soak.csv and soak.svg go.
    #[arg(long, default_value = "target/soak")]
    soak_out: PathBuf,
}

/// Share of the measured capacity offered during the soak.
const LOAD_SHARE: f64 = 0.7;
/// How long producers run at full speed to measure E1 capacity.
const CALIBRATION: Duration = Duration::from_secs(20);
/// The start of the calibration that is not counted (the pipeline filling up).
const CALIBRATION_SETTLE: Duration = Duration::from_secs(5);
/// Producer tasks (each keeps its own share of the token schedule).
const PRODUCERS: usize = 16;
/// Ordering keys the messages are spread over (and rows of the effect table).
const KEYS: u64 = 1_000;
const TOPIC: &str = "soak";
const MINUTE: Duration = Duration::from_secs(60);
/// The janitor's inbox retention and pause between passes: short, so that the inbox's size
/// settles within the warm-up.
const INBOX_RETENTION: Duration = Duration::from_secs(60);
const JANITOR_INTERVAL: Duration = Duration::from_secs(10);
/// Bound on waiting for the pipeline to drain what was enqueued.
const DRAIN_LIMIT: Duration = Duration::from_secs(300);
/// Verdict thresholds.
const FLAT: f64 = 0.10;
const RSS_SLACK_BYTES: f64 = 8.0 * 1024.0 * 1024.0;
const SIZE_SLACK_BYTES: f64 = 8.0 * 1024.0 * 1024.0;

/// Runs the soak; the private cluster is stopped and removed whatever happens (also on
/// Ctrl-C).
pub(crate) async fn run(args: &SoakArgs, payload: usize) -> anyhow::Result<()> {
    let minutes = args.soak_minutes;
    let warmup = args.soak_warmup_minutes;
    anyhow::ensure!(
        minutes >= warmup + 2,
        "--soak-minutes ({minutes}) must leave at least two minutes after the warm-up ({warmup})"
    );
    if let Some(rate) = args.soak_rate {
        anyhow::ensure!(
            rate.is_finite() && rate > 0.0,
            "--soak-rate must be positive"
        );
    }
    let cluster = tokio::task::spawn_blocking(Cluster::start).await??;
    println!(
        "soak: private cluster {} (PostgreSQL from {}), autovacuum on, durable commits",
        cluster.url(),
        cluster.bindir.display()
    );
    let url = cluster.url();
    let outcome = tokio::select! {
        r = soak(args, payload, &url) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    // Stops the server and removes its directory.
    tokio::task::spawn_blocking(move || drop(cluster)).await?;
    outcome
}

async fn soak(args: &SoakArgs, payload: usize, url: &str) -> anyhow::Result<()> {
    let options = PgConnectOptions::from_str(url)?;
    let mut admin = sqlx::PgConnection::connect_with(&options).await?;
    admin.execute("CREATE DATABASE soak").await?;
    admin.close().await?;
    let options = options.database("soak");
    let pools = Pools::connect(&options).await?;
    pgbox::migrate(&pools.pipeline).await?;
    for statement in SETUP {
        pools.pipeline.execute(*statement).await?;
    }
    let payload: Arc<[u8]> = vec![b'x'; payload].into();

    let rate = match args.soak_rate {
        Some(rate) => rate,
        None => {
            let capacity = calibrate(&pools, &payload).await?;
            println!(
                "soak: E1 capacity {capacity:.0} msgs/s ({} s at full speed); offered load {:.0} % of it",
                CALIBRATION.as_secs(),
                LOAD_SHARE * 100.0
            );
            for statement in RESET {
                pools.pipeline.execute(*statement).await?;
            }
            capacity * LOAD_SHARE
        }
    };
    println!(
        "soak: {} minutes ({} of warm-up) at {rate:.0} msgs/s offered, {PRODUCERS} producers, {KEYS} keys",
        args.soak_minutes, args.soak_warmup_minutes
    );

    let pipeline = Pipeline::start(&pools)?;
    let stop_producers = CancellationToken::new();
    let producers = spawn_producers(
        &pools,
        &pipeline.tracker,
        &payload,
        Some(rate),
        &stop_producers,
    );
    let tables = table_stats(&pools.stats).await?;
    let names: Vec<String> = tables.iter().map(|t| t.name.clone()).collect();
    print_header();
    let started = Instant::now();
    let mut last = Snapshot::take(&pools.stats, &pipeline.tracker, started).await?;
    let mut rows = Vec::new();
    for minute in 1..=args.soak_minutes {
        tokio::time::sleep_until((started + MINUTE * minute).into()).await;
        // A task that stopped early says why when it is joined.
        if pipeline.finished() {
            pipeline.stop().await?;
            anyhow::bail!("a pipeline task stopped during the soak");
        }
        if producers.iter().any(|p| p.is_finished()) {
            stop_producers.cancel();
            join_producers(producers).await?;
            anyhow::bail!("a producer stopped during the soak");
        }
        let now = Snapshot::take(&pools.stats, &pipeline.tracker, started).await?;
        let hist = std::mem::take(&mut *pipeline.tracker.latency.lock().unwrap());
        let row = Minute::between(
            minute,
            minute <= args.soak_warmup_minutes,
            &last,
            &now,
            &hist,
        );
        print_row(&row);
        rows.push(row);
        last = now;
    }
    stop_producers.cancel();
    let enqueued = join_producers(producers).await?;
    pipeline.tracker.wait_drained(enqueued, DRAIN_LIMIT).await?;
    pipeline.stop().await?;
    exactly_once(&pools.pipeline, enqueued).await?;
    println!("soak: {enqueued} messages, each effect exactly once");

    let verdict = Verdict::of(&rows, args.soak_minutes, args.soak_warmup_minutes, rate);
    for line in verdict.lines() {
        println!("{line}");
    }
    std::fs::create_dir_all(&args.soak_out)?;
    let out = &args.soak_out;
    std::fs::write(out.join("soak.csv"), csv(&rows, &names))?;
    std::fs::write(
        out.join("soak.md"),
        markdown(&rows, &names, &verdict, rate, args),
    )?;
    std::fs::write(out.join("soak.svg"), svg(&rows, args.soak_warmup_minutes))?;
    println!(
        "soak: wrote {0}/soak.md, {0}/soak.csv, {0}/soak.svg",
        out.display()
    );
    if verdict.passed() {
        Ok(())
    } else {
        anyhow::bail!("soak failed: see the verdict above")
    }
}

const SETUP: &[&str] = &[
    "CREATE TABLE soak_orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
     k text NOT NULL, amount integer NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    "CREATE TABLE soak_effects (k text PRIMARY KEY, n bigint NOT NULL)",
];

const RESET: &[&str] = &[
    "TRUNCATE pgbox.outbox, pgbox.queue, pgbox.inbox, soak_orders, soak_effects",
    "VACUUM ANALYZE",
];

/// The pools of each role, so that one cannot starve another of connections.
struct Pools {
    producers: PgPool,
    pipeline: PgPool,
    janitor: PgPool,
    stats: PgPool,
}

impl Pools {
    async fn connect(options: &PgConnectOptions) -> anyhow::Result<Pools> {
        let pool = |max: u32| {
            PgPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(Duration::from_secs(30))
                .connect_with(options.clone())
        };
        Ok(Pools {
            producers: pool(PRODUCERS as u32).await?,
            pipeline: pool(24).await?,
            janitor: pool(2).await?,
            stats: pool(2).await?,
        })
    }
}

/// When each message was committed by its producer and when its effect was, whichever
/// came first waiting for the other, so that the map holds only messages in flight.
enum Mark {
    Committed(Instant),
    Effected(Instant),
}

#[derive(Default)]
struct Tracker {
    marks: Mutex<HashMap<uuid::Uuid, Mark>>,
    latency: Mutex<Histogram>,
    enqueued: AtomicU64,
    handled: AtomicU64,
}

impl Tracker {
    fn committed(&self, id: uuid::Uuid, at: Instant) {
        self.enqueued.fetch_add(1, Relaxed);
        let mut marks = self.marks.lock().unwrap();
        match marks.remove(&id) {
            Some(Mark::Effected(effect)) => {
                drop(marks);
                self.latency
                    .lock()
                    .unwrap()
                    .record(effect.saturating_duration_since(at));
            }
            _ => {
                marks.insert(id, Mark::Committed(at));
            }
        }
    }

    fn effected(&self, id: uuid::Uuid, at: Instant) {
        let mut marks = self.marks.lock().unwrap();
        match marks.remove(&id) {
            Some(Mark::Committed(commit)) => {
                drop(marks);
                self.handled.fetch_add(1, Relaxed);
                self.latency
                    .lock()
                    .unwrap()
                    .record(at.saturating_duration_since(commit));
            }
            // A redelivery of a message already counted: its effect is not repeated.
            Some(Mark::Effected(first)) => {
                marks.insert(id, Mark::Effected(first));
            }
            None => {
                self.handled.fetch_add(1, Relaxed);
                marks.insert(id, Mark::Effected(at));
            }
        }
    }

    async fn wait_drained(&self, enqueued: u64, limit: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        loop {
            let handled = self.handled.load(Relaxed);
            if handled >= enqueued {
                return Ok(());
            }
            anyhow::ensure!(
                start.elapsed() < limit,
                "only {handled} of {enqueued} effects after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Latencies in microseconds: exact below 1024 µs, then 512 buckets per power of two
/// (under 0.2 % error), so a minute of any rate costs the same fixed memory.
struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

const SUB_BITS: u32 = 9;
const LINEAR: u64 = 1 << (SUB_BITS + 1);
const MAX_EXPONENT: u32 = 40;

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; Self::index(u64::MAX) + 1],
            total: 0,
        }
    }
}

impl Histogram {
    fn index(us: u64) -> usize {
        let us = us.min((1 << MAX_EXPONENT) - 1);
        if us < LINEAR {
            return us as usize;
        }
        let exponent = 63 - us.leading_zeros();
        let shift = exponent - SUB_BITS;
        let sub = (us >> shift) - (1 << SUB_BITS);
        LINEAR as usize + ((exponent - SUB_BITS - 1) as usize) * (1 << SUB_BITS) + sub as usize
    }

    /// The middle of bucket `i`, in microseconds.
    fn value(i: usize) -> u64 {
        let i = i as u64;
        if i < LINEAR {
            return i;
        }
        let octave = (i - LINEAR) >> SUB_BITS;
        let sub = (i - LINEAR) & ((1 << SUB_BITS) - 1);
        let shift = octave + 1;
        (((1 << SUB_BITS) + sub) << shift) + (1 << shift) / 2
    }

    fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.counts[Self::index(us)] += 1;
        self.total += 1;
    }

    /// The `q` quantile in milliseconds, `None` when empty.
    fn quantile_ms(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Self::value(i) as f64 / 1e3);
            }
        }
        None
    }
}

/// Wraps the queue's subscriber to record when each effect committed: the runner acks a
/// message right after its handler's transaction commits.
struct Timed {
    inner: PgQueue,
    tracker: Arc<Tracker>,
}

impl Subscriber for Timed {
    type Delivery = <PgQueue as Subscriber>::Delivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> pgbox::Result<Vec<Self::Delivery>> {
        self.inner.receive(topic, max, visibility).await
    }

    fn envelope<'d>(&self, delivery: &'d Self::Delivery) -> &'d Envelope {
        self.inner.envelope(delivery)
    }

    fn attempt(&self, delivery: &Self::Delivery) -> i32 {
        self.inner.attempt(delivery)
    }

    async fn ack(&self, delivery: &Self::Delivery) -> pgbox::Result<bool> {
        self.tracker
            .effected(self.inner.envelope(delivery).id, Instant::now());
        self.inner.ack(delivery).await
    }

    async fn nack(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
        error: &str,
    ) -> pgbox::Result<bool> {
        self.inner.nack(delivery, delay, error).await
    }

    async fn dead_letter(&self, delivery: &Self::Delivery, error: &str) -> pgbox::Result<bool> {
        self.inner.dead_letter(delivery, error).await
    }

    fn wake_channel(&self) -> Option<(PgPool, String)> {
        self.inner.wake_channel()
    }
}

type Task<T> = tokio::task::JoinHandle<pgbox::Result<T>>;

/// Relay, consumer runner and janitor, with the library's defaults but for the janitor's
/// retention.
struct Pipeline {
    tracker: Arc<Tracker>,
    shutdown: CancellationToken,
    relay: Task<()>,
    consumer: Task<pgbox::ConsumerStats>,
    janitor: Task<()>,
}

impl Pipeline {
    fn start(pools: &Pools) -> anyhow::Result<Pipeline> {
        let tracker = Arc::new(Tracker::default());
        let shutdown = CancellationToken::new();
        let relay =
            Relay::builder(pools.pipeline.clone(), PgQueue::new(pools.pipeline.clone())).build()?;
        let consumer = Consumer::builder(
            pools.pipeline.clone(),
            Timed {
                inner: PgQueue::new(pools.pipeline.clone()),
                tracker: tracker.clone(),
            },
            TOPIC,
            Inbox::new("soak")?,
        )
        .build()?;
        let janitor = Janitor::builder(pools.janitor.clone())
            .instance_name("soak")
            .min_retention(INBOX_RETENTION)
            .inbox_retention(INBOX_RETENTION)
            .interval(JANITOR_INTERVAL)
            .build()?;
        let s = shutdown.clone();
        let relay = tokio::spawn(async move { relay.run(s).await });
        let s = shutdown.clone();
        let consumer = tokio::spawn(async move {
            consumer
                .run(
                    async |msg: &Envelope, conn: &mut HandlerConnection<'_>| {
                        sqlx::query(
                            "INSERT INTO soak_effects (k, n) VALUES ($1, 1) \
                             ON CONFLICT (k) DO UPDATE SET n = soak_effects.n + 1",
                        )
                        .bind(msg.ordering_key.as_deref().unwrap_or(""))
                        .execute(&mut *conn)
                        .await
                        .map_err(pgbox::Error::from)?;
                        Ok::<(), pgbox::Error>(())
                    },
                    s,
                )
                .await
        });
        let s = shutdown.clone();
        let janitor = tokio::spawn(async move { janitor.run(s).await });
        Ok(Pipeline {
            tracker,
            shutdown,
            relay,
            consumer,
            janitor,
        })
    }

    fn finished(&self) -> bool {
        self.relay.is_finished() || self.consumer.is_finished() || self.janitor.is_finished()
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let limit = Duration::from_secs(60);
        tokio::time::timeout(limit, self.consumer).await???;
        tokio::time::timeout(limit, self.relay).await???;
        tokio::time::timeout(limit, self.janitor).await???;
        Ok(())
    }
}

/// Producers: each commits a business row and one keyed message per transaction, on its
/// share of a token schedule at `rate` messages/s in all (at full speed when `None`), until
/// `stop`. A producer behind its schedule catches up without sleeping, so the offered load
/// is kept as long as the database can take it; the per-minute enqueue rate shows when not.
fn spawn_producers(
    pools: &Pools,
    tracker: &Arc<Tracker>,
    payload: &Arc<[u8]>,
    rate: Option<f64>,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<u64>>> {
    let counter = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    (0..PRODUCERS)
        .map(|p| {
            let (pool, tracker, payload, stop, counter) = (
                pools.producers.clone(),
                tracker.clone(),
                payload.clone(),
                stop.clone(),
                counter.clone(),
            );
            // Producer p's tokens fall at start + (p + i * PRODUCERS) / rate.
            let interval = rate.map(|r| Duration::from_secs_f64(PRODUCERS as f64 / r));
            let mut next =
                start + rate.map_or(Duration::ZERO, |r| Duration::from_secs_f64(p as f64 / r));
            tokio::spawn(async move {
                let outbox = Outbox::new();
                let mut sent = 0u64;
                // Bounded by `stop`, which the caller cancels at the end of its window.
                while !stop.is_cancelled() {
                    if let Some(interval) = interval {
                        tokio::select! {
                            _ = tokio::time::sleep_until(next.into()) => {}
                            _ = stop.cancelled() => break,
                        }
                        next += interval;
                    }
                    let n = counter.fetch_add(1, Relaxed);
                    let key = format!("k{}", n % KEYS);
                    let mut tx = pool.begin().await?;
                    sqlx::query("INSERT INTO soak_orders (k, amount) VALUES ($1, $2)")
                        .bind(&key)
                        .bind((n % 997) as i32)
                        .execute(&mut *tx)
                        .await?;
                    let id = outbox
                        .enqueue(
                            &mut tx,
                            Message::bytes(TOPIC, payload.to_vec()).ordering_key(key),
                        )
                        .await?;
                    tx.commit().await?;
                    tracker.committed(id, Instant::now());
                    sent += 1;
                }
                anyhow::Ok(sent)
            })
        })
        .collect()
}

async fn join_producers(
    producers: Vec<tokio::task::JoinHandle<anyhow::Result<u64>>>,
) -> anyhow::Result<u64> {
    let mut sent = 0;
    for p in producers {
        sent += tokio::time::timeout(Duration::from_secs(60), p).await???;
    }
    Ok(sent)
}

/// E1 capacity: producers at full speed for [`CALIBRATION`] while the pipeline runs; the
/// messages handled per second after [`CALIBRATION_SETTLE`], while they still run.
async fn calibrate(pools: &Pools, payload: &Arc<[u8]>) -> anyhow::Result<f64> {
    println!(
        "soak: measuring E1 capacity (messages handled while producers run at full speed, over the last {} of {} s)",
        (CALIBRATION - CALIBRATION_SETTLE).as_secs(),
        CALIBRATION.as_secs()
    );
    let pipeline = Pipeline::start(pools)?;
    let stop = CancellationToken::new();
    let producers = spawn_producers(pools, &pipeline.tracker, payload, None, &stop);
    // What the pipeline sustains is what the consumer handles while the producers share the
    // machine with it; a drain after they stop would run with the cores to itself (the
    // first soak offered 70 % of such a figure and fell behind).
    tokio::time::sleep(CALIBRATION_SETTLE).await;
    let (from, handled_from) = (Instant::now(), pipeline.tracker.handled.load(Relaxed));
    tokio::time::sleep(CALIBRATION - CALIBRATION_SETTLE).await;
    let handled = pipeline.tracker.handled.load(Relaxed) - handled_from;
    let rate = handled as f64 / from.elapsed().as_secs_f64();
    stop.cancel();
    let enqueued = join_producers(producers).await?;
    pipeline.tracker.wait_drained(enqueued, DRAIN_LIMIT).await?;
    pipeline.stop().await?;
    exactly_once(&pools.pipeline, enqueued).await?;
    Ok(rate)
}

/// Every message's effect committed once: the per-key counters add up to the messages,
/// and every business row is there.
async fn exactly_once(pool: &PgPool, enqueued: u64) -> anyhow::Result<()> {
    let (effects, orders): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(n), 0)::bigint FROM soak_effects), \
                (SELECT count(*) FROM soak_orders)",
    )
    .fetch_one(pool)
    .await?;
    anyhow::ensure!(
        effects == enqueued as i64 && orders == enqueued as i64,
        "exactly-once check failed: {effects} effects, {orders} business rows, {enqueued} messages"
    );
    Ok(())
}

struct TableStat {
    name: String,
    total: i64,
    index: i64,
    dead: i64,
}

/// Every table of the pgbox schema, then the effect and business tables.
async fn table_stats(pool: &PgPool) -> anyhow::Result<Vec<TableStat>> {
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT CASE WHEN n.nspname = 'pgbox' THEN 'pgbox.' ELSE '' END || c.relname, \
                pg_total_relation_size(c.oid), pg_indexes_size(c.oid), \
                coalesce(s.n_dead_tup, 0) \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
         WHERE c.relkind = 'r' AND (n.nspname = 'pgbox' \
            OR (n.nspname = 'public' AND c.relname IN ('soak_effects', 'soak_orders'))) \
         ORDER BY n.nspname = 'pgbox' DESC, c.relname",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, total, index, dead)| TableStat {
            name,
            total,
            index,
            dead,
        })
        .collect())
}

/// Counters read at one instant.
struct Snapshot {
    at: Duration,
    enqueued: u64,
    handled: u64,
    wal_lsn: String,
    tables: Vec<TableStat>,
    autovacuums: i64,
}

impl Snapshot {
    async fn take(pool: &PgPool, tracker: &Tracker, started: Instant) -> anyhow::Result<Snapshot> {
        let at = started.elapsed();
        let (enqueued, handled) = (
            tracker.enqueued.load(Relaxed),
            tracker.handled.load(Relaxed),
        );
        let (wal_lsn, autovacuums): (String, i64) = sqlx::query_as(
            "SELECT pg_current_wal_lsn()::text, \
                    (SELECT coalesce(sum(autovacuum_count), 0)::bigint FROM pg_stat_user_tables)",
        )
        .fetch_one(pool)
        .await?;
        Ok(Snapshot {
            at,
            enqueued,
            handled,
            wal_lsn,
            tables: table_stats(pool).await?,
            autovacuums,
        })
    }
}

/// One minute's figures.
struct Minute {
    minute: u32,
    warmup: bool,
    enqueued_per_s: f64,
    handled_per_s: f64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    rss_bytes: f64,
    wal_per_msg: Option<f64>,
    wal_bytes: i64,
    autovacuums: i64,
    tables: Vec<TableStat>,
}

impl Minute {
    fn between(minute: u32, warmup: bool, a: &Snapshot, b: &Snapshot, hist: &Histogram) -> Minute {
        let seconds = (b.at - a.at).as_secs_f64();
        let handled = b.handled - a.handled;
        let wal_bytes = lsn(&b.wal_lsn) - lsn(&a.wal_lsn);
        Minute {
            minute,
            warmup,
            enqueued_per_s: (b.enqueued - a.enqueued) as f64 / seconds,
            handled_per_s: handled as f64 / seconds,
            p50_ms: hist.quantile_ms(0.50),
            p99_ms: hist.quantile_ms(0.99),
            rss_bytes: rss_bytes(),
            wal_per_msg: (handled > 0).then(|| wal_bytes as f64 / handled as f64),
            wal_bytes,
            autovacuums: b.autovacuums - a.autovacuums,
            tables: b
                .tables
                .iter()
                .map(|t| TableStat {
                    name: t.name.clone(),
                    ..*t
                })
                .collect(),
        }
    }

    fn pgbox_total(&self) -> i64 {
        self.tables
            .iter()
            .filter(|t| t.name.starts_with("pgbox."))
            .map(|t| t.total)
            .sum()
    }

    fn table(&self, name: &str) -> Option<&TableStat> {
        self.tables.iter().find(|t| t.name == name)
    }
}

/// An LSN (`16/B374D848`) as a byte position.
fn lsn(text: &str) -> i64 {
    let (hi, lo) = text.split_once('/').unwrap_or(("0", "0"));
    let hi = i64::from_str_radix(hi, 16).unwrap_or(0);
    let lo = i64::from_str_radix(lo, 16).unwrap_or(0);
    (hi << 32) + lo
}

/// This process's resident set (`VmRSS` in /proc/self/status), in bytes; 0 where there is
/// no /proc.
fn rss_bytes() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib * 1024.0)
}

const MIB: f64 = 1024.0 * 1024.0;

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// The tables the pipeline writes to, shown on the console (soak.md and soak.csv have all).
const BUSY_TABLES: &[&str] = &[
    "pgbox.outbox",
    "pgbox.queue",
    "pgbox.inbox",
    "soak_effects",
    "soak_orders",
];

fn print_header() {
    println!(
        "{:>4} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10} {:>3}   tables: total MiB / dead tuples",
        "min",
        "enq/s",
        "msgs/s",
        "p50 ms",
        "p99 ms",
        "RSS MiB",
        "WAL B/msg",
        "pgbox MiB",
        "dead",
        "av"
    );
    println!("     ({})", BUSY_TABLES.join(", "));
}

fn print_row(m: &Minute) {
    let dead: i64 = m
        .tables
        .iter()
        .filter(|t| t.name.starts_with("pgbox."))
        .map(|t| t.dead)
        .sum();
    let per_table: Vec<String> = BUSY_TABLES
        .iter()
        .filter_map(|n| m.table(n))
        .map(|t| format!("{:.1}/{}", t.total as f64 / MIB, t.dead))
        .collect();
    println!(
        "{:>3}{} {:>9.0} {:>9.0} {:>8} {:>8} {:>8.1} {:>9} {:>10.2} {:>10} {:>3}   {}",
        m.minute,
        if m.warmup { "w" } else { " " },
        m.enqueued_per_s,
        m.handled_per_s,
        opt(m.p50_ms, 1),
        opt(m.p99_ms, 1),
        m.rss_bytes / MIB,
        opt(m.wal_per_msg, 0),
        m.pgbox_total() as f64 / MIB,
        dead,
        m.autovacuums,
        per_table.join(" ")
    );
}

/// One criterion's outcome.
struct Check {
    name: &'static str,
    first: f64,
    last: f64,
    unit: &'static str,
    rule: String,
    passed: bool,
}

struct Verdict {
    /// Offered load, and the mean enqueue rate after the warm-up (not a criterion: it says
    /// whether the producers kept their schedule).
    offered: (f64, f64),
    first: (u32, u32),
    last: (u32, u32),
    checks: Vec<Check>,
}

impl Verdict {
    /// Windows: 10 minutes of a 30-minute soak, scaled down for shorter ones (at least one
    /// minute, at most half of what follows the warm-up).
    fn of(rows: &[Minute], minutes: u32, warmup: u32, rate: f64) -> Verdict {
        let after = minutes - warmup;
        let window = ((f64::from(minutes) * 10.0 / 30.0).round() as u32).clamp(1, after / 2);
        let first = (warmup + 1, warmup + window);
        let last = (minutes - window + 1, minutes);
        let mean = |(a, b): (u32, u32), f: &dyn Fn(&Minute) -> Option<f64>| {
            let v: Vec<f64> = rows
                .iter()
                .filter(|r| (a..=b).contains(&r.minute))
                .filter_map(f)
                .collect();
            if v.is_empty() {
                f64::NAN
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let within = |first: f64, last: f64| (last - first).abs() <= FLAT * first;
        let mut checks = Vec::new();
        let (a, b) = (
            mean(first, &|r| Some(r.handled_per_s)),
            mean(last, &|r| Some(r.handled_per_s)),
        );
        checks.push(Check {
            name: "throughput flat",
            first: a,
            last: b,
            unit: "msgs/s",
            rule: format!("last within {:.0} % of first", FLAT * 100.0),
            passed: within(a, b),
        });
        let (a, b) = (mean(first, &|r| r.p99_ms), mean(last, &|r| r.p99_ms));
        checks.push(Check {
            name: "p99 flat",
            first: a,
            last: b,
            unit: "ms",
            rule: format!("last within {:.0} % of first", FLAT * 100.0),
            passed: within(a, b),
        });
        let (a, b) = (
            mean(first, &|r| Some(r.rss_bytes)),
            mean(last, &|r| Some(r.rss_bytes)),
        );
        let bound = (FLAT * a).max(RSS_SLACK_BYTES);
        checks.push(Check {
            name: "RSS flat",
            first: a / MIB,
            last: b / MIB,
            unit: "MiB",
            rule: format!("growth at most {:.1} MiB (10 % or 8 MiB)", bound / MIB),
            passed: b - a <= bound,
        });
        // Second half of the run: from its middle minute to its end.
        let middle = minutes.div_ceil(2).max(warmup + 1);
        let at = |m: u32| {
            rows.iter()
                .find(|r| r.minute == m)
                .map_or(f64::NAN, |r| r.pgbox_total() as f64)
        };
        let (a, b) = (at(middle), at(minutes));
        let bound = (FLAT * a).max(SIZE_SLACK_BYTES);
        checks.push(Check {
            name: "pgbox tables bounded",
            first: a / MIB,
            last: b / MIB,
            unit: "MiB",
            rule: format!(
                "total size's growth from minute {middle} to {minutes} at most {:.1} MiB (10 % or 8 MiB)",
                bound / MIB
            ),
            passed: b - a <= bound,
        });
        let kept = mean((warmup + 1, minutes), &|r| Some(r.enqueued_per_s));
        Verdict {
            offered: (rate, kept),
            first,
            last,
            checks,
        }
    }

    fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "verdict: first window minutes {}-{}, last window minutes {}-{}",
            self.first.0, self.first.1, self.last.0, self.last.1
        )];
        for c in &self.checks {
            out.push(format!(
                "  {}: {} ({:.1} → {:.1} {}; {})",
                c.name,
                if c.passed { "PASS" } else { "FAIL" },
                c.first,
                c.last,
                c.unit,
                c.rule
            ));
        }
        let (rate, kept) = self.offered;
        out.push(format!(
            "  offered load kept: {kept:.0} of {rate:.0} msgs/s enqueued after the warm-up ({:.0} %; not a criterion, below 95 % the producers fell behind their schedule)",
            100.0 * kept / rate
        ));
        out.push(format!(
            "  overall: {}",
            if self.passed() { "PASS" } else { "FAIL" }
        ));
        out
    }
}

fn csv(rows: &[Minute], names: &[String]) -> String {
    let mut s = String::from(
        "minute,warmup,enqueued_per_s,handled_per_s,p50_ms,p99_ms,rss_bytes,wal_bytes,wal_bytes_per_msg,autovacuums,pgbox_total_bytes",
    );
    for n in names {
        let _ = write!(s, ",{n}_total_bytes,{n}_index_bytes,{n}_dead_tuples");
    }
    s.push('\n');
    for r in rows {
        let _ = write!(
            s,
            "{},{},{:.1},{:.1},{},{},{:.0},{},{},{},{}",
            r.minute,
            r.warmup,
            r.enqueued_per_s,
            r.handled_per_s,
            opt(r.p50_ms, 3).replace('-', ""),
            opt(r.p99_ms, 3).replace('-', ""),
            r.rss_bytes,
            r.wal_bytes,
            opt(r.wal_per_msg, 1).replace('-', ""),
            r.autovacuums,
            r.pgbox_total()
        );
        for n in names {
            match r.table(n) {
                Some(t) => {
                    let _ = write!(s, ",{},{},{}", t.total, t.index, t.dead);
                }
                None => s.push_str(",,,"),
            }
        }
        s.push('\n');
    }
    s
}

fn markdown(
    rows: &[Minute],
    names: &[String],
    verdict: &Verdict,
    rate: f64,
    args: &SoakArgs,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Soak: {} minutes ({} of warm-up) at {rate:.0} msgs/s offered\n",
        args.soak_minutes, args.soak_warmup_minutes
    );
    let _ = writeln!(
        s,
        "Private PostgreSQL cluster, autovacuum on, durable commits; {PRODUCERS} producers \
         (business row + one keyed message per transaction, {KEYS} keys), relay into the \
         built-in queue, consumer runner with the inbox and a one-row effect, janitor with \
         {} s inbox retention every {} s. Offered load: {}.\n",
        INBOX_RETENTION.as_secs(),
        JANITOR_INTERVAL.as_secs(),
        if args.soak_rate.is_some() {
            "fixed by --soak-rate".to_owned()
        } else {
            format!(
                "{:.0} % of the E1 capacity measured first",
                LOAD_SHARE * 100.0
            )
        }
    );
    let _ = writeln!(s, "## Verdict\n");
    for line in verdict.lines() {
        let _ = writeln!(s, "- {}", line.trim());
    }
    let _ = writeln!(s, "\n## Per minute (w: warm-up)\n");
    let _ = writeln!(
        s,
        "| min | enqueued/s | handled/s | p50 ms | p99 ms | RSS MiB | WAL B/msg | pgbox tables MiB | pgbox dead tuples | autovacuums |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let dead: i64 = r
            .tables
            .iter()
            .filter(|t| t.name.starts_with("pgbox."))
            .map(|t| t.dead)
            .sum();
        let _ = writeln!(
            s,
            "| {}{} | {:.0} | {:.0} | {} | {} | {:.1} | {} | {:.2} | {} | {} |",
            r.minute,
            if r.warmup { " w" } else { "" },
            r.enqueued_per_s,
            r.handled_per_s,
            opt(r.p50_ms, 1),
            opt(r.p99_ms, 1),
            r.rss_bytes / MIB,
            opt(r.wal_per_msg, 0),
            r.pgbox_total() as f64 / MIB,
            dead,
            r.autovacuums
        );
    }
    let picks: Vec<&Minute> = {
        let mut m: Vec<u32> = vec![
            args.soak_warmup_minutes + 1,
            args.soak_minutes.div_ceil(2),
            args.soak_minutes,
        ];
        m.dedup();
        m.iter()
            .filter_map(|&m| rows.iter().find(|r| r.minute == m))
            .collect()
    };
    let _ = writeln!(
        s,
        "\n## Tables (total size MiB, of which indexes; dead tuples) at minutes {}\n",
        picks
            .iter()
            .map(|r| r.minute.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = write!(s, "| table |");
    for r in &picks {
        let _ = write!(s, " minute {} |", r.minute);
    }
    let _ = writeln!(s, "\n|---|{}", "---:|".repeat(picks.len()));
    for n in names {
        let _ = write!(s, "| {n} |");
        for r in &picks {
            match r.table(n) {
                Some(t) => {
                    let _ = write!(
                        s,
                        " {:.2} ({:.2}); {} |",
                        t.total as f64 / MIB,
                        t.index as f64 / MIB,
                        t.dead
                    );
                }
                None => s.push_str(" - |"),
            }
        }
        s.push('\n');
    }
    s
}

/// One series of a panel.
struct Series<'a> {
    label: &'a str,
    color: &'a str,
    points: Vec<(u32, f64)>,
}

/// Four panels, one above the other, sharing the minute axis: throughput, latency, RSS,
/// pgbox tables' total size. The warm-up is shaded.
fn svg(rows: &[Minute], warmup: u32) -> String {
    const WIDTH: f64 = 820.0;
    const PANEL: f64 = 170.0;
    const GAP: f64 = 40.0;
    const LEFT: f64 = 70.0;
    const RIGHT: f64 = 170.0;
    const TOP: f64 = 40.0;
    let minutes = rows.iter().map(|r| r.minute).max().unwrap_or(1).max(1);
    let series = |f: &dyn Fn(&Minute) -> Option<f64>| -> Vec<(u32, f64)> {
        rows.iter()
            .filter_map(|r| f(r).map(|v| (r.minute, v)))
            .collect()
    };
    let panels: Vec<(&str, Vec<Series>)> = vec![
        (
            "throughput (msgs/s)",
            vec![
                Series {
                    label: "handled",
                    color: "#1f77b4",
                    points: series(&|r| Some(r.handled_per_s)),
                },
                Series {
                    label: "enqueued",
                    color: "#aec7e8",
                    points: series(&|r| Some(r.enqueued_per_s)),
                },
            ],
        ),
        (
            "commit → effect (ms)",
            vec![
                Series {
                    label: "p99",
                    color: "#d62728",
                    points: series(&|r| r.p99_ms),
                },
                Series {
                    label: "p50",
                    color: "#ff9896",
                    points: series(&|r| r.p50_ms),
                },
            ],
        ),
        (
            "process RSS (MiB)",
            vec![Series {
                label: "RSS",
                color: "#2ca02c",
                points: series(&|r| Some(r.rss_bytes / MIB)),
            }],
        ),
        (
            "pgbox tables, total size (MiB)",
            vec![Series {
                label: "total",
                color: "#9467bd",
                points: series(&|r| Some(r.pgbox_total() as f64 / MIB)),
            }],
        ),
    ];
    let height = TOP + panels.len() as f64 * (PANEL + GAP) + 20.0;
    let plot_w = WIDTH - LEFT - RIGHT;
    let x = |m: f64| LEFT + plot_w * m / f64::from(minutes);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" font-size="15" text-anchor="middle">pgbox soak: per minute (shaded: warm-up)</text>"#,
        WIDTH / 2.0
    );
    for (i, (title, lines)) in panels.iter().enumerate() {
        let top = TOP + i as f64 * (PANEL + GAP);
        let bottom = top + PANEL;
        let max = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.1))
            .filter(|v| v.is_finite())
            .fold(0.0_f64, f64::max);
        let max = nice_ceiling(max);
        let y = |v: f64| bottom - PANEL * v / max;
        let _ = writeln!(
            s,
            r#"<text x="{LEFT}" y="{:.1}" font-weight="bold">{}</text>"#,
            top - 6.0,
            escape(title)
        );
        if warmup > 0 {
            let _ = writeln!(
                s,
                "<rect x=\"{LEFT}\" y=\"{top:.1}\" width=\"{:.1}\" height=\"{PANEL}\" fill=\"#eeeeee\"/>",
                x(f64::from(warmup)) - LEFT
            );
        }
        // Round steps: 0.2, 0.5 or 1 of a power of ten (max is 1, 2, 2.5 or 5 of one).
        let mantissa = max / 10f64.powf(max.log10().floor());
        let divisions = if (mantissa - 2.0).abs() < 1e-9 { 4 } else { 5 };
        for k in 0..=divisions {
            let v = max * f64::from(k) / f64::from(divisions);
            let _ = writeln!(
                s,
                "<line x1=\"{LEFT}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\" stroke=\"#dddddd\"/>\
                 <text x=\"{2:.1}\" y=\"{3:.1}\" text-anchor=\"end\">{4}</text>",
                y(v),
                LEFT + plot_w,
                LEFT - 6.0,
                y(v) + 4.0,
                tick(v)
            );
        }
        let _ = writeln!(
            s,
            "<polyline points=\"{LEFT},{top:.1} {LEFT},{bottom:.1} {:.1},{bottom:.1}\" fill=\"none\" stroke=\"black\"/>",
            LEFT + plot_w
        );
        let step = minutes.div_ceil(15).max(1);
        for m in (0..=minutes).step_by(step as usize) {
            let _ = writeln!(
                s,
                "<line x1=\"{0:.1}\" y1=\"{bottom:.1}\" x2=\"{0:.1}\" y2=\"{1:.1}\" stroke=\"black\"/>\
                 <text x=\"{0:.1}\" y=\"{2:.1}\" text-anchor=\"middle\">{m}</text>",
                x(f64::from(m)),
                bottom + 4.0,
                bottom + 16.0
            );
        }
        // The first series (the main one) is drawn last, on top; the others dashed.
        for (j, line) in lines.iter().enumerate().rev() {
            let dash = if j == 0 {
                ""
            } else {
                " stroke-dasharray=\"6 3\""
            };
            let points: Vec<String> = line
                .points
                .iter()
                .filter(|p| p.1.is_finite())
                .map(|&(m, v)| format!("{:.1},{:.1}", x(f64::from(m)), y(v)))
                .collect();
            let _ = writeln!(
                s,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{dash}/>",
                points.join(" "),
                line.color
            );
            for p in &points {
                let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(
                    s,
                    "<circle cx=\"{px}\" cy=\"{py}\" r=\"2.5\" fill=\"{}\"/>",
                    line.color
                );
            }
            let ly = top + 14.0 + 18.0 * j as f64;
            let lx = LEFT + plot_w + 14.0;
            let _ = writeln!(
                s,
                "<line x1=\"{lx:.1}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\" stroke=\"{2}\" stroke-width=\"3\"{dash}/>\
                 <text x=\"{3:.1}\" y=\"{4:.1}\">{5}</text>",
                ly - 4.0,
                lx + 20.0,
                line.color,
                lx + 26.0,
                ly,
                escape(line.label)
            );
        }
    }
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">minute</text>\n</svg>",
        LEFT + plot_w / 2.0,
        height - 6.0
    );
    s
}

/// The smallest of 1, 2, 2.5, 5 × 10^k at or above `v` (1 when `v` is not positive).
fn nice_ceiling(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let base = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * base)
        .find(|&c| c >= v)
        .unwrap_or(10.0 * base)
}

fn tick(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A private PostgreSQL cluster in a temporary directory, stopped and removed on drop.
struct Cluster {
    bindir: PathBuf,
    root: bool,
    dir: PathBuf,
    port: u16,
}

impl Cluster {
    /// `initdb` and start, on the first port of 31000-31399 (from a pid-derived offset)
    /// that is free and that the server then manages to bind.
    fn start() -> anyhow::Result<Cluster> {
        let bindir = std::env::var_os("PG_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                let debian = PathBuf::from("/usr/lib/postgresql/15/bin");
                debian.join("initdb").exists().then_some(debian)
            })
            .or_else(local_pg::find_bindir)
            .ok_or_else(|| anyhow::anyhow!("no PostgreSQL binaries: set PG_BIN"))?;
        let root = local_pg::is_root();
        let dir = std::env::temp_dir().join(format!(
            "pgbox-soak-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir)?;
        // From here on, dropping `cluster` removes the directory (and stops a server).
        let mut cluster = Cluster {
            bindir,
            root,
            dir,
            port: 0,
        };
        if root {
            local_pg::run(
                std::process::Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(&cluster.dir),
            )
            .map_err(anyhow::Error::msg)?;
        }
        local_pg::run(
            cluster
                .command("initdb")
                .arg("-D")
                .arg(cluster.data())
                .args([
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                ]),
        )
        .map_err(anyhow::Error::msg)?;
        const FIRST: u16 = 31_000;
        const PORTS: u16 = 400;
        let offset = (std::process::id() % u32::from(PORTS)) as u16;
        let mut last_error = String::new();
        let mut tries = 0;
        for i in 0..PORTS {
            let port = FIRST + (offset + i) % PORTS;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            cluster.port = port;
            let options = format!(
                "-c listen_addresses=127.0.0.1 -p {port} -k {} -c autovacuum=on",
                cluster.dir.display()
            );
            match local_pg::run(
                cluster
                    .command("pg_ctl")
                    .arg("-D")
                    .arg(cluster.data())
                    .arg("-l")
                    .arg(cluster.dir.join("server.log"))
                    .args(["-w", "-t", "60", "-o", &options, "start"]),
            ) {
                Ok(()) => return Ok(cluster),
                Err(e) => last_error = e,
            }
            // A port taken between the check and the start: try another, a few times.
            tries += 1;
            if tries == 3 {
                break;
            }
        }
        cluster.port = 0;
        anyhow::bail!("could not start the private cluster: {last_error}")
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn command(&self, program: &str) -> std::process::Command {
        local_pg::pg_command(self.root, &self.bindir.join(program))
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn remove(dir: &Path) {
        if let Err(e) = std::fs::remove_dir_all(dir) {
            eprintln!("soak: could not remove {}: {e}", dir.display());
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.port != 0 {
            let stopped = local_pg::run(
                self.command("pg_ctl")
                    .arg("-D")
                    .arg(self.data())
                    .args(["-m", "fast", "-w", "-t", "60", "stop"]),
            );
            match stopped {
                Ok(()) => println!("soak: private cluster stopped"),
                Err(e) => eprintln!("soak: stopping the private cluster failed: {e}"),
            }
        }
        Self::remove(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_round_trip_within_their_width() {
        for us in [0, 1, 1023, 1024, 1500, 65_535, 1_000_000, 123_456_789] {
            let v = Histogram::value(Histogram::index(us));
            let err = (v as f64 - us as f64).abs() / (us.max(1) as f64);
            assert!(err <= 0.002, "{us} µs read back as {v}");
        }
    }

    #[test]
    fn histogram_quantiles_follow_the_recorded_values() {
        let mut h = Histogram::default();
        for ms in 1..=100 {
            h.record(Duration::from_millis(ms));
        }
        let p50 = h.quantile_ms(0.5).unwrap();
        let p99 = h.quantile_ms(0.99).unwrap();
        assert!((p50 - 50.0).abs() < 0.2, "p50 {p50}");
        assert!((p99 - 99.0).abs() < 0.3, "p99 {p99}");
        assert!(Histogram::default().quantile_ms(0.5).is_none());
    }

    #[test]
    fn lsn_text_is_a_byte_position() {
        assert_eq!(lsn("0/10"), 16);
        assert_eq!(lsn("1/0"), 1 << 32);
    }

    #[test]
    fn nice_ceiling_rounds_up_to_a_readable_axis_end() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(180.0), 200.0);
        assert_eq!(nice_ceiling(2_100.0), 2_500.0);
    }
}
