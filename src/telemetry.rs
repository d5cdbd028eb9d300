//! Metrics, through the [`metrics`] facade: their names, their descriptions, and the gauges
//! refreshed from a cheap [`status`](crate::status()) snapshot.
//!
//! pgbox records counters and histograms as it works (the consumer runner, the relay, the
//! inbox's claim and lease takeovers) and sets gauges when [`refresh_gauges`] is called. It
//! installs no recorder: the application installs the exporter it wants (Prometheus, StatsD,
//! OpenTelemetry, ...) and, optionally, calls [`describe_metrics`] for help texts and units.
//! Without a recorder every call is a no-op.
//!
//! - **Install the recorder before starting runners.** [`Consumer::run`](crate::Consumer::run)
//!   registers its counters when it starts and keeps the handles (an atomic add per message,
//!   no lookup); a run started before the recorder was installed records nothing.
//! - **Labels are bounded**: `consumer` (the inbox's name), `topic`, `schema` (pgbox's schema),
//!   `state` (two values), `tenant` (`<database>/<schema>` for the first
//!   [`tenant_label_cap`](crate::TenantRelayBuilder::tenant_label_cap) tenants a
//!   [`TenantRelay`](crate::TenantRelay) serves, `other` past it). All are names the application chose, never a key or a message id.
//! - **Gauges cost queries, so they are not updated on the hot path**: call
//!   [`refresh_gauges`] periodically (every 10–60 s), per pgbox schema, from one instance (the
//!   janitor does). It reads index lookups only, never `count(*)` over the outbox or the queue.
//! - Lags compare a database timestamp (`created_at`, the producer transaction's `now()`) with
//!   the local clock: clock skew between the database server and the service shows up in
//!   them. Negative values are recorded as 0.
//!
//! | Name | Type | Labels |
//! |---|---|---|
//! | [`CONSUMER_PROCESSED`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_DUPLICATES`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_REJECTED`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_IN_PROGRESS`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_RETRIED`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_DEAD_LETTERED`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_HANDLER_ERRORS`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_HANDLER_PANICS`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_BATCH_ROLLBACKS`] | counter | `consumer`, `topic` |
//! | [`CONSUMER_HANDLER_DURATION`] | histogram | `consumer`, `topic` |
//! | [`CONSUMER_RECEIVE_LAG`] | histogram | `consumer`, `topic` |
//! | [`CONSUMER_LIMIT_WAITS`] | counter | `consumer`, `topic`, `limit` |
//! | [`RELAY_PUBLISHED`] | counter | `topic` |
//! | [`RELAY_RETRIED`] | counter | `topic` |
//! | [`RELAY_DEAD_LETTERED`] | counter | `topic` |
//! | [`RELAY_UNAVAILABLE`] | counter | `topic` |
//! | [`RELAY_TRANSPORT_UNAVAILABLE`] | gauge | `topic` |
//! | [`RELAY_ROUND_ERRORS`] | counter | |
//! | [`RELAY_ROUND_DURATION`] | histogram | |
//! | [`RELAY_PUBLISH_LAG`] | histogram | `topic` |
//! | [`TENANT_RELAY_PUBLISHED`] | counter | `tenant` |
//! | [`TENANT_RELAY_ROUNDS`] | counter | `tenant` |
//! | [`TENANT_RELAY_ROUND_ERRORS`] | counter | `tenant` |
//! | [`TENANT_RELAY_TENANTS`] | gauge | `state` |
//! | [`WAL_RELAY_PUBLISHED`] | counter | `slot`, `topic` |
//! | [`WAL_RELAY_PUBLISH_LAG`] | histogram | `slot`, `topic` |
//! | [`WAL_RELAY_RETRIED`] | counter | `slot` |
//! | [`WAL_RELAY_DEAD_LETTERED`] | counter | `slot` |
//! | [`WAL_RELAY_UNAVAILABLE`] | counter | `slot` |
//! | [`WAL_SLOT_RETAINED_BYTES`] | gauge | `slot` |
//! | [`FANOUT_DEFERRED`] | counter | `destination` |
//! | [`FANOUT_DELIVERED_DEFERRED`] | counter | `destination` |
//! | [`FANOUT_DEAD`] | counter | `destination` |
//! | [`INBOX_CLAIM_DURATION`] | histogram | `consumer` |
//! | [`INBOX_LIVENESS_CHECKS`] | counter | `consumer` |
//! | [`INBOX_LEASE_TAKEOVERS`] | counter | `consumer` |
//! | [`OUTBOX_BACKLOG`] | gauge | `schema`, `topic` |
//! | [`OUTBOX_OLDEST_PENDING_AGE`] | gauge | `schema`, `topic` |
//! | [`OUTBOX_DEAD_LETTERS`] | gauge | `schema`, `topic` |
//! | [`OUTBOX_SCHEDULED`] | gauge | `schema` |
//! | [`OUTBOX_SCHEDULED_OVERDUE`] | gauge (seconds) | `schema` |
//! | [`QUEUE_BACKLOG`] | gauge | `schema`, `topic` |
//! | [`QUEUE_OLDEST_AGE`] | gauge | `schema`, `topic` |
//! | [`QUEUE_DEAD_LETTERS`] | gauge | `schema`, `topic` |
//! | [`INBOX_ROWS`] | gauge | `schema`, `consumer` |
//! | [`INBOX_LEASES`] | gauge | `schema`, `consumer`, `state` |

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

