//! The cheap paths keep the guarantees: the one-statement duplicate lookup, the runner's
//! redelivery shortcut, and the handler connection that only asks the server whether the
//! transaction is alive when it could not watch.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, Envelope, Error, HandlerConnection, Inbox, Message, Outbox,
    Outcome, Relay, Verdict,
};
use sqlx::Executor;
use support::TestDb;

#[tokio::test]
async fn lookup_sees_only_committed_records_and_returns_what_they_stored() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("lookups").unwrap();
    assert!(inbox.lookup(&db.pool, "k").await.unwrap().is_none());

    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "k", async |_conn| Ok::<_, Error>("receipt-1"))
        .await
        .unwrap();
    assert!(outcome.is_processed());
    // Claimed but not committed: a lookup from elsewhere sees nothing.
    assert!(inbox.lookup(&db.pool, "k").await.unwrap().is_none());
    tx.commit().await.unwrap();
    let found = inbox.lookup(&db.pool, "k").await.unwrap().unwrap();
    assert_eq!(
        found.outcome::<String>().unwrap().as_deref(),
        Some("receipt-1")
    );
    assert!(!found.was_rejected());

    let mut tx = db.pool.begin().await.unwrap();
    let _ = inbox
        .process_or_reject(&mut tx, "r", async |_conn| {
            Ok::<Verdict<()>, Error>(Verdict::Reject("unknown account".into()))
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(
        inbox
            .lookup(&db.pool, "r")
            .await
            .unwrap()
            .unwrap()
            .was_rejected()
    );

    // Another consumer's key space is separate; bad keys are typed errors.
    let other = Inbox::new("others").unwrap();
    assert!(other.lookup(&db.pool, "k").await.unwrap().is_none());
    assert!(matches!(
        inbox.lookup(&db.pool, "").await,
        Err(Error::EmptyKey)
    ));
}

#[tokio::test]
async fn a_swallowed_error_is_caught_whether_the_handler_used_the_wrapper_or_the_raw_connection() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("swallow").unwrap();
    // Through the wrapper's Executor.
    let mut tx = db.pool.begin().await.unwrap();
    let err = inbox
        .process(&mut tx, "a", async |conn: &mut HandlerConnection<'_>| {
            let _ = sqlx::query("SELECT 1/0").execute(&mut *conn).await;
            Ok::<(), Error>(())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TransactionAbortedInHandler), "{err:?}");
    drop(tx);
    // Through the raw connection (DerefMut), where the wrapper cannot watch.
    let mut tx = db.pool.begin().await.unwrap();
    let err = inbox
        .process(&mut tx, "b", async |conn: &mut HandlerConnection<'_>| {
            let raw: &mut sqlx::PgConnection = conn;
            let _ = raw.execute("SELECT 1/0").await;
            Ok::<(), Error>(())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TransactionAbortedInHandler), "{err:?}");
    drop(tx);
    // A recovered savepoint is fine: the check passes and the key commits.
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "c", async |conn: &mut HandlerConnection<'_>| {
            let mut sp = sqlx::Connection::begin(&mut **conn).await?;
            let _ = sqlx::query("SELECT 1/0").execute(&mut *sp).await;
            sp.rollback().await?;
            sqlx::query("SELECT 2").execute(&mut *conn).await?;
            Ok::<(), Error>(())
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Processed(())));
    tx.commit().await.unwrap();
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pgbox.inbox WHERE key IN ('a','b','c')")
            .fetch_one(&db.pool)
            .await
            .unwrap(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_of_a_processed_message_is_acked_without_running_the_handler() {
    let db = TestDb::migrated().await;
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("jobs", "once"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let queue = PgQueue::new(db.pool.clone());
    Relay::builder(db.pool.clone(), queue.clone())
        .build()
        .unwrap()
        .relay_once()
        .await
        .unwrap();
    // Publish the same message again, as a relay does after a crash between publish and
    // commit, and make it a redelivery (attempt 2), as after a lost ack.
    sqlx::query(
        "INSERT INTO pgbox.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at, deliveries) \
         SELECT message_id, topic, ordering_key, payload, content_type, headers, created_at, 1 FROM pgbox.queue",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = Consumer::builder(db.pool.clone(), queue, "jobs", Inbox::new("jobs").unwrap())
        .concurrency(1)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let s = shutdown.clone();
        let runs = runs.clone();
        async move {
            consumer
                .run(
                    async |_e: &Envelope, _conn: &mut HandlerConnection<'_>| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        Ok::<(), Error>(())
                    },
                    s,
                )
                .await
        }
    });
    let start = Instant::now();
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if left == 0 || start.elapsed() > Duration::from_secs(10) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(stats.processed, 1);
    assert_eq!(stats.duplicates, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_batch_claims_split_the_keys_exactly_once() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("batches").unwrap();
    let first: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    let second: Vec<String> = (100..300).map(|i| format!("k{i}")).collect();
    let mut t1 = db.pool.begin().await.unwrap();
    let claimed1 = inbox
        .claim_batch(&mut t1, first.iter().map(String::as_str))
        .await
        .unwrap();
    assert!(
        claimed1.iter().all(|c| *c),
        "a fresh batch is claimed whole"
    );
    let t2 = tokio::spawn({
        let pool = db.pool.clone();
        let inbox = inbox.clone();
        async move {
            let mut t2 = pool.begin().await.unwrap();
            let claimed = inbox
                .claim_batch(&mut t2, second.iter().map(String::as_str))
                .await
                .unwrap();
            t2.commit().await.unwrap();
            claimed
        }
    });
    support::wait_for_lock_waiter(&db.pool).await;
    t1.commit().await.unwrap();
    let claimed2 = t2.await.unwrap();
    assert_eq!(claimed2.iter().filter(|c| **c).count(), 100);
    assert!(
        claimed2[..100].iter().all(|c| !*c),
        "k100..k199 were the first's"
    );
    assert!(claimed2[100..].iter().all(|c| *c));
    let total: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = 'batches'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(total, 300);
}
