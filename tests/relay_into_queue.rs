//! A relay whose publisher is the built-in queue in the outbox's own database moves each
//! batch into the queue inside its round's transaction: the queue gets every message exactly
//! once, in order, with its id, payload, headers and timestamps, even when the round fails at
//! its very end. A queue on another database, or behind a wrapper that does not name it,
//! is published to through its own pool, as before.

mod support;

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{Envelope, Message, Outbox, Relay};
use sqlx::{AssertSqlSafe, PgPool, Row};
use support::TestDb;

/// The columns a message keeps from the outbox into the queue, in publication order.
type Copied = (
    uuid::Uuid,
    String,
    Option<String>,
    Vec<u8>,
    String,
    serde_json::Value,
    time::OffsetDateTime,
);

async fn enqueue(pool: &PgPool, tag: &str, keyed: usize, unkeyed: usize) {
    let outbox = Outbox::new();
    let mut tx = pool.begin().await.unwrap();
    for i in 0..keyed.max(unkeyed) {
        if i < keyed {
            let message = Message::bytes("orders", format!("{tag}-k{i}").into_bytes())
                .ordering_key(format!("key-{}", i % 7))
                .content_type("text/plain")
                .header("x-n", i.to_string());
            outbox.enqueue(&mut tx, message).await.unwrap();
        }
        if i < unkeyed {
            let message = Message::json("orders", &serde_json::json!({ "tag": tag, "n": i }))
                .unwrap()
                .header("x-tag", tag);
            outbox.enqueue(&mut tx, message).await.unwrap();
        }
    }
    tx.commit().await.unwrap();
}

