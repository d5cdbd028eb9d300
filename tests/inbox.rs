//! The inbox's contract, on a real PostgreSQL.

mod support;

use std::time::{Duration, Instant};

use pgbox::{Claim, DbErrorKind, Error, Inbox, Key, Outcome, Verdict, Wait};
use sqlx::{Executor, PgConnection, PgPool};
use support::{TestDb, wait_for_lock_waiter};

async fn setup() -> TestDb {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (consumer text NOT NULL, key text NOT NULL)")
        .await
        .unwrap();
    db
}

async fn record_effect(conn: &mut PgConnection, consumer: &str, key: &str) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (consumer, key) VALUES ($1, $2)")
        .bind(consumer)
        .bind(key)
        .execute(conn)
        .await?;
    Ok(())
}

async fn effects(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn inbox_rows(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Processes `key` once with a handler that records an effect; returns the outcome.
async fn deliver(inbox: &Inbox, pool: &PgPool, key: &str) -> Outcome<()> {
    let mut tx = pool.begin().await.unwrap();
    let consumer = inbox.consumer().to_owned();
    let outcome = inbox
        .process(&mut tx, key, async |conn| {
            record_effect(conn, &consumer, key).await
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    outcome
}

#[tokio::test]
async fn first_delivery_takes_effect_and_redelivery_is_skipped() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    assert_eq!(
        deliver(&inbox, &db.pool, "order-1").await,
        Outcome::Processed(())
    );
    let second = deliver(&inbox, &db.pool, "order-1").await;
    let Outcome::Duplicate(dup) = second else {
        panic!("expected a duplicate, got {second:?}")
    };
    assert!(!dup.was_rejected());
    assert_eq!(dup.outcome, None, "() is never stored");
    assert_eq!(effects(&db.pool, "order-1").await, 1);
    assert_eq!(inbox_rows(&db.pool, "order-1").await, 1);
}

#[tokio::test]
async fn duplicate_waits_for_first_and_is_skipped_after_commit() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let mut first = db.pool.begin().await.unwrap();
    assert!(matches!(
        inbox.claim(&mut first, "k").await.unwrap(),
        Claim::Claimed(_)
    ));
    record_effect(&mut first, "points", "k").await.unwrap();

    let (pool, inbox2) = (db.pool.clone(), inbox.clone());
    let second = tokio::spawn(async move { deliver(&inbox2, &pool, "k").await });
    wait_for_lock_waiter(&db.pool).await;
    assert!(
        !second.is_finished(),
        "the duplicate must wait for the first transaction"
    );
    first.commit().await.unwrap();

    let outcome = second.await.unwrap();
    assert!(outcome.is_duplicate(), "got {outcome:?}");
    assert_eq!(effects(&db.pool, "k").await, 1);
}

#[tokio::test]
async fn duplicate_waiting_on_a_rolled_back_claim_processes_it() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let mut first = db.pool.begin().await.unwrap();
    assert!(matches!(
        inbox.claim(&mut first, "k").await.unwrap(),
        Claim::Claimed(_)
    ));
    record_effect(&mut first, "points", "k").await.unwrap();

    let (pool, inbox2) = (db.pool.clone(), inbox.clone());
    let second = tokio::spawn(async move { deliver(&inbox2, &pool, "k").await });
    wait_for_lock_waiter(&db.pool).await;
    first.rollback().await.unwrap();

    assert_eq!(second.await.unwrap(), Outcome::Processed(()));
    assert_eq!(effects(&db.pool, "k").await, 1);
    assert_eq!(inbox_rows(&db.pool, "k").await, 1);
}

#[derive(Debug, thiserror::Error)]
enum HandlerError {
    #[error("business failure: {0}")]
    Business(String),
    #[error(transparent)]
    Inbox(#[from] Error),
}

#[tokio::test]
async fn handler_error_is_returned_typed_and_commits_nothing() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let result = inbox
        .process(&mut tx, "k", async |conn| {
            record_effect(conn, "points", "k").await?;
            Err::<(), _>(HandlerError::Business("card declined".into()))
        })
        .await;
    assert!(matches!(result, Err(HandlerError::Business(ref m)) if m == "card declined"));
    // Even a caller that commits anyway cannot record the key without its effect.
    let _ = tx.commit().await;
    assert_eq!(inbox_rows(&db.pool, "k").await, 0);
    assert_eq!(effects(&db.pool, "k").await, 0);

    // The redelivery processes normally.
    assert_eq!(deliver(&inbox, &db.pool, "k").await, Outcome::Processed(()));
    assert_eq!(effects(&db.pool, "k").await, 1);
}

#[tokio::test]
async fn handler_panic_commits_nothing_and_leaves_the_pool_healthy() {
    let db = setup().await;
    // One connection: the pool must hand back the very connection the panic happened on.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let inbox = Inbox::new("points").unwrap();

    let (p, i) = (pool.clone(), inbox.clone());
    let task = tokio::spawn(async move {
        let mut tx = p.begin().await.unwrap();
        let _ = i
            .process(&mut tx, "k", async |conn| {
                record_effect(conn, "points", "k").await?;
                if std::hint::black_box(true) {
                    panic!("handler bug");
                }
                Ok::<(), Error>(())
            })
            .await;
        // Unreachable: the panic resumes through process.
        tx.commit().await.unwrap();
    });
    let err = task.await.unwrap_err();
    assert!(err.is_panic());

    // A caller that catches the panic and commits anyway still records nothing.
    let mut tx = pool.begin().await.unwrap();
    let caught = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
        inbox.process(&mut tx, "k2", async |conn| {
            record_effect(conn, "points", "k2").await?;
            if std::hint::black_box(true) {
                panic!("handler bug");
            }
            Ok::<(), Error>(())
        }),
    ))
    .await;
    assert!(caught.is_err());
    let _ = tx.commit().await;

    assert_eq!(inbox_rows(&pool, "k").await, 0);
    assert_eq!(inbox_rows(&pool, "k2").await, 0);
    assert_eq!(effects(&pool, "k2").await, 0);
    assert_eq!(deliver(&inbox, &pool, "k").await, Outcome::Processed(()));
    assert_eq!(deliver(&inbox, &pool, "k2").await, Outcome::Processed(()));
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    points: i64,
    balance: i64,
}