use metrics::Unit;
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::error::Result;

// --- consumer runner (labels `consumer`, `topic`) ---------------------------------------------

/// Counter: deliveries whose handler ran and committed (the first effective delivery of a
/// key). Labels `consumer`, `topic`.
pub const CONSUMER_PROCESSED: &str = "pgbox_consumer_messages_processed_total";

/// Counter: deliveries the inbox found already processed (or rejected), then acked; the
/// handler did not run. Labels `consumer`, `topic`.
pub const CONSUMER_DUPLICATES: &str = "pgbox_consumer_messages_duplicate_total";

/// Counter: deliveries the handler refused for good
/// ([`Verdict::Reject`](crate::Verdict::Reject) through
/// [`Consumer::run_or_reject`](crate::Consumer::run_or_reject)), recorded and acked. Labels
/// `consumer`, `topic`.
pub const CONSUMER_REJECTED: &str = "pgbox_consumer_messages_rejected_total";

/// Counter: deliveries found in progress elsewhere (an uncommitted claim with a bounded
/// [`Wait`](crate::Wait), or a live lease in lease mode), sent back for a later redelivery.
/// Labels `consumer`, `topic`.
pub const CONSUMER_IN_PROGRESS: &str = "pgbox_consumer_messages_in_progress_total";

/// Counter: failed deliveries (errors, panics, in progress elsewhere) sent back for
/// redelivery with backoff. Labels `consumer`, `topic`.
pub const CONSUMER_RETRIED: &str = "pgbox_consumer_messages_retried_total";

/// Counter: deliveries moved to the transport's dead letters after `max_deliveries`. Labels
/// `consumer`, `topic`.
pub const CONSUMER_DEAD_LETTERED: &str = "pgbox_consumer_messages_dead_lettered_total";

/// Counter: deliveries whose handler returned an error (or whose transaction, claim or lease
/// statement failed); each is then retried or dead-lettered. Labels `consumer`, `topic`.
pub const CONSUMER_HANDLER_ERRORS: &str = "pgbox_consumer_handler_errors_total";

/// Counter: deliveries whose handler panicked; each is then retried or dead-lettered. Labels
/// `consumer`, `topic`.
pub const CONSUMER_HANDLER_PANICS: &str = "pgbox_consumer_handler_panics_total";

/// Counter: batches ([`ConsumerBuilder::batch_size`](crate::ConsumerBuilder::batch_size))
/// rolled back because one of their messages failed, or a statement of pgbox's did; their
/// other messages then ran one per transaction. Labels `consumer`, `topic`.
pub const CONSUMER_BATCH_ROLLBACKS: &str = "pgbox_consumer_batch_rollbacks_total";

/// Histogram, seconds: time spent in the handler (success, error or panic), without the
/// claim, the commit and the ack. Labels `consumer`, `topic`.
pub const CONSUMER_HANDLER_DURATION: &str = "pgbox_consumer_handler_duration_seconds";

/// Histogram, seconds: from the producer's enqueue (the envelope's `created_at`, carried by
/// every transport) to the consumer receiving the message, first deliveries only: the
/// end-to-end lag, which includes [`RELAY_PUBLISH_LAG`]. Labels `consumer`, `topic`.
pub const CONSUMER_RECEIVE_LAG: &str = "pgbox_consumer_receive_lag_seconds";

