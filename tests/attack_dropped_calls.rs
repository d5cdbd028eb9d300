//! Attack on issue 34, defect 13 (commit 331ef2e): every public entry point that begins a
//! transaction on something the caller gave (a pool, a connection), dropped at random times
//! and at named points (during BEGIN, during the claim, during the handler, during COMMIT),
//! must leave every pooled connection outside any transaction and must commit nothing
//! half-way.
//!
//! The promise, as written before reading the code:
//! - `Inbox::process_and_commit` rustdoc, "Dropped before it finishes": given a pool, dropped
//!   at any point, the transaction rolls back and the connection goes back to the pool
//!   outside any transaction, also when the drop comes while `BEGIN` awaits its answer.
//!   `process_with_retry` and the `Consumer` begin the same way.
//! - README "A begin dropped mid-flight": every transaction pgbox begins on a pool itself
//!   (the Consumer, process_with_retry, the queue, the relay, the Idempotency-Key layer)
//!   takes its connection first and sends its BEGIN from a task of its own.
//! - README "process is not cancel-safe": Consumer, process_and_commit, process_with_retry
//!   own their transactions and are safe.
//! - Lease calls: "No transaction or connection is held after it returns."
//! - Janitor::run_once: "Cancel-safe: if this future is dropped mid-unit, the next call
//!   discards the lock connection".
//!
//! Named points are reached deterministically: a TCP proxy in front of the server that can
//! hold the server's answers (so a call is dropped after its `BEGIN` went out and before the
//! answer came back), a blocking claim (a second transaction holding the key), a handler
//! that never finishes, and a deferred constraint trigger that waits on an advisory lock at
//! COMMIT.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgbox::{Error, Inbox, Outcome, Pooler};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgConnection, PgPool};
use support::TestDb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

// ---------------------------------------------------------------------------------------------
// A proxy that can hold the server's answers.
// ---------------------------------------------------------------------------------------------

/// A TCP proxy to the test server. While [`held`](HoldProxy::hold), bytes from the server are
/// kept back (the client waits for its answer); bytes from the client go through, and are
/// counted, so a test knows a statement went out.
struct HoldProxy {
    addr: std::net::SocketAddr,
    hold: watch::Sender<bool>,
    sent: Arc<AtomicUsize>,
    /// When set, the next client chunk containing these bytes turns the hold on before it is
    /// forwarded (so its answer is held), and counts in `triggered`.
    armed: Arc<std::sync::Mutex<Option<Vec<u8>>>>,
    triggered: Arc<AtomicUsize>,
    accept: tokio::task::AbortHandle,
}

impl HoldProxy {
    async fn start(target: std::net::SocketAddr) -> HoldProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (hold, _) = watch::channel(false);
        let sent = Arc::new(AtomicUsize::new(0));
        let armed: Arc<std::sync::Mutex<Option<Vec<u8>>>> = Arc::default();
        let triggered = Arc::new(AtomicUsize::new(0));
        let (hold2, sent2) = (hold.clone(), sent.clone());
        let (armed2, triggered2) = (armed.clone(), triggered.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let sent = sent2.clone();
                let (armed, triggered, hold) = (armed2.clone(), triggered2.clone(), hold2.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        {
                            let mut armed = armed.lock().unwrap();
                            // A simple-protocol Query message ('Q', a 4-byte length) whose
                            // text starts with the pattern.
                            let hit = armed.as_ref().is_some_and(|p| {
                                buf[..n]
                                    .windows(p.len() + 5)
                                    .any(|w| w[0] == b'Q' && &w[5..] == p.as_slice())
                            });
                            if hit {
                                *armed = None;
                                hold.send_replace(true);
                                triggered.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        if sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        sent.fetch_add(n, Ordering::SeqCst);
                    }
                    let _ = sw.shutdown().await;
                });
                let mut held = hold2.subscribe();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if held.wait_for(|h| !*h).await.is_err() {
                            break;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = cw.shutdown().await;
                });
            }
        })
        .abort_handle();
        HoldProxy {
            addr,
            hold,
            sent,
            armed,
            triggered,
            accept,
        }
    }

    fn arm(&self, pattern: Option<&[u8]>) {
        *self.armed.lock().unwrap() = pattern.map(<[u8]>::to_vec);
    }

    fn triggered(&self) -> usize {
        self.triggered.load(Ordering::SeqCst)
    }

    fn hold(&self, on: bool) {
        self.hold.send_replace(on);
    }

    fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }

    /// Options of `db` through this proxy.
    fn options(&self, db: &TestDb) -> PgConnectOptions {
        db.options.clone().host("127.0.0.1").port(self.addr.port())
    }
}

