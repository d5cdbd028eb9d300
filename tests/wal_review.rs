//! The WAL outbox under review (issue 34, defects 1–5 and 11): a round that reads nothing
//! never moves the slot past a commit it did not read; more than 1,024 dead letters of one
//! emit all land; a message behind a refused one of its key is offered, not dead-lettered;
//! replayed WAL dead letters come back in their order through the WAL relay; a WAL dead letter
//! does not hold table-mode messages of its key; a transport outage longer than the whole
//! retry budget dead-letters nothing. Each on a private cluster with `wal_level = logical`.

mod support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pgbox::transport::{PublishError, Publisher};
use pgbox::{
    DeadLetters, Envelope, Error, Message, Outbox, OutboxMode, Relay, WalReader, WalRelay,
};
use sqlx::{Connection, Executor, PgConnection, PgPool};
use support::wal::{logical, pool, quick};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// A broker the test controls: up or down (every publish `unavailable`), refusing some
/// payloads (or all), recording what it was offered and what it took.
#[derive(Clone, Default)]
struct Broker(Arc<Mutex<BrokerState>>);

#[derive(Default)]
struct BrokerState {
    down: bool,
    refuse_all: bool,
    refuse: HashSet<String>,
    /// Every payload offered, in order.
    offered: Vec<String>,
    /// (ordering key, payload) of every message taken, in order.
    published: Vec<(Option<String>, String)>,
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

    fn offered(&self) -> Vec<String> {
        self.0.lock().unwrap().offered.clone()
    }
}

impl Publisher for Broker {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let mut s = self.0.lock().unwrap();
        batch
            .iter()
            .map(|e| {
                let payload = String::from_utf8(e.payload.clone()).unwrap();
                s.offered.push(payload.clone());
                if s.down {
                    Err(PublishError::unavailable("connection refused"))
                } else if s.refuse_all || s.refuse.contains(&payload) {
                    Err(PublishError::refused("refused by the broker"))
                } else {
                    s.published.push((e.ordering_key.clone(), payload));
                    Ok(())
                }
            })
            .collect()
    }
}

/// The debugging recorder, installed once for this binary; the sum of counter `name` of slot
/// `pgbox_outbox` recorded since the last call.
fn counter(name: &str) -> u64 {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    let snapshotter = SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this binary");
        snapshotter
    });
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| {
            key.key().name() == name
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == "slot" && l.value() == "pgbox_outbox")
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}

async fn emit(pool: &PgPool, messages: Vec<Message>) {
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let mut tx = pool.begin().await.unwrap();
    wal.enqueue_batch(&mut tx, messages).await.unwrap();
    tx.commit().await.unwrap();
}

fn keyed(payload: &str, key: &str) -> Message {
    Message::bytes("t", payload.as_bytes().to_vec()).ordering_key(key)
}

async fn dead_letters(pool: &PgPool) -> Vec<(String, i32, String)> {
    sqlx::query_as::<_, (Vec<u8>, i32, Option<String>)>(
        "SELECT payload, attempts, last_error FROM pgbox.outbox_dead_letters ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(p, a, e)| (String::from_utf8(p).unwrap(), a, e.unwrap_or_default()))
    .collect()
}

/// When armed: who to tell that the packet is held, and what lets it through.
type Armed = Arc<Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>>;

/// A TCP proxy that, once armed, holds the first client→server packet containing `needle`
/// until released: a relay descheduled (or a network slow) between its read and its advance.
struct HoldingProxy {
    addr: SocketAddr,
    armed: Armed,
    accept: tokio::task::AbortHandle,
}

impl HoldingProxy {
    async fn start(target: SocketAddr, needle: &'static [u8]) -> HoldingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let armed: Armed = Arc::default();
        let hold = armed.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let hold = hold.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                    });
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut tail: Vec<u8> = Vec::new();
                    loop {
                        let n = match client_read.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        tail.extend_from_slice(&buf[..n]);
                        let seen = tail.windows(needle.len()).any(|w| w == needle);
                        let keep = tail.len().saturating_sub(needle.len());
                        tail.drain(..keep);
                        if seen {
                            let taken = hold.lock().unwrap().take();
                            if let Some((caught, release)) = taken {
                                let _ = caught.send(());
                                let _ = release.await;
                            }
                        }
                        if server_write.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        })
        .abort_handle();
        HoldingProxy {
            addr,
            armed,
            accept,
        }
    }

    /// Holds the next packet with the needle: the first receiver fires when it is held, the
    /// sender lets it through.
    fn arm(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (caught_tx, caught_rx) = oneshot::channel();
        let (release_tx, release_rx) = oneshot::channel();
        *self.armed.lock().unwrap() = Some((caught_tx, release_rx));
        (caught_rx, release_tx)
    }
}

