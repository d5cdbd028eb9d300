//! Outbox dead letters: list, replay (in order), discard.

use std::collections::BTreeMap;

use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::Result;
use crate::ident::DEFAULT_SCHEMA;
use crate::ident::Identifier;

/// A message that failed every publish attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its original outbox position; replay puts it back there.
    pub seq: i64,
    /// Its id.
    pub message_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Ordering key: later messages of this key wait until it is replayed or discarded.
    pub ordering_key: Option<String>,
    /// Headers.
    pub headers: BTreeMap<String, String>,
    /// Payload size in bytes.
    pub payload_bytes: i32,
    /// Attempts made.
    pub attempts: i32,
    /// The last publish error.
    pub last_error: Option<String>,
    /// When it was enqueued.
    pub created_at: OffsetDateTime,
    /// When it was dead-lettered.
    pub dead_at: OffsetDateTime,
}

/// Operator access to the outbox's dead letters. (The built-in queue's are
/// [`QueueDeadLetters`](crate::transport::QueueDeadLetters).)
#[derive(Debug, Clone)]
pub struct DeadLetters {
    pool: PgPool,
    schema: Identifier,
}

impl DeadLetters {
    /// Dead letters of the default schema.
    pub fn new(pool: PgPool) -> Self {
        DeadLetters {
            pool,
            schema: Identifier::pgbox_schema(DEFAULT_SCHEMA).expect("valid default"),
        }
    }

    /// Dead letters of `schema`.
    pub fn with_schema(pool: PgPool, schema: &str) -> Result<Self> {
        Ok(DeadLetters {
            pool,
            schema: Identifier::pgbox_schema(schema)?,
        })
    }

    /// Up to `limit` dead letters, oldest first.
    pub async fn list(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        let sql = format!(
            "SELECT seq, message_id, topic, ordering_key, headers, pg_catalog.octet_length(payload) AS payload_bytes, \
                    attempts, last_error, created_at, dead_at \
             FROM {}.outbox_dead_letters ORDER BY seq LIMIT $1",
            self.schema
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(decode).collect()
    }

    /// One dead letter and its payload, if it exists.
    pub async fn get(&self, id: Uuid) -> Result<Option<(DeadLetter, Vec<u8>)>> {
        let sql = format!(
            "SELECT seq, message_id, topic, ordering_key, headers, pg_catalog.octet_length(payload) AS payload_bytes, \
                    attempts, last_error, created_at, dead_at, payload \
             FROM {}.outbox_dead_letters WHERE message_id = $1",
            self.schema
        );
        let row = sqlx::query(AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| Ok((decode(&r)?, r.try_get("payload")?)))
            .transpose()
    }

    /// Moves these dead letters back into the outbox at their original positions, with
    /// fresh attempt counts: each is published before the messages its key held back.
    /// Returns how many were found.
    pub async fn replay(&self, ids: &[Uuid]) -> Result<u64> {
        let s = &self.schema;
        let sql = format!(
            "WITH moved AS (DELETE FROM {s}.outbox_dead_letters WHERE message_id = ANY($1) RETURNING *) \
             INSERT INTO {s}.outbox (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at) \
             OVERRIDING SYSTEM VALUE \
             SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at FROM moved"
        );
        let n = sqlx::query(AssertSqlSafe(sql))
            .bind(ids)
            .execute(&self.pool)
            .await?
            .rows_affected();
        tracing::info!(replayed = n, "pgbox dead letters replayed");
        Ok(n)
    }

    /// Replays every dead letter.
    pub async fn replay_all(&self) -> Result<u64> {
        let sql = format!("SELECT message_id FROM {}.outbox_dead_letters", self.schema);
        let ids: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?;
        self.replay(&ids).await
    }

    /// Deletes these dead letters for good, releasing their keys. Returns how many existed.
    pub async fn discard(&self, ids: &[Uuid]) -> Result<u64> {
        let sql = format!(
            "DELETE FROM {}.outbox_dead_letters WHERE message_id = ANY($1)",
            self.schema
        );
        let n = sqlx::query(AssertSqlSafe(sql))
            .bind(ids)
            .execute(&self.pool)
            .await?
            .rows_affected();
        tracing::warn!(discarded = n, "pgbox dead letters discarded");
        Ok(n)
    }
}

fn decode(r: &sqlx::postgres::PgRow) -> Result<DeadLetter> {
    let headers: Json<BTreeMap<String, String>> = r.try_get("headers")?;
    Ok(DeadLetter {
        seq: r.try_get("seq")?,
        message_id: r.try_get("message_id")?,
        topic: r.try_get("topic")?,
        ordering_key: r.try_get("ordering_key")?,
        headers: headers.0,
        payload_bytes: r.try_get("payload_bytes")?,
        attempts: r.try_get("attempts")?,
        last_error: r.try_get("last_error")?,
        created_at: r.try_get("created_at")?,
        dead_at: r.try_get("dead_at")?,
    })
}
