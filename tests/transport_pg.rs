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
