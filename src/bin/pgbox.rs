//! `pgbox`: migrations, status, dead letters and retention, for operators and deploy scripts.
//!
//! Exit codes: 0 success; 1 other failure; 2 bad usage; 3 cannot connect (bad URL or
//! unreachable server); 4 the pgbox schema is missing (run `pgbox migrate`); 5 an id was not
//! found; 6 refused (a retention below the floor without `--force`); 7 `doctor` found
//! warnings (and nothing critical); 8 `doctor` found critical findings.

#[path = "pgbox/archive.rs"]
mod archive;
#[path = "pgbox/tenants.rs"]
mod tenants;

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use pgbox::doctor::{Doctor, Report, Severity};
use pgbox::transport::{QueueDeadLetter, QueueDeadLetters};
use pgbox::{DbErrorKind, DeadLetter, DeadLetters, Error, Inbox, Migrator};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

// No `Debug`: the URL may hold the password.
#[derive(Parser)]
#[command(
    name = "pgbox",
    version,
    about = "Operate pgbox: migrations, status, health checks, dead letters, retention.",
    after_help = "The password: rather than in the URL (which `ps` shows to every user when it \
                  is on the command line), give it as PostgreSQL's own clients take it: in the \
                  PGPASSWORD environment variable, or in a password file (PGPASSFILE, else \
                  ~/.pgpass; mode 0600; lines host:port:database:user:password). Either is \
                  used when the URL has no password. pgbox never prints the password."
)]
struct Cli {
    /// PostgreSQL connection URL: postgres://user@host:port/database[?sslmode=...]. Without
    /// a password in it, PGPASSWORD or the password file (PGPASSFILE, else ~/.pgpass) gives
    /// it.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// The pgbox schema.
    #[arg(long, default_value = pgbox::DEFAULT_SCHEMA, global = true)]
    schema: String,
    /// Machine-readable JSON output.
    #[arg(long, global = true)]
    json: bool,
    /// Every tenant schema whose name matches this SQL `LIKE` pattern (`tenant\_%`), instead
    /// of `--schema`: for `migrate` (every matching schema, even an empty one), `status` and
    /// `doctor` (schemas holding pgbox's tables). One line per tenant, then a summary.
    #[arg(long, global = true, value_name = "PATTERN")]
    tenants: Option<String>,
    /// Every database of the server whose name matches this SQL `LIKE` pattern, instead of
    /// the URL's database (which is still the one connected to first): for `migrate`,
    /// `status` and `doctor`, with `--tenants` or the `--schema` in each.
    #[arg(long, global = true, value_name = "PATTERN")]
    databases: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Apply pending migrations (safe to run from several instances at once).
    Migrate {
        /// Print the migrations as one SQL script instead of applying them.
        #[arg(long)]
        print_sql: bool,
        /// Switch the schema to the time-partitioned inbox, one partition per this much
        /// claim time (`1h`, `1d`); or change its width. There is no switching back.
        #[arg(long, value_parser = parse_age, conflicts_with = "print_sql")]
        partitioned_inbox: Option<Duration>,
        /// With `--partitioned-inbox`: the redelivery window; no partition younger than this
        /// is ever dropped.
        #[arg(long, value_parser = parse_age, default_value = "1d", requires = "partitioned_inbox")]
        partition_min_retention: Duration,
        /// With `--partitioned-inbox`: partitions kept created ahead of the current one.
        #[arg(long, default_value_t = 3, requires = "partitioned_inbox")]
        partitions_ahead: u32,
        /// After the migrations, grant this application role exactly what pgbox's components
        /// need (schema usage, table rights, the lease sequence, pgbox's functions; no CREATE,
        /// no ownership), again on every run. Repeat for several roles. Also in --print-sql.
        #[arg(long = "grant-to", value_name = "ROLE")]
        grant_to: Vec<String>,
        /// With `--tenants` or `--databases`: tenant schemas migrated at once, per database.
        #[arg(long, default_value_t = 2)]
        jobs: usize,
    },
    /// The time-partitioned inbox's partitions: list them, create them ahead, drop old ones.
    Partitions {
        #[command(subcommand)]
        action: PartitionAction,
    },
    /// Backlog, oldest pending message and dead letters per topic; rows, live and expired
    /// leases per consumer.
    Status,
    /// Health checks with advice: migrations, indexes, bloat, what holds back vacuum, the
    /// notification queue, dead letters.
    ///
    /// Exit status: 0 when every finding is ok, 7 when the worst is a warning, 8 when one is
    /// critical, 4 when the schema is not migrated.
    Doctor {
        /// A transaction (or prepared transaction) of this database holding back vacuum this
        /// long is a warning: `90s`, `5m`, `1h`.
        #[arg(long, value_parser = parse_age, default_value = "5m")]
        xmin_age_warn: Duration,
        /// A transaction (or prepared transaction) of this database holding back vacuum this
        /// long is critical.
        #[arg(long, value_parser = parse_age, default_value = "1h")]
        xmin_age_critical: Duration,
        /// Check the grants of this role (the one your services connect as) instead of the
        /// role running the doctor.
        #[arg(long, value_name = "ROLE")]
        role: Option<String>,
    },
    /// Inspect, replay or discard dead letters: the outbox's, or with `--queue` the built-in
    /// queue's. Either kind holds back later messages of its ordering key until it is
    /// replayed or discarded.
    DeadLetters {
        /// The built-in queue's dead letters (messages consumers gave up on) instead of the
        /// outbox's (messages the relay could not publish).
        #[arg(long, global = true)]
        queue: bool,
        #[command(subcommand)]
        action: DeadLetterAction,
    },
    /// The WAL outbox's replication slot (and its publication): create, drop, show.
    Wal {
        #[command(subcommand)]
        action: WalAction,
    },
    /// The archive of delivered messages (relays built with `archive(..)`).
    Archive {
        #[command(subcommand)]
        action: archive::ArchiveAction,
    },
    /// Enqueue archived messages into the outbox again, in archive order (each ordering
    /// key's order), in chunks of one transaction each; prints where it stopped.
    Replay(archive::ReplayArgs),
    /// Delete old inbox rows in batches (index-backed).
    Purge {
        /// Delete rows older than this: `90s`, `30m`, `12h`, `7d`.
        #[arg(long, value_parser = parse_age)]
        older_than: Duration,
        /// Only this consumer's rows (default: every consumer).
        #[arg(long)]
        consumer: Option<String>,
        /// The shortest retention accepted without `--force`: a key purged before its last
        /// redelivery is processed again.
        #[arg(long, value_parser = parse_age, default_value = "1d")]
        min_retention: Duration,
        /// Purge even below `--min-retention`.
        #[arg(long)]
        force: bool,
    },
}

