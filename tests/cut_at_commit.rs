//! A connection that dies after COMMIT was sent but before its answer arrived: the outcome is
//! unknown to the client, while the server did commit. A proxy that reads the PostgreSQL
//! protocol cuts exactly there (it forwards the COMMIT, waits until the server has answered,
//! drops the answer and closes both sides). pgbox must report such a call as retryable, and
//! the retry must find the committed row: never a second effect, never a lost message.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, Envelope, Error, HandlerConnection, Inbox, Message, Outbox, Relay,
};
use sqlx::postgres::{PgPoolOptions, PgSslMode};
use sqlx::{Executor, PgPool};
use support::TestDb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A proxy in front of PostgreSQL that can cut the next `COMMIT` (simple-query protocol, as
/// sqlx sends it) after the server answered it and before the client hears the answer.
struct CommitCutter {
    addr: SocketAddr,
    /// How many of the next COMMITs to cut.
    armed: Arc<AtomicUsize>,
    /// How many COMMITs were cut (the server answered each).
    cut: Arc<AtomicUsize>,
    accept: tokio::task::AbortHandle,
}

impl CommitCutter {
    async fn start(target: SocketAddr) -> CommitCutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicUsize::new(0));
        let cut = Arc::new(AtomicUsize::new(0));
        let (a, c) = (armed.clone(), cut.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (a, c) = (a.clone(), c.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(target).await {
                        let _ = relay_connection(client, server, a, c).await;
                    }
                });
            }
        })
        .abort_handle();
        CommitCutter {
            addr,
            armed,
            cut,
            accept,
        }
    }

    fn arm(&self, commits: usize) {
        self.armed.store(commits, Ordering::SeqCst);
    }

    fn cuts(&self) -> usize {
        self.cut.load(Ordering::SeqCst)
    }
}

impl Drop for CommitCutter {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Client → server: the untyped startup message, then typed messages, each inspected; server
/// → client: copied, unless a cut is under way (then the answer is dropped and, once it came,
/// both sockets close).
async fn relay_connection(
    client: TcpStream,
    server: TcpStream,
    armed: Arc<AtomicUsize>,
    cut: Arc<AtomicUsize>,
) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let cutting = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(tokio::sync::Notify::new());
    let downstream = {
        let (cutting, answered) = (cutting.clone(), answered.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = server_read.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    return;
                }
                if cutting.load(Ordering::SeqCst) {
                    // The server answered the COMMIT: it is durable. The client never hears it.
                    answered.notify_one();
                    return;
                }
                if client_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        })
    };
    // The startup message: length (including itself), then the rest.
    let mut len = [0u8; 4];
    client_read.read_exact(&mut len).await?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize - 4];
    client_read.read_exact(&mut body).await?;
    server_write.write_all(&len).await?;
    server_write.write_all(&body).await?;
    loop {
        let mut header = [0u8; 5];
        if client_read.read_exact(&mut header).await.is_err() {
            break;
        }
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let mut body = vec![0u8; len - 4];
        client_read.read_exact(&mut body).await?;
        let is_commit = header[0] == b'Q' && {
            let text = String::from_utf8_lossy(&body);
            text.trim_end_matches('\0')
                .trim()
                .eq_ignore_ascii_case("COMMIT")
        };
        let take = is_commit
            && armed
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if take {
            cutting.store(true, Ordering::SeqCst);
            server_write.write_all(&header).await?;
            server_write.write_all(&body).await?;
            // Wait for the server's answer (bounded), then drop everything.
            let _ = tokio::time::timeout(Duration::from_secs(10), answered.notified()).await;
            cut.fetch_add(1, Ordering::SeqCst);
            break;
        }
        server_write.write_all(&header).await?;
        server_write.write_all(&body).await?;
    }
    downstream.abort();
    Ok(())
}

/// A pool through the cutter (no TLS, so the first message is the startup message).
async fn pool_through(db: &TestDb, cutter: &CommitCutter, connections: u32) -> PgPool {
    let options = db
        .options
        .clone()
        .host("127.0.0.1")
        .port(cutter.addr.port())
        .ssl_mode(PgSslMode::Disable);
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .unwrap()
}

