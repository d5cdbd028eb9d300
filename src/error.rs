//! The one error type of pgbox, and how database errors are classified.

use std::fmt;

/// Result alias used throughout pgbox.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong inside pgbox.
///
/// Input errors (`Invalid*`, `Key*`) are detected before any SQL is sent, so they never abort
/// the caller's transaction. Database errors keep the original [`sqlx::Error`] and a
/// [`DbErrorKind`] derived from the SQLSTATE (never from message text); ask
/// [`Error::is_retryable`] whether retrying the whole transaction can succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The message key is the empty string.
    #[error("message key is empty")]
    EmptyKey,

    /// The message key is longer than [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES). Keys are never
    /// truncated: two long keys sharing a prefix must not collide. Hash long business keys.
    #[error("message key is {len} bytes long, the limit is {max} bytes (hash long keys)")]
    KeyTooLong {
        /// Length of the rejected key in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },

    /// The message key contains a NUL byte, which PostgreSQL `text` cannot store.
    #[error("message key contains a NUL byte at byte offset {position}")]
    KeyContainsNul {
        /// Byte offset of the first NUL.
        position: usize,
    },

    /// A consumer name failed validation.
    #[error("invalid consumer name {name:?}: {reason}")]
    InvalidConsumerName {
        /// The rejected name (debug-escaped when displayed).
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// An SQL identifier (schema, table or column name) failed validation. pgbox never
    /// interpolates a name into SQL unless it passed this check, and then always quoted.
    #[error("invalid {what} {name:?}: {reason}")]
    InvalidIdentifier {
        /// What the identifier names: "schema", "table", "column".
        what: &'static str,
        /// The rejected name (debug-escaped when displayed).
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// An optional text field (message id, rejection reason) is unusable as given.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// The handler's outcome could not be serialized to JSON for storage.
    #[error("could not serialize the handler outcome to JSON: {0}")]
    SerializeOutcome(#[source] serde_json::Error),

    /// A message payload could not be serialized to JSON ([`Message::json`](crate::Message::json)).
    #[error("could not serialize the message payload to JSON: {0}")]
    SerializePayload(#[source] serde_json::Error),

    /// A message payload is not JSON of the requested type ([`Envelope::json`](crate::Envelope::json)).
    #[error("message payload does not deserialize into the requested type: {0}")]
    DeserializePayload(#[source] serde_json::Error),

    /// A message (payload plus headers) or a batch of messages is larger than the configured
    /// maximum. Checked before any SQL is sent; not retryable: the same message will never
    /// fit. See [`Outbox::max_message_bytes`](crate::Outbox::max_message_bytes).
    #[error("{what} is {len} bytes, the limit is {max} bytes")]
    TooLarge {
        /// "message" or "batch".
        what: &'static str,
        /// Its size in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },

    /// A stored outcome could not be deserialized into the requested type.
    #[error("stored outcome does not deserialize into the requested type: {0}")]
    DeserializeOutcome(#[source] serde_json::Error),

    /// The claim found the key taken, but the row was gone when it was read back (a purge
    /// deleted it in between, or a watermark row vanished). Rare; roll back and retry.
    /// (Under REPEATABLE READ or SERIALIZABLE, a key committed after the snapshot surfaces
    /// as a serialization failure, SQLSTATE 40001, which is retryable too.)
    #[error(
        "key {key:?} of consumer {consumer:?} was taken, then vanished before it could be read; roll back and retry"
    )]
    ConcurrentClaim {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
    },

    /// [`Inbox::claim_batch`](crate::Inbox::claim_batch) met a key that a lease holds (lease
    /// mode, not completed): its message is neither new nor done. Roll back and retry later.
    #[error("key {key:?} of consumer {consumer:?} is held by a lease; retry later")]
    KeyInProgress {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
    },

    /// The inbox's table layout and the call do not fit: an [`Inbox`](crate::Inbox) built
    /// for the plain table in a schema switched to the time-partitioned inbox (or the
    /// reverse), no partition for the claiming transaction's start time (run the
    /// [`Janitor`](crate::janitor::Janitor), or
    /// [`InboxPartitions::create_ahead`](crate::InboxPartitions::create_ahead)), a claim on
    /// the partitioned inbox under REPEATABLE READ or SERIALIZABLE, or lease mode on a partitioned inbox.
    /// Nothing was recorded: fix the configuration and redeliver.
    #[error("pgbox inbox layout: {0}")]
    InboxLayout(String),

    /// The handler returned `Ok`, but a statement inside it failed and aborted the
    /// transaction (the handler swallowed that error). Nothing of the transaction can commit,
    /// and COMMIT would silently roll back; pgbox reports it instead of `Processed`. Roll back;
    /// the redelivery runs the handler again.
    #[error(
        "the handler returned Ok, but a statement inside it failed and aborted the transaction; nothing was recorded"
    )]
    TransactionAbortedInHandler,

    /// The transaction that claimed the key is no longer the one the handler's connection is
    /// in: something ended it from inside the handler (a `COMMIT` or `ROLLBACK` sent on the
    /// raw connection, which pgbox's watched connection refuses, or transaction control
    /// outside sqlx's knowledge). The message is not reported processed. What the handler did
    /// before the end may have committed (with the inbox row, making the redelivery a
    /// duplicate) or rolled back; what it did after ran outside the inbox's transaction.
    /// Nest units of work with `conn.begin()` (a savepoint) instead.
    #[error(
        "the inbox's transaction was ended inside the handler (COMMIT or ROLLBACK on its connection); the message is not recorded as processed"
    )]
    TransactionEndedInHandler,

    /// `store_outcome` or `reject` was called for a key this transaction did not claim, or
    /// that already has an outcome.
    #[error("key {key:?} of consumer {consumer:?} is not claimed by this transaction")]
    NotClaimed {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
    },

    /// A lease's TTL is outside [`MIN_LEASE_TTL`](crate::MIN_LEASE_TTL)..=
    /// [`MAX_LEASE_TTL`](crate::MAX_LEASE_TTL). Checked before any SQL is sent.
    #[error("lease ttl {ttl:?} is outside {min:?}..={max:?}")]
    InvalidLeaseTtl {
        /// The rejected TTL.
        ttl: std::time::Duration,
        /// The shortest TTL accepted.
        min: std::time::Duration,
        /// The longest TTL accepted.
        max: std::time::Duration,
    },

    /// The lease with this fencing token no longer holds the key: an expired lease was taken
    /// over by a newer token, or the key was completed, released or purged. A completion, an
    /// extension or a release by the stale holder is refused; nothing was written. Whatever
    /// the stale holder did outside the database may still have happened: the fencing token
    /// is how the remote side can refuse it.
    #[error(
        "lease {token} on key {key:?} of consumer {consumer:?} is lost (the key's token now: {current:?})"
    )]
    LeaseLost {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
        /// The stale holder's fencing token.
        token: i64,
        /// The token that holds or completed the key now, when known.
        current: Option<i64>,
    },

    /// The lease state read from the database is not one pgbox wrote (or the row vanished
    /// mid-statement). Never treated as "run it anyway": nothing ran.
    #[error("unreadable lease state for key {key:?} of consumer {consumer:?}: {detail}")]
    LeaseStateUnreadable {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
        /// What was wrong.
        detail: String,
    },

    /// A versioned compare-and-set found another version than expected: someone else
    /// updated the row since it was read. Retryable: re-read and re-apply.
    #[error("version conflict on {table}: expected version {expected}, found {actual}")]
    VersionConflict {
        /// The (quoted) table.
        table: String,
        /// The version the update expected.
        expected: i64,
        /// The version found.
        actual: i64,
    },

    /// The row to update does not exist (any more).
    #[error("no such row in {table}")]
    RowNotFound {
        /// The (quoted) table.
        table: String,
    },

    /// A state column holds a value that is not one of the state machine's states.
    #[error("{table} holds unknown state {value:?}")]
    UnknownState {
        /// The (quoted) table.
        table: String,
        /// The stored value.
        value: String,
    },

    /// A state column is NULL: the row exists but has no state. Reported the same way by
    /// [`StateTable::transition`](crate::StateTable::transition) and
    /// [`StateTable::current`](crate::StateTable::current).
    #[error("{table} has a row whose state is NULL")]
    NullState {
        /// The (quoted) table.
        table: String,
    },

    /// A state machine declaration is unusable (duplicate names, unknown targets, cycles).
    #[error("invalid state machine: {0}")]
    InvalidStateMachine(String),

    /// A sequence number below 1 was passed to in-order processing.
    #[error("sequence numbers start at 1, got {0}")]
    InvalidSequence(i64),

    /// A database error, classified by SQLSTATE.
    #[error("database error ({kind}): {}", sqlx_message(source))]
    Database {
        /// The classification.
        kind: DbErrorKind,
        /// The original error.
        #[source]
        source: sqlx::Error,
    },

    /// [`connect`](crate::connect) could not open its first connection: nothing listening,
    /// a refused login, a missing database. Says where it tried (never the password) and why.
    #[error("cannot connect to {target}: {reason}")]
    Connect {
        /// `user@host:port/database`.
        target: String,
        /// What went wrong, as the server or the network said it.
        reason: String,
    },

    /// A component that needs a session of its own (a session advisory lock, `LISTEN`) was
    /// configured to reach PostgreSQL only through a pooler in transaction mode
    /// ([`Pooler::Transaction`](crate::Pooler::Transaction)), which would hand that session's
    /// state to other clients' transactions. Give it a direct connection.
    #[error("{component} needs a direct (session) connection to PostgreSQL: {reason}")]
    SessionRequired {
        /// The component ("janitor", ...).
        component: &'static str,
        /// What it holds across transactions, and how to give it a session.
        reason: String,
    },

    /// The server's `wal_level` is not `logical`: the WAL outbox's slot cannot be created or
    /// read. Set `wal_level = logical` in `postgresql.conf` and restart the server (managed
    /// services: the "logical replication" or "logical decoding" option).
    #[error(
        "wal_level is {actual:?}: the WAL outbox needs wal_level = logical (a server setting; it takes a restart)"
    )]
    WalLevel {
        /// The server's `wal_level`.
        actual: String,
    },

    /// The WAL outbox's replication slot cannot be read: it does not exist, another session
    /// reads it, or it was invalidated (the WAL it needed is gone, and the messages with it).
    #[error("WAL outbox slot {slot:?}: {reason}")]
    WalSlot {
        /// The slot's name.
        slot: String,
        /// What is wrong, and what to do.
        reason: String,
    },

    /// The WAL relay's streaming reader could not open or keep its replication connection
    /// for a reason that is not the slot's state (those are [`Error::WalSlot`]): the role
    /// lacks `REPLICATION`, `pg_hba.conf` refuses replication connections, the login failed,
    /// the pool asks for a setting the replication client cannot honour (TLS), or the
    /// session was lost. See [`WalStreamProblem`].
    #[error("WAL outbox slot {slot:?}, streaming reader: {reason}")]
    WalStream {
        /// The slot's name.
        slot: String,
        /// Which problem it is.
        problem: WalStreamProblem,
        /// What is wrong, and what to do.
        reason: String,
    },

    /// Applying migrations failed. A schema whose history holds a migration this pgbox does
    /// not have (a newer pgbox migrated it) is refused, and the message says so.
    #[error("migration failed: {}", migration_message(.0))]
    Migration(#[source] Box<refinery_core::Error>),

    /// A message broker (RabbitMQ, NATS) refused an operation or could not be reached.
    /// Transports reconnect on their next call; retrying later may succeed.
    #[error("{transport}: {message}")]
    Transport {
        /// The transport: "rabbitmq", "nats".
        transport: &'static str,
        /// What went wrong, with the client's error.
        message: String,
    },

    /// A TLS session with a server (PostgreSQL or a broker) could not be set up, or the
    /// configuration asks for TLS this build cannot give. Not retried by
    /// [`connect`](crate::connect): a certificate that does not verify will not verify on
    /// the next attempt. See [`TlsProblem`].
    #[error("TLS with {target}: {reason}")]
    Tls {
        /// Where: `user@host:port/database` for PostgreSQL, `rabbitmq at host:port`, ...
        /// Never a password.
        target: String,
        /// Which problem it is.
        problem: TlsProblem,
        /// What is wrong, and what to do.
        reason: String,
    },

    /// The server refused the credentials: a wrong password, an unknown user, a client
    /// certificate it does not accept for that user, an authentication method the client
    /// lacks. Not retried: the same credentials will be refused again.
    #[error("authentication with {target} failed: {reason}")]
    Authentication {
        /// Where: as in [`Error::Tls`]. Never a password.
        target: String,
        /// What the server said (never the credentials).
        reason: String,
    },

    /// The configuration would send credentials (a password, a token) in clear text to an
    /// address that is not loopback. Refused unless the configuration says so explicitly
    /// (the named setting).
    #[error("{transport}: credentials would cross the network in clear text: {reason}")]
    InsecureCredentials {
        /// The transport or component: "postgres", "rabbitmq", "nats", "kafka".
        transport: &'static str,
        /// The setting that allows it on purpose, or the one that turns TLS on.
        setting: &'static str,
        /// Where, and what to change.
        reason: String,
    },
}

