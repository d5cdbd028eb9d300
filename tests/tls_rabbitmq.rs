//! The RabbitMQ transport over TLS, against a PRIVATE RabbitMQ node (never the shared one on
//! 5672) whose TLS listener requires client certificates, and `openssl s_server` for server
//! certificates a RabbitMQ node would not be started with (expired, for another name):
//! verification with a private CA, the typed failures (unknown issuer, host name, expiry,
//! plain port, client certificate missing or unknown, wrong password), credentials from a
//! secret file, clear-text credentials refused at build, no password in Debug or errors.
#![cfg(all(feature = "tls", feature = "rabbitmq"))]

#[path = "support/rabbit_tls.rs"]
mod rabbit_tls;
mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pgbox::transport::rabbitmq::{RabbitMq, RabbitMqBuilder};
use pgbox::transport::{Publisher, Subscriber, conformance};
use pgbox::{Error, Secret, TlsProblem};
use rabbit_tls::PrivateRabbit;
use support::certs::{Issued, Pki, Validity};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "pgbox-tls-rabbit-{name}-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn quick(builder: RabbitMqBuilder) -> RabbitMqBuilder {
    builder
        .exchange("pgbox-tls-test")
        .queue_prefix(format!("pgbox-tls-{}.", uuid::Uuid::now_v7().simple()))
        .receive_wait(Duration::from_millis(200))
        .connect_timeout(Duration::from_secs(20))
        .operation_timeout(Duration::from_secs(20))
}

/// What the cases share: the node, the CA it trusts and presents, a client certificate.
struct World {
    node: PrivateRabbit,
    ca_cert: PathBuf,
    /// Server certificates for `openssl s_server`: expired, and for another name.
    expired: Issued,
    elsewhere: Issued,
    client: Issued,
    other_client: Issued,
    other_ca: PathBuf,
    password_file: PathBuf,
}

impl World {
    fn url(&self, host: &str) -> String {
        format!("amqps://{host}:{}/%2f", self.node.tls_port)
    }

    /// The node's TLS port, trusting the test CA, the client certificate, credentials from
    /// the secret file.
    fn good(&self) -> RabbitMqBuilder {
        quick(RabbitMq::builder(self.url("localhost")))
            .tls_root_certificates(&self.ca_cert)
            .tls_client_certificate(&self.client.cert, &self.client.key)
            .credentials(
                &self.node.user,
                Secret::from_file(&self.password_file).unwrap(),
            )
    }
}

fn tls_problem(e: &Error) -> Option<TlsProblem> {
    match e {
        Error::Tls { problem, .. } => Some(*problem),
        _ => None,
    }
}

async fn connect_err(builder: RabbitMqBuilder) -> Error {
    let transport = builder.build().expect("valid config");
    let e = transport
        .connect()
        .await
        .expect_err("the connection must fail");
    eprintln!("connect error: {e} / {e:?}");
    e
}

