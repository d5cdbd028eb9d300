//! The time-partitioned inbox: exactly-once across partition boundaries, layouts that cannot
//! be mixed, expiry by partition drop that respects the redelivery window.
//!
//! Partitions here are one second wide, so that a test crosses several boundaries in a few
//! seconds; the claim's correctness does not depend on the width.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pgbox::{Error, Inbox, InboxPartitioning, InboxPartitions, Migrator, Outcome};
use sqlx::{Connection, PgPool};
use support::{TestDb, wait_for_lock_waiter};

const SECOND: Duration = Duration::from_secs(1);

/// A database whose default schema uses one-second partitions, `ahead` of them created.
async fn partitioned_db(minimum_retention: Duration, ahead: u32) -> TestDb {
    support::init_tracing();
    let db = TestDb::empty().await;
    let report = Migrator::new()
        .partitioned_inbox(
            InboxPartitioning::every(SECOND)
                .minimum_retention(minimum_retention)
                .ahead(ahead),
        )
        .run(&db.pool)
        .await
        .expect("migrate with the partitioned inbox");
    assert!(
        report.partitions_created.len() > ahead as usize,
        "{report:?}"
    );
    sqlx::query("CREATE TABLE effects (key text NOT NULL, worker int NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

fn partitioned(consumer: &str) -> Inbox {
    Inbox::builder(consumer).partitioned(true).build().unwrap()
}

/// Sleeps until just after the next whole second of the database clock: the next partition.
async fn cross_boundary(pool: &PgPool) {
    let now: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(pool)
        .await
        .unwrap();
    let wait = now.ceil() - now + 0.05;
    tokio::time::sleep(Duration::from_secs_f64(wait)).await;
}

/// The partition that holds `key`'s row, and how many rows the key has in all.
async fn where_is(pool: &PgPool, consumer: &str, key: &str) -> (Vec<String>, i64) {
    let partitions: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pgbox.partitioned_inbox AS i \
         JOIN pg_class AS c ON c.oid = i.tableoid \
         WHERE i.consumer = $1 AND i.key = $2",
    )
    .bind(consumer)
    .bind(key)
    .fetch_all(pool)
    .await
    .unwrap();
    let n = partitions.len() as i64;
    (partitions, n)
}

/// Delivers `key` once with a handler that does nothing: commits on success, rolls back on
/// an error.
async fn process_noop(inbox: &Inbox, pool: &PgPool, key: &str) -> Result<Outcome<()>, Error> {
    let mut tx = pool.begin().await?;
    let outcome = inbox
        .process(&mut tx, key, async |_c| Ok::<_, Error>(()))
        .await?;
    tx.commit().await?;
    Ok(outcome)
}

async fn effects(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn record_effect(
    conn: &mut pgbox::HandlerConnection<'_>,
    key: &str,
    worker: i32,
) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (key, worker) VALUES ($1, $2)")
        .bind(key)
        .bind(worker)
        .execute(&mut **conn)
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_redelivery_in_a_later_partition_is_a_duplicate_that_writes_nothing() {
    let db = partitioned_db(Duration::ZERO, 30).await;
    let inbox = partitioned("points");
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "order-1", async |conn| {
            record_effect(conn, "order-1", 0).await?;
            Ok::<_, Error>(serde_json::json!({"points": 30}))
        })
        .await
        .unwrap();
    assert!(outcome.is_processed());
    tx.commit().await.unwrap();
    let (first, _) = where_is(&db.pool, "points", "order-1").await;

    for _ in 0..2 {
        cross_boundary(&db.pool).await;
        let mut tx = db.pool.begin().await.unwrap();
        let outcome = inbox
            .process(&mut tx, "order-1", async |conn| {
                record_effect(conn, "order-1", 1).await?;
                Ok::<_, Error>(serde_json::json!({"points": 99}))
            })
            .await
            .unwrap();
        let Outcome::Duplicate(duplicate) = outcome else {
            panic!("expected a duplicate, got {outcome:?}");
        };
        let stored: Option<serde_json::Value> = duplicate.outcome().unwrap();
        assert_eq!(stored, Some(serde_json::json!({"points": 30})));
        let xid: Option<i64> =
            sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text::bigint")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        assert_eq!(xid, None, "the duplicate wrote something");
        // This transaction's own partition is a later one than the record's.
        let mine: String = sqlx::query_scalar(
            "SELECT r_name FROM pgbox.inbox_partitions() WHERE now() >= r_from AND now() < r_to",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert_ne!(vec![mine], first, "the redelivery did not cross a boundary");
        tx.commit().await.unwrap();
    }
    assert_eq!(where_is(&db.pool, "points", "order-1").await.1, 1);
    assert_eq!(effects(&db.pool, "order-1").await, 1);
    // The cheap pre-check finds it too.
    let found = inbox.lookup(&db.pool, "order-1").await.unwrap();
    assert!(found.is_some());
}

#[tokio::test]
async fn a_claim_in_the_next_partition_waits_for_the_holder_then_sees_its_commit_or_rollback() {
    let db = partitioned_db(Duration::ZERO, 30).await;
    let inbox = partitioned("points");
    for commit_first in [true, false] {
        let key = format!("k-{commit_first}");
        // The holder's transaction starts (and writes) in one partition...
        let mut holder = db.pool.begin().await.unwrap();
        let claimed = inbox.claim(&mut holder, key.as_str()).await.unwrap();
        assert!(matches!(claimed, pgbox::Claim::Claimed(_)));
        record_effect_raw(&mut holder, &key, 1).await;
        // ...the racing delivery's starts in the next one.
        cross_boundary(&db.pool).await;
        let racer = {
            let pool = db.pool.clone();
            let inbox = inbox.clone();
            let key = key.clone();
            tokio::spawn(async move {
                let mut tx = pool.begin().await.unwrap();
                let outcome = inbox
                    .process(&mut tx, key.as_str(), async |conn| {
                        record_effect(conn, &key, 2).await
                    })
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                outcome
            })
        };
        wait_for_lock_waiter(&db.pool).await;
        assert!(
            !racer.is_finished(),
            "the racer did not wait for the holder"
        );
        if commit_first {
            holder.commit().await.unwrap();
            let outcome = racer.await.unwrap();
            assert!(outcome.is_duplicate(), "{outcome:?}");
        } else {
            holder.rollback().await.unwrap();
            let outcome = racer.await.unwrap();
            assert!(outcome.is_processed(), "{outcome:?}");
        }
        let (partitions, rows) = where_is(&db.pool, "points", &key).await;
        assert_eq!(rows, 1, "{partitions:?}");
        assert_eq!(effects(&db.pool, &key).await, 1);
    }
}

async fn record_effect_raw(tx: &mut sqlx::PgConnection, key: &str, worker: i32) {
    sqlx::query("INSERT INTO effects (key, worker) VALUES ($1, $2)")
        .bind(key)
        .bind(worker)
        .execute(tx)
        .await
        .unwrap();
}

#[derive(Default)]
struct Tally {
    processed: AtomicU64,
    duplicates: AtomicU64,
    cross_partition_duplicates: AtomicU64,
    rolled_back: AtomicU64,
    retried: AtomicU64,
}

/// Rounds of racing deliveries, each straddling a partition switch: just before a boundary,
/// half the workers begin transactions (in the old partition) and wait past the boundary
/// before claiming; the other half begin theirs just after it (in the new partition). All
/// deliver the round's fresh keys, in random orders, concurrently, plus redeliveries of
/// earlier rounds' keys; a delivery that claimed rolls back one time in three. Then every
/// key is delivered once more and committed. Each key's effect must exist exactly once, and
/// its record once.
async fn race_across_switches(serializable: bool) {
    let db = partitioned_db(Duration::ZERO, 30).await;
    let inbox = partitioned("points");
    let tally = Arc::new(Tally::default());
    let mut all_keys: Vec<String> = Vec::new();
    for round in 0..4 {
        let fresh: Vec<String> = (0..6).map(|i| format!("r{round}-k{i}")).collect();
        all_keys.extend(fresh.iter().cloned());
        let earlier = Arc::new(all_keys.clone());
        // 40 ms before the next boundary.
        let now: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let until_boundary = now.ceil() - now;
        if until_boundary > 0.04 {
            tokio::time::sleep(Duration::from_secs_f64(until_boundary - 0.04)).await;
        } else {
            tokio::time::sleep(Duration::from_secs_f64(until_boundary + 0.96)).await;
        }
        let mut workers = Vec::new();
        for worker in 0..8 {
            let (pool, inbox, tally, earlier) = (
                db.pool.clone(),
                inbox.clone(),
                tally.clone(),
                earlier.clone(),
            );
            let mut keys = fresh.clone();
            fastrand::shuffle(&mut keys);
            workers.push(tokio::spawn(async move {
                let old_side = worker % 2 == 0;
                if !old_side {
                    tokio::time::sleep(Duration::from_millis(80)).await;
                }
                for (i, key) in keys.iter().enumerate() {
                    // The old side's first transaction begins before the boundary and
                    // claims after it.
                    let pause = if old_side && i == 0 {
                        80
                    } else {
                        fastrand::u64(..4)
                    };
                    let commit = fastrand::u8(..3) != 0;
                    deliver(
                        &pool,
                        &inbox,
                        key,
                        worker,
                        commit,
                        serializable,
                        pause,
                        &tally,
                    )
                    .await;
                    let old = &earlier[fastrand::usize(..earlier.len())];
                    deliver(&pool, &inbox, old, worker, true, serializable, 0, &tally).await;
                }
            }));
        }
        for w in workers {
            w.await.unwrap();
        }
    }
    for key in &all_keys {
        deliver(&db.pool, &inbox, key, 99, true, serializable, 0, &tally).await;
    }
    let mut spread: HashMap<String, i64> = HashMap::new();
    for key in &all_keys {
        let (partitions, rows) = where_is(&db.pool, "points", key).await;
        assert_eq!(rows, 1, "{key}: {partitions:?}");
        *spread.entry(partitions[0].clone()).or_default() += 1;
        assert_eq!(effects(&db.pool, key).await, 1, "{key}: effect count");
    }
    let t = |a: &AtomicU64| a.load(Ordering::Relaxed);
    eprintln!(
        "serializable={serializable}: processed {} duplicates {} (across partitions {}) rolled back {} retried {}; keys by partition {spread:?}",
        t(&tally.processed),
        t(&tally.duplicates),
        t(&tally.cross_partition_duplicates),
        t(&tally.rolled_back),
        t(&tally.retried)
    );
    // The race really crossed boundaries, and really had rollbacks.
    assert!(t(&tally.cross_partition_duplicates) > 0);
    assert!(t(&tally.rolled_back) > 0);
    assert!(
        spread.len() > 2,
        "first claims fell into too few partitions"
    );
    let total_effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total_effects, all_keys.len() as i64);
}

#[allow(clippy::too_many_arguments)]
async fn deliver(
    pool: &PgPool,
    inbox: &Inbox,
    key: &str,
    worker: i32,
    commit: bool,
    serializable: bool,
    pause_ms: u64,
    tally: &Tally,
) {
    for _attempt in 0..50 {
        let mut tx = pool.begin().await.unwrap();
        if serializable {
            sqlx::query("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        let started: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        let outcome = inbox
            .process(&mut tx, key, async |conn| {
                record_effect(conn, key, worker).await?;
                tokio::time::sleep(Duration::from_millis(fastrand::u64(2..8))).await;
                Ok::<_, Error>(())
            })
            .await;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(e) if e.is_retryable() => {
                tally.retried.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(e) => panic!("{key}: {e}"),
        };
        if let Outcome::Duplicate(d) = &outcome {
            tally.duplicates.fetch_add(1, Ordering::Relaxed);
            let first = d.first_processed_at.unix_timestamp_nanos() as f64 / 1e9;
            if first.floor() != started.floor() {
                tally
                    .cross_partition_duplicates
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        if !commit && outcome.is_processed() {
            tx.rollback().await.unwrap();
            tally.rolled_back.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match tx.commit().await.map_err(Error::from) {
            Ok(()) => {
                if outcome.is_processed() {
                    tally.processed.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            Err(e) if e.is_retryable() => {
                tally.retried.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(e) => panic!("{key}: commit: {e}"),
        }
    }
    panic!("{key}: 50 retries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_deliveries_across_partition_switches_apply_once_under_read_committed() {
    race_across_switches(false).await;
}

#[tokio::test]
async fn repeatable_read_and_serializable_are_refused_with_a_typed_error_and_record_nothing() {
    let db = partitioned_db(Duration::ZERO, 5).await;
    let inbox = partitioned("points");
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET TRANSACTION ISOLATION LEVEL {level}"
        )))
        .execute(&mut *tx)
        .await
        .unwrap();
        let ran = std::sync::atomic::AtomicBool::new(false);
        let err = inbox
            .process(&mut tx, "k", async |_conn| {
                ran.store(true, Ordering::SeqCst);
                Ok::<_, Error>(())
            })
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InboxLayout(ref m) if m.contains(level) && m.contains("READ COMMITTED")),
            "{level}: {err}"
        );
        assert!(!ran.load(Ordering::SeqCst));
        drop(tx);
        // The batch claim refuses the same way.
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET TRANSACTION ISOLATION LEVEL {level}"
        )))
        .execute(&mut *tx)
        .await
        .unwrap();
        let err = inbox.claim_batch(&mut tx, ["k", "k2"]).await.unwrap_err();
        assert!(
            matches!(err, Error::InboxLayout(ref m) if m.contains(level)),
            "{err}"
        );
        drop(tx);
    }
    assert_eq!(where_is(&db.pool, "points", "k").await.1, 0);
}

/// The race the review found: a claim whose snapshot predates a READ COMMITTED holder's
/// commit, in the next partition. Under SERIALIZABLE (or REPEATABLE READ) its look-up would
/// miss the holder's row and record the key a second time; it is refused instead. Every
/// pair of levels: only READ COMMITTED against READ COMMITTED claims, once.
#[tokio::test]
async fn a_claim_whose_snapshot_predates_a_commit_across_a_boundary_never_records_twice() {
    // Nine pairs, each crossing a 1 s boundary: partitions for well past the end.
    let db = partitioned_db(Duration::ZERO, 30).await;
    let inbox = partitioned("points");
    let levels = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"];
    for (i, late) in levels.iter().enumerate() {
        for (j, early) in levels.iter().enumerate() {
            let key = format!("pair-{i}-{j}");
            // The late claimer's transaction starts (and takes its snapshot) first.
            let mut late_tx = db.pool.begin().await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SET TRANSACTION ISOLATION LEVEL {late}"
            )))
            .execute(&mut *late_tx)
            .await
            .unwrap();
            sqlx::query("SELECT 1")
                .execute(&mut *late_tx)
                .await
                .unwrap();
            // The holder claims and commits, in the next partition.
            cross_boundary(&db.pool).await;
            let mut early_tx = db.pool.begin().await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SET TRANSACTION ISOLATION LEVEL {early}"
            )))
            .execute(&mut *early_tx)
            .await
            .unwrap();
            let first = inbox
                .process(&mut early_tx, key.as_str(), async |conn| {
                    record_effect(conn, &key, 1).await
                })
                .await;
            let first_ok = match first {
                Ok(outcome) => {
                    assert!(outcome.is_processed(), "{early}: {outcome:?}");
                    early_tx.commit().await.unwrap();
                    true
                }
                Err(e) => {
                    assert!(matches!(e, Error::InboxLayout(_)), "{early}: {e}");
                    assert_ne!(*early, "READ COMMITTED", "{e}");
                    false
                }
            };
            let second = inbox
                .process(&mut late_tx, key.as_str(), async |conn| {
                    record_effect(conn, &key, 2).await
                })
                .await;
            match second {
                Ok(outcome) => {
                    assert_eq!(*late, "READ COMMITTED", "{late} claimed: {outcome:?}");
                    assert_eq!(
                        outcome.is_duplicate(),
                        first_ok,
                        "{late}/{early}: {outcome:?}"
                    );
                    late_tx.commit().await.unwrap();
                }
                Err(e) => {
                    assert!(matches!(e, Error::InboxLayout(_)), "{late}: {e}");
                    assert_ne!(*late, "READ COMMITTED", "{e}");
                }
            }
            let (partitions, rows) = where_is(&db.pool, "points", &key).await;
            assert!(
                rows <= 1,
                "{late} after {early}: recorded twice in {partitions:?}"
            );
            assert!(
                effects(&db.pool, &key).await <= 1,
                "{late} after {early}: two effects"
            );
        }
    }
}

