//! The tenant relay: one process publishing the outboxes of many tenant schemas, in many
//! databases, fairly, through one [`Publisher`].
//!
//! Each tenant is served by an inner [`Relay`] (its rounds, its per-key order, its retries
//! and dead letters are exactly a single relay's); what this module adds is which tenants
//! there are (discovery), when each one gets a round (a shared wake-up and a fair
//! scheduler), and how a broken tenant is kept away from the others.

mod discover;
mod listener;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use self::discover::{Found, Selector, Sources};
use self::listener::{Command, Event, Sleep};
use crate::error::{Error, Result};
use crate::ident::Identifier;
use crate::relay::{Relay, RoundReport, WakeUp};
use crate::retry::RetryPolicy;
use crate::telemetry;
use crate::transport::Publisher;

/// The header a [`TenantRelay`] adds to every message it publishes: which tenant the
/// message came from, as `<database>/<schema>` (for example `tenant_db_7/acme`).
///
/// Set on the [`Envelope`](crate::Envelope)'s headers before the publisher sees the batch,
/// so every transport carries it as it carries the other headers (RabbitMQ and NATS
/// headers, Kafka record headers, the built-in queue's `headers` column, also when a round
/// moves its batch into the queue in the same database). It replaces a header of the same
/// name set by the producer, in any case of its letters.
pub const TENANT_HEADER: &str = "pgbox-tenant";

/// The `tenant` label of tenants past the [label cap](TenantRelayBuilder::tenant_label_cap).
const OTHER_LABEL: &str = "other";

/// How soon an awake tenant whose producers were in flight gets its next round (doubling
/// while they stay in flight, up to the idle poll interval).
const AWAKE_POLL: Duration = Duration::from_millis(10);

/// How soon a failed probe of a database is tried again (doubling), and how many times
/// before it waits for the next idle poll.
const PROBE_RETRY: Duration = Duration::from_millis(100);
const PROBE_RETRIES: u32 = 3;

/// The longest a broken tenant waits before its next try.
const MAX_BROKEN_BACKOFF: Duration = Duration::from_secs(60);

/// Builder for a [`TenantRelay`]: [`TenantRelay::builder`].
#[derive(Debug)]
pub struct TenantRelayBuilder<P> {
    publisher: P,
    given: Vec<PgPool>,
    servers: Vec<(PgPool, String)>,
    schema_pattern: Option<String>,
    schema_names: Vec<String>,
    discover_interval: Duration,
    idle_poll_interval: Duration,
    rounds_in_flight: usize,
    tenant_label_cap: usize,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    publish_timeout: Duration,
    database_pool_size: u32,
}

impl<P: Publisher + 'static> TenantRelayBuilder<P> {
    /// Serves the tenants of the database `pool` is on. Its pool runs the rounds, the
    /// discovery and the idle polls of that database; its size must be at least
    /// [`rounds_in_flight`](Self::rounds_in_flight). Call once per database.
    pub fn database(mut self, pool: PgPool) -> Self {
        self.given.push(pool);
        self
    }

    /// Serves every database of `server`'s server whose name is `LIKE pattern`, that
    /// accepts connections and is not a template, listed again every
    /// [`discover_interval`](Self::discover_interval). Each one gets a lazily connected pool
    /// of [`database_pool_size`](Self::database_pool_size) connections made from `server`'s
    /// connect options with the database changed (same user, TLS and application name).
    pub fn discover_databases(mut self, server: PgPool, pattern: impl Into<String>) -> Self {
        self.servers.push((server, pattern.into()));
        self
    }

    /// Serves the pgbox schemas whose names are `LIKE pattern` (default `%`: every schema
    /// holding pgbox's outbox tables). Replaces an earlier pattern; combines with
    /// [`schemas`](Self::schemas).
    pub fn schema_pattern(mut self, pattern: impl Into<String>) -> Self {
        self.schema_pattern = Some(pattern.into());
        self
    }

    /// Serves these pgbox schemas (where they exist), besides those of
    /// [`schema_pattern`](Self::schema_pattern). With names and no pattern, only the names
    /// are served. Each is validated at [`build`](Self::build).
    pub fn schemas<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.schema_names.extend(names.into_iter().map(Into::into));
        self
    }

    /// How often databases and schemas are listed again (default 2 s): a new tenant is served,
    /// and a dropped one let go, within about this long. One statement per database (and
    /// one per server with [`discover_databases`](Self::discover_databases)).
    pub fn discover_interval(mut self, interval: Duration) -> Self {
        self.discover_interval = interval;
        self
    }

    /// How often sleeping tenants are checked for due work that sent no notification (a
    /// retry whose backoff expired, a scheduled message falling due, a producer that saw
    /// the tenant awake) (default 1 s). One statement per database per
    /// 200 tenants.
    pub fn idle_poll_interval(mut self, interval: Duration) -> Self {
        self.idle_poll_interval = interval;
        self
    }

    /// Rounds running at once, over all tenants (default 4; at most one per tenant). Not
    /// above any given pool's size nor [`database_pool_size`](Self::database_pool_size).
    pub fn rounds_in_flight(mut self, n: usize) -> Self {
        self.rounds_in_flight = n;
        self
    }

    /// Tenants that get a `tenant` label of their own on the metrics (default 100): the
    /// first ones served; the others are counted under `tenant="other"`, so a thousand
    /// tenants do not make a thousand series.
    pub fn tenant_label_cap(mut self, cap: usize) -> Self {
        self.tenant_label_cap = cap;
        self
    }

    /// Messages claimed per round (default 500; see
    /// [`RelayBuilder::batch_size`](crate::RelayBuilder::batch_size)). A smaller batch makes
    /// rounds shorter, so a quiet tenant waits less behind a busy one.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Publish attempts before a message is dead-lettered (default 10).
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Delay between attempts of one message (default as [`Relay`]'s).
    pub fn backoff(mut self, policy: RetryPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// How long one call of the publisher may take (default 2 min; see
    /// [`RelayBuilder::publish_timeout`](crate::RelayBuilder::publish_timeout)).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// The size of the pool made for each discovered database (default 4).
    pub fn database_pool_size(mut self, n: u32) -> Self {
        self.database_pool_size = n;
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<TenantRelay<P>> {
        let invalid = |m: &str| Err(Error::InvalidConfig(format!("tenant relay: {m}")));
        if self.given.is_empty() && self.servers.is_empty() {
            return invalid("no database: give one with database() or discover_databases()");
        }
        if self.discover_interval.is_zero() || self.idle_poll_interval.is_zero() {
            return invalid("discover and idle poll intervals must be positive");
        }
        if self.rounds_in_flight == 0 {
            return invalid("rounds_in_flight must be at least 1");
        }
        if self.database_pool_size == 0 {
            return invalid("database_pool_size must be at least 1");
        }
        if !self.servers.is_empty() && self.rounds_in_flight > self.database_pool_size as usize {
            return invalid("rounds_in_flight is above database_pool_size");
        }
        if self
            .given
            .iter()
            .any(|p| (p.options().get_max_connections() as usize) < self.rounds_in_flight)
        {
            return invalid("rounds_in_flight is above the size of a given pool");
        }
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return invalid("batch size must be 1..=10000");
        }
        if self.max_attempts < 1 {
            return invalid("max_attempts must be at least 1");
        }
        if self.publish_timeout.is_zero() {
            return invalid("publish timeout must be positive");
        }
        crate::transport::check_call_timeout(&self.publisher, self.publish_timeout)?;
        for (_, pattern) in &self.servers {
            if pattern.is_empty() {
                return invalid("empty database pattern");
            }
        }
        let mut names = Vec::with_capacity(self.schema_names.len());
        for name in &self.schema_names {
            names.push(Identifier::pgbox_schema(name)?.as_str().to_owned());
        }
        let pattern = match (self.schema_pattern, names.is_empty()) {
            (Some(p), _) if p.is_empty() => return invalid("empty schema pattern"),
            (Some(p), _) => Some(p),
            (None, true) => Some("%".to_owned()),
            (None, false) => None,
        };
        Ok(TenantRelay {
            publisher: Arc::new(self.publisher),
            sources: Sources {
                given: self.given,
                servers: self.servers,
                pool_size: self.database_pool_size,
            },
            selector: Selector { pattern, names },
            discover_interval: self.discover_interval,
            idle_poll_interval: self.idle_poll_interval,
            rounds_in_flight: self.rounds_in_flight,
            tenant_label_cap: self.tenant_label_cap,
            batch_size: self.batch_size,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            publish_timeout: self.publish_timeout,
            status: Mutex::default(),
            labels: Mutex::default(),
            counted: Mutex::default(),
        })
    }
}

/// How a tenant is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TenantHealth {
    /// Its last round (or none yet) went through.
    Healthy,
    /// Its rounds fail (missing table, revoked grant, database away): retried with a
    /// backoff (up to a minute), the other tenants unaffected.
    Broken {
        /// The last round's error.
        reason: String,
    },
}

