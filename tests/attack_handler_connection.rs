//! Attacks on the handler's connection (`HandlerConnection`, src/inbox/connection.rs).
//!
//! The promise under attack (rustdoc of `HandlerConnection`, commit 1eaf742, and README's
//! "Guarantees, and where they end"):
//!
//! 1. Nothing a handler sends through its `HandlerConnection` can end the inbox's
//!    transaction: every statement goes out with the extended protocol (the server refuses a
//!    second statement, 42601), and BEGIN/START/COMMIT/END/ROLLBACK (not ROLLBACK TO)/ABORT/
//!    PREPARE TRANSACTION are refused before they reach the server.
//! 2. On the raw connection, or inside a nested unit from `conn.begin()`, transaction control
//!    is reported (`TransactionEndedInHandler`), never `Processed`, when the handler returns
//!    `Ok`.
//! 3. Nested units of work stay inside the message's transaction, on every entry point:
//!    `conn.begin()` is a savepoint, whose commit or rollback "cannot end the transaction the
//!    message is recorded in".
//! 4. Exactly one committed effect per `(consumer, key)` for effects written through the
//!    handler's transaction: the inbox row and those writes commit together or not at all;
//!    a redelivery of a committed key is `Duplicate`, of an uncommitted one runs once more.
//!
//! Every test here checks the invariant that matters: after each delivery, the handler's
//! effects and the inbox row are both committed or both absent, and over all deliveries of a
//! key there is exactly one committed effect.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::{FutureExt, StreamExt, TryStreamExt};
use pgbox::{Error, HandlerConnection, Inbox, Outcome, Pooler};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgPool};
use support::TestDb;

const CONSUMER: &str = "attacker";

async fn setup() -> TestDb {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    db
}

async fn effects(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn records(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = $1 AND key = $2")
        .bind(CONSUMER)
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn effect(conn: &mut HandlerConnection<'_>, key: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO effects (key) VALUES ($1)")
        .bind(key)
        .execute(&mut *conn)
        .await
        .map(|_| ())
}

/// A well-behaved redelivery: one effect, through the watched connection.
async fn redeliver(pool: &PgPool, inbox: &Inbox, key: &str) -> Outcome<()> {
    inbox
        .process_and_commit(pool, key, async |conn: &mut HandlerConnection<'_>| {
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(())
        })
        .await
        .expect("the redelivery")
}

/// The invariant after one delivery, and after a well-behaved redelivery: `None` when it
/// holds, else what broke.
async fn exactly_once(
    pool: &PgPool,
    inbox: &Inbox,
    key: &str,
    what: &str,
    first: &anyhow::Result<Outcome<()>>,
) -> Option<String> {
    let (e1, r1) = (effects(pool, key).await, records(pool, key).await);
    let again = redeliver(pool, inbox, key).await;
    let (e2, r2) = (effects(pool, key).await, records(pool, key).await);
    let report = format!(
        "{what}: first delivery {first:?} -> effects {e1}, records {r1}; \
         redelivery {again:?} -> effects {e2}, records {r2}"
    );
    eprintln!("{report}");
    let processed = matches!(first, Ok(Outcome::Processed(())));
    let broken = (processed && (e1, r1) != (1, 1)) || e1 != r1 || (e2, r2) != (1, 1);
    broken.then_some(report)
}

async fn check_exactly_once(
    pool: &PgPool,
    inbox: &Inbox,
    key: &str,
    what: &str,
    first: &anyhow::Result<Outcome<()>>,
) {
    if let Some(report) = exactly_once(pool, inbox, key, what, first).await {
        panic!("not exactly once: {report}");
    }
}

// ---------------------------------------------------------------------------------------
// Findings (fixed: sqlx's transaction depth against the claim's level, the claim's row in the
// liveness check, 25P01 after the handler read as an ended transaction; each doc comment says
// what the old code did)
// ---------------------------------------------------------------------------------------

/// A handler swallows a failed statement (pgbox promises to report that: never
/// `Processed`) and then opens a nested unit, the README's way to isolate work. sqlx's
/// `begin` sees its SAVEPOINT refused (the transaction is aborted) and, in its clean-up,
/// queues a top-level `ROLLBACK` and sets its depth to 0. The next statement the handler sends
/// through the *watched* connection flushes that ROLLBACK and then runs in autocommit: the
/// effect commits on its own, the inbox row does not, and the redelivery applies it again.
#[tokio::test]
async fn a_refused_nested_begin_is_transaction_ended_and_nothing_after_it_autocommits() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let mut broken = Vec::new();
    for entry in ["process_and_commit", "process"] {
        let key = format!("refused-begin-{entry}");
        let handler = async |conn: &mut HandlerConnection<'_>| {
            // e.g. a duplicate the handler means to tolerate
            let _ = sqlx::query("SELECT 1/0").execute(&mut *conn).await;
            // isolate the rest in a nested unit; it cannot be opened
            match conn.begin().await {
                Ok(unit) => unit.commit().await?,
                Err(e) => eprintln!("nested begin refused: {e}"),
            }
            let _ = effect(conn, &key).await;
            Ok::<_, anyhow::Error>(())
        };
        let first = if entry == "process" {
            let mut tx = db.pool.begin().await.unwrap();
            let outcome = inbox.process(&mut tx, key.as_str(), handler).await;
            if outcome.is_ok() {
                tx.commit().await.unwrap();
            }
            outcome
        } else {
            inbox
                .process_and_commit(&db.pool, key.as_str(), handler)
                .await
        };
        if matches!(first, Ok(Outcome::Processed(()))) {
            broken.push(format!("{entry}: a swallowed failure reported Processed"));
        }
        broken.extend(exactly_once(&db.pool, &inbox, &key, entry, &first).await);
    }
    assert!(
        broken.is_empty(),
        "not exactly once:\n{}",
        broken.join("\n")
    );
}