/// Counter: transactions (or batch messages) that waited for a consumer limit
/// ([`Limit`](crate::Limit)): no free concurrency slot, or no token of a rate limit yet.
/// Counted once per wait, however long. Labels `consumer`, `topic`, `limit` (the limit's
/// name, never its prefix: the label set stays bounded).
pub const CONSUMER_LIMIT_WAITS: &str = "pgbox_consumer_limit_waits_total";

// --- relay (label `topic`) --------------------------------------------------------------------

/// Counter: outbox messages published, confirmed by the transport and removed (or marked
/// published) by a committed round. Label `topic`.
pub const RELAY_PUBLISHED: &str = "pgbox_relay_messages_published_total";

/// Counter: failed publish attempts rescheduled with backoff. Label `topic`.
pub const RELAY_RETRIED: &str = "pgbox_relay_messages_retried_total";

/// Counter: outbox messages moved to the outbox dead letters after `max_attempts`. Label
/// `topic`.
pub const RELAY_DEAD_LETTERED: &str = "pgbox_relay_messages_dead_lettered_total";

/// Counter: publishes of outbox messages that found the transport unavailable (not reached,
/// no answer, connection lost): an outage, never counted as an attempt of the message, which
/// waits in the outbox. Label `topic`.
pub const RELAY_UNAVAILABLE: &str = "pgbox_relay_publish_unavailable_total";

/// Gauge: 1 while the relay backs off a topic because its transport was unavailable at the
/// last publish, 0 once the transport answers for it again. Label `topic`. Alert on it.
pub const RELAY_TRANSPORT_UNAVAILABLE: &str = "pgbox_relay_transport_unavailable";

/// Counter: relay rounds that failed (database errors; the relay retries after its poll
/// interval). No labels.
pub const RELAY_ROUND_ERRORS: &str = "pgbox_relay_round_errors_total";

/// Histogram, seconds: one relay round (claim, publish, settle, commit), for rounds that
/// claimed at least one message and committed. No labels.
pub const RELAY_ROUND_DURATION: &str = "pgbox_relay_round_duration_seconds";

// --- tenant relay (label `tenant`, capped) ----------------------------------------------------

/// Counter: messages a [`TenantRelay`](crate::TenantRelay) published (or moved into the
/// built-in queue) for a tenant, by committed rounds. Label `tenant`: `<database>/<schema>`
/// for the first [`tenant_label_cap`](crate::TenantRelayBuilder::tenant_label_cap) tenants,
/// `other` for the rest. Counted per round, whatever the tenant's backlog.
pub const TENANT_RELAY_PUBLISHED: &str = "pgbox_tenant_relay_messages_published_total";

/// Counter: rounds a [`TenantRelay`](crate::TenantRelay) ran for a tenant. Label `tenant`
/// (capped, as [`TENANT_RELAY_PUBLISHED`]).
pub const TENANT_RELAY_ROUNDS: &str = "pgbox_tenant_relay_rounds_total";

/// Counter: rounds of a [`TenantRelay`](crate::TenantRelay) that failed for a tenant (a
/// broken schema, a database away). Label `tenant` (capped, as [`TENANT_RELAY_PUBLISHED`]).
pub const TENANT_RELAY_ROUND_ERRORS: &str = "pgbox_tenant_relay_round_errors_total";

/// Gauge: tenants the [`TenantRelay`](crate::TenantRelay)s of the process serve (summed
/// over them; a relay dropped takes its own out), by `state` (`healthy`, `broken`).
pub const TENANT_RELAY_TENANTS: &str = "pgbox_tenant_relay_tenants";

/// Counter: WAL outbox messages published and passed by the slot. Labels `slot`, `topic`.
pub const WAL_RELAY_PUBLISHED: &str = "pgbox_wal_relay_messages_published_total";

/// Histogram, seconds: per WAL outbox message, from its transaction's commit to the
/// transport's confirmation. Labels `slot`, `topic`.
pub const WAL_RELAY_PUBLISH_LAG: &str = "pgbox_wal_relay_publish_lag_seconds";

/// Counter: WAL outbox messages whose publish failed and that are read again. Label `slot`.
pub const WAL_RELAY_RETRIED: &str = "pgbox_wal_relay_messages_retried_total";