#[tokio::test]
async fn stored_outcome_is_handed_back_to_every_duplicate() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let key = Key::new("order-9").with_message_id("msg-1");

    let mut tx = db.pool.begin().await.unwrap();
    let first = inbox
        .process(&mut tx, key.clone(), async |_conn| {
            Ok::<_, Error>(Receipt {
                points: 30,
                balance: 130,
            })
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        first,
        Outcome::Processed(Receipt {
            points: 30,
            balance: 130
        })
    );

    for attempt in 0..3 {
        let mut tx = db.pool.begin().await.unwrap();
        let again = inbox
            .process(
                &mut tx,
                Key::new("order-9").with_message_id(format!("msg-retry-{attempt}")),
                async |_conn| -> Result<Receipt, Error> { panic!("must not run for a duplicate") },
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let Outcome::Duplicate(dup) = again else {
            panic!("expected duplicate, got {again:?}")
        };
        assert_eq!(
            dup.outcome::<Receipt>().unwrap(),
            Some(Receipt {
                points: 30,
                balance: 130
            })
        );
        assert_eq!(
            dup.message_id.as_deref(),
            Some("msg-1"),
            "the first id is kept"
        );
        assert!(matches!(
            dup.outcome::<Vec<String>>(),
            Err(Error::DeserializeOutcome(_))
        ));
    }
}

#[tokio::test]
async fn rejected_message_commits_its_reason_and_redeliveries_skip() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process_or_reject(&mut tx, "order-unknown", async |_conn| {
            Ok::<Verdict<()>, Error>(Verdict::Reject("no such order".into()))
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(outcome, Outcome::Rejected("no such order".into()));

    let mut ran = false;
    let mut tx = db.pool.begin().await.unwrap();
    let again = inbox
        .process(&mut tx, "order-unknown", async |_conn| {
            ran = true;
            Ok::<(), Error>(())
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(!ran);
    let Outcome::Duplicate(dup) = again else {
        panic!("expected duplicate, got {again:?}")
    };
    assert_eq!(dup.rejection.as_deref(), Some("no such order"));
    assert!(dup.was_rejected());
}

#[tokio::test]
async fn low_level_claim_records_outcome_and_rejection() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Claimed(claimed) = inbox.claim(&mut tx, "a").await.unwrap() else {
        panic!("first claim must succeed")
    };
    assert_eq!(claimed.key(), "a");
    claimed
        .store_outcome(&mut tx, &serde_json::json!({"ok": true}))
        .await
        .unwrap();
    let Claim::Claimed(claimed_b) = inbox.claim(&mut tx, "b").await.unwrap() else {
        panic!("first claim must succeed")
    };
    claimed_b.reject(&mut tx, "bad\0reason").await.unwrap();
    // The same transaction sees its own claim as a duplicate.
    assert!(matches!(
        inbox.claim(&mut tx, "a").await.unwrap(),
        Claim::Duplicate(_)
    ));
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Duplicate(a) = inbox.claim(&mut tx, "a").await.unwrap() else {
        panic!()
    };
    assert_eq!(a.outcome, Some(serde_json::json!({"ok": true})));
    let Claim::Duplicate(b) = inbox.claim(&mut tx, "b").await.unwrap() else {
        panic!()
    };
    assert_eq!(b.rejection.as_deref(), Some("bad\\0reason"));
}

#[tokio::test]
async fn in_progress_is_returned_within_the_timeout_and_the_transaction_stays_usable() {
    let db = setup().await;
    let blocking = Inbox::new("points").unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    assert!(matches!(
        blocking.claim(&mut holder, "k").await.unwrap(),
        Claim::Claimed(_)
    ));

    for (wait, bound) in [
        (
            Wait::Timeout(Duration::from_millis(200)),
            Duration::from_millis(200),
        ),
        (Wait::NoWait, Duration::ZERO),
    ] {
        let inbox = Inbox::builder("points").wait(wait).build().unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '7s'")
            .execute(&mut *tx)
            .await
            .unwrap();
        let started = Instant::now();
        let mut ran = false;
        let outcome = inbox
            .process(&mut tx, "k", async |_conn| {
                ran = true;
                Ok::<(), Error>(())
            })
            .await
            .unwrap();
        let elapsed = started.elapsed();
        assert_eq!(outcome, Outcome::InProgress);
        assert!(!ran);
        assert!(!outcome.should_ack());
        // It did wait (no early give-up), and did not wait on forever.
        assert!(elapsed >= bound, "{wait:?} returned after {elapsed:?}");
        assert!(
            elapsed < Duration::from_secs(5),
            "{wait:?} took {elapsed:?}"
        );
        // Not poisoned, and the caller's own lock_timeout is back.
        let timeout: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(timeout, "7s");
        tx.commit().await.unwrap();
    }

    holder.rollback().await.unwrap();
    let inbox = Inbox::builder("points").wait(Wait::NoWait).build().unwrap();
    assert_eq!(deliver(&inbox, &db.pool, "k").await, Outcome::Processed(()));
    assert!(deliver(&inbox, &db.pool, "k").await.is_duplicate());
}

#[tokio::test]
async fn bounded_wait_sees_a_duplicate_committed_while_waiting() {
    let db = setup().await;
    let inbox = Inbox::builder("points")
        .wait(Wait::Timeout(Duration::from_secs(20)))
        .build()
        .unwrap();
    let mut first = db.pool.begin().await.unwrap();
    let Claim::Claimed(claimed) = inbox.claim(&mut first, "k").await.unwrap() else {
        panic!()
    };
    claimed.store_outcome(&mut first, &42).await.unwrap();
    let (pool, i) = (db.pool.clone(), inbox.clone());
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let o = i
            .process(&mut tx, "k", async |_c| Ok::<i32, Error>(7))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        o
    });
    wait_for_lock_waiter(&db.pool).await;
    first.commit().await.unwrap();
    let Outcome::Duplicate(dup) = second.await.unwrap() else {
        panic!("expected duplicate")
    };
    assert_eq!(dup.outcome::<i32>().unwrap(), Some(42));
}

#[tokio::test]
async fn same_key_under_two_consumers_is_two_independent_records() {
    let db = setup().await;
    let points = Inbox::new("points").unwrap();
    let email = Inbox::new("email").unwrap();
    assert!(deliver(&points, &db.pool, "order-1").await.is_processed());
    assert!(deliver(&email, &db.pool, "order-1").await.is_processed());
    assert!(deliver(&points, &db.pool, "order-1").await.is_duplicate());
    assert!(deliver(&email, &db.pool, "order-1").await.is_duplicate());
    assert_eq!(inbox_rows(&db.pool, "order-1").await, 2);
}

#[tokio::test]
async fn repeatable_read_claim_of_a_key_committed_after_the_snapshot_is_retryable() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let key = format!("k-{level}");
        let mut late = db.pool.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET TRANSACTION ISOLATION LEVEL {level}"
        )))
        .execute(&mut *late)
        .await
        .unwrap();
        // Take the snapshot now.
        sqlx::query("SELECT count(*) FROM effects")
            .execute(&mut *late)
            .await
            .unwrap();
        assert!(deliver(&inbox, &db.pool, &key).await.is_processed());

        let result = inbox
            .process(&mut late, key.as_str(), async |conn| {
                record_effect(conn, "points", "late").await
            })
            .await;
        let err = result.expect_err("must not process a key committed by another transaction");
        assert!(err.is_retryable(), "{level}: {err}");
        drop(late);
        assert_eq!(effects(&db.pool, &key).await, 1);
        assert_eq!(effects(&db.pool, "late").await, 0);
    }
}

