//! Attacks on the operations kit in `ops/`: the alerting rules and the Grafana dashboard,
//! measured against their promise (guide/src/dashboards.md, the rules' annotations): an
//! alert fires when its condition is true for real and stays silent in healthy operation.
//!
//! Two kinds of test:
//! - On a real Prometheus (2.42, scraping every second) that scrapes the payment services
//!   example (`examples/payment_services/`, built by `cargo test` or `cargo build --example
//!   payment_services`): services killed and restarted, a service that stays dead.
//! - Through `promtool test rules`, which runs Prometheus's own rule engine over series
//!   written out sample by sample: for what needs hours of history (scrape gaps, windows
//!   of 15 minutes). The series have the shapes the real services export (a counter created
//!   at 0 at start, labels `job`/`instance` from the scrape).
//!
//! Prometheus and promtool come from PATH, else from Debian's `prometheus` package when the
//! tests run as root (tests/support/prometheus.rs).

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::prometheus::{
    DASHBOARD, HTTP_TIMEOUT, LIMIT, PRIVATE_DIR_PREFIX, Prometheus, RULES, Service, free_port,
    read, rules_without_for, tools,
};
use support::{TestDb, http};

// --- promtool: the rule engine over series written out --------------------------------------

/// The shipped rules without their annotations (expressions, `for:` and labels unchanged),
/// so that a case can expect an alert by its labels alone.
fn rules_without_annotations() -> String {
    let mut out = Vec::new();
    let mut skip_deeper_than: Option<usize> = None;
    let shipped = read(RULES);
    for line in shipped.lines() {
        let indent = line.len() - line.trim_start().len();
        if let Some(depth) = skip_deeper_than {
            if line.trim().is_empty() || indent > depth {
                continue;
            }
            skip_deeper_than = None;
        }
        if line.trim() == "annotations:" {
            skip_deeper_than = Some(indent);
            continue;
        }
        out.push(line);
    }
    out.join("\n") + "\n"
}

