//! The payment/points scenario, end to end.
//!
//! Without arguments (or with `demo`, `payments`, `points`), this runs the scenario as two
//! real services, each its own process, with a driver that kills and restarts them: see
//! `examples/payment_services/`. With flags, it runs the one-process simulation below, with
//! faults injected on request.
//!
//! A user pays for an order. The payments service marks the order paid (a state-machine
//! transition) and writes `PaymentSucceeded` to its outbox in the same transaction. A relay
//! publishes it to the built-in Postgres queue. The points service consumes it and grants 30
//! points exactly once per order: a ledger row (unique per order) and the user's total,
//! raised through an optimistic version check, all inside `inbox.process`.
//!
//! Two services, two schemas, as in production: `payments` + `payments_pgbox` (the outbox) and
//! `points` + `points_pgbox` (the inbox, next to the data it protects); the queue lives in
//! `sim_broker`. These schemas are dropped and recreated at start, and left for inspection.
//! (The two real services keep to schemas of their own, `svc_payments`, `svc_points`, ...,
//! so either may run after the other.)
//!
//! ```text
//! cargo run --example payment_points -- --orders 2000 --consumers 4 \
//!     --duplicate-rate 0.3 --producer-retries 0.1 --crash-rate 0.05
//! ```
//!
//! With `--metrics-addr 127.0.0.1:9000`, pgbox's metrics are served for Prometheus at
//! `http://127.0.0.1:9000/metrics` while the run lasts (gauges refreshed every half second;
//! `--metrics-linger-secs` keeps serving the final values after the report).
//!
//! Uses `DATABASE_URL` when set, else the local bootstrap of the tests. With
//! `--transport rabbitmq`, `--transport nats` or `--transport kafka` the messages go through that broker instead
//! of the built-in queue (found or started like the tests do: `RABBITMQ_URL`, `NATS_URL`, or
//! the standard local ports); each run uses its own topic there.

#[path = "support/demo_db.rs"]
mod demo_db;
#[path = "../tests/support/local_pg.rs"]
mod local_pg;

#[allow(dead_code)]
#[path = "../tests/support/brokers.rs"]
mod brokers;

// The scenario as two services (examples/payment_services): without arguments, or with one of
// its subcommands (`demo`, `payments`, `points`), this example runs them instead of the
// one-process simulation below.
#[path = "payment_services/cli.rs"]
mod cli;
#[path = "payment_services/demo.rs"]
mod demo;
#[path = "payment_services/http.rs"]
mod http;
#[path = "payment_services/payments.rs"]
mod payments;
#[path = "payment_services/points.rs"]
mod points;
#[path = "payment_services/service.rs"]
mod service;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use clap::Parser;
#[cfg(feature = "kafka")]
use pgbox::transport::kafka::Kafka;
#[cfg(feature = "nats")]
use pgbox::transport::nats::Nats;
use pgbox::transport::rabbitmq::RabbitMq;
use pgbox::transport::{PgQueue, PublishError, Publisher, Subscriber};
use pgbox::{
    CancellationToken, Consumer, Envelope, Inbox, Message, Migrator, Outbox, Relay, RetryPolicy,
    StateMachine, StateTable, Transition, VersionedTable,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// The payment/points example: exactly-once points under duplicates, retries and crashes.
#[derive(Parser, Debug, Clone)]
#[command(version, about, long_about = None)]
struct Args {
    /// Orders to create and pay.
    #[arg(long, default_value_t = 200)]
    orders: u64,
    /// Points-service consumer instances (each handles 4 messages at a time).
    #[arg(long, default_value_t = 2)]
    consumers: usize,
    /// Probability that the transport delivers a message twice (a redelivery).
    #[arg(long, default_value_t = 0.0)]
    duplicate_rate: f64,
    /// Probability that the payments service re-sends an order's event as a new message
    /// with a new message id (a producer retry): dedup by message id would fail here.
    #[arg(long, default_value_t = 0.0)]
    producer_retries: f64,
    /// Probability, per delivery, that the consumer process crashes: before the handler's
    /// work, in the middle of it, or after commit but before the ack (a third each).
    #[arg(long, default_value_t = 0.0)]
    crash_rate: f64,
    /// Give up (exit 1) if the run takes longer than this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout_secs: u64,
    /// Where the messages go between the services.
    #[arg(long, value_enum, default_value_t = TransportKind::Postgres)]
    transport: TransportKind,
    /// Serve pgbox's metrics for Prometheus at http://<this address>/metrics during the run
    /// (off by default).
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<SocketAddr>,
    /// With --metrics-addr: after the report, keep serving the final metrics this long.
    #[arg(long, default_value_t = 0, requires = "metrics_addr")]
    metrics_linger_secs: u64,
    /// The topic (set at start: per run on a broker, whose queues outlive the run).
    #[arg(skip)]
    topic: String,
    /// The broker's URL (set at start).
    #[arg(skip)]
    broker_url: String,
}

/// The transport between the two services.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum TransportKind {
    /// The built-in queue, in schema `sim_broker`.
    Postgres,
    /// RabbitMQ.
    Rabbitmq,
    /// NATS JetStream.
    Nats,
    /// Kafka (a Kafka-protocol broker).
    Kafka,
}

