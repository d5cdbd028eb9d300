//! The driver: starts both services as child processes, pays orders over HTTP (retrying with
//! the same Idempotency-Key, sometimes concurrently), SIGKILLs and restarts the services
//! during the run, then checks the invariants through both HTTP APIs and SQL.
//!
//! The payments child runs with faults injected (`--duplicate-rate`: its relay publishes some
//! messages twice; `--producer-retries`: some payments enqueue PaymentSucceeded again under a
//! new message id); the points inbox, keyed by order id, must absorb both.
//!
//! It also checks three features the services use (with the children it starts):
//!
//! - **Payment reminders** (scheduled messages): it first creates `--unpaid` orders it never
//!   pays. Each must get exactly one reminder, no earlier than its due time
//!   (`--reminder-after-secs` after its creation), across the kills; a paid order none (its
//!   reminder cancelled by the payment, never delivered), unless it was paid only after its
//!   reminder fell due (a kill in between), and then it was reminded before it was paid.
//! - **Archive and replay**: it replays one user's `PaymentSucceeded` events from the payments
//!   archive (`pgbox::Archive`, the user's ordering key): the points service must answer each
//!   as a Duplicate (its metrics) and grant no new points. On NATS the replay takes new ids:
//!   JetStream would drop a re-published id within its duplicate window before the points
//!   service saw it; its inbox, keyed by the order, answers Duplicate all the same.
//! - **CloudEvents**: on a broker, every ledger row must come from a CloudEvent of source
//!   `/payments`; on the built-in queue from the native envelope.
//!
//! With `--payments-url` and `--points-url` it drives services that are already running
//! instead (docker compose's `driver`): no schema reset, no children, no kills; its users are
//! new to the database, so the checks cover this run only, through the HTTP APIs, plus SQL
//! when `DATABASE_URL` is set.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::Rng;
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use crate::http::{self, Response};
use crate::points::POINTS_PER_ORDER;
use crate::service::TransportKind;

/// Options of the demo run.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Orders to create and pay.
    #[arg(long, default_value_t = 200)]
    orders: usize,
    /// Distinct users the orders belong to.
    #[arg(long, default_value_t = 20)]
    users: i64,
    /// Clients paying orders at the same time.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Share of payments retried afterwards with the same Idempotency-Key.
    #[arg(long, default_value_t = 0.2)]
    retry_rate: f64,
    /// Share of payments sent twice at once with the same Idempotency-Key.
    #[arg(long, default_value_t = 0.1)]
    concurrent_rate: f64,
    /// Times a random service is killed with SIGKILL (and restarted) during the run.
    #[arg(long, default_value_t = 3)]
    kills: usize,
    /// Give up (exit 1) when the run takes longer than this, counted once the broker and the
    /// services are up.
    #[arg(long, default_value_t = 90)]
    timeout_secs: u64,
    /// Where the messages go between the services (rabbitmq/nats/kafka: found or started like the
    /// tests do).
    #[arg(long, value_enum, default_value_t = TransportKind::Postgres)]
    transport: TransportKind,
    /// Fault injected into the payments child: the share of relayed messages published twice.
    #[arg(long, default_value_t = 0.1)]
    duplicate_rate: f64,
    /// Fault injected into the payments child: the share of payments whose PaymentSucceeded
    /// is enqueued again, under a new message id, after the first commit.
    #[arg(long, default_value_t = 0.05)]
    producer_retries: f64,
    /// Drive an already-running payments service at this URL (http://host:port) instead of
    /// starting one; requires --points-url. No reset, no kills; the fault flags are then the
    /// service's own (DUPLICATE_RATE, PRODUCER_RETRIES).
    #[arg(long, env = "PAYMENTS_URL", requires = "points_url")]
    payments_url: Option<String>,
    /// The already-running points service (http://host:port); requires --payments-url.
    #[arg(long, env = "POINTS_URL", requires = "payments_url")]
    points_url: Option<String>,
    /// External mode: how long to wait for both services' /health (they may be compiling).
    #[arg(long, default_value_t = 900)]
    wait_secs: u64,
    /// Orders created first and never paid: each must get one payment reminder (not in
    /// external mode).
    #[arg(long, default_value_t = 10)]
    unpaid: usize,
    /// How long after its creation an order's payment reminder falls due, in seconds (the
    /// payments child's --reminder-after-secs): short, so that the unpaid orders' reminders
    /// fall due while the services are being killed.
    #[arg(long, default_value_t = 0.5)]
    reminder_after_secs: f64,
}

/// The schemas the demo owns in its database (see `demo_db`).
pub(crate) const SCHEMAS: [&str; 5] = [
    crate::payments::SCHEMA,
    crate::payments::PGBOX_SCHEMA,
    crate::points::SCHEMA,
    crate::points::PGBOX_SCHEMA,
    crate::payments::BROKER_SCHEMA,
];

/// A service process, restarted in place (same port) after a kill.
struct Service {
    name: &'static str,
    addr: SocketAddr,
    args: Vec<String>,
    env: Vec<(String, String)>,
    child: Mutex<Option<Child>>,
}