/// `wal create-slot --failover`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum FailoverArg {
    Auto,
    On,
    Off,
}

#[derive(Subcommand, Debug)]
enum WalAction {
    /// Create the slot and its publication if missing (needs wal_level = logical and the
    /// REPLICATION attribute). Messages emitted before the slot exists are not kept.
    CreateSlot {
        /// The slot's name (the WalRelay's).
        #[arg(long, default_value = "pgbox_outbox")]
        slot: String,
        /// A failover slot (PostgreSQL 17+: standbys with sync_replication_slots = on keep a
        /// copy, and the relay reads on after a promotion). auto: where the server can make
        /// one (a 17+ primary); on: required (refused on 15/16, on a standby, or when the slot
        /// exists without failover); off: a plain slot. An existing slot is not changed.
        #[arg(long, value_enum, default_value_t = FailoverArg::Auto)]
        failover: FailoverArg,
    },
    /// Drop the slot and its publication: what it held unpublished is gone.
    DropSlot {
        /// The slot's name.
        #[arg(long, default_value = "pgbox_outbox")]
        slot: String,
    },
    /// Whether the slot exists, whether a relay reads it, the WAL it retains.
    Status {
        /// The slot's name.
        #[arg(long, default_value = "pgbox_outbox")]
        slot: String,
    },
}

#[derive(Subcommand, Debug)]
enum PartitionAction {
    /// The partitions, oldest first, with their bounds and estimated rows.
    List,
    /// Create the partitions missing ahead of the current one.
    Create,
    /// Detach (concurrently) and drop every partition whose rows are all older than this.
    /// The database refuses an age below the configured minimum retention.
    Drop {
        /// `12h`, `7d`, ...
        #[arg(long, value_parser = parse_age)]
        older_than: Duration,
    },
}

#[derive(Subcommand, Debug)]
enum DeadLetterAction {
    /// List dead letters, oldest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Show one dead letter with its payload.
    Show {
        /// Message id.
        id: Uuid,
    },
    /// Put dead letters back in the outbox (or the queue) at their original positions.
    Replay {
        /// Message ids.
        #[arg(required_unless_present = "all")]
        ids: Vec<Uuid>,
        /// Replay every dead letter.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
    },
    /// Delete dead letters for good, releasing their ordering keys.
    Discard {
        /// Message ids.
        #[arg(required = true)]
        ids: Vec<Uuid>,
    },
}

/// A failure with the exit code it maps to.
struct Failure {
    code: u8,
    message: String,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match e.db_kind() {
            Some(DbErrorKind::ConnectionLost | DbErrorKind::PoolTimedOut) => 3,
            Some(DbErrorKind::MissingSchema) => 4,
            _ if matches!(
                e,
                Error::InvalidIdentifier { .. } | Error::InvalidConsumerName { .. }
            ) =>
            {
                2
            }
            // Refused: below a retention floor, or the wrong inbox layout.
            _ if matches!(e, Error::InvalidConfig(_) | Error::InboxLayout(_)) => 6,
            _ => 1,
        };
        let hint = if code == 4 {
            " (run `pgbox migrate`)"
        } else if e.db_kind() == Some(DbErrorKind::InsufficientPrivilege) {
            " (as the schema's owner, run `pgbox migrate --grant-to ROLE`; \
             `pgbox doctor --role ROLE` lists what is missing)"
        } else {
            ""
        };
        Failure {
            code,
            message: format!("{e}{hint}"),
        }
    }
}

fn fail(code: u8, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

fn parse_age(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{s:?}: add a unit (s, m, h, d)"))?;
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected a number then a unit"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (s, m, h, d)")),
    };
    n.checked_mul(secs)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{s:?}: too large"))
}

