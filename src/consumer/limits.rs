//! Limits on a consumer runner that hold across every instance of it (several processes on
//! several machines), with the database as the only coordinator: concurrency slots and rate
//! buckets, globally or per prefix of the message (a tenant, a key prefix).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::Counter;
use sqlx::{PgConnection, PgPool};

use crate::error::{Error, Result};
use crate::ident::Identifier;
use crate::outbox::Envelope;
use crate::pooler::Pooler;

/// The longest name a [`Limit`] may have, in bytes.
pub const MAX_LIMIT_NAME_BYTES: usize = 64;

/// The most concurrency slots a [`Limit::concurrency`] may have.
pub const MAX_CONCURRENCY_SLOTS: u32 = 1024;

/// The highest rate a [`Limit::rate`] accepts, per second (and the largest burst).
pub const MAX_RATE_PER_SECOND: f64 = 1_000_000.0;

/// Advisory-lock class of concurrency slots: `pg_try_advisory_xact_lock(class, key)`, apart
/// from pgbox's other classes ("pboa", "pboj", "pbok", "pbow", "pbox", "pboy", "pboz").
pub(crate) const SLOT_LOCK_CLASS: i32 = 0x7062_6f6c; // "pbol"

/// Prefixes longer than this are stored as their first bytes and a hash (a bucket row's
/// primary key stays small; two long prefixes that collide share a bucket: stricter only).
const MAX_STORED_PREFIX_BYTES: usize = 256;

/// The longest a rate bucket may span (burst × one emission interval), in microseconds:
/// 100 years, well inside PostgreSQL's timestamps.
const MAX_BUCKET_SPAN_MICROS: f64 = 100.0 * 365.25 * 86_400.0 * 1e6;

/// The longest pause between two tries for a slot or a token.
const MAX_PAUSE: Duration = Duration::from_millis(200);

/// A per-prefix rate limit's wait longer than this is not waited in the runner: the message
/// is handed back at once, to come back when its bucket has a token, so that its runner slot
/// serves other prefixes meanwhile (a prefix's backlog at the head of the queue would
/// otherwise fill the slots). A global limit's wait is waited until the unit's deadline: every
/// message needs that limit's token, so a free slot would serve nothing else.
pub(super) const HAND_BACK_PAST: Duration = Duration::from_secs(1);

/// The longest wait a bucket's answer is taken at, in seconds (a glacial rate's).
const MAX_WAIT_SECS: f64 = 24.0 * 3600.0;

/// How often a runner deletes its rate limits' full buckets.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The most a runner takes ahead of a rate limit, in time: at most this many microseconds'
/// worth of the rate per take (see [`Limit::burst`]).
const TAKE_AHEAD_MICROS: i64 = 50_000;

/// Past this many (limit, prefix) entries of tokens taken ahead, a runner forgets the
/// entries whose tokens have lapsed (prefixes that went quiet keep no memory behind).
const MAX_AHEAD_ENTRIES: usize = 4096;

type PerFn = Arc<dyn Fn(&Envelope) -> String + Send + Sync>;

