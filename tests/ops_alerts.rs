//! The operations kit in `ops/`: the Prometheus alerting rules pass `promtool check rules`
//! and their unit tests; every rule says what to do; the rules and the Grafana dashboard use
//! only metrics pgbox exports, and every dashboard query parses on a real Prometheus; and on
//! a real Prometheus that scrapes the payment services example (`examples/payment_services/`,
//! built by `cargo test`), alerts fire when their condition is made true for real: a broker
//! outage behind the relay, a poison message dead-lettered by the consumer.
//!
//! Prometheus and promtool come from PATH; when they are missing and the tests run as root,
//! from Debian's `prometheus` package (installed once; the service the package starts is
//! stopped and disabled). Otherwise the tests fail and say what to install.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::{Duration, Instant};

use pgbox::Envelope;
use pgbox::transport::{PgQueue, Publisher};
use serde_json::Value;
use support::TestDb;
use support::brokers::{self, Proxy};
use support::prometheus::{
    DASHBOARD, LIMIT, Prometheus, RULES, Service, free_port, read, repo, rules_without_for, tools,
};

const RULE_TESTS: &str = "ops/prometheus/pgbox-alerts.test.yml";

// --- promtool --------------------------------------------------------------------------------

fn promtool(args: &[&str]) -> String {
    let out = Command::new(&tools().promtool)
        .args(args)
        .current_dir(repo("ops/prometheus"))
        .output()
        .unwrap_or_else(|e| panic!("promtool {args:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

// --- what pgbox exports ------------------------------------------------------------------------

/// Every metric name pgbox exports (the constants of src/telemetry.rs), and the series names
/// a Prometheus exporter makes of them (histograms: `_bucket`, `_sum`, `_count`).
fn exported_series() -> BTreeSet<String> {
    let source = include_str!("../src/telemetry.rs");
    let names: BTreeSet<String> = source
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub const "))
        .filter_map(|l| l.split_once(": &str = \"")?.1.strip_suffix("\";"))
        .map(str::to_owned)
        .collect();
    assert!(
        names.len() > 30,
        "read only {names:?} from src/telemetry.rs"
    );
    let histograms = [
        pgbox::telemetry::CONSUMER_HANDLER_DURATION,
        pgbox::telemetry::CONSUMER_RECEIVE_LAG,
        pgbox::telemetry::RELAY_ROUND_DURATION,
        pgbox::telemetry::RELAY_PUBLISH_LAG,
        pgbox::telemetry::WAL_RELAY_PUBLISH_LAG,
        pgbox::telemetry::INBOX_CLAIM_DURATION,
    ];
    let mut series = names.clone();
    for h in histograms {
        assert!(names.contains(h), "{h} is not in src/telemetry.rs");
        for suffix in ["_bucket", "_sum", "_count"] {
            series.insert(format!("{h}{suffix}"));
        }
    }
    series
}

/// The `pgbox_...` metric names an expression selects (outside quoted strings, so that a
/// matcher such as `__name__=~"pgbox_.+"` is not taken for a name).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut unquoted = String::new();
    let mut quoted = false;
    let mut escaped = false;
    for c in expr.chars() {
        match (quoted, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => quoted = !quoted,
            (false, _, c) => unquoted.push(c),
            _ => {}
        }
    }
    unquoted
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("pgbox_"))
        .map(str::to_owned)
        .collect()
}

// --- the rules -------------------------------------------------------------------------------

/// The alert names of the shipped rules, in file order.
fn alert_names() -> Vec<String> {
    let names: Vec<String> = read(RULES)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|n| n.trim().to_owned())
        .collect();
    assert!(!names.is_empty(), "no alert in {RULES}");
    names
}