/// One tenant, as [`TenantRelay::status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TenantStatus {
    /// The tenant's database.
    pub database: String,
    /// The tenant's pgbox schema.
    pub schema: String,
    /// Healthy or broken.
    pub health: TenantHealth,
    /// Whether it sleeps: its asleep lock is held, by this relay or by another relay serving
    /// the same tenant, so its producers notify (and every relay listening hears them).
    pub asleep: bool,
    /// Rounds run for it by this relay (failed ones included).
    pub rounds: u64,
    /// Messages published for it by this relay.
    pub published: u64,
    /// The last error of its rounds, kept after it recovers.
    pub last_error: Option<String>,
}

/// What [`TenantRelay::drain`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TenantDrainReport {
    /// Tenants drained.
    pub tenants: usize,
    /// Messages published, over all tenants.
    pub published: usize,
    /// Tenants whose drain failed (see [`TenantRelay::status`]).
    pub broken: usize,
}

/// Publishes the outboxes of many tenants (pgbox schemas, in one or several databases)
/// through one [`Publisher`], from one task.
///
/// Tenants are the pgbox schemas matching a selector ([`schemas`](TenantRelayBuilder::schemas),
/// [`schema_pattern`](TenantRelayBuilder::schema_pattern)) in each database given
/// ([`database`](TenantRelayBuilder::database)) or found on a server
/// ([`discover_databases`](TenantRelayBuilder::discover_databases)), listed again every
/// [`discover_interval`](TenantRelayBuilder::discover_interval): a tenant created (and
/// migrated) while it runs is served without a restart, a dropped one is let go.
///
/// - **Rounds are a [`Relay`]'s**: each tenant has an inner relay over its database's pool,
///   so per-key order, retries, dead letters and moving batches into the built-in queue of
///   the same database in the round's transaction are exactly as with one relay per schema.
///   Several tenant relays (or plain relays) may serve the same tenants at once.
/// - **Fair**: at most [`rounds_in_flight`](TenantRelayBuilder::rounds_in_flight) rounds at
///   once, at most one per tenant; tenants with work wait in one queue and get one round
///   each, then go to its back. A tenant with a backlog of a million messages gets a round
///   in turn with the others: a quiet tenant's message waits about one round of each busy
///   tenant, not for the backlog. While no tenant waits for a slot, a tenant with more work
///   runs its next round at once, as a [`Relay`] of its own would; as soon as another is
///   due, the next slot that frees is its.
/// - **Which tenant**: every message published carries the [`TENANT_HEADER`] header,
///   `<database>/<schema>`.
/// - **Isolated**: a tenant whose rounds fail (its tables dropped, a grant revoked, its
///   database away) is logged once when it breaks and once when it recovers, retried with a
///   backoff (1 s doubling, up to a minute), and shown in [`status`](Self::status); the
///   others keep flowing.
///
/// # What an idle tenant costs
///
/// Per database, the relay holds **one listener connection** that `LISTEN`s on every
/// tenant's channel, plus the rounds' pool (connections are taken by rounds and polls, and
/// a discovered database's pool closes idle ones after a minute). No connection per tenant.
///
/// A tenant with nothing to do sleeps: it holds its asleep lock (see [`Relay`]) on the
/// listener connection, taken with `pg_try_advisory_lock` (never a wait: a tenant whose
/// producers are in flight stays awake and gets another round 10 ms later, then 20, 40, ...
/// up to the idle poll interval, while they stay in flight; back to 10 ms once a round
/// publishes, as a producer that committed was not a long transaction). So an idle tenant costs
/// - **one advisory lock** held by the listener's session. PostgreSQL's shared lock table
///   holds `max_locks_per_transaction × (max_connections + max_prepared_transactions)`
///   locks (64 × 100 by default, about 6,400): a thousand sleeping tenants on one server
///   take a thousand of them; raise `max_locks_per_transaction` for many thousands;
/// - **no statement per tenant**: one "which of these have due work" statement (a
///   `UNION ALL` of index probes, 200 tenants per statement) per database per
///   [`idle_poll_interval`](TenantRelayBuilder::idle_poll_interval), which catches retries
///   whose backoff expired and scheduled messages falling due; and one discovery statement
///   per database per [`discover_interval`](TenantRelayBuilder::discover_interval). With
///   the defaults: about 1.5 statements per second per database of up to 200 tenants.
///
/// Several tenant relays on the same tenants cost, while idle, what one costs: a tenant
/// whose asleep lock another relay holds sleeps in this one too (its producers notify every
/// listener), with no round of its own until a notification or its idle probe finds work.
/// If that other relay stops, its producers stop notifying until this relay takes the lock
/// after its next round: meanwhile their messages wait up to one idle poll interval.
///
/// A lost listener connection (every lock it held released) costs one probe of its
/// database, not a round per tenant; the tenants fall asleep again once it is back. A probe
/// the database refuses (a tenant's table gone) is split until the tenant it fails on is
/// found, and only that one gets a round; a probe that cannot reach the database is tried
/// again three times (100, 200, 400 ms), then at the next idle poll.
///
/// A producer committing while its tenant sleeps notifies; the tenant joins the queue.
/// A tenant falls asleep when it is found and after each stretch of work; its final look
/// for work committed before it did (whose producers did not notify) is that same probe
/// statement, one per database for every tenant that fell asleep meanwhile, not a round of
/// its own: a relay starting over a thousand idle tenants queues no round for them.
///
/// # Letting tenants go
///
/// A schema dropped (or no longer matching) is let go at the next discovery: its round in
/// flight, if any, ends first, then its asleep lock is released and its channel unlistened.
/// A database is let go when its server no longer lists it; while the relay serves it, it
/// holds connections to it, so `DROP DATABASE` needs `WITH (FORCE)` (or the relay stopped,
/// or the database renamed out of the pattern first and a discovery interval waited).
///
/// # Example
///
/// ```no_run
/// use pgbox::transport::PgQueue;
/// use pgbox::{CancellationToken, TenantRelay};
/// # async fn f(server: sqlx::PgPool, hub: sqlx::PgPool) -> pgbox::Result<()> {
/// // Every pgbox schema named `tenant_%` in every database named `tenant_db_%`, into the
/// // built-in queue of the hub database.
/// let relay = TenantRelay::builder(PgQueue::new(hub))
///     .discover_databases(server, "tenant_db_%")
///     .schema_pattern("tenant_%")
///     .build()?;
/// relay.run(CancellationToken::new()).await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TenantRelay<P> {
    publisher: Arc<P>,
    sources: Sources,
    selector: Selector,
    discover_interval: Duration,
    idle_poll_interval: Duration,
    rounds_in_flight: usize,
    tenant_label_cap: usize,
    batch_size: usize,
    max_attempts: i32,
    backoff: RetryPolicy,
    publish_timeout: Duration,
    status: Mutex<BTreeMap<(String, String), TenantStatus>>,
    /// Tenants given a label of their own, in the order first served.
    labels: Mutex<HashSet<(String, String)>>,
    /// Healthy and broken tenants this relay last added to the process-wide gauge: it moves
    /// the gauge by its own change, so several relays in a process add up.
    counted: Mutex<(usize, usize)>,
}

