//! The transactional inbox: record `(consumer, key)` in the same transaction as the effects.
//!
//! The claim is `INSERT … ON CONFLICT DO NOTHING` into `inbox`, whose primary key is
//! `(consumer, key)`. The unique index is the arbiter and the row lock is the lease:
//! - a first delivery inserts the row, the handler runs on the same transaction, and the row
//!   commits or rolls back with the handler's writes;
//! - a concurrent delivery of the same key waits on the index entry until the first
//!   transaction ends, then sees a duplicate (commit) or claims the key itself (rollback);
//! - a later delivery finds the committed row and is a pure read: no tuple written, no WAL,
//!   no transaction id, and the transaction is never aborted by a unique violation.

mod batch;
mod committing;
mod connection;
mod key;
mod lease;
mod outcome;
pub(crate) mod partitions;
mod retention;
mod sequence;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_util::FutureExt;
use serde::Serialize;
use sqlx::postgres::{PgRow, PgTransactionManager};
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, Transaction};
use sqlx_core::transaction::TransactionManager;
use tracing::Instrument;

pub use self::committing::BeginsItsOwn;
pub(crate) use self::connection::OneStatement;
use self::connection::{Check, Nesting};
pub use self::connection::{ConnectionLike, HandlerConnection};
pub use self::key::{Key, MAX_CONSUMER_BYTES, MAX_KEY_BYTES, MAX_MESSAGE_ID_BYTES};
pub(crate) use self::lease::ttl_micros as lease_ttl_micros;
pub use self::lease::{FencingToken, Lease, LeaseAttempt, LeasedRun, MAX_LEASE_TTL, MIN_LEASE_TTL};
pub use self::outcome::{Duplicate, Outcome, Verdict};
pub use self::partitions::{InboxPartition, InboxPartitioning, InboxPartitions};
pub use self::retention::PURGE_BATCH_ROWS;
pub(crate) use self::retention::purge_batch_sql;
pub use self::sequence::{GapPolicy, Sequenced};

use crate::error::{Error, Result};
use crate::ident::DEFAULT_SCHEMA;
use crate::ident::Identifier;
use crate::pooler::Pooler;

/// How long a claim waits behind an uncommitted claim of the same key by another transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Wait {
    /// Wait until the other transaction ends (subject to the session's own `lock_timeout`),
    /// then report [`Outcome::Duplicate`] or claim the key. The default.
    #[default]
    Block,
    /// Wait at most this long, then report [`Outcome::InProgress`]. At least 1 ms.
    Timeout(Duration),
    /// Report [`Outcome::InProgress`] at once (within about a millisecond).
    NoWait,
}

/// A consumer's inbox. Cheap to clone; build one per consumer at start-up.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> anyhow::Result<()> {
/// use pgbox::{Inbox, Outcome};
///
/// let inbox = Inbox::new("points-service")?;
/// let mut tx = pool.begin().await?;
/// let outcome = inbox
///     .process(&mut tx, "order-42", async |conn| {
///         sqlx::query("UPDATE points SET total = total + 30 WHERE user_id = $1")
///             .bind(7_i64)
///             .execute(&mut *conn)
///             .await?;
///         Ok::<_, anyhow::Error>(())
///     })
///     .await?;
/// tx.commit().await?;
/// assert!(matches!(outcome, Outcome::Processed(()) | Outcome::Duplicate(_)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Inbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    consumer: String,
    schema: Identifier,
    wait: Wait,
    store_outcomes: bool,
    gap_policy: GapPolicy,
    verify_transaction: bool,
    partitioned: bool,
    pooler: Pooler,
    sql: Statements,
    lease_sql: lease::LeaseStatements,
    /// Whether this inbox's last claim found a duplicate: the next claim then uses the
    /// statement that also reads the stored record (`claim`), otherwise the plain INSERT
    /// (`claim_new`). Both decide alike; only the cost differs (see `claim_new`).
    last_was_duplicate: std::sync::atomic::AtomicBool,
}

impl Inner {
    /// Whether sqlx may name and cache this inbox's statements (not behind a transaction
    /// pooler).
    fn persistent(&self) -> bool {
        self.pooler.persistent()
    }
}

/// SQL built once per inbox, with the schema validated and quoted.
#[derive(Debug)]
struct Statements {
    claim: Arc<str>,
    /// The claim as a plain INSERT, for a key that is most likely new: no row back on a
    /// conflict, and `read` then fetches the record that holds the key. `None` on the
    /// partitioned inbox, whose claim is a function.
    claim_new: Option<Arc<str>>,
    claim_bounded: Arc<str>,
    read: Arc<str>,
    store_outcome: Arc<str>,
    reject: Arc<str>,
    verify: Arc<str>,
    /// `verify` and the claim's row still there (after a `ROLLBACK TO` in the handler).
    verify_claimed: Arc<str>,
    claim_batch: Arc<str>,
    claim_batch_plain: Arc<str>,
    batch_unsettled: Arc<str>,
    /// `None` on the partitioned inbox, which has no leases.
    take_expired_lease: Option<Arc<str>>,
    lock_watermark: Arc<str>,
    create_watermark: Arc<str>,
    advance_watermark: Arc<str>,
}