#[tokio::test]
async fn layouts_cannot_be_mixed() {
    // A plain inbox in a partitioned schema: refused, not deduplicated against the old table.
    let db = partitioned_db(Duration::ZERO, 5).await;
    let plain = Inbox::new("points").unwrap();
    let err = process_noop(&plain, &db.pool, "k").await.unwrap_err();
    assert!(
        matches!(err, Error::InboxLayout(ref m) if m.contains("partitioned(true)")),
        "{err}"
    );
    let mut tx = db.pool.begin().await.unwrap();
    let err = plain.claim_batch(&mut tx, ["a", "b"]).await.unwrap_err();
    assert!(matches!(err, Error::InboxLayout(_)), "{err}");
    drop(tx);
    let err = plain.lease(&db.pool, "k", SECOND).await.unwrap_err();
    assert!(matches!(err, Error::InboxLayout(_)), "{err}");
    // Lease mode is not available on the partitioned inbox.
    let err = partitioned("points")
        .lease(&db.pool, "k", SECOND)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InboxLayout(_)), "{err}");

    // A partitioned inbox in a plain schema: refused too.
    let plain_db = TestDb::migrated().await;
    let err = process_noop(&partitioned("points"), &plain_db.pool, "k")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InboxLayout(_)), "{err}");
    let mut tx = plain_db.pool.begin().await.unwrap();
    let err = partitioned("points")
        .claim_batch(&mut tx, ["a"])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InboxLayout(_)), "{err}");
}