async fn server_addr(db: &TestDb) -> SocketAddr {
    let url = url::Url::parse(&db.url()).unwrap();
    let host = url.host_str().unwrap_or("127.0.0.1");
    let port = url.port().unwrap_or(5432);
    tokio::net::lookup_host((host, port))
        .await
        .unwrap()
        .find(SocketAddr::is_ipv4)
        .unwrap()
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn setup() -> (TestDb, CommitCutter) {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    let cutter = CommitCutter::start(server_addr(&db).await).await;
    (db, cutter)
}

#[tokio::test]
async fn process_and_commit_cut_at_commit_is_retryable_and_the_retry_is_a_duplicate() {
    let (db, cutter) = setup().await;
    let pool = pool_through(&db, &cutter, 2).await;
    let inbox = Inbox::new("points").unwrap();
    let handler = async |conn: &mut HandlerConnection<'_>| {
        sqlx::query("INSERT INTO effects VALUES ('k')")
            .execute(&mut *conn)
            .await?;
        Ok::<_, Error>(())
    };
    cutter.arm(1);
    let first = inbox.process_and_commit(&pool, "k", handler).await;
    assert_eq!(cutter.cuts(), 1, "the COMMIT was not cut");
    let e = first.expect_err("a cut COMMIT cannot be reported as processed");
    assert!(e.is_retryable(), "not retryable: {e:?}");
    // The server committed: the effect and the record are there, once.
    assert_eq!(scalar(&db.pool, "SELECT count(*) FROM effects").await, 1);
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM pgbox.inbox").await,
        1
    );
    // The retry (a new connection through the same proxy) finds the record.
    let retry = inbox.process_and_commit(&pool, "k", handler).await.unwrap();
    assert!(retry.is_duplicate(), "{retry:?}");
    assert_eq!(scalar(&db.pool, "SELECT count(*) FROM effects").await, 1);
    // And `process_with_retry` settles it by itself.
    cutter.arm(1);
    let policy = pgbox::RetryPolicy::new().base_delay(Duration::from_millis(5));
    let settled = inbox
        .process_with_retry(&pool, "k2", &policy, async |conn| {
            sqlx::query("INSERT INTO effects VALUES ('k2')")
                .execute(&mut *conn)
                .await?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    assert_eq!(cutter.cuts(), 2);
    assert!(settled.is_duplicate(), "{settled:?}");
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM effects WHERE key = 'k2'").await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_cut_at_commit_retries_and_the_redelivery_is_a_duplicate() {
    let (db, cutter) = setup().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..20 {
        outbox
            .enqueue(&mut tx, Message::bytes("jobs", format!("m{i}")))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    // The queue on a direct pool; the inbox's transactions through the cutter.
    let queue = PgQueue::new(db.pool.clone());
    Relay::builder(db.pool.clone(), queue.clone())
        .build()
        .unwrap()
        .relay_once()
        .await
        .unwrap();
    let inbox_pool = pool_through(&db, &cutter, 4).await;
    let consumer = Consumer::builder(inbox_pool, queue, "jobs", Inbox::new("runner").unwrap())
        .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    cutter.arm(3);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let s = shutdown.clone();
        async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        sqlx::query("INSERT INTO effects VALUES ($1)")
                            .bind(String::from_utf8_lossy(&e.payload).into_owned())
                            .execute(&mut *conn)
                            .await?;
                        Ok::<_, Error>(())
                    },
                    s,
                )
                .await
        }
    });
    let started = Instant::now();
    while scalar(&db.pool, "SELECT count(*) FROM pgbox.queue").await > 0
        && started.elapsed() < Duration::from_secs(30)
        && !run.is_finished()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(cutter.cuts(), 3, "{stats:?}");
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM pgbox.queue").await,
        0
    );
    // Every message took effect exactly once; the three cut ones came back as duplicates.
    assert_eq!(
        scalar(
            &db.pool,
            "SELECT count(*) FROM (SELECT key FROM effects GROUP BY key HAVING count(*) = 1) s"
        )
        .await,
        20
    );
    assert_eq!(scalar(&db.pool, "SELECT count(*) FROM effects").await, 20);
    assert_eq!(stats.processed + stats.duplicates, 20, "{stats:?}");
    assert_eq!(stats.duplicates, 3, "{stats:?}");
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM pgbox.queue_dead_letters").await,
        0
    );
}

#[tokio::test]
async fn a_relay_cut_at_commit_republishes_at_most_its_batch_and_loses_nothing() {
    let (db, cutter) = setup().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..50 {
        outbox
            .enqueue(&mut tx, Message::bytes("jobs", format!("m{i}")))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    // The relay's round through the cutter; the queue it publishes to on a direct pool.
    let relay_pool = pool_through(&db, &cutter, 2).await;
    let relay = Relay::builder(relay_pool, PgQueue::new(db.pool.clone()))
        .batch_size(20)
        .build()
        .unwrap();
    cutter.arm(1);
    let mut errors = 0;
    for _ in 0..20 {
        match relay.relay_once().await {
            Ok(report) if report.claimed == 0 => break,
            Ok(_) => {}
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                errors += 1;
            }
        }
    }
    assert_eq!(cutter.cuts(), 1);
    assert_eq!(errors, 1);
    assert_eq!(
        scalar(
            &db.pool,
            "SELECT count(*) FROM pgbox.outbox WHERE published_at IS NULL"
        )
        .await,
        0,
        "the outbox did not drain"
    );
    let distinct = scalar(
        &db.pool,
        "SELECT count(DISTINCT message_id) FROM pgbox.queue",
    )
    .await;
    let total = scalar(&db.pool, "SELECT count(*) FROM pgbox.queue").await;
    assert_eq!(distinct, 50, "a message was lost");
    assert!(
        total - distinct <= 20,
        "more than the batch in flight was republished: {total}"
    );
}