#[tokio::test]
async fn serializable_duplicate_race_yields_a_retryable_error_never_a_double_effect() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();

    async fn serializable_attempt(pool: &PgPool, inbox: &Inbox) -> Result<Outcome<()>, Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
            .execute(&mut *tx)
            .await?;
        let outcome = inbox
            .process(&mut tx, "k", async |conn| {
                record_effect(conn, "points", "k").await
            })
            .await?;
        tx.commit().await?;
        Ok(outcome)
    }

    let mut first = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        .execute(&mut *first)
        .await
        .unwrap();
    let outcome = inbox
        .process(&mut first, "k", async |conn| {
            record_effect(conn, "points", "k").await
        })
        .await
        .unwrap();
    assert!(outcome.is_processed());

    let (pool, i) = (db.pool.clone(), inbox.clone());
    let second = tokio::spawn(async move { serializable_attempt(&pool, &i).await });
    wait_for_lock_waiter(&db.pool).await;
    first.commit().await.unwrap();
    let err = second
        .await
        .unwrap()
        .expect_err("the racing duplicate must fail");
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.db_kind(), Some(DbErrorKind::SerializationFailure));

    // The retry sees the committed record.
    assert!(
        serializable_attempt(&db.pool, &inbox)
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(effects(&db.pool, "k").await, 1);
}

