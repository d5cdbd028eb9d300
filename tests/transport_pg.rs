//! The built-in Postgres queue against the transport conformance suite.

mod support;

use std::time::Duration;

use pgbox::transport::PgQueue;
use pgbox::transport::conformance::{Capabilities, DeadLettered, Harness};
use sqlx::Row;
use support::TestDb;

struct PgHarness {
    db: TestDb,
}

async fn harness() -> PgHarness {
    support::init_tracing();
    PgHarness {
        db: TestDb::migrated().await,
    }
}

impl Harness for PgHarness {
    type Publisher = PgQueue;
    type Subscriber = PgQueue;

    fn capabilities(&self) -> Capabilities {
        // A consumer that died is noticed when its visibility timeout runs out.
        Capabilities::default()
            .per_key_order(true)
            .visibility(Duration::from_secs(1))
            .redelivery_after_crash(Duration::from_secs(2))
    }

    async fn fresh_topic(&self) -> String {
        format!("topic-{}", uuid::Uuid::now_v7().simple())
    }

    async fn publisher(&self) -> PgQueue {
        PgQueue::new(self.db.pool.clone())
    }

    async fn subscriber(&self) -> PgQueue {
        PgQueue::new(self.db.pool.clone())
    }

    async fn cut_connections(&self) {
        // Server-side kill of every session of the test database but this one.
        let mut conn = self.db.connect().await;
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut conn)
        .await
        .expect("terminate backends");
        assert!(killed > 0, "no connection to cut");
    }

    async fn dead_letters(&self, topic: &str) -> Vec<DeadLettered> {
        let rows = sqlx::query(
            "SELECT message_id, payload, headers, last_error FROM pgbox.queue_dead_letters \
             WHERE topic = $1 ORDER BY seq",
        )
        .bind(topic)
        .fetch_all(&self.db.pool)
        .await
        .expect("list dead letters");
        rows.iter()
            .map(|row| {
                let mut e = pgbox::transport::conformance::envelope(topic, Vec::new());
                e.id = row.get("message_id");
                e.payload = row.get("payload");
                e.headers = row
                    .get::<sqlx::types::Json<std::collections::BTreeMap<String, String>>, _>(
                        "headers",
                    )
                    .0;
                DeadLettered::new(e, row.get("last_error"))
            })
            .collect()
    }

    async fn refused(&self, topic: &str) -> Option<pgbox::Envelope> {
        // PostgreSQL text cannot hold a NUL byte: the queue refuses the message.
        let mut e = pgbox::transport::conformance::envelope(topic, "refused");
        e.content_type = "bad\0type".into();
        Some(e)
    }
}

pgbox::conformance_tests!(harness());

/// Publishes `n` messages to a fresh topic and receives them all.
async fn received(queue: &PgQueue, n: usize) -> Vec<pgbox::transport::Delivery> {
    use pgbox::transport::Publisher;
    let topic = format!("acks-{}", uuid::Uuid::now_v7().simple());
    let batch: Vec<pgbox::Envelope> = (0..n)
        .map(|i| pgbox::transport::conformance::envelope(&topic, format!("{i}")))
        .collect();
    assert!(queue.publish(&batch).await.iter().all(Result::is_ok));
    let deliveries = queue
        .receive(&topic, n, Duration::from_secs(60))
        .await
        .expect("receive");
    assert_eq!(deliveries.len(), n);
    deliveries
}

async fn queued(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Acks made at once are deleted together, and each is still fenced to its own delivery: a
/// stale ack (an earlier delivery) reports `false` and deletes nothing, the same delivery
/// acked twice is fresh once.
#[tokio::test]
async fn acks_made_together_are_each_fenced_to_their_delivery() {
    let h = harness().await;
    let queue = PgQueue::new(h.db.pool.clone());
    let deliveries = received(&queue, 300).await;
    // Counts the DELETE statements on the queue (this test's own database).
    sqlx::raw_sql(
        "CREATE TABLE delete_statements (at timestamptz DEFAULT now()); \
         CREATE FUNCTION count_delete() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN INSERT INTO delete_statements DEFAULT VALUES; RETURN NULL; END $$; \
         CREATE TRIGGER count_delete AFTER DELETE ON pgbox.queue \
           FOR EACH STATEMENT EXECUTE FUNCTION count_delete();",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    let stale: Vec<_> = deliveries[..20]
        .iter()
        .map(|d| {
            let mut stale = d.clone();
            stale.delivery -= 1;
            stale
        })
        .collect();
    // Stale acks first, alone: nothing is deleted by them.
    let results = futures_util::future::join_all(stale.iter().map(|d| queue.ack(d))).await;
    assert!(
        results.iter().all(|r| matches!(r, Ok(false))),
        "{results:?}"
    );
    assert_eq!(queued(&h.db).await, 300, "a stale ack deleted a row");
    // Then every delivery, the first 50 twice, mixed with the stale ones again.
    let all: Vec<&pgbox::transport::Delivery> = deliveries
        .iter()
        .chain(&deliveries[..50])
        .chain(&stale)
        .collect();
    let results = futures_util::future::join_all(all.iter().map(|d| queue.ack(d))).await;
    let fresh = results
        .iter()
        .map(|r| r.as_ref().expect("ack"))
        .filter(|f| **f)
        .count();
    assert_eq!(fresh, 300, "each delivery fresh once: {results:?}");
    assert!(
        results[320..].iter().all(|r| matches!(r, Ok(false))),
        "stale acks report false"
    );
    assert_eq!(queued(&h.db).await, 0);
    let statements: i64 = sqlx::query_scalar("SELECT count(*) FROM delete_statements")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert!(
        statements <= 10,
        "390 acks made together took {statements} statements"
    );
}

/// An ack whose caller stops waiting (a runner cancelled mid-ack) strands no other ack:
/// the grouped statement runs in a task of its own.
#[tokio::test]
async fn abandoned_acks_strand_no_other_ack() {
    let h = harness().await;
    let queue = PgQueue::new(h.db.pool.clone());
    let deliveries = received(&queue, 200).await;
    for d in deliveries.iter().step_by(2) {
        // Polled once, then dropped.
        let _ = tokio::time::timeout(Duration::ZERO, queue.ack(d)).await;
    }
    let results = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join_all(deliveries.iter().map(|d| queue.ack(d))),
    )
    .await
    .expect("acks complete");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert!(
        results
            .iter()
            .skip(1)
            .step_by(2)
            .all(|r| matches!(r, Ok(true))),
        "acks never abandoned are fresh"
    );
    assert_eq!(queued(&h.db).await, 0);
}

/// When the grouped statement fails, each ack runs alone and reports its own error; none
/// waits forever.
#[tokio::test]
async fn acks_report_errors_when_the_database_is_gone() {
    let h = harness().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&h.db.url())
        .await
        .unwrap();
    let queue = PgQueue::new(pool.clone());
    let deliveries = received(&queue, 20).await;
    pool.close().await;
    let results = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join_all(deliveries.iter().map(|d| queue.ack(d))),
    )
    .await
    .expect("acks end");
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert_eq!(queued(&h.db).await, 20, "nothing acked");
}
