//! A handler that nests a unit of work on the connection it was given must never end the
//! inbox's transaction: whatever the entry point, layout, isolation level or lease state,
//! a nested commit followed by a handler error leaves nothing committed, a nested rollback
//! followed by success commits the rest once, and a nested unit that calls other pgbox APIs
//! commits with the message. Transaction control sent through the handler's connection is
//! refused; transaction control sent behind it is reported, never `Processed`.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use pgbox::transport::PgQueue;
use pgbox::{
    Consumer, Envelope, Error, HandlerConnection, Inbox, InboxPartitioning, Message, Migrator,
    Outbox, Outcome, Relay, Sequenced,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgPool};
use support::TestDb;
use tokio_util::sync::CancellationToken;

/// What the handler does on its first delivery (a redelivery always runs [`plain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// A nested unit writes and commits; then the handler fails.
    NestedCommitThenError,
    /// A nested unit writes and rolls back; then the handler writes and succeeds.
    NestedRollbackThenSuccess,
    /// A nested unit enqueues to the outbox and processes a key of another inbox, and commits.
    NestedPgboxApis,
    /// `COMMIT` sent through the handler's connection (refused), error propagated.
    CommitThroughTheWrapper,
    /// `COMMIT` sent on the raw connection behind the wrapper; then a write and success.
    CommitBehindTheWrapper,
    /// `ROLLBACK` sent on the raw connection behind the wrapper; then a write and success.
    RollbackBehindTheWrapper,
}

const SCENARIOS: [Scenario; 6] = [
    Scenario::NestedCommitThenError,
    Scenario::NestedRollbackThenSuccess,
    Scenario::NestedPgboxApis,
    Scenario::CommitThroughTheWrapper,
    Scenario::CommitBehindTheWrapper,
    Scenario::RollbackBehindTheWrapper,
];

async fn effect(conn: &mut sqlx::PgConnection, key: &str, what: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO effects (key, what) VALUES ($1, $2)")
        .bind(key)
        .bind(what)
        .execute(conn)
        .await?;
    Ok(())
}

/// The handler of a redelivery: one write.
async fn plain(conn: &mut HandlerConnection<'_>, key: &str) -> anyhow::Result<()> {
    sqlx::query("INSERT INTO effects (key, what) VALUES ($1, 'outer')")
        .bind(key)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn first(
    conn: &mut HandlerConnection<'_>,
    key: &str,
    scenario: Scenario,
) -> anyhow::Result<()> {
    match scenario {
        Scenario::NestedCommitThenError => {
            let mut nested = conn.begin().await?;
            effect(&mut nested, key, "nested").await?;
            nested.commit().await?;
            Err(anyhow!("the handler fails after its nested unit committed"))
        }
        Scenario::NestedRollbackThenSuccess => {
            let mut nested = conn.begin().await?;
            effect(&mut nested, key, "nested").await?;
            nested.rollback().await?;
            plain(conn, key).await
        }
        Scenario::NestedPgboxApis => {
            let mut nested = conn.begin().await?;
            Outbox::new()
                .enqueue(&mut nested, Message::bytes("nested-topic", key.as_bytes()))
                .await?;
            let inner = Inbox::new("inner").unwrap();
            let outcome = inner
                .process(&mut nested, key, async |c| {
                    sqlx::query("INSERT INTO effects (key, what) VALUES ($1, 'inner')")
                        .bind(key)
                        .execute(&mut *c)
                        .await?;
                    Ok::<_, anyhow::Error>(())
                })
                .await?;
            anyhow::ensure!(outcome.is_processed(), "inner: {outcome:?}");
            nested.commit().await?;
            Ok(())
        }
        Scenario::CommitThroughTheWrapper => {
            sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
            plain(conn, key).await
        }
        Scenario::CommitBehindTheWrapper => {
            sqlx::raw_sql("COMMIT").execute(&mut **conn).await?;
            plain(conn, key).await
        }
        Scenario::RollbackBehindTheWrapper => {
            sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await?;
            plain(conn, key).await
        }
    }
}

/// The ways into the inbox that run a handler on the claim's transaction.
#[derive(Debug, Clone, Copy)]
enum Entry {
    /// `process` on a transaction the caller begins with this statement and commits on `Ok`.
    Process(&'static str),
    /// `process_and_commit` on the pool.
    ProcessAndCommit,
    /// `process_and_commit` on a connection the caller holds.
    ProcessAndCommitOnConnection,
    /// `process_with_retry`.
    ProcessWithRetry,
}

const ISOLATION: [&str; 3] = [
    "BEGIN ISOLATION LEVEL READ COMMITTED",
    "BEGIN ISOLATION LEVEL REPEATABLE READ",
    "BEGIN ISOLATION LEVEL SERIALIZABLE",
];

async fn deliver(
    entry: Entry,
    pool: &PgPool,
    inbox: &Inbox,
    key: &str,
    scenario: Option<Scenario>,
) -> anyhow::Result<Outcome<()>> {
    let handler = async |conn: &mut HandlerConnection<'_>| match scenario {
        Some(s) => first(conn, key, s).await,
        None => plain(conn, key).await,
    };
    match entry {
        Entry::Process(begin) => {
            let mut tx = pool.begin_with(begin).await?;
            let outcome = inbox.process(&mut tx, key, handler).await?;
            tx.commit().await?;
            Ok(outcome)
        }
        Entry::ProcessAndCommit => inbox.process_and_commit(pool, key, handler).await,
        Entry::ProcessAndCommitOnConnection => {
            let mut conn = pool.acquire().await?;
            inbox.process_and_commit(&mut *conn, key, handler).await
        }
        Entry::ProcessWithRetry => {
            let policy = pgbox::RetryPolicy::new().max_attempts(1);
            inbox
                .process_with_retry(pool, key, &policy, async |conn| {
                    handler(conn).await.map_err(Failure)
                })
                .await
                .map_err(|Failure(e)| e)
        }
    }
}

/// A handler error `process_with_retry` accepts.
struct Failure(anyhow::Error);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(e.into())
    }
}