impl Service {
    fn spawn(&self) -> anyhow::Result<Child> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        cmd.spawn()
            .with_context(|| format!("start the {} service", self.name))
    }

    async fn start(&self) -> anyhow::Result<()> {
        *self.child.lock().await = Some(self.spawn()?);
        Ok(())
    }

    /// SIGKILL, then start again.
    async fn kill_and_restart(&self) -> anyhow::Result<()> {
        let mut child = self.child.lock().await;
        if let Some(mut old) = child.take() {
            old.start_kill().ok();
            old.wait().await.ok();
        }
        *child = Some(self.spawn()?);
        Ok(())
    }

    /// SIGTERM, then wait (bounded) for a graceful exit; SIGKILL when it does not come.
    async fn stop(&self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.lock().await.take()?;
        if let Some(pid) = child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                child.start_kill().ok();
                child.wait().await.ok();
                None
            }
        }
    }

    /// A service this driver did not start, at `url` (`http://host:port`): waits (bounded)
    /// until its name resolves and its `/health` answers 200.
    async fn external(name: &'static str, url: &str, within: Duration) -> anyhow::Result<Self> {
        let (host, port) = parse_http_url(url)?;
        let deadline = Instant::now() + within;
        let mut last_report = Instant::now();
        let mut last_error = String::from("not tried");
        loop {
            match tokio::net::lookup_host((host.as_str(), port)).await {
                Ok(addrs) => {
                    for addr in addrs {
                        match get(addr, "/health").await {
                            Ok(r) if r.status == 200 => {
                                return Ok(Service {
                                    name,
                                    addr,
                                    args: Vec::new(),
                                    env: Vec::new(),
                                    child: Mutex::new(None),
                                });
                            }
                            Ok(r) => last_error = format!("/health: {} {}", r.status, r.text()),
                            Err(e) => last_error = format!("{addr}: {e}"),
                        }
                    }
                }
                Err(e) => last_error = format!("resolve {host}: {e}"),
            }
            if Instant::now() > deadline {
                anyhow::bail!("{name} at {url} not healthy within {within:?}: {last_error}");
            }
            if last_report.elapsed() > Duration::from_secs(10) {
                println!("  … waiting for {name} at {url} ({last_error})");
                last_report = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn wait_healthy(&self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(r) = get(self.addr, "/health").await
                && r.status == 200
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!("{} did not become healthy within {within:?}", self.name);
            }
            if let Some(child) = self.child.lock().await.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                anyhow::bail!("{} exited during start-up: {status}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

async fn get(addr: SocketAddr, path: &str) -> std::io::Result<Response> {
    http::request(addr, "GET", path, &[], None, REQUEST_TIMEOUT).await
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    connection_retries: AtomicU64,
    server_error_retries: AtomicU64,
    retries_same_key: AtomicU64,
    concurrent_duplicates: AtomicU64,
    mismatched_replays: AtomicU64,
    replayed_header: AtomicU64,
    reused_key_checks: AtomicU64,
    reused_key_failures: AtomicU64,
    new_key_checks: AtomicU64,
    new_key_failures: AtomicU64,
    unexpected: AtomicU64,
    done: AtomicUsize,
}

/// Sends a request until it gets an answer that is not a connection failure or a 5xx (the
/// service may be dead and restarting): the same Idempotency-Key every time.
async fn send(
    service: &Service,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
    counters: &Counters,
) -> anyhow::Result<Response> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
    loop {
        counters.requests.fetch_add(1, Relaxed);
        match http::request(service.addr, method, path, &headers, body, REQUEST_TIMEOUT).await {
            Ok(r) if r.status < 500 => return Ok(r),
            Ok(r) => {
                counters.server_error_retries.fetch_add(1, Relaxed);
                if Instant::now() > deadline {
                    anyhow::bail!("{method} {path}: {} {}", r.status, r.text());
                }
            }
            Err(e) => {
                counters.connection_retries.fetch_add(1, Relaxed);
                if Instant::now() > deadline {
                    anyhow::bail!("{method} {path}: {e}");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What one order went through, for the checks.
struct Paid {
    order_id: i64,
    user_id: i64,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<bool> {
    for (name, p) in [
        ("--retry-rate", args.retry_rate),
        ("--concurrent-rate", args.concurrent_rate),
        ("--duplicate-rate", args.duplicate_rate),
        ("--producer-retries", args.producer_retries),
    ] {
        anyhow::ensure!((0.0..=1.0).contains(&p), "{name} must be between 0 and 1");
    }
    anyhow::ensure!(
        (0.0..=3600.0).contains(&args.reminder_after_secs),
        "--reminder-after-secs must be between 0 and 3600"
    );
    anyhow::ensure!(
        args.users >= 1 && args.clients >= 1,
        "--users and --clients must be at least 1"
    );
    if let (Some(payments_url), Some(points_url)) = (&args.payments_url, &args.points_url) {
        return run_external(&args, payments_url, points_url).await;
    }
    let started = Instant::now();
    let url = crate::demo_db::demo_url().await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await?;
    crate::demo_db::reset_schemas(&pool, &SCHEMAS).await?;

    let run = uuid::Uuid::now_v7().simple().to_string();
    // Per run on a broker (its queues outlive the run); the services' defaults otherwise.
    let (topic, reminder_topic) = match args.transport {
        TransportKind::Postgres => (
            "payment-succeeded".to_owned(),
            "payment-reminders".to_owned(),
        ),
        _ => (
            format!("payment-succeeded-{run}"),
            format!("payment-reminders-{run}"),
        ),
    };
    let mut env = vec![("DATABASE_URL".to_owned(), url.clone())];
    let mut common = vec![
        "--transport".to_owned(),
        args.transport.name().to_owned(),
        "--max-connections".to_owned(),
        "8".to_owned(),
    ];
    match args.transport {
        TransportKind::Postgres => {}
        TransportKind::Rabbitmq => {
            env.push(("BROKER_URL".into(), crate::brokers::rabbitmq_url().await));
            common.extend(["--topic".into(), topic.clone()]);
            common.extend(["--reminder-topic".into(), reminder_topic.clone()]);
            common.extend(["--broker-expires-secs".into(), "3600".into()]);
        }
        TransportKind::Nats => {
            env.push(("BROKER_URL".into(), crate::brokers::nats_url().await));
            common.extend(["--topic".into(), topic.clone()]);
            common.extend(["--reminder-topic".into(), reminder_topic.clone()]);
            common.extend(["--broker-expires-secs".into(), "3600".into()]);
        }
        TransportKind::Kafka => {
            env.push(("BROKER_URL".into(), crate::brokers::kafka_url().await));
            // The demo's broker is tansu 0.6, which skips the rest of a record batch when a
            // consumer restarts inside it: one message per batch.
            env.push(("KAFKA_SETTINGS".into(), "batch.num.messages=1".into()));
            common.extend(["--topic".into(), topic.clone()]);
            common.extend(["--reminder-topic".into(), reminder_topic.clone()]);
        }
    }
    let service = |name: &'static str, extra: &[String]| -> anyhow::Result<Arc<Service>> {
        let addr = free_port()?;
        let mut service_args = vec![name.to_owned(), "--listen".into(), addr.to_string()];
        service_args.extend(common.iter().cloned());
        service_args.extend(extra.iter().cloned());
        Ok(Arc::new(Service {
            name,
            addr,
            args: service_args,
            env: env.clone(),
            child: Mutex::new(None),
        }))
    };
    // Points first: on a broker, its queue must exist before payments publishes.
    // In batches of 8: a SIGKILL catches whole uncommitted batches in hand.
    let mut points_args = vec![
        "--visibility-timeout-ms".into(),
        "2000".into(),
        "--batch-size".into(),
        "8".into(),
    ];
    if args.transport == TransportKind::Kafka {
        // Static membership: each restart after a SIGKILL takes the partitions back at
        // once. Without it, tansu 0.6 can leave a SIGKILLed group leader in charge and the
        // restarted consumer with no partitions (the README's Kafka section).
        points_args.extend(["--instance-id".into(), "points-1".into()]);
    }
    let points = service("points", &points_args)?;
    let mut payments_args = vec![
        "--duplicate-rate".into(),
        args.duplicate_rate.to_string(),
        "--producer-retries".into(),
        args.producer_retries.to_string(),
        "--reminder-after-secs".into(),
        args.reminder_after_secs.to_string(),
    ];
    if args.transport == TransportKind::Kafka {
        // Its reminders consumer, like the points service's consumer above.
        payments_args.extend(["--instance-id".into(), "payments-1".into()]);
    }
    let payments = service("payments", &payments_args)?;
    let services = [payments.clone(), points.clone()];

    let outcome = async {
        points.start().await?;
        points.wait_healthy(Duration::from_secs(30)).await?;
        payments.start().await?;
        payments.wait_healthy(Duration::from_secs(30)).await?;
        println!(
            "payments on {}, points on {} ({} transport; injecting --duplicate-rate {} \
             --producer-retries {})",
            payments.addr,
            points.addr,
            args.transport.name(),
            args.duplicate_rate,
            args.producer_retries,
        );
        let target = Target {
            payments: &payments,
            points: &points,
            pool: Some(&pool),
            queue_backlog: args.transport == TransportKind::Postgres,
            kills: args.kills,
            user_base: 0,
            features: Some(Features {
                topic: topic.clone(),
                reminder_topic: reminder_topic.clone(),
                reminder_after: Duration::from_secs_f64(args.reminder_after_secs),
                cloudevents: args.transport != TransportKind::Postgres,
                replay_new_ids: args.transport == TransportKind::Nats,
            }),
        };
        // The timeout counts from here: finding or starting a broker (on a new machine,
        // building one) and starting the services is not the run's time.
        drive_and_check(&args, &target, Instant::now()).await
    }
    .await;
    // Stop the children whatever happened (they are also killed when dropped).
    let mut stopped = Vec::new();
    for s in &services {
        stopped.push((s.name, s.stop().await));
    }
    let mut ok = report_outcome(outcome);
    for (name, status) in stopped {
        let graceful = status.is_some_and(|s| s.success());
        println!(
            "  [{}] {name} stopped gracefully on SIGTERM ({})",
            if graceful { "ok" } else { "FAILED" },
            status.map_or_else(|| "did not exit".to_owned(), |s| s.to_string())
        );
        ok &= graceful;
    }
    print_verdict(ok, started);
    Ok(ok)
}

/// External mode: drives services started by someone else (docker compose) and checks this
/// run's orders only.
async fn run_external(
    args: &DemoArgs,
    payments_url: &str,
    points_url: &str,
) -> anyhow::Result<bool> {
    parse_http_url(payments_url)?;
    parse_http_url(points_url)?;
    let within = Duration::from_secs(args.wait_secs);
    println!("external mode: waiting for payments at {payments_url} and points at {points_url}");
    let payments = Arc::new(Service::external("payments", payments_url, within).await?);
    let points = Arc::new(Service::external("points", points_url, within).await?);
    let pool = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Some(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(&url)
                .await
                .context("connect to DATABASE_URL")?,
        ),
        _ => None,
    };
    let queue_backlog = match &pool {
        Some(pool) => {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass('broker.queue') IS NOT NULL")
                .fetch_one(pool)
                .await?
        }
        None => false,
    };
    if args.kills > 0 {
        println!("  (external mode: --kills ignored, the services are not this driver's)");
    }
    // Users no earlier run has: the checks then see this run's orders only.
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    anyhow::ensure!(
        args.users < 1_000_000,
        "--users must be below 1000000 in external mode"
    );
    let user_base = millis * 1_000_000;
    println!(
        "payments at {} ({payments_url}), points at {} ({points_url}); users {}..={}; SQL checks {}",
        payments.addr,
        points.addr,
        user_base + 1,
        user_base + args.users,
        if pool.is_some() {
            "on (DATABASE_URL)"
        } else {
            "off (no DATABASE_URL)"
        }
    );
    let started = Instant::now();
    let target = Target {
        payments: &payments,
        points: &points,
        pool: pool.as_ref(),
        queue_backlog,
        kills: 0,
        user_base,
        features: None,
    };
    let ok = report_outcome(drive_and_check(args, &target, started).await);
    print_verdict(ok, started);
    Ok(ok)
}

fn report_outcome(outcome: anyhow::Result<bool>) -> bool {
    match outcome {
        Ok(ok) => ok,
        Err(e) => {
            println!("  [FAILED] {e:#}");
            false
        }
    }
}

fn print_verdict(ok: bool, started: Instant) {
    println!(
        "{} in {:.1?}",
        if ok {
            "all invariants hold"
        } else {
            "INVARIANTS BROKEN"
        },
        started.elapsed()
    );
}

/// `http://host[:port][/]` → host and port (default 80).
fn parse_http_url(url: &str) -> anyhow::Result<(String, u16)> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("{url:?}: only http://host:port URLs are supported"))?;
    let authority = rest.trim_end_matches('/');
    anyhow::ensure!(
        !authority.is_empty() && !authority.contains('/'),
        "{url:?}: expected http://host:port, without a path"
    );
    // [v6]:port, host:port, host
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .with_context(|| format!("{url:?}: unclosed ["))?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => p
            .parse()
            .with_context(|| format!("{url:?}: bad port {p:?}"))?,
        None => 80,
    };
    Ok((host.to_owned(), port))
}

fn free_port() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// What the driver drives and how it checks.
struct Target<'a> {
    payments: &'a Arc<Service>,
    points: &'a Arc<Service>,
    /// For the SQL checks; none in external mode without DATABASE_URL.
    pool: Option<&'a sqlx::PgPool>,
    /// Whether `broker.queue` counts in the backlog (the built-in queue transport).
    queue_backlog: bool,
    /// SIGKILLs during the run (children only).
    kills: usize,
    /// This run's users are `user_base + 1 ..= user_base + users`.
    user_base: i64,
    /// What the services were started with, for the checks of the reminders, the replay and
    /// CloudEvents (children only).
    features: Option<Features>,
}

/// The settings of the children this driver started.
struct Features {
    /// PaymentSucceeded's topic (the replay's).
    topic: String,
    /// The payment reminders' topic.
    reminder_topic: String,
    /// The payments child's `--reminder-after-secs`.
    reminder_after: Duration,
    /// Whether PaymentSucceeded travels as CloudEvents (on a broker).
    cloudevents: bool,
    /// Whether the replay gives the events new ids: on NATS, whose JetStream drops a
    /// re-publish of a message id within its duplicate window (2 minutes) before any consumer
    /// sees it. With new ids the replay reaches the points service, whose inbox, keyed by the
    /// order, still answers Duplicate.
    replay_new_ids: bool,
}

/// The faults the payments service reports as injected (`/stats`), since it first started
/// on this database.
async fn injected(payments: &Service) -> anyhow::Result<(i64, i64)> {
    let stats = get(payments.addr, "/stats").await?.json()?;
    let n = |k: &str| stats["injected"][k].as_i64().unwrap_or_default();
    Ok((n("relay_duplicates"), n("producer_resends")))
}

async fn drive_and_check(
    args: &DemoArgs,
    target: &Target<'_>,
    started: Instant,
) -> anyhow::Result<bool> {
    let (payments, points) = (target.payments, target.points);
    let injected_before = injected(payments).await?;
    let counters = Arc::new(Counters::default());
    let next = Arc::new(AtomicUsize::new(0));
    let run = uuid::Uuid::now_v7().simple().to_string();

    // Orders never paid, first: their reminders fall due while the services are killed.
    let mut unpaid = Vec::new();
    if target.features.is_some() {
        for i in 0..args.unpaid {
            let user_id = target.user_base + 1 + (i as i64 % args.users);
            let body = json!({ "user_id": user_id, "amount": 1 + i as i64 });
            let key = format!("{run}-create-unpaid-{i}");
            let created = send(
                payments,
                "POST",
                "/orders",
                Some(&key),
                Some(&body),
                &counters,
            )
            .await?;
            anyhow::ensure!(
                created.status == 201,
                "create unpaid order {i}: {} {}",
                created.status,
                created.text()
            );
            unpaid.push(created.json()?["id"].as_i64().context("order without id")?);
        }
    }

    // The killer: at evenly spaced points of progress, SIGKILL a random service and start it
    // again. The clients meanwhile retry with the same keys.
    let killer = {
        let (payments, points, counters) = (payments.clone(), points.clone(), counters.clone());
        let (kills, orders) = (target.kills, args.orders);
        tokio::spawn(async move {
            let mut log = Vec::new();
            for k in 0..kills {
                let at = orders * (k + 1) / (kills + 1);
                while counters.done.load(Relaxed) < at {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let victim = if rand::rng().random_bool(0.5) {
                    &payments
                } else {
                    &points
                };
                victim.kill_and_restart().await?;
                log.push(format!("{} at order {at}", victim.name));
            }
            anyhow::Ok(log)
        })
    };

    let mut clients = Vec::new();
    for _ in 0..args.clients {
        let (payments, counters, next, args, run) = (
            payments.clone(),
            counters.clone(),
            next.clone(),
            args.clone(),
            run.clone(),
        );
        let user_base = target.user_base;
        clients.push(tokio::spawn(async move {
            let mut paid = Vec::new();
            loop {
                let i = next.fetch_add(1, Relaxed);
                if i >= args.orders {
                    return anyhow::Ok(paid);
                }
                paid.push(one_order(&payments, &args, &run, user_base, i, &counters).await?);
                counters.done.fetch_add(1, Relaxed);
            }
        }));
    }
    let mut paid: Vec<Paid> = Vec::new();
    for c in clients {
        paid.extend(c.await??);
    }
    let kills = killer.await??;
    let driven = started.elapsed();
    println!(
        "{} orders paid over HTTP in {driven:.1?}; killed: {}",
        paid.len(),
        if kills.is_empty() {
            "none".to_owned()
        } else {
            kills.join(", ")
        }
    );

    // Wait (bounded) until the points service has rewarded every paid order and (with SQL)
    // nothing is in flight.
    payments.wait_healthy(Duration::from_secs(30)).await?;
    points.wait_healthy(Duration::from_secs(30)).await?;
    let mut expected: BTreeMap<i64, BTreeSet<i64>> = BTreeMap::new();
    for p in &paid {
        expected.entry(p.user_id).or_default().insert(p.order_id);
    }
    let deadline = started + Duration::from_secs(args.timeout_secs);
    let mut last_report = Instant::now();
    loop {
        let rewarded = rewarded_orders(points, &expected).await?;
        let backlog = match target.pool {
            Some(pool) => backlog(pool, target.queue_backlog).await?,
            None => 0,
        };
        if rewarded >= paid.len() && backlog == 0 {
            break;
        }
        if Instant::now() > deadline {
            println!(
                "  [FAILED] timed out: {rewarded}/{} rewarded, {backlog} in flight",
                paid.len()
            );
            return Ok(false);
        }
        if last_report.elapsed() > Duration::from_secs(2) {
            println!(
                "  … {rewarded}/{} orders rewarded, {backlog} messages in flight",
                paid.len()
            );
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let injected_after = injected(payments).await?;
    let faults = Faults {
        relay_duplicates: injected_after.0 - injected_before.0,
        producer_resends: injected_after.1 - injected_before.1,
    };

    let mut ok = check(args, target, &run, &paid, &expected, &counters, &faults).await?;
    if let (Some(features), Some(pool)) = (&target.features, target.pool) {
        ok &= check_reminders(
            pool,
            features,
            &unpaid,
            &paid,
            target.queue_backlog,
            deadline,
        )
        .await?;
        ok &= check_replay(pool, target, features, &expected).await?;
        ok &= check_event_form(pool, features, &paid).await?;
    }
    Ok(ok)
}

/// Prints `[ok]` or `[FAILED]` and `what`; whether `good`.
fn verdict(good: bool, what: String) -> bool {
    println!("  [{}] {what}", if good { "ok" } else { "FAILED" });
    good
}

/// The payment reminders: waits (until `deadline`) for the unpaid orders' reminders, then
/// checks that each got one, on time, and that no paid order got one it should not have.
async fn check_reminders(
    pool: &sqlx::PgPool,
    features: &Features,
    unpaid: &[i64],
    paid: &[Paid],
    queue_backlog: bool,
    deadline: Instant,
) -> anyhow::Result<bool> {
    let paid: Vec<i64> = paid.iter().map(|p| p.order_id).collect();
    let after = features.reminder_after.as_secs_f64();
    // Reminders of these orders still scheduled, and messages not yet consumed (on the
    // built-in queue, the reminders' own too).
    let scheduled = "SELECT count(*) FROM svc_payments_pgbox.outbox_scheduled \
                     WHERE topic = $1 AND schedule_key = ANY($2)";
    let keys: Vec<String> = unpaid
        .iter()
        .chain(&paid)
        .map(|id| format!("order-{id}"))
        .collect();
    let mut last_report = Instant::now();
    loop {
        let reminded: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM svc_payments.reminders WHERE order_id = ANY($1)",
        )
        .bind(unpaid)
        .fetch_one(pool)
        .await?;
        let in_flight: i64 = sqlx::query_scalar::<_, i64>(scheduled)
            .bind(&features.reminder_topic)
            .bind(&keys)
            .fetch_one(pool)
            .await?
            + backlog(pool, queue_backlog).await?;
        if reminded as usize >= unpaid.len() && in_flight == 0 {
            break;
        }
        if Instant::now() > deadline {
            println!(
                "  [FAILED] timed out: {reminded}/{} unpaid orders reminded, {in_flight} \
                 reminders or messages pending",
                unpaid.len()
            );
            return Ok(false);
        }
        if last_report.elapsed() > Duration::from_secs(2) {
            println!("  … {reminded}/{} unpaid orders reminded", unpaid.len());
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Unpaid: one reminder each (`sent` counts them), no earlier than due.
    let (reminded_once, on_time, sent): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE r.sent = 1), \
                count(*) FILTER (WHERE r.first_sent_at >= o.created_at + make_interval(secs => $2)), \
                coalesce(sum(r.sent), 0)::bigint \
         FROM svc_payments.orders o JOIN svc_payments.reminders r ON r.order_id = o.id \
         WHERE o.id = ANY($1) AND o.status = 'created'",
    )
    .bind(unpaid)
    .bind(after)
    .fetch_one(pool)
    .await?;
    // Paid: a reminder delivered (its inbox key) for an order paid before it fell due means
    // the payment did not cancel it (with a margin: a paying transaction that began just
    // before the due time may meet a promoted reminder, which the consumer then drops); a
    // reminder recorded after the payment means the consumer reminded a paid order. Paid
    // late (a kill in between), reminded before: allowed.
    let (delivered_cancelled, reminded_after_paid, reminded_before_late_payment): (
        i64,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT \
           (SELECT count(*) FROM svc_payments.orders o \
            JOIN svc_payments_pgbox.inbox i \
              ON i.consumer = 'payment-reminders' AND i.key = 'order-' || o.id \
            WHERE o.id = ANY($1) \
              AND o.paid_at + interval '200 milliseconds' < o.created_at + make_interval(secs => $2)), \
           (SELECT count(*) FROM svc_payments.orders o \
            JOIN svc_payments.reminders r ON r.order_id = o.id \
            WHERE o.id = ANY($1) AND r.last_sent_at > o.paid_at), \
           (SELECT count(*) FROM svc_payments.orders o \
            JOIN svc_payments.reminders r ON r.order_id = o.id \
            WHERE o.id = ANY($1) AND r.last_sent_at <= o.paid_at)",
    )
    .bind(&paid)
    .bind(after)
    .fetch_one(pool)
    .await?;
    let n = unpaid.len() as i64;
    let mut ok = verdict(
        reminded_once == n && sent == n && on_time == n,
        format!(
            "each unpaid order reminded exactly once, after its due time ({n} unpaid: \
             {reminded_once} reminded once, {sent} reminders, {on_time} on or after due)"
        ),
    );
    ok &= verdict(
        delivered_cancelled == 0 && reminded_after_paid == 0,
        format!(
            "no paid order reminded ({delivered_cancelled} reminders delivered despite the \
             payment, {reminded_after_paid} sent after it; {reminded_before_late_payment} \
             paid only after their reminder)"
        ),
    );
    Ok(ok)
}

/// The sum of the `pgbox_consumer_messages_duplicate_total` series on `service`'s metrics.
async fn duplicates_seen(service: &Service) -> anyhow::Result<f64> {
    let text = get(service.addr, "/metrics").await?.text();
    Ok(text
        .lines()
        .filter(|l| l.starts_with("pgbox_consumer_messages_duplicate_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum())
}

/// Replays one user's PaymentSucceeded events from the payments archive: the points service
/// must see each as a duplicate and grant nothing.
async fn check_replay(
    pool: &sqlx::PgPool,
    target: &Target<'_>,
    features: &Features,
    expected: &BTreeMap<i64, BTreeSet<i64>>,
) -> anyhow::Result<bool> {
    let Some((&user_id, orders)) = expected.iter().next() else {
        return Ok(true);
    };
    let ledger = "SELECT count(*), coalesce(sum(points), 0)::bigint FROM svc_points.ledger";
    let before: (i64, i64) = sqlx::query_as(ledger).fetch_one(pool).await?;
    let duplicates_before = duplicates_seen(target.points).await?;
    let started = Instant::now();
    let replay = pgbox::Archive::new(pool.clone())
        .with_schema(crate::payments::PGBOX_SCHEMA)?
        .replay()
        .topic(&features.topic)
        .ordering_key(format!("user-{user_id}"))
        .new_ids(features.replay_new_ids)
        .run()
        .await;
    let report = match replay {
        Ok(report) => report,
        Err(e) => {
            return Ok(verdict(
                false,
                format!("a replay of user {user_id}'s events from the archive: {e}"),
            ));
        }
    };
    // Answered once the points consumer counted as many duplicates and nothing is in flight.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut duplicates;
    loop {
        duplicates = duplicates_seen(target.points).await? - duplicates_before;
        let in_flight = backlog(pool, target.queue_backlog).await?;
        if duplicates >= report.replayed as f64 && in_flight == 0 {
            break;
        }
        if Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after: (i64, i64) = sqlx::query_as(ledger).fetch_one(pool).await?;
    Ok(verdict(
        report.replayed >= orders.len() as u64
            && duplicates >= report.replayed as f64
            && after == before,
        format!(
            "a replay of user {user_id}'s events from the archive grants 0 new points \
             ({} replayed{} for {} orders, {duplicates} answered Duplicate, ledger {} → {} \
             points, in {:.1?})",
            report.replayed,
            if features.replay_new_ids {
                " with new ids"
            } else {
                ""
            },
            orders.len(),
            before.1,
            after.1,
            started.elapsed()
        ),
    ))
}

/// On a broker, every PaymentSucceeded that granted points came as a CloudEvent from
/// `/payments`; on the built-in queue, in the native envelope.
async fn check_event_form(
    pool: &sqlx::PgPool,
    features: &Features,
    paid: &[Paid],
) -> anyhow::Result<bool> {
    let paid: Vec<i64> = paid.iter().map(|p| p.order_id).collect();
    let (rows, from_payments): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE event_source = $2) \
         FROM svc_points.ledger WHERE order_id = ANY($1)",
    )
    .bind(&paid)
    .bind(crate::payments::EVENT_SOURCE)
    .fetch_one(pool)
    .await?;
    Ok(if features.cloudevents {
        verdict(
            rows == paid.len() as i64 && from_payments == rows,
            format!(
                "points granted from CloudEvents (source {}): {from_payments} of {rows} ledger rows",
                crate::payments::EVENT_SOURCE
            ),
        )
    } else {
        verdict(
            from_payments == 0,
            format!("points granted from the native envelope ({rows} ledger rows)"),
        )
    })
}

/// How many of `expected` (order ids by user) the points API shows in the users' ledgers.
async fn rewarded_orders(
    points: &Service,
    expected: &BTreeMap<i64, BTreeSet<i64>>,
) -> anyhow::Result<usize> {
    let mut rewarded = 0;
    for (user_id, orders) in expected {
        let r = get(points.addr, &format!("/users/{user_id}/points"))
            .await?
            .json()?;
        rewarded += r["ledger"].as_array().map_or(0, |ledger| {
            ledger
                .iter()
                .filter_map(|e| e["order_id"].as_i64())
                .filter(|id| orders.contains(id))
                .count()
        });
    }
    Ok(rewarded)
}

/// The faults injected during this run, from the payments service's `/stats`.
struct Faults {
    relay_duplicates: i64,
    producer_resends: i64,
}

/// Outbox rows plus (postgres transport) queue rows not yet consumed.
async fn backlog(pool: &sqlx::PgPool, queue: bool) -> anyhow::Result<i64> {
    let sql = if queue {
        "SELECT (SELECT count(*) FROM svc_payments_pgbox.outbox) + (SELECT count(*) FROM broker.queue)"
    } else {
        "SELECT count(*) FROM svc_payments_pgbox.outbox"
    };
    Ok(sqlx::query_scalar(sql).fetch_one(pool).await?)
}

/// Creates order `i` and pays it; sometimes retries the payment with the same key
/// (afterwards or at once), reuses the key for another order (expects 422) or pays again
/// with a new key (expects 409).
async fn one_order(
    payments: &Service,
    args: &DemoArgs,
    run: &str,
    user_base: i64,
    i: usize,
    counters: &Counters,
) -> anyhow::Result<Paid> {
    let user_id = user_base + 1 + (i as i64 % args.users);
    let body = json!({ "user_id": user_id, "amount": 100 + i as i64 });
    let create_key = format!("{run}-create-{i}");
    let created = send(
        payments,
        "POST",
        "/orders",
        Some(&create_key),
        Some(&body),
        counters,
    )
    .await?;
    anyhow::ensure!(
        created.status == 201,
        "create order {i}: {} {}",
        created.status,
        created.text()
    );
    let order_id = created.json()?["id"].as_i64().context("order without id")?;

    let pay_key = format!("{run}-pay-{i}");
    let path = format!("/orders/{order_id}/pay");
    let (concurrent, retry) = {
        let mut rng = rand::rng();
        (
            rng.random_bool(args.concurrent_rate),
            rng.random_bool(args.retry_rate),
        )
    };
    let mut responses = Vec::new();
    if concurrent {
        let (a, b) = tokio::join!(
            send(payments, "POST", &path, Some(&pay_key), None, counters),
            send(payments, "POST", &path, Some(&pay_key), None, counters),
        );
        responses.push(a?);
        responses.push(b?);
        counters.concurrent_duplicates.fetch_add(1, Relaxed);
    } else {
        responses.push(send(payments, "POST", &path, Some(&pay_key), None, counters).await?);
    }
    if retry {
        responses.push(send(payments, "POST", &path, Some(&pay_key), None, counters).await?);
        counters.retries_same_key.fetch_add(1, Relaxed);
    }
    let first = &responses[0];
    if first.status != 200 {
        counters.unexpected.fetch_add(1, Relaxed);
        anyhow::bail!("pay order {order_id}: {} {}", first.status, first.text());
    }
    for r in &responses[1..] {
        if r.status != first.status || r.body != first.body {
            counters.mismatched_replays.fetch_add(1, Relaxed);
            println!(
                "  order {order_id}: replay differs: {} {} vs {} {}",
                r.status,
                r.text(),
                first.status,
                first.text()
            );
        }
    }
    let replayed = responses
        .iter()
        .filter(|r| r.header("idempotent-replayed") == Some("true"))
        .count();
    counters.replayed_header.fetch_add(replayed as u64, Relaxed);

    if i.is_multiple_of(10) {
        // The same key for another request: refused.
        let other = format!("/orders/{}/pay", order_id + 1_000_000);
        let r = send(payments, "POST", &other, Some(&pay_key), None, counters).await?;
        counters.reused_key_checks.fetch_add(1, Relaxed);
        if r.status != 422 {
            counters.reused_key_failures.fetch_add(1, Relaxed);
        }
    }
    if i % 10 == 5 {
        // A new key for a paid order: conflict, and no second payment.
        let r = send(
            payments,
            "POST",
            &path,
            Some(&format!("{pay_key}-again")),
            None,
            counters,
        )
        .await?;
        counters.new_key_checks.fetch_add(1, Relaxed);
        if r.status != 409 {
            counters.new_key_failures.fetch_add(1, Relaxed);
        }
    }
    Ok(Paid { order_id, user_id })
}

/// What SQL says about this run's users, independently of the services.
struct SqlView {
    orders: i64,
    paid: i64,
    ledger_rows: i64,
    ledger_points: i64,
    totals: i64,
    unrewarded: i64,
    rewarded_unpaid: i64,
    pay_keys: i64,
}

async fn sql_view(pool: &sqlx::PgPool, users: (i64, i64), run: &str) -> anyhow::Result<SqlView> {
    let (first, last) = users;
    let (orders, paid): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status = 'paid') FROM svc_payments.orders \
         WHERE user_id BETWEEN $1 AND $2",
    )
    .bind(first)
    .bind(last)
    .fetch_one(pool)
    .await?;
    let (ledger_rows, ledger_points): (i64, i64) = sqlx::query_as(
        "SELECT count(*), coalesce(sum(points), 0)::bigint FROM svc_points.ledger \
         WHERE user_id BETWEEN $1 AND $2",
    )
    .bind(first)
    .bind(last)
    .fetch_one(pool)
    .await?;
    let totals: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(total), 0)::bigint FROM svc_points.accounts \
         WHERE user_id BETWEEN $1 AND $2",
    )
    .bind(first)
    .bind(last)
    .fetch_one(pool)
    .await?;
    let unrewarded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM svc_payments.orders o WHERE o.status = 'paid' \
         AND o.user_id BETWEEN $1 AND $2 \
         AND NOT EXISTS (SELECT 1 FROM svc_points.ledger l WHERE l.order_id = o.id)",
    )
    .bind(first)
    .bind(last)
    .fetch_one(pool)
    .await?;
    let rewarded_unpaid: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM svc_points.ledger l WHERE l.user_id BETWEEN $1 AND $2 \
         AND NOT EXISTS (SELECT 1 FROM svc_payments.orders o WHERE o.id = l.order_id \
                         AND o.status = 'paid')",
    )
    .bind(first)
    .bind(last)
    .fetch_one(pool)
    .await?;
    // The idempotency layer records `<scope length>:<scope>:<key>`; payments has no scope.
    let pay_keys: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM svc_payments_pgbox.inbox \
         WHERE consumer = 'pay-requests' AND key LIKE $1",
    )
    .bind(format!("0::{run}-pay-%"))
    .fetch_one(pool)
    .await
    .unwrap_or(-1);
    Ok(SqlView {
        orders,
        paid,
        ledger_rows,
        ledger_points,
        totals,
        unrewarded,
        rewarded_unpaid,
        pay_keys,
    })
}

