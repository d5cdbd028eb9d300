//! The NATS JetStream transport (feature `nats`, on [`async_nats`]).
//!
//! [`Nats`] is both a [`Publisher`] for the relay and a [`Subscriber`] for the
//! [`Consumer`](crate::Consumer) runner. Clone it freely: clones share one client, which
//! reconnects by itself after the connection breaks.
//!
//! # Streams and subjects
//!
//! A message of topic `T` is published on subject `<prefix>.<token(T)>` (default prefix
//! `pgbox`), where `token` keeps ASCII letters, digits and `-` and writes every other byte
//! as `_` plus two hex digits (`orders.paid` → `orders_2epaid`), so any topic is one valid
//! subject token. With [`NatsBuilder::declare`] on (the default), pgbox creates, if missing:
//! - the stream (default `PGBOX`) on `<prefix>.>`, file storage, limits retention with
//!   [`NatsBuilder::max_age`] (default 7 days) and the duplicate window
//!   [`NatsBuilder::duplicate_window`] (default 2 minutes), and [`NatsBuilder::replicas`]
//!   copies (default 1; 3 on a cluster);
//! - the dead-letter stream `<stream>_DEAD` on `<prefix>-dead.>`;
//! - per topic, a durable pull consumer `<durable>_<token(T)>` (default durable `pgbox`)
//!   filtered on the topic's subject, explicit acks, `ack_wait` =
//!   [`NatsBuilder::ack_wait`], unlimited deliveries (the consumer runner decides when to
//!   dead-letter).
//!
//! An existing stream or consumer is used as it is (its settings are not changed). Turn
//! `declare` off to create them yourself.
//!
//! # Publishing
//!
//! Every message carries `Nats-Msg-Id` = the outbox message id, so a relay re-publish within
//! the stream's duplicate window is dropped by the server (and reported `Ok`). Acks are
//! awaited concurrently: a batch is sent, then its acks are collected. Headers: pgbox's
//! fields travel as JSON in `Pgbox-Meta` (content type, ordering key, creation time, and the
//! message headers, byte-exact whatever their names); `traceparent` and `tracestate` are
//! also set as plain NATS headers for other tools. Messages larger than the server's
//! `max_payload` (1 MiB by default) fail; raise it in the server configuration if needed.
//!
//! # Receiving
//!
//! `receive` pulls from the durable consumer and returns as soon as it has messages: first up
//! to `max` of those already there, without waiting; if there are none, it waits up to
//! [`NatsBuilder::receive_wait`] for one, then takes up to `max - 1` more of those there by
//! then, without waiting. So a receive returns at once with what there is, or when the first
//! message arrives, or with nothing after `receive_wait`. A pull whose reply does not come (a
//! connection cut with the request in flight) is given up 1 s past the server's own deadline;
//! messages the server had sent it come back after `ack_wait`.
//!
//! The `visibility` argument does not apply: the consumer's `ack_wait` is the visibility
//! timeout (a message not acked in time is redelivered). The attempt is JetStream's
//! `num_delivered`. A nack with a delay is a `NAK` with that delay (the server redelivers no
//! earlier). A dead letter is copied (with publish ack) to the dead-letter stream with the
//! error in `Pgbox-Error`, then terminated (`TERM`) so it is never redelivered; inspect them
//! with [`Nats::dead_letters`] or any NATS tool.
//!
//! **Order**: a stream keeps publication order per subject, but a pull consumer hands
//! messages to whoever pulls, and redeliveries come back later. pgbox does not claim
//! per-key order on NATS; use
//! [`Inbox::process_in_order`](crate::Inbox::process_in_order) where order matters.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, Context};
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::join_all;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::sync::OnceCell;
use uuid::Uuid;

use super::{PublishError, Publisher, Subscriber, truncate};
use crate::error::{Error, Result};
use crate::outbox::{Envelope, TRACEPARENT};