impl pgbox::Retryable for Failure {
    fn is_retryable(&self) -> bool {
        false
    }
}

async fn count(pool: &PgPool, sql: &str, key: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn effects(pool: &PgPool, key: &str, what: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1 AND what = $2")
        .bind(key)
        .bind(what)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The inbox rows of `key` for `consumer`, in whichever table the layout uses.
async fn records(pool: &PgPool, consumer: &str, key: &str, partitioned: bool) -> i64 {
    let table = if partitioned {
        "pgbox.partitioned_inbox"
    } else {
        "pgbox.inbox"
    };
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE consumer = $1 AND key = $2"
    )))
    .bind(consumer)
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn effects_table(db: &TestDb) {
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL, what text NOT NULL)")
        .await
        .unwrap();
}

/// One scenario through one entry point, then a plain redelivery; checks what committed.
async fn check(
    entry: Entry,
    pool: &PgPool,
    inbox: &Inbox,
    partitioned: bool,
    key: &str,
    scenario: Scenario,
) {
    let ctx = format!("{entry:?} / {scenario:?} / partitioned {partitioned}");
    let consumer = inbox.consumer();
    let result = deliver(entry, pool, inbox, key, Some(scenario)).await;
    let redelivery = deliver(entry, pool, inbox, key, None)
        .await
        .unwrap_or_else(|e| panic!("{ctx}: redelivery failed: {e:#}"));
    match scenario {
        Scenario::NestedCommitThenError | Scenario::CommitThroughTheWrapper => {
            let e = result.expect_err(&ctx);
            if scenario == Scenario::CommitThroughTheWrapper {
                assert!(
                    format!("{e:#}").contains("may not send COMMIT"),
                    "{ctx}: {e:#}"
                );
            }
            // Nothing of the failed delivery committed; the redelivery did the work.
            assert_eq!(effects(pool, key, "nested").await, 0, "{ctx}");
            assert!(redelivery.is_processed(), "{ctx}: {redelivery:?}");
            assert_eq!(effects(pool, key, "outer").await, 1, "{ctx}");
        }
        Scenario::NestedRollbackThenSuccess => {
            assert!(result.expect(&ctx).is_processed(), "{ctx}");
            assert!(redelivery.is_duplicate(), "{ctx}: {redelivery:?}");
            assert_eq!(effects(pool, key, "nested").await, 0, "{ctx}");
            assert_eq!(effects(pool, key, "outer").await, 1, "{ctx}");
        }
        Scenario::NestedPgboxApis => {
            assert!(result.expect(&ctx).is_processed(), "{ctx}");
            assert!(redelivery.is_duplicate(), "{ctx}: {redelivery:?}");
            assert_eq!(effects(pool, key, "inner").await, 1, "{ctx}");
            assert_eq!(effects(pool, key, "outer").await, 0, "{ctx}");
            assert_eq!(records(pool, "inner", key, partitioned).await, 1, "{ctx}");
            let enqueued = count(
                pool,
                "SELECT count(*) FROM pgbox.outbox WHERE topic = 'nested-topic' AND payload = convert_to($1, 'UTF8')",
                key,
            )
            .await;
            assert_eq!(enqueued, 1, "{ctx}");
        }
        Scenario::CommitBehindTheWrapper | Scenario::RollbackBehindTheWrapper => {
            // Whatever ran outside the inbox's transaction, the first delivery is never
            // reported processed.
            let e = result.expect_err(&ctx);
            let ended = e
                .downcast_ref::<Error>()
                .is_some_and(|e| matches!(e, Error::TransactionEndedInHandler));
            assert!(ended, "{ctx}: {e:#}");
        }
    }
    assert_eq!(records(pool, consumer, key, partitioned).await, 1, "{ctx}");
}

