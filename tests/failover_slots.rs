//! Failover slots (issue 35): what becomes of the WAL outbox's slot at a failover, per
//! PostgreSQL version, on private clusters of the right major (never the shared server).
//!
//! - 17: `WalSlot::create` makes a failover slot by default; the doctor names what the
//!   primary (`synchronized_standby_slots`, a physical slot per standby) and the standby
//!   (`sync_replication_slots`, `hot_standby_feedback`, `primary_slot_name`, a `dbname` in
//!   `primary_conninfo`) lack; a real promotion under WAL producers and a WAL relay loses
//!   nothing and doubles no effect.
//! - 15 and 16: a plain slot; the doctor says a failover loses it; after a promotion the slot
//!   is gone and the relay says so with a typed error.
//! - 18: `idle_replication_slot_timeout` below a tolerated relay outage is a warning; the
//!   invalidation it causes is typed (`idle_timeout`).

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pgbox::doctor::{Code, Doctor, Report, Severity};
use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, Envelope, Error, HandlerConnection, Inbox, Message, Outbox,
    OutboxMode, RetryPolicy, WalRelay, WalSlot,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Executor, PgPool};
use support::brokers::Proxy;
use support::cluster::Cluster;

const TOPIC: &str = "orders";
const SLOT: &str = "pgbox_outbox";
/// The standby's physical slot on the primary.
const STANDBY_SLOT: &str = "standby1";
const PRODUCERS: i32 = 3;

fn options(addr: SocketAddr) -> PgConnectOptions {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(addr.port())
        .username("postgres")
        .database("postgres")
        .ssl_mode(PgSslMode::Disable)
}

async fn pool_at(addr: SocketAddr, connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options(addr))
        .await
        .unwrap()
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `wal_level = logical` on PostgreSQL `major`, started off the runtime's threads.
async fn logical(major: u32) -> Cluster {
    tokio::task::spawn_blocking(move || Cluster::start_logical_version(major))
        .await
        .unwrap()
}

/// A standby of `primary` with `settings`, started off the runtime's threads.
async fn standby(primary: &Cluster, sync: bool, settings: &[(&str, &str)]) -> Cluster {
    let settings: Vec<(String, String)> = settings
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::block_in_place(|| {
        let settings: Vec<(&str, &str)> = settings
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        Cluster::standby_with(primary, sync, &settings)
    })
}

/// What slot synchronization needs on a standby (17+).
const SYNCING: &[(&str, &str)] = &[
    ("primary_slot_name", STANDBY_SLOT),
    ("hot_standby_feedback", "on"),
    ("sync_replication_slots", "on"),
];

async fn prepare(pool: &PgPool) {
    pgbox::migrate(pool).await.unwrap();
    pool.execute(
        "CREATE TABLE orders (producer int NOT NULL, seq int NOT NULL, PRIMARY KEY (producer, seq)); \
         CREATE TABLE effects (id bigserial PRIMARY KEY, producer int NOT NULL, seq int NOT NULL, \
                               message_id uuid NOT NULL)",
    )
    .await
    .unwrap();
}

fn backoff() -> RetryPolicy {
    RetryPolicy::new()
        .base_delay(Duration::from_millis(20))
        .max_delay(Duration::from_millis(200))
}

fn relay(pool: &PgPool) -> WalRelay<PgQueue> {
    WalRelay::builder(
        pool.clone(),
        WalSlot::new(SLOT).unwrap(),
        PgQueue::new(pool.clone()),
    )
    .poll_interval(Duration::from_millis(50))
    .backoff(backoff())
    .build()
    .unwrap()
}