impl Statements {
    fn new(schema: &Identifier, partitioned: bool) -> Self {
        let s = schema.quoted();
        if partitioned {
            return Self::partitioned(schema);
        }
        let (lock_watermark, create_watermark, advance_watermark) = watermark_sql(schema);
        // The second column is true for a key under a lease (lease mode's CONSUMING): not
        // processed yet, and not this transaction's to claim.
        let read = format!(
            "SELECT false, lease_expires_at IS NOT NULL, processed_at, message_id, outcome, \
                    rejection, NULL::text \
             FROM {s}.inbox WHERE consumer = $1 AND key = $2"
        );
        Statements {
            // The common path: one statement. The INSERT claims a new key; when it inserts
            // nothing, the second branch reads the row that holds the key (as `read` does),
            // so a duplicate is decided without a second round trip. That branch reads with
            // the statement's snapshot: a row committed by a concurrent claim we waited for
            // is not in it, no row comes back, and `read` fetches it with a new snapshot
            // under READ COMMITTED. The transaction id comes back only from an inserted row,
            // so a duplicate assigns none.
            claim: format!(
                "WITH claimed AS (INSERT INTO {s}.inbox (consumer, key, message_id) VALUES ($1, $2, $3) \
                   ON CONFLICT (consumer, key) DO NOTHING \
                   RETURNING true, false, processed_at, message_id, NULL::jsonb, NULL::text, \
                             pg_catalog.pg_current_xact_id()::text) \
                 SELECT * FROM claimed \
                 UNION ALL \
                 {read} AND NOT EXISTS (SELECT FROM claimed)"
            )
            .into(),
            // Measured with pgbench (BENCHMARKS.md run 15): the statement above costs the
            // server 15-20 % more per new key than this one, whose duplicate takes a second
            // statement (`read`). The inbox picks by what its last claim found.
            claim_new: Some(
                format!(
                    "INSERT INTO {s}.inbox (consumer, key, message_id) VALUES ($1, $2, $3) \
                     ON CONFLICT (consumer, key) DO NOTHING \
                     RETURNING true, false, processed_at, message_id, NULL::jsonb, NULL::text, \
                               pg_catalog.pg_current_xact_id()::text"
                )
                .into(),
            ),
            claim_bounded: format!("SELECT * FROM {s}.inbox_claim_bounded($1, $2, $3, $4)").into(),
            read: read.into(),
            // An expired lease, taken over by a transactional claim: the row becomes this
            // transaction's like a fresh claim (lease cleared, so the stale holder's
            // complete, extend and release are refused). SKIP LOCKED: never waits, so the
            // bounded `Wait` modes stay bounded; a row someone holds stays in progress.
            take_expired_lease: Some(format!(
                "UPDATE {s}.inbox AS i SET lease_token = NULL, lease_expires_at = NULL, \
                   processed_at = pg_catalog.now(), message_id = $3 \
                 WHERE i.ctid = (SELECT l.ctid FROM {s}.inbox AS l \
                   WHERE l.consumer = $1 AND l.key = $2 \
                     AND l.lease_expires_at IS NOT NULL AND l.lease_expires_at <= pg_catalog.now() \
                   FOR UPDATE SKIP LOCKED) \
                 RETURNING true, false, i.processed_at, i.message_id, NULL::jsonb, NULL::text, \
                           pg_catalog.pg_current_xact_id()::text"
            )
            .into()),
            // Only the row this transaction claimed, and only from that transaction: $4 is
            // the 64-bit transaction id the claim returned (never reused, unlike a start
            // timestamp, which two transactions may share). `_if_assigned` keeps a stale
            // token in a read-only transaction from assigning an id just to fail.
            store_outcome: format!(
                "UPDATE {s}.inbox SET outcome = $3 WHERE consumer = $1 AND key = $2 \
                 AND pg_catalog.pg_current_xact_id_if_assigned() = $4::xid8 \
                 AND processed_at = pg_catalog.now() AND outcome IS NULL AND rejection IS NULL"
            )
            .into(),
            reject: format!(
                "UPDATE {s}.inbox SET rejection = $3 WHERE consumer = $1 AND key = $2 \
                 AND pg_catalog.pg_current_xact_id_if_assigned() = $4::xid8 \
                 AND processed_at = pg_catalog.now() AND outcome IS NULL AND rejection IS NULL"
            )
            .into(),
            // True only in the transaction that claimed: false or NULL once that transaction
            // was ended under the handler (a later one has another id, or none yet), and
            // the "transaction is aborted" error after a swallowed failure.
            verify: "SELECT pg_catalog.pg_current_xact_id_if_assigned() = $1::xid8".into(),
            verify_claimed: verify_claimed_sql(&format!("{s}.inbox")).into(),
            claim_batch: format!(
                "INSERT INTO {s}.inbox (consumer, key, message_id) \
                 SELECT $1, k.key, k.message_id FROM unnest($2::text[], $3::text[]) AS k(key, message_id) \
                 ON CONFLICT (consumer, key) DO NOTHING RETURNING key"
            )
            .into(),
            claim_batch_plain: format!(
                "INSERT INTO {s}.inbox (consumer, key, message_id) \
                 SELECT $1, k.key, k.message_id FROM unnest($2::text[], $3::text[]) AS k(key, message_id)"
            )
            .into(),
            // Of the keys a batch did not claim, one that is not positively recorded: under
            // a lease, or gone (released or purged since the claim statement). Failing
            // closed: only a committed row without a lease may be reported as done.
            batch_unsettled: format!(
                "SELECT k FROM pg_catalog.unnest($2::text[]) AS k \
                 WHERE k <> ALL($3::text[]) AND NOT EXISTS (\
                   SELECT 1 FROM {s}.inbox AS i \
                   WHERE i.consumer = $1 AND i.key = k AND i.lease_expires_at IS NULL) \
                 LIMIT 1"
            )
            .into(),
            lock_watermark,
            create_watermark,
            advance_watermark,
        }
    }

