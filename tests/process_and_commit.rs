//! `Inbox::process_and_commit`: pgbox opens the transaction and commits it. The same contract
//! as `process`, plus connection hygiene: nothing may go back to the pool mid-transaction.

mod support;

use std::sync::Arc;
use std::time::Duration;

use pgbox::{Error, Inbox, Key, Outcome, Verdict, Wait};
use sqlx::postgres::PgPoolOptions;
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

/// A pool of one connection: whatever a call leaves on its connection, the next call meets.
async fn single_connection_pool(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone())
        .await
        .unwrap()
}

async fn record_effect(conn: &mut PgConnection, key: &str) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (consumer, key) VALUES ('points', $1)")
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

async fn deliver(inbox: &Inbox, pool: &PgPool, key: &str) -> Outcome<()> {
    inbox
        .process_and_commit(pool, key, async |conn| record_effect(conn, key).await)
        .await
        .unwrap()
}

/// The connection a single-connection pool hands out next is outside any transaction.
async fn assert_idle_connection(pool: &PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    // SAVEPOINT succeeds only inside a transaction block.
    let probe = sqlx::raw_sql("SAVEPOINT pgbox_probe")
        .execute(&mut *conn)
        .await;
    match probe {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P01") => {}
        other => panic!("the pool handed out a connection inside a transaction: {other:?}"),
    }
}

#[tokio::test]
async fn first_delivery_commits_and_redeliveries_are_duplicates_with_the_stored_outcome() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let outcome = inbox
        .process_and_commit(
            &db.pool,
            Key::new("order-1").with_message_id("m-1"),
            async |conn| {
                record_effect(conn, "order-1").await?;
                Ok::<_, Error>(serde_json::json!({ "points": 10 }))
            },
        )
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Processed(serde_json::json!({ "points": 10 }))
    );
    // Committed: visible from another connection right away.
    assert_eq!(effects(&db.pool, "order-1").await, 1);
    assert_eq!(inbox_rows(&db.pool, "order-1").await, 1);

    for _ in 0..3 {
        let outcome = inbox
            .process_and_commit(&db.pool, "order-1", async |conn| {
                record_effect(conn, "order-1").await?;
                Ok::<_, Error>(serde_json::json!({ "points": 99 }))
            })
            .await
            .unwrap();
        let Outcome::Duplicate(duplicate) = outcome else {
            panic!("expected a duplicate, got {outcome:?}");
        };
        assert_eq!(duplicate.message_id.as_deref(), Some("m-1"));
        assert_eq!(
            duplicate.outcome::<serde_json::Value>().unwrap(),
            Some(serde_json::json!({ "points": 10 }))
        );
    }
    assert_eq!(effects(&db.pool, "order-1").await, 1);
}

#[tokio::test]
async fn keys_with_quotes_backslashes_and_unicode_are_stored_exactly() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let keys = [
        "it's",
        r"back\slash",
        r"\'",
        "''",
        "$$",
        "$q$ x $q$",
        "'); DROP TABLE effects; --",
        r"E'\x41'",
        "ключ-日本-🎉",
        "tab\tnewline\n",
    ];
    for key in keys {
        let message_id = format!("id {key}");
        let outcome = inbox
            .process_and_commit(
                &db.pool,
                Key::new(key).with_message_id(message_id.as_str()),
                async |conn| record_effect(conn, key).await,
            )
            .await
            .unwrap();
        assert!(outcome.is_processed(), "{key:?}: {outcome:?}");
        let stored: (String, Option<String>) = sqlx::query_as(
            "SELECT key, message_id FROM pgbox.inbox WHERE consumer = 'points' AND key = $1",
        )
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(stored, (key.to_owned(), Some(message_id.clone())));
        // The same key through the parameterised path is the same record.
        let mut tx = db.pool.begin().await.unwrap();
        let again = inbox
            .process(&mut tx, key, async |_conn| Ok::<(), Error>(()))
            .await
            .unwrap();
        assert!(again.is_duplicate(), "{key:?}: {again:?}");
        tx.commit().await.unwrap();
    }
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total, keys.len() as i64);
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects")
            .fetch_one(&db.pool)
            .await
            .unwrap(),
        keys.len() as i64
    );
}

