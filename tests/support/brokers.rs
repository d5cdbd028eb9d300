//! Finds RabbitMQ and NATS (JetStream) for the tests, starting them if they are not running,
//! and a TCP proxy whose connections a test can cut.
//!
//! RabbitMQ: `RABBITMQ_URL` when set, else `amqp://guest:guest@127.0.0.1:5672/%2f`. NATS:
//! `NATS_URL` when set, else `nats://127.0.0.1:4222`. When the default address does not
//! answer, the broker is started from the distribution's package (installed with apt-get
//! when missing and we are root): `rabbitmq-server -detached`, and
//! `nats-server -js -a 127.0.0.1 -p 4222 -sd /tmp/pgbox-nats`. Both are left running for the
//! next test run. Several test binaries may get here at once; a file lock per broker makes
//! one of them start it while the others wait. A broker that cannot be brought up panics
//! with what was tried: a failed test, never a skipped one.

use std::fs::File;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OnceCell;
use tokio::task::AbortHandle;

const RABBITMQ_DEFAULT: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const NATS_DEFAULT: &str = "nats://127.0.0.1:4222";

static RABBITMQ: OnceCell<String> = OnceCell::const_new();
static NATS: OnceCell<String> = OnceCell::const_new();
static KAFKA: OnceCell<String> = OnceCell::const_new();

/// The URL of a running RabbitMQ (started if needed); panics if there is none.
pub async fn rabbitmq_url() -> String {
    RABBITMQ
        .get_or_init(|| async {
            find_or_start(Broker::RabbitMq)
                .await
                .unwrap_or_else(|e| panic!("no RabbitMQ for the tests: {e}"))
        })
        .await
        .clone()
}

/// The URL of a running NATS server with JetStream (started if needed); panics if there is
/// none.
pub async fn nats_url() -> String {
    NATS.get_or_init(|| async {
        find_or_start(Broker::Nats)
            .await
            .unwrap_or_else(|e| panic!("no NATS server for the tests: {e}"))
    })
    .await
    .clone()
}

/// The bootstrap address (`host:port`) of a running Kafka-protocol broker (started if
/// needed, see [`kafka`]); panics if there is none.
pub async fn kafka_url() -> String {
    KAFKA
        .get_or_init(|| async {
            find_or_start(Broker::Kafka)
                .await
                .unwrap_or_else(|e| panic!("no Kafka-protocol broker for the tests: {e}"))
        })
        .await
        .clone()
}

#[derive(Debug, Clone, Copy)]
enum Broker {
    RabbitMq,
    Nats,
    Kafka,
}

impl Broker {
    fn name(self) -> &'static str {
        match self {
            Broker::RabbitMq => "rabbitmq",
            Broker::Nats => "nats",
            Broker::Kafka => "kafka",
        }
    }
    fn env(self) -> &'static str {
        match self {
            Broker::RabbitMq => "RABBITMQ_URL",
            Broker::Nats => "NATS_URL",
            Broker::Kafka => "KAFKA_BOOTSTRAP",
        }
    }
    fn default_url(self) -> &'static str {
        match self {
            Broker::RabbitMq => RABBITMQ_DEFAULT,
            Broker::Nats => NATS_DEFAULT,
            Broker::Kafka => kafka::SHARED,
        }
    }
}

/// host:port of a broker URL.
pub fn address(url: &str) -> SocketAddr {
    if let Ok(addr) = url.parse() {
        // A Kafka bootstrap address is a bare host:port.
        return addr;
    }
    let parsed = url::Url::parse(url).unwrap_or_else(|e| panic!("bad broker URL {url}: {e}"));
    let host = parsed.host_str().expect("broker URL has a host");
    let port = parsed.port().unwrap_or(match parsed.scheme() {
        "amqp" => 5672,
        _ => 4222,
    });
    let host = if host == "localhost" {
        "127.0.0.1"
    } else {
        host
    };
    format!("{host}:{port}")
        .parse()
        .unwrap_or_else(|e| panic!("broker address {host}:{port}: {e}"))
}

/// `url` with its host and port replaced by `addr`.
pub fn with_address(url: &str, addr: SocketAddr) -> String {
    let mut parsed = url::Url::parse(url).expect("broker URL");
    parsed.set_host(Some(&addr.ip().to_string())).expect("host");
    parsed.set_port(Some(addr.port())).expect("port");
    parsed.to_string()
}