/// Counter: WAL outbox messages moved to the outbox dead letters. Label `slot`.
pub const WAL_RELAY_DEAD_LETTERED: &str = "pgbox_wal_relay_messages_dead_lettered_total";

/// Counter: WAL outbox messages whose publish found the transport unavailable (an outage:
/// read again, never counted as an attempt). Label `slot`.
pub const WAL_RELAY_UNAVAILABLE: &str = "pgbox_wal_relay_publish_unavailable_total";

/// Gauge, bytes: WAL the slot retains (from its restart position to the server's current
/// one), set by the slot's reader at most every 5 s. Label `slot`.
pub const WAL_SLOT_RETAINED_BYTES: &str = "pgbox_wal_slot_retained_bytes";

/// Histogram, seconds: per published message, from the outbox row's `created_at` (the
/// producer transaction's `now()`, so it includes the rest of that transaction) to the
/// transport's confirmation. Recorded once the round commits. Label `topic`.
pub const RELAY_PUBLISH_LAG: &str = "pgbox_relay_publish_lag_seconds";

// --- fan-out router (label `destination`) ----------------------------------------------------

/// Counter: copies of messages the router could not hand to a destination at once (the
/// destination was away, refused, timed out, or holds the message's key) and stored as
/// deferred deliveries. Label `destination`.
pub const FANOUT_DEFERRED: &str = "pgbox_fanout_deliveries_deferred_total";

/// Counter: deferred deliveries the router's drain published and removed. Label
/// `destination`.
pub const FANOUT_DELIVERED_DEFERRED: &str = "pgbox_fanout_deferred_delivered_total";

/// Counter: deferred deliveries marked dead after the router's `max_attempts` refusals; each
/// holds its key at its destination until redelivered or discarded. Label `destination`.
pub const FANOUT_DEAD: &str = "pgbox_fanout_deliveries_dead_total";

// --- inbox (label `consumer`) -----------------------------------------------------------------

/// Histogram, seconds: the inbox claim (the claim statement and, for a duplicate, the read
/// of the stored record), including any wait behind an in-flight claim of the same key.
/// Covers [`Inbox::process`](crate::Inbox::process), `process_or_reject` and
/// [`Inbox::claim`](crate::Inbox::claim). Label `consumer`.
pub const INBOX_CLAIM_DURATION: &str = "pgbox_inbox_claim_duration_seconds";

/// Counter: liveness checks after a handler (one round trip each), owed when a handler
/// statement failed or the handler used the raw connection (`&mut **conn`), where pgbox could
/// not watch. A handler that only runs statements through its `HandlerConnection` (directly or
/// through pgbox's helpers) owes none: a steadily growing count points at a handler that
/// could. Label `consumer`.
pub const INBOX_LIVENESS_CHECKS: &str = "pgbox_inbox_liveness_checks_total";

/// Counter: leases granted over an expired lease of another holder (lease mode; each
/// takeover means a holder crashed or stalled past its TTL). Label `consumer`.
pub const INBOX_LEASE_TAKEOVERS: &str = "pgbox_inbox_lease_takeovers_total";

// --- gauges, set by refresh_gauges --------------------------------------------------------------

/// Gauge: outbox messages not yet published, estimated from the first and last pending
/// sequence numbers (an upper bound). Labels `schema`, `topic`.
pub const OUTBOX_BACKLOG: &str = "pgbox_outbox_backlog_messages";

/// Gauge, seconds: age of the oldest unpublished outbox message (0 when there is none),
/// database clock. Labels `schema`, `topic`.
pub const OUTBOX_OLDEST_PENDING_AGE: &str = "pgbox_outbox_oldest_pending_age_seconds";

/// Gauge: outbox dead letters, counted up to
/// [`DEAD_LETTER_COUNT_CAP`](crate::DEAD_LETTER_COUNT_CAP). Labels `schema`, `topic`.
pub const OUTBOX_DEAD_LETTERS: &str = "pgbox_outbox_dead_letter_messages";

/// Gauge: scheduled messages waiting for their due time or their promotion (all topics),
/// counted up to 10,000 like [`Status::scheduled`](crate::Status::scheduled). Label `schema`.
pub const OUTBOX_SCHEDULED: &str = "pgbox_outbox_scheduled_messages";