/// A nested unit whose `begin` is given up while its SAVEPOINT is on the wire (a timeout, a
/// `select!`): sqlx 0.9.0 queues a top-level `ROLLBACK` (transact-rs/sqlx#4393's twin for
/// savepoints, which pgbox's own batch claim works around). The inbox's transaction ends;
/// the handler's next statement through the watched connection autocommits.
#[tokio::test]
async fn a_nested_begin_given_up_mid_flight_lets_nothing_run_outside_the_inbox_transaction() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "cancelled-begin";
    let cancelled = AtomicBool::new(false);
    let first = inbox
        .process_and_commit(&db.pool, key, async |conn: &mut HandlerConnection<'_>| {
            // A handler that gives up on opening a nested unit (a timeout, a shutdown signal
            // in a `select!`): modelled as one poll, i.e. given up right after the SAVEPOINT
            // went out. Bounded loop, in case the answer is already there.
            for _ in 0..500 {
                match conn.begin().now_or_never() {
                    None => {
                        cancelled.store(true, Ordering::Relaxed);
                        break;
                    }
                    Some(Ok(unit)) => unit.rollback().await?,
                    Some(Err(e)) => return Err(e.into()),
                }
            }
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(())
        })
        .await;
    assert!(
        cancelled.load(Ordering::Relaxed),
        "the begin never went out unanswered"
    );
    check_exactly_once(&db.pool, &inbox, key, "cancelled nested begin", &first).await;
}

/// A nested unit that is never ended (`mem::forget`, `Box::leak`, a cycle): sqlx's depth stays
/// at 2, pgbox's check (same transaction id) passes, and `process_and_commit`'s `commit()`
/// only releases the savepoint. It reports `Processed` having committed nothing, and the
/// pool gets the connection back inside the open transaction.
#[tokio::test]
async fn a_leaked_nested_unit_is_rolled_back_never_processed_and_never_lent_on_in_a_transaction() {
    let db = setup().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "leaked-unit";
    let first = inbox
        .process_and_commit(&pool, key, async |conn: &mut HandlerConnection<'_>| {
            let unit = conn.begin().await?;
            std::mem::forget(unit);
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(())
        })
        .await;
    let (e, r) = (effects(&db.pool, key).await, records(&db.pool, key).await);
    // What the pool lends next: a connection still inside the leaked transaction.
    let next_in_tx: bool = {
        let mut c = pool.acquire().await.unwrap();
        sqlx::query_scalar("SELECT pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL")
            .fetch_one(&mut *c)
            .await
            .unwrap()
    };
    eprintln!("first {first:?}; effects {e}, records {r}; next borrower inside it: {next_in_tx}");
    pool.close().await;
    if let Ok(Outcome::Processed(())) = first {
        assert_eq!(
            (e, r),
            (1, 1),
            "process_and_commit returned Processed, but effects {e}, records {r} committed"
        );
    }
    assert!(
        !next_in_tx,
        "the pool lent a connection inside an open transaction"
    );
}

