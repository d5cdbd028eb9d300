//! The WAL outbox: producers emit logical-decoding messages in their transactions, the WAL
//! relay reads them from a replication slot. On a private cluster with `wal_level = logical`
//! (the shared server runs `replica`, and slots there would be ours to clean up).

mod support;

use std::time::Duration;

use pgbox::transport::PgQueue;
use pgbox::{Error, Message, Outbox, OutboxMode, Relay, WalRelay, WalSlot};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use support::cluster::Cluster;

async fn pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .unwrap()
}

async fn logical() -> (Cluster, PgPool) {
    let cluster = tokio::task::spawn_blocking(Cluster::start_logical)
        .await
        .unwrap();
    let pool = pool(&cluster.url("postgres")).await;
    pgbox::migrate(&pool).await.unwrap();
    (cluster, pool)
}

/// What the built-in queue received, in its order: (topic, payload).
async fn queued(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as::<_, (String, Vec<u8>)>("SELECT topic, payload FROM pgbox.queue ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(t, p)| (t, String::from_utf8(p).unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_arrive_whole_in_commit_order_rollbacks_never_and_table_mode_is_undisturbed() {
    let (_cluster, pool) = logical().await;
    let slot = WalSlot::new("pgbox_outbox").unwrap();
    slot.create(&pool).await.unwrap();
    slot.create(&pool).await.unwrap(); // idempotent
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let table = Outbox::new();

    // Rolled back: emits nothing.
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue(&mut tx, Message::bytes("wal", b"rolled-back".to_vec()))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // Oversized: refused before any SQL, the transaction stays usable.
    let mut tx = pool.begin().await.unwrap();
    let big = Message::bytes("wal", vec![0u8; pgbox::DEFAULT_MAX_MESSAGE_BYTES + 1]);
    assert!(matches!(
        wal.enqueue(&mut tx, big).await,
        Err(Error::TooLarge { .. })
    ));
    wal.enqueue(
        &mut tx,
        Message::bytes("wal", b"a1".to_vec()).ordering_key("a"),
    )
    .await
    .unwrap();
    table
        .enqueue(&mut tx, Message::bytes("table", b"t1".to_vec()))
        .await
        .unwrap();
    wal.enqueue(&mut tx, Message::bytes("wal", b"b1".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Two transactions whose commit order differs from their start order.
    let mut first = pool.begin().await.unwrap();
    let mut second = pool.begin().await.unwrap();
    wal.enqueue(
        &mut first,
        Message::bytes("wal", b"late".to_vec()).ordering_key("a"),
    )
    .await
    .unwrap();
    wal.enqueue(&mut second, Message::bytes("wal", b"early".to_vec()))
        .await
        .unwrap();
    second.commit().await.unwrap();
    first.commit().await.unwrap();
    // 10,000 messages in one transaction, in one emit.
    let mut tx = pool.begin().await.unwrap();
    let many = (0..10_000).map(|i| Message::bytes("many", format!("m{i}").into_bytes()));
    wal.enqueue_batch(&mut tx, many).await.unwrap();
    tx.commit().await.unwrap();

    let relay = WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
        .batch_size(100)
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 10_004, "{report:?}");
    assert_eq!(report.dead_lettered, 0);
    let got = queued(&pool).await;
    let wal_messages: Vec<&str> = got
        .iter()
        .filter(|(t, _)| t == "wal")
        .map(|(_, p)| p.as_str())
        .collect();
    assert_eq!(wal_messages, ["a1", "b1", "early", "late"], "commit order");
    let many: Vec<&str> = got
        .iter()
        .filter(|(t, _)| t == "many")
        .map(|(_, p)| p.as_str())
        .collect();
    assert_eq!(many.len(), 10_000, "the big transaction arrived whole");
    assert!(many.iter().enumerate().all(|(i, p)| *p == format!("m{i}")));
    assert!(got.iter().all(|(_, p)| p != "rolled-back"));
    // The table-mode message is the table relay's, untouched by the WAL relay.
    assert!(got.iter().all(|(t, _)| t != "table"));
    let in_table: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(in_table, 1);
    Relay::builder(pool.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap()
        .drain()
        .await
        .unwrap();
    assert_eq!(queued(&pool).await.len(), 10_005);
    // The WAL outbox leaves no row behind in the producer's tables.
    let dead_rows: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(n_dead_tup), 0)::int8 FROM pg_stat_user_tables WHERE relname = 'outbox'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(dead_rows <= 1, "{dead_rows}");

    // Nothing left: a second drain reads nothing, the slot holds no unpublished message.
    let again = relay.drain().await.unwrap();
    assert_eq!(again.read, 0);
    let status = slot.status(&pool).await.unwrap().unwrap();
    assert_eq!(status.wal_status, "reserved");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_reader_at_a_time_and_the_other_takes_over() {
    let (_cluster, pool) = logical().await;
    let slot = WalSlot::new("pgbox_outbox").unwrap();
    slot.create(&pool).await.unwrap();
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let build = || {
        WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
            .build()
            .unwrap()
    };
    let (first, second) = (build(), build());
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue(&mut tx, Message::bytes("wal", b"one".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let a = first.relay_once().await.unwrap();
    assert!(a.reader && a.published == 1, "{a:?}");
    let b = second.relay_once().await.unwrap();
    assert!(!b.reader && b.read == 0, "{b:?}");
    // The reader's session ends (what a SIGKILL does; the crash harness does it for real):
    // the other relay becomes the reader and goes on from the slot's position.
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue(&mut tx, Message::bytes("wal", b"two".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    pool.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_locks \
         WHERE locktype = 'advisory' AND classid = 1885499255 AND granted",
    )
    .await
    .unwrap();
    let mut took_over = None;
    for _ in 0..50 {
        let b = second.relay_once().await.unwrap();
        if b.reader {
            took_over = Some(b);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = took_over.expect("the second relay took over");
    assert_eq!(b.published, 1, "{b:?}");
    let got: Vec<String> = queued(&pool).await.into_iter().map(|(_, p)| p).collect();
    assert_eq!(got, ["one", "two"]);
    // The first relay finds out at its next round (its connection is gone), then waits.
    let _ = first.relay_once().await;
    let a = first.relay_once().await.unwrap();
    assert!(!a.reader, "{a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_under_a_running_relay_and_a_replica_server_are_typed_errors() {
    let (_cluster, pool) = logical().await;
    let slot = WalSlot::new("pgbox_outbox").unwrap();
    slot.create(&pool).await.unwrap();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap();
    relay.relay_once().await.unwrap();
    slot.drop(&pool).await.unwrap();
    let err = relay.relay_once().await.unwrap_err();
    match &err {
        Error::WalSlot { slot, reason } => {
            assert_eq!(slot, "pgbox_outbox");
            assert!(reason.contains("does not exist"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // Bad names never reach SQL.
    assert!(matches!(
        WalSlot::new("Bad-Name"),
        Err(Error::InvalidIdentifier { .. })
    ));

    // The shared server runs wal_level = replica: creating a slot there says what to set.
    let db = support::TestDb::migrated().await;
    let level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if level != "logical" {
        let err = WalSlot::new("pgbox_never")
            .unwrap()
            .create(&db.pool)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::WalLevel { actual } if *actual == level),
            "{err:?}"
        );
        assert!(err.to_string().contains("wal_level = logical"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_doctor_reports_a_slot_behind_and_an_invalidated_one_the_relay_says_so_typed() {
    let (cluster, pool) = logical().await;
    let slot = WalSlot::new("pgbox_outbox").unwrap();
    slot.create(&pool).await.unwrap();
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue(&mut tx, Message::bytes("wal", b"waiting".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // No relay reads it: the doctor sees what it retains and how old its oldest commit is.
    let report = pgbox::doctor::Doctor::new()
        .wal_slot_retained_warn(1)
        .xmin_age_warn(Duration::from_secs(1))
        .check(&pool)
        .await
        .unwrap();
    let behind: Vec<_> = report
        .with_code(pgbox::doctor::Code::WalSlotBehind)
        .collect();
    assert_eq!(behind.len(), 1, "{report:#?}");
    let age = behind[0].details["oldest_unpublished_commit_age_seconds"]
        .as_f64()
        .expect("the oldest commit's age");
    assert!(age >= 1.0, "{age}");
    assert!(behind[0].message.contains("pgbox_outbox"));

    // The WAL it needs is removed past max_slot_wal_keep_size: invalidated.
    cluster.psql("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'");
    cluster.psql("SELECT pg_reload_conf()");
    for _ in 0..4 {
        pool.execute(
            "CREATE TABLE IF NOT EXISTS wal_filler (x int); INSERT INTO wal_filler VALUES (1)",
        )
        .await
        .unwrap();
        pool.execute("SELECT pg_switch_wal()").await.unwrap();
    }
    pool.execute("CHECKPOINT").await.unwrap();
    let status = slot.status(&pool).await.unwrap().unwrap();
    assert_eq!(status.wal_status, "lost", "{status:?}");
    let report = pgbox::doctor::check(&pool, "pgbox").await.unwrap();
    assert_eq!(
        report
            .with_code(pgbox::doctor::Code::WalSlotInvalidated)
            .count(),
        1,
        "{report:#?}"
    );
    let relay = WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap();
    match relay.relay_once().await.unwrap_err() {
        Error::WalSlot { reason, .. } => assert!(reason.contains("invalidated"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_creates_shows_and_drops_the_slot() {
    let (cluster, _pool) = logical().await;
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgbox"))
            .args(args)
            .env("DATABASE_URL", cluster.url("postgres"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pgbox {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    cli(&["--json", "wal", "create-slot", "--slot", "orders_outbox"]);
    let status = cli(&["--json", "wal", "status", "--slot", "orders_outbox"]);
    assert_eq!(status["exists"], true, "{status}");
    assert_eq!(status["active"], false, "{status}");
    assert_eq!(status["wal_status"], "reserved", "{status}");
    cli(&["--json", "wal", "drop-slot", "--slot", "orders_outbox"]);
    let status = cli(&["--json", "wal", "status", "--slot", "orders_outbox"]);
    assert_eq!(status["exists"], false, "{status}");
}

/// PostgreSQL 15 keeps logical slots on the primary only: after a failover the promoted
/// standby has no slot. The relay says so (typed), a new slot is created there, and what was
/// emitted between the old slot's last advance and the failover is not published (it was
/// decoded only on the old primary): exactly the messages the README says are lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_the_slot_is_gone_typed_and_the_unpublished_tail_is_lost() {
    let primary = tokio::task::spawn_blocking(Cluster::start_logical)
        .await
        .unwrap();
    let primary_pool = pool(&primary.url("postgres")).await;
    pgbox::migrate(&primary_pool).await.unwrap();
    let slot = WalSlot::new("pgbox_outbox").unwrap();
    slot.create(&primary_pool).await.unwrap();
    let standby = {
        let p = &primary;
        tokio::task::block_in_place(|| Cluster::standby_of(p, true))
    };
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let emit = async |pool: &PgPool, text: &str| {
        let mut tx = pool.begin().await.unwrap();
        wal.enqueue(&mut tx, Message::bytes("wal", text.as_bytes().to_vec()))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    };
    emit(&primary_pool, "published").await;
    let relay = WalRelay::builder(
        primary_pool.clone(),
        slot.clone(),
        PgQueue::new(primary_pool.clone()),
    )
    .build()
    .unwrap();
    assert_eq!(relay.drain().await.unwrap().published, 1);
    emit(&primary_pool, "tail").await; // committed, replicated, never read from the slot
    primary_pool.close().await;
    tokio::task::block_in_place(|| {
        primary.stop_immediate();
        standby.promote();
    });

    let promoted = pool(&standby.url("postgres")).await;
    let relay = WalRelay::builder(
        promoted.clone(),
        slot.clone(),
        PgQueue::new(promoted.clone()),
    )
    .build()
    .unwrap();
    match relay.relay_once().await.unwrap_err() {
        Error::WalSlot { reason, .. } => assert!(reason.contains("does not exist"), "{reason}"),
        other => panic!("{other:?}"),
    }
    slot.create(&promoted).await.unwrap();
    emit(&promoted, "after").await;
    relay.drain().await.unwrap();
    let got: Vec<String> = queued(&promoted)
        .await
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    // "published" was in the queue before the failover (replicated with it); "tail" is lost.
    assert_eq!(got, ["published", "after"]);
}

/// Other work's WAL does not pile up behind the slot: a round that finds nothing of ours
/// moves the slot to where its read ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_moves_the_slot_past_other_work() {
    let (_cluster, pool) = logical().await;
    let slot = WalSlot::new("pgbox_outbox").unwrap();
    slot.create(&pool).await.unwrap();
    pool.execute("CREATE TABLE other_work (x text); INSERT INTO other_work SELECT repeat('x', 100) FROM generate_series(1, 20000)")
        .await
        .unwrap();
    let before: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap();
    let round = relay.relay_once().await.unwrap();
    assert_eq!(round.read, 0);
    let moved: bool = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = 'pgbox_outbox'",
    )
    .bind(&before)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        moved,
        "the slot still holds the WAL of work that had no message"
    );
}
