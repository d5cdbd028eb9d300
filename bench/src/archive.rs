//! A1: the archive of delivered messages.
//!
//! - O2 drain (unkeyed backlog, no-op publisher) with archiving off vs on: the settling
//!   DELETE feeds the archive's INSERT in the same statement. Arms interleaved, repeated,
//!   medians; the ratio is on / off (target: archiving costs at most 10 %).
//! - Replay from an archive of `archive_rows` messages into the outbox (chunks of 10,000,
//!   each one INSERT … SELECT on the server), then onward: the outbox drained by a relay into
//!   a no-op publisher (target: at least 100k msgs/s into the outbox).

use std::time::Instant;

use pgbox::transport::{PublishError, Publisher};
use pgbox::{Archive, ArchiveRetention, Envelope, Relay, Replay};
use sqlx::{Executor, PgPool};

struct Discard;

impl Publisher for Discard {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        batch.iter().map(|_| Ok(())).collect()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn fill_outbox(pool: &PgPool, n: usize) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO pgbox.outbox (message_id, topic, payload, content_type, headers) \
         SELECT gen_random_uuid(), 'bench', convert_to(repeat('x', 100), 'UTF8'), 'text/plain', '{\"type\":\"t\"}' \
         FROM generate_series(1, $1)",
    )
    .bind(n as i64)
    .execute(pool)
    .await?;
    pool.execute("VACUUM ANALYZE pgbox.outbox").await?;
    Ok(())
}

async fn drain_rate(pool: &PgPool, batch: usize, archive: bool, n: usize) -> anyhow::Result<f64> {
    let mut builder = Relay::builder(pool.clone(), Discard).batch_size(batch);
    if archive {
        builder = builder.archive(ArchiveRetention::days(1));
    }
    let relay = builder.build()?;
    let started = Instant::now();
    let report = relay.drain().await?;
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(report.published == n, "drained {} of {n}", report.published);
    Ok(n as f64 / secs)
}

/// Runs A1 on `pool` (a migrated bench database of its own).
pub(crate) async fn run(
    pool: &PgPool,
    quick: bool,
    backlog: usize,
    batch: usize,
) -> anyhow::Result<()> {
    let (backlog, repeats, archive_rows) = if quick {
        (backlog.min(10_000), 3, 20_000)
    } else {
        (backlog, 5, 200_000)
    };
    // Partitions first (daily, 3 ahead): the archiving arms never meet a missing partition.
    Archive::new(pool.clone())
        .configure(ArchiveRetention::days(1))
        .await?;
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for _ in 0..repeats {
        for archive in [false, true] {
            pool.execute("TRUNCATE pgbox.outbox_archive").await?;
            fill_outbox(pool, backlog).await?;
            let rate = drain_rate(pool, batch, archive, backlog).await?;
            if archive {
                on.push(rate)
            } else {
                off.push(rate)
            }
        }
    }
    let (off, on) = (median(off), median(on));
    println!(
        "A1 O2 drain {backlog} (no-op), archive off: {off:>10.0} msgs/s (median of {repeats})"
    );
    println!(
        "A1 O2 drain {backlog} (no-op), archive on:  {on:>10.0} msgs/s  on/off {:.2} (cost {:.1} %)",
        on / off,
        (1.0 - on / off) * 100.0
    );

    // The archive to replay from.
    pool.execute("TRUNCATE pgbox.outbox_archive, pgbox.outbox")
        .await?;
    sqlx::query(
        "INSERT INTO pgbox.outbox_archive (source_seq, message_id, topic, ordering_key, payload, content_type, headers, created_at) \
         SELECT g, gen_random_uuid(), 'bench', 'k' || (g % 100), convert_to(repeat('x', 100), 'UTF8'), 'text/plain', '{\"type\":\"t\"}', now() \
         FROM generate_series(1, $1) AS g",
    )
    .bind(archive_rows as i64)
    .execute(pool)
    .await?;
    pool.execute("VACUUM ANALYZE pgbox.outbox_archive").await?;
    let archive = Archive::new(pool.clone());
    let (mut into, mut onward) = (Vec::new(), Vec::new());
    for _ in 0..repeats {
        pool.execute("TRUNCATE pgbox.outbox").await?;
        let started = Instant::now();
        let report = archive
            .replay()
            .batch_size(Replay::MAX_BATCH_SIZE)
            .run()
            .await?;
        let secs = started.elapsed().as_secs_f64();
        anyhow::ensure!(
            report.replayed == archive_rows as u64,
            "replayed {report:?}"
        );
        into.push(archive_rows as f64 / secs);
        onward.push(drain_rate(pool, batch, false, archive_rows).await?);
    }
    let (into, onward) = (median(into), median(onward));
    println!(
        "A1 replay {archive_rows} (100 keys) into the outbox: {into:>10.0} msgs/s (median of {repeats}; target >= 100000: {})",
        if into >= 100_000.0 { "met" } else { "NOT met" }
    );
    println!(
        "A1 replayed outbox drained onward (no-op):   {onward:>10.0} msgs/s  end to end {:.0} msgs/s",
        1.0 / (1.0 / into + 1.0 / onward)
    );
    pool.execute("TRUNCATE pgbox.outbox_archive, pgbox.outbox")
        .await?;
    Ok(())
}
