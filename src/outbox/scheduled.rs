//! Scheduled messages: held in `outbox_scheduled` until they are due, then promoted into
//! the outbox (the table outbox: moved into `outbox` under the key's enqueue lock; the WAL
//! outbox: emitted into the WAL), where they take their place in their key's order.
//!
//! The database's clock decides everything: a `deliver_after` delay is added to the
//! enqueuing statement's `statement_timestamp()` on the server, and promotion compares due
//! times with the server's `now()`. An application's clock skew plays no part.

use std::time::Duration;

use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Row};
use time::OffsetDateTime;
use uuid::Uuid;

use super::{ENQUEUE_LOCK_CLASS, InTransaction, Message};
use crate::error::Result;
use crate::ident::Identifier;

/// The payload of the notification a scheduled enqueue sends a sleeping relay: look for
/// due scheduled messages now, not at the time the relay had planned.
pub(crate) const SCHEDULED_NOTICE: &str = "scheduled";

/// The longest [`Message::deliver_after`] delay: 100 years (36,500 days).
pub const MAX_SCHEDULE_DELAY: Duration = Duration::from_secs(36_500 * 24 * 60 * 60);

/// What happens when a scheduled message meets a pending one under the same
/// [`schedule_key`](Message::schedule_key) (and topic).
///
/// "Pending" means still in `outbox_scheduled`: not yet promoted. Whoever commits first
/// wins a race with the relay's promotion: if the pending message was promoted first, the
/// new one finds nothing and is scheduled anew, whatever the mode (neither is lost).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ScheduleConflict {
    /// The new message replaces the pending one: its payload, headers, ordering key, id and
    /// due time (debounce: "send the latest, `delay` after the last change").
    #[default]
    Replace,
    /// The new message's payload, headers, ordering key and id replace the pending one's,
    /// but the pending due time stays (throttle: "send the latest, at most once per
    /// window").
    ReplaceKeepDueTime,
    /// The pending message stays as it is and the new one is dropped (first one wins);
    /// `enqueue` returns the pending message's id.
    KeepExisting,
}

/// When a scheduled message is due.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Due {
    /// Only a schedule key or a conflict mode was set: refused at validation.
    #[default]
    Unset,
    At(OffsetDateTime),
    After(Duration),
}

/// A message's schedule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub(crate) due: Due,
    pub(crate) key: Option<String>,
    pub(crate) conflict: ScheduleConflict,
}

/// The scheduled insert of `schema`, for `conflict`; `wake` is the outbox's
/// "notify a sleeping relay" sub-select (one value).
fn insert_sql(schema: &Identifier, conflict: ScheduleConflict, wake: &str) -> String {
    let on_conflict = match conflict {
        ScheduleConflict::Replace => {
            "message_id = EXCLUDED.message_id, ordering_key = EXCLUDED.ordering_key, \
             payload = EXCLUDED.payload, content_type = EXCLUDED.content_type, \
             headers = EXCLUDED.headers, created_at = EXCLUDED.created_at, due_at = EXCLUDED.due_at"
        }
        ScheduleConflict::ReplaceKeepDueTime => {
            "message_id = EXCLUDED.message_id, ordering_key = EXCLUDED.ordering_key, \
             payload = EXCLUDED.payload, content_type = EXCLUDED.content_type, \
             headers = EXCLUDED.headers, created_at = EXCLUDED.created_at"
        }
        // A no-op update rather than DO NOTHING: it waits for (and locks) the pending row, so
        // its id can be returned, and a row promoted meanwhile is not a conflict any more.
        ScheduleConflict::KeepExisting => "schedule_key = o.schedule_key",
    };
    format!(
        "WITH ins AS (\
           INSERT INTO {schema}.outbox_scheduled AS o \
             (message_id, topic, ordering_key, payload, content_type, headers, due_at, schedule_key) \
           VALUES ($1, $2, $3, $4, $5, $6, \
             COALESCE($7::timestamptz, pg_catalog.statement_timestamp() + pg_catalog.make_interval(secs => $8::float8)), $9) \
           ON CONFLICT (topic, schedule_key) WHERE schedule_key IS NOT NULL DO UPDATE SET {on_conflict} \
           RETURNING o.message_id) \
         SELECT ins.message_id, ({wake}) FROM ins"
    )
}