/// Why a TLS session could not be set up ([`Error::Tls`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsProblem {
    /// TLS was asked for, and this build of pgbox has none: enable the `tls` feature.
    NotBuilt,
    /// TLS was required and the server does not offer it (PostgreSQL answered `N` to
    /// `SSLRequest`, or a broker's port speaks plain text).
    NotOffered,
    /// The server's certificate is not signed by a trusted certificate authority (the one in
    /// the configured root-certificate file, or the system's).
    UnknownIssuer,
    /// The server's certificate does not name the host that was dialled (`verify-full`).
    HostnameMismatch,
    /// The server's certificate has expired or is not valid yet.
    Expired,
    /// The server refused this client's certificate, or asked for one that was not given.
    ClientCertificate,
    /// A root-certificate, certificate or key file cannot be read or parsed.
    BadFile,
    /// Another TLS failure; the reason says which.
    Other,
}

impl std::fmt::Display for TlsProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsProblem::NotBuilt => "TLS not built (the `tls` feature is off)",
            TlsProblem::NotOffered => "the server offers no TLS",
            TlsProblem::UnknownIssuer => "certificate signed by an unknown authority",
            TlsProblem::HostnameMismatch => "certificate not valid for the host name",
            TlsProblem::Expired => "certificate expired or not yet valid",
            TlsProblem::ClientCertificate => "client certificate refused or missing",
            TlsProblem::BadFile => "certificate or key file unreadable",
            TlsProblem::Other => "TLS failure",
        })
    }
}

