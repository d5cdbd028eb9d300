//! An attack on the WAL outbox (`OutboxMode::Wal`), its relay (`WalRelay`) and the replay of
//! its dead letters, after issue 34 (defects 1–5, 11).
//!
//! The promise attacked (README "The WAL outbox: messages without a table", "Which outbox",
//! "Guarantees, and where they end"; rustdoc of `relay::wal` and `DeadLetters`):
//! - a rollback emits nothing; a commit hands out everything, in commit order; nothing lost;
//! - each peek is bounded by the flush position taken before it; a round that finds nothing
//!   moves the slot at most there; a commit written but not flushed is read later, never
//!   skipped;
//! - the slot moves only past transactions whose messages were all confirmed: a crash (or a
//!   cancelled round) anywhere re-reads from the last advance: at-least-once;
//! - a WAL dead letter's seq is `i64::MIN` + its WAL position (unique, WAL order); a taken seq
//!   is an error, not a silent drop; content under the prefix pgbox cannot read is
//!   dead-lettered (`pgbox.undecodable`), never skipped, never a stall;
//! - only a refusal counts toward `max_attempts`; waiting never counts; a dead letter's key
//!   goes on in the same round; an outage counts nothing and dead-letters nothing;
//! - `DeadLetters::replay` emits WAL dead letters into the WAL again, in original order; the
//!   WAL relay publishes them; refused with `Error::WalSlot` when no logical slot would read
//!   them; `DeadLetters::list` lists WAL dead letters first, in WAL order;
//! - `WalRelay::drain` publishes until the slot has nothing more of its schema; messages of
//!   other schemas in the slot are passed over.
//!
//! Each test runs on a private cluster with `wal_level = logical`.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbox::transport::{PublishError, Publisher};
use pgbox::{
    DeadLetters, Envelope, Error, Message, Migrator, Outbox, OutboxMode, WalRelay, WalSlot,
};
use sqlx::{Connection, Executor, PgPool};
use support::wal::{logical, quick};

/// A broker the test controls, per payload: refused, unavailable, or taken. Records what it
/// took, in order, with the message's key.
#[derive(Clone, Default)]
struct Broker(Arc<Mutex<BrokerState>>);

#[derive(Default)]
struct BrokerState {
    down: bool,
    refuse: HashSet<String>,
    /// Refuse these payloads this many more times.
    refuse_times: HashMap<String, u32>,
    unavailable: HashSet<String>,
    published: Vec<(Option<String>, String)>,
    /// Yield to the scheduler inside publish (a cancellation point).
    slow: bool,
}

impl Broker {
    fn set(&self, f: impl FnOnce(&mut BrokerState)) {
        f(&mut self.0.lock().unwrap());
    }
    fn published(&self) -> Vec<String> {
        let s = self.0.lock().unwrap();
        s.published.iter().map(|(_, p)| p.clone()).collect()
    }
    fn published_of(&self, key: &str) -> Vec<String> {
        let s = self.0.lock().unwrap();
        s.published
            .iter()
            .filter(|(k, _)| k.as_deref() == Some(key))
            .map(|(_, p)| p.clone())
            .collect()
    }
}

impl Publisher for Broker {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let slow = self.0.lock().unwrap().slow;
        if slow {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let mut s = self.0.lock().unwrap();
        batch
            .iter()
            .map(|e| {
                let payload = String::from_utf8_lossy(&e.payload).into_owned();
                if s.down || s.unavailable.contains(&payload) {
                    return Err(PublishError::unavailable("connection refused"));
                }
                if s.refuse.contains(&payload) {
                    return Err(PublishError::refused("refused by the broker"));
                }
                if let Some(n) = s.refuse_times.get_mut(&payload)
                    && *n > 0
                {
                    *n -= 1;
                    return Err(PublishError::refused("refused by the broker (for now)"));
                }
                s.published.push((e.ordering_key.clone(), payload));
                Ok(())
            })
            .collect()
    }
}

async fn emit_in(outbox: &Outbox, pool: &PgPool, messages: Vec<Message>) {
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue_batch(&mut tx, messages).await.unwrap();
    tx.commit().await.unwrap();
}

async fn emit(pool: &PgPool, messages: Vec<Message>) {
    emit_in(&Outbox::new().mode(OutboxMode::Wal), pool, messages).await;
}

fn keyed(payload: &str, key: &str) -> Message {
    Message::bytes("t", payload.as_bytes().to_vec()).ordering_key(key)
}