fn rabbitmq(args: &Args) -> anyhow::Result<RabbitMq> {
    Ok(RabbitMq::builder(&args.broker_url)
        .exchange("pgbox-example")
        .queue_prefix("pgbox-example.")
        .queue_expires(Duration::from_secs(3600))
        .build()?)
}

#[cfg(feature = "nats")]
fn nats(args: &Args) -> anyhow::Result<Nats> {
    Ok(Nats::builder(&args.broker_url)
        .stream("PGBOX_EXAMPLE")
        .subject_prefix("pgbox-example")
        .max_age(Duration::from_secs(3600))
        .inactive_threshold(Duration::from_secs(3600))
        // Like the built-in queue's visibility timeout below.
        .ack_wait(Duration::from_secs(2))
        .build()?)
}

#[cfg(feature = "kafka")]
fn kafka(args: &Args) -> anyhow::Result<Kafka> {
    Ok(Kafka::builder(&args.broker_url)
        .group("pgbox-example")
        .partitions(4)
        // The test broker (tansu 0.6) skips the rest of a record batch when a consumer
        // restarts inside it: one message per batch there. Not needed on Apache Kafka.
        .set("batch.num.messages", "1")
        .build()?)
}

/// What a transport left out of this build says: how to build it in.
#[cfg(not(all(feature = "nats", feature = "kafka")))]
pub(crate) fn needs_feature(feature: &str) -> String {
    format!(
        "this example was built without the `{feature}` transport; build it in with \
         `cargo run --features {feature} --example ...` ({})",
        if feature == "kafka" {
            "builds librdkafka: needs make and a C/C++ compiler"
        } else {
            "needs a C compiler for ring"
        }
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OrderState {
    Created,
    Paid,
}

impl StateMachine for OrderState {
    const STATES: &'static [Self] = &[OrderState::Created, OrderState::Paid];
    fn name(self) -> &'static str {
        match self {
            OrderState::Created => "created",
            OrderState::Paid => "paid",
        }
    }
    fn next(self) -> &'static [Self] {
        match self {
            OrderState::Created => &[OrderState::Paid],
            OrderState::Paid => &[],
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct PaymentSucceeded {
    order_id: i64,
    user_id: i64,
}

#[derive(Default)]
struct Counters {
    deliveries: AtomicU64,
    acks: AtomicU64,
    duplicated_by_transport: AtomicU64,
    producer_resends: AtomicU64,
    crashes: AtomicU64,
    version_conflicts: AtomicU64,
}

/// The transport, with redelivery injected: some messages are published twice.
struct DuplicatingPublisher<P> {
    inner: P,
    rate: f64,
    counters: Arc<Counters>,
}

impl<P: Publisher> Publisher for DuplicatingPublisher<P> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let results = self.inner.publish(batch).await;
        let again: Vec<Envelope> = batch
            .iter()
            .filter(|_| fastrand::f64() < self.rate)
            .cloned()
            .collect();
        if !again.is_empty() && results.iter().all(Result::is_ok) {
            // Same message, same id, delivered a second time.
            if self.inner.publish(&again).await.iter().all(Result::is_ok) {
                self.counters
                    .duplicated_by_transport
                    .fetch_add(again.len() as u64, Relaxed);
            }
        }
        results
    }
}

/// The consumer's view of the queue, with crashes between commit and ack injected.
struct CrashingSubscriber<S> {
    inner: S,
    ack_crash_rate: f64,
    counters: Arc<Counters>,
}

impl<S: Subscriber> Subscriber for CrashingSubscriber<S> {
    type Delivery = S::Delivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> pgbox::Result<Vec<S::Delivery>> {
        let batch = self.inner.receive(topic, max, visibility).await?;
        self.counters
            .deliveries
            .fetch_add(batch.len() as u64, Relaxed);
        Ok(batch)
    }
    fn envelope<'d>(&self, delivery: &'d S::Delivery) -> &'d Envelope {
        self.inner.envelope(delivery)
    }
    fn attempt(&self, delivery: &S::Delivery) -> i32 {
        self.inner.attempt(delivery)
    }
    async fn ack(&self, delivery: &S::Delivery) -> pgbox::Result<bool> {
        if fastrand::f64() < self.ack_crash_rate {
            self.counters.crashes.fetch_add(1, Relaxed);
            panic!("injected crash: after commit, before ack");
        }
        let acked = self.inner.ack(delivery).await?;
        self.counters.acks.fetch_add(u64::from(acked), Relaxed);
        Ok(acked)
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

/// The schemas of the simulation, reset at every run. Not the two services' (`svc_payments`,
/// ...): the same names with other tables would trip up whichever ran second.
const SIM_SCHEMAS: [&str; 5] = [
    "payments",
    "payments_pgbox",
    "points",
    "points_pgbox",
    SIM_BROKER,
];
/// The simulation's built-in queue.
const SIM_BROKER: &str = "sim_broker";

const SETUP: &str = "
CREATE TABLE payments.orders (id bigint PRIMARY KEY, user_id bigint NOT NULL, status text NOT NULL);
CREATE TABLE points.ledger (order_id bigint PRIMARY KEY, user_id bigint NOT NULL, points bigint NOT NULL);
CREATE TABLE points.accounts (id bigint PRIMARY KEY, total bigint NOT NULL, version bigint NOT NULL);
";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match argv.get(1).and_then(|a| a.to_str()) {
        None => argv.push("demo".into()),
        Some("demo" | "payments" | "points") => {}
        Some(_) => return simulate().await,
    }
    if cli::run(argv).await {
        Ok(())
    } else {
        std::process::exit(1)
    }
}

