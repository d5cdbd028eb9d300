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

#[allow(dead_code)]
#[path = "../examples/payment_services/http.rs"]
mod http;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pgbox::Envelope;
use pgbox::transport::{PgQueue, Publisher};
use serde_json::{Value, json};
use support::brokers::{self, Proxy};
use support::{TestDb, local_pg};

const RULES: &str = "ops/prometheus/pgbox-alerts.yml";
const RULE_TESTS: &str = "ops/prometheus/pgbox-alerts.test.yml";
const DASHBOARD: &str = "ops/grafana/pgbox-dashboard.json";

/// The longest wait for anything to happen: a scrape, an alert, a service start.
const LIMIT: Duration = Duration::from_secs(90);
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

// --- the tools -------------------------------------------------------------------------------

struct Tools {
    prometheus: PathBuf,
    promtool: PathBuf,
}

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// Prometheus and promtool: from PATH, else installed from Debian's `prometheus` package when
/// running as root; panics with what to do otherwise.
fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS.get_or_init(|| {
        if on_path("prometheus").is_none() || on_path("promtool").is_none() {
            install_prometheus();
        }
        let find = |program| {
            on_path(program).unwrap_or_else(|| {
                panic!("{program} is still not on PATH after installing the prometheus package")
            })
        };
        Tools {
            prometheus: find("prometheus"),
            promtool: find("promtool"),
        }
    })
}

/// PIDs of running `/usr/bin/prometheus` processes that are not one of these tests' own.
fn packaged_prometheus_pids() -> BTreeSet<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return BTreeSet::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            exe.is_some_and(|e| e == Path::new("/usr/bin/prometheus"))
                && !String::from_utf8_lossy(&cmdline).contains(PRIVATE_DIR_PREFIX)
        })
        .collect()
}

fn install_prometheus() {
    assert!(
        local_pg::is_root(),
        "prometheus and promtool are not on PATH and only root can install them: \
         `apt-get install prometheus` (Debian's package, 2.42 or later), or put both on PATH"
    );
    // One apt at a time across test binaries (the lock the other installers take).
    let lock = File::create(std::env::temp_dir().join("pgbox-apt.lock")).unwrap();
    lock.lock().unwrap();
    if on_path("prometheus").is_some() && on_path("promtool").is_some() {
        return;
    }
    let before = packaged_prometheus_pids();
    eprintln!("pgbox tests: installing Debian's prometheus package with apt-get");
    let install = |update: bool| {
        if update {
            let _ = local_pg::run(Command::new("apt-get").args(["update", "-q"]));
        }
        local_pg::run(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args([
                    "install",
                    "-y",
                    "-q",
                    "--no-install-recommends",
                    "prometheus",
                ]),
        )
    };
    install(false)
        .or_else(|_| install(true))
        .unwrap_or_else(|e| panic!("apt-get install prometheus: {e}"));
    // The package enables a service on :9090 and may have started it: the tests run their
    // own. Disabled where an init system manages it; a process the install started is
    // stopped, and nothing else.
    if Path::new("/run/systemd/system").exists() {
        let _ = local_pg::run(Command::new("systemctl").args(["disable", "--now", "prometheus"]));
    } else if on_path("update-rc.d").is_some() {
        let _ = local_pg::run(Command::new("update-rc.d").args(["prometheus", "disable"]));
    }
    for pid in packaged_prometheus_pids().difference(&before) {
        eprintln!("pgbox tests: stopping the prometheus (pid {pid}) the package started");
        let _ = Command::new("kill").arg(pid.to_string()).status();
    }
}

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

// --- a private Prometheus ------------------------------------------------------------------