/// A duration in words for messages: `1 day`, `1 day 12 hours`, `90 minutes` is
/// `1 hour 30 minutes`. Whole seconds; the flags take nothing finer.
fn human_age(d: Duration) -> String {
    let mut secs = d.as_secs();
    if secs == 0 {
        return "0 seconds".into();
    }
    let mut parts = Vec::new();
    for (unit, size) in [
        ("day", 86_400),
        ("hour", 3600),
        ("minute", 60),
        ("second", 1),
    ] {
        let n = secs / size;
        secs %= size;
        match n {
            0 => {}
            1 => parts.push(format!("1 {unit}")),
            n => parts.push(format!("{n} {unit}s")),
        }
    }
    parts.join(" ")
}

/// A duration as the CLI's flags write it, in the largest unit that divides it: `1d`, `12h`.
fn age_text(d: Duration) -> String {
    let secs = d.as_secs();
    for (unit, size) in [("d", 86_400), ("h", 3600), ("m", 60)] {
        if secs >= size && secs.is_multiple_of(size) {
            return format!("{}{unit}", secs / size);
        }
    }
    format!("{secs}s")
}

fn time_text(t: Option<OffsetDateTime>) -> String {
    t.and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| "-".into())
}

fn time_json(t: Option<OffsetDateTime>) -> Value {
    t.and_then(|t| t.format(&Rfc3339).ok())
        .map_or(Value::Null, Value::String)
}

fn print(json_mode: bool, value: Value, text: impl FnOnce() -> String) {
    if json_mode {
        println!("{}", serde_json::to_string_pretty(&value).expect("json"));
    } else {
        print!("{}", text());
    }
}

async fn connect(url: Option<&str>) -> Result<PgPool, Failure> {
    let url = url.ok_or_else(|| fail(2, "no database: pass --database-url or set DATABASE_URL"))?;
    pgbox::connect(
        url,
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10)),
    )
    .await
    .map_err(|e| fail(3, e.to_string()))
}

async fn ensure_schema(pool: &PgPool, schema: &str) -> Result<(), Failure> {
    let applied = Migrator::new().schema(schema)?.applied(pool).await?;
    if applied.is_empty() {
        return Err(fail(
            4,
            format!("schema {schema:?} has no pgbox tables (run `pgbox migrate`)"),
        ));
    }
    Ok(())
}

/// The ids named on the command line as a set: each once, in the order first given.
fn distinct(ids: Vec<Uuid>) -> Vec<Uuid> {
    let mut seen = HashSet::with_capacity(ids.len());
    ids.into_iter().filter(|id| seen.insert(*id)).collect()
}

/// Exit 5 unless every one of the (distinct) `ids` was found; the others were still acted on.
fn check_all_found(done: &str, n: u64, ids: &[Uuid], what: &str) -> Result<(), Failure> {
    if n < ids.len() as u64 {
        return Err(fail(
            5,
            format!(
                "{done} {n} of {} distinct ids: the others are not {what}",
                ids.len()
            ),
        ));
    }
    Ok(())
}

/// The dead letters a `dead-letters` command works on: the outbox's (the relay gave up
/// publishing them) or, with `--queue`, the built-in queue's (a consumer gave up on them).
enum Store {
    Outbox(DeadLetters),
    Queue(QueueDeadLetters),
}

impl Store {
    fn what(&self) -> &'static str {
        match self {
            Store::Outbox(_) => "dead letters",
            Store::Queue(_) => "queue dead letters",
        }
    }

    /// Each dead letter as JSON and as one line of text.
    async fn list(&self, limit: i64) -> Result<Vec<(Value, String)>, Failure> {
        let line =
            |id: &Uuid, topic: &str, key: Option<&str>, count: String, error: Option<&str>| {
                format!(
                    "{id}  {topic}  key={}  {count}  error={}\n",
                    key.unwrap_or("-"),
                    error.unwrap_or("-")
                )
            };
        Ok(match self {
            Store::Outbox(dead) => dead
                .list(limit)
                .await?
                .iter()
                .map(|d| {
                    let text = line(
                        &d.message_id,
                        &d.topic,
                        d.ordering_key.as_deref(),
                        format!("attempts={}", d.attempts),
                        d.last_error.as_deref(),
                    );
                    (dead_letter_json(d), text)
                })
                .collect(),
            Store::Queue(dead) => dead
                .list(limit)
                .await?
                .iter()
                .map(|d| {
                    let text = line(
                        &d.message_id,
                        &d.topic,
                        d.ordering_key.as_deref(),
                        format!("deliveries={}", d.deliveries),
                        d.last_error.as_deref(),
                    );
                    (queue_dead_letter_json(d), text)
                })
                .collect(),
        })
    }

    /// One dead letter as JSON, with its payload (as text, lossily).
    async fn show(&self, id: Uuid) -> Result<Option<Value>, Failure> {
        let found = match self {
            Store::Outbox(dead) => dead
                .get(id)
                .await?
                .map(|(d, payload)| (dead_letter_json(&d), payload)),
            Store::Queue(dead) => dead
                .get(id)
                .await?
                .map(|(d, payload)| (queue_dead_letter_json(&d), payload)),
        };
        Ok(found.map(|(mut value, payload)| {
            value["payload"] = Value::String(String::from_utf8_lossy(&payload).into_owned());
            value
        }))
    }

    async fn replay(&self, ids: &[Uuid]) -> Result<u64, Failure> {
        Ok(match self {
            Store::Outbox(dead) => dead.replay(ids).await?,
            Store::Queue(dead) => dead.replay(ids).await?,
        })
    }

    async fn replay_all(&self) -> Result<u64, Failure> {
        Ok(match self {
            Store::Outbox(dead) => dead.replay_all().await?,
            Store::Queue(dead) => dead.replay_all().await?,
        })
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Failure> {
        Ok(match self {
            Store::Outbox(dead) => dead.discard(ids).await?,
            Store::Queue(dead) => dead.discard(ids).await?,
        })
    }
}

