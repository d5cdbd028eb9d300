//! Attacks on the `Consumer` runner's failure counting (src/consumer/mod.rs, `AwayTally`,
//! `retry_while_away`, `retry_not_before`).
//!
//! The promise (README, "The consumer runner"; rustdoc of `ConsumerBuilder::max_deliveries`):
//! - A delivery that failed because the inbox's database could not take it (its claim or
//!   commit lost the connection, no connection could be had, a read-only standby) is nacked
//!   with backoff but never dead-lettered for that, however many deliveries it had.
//! - Nor do those deliveries count later: the runner subtracts the deliveries it saw lost to
//!   an away database before comparing with `max_deliveries`, in transaction and lease mode
//!   alike, so one ordinary failure after a long outage is not the last.
//! - A handler that fails for its own reason is dead-lettered after `max_deliveries` of its
//!   own failures (panics are failures), in batch mode too.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbox::transport::{PgQueue, Publisher, conformance};
use pgbox::{CancellationToken, Consumer, Envelope, HandlerConnection, Inbox, Lease, RetryPolicy};
use sqlx::postgres::{PgPool, PgPoolOptions};
use support::TestDb;
use support::brokers::{self, Proxy};
use tokio::sync::Notify;

fn nowhere() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
}

struct Rig {
    queue_db: TestDb,
    inbox_db: TestDb,
    proxy: Proxy,
    server: SocketAddr,
    inbox_pool: PgPool,
}

impl Rig {
    /// The queue in its own database; the inbox in another, reached through `proxy`, which
    /// starts pointed at the server (`away == false`) or nowhere.
    async fn new(away: bool) -> Rig {
        support::init_tracing();
        let queue_db = TestDb::migrated().await;
        let inbox_db = TestDb::migrated().await;
        let server = brokers::address(&support::server_url().await);
        let proxy = Proxy::start(if away { nowhere() } else { server }).await;
        let inbox_pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_millis(200))
            .connect_lazy_with(
                inbox_db
                    .options
                    .clone()
                    .host("127.0.0.1")
                    .port(proxy.addr().port()),
            );
        Rig {
            queue_db,
            inbox_db,
            proxy,
            server,
            inbox_pool,
        }
    }

    fn away(&self) {
        self.proxy.retarget(nowhere());
        self.proxy.cut();
    }

    fn back(&self) {
        self.proxy.retarget(self.server);
    }

    async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(&self.queue_db.pool)
            .await
            .unwrap()
    }

    async fn dead(&self) -> i64 {
        self.scalar("SELECT count(*) FROM pgbox.queue_dead_letters")
            .await
    }

    async fn left(&self) -> i64 {
        self.scalar("SELECT count(*) FROM pgbox.queue").await
    }

    async fn wait(&self, what: &str, mut done: impl AsyncFnMut(&Rig) -> bool) {
        for _ in 0..6_000 {
            if done(self).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("waited in vain: {what}");
    }

    async fn publish(&self, topic: &str, payloads: &[&str]) -> Vec<uuid::Uuid> {
        let queue = PgQueue::new(self.queue_db.pool.clone());
        let envs: Vec<Envelope> = payloads
            .iter()
            .map(|p| conformance::envelope(topic, *p))
            .collect();
        let ids = envs.iter().map(|e| e.id).collect();
        for r in queue.publish(&envs).await {
            r.unwrap();
        }
        ids
    }

    fn consumer(&self, topic: &str, max: i32, batch: usize) -> Consumer<PgQueue> {
        Consumer::builder(
            self.inbox_pool.clone(),
            PgQueue::new(self.queue_db.pool.clone()),
            topic,
            Inbox::new("attack").unwrap(),
        )
        .max_deliveries(max)
        .concurrency(8)
        .batch_size(batch)
        .poll_interval(Duration::from_millis(10))
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5)),
        )
        .build()
        .unwrap()
    }
}

type Calls = Arc<Mutex<HashMap<uuid::Uuid, usize>>>;

fn call(calls: &Calls, id: uuid::Uuid) -> usize {
    let mut c = calls.lock().unwrap();
    let n = c.entry(id).or_default();
    *n += 1;
    *n
}

fn ordinary() -> pgbox::Error {
    pgbox::Error::InvalidConfig("an ordinary failure of the handler".into())
}