#[tokio::test]
async fn duplicates_are_pure_reads_with_no_transaction_id_and_no_dead_tuples() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    for i in 0..50 {
        let key = format!("k{i}");
        assert!(deliver(&inbox, &db.pool, &key).await.is_processed());
    }
    let mut conn = db.pool.acquire().await.unwrap();
    for round in 0..3 {
        for i in 0..50 {
            let key = format!("k{i}");
            let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
            let outcome = inbox
                .process(&mut tx, key.as_str(), async |_c| Ok::<(), Error>(()))
                .await
                .unwrap();
            assert!(outcome.is_duplicate());
            // No write happened: the transaction never needed an id.
            let xid: Option<i64> =
                sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text::bigint")
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
            assert_eq!(xid, None, "round {round}, key {key}: the duplicate wrote");
            tx.commit().await.unwrap();
        }
    }

    // Control: the measurement does see dead tuples when there are some.
    sqlx::query("CREATE TABLE control (k text PRIMARY KEY, v int)")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO control VALUES ('a', 1)")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO control VALUES ('a', 1) ON CONFLICT (k) DO UPDATE SET v = 2")
        .execute(&mut *conn)
        .await
        .unwrap();

    let dead = |table: &'static str| {
        let pool = db.pool.clone();
        async move {
            let mut c = pool.acquire().await.unwrap();
            sqlx::query("SELECT pg_stat_clear_snapshot()")
                .execute(&mut *c)
                .await
                .unwrap();
            sqlx::query_scalar::<_, i64>(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = $1",
            )
            .bind(table)
            .fetch_one(&mut *c)
            .await
            .unwrap()
        }
    };
    // Statistics are flushed by each backend when it goes idle; make ours flush now.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    let mut control_dead = 0;
    for _ in 0..100 {
        control_dead = dead("control").await;
        if control_dead > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        control_dead, 1,
        "statistics never arrived; the check is blind"
    );
    assert_eq!(dead("inbox").await, 0);
}