/// Whether the broker answers like itself: AMQP's protocol header is answered by
/// `connection.start`; NATS greets with `INFO`.
async fn answers(broker: Broker, addr: SocketAddr) -> bool {
    let probe = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        use tokio::io::AsyncWriteExt;
        match broker {
            Broker::RabbitMq => stream.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?,
            Broker::Kafka => stream.write_all(&kafka::API_VERSIONS).await.ok()?,
            Broker::Nats => {}
        }
        let mut buf = [0u8; 8];
        let n = stream.read(&mut buf).await.ok()?;
        Some(match broker {
            Broker::RabbitMq => n >= 1 && buf[0] == 1,
            Broker::Nats => buf[..n].starts_with(b"INFO"),
            // A response: length, then our correlation id.
            Broker::Kafka => n == 8 && buf[4..8] == kafka::API_VERSIONS[8..12],
        })
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(3), probe).await,
        Ok(Some(true))
    )
}

async fn find_or_start(broker: Broker) -> Result<String, String> {
    if let Ok(url) = std::env::var(broker.env())
        && !url.is_empty()
    {
        if answers(broker, address(&url)).await {
            return Ok(url);
        }
        return Err(format!("{}={url} does not answer", broker.env()));
    }
    let url = broker.default_url().to_owned();
    let addr = address(&url);
    if answers(broker, addr).await {
        return Ok(url);
    }
    let lock_path = format!("/tmp/pgbox-{}.lock", broker.name());
    let lock = File::create(&lock_path).map_err(|e| format!("create {lock_path}: {e}"))?;
    lock.lock().map_err(|e| format!("lock {lock_path}: {e}"))?;
    if answers(broker, addr).await {
        return Ok(url);
    }
    eprintln!(
        "pgbox: {} not reachable at {addr}; starting it",
        broker.name()
    );
    tokio::task::spawn_blocking(move || start(broker))
        .await
        .map_err(|e| e.to_string())??;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(90) {
        if answers(broker, addr).await {
            return Ok(url);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!(
        "started {}, but {addr} does not answer after 90 s",
        broker.name()
    ))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn installed(program: &str) -> bool {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/bin"]
        .iter()
        .any(|d| std::path::Path::new(d).join(program).exists())
}

fn ensure_package(program: &str, package: &str) -> Result<(), String> {
    if installed(program) {
        return Ok(());
    }
    if !is_root() {
        return Err(format!(
            "{program} is not installed: install the `{package}` package \
             (e.g. `sudo apt-get install {package}`), or set the URL variable"
        ));
    }
    eprintln!("pgbox: installing the {package} package with apt-get");
    run(Command::new("apt-get")
        .arg("update")
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends", package])
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn start(broker: Broker) -> Result<(), String> {
    match broker {
        Broker::RabbitMq => {
            ensure_package("rabbitmq-server", "rabbitmq-server")?;
            // A node of our own: its own name, data, logs and distribution port. Started
            // with the package's defaults it would be `rabbit@<host>` on
            // /var/lib/rabbitmq/mnesia, the same node and the same data as the machine's
            // own RabbitMQ (seen: a test run in another network namespace left the shared
            // broker unable to declare quorum queues until it was restarted).
            let dir = "/tmp/pgbox-rabbitmq";
            for sub in ["mnesia", "log"] {
                std::fs::create_dir_all(format!("{dir}/{sub}"))
                    .map_err(|e| format!("create {dir}/{sub}: {e}"))?;
            }
            std::fs::write(format!("{dir}/enabled_plugins"), "[].\n")
                .map_err(|e| format!("write {dir}/enabled_plugins: {e}"))?;
            if is_root() {
                run(Command::new("chown").args(["-R", "rabbitmq:rabbitmq", dir]))?;
            }
            run(Command::new("rabbitmq-server")
                .arg("-detached")
                .env("RABBITMQ_NODENAME", "pgbox-test@localhost")
                .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
                .env("RABBITMQ_NODE_PORT", "5672")
                .env("RABBITMQ_DIST_PORT", "25699")
                .env("RABBITMQ_MNESIA_BASE", format!("{dir}/mnesia"))
                .env("RABBITMQ_LOG_BASE", format!("{dir}/log"))
                .env("RABBITMQ_PID_FILE", format!("{dir}/pid"))
                .env(
                    "RABBITMQ_ENABLED_PLUGINS_FILE",
                    format!("{dir}/enabled_plugins"),
                ))
        }
        Broker::Kafka => {
            let tansu = kafka::tansu()?;
            let addr: SocketAddr = kafka::SHARED.parse().expect("address");
            kafka::spawn(&tansu, addr, addr, std::path::Path::new("/tmp/pgbox-kafka")).map(drop)
        }
        Broker::Nats => {
            ensure_package("nats-server", "nats-server")?;
            let dir = "/tmp/pgbox-nats";
            std::fs::create_dir_all(dir).map_err(|e| format!("create {dir}: {e}"))?;
            let log = File::create(format!("{dir}/server.log"))
                .map_err(|e| format!("create {dir}/server.log: {e}"))?;
            Command::new("nats-server")
                .args(["-js", "-a", "127.0.0.1", "-p", "4222", "-sd", dir])
                .stdin(Stdio::null())
                .stdout(log.try_clone().map_err(|e| e.to_string())?)
                .stderr(log)
                .spawn()
                .map(drop)
                .map_err(|e| format!("spawn nats-server: {e}"))
        }
    }
}

/// A TCP proxy in front of a broker (or a PostgreSQL server): clients connect to
/// [`Proxy::addr`]; [`Proxy::cut`] severs every connection made so far (both sides see the
/// socket close), as a network failure would. New connections keep working.
/// [`Proxy::retarget`] sends new connections elsewhere, as a virtual IP, a DNS name or
/// HAProxy does when a standby is promoted.
pub struct Proxy {
    addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
}

impl Proxy {
    /// A proxy to `target` on a free local port.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let target = Arc::new(Mutex::new(target));
        let conns = connections.clone();
        let current = target.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                let target = *current.lock().unwrap();
                let task = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                let mut conns = conns.lock().unwrap();
                conns.retain(|c| !c.is_finished());
                conns.push(task.abort_handle());
            }
        })
        .abort_handle();
        Proxy {
            addr,
            target,
            connections,
            accept,
        }
    }

    /// New connections go to `target` from now on; open ones stay where they are.
    pub fn retarget(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Severs every open connection; returns how many there were.
    pub fn cut(&self) -> usize {
        let conns: Vec<AbortHandle> = self.connections.lock().unwrap().drain(..).collect();
        let open = conns.iter().filter(|c| !c.is_finished()).count();
        for c in conns {
            c.abort();
        }
        open
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Outbox → relay → `publisher` → broker → `subscriber` → consumer → inbox for 1000
/// messages, in the migrated, otherwise empty database of `pool`, while `proxy` (which both
/// transports go through) cuts every connection five times as the messages flow. Asserts
/// each message took effect exactly once.
pub async fn pipeline_with_cuts<P, S>(
    pool: &sqlx::PgPool,
    publisher: P,
    subscriber: S,
    topic: &str,
    proxy: &Proxy,
) where
    P: pgbox::transport::Publisher + 'static,
    S: pgbox::transport::Subscriber + 'static,
{
    use pgbox::{CancellationToken, Consumer, Envelope, Inbox, Message, Outbox, Relay};
    use sqlx::Executor;

    const N: i64 = 1000;
    pool.execute("CREATE TABLE effects (message_id uuid NOT NULL)")
        .await
        .unwrap();
    let outbox = Outbox::new();
    for chunk in 0..(N / 100) {
        let mut tx = pool.begin().await.unwrap();
        let batch = (0..100).map(|i| {
            Message::json(topic, &serde_json::json!({ "n": chunk * 100 + i }))
                .unwrap()
                .ordering_key(format!("k{}", i % 7))
        });
        outbox.enqueue_batch(&mut tx, batch).await.unwrap();
        tx.commit().await.unwrap();
    }

    let shutdown = CancellationToken::new();
    let relay = Relay::builder(pool.clone(), publisher)
        .batch_size(50)
        .poll_interval(Duration::from_millis(50))
        .backoff(
            pgbox::RetryPolicy::new()
                .base_delay(Duration::from_millis(20))
                .max_delay(Duration::from_millis(200)),
        )
        .max_attempts(1000)
        .build()
        .unwrap();
    let consumer = Consumer::builder(
        pool.clone(),
        subscriber,
        topic.to_owned(),
        Inbox::new("effects").unwrap(),
    )
    .concurrency(8)
    .poll_interval(Duration::from_millis(10))
    .backoff(
        pgbox::RetryPolicy::new()
            .base_delay(Duration::from_millis(20))
            .max_delay(Duration::from_millis(200)),
    )
    .max_deliveries(1000)
    .build()
    .unwrap();
    let relay_task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    let consumer_task = tokio::spawn({
        let s = shutdown.clone();
        async move {
            consumer
                .run(
                    async |msg: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                        sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                            .bind(msg.id)
                            .execute(&mut *conn)
                            .await
                            .map_err(pgbox::Error::from)?;
                        Ok::<(), pgbox::Error>(())
                    },
                    s,
                )
                .await
        }
    });

    // Cut whenever another tenth has taken effect, while messages are in flight.
    let start = Instant::now();
    let mut cuts = 0;
    let mut next_cut = N / 10;
    let mut next_report = Duration::from_secs(5);
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "pipeline did not finish within 120 s"
        );
        let effects: i64 = sqlx::query_scalar("SELECT count(DISTINCT message_id) FROM effects")
            .fetch_one(pool)
            .await
            .unwrap();
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
            .fetch_one(pool)
            .await
            .unwrap();
        if effects >= N && pending == 0 {
            break;
        }
        if start.elapsed() >= next_report {
            eprintln!("pipeline: {effects} effects, {pending} pending, {cuts} cuts");
            next_report += Duration::from_secs(5);
        }
        if effects >= next_cut && cuts < 5 {
            cuts += proxy.cut().min(1);
            next_cut += N / 10;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), relay_task)
        .await
        .expect("the relay stops within 30 s of shutdown")
        .unwrap()
        .unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(30), consumer_task)
        .await
        .expect("the consumer stops within 30 s of shutdown")
        .unwrap()
        .unwrap();
    assert!(cuts >= 3, "only {cuts} cuts happened");
    let (total, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM effects")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(distinct, N, "every message took effect");
    assert_eq!(total, N, "no message took effect twice");
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox_dead_letters")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(dead, 0, "nothing dead-lettered");
    eprintln!("pipeline: {cuts} cuts, consumer {stats:?}");
}

