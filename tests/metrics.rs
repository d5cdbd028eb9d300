//! Metrics through the `metrics` facade: exact counts from a real pipeline (outbox → relay →
//! queue → consumer → inbox) under a debugging recorder, and the payment/points example
//! serving them to a Prometheus scrape.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use pgbox::telemetry::{self, refresh_gauges};
use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    CancellationToken, Consumer, Envelope, Error, Inbox, LeaseAttempt, Message, Outbox, Relay,
    RetryPolicy, Verdict,
};
use sqlx::{Executor, PgPool};
use support::TestDb;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

// --- a recorder for the whole test binary -----------------------------------------------------

/// The debugging recorder, installed globally once per test binary (runners register their
/// metrics when they start, so it must be there first).
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this binary");
        snapshotter
    })
}

/// What has been recorded so far. A debugging snapshot drains what it reads (counters and
/// gauges back to 0, histograms emptied), so counters and histogram samples are accumulated
/// here across snapshots; gauges are read from the latest snapshot only (take it right after
/// `refresh_gauges`).
#[derive(Default, Clone)]
struct Recorded {
    counters: HashMap<String, u64>,
    histograms: HashMap<String, Vec<f64>>,
    gauges: HashMap<String, f64>,
}

fn recorded() -> Recorded {
    static ACCUMULATED: OnceLock<Mutex<Recorded>> = OnceLock::new();
    let acc = ACCUMULATED.get_or_init(Mutex::default);
    let mut acc = acc.lock().unwrap();
    acc.gauges.clear();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        match value {
            DebugValue::Counter(n) => *acc.counters.entry(name).or_default() += n,
            DebugValue::Gauge(v) => {
                acc.gauges.insert(name, v.into_inner());
            }
            DebugValue::Histogram(vs) => acc
                .histograms
                .entry(name)
                .or_default()
                .extend(vs.into_iter().map(|v| v.into_inner())),
        }
    }
    acc.clone()
}

