//! F1: fan-out. Each destination's drain rate through a `Router` with three destinations,
//! relative to the rate of a relay publishing to one destination alone; and the enqueue rate
//! (O1) with vs without the destinations header.
//!
//! Destinations: the built-in queue, each in a schema of its own (`fan_a`, `fan_b`,
//! `fan_c`), published to through `Publisher::publish` in both arms (the single-destination
//! relay goes through a forwarding wrapper, so that it does not take the relay's in-round
//! move into a local queue, which a router never takes). A backlog of `n` messages, half of
//! them keyed (100 keys), 100-byte payloads; the arms interleaved, repeated, medians.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{Envelope, Message, Migrator, Outbox, Relay, Router};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Executor, PgPool};

const CLIENTS: usize = 16;
const SCHEMAS: [&str; 3] = ["fan_a", "fan_b", "fan_c"];

/// Forwards to a queue without naming it (`as_pg_queue` stays `None`).
struct Via(PgQueue);

impl Publisher for Via {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.publish(batch).await
    }

    fn atomic_batches(&self) -> bool {
        self.0.atomic_batches()
    }
}

/// A broker-like destination: accepts everything after a 1 ms round trip per call.
struct Remote;

impl Publisher for Remote {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

/// Messages per second each destination receives: one remote destination alone
/// (`router == false`, the relay publishes to it directly) or three behind a router.
async fn remote(pool: &PgPool, n: usize, router: bool) -> anyhow::Result<f64> {
    backlog(pool, n).await?;
    let started = Instant::now();
    let report = if router {
        let r = Router::builder(pool.clone())
            .destination("r1", Remote)
            .destination("r2", Remote)
            .destination("r3", Remote)
            .route(">", ["r1", "r2", "r3"])
            .build()?;
        Relay::builder(pool.clone(), Arc::new(r))
            .build()?
            .drain()
            .await?
    } else {
        Relay::builder(pool.clone(), Remote)
            .build()?
            .drain()
            .await?
    };
    anyhow::ensure!(report.published == n, "drained {report:?} of {n}");
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn message(i: usize) -> Message {
    let m = Message::bytes("orders.created", vec![b'x'; 100]);
    if i.is_multiple_of(2) {
        m.ordering_key(format!("key-{}", i % 100))
    } else {
        m
    }
}

async fn reset(pool: &PgPool) -> anyhow::Result<()> {
    pool.execute(
        "TRUNCATE pgbox.outbox, pgbox.outbox_fanout_deliveries, pgbox.outbox_fanout_messages",
    )
    .await?;
    for s in SCHEMAS {
        pool.execute(AssertSqlSafe(format!("TRUNCATE {s}.queue")))
            .await?;
    }
    Ok(())
}

async fn backlog(pool: &PgPool, n: usize) -> anyhow::Result<()> {
    reset(pool).await?;
    let mut tx = pool.begin().await?;
    Outbox::new()
        .enqueue_batch(&mut tx, (0..n).map(message))
        .await?;
    tx.commit().await?;
    pool.execute("VACUUM ANALYZE pgbox.outbox").await?;
    Ok(())
}

/// Messages per second a relay drains into one destination.
async fn single(pool: &PgPool, n: usize) -> anyhow::Result<f64> {
    backlog(pool, n).await?;
    let queue = PgQueue::with_schema(pool.clone(), SCHEMAS[0])?;
    let relay = Relay::builder(pool.clone(), Via(queue)).build()?;
    let started = Instant::now();
    let report = relay.drain().await?;
    anyhow::ensure!(report.published == n, "drained {report:?} of {n}");
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Messages per second each of three destinations receives through a router.
async fn fanned(pool: &PgPool, n: usize) -> anyhow::Result<f64> {
    backlog(pool, n).await?;
    let mut builder = Router::builder(pool.clone());
    for s in SCHEMAS {
        builder = builder.destination(s, PgQueue::with_schema(pool.clone(), s)?);
    }
    let router = Arc::new(builder.route("orders.>", SCHEMAS).build()?);
    let relay = Relay::builder(pool.clone(), router.clone()).build()?;
    let started = Instant::now();
    let report = relay.drain().await?;
    let elapsed = started.elapsed().as_secs_f64();
    anyhow::ensure!(report.published == n, "drained {report:?} of {n}");
    for s in SCHEMAS {
        let got: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {s}.queue")))
            .fetch_one(pool)
            .await?;
        anyhow::ensure!(got as usize == n, "{s} got {got} of {n}");
    }
    Ok(n as f64 / elapsed)
}

/// O1: messages enqueued per second by `CLIENTS` clients, one per transaction.
async fn enqueue_rate(pool: &PgPool, seconds: f64, header: bool) -> anyhow::Result<f64> {
    reset(pool).await?;
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (pool, done, stop) = (pool.clone(), done.clone(), stop.clone());
            tokio::spawn(async move {
                let outbox = Outbox::new();
                while !stop.load(Relaxed) {
                    let mut m = Message::bytes("orders.created", vec![b'x'; 100]);
                    if header {
                        m = m.destinations(SCHEMAS);
                    }
                    let mut tx = pool.begin().await?;
                    outbox.enqueue(&mut tx, m).await?;
                    tx.commit().await?;
                    done.fetch_add(1, Relaxed);
                }
                anyhow::Ok(())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Relaxed);
    for t in tasks {
        t.await??;
    }
    Ok(done.load(Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// Runs F1 in the bench's database (pgbox in `pgbox`, the destinations' queues in
/// `fan_a`..`fan_c`).
pub(crate) async fn run(options: &PgConnectOptions, quick: bool) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(CLIENTS as u32 + 4)
        .connect_with(options.clone())
        .await?;
    pgbox::migrate(&pool).await?;
    for s in SCHEMAS {
        Migrator::new().schema(s)?.run(&pool).await?;
    }
    let (repeats, seconds, n) = if quick {
        (3, 1.0, 5_000)
    } else {
        (5, 3.0, 20_000)
    };
    let (mut one, mut three) = (Vec::new(), Vec::new());
    let (mut plain, mut addressed) = (Vec::new(), Vec::new());
    let (mut remote_one, mut remote_three) = (Vec::new(), Vec::new());
    for r in 0..repeats {
        if r % 2 == 0 {
            remote_one.push(remote(&pool, n, false).await?);
            remote_three.push(remote(&pool, n, true).await?);
        } else {
            remote_three.push(remote(&pool, n, true).await?);
            remote_one.push(remote(&pool, n, false).await?);
        }
        if r % 2 == 0 {
            one.push(single(&pool, n).await?);
            three.push(fanned(&pool, n).await?);
            plain.push(enqueue_rate(&pool, seconds, false).await?);
            addressed.push(enqueue_rate(&pool, seconds, true).await?);
        } else {
            three.push(fanned(&pool, n).await?);
            one.push(single(&pool, n).await?);
            addressed.push(enqueue_rate(&pool, seconds, true).await?);
            plain.push(enqueue_rate(&pool, seconds, false).await?);
        }
    }
    reset(&pool).await?;
    let (one, three) = (median(one), median(three));
    let (plain, addressed) = (median(plain), median(addressed));
    println!();
    println!("F1 fan-out: {repeats} interleaved repeats, medians");
    println!(
        "F1 drain {n} (half keyed) into the built-in queue: 1 destination {one:.0}/s; \
         router, 3 destinations: {three:.0}/s each, ratio {:.3} (target >= 0.8)",
        three / one
    );
    let (remote_one, remote_three) = (median(remote_one), median(remote_three));
    println!(
        "F1 drain {n} (half keyed) to broker-like destinations (1 ms per call, nothing written): \
         1 destination {remote_one:.0}/s; router, 3 destinations: {remote_three:.0}/s each, ratio {:.3} (target >= 0.8)",
        remote_three / remote_one
    );
    println!(
        "F1 O1 enqueue 1/tx, {CLIENTS} clients: plain {plain:.0}/s, with the destinations header {addressed:.0}/s, ratio {:.3} (target >= 0.8)",
        addressed / plain
    );
    pool.close().await;
    Ok(())
}
