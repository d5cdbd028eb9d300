//! The built-in transport: a durable per-topic queue in PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgPool, Row};

use super::{PublishError, Publisher, Subscriber};
use crate::error::{Error, Result};
use crate::ident::Identifier;
use crate::migrate::DEFAULT_SCHEMA;
use crate::outbox::Envelope;

/// A message received from a [`PgQueue`]. Ack it, nack it, or dead-letter it; if the
/// consumer dies instead, it becomes visible again after the visibility timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery {
    /// The message.
    pub envelope: Envelope,
    /// 1 on the first delivery, 2 on the first redelivery... Also fences acks: an ack from
    /// an earlier delivery of a message that was redelivered since is refused.
    pub delivery: i32,
    /// The queue's own row id.
    pub(crate) queue_seq: i64,
}

/// The built-in PostgreSQL queue. Cheap to clone.
///
/// Per ordering key, at most one message is out for delivery at a time and keys are
/// delivered in publication order; messages without a key flow freely.
#[derive(Debug, Clone)]
pub struct PgQueue {
    pool: PgPool,
    inner: Arc<Statements>,
}

#[derive(Debug)]
struct Statements {
    schema: Identifier,
    publish: String,
    receive: String,
    ack: String,
    nack: String,
    dead_letter: String,
}

const COLUMNS: &str =
    "seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, deliveries";

impl PgQueue {
    /// The queue in the default schema.
    pub fn new(pool: PgPool) -> Self {
        Self::build(
            pool,
            Identifier::new("schema", DEFAULT_SCHEMA).expect("valid default"),
        )
    }

    /// The queue in `schema`.
    pub fn with_schema(pool: PgPool, schema: &str) -> Result<Self> {
        Ok(Self::build(pool, Identifier::new("schema", schema)?))
    }

    fn build(pool: PgPool, schema: Identifier) -> Self {
        let s = &schema;
        let inner = Statements {
            publish: format!(
                "INSERT INTO {s}.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::timestamptz[])"
            ),
            // Head of each key only: a later message of a key waits while an earlier one is
            // in the table (invisible, in flight, or waiting out a nack delay).
            receive: format!(
                "UPDATE {s}.queue AS q \
                 SET visible_at = now() + make_interval(secs => $3), deliveries = q.deliveries + 1 \
                 WHERE q.seq IN (\
                   SELECT o.seq FROM {s}.queue AS o \
                   WHERE o.topic = $1 AND o.visible_at <= now() \
                     AND (o.ordering_key IS NULL OR NOT EXISTS (\
                       SELECT 1 FROM {s}.queue AS p \
                       WHERE p.topic = o.topic AND p.ordering_key = o.ordering_key AND p.seq < o.seq)) \
                   ORDER BY o.seq LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 RETURNING {COLUMNS}"
            ),
            ack: format!("DELETE FROM {s}.queue WHERE seq = $1 AND deliveries = $2"),
            nack: format!(
                "UPDATE {s}.queue SET visible_at = now() + make_interval(secs => $3), last_error = $4 \
                 WHERE seq = $1 AND deliveries = $2"
            ),
            dead_letter: format!(
                "WITH moved AS (DELETE FROM {s}.queue WHERE seq = $1 AND deliveries = $2 RETURNING *) \
                 INSERT INTO {s}.queue_dead_letters \
                   (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, deliveries, last_error) \
                 SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, deliveries, $3 \
                 FROM moved"
            ),
            schema,
        };
        PgQueue {
            pool,
            inner: Arc::new(inner),
        }
    }

    /// The pool the queue lives in.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The `LISTEN` channel notified when messages arrive.
    pub fn channel(&self) -> String {
        format!("{}.queue", self.inner.schema.as_str())
    }

    /// Takes up to `max` visible messages of `topic`, hiding them for `visibility`.
    pub async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> Result<Vec<Delivery>> {
        let rows = sqlx::query(AssertSqlSafe(self.inner.receive.clone()))
            .bind(topic)
            .bind(i64::try_from(max).unwrap_or(i64::MAX))
            .bind(visibility.as_secs_f64())
            .fetch_all(&self.pool)
            .await?;
        let mut deliveries = rows
            .iter()
            .map(decode_delivery)
            .collect::<Result<Vec<_>>>()?;
        deliveries.sort_by_key(|d| d.queue_seq);
        Ok(deliveries)
    }