fn plain(payload: &str) -> Message {
    Message::bytes("t", payload.as_bytes().to_vec())
}

async fn dead_payloads(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar::<_, Vec<u8>>("SELECT payload FROM pgbox.outbox_dead_letters ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| String::from_utf8_lossy(&p).into_owned())
        .collect()
}

/// Rounds until `broker` published `payload` or `rounds` ran out; the errors of failed rounds.
async fn rounds_until<P: Publisher>(
    relay: &WalRelay<P>,
    broker: &Broker,
    payload: &str,
    rounds: usize,
) -> Vec<String> {
    let mut errors = Vec::new();
    for _ in 0..rounds {
        if broker.published().iter().any(|p| p == payload) {
            break;
        }
        if let Err(e) = relay.relay_once().await {
            errors.push(e.to_string());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    errors
}

// ---------------------------------------------------------------------------------------------
// Findings (fixed; kept as regression tests under descriptive names)
// ---------------------------------------------------------------------------------------------

/// A message dead-lettered in a transaction the slot has not passed yet (another message of
/// that transaction waits behind an outage of its topic) sits in the relay's in-memory
/// `dead` set, keyed by message id. The operator replays it: the replay deletes the dead
/// letter and emits the message again, with the same id. The next round finds that id in
/// `dead` and treats the replayed copy as settled: it is never offered, the slot moves past
/// it, and the message is gone (neither published nor in the dead letters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_dead_letter_whose_transaction_the_slot_has_not_passed_is_published() {
    let (_cluster, pool, slot) = logical(&[]).await;
    // One business transaction, two topics' messages: `orders` refuses m1, `audit` is down.
    emit(
        &pool,
        vec![
            Message::bytes("orders", b"m1".to_vec()).ordering_key("A"),
            Message::bytes("audit", b"m2".to_vec()).ordering_key("B"),
        ],
    )
    .await;
    let broker = Broker::default();
    broker.set(|s| {
        s.refuse.insert("m1".into());
        s.unavailable.insert("m2".into());
    });
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(1)
        .backoff(quick())
        .build()
        .unwrap();
    let round = relay.relay_once().await.unwrap();
    assert_eq!(
        (round.dead_lettered, round.unavailable),
        (1, 1),
        "{round:?}"
    );
    assert_eq!(dead_payloads(&pool).await, ["m1"]);

    // The operator fixes what made m1 fail and replays it; the audit broker comes back.
    broker.set(|s| {
        s.refuse.clear();
        s.unavailable.clear();
    });
    assert_eq!(
        DeadLetters::new(pool.clone()).replay_all().await.unwrap(),
        1
    );
    let report = relay.drain().await.unwrap();
    let published = broker.published();
    let dead = dead_payloads(&pool).await;
    eprintln!("drain: {report:?}; published {published:?}; dead letters {dead:?}");
    assert!(
        published.iter().any(|p| p == "m1") || dead.iter().any(|p| p == "m1"),
        "m1 was replayed and is neither published nor a dead letter: lost \
         (published {published:?}, dead letters {dead:?}, drain {report:?})"
    );
}

/// Two schemas share a database; schema `other` has a backlog of WAL messages (its relay is
/// down, or slower). `WalRelay::drain` of schema `pgbox` promises to publish "until the slot
/// has nothing more of this schema", but it stops after the first round that read nothing of
/// its schema: one read of 20,000 changes full of the other schema's transactions. Its own
/// message, committed after them, is left unpublished, and drain reports success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_reads_past_another_schemas_backlog_to_its_own_message() {
    let (_cluster, pool, slot) = logical(&[]).await;
    Migrator::new()
        .schema("other")
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    let other = Outbox::with_schema("other").unwrap().mode(OutboxMode::Wal);
    let mut conn = pool.acquire().await.unwrap();
    conn.execute("SET synchronous_commit = off").await.unwrap();
    // 7,000 one-message transactions: 21,000 changes, over the default read of 20,000.
    for i in 0..7_000 {
        let mut tx = conn.begin().await.unwrap();
        other
            .enqueue(&mut tx, plain(&format!("other-{i}")))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    drop(conn);
    emit(&pool, vec![plain("ours")]).await;
    let broker = Broker::default();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(
        broker.published(),
        ["ours"],
        "drain returned ({report:?}) with its schema's message still in the slot"
    );
}

/// Another application in the database emits non-transactional logical messages (a CDC
/// tool's heartbeat: `pg_logical_emit_message(false, 'heartbeat', ...)`). When a read of
/// `batch_size` changes holds only such messages, it holds no transaction, so the round
/// neither publishes nor counts the read as covering anything, and the slot does not move: the
/// next read returns the same changes. The relay is stuck for good; every pgbox message
/// behind them waits forever (and the slot retains WAL until it is invalidated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_full_of_other_apps_non_transactional_messages_moves_the_slot_past_them() {
    let (_cluster, pool, slot) = logical(&[]).await;
    sqlx::query(
        "SELECT count(pg_logical_emit_message(false, 'heartbeat', 'beat')) \
         FROM generate_series(1, 25000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    emit(&pool, vec![plain("ours")]).await;
    let broker = Broker::default();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .build()
        .unwrap();
    let errors = rounds_until(&relay, &broker, "ours", 10).await;
    let drain = relay.drain().await;
    assert_eq!(
        broker.published(),
        ["ours"],
        "after 10 rounds and a drain ({drain:?}; errors {errors:?}) the message behind \
         25,000 non-transactional messages of another prefix is still unpublished"
    );
}

/// A non-transactional emit under the schema's own prefix (a producer's mistake, or
/// anyone who can emit): the README says content under the prefix that pgbox cannot read is
/// dead-lettered (`pgbox.undecodable`), never skipped silently. Instead every round fails
/// ("a message outside a transaction") and nothing after it is ever published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_transactional_emit_under_the_prefix_is_dead_lettered_and_the_relay_goes_on() {
    let (_cluster, pool, slot) = logical(&[]).await;
    sqlx::query("SELECT pg_logical_emit_message(false, 'pgbox:pgbox', 'not pgbox''s format')")
        .execute(&pool)
        .await
        .unwrap();
    emit(&pool, vec![plain("after")]).await;
    let broker = Broker::default();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .build()
        .unwrap();
    let errors = rounds_until(&relay, &broker, "after", 10).await;
    let undecodable: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgbox.outbox_dead_letters WHERE topic = 'pgbox.undecodable'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (broker.published(), undecodable),
        (vec!["after".to_owned()], 1),
        "10 rounds: errors {:?}",
        errors.first()
    );
    assert!(errors.is_empty(), "no round fails over it: {errors:?}");
}

