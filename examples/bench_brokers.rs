//! Each transport's stages and the whole pipeline, in one run: the no-op publisher (the
//! database's ceiling), the built-in Postgres queue, RabbitMQ (publisher confirms on), NATS
//! JetStream (publish acks on) and Kafka (idempotent producer, acks=all). Rounds interleave
//! the transports so that drift on the machine hits them all alike; the tables show
//! medians.
//!
//! - **O2** relay drain: a backlog in the outbox → the broker (confirmed).
//! - **C1** consumer drain: that backlog, now in the broker → the `Consumer` runner → the
//!   inbox and a one-row business effect per message, committed, then acked.
//! - **E1** end to end: producers enqueue (10 messages per business transaction) while the
//!   relay and the consumer run, as a service does; messages/s from the first enqueue to
//!   the last committed effect, exactly-once checked (effects = messages, none twice).
//! - **E1b** the same with the runner's `batch_size` (`--consumer-batch`, default 32):
//!   first deliveries processed many per transaction; run beside E1 every round.
//! - **R1** receive → ack alone: a published backlog received and acked as the runner
//!   does it (up to its concurrency in hand, receiving while acks run), no inbox and no
//!   database work: what the transport costs the consumer side.
//! - **B0** `BEGIN`, the effect's `INSERT`, `COMMIT` from as many tasks, same run: the
//!   physical limit E1 and E1b are measured against (E1 / B0).
//! - **I1** the inbox alone, same run: `inbox.process` with the one-row effect, committed,
//!   from as many tasks as the runner's concurrency, no transport. R1 / I1 says whether the
//!   transport or the inbox bounds the consumer (C1).
//! - **E1 latency**: at a fixed rate, enqueue commit → effect commit (the runner's ack,
//!   which follows its commit), p50 and p99; once with batch size 1 and once with
//!   `--consumer-batch` (E1b: does batching cost latency when messages trickle in?).
//! - **O3**: at a fixed rate, enqueue commit → publish confirmed.
//!
//! Where the time goes: for O2, R1, I1, C1 and E1 the run also reads CPU time from
//! `/proc` (Linux, and only for processes on this machine): this process (the client:
//! relay, producers, runner), every PostgreSQL server process, and the broker's processes
//! (`beam.smp`, `nats-server`, `tansu`), per message, in microseconds. On a machine whose
//! few cores are shared by all three, throughput follows their sum.
//!
//! ```sh
//! cargo run --release --example bench_brokers            # full run
//! cargo run --release --example bench_brokers -- --quick # under a minute
//! ```
//!
//! PostgreSQL and the brokers are found (or started) as the tests do: `DATABASE_URL`,
//! `RABBITMQ_URL`, `NATS_URL`, `KAFKA_BOOTSTRAP`, or the standard local ports (Kafka: a
//! tansu broker on 127.0.0.1:19092, built once per machine). The run works in a database of
//! its own, dropped at the end; broker queues and streams it makes expire by themselves.

#[path = "../tests/support/local_pg.rs"]
mod local_pg;

#[allow(dead_code)]
#[path = "../tests/support/brokers.rs"]
mod brokers;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use pgbox::transport::kafka::Kafka;
use pgbox::transport::nats::Nats;
use pgbox::transport::rabbitmq::RabbitMq;
use pgbox::transport::{DiscardPublisher, PgQueue, PublishError, Publisher, Subscriber};
use pgbox::{
    CancellationToken, Consumer, Envelope, HandlerConnection, Inbox, Limit, Message, Outbox, Relay,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgPool};

#[derive(Parser, Debug)]
struct Args {
    /// Small backlog, short latency runs: finishes in under a minute.
    #[arg(long)]
    quick: bool,
    /// Outbox backlog drained per O2 round.
    #[arg(long, default_value_t = 20_000)]
    backlog: usize,
    /// Rounds per measurement (the table shows the median).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Relay batch size.
    #[arg(long, default_value_t = 500)]
    batch: usize,
    /// Payload bytes per message.
    #[arg(long, default_value_t = 200)]
    payload: usize,
    /// O3: messages committed per second.
    #[arg(long, default_value_t = 200.0)]
    rate: f64,
    /// O3: seconds of producing per round.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// E1 and C1: the consumer runner's concurrency.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// E1b: the consumer runner's batch size (messages per transaction) in the batched
    /// end-to-end arm, run beside E1 (batch size 1, the default) every round.
    #[arg(long, default_value_t = 32)]
    consumer_batch: usize,
    /// The built-in queue's receives and acks wait for their WAL flush
    /// (`PgQueue::wait_for_flush(true)`; by default they do not).
    #[arg(long)]
    queue_waits_for_flush: bool,
    /// E1L: on the built-in queue, E1 again with a consumer limit that never binds (a global
    /// concurrency limit of `--concurrency` slots; a rate limit of a million a second), beside
    /// the unlimited E1, interleaved; prints each limited arm's ratio to the unlimited one.
    #[arg(long)]
    limits: bool,
    /// Only these transports (comma-separated: noop, postgres, rabbitmq, nats, kafka).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Transport {
    Noop,
    Postgres,
    RabbitMq,
    Nats,
    Kafka,
}

const TRANSPORTS: [Transport; 5] = [
    Transport::Noop,
    Transport::Postgres,
    Transport::RabbitMq,
    Transport::Nats,
    Transport::Kafka,
];

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Noop => "no-op publisher",
            Transport::Postgres => "built-in queue (PgQueue)",
            Transport::RabbitMq => "RabbitMQ (confirms)",
            Transport::Nats => "NATS JetStream (acks)",
            Transport::Kafka => "Kafka (acks=all)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Transport::Noop => "noop",
            Transport::Postgres => "postgres",
            Transport::RabbitMq => "rabbitmq",
            Transport::Nats => "nats",
            Transport::Kafka => "kafka",
        }
    }
}

