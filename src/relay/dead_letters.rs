//! Outbox dead letters: list, replay (in order), discard.
//!
//! Two kinds share the table. The table relay's (positive `seq`: the outbox row's) hold the
//! later messages of their key until they are replayed or discarded. The WAL relay's
//! (negative `seq`: their WAL position, see [`WalRelay`](crate::WalRelay)) hold nothing.

use std::collections::BTreeMap;

use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgPool, Row};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::ident::DEFAULT_SCHEMA;
use crate::ident::Identifier;
use crate::outbox::{Message, WAL_ASLEEP_LOCK_CLASS, wal};
use crate::relay::wal::{WAL_SEQ_CEILING, slot_claim};

/// A message that failed every publish attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its original position: positive for the table outbox's (replay puts it back there),
    /// negative for the WAL outbox's (its WAL position; replay emits it into the WAL again).
    pub seq: i64,
    /// Its id.
    pub message_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Ordering key. A table outbox dead letter (positive `seq`) holds the later messages of
    /// its key until it is replayed or discarded; a WAL one holds nothing.
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

    /// Up to `limit` dead letters: the WAL outbox's first, in WAL order (an earlier
    /// release's before the current ones, as [`replay`](Self::replay) orders them), then the
    /// table outbox's, in outbox order.
    pub async fn list(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        // The SQL twin of `wal_order`: table ones last; of the WAL ones, an earlier release's
        // (from the ceiling to 0, later lower) first, by minus `seq`; then the current ones
        // (below the ceiling), by `seq`. Never negates a current one (i64::MIN would overflow).
        let sql = format!(
            "SELECT seq, message_id, topic, ordering_key, headers, pg_catalog.octet_length(payload) AS payload_bytes, \
                    attempts, last_error, created_at, dead_at \
             FROM {}.outbox_dead_letters \
             ORDER BY seq > 0, seq < $2, \
                      CASE WHEN seq > 0 OR seq < $2 THEN seq ELSE -seq END \
             LIMIT $1",
            self.schema
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(limit)
            .bind(WAL_SEQ_CEILING)
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

    /// Gives these dead letters another life, with fresh attempt counts, in one
    /// transaction. Returns how many were found.
    ///
    /// - **Table outbox dead letters** go back into the outbox at their original positions:
    ///   each is published before the messages its key held back.
    /// - **WAL outbox dead letters** are emitted into the WAL again (one logical-decoding
    ///   message per 64 MiB, in their original WAL order), committed with the replay: the
    ///   [`WalRelay`](crate::WalRelay) publishes them, in that order, after whatever of their
    ///   keys it published meanwhile (a WAL dead letter held nothing back). No table relay is
    ///   needed. Refused ([`Error::WalSlot`]), with nothing replayed, when no logical
    ///   replication slot of this database would read them: none with its publication that
    ///   is not invalidated (`wal_status = 'lost'`) and not claimed by another schema's
    ///   relay.
    pub async fn replay(&self, ids: &[Uuid]) -> Result<u64> {
        let s = &self.schema;
        let mut tx = crate::pooler::begin(&self.pool, None).await?;
        let sql = format!(
            "DELETE FROM {s}.outbox_dead_letters WHERE message_id = ANY($1) AND seq < 0 \
             RETURNING seq, message_id, topic, ordering_key, payload, content_type, headers"
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .persistent(false)
            .bind(ids)
            .fetch_all(&mut *tx)
            .await?;
        let wal_replayed = rows.len() as u64;
        if !rows.is_empty() {
            // A slot a WalRelay of this schema could read: pgoutput, in this database, not
            // invalidated (an invalidated slot never reads again), with its publication, not
            // claimed by another schema's relay.
            let read: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots s \
                   JOIN pg_catalog.pg_publication p ON p.pubname = s.slot_name \
                 WHERE s.slot_type = 'logical' AND s.plugin = 'pgoutput' \
                   AND s.database = pg_catalog.current_database() \
                   AND coalesce(s.wal_status, 'lost') <> 'lost' \
                   AND coalesce(pg_catalog.obj_description(p.oid, 'pg_publication'), $1) = $1)",
            )
            .persistent(false)
            .bind(slot_claim(self.schema.as_str()))
            .fetch_one(&mut *tx)
            .await?;
            if !read {
                return Err(Error::WalSlot {
                    slot: "(none)".into(),
                    reason: format!(
                        "no logical replication slot of this database would read schema {}'s \
                         WAL outbox (none exists with its publication, or each is invalidated \
                         (wal_status lost) or another schema's), and replaying a WAL dead \
                         letter emits it into the WAL again; nothing was replayed; create the \
                         slot (WalSlot::create or `pgbox wal create-slot`) and run a WalRelay, \
                         then replay",
                        self.schema.as_str()
                    ),
                });
            }
            let mut wal_rows: Vec<(i64, Message)> = rows
                .iter()
                .map(|r| {
                    let headers: Json<BTreeMap<String, String>> = r.try_get("headers")?;
                    Ok((
                        r.try_get("seq")?,
                        Message {
                            id: r.try_get("message_id")?,
                            topic: r.try_get("topic")?,
                            ordering_key: r.try_get("ordering_key")?,
                            payload: r.try_get("payload")?,
                            content_type: r.try_get("content_type")?,
                            headers: headers.0,
                            schedule: None,
                        },
                    ))
                })
                .collect::<Result<_>>()?;
            wal_rows.sort_by_key(|(seq, _)| wal_order(*seq));
            let messages: Vec<Message> = wal_rows.into_iter().map(|(_, m)| m).collect();
            for chunk in chunks_by_bytes(&messages, EMIT_BYTES) {
                self.emit(&mut tx, chunk).await?;
            }
        }
        let sql = format!(
            "WITH moved AS (DELETE FROM {s}.outbox_dead_letters WHERE message_id = ANY($1) AND seq > 0 RETURNING *) \
             INSERT INTO {s}.outbox (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at) \
             OVERRIDING SYSTEM VALUE \
             SELECT seq, message_id, topic, ordering_key, payload, content_type, headers, created_at FROM moved"
        );
        let table_replayed = sqlx::query(AssertSqlSafe(sql))
            .bind(ids)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        let n = wal_replayed + table_replayed;
        tracing::info!(
            replayed = n,
            into_the_wal = wal_replayed,
            "pgbox dead letters replayed"
        );
        Ok(n)
    }

    /// One logical-decoding message of `messages`, as [`Outbox`](crate::Outbox) emits them in
    /// [`OutboxMode::Wal`](crate::OutboxMode::Wal), waking a WAL relay that sleeps.
    async fn emit(&self, tx: &mut sqlx::PgConnection, messages: &[Message]) -> Result<()> {
        let schema = self.schema.as_str();
        sqlx::query(
            "WITH e AS MATERIALIZED (\
               SELECT pg_catalog.pg_logical_emit_message(true, $1::text, $2::bytea) AS lsn) \
             SELECT pg_catalog.pg_notify($3::text, '') FROM e \
             WHERE e.lsn IS NOT NULL \
               AND NOT pg_catalog.pg_try_advisory_xact_lock_shared($4::int4, pg_catalog.hashtext($5::text))",
        )
        .persistent(false)
        .bind(wal::prefix(schema))
        .bind(wal::encode(messages))
        .bind(wal::channel(schema))
        .bind(WAL_ASLEEP_LOCK_CLASS)
        .bind(schema)
        .execute(&mut *tx)
        .await?;
        Ok(())
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

/// Payload bytes per replay emit, far below the 1 GiB a bytea parameter may hold.
const EMIT_BYTES: usize = 64 * 1024 * 1024;

/// Consecutive slices of `messages` of at most `max` payload bytes (a larger message gets a
/// slice of its own).
fn chunks_by_bytes(messages: &[Message], max: usize) -> Vec<&[Message]> {
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, m) in messages.iter().enumerate() {
        if i > start && bytes + m.size() > max {
            chunks.push(&messages[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += m.size();
    }
    if start < messages.len() {
        chunks.push(&messages[start..]);
    }
    chunks
}

/// The original order of WAL dead letters: a current `seq` is `i64::MIN` plus the WAL
/// position (increasing); an earlier release's, between [`WAL_SEQ_CEILING`] and 0, was minus
/// the position times 1,024 minus the index (decreasing), and comes first: it is older.
fn wal_order(seq: i64) -> (bool, i64) {
    if seq < WAL_SEQ_CEILING {
        (true, seq)
    } else {
        (false, seq.wrapping_neg())
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