/// Two schemas' relays on one slot (nothing says a slot serves one schema, and nothing
/// refuses it): the reader of schema `pgbox` passes over schema `other`'s messages and moves
/// the slot past them. When `other`'s relay becomes the reader, they are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_serves_one_schema_and_another_schemas_relay_is_refused_naming_both() {
    let (_cluster, pool, slot) = logical(&[]).await;
    Migrator::new()
        .schema("other")
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    let other = Outbox::with_schema("other").unwrap().mode(OutboxMode::Wal);
    emit(&pool, vec![plain("a1")]).await;
    emit_in(&other, &pool, vec![plain("b1")]).await;

    let broker_a = Broker::default();
    let broker_b = Broker::default();
    let relay_a = WalRelay::builder(pool.clone(), slot.clone(), broker_a.clone())
        .build()
        .unwrap();
    let relay_b = WalRelay::builder(pool.clone(), slot.clone(), broker_b.clone())
        .schema("other")
        .build()
        .unwrap();
    let a = relay_a.drain().await;
    drop(relay_a); // its reader's session ends
    let mut b = None;
    for _ in 0..100 {
        match relay_b.relay_once().await {
            Ok(r) if r.reader => {
                b = Some(relay_b.drain().await);
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => {
                b = Some(Err(e));
                break;
            }
        }
    }
    let refused =
        matches!(a, Err(Error::WalSlot { .. })) || matches!(b, Some(Err(Error::WalSlot { .. })));
    assert!(
        refused || broker_b.published() == ["b1"],
        "schema other's b1 is lost: relay a {a:?} published {:?}; relay b {b:?} published {:?}",
        broker_a.published(),
        broker_b.published()
    );
    // The decision: the slot is the first reader's schema's; another schema's relay is
    // refused, typed, naming both, and reads nothing.
    assert!(a.is_ok(), "{a:?}");
    assert_eq!(broker_a.published(), ["a1"]);
    match b {
        Some(Err(Error::WalSlot { slot, reason })) => {
            assert_eq!(slot, "pgbox_outbox");
            assert!(
                reason.contains("schema pgbox") && reason.contains("schema other"),
                "{reason}"
            );
        }
        other => panic!("relay of schema other: {other:?}"),
    }
    assert!(broker_b.published().is_empty());
    // Refused at every try, not once. (The refused try's session ends asynchronously: until
    // its backend has gone, the next try may find the reader's lock still taken.)
    let mut again = None;
    for _ in 0..100 {
        match relay_b.relay_once().await {
            Ok(r) if !r.reader => tokio::time::sleep(Duration::from_millis(50)).await,
            other => {
                again = Some(other);
                break;
            }
        }
    }
    assert!(
        matches!(again, Some(Err(Error::WalSlot { .. }))),
        "{again:?}"
    );
}