fn queue_dead_letter_json(d: &QueueDeadLetter) -> Value {
    json!({
        "message_id": d.message_id,
        "seq": d.seq,
        "topic": d.topic,
        "ordering_key": d.ordering_key,
        "deliveries": d.deliveries,
        "last_error": d.last_error,
        "payload_bytes": d.payload_bytes,
        "headers": d.headers,
        "created_at": time_json(Some(d.created_at)),
        "dead_at": time_json(Some(d.dead_at)),
    })
}

fn dead_letter_json(d: &DeadLetter) -> Value {
    json!({
        "message_id": d.message_id,
        "seq": d.seq,
        "topic": d.topic,
        "ordering_key": d.ordering_key,
        "attempts": d.attempts,
        "last_error": d.last_error,
        "payload_bytes": d.payload_bytes,
        "headers": d.headers,
        "created_at": time_json(Some(d.created_at)),
        "dead_at": time_json(Some(d.dead_at)),
    })
}

/// `doctor`'s exit status: 0 all ok, 7 warnings, 8 critical, 4 not migrated.
fn doctor_exit_code(report: &Report) -> u8 {
    if report.not_migrated() {
        return 4;
    }
    match report.severity() {
        Severity::Ok => 0,
        Severity::Warning => 7,
        Severity::Critical => 8,
    }
}

/// The report for a terminal: a summary line, then each finding (worst first) with its
/// advice.
fn doctor_text(report: &Report) -> String {
    let mut out = format!(
        "pgbox doctor, schema {:?}, at {}: {} critical, {} warning(s), {} ok\n",
        report.schema,
        time_text(Some(report.taken_at)),
        report.count(Severity::Critical),
        report.count(Severity::Warning),
        report.count(Severity::Ok)
    );
    let mut findings: Vec<_> = report.findings.iter().collect();
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    for f in findings {
        let label = match f.severity {
            Severity::Ok => "ok",
            Severity::Warning => "WARNING",
            Severity::Critical => "CRITICAL",
        };
        out.push_str(&format!("\n{label:<8}  {}: {}\n", f.code, f.message));
        if let Some((heading, advice)) = advice_line(f.severity, &f.advice) {
            out.push_str(&format!("{:<8}  {heading}: {advice}\n", ""));
        }
    }
    out
}

/// A finding's advice as the text report shows it: "what to do" for a problem; for an ok
/// finding only what is worth knowing beyond "Nothing to do." (a "note"), else nothing.
fn advice_line(severity: Severity, advice: &str) -> Option<(&'static str, &str)> {
    if severity != Severity::Ok {
        return Some(("what to do", advice));
    }
    let rest = advice
        .strip_prefix("Nothing to do.")
        .unwrap_or(advice)
        .trim();
    let rest = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or(rest);
    (!rest.is_empty()).then_some(("note", rest))
}

/// The doctor with the command line's thresholds and role; the warning must come first.
fn doctor_from(
    xmin_age_warn: Duration,
    xmin_age_critical: Duration,
    role: Option<&str>,
) -> Result<Doctor, Failure> {
    if xmin_age_warn > xmin_age_critical {
        return Err(fail(
            2,
            format!(
                "--xmin-age-warn ({}) is above --xmin-age-critical ({}): the warning must come \
                 first",
                age_text(xmin_age_warn),
                age_text(xmin_age_critical)
            ),
        ));
    }
    let doctor = Doctor::new()
        .xmin_age_warn(xmin_age_warn)
        .xmin_age_critical(xmin_age_critical);
    Ok(match role {
        Some(role) => doctor.application_role(role)?,
        None => doctor,
    })
}

