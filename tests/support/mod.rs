//! Test fixtures: every test gets a database of its own on a real PostgreSQL server.
#![allow(dead_code)]

pub mod brokers;
pub mod certs;
pub mod cluster;
#[path = "../../examples/payment_services/http.rs"]
pub mod http;
pub mod local_pg;
#[cfg(feature = "nats")]
pub mod nats_cluster;
pub mod pg_binaries;
pub mod pooler;
pub mod prometheus;
pub mod wal;

use std::path::PathBuf;
use std::process::Command;
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection, PgPool};
use tokio::sync::OnceCell;

static SERVER_URL: OnceCell<String> = OnceCell::const_new();

/// The server every test database is created on: `DATABASE_URL` when set; else, when
/// `PGBOX_TEST_PG_MAJOR` names a major (the version matrix), a throwaway cluster of that
/// major in `/tmp/pgbox-local-pg-<major>` on port `31400 + major` (below the kernel's ephemeral range, 32768 and up, where a client connection's source port could hold it), started once and reused
/// by every test binary; else the local server or fallback cluster of
/// [`local_pg::database_url`].
pub async fn server_url() -> String {
    SERVER_URL
        .get_or_init(|| async {
            let url = match pg_binaries::matrix_major() {
                Some(major) if std::env::var("DATABASE_URL").is_ok_and(|u| !u.is_empty()) => {
                    panic!(
                        "{}={major} and DATABASE_URL are both set: unset one (the matrix \
                         starts its own server)",
                        pg_binaries::MATRIX_ENV
                    )
                }
                Some(major) => matrix_server(major).await,
                None => local_pg::database_url().await,
            };
            url.unwrap_or_else(|e| panic!("no PostgreSQL for the tests: {e}"))
        })
        .await
        .clone()
}