/// A limit on a [`Consumer`](crate::Consumer) that holds across every runner instance
/// sharing the inbox's database ([`ConsumerBuilder::limit`](crate::ConsumerBuilder::limit)).
///
/// - [`Limit::concurrency`]: at most `n` transactions of the limit in flight at once, across
///   all instances. Each transaction holds one of `n` advisory-lock slots
///   (`pg_try_advisory_xact_lock`), released by its COMMIT or ROLLBACK, or by the server when
///   the runner's connection dies: no table, nothing to leak after a crash.
/// - [`Limit::rate`]: at most `per_second` messages a second, and [`burst`](Limit::burst) at
///   once, across all instances. One row per limit (and prefix) in the inbox schema's
///   `rate_limits` table holds the bucket (a generic cell rate algorithm); a message takes
///   its tokens with one short statement before its transaction begins, so the row is never
///   locked for longer than that statement, whose commit does not wait for the disk. With a
///   [`burst`](Limit::burst) above 1, a runner takes several tokens per statement and hands
///   them to its next messages. [`burst`](Limit::burst) says what this allows, and what a
///   crash of the database server may forget.
/// - [`per`](Limit::per) / [`per_key_prefix`](Limit::per_key_prefix): the limit holds per
///   prefix (each tenant gets its own `n` slots or its own rate) instead of globally.
///
/// A message over a limit **waits**, inside the runner, holding its runner slot (for a
/// concurrency limit, also its connection and its open transaction). It is never failed,
/// never counted as a delivery toward `max_deliveries`, never dead-lettered, and its key's
/// order is kept. If it would wait for more than a third of the visibility timeout, it is
/// handed back to the transport without being counted: it never overruns the visibility
/// timeout. Handed back for a rate limit, it comes back once the bucket has its token (at
/// least after the backoff); for a concurrency limit, after the backoff. A message whose
/// per-prefix rate limit has no token for more than a second, or whose per-prefix
/// concurrency limit has no free slot for a second, is handed back at once (then, for a
/// concurrency limit, not before that second again): a prefix's backlog at the head of the
/// queue does not hold the runner's slots while other prefixes' messages could go.
///
/// A message takes its tokens of all rate limits together, all or none: one statement
/// takes them (or the runner's tokens taken ahead, see [`burst`](Limit::burst)), and a
/// message one limit holds back takes no token of the others. (A bucket's very first row,
/// inserted by two takes at once, is the exception: the take that loses is reported as
/// denied with the other limits' tokens taken; stricter only.)
///
/// In a batch ([`ConsumerBuilder::batch_size`](crate::ConsumerBuilder::batch_size)) every
/// message takes its own rate token; a concurrency limit counts the batch's transaction once
/// per prefix it carries (its messages of one prefix share one slot).
///
/// Limits apply to [`Consumer::run`](crate::Consumer::run) and
/// [`Consumer::run_or_reject`](crate::Consumer::run_or_reject); lease mode refuses them.
/// Redeliveries answered as duplicates without a transaction take nothing.
///
/// Bucket rows are per (limit, prefix). A bucket that has refilled is the same as no row, so
/// each runner deletes its limits' full buckets once a minute: prefixes that went quiet leave
/// no rows behind. Metric labels carry the limit's name only, never a prefix.
///
/// ```no_run
/// use pgbox::transport::PgQueue;
/// use pgbox::{Consumer, Inbox, Limit};
/// # fn f(pool: sqlx::PgPool) -> pgbox::Result<()> {
/// let consumer = Consumer::builder(pool.clone(), PgQueue::new(pool.clone()), "payments", Inbox::new("psp")?)
///     .concurrency(16)
///     // The payment provider takes 4 calls at once, from all our machines together...
///     .limit(Limit::concurrency("psp", 4))
///     // ...and 50 a second per merchant, the merchant id being the key up to ':'.
///     .limit(Limit::rate("psp-merchant", 50.0).burst(10).per_key_prefix(':'))
///     .key(|m| format!("{}:{}", m.headers.get("merchant").map_or("", String::as_str), m.id))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct Limit {
    name: String,
    kind: Kind,
    per: Per,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Concurrency(u32),
    Rate { per_second: f64, burst: u32 },
}

#[derive(Clone)]
enum Per {
    All,
    KeyPrefix(char),
    Envelope(PerFn),
}

impl fmt::Debug for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per = match &self.per {
            Per::All => "all".to_owned(),
            Per::KeyPrefix(c) => format!("key prefix up to {c:?}"),
            Per::Envelope(_) => "function".to_owned(),
        };
        f.debug_struct("Limit")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("per", &per)
            .finish()
    }
}

impl Limit {
    /// At most `n` transactions of limit `name` in flight at once across all instances.
    pub fn concurrency(name: impl Into<String>, n: u32) -> Self {
        Limit {
            name: name.into(),
            kind: Kind::Concurrency(n),
            per: Per::All,
        }
    }

    /// At most `per_second` messages a second of limit `name` across all instances, with a
    /// burst of 1 unless [`burst`](Self::burst) says more.
    pub fn rate(name: impl Into<String>, per_second: f64) -> Self {
        Limit {
            name: name.into(),
            kind: Kind::Rate {
                per_second,
                burst: 1,
            },
            per: Per::All,
        }
    }

    /// A rate limit's burst: how many messages may go at once after a quiet spell (default
    /// 1). No effect on a concurrency limit.
    ///
    /// The database counts a token when it is taken. With a burst of 1, or a rate under 40
    /// a second, each message takes its own token, and over any span of `t` seconds at most
    /// `burst + per_second × t` messages go. Otherwise a runner takes up to
    /// `k = min(floor(per_second × 0.05 s), burst)` tokens with one statement and hands them
    /// to its next messages of that limit (and prefix) for `k` emission intervals (at most
    /// 50 ms), dropping the ones not handed out by then (they stay counted): over any span of
    /// `t` seconds at most `burst + per_second × t + k` messages go, across all instances. A
    /// runner asks for fewer than `k` while its messages do not need them, so that tokens it
    /// would drop are not taken from other instances.
    ///
    /// Tokens are taken without waiting for the server to flush the take to disk
    /// (`synchronous_commit = off` for the take's own transaction alone, so it is safe behind
    /// a pooler in transaction mode). After a crash of the database server (or a failover),
    /// takes of the last fraction of a second before it (up to three times
    /// `wal_writer_delay`, 600 ms by default) may be forgotten, and the bucket may let
    /// through up to that many more. A message whose transaction committed had its token's
    /// take written before it, so only the takes of messages that were in flight (and of
    /// tokens taken ahead) can be lost.
    pub fn burst(mut self, burst: u32) -> Self {
        if let Kind::Rate { burst: b, .. } = &mut self.kind {
            *b = burst;
        }
        self
    }

