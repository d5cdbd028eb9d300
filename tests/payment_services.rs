//! The payment/points services (examples/payment_services/), run as processes: the demo
//! driver end to end, the payments API's idempotency over HTTP, its scheduled payment
//! reminders, the replay of its archive and CloudEvents on a broker.

mod support;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{TestDb, example_path, http};

const TIMEOUT: Duration = Duration::from_secs(10);

async fn post(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    body: Option<&serde_json::Value>,
) -> http::Response {
    let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
    http::request(addr, "POST", path, &headers, body, TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_keeps_its_invariants_while_services_are_killed() {
    let db = TestDb::empty().await;
    let example = example_path("payment_services");
    let url = db.url();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(example)
            .args(["demo", "--orders", "60", "--users", "6", "--clients", "4"])
            .args(["--kills", "2", "--timeout-secs", "60"])
            .env("DATABASE_URL", url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the demo failed");
    for line in [
        "[ok] points = 30 × paid orders per user",
        "[ok] no order rewarded twice",
        "[ok] none unrewarded",
        "[ok] every idempotent retry got the original response",
        "[ok] each unpaid order reminded exactly once, after its due time (10 unpaid",
        "[ok] no paid order reminded",
        "[ok] a replay of user 1's events from the archive grants 0 new points",
        "[ok] points granted from the native envelope (60 ledger rows)",
        "all invariants hold",
    ] {
        assert!(text.contains(line), "missing {line:?}");
    }
    assert!(!text.contains("FAILED"));

    // Independently: 60 paid orders, 30 points each, once.
    let (paid, ledger): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM svc_payments.orders WHERE status = 'paid'), \
                (SELECT coalesce(sum(points), 0)::bigint FROM svc_points.ledger)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((paid, ledger), (60, 60 * 30));
    assert_features_in_sql(&db.pool, 10).await;
}

/// What the demo's reminders, archive and replay left in the database, read without the
/// demo's help: each of the `unpaid` orders reminded once, no paid order reminded after its
/// payment, nothing left scheduled, and the replayed events went through the relay (archived
/// again, with their replay id) without a ledger row more.
async fn assert_features_in_sql(pool: &sqlx::PgPool, unpaid: i64) {
    let (unpaid_orders, reminded, sent): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(r.order_id), coalesce(sum(r.sent), 0)::bigint \
         FROM svc_payments.orders o LEFT JOIN svc_payments.reminders r ON r.order_id = o.id \
         WHERE o.status = 'created'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((unpaid_orders, reminded, sent), (unpaid, unpaid, unpaid));
    let (reminded_after_payment, scheduled): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM svc_payments.orders o \
                 JOIN svc_payments.reminders r ON r.order_id = o.id \
                 WHERE o.status = 'paid' AND r.last_sent_at > o.paid_at), \
                (SELECT count(*) FROM svc_payments_pgbox.outbox_scheduled)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((reminded_after_payment, scheduled), (0, 0));
    let (replayed, ledger_rows, paid): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM svc_payments_pgbox.outbox_archive \
                 WHERE headers ? 'pgbox-replay-id'), \
                (SELECT count(*) FROM svc_points.ledger), \
                (SELECT count(*) FROM svc_payments.orders WHERE status = 'paid')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(replayed > 0, "no replayed message went through the relay");
    assert_eq!(ledger_rows, paid, "the replay added ledger rows");
}

/// On RabbitMQ the payments relay publishes CloudEvents (binary mode, source `/payments`), its
/// reminders go through the broker too, and the points service reads the events: the demo's
/// invariants, with every ledger row granted from a CloudEvent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_on_rabbitmq_uses_cloudevents_reminders_and_replay() {
    let db = TestDb::empty().await;
    let url = db.url();
    let text = run_demo(
        &[
            "--transport",
            "rabbitmq",
            "--orders",
            "40",
            "--users",
            "4",
            "--clients",
            "4",
            "--kills",
            "1",
            "--unpaid",
            "6",
            "--timeout-secs",
            "60",
        ],
        &[("DATABASE_URL", &url)],
    )
    .await;
    for line in [
        "[ok] each unpaid order reminded exactly once, after its due time (6 unpaid",
        "[ok] no paid order reminded",
        "[ok] a replay of user 1's events from the archive grants 0 new points",
        "[ok] points granted from CloudEvents (source /payments): 40 of 40 ledger rows",
    ] {
        assert!(text.contains(line), "missing {line:?}");
    }
    let (rows, from_payments): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE event_source = '/payments') \
         FROM svc_points.ledger",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((rows, from_payments), (40, 40));
    assert_features_in_sql(&db.pool, 6).await;
}