#[tokio::test]
async fn invalid_keys_are_refused_before_any_sql() {
    let db = setup().await;
    let pool = single_connection_pool(&db).await;
    let inbox = Inbox::new("points").unwrap();
    for (key, check) in [
        (
            "",
            (|e: &Error| matches!(e, Error::EmptyKey)) as fn(&Error) -> bool,
        ),
        ("a\0b", |e| matches!(e, Error::KeyContainsNul { .. })),
    ] {
        let result = inbox
            .process_and_commit(&pool, key, async |_conn| Ok::<(), Error>(()))
            .await;
        assert!(matches!(&result, Err(e) if check(e)), "{key:?}: {result:?}");
    }
    let long = "x".repeat(pgbox::MAX_KEY_BYTES + 1);
    let result = inbox
        .process_and_commit(&pool, long.as_str(), async |_conn| Ok::<(), Error>(()))
        .await;
    assert!(
        matches!(result, Err(Error::KeyTooLong { .. })),
        "{result:?}"
    );
    let result = inbox
        .process_and_commit(&pool, Key::new("k").with_message_id("m\0"), async |_conn| {
            Ok::<(), Error>(())
        })
        .await;
    assert!(
        matches!(result, Err(Error::InvalidField { .. })),
        "{result:?}"
    );
    assert_idle_connection(&pool).await;
}

#[tokio::test]
async fn handler_errors_and_panics_roll_back_and_leave_the_connection_clean() {
    let db = setup().await;
    let pool = single_connection_pool(&db).await;
    let inbox = Inbox::new("points").unwrap();

    let result = inbox
        .process_and_commit(&pool, "k-error", async |conn| {
            record_effect(conn, "k-error").await?;
            Err::<(), Error>(Error::InvalidConfig("the handler said no".into()))
        })
        .await;
    assert!(matches!(result, Err(Error::InvalidConfig(_))), "{result:?}");
    assert_idle_connection(&pool).await;

    let panicking = tokio::spawn({
        let (inbox, pool) = (inbox.clone(), pool.clone());
        async move {
            inbox
                .process_and_commit(&pool, "k-panic", async |conn| {
                    record_effect(conn, "k-panic").await?;
                    panic!("handler bug");
                    #[allow(unreachable_code)]
                    Ok::<(), Error>(())
                })
                .await
        }
    })
    .await;
    assert!(panicking.unwrap_err().is_panic());
    assert_idle_connection(&pool).await;

    for key in ["k-error", "k-panic"] {
        assert_eq!(inbox_rows(&db.pool, key).await, 0, "{key}");
        assert_eq!(effects(&db.pool, key).await, 0, "{key}");
    }
    // Both keys are still processable.
    for key in ["k-error", "k-panic"] {
        assert!(deliver(&inbox, &pool, key).await.is_processed());
        assert_eq!(effects(&db.pool, key).await, 1, "{key}");
    }
}

#[tokio::test]
async fn a_dropped_call_never_lets_its_transaction_commit_with_someone_else() {
    let db = setup().await;
    let pool = single_connection_pool(&db).await;
    let inbox = Inbox::new("points").unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let call = tokio::spawn({
        let (inbox, pool, started) = (inbox.clone(), pool.clone(), started.clone());
        async move {
            inbox
                .process_and_commit(&pool, "k-dropped", async |conn| {
                    record_effect(conn, "k-dropped").await?;
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Ok::<(), Error>(())
                })
                .await
        }
    });
    started.notified().await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());

    // The next call on the single connection commits its own transaction: had the dropped
    // one's transaction stayed open on that connection, this COMMIT would commit it too.
    assert!(deliver(&inbox, &pool, "k-next").await.is_processed());
    assert_idle_connection(&pool).await;
    assert_eq!(inbox_rows(&db.pool, "k-dropped").await, 0);
    assert_eq!(effects(&db.pool, "k-dropped").await, 0);
    assert_eq!(effects(&db.pool, "k-next").await, 1);
}