/// Gauge, seconds: how long past its due time the earliest scheduled message still waits to
/// be promoted (0 when none is due), database clock. Above a poll interval or two, no relay
/// is promoting. Label `schema`.
pub const OUTBOX_SCHEDULED_OVERDUE: &str = "pgbox_outbox_scheduled_overdue_seconds";

/// Gauge: messages in the built-in queue ([`PgQueue`](crate::transport::PgQueue)), estimated
/// like [`OUTBOX_BACKLOG`]. Labels `schema`, `topic`.
pub const QUEUE_BACKLOG: &str = "pgbox_queue_backlog_messages";

/// Gauge, seconds: age of the oldest message in the built-in queue (0 when empty), database
/// clock. Labels `schema`, `topic`.
pub const QUEUE_OLDEST_AGE: &str = "pgbox_queue_oldest_age_seconds";

/// Gauge: the built-in queue's dead letters, counted up to
/// [`DEAD_LETTER_COUNT_CAP`](crate::DEAD_LETTER_COUNT_CAP). Labels `schema`, `topic`.
pub const QUEUE_DEAD_LETTERS: &str = "pgbox_queue_dead_letter_messages";

/// Gauge: inbox rows of a consumer, counted up to
/// [`INBOX_COUNT_CAP`](crate::INBOX_COUNT_CAP) (an index-only scan that stops there). Labels
/// `schema`, `consumer`.
pub const INBOX_ROWS: &str = "pgbox_inbox_rows";

/// Gauge: keys under a lease (lease mode), `state` = `live` or `expired` (abandoned, waiting
/// for a takeover or a purge), counted up to [`LEASE_COUNT_CAP`](crate::LEASE_COUNT_CAP).
/// Labels `schema`, `consumer`, `state`.
pub const INBOX_LEASES: &str = "pgbox_inbox_leases";

