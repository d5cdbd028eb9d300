//! J1, J2: the built-in queue (`PgQueue` drained by a `Consumer`) against the Rust job
//! queues a user would otherwise pick, in the same run on the same database: sqlxmq,
//! underway, apalis (PostgreSQL storage) and graphile_worker. Run only when asked for
//! (`--only J`).
//!
//! - J1: a backlog of `n` jobs enqueued (untimed), then drained by each system's own
//!   worker at concurrency 16 with a handler that only returns; jobs/s.
//! - J2: 4 producers enqueue `n` jobs, one per transaction, at full speed while the worker
//!   runs; each job is handled through pgbox's inbox with a one-row effect in the same
//!   transaction (for pgbox, the runner's own inbox transaction; for the peers, a
//!   transaction the handler opens on a sqlx 0.9 pool, as a user would combine them);
//!   jobs/s from the first enqueue to the last effect, effects checked exactly once.
//!
//! Each system in its own tables, made by its own migrations. The arms interleaved
//! (the order rotates from round to round), repeated, medians.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, Envelope, HandlerConnection, Inbox, Message, Outbox, Relay,
};
use sqlx::{Executor, PgPool};

const CONCURRENCY: usize = 16;
const PRODUCERS: usize = 4;
const POOL: u32 = 40;
const LIMIT: Duration = Duration::from_secs(60);
const TOPIC: &str = "jq";
/// The shortest poll period given to the systems that poll (pgbox's runner, underway,
/// apalis, graphile_worker); sqlxmq's is fixed by its runner.
const POLL: Duration = Duration::from_millis(10);

#[derive(Clone, Copy, PartialEq, Debug)]
enum System {
    Pgbox,
    /// The built-in queue without the runner: tasks that receive, handle as the peers' handlers
    /// do (nothing in J1; their own inbox transaction in J2), and ack.
    PgboxLoop,
    Sqlxmq,
    Underway,
    Apalis,
    Graphile,
}

const SYSTEMS: [System; 6] = [
    System::Pgbox,
    System::PgboxLoop,
    System::Sqlxmq,
    System::Underway,
    System::Apalis,
    System::Graphile,
];

impl System {
    fn name(self) -> &'static str {
        match self {
            System::Pgbox => "pgbox PgQueue + Consumer",
            System::PgboxLoop => "pgbox PgQueue, a worker loop like the peers'",
            System::Sqlxmq => "sqlxmq 0.6.0",
            System::Underway => "underway 0.2.0",
            System::Apalis => "apalis 1.0.0 + apalis-postgres 1.0.0",
            System::Graphile => "graphile_worker 0.14.1",
        }
    }
}

/// What every peer's handler shares: a count of handled jobs and, in J2, the pool and
/// inbox it handles them through.
#[derive(Debug)]
struct Ctx {
    done: AtomicUsize,
    inbox: Option<(PgPool, Inbox)>,
}

impl Ctx {
    fn new(pool: &PgPool, with_inbox: bool) -> Arc<Self> {
        Arc::new(Ctx {
            done: AtomicUsize::new(0),
            inbox: with_inbox.then(|| (pool.clone(), Inbox::new("jq").expect("inbox name"))),
        })
    }

