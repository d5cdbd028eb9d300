//! Attack on failover slots and the doctor's slot checks (issue 35, part 2/4): `WalSlot::create`
//! / `failover` / `status`, and the doctor's WAL-slot and replication checks, on private
//! PostgreSQL 17 clusters (never the shared server).
//!
//! Each `finding_*` test fails on the code it was written against (ignored with the finding's
//! number until it is fixed); each `held_*` test is an attack that held.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pgbox::doctor::{Code, Doctor, Report};
use pgbox::transport::PgQueue;
use pgbox::{Error, Message, Migrator, Outbox, OutboxMode, WalRelay, WalSlot};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Executor, PgPool};
use support::cluster::Cluster;

const SLOT: &str = "pgbox_outbox";
/// The standby's physical slot on the primary.
const STANDBY_SLOT: &str = "standby1";

fn options(addr: SocketAddr, database: &str, user: &str) -> PgConnectOptions {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(addr.port())
        .username(user)
        .database(database)
        .ssl_mode(PgSslMode::Disable)
}

async fn pool_as(addr: SocketAddr, database: &str, user: &str, connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options(addr, database, user))
        .await
        .unwrap()
}

async fn pool_at(addr: SocketAddr, database: &str) -> PgPool {
    pool_as(addr, database, "postgres", 4).await
}

/// `wal_level = logical` on PostgreSQL `major`, started off the runtime's threads.
async fn logical(major: u32) -> Cluster {
    tokio::task::spawn_blocking(move || Cluster::start_logical_version(major))
        .await
        .unwrap()
}

/// A standby of `primary` with `settings`, started off the runtime's threads.
async fn standby(primary: &Cluster, settings: &[(&str, &str)]) -> Cluster {
    tokio::task::block_in_place(|| Cluster::standby_with(primary, false, settings))
}

/// What slot synchronization needs on a standby (17+).
const SYNCING: &[(&str, &str)] = &[
    ("primary_slot_name", STANDBY_SLOT),
    ("hot_standby_feedback", "on"),
    ("sync_replication_slots", "on"),
];

fn relay(pool: &PgPool) -> WalRelay<PgQueue> {
    WalRelay::builder(
        pool.clone(),
        WalSlot::new(SLOT).unwrap(),
        PgQueue::new(pool.clone()),
    )
    .poll_interval(Duration::from_millis(50))
    .build()
    .unwrap()
}