async fn rows(pool: &PgPool, table: &str) -> Vec<Copied> {
    sqlx::query(AssertSqlSafe(format!(
        "SELECT message_id, topic, ordering_key, payload, content_type, headers, created_at \
         FROM pgbox.{table} ORDER BY seq"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| {
        (
            r.get(0),
            r.get(1),
            r.get(2),
            r.get(3),
            r.get(4),
            r.get(5),
            r.get(6),
        )
    })
    .collect()
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM pgbox.{table}")))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Makes every transaction that deletes an outbox row fail at COMMIT while
/// `public.refuse_commit` holds true: a round that gets all the way to its commit, then fails.
async fn install_commit_refusal(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE public.refuse_commit (refuse boolean NOT NULL); \
         INSERT INTO public.refuse_commit VALUES (false); \
         CREATE FUNCTION public.refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF (SELECT refuse FROM public.refuse_commit) THEN \
             RAISE EXCEPTION 'commit refused by the test'; \
           END IF; \
           RETURN NULL; \
         END $$; \
         CREATE CONSTRAINT TRIGGER refuse_commit AFTER DELETE ON pgbox.outbox \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.refuse_commit();",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn refuse_commits(pool: &PgPool, refuse: bool) {
    sqlx::query("UPDATE public.refuse_commit SET refuse = $1")
        .bind(refuse)
        .execute(pool)
        .await
        .unwrap();
}

/// Forwards to a queue but does not name it (`as_pg_queue` keeps its default): the relay
/// publishes through it, as it does into any other transport.
struct Forwarding(PgQueue);

impl Publisher for Forwarding {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.0.publish(batch).await
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn a_round_into_a_queue_in_the_same_database_moves_its_batch_in_its_own_transaction() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    install_commit_refusal(&db.pool).await;
    enqueue(&db.pool, "a", 120, 80).await;
    let before = rows(&db.pool, "outbox").await;
    assert_eq!(before.len(), 200);

    let relay = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .batch_size(50)
        .build()
        .unwrap();
    // A round that fails at its commit leaves nothing in the queue: the move was part of it.
    refuse_commits(&db.pool, true).await;
    let err = relay.relay_once().await.unwrap_err();
    assert!(err.to_string().contains("commit refused"), "{err}");
    assert_eq!(count(&db.pool, "queue").await, 0);
    assert_eq!(count(&db.pool, "outbox").await, 200);

    refuse_commits(&db.pool, false).await;
    let drained = relay.drain().await.unwrap();
    assert_eq!(drained.published, 200, "{drained:?}");
    assert_eq!(count(&db.pool, "outbox").await, 0);
    // Every message once, in outbox order (so each key's order too), with every column kept.
    assert_eq!(rows(&db.pool, "queue").await, before);

    // The contrast: through a wrapper that does not name the queue, the publish commits on
    // the queue's own pool before the round's commit fails, and the retry publishes again.
    // The inbox absorbs such copies; the move above never makes them.
    enqueue(&db.pool, "b", 0, 10).await;
    let forwarding = Relay::builder(db.pool.clone(), Forwarding(PgQueue::new(db.pool.clone())))
        .build()
        .unwrap();
    refuse_commits(&db.pool, true).await;
    forwarding.relay_once().await.unwrap_err();
    assert_eq!(count(&db.pool, "queue").await, 210);
    refuse_commits(&db.pool, false).await;
    assert_eq!(forwarding.drain().await.unwrap().published, 10);
    assert_eq!(count(&db.pool, "queue").await, 220);
}

#[tokio::test]
async fn audit_mode_marks_the_moved_rows_published() {
    let db = TestDb::migrated().await;
    enqueue(&db.pool, "a", 30, 30).await;
    let before = rows(&db.pool, "outbox").await;
    let relay = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .batch_size(25)
        .keep_published(true)
        .build()
        .unwrap();
    assert_eq!(relay.drain().await.unwrap().published, 60);
    assert_eq!(rows(&db.pool, "queue").await, before);
    let unpublished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((count(&db.pool, "outbox").await, unpublished), (60, 0));
}

#[tokio::test]
async fn a_queue_on_another_database_is_published_to_through_its_own_pool() {
    let outbox_db = TestDb::migrated().await;
    let queue_db = TestDb::migrated().await;
    enqueue(&outbox_db.pool, "a", 20, 20).await;
    let before = rows(&outbox_db.pool, "outbox").await;
    let relay = Relay::builder(outbox_db.pool.clone(), PgQueue::new(queue_db.pool.clone()))
        .build()
        .unwrap();
    assert_eq!(relay.drain().await.unwrap().published, 40);
    assert_eq!(rows(&queue_db.pool, "queue").await, before);
    assert_eq!(count(&outbox_db.pool, "queue").await, 0);
    assert_eq!(count(&outbox_db.pool, "outbox").await, 0);
}

/// The queue in a schema of its own, next to the outbox's: the move writes there.
#[tokio::test]
async fn a_queue_in_another_schema_of_the_same_database_gets_the_batch() {
    let db = TestDb::migrated().await;
    pgbox::Migrator::new()
        .schema("jobs")
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    enqueue(&db.pool, "a", 10, 10).await;
    let queue = PgQueue::with_schema(db.pool.clone(), "jobs").unwrap();
    let relay = Relay::builder(db.pool.clone(), queue).build().unwrap();
    assert_eq!(relay.drain().await.unwrap().published, 20);
    let in_jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs.queue")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!((in_jobs, count(&db.pool, "queue").await), (20, 0));
}

/// A queue whose pool can be pointed elsewhere while the relay runs (as a pool behind a DNS
/// name or a virtual IP can): the relay decides every round, so once the queue's pool is on
/// another database the next round publishes there instead of moving rows into its own.
struct Repointable {
    queues: [PgQueue; 2],
    current: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Repointable {
    fn queue(&self) -> &PgQueue {
        &self.queues[self.current.load(std::sync::atomic::Ordering::SeqCst)]
    }
}

impl Publisher for Repointable {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.queue().publish(batch).await
    }

    fn atomic_batches(&self) -> bool {
        true
    }

    fn as_pg_queue(&self) -> Option<&PgQueue> {
        Some(self.queue())
    }
}

#[tokio::test]
async fn a_queue_pool_that_moves_to_another_database_is_followed_at_the_next_round() {
    let outbox_db = TestDb::migrated().await;
    let other_db = TestDb::migrated().await;
    let current = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let publisher = Repointable {
        queues: [
            PgQueue::new(outbox_db.pool.clone()),
            PgQueue::new(other_db.pool.clone()),
        ],
        current: current.clone(),
    };
    let relay = Relay::builder(outbox_db.pool.clone(), publisher)
        .build()
        .unwrap();
    enqueue(&outbox_db.pool, "a", 5, 5).await;
    assert_eq!(relay.drain().await.unwrap().published, 10);
    assert_eq!(count(&outbox_db.pool, "queue").await, 10);

    current.store(1, std::sync::atomic::Ordering::SeqCst);
    enqueue(&outbox_db.pool, "b", 5, 5).await;
    assert_eq!(relay.drain().await.unwrap().published, 10);
    assert_eq!(count(&outbox_db.pool, "queue").await, 10);
    assert_eq!(count(&other_db.pool, "queue").await, 10);
}