    /// The handler: nothing (J1), or the effect through the inbox in a transaction of its
    /// own (J2).
    async fn handle(&self, key: &str) -> anyhow::Result<()> {
        if let Some((pool, inbox)) = &self.inbox {
            let mut tx = pool.begin().await?;
            // A duplicate is skipped by the inbox; the effect count below tells.
            let _outcome = inbox
                .process(&mut tx, key, async |conn: &mut HandlerConnection<'_>| {
                    effect(conn, key).await
                })
                .await?;
            tx.commit().await?;
        }
        self.done.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Waits (bounded) until `n` jobs were handled.
    async fn until(&self, n: usize, started: Instant) -> anyhow::Result<()> {
        while self.done.load(Relaxed) < n {
            anyhow::ensure!(
                started.elapsed() < LIMIT,
                "only {} of {n} jobs handled after {LIMIT:?}",
                self.done.load(Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }
}

async fn effect(conn: &mut HandlerConnection<'_>, key: &str) -> Result<(), pgbox::Error> {
    sqlx::query("INSERT INTO jq_effects VALUES ($1)")
        .bind(key)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs J1 and J2 on the bench's database; prints a table each.
pub(crate) async fn run(server: &str, database: &str, quick: bool) -> anyhow::Result<()> {
    // Pools of their own, large enough for every system's workers, listeners and producers.
    let mut url = url::Url::parse(server)?;
    url.set_path(database);
    let pool = &sqlx::postgres::PgPoolOptions::new()
        .max_connections(POOL)
        .connect(url.as_str())
        .await?;
    let pool08 = &sqlx08::postgres::PgPoolOptions::new()
        .max_connections(POOL)
        .connect(url.as_str())
        .await?;
    let (rounds, n1, n2) = if quick {
        (2, 2_000, 1_000)
    } else {
        (3, 10_000, 5_000)
    };
    pool.execute("CREATE TABLE IF NOT EXISTS jq_effects (k text NOT NULL)")
        .await?;
    underway::run_migrations(pool08).await?;
    apalis_postgres::PostgresStorage::<()>::setup(pool).await?;
    // graphile_worker migrates its schema on `init`.
    graphile::worker(pool, Ctx::new(pool, false)).await?;
    println!();
    println!(
        "J: the built-in queue against the Rust job queues, same database, concurrency {CONCURRENCY}, {rounds} rounds, medians"
    );
    for (id, n, with_inbox) in [
        ("J1 drain", n1, false),
        ("J2 enqueue → handled with the inbox", n2, true),
    ] {
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); SYSTEMS.len()];
        let mut failed: Vec<Option<String>> = vec![None; SYSTEMS.len()];
        for round in 0..rounds {
            for k in 0..SYSTEMS.len() {
                let i = (k + round) % SYSTEMS.len();
                // A peer that cannot finish is reported, not fatal; pgbox must finish.
                match arm(SYSTEMS[i], pool, pool08, n, with_inbox).await {
                    Ok(rate) => {
                        eprintln!(
                            "  {id} round {round}: {} {rate:.0} jobs/s",
                            SYSTEMS[i].name()
                        );
                        rates[i].push(rate);
                    }
                    Err(e) if !matches!(SYSTEMS[i], System::Pgbox | System::PgboxLoop) => {
                        eprintln!("  {id} round {round}: {} failed: {e:#}", SYSTEMS[i].name());
                        failed[i] = Some(format!("{e:#}"));
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        let pgbox = median(rates[0].clone());
        let pgbox_loop = median(rates[1].clone());
        println!();
        println!("{id}, {n} jobs");
        println!();
        println!("| system | jobs/s (median) | pgbox runner / it | pgbox worker loop / it |");
        println!("|---|---:|---:|---:|");
        for (i, s) in SYSTEMS.iter().enumerate() {
            if rates[i].is_empty() {
                println!(
                    "| {} | failed: {} | - | - |",
                    s.name(),
                    failed[i].as_deref().unwrap_or("-")
                );
                continue;
            }
            let m = median(rates[i].clone());
            let note = match &failed[i] {
                Some(e) => format!(
                    " ({} of {rounds} rounds; others failed: {e})",
                    rates[i].len()
                ),
                None => String::new(),
            };
            println!(
                "| {}{note} | {m:.0} | {:.2}× | {:.2}× |",
                s.name(),
                pgbox / m,
                pgbox_loop / m
            );
        }
    }
    println!();
    for note in NOTES {
        println!("note: {note}");
    }
    Ok(())
}

const NOTES: [&str; 5] = [
    "pgbox's runner records every message in its inbox, in J1 too (it has no mode without); the peers' no-op handlers write nothing",
    "pgbox's worker loop is driven as the peers are: 16 tasks receive up to 4 messages, run the peers' handler (nothing in J1; its own inbox transaction in J2) and ack",
    "sqlxmq's runner polls when its NOTIFY or a finished job wakes it, else at the earliest retry time (at most 60 s); it has no poll setting; driven at concurrency 16..16",
    "underway's worker starts one more task-processing loop per NOTIFY or poll tick, up to its limit: polled every 10 ms (its `run_every`) so that it reaches 16 on a backlog that sends no NOTIFY",
    "apalis-postgres fetches in batches (batch size 10, its default) and is woken by its pub/sub listener besides a 10 ms poll; graphile_worker polled every 10 ms besides its LISTEN",
];

async fn arm(
    s: System,
    pool: &PgPool,
    pool08: &sqlx08::PgPool,
    n: usize,
    with_inbox: bool,
) -> anyhow::Result<f64> {
    pool.execute(
        "TRUNCATE jq_effects, pgbox.outbox, pgbox.queue, pgbox.inbox, underway.task, \
         underway.task_attempt, apalis.jobs, graphile_worker._private_jobs CASCADE",
    )
    .await?;
    // sqlxmq's own clean-up keeps the sentinel row its queue needs.
    pool.execute("SELECT mq_clear_all()").await?;
    pool.execute("VACUUM ANALYZE").await?;
    let rate = match s {
        System::Pgbox => pgbox_arm(pool, n, with_inbox).await?,
        System::PgboxLoop => pgbox_loop_arm(pool, n, with_inbox).await?,
        System::Sqlxmq => sqlxmq_arm::arm(pool, pool08, n, with_inbox).await?,
        System::Underway => underway_arm::arm(pool, pool08, n, with_inbox).await?,
        System::Apalis => apalis_arm::arm(pool, n, with_inbox).await?,
        System::Graphile => graphile::arm(pool, n, with_inbox).await?,
    };
    if with_inbox {
        let (total, distinct): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT k) FROM jq_effects")
                .fetch_one(pool)
                .await?;
        anyhow::ensure!(
            total == n as i64 && distinct == n as i64,
            "J2 {}: exactly-once check failed: {total} effects, {distinct} distinct, {n} jobs",
            s.name()
        );
    }
    Ok(rate)
}

/// Runs `produce` from `PRODUCERS` tasks, each with its share of `0..n`.
async fn producers<F, Fut>(n: usize, produce: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let jobs: Vec<usize> = (p..n).step_by(PRODUCERS).collect();
        let mut futures = Vec::new();
        for i in jobs {
            futures.push(produce(i));
        }
        tasks.push(tokio::spawn(async move {
            for f in futures {
                f.await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// J1: the backlog of `n` messages, through the outbox and a relay into the queue, untimed;
/// J2: a relay running into the queue while the producers enqueue.
async fn pgbox_relay(
    pool: &PgPool,
    queue: &PgQueue,
    n: usize,
    with_inbox: bool,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<tokio::task::JoinHandle<pgbox::Result<()>>>> {
    if with_inbox {
        let relay = Relay::builder(pool.clone(), queue.clone()).build()?;
        let s = shutdown.clone();
        return Ok(Some(tokio::spawn(async move { relay.run(s).await })));
    }
    let mut tx = pool.begin().await?;
    Outbox::new()
        .enqueue_batch(
            &mut tx,
            (0..n).map(|_| Message::bytes(TOPIC, vec![b'x'; 16])),
        )
        .await?;
    tx.commit().await?;
    let report = Relay::builder(pool.clone(), queue.clone())
        .build()?
        .drain()
        .await?;
    anyhow::ensure!(report.published == n, "J1 pgbox: relayed {report:?} of {n}");
    pool.execute("VACUUM ANALYZE pgbox.queue").await?;
    Ok(None)
}

/// Producers through the outbox, one message per transaction (J2).
async fn pgbox_producers(pool: &PgPool, n: usize) -> anyhow::Result<()> {
    producers(n, |_| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await?;
            Outbox::new()
                .enqueue(&mut tx, Message::bytes(TOPIC, vec![b'x'; 16]))
                .await?;
            tx.commit().await?;
            Ok(())
        }
    })
    .await
}

async fn pgbox_arm(pool: &PgPool, n: usize, with_inbox: bool) -> anyhow::Result<f64> {
    let queue = PgQueue::new(pool.clone());
    let shutdown = CancellationToken::new();
    let relay = pgbox_relay(pool, &queue, n, with_inbox, &shutdown).await?;
    let done = Arc::new(AtomicUsize::new(0));
    let consumer = Consumer::builder(pool.clone(), queue, TOPIC, Inbox::new("jq")?)
        .concurrency(CONCURRENCY)
        .poll_interval(POLL)
        .build()?;
    let d = done.clone();
    let started = Instant::now();
    let s = shutdown.clone();
    let task = tokio::spawn(async move {
        consumer
            .run(
                async move |msg: &Envelope, conn: &mut HandlerConnection<'_>| {
                    if with_inbox {
                        effect(conn, &msg.id.to_string()).await?;
                    }
                    d.fetch_add(1, Relaxed);
                    Ok::<(), pgbox::Error>(())
                },
                s,
            )
            .await
    });
    if with_inbox {
        pgbox_producers(pool, n).await?;
    }
    let wait = async {
        while done.load(Relaxed) < n {
            anyhow::ensure!(
                started.elapsed() < LIMIT,
                "pgbox: {} of {n}",
                done.load(Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        anyhow::Ok(())
    };
    wait.await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), task).await???;
    if let Some(relay) = relay {
        tokio::time::timeout(Duration::from_secs(30), relay).await???;
    }
    Ok(rate)
}

/// The built-in queue driven as the peers are: `CONCURRENCY` tasks that receive a few
/// messages, run the peers' handler on each and ack it.
async fn pgbox_loop_arm(pool: &PgPool, n: usize, with_inbox: bool) -> anyhow::Result<f64> {
    let queue = PgQueue::new(pool.clone());
    let shutdown = CancellationToken::new();
    let relay = pgbox_relay(pool, &queue, n, with_inbox, &shutdown).await?;
    let ctx = Ctx::new(pool, with_inbox);
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let (queue, ctx, shutdown) = (queue.clone(), ctx.clone(), shutdown.clone());
        workers.push(tokio::spawn(async move {
            while !shutdown.is_cancelled() {
                let got = queue.receive(TOPIC, 4, Duration::from_secs(60)).await?;
                if got.is_empty() {
                    tokio::time::sleep(POLL).await;
                    continue;
                }
                for d in &got {
                    ctx.handle(&d.envelope.id.to_string()).await?;
                    queue.ack(d).await?;
                }
            }
            anyhow::Ok(())
        }));
    }
    if with_inbox {
        pgbox_producers(pool, n).await?;
    }
    let waited = ctx.until(n, started).await;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    for w in workers {
        tokio::time::timeout(Duration::from_secs(30), w).await???;
    }
    if let Some(relay) = relay {
        tokio::time::timeout(Duration::from_secs(30), relay).await???;
    }
    waited?;
    Ok(rate)
}

mod sqlxmq_arm {
    use super::*;
    use ::sqlxmq::{CurrentJob, JobRegistry, job};

    #[job(channel_name = "jq")]
    async fn jq_job(
        mut current_job: CurrentJob,
        ctx: Arc<Ctx>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>> {
        let key = String::from_utf8(current_job.raw_bytes().unwrap_or_default().to_vec())?;
        ctx.handle(&key).await?;
        current_job.complete().await?;
        Ok(())
    }

    async fn enqueue(pool08: &sqlx08::PgPool, i: usize) -> anyhow::Result<()> {
        jq_job
            .builder()
            .set_raw_bytes(format!("sqlxmq-{i}").as_bytes())
            .spawn(pool08)
            .await?;
        Ok(())
    }

    pub(super) async fn arm(
        pool: &PgPool,
        pool08: &sqlx08::PgPool,
        n: usize,
        with_inbox: bool,
    ) -> anyhow::Result<f64> {
        if !with_inbox {
            for i in 0..n {
                enqueue(pool08, i).await?;
            }
        }
        let ctx = Ctx::new(pool, with_inbox);
        let mut registry = JobRegistry::new(&[jq_job]);
        registry.set_context(ctx.clone());
        let started = Instant::now();
        let mut runner = registry
            .runner(pool08)
            .set_concurrency(CONCURRENCY, CONCURRENCY)
            .set_channel_names(&["jq"])
            .run()
            .await?;
        if with_inbox {
            producers(n, |i| {
                let pool08 = pool08.clone();
                async move { enqueue(&pool08, i).await }
            })
            .await?;
        }
        ctx.until(n, started).await?;
        let rate = n as f64 / started.elapsed().as_secs_f64();
        runner.stop().await;
        Ok(rate)
    }
}

mod underway_arm {
    use super::*;
    use underway::{Job, To};

    pub(super) async fn arm(
        pool: &PgPool,
        pool08: &sqlx08::PgPool,
        n: usize,
        with_inbox: bool,
    ) -> anyhow::Result<f64> {
        let ctx = Ctx::new(pool, with_inbox);
        let job = Job::builder()
            .state(ctx.clone())
            .step(|cx, key: String| async move {
                cx.state
                    .handle(&key)
                    .await
                    .map_err(|e| underway::task::Error::Retryable(e.to_string()))?;
                To::done()
            })
            .name("jq")
            .pool(pool08.clone())
            .build()
            .await?;
        if !with_inbox {
            for i in 0..n {
                job.enqueue(&format!("underway-{i}")).await?;
            }
        }
        let shutdown = CancellationToken::new();
        // Stops the worker on every way out, errors included.
        let _stop = shutdown.clone().drop_guard();
        let mut worker = job.worker();
        worker.set_concurrency_limit(CONCURRENCY);
        worker.set_shutdown_token(shutdown.clone());
        let started = Instant::now();
        let task = tokio::spawn(async move {
            worker
                .run_every(jiff::Span::new().milliseconds(POLL.as_millis() as i64))
                .await
        });
        if with_inbox {
            producers(n, |i| {
                let job = job.clone();
                async move {
                    job.enqueue(&format!("underway-{i}")).await?;
                    Ok(())
                }
            })
            .await?;
        }
        ctx.until(n, started).await?;
        let rate = n as f64 / started.elapsed().as_secs_f64();
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), task).await???;
        Ok(rate)
    }
}

mod apalis_arm {
    use super::*;
    use apalis::prelude::*;
    use apalis_postgres::{Config, PostgresStorage};

    async fn handler(key: String, ctx: Data<Arc<Ctx>>) -> Result<(), BoxDynError> {
        ctx.handle(&key).await.map_err(|e| e.to_string())?;
        Ok(())
    }

    fn storage(pool: &PgPool) -> PostgresStorage<String> {
        PostgresStorage::new(pool).with_config(Config::default().queue("jq"))
    }

    pub(super) async fn arm(pool: &PgPool, n: usize, with_inbox: bool) -> anyhow::Result<f64> {
        if !with_inbox {
            let mut s = storage(pool);
            for i in 0..n {
                s.push(format!("apalis-{i}")).await?;
            }
        }
        let ctx = Ctx::new(pool, with_inbox);
        let backend = storage(pool)
            .with_pubsub()
            .poll_with_strategy(Strategy::new().interval(POLL));
        // A name of its own per run: apalis refuses a name its workers table still holds
        // (`WorkerAlreadyExists`).
        let worker = WorkerBuilder::new(format!("jq-{}", uuid::Uuid::now_v7().simple()))
            .backend(backend)
            .data(ctx.clone())
            .concurrency(CONCURRENCY)
            .build(handler);
        let shutdown = CancellationToken::new();
        // Stops the worker on every way out, errors included.
        let _stop = shutdown.clone().drop_guard();
        let s = shutdown.clone();
        let started = Instant::now();
        let task = tokio::spawn(worker.run_until(async move {
            s.cancelled().await;
            Ok::<(), WorkerError>(())
        }));
        if with_inbox {
            producers(n, |i| {
                let mut s = storage(pool);
                async move {
                    s.push(format!("apalis-{i}")).await?;
                    Ok(())
                }
            })
            .await?;
        }
        if let Err(e) = ctx.until(n, started).await {
            shutdown.cancel();
            let worker = tokio::time::timeout(Duration::from_secs(10), task).await;
            anyhow::bail!("{e}; its worker: {worker:?}");
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), task).await???;
        Ok(rate)
    }
}

mod graphile {
    use super::*;
    use graphile_worker::{
        IntoTaskHandlerResult, JobSpec, TaskHandler, Worker, WorkerContext, WorkerOptions,
    };
    use serde::{Deserialize, Serialize};

    #[derive(Deserialize, Serialize)]
    struct JqJob {
        key: String,
    }

    impl TaskHandler for JqJob {
        const IDENTIFIER: &'static str = "jq";

        async fn run(self, ctx: WorkerContext) -> impl IntoTaskHandlerResult {
            let c = ctx.get_ext::<Arc<Ctx>>().ok_or("no context")?;
            c.handle(&self.key).await.map_err(|e| e.to_string())
        }
    }

    pub(super) async fn worker(pool: &PgPool, ctx: Arc<Ctx>) -> anyhow::Result<Worker> {
        Ok(WorkerOptions::default()
            .pg_pool(pool.clone())
            .schema("graphile_worker")
            .concurrency(CONCURRENCY)
            .poll_interval(POLL)
            .listen_os_shutdown_signals(false)
            .define_job::<JqJob>()
            .add_extension(ctx)
            .init()
            .await?)
    }

    pub(super) async fn arm(pool: &PgPool, n: usize, with_inbox: bool) -> anyhow::Result<f64> {
        let ctx = Ctx::new(pool, with_inbox);
        let worker = Arc::new(worker(pool, ctx.clone()).await?);
        let utils = worker.create_utils();
        if !with_inbox {
            for i in 0..n {
                utils
                    .add_job(
                        JqJob {
                            key: format!("graphile-{i}"),
                        },
                        JobSpec::default(),
                    )
                    .await?;
            }
        }
        let started = Instant::now();
        let w = worker.clone();
        let task = tokio::spawn(async move { w.run().await });
        if with_inbox {
            producers(n, |i| {
                let utils = worker.create_utils();
                async move {
                    utils
                        .add_job(
                            JqJob {
                                key: format!("graphile-{i}"),
                            },
                            JobSpec::default(),
                        )
                        .await?;
                    Ok(())
                }
            })
            .await?;
        }
        ctx.until(n, started).await?;
        let rate = n as f64 / started.elapsed().as_secs_f64();
        worker.request_shutdown();
        tokio::time::timeout(Duration::from_secs(30), task).await???;
        Ok(rate)
    }
}
