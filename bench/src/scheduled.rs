//! S1: what pending scheduled messages cost the immediate path, and the promotion rate.
//!
//! O1 (enqueue, 1 message per transaction, 16 clients) and O2 (relay drain of an unkeyed
//! backlog, no-op publisher) with `outbox_scheduled` empty vs holding 100,000 rows due in an
//! hour; the arms interleaved, repeated, medians, ratios. Then the promotion rate: due
//! scheduled rows promoted into the outbox and published (no-op) per second, next to the
//! drain rate of as many immediate messages.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{Envelope, Message, Outbox, Relay};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};

struct Noop;

impl Publisher for Noop {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

const CLIENTS: usize = 16;
const PENDING: i64 = 100_000;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Fills (`pending` rows due in an hour) or empties `outbox_scheduled`, then vacuums it.
async fn set_pending(pool: &PgPool, pending: i64) -> anyhow::Result<()> {
    pool.execute("TRUNCATE pgbox.outbox_scheduled").await?;
    if pending > 0 {
        sqlx::query(
            "INSERT INTO pgbox.outbox_scheduled (message_id, topic, payload, content_type, due_at, schedule_key) \
             SELECT gen_random_uuid(), 'later', '\\x00'::bytea, 'application/octet-stream', \
               now() + interval '1 hour', 'k' || g FROM generate_series(1, $1) AS g",
        )
        .bind(pending)
        .execute(pool)
        .await?;
    }
    pool.execute("VACUUM ANALYZE pgbox.outbox_scheduled")
        .await?;
    Ok(())
}

/// O1: messages enqueued per second by `CLIENTS` clients, one per transaction.
async fn enqueue_rate(pool: &PgPool, seconds: f64) -> anyhow::Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (pool, done, stop) = (pool.clone(), done.clone(), stop.clone());
            tokio::spawn(async move {
                let outbox = Outbox::new();
                while !stop.load(Relaxed) {
                    let mut tx = pool.begin().await?;
                    outbox
                        .enqueue(&mut tx, Message::bytes("now", vec![b'x'; 100]))
                        .await?;
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
    let rate = done.load(Relaxed) as f64 / started.elapsed().as_secs_f64();
    pool.execute("TRUNCATE pgbox.outbox").await?;
    Ok(rate)
}

/// O2: a backlog of `n` immediate messages drained by one relay (no-op publisher), per
/// second.
async fn drain_rate(pool: &PgPool, n: usize) -> anyhow::Result<f64> {
    let outbox = Outbox::new();
    let mut tx = pool.begin().await?;
    outbox
        .enqueue_batch(
            &mut tx,
            (0..n).map(|_| Message::bytes("now", vec![b'x'; 100])),
        )
        .await?;
    tx.commit().await?;
    pool.execute("VACUUM ANALYZE pgbox.outbox").await?;
    let relay = Relay::builder(pool.clone(), Noop).build()?;
    let started = Instant::now();
    let report = relay.drain().await?;
    anyhow::ensure!(report.published == n, "drained {report:?} of {n}");
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Due scheduled rows promoted and published (no-op) per second, `n` of them.
async fn promotion_rate(pool: &PgPool, n: i64) -> anyhow::Result<f64> {
    pool.execute("TRUNCATE pgbox.outbox_scheduled").await?;
    sqlx::query(
        "INSERT INTO pgbox.outbox_scheduled (message_id, topic, ordering_key, payload, content_type, due_at) \
         SELECT gen_random_uuid(), 'due', CASE WHEN g % 2 = 0 THEN 'key-' || (g % 100) END, \
           convert_to(repeat('x', 100), 'UTF8'), 'application/octet-stream', now() - interval '1 second' \
         FROM generate_series(1, $1) AS g",
    )
    .bind(n)
    .execute(pool)
    .await?;
    pool.execute("VACUUM ANALYZE pgbox.outbox_scheduled")
        .await?;
    let relay = Relay::builder(pool.clone(), Noop).build()?;
    let started = Instant::now();
    let report = relay.drain().await?;
    anyhow::ensure!(report.published as i64 == n, "drained {report:?} of {n}");
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Runs S1 in a schema-default pgbox of the bench's database.
pub(crate) async fn run(options: &PgConnectOptions, quick: bool) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(CLIENTS as u32 + 2)
        .connect_with(options.clone())
        .await?;
    let (repeats, seconds, backlog, promoted) = if quick {
        (3, 1.0, 5_000, 20_000)
    } else {
        (5, 3.0, 20_000, 100_000)
    };
    let mut o1 = [Vec::new(), Vec::new()];
    let mut o2 = [Vec::new(), Vec::new()];
    for r in 0..repeats {
        // Alternate which arm goes first.
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for arm in order {
            set_pending(&pool, if arm == 0 { 0 } else { PENDING }).await?;
            o1[arm].push(enqueue_rate(&pool, seconds).await?);
            o2[arm].push(drain_rate(&pool, backlog).await?);
        }
    }
    set_pending(&pool, 0).await?;
    let [o1_empty, o1_full] = o1.map(median);
    let [o2_empty, o2_full] = o2.map(median);
    println!();
    println!(
        "S1 scheduled messages: {PENDING} pending (due in an hour) vs none; {repeats} interleaved repeats, medians"
    );
    println!(
        "S1 O1 enqueue 1/tx, {CLIENTS} clients: empty {o1_empty:.0}/s, 100k pending {o1_full:.0}/s, ratio {:.3}",
        o1_full / o1_empty
    );
    println!(
        "S1 O2 drain {backlog} (no-op publisher): empty {o2_empty:.0}/s, 100k pending {o2_full:.0}/s, ratio {:.3}",
        o2_full / o2_empty
    );
    let promote = median(vec![
        promotion_rate(&pool, promoted).await?,
        promotion_rate(&pool, promoted).await?,
        promotion_rate(&pool, promoted).await?,
    ]);
    println!(
        "S1 promotion: {promoted} due scheduled rows promoted and published (no-op) at {promote:.0}/s \
         (O2's immediate drain: {o2_empty:.0}/s)"
    );
    pool.close().await;
    Ok(())
}