async fn check(
    args: &DemoArgs,
    target: &Target<'_>,
    run: &str,
    paid: &[Paid],
    expected: &BTreeMap<i64, BTreeSet<i64>>,
    counters: &Counters,
    faults: &Faults,
) -> anyhow::Result<bool> {
    let (payments, points) = (target.payments, target.points);
    // From the HTTP APIs: every order paid; each user's points and ledger.
    let mut not_paid = 0;
    for p in paid {
        let order = get(payments.addr, &format!("/orders/{}", p.order_id))
            .await?
            .json()?;
        if order["status"] != "paid" {
            not_paid += 1;
        }
    }
    let paid_api = (paid.len() - not_paid) as i64;
    let (mut wrong_totals, mut rewarded_twice, mut unrewarded, mut foreign) = (0, 0, 0, 0);
    let mut api_points = 0;
    for (user_id, orders) in expected {
        let r = get(points.addr, &format!("/users/{user_id}/points"))
            .await?
            .json()?;
        let total = r["points"].as_i64().unwrap_or(-1);
        api_points += total;
        let ledger: Vec<i64> = r["ledger"]
            .as_array()
            .map(|a| a.iter().filter_map(|e| e["order_id"].as_i64()).collect())
            .unwrap_or_default();
        let distinct: BTreeSet<i64> = ledger.iter().copied().collect();
        rewarded_twice += ledger.len() - distinct.len();
        unrewarded += orders.difference(&distinct).count();
        foreign += distinct.difference(orders).count();
        if total != POINTS_PER_ORDER * orders.len() as i64 {
            wrong_totals += 1;
        }
    }

    // From SQL, independently of the services (this run's users only).
    let sql = match target.pool {
        Some(pool) => Some(
            sql_view(
                pool,
                (target.user_base + 1, target.user_base + args.users),
                run,
            )
            .await?,
        ),
        None => None,
    };

    let c = |a: &AtomicU64| a.load(Relaxed);
    println!();
    match &sql {
        Some(sql) => {
            println!("  orders created              {:>8}", sql.orders);
            println!("  orders paid                 {:>8}", sql.paid);
            println!("  payment keys recorded       {:>8}", sql.pay_keys);
        }
        None => {
            println!("  orders paid (API)           {paid_api:>8}");
        }
    }
    println!("  HTTP requests               {:>8}", c(&counters.requests));
    println!(
        "  retried after conn. failure {:>8}",
        c(&counters.connection_retries)
    );
    println!(
        "  retried after 5xx           {:>8}",
        c(&counters.server_error_retries)
    );
    println!(
        "  sequential same-key retries {:>8}",
        c(&counters.retries_same_key)
    );
    println!(
        "  concurrent same-key pairs   {:>8}",
        c(&counters.concurrent_duplicates)
    );
    println!(
        "  answered as replays         {:>8}",
        c(&counters.replayed_header)
    );
    println!(
        "  relay duplicates injected   {:>8}",
        faults.relay_duplicates
    );
    println!(
        "  producer re-sends injected  {:>8}",
        faults.producer_resends
    );
    match &sql {
        Some(sql) => println!("  points granted (ledger)     {:>8}", sql.ledger_points),
        None => println!("  points granted (API)        {api_points:>8}"),
    }
    println!();

    let mut ok = true;
    let mut check = |good: bool, what: String| {
        println!("  [{}] {what}", if good { "ok" } else { "FAILED" });
        ok &= good;
    };
    let driven = args.orders as i64;
    let unpaid = if target.features.is_some() {
        args.unpaid as i64
    } else {
        0
    };
    match &sql {
        Some(sql) => check(
            sql.orders == driven + unpaid && sql.paid == driven && not_paid == 0,
            format!(
                "every order created once and paid ({} created, {} paid, {driven} driven, \
                 {unpaid} left unpaid on purpose)",
                sql.orders, sql.paid
            ),
        ),
        None => check(
            paid.len() as i64 == driven && not_paid == 0,
            format!("every order paid (API: {paid_api} paid, {driven} driven)"),
        ),
    }
    let paid_count = sql.as_ref().map_or(paid_api, |sql| sql.paid);
    check(
        wrong_totals == 0 && api_points == POINTS_PER_ORDER * paid_count,
        format!(
            "points = 30 × paid orders per user (API total {api_points}, {wrong_totals} users off)"
        ),
    );
    if let Some(sql) = &sql {
        check(
            sql.ledger_points == POINTS_PER_ORDER * sql.paid && sql.totals == sql.ledger_points,
            format!(
                "SQL: ledger {} = account totals {} = 30 × {}",
                sql.ledger_points, sql.totals, sql.paid
            ),
        );
    }
    let ledger_rows = sql.as_ref().map_or(paid_count, |sql| sql.ledger_rows);
    check(
        rewarded_twice == 0 && ledger_rows == paid_count,
        format!(
            "no order rewarded twice ({rewarded_twice} in the API, {ledger_rows} ledger rows; \
             {} relay duplicates and {} producer re-sends injected)",
            faults.relay_duplicates, faults.producer_resends
        ),
    );
    let (unrewarded_sql, rewarded_unpaid) = sql
        .as_ref()
        .map_or((0, 0), |sql| (sql.unrewarded, sql.rewarded_unpaid));
    check(
        unrewarded == 0 && unrewarded_sql == 0 && foreign == 0 && rewarded_unpaid == 0,
        format!(
            "none unrewarded ({unrewarded} API, {unrewarded_sql} SQL), none rewarded unpaid \
             ({rewarded_unpaid} SQL, {foreign} API)"
        ),
    );
    check(
        c(&counters.mismatched_replays) == 0,
        format!(
            "every idempotent retry got the original response ({} differed)",
            c(&counters.mismatched_replays)
        ),
    );
    check(
        c(&counters.reused_key_failures) == 0,
        format!(
            "a key reused for another order is refused with 422 ({} checked)",
            c(&counters.reused_key_checks)
        ),
    );
    check(
        c(&counters.new_key_failures) == 0,
        format!(
            "paying a paid order with a new key is refused with 409 ({} checked)",
            c(&counters.new_key_checks)
        ),
    );
    Ok(ok)
}