/// `process` on a transaction whose claim sits in a savepoint (the caller nested it, or a
/// handler nests `Inbox::process` in `conn.begin()`, as the README suggests): the handler
/// sends `ROLLBACK TO SAVEPOINT` (let through as "a nested unit") of the savepoint that holds
/// the claim. The transaction goes on with the same id, so pgbox's check passes; the claim is
/// gone, the effect written after it commits, and `Processed` is reported. The redelivery
/// runs the effect again.
#[tokio::test]
async fn rollback_to_a_savepoint_older_than_the_claim_is_never_processed() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "rollback-to-claim";
    let mut tx = db.pool.begin().await.unwrap();
    let mut unit = tx.begin().await.unwrap(); // SAVEPOINT _sqlx_savepoint_1
    let first = inbox
        .process(&mut unit, key, async |conn: &mut HandlerConnection<'_>| {
            sqlx::raw_sql("ROLLBACK TO SAVEPOINT _sqlx_savepoint_1")
                .execute(&mut *conn)
                .await?;
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(())
        })
        .await;
    if first.is_ok() {
        unit.commit().await.unwrap();
        tx.commit().await.unwrap();
    } else {
        drop(unit);
        drop(tx);
    }
    check_exactly_once(
        &db.pool,
        &inbox,
        key,
        "ROLLBACK TO the claim's savepoint",
        &first,
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Attacks that held (kept as regression tests)
// ---------------------------------------------------------------------------------------

/// Every way into the wrapper a handler has: each sends transaction control (or a second
/// statement), ignores the result, writes its effect and returns `Ok`.
#[derive(Debug, Clone, Copy)]
enum Entry {
    StrExecute,
    StrFetchAll,
    StrFetchOptional,
    StrFetchMany,
    RawSql,
    Query,
    QueryNotPersistent,
    QueryWithArgument,
    QueryAs,
    QueryScalar,
    TupleWithNoArguments,
    PreparedStatement,
    Describe,
    RawSqlTwoStatements,
    QueryTwoStatements,
    DoBlockCommit,
    CallProcedureCommit,
    RollbackAndChain,
    CommitAndChain,
    PrepareTransaction,
    SetSessionCharacteristicsThenCommit,
}

const ENTRIES: [Entry; 21] = [
    Entry::StrExecute,
    Entry::StrFetchAll,
    Entry::StrFetchOptional,
    Entry::StrFetchMany,
    Entry::RawSql,
    Entry::Query,
    Entry::QueryNotPersistent,
    Entry::QueryWithArgument,
    Entry::QueryAs,
    Entry::QueryScalar,
    Entry::TupleWithNoArguments,
    Entry::PreparedStatement,
    Entry::Describe,
    Entry::RawSqlTwoStatements,
    Entry::QueryTwoStatements,
    Entry::DoBlockCommit,
    Entry::CallProcedureCommit,
    Entry::RollbackAndChain,
    Entry::CommitAndChain,
    Entry::PrepareTransaction,
    Entry::SetSessionCharacteristicsThenCommit,
];

async fn send(conn: &mut HandlerConnection<'_>, entry: Entry) -> Result<(), sqlx::Error> {
    match entry {
        Entry::StrExecute => conn.execute("COMMIT").await.map(drop),
        Entry::StrFetchAll => conn.fetch_all("END").await.map(drop),
        Entry::StrFetchOptional => conn.fetch_optional("ROLLBACK").await.map(drop),
        Entry::StrFetchMany => conn
            .fetch_many("ABORT")
            .try_collect::<Vec<_>>()
            .await
            .map(drop),
        Entry::RawSql => sqlx::raw_sql("commit work")
            .execute(&mut *conn)
            .await
            .map(drop),
        Entry::Query => sqlx::query("COMMIT").execute(&mut *conn).await.map(drop),
        Entry::QueryNotPersistent => sqlx::query("/* x */ COMMIT")
            .persistent(false)
            .execute(&mut *conn)
            .await
            .map(drop),
        Entry::QueryWithArgument => sqlx::query("SELECT $1::int; COMMIT")
            .bind(1)
            .execute(&mut *conn)
            .await
            .map(drop),
        Entry::QueryAs => sqlx::query_as::<_, (i32,)>("END")
            .fetch_optional(&mut *conn)
            .await
            .map(drop),
        Entry::QueryScalar => sqlx::query_scalar::<_, i32>("ROLLBACK TRANSACTION")
            .fetch_all(&mut *conn)
            .await
            .map(drop),
        Entry::TupleWithNoArguments => conn
            .execute(("COMMIT", None::<sqlx::postgres::PgArguments>))
            .await
            .map(drop),
        Entry::PreparedStatement => {
            // Parse only: never executes. Then the prepared statement through the wrapper.
            let stmt = (&mut *conn)
                .prepare(sqlx::SqlSafeStr::into_sql_str("COMMIT"))
                .await?;
            use sqlx::Statement;
            stmt.query().execute(&mut *conn).await.map(drop)
        }
        Entry::Describe => (&mut *conn)
            .describe(sqlx::SqlSafeStr::into_sql_str("COMMIT"))
            .await
            .map(drop),
        Entry::RawSqlTwoStatements => sqlx::raw_sql("SELECT 1; COMMIT")
            .execute(&mut *conn)
            .await
            .map(drop),
        Entry::QueryTwoStatements => conn.execute("SELECT 1; COMMIT").await.map(drop),
        Entry::DoBlockCommit => conn.execute("DO $$BEGIN COMMIT; END$$").await.map(drop),
        Entry::CallProcedureCommit => conn.execute("CALL committer()").await.map(drop),
        Entry::RollbackAndChain => conn.execute("ROLLBACK AND CHAIN").await.map(drop),
        Entry::CommitAndChain => conn.execute("COMMIT AND CHAIN").await.map(drop),
        Entry::PrepareTransaction => conn.execute("PREPARE TRANSACTION 'x'").await.map(drop),
        Entry::SetSessionCharacteristicsThenCommit => {
            conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                .await?;
            conn.execute("END").await.map(drop)
        }
    }
}

async fn every_entry_point(pooler: Pooler, fail: bool) {
    let db = setup().await;
    db.pool
        .execute("CREATE PROCEDURE committer() LANGUAGE plpgsql AS $$BEGIN INSERT INTO effects VALUES ('proc'); COMMIT; END$$")
        .await
        .unwrap();
    let inbox = Inbox::builder(CONSUMER).pooler(pooler).build().unwrap();
    for entry in ENTRIES {
        let key = format!("{entry:?}-{fail}");
        let sent = std::sync::Mutex::new(None);
        let first = inbox
            .process_and_commit(
                &db.pool,
                key.as_str(),
                async |conn: &mut HandlerConnection<'_>| {
                    let r = send(conn, entry).await;
                    *sent.lock().unwrap() = Some(r.map_err(|e| e.to_string()));
                    let _ = effect(conn, &key).await;
                    if fail {
                        anyhow::bail!("the handler fails after its effect");
                    }
                    Ok::<_, anyhow::Error>(())
                },
            )
            .await;
        let sent = sent.into_inner().unwrap();
        eprintln!("{entry:?}: sent {sent:?}");
        if !matches!(entry, Entry::Describe) {
            assert!(
                matches!(sent, Some(Err(_))),
                "{entry:?}: transaction control went through: {sent:?}"
            );
        }
        if fail {
            assert!(first.is_err(), "{entry:?}: a failing handler got {first:?}");
        }
        check_exactly_once(&db.pool, &inbox, &key, &format!("{entry:?}"), &first).await;
    }
    let proc_effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = 'proc'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(proc_effects, 0, "the procedure's COMMIT committed");
}