    /// The limit holds per prefix returned by `prefix` (a tenant header, a customer id)
    /// instead of globally. A panicking function fails the delivery like a panicking handler.
    pub fn per(mut self, prefix: impl Fn(&Envelope) -> String + Send + Sync + 'static) -> Self {
        self.per = Per::Envelope(Arc::new(prefix));
        self
    }

    /// The limit holds per prefix of the message's inbox key (see
    /// [`ConsumerBuilder::key`](crate::ConsumerBuilder::key)): the key up to the first
    /// `separator`, or the whole key when it has none.
    pub fn per_key_prefix(mut self, separator: char) -> Self {
        self.per = Per::KeyPrefix(separator);
        self
    }

    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn validate(&self) -> Result<()> {
        let invalid = |why: String| Err(Error::InvalidConfig(why));
        if self.name.is_empty()
            || self.name.len() > MAX_LIMIT_NAME_BYTES
            || self.name.contains('\0')
        {
            return invalid(format!(
                "consumer limit name {:?} must be 1..={MAX_LIMIT_NAME_BYTES} bytes without NUL",
                self.name
            ));
        }
        match self.kind {
            Kind::Concurrency(n) if n == 0 || n > MAX_CONCURRENCY_SLOTS => invalid(format!(
                "consumer limit {:?}: concurrency must be between 1 and {MAX_CONCURRENCY_SLOTS}, got {n}",
                self.name
            )),
            Kind::Rate { per_second, .. }
                if !per_second.is_finite()
                    || per_second <= 0.0
                    || per_second > MAX_RATE_PER_SECOND =>
            {
                invalid(format!(
                    "consumer limit {:?}: rate must be above 0 and at most {MAX_RATE_PER_SECOND} a second, got {per_second}",
                    self.name
                ))
            }
            Kind::Rate { burst, .. } if burst == 0 || f64::from(burst) > MAX_RATE_PER_SECOND => {
                invalid(format!(
                    "consumer limit {:?}: burst must be between 1 and {MAX_RATE_PER_SECOND}, got {burst}",
                    self.name
                ))
            }
            // The bucket's span (burst × one interval) must fit the server's timestamps: a
            // glacial rate would be accepted here and refused by every take (22008).
            Kind::Rate { per_second, burst }
                if (1e6 / per_second).ceil() * f64::from(burst) > MAX_BUCKET_SPAN_MICROS =>
            {
                invalid(format!(
                    "consumer limit {:?}: a burst of {burst} at {per_second} a second spans more \
                     than 100 years; use a higher rate or a smaller burst",
                    self.name
                ))
            }
            _ => Ok(()),
        }
    }
}

/// A consumer's limits, checked and ready to run.
pub(super) struct Limits {
    all: Vec<Limit>,
    take_sql: String,
    sweep_sql: String,
    /// The inbox's: behind a pooler in transaction mode, statements are unnamed and run in
    /// transactions of their own.
    pooler: Pooler,
    /// Per limit, when this runner last swept its full buckets.
    last_sweep: Vec<Mutex<Option<Instant>>>,
    /// Per limit, the tokens this runner took ahead, by prefix.
    ahead: Vec<Mutex<HashMap<Vec<u8>, AheadCell>>>,
}

/// One (limit, prefix)'s tokens taken ahead, shared by the runner's tasks.
type AheadCell = Arc<tokio::sync::Mutex<Ahead>>;

/// Tokens of one (rate limit, prefix) that a runner took ahead: handed to its next messages
/// until `until`, then dropped. Only one task of the runner takes more at a time (the others
/// wait on its lock), so that they share the tokens instead of each taking its own.
#[derive(Debug, Default)]
struct Ahead {
    /// The last take: how many tokens it got, and how many are left.
    got: u32,
    left: u32,
    until: Option<Instant>,
}

impl Ahead {
    /// Hands out a token if one is left and has not lapsed.
    fn spend(&mut self, now: Instant) -> bool {
        if self.left > 0 && self.until.is_some_and(|until| now < until) {
            self.left -= 1;
            return true;
        }
        false
    }

