//! PostgreSQL over TLS (issue 40, part 1), on private clusters with certificates from a private
//! authority: `pgbox::connect` with each `sslmode`, SCRAM-SHA-256 and client-certificate
//! logins, the password from `PGPASSWORD` and from a `.pgpass` file, and every refusal as a
//! typed error (`Error::Tls` with its `TlsProblem`, `Error::Authentication`) returned after one
//! attempt; the WAL relay's replication connection over TLS on a cluster that refuses plain
//! text, feeding the built-in queue and a consumer.
#![cfg(feature = "tls")]

mod support;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use pgbox::transport::PgQueue;
use pgbox::{
    Consumer, Envelope, Error, HandlerConnection, Inbox, Message, Outbox, OutboxMode, TlsProblem,
    WalReader, WalRelay, WalSlot,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::certs::{Issued, Pki, Validity};
use support::cluster::Cluster;
use tokio_util::sync::CancellationToken;

const APP_PASSWORD: &str = "app-pw-7f3c9e";
const VICTIM_PASSWORD: &str = "victim-pw-2b8d1a";

/// The shared TLS cluster: `ssl = on` with a certificate for `localhost` only, `wal_level =
/// logical`, and a pg_hba.conf that refuses every TCP connection without TLS.
struct TlsServer {
    cluster: Cluster,
    /// The authority that signed the server's and the client's certificates.
    ca: PathBuf,
    /// Another authority, which signed nothing the server has.
    other_ca: PathBuf,
    /// A client certificate for the role `certuser`.
    client: Issued,
}

/// The shared cluster, started by the first test that needs it and stopped (its directory
/// removed) when the last test holding it ends.
async fn tls_server() -> Arc<TlsServer> {
    static SHARED: tokio::sync::Mutex<Weak<TlsServer>> = tokio::sync::Mutex::const_new(Weak::new());
    let mut shared = SHARED.lock().await;
    if let Some(server) = shared.upgrade() {
        return server;
    }
    let server = Arc::new(tokio::task::spawn_blocking(start_tls_server).await.unwrap());
    *shared = Arc::downgrade(&server);
    server
}

/// The files of a private authority in `dir`, readable by the server's user.
fn own_by_server(dir: &Path) {
    if support::local_pg::is_root() {
        support::local_pg::run(
            std::process::Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir),
        )
        .unwrap();
    }
}

fn start_tls_server() -> TlsServer {
    let cluster = Cluster::start_logical();
    let dir = cluster.dir().join("pki");
    let pki = Pki::new(&dir, "main");
    let server = pki.server("server", &["localhost"], Validity::Current);
    let client = pki.client("certuser", "certuser");
    let other = Pki::new(cluster.dir().join("pki-other"), "other");
    own_by_server(&dir);
    cluster.psql(&format!(
        "CREATE ROLE app LOGIN SUPERUSER REPLICATION PASSWORD '{APP_PASSWORD}'"
    ));
    cluster.psql(&format!(
        "CREATE ROLE victim LOGIN PASSWORD '{VICTIM_PASSWORD}'"
    ));
    cluster.psql("CREATE ROLE certuser LOGIN");
    for setting in [
        "ssl = on".to_owned(),
        format!("ssl_cert_file = '{}'", server.cert.display()),
        format!("ssl_key_file = '{}'", server.key.display()),
        format!("ssl_ca_file = '{}'", pki.ca_cert.display()),
        "log_connections = on".to_owned(),
        "password_encryption = 'scram-sha-256'".to_owned(),
    ] {
        cluster.psql(&format!("ALTER SYSTEM SET {setting}"));
    }
    // The administrator (`psql` as postgres, over TLS by libpq's default `prefer`) is
    // trusted; everyone else logs in with SCRAM or a client certificate, over TLS only.
    std::fs::write(
        cluster.dir().join("data").join("pg_hba.conf"),
        "local all all trust\n\
         hostssl all postgres 127.0.0.1/32 trust\n\
         hostssl all certuser 127.0.0.1/32 cert\n\
         hostssl all all 127.0.0.1/32 scram-sha-256\n\
         hostnossl all all 0.0.0.0/0 reject\n",
    )
    .unwrap();
    cluster.pg_ctl(&["-m", "fast", "restart"]);
    assert_eq!(cluster.psql("SHOW ssl"), "on");
    TlsServer {
        ca: pki.ca_cert.clone(),
        other_ca: other.ca_cert.clone(),
        client,
        cluster,
    }
}

impl TlsServer {
    fn port(&self) -> u16 {
        self.cluster.port()
    }

    /// `postgres://app:…@{host}:{port}/{database}?{query}`.
    fn app_url(&self, host: &str, database: &str, query: &str) -> String {
        format!(
            "postgres://app:{APP_PASSWORD}@{host}:{}/{database}?{query}",
            self.port()
        )
    }

