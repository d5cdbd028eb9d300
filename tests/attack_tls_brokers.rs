//! Attacks on the RabbitMQ and NATS transports' TLS and credential promises (module docs of
//! `transport::rabbitmq` and `transport::nats`, "TLS" sections): the clear-text credential
//! decision at `build()` measured against the host the client library really dials, and
//! secrets in the client libraries' own TRACE logs.
//!
//! Network: failed logins against the shared RabbitMQ on 127.0.0.1:5672 (a user that does
//! not exist: nothing on the broker is created or changed); private `nats-server` and
//! RabbitMQ nodes on free ports; test databases of their own on the shared PostgreSQL.
#![cfg(all(feature = "tls", feature = "rabbitmq", feature = "nats"))]

#[path = "support/rabbit_tls.rs"]
mod rabbit_tls;
mod support;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use std::sync::atomic::{AtomicUsize, Ordering};

use pgbox::transport::nats::Nats;
use pgbox::transport::rabbitmq::RabbitMq;
use pgbox::transport::{PublishError, Publisher, Subscriber};
use pgbox::{Envelope, Error, Message, Outbox, Relay, RetryPolicy, Secret};
use support::TestDb;
use support::certs::{Pki, Validity};
use tracing_subscriber::fmt::MakeWriter;

/// Everything the TRACE subscriber wrote.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogBuffer {
    type Writer = LogBuffer;

    fn make_writer(&'a self) -> LogBuffer {
        self.clone()
    }
}

static LOGS: OnceLock<LogBuffer> = OnceLock::new();

/// One TRACE subscriber for every target in this test binary, writing into [`LOGS`].
fn capture_logs() -> LogBuffer {
    LOGS.get_or_init(|| {
        let buffer = LogBuffer::default();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("trace"))
            .with_writer(buffer.clone())
            .with_ansi(false)
            .try_init()
            .expect("the only subscriber of this test binary");
        buffer
    })
    .clone()
}

/// The forms a secret can take in a log line: as it is, percent-encoded, and as the
/// `Debug` of its bytes (`[.., 112, 119, ..]`: how a `Vec<u8>` field is printed).
fn secret_forms(secret: &str) -> Vec<String> {
    let encoded: String = secret
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let bytes = secret
        .bytes()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    vec![secret.to_owned(), encoded, bytes]
}

/// The forms of `secret` found in `text`.
fn found(text: &str, secret: &str) -> Vec<String> {
    secret_forms(secret)
        .into_iter()
        .filter(|form| text.contains(form.as_str()))
        .collect()
}

/// The finder finds: each form is reported, and a text without the secret is clean.
#[test]
fn the_secret_finder_finds_every_form() {
    let secret = "Zq9-secret/pw";
    for form in secret_forms(secret) {
        assert_eq!(found(&format!("x{form}y"), secret).len(), 1, "{form}");
    }
    assert!(found("nothing here", secret).is_empty());
    let debug = format!("{:?}", format!("\0user\0{secret}").into_bytes());
    assert!(!found(&debug, secret).is_empty(), "{debug}");
}