/// Runs `promtool test rules` on `tests` (the `tests:` list of a rule unit test file, YAML)
/// against the shipped rules without annotations; the failures promtool reports, or `Ok`
/// when every expectation held.
fn promtool_cases(tests: &str) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!(
        "{PRIVATE_DIR_PREFIX}{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules.yml"), rules_without_annotations()).unwrap();
    let file = dir.join("cases.yml");
    std::fs::write(
        &file,
        format!("rule_files:\n- rules.yml\nevaluation_interval: 1m\ntests:\n{tests}"),
    )
    .unwrap();
    let out = Command::new(&tools().promtool)
        .args(["test", "rules", "cases.yml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // promtool says SUCCESS only when every case held; a syntax error is a failure too.
    if out.status.success() && text.contains("SUCCESS") {
        Ok(())
    } else {
        Err(text)
    }
}

/// Counters that only ever counted long ago (a dead letter, a lease takeover an hour before)
/// and a 12-minute gap in scraping (Prometheus restarted or upgraded, a network partition, a
/// target that timed out): the process never restarted and nothing new happened, yet the
/// `x > 0 unless x offset 15m` clause of the rare-event rules takes the series back for a
/// new one, and PgboxConsumerDeadLettered and PgboxInboxLeaseTakeovers fire 20 minutes after
/// the gap began, for events of an hour ago.
#[test]
fn finding_a_scrape_gap_fires_the_rare_event_alerts_for_old_events() {
    // 60 samples a minute apart, minutes 21 to 32 missing (`_`): the same values before and
    // after, as a process that kept running exports them.
    let series = |name_and_labels: &str, value: u32| {
        format!("  - series: {name_and_labels}\n    values: {value}x20 _x12 {value}x30\n")
    };
    let mut input = String::new();
    input.push_str(&series(
        r#"pgbox_consumer_messages_dead_lettered_total{job="points",instance="points-1:9100",consumer="points-service",topic="payment-succeeded"}"#,
        2,
    ));
    input.push_str(&series(
        r#"pgbox_inbox_lease_takeovers_total{job="points",instance="points-1:9100",consumer="points-service"}"#,
        1,
    ));
    input.push_str(&series(
        r#"pgbox_relay_round_errors_total{job="payments",instance="payments-1:9100"}"#,
        3,
    ));
    let mut expectations = String::new();
    // Every minute from the gap's start to well after it: nothing new happened.
    for minute in 18..=55 {
        for alert in [
            "PgboxConsumerDeadLettered",
            "PgboxInboxLeaseTakeovers",
            "PgboxRelayRoundsFailing",
        ] {
            expectations.push_str(&format!(
                "  - eval_time: {minute}m\n    alertname: {alert}\n    exp_alerts: []\n"
            ));
        }
    }
    let result = promtool_cases(&format!(
        "- name: a scrape gap, nothing new\n  interval: 1m\n  input_series:\n{input}  \
         alert_rule_test:\n{expectations}"
    ));
    assert!(
        result.is_ok(),
        "alerts fired after a scrape gap for events that happened before it:\n{}",
        result.unwrap_err()
    );
}

/// The rare-event rules still fire when they should: a counter created at 0 that climbs (a
/// dead letter), one that appears at 1 (pgbox creates the takeover counter at its first
/// increment), one that climbs again after its process restarted (reset to 0).
#[test]
fn rare_event_rules_fire_on_new_events_including_after_a_restart() {
    let input = concat!(
        // Created at 0 when the runner starts; a dead letter at minute 30.
        "  - series: pgbox_consumer_messages_dead_lettered_total{job=\"points\",instance=\"p:1\",consumer=\"c\",topic=\"t\"}\n",
        "    values: 0x29 1x30\n",
        // First takeover of a new process at minute 30: the series appears at 1.
        "  - series: pgbox_inbox_lease_takeovers_total{job=\"points\",instance=\"p:1\",consumer=\"c\"}\n",
        "    values: _x29 1x30\n",
        // 4 dead letters, the process restarted at minute 20 (0 again), one more at 40.
        "  - series: pgbox_consumer_messages_dead_lettered_total{job=\"points\",instance=\"p:2\",consumer=\"c\",topic=\"u\"}\n",
        "    values: 4x18 _ 0x20 1x20\n",
    );
    let tests = format!(
        "- name: new events\n  interval: 1m\n  input_series:\n{input}  alert_rule_test:\n\
         \x20 - eval_time: 25m\n    alertname: PgboxConsumerDeadLettered\n    exp_alerts: []\n\
         \x20 - eval_time: 32m\n    alertname: PgboxConsumerDeadLettered\n    exp_alerts:\n\
         \x20   - exp_labels: {{job: points, consumer: c, topic: t, severity: warning}}\n\
         \x20 - eval_time: 42m\n    alertname: PgboxConsumerDeadLettered\n    exp_alerts:\n\
         \x20   - exp_labels: {{job: points, consumer: c, topic: t, severity: warning}}\n\
         \x20   - exp_labels: {{job: points, consumer: c, topic: u, severity: warning}}\n\
         \x20 - eval_time: 32m\n    alertname: PgboxInboxLeaseTakeovers\n    exp_alerts:\n\
         \x20   - exp_labels: {{job: points, consumer: c, severity: info}}\n"
    );
    if let Err(text) = promtool_cases(&tests) {
        panic!("a new event did not fire its alert, or one fired early:\n{text}");
    }
}

/// Two services publish the same topic from their own outbox schemas. The relay of
/// `svc_b` publishes; the relay of `svc_a` is stalled (its messages have waited 10 minutes,
/// the oldest never changes). The relay's counter has no `schema` label and the rule joins
/// `on (topic)` only, so `svc_b`'s publishing hides `svc_a`'s stall: no PgboxRelayStalled.
#[test]
fn finding_another_schemas_relay_hides_a_stalled_relay() {
    let input = concat!(
        "  - series: pgbox_outbox_oldest_pending_age_seconds{schema=\"svc_a\",topic=\"orders\",job=\"a\",instance=\"a:1\"}\n",
        "    values: 0+60x30\n",
        "  - series: pgbox_outbox_oldest_pending_age_seconds{schema=\"svc_b\",topic=\"orders\",job=\"b\",instance=\"b:1\"}\n",
        "    values: 1x30\n",
        "  - series: pgbox_relay_messages_published_total{topic=\"orders\",job=\"b\",instance=\"b:1\"}\n",
        "    values: 0+100x30\n",
    );
    let tests = format!(
        "- name: one schema stalled, another publishes the topic\n  interval: 1m\n  \
         input_series:\n{input}  alert_rule_test:\n\
         \x20 - eval_time: 20m\n    alertname: PgboxRelayStalled\n    exp_alerts:\n\
         \x20   - exp_labels: {{schema: svc_a, topic: orders, severity: critical}}\n"
    );
    if let Err(text) = promtool_cases(&tests) {
        panic!("PgboxRelayStalled silent for svc_a/orders, stalled for 20 minutes:\n{text}");
    }
}

// --- a real Prometheus ----------------------------------------------------------------------

/// `payment_services <which>` on `addr`, on the built-in queue (`--transport postgres`) and
/// `topic`; returns once it is ready.
async fn on_queue(which: &str, addr: SocketAddr, database_url: &str, topic: &str) -> Service {
    let args = ["--transport", "postgres", "--topic", topic];
    Service::start(which, addr, database_url, &args).await
}

/// The payments service (orders API, outbox, relay, and the gauges of its schemas) is
/// SIGKILLed and stays dead while orders wait in its outbox. Its metrics vanish with it: the
/// outbox gauges go stale, so PgboxRelayStalled, PgboxOutboxMessagesWaitingTooLong and the
/// backlog rules have nothing to compare; the relay's counters vanish, so nothing else can
/// fire. Some pgbox alert must name the dead job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_dead_relay_process_raises_no_alert() {
    let db = TestDb::empty().await;
    let topic = format!("attack-ops-{}", uuid::Uuid::now_v7().simple());
    let mut payments = on_queue("payments", free_port(), &db.url(), &topic).await;
    let prometheus =
        Prometheus::start(&rules_without_for(&[]), &[("payments", payments.addr)]).await;
    payments.pay_an_order().await;
    prometheus
        .reaches(
            &format!("pgbox_relay_messages_published_total{{topic=\"{topic}\"}}"),
            1.0,
        )
        .await;
    let before = prometheus.active().await;
    assert!(before.is_empty(), "alerts while healthy: {before:?}");

    payments.kill();
    // An order paid while the relay is dead would wait in the outbox: the database holds
    // it, but no process reports it.
    let start = Instant::now();
    let alert = loop {
        let active = prometheus.active().await;
        if let Some(a) = active
            .iter()
            .find(|a| a["state"] == "firing" && a["labels"]["job"] == "payments")
        {
            break a.clone();
        }
        assert!(
            start.elapsed() < LIMIT,
            "the payments service (the relay) has been dead for {LIMIT:?} and no pgbox alert \
             names it; active: {active:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(alert["labels"]["severity"], "critical", "{alert}");
    let description = alert["annotations"]["description"].as_str().unwrap();
    assert!(description.contains("payments"), "{description}");
}

/// Both services on the built-in queue (points in two replicas), under load, each SIGKILLed
/// and restarted on its address (as the demo does): counters start again at 0, gauges go stale and come back.
/// While this happens, every message is processed and no pgbox alert fires (every `for:`
/// but PgboxProcessDown's set to 0s, so that a condition true for one evaluation shows).
/// Then, on the services' real label values, the dashboard's variables list them and its
/// core panels return data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_services_killed_and_restarted_raise_no_alert_and_fill_the_dashboard() {
    let db = TestDb::empty().await;
    let topic = format!("attack-ops-{}", uuid::Uuid::now_v7().simple());
    let (payments_addr, points_addr, replica_addr) = (free_port(), free_port(), free_port());
    let mut points = on_queue("points", points_addr, &db.url(), &topic).await;
    // A second replica of points: its counters and its copies of the gauges are scraped
    // separately, under the same job.
    let _replica = on_queue("points", replica_addr, &db.url(), &topic).await;
    let mut payments = on_queue("payments", payments_addr, &db.url(), &topic).await;
    let config = format!(
        "points\n    static_configs:\n      - targets: ['{points_addr}', '{replica_addr}']\n  \
         - job_name: payments"
    );
    let prometheus = Prometheus::start(
        &rules_without_for(&["PgboxProcessDown"]),
        &[(config.as_str(), payments_addr)],
    )
    .await;

    // Every second alert state is read in the background: any firing alert, or any pending
    // one other than PgboxProcessDown (pending while a service is down, by design).
    let seen: Arc<std::sync::Mutex<Vec<Value>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (seen, stop, addr) = (seen.clone(), stop.clone(), prometheus.addr);
        tokio::spawn(async move {
            // Bounded: at most ten minutes of watching.
            for _ in 0..1200 {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Ok(r) =
                    http::request(addr, "GET", "/api/v1/alerts", &[], None, HTTP_TIMEOUT).await
                    && let Ok(body) = r.json()
                {
                    for a in body["data"]["alerts"].as_array().into_iter().flatten() {
                        let name = a["labels"]["alertname"].as_str().unwrap_or("");
                        if name.starts_with("Pgbox")
                            && (a["state"] == "firing" || name != "PgboxProcessDown")
                        {
                            seen.lock().unwrap().push(a.clone());
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };

    let mut paid = 0;
    for round in 0..3 {
        for _ in 0..10 {
            payments.pay_an_order().await;
            paid += 1;
        }
        match round {
            0 => {
                points.kill();
                points = on_queue("points", points_addr, &db.url(), &topic).await;
            }
            1 => {
                payments.kill();
                payments = on_queue("payments", payments_addr, &db.url(), &topic).await;
            }
            _ => {}
        }
    }
    // Every payment reaches the points ledger.
    let start = Instant::now();
    loop {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM svc_points.ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if n >= paid {
            break;
        }
        assert!(
            start.elapsed() < LIMIT,
            "{n} of {paid} payments in the ledger"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Scraped after the last restart, and some evaluations of settled state.
    prometheus
        .reaches(
            &format!("sum(pgbox_consumer_messages_processed_total{{topic=\"{topic}\"}})"),
            1.0,
        )
        .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    let names: BTreeSet<String> = seen
        .iter()
        .map(|a| {
            format!(
                "{} {} {}",
                a["labels"]["alertname"], a["state"], a["labels"]
            )
        })
        .collect();
    assert!(
        names.is_empty(),
        "alerts while every service was healthy or restarting: {names:#?}"
    );

    // The dashboard, on these label values.
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)).unwrap();
    let mut variables = std::collections::BTreeMap::new();
    for v in dashboard["templating"]["list"].as_array().unwrap() {
        let Some(definition) = v["definition"].as_str() else {
            continue;
        };
        let (selector, label) = definition
            .strip_prefix("label_values(")
            .and_then(|d| d.strip_suffix(')'))
            .and_then(|d| d.rsplit_once(','))
            .unwrap_or_else(|| panic!("variable query {definition}"));
        let values: BTreeSet<String> = prometheus
            .query(&format!(
                "group by ({label}) ({selector})",
                label = label.trim()
            ))
            .await
            .unwrap()
            .iter()
            .filter_map(|s| s["metric"][label.trim()].as_str().map(str::to_owned))
            .collect();
        variables.insert(v["name"].as_str().unwrap().to_owned(), values);
    }
    let expect = |name: &str, value: &str| {
        assert!(
            variables[name].contains(value),
            "variable {name} lacks {value}: {:?}",
            variables[name]
        );
    };
    expect("job", "payments");
    expect("job", "points");
    expect("schema", "svc_payments_pgbox");
    expect("schema", "svc_points_pgbox");
    // Not `broker`: the built-in queue's gauges exist only for topics that had messages
    // waiting (or dead letters) at a refresh since the process started; a service restarted
    // with an empty queue exports none, and that schema leaves the list (see the report of
    // this attack: a gauge per known topic at 0 would need `refresh_gauges` to know them).
    expect("topic", &topic);
    expect("consumer", "points-service");

    // Panels that must show data for these services, with each variable at the value an
    // operator picks for them (Grafana sends a multi-value pick as a regex group).
    let core = [
        ("Outbox backlog per topic", "svc_payments_pgbox"),
        ("Oldest unpublished message per topic", "svc_payments_pgbox"),
        ("Relay: published per second", "svc_payments_pgbox"),
        ("Relay: publish lag", "svc_payments_pgbox"),
        ("Relay: round duration", "svc_payments_pgbox"),
        ("Processed per second", "svc_points_pgbox"),
        ("Handler duration", "svc_points_pgbox"),
        ("End-to-end lag", "svc_points_pgbox"),
        ("Inbox rows", "svc_points_pgbox"),
        ("Leases", "svc_points_pgbox"),
    ];
    let mut empty = Vec::new();
    let mut panels: Vec<&Value> = Vec::new();
    for p in dashboard["panels"].as_array().unwrap() {
        panels.push(p);
        panels.extend(p["panels"].as_array().into_iter().flatten());
    }
    for (title, schema) in core {
        let panel = panels
            .iter()
            .find(|p| p["title"] == title)
            .unwrap_or_else(|| panic!("no panel {title:?}"));
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let job = if schema == "svc_payments_pgbox" {
                "payments"
            } else {
                "points"
            };
            let q = expr
                .replace("$__rate_interval", "1m")
                .replace("$job", &format!("({job})"))
                .replace("$schema", &format!("({schema})"))
                .replace("$topic", &format!("({})", regex_quote(&topic)))
                .replace("$consumer", "(points-service)");
            match prometheus.query(&q).await {
                Ok(r) if !r.is_empty() => {}
                Ok(_) => empty.push(format!("{title}: {q} returned nothing")),
                Err(e) => empty.push(format!("{title}: {q}: {e}")),
            }
        }
    }
    assert!(empty.is_empty(), "{}", empty.join("\n"));
}

/// The waiting threshold `a_hung_handler_fires_queue_waiting_too_long_and_resolves` gives the
/// rule in place of the shipped 300 s.
const WAITING_THRESHOLD_SECS: u64 = 15;

/// The points service's handler hangs (a test session holds an exclusive lock on the ledger
/// it writes) while a payment waits in the built-in queue: the consumer processes nothing
/// and reports no error. PgboxQueueMessagesWaitingTooLong fires once the message has waited
/// over its threshold and resolves when the handler is released and the message is
/// processed. The shipped threshold (5 minutes, `for: 5m`) is checked on the rule engine by
/// `pgbox-alerts.test.yml`; here the same rule runs with `for: 0s` and a threshold of
/// `WAITING_THRESHOLD_SECS`, so that the live metric's part (the age grows while nothing is
/// consumed, then falls) costs seconds of CI, not five minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_handler_fires_queue_waiting_too_long_and_resolves() {
    let db = TestDb::empty().await;
    let topic = format!("attack-ops-{}", uuid::Uuid::now_v7().simple());
    let points = on_queue("points", free_port(), &db.url(), &topic).await;
    let payments = on_queue("payments", free_port(), &db.url(), &topic).await;
    let shipped = "max by (schema, topic) (pgbox_queue_oldest_age_seconds) > 300";
    let rules = rules_without_for(&["PgboxProcessDown"]);
    assert!(
        rules.contains(shipped),
        "the shipped PgboxQueueMessagesWaitingTooLong expression changed: update this test"
    );
    let rules = rules.replace(
        shipped,
        &format!(
            "max by (schema, topic) (pgbox_queue_oldest_age_seconds) > {WAITING_THRESHOLD_SECS}"
        ),
    );
    let prometheus = Prometheus::start(
        &rules,
        &[("payments", payments.addr), ("points", points.addr)],
    )
    .await;
    let labels = |a: &Value| {
        a["labels"]["alertname"] == "PgboxQueueMessagesWaitingTooLong"
            && a["labels"]["schema"] == "broker"
            && a["labels"]["topic"] == topic.as_str()
    };

    let mut lock = db.connect().await;
    sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
    sqlx::query("LOCK TABLE svc_points.ledger IN ACCESS EXCLUSIVE MODE")
        .execute(&mut lock)
        .await
        .unwrap();
    let hung_at = Instant::now();
    payments.pay_an_order().await;

    // The threshold's wait, then a scrape and an evaluation or two (both every second).
    let limit = Duration::from_secs(WAITING_THRESHOLD_SECS + 60);
    loop {
        let active = prometheus.active().await;
        if active.iter().any(|a| labels(a) && a["state"] == "firing") {
            break;
        }
        assert!(
            hung_at.elapsed() < limit,
            "the handler has hung for {limit:?} with a message waiting and \
             PgboxQueueMessagesWaitingTooLong did not fire; active: {active:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(
        hung_at.elapsed() >= Duration::from_secs(WAITING_THRESHOLD_SECS),
        "fired after {:?}, before the message had waited {WAITING_THRESHOLD_SECS} s",
        hung_at.elapsed()
    );

    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();
    let start = Instant::now();
    loop {
        let active = prometheus.active().await;
        if !active.iter().any(labels) {
            break;
        }
        assert!(
            start.elapsed() < LIMIT,
            "still active {LIMIT:?} after the handler was released: {active:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM svc_points.ledger")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "the waiting payment was processed once released");
}

/// `s` as a literal inside a Prometheus regex (Grafana escapes a picked value the same way).
fn regex_quote(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}
