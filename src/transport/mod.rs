//! Where the relay publishes to, and where consumers receive from.
//!
//! [`Publisher`] is the relay's side: publish a batch, confirm each message. The built-in
//! [`PgQueue`] implements it and also the receiving side (visibility timeout, ack, nack,
//! dead letters), so a whole pipeline runs on PostgreSQL alone. Broker adapters implement
//! both traits for their client: `transport::rabbitmq` (feature `rabbitmq`) and
//! `transport::nats` (feature `nats`) and `transport::kafka` (feature `kafka`). Every transport is checked by the same
//! `transport::conformance` suite (feature `testing`).

#[cfg(feature = "testing")]
pub mod conformance;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
mod postgres;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;

pub use self::postgres::{Delivery, PgQueue, QueueDeadLetter, QueueDeadLetters};

use crate::error::Result;
use crate::outbox::Envelope;

/// `s` cut to at most `max` bytes, at a character boundary (error texts the brokers carry
/// in a header).
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Why a message could not be published, and whose fault it was.
///
/// The relay treats the two kinds differently. A message the transport
/// [refused](Self::refused) counts a failed attempt and is dead-lettered after the relay's
/// `max_attempts`. A transport that is [unavailable](Self::unavailable) (cannot be reached,
/// does not answer, connection lost) is an outage: the relay backs off and tries again, for as
/// long as the outage lasts, and never counts it against the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    kind: PublishErrorKind,
    message: String,
}

/// Whose fault a [`PublishError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// The transport answered and refused this message, or the message cannot be sent as it
    /// is: a failed attempt of the message.
    Refused,
    /// The transport could not be reached or did not answer: an outage, not the message's
    /// failure.
    Unavailable,
}

impl PublishError {
    /// The transport refused this message (counts toward the relay's `max_attempts`).
    pub fn refused(message: impl Into<String>) -> Self {
        Self {
            kind: PublishErrorKind::Refused,
            message: message.into(),
        }
    }

    /// The transport could not be reached (an outage: retried, never counted as an attempt).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            kind: PublishErrorKind::Unavailable,
            message: message.into(),
        }
    }

    /// Whose fault it is.
    pub fn kind(&self) -> PublishErrorKind {
        self.kind
    }

    /// Whether the transport was unavailable (an outage) rather than refusing the message.
    pub fn is_unavailable(&self) -> bool {
        self.kind == PublishErrorKind::Unavailable
    }

    /// The error's text.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Publishes batches of outbox messages with per-message confirmation.
pub trait Publisher: Send + Sync {
    /// Publishes `batch`, returning one result per message, in order. A message reported
    /// `Ok` is deleted from the outbox (or marked published); an `Err` is retried with
    /// backoff. A result list of the wrong length counts every message as failed.
    fn publish(
        &self,
        batch: &[Envelope],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send;

    /// Whether a batch is published all or nothing, in order (one database statement, one
    /// broker transaction). The relay then hands over several messages of one ordering key
    /// in one call. Otherwise (the default) it calls [`publish`](Self::publish) in waves, so
    /// that no message of a key is sent before the previous one was confirmed.
    fn atomic_batches(&self) -> bool {
        false
    }

    /// The built-in queue this publisher writes into, if it is one. A
    /// [`Relay`](crate::Relay) whose outbox lives in the same database as that queue then
    /// moves each batch into it inside the round's own transaction (one statement; payloads
    /// never leave the server; a relay that dies mid-round leaves no copy behind) instead of
    /// calling [`publish`](Self::publish). On another database, or without `USAGE` on the
    /// queue's schema and `INSERT` on the queue, the relay publishes as usual (it asks every
    /// round).
    ///
    /// [`PgQueue`] returns itself. A wrapper that only forwards to a queue may return it too;
    /// one that does anything on the way (transforms, counts, duplicates) must keep the
    /// default, `None`, or its `publish` is bypassed.
    fn as_pg_queue(&self) -> Option<&PgQueue> {
        None
    }

    /// How long one call of [`publish`](Self::publish) may take, when the publisher bounds
    /// its own calls (a [`Router`](crate::Router): its `destination_timeout`). A relay whose
    /// own bound on a call is not longer refuses to build
    /// ([`Error::InvalidConfig`](crate::Error::InvalidConfig)): it would drop calls the
    /// publisher is still entitled to finish, and publish their messages again. `None` (the
    /// default): the publisher does not say.
    fn call_timeout(&self) -> Option<Duration> {
        None
    }
}

/// Refuses a relay's bound on one publish call (`relay_timeout`) that is not longer than the
/// publisher's own ([`Publisher::call_timeout`]).
pub(crate) fn check_call_timeout<P: Publisher>(
    publisher: &P,
    relay_timeout: Duration,
) -> Result<()> {
    match publisher.call_timeout() {
        Some(own) if own >= relay_timeout => Err(crate::Error::InvalidConfig(format!(
            "the publisher takes up to {own:?} per call (e.g. a Router's destination_timeout), \
             not less than the relay's publish timeout of {relay_timeout:?}: the relay would \
             drop its calls and publish their messages again; lower the one or raise the other"
        ))),
        _ => Ok(()),
    }
}

/// A publisher that accepts everything and sends nothing: the database's ceiling in
/// benchmarks, and a sink in tests.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiscardPublisher;

impl Publisher for DiscardPublisher {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        vec![Ok(()); batch.len()]
    }

    fn atomic_batches(&self) -> bool {
        true
    }
}

/// The receiving side of a transport, as the [`Consumer`](crate::Consumer) runner uses it:
/// receive with a visibility timeout, then ack, nack with a delay, or dead-letter.
pub trait Subscriber: Send + Sync {
    /// A received message plus whatever the transport needs to settle it.
    type Delivery: Send + Sync;

    /// Up to `max` messages of `topic`, hidden from other receivers for `visibility`.
    /// Transports whose broker owns the timeout say how it applies instead (RabbitMQ:
    /// redelivery when the consumer's channel closes; NATS: the consumer's `ack_wait`).
    /// Broker transports wait a short while for messages before returning none, so a
    /// consumer over them can use a short poll interval.
    fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> impl Future<Output = Result<Vec<Self::Delivery>>> + Send;

    /// The message inside a delivery.
    fn envelope<'d>(&self, delivery: &'d Self::Delivery) -> &'d Envelope;

    /// 1 for a first delivery, 2 for the first redelivery, and so on.
    fn attempt(&self, delivery: &Self::Delivery) -> i32;

    /// Done with it; `false` if the delivery was stale (already redelivered or acked).
    fn ack(&self, delivery: &Self::Delivery) -> impl Future<Output = Result<bool>> + Send;

    /// Redeliver it after `delay`.
    fn nack(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Give up on it: park it where an operator can look.
    fn dead_letter(
        &self,
        delivery: &Self::Delivery,
        error: &str,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// A PostgreSQL `LISTEN` channel (and a pool to listen with) notified when messages
    /// arrive, if the transport has one; the consumer polls otherwise.
    fn wake_channel(&self) -> Option<(PgPool, String)> {
        None
    }
}