/// `DeadLetters::replay` is "refused with Error::WalSlot when no logical slot would read
/// them". Its check is only that some pgoutput slot exists in the database: an invalidated
/// slot (`wal_status = lost`, past `max_slot_wal_keep_size`), which will never read anything
/// again, passes. The replay deletes the dead letter and emits into WAL no slot reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_only_an_invalidated_slot_is_refused_and_keeps_the_dead_letter() {
    let (cluster, pool, slot) = logical(&["max_slot_wal_keep_size = '1MB'"]).await;
    emit(&pool, vec![keyed("dead-1", "A")]).await;
    let broker = Broker::default();
    broker.set(|s| {
        s.refuse.insert("dead-1".into());
    });
    {
        let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
            .max_attempts(1)
            .backoff(quick())
            .build()
            .unwrap();
        relay.drain().await.unwrap();
    }
    assert_eq!(dead_payloads(&pool).await, ["dead-1"]);
    // Push WAL past the slot's keep size until the server invalidates it.
    sqlx::query("CREATE TABLE filler (x text)")
        .execute(&pool)
        .await
        .unwrap();
    let mut status = String::new();
    for _ in 0..30 {
        sqlx::query("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 3000)")
            .execute(&pool)
            .await
            .unwrap();
        cluster.psql("SELECT pg_switch_wal()");
        cluster.psql("CHECKPOINT");
        status = cluster.psql(
            "SELECT coalesce(wal_status, 'lost') FROM pg_replication_slots WHERE slot_name = 'pgbox_outbox'",
        );
        if status == "lost" {
            break;
        }
    }
    assert_eq!(status, "lost", "the slot was invalidated");
    let replay = DeadLetters::new(pool.clone()).replay_all().await;
    let left = dead_payloads(&pool).await;
    assert!(
        matches!(replay, Err(Error::WalSlot { .. })) && left == ["dead-1"],
        "replay into WAL only an invalidated slot could read: {replay:?}; dead letters left \
         {left:?}"
    );
}

/// `DeadLetters::list`: "the WAL outbox's first, in WAL order". Dead letters of the earlier
/// release's formula (minus the position times 1,024 minus the index: later messages lower,
/// between `i64::MIN / 2` and 0), which `replay` knows how to order, are listed newest first,
/// and after every current one although they are older; `list(1)` gives the newest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_orders_old_and_current_wal_dead_letters_as_replay_does() {
    let (_cluster, pool, slot) = logical(&[]).await;
    let old = |position: i64, index: i64| -(position * 1024) - index;
    let rows: [(i64, &str); 4] = [
        (old(0x0100_0000, 0), "old-1"),
        (old(0x0100_0000, 1), "old-2"),
        (old(0x0200_0000, 0), "old-3"),
        (i64::MIN + 0x0300_0000, "new-4"),
    ];
    for (seq, payload) in rows {
        sqlx::query(
            "INSERT INTO pgbox.outbox_dead_letters \
               (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, attempts) \
             VALUES ($1, $2, 't', 'A', $3, 'application/octet-stream', '{}', now(), 10)",
        )
        .bind(seq)
        .bind(uuid::Uuid::now_v7())
        .bind(payload.as_bytes())
        .execute(&pool)
        .await
        .unwrap();
    }
    let dead = DeadLetters::new(pool.clone());
    let mut listed = Vec::new();
    for d in dead.list(10).await.unwrap() {
        listed.push(String::from_utf8(dead.get(d.message_id).await.unwrap().unwrap().1).unwrap());
    }
    // What replay does with them, for comparison: original order.
    let broker = Broker::default();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    dead.replay_all().await.unwrap();
    relay.drain().await.unwrap();
    assert_eq!(
        broker.published_of("A"),
        ["old-1", "old-2", "old-3", "new-4"],
        "replay's order"
    );
    assert_eq!(listed, ["old-1", "old-2", "old-3", "new-4"], "list's order");
}