/// One message into the WAL, in its own transaction.
async fn emit(pool: &PgPool, n: i64) {
    let mut tx = pool.begin().await.unwrap();
    Outbox::new()
        .mode(OutboxMode::Wal)
        .enqueue(
            &mut tx,
            Message::json("orders", &serde_json::json!({ "n": n })).unwrap(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

fn codes(report: &Report) -> Vec<String> {
    report
        .findings
        .iter()
        .map(|f| format!("{} {}", f.severity, f.code))
        .collect()
}

/// Waits until `standby` holds a synchronized, persistent copy of [`SLOT`], emitting and
/// relaying a message per try on `primary` (synchronization follows the primary's slot).
async fn until_synced(standby: &Cluster, primary: &PgPool, relay: &WalRelay<PgQueue>) {
    let started = Instant::now();
    let mut n = 1_000_000;
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
            "slot {SLOT} not synchronized after 60 s; standby log:\n{}",
            standby.log()
        );
        emit(primary, n).await;
        n += 1;
        relay.drain().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The printed command of an advice (`psql "…" -c '…'`), up to the text after it.
fn printed_psql_command(advice: &str) -> String {
    // The conninfo argument is quoted for the shell, in double or (safer) single quotes.
    let start = advice
        .find("psql \"")
        .or_else(|| advice.find("psql '"))
        .expect("a psql command in the advice");
    let rest = &advice[start..];
    let end = rest
        .find(" (as a role with REPLICATION)")
        .expect("the end of the psql command");
    rest[..end].to_owned()
}

/// Finding 1. The advice for turning failover on (in `WalSlot::create`'s error and warning,
/// and the doctor's `wal_slot_not_failover`) prints `psql "dbname=<db> replication=database"`
/// with the database name pasted in unquoted: a name with a space breaks the command, one
/// with `$(…)` runs a command in the operator's shell. Run verbatim with `sh -c` (the way an
/// operator pastes it), it must turn failover on for the slot and run nothing else.
#[tokio::test(flavor = "multi_thread")]
async fn finding_the_enable_failover_advice_runs_shell_code_from_a_database_name() {
    support::init_tracing();
    let primary = logical(17).await;
    let marker = std::env::temp_dir().join(format!("pgbox_a3_{}", uuid::Uuid::now_v7().simple()));
    let marker_text = marker.to_str().unwrap().to_owned();
    // A legal database name (63 bytes at most) an operator could have.
    let database = format!("shop db$(touch {marker_text})");
    assert!(database.len() <= 63, "{database}");
    let admin = pool_at(primary.addr(), "postgres").await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE \"{}\"",
            database.replace('"', "\"\"")
        )))
        .await
        .unwrap();
    let pool = pool_at(primary.addr(), &database).await;

    let plain = WalSlot::new("plain").unwrap().failover(false);
    plain.create(&pool).await.unwrap();
    let err = WalSlot::new("plain")
        .unwrap()
        .failover(true)
        .create(&pool)
        .await
        .unwrap_err();
    let Error::WalSlot { reason, .. } = &err else {
        panic!("not a WalSlot error: {err:?}")
    };
    let command = printed_psql_command(reason);
    eprintln!("printed: {command}");
    // The doctor prints the same command (a physical slot is a standby to fail over to),
    // asked while the slot still has no failover (the printed command turns it on).
    pgbox::migrate(&pool).await.unwrap();
    pool.execute("SELECT pg_create_physical_replication_slot('standby1')")
        .await
        .unwrap();
    let report = Doctor::new().check(&pool).await.unwrap();
    let doctor_prints: Vec<_> = report
        .with_code(Code::WalSlotNotFailover)
        .map(|f| printed_psql_command(&f.advice))
        .collect();
    assert_eq!(doctor_prints, vec![command.clone()], "{report:#?}");
    let out = std::process::Command::new("sh")
        .args(["-c", &command])
        .env("PGHOST", "127.0.0.1")
        .env("PGPORT", primary.port().to_string())
        .env("PGUSER", "postgres")
        .output()
        .unwrap();
    let ran_code = marker.exists();
    let _ = std::fs::remove_file(&marker);
    let failover = plain.status(&pool).await.unwrap().unwrap().failover;
    assert!(
        !ran_code && out.status.success() && failover == Some(true),
        "the printed command {command:?}, pasted into a shell: ran the database name's \
         $(touch …): {ran_code}; psql exit {:?}, stderr {:?}; failover afterwards {failover:?}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The same advice for an ordinary database name works as printed (the class held there).
#[tokio::test(flavor = "multi_thread")]
async fn held_the_enable_failover_advice_works_as_printed_for_a_plain_database_name() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    let plain = WalSlot::new("plain").unwrap().failover(false);
    plain.create(&pool).await.unwrap();
    let err = WalSlot::new("plain")
        .unwrap()
        .failover(true)
        .create(&pool)
        .await
        .unwrap_err();
    let Error::WalSlot { reason, .. } = &err else {
        panic!("not a WalSlot error: {err:?}")
    };
    let command = printed_psql_command(reason);
    let out = std::process::Command::new("sh")
        .args(["-c", &command])
        .env("PGHOST", "127.0.0.1")
        .env("PGPORT", primary.port().to_string())
        .env("PGUSER", "postgres")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{command}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        plain.status(&pool).await.unwrap().unwrap().failover,
        Some(true)
    );
}

/// Finding 2. Two services on one cluster, each in its own database with the default slot
/// name: the second `WalSlot::create` finds the first database's slot by name
/// (`pg_replication_slots` is cluster-wide), says Ok and creates nothing; its database has
/// no slot, and its relay cannot read (the slot "was not created in this database").
#[tokio::test(flavor = "multi_thread")]
async fn finding_create_says_ok_for_a_slot_of_the_same_name_in_another_database() {
    support::init_tracing();
    let primary = logical(17).await;
    let admin = pool_at(primary.addr(), "postgres").await;
    admin.execute("CREATE DATABASE app_a").await.unwrap();
    admin.execute("CREATE DATABASE app_b").await.unwrap();
    let a = pool_at(primary.addr(), "app_a").await;
    let b = pool_at(primary.addr(), "app_b").await;
    pgbox::migrate(&a).await.unwrap();
    pgbox::migrate(&b).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&a).await.unwrap();

    let created = WalSlot::new(SLOT).unwrap().create(&b).await;
    let in_b: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_replication_slots \
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(SLOT)
    .fetch_one(&b)
    .await
    .unwrap();
    let drained = match &created {
        Ok(()) => {
            emit(&b, 1).await;
            Some(format!(
                "{:?}",
                relay(&b).drain().await.map(|r| r.published)
            ))
        }
        Err(_) => None,
    };
    assert!(
        created.is_err() || in_b == 1,
        "create in app_b returned {created:?}, yet app_b has {in_b} slot {SLOT} (the one \
         there is app_a's); the relay of app_b then: {drained:?}"
    );
}