/// Why the WAL relay's streaming reader has no replication session ([`Error::WalStream`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WalStreamProblem {
    /// The role may not open a replication connection (SQLSTATE 42501): it needs the
    /// `REPLICATION` attribute. Managed services without it: the SQL-function reader.
    NoReplicationPrivilege,
    /// The server refused the replication session: no `pg_hba.conf` line admits it (28000),
    /// no walsender is free (`max_wal_senders`), the publication is missing, or another
    /// refusal the message names.
    Refused,
    /// The login failed (wrong password, an authentication method the client lacks).
    Authentication,
    /// The pool's settings ask for something the replication client cannot do (TLS):
    /// refused rather than ignored.
    UnsupportedOption,
    /// The session ended: the connection broke, the server shut down or ended the stream.
    /// The relay reconnects with backoff and resumes from the slot's confirmed position.
    Lost,
    /// The replication connection stopped carrying the server's bytes without breaking (a
    /// dropped NAT flow, a partition that sends no reset): the server ended this relay's
    /// walsender (`wal_sender_timeout`) or another session holds the slot, or the server
    /// sent WAL the client did not receive for longer than the relay's bound while the relay
    /// was not holding back. The relay ends the session and reconnects as after
    /// [`Lost`](Self::Lost).
    Silent,
}

