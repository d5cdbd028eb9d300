//! The janitor: retention by consumer, audit-mode rows, dead letters only when asked, and one
//! instance at a time among many, through killed processes and terminated connections.
//!
//! Who deleted what is recorded by the database itself: a statement trigger on each table the
//! janitor cleans logs every deleting statement with its backend pid, its row count and
//! whether that backend held the janitor lock at that moment. A unit that rolls back takes
//! its log row with it.

mod support;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgbox::janitor::{Janitor, JanitorBuilder, LOCK_CLASS, LockStatus, PassReport, Retention};
use pgbox::{CancellationToken, Error};
use sqlx::{Executor, PgPool};
use support::TestDb;

const CHILD_ENV: &str = "PGBOX_JANITOR_CHILD_URL";
const DAY: u64 = 24 * 3600;

fn days(n: u64) -> Duration {
    Duration::from_secs(n * DAY)
}

/// A janitor for tests: short interval, its name in `application_name`.
fn janitor(pool: &PgPool, name: &str) -> JanitorBuilder {
    Janitor::builder(pool.clone())
        .instance_name(name)
        .interval(Duration::from_millis(20))
}

/// `n` inbox rows of `consumer` recorded `age_secs` ago, keys `<prefix><i>`.
async fn insert_inbox(pool: &PgPool, consumer: &str, prefix: &str, n: i64, age_secs: u64) {
    sqlx::query(
        "INSERT INTO pgbox.inbox (consumer, key, processed_at) \
         SELECT $1, $2 || g, now() - make_interval(secs => $3) FROM generate_series(1, $4) g",
    )
    .bind(consumer)
    .bind(prefix)
    .bind(age_secs as f64)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn inbox_rows(pool: &PgPool, consumer: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = $1")
        .bind(consumer)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Logs every deleting statement on the tables the janitor cleans (see the module docs).
/// `janitor_log_conf.sleep` keeps each unit's transaction open that many seconds after its
/// delete, so that a kill can land inside it.
async fn install_delete_log(pool: &PgPool) {
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE janitor_log_conf (sleep float8 NOT NULL);
         INSERT INTO janitor_log_conf VALUES (0);
         CREATE TABLE janitor_log (
             seq bigserial PRIMARY KEY, pid int NOT NULL, tbl text NOT NULL,
             rows bigint NOT NULL, held boolean NOT NULL);
         CREATE FUNCTION janitor_log_delete() RETURNS trigger LANGUAGE plpgsql AS $fn$
         BEGIN
             INSERT INTO public.janitor_log (pid, tbl, rows, held)
             SELECT pg_backend_pid(), TG_TABLE_NAME, (SELECT count(*) FROM gone),
                    EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
                            AND pid = pg_backend_pid() AND classid::bigint = {LOCK_CLASS}
                            AND objsubid = 2);
             PERFORM pg_sleep(sleep) FROM public.janitor_log_conf;
             RETURN NULL;
         END $fn$;
         CREATE TRIGGER janitor_log AFTER DELETE ON pgbox.inbox REFERENCING OLD TABLE AS gone
             FOR EACH STATEMENT EXECUTE FUNCTION janitor_log_delete();
         CREATE TRIGGER janitor_log AFTER DELETE ON pgbox.outbox REFERENCING OLD TABLE AS gone
             FOR EACH STATEMENT EXECUTE FUNCTION janitor_log_delete();
         CREATE TRIGGER janitor_log AFTER DELETE ON pgbox.outbox_dead_letters
             REFERENCING OLD TABLE AS gone
             FOR EACH STATEMENT EXECUTE FUNCTION janitor_log_delete();
         CREATE TRIGGER janitor_log AFTER DELETE ON pgbox.queue_dead_letters
             REFERENCING OLD TABLE AS gone
             FOR EACH STATEMENT EXECUTE FUNCTION janitor_log_delete();"
    )))
    .await
    .unwrap();
}

