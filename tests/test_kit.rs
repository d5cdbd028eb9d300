//! The test kit (`pgbox::testing`), used the way a service's own tests use it: only the
//! public API, a fresh database per test.

use std::time::Duration;

use pgbox::testing::{
    FaultPoint, FaultPoints, OutboxProbe, TEST_DATABASE_PREFIX, TestDatabase, TestError,
    run_until_idle, run_until_idle_within,
};
use pgbox::transport::PgQueue;
use pgbox::{Consumer, Envelope, HandlerConnection, Inbox, Message, Outbox, Relay, RetryPolicy};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Credit {
    account: String,
    amount: i32,
}

async fn credits_table(pool: &PgPool) {
    sqlx::query("CREATE TABLE credits (account text PRIMARY KEY, total int NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

/// Commits one credit message (keyed by its account) in a transaction of its own.
async fn enqueue_credit(pool: &PgPool, account: &str, amount: i32) -> uuid::Uuid {
    let credit = Credit {
        account: account.into(),
        amount,
    };
    let mut tx = pool.begin().await.unwrap();
    let id = Outbox::new()
        .enqueue(
            &mut tx,
            Message::json("credits", &credit)
                .unwrap()
                .ordering_key(account),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    id
}

/// The handler under test: adds the credit to the account's total, in the inbox's
/// transaction.
async fn apply_credit(e: &Envelope, conn: &mut HandlerConnection<'_>) -> Result<(), pgbox::Error> {
    let credit: Credit = e.json()?;
    sqlx::query(
        "INSERT INTO credits VALUES ($1, $2) \
         ON CONFLICT (account) DO UPDATE SET total = credits.total + $2",
    )
    .bind(&credit.account)
    .bind(credit.amount)
    .execute(&mut **conn)
    .await?;
    Ok(())
}

async fn totals(pool: &PgPool) -> Vec<(String, i32)> {
    sqlx::query_as("SELECT account, total FROM credits ORDER BY account")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A consumer of `credits` from `queue`, deduplicating in `pool`'s inbox, with the short
/// timings a test wants.
fn credits_consumer(pool: &PgPool, queue: PgQueue) -> Consumer<PgQueue> {
    Consumer::builder(
        pool.clone(),
        queue,
        "credits",
        Inbox::new("credits-service").unwrap(),
    )
    .concurrency(2)
    .poll_interval(Duration::from_millis(50))
    .visibility_timeout(Duration::from_secs(5))
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(10))
            .max_delay(Duration::from_millis(50)),
    )
    .build()
    .unwrap()
}

async fn database_exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn each_test_database_is_fresh_migrated_and_unseen_by_another() {
    let (a, b) = tokio::join!(TestDatabase::new(), TestDatabase::new());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a.name(), b.name());
    assert!(a.name().starts_with(TEST_DATABASE_PREFIX), "{}", a.name());
    for db in [&a, &b] {
        let current: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!(current, db.name());
        assert!(db.url().ends_with(db.name()), "{}", db.url());
        let outbox: Option<String> = sqlx::query_scalar("SELECT to_regclass('pgbox.outbox')::text")
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!(outbox.as_deref(), Some("pgbox.outbox"), "migrated");
    }
    credits_table(a.pool()).await;
    enqueue_credit(a.pool(), "x", 1).await;
    let in_b: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
        .fetch_one(b.pool())
        .await
        .unwrap();
    assert_eq!(in_b, 0, "b sees nothing of a's outbox");
    let credits_in_b: Option<String> = sqlx::query_scalar("SELECT to_regclass('credits')::text")
        .fetch_one(b.pool())
        .await
        .unwrap();
    assert_eq!(credits_in_b, None, "nor its tables");
    a.close().await.unwrap();
    b.close().await.unwrap();
}

#[tokio::test]
async fn an_unmigrated_database_has_no_pgbox_schema() {
    let db = TestDatabase::unmigrated().await.unwrap();
    let schema: Option<String> = sqlx::query_scalar("SELECT to_regnamespace('pgbox')::text")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(schema, None);
    db.close().await.unwrap();
}

#[tokio::test]
async fn closing_or_dropping_removes_only_the_databases_own_database() {
    let watcher = TestDatabase::unmigrated().await.unwrap();
    let closed = TestDatabase::unmigrated().await.unwrap();
    let dropped = TestDatabase::unmigrated().await.unwrap();
    let kept = TestDatabase::unmigrated().await.unwrap();
    let names = [
        closed.name().to_owned(),
        dropped.name().to_owned(),
        kept.name().to_owned(),
    ];
    for name in &names {
        assert!(database_exists(watcher.pool(), name).await, "{name} exists");
    }
    closed.close().await.unwrap();
    drop(dropped);
    assert!(
        !database_exists(watcher.pool(), &names[0]).await,
        "closed: dropped"
    );
    assert!(
        !database_exists(watcher.pool(), &names[1]).await,
        "dropped: dropped"
    );
    assert!(
        database_exists(watcher.pool(), &names[2]).await,
        "another test's database stays"
    );
    assert!(database_exists(watcher.pool(), watcher.name()).await);
    kept.close().await.unwrap();
    watcher.close().await.unwrap();
}

#[tokio::test]
async fn the_probe_sees_a_committed_enqueue_and_not_a_rolled_back_one() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool();
    // Messages from before the probe started are not its business.
    enqueue_credit(pool, "before", 1).await;
    let probe = OutboxProbe::start(pool).await.unwrap();
    probe.enqueued().await.unwrap().assert_nothing_enqueued();

    let mut tx = pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(
            &mut tx,
            Message::json(
                "credits",
                &Credit {
                    account: "gone".into(),
                    amount: 9,
                },
            )
            .unwrap(),
        )
        .await
        .unwrap();
    // Inside the transaction it is there; the pool does not see it yet.
    probe
        .enqueued_in(&mut tx)
        .await
        .unwrap()
        .assert_enqueued("credits", None);
    probe.enqueued().await.unwrap().assert_nothing_enqueued();
    tx.rollback().await.unwrap();
    probe.enqueued().await.unwrap().assert_nothing_enqueued();

    let id = enqueue_credit(pool, "a", 5).await;
    let enqueued = probe.enqueued().await.unwrap();
    assert_eq!(enqueued.len(), 1, "{enqueued}");
    let message = enqueued.assert_enqueued("credits", Some("a"));
    assert_eq!(message.id, id);
    assert_eq!(
        message.json::<Credit>().unwrap(),
        Credit {
            account: "a".into(),
            amount: 5
        }
    );
    enqueued.assert_not_enqueued("refunds");

    // The assertions fail, saying what was there.
    let wrong_key = std::panic::catch_unwind(|| {
        enqueued.assert_enqueued("credits", Some("b"));
    })
    .unwrap_err();
    let text = wrong_key.downcast_ref::<String>().unwrap();
    assert!(
        text.contains("key \"b\"") && text.contains("key \"a\""),
        "{text}"
    );
    assert!(std::panic::catch_unwind(|| enqueued.assert_nothing_enqueued()).is_err());
    assert!(std::panic::catch_unwind(|| enqueued.assert_not_enqueued("credits")).is_err());
    db.close().await.unwrap();
}

