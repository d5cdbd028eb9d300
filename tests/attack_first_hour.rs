//! Attacks on the first hour: the "run the migrations" hint (false positives on an
//! application's own objects, false negatives on pgbox's), what each component says on an
//! unmigrated database, and the examples run over a user's own schemas of the same names.
//!
//! Tests named `finding_*` failed on the code they were written against; the others are
//! attacks that held and are kept.

mod support;

use std::process::{Command, Output};
use std::time::Duration;

use pgbox::transport::{PgQueue, QueueDeadLetters};
use pgbox::{
    CancellationToken, Consumer, DbErrorKind, DeadLetters, Error, Inbox, Message, Outbox, Outcome,
    Relay, RetryPolicy,
};
use support::{TestDb, example_path};

/// The three ways to migrate that the hint names.
const MIGRATE_WORDS: [&str; 3] = ["pgbox::migrate(&pool)", "Migrator", "pgbox migrate"];

fn says_migrate(text: &str) -> bool {
    MIGRATE_WORDS.iter().all(|w| text.contains(w))
}

fn assert_says_migrate(what: &str, e: &Error) {
    let text = e.to_string();
    eprintln!("{what}: {text}");
    assert!(says_migrate(&text), "{what}: no migrate hint in: {text}");
}

fn assert_no_migrate_hint(what: &str, e: &Error) {
    let text = e.to_string();
    eprintln!("{what}: {text}");
    assert!(
        !text.contains("pgbox migrate") && !text.contains("pgbox's tables"),
        "{what}: an application's own object is blamed on pgbox: {text}"
    );
}

/// Runs `statements` one by one on the handler's connection (as a handler would), and
/// returns the first failure as a pgbox error.
async fn app_error(db: &TestDb, statements: &'static [&'static str]) -> Error {
    let inbox = Inbox::new("attack-first-hour").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    inbox
        .process(&mut tx, "k1", async |conn| {
            for sql in statements {
                sqlx::query(*sql).execute(&mut *conn).await?;
            }
            Ok::<_, Error>(())
        })
        .await
        .expect_err("the statements fail")
}

// ---------------------------------------------------------------------------------------
// The hint's false positives: an application's own objects named like pgbox's.
// ---------------------------------------------------------------------------------------

/// An application's own (missing) `orders.inbox` table, schema-qualified: pgbox's `inbox`
/// table is not what is missing.
#[tokio::test]
async fn finding_app_table_named_inbox_in_its_own_schema_gets_the_migrate_hint() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql("CREATE SCHEMA orders")
        .execute(&db.pool)
        .await
        .unwrap();
    let e = app_error(&db, &["SELECT * FROM orders.inbox"]).await;
    assert_eq!(e.sqlstate().as_deref(), Some("42P01"), "{e}");
    assert_no_migrate_hint("orders.inbox", &e);
}

/// An application's unqualified `outbox`, resolved through its `search_path`: pgbox always
/// names its schema, so an unqualified missing name is never one of pgbox's.
#[tokio::test]
async fn finding_unqualified_app_table_named_outbox_on_its_search_path_gets_the_hint() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql("CREATE SCHEMA shop")
        .execute(&db.pool)
        .await
        .unwrap();
    let e = app_error(
        &db,
        &[
            "SET LOCAL search_path = shop",
            "INSERT INTO outbox VALUES (1)",
        ],
    )
    .await;
    assert_eq!(e.sqlstate().as_deref(), Some("42P01"), "{e}");
    assert_eq!(e.db_kind(), Some(DbErrorKind::MissingSchema), "{e}");
    assert_no_migrate_hint("unqualified outbox", &e);
}

/// A column the application forgot on its own `queue` table (42703 names the relation
/// without its schema): not a pgbox migration that is missing.
#[tokio::test]
async fn finding_missing_column_of_an_app_table_named_queue_gets_the_hint() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql("CREATE SCHEMA jobs; CREATE TABLE jobs.queue (id int)")
        .execute(&db.pool)
        .await
        .unwrap();
    let e = app_error(&db, &["UPDATE jobs.queue SET priority = 1"]).await;
    assert_eq!(e.sqlstate().as_deref(), Some("42703"), "{e}");
    assert_no_migrate_hint("jobs.queue.priority", &e);
}