    /// The time-partitioned inbox's statements (migration V10): the claims are functions
    /// (advisory lock, look-up in every partition, insert); updates of a claimed row name
    /// `processed_at = now()`, which prunes them to the claiming transaction's partition.
    fn partitioned(schema: &Identifier) -> Self {
        let s = schema.quoted();
        let plain = Self::new(schema, false);
        let update = |column: &str| {
            format!(
                "UPDATE {s}.partitioned_inbox SET {column} = $3 WHERE consumer = $1 AND key = $2 \
                 AND pg_catalog.pg_current_xact_id_if_assigned() = $4::xid8 \
                 AND processed_at = pg_catalog.now() AND outcome IS NULL AND rejection IS NULL"
            )
        };
        Statements {
            claim: format!("SELECT * FROM {s}.partitioned_inbox_claim($1, $2, $3, NULL)").into(),
            claim_new: None,
            claim_bounded: format!("SELECT * FROM {s}.partitioned_inbox_claim($1, $2, $3, $4)")
                .into(),
            // The newest record first; then one of the plain inbox from before the switch.
            read: format!(
                "(SELECT false, false, processed_at, message_id, outcome, rejection, NULL::text \
                  FROM {s}.partitioned_inbox WHERE consumer = $1 AND key = $2 \
                  UNION ALL \
                  SELECT false, lease_expires_at IS NOT NULL, processed_at, message_id, outcome, \
                         rejection, NULL::text \
                  FROM {s}.inbox WHERE consumer = $1 AND key = $2) LIMIT 1"
            )
            .into(),
            take_expired_lease: None,
            verify_claimed: verify_claimed_sql(&format!("{s}.partitioned_inbox")).into(),
            store_outcome: update("outcome").into(),
            reject: update("rejection").into(),
            claim_batch: format!("SELECT * FROM {s}.partitioned_inbox_claim_batch($1, $2, $3)")
                .into(),
            ..plain
        }
    }
}

/// The liveness check of [`Inbox::verify_alive`] after a `ROLLBACK TO` in the handler, on
/// `table` (schema-qualified, quoted): `verify`, and the claim's row still there. False once
/// a `ROLLBACK TO` a savepoint older than the claim undid the row while the transaction went
/// on. The row must be the one this transaction wrote (`processed_at = now()`, the test the
/// outcome's UPDATE makes too), not one a later claimer committed after the undo.
fn verify_claimed_sql(table: &str) -> String {
    format!(
        "SELECT pg_catalog.pg_current_xact_id_if_assigned() = $1::xid8 \
           AND EXISTS (SELECT FROM {table} WHERE consumer = $2 AND key = $3 \
                       AND processed_at = pg_catalog.now())"
    )
}

/// The sequence watermark statements (shared by both layouts).
fn watermark_sql(schema: &Identifier) -> (Arc<str>, Arc<str>, Arc<str>) {
    let s = schema.quoted();
    (
        format!(
            // The row lock assigns the transaction its id anyway; the advance names it, so a
            // transaction ended under the handler cannot advance the watermark.
            "SELECT last_seq, pg_catalog.pg_current_xact_id()::text FROM {s}.sequence_watermarks \
                 WHERE consumer = $1 AND entity = $2 FOR UPDATE"
        )
        .into(),
        format!(
            "INSERT INTO {s}.sequence_watermarks (consumer, entity, last_seq) \
                 VALUES ($1, $2, 0) ON CONFLICT (consumer, entity) DO NOTHING"
        )
        .into(),
        format!(
            "UPDATE {s}.sequence_watermarks SET last_seq = $3, updated_at = pg_catalog.now() \
                 WHERE consumer = $1 AND entity = $2 AND pg_catalog.pg_current_xact_id_if_assigned() = $4::xid8"
        )
        .into(),
    )
}

/// Builder for an [`Inbox`] with non-default settings.
#[derive(Debug, Clone)]
pub struct InboxBuilder {
    consumer: String,
    schema: String,
    wait: Wait,
    store_outcomes: bool,
    gap_policy: GapPolicy,
    verify_transaction: bool,
    partitioned: bool,
    pooler: Pooler,
}

impl InboxBuilder {
    /// What stands between this inbox and PostgreSQL (default [`Pooler::None`]). Behind a
    /// pooler in transaction mode, set [`Pooler::Transaction`]: the inbox's statements, and
    /// the handler's statements sent through its [`HandlerConnection`], are then sent unnamed
    /// (a pooler in transaction mode cannot keep a named statement between transactions), and
    /// lease mode runs each of its steps in a transaction of its own.
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// Whether this inbox uses the time-partitioned table (default `false`): set it in a
    /// schema switched with [`Migrator::partitioned_inbox`](crate::Migrator::partitioned_inbox).
    /// A mismatch either way fails every claim with [`Error::InboxLayout`], never
    /// deduplicating against the wrong table. The partitioned inbox claims only under READ
    /// COMMITTED and has no lease mode; see [`InboxPartitioning`].
    pub fn partitioned(mut self, partitioned: bool) -> Self {
        self.partitioned = partitioned;
        self
    }

    /// The schema holding pgbox's tables (default `pgbox`); must match the migrator's.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// How long a claim waits behind an in-flight duplicate (default [`Wait::Block`]).
    pub fn wait(mut self, wait: Wait) -> Self {
        self.wait = wait;
        self
    }

    /// Whether handler return values are stored and handed back to duplicates (default
    /// `true`). Values that serialize to JSON `null`, such as `()` and `None`, are never
    /// stored and cost nothing.
    pub fn store_outcomes(mut self, store: bool) -> Self {
        self.store_outcomes = store;
        self
    }

    /// Whether to check, after a handler returns `Ok`, that its transaction is still alive
    /// (default `true`). A handler that swallows a failed statement leaves the transaction
    /// aborted; COMMIT then silently rolls back, and without the check the message would be
    /// acked as processed while nothing was recorded. The check rides on the outcome's UPDATE
    /// when there is one, and costs one `SELECT 1` round trip otherwise. Turn it off only for
    /// handlers that propagate every database error.
    pub fn verify_transaction(mut self, verify: bool) -> Self {
        self.verify_transaction = verify;
        self
    }