/// The scheduled payment reminder, service by service: creating an order schedules it (due
/// after REMINDER_AFTER_SECS, by the database's clock), paying cancels it in the paying
/// transaction, and an unpaid order's reminder is consumed once, also when the service was
/// SIGKILLed while it waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_reminder_is_cancelled_by_the_payment_and_sent_once_otherwise() {
    let db = TestDb::empty().await;
    let url = db.url();
    let env = [("REMINDER_AFTER_SECS", "2")];
    let payments = Payments::start_service("payments", &url, &env).await;
    let (paid, unpaid) = (
        create_order(payments.addr, 7).await,
        create_order(payments.addr, 7).await,
    );
    let scheduled = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (String, f64)>(
            "SELECT schedule_key, extract(epoch FROM due_at - created_at)::float8 \
             FROM svc_payments_pgbox.outbox_scheduled WHERE topic = 'payment-reminders' \
             ORDER BY schedule_key",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let before = scheduled(db.pool.clone()).await;
    let mut keys: Vec<String> = vec![format!("order-{paid}"), format!("order-{unpaid}")];
    keys.sort();
    assert_eq!(
        before.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        keys
    );
    for (key, delay) in &before {
        assert!(
            (2.0..2.5).contains(delay),
            "{key} due {delay} s after creation"
        );
    }
    let r = post(
        payments.addr,
        &format!("/orders/{paid}/pay"),
        Some("pay-1"),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        scheduled(db.pool.clone()).await.len(),
        1,
        "the payment did not cancel its reminder"
    );

    // A third order, then SIGKILL before its reminder is due, and a new process.
    let killed = create_order(payments.addr, 8).await;
    drop(payments);
    let payments = Payments::start_service("payments", &url, &env).await;

    // Both unpaid orders reminded once; the paid one's reminder never delivered.
    let deadline = Instant::now() + Duration::from_secs(20);
    let reminders = loop {
        let rows: Vec<(i64, i32)> =
            sqlx::query_as("SELECT order_id, sent FROM svc_payments.reminders ORDER BY 1")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        if rows.len() >= 2 || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Time for a second delivery, were there one.
    tokio::time::sleep(Duration::from_secs(1)).await;
    payments.stop().await;
    assert_eq!(reminders, vec![(unpaid, 1), (killed, 1)]);
    let (sent, delivered, late): (i64, Vec<String>, i64) = sqlx::query_as(
        "SELECT (SELECT sum(sent) FROM svc_payments.reminders), \
                (SELECT array_agg(key ORDER BY key) FROM svc_payments_pgbox.inbox \
                 WHERE consumer = 'payment-reminders'), \
                (SELECT count(*) FROM svc_payments.reminders r \
                 JOIN svc_payments.orders o ON o.id = r.order_id \
                 WHERE r.first_sent_at < o.created_at + interval '2 seconds')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let mut expected = vec![format!("order-{unpaid}"), format!("order-{killed}")];
    expected.sort();
    assert_eq!((sent, delivered, late), (2, expected, 0));
}

/// The two services over Kafka (the shared test broker, tansu), killed and restarted
/// mid-run: the same invariants.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_on_kafka_keeps_its_invariants_while_services_are_killed() {
    let db = TestDb::empty().await;
    let url = db.url();
    let text = run_demo(
        &[
            "--transport",
            "kafka",
            "--orders",
            "60",
            "--users",
            "6",
            "--clients",
            "4",
            "--kills",
            "2",
            "--timeout-secs",
            "90",
        ],
        &[("DATABASE_URL", &url)],
    )
    .await;
    assert!(text.contains("[ok] no order rewarded twice"));
    let (paid, ledger): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM svc_payments.orders WHERE status = 'paid'), \
                (SELECT coalesce(sum(points), 0)::bigint FROM svc_points.ledger)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((paid, ledger), (60, 60 * 30));
}

/// The number on the demo's summary line starting with `label`.
fn summary_count(text: &str, label: &str) -> i64 {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} line"));
    line.split_whitespace().last().unwrap().parse().unwrap()
}