/// Environment of a consumer child process (see [`child_consumer`]).
pub const CHILD_ENV: &str = "PGBOX_TEST_CHILD_CONSUMER";

/// Runs the consumer side of [`pipeline_with_killed_consumer`] in a child process: when
/// `PGBOX_TEST_CHILD_CONSUMER` holds `<database url> <topic> <extra>`, consumes `topic` from
/// `subscriber(extra)` into that database until killed. Otherwise (the normal test run)
/// returns at once.
pub async fn child_consumer<S: pgbox::transport::Subscriber + 'static>(
    subscriber: impl FnOnce(&str) -> S,
) {
    use pgbox::{CancellationToken, Consumer, Envelope, Inbox};
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, ' ');
    let (url, topic, extra) = (
        parts.next().expect("url"),
        parts.next().expect("topic"),
        parts.next().unwrap_or(""),
    );
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .connect(url)
        .await
        .expect("child: connect");
    let consumer = Consumer::builder(
        pool,
        subscriber(extra),
        topic.to_owned(),
        Inbox::new("effects").unwrap(),
    )
    .concurrency(8)
    .poll_interval(Duration::from_millis(10))
    .build()
    .unwrap();
    // Runs until the parent kills this process; bounded by the parent's own limit.
    consumer
        .run(
            async |msg: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                    .bind(msg.id)
                    .execute(&mut *conn)
                    .await
                    .map_err(pgbox::Error::from)?;
                // Keep transactions open long enough for the kill to land mid-batch.
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<(), pgbox::Error>(())
            },
            CancellationToken::new(),
        )
        .await
        .unwrap();
}