impl HoldingProxy {
    fn disarm(&self) {
        *self.armed.lock().unwrap() = None;
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn lsn(conn: impl Executor<'_, Database = sqlx::Postgres>, sql: &str) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Defect 1. A commit written but not yet flushed when a round reads (an asynchronous commit;
/// the WAL writer flushes only every `wal_writer_delay`) is past the end of what the slot
/// functions decode. The round that read nothing must not move the slot past it, however
/// long the advance takes (here: held by a proxy while another session flushes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_that_reads_nothing_never_moves_the_slot_past_a_written_unflushed_commit() {
    let (cluster, direct, slot) = logical(&[
        "wal_writer_delay = '10s'",
        "wal_writer_flush_after = '1GB'",
        "wal_buffers = '64kB'",
        "autovacuum = off",
        "checkpoint_timeout = '1h'",
    ])
    .await;
    let proxy = HoldingProxy::start(cluster.addr(), b"pg_replication_slot_advance").await;
    let through_proxy = pool(&format!("postgres://postgres@{}/postgres", proxy.addr)).await;
    let broker = Broker::default();
    let relay = Arc::new(
        WalRelay::builder(through_proxy.clone(), slot.clone(), broker.clone())
            // The defect was the SQL-function reader's advance (the proxy holds it); the
            // streaming reader's twin is in tests/wal_stream.rs.
            .reader(WalReader::SqlFunctions)
            .build()
            .unwrap(),
    );
    assert!(relay.relay_once().await.unwrap().reader);
    direct
        .execute("CREATE TABLE flusher (x int)")
        .await
        .unwrap();
    let mut producer = PgConnection::connect(&cluster.url("postgres"))
        .await
        .unwrap();
    producer
        .execute("SET synchronous_commit = off")
        .await
        .unwrap();
    let wal = Outbox::new().mode(OutboxMode::Wal);

    let mut sent = Vec::new();
    let mut reproduced = 0;
    for attempt in 0..8 {
        // A fresh segment (finishing one fsyncs it), everything so far flushed.
        direct.execute("SELECT pg_switch_wal()").await.unwrap();
        direct
            .execute("INSERT INTO flusher VALUES (1)")
            .await
            .unwrap();
        // The relay has published everything before: its next round finds nothing.
        relay.drain().await.unwrap();
        // The message, committed asynchronously: its commit record waits for the WAL writer.
        let text = format!("async-{attempt}");
        let mut tx = producer.begin().await.unwrap();
        wal.enqueue(&mut tx, Message::bytes("wal", text.clone().into_bytes()))
            .await
            .unwrap();
        let before_commit = lsn(&mut *tx, "SELECT pg_current_wal_insert_lsn()::text").await;
        tx.commit().await.unwrap();
        let after_commit = lsn(&mut producer, "SELECT pg_current_wal_insert_lsn()::text").await;
        sent.push(text);
        // More WAL than wal_buffers, without a commit record: the buffers holding the commit
        // are written out, not flushed.
        for _ in 0..4 {
            direct
                .execute("SELECT pg_logical_emit_message(false, 'pad', repeat('x', 100000))")
                .await
                .unwrap();
        }
        let written: bool = sqlx::query_scalar(
            "SELECT pg_current_wal_lsn() >= $1::pg_lsn AND pg_current_wal_flush_lsn() < $2::pg_lsn",
        )
        .bind(&after_commit)
        .bind(&before_commit)
        .fetch_one(&direct)
        .await
        .unwrap();
        if !written {
            continue; // the WAL writer flushed in between: try again
        }
        let (caught, release) = proxy.arm();
        let mut round = tokio::spawn({
            let relay = relay.clone();
            async move { relay.relay_once().await }
        });
        // Either the round's advance is held (the read is done, the advance is on its way),
        // or the round ended without one (a read that found nothing may leave the slot).
        let held = tokio::select! {
            _ = caught => true,
            r = &mut round => {
                r.unwrap().unwrap();
                false
            }
        };
        // Was the commit still unflushed when the round read? (The flush position only grows.)
        let unflushed: bool = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn() < $1::pg_lsn")
            .bind(&before_commit)
            .fetch_one(&direct)
            .await
            .unwrap();
        if unflushed {
            reproduced += 1;
        }
        // Another session commits synchronously: the commit is flushed before a held advance
        // arrives.
        direct
            .execute("INSERT INTO flusher VALUES (2)")
            .await
            .unwrap();
        if held {
            let _ = release.send(());
            round.await.unwrap().unwrap();
        }
        proxy.disarm();
    }
    assert!(
        reproduced > 0,
        "no round read while a commit was written but unflushed in 8 attempts"
    );
    let report = relay.drain().await.unwrap();
    let published = broker.published();
    assert_eq!(
        published, sent,
        "every committed message is published ({reproduced} rounds read before a commit's flush; drain {report:?})"
    );
    drop(producer);
}

/// Defect 2. 1,500 messages of one emit, all refused for good: 1,500 dead letters, each its
/// own row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_1024_refused_messages_of_one_emit_are_all_dead_lettered() {
    let (_cluster, pool, slot) = logical(&[]).await;
    let n = 1_500;
    emit(
        &pool,
        (0..n)
            .map(|i| Message::bytes("t", format!("m{i}").into_bytes()))
            .collect(),
    )
    .await;
    let broker = Broker::default();
    broker.set(|s| s.refuse_all = true);
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(1)
        .backoff(quick())
        .build()
        .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.dead_lettered, n, "{report:?}");
    let dead = dead_letters(&pool).await;
    assert_eq!(dead.len(), n, "dead letters in the table");
    // In their emit's order, each once.
    let expected: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    let got: Vec<String> = dead.into_iter().map(|(p, _, _)| p).collect();
    assert_eq!(got, expected);
}