    /// What [`Inbox::process_in_order`] does with a sequence number beyond the next one
    /// (default [`GapPolicy::Wait`]).
    pub fn on_gap(mut self, policy: GapPolicy) -> Self {
        self.gap_policy = policy;
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Inbox> {
        key::validate_consumer(&self.consumer)?;
        let schema = Identifier::pgbox_schema(&self.schema)?;
        if let Wait::Timeout(d) = self.wait
            && (d < Duration::from_millis(1) || d.as_millis() > i32::MAX as u128)
        {
            return Err(Error::InvalidConfig(format!(
                "Wait::Timeout({d:?}) must be between 1 ms and {} ms",
                i32::MAX
            )));
        }
        let sql = Statements::new(&schema, self.partitioned);
        Ok(Inbox {
            inner: Arc::new(Inner {
                sql,
                lease_sql: lease::LeaseStatements::new(&schema),
                consumer: self.consumer,
                schema,
                wait: self.wait,
                store_outcomes: self.store_outcomes,
                gap_policy: self.gap_policy,
                verify_transaction: self.verify_transaction,
                partitioned: self.partitioned,
                pooler: self.pooler,
                last_was_duplicate: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }
}

/// The result of [`Inbox::claim`].
#[derive(Debug)]
#[must_use = "a claim must be acted on: run the effects, or roll back"]
pub enum Claim {
    /// This transaction now holds the key. Do the work on the same transaction and commit;
    /// optionally record an outcome or a rejection through the token.
    Claimed(Claimed),
    /// Already recorded by a committed transaction.
    Duplicate(Duplicate),
    /// Held by another uncommitted transaction and the inbox's [`Wait`] expired, or held
    /// under a live lease ([`Inbox::lease`]): redeliver later. (An expired lease is taken
    /// over: the claim comes back [`Claimed`](Claim::Claimed).)
    InProgress,
}

/// Proof that this transaction claimed a key; records what became of it.
#[derive(Debug)]
#[must_use = "the claim commits as `processed` with no outcome unless recorded otherwise"]
pub struct Claimed {
    inbox: Inbox,
    key: String,
    /// The claiming transaction's id (`xid8` as text).
    xact: String,
}

impl Claimed {
    /// The claimed key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Stores `outcome` as JSON with the inbox row; duplicates get it back. One statement.
    pub async fn store_outcome<T: Serialize + ?Sized>(
        self,
        tx: &mut Transaction<'_, Postgres>,
        outcome: &T,
    ) -> Result<()> {
        let json = outcome_json(outcome)?;
        self.inbox.store_json(tx, &self, json).await
    }

    /// Marks the message rejected for good, with a reason. One statement.
    pub async fn reject(self, tx: &mut Transaction<'_, Postgres>, reason: &str) -> Result<()> {
        self.inbox.store_rejection(tx, &self, reason).await
    }
}

impl Inbox {
    /// The pooler this inbox was built for (the Idempotency-Key layer and the runner's
    /// limits send their statements the same way).
    pub(crate) fn pooler(&self) -> Pooler {
        self.inner.pooler
    }

    /// An inbox for `consumer` in the default schema, blocking on in-flight duplicates and
    /// storing outcomes.
    pub fn new(consumer: impl Into<String>) -> Result<Self> {
        Self::builder(consumer).build()
    }

    /// A builder for `consumer` with the defaults of [`Inbox::new`].
    pub fn builder(consumer: impl Into<String>) -> InboxBuilder {
        InboxBuilder {
            consumer: consumer.into(),
            schema: DEFAULT_SCHEMA.to_owned(),
            wait: Wait::Block,
            store_outcomes: true,
            gap_policy: GapPolicy::Wait,
            verify_transaction: true,
            partitioned: false,
            pooler: Pooler::None,
        }
    }

    /// The consumer name that scopes this inbox's keys.
    pub fn consumer(&self) -> &str {
        &self.inner.consumer
    }

    /// The schema holding the inbox table.
    pub fn schema(&self) -> &str {
        self.inner.schema.as_str()
    }

    /// Runs `handler` once per key, on the caller's transaction.
    ///
    /// Claims `key`, and only if this is its first delivery runs `handler` with the same
    /// connection, so the handler's writes and the inbox row commit or roll back together.
    /// The caller commits (and then acks the message); `Duplicate` and `Rejected` are
    /// successes to ack as well.
    ///
    /// - The handler's return value is stored (unless it is JSON `null` or storing is off)
    ///   and returned to later duplicates.
    /// - After the handler, one statement (the outcome's UPDATE, else `SELECT 1`) checks the
    ///   transaction is still alive: a handler that swallowed a failed statement gets
    ///   [`Error::TransactionAbortedInHandler`], never `Processed`.
    /// - Not cancel-safe: if this future is dropped while the handler runs, roll the
    ///   transaction back (dropping it does); committing would record the key with only part
    ///   of the handler's work.
    /// - A handler error is returned unchanged. The transaction is then aborted on the server
    ///   so that nothing of it can commit: roll it back (dropping it does).
    /// - A handler panic aborts the transaction the same way, then resumes unwinding.
    /// - Invalid keys are refused before any SQL runs; the transaction stays usable.
    /// - Under REPEATABLE READ or SERIALIZABLE, losing a race to a concurrent claim surfaces
    ///   as an error whose [`Error::is_retryable`] is true: retry the transaction.
    ///
    /// # Passing a pool?
    ///
    /// `process` runs inside a transaction you own, so it takes `&mut Transaction`, not a
    /// `&PgPool` (`inbox.process(&pool, ...)` does not compile: "expected `&mut
    /// Transaction<'_, Postgres>`, found `&Pool<Postgres>`"). Either begin one and commit it
    /// yourself, with whatever else belongs in it:
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool) -> Result<(), pgbox::Error> {
    /// let inbox = pgbox::Inbox::new("points")?;
    /// let mut tx = pool.begin().await?;
    /// let outcome = inbox
    ///     .process(&mut tx, "order-42", async |conn| {
    ///         sqlx::query("UPDATE accounts SET points = points + 10 WHERE id = 7")
    ///             .execute(&mut *conn)
    ///             .await?;
    ///         Ok::<_, pgbox::Error>(())
    ///     })
    ///     .await?;
    /// tx.commit().await?; // then ack the message
    /// # let _ = outcome; Ok(())
    /// # }
    /// ```
    ///
    /// or let pgbox begin and commit it: [`process_and_commit(&pool, ...)`](Self::process_and_commit)
    /// takes the pool (or a connection) and is the same call in one step.
    ///
    /// ```compile_fail
    /// # async fn f(pool: sqlx::PgPool) -> Result<(), pgbox::Error> {
    /// let inbox = pgbox::Inbox::new("points")?;
    /// inbox.process(&pool, "order-42", async |_conn| Ok::<_, pgbox::Error>(())).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// If the compiler insists that a `Transaction` you pass is not a `Transaction`
    /// ("expected `Transaction<'_, Postgres>`, found a different `Transaction<'_,
    /// Postgres>`", with a note that there are multiple different versions of crate
    /// `sqlx_core` in the dependency graph), your application builds another sqlx version
    /// than pgbox's: `cargo tree -i sqlx` lists both. Depend on the version pgbox uses, or
    /// use the one it re-exports, [`pgbox::sqlx`](crate::sqlx).
    pub async fn process<T, E, F>(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: impl Into<Key<'_>>,
        handler: F,
    ) -> Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> Result<T, E>,
        T: Serialize,
        E: From<Error>,
    {
        self.process_or_reject(tx, key, async move |conn: &mut HandlerConnection<'_>| {
            handler(conn).await.map(Verdict::Accept)
        })
        .await
    }

    /// Like [`process`](Self::process), for handlers that may refuse a message for good by
    /// returning [`Verdict::Reject`]: the inbox row then commits with the reason, and the
    /// outcome is [`Outcome::Rejected`].
    pub async fn process_or_reject<T, E, F>(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: impl Into<Key<'_>>,
        handler: F,
    ) -> Result<Outcome<T>, E>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> Result<Verdict<T>, E>,
        T: Serialize,
        E: From<Error>,
    {
        let key = key.into();
        key.validate()?;
        let span = self.process_span(&key);
        async move {
            let claimed = match self.claim_validated(tx, &key).await? {
                Claim::Claimed(claimed) => claimed,
                Claim::Duplicate(duplicate) => return Ok(Outcome::Duplicate(duplicate)),
                Claim::InProgress => return Ok(Outcome::InProgress),
            };
            let (verdict, needs_check) = run_handler(tx, self.inner.pooler, handler).await?;
            let (outcome, check_owed) = self
                .record_verdict(tx, &claimed, verdict, needs_check)
                .await?;
            if check_owed != Check::None {
                self.verify(tx, &claimed, check_owed)
                    .await
                    .map_err(handler_aborted)?;
            }
            if outcome.is_processed() {
                tracing::debug!("pgbox message processed");
            }
            Ok(outcome)
        }
        .instrument(span)
        .await
    }

    /// The span of one message through `process` or `process_and_commit`.
    fn process_span(&self, key: &Key<'_>) -> tracing::Span {
        tracing::info_span!(
            "pgbox.inbox.process",
            consumer = %self.inner.consumer,
            key = %key.as_str(),
            message_id = key.message_id(),
        )
    }

    /// Claims `key` on the caller's transaction without running anything: the lower-level
    /// form of [`process`](Self::process) for callers who want explicit control.
    pub async fn claim(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: impl Into<Key<'_>>,
    ) -> Result<Claim> {
        let key = key.into();
        key.validate()?;
        let span = tracing::info_span!(
            "pgbox.inbox.claim",
            consumer = %self.inner.consumer,
            key = %key.as_str(),
            message_id = key.message_id(),
        );
        self.claim_validated(tx, &key).instrument(span).await
    }

    /// The record of `key` if a committed transaction (or a completed lease) processed (or
    /// rejected) it, `None` for a key under a lease: one autocommit `SELECT`, no
    /// transaction, nothing written.
    ///
    /// The cheap way to settle a redelivery: if it returns `Some`, acknowledge the message
    /// without opening a transaction. `None` proves nothing (the key may be claimed an instant
    /// later): process the message through [`process`](Self::process), which decides.
    /// The [`Consumer`](crate::Consumer) runner does this for every redelivery.
    ///
    /// Behind a pooler in transaction mode ([`Pooler::Transaction`]), pass a transaction,
    /// never the pool: an autocommit statement with parameters can be split across two
    /// server connections there.
    pub async fn lookup<'e, X>(
        &self,
        executor: X,
        key: impl Into<Key<'_>>,
    ) -> Result<Option<Duplicate>>
    where
        X: sqlx::Executor<'e, Database = Postgres>,
    {
        let key = key.into();
        key.validate()?;
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.read.clone()))
            .persistent(self.inner.persistent())
            .bind(&self.inner.consumer)
            .bind(key.as_str())
            .fetch_optional(executor)
            .await?;
        let Some(row) = row else { return Ok(None) };
        // A key under a lease is not processed yet.
        if row.try_get::<Option<bool>, _>(1)? != Some(false) {
            return Ok(None);
        }
        let duplicate = duplicate_from_row(&row)?;
        tracing::info!(
            consumer = %self.inner.consumer,
            key = %key.as_str(),
            first_processed_at = %rfc3339(duplicate.first_processed_at),
            rejected = duplicate.was_rejected(),
            "pgbox duplicate found by lookup"
        );
        Ok(Some(duplicate))
    }

    /// [`lookup`](Self::lookup) on a pool, in a transaction of its own behind a transaction
    /// pooler (the consumer runner's redelivery check).
    pub(crate) async fn lookup_on_pool(
        &self,
        pool: &sqlx::PgPool,
        key: Key<'_>,
    ) -> Result<Option<Duplicate>> {
        let mut unit = self.inner.pooler.unit(pool).await?;
        let found = self.lookup(&mut *unit, key).await?;
        unit.finish().await?;
        Ok(found)
    }

    async fn claim_validated(&self, conn: &mut PgConnection, key: &Key<'_>) -> Result<Claim> {
        let started = std::time::Instant::now();
        let claim = self
            .claim_statement(conn, key)
            .await
            .map_err(partitions::layout_error);
        metrics::histogram!(
            crate::telemetry::INBOX_CLAIM_DURATION,
            "consumer" => self.inner.consumer.clone()
        )
        .record(started.elapsed());
        claim
    }

    async fn claim_statement(&self, conn: &mut PgConnection, key: &Key<'_>) -> Result<Claim> {
        let sql = &self.inner.sql;
        let lock_timeout = self.lock_timeout();
        let expect_duplicate = self.inner.last_was_duplicate.load(Relaxed);
        let (statement, plain) = match (lock_timeout.as_ref(), &sql.claim_new) {
            (Some(_), _) => (sql.claim_bounded.clone(), false),
            (None, Some(claim_new)) if !expect_duplicate => (claim_new.clone(), true),
            (None, _) => (sql.claim.clone(), false),
        };
        let mut query = sqlx::query(AssertSqlSafe(statement))
            .persistent(self.inner.persistent())
            .bind(&self.inner.consumer)
            .bind(key.as_str())
            .bind(key.message_id());
        if let Some(lock_timeout) = lock_timeout {
            query = query.bind(lock_timeout);
        }
        let row = query.fetch_optional(&mut *conn).await?;
        let claim = match self.settle_claim(conn, row, key).await {
            // The plain INSERT found the key held, and by the time `read` looked (a new
            // snapshot under READ COMMITTED) the row was gone: a lease released, a purge.
            // Nothing was written and no transaction id taken, so claim once more with the
            // statement that decides in one snapshot, as the reading form would have.
            Err(Error::ConcurrentClaim { .. }) if plain => {
                tracing::debug!(
                    "pgbox key's record went away between the claim and its read; claiming again"
                );
                let row = sqlx::query(AssertSqlSafe(sql.claim.clone()))
                    .persistent(self.inner.persistent())
                    .bind(&self.inner.consumer)
                    .bind(key.as_str())
                    .bind(key.message_id())
                    .fetch_optional(&mut *conn)
                    .await?;
                self.settle_claim(conn, row, key).await?
            }
            other => other?,
        };
        let duplicate = matches!(claim, Claim::Duplicate(_));
        if duplicate != expect_duplicate {
            self.inner.last_was_duplicate.store(duplicate, Relaxed);
        }
        Ok(claim)
    }

    /// The lock timeout of the bounded claims, `None` for [`Wait::Block`].
    fn lock_timeout(&self) -> Option<String> {
        match self.inner.wait {
            Wait::Block => None,
            Wait::Timeout(d) => Some(format!("{}ms", d.as_millis())),
            Wait::NoWait => Some("1ms".to_owned()),
        }
    }

    /// Decides a claim from the claim statement's row: `None` when the statement returned
    /// none (a conflict with a row its snapshot does not see: committed while it waited).
    async fn settle_claim(
        &self,
        conn: &mut PgConnection,
        row: Option<PgRow>,
        key: &Key<'_>,
    ) -> Result<Claim> {
        let sql = &self.inner.sql;
        let row = match row {
            Some(row) => row,
            // A duplicate: the key is held by a committed row (perhaps committed while we
            // waited, after our statement's snapshot). A new statement sees it under READ
            // COMMITTED; under REPEATABLE READ the INSERT already raised a serialization error.
            None => sqlx::query(AssertSqlSafe(sql.read.clone()))
                .persistent(self.inner.persistent())
                .bind(&self.inner.consumer)
                .bind(key.as_str())
                .fetch_optional(&mut *conn)
                .await?
                .ok_or_else(|| Error::ConcurrentClaim {
                    consumer: self.inner.consumer.clone(),
                    key: key.as_str().to_owned(),
                })?,
        };
        // A key under a lease whose holder is gone (lease mode's CONSUMING, expired): take it
        // over in this transaction rather than report it in progress until a purge. A live
        // lease, or one another session holds locked, stays in progress; a pure duplicate
        // never gets here.
        let in_progress: Option<bool> = row.try_get(1)?;
        if in_progress == Some(true)
            && let Some(take_expired_lease) = &sql.take_expired_lease
            && let Some(taken) = sqlx::query(AssertSqlSafe(take_expired_lease.clone()))
                .persistent(self.inner.persistent())
                .bind(&self.inner.consumer)
                .bind(key.as_str())
                .bind(key.message_id())
                .fetch_optional(&mut *conn)
                .await?
        {
            tracing::warn!(
                key = %key.as_str(),
                "pgbox key's lease had expired; claimed by this transaction"
            );
            return self.decode_claim(&taken, key);
        }
        self.decode_claim(&row, key)
    }

    fn decode_claim(&self, row: &PgRow, key: &Key<'_>) -> Result<Claim> {
        let claimed: Option<bool> = row.try_get(0)?;
        let in_progress: Option<bool> = row.try_get(1)?;
        if in_progress == Some(true) {
            tracing::info!(
                "pgbox key in progress in another transaction or under a lease; redeliver later"
            );
            return Ok(Claim::InProgress);
        }
        if claimed == Some(true) {
            tracing::debug!("pgbox key claimed");
            let xact: Option<String> = row.try_get(6)?;
            return Ok(Claim::Claimed(Claimed {
                inbox: self.clone(),
                key: key.as_str().to_owned(),
                xact: xact.ok_or_else(|| Error::Database {
                    kind: crate::DbErrorKind::Other,
                    source: sqlx::Error::Protocol("claim returned no transaction id".into()),
                })?,
            }));
        }
        let duplicate = duplicate_from_row(row)?;
        tracing::info!(
            first_processed_at = %rfc3339(duplicate.first_processed_at),
            first_message_id = duplicate.message_id.as_deref(),
            rejected = duplicate.was_rejected(),
            "pgbox duplicate skipped"
        );
        Ok(Claim::Duplicate(duplicate))
    }

    /// Records what the handler decided, on the claim's transaction: the outcome (when one is
    /// stored) or the rejection. Returns the outcome and whether the transaction's liveness
    /// is still to be checked: a handler statement bypassed the watched connection or failed,
    /// and no UPDATE here proved the transaction alive.
    async fn record_verdict<T: Serialize>(
        &self,
        conn: &mut PgConnection,
        claimed: &Claimed,
        verdict: Verdict<T>,
        needs_check: Check,
    ) -> Result<(Outcome<T>, Check)> {
        match verdict {
            Verdict::Accept(value) => {
                let json = if self.inner.store_outcomes {
                    match outcome_json(&value) {
                        Ok(json) => Some(json).filter(|j| !j.is_null()),
                        Err(e) => {
                            abort_transaction(conn).await;
                            return Err(e);
                        }
                    }
                } else {
                    None
                };
                // The UPDATE doubles as the liveness check.
                let check_owed = match json {
                    Some(json) => {
                        self.store_json(conn, claimed, json)
                            .await
                            .map_err(handler_ended)?;
                        Check::None
                    }
                    None if self.inner.verify_transaction => needs_check,
                    None => Check::None,
                };
                Ok((Outcome::Processed(value), check_owed))
            }
            Verdict::Reject(reason) => {
                self.store_rejection(conn, claimed, &reason)
                    .await
                    .map_err(handler_ended)?;
                Ok((Outcome::Rejected(reason), Check::None))
            }
        }
    }

    async fn store_json(
        &self,
        conn: &mut PgConnection,
        claimed: &Claimed,
        json: serde_json::Value,
    ) -> Result<()> {
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.store_outcome.clone()))
            .persistent(self.inner.persistent())
            .bind(&self.inner.consumer)
            .bind(&claimed.key)
            .bind(sqlx::types::Json(json))
            .bind(&claimed.xact)
            .execute(conn)
            .await?;
        self.expect_one_row(done.rows_affected(), &claimed.key)
    }

    /// Checks that the handler left the claim's transaction alive and in place: fails with
    /// the server's "transaction is aborted" error if a statement inside the handler failed,
    /// and with [`Error::TransactionEndedInHandler`] if the connection is no longer in the
    /// transaction that claimed. (The idempotency layer's check.)
    #[cfg(feature = "axum")]
    pub(crate) async fn verify_alive(
        &self,
        conn: &mut PgConnection,
        claimed: &Claimed,
    ) -> Result<()> {
        self.verify(conn, claimed, Check::Alive).await
    }

    /// [`verify_alive`](Self::verify_alive); with [`Check::AliveAndClaimed`] the claim's row
    /// must still be there too (a `ROLLBACK TO` in the handler may have undone it), else
    /// [`Error::TransactionEndedInHandler`] as well.
    async fn verify(&self, conn: &mut PgConnection, claimed: &Claimed, check: Check) -> Result<()> {
        metrics::counter!(
            crate::telemetry::INBOX_LIVENESS_CHECKS,
            "consumer" => self.inner.consumer.clone()
        )
        .increment(1);
        tracing::debug!(
            "pgbox liveness check: the handler used the raw connection, or a statement failed"
        );
        let query = match check {
            Check::AliveAndClaimed => {
                sqlx::query_scalar(AssertSqlSafe(self.inner.sql.verify_claimed.clone()))
                    .bind(&claimed.xact)
                    .bind(&self.inner.consumer)
                    .bind(&claimed.key)
            }
            Check::Alive | Check::None => {
                sqlx::query_scalar(AssertSqlSafe(self.inner.sql.verify.clone())).bind(&claimed.xact)
            }
        };
        let same: Option<bool> = query
            .persistent(self.inner.persistent())
            .fetch_one(conn)
            .await
            .map_err(|e| handler_aborted(e.into()))?;
        if same == Some(true) {
            Ok(())
        } else {
            tracing::error!(
                key = %claimed.key,
                "pgbox: the claim's transaction was ended inside the handler, or its claim rolled back"
            );
            Err(Error::TransactionEndedInHandler)
        }
    }

    fn expect_one_row(&self, rows: u64, key: &str) -> Result<()> {
        if rows == 1 {
            Ok(())
        } else {
            Err(Error::NotClaimed {
                consumer: self.inner.consumer.clone(),
                key: key.to_owned(),
            })
        }
    }

    async fn store_rejection(
        &self,
        conn: &mut PgConnection,
        claimed: &Claimed,
        reason: &str,
    ) -> Result<()> {
        let key = claimed.key.as_str();
        // text cannot hold NUL; keep the reason readable instead of failing the rejection.
        let reason = reason.replace('\0', "\\0");
        let done = sqlx::query(AssertSqlSafe(self.inner.sql.reject.clone()))
            .persistent(self.inner.persistent())
            .bind(&self.inner.consumer)
            .bind(key)
            .bind(&reason)
            .bind(&claimed.xact)
            .execute(conn)
            .await?;
        self.expect_one_row(done.rows_affected(), key)?;
        tracing::info!(reason = %reason, "pgbox message rejected");
        Ok(())
    }
}