/// A server error as a person can act on it: the message, the SQLSTATE, and the server's
/// detail and hint when it sent them; not the server's source-file position, which sqlx's
/// own display appends ("at line 334").
pub(crate) fn database_message(db: &dyn sqlx::error::DatabaseError) -> String {
    let ours = missing_object_hint(db);
    let mut text = db.message().to_owned();
    if let Some(code) = db.code() {
        text.push_str(&format!(" (SQLSTATE {code})"));
    }
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        if let Some(detail) = pg.detail() {
            text.push_str(&format!("; {detail}"));
        }
        // The server's hint for a missing function of pgbox's ("You might need to add
        // explicit type casts") points the wrong way: ours replaces it.
        if let Some(hint) = pg.hint()
            && !(ours.is_some() && db.code().as_deref() == Some("42883"))
        {
            text.push_str(&format!("; hint: {hint}"));
        }
    }
    if let Some(hint) = ours {
        text.push_str("; ");
        text.push_str(hint);
    }
    text
}

/// What to do when the server says one of pgbox's own objects does not exist: the schema was
/// never migrated, or was migrated by an older pgbox than this one.
pub(crate) const MIGRATE_HINT: &str = "pgbox's tables are missing or older than this pgbox: \
     run its migrations (`pgbox::migrate(&pool)` at start-up, \
     `pgbox::Migrator::new().schema(\"NAME\")?.run(&pool)` for a schema other than `pgbox`, \
     or `pgbox migrate [--schema NAME]` from the command line)";