struct Env {
    pool: PgPool,
    rabbit_url: String,
    nats_url: String,
    kafka_url: String,
    run: String,
    /// Room for the batched arm's full batches (RabbitMQ's default prefetch is 100).
    rabbit_prefetch: u16,
    queue_waits_for_flush: bool,
}

impl Env {
    /// The built-in queue, as the run's flags set it.
    fn queue(&self) -> PgQueue {
        PgQueue::new(self.pool.clone()).wait_for_flush(self.queue_waits_for_flush)
    }

    fn rabbit(&self) -> RabbitMq {
        RabbitMq::builder(&self.rabbit_url)
            .prefetch(self.rabbit_prefetch)
            .exchange("pgbox-bench")
            .queue_prefix(format!("pgbox-bench-{}.", self.run))
            .queue_expires(Duration::from_secs(120))
            .build()
            .expect("rabbitmq config")
    }

    fn nats(&self) -> Nats {
        Nats::builder(&self.nats_url)
            .stream("PGBOX_BENCH")
            .subject_prefix("pgbox-bench")
            .max_age(Duration::from_secs(600))
            .inactive_threshold(Duration::from_secs(120))
            .build()
            .expect("nats config")
    }

    fn kafka(&self) -> Kafka {
        Kafka::builder(&self.kafka_url)
            .group(format!("pgbox-bench-{}", self.run))
            .partitions(8)
            .receive_wait(Duration::from_millis(50))
            // tansu answers a fetch only when its wait is over, even when records arrived
            // meanwhile (Apache Kafka answers at once): keep the wait short.
            .set("fetch.wait.max.ms", "5")
            .build()
            .expect("kafka config")
    }

    /// Makes sure a message published to `topic` is kept (queues and consumers exist).
    async fn prepare(&self, transport: Transport, topic: &str) -> anyhow::Result<()> {
        match transport {
            Transport::RabbitMq => self.rabbit().declare_topic(topic).await?,
            Transport::Nats => self.nats().declare_topic(topic).await?,
            Transport::Kafka => self.kafka().declare_topic(topic).await?,
            _ => {}
        }
        Ok(())
    }
}

/// Wraps a publisher, recording when each message was confirmed.
struct Timed<P> {
    inner: Arc<P>,
    confirmed: Arc<Mutex<HashMap<uuid::Uuid, Instant>>>,
}

impl<P> Clone for Timed<P> {
    fn clone(&self) -> Self {
        Timed {
            inner: self.inner.clone(),
            confirmed: self.confirmed.clone(),
        }
    }
}

impl<P: Publisher> Publisher for Timed<P> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let results = self.inner.publish(batch).await;
        let now = Instant::now();
        let mut confirmed = self.confirmed.lock().unwrap();
        for (e, r) in batch.iter().zip(&results) {
            if r.is_ok() {
                confirmed.insert(e.id, now);
            }
        }
        results
    }
}

/// Wraps a subscriber, recording when each message was acked (its effect committed just
/// before).
struct Acked<S> {
    inner: S,
    acked: Arc<Mutex<HashMap<uuid::Uuid, Instant>>>,
}

impl<S: Subscriber> Subscriber for Acked<S> {
    type Delivery = S::Delivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> pgbox::Result<Vec<S::Delivery>> {
        self.inner.receive(topic, max, visibility).await
    }

    fn envelope<'d>(&self, delivery: &'d S::Delivery) -> &'d Envelope {
        self.inner.envelope(delivery)
    }

    fn attempt(&self, delivery: &S::Delivery) -> i32 {
        self.inner.attempt(delivery)
    }

    async fn ack(&self, delivery: &S::Delivery) -> pgbox::Result<bool> {
        let fresh = self.inner.ack(delivery).await?;
        let id = self.inner.envelope(delivery).id;
        self.acked
            .lock()
            .unwrap()
            .entry(id)
            .or_insert_with(Instant::now);
        Ok(fresh)
    }

    async fn nack(
        &self,
        delivery: &S::Delivery,
        delay: Duration,
        error: &str,
    ) -> pgbox::Result<bool> {
        self.inner.nack(delivery, delay, error).await
    }

    async fn dead_letter(&self, delivery: &S::Delivery, error: &str) -> pgbox::Result<bool> {
        self.inner.dead_letter(delivery, error).await
    }

    fn wake_channel(&self) -> Option<(PgPool, String)> {
        self.inner.wake_channel()
    }
}

/// Runs the consumer runner on `topic` (inbox + one effect row per message) until
/// `shutdown`; `acked` fills as effects commit.
// The bench's arms differ in these settings only; a struct for one call site each would add nothing.
#[allow(clippy::too_many_arguments)]
fn spawn_consumer<S: Subscriber + 'static>(
    env: &Env,
    args: &Args,
    subscriber: S,
    topic: &str,
    acked: Arc<Mutex<HashMap<uuid::Uuid, Instant>>>,
    shutdown: CancellationToken,
    batch: usize,
    limits: &[Limit],
) -> tokio::task::JoinHandle<pgbox::Result<pgbox::ConsumerStats>> {
    let mut builder = Consumer::builder(
        env.pool.clone(),
        Acked {
            inner: subscriber,
            acked,
        },
        topic.to_owned(),
        Inbox::new("bench").expect("inbox name"),
    )
    .concurrency(args.concurrency)
    .batch_size(batch)
    .poll_interval(Duration::from_millis(10));
    for limit in limits {
        builder = builder.limit(limit.clone());
    }
    let consumer = builder.build().expect("consumer config");
    tokio::spawn(async move {
        consumer
            .run(
                async |msg: &Envelope, conn: &mut HandlerConnection<'_>| {
                    sqlx::query("INSERT INTO bench_effects (message_id) VALUES ($1)")
                        .bind(msg.id)
                        .execute(&mut *conn)
                        .await
                        .map_err(pgbox::Error::from)?;
                    Ok::<(), pgbox::Error>(())
                },
                shutdown,
            )
            .await
    })
}