#[tokio::test]
async fn records_from_before_the_switch_keep_deduplicating() {
    let db = TestDb::migrated().await;
    let plain = Inbox::new("points").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let _ = plain
        .process(&mut tx, "old", async |_c| Ok::<_, Error>(7))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    Migrator::new()
        .partitioned_inbox(InboxPartitioning::every(SECOND).minimum_retention(Duration::ZERO))
        .run(&db.pool)
        .await
        .unwrap();
    let inbox = partitioned("points");
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "old", async |_c| Ok::<_, Error>(8))
        .await
        .unwrap();
    let Outcome::Duplicate(d) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(d.outcome::<i32>().unwrap(), Some(7));
    let claimed = inbox.claim_batch(&mut tx, ["old", "new"]).await.unwrap();
    assert_eq!(claimed, vec![false, true]);
    tx.commit().await.unwrap();
    assert!(inbox.lookup(&db.pool, "old").await.unwrap().is_some());
    assert!(inbox.lookup(&db.pool, "new").await.unwrap().is_some());
    assert!(inbox.lookup(&db.pool, "none").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_in_opposite_orders_across_switches_claim_each_key_once_without_deadlock() {
    let db = partitioned_db(Duration::ZERO, 30).await;
    let inbox = partitioned("points");
    let claimed_total = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_millis(2_500);
    let mut tasks = Vec::new();
    for worker in 0..4 {
        let (pool, inbox, claimed_total) = (db.pool.clone(), inbox.clone(), claimed_total.clone());
        tasks.push(tokio::spawn(async move {
            let mut round = 0;
            while Instant::now() < deadline {
                round += 1;
                // A window of keys that slides with time (every worker batches the same
                // keys at the same moment, and new keys keep coming through the switches),
                // forwards or backwards, with a repeat inside.
                let base = (started.elapsed().as_millis() / 50) as usize * 5;
                let mut keys: Vec<String> = (base..base + 20).map(|i| format!("k{i}")).collect();
                if worker % 2 == 1 {
                    keys.reverse();
                }
                keys.push(keys[0].clone());
                let mut tx = pool.begin().await.unwrap();
                let claimed = inbox
                    .claim_batch(&mut tx, keys.iter().map(String::as_str))
                    .await;
                let claimed = match claimed {
                    Ok(c) => c,
                    Err(e) => panic!("worker {worker}: {e}"),
                };
                assert!(
                    !claimed[claimed.len() - 1],
                    "a repeated key was claimed twice"
                );
                for (key, new) in keys.iter().zip(&claimed) {
                    if *new {
                        sqlx::query("INSERT INTO effects (key, worker) VALUES ($1, $2)")
                            .bind(key)
                            .bind(worker)
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                    }
                }
                let n = claimed.iter().filter(|c| **c).count() as u64;
                if round % 4 == 0 {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    claimed_total.fetch_add(n, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM effects GROUP BY key HAVING count(*) > 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert!(rows.is_empty(), "keys applied twice: {rows:?}");
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.partitioned_inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(records, effects);
    assert_eq!(records as u64, claimed_total.load(Ordering::Relaxed));
    let partitions: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM pgbox.partitioned_inbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(partitions > 1, "the batches never crossed a boundary");
}

#[tokio::test]
async fn expiry_drops_old_partitions_and_refuses_a_retention_below_the_minimum() {
    let db = partitioned_db(Duration::from_secs(2), 30).await;
    let inbox = partitioned("points");
    let partitions = InboxPartitions::new(db.pool.clone());
    let settings = partitions.settings().await.unwrap().unwrap();
    assert_eq!(settings.width(), SECOND);
    assert_eq!(settings.minimum_retention_window(), Duration::from_secs(2));

    let err = partitions.drop_expired(SECOND).await.unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig(ref m) if m.contains("minimum")),
        "{err}"
    );

    assert!(
        process_noop(&inbox, &db.pool, "old")
            .await
            .unwrap()
            .is_processed()
    );
    let (old_partition, _) = where_is(&db.pool, "points", "old").await;

    // Nothing is old enough yet: the record's partition is younger than the retention.
    let early = partitions
        .drop_expired(Duration::from_secs(2))
        .await
        .unwrap();
    assert!(
        early.iter().all(|p| p.name != old_partition[0]),
        "dropped a partition younger than the retention: {early:?}"
    );

    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert!(
        process_noop(&inbox, &db.pool, "young")
            .await
            .unwrap()
            .is_processed()
    );
    let before = partitions.list().await.unwrap();
    let dropped = partitions
        .drop_expired(Duration::from_secs(2))
        .await
        .unwrap();
    assert!(
        dropped.iter().any(|p| p.name == old_partition[0]),
        "{dropped:?}"
    );
    let cutoff: time::OffsetDateTime = sqlx::query_scalar("SELECT now() - interval '2 seconds'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    for p in &dropped {
        assert!(
            p.to <= cutoff,
            "dropped a partition younger than the retention: {p:?}"
        );
    }
    let after = partitions.list().await.unwrap();
    assert_eq!(after.len() + dropped.len(), before.len());
    assert!(
        after
            .iter()
            .all(|p| p.to > cutoff - time::Duration::seconds(1))
    );
    // The young record is kept; the old key is forgotten, as its retention says.
    assert_eq!(where_is(&db.pool, "points", "young").await.1, 1);
    assert_eq!(where_is(&db.pool, "points", "old").await.1, 0);
    let mut tx = db.pool.begin().await.unwrap();
    let again = inbox
        .process(&mut tx, "old", async |_c| Ok::<_, Error>(()))
        .await
        .unwrap();
    assert!(again.is_processed());
    tx.commit().await.unwrap();
    // Dropping is what expiry is: no table holds the old partition any more.
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&old_partition[0])
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!exists);
}

#[tokio::test]
async fn running_out_of_partitions_is_a_typed_error_until_more_are_created() {
    let db = partitioned_db(Duration::ZERO, 1).await;
    let inbox = partitioned("points");
    let last: time::OffsetDateTime =
        sqlx::query_scalar("SELECT max(r_to) FROM pgbox.inbox_partitions()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    // The last partition ends within a few seconds; bounded at 10.
    for tick in 0.. {
        let now: time::OffsetDateTime = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if now > last + time::Duration::milliseconds(50) {
            break;
        }
        assert!(tick < 100, "the last partition ({last}) never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let err = process_noop(&inbox, &db.pool, "k").await.unwrap_err();
    assert!(
        matches!(err, Error::InboxLayout(ref m) if m.contains("no partition")),
        "{err}"
    );
    let created = InboxPartitions::new(db.pool.clone())
        .create_ahead()
        .await
        .unwrap();
    assert!(!created.is_empty());
    let mut tx = db.pool.begin().await.unwrap();
    assert!(
        inbox
            .process(&mut tx, "k", async |_c| Ok::<_, Error>(()))
            .await
            .unwrap()
            .is_processed()
    );
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn an_interrupted_detach_is_finished_by_the_next_expiry() {
    let db = partitioned_db(Duration::ZERO, 3).await;
    let partitions = InboxPartitions::new(db.pool.clone());
    let list = partitions.list().await.unwrap();
    let (first, second) = (list[0].name.clone(), list[1].name.clone());

    // A detach whose second phase was cancelled: the partition stays "detach pending".
    let mut reader = db.connect().await;
    let mut snapshot = reader.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM pgbox.partitioned_inbox")
        .execute(&mut *snapshot)
        .await
        .unwrap();
    let mut detacher = db.connect().await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut detacher)
        .await
        .unwrap();
    let sql =
        format!("ALTER TABLE pgbox.partitioned_inbox DETACH PARTITION pgbox.{first} CONCURRENTLY");
    let detach = tokio::spawn(async move {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&mut detacher)
            .await
    });
    wait_for_lock_waiter(&db.pool).await;
    sqlx::query("SELECT pg_cancel_backend($1)")
        .bind(pid)
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(detach.await.unwrap().is_err());
    snapshot.commit().await.unwrap();
    let pending: bool = sqlx::query_scalar(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass('pgbox.' || $1)",
    )
    .bind(&first)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(pending, "the test did not leave a pending detach");

    // A detached partition that was never dropped.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE pgbox.partitioned_inbox DETACH PARTITION pgbox.{second}"
    )))
    .execute(&db.pool)
    .await
    .unwrap();

    // Any expiry call finishes both, even with nothing old enough to drop.
    partitions
        .drop_expired(Duration::from_secs(3600))
        .await
        .unwrap();
    for name in [first, second] {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('pgbox.' || $1) IS NOT NULL")
            .bind(&name)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert!(!exists, "{name} was left behind");
    }
}

#[tokio::test]
async fn the_janitor_creates_partitions_ahead_and_drops_expired_ones() {
    use pgbox::janitor::{Janitor, Retention};
    let db = partitioned_db(Duration::from_secs(2), 2).await;
    let inbox = partitioned("points");
    assert!(
        process_noop(&inbox, &db.pool, "old")
            .await
            .unwrap()
            .is_processed()
    );
    let (old_partition, _) = where_is(&db.pool, "points", "old").await;
    // The record's partition ends at most 1 s after the claim; the longest retention below
    // is 3 s: 4 s from the claim, with a margin, the partition is old enough to drop.
    tokio::time::sleep(Duration::from_millis(4_300)).await;

    // One consumer keeps its keys forever: no partition may be dropped.
    let keeper = Janitor::builder(db.pool.clone())
        .min_retention(Duration::from_secs(2))
        .inbox_retention(Duration::from_secs(2))
        .consumer_retention("audit", Retention::Forever)
        .refresh_gauges(false)
        .build()
        .unwrap();
    let report = keeper.run_once().await.unwrap();
    assert!(report.lock.is_held());
    assert!(!report.partitions_created.is_empty(), "{report:?}");
    assert!(report.partitions_dropped.is_empty(), "{report:?}");
    keeper.release().await.unwrap();

    let janitor = Janitor::builder(db.pool.clone())
        .min_retention(Duration::from_secs(2))
        .inbox_retention(Duration::from_secs(2))
        .consumer_retention("slow", Duration::from_secs(3))
        .refresh_gauges(false)
        .build()
        .unwrap();
    // Partitions ahead are counted from before the pass: on a slow machine the clock can
    // cross a 1 s boundary between the pass and the listing.
    let before_pass: time::OffsetDateTime = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let listed_before = InboxPartitions::new(db.pool.clone()).list().await.unwrap();
    let report = janitor.run_once().await.unwrap();
    let after_pass: time::OffsetDateTime = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        report.partitions_dropped.contains(&old_partition[0]),
        "{report:?}"
    );
    // The longest retention (3 s) bounds what was dropped: nothing dropped ends within 3 s of
    // the pass (with the default 2 s, a partition ending 2-3 s before it would go).
    for name in &report.partitions_dropped {
        let p = listed_before.iter().find(|p| &p.name == name).unwrap();
        assert!(
            p.to <= after_pass - time::Duration::seconds(3),
            "{name} dropped too early: {p:?}, pass ended {after_pass}"
        );
    }
    // Everything kept ends after the pass's own cutoff, which is no earlier than this one.
    let cutoff = before_pass - time::Duration::seconds(3);
    let kept = InboxPartitions::new(db.pool.clone()).list().await.unwrap();
    assert!(kept.iter().all(|p| p.to >= cutoff), "{kept:?}");
    assert!(
        kept.iter().filter(|p| p.from > before_pass).count() >= 2,
        "partitions ahead: {kept:?}"
    );
    janitor.release().await.unwrap();
}

fn pgbox_cli(url: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("RUST_LOG")
        .output()
        .expect("run pgbox")
}

#[tokio::test]
async fn the_cli_switches_a_schema_lists_creates_and_drops_partitions() {
    let db = TestDb::empty().await;
    let url = db.url();
    // Not switched yet: `partitions` says so.
    let out = pgbox_cli(&url, &["migrate"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = pgbox_cli(&url, &["partitions", "list"]);
    assert_eq!(
        out.status.code(),
        Some(6),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = pgbox_cli(
        &url,
        &[
            "migrate",
            "--json",
            "--partitioned-inbox",
            "1s",
            "--partition-min-retention",
            "2s",
            "--partitions-ahead",
            "2",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["partitions_created"].as_array().unwrap().len() >= 3,
        "{report}"
    );

    let out = pgbox_cli(&url, &["partitions", "list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let first = listed["partitions"][0]["name"].as_str().unwrap().to_owned();

    // Below the minimum retention: refused, nothing dropped.
    let out = pgbox_cli(&url, &["partitions", "drop", "--older-than", "1s"]);
    assert_eq!(
        out.status.code(),
        Some(6),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("minimum"));

    tokio::time::sleep(Duration::from_millis(3_200)).await;
    let out = pgbox_cli(&url, &["partitions", "create", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        !created["created"].as_array().unwrap().is_empty(),
        "{created}"
    );
    let out = pgbox_cli(
        &url,
        &["partitions", "drop", "--older-than", "2s", "--json"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dropped: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = dropped["dropped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&first.as_str()), "{dropped}");
}

#[tokio::test]
async fn the_doctor_warns_before_the_partitions_run_out() {
    use pgbox::doctor::{Code, Severity};
    let plain = TestDb::migrated().await;
    let report = pgbox::doctor::check(&plain.pool, "pgbox").await.unwrap();
    assert_eq!(report.with_code(Code::InboxPartitionsOk).count(), 0);
    assert_eq!(report.with_code(Code::InboxPartitionsRunningOut).count(), 0);

    let db = partitioned_db(Duration::ZERO, 3).await;
    let report = pgbox::doctor::check(&db.pool, "pgbox").await.unwrap();
    assert_eq!(
        report.with_code(Code::InboxPartitionsOk).count(),
        1,
        "{report:?}"
    );
    // Past the last partition: critical, with what to do.
    let last: time::OffsetDateTime =
        sqlx::query_scalar("SELECT max(r_to) FROM pgbox.inbox_partitions()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let now: time::OffsetDateTime = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let wait = (last - now).as_seconds_f64().max(0.0) + 0.1;
    tokio::time::sleep(Duration::from_secs_f64(wait)).await;
    let report = pgbox::doctor::check(&db.pool, "pgbox").await.unwrap();
    let finding = report
        .with_code(Code::InboxPartitionsRunningOut)
        .next()
        .unwrap_or_else(|| panic!("{report:?}"));
    assert_eq!(finding.severity, Severity::Critical);
    assert!(finding.advice.contains("pgbox partitions create"));
}

/// Leases taken in the plain inbox before the switch: every claim path agrees on what such a
/// key is. A live one is in progress (single claim) or refuses the batch (as the plain
/// layout's batch does), never "already recorded"; its holder can still complete it; an
/// expired one is taken over by the next claim, and its stale holder is refused.
#[tokio::test]
async fn leases_from_before_the_switch_are_in_progress_completable_and_taken_over() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    sqlx::query("CREATE TABLE effects (key text NOT NULL, worker int NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let plain = Inbox::new("points").unwrap();
    let leased = |attempt: pgbox::LeaseAttempt| match attempt {
        pgbox::LeaseAttempt::Leased(lease) => lease,
        other => panic!("not leased: {other:?}"),
    };
    let ttl = Duration::from_secs(60);
    let _live = leased(plain.lease(&db.pool, "live", ttl).await.unwrap());
    let done = leased(plain.lease(&db.pool, "done", ttl).await.unwrap());
    let stale = leased(
        plain
            .lease(&db.pool, "expired", Duration::from_millis(300))
            .await
            .unwrap(),
    );
    Migrator::new()
        .partitioned_inbox(
            InboxPartitioning::every(SECOND)
                .minimum_retention(Duration::ZERO)
                .ahead(5),
        )
        .run(&db.pool)
        .await
        .unwrap();
    let inbox = partitioned("points");
    let deliver = async |key: &str| {
        inbox
            .process_and_commit(&db.pool, key, async |conn| {
                record_effect(conn, key, 1).await
            })
            .await
            .unwrap()
    };

    // A live lease: the batch is refused for it, the single claim says in progress.
    let mut tx = db.pool.begin().await.unwrap();
    let err = inbox
        .claim_batch(&mut tx, ["fresh", "live"])
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::KeyInProgress { ref key, .. } if key == "live"),
        "{err}"
    );
    drop(tx);
    let outcome = deliver("live").await;
    assert!(matches!(outcome, Outcome::InProgress), "{outcome:?}");
    assert_eq!(effects(&db.pool, "live").await, 0);

    // Its holder completes it after the switch; from then on it is a duplicate everywhere.
    done.complete(&db.pool, &"receipt").await.unwrap();
    assert!(deliver("done").await.is_duplicate());
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        inbox.claim_batch(&mut tx, ["done", "new"]).await.unwrap(),
        vec![false, true]
    );
    tx.commit().await.unwrap();

    // An expired lease is taken over by the next claim; the stale holder is refused.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let outcome = deliver("expired").await;
    assert!(outcome.is_processed(), "{outcome:?}");
    assert_eq!(effects(&db.pool, "expired").await, 1);
    let err = stale.complete(&db.pool, &()).await.unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");
    assert!(deliver("expired").await.is_duplicate());
    assert_eq!(effects(&db.pool, "expired").await, 1);
    assert_eq!(where_is(&db.pool, "points", "expired").await.1, 1);
}
