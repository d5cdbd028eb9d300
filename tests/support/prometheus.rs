//! The operations kit under test (`ops/`) on a real Prometheus: finding (or installing)
//! prometheus and promtool, a private Prometheus per test that scrapes and evaluates every
//! second, its HTTP API (queries, alerts, waiting for an alert to fire or resolve), and the
//! payment services example (`examples/payment_services/`) run as the processes it scrapes.
//!
//! Prometheus and promtool come from PATH; when they are missing and the tests run as root,
//! from Debian's `prometheus` package (installed once; the service the package starts is
//! stopped and disabled). Otherwise the tests fail and say what to install.

use std::collections::BTreeSet;
use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{apt_install, example_path, http, local_pg};

/// The shipped alerting rules.
pub const RULES: &str = "ops/prometheus/pgbox-alerts.yml";
/// The shipped Grafana dashboard.
pub const DASHBOARD: &str = "ops/grafana/pgbox-dashboard.json";

/// The longest wait for anything to happen: a scrape, an alert, a service start.
pub const LIMIT: Duration = Duration::from_secs(90);
/// The longest wait for one HTTP request.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// The start of the name of every directory and log file these tests create in the temporary
/// directory; it also tells the tests' own Prometheus processes from a packaged one.
pub const PRIVATE_DIR_PREFIX: &str = "pgbox-ops-tests-";

/// `path` (relative to the repository) as an absolute path.
pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The text of the repository's file `path`.
pub fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A free TCP address on the loopback interface.
pub fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

// --- the tools -------------------------------------------------------------------------------

/// Where prometheus and promtool are.
pub struct Tools {
    /// The Prometheus server.
    pub prometheus: PathBuf,
    /// Prometheus's command-line tool (rule checks and rule unit tests).
    pub promtool: PathBuf,
}

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// Prometheus and promtool: from PATH, else installed from Debian's `prometheus` package when
/// running as root; panics with what to do otherwise.
pub fn tools() -> &'static Tools {
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
    let before = packaged_prometheus_pids();
    let present = || on_path("prometheus").is_some() && on_path("promtool").is_some();
    if !apt_install("prometheus", present) {
        return;
    }
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

/// The shipped rules with every `for:` set to 0s except those of the alerts named in `keep`:
/// an alert fires at the first evaluation its expression holds, so a test sees in seconds
/// what would fire minutes later; the expressions, labels and annotations are unchanged.
pub fn rules_without_for(keep: &[&str]) -> String {
    let mut current = String::new();
    let mut changed = 0;
    let text: Vec<String> = read(RULES)
        .lines()
        .map(|line| {
            if let Some(name) = line.trim().strip_prefix("- alert: ") {
                current = name.trim().to_owned();
            }
            match line.trim_start().strip_prefix("for: ") {
                Some(_) if !keep.contains(&current.as_str()) => {
                    changed += 1;
                    let indent = &line[..line.len() - line.trim_start().len()];
                    format!("{indent}for: 0s")
                }
                _ => line.to_owned(),
            }
        })
        .collect();
    assert!(changed > 0, "no `for:` found in {RULES}");
    text.join("\n") + "\n"
}

// --- a private Prometheus ------------------------------------------------------------------

/// A Prometheus of one test: its own data directory, a free port, scraping and evaluating
/// every second. Killed, and its directory removed, when dropped.
pub struct Prometheus {
    child: Child,
    /// Where its HTTP API listens.
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Prometheus {
    /// Starts Prometheus with `rules` (the text of a rules file) and a job per
    /// `(name, address)` in `targets`; returns once it is ready.
    pub async fn start(rules: &str, targets: &[(&str, SocketAddr)]) -> Prometheus {
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

    /// What Prometheus has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` of the HTTP API: the HTTP status and the JSON body.
    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = http::request(self.addr, "GET", path, &[], None, HTTP_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("prometheus GET {path}: {e}"));
        let body = r
            .json()
            .unwrap_or_else(|e| panic!("prometheus GET {path}: {e}: {}", r.text()));
        (r.status, body)
    }

    /// An instant query: the result vector, or Prometheus's error (status and message).
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
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

    /// Every active (pending or firing) alert.
    async fn all_alerts(&self) -> Vec<Value> {
        let (status, body) = self.get("/api/v1/alerts").await;
        assert_eq!(status, 200, "{body}");
        body["data"]["alerts"].as_array().unwrap().clone()
    }

    /// The active (pending or firing) alerts named `name` whose labels include `labels`.
    pub async fn alerts(&self, name: &str, labels: &[(&str, &str)]) -> Vec<Value> {
        let mut alerts = self.all_alerts().await;
        alerts.retain(|a| {
            a["labels"]["alertname"] == name && labels.iter().all(|(k, v)| a["labels"][*k] == *v)
        });
        alerts
    }

    /// Every active (pending or firing) pgbox alert.
    pub async fn active(&self) -> Vec<Value> {
        let mut alerts = self.all_alerts().await;
        alerts.retain(|a| {
            a["labels"]["alertname"]
                .as_str()
                .is_some_and(|n| n.starts_with("Pgbox"))
        });
        alerts
    }

    /// Waits (at most [`LIMIT`]) until an alert `name` with `labels` is firing; returns it.
    pub async fn firing(&self, name: &str, labels: &[(&str, &str)]) -> Value {
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
    pub async fn resolved(&self, name: &str, labels: &[(&str, &str)]) {
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
    pub async fn reaches(&self, expr: &str, min: f64) {
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

// --- the example's services -------------------------------------------------------------------

/// One of the payment services example's services, SIGKILLed when dropped (its log printed
/// if the test failed).
pub struct Service {
    child: Child,
    /// Where its HTTP API (and `/metrics`) listens.
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Service {
    /// Starts `payment_services <which> --listen <addr> <args>` on `database_url` and waits
    /// until `/health/ready` answers 200.
    pub async fn start(
        which: &str,
        addr: SocketAddr,
        database_url: &str,
        args: &[&str],
    ) -> Service {
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

    /// What the service has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, as the demo does.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `POST path` with an `Idempotency-Key`; panics unless the status is 2xx; the JSON body.
    pub async fn post(&self, path: &str, key: &str, body: Option<&Value>) -> Value {
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

    /// Creates an order and pays it: a `PaymentSucceeded` in the payments outbox.
    pub async fn pay_an_order(&self) {
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
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- service log ---\n{}", self.log());
        }
        let _ = std::fs::remove_file(&self.log);
    }
}