#[tokio::test]
async fn a_swallowed_failed_statement_is_reported_with_the_check_riding_on_commit() {
    let db = setup().await;
    let pool = single_connection_pool(&db).await;
    db.pool
        .execute("CREATE TABLE uniq (k text PRIMARY KEY); INSERT INTO uniq VALUES ('taken')")
        .await
        .unwrap();
    for store in [false, true] {
        let inbox = Inbox::new("points").unwrap();
        let key = format!("k-{store}");
        let result = inbox
            .process_and_commit(&pool, key.as_str(), async |conn| {
                record_effect(conn, &key).await?;
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
        assert_eq!(inbox_rows(&db.pool, &key).await, 0);
        assert_eq!(effects(&db.pool, &key).await, 0);
        assert_idle_connection(&pool).await;
    }
    // Without the check, Processed is claimed while nothing committed: the check is what
    // catches it.
    let unchecked = Inbox::builder("points")
        .verify_transaction(false)
        .build()
        .unwrap();
    let outcome = unchecked
        .process_and_commit(&pool, "k-unchecked", async |conn| {
            let _ = sqlx::query("INSERT INTO uniq VALUES ('taken')")
                .execute(&mut *conn)
                .await;
            Ok::<(), Error>(())
        })
        .await
        .unwrap();
    assert!(outcome.is_processed());
    assert_eq!(inbox_rows(&db.pool, "k-unchecked").await, 0);
    assert_idle_connection(&pool).await;
}

#[tokio::test]
async fn racing_deliveries_of_one_key_take_effect_once() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    for round in 0..20 {
        let key = format!("race-{round}");
        let mut tasks = Vec::new();
        for racer in 0..6 {
            let (inbox, pool, key) = (inbox.clone(), db.pool.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                if racer % 2 == 0 {
                    // Half the racers go through the transactional API.
                    let mut tx = pool.begin().await.unwrap();
                    let outcome = inbox
                        .process(&mut tx, key.as_str(), async |conn| {
                            record_effect(conn, &key).await
                        })
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                    outcome
                } else {
                    deliver(&inbox, &pool, &key).await
                }
            }));
        }
        let mut processed = 0;
        for task in tasks {
            match task.await.unwrap() {
                Outcome::Processed(()) => processed += 1,
                Outcome::Duplicate(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(processed, 1, "{key}");
        assert_eq!(effects(&db.pool, &key).await, 1, "{key}");
    }
}

#[tokio::test]
async fn a_duplicate_waits_for_the_holder_and_sees_its_commit_or_takes_over_its_rollback() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    for holder_commits in [true, false] {
        let key = format!("held-{holder_commits}");
        let mut holder = db.pool.begin().await.unwrap();
        let held = inbox
            .process(&mut holder, key.as_str(), async |conn| {
                record_effect(conn, &key).await?;
                Ok::<_, Error>(7)
            })
            .await
            .unwrap();
        assert!(held.is_processed());
        let waiter = tokio::spawn({
            let (inbox, pool, key) = (inbox.clone(), db.pool.clone(), key.clone());
            async move {
                inbox
                    .process_and_commit(&pool, key.as_str(), async |conn| {
                        record_effect(conn, &key).await?;
                        Ok::<_, Error>(8)
                    })
                    .await
                    .unwrap()
            }
        });
        wait_for_lock_waiter(&db.pool).await;
        if holder_commits {
            holder.commit().await.unwrap();
            let Outcome::Duplicate(duplicate) = waiter.await.unwrap() else {
                panic!("expected a duplicate");
            };
            assert_eq!(duplicate.outcome::<i32>().unwrap(), Some(7));
        } else {
            holder.rollback().await.unwrap();
            assert_eq!(waiter.await.unwrap(), Outcome::Processed(8));
        }
        assert_eq!(effects(&db.pool, &key).await, 1, "{key}");
    }
}

#[tokio::test]
async fn bounded_waits_report_in_progress_and_release_the_connection() {
    let db = setup().await;
    let pool = single_connection_pool(&db).await;
    let holder_inbox = Inbox::new("points").unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    let _claimed = holder_inbox.claim(&mut holder, "busy").await.unwrap();
    for wait in [Wait::NoWait, Wait::Timeout(Duration::from_millis(50))] {
        let inbox = Inbox::builder("points").wait(wait).build().unwrap();
        let outcome = inbox
            .process_and_commit(&pool, "busy", async |conn| {
                record_effect(conn, "busy").await
            })
            .await
            .unwrap();
        assert_eq!(outcome, Outcome::InProgress, "{wait:?}");
        assert_idle_connection(&pool).await;
        // A free key goes through the bounded claim too.
        let free = format!("free-{wait:?}");
        let outcome = inbox
            .process_and_commit(&pool, free.as_str(), async |conn| {
                record_effect(conn, &free).await
            })
            .await
            .unwrap();
        assert!(outcome.is_processed(), "{wait:?}");
    }
    holder.rollback().await.unwrap();
    assert_eq!(effects(&db.pool, "busy").await, 0);
}

#[tokio::test]
async fn rejections_commit_their_reason() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let outcome: Outcome<()> = inbox
        .process_or_reject_and_commit(&db.pool, "bad-order", async |_conn| {
            Ok::<_, Error>(Verdict::Reject("unknown account".into()))
        })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Rejected("unknown account".into()));
    let again: Outcome<()> = inbox
        .process_or_reject_and_commit(&db.pool, "bad-order", async |_conn| {
            Ok::<_, Error>(Verdict::Accept(()))
        })
        .await
        .unwrap();
    let Outcome::Duplicate(duplicate) = again else {
        panic!("expected a duplicate, got {again:?}");
    };
    assert!(duplicate.was_rejected());
}