/// The one-process simulation: both sides in this process, faults injected in-process.
async fn simulate() -> anyhow::Result<()> {
    let mut args = Args::parse();
    // Injected crashes are expected: keep their panic messages out of the output.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
        if !message.is_some_and(|m| m.starts_with("injected crash")) {
            default_hook(info);
        }
    }));
    for (name, p) in [
        ("--duplicate-rate", args.duplicate_rate),
        ("--producer-retries", args.producer_retries),
        ("--crash-rate", args.crash_rate),
    ] {
        anyhow::ensure!(
            (0.0..=1.0).contains(&p),
            "{name} must be between 0 and 1, got {p}"
        );
    }
    anyhow::ensure!(args.consumers >= 1, "--consumers must be at least 1");
    args.topic = "payment-succeeded".into();
    let run = uuid::Uuid::now_v7().simple();
    match args.transport {
        TransportKind::Postgres => {}
        TransportKind::Rabbitmq => {
            args.broker_url = brokers::rabbitmq_url().await;
            args.topic = format!("payment-succeeded-{run}");
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            args.broker_url = brokers::nats_url().await;
            args.topic = format!("payment-succeeded-{run}");
        }
        #[cfg(not(feature = "nats"))]
        TransportKind::Nats => anyhow::bail!(crate::needs_feature("nats")),
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            args.broker_url = brokers::kafka_url().await;
            args.topic = format!("payment-succeeded-{run}");
        }
        #[cfg(not(feature = "kafka"))]
        TransportKind::Kafka => anyhow::bail!(crate::needs_feature("kafka")),
    }
    let url = demo_db::demo_url().await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await?;

    demo_db::reset_schemas(&pool, &SIM_SCHEMAS).await?;
    sqlx::raw_sql(SETUP).execute(&pool).await?;
    for schema in ["payments_pgbox", "points_pgbox", SIM_BROKER] {
        Migrator::new().schema(schema)?.run(&pool).await?;
    }
    let users = (args.orders / 10).max(1) as i64;
    sqlx::query("INSERT INTO points.accounts SELECT g, 0, 0 FROM generate_series(1, $1) g")
        .bind(users)
        .execute(&pool)
        .await?;
    sqlx::query(
        "INSERT INTO payments.orders SELECT g, 1 + g % $2, 'created' FROM generate_series(1, $1) g",
    )
    .bind(args.orders as i64)
    .bind(users)
    .execute(&pool)
    .await?;

    let counters = Arc::new(Counters::default());
    let shutdown = CancellationToken::new();
    // Before the relay and the consumers start: they register their metrics when they do.
    let gauges_task = match args.metrics_addr {
        Some(addr) => Some(serve_metrics(addr, &pool, &shutdown)?),
        None => None,
    };
    let started = Instant::now();

    // The relay of the payments service: its outbox → the broker.
    let relay_task = match args.transport {
        TransportKind::Postgres => spawn_relay(
            &pool,
            PgQueue::with_schema(pool.clone(), SIM_BROKER)?,
            &args,
            &counters,
            &shutdown,
        )?,
        TransportKind::Rabbitmq => {
            let rabbit = rabbitmq(&args)?;
            // Its queue exists before the first publish (unroutable messages are retried).
            rabbit.declare_topic(&args.topic).await?;
            spawn_relay(&pool, rabbit, &args, &counters, &shutdown)?
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            let nats = nats(&args)?;
            nats.declare_topic(&args.topic).await?;
            spawn_relay(&pool, nats, &args, &counters, &shutdown)?
        }
        #[cfg(not(feature = "nats"))]
        TransportKind::Nats => anyhow::bail!(crate::needs_feature("nats")),
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            let kafka = kafka(&args)?;
            kafka.declare_topic(&args.topic).await?;
            spawn_relay(&pool, kafka, &args, &counters, &shutdown)?
        }
        #[cfg(not(feature = "kafka"))]
        TransportKind::Kafka => anyhow::bail!(crate::needs_feature("kafka")),
    };

    // The points service: K consumer instances, each restarted when it crashes.
    let mut consumer_tasks = Vec::new();
    for _ in 0..args.consumers {
        consumer_tasks.push(tokio::spawn(supervise_consumer(
            url.clone(),
            args.clone(),
            counters.clone(),
            shutdown.clone(),
        )));
    }

    // The payments service pays every order.
    pay_orders(&pool, &args, &counters).await?;

    // Wait for every paid order to be rewarded.
    let deadline = started + Duration::from_secs(args.timeout_secs);
    let mut last_progress = Instant::now();
    loop {
        let rewarded: i64 = sqlx::query_scalar("SELECT count(*) FROM points.ledger")
            .fetch_one(&pool)
            .await?;
        let backlog: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM payments_pgbox.outbox) + (SELECT count(*) FROM sim_broker.queue)",
        )
        .fetch_one(&pool)
        .await?;
        if rewarded as u64 == args.orders && backlog == 0 {
            break;
        }
        if last_progress.elapsed() > Duration::from_secs(2) {
            eprintln!(
                "  … {rewarded}/{} orders rewarded, {backlog} messages in flight, {:.0?}",
                args.orders,
                started.elapsed()
            );
            last_progress = Instant::now();
        }
        if Instant::now() > deadline {
            eprintln!("timed out after {:?}", started.elapsed());
            std::process::exit(1);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed();
    shutdown.cancel();
    relay_task.await??;
    for t in consumer_tasks {
        t.await??;
    }
    if let Some(task) = gauges_task {
        task.await?;
        // The final values, for a last scrape.
        refresh_gauges(&pool).await;
    }

    report_and_check(&pool, &args, &counters, elapsed).await?;
    if args.metrics_addr.is_some() && args.metrics_linger_secs > 0 {
        eprintln!(
            "serving the final metrics for {} s more",
            args.metrics_linger_secs
        );
        tokio::time::sleep(Duration::from_secs(args.metrics_linger_secs)).await;
    }
    Ok(())
}