/// Starts the consumer of transport `t` on `topic`, `batch` messages per transaction.
// The bench's arms differ in these settings only; a struct for one call site each would add nothing.
#[allow(clippy::too_many_arguments)]
fn consumer_of(
    env: &Env,
    args: &Args,
    t: Transport,
    topic: &str,
    acked: Arc<Mutex<HashMap<uuid::Uuid, Instant>>>,
    shutdown: CancellationToken,
    batch: usize,
    limits: &[Limit],
) -> tokio::task::JoinHandle<pgbox::Result<pgbox::ConsumerStats>> {
    match t {
        Transport::Noop => unreachable!("the no-op publisher has no consumer side"),
        Transport::Postgres => spawn_consumer(
            env,
            args,
            env.queue(),
            topic,
            acked,
            shutdown,
            batch,
            limits,
        ),
        Transport::RabbitMq => spawn_consumer(
            env,
            args,
            env.rabbit(),
            topic,
            acked,
            shutdown,
            batch,
            limits,
        ),
        Transport::Nats => {
            spawn_consumer(env, args, env.nats(), topic, acked, shutdown, batch, limits)
        }
        Transport::Kafka => spawn_consumer(
            env,
            args,
            env.kafka(),
            topic,
            acked,
            shutdown,
            batch,
            limits,
        ),
    }
}