/// The version matrix's shared server of PostgreSQL `major`, checked to be that major.
async fn matrix_server(major: u32) -> Result<String, String> {
    let bindir = tokio::task::spawn_blocking(move || pg_binaries::bindir(major))
        .await
        .map_err(|e| e.to_string())??;
    let dir = std::path::PathBuf::from(format!("/tmp/pgbox-local-pg-{major}"));
    let port = 31400 + major as u16;
    let url = local_pg::throwaway_url(dir, port, Some(bindir)).await?;
    let mut conn = PgConnection::connect(&url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let version: String = sqlx::query_scalar("SELECT current_setting('server_version_num')")
        .fetch_one(&mut conn)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    conn.close().await.ok();
    let running = version.parse::<u32>().unwrap_or(0) / 10000;
    if running != major {
        return Err(format!(
            "{url} answers with PostgreSQL {version}, not {major} (another server on its port?)"
        ));
    }
    Ok(url)
}

/// A fresh, empty database, dropped (with its connections) when the value is dropped.
/// Set `PGBOX_KEEP_TEST_DBS=1` to keep them for inspection.
pub struct TestDb {
    pub name: String,
    pub pool: PgPool,
    pub options: PgConnectOptions,
    server: String,
}

impl TestDb {
    /// A new empty database; pgbox is not migrated.
    pub async fn empty() -> TestDb {
        let server = server_url().await;
        let name = format!("pgbox_test_{}", uuid::Uuid::now_v7().simple());
        let mut admin = PgConnection::connect(&server)
            .await
            .expect("connect to server");
        admin
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE DATABASE \"{name}\" TEMPLATE template0"
            )))
            .await
            .expect("create test database");
        admin.close().await.ok();
        let options = PgConnectOptions::from_str(&server)
            .expect("server url")
            .database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.clone())
            .await
            .expect("connect to test database");
        TestDb {
            name,
            pool,
            options,
            server,
        }
    }

    /// A new database with pgbox migrated into the default schema.
    pub async fn migrated() -> TestDb {
        let db = Self::empty().await;
        pgbox::migrate(&db.pool).await.expect("migrate");
        db
    }

    /// A URL of this database, for spawned processes.
    pub fn url(&self) -> String {
        let mut url = url::Url::parse(&self.server).expect("server url");
        url.set_path(&self.name);
        url.to_string()
    }

    /// A connection that is not part of the pool (for blocking scenarios and kill tests).
    pub async fn connect(&self) -> PgConnection {
        PgConnection::connect_with(&self.options)
            .await
            .expect("connect")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::env::var_os("PGBOX_KEEP_TEST_DBS").is_some() {
            eprintln!("keeping test database {}", self.name);
            return;
        }
        let server = self.server.clone();
        let name = self.name.clone();
        // Drop runs inside the test's runtime, which cannot be blocked on; use a thread with
        // a runtime of its own. FORCE ends the pool's connections.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&server).await {
                    let _ = admin
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                        )))
                        .await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Waits until some backend of this database is blocked on a lock (the positive signal that
/// a claim is waiting, rather than guessing with a sleep). Panics after 10 s.
pub async fn wait_for_lock_waiter(pool: &PgPool) {
    for _ in 0..1000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no backend started waiting on a lock within 10 s");
}

/// Stops a consumer runner gracefully (its messages in flight settled and acked) and returns
/// its counts; panics unless it stops within `limit`.
pub async fn stop_runner(
    shutdown: tokio_util::sync::CancellationToken,
    run: tokio::task::JoinHandle<pgbox::Result<pgbox::ConsumerStats>>,
    limit: Duration,
) -> pgbox::ConsumerStats {
    shutdown.cancel();
    tokio::time::timeout(limit, run)
        .await
        .expect("the runner stops")
        .unwrap()
        .unwrap()
}

/// Waits (at most `limit`) until the table `effects` holds `n` rows and the built-in queue
/// is empty.
pub async fn settled(pool: &PgPool, n: i64, limit: Duration) -> bool {
    let started = std::time::Instant::now();
    while started.elapsed() < limit {
        let (effects, queued): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM pgbox.queue)",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if effects == n && queued == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Messages with these payloads enqueued into the outbox of `pool` in one transaction, on
/// `topic`, then relayed into the built-in queue (panics unless all are relayed in 100
/// rounds).
pub async fn enqueue_and_relay(pool: &PgPool, topic: &str, payloads: &[String]) {
    let outbox = pgbox::Outbox::new();
    let mut tx = pool.begin().await.unwrap();
    for p in payloads {
        outbox
            .enqueue(&mut tx, pgbox::Message::bytes(topic, p.as_bytes()))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let queue = pgbox::transport::PgQueue::new(pool.clone());
    let relay = pgbox::Relay::builder(pool.clone(), queue).build().unwrap();
    let mut relayed = 0;
    for _ in 0..100 {
        relayed += relay.relay_once().await.unwrap().published;
        if relayed == payloads.len() {
            return;
        }
    }
    panic!("relayed {relayed} of {} messages", payloads.len());
}

/// `<target>/debug/examples/<name>`, next to this test binary's directory; panics unless it
/// is built.
pub fn example_path(name: &str) -> PathBuf {
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

/// Installs Debian's `package` with apt-get (running `apt-get update` first only when the
/// plain install fails), one apt at a time across test binaries. Does nothing when
/// `present()` holds once the lock is taken: another test binary installed it meanwhile.
/// Returns whether apt-get ran; panics when the install fails.
pub fn apt_install(package: &str, present: impl Fn() -> bool) -> bool {
    let lock = std::fs::File::create(std::env::temp_dir().join("pgbox-apt.lock")).unwrap();
    lock.lock().unwrap();
    if present() {
        return false;
    }
    eprintln!("pgbox tests: installing Debian's {package} package with apt-get");
    let install = |update: bool| {
        if update {
            let _ = local_pg::run(Command::new("apt-get").args(["update", "-q"]));
        }
        local_pg::run(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "-y", "-q", "--no-install-recommends", package]),
        )
    };
    install(false)
        .or_else(|_| install(true))
        .unwrap_or_else(|e| panic!("apt-get install {package}: {e}"));
    true
}