/// The tables, functions and sequences pgbox's migrations create: a missing one of these
/// names means an unmigrated or outdated schema, not an application bug.
pub(crate) const PGBOX_OBJECTS: &[&str] = &[
    crate::migrate::HISTORY_TABLE,
    "enable_partitioned_inbox",
    "hand_backs",
    "inbox",
    "inbox_claim_bounded",
    "inbox_lease",
    "inbox_lease_token_seq",
    "inbox_partitioning",
    "inbox_partitions",
    "inbox_partitions_create",
    "inbox_partitions_create_ahead",
    "inbox_partitions_expired",
    "inbox_refuse_new_claims",
    "inbox_refuse_new_claims_install",
    "outbox",
    "outbox_archive",
    "outbox_archive_configure",
    "outbox_archive_create_ahead",
    "outbox_archive_default",
    "outbox_archive_drop_expired",
    "outbox_archive_partition_add",
    "outbox_archive_partitions",
    "outbox_archive_partitions_create",
    "outbox_archive_seq",
    "outbox_archive_settings",
    "outbox_dead_letters",
    "outbox_fanout_deliveries",
    "outbox_fanout_messages",
    "outbox_notify",
    "outbox_scheduled",
    "partitioned_inbox",
    "partitioned_inbox_check_isolation",
    "partitioned_inbox_claim",
    "partitioned_inbox_claim_batch",
    "partitioned_inbox_lock_id",
    "queue",
    "queue_dead_letters",
    "queue_notify",
    "queue_receive",
    "rate_limits",
    "sequence_watermarks",
];

/// Columns that a later migration added to a table of pgbox's (V7: the leases): a schema an
/// older pgbox migrated lacks them. A migration that adds a column adds it here (a unit test
/// reads the migrations' `ADD COLUMN`s).
const PGBOX_ADDED_COLUMNS: &[&str] = &["lease_expires_at", "lease_token"];