#[tokio::test]
async fn duplicates_write_nothing() {
    let db = setup().await;
    // One connection: its statistics reach the collector in the order it wrote them.
    let pool = single_connection_pool(&db).await;
    let inbox = Inbox::new("points").unwrap();
    assert!(deliver(&inbox, &pool, "once").await.is_processed());
    for _ in 0..20 {
        assert!(deliver(&inbox, &pool, "once").await.is_duplicate());
    }
    // A control write after the duplicates: once it shows, everything before it has too.
    assert!(deliver(&inbox, &pool, "control").await.is_processed());
    let stats = inbox_stats(&db, &pool, |s| s.inserts >= 2).await;
    // Two inserts (the first delivery and the control), no update, no dead tuple: the 20
    // duplicates wrote nothing (an aborted insert would count as an insert and a dead tuple).
    assert_eq!((stats.inserts, stats.updates, stats.dead), (2, 0, 0));
}

#[tokio::test]
async fn the_partitioned_inbox_works_through_it_too() {
    let db = setup().await;
    pgbox::Migrator::new()
        .partitioned_inbox(pgbox::InboxPartitioning::every(Duration::from_secs(3600)))
        .run(&db.pool)
        .await
        .unwrap();
    let inbox = Inbox::builder("points").partitioned(true).build().unwrap();
    assert!(deliver(&inbox, &db.pool, "p-1").await.is_processed());
    assert!(deliver(&inbox, &db.pool, "p-1").await.is_duplicate());
    assert_eq!(effects(&db.pool, "p-1").await, 1);
    // The plain inbox against a switched schema: a typed layout error, connection clean.
    let pool = single_connection_pool(&db).await;
    let plain = Inbox::new("points").unwrap();
    let result = plain
        .process_and_commit(&pool, "p-2", async |conn| record_effect(conn, "p-2").await)
        .await;
    assert!(matches!(result, Err(Error::InboxLayout(_))), "{result:?}");
    assert_idle_connection(&pool).await;
}

/// The inbox table's statistics.
struct InboxStats {
    inserts: i64,
    updates: i64,
    dead: i64,
    /// Rows fetched through the table's indexes.
    fetches: i64,
}