/// Finding 3. `WalSlot::create` is idempotent one at a time, but two services starting
/// together (each calling it, as the README's start-up does) race between "does it exist"
/// and "create it": the loser gets a raw database error (duplicate publication or "replication
/// slot already exists") instead of Ok.
#[tokio::test(flavor = "multi_thread")]
async fn finding_create_racing_itself_fails_instead_of_finding_the_slot() {
    support::init_tracing();
    let primary = logical(17).await;
    let one = pool_at(primary.addr(), "postgres").await;
    let two = pool_at(primary.addr(), "postgres").await;
    let rounds = 40;
    let mut failures = Vec::new();
    for round in 0..rounds {
        let name = format!("race_{round}");
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
        let run = |pool: PgPool, barrier: std::sync::Arc<tokio::sync::Barrier>| {
            let slot = WalSlot::new(&name).unwrap();
            tokio::spawn(async move {
                // Both connections open before the start line.
                let _warm = pool.acquire().await.unwrap();
                drop(_warm);
                barrier.wait().await;
                slot.create(&pool).await
            })
        };
        let a = run(one.clone(), barrier.clone());
        let b = run(two.clone(), barrier);
        for result in [a.await.unwrap(), b.await.unwrap()] {
            if let Err(e) = result {
                failures.push(format!("round {round}: {e}"));
            }
        }
        // max_replication_slots is 10: each round leaves none behind.
        WalSlot::new(&name).unwrap().drop(&one).await.unwrap();
    }
    assert!(
        failures.is_empty(),
        "{} of {} concurrent creates failed: {failures:#?}",
        failures.len(),
        rounds * 2
    );
}

/// Finding 4. `synchronized_standby_slots = 'STANDBY1'` is accepted by PostgreSQL and means
/// `standby1` (the list is split as identifiers: unquoted names are folded to lower case), so
/// the failover slot is guarded and decodes while that standby streams. The doctor compares
/// the raw text: it reports the streaming standby's slot as not named
/// (`failover_slot_unguarded`) and `STANDBY1` as a missing slot that stalls decoding
/// (`synchronized_standby_slot_unusable`, critical).
#[tokio::test(flavor = "multi_thread")]
async fn finding_doctor_misreads_synchronized_standby_slots_written_in_upper_case() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    let _standby = standby(&primary, SYNCING).await;
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'STANDBY1'");
    primary.psql("SELECT pg_reload_conf()");
    primary.wait_for("SHOW synchronized_standby_slots", "STANDBY1");

    // The server's own reading: the failover slot decodes (a slot the list names that does
    // not exist or does not stream makes the read wait, here past a 10 s statement timeout).
    emit(&pool, 1).await;
    let mut tx = pool.begin().await.unwrap();
    tx.execute("SET LOCAL statement_timeout = '10s'")
        .await
        .unwrap();
    let decoded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
           'proto_version', '1', 'publication_names', $1, 'messages', 'true')",
    )
    .bind(SLOT)
    .fetch_one(&mut *tx)
    .await
    .expect("the server reads 'STANDBY1' as the streaming standby1: decoding does not wait");
    tx.commit().await.unwrap();
    assert!(decoded > 0);

    let report = Doctor::new().check(&pool).await.unwrap();
    eprintln!("{:?}", codes(&report));
    let false_alarms: Vec<_> = report
        .findings
        .iter()
        .filter(|f| {
            f.code == Code::SynchronizedStandbySlotUnusable || f.code == Code::FailoverSlotUnguarded
        })
        .map(|f| format!("{} {}: {}", f.severity, f.code, f.message))
        .collect();
    assert!(
        false_alarms.is_empty(),
        "synchronized_standby_slots = 'STANDBY1' guards standby1 (decoding proceeds), yet the \
         doctor says: {false_alarms:#?}"
    );
}

