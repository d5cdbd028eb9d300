//! `pgbox doctor` and `pgbox::doctor`: health checks with advice, on a real database. The
//! CLI runs as a spawned process, as an operator or a deploy script runs it.

mod support;

use std::process::{Command, Output};
use std::time::Duration;

use pgbox::Migrator;
use pgbox::doctor::{self, Code, Doctor, Report, Severity};
use serde_json::Value;
use sqlx::{AssertSqlSafe, Connection};
use support::TestDb;

/// Exit statuses of `pgbox doctor`.
const EXIT_OK: i32 = 0;
const EXIT_NOT_MIGRATED: i32 = 4;
const EXIT_WARNINGS: i32 = 7;
const EXIT_CRITICAL: i32 = 8;

fn pgbox_cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env("DATABASE_URL", url)
        .output()
        .expect("run pgbox")
}

fn describe(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn expect_exit(o: &Output, code: i32) -> String {
    assert_eq!(o.status.code(), Some(code), "{}", describe(o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", describe(o)))
}

/// The codes of a `--json` report's findings.
fn json_codes(report: &Value) -> Vec<String> {
    report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .map(|f| f["code"].as_str().expect("code").to_owned())
        .collect()
}

fn codes(report: &Report) -> Vec<Code> {
    report.findings.iter().map(|f| f.code).collect()
}

/// The SQL statements an advice quotes (between backticks), to run them as an operator would.
fn quoted_sql(advice: &str) -> Vec<String> {
    advice
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.ends_with(';'))
        .map(str::to_owned)
        .collect()
}

async fn run_advice(db: &TestDb, advice: &str) {
    let statements = quoted_sql(advice);
    assert!(!statements.is_empty(), "no SQL in the advice: {advice}");
    // CONCURRENTLY cannot run inside a transaction block: one plain statement at a time.
    let mut conn = db.connect().await;
    for sql in statements {
        sqlx::raw_sql(AssertSqlSafe(sql.clone()))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("the advice's {sql:?} failed: {e}"));
    }
    conn.close().await.unwrap();
}

const OK_CODES: [Code; 11] = [
    Code::MigrationsCurrent,
    Code::IndexesValid,
    Code::BloatLow,
    Code::XminHorizonOk,
    Code::NotificationQueueOk,
    Code::NoDeadLetters,
    Code::InboxLeasesConsistent,
    Code::ReplicationOk,
    Code::GrantsComplete,
    Code::PoolerOk,
    Code::WalSlotsOk,
];

#[tokio::test]
async fn a_freshly_migrated_schema_is_all_ok_and_exits_0() {
    let db = TestDb::migrated().await;
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert!(report.is_ok(), "{report:#?}");
    assert_eq!(codes(&report), OK_CODES);
    for f in &report.findings {
        assert_eq!(f.severity, Severity::Ok);
        assert!(!f.message.is_empty() && !f.advice.is_empty(), "{f:?}");
    }

    let text = expect_exit(&pgbox_cli(&db.url(), &["doctor"]), EXIT_OK);
    assert!(text.contains("0 critical, 0 warning(s), 11 ok"), "{text}");
    assert!(text.contains("migrations_current"), "{text}");
    // All ok: nothing under "what to do", no "Nothing to do." repeated per finding; the
    // superuser the tests run as is a note, not advice under an ok line.
    assert!(!text.contains("what to do"), "{text}");
    assert!(!text.contains("Nothing to do."), "{text}");
    let superuser: bool =
        sqlx::query_scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        text.contains("note: Services should not run as a superuser"),
        superuser,
        "{text}"
    );
    // When, in RFC 3339 (`2026-11-27T01:45:54.226621Z`), not `2026-11-27 1:45:54.226621 +00:00:00`.
    let at = text
        .lines()
        .next()
        .and_then(|l| l.split(", at ").nth(1))
        .and_then(|l| l.split(": ").next())
        .unwrap_or_else(|| panic!("no time in the summary line: {text}"));
    time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|e| panic!("{at:?} is not RFC 3339: {e}"));

    let out = pgbox_cli(&db.url(), &["doctor", "--json"]);
    expect_exit(&out, EXIT_OK);
    let value = json(&out);
    assert_eq!(value["status"], "ok");
    assert_eq!(value["exit_code"], 0);
    assert_eq!(value["schema"], "pgbox");
    let expected: Vec<&str> = OK_CODES.iter().map(|c| c.as_str()).collect();
    assert_eq!(json_codes(&value), expected);
    for f in value["findings"].as_array().unwrap() {
        for key in ["severity", "check", "code", "message", "advice", "details"] {
            assert!(!f[key].is_null(), "{key} missing in {f}");
        }
    }
}

