//! After PostgreSQL restarts, the pipeline's wake-ups come back: a relay and a consumer with a
//! long poll interval (5 s) still hand a new message to its handler in a fraction of that,
//! because both LISTEN again (and the relay takes its asleep lock again). Crash-restarts a
//! private cluster of the test's own, never the shared server.

mod support;

use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{CancellationToken, Consumer, Envelope, Error, HandlerConnection, Inbox, Message};
use pgbox::{Outbox, Relay};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use support::cluster::Cluster;
use tokio::sync::mpsc;

const POLL: Duration = Duration::from_secs(5);

async fn wait_for_server(url: &str) {
    let started = Instant::now();
    loop {
        match PgConnection::connect(url).await {
            Ok(conn) => {
                let _ = conn.close().await;
                return;
            }
            Err(e) if started.elapsed() < Duration::from_secs(60) => {
                tracing::debug!(error = %e, "server not up yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the private cluster did not come back: {e}"),
        }
    }
}

/// Enqueues one message (retrying while the server comes back) and returns when it committed.
async fn produce(pool: &PgPool, payload: &str) -> Instant {
    let outbox = Outbox::new();
    for _ in 0..600 {
        let attempt = async {
            let mut tx = pool.begin().await?;
            outbox
                .enqueue(&mut tx, Message::bytes("jobs", payload.as_bytes()))
                .await?;
            tx.commit().await.map_err(Error::from)
        };
        match attempt.await {
            Ok(()) => return Instant::now(),
            Err(e) => {
                tracing::debug!(error = %e, "enqueue failed; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    panic!("could not enqueue {payload} within a minute");
}

/// Seconds from commit to the handler for one message.
async fn latency(pool: &PgPool, seen: &mut mpsc::UnboundedReceiver<String>, payload: &str) -> f64 {
    let committed = produce(pool, payload).await;
    let deadline = Duration::from_secs(30);
    loop {
        let got = tokio::time::timeout(deadline, seen.recv())
            .await
            .unwrap_or_else(|_| panic!("{payload} never reached the handler"))
            .expect("handler channel open");
        if got == payload {
            return committed.elapsed().as_secs_f64();
        }
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_ups_come_back_after_postgres_restarts() {
    support::init_tracing();
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let url = cluster.url("postgres");
    wait_for_server(&url).await;
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await
        .unwrap();
    pgbox::migrate(&pool).await.unwrap();
    pool.execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();
    let queue = PgQueue::new(pool.clone());
    let relay = Relay::builder(pool.clone(), queue.clone())
        .poll_interval(POLL)
        .build()
        .unwrap();
    let consumer = Consumer::builder(pool.clone(), queue, "jobs", Inbox::new("restart").unwrap())
        .poll_interval(POLL)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let relay_task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let consumer_task = tokio::spawn({
        let s = shutdown.clone();
        async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        let payload = String::from_utf8_lossy(&e.payload).into_owned();
                        sqlx::query("INSERT INTO effects VALUES ($1)")
                            .bind(&payload)
                            .execute(&mut *conn)
                            .await?;
                        let _ = seen_tx.send(payload);
                        Ok::<_, Error>(())
                    },
                    s,
                )
                .await
        }
    });
    // Let both fall asleep on LISTEN first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut before = Vec::new();
    for i in 0..3 {
        before.push(latency(&pool, &mut seen, &format!("before-{i}")).await);
    }

    tokio::task::block_in_place(|| cluster.crash_restart());
    wait_for_server(&url).await;
    // The first message after the restart may ride on a poll while the listeners come back;
    // it proves the pipeline works again. Then give reconnects a moment (well under the poll
    // interval) and measure.
    let _ = latency(&pool, &mut seen, "after-first").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut after = Vec::new();
    for i in 0..5 {
        after.push(latency(&pool, &mut seen, &format!("after-{i}")).await);
    }
    shutdown.cancel();
    relay_task.await.unwrap().unwrap();
    consumer_task.await.unwrap().unwrap();
    let (before, after) = (median(before), median(after));
    eprintln!("commit → handler, median: {before:.3} s before the restart, {after:.3} s after");
    // Polling alone would take 2.5 s on average (up to 5 s) through each of two stages.
    assert!(
        after < 1.5,
        "after the restart a message waits for the poll ({after:.3} s median): nothing LISTENs"
    );
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(effects, 9);
}

/// The janitor's session lock lives on a connection of its own: after the server restarts,
/// a later pass takes it again (no "lost once, gone forever").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_janitor_takes_its_lock_again_after_postgres_restarts() {
    support::init_tracing();
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let url = cluster.url("postgres");
    wait_for_server(&url).await;
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await
        .unwrap();
    pgbox::migrate(&pool).await.unwrap();
    let janitor = pgbox::janitor::Janitor::builder(pool.clone())
        .build()
        .unwrap();
    let report = janitor.run_once().await.unwrap();
    assert!(report.lock.is_held(), "{report:?}");
    tokio::task::block_in_place(|| cluster.crash_restart());
    wait_for_server(&url).await;
    let mut held_again = false;
    for _ in 0..50 {
        match janitor.run_once().await {
            Ok(report) if report.lock.is_held() => {
                held_again = true;
                break;
            }
            Ok(report) => tracing::debug!(?report, "janitor pass without the lock"),
            Err(e) => tracing::debug!(error = %e, "janitor pass failed"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(held_again, "the janitor never took its lock again");
}

/// Runs a consumer runner on `topic` until it has settled one delivery (the one effect in
/// `effects`, the queue empty), then stops it gracefully (its ack made) and returns its
/// counts.
async fn settle_one(pool: &PgPool, queue: PgQueue, topic: &str) -> pgbox::ConsumerStats {
    let consumer = Consumer::builder(pool.clone(), queue, topic, Inbox::new("undo").unwrap())
        .poll_interval(Duration::from_millis(50))
        // An undone ack leaves its message hidden until this runs out (its receive, flushed
        // by the inbox's commit, survives the crash).
        .visibility_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let s = shutdown.clone();
        async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        sqlx::query("INSERT INTO effects VALUES ($1)")
                            .bind(e.id)
                            .execute(&mut *conn)
                            .await?;
                        Ok::<_, Error>(())
                    },
                    s,
                )
                .await
        }
    });
    assert!(
        support::settled(pool, 1, Duration::from_secs(30)).await,
        "{topic}: not settled after 30 s"
    );
    support::stop_runner(shutdown, run, Duration::from_secs(60)).await
}

/// Rows of `sql` (one count), retried while the pool's connections come back after a
/// restart.
async fn count_after_restart(pool: &PgPool, sql: &'static str, bind: &str) -> i64 {
    for _ in 0..300 {
        match sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await {
            Ok(n) => return n,
            Err(e) => tracing::debug!(error = %e, "not back yet"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{sql}: no answer within 30 s of the restart");
}

/// The queue's acks commit without waiting for their WAL flush, so a PostgreSQL crash right
/// after one can undo it. The message then comes back, and the inbox answers `Duplicate`:
/// one effect either way. With `PgQueue::wait_for_flush(true)` the same crash undoes no
/// ack. Crash-restarts a private cluster whose WAL writer writes at most every 10 s
/// (`wal_writer_delay`), so that an unflushed ack is still in shared memory at the crash
/// (it can be written sooner when a WAL page fills: the unflushed arm has five attempts to
/// see one undone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_undone_by_a_crash_is_delivered_again_and_absorbed() {
    use pgbox::transport::Publisher;
    support::init_tracing();
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    cluster.psql("ALTER SYSTEM SET wal_writer_delay = '10s'");
    cluster.psql("SELECT pg_catalog.pg_reload_conf()");
    let url = cluster.url("postgres");
    wait_for_server(&url).await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await
        .unwrap();
    pgbox::migrate(&pool).await.unwrap();
    pool.execute("CREATE TABLE effects (message_id uuid NOT NULL)")
        .await
        .unwrap();
    for (wait, attempts) in [(true, 2), (false, 5)] {
        let mut undone = 0;
        for attempt in 0..attempts {
            pool.execute("TRUNCATE effects").await.unwrap();
            let queue = PgQueue::new(pool.clone()).wait_for_flush(wait);
            let topic = format!("undo-{wait}-{attempt}");
            let message = pgbox::transport::conformance::envelope(&topic, "once".to_owned());
            assert!(queue.publish(std::slice::from_ref(&message)).await[0].is_ok());
            let first = settle_one(&pool, queue.clone(), &topic).await;
            assert_eq!((first.processed, first.duplicates), (1, 0), "{first:?}");
            tokio::task::block_in_place(|| cluster.crash_restart());
            wait_for_server(&url).await;
            let back = count_after_restart(
                &pool,
                "SELECT count(*) FROM pgbox.queue WHERE topic = $1",
                &topic,
            )
            .await;
            if back == 1 {
                undone += 1;
                let again = settle_one(&pool, queue, &topic).await;
                assert_eq!((again.processed, again.duplicates), (0, 1), "{again:?}");
            }
            let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(effects, 1, "{topic}: {back} row(s) back after the crash");
            if !wait && undone > 0 {
                break;
            }
        }
        eprintln!("wait_for_flush({wait}): {undone} ack(s) undone by a crash");
        if wait {
            assert_eq!(undone, 0, "a crash undid an ack that waited for its flush");
        } else {
            assert!(
                undone > 0,
                "no crash undid an unflushed ack in {attempts} attempts"
            );
        }
    }
}