/// Writes `m` (validated, scheduled) into `outbox_scheduled` in the caller's transaction;
/// returns the id of the message now pending (the pending one's under
/// [`ScheduleConflict::KeepExisting`]).
pub(crate) async fn insert(
    schema: &Identifier,
    wake: &str,
    persistent: bool,
    tx: &mut impl InTransaction,
    m: Message,
) -> Result<Uuid> {
    let schedule = m.schedule.clone().unwrap_or_default();
    let (at, after) = match schedule.due {
        // Far in the past is "due now"; the floor keeps it in PostgreSQL's range.
        Due::At(at) => (Some(at.max(OffsetDateTime::UNIX_EPOCH)), None),
        Due::After(delay) => (None, Some(delay.as_secs_f64())),
        Due::Unset => (None, Some(0.0)),
    };
    let sql = insert_sql(schema, schedule.conflict, wake);
    let done = sqlx::query(AssertSqlSafe(sql))
        .persistent(persistent)
        .bind(m.id)
        .bind(m.topic)
        .bind(m.ordering_key)
        .bind(m.payload)
        .bind(m.content_type)
        .bind(Json(m.headers))
        .bind(at)
        .bind(after)
        .bind(schedule.key)
        .fetch_one(tx.connection())
        .await;
    if done.is_err() {
        tx.statement_failed();
    }
    Ok(done?.try_get(0)?)
}

