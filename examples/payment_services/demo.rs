//! The driver: starts both services as child processes, pays orders over HTTP (retrying with
//! the same Idempotency-Key, sometimes concurrently), SIGKILLs and restarts the services
//! during the run, then checks the invariants through both HTTP APIs and SQL.

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
use crate::local_pg;
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
    /// Give up (exit 1) when the run takes longer than this.
    #[arg(long, default_value_t = 90)]
    timeout_secs: u64,
    /// Where the messages go between the services (rabbitmq/nats: found or started like the
    /// tests do).
    #[arg(long, value_enum, default_value_t = TransportKind::Postgres)]
    transport: TransportKind,
}

const RESET: &str =
    "DROP SCHEMA IF EXISTS payments, payments_pgbox, points, points_pgbox, broker CASCADE";

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
    ] {
        anyhow::ensure!((0.0..=1.0).contains(&p), "{name} must be between 0 and 1");
    }
    anyhow::ensure!(
        args.users >= 1 && args.clients >= 1,
        "--users and --clients must be at least 1"
    );
    let started = Instant::now();
    let url = local_pg::database_url()
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await?;
    sqlx::raw_sql(RESET).execute(&pool).await?;

    let run = uuid::Uuid::now_v7().simple().to_string();
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
            common.extend(["--topic".into(), format!("payment-succeeded-{run}")]);
            common.extend(["--broker-expires-secs".into(), "3600".into()]);
        }
        TransportKind::Nats => {
            env.push(("BROKER_URL".into(), crate::brokers::nats_url().await));
            common.extend(["--topic".into(), format!("payment-succeeded-{run}")]);
            common.extend(["--broker-expires-secs".into(), "3600".into()]);
        }
    }
    let service = |name: &'static str, extra: &[&str]| -> anyhow::Result<Arc<Service>> {
        let addr = free_port()?;
        let mut service_args = vec![name.to_owned(), "--listen".into(), addr.to_string()];
        service_args.extend(common.iter().cloned());
        service_args.extend(extra.iter().map(|s| s.to_string()));
        Ok(Arc::new(Service {
            name,
            addr,
            args: service_args,
            env: env.clone(),
            child: Mutex::new(None),
        }))
    };
    // Points first: on a broker, its queue must exist before payments publishes.
    let points = service("points", &["--visibility-timeout-ms", "2000"])?;
    let payments = service("payments", &[])?;
    let services = [payments.clone(), points.clone()];

    let outcome = drive_and_check(&args, &pool, &payments, &points, started).await;
    // Stop the children whatever happened (they are also killed when dropped).
    let mut stopped = Vec::new();
    for s in &services {
        stopped.push((s.name, s.stop().await));
    }
    let mut ok = match outcome {
        Ok(ok) => ok,
        Err(e) => {
            println!("  [FAILED] {e:#}");
            false
        }
    };
    for (name, status) in stopped {
        let graceful = status.is_some_and(|s| s.success());
        println!(
            "  [{}] {name} stopped gracefully on SIGTERM ({})",
            if graceful { "ok" } else { "FAILED" },
            status.map_or_else(|| "did not exit".to_owned(), |s| s.to_string())
        );
        ok &= graceful;
    }
    println!(
        "{} in {:.1?}",
        if ok {
            "all invariants hold"
        } else {
            "INVARIANTS BROKEN"
        },
        started.elapsed()
    );
    Ok(ok)
}

fn free_port() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