/// Defect 3. m1 and m2 (key A) and m3 (key B) in one transaction, only m1 refused: m1 is
/// dead-lettered after `max_attempts` refusals, m2 is offered and published, never counted
/// while it waited behind m1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_behind_a_refused_one_of_its_key_is_offered_not_dead_lettered() {
    let (_cluster, pool, slot) = logical(&[]).await;
    emit(
        &pool,
        vec![keyed("m1", "A"), keyed("m2", "A"), keyed("m3", "B")],
    )
    .await;
    let broker = Broker::default();
    broker.set(|s| {
        s.refuse.insert("m1".into());
    });
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(3)
        .backoff(quick())
        .build()
        .unwrap();
    for _ in 0..20 {
        let round = relay.relay_once().await.unwrap();
        if round.read == 0 {
            break;
        }
    }
    let dead = dead_letters(&pool).await;
    assert_eq!(dead.len(), 1, "only m1 is dead-lettered: {dead:?}");
    assert_eq!((dead[0].0.as_str(), dead[0].1), ("m1", 3), "{dead:?}");
    assert_eq!(dead[0].2, "refused by the broker");
    assert_eq!(broker.published_of("A"), ["m2"]);
    assert!(broker.published_of("B").contains(&"m3".to_string()));
    let offered = broker.offered();
    let m1_offers = offered.iter().filter(|p| *p == "m1").count();
    assert_eq!(m1_offers, 3, "m1 offered max_attempts times: {offered:?}");
    let last_m1 = offered.iter().rposition(|p| p == "m1").unwrap();
    let first_m2 = offered.iter().position(|p| p == "m2").unwrap();
    assert!(
        last_m1 < first_m2,
        "m2 offered only after m1 was settled: {offered:?}"
    );
}