/// The payload says how the handler behaves: "bad" always fails, "once" fails its first
/// call, "panic" always panics, anything else succeeds.
fn verdict(payload: &[u8], n: usize) -> Result<(), pgbox::Error> {
    match payload {
        b"bad" => Err(ordinary()),
        b"once" if n == 1 => Err(ordinary()),
        b"panic" => panic!("a handler panic"),
        _ => Ok(()),
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Transaction,
    Batch,
    Lease,
}

/// A long outage of the inbox's database from the start (many more deliveries than the
/// budget), then back. Healthy and fail-once messages are processed; always-failing ones
/// are dead-lettered after exactly `max` calls of their handler.
async fn long_outage_then_mixed_handlers(mode: Mode) {
    let rig = Rig::new(true).await;
    let topic = "attack.mixed";
    let payloads = [
        "good", "once", "bad", "good", "once", "panic", "good", "bad",
    ];
    let ids = rig.publish(topic, &payloads).await;
    let max = 3;
    let consumer = rig.consumer(topic, max, if mode == Mode::Batch { 4 } else { 1 });
    let calls: Calls = Arc::default();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (calls, shutdown) = (calls.clone(), shutdown.clone());
        async move {
            match mode {
                Mode::Lease => {
                    consumer
                        .run_leased(
                            async move |m: &Envelope, _: &mut Lease| {
                                let n = call(&calls, m.id);
                                verdict(&m.payload, n)
                            },
                            Duration::from_secs(30),
                            shutdown,
                        )
                        .await
                }
                _ => {
                    consumer
                        .run(
                            async move |m: &Envelope, _: &mut HandlerConnection<'_>| {
                                let n = call(&calls, m.id);
                                verdict(&m.payload, n)
                            },
                            shutdown,
                        )
                        .await
                }
            }
        }
    });
    rig.wait("deliveries past the budget while away", async |r: &Rig| {
        r.scalar("SELECT coalesce(min(deliveries), 0)::int8 FROM pgbox.queue")
            .await
            > i64::from(max) + 3
    })
    .await;
    assert_eq!(
        rig.dead().await,
        0,
        "dead-lettered while the inbox was away"
    );
    assert!(calls.lock().unwrap().is_empty(), "a handler ran while away");
    rig.back();
    rig.wait("queue drained", async |r: &Rig| r.left().await == 0)
        .await;
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
    let calls = calls.lock().unwrap().clone();
    let dead: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT message_id FROM pgbox.queue_dead_letters")
            .fetch_all(&rig.queue_db.pool)
            .await
            .unwrap_or_default();
    let mut report = Vec::new();
    for (p, id) in payloads.iter().zip(&ids) {
        report.push(format!("{p}: calls {:?}", calls.get(id)));
    }
    let expected_dead = payloads
        .iter()
        .filter(|p| **p == "bad" || **p == "panic")
        .count() as i64;
    assert_eq!(
        rig.dead().await,
        expected_dead,
        "{mode:?}: {report:?} {stats:?} dead {dead:?}"
    );
    for (p, id) in payloads.iter().zip(&ids) {
        let n = calls.get(id).copied().unwrap_or(0);
        match *p {
            "bad" | "panic" => assert_eq!(
                n, max as usize,
                "{mode:?}: {p} ran {n} times, not max_deliveries: {report:?} {stats:?}"
            ),
            "once" => assert!(n >= 2, "{mode:?}: {report:?}"),
            _ => assert!(n >= 1, "{mode:?}: {report:?}"),
        }
    }
    let _ = &rig.inbox_db;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_outage_then_mixed_handlers_transaction_mode() {
    long_outage_then_mixed_handlers(Mode::Transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_outage_then_mixed_handlers_batch_mode() {
    long_outage_then_mixed_handlers(Mode::Batch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_outage_then_mixed_handlers_lease_mode() {
    long_outage_then_mixed_handlers(Mode::Lease).await;
}

/// Lease mode: the inbox's database goes away while the handler runs (its external effect
/// done), so the lease's completion finds the database away: an outage, nacked, not
/// counted. The lease it took cannot be released either and outlives the outage, so the
/// first delivery after the database is back finds the key "leased elsewhere" — by this
/// very runner's dead lease. That delivery is not the message's failure (the handler did
/// not run) and is not counted: with max_deliveries 2, one ordinary failure afterwards
/// does not dead-letter the message (it used to).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_left_by_an_outage_is_not_counted_against_the_message() {
    lease_left_by_an_outage(2, true).await;
}

/// The same with max_deliveries 1 and a handler that never fails: the delivery after the
/// outage that finds its own dead lease does not dead-letter a message whose effect
/// succeeded (it used to).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_left_by_an_outage_does_not_dead_letter_a_healthy_message() {
    lease_left_by_an_outage(1, false).await;
}

async fn lease_left_by_an_outage(max: i32, fail_once: bool) {
    let rig = Rig::new(false).await;
    let topic = "attack.lease";
    rig.publish(topic, &["x"]).await;
    let consumer = rig.consumer(topic, max, 1);
    let calls: Calls = Arc::default();
    let entered = Arc::new(Notify::new());
    let go = Arc::new(Notify::new());
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (calls, shutdown, entered, go) =
            (calls.clone(), shutdown.clone(), entered.clone(), go.clone());
        async move {
            consumer
                .run_leased(
                    async move |m: &Envelope, _: &mut Lease| {
                        match call(&calls, m.id) {
                            1 => {
                                // The effect is done; then the database goes away.
                                entered.notify_one();
                                go.notified().await;
                                Ok(())
                            }
                            2 if fail_once => Err(ordinary()),
                            _ => Ok(()),
                        }
                    },
                    Duration::from_secs(8),
                    shutdown,
                )
                .await
        }
    });
    tokio::time::timeout(Duration::from_secs(30), entered.notified())
        .await
        .expect("handler entered");
    rig.away();
    go.notify_one();
    rig.wait("redelivered while away", async |r: &Rig| {
        r.scalar("SELECT coalesce(max(deliveries), 0)::int8 FROM pgbox.queue")
            .await
            >= 2
    })
    .await;
    rig.back();
    rig.wait("acked or dead-lettered", async |r: &Rig| {
        r.left().await == 0
    })
    .await;
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
    let n = calls.lock().unwrap().values().sum::<usize>();
    let dead_reason: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM pgbox.queue_dead_letters LIMIT 1")
            .fetch_optional(&rig.queue_db.pool)
            .await
            .unwrap_or(None);
    assert_eq!(
        rig.dead().await,
        0,
        "dead-lettered (max_deliveries {max}, own failures {}): handler calls {n}, \
         {stats:?}, reason {dead_reason:?}",
        u8::from(fail_once)
    );
}