/// The promise: "No message, log line or `Debug` output shows a password" — lapin's own
/// TRACE lines included. A login (refused: the user does not exist on the shared broker)
/// sends the password in `Connection.StartOk`; lapin logs every frame it writes at TRACE
/// (`will write to buffer`, the method's `Debug`), where the SASL response
/// `\0user\0password` is a `LongString(Vec<u8>)`, printed as its bytes.
///
/// pgbox cannot redact lapin's own frames (they are logged on lapin's I/O thread), so the
/// documented rule is: keep the target `lapin::io_loop` at DEBUG or above. This test checks
/// that every other line, at every level, holds no password, and that the one known leak is
/// exactly the line the rule turns off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_rabbitmq_trace_log_shows_the_password() {
    let logs = capture_logs();
    let password = format!("Pw{}", uuid::Uuid::now_v7().simple());
    let transport = RabbitMq::builder("amqp://127.0.0.1:5672/%2f")
        .credentials(
            format!("pgbox-attack-nobody-{}", uuid::Uuid::now_v7().simple()),
            Secret::new(password.clone()),
        )
        .connect_timeout(Duration::from_secs(20))
        .operation_timeout(Duration::from_secs(20))
        .build()
        .expect("credentials to loopback in clear text are allowed");
    let e = transport
        .connect()
        .await
        .expect_err("a user that does not exist cannot log in");
    assert!(
        matches!(e, Error::Authentication { .. }),
        "a refused login is Error::Authentication, not {e:?}"
    );
    transport.close().await;
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(
        text.contains("StartOk") || text.contains("start_ok") || text.contains("StartOk"),
        "the TRACE log shows the login frames (else this test proves nothing)"
    );
    for place in [format!("{e}"), format!("{e:?}"), format!("{e:#}")] {
        assert!(found(&place, &password).is_empty(), "error: {place}");
    }
    let lapin_frames = |line: &str| line.contains("TRACE") && line.contains("lapin::io_loop");
    let frame_leaks = text
        .lines()
        .filter(|line| lapin_frames(line) && !found(line, &password).is_empty())
        .count();
    eprintln!("lapin::io_loop TRACE lines showing the login frame: {frame_leaks}");
    let leaks: Vec<String> = text
        .lines()
        .filter(|line| !lapin_frames(line))
        .filter(|line| !found(line, &password).is_empty())
        .map(|line| {
            // The part that holds the secret (a throwaway one: no such user exists).
            let at = line.find("response").unwrap_or(0);
            format!(
                "{} ... {}",
                line.chars().take(120).collect::<String>(),
                line[at..].chars().take(300).collect::<String>()
            )
        })
        .collect();
    assert!(
        leaks.is_empty(),
        "{} TRACE line(s) show the password, e.g.:\n{}",
        leaks.len(),
        leaks.first().cloned().unwrap_or_default()
    );
}

fn insecure(e: &Error) -> bool {
    matches!(e, Error::InsecureCredentials { .. })
}

/// An IPv6 broker address with a password in clear text: the host is not loopback, so
/// `build` must refuse it (or, with TLS, dial that address). amq-protocol-uri keeps only
/// `Url::domain()`, which is `None` for an IP literal, and puts `localhost` in its place:
/// pgbox then checks (and lapin dials) `localhost`, not the address the user gave.
#[test]
fn finding_rabbitmq_ipv6_broker_address_becomes_localhost() {
    let remote = RabbitMq::builder("amqp://orders:s3cret-pw@[2001:db8::10]:5672/%2f").build();
    match &remote {
        Err(e) => assert!(insecure(e), "{e:?}"),
        Ok(t) => {
            panic!("clear-text password to 2001:db8::10 accepted; the transport targets: {t:?}")
        }
    }
    // With TLS the address itself is dialled (and shown), not localhost.
    let tls = RabbitMq::builder("amqps://[2001:db8::10]:5671/%2f")
        .build()
        .expect("amqps to an IPv6 address is a valid configuration");
    let shown = format!("{tls:?}");
    assert!(
        shown.contains("2001:db8::10") && !shown.contains("localhost"),
        "{shown}"
    );
    // Loopback IPv6 with a password: allowed (it is loopback).
    RabbitMq::builder("amqp://orders:s3cret-pw@[::1]:5672/%2f")
        .build()
        .expect("::1 is loopback");
}