#[tokio::test]
async fn nested_units_never_end_the_inbox_transaction_on_any_entry_point_or_isolation_level() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db).await;
    let inbox = Inbox::new("points").unwrap();
    let mut entries: Vec<Entry> = ISOLATION.iter().map(|b| Entry::Process(b)).collect();
    entries.extend([
        Entry::ProcessAndCommit,
        Entry::ProcessAndCommitOnConnection,
        Entry::ProcessWithRetry,
    ]);
    for (e, entry) in entries.into_iter().enumerate() {
        for (s, scenario) in SCENARIOS.into_iter().enumerate() {
            check(
                entry,
                &db.pool,
                &inbox,
                false,
                &format!("k-{e}-{s}"),
                scenario,
            )
            .await;
        }
    }
}

#[tokio::test]
async fn nested_units_on_the_partitioned_inbox() {
    support::init_tracing();
    let db = TestDb::empty().await;
    Migrator::new()
        .partitioned_inbox(InboxPartitioning::every(Duration::from_secs(3600)).ahead(2))
        .run(&db.pool)
        .await
        .unwrap();
    effects_table(&db).await;
    let inbox = Inbox::builder("points").partitioned(true).build().unwrap();
    for (e, entry) in [
        Entry::Process(ISOLATION[0]),
        Entry::ProcessAndCommit,
        Entry::ProcessWithRetry,
    ]
    .into_iter()
    .enumerate()
    {
        // The nested inbox ("inner") is a plain one: skip the scenario that needs it here.
        for (s, scenario) in SCENARIOS.into_iter().enumerate() {
            if scenario == Scenario::NestedPgboxApis {
                continue;
            }
            check(
                entry,
                &db.pool,
                &inbox,
                true,
                &format!("p-{e}-{s}"),
                scenario,
            )
            .await;
        }
    }
}

#[tokio::test]
async fn nested_units_on_a_key_whose_expired_lease_is_taken_over() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db).await;
    let inbox = Inbox::new("points").unwrap();
    for (s, scenario) in SCENARIOS.into_iter().enumerate() {
        for (e, entry) in [Entry::Process(ISOLATION[0]), Entry::ProcessAndCommit]
            .into_iter()
            .enumerate()
        {
            let key = format!("lease-{e}-{s}");
            let leased = inbox
                .lease(&db.pool, key.as_str(), Duration::from_millis(100))
                .await
                .unwrap();
            assert!(matches!(leased, pgbox::LeaseAttempt::Leased(_)));
            tokio::time::sleep(Duration::from_millis(150)).await;
            check(entry, &db.pool, &inbox, false, &key, scenario).await;
        }
    }
}

#[tokio::test]
async fn in_order_processing_keeps_its_watermark_in_the_same_transaction() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db).await;
    let inbox = Inbox::new("ledger").unwrap();
    let watermark = async || -> i64 {
        sqlx::query_scalar(
            "SELECT coalesce(max(last_seq), 0) FROM pgbox.sequence_watermarks WHERE entity = 'acct'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    for (seq, scenario) in [
        (1, Scenario::NestedCommitThenError),
        (1, Scenario::CommitThroughTheWrapper),
        (1, Scenario::NestedRollbackThenSuccess),
        (2, Scenario::CommitBehindTheWrapper),
        (2, Scenario::RollbackBehindTheWrapper),
    ] {
        let key = format!("seq-{seq}-{scenario:?}");
        let mut tx = db.pool.begin().await.unwrap();
        let result = inbox
            .process_in_order(&mut tx, "acct", seq, async |conn| {
                first(conn, &key, scenario).await
            })
            .await;
        let ok = matches!(result, Ok(Sequenced::Processed { .. }));
        if ok {
            tx.commit().await.unwrap();
        } else {
            drop(tx);
        }
        match scenario {
            Scenario::NestedRollbackThenSuccess => {
                assert!(ok, "{scenario:?}: {result:?}");
                assert_eq!(watermark().await, 1);
                assert_eq!(effects(&db.pool, &key, "nested").await, 0);
                assert_eq!(effects(&db.pool, &key, "outer").await, 1);
            }
            Scenario::NestedCommitThenError | Scenario::CommitThroughTheWrapper => {
                assert!(!ok, "{scenario:?}: {result:?}");
                assert_eq!(watermark().await, 0);
                assert_eq!(effects(&db.pool, &key, "nested").await, 0);
            }
            _ => {
                let ended = matches!(
                    result
                        .as_ref()
                        .err()
                        .and_then(|e| e.downcast_ref::<Error>()),
                    Some(Error::TransactionEndedInHandler)
                );
                assert!(ended, "{scenario:?}: {result:?}");
            }
        }
    }
}