async fn set_unit_sleep(pool: &PgPool, secs: f64) {
    sqlx::query("UPDATE janitor_log_conf SET sleep = $1")
        .bind(secs)
        .execute(pool)
        .await
        .unwrap();
}

/// The committed deleting statements, in order: (pid, rows, held the lock).
async fn delete_log(pool: &PgPool) -> Vec<(i32, i64, bool)> {
    sqlx::query_as("SELECT pid, rows, held FROM janitor_log ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Asserts that every deleting statement ran in a session holding the janitor lock, and that
/// the sessions that deleted rows worked one after the other, never interleaved. Returns the
/// working sessions in order.
fn assert_one_at_a_time(log: &[(i32, i64, bool)]) -> Vec<i32> {
    assert!(
        log.iter().all(|(_, _, held)| *held),
        "a statement deleted rows without holding the janitor lock: {log:?}"
    );
    let mut runs: Vec<i32> = Vec::new();
    for (pid, rows, _) in log {
        if *rows > 0 && runs.last() != Some(pid) {
            assert!(
                !runs.contains(pid),
                "session {pid} worked again after another one had: {log:?}"
            );
            runs.push(*pid);
        }
    }
    runs
}

/// The backend holding the janitor lock of this database, with its `application_name`.
async fn lock_holder(pool: &PgPool) -> Option<(i32, String, String)> {
    sqlx::query_as(
        "SELECT a.pid, a.application_name, coalesce(a.state, '') || ' ' || a.query \
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = $1 \
           AND l.objsubid = 2 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind(i64::from(LOCK_CLASS))
    .fetch_optional(pool)
    .await
    .unwrap()
}

async fn backend_of(pool: &PgPool, instance: &str) -> i32 {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1",
    )
    .bind(format!("pgbox-janitor {instance}"))
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn wait_until_gone(pool: &PgPool, pid: i32) {
    for _ in 0..1000 {
        let alive: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(pid)
                .fetch_one(pool)
                .await
                .unwrap();
        if !alive {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("backend {pid} did not end within 10 s");
}

/// Passes of `janitor` until one holds the lock and leaves nothing for the next pass.
async fn until_done(janitor: &Janitor) -> Vec<PassReport> {
    let mut reports = Vec::new();
    for _ in 0..500 {
        let report = janitor.run_once().await.unwrap();
        let done = report.lock.is_held() && !report.more && !report.lost_lock;
        reports.push(report);
        if done {
            return reports;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no pass completed the work: {reports:?}");
}

fn inbox_total(reports: &[PassReport], consumer: &str) -> u64 {
    reports
        .iter()
        .map(|r| r.inbox_deleted.get(consumer).copied().unwrap_or(0))
        .sum()
}

#[tokio::test]
async fn retention_deletes_exactly_each_consumers_old_rows_and_respects_overrides() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    install_delete_log(&db.pool).await;
    let pool = &db.pool;
    insert_inbox(pool, "orders", "old-", 10, 8 * DAY).await;
    insert_inbox(pool, "orders", "young-", 5, 2 * DAY).await;
    insert_inbox(pool, "billing", "ancient-", 4, 31 * DAY).await;
    insert_inbox(pool, "billing", "old-", 10, 8 * DAY).await;
    insert_inbox(pool, "audit", "ancient-", 6, 100 * DAY).await;
    // Lease mode: an old row under a live lease stays; an expired lease older than the
    // retention goes, like `purge_older_than`.
    pool.execute(
        "INSERT INTO pgbox.inbox (consumer, key, processed_at, lease_token, lease_expires_at) VALUES \
         ('orders', 'live-lease', now() - interval '8 days', 1, now() + interval '1 hour'), \
         ('orders', 'dead-lease', now() - interval '8 days', 2, now() - interval '1 hour')",
    )
    .await
    .unwrap();

    let janitor = janitor(pool, "a")
        .inbox_retention(days(7))
        .consumer_retention("billing", days(30))
        .consumer_retention("audit", Retention::Forever)
        .batch_size(3)
        .max_batches_per_pass(2)
        .build()
        .unwrap();
    let reports = until_done(&janitor).await;

    assert_eq!(reports[0].lock, LockStatus::Acquired);
    assert!(
        reports[0].more,
        "11 old rows of orders need more than 2 batches of 3"
    );
    assert!(reports[1..].iter().all(|r| r.lock == LockStatus::Held));
    assert_eq!(inbox_total(&reports, "orders"), 11);
    assert_eq!(inbox_total(&reports, "billing"), 4);
    assert_eq!(inbox_total(&reports, "audit"), 0);
    assert!(
        reports
            .iter()
            .all(|r| !r.inbox_deleted.contains_key("audit"))
    );

    let keys: Vec<String> =
        sqlx::query_scalar("SELECT key FROM pgbox.inbox WHERE consumer = 'orders' ORDER BY key")
            .fetch_all(pool)
            .await
            .unwrap();
    let mut expected: Vec<String> = (1..=5).map(|i| format!("young-{i}")).collect();
    expected.push("live-lease".into());
    expected.sort();
    assert_eq!(keys, expected);
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM pgbox.inbox WHERE consumer = 'billing' AND key LIKE 'old-%'"
        )
        .await,
        10
    );
    assert_eq!(inbox_rows(pool, "billing").await, 10);
    assert_eq!(inbox_rows(pool, "audit").await, 6);

    // Every batch was its own statement of at most 3 rows, under the lock.
    let log = delete_log(pool).await;
    assert!(log.iter().all(|(_, rows, _)| *rows <= 3), "{log:?}");
    assert_eq!(log.iter().map(|(_, rows, _)| rows).sum::<i64>(), 15);
    assert_eq!(assert_one_at_a_time(&log).len(), 1);

    // A further pass finds nothing.
    let again = janitor.run_once().await.unwrap();
    assert_eq!((again.lock, again.deleted()), (LockStatus::Held, 0));
}

#[tokio::test]
async fn retention_below_the_minimum_and_other_bad_settings_are_refused() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://postgres@127.0.0.1:1/postgres")
        .unwrap();
    let refused = |b: JanitorBuilder, what: &str| match b.build() {
        Err(Error::InvalidConfig(msg)) => msg,
        other => panic!("{what}: expected InvalidConfig, got {other:?}"),
    };
    let msg = refused(
        Janitor::builder(pool.clone()).inbox_retention(Duration::from_secs(3600)),
        "1 h default retention",
    );
    assert!(msg.contains("min_retention"), "{msg}");
    // In words, not `3600s` and `86400s`.
    assert!(msg.contains("1 hour is below 1 day"), "{msg}");
    refused(
        Janitor::builder(pool.clone()).consumer_retention("points", Duration::from_secs(12 * 3600)),
        "12 h override",
    );
    refused(
        Janitor::builder(pool.clone())
            .min_retention(Duration::ZERO)
            .inbox_retention(Duration::ZERO),
        "zero retention",
    );
    refused(
        Janitor::builder(pool.clone()).published_retention(Duration::ZERO),
        "zero published retention",
    );
    refused(Janitor::builder(pool.clone()).batch_size(0), "batch size 0");
    refused(
        Janitor::builder(pool.clone()).batch_size(1_000_000),
        "huge batches",
    );
    refused(
        Janitor::builder(pool.clone()).interval(Duration::ZERO),
        "zero interval",
    );
    assert!(matches!(
        Janitor::builder(pool.clone())
            .consumer_retention("no spaces", days(30))
            .build(),
        Err(Error::InvalidConsumerName { .. })
    ));
    assert!(matches!(
        Janitor::builder(pool.clone()).schema("Bad").build(),
        Err(Error::InvalidIdentifier { .. })
    ));

    // A lower floor, set on purpose, admits a shorter retention; Forever is always fine.
    Janitor::builder(pool.clone())
        .min_retention(Duration::from_secs(3600))
        .inbox_retention(Duration::from_secs(2 * 3600))
        .consumer_retention("points", Retention::Forever)
        .build()
        .unwrap();
    let defaults = Janitor::builder(pool).build().unwrap();
    assert_eq!(defaults.schema_name(), "pgbox");
}

/// `n` outbox rows of `topic`, created `created_secs` ago, published `published_secs` ago (or
/// pending when `None`).
async fn insert_outbox(
    pool: &PgPool,
    topic: &str,
    n: i64,
    created_secs: u64,
    published_secs: Option<u64>,
) {
    sqlx::query(
        "INSERT INTO pgbox.outbox (message_id, topic, payload, content_type, created_at, published_at) \
         SELECT md5(random()::text || g)::uuid, $1, '\\x00', 'application/octet-stream', \
                now() - make_interval(secs => $2), now() - make_interval(secs => $3) \
         FROM generate_series(1, $4) g",
    )
    .bind(topic)
    .bind(created_secs as f64)
    .bind(published_secs.map(|s| s as f64))
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn audit_mode_published_rows_are_purged_by_age_and_pending_rows_never() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    install_delete_log(&db.pool).await;
    let pool = &db.pool;
    insert_outbox(pool, "pending", 5, 30 * DAY, None).await;
    insert_outbox(pool, "old", 7, 20 * DAY, Some(10 * DAY)).await;
    insert_outbox(pool, "recent", 3, 20 * DAY, Some(3600)).await;

    // Kept by default: audit rows go only when a retention is set.
    let keep = janitor(pool, "keep").build().unwrap();
    let report = keep.run_once().await.unwrap();
    assert_eq!((report.lock, report.deleted()), (LockStatus::Acquired, 0));
    assert_eq!(count(pool, "SELECT count(*) FROM pgbox.outbox").await, 15);
    keep.release().await.unwrap();

    let purge = janitor(pool, "purge")
        .published_retention(days(7))
        .batch_size(2)
        .build()
        .unwrap();
    let reports = until_done(&purge).await;
    assert_eq!(reports.iter().map(|r| r.published_deleted).sum::<u64>(), 7);
    let left: Vec<(String, i64)> =
        sqlx::query_as("SELECT topic, count(*) FROM pgbox.outbox GROUP BY topic ORDER BY topic")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(left, vec![("pending".into(), 5), ("recent".into(), 3)]);
    assert_eq!(assert_one_at_a_time(&delete_log(pool).await).len(), 1);

    // The purge walks the partial index that V8 adds (the doctor looks for it by name).
    let def: String = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'pgbox' AND indexname = 'outbox_published_idx'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(
        def.contains("(published_at)") && def.contains("WHERE (published_at IS NOT NULL)"),
        "{def}"
    );
    let mut conn = db.connect().await;
    conn.execute("SET enable_seqscan = off").await.unwrap();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT seq FROM pgbox.outbox WHERE published_at IS NOT NULL \
         AND published_at < now() - interval '7 days' ORDER BY published_at LIMIT 1000",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        plan.iter().any(|l| l.contains("outbox_published_idx")),
        "{plan:?}"
    );
}

#[tokio::test]
async fn dead_letters_are_untouched_unless_configured_and_deleting_one_releases_its_key() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    install_delete_log(&db.pool).await;
    let pool = &db.pool;
    for table in ["outbox_dead_letters", "queue_dead_letters"] {
        let counter = if table == "outbox_dead_letters" {
            "attempts"
        } else {
            "deliveries"
        };
        pool.execute(sqlx::AssertSqlSafe(format!(
            "INSERT INTO pgbox.{table} (seq, message_id, topic, ordering_key, payload, content_type, \
                                        headers, created_at, {counter}, last_error, dead_at) VALUES \
             (1000001, md5('old{table}')::uuid, 't', 'k-old', '\\x00', 'text/plain', '{{}}', \
              now() - interval '41 days', 10, 'boom', now() - interval '40 days'), \
             (1000002, md5('young{table}')::uuid, 't', 'k-young', '\\x00', 'text/plain', '{{}}', \
              now() - interval '2 days', 10, 'boom', now() - interval '1 hour')"
        )))
        .await
        .unwrap();
    }
    // Messages queued behind the two dead letters' keys.
    pool.execute(
        "INSERT INTO pgbox.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at) VALUES \
         (md5('next-old')::uuid, 't', 'k-old', '\\x01', 'text/plain', '{}', now()), \
         (md5('next-young')::uuid, 't', 'k-young', '\\x01', 'text/plain', '{}', now())",
    )
    .await
    .unwrap();
    let receivable = async || -> Vec<String> {
        let mut tx = pool.begin().await.unwrap();
        let keys = sqlx::query_scalar(
            "SELECT ordering_key FROM pgbox.queue_receive('t', 10, 30) ORDER BY ordering_key",
        )
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();
        keys
    };
    assert!(receivable().await.is_empty(), "both keys are held");

    // Not configured: even dead letters 40 days old stay.
    let default = janitor(pool, "default").build().unwrap();
    let report = default.run_once().await.unwrap();
    assert!(report.lock.is_held());
    assert_eq!(
        (
            report.outbox_dead_letters_deleted,
            report.queue_dead_letters_deleted
        ),
        (0, 0)
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM pgbox.outbox_dead_letters").await,
        2
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM pgbox.queue_dead_letters").await,
        2
    );
    default.release().await.unwrap();

    let configured = janitor(pool, "configured")
        .dead_letter_retention(days(30))
        .build()
        .unwrap();
    let reports = until_done(&configured).await;
    assert_eq!(
        reports
            .iter()
            .map(|r| (r.outbox_dead_letters_deleted, r.queue_dead_letters_deleted))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1)),
        (1, 1)
    );
    for table in ["outbox_dead_letters", "queue_dead_letters"] {
        let left: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT ordering_key FROM pgbox.{table}"
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        assert_eq!(left, vec!["k-young".to_owned()], "{table}");
    }
    // The old dead letter's key is released, as `discard` would; the young one still holds.
    assert_eq!(receivable().await, vec!["k-old".to_owned()]);

    // Only one of the two retentions set: the other table is left alone.
    pool.execute(
        "UPDATE pgbox.outbox_dead_letters SET dead_at = now() - interval '60 days'; \
         UPDATE pgbox.queue_dead_letters SET dead_at = now() - interval '60 days'",
    )
    .await
    .unwrap();
    configured.release().await.unwrap();
    let queue_only = janitor(pool, "queue-only")
        .queue_dead_letter_retention(days(30))
        .build()
        .unwrap();
    let report = queue_only.run_once().await.unwrap();
    assert_eq!(
        (
            report.outbox_dead_letters_deleted,
            report.queue_dead_letters_deleted
        ),
        (0, 1)
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM pgbox.outbox_dead_letters").await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_at_once_only_one_works_at_a_time_and_another_takes_over() {
    const OLD: i64 = 20_000;
    support::init_tracing();
    let db = TestDb::migrated().await;
    install_delete_log(&db.pool).await;
    let pool = &db.pool;
    insert_inbox(pool, "bulk", "old-", OLD, 30 * DAY).await;
    insert_inbox(pool, "bulk", "young-", 100, 3600).await;

    let mut instances = Vec::new();
    for i in 0..3 {
        let name = format!("j{i}");
        let janitor = Arc::new(
            janitor(pool, &name)
                .batch_size(200)
                .max_batches_per_pass(5)
                .batch_pause(Duration::from_millis(10))
                .build()
                .unwrap(),
        );
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let janitor = janitor.clone();
            let shutdown = shutdown.clone();
            async move { janitor.run(shutdown).await }
        });
        instances.push((name, shutdown, Some(task)));
    }

    // Stop whichever instance holds the lock once it has done some work, twice: each time
    // another one takes over. The last one finishes.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut stopped = 0;
    loop {
        assert!(
            Instant::now() < deadline,
            "the backlog was not deleted in time"
        );
        let left = count(
            pool,
            "SELECT count(*) FROM pgbox.inbox WHERE key LIKE 'old-%'",
        )
        .await;
        if left == 0 {
            break;
        }
        if stopped < 2
            && let Some((pid, app, _)) = lock_holder(pool).await
        {
            let by_holder: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(rows), 0)::bigint FROM janitor_log WHERE pid = $1",
            )
            .bind(pid)
            .fetch_one(pool)
            .await
            .unwrap();
            if by_holder >= 2_000 {
                let (_, shutdown, task) = instances
                    .iter_mut()
                    .find(|(name, ..)| app == format!("pgbox-janitor {name}"))
                    .expect("the holder is one of ours");
                shutdown.cancel();
                task.take().unwrap().await.unwrap().unwrap();
                stopped += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (_, shutdown, task) in &mut instances {
        shutdown.cancel();
        if let Some(task) = task.take() {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("run returns after shutdown")
                .unwrap()
                .unwrap();
        }
    }

    assert_eq!(inbox_rows(pool, "bulk").await, 100, "young rows stay");
    let log = delete_log(pool).await;
    assert_eq!(log.iter().map(|(_, rows, _)| rows).sum::<i64>(), OLD);
    assert!(log.iter().all(|(_, rows, _)| *rows <= 200));
    let workers = assert_one_at_a_time(&log);
    assert_eq!(workers.len(), 3, "two handovers: {workers:?}");
    assert!(
        lock_holder(pool).await.is_none(),
        "shutdown released the lock"
    );
}

