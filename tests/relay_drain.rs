//! `Relay::drain`: publish until nothing is left, then return a report. Correct with keyed
//! messages and with several relays draining at once; a message waiting out a retry backoff
//! is waited for; messages held behind a dead-lettered one of their key are reported, not
//! waited for forever.

mod support;

use std::time::Duration;

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{Envelope, Message, Outbox, Relay, RetryPolicy};
use sqlx::PgPool;
use support::TestDb;

async fn enqueue(pool: &PgPool, keyed: usize, keys: usize, unkeyed: usize) {
    let outbox = Outbox::new();
    let mut tx = pool.begin().await.unwrap();
    for i in 0..keyed {
        outbox
            .enqueue(
                &mut tx,
                Message::bytes("jobs", format!("k{i}")).ordering_key(format!("key-{}", i % keys)),
            )
            .await
            .unwrap();
    }
    for i in 0..unkeyed {
        outbox
            .enqueue(&mut tx, Message::bytes("jobs", format!("u{i}")))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_drain_a_keyed_and_unkeyed_backlog_and_each_returns_when_it_is_empty() {
    let db = TestDb::migrated().await;
    enqueue(&db.pool, 300, 10, 200).await;
    let relay = || {
        Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
            .batch_size(50)
            .build()
            .unwrap()
    };
    let (a, b, c) = (relay(), relay(), relay());
    let (ra, rb, rc) = tokio::join!(a.drain(), b.drain(), c.drain());
    let (ra, rb, rc) = (ra.unwrap(), rb.unwrap(), rc.unwrap());
    assert_eq!(
        ra.published + rb.published + rc.published,
        500,
        "{ra:?} {rb:?} {rc:?}"
    );
    assert_eq!(ra.held + rb.held + rc.held, 0);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        0
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(DISTINCT message_id) FROM pgbox.queue"
        )
        .await,
        500
    );
    // Each key's messages reached the queue in production order.
    let out_of_order = count(
        &db.pool,
        "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY ordering_key ORDER BY seq) AS prev, \
           substring(convert_from(payload, 'UTF8') FROM 2)::int AS n, \
           lag(substring(convert_from(payload, 'UTF8') FROM 2)::int) OVER (PARTITION BY ordering_key ORDER BY seq) AS prev_n \
           FROM pgbox.queue WHERE ordering_key IS NOT NULL) q WHERE q.prev_n > q.n",
    )
    .await;
    assert_eq!(out_of_order, 0);
    // An empty outbox drains at once.
    let again = a.drain().await.unwrap();
    assert_eq!((again.rounds, again.published), (1, 0));
}

/// Fails every message of key `key-bad`; the rest goes through.
struct FailsOneKey;

impl Publisher for FailsOneKey {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        batch
            .iter()
            .map(|e| match e.ordering_key.as_deref() {
                Some("key-bad") => Err(PublishError::refused("refused")),
                _ => Ok(()),
            })
            .collect()
    }
}

#[tokio::test]
async fn drain_waits_out_retries_and_reports_what_a_dead_letter_holds_back() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..3 {
        outbox
            .enqueue(
                &mut tx,
                Message::bytes("jobs", format!("bad{i}")).ordering_key("key-bad"),
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    enqueue(&db.pool, 20, 4, 10).await;
    let relay = Relay::builder(db.pool.clone(), FailsOneKey)
        .max_attempts(3)
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(50))
                .max_delay(Duration::from_millis(100)),
        )
        .poll_interval(Duration::from_millis(200))
        .build()
        .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), relay.drain())
        .await
        .expect("drain returned")
        .unwrap();
    assert_eq!(report.published, 30, "{report:?}");
    // The key's head failed three times (two retries waited out), then was dead-lettered;
    // the two behind it are held until it is replayed or discarded.
    assert_eq!(report.retried, 2, "{report:?}");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(report.held, 2, "{report:?}");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        2
    );
}
