//! sqlx's transaction depth against the claim's level (issue 34, defect 6's class): a
//! nested unit whose `begin` fails or is given up rolls the claim's level back, a nested unit
//! left open turns the caller's commit into a `RELEASE`, and a `ROLLBACK TO` a savepoint older
//! than the claim undoes it. None of them may ever be reported `Processed`, on any entry point
//! that runs a handler, and nothing the handler sends afterwards may commit on its own.

mod support;

use pgbox::{Error, HandlerConnection, Inbox, Message, Outbox, Outcome, Sequenced};
use sqlx::{Connection, Executor, PgPool};
use support::TestDb;

const CONSUMER: &str = "depth";

async fn setup() -> TestDb {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    db
}

async fn count(pool: &PgPool, sql: &str, key: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn effects(pool: &PgPool, key: &str) -> i64 {
    count(pool, "SELECT count(*) FROM effects WHERE key = $1", key).await
}

async fn records(pool: &PgPool, key: &str) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM pgbox.inbox WHERE consumer = 'depth' AND key = $1",
        key,
    )
    .await
}

async fn effect(conn: &mut sqlx::PgConnection, key: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO effects (key) VALUES ($1)")
        .bind(key)
        .execute(conn)
        .await
        .map(drop)
}

fn ended<T: std::fmt::Debug>(result: &anyhow::Result<T>) -> bool {
    matches!(
        result
            .as_ref()
            .err()
            .and_then(|e| e.downcast_ref::<Error>()),
        Some(Error::TransactionEndedInHandler)
    )
}

/// `process` on the caller's transaction, a handler that leaks a nested unit and writes in
/// it: the caller's `commit()` would only release the savepoint. Not `Processed`, and the
/// caller's transaction is left at its own level (its commit commits nothing of the handler).
#[tokio::test]
async fn a_leaked_nested_unit_under_process_is_transaction_ended_and_commits_nothing() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "leaked-process";
    let mut tx = db.pool.begin().await.unwrap();
    let first = inbox
        .process(&mut tx, key, async |conn: &mut HandlerConnection<'_>| {
            std::mem::forget(conn.begin().await?);
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(())
        })
        .await;
    eprintln!("{first:?}");
    assert!(ended(&first), "{first:?}");
    // A caller that commits anyway: the transaction was aborted, nothing commits.
    let committed = tx.commit().await;
    eprintln!("the caller's commit: {committed:?}");
    assert_eq!(
        (effects(&db.pool, key).await, records(&db.pool, key).await),
        (0, 0)
    );
}

/// A nested unit left open with a stored outcome: the outcome's UPDATE succeeds inside the
/// savepoint, and only sqlx's depth tells. Not `Processed`.
#[tokio::test]
async fn a_leaked_nested_unit_with_a_stored_outcome_is_never_processed() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "leaked-outcome";
    let first = inbox
        .process_and_commit(&db.pool, key, async |conn: &mut HandlerConnection<'_>| {
            std::mem::forget(conn.begin().await?);
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(42)
        })
        .await;
    eprintln!("{first:?}");
    assert!(ended(&first), "{first:?}");
    assert_eq!(
        (effects(&db.pool, key).await, records(&db.pool, key).await),
        (0, 0)
    );
}

/// `ROLLBACK TO` the savepoint that holds the claim, through the wrapper in its other
/// spellings, with a stored outcome (its UPDATE is the check) and without: never `Processed`.
#[tokio::test]
async fn rollback_to_a_savepoint_older_than_the_claim_is_caught_in_every_spelling() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    for (i, sql) in [
        "ROLLBACK WORK TO _sqlx_savepoint_1",
        "/* undo */ rollback transaction to savepoint \"_sqlx_savepoint_1\"",
    ]
    .into_iter()
    .enumerate()
    {
        for stored in [true, false] {
            let key = format!("rollback-to-{i}-{stored}");
            let mut tx = db.pool.begin().await.unwrap();
            let mut unit = tx.begin().await.unwrap();
            let first = inbox
                .process(
                    &mut unit,
                    key.as_str(),
                    async |conn: &mut HandlerConnection<'_>| {
                        conn.execute(sql).await?;
                        effect(conn, &key).await?;
                        Ok::<_, anyhow::Error>(stored.then_some(7))
                    },
                )
                .await;
            eprintln!("{sql:?}, stored {stored}: {first:?}");
            assert!(ended(&first), "{sql:?}, stored {stored}: {first:?}");
            drop(unit);
            drop(tx);
            assert_eq!(effects(&db.pool, &key).await, 0);
        }
    }
}

