#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod consumer;
mod error;
mod ident;
pub mod inbox;
mod listen;
mod migrate;
mod outbox;
mod relay;
mod retry;
mod state;
mod status;
pub mod transport;
mod version;

/// Cancels a [`Relay`] or [`Consumer`] run (re-exported from `tokio-util`).
pub use tokio_util::sync::CancellationToken;

pub use crate::consumer::{Consumer, ConsumerBuilder, ConsumerStats};
pub use crate::error::{DbErrorKind, Error, Result};
pub use crate::ident::{Identifier, MAX_IDENTIFIER_BYTES};
pub use crate::inbox::{
    Claim, Claimed, Duplicate, GapPolicy, Inbox, InboxBuilder, Key, MAX_KEY_BYTES, Outcome,
    Sequenced, Verdict, Wait,
};
pub use crate::migrate::{
    AppliedMigration, DEFAULT_SCHEMA, HISTORY_TABLE, MigrationReport, Migrator, migrate,
};
pub use crate::outbox::{Envelope, MAX_TOPIC_BYTES, Message, Outbox, TRACEPARENT};
pub use crate::relay::{DeadLetter, DeadLetters, Relay, RelayBuilder, RoundReport, WakeUp};
pub use crate::retry::{RetryPolicy, Retryable};
pub use crate::state::{StateMachine, StateTable, Transition};
pub use crate::status::{
    ConsumerInbox, DEAD_LETTER_COUNT_CAP, INBOX_COUNT_CAP, Status, TopicStatus, inbox_status,
    status,
};
pub use crate::version::{VersionedTable, VersionedUpdate};