/// Finding 5. On a 17 standby whose `primary_conninfo` names no `dbname` (slot
/// synchronization stops; the copy it made earlier stays `synced`, persistent, and goes
/// stale), a doctor running as a role without `pg_read_all_settings` cannot read
/// `primary_conninfo`: it says nothing about it and reports the slot
/// `wal_slot_failover_ready` (ok), where the superuser's run says `slot_sync_not_configured`.
#[tokio::test(flavor = "multi_thread")]
async fn finding_doctor_without_pg_read_all_settings_says_failover_ready_on_a_standby_that_cannot_sync()
 {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pool.execute("CREATE ROLE app LOGIN").await.unwrap();
    Migrator::new()
        .grant_to("app")
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    emit(&pool, 0).await;
    let relay = relay(&pool);
    relay.drain().await.unwrap();
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
    let standby = standby(&primary, SYNCING).await;
    until_synced(&standby, &pool, &relay).await;

    // primary_conninfo loses its dbname (an operator's edit, a tool that rewrites it).
    standby.psql(&format!(
        "ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port={} user=postgres \
         application_name=standby_nodb'",
        primary.port()
    ));
    standby.psql("SELECT pg_reload_conf()");
    primary.wait_for(
        "SELECT count(*) FROM pg_stat_replication \
         WHERE application_name = 'standby_nodb' AND state = 'streaming'",
        "1",
    );

    let as_superuser = Doctor::new()
        .check(&pool_at(standby.addr(), "postgres").await)
        .await
        .unwrap();
    eprintln!("superuser: {:?}", codes(&as_superuser));
    let f: Vec<_> = as_superuser
        .with_code(Code::SlotSyncNotConfigured)
        .collect();
    assert_eq!(f.len(), 1, "{as_superuser:#?}");
    assert!(f[0].message.contains("dbname"), "{:?}", f[0]);

    let app = pool_as(standby.addr(), "postgres", "app", 2).await;
    let as_app = Doctor::new().check(&app).await.unwrap();
    eprintln!("app: {:?}", codes(&as_app));
    let warned = as_app.with_code(Code::SlotSyncNotConfigured).count();
    let ready: Vec<_> = as_app
        .with_code(Code::WalSlotFailoverReady)
        .map(|f| f.message.clone())
        .collect();
    assert!(
        warned == 1 || ready.is_empty(),
        "as a role that cannot read primary_conninfo the doctor neither warns nor says it \
         could not check: {ready:?}; all findings: {:?}",
        codes(&as_app)
    );
}

/// Finding 6. The doctor finds the WAL outbox's slots on a standby by the comment the relay's
/// first read writes on the publication. Between `pgbox wal create-slot` (or
/// `WalSlot::create`) and that first read, a 17 standby that synchronizes nothing (no
/// `sync_replication_slots`, no physical slot) gets `wal_slots_ok` ("the WAL outbox is not in
/// use") and no `slot_sync_not_configured`, while producers may already emit into the
/// primary's slot: promoted then, their messages are gone. The publication of the slot's name
/// is on the standby from the start.
#[tokio::test(flavor = "multi_thread")]
async fn finding_standby_doctor_is_silent_before_the_relays_first_read() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    // Producers start before the relay does.
    emit(&pool, 1).await;
    let standby = standby(&primary, &[]).await;
    let standby_pool = pool_at(standby.addr(), "postgres").await;
    // The publication is there (it replicated with the backup).
    let publication: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_publication WHERE pubname = $1")
            .bind(SLOT)
            .fetch_one(&standby_pool)
            .await
            .unwrap();
    assert_eq!(publication, 1);
    let report = Doctor::new().check(&standby_pool).await.unwrap();
    eprintln!(
        "standby before the relay's first read: {:?}",
        codes(&report)
    );
    let said = report.with_code(Code::SlotSyncNotConfigured).count()
        + report.with_code(Code::WalSlotNotSynced).count();
    let ok: Vec<_> = report
        .with_code(Code::WalSlotsOk)
        .map(|f| f.message.clone())
        .collect();
    assert!(
        said > 0,
        "primary holds failover slot {SLOT} with an unpublished message; this standby \
         synchronizes nothing, and the doctor here says: {ok:?} ({:?})",
        codes(&report)
    );
}