/// A `ROLLBACK TO` of the handler's own savepoint costs one check and passes it.
#[tokio::test]
async fn rollback_to_the_handlers_own_savepoint_is_processed() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "own-savepoint";
    let first = inbox
        .process_and_commit(&db.pool, key, async |conn: &mut HandlerConnection<'_>| {
            conn.execute("SAVEPOINT mine").await?;
            conn.execute("INSERT INTO effects VALUES ('undone')")
                .await?;
            conn.execute("rollback work to mine").await?;
            effect(conn, key).await?;
            Ok::<_, anyhow::Error>(())
        })
        .await;
    assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
    assert_eq!(effects(&db.pool, "undone").await, 0);
    assert_eq!(
        (effects(&db.pool, key).await, records(&db.pool, key).await),
        (1, 1)
    );
}

/// In-order processing: a swallowed failure, a refused nested begin, then a write. The
/// watermark does not move, nothing commits, the call is not `Processed`.
#[tokio::test]
async fn a_refused_nested_begin_in_order_never_advances_the_watermark() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "in-order";
    let mut tx = db.pool.begin().await.unwrap();
    let first = inbox
        .process_in_order(&mut tx, key, 1, async |conn: &mut HandlerConnection<'_>| {
            let _ = conn.execute("SELECT 1/0").await;
            if let Ok(unit) = conn.begin().await {
                unit.commit().await?;
            }
            let sent = sqlx::query("INSERT INTO effects (key) VALUES ($1)")
                .bind(key)
                .execute(&mut *conn)
                .await;
            eprintln!("the write after the refused begin: {sent:?}");
            Ok::<_, anyhow::Error>(())
        })
        .await;
    eprintln!("{first:?}");
    assert!(
        !matches!(first, Ok(Sequenced::Processed { .. })),
        "{first:?}"
    );
    let _ = tx.commit().await;
    assert_eq!(effects(&db.pool, key).await, 0);
    let advanced = count(
        &db.pool,
        "SELECT count(*) FROM pgbox.sequence_watermarks WHERE entity = $1 AND last_seq > 0",
        key,
    )
    .await;
    assert_eq!(advanced, 0);
}

/// A nested begin refused, then a row helper on the handler's connection
/// ([`VersionedTable`](pgbox::VersionedTable), which goes through `ConnectionLike`): its
/// UPDATE is refused before it is sent, never committed on its own.
#[tokio::test]
async fn a_row_helper_after_a_refused_nested_begin_never_commits_on_its_own() {
    let db = setup().await;
    db.pool
        .execute(
            "CREATE TABLE accounts (id bigint PRIMARY KEY, version bigint NOT NULL, balance bigint NOT NULL);
             INSERT INTO accounts VALUES (7, 1, 0)",
        )
        .await
        .unwrap();
    let accounts = pgbox::VersionedTable::new("accounts").unwrap();
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let key = "helper-after";
    let first = inbox
        .process_and_commit(&db.pool, key, async |conn: &mut HandlerConnection<'_>| {
            let _ = conn.execute("SELECT 1/0").await;
            if let Ok(unit) = conn.begin().await {
                unit.commit().await?;
            }
            let updated = accounts
                .update(7_i64, 1)
                .set("balance", 100_i64)
                .execute(conn)
                .await;
            eprintln!("the helper's update after the refused begin: {updated:?}");
            Ok::<_, anyhow::Error>(())
        })
        .await;
    eprintln!("{first:?}");
    assert!(!matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 7")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(balance, 0, "the helper's UPDATE committed on its own");
}

/// A nested begin given up mid-flight, then an outbox enqueue through the handler's
/// connection (pgbox's own statement on the handler's behalf): the message must not commit
/// on its own.
#[tokio::test]
async fn an_outbox_enqueue_after_a_given_up_nested_begin_never_commits_on_its_own() {
    let db = setup().await;
    let inbox = Inbox::builder(CONSUMER).build().unwrap();
    let outbox = Outbox::new();
    let key = "enqueue-after";
    let first = inbox
        .process_and_commit(&db.pool, key, async |conn: &mut HandlerConnection<'_>| {
            let _ = conn.execute("SELECT 1/0").await;
            if let Ok(unit) = conn.begin().await {
                unit.commit().await?;
            }
            let sent = outbox
                .enqueue(conn, Message::bytes("t", b"x".as_slice()))
                .await;
            eprintln!("the enqueue after the refused begin: {sent:?}");
            Ok::<_, anyhow::Error>(())
        })
        .await;
    eprintln!("{first:?}");
    assert!(!matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
    let messages: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(messages, 0, "the outbox message committed on its own");
}
