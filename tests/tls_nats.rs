//! The NATS transport over TLS and with credentials, against private `nats-server`
//! processes (on free loopback ports, in a temporary directory removed at the end; never the
//! shared server on 4222), each with certificates from a private authority made for the test.

#![cfg(all(feature = "nats", feature = "testing"))]

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pgbox::transport::conformance::envelope;
use pgbox::transport::nats::Nats;
use pgbox::transport::{Publisher, Subscriber};
use pgbox::{Error, Secret, TlsProblem};
use support::certs::{Issued, Pki, Validity};

const NATS_SERVER: &str = "/usr/sbin/nats-server";
const PASSWORD: &str = "s3cr%t p@ss";
const TOKEN: &str = "t0ken-that-must-not-leak";

/// A throwaway directory, removed on drop (kept and named when the test panics).
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "pgbox-tls-nats-{what}-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("keeping {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// One private `nats-server`, killed on drop.
struct Server {
    port: u16,
    log: PathBuf,
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts a server in `dir` named `name` with the configuration `body` (everything but
    /// `listen`), and waits (bounded) until its port accepts connections.
    fn start(dir: &Path, name: &str, body: &str) -> Server {
        assert!(
            Path::new(NATS_SERVER).exists(),
            "{NATS_SERVER} is not installed (Debian package `nats-server`)"
        );
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.join(format!("{name}.conf"));
        std::fs::write(&config, format!("listen: 127.0.0.1:{port}\n{body}\n")).unwrap();
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(NATS_SERVER)
            .arg("-c")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("spawn nats-server");
        let mut server = Server { port, log, child };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("nats-server exited ({status}): {}", server.logs());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("nats-server not listening after 10 s: {}", server.logs());
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A `tls { ... }` block for `issued`, trusting `ca` for client certificates.
fn tls_block(issued: &Issued, ca: &Path, verify: bool) -> String {
    format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: {verify}\n  timeout: 5\n}}\n",
        issued.cert.display(),
        issued.key.display(),
        ca.display()
    )
}

fn jetstream_block(dir: &Path, name: &str) -> String {
    format!(
        "jetstream {{ store_dir: \"{}\" }}\n",
        dir.join(format!("{name}-store")).display()
    )
}

fn users_block() -> String {
    format!("authorization {{ users = [ {{ user: alice, password: \"{PASSWORD}\" }} ] }}\n")
}

/// A transport that only connects (no streams declared), for the error cases.
fn connect_only(builder: pgbox::transport::nats::NatsBuilder) -> Nats {
    builder.declare(false).build().expect("valid config")
}

/// Connects (the transport connects lazily), bounded so that a reconnect loop fails the
/// test instead of hanging it.
async fn connect(nats: &Nats) -> pgbox::Result<usize> {
    tokio::time::timeout(Duration::from_secs(60), nats.max_payload())
        .await
        .expect("the connection attempt must end (no endless reconnect loop)")
}

fn tls_problem(result: pgbox::Result<usize>) -> (TlsProblem, String) {
    match result {
        Err(Error::Tls {
            problem, reason, ..
        }) => (problem, reason),
        other => panic!("expected Error::Tls, got {other:?}"),
    }
}

fn no_secret(text: &str) {
    for secret in [PASSWORD, "s3cr%25t", TOKEN] {
        assert!(!text.contains(secret), "a secret leaked into: {text}");
    }
}

/// A password from a file, over verified TLS: a message published through the transport is
/// received and acked through it; the same login also works from the URL.
#[tokio::test]
async fn verified_tls_with_password_publishes_and_receives() {
    support::init_tracing();
    let dir = TempDir::new("ok");
    let pki = Pki::new(dir.0.join("pki"), "nats");
    let cert = pki.server("server", &["localhost"], Validity::Current);
    let server = Server::start(
        &dir.0,
        "ok",
        &format!(
            "{}{}{}",
            tls_block(&cert, &pki.ca_cert, false),
            users_block(),
            jetstream_block(&dir.0, "ok")
        ),
    );
    let secret_file = dir.0.join("password");
    std::fs::write(&secret_file, format!("{PASSWORD}\n")).unwrap();
    let builder = Nats::builder(format!("tls://localhost:{}", server.port))
        .tls_root_certificates(&pki.ca_cert)
        .user_password("alice", Secret::from_file(&secret_file).unwrap())
        .receive_wait(Duration::from_secs(2))
        .inactive_threshold(Duration::from_secs(60));
    no_secret(&format!("{builder:?}"));
    let nats = builder.build().unwrap();
    no_secret(&format!("{nats:?}"));
    let topic = "tls.topic";
    nats.declare_topic(topic)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", server.logs()));
    let sent = envelope(topic, b"over tls".to_vec());
    let results = nats.publish(std::slice::from_ref(&sent)).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let mut got = Vec::new();
    for _ in 0..10 {
        got = nats
            .receive(topic, 10, Duration::from_secs(30))
            .await
            .unwrap();
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(got.len(), 1, "the message published over TLS comes back");
    assert_eq!(nats.envelope(&got[0]).id, sent.id);
    assert_eq!(nats.envelope(&got[0]).payload, b"over tls");
    assert!(nats.ack(&got[0]).await.unwrap());

    // The same credentials in the URL (percent-encoded) work too, and show in no Debug.
    let url = format!(
        "tls://alice:{}@localhost:{}",
        PASSWORD
            .replace('%', "%25")
            .replace(' ', "%20")
            .replace('@', "%40"),
        server.port
    );
    let builder = Nats::builder(&url).tls_root_certificates(&pki.ca_cert);
    no_secret(&format!("{builder:?}"));
    connect(&connect_only(builder))
        .await
        .expect("credentials from the URL");

    // A wrong password: refused, typed, at once (no reconnect loop), without the password.
    let wrong = connect_only(
        Nats::builder(format!("tls://localhost:{}", server.port))
            .tls_root_certificates(&pki.ca_cert)
            .user_password("alice", Secret::new("not-the-password")),
    );
    match connect(&wrong).await {
        Err(e @ Error::Authentication { .. }) => {
            let text = e.to_string();
            assert!(!text.contains("not-the-password"), "{text}");
        }
        other => panic!("expected Error::Authentication, got {other:?}"),
    }
    // No credentials at all where the server requires some: the same.
    let none = connect_only(
        Nats::builder(format!("tls://localhost:{}", server.port))
            .tls_root_certificates(&pki.ca_cert),
    );
    assert!(
        matches!(connect(&none).await, Err(Error::Authentication { .. })),
        "no credentials"
    );
}

/// The server's certificate is checked: an unknown authority, a name that is not the
/// dialled host, an expired certificate, and a server that requires TLS reached by a client
/// that did not ask for it (the client upgrades, and verifies).
#[tokio::test]
async fn server_certificates_are_verified() {
    support::init_tracing();
    let dir = TempDir::new("verify");
    let pki = Pki::new(dir.0.join("pki"), "nats");
    let other = Pki::new(dir.0.join("other"), "other");
    let good = pki.server("good", &["localhost"], Validity::Current);
    let expired = pki.server("expired", &["localhost", "127.0.0.1"], Validity::Expired);
    let server = Server::start(
        &dir.0,
        "good",
        &format!("{}{}", tls_block(&good, &pki.ca_cert, false), users_block()),
    );
    let old = Server::start(&dir.0, "expired", &tls_block(&expired, &pki.ca_cert, false));

    // Another authority's CA: the server's certificate has an unknown issuer.
    let nats = connect_only(
        Nats::builder(format!("tls://localhost:{}", server.port))
            .tls_root_certificates(&other.ca_cert),
    );
    let (problem, reason) = tls_problem(connect(&nats).await);
    eprintln!("unknown CA: {reason}");
    assert_eq!(problem, TlsProblem::UnknownIssuer, "{reason}");

    // The certificate names `localhost` only; 127.0.0.1 is dialled.
    let nats = connect_only(
        Nats::builder(format!("tls://127.0.0.1:{}", server.port))
            .tls_root_certificates(&pki.ca_cert),
    );
    let (problem, reason) = tls_problem(connect(&nats).await);
    eprintln!("wrong host: {reason}");
    assert_eq!(problem, TlsProblem::HostnameMismatch, "{reason}");

    // Expired in 2020.
    let nats = connect_only(
        Nats::builder(format!("tls://localhost:{}", old.port)).tls_root_certificates(&pki.ca_cert),
    );
    let (problem, reason) = tls_problem(connect(&nats).await);
    eprintln!("expired: {reason}");
    assert_eq!(problem, TlsProblem::Expired, "{reason}");

    // A plain nats:// URL, require_tls off, no CA file, to a server that requires TLS: the
    // client upgrades when the server's greeting asks (before sending its CONNECT, so the
    // password below never travels in clear), and verifies against the system's roots,
    // which do not know the test authority.
    let nats = connect_only(
        Nats::builder(format!("nats://localhost:{}", server.port))
            .user_password("alice", Secret::new(PASSWORD)),
    );
    let (problem, reason) = tls_problem(connect(&nats).await);
    eprintln!("plain client, TLS server: {reason}");
    assert_eq!(problem, TlsProblem::UnknownIssuer, "{reason}");
    no_secret(&reason);
}

/// A server that verifies client certificates: without one the connection is refused with
/// a typed error; with one from the trusted authority it is accepted.
#[tokio::test]
async fn client_certificates() {
    support::init_tracing();
    let dir = TempDir::new("mtls");
    let pki = Pki::new(dir.0.join("pki"), "nats");
    let cert = pki.server("server", &["localhost"], Validity::Current);
    let client = pki.client("client", "pgbox");
    let server = Server::start(&dir.0, "mtls", &tls_block(&cert, &pki.ca_cert, true));
    let url = format!("tls://localhost:{}", server.port);

    let without = connect_only(Nats::builder(&url).tls_root_certificates(&pki.ca_cert));
    let (problem, reason) = tls_problem(connect(&without).await);
    eprintln!("no client certificate: {reason}");
    assert_eq!(problem, TlsProblem::ClientCertificate, "{reason}");

    let with = connect_only(
        Nats::builder(&url)
            .tls_root_certificates(&pki.ca_cert)
            .tls_client_certificate(&client.cert, &client.key),
    );
    connect(&with)
        .await
        .unwrap_or_else(|e| panic!("with a client certificate: {e}\n{}", server.logs()));

    // Unreadable files are refused at build, without the network.
    let missing = Nats::builder(&url)
        .tls_client_certificate(dir.0.join("none.crt"), &client.key)
        .build();
    assert!(
        matches!(
            missing,
            Err(Error::Tls {
                problem: TlsProblem::BadFile,
                ..
            })
        ),
        "{missing:?}"
    );
}

/// Token authentication over TLS: the right token connects, a wrong one is refused typed.
#[tokio::test]
async fn token_login() {
    support::init_tracing();
    let dir = TempDir::new("token");
    let pki = Pki::new(dir.0.join("pki"), "nats");
    let cert = pki.server("server", &["localhost"], Validity::Current);
    let server = Server::start(
        &dir.0,
        "token",
        &format!(
            "{}authorization {{ token: \"{TOKEN}\" }}\n",
            tls_block(&cert, &pki.ca_cert, false)
        ),
    );
    let url = format!("tls://localhost:{}", server.port);
    let ok = connect_only(
        Nats::builder(&url)
            .tls_root_certificates(&pki.ca_cert)
            .token(Secret::new(TOKEN)),
    );
    connect(&ok).await.expect("the right token");
    let in_url = connect_only(
        Nats::builder(format!("tls://{TOKEN}@localhost:{}", server.port))
            .tls_root_certificates(&pki.ca_cert),
    );
    connect(&in_url).await.expect("the token in the URL");
    let wrong = connect_only(
        Nats::builder(&url)
            .tls_root_certificates(&pki.ca_cert)
            .token(Secret::new("wrong-token")),
    );
    match connect(&wrong).await {
        Err(e @ Error::Authentication { .. }) => no_secret(&e.to_string()),
        other => panic!("expected Error::Authentication, got {other:?}"),
    }
}

/// NKey login: the user's seed signs the server's nonce. Over TLS and, since the seed never
/// travels, also in clear text (to loopback here; to any host at build). Another user's
/// seed is refused typed; a public key or garbage in place of a seed is refused at build;
/// nothing shows the seed.
#[tokio::test]
async fn nkey_login() {
    support::init_tracing();
    let dir = TempDir::new("nkey");
    let pki = Pki::new(dir.0.join("pki"), "nats");
    let cert = pki.server("server", &["localhost"], Validity::Current);
    // Two user key pairs made for this test with the nkeys crate (a dev-dependency only for
    // this would add an ed25519 build to every `cargo test`): seeds and public keys.
    const USER_SEED: &str = "SUAM6SDGLKPTSJLDF2GWT2DL6PJ44F3OFGTUGD5FKNDS3AMMDZFTGQKKAM";
    const USER_PUBLIC: &str = "UCVTNQZOLAPJQIAN43HFT57HUZPJCSSACJBYZ5XDC4MMF3L676L36Y2Q";
    const STRANGER_SEED: &str = "SUAK4P2JELFP2TZSATGDSZGSKWLSS6MVP4DDRLOCS7ESSBAIARICD6MZ64";
    let seed = USER_SEED.to_owned();
    let server = Server::start(
        &dir.0,
        "nkey",
        &format!(
            "{}authorization {{ users = [ {{ nkey: \"{}\" }} ] }}\n",
            tls_block(&cert, &pki.ca_cert, false),
            USER_PUBLIC
        ),
    );
    let url = format!("tls://localhost:{}", server.port);
    let builder = Nats::builder(&url)
        .tls_root_certificates(&pki.ca_cert)
        .nkey(Secret::new(seed.clone()));
    let debug = format!("{builder:?}");
    assert!(!debug.contains(&seed), "{debug}");
    connect(&connect_only(builder))
        .await
        .expect("the user's seed");

    let stranger = STRANGER_SEED.to_owned();
    let wrong = connect_only(
        Nats::builder(&url)
            .tls_root_certificates(&pki.ca_cert)
            .nkey(Secret::new(stranger.clone())),
    );
    match connect(&wrong).await {
        Err(e @ Error::Authentication { .. }) => {
            let text = format!("{e} {e:?}");
            assert!(!text.contains(&stranger), "{text}");
        }
        other => panic!("expected Error::Authentication, got {other:?}"),
    }

    // No TLS: an NKey is not refused as clear-text credentials, even off loopback.
    Nats::builder("nats://nats.example.com:4222")
        .nkey(Secret::new(seed.clone()))
        .build()
        .expect("an NKey's seed is never sent");
    for not_a_seed in [
        USER_PUBLIC.to_owned(),
        "SUNOTASEED".to_owned(),
        String::new(),
    ] {
        match Nats::builder(&url)
            .nkey(Secret::new(not_a_seed.clone()))
            .build()
        {
            Err(Error::InvalidConfig(m)) => {
                assert!(m.contains("seed"), "{m}");
                assert!(not_a_seed.is_empty() || !m.contains(&not_a_seed), "{m}");
            }
            other => panic!("{not_a_seed:?}: expected InvalidConfig, got {other:?}"),
        }
    }
}

/// Passwords and tokens that would cross the network in clear text are refused at build,
/// before any connection (the hosts below do not exist); loopback, TLS or an explicit
/// opt-in allow them. Nothing shows the secrets.
#[test]
fn clear_text_credentials_to_the_network_are_refused() {
    let refused = |builder: pgbox::transport::nats::NatsBuilder| {
        let debug = format!("{builder:?}");
        no_secret(&debug);
        match builder.build() {
            Err(
                e @ Error::InsecureCredentials {
                    transport: "nats",
                    setting: "allow_insecure_credentials",
                    ..
                },
            ) => no_secret(&e.to_string()),
            other => panic!("expected Error::InsecureCredentials, got {other:?}"),
        }
    };
    let encoded = PASSWORD
        .replace('%', "%25")
        .replace(' ', "%20")
        .replace('@', "%40");
    refused(Nats::builder("nats://nats.invalid:4222").user_password("u", Secret::new(PASSWORD)));
    refused(Nats::builder("nats.invalid").token(Secret::new(TOKEN)));
    refused(Nats::builder(format!(
        "nats://u:{encoded}@nats.invalid:4222"
    )));
    refused(Nats::builder(format!("nats://{TOKEN}@10.1.2.3:4222")));
    // One remote server among loopback ones is enough to refuse.
    refused(
        Nats::builder("nats://127.0.0.1:4222,nats://nats.invalid:4222").token(Secret::new(TOKEN)),
    );

    let allowed = |builder: pgbox::transport::nats::NatsBuilder| {
        no_secret(&format!("{builder:?}"));
        let nats = builder.build().expect("allowed");
        no_secret(&format!("{nats:?}"));
    };
    allowed(Nats::builder("tls://nats.invalid:4222").user_password("u", Secret::new(PASSWORD)));
    allowed(
        Nats::builder("nats://nats.invalid:4222")
            .require_tls(true)
            .token(Secret::new(TOKEN)),
    );
    allowed(Nats::builder(format!("nats://u:{encoded}@127.0.0.1:4222")));
    allowed(Nats::builder(format!("nats://{TOKEN}@localhost:4222")));
    allowed(
        Nats::builder("nats://nats.invalid:4222")
            .token(Secret::new(TOKEN))
            .allow_insecure_credentials(true),
    );
    // No credentials: plain text is the user's business.
    allowed(Nats::builder("nats://nats.invalid:4222"));

    // Credentials given twice, or different per server, are a configuration error.
    let twice = Nats::builder(format!("tls://u:{encoded}@nats.invalid:4222"))
        .token(Secret::new(TOKEN))
        .build();
    assert!(matches!(twice, Err(Error::InvalidConfig(_))), "{twice:?}");
    let differ = Nats::builder("tls://a:b@one.invalid:4222,tls://a:c@two.invalid:4222").build();
    assert!(matches!(differ, Err(Error::InvalidConfig(_))), "{differ:?}");
}