#[tokio::test]
async fn a_schema_installed_from_the_plain_sql_script_is_recognized() {
    let db = TestDb::empty().await;
    let script = Migrator::new().schema("billing").unwrap().to_sql();
    let mut conn = db.connect().await;
    sqlx::raw_sql(AssertSqlSafe(script))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();

    let report = doctor::check(&db.pool, "billing").await.unwrap();
    assert!(report.is_ok(), "{report:#?}");
    let out = pgbox_cli(&db.url(), &["doctor", "--schema", "billing", "--json"]);
    expect_exit(&out, EXIT_OK);
    assert!(json_codes(&json(&out)).contains(&"migrations_current".to_owned()));
}

#[tokio::test]
async fn a_dropped_index_is_a_critical_missing_index_naming_it_and_its_advice_restores_it() {
    let db = TestDb::migrated().await;
    sqlx::query("DROP INDEX pgbox.queue_topic_idx")
        .execute(&db.pool)
        .await
        .unwrap();

    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert_eq!(report.severity(), Severity::Critical);
    let missing: Vec<_> = report.with_code(Code::MissingIndex).collect();
    assert_eq!(missing.len(), 1, "{report:#?}");
    let finding = missing[0];
    assert_eq!(finding.severity, Severity::Critical);
    assert_eq!(finding.subject.as_deref(), Some("queue_topic_idx"));
    assert_eq!(finding.details["table"], "queue");
    assert!(finding.message.contains("queue_topic_idx"), "{finding:?}");
    assert!(
        finding
            .advice
            .contains("CREATE INDEX CONCURRENTLY queue_topic_idx ON \"pgbox\".queue (topic, seq);"),
        "{finding:?}"
    );

    let text = expect_exit(&pgbox_cli(&db.url(), &["doctor"]), EXIT_CRITICAL);
    assert!(text.contains("CRITICAL"), "{text}");
    assert!(text.contains("missing_index"), "{text}");
    assert!(text.contains("queue_topic_idx"), "{text}");
    assert!(text.contains("CREATE INDEX CONCURRENTLY"), "{text}");
    let out = pgbox_cli(&db.url(), &["doctor", "--json"]);
    expect_exit(&out, EXIT_CRITICAL);
    let value = json(&out);
    assert_eq!(value["status"], "critical");
    assert_eq!(value["exit_code"], EXIT_CRITICAL);
    let f = value["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["code"] == "missing_index")
        .expect("a missing_index finding");
    assert_eq!(f["severity"], "critical");
    assert_eq!(f["check"], "indexes");
    assert_eq!(f["subject"], "queue_topic_idx");

    // Doing what it says heals it.
    run_advice(&db, &finding.advice).await;
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert!(report.is_ok(), "{report:#?}");
}

#[tokio::test]
async fn a_dropped_primary_key_names_the_constraint_to_restore() {
    let db = TestDb::migrated().await;
    sqlx::query("ALTER TABLE pgbox.queue_dead_letters DROP CONSTRAINT queue_dead_letters_pkey")
        .execute(&db.pool)
        .await
        .unwrap();
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    let finding = report
        .with_code(Code::MissingIndex)
        .next()
        .expect("missing_index");
    assert_eq!(finding.subject.as_deref(), Some("queue_dead_letters_pkey"));
    assert!(
        finding.advice.contains("PRIMARY KEY USING INDEX"),
        "{finding:?}"
    );
    run_advice(&db, &finding.advice).await;
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert!(report.is_ok(), "{report:#?}");
}

#[tokio::test]
async fn an_invalid_index_is_critical_and_reindex_heals_it() {
    let db = TestDb::migrated().await;
    // What a failed CREATE INDEX CONCURRENTLY leaves behind (the tests run as a superuser).
    sqlx::query(
        "UPDATE pg_index SET indisvalid = false \
         WHERE indexrelid = 'pgbox.outbox_unkeyed_idx'::regclass",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    let finding = report
        .with_code(Code::InvalidIndex)
        .next()
        .expect("invalid_index");
    assert_eq!(finding.severity, Severity::Critical);
    assert_eq!(finding.subject.as_deref(), Some("outbox_unkeyed_idx"));
    assert_eq!(finding.details["indisvalid"], false);
    assert!(
        finding.advice.contains("REINDEX INDEX CONCURRENTLY"),
        "{finding:?}"
    );
    expect_exit(&pgbox_cli(&db.url(), &["doctor"]), EXIT_CRITICAL);

    run_advice(&db, &finding.advice).await;
    assert!(doctor::check(&db.pool, "pgbox").await.unwrap().is_ok());
}

#[tokio::test]
async fn a_held_back_xmin_names_the_backend_and_says_what_to_do() {
    let db = TestDb::migrated().await;
    let mut holder = db.connect().await;
    sqlx::query("SET application_name = 'doctor-test-holder'")
        .execute(&mut holder)
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    let mut tx = holder.begin().await.unwrap();
    // An assigned xid: VACUUM keeps every row version deleted after it.
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *tx)
        .await
        .unwrap();

    // Library, with a low threshold: wait (bounded) until the transaction is older than it.
    let doc = Doctor::new().xmin_age_warn(Duration::from_millis(200));
    let mut found = None;
    for _ in 0..100 {
        let report = doc.check(&db.pool).await.unwrap();
        if let Some(f) = report.with_code(Code::LongTransaction).next() {
            found = Some(f.clone());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let finding = found.expect("a long_transaction finding within 10 s");
    assert_eq!(finding.severity, Severity::Warning);
    assert_eq!(finding.subject, Some(format!("pid {pid}")));
    assert_eq!(finding.details["pid"], pid);
    assert_eq!(finding.details["application_name"], "doctor-test-holder");
    assert_eq!(finding.details["holds"], "xid");
    assert!(
        finding.message.contains(&format!("pid {pid}")),
        "{finding:?}"
    );
    assert!(
        finding.message.contains("doctor-test-holder"),
        "{finding:?}"
    );
    assert!(
        finding.message.contains("idle in transaction"),
        "{finding:?}"
    );
    assert!(
        finding
            .advice
            .contains(&format!("SELECT pg_terminate_backend({pid});")),
        "{finding:?}"
    );
    assert!(
        finding
            .advice
            .contains("idle_in_transaction_session_timeout"),
        "{finding:?}"
    );

    // The CLI, with `--xmin-age-warn 1s`: a warning (exit 7) once the transaction is 1 s old.
    let url = db.url();
    let mut out = None;
    for _ in 0..30 {
        let o = pgbox_cli(&url, &["doctor", "--xmin-age-warn", "1s", "--json"]);
        if o.status.code() == Some(EXIT_WARNINGS) {
            out = Some(o);
            break;
        }
        expect_exit(&o, EXIT_OK); // not old enough yet
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = out.expect("exit 7 within the bounded wait");
    let value = json(&out);
    assert_eq!(value["status"], "warning");
    assert_eq!(value["exit_code"], EXIT_WARNINGS);
    let f = value["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["code"] == "long_transaction")
        .expect("a long_transaction finding")
        .clone();
    assert_eq!(f["details"]["pid"], pid);
    assert!(
        f["advice"]
            .as_str()
            .unwrap()
            .contains(&format!("pg_terminate_backend({pid})"))
    );
    // Human output names it too.
    let text = expect_exit(
        &pgbox_cli(&url, &["doctor", "--xmin-age-warn", "1s"]),
        EXIT_WARNINGS,
    );
    assert!(text.contains(&format!("pid {pid}")), "{text}");
    assert!(text.contains("what to do"), "{text}");

    // Past the critical threshold: exit 8.
    let out = pgbox_cli(
        &url,
        &[
            "doctor",
            "--xmin-age-warn",
            "1s",
            "--xmin-age-critical",
            "1s",
            "--json",
        ],
    );
    expect_exit(&out, EXIT_CRITICAL);
    assert!(json_codes(&json(&out)).contains(&"long_transaction".to_owned()));

    // Ended: nothing holds the horizon any more.
    tx.rollback().await.unwrap();
    let report = doc.check(&db.pool).await.unwrap();
    assert!(report.is_ok(), "{report:#?}");
    holder.close().await.unwrap();
}

#[tokio::test]
async fn an_unmigrated_database_exits_4() {
    let db = TestDb::empty().await;
    let out = pgbox_cli(&db.url(), &["doctor"]);
    expect_exit(&out, EXIT_NOT_MIGRATED);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("pgbox migrate"),
        "{}",
        describe(&out)
    );
    expect_exit(
        &pgbox_cli(&db.url(), &["doctor", "--json"]),
        EXIT_NOT_MIGRATED,
    );

    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert!(report.not_migrated());
    assert_eq!(report.severity(), Severity::Critical);
    assert_eq!(codes(&report), [Code::NotMigrated]);
    assert!(report.findings[0].advice.contains("pgbox migrate"));
}

#[tokio::test]
async fn dead_letters_are_warnings_with_the_commands_that_handle_them() {
    let db = TestDb::migrated().await;
    sqlx::query(
        "INSERT INTO pgbox.outbox_dead_letters \
           (seq, message_id, topic, payload, content_type, headers, created_at, attempts, last_error) \
         VALUES (1, gen_random_uuid(), 'orders', '\\x00', 'application/octet-stream', '{}', now(), 5, 'broker down')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO pgbox.queue_dead_letters \
           (seq, message_id, topic, payload, content_type, headers, created_at, deliveries) \
         VALUES (1, gen_random_uuid(), 'points', '\\x00', 'application/octet-stream', '{}', now(), 5)",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert_eq!(report.severity(), Severity::Warning);
    let outbox = report.with_code(Code::OutboxDeadLetters).next().unwrap();
    assert_eq!(outbox.details["count"], 1);
    assert!(outbox.message.contains("\"orders\""), "{outbox:?}");
    assert!(outbox.advice.contains("pgbox dead-letters list"));
    let queue = report.with_code(Code::QueueDeadLetters).next().unwrap();
    assert!(queue.advice.contains("pgbox dead-letters --queue list"));

    let out = pgbox_cli(&db.url(), &["doctor", "--json"]);
    expect_exit(&out, EXIT_WARNINGS);
    let codes = json_codes(&json(&out));
    assert!(
        codes.contains(&"outbox_dead_letters".to_owned()),
        "{codes:?}"
    );
    assert!(
        codes.contains(&"queue_dead_letters".to_owned()),
        "{codes:?}"
    );
}

#[tokio::test]
async fn a_lease_row_that_breaks_the_lease_invariants_is_critical() {
    let db = TestDb::migrated().await;
    // Rows written by pgbox's own statements: a processed key and a key under a live lease.
    let inbox = pgbox::Inbox::new("points").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "done", async |_c| Ok::<_, pgbox::Error>(7))
        .await
        .unwrap();
    assert!(outcome.is_processed());
    tx.commit().await.unwrap();
    let lease = inbox
        .lease(&db.pool, "held", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(matches!(lease, pgbox::LeaseAttempt::Leased(_)), "{lease:?}");
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert!(report.is_ok(), "{report:#?}");
    assert_eq!(report.with_code(Code::InboxLeasesConsistent).count(), 1);

    // Written behind pgbox's back: an outcome on a key still under its lease, and a lease
    // without a fencing token.
    sqlx::query("UPDATE pgbox.inbox SET outcome = '1' WHERE key = 'held'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO pgbox.inbox (consumer, key, lease_expires_at) \
         VALUES ('points', 'tokenless', now() + interval '1 minute')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert_eq!(report.severity(), Severity::Critical);
    let finding = report
        .with_code(Code::InboxLeaseInconsistent)
        .next()
        .unwrap();
    assert_eq!(finding.details["inconsistent"], 2, "{finding:?}");
    assert!(finding.message.contains("points / held"), "{finding:?}");
    assert_eq!(report.with_code(Code::InboxLeasesConsistent).count(), 0);
    let out = pgbox_cli(&db.url(), &["doctor", "--json"]);
    expect_exit(&out, EXIT_CRITICAL);
    assert!(json_codes(&json(&out)).contains(&"inbox_lease_inconsistent".to_owned()));
}

#[tokio::test]
async fn migration_history_pending_newer_and_diverged() {
    let db = TestDb::migrated().await;
    let newest = Migrator::new()
        .applied(&db.pool)
        .await
        .unwrap()
        .pop()
        .unwrap();

    // A schema newer than this binary: a warning.
    sqlx::query(
        "INSERT INTO pgbox.pgbox_migrations (version, name, applied_on, checksum) \
         VALUES (9999, 'from_the_future', '2030-01-01T00:00:00Z', '1')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    assert_eq!(
        codes(&report)[0],
        Code::SchemaNewerThanBinary,
        "{report:#?}"
    );
    assert_eq!(report.severity(), Severity::Warning);
    assert_eq!(
        report.findings[0].subject.as_deref(),
        Some("V9999__from_the_future")
    );
    expect_exit(&pgbox_cli(&db.url(), &["doctor"]), EXIT_WARNINGS);
    sqlx::query("DELETE FROM pgbox.pgbox_migrations WHERE version = 9999")
        .execute(&db.pool)
        .await
        .unwrap();

    // The newest migration not recorded: pending, critical.
    sqlx::query("DELETE FROM pgbox.pgbox_migrations WHERE version = $1")
        .bind(newest.version)
        .execute(&db.pool)
        .await
        .unwrap();
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    let pending = report.with_code(Code::MigrationsPending).next().unwrap();
    assert_eq!(pending.severity, Severity::Critical);
    let label = format!("V{}__{}", newest.version, newest.name);
    assert_eq!(pending.subject.as_deref(), Some(label.as_str()));
    assert!(pending.advice.contains("pgbox migrate"));
    expect_exit(&pgbox_cli(&db.url(), &["doctor"]), EXIT_CRITICAL);

    // An edited migration: the migrator refuses the schema, critical.
    let db = TestDb::migrated().await;
    sqlx::query("UPDATE pgbox.pgbox_migrations SET checksum = '42' WHERE version = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let report = doctor::check(&db.pool, "pgbox").await.unwrap();
    let diverged = report.with_code(Code::MigrationDiverged).next().unwrap();
    assert_eq!(diverged.severity, Severity::Critical);
    assert!(diverged.message.contains("checksum 42"), "{diverged:?}");
    expect_exit(&pgbox_cli(&db.url(), &["doctor"]), EXIT_CRITICAL);
}

#[tokio::test]
async fn dead_rows_and_bloat_are_reported_as_estimates() {
    let db = TestDb::migrated().await;
    let mut conn = db.connect().await;
    sqlx::raw_sql(
        "ALTER TABLE pgbox.outbox SET (autovacuum_enabled = false); \
         INSERT INTO pgbox.outbox (message_id, topic, payload, content_type) \
           SELECT gen_random_uuid(), 'orders', '\\x00', 'application/octet-stream' \
           FROM generate_series(1, 2000); \
         DELETE FROM pgbox.outbox",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    // Statistics are flushed by each backend when it goes idle; make this one flush now.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();

    let doc = Doctor::new().dead_rows_warn(1000).bloat_min_bytes(1);
    let mut report = doc.check(&db.pool).await.unwrap();
    for _ in 0..100 {
        if report.with_code(Code::DeadTuples).next().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        report = doc.check(&db.pool).await.unwrap();
    }
    let dead = report
        .with_code(Code::DeadTuples)
        .next()
        .unwrap_or_else(|| panic!("dead_tuples within 10 s: {report:#?}"));
    assert_eq!(dead.severity, Severity::Warning);
    assert_eq!(dead.subject.as_deref(), Some("outbox"));
    assert_eq!(dead.details["dead_rows"], 2000);
    assert!(dead.message.contains("estimate"), "{dead:?}");
    assert!(dead.advice.contains("VACUUM"), "{dead:?}");
    let bloat = report
        .with_code(Code::TableBloat)
        .find(|f| f.subject.as_deref() == Some("outbox"))
        .unwrap_or_else(|| panic!("table_bloat for outbox: {report:#?}"));
    assert!(bloat.message.contains("estimate"), "{bloat:?}");

    // The defaults ignore a table this small.
    assert!(
        doctor::check(&db.pool, "pgbox")
            .await
            .unwrap()
            .with_code(Code::TableBloat)
            .next()
            .is_none()
    );
}

/// A table whose pages are filled half full (an operator's `fillfactor = 50`, room for HOT
/// updates) holds its live rows in twice the pages of packed rows: the bloat estimate reads
/// the table's fillfactor and does not call that half waste.
#[tokio::test]
async fn a_table_filled_to_its_fillfactor_is_not_bloat() {
    let db = TestDb::migrated().await;
    let mut conn = db.connect().await;
    sqlx::raw_sql(
        "ALTER TABLE pgbox.queue SET (fillfactor = 50); \
         INSERT INTO pgbox.queue (message_id, topic, payload, content_type, headers, created_at) \
           SELECT gen_random_uuid(), 'orders', pg_catalog.decode(repeat('ab', 200), 'hex'), \
                  'application/octet-stream', '{}', now() \
           FROM generate_series(1, 20000); \
         ANALYZE pgbox.queue",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut conn)
        .await
        .unwrap();
    let fillfactor: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(reloptions) FROM pg_class WHERE oid = 'pgbox.queue'::regclass",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(fillfactor, ["fillfactor=50"]);
    conn.close().await.unwrap();

    let doc = Doctor::new().bloat_min_bytes(1).bloat_ratio_warn(0.3);
    let mut report = doc.check(&db.pool).await.unwrap();
    // The live-row count comes from the statistics, flushed asynchronously: wait until the
    // report counts the rows (in its all-clear finding, or in a bloat finding on the queue).
    for _ in 0..100 {
        let live = report
            .with_code(Code::BloatLow)
            .chain(
                report
                    .with_code(Code::TableBloat)
                    .filter(|f| f.subject.as_deref() == Some("queue")),
            )
            .map(|f| f.details["live_rows"].as_i64().unwrap_or(0))
            .max()
            .unwrap_or(0);
        if live >= 20000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        report = doc.check(&db.pool).await.unwrap();
    }
    assert!(
        report
            .with_code(Code::TableBloat)
            .all(|f| f.subject.as_deref() != Some("queue")),
        "{report:#?}"
    );
    let low = report
        .with_code(Code::BloatLow)
        .next()
        .unwrap_or_else(|| panic!("bloat_low: {report:#?}"));
    assert!(
        low.details["live_rows"].as_i64().unwrap() >= 20000,
        "{low:?}"
    );
}

#[tokio::test]
async fn invalid_thresholds_are_refused_before_any_query() {
    let db = TestDb::migrated().await;
    let err = Doctor::new()
        .bloat_ratio_warn(1.5)
        .check(&db.pool)
        .await
        .unwrap_err();
    assert!(matches!(err, pgbox::Error::InvalidConfig(_)), "{err}");
    assert!(Doctor::new().schema("Bad Name").is_err());
}