const TRANSPORT: &str = "nats";
const META: &str = "Pgbox-Meta";
const ERROR: &str = "Pgbox-Error";
const DELIVERIES: &str = "Pgbox-Deliveries";
const MSG_ID: &str = "Nats-Msg-Id";
/// The message id on dead-letter copies, whose `Nats-Msg-Id` also names the delivery.
const ID: &str = "Pgbox-Id";
const MAX_ERROR_BYTES: usize = 4096;
/// Acks awaited at once; bigger batches go in chunks of this size.
const ACK_CHUNK: usize = 1000;
/// How long past the server's own deadline a pull waits for its reply before it counts as
/// lost (see `Nats::pull`).
const LOST_PULL: Duration = Duration::from_secs(1);

/// The pause before connection attempt number `attempts` (from 1): none before the first,
/// then 100 ms more per failed attempt, up to 2 s.
fn reconnect_delay(attempts: usize) -> Duration {
    Duration::from_millis((attempts.saturating_sub(1) as u64 * 100).min(2000))
}

fn broker_error(what: &str, e: impl fmt::Display) -> Error {
    Error::Transport {
        transport: TRANSPORT,
        message: format!("{what}: {e}"),
    }
}

/// Builder for [`Nats`].
#[derive(Debug, Clone)]
pub struct NatsBuilder {
    url: String,
    stream: String,
    subject_prefix: String,
    durable: String,
    declare: bool,
    ack_wait: Duration,
    max_ack_pending: i64,
    max_age: Duration,
    duplicate_window: Duration,
    replicas: usize,
    receive_wait: Duration,
    inactive_threshold: Option<Duration>,
}

impl NatsBuilder {
    /// The stream's name (default `PGBOX`); the dead letters go to `<stream>_DEAD`.
    pub fn stream(mut self, name: impl Into<String>) -> Self {
        self.stream = name.into();
        self
    }

    /// The subject prefix (default `pgbox`): topic `T` is `<prefix>.<token(T)>`.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// The durable consumer name's prefix (default `pgbox`). Consumers sharing it share the
    /// topic's messages; give each consuming service its own.
    pub fn durable(mut self, name: impl Into<String>) -> Self {
        self.durable = name.into();
        self
    }

    /// Create the streams and consumers when missing (default `true`).
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// How long a delivered message may stay unacked before it is redelivered (default
    /// 30 s): the visibility timeout. Must exceed the handler's worst case.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// Unacked messages per consumer (default 1000).
    pub fn max_ack_pending(mut self, n: i64) -> Self {
        self.max_ack_pending = n;
        self
    }

    /// How long the stream keeps messages, acked or not (default 7 days).
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// The stream's duplicate window for `Nats-Msg-Id` (default 2 minutes).
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// Copies of each stream kept on a JetStream cluster (default 1; 3 or 5 on a cluster of
    /// at least as many servers). Applies when pgbox creates the streams; their durable
    /// consumers get the stream's replicas.
    pub fn replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    /// How long `receive` waits for a message when none is there (default 200 ms).
    pub fn receive_wait(mut self, wait: Duration) -> Self {
        self.receive_wait = wait;
        self
    }

    /// Delete a durable consumer after it has been idle this long (default: never). For
    /// tests and throwaway topics.
    pub fn inactive_threshold(mut self, idle: Duration) -> Self {
        self.inactive_threshold = Some(idle);
        self
    }

    /// Validates the settings. Connects lazily, on first use.
    pub fn build(self) -> Result<Nats> {
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        };
        if !name_ok(&self.stream) || !name_ok(&self.durable) {
            return Err(Error::InvalidConfig(
                "nats stream and durable names: ASCII letters, digits, '-' and '_'".into(),
            ));
        }
        if self.subject_prefix.is_empty()
            || self
                .subject_prefix
                .split('.')
                .any(|t| t.is_empty() || t.contains(['*', '>', ' ']))
        {
            return Err(Error::InvalidConfig(
                "nats subject prefix must be dot-separated non-empty tokens without wildcards"
                    .into(),
            ));
        }
        if self.replicas == 0 {
            return Err(Error::InvalidConfig(
                "nats replicas must be at least 1".into(),
            ));
        }
        if self.receive_wait < Duration::from_millis(10) || self.ack_wait.is_zero() {
            return Err(Error::InvalidConfig(
                "nats receive_wait must be at least 10 ms and ack_wait positive".into(),
            ));
        }
        Ok(Nats {
            inner: Arc::new(Inner {
                config: self,
                client: OnceCell::new(),
                consumers: StdMutex::new(HashMap::new()),
                streams: OnceCell::new(),
            }),
        })
    }
}