/// Defect 4. Three WAL messages of one key, in three transactions, dead-lettered; replayed:
/// the WAL relay (no table relay anywhere) publishes them in their original order. Without a
/// slot to read them, replay refuses, typed, and keeps the dead letters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_wal_dead_letters_come_back_in_order_through_the_wal_relay() {
    let (_cluster, pool, slot) = logical(&[]).await;
    for p in ["k1", "k2", "k3"] {
        emit(&pool, vec![keyed(p, "A")]).await;
    }
    let broker = Broker::default();
    broker.set(|s| s.refuse_all = true);
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(1)
        .backoff(quick())
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    assert_eq!(dead_letters(&pool).await.len(), 3);
    let dead = DeadLetters::new(pool.clone());
    let listed: Vec<Vec<u8>> = {
        let ids: Vec<_> = dead
            .list(10)
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.message_id)
            .collect();
        let mut payloads = Vec::new();
        for id in ids {
            payloads.push(dead.get(id).await.unwrap().unwrap().1);
        }
        payloads
    };
    assert_eq!(
        listed,
        [b"k1".to_vec(), b"k2".to_vec(), b"k3".to_vec()],
        "listed oldest first"
    );

    broker.set(|s| s.refuse_all = false);
    assert_eq!(dead.replay_all().await.unwrap(), 3);
    relay.drain().await.unwrap();
    assert_eq!(broker.published_of("A"), ["k1", "k2", "k3"]);
    assert!(dead_letters(&pool).await.is_empty());
    let in_table: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(in_table, 0, "nothing waits for a table relay");

    // No logical slot in the database: the replay would emit into WAL nobody reads.
    broker.set(|s| s.refuse_all = true);
    emit(&pool, vec![keyed("k4", "A")]).await;
    relay.drain().await.unwrap();
    assert_eq!(dead_letters(&pool).await.len(), 1);
    drop(relay); // its reader's session ends, and the slot is free to drop
    let mut dropped = false;
    for _ in 0..100 {
        if slot.drop(&pool).await.is_ok() {
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(dropped);
    let err = dead.replay_all().await.unwrap_err();
    assert!(matches!(err, Error::WalSlot { .. }), "{err:?}");
    assert!(err.to_string().contains("slot"), "{err}");
    assert_eq!(dead_letters(&pool).await.len(), 1, "kept");
}

/// Defect 5. A WAL dead letter of key A does not hold table-mode messages of key A in the
/// same schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_dead_letter_does_not_hold_table_mode_messages_of_its_key() {
    let (_cluster, pool, slot) = logical(&[]).await;
    emit(&pool, vec![keyed("wal-1", "A")]).await;
    let broker = Broker::default();
    broker.set(|s| {
        s.refuse.insert("wal-1".into());
    });
    WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(1)
        .build()
        .unwrap()
        .drain()
        .await
        .unwrap();
    assert_eq!(dead_letters(&pool).await.len(), 1);
    let mut tx = pool.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, keyed("table-1", "A"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let report = Relay::builder(pool.clone(), broker.clone())
        .build()
        .unwrap()
        .drain()
        .await
        .unwrap();
    assert_eq!(broker.published_of("A"), ["table-1"], "{report:?}");
}

/// Defect 11 on the WAL relay. The transport is unreachable for three times the whole retry
/// budget (`max_attempts(2)`), then back: nothing is dead-lettered, everything is delivered,
/// each key in order; the rounds say it was an outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_retry_budget_dead_letters_nothing() {
    let (_cluster, pool, slot) = logical(&[]).await;
    emit(
        &pool,
        vec![
            keyed("a1", "A"),
            keyed("b1", "B"),
            Message::bytes("t", b"u1".to_vec()),
            keyed("a2", "A"),
        ],
    )
    .await;
    emit(&pool, vec![keyed("b2", "B"), keyed("a3", "A")]).await;
    counter(pgbox::telemetry::WAL_RELAY_UNAVAILABLE); // installed, and drained
    let broker = Broker::default();
    broker.set(|s| s.down = true);
    let relay = WalRelay::builder(pool.clone(), slot.clone(), broker.clone())
        .max_attempts(2)
        .backoff(quick())
        .build()
        .unwrap();
    let mut outage_rounds = 0;
    for _ in 0..6 {
        let round = relay.relay_once().await.unwrap();
        assert_eq!(round.published, 0);
        assert_eq!(round.dead_lettered, 0, "{round:?}");
        assert_eq!(round.retried, 0, "an outage is no refusal: {round:?}");
        // The first of each key and the unkeyed one were offered; the rest waited.
        assert_eq!(round.unavailable, 3, "{round:?}");
        outage_rounds += 1;
    }
    assert_eq!(outage_rounds, 6);
    assert_eq!(
        counter(pgbox::telemetry::WAL_RELAY_UNAVAILABLE),
        18,
        "3 per round"
    );
    assert!(
        dead_letters(&pool).await.is_empty(),
        "an outage is not the messages' failure"
    );
    broker.set(|s| s.down = false);
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 6, "{report:?}");
    assert!(dead_letters(&pool).await.is_empty());
    assert_eq!(broker.published_of("A"), ["a1", "a2", "a3"]);
    assert_eq!(broker.published_of("B"), ["b1", "b2"]);
    assert!(broker.published().contains(&"u1".to_string()));
}