/// An application's own missing schema (3F000): every such error is blamed on pgbox.
#[tokio::test]
async fn finding_app_missing_schema_gets_the_migrate_hint() {
    let db = TestDb::migrated().await;
    let e = app_error(&db, &["CREATE TABLE reporting.daily (day date)"]).await;
    assert_eq!(e.sqlstate().as_deref(), Some("3F000"), "{e}");
    assert_eq!(e.db_kind(), Some(DbErrorKind::MissingSchema), "{e}");
    assert_no_migrate_hint("reporting.daily", &e);
}

/// An application table with a name pgbox does not use, in its own schema: no hint (held).
#[tokio::test]
async fn app_table_with_its_own_name_gets_no_hint() {
    let db = TestDb::migrated().await;
    let e = app_error(&db, &["SELECT * FROM public.invoices"]).await;
    assert_eq!(e.db_kind(), Some(DbErrorKind::MissingSchema), "{e}");
    assert_no_migrate_hint("public.invoices", &e);
}

// ---------------------------------------------------------------------------------------
// The hint's false negatives: pgbox's own objects missing or older.
// ---------------------------------------------------------------------------------------

/// A schema migrated by an older pgbox (before V7, the leases): the inbox's claim selects
/// `lease_expires_at`, and the server's 42703 for a SELECT names no relation.
#[tokio::test]
async fn finding_inbox_on_a_schema_before_the_lease_columns_does_not_say_migrate() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(
        "ALTER TABLE pgbox.inbox DROP COLUMN lease_expires_at CASCADE, \
                                 DROP COLUMN lease_token CASCADE; \
         DELETE FROM pgbox.pgbox_migrations WHERE version >= 7",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // A new key's claim is a plain INSERT; the duplicate's read is what selects the column.
    let inbox = Inbox::new("older-schema").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let first = inbox
        .process(&mut tx, "k1", async |_conn| Ok::<_, Error>(()))
        .await
        .unwrap();
    assert!(matches!(first, Outcome::Processed(())), "{first:?}");
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let e = inbox
        .process(&mut tx, "k1", async |_conn| Ok::<_, Error>(()))
        .await
        .expect_err("no lease columns");
    drop(tx);
    assert_eq!(e.sqlstate().as_deref(), Some("42703"), "{e}");
    assert_says_migrate("inbox.process on a pre-V7 schema", &e);
}