impl Drop for HoldProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn server_addr(db: &TestDb) -> std::net::SocketAddr {
    use std::net::ToSocketAddrs;
    let host = db.options.get_host().to_owned();
    let port = db.options.get_port();
    (host.as_str(), port)
        .to_socket_addrs()
        .unwrap()
        .find(|a| a.is_ipv4())
        .unwrap()
}

/// Runs `call` until the proxy has seen the client send something after `before` bytes
/// (the statement that is now waiting for its held answer), then drops it. Bounded: 10 s.
async fn drop_once_sent<F: std::future::Future>(proxy: &HoldProxy, before: usize, call: F) -> bool {
    let sent = async {
        for _ in 0..10_000 {
            if proxy.sent() > before {
                // Let the statement reach the server.
                tokio::time::sleep(Duration::from_millis(20)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("the call sent nothing within 10 s");
    };
    tokio::select! {
        biased;
        _ = call => false,
        _ = sent => true,
    }
}

/// Runs `call` until the client sends `pattern` (e.g. `BEGIN`, `COMMIT`), holds the answer to
/// it, and drops the call then. Returns `None` if the call finished without sending it (its
/// output), `Some(())` if it was dropped at that point. The hold is lifted before returning.
async fn drop_at<F: std::future::Future>(
    proxy: &HoldProxy,
    pattern: &[u8],
    call: F,
) -> Result<(), F::Output> {
    let before = proxy.triggered();
    proxy.arm(Some(pattern));
    let reached = async {
        for _ in 0..10_000 {
            if proxy.triggered() > before {
                tokio::time::sleep(Duration::from_millis(20)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("the call neither finished nor sent {pattern:?} within 10 s");
    };
    let result = tokio::select! {
        biased;
        out = call => Err(out),
        _ = reached => Ok(()),
    };
    proxy.arm(None);
    proxy.hold(false);
    result
}

// ---------------------------------------------------------------------------------------------
// Checks.
// ---------------------------------------------------------------------------------------------

/// A seed from the environment (`PGBOX_TEST_SEED`) to replay a run, else a fresh one, printed.
fn rng() -> StdRng {
    let seed = std::env::var("PGBOX_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("PGBOX_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// 0–5 ms; a third of the time zero (one poll).
fn budget(rng: &mut StdRng) -> Duration {
    if rng.random_bool(0.3) {
        Duration::ZERO
    } else {
        Duration::from_micros(rng.random_range(0..=5_000))
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

/// Second probe, the one the brief names: outside an explicit transaction, `now()` is the
/// statement's own timestamp (in the simple protocol: the extended one stamps each of its
/// messages, so the two differ even in autocommit).
async fn now_is_statement_time(conn: &mut PgConnection) -> bool {
    use sqlx::Row;
    sqlx::raw_sql("SELECT now() = statement_timestamp()")
        .fetch_one(&mut *conn)
        .await
        .unwrap()
        .get::<bool, _>(0)
}

/// Every connection of `pool` (all `size`, held at once so none is in flight back to the
/// pool) is outside any transaction, and the server has no session of this database idle in
/// a transaction. Returns a description of what is wrong, if anything.
async fn open_transactions(db: &TestDb, pool: &PgPool, size: u32) -> Option<String> {
    let mut held = Vec::new();
    for _ in 0..size {
        held.push(pool.acquire().await.unwrap());
    }
    let mut open = 0;
    for conn in &mut held {
        // `now()` first: the SAVEPOINT probe would otherwise start nothing, but keep order.
        let stale_now = !now_is_statement_time(conn).await;
        if in_transaction(conn).await || stale_now {
            open += 1;
        }
    }
    let mut observer = db.connect().await;
    let idle: Vec<(String, String)> = sqlx::query_as(
        "SELECT state, query FROM pg_catalog.pg_stat_activity \
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_all(&mut observer)
    .await
    .unwrap();
    drop(held);
    (open != 0 || !idle.is_empty()).then(|| {
        format!("{open} of {size} pooled connection(s) inside a transaction; sessions idle in transaction: {idle:?}")
    })
}

async fn assert_clean(db: &TestDb, pool: &PgPool, size: u32, context: &str) {
    if let Some(wrong) = open_transactions(db, pool, size).await {
        panic!("{context}: {wrong}");
    }
    all_idle(pool, size).await;
}

/// Waits (bounded, 10 s) until all `size` connections are back in the pool: their return
/// (a ping) must not race with a held proxy.
async fn all_idle(pool: &PgPool, size: u32) {
    for _ in 0..10_000 {
        // Every open connection is idle (a pool that closed one has fewer than `size`).
        if pool.num_idle() as u32 >= pool.size().min(size) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!(
        "the pool's connections did not come back within 10 s: {} idle of {} open",
        pool.num_idle(),
        pool.size()
    );
}

/// Each key that has an inbox record (consumer `points`) has exactly one effect, and each key without one has none.
async fn assert_exactly_once(pool: &PgPool) {
    let wrong: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT k.key, \
                (SELECT count(*) FROM pgbox.inbox i WHERE i.key = k.key AND i.consumer = 'points'), \
                (SELECT count(*) FROM effects e WHERE e.key = k.key) \
         FROM (SELECT key FROM pgbox.inbox WHERE consumer = 'points' UNION SELECT key FROM effects) k \
         WHERE (SELECT count(*) FROM pgbox.inbox i WHERE i.key = k.key AND i.consumer = 'points') \
            <> (SELECT count(*) FROM effects e WHERE e.key = k.key)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(wrong.is_empty(), "(key, inbox rows, effects): {wrong:?}");
}

async fn setup() -> TestDb {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    db
}

fn options(size: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
}

/// A pool with every hook set, and no test before acquire: what the brief calls "a pool with
/// after_connect/before_acquire hooks and test_before_acquire(false)".
async fn hooked_pool(opts: PgConnectOptions, size: u32) -> PgPool {
    options(size)
        .test_before_acquire(false)
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                conn.execute("SET application_name = 'attack_dropped_calls'")
                    .await?;
                Ok(())
            })
        })
        .before_acquire(|_conn, _meta| Box::pin(async move { Ok(true) }))
        .after_release(|_conn, _meta| Box::pin(async move { Ok(true) }))
        .connect_with(opts)
        .await
        .unwrap()
}

async fn effect(conn: &mut pgbox::HandlerConnection<'_>, key: &str) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (key) VALUES ($1)")
        .bind(key)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Named points, deterministic.
// ---------------------------------------------------------------------------------------------

/// process_and_commit given a pool (one connection, all hooks, no test before acquire),
/// dropped while its `BEGIN` is on the wire and the answer is held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_and_commit_on_a_hooked_pool_dropped_during_begin_leaves_the_pool_clean() {
    let db = setup().await;
    let proxy = HoldProxy::start(server_addr(&db)).await;
    let pool = hooked_pool(proxy.options(&db), 1).await;
    let inbox = Inbox::new("points").unwrap();
    for round in 0..20 {
        // Warm: the pool has its connection idle, so the first bytes sent are the BEGIN.
        assert_clean(&db, &pool, 1, "warm-up").await;
        proxy.hold(true);
        let before = proxy.sent();
        let key = format!("k-{round}");
        let dropped = drop_once_sent(
            &proxy,
            before,
            inbox.process_and_commit(&pool, key.as_str(), async |c| effect(c, &key).await),
        )
        .await;
        proxy.hold(false);
        assert!(
            dropped,
            "round {round}: the call finished with its answers held"
        );
        assert_clean(
            &db,
            &pool,
            1,
            &format!("round {round}, dropped during BEGIN"),
        )
        .await;
    }
    assert_exactly_once(&db.pool).await;
}

/// Outbox `DeadLetters::replay` begins a transaction on the pool it was given. Dropped while
/// its `BEGIN` is on the wire (an operator endpoint whose client hung up, a timeout around
/// it), the pool must not lend that connection on inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_dead_letters_replay_dropped_during_begin_leaves_no_pooled_connection_in_a_transaction()
 {
    let db = setup().await;
    let proxy = HoldProxy::start(server_addr(&db)).await;
    let pool = options(1)
        .test_before_acquire(false)
        .connect_with(proxy.options(&db))
        .await
        .unwrap();
    let dead_letters = pgbox::DeadLetters::new(pool.clone());
    assert_clean(&db, &pool, 1, "warm-up").await;
    proxy.hold(true);
    let before = proxy.sent();
    let ids = [uuid::Uuid::now_v7()];
    let dropped = drop_once_sent(&proxy, before, dead_letters.replay(&ids)).await;
    proxy.hold(false);
    assert!(dropped, "replay finished with its answers held");
    // The next borrower's autocommit write.
    sqlx::query("INSERT INTO effects (key) VALUES ('after-replay')")
        .execute(&pool)
        .await
        .unwrap();
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = 'after-replay'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let wrong = open_transactions(&db, &pool, 1).await;
    assert!(
        wrong.is_none() && seen == 1,
        "after a replay dropped during BEGIN: {wrong:?}; the next borrower's autocommit INSERT \
         committed (visible to another session): {}",
        seen == 1
    );
}

/// Dropped while its claim waits for another transaction holding the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_and_commit_dropped_during_a_blocked_claim_leaves_the_pool_clean() {
    let db = setup().await;
    for size in [1u32, 4] {
        let pool = hooked_pool(db.options.clone(), size).await;
        let inbox = Inbox::new("points").unwrap();
        for round in 0..5 {
            let key = format!("blocked-{size}-{round}");
            // The blocker claims the key and holds its transaction open.
            let mut blocker = db.pool.begin().await.unwrap();
            let k = key.clone();
            let _ = inbox
                .process(&mut blocker, key.as_str(), async |c| effect(c, &k).await)
                .await
                .unwrap();
            let k = key.clone();
            let call = inbox.process_and_commit(&pool, key.as_str(), async |c| effect(c, &k).await);
            let dropped = tokio::select! {
                biased;
                _ = call => false,
                _ = support::wait_for_lock_waiter(&db.pool) => true,
            };
            assert!(dropped, "the claim did not wait for the blocker");
            // Half the rounds the blocker commits (the dropped call would be a duplicate),
            // half it rolls back (the dropped call would have claimed).
            if round % 2 == 0 {
                blocker.commit().await.unwrap();
            } else {
                blocker.rollback().await.unwrap();
            }
            assert_clean(&db, &pool, size, &format!("size {size} round {round}")).await;
            // And the key is still processable exactly once.
            let k = key.clone();
            let _ = inbox
                .process_and_commit(&pool, key.as_str(), async |c| effect(c, &k).await)
                .await
                .unwrap();
        }
        assert_exactly_once(&db.pool).await;
    }
}

/// Dropped while the handler runs (after its first write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_and_commit_dropped_mid_handler_commits_nothing_and_leaves_the_pool_clean() {
    let db = setup().await;
    for size in [1u32, 4] {
        let pool = hooked_pool(db.options.clone(), size).await;
        let inbox = Inbox::new("points").unwrap();
        for round in 0..5 {
            let key = format!("mid-{size}-{round}");
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let tx = std::sync::Mutex::new(Some(tx));
            let k = key.clone();
            let call = inbox.process_and_commit(&pool, key.as_str(), async |c| {
                effect(c, &k).await?;
                if let Some(tx) = tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                std::future::pending::<()>().await;
                Ok::<_, Error>(())
            });
            let dropped = tokio::select! {
                biased;
                _ = call => false,
                _ = rx => true,
            };
            assert!(dropped);
            assert_clean(&db, &pool, size, &format!("size {size} round {round}")).await;
            let n: i64 = sqlx::query_scalar(
                "SELECT (SELECT count(*) FROM effects WHERE key = $1) + \
                        (SELECT count(*) FROM pgbox.inbox WHERE key = $1)",
            )
            .bind(&key)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert_eq!(n, 0, "{key}: half a handler committed");
        }
    }
}

/// Dropped while its COMMIT waits (a deferred constraint trigger waits on an advisory lock
/// the test holds): the commit either happens whole or not at all, and the connection comes
/// back clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_and_commit_dropped_during_commit_is_all_or_nothing_and_leaves_the_pool_clean() {
    let db = setup().await;
    db.pool
        .execute(
            "CREATE FUNCTION wait_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NULL; END $$; \
             CREATE CONSTRAINT TRIGGER effects_wait AFTER INSERT ON effects \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION wait_at_commit();",
        )
        .await
        .unwrap();
    for size in [1u32, 4] {
        let pool = hooked_pool(db.options.clone(), size).await;
        let inbox = Inbox::new("points").unwrap();
        for round in 0..5 {
            let key = format!("commit-{size}-{round}");
            let mut gate = db.connect().await;
            sqlx::query("SELECT pg_advisory_lock(4242)")
                .execute(&mut gate)
                .await
                .unwrap();
            let k = key.clone();
            let call = inbox.process_and_commit(&pool, key.as_str(), async |c| effect(c, &k).await);
            // A session of this pool waits on the lock with COMMIT as its statement.
            let waiting = async {
                for _ in 0..10_000 {
                    let n: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_catalog.pg_stat_activity \
                         WHERE datname = current_database() AND wait_event_type = 'Lock' \
                           AND query ILIKE 'COMMIT%'",
                    )
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
                    if n > 0 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                panic!("no COMMIT waiting within 10 s");
            };
            let dropped = tokio::select! {
                biased;
                _ = call => false,
                _ = waiting => true,
            };
            assert!(dropped);
            sqlx::query("SELECT pg_advisory_unlock(4242)")
                .execute(&mut gate)
                .await
                .unwrap();
            assert_clean(&db, &pool, size, &format!("size {size} round {round}")).await;
            assert_exactly_once(&db.pool).await;
            // The call was dropped after COMMIT went out: a redelivery is a duplicate.
            let k = key.clone();
            let again = inbox
                .process_and_commit(&pool, key.as_str(), async |c| effect(c, &k).await)
                .await
                .unwrap();
            assert!(matches!(again, Outcome::Duplicate(_)), "{key}: {again:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Every other entry point that begins a transaction on the caller's pool, dropped during its
// BEGIN and during its COMMIT (the answer held back by the proxy), on a one-connection pool.
// ---------------------------------------------------------------------------------------------

struct Rig {
    db: TestDb,
    proxy: HoldProxy,
    pool: PgPool,
}

/// A database, a proxy, and a one-connection hooked pool through the proxy; `setting`, if
/// given, is run on each new connection (e.g. a default isolation level).
async fn rig(setting: Option<&'static str>) -> Rig {
    let db = setup().await;
    let proxy = HoldProxy::start(server_addr(&db)).await;
    let pool = options(1)
        .test_before_acquire(false)
        .after_connect(move |conn, _meta| {
            Box::pin(async move {
                conn.execute("SET application_name = 'attack_dropped_calls'")
                    .await?;
                if let Some(setting) = setting {
                    conn.execute(setting).await?;
                }
                Ok(())
            })
        })
        .before_acquire(|_conn, _meta| Box::pin(async move { Ok(true) }))
        .connect_with(proxy.options(&db))
        .await
        .unwrap();
    Rig { db, proxy, pool }
}

impl Rig {
    /// Drops `call` at `point`; then every pooled connection must be outside a transaction.
    /// Returns whether the call was dropped there (false: it finished without sending it).
    async fn drop_at<F: std::future::Future>(&self, point: &str, call: F, context: &str) -> bool
    where
        F::Output: std::fmt::Debug,
    {
        all_idle(&self.pool, 1).await;
        let dropped = match drop_at(&self.proxy, point.as_bytes(), call).await {
            Ok(()) => true,
            Err(out) => {
                eprintln!("{context}: finished without {point}: {out:?}");
                false
            }
        };
        assert_clean(
            &self.db,
            &self.pool,
            1,
            &format!("{context}, dropped during {point}"),
        )
        .await;
        dropped
    }
}

/// The statements' texts as sqlx sends them: a `BEGIN` (plain or with options) and the
/// top-level `COMMIT` (its text ends at the message's NUL).
const POINTS: [&str; 2] = ["BEGIN", "COMMIT\0"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_with_retry_dropped_during_begin_and_commit_leaves_the_pool_clean() {
    let r = rig(None).await;
    let inbox = Inbox::new("points").unwrap();
    let policy = pgbox::RetryPolicy::default();
    for point in POINTS {
        let name = point.trim_end_matches('\0');
        for round in 0..5 {
            let key = format!("retry-{name}-{round}");
            let k = key.as_str();
            let dropped = r
                .drop_at(
                    point,
                    inbox.process_with_retry(&r.pool, k, &policy, async |c| effect(c, k).await),
                    &key,
                )
                .await;
            assert!(dropped, "{key}");
            let again = inbox
                .process_with_retry(&r.pool, k, &policy, async |c| effect(c, k).await)
                .await
                .unwrap();
            match (point, &again) {
                ("BEGIN", Outcome::Processed(())) | ("COMMIT\0", Outcome::Duplicate(_)) => {}
                _ => panic!("{key}: {again:?}"),
            }
        }
    }
    assert_exactly_once(&r.db.pool).await;
}

/// Lease mode behind a transaction pooler setting (each lease call is a transaction of its
/// own): lease, complete, release, extend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_calls_dropped_during_begin_and_commit_leave_the_pool_clean() {
    let r = rig(None).await;
    let inbox = Inbox::builder("leases")
        .pooler(Pooler::Transaction)
        .build()
        .unwrap();
    let ttl = Duration::from_secs(60);
    for point in POINTS {
        let name = point.trim_end_matches('\0');
        let key = format!("lease-{name}");
        assert!(
            r.drop_at(point, inbox.lease(&r.pool, key.as_str(), ttl), &key)
                .await
        );
        // Dropped during BEGIN: nothing taken; during COMMIT: taken. Either way the state
        // reads back consistently.
        let attempt = inbox.lease(&r.pool, key.as_str(), ttl).await.unwrap();
        let mut lease = match (point, attempt) {
            ("BEGIN", pgbox::LeaseAttempt::Leased(l)) => l,
            ("COMMIT\0", pgbox::LeaseAttempt::InProgress { .. }) => {
                // The dropped call's lease is live and nobody has its token: take another key.
                let key = format!("lease-{name}-b");
                match inbox.lease(&r.pool, key.as_str(), ttl).await.unwrap() {
                    pgbox::LeaseAttempt::Leased(l) => l,
                    other => panic!("{other:?}"),
                }
            }
            (_, other) => panic!("{key}: {other:?}"),
        };
        assert!(
            r.drop_at(point, lease.extend(&r.pool, ttl), &format!("{key} extend"))
                .await
        );
        assert!(
            r.drop_at(
                point,
                lease.complete(&r.pool, &1),
                &format!("{key} complete")
            )
            .await
        );
        lease.complete(&r.pool, &1).await.unwrap();
        let key2 = lease.key().to_string();
        assert!(matches!(
            inbox.lease(&r.pool, key2.as_str(), ttl).await.unwrap(),
            pgbox::LeaseAttempt::Duplicate(_)
        ));
        let key3 = format!("lease-{name}-release");
        let pgbox::LeaseAttempt::Leased(lease) =
            inbox.lease(&r.pool, key3.as_str(), ttl).await.unwrap()
        else {
            panic!()
        };
        assert!(
            r.drop_at(point, lease.release(&r.pool), &format!("{key3} release"))
                .await
        );
    }
}

async fn put_in_queue(pool: &PgPool, topic: &str, n: i64) {
    sqlx::query(
        "INSERT INTO pgbox.queue (message_id, topic, payload, content_type, headers, created_at) \
         SELECT gen_random_uuid(), $1, '\\x00', 'application/octet-stream', '{}', now() \
         FROM generate_series(1, $2)",
    )
    .bind(topic)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// The queue's receive, ack, nack and dead-letter, in the two configurations where they
/// begin transactions: sessions that default to REPEATABLE READ, and `Pooler::Transaction`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_calls_dropped_during_begin_and_commit_leave_the_pool_clean() {
    for (setting, pooler) in [
        (
            Some("SET default_transaction_isolation = 'repeatable read'"),
            Pooler::None,
        ),
        (None, Pooler::Transaction),
    ] {
        let r = rig(setting).await;
        let queue = pgbox::transport::PgQueue::new(r.pool.clone()).pooler(pooler);
        put_in_queue(&r.db.pool, "t", 40).await;
        let vis = Duration::from_secs(60);
        for point in POINTS {
            let ctx = format!("{setting:?}/{pooler:?}");
            assert!(
                r.drop_at(point, queue.receive("t", 1, vis), &format!("{ctx} receive"))
                    .await
            );
            let got = queue.receive("t", 3, vis).await.unwrap();
            assert_eq!(got.len(), 3, "{ctx}");
            r.drop_at(point, queue.ack(&got[0]), &format!("{ctx} ack"))
                .await;
            assert!(
                r.drop_at(
                    point,
                    queue.nack(&got[1], Duration::ZERO, "x"),
                    &format!("{ctx} nack")
                )
                .await
            );
            assert!(
                r.drop_at(
                    point,
                    queue.dead_letter(&got[2], "x"),
                    &format!("{ctx} dead_letter")
                )
                .await
            );
        }
    }
}

/// A table relay round into a queue elsewhere, dropped during its BEGIN and its COMMIT:
/// then every message still arrives (at least once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_rounds_dropped_during_begin_and_commit_leave_the_pool_clean_and_lose_nothing() {
    let r = rig(None).await;
    let outbox = pgbox::Outbox::new();
    let mut ids = Vec::new();
    let mut tx = r.db.pool.begin().await.unwrap();
    for i in 0..30 {
        ids.push(
            outbox
                .enqueue(&mut tx, pgbox::Message::bytes("jobs", format!("m{i}")))
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();
    let queue = pgbox::transport::PgQueue::new(r.db.pool.clone());
    let relay = pgbox::Relay::builder(r.pool.clone(), queue)
        .batch_size(10)
        .build()
        .unwrap();
    for point in POINTS {
        let name = point.trim_end_matches('\0');
        for round in 0..2 {
            r.drop_at(point, relay.relay_once(), &format!("relay {name} {round}"))
                .await;
        }
    }
    for _ in 0..20 {
        relay.relay_once().await.unwrap();
    }
    let arrived: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT message_id) FROM pgbox.queue WHERE message_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_one(&r.db.pool)
    .await
    .unwrap();
    assert_eq!(arrived, 30);
    assert_clean(&r.db, &r.pool, 1, "after the relay").await;
}

/// Outbox dead letters: replay dropped during COMMIT (the BEGIN case is the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_dead_letters_replay_dropped_during_commit_leaves_the_pool_clean() {
    let r = rig(None).await;
    let dead_letters = pgbox::DeadLetters::new(r.pool.clone());
    let ids = [uuid::Uuid::now_v7()];
    assert!(
        r.drop_at("COMMIT\0", dead_letters.replay(&ids), "replay")
            .await
    );
}

/// The janitor's unit (its own lock connection, opened with the pool's options, so through
/// the proxy), dropped during its BEGIN and its COMMIT: the next pass discards the
/// connection; afterwards nothing of this database is idle in a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn janitor_pass_dropped_during_begin_and_commit_leaves_nothing_open_after_the_next_pass() {
    let r = rig(None).await;
    sqlx::query(
        "INSERT INTO pgbox.inbox (consumer, key, processed_at) \
         SELECT 'old', 'k' || g, now() - interval '30 days' FROM generate_series(1, 50) g",
    )
    .execute(&r.db.pool)
    .await
    .unwrap();
    let janitor = pgbox::janitor::Janitor::builder(r.pool.clone())
        .batch_size(5)
        .build()
        .unwrap();
    for point in ["BEGIN; SET LOCAL statement_timeout", "COMMIT\0"] {
        let name = if point.starts_with("BEGIN") {
            "begin"
        } else {
            "commit"
        };
        sqlx::query(
            "INSERT INTO pgbox.inbox (consumer, key, processed_at) \
             SELECT 'old', $1 || g, now() - interval '30 days' FROM generate_series(1, 50) g",
        )
        .bind(name)
        .execute(&r.db.pool)
        .await
        .unwrap();
        all_idle(&r.pool, 1).await;
        let out = drop_at(&r.proxy, point.as_bytes(), janitor.run_once()).await;
        assert!(out.is_ok(), "{point}: {out:?}");
        janitor.run_once().await.unwrap();
        assert_clean(
            &r.db,
            &r.pool,
            1,
            &format!("janitor dropped during {point}, then a pass"),
        )
        .await;
    }
    janitor.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Random drops (0–5 ms) under load, entry points mixed, on 1 and 4 connections.
// ---------------------------------------------------------------------------------------------

/// One call of a random entry point, with a random budget. Returns whether it was dropped.
async fn random_call(
    rng: &mut StdRng,
    pool: &PgPool,
    inbox: &Inbox,
    leases: &Inbox,
    queue: &pgbox::transport::PgQueue,
    relay: &pgbox::Relay<pgbox::transport::PgQueue>,
) -> bool {
    let key = format!("k-{}", rng.random_range(0..300));
    let budget = budget(rng);
    let k = key.as_str();
    let policy = pgbox::RetryPolicy::default();
    let ttl = Duration::from_secs(60);
    macro_rules! timed {
        ($call:expr) => {
            match tokio::time::timeout(budget, $call).await {
                Err(_) => true,
                Ok(out) => {
                    if let Err(e) = out {
                        let e: Error = e;
                        assert!(e.is_retryable(), "{key}: {e:?}");
                    }
                    false
                }
            }
        };
    }
    match rng.random_range(0..5) {
        0 => timed!(inbox.process_and_commit(pool, k, async |c| effect(c, k).await)),
        1 => timed!(inbox.process_with_retry(pool, k, &policy, async |c| effect(c, k).await)),
        2 => timed!(async {
            if let pgbox::LeaseAttempt::Leased(lease) = leases.lease(pool, k, ttl).await? {
                lease.complete(pool, &1).await?;
            }
            Ok(())
        }),
        3 => timed!(async {
            for d in queue.receive("t", 2, Duration::from_secs(1)).await? {
                queue.ack(&d).await?;
            }
            Ok(())
        }),
        _ => timed!(async { relay.relay_once().await.map(|_| ()) }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_points_dropped_at_random_under_load_leave_every_pooled_connection_clean() {
    let db = setup().await;
    put_in_queue(&db.pool, "t", 2_000).await;
    let outbox = pgbox::Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..300 {
        outbox
            .enqueue(&mut tx, pgbox::Message::bytes("jobs", format!("m{i}")))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let seed: u64 = rng().random();
    for (size, callers, calls) in [(1u32, 1u64, 600u32), (4, 8, 120)] {
        let pool = hooked_pool(db.options.clone(), size).await;
        let inbox = Inbox::new("points").unwrap();
        let leases = Inbox::builder("leases")
            .pooler(Pooler::Transaction)
            .build()
            .unwrap();
        let queue = pgbox::transport::PgQueue::new(pool.clone()).pooler(Pooler::Transaction);
        let relay = Arc::new(
            pgbox::Relay::builder(
                pool.clone(),
                pgbox::transport::PgQueue::new(db.pool.clone()),
            )
            .batch_size(5)
            .build()
            .unwrap(),
        );
        let tasks = (0..callers).map(|caller| {
            let (pool, inbox, leases, queue, relay) = (
                pool.clone(),
                inbox.clone(),
                leases.clone(),
                queue.clone(),
                relay.clone(),
            );
            let db_options = db.options.clone();
            tokio::spawn(async move {
                let _ = db_options;
                let mut rng = StdRng::seed_from_u64(seed ^ caller ^ u64::from(size));
                let mut dropped = 0;
                for _ in 0..calls {
                    if random_call(&mut rng, &pool, &inbox, &leases, &queue, &relay).await {
                        dropped += 1;
                    }
                }
                dropped
            })
        });
        let dropped: Vec<u32> = futures_util::future::join_all(tasks)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        eprintln!("size {size}: dropped per caller {dropped:?}");
        assert!(dropped.iter().all(|d| *d > 0));
        all_idle(&pool, size).await;
        assert_clean(&db, &pool, size, &format!("size {size}")).await;
        assert_exactly_once(&db.pool).await;
    }
}

/// Outbox `DeadLetters::replay` under plain timeouts (0–5 ms), no proxy: a one-connection
/// pool is soon lent on inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_dead_letters_replay_dropped_at_random_never_poisons_the_pool() {
    let db = setup().await;
    let pool = options(1).connect_with(db.options.clone()).await.unwrap();
    let dead_letters = pgbox::DeadLetters::new(pool.clone());
    let mut rng = rng();
    let (mut dropped, mut poisoned) = (0, Vec::new());
    for i in 0..1_500 {
        let ids = [uuid::Uuid::now_v7()];
        if tokio::time::timeout(budget(&mut rng), dead_letters.replay(&ids))
            .await
            .is_err()
        {
            dropped += 1;
        }
        let mut conn = pool.acquire().await.unwrap();
        if in_transaction(&mut conn).await {
            poisoned.push(i);
            conn.close().await.unwrap();
        }
    }
    assert!(dropped > 0);
    assert!(
        poisoned.is_empty(),
        "{} of 1500 calls ({dropped} dropped) left the pool's connection inside a transaction, \
         first after calls {:?}",
        poisoned.len(),
        &poisoned[..poisoned.len().min(10)]
    );
}

// ---------------------------------------------------------------------------------------------
// A Pooler::Transaction inbox through a real PgBouncer.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_pooler_inbox_through_pgbouncer_dropped_at_random_leaves_no_server_session_in_a_transaction()
 {
    use support::cluster::Cluster;
    use support::pooler::PgBouncer;
    support::init_tracing();
    let cluster = Cluster::start();
    let bouncer = PgBouncer::start(&cluster, 2);
    let direct = options(2).connect(&cluster.url("postgres")).await.unwrap();
    pgbox::migrate(&direct).await.unwrap();
    direct
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    let pool = options(4)
        .test_before_acquire(false)
        .connect(&bouncer.url("postgres"))
        .await
        .unwrap();
    let inbox = Inbox::builder("points")
        .pooler(Pooler::Transaction)
        .build()
        .unwrap();
    let seed: u64 = rng().random();
    let tasks = (0..8u64).map(|caller| {
        let (pool, inbox) = (pool.clone(), inbox.clone());
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed ^ caller);
            let mut dropped = 0;
            for _ in 0..150 {
                let key = format!("k-{}", rng.random_range(0..300));
                let k = key.as_str();
                match tokio::time::timeout(
                    budget(&mut rng),
                    inbox.process_and_commit(&pool, k, async |c| effect(c, k).await),
                )
                .await
                {
                    Err(_) => dropped += 1,
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => panic!("{key}: {e:?}"),
                }
            }
            dropped
        })
    });
    let dropped: Vec<u32> = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    eprintln!("dropped per caller {dropped:?}");
    // Every client connection, held at once, is outside a transaction...
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(pool.acquire().await.unwrap());
    }
    let mut open = 0;
    for conn in &mut held {
        if in_transaction(conn).await {
            open += 1;
        }
    }
    drop(held);
    // ...and no server session behind PgBouncer is idle in a transaction.
    let mut observer = direct.acquire().await.unwrap();
    let idle: Vec<String> = sqlx::query_scalar(
        "SELECT query FROM pg_catalog.pg_stat_activity \
         WHERE datname = 'postgres' AND state LIKE 'idle in transaction%'",
    )
    .fetch_all(&mut *observer)
    .await
    .unwrap();
    drop(observer);
    assert_eq!(
        (open, idle.len()),
        (0, 0),
        "open client connections; idle server sessions: {idle:?}"
    );
    assert_exactly_once(&direct).await;
}