/// Runs `payment_services demo <args>` with `env` (and without DATABASE_URL unless given);
/// its stdout, after asserting that it passed.
async fn run_demo(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(example_path("payment_services"));
    cmd.arg("demo").args(args).env_remove("DATABASE_URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let logs = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("{text}{logs}");
    assert!(out.status.success(), "the demo failed");
    assert!(text.contains("all invariants hold"));
    assert!(!text.contains("FAILED"));
    // Logs to a pipe are plain text, and a run's idempotent DDL raises no notices.
    assert!(
        !logs.contains('\u{1b}') && !text.contains('\u{1b}'),
        "colour codes in a pipe"
    );
    assert!(!logs.contains("skipping"), "NOTICEs in the log: {logs}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_injected_faults_keeps_its_invariants() {
    let db = TestDb::empty().await;
    let url = db.url();
    let text = run_demo(
        &[
            "--orders",
            "60",
            "--users",
            "6",
            "--clients",
            "4",
            "--kills",
            "1",
            "--timeout-secs",
            "60",
            "--duplicate-rate",
            "0.5",
            "--producer-retries",
            "0.3",
        ],
        &[("DATABASE_URL", &url)],
    )
    .await;
    assert!(text.contains("injecting --duplicate-rate 0.5 --producer-retries 0.3"));
    let duplicates = summary_count(&text, "relay duplicates injected");
    let resends = summary_count(&text, "producer re-sends injected");
    assert!(duplicates > 0, "no duplicate injected");
    assert!(resends > 0, "no re-send injected");
    for line in [
        "[ok] no order rewarded twice",
        "[ok] none unrewarded",
        "[ok] SQL: ledger 1800 = account totals 1800",
    ] {
        assert!(text.contains(line), "missing {line:?}");
    }

    // Independently: whatever was injected, one ledger row per order, 30 points each.
    let (ledger_rows, ledger, recorded): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM svc_points.ledger), \
                (SELECT coalesce(sum(points), 0)::bigint FROM svc_points.ledger), \
                (SELECT count FROM svc_payments.injected_faults WHERE kind = 'producer_resends')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((ledger_rows, ledger), (60, 60 * 30));
    assert_eq!(
        recorded, resends,
        "the summary reports what payments recorded"
    );
}

/// A service alone, as a child process killed when dropped.
struct Payments {
    child: std::process::Child,
    addr: SocketAddr,
    name: &'static str,
}

impl Payments {
    async fn start(url: &str) -> Payments {
        Payments::start_service("payments", url, &[]).await
    }

    /// `payment_services <name> --listen <free port>` with DATABASE_URL = `url` and `env`;
    /// returns when its /health answers.
    async fn start_service(name: &'static str, url: &str, env: &[(&str, &str)]) -> Payments {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let child = Command::new(example_path("payment_services"))
            .args([name, "--listen", &addr.to_string()])
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .spawn()
            .unwrap();
        let mut payments = Payments { child, addr, name };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = http::request(addr, "GET", "/health", &[], None, TIMEOUT).await
                && r.status == 200
            {
                return payments;
            }
            if let Some(status) = payments.child.try_wait().unwrap() {
                panic!("{name} exited during start-up: {status}");
            }
            assert!(Instant::now() < deadline, "{name} not healthy in 30 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM; the service finishes its work and exits 0.
    async fn stop(mut self) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "{} exited with {status}", self.name);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not stop in 30 s",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Payments {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn create_order(addr: SocketAddr, user_id: i64) -> i64 {
    let r = post(
        addr,
        "/orders",
        None,
        Some(&json!({ "user_id": user_id, "amount": 500 })),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json().unwrap()["id"].as_i64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pay_is_idempotent_by_key_over_http() {
    let db = TestDb::empty().await;
    let payments = Payments::start(&db.url()).await;
    let addr = payments.addr;
    let order = create_order(addr, 7).await;
    let pay = format!("/orders/{order}/pay");

    // No key: refused, nothing paid.
    let r = post(addr, &pay, None, None).await;
    assert_eq!(r.status, 400, "{}", r.text());
    // A key with a space: refused, saying why.
    let r = post(addr, &pay, Some("two words"), None).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("it contains a space"), "{}", r.text());

    // An order that does not exist: 404, not stored (a retry runs again, no replay).
    let missing = format!("/orders/{}/pay", order + 1_000_000);
    for _ in 0..2 {
        let r = post(addr, &missing, Some("key-404"), None).await;
        assert_eq!(r.status, 404, "{}", r.text());
        assert_eq!(r.header("idempotent-replayed"), None);
    }

    // Same key: the identical response, marked as a replay.
    let first = post(addr, &pay, Some("key-1"), None).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let body = first.json().unwrap();
    assert_eq!(body["status"], "paid");
    assert_eq!(body["id"], order);
    assert!(body["payment_id"].is_string());
    let again = post(addr, &pay, Some("key-1"), None).await;
    assert_eq!((again.status, &again.body), (first.status, &first.body));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));

    // Same key, another request: refused.
    let other = create_order(addr, 7).await;
    let r = post(addr, &format!("/orders/{other}/pay"), Some("key-1"), None).await;
    assert_eq!(r.status, 422, "{}", r.text());

    // A new key for the paid order: conflict; the order keeps its payment.
    let r = post(addr, &pay, Some("key-2"), None).await;
    assert_eq!(r.status, 409, "{}", r.text());

    // Two requests with one key at once: the same payment for both, one effect.
    let pay_other = format!("/orders/{other}/pay");
    let (a, b) = tokio::join!(
        post(addr, &pay_other, Some("key-3"), None),
        post(addr, &pay_other, Some("key-3"), None),
    );
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!((a.status, &a.body), (b.status, &b.body));
    let replays = [&a, &b]
        .iter()
        .filter(|r| r.header("idempotent-replayed") == Some("true"))
        .count();
    assert_eq!(
        replays, 1,
        "one request ran, the other was answered from it"
    );

    // The relay finishes its round on SIGTERM; then every message is in the outbox or the
    // queue (nobody consumes here), and each paid order has exactly one PaymentSucceeded.
    payments.stop().await;
    let events: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT (convert_from(payload, 'UTF8')::jsonb->>'order_id')::bigint AS order_id, \
                count(DISTINCT message_id) \
         FROM (SELECT payload, message_id, topic FROM svc_payments_pgbox.outbox \
               UNION ALL SELECT payload, message_id, topic FROM broker.queue) m \
         WHERE topic = 'payment-succeeded' \
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(events, vec![(order, 1), (other, 1)]);
    let paid: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, status FROM svc_payments.orders ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        paid,
        vec![(order, "paid".to_owned()), (other, "paid".to_owned())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_drives_running_services_in_external_mode() {
    let db = TestDb::empty().await;
    let url = db.url();
    let faults = [("DUPLICATE_RATE", "0.5"), ("PRODUCER_RETRIES", "0.3")];
    // Points first: the queue's consumer is there before payments publishes.
    let points = Payments::start_service("points", &url, &[]).await;
    let payments = Payments::start_service("payments", &url, &faults).await;
    let payments_url = format!("http://{}", payments.addr);
    let points_url = format!("http://{}/", points.addr);
    let external = [
        "--payments-url",
        payments_url.as_str(),
        "--points-url",
        points_url.as_str(),
        "--orders",
        "40",
        "--users",
        "5",
        "--clients",
        "4",
        "--timeout-secs",
        "60",
    ];

    // HTTP only: no DATABASE_URL, so no SQL checks.
    let text = run_demo(&external, &[]).await;
    assert!(text.contains("SQL checks off"), "SQL checks ran");
    assert!(!text.contains("SQL: ledger"));
    assert!(text.contains("[ok] every order paid (API: 40 paid, 40 driven)"));
    assert!(text.contains("[ok] no order rewarded twice"));
    assert!(
        !text.contains("stopped gracefully"),
        "the driver stopped the services"
    );
    assert!(summary_count(&text, "relay duplicates injected") > 0);

    // Again, on the same database (not reset), with the SQL checks: they see this run only.
    let text = run_demo(&external, &[("DATABASE_URL", &url)]).await;
    assert!(text.contains("SQL checks on"));
    assert!(text.contains("[ok] every order created once and paid (40 created, 40 paid"));
    assert!(text.contains("[ok] SQL: ledger 1200 = account totals 1200"));

    // Both runs' orders, rewarded once each; the services are still up and stop cleanly.
    let (paid, ledger): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM svc_payments.orders WHERE status = 'paid'), \
                (SELECT coalesce(sum(points), 0)::bigint FROM svc_points.ledger)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((paid, ledger), (80, 80 * 30));
    let stats = http::request(payments.addr, "GET", "/stats", &[], None, TIMEOUT)
        .await
        .unwrap()
        .json()
        .unwrap();
    assert!(stats["injected"]["relay_duplicates"].as_i64().unwrap() > 0);
    payments.stop().await;
    points.stop().await;
}

/// A dead broker makes either service unready, never dead: both start, `/health/live` says
/// 200, `/health/ready` (and `/health`) 503 naming the broker, and they keep running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_broker_makes_a_service_unready_not_dead() {
    let db = TestDb::empty().await;
    let url = db.url();
    let cases = [
        ("points", "rabbitmq", "amqp://guest:guest@127.0.0.1:1/%2f"),
        #[cfg(feature = "nats")]
        ("payments", "nats", "nats://127.0.0.1:1"),
        #[cfg(feature = "kafka")]
        ("points", "kafka", "127.0.0.1:1"),
    ];
    for (name, transport, broker) in cases {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut child = Command::new(example_path("payment_services"))
            .args([
                name,
                "--listen",
                &addr.to_string(),
                "--transport",
                transport,
            ])
            .env("DATABASE_URL", &url)
            .env("BROKER_URL", broker)
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let live = loop {
            if let Ok(r) = http::request(addr, "GET", "/health/live", &[], None, TIMEOUT).await {
                break r;
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("{name} exited with a dead broker: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "{name} never served /health/live"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(live.status, 200, "{name}");
        for path in ["/health/ready", "/health"] {
            let ready = http::request(addr, "GET", path, &[], None, TIMEOUT)
                .await
                .unwrap();
            assert_eq!(ready.status, 503, "{name} {path}: {}", ready.text());
            let body = ready.json().unwrap();
            assert!(body["down"]["broker"].is_string(), "{name}: {body}");
            assert!(body["down"]["database"].is_null(), "{name}: {body}");
        }
        // Still running a moment later.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(child.try_wait().unwrap().is_none(), "{name} gave up");
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// What an operator reads while the broker is down: the points service starts, is live and
/// unready, says so once per component (not a warning per 250 ms poll), logs plain text to a
/// pipe (no `NO_COLOR` needed), says in one line that it migrated its schema (and on a
/// restart that it was current), stops cleanly on SIGTERM, and a restart raises no "already
/// exists, skipping" NOTICEs from its idempotent set-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_broker_is_reported_once_per_outage_in_plain_logs() {
    let db = TestDb::empty().await;
    // A local port nothing listens on: bound, then released.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let broker = format!("amqp://guest:guest@127.0.0.1:{closed}/%2f");

    let first = run_points_briefly(&db.url(), &broker, Duration::from_secs(3)).await;
    assert!(
        !first.contains('\u{1b}'),
        "colour codes in a pipe:\n{first}"
    );
    assert!(!first.contains("skipping"), "NOTICEs:\n{first}");
    // One INFO line per migrated schema, no line per migration (those are at DEBUG).
    assert_eq!(
        first.matches("V1__inbox").count(),
        0,
        "a line per migration:\n{first}"
    );
    assert_eq!(first.matches("pgbox schema migrated").count(), 1, "{first}");
    // Two components notice the outage (readiness and the consumer): one warning each, then
    // backoff. Polling every 250 ms would have logged a dozen in these 3 s.
    let warnings = first.lines().filter(|l| l.contains(" WARN ")).count();
    assert!(
        (1..=4).contains(&warnings),
        "{warnings} warnings in 3 s:\n{first}"
    );

    let restart = run_points_briefly(&db.url(), &broker, Duration::ZERO).await;
    assert!(
        !restart.contains("skipping"),
        "NOTICEs on restart:\n{restart}"
    );
    assert!(!restart.contains("applying migration"), "{restart}");
    assert_eq!(
        restart.matches("pgbox schema already current").count(),
        1,
        "{restart}"
    );
}

/// Starts `points` on RabbitMQ at `broker` (down), checks live 200 and ready 503 naming the
/// broker, waits `linger`, stops it with SIGTERM (it must exit 0) and returns its stderr.
async fn run_points_briefly(url: &str, broker: &str, linger: Duration) -> String {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut child = Command::new(example_path("payment_services"))
        .args(["points", "--listen", &addr.to_string()])
        .args(["--transport", "rabbitmq"])
        .env("DATABASE_URL", url)
        .env("BROKER_URL", broker)
        .env("RUST_LOG", "info")
        // Plain text must come from stderr not being a terminal, not from NO_COLOR.
        .env_remove("NO_COLOR")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let live = loop {
        if let Ok(r) = http::request(addr, "GET", "/health/live", &[], None, TIMEOUT).await {
            break r;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("points exited with a dead broker: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "points never served /health/live"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(live.status, 200);
    let ready = http::request(addr, "GET", "/health/ready", &[], None, TIMEOUT)
        .await
        .unwrap();
    assert_eq!(ready.status, 503, "{}", ready.text());
    let body = ready.json().unwrap();
    assert_eq!(body["ready"], false, "{body}");
    assert!(body["down"]["broker"].is_string(), "{body}");
    assert!(body["down"]["database"].is_null(), "{body}");
    tokio::time::sleep(linger).await;

    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await
    .expect("points did not stop in 30 s after SIGTERM")
    .unwrap()
    .unwrap();
    let logs = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "points exited with {}:\n{logs}",
        out.status
    );
    logs
}

/// Readiness follows the broker both ways: `points` on RabbitMQ (through a proxy the test
/// controls) becomes ready, turns unready (503 naming the broker) when the broker goes away
/// later, with one warning, and ready again when it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_turns_503_on_a_later_broker_outage_and_back() {
    let db = TestDb::empty().await;
    let rabbit = support::brokers::rabbitmq_url().await;
    let proxy = support::brokers::Proxy::start(support::brokers::address(&rabbit)).await;
    let broker = support::brokers::with_address(&rabbit, proxy.addr());
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut child = Command::new(example_path("payment_services"))
        .args(["points", "--listen", &addr.to_string()])
        .args(["--transport", "rabbitmq"])
        .env("DATABASE_URL", db.url())
        .env("BROKER_URL", &broker)
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ready_is = async |status: u16, within: Duration| {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(r) = http::request(addr, "GET", "/health/ready", &[], None, TIMEOUT).await
                && r.status == status
            {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "/health/ready never answered {status}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    ready_is(200, Duration::from_secs(30)).await;
    // The broker goes away: new connections refused, open ones cut.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    proxy.retarget(closed);
    proxy.cut();
    let down = ready_is(503, Duration::from_secs(20)).await;
    let body = down.json().unwrap();
    assert!(body["down"]["broker"].is_string(), "{body}");
    assert!(
        http::request(addr, "GET", "/health/live", &[], None, TIMEOUT)
            .await
            .unwrap()
            .status
            == 200
    );
    // Back.
    proxy.retarget(support::brokers::address(&rabbit));
    ready_is(200, Duration::from_secs(40)).await;
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let logs = String::from_utf8_lossy(&out.stderr);
    assert!(
        logs.contains("broker unreachable; not ready"),
        "the outage was logged:\n{logs}"
    );
}

/// `payments` with NATS down: the relay's failed rounds say so once per round, not once per
/// message plus once per batch.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_with_a_dead_broker_warns_once_per_relay_round() {
    let db = TestDb::empty().await;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(example_path("payment_services"))
        .args(["payments", "--listen", &addr.to_string()])
        .args(["--transport", "nats"])
        .env("DATABASE_URL", db.url())
        .env("BROKER_URL", format!("nats://127.0.0.1:{closed}"))
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while http::request(addr, "GET", "/health/live", &[], None, TIMEOUT)
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "payments never served /health/live"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Ten paid orders wait in the outbox for a broker that is not there.
    for n in 1..=10 {
        let created = http::request(
            addr,
            "POST",
            "/orders",
            &[],
            Some(&json!({ "user_id": 1, "amount": 100 })),
            TIMEOUT,
        )
        .await
        .unwrap();
        assert!(created.status < 300, "{}", created.text());
        let order = created.json().unwrap()["id"].as_i64().unwrap();
        let paid = http::request(
            addr,
            "POST",
            &format!("/orders/{order}/pay"),
            &[("Idempotency-Key", &format!("pay-{n}"))],
            None,
            TIMEOUT,
        )
        .await
        .unwrap();
        assert!(paid.status < 300, "{}", paid.text());
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let logs = String::from_utf8_lossy(&out.stderr);
    let per_message =
        logs.matches("pgbox nats publish failed").count() + logs.matches("not connected").count();
    assert_eq!(per_message, 0, "per-message or per-batch warnings:\n{logs}");
    // A broker that is away is an outage: one line per relay round that found it so.
    let rounds = logs.matches("pgbox relay: transport unavailable").count();
    assert!(
        (1..=6).contains(&rounds),
        "{rounds} relay warnings in ~3 s for 10 messages:\n{logs}"
    );
}