#[tokio::test]
async fn every_entry_point_of_the_wrapper_refuses_transaction_control_ok_handler() {
    every_entry_point(Pooler::None, false).await;
}

#[tokio::test]
async fn every_entry_point_of_the_wrapper_refuses_transaction_control_err_handler() {
    every_entry_point(Pooler::None, true).await;
}

#[tokio::test]
async fn every_entry_point_of_the_wrapper_refuses_transaction_control_behind_a_transaction_pooler_setting()
 {
    every_entry_point(Pooler::Transaction, false).await;
}

/// A stream dropped after its first row, whose statement fails on a later row: the handler
/// never sees the error (the wrapper's `failed` stays false) and returns `Ok`. The error
/// surfaces at pgbox's next statement or at COMMIT: never `Processed` over nothing.
#[tokio::test]
async fn a_stream_dropped_before_its_error_is_never_processed_over_nothing() {
    let db = setup().await;
    for store in [false, true] {
        let inbox = Inbox::builder(CONSUMER)
            .store_outcomes(store)
            .build()
            .unwrap();
        let key = format!("dropped-stream-{store}");
        let first = inbox
            .process_and_commit(
                &db.pool,
                key.as_str(),
                async |conn: &mut HandlerConnection<'_>| {
                    effect(conn, &key).await?;
                    {
                        let mut rows = sqlx::query_scalar::<_, i32>(
                            "SELECT 1/(3 - n) FROM generate_series(1, 5) AS n",
                        )
                        .fetch(&mut *conn);
                        let _first = rows.next().await;
                    }
                    Ok::<_, anyhow::Error>(Some(1))
                },
            )
            .await;
        let first = first.map(|o| match o {
            Outcome::Processed(_) => Outcome::Processed(()),
            Outcome::Duplicate(d) => Outcome::Duplicate(d),
            Outcome::Rejected(r) => Outcome::Rejected(r),
            Outcome::InProgress => Outcome::InProgress,
        });
        check_exactly_once(
            &db.pool,
            &inbox,
            &key,
            &format!("dropped stream, store {store}"),
            &first,
        )
        .await;
    }
}