/// `migrate`, `status` and `doctor` over the tenants `--tenants`/`--databases` select.
async fn run_fleet(cli: Cli, selection: &tenants::Selection) -> Result<(), Failure> {
    let url = cli.database_url.as_deref();
    match cli.command {
        Command::Migrate {
            print_sql: false,
            partitioned_inbox,
            partition_min_retention,
            partitions_ahead,
            grant_to,
            jobs,
        } => {
            let mut migrator = Migrator::new();
            for role in &grant_to {
                migrator = migrator.grant_to(role)?;
            }
            if let Some(width) = partitioned_inbox {
                migrator = migrator.partitioned_inbox(
                    pgbox::InboxPartitioning::every(width)
                        .minimum_retention(partition_min_retention)
                        .ahead(partitions_ahead),
                );
            }
            if jobs == 0 {
                return Err(fail(2, "--jobs must be at least 1"));
            }
            tenants::migrate(url, selection, migrator, jobs, cli.json).await
        }
        Command::Status => tenants::status(url, selection, cli.json).await,
        Command::Doctor {
            xmin_age_warn,
            xmin_age_critical,
            role,
        } => {
            let doctor = doctor_from(xmin_age_warn, xmin_age_critical, role.as_deref())?;
            tenants::doctor(url, selection, doctor, cli.json).await
        }
        _ => Err(fail(
            2,
            "--tenants and --databases apply to migrate (without --print-sql), status and \
             doctor; run other commands with --schema against one database",
        )),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let json_mode = cli.json;
    let schema = cli.schema.as_str();
    let selection = tenants::Selection {
        tenants: cli.tenants.clone(),
        databases: cli.databases.clone(),
        schema: cli.schema.clone(),
    };
    if selection.is_fleet() {
        return run_fleet(cli, &selection).await;
    }
    match cli.command {
        Command::Migrate {
            print_sql: true,
            grant_to,
            ..
        } => {
            let mut migrator = Migrator::new().schema(schema)?;
            for role in &grant_to {
                migrator = migrator.grant_to(role)?;
            }
            let sql = migrator.to_sql();
            print(json_mode, json!({ "sql": sql }), || sql.clone());
        }
        Command::Migrate {
            print_sql: false,
            partitioned_inbox,
            partition_min_retention,
            partitions_ahead,
            grant_to,
            jobs: _,
        } => {
            let mut migrator = Migrator::new().schema(schema)?;
            for role in &grant_to {
                migrator = migrator.grant_to(role)?;
            }
            let pool = connect(cli.database_url.as_deref()).await?;
            if let Some(width) = partitioned_inbox {
                migrator = migrator.partitioned_inbox(
                    pgbox::InboxPartitioning::every(width)
                        .minimum_retention(partition_min_retention)
                        .ahead(partitions_ahead),
                );
            }
            let report = migrator.run(&pool).await?;
            let applied: Vec<Value> = report
                .applied
                .iter()
                .map(|m| json!({"version": m.version, "name": m.name}))
                .collect();
            print(
                json_mode,
                json!({
                    "schema": schema,
                    "applied": applied,
                    "partitions_created": report.partitions_created,
                    "granted_to": grant_to,
                }),
                || {
                    let mut out: String = if report.applied.is_empty() {
                        format!("schema {schema:?} is up to date\n")
                    } else {
                        report
                            .applied
                            .iter()
                            .map(|m| format!("applied V{}__{}\n", m.version, m.name))
                            .collect()
                    };
                    for p in &report.partitions_created {
                        out.push_str(&format!("created inbox partition {p}\n"));
                    }
                    for role in &grant_to {
                        out.push_str(&format!("granted role {role:?} what pgbox needs\n"));
                    }
                    out
                },
            );
        }
        Command::Status => {
            let pool = connect(cli.database_url.as_deref()).await?;
            ensure_schema(&pool, schema).await?;
            let status = pgbox::status(&pool, schema).await?;
            let inboxes = pgbox::inbox_status(&pool, schema).await?;
            let topics: Vec<Value> = status
                .topics
                .iter()
                .map(|t| {
                    json!({
                        "topic": t.topic,
                        "outbox_backlog_estimate": t.outbox_backlog_estimate,
                        "outbox_oldest_pending": time_json(t.outbox_oldest_pending),
                        "outbox_dead_letters": t.outbox_dead_letters,
                        "queue_backlog_estimate": t.queue_backlog_estimate,
                        "queue_oldest": time_json(t.queue_oldest),
                        "queue_dead_letters": t.queue_dead_letters,
                    })
                })
                .collect();
            let consumers: Vec<Value> = inboxes
                .iter()
                .map(|c| {
                    json!({
                        "consumer": c.consumer,
                        "rows": c.rows,
                        "oldest_processed_at": time_json(c.oldest_processed_at),
                        "newest_processed_at": time_json(c.newest_processed_at),
                        "live_leases": c.live_leases,
                        "expired_leases": c.expired_leases,
                        "earliest_lease_expiry": time_json(c.earliest_lease_expiry),
                    })
                })
                .collect();
            let value = json!({
                "schema": schema,
                "taken_at": time_json(Some(status.taken_at)),
                "topics": topics,
                "consumers": consumers,
                "scheduled": status.scheduled,
                "next_scheduled_due": time_json(status.next_scheduled_due),
            });
            print(json_mode, value, || {
                let age = |t: Option<OffsetDateTime>| match t {
                    Some(t) => format!("{:.1}s", (status.taken_at - t).as_seconds_f64()),
                    None => "-".into(),
                };
                let mut out = String::from(
                    "TOPIC                    OUTBOX(~) OLDEST      DEAD  QUEUE(~) OLDEST      DEAD\n",
                );
                if status.topics.is_empty() {
                    out.push_str("(no pending messages, no dead letters)\n");
                }
                for t in &status.topics {
                    out.push_str(&format!(
                        "{:<24} {:>9} {:<11} {:>4}  {:>8} {:<11} {:>4}\n",
                        t.topic,
                        t.outbox_backlog_estimate,
                        age(t.outbox_oldest_pending),
                        t.outbox_dead_letters,
                        t.queue_backlog_estimate,
                        age(t.queue_oldest),
                        t.queue_dead_letters
                    ));
                }
                if status.scheduled > 0 {
                    out.push_str(&format!(
                        "scheduled: {} pending (counted up to 10000), the next due {}\n",
                        status.scheduled,
                        time_text(status.next_scheduled_due)
                    ));
                }
                out.push_str("\nCONSUMER                 INBOX ROWS  OLDEST                          NEWEST                          LEASES LIVE  EXPIRED\n");
                if inboxes.is_empty() {
                    out.push_str("(no inbox rows)\n");
                }
                for c in &inboxes {
                    out.push_str(&format!(
                        "{:<24} {:>10}  {:<31} {:<31} {:>11}  {:>7}\n",
                        c.consumer,
                        c.rows,
                        time_text(c.oldest_processed_at),
                        time_text(c.newest_processed_at),
                        c.live_leases,
                        c.expired_leases
                    ));
                }
                let abandoned: Vec<_> = inboxes.iter().filter(|c| c.expired_leases > 0).collect();
                for c in abandoned {
                    out.push_str(&format!(
                        "warning: {} has {} expired lease(s), the earliest expired {} ago: \
                         their holders crashed or stalled; the next delivery takes each over\n",
                        c.consumer,
                        c.expired_leases,
                        age(c.earliest_lease_expiry)
                    ));
                }
                out
            });
        }
        Command::Doctor {
            xmin_age_warn,
            xmin_age_critical,
            role,
        } => {
            let doctor =
                doctor_from(xmin_age_warn, xmin_age_critical, role.as_deref())?.schema(schema)?;
            let pool = connect(cli.database_url.as_deref()).await?;
            // No `ensure_schema` here: on an unmigrated schema the doctor reports it as a
            // finding (`not_migrated`, exit 4), so a health check reading stdout gets the same
            // report shape whatever it found.
            let report = doctor.check(&pool).await?;
            let code = doctor_exit_code(&report);
            let mut value = serde_json::to_value(&report).expect("json");
            value["migrated"] = json!(!report.not_migrated());
            value["exit_code"] = json!(code);
            print(json_mode, value, || doctor_text(&report));
            if report.not_migrated() {
                return Err(fail(
                    code,
                    format!("schema {schema:?} has no pgbox tables (run `pgbox migrate`)"),
                ));
            }
            if code != 0 {
                let (critical, warnings) = (
                    report.count(Severity::Critical),
                    report.count(Severity::Warning),
                );
                return Err(fail(
                    code,
                    format!("doctor: {critical} critical finding(s), {warnings} warning(s)"),
                ));
            }
        }
        Command::DeadLetters { queue, action } => {
            let pool = connect(cli.database_url.as_deref()).await?;
            ensure_schema(&pool, schema).await?;
            let dead = if queue {
                Store::Queue(QueueDeadLetters::with_schema(pool, schema)?)
            } else {
                Store::Outbox(DeadLetters::with_schema(pool, schema)?)
            };
            let what = dead.what();
            match action {
                DeadLetterAction::List { limit } => {
                    let list = dead.list(limit).await?;
                    let value = Value::Array(list.iter().map(|(v, _)| v.clone()).collect());
                    print(json_mode, value, || {
                        if list.is_empty() {
                            return format!("no {what}\n");
                        }
                        list.iter().map(|(_, line)| line.as_str()).collect()
                    });
                }
                DeadLetterAction::Show { id } => {
                    let value = dead
                        .show(id)
                        .await?
                        .ok_or_else(|| fail(5, format!("no {what} with id {id}")))?;
                    print(json_mode, value.clone(), || {
                        format!("{}\n", serde_json::to_string_pretty(&value).expect("json"))
                    });
                }
                DeadLetterAction::Replay { ids, all } => {
                    let n = if all {
                        dead.replay_all().await?
                    } else {
                        let ids = distinct(ids);
                        let n = dead.replay(&ids).await?;
                        check_all_found("replayed", n, &ids, what)?;
                        n
                    };
                    print(json_mode, json!({ "replayed": n }), || {
                        format!("replayed {n}\n")
                    });
                }
                DeadLetterAction::Discard { ids } => {
                    let ids = distinct(ids);
                    let n = dead.discard(&ids).await?;
                    check_all_found("discarded", n, &ids, what)?;
                    print(json_mode, json!({ "discarded": n }), || {
                        format!("discarded {n}\n")
                    });
                }
            }
        }
        Command::Archive {
            action: archive::ArchiveAction::Status,
        } => archive::status(cli.database_url.as_deref(), schema, json_mode).await?,
        Command::Replay(args) => {
            archive::replay(cli.database_url.as_deref(), schema, json_mode, args).await?
        }
        Command::Partitions { action } => {
            let pool = connect(cli.database_url.as_deref()).await?;
            ensure_schema(&pool, schema).await?;
            let partitions = pgbox::InboxPartitions::new(pool).schema(schema)?;
            if partitions.settings().await?.is_none() {
                return Err(fail(
                    6,
                    format!(
                        "schema {schema:?} does not use the partitioned inbox \
                         (pgbox migrate --partitioned-inbox <width>)"
                    ),
                ));
            }
            let describe = |list: &[pgbox::InboxPartition]| -> (Vec<Value>, String) {
                let json = list
                    .iter()
                    .map(|p| {
                        json!({
                            "name": p.name,
                            "from": time_json(Some(p.from)),
                            "to": time_json(Some(p.to)),
                            "rows_estimate": p.rows_estimate,
                        })
                    })
                    .collect();
                let text = list
                    .iter()
                    .map(|p| {
                        format!(
                            "{}  {} .. {}  rows ~{}\n",
                            p.name,
                            time_text(Some(p.from)),
                            time_text(Some(p.to)),
                            p.rows_estimate
                                .map_or_else(|| "?".to_owned(), |n| n.to_string())
                        )
                    })
                    .collect();
                (json, text)
            };
            match action {
                PartitionAction::List => {
                    let (json, text) = describe(&partitions.list().await?);
                    print(json_mode, json!({ "partitions": json }), || text.clone());
                }
                PartitionAction::Create => {
                    let created = partitions.create_ahead().await?;
                    print(json_mode, json!({ "created": created }), || {
                        created.iter().map(|p| format!("created {p}\n")).collect()
                    });
                }
                PartitionAction::Drop { older_than } => {
                    let dropped = partitions.drop_expired(older_than).await?;
                    let (json, text) = describe(&dropped);
                    print(json_mode, json!({ "dropped": json }), || {
                        if dropped.is_empty() {
                            "no partition is old enough\n".to_owned()
                        } else {
                            format!("dropped:\n{text}")
                        }
                    });
                }
            }
        }
        Command::Wal { action } => {
            let pool = connect(cli.database_url.as_deref()).await?;
            match action {
                WalAction::CreateSlot { slot, failover } => {
                    let mut slot = pgbox::WalSlot::new(&slot)?;
                    match failover {
                        FailoverArg::Auto => {}
                        FailoverArg::On => slot = slot.failover(true),
                        FailoverArg::Off => slot = slot.failover(false),
                    }
                    // true only when this call created it (it may have existed).
                    let created = slot.create_if_absent(&pool).await?;
                    // None: a server without failover slots (before 17).
                    let failover = slot.status(&pool).await?.and_then(|st| st.failover);
                    print(
                        json_mode,
                        json!({ "slot": slot.name(), "created": created, "failover": failover }),
                        || {
                            format!(
                                "slot {} and its publication exist; failover: {}\n",
                                slot.name(),
                                match failover {
                                    Some(true) =>
                                        "on (synchronized to standbys that run \
                                                   sync_replication_slots)",
                                    Some(false) => "off (a failover to a standby loses it)",
                                    None =>
                                        "not before PostgreSQL 17 (a failover to a \
                                             standby loses it)",
                                }
                            )
                        },
                    );
                }
                WalAction::DropSlot { slot } => {
                    let slot = pgbox::WalSlot::new(&slot)?;
                    slot.drop(&pool).await?;
                    print(
                        json_mode,
                        json!({ "slot": slot.name(), "dropped": true }),
                        || format!("slot {} and its publication are gone\n", slot.name()),
                    );
                }
                WalAction::Status { slot } => {
                    let slot = pgbox::WalSlot::new(&slot)?;
                    match slot.status(&pool).await? {
                        Some(st) => print(
                            json_mode,
                            json!({
                                "slot": slot.name(), "exists": true, "active": st.active,
                                "retained_bytes": st.retained_bytes, "wal_status": st.wal_status,
                            }),
                            || {
                                format!(
                                    "slot {}: {}, retains {} bytes of WAL, wal_status {}\n",
                                    slot.name(),
                                    if st.active {
                                        "read by a relay"
                                    } else {
                                        "not read"
                                    },
                                    st.retained_bytes,
                                    st.wal_status
                                )
                            },
                        ),
                        None => print(
                            json_mode,
                            json!({ "slot": slot.name(), "exists": false }),
                            || format!("slot {} does not exist\n", slot.name()),
                        ),
                    }
                }
            }
        }
        Command::Purge {
            older_than,
            consumer,
            min_retention,
            force,
        } => {
            if older_than < min_retention && !force {
                return Err(fail(
                    6,
                    format!(
                        "refusing to purge rows younger than {} (the retention floor, \
                         --min-retention {}): --older-than {} is below it, and a message \
                         redelivered after its row is gone is processed again; pass --force \
                         to override",
                        human_age(min_retention),
                        age_text(min_retention),
                        human_age(older_than)
                    ),
                ));
            }
            let pool = connect(cli.database_url.as_deref()).await?;
            ensure_schema(&pool, schema).await?;
            let consumers = match consumer {
                Some(c) => vec![c],
                None => pgbox::inbox_status(&pool, schema)
                    .await?
                    .into_iter()
                    .map(|c| c.consumer)
                    .collect(),
            };
            let mut deleted = serde_json::Map::new();
            let mut total = 0;
            for name in consumers {
                let inbox = Inbox::builder(name.clone()).schema(schema).build()?;
                let n = inbox.purge_older_than(&pool, older_than).await?;
                total += n;
                deleted.insert(name, json!(n));
            }
            print(
                json_mode,
                json!({ "deleted": deleted, "total": total }),
                || {
                    format!(
                        "deleted {total} inbox rows older than {}\n",
                        human_age(older_than)
                    )
                },
            );
        }
    }
    Ok(())
}

/// An argument error as one JSON object: `error` (clap's message, its continuation lines
/// joined), `usage` and, when clap has one, `tip`; `exit_code` 2 as without `--json`.
fn usage_error_json(e: &clap::Error, hide: &Hider) -> Value {
    // The plain rendering (`Display` drops clap's styling): paragraphs of the error, a tip,
    // the usage line, the `--help` hint. clap quotes the argument it could not place: a URL
    // typed where a subcommand or an id belongs would bring its password along.
    let text = hide.apply(&e.to_string());
    let (mut message, mut usage, mut tip) = (None, None, None);
    for paragraph in text.split("\n\n").map(str::trim) {
        if let Some(u) = paragraph.strip_prefix("Usage:") {
            usage = Some(u.trim().to_owned());
        } else if let Some(t) = paragraph.strip_prefix("tip:") {
            tip = Some(t.trim().to_owned());
        } else if message.is_none() && !paragraph.is_empty() {
            let joined: Vec<&str> = paragraph.lines().map(str::trim).collect();
            message = Some(joined.join(" ").trim_start_matches("error: ").to_owned());
        }
    }
    // A (sub)command given without its subcommand or arguments: clap prints that command's
    // help, whose first paragraph is its description, not an error.
    if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        let command: Vec<&str> = usage
            .as_deref()
            .unwrap_or("pgbox")
            .split_whitespace()
            .take_while(|w| !w.starts_with(['[', '<']))
            .collect();
        let what = if usage.as_deref().is_some_and(|u| u.contains("<COMMAND>")) {
            "a subcommand"
        } else {
            "arguments"
        };
        message = Some(format!(
            "'{}' requires {what} but none was provided",
            command.join(" ")
        ));
    }
    let mut out = json!({
        "error": message.unwrap_or_else(|| "bad usage".into()),
        "exit_code": 2,
    });
    if let Some(usage) = usage {
        out["usage"] = json!(usage);
    }
    if let Some(tip) = tip {
        out["tip"] = json!(tip);
    }
    out
}

