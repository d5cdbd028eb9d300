//! What a test's transactions wrote into the outbox.

use std::collections::BTreeMap;
use std::fmt;

use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::error::Result;
use crate::ident::{DEFAULT_SCHEMA, Identifier};

/// Reads the messages enqueued into the outbox table since the probe was started: what a
/// test's code committed (and, by their absence, what it rolled back).
///
/// The start is a position in the outbox's sequence, not a time: a message whose row was
/// inserted after [`start`](Self::start) is seen once its transaction commits, whenever it
/// began. Read before a relay runs: a relay deletes what it published (unless it keeps
/// published rows, [`RelayBuilder::keep_published`](crate::RelayBuilder::keep_published)).
/// The table outbox only: what an [`OutboxMode::Wal`](crate::OutboxMode::Wal) outbox emits
/// is not seen.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> anyhow::Result<()> {
/// use pgbox::{Message, Outbox, testing::OutboxProbe};
/// let probe = OutboxProbe::start(&pool).await?;
/// let mut tx = pool.begin().await?;
/// Outbox::new()
///     .enqueue(&mut tx, Message::json("orders", &serde_json::json!({"id": 7}))?.ordering_key("7"))
///     .await?;
/// tx.commit().await?;
/// let enqueued = probe.enqueued().await?;
/// let order: serde_json::Value = enqueued.assert_enqueued("orders", Some("7")).json()?;
/// assert_eq!(order["id"], 7);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct OutboxProbe {
    pool: PgPool,
    since: i64,
    select: String,
}

impl OutboxProbe {
    /// A probe of the outbox in the default schema, starting now.
    pub async fn start(pool: &PgPool) -> Result<Self> {
        Self::start_in(pool, DEFAULT_SCHEMA).await
    }

    /// A probe of the outbox in `schema`, starting now.
    pub async fn start_in(pool: &PgPool, schema: &str) -> Result<Self> {
        let schema = Identifier::pgbox_schema(schema)?;
        // The identity sequence's last value: every row inserted from now on gets a larger
        // seq, committed or not yet. (NULL before the first insert ever.)
        let since: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COALESCE(pg_catalog.pg_sequence_last_value(\
               pg_catalog.pg_get_serial_sequence('{schema}.outbox', 'seq')::regclass), 0)"
        )))
        .fetch_one(pool)
        .await?;
        let select = format!(
            "SELECT seq, message_id, topic, ordering_key, payload, content_type, headers \
             FROM {schema}.outbox WHERE seq > $1 ORDER BY seq"
        );
        Ok(OutboxProbe {
            pool: pool.clone(),
            since,
            select,
        })
    }

    /// The messages committed since the start, in enqueue order.
    pub async fn enqueued(&self) -> Result<Enqueued> {
        let mut conn = self.pool.acquire().await?;
        self.enqueued_in(&mut conn).await
    }

    /// The messages since the start that `conn` sees: inside a transaction, its own
    /// uncommitted messages too (`probe.enqueued_in(&mut tx)` before `tx.commit()`).
    pub async fn enqueued_in(&self, conn: &mut PgConnection) -> Result<Enqueued> {
        let rows = sqlx::query(AssertSqlSafe(self.select.clone()))
            .bind(self.since)
            .fetch_all(conn)
            .await?;
        let messages = rows
            .iter()
            .map(|row| {
                let Json(headers): Json<BTreeMap<String, String>> = row.try_get("headers")?;
                Ok(EnqueuedMessage {
                    seq: row.try_get("seq")?,
                    id: row.try_get("message_id")?,
                    topic: row.try_get("topic")?,
                    ordering_key: row.try_get("ordering_key")?,
                    payload: row.try_get("payload")?,
                    content_type: row.try_get("content_type")?,
                    headers,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()?;
        Ok(Enqueued { messages })
    }
}

/// One message a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnqueuedMessage {
    /// Its position in the outbox.
    pub seq: i64,
    /// The message id.
    pub id: Uuid,
    /// The topic.
    pub topic: String,
    /// The ordering key, if any.
    pub ordering_key: Option<String>,
    /// The payload.
    pub payload: Vec<u8>,
    /// The payload's content type.
    pub content_type: String,
    /// The headers.
    pub headers: BTreeMap<String, String>,
}

impl EnqueuedMessage {
    /// The payload decoded from JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload).map_err(crate::Error::DeserializePayload)
    }
}

impl fmt::Display for EnqueuedMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ", self.topic)?;
        match &self.ordering_key {
            Some(key) => write!(f, "key {key:?}")?,
            None => f.write_str("no key")?,
        }
        write!(f, " id {} ({} bytes", self.id, self.payload.len())?;
        if let Ok(text) = std::str::from_utf8(&self.payload)
            && text.len() <= 200
        {
            write!(f, ": {text}")?;
        }
        f.write_str(")")
    }
}

/// The messages an [`OutboxProbe`] found, with assertions that panic with what was there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enqueued {
    messages: Vec<EnqueuedMessage>,
}

impl Enqueued {
    /// All of them, in enqueue order.
    pub fn messages(&self) -> &[EnqueuedMessage] {
        &self.messages
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Those of `topic`, in enqueue order.
    pub fn on_topic(&self, topic: &str) -> Vec<&EnqueuedMessage> {
        self.messages.iter().filter(|m| m.topic == topic).collect()
    }

    /// The first message of `topic` with ordering key `key` (`None`: without a key).
    ///
    /// # Panics
    /// When there is none, listing what was enqueued.
    #[track_caller]
    pub fn assert_enqueued(&self, topic: &str, key: Option<&str>) -> &EnqueuedMessage {
        match self
            .messages
            .iter()
            .find(|m| m.topic == topic && m.ordering_key.as_deref() == key)
        {
            Some(m) => m,
            None => panic!(
                "expected a message on {topic:?} with {}; enqueued: {self}",
                match key {
                    Some(k) => format!("key {k:?}"),
                    None => "no key".to_owned(),
                }
            ),
        }
    }

    /// # Panics
    /// When any message of `topic` was enqueued, listing them.
    #[track_caller]
    pub fn assert_not_enqueued(&self, topic: &str) {
        let found = self.on_topic(topic);
        if !found.is_empty() {
            panic!(
                "expected nothing on {topic:?}; enqueued: {}",
                Enqueued {
                    messages: found.into_iter().cloned().collect()
                }
            );
        }
    }

    /// # Panics
    /// When anything was enqueued, listing it.
    #[track_caller]
    pub fn assert_nothing_enqueued(&self) {
        if !self.is_empty() {
            panic!("expected nothing enqueued; enqueued: {self}");
        }
    }
}

impl fmt::Display for Enqueued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.messages.is_empty() {
            return f.write_str("nothing");
        }
        for (i, m) in self.messages.iter().enumerate() {
            write!(f, "{}{m}", if i == 0 { "" } else { "; " })?;
        }
        Ok(())
    }
}
