//! No password, token or key given to pgbox shows up anywhere pgbox writes: log lines at every
//! level (pgbox's, sqlx's and lapin's, TRACE included), error messages, `Debug` output of
//! configurations, builders and handles, panic reports, the metrics it exports, and the
//! `pgbox` command's output (text and `--json`, with `RUST_LOG=trace`).
//!
//! The test makes its own secrets (unique per run, with characters a URL must encode) and a
//! private PostgreSQL cluster that checks passwords (SCRAM; the shared server trusts every
//! local login, so a password there would never be sent, let alone refused). It runs a
//! realistic session with them, collects everything that was written, and fails naming each
//! place a secret (raw or URL-encoded) appeared.

mod support;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::transport::rabbitmq::RabbitMq;
use pgbox::{
    CancellationToken, Consumer, Envelope, Error, HandlerConnection, Inbox, Message, Migrator,
    Outbox, Relay, RetryPolicy, Secret,
};
use sqlx::postgres::PgPoolOptions;
use support::cluster::Cluster;
use tracing_subscriber::fmt::MakeWriter;

/// Everything the tracing subscriber wrote.
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

/// A TRACE subscriber for every target (log records of crates that use `log` included),
/// writing into [`LOGS`].
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

/// `text` percent-encoded as in a URL's user-info: everything but the unreserved characters.
fn url_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// What was written, by where it was written.
#[derive(Default)]
struct Haystack(Vec<(String, String)>);

impl Haystack {
    fn add(&mut self, place: impl Into<String>, text: impl Into<String>) {
        self.0.push((place.into(), text.into()));
    }

    fn add_output(&mut self, place: &str, out: &Output) {
        self.add(
            format!("{place}: stdout"),
            String::from_utf8_lossy(&out.stdout),
        );
        self.add(
            format!("{place}: stderr"),
            String::from_utf8_lossy(&out.stderr),
        );
    }

    /// Each place where one of `secrets` (named by its key) appears, raw or URL-encoded
    /// (in either case of hex digits).
    fn leaks(&self, secrets: &BTreeMap<&str, String>) -> Vec<String> {
        let mut found = Vec::new();
        for (place, text) in &self.0 {
            let lower = text.to_lowercase();
            for (name, secret) in secrets {
                let encoded = url_encoded(secret).to_lowercase();
                if text.contains(secret.as_str()) {
                    found.push(format!("the {name} in {place}"));
                } else if lower.contains(&encoded) {
                    found.push(format!("the {name}, URL-encoded, in {place}"));
                }
            }
        }
        found
    }
}

/// Runs the `pgbox` command with `args` and `env` (and `RUST_LOG=trace`), with none of the
/// caller's PostgreSQL settings and a `HOME` without a `.pgpass`.
fn pgbox_cli(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_pgbox"));
    command
        .args(args)
        .env("RUST_LOG", "trace")
        .env("RUST_BACKTRACE", "1")
        .env("HOME", home);
    for var in [
        "DATABASE_URL",
        "PGPASSWORD",
        "PGPASSFILE",
        "PGUSER",
        "PGHOST",
        "PGPORT",
        "PGDATABASE",
        "PGSSLMODE",
    ] {
        command.env_remove(var);
    }
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("run the pgbox command")
}

/// A command line expected to fail: what it tries, its arguments, its environment, the exit
/// code it must end with.
type FailingRun<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>, i32);

