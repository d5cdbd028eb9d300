//! Outgoing messages.

use std::collections::BTreeMap;

use serde::Serialize;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::inbox::Key;

use super::scheduled::{Due, MAX_SCHEDULE_DELAY, Schedule, ScheduleConflict};

/// The longest topic name, in bytes.
pub const MAX_TOPIC_BYTES: usize = 255;

/// The longest header name, in bytes.
pub const MAX_HEADER_NAME_BYTES: usize = 255;

/// The default limit on one message's size (payload plus headers), in bytes: 8 MiB. Brokers
/// have limits of their own (NATS 1 MiB by default, RabbitMQ 16 MiB in 4.x); set
/// [`Outbox::max_message_bytes`](crate::Outbox::max_message_bytes) to the smallest in the path.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// The largest value [`Outbox::max_message_bytes`](crate::Outbox::max_message_bytes) accepts:
/// 256 MiB, well under PostgreSQL's 1 GiB protocol message limit, past which the server drops
/// the connection instead of returning an error.
pub const MAX_MESSAGE_BYTES_LIMIT: usize = 256 * 1024 * 1024;

/// A message to publish: topic, optional ordering key, payload, headers, and an id.
///
/// The id is a UUIDv7 assigned when the message is built and kept through every re-publish:
/// it is the consumer side's default dedup key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub(crate) id: Uuid,
    pub(crate) topic: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) content_type: String,
    pub(crate) headers: BTreeMap<String, String>,
    /// When set, the message waits in `outbox_scheduled` until it is due.
    pub(crate) schedule: Option<Schedule>,
}

impl Message {
    /// A message whose payload is `value` serialized as JSON.
    ///
    /// NaN and infinite numbers are refused ([`Error::InvalidField`]): JSON has no form for
    /// them, and serde_json would silently write `null`.
    pub fn json<T: Serialize + ?Sized>(topic: impl Into<String>, value: &T) -> Result<Self> {
        if crate::json::has_non_finite(value) {
            return Err(Error::InvalidField {
                field: "payload",
                reason: "contains a NaN or infinite number, which JSON cannot represent (it would be sent as null)",
            });
        }
        let payload = serde_json::to_vec(value).map_err(Error::SerializePayload)?;
        Ok(Self::bytes(topic, payload).content_type("application/json"))
    }

    /// A message with a raw payload (`application/octet-stream` unless changed).
    pub fn bytes(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Message {
            id: Uuid::now_v7(),
            topic: topic.into(),
            ordering_key: None,
            payload: payload.into(),
            content_type: "application/octet-stream".into(),
            headers: BTreeMap::new(),
            schedule: None,
        }
    }

    /// Publish no earlier than `at`, by the **database's** clock: the relay promotes the
    /// message once the server's `now()` reaches `at`. A time in the past means "due now".
    ///
    /// The message then takes its place in its ordering key's order when it is promoted,
    /// not when it was enqueued: it never holds back the key's other messages (see the
    /// guide's "Scheduled messages" chapter). Replaces an earlier
    /// [`deliver_after`](Self::deliver_after).
    pub fn deliver_at(mut self, at: OffsetDateTime) -> Self {
        self.schedule_mut().due = Due::At(at);
        self
    }

    /// Publish no earlier than `delay` after the enqueuing statement, by the **database's**
    /// clock (`statement_timestamp() + delay`, computed on the server: the application's
    /// clock plays no part). At most [`MAX_SCHEDULE_DELAY`]; zero means "due now".
    /// Replaces an earlier [`deliver_at`](Self::deliver_at).
    pub fn deliver_after(mut self, delay: std::time::Duration) -> Self {
        self.schedule_mut().due = Due::After(delay);
        self
    }

    /// At most one pending scheduled message per (topic, `key`): enqueuing another under the
    /// same key (in another transaction, or the same) meets the pending one, and
    /// [`on_schedule_conflict`](Self::on_schedule_conflict) says which wins. Validated like
    /// an inbox key (not empty, no NUL, at most [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES)). Needs
    /// [`deliver_at`](Self::deliver_at) or [`deliver_after`](Self::deliver_after).
    ///
    /// A message already promoted (due, handed to the relay) is no longer pending: a new one
    /// under its key is scheduled anew.
    pub fn schedule_key(mut self, key: impl Into<String>) -> Self {
        self.schedule_mut().key = Some(key.into());
        self
    }

    /// What to do when a message is already pending under this message's
    /// [`schedule_key`](Self::schedule_key) (default [`ScheduleConflict::Replace`]).
    pub fn on_schedule_conflict(mut self, conflict: ScheduleConflict) -> Self {
        self.schedule_mut().conflict = conflict;
        self
    }

    /// Whether the message is scheduled (waits until it is due).
    pub fn is_scheduled(&self) -> bool {
        self.schedule.as_ref().is_some_and(|s| s.due != Due::Unset)
    }

    fn schedule_mut(&mut self) -> &mut Schedule {
        self.schedule.get_or_insert_with(Schedule::default)
    }

    /// The entity this message is about. Messages of one key are published one at a time,
    /// in commit order; messages without a key have no order.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Addresses the message to these destinations of a [`Router`](crate::Router), in
    /// addition to those its routes give its topic: sets the
    /// [`DESTINATIONS_HEADER`](crate::DESTINATIONS_HEADER) header (names comma-separated).
    /// A name the router does not know makes it refuse the message (the relay retries, then
    /// dead-letters it, replayable), never drop it silently. Replaces an earlier call.
    pub fn destinations<I, S>(self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let names: Vec<String> = names.into_iter().map(|n| n.as_ref().to_owned()).collect();
        self.header(crate::fanout::DESTINATIONS_HEADER, names.join(","))
    }