#[test]
fn shipped_rules_pass_promtool_check_and_their_unit_tests() {
    let checked = promtool(&["check", "rules", "pgbox-alerts.yml"]);
    let names = alert_names();
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", names.len())),
        "{checked}"
    );
    let tested = promtool(&["test", "rules", "pgbox-alerts.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");

    // Every alert has a case where it fires and one where it does not: per `alertname:` of
    // an alert_rule_test, whether its `exp_alerts` is `[]`.
    let mut cases: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in read(RULE_TESTS).lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname: ") {
            current = Some(name.trim().to_owned());
        } else if let Some(rest) = line.strip_prefix("exp_alerts:") {
            let name = current.take().expect("exp_alerts without an alertname");
            let entry = cases.entry(name).or_default();
            if rest.trim() == "[]" {
                entry.1 += 1;
            } else {
                entry.0 += 1;
            }
        }
    }
    for name in &names {
        let (firing, silent) = cases.get(name).copied().unwrap_or_default();
        assert!(
            firing > 0 && silent > 0,
            "{name}: {firing} firing and {silent} silent cases in {RULE_TESTS}; both are needed"
        );
    }
    let unknown: Vec<&String> = cases.keys().filter(|n| !names.contains(n)).collect();
    assert!(unknown.is_empty(), "tests of unknown alerts: {unknown:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_says_what_to_do_and_selects_only_metrics_pgbox_exports() {
    let prometheus = Prometheus::start(&read(RULES), &[]).await;
    // Evaluated at least once each, so that their health is known.
    let start = Instant::now();
    let body = loop {
        let (status, body) = prometheus.get("/api/v1/rules").await;
        assert_eq!(status, 200, "{body}");
        let mut health = Vec::new();
        strings_under(&body, "health", &mut health);
        if !health.is_empty() && !health.contains(&"unknown") {
            break body;
        }
        assert!(
            start.elapsed() < LIMIT,
            "rules not evaluated after {LIMIT:?}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let exported = exported_series();
    let mut seen = Vec::new();
    for group in body["data"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let name = rule["name"].as_str().unwrap();
            assert_eq!(rule["type"], "alerting", "{name}: not an alerting rule");
            assert_eq!(
                rule["health"],
                "ok",
                "{name}: {}",
                rule["lastError"].as_str().unwrap_or("")
            );
            let severity = rule["labels"]["severity"].as_str().unwrap_or("");
            assert!(
                ["critical", "warning", "info"].contains(&severity),
                "{name}: severity {severity:?}"
            );
            for annotation in ["summary", "description"] {
                let text = rule["annotations"][annotation].as_str().unwrap_or("");
                assert!(text.len() > 20, "{name}: {annotation} {text:?}");
            }
            let query = rule["query"].as_str().unwrap();
            let names = metric_names(query);
            assert!(!names.is_empty(), "{name} selects no pgbox metric: {query}");
            for metric in names {
                assert!(
                    exported.contains(&metric),
                    "{name} selects {metric}, which pgbox does not export"
                );
            }
            seen.push(name.to_owned());
        }
    }
    // Groups come back in another order than the file's.
    seen.sort();
    let mut names = alert_names();
    names.sort();
    assert_eq!(
        seen, names,
        "Prometheus loaded other rules than the file has"
    );
}

// --- the dashboard ---------------------------------------------------------------------------

/// Every string under a key `key`, anywhere in `value`.
fn strings_under<'a>(value: &'a Value, key: &str, out: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                match v {
                    Value::String(s) if k == key => out.push(s),
                    _ => strings_under(v, key, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| strings_under(v, key, out)),
        _ => {}
    }
}