/// What is dialled for `[::1]`: the shared broker listens on 127.0.0.1:5672 only, so a
/// connection to ::1 port 5672 is refused (a transport error). Dialling `localhost` instead
/// reaches the shared broker, which refuses the unknown user (an authentication error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_rabbitmq_ipv6_loopback_dials_localhost_instead() {
    let transport = RabbitMq::builder("amqp://[::1]:5672/%2f")
        .credentials(
            format!("pgbox-attack-nobody-{}", uuid::Uuid::now_v7().simple()),
            Secret::new(format!("Pw{}", uuid::Uuid::now_v7().simple())),
        )
        .connect_timeout(Duration::from_secs(20))
        .build()
        .expect("::1 is loopback");
    let e = transport.connect().await.expect_err("nothing to log in to");
    transport.close().await;
    assert!(
        matches!(e, Error::Transport { .. }),
        "::1:5672 has no listener, yet: {e:?}"
    );
}

/// A percent-encoded host is decoded by amq-protocol-uri before lapin dials it; pgbox's
/// loopback test treats a host starting with `/` or `@` as a Unix-domain socket, which an
/// AMQP URL never names. `%40mq.example.com` is the host `@mq.example.com`: not loopback.
#[test]
fn finding_rabbitmq_percent_encoded_host_passes_as_a_unix_socket() {
    for url in [
        "amqp://orders:s3cret-pw@%40mq.example.com:5672/%2f",
        "amqp://orders:s3cret-pw@%2Fmq.example.com:5672/%2f",
    ] {
        match RabbitMq::builder(url).build() {
            Err(e) => assert!(insecure(&e), "{url}: {e:?}"),
            Ok(t) => panic!("{url}: clear-text password accepted for {t:?}"),
        }
    }
}

/// The loopback decision on the host lapin really dials: names and addresses that only
/// look local are refused, the ones that are local pass, user-info tricks resolve to the
/// host after the last `@` (where lapin connects too).
#[test]
fn rabbitmq_loopback_decision_holds() {
    for host in [
        "127.0.0.1.nip.io",
        "localhost.evil.example",
        "0.0.0.0",
        "10.0.0.1",
        "127.1",
        "0x7f000001",
        "evil.example%2elocalhost%2e%2f",
    ] {
        let url = format!("amqp://orders:s3cret-pw@{host}:5672/%2f");
        match RabbitMq::builder(&url).build() {
            Err(e) => assert!(insecure(&e), "{url}: {e:?}"),
            Ok(t) => panic!("{url}: clear-text password accepted for {t:?}"),
        }
        // The builder's credentials count the same as the URL's.
        let url = format!("amqp://{host}:5672/%2f");
        let built = RabbitMq::builder(&url)
            .credentials("orders", Secret::new("s3cret-pw"))
            .build();
        assert!(matches!(&built, Err(e) if insecure(e)), "{url}: {built:?}");
        // Allowed on request.
        RabbitMq::builder(&url)
            .credentials("orders", Secret::new("s3cret-pw"))
            .allow_insecure_credentials(true)
            .build()
            .unwrap_or_else(|e| panic!("{url}: {e:?}"));
    }
    for host in [
        "127.0.0.1",
        "LOCALHOST",
        "localhost.",
        "127.9.9.9",
        "mq.localhost",
    ] {
        let url = format!("amqp://orders:s3cret-pw@{host}:5672/%2f");
        RabbitMq::builder(&url)
            .build()
            .unwrap_or_else(|e| panic!("{url}: {e:?}"));
    }
    // `evil.example@127.0.0.1`: the URL parser splits at the last `@`; the password is
    // `pw@evil.example`, the host (checked and dialled) 127.0.0.1.
    let t = RabbitMq::builder("amqp://orders:pw@evil.example@127.0.0.1:5672/%2f")
        .build()
        .expect("the host is 127.0.0.1");
    let shown = format!("{t:?}");
    assert!(
        shown.contains("127.0.0.1") && !shown.contains("evil"),
        "{shown}"
    );
    // `guest:guest` to a remote host is lapin's default, public: not a secret.
    RabbitMq::builder("amqp://guest:guest@mq.example.com:5672/%2f")
        .build()
        .expect("guest/guest is not a secret");
    // amqps:// to a remote host with a password: fine.
    RabbitMq::builder("amqps://orders:s3cret-pw@mq.example.com:5671/%2f")
        .build()
        .expect("TLS carries the password");
}