#[tokio::test]
async fn a_cancelled_call_never_commits_a_nested_unit() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db).await;
    // One connection: whatever the cancelled call leaves behind, the next call meets.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let inbox = Inbox::new("points").unwrap();
    for i in 0..20 {
        let key = format!("cancel-{i}");
        let call = inbox.process_and_commit(&pool, key.as_str(), async |conn| {
            let mut nested = conn.begin().await?;
            effect(&mut nested, &key, "nested").await?;
            nested.commit().await?;
            // Cancelled here, after the nested unit "committed".
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok::<_, anyhow::Error>(())
        });
        let timed_out = tokio::time::timeout(Duration::from_millis(20 + i * 5), call).await;
        assert!(timed_out.is_err(), "the call was meant to be cancelled");
        assert_eq!(effects(&db.pool, &key, "nested").await, 0, "{key}");
        assert_eq!(records(&db.pool, "points", &key, false).await, 0, "{key}");
        // The connection comes back usable and outside any transaction.
        let outcome = deliver(Entry::ProcessAndCommit, &pool, &inbox, &key, None)
            .await
            .unwrap();
        assert!(outcome.is_processed(), "{key}: {outcome:?}");
        assert_eq!(effects(&db.pool, &key, "outer").await, 1, "{key}");
    }
}

#[tokio::test]
async fn process_and_commit_refuses_a_connection_already_in_a_transaction() {
    let db = TestDb::migrated().await;
    effects_table(&db).await;
    let inbox = Inbox::new("points").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let result = inbox
        .process_and_commit(&mut *tx, "k", async |conn| plain(conn, "k").await)
        .await;
    let e = result.expect_err("a savepoint is not a commit");
    assert!(
        matches!(e.downcast_ref::<Error>(), Some(Error::InvalidConfig(_))),
        "{e:#}"
    );
}

/// The runner (`Consumer` on the built-in queue) with handlers that nest units of work: a
/// failed first attempt after a nested commit leaves nothing, a nested rollback keeps the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_keeps_nested_units_inside_the_message_transaction() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    effects_table(&db).await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for p in ["fail-once", "rollback", "apis"] {
        outbox
            .enqueue(&mut tx, Message::bytes("jobs", p))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let queue = PgQueue::new(db.pool.clone());
    Relay::builder(db.pool.clone(), queue.clone())
        .build()
        .unwrap()
        .relay_once()
        .await
        .unwrap();
    let consumer = Consumer::builder(
        db.pool.clone(),
        queue,
        "jobs",
        Inbox::new("runner").unwrap(),
    )
    .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
    .poll_interval(Duration::from_millis(20))
    .build()
    .unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let s = shutdown.clone();
        let attempts = attempts.clone();
        async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        let payload = String::from_utf8(e.payload.clone()).unwrap();
                        match payload.as_str() {
                            "fail-once" if attempts.fetch_add(1, Ordering::SeqCst) == 0 => {
                                first(conn, &payload, Scenario::NestedCommitThenError).await
                            }
                            "fail-once" => plain(conn, &payload).await,
                            "rollback" => {
                                first(conn, &payload, Scenario::NestedRollbackThenSuccess).await
                            }
                            _ => first(conn, &payload, Scenario::NestedPgboxApis).await,
                        }
                    },
                    s,
                )
                .await
        }
    });
    let started = Instant::now();
    while effects(&db.pool, "fail-once", "outer").await < 1
        && started.elapsed() < Duration::from_secs(30)
        && !run.is_finished()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let anything still in flight settle, then stop.
    tokio::time::sleep(Duration::from_millis(200)).await;
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(stats.processed, 3, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(stats.retried, 1, "{stats:?}");
    assert_eq!(effects(&db.pool, "fail-once", "nested").await, 0);
    assert_eq!(effects(&db.pool, "fail-once", "outer").await, 1);
    assert_eq!(effects(&db.pool, "rollback", "nested").await, 0);
    assert_eq!(effects(&db.pool, "rollback", "outer").await, 1);
    assert_eq!(effects(&db.pool, "apis", "inner").await, 1);
    let recorded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = 'runner'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(recorded, 3);
}