/// `name{k=v,...}` with the labels sorted, as `recorded()` keys them.
fn key(name: &str, labels: &[(&str, &str)]) -> String {
    let mut labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

impl Recorded {
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let key = key(name, labels);
        *self
            .counters
            .get(&key)
            .unwrap_or_else(|| panic!("counter {key} was never registered"))
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let key = key(name, labels);
        *self
            .gauges
            .get(&key)
            .unwrap_or_else(|| panic!("gauge {key} not set by the last refresh"))
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> &[f64] {
        let key = key(name, labels);
        self.histograms
            .get(&key)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }
}

// --- the pipeline -------------------------------------------------------------------------------

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn enqueue(pool: &PgPool, messages: Vec<Message>) {
    let mut tx = pool.begin().await.unwrap();
    Outbox::new()
        .enqueue_batch(&mut tx, messages)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// The queue, except that it refuses the message whose payload is `poison`.
#[derive(Clone)]
struct Poisoned(PgQueue);

impl Publisher for Poisoned {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let good: Vec<Envelope> = batch
            .iter()
            .filter(|e| e.payload != b"poison")
            .cloned()
            .collect();
        let mut results = self.0.publish(&good).await.into_iter();
        batch
            .iter()
            .map(|e| {
                if e.payload == b"poison" {
                    Err(PublishError::refused("broker refused it"))
                } else {
                    results.next().expect("one result per message")
                }
            })
            .collect()
    }
}

const TOPIC: &str = "metrics-pipeline";
const CONSUMER: &str = "metrics-points";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipeline_counts_every_outcome_exactly_and_gauges_read_the_backlog() {
    snapshotter();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();

    // ok-1 twice (a producer retry under a new message id: the inbox key is the payload, so
    // the second is a duplicate), a rejection, a handler that always fails, one that panics
    // on its first delivery, and a message the broker refuses.
    let payloads = [
        "ok-1", "ok-2", "ok-1", "reject-3", "fail-4", "panic-5", "poison",
    ];
    enqueue(
        &db.pool,
        payloads.iter().map(|p| Message::bytes(TOPIC, *p)).collect(),
    )
    .await;

    let queue = PgQueue::new(db.pool.clone());
    let relay = Relay::builder(db.pool.clone(), Poisoned(queue.clone()))
        .max_attempts(2)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(1)),
        )
        .build()
        .unwrap();
    // Round one publishes six and reschedules the poison; a later one dead-letters it.
    for _ in 0..500 {
        relay.relay_once().await.unwrap();
        if count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox_dead_letters").await,
        1
    );

    let consumer = Consumer::builder(
        db.pool.clone(),
        queue.clone(),
        TOPIC,
        Inbox::new(CONSUMER).unwrap(),
    )
    .key(|e| String::from_utf8_lossy(&e.payload).into_owned())
    .max_deliveries(2)
    .backoff(RetryPolicy::new().base_delay(Duration::from_millis(5)))
    .poll_interval(Duration::from_millis(20))
    .build()
    .unwrap();
    let panicked_once = Arc::new(AtomicBool::new(false));
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let s = shutdown.clone();
        let panicked_once = panicked_once.clone();
        async move {
            consumer
                .run_or_reject(
                    async |e: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                        let text = String::from_utf8(e.payload.clone()).unwrap();
                        if text.starts_with("reject") {
                            return Ok(Verdict::Reject("no such account".into()));
                        }
                        if text.starts_with("fail") {
                            return Err(Error::InvalidConfig("the handler failed".into()));
                        }
                        sqlx::query("INSERT INTO effects VALUES ($1)")
                            .bind(&text)
                            .execute(&mut *conn)
                            .await
                            .map_err(Error::from)?;
                        if text.starts_with("panic") && !panicked_once.swap(true, Ordering::SeqCst)
                        {
                            panic!("a handler bug, once");
                        }
                        Ok::<_, Error>(Verdict::Accept(()))
                    },
                    s,
                )
                .await
        }
    });
    // Done when the queue is empty but for the dead-lettered fail-4.
    let start = Instant::now();
    while (count(&db.pool, "SELECT count(*) FROM pgbox.queue").await > 0
        || count(&db.pool, "SELECT count(*) FROM pgbox.queue_dead_letters").await < 1)
        && start.elapsed() < Duration::from_secs(30)
        && !run.is_finished()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = run.await.expect("the runner survived the panic").unwrap();
    assert_eq!(count(&db.pool, "SELECT count(*) FROM effects").await, 3);

    // A lease abandoned by a holder that stalled, taken over by the next one.
    let leases = Inbox::new("metrics-leases").unwrap();
    let abandoned = leases
        .lease(&db.pool, "charge-1", Duration::from_millis(1))
        .await
        .unwrap();
    assert!(matches!(abandoned, LeaseAttempt::Leased(_)));
    let mut taken_over = false;
    for _ in 0..500 {
        match leases
            .lease(&db.pool, "charge-1", Duration::from_secs(60))
            .await
            .unwrap()
        {
            LeaseAttempt::Leased(lease) => {
                assert!(lease.taken_over_from().is_some());
                taken_over = true;
                break;
            }
            LeaseAttempt::InProgress { .. } => tokio::time::sleep(Duration::from_millis(2)).await,
            LeaseAttempt::Duplicate(d) => panic!("not consumed: {d:?}"),
        }
    }
    assert!(taken_over);

    // Backlog for the gauges: two messages in the queue that nobody consumes, three in the
    // outbox that no relay publishes.
    enqueue(
        &db.pool,
        vec![
            Message::bytes("metrics-queued", "q1"),
            Message::bytes("metrics-queued", "q2"),
        ],
    )
    .await;
    relay.relay_once().await.unwrap();
    enqueue(
        &db.pool,
        (0..3)
            .map(|i| Message::bytes("metrics-backlog", format!("b{i}")))
            .collect(),
    )
    .await;
    refresh_gauges(&db.pool, "pgbox").await.unwrap();
    let m = recorded();

    // The consumer: exact counts, equal to what the run reported.
    let c = [("consumer", CONSUMER), ("topic", TOPIC)];
    assert_eq!(m.counter(telemetry::CONSUMER_PROCESSED, &c), 3); // ok-1, ok-2, panic-5
    assert_eq!(m.counter(telemetry::CONSUMER_DUPLICATES, &c), 1); // ok-1 again
    assert_eq!(m.counter(telemetry::CONSUMER_REJECTED, &c), 1);
    assert_eq!(m.counter(telemetry::CONSUMER_HANDLER_ERRORS, &c), 2); // fail-4, twice
    assert_eq!(m.counter(telemetry::CONSUMER_HANDLER_PANICS, &c), 1);
    assert_eq!(m.counter(telemetry::CONSUMER_RETRIED, &c), 2); // fail-4, panic-5
    assert_eq!(m.counter(telemetry::CONSUMER_DEAD_LETTERED, &c), 1); // fail-4
    assert_eq!(m.counter(telemetry::CONSUMER_IN_PROGRESS, &c), 0);
    assert_eq!(
        (
            stats.processed,
            stats.duplicates,
            stats.rejected,
            stats.panicked,
            stats.retried,
            stats.dead_lettered
        ),
        (3, 1, 1, 1, 2, 1)
    );
    // Seven deliveries ran the handler: every one but the duplicate.
    let durations = m.samples(telemetry::CONSUMER_HANDLER_DURATION, &c);
    assert_eq!(durations.len(), 7, "{durations:?}");
    assert!(durations.iter().all(|s| *s >= 0.0));
    // Six first deliveries.
    let lags = m.samples(telemetry::CONSUMER_RECEIVE_LAG, &c);
    assert_eq!(lags.len(), 6, "{lags:?}");
    assert!(lags.iter().all(|s| *s >= 0.0));

    // The relay.
    let t = [("topic", TOPIC)];
    assert_eq!(m.counter(telemetry::RELAY_PUBLISHED, &t), 6);
    assert_eq!(m.counter(telemetry::RELAY_RETRIED, &t), 1);
    assert_eq!(m.counter(telemetry::RELAY_DEAD_LETTERED, &t), 1);
    assert_eq!(
        m.counter(telemetry::RELAY_PUBLISHED, &[("topic", "metrics-queued")]),
        2
    );
    assert_eq!(m.samples(telemetry::RELAY_PUBLISH_LAG, &t).len(), 6);
    assert!(!m.samples(telemetry::RELAY_ROUND_DURATION, &[]).is_empty());

    // The inbox: a claim per delivery (the redeliveries' shortcut lookups found nothing and
    // went on to claim); the takeover.
    let claims = m.samples(telemetry::INBOX_CLAIM_DURATION, &[("consumer", CONSUMER)]);
    assert_eq!(claims.len(), 8, "{claims:?}");
    assert_eq!(
        m.counter(
            telemetry::INBOX_LEASE_TAKEOVERS,
            &[("consumer", "metrics-leases")]
        ),
        1
    );

    // The gauges.
    let g = |topic| [("schema", "pgbox"), ("topic", topic)];
    assert_eq!(
        m.gauge(telemetry::OUTBOX_BACKLOG, &g("metrics-backlog")),
        3.0
    );
    assert!(m.gauge(telemetry::OUTBOX_OLDEST_PENDING_AGE, &g("metrics-backlog")) >= 0.0);
    assert_eq!(m.gauge(telemetry::OUTBOX_BACKLOG, &g(TOPIC)), 0.0);
    assert_eq!(m.gauge(telemetry::OUTBOX_DEAD_LETTERS, &g(TOPIC)), 1.0);
    assert_eq!(m.gauge(telemetry::QUEUE_BACKLOG, &g("metrics-queued")), 2.0);
    assert!(m.gauge(telemetry::QUEUE_OLDEST_AGE, &g("metrics-queued")) >= 0.0);
    assert_eq!(m.gauge(telemetry::QUEUE_BACKLOG, &g(TOPIC)), 0.0);
    assert_eq!(m.gauge(telemetry::QUEUE_DEAD_LETTERS, &g(TOPIC)), 1.0);
    let inbox = |consumer| [("schema", "pgbox"), ("consumer", consumer)];
    // ok-1, ok-2, reject-3, panic-5.
    assert_eq!(m.gauge(telemetry::INBOX_ROWS, &inbox(CONSUMER)), 4.0);
    assert_eq!(
        m.gauge(telemetry::INBOX_ROWS, &inbox("metrics-leases")),
        1.0
    );
    let leases = |state| {
        [
            ("schema", "pgbox"),
            ("consumer", "metrics-leases"),
            ("state", state),
        ]
    };
    assert_eq!(m.gauge(telemetry::INBOX_LEASES, &leases("live")), 1.0);
    assert_eq!(m.gauge(telemetry::INBOX_LEASES, &leases("expired")), 0.0);

    // A topic whose messages are gone drops out of the snapshot: its gauges read 0, not
    // their last value.
    db.pool
        .execute("DELETE FROM pgbox.queue WHERE topic = 'metrics-queued'")
        .await
        .unwrap();
    refresh_gauges(&db.pool, "pgbox").await.unwrap();
    let m = recorded();
    assert_eq!(m.gauge(telemetry::QUEUE_BACKLOG, &g("metrics-queued")), 0.0);
    assert_eq!(
        m.gauge(telemetry::QUEUE_OLDEST_AGE, &g("metrics-queued")),
        0.0
    );
    assert_eq!(
        m.gauge(telemetry::OUTBOX_BACKLOG, &g("metrics-backlog")),
        3.0
    );

    // Scheduled messages: how many wait, and how late the earliest due one is (no relay
    // runs here, so a message made due 90 s ago stays overdue).
    let schema = [("schema", "pgbox")];
    assert_eq!(m.gauge(telemetry::OUTBOX_SCHEDULED, &schema), 0.0);
    assert_eq!(m.gauge(telemetry::OUTBOX_SCHEDULED_OVERDUE, &schema), 0.0);
    for n in 0..3 {
        let mut tx = db.pool.begin().await.unwrap();
        Outbox::new()
            .enqueue(
                &mut tx,
                Message::json("metrics-later", &n)
                    .unwrap()
                    .deliver_after(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    refresh_gauges(&db.pool, "pgbox").await.unwrap();
    let m = recorded();
    assert_eq!(m.gauge(telemetry::OUTBOX_SCHEDULED, &schema), 3.0);
    assert_eq!(m.gauge(telemetry::OUTBOX_SCHEDULED_OVERDUE, &schema), 0.0);
    db.pool
        .execute(
            "UPDATE pgbox.outbox_scheduled SET due_at = now() - interval '90 seconds' \
             WHERE sched_seq = (SELECT min(sched_seq) FROM pgbox.outbox_scheduled)",
        )
        .await
        .unwrap();
    refresh_gauges(&db.pool, "pgbox").await.unwrap();
    let overdue = recorded().gauge(telemetry::OUTBOX_SCHEDULED_OVERDUE, &schema);
    assert!((90.0..120.0).contains(&overdue), "{overdue}");
}

// --- the example, scraped -----------------------------------------------------------------------

/// target/debug/examples/<name>, next to this test binary's directory.
fn example_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

/// `GET /metrics` over HTTP/1.0 (no chunked encoding), the body; `None` if nothing answers.
async fn scrape(addr: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .ok()?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .ok()?
        .ok()?;
    let response = String::from_utf8(response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    Some(body.to_owned())
}

/// Samples of the exposition text: `name{labels}` → value.
fn parse(body: &str) -> BTreeMap<String, f64> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The value of the one series of `name` whose labels contain every `labels` pair.
fn value(samples: &BTreeMap<String, f64>, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|(series, _)| {
            series.strip_prefix(name).is_some_and(|rest| {
                rest.starts_with('{')
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            })
        })
        .map(|(_, v)| *v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_points_example_serves_its_metrics_to_a_prometheus_scrape() {
    const ORDERS: f64 = 300.0;
    let db = TestDb::empty().await;
    let example = example_path("payment_points");
    assert!(
        example.exists(),
        "{example:?} not built (cargo test builds examples)"
    );
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    // Lingering after its report keeps the final values up for the last scrape; the test
    // ends the process itself.
    let mut child = tokio::process::Command::new(example)
        .args([
            "--orders",
            "300",
            "--consumers",
            "2",
            "--timeout-secs",
            "120",
        ])
        .args(["--metrics-addr", &addr, "--metrics-linger-secs", "120"])
        .env("DATABASE_URL", db.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let stderr = child.stderr.take().unwrap();
    let stderr = tokio::spawn(async move {
        let mut text = String::new();
        let _ = BufReader::new(stderr).read_to_string(&mut text).await;
        text
    });

    // Scrape while it runs, until the report is printed (every order rewarded: the counters
    // are final, and the example refreshed its gauges once more).
    let mut report = String::new();
    let mut scrapes_while_running = 0;
    let start = Instant::now();
    while !report.contains("[ok] no paid order unrewarded") {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no report within 120 s:\n{report}"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the example exited early:\n{report}"
        );
        if scrape(&addr).await.is_some() {
            scrapes_while_running += 1;
        }
        while let Ok(Ok(Some(line))) =
            tokio::time::timeout(Duration::from_millis(50), stdout.next_line()).await
        {
            report.push_str(&line);
            report.push('\n');
        }
    }
    assert!(!report.contains("FAILED"), "{report}");
    let body = scrape(&addr).await.expect("the example serves /metrics");
    child.kill().await.unwrap();
    let stderr = stderr.await.unwrap();
    assert!(scrapes_while_running > 0, "{stderr}");

    let samples = parse(&body);
    let c = [
        ("consumer", "points-service"),
        ("topic", "payment-succeeded"),
    ];
    for line in [
        "# TYPE pgbox_consumer_messages_processed_total counter",
        "# TYPE pgbox_relay_messages_published_total counter",
        "# TYPE pgbox_consumer_handler_duration_seconds histogram",
        "# TYPE pgbox_inbox_claim_duration_seconds histogram",
        "# TYPE pgbox_inbox_rows gauge",
        "# HELP pgbox_consumer_messages_processed_total ",
    ] {
        assert!(body.contains(line), "no {line:?} in:\n{body}");
    }
    let processed = value(&samples, telemetry::CONSUMER_PROCESSED, &c);
    assert!(processed > Some(0.0), "{body}");
    // No faults injected: every order processed exactly once, published exactly once.
    assert_eq!(processed, Some(ORDERS), "{body}");
    assert_eq!(
        value(
            &samples,
            telemetry::RELAY_PUBLISHED,
            &[("topic", "payment-succeeded")]
        ),
        Some(ORDERS)
    );
    assert_eq!(
        value(&samples, telemetry::CONSUMER_HANDLER_ERRORS, &c),
        Some(0.0)
    );
    assert!(
        value(
            &samples,
            "pgbox_consumer_handler_duration_seconds_count",
            &c
        ) >= Some(ORDERS),
        "{body}"
    );
    assert_eq!(
        value(
            &samples,
            telemetry::INBOX_ROWS,
            &[("schema", "points_pgbox"), ("consumer", "points-service")]
        ),
        Some(ORDERS),
        "{body}"
    );
}

/// The liveness check is visible, and pgbox's own row helpers never owe one: through the
/// handler's connection they stay watched; through the raw connection a check is owed.
#[tokio::test]
async fn row_helpers_through_the_handler_connection_owe_no_liveness_check() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    snapshotter();
    db.pool
        .execute(
            "CREATE TABLE accounts (id bigint PRIMARY KEY, total bigint NOT NULL, version bigint NOT NULL); \
             INSERT INTO accounts VALUES (1, 0, 0)",
        )
        .await
        .unwrap();
    let accounts = pgbox::VersionedTable::new("accounts").unwrap();
    let checks = |consumer: &'static str| {
        recorded()
            .counters
            .get(&key(
                pgbox::telemetry::INBOX_LIVENESS_CHECKS,
                &[("consumer", consumer)],
            ))
            .copied()
            .unwrap_or(0)
    };
    let watched = pgbox::Inbox::new("helpers-watched").unwrap();
    let raw = pgbox::Inbox::new("helpers-raw").unwrap();
    for i in 0..5 {
        let key = format!("k{i}");
        // Handlers returning `()`: no outcome UPDATE that could double as the check.
        let outcome = watched
            .process_and_commit(&db.pool, key.as_str(), async |conn| {
                let version = accounts.current_version(conn, 1_i64).await?.unwrap();
                accounts
                    .update(1_i64, version)
                    .add("total", 1_i64)
                    .execute(conn)
                    .await
                    .map(drop)
            })
            .await
            .unwrap();
        assert!(outcome.is_processed());
        let outcome = raw
            .process_and_commit(&db.pool, key.as_str(), async |conn| {
                let version = accounts.current_version(&mut **conn, 1_i64).await?.unwrap();
                accounts
                    .update(1_i64, version)
                    .add("total", 1_i64)
                    .execute(&mut **conn)
                    .await
                    .map(drop)
            })
            .await
            .unwrap();
        assert!(outcome.is_processed());
    }
    assert_eq!(checks("helpers-watched"), 0);
    assert_eq!(checks("helpers-raw"), 5);
    assert_eq!(count(&db.pool, "SELECT total FROM accounts").await, 10);
}