/// [`MIGRATE_HINT`] when `db` says an object of pgbox's is missing: an undefined table
/// (42P01, schema-qualified as pgbox always writes it: an unqualified name found through the
/// `search_path` is the application's) or function (42883) of one of pgbox's names, a column
/// that a later migration of pgbox's added (42703, with or without the relation the server
/// names), or an undefined schema (3F000, which names no object to check). The SQLSTATE
/// decides; the message is read only for the object's name.
fn missing_object_hint(db: &dyn sqlx::error::DatabaseError) -> Option<&'static str> {
    let code = db.code()?;
    let message = db.message();
    // The name as the server quotes it after `after`, `"schema.table"` or `"table"`.
    let quoted = |after: &str| -> Option<&str> {
        let start = message.find(after)? + after.len();
        let rest = message[start..].strip_prefix('"')?;
        Some(&rest[..rest.find('"')?])
    };
    // One of pgbox's names, and, when qualified, in a schema this process uses for pgbox.
    let ours = |name: &str| {
        let (schema, object) = match name.rsplit_once('.') {
            Some((schema, object)) => (Some(schema.trim_matches('"')), object),
            None => (None, name),
        };
        PGBOX_OBJECTS.contains(&object.trim_matches('"'))
            && schema.is_none_or(crate::ident::is_pgbox_schema)
    };
    let missing = match code.as_ref() {
        // `schema "billing" does not exist`: only a schema used for pgbox's tables.
        "3F000" => quoted("schema ").is_some_and(crate::ident::is_pgbox_schema),
        "42P01" => quoted("relation ").is_some_and(|n| n.contains('.') && ours(n)),
        // `column "x" of relation "inbox" does not exist` (INSERT, UPDATE), `column "x" does
        // not exist` or `column i.x does not exist` (SELECT: no relation named).
        "42703" => {
            let column = message
                .strip_prefix("column ")
                .map(|rest| match rest.strip_prefix('"') {
                    Some(q) => q.split('"').next().unwrap_or(q),
                    None => {
                        let name = rest.split(' ').next().unwrap_or(rest);
                        name.rsplit('.').next().unwrap_or(name)
                    }
                });
            column.is_some_and(|c| PGBOX_ADDED_COLUMNS.contains(&c))
                && quoted("of relation ").is_none_or(ours)
        }
        // `function pgbox.inbox_lease(text, text) does not exist`: no quotes.
        "42883" => message
            .strip_prefix("function ")
            .and_then(|rest| rest.find('(').map(|end| &rest[..end]))
            .is_some_and(ours),
        _ => false,
    };
    missing.then_some(MIGRATE_HINT)
}

/// A refused migration history in words: a migration this pgbox does not have, newer than
/// its newest, means a newer pgbox migrated the schema (pgbox never migrates back).
fn migration_message(e: &refinery_core::Error) -> String {
    if let refinery_core::error::Kind::MissingVersion(m) = e.kind() {
        let newest = crate::migrate::embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| m.version())
            .max()
            .unwrap_or(0);
        if i64::from(m.version()) > i64::from(newest) {
            return format!(
                "the schema was migrated by a newer pgbox: its history holds {m}, and this \
                 pgbox's newest migration is V{newest}. Run the newer pgbox (a schema is never \
                 migrated back), or restore the schema from before that migration"
            );
        }
        return format!(
            "the schema's history holds {m}, which this pgbox does not have (a migration \
             of another program, or of another pgbox build, under pgbox's history table)"
        );
    }
    e.to_string()
}

fn sqlx_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => database_message(db.as_ref()),
        other => other.to_string(),
    }
}

