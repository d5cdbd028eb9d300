//! The transactional outbox: write messages in the business transaction; the
//! [`Relay`](crate::Relay) publishes them after commit.

mod message;
pub(crate) mod trace;

use std::sync::Arc;

use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Postgres, Transaction};
use tracing::Instrument;
use uuid::Uuid;

pub use self::message::{Envelope, MAX_TOPIC_BYTES, Message};
pub use self::trace::TRACEPARENT;

use crate::error::Result;
use crate::ident::Identifier;
use crate::migrate::DEFAULT_SCHEMA;

/// Advisory-lock class for per-key enqueue locks (two-key form, so it never collides with an
/// application's single-key advisory locks).
pub(crate) const ENQUEUE_LOCK_CLASS: i32 = 0x7062_6f78; // "pbox"

/// Writes messages into the outbox table, inside the caller's transaction.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> anyhow::Result<()> {
/// use pgbox::{Message, Outbox};
/// let outbox = Outbox::new();
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE orders SET status = 'paid' WHERE id = 42").execute(&mut *tx).await?;
/// outbox
///     .enqueue(&mut tx, Message::json("payments", &serde_json::json!({"order": 42}))?.ordering_key("order-42"))
///     .await?;
/// tx.commit().await?; // the order update and the message commit together, or neither does
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Outbox {
    schema: Identifier,
    insert: Arc<str>,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Outbox {
    /// An outbox in the default schema.
    pub fn new() -> Self {
        Self::build(Identifier::new("schema", DEFAULT_SCHEMA).expect("valid default"))
    }

    /// An outbox in `schema` (validated, then always quoted).
    pub fn with_schema(schema: &str) -> Result<Self> {
        Ok(Self::build(Identifier::new("schema", schema)?))
    }

    fn build(schema: Identifier) -> Self {
        // One statement for any batch size. The `locks` sub-select takes the per-key
        // transaction locks (sorted, so two batch producers cannot deadlock) before any row
        // gets its seq: the aggregate must finish before the first row is produced. Holding
        // the lock to commit makes seq order equal commit order within a key.
        let insert = format!(
            "WITH msgs AS (\
               SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[]) \
                 WITH ORDINALITY AS m(message_id, topic, ordering_key, payload, content_type, headers, n)), \
             locks AS (\
               SELECT count(pg_advisory_xact_lock({class}, hashtext(k.topic || chr(31) || k.ordering_key))) AS n \
               FROM (SELECT DISTINCT topic, ordering_key FROM msgs WHERE ordering_key IS NOT NULL \
                     ORDER BY topic, ordering_key) AS k) \
             INSERT INTO {schema}.outbox (message_id, topic, ordering_key, payload, content_type, headers) \
             SELECT m.message_id, m.topic, m.ordering_key, m.payload, m.content_type, m.headers \
             FROM msgs AS m CROSS JOIN locks ORDER BY m.n",
            class = ENQUEUE_LOCK_CLASS,
        );
        Outbox {
            schema,
            insert: insert.into(),
        }
    }

    /// The schema of the outbox table.
    pub fn schema(&self) -> &str {
        self.schema.as_str()
    }

    /// Writes one message in the caller's transaction; returns its id. If the transaction
    /// rolls back, the message never existed.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        message: Message,
    ) -> Result<Uuid> {
        let id = message.id;
        self.enqueue_batch(tx, [message]).await?;
        Ok(id)
    }

    /// Writes many messages in one statement, in the given order; returns their ids.
    pub async fn enqueue_batch(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        messages: impl IntoIterator<Item = Message>,
    ) -> Result<Vec<Uuid>> {
        let messages: Vec<Message> = messages.into_iter().collect();
        for m in &messages {
            m.validate()?;
        }
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let n = messages.len();
        let mut ids = Vec::with_capacity(n);
        let mut topics = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut types = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        for mut m in messages {
            if !m.headers.contains_key(TRACEPARENT)
                && let Some(traceparent) = trace::outgoing()
            {
                m.headers.insert(TRACEPARENT.to_owned(), traceparent);
            }
            ids.push(m.id);
            topics.push(m.topic);
            keys.push(m.ordering_key);
            payloads.push(m.payload);
            types.push(m.content_type);
            headers.push(Json(m.headers));
        }
        let span = tracing::debug_span!("pgbox.outbox.enqueue", messages = n);
        sqlx::query(AssertSqlSafe(self.insert.clone()))
            .bind(&ids)
            .bind(&topics)
            .bind(&keys)
            .bind(&payloads)
            .bind(&types)
            .bind(&headers)
            .execute(&mut **tx)
            .instrument(span)
            .await?;
        tracing::debug!(messages = n, "pgbox outbox enqueued");
        Ok(ids)
    }
}