/// What pgbox's own messages must not repeat: the command line's arguments that may hold a
/// password (a URL, a key=value with a secret's name), and the password part of the database
/// URL, also in pieces (a message quoting a malformed URL may cut the password at a `/`, `?`,
/// `#`, `,` or `:` it holds).
struct Hider {
    /// (text, what replaces it), longest text first.
    replacements: Vec<(String, String)>,
}

impl Hider {
    fn new(args: &[String], database_url: Option<&str>) -> Hider {
        let mut replacements = Vec::new();
        for arg in args {
            let lower = arg.to_ascii_lowercase();
            let risky = arg.contains('@')
                || arg.contains("://")
                || ["pass", "token", "secret", "key"]
                    .iter()
                    .any(|w| lower.contains(w) && arg.contains('='));
            if risky {
                let shown = match arg.split_once("://") {
                    Some((scheme, _)) => format!("{scheme}://*** (hidden: it may hold a password)"),
                    None => "*** (hidden: it may hold a password)".to_owned(),
                };
                replacements.push((arg.clone(), shown));
            }
        }
        if let Some(url) = database_url {
            let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
            // The user-info: up to the last '@' (a password pasted unencoded may hold '/').
            let before_query = rest.split(['?', '#']).next().unwrap_or(rest);
            if let Some((userinfo, _)) = before_query.rsplit_once('@')
                && let Some((_, password)) = userinfo.split_once(':')
            {
                replacements.push((password.to_owned(), "***".to_owned()));
                // Pieces only of a password that has such characters, and long enough not
                // to blot out ordinary words of the message.
                let pieces: Vec<&str> = password.split(['/', '?', '#', ',', ':', '@']).collect();
                for piece in pieces.iter().filter(|_| pieces.len() > 1) {
                    if piece.len() >= 6 {
                        replacements.push(((*piece).to_owned(), "***".to_owned()));
                    }
                }
            }
        }
        replacements.retain(|(text, _)| !text.is_empty());
        replacements.sort_by_key(|(text, _)| std::cmp::Reverse(text.len()));
        Hider { replacements }
    }