/// The NATS JetStream transport: see the [module docs](self). Cheap to clone.
#[derive(Clone)]
pub struct Nats {
    inner: Arc<Inner>,
}

impl fmt::Debug for Nats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nats")
            .field("stream", &self.inner.config.stream)
            .field("subject_prefix", &self.inner.config.subject_prefix)
            .finish_non_exhaustive()
    }
}

type PullConsumer = jetstream::consumer::Consumer<jetstream::consumer::pull::Config>;

struct Inner {
    config: NatsBuilder,
    client: OnceCell<(async_nats::Client, Context)>,
    consumers: StdMutex<HashMap<String, PullConsumer>>,
    streams: OnceCell<()>,
}

/// A message received from [`Nats`]: settle it with `ack`, `nack` or `dead_letter`.
pub struct NatsDelivery {
    envelope: Envelope,
    attempt: i32,
    message: jetstream::Message,
}

impl fmt::Debug for NatsDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsDelivery")
            .field("message_id", &self.envelope.id)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

impl NatsDelivery {
    /// The message.
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// JetStream's delivery count: 1 for a first delivery.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }
}

/// A dead-lettered message, as [`Nats::dead_letters`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsDeadLetter {
    /// The message.
    pub envelope: Envelope,
    /// The error given when it was dead-lettered.
    pub error: Option<String>,
    /// Deliveries before it was dead-lettered.
    pub deliveries: i32,
    /// Its sequence number in the dead-letter stream.
    pub sequence: u64,
}

/// pgbox's fields, as JSON in one header: exact whatever the header names and values.
#[derive(Serialize, Deserialize)]
struct Meta {
    content_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ordering_key: Option<String>,
    created_at: i128,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// One subject token (and consumer-name part) for any topic, reversible and collision-free.
pub fn token(topic: &str) -> String {
    let mut out = String::with_capacity(topic.len());
    for b in topic.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(b as char);
        } else {
            out.push_str(&format!("_{b:02x}"));
        }
    }
    out
}

impl Nats {
    /// A transport for the server at `url` (`nats://host:port`), or for any server of a
    /// cluster given as a comma-separated list (`nats://a:4222,nats://b:4222`): the client
    /// connects to one of them and fails over to the others (and to the servers the
    /// cluster announces).
    pub fn builder(url: impl Into<String>) -> NatsBuilder {
        NatsBuilder {
            url: url.into(),
            stream: "PGBOX".into(),
            subject_prefix: "pgbox".into(),
            durable: "pgbox".into(),
            declare: true,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
            max_age: Duration::from_secs(7 * 24 * 3600),
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
            receive_wait: Duration::from_millis(200),
            inactive_threshold: None,
        }
    }