/// The sweep of the last two findings: a replay is refused, typed, keeping its dead
/// letters, when the only live slot is claimed by another schema's relay (it would pass the
/// replayed messages over); accepted once a slot of its own exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_refused_when_the_only_live_slot_is_another_schemas() {
    let (_cluster, pool, slot) = logical(&[]).await;
    Migrator::new()
        .schema("other")
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    // Schema other's relay reads the slot first: it is other's.
    let other_relay = WalRelay::builder(pool.clone(), slot.clone(), Broker::default())
        .schema("other")
        .build()
        .unwrap();
    other_relay.drain().await.unwrap();
    drop(other_relay);
    let old = i64::MIN + 0x0100_0000;
    sqlx::query(
        "INSERT INTO pgbox.outbox_dead_letters \
           (seq, message_id, topic, ordering_key, payload, content_type, headers, created_at, attempts) \
         VALUES ($1, $2, 't', 'A', 'dead-1', 'application/octet-stream', '{}', now(), 10)",
    )
    .bind(old)
    .bind(uuid::Uuid::now_v7())
    .execute(&pool)
    .await
    .unwrap();
    let dead = DeadLetters::new(pool.clone());
    let err = dead.replay_all().await.unwrap_err();
    match &err {
        Error::WalSlot { reason, .. } => assert!(reason.contains("schema pgbox"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(dead_payloads(&pool).await, ["dead-1"], "kept");

    // A slot of its own: replayed and published by its relay.
    let own = WalSlot::new("pgbox_own").unwrap();
    own.create(&pool).await.unwrap();
    let broker = Broker::default();
    let relay = WalRelay::builder(pool.clone(), own.clone(), broker.clone())
        .build()
        .unwrap();
    relay.drain().await.unwrap(); // claims it for schema pgbox
    assert_eq!(dead.replay_all().await.unwrap(), 1);
    relay.drain().await.unwrap();
    assert_eq!(broker.published(), ["dead-1"]);
    assert!(dead_payloads(&pool).await.is_empty());
}

/// `DeadLetters::list` over generated `seq`s of all three kinds, boundaries included
/// (`i64::MIN`, the ceiling between the WAL formulas, -1, 1, `i64::MAX`): the earlier
/// release's WAL dead letters first in their original order (minus the position times 1,024
/// minus the index: the original order is descending `seq`), then the current ones (`i64::MIN`
/// plus the position: ascending), then the table outbox's (ascending); `list(n)` is a prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_orders_generated_dead_letters_of_every_kind_in_original_order() {
    let db = support::TestDb::migrated().await;
    let ceiling = i64::MIN / 2;
    let mut seqs: Vec<i64> = vec![i64::MIN, ceiling - 1, ceiling, -1, 1, i64::MAX];
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    while seqs.len() < 300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let seq = match x % 3 {
            0 => i64::MIN + (x >> 3) as i64 % (1 << 62),
            1 => -(((x >> 8) % (1 << 40)) as i64 * 1024) - ((x >> 2) % 1024) as i64 - 1,
            _ => 1 + ((x >> 1) % (1 << 62)) as i64,
        };
        if !seqs.contains(&seq) {
            seqs.push(seq);
        }
    }
    for seq in &seqs {
        sqlx::query(
            "INSERT INTO pgbox.outbox_dead_letters \
               (seq, message_id, topic, payload, content_type, headers, created_at, attempts) \
             VALUES ($1, $2, 't', '', 'application/octet-stream', '{}', now(), 1)",
        )
        .bind(seq)
        .bind(uuid::Uuid::now_v7())
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let mut old: Vec<i64> = seqs
        .iter()
        .copied()
        .filter(|&s| (ceiling..0).contains(&s))
        .collect();
    old.sort_by(|a, b| b.cmp(a));
    let mut current: Vec<i64> = seqs.iter().copied().filter(|&s| s < ceiling).collect();
    current.sort();
    let mut table: Vec<i64> = seqs.iter().copied().filter(|&s| s > 0).collect();
    table.sort();
    let want: Vec<i64> = old.into_iter().chain(current).chain(table).collect();
    let dead = DeadLetters::new(db.pool.clone());
    let listed: Vec<i64> = dead
        .list(1000)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.seq)
        .collect();
    assert_eq!(listed, want);
    for n in [1usize, 7, 150] {
        let prefix: Vec<i64> = dead
            .list(n as i64)
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.seq)
            .collect();
        assert_eq!(prefix, want[..n]);
    }
}