async fn publish_and_receive(world: &World) {
    let transport = world.good().build().unwrap();
    transport
        .connect()
        .await
        .expect("amqps with the test CA connects");
    let topic = "tls-orders";
    transport.declare_topic(topic).await.unwrap();
    let envelope = conformance::envelope(topic, "over TLS");
    let results = transport.publish(std::slice::from_ref(&envelope)).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let mut got = Vec::new();
    // Bounded: 50 receives of up to 200 ms each.
    for _ in 0..50 {
        got = transport
            .receive(topic, 10, Duration::from_secs(30))
            .await
            .unwrap();
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(got.len(), 1, "the message must come back");
    assert_eq!(transport.envelope(&got[0]).id, envelope.id);
    assert_eq!(transport.envelope(&got[0]).payload, envelope.payload);
    assert!(transport.ack(&got[0]).await.unwrap());
    transport.close().await;
}

async fn unknown_issuer(world: &World) {
    // Trusting another CA (and the system's roots): the node's certificate is unknown.
    let e = connect_err(
        quick(RabbitMq::builder(world.url("localhost")))
            .tls_root_certificates(&world.other_ca)
            .tls_client_certificate(&world.client.cert, &world.client.key),
    )
    .await;
    assert_eq!(tls_problem(&e), Some(TlsProblem::UnknownIssuer), "{e:?}");
}

async fn plain_port(world: &World) {
    let e = connect_err(
        quick(RabbitMq::builder(format!(
            "amqps://localhost:{}/%2f",
            world.node.plain_port
        )))
        .tls_root_certificates(&world.ca_cert),
    )
    .await;
    assert!(tls_problem(&e).is_some(), "a typed TLS error: {e:?}");
}

async fn client_certificate_missing(world: &World) {
    let e = connect_err(
        quick(RabbitMq::builder(world.url("localhost"))).tls_root_certificates(&world.ca_cert),
    )
    .await;
    assert_eq!(
        tls_problem(&e),
        Some(TlsProblem::ClientCertificate),
        "{e:?}"
    );
}

async fn client_certificate_unknown(world: &World) {
    let e = connect_err(
        quick(RabbitMq::builder(world.url("localhost")))
            .tls_root_certificates(&world.ca_cert)
            .tls_client_certificate(&world.other_client.cert, &world.other_client.key),
    )
    .await;
    assert_eq!(
        tls_problem(&e),
        Some(TlsProblem::ClientCertificate),
        "{e:?}"
    );
}

async fn wrong_password(world: &World) {
    let wrong = "not-the-password-4711";
    let e = connect_err(
        quick(RabbitMq::builder(world.url("localhost")))
            .tls_root_certificates(&world.ca_cert)
            .tls_client_certificate(&world.client.cert, &world.client.key)
            .credentials(&world.node.user, Secret::new(wrong)),
    )
    .await;
    assert!(matches!(e, Error::Authentication { .. }), "{e:?}");
    let shown = format!("{e} {e:?}");
    assert!(!shown.contains(wrong), "{shown}");
    // The same wrong password in the URL: the same error, no password shown either.
    let e = connect_err(
        quick(RabbitMq::builder(format!(
            "amqps://{}:{wrong}@localhost:{}/%2f",
            world.node.user, world.node.tls_port
        )))
        .tls_root_certificates(&world.ca_cert)
        .tls_client_certificate(&world.client.cert, &world.client.key),
    )
    .await;
    assert!(matches!(e, Error::Authentication { .. }), "{e:?}");
    assert!(!format!("{e} {e:?}").contains(wrong));
}

/// Both transports' Debug, and their errors, keep the password out.
async fn no_password_shown(world: &World) {
    let builder = world.good();
    let transport = builder.clone().build().unwrap();
    transport.connect().await.unwrap();
    for shown in [format!("{builder:?}"), format!("{transport:?}")] {
        assert!(!shown.contains(&world.node.password), "{shown}");
        assert!(shown.contains("localhost"), "{shown}");
    }
    transport.close().await;
}

/// `openssl s_server` presenting `cert` on a free loopback port: for server certificates
/// the private node is not started with. Killed on drop.
struct TlsServer {
    child: Child,
    port: u16,
}

impl TlsServer {
    fn start(cert: &Issued) -> TlsServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("openssl")
            .args(["s_server", "-quiet", "-accept"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("-cert")
            .arg(&cert.cert)
            .arg("-key")
            .arg(&cert.key)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("openssl s_server");
        // Killed on drop, also when it never listens.
        let server = TlsServer { child, port };
        // Bounded: 20 s.
        for _ in 0..80 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!("openssl s_server not listening within 20 s");
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn server_certificate_faults(world: &World) {
    let expired = TlsServer::start(&world.expired);
    let e = connect_err(
        quick(RabbitMq::builder(format!(
            "amqps://localhost:{}/%2f",
            expired.port
        )))
        .tls_root_certificates(&world.ca_cert),
    )
    .await;
    assert_eq!(tls_problem(&e), Some(TlsProblem::Expired), "{e:?}");

    let elsewhere = TlsServer::start(&world.elsewhere);
    let e = connect_err(
        quick(RabbitMq::builder(format!(
            "amqps://localhost:{}/%2f",
            elsewhere.port
        )))
        .tls_root_certificates(&world.ca_cert),
    )
    .await;
    assert_eq!(tls_problem(&e), Some(TlsProblem::HostnameMismatch), "{e:?}");
}

/// One node for every case (it takes seconds to start), stopped and removed at the end even
/// when a case fails: each case runs as its own task and its panic is collected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_over_tls() {
    support::init_tracing();
    let dir = temp_dir("node");
    let pki = Pki::new(dir.join("pki"), "rabbit");
    let server = pki.server("node", &["localhost", "127.0.0.1"], Validity::Current);
    let client = pki.client("client", "pgbox-app");
    let other = Pki::new(dir.join("other"), "other");
    let other_client = other.client("stranger", "pgbox-app");
    let node = PrivateRabbit::start(&dir.join("node"), &pki.ca_cert, &server.cert, &server.key);
    let password_file = dir.join("password");
    std::fs::write(&password_file, format!("{}\n", node.password)).unwrap();
    let world = std::sync::Arc::new(World {
        node,
        other_ca: other.ca_cert.clone(),
        ca_cert: pki.ca_cert.clone(),
        expired: pki.server("expired", &["localhost", "127.0.0.1"], Validity::Expired),
        elsewhere: pki.server("elsewhere", &["mq.example.com"], Validity::Current),
        client,
        other_client,
        password_file,
    });

    macro_rules! case {
        ($name:ident) => {{
            let w = world.clone();
            (
                stringify!($name),
                tokio::spawn(async move { $name(&w).await }).await,
            )
        }};
    }
    let outcomes = vec![
        case!(publish_and_receive),
        case!(unknown_issuer),
        case!(plain_port),
        case!(client_certificate_missing),
        case!(client_certificate_unknown),
        case!(wrong_password),
        case!(no_password_shown),
        case!(server_certificate_faults),
    ];
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|(_, r)| r.is_err())
        .map(|(name, _)| *name)
        .collect();
    drop(outcomes);
    let world = std::sync::Arc::into_inner(world).expect("every case is done");
    drop(world.node);
    if failed.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(
        failed.is_empty(),
        "failed cases: {failed:?} (files in {})",
        dir.display()
    );
}

/// Clear-text credentials to a host that is not loopback: refused at build, before any
/// network (the host does not resolve).
#[test]
fn clear_text_credentials_to_a_remote_host_are_refused() {
    for builder in [
        RabbitMq::builder("amqp://app:hunter22@mq.example.invalid:5672/%2f"),
        RabbitMq::builder("amqp://mq.example.invalid:5672/%2f")
            .credentials("app", Secret::new("hunter22")),
    ] {
        let shown = format!("{builder:?}");
        assert!(!shown.contains("hunter22"), "{shown}");
        let e = builder.clone().build().unwrap_err();
        assert!(
            matches!(
                e,
                Error::InsecureCredentials {
                    transport: "rabbitmq",
                    setting: "allow_insecure_credentials",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(!format!("{e} {e:?}").contains("hunter22"));
        let transport = builder.allow_insecure_credentials(true).build().unwrap();
        assert!(!format!("{transport:?}").contains("hunter22"));
    }
    // Loopback, TLS, or no credentials (lapin's public guest/guest): allowed.
    for url in [
        "amqp://app:hunter22@127.0.0.1:5672/%2f",
        "amqp://app:hunter22@localhost:5672/%2f",
        "amqps://app:hunter22@mq.example.invalid:5671/%2f",
        "amqp://mq.example.invalid:5672/%2f",
    ] {
        RabbitMq::builder(url).build().unwrap();
    }
}

/// Unreadable or empty TLS files, and TLS settings for a plain URL, fail at build.
#[test]
fn bad_tls_files_fail_at_build() {
    let dir = temp_dir("files");
    let empty = dir.join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").unwrap();
    for builder in [
        RabbitMq::builder("amqps://localhost:5671/%2f").tls_root_certificates(dir.join("none")),
        RabbitMq::builder("amqps://localhost:5671/%2f").tls_root_certificates(&empty),
        RabbitMq::builder("amqps://localhost:5671/%2f").tls_client_certificate(&empty, &empty),
    ] {
        let e = builder.build().unwrap_err();
        assert_eq!(tls_problem(&e), Some(TlsProblem::BadFile), "{e:?}");
    }
    let e = RabbitMq::builder("amqp://localhost:5672/%2f")
        .tls_root_certificates(Path::new("/x"))
        .build()
        .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
