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

/// The queue's own statements run at READ COMMITTED whatever the pool's sessions default to.
/// Concurrent workers receive, nack and ack on a pool whose sessions default to REPEATABLE
/// READ, then SERIALIZABLE: at those levels a receive or an ack that meets a row another
/// worker changed since its snapshot fails with a serialization error (and a failed ack
/// leaves its message hidden until its visibility timeout). Every call must succeed, and
/// every message be acked once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_statements_ignore_the_pools_default_isolation() {
    use pgbox::transport::Publisher;
    use std::sync::{Arc, Mutex};
    const MESSAGES: usize = 300;
    const WORKERS: usize = 6;
    let h = harness().await;
    for level in ["repeatable read", "serializable"] {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(WORKERS as u32 + 2)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "SET default_transaction_isolation = '{level}'"
                    )))
                    .execute(conn)
                    .await
                    .map(drop)
                })
            })
            .connect(&h.db.url())
            .await
            .unwrap();
        let shown: String = sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(shown, level);
        let queue = PgQueue::new(pool.clone());
        let topic = format!("isolation-{}", uuid::Uuid::now_v7().simple());
        // Half the messages keyed (the receive's head-of-key check), half free.
        let batch: Vec<pgbox::Envelope> = (0..MESSAGES)
            .map(|i| {
                let mut e = pgbox::transport::conformance::envelope(&topic, format!("{i}"));
                if i % 2 == 0 {
                    e.ordering_key = Some(format!("key-{}", i % 10));
                }
                e
            })
            .collect();
        assert!(queue.publish(&batch).await.iter().all(Result::is_ok));
        let errors = Arc::new(Mutex::new(Vec::<String>::new()));
        let acked = Arc::new(Mutex::new(Vec::<String>::new()));
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut workers = Vec::new();
        for _ in 0..WORKERS {
            let (queue, topic) = (queue.clone(), topic.clone());
            let (errors, acked) = (errors.clone(), acked.clone());
            workers.push(tokio::spawn(async move {
                while acked.lock().unwrap().len() < MESSAGES && std::time::Instant::now() < deadline
                {
                    let deliveries = match queue.receive(&topic, 4, Duration::from_secs(60)).await {
                        Ok(d) => d,
                        Err(e) => {
                            errors.lock().unwrap().push(format!("receive: {e}"));
                            continue;
                        }
                    };
                    if deliveries.is_empty() {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    let settled = deliveries.iter().map(|d| {
                        let (queue, errors, acked) = (&queue, &errors, &acked);
                        async move {
                            let payload = String::from_utf8(d.envelope.payload.clone()).unwrap();
                            // Every third message is nacked on its first delivery.
                            let result =
                                if d.delivery == 1 && payload.parse::<usize>().unwrap() % 3 == 0 {
                                    queue.nack(d, Duration::ZERO, "once").await.map(|_| ())
                                } else {
                                    queue.ack(d).await.map(|fresh| {
                                        assert!(fresh, "stale ack of {payload}");
                                        acked.lock().unwrap().push(payload.clone());
                                    })
                                };
                            if let Err(e) = result {
                                errors
                                    .lock()
                                    .unwrap()
                                    .push(format!("settle {payload}: {e}"));
                            }
                        }
                    });
                    futures_util::future::join_all(settled).await;
                }
            }));
        }
        for w in workers {
            w.await.unwrap();
        }
        let errors = errors.lock().unwrap().clone();
        assert!(
            errors.is_empty(),
            "{level}: {} failed calls: {errors:?}",
            errors.len()
        );
        let mut acked = acked.lock().unwrap().clone();
        acked.sort();
        let before = acked.len();
        acked.dedup();
        assert_eq!(before, acked.len(), "{level}: a message was acked twice");
        assert_eq!(acked.len(), MESSAGES, "{level}: every message acked");
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue WHERE topic = $1")
            .bind(&topic)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
        assert_eq!(left, 0, "{level}");
        pool.close().await;
    }
}