/// Outbox → relay → `publisher` → broker → consumer process → inbox for 600 messages, in the
/// migrated database of `pool` (at `database_url`, for the consumer processes); the
/// first consumer process is killed with SIGKILL mid-batch, a second one finishes. Asserts
/// each message took effect exactly once. `child_test` names the test function that calls
/// [`child_consumer`] in this test binary, which gets `extra` (no spaces needed).
pub async fn pipeline_with_killed_consumer<P>(
    pool: &sqlx::PgPool,
    database_url: &str,
    publisher: P,
    topic: &str,
    child_test: &str,
    extra: &str,
) where
    P: pgbox::transport::Publisher + 'static,
{
    use pgbox::{CancellationToken, Message, Outbox, Relay};
    use sqlx::Executor;

    const N: i64 = 600;
    pool.execute("CREATE TABLE effects (message_id uuid NOT NULL)")
        .await
        .unwrap();
    let outbox = Outbox::new();
    for chunk in 0..(N / 100) {
        let mut tx = pool.begin().await.unwrap();
        let batch = (0..100)
            .map(|i| Message::json(topic, &serde_json::json!({ "n": chunk * 100 + i })).unwrap());
        outbox.enqueue_batch(&mut tx, batch).await.unwrap();
        tx.commit().await.unwrap();
    }
    let shutdown = CancellationToken::new();
    let relay = Relay::builder(pool.clone(), publisher)
        .batch_size(100)
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let relay_task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    let spawn = || {
        std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", child_test, "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, format!("{database_url} {topic} {extra}"))
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn consumer process")
    };
    let count = async || -> (i64, i64) {
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM effects")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let start = Instant::now();
    let mut first = spawn();
    while count().await.0 < N / 4 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "first consumer made no progress"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill().expect("SIGKILL the consumer"); // std's kill is SIGKILL on Unix
    first.wait().expect("reap");
    let killed_at = count().await.0;
    let mut second = spawn();
    loop {
        let (_, distinct) = count().await;
        if distinct >= N {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = second.kill();
            panic!("only {distinct} of {N} messages took effect within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Give redeliveries of the killed process's messages time to arrive (and be absorbed).
    tokio::time::sleep(Duration::from_secs(3)).await;
    second.kill().expect("stop the second consumer");
    second.wait().expect("reap");
    shutdown.cancel();
    relay_task.await.unwrap().unwrap();
    let (total, distinct) = count().await;
    assert!(
        killed_at < N,
        "the first consumer finished before it was killed"
    );
    assert_eq!(distinct, N, "every message took effect");
    assert_eq!(total, N, "no message took effect twice");
    eprintln!("killed the first consumer after {killed_at} effects");
}

/// Runs `examples/payment_points` (built by `cargo test`) with `--transport transport` and
/// every fault flag on, against the (empty) test database of `pool` at `database_url`, and
/// checks its invariants from the outside too: every paid order rewarded exactly once.
pub async fn payment_points_on(pool: &sqlx::PgPool, database_url: &str, transport: &'static str) {
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("payment_points");
    assert!(
        example.exists(),
        "{example:?} not built (cargo test builds examples)"
    );
    let url = database_url.to_owned();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(example)
            .args([
                "--transport",
                transport,
                "--orders",
                "500",
                "--consumers",
                "3",
                "--duplicate-rate",
                "0.3",
                "--producer-retries",
                "0.1",
                "--crash-rate",
                "0.05",
                "--timeout-secs",
                "120",
            ])
            .env("DATABASE_URL", url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the example failed on {transport}");
    assert!(text.contains("[ok] no order rewarded twice"));
    let (paid, rewarded, distinct): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM payments.orders WHERE status = 'paid'), \
                (SELECT count(*) FROM points.ledger), \
                (SELECT count(DISTINCT order_id) FROM points.ledger)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(paid, 500, "every order paid");
    assert_eq!(rewarded, 500, "every paid order rewarded once");
    assert_eq!(distinct, 500);
}

/// Kafka for the tests: a Kafka-protocol broker, [tansu](https://crates.io/crates/tansu)
/// (Debian has no Kafka, and this machine has no registry with one), built once per machine
/// with `cargo install` into `~/.cache/pgbox/tansu-<version>` (or the binary named by
/// `PGBOX_TANSU`), and started on loopback with its in-memory storage.
///
/// [`kafka_url`] finds or starts a shared broker on 127.0.0.1:19092, left running like the
/// other brokers. [`kafka::PrivateKafka`] is a broker of one test's own behind a [`Proxy`]
/// (the broker advertises the proxy's address, so every client connection goes through it
/// and can be cut), which the test can SIGKILL and restart.
pub mod kafka {
    use std::fs::File;
    use std::net::SocketAddr;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use super::Proxy;

    /// The shared broker's address.
    pub const SHARED: &str = "127.0.0.1:19092";
    /// The version built.
    pub const TANSU_VERSION: &str = "0.6.0";

    /// An ApiVersions v0 request, correlation id 0x70676278 ("pgbx"), no client id.
    pub const API_VERSIONS: [u8; 14] =
        [0, 0, 0, 10, 0, 18, 0, 0, 0x70, 0x67, 0x62, 0x78, 0xff, 0xff];

    fn cache_root() -> PathBuf {
        let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
        home.join(".cache/pgbox")
    }

    /// The tansu binary: `PGBOX_TANSU`, else the one `scripts/kafka-test-broker.sh` built
    /// into `~/.cache/pgbox/tansu-<version>`. A test never builds it (a `cargo install`
    /// inside a test runs for minutes with its progress hidden by the test harness): it says
    /// what to run instead.
    pub fn tansu() -> Result<PathBuf, String> {
        if let Some(path) = std::env::var_os("PGBOX_TANSU") {
            return Ok(PathBuf::from(path));
        }
        let binary = cache_root().join(format!("tansu-{TANSU_VERSION}/bin/tansu"));
        if binary.exists() {
            Ok(binary)
        } else {
            Err(format!(
                "the Kafka tests need the Kafka-protocol broker tansu {TANSU_VERSION}, not \
                 built on this machine yet ({binary:?} is missing): run \
                 `bash scripts/kafka-test-broker.sh` once (several minutes), or set \
                 PGBOX_TANSU to a tansu binary"
            ))
        }
    }

    /// Starts tansu listening on `listen`, telling clients to connect to `advertised`,
    /// logging to `dir/tansu.log`.
    pub fn spawn(
        tansu: &Path,
        listen: SocketAddr,
        advertised: SocketAddr,
        dir: &Path,
    ) -> Result<Child, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {dir:?}: {e}"))?;
        let log = File::create(dir.join("tansu.log")).map_err(|e| format!("tansu log: {e}"))?;
        Command::new(tansu)
            .arg("broker")
            .arg(format!("--listener-url=tcp://{listen}"))
            .arg(format!("--advertised-listener-url=tcp://{advertised}"))
            .arg("--storage-engine=memory://tansu/")
            .env_remove("CLUSTER_ID")
            .env_remove("STORAGE_ENGINE")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {tansu:?}: {e}"))
    }

    async fn wait_until_answers(addr: SocketAddr) -> Result<(), String> {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if super::answers(super::Broker::Kafka, addr).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!("tansu on {addr} does not answer after 30 s"))
    }

    fn free_port() -> SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
    }

    /// A broker of one test's own, behind a proxy that can cut its connections; killed on
    /// drop. Its storage is in memory: a restart starts empty.
    pub struct PrivateKafka {
        tansu: PathBuf,
        dir: PathBuf,
        listen: SocketAddr,
        proxy: Proxy,
        child: Option<Child>,
    }

    impl PrivateKafka {
        /// Starts it; panics with the reason if it cannot.
        pub async fn start() -> PrivateKafka {
            let tansu = tokio::task::spawn_blocking(tansu)
                .await
                .expect("tansu build task")
                .unwrap_or_else(|e| panic!("no Kafka-protocol broker for the tests: {e}"));
            let listen = free_port();
            let proxy = Proxy::start(listen).await;
            let dir =
                std::env::temp_dir().join(format!("pgbox-kafka-{}", uuid::Uuid::now_v7().simple()));
            let mut broker = PrivateKafka {
                tansu,
                dir,
                listen,
                proxy,
                child: None,
            };
            broker.restart().await;
            broker
        }

        /// What clients bootstrap from (the proxy).
        pub fn bootstrap(&self) -> String {
            self.proxy.addr().to_string()
        }

        /// The proxy every client connection goes through.
        pub fn proxy(&self) -> &Proxy {
            &self.proxy
        }

        /// SIGKILLs the broker (its in-memory topics and offsets are gone with it).
        pub fn kill(&mut self) {
            if let Some(mut child) = self.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            self.proxy.cut();
        }

        /// (Re)starts the broker on the same addresses and waits until it answers.
        pub async fn restart(&mut self) {
            self.kill();
            let child = spawn(&self.tansu, self.listen, self.proxy.addr(), &self.dir)
                .unwrap_or_else(|e| panic!("start tansu: {e}"));
            self.child = Some(child);
            wait_until_answers(self.listen).await.unwrap_or_else(|e| {
                let log = std::fs::read_to_string(self.dir.join("tansu.log")).unwrap_or_default();
                panic!("{e}; its log:\n{log}")
            });
        }
    }

    impl Drop for PrivateKafka {
        fn drop(&mut self) {
            self.kill();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
