//! Where the relay publishes to, and where consumers receive from.
//!
//! [`Publisher`] is the relay's side: publish a batch, confirm each message. The built-in
//! [`PgQueue`] implements it and also the receiving side (visibility timeout, ack, nack,
//! dead letters), so a whole pipeline runs on PostgreSQL alone. Broker adapters implement
//! `Publisher` for their client.

mod postgres;

use std::future::Future;

pub use self::postgres::{Delivery, PgQueue};

use crate::outbox::Envelope;

/// Why a message could not be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PublishError(pub String);

/// Publishes batches of outbox messages with per-message confirmation.
pub trait Publisher: Send + Sync {
    /// Publishes `batch`, returning one result per message, in order. A message reported
    /// `Ok` is deleted from the outbox (or marked published); an `Err` is retried with
    /// backoff. A result list of the wrong length counts every message as failed.
    fn publish(
        &self,
        batch: &[Envelope],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send;
}

/// A publisher that accepts everything and sends nothing: the database's ceiling in
/// benchmarks, and a sink in tests.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiscardPublisher;

impl Publisher for DiscardPublisher {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        vec![Ok(()); batch.len()]
    }
}
