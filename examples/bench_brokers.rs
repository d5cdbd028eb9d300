//! Outbox drain (O2) and commit → publish latency (O3) through each transport, in one run:
//! the no-op publisher (the database's ceiling), the built-in Postgres queue, RabbitMQ
//! (publisher confirms on) and NATS JetStream (publish acks on). Rounds interleave the
//! transports so that drift on the machine hits them all alike; the table shows medians.
//!
//! ```sh
//! cargo run --release --example bench_brokers            # full run
//! cargo run --release --example bench_brokers -- --quick # under a minute
//! ```
//!
//! PostgreSQL, RabbitMQ and NATS are found (or started) as the tests do: `DATABASE_URL`,
//! `RABBITMQ_URL`, `NATS_URL`, or the standard local ports. The run works in a database of
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
use pgbox::transport::nats::Nats;
use pgbox::transport::rabbitmq::RabbitMq;
use pgbox::transport::{DiscardPublisher, PgQueue, PublishError, Publisher};
use pgbox::{CancellationToken, Envelope, Message, Outbox, Relay};
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
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Transport {
    Noop,
    Postgres,
    RabbitMq,
    Nats,
}

const TRANSPORTS: [Transport; 4] = [
    Transport::Noop,
    Transport::Postgres,
    Transport::RabbitMq,
    Transport::Nats,
];

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Noop => "no-op publisher",
            Transport::Postgres => "built-in queue (PgQueue)",
            Transport::RabbitMq => "RabbitMQ (confirms)",
            Transport::Nats => "NATS JetStream (acks)",
        }
    }
}

struct Env {
    pool: PgPool,
    rabbit_url: String,
    nats_url: String,
    run: String,
}

impl Env {
    fn rabbit(&self) -> RabbitMq {
        RabbitMq::builder(&self.rabbit_url)
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

    /// Makes sure a message published to `topic` is kept (queues and consumers exist).
    async fn prepare(&self, transport: Transport, topic: &str) -> anyhow::Result<()> {
        match transport {
            Transport::RabbitMq => self.rabbit().declare_topic(topic).await?,
            Transport::Nats => self.nats().declare_topic(topic).await?,
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

async fn o2(env: &Env, args: &Args, t: Transport, round: usize) -> anyhow::Result<f64> {
    let topic = format!("o2-{round}");
    env.prepare(t, &topic).await?;
    env.pool
        .execute("TRUNCATE pgbox.outbox, pgbox.queue")
        .await?;
    fill(&env.pool, &topic, args.backlog, &vec![b'x'; args.payload]).await?;
    let (pool, batch, n) = (&env.pool, args.batch, args.backlog);
    let rate = match t {
        Transport::Noop => drain(pool, DiscardPublisher, batch, n).await?,
        Transport::Postgres => drain(pool, PgQueue::new(pool.clone()), batch, n).await?,
        Transport::RabbitMq => {
            let r = env.rabbit();
            let rate = drain(pool, r.clone(), batch, n).await?;
            r.close().await;
            rate
        }
        Transport::Nats => drain(pool, env.nats(), batch, n).await?,
    };
    Ok(rate)
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
    let outbox = Outbox::new();
    let mut committed = HashMap::new();
    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let duration = Duration::from_secs_f64(args.seconds);
    let started = Instant::now();
    let mut next = started;
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
    let topic = format!("o3-{round}");
    env.prepare(t, &topic).await?;
    env.pool
        .execute("TRUNCATE pgbox.outbox, pgbox.queue")
        .await?;
    match t {
        Transport::Noop => latency(env, args, DiscardPublisher, &topic).await,
        Transport::Postgres => latency(env, args, PgQueue::new(env.pool.clone()), &topic).await,
        Transport::RabbitMq => latency(env, args, env.rabbit(), &topic).await,
        Transport::Nats => latency(env, args, env.nats(), &topic).await,
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
    anyhow::ensure!(args.rounds >= 1 && args.backlog >= 1 && args.rate > 0.0);
    let server = local_pg::database_url()
        .await
        .map_err(|e| anyhow::anyhow!("no PostgreSQL: {e}"))?;
    let rabbit_url = brokers::rabbitmq_url().await;
    let nats_url = brokers::nats_url().await;
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
    let env = Env {
        pool,
        rabbit_url,
        nats_url,
        run,
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
    let mut drains: HashMap<Transport, Vec<f64>> = HashMap::new();
    let mut lats: HashMap<Transport, Vec<(Duration, Duration)>> = HashMap::new();
    for round in 0..args.rounds {
        // Rotate the order each round, so no transport always goes first.
        for i in 0..TRANSPORTS.len() {
            let t = TRANSPORTS[(i + round) % TRANSPORTS.len()];
            let rate = o2(env, args, t, round).await?;
            eprintln!("round {round}: O2 {} {rate:.0} msgs/s", t.name());
            drains.entry(t).or_default().push(rate);
        }
        for i in 0..TRANSPORTS.len() {
            let t = TRANSPORTS[(i + round) % TRANSPORTS.len()];
            let l = o3(env, args, t, round).await?;
            eprintln!("round {round}: O3 {} p50 {:?} p99 {:?}", t.name(), l.0, l.1);
            lats.entry(t).or_default().push(l);
        }
    }
    println!();
    println!(
        "| transport | O2 drain msgs/s (median) | O3 commit→publish p50 | O3 p99 (median of rounds) |"
    );
    println!("|---|---:|---:|---:|");
    for t in TRANSPORTS {
        let d = median(drains[&t].clone());
        let p50 = median(lats[&t].iter().map(|l| l.0).collect());
        let p99 = median(lats[&t].iter().map(|l| l.1).collect());
        println!(
            "| {} | {d:.0} | {:.1} ms | {:.1} ms |",
            t.name(),
            p50.as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