/// The inbox table's statistics once `ready` holds: `writer`'s are flushed, then read fresh
/// until they show (one connection's statistics arrive in the order it wrote them), for up
/// to 10 s.
async fn inbox_stats(
    db: &TestDb,
    writer: &PgPool,
    ready: impl Fn(&InboxStats) -> bool,
) -> InboxStats {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(writer)
        .await
        .unwrap();
    let mut stats = InboxStats {
        inserts: 0,
        updates: 0,
        dead: 0,
        fetches: 0,
    };
    for _ in 0..200 {
        let mut c = db.pool.acquire().await.unwrap();
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *c)
            .await
            .unwrap();
        let (inserts, updates, dead, fetches) = sqlx::query_as::<_, (i64, i64, i64, i64)>(
            "SELECT n_tup_ins, n_tup_upd, n_dead_tup, coalesce(idx_tup_fetch, 0) \
             FROM pg_stat_user_tables WHERE schemaname = 'pgbox' AND relname = 'inbox'",
        )
        .fetch_one(&mut *c)
        .await
        .unwrap();
        stats = InboxStats {
            inserts,
            updates,
            dead,
            fetches,
        };
        if ready(&stats) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stats
}

#[tokio::test]
async fn a_new_message_never_reads_its_record_and_a_duplicate_reads_it_once() {
    let db = setup().await;
    // One connection: every statement of the deliveries runs on it.
    let pool = single_connection_pool(&db).await;
    let inbox = Inbox::new("points").unwrap();
    // Warm up: the first call on a connection prepares sqlx's statements.
    assert!(deliver(&inbox, &pool, "warm").await.is_processed());
    let before = inbox_stats(&db, &pool, |_| true).await.fetches;
    for i in 0..20 {
        assert!(
            deliver(&inbox, &pool, &format!("new-{i}"))
                .await
                .is_processed()
        );
    }
    // A control: one duplicate, two fetches (the claim's conflict check visits the recorded
    // row; the read fetches the record). Once they show, the new messages' fetches have too.
    assert!(deliver(&inbox, &pool, "warm").await.is_duplicate());
    let after_new = inbox_stats(&db, &pool, |s| s.fetches >= before + 2)
        .await
        .fetches;
    // The read goes only with a duplicate's ROLLBACK: no new message fetched its own row.
    assert_eq!(after_new - before, 2, "new messages fetched their own rows");
    for i in 0..20 {
        assert!(
            deliver(&inbox, &pool, &format!("new-{i}"))
                .await
                .is_duplicate()
        );
    }
    let after_duplicates = inbox_stats(&db, &pool, |s| s.fetches >= after_new + 40)
        .await
        .fetches;
    // Two fetches per duplicate; a second read after the first would be a third.
    assert_eq!(after_duplicates - after_new, 40);
}

#[tokio::test]
async fn keys_under_a_lease_are_in_progress_until_it_expires_and_then_taken_over() {
    let db = setup().await;
    let pool = single_connection_pool(&db).await;
    let inbox = Inbox::new("points").unwrap();
    let live = inbox
        .lease(&db.pool, "live", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(matches!(live, pgbox::LeaseAttempt::Leased(_)), "{live:?}");
    let expired = inbox
        .lease(&db.pool, "expired", Duration::from_millis(200))
        .await
        .unwrap();
    assert!(
        matches!(expired, pgbox::LeaseAttempt::Leased(_)),
        "{expired:?}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;

    // The bare claim finds a row; its read says "under a lease": settled the long way.
    let outcome = deliver(&inbox, &pool, "live").await;
    assert!(matches!(outcome, Outcome::InProgress), "{outcome:?}");
    assert_eq!(effects(&db.pool, "live").await, 0);
    assert_idle_connection(&pool).await;

    // An expired lease is taken over by this transaction, like `process` does.
    assert!(deliver(&inbox, &pool, "expired").await.is_processed());
    assert_eq!(effects(&db.pool, "expired").await, 1);
    assert!(deliver(&inbox, &pool, "expired").await.is_duplicate());
    assert_eq!(effects(&db.pool, "expired").await, 1);
    assert_idle_connection(&pool).await;
}