impl Error {
    /// Whether rolling back and retrying the whole transaction may succeed: serialization
    /// failures, deadlocks, lock and statement timeouts, lost connections (also a WAL
    /// relay's replication session: [`WalStreamProblem::Lost`] and
    /// [`WalStreamProblem::Silent`]), pool timeouts, [`Error::ConcurrentClaim`] and
    /// [`Error::VersionConflict`].
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::ConcurrentClaim { .. }
            | Error::VersionConflict { .. }
            | Error::KeyInProgress { .. } => true,
            Error::Database { kind, .. } => kind.is_retryable(),
            // A replication session that broke or went silent: the next try reconnects.
            Error::WalStream {
                problem: WalStreamProblem::Lost | WalStreamProblem::Silent,
                ..
            } => true,
            _ => false,
        }
    }

    /// Whether this is the server saying one of pgbox's own objects is missing (the schema
    /// was never migrated, or by an older pgbox): not a message's fault, and not a passing
    /// outage either; it lasts until someone runs the migrations.
    pub(crate) fn needs_migration(&self) -> bool {
        match self {
            Error::Database {
                source: sqlx::Error::Database(db),
                ..
            } => missing_object_hint(db.as_ref()).is_some(),
            _ => false,
        }
    }

    /// The classification of a database error, if this is one.
    pub fn db_kind(&self) -> Option<DbErrorKind> {
        match self {
            Error::Database { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// The SQLSTATE of a database error, if the server sent one.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            Error::Database {
                source: sqlx::Error::Database(e),
                ..
            } => e.code().map(|c| c.into_owned()),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(source: sqlx::Error) -> Self {
        Error::Database {
            kind: DbErrorKind::classify(&source),
            source,
        }
    }
}

/// What kind of database error occurred, derived from the SQLSTATE or the client error type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DbErrorKind {
    /// 23505: a unique constraint was violated.
    UniqueViolation,
    /// 40001: the transaction could not be serialized.
    SerializationFailure,
    /// 40P01: a deadlock was detected.
    Deadlock,
    /// 55P03: `lock_timeout` expired or `NOWAIT` could not get a lock.
    LockTimeout,
    /// 57014: the statement was cancelled (usually `statement_timeout`).
    QueryCanceled,
    /// Class 08, 57P01–57P03, I/O and protocol errors: the connection is gone.
    ConnectionLost,
    /// The pool had no connection available within its timeout.
    PoolTimedOut,
    /// 25P02: an earlier statement already aborted this transaction.
    TransactionAborted,
    /// 3F000 / 42P01: a schema or table does not exist. When it is one of pgbox's, the
    /// error's message says to run the migrations ([`migrate`](fn@crate::migrate),
    /// [`Migrator`](crate::Migrator), or `pgbox migrate`), as it does for a missing function
    /// or column of pgbox's (42883, 42703: a schema migrated by an older pgbox; those keep
    /// their kind, [`DbErrorKind::Other`]).
    MissingSchema,
    /// 25006: the server only allows reads: a hot standby (the address clients use points at
    /// a standby: not yet moved to the promoted one after a failover, or a pool made before a
    /// promotion), or `default_transaction_read_only`. The claim fails before any handler
    /// runs. Retryable: the standby may be promoted, the address moved to the new primary.
    /// (sqlx has no `target_session_attrs`: see the README's "Failover".)
    ReadOnly,
    /// 42501: the role lacks a privilege (a missing `GRANT`: `permission denied for table
    /// inbox`, `... for schema pgbox`, `... for function inbox_lease`, `must be owner of
    /// table partitioned_inbox`). The error's message names the object. The statement, and
    /// with it the transaction (an inbox claim and the handler's effects), is rolled back;
    /// not retryable: grant what is missing (`pgbox migrate --grant-to ROLE` as the schema's
    /// owner; `pgbox doctor --role ROLE` lists it).
    InsufficientPrivilege,
    /// Any other error.
    Other,
}

impl DbErrorKind {
    /// Classifies a sqlx error by SQLSTATE, never by message text.
    pub fn classify(err: &sqlx::Error) -> Self {
        match err {
            sqlx::Error::Database(db) => match db.code().as_deref() {
                Some(code) => Self::from_sqlstate(code),
                None => DbErrorKind::Other,
            },
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => {
                DbErrorKind::ConnectionLost
            }
            sqlx::Error::WorkerCrashed => DbErrorKind::ConnectionLost,
            sqlx::Error::PoolTimedOut => DbErrorKind::PoolTimedOut,
            _ => DbErrorKind::Other,
        }
    }

    /// Classifies a five-character SQLSTATE code.
    pub fn from_sqlstate(code: &str) -> Self {
        match code {
            "23505" => DbErrorKind::UniqueViolation,
            "40001" => DbErrorKind::SerializationFailure,
            "40P01" => DbErrorKind::Deadlock,
            "55P03" => DbErrorKind::LockTimeout,
            "57014" => DbErrorKind::QueryCanceled,
            "57P01" | "57P02" | "57P03" => DbErrorKind::ConnectionLost,
            "25P02" => DbErrorKind::TransactionAborted,
            "3F000" | "42P01" => DbErrorKind::MissingSchema,
            "25006" => DbErrorKind::ReadOnly,
            "42501" => DbErrorKind::InsufficientPrivilege,
            c if c.starts_with("08") => DbErrorKind::ConnectionLost,
            _ => DbErrorKind::Other,
        }
    }