    /// The subject of `topic`.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}.{}", self.inner.config.subject_prefix, token(topic))
    }

    /// The dead-letter subject of `topic`.
    pub fn dead_letter_subject(&self, topic: &str) -> String {
        format!("{}-dead.{}", self.inner.config.subject_prefix, token(topic))
    }

    fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.inner.config.stream)
    }

    async fn context(&self) -> Result<&Context> {
        let (_, context) = self
            .inner
            .client
            .get_or_try_init(|| async {
                let client = async_nats::ConnectOptions::new()
                    .connection_timeout(Duration::from_secs(10))
                    // `attempts` counts the attempt about to be made, from 1: the first
                    // connect and the first try after a break go at once.
                    .reconnect_delay_callback(reconnect_delay)
                    .event_callback(|event| async move {
                        tracing::info!(%event, "pgbox nats connection event");
                    })
                    .connect(
                        self.inner
                            .config
                            .url
                            .split(',')
                            .map(str::trim)
                            .collect::<Vec<_>>(),
                    )
                    .await
                    .map_err(|e| broker_error("connect", e))?;
                tracing::info!(url = %self.inner.config.url, "pgbox nats connected");
                let context = jetstream::new(client.clone());
                Ok::<_, Error>((client, context))
            })
            .await?;
        if self.inner.config.declare {
            self.inner
                .streams
                .get_or_try_init(|| self.declare_streams(context))
                .await?;
        }
        Ok(context)
    }

    async fn declare_streams(&self, context: &Context) -> Result<()> {
        let config = &self.inner.config;
        for (name, subjects) in [
            (
                config.stream.clone(),
                format!("{}.>", config.subject_prefix),
            ),
            (
                self.dead_stream(),
                format!("{}-dead.>", config.subject_prefix),
            ),
        ] {
            context
                .get_or_create_stream(jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![subjects],
                    max_age: config.max_age,
                    duplicate_window: config.duplicate_window,
                    storage: jetstream::stream::StorageType::File,
                    allow_direct: true,
                    num_replicas: config.replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| broker_error(&format!("create stream {name}"), e))?;
        }
        tracing::debug!(stream = %config.stream, "pgbox nats streams ready");
        Ok(())
    }

    /// The largest payload the server takes, once connected.
    pub async fn max_payload(&self) -> Result<usize> {
        self.context().await?;
        let (client, _) = self.inner.client.get().expect("connected");
        Ok(client.server_info().max_payload)
    }

    /// Creates the topic's durable consumer if missing (idempotent), so that messages
    /// published from now on are kept for it even before the first `receive`.
    pub async fn declare_topic(&self, topic: &str) -> Result<()> {
        self.consumer(topic).await.map(drop)
    }

    async fn consumer(&self, topic: &str) -> Result<PullConsumer> {
        if let Some(c) = self.inner.consumers.lock().expect("consumers").get(topic) {
            return Ok(c.clone());
        }
        let context = self.context().await?;
        let config = &self.inner.config;
        let name = format!("{}_{}", config.durable, token(topic));
        let stream = context
            .get_stream(&config.stream)
            .await
            .map_err(|e| broker_error("get stream", e))?;
        let consumer_config = jetstream::consumer::pull::Config {
            durable_name: Some(name.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: -1,
            max_ack_pending: config.max_ack_pending,
            filter_subject: self.subject(topic),
            inactive_threshold: config.inactive_threshold.unwrap_or_default(),
            ..Default::default()
        };
        let consumer: PullConsumer = if config.declare {
            stream
                .get_or_create_consumer(&name, consumer_config)
                .await
                .map_err(|e| broker_error(&format!("create consumer {name}"), e))?
        } else {
            stream
                .get_consumer(&name)
                .await
                .map_err(|e| broker_error(&format!("get consumer {name}"), e))?
        };
        tracing::info!(topic, consumer = %name, "pgbox nats consumer ready");
        self.inner
            .consumers
            .lock()
            .expect("consumers")
            .insert(topic.to_owned(), consumer.clone());
        Ok(consumer)
    }

    /// One pull of up to `max` messages of `topic` into `out`: without waiting (`wait`
    /// `None`: the server answers at once with what it has) or for up to `wait`. Every step
    /// is bounded: a reply lost with a cut connection (the client reconnects and
    /// resubscribes, but nothing answers a request sent before the cut; a no-wait pull has no
    /// timer of its own) ends the pull after [`LOST_PULL`] past the server's own deadline.
    /// Messages the server sent to a pull given up on come back after `ack_wait`.
    async fn pull(
        &self,
        topic: &str,
        consumer: &PullConsumer,
        max: usize,
        wait: Option<Duration>,
        out: &mut Vec<NatsDelivery>,
    ) -> Result<()> {
        let started = match wait {
            None => {
                tokio::time::timeout(LOST_PULL, consumer.fetch().max_messages(max).messages()).await
            }
            Some(wait) => {
                tokio::time::timeout(
                    LOST_PULL,
                    consumer.batch().max_messages(max).expires(wait).messages(),
                )
                .await
            }
        };
        let mut batch = match started {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                // The consumer may be gone (deleted, or expired while idle): look it up
                // again next time.
                self.inner
                    .consumers
                    .lock()
                    .expect("consumers")
                    .remove(topic);
                return Err(broker_error("pull", e));
            }
            Err(_) => return Err(broker_error("pull", "request not sent in time")),
        };
        // Bounded: at most `max` messages, each within `wait` + LOST_PULL.
        let patience = wait.unwrap_or_default() + LOST_PULL;
        loop {
            let message = match tokio::time::timeout(patience, batch.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(None) => return Ok(()),
                Ok(Some(Err(e))) => return Err(broker_error("pull", e)),
                Err(_) => {
                    return Err(broker_error(
                        "pull",
                        format!("no reply within {patience:?} (connection lost?)"),
                    ));
                }
            };
            let attempt = message.info().map(|i| i.delivered).unwrap_or(1);
            let empty = HeaderMap::new();
            let headers = message.headers.as_ref().unwrap_or(&empty);
            match decode(topic, headers, &message.payload) {
                Ok(envelope) => out.push(NatsDelivery {
                    envelope,
                    attempt: i32::try_from(attempt).unwrap_or(i32::MAX),
                    message,
                }),
                Err(e) => {
                    // Not a pgbox message: never redeliver it.
                    tracing::warn!(topic, error = %e, "pgbox nats: undecodable message terminated");
                    let _ = tokio::time::timeout(LOST_PULL, message.ack_with(AckKind::Term)).await;
                }
            }
        }
    }

    /// Up to `max` dead letters of `topic`, oldest first (read from the dead-letter stream,
    /// which keeps them).
    pub async fn dead_letters(&self, topic: &str, max: usize) -> Result<Vec<NatsDeadLetter>> {
        let context = self.context().await?;
        let mut stream = context
            .get_stream(self.dead_stream())
            .await
            .map_err(|e| broker_error("get dead-letter stream", e))?;
        let state = stream
            .info()
            .await
            .map_err(|e| broker_error("dead-letter stream info", e))?
            .state
            .clone();
        let subject = self.dead_letter_subject(topic);
        let mut out = Vec::new();
        let mut seq = state.first_sequence.max(1);
        // Bounded: one lookup per matching message, at most `max`.
        while out.len() < max && seq <= state.last_sequence {
            let found = stream
                .direct_get_next_for_subject(&subject, Some(seq))
                .await;
            let Ok(message) = found else { break };
            seq = message.sequence + 1;
            let envelope = decode(topic, &message.headers, &message.payload)?;
            out.push(NatsDeadLetter {
                envelope,
                error: message.headers.get(ERROR).map(|v| v.as_str().to_owned()),
                deliveries: message
                    .headers
                    .get(DELIVERIES)
                    .and_then(|v| v.as_str().parse().ok())
                    .unwrap_or(0),
                sequence: message.sequence,
            });
        }
        Ok(out)
    }
}