/// The doctor's failover checks on a 17 primary, run as the application role (no
/// `pg_read_all_stats`, no `pg_read_all_settings`), find what the superuser's run finds: a
/// plain slot lost at failover, a standby streaming without a physical slot, and the list
/// not naming it.
#[tokio::test(flavor = "multi_thread")]
async fn held_doctor_on_a_17_primary_as_the_application_role_finds_what_the_superuser_finds() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pool.execute("CREATE ROLE app LOGIN").await.unwrap();
    Migrator::new()
        .grant_to("app")
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    WalSlot::new("plain")
        .unwrap()
        .failover(false)
        .create(&pool)
        .await
        .unwrap();
    emit(&pool, 0).await;
    relay(&pool).drain().await.unwrap();
    let _synced = standby(&primary, SYNCING).await;
    let _bare = standby(&primary, &[]).await;
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
    let slot_codes = |report: &Report| {
        let mut v: Vec<String> = report
            .findings
            .iter()
            .filter(|f| {
                [
                    Code::WalSlotNotFailover,
                    Code::FailoverSlotUnguarded,
                    Code::SynchronizedStandbySlotUnusable,
                    Code::StandbyWithoutSlot,
                    Code::WalSlotsOk,
                    Code::WalSlotBehind,
                    Code::WalSlotInvalidated,
                ]
                .contains(&f.code)
            })
            .map(|f| format!("{} {} {:?}", f.severity, f.code, f.subject))
            .collect();
        v.sort();
        v
    };
    let as_superuser = Doctor::new().check(&pool).await.unwrap();
    let app = pool_as(primary.addr(), "postgres", "app", 2).await;
    let as_app = Doctor::new().check(&app).await.unwrap();
    eprintln!(
        "superuser: {:?}\napp: {:?}",
        codes(&as_superuser),
        codes(&as_app)
    );
    let expected = slot_codes(&as_superuser);
    assert!(
        expected.iter().any(|c| c.contains("wal_slot_not_failover"))
            && expected.iter().any(|c| c.contains("standby_without_slot")),
        "{expected:?}"
    );
    assert_eq!(slot_codes(&as_app), expected);
}