/// The child side of [`a_janitor_killed_mid_batch_leaves_no_half_done_batch_and_another_takes_over`]:
/// when `PGBOX_JANITOR_CHILD_URL` is set, runs a janitor until killed. Otherwise (the normal
/// test run) returns at once.
#[tokio::test]
async fn janitor_child() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let janitor = janitor(&pool, "child")
        .batch_size(500)
        .max_batches_per_pass(1000)
        .build()
        .unwrap();
    // Bounded: the parent kills this process long before.
    let _ = tokio::time::timeout(
        Duration::from_secs(120),
        janitor.run(CancellationToken::new()),
    )
    .await;
    panic!("the parent should have killed this process");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_janitor_killed_mid_batch_leaves_no_half_done_batch_and_another_takes_over() {
    const OLD: i64 = 5_000;
    support::init_tracing();
    let db = TestDb::migrated().await;
    install_delete_log(&db.pool).await;
    let pool = &db.pool;
    insert_inbox(pool, "bulk", "old-", OLD, 30 * DAY).await;
    insert_inbox(pool, "bulk", "young-", 50, 3600).await;
    // Each unit stays open 300 ms after its delete: the kill lands inside one.
    set_unit_sleep(pool, 0.3).await;

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "janitor_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, db.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    // Wait until the child has committed two batches and is inside a third.
    let deadline = Instant::now() + Duration::from_secs(60);
    let child_pid = loop {
        assert!(Instant::now() < deadline, "the child never got to work");
        if let Some((pid, app, activity)) = lock_holder(pool).await {
            assert_eq!(app, "pgbox-janitor child");
            let committed: i64 =
                sqlx::query_scalar("SELECT count(*) FROM janitor_log WHERE pid = $1 AND rows > 0")
                    .bind(pid)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            if committed >= 2 && activity.starts_with("active DELETE") {
                child.kill().unwrap(); // SIGKILL: no destructor, no unlock, no rollback sent.
                break pid;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    child.wait().unwrap();
    wait_until_gone(pool, child_pid).await;

    // The batch in flight rolled back whole: the rows left are exactly the rows the
    // committed batches did not take, and those came in whole batches.
    let committed: i64 = delete_log(pool).await.iter().map(|(_, rows, _)| rows).sum();
    assert!((1_000..OLD).contains(&committed), "{committed}");
    assert_eq!(committed % 500, 0, "only whole batches committed");
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM pgbox.inbox WHERE key LIKE 'old-%'"
        )
        .await,
        OLD - committed
    );
    assert!(
        lock_holder(pool).await.is_none(),
        "the lock died with its session"
    );

    set_unit_sleep(pool, 0.0).await;
    let survivor = janitor(pool, "survivor").batch_size(500).build().unwrap();
    let reports = until_done(&survivor).await;
    assert_eq!(reports[0].lock, LockStatus::Acquired);
    assert_eq!(inbox_total(&reports, "bulk") as i64, OLD - committed);
    assert_eq!(inbox_rows(pool, "bulk").await, 50);

    let log = delete_log(pool).await;
    assert_eq!(log.iter().map(|(_, rows, _)| rows).sum::<i64>(), OLD);
    let workers = assert_one_at_a_time(&log);
    assert_eq!(workers.len(), 2);
    assert_eq!(workers[0], child_pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_lock_connection_stops_the_work_until_the_lock_is_taken_again() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    install_delete_log(&db.pool).await;
    let pool = &db.pool;
    let a = Arc::new(janitor(pool, "a").batch_size(100).build().unwrap());
    let b = janitor(pool, "b").batch_size(100).build().unwrap();

    insert_inbox(pool, "x", "one-", 300, 30 * DAY).await;
    let first = a.run_once().await.unwrap();
    assert_eq!(first.lock, LockStatus::Acquired);
    assert_eq!(first.inbox_deleted.get("x"), Some(&300));
    let b_waits = b.run_once().await.unwrap();
    assert_eq!((b_waits.lock, b_waits.deleted()), (LockStatus::NotHeld, 0));

    // Between passes: a's lock connection is terminated; b takes over.
    let a_pid = backend_of(pool, "a").await;
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(a_pid)
        .execute(pool)
        .await
        .unwrap();
    wait_until_gone(pool, a_pid).await;
    insert_inbox(pool, "x", "two-", 200, 30 * DAY).await;
    let b_takes = b.run_once().await.unwrap();
    assert_eq!(b_takes.lock, LockStatus::Acquired);
    assert_eq!(b_takes.inbox_deleted.get("x"), Some(&200));

    // a notices before doing anything, and does nothing while b holds the lock.
    insert_inbox(pool, "x", "three-", 150, 30 * DAY).await;
    let a_lost = a.run_once().await.unwrap();
    assert!(a_lost.lost_lock);
    assert_eq!((a_lost.lock, a_lost.deleted()), (LockStatus::NotHeld, 0));
    let a_waits = a.run_once().await.unwrap();
    assert_eq!(
        (a_waits.lock, a_waits.lost_lock, a_waits.deleted()),
        (LockStatus::NotHeld, false, 0)
    );
    assert_eq!(inbox_rows(pool, "x").await, 150);

    // b lets go; a takes the lock again, on a new connection, and works.
    b.release().await.unwrap();
    let a_back = a.run_once().await.unwrap();
    assert_eq!(a_back.lock, LockStatus::Acquired);
    assert_eq!(a_back.inbox_deleted.get("x"), Some(&150));
    let a_pid2 = backend_of(pool, "a").await;
    assert_ne!(a_pid, a_pid2);

    // Terminated mid-pass, inside a unit: the pass stops there, the unit rolls back.
    insert_inbox(pool, "x", "four-", 1_000, 30 * DAY).await;
    set_unit_sleep(pool, 0.3).await;
    let pass = tokio::spawn({
        let a = a.clone();
        async move { a.run_once().await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "a never got inside a unit");
        let committed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM janitor_log WHERE pid = $1 AND rows = 100")
                .bind(a_pid2)
                .fetch_one(pool)
                .await
                .unwrap();
        let activity = lock_holder(pool).await.map(|(_, _, act)| act);
        // One batch of 100 is from the pass above (150 rows: 100 + 50); a second means this
        // pass committed one.
        if committed >= 2 && activity.is_some_and(|act| act.starts_with("active DELETE")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(a_pid2)
        .execute(pool)
        .await
        .unwrap();
    let cut = pass.await.unwrap().unwrap();
    assert_eq!(cut.lock, LockStatus::Held);
    assert!(cut.lost_lock);
    let done_by_a = cut.inbox_deleted.get("x").copied().unwrap_or(0);
    assert_eq!(done_by_a % 100, 0, "whole batches only");
    assert!(done_by_a < 1_000);
    assert_eq!(inbox_rows(pool, "x").await as u64, 1_000 - done_by_a);

    set_unit_sleep(pool, 0.0).await;
    let rest = until_done(&b).await;
    assert_eq!(rest[0].lock, LockStatus::Acquired);
    assert_eq!(inbox_total(&rest, "x"), 1_000 - done_by_a);
    assert_eq!(inbox_rows(pool, "x").await, 0);

    let workers = assert_one_at_a_time(&delete_log(pool).await);
    assert_eq!(workers.len(), 4, "a, b, a again, b again: {workers:?}");
    assert_eq!(workers[0], a_pid);
    assert_eq!(workers[2], a_pid2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_drains_a_backlog_without_waiting_the_interval_and_stops_promptly() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    insert_inbox(pool, "x", "old-", 1_000, 30 * DAY).await;
    // One batch per pass and an hour between passes: only the "more to do" rule drains it.
    let janitor = Arc::new(
        Janitor::builder(pool.clone())
            .instance_name("solo")
            .interval(Duration::from_secs(3600))
            .batch_size(100)
            .max_batches_per_pass(1)
            .build()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let janitor = janitor.clone();
        let shutdown = shutdown.clone();
        async move { janitor.run(shutdown).await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while inbox_rows(pool, "x").await > 0 {
        assert!(Instant::now() < deadline, "the backlog was not drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(lock_holder(pool).await.is_some());
    // Now asleep for an hour: shutdown ends the sleep and releases the lock.
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("run returns on shutdown, not after the interval")
        .unwrap()
        .unwrap();
    assert!(lock_holder(pool).await.is_none());
}

/// The consumer runner's hand-back counts (`hand_backs`, V20) are deleted a week after a
/// message's last hand-back, always (no retention to configure), in batches; younger rows
/// stay.
#[tokio::test]
async fn hand_backs_not_handed_back_for_a_week_are_purged() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    pool.execute(
        "INSERT INTO pgbox.hand_backs (consumer, message_id, count, at) \
         SELECT 'c', md5('old' || i)::uuid, 3, now() - interval '8 days' FROM generate_series(1, 5) i; \
         INSERT INTO pgbox.hand_backs (consumer, message_id, count, at) \
         SELECT 'c', md5('young' || i)::uuid, 3, now() - interval '6 days' FROM generate_series(1, 2) i",
    )
    .await
    .unwrap();
    let janitor = janitor(pool, "hand-backs").batch_size(2).build().unwrap();
    let reports = until_done(&janitor).await;
    assert_eq!(reports.iter().map(|r| r.hand_backs_deleted).sum::<u64>(), 5);
    assert_eq!(reports.iter().map(PassReport::deleted).sum::<u64>(), 5);
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM pgbox.hand_backs \
             WHERE message_id IN (SELECT md5('young' || i)::uuid FROM generate_series(1, 2) i)"
        )
        .await,
        2,
        "the young rows stay"
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM pgbox.hand_backs").await,
        2
    );
    let mut conn = db.connect().await;
    conn.execute("SET enable_seqscan = off").await.unwrap();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT ctid FROM pgbox.hand_backs WHERE at < now() - interval '7 days' \
         ORDER BY at LIMIT 1000",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        plan.iter().any(|l| l.contains("hand_backs_at_idx")),
        "{plan:?}"
    );
    janitor.release().await.unwrap();
}