    /// Whether a transaction that failed with this kind may succeed when retried.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            DbErrorKind::SerializationFailure
                | DbErrorKind::Deadlock
                | DbErrorKind::LockTimeout
                | DbErrorKind::QueryCanceled
                | DbErrorKind::ConnectionLost
                | DbErrorKind::PoolTimedOut
                | DbErrorKind::ReadOnly
        )
    }
}

impl fmt::Display for DbErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DbErrorKind::UniqueViolation => "unique violation",
            DbErrorKind::SerializationFailure => "serialization failure",
            DbErrorKind::Deadlock => "deadlock",
            DbErrorKind::LockTimeout => "lock timeout",
            DbErrorKind::QueryCanceled => "query canceled",
            DbErrorKind::ConnectionLost => "connection lost",
            DbErrorKind::PoolTimedOut => "pool timed out",
            DbErrorKind::TransactionAborted => "transaction aborted",
            DbErrorKind::MissingSchema => "missing schema or table",
            DbErrorKind::ReadOnly => "read-only server (a standby?)",
            DbErrorKind::InsufficientPrivilege => {
                "insufficient privilege: a GRANT is missing (`pgbox doctor --role ROLE` lists them)"
            }
            DbErrorKind::Other => "other",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_or_silent_replication_session_is_retryable_and_a_refusal_is_not() {
        let stream = |problem| Error::WalStream {
            slot: "s".into(),
            problem,
            reason: String::new(),
        };
        assert!(stream(WalStreamProblem::Lost).is_retryable());
        assert!(stream(WalStreamProblem::Silent).is_retryable());
        assert!(!stream(WalStreamProblem::NoReplicationPrivilege).is_retryable());
        assert!(!stream(WalStreamProblem::UnsupportedOption).is_retryable());
    }

    #[test]
    fn sqlstates_map_to_kinds_and_retryability() {
        let cases = [
            ("23505", DbErrorKind::UniqueViolation, false),
            ("40001", DbErrorKind::SerializationFailure, true),
            ("40P01", DbErrorKind::Deadlock, true),
            ("55P03", DbErrorKind::LockTimeout, true),
            ("57014", DbErrorKind::QueryCanceled, true),
            ("08006", DbErrorKind::ConnectionLost, true),
            ("57P01", DbErrorKind::ConnectionLost, true),
            ("25P02", DbErrorKind::TransactionAborted, false),
            ("25006", DbErrorKind::ReadOnly, true),
            ("42P01", DbErrorKind::MissingSchema, false),
            ("42501", DbErrorKind::InsufficientPrivilege, false),
            ("22P02", DbErrorKind::Other, false),
        ];
        for (code, kind, retryable) in cases {
            assert_eq!(DbErrorKind::from_sqlstate(code), kind, "{code}");
            assert_eq!(kind.is_retryable(), retryable, "{code}");
        }
    }

    #[test]
    fn every_column_a_migration_adds_is_known_to_the_hint() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut added = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let sql = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let upper = sql.to_uppercase();
            for (at, _) in upper.match_indices("ADD COLUMN ") {
                let rest = sql[at + "ADD COLUMN ".len()..].trim_start();
                let rest = rest.strip_prefix("IF NOT EXISTS ").unwrap_or(rest);
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                added.push(name);
            }
        }
        assert!(!added.is_empty(), "no ADD COLUMN found in {dir}");
        for name in &added {
            assert!(
                PGBOX_ADDED_COLUMNS.contains(&name.as_str()),
                "{name} (added by a migration) is missing from PGBOX_ADDED_COLUMNS"
            );
        }
    }

    #[test]
    fn client_side_failures_are_classified() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(DbErrorKind::classify(&io), DbErrorKind::ConnectionLost);
        assert!(Error::from(io).is_retryable());
        assert!(Error::from(sqlx::Error::PoolTimedOut).is_retryable());
        assert!(!Error::from(sqlx::Error::RowNotFound).is_retryable());
    }
}
