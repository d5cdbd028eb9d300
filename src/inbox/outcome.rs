//! What a claim or a `process` call can come back with.

use serde::de::DeserializeOwned;
use time::OffsetDateTime;

use crate::error::{Error, Result};

/// The result of [`Inbox::process`](crate::Inbox::process). In every case the caller commits
/// the transaction, then acknowledges the message to its broker.
#[derive(Debug, Clone, PartialEq)]
#[must_use = "an outcome tells whether the message took effect; commit, then ack"]
pub enum Outcome<T> {
    /// First delivery: the handler ran and returned this value. Its writes and the inbox row
    /// commit together with the caller's transaction.
    Processed(T),
    /// The handler refused the message for good (see [`Verdict::Reject`]). The inbox row
    /// records the reason, so redeliveries come back as a [`Duplicate`] that was rejected.
    Rejected(String),
    /// The key was recorded by an earlier, committed transaction. Nothing ran.
    Duplicate(Duplicate),
    /// Another transaction holds an uncommitted claim on this key and the configured
    /// [`Wait`](crate::Wait) expired, or a lease (lease mode, see
    /// [`Inbox::lease`](crate::Inbox::lease)) holds it. Nothing ran and this transaction is
    /// still usable; redeliver later.
    InProgress,
}

impl<T> Outcome<T> {
    /// True for [`Outcome::Processed`].
    pub fn is_processed(&self) -> bool {
        matches!(self, Outcome::Processed(_))
    }

    /// True for [`Outcome::Duplicate`].
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate(_))
    }

    /// Whether the message is finished with once the transaction commits (everything except
    /// [`Outcome::InProgress`]): acknowledge it to the broker.
    pub fn should_ack(&self) -> bool {
        !matches!(self, Outcome::InProgress)
    }
}

/// A handler's decision when it may refuse a message, for
/// [`Inbox::process_or_reject`](crate::Inbox::process_or_reject).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<T> {
    /// The message took effect; `T` is returned (and stored, unless it serializes to `null`).
    Accept(T),
    /// The business refuses this message for good (unknown account, expired offer...). The
    /// inbox row is committed with this reason, so the message is not redelivered forever.
    /// Writes the handler already made are *not* undone: reject before writing.
    Reject(String),
}

/// What the inbox knows about a key that was already recorded.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Duplicate {
    /// When the first delivery was recorded (database clock).
    pub first_processed_at: OffsetDateTime,
    /// The message id stored with the first delivery, if any.
    pub message_id: Option<String>,
    /// The JSON outcome the first handler returned, if one was stored.
    pub outcome: Option<serde_json::Value>,
    /// The rejection reason, when the first delivery was rejected.
    pub rejection: Option<String>,
}

impl Duplicate {
    /// Deserializes the stored outcome: hand a retried request the original answer.
    pub fn outcome<T: DeserializeOwned>(&self) -> Result<Option<T>> {
        self.outcome
            .clone()
            .map(serde_json::from_value)
            .transpose()
            .map_err(Error::DeserializeOutcome)
    }

    /// Whether the first delivery was rejected rather than processed.
    pub fn was_rejected(&self) -> bool {
        self.rejection.is_some()
    }
}