fn headers(envelope: &Envelope) -> Result<HeaderMap, PublishError> {
    let meta = Meta {
        content_type: envelope.content_type.clone(),
        ordering_key: envelope.ordering_key.clone(),
        created_at: envelope.created_at.unix_timestamp_nanos(),
        headers: envelope.headers.clone(),
    };
    let json = serde_json::to_string(&meta)
        .map_err(|e| PublishError::refused(format!("message {}: {e}", envelope.id)))?;
    let mut map = HeaderMap::new();
    map.insert(MSG_ID, envelope.id.to_string().as_str());
    map.insert(META, json.as_str());
    for name in [TRACEPARENT, "tracestate"] {
        if let Some(v) = envelope.headers.get(name)
            && !v.contains(['\r', '\n'])
        {
            map.insert(name, v.as_str());
        }
    }
    Ok(map)
}

/// A failed JetStream publish, by whose fault. The server's answer about this message (over
/// `max_payload`, an API error from the stream) refuses it; no answer in time, a broken
/// connection, the client's in-flight limit, and "no responders" are an outage.
///
/// "No responders" (`StreamNotFound`) means that nothing took the subject at that moment:
/// no stream captures it, or the stream has no leader (a JetStream cluster electing one,
/// JetStream restarting). The two cannot be told apart from the publish, and neither is the
/// message's fault: pgbox's one stream takes every topic's subject, so a missing stream (a
/// deleted stream, `declare(false)` without creating it) stops every topic alike. It is an
/// outage: the relay backs off and reports it (metrics, a log line per round) and nothing is
/// dead-lettered; create the stream and the messages flow.
///
/// JetStream's own answer is read by its status: a 5xx (503 "JetStream system temporarily
/// unavailable" while a cluster has no quorum or the stream no leader, "insufficient
/// resources", JetStream not enabled) says the server cannot take messages now, whatever
/// the message; it is an outage too. A 4xx is about this message, and refuses it.
fn nats_publish_error(what: &str, e: &jetstream::context::PublishError) -> PublishError {
    use jetstream::context::PublishErrorKind as Kind;
    let message = format!("{what}: {e}");
    match e.kind() {
        Kind::TimedOut | Kind::BrokenPipe | Kind::MaxAckPending | Kind::StreamNotFound => {
            PublishError::unavailable(message)
        }
        Kind::Other if api_error(e).is_some_and(|api| api.code() >= 500) => {
            PublishError::unavailable(message)
        }
        _ => PublishError::refused(message),
    }
}