/// A database migrated by a newer pgbox than this one: `migrate` at start-up refuses it;
/// the refusal must say why (a newer pgbox) and what to do, not only refinery's words.
#[tokio::test]
async fn finding_a_schema_migrated_by_a_newer_pgbox_is_refused_without_saying_so() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(
        "INSERT INTO pgbox.pgbox_migrations (version, name, applied_on, checksum) \
         VALUES (999, 'from_the_future', '2030-01-01T00:00:00Z', '1')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let e = pgbox::migrate(&db.pool)
        .await
        .expect_err("a history with an unknown migration");
    let text = e.to_string();
    eprintln!("migrate over a newer schema: {text}");
    assert!(
        text.contains("newer") && text.contains("999"),
        "does not say a newer pgbox migrated it: {text}"
    );
    // Everything else of this pgbox still works on the newer schema (held).
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("t", "x"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// Every component's first call on an unmigrated database says to migrate (held).
#[tokio::test]
async fn every_component_on_an_unmigrated_database_says_to_migrate() {
    let db = TestDb::empty().await;
    let e = DeadLetters::new(db.pool.clone())
        .list(10)
        .await
        .expect_err("no dead letters table");
    assert_says_migrate("DeadLetters::list", &e);
    let e = DeadLetters::with_schema(db.pool.clone(), "billing")
        .unwrap()
        .replay_all()
        .await
        .expect_err("no schema billing");
    assert_says_migrate("DeadLetters::replay_all in billing", &e);
    let e = QueueDeadLetters::new(db.pool.clone())
        .list(10)
        .await
        .expect_err("no queue dead letters");
    assert_says_migrate("QueueDeadLetters::list", &e);
    let e = pgbox::status(&db.pool, "pgbox")
        .await
        .expect_err("no schema");
    assert_says_migrate("status", &e);
    let e = pgbox::inbox_status(&db.pool, "pgbox")
        .await
        .expect_err("no schema");
    assert_says_migrate("inbox_status", &e);
    let janitor = pgbox::janitor::Janitor::builder(db.pool.clone())
        .build()
        .unwrap();
    let e = janitor.run_once().await.expect_err("no tables");
    assert_says_migrate("janitor.run_once", &e);
    let relay = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .schema("billing")
        .build()
        .unwrap();
    let e = relay.relay_once().await.expect_err("no schema billing");
    assert_says_migrate("relay in billing", &e);
    let e = Inbox::builder("c")
        .schema("billing")
        .build()
        .unwrap()
        .process(&mut db.pool.begin().await.unwrap(), "k", async |_c| {
            Ok::<_, Error>(())
        })
        .await
        .expect_err("no schema billing");
    assert_says_migrate("inbox in billing", &e);
    assert_eq!(e.db_kind(), Some(DbErrorKind::MissingSchema), "{e}");
}

/// The consumer's inbox schema was never migrated (its queue was): the handler never runs,
/// and that is not the message's failure. Today each delivery counts, and after
/// `max_deliveries` a good message is dead-lettered with "run the migrations" as its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_consumer_dead_letters_good_messages_when_its_inbox_is_not_migrated() {
    let db = TestDb::empty().await;
    pgbox::Migrator::new()
        .schema("q")
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let queue = PgQueue::with_schema(db.pool.clone(), "q").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::with_schema("q")
        .unwrap()
        .enqueue(&mut tx, Message::bytes("orders", "good"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::builder(db.pool.clone(), queue.clone())
        .schema("q")
        .build()
        .unwrap();
    relay.relay_once().await.unwrap();

    let inbox = Inbox::builder("points").schema("ib").build().unwrap();
    let consumer = Consumer::builder(db.pool.clone(), queue.clone(), "orders", inbox)
        .max_deliveries(2)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(10))
                .max_delay(Duration::from_millis(20)),
        )
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            consumer
                .run(async |_m, _c| Ok::<_, Error>(()), shutdown)
                .await
        })
    };
    // Long enough for several deliveries; the loop ends early once one is dead-lettered.
    let dead = QueueDeadLetters::with_schema(db.pool.clone(), "q").unwrap();
    let mut parked = Vec::new();
    for _ in 0..60 {
        parked = dead.list(10).await.unwrap();
        if !parked.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    eprintln!("consumer: {stats:?}; dead letters: {parked:?}");
    assert!(
        parked.is_empty(),
        "a good message was dead-lettered because the inbox schema is not migrated: {parked:?}"
    );
}

// ---------------------------------------------------------------------------------------
// The CLI on an unmigrated database.
// ---------------------------------------------------------------------------------------

fn pgbox_cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .expect("run pgbox")
}

/// Each read-only CLI command on an unmigrated database exits 4 and says to migrate (held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_on_an_unmigrated_database_says_to_migrate() {
    let db = TestDb::empty().await;
    let url = db.url();
    for args in [
        &["status"][..],
        &["dead-letters", "list"][..],
        &["status", "--schema", "billing"][..],
    ] {
        let out = {
            let url = url.clone();
            let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            tokio::task::spawn_blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                pgbox_cli(&url, &args)
            })
            .await
            .unwrap()
        };
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!("pgbox {args:?}: {:?} {err}", out.status.code());
        assert_eq!(out.status.code(), Some(4), "pgbox {args:?}: {err}");
        assert!(err.contains("pgbox migrate"), "pgbox {args:?}: {err}");
    }
}

/// `pgbox status` on a schema an older pgbox migrated (before the lease columns): it works,
/// or it exits 4 saying to migrate (held: it works).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_status_on_an_older_schema_works_or_says_migrate() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(
        "ALTER TABLE pgbox.inbox DROP COLUMN lease_expires_at CASCADE, \
                                 DROP COLUMN lease_token CASCADE; \
         DELETE FROM pgbox.pgbox_migrations WHERE version >= 7",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let url = db.url();
    let out = tokio::task::spawn_blocking(move || pgbox_cli(&url, &["status"]))
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let text = format!("{}{err}", String::from_utf8_lossy(&out.stdout));
    eprintln!(
        "pgbox status on a pre-V7 schema: {:?} {text}",
        out.status.code()
    );
    assert!(
        out.status.success() || (out.status.code() == Some(4) && says_migrate(&err)),
        "{:?}: {text}",
        out.status.code()
    );
}