#[tokio::test]
async fn run_until_idle_delivers_every_message_to_the_handler_once() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool();
    credits_table(pool).await;
    for (account, amount) in [("a", 1), ("b", 2), ("a", 3)] {
        enqueue_credit(pool, account, amount).await;
    }
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = credits_consumer(pool, queue);
    let report = run_until_idle(&relay, &consumer, apply_credit)
        .await
        .unwrap();
    assert_eq!(report.consumer.processed, 3, "{report:?}");
    assert_eq!(report.consumer.duplicates, 0, "{report:?}");
    assert_eq!(totals(pool).await, [("a".into(), 4), ("b".into(), 2)]);
    // Idle means idle: nothing left in the outbox or the queue.
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pgbox.outbox) + (SELECT count(*) FROM pgbox.queue)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(left, 0);
    db.close().await.unwrap();
}

#[tokio::test]
async fn a_crash_between_the_handlers_commit_and_the_ack_is_a_duplicate_applied_once() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool();
    credits_table(pool).await;
    enqueue_credit(pool, "a", 5).await;
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = credits_consumer(pool, queue);
    let faults = FaultPoints::new();
    faults.arm(FaultPoint::ConsumerAfterHandlerCommitBeforeAck, 1);
    let report = faults
        .scope(run_until_idle(&relay, &consumer, apply_credit))
        .await
        .unwrap();
    assert_eq!(
        faults.fired(FaultPoint::ConsumerAfterHandlerCommitBeforeAck),
        1
    );
    assert_eq!(
        (report.consumer.processed, report.consumer.duplicates),
        (1, 1),
        "the redelivery is a duplicate: {report:?}"
    );
    assert_eq!(totals(pool).await, [("a".into(), 5)], "applied once");
    db.close().await.unwrap();
}