    /// Sets the payload's content type.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = content_type.into();
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The message id (UUIDv7).
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Payload plus header bytes: what [`Outbox::max_message_bytes`](crate::Outbox::max_message_bytes)
    /// limits.
    pub fn size(&self) -> usize {
        self.payload.len()
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }

    pub(crate) fn validate(&self, max_bytes: usize) -> Result<()> {
        let size = self.size();
        if size > max_bytes {
            return Err(Error::TooLarge {
                what: "message",
                len: size,
                max: max_bytes,
            });
        }
        let bad = |field, reason| Err(Error::InvalidField { field, reason });
        if self.topic.is_empty() {
            return bad("topic", "must not be empty");
        }
        if self.topic.len() > MAX_TOPIC_BYTES {
            return bad("topic", "longer than 255 bytes");
        }
        if self.topic.contains('\0') {
            return bad("topic", "contains a NUL byte");
        }
        if let Some(key) = &self.ordering_key {
            Key::new(key.as_str()).validate()?;
        }
        if let Some(schedule) = &self.schedule {
            if let Some(key) = &schedule.key {
                Key::new(key.as_str()).validate()?;
            }
            match schedule.due {
                Due::Unset if schedule.key.is_some() => {
                    return bad(
                        "schedule key",
                        "needs a due time (deliver_at or deliver_after)",
                    );
                }
                Due::Unset => {
                    return bad("schedule", "needs a due time (deliver_at or deliver_after)");
                }
                Due::After(delay) if delay > MAX_SCHEDULE_DELAY => {
                    return bad("deliver_after", "longer than 100 years");
                }
                _ => {}
            }
        }
        if self.content_type.chars().any(char::is_control) {
            return bad("content type", "contains a control character");
        }
        for (name, value) in &self.headers {
            if name.is_empty() {
                return bad("header name", "must not be empty");
            }
            if name.len() > MAX_HEADER_NAME_BYTES {
                return bad("header name", "longer than 255 bytes");
            }
            // What every broker's header model accepts: no controls (CR/LF would split a
            // NATS header block), no whitespace, no ':' (the name/value separator on the wire).
            if name
                .chars()
                .any(|c| c.is_control() || c.is_whitespace() || c == ':')
            {
                return bad(
                    "header name",
                    "contains a control character, whitespace or ':'",
                );
            }
            if value.contains(['\0', '\r', '\n']) {
                return bad("header value", "contains NUL, CR or LF");
            }
        }
        Ok(())
    }
}

/// A message as stored in the outbox or a queue, handed to publishers and consumers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Envelope {
    /// Position in the outbox (publication order).
    pub seq: i64,
    /// The id assigned at enqueue.
    pub id: Uuid,
    /// The topic.
    pub topic: String,
    /// The ordering key, if any.
    pub ordering_key: Option<String>,
    /// The payload.
    pub payload: Vec<u8>,
    /// The payload's content type.
    pub content_type: String,
    /// Headers, including `traceparent` when one was propagated.
    pub headers: BTreeMap<String, String>,
    /// When the producer's transaction enqueued it; for a scheduled message, its due time
    /// (or its enqueue time, if that was later): the publish lag is counted from there.
    pub created_at: OffsetDateTime,
    /// Publish attempts that failed before this one.
    pub attempts: i32,
}

impl Envelope {
    /// An envelope for `topic` with `payload`: how a transport outside this crate rebuilds a
    /// received message. The other fields start empty (no key, `application/octet-stream`,
    /// no headers, created now, seq and attempts 0); set them directly, they are public.
    ///
    /// ```
    /// let mut e = pgbox::Envelope::new(uuid::Uuid::now_v7(), "orders", br#"{"order":42}"#.to_vec());
    /// e.content_type = "application/json".into();
    /// e.ordering_key = Some("order-42".into());
    /// assert_eq!(e.json::<serde_json::Value>().unwrap()["order"], 42);
    /// ```
    pub fn new(id: Uuid, topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Envelope {
            seq: 0,
            id,
            topic: topic.into(),
            ordering_key: None,
            payload: payload.into(),
            content_type: "application/octet-stream".into(),
            headers: BTreeMap::new(),
            created_at: OffsetDateTime::now_utc(),
            attempts: 0,
        }
    }

    /// Decodes a row of the outbox or the queue (same columns); `attempts` is passed in
    /// because the two tables count attempts differently.
    pub(crate) fn from_row(row: &sqlx::postgres::PgRow, attempts: i32) -> Result<Self> {
        use sqlx::Row;
        let headers: sqlx::types::Json<BTreeMap<String, String>> = row.try_get("headers")?;
        Ok(Envelope {
            seq: row.try_get("seq")?,
            id: row.try_get("message_id")?,
            topic: row.try_get("topic")?,
            ordering_key: row.try_get("ordering_key")?,
            payload: row.try_get("payload")?,
            content_type: row.try_get("content_type")?,
            headers: headers.0,
            created_at: row.try_get("created_at")?,
            attempts,
        })
    }

    /// Deserializes a JSON payload.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload).map_err(Error::DeserializePayload)
    }
}