    /// Deletes a delivered message. `false` if this delivery is stale (the message was
    /// redelivered since, or already acked).
    pub async fn ack(&self, delivery: &Delivery) -> Result<bool> {
        let done = sqlx::query(AssertSqlSafe(self.inner.ack.clone()))
            .bind(delivery.queue_seq)
            .bind(delivery.delivery)
            .execute(&self.pool)
            .await?;
        tracing::debug!(message_id = %delivery.envelope.id, "pgbox queue ack");
        Ok(done.rows_affected() == 1)
    }

    /// Makes the message visible again after `delay`, recording `error`.
    pub async fn nack(&self, delivery: &Delivery, delay: Duration, error: &str) -> Result<bool> {
        let done = sqlx::query(AssertSqlSafe(self.inner.nack.clone()))
            .bind(delivery.queue_seq)
            .bind(delivery.delivery)
            .bind(delay.as_secs_f64())
            .bind(error.replace('\0', "\\0"))
            .execute(&self.pool)
            .await?;
        tracing::info!(message_id = %delivery.envelope.id, ?delay, error, "pgbox queue nack; will redeliver");
        Ok(done.rows_affected() == 1)
    }

    /// Moves the message to `queue_dead_letters`.
    pub async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool> {
        let done = sqlx::query(AssertSqlSafe(self.inner.dead_letter.clone()))
            .bind(delivery.queue_seq)
            .bind(delivery.delivery)
            .bind(error.replace('\0', "\\0"))
            .execute(&self.pool)
            .await?;
        tracing::warn!(message_id = %delivery.envelope.id, deliveries = delivery.delivery, error, "pgbox queue message dead-lettered");
        Ok(done.rows_affected() == 1)
    }
}

fn decode_delivery(row: &PgRow) -> Result<Delivery> {
    let deliveries: i32 = row.try_get("deliveries")?;
    let envelope = Envelope::from_row(row, deliveries - 1)?;
    Ok(Delivery {
        queue_seq: envelope.seq,
        envelope,
        delivery: deliveries,
    })
}

impl Publisher for PgQueue {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let result: Result<()> = async {
            sqlx::query(AssertSqlSafe(self.inner.publish.clone()))
                .bind(batch.iter().map(|e| e.id).collect::<Vec<_>>())
                .bind(batch.iter().map(|e| e.topic.as_str()).collect::<Vec<_>>())
                .bind(
                    batch
                        .iter()
                        .map(|e| e.ordering_key.as_deref())
                        .collect::<Vec<_>>(),
                )
                .bind(
                    batch
                        .iter()
                        .map(|e| e.payload.as_slice())
                        .collect::<Vec<_>>(),
                )
                .bind(
                    batch
                        .iter()
                        .map(|e| e.content_type.as_str())
                        .collect::<Vec<_>>(),
                )
                .bind(batch.iter().map(|e| Json(&e.headers)).collect::<Vec<_>>())
                .bind(batch.iter().map(|e| e.created_at).collect::<Vec<_>>())
                .execute(&self.pool)
                .await?;
            Ok(())
        }
        .await;
        // One statement: the whole batch is in, or none of it.
        let result = result.map_err(|e: Error| PublishError(e.to_string()));
        vec![result; batch.len()]
    }
}

impl Subscriber for PgQueue {
    type Delivery = Delivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> Result<Vec<Delivery>> {
        PgQueue::receive(self, topic, max, visibility).await
    }

    fn envelope<'d>(&self, delivery: &'d Delivery) -> &'d Envelope {
        &delivery.envelope
    }

    fn attempt(&self, delivery: &Delivery) -> i32 {
        delivery.delivery
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool> {
        PgQueue::ack(self, delivery).await
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration, error: &str) -> Result<bool> {
        PgQueue::nack(self, delivery, delay, error).await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool> {
        PgQueue::dead_letter(self, delivery, error).await
    }

    fn wake_channel(&self) -> Option<(PgPool, String)> {
        Some((self.pool.clone(), self.channel()))
    }
}