/// Waits (bounded) until `n` effects are acked; returns when the last one was.
async fn until_acked(
    acked: &Mutex<HashMap<uuid::Uuid, Instant>>,
    n: usize,
    limit: Duration,
) -> anyhow::Result<Instant> {
    let start = Instant::now();
    loop {
        {
            let acked = acked.lock().unwrap();
            if acked.len() >= n {
                return Ok(*acked.values().max().expect("some"));
            }
            anyhow::ensure!(
                start.elapsed() < limit,
                "only {} of {n} effects after {limit:?}",
                acked.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// CPU time read from `/proc/<pid>/stat`, summed per role, in clock ticks (USER_HZ, 100
/// per second on Linux).
#[derive(Clone, Copy, Default)]
struct CpuTicks {
    client: u64,
    postgres: Option<u64>,
    broker: Option<u64>,
}

/// CPU spent per message by one arm, in microseconds.
#[derive(Clone, Copy)]
struct CpuPerMessage {
    client: f64,
    postgres: Option<f64>,
    broker: Option<f64>,
}

impl CpuTicks {
    const USER_HZ: f64 = 100.0;

    /// Utime + stime of `pid`, and its command name.
    fn of(pid: &str) -> Option<(String, u64)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let comm = stat[open + 1..close].to_owned();
        // Fields after the command: state is the 3rd field, utime the 14th, stime the 15th.
        let rest: Vec<&str> = stat[close + 2..].split(' ').collect();
        let utime: u64 = rest.get(11)?.parse().ok()?;
        let stime: u64 = rest.get(12)?.parse().ok()?;
        Some((comm, utime + stime))
    }

    /// Reads the client's, PostgreSQL's and `broker`'s processes (by command name).
    fn now(broker: Option<Transport>) -> CpuTicks {
        let broker_comm = match broker {
            Some(Transport::RabbitMq) => Some("beam.smp"),
            Some(Transport::Nats) => Some("nats-server"),
            Some(Transport::Kafka) => Some("tansu"),
            _ => None,
        };
        let client = Self::of("self").map_or(0, |(_, t)| t);
        let (mut postgres, mut brokers) = (None::<u64>, None::<u64>);
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let name = entry.file_name();
                let Some(pid) = name
                    .to_str()
                    .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
                else {
                    continue;
                };
                let Some((comm, ticks)) = Self::of(pid) else {
                    continue;
                };
                if comm == "postgres" {
                    *postgres.get_or_insert(0) += ticks;
                } else if Some(comm.as_str()) == broker_comm {
                    *brokers.get_or_insert(0) += ticks;
                }
            }
        }
        CpuTicks {
            client,
            postgres,
            broker: brokers,
        }
    }

    /// CPU per message since `self`, `n` messages later.
    fn per_message(self, later: CpuTicks, n: usize) -> CpuPerMessage {
        let us = |ticks: u64| ticks as f64 / Self::USER_HZ * 1e6 / n as f64;
        let diff = |a: Option<u64>, b: Option<u64>| Some(us(b?.saturating_sub(a?)));
        CpuPerMessage {
            client: us(later.client.saturating_sub(self.client)),
            postgres: diff(self.postgres, later.postgres),
            broker: diff(self.broker, later.broker),
        }
    }
}

/// Medians of CPU per message over rounds, as "client / postgres / broker" µs.
fn cpu_cell(samples: Option<&Vec<CpuPerMessage>>) -> String {
    let Some(samples) = samples.filter(|s| !s.is_empty()) else {
        return "-".into();
    };
    let part = |f: &dyn Fn(&CpuPerMessage) -> Option<f64>| {
        let v: Vec<f64> = samples.iter().filter_map(f).collect();
        if v.len() == samples.len() {
            format!("{:.0}", median(v))
        } else {
            "-".into()
        }
    };
    format!(
        "{} / {} / {}",
        part(&|c| Some(c.client)),
        part(&|c| c.postgres),
        part(&|c| c.broker)
    )
}

/// Effects = messages, none twice.
async fn exactly_once(env: &Env, n: usize) -> anyhow::Result<()> {
    let (total, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM bench_effects")
            .fetch_one(&env.pool)
            .await?;
    anyhow::ensure!(
        total == n as i64 && distinct == n as i64,
        "exactly-once check failed: {total} effects, {distinct} distinct, {n} messages"
    );
    Ok(())
}

async fn reset(env: &Env) -> anyhow::Result<()> {
    env.pool
        .execute("TRUNCATE pgbox.outbox, pgbox.queue, pgbox.inbox, bench_effects")
        .await?;
    Ok(())
}

async fn stop_consumer(
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<pgbox::Result<pgbox::ConsumerStats>>,
) -> anyhow::Result<pgbox::ConsumerStats> {
    shutdown.cancel();
    Ok(tokio::time::timeout(Duration::from_secs(30), task).await???)
}

/// C1: the backlog O2 just published, consumed through the runner and the inbox; msgs/s.
async fn c1(
    env: &Env,
    args: &Args,
    t: Transport,
    topic: &str,
) -> anyhow::Result<(f64, CpuPerMessage)> {
    let acked: Arc<Mutex<HashMap<uuid::Uuid, Instant>>> = Arc::default();
    let shutdown = CancellationToken::new();
    let cpu = CpuTicks::now(Some(t));
    let started = Instant::now();
    let task = consumer_of(env, args, t, topic, acked.clone(), shutdown.clone(), 1, &[]);
    let last = until_acked(&acked, args.backlog, Duration::from_secs(300)).await?;
    let cpu = cpu.per_message(CpuTicks::now(Some(t)), args.backlog);
    stop_consumer(shutdown, task).await?;
    exactly_once(env, args.backlog).await?;
    Ok((
        args.backlog as f64 / last.duration_since(started).as_secs_f64(),
        cpu,
    ))
}

/// R1: a backlog published to `t` (untimed), then received and acked alone, up to the
/// runner's concurrency in hand; msgs/s.
async fn r1(
    env: &Env,
    args: &Args,
    t: Transport,
    round: usize,
) -> anyhow::Result<(f64, CpuPerMessage)> {
    async fn go<P: Publisher, S: Subscriber>(
        env: &Env,
        args: &Args,
        publisher: P,
        subscriber: S,
        topic: &str,
        t: Transport,
    ) -> anyhow::Result<(f64, CpuPerMessage)> {
        let n = args.backlog;
        fill(&env.pool, topic, n, &vec![b'x'; args.payload]).await?;
        drain(&env.pool, publisher, args.batch, n).await?;
        let mut seen = std::collections::HashSet::with_capacity(n);
        let limit = Duration::from_secs(300);
        let cpu = CpuTicks::now(Some(t));
        let started = Instant::now();
        // As the runner does: up to `concurrency` messages in hand, receiving more while
        // earlier ones are being acked.
        let mut acking = futures_util::stream::FuturesUnordered::new();
        while seen.len() < n {
            anyhow::ensure!(
                started.elapsed() < limit,
                "R1: only {} of {n} received after {limit:?}",
                seen.len()
            );
            let free = args.concurrency.saturating_sub(acking.len());
            // As the runner does under load: receive once a quarter of the slots are free.
            if free >= args.concurrency.div_ceil(4) || acking.is_empty() {
                // Acks keep running while the receive waits (they may hold connections
                // of the pool the receive needs), as in the runner.
                let receive = subscriber.receive(topic, free, Duration::from_secs(60));
                tokio::pin!(receive);
                let batch = loop {
                    tokio::select! {
                        r = &mut receive => break r?,
                        Some(acked) = futures_util::StreamExt::next(&mut acking), if !acking.is_empty() => {
                            seen.insert(acked?);
                        }
                    }
                };
                let received = batch.len();
                for d in batch {
                    let subscriber = &subscriber;
                    acking.push(async move {
                        let fresh = subscriber.ack(&d).await?;
                        anyhow::ensure!(fresh, "R1: an ack found its delivery stale");
                        Ok(subscriber.envelope(&d).id)
                    });
                }
                if received == free {
                    continue;
                }
            }
            // Wait for an ack, or (none in flight) for messages to arrive.
            match futures_util::StreamExt::next(&mut acking).await {
                Some(acked) => {
                    seen.insert(acked?);
                }
                None => tokio::time::sleep(Duration::from_millis(1)).await,
            }
            while let Some(Some(acked)) =
                futures_util::FutureExt::now_or_never(futures_util::StreamExt::next(&mut acking))
            {
                seen.insert(acked?);
            }
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        Ok((rate, cpu.per_message(CpuTicks::now(Some(t)), n)))
    }
    let topic = format!("r1-{}-{round}-{}", t.short(), env.run);
    env.prepare(t, &topic).await?;
    reset(env).await?;
    match t {
        Transport::Noop => unreachable!("the no-op publisher has no consumer side"),
        Transport::Postgres => go(env, args, env.queue(), env.queue(), &topic, t).await,
        Transport::RabbitMq => {
            let r = env.rabbit();
            let rate = go(env, args, r.clone(), r.clone(), &topic, t).await;
            r.close().await;
            rate
        }
        Transport::Nats => go(env, args, env.nats(), env.nats(), &topic, t).await,
        Transport::Kafka => go(env, args, env.kafka(), env.kafka(), &topic, t).await,
    }
}

/// I1: the inbox alone, as the runner drives it: `inbox.process` with the one-row effect,
/// one transaction per message, from `concurrency` tasks; msgs/s, exactly-once checked.
async fn i1(env: &Env, args: &Args) -> anyhow::Result<(f64, CpuPerMessage)> {
    reset(env).await?;
    let n = args.backlog;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let cpu = CpuTicks::now(None);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency {
        let pool = env.pool.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let inbox = Inbox::new("bench")?;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let id = uuid::Uuid::now_v7();
                let mut tx = pool.begin().await?;
                let outcome = inbox
                    .process(&mut tx, id, async |conn: &mut HandlerConnection<'_>| {
                        sqlx::query("INSERT INTO bench_effects (message_id) VALUES ($1)")
                            .bind(id)
                            .execute(&mut *conn)
                            .await
                            .map_err(pgbox::Error::from)?;
                        Ok::<(), pgbox::Error>(())
                    })
                    .await?;
                anyhow::ensure!(
                    outcome.is_processed(),
                    "I1: a new key came back {outcome:?}"
                );
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.per_message(CpuTicks::now(None), n);
    exactly_once(env, n).await?;
    Ok((rate, cpu))
}

/// B0: the physical limit the consumer path is measured against: `BEGIN`, the one-row
/// effect's `INSERT`, `COMMIT`, from `concurrency` tasks, no inbox and no transport; msgs/s.
async fn b0(env: &Env, args: &Args) -> anyhow::Result<(f64, CpuPerMessage)> {
    reset(env).await?;
    let n = args.backlog;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let cpu = CpuTicks::now(None);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency {
        let pool = env.pool.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let mut tx = pool.begin().await?;
                sqlx::query("INSERT INTO bench_effects (message_id) VALUES ($1)")
                    .bind(uuid::Uuid::now_v7())
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.per_message(CpuTicks::now(None), n);
    exactly_once(env, n).await?;
    Ok((rate, cpu))
}

/// E1: producers, relay and consumer at once; msgs/s from the first enqueue to the last
/// committed effect. The consumer processes `batch` messages per transaction (E1b > 1).
async fn e1(
    env: &Env,
    args: &Args,
    t: Transport,
    round: usize,
    batch: usize,
    limits: &[Limit],
) -> anyhow::Result<(f64, CpuPerMessage)> {
    let topic = format!(
        "e1-{}-{round}-b{batch}-l{}-{}",
        t.short(),
        limits.first().map_or("", Limit::name),
        env.run
    );
    env.prepare(t, &topic).await?;
    reset(env).await?;
    let acked: Arc<Mutex<HashMap<uuid::Uuid, Instant>>> = Arc::default();
    let shutdown = CancellationToken::new();
    let consumer = consumer_of(
        env,
        args,
        t,
        &topic,
        acked.clone(),
        shutdown.clone(),
        batch,
        limits,
    );
    let relay = spawn_relay(env, args, t, shutdown.clone())?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = args.backlog;
    let cpu = CpuTicks::now(Some(t));
    let started = Instant::now();
    const PRODUCERS: usize = 4;
    const PER_TX: usize = 10;
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let pool = env.pool.clone();
        let topic = topic.clone();
        let payload = vec![b'x'; args.payload];
        let share = n / PRODUCERS + usize::from(p < n % PRODUCERS);
        producers.push(tokio::spawn(async move {
            let outbox = Outbox::new();
            let mut left = share;
            while left > 0 {
                let k = left.min(PER_TX);
                let mut tx = pool.begin().await?;
                outbox
                    .enqueue_batch(
                        &mut tx,
                        (0..k).map(|_| Message::bytes(&topic, payload.clone())),
                    )
                    .await?;
                tx.commit().await?;
                left -= k;
            }
            anyhow::Ok(())
        }));
    }
    for p in producers {
        p.await??;
    }
    let enqueued = started.elapsed();
    let last = until_acked(&acked, n, Duration::from_secs(300)).await?;
    let cpu = cpu.per_message(CpuTicks::now(Some(t)), n);
    stop_consumer(shutdown, consumer).await?;
    relay.await??;
    exactly_once(env, n).await?;
    let rate = n as f64 / last.duration_since(started).as_secs_f64();
    eprintln!(
        "  E1 {} (batch {batch}): producers enqueued {:.0} msgs/s (relay and consumer running), end to end {rate:.0} msgs/s",
        t.name(),
        n as f64 / enqueued.as_secs_f64()
    );
    Ok((rate, cpu))
}

fn spawn_relay(
    env: &Env,
    args: &Args,
    t: Transport,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<pgbox::Result<()>>> {
    fn go<P: Publisher + 'static>(
        env: &Env,
        args: &Args,
        p: P,
        shutdown: CancellationToken,
    ) -> anyhow::Result<tokio::task::JoinHandle<pgbox::Result<()>>> {
        let relay = Relay::builder(env.pool.clone(), p)
            .batch_size(args.batch)
            .build()?;
        Ok(tokio::spawn(async move { relay.run(shutdown).await }))
    }
    match t {
        Transport::Noop => go(env, args, DiscardPublisher, shutdown),
        Transport::Postgres => go(env, args, env.queue(), shutdown),
        Transport::RabbitMq => go(env, args, env.rabbit(), shutdown),
        Transport::Nats => go(env, args, env.nats(), shutdown),
        Transport::Kafka => go(env, args, env.kafka(), shutdown),
    }
}

/// The runner's batch sizes of the E1 arm (1) and the E1b arm, alternating which goes first
/// from round to round.
fn batch_arms(args: &Args, round: usize) -> [usize; 2] {
    let mut arms = [1, args.consumer_batch];
    if round % 2 == 1 {
        arms.reverse();
    }
    arms
}

/// E1 latency: at a fixed rate, enqueue commit → effect commit, the runner processing up
/// to `batch` messages per transaction; (p50, p99).
async fn e1_latency(
    env: &Env,
    args: &Args,
    t: Transport,
    round: usize,
    batch: usize,
) -> anyhow::Result<(Duration, Duration)> {
    let topic = format!("e1l-{}-{round}-{batch}-{}", t.short(), env.run);
    env.prepare(t, &topic).await?;
    reset(env).await?;
    let acked: Arc<Mutex<HashMap<uuid::Uuid, Instant>>> = Arc::default();
    let shutdown = CancellationToken::new();
    let consumer = consumer_of(
        env,
        args,
        t,
        &topic,
        acked.clone(),
        shutdown.clone(),
        batch,
        &[],
    );
    let relay = spawn_relay(env, args, t, shutdown.clone())?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let committed = produce_at_rate(env, args, &topic).await?;
    until_acked(&acked, committed.len(), Duration::from_secs(30)).await?;
    stop_consumer(shutdown, consumer).await?;
    relay.await??;
    exactly_once(env, committed.len()).await?;
    let acked = acked.lock().unwrap();
    let mut lat: Vec<Duration> = committed
        .iter()
        .filter_map(|(id, at)| acked.get(id).map(|a| a.saturating_duration_since(*at)))
        .collect();
    lat.sort();
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
}

/// Commits one message per transaction to `topic` at `args.rate` for `args.seconds`;
/// returns when each was committed.
async fn produce_at_rate(
    env: &Env,
    args: &Args,
    topic: &str,
) -> anyhow::Result<HashMap<uuid::Uuid, Instant>> {
    let outbox = Outbox::new();
    let mut committed = HashMap::new();
    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let duration = Duration::from_secs_f64(args.seconds);
    let started = Instant::now();
    let mut next = started;
    // Bounded by `args.seconds`.
    while started.elapsed() < duration {
        let mut tx = env.pool.begin().await?;
        let id = outbox
            .enqueue(&mut tx, Message::bytes(topic, vec![b'x'; args.payload]))
            .await?;
        tx.commit().await?;
        committed.insert(id, Instant::now());
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
    Ok(committed)
}

async fn fill(pool: &PgPool, topic: &str, n: usize, payload: &[u8]) -> anyhow::Result<()> {
    let outbox = Outbox::new();
    let mut left = n;
    while left > 0 {
        let k = left.min(5_000);
        let mut tx = pool.begin().await?;
        outbox
            .enqueue_batch(
                &mut tx,
                (0..k).map(|_| Message::bytes(topic, payload.to_vec())),
            )
            .await?;
        tx.commit().await?;
        left -= k;
    }
    pool.execute("VACUUM (ANALYZE) pgbox.outbox").await?;
    Ok(())
}

/// Drains the outbox through `publisher`; returns msgs/s.
async fn drain<P: Publisher>(
    pool: &PgPool,
    publisher: P,
    batch: usize,
    n: usize,
) -> anyhow::Result<f64> {
    let relay = Relay::builder(pool.clone(), publisher)
        .batch_size(batch)
        .build()?;
    let started = Instant::now();
    let mut published = 0;
    // Bounded: every round publishes or the backlog is gone; failures end the run.
    while published < n {
        let report = relay.relay_once().await?;
        if report.claimed == 0 {
            break;
        }
        anyhow::ensure!(
            report.retried == 0 && report.dead_lettered == 0,
            "publishing failed during the drain: {report:?}"
        );
        published += report.published;
    }
    anyhow::ensure!(published == n, "published {published} of {n}");
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// O2, then (for a transport with a consumer side) C1 on what it published.
type Stage = (f64, CpuPerMessage);

async fn o2(
    env: &Env,
    args: &Args,
    t: Transport,
    round: usize,
) -> anyhow::Result<(Stage, Option<Stage>)> {
    let topic = format!("o2-{}-{round}-{}", t.short(), env.run);
    env.prepare(t, &topic).await?;
    reset(env).await?;
    fill(&env.pool, &topic, args.backlog, &vec![b'x'; args.payload]).await?;
    let (pool, batch, n) = (&env.pool, args.batch, args.backlog);
    let cpu = CpuTicks::now(Some(t));
    let rate = match t {
        Transport::Noop => drain(pool, DiscardPublisher, batch, n).await?,
        Transport::Postgres => drain(pool, env.queue(), batch, n).await?,
        Transport::RabbitMq => {
            let r = env.rabbit();
            let rate = drain(pool, r.clone(), batch, n).await?;
            r.close().await;
            rate
        }
        Transport::Nats => drain(pool, env.nats(), batch, n).await?,
        Transport::Kafka => drain(pool, env.kafka(), batch, n).await?,
    };
    let cpu = cpu.per_message(CpuTicks::now(Some(t)), n);
    let consumed = match t {
        Transport::Noop => None,
        _ => Some(c1(env, args, t, &topic).await?),
    };
    Ok(((rate, cpu), consumed))
}

async fn latency<P: Publisher + 'static>(
    env: &Env,
    args: &Args,
    publisher: P,
    topic: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let timed = Timed {
        inner: Arc::new(publisher),
        confirmed: Arc::default(),
    };
    let relay = Relay::builder(env.pool.clone(), timed.clone())
        .batch_size(args.batch)
        .build()?;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let committed = produce_at_rate(env, args, topic).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while timed.confirmed.lock().unwrap().len() < committed.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    task.await??;
    let confirmed = timed.confirmed.lock().unwrap();
    anyhow::ensure!(
        confirmed.len() >= committed.len(),
        "only {} of {} messages published within 10 s",
        confirmed.len(),
        committed.len()
    );
    let mut lat: Vec<Duration> = committed
        .iter()
        .filter_map(|(id, at)| confirmed.get(id).map(|c| c.saturating_duration_since(*at)))
        .collect();
    lat.sort();
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
}

async fn o3(
    env: &Env,
    args: &Args,
    t: Transport,
    round: usize,
) -> anyhow::Result<(Duration, Duration)> {
    let topic = format!("o3-{}-{round}-{}", t.short(), env.run);
    env.prepare(t, &topic).await?;
    reset(env).await?;
    match t {
        Transport::Noop => latency(env, args, DiscardPublisher, &topic).await,
        Transport::Postgres => latency(env, args, env.queue(), &topic).await,
        Transport::RabbitMq => latency(env, args, env.rabbit(), &topic).await,
        Transport::Nats => latency(env, args, env.nats(), &topic).await,
        Transport::Kafka => latency(env, args, env.kafka(), &topic).await,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).expect("comparable"));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.backlog = args.backlog.min(3_000);
        args.rounds = 3;
        args.seconds = args.seconds.min(1.5);
    }
    anyhow::ensure!(
        args.rounds >= 1 && args.backlog >= 1 && args.rate > 0.0 && args.consumer_batch >= 2
    );
    let server = local_pg::database_url()
        .await
        .map_err(|e| anyhow::anyhow!("no PostgreSQL: {e}"))?;
    // Only the brokers of the transports asked for are found (or started).
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let rabbit_url = match wanted("rabbitmq") {
        true => brokers::rabbitmq_url().await,
        false => String::new(),
    };
    let nats_url = match wanted("nats") {
        true => brokers::nats_url().await,
        false => String::new(),
    };
    let kafka_url = match wanted("kafka") {
        true => brokers::kafka_url().await,
        false => String::new(),
    };
    let run = uuid::Uuid::now_v7().simple().to_string();
    let database = format!("pgbox_bench_brokers_{run}");
    let mut admin = sqlx::PgConnection::connect(&server).await?;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE \"{database}\""
        )))
        .await?;
    let options = PgConnectOptions::from_str(&server)?.database(&database);
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    pgbox::migrate(&pool).await?;
    pool.execute("CREATE TABLE bench_effects (message_id uuid NOT NULL)")
        .await?;
    let env = Env {
        pool,
        rabbit_url,
        nats_url,
        kafka_url,
        run,
        rabbit_prefetch: u16::try_from(args.concurrency * args.consumer_batch)
            .unwrap_or(u16::MAX)
            .max(100),
        queue_waits_for_flush: args.queue_waits_for_flush,
    };
    println!(
        "backlog {} × {} B, batch {}, {} rounds (medians); O3 at {}/s for {} s",
        args.backlog, args.payload, args.batch, args.rounds, args.rate, args.seconds
    );
    let result = bench(&env, &args).await;
    env.pool.close().await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
        )))
        .await?;
    result
}