/// A dashboard query as Prometheus would get it from Grafana, every variable at "All".
fn as_grafana_sends(expr: &str) -> String {
    let mut q = expr.replace("$__rate_interval", "1m");
    for var in ["$job", "$schema", "$topic", "$consumer"] {
        q = q.replace(var, ".*");
    }
    assert!(!q.contains('$'), "an unknown variable in {expr}");
    q
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_parses_on_a_real_prometheus() {
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)).expect("dashboard JSON");
    assert!(
        dashboard["schemaVersion"].as_u64().unwrap_or(0) >= 36,
        "schemaVersion {}",
        dashboard["schemaVersion"]
    );
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        variables,
        ["datasource", "job", "schema", "topic", "consumer"]
    );

    // No hard-coded data source: every reference is the `datasource` variable (or Grafana's
    // own, for annotations).
    let mut uids = Vec::new();
    strings_under(&dashboard, "uid", &mut uids);
    for uid in uids {
        assert!(
            uid == "${datasource}" || uid == "-- Grafana --",
            "hard-coded uid {uid}"
        );
    }
    let panels = dashboard["panels"].as_array().unwrap();
    let ids: BTreeSet<u64> = panels.iter().map(|p| p["id"].as_u64().unwrap()).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids are not unique");

    let mut exprs = Vec::new();
    strings_under(&dashboard["panels"], "expr", &mut exprs);
    assert!(exprs.len() > 30, "only {} queries", exprs.len());
    // The variables' `label_values(selector, label)`: the selector must parse too.
    let mut definitions = Vec::new();
    strings_under(&dashboard["templating"], "definition", &mut definitions);
    let selectors: Vec<&str> = definitions
        .iter()
        .map(|d| {
            d.strip_prefix("label_values(")
                .and_then(|d| d.rsplit_once(','))
                .map(|(selector, _)| selector)
                .unwrap_or_else(|| panic!("variable query {d}"))
        })
        .collect();
    assert_eq!(selectors.len(), 4);

    let exported = exported_series();
    let prometheus = Prometheus::start(&read(RULES), &[]).await;
    let mut failures = Vec::new();
    for expr in exprs.iter().chain(&selectors) {
        for metric in metric_names(expr) {
            if !exported.contains(&metric) {
                failures.push(format!("{expr}: {metric} is not a metric pgbox exports"));
            }
        }
        if let Err(e) = prometheus.query(&as_grafana_sends(expr)).await {
            failures.push(format!("{expr}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// --- alerts firing for real --------------------------------------------------------------------

/// The payments service relays to RabbitMQ through a proxy; the proxy stops forwarding (a
/// broker outage as the relay sees it) and PgboxRelayTransportUnavailable fires for the
/// topic; the proxy forwards again and the alert resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_behind_the_relay_fires_transport_unavailable() {
    tools();
    let db = TestDb::empty().await;
    let rabbit = brokers::rabbitmq_url().await;
    let broker = brokers::address(&rabbit);
    let proxy = Proxy::start(broker).await;
    let topic = format!("ops-alerts-{}", uuid::Uuid::now_v7().simple());
    let payments = Service::start(
        "payments",
        free_port(),
        &db.url(),
        &[
            "--transport",
            "rabbitmq",
            "--broker-url",
            &brokers::with_address(&rabbit, proxy.addr()),
            "--topic",
            &topic,
            // The shared broker drops this run's queue an hour after it is last used.
            "--broker-expires-secs",
            "3600",
        ],
    )
    .await;
    let prometheus =
        Prometheus::start(&rules_without_for(&[]), &[("payments", payments.addr)]).await;
    let labels = [("job", "payments"), ("topic", topic.as_str())];

    // While the broker answers: published, and no alert.
    payments.pay_an_order().await;
    prometheus
        .reaches(
            &format!("pgbox_relay_messages_published_total{{topic=\"{topic}\"}}"),
            1.0,
        )
        .await;
    let active = prometheus
        .alerts("PgboxRelayTransportUnavailable", &labels)
        .await;
    assert!(active.is_empty(), "before the outage: {active:?}");

    // The outage: new connections go to a closed port, open ones are cut.
    let closed = free_port();
    proxy.retarget(closed);
    proxy.cut();
    payments.pay_an_order().await;
    let alert = prometheus
        .firing("PgboxRelayTransportUnavailable", &labels)
        .await;
    assert_eq!(alert["labels"]["severity"], "warning", "{alert}");
    let summary = alert["annotations"]["summary"].as_str().unwrap();
    assert!(summary.contains(&topic), "{summary}");
    prometheus
        .reaches(
            &format!("pgbox_relay_publish_unavailable_total{{topic=\"{topic}\"}}"),
            1.0,
        )
        .await;

    // The broker is back: the waiting message is published and the alert resolves.
    proxy.retarget(broker);
    prometheus
        .reaches(
            &format!("pgbox_relay_messages_published_total{{topic=\"{topic}\"}}"),
            2.0,
        )
        .await;
    prometheus
        .resolved("PgboxRelayTransportUnavailable", &labels)
        .await;
}

/// A message the points service's handler cannot decode is dead-lettered after its
/// deliveries: PgboxConsumerDeadLettered and PgboxQueueDeadLetters fire; discarding the dead
/// letter (what the alert says to do) resolves PgboxQueueDeadLetters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_fires_the_dead_letter_alerts() {
    tools();
    let db = TestDb::empty().await;
    let topic = format!("ops-alerts-{}", uuid::Uuid::now_v7().simple());
    let points = Service::start(
        "points",
        free_port(),
        &db.url(),
        &["--transport", "postgres", "--topic", &topic],
    )
    .await;
    let prometheus = Prometheus::start(&rules_without_for(&[]), &[("points", points.addr)]).await;
    let consumer = [
        ("job", "points"),
        ("consumer", "points-service"),
        ("topic", topic.as_str()),
    ];
    let queue = [("schema", "broker"), ("topic", topic.as_str())];

    // The runner's counters are scraped (at 0) before anything goes wrong; no alert.
    prometheus
        .reaches(
            &format!("pgbox_consumer_messages_dead_lettered_total{{topic=\"{topic}\"}} + 1"),
            1.0,
        )
        .await;
    for (name, labels) in [
        ("PgboxConsumerDeadLettered", &consumer[..]),
        ("PgboxQueueDeadLetters", &queue[..]),
    ] {
        let active = prometheus.alerts(name, labels).await;
        assert!(
            active.is_empty(),
            "{name} before the poison message: {active:?}"
        );
    }

    // The poison: not JSON, so the handler fails on every delivery.
    let poison = Envelope::new(uuid::Uuid::now_v7(), topic.clone(), b"not json".to_vec());
    let queue_publisher = PgQueue::with_schema(db.pool.clone(), "broker").unwrap();
    for result in queue_publisher.publish(std::slice::from_ref(&poison)).await {
        result.unwrap();
    }

    let alert = prometheus
        .firing("PgboxConsumerDeadLettered", &consumer)
        .await;
    assert_eq!(alert["labels"]["severity"], "warning", "{alert}");
    let alert = prometheus.firing("PgboxQueueDeadLetters", &queue).await;
    assert!(
        alert["annotations"]["description"]
            .as_str()
            .unwrap()
            .contains("dead-letters --queue"),
        "{alert}"
    );

    // Discarded, as the alert says: PgboxQueueDeadLetters resolves.
    let out = Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(["--schema", "broker", "dead-letters", "--queue", "discard"])
        .arg(poison.id.to_string())
        .env("DATABASE_URL", db.url())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pgbox dead-letters --queue discard: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    prometheus.resolved("PgboxQueueDeadLetters", &queue).await;
}