// ---------------------------------------------------------------------------------------
// The examples, over a user's own schemas of the same names, and after each other.
// ---------------------------------------------------------------------------------------

async fn run_example(name: &'static str, args: &[&str], url: &str) -> Output {
    let path = example_path(name);
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let url = url.to_owned();
    tokio::task::spawn_blocking(move || {
        Command::new(path)
            .args(args)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// The quick start pointed at a database where `quickstart` is the user's own schema:
/// it must refuse, and not drop the user's `quickstart.points`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_quickstart_drops_the_users_own_quickstart_points_table() {
    let db = TestDb::empty().await;
    sqlx::raw_sql(
        "CREATE SCHEMA quickstart; \
         CREATE TABLE quickstart.points (user_id bigint PRIMARY KEY, total bigint NOT NULL, \
                                         note text); \
         INSERT INTO quickstart.points VALUES (1, 5000, 'the user''s own row')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = run_example("quickstart", &[], &db.url()).await;
    eprintln!(
        "quickstart: {:?}\n{}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let kept: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_attribute a \
         JOIN pg_catalog.pg_class c ON c.oid = a.attrelid \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = 'quickstart' AND c.relname = 'points' AND a.attname = 'note'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        kept, 1,
        "the user's quickstart.points was dropped and replaced"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM quickstart.points WHERE user_id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "the user's row is gone");
}

/// The services by hand, pointed at a database where `broker` (the built-in queue's schema
/// of the services) is the user's own with a table `queue` of its own: refused with a message
/// naming the example, not a raw SQL error, and nothing of the user's changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_services_by_hand_migrate_into_the_users_own_broker_schema() {
    let db = TestDb::empty().await;
    sqlx::raw_sql(
        "CREATE SCHEMA broker; CREATE TABLE broker.queue (job text); \
         INSERT INTO broker.queue VALUES ('the user''s job')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = run_example(
        "payment_services",
        &["points", "--listen", "127.0.0.1:0"],
        &db.url(),
    )
    .await;
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("points service: {:?}\n{err}", out.status.code());
    assert!(
        !out.status.success(),
        "the service ran over the user's schema"
    );
    assert!(
        err.contains("was not created by pgbox's examples")
            || err.contains("examples/payment_services"),
        "not refused with a message naming the example: {err}"
    );
    let created: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = 'broker'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        created, 1,
        "tables were created in the user's schema broker"
    );
}

/// The same with the user's own, empty `svc_points` schema: the service must not move in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_services_by_hand_create_tables_in_the_users_own_schema() {
    let db = TestDb::empty().await;
    sqlx::raw_sql("CREATE SCHEMA svc_points; CREATE TABLE svc_points.mine (id int)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut child = Command::new(example_path("payment_services"))
        .args([
            "points",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "postgres",
        ])
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Started (tables made) or refused: bounded wait for either.
    let mut tables = 0i64;
    for _ in 0..100 {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        tables = sqlx::query_scalar(
            "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = 'svc_points'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if tables > 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = child.kill();
    let status = child.wait().unwrap();
    let now: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = 'svc_points'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let tables = now.max(tables);
    assert_eq!(
        tables, 1,
        "the service created its tables in the user's own schema svc_points ({status})"
    );
}

/// Starts `payment_services <service>` by hand (as the guide does), waits until it is ready,
/// and stops it: `Ok` once ready, `Err(stderr)` if it exits first.
async fn service_by_hand(service: &str, url: &str) -> Result<(), String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(example_path("payment_services"))
        .args([service, "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ready = |port: u16| -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = write!(
            s,
            "GET /health/ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        );
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.starts_with("HTTP/1.1 200")
    };
    for _ in 0..300 {
        if child.try_wait().unwrap().is_some() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            return Err(err);
        }
        if ready(port) {
            child.kill().unwrap();
            child.wait().unwrap();
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    Err(format!("{service} never became ready"))
}

/// Simulation → quickstart → external_effect → both services by hand → simulation →
/// payment_services demo → the services by hand again → simulation, all in one database:
/// each runs (held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_run_in_any_order_in_one_database() {
    let db = TestDb::empty().await;
    let url = db.url();
    let steps: [(&'static str, &[&str]); 10] = [
        ("payment_points", &["--orders", "20"]),
        ("quickstart", &[]),
        ("external_effect", &[]),
        ("by hand", &["payments", "points"]),
        (
            "payment_points",
            &["--orders", "20", "--duplicate-rate", "0.3"],
        ),
        (
            "payment_services",
            &["demo", "--orders", "10", "--kills", "0"],
        ),
        ("by hand", &["points", "payments"]),
        ("quickstart", &[]),
        ("external_effect", &[]),
        ("payment_points", &["--orders", "20"]),
    ];
    for (i, (name, args)) in steps.iter().enumerate() {
        if *name == "by hand" {
            for service in *args {
                if let Err(e) = service_by_hand(service, &url).await {
                    panic!("step {i}: {service} by hand: {e}");
                }
            }
            continue;
        }
        let out = run_example(name, args, &url).await;
        assert!(
            out.status.success(),
            "step {i}: {name} {args:?} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Nothing of the examples' landed outside their schemas.
    let stray: Vec<String> = sqlx::query_scalar(
        "SELECT table_schema || '.' || table_name FROM information_schema.tables \
         WHERE table_schema = 'public'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(stray.is_empty(), "tables in public: {stray:?}");
}

/// A user's own view and foreign key over the simulation's tables (in the user's own
/// schema): the next simulation run resets its schemas with `DROP SCHEMA ... CASCADE`, which
/// must not take the user's objects with it. Refused, untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_demo_reset_cascades_into_the_users_own_objects() {
    let db = TestDb::empty().await;
    let url = db.url();
    let first = run_example("payment_points", &["--orders", "20"], &url).await;
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    sqlx::raw_sql(
        "CREATE SCHEMA mine; \
         CREATE VIEW mine.points_report AS SELECT user_id, sum(points) AS points \
           FROM points.ledger GROUP BY user_id; \
         CREATE TABLE mine.refunds (order_id bigint REFERENCES payments.orders (id), note text); \
         INSERT INTO mine.refunds VALUES (1, 'the user''s row')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let again = run_example("payment_points", &["--orders", "20"], &url).await;
    let err = String::from_utf8_lossy(&again.stderr).into_owned();
    eprintln!("second run: {:?}\n{err}", again.status.code());
    let view: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_views \
         WHERE schemaname = 'mine' AND viewname = 'points_report'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let fk: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_constraint \
         WHERE conrelid = 'mine.refunds'::regclass AND contype = 'f'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (view, fk),
        (1, 1),
        "the reset dropped the user's view or foreign key (view, fk)"
    );
    assert!(!again.status.success(), "ran over the user's objects");
    assert!(
        err.contains("mine."),
        "the refusal names no object of the user's: {err}"
    );
}

/// The relay publishes into the built-in queue of a schema that was never migrated (the
/// broker's schema forgotten): the queue's missing table is not the message's failure, yet
/// each round counts an attempt, and after `max_attempts` good messages are dead-lettered.
#[tokio::test]
async fn finding_relay_dead_letters_good_messages_when_the_queue_is_not_migrated() {
    let db = TestDb::migrated().await;
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("orders", "good"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let queue = PgQueue::with_schema(db.pool.clone(), "broker_never_migrated").unwrap();
    let relay = Relay::builder(db.pool.clone(), queue)
        .max_attempts(2)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(1)),
        )
        .build()
        .unwrap();
    let mut last = None;
    for _ in 0..20 {
        last = Some(format!("{:?}", relay.relay_once().await));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("last round: {last:?}");
    let dead: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT topic, last_error FROM pgbox.outbox_dead_letters")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert!(
        dead.is_empty(),
        "a good message was dead-lettered because the queue's schema is not migrated: {dead:?}"
    );
}