// ---------------------------------------------------------------------------------------------
// Held (kept as regression tests)
// ---------------------------------------------------------------------------------------------

/// Emits in savepoints rolled back (SQL `ROLLBACK TO`, and sqlx's nested `begin` dropped) are
/// not published; those in released savepoints are, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emits_in_rolled_back_subtransactions_are_not_published() {
    let (_cluster, pool, slot) = logical(&[]).await;
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue(&mut tx, keyed("kept-1", "A")).await.unwrap();
    tx.execute("SAVEPOINT s1").await.unwrap();
    wal.enqueue(&mut tx, keyed("rolled-back-1", "A"))
        .await
        .unwrap();
    tx.execute("ROLLBACK TO SAVEPOINT s1").await.unwrap();
    wal.enqueue(&mut tx, keyed("kept-2", "A")).await.unwrap();
    {
        let mut nested = tx.begin().await.unwrap();
        wal.enqueue(&mut nested, keyed("rolled-back-2", "A"))
            .await
            .unwrap();
        // dropped: ROLLBACK TO SAVEPOINT
    }
    {
        let mut nested = tx.begin().await.unwrap();
        wal.enqueue(&mut nested, keyed("released-3", "A"))
            .await
            .unwrap();
        {
            let mut deeper = nested.begin().await.unwrap();
            wal.enqueue(&mut deeper, keyed("rolled-back-3", "A"))
                .await
                .unwrap();
            deeper.rollback().await.unwrap();
        }
        nested.commit().await.unwrap();
    }
    tx.commit().await.unwrap();
    // And a whole transaction rolled back.
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue(&mut tx, keyed("rolled-back-4", "A"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    emit(&pool, vec![keyed("last", "A")]).await;

    let broker = Broker::default();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    assert_eq!(
        broker.published_of("A"),
        ["kept-1", "kept-2", "released-3", "last"]
    );
}

/// Prepared transactions: emits are published once at `COMMIT PREPARED`, never after
/// `ROLLBACK PREPARED`, although empty rounds moved the slot past the PREPARE records in
/// between (to the flush position, with other WAL going on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_transactions_publish_at_commit_prepared_once() {
    let (_cluster, pool, slot) = logical(&["max_prepared_transactions = 10"]).await;
    let wal = Outbox::new().mode(OutboxMode::Wal);
    for (gid, payload) in [("p-commit", "prepared-1"), ("p-abort", "prepared-2")] {
        let mut tx = pool.begin().await.unwrap();
        wal.enqueue(&mut tx, keyed(payload, "A")).await.unwrap();
        tx.execute(sqlx::AssertSqlSafe(format!("PREPARE TRANSACTION '{gid}'")))
            .await
            .unwrap();
        // sqlx still thinks a transaction is open; its COMMIT only warns.
        let _ = tx.commit().await;
    }
    emit(&pool, vec![keyed("plain-0", "B")]).await;
    let broker = Broker::default();
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .build()
        .unwrap();
    for _ in 0..5 {
        relay.relay_once().await.unwrap();
        sqlx::query("SELECT pg_switch_wal()")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("CHECKPOINT").execute(&pool).await.unwrap();
        emit(&pool, vec![keyed("plain", "B")]).await;
    }
    relay.drain().await.unwrap();
    assert!(
        broker.published_of("A").is_empty(),
        "nothing before COMMIT PREPARED"
    );
    sqlx::query("COMMIT PREPARED 'p-commit'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("ROLLBACK PREPARED 'p-abort'")
        .execute(&pool)
        .await
        .unwrap();
    emit(&pool, vec![keyed("after", "A")]).await;
    relay.drain().await.unwrap();
    assert_eq!(broker.published_of("A"), ["prepared-1", "after"]);
}

/// Asynchronous commits (synchronous_commit off, wal_writer_delay 1 s) from four producers
/// racing a running relay: every message is published; per key, first publications in commit
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_commits_racing_a_running_relay_lose_nothing() {
    let (_cluster, pool, slot) = logical(&["wal_writer_delay = '1000ms'"]).await;
    let broker = Broker::default();
    let relay = Arc::new(
        WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
            .poll_interval(Duration::from_millis(10))
            .build()
            .unwrap(),
    );
    let shutdown = pgbox::CancellationToken::new();
    let run = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    let mut producers = Vec::new();
    for p in 0..4 {
        let pool = pool.clone();
        producers.push(tokio::spawn(async move {
            let wal = Outbox::new().mode(OutboxMode::Wal);
            let mut conn = pool.acquire().await.unwrap();
            conn.execute("SET synchronous_commit = off").await.unwrap();
            for i in 0..400 {
                let mut tx = conn.begin().await.unwrap();
                wal.enqueue(&mut tx, keyed(&format!("p{p}-{i}"), &format!("k{p}")))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                if i % 50 == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    // One durable commit flushes everything before it.
    emit(&pool, vec![plain("flush")]).await;
    for _ in 0..600 {
        let got: HashSet<String> = broker.published().into_iter().collect();
        if got.len() >= 1601 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let got: HashSet<String> = broker.published().into_iter().collect();
    assert_eq!(got.len(), 1601, "missing: {}", 1601 - got.len());
    for p in 0..4 {
        let mut seen = HashSet::new();
        let firsts: Vec<String> = broker
            .published_of(&format!("k{p}"))
            .into_iter()
            .filter(|x| seen.insert(x.clone()))
            .collect();
        let want: Vec<String> = (0..400).map(|i| format!("p{p}-{i}")).collect();
        assert_eq!(firsts, want, "key k{p} in commit order");
    }
}

/// Rounds cancelled at random points (a `timeout` around `relay_once`: between publish and
/// advance, between a dead-letter insert and the advance, mid-statement): nothing is lost,
/// each key's first publications stay in order, every refused message is a dead letter
/// exactly once and never published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_cancelled_at_random_points_lose_nothing() {
    let (_cluster, pool, slot) = logical(&[]).await;
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    let mut refused = HashSet::new();
    for t in 0..150 {
        let mut batch = Vec::new();
        for j in 0..4 {
            let key = format!("k{}", (t + j) % 7);
            let payload = format!("m{t}-{j}");
            if (t * 4 + j) % 23 == 0 {
                refused.insert(payload.clone());
            } else {
                expected
                    .entry(key.clone())
                    .or_default()
                    .push(payload.clone());
            }
            batch.push(keyed(&payload, &key));
        }
        emit(&pool, batch).await;
    }
    let broker = Broker::default();
    broker.set(|s| {
        s.refuse = refused.clone();
        s.slow = true;
    });
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .batch_size(60)
        .max_attempts(1)
        .backoff(quick())
        .build()
        .unwrap();
    let mut seed: u64 = 0x2545_F491_4F6C_DD1D;
    let mut cancelled = 0;
    for _ in 0..400 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let budget = Duration::from_micros(seed % 8_000);
        match tokio::time::timeout(budget, relay.relay_once()).await {
            Err(_) => cancelled += 1,
            Ok(Ok(r)) if r.read == 0 && r.reader => break,
            Ok(_) => {}
        }
    }
    eprintln!("{cancelled} rounds cancelled");
    relay.drain().await.unwrap();
    let published: HashSet<String> = broker.published().into_iter().collect();
    for (key, want) in &expected {
        let mut seen = HashSet::new();
        let firsts: Vec<String> = broker
            .published_of(key)
            .into_iter()
            .filter(|x| seen.insert(x.clone()))
            .collect();
        assert_eq!(&firsts, want, "key {key}");
    }
    let dead = dead_payloads(&pool).await;
    let dead_set: HashSet<String> = dead.iter().cloned().collect();
    assert_eq!(dead.len(), dead_set.len(), "each dead letter once");
    assert_eq!(dead_set, refused);
    assert!(published.is_disjoint(&refused));
}

/// Two relays run on one slot while producers commit: one reads, everything is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_one_slot_publish_everything() {
    let (_cluster, pool, slot) = logical(&[]).await;
    let broker = Broker::default();
    let shutdown = pgbox::CancellationToken::new();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
            .poll_interval(Duration::from_millis(20))
            .build()
            .unwrap();
        let s = shutdown.clone();
        runs.push(tokio::spawn(async move { relay.run(s).await }));
    }
    for t in 0..300 {
        emit(
            &pool,
            vec![keyed(&format!("a{t}"), "A"), keyed(&format!("b{t}"), "B")],
        )
        .await;
    }
    for _ in 0..600 {
        if broker.published().into_iter().collect::<HashSet<_>>().len() >= 600 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    for r in runs {
        r.await.unwrap().unwrap();
    }
    for key in ["A", "B"] {
        let mut seen = HashSet::new();
        let firsts: Vec<String> = broker
            .published_of(key)
            .into_iter()
            .filter(|x| seen.insert(x.clone()))
            .collect();
        let want: Vec<String> = (0..300)
            .map(|t| format!("{}{t}", key.to_lowercase()))
            .collect();
        assert_eq!(firsts, want);
    }
}

/// A message refused once (one attempt of three counted), then an outage of 30 rounds, then
/// recovery: nothing dead-lettered, the key in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_after_a_refusal_counts_nothing_and_dead_letters_nothing() {
    let (_cluster, pool, slot) = logical(&[]).await;
    for i in 1..=3 {
        emit(
            &pool,
            vec![keyed(&format!("a{i}"), "A"), plain(&format!("u{i}"))],
        )
        .await;
    }
    let broker = Broker::default();
    broker.set(|s| {
        s.refuse_times.insert("a1".into(), 2);
    });
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(3)
        .backoff(quick())
        .build()
        .unwrap();
    let r = relay.relay_once().await.unwrap();
    assert_eq!(r.retried, 1);
    broker.set(|s| s.down = true);
    for _ in 0..30 {
        let r = relay.relay_once().await.unwrap();
        assert_eq!(r.dead_lettered, 0);
    }
    broker.set(|s| s.down = false);
    relay.drain().await.unwrap();
    assert!(dead_payloads(&pool).await.is_empty());
    let mut seen = HashSet::new();
    let firsts: Vec<String> = broker
        .published_of("A")
        .into_iter()
        .filter(|x| seen.insert(x.clone()))
        .collect();
    assert_eq!(firsts, ["a1", "a2", "a3"]);
}

/// Two replays of the same dead letters at once, and one more after: each replayed message
/// is published, none is left, none is emitted twice by the replays (each id appears in the
/// slot once more only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_and_repeated_replays_emit_each_dead_letter_once() {
    let (_cluster, pool, slot) = logical(&[]).await;
    for i in 0..20 {
        emit(&pool, vec![keyed(&format!("d{i}"), "A")]).await;
    }
    let broker = Broker::default();
    broker.set(|s| {
        s.refuse = (0..20).map(|i| format!("d{i}")).collect();
    });
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(1)
        .backoff(quick())
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    assert_eq!(dead_payloads(&pool).await.len(), 20);
    broker.set(|s| s.refuse.clear());
    let dead = DeadLetters::new(pool.clone());
    let (a, b) = tokio::join!(dead.replay_all(), dead.replay_all());
    let total = a.unwrap() + b.unwrap() + dead.replay_all().await.unwrap();
    assert_eq!(total, 20);
    relay.drain().await.unwrap();
    let want: Vec<String> = (0..20).map(|i| format!("d{i}")).collect();
    assert_eq!(broker.published_of("A"), want);
    assert!(dead_payloads(&pool).await.is_empty());
}

/// A replay of WAL dead letters spanning more than one emit (payloads over 64 MiB in total:
/// 9 of 8 MiB) keeps their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_over_64_mib_keeps_the_order() {
    let (_cluster, pool, slot) = logical(&[]).await;
    let big = |i: usize| {
        let mut p = format!("big-{i}:").into_bytes();
        p.resize(8 * 1024 * 1024 - 1024, b'x');
        Message::bytes("t", p).ordering_key("A")
    };
    for i in 0..9 {
        emit(&pool, vec![big(i)]).await;
    }
    #[derive(Clone, Default)]
    struct Prefixes(Arc<Mutex<(bool, Vec<String>)>>);
    impl Publisher for Prefixes {
        async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
            let mut s = self.0.lock().unwrap();
            batch
                .iter()
                .map(|e| {
                    if s.0 {
                        return Err(PublishError::refused("no"));
                    }
                    let head = e.payload.iter().take_while(|&&b| b != b':').count();
                    s.1.push(String::from_utf8_lossy(&e.payload[..head]).into_owned());
                    Ok(())
                })
                .collect()
        }
    }
    let broker = Prefixes::default();
    broker.0.lock().unwrap().0 = true;
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(1)
        .batch_size(4)
        .backoff(quick())
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    broker.0.lock().unwrap().0 = false;
    assert_eq!(
        DeadLetters::new(pool.clone()).replay_all().await.unwrap(),
        9
    );
    relay.drain().await.unwrap();
    let want: Vec<String> = (0..9).map(|i| format!("big-{i}")).collect();
    assert_eq!(broker.0.lock().unwrap().1, want);
}