/// Runs `program` with `args` and `env` (and `RUST_LOG=trace`), its output in files under
/// `dir`; kills it if it is still running after 60 s (and fails). Whether it succeeded, its
/// stdout and stderr.
fn run_bounded(
    program: &Path,
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (bool, String, String) {
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let mut command = Command::new(program);
    command
        .args(args)
        .env("RUST_LOG", "trace")
        .env("HOME", dir)
        .env_remove("DATABASE_URL")
        .env_remove("PGPASSWORD")
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("start the example");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{program:?} {args:?} still ran after 60 s: {}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (
        status.success(),
        std::fs::read_to_string(&out_path).unwrap(),
        std::fs::read_to_string(&err_path).unwrap(),
    )
}

fn code(out: &Output) -> Option<i32> {
    out.status.code()
}

#[test]
fn no_secret_appears_in_logs_errors_debug_output_metrics_or_the_cli() {
    let logs = capture_logs();
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("the only metrics recorder of this test binary");

    let run = uuid::Uuid::now_v7().simple().to_string();
    // Characters that must be encoded in a URL (@ / : %), so the encoded form differs.
    let password = format!("Pw{run}@a/b:c%d");
    let wrong_password = format!("Wrong{run}@x");
    let rabbit_password = format!("Rb{run}@y");
    let token = format!("Tk{run}");
    let secrets: BTreeMap<&str, String> = [
        ("database password", password.clone()),
        ("wrong database password", wrong_password.clone()),
        ("RabbitMQ password", rabbit_password.clone()),
        ("Secret token", token.clone()),
    ]
    .into();

    // A private cluster that checks passwords: `postgres` keeps its trust login (for the
    // test's own administration through psql), every other role needs SCRAM.
    let cluster = Cluster::start();
    let role = format!("leak_{run}");
    let database = format!("leak_db_{run}");
    cluster.psql(&format!(
        "CREATE ROLE {role} LOGIN CREATEDB PASSWORD '{}'",
        password.replace('\'', "''")
    ));
    cluster.psql(&format!("CREATE DATABASE {database} OWNER {role}"));
    std::fs::write(
        cluster.dir().join("data").join("pg_hba.conf"),
        "local all all trust\n\
         host all postgres 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 scram-sha-256\n",
    )
    .unwrap();
    cluster.psql("SELECT pg_reload_conf()");
    let port = cluster.port();
    let url = format!(
        "postgres://{role}:{}@127.0.0.1:{port}/{database}",
        url_encoded(&password)
    );
    let bare_url = format!("postgres://{role}@127.0.0.1:{port}/{database}");
    let wrong_url = format!(
        "postgres://{role}:{}@127.0.0.1:{port}/{database}",
        url_encoded(&wrong_password)
    );
    let admin_url = format!(
        "postgres://{role}:{}@127.0.0.1:{port}/postgres",
        url_encoded(&password)
    );
    // Port 1 on loopback: nothing listens there.
    let unreachable_url = format!(
        "postgres://{role}:{}@127.0.0.1:1/{database}",
        url_encoded(&password)
    );
    let bad_sslmode_url = format!("{url}?sslmode=sometimes");
    let rabbit_url = format!(
        "amqp://pgbox-leak-{run}:{}@127.0.0.1:5672/%2f",
        url_encoded(&rabbit_password)
    );
    // The testing kit's databases are made on the server this variable names. Set before the
    // runtime starts a thread (this binary holds this one test).
    // SAFETY: no other thread of this process reads or writes the environment yet.
    unsafe { std::env::set_var("PGBOX_TEST_DATABASE_URL", &admin_url) };

    let mut seen = Haystack::default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The password as a query parameter, which sqlx also takes.
    let wrong_in_query = format!("{bare_url}?password={}", url_encoded(&wrong_password));
    let bad_sslmode_in_query = format!(
        "{bare_url}?password={}&sslmode=sometimes",
        url_encoded(&password)
    );
    runtime.block_on(library_session(
        &mut seen,
        &url,
        &[
            ("a wrong password", wrong_url.as_str()),
            ("a wrong password in the query", wrong_in_query.as_str()),
            ("an unreachable server", unreachable_url.as_str()),
            ("a bad sslmode", bad_sslmode_url.as_str()),
            (
                "a bad sslmode, the password in the query",
                bad_sslmode_in_query.as_str(),
            ),
        ],
        &rabbit_url,
        &token,
    ));
    drop(runtime);

    // The command line: the URL on the command line, in DATABASE_URL, and without a
    // password (PGPASSWORD, a .pgpass file): each must log in, as SCRAM checks.
    let home = std::env::temp_dir().join(format!("pgbox-leak-home-{run}"));
    std::fs::create_dir_all(&home).unwrap();
    let pgpass = home.join("pgpass");
    std::fs::write(
        &pgpass,
        format!(
            "127.0.0.1:{port}:{database}:{role}:{}\n",
            password.replace('\\', "\\\\").replace(':', "\\:")
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let pgpass = pgpass.to_str().unwrap();
    let mut successes = Vec::new();
    for (how, url_arg, env) in [
        ("--database-url", Some(url.as_str()), vec![]),
        ("DATABASE_URL", None, vec![("DATABASE_URL", url.as_str())]),
        (
            "PGPASSWORD",
            None,
            vec![
                ("DATABASE_URL", bare_url.as_str()),
                ("PGPASSWORD", password.as_str()),
            ],
        ),
        (
            "PGPASSFILE",
            None,
            vec![("DATABASE_URL", bare_url.as_str()), ("PGPASSFILE", pgpass)],
        ),
    ] {
        for command in [
            &["migrate"][..],
            &["status"],
            &["doctor"],
            &["dead-letters", "list"],
            &["dead-letters", "--queue", "list"],
        ] {
            for json in [false, true] {
                let mut args = Vec::new();
                if let Some(u) = url_arg {
                    args.extend(["--database-url", u]);
                }
                if json {
                    args.push("--json");
                }
                args.extend_from_slice(command);
                let out = pgbox_cli(&home, &args, &env);
                let place = format!("`pgbox {}` (URL by {how})", command.join(" "));
                // 0, or the doctor's 7/8 for warnings: anything but a failed login (3).
                successes.push((place.clone(), code(&out)));
                seen.add_output(&place, &out);
            }
        }
    }
    for (place, code) in &successes {
        assert!(
            matches!(code, Some(0 | 7 | 8)),
            "{place} did not log in and run: exit {code:?}"
        );
    }

    // Failing command lines.
    let failing: Vec<FailingRun> = vec![
        (
            "wrong password in the URL",
            vec!["--database-url", &wrong_url, "status"],
            vec![],
            3,
        ),
        (
            "wrong PGPASSWORD",
            vec!["status"],
            vec![
                ("DATABASE_URL", bare_url.as_str()),
                ("PGPASSWORD", wrong_password.as_str()),
            ],
            3,
        ),
        (
            "unreachable server",
            vec!["--database-url", &unreachable_url, "doctor"],
            vec![],
            3,
        ),
        (
            "bad sslmode",
            vec!["--database-url", &bad_sslmode_url, "status"],
            vec![],
            3,
        ),
        (
            "a usage error after the URL",
            vec!["--database-url", &url, "--no-such-flag", "status"],
            vec![],
            2,
        ),
        (
            "a bad argument value after the URL",
            vec!["--database-url", &url, "purge", "--older-than", "soon"],
            vec![],
            2,
        ),
        (
            "--help with the URL in the environment",
            vec!["--help"],
            vec![("DATABASE_URL", url.as_str())],
            0,
        ),
    ];
    for (what, args, env, expected) in failing {
        for json in [false, true] {
            let mut args = args.clone();
            if json {
                args.insert(0, "--json");
            }
            let out = pgbox_cli(&home, &args, &env);
            assert_eq!(
                code(&out),
                Some(expected),
                "pgbox with {what} (json: {json}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
            seen.add_output(&format!("`pgbox` with {what} (json: {json})"), &out);
        }
    }

    // The payment services example: its --help with the URLs in the environment, a start
    // with a refused database password, and one whose broker settings it must refuse.
    let services = support::example_path("payment_services");
    for (what, args, env, must_succeed) in [
        (
            "--help",
            &["payments", "--help"][..],
            vec![
                ("DATABASE_URL", url.as_str()),
                ("BROKER_URL", rabbit_url.as_str()),
            ],
            true,
        ),
        (
            "a wrong database password",
            &["payments"],
            vec![
                ("DATABASE_URL", wrong_url.as_str()),
                ("LISTEN", "127.0.0.1:0"),
            ],
            false,
        ),
        (
            "broker TLS settings it cannot apply",
            &["points"],
            vec![
                ("DATABASE_URL", url.as_str()),
                ("LISTEN", "127.0.0.1:0"),
                ("TRANSPORT", "rabbitmq"),
                ("BROKER_URL", rabbit_url.as_str()),
                ("PGBOX_BROKER_CA_FILE", "/nonexistent/ca.pem"),
            ],
            false,
        ),
    ] {
        let (status, stdout, stderr) = run_bounded(&services, &home, args, &env);
        assert_eq!(
            status, must_succeed,
            "payment_services with {what}: {stderr}"
        );
        seen.add(format!("payment_services with {what}: stdout"), stdout);
        seen.add(format!("payment_services with {what}: stderr"), stderr);
    }
    std::fs::remove_dir_all(&home).unwrap();

    seen.add("the Prometheus metrics", metrics.render());
    seen.add(
        "the TRACE log",
        String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned(),
    );
    let log_len = logs.0.lock().unwrap().len();
    assert!(log_len > 0, "nothing was logged: the capture does not work");

    // PGBOX_SECRETS_TEST_DUMP=<file>: everything that was searched, to read by hand.
    if let Some(dump) = std::env::var_os("PGBOX_SECRETS_TEST_DUMP") {
        let text: String = seen
            .0
            .iter()
            .map(|(place, text)| format!("===== {place}\n{text}\n"))
            .collect();
        std::fs::write(dump, text).unwrap();
    }
    let leaks = seen.leaks(&secrets);
    assert!(
        leaks.is_empty(),
        "secrets leaked ({}):\n{}",
        leaks.len(),
        leaks.join("\n")
    );
    // The finder finds: a haystack that holds each secret reports it.
    let mut canary = Haystack::default();
    canary.add("canary", format!("x{}y {}", password, url_encoded(&token)));
    assert_eq!(canary.leaks(&secrets).len(), 2);
    drop(cluster);
}

/// The library's part: connect, migrate, enqueue, relay, consume (with a panicking handler),
/// the janitor, status, the doctor, the testing kit, failures, and `Debug` of everything.
async fn library_session(
    seen: &mut Haystack,
    url: &str,
    failing: &[(&str, &str)],
    rabbit_url: &str,
    token: &str,
) {
    let options = || PgPoolOptions::new().max_connections(4);
    let pool = pgbox::connect(url, options())
        .await
        .expect("log in with the password");
    seen.add("Debug of the pool", format!("{pool:?}"));
    let report = pgbox::migrate(&pool).await.unwrap();
    seen.add("Debug of the migration report", format!("{report:?}"));
    seen.add("Debug of a Migrator", format!("{:?}", Migrator::new()));

    // Three messages through the outbox, relayed into the built-in queue.
    let outbox = Outbox::new();
    let mut tx = pool.begin().await.unwrap();
    for payload in ["one", "two", "panic"] {
        outbox
            .enqueue(&mut tx, Message::bytes("leak-orders", payload))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let queue = PgQueue::new(pool.clone());
    let builder = Relay::builder(pool.clone(), queue.clone());
    seen.add("Debug of a RelayBuilder", format!("{builder:?}"));
    let relay = builder.build().unwrap();
    seen.add("Debug of a Relay", format!("{relay:?}"));
    let round = relay.relay_once().await.unwrap();
    seen.add("Debug of a relay round", format!("{round:?}"));
    seen.add("Debug of a PgQueue", format!("{queue:?}"));

    // A consumer whose handler panics once.
    let builder = Consumer::builder(
        pool.clone(),
        queue.clone(),
        "leak-orders",
        Inbox::new("leak-consumer").unwrap(),
    )
    .key(|e: &Envelope| String::from_utf8_lossy(&e.payload).into_owned())
    .max_deliveries(3)
    .backoff(RetryPolicy::new().base_delay(Duration::from_millis(5)))
    .poll_interval(Duration::from_millis(20));
    seen.add("Debug of a ConsumerBuilder", format!("{builder:?}"));
    let consumer = builder.build().unwrap();
    seen.add("Debug of a Consumer", format!("{consumer:?}"));
    let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        let panicked = panicked.clone();
        async move {
            consumer
                .run(
                    async move |e: &Envelope, _conn: &mut HandlerConnection<'_>| {
                        if e.payload == b"panic"
                            && !panicked.swap(true, std::sync::atomic::Ordering::SeqCst)
                        {
                            panic!("a handler bug");
                        }
                        Ok::<_, Error>(())
                    },
                    shutdown,
                )
                .await
        }
    });
    let started = Instant::now();
    loop {
        let processed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = 'leak-consumer'")
                .fetch_one(&pool)
                .await
                .unwrap();
        if processed == 3 || running.is_finished() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the consumer did not process the three messages in 60 s ({processed})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = running
        .await
        .expect("the runner survived the panic")
        .unwrap();
    assert_eq!(stats.panicked, 1, "{stats:?}");
    seen.add("Debug of consumer stats", format!("{stats:?}"));

    // The janitor, status and the doctor.
    let builder = pgbox::janitor::Janitor::builder(pool.clone());
    seen.add("Debug of a JanitorBuilder", format!("{builder:?}"));
    let janitor = builder.build().unwrap();
    seen.add("Debug of a Janitor", format!("{janitor:?}"));
    let pass = janitor.run_once().await.unwrap();
    seen.add("Debug of a janitor pass", format!("{pass:?}"));
    let status = pgbox::status(&pool, "pgbox").await.unwrap();
    seen.add("Debug of status", format!("{status:?}"));
    let doctor = pgbox::doctor::check(&pool, "pgbox").await.unwrap();
    seen.add("Debug of a doctor report", format!("{doctor:?}"));

    // A relay into RabbitMQ with a wrong password: the error is logged, stored with the
    // message (dead-lettered after one attempt) and shown by `pgbox dead-letters list`.
    let rabbit_builder = RabbitMq::builder(rabbit_url).queue_expires(Duration::from_secs(60));
    seen.add("Debug of a RabbitMqBuilder", format!("{rabbit_builder:?}"));
    let rabbit = rabbit_builder.build().unwrap();
    seen.add("Debug of a RabbitMq", format!("{rabbit:?}"));
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, Message::bytes("leak-rabbit", "to the broker"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let rabbit_relay = Relay::builder(pool.clone(), rabbit)
        .max_attempts(1)
        .build()
        .unwrap();
    match rabbit_relay.relay_once().await {
        Ok(round) => seen.add("a relay round into RabbitMQ", format!("{round:?}")),
        Err(e) => seen.add("a relay round into RabbitMQ's error", format!("{e} {e:?}")),
    }
    let stored: Vec<String> =
        sqlx::query_scalar("SELECT coalesce(last_error, '') FROM pgbox.outbox_dead_letters")
            .fetch_all(&pool)
            .await
            .unwrap();
    seen.add("the outbox's dead letters' errors", stored.join("\n"));

    // The testing kit, on the server PGBOX_TEST_DATABASE_URL names (with the password).
    let test_db = pgbox::testing::TestDatabase::new().await.unwrap();
    seen.add("Debug of a TestDatabase", format!("{test_db:?}"));
    test_db.close().await.unwrap();

    // Secret itself.
    let secret = Secret::new(token);
    seen.add(
        "Debug and Display of a Secret",
        format!("{secret:?} {secret}"),
    );

    // Failures.
    for (what, bad) in failing {
        let e = pgbox::connect(bad, options())
            .await
            .expect_err("must not connect");
        seen.add(format!("pgbox::connect with {what}"), format!("{e}\n{e:?}"));
    }
    let e = pgbox::connect(&format!("{url}?sslmode=require"), options())
        .await
        .map(|_| ())
        .err();
    seen.add("pgbox::connect with sslmode=require", format!("{e:?}"));
    pool.close().await;
}