#[tokio::test]
async fn terminated_connection_mid_handler_is_a_retryable_error_and_commits_nothing() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let pool = db.pool.clone();
    let result = inbox
        .process(&mut tx, "k", async |conn| {
            record_effect(conn, "points", "k").await?;
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(&pool)
                .await?;
            record_effect(conn, "points", "k").await
        })
        .await;
    let err = result.expect_err("the connection is gone");
    assert_eq!(err.db_kind(), Some(DbErrorKind::ConnectionLost), "{err}");
    assert!(err.is_retryable());
    drop(tx);
    assert_eq!(inbox_rows(&db.pool, "k").await, 0);
    assert_eq!(deliver(&inbox, &db.pool, "k").await, Outcome::Processed(()));
}

#[tokio::test]
async fn custom_schema_keeps_everything_inside_it() {
    let db = TestDb::empty().await;
    pgbox::Migrator::new()
        .schema("messaging")
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let inbox = Inbox::builder("points")
        .schema("messaging")
        .build()
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let o = inbox
        .process(&mut tx, "k", async |_c| Ok::<_, Error>(1))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(o, Outcome::Processed(1));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM messaging.inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);

    // An inbox pointed at a schema that was never migrated fails with a clear kind.
    let wrong = Inbox::builder("points").schema("nowhere").build().unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let err = wrong.claim(&mut tx, "k").await.unwrap_err();
    assert_eq!(err.db_kind(), Some(DbErrorKind::MissingSchema), "{err}");
}

#[tokio::test]
async fn purge_deletes_only_old_rows_of_its_own_consumer() {
    let db = setup().await;
    let points = Inbox::new("points").unwrap();
    let email = Inbox::new("email").unwrap();
    // 12,000 old rows (more than two purge batches), 5 recent ones, and another consumer's.
    sqlx::query(
        "INSERT INTO pgbox.inbox (consumer, key, processed_at) \
         SELECT 'points', 'old-' || g, now() - interval '8 days' FROM generate_series(1, 12000) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO pgbox.inbox (consumer, key, processed_at) \
         SELECT 'email', 'old-' || g, now() - interval '8 days' FROM generate_series(1, 10) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for i in 0..5 {
        assert!(
            deliver(&points, &db.pool, &format!("new-{i}"))
                .await
                .is_processed()
        );
    }
    let week = Duration::from_secs(7 * 24 * 3600);
    assert_eq!(
        points.purge_older_than(&db.pool, week).await.unwrap(),
        12_000
    );
    assert_eq!(points.purge_older_than(&db.pool, week).await.unwrap(), 0);
    let left: Vec<(String, i64)> = sqlx::query_as(
        "SELECT consumer, count(*) FROM pgbox.inbox GROUP BY consumer ORDER BY consumer",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(left, vec![("email".into(), 10), ("points".into(), 5)]);
    // A purged key is processed again: retention must outlast redelivery.
    assert!(deliver(&points, &db.pool, "old-1").await.is_processed());
    assert!(matches!(
        email.purge_older_than(&db.pool, Duration::ZERO).await,
        Err(Error::InvalidConfig(_))
    ));
}

#[tokio::test]
async fn a_handler_that_swallows_a_failed_statement_is_reported_not_processed() {
    let db = setup().await;
    db.pool
        .execute("CREATE TABLE uniq (k text PRIMARY KEY); INSERT INTO uniq VALUES ('taken')")
        .await
        .unwrap();
    for store in [false, true] {
        let inbox = Inbox::new("points").unwrap();
        let key = format!("k-{store}");
        let mut tx = db.pool.begin().await.unwrap();
        let result = inbox
            .process(&mut tx, key.as_str(), async |conn| {
                record_effect(conn, "points", "swallowed").await?;
                // A failing statement whose error the handler ignores.
                let _ = sqlx::query("INSERT INTO uniq VALUES ('taken')")
                    .execute(&mut *conn)
                    .await;
                Ok::<_, Error>(if store { Some(42) } else { None })
            })
            .await;
        assert!(
            matches!(result, Err(Error::TransactionAbortedInHandler)),
            "store={store}: {result:?}"
        );
        drop(tx);
        assert_eq!(inbox_rows(&db.pool, &key).await, 0);
    }
    // Without the check the outcome says Processed, yet nothing is recorded: the reason the
    // check is on by default.
    let unchecked = Inbox::builder("points")
        .verify_transaction(false)
        .build()
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = unchecked
        .process(&mut tx, "k-unchecked", async |conn| {
            let _ = sqlx::query("INSERT INTO uniq VALUES ('taken')")
                .execute(&mut *conn)
                .await;
            Ok::<(), Error>(())
        })
        .await
        .unwrap();
    assert!(outcome.is_processed());
    let _ = tx.commit().await;
    assert_eq!(inbox_rows(&db.pool, "k-unchecked").await, 0);
}

#[tokio::test]
async fn an_outcome_with_a_nul_character_is_a_typed_error_before_any_sql() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let result = inbox
        .process(&mut tx, "k", async |conn| {
            record_effect(conn, "points", "k").await?;
            Ok::<_, Error>(serde_json::json!({"note": "a\u{0}b"}))
        })
        .await;
    assert!(
        matches!(
            result,
            Err(Error::InvalidField {
                field: "outcome",
                ..
            })
        ),
        "{result:?}"
    );
    let _ = tx.commit().await;
    assert_eq!(inbox_rows(&db.pool, "k").await, 0);
    assert_eq!(effects(&db.pool, "k").await, 0);
}