impl<P> Drop for TenantRelay<P> {
    /// Takes this relay's tenants out of the process-wide tenants gauge.
    fn drop(&mut self) {
        let (healthy, broken) = *self
            .counted
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        metrics::gauge!(telemetry::TENANT_RELAY_TENANTS, "state" => "healthy")
            .decrement(healthy as f64);
        metrics::gauge!(telemetry::TENANT_RELAY_TENANTS, "state" => "broken")
            .decrement(broken as f64);
    }
}

/// A tenant: (database, schema).
type Key = (String, String);

/// Where a tenant is in the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waits for a notification, a poll, or its backoff.
    Idle,
    /// In the ready queue.
    Queued,
    /// A round is running.
    Running,
}

struct Tenant<P> {
    relay: Arc<Relay<P>>,
    schema: Identifier,
    label: String,
    phase: Phase,
    /// Its asleep lock is held on the listener connection.
    asleep: bool,
    /// Asked the listener to take its asleep lock, no answer yet.
    sleep_pending: bool,
    /// Notified while its round ran (it held the lock): run again.
    again: bool,
    /// No longer listed: let go once its round ends.
    removed: bool,
    /// Cancelled to end its turn (several rounds in a row) after the round in flight.
    turn: CancellationToken,
    /// Attempts to fall asleep in a row that found producers in flight.
    awake_polls: u32,
    /// Failed rounds in a row, and when to try again.
    failures: u32,
    retry_at: Instant,
}

struct Db {
    pool: PgPool,
    owned: bool,
    listener: mpsc::UnboundedSender<Command>,
    probing: bool,
    /// A probe of its tenants is owed: the idle poll, or tenants that took their asleep lock
    /// since the last probe started (their final look, under the lock).
    look: bool,
    /// Failed probes in a row.
    probe_failures: u32,
    /// Why its schemas could not be read, while they cannot.
    away: Option<String>,
}

/// What a tenant's turn did: one round, or several in a row while no other tenant waited for
/// a slot.
struct Turn {
    /// Rounds run.
    rounds: u64,
    /// Messages published by them.
    published: usize,
    /// The last round's outcome.
    last: Result<RoundReport>,
}

impl Turn {
    fn failed(error: Error) -> Self {
        Turn {
            rounds: 1,
            published: 0,
            last: Err(error),
        }
    }
}