/// Transaction mode: the inbox's database goes away while the handler runs, so the
/// handler's own statement on the inbox's transaction loses the connection and the handler
/// returns that error. The database was away, the message is fine; but the delivery is
/// counted as the message's failure. With max_deliveries 2, one ordinary failure after the
/// database is back dead-letters it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_statement_cut_by_an_outage_is_not_counted_against_the_message() {
    let rig = Rig::new(false).await;
    let topic = "attack.cut";
    rig.publish(topic, &["x"]).await;
    let consumer = rig.consumer(topic, 2, 1);
    let calls: Calls = Arc::default();
    let entered = Arc::new(Notify::new());
    let go = Arc::new(Notify::new());
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (calls, shutdown, entered, go) =
            (calls.clone(), shutdown.clone(), entered.clone(), go.clone());
        async move {
            consumer
                .run(
                    async move |m: &Envelope, conn: &mut HandlerConnection<'_>| match call(
                        &calls, m.id,
                    ) {
                        1 => {
                            entered.notify_one();
                            go.notified().await;
                            sqlx::query("SELECT 1")
                                .execute(&mut *conn)
                                .await
                                .map_err(pgbox::Error::from)?;
                            Ok(())
                        }
                        2 => Err(ordinary()),
                        _ => Ok(()),
                    },
                    shutdown,
                )
                .await
        }
    });
    tokio::time::timeout(Duration::from_secs(30), entered.notified())
        .await
        .expect("handler entered");
    rig.away();
    go.notify_one();
    rig.wait("redelivered while away", async |r: &Rig| {
        r.scalar("SELECT coalesce(max(deliveries), 0)::int8 FROM pgbox.queue")
            .await
            >= 3
    })
    .await;
    rig.back();
    rig.wait("acked or dead-lettered", async |r: &Rig| {
        r.left().await == 0
    })
    .await;
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
    let n = calls.lock().unwrap().values().sum::<usize>();
    let dead_reason: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM pgbox.queue_dead_letters LIMIT 1")
            .fetch_optional(&rig.queue_db.pool)
            .await
            .unwrap_or(None);
    assert_eq!(
        rig.dead().await,
        0,
        "dead-lettered after 1 failure of its own (max_deliveries 2): handler calls {n}, \
         {stats:?}, reason {dead_reason:?}"
    );
}

