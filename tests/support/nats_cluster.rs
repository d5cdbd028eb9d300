//! A private NATS cluster with JetStream for tests that kill brokers: three (or more)
//! `nats-server` processes on loopback, on free ports, routed to each other, their stores
//! under a fresh temporary directory. Never the shared server on 127.0.0.1:4222.
//!
//! [`NatsCluster::start`] returns once every node answers and agrees on a JetStream meta
//! leader. [`NatsCluster::kill`] SIGKILLs a node (a crash: no shutdown, no leader
//! hand-over), [`NatsCluster::restart`] starts it again on its ports and store. Every node
//! is killed on drop; the directory (configurations, logs, stores) is removed, or kept and
//! named when the test is panicking.

use std::fs::OpenOptions;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const NATS_SERVER: &str = "/usr/sbin/nats-server";

/// One node of a [`NatsCluster`].
pub struct Node {
    /// Its server name (`n1`, `n2`, ...), as JetStream reports leaders and peers.
    pub name: String,
    /// The client port.
    pub port: u16,
    /// The monitoring (HTTP) port.
    pub http_port: u16,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Node {
    /// The node's client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Whether the process is running (started and not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

/// A throwaway NATS cluster; see the module docs.
pub struct NatsCluster {
    dir: PathBuf,
    /// The nodes, in the order of their names.
    pub nodes: Vec<Node>,
}

/// Free local TCP ports, all bound at once (so they differ), then released.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local address").port())
        .collect()
}

/// GET `path` from the monitoring port `port` as JSON; `None` when the node does not answer
/// (within 2 s) or the body is not JSON.
pub async fn monitor(port: u16, path: &str) -> Option<serde_json::Value> {
    let fetch = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        let text = String::from_utf8_lossy(&response);
        let (_, body) = text.split_once("\r\n\r\n")?;
        serde_json::from_str(body).ok()
    };
    tokio::time::timeout(Duration::from_secs(2), fetch)
        .await
        .ok()
        .flatten()
}

impl NatsCluster {
    /// Starts `size` nodes and waits (up to 30 s) until the cluster is ready; panics
    /// otherwise, with the nodes' logs.
    pub async fn start(size: usize) -> NatsCluster {
        assert!(
            std::path::Path::new(NATS_SERVER).exists(),
            "{NATS_SERVER} is not installed (Debian package `nats-server`)"
        );
        let dir = std::env::temp_dir().join(format!(
            "pgbox-nats-cluster-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir).expect("create the cluster directory");
        let ports = free_ports(3 * size);
        let route_ports: Vec<u16> = (0..size).map(|i| ports[3 * i + 1]).collect();
        let routes = route_ports
            .iter()
            .map(|p| format!("nats-route://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut nodes = Vec::new();
        for i in 0..size {
            let name = format!("n{}", i + 1);
            let (port, route_port, http_port) = (ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]);
            let store = dir.join(format!("{name}-store"));
            let config = dir.join(format!("{name}.conf"));
            std::fs::write(
                &config,
                format!(
                    "server_name: {name}\n\
                     listen: 127.0.0.1:{port}\n\
                     http: 127.0.0.1:{http_port}\n\
                     jetstream {{ store_dir: \"{}\" }}\n\
                     cluster {{\n  name: pgbox-test\n  listen: 127.0.0.1:{route_port}\n  \
                     routes: [{routes}]\n}}\n",
                    store.display()
                ),
            )
            .expect("write a node's configuration");
            nodes.push(Node {
                log: dir.join(format!("{name}.log")),
                name,
                port,
                http_port,
                config,
                child: None,
            });
        }
        let mut cluster = NatsCluster { dir, nodes };
        for i in 0..size {
            cluster.spawn(i);
        }
        eprintln!(
            "nats cluster: {} nodes in {} ({})",
            size,
            cluster.dir.display(),
            cluster.urls()
        );
        cluster.wait_ready(Duration::from_secs(30)).await;
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        assert!(node.child.is_none(), "{} is already running", node.name);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .expect("open a node's log");
        let child = Command::new(NATS_SERVER)
            .arg("-c")
            .arg(&node.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {NATS_SERVER} for {}: {e}", node.name));
        node.child = Some(child);
    }

    /// Every node's client URL, comma-separated (what `Nats::builder` takes).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(Node::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The index of the node named `name`.
    pub fn index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node named {name}"))
    }

    /// SIGKILLs node `name` and reaps it.
    pub fn kill(&mut self, name: &str) {
        let i = self.index(name);
        let mut child = self.nodes[i]
            .child
            .take()
            .unwrap_or_else(|| panic!("{name} is not running"));
        child.kill().expect("SIGKILL a node"); // std's kill is SIGKILL on Unix
        child.wait().expect("reap a node");
    }

    /// Starts node `name` again (same ports, same store) and waits (up to 30 s) until the
    /// cluster is ready again with it.
    pub async fn restart(&mut self, name: &str) {
        let i = self.index(name);
        self.spawn(i);
        self.wait_ready(Duration::from_secs(30)).await;
    }

    /// Waits until every running node answers its monitoring port and they all name the same
    /// JetStream meta leader of a cluster of every node; panics after `limit` with the
    /// nodes' last answers and logs.
    pub async fn wait_ready(&self, limit: Duration) {
        let start = Instant::now();
        let mut last = Vec::new();
        loop {
            last.clear();
            let mut leaders = Vec::new();
            for node in self.nodes.iter().filter(|n| n.is_running()) {
                let jsz = monitor(node.http_port, "/jsz").await;
                let meta = jsz.as_ref().and_then(|j| j.get("meta_cluster"));
                let leader = meta
                    .and_then(|m| m.get("leader"))
                    .and_then(|l| l.as_str())
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned);
                let size = meta
                    .and_then(|m| m.get("cluster_size"))
                    .and_then(|s| s.as_u64())
                    .unwrap_or(0);
                let healthy = monitor(node.http_port, "/healthz")
                    .await
                    .and_then(|h| h.get("status").and_then(|s| s.as_str().map(str::to_owned)))
                    .is_some_and(|s| s == "ok");
                last.push(format!(
                    "{}: leader {leader:?}, cluster size {size}, healthz ok {healthy}",
                    node.name
                ));
                leaders.push((leader, size as usize >= self.nodes.len() && healthy));
            }
            let first = leaders.first().and_then(|(l, _)| l.clone());
            if first.is_some() && leaders.iter().all(|(l, ok)| *ok && *l == first) {
                return;
            }
            if start.elapsed() > limit {
                panic!(
                    "the NATS cluster was not ready within {limit:?}:\n{}\n{}",
                    last.join("\n"),
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines of every node's log.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for node in &self.nodes {
            let text = std::fs::read_to_string(&node.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {} ---\n", node.name));
            for line in &lines[lines.len().saturating_sub(20)..] {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if std::thread::panicking() {
            eprintln!(
                "keeping the NATS cluster's directory {}",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The server name of the leader of `stream`, from the stream's info (`cluster.leader`),
/// waiting (up to `limit`) while there is none; panics after that.
pub async fn stream_leader(
    js: &async_nats::jetstream::Context,
    stream: &str,
    limit: Duration,
) -> String {
    let start = Instant::now();
    loop {
        let last = match js.get_stream(stream).await {
            Ok(mut s) => match s.info().await {
                Ok(info) => match info.cluster.as_ref().and_then(|c| c.leader.clone()) {
                    Some(leader) if !leader.is_empty() => return leader,
                    _ => "no leader".to_owned(),
                },
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        assert!(
            start.elapsed() < limit,
            "stream {stream} has no leader after {limit:?}: {last}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