/// The pgbox schemas of this run: the payments outbox, the queue, the points inbox.
const PGBOX_SCHEMAS: [&str; 3] = ["payments_pgbox", SIM_BROKER, "points_pgbox"];

/// Installs the Prometheus exporter (its HTTP listener runs on this runtime until the process
/// exits) and refreshes pgbox's gauges every half second until `shutdown`.
fn serve_metrics(
    addr: SocketAddr,
    pool: &PgPool,
    shutdown: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        // Latencies as Prometheus histograms (buckets) rather than summaries.
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ],
        )?
        .install()?;
    pgbox::telemetry::describe_metrics();
    eprintln!("serving metrics at http://{addr}/metrics");
    let (pool, shutdown) = (pool.clone(), shutdown.clone());
    Ok(tokio::spawn(async move {
        loop {
            refresh_gauges(&pool).await;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }))
}

async fn refresh_gauges(pool: &PgPool) {
    for schema in PGBOX_SCHEMAS {
        if let Err(e) = pgbox::telemetry::refresh_gauges(pool, schema).await {
            eprintln!("cannot refresh the gauges of {schema}: {e}");
        }
    }
}

/// Each order: one transaction that moves it to paid and writes the event to the outbox.
/// With `--producer-retries`, some events are sent again in a second transaction, as a
/// producer does when it cannot tell whether its first attempt went through.
async fn pay_orders(pool: &PgPool, args: &Args, counters: &Counters) -> anyhow::Result<()> {
    let orders = StateTable::<OrderState>::new("orders")?.schema("payments")?;
    let outbox = Outbox::with_schema("payments_pgbox")?;
    for order_id in 1..=args.orders as i64 {
        let mut tx = pool.begin().await?;
        let user_id: i64 = sqlx::query_scalar("SELECT user_id FROM payments.orders WHERE id = $1")
            .bind(order_id)
            .fetch_one(&mut *tx)
            .await?;
        match orders
            .transition(&mut tx, order_id, OrderState::Paid)
            .await?
        {
            Transition::Applied { .. } => {}
            other => anyhow::bail!("order {order_id}: unexpected {other:?}"),
        }
        let event = PaymentSucceeded { order_id, user_id };
        outbox
            .enqueue(
                &mut tx,
                Message::json(&args.topic, &event)?.ordering_key(format!("user-{user_id}")),
            )
            .await?;
        tx.commit().await?;

        if fastrand::f64() < args.producer_retries {
            // The same business event under a new message id.
            let mut tx = pool.begin().await?;
            outbox
                .enqueue(
                    &mut tx,
                    Message::json(&args.topic, &event)?.ordering_key(format!("user-{user_id}")),
                )
                .await?;
            tx.commit().await?;
            counters.producer_resends.fetch_add(1, Relaxed);
        }
    }
    Ok(())
}