/// Deletes the pending message under (`topic`, `key`); whether there was one.
pub(crate) async fn cancel(
    schema: &Identifier,
    persistent: bool,
    tx: &mut impl InTransaction,
    topic: &str,
    key: &str,
) -> Result<bool> {
    let sql = format!(
        "DELETE FROM {schema}.outbox_scheduled WHERE topic = $1 AND schedule_key = $2 \
         RETURNING message_id"
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .persistent(persistent)
        .bind(topic)
        .bind(key)
        .fetch_optional(tx.connection())
        .await;
    if done.is_err() {
        tx.statement_failed();
    }
    Ok(done?.is_some())
}

/// Moves the pending message under (`topic`, `key`) to a new due time; whether there was
/// one.
pub(crate) async fn reschedule(
    schema: &Identifier,
    wake: &str,
    persistent: bool,
    tx: &mut impl InTransaction,
    topic: &str,
    key: &str,
    at: OffsetDateTime,
) -> Result<bool> {
    // A sleeping relay is told (as by a scheduled enqueue): the new due time may be sooner
    // than the one it sleeps towards.
    let sql = format!(
        "WITH moved AS (\
           UPDATE {schema}.outbox_scheduled SET due_at = $3 WHERE topic = $1 AND schedule_key = $2 \
           RETURNING 1) \
         SELECT (SELECT pg_catalog.count(*) FROM moved)::int8, ({wake})"
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .persistent(persistent)
        .bind(topic)
        .bind(key)
        .bind(at.max(OffsetDateTime::UNIX_EPOCH))
        .fetch_one(tx.connection())
        .await;
    if done.is_err() {
        tx.statement_failed();
    }
    let moved: i64 = done?.try_get(0)?;
    Ok(moved > 0)
}

/// The statement promoting up to `limit` due rows of `schema` into its `outbox` table, in
/// due order then scheduling order; its row count is the number promoted.
///
/// The per-key enqueue locks are taken first (sorted, as a batch producer takes them), on
/// the keys of the due candidates read without a lock; only then are the rows locked (`FOR
/// UPDATE SKIP LOCKED`: another relay's, or a cancel's, are skipped) and moved, so that a
/// promoted row's seq is drawn under its key's lock and "per key, seq order = commit order"
/// holds. A candidate whose key changed (replaced) or whose due time moved meanwhile is
/// left for the next round, and so is every later candidate of its ordering key: a row held
/// by a producer (a cancel, a reschedule, a replacement or a `KeepExisting` enqueue in an
/// open transaction) is skipped, and the key's later messages must not overtake it.
pub(crate) fn promote_sql(schema: &Identifier, limit: usize) -> String {
    format!(
        "WITH cand AS MATERIALIZED (\
           SELECT c.sched_seq, c.topic, c.ordering_key, c.due_at FROM {schema}.outbox_scheduled AS c \
           WHERE c.due_at <= pg_catalog.now() ORDER BY c.due_at, c.sched_seq LIMIT {limit}), \
         locks AS MATERIALIZED (\
           SELECT k.topic, k.ordering_key \
           FROM (SELECT DISTINCT topic, ordering_key FROM cand WHERE ordering_key IS NOT NULL \
                 ORDER BY topic, ordering_key) AS k \
           WHERE pg_catalog.pg_try_advisory_xact_lock({class}, \
             pg_catalog.hashtext(k.topic || pg_catalog.chr(31) || k.ordering_key))), \
         locked AS MATERIALIZED (SELECT pg_catalog.count(*) AS n FROM locks), \
         due AS MATERIALIZED (\
           SELECT o.sched_seq FROM {schema}.outbox_scheduled AS o \
           CROSS JOIN locked JOIN cand ON cand.sched_seq = o.sched_seq \
           WHERE o.due_at <= pg_catalog.now() AND o.topic = cand.topic \
             AND o.ordering_key IS NOT DISTINCT FROM cand.ordering_key \
             AND (cand.ordering_key IS NULL OR EXISTS (SELECT 1 FROM locks AS l \
               WHERE l.topic = cand.topic AND l.ordering_key = cand.ordering_key)) \
           FOR UPDATE OF o SKIP LOCKED), \
         moved AS (\
           DELETE FROM {schema}.outbox_scheduled AS o USING ({in_order}) AS ok \
           WHERE o.sched_seq = ok.sched_seq \
           RETURNING o.*) \
         INSERT INTO {schema}.outbox (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
         SELECT message_id, topic, ordering_key, payload, content_type, headers, \
           GREATEST(created_at, due_at) \
         FROM moved ORDER BY due_at, sched_seq",
        class = ENQUEUE_LOCK_CLASS,
        in_order = IN_KEY_ORDER,
    )
}

/// The locked candidates (`due`) that no earlier candidate of their (topic, ordering key)
/// left behind (`cand` minus `due`: skipped, locked by another transaction, or changed):
/// a key's scheduled messages are promoted in its due order or not at all this round.
///
/// One pass over the candidates in each key's due order (a window), not a correlated search
/// per row: a keyed candidate goes if it and every earlier candidate of its key were locked.
const IN_KEY_ORDER: &str = "SELECT x.sched_seq FROM (\
      SELECT c.sched_seq, c.ordering_key, d.sched_seq IS NOT NULL AS taken, \
        pg_catalog.bool_and(d.sched_seq IS NOT NULL) OVER (PARTITION BY c.topic, c.ordering_key \
          ORDER BY c.due_at, c.sched_seq) AS all_taken \
      FROM cand AS c LEFT JOIN due AS d ON d.sched_seq = c.sched_seq) AS x \
    WHERE x.taken AND (x.ordering_key IS NULL OR x.all_taken)";

/// The statement taking up to `limit` due rows of `schema` off `outbox_scheduled` (locked,
/// skipping rows another transaction holds, and the later rows of their ordering keys),
/// returning them for the WAL relay to emit in
/// the same transaction.
pub(crate) fn take_due_sql(schema: &Identifier, limit: usize) -> String {
    format!(
        "WITH cand AS MATERIALIZED (\
           SELECT c.sched_seq, c.topic, c.ordering_key, c.due_at FROM {schema}.outbox_scheduled AS c \
           WHERE c.due_at <= pg_catalog.now() ORDER BY c.due_at, c.sched_seq LIMIT {limit}), \
         due AS MATERIALIZED (\
           SELECT o.sched_seq FROM {schema}.outbox_scheduled AS o JOIN cand ON cand.sched_seq = o.sched_seq \
           WHERE o.due_at <= pg_catalog.now() AND o.topic = cand.topic \
             AND o.ordering_key IS NOT DISTINCT FROM cand.ordering_key \
           FOR UPDATE OF o SKIP LOCKED) \
         DELETE FROM {schema}.outbox_scheduled AS o USING ({in_order}) AS ok \
         WHERE o.sched_seq = ok.sched_seq \
         RETURNING o.message_id, o.topic, o.ordering_key, o.payload, o.content_type, o.headers, \
           o.due_at, o.sched_seq",
        in_order = IN_KEY_ORDER,
    )
}

/// How long after a promotion that moved `moved` (of at most `batch_size`) to look again,
/// given the seconds until the earliest pending message is due (`next_due`): at once after
/// a full batch; when the earliest falls due, at most `poll_interval` ahead; and, when one is
/// due but none was moved (a producer's open transaction holds it, or holds an earlier one
/// of its key), after [`HELD_BACKOFF`] rather than at once, so that a relay does not spin on
/// it for as long as that transaction lasts.
pub(crate) fn next_look(
    moved: usize,
    batch_size: usize,
    next_due: Option<f64>,
    poll_interval: Duration,
) -> Duration {
    if moved >= batch_size {
        return Duration::ZERO;
    }
    match next_due {
        None => poll_interval,
        Some(s) if s <= 0.0 && moved == 0 => HELD_BACKOFF.min(poll_interval),
        Some(s) => Duration::from_secs_f64(s.clamp(0.0, poll_interval.as_secs_f64())),
    }
}

/// How long until a relay that just moved `moved` due messages looks again: at once after a
/// full batch (without asking), else [`next_look`] from one probe of the due-time index
/// (`next_due_sql`).
pub(crate) async fn wait_before_next_look(
    pool: &sqlx::PgPool,
    next_due_sql: &str,
    persistent: bool,
    moved: usize,
    batch_size: usize,
    poll_interval: Duration,
) -> Result<Duration> {
    if moved >= batch_size {
        return Ok(Duration::ZERO);
    }
    let seconds = next_due(pool, next_due_sql, persistent).await?;
    Ok(next_look(moved, batch_size, seconds, poll_interval))
}

/// How long a relay waits before it looks again at a due message it could not move.
pub(crate) const HELD_BACKOFF: Duration = Duration::from_millis(250);

/// Seconds until the earliest scheduled message of `schema` is due (0 or less: due now),
/// NULL when none is pending: one probe of the due-time index.
pub(crate) fn next_due_sql(schema: &Identifier) -> String {
    format!(
        "SELECT extract(epoch FROM pg_catalog.min(due_at) - pg_catalog.now())::float8 \
         FROM {schema}.outbox_scheduled"
    )
}

/// Promotes due rows of `schema` into the WAL: takes them off `outbox_scheduled` and emits
/// them (one transactional logical-decoding message, the producer's encoding, due order)
/// in one transaction, so they are in the WAL exactly once. Returns how many, up to
/// `limit`.
pub(crate) async fn promote_into_wal(
    pool: &sqlx::PgPool,
    schema: &Identifier,
    limit: usize,
) -> Result<usize> {
    let mut tx = crate::pooler::begin(pool, None).await?;
    let rows = sqlx::query(AssertSqlSafe(take_due_sql(schema, limit)))
        .fetch_all(&mut *tx)
        .await?;
    if rows.is_empty() {
        tx.rollback().await?;
        return Ok(0);
    }
    let mut due = Vec::with_capacity(rows.len());
    for row in &rows {
        let headers: Json<std::collections::BTreeMap<String, String>> = row.try_get("headers")?;
        let at: OffsetDateTime = row.try_get("due_at")?;
        let seq: i64 = row.try_get("sched_seq")?;
        let message = Message {
            id: row.try_get("message_id")?,
            topic: row.try_get("topic")?,
            ordering_key: row.try_get("ordering_key")?,
            payload: row.try_get("payload")?,
            content_type: row.try_get("content_type")?,
            headers: headers.0,
            schedule: None,
        };
        due.push((at, seq, message));
    }
    due.sort_by_key(|(at, seq, _)| (*at, *seq));
    let messages: Vec<Message> = due.into_iter().map(|(_, _, m)| m).collect();
    sqlx::query("SELECT pg_catalog.pg_logical_emit_message(true, $1::text, $2::bytea)")
        .bind(super::wal::prefix(schema.as_str()))
        .bind(super::wal::encode(&messages))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(messages.len())
}

/// Promotes due rows of `schema` into its `outbox` table (see [`promote_sql`]).
pub(crate) async fn promote_into_table(
    pool: &sqlx::PgPool,
    sql: &str,
    persistent: bool,
) -> Result<usize> {
    let query = sqlx::query(AssertSqlSafe(sql.to_owned())).persistent(persistent);
    let done = if persistent {
        query.execute(pool).await?
    } else {
        // Behind a pooler in transaction mode: an unnamed statement only inside a
        // transaction of its own (see `crate::pooler`).
        let mut tx = crate::pooler::begin(pool, None).await?;
        let done = query.execute(&mut *tx).await?;
        tx.commit().await?;
        done
    };
    Ok(usize::try_from(done.rows_affected()).unwrap_or(usize::MAX))
}

/// Seconds until the earliest scheduled message is due (see [`next_due_sql`]).
pub(crate) async fn next_due(
    pool: &sqlx::PgPool,
    sql: &str,
    persistent: bool,
) -> Result<Option<f64>> {
    let query = sqlx::query_scalar(AssertSqlSafe(sql.to_owned())).persistent(persistent);
    if persistent {
        return Ok(query.fetch_one(pool).await?);
    }
    // Behind a pooler in transaction mode (see `promote_into_table`).
    let mut tx = crate::pooler::begin(pool, None).await?;
    let seconds = query.fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(seconds)
}
