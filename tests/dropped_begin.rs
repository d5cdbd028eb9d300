//! `process_and_commit` dropped at any point, the round trip of its `BEGIN` included, leaves no
//! transaction open on a pooled connection (issue 34, defect 13). Request futures are dropped
//! all the time (a client that hangs up, `select!`, a timeout): whoever takes the connection
//! next must find it in autocommit.

mod support;

use std::time::Duration;

use pgbox::{Error, Inbox, Outcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgConnection, PgPool};
use support::TestDb;

async fn setup() -> TestDb {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    db
}

async fn pool_of(db: &TestDb, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone())
        .await
        .unwrap()
}

/// A seed from the environment (`PGBOX_TEST_SEED`) to replay a run, else a fresh one, printed.
fn rng() -> StdRng {
    let seed = std::env::var("PGBOX_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("PGBOX_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// A budget of 0–3 ms. A zero budget polls the call once: far enough to send its `BEGIN`
/// when the pool has a connection ready, not far enough to read the answer.
fn budget(rng: &mut StdRng) -> Duration {
    if rng.random_bool(0.3) {
        Duration::ZERO
    } else {
        Duration::from_micros(rng.random_range(0..=3_000))
    }
}

/// Whether the server session behind `conn` is inside a transaction block: `SAVEPOINT` is
/// refused outside one (25P01) and accepted inside one (an aborted one refuses it with 25P02).
async fn in_transaction(conn: &mut PgConnection) -> bool {
    match sqlx::raw_sql("SAVEPOINT pgbox_probe")
        .execute(&mut *conn)
        .await
    {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P01") => false,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => true,
        Ok(_) => true,
        Err(e) => panic!("probe failed: {e}"),
    }
}

/// The connection the pool lends next is outside any transaction.
async fn assert_lends_autocommit(pool: &PgPool, context: &str) {
    let mut conn = pool.acquire().await.unwrap();
    assert!(
        !in_transaction(&mut conn).await,
        "{context}: the pool lent a connection inside a transaction nobody will end"
    );
}

/// Every connection of `pool` (all `size` of them, held at once so that none is in flight
/// back to the pool) is outside any transaction, and the server has no session of this
/// database idle in a transaction.
async fn assert_every_connection_in_autocommit(db: &TestDb, pool: &PgPool, size: u32) {
    let mut held = Vec::new();
    for _ in 0..size {
        held.push(pool.acquire().await.unwrap());
    }
    let mut open = 0;
    for conn in &mut held {
        if in_transaction(conn).await {
            open += 1;
        }
    }
    let mut observer = db.connect().await;
    let idle_in_transaction: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_stat_activity \
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&mut observer)
    .await
    .unwrap();
    assert_eq!(
        (open, idle_in_transaction),
        (0, 0),
        "pooled connections inside a transaction (probed, seen by the server)"
    );
}

/// Each key that has an inbox record has exactly one effect, and each key without one has none.
async fn assert_exactly_once(pool: &PgPool) {
    let wrong: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT k.key, \
                (SELECT count(*) FROM pgbox.inbox i WHERE i.key = k.key), \
                (SELECT count(*) FROM effects e WHERE e.key = k.key) \
         FROM (SELECT key FROM pgbox.inbox UNION SELECT key FROM effects) k \
         WHERE (SELECT count(*) FROM pgbox.inbox i WHERE i.key = k.key) \
            <> (SELECT count(*) FROM effects e WHERE e.key = k.key)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(wrong.is_empty(), "(key, inbox rows, effects): {wrong:?}");
}

#[derive(Debug, Default)]
struct Tally {
    dropped: u32,
    processed: u32,
    duplicates: u32,
}

/// One call with `budget`, against `pool`.
async fn call(inbox: &Inbox, pool: &PgPool, key: &str, budget: Duration, tally: &mut Tally) {
    let call = inbox.process_and_commit(pool, key, async |conn| {
        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
            .bind(key)
            .execute(&mut *conn)
            .await?;
        Ok::<_, Error>(())
    });
    match tokio::time::timeout(budget, call).await {
        Err(_) => tally.dropped += 1,
        Ok(Ok(Outcome::Processed(()))) => tally.processed += 1,
        Ok(Ok(Outcome::Duplicate(_))) => tally.duplicates += 1,
        Ok(other) => panic!("{key}: {other:?}"),
    }
}

#[tokio::test]
async fn a_call_dropped_at_random_never_leaves_a_transaction_on_a_one_connection_pool() {
    let db = setup().await;
    let pool = pool_of(&db, 1).await;
    let inbox = Inbox::new("points").unwrap();
    let mut rng = rng();
    let mut tally = Tally::default();
    for i in 0..1_500 {
        let key = format!("k-{}", i % 500);
        call(&inbox, &pool, &key, budget(&mut rng), &mut tally).await;
        assert_lends_autocommit(&pool, &format!("after call {i} ({tally:?})")).await;
    }
    eprintln!("{tally:?}");
    assert!(tally.dropped > 0 && tally.processed > 0, "{tally:?}");
    assert_every_connection_in_autocommit(&db, &pool, 1).await;
    assert_exactly_once(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_dropped_at_random_under_load_leave_every_pooled_connection_in_autocommit() {
    const CONNECTIONS: u32 = 4;
    const CALLERS: u64 = 8;
    const CALLS: u32 = 200;
    let db = setup().await;
    let pool = pool_of(&db, CONNECTIONS).await;
    let inbox = Inbox::new("points").unwrap();
    let seed: u64 = rng().random();
    let callers = (0..CALLERS).map(|caller| {
        let (inbox, pool) = (inbox.clone(), pool.clone());
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed ^ caller);
            let mut tally = Tally::default();
            for i in 0..CALLS {
                // Keys shared between callers: duplicates and waits on each other's claims.
                let key = format!("k-{}", rng.random_range(0..400));
                call(&inbox, &pool, &key, budget(&mut rng), &mut tally).await;
                assert_lends_autocommit(&pool, &format!("caller {caller}, call {i}")).await;
            }
            tally
        })
    });
    for tally in futures_util::future::join_all(callers).await {
        let tally = tally.unwrap();
        eprintln!("{tally:?}");
        assert!(tally.dropped > 0, "{tally:?}");
    }
    assert_every_connection_in_autocommit(&db, &pool, CONNECTIONS).await;
    assert_exactly_once(&db.pool).await;
}