async fn drive_and_check(
    args: &DemoArgs,
    pool: &sqlx::PgPool,
    payments: &Arc<Service>,
    points: &Arc<Service>,
    started: Instant,
) -> anyhow::Result<bool> {
    points.start().await?;
    points.wait_healthy(Duration::from_secs(30)).await?;
    payments.start().await?;
    payments.wait_healthy(Duration::from_secs(30)).await?;
    println!(
        "payments on {}, points on {} ({} transport)",
        payments.addr,
        points.addr,
        args.transport.name()
    );

    let counters = Arc::new(Counters::default());
    let next = Arc::new(AtomicUsize::new(0));
    let run = uuid::Uuid::now_v7().simple().to_string();

    // The killer: at evenly spaced points of progress, SIGKILL a random service and start it
    // again. The clients meanwhile retry with the same keys.
    let killer = {
        let (payments, points, counters) = (payments.clone(), points.clone(), counters.clone());
        let (kills, orders) = (args.kills, args.orders);
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
        clients.push(tokio::spawn(async move {
            let mut paid = Vec::new();
            loop {
                let i = next.fetch_add(1, Relaxed);
                if i >= args.orders {
                    return anyhow::Ok(paid);
                }
                paid.push(one_order(&payments, &args, &run, i, &counters).await?);
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

    // Wait (bounded) until the points service has rewarded every paid order and nothing is
    // in flight.
    payments.wait_healthy(Duration::from_secs(30)).await?;
    points.wait_healthy(Duration::from_secs(30)).await?;
    let deadline = started + Duration::from_secs(args.timeout_secs);
    let mut last_report = Instant::now();
    loop {
        let stats = get(points.addr, "/stats").await?.json()?;
        let rewarded = stats["rewarded_orders"].as_u64().unwrap_or_default() as usize;
        let backlog = backlog(pool, args.transport).await?;
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
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    check(args, pool, payments, points, &paid, &counters).await
}

/// Outbox rows plus (postgres transport) queue rows not yet consumed.
async fn backlog(pool: &sqlx::PgPool, transport: TransportKind) -> anyhow::Result<i64> {
    let sql = match transport {
        TransportKind::Postgres => {
            "SELECT (SELECT count(*) FROM payments_pgbox.outbox) + (SELECT count(*) FROM broker.queue)"
        }
        _ => "SELECT count(*) FROM payments_pgbox.outbox",
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
    i: usize,
    counters: &Counters,
) -> anyhow::Result<Paid> {
    let user_id = 1 + (i as i64 % args.users);
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

async fn check(
    args: &DemoArgs,
    pool: &sqlx::PgPool,
    payments: &Service,
    points: &Service,
    paid: &[Paid],
    counters: &Counters,
) -> anyhow::Result<bool> {
    // From the HTTP APIs: every order paid; each user's points and ledger.
    let mut expected: BTreeMap<i64, BTreeSet<i64>> = BTreeMap::new();
    let mut not_paid = 0;
    for p in paid {
        let order = get(payments.addr, &format!("/orders/{}", p.order_id))
            .await?
            .json()?;
        if order["status"] != "paid" {
            not_paid += 1;
        }
        expected.entry(p.user_id).or_default().insert(p.order_id);
    }
    let (mut wrong_totals, mut rewarded_twice, mut unrewarded, mut foreign) = (0, 0, 0, 0);
    let mut api_points = 0;
    for (user_id, orders) in &expected {
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

    // From SQL, independently of the services.
    let (orders_sql, paid_sql): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status = 'paid') FROM payments.orders",
    )
    .fetch_one(pool)
    .await?;
    let (ledger_rows, ledger_points): (i64, i64) =
        sqlx::query_as("SELECT count(*), coalesce(sum(points), 0)::bigint FROM points.ledger")
            .fetch_one(pool)
            .await?;
    let totals: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(total), 0)::bigint FROM points.accounts")
            .fetch_one(pool)
            .await?;
    let unrewarded_sql: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payments.orders o WHERE o.status = 'paid' \
         AND NOT EXISTS (SELECT 1 FROM points.ledger l WHERE l.order_id = o.id)",
    )
    .fetch_one(pool)
    .await?;
    let rewarded_unpaid: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM points.ledger l WHERE NOT EXISTS \
         (SELECT 1 FROM payments.orders o WHERE o.id = l.order_id AND o.status = 'paid')",
    )
    .fetch_one(pool)
    .await?;
    let pay_keys: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payments_pgbox.inbox WHERE consumer = 'pay-requests'",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(-1);

    let c = |a: &AtomicU64| a.load(Relaxed);
    println!();
    println!("  orders created              {orders_sql:>8}");
    println!("  orders paid                 {paid_sql:>8}");
    println!("  payment keys recorded       {pay_keys:>8}");
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
    println!("  points granted (ledger)     {ledger_points:>8}");
    println!();

    let mut ok = true;
    let mut check = |good: bool, what: String| {
        println!("  [{}] {what}", if good { "ok" } else { "FAILED" });
        ok &= good;
    };
    check(
        orders_sql == args.orders as i64 && paid_sql == args.orders as i64 && not_paid == 0,
        format!(
            "every order created once and paid ({orders_sql} created, {paid_sql} paid, {} driven)",
            args.orders
        ),
    );
    check(
        wrong_totals == 0 && api_points == POINTS_PER_ORDER * paid_sql,
        format!(
            "points = 30 × paid orders per user (API total {api_points}, {wrong_totals} users off)"
        ),
    );
    check(
        ledger_points == POINTS_PER_ORDER * paid_sql && totals == ledger_points,
        format!("SQL: ledger {ledger_points} = account totals {totals} = 30 × {paid_sql}"),
    );
    check(
        rewarded_twice == 0 && ledger_rows == paid_sql,
        format!("no order rewarded twice ({rewarded_twice} in the API, {ledger_rows} ledger rows)"),
    );
    check(
        unrewarded == 0 && unrewarded_sql == 0 && foreign == 0 && rewarded_unpaid == 0,
        format!(
            "none unrewarded ({unrewarded} API, {unrewarded_sql} SQL), none rewarded unpaid ({rewarded_unpaid})"
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