/// An always-failing message whose own failures interleave with an outage: two own
/// failures, then the database away for many deliveries, then back. It is dead-lettered
/// after exactly max_deliveries calls of its handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_failures_interleaved_with_an_outage_dead_letter_after_exactly_max() {
    let rig = Rig::new(false).await;
    let topic = "attack.interleave";
    rig.publish(topic, &["bad"]).await;
    let max = 4;
    let consumer = rig.consumer(topic, max, 1);
    let calls: Calls = Arc::default();
    let shutdown = CancellationToken::new();
    let second = Arc::new(Notify::new());
    let go = Arc::new(Notify::new());
    let run = tokio::spawn({
        let (calls, shutdown, second, go) =
            (calls.clone(), shutdown.clone(), second.clone(), go.clone());
        async move {
            consumer
                .run(
                    async move |m: &Envelope, _: &mut HandlerConnection<'_>| {
                        if call(&calls, m.id) == 2 {
                            second.notify_one();
                            go.notified().await;
                        }
                        Err::<(), _>(ordinary())
                    },
                    shutdown,
                )
                .await
        }
    });
    tokio::time::timeout(Duration::from_secs(30), second.notified())
        .await
        .expect("second call");
    // The second failure happens (its rollback may already find the database away).
    rig.away();
    go.notify_one();
    rig.wait("many deliveries while away", async |r: &Rig| {
        r.scalar("SELECT coalesce(max(deliveries), 0)::int8 FROM pgbox.queue")
            .await
            >= 12
    })
    .await;
    rig.back();
    rig.wait("dead-lettered", async |r: &Rig| r.left().await == 0)
        .await;
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
    let n = calls.lock().unwrap().values().sum::<usize>();
    assert_eq!(rig.dead().await, 1, "{stats:?}");
    assert_eq!(
        n, max as usize,
        "handler calls before the dead letter: {stats:?}"
    );
}

/// The relay is at least once: the same message (same id) can sit in the queue twice. The
/// tally used to be one count per message id, so the away deliveries of both copies were
/// taken off each copy's count (27 handler calls for max_deliveries 3). Each copy runs its
/// handler max_deliveries times, whatever the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_of_a_failing_message_each_run_max_deliveries_times() {
    let rig = Rig::new(true).await;
    let topic = "attack.copies";
    let queue = PgQueue::new(rig.queue_db.pool.clone());
    let env = conformance::envelope(topic, "bad");
    for r in queue.publish(&[env.clone(), env.clone()]).await {
        r.unwrap();
    }
    let copies = rig.left().await;
    let max = 3;
    let consumer = rig.consumer(topic, max, 1);
    let calls: Calls = Arc::default();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (calls, shutdown) = (calls.clone(), shutdown.clone());
        async move {
            consumer
                .run(
                    async move |m: &Envelope, _: &mut HandlerConnection<'_>| {
                        call(&calls, m.id);
                        Err::<(), _>(ordinary())
                    },
                    shutdown,
                )
                .await
        }
    });
    rig.wait("deliveries while away", async |r: &Rig| {
        r.scalar("SELECT coalesce(min(deliveries), 0)::int8 FROM pgbox.queue")
            .await
            >= 10
    })
    .await;
    rig.back();
    rig.wait("dead-lettered", async |r: &Rig| r.left().await == 0)
        .await;
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
    let n = calls.lock().unwrap().values().sum::<usize>();
    let per_copy: Vec<i32> =
        sqlx::query_scalar("SELECT deliveries FROM pgbox.queue_dead_letters ORDER BY seq")
            .fetch_all(&rig.queue_db.pool)
            .await
            .unwrap();
    assert_eq!(rig.dead().await, copies, "{stats:?}");
    assert_eq!(
        n,
        max as usize * copies as usize,
        "{copies} copies, max_deliveries {max}: handler calls {n}; deliveries at the dead \
         letter {per_copy:?}; {stats:?}"
    );
}