    /// How many tokens to ask for (at most `k`): twice the last take when it ran out before
    /// it lapsed, as many as were handed out when it lapsed, one at first.
    fn ask(&self, now: Instant, k: u32) -> u32 {
        match self.until {
            None => 1,
            Some(until) if now < until => self.got.saturating_mul(2),
            Some(_) => self.got - self.left,
        }
        .clamp(1, k)
    }
}

/// What the database said to one message's take.
enum Take {
    Granted,
    /// Not granted, nothing taken: the longest wait in seconds until the denying buckets
    /// have one token, and until every bucket has the tokens asked for (`None`: not known),
    /// and the denying limits' ordinals among those asked (from 1).
    Denied {
        wait: Option<f64>,
        wait_all: Option<f64>,
        denied: Vec<i32>,
    },
}

/// How a message's wait for its limits ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waited {
    /// Within every limit: the message may go.
    Got,
    /// Not within its limits in time: the message is handed back to the transport, uncounted,
    /// to come back no sooner than this (the bucket's wait; zero for a concurrency limit,
    /// whose wait nobody knows).
    HandBack(Duration),
}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.all).finish()
    }
}

/// The prefixes of one message, one per limit (empty for a global limit).
pub(super) type Prefixes = Vec<Vec<u8>>;

/// What one unit (a transaction) holds: the slots it took, by limit and prefix.
pub(super) type Held = HashSet<(usize, Vec<u8>)>;