/// Runs a tenant's turn: a round, then more at once while each finds more work (it published,
/// or claimed a full batch), no other tenant waits for a slot (`waiting`) and the turn is not
/// ended (`end`: shutdown, the tenant let go). A plain [`Relay`] drains a backlog the same
/// way; going back through the scheduler between rounds cost a quarter of its throughput.
async fn turn<P: Publisher>(
    relay: &Relay<P>,
    batch_size: usize,
    single: bool,
    waiting: &AtomicUsize,
    end: &CancellationToken,
) -> Turn {
    let mut turn = Turn {
        rounds: 0,
        published: 0,
        last: Ok(RoundReport::default()),
    };
    // Bounded by the work in the outbox: each round that goes on published or claimed a
    // full batch; and by the other tenants, which end it by waiting.
    loop {
        let result = relay.relay_once().await;
        turn.rounds += 1;
        let more = match &result {
            Ok(r) => {
                turn.published += r.published;
                r.published > 0 || r.claimed >= batch_size
            }
            Err(_) => false,
        };
        turn.last = result;
        if !more || single || waiting.load(Ordering::Relaxed) > 0 || end.is_cancelled() {
            return turn;
        }
    }
}

/// What the scheduler's background tasks report.
enum Done {
    Round(Key, Turn),
    Discovered(Found),
    Probed(String, Result<Vec<String>>),
    /// A failed probe of the database is to be tried again.
    Look(String),
    /// An awake tenant whose producers were in flight: time for another round.
    Poll(Key),
}