/// NATS: every server of a list counts; user-info tricks split where async-nats would.
#[test]
fn nats_loopback_decision_holds() {
    for url in [
        "nats://orders:pw@127.0.0.1:4222,nats://mq.example.com:4222",
        "nats://127.0.0.1:4222, nats://orders:pw@mq.example.com:4222",
        "nats://orders:pw@127.0.0.1.nip.io:4222",
        "nats://orders:pw@localhost.evil.example:4222",
        "nats://orders:pw@0.0.0.0:4222",
        "nats://orders:pw@evil.example@mq.example.com:4222",
        "nats://t0ken-secret@[2001:db8::10]:4222",
        "nats://orders:pw@%40mq.example.com:4222",
    ] {
        match Nats::builder(url).build() {
            Err(e) => assert!(insecure(&e), "{url}: {e:?}"),
            Ok(t) => panic!("{url}: clear-text credentials accepted for {t:?}"),
        }
        let bare = url.replace("orders:pw@", "").replace("t0ken-secret@", "");
        if bare.contains('@') {
            continue; // user-info left in the URL: given twice
        }
        let built = Nats::builder(&bare)
            .token(Secret::new("t0ken-secret"))
            .build();
        assert!(matches!(&built, Err(e) if insecure(e)), "{bare}: {built:?}");
    }
    for url in [
        "nats://orders:pw@127.0.0.1:4222,nats://orders:pw@[::1]:4223",
        "nats://orders:pw@LOCALHOST.:4222",
        "tls://orders:pw@mq.example.com:4222",
    ] {
        let t = Nats::builder(url)
            .build()
            .unwrap_or_else(|e| panic!("{url}: {e:?}"));
        let shown = format!("{t:?}");
        assert!(!shown.contains(":pw@"), "{shown}");
    }
    // TLS from require_tls covers a nats:// URL to a remote host.
    Nats::builder("nats://orders:pw@mq.example.com:4222")
        .require_tls(true)
        .build()
        .expect("TLS is required");
}

const NATS_SERVER: &str = "/usr/sbin/nats-server";

/// One private `nats-server` on a free loopback port, in its own directory; killed and the
/// directory removed on drop (as in tests/tls_nats.rs).
struct NatsServer {
    dir: std::path::PathBuf,
    port: u16,
    child: std::process::Child,
}