/// A connection the caller holds (`&mut PgConnection`): once the call has returned, `Ok` or
/// `Err`, its transaction is over; a call dropped before it returned may leave one, and the
/// documented answer (close that connection instead of returning it) keeps the pool clean.
#[tokio::test]
async fn on_a_held_connection_a_finished_call_ends_its_transaction_and_a_dropped_one_is_closed() {
    let db = setup().await;
    let pool = pool_of(&db, 1).await;
    let inbox = Inbox::new("points").unwrap();
    let mut rng = rng();
    let mut tally = Tally::default();
    for i in 0..300 {
        let key = format!("k-{}", i % 100);
        let mut conn = pool.acquire().await.unwrap();
        let call = inbox.process_and_commit(&mut *conn, key.as_str(), async |c| {
            sqlx::query("INSERT INTO effects (key) VALUES ($1)")
                .bind(&key)
                .execute(&mut *c)
                .await?;
            Ok::<_, Error>(())
        });
        match tokio::time::timeout(budget(&mut rng), call).await {
            Err(_) => {
                tally.dropped += 1;
                conn.close_on_drop();
            }
            Ok(outcome) => {
                match outcome.unwrap() {
                    Outcome::Processed(()) => tally.processed += 1,
                    Outcome::Duplicate(_) => tally.duplicates += 1,
                    other => panic!("{key}: {other:?}"),
                }
                assert!(
                    !in_transaction(&mut conn).await,
                    "call {i}: returned with its transaction open on the caller's connection"
                );
            }
        }
        drop(conn);
        assert_lends_autocommit(&pool, &format!("after call {i} ({tally:?})")).await;
    }
    eprintln!("{tally:?}");
    assert!(tally.dropped > 0 && tally.processed > 0, "{tally:?}");
    assert_every_connection_in_autocommit(&db, &pool, 1).await;
    assert_exactly_once(&db.pool).await;
}

/// `claim_batch` opens a savepoint on the caller's transaction. Dropped while its `SAVEPOINT`
/// awaited the server, sqlx 0.9.0's savepoint guard queued a top-level `ROLLBACK` and forgot
/// the caller's transaction, whose `commit()` then answered `Ok` having committed nothing.
/// A `commit()` that answers `Ok` has committed what the caller wrote.
#[tokio::test]
async fn a_commit_after_a_dropped_claim_batch_is_never_ok_for_nothing() {
    let db = setup().await;
    let inbox = Inbox::new("points").unwrap();
    let mut rng = rng();
    let (mut dropped, mut lost) = (0, Vec::new());
    for i in 0..1_000 {
        let mut tx = db.pool.begin().await.unwrap();
        let mine = format!("mine-{i}");
        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
            .bind(&mine)
            .execute(&mut *tx)
            .await
            .unwrap();
        let keys = [format!("a-{i}"), format!("b-{i}")];
        let claim = inbox.claim_batch(&mut tx, keys.iter().map(String::as_str));
        if tokio::time::timeout(budget(&mut rng), claim).await.is_ok() {
            continue;
        }
        dropped += 1;
        let committed = tx.commit().await;
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
            .bind(&mine)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if committed.is_ok() && rows != 1 {
            lost.push(i);
        }
    }
    assert!(dropped > 0);
    assert!(
        lost.is_empty(),
        "commit() answered Ok and committed nothing after calls {lost:?} ({dropped} dropped)"
    );
}
