//! The SQL of deferred fan-out deliveries (`outbox_fanout_messages`,
//! `outbox_fanout_deliveries`, migration V18), built once per router.
//!
//! Payload rows and their last delivery: a payload row is deleted by the transaction that
//! deletes its last delivery, and only under the payload row's lock. Whoever deletes
//! deliveries first locks the payload rows (`lock_messages`, in `message_id` order), then
//! deletes the deliveries, then, in a new statement (so a new snapshot, which sees every
//! delivery another transaction deleted and committed meanwhile), deletes the payload rows
//! that have none left. A router deferring a message upserts its payload row with
//! `DO UPDATE`, which takes the same row lock (or waits for a deleting transaction and then
//! inserts the row anew), before it inserts the delivery. So two destinations' drains
//! settling the last two deliveries of one message run one after the other, and the second
//! sees the first's delete; and a delivery is never inserted for a payload row being deleted.

use crate::ident::Identifier;

/// Seed of a destination's drain lock: a 64-bit advisory lock (the single-`bigint` form,
/// which no other pgbox lock uses) keyed by
/// `hashtextextended('pgbox-fanout-drain:' || schema || '.' || destination, DRAIN_SEED)`,
/// held for one drain round: one process drains a destination at a time (another round
/// would claim the same heads and publish them twice). 64 bits, not `hashtext`'s 32: two
/// destinations whose names collide would share one lock, and a slow drain of one would
/// hold the other's (names colliding in 32 bits are found among a few hundred thousand).
pub(super) const DRAIN_SEED: i64 = 0x7062_6f66; // "pbof"

#[derive(Debug)]
pub(super) struct Statements {
    /// (destination, topic, key) triples that have a deferred delivery.
    pub(super) held: String,
    pub(super) insert_messages: String,
    pub(super) insert_deliveries: String,
    pub(super) drain_lock: String,
    pub(super) claim: String,
    pub(super) lock_messages: String,
    pub(super) delete_deliveries: String,
    pub(super) delete_orphans: String,
    pub(super) forget_ids: String,
    pub(super) retry: String,
    pub(super) status: String,
    pub(super) dead_letters: String,
    pub(super) redeliver: String,
    pub(super) discard: String,
    pub(super) due: String,
}