/// The JetStream API error inside a publish error, if the server answered with one.
fn api_error(e: &jetstream::context::PublishError) -> Option<&jetstream::Error> {
    std::error::Error::source(e)?.downcast_ref::<jetstream::Error>()
}

fn decode(topic: &str, headers: &HeaderMap, payload: &[u8]) -> Result<Envelope> {
    let bad = |reason| Error::InvalidField {
        field: "nats message",
        reason,
    };
    let id = headers
        .get(ID)
        .or_else(|| headers.get(MSG_ID))
        .and_then(|v| Uuid::parse_str(v.as_str()).ok())
        .ok_or(bad("no Nats-Msg-Id, or not a UUID"))?;
    let meta: Meta = headers
        .get(META)
        .and_then(|v| serde_json::from_str(v.as_str()).ok())
        .ok_or(bad("no Pgbox-Meta header"))?;
    Ok(Envelope {
        seq: 0,
        id,
        topic: topic.to_owned(),
        ordering_key: meta.ordering_key,
        payload: payload.to_vec(),
        content_type: meta.content_type,
        headers: meta.headers,
        created_at: OffsetDateTime::from_unix_timestamp_nanos(meta.created_at)
            .map_err(|_| bad("creation time out of range"))?,
        attempts: 0,
    })
}

impl Publisher for Nats {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let context = match self.context().await {
            Ok(c) => c,
            Err(e) => {
                // Not the messages' fault (connect, the streams' declaration): an outage.
                tracing::debug!(error = %e, "pgbox nats publish: not connected");
                return vec![Err(PublishError::unavailable(e.to_string())); batch.len()];
            }
        };
        let mut results = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(ACK_CHUNK) {
            // Send the chunk, then await its acks together.
            let mut pending = Vec::with_capacity(chunk.len());
            for envelope in chunk {
                let sent = match headers(envelope) {
                    Ok(h) => context
                        .send_publish(
                            self.subject(&envelope.topic),
                            jetstream::message::PublishMessage::build()
                                .payload(Bytes::copy_from_slice(&envelope.payload))
                                .headers(h),
                        )
                        .await
                        .map_err(|e| nats_publish_error("publish failed", &e)),
                    Err(e) => Err(e),
                };
                pending.push(sent);
            }
            let acks = join_all(pending.into_iter().map(|p| async move {
                match p {
                    Ok(ack) => ack.await.map_err(|e| nats_publish_error("publish ack", &e)),
                    Err(e) => Err(e),
                }
            }))
            .await;
            for (envelope, ack) in chunk.iter().zip(acks) {
                let result = match ack {
                    Ok(ack) => {
                        tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, stream_seq = ack.sequence, duplicate = ack.duplicate, "pgbox nats published");
                        Ok(())
                    }
                    Err(e) => {
                        tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, error = %e, "pgbox nats publish failed");
                        Err(e)
                    }
                };
                results.push(result);
            }
        }
        results
    }
}