/// Finding 7. `WalSlot::create` (and `pgbox wal create-slot`, default `auto`) against a 17
/// standby that has no synchronized copy yet makes a *local* plain logical slot there (the
/// publication replicated, so nothing stops it): `failover(true)` is refused on a standby, the
/// default is not. That local slot has the primary's slot's name, so slot synchronization
/// then refuses to sync it ("same name slot … already exists on the standby"): the standby
/// never gets the primary's failover slot, and promoted, the relay reads the local slot,
/// which starts where it was created, past what the primary's relay had not yet published.
#[tokio::test(flavor = "multi_thread")]
async fn finding_create_on_a_17_standby_makes_a_local_slot_that_blocks_synchronization() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    emit(&pool, 0).await;
    relay(&pool).drain().await.unwrap();
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
    // Set up for synchronization except the switch itself.
    let standby = standby(
        &primary,
        &[
            ("primary_slot_name", STANDBY_SLOT),
            ("hot_standby_feedback", "on"),
        ],
    )
    .await;
    let standby_pool = pool_at(standby.addr(), "postgres").await;
    // Committed on the primary, replayed on the standby, not yet published by the relay.
    emit(&pool, 1).await;
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    standby.wait_for(&format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'"), "t");

    // A logical slot created on a standby waits for a running-transactions record from the
    // primary: log them while create runs.
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
    let created = tokio::time::timeout(
        Duration::from_secs(20),
        WalSlot::new(SLOT).unwrap().create(&standby_pool),
    )
    .await
    .expect("create on the standby did not return within 20 s");
    logging.abort();
    let status = WalSlot::new(SLOT)
        .unwrap()
        .status(&standby_pool)
        .await
        .unwrap();
    let local = status
        .as_ref()
        .is_some_and(|s| s.synced == Some(false) && !s.temporary);

    // What becomes of synchronization then.
    let mut sync_error = String::new();
    if local {
        standby.psql("ALTER SYSTEM SET sync_replication_slots = on");
        standby.psql("SELECT pg_reload_conf()");
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Some(line) = standby
                .log()
                .lines()
                .find(|l| l.contains("already exists on the standby"))
            {
                sync_error = line.to_owned();
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    // Promoted: what the relay there publishes of the message the old primary's relay never
    // published.
    let mut after_promotion = None;
    if local {
        tokio::task::block_in_place(|| standby.promote());
        after_promotion = Some(format!(
            "{:?}",
            relay(&standby_pool).drain().await.map(|r| r.published)
        ));
    }
    assert!(
        !local,
        "create on the standby returned {created:?} and left a local, non-synchronized slot \
         {SLOT} there ({status:?}); slot synchronization then says: {sync_error:?}; promoted, \
         the relay there published {after_promotion:?} messages (1 was committed and \
         unpublished before the promotion)"
    );
}

/// A logical slot on a standby invalidated by a recovery conflict (the primary restarted with
/// `wal_level = replica`): `WalSlot::status` there types it (16: `conflicting` →
/// `RecoveryConflict`; 17: `wal_level_insufficient`), and the doctor there reports
/// `wal_slot_invalidated` (critical).
#[tokio::test(flavor = "multi_thread")]
async fn held_a_standby_slot_invalidated_by_the_primarys_wal_level_is_typed_on_16_and_17() {
    support::init_tracing();
    for (major, expected) in [(16, "recovery_conflict"), (17, "wal_level_insufficient")] {
        let primary = logical(major).await;
        let pool = pool_at(primary.addr(), "postgres").await;
        pgbox::migrate(&pool).await.unwrap();
        pool.execute(sqlx::AssertSqlSafe(format!("CREATE PUBLICATION {SLOT}")))
            .await
            .unwrap();
        let standby = standby(&primary, &[("hot_standby_feedback", "off")]).await;
        let standby_pool = pool_at(standby.addr(), "postgres").await;
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
        let slot = WalSlot::new(SLOT).unwrap();
        assert_eq!(
            slot.status(&standby_pool)
                .await
                .unwrap()
                .unwrap()
                .invalidation,
            None
        );
        // The primary goes back to wal_level = replica (it has no logical slot of its own).
        tokio::task::block_in_place(|| {
            primary.psql("ALTER SYSTEM SET wal_level = replica");
            primary.pg_ctl(&["-m", "fast", "restart"]);
        });
        let started = Instant::now();
        let status = loop {
            let status = slot.status(&standby_pool).await.unwrap().unwrap();
            if status.invalidation.is_some() {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{major}: not invalidated after 30 s: {status:?}; standby log:\n{}",
                standby.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(
            status.invalidation.as_ref().map(|i| i.as_str()),
            Some(expected),
            "{major}: {status:?}"
        );
        assert_eq!(status.wal_status, "lost", "{major}: {status:?}");
        let report = Doctor::new().check(&standby_pool).await.unwrap();
        eprintln!("{major} standby: {:?}", codes(&report));
        let found: Vec<_> = report.with_code(Code::WalSlotInvalidated).collect();
        assert_eq!(found.len(), 1, "{major}: {report:#?}");
        assert_eq!(found[0].subject.as_deref(), Some(SLOT));
    }
}

/// 17, on the primary: a slot that held more than `max_slot_wal_keep_size` is invalidated
/// (`wal_removed`); `WalSlot::status` types it, the doctor says `wal_slot_invalidated`, and a
/// failover(true) `create` of the same name does not call it fine.
#[tokio::test(flavor = "multi_thread")]
async fn held_a_17_slot_invalidated_for_removed_wal_is_typed() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    let slot = WalSlot::new(SLOT).unwrap();
    slot.create(&pool).await.unwrap();
    primary.psql("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'");
    primary.psql("SELECT pg_reload_conf()");
    let started = Instant::now();
    let status = loop {
        emit(&pool, 1).await;
        primary.psql("SELECT pg_switch_wal()");
        emit(&pool, 2).await;
        primary.psql("SELECT pg_switch_wal()");
        primary.psql("CHECKPOINT");
        let status = slot.status(&pool).await.unwrap().unwrap();
        if status.invalidation.is_some() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not invalidated after 60 s: {status:?}"
        );
    };
    assert_eq!(
        status.invalidation.as_ref().map(|i| i.as_str()),
        Some("wal_removed"),
        "{status:?}"
    );
    assert_eq!(status.failover, Some(true));
    let report = Doctor::new().check(&pool).await.unwrap();
    let found: Vec<_> = report.with_code(Code::WalSlotInvalidated).collect();
    assert_eq!(found.len(), 1, "{report:#?}");
    assert!(found[0].message.contains("wal_removed"), "{:?}", found[0]);
}

/// Finding 8. After a failover the promoted standby's copy of the slot is the new primary's
/// slot, and it keeps `synced = true` (as `WalSlotStatus::synced` documents). The doctor's
/// primary-side failover checks skip synced slots: on the promoted primary, with a new
/// standby streaming and `synchronized_standby_slots` empty, it says nothing
/// (`failover_slot_unguarded` is what the same setup gets on the original primary): after the
/// first failover, the next one is unguarded and the doctor is silent about it.
#[tokio::test(flavor = "multi_thread")]
async fn finding_doctor_on_a_promoted_primary_skips_its_failover_slot() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    emit(&pool, 0).await;
    let old_relay = relay(&pool);
    old_relay.drain().await.unwrap();
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
    let promoted = standby(&primary, SYNCING).await;
    until_synced(&promoted, &pool, &old_relay).await;
    drop(old_relay);
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        promoted.promote();
        // The promoted server's own standbys are not named (the copy of the old primary's
        // setting is dropped): the state the doctor must flag.
        promoted.psql("ALTER SYSTEM RESET synchronized_standby_slots");
        promoted.psql("SELECT pg_reload_conf()");
    });
    let new_pool = pool_at(promoted.addr(), "postgres").await;
    let status = WalSlot::new(SLOT)
        .unwrap()
        .status(&new_pool)
        .await
        .unwrap()
        .unwrap();
    // The relay reads on from the promoted server.
    emit(&new_pool, 1).await;
    relay(&new_pool).drain().await.unwrap();
    let _next = standby(&promoted, SYNCING).await;
    promoted.wait_for("SHOW synchronized_standby_slots", "");

    let report = Doctor::new().check(&new_pool).await.unwrap();
    eprintln!("promoted primary: {:?}", codes(&report));
    assert!(
        report.with_code(Code::FailoverSlotUnguarded).count() == 1,
        "promoted primary: a standby streams through {STANDBY_SLOT}, \
         synchronized_standby_slots is empty, the outbox slot is a failover slot ({status:?}), \
         yet the doctor says {:?}",
        codes(&report)
    );
}