/// One business transaction: the order row and, only when new, its message in the WAL.
async fn place_order(pool: &PgPool, producer: i32, seq: i32) -> Result<bool, Error> {
    let mut tx = pool.begin().await?;
    let inserted =
        sqlx::query("INSERT INTO orders (producer, seq) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(producer)
            .bind(seq)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
    if inserted {
        let message = Message::json(
            TOPIC,
            &serde_json::json!({ "producer": producer, "seq": seq }),
        )?;
        Outbox::new()
            .mode(OutboxMode::Wal)
            .enqueue(&mut tx, message)
            .await?;
    }
    tx.commit().await?;
    Ok(inserted)
}

async fn doctor(pool: &PgPool) -> Report {
    Doctor::new().check(pool).await.unwrap()
}

fn codes(report: &Report) -> Vec<String> {
    report
        .findings
        .iter()
        .map(|f| format!("{} {}", f.severity, f.code))
        .collect()
}

fn the(report: &Report, code: Code) -> &pgbox::doctor::Finding {
    let found: Vec<_> = report.with_code(code).collect();
    assert_eq!(found.len(), 1, "{code}: {report:#?}");
    found[0]
}

/// Polls `sql` on `cluster` until it returns `expected`, emitting and relaying a message
/// per try on `primary` (slot synchronization follows the primary's slot as it moves).
async fn until_synced(standby: &Cluster, primary: &PgPool, relay: Option<&WalRelay<PgQueue>>) {
    let started = Instant::now();
    let mut seq = 1_000_000;
    loop {
        let got = tokio::task::block_in_place(|| {
            standby.psql(&format!(
                "SELECT count(*) FROM pg_replication_slots \
                 WHERE slot_name = '{SLOT}' AND synced AND NOT temporary"
            ))
        });
        if got == "1" {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "slot {SLOT} not synchronized (synced, persistent) on the standby after 60 s; \
             standby log:\n{}",
            standby.log()
        );
        place_order(primary, 99, seq).await.unwrap();
        seq += 1;
        if let Some(relay) = relay {
            relay.drain().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn on_17_create_makes_a_failover_slot_by_default_and_says_how_to_turn_it_on_later() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), 4).await;

    // Default: a failover slot on a 17 primary.
    let slot = WalSlot::new(SLOT).unwrap();
    slot.create(&pool).await.unwrap();
    let status = slot.status(&pool).await.unwrap().unwrap();
    assert_eq!(status.failover, Some(true), "{status:?}");
    assert_eq!(status.synced, Some(false), "{status:?}");
    assert_eq!(status.invalidation, None, "{status:?}");
    assert!(!status.temporary);
    assert!(
        status.inactive_since.is_some(),
        "17 reports inactive_since: {status:?}"
    );

    // Told not to: a plain slot. Then required: refused, with the command that turns it on.
    let plain = WalSlot::new("plain").unwrap().failover(false);
    plain.create(&pool).await.unwrap();
    assert_eq!(
        plain.status(&pool).await.unwrap().unwrap().failover,
        Some(false)
    );
    let required = WalSlot::new("plain").unwrap().failover(true);
    let err = required.create(&pool).await.unwrap_err();
    let Error::WalSlot { slot, reason } = &err else {
        panic!("not a WalSlot error: {err:?}")
    };
    assert_eq!(slot, "plain");
    assert!(
        reason.contains("ALTER_REPLICATION_SLOT \"plain\" (FAILOVER true)"),
        "{reason}"
    );
    // The default leaves an existing slot as it is (a warning in the log).
    WalSlot::new("plain").unwrap().create(&pool).await.unwrap();
    assert_eq!(
        plain.status(&pool).await.unwrap().unwrap().failover,
        Some(false)
    );

    // The advice's command works: a replication connection turns failover on.
    let out = std::process::Command::new("psql")
        .arg(format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres replication=database",
            primary.port()
        ))
        .args(["-X", "-c", "ALTER_REPLICATION_SLOT plain (FAILOVER true)"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        plain.status(&pool).await.unwrap().unwrap().failover,
        Some(true)
    );
    required.create(&pool).await.unwrap();
}

/// `pgbox wal create-slot --json` says `"created": true` only when that call created the slot
/// (`WalSlot::create_if_absent`); a second call finds it.
#[tokio::test(flavor = "multi_thread")]
async fn create_slot_says_created_only_for_the_call_that_created_it() {
    support::init_tracing();
    let primary = logical(17).await;
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgbox"))
            .args(args)
            .env("DATABASE_URL", primary.url("postgres"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pgbox {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let first = cli(&["--json", "wal", "create-slot", "--slot", SLOT]);
    let second = cli(&["--json", "wal", "create-slot", "--slot", SLOT]);
    assert_eq!(first["created"], serde_json::json!(true), "{first}");
    assert_eq!(second["created"], serde_json::json!(false), "{second}");
    assert_eq!(second["failover"], serde_json::json!(true), "{second}");
}

/// On a 17 standby, `WalSlot::create` refuses (the slot belongs on the primary; a local one
/// would block synchronization), and a local slot of the outbox's name made there by hand
/// is reported with the advice to drop it.
#[tokio::test(flavor = "multi_thread")]
async fn on_a_17_standby_create_refuses_and_the_doctor_says_to_drop_a_local_slot() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), 4).await;
    prepare(&pool).await;
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    let standby = standby(&primary, false, &[("hot_standby_feedback", "on")]).await;
    let standby_pool = pool_at(standby.addr(), 4).await;

    let err = WalSlot::new(SLOT)
        .unwrap()
        .create(&standby_pool)
        .await
        .unwrap_err();
    let Error::WalSlot { reason, .. } = &err else {
        panic!("not a WalSlot error: {err:?}")
    };
    assert!(
        reason.contains("create the slot on the primary"),
        "{reason}"
    );
    assert_eq!(
        WalSlot::new(SLOT)
            .unwrap()
            .status(&standby_pool)
            .await
            .unwrap(),
        None
    );

    // By hand: a logical slot on a standby waits for a running-transactions record from the
    // primary, logged while it waits.
    let logging = {
        let pool = pool.clone();
        tokio::spawn(async move {
            for _ in 0..200 {
                let _ = sqlx::query("SELECT pg_log_standby_snapshot()")
                    .execute(&pool)
                    .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    tokio::time::timeout(
        Duration::from_secs(20),
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(SLOT)
            .execute(&standby_pool),
    )
    .await
    .expect("a logical slot on the standby within 20 s")
    .unwrap();
    logging.abort();
    let report = doctor(&standby_pool).await;
    eprintln!("standby with a local slot: {:?}", codes(&report));
    let f = report
        .with_code(Code::WalSlotNotSynced)
        .find(|f| f.subject.as_deref() == Some(SLOT))
        .unwrap_or_else(|| panic!("{report:#?}"));
    assert!(f.message.contains("a local slot of this standby"), "{f:?}");
    assert!(
        f.advice
            .contains(&format!("pg_drop_replication_slot('{SLOT}')")),
        "{f:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn on_15_and_16_create_makes_a_plain_slot_and_refuses_a_required_failover() {
    support::init_tracing();
    for major in [15, 16] {
        let server = logical(major).await;
        let pool = pool_at(server.addr(), 4).await;
        let slot = WalSlot::new(SLOT).unwrap();
        slot.create(&pool).await.unwrap();
        let status = slot.status(&pool).await.unwrap().unwrap();
        assert_eq!(status.failover, None, "{major}: {status:?}");
        assert_eq!(status.synced, None, "{major}: {status:?}");
        assert_eq!(status.invalidation, None, "{major}: {status:?}");
        let err = WalSlot::new("required")
            .unwrap()
            .failover(true)
            .create(&pool)
            .await
            .unwrap_err();
        let Error::WalSlot { reason, .. } = &err else {
            panic!("{major}: not a WalSlot error: {err:?}")
        };
        assert!(
            reason.contains("PostgreSQL 17 or later"),
            "{major}: {reason}"
        );
        assert!(
            WalSlot::new("required")
                .unwrap()
                .status(&pool)
                .await
                .unwrap()
                .is_none(),
            "{major}: a refused create left a slot"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_on_17_names_what_a_failover_slot_lacks_on_the_primary_and_on_the_standby() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), 8).await;
    prepare(&pool).await;
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    WalSlot::new("plain")
        .unwrap()
        .failover(false)
        .create(&pool)
        .await
        .unwrap();
    // The relay's first read claims the slot for its schema (the standby finds it by that).
    place_order(&pool, 0, 0).await.unwrap();
    let relay = relay(&pool);
    relay.drain().await.unwrap();
    // A standby with a physical slot but neither sync_replication_slots nor feedback.
    let standby = standby(
        &primary,
        false,
        &[
            ("primary_slot_name", STANDBY_SLOT),
            ("hot_standby_feedback", "off"),
        ],
    )
    .await;
    let standby_pool = pool_at(standby.addr(), 4).await;

    // The primary: the plain slot is lost at failover; the failover slot is unguarded.
    let report = doctor(&pool).await;
    eprintln!("primary: {:?}", codes(&report));
    let f = the(&report, Code::WalSlotNotFailover);
    assert_eq!(f.subject.as_deref(), Some("plain"));
    assert!(f.message.contains("this slot is lost at failover"), "{f:?}");
    assert!(
        f.advice
            .contains("ALTER_REPLICATION_SLOT \"plain\" (FAILOVER true)"),
        "{f:?}"
    );
    let f = the(&report, Code::FailoverSlotUnguarded);
    assert!(
        f.message.contains("synchronized_standby_slots is empty"),
        "{f:?}"
    );
    assert!(
        f.advice
            .contains(&format!("synchronized_standby_slots = '{STANDBY_SLOT}'")),
        "{f:?}"
    );
    assert_eq!(report.with_code(Code::StandbyWithoutSlot).count(), 0);

    // A slot named there that does not exist stalls decoding: critical. Named right: quiet.
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1, ghost'");
    primary.psql("SELECT pg_reload_conf()");
    let report = doctor(&pool).await;
    let f = the(&report, Code::SynchronizedStandbySlotUnusable);
    assert_eq!(f.severity, Severity::Critical);
    assert_eq!(f.subject.as_deref(), Some("ghost"));
    assert_eq!(
        report.with_code(Code::FailoverSlotUnguarded).count(),
        0,
        "{report:#?}"
    );
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
    primary.psql("SELECT pg_reload_conf()");
    let report = doctor(&pool).await;
    assert_eq!(
        report
            .with_code(Code::SynchronizedStandbySlotUnusable)
            .count(),
        0
    );
    assert_eq!(
        report.with_code(Code::FailoverSlotUnguarded).count(),
        0,
        "{report:#?}"
    );

    // The standby: what slot synchronization lacks, by name, and no slot here.
    let report = doctor(&standby_pool).await;
    eprintln!("standby, unconfigured: {:?}", codes(&report));
    let f = the(&report, Code::SlotSyncNotConfigured);
    assert!(f.message.contains("sync_replication_slots is off"), "{f:?}");
    assert!(f.message.contains("hot_standby_feedback is off"), "{f:?}");
    assert!(!f.message.contains("primary_slot_name"), "{f:?}");
    assert!(!f.message.contains("dbname"), "{f:?}");
    // Both slots' publications are here (the doctor finds a message-only publication before
    // any relay has read its slot): each is missing on this standby.
    let mut not_synced: Vec<_> = report
        .with_code(Code::WalSlotNotSynced)
        .map(|f| f.subject.clone().unwrap_or_default())
        .collect();
    not_synced.sort();
    assert_eq!(not_synced, vec!["pgbox_outbox", "plain"], "{report:#?}");
    let f = report
        .with_code(Code::WalSlotNotSynced)
        .find(|f| f.subject.as_deref() == Some(SLOT))
        .unwrap();
    assert!(f.message.contains("is not on this standby"), "{f:?}");

    // Configured: the slot arrives, synchronized and persistent; the doctor there says so,
    // and works there (before, its WAL slots query called pg_current_wal_lsn(), which fails
    // on a standby as soon as the database has a slot).
    standby.psql("ALTER SYSTEM SET hot_standby_feedback = on");
    standby.psql("ALTER SYSTEM SET sync_replication_slots = on");
    standby.psql("SELECT pg_reload_conf()");
    until_synced(&standby, &pool, Some(&relay)).await;
    let report = doctor(&standby_pool).await;
    eprintln!("standby, configured: {:?}", codes(&report));
    assert_eq!(
        report.with_code(Code::SlotSyncNotConfigured).count(),
        0,
        "{report:#?}"
    );
    // The plain slot is no failover slot: it never arrives here.
    assert_eq!(
        report
            .with_code(Code::WalSlotNotSynced)
            .map(|f| f.subject.as_deref())
            .collect::<Vec<_>>(),
        vec![Some("plain")],
        "{report:#?}"
    );
    let f = the(&report, Code::WalSlotFailoverReady);
    assert_eq!(f.subject.as_deref(), Some(SLOT));
    let status = WalSlot::new(SLOT)
        .unwrap()
        .status(&standby_pool)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (status.failover, status.synced),
        (Some(true), Some(true)),
        "{status:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_on_17_flags_a_standby_streaming_without_a_physical_slot() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), 8).await;
    prepare(&pool).await;
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    let _standby = standby(&primary, false, &[]).await;
    let report = doctor(&pool).await;
    eprintln!("17, standby without a slot: {:?}", codes(&report));
    let f = the(&report, Code::StandbyWithoutSlot);
    assert_eq!(f.severity, Severity::Warning);
    assert!(
        f.message.contains("without a physical replication slot"),
        "{f:?}"
    );
    assert!(f.advice.contains("primary_slot_name"), "{f:?}");
    let f = the(&report, Code::FailoverSlotUnguarded);
    assert!(f.advice.contains("<each standby's physical slot>"), "{f:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streaming_wal_relay_is_not_counted_as_a_standby() {
    support::init_tracing();
    let server = logical(17).await;
    let pool = pool_at(server.addr(), 8).await;
    prepare(&pool).await;
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    let shutdown = CancellationToken::new();
    let relay = relay(&pool);
    let task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    // The relay's walsender shows in pg_stat_replication once it reads.
    let started = Instant::now();
    let mut seq = 0;
    while scalar(&pool, "SELECT count(*) FROM pg_stat_replication").await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no walsender for the relay after 30 s"
        );
        place_order(&pool, 0, seq).await.unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = doctor(&pool).await;
    eprintln!("17, a streaming relay, no standby: {:?}", codes(&report));
    let f = the(&report, Code::ReplicationOk);
    assert!(f.message.contains("no standby streams"), "{f:?}");
    for code in [
        Code::AsyncReplication,
        Code::StandbyWithoutSlot,
        Code::FailoverSlotUnguarded,
    ] {
        assert_eq!(report.with_code(code).count(), 0, "{report:#?}");
    }
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_on_15_and_16_says_a_failover_loses_the_slot_on_both_sides() {
    support::init_tracing();
    for major in [15, 16] {
        doctor_says_a_failover_loses_the_slot(major).await;
    }
}

async fn doctor_says_a_failover_loses_the_slot(major: u32) {
    let primary = logical(major).await;
    let pool = pool_at(primary.addr(), 8).await;
    prepare(&pool).await;
    // No standby yet: nothing to fail over to, nothing said.
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    place_order(&pool, 0, 0).await.unwrap();
    relay(&pool).drain().await.unwrap();
    let report = doctor(&pool).await;
    assert_eq!(
        report.with_code(Code::WalSlotLostAtFailover).count(),
        0,
        "{report:#?}"
    );

    let standby = standby(&primary, false, &[]).await;
    let report = doctor(&pool).await;
    eprintln!("{major} primary: {:?}", codes(&report));
    let f = the(&report, Code::WalSlotLostAtFailover);
    assert_eq!(f.severity, Severity::Warning);
    assert!(
        f.message.contains(&format!(
            "PostgreSQL {major} keeps logical slots on the primary only"
        )),
        "{f:?}"
    );
    let standby_pool = pool_at(standby.addr(), 4).await;
    let report = doctor(&standby_pool).await;
    eprintln!("{major} standby: {:?}", codes(&report));
    let f = the(&report, Code::WalSlotLostAtFailover);
    assert!(f.message.contains("this standby has no copy"), "{f:?}");
    assert_eq!(report.with_code(Code::SlotSyncNotConfigured).count(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn on_18_an_idle_slot_timeout_below_the_tolerated_outage_is_a_warning_and_its_invalidation_is_typed()
 {
    support::init_tracing();
    let server = logical(18).await;
    let pool = pool_at(server.addr(), 4).await;
    prepare(&pool).await;
    let slot = WalSlot::new(SLOT).unwrap();
    slot.create(&pool).await.unwrap();
    assert_eq!(
        the(&doctor(&pool).await, Code::WalSlotsOk).severity,
        Severity::Ok
    );

    server.psql("ALTER SYSTEM SET idle_replication_slot_timeout = '1s'");
    server.psql("SELECT pg_reload_conf()");
    let report = doctor(&pool).await;
    let f = the(&report, Code::IdleSlotTimeout);
    assert_eq!(f.severity, Severity::Warning);
    assert!(
        f.message.contains("idle_replication_slot_timeout is 1.0s"),
        "{f:?}"
    );
    assert_eq!(f.details["idle_replication_slot_timeout_seconds"], 1);
    // Tolerating less than the timeout: no warning.
    let report = Doctor::new()
        .wal_relay_outage_tolerance(Duration::from_millis(500))
        .check(&pool)
        .await
        .unwrap();
    assert_eq!(
        report.with_code(Code::IdleSlotTimeout).count(),
        0,
        "{report:#?}"
    );

    // Nobody reads the slot for longer: the next checkpoint invalidates it.
    place_order(&pool, 0, 0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    server.psql("CHECKPOINT");
    let status = slot.status(&pool).await.unwrap().unwrap();
    assert_eq!(
        status.invalidation.as_ref().map(|i| i.as_str()),
        Some("idle_timeout"),
        "{status:?}"
    );
    assert_eq!(status.wal_status, "lost");
    let report = doctor(&pool).await;
    let f = the(&report, Code::WalSlotInvalidated);
    assert_eq!(f.details["invalidation_reason"], "idle_timeout");
    assert!(f.message.contains("idle_replication_slot_timeout"), "{f:?}");
    // The relay stops with a typed error: it never reads past what it lost.
    let err = relay(&pool).drain().await.unwrap_err();
    assert!(matches!(err, Error::WalSlot { .. }), "{err:?}");
    eprintln!("18, relay on an idle-timed-out slot: {err}");
}

/// What the producers were told committed.
struct Produced {
    committed: BTreeSet<(i32, i32)>,
    after: u64,
}

async fn producer(
    pool: PgPool,
    id: i32,
    stop: CancellationToken,
    failed_over: Arc<AtomicU64>,
) -> Produced {
    let mut produced = Produced {
        committed: BTreeSet::new(),
        after: 0,
    };
    let mut seq = 0;
    while !stop.is_cancelled() {
        let started = Instant::now();
        loop {
            match place_order(&pool, id, seq).await {
                Ok(_) => {
                    produced.committed.insert((id, seq));
                    if failed_over.load(Ordering::SeqCst) == 1 {
                        produced.after += 1;
                    }
                    break;
                }
                Err(e) => {
                    assert!(e.is_retryable(), "producer {id}: not retryable: {e}");
                    assert!(
                        started.elapsed() < Duration::from_secs(30),
                        "producer {id}: order {seq} not placed within 30 s: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        seq += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    produced
}

#[tokio::test(flavor = "multi_thread")]
async fn on_17_a_failover_slot_survives_a_promotion_under_load_with_nothing_lost_or_doubled() {
    promotion_under_load(17).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_18_a_failover_slot_survives_a_promotion_under_load_with_nothing_lost_or_doubled() {
    promotion_under_load(18).await;
}

/// A primary of `major` with a failover slot and a synchronous standby set up for slot
/// synchronization; WAL producers, a WAL relay into the built-in queue and consumers through
/// the inbox; the primary killed, the standby promoted, every client moved to it.
async fn promotion_under_load(major: u32) {
    support::init_tracing();
    let primary = logical(major).await;
    let proxy = Proxy::start(primary.addr()).await;
    let pool = pool_at(proxy.addr(), 16).await;
    prepare(&pool).await;
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    let standby = standby(&primary, true, SYNCING).await;
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
    let standby_pool = pool_at(standby.addr(), 4).await;

    let shutdown = CancellationToken::new();
    let relay = relay(&pool);
    // A first read claims the slot; the copy on the standby becomes persistent once the
    // primary's slot moves.
    until_synced(&standby, &pool, Some(&relay)).await;
    let report = doctor(&pool).await;
    eprintln!("primary before: {:?}", codes(&report));
    for code in [
        Code::WalSlotNotFailover,
        Code::FailoverSlotUnguarded,
        Code::SynchronizedStandbySlotUnusable,
        Code::StandbyWithoutSlot,
    ] {
        assert_eq!(report.with_code(code).count(), 0, "{report:#?}");
    }
    let report = doctor(&standby_pool).await;
    eprintln!("standby before: {:?}", codes(&report));
    the(&report, Code::WalSlotFailoverReady);

    let relay_task = tokio::spawn({
        let s = shutdown.clone();
        async move { relay.run(s).await }
    });
    let queue = PgQueue::new(pool.clone());
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let consumer = Consumer::builder(
            pool.clone(),
            queue.clone(),
            TOPIC,
            Inbox::new("fulfilment").unwrap(),
        )
        .poll_interval(Duration::from_millis(50))
        .backoff(backoff())
        .visibility_timeout(Duration::from_secs(3))
        .max_deliveries(1000)
        .concurrency(4)
        .build()
        .unwrap();
        let s = shutdown.clone();
        consumers.push(tokio::spawn(async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut HandlerConnection<'_>| {
                        let body: serde_json::Value = serde_json::from_slice(&e.payload)
                            .map_err(|e| Error::InvalidConfig(e.to_string()))?;
                        sqlx::query(
                            "INSERT INTO effects (producer, seq, message_id) VALUES ($1, $2, $3)",
                        )
                        .bind(body["producer"].as_i64().unwrap() as i32)
                        .bind(body["seq"].as_i64().unwrap() as i32)
                        .bind(e.id)
                        .execute(&mut *conn)
                        .await?;
                        Ok::<_, Error>(())
                    },
                    s,
                )
                .await
        }));
    }
    let stop_producing = CancellationToken::new();
    let failed_over = Arc::new(AtomicU64::new(0));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|id| {
            tokio::spawn(producer(
                pool.clone(),
                id,
                stop_producing.clone(),
                failed_over.clone(),
            ))
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(3000)).await;
    let killed = Instant::now();
    let synced_lsn = standby.psql(&format!(
        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
    ));
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        standby.promote();
    });
    failed_over.store(1, Ordering::SeqCst);
    proxy.retarget(standby.addr());
    let promoted_in = killed.elapsed();
    tokio::time::sleep(Duration::from_millis(3000)).await;
    stop_producing.cancel();
    let mut committed = BTreeSet::new();
    let mut after = 0;
    for p in producers {
        let p = p.await.unwrap();
        committed.extend(p.committed);
        after += p.after;
    }
    assert!(after > 0, "no order placed after the promotion");

    // Every order a producer was told committed takes effect, on the promoted server.
    let started = Instant::now();
    loop {
        let effects: BTreeSet<(i32, i32)> =
            sqlx::query_as("SELECT DISTINCT producer, seq FROM effects")
                .fetch_all(&pool)
                .await
                .unwrap()
                .into_iter()
                .collect();
        let missing: Vec<_> = committed
            .iter()
            .filter(|o| o.0 < PRODUCERS && !effects.contains(o))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} of {} committed orders never took effect after the failover (lost), e.g. {:?}",
            missing.len(),
            committed.len(),
            &missing[..missing.len().min(10)]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    relay_task.await.unwrap().unwrap();
    let mut duplicates = 0;
    for c in consumers {
        let stats = c.await.unwrap().unwrap();
        assert_eq!(stats.dead_lettered, 0, "{stats:?}");
        duplicates += stats.duplicates;
    }
    let doubled = scalar(
        &pool,
        "SELECT count(*) FROM (SELECT 1 FROM effects GROUP BY producer, seq HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(doubled, 0, "an order took effect twice");
    let orders = scalar(&pool, "SELECT count(*) FROM orders WHERE producer < 3").await;
    let lost = committed.len() as i64 - orders;
    assert_eq!(lost, 0, "committed orders missing on the promoted standby");
    let status = WalSlot::new(SLOT)
        .unwrap()
        .status(&pool)
        .await
        .unwrap()
        .unwrap();
    eprintln!(
        "{major} failover slot: {} orders committed ({after} after the promotion), 0 lost, 0 doubled, \
         {duplicates} redeliveries absorbed by the inbox; promoted {:.0} ms after the kill; the \
         standby's copy stood at {synced_lsn} when the primary died; slot on the new primary: \
         {status:?}",
        committed.len(),
        promoted_in.as_secs_f64() * 1000.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn on_15_the_promoted_standby_has_no_slot_and_the_relay_says_so() {
    support::init_tracing();
    let primary = logical(15).await;
    let proxy = Proxy::start(primary.addr()).await;
    let pool = pool_at(proxy.addr(), 8).await;
    prepare(&pool).await;
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    let standby = standby(&primary, true, &[]).await;
    // Published before the failover: fine. Emitted after the relay's last read: stranded.
    for seq in 0..10 {
        place_order(&pool, 0, seq).await.unwrap();
    }
    let published = relay(&pool).drain().await.unwrap();
    assert_eq!(published.published, 10, "{published:?}");
    for seq in 10..25 {
        place_order(&pool, 0, seq).await.unwrap();
    }
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        standby.promote();
    });
    proxy.retarget(standby.addr());
    // The orders are there (synchronous replication); the slot is not.
    assert_eq!(scalar(&pool, "SELECT count(*) FROM orders").await, 25);
    assert!(
        WalSlot::new(SLOT)
            .unwrap()
            .status(&pool)
            .await
            .unwrap()
            .is_none()
    );
    let err = relay(&pool).drain().await.unwrap_err();
    let Error::WalSlot { slot, reason } = &err else {
        panic!("not a WalSlot error: {err:?}")
    };
    assert_eq!(slot, SLOT);
    assert!(reason.contains("does not exist"), "{reason}");
    eprintln!(
        "15 after a promotion: 15 orders committed whose messages no slot holds; relay: {err}"
    );
}