async fn bench(env: &Env, args: &Args) -> anyhow::Result<()> {
    let transports: Vec<Transport> = TRANSPORTS
        .into_iter()
        .filter(|t| args.only.is_empty() || args.only.iter().any(|o| o == t.short()))
        .collect();
    anyhow::ensure!(!transports.is_empty(), "--only named no known transport");
    let with_consumer: Vec<Transport> = transports
        .iter()
        .copied()
        .filter(|&t| t != Transport::Noop)
        .collect();
    let mut drains: HashMap<Transport, Vec<f64>> = HashMap::new();
    let mut consumes: HashMap<Transport, Vec<f64>> = HashMap::new();
    let mut ends: HashMap<Transport, Vec<f64>> = HashMap::new();
    let mut batched: HashMap<Transport, Vec<f64>> = HashMap::new();
    let mut lats: HashMap<Transport, Vec<(Duration, Duration)>> = HashMap::new();
    let mut e_lats: HashMap<Transport, Vec<(Duration, Duration)>> = HashMap::new();
    let mut eb_lats: HashMap<Transport, Vec<(Duration, Duration)>> = HashMap::new();
    let mut receives: HashMap<Transport, Vec<f64>> = HashMap::new();
    let mut inbox_alone: Vec<f64> = Vec::new();
    let mut limited: HashMap<&str, Vec<f64>> = HashMap::new();
    let mut bare_commits: Vec<f64> = Vec::new();
    // CPU per message per (stage, transport); I1 under Noop.
    let mut cpu: HashMap<(&str, Transport), Vec<CpuPerMessage>> = HashMap::new();
    for round in 0..args.rounds {
        // Rotate the order each round, so no transport always goes first.
        let order = |list: &[Transport]| -> Vec<Transport> {
            (0..list.len())
                .map(|i| list[(i + round) % list.len()])
                .collect()
        };
        for t in order(&transports) {
            let ((rate, o2_cpu), consumed) = o2(env, args, t, round).await?;
            eprintln!(
                "round {round}: O2 {} {rate:.0} msgs/s; C1 {}",
                t.name(),
                consumed.map_or("-".into(), |c| format!("{:.0} msgs/s", c.0))
            );
            drains.entry(t).or_default().push(rate);
            cpu.entry(("O2", t)).or_default().push(o2_cpu);
            if let Some((c, c1_cpu)) = consumed {
                consumes.entry(t).or_default().push(c);
                cpu.entry(("C1", t)).or_default().push(c1_cpu);
            }
        }
        // I1 goes at a different place among the R1 arms each round.
        let mut r_arms: Vec<Option<Transport>> =
            order(&with_consumer).into_iter().map(Some).collect();
        r_arms.insert(round % (r_arms.len() + 1), None);
        for arm in r_arms {
            match arm {
                Some(t) => {
                    let (rate, r1_cpu) = r1(env, args, t, round).await?;
                    eprintln!("round {round}: R1 {} {rate:.0} msgs/s", t.name());
                    receives.entry(t).or_default().push(rate);
                    cpu.entry(("R1", t)).or_default().push(r1_cpu);
                }
                None => {
                    let (rate, i1_cpu) = i1(env, args).await?;
                    eprintln!("round {round}: I1 inbox alone {rate:.0} msgs/s");
                    inbox_alone.push(rate);
                    cpu.entry(("I1", Transport::Noop)).or_default().push(i1_cpu);
                    let (rate, b0_cpu) = b0(env, args).await?;
                    eprintln!("round {round}: B0 BEGIN/INSERT/COMMIT {rate:.0} msgs/s");
                    bare_commits.push(rate);
                    cpu.entry(("B0", Transport::Noop)).or_default().push(b0_cpu);
                }
            }
        }
        for t in order(&with_consumer) {
            for batch in batch_arms(args, round) {
                let (rate, e1_cpu) = e1(env, args, t, round, batch, &[]).await?;
                eprintln!(
                    "round {round}: E1 {} batch {batch} {rate:.0} msgs/s",
                    t.name()
                );
                if batch == 1 {
                    ends.entry(t).or_default().push(rate);
                    cpu.entry(("E1", t)).or_default().push(e1_cpu);
                } else {
                    batched.entry(t).or_default().push(rate);
                    cpu.entry(("E1b", t)).or_default().push(e1_cpu);
                }
            }
        }
        if args.limits && with_consumer.contains(&Transport::Postgres) {
            // E1L: unlimited, a concurrency limit, a rate limit, none of them binding; the
            // order rotates per round.
            let mut arms: Vec<(&str, Vec<Limit>)> = vec![
                ("none", vec![]),
                (
                    "concurrency",
                    vec![Limit::concurrency("bench-slots", args.concurrency as u32)],
                ),
                (
                    "rate",
                    vec![Limit::rate("bench-rate", 1_000_000.0).burst(1_000_000)],
                ),
            ];
            arms.rotate_left(round % 3);
            for (arm, limits) in arms {
                let (rate, _) = e1(env, args, Transport::Postgres, round, 1, &limits).await?;
                eprintln!("round {round}: E1L built-in queue, limit {arm}: {rate:.0} msgs/s");
                limited.entry(arm).or_default().push(rate);
            }
        }
        for t in order(&with_consumer) {
            for batch in batch_arms(args, round) {
                let l = e1_latency(env, args, t, round, batch).await?;
                eprintln!(
                    "round {round}: E1 latency {} batch {batch} p50 {:?} p99 {:?}",
                    t.name(),
                    l.0,
                    l.1
                );
                if batch == 1 {
                    e_lats.entry(t).or_default().push(l);
                } else {
                    eb_lats.entry(t).or_default().push(l);
                }
            }
        }
        for t in order(&transports) {
            let l = o3(env, args, t, round).await?;
            eprintln!("round {round}: O3 {} p50 {:?} p99 {:?}", t.name(), l.0, l.1);
            lats.entry(t).or_default().push(l);
        }
    }
    if let Some(none) = limited.get("none") {
        let none = median(none.clone());
        println!();
        println!(
            "E1L the built-in queue's E1 with a limit that never binds (median of {} rounds):",
            args.rounds
        );
        println!("| limit | msgs/s | / unlimited |");
        println!("|---|---|---|");
        for arm in ["none", "concurrency", "rate"] {
            let rate = median(limited[arm].clone());
            println!("| {arm} | {rate:.0} | {:.3} |", rate / none);
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let i1_rate = if inbox_alone.is_empty() {
        f64::NAN
    } else {
        median(inbox_alone.clone())
    };
    println!();
    println!(
        "I1 the inbox alone (inbox.process + effect, {} tasks): {i1_rate:.0} msgs/s; CPU µs per message client / postgres / broker: {}",
        args.concurrency,
        cpu_cell(cpu.get(&("I1", Transport::Noop)))
    );
    let b0_rate = if bare_commits.is_empty() {
        f64::NAN
    } else {
        median(bare_commits.clone())
    };
    println!(
        "B0 BEGIN/INSERT/COMMIT ({} tasks): {b0_rate:.0} msgs/s; CPU µs per message client / postgres / broker: {}",
        args.concurrency,
        cpu_cell(cpu.get(&("B0", Transport::Noop)))
    );
    println!();
    println!(
        "| transport | O2 relay drain msgs/s | R1 receive → ack alone msgs/s | R1 / I1 | C1 consumer + inbox msgs/s | E1 end to end msgs/s | E1 / slowest stage | E1 / B0 | E1b batch {} msgs/s | E1b / E1 | E1b / B0 | E1 commit→effect p50 | p99 | E1b commit→effect p50 | p99 | O3 commit→publish p50 | p99 |",
        args.consumer_batch
    );
    println!(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for t in &transports {
        let d = median(drains[t].clone());
        let (p50, p99) = (
            median(lats[t].iter().map(|l| l.0).collect()),
            median(lats[t].iter().map(|l| l.1).collect()),
        );
        if *t == Transport::Noop {
            println!(
                "| {} | {d:.0} | - | - | - | - | - | - | - | - | - | - | - | - | - | {:.1} ms | {:.1} ms |",
                t.name(),
                ms(p50),
                ms(p99)
            );
            continue;
        }
        let c = median(consumes[t].clone());
        let r = median(receives[t].clone());
        let e = median(ends[t].clone());
        let eb = median(batched[t].clone());
        let (e50, e99) = (
            median(e_lats[t].iter().map(|l| l.0).collect()),
            median(e_lats[t].iter().map(|l| l.1).collect()),
        );
        let (b50, b99) = (
            median(eb_lats[t].iter().map(|l| l.0).collect()),
            median(eb_lats[t].iter().map(|l| l.1).collect()),
        );
        let slowest = if d < c { "relay" } else { "consumer" };
        println!(
            "| {} | {d:.0} | {r:.0} | {:.2}× | {c:.0} | {e:.0} | {:.2}× ({slowest}) | {:.2}× | {eb:.0} | {:.2}× | {:.2}× | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
            t.name(),
            r / i1_rate,
            e / d.min(c),
            e / b0_rate,
            eb / e,
            eb / b0_rate,
            ms(e50),
            ms(e99),
            ms(b50),
            ms(b99),
            ms(p50),
            ms(p99)
        );
    }
    println!();
    println!(
        "CPU per message, µs (client / postgres / broker; `-` where the process is not on this machine):"
    );
    println!();
    println!(
        "| transport | O2 relay drain | R1 receive → ack | C1 consumer + inbox | E1 end to end | E1b batched |"
    );
    println!("|---|---|---|---|---|---|");
    for t in &transports {
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            t.name(),
            cpu_cell(cpu.get(&("O2", *t))),
            cpu_cell(cpu.get(&("R1", *t))),
            cpu_cell(cpu.get(&("C1", *t))),
            cpu_cell(cpu.get(&("E1", *t))),
            cpu_cell(cpu.get(&("E1b", *t))),
        );
    }
    Ok(())
}