/// Finding 2, other kinds: a physical slot, or a logical slot of another plugin, named like
/// the WAL outbox's slot: `create` says Ok and the relay cannot read what it "created".
#[tokio::test(flavor = "multi_thread")]
async fn finding_create_says_ok_for_a_same_named_slot_of_another_kind() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    pool.execute("SELECT pg_create_physical_replication_slot('outbox_physical', true)")
        .await
        .unwrap();
    pool.execute("SELECT pg_create_logical_replication_slot('outbox_decoding', 'test_decoding')")
        .await
        .unwrap();
    let mut problems = Vec::new();
    for name in ["outbox_physical", "outbox_decoding"] {
        let slot = WalSlot::new(name).unwrap();
        let created = slot.create(&pool).await;
        if created.is_ok() {
            emit(&pool, 1).await;
            let relayed = WalRelay::builder(pool.clone(), slot, PgQueue::new(pool.clone()))
                .build()
                .unwrap()
                .drain()
                .await
                .map(|r| r.published);
            if relayed.is_err() {
                problems.push(format!("{name}: create Ok, then the relay: {relayed:?}"));
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Finding 9. A standby whose slot synchronization stopped (here `sync_replication_slots`
/// turned off after the copy was made) keeps a synced, persistent copy that no longer moves.
/// The doctor there reports `slot_sync_not_configured` and, in the same report,
/// `wal_slot_failover_ready` ("synchronized here … may be a little behind"). Promoted, the
/// relay re-publishes everything since synchronization stopped: past the inbox's retention,
/// those copies are processed again.
#[tokio::test(flavor = "multi_thread")]
async fn finding_doctor_calls_a_copy_that_stopped_synchronizing_failover_ready() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    emit(&pool, 0).await;
    let old_relay = relay(&pool);
    old_relay.drain().await.unwrap();
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
    let standby = standby(&primary, SYNCING).await;
    until_synced(&standby, &pool, &old_relay).await;
    standby.psql("ALTER SYSTEM SET sync_replication_slots = off");
    standby.psql("SELECT pg_reload_conf()");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The primary's relay goes on publishing; the copy stays where it was.
    let messages = 50;
    for n in 0..messages {
        emit(&pool, n).await;
    }
    let published = old_relay.drain().await.unwrap().published;
    assert_eq!(published, messages as usize);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let standby_pool = pool_at(standby.addr(), "postgres").await;
    let report = Doctor::new().check(&standby_pool).await.unwrap();
    eprintln!("standby: {:?}", codes(&report));
    let ready: Vec<_> = report
        .with_code(Code::WalSlotFailoverReady)
        .map(|f| f.message.clone())
        .collect();

    drop(old_relay);
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        standby.promote();
        // Its copy of the old primary's synchronized_standby_slots names a slot it does not
        // have (finding 10): out of the way here.
        standby.psql("ALTER SYSTEM RESET synchronized_standby_slots");
        standby.psql("SELECT pg_reload_conf()");
    });
    standby.wait_for("SHOW synchronized_standby_slots", "");
    let republished = tokio::time::timeout(Duration::from_secs(60), relay(&standby_pool).drain())
        .await
        .map(|r| r.map(|r| r.published));
    assert!(
        ready.is_empty(),
        "the doctor on the standby says {ready:?} (with {:?}); promoted, the relay there \
         published again {republished:?} of the {messages} messages the old primary had \
         already published",
        codes(&report)
    );
}

/// Finding 10. `synchronized_standby_slots` naming a slot that does not exist stalls every
/// read of a failover slot (the doctor's own promise: `synchronized_standby_slot_unusable`,
/// critical). The doctor checks the list only while this server has a standby or a physical
/// slot, and only for failover slots that are not `synced`. Two ordinary ways to be outside
/// both: (a) the standby was decommissioned and its physical slot dropped, the setting left;
/// (b) a promotion: the promoted standby's configuration is a copy of the primary's (a base
/// backup copies `postgresql.auto.conf`), so it names its own physical slot on the old
/// primary, which it does not have, and its slot is `synced`. Either way the WAL relay
/// publishes nothing, with no end, and the doctor says `wal_slots_ok`.
#[tokio::test(flavor = "multi_thread")]
async fn finding_a_relay_stalled_by_synchronized_standby_slots_is_not_reported() {
    support::init_tracing();
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    emit(&pool, 0).await;
    let old_relay = relay(&pool);
    old_relay.drain().await.unwrap();
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
    let standby = standby(&primary, SYNCING).await;
    until_synced(&standby, &pool, &old_relay).await;
    drop(old_relay);
    let mut problems = Vec::new();

    // (b) The failover.
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        standby.promote();
    });
    let promoted = pool_at(standby.addr(), "postgres").await;
    let inherited: String =
        sqlx::query_scalar("SELECT current_setting('synchronized_standby_slots')")
            .fetch_one(&promoted)
            .await
            .unwrap();
    emit(&promoted, 1).await;
    let drained = tokio::time::timeout(Duration::from_secs(15), relay(&promoted).drain()).await;
    let report = Doctor::new().check(&promoted).await.unwrap();
    eprintln!("promoted: {:?}", codes(&report));
    if report
        .with_code(Code::SynchronizedStandbySlotUnusable)
        .count()
        == 0
    {
        problems.push(format!(
            "promoted server, synchronized_standby_slots = {inherited:?} (no such slot here): \
             relay drain after 15 s: {}; doctor: {:?}",
            if drained.is_err() {
                "still waiting".to_owned()
            } else {
                format!("{drained:?}")
            },
            codes(&report)
        ));
    }

    // (a) On a primary whose standby is gone: its physical slot dropped, the setting left.
    let primary = logical(17).await;
    let pool = pool_at(primary.addr(), "postgres").await;
    pgbox::migrate(&pool).await.unwrap();
    WalSlot::new(SLOT).unwrap().create(&pool).await.unwrap();
    primary.psql("SELECT pg_create_physical_replication_slot('gone')");
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'gone'");
    primary.psql("SELECT pg_reload_conf()");
    primary.psql("SELECT pg_drop_replication_slot('gone')");
    emit(&pool, 1).await;
    let drained = tokio::time::timeout(Duration::from_secs(15), relay(&pool).drain()).await;
    let report = Doctor::new().check(&pool).await.unwrap();
    eprintln!("decommissioned standby: {:?}", codes(&report));
    if report
        .with_code(Code::SynchronizedStandbySlotUnusable)
        .count()
        == 0
    {
        problems.push(format!(
            "primary, synchronized_standby_slots = 'gone' (dropped): relay drain after 15 s: \
             {}; doctor: {:?}",
            if drained.is_err() {
                "still waiting".to_owned()
            } else {
                format!("{drained:?}")
            },
            codes(&report)
        ));
    }
    assert!(problems.is_empty(), "{problems:#?}");
}