impl Subscriber for Nats {
    type Delivery = NatsDelivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        _visibility: Duration,
    ) -> Result<Vec<NatsDelivery>> {
        let consumer = self.consumer(topic).await?;
        let max = max.max(1);
        let mut out = Vec::new();
        // What is there now, without waiting. An error here (the consumer at its
        // `max_ack_pending`, say) is left to the waiting pull below to report.
        match self.pull(topic, &consumer, max, None, &mut out).await {
            Ok(()) if !out.is_empty() => return Ok(out),
            Ok(()) => {}
            Err(e) if out.is_empty() => {
                tracing::debug!(topic, error = %e, "pgbox nats no-wait pull failed; waiting pull next");
            }
            Err(e) => {
                tracing::warn!(topic, error = %e, "pgbox nats pull ended early");
                return Ok(out);
            }
        }
        // Nothing yet: wait for one message, which ends the pull as soon as it comes (a
        // pull for more would hold it until the rest came or the pull expired).
        let wait = self.inner.config.receive_wait;
        if let Err(e) = self.pull(topic, &consumer, 1, Some(wait), &mut out).await {
            if out.is_empty() {
                return Err(e);
            }
            tracing::warn!(topic, error = %e, "pgbox nats pull ended early");
        }
        // Then whatever came with it, without waiting.
        if out.len() == 1
            && max > 1
            && let Err(e) = self.pull(topic, &consumer, max - 1, None, &mut out).await
        {
            tracing::debug!(topic, error = %e, "pgbox nats no-wait pull after a wait failed");
        }
        Ok(out)
    }

    fn envelope<'d>(&self, delivery: &'d NatsDelivery) -> &'d Envelope {
        &delivery.envelope
    }

    fn attempt(&self, delivery: &NatsDelivery) -> i32 {
        delivery.attempt
    }

    async fn ack(&self, delivery: &NatsDelivery) -> Result<bool> {
        delivery
            .message
            .ack()
            .await
            .map_err(|e| broker_error("ack", e))?;
        tracing::debug!(message_id = %delivery.envelope.id, "pgbox nats ack");
        Ok(true)
    }

    async fn nack(&self, delivery: &NatsDelivery, delay: Duration, error: &str) -> Result<bool> {
        let delay = (!delay.is_zero()).then_some(delay);
        delivery
            .message
            .ack_with(AckKind::Nak(delay))
            .await
            .map_err(|e| broker_error("nak", e))?;
        tracing::info!(message_id = %delivery.envelope.id, ?delay, error, "pgbox nats nak; will redeliver");
        Ok(true)
    }

    async fn dead_letter(&self, delivery: &NatsDelivery, error: &str) -> Result<bool> {
        let context = self.context().await?;
        let envelope = &delivery.envelope;
        let mut map = headers(envelope).map_err(|e| broker_error("dead letter", e.to_string()))?;
        map.insert(
            ERROR,
            truncate(&error.replace(['\r', '\n'], " "), MAX_ERROR_BYTES),
        );
        map.insert(DELIVERIES, delivery.attempt.to_string().as_str());
        // Deduplicated per delivery, not per message: a message dead-lettered again after a
        // replay must not be dropped as a duplicate of its first dead letter.
        map.insert(ID, envelope.id.to_string().as_str());
        map.insert(
            MSG_ID,
            format!("{}-dead-{}", envelope.id, delivery.attempt).as_str(),
        );
        context
            .send_publish(
                self.dead_letter_subject(&envelope.topic),
                jetstream::message::PublishMessage::build()
                    .payload(Bytes::copy_from_slice(&envelope.payload))
                    .headers(map),
            )
            .await
            .map_err(|e| broker_error("publish dead letter", e))?
            .await
            .map_err(|e| broker_error("dead letter publish ack", e))?;
        delivery
            .message
            .ack_with(AckKind::Term)
            .await
            .map_err(|e| broker_error("term", e))?;
        tracing::warn!(message_id = %envelope.id, attempt = delivery.attempt, error, "pgbox nats message dead-lettered");
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_connect_attempt_does_not_wait() {
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(100));
        assert_eq!(reconnect_delay(100), Duration::from_secs(2));
    }

    #[test]
    fn tokens_are_subject_safe_and_distinct() {
        assert_eq!(token("orders"), "orders");
        assert_eq!(token("orders.paid"), "orders_2epaid");
        assert_eq!(token("a_b"), "a_5fb");
        assert_eq!(token("a b*>"), "a_20b_2a_3e");
        assert_eq!(token("ü"), "_c3_bc");
        // `_` is escaped too, so an escape cannot be forged by a topic.
        assert_ne!(token("a.b"), token("a_2eb"));
    }
}