/// Runs one consumer instance; when an injected crash kills it, starts a new one, as a
/// process supervisor would. Messages it had in hand come back after their visibility
/// timeout.
async fn supervise_consumer(
    url: String,
    args: Args,
    counters: Arc<Counters>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        let task = tokio::spawn(run_consumer(
            url.clone(),
            args.clone(),
            counters.clone(),
            shutdown.clone(),
        ));
        match task.await {
            Ok(result) => return result,
            Err(e) if e.is_panic() => continue, // crashed: restart
            Err(e) => return Err(e.into()),
        }
    }
}

async fn run_consumer(
    url: String,
    args: Args,
    counters: Arc<Counters>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // Each instance has its own pool, like a separate process.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect(&url)
        .await?;
    let inbox = Inbox::builder("points-service")
        .schema("points_pgbox")
        .build()?;
    match args.transport {
        TransportKind::Postgres => {
            let queue = PgQueue::with_schema(pool.clone(), SIM_BROKER)?;
            consume(pool, queue, inbox, args, counters, shutdown).await
        }
        TransportKind::Rabbitmq => {
            let rabbit = rabbitmq(&args)?;
            consume(pool, rabbit, inbox, args, counters, shutdown).await
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            let nats = nats(&args)?;
            consume(pool, nats, inbox, args, counters, shutdown).await
        }
        #[cfg(not(feature = "nats"))]
        TransportKind::Nats => anyhow::bail!(crate::needs_feature("nats")),
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            let kafka = kafka(&args)?;
            consume(pool, kafka, inbox, args, counters, shutdown).await
        }
        #[cfg(not(feature = "kafka"))]
        TransportKind::Kafka => anyhow::bail!(crate::needs_feature("kafka")),
    }
}