impl Limits {
    /// Checks `limits` (names, numbers, no name twice for one kind).
    pub(super) fn new(all: Vec<Limit>, schema: &str, pooler: Pooler) -> Result<Self> {
        let mut seen = HashSet::new();
        for limit in &all {
            limit.validate()?;
            let kind = matches!(limit.kind, Kind::Rate { .. });
            if !seen.insert((kind, limit.name.clone())) {
                return Err(Error::InvalidConfig(format!(
                    "consumer limit {:?} is configured twice",
                    limit.name
                )));
            }
        }
        let s = Identifier::new("schema", schema)?;
        // One take for every rate limit of a message, all or none: each limit's `n` tokens
        // ($3) at one per `step` µs ($4) within a burst of `span` µs ($5), per (name, prefix)
        // ($1, $2). The limits' existing rows are locked first, in key order (no deadlock
        // between two takes), and read at their latest version (the lock waits for a
        // concurrent take, then sees its result). A take is allowed when each bucket's
        // theoretical arrival time, advanced by its tokens, stays within its burst of now.
        // If every limit allows, the rows are moved on (or inserted); if one does not,
        // nothing is written, and the statement says which limits denied (their ordinals)
        // and how long until they allow one token, and until they allow all asked for. A
        // stale `statement_timestamp()` only makes the check stricter.
        //
        // A bucket row inserted by a concurrent take after this statement's snapshot (the
        // first take of a prefix, or one just after a sweep) makes the insert a no-op: the
        // take is then reported as not granted, though the other limits' tokens were
        // taken. That race can only make the limits stricter.
        //
        // `set_config(.., true)` holds for the statement's transaction (its own implicit one,
        // or behind a transaction pooler the short one it runs in), whose commit then does
        // not wait for the WAL flush; nothing is left on the connection for its next client.
        // Its WAL still comes before the unit's commit, which does wait.
        let take_sql = format!(
            "WITH want AS (\
               SELECT w.name, w.prefix, w.n, w.step, w.span, w.ord \
                 FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::bytea[]), \
                                 pg_catalog.unnest($3::int8[]), pg_catalog.unnest($4::int8[]), \
                                 pg_catalog.unnest($5::int8[])) \
                      WITH ORDINALITY AS w(name, prefix, n, step, span, ord)), \
             locked AS (\
               SELECT r.name, r.prefix, r.tat FROM {s}.rate_limits r \
                WHERE (r.name, r.prefix) IN (SELECT name, prefix FROM want) \
                ORDER BY r.name, r.prefix FOR UPDATE OF r), \
             d AS (\
               SELECT w.name, w.prefix, w.n, w.step, w.span, w.ord, l.tat AS old, \
                      GREATEST(l.tat, pg_catalog.statement_timestamp()) AS base, \
                      GREATEST(l.tat, pg_catalog.statement_timestamp()) \
                        + w.n * w.step * interval '1 microsecond' \
                        <= pg_catalog.statement_timestamp() + w.span * interval '1 microsecond' AS allowed \
                 FROM want w LEFT JOIN locked l ON l.name = w.name AND l.prefix = w.prefix), \
             go AS (SELECT pg_catalog.bool_and(allowed) AS yes FROM d), \
             moved AS (\
               UPDATE {s}.rate_limits r SET tat = d.base + d.n * d.step * interval '1 microsecond' \
                 FROM d, go \
                WHERE go.yes AND d.old IS NOT NULL AND r.name = d.name AND r.prefix = d.prefix \
                RETURNING 1), \
             added AS (\
               INSERT INTO {s}.rate_limits (name, prefix, tat) \
               SELECT d.name, d.prefix, d.base + d.n * d.step * interval '1 microsecond' \
                 FROM d, go WHERE go.yes AND d.old IS NULL ORDER BY d.name, d.prefix \
               ON CONFLICT (name, prefix) DO NOTHING \
               RETURNING 1) \
             SELECT (SELECT yes FROM go) \
                    AND (SELECT pg_catalog.count(*) FROM moved) + (SELECT pg_catalog.count(*) FROM added) \
                        = (SELECT pg_catalog.count(*) FROM want), \
                    (SELECT pg_catalog.max(EXTRACT(EPOCH FROM (base - pg_catalog.statement_timestamp()))::float8 \
                                           + (step - span)::float8 / 1e6) FROM d WHERE NOT allowed), \
                    (SELECT pg_catalog.max(EXTRACT(EPOCH FROM (base - pg_catalog.statement_timestamp()))::float8 \
                                           + (n * step - span)::float8 / 1e6) FROM d), \
                    (SELECT pg_catalog.array_agg(ord::int4) FROM d WHERE NOT allowed), \
                    pg_catalog.set_config('synchronous_commit', 'off', true)"
        );
        // A bucket whose arrival time has passed is full: the same as no row. The re-check
        // under the row's lock (a take that just moved it on) keeps it.
        let sweep_sql = format!(
            "DELETE FROM {s}.rate_limits WHERE ctid = ANY(ARRAY(\
               SELECT ctid FROM {s}.rate_limits \
                WHERE name = $1 AND tat < pg_catalog.statement_timestamp() LIMIT 1000)) \
               AND tat < pg_catalog.statement_timestamp()"
        );
        Ok(Limits {
            take_sql,
            sweep_sql,
            pooler,
            last_sweep: (0..all.len()).map(|_| Mutex::new(None)).collect(),
            ahead: (0..all.len()).map(|_| Mutex::default()).collect(),
            all,
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    pub(super) fn has_rates(&self) -> bool {
        self.all.iter().any(|l| matches!(l.kind, Kind::Rate { .. }))
    }

    pub(super) fn has_slots(&self) -> bool {
        self.all
            .iter()
            .any(|l| matches!(l.kind, Kind::Concurrency(_)))
    }

    /// The limits' names, in order (the metric handles follow it).
    pub(super) fn names(&self) -> impl Iterator<Item = &str> {
        self.all.iter().map(|l| l.name.as_str())
    }

    /// The prefix of each limit for a message whose inbox key is `key`. Err: a prefix
    /// function panicked (its message).
    pub(super) fn prefixes(
        &self,
        envelope: &Envelope,
        key: &str,
    ) -> std::result::Result<Prefixes, String> {
        self.all
            .iter()
            .map(|limit| {
                let prefix = match &limit.per {
                    Per::All => return Ok(Vec::new()),
                    Per::KeyPrefix(sep) => key.split(*sep).next().unwrap_or("").to_owned(),
                    Per::Envelope(f) => std::panic::catch_unwind(AssertUnwindSafe(|| f(envelope)))
                        .map_err(|panic| super::panic_message(panic.as_ref()))?,
                };
                Ok(stored_prefix(prefix.into_bytes()))
            })
            .collect()
    }

    /// Takes a token of every rate limit for one message, all or none, waiting while a
    /// bucket is empty. [`Waited::HandBack`]: the message is to be handed back (the bucket's
    /// wait is past `deadline`, or a per-prefix bucket's is longer than
    /// [`HAND_BACK_PAST`]); it took no token.
    pub(super) async fn take_tokens(
        &self,
        pool: &PgPool,
        prefixes: &Prefixes,
        deadline: Instant,
        waits: &[Counter],
    ) -> Result<Waited> {
        // Per rate limit: (its index, one token's interval in µs, the burst's span, `k`).
        let rates: Vec<(usize, i64, i64, u32)> = self
            .all
            .iter()
            .enumerate()
            .filter_map(|(i, limit)| match limit.kind {
                Kind::Rate { per_second, burst } => {
                    // Rounded up to the microsecond: never faster than asked.
                    let interval = (1e6 / per_second).ceil() as i64;
                    Some((
                        i,
                        interval,
                        interval.saturating_mul(i64::from(burst)),
                        take_ahead(interval, burst),
                    ))
                }
                Kind::Concurrency(_) => None,
            })
            .collect();
        for &(i, ..) in &rates {
            self.sweep(pool, i).await;
        }
        let cells: Vec<Option<AheadCell>> = rates
            .iter()
            .map(|&(i, _, _, k)| (k > 1).then(|| self.ahead_of(i, &prefixes[i])))
            .collect();
        let mut counted = vec![false; self.all.len()];
        let mut pause = Duration::from_millis(1);
        loop {
            // The cells of the limits that take ahead, locked in the limits' order (every
            // task locks them in that order): one task of the runner takes for them at a
            // time, and the others then share what it took.
            let mut guards = Vec::with_capacity(rates.len());
            for cell in &cells {
                guards.push(match cell {
                    None => None,
                    Some(cell) => {
                        match tokio::time::timeout_at(deadline.into(), cell.clone().lock_owned())
                            .await
                        {
                            Ok(guard) => Some(guard),
                            Err(_) => return Ok(Waited::HandBack(Duration::ZERO)),
                        }
                    }
                });
            }
            let sent = Instant::now();
            // Tokens taken ahead are spent first; the limits without one take theirs from
            // the database, all in one statement.
            let mut spent = Vec::new();
            let mut asks = Vec::new();
            for (r, guard) in guards.iter_mut().enumerate() {
                let (i, interval, span, k) = rates[r];
                match guard {
                    Some(ahead) => {
                        if ahead.spend(sent) {
                            spent.push(r);
                        } else {
                            asks.push((r, i, interval, span, ahead.ask(sent, k)));
                        }
                    }
                    None => asks.push((r, i, interval, span, 1)),
                }
            }
            if asks.is_empty() {
                return Ok(Waited::Got);
            }
            let (wait, wait_all, denied) = match self.take(pool, prefixes, &asks).await? {
                Take::Granted => {
                    for &(r, _, interval, _, n) in &asks {
                        if let Some(ahead) = &mut guards[r] {
                            // The first token is this message's.
                            **ahead = Ahead {
                                got: n,
                                left: n - 1,
                                until: Some(
                                    sent + Duration::from_micros(
                                        (interval * i64::from(rates[r].3)) as u64,
                                    ),
                                ),
                            };
                        }
                    }
                    return Ok(Waited::Got);
                }
                Take::Denied {
                    wait,
                    wait_all,
                    denied,
                } => (wait, wait_all, denied),
            };
            // All or none: the tokens spent from those taken ahead go back.
            for r in spent {
                if let Some(ahead) = &mut guards[r] {
                    ahead.left += 1;
                }
            }
            drop(guards);
            let denied: Vec<usize> = denied
                .iter()
                .filter_map(|&ord| asks.get(usize::try_from(ord).ok()?.checked_sub(1)?))
                .map(|&(_, i, ..)| i)
                .collect();
            for &i in &denied {
                if !counted[i] {
                    waits[i].increment(1);
                    counted[i] = true;
                }
            }
            // Sleep until the buckets say, plus a little so that the runners woken together
            // do not all try at once. No wait known (a concurrent first take or sweep): try
            // again soon. A wait past the deadline is not begun, nor a long one for a prefix:
            // the message is handed back until then, and the runner's slot serves others.
            let secs = |w: Option<f64>| {
                w.filter(|w| w.is_finite() && *w > 0.0)
                    .map_or(pause, |w| Duration::from_secs_f64(w.min(MAX_WAIT_SECS)))
            };
            let now = Instant::now();
            let wait = secs(wait);
            let per_prefix = denied.iter().any(|&i| !matches!(self.all[i].per, Per::All));
            if now + wait > deadline || (per_prefix && wait > HAND_BACK_PAST) {
                return Ok(Waited::HandBack(wait));
            }
            let until = secs(wait_all).min(deadline.saturating_duration_since(now));
            tokio::time::sleep(until + jitter(pause)).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    /// One take for one message: `asks` are (_, limit, interval, span, tokens) of the rate
    /// limits it takes from the database, all or none.
    async fn take(
        &self,
        pool: &PgPool,
        prefixes: &Prefixes,
        asks: &[(usize, usize, i64, i64, u32)],
    ) -> Result<Take> {
        let names: Vec<&str> = asks.iter().map(|a| self.all[a.1].name.as_str()).collect();
        let keys: Vec<&[u8]> = asks.iter().map(|a| prefixes[a.1].as_slice()).collect();
        let tokens: Vec<i64> = asks.iter().map(|a| i64::from(a.4)).collect();
        let steps: Vec<i64> = asks.iter().map(|a| a.2).collect();
        let spans: Vec<i64> = asks.iter().map(|a| a.3).collect();
        // Behind a transaction pooler, a transaction of its own (its setting ends with it).
        let mut unit = self.pooler.unit(pool).await?;
        type Row = (
            bool,
            Option<f64>,
            Option<f64>,
            Option<Vec<i32>>,
            Option<String>,
        );
        let (took, wait, wait_all, denied, _): Row =
            sqlx::query_as(sqlx::AssertSqlSafe(self.take_sql.as_str()))
                .bind(names)
                .bind(keys)
                .bind(tokens)
                .bind(steps)
                .bind(spans)
                .persistent(self.pooler.persistent())
                .fetch_one(&mut *unit)
                .await?;
        unit.finish().await?;
        Ok(if took {
            Take::Granted
        } else {
            Take::Denied {
                wait,
                wait_all,
                denied: denied.unwrap_or_default(),
            }
        })
    }

    /// The tokens this runner took ahead for rate limit `i` and `prefix`.
    fn ahead_of(&self, i: usize, prefix: &[u8]) -> AheadCell {
        let mut all = self.ahead[i].lock().expect("tokens taken ahead");
        if let Some(ahead) = all.get(prefix) {
            return ahead.clone();
        }
        if all.len() >= MAX_AHEAD_ENTRIES {
            // Kept: entries in use, or with tokens that have not lapsed.
            let now = Instant::now();
            all.retain(|_, ahead| {
                Arc::strong_count(ahead) > 1
                    || match ahead.try_lock() {
                        Ok(a) => a.until.is_some_and(|until| until > now),
                        Err(_) => true,
                    }
            });
        }
        all.entry(prefix.to_vec()).or_default().clone()
    }

    /// Takes a slot of every concurrency limit on the unit's transaction `conn`, waiting
    /// while none is free; a slot `held` already by the unit is not taken twice.
    /// [`Waited::HandBack`]: `deadline` came first, or a per-prefix limit had no free slot for
    /// [`HAND_BACK_PAST`] (the message then comes back no sooner than that, and its runner
    /// slot serves other prefixes meanwhile); the slots taken are released with the
    /// transaction.
    pub(super) async fn take_slots(
        &self,
        conn: &mut PgConnection,
        prefixes: &Prefixes,
        held: &mut Held,
        deadline: Instant,
        waits: &[Counter],
    ) -> Result<Waited> {
        for (i, limit) in self.all.iter().enumerate() {
            let Kind::Concurrency(n) = limit.kind else {
                continue;
            };
            if held.contains(&(i, prefixes[i].clone())) {
                continue;
            }
            // Slot keys are consecutive from a hash of (limit, prefix): distinct within the
            // limit; another limit's range that overlaps only makes both stricter. Tried from
            // a random slot, so that runners do not all queue on the first.
            let base = slot_base(&limit.name, &prefixes[i]);
            let start = fastrand::u32(0..n);
            let keys: Vec<i32> = (0..n)
                .map(|j| base.wrapping_add(((start + j) % n) as i32))
                .collect();
            let (until, hand_back) = match limit.per {
                Per::All => (deadline, Duration::ZERO),
                _ => (
                    deadline.min(Instant::now() + HAND_BACK_PAST),
                    HAND_BACK_PAST,
                ),
            };
            let mut counted = false;
            let mut pause = Duration::from_millis(2);
            loop {
                // The executor stops at the first row the filter lets through: one lock.
                let got: Option<i32> = sqlx::query_scalar(
                    "SELECT k FROM pg_catalog.unnest($2::int4[]) AS k \
                     WHERE pg_catalog.pg_try_advisory_xact_lock($1, k) LIMIT 1",
                )
                .bind(SLOT_LOCK_CLASS)
                .bind(&keys)
                .persistent(self.pooler.persistent())
                .fetch_optional(&mut *conn)
                .await?;
                if got.is_some() {
                    held.insert((i, prefixes[i].clone()));
                    break;
                }
                if !counted {
                    waits[i].increment(1);
                    counted = true;
                }
                if Instant::now() + pause > until {
                    return Ok(Waited::HandBack(hand_back));
                }
                tokio::time::sleep(jitter(pause)).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
        Ok(Waited::Got)
    }

    /// Deletes `limit`'s full buckets, at most once a minute per runner: prefixes that went
    /// quiet leave no rows. A failure is only logged (the next sweep tries again).
    async fn sweep(&self, pool: &PgPool, i: usize) {
        let limit = &self.all[i];
        {
            let mut last = self.last_sweep[i].lock().expect("sweep time");
            if last.is_some_and(|at| at.elapsed() < SWEEP_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let swept = async {
            let mut unit = self.pooler.unit(pool).await?;
            sqlx::query(sqlx::AssertSqlSafe(self.sweep_sql.as_str()))
                .bind(&limit.name)
                .persistent(self.pooler.persistent())
                .execute(&mut *unit)
                .await?;
            unit.finish().await
        };
        if let Err(e) = swept.await {
            tracing::debug!(error = %e, limit = %limit.name, "pgbox rate limit sweep failed");
        }
    }
}

/// How many tokens a runner takes ahead at most (`k`), for a rate limit of one token per
/// `interval` µs: `TAKE_AHEAD_MICROS` worth of the rate, at least 1, at most the burst.
fn take_ahead(interval: i64, burst: u32) -> u32 {
    let k = (TAKE_AHEAD_MICROS / interval.max(1)).clamp(1, i64::from(burst));
    u32::try_from(k).unwrap_or(1)
}

/// A prefix as stored: long ones cut, with a hash of the whole appended.
fn stored_prefix(mut prefix: Vec<u8>) -> Vec<u8> {
    if prefix.len() > MAX_STORED_PREFIX_BYTES {
        let hash = fnv1a(&prefix);
        prefix.truncate(MAX_STORED_PREFIX_BYTES);
        prefix.extend_from_slice(&hash.to_be_bytes());
    }
    prefix
}

/// The first slot key of (limit, prefix): the same in every instance (and release).
fn slot_base(name: &str, prefix: &[u8]) -> i32 {
    let mut bytes = Vec::with_capacity(name.len() + 1 + prefix.len());
    bytes.extend_from_slice(name.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(prefix);
    let h = fnv1a(&bytes);
    (h ^ (h >> 32)) as u32 as i32
}

/// FNV-1a, 64 bits: stable across builds and platforms (the std hasher is not).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Half to all of `pause`, at random: runners waiting together do not retry in step.
fn jitter(pause: Duration) -> Duration {
    pause.mul_f64(0.5 + fastrand::f64() / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_taken_ahead_are_bounded_and_follow_demand() {
        // 50 ms of the rate, within 1..=burst.
        assert_eq!(take_ahead(1, 1_000_000), 50_000);
        assert_eq!(take_ahead(10_000, 20), 5);
        assert_eq!(take_ahead(10_000, 2), 2);
        assert_eq!(take_ahead(100_000, 10), 1);
        assert_eq!(take_ahead(1, 1), 1);
        let now = Instant::now();
        let mut ahead = Ahead::default();
        assert!(!ahead.spend(now));
        assert_eq!(ahead.ask(now, 8), 1);
        ahead = Ahead {
            got: 4,
            left: 1,
            until: Some(now + Duration::from_millis(50)),
        };
        assert!(ahead.spend(now));
        assert!(!ahead.spend(now), "ran out");
        assert_eq!(ahead.ask(now, 8), 8, "ran out early: twice as many");
        assert_eq!(ahead.ask(now, 6), 6, "never over k");
        ahead.left = 3;
        let later = now + Duration::from_millis(50);
        assert!(!ahead.spend(later), "lapsed tokens are dropped");
        assert_eq!(ahead.ask(later, 8), 1, "as many as were handed out");
    }

    #[test]
    fn slot_keys_are_stable_and_names_checked() {
        assert_eq!(slot_base("a", b"x"), slot_base("a", b"x"));
        assert_ne!(slot_base("a", b"x"), slot_base("a", b"y"));
        assert_ne!(slot_base("ab", b""), slot_base("a", b"b"));
        assert_eq!(
            stored_prefix(vec![7; 300]).len(),
            MAX_STORED_PREFIX_BYTES + 8
        );
        assert_ne!(stored_prefix(vec![7; 300]), stored_prefix(vec![7; 301]));
        for bad in [
            Limit::concurrency("", 1),
            Limit::concurrency("a\0b", 1),
            Limit::concurrency("x".repeat(65), 1),
            Limit::concurrency("a", 0),
            Limit::concurrency("a", MAX_CONCURRENCY_SLOTS + 1),
            Limit::rate("a", 0.0),
            Limit::rate("a", f64::NAN),
            Limit::rate("a", -1.0),
            Limit::rate("a", 1.0).burst(0),
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::InvalidConfig(_))),
                "{bad:?}"
            );
        }
        assert!(
            Limits::new(
                vec![Limit::rate("a", 1.0), Limit::rate("a", 2.0)],
                "pgbox",
                Pooler::None
            )
            .is_err()
        );
        assert!(
            Limits::new(
                vec![Limit::rate("a", 1.0), Limit::concurrency("a", 2)],
                "pgbox",
                Pooler::None
            )
            .is_ok()
        );
    }
}