/// Kinds, for [`describe_metrics`].
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric: name, kind, unit, help text (the first line of each constant's docs).
const METRICS: &[(&str, Kind, Unit, &str)] = &[
    (
        FANOUT_DEFERRED,
        Kind::Counter,
        Unit::Count,
        "Message copies the fan-out router stored as deferred deliveries.",
    ),
    (
        FANOUT_DELIVERED_DEFERRED,
        Kind::Counter,
        Unit::Count,
        "Deferred fan-out deliveries published by the router's drain.",
    ),
    (
        FANOUT_DEAD,
        Kind::Counter,
        Unit::Count,
        "Deferred fan-out deliveries marked dead after max_attempts refusals.",
    ),
    (
        CONSUMER_PROCESSED,
        Kind::Counter,
        Unit::Count,
        "Deliveries whose handler ran and committed.",
    ),
    (
        CONSUMER_DUPLICATES,
        Kind::Counter,
        Unit::Count,
        "Deliveries skipped by the inbox as already processed, then acked.",
    ),
    (
        CONSUMER_REJECTED,
        Kind::Counter,
        Unit::Count,
        "Deliveries the handler refused for good, recorded and acked.",
    ),
    (
        CONSUMER_IN_PROGRESS,
        Kind::Counter,
        Unit::Count,
        "Deliveries found in progress elsewhere, redelivered later.",
    ),
    (
        CONSUMER_RETRIED,
        Kind::Counter,
        Unit::Count,
        "Failed deliveries sent back for redelivery with backoff.",
    ),
    (
        CONSUMER_DEAD_LETTERED,
        Kind::Counter,
        Unit::Count,
        "Deliveries moved to the transport's dead letters.",
    ),
    (
        CONSUMER_HANDLER_ERRORS,
        Kind::Counter,
        Unit::Count,
        "Deliveries whose handler or transaction returned an error.",
    ),
    (
        CONSUMER_HANDLER_PANICS,
        Kind::Counter,
        Unit::Count,
        "Deliveries whose handler panicked.",
    ),
    (
        CONSUMER_BATCH_ROLLBACKS,
        Kind::Counter,
        Unit::Count,
        "Consumer batches rolled back, their messages then run one per transaction.",
    ),
    (
        CONSUMER_LIMIT_WAITS,
        Kind::Counter,
        Unit::Count,
        "Consumer transactions that waited for a concurrency or rate limit.",
    ),
    (
        CONSUMER_HANDLER_DURATION,
        Kind::Histogram,
        Unit::Seconds,
        "Time spent in the message handler.",
    ),
    (
        CONSUMER_RECEIVE_LAG,
        Kind::Histogram,
        Unit::Seconds,
        "From the producer's enqueue to the consumer receiving the message (first deliveries).",
    ),
    (
        RELAY_PUBLISHED,
        Kind::Counter,
        Unit::Count,
        "Outbox messages published and confirmed.",
    ),
    (
        RELAY_RETRIED,
        Kind::Counter,
        Unit::Count,
        "Failed publish attempts rescheduled with backoff.",
    ),
    (
        RELAY_DEAD_LETTERED,
        Kind::Counter,
        Unit::Count,
        "Outbox messages moved to the outbox dead letters.",
    ),
    (
        RELAY_UNAVAILABLE,
        Kind::Counter,
        Unit::Count,
        "Publishes of outbox messages that found the transport unavailable (an outage).",
    ),
    (
        RELAY_TRANSPORT_UNAVAILABLE,
        Kind::Gauge,
        Unit::Count,
        "1 while the relay backs off a topic whose transport is unavailable.",
    ),
    (
        TENANT_RELAY_PUBLISHED,
        Kind::Counter,
        Unit::Count,
        "Messages a tenant relay published for a tenant (label tenant, capped; other past the cap).",
    ),
    (
        TENANT_RELAY_ROUNDS,
        Kind::Counter,
        Unit::Count,
        "Rounds a tenant relay ran for a tenant (label tenant, capped).",
    ),
    (
        TENANT_RELAY_ROUND_ERRORS,
        Kind::Counter,
        Unit::Count,
        "Rounds a tenant relay ran for a tenant that failed (label tenant, capped).",
    ),
    (
        TENANT_RELAY_TENANTS,
        Kind::Gauge,
        Unit::Count,
        "Tenants a tenant relay serves, by state (healthy, broken).",
    ),
    (
        RELAY_ROUND_ERRORS,
        Kind::Counter,
        Unit::Count,
        "Relay rounds that failed.",
    ),
    (
        RELAY_ROUND_DURATION,
        Kind::Histogram,
        Unit::Seconds,
        "Relay rounds that claimed messages: claim, publish, settle, commit.",
    ),
    (
        RELAY_PUBLISH_LAG,
        Kind::Histogram,
        Unit::Seconds,
        "From the outbox row's creation to the transport's confirmation.",
    ),
    (
        WAL_RELAY_PUBLISHED,
        Kind::Counter,
        Unit::Count,
        "WAL outbox messages published and passed by the slot.",
    ),
    (
        WAL_RELAY_PUBLISH_LAG,
        Kind::Histogram,
        Unit::Seconds,
        "From the WAL outbox message's commit to the transport's confirmation.",
    ),
    (
        WAL_RELAY_RETRIED,
        Kind::Counter,
        Unit::Count,
        "WAL outbox messages whose publish failed, read again.",
    ),
    (
        WAL_RELAY_DEAD_LETTERED,
        Kind::Counter,
        Unit::Count,
        "WAL outbox messages moved to the outbox dead letters.",
    ),
    (
        WAL_RELAY_UNAVAILABLE,
        Kind::Counter,
        Unit::Count,
        "WAL outbox messages whose publish found the transport unavailable (an outage).",
    ),
    (
        WAL_SLOT_RETAINED_BYTES,
        Kind::Gauge,
        Unit::Bytes,
        "WAL the slot retains, from its restart position to the current one.",
    ),
    (
        INBOX_CLAIM_DURATION,
        Kind::Histogram,
        Unit::Seconds,
        "The inbox claim, including any wait behind an in-flight claim of the key.",
    ),
    (
        INBOX_LIVENESS_CHECKS,
        Kind::Counter,
        Unit::Count,
        "Liveness checks owed after a handler that used the raw connection or had a statement fail.",
    ),
    (
        INBOX_LEASE_TAKEOVERS,
        Kind::Counter,
        Unit::Count,
        "Leases granted over an expired lease of another holder.",
    ),
    (
        OUTBOX_BACKLOG,
        Kind::Gauge,
        Unit::Count,
        "Outbox messages not yet published (estimate, upper bound).",
    ),
    (
        OUTBOX_OLDEST_PENDING_AGE,
        Kind::Gauge,
        Unit::Seconds,
        "Age of the oldest unpublished outbox message.",
    ),
    (
        OUTBOX_DEAD_LETTERS,
        Kind::Gauge,
        Unit::Count,
        "Outbox dead letters (capped).",
    ),
    (
        OUTBOX_SCHEDULED,
        Kind::Gauge,
        Unit::Count,
        "Scheduled messages waiting (capped).",
    ),
    (
        OUTBOX_SCHEDULED_OVERDUE,
        Kind::Gauge,
        Unit::Seconds,
        "How long the earliest due scheduled message has waited past its due time.",
    ),
    (
        QUEUE_BACKLOG,
        Kind::Gauge,
        Unit::Count,
        "Messages in the built-in queue (estimate, upper bound).",
    ),
    (
        QUEUE_OLDEST_AGE,
        Kind::Gauge,
        Unit::Seconds,
        "Age of the oldest message in the built-in queue.",
    ),
    (
        QUEUE_DEAD_LETTERS,
        Kind::Gauge,
        Unit::Count,
        "Dead letters of the built-in queue (capped).",
    ),
    (
        INBOX_ROWS,
        Kind::Gauge,
        Unit::Count,
        "Inbox rows of a consumer (capped).",
    ),
    (
        INBOX_LEASES,
        Kind::Gauge,
        Unit::Count,
        "Keys under a live or expired lease (capped).",
    ),
];

/// Registers the help text and unit of every pgbox metric with the installed recorder (a
/// Prometheus exporter prints them as `# HELP` lines). Optional; call it once, after
/// installing the recorder.
pub fn describe_metrics() {
    for (name, kind, unit, help) in METRICS {
        let (name, unit, help) = (*name, *unit, *help);
        match kind {
            Kind::Counter => metrics::describe_counter!(name, unit, help),
            Kind::Gauge => metrics::describe_gauge!(name, unit, help),
            Kind::Histogram => metrics::describe_histogram!(name, unit, help),
        }
    }
}

/// Seconds from `t` (a database timestamp) to now on the local clock, 0 if negative (skew).
pub(crate) fn seconds_since(t: OffsetDateTime) -> f64 {
    seconds_between(t, OffsetDateTime::now_utc())
}

/// Seconds from `from` to `to`, 0 if negative.
pub(crate) fn seconds_between(from: OffsetDateTime, to: OffsetDateTime) -> f64 {
    (to - from).as_seconds_f64().max(0.0)
}

/// Topics and consumers given gauges by the last refresh, per schema: a topic whose backlog
/// and dead letters are gone disappears from the snapshot, and its gauges are set to 0
/// rather than left at their last value.
#[derive(Default)]
struct Reported {
    topics: BTreeSet<String>,
    consumers: BTreeSet<String>,
}

static REPORTED: Mutex<BTreeMap<String, Reported>> = Mutex::new(BTreeMap::new());

/// Refreshes the gauges of `schema` (a pgbox schema, as given to the migrator) from one
/// [`status`](crate::status()) and one [`inbox_status`](crate::inbox_status) snapshot: per
/// topic, [`OUTBOX_BACKLOG`], [`OUTBOX_OLDEST_PENDING_AGE`], [`OUTBOX_DEAD_LETTERS`],
/// [`QUEUE_BACKLOG`], [`QUEUE_OLDEST_AGE`], [`QUEUE_DEAD_LETTERS`]; per schema,
/// [`OUTBOX_SCHEDULED`] and [`OUTBOX_SCHEDULED_OVERDUE`]; per consumer,
/// [`INBOX_ROWS`] and [`INBOX_LEASES`]. Every gauge is labelled with `schema`, so services
/// with several pgbox schemas (an outbox in one, an inbox in another) report each.
///
/// Index lookups only (a few per topic and per consumer), never `count(*)` over the outbox
/// or the queue: cheap enough to run every few seconds, but it is still a handful of
/// queries, so call it from one task per process (the janitor does), not per message. A
/// topic or consumer that disappears from the snapshot (nothing pending, no dead letters)
/// has its gauges set to 0. On a database error nothing is updated and the error is
/// returned.
pub async fn refresh_gauges(pool: &PgPool, schema: &str) -> Result<()> {
    let status = crate::status::status(pool, schema).await?;
    let inboxes = crate::status::inbox_status(pool, schema).await?;
    // Validated by the snapshots above: a bounded, well-formed label value.
    let schema = schema.to_owned();
    let topic_labels = |topic: &str| [("schema", schema.clone()), ("topic", topic.to_owned())];
    let consumer_labels = |consumer: &str| {
        [
            ("schema", schema.clone()),
            ("consumer", consumer.to_owned()),
        ]
    };

    // Under the lock, so that two refreshes of one schema cannot interleave their writes.
    let mut reported = REPORTED.lock().unwrap_or_else(PoisonError::into_inner);
    let previous = reported.remove(&schema).unwrap_or_default();
    let mut now = Reported::default();

    for t in &status.topics {
        let labels = topic_labels(&t.topic);
        let age = |oldest: Option<OffsetDateTime>| {
            oldest.map_or(0.0, |o| seconds_between(o, status.taken_at))
        };
        metrics::gauge!(OUTBOX_BACKLOG, &labels).set(t.outbox_backlog_estimate as f64);
        metrics::gauge!(OUTBOX_OLDEST_PENDING_AGE, &labels).set(age(t.outbox_oldest_pending));
        metrics::gauge!(OUTBOX_DEAD_LETTERS, &labels).set(t.outbox_dead_letters as f64);
        metrics::gauge!(QUEUE_BACKLOG, &labels).set(t.queue_backlog_estimate as f64);
        metrics::gauge!(QUEUE_OLDEST_AGE, &labels).set(age(t.queue_oldest));
        metrics::gauge!(QUEUE_DEAD_LETTERS, &labels).set(t.queue_dead_letters as f64);
        now.topics.insert(t.topic.clone());
    }
    for gone in previous.topics.difference(&now.topics) {
        let labels = topic_labels(gone);
        for name in [
            OUTBOX_BACKLOG,
            OUTBOX_OLDEST_PENDING_AGE,
            OUTBOX_DEAD_LETTERS,
            QUEUE_BACKLOG,
            QUEUE_OLDEST_AGE,
            QUEUE_DEAD_LETTERS,
        ] {
            metrics::gauge!(name, &labels).set(0.0);
        }
    }

    let schema_label = [("schema", schema.clone())];
    metrics::gauge!(OUTBOX_SCHEDULED, &schema_label).set(status.scheduled as f64);
    let overdue = status
        .next_scheduled_due
        .map_or(0.0, |due| seconds_between(due, status.taken_at));
    metrics::gauge!(OUTBOX_SCHEDULED_OVERDUE, &schema_label).set(overdue);

    for c in &inboxes {
        set_inbox_gauges(
            &consumer_labels(&c.consumer),
            c.rows,
            c.live_leases,
            c.expired_leases,
        );
        now.consumers.insert(c.consumer.clone());
    }
    for gone in previous.consumers.difference(&now.consumers) {
        set_inbox_gauges(&consumer_labels(gone), 0, 0, 0);
    }

    reported.insert(schema, now);
    Ok(())
}

fn set_inbox_gauges(labels: &[(&'static str, String); 2], rows: i64, live: i64, expired: i64) {
    metrics::gauge!(INBOX_ROWS, labels).set(rows as f64);
    for (state, n) in [("live", live), ("expired", expired)] {
        let [schema, consumer] = labels.clone();
        let labels = [schema, consumer, ("state", state.to_owned())];
        metrics::gauge!(INBOX_LEASES, &labels).set(n as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::METRICS;

    /// Every metric name this module defines is described (help text and unit) and listed
    /// in the module's table: a metric added without both had no `# HELP` line and was
    /// missing from the docs (`pgbox_inbox_liveness_checks_total` was).
    #[test]
    fn every_metric_is_described_and_documented() {
        let source = include_str!("telemetry.rs");
        let defined: Vec<(&str, &str)> = source
            .lines()
            .filter_map(|line| line.strip_prefix("pub const "))
            .filter_map(|rest| {
                let (constant, value) = rest.split_once(": &str = \"")?;
                value
                    .strip_suffix("\";")
                    .filter(|name| name.starts_with("pgbox_"))
                    .map(|name| (constant, name))
            })
            .collect();
        assert!(defined.len() > 20, "found only {defined:?}");
        for (constant, name) in defined {
            assert!(
                METRICS.iter().any(|(described, ..)| *described == name),
                "{name} is not in METRICS (describe_metrics)"
            );
            assert!(
                source.contains(&format!("//! | [`{constant}`] |")),
                "{constant} is not in the module docs' table"
            );
        }
    }
}