/// A stored record, from the columns shared by the claim and `read` statements.
fn duplicate_from_row(row: &PgRow) -> Result<Duplicate> {
    Ok(Duplicate {
        first_processed_at: row.try_get(2)?,
        message_id: row.try_get(3)?,
        outcome: row.try_get(4)?,
        rejection: row.try_get(5)?,
    })
}

/// Serializes a handler's outcome for the jsonb column, which cannot hold NUL characters:
/// refused here, with a typed error, rather than failing in the database on every redelivery.
fn outcome_json<T: Serialize + ?Sized>(value: &T) -> Result<serde_json::Value> {
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(items) => items.iter().any(has_nul),
            serde_json::Value::Object(map) => {
                map.iter().any(|(k, v)| k.contains('\0') || has_nul(v))
            }
            _ => false,
        }
    }
    let json = serde_json::to_value(value).map_err(Error::SerializeOutcome)?;
    if crate::json::has_non_finite(value) {
        return Err(Error::InvalidField {
            field: "outcome",
            reason: "contains a NaN or infinite number, which JSON cannot represent (it would be stored as null)",
        });
    }
    if has_nul(&json) {
        return Err(Error::InvalidField {
            field: "outcome",
            reason: "contains a NUL character, which jsonb cannot store",
        });
    }
    Ok(json)
}