impl Statements {
    pub(super) fn new(s: &Identifier) -> Self {
        let d = format!("{s}.outbox_fanout_deliveries");
        let m = format!("{s}.outbox_fanout_messages");
        Statements {
            held: format!(
                "SELECT f.destination, f.topic, f.ordering_key \
                 FROM unnest($1::text[], $2::text[], $3::text[]) AS f(destination, topic, ordering_key) \
                 WHERE EXISTS (SELECT 1 FROM {d} AS d WHERE d.destination = f.destination \
                   AND d.topic = f.topic AND d.ordering_key = f.ordering_key)"
            ),
            // `DO UPDATE`, not `DO NOTHING`: the row lock orders this against a drain deleting
            // the payload row (see the module docs). Callers pass rows in message_id order, as
            // `lock_messages` locks them, so the two never deadlock.
            insert_messages: format!(
                "INSERT INTO {m} AS m (message_id, source_seq, topic, ordering_key, payload, content_type, headers, created_at) \
                 SELECT f.message_id, f.source_seq, f.topic, f.ordering_key, f.payload, f.content_type, f.headers::jsonb, f.created_at \
                 FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[], $5::bytea[], $6::text[], $7::text[], $8::timestamptz[]) \
                   AS f(message_id, source_seq, topic, ordering_key, payload, content_type, headers, created_at) \
                 ON CONFLICT (message_id) DO UPDATE SET source_seq = m.source_seq"
            ),
            // In the order given (the batch's): the identity gives each key its order.
            insert_deliveries: format!(
                "INSERT INTO {d} (destination, message_id, topic, ordering_key, attempts, last_error, available_at, dead_at) \
                 SELECT f.destination, f.message_id, f.topic, f.ordering_key, f.attempts, f.error, \
                   pg_catalog.now() + pg_catalog.make_interval(secs => f.delay), \
                   CASE WHEN f.attempts >= $8 THEN pg_catalog.now() END \
                 FROM unnest($1::text[], $2::uuid[], $3::text[], $4::text[], $5::int[], $6::text[], $7::float8[]) \
                   WITH ORDINALITY AS f(destination, message_id, topic, ordering_key, attempts, error, delay, n) \
                 ORDER BY f.n \
                 ON CONFLICT (destination, message_id) DO NOTHING"
            ),
            drain_lock: format!(
                "SELECT pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended($1, {DRAIN_SEED}))"
            ),
            // Per key, a run from the key's head: a row is claimed only while no earlier row
            // of its key at this destination is dead or waiting out a backoff. Id order, so
            // the run's earlier rows come first under the LIMIT.
            claim: format!(
                "SELECT d.id, d.attempts, m.source_seq AS seq, m.message_id, m.topic, m.ordering_key, m.payload, \
                   m.content_type, m.headers, m.created_at \
                 FROM {d} AS d JOIN {m} AS m ON m.message_id = d.message_id \
                 WHERE d.destination = $1 AND d.dead_at IS NULL AND d.available_at <= pg_catalog.now() \
                   AND (d.ordering_key IS NULL OR NOT EXISTS ( \
                     SELECT 1 FROM {d} AS e WHERE e.destination = d.destination AND e.topic = d.topic \
                       AND e.ordering_key = d.ordering_key AND e.id < d.id \
                       AND (e.dead_at IS NOT NULL OR e.available_at > pg_catalog.now()))) \
                 ORDER BY d.id LIMIT $2 FOR UPDATE OF d"
            ),
            lock_messages: format!(
                "SELECT message_id FROM {m} WHERE message_id = ANY($1) ORDER BY message_id FOR UPDATE"
            ),
            delete_deliveries: format!(
                "DELETE FROM {d} WHERE destination = $1 AND message_id = ANY($2)"
            ),
            delete_orphans: format!(
                "DELETE FROM {m} AS m WHERE m.message_id = ANY($1) \
                 AND NOT EXISTS (SELECT 1 FROM {d} AS d WHERE d.message_id = m.message_id)"
            ),
            retry: format!(
                "UPDATE {d} AS d SET attempts = d.attempts + 1, last_error = f.error, \
                   available_at = pg_catalog.now() + pg_catalog.make_interval(secs => f.delay), \
                   dead_at = CASE WHEN d.attempts + 1 >= $4 THEN pg_catalog.now() END \
                 FROM unnest($1::bigint[], $2::text[], $3::float8[]) AS f(id, error, delay) \
                 WHERE d.id = f.id RETURNING d.dead_at IS NOT NULL AS dead"
            ),
            status: format!(
                "SELECT destination, count(*) FILTER (WHERE dead_at IS NULL) AS deferred, \
                   count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead, \
                   EXTRACT(EPOCH FROM pg_catalog.now() - min(deferred_at))::float8 AS oldest \
                 FROM {d} GROUP BY destination"
            ),
            dead_letters: format!(
                "SELECT message_id, topic, ordering_key, attempts, last_error, deferred_at, dead_at \
                 FROM {d} WHERE destination = $1 AND dead_at IS NOT NULL ORDER BY id LIMIT $2"
            ),
            redeliver: format!(
                "UPDATE {d} SET dead_at = NULL, attempts = 0, last_error = NULL, available_at = pg_catalog.now() \
                 WHERE destination = $1 AND message_id = $2 AND dead_at IS NOT NULL"
            ),
            // A chunk of a removed destination's deliveries (`Router::forget_destination`).
            forget_ids: format!(
                "SELECT message_id FROM {d} WHERE destination = $1 ORDER BY id LIMIT 1000"
            ),
            discard: format!(
                "DELETE FROM {d} WHERE destination = $1 AND message_id = $2 AND dead_at IS NOT NULL"
            ),
            due: format!(
                "SELECT EXISTS (SELECT 1 FROM {d} WHERE destination = $1 AND dead_at IS NULL \
                   AND available_at <= pg_catalog.now())"
            ),
        }
    }
}