impl NatsServer {
    fn start(name: &str, body: &str) -> NatsServer {
        assert!(
            std::path::Path::new(NATS_SERVER).exists(),
            "{NATS_SERVER} is not installed (Debian package `nats-server`)"
        );
        let dir = std::env::temp_dir().join(format!(
            "pgbox-attack-brokers-{name}-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.join("server.conf");
        std::fs::write(&config, format!("listen: 127.0.0.1:{port}\n{body}\n")).unwrap();
        let log = std::fs::File::create(dir.join("server.log")).unwrap();
        let child = std::process::Command::new(NATS_SERVER)
            .arg("-c")
            .arg(&config)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        let mut server = NatsServer { dir, port, child };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("nats-server exited: {status}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("nats-server not listening after 10 s");
    }
}

impl NatsServer {
    /// Rewrites the configuration (same port) and has the server reload it (SIGHUP to the
    /// process this test started).
    fn reconfigure(&self, body: &str) {
        std::fs::write(
            self.dir.join("server.conf"),
            format!("listen: 127.0.0.1:{}\n{body}\n", self.port),
        )
        .unwrap();
        let status = std::process::Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// async-nats logs the server URL (debug) and the CONNECT it writes (trace): with
/// credentials in the URL or from the builder, right or wrong, no log line, error or `Debug`
/// shows the password or the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_trace_log_shows_no_credentials() {
    let logs = capture_logs();
    let password = format!("Np{}!x", uuid::Uuid::now_v7().simple());
    let token = format!("Tk{}", uuid::Uuid::now_v7().simple());
    let users = NatsServer::start(
        "users",
        &format!("authorization {{ users = [ {{ user: alice, password: \"{password}\" }} ] }}"),
    );
    let tokens = NatsServer::start("token", &format!("authorization {{ token: \"{token}\" }}"));
    let encoded: String = secret_forms(&password)[1].clone();
    let mut seen = Vec::new();
    let cases = [
        (
            Nats::builder(format!("nats://alice:{encoded}@127.0.0.1:{}", users.port)),
            true,
        ),
        (
            Nats::builder(format!("nats://127.0.0.1:{}", users.port))
                .user_password("alice", Secret::new(password.clone())),
            true,
        ),
        (
            Nats::builder(format!("nats://127.0.0.1:{}", users.port))
                .user_password("alice", Secret::new(format!("{password}-wrong"))),
            false,
        ),
        (
            Nats::builder(format!("nats://{token}@127.0.0.1:{}", tokens.port)),
            true,
        ),
        (
            Nats::builder(format!("nats://127.0.0.1:{}", tokens.port))
                .token(Secret::new(format!("{token}-wrong"))),
            false,
        ),
    ];
    for (builder, good) in cases {
        seen.push(format!("{builder:?}"));
        let nats = builder.declare(false).build().expect("loopback");
        seen.push(format!("{nats:?}"));
        let result = tokio::time::timeout(Duration::from_secs(60), nats.max_payload())
            .await
            .expect("the connection attempt ends");
        match result {
            Ok(_) => assert!(good, "a wrong credential was accepted"),
            Err(e) => {
                assert!(!good, "the right credential was refused: {e:?}");
                assert!(
                    matches!(e, Error::Authentication { .. }),
                    "a refused login is Error::Authentication: {e:?}"
                );
                seen.push(format!("{e} {e:?} {e:#}"));
            }
        }
    }
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(
        text.contains("CONNECT"),
        "the TRACE log shows the CONNECT (else this test proves nothing)"
    );
    seen.push(text);
    for secret in [&password, &token] {
        for place in &seen {
            let hits = found(place, secret);
            assert!(
                hits.is_empty(),
                "{hits:?} in {}",
                &place[..place.len().min(300)]
            );
        }
    }
}

/// Forwards to the transport and counts the messages it failed to publish.
struct Counting<P> {
    inner: P,
    failed: Arc<AtomicUsize>,
}

impl<P: Publisher> Publisher for Counting<P> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let results = self.inner.publish(batch).await;
        let failed = results.iter().filter(|r| r.is_err()).count();
        self.failed.fetch_add(failed, Ordering::Relaxed);
        results
    }

    fn atomic_batches(&self) -> bool {
        self.inner.atomic_batches()
    }
}

/// `rabbitmqctl` against the private node started by this process.
fn rabbitmqctl(node_dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("/usr/lib/rabbitmq/bin/rabbitmqctl")
        .env("HOME", node_dir)
        .env("ERL_EPMD_ADDRESS", "127.0.0.1")
        .arg("-n")
        .arg(format!("pgbox-tls-{}@localhost", std::process::id()))
        .arg("--timeout")
        .arg("60")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn dead_letters(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox_dead_letters")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The promise: the relay treats an authentication/authorisation failure like an outage
/// (retried with backoff, logged at error), so a fixed account works without a restart
/// and nothing is dead-lettered for it. Here the login succeeds over TLS but the user has
/// lost its `write` permission (a rotated or misapplied policy): the broker closes the
/// channel with 403 ACCESS_REFUSED on every publish, whatever the message. The relay must
/// not count that against the messages; once the permission is back, all are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_rabbitmq_refused_write_permission_dead_letters_good_messages() {
    let dir = std::env::temp_dir().join(format!(
        "pgbox-attack-brokers-rabbit-{}",
        uuid::Uuid::now_v7().simple()
    ));
    let pki = Pki::new(dir.join("pki"), "rabbit");
    let server = pki.server("node", &["localhost", "127.0.0.1"], Validity::Current);
    let client = pki.client("client", "pgbox-app");
    let node_dir = dir.join("node");
    let node = rabbit_tls::PrivateRabbit::start(&node_dir, &pki.ca_cert, &server.cert, &server.key);
    assert_ne!(node.plain_port, node.tls_port);
    let prefix = format!("pgbox-attack-{}.", uuid::Uuid::now_v7().simple());
    // The client's copy of the CA file, swapped below.
    let client_ca = dir.join("client-ca.pem");
    std::fs::copy(&pki.ca_cert, &client_ca).unwrap();
    let transport = RabbitMq::builder(format!("amqps://localhost:{}/%2f", node.tls_port))
        .tls_root_certificates(&client_ca)
        .tls_client_certificate(&client.cert, &client.key)
        .credentials(&node.user, Secret::new(node.password.clone()))
        .exchange("pgbox-attack")
        .queue_prefix(&prefix)
        .connect_timeout(Duration::from_secs(20))
        .operation_timeout(Duration::from_secs(20))
        .confirm_timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let topic = "perm.orders";
    transport
        .declare_topic(topic)
        .await
        .expect("declare over TLS");

    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let payloads = ["p1", "p2", "p3"];
    for payload in payloads {
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, Message::bytes(topic, payload))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    // Configure and read stay, write goes.
    rabbitmqctl(
        &node_dir,
        &["set_permissions", "-p", "/", &node.user, ".*", "^$", ".*"],
    );
    let failed = Arc::new(AtomicUsize::new(0));
    let relay = Relay::builder(
        db.pool.clone(),
        Counting {
            inner: transport.clone(),
            failed: failed.clone(),
        },
    )
    .max_attempts(2)
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(5))
            .max_delay(Duration::from_millis(20)),
    )
    .poll_interval(Duration::from_millis(20))
    .build()
    .unwrap();
    // Three failures per message is past a budget of two attempts.
    let past_budget = 3 * payloads.len();
    let mut rounds = 0;
    while failed.load(Ordering::Relaxed) < past_budget && dead_letters(&db.pool).await == 0 {
        rounds += 1;
        assert!(rounds <= 2_000, "the relay stopped offering messages");
        tokio::time::timeout(Duration::from_secs(120), relay.relay_once())
            .await
            .expect("a round ends")
            .expect("round");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dead = dead_letters(&db.pool).await;

    // The permission is back: everything pending is delivered.
    rabbitmqctl(
        &node_dir,
        &["set_permissions", "-p", "/", &node.user, ".*", ".*", ".*"],
    );
    let report = tokio::time::timeout(Duration::from_secs(120), relay.drain())
        .await
        .expect("drain finishes once the permission is back")
        .expect("drain");
    let mut got = Vec::new();
    for _ in 0..50 {
        if got.len() >= payloads.len() {
            break;
        }
        for d in transport
            .receive(topic, 10, Duration::from_secs(30))
            .await
            .unwrap()
        {
            got.push(String::from_utf8_lossy(&transport.envelope(&d).payload).into_owned());
            transport.ack(&d).await.unwrap();
        }
    }
    transport.close().await;

    // The CA file replaced between build and a reconnect (files are read at each
    // connection): garbage or empty is Error::Tls with BadFile, never a fallback to the
    // system roots or to no verification; the right file again connects.
    let mut swapped = Vec::new();
    for content in ["", "garbage, not PEM\n"] {
        std::fs::write(&client_ca, content).unwrap();
        swapped.push(transport.connect().await);
        transport.close().await;
    }
    std::fs::copy(&pki.ca_cert, &client_ca).unwrap();
    let again = transport.connect().await;
    transport.close().await;
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
    for r in &swapped {
        assert!(
            matches!(
                r,
                Err(Error::Tls {
                    problem: pgbox::TlsProblem::BadFile,
                    ..
                })
            ),
            "{r:?}"
        );
    }
    again.expect("the right CA file connects again");
    assert_eq!(
        dead,
        0,
        "a refused write permission (same for every message) dead-lettered {dead} good \
         message(s) after {} failed publishes",
        failed.load(Ordering::Relaxed)
    );
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    got.sort();
    assert_eq!(got, payloads, "{report:?}");
}

/// The same class on NATS: a user that logs in but may not publish on pgbox's subjects
/// (a permissions violation, the same for every message). The relay must treat it as an
/// outage: nothing dead-lettered, all delivered once the permission is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_refused_publish_permission_dead_letters_nothing() {
    let password = format!("Np{}", uuid::Uuid::now_v7().simple());
    let store = std::env::temp_dir().join(format!(
        "pgbox-attack-brokers-js-{}",
        uuid::Uuid::now_v7().simple()
    ));
    let config = |deny: &str| {
        format!(
            "jetstream {{ store_dir: \"{}\" }}\n\
             authorization {{ users = [ {{ user: alice, password: \"{password}\", \
             permissions: {{ publish: {{ allow: [\">\"], deny: [{deny}] }} }} }} ] }}",
            store.display()
        )
    };
    let server = NatsServer::start("perm", &config("\"attack-denied.>\""));
    let stream = format!("ATTACK_{}", uuid::Uuid::now_v7().simple());
    let nats = Nats::builder(format!("nats://127.0.0.1:{}", server.port))
        .user_password("alice", Secret::new(password.clone()))
        .stream(&stream)
        .subject_prefix("attack-denied")
        .build()
        .expect("loopback");
    let topic = "perm.orders";
    nats.declare_topic(topic).await.expect("declare");
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let payloads = ["n1", "n2"];
    for payload in payloads {
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, Message::bytes(topic, payload))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let failed = Arc::new(AtomicUsize::new(0));
    let relay = Relay::builder(
        db.pool.clone(),
        Counting {
            inner: nats.clone(),
            failed: failed.clone(),
        },
    )
    .max_attempts(2)
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(5))
            .max_delay(Duration::from_millis(20)),
    )
    .poll_interval(Duration::from_millis(20))
    .build()
    .unwrap();
    let past_budget = 3 * payloads.len();
    let mut rounds = 0;
    while failed.load(Ordering::Relaxed) < past_budget && dead_letters(&db.pool).await == 0 {
        rounds += 1;
        assert!(rounds <= 2_000, "the relay stopped offering messages");
        tokio::time::timeout(Duration::from_secs(120), relay.relay_once())
            .await
            .expect("a round ends")
            .expect("round");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dead = dead_letters(&db.pool).await;
    server.reconfigure(&config("\"nothing-denied.>\""));
    let mut report = None;
    // Bounded: the reload takes effect within a few rounds.
    for _ in 0..100 {
        let r = tokio::time::timeout(Duration::from_secs(120), relay.drain())
            .await
            .expect("drain ends")
            .expect("drain");
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        report = Some(r);
        if pending == 0 || dead_letters(&db.pool).await > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut got = Vec::new();
    for _ in 0..20 {
        if got.len() >= payloads.len() {
            break;
        }
        for d in nats
            .receive(topic, 10, Duration::from_secs(30))
            .await
            .unwrap()
        {
            got.push(String::from_utf8_lossy(&nats.envelope(&d).payload).into_owned());
            nats.ack(&d).await.unwrap();
        }
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&store);
    assert_eq!(
        dead,
        0,
        "a refused publish permission dead-lettered {dead} message(s) after {} failures",
        failed.load(Ordering::Relaxed)
    );
    assert_eq!(dead_letters(&db.pool).await, 0, "{report:?}");
    got.sort();
    assert_eq!(got, payloads, "{report:?}");
}