#[tokio::test]
async fn a_relay_crash_after_publishing_sends_the_message_twice_and_the_inbox_applies_it_once() {
    // The services' database (outbox, inbox, effects) and a queue in a database of its own:
    // the relay publishes through the queue's pool, as it would to a broker, so a round that
    // dies after the publish has sent its batch.
    let db = TestDatabase::new().await.unwrap();
    let broker = TestDatabase::new().await.unwrap();
    let pool = db.pool();
    credits_table(pool).await;
    enqueue_credit(pool, "a", 5).await;
    let queue = PgQueue::new(broker.pool().clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = credits_consumer(pool, queue);
    let faults = FaultPoints::new();
    faults.arm(FaultPoint::RelayAfterPublishBeforeMark, 1);
    let report = faults
        .scope(run_until_idle(&relay, &consumer, apply_credit))
        .await
        .unwrap();
    assert_eq!(faults.fired(FaultPoint::RelayAfterPublishBeforeMark), 1);
    assert_eq!(report.relay_faults, 1, "{report:?}");
    assert_eq!(
        (report.consumer.processed, report.consumer.duplicates),
        (1, 1),
        "two copies, one applied: {report:?}"
    );
    assert_eq!(totals(pool).await, [("a".into(), 5)], "applied once");
    broker.close().await.unwrap();
    db.close().await.unwrap();
}

#[tokio::test]
async fn what_a_handler_enqueues_is_relayed_before_it_is_idle() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool();
    enqueue_credit(pool, "a", 5).await;
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = credits_consumer(pool, queue);
    // Each credit, once applied, announces itself on another topic.
    let report = run_until_idle(
        &relay,
        &consumer,
        async |e: &Envelope, conn: &mut HandlerConnection<'_>| {
            let credit: Credit = e.json()?;
            Outbox::new()
                .enqueue(
                    conn,
                    Message::json("credited", &credit)?.ordering_key(credit.account.as_str()),
                )
                .await?;
            Ok::<_, pgbox::Error>(())
        },
    )
    .await
    .unwrap();
    assert_eq!(
        report.published, 2,
        "the credit and the announcement: {report:?}"
    );
    let announced: Vec<(String, i64)> =
        sqlx::query_as("SELECT topic, (SELECT count(*) FROM pgbox.outbox) FROM pgbox.queue")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(
        announced,
        [("credited".to_owned(), 0)],
        "relayed, waiting for its consumer"
    );
    db.close().await.unwrap();
}

async fn always_fails(_: &Envelope, _: &mut HandlerConnection<'_>) -> Result<(), pgbox::Error> {
    Err(pgbox::Error::InvalidConfig("always fails".into()))
}

#[tokio::test]
async fn a_message_that_fails_every_delivery_ends_dead_lettered_and_then_it_is_idle() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool();
    enqueue_credit(pool, "a", 5).await;
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    let consumer = credits_consumer(pool, queue);
    let report = run_until_idle(&relay, &consumer, always_fails)
        .await
        .unwrap();
    assert_eq!(report.consumer.dead_lettered, 1, "{report:?}");
    assert_eq!(report.consumer.processed, 0, "{report:?}");
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue_dead_letters")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(dead, 1);
    db.close().await.unwrap();
}

#[tokio::test]
async fn run_until_idle_gives_up_with_not_idle_when_a_message_never_settles() {
    let db = TestDatabase::new().await.unwrap();
    let pool = db.pool();
    enqueue_credit(pool, "a", 5).await;
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone()).build().unwrap();
    // Retried for far longer than the limit: never dead-lettered within it.
    let consumer = Consumer::builder(
        pool.clone(),
        queue,
        "credits",
        Inbox::new("credits-service").unwrap(),
    )
    .poll_interval(Duration::from_millis(50))
    .max_deliveries(1_000_000)
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(20))
            .max_delay(Duration::from_millis(50)),
    )
    .build()
    .unwrap();
    let failed = run_until_idle_within(Duration::from_secs(1), &relay, &consumer, always_fails)
        .await
        .unwrap_err();
    match failed {
        TestError::NotIdle { state, .. } => {
            assert!(
                state.contains("1 message(s)") && state.contains("credits"),
                "{state}"
            )
        }
        other => panic!("expected NotIdle, got {other}"),
    }
    db.close().await.unwrap();
}