fn spawn_relay<P: Publisher + 'static>(
    pool: &PgPool,
    publisher: P,
    args: &Args,
    counters: &Arc<Counters>,
    shutdown: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<pgbox::Result<()>>> {
    let relay = Relay::builder(
        pool.clone(),
        DuplicatingPublisher {
            inner: publisher,
            rate: args.duplicate_rate,
            counters: counters.clone(),
        },
    )
    .schema("payments_pgbox")
    .batch_size(500)
    .build()?;
    let s = shutdown.clone();
    Ok(tokio::spawn(async move { relay.run(s).await }))
}

async fn consume<S: Subscriber + 'static>(
    pool: PgPool,
    subscriber: S,
    inbox: Inbox,
    args: Args,
    counters: Arc<Counters>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let consumer = Consumer::builder(
        pool.clone(),
        CrashingSubscriber {
            inner: subscriber,
            ack_crash_rate: args.crash_rate / 3.0,
            counters: counters.clone(),
        },
        args.topic.clone(),
        inbox,
    )
    .concurrency(4)
    .visibility_timeout(Duration::from_secs(2))
    .poll_interval(Duration::from_millis(250))
    .max_deliveries(1_000)
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(5))
            .max_delay(Duration::from_millis(200)),
    )
    // The inbox key is the ORDER ID, the business key, not the message id: a producer
    // retry publishes the same payment under a new message id, which a message-id key
    // would process twice (60 points). The order id is the same in both.
    .key(|envelope| match envelope.json::<PaymentSucceeded>() {
        Ok(event) => format!("order-{}", event.order_id),
        Err(_) => envelope.id.to_string(),
    })
    .build()?;
    let accounts = VersionedTable::new("accounts")?.schema("points")?;
    let crash_rate = args.crash_rate;
    consumer
        .run(
            async |envelope: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                let event: PaymentSucceeded = envelope.json()?;
                let roll = fastrand::f64();
                if roll < crash_rate / 3.0 {
                    counters.crashes.fetch_add(1, Relaxed);
                    panic!("injected crash: before the handler's work");
                }
                sqlx::query(
                    "INSERT INTO points.ledger (order_id, user_id, points) VALUES ($1, $2, 30)",
                )
                .bind(event.order_id)
                .bind(event.user_id)
                .execute(&mut *conn)
                .await
                .map_err(pgbox::Error::from)?;
                // The account update as a nested unit of work (a savepoint: sqlx knows the
                // handler's connection is inside the inbox's transaction). Its commit only
                // releases the savepoint: a crash after it still rolls everything back.
                let mut unit = sqlx::Connection::begin(&mut **conn).await?;
                let version = accounts
                    .current_version(&mut unit, event.user_id)
                    .await?
                    .ok_or_else(|| {
                        pgbox::Error::InvalidConfig(format!("no account {}", event.user_id))
                    })?;
                let updated = accounts
                    .update(event.user_id, version)
                    .add("total", 30_i64)
                    .execute(&mut unit)
                    .await;
                if let Err(pgbox::Error::VersionConflict { .. }) = updated {
                    counters.version_conflicts.fetch_add(1, Relaxed);
                }
                updated?;
                unit.commit().await?;
                if roll < crash_rate * 2.0 / 3.0 {
                    counters.crashes.fetch_add(1, Relaxed);
                    panic!("injected crash: inside the handler, after its nested unit committed");
                }
                Ok::<(), pgbox::Error>(())
            },
            shutdown,
        )
        .await?;
    Ok(())
}