/// A statement after the handler failing with "transaction is aborted" means the handler
/// swallowed an error: say so. Failing with "no transaction in progress" (25P01: a nested
/// unit's queued `ROLLBACK TO SAVEPOINT`, flushed by pgbox's statement, found the
/// transaction ended by transaction control sent inside the unit) means it ended it.
pub(crate) fn handler_aborted(e: Error) -> Error {
    match e.db_kind() {
        Some(crate::DbErrorKind::TransactionAborted) => Error::TransactionAbortedInHandler,
        _ if e.sqlstate().as_deref() == Some("25P01") => {
            tracing::error!("pgbox: the claim's transaction was ended inside the handler");
            Error::TransactionEndedInHandler
        }
        _ => e,
    }
}

/// After the handler, the outcome's or rejection's UPDATE, which names the claiming
/// transaction: an aborted transaction means the handler swallowed an error; no row means the
/// connection is no longer in the transaction that claimed.
fn handler_ended(e: Error) -> Error {
    match handler_aborted(e) {
        Error::NotClaimed { key, .. } => {
            tracing::error!(key = %key, "pgbox: the claim's transaction was ended inside the handler");
            Error::TransactionEndedInHandler
        }
        e => e,
    }
}

/// Runs a handler on the claim's transaction. An error or a panic aborts the transaction on
/// the server first (see [`abort_transaction`]); a panic then resumes unwinding. Returns the
/// value and the check owed before success may be reported (see [`Check`]).
///
/// sqlx's transaction depth is compared with the claim's level once the handler is done,
/// whatever it returned: below it (sqlx rolled back the claim's level, as it does when a
/// nested `begin` fails or is dropped mid-flight), or above it (a nested unit left open,
/// which would turn the caller's commit into a `RELEASE`), the handler's `Ok` becomes
/// [`Error::TransactionEndedInHandler`], never a success. Both are read from sqlx's
/// bookkeeping: no round trip.
pub(crate) async fn run_handler<V, E, F>(
    conn: &mut PgConnection,
    pooler: Pooler,
    handler: F,
) -> Result<(V, Check), E>
where
    F: AsyncFnOnce(&mut HandlerConnection<'_>) -> Result<V, E>,
    E: From<Error>,
{
    let mut watched = HandlerConnection::new(&mut *conn, pooler);
    let result = AssertUnwindSafe(handler(&mut watched)).catch_unwind().await;
    let needs_check = watched.needs_check();
    let nesting = watched.nesting();
    let connection_lost = watched.connection_lost();
    if nesting != Nesting::Level {
        restore_level(conn, nesting).await;
    }
    match result {
        Ok(Ok(_)) if nesting != Nesting::Level => {
            abort_transaction(conn).await;
            Err(Error::TransactionEndedInHandler.into())
        }
        Ok(Ok(value)) => Ok((value, needs_check)),
        // A statement of the handler's lost the connection: the database went away under it,
        // whatever error the handler made of that. Reported as such (retryable, and never
        // the message's failure: the runner does not count it toward `max_deliveries`).
        Ok(Err(_)) if connection_lost => {
            tracing::warn!("pgbox handler's connection was lost; the transaction is gone");
            Err(Error::Database {
                kind: crate::DbErrorKind::ConnectionLost,
                source: sqlx::Error::Io(std::io::Error::other(
                    "the connection was lost under the handler",
                )),
            }
            .into())
        }
        Ok(Err(error)) => {
            tracing::warn!("pgbox handler failed; transaction aborted, roll it back");
            abort_transaction(conn).await;
            Err(error)
        }
        Err(panic) => {
            tracing::error!("pgbox handler panicked; transaction aborted");
            abort_transaction(conn).await;
            std::panic::resume_unwind(panic);
        }
    }
}

/// Brings sqlx's transaction depth back to the claim's level after a handler that left it
/// elsewhere (see [`Nesting`]), so that what the caller does next (`commit`, `rollback`, the
/// pool taking the connection back) acts on the level it expects.
///
/// - Above it: every nested unit left open is rolled back, newest first. sqlx's own queued
///   rollback is used (it lowers the depth whatever the server answers: a level the server
///   no longer has still leaves sqlx's count). The transaction is aborted afterwards by the
///   caller, since a `ROLLBACK TO` would otherwise revive an aborted one.
/// - Below it: sqlx has already rolled back the claim's level, or queued that rollback; it is
///   sent now rather than with whatever statement comes next on the connection.
async fn restore_level(conn: &mut PgConnection, nesting: Nesting) {
    match nesting {
        Nesting::Level => return,
        Nesting::Above(levels) => {
            tracing::error!(
                levels,
                "pgbox: the handler left nested units of work open (a leaked Transaction); \
                 rolled back, the message is not recorded"
            );
            for _ in 0..levels {
                PgTransactionManager::start_rollback(conn);
            }
        }
        Nesting::Below => {
            tracing::error!(
                "pgbox: the inbox's transaction was rolled back inside the handler by a nested \
                 unit's failed or abandoned begin; the message is not recorded"
            );
        }
    }
    // Sends what sqlx queued and reads every answer: each error ends one wait with the
    // answers after it still unread, so a few rounds at most (one per queued statement,
    // plus the in-flight one a dropped begin left). A lost connection fails every round.
    for _ in 0..8 {
        if sqlx::Connection::ping(&mut *conn).await.is_ok() {
            break;
        }
    }
}

/// Puts the transaction into the aborted state on the server: every later statement fails
/// and COMMIT turns into ROLLBACK. Used when the handler failed or panicked, so a caller that
/// commits anyway cannot record the key without its effects.
async fn abort_transaction(conn: &mut PgConnection) {
    let result = sqlx::raw_sql(
        "DO $$BEGIN RAISE EXCEPTION 'pgbox: the message handler failed; this transaction can only roll back'; END$$",
    )
    .execute(conn)
    .await;
    debug_assert!(result.is_err(), "the abort statement always raises");
}

/// A timestamp for logs, in RFC 3339 (`2026-11-27T10:27:40.97081Z`), not `time`'s own
/// `Display` (`2026-11-27 10:27:40.97081 +00:00:00`).
pub(crate) fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}