/// Savepoints the handler takes and rolls back to itself, and RELEASE of sqlx's nested
/// unit's savepoint from inside it: the message's transaction goes on, the outcome is right.
#[tokio::test]
async fn savepoint_games_of_the_handlers_own_stay_inside_the_transaction() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "savepoints";
    let first = inbox
        .process_and_commit(&db.pool, key, async |conn: &mut HandlerConnection<'_>| {
            conn.execute("SAVEPOINT a").await?;
            conn.execute("INSERT INTO effects VALUES ('undone')")
                .await?;
            conn.execute("ROLLBACK TO SAVEPOINT a").await?;
            conn.execute("RELEASE SAVEPOINT a").await?;
            // Release the nested unit's savepoint under it, then let the unit commit.
            let mut unit = conn.begin().await?;
            let _ = unit.execute("RELEASE SAVEPOINT _sqlx_savepoint_1").await;
            let _ = unit.commit().await;
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(())
        })
        .await;
    assert_eq!(effects(&db.pool, "undone").await, 0);
    check_exactly_once(&db.pool, &inbox, key, "savepoint games", &first).await;
}

/// Transaction control inside a nested unit (the raw connection), the handler ignoring what
/// its unit's `commit()` says: nothing commits and the call is not `Processed` (held), but
/// the promised `TransactionEndedInHandler` comes back as an unrelated database error (the
/// dropped unit's queued `ROLLBACK TO SAVEPOINT`, refused outside a transaction block, 25P01).
#[tokio::test]
async fn a_rollback_inside_a_nested_unit_is_reported_as_transaction_ended() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "rollback-in-unit";
    let first = inbox
        .process_and_commit(&db.pool, key, async |conn: &mut HandlerConnection<'_>| {
            let mut unit = conn.begin().await?;
            let _ = unit.execute("ROLLBACK").await;
            if let Err(e) = unit.commit().await {
                eprintln!("the unit's commit: {e}");
            }
            Ok::<_, anyhow::Error>(())
        })
        .await;
    eprintln!("{first:?}");
    assert!(
        !matches!(first, Ok(Outcome::Processed(()))),
        "Processed: {first:?}"
    );
    assert_eq!(records(&db.pool, key).await, 0);
    let ended = first
        .as_ref()
        .err()
        .and_then(|e| e.downcast_ref::<Error>())
        .map(|e| {
            matches!(
                e,
                Error::TransactionEndedInHandler | Error::TransactionAbortedInHandler
            )
        });
    assert_eq!(ended, Some(true), "reported as {first:?}");
}