/// The queue in the inbox's own database, both through the proxy: the database goes away
/// while the handler runs, so the commit, the nack and the receives all fail; the message
/// comes back after the visibility timeout. One ordinary failure after that is not the
/// last (max_deliveries 2), and the effect is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_in_the_inbox_database_outage_mid_handler_then_one_failure() {
    let rig = Rig::new(false).await;
    sqlx::query("CREATE TABLE effects (message_id uuid NOT NULL)")
        .execute(&rig.inbox_db.pool)
        .await
        .unwrap();
    let topic = "attack.samedb";
    // Published into the inbox's database directly.
    let direct = PgQueue::new(rig.inbox_db.pool.clone());
    for r in direct.publish(&[conformance::envelope(topic, "x")]).await {
        r.unwrap();
    }
    let consumer = Consumer::builder(
        rig.inbox_pool.clone(),
        PgQueue::new(rig.inbox_pool.clone()),
        topic,
        Inbox::new("attack").unwrap(),
    )
    .max_deliveries(2)
    .concurrency(2)
    .visibility_timeout(Duration::from_millis(300))
    .poll_interval(Duration::from_millis(10))
    .backoff(
        RetryPolicy::new()
            .base_delay(Duration::from_millis(1))
            .max_delay(Duration::from_millis(5)),
    )
    .build()
    .unwrap();
    let calls: Calls = Arc::default();
    let entered = Arc::new(Notify::new());
    let go = Arc::new(Notify::new());
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (calls, shutdown, entered, go) =
            (calls.clone(), shutdown.clone(), entered.clone(), go.clone());
        async move {
            consumer
                .run(
                    async move |m: &Envelope, conn: &mut HandlerConnection<'_>| {
                        let n = call(&calls, m.id);
                        if n == 2 {
                            return Err(ordinary());
                        }
                        sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                            .bind(m.id)
                            .execute(&mut *conn)
                            .await
                            .map_err(pgbox::Error::from)?;
                        if n == 1 {
                            // The effect is written; the commit will find the database away.
                            entered.notify_one();
                            go.notified().await;
                        }
                        Ok::<(), pgbox::Error>(())
                    },
                    shutdown,
                )
                .await
        }
    });
    tokio::time::timeout(Duration::from_secs(30), entered.notified())
        .await
        .expect("handler entered");
    rig.away();
    // The commit goes out on a connection that is gone; stay away a while.
    go.notify_one();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    rig.back();
    let inbox = &rig.inbox_db.pool;
    let mut done = false;
    for _ in 0..6_000 {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
            .fetch_one(inbox)
            .await
            .unwrap();
        if left == 0 {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
    assert!(done, "neither acked nor dead-lettered: {stats:?}");
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue_dead_letters")
        .fetch_one(inbox)
        .await
        .unwrap();
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(inbox)
        .await
        .unwrap();
    let n = calls.lock().unwrap().values().sum::<usize>();
    assert_eq!(dead, 0, "handler calls {n}: {stats:?}");
    assert_eq!(effects, 1, "handler calls {n}: {stats:?}");
}

/// Not attempted, counted as an attempt: the relay is at least once, so a second copy of a
/// message can arrive while the first copy's lease-mode handler is still running (a long
/// effect, its lease extended as documented). Every delivery of the second copy finds the
/// key "leased elsewhere"; the handler never runs for it, and such deliveries do not count:
/// the copy is not dead-lettered for a message whose effect succeeded (it used to be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_elsewhere_deliveries_do_not_count_against_a_copy() {
    let rig = Rig::new(false).await;
    let topic = "attack.leased";
    let queue = PgQueue::new(rig.queue_db.pool.clone());
    let env = conformance::envelope(topic, "x");
    for r in queue.publish(&[env.clone(), env.clone()]).await {
        r.unwrap();
    }
    let consumer = rig.consumer(topic, 3, 1);
    let calls: Calls = Arc::default();
    let shutdown = CancellationToken::new();
    let pool = rig.inbox_pool.clone();
    let run = tokio::spawn({
        let (calls, shutdown) = (calls.clone(), shutdown.clone());
        async move {
            consumer
                .run_leased(
                    async move |m: &Envelope, lease: &mut Lease| {
                        call(&calls, m.id);
                        // A long effect, its lease kept alive.
                        for _ in 0..15 {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            lease.extend(&pool, Duration::from_millis(500)).await?;
                        }
                        Ok::<(), pgbox::Error>(())
                    },
                    Duration::from_millis(500),
                    shutdown,
                )
                .await
        }
    });
    rig.wait("both copies settled", async |r: &Rig| r.left().await == 0)
        .await;
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
    let n = calls.lock().unwrap().values().sum::<usize>();
    let reason: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM pgbox.queue_dead_letters LIMIT 1")
            .fetch_optional(&rig.queue_db.pool)
            .await
            .unwrap_or(None);
    assert_eq!(
        rig.dead().await,
        0,
        "handler calls {n} (none failed); {stats:?}; dead letter's reason {reason:?}"
    );
}