impl<P: Publisher + 'static> TenantRelay<P> {
    /// A tenant relay publishing through `publisher`, with defaults; give it databases.
    pub fn builder(publisher: P) -> TenantRelayBuilder<P> {
        TenantRelayBuilder {
            publisher,
            given: Vec::new(),
            servers: Vec::new(),
            schema_pattern: None,
            schema_names: Vec::new(),
            discover_interval: Duration::from_secs(2),
            idle_poll_interval: Duration::from_secs(1),
            rounds_in_flight: 4,
            tenant_label_cap: 100,
            batch_size: 500,
            max_attempts: 10,
            backoff: RetryPolicy::new()
                .base_delay(Duration::from_secs(1))
                .max_delay(Duration::from_secs(300)),
            publish_timeout: crate::relay::DEFAULT_PUBLISH_TIMEOUT,
            database_pool_size: 4,
        }
    }

    /// A snapshot of every tenant served (as of the last discovery), sorted by database and
    /// schema. Cheap: no database access.
    pub fn status(&self) -> Vec<TenantStatus> {
        self.status
            .lock()
            .expect("tenant status")
            .values()
            .cloned()
            .collect()
    }

    /// Refuses pools that reach PostgreSQL through a pooler in transaction mode (the given
    /// databases' pools and the servers' pools, from which discovered databases' pools are
    /// made): the listener holds session advisory locks and `LISTEN`s, and the probes and
    /// rounds use prepared statements, none of which such a pooler keeps. A pool that cannot
    /// be probed (the database away, no second connection) is not refused: the relay reports
    /// and retries what fails later, as it does for any database.
    async fn refuse_transaction_poolers(&self) -> Result<()> {
        let given = self.sources.given.iter();
        let servers = self.sources.servers.iter().map(|(pool, _)| pool);
        for pool in given.chain(servers) {
            if let Ok(Some(true)) = crate::pooler::shares_sessions(pool).await {
                return Err(Error::SessionRequired {
                    component: "tenant relay",
                    reason: "its listener holds session advisory locks and LISTENs, and its \
                             probes and rounds use prepared statements, none of which a pooler \
                             in transaction mode keeps; give it pools of direct connections \
                             (or a pooler in session mode)"
                        .to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Lists the tenants once and drains each of them in turn (see [`Relay::drain`]): for
    /// tests, batch jobs and a shutdown that should leave nothing behind. A tenant whose
    /// drain fails is counted in [`TenantDrainReport::broken`] and shown broken in
    /// [`status`](Self::status); the others are drained.
    pub async fn drain(&self) -> Result<TenantDrainReport> {
        self.refuse_transaction_poolers().await?;
        let found = discover::discover(&self.sources, &self.selector, &HashMap::new()).await;
        if let Some(e) = found.server_errors.iter().flatten().next() {
            return Err(Error::InvalidConfig(format!(
                "tenant relay cannot list databases: {e}"
            )));
        }
        let mut report = TenantDrainReport::default();
        for db in found.databases {
            let schemas = match db.schemas {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(database = db.name, error = %e, "pgbox tenant relay cannot read the database's schemas");
                    continue;
                }
            };
            for schema in schemas {
                let key = (db.name.clone(), schema.as_str().to_owned());
                let relay = self.tenant_relay(&db.pool, &key)?;
                let label = self.label(&key);
                self.touch(&key);
                report.tenants += 1;
                match relay.drain().await {
                    Ok(d) => {
                        report.published += d.published;
                        self.note_round(&key, &label, &Ok(d.published), d.rounds as u64);
                    }
                    Err(e) => {
                        report.broken += 1;
                        self.note_round(&key, &label, &Err(e.to_string()), 1);
                    }
                }
                // A tenant new to the status is counted in the gauge too.
                self.count_tenants();
            }
        }
        Ok(report)
    }

    /// Runs until `shutdown` is cancelled; the rounds in flight are finished (published and
    /// committed) before it returns. Errors are per tenant or per database: logged, shown in
    /// [`status`](Self::status), retried; it never gives up on its own. One exception, at
    /// the start: a pool that goes through a pooler in transaction mode (PgBouncer's
    /// `pool_mode = transaction`) is refused with [`Error::SessionRequired`] (the relay
    /// needs sessions of its own; so does [`drain`](Self::drain)).
    ///
    /// Dropping the future instead abandons the rounds in flight: their transactions roll
    /// back and their messages are published again by the next round (at least once), and
    /// the listener connections close, releasing the asleep locks.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        self.refuse_transaction_poolers().await?;
        let (events_tx, mut events) = mpsc::unbounded_channel::<Event>();
        let listeners = shutdown.child_token();
        let _stop_listeners = listeners.clone().drop_guard();
        let mut dbs: HashMap<String, Db> = HashMap::new();
        let mut tenants: HashMap<Key, Tenant<P>> = HashMap::new();
        let mut ready: VecDeque<Key> = VecDeque::new();
        let mut work: JoinSet<Done> = JoinSet::new();
        let mut running = 0usize;
        // Which tenant each round task serves, to find it if the task panics.
        let mut round_tasks: HashMap<tokio::task::Id, Key> = HashMap::new();
        // Tenants waiting for a slot, as of the scheduler's last pass: a turn goes on while
        // there are none.
        let waiting = Arc::new(AtomicUsize::new(0));
        let mut discovering = false;
        let mut server_errors: Vec<Option<String>> = vec![None; self.sources.servers.len()];
        let mut discover_tick = tokio::time::interval(self.discover_interval);
        discover_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut idle_tick = tokio::time::interval(self.idle_poll_interval);
        idle_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Start rounds, fairly: one per tenant, the ready queue in order.
            while running < self.rounds_in_flight && !shutdown.is_cancelled() {
                let Some(key) = ready.pop_front() else { break };
                let Some(t) = tenants.get_mut(&key) else {
                    continue;
                };
                if t.phase != Phase::Queued {
                    continue;
                }
                t.phase = Phase::Running;
                t.again = false;
                running += 1;
                let relay = t.relay.clone();
                let task_key = key.clone();
                t.turn = shutdown.child_token();
                let end = t.turn.clone();
                // An asleep tenant (queued by a probe) gets one round: if it published, the
                // scheduler wakes it (its producers stop notifying) before the next.
                let single = t.asleep;
                let (waiting, batch_size) = (waiting.clone(), self.batch_size);
                let handle = work.spawn(async move {
                    let done = turn(&relay, batch_size, single, &waiting, &end).await;
                    Done::Round(task_key, done)
                });
                round_tasks.insert(handle.id(), key);
            }
            waiting.store(ready.len(), Ordering::Relaxed);
            if shutdown.is_cancelled() && running == 0 {
                return Ok(());
            }
            // Owed probes, one at a time per database: a look that falls due while one runs
            // is taken by the next (the one running may have started before the lock).
            for (name, db) in dbs.iter_mut() {
                if db.look && !db.probing && !shutdown.is_cancelled() {
                    db.look = false;
                    let mut schemas: Vec<Identifier> = tenants
                        .iter()
                        .filter(|(k, t)| k.0 == *name && !t.removed && t.failures == 0)
                        .map(|(_, t)| t.schema.clone())
                        .collect();
                    if schemas.is_empty() {
                        continue;
                    }
                    // Sorted: the statement's text changes only when tenants come or go,
                    // so it stays prepared.
                    schemas.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                    db.probing = true;
                    let pool = db.pool.clone();
                    let name = name.clone();
                    work.spawn(async move {
                        let result = discover::due(&pool, &schemas).await;
                        Done::Probed(name, result)
                    });
                }
            }
            tokio::select! {
                _ = shutdown.cancelled(), if running > 0 => {
                    // Finish the rounds in flight, start no other.
                    while let Some(done) = work.join_next().await {
                        let key = match done {
                            Ok(Done::Round(key, turn)) => {
                                // Counted in the status and metrics as any round.
                                self.after_round(key.clone(), turn, &mut tenants, &dbs, &mut ready);
                                Some(key)
                            }
                            Err(e) => round_tasks.get(&e.id()).cloned(),
                            Ok(_) => None,
                        };
                        if let Some(key) = key {
                            round_tasks.retain(|_, k| *k != key);
                            running -= 1;
                            if running == 0 { break; }
                        }
                    }
                    return Ok(());
                }
                _ = shutdown.cancelled(), if running == 0 => return Ok(()),
                _ = discover_tick.tick(), if !discovering => {
                    discovering = true;
                    let sources = self.sources.clone();
                    let selector = self.selector.clone();
                    let known: HashMap<String, PgPool> = dbs
                        .iter()
                        .filter(|(_, d)| d.owned)
                        .map(|(n, d)| (n.clone(), d.pool.clone()))
                        .collect();
                    work.spawn(async move {
                        Done::Discovered(discover::discover(&sources, &selector, &known).await)
                    });
                }
                _ = idle_tick.tick() => {
                    let now = Instant::now();
                    // Every database's healthy tenants are probed (the result only matters
                    // for the idle ones), at the top of the loop.
                    for db in dbs.values_mut() {
                        db.look = true;
                    }
                    for (key, t) in tenants.iter_mut() {
                        if t.removed {
                            continue;
                        }
                        if t.phase != Phase::Idle || t.sleep_pending {
                            continue;
                        }
                        // A healthy tenant awake here (producers in flight, or no
                        // listener) is not given a round: the probe just owed finds its
                        // work, and its awake polls go on.
                        if t.failures > 0 && t.retry_at <= now {
                            t.phase = Phase::Queued;
                            ready.push_back(key.clone());
                        }
                    }
                }
                Some(event) = events.recv() => match event {
                    Event::Woken { database, schema, scheduled } => {
                        let key = (database, schema);
                        if let Some(t) = tenants.get_mut(&key) {
                            if scheduled {
                                t.relay.promote_soon();
                            }
                            self.wake(&key, t, &dbs, &mut ready);
                        }
                    }
                    Event::Slept { database, schema, asleep } => {
                        let key = (database, schema);
                        if let Some(t) = tenants.get_mut(&key) {
                            t.sleep_pending = false;
                            match asleep {
                                // Held here, or by another relay serving the tenant (its
                                // producers notify, and this relay hears them too): asleep
                                // either way, no round until a notification or a probe.
                                Sleep::Held | Sleep::Elsewhere => {
                                    t.asleep = true;
                                    t.awake_polls = 0;
                                    self.set_asleep(&key, true);
                                    // The final look, under the lock: producers that committed
                                    // before it did not notify. A probe of the database (one
                                    // statement per 200 tenants, shared by every tenant that
                                    // fell asleep meanwhile), not a round each: a thousand
                                    // tenants falling asleep at start would otherwise put a
                                    // thousand rounds in the ready queue ahead of a notified
                                    // tenant.
                                    if t.phase == Phase::Idle
                                        && !t.removed
                                        && let Some(db) = dbs.get_mut(&key.0)
                                    {
                                        db.look = true;
                                    } else if t.phase == Phase::Running {
                                        // Its round (queued by a probe) may have read the
                                        // outbox before the lock was taken: one more, under it.
                                        t.again = true;
                                    }
                                }
                                Sleep::Busy if !t.removed => {
                                    // A producer is in flight (it holds the lock shared until
                                    // it commits, and will not notify): look again soon, then
                                    // less and less often, up to the idle poll interval.
                                    let wait = AWAKE_POLL
                                        .saturating_mul(1 << t.awake_polls.min(10))
                                        .min(self.idle_poll_interval);
                                    t.awake_polls = t.awake_polls.saturating_add(1);
                                    work.spawn(async move {
                                        tokio::time::sleep(wait).await;
                                        Done::Poll(key)
                                    });
                                }
                                // No listener: the idle probe looks for its work meanwhile,
                                // and it tries again once the listener is back.
                                Sleep::Busy | Sleep::Away => {}
                            }
                        }
                    }
                    Event::Lost { database } => {
                        // Every lock of that connection is gone and notifications may be
                        // lost: its tenants are awake, and one probe of the database (not a
                        // round each) finds those with due work; they fall asleep again
                        // when the listener is back.
                        for (key, t) in tenants.iter_mut().filter(|(k, _)| k.0 == database) {
                            t.sleep_pending = false;
                            if t.asleep {
                                t.asleep = false;
                                self.set_asleep(key, false);
                            }
                        }
                        if let Some(db) = dbs.get_mut(&database) {
                            db.look = true;
                        }
                    }
                    Event::Connected { database } => {
                        // As at start: each idle tenant takes its lock, then one probe.
                        if let Some(db) = dbs.get(&database) {
                            for (key, t) in tenants.iter_mut().filter(|(k, _)| k.0 == database) {
                                if t.phase == Phase::Idle
                                    && !t.asleep
                                    && !t.sleep_pending
                                    && !t.removed
                                    && t.failures == 0
                                {
                                    t.sleep_pending = true;
                                    let _ = db.listener.send(Command::Sleep(key.1.clone()));
                                }
                            }
                        }
                    }
                },
                Some(done) = work.join_next() => {
                    let done = match done {
                        Ok(done) => done,
                        Err(e) => {
                            tracing::error!(error = %e, "pgbox tenant relay: a task failed");
                            match round_tasks.remove(&e.id()) {
                                Some(key) => {
                                    running -= 1;
                                    let failed = Turn::failed(Error::InvalidConfig(format!("the round's task failed: {e}")));
                                    self.after_round(key, failed, &mut tenants, &dbs, &mut ready);
                                }
                                None => discovering = false,
                            }
                            continue;
                        }
                    };
                    match done {
                        Done::Round(key, turn) => {
                            running -= 1;
                            round_tasks.retain(|_, k| *k != key);
                            self.after_round(key, turn, &mut tenants, &dbs, &mut ready);
                        }
                        Done::Discovered(found) => {
                            discovering = false;
                            self.apply_discovery(
                                found,
                                &mut server_errors,
                                &mut dbs,
                                &mut tenants,
                                &events_tx,
                                &listeners,
                            );
                        }
                        Done::Look(name) => {
                            if let Some(db) = dbs.get_mut(&name) {
                                db.look = true;
                            }
                        }
                        Done::Poll(key) => {
                            if let Some(t) = tenants.get_mut(&key)
                                && t.phase == Phase::Idle
                                && !t.asleep
                                && !t.sleep_pending
                                && !t.removed
                                && t.failures == 0
                            {
                                t.phase = Phase::Queued;
                                ready.push_back(key);
                            }
                        }
                        Done::Probed(name, result) => {
                            // A failed probe (the database out of reach; a tenant's table
                            // gone is told apart by the probe itself) gives no round: it is
                            // tried again soon, a few times, then at the idle poll.
                            let due = match result {
                                Ok(due) => {
                                    if let Some(db) = dbs.get_mut(&name) {
                                        db.probing = false;
                                        db.probe_failures = 0;
                                    }
                                    due
                                }
                                Err(e) => {
                                    tracing::debug!(database = name, error = %e, "pgbox tenant relay: idle poll failed");
                                    if let Some(db) = dbs.get_mut(&name) {
                                        db.probing = false;
                                        db.probe_failures = db.probe_failures.saturating_add(1);
                                        if db.probe_failures <= PROBE_RETRIES {
                                            let wait = PROBE_RETRY
                                                .saturating_mul(1 << (db.probe_failures - 1))
                                                .min(self.idle_poll_interval);
                                            work.spawn(async move {
                                                tokio::time::sleep(wait).await;
                                                Done::Look(name)
                                            });
                                        }
                                    }
                                    continue;
                                }
                            };
                            for schema in due {
                                let key = (name.clone(), schema);
                                if let Some(t) = tenants.get_mut(&key)
                                    && t.phase == Phase::Idle
                                    && !t.removed
                                {
                                    t.phase = Phase::Queued;
                                    ready.push_back(key);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// A notification for a tenant: it wakes (its lock released, so that its producers stop
    /// notifying while it works) and joins the queue.
    fn wake(
        &self,
        key: &Key,
        t: &mut Tenant<P>,
        dbs: &HashMap<String, Db>,
        ready: &mut VecDeque<Key>,
    ) {
        if t.removed {
            return;
        }
        match t.phase {
            Phase::Idle => {
                if t.asleep {
                    t.asleep = false;
                    self.set_asleep(key, false);
                    if let Some(db) = dbs.get(&key.0) {
                        let _ = db.listener.send(Command::Wake(key.1.clone()));
                    }
                }
                if t.failures == 0 || t.retry_at <= Instant::now() {
                    t.phase = Phase::Queued;
                    ready.push_back(key.clone());
                }
            }
            Phase::Running => t.again = true,
            Phase::Queued => {}
        }
    }

    fn after_round(
        &self,
        key: Key,
        turn: Turn,
        tenants: &mut HashMap<Key, Tenant<P>>,
        dbs: &HashMap<String, Db>,
        ready: &mut VecDeque<Key>,
    ) {
        let Some(t) = tenants.get_mut(&key) else {
            return;
        };
        t.phase = Phase::Idle;
        let result = turn.last;
        match &result {
            Ok(_) => self.note_round(&key, &t.label, &Ok(turn.published), turn.rounds),
            Err(e) => {
                // The rounds before the failed one went through.
                if turn.rounds > 1 {
                    self.note_round(&key, &t.label, &Ok(turn.published), turn.rounds - 1);
                }
                self.note_round(&key, &t.label, &Err(e.to_string()), 1);
            }
        }
        if turn.published > 0 {
            // Its producers commit: a Busy look at its asleep lock was one of them in flight,
            // not one long transaction. The awake polls start again at the shortest.
            t.awake_polls = 0;
        }
        if t.removed {
            self.forget(&key, tenants, dbs);
            return;
        }
        let listener = dbs.get(&key.0).map(|d| &d.listener);
        match result {
            Ok(report) => {
                t.failures = 0;
                let more = report.published > 0 || report.claimed >= self.batch_size || t.again;
                if more {
                    if t.asleep && turn.published > 0 {
                        // Woken by a poll with work to do: its producers stop notifying
                        // while it works, as when a notification wakes it.
                        t.asleep = false;
                        self.set_asleep(&key, false);
                        if let Some(listener) = listener {
                            let _ = listener.send(Command::Wake(key.1.clone()));
                        }
                    }
                    t.phase = Phase::Queued;
                    ready.push_back(key);
                } else if !t.asleep
                    && !t.sleep_pending
                    && let Some(listener) = listener
                {
                    t.sleep_pending = true;
                    let _ = listener.send(Command::Sleep(key.1.clone()));
                }
            }
            Err(_) => {
                t.failures = t.failures.saturating_add(1);
                let backoff = Duration::from_secs(1)
                    .saturating_mul(1 << t.failures.min(6).saturating_sub(1))
                    .min(MAX_BROKEN_BACKOFF);
                t.retry_at = Instant::now() + backoff;
                if t.asleep {
                    t.asleep = false;
                    self.set_asleep(&key, false);
                    if let Some(listener) = listener {
                        let _ = listener.send(Command::Wake(key.1.clone()));
                    }
                }
            }
        }
    }

    /// Records a round's outcome (`Ok`: messages published) in the status and metrics, and
    /// logs a change of health once.
    fn note_round(
        &self,
        key: &Key,
        label: &str,
        outcome: &std::result::Result<usize, String>,
        rounds: u64,
    ) {
        let labels = [("tenant", label.to_owned())];
        metrics::counter!(telemetry::TENANT_RELAY_ROUNDS, &labels).increment(rounds);
        let mut status = self.status.lock().expect("tenant status");
        let Some(s) = status.get_mut(key) else {
            return;
        };
        s.rounds += rounds;
        let was_healthy = s.health == TenantHealth::Healthy;
        match outcome {
            Ok(published) => {
                if *published > 0 {
                    metrics::counter!(telemetry::TENANT_RELAY_PUBLISHED, &labels)
                        .increment(*published as u64);
                }
                s.published += *published as u64;
                if let TenantHealth::Broken { reason } = &s.health {
                    tracing::info!(
                        database = key.0,
                        schema = key.1,
                        was = reason,
                        "pgbox tenant relay: the tenant works again"
                    );
                    s.health = TenantHealth::Healthy;
                }
            }
            Err(error) => {
                metrics::counter!(telemetry::TENANT_RELAY_ROUND_ERRORS, &labels).increment(1);
                if s.health == TenantHealth::Healthy {
                    tracing::warn!(database = key.0, schema = key.1, %error, "pgbox tenant relay: the tenant's rounds fail; retrying with a backoff, the others go on");
                } else {
                    tracing::debug!(database = key.0, schema = key.1, %error, "pgbox tenant relay: the tenant's round failed again");
                }
                s.health = TenantHealth::Broken {
                    reason: error.clone(),
                };
                s.last_error = Some(error.clone());
            }
        }
        let moved = was_healthy != (s.health == TenantHealth::Healthy);
        drop(status);
        // The gauge is counted over every tenant: only when this one changed sides, not
        // every round.
        if moved {
            self.count_tenants();
        }
    }

    fn set_asleep(&self, key: &Key, asleep: bool) {
        if let Some(s) = self.status.lock().expect("tenant status").get_mut(key) {
            s.asleep = asleep;
        }
    }

    /// Adds the tenant to the status if it is not there.
    fn touch(&self, key: &Key) {
        self.status
            .lock()
            .expect("tenant status")
            .entry(key.clone())
            .or_insert_with(|| TenantStatus {
                database: key.0.clone(),
                schema: key.1.clone(),
                health: TenantHealth::Healthy,
                asleep: false,
                rounds: 0,
                published: 0,
                last_error: None,
            });
    }

    fn count_tenants(&self) {
        let (mut healthy, mut broken) = (0usize, 0usize);
        // Counted and moved under the status lock: two calls cannot move it out of order.
        let status = self.status.lock().expect("tenant status");
        for s in status.values() {
            match s.health {
                TenantHealth::Healthy => healthy += 1,
                TenantHealth::Broken { .. } => broken += 1,
            }
        }
        let mut counted = self.counted.lock().expect("tenant gauge");
        let (was_healthy, was_broken) = *counted;
        *counted = (healthy, broken);
        drop(counted);
        let moved = |now: usize, was: usize| now as f64 - was as f64;
        metrics::gauge!(telemetry::TENANT_RELAY_TENANTS, "state" => "healthy")
            .increment(moved(healthy, was_healthy));
        metrics::gauge!(telemetry::TENANT_RELAY_TENANTS, "state" => "broken")
            .increment(moved(broken, was_broken));
        drop(status);
    }

    /// The tenant's metrics label: its own for the first `tenant_label_cap` tenants.
    fn label(&self, key: &Key) -> String {
        let mut labels = self.labels.lock().expect("tenant labels");
        if labels.contains(key) || labels.len() < self.tenant_label_cap {
            labels.insert(key.clone());
            format!("{}/{}", key.0, key.1)
        } else {
            OTHER_LABEL.to_owned()
        }
    }

    fn tenant_relay(&self, pool: &PgPool, key: &Key) -> Result<Relay<P>> {
        Relay::shared(pool.clone(), self.publisher.clone())
            .schema(key.1.clone())
            .batch_size(self.batch_size)
            .max_attempts(self.max_attempts)
            .backoff(self.backoff.clone())
            .poll_interval(self.idle_poll_interval)
            .publish_timeout(self.publish_timeout)
            .wake_up(WakeUp::Poll)
            .tenant(format!("{}/{}", key.0, key.1))
            .build()
    }

    /// Lets a tenant go: its lock released, its channel unlistened, its status removed.
    fn forget(&self, key: &Key, tenants: &mut HashMap<Key, Tenant<P>>, dbs: &HashMap<String, Db>) {
        tenants.remove(key);
        if let Some(db) = dbs.get(&key.0) {
            let _ = db.listener.send(Command::Forget(key.1.clone()));
        }
        self.status.lock().expect("tenant status").remove(key);
        tracing::info!(
            database = key.0,
            schema = key.1,
            "pgbox tenant relay lets a tenant go"
        );
        self.count_tenants();
    }

    #[allow(clippy::too_many_arguments)]
    fn apply_discovery(
        &self,
        found: Found,
        server_errors: &mut [Option<String>],
        dbs: &mut HashMap<String, Db>,
        tenants: &mut HashMap<Key, Tenant<P>>,
        events: &mpsc::UnboundedSender<Event>,
        listeners: &CancellationToken,
    ) {
        for (i, now) in found.server_errors.into_iter().enumerate() {
            let Some(before) = server_errors.get_mut(i) else {
                continue;
            };
            match (&before, &now) {
                (None, Some(e)) => {
                    tracing::warn!(error = %e, "pgbox tenant relay cannot list the server's databases; keeping those it knows")
                }
                (Some(_), None) => {
                    tracing::info!("pgbox tenant relay lists the server's databases again")
                }
                _ => {}
            }
            *before = now;
        }
        for (i, e) in found.given_errors {
            tracing::debug!(pool = i, error = %e, "pgbox tenant relay cannot reach a given database yet");
        }
        let listed: HashSet<String> = found.databases.iter().map(|d| d.name.clone()).collect();
        // Databases gone: their tenants let go, their listener stopped, their pool closed.
        let gone: Vec<String> = dbs
            .keys()
            .filter(|n| !listed.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            let keys: Vec<Key> = tenants.keys().filter(|k| k.0 == name).cloned().collect();
            for key in keys {
                self.let_go(&key, tenants, dbs);
            }
            if let Some(db) = dbs.remove(&name) {
                tracing::info!(database = name, "pgbox tenant relay lets a database go");
                if db.owned {
                    let pool = db.pool;
                    tokio::spawn(async move { pool.close().await });
                }
                // Dropping the sender stops the listener (its connection closes).
            }
        }
        for found_db in found.databases {
            let name = found_db.name.clone();
            let db = dbs.entry(name.clone()).or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(listener::run(
                    name.clone(),
                    (*found_db.pool.connect_options()).clone(),
                    rx,
                    events.clone(),
                    listeners.clone(),
                ));
                tracing::info!(database = name, "pgbox tenant relay serves a database");
                Db {
                    pool: found_db.pool.clone(),
                    owned: found_db.owned,
                    listener: tx,
                    probing: false,
                    look: false,
                    probe_failures: 0,
                    away: None,
                }
            });
            let schemas = match found_db.schemas {
                Ok(s) => {
                    if let Some(e) = db.away.take() {
                        tracing::info!(
                            database = name,
                            was = e,
                            "pgbox tenant relay reads the database's schemas again"
                        );
                    }
                    s
                }
                Err(e) => {
                    if db.away.is_none() {
                        tracing::warn!(database = name, error = %e, "pgbox tenant relay cannot read the database's schemas; its tenants are kept");
                    }
                    db.away = Some(e);
                    continue;
                }
            };
            let names: HashSet<&str> = schemas.iter().map(Identifier::as_str).collect();
            let gone: Vec<Key> = tenants
                .keys()
                .filter(|k| k.0 == name && !names.contains(k.1.as_str()))
                .cloned()
                .collect();
            for key in gone {
                self.let_go(&key, tenants, dbs);
            }
            let Some(db) = dbs.get(&name) else { continue };
            for schema in schemas {
                let key = (name.clone(), schema.as_str().to_owned());
                if tenants.contains_key(&key) {
                    continue;
                }
                let relay = match self.tenant_relay(&db.pool, &key) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(database = name, schema = key.1, error = %e, "pgbox tenant relay cannot serve the tenant");
                        continue;
                    }
                };
                let _ = db.listener.send(Command::Listen(key.1.clone()));
                self.touch(&key);
                tracing::info!(
                    database = name,
                    schema = key.1,
                    "pgbox tenant relay serves a tenant"
                );
                tenants.insert(
                    key.clone(),
                    Tenant {
                        relay: Arc::new(relay),
                        schema,
                        label: self.label(&key),
                        // It falls asleep at once; the final look under its lock (a probe
                        // of the database) gives it a round if it has work. A round each
                        // at start would queue every idle tenant ahead of the busy ones.
                        phase: Phase::Idle,
                        asleep: false,
                        sleep_pending: true,
                        again: false,
                        awake_polls: 0,
                        removed: false,
                        turn: CancellationToken::new(),
                        failures: 0,
                        retry_at: Instant::now(),
                    },
                );
                let _ = db.listener.send(Command::Sleep(key.1.clone()));
            }
        }
        self.count_tenants();
    }

    /// A tenant no longer listed: let go now, or when its round ends.
    fn let_go(&self, key: &Key, tenants: &mut HashMap<Key, Tenant<P>>, dbs: &HashMap<String, Db>) {
        match tenants.get_mut(key) {
            Some(t) if t.phase == Phase::Running => {
                t.removed = true;
                t.turn.cancel();
            }
            Some(_) => self.forget(key, tenants, dbs),
            None => {}
        }
    }
}