    fn apply(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for (secret, shown) in &self.replacements {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), shown);
            }
        }
        text
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let hide = Hider::new(&args, std::env::var("DATABASE_URL").ok().as_deref());
            // `--json` covers argument errors too: a script gets JSON whatever went wrong.
            // (Looked for in the raw arguments: parsing is what failed.)
            let wants_json = std::env::args_os()
                .any(|a| a == "--json" || a.to_str().is_some_and(|a| a.starts_with("--json=")));
            let is_usage_error = !matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            );
            if wants_json && is_usage_error {
                eprintln!("{}", usage_error_json(&e, &hide));
                return ExitCode::from(2);
            }
            let plain = e.to_string();
            let hidden = hide.apply(&plain);
            if hidden != plain {
                // Without clap's colours: the styled rendering cannot be edited safely.
                if e.use_stderr() {
                    eprint!("{hidden}");
                } else {
                    print!("{hidden}");
                }
                return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
            }
            e.exit();
        }
    };
    let json_mode = cli.json;
    let hide = Hider::new(&args, cli.database_url.as_deref());
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(mut f) => {
            f.message = hide.apply(&f.message);
            if json_mode {
                eprintln!("{}", json!({ "error": f.message, "exit_code": f.code }));
            } else {
                eprintln!("pgbox: {}", f.message);
            }
            ExitCode::from(f.code)
        }
    }
}