const PRIVATE_DIR_PREFIX: &str = "pgbox-ops-alerts-";

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A Prometheus of one test: its own data directory, a free port, scraping and evaluating
/// every second. Killed, and its directory removed, when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Prometheus {
    /// Starts Prometheus with `rules` (the text of a rules file) and a job per
    /// `(name, address)` in `targets`; returns once it is ready.
    async fn start(rules: &str, targets: &[(&str, SocketAddr)]) -> Prometheus {
        let dir = std::env::temp_dir().join(format!(
            "{PRIVATE_DIR_PREFIX}{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(dir.join("data")).unwrap();
        std::fs::write(dir.join("rules.yml"), rules).unwrap();
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\nscrape_configs:\n",
            dir.join("rules.yml").display()
        );
        for (job, target) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            ));
        }
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let addr = free_port();
        let log = File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(&tools().prometheus)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--storage.tsdb.retention.time=1h")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {:?}: {e}", tools().prometheus));
        let mut prometheus = Prometheus { child, addr, dir };
        let start = Instant::now();
        loop {
            if let Some(status) = prometheus.child.try_wait().unwrap() {
                panic!(
                    "prometheus exited at start ({status}):\n{}",
                    prometheus.log()
                );
            }
            if let Ok(r) = http::request(addr, "GET", "/-/ready", &[], None, HTTP_TIMEOUT).await
                && r.status == 200
            {
                return prometheus;
            }
            assert!(
                start.elapsed() < LIMIT,
                "prometheus not ready after {LIMIT:?}:\n{}",
                prometheus.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` of the HTTP API: the HTTP status and the JSON body.
    async fn get(&self, path: &str) -> (u16, Value) {
        let r = http::request(self.addr, "GET", path, &[], None, HTTP_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("prometheus GET {path}: {e}"));
        let body = r
            .json()
            .unwrap_or_else(|e| panic!("prometheus GET {path}: {e}: {}", r.text()));
        (r.status, body)
    }

    /// An instant query: the result vector, or Prometheus's error (status and message).
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let q: String = url::form_urlencoded::byte_serialize(expr.as_bytes()).collect();
        let (status, body) = self.get(&format!("/api/v1/query?query={q}")).await;
        if status == 200 && body["status"] == "success" {
            Ok(body["data"]["result"]
                .as_array()
                .cloned()
                .unwrap_or_default())
        } else {
            Err(format!("{status}: {}", body["error"]))
        }
    }

    /// The active (pending or firing) alerts named `name` whose labels include `labels`.
    async fn alerts(&self, name: &str, labels: &[(&str, &str)]) -> Vec<Value> {
        let (status, body) = self.get("/api/v1/alerts").await;
        assert_eq!(status, 200, "{body}");
        body["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| {
                a["labels"]["alertname"] == name
                    && labels.iter().all(|(k, v)| a["labels"][*k] == *v)
            })
            .cloned()
            .collect()
    }

    /// Waits (at most [`LIMIT`]) until an alert `name` with `labels` is firing; returns it.
    async fn firing(&self, name: &str, labels: &[(&str, &str)]) -> Value {
        let start = Instant::now();
        loop {
            let alerts = self.alerts(name, labels).await;
            if let Some(a) = alerts.iter().find(|a| a["state"] == "firing") {
                return a.clone();
            }
            assert!(
                start.elapsed() < LIMIT,
                "{name} {labels:?} not firing after {LIMIT:?}; active: {alerts:?}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits (at most [`LIMIT`]) until no alert `name` with `labels` is active.
    async fn resolved(&self, name: &str, labels: &[(&str, &str)]) {
        let start = Instant::now();
        loop {
            let alerts = self.alerts(name, labels).await;
            if alerts.is_empty() {
                return;
            }
            assert!(
                start.elapsed() < LIMIT,
                "{name} {labels:?} still active after {LIMIT:?}: {alerts:?}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits (at most [`LIMIT`]) until `expr` has a sample of at least `min`.
    async fn reaches(&self, expr: &str, min: f64) {
        let start = Instant::now();
        loop {
            let result = self.query(expr).await.unwrap();
            let top = result
                .iter()
                .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
                .fold(f64::NEG_INFINITY, f64::max);
            if top >= min {
                return;
            }
            assert!(
                start.elapsed() < LIMIT,
                "{expr} below {min} after {LIMIT:?}: {result:?}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- prometheus log ---\n{}", self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The shipped rules with every `for:` set to 0s, so that an alert fires at the first
/// evaluation its expression holds: the expressions, labels and annotations are unchanged.
fn rules_without_for() -> String {
    let shipped = read(RULES);
    let mut changed = 0;
    let text: Vec<String> = shipped
        .lines()
        .map(|line| match line.trim_start().strip_prefix("for: ") {
            Some(_) => {
                changed += 1;
                let indent = &line[..line.len() - line.trim_start().len()];
                format!("{indent}for: 0s")
            }
            None => line.to_owned(),
        })
        .collect();
    assert!(changed > 0, "no `for:` found in {RULES}");
    text.join("\n") + "\n"
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

/// target/debug/examples/<name>, next to this test binary's directory.
fn example_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{path:?} not built (cargo test builds examples; or cargo build --example {name})"
    );
    path
}

/// One of the example's services, killed when dropped (its log printed if the test failed).
struct Service {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Service {
    /// Starts `payment_services <which> --listen <free port> <args>` on `database_url` and
    /// waits until `/health/ready` answers 200.
    async fn start(which: &str, database_url: &str, args: &[&str]) -> Service {
        let addr = free_port();
        let log = std::env::temp_dir().join(format!(
            "{PRIVATE_DIR_PREFIX}{which}-{}.log",
            uuid::Uuid::now_v7().simple()
        ));
        let file = File::create(&log).unwrap();
        let child = Command::new(example_path("payment_services"))
            .arg(which)
            .args(["--listen", &addr.to_string()])
            .args(args)
            .env("DATABASE_URL", database_url)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        let mut service = Service { child, addr, log };
        let start = Instant::now();
        loop {
            if let Some(status) = service.child.try_wait().unwrap() {
                panic!("{which} exited ({status}):\n{}", service.log());
            }
            if let Ok(r) =
                http::request(addr, "GET", "/health/ready", &[], None, HTTP_TIMEOUT).await
                && r.status == 200
            {
                return service;
            }
            assert!(
                start.elapsed() < LIMIT,
                "{which} not ready after {LIMIT:?}:\n{}",
                service.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn post(&self, path: &str, key: &str, body: Option<&Value>) -> Value {
        let r = http::request(
            self.addr,
            "POST",
            path,
            &[("Idempotency-Key", key)],
            body,
            HTTP_TIMEOUT,
        )
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        assert!(
            (200..300).contains(&r.status),
            "POST {path}: {} {}",
            r.status,
            r.text()
        );
        r.json().unwrap()
    }

    /// Creates an order and pays it: a `PaymentSucceeded` in the outbox.
    async fn pay_an_order(&self) {
        let key = uuid::Uuid::now_v7().to_string();
        let order = self
            .post(
                "/orders",
                &format!("create-{key}"),
                Some(&json!({"user_id": 1, "amount": 100})),
            )
            .await;
        let id = order["id"].as_i64().unwrap_or_else(|| panic!("{order}"));
        self.post(&format!("/orders/{id}/pay"), &format!("pay-{key}"), None)
            .await;
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- service log ---\n{}", self.log());
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

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
    let prometheus = Prometheus::start(&rules_without_for(), &[("payments", payments.addr)]).await;
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
        &db.url(),
        &["--transport", "postgres", "--topic", &topic],
    )
    .await;
    let prometheus = Prometheus::start(&rules_without_for(), &[("points", points.addr)]).await;
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