    /// `sslmode=verify-full&sslrootcert=<our CA>`.
    fn verify_full(&self) -> String {
        format!("sslmode=verify-full&sslrootcert={}", self.ca.display())
    }
}

fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
}

/// Whether this pool's connection is encrypted (`pg_stat_ssl`).
async fn on_tls(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The `TlsProblem` of `result`, panicking with what it was otherwise; the error's text never
/// holds a password.
fn tls_problem<T: std::fmt::Debug>(result: pgbox::Result<T>) -> TlsProblem {
    match result {
        Err(e @ Error::Tls { .. }) => {
            let text = format!("{e} / {e:?}");
            assert!(!text.contains(APP_PASSWORD), "{text}");
            eprintln!("error text: {e}");
            match e {
                Error::Tls { problem, .. } => problem,
                _ => unreachable!(),
            }
        }
        other => panic!("expected Error::Tls, got {other:?}"),
    }
}

#[tokio::test]
async fn verify_full_by_name_connects_over_tls_with_scram() {
    let server = tls_server().await;
    let url = server.app_url("localhost", "postgres", &server.verify_full());
    let pool = pgbox::connect(&url, pool_options()).await.unwrap();
    assert!(on_tls(&pool).await);
    let version: String =
        sqlx::query_scalar("SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(version.starts_with("TLSv1."), "{version}");
    pool.close().await;
    // The server's log names the method that authenticated app: SCRAM, as pg_hba.conf says.
    let log = server.cluster.log();
    assert!(
        log.contains("identity=\"app\" method=scram-sha-256"),
        "no SCRAM login of app in the server's log"
    );
}

#[tokio::test]
async fn a_certificate_for_another_name_is_a_hostname_mismatch_and_verify_ca_accepts_it() {
    let server = tls_server().await;
    // The certificate names localhost only; 127.0.0.1 is not in it.
    let url = server.app_url("127.0.0.1", "postgres", &server.verify_full());
    let problem = tls_problem(pgbox::connect(&url, pool_options()).await);
    assert_eq!(problem, TlsProblem::HostnameMismatch);
    // verify-ca checks the authority, not the name.
    let url = server.app_url(
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-ca&sslrootcert={}", server.ca.display()),
    );
    let pool = pgbox::connect(&url, pool_options()).await.unwrap();
    assert!(on_tls(&pool).await);
    pool.close().await;
}

#[tokio::test]
async fn a_certificate_of_an_unknown_authority_is_refused() {
    let server = tls_server().await;
    let url = server.app_url(
        "localhost",
        "postgres",
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            server.other_ca.display()
        ),
    );
    let problem = tls_problem(pgbox::connect(&url, pool_options()).await);
    assert_eq!(problem, TlsProblem::UnknownIssuer);
    // Without sslrootcert, the system's authorities do not know ours either.
    let url = server.app_url("localhost", "postgres", "sslmode=verify-full");
    assert_eq!(
        tls_problem(pgbox::connect(&url, pool_options()).await),
        TlsProblem::UnknownIssuer
    );
    // sslrootcert=system: the system's authorities alone, verify-full implied.
    let url = server.app_url("localhost", "postgres", "sslrootcert=system");
    assert_eq!(
        tls_problem(pgbox::connect(&url, pool_options()).await),
        TlsProblem::UnknownIssuer
    );
}

#[tokio::test]
async fn a_wrong_password_is_an_authentication_error_after_one_attempt() {
    let server = tls_server().await;
    let url = format!(
        "postgres://victim:not-{VICTIM_PASSWORD}@localhost:{}/postgres?{}",
        server.port(),
        server.verify_full()
    );
    let err = pgbox::connect(&url, pool_options()).await.unwrap_err();
    eprintln!("error text: {err}");
    match &err {
        Error::Authentication { target, reason } => {
            assert!(reason.contains("28P01"), "{reason}");
            assert!(!target.contains(VICTIM_PASSWORD) && !reason.contains(VICTIM_PASSWORD));
        }
        other => panic!("{other:?}"),
    }
    // The server saw exactly one attempt. (Its log line is written before the error is sent.)
    let attempts = server
        .cluster
        .log()
        .matches("password authentication failed for user \"victim\"")
        .count();
    assert_eq!(attempts, 1);

    // No such role: authentication too (SCRAM reports it as a failed password).
    let url = format!(
        "postgres://nobody:x@localhost:{}/postgres?{}",
        server.port(),
        server.verify_full()
    );
    let err = pgbox::connect(&url, pool_options()).await.unwrap_err();
    eprintln!("error text: {err}");
    assert!(matches!(err, Error::Authentication { .. }), "{err:?}");

    // Plain text is refused by pg_hba.conf (28000): authentication, not a connection error.
    let url = server.app_url("localhost", "postgres", "sslmode=disable");
    let err = pgbox::connect(&url, pool_options()).await.unwrap_err();
    eprintln!("error text: {err}");
    match &err {
        Error::Authentication { reason, .. } => assert!(reason.contains("28000"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_client_certificate_logs_in_and_its_absence_is_refused_typed() {
    let server = tls_server().await;
    let url = format!(
        "postgres://certuser@localhost:{}/postgres?{}&sslcert={}&sslkey={}",
        server.port(),
        server.verify_full(),
        server.client.cert.display(),
        server.client.key.display()
    );
    let pool = pgbox::connect(&url, pool_options()).await.unwrap();
    assert!(on_tls(&pool).await);
    let client_dn: Option<String> =
        sqlx::query_scalar("SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        client_dn
            .as_deref()
            .is_some_and(|dn| dn.contains("certuser")),
        "{client_dn:?}"
    );
    pool.close().await;

    let without = format!(
        "postgres://certuser@localhost:{}/postgres?{}",
        server.port(),
        server.verify_full()
    );
    assert_eq!(
        tls_problem(pgbox::connect(&without, pool_options()).await),
        TlsProblem::ClientCertificate
    );
}

/// The child half of [`the_password_and_tls_settings_come_from_the_environment`]: connects
/// with what the environment gives (run by that test in a process of its own, as the
/// environment is the whole process's).
#[tokio::test]
#[ignore = "run by the_password_and_tls_settings_come_from_the_environment"]
async fn child_connects_with_the_environments_settings() {
    let url = std::env::var("PGBOX_TLS_CHILD_URL").expect("run by the parent test");
    let pool = pgbox::connect(&url, pool_options()).await.unwrap();
    assert!(on_tls(&pool).await);
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    let expected = std::env::var("PGBOX_TLS_CHILD_USER").expect("run by the parent test");
    assert_eq!(user, expected);
    pool.close().await;
}

#[tokio::test]
async fn the_password_and_tls_settings_come_from_the_environment() {
    let server = tls_server().await;
    // No password, no sslmode, no sslrootcert in the URL.
    let url = format!("postgres://app@localhost:{}/postgres", server.port());
    let passfile = server.cluster.dir().join("pgpass");
    std::fs::write(
        &passfile,
        format!("localhost:{}:*:app:{APP_PASSWORD}\n", server.port()),
    )
    .unwrap();
    std::fs::set_permissions(
        &passfile,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let run_as = |url: &str, user: &str, settings: &[(&str, &str)]| {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child
            .args([
                "--exact",
                "child_connects_with_the_environments_settings",
                "--ignored",
                "--test-threads=1",
            ])
            .env("PGBOX_TLS_CHILD_URL", url)
            .env("PGBOX_TLS_CHILD_USER", user)
            .env("PGSSLMODE", "verify-full")
            .env("PGSSLROOTCERT", &server.ca);
        for name in ["PGPASSWORD", "PGPASSFILE", "PGSSLCERT", "PGSSLKEY"] {
            child.env_remove(name);
        }
        child.envs(settings.iter().copied());
        let out = child.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success() && text.contains("1 passed"), text)
    };
    let run = |setting: (&str, &str)| run_as(&url, "app", &[setting]);
    let (ok, text) = run(("PGPASSWORD", APP_PASSWORD));
    assert!(ok, "PGPASSWORD: {text}");
    let (ok, text) = run(("PGPASSFILE", passfile.to_str().unwrap()));
    assert!(ok, "PGPASSFILE: {text}");
    // And the child can fail: a wrong password in the environment.
    let (ok, text) = run(("PGPASSWORD", "wrong"));
    assert!(!ok, "{text}");
    assert!(text.contains("Authentication"), "{text}");
    // The client certificate from PGSSLCERT and PGSSLKEY.
    let cert_url = format!("postgres://certuser@localhost:{}/postgres", server.port());
    let (ok, text) = run_as(
        &cert_url,
        "certuser",
        &[
            ("PGSSLCERT", server.client.cert.to_str().unwrap()),
            ("PGSSLKEY", server.client.key.to_str().unwrap()),
        ],
    );
    assert!(ok, "PGSSLCERT/PGSSLKEY: {text}");
    let (ok, text) = run_as(&cert_url, "certuser", &[]);
    assert!(!ok && text.contains("ClientCertificate"), "{text}");
}

/// An outbox message (WAL mode) read by the relay's streaming reader over a verify-full
/// replication connection (the cluster refuses plain text), published into the built-in
/// queue, and handled by a consumer: every hop over TLS.
#[tokio::test]
async fn the_wal_relay_streams_over_tls_into_the_queue_and_a_consumer() {
    let server = tls_server().await;
    let database = "relay_tls";
    server
        .cluster
        .psql(&format!("CREATE DATABASE {database} OWNER app"));
    let url = server.app_url("localhost", database, &server.verify_full());
    let pool = pgbox::connect(&url, pool_options()).await.unwrap();
    assert!(on_tls(&pool).await);
    pgbox::migrate(&pool).await.unwrap();
    let slot = WalSlot::new("pgbox_tls_relay").unwrap();
    slot.create(&pool).await.unwrap();

    let outbox = Outbox::new().mode(OutboxMode::Wal);
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, Message::bytes("tls", b"over tls".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let relay = WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
        .reader(WalReader::Stream)
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 1, "{report:?}");

    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let consumer = Consumer::builder(
        pool.clone(),
        PgQueue::new(pool.clone()),
        "tls",
        Inbox::new("tls").unwrap(),
    )
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            consumer
                .run(
                    async move |e: &Envelope, _conn: &mut HandlerConnection<'_>| {
                        let _ = seen_tx.send(e.payload.to_vec());
                        Ok::<(), anyhow::Error>(())
                    },
                    shutdown,
                )
                .await
        }
    });
    let payload = tokio::time::timeout(Duration::from_secs(60), seen.recv())
        .await
        .expect("the consumer got nothing within 60 s")
        .unwrap();
    assert_eq!(payload, b"over tls");
    let stats = support::stop_runner(shutdown, run, Duration::from_secs(60)).await;
    assert_eq!(stats.processed, 1, "{stats:?}");

    slot.drop(&pool).await.ok();
    pool.close().await;
}

/// A server without TLS, then with a certificate for its IP address, then with an expired one
/// and one not valid yet: `require` finds no TLS, `prefer` connects in plain text,
/// `verify-full` by IP address connects once the server has TLS, and the expired and future
/// certificates are refused as such. Its own cluster: its certificate is swapped under it.
#[tokio::test]
async fn no_tls_then_an_ip_address_certificate_then_expired_ones() {
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port());

    assert_eq!(cluster.psql("SHOW ssl"), "off");
    let err = pgbox::connect(&format!("{base}?sslmode=require"), pool_options()).await;
    assert_eq!(tls_problem(err), TlsProblem::NotOffered);
    let plain = pgbox::connect(&format!("{base}?sslmode=prefer"), pool_options())
        .await
        .unwrap();
    assert!(!on_tls(&plain).await);
    plain.close().await;

    let dir = cluster.dir().join("pki");
    let pki = Pki::new(&dir, "ip");
    let current = pki.server("current", &["127.0.0.1"], Validity::Current);
    let expired = pki.server("expired", &["127.0.0.1"], Validity::Expired);
    let future = pki.server("future", &["127.0.0.1"], Validity::Future);
    // The server reads these two paths; each step copies another certificate into them.
    let served = Issued {
        cert: dir.join("served.crt"),
        key: dir.join("served.key"),
    };
    let serve = |issued: &Issued| {
        std::fs::copy(&issued.cert, &served.cert).unwrap();
        std::fs::copy(&issued.key, &served.key).unwrap();
        std::fs::set_permissions(
            &served.key,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        own_by_server(&dir);
    };
    serve(&current);
    for setting in [
        "ssl = on".to_owned(),
        format!("ssl_cert_file = '{}'", served.cert.display()),
        format!("ssl_key_file = '{}'", served.key.display()),
    ] {
        cluster.psql(&format!("ALTER SYSTEM SET {setting}"));
    }
    cluster.psql("SELECT pg_reload_conf()");
    let verify_full = format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        pki.ca_cert.display()
    );
    // The postmaster applies the reload on its own time: wait, bounded, for the first
    // connection that sees it.
    let mut outcome = None;
    for _ in 0..100 {
        match pgbox::connect(&verify_full, pool_options()).await {
            Ok(pool) => {
                outcome = Some(pool);
                break;
            }
            Err(Error::Tls {
                problem: TlsProblem::NotOffered,
                ..
            }) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(other) => panic!("{other:?}"),
        }
    }
    let pool = outcome.expect("the server never offered TLS after the reload");
    assert!(on_tls(&pool).await);
    pool.close().await;

    for (issued, what) in [(&expired, "expired"), (&future, "not yet valid")] {
        serve(issued);
        cluster.psql("SELECT pg_reload_conf()");
        let mut problem = None;
        for _ in 0..100 {
            match pgbox::connect(&verify_full, pool_options()).await {
                Ok(pool) => {
                    pool.close().await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                err => {
                    problem = Some(tls_problem(err));
                    break;
                }
            }
        }
        assert_eq!(problem, Some(TlsProblem::Expired), "{what}");
    }
}