#[tokio::test]
async fn a_session_temp_table_cannot_shadow_the_inbox_in_bounded_claims() {
    let db = setup().await;
    let inbox = Inbox::builder("points").wait(Wait::NoWait).build().unwrap();
    assert!(deliver(&inbox, &db.pool, "k").await.is_processed());
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("CREATE TEMP TABLE inbox (LIKE pgbox.inbox INCLUDING ALL) ON COMMIT DROP")
        .execute(&mut *tx)
        .await
        .unwrap();
    let claim = inbox.claim(&mut tx, "k").await.unwrap();
    assert!(matches!(claim, Claim::Duplicate(_)), "{claim:?}");
}

#[tokio::test]
async fn a_claim_token_cannot_write_through_another_transaction() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    // Claimed, then rolled back: the token is worthless.
    let mut first = db.pool.begin().await.unwrap();
    let Claim::Claimed(token) = inbox.claim(&mut first, "a").await.unwrap() else {
        panic!()
    };
    first.rollback().await.unwrap();
    let mut other = db.pool.begin().await.unwrap();
    let err = token.store_outcome(&mut other, &1).await.unwrap_err();
    assert!(matches!(err, Error::NotClaimed { .. }), "{err}");
    drop(other);

    // A stale token cannot overwrite a record another transaction committed.
    let mut stale = db.pool.begin().await.unwrap();
    let Claim::Claimed(token) = inbox.claim(&mut stale, "b").await.unwrap() else {
        panic!()
    };
    stale.rollback().await.unwrap();
    assert!(deliver(&inbox, &db.pool, "b").await.is_processed());
    let mut other = db.pool.begin().await.unwrap();
    let err = token.reject(&mut other, "late").await.unwrap_err();
    assert!(matches!(err, Error::NotClaimed { .. }), "{err}");
    other.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Duplicate(d) = inbox.claim(&mut tx, "b").await.unwrap() else {
        panic!()
    };
    assert!(!d.was_rejected());
}

#[tokio::test]
async fn batch_claim_dedups_many_keys_in_one_statement() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    assert!(deliver(&inbox, &db.pool, "old").await.is_processed());
    let mut tx = db.pool.begin().await.unwrap();
    let claimed = inbox
        .claim_batch(&mut tx, ["a", "old", "b", "a", "c"])
        .await
        .unwrap();
    assert_eq!(claimed, [true, false, true, false, true]);
    // A bad key anywhere refuses the whole batch before any SQL; the transaction stays usable.
    let err = inbox.claim_batch(&mut tx, ["d", ""]).await.unwrap_err();
    assert!(matches!(err, Error::EmptyKey));
    tx.commit().await.unwrap();
    for k in ["a", "b", "c", "old"] {
        assert_eq!(inbox_rows(&db.pool, k).await, 1, "{k}");
    }
    assert_eq!(inbox_rows(&db.pool, "d").await, 0);
    let mut tx = db.pool.begin().await.unwrap();
    let again = inbox.claim_batch(&mut tx, ["a", "b", "e"]).await.unwrap();
    assert_eq!(again, [false, false, true]);
    let none: Vec<bool> = inbox
        .claim_batch(&mut tx, Vec::<&str>::new())
        .await
        .unwrap();
    assert!(none.is_empty());
}