async fn report_and_check(
    pool: &PgPool,
    args: &Args,
    counters: &Counters,
    elapsed: Duration,
) -> anyhow::Result<()> {
    let paid: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payments.orders WHERE status = 'paid'")
            .fetch_one(pool)
            .await?;
    let granted: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(points), 0)::bigint FROM points.ledger")
            .fetch_one(pool)
            .await?;
    let totals: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(total), 0)::bigint FROM points.accounts")
            .fetch_one(pool)
            .await?;
    let rewarded_twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT order_id FROM points.ledger GROUP BY order_id HAVING count(*) > 1) t",
    )
    .fetch_one(pool)
    .await?;
    let unrewarded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payments.orders o WHERE o.status = 'paid' \
         AND NOT EXISTS (SELECT 1 FROM points.ledger l WHERE l.order_id = o.id)",
    )
    .fetch_one(pool)
    .await?;
    let deliveries = counters.deliveries.load(Relaxed);
    let processed: i64 = sqlx::query_scalar("SELECT count(*) FROM points_pgbox.inbox")
        .fetch_one(pool)
        .await?;
    let acks = counters.acks.load(Relaxed);
    let rate = args.orders as f64 / elapsed.as_secs_f64();
    println!();
    println!("  orders                      {:>10}", args.orders);
    println!("  paid                        {paid:>10}");
    println!("  deliveries                  {deliveries:>10}");
    println!(
        "  duplicated by transport     {:>10}",
        counters.duplicated_by_transport.load(Relaxed)
    );
    println!(
        "  re-sent by producer         {:>10}",
        counters.producer_resends.load(Relaxed)
    );
    println!(
        "  duplicates absorbed         {:>10}",
        acks.saturating_sub(processed as u64)
    );
    println!(
        "  crashes injected            {:>10}",
        counters.crashes.load(Relaxed)
    );
    println!(
        "  version conflicts retried   {:>10}",
        counters.version_conflicts.load(Relaxed)
    );
    println!("  points granted              {granted:>10}");
    println!("  elapsed                     {:>10.2?}", elapsed);
    println!("  orders per second           {rate:>10.0}");
    println!();
    let mut failed = false;
    let mut check = |ok: bool, what: String| {
        println!("  [{}] {what}", if ok { "ok" } else { "FAILED" });
        failed |= !ok;
    };
    check(
        granted == 30 * paid,
        format!("points granted = 30 × paid orders ({granted} = 30 × {paid})"),
    );
    check(
        totals == granted,
        format!("account totals = ledger ({totals} = {granted})"),
    );
    check(
        rewarded_twice == 0,
        format!("no order rewarded twice ({rewarded_twice})"),
    );
    check(
        unrewarded == 0,
        format!("no paid order unrewarded ({unrewarded})"),
    );
    if failed {
        std::process::exit(1);
    }
    Ok(())
}