/// A receive dropped at any point leaves no transaction open on its connection. sqlx 0.9.0's
/// begin, dropped while its `BEGIN` is on the wire, leaves the session inside a transaction
/// that nothing ends, and the pool lends the connection on (transact-rs/sqlx#4393): behind a
/// transaction pooler (where every queue statement is a transaction) that pinned a server
/// connection and ran later statements inside the stale transaction. Receives through a
/// one-connection pool are dropped after a growing number of yields, so that some are
/// dropped mid-`BEGIN`; after each, the connection, back in the pool, must be outside any
/// transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receive_leaves_no_transaction_open() {
    let h = harness().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&h.db.url())
        .await
        .unwrap();
    let queue = PgQueue::new(pool.clone()).pooler(pgbox::Pooler::Transaction);
    let topic = format!("dropped-{}", uuid::Uuid::now_v7().simple());
    let mut dropped = 0;
    // Dropped after 0, 2, 4... µs: a local round trip takes tens of µs, so some of the
    // drops land while the BEGIN's answer is awaited.
    for micros in (0..1200).step_by(2) {
        let receive = queue.receive(&topic, 1, Duration::from_secs(30));
        let until = std::time::Instant::now() + Duration::from_micros(micros);
        let finished = tokio::select! {
            biased;
            r = receive => { r.unwrap(); true }
            _ = async {
                while std::time::Instant::now() < until {
                    tokio::task::yield_now().await;
                }
            } => false,
        };
        dropped += usize::from(!finished);
        // The connection is back once the pool lends it again.
        let mut conn = pool.acquire().await.unwrap();
        // One simple-protocol statement: its own transaction starts with it, unless one was
        // left open before.
        let row = sqlx::raw_sql("SELECT now() <> statement_timestamp(), now()::text")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let (inside, xact_start): (bool, String) = (row.get(0), row.get(1));
        assert!(
            !inside,
            "after a receive dropped at {micros} µs, the connection is inside a \
             transaction begun at {xact_start}"
        );
    }
    assert!(dropped > 0, "no receive was dropped");
}

/// Receives and acks commit without waiting for their WAL flush, unless asked to; publishes
/// and nacks always wait. Read at each commit by a deferred trigger on the queue (this
/// test's own database), through a plain pool, a pool behind which every statement runs in a
/// transaction of its own (`Pooler::Transaction`), and a pool whose sessions default to
/// `REPEATABLE READ` (the queue then opens `READ COMMITTED` transactions). The setting never
/// outlives the statement's transaction: the pool's one session is back at `on` afterwards.
#[tokio::test]
async fn receipts_commit_unflushed_unless_asked_to_wait() {
    use pgbox::Pooler;
    use pgbox::transport::Publisher;
    let h = harness().await;
    sqlx::raw_sql(
        "CREATE TABLE commit_settings (arm text, op text, synchronous_commit text); \
         CREATE FUNCTION note_commit_setting() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO commit_settings VALUES (pg_catalog.current_setting('application_name'), \
             TG_OP, pg_catalog.current_setting('synchronous_commit')); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER note_commit_setting AFTER INSERT OR UPDATE OR DELETE \
           ON pgbox.queue DEFERRABLE INITIALLY DEFERRED \
           FOR EACH ROW EXECUTE FUNCTION note_commit_setting();",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    let arms = [
        ("plain", Pooler::None, "", false),
        ("pooler", Pooler::Transaction, "", false),
        ("repeatable", Pooler::None, "repeatable read", false),
        ("waits", Pooler::None, "", true),
    ];
    for (arm, pooler, isolation, wait) in arms {
        let options = h.db.options.clone().application_name(arm).options(
            [("default_transaction_isolation", isolation)]
                .into_iter()
                .filter(|(_, v)| !v.is_empty()),
        );
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        let queue = PgQueue::new(pool.clone())
            .pooler(pooler)
            .wait_for_flush(wait);
        let topic = format!("receipts-{arm}");
        let batch: Vec<pgbox::Envelope> = (0..3)
            .map(|i| pgbox::transport::conformance::envelope(&topic, format!("{i}")))
            .collect();
        assert!(queue.publish(&batch).await.iter().all(Result::is_ok));
        let deliveries = queue
            .receive(&topic, 3, Duration::from_secs(60))
            .await
            .expect("receive");
        assert_eq!(deliveries.len(), 3);
        let acks =
            futures_util::future::join_all(deliveries[..2].iter().map(|d| queue.ack(d))).await;
        assert!(acks.iter().all(|a| matches!(a, Ok(true))), "{acks:?}");
        assert!(
            queue
                .nack(&deliveries[2], Duration::ZERO, "again")
                .await
                .expect("nack")
        );
        let session: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(session, "on", "{arm}: the setting outlived its transaction");
        pool.close().await;
        let seen: Vec<(String, String)> = sqlx::query_as(
            "SELECT op || ' ' || synchronous_commit, count(*)::text FROM commit_settings \
             WHERE arm = $1 GROUP BY 1 ORDER BY 1",
        )
        .bind(arm)
        .fetch_all(&h.db.pool)
        .await
        .unwrap();
        let expected: &[(&str, &str)] = if wait {
            &[("DELETE on", "2"), ("INSERT on", "3"), ("UPDATE on", "4")]
        } else {
            &[
                ("DELETE off", "2"),
                ("INSERT on", "3"),
                ("UPDATE off", "3"),
                ("UPDATE on", "1"),
            ]
        };
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(what, n)| ((*what).to_owned(), (*n).to_owned()))
            .collect();
        assert_eq!(seen, expected, "{arm}");
    }
}
