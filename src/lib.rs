#![doc = include_str!("front_page.md")]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod archive;
pub mod cloudevents;
mod connect;
mod consumer;
pub mod doctor;
mod error;
mod fanout;
mod grants;
mod guide_doctests;
#[cfg(feature = "axum")]
pub mod idempotency;
mod ident;
pub mod inbox;
pub mod janitor;
mod json;
mod listen;
mod migrate;
#[cfg(feature = "opentelemetry")]
mod otel;
mod outbox;
mod percent;
mod pooler;
mod relay;
mod retry;
mod secret;
mod state;
mod status;
pub mod telemetry;
mod tenants;
#[cfg(feature = "testing")]
pub mod testing;
mod tls;
mod traceparent;
pub mod transport;
mod version;

/// The sqlx pgbox is built on (0.9, PostgreSQL, tokio): use `pgbox::sqlx` instead of a
/// dependency of your own to be sure the pool and transaction types are the ones pgbox takes
/// (two sqlx versions in one build make `PgPool` two different types).
pub use sqlx;

/// Cancels a [`Relay`] or [`Consumer`] run (re-exported from `tokio-util`).
pub use tokio_util::sync::CancellationToken;

pub use crate::archive::{
    Archive, ArchivePartition, ArchiveRetention, ArchiveStatus, REPLAY_ID_HEADER, Replay,
    ReplayCursor, ReplayReport,
};
pub use crate::cloudevents::{CloudEvents, ContentMode};
pub use crate::connect::{FIRST_CONNECTION_TIMEOUT, connect};
pub use crate::consumer::{
    Consumer, ConsumerBuilder, ConsumerStats, Limit, MAX_BATCH_SIZE, MAX_CONCURRENCY_SLOTS,
    MAX_LIMIT_NAME_BYTES, MAX_RATE_PER_SECOND, MAX_VISIBILITY_TIMEOUT, MIN_VISIBILITY_TIMEOUT,
};
pub use crate::error::{DbErrorKind, Error, Result, TlsProblem, WalStreamProblem};
pub use crate::fanout::{
    DEFAULT_DESTINATION_TIMEOUT, DESTINATIONS_HEADER, DestinationStatus, FanoutDeadLetter,
    FanoutDrainReport, Router, RouterBuilder,
};
#[cfg(feature = "axum")]
pub use crate::idempotency::{Finality, IdempotencyLayer, IdempotencyTx};
pub use crate::ident::{Identifier, MAX_IDENTIFIER_BYTES, MAX_PGBOX_SCHEMA_BYTES};
pub use crate::inbox::{
    BeginsItsOwn, Claim, Claimed, ConnectionLike, Duplicate, FencingToken, GapPolicy,
    HandlerConnection, Inbox, InboxBuilder, InboxPartition, InboxPartitioning, InboxPartitions,
    Key, Lease, LeaseAttempt, LeasedRun, MAX_KEY_BYTES, MAX_LEASE_TTL, MIN_LEASE_TTL, Outcome,
    Sequenced, Verdict, Wait,
};
pub use crate::migrate::{
    AppliedMigration, DEFAULT_SCHEMA, HISTORY_TABLE, MigrationReport, Migrator, SchemaMigration,
    migrate,
};
pub use crate::outbox::{
    DEFAULT_MAX_MESSAGE_BYTES, Envelope, InTransaction, MAX_HEADER_NAME_BYTES,
    MAX_MESSAGE_BYTES_LIMIT, MAX_SCHEDULE_DELAY, MAX_TOPIC_BYTES, Message, Outbox, OutboxMode,
    ScheduleConflict, TRACEPARENT,
};
pub use crate::pooler::Pooler;
pub use crate::relay::{
    DeadLetter, DeadLetters, DrainReport, Relay, RelayBuilder, RoundReport, WakeUp, WalReader,
    WalRelay, WalRelayBuilder, WalRoundReport, WalSlot, WalSlotInvalidation, WalSlotStatus,
};
pub use crate::retry::{RetryPolicy, Retryable};
pub use crate::secret::Secret;
pub use crate::state::{StateMachine, StateTable, Transition};
pub use crate::status::{
    ConsumerInbox, DEAD_LETTER_COUNT_CAP, INBOX_COUNT_CAP, LEASE_COUNT_CAP, Status, TopicStatus,
    inbox_status, status,
};
pub use crate::tenants::{
    TENANT_HEADER, TenantDrainReport, TenantHealth, TenantRelay, TenantRelayBuilder, TenantStatus,
};
pub use crate::version::{VersionedTable, VersionedUpdate};
