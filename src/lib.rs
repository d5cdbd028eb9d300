#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod error;
mod ident;
pub mod inbox;
mod migrate;
mod retry;
mod state;
mod version;

pub use crate::error::{DbErrorKind, Error, Result};
pub use crate::ident::{Identifier, MAX_IDENTIFIER_BYTES};
pub use crate::inbox::{
    Claim, Claimed, Duplicate, GapPolicy, Inbox, InboxBuilder, Key, MAX_KEY_BYTES, Outcome,
    Sequenced, Verdict, Wait,
};
pub use crate::migrate::{
    AppliedMigration, DEFAULT_SCHEMA, HISTORY_TABLE, MigrationReport, Migrator, migrate,
};
pub use crate::retry::{RetryPolicy, Retryable};
pub use crate::state::{StateMachine, StateTable, Transition};
pub use crate::version::{VersionedTable, VersionedUpdate};
