//! The payment/points example and the `pgbox` CLI, run as a user runs them: spawned
//! processes against a real database, checked independently with SQL.

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{Envelope, Message, Outbox, Relay};
use support::TestDb;

/// target/debug/examples/<name>, next to this test binary's directory.
fn example_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

fn pgbox_cli(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgbox"));
    cmd.args(args).env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("run pgbox")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(o)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_points_example_under_faults_keeps_its_invariants() {
    let db = TestDb::empty().await;
    let url = db.url();
    let example = example_path("payment_points");
    assert!(
        example.exists(),
        "{example:?} not built (cargo test builds examples)"
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(example)
            .args([
                "--orders",
                "2000",
                "--consumers",
                "4",
                "--duplicate-rate",
                "0.3",
                "--producer-retries",
                "0.1",
                "--crash-rate",
                "0.05",
            ])
            .env("DATABASE_URL", url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = stdout(&out);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the example failed");
    assert!(text.contains("[ok] no order rewarded twice"));

    // Independently: every paid order has exactly 30 points, once; the totals agree.
    let q = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        q("SELECT count(*) FROM payments.orders WHERE status = 'paid'").await,
        2000
    );
    assert_eq!(q("SELECT count(*) FROM points.ledger").await, 2000);
    assert_eq!(
        q("SELECT count(DISTINCT order_id) FROM points.ledger").await,
        2000
    );
    assert_eq!(
        q("SELECT sum(points)::bigint FROM points.ledger").await,
        60_000
    );
    assert_eq!(
        q("SELECT sum(total)::bigint FROM points.accounts").await,
        60_000
    );
    assert_eq!(
        q("SELECT count(*) FROM payments.orders o LEFT JOIN points.ledger l ON l.order_id = o.id WHERE l.order_id IS NULL").await,
        0
    );
    // The faults really happened: more deliveries than orders reached the consumers.
    assert!(q("SELECT count(*) FROM points_pgbox.inbox").await == 2000);
}

struct AlwaysFails;
impl Publisher for AlwaysFails {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        vec![Err(PublishError::refused("broker down")); batch.len()]
    }
}

#[tokio::test]
async fn cli_migrate_status_dead_letters_and_purge() {
    let db = TestDb::empty().await;
    let url = db.url();
    let url = url.as_str();

    // migrate twice: applies, then nothing to do.
    let first = pgbox_cli(Some(url), &["migrate", "--json"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(!json(&first)["applied"].as_array().unwrap().is_empty());
    let second = pgbox_cli(Some(url), &["migrate"]);
    assert!(second.status.success());
    assert!(
        stdout(&second).contains("up to date"),
        "{}",
        stdout(&second)
    );
    let sql = pgbox_cli(None, &["migrate", "--print-sql", "--schema", "billing"]);
    assert!(sql.status.success());
    assert!(stdout(&sql).contains("CREATE SCHEMA IF NOT EXISTS \"billing\""));

    // status, empty.
    let empty = pgbox_cli(Some(url), &["status"]);
    assert!(empty.status.success());
    assert!(
        stdout(&empty).contains("no pending messages"),
        "{}",
        stdout(&empty)
    );

    // A busy database: pending messages, a dead letter, inbox rows.
    let mut tx = db.pool.begin().await.unwrap();
    let ids = Outbox::new()
        .enqueue_batch(
            &mut tx,
            vec![
                Message::bytes("orders", "{\"order\":1}").ordering_key("o1"),
                Message::bytes("orders", "{\"order\":2}").ordering_key("o2"),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::builder(db.pool.clone(), AlwaysFails)
        .max_attempts(1)
        .batch_size(1)
        .build()
        .unwrap();
    relay.relay_once().await.unwrap();
    sqlx::query(
        "INSERT INTO pgbox.inbox (consumer, key, processed_at) \
         SELECT 'points', 'k' || g, now() - interval '10 days' FROM generate_series(1, 30) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let busy = json(&pgbox_cli(Some(url), &["status", "--json"]));
    let topic = &busy["topics"][0];
    assert_eq!(topic["topic"], "orders");
    assert_eq!(topic["outbox_backlog_estimate"], 1);
    assert_eq!(topic["outbox_dead_letters"], 1);
    assert_eq!(busy["consumers"][0]["consumer"], "points");
    assert_eq!(busy["consumers"][0]["rows"], 30);

    // dead letters: list, show, replay, discard.
    let list = json(&pgbox_cli(Some(url), &["dead-letters", "list", "--json"]));
    assert_eq!(list.as_array().unwrap().len(), 1);
    let dead_id = list[0]["message_id"].as_str().unwrap().to_owned();
    assert_eq!(dead_id, ids[0].to_string());
    assert_eq!(list[0]["last_error"], "broker down");
    let show = pgbox_cli(Some(url), &["dead-letters", "show", &dead_id, "--json"]);
    assert!(show.status.success());
    assert_eq!(json(&show)["payload"], "{\"order\":1}");
    let replay = pgbox_cli(Some(url), &["dead-letters", "replay", &dead_id]);
    assert!(
        replay.status.success(),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    let back: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox WHERE message_id = $1")
        .bind(ids[0])
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(back, 1);
    relay.relay_once().await.unwrap(); // dead again (attempts reset, max 1)
    let discard = pgbox_cli(Some(url), &["dead-letters", "discard", &dead_id, "--json"]);
    assert!(discard.status.success());
    assert_eq!(json(&discard)["discarded"], 1);
    let unknown = uuid::Uuid::now_v7().to_string();
    assert_eq!(
        pgbox_cli(Some(url), &["dead-letters", "show", &unknown])
            .status
            .code(),
        Some(5)
    );
    assert_eq!(
        pgbox_cli(Some(url), &["dead-letters", "replay", &unknown])
            .status
            .code(),
        Some(5)
    );
    assert_eq!(
        pgbox_cli(Some(url), &["dead-letters", "discard", &unknown])
            .status
            .code(),
        Some(5)
    );

    // purge: the floor refuses a short retention unless forced.
    let refused = pgbox_cli(Some(url), &["purge", "--older-than", "1h"]);
    assert_eq!(refused.status.code(), Some(6));
    let purged = json(&pgbox_cli(
        Some(url),
        &["purge", "--older-than", "7d", "--json"],
    ));
    assert_eq!(purged["total"], 30);
    let forced = pgbox_cli(
        Some(url),
        &[
            "purge",
            "--older-than",
            "1s",
            "--force",
            "--consumer",
            "points",
        ],
    );
    assert!(forced.status.success());
}

#[tokio::test]
async fn cli_errors_have_clear_messages_and_exit_codes() {
    let db = TestDb::empty().await; // not migrated
    let url = db.url();
    let cases: Vec<(Option<&str>, Vec<&str>, i32, &str)> = vec![
        (
            Some("not a url"),
            vec!["status"],
            3,
            "database URL has no scheme",
        ),
        (
            Some("mysql://root@127.0.0.1:3306/test"),
            vec!["status"],
            3,
            "pgbox needs a PostgreSQL URL",
        ),
        (
            Some("http://127.0.0.1:5432/postgres"),
            vec!["status"],
            3,
            "scheme is \"http\"",
        ),
        (
            Some("postgres://postgres:hunter2@127.0.0.1:1/nothing"),
            vec!["status"],
            3,
            "cannot connect to postgres@127.0.0.1:1/nothing: connection refused",
        ),
        (None, vec!["status"], 2, "DATABASE_URL"),
        (Some(url.as_str()), vec!["status"], 4, "pgbox migrate"),
        (
            Some(url.as_str()),
            vec!["dead-letters", "list"],
            4,
            "pgbox migrate",
        ),
        (
            Some(url.as_str()),
            vec!["status", "--schema", "Bad Name"],
            2,
            "invalid schema",
        ),
        (
            Some(url.as_str()),
            vec!["purge", "--older-than", "7 parsecs"],
            2,
            "unit",
        ),
        (
            Some(url.as_str()),
            vec!["frobnicate"],
            2,
            "unrecognized subcommand",
        ),
    ];
    for (url, args, code, needle) in cases {
        let started = std::time::Instant::now();
        let out = pgbox_cli(url, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(!err.contains("hunter2"), "the password leaked: {err}");
        assert!(
            !err.contains(" at line "),
            "a server source position: {err}"
        );
        // Refused at once, not after the pool's 10 s acquire timeout.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{args:?} took {:?}",
            started.elapsed()
        );
    }
    // A refused login keeps the server's words, once, without its source position.
    let bad_database = url.replace(&db.name, "pgbox_no_such_database");
    let out = pgbox_cli(Some(&bad_database), &["status"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("does not exist (SQLSTATE 3D000)"), "{err}");
    assert_eq!(err.matches("does not exist").count(), 1, "{err}");
}

/// The examples never drop what they did not create: a user's own `payments` schema in the
/// database they point the example at stops it with an error, untouched; a second run in a
/// database where the example made its schemas itself resets them and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_never_drops_a_schema_it_did_not_create() {
    let db = TestDb::empty().await;
    sqlx::raw_sql(
        "CREATE SCHEMA payments; CREATE TABLE payments.orders (id bigint PRIMARY KEY); \
         INSERT INTO payments.orders VALUES (42); CREATE SCHEMA ee_pgbox; \
         CREATE TABLE ee_pgbox.mine (id int); INSERT INTO ee_pgbox.mine VALUES (1);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let run = |name: &'static str, args: &'static [&'static str], url: String| {
        let example = example_path(name);
        tokio::task::spawn_blocking(move || {
            Command::new(example)
                .args(args)
                .env("DATABASE_URL", url)
                .output()
                .unwrap()
        })
    };
    for (name, args) in [
        ("payment_points", &["--orders", "20"][..]),
        ("external_effect", &[][..]),
    ] {
        let out = run(name, args, db.url()).await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{name} ran over a user's schema");
        assert!(
            stderr.contains("was not created by pgbox's examples"),
            "{name}: {stderr}"
        );
    }
    let kept: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM payments.orders WHERE id = 42) \
              + (SELECT count(*) FROM ee_pgbox.mine)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kept, 2, "a user's rows were touched");

    // In a database of its own, the example runs, and runs again over what it made.
    let own = TestDb::empty().await;
    for _ in 0..2 {
        let out = run("payment_points", &["--orders", "20"], own.url())
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The one-process simulation and the two services keep to schemas of their own: the
/// services start in a database where the simulation ran (same scenario, other tables), and
/// a table of theirs with another layout stops them with a message naming its owner, not a
/// raw SQL error on the first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulation_and_the_services_run_after_each_other() {
    let db = TestDb::empty().await;
    let url = db.url();
    let sim = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            Command::new(example_path("payment_points"))
                .args(["--orders", "20"])
                .env("DATABASE_URL", url)
                .output()
                .unwrap()
        })
        .await
        .unwrap()
    };
    assert!(
        sim.status.success(),
        "{}",
        String::from_utf8_lossy(&sim.stderr)
    );

    // The payments service, after the simulation: ready, and an order can be made and paid.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(example_path("payment_services"))
        .args(["payments", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let http = |method: &str, path: &str, headers: &str, body: &str| -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .ok()?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{headers}\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    };
    let mut ready = false;
    for _ in 0..600 {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("the payments service exited after the simulation ({status}): {err}");
        }
        if http("GET", "/health/ready", "", "").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            ready = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(ready, "the payments service never became ready");
    let created = http("POST", "/orders", "", r#"{"user_id":42,"amount":990}"#).unwrap();
    assert!(created.starts_with("HTTP/1.1 201"), "{created}");
    let id = created
        .split("\"id\":")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .unwrap_or_else(|| panic!("no id in {created}"))
        .to_owned();
    let paid = http(
        "POST",
        &format!("/orders/{id}/pay"),
        &format!("idempotency-key: pay-{id}\r\n"),
        "",
    )
    .unwrap();
    assert!(paid.starts_with("HTTP/1.1 200"), "{paid}");
    child.kill().unwrap();
    child.wait().unwrap();

    // A table of the service's with another layout (here the simulation's) stops it, named.
    sqlx::raw_sql(
        "DROP SCHEMA svc_payments CASCADE; CREATE SCHEMA svc_payments; \
         CREATE TABLE svc_payments.orders (id bigint PRIMARY KEY, user_id bigint, status text)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(example_path("payment_services"))
            .args(["payments", "--listen", &format!("127.0.0.1:{port}")])
            .env("DATABASE_URL", url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("svc_payments.orders belongs to examples/payment_services"),
        "{err}"
    );
    assert!(err.contains("no column amount"), "{err}");
}
