//! Defects found by an adversarial review (issue 9), each pinned by a test that failed
//! before its fix. Real PostgreSQL throughout.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    CancellationToken, Claim, Consumer, Envelope, Error, Inbox, Message, Migrator, Outbox, Relay,
    StateMachine, StateTable, Transition, WakeUp,
};
use sqlx::{Connection, Executor, PgPool};
use support::TestDb;

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Records what it was asked to publish, call by call; fails the messages whose payload is
/// listed in `fail` (a per-message broker, not an atomic one).
#[derive(Clone, Default)]
struct Recorder {
    calls: Arc<Mutex<Vec<Vec<Envelope>>>>,
    fail: Arc<Mutex<Vec<Vec<u8>>>>,
    atomic: bool,
}

impl Recorder {
    fn published(&self) -> Vec<Envelope> {
        let fail = self.fail.lock().unwrap().clone();
        self.calls
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .filter(|e| !fail.contains(&e.payload))
            .cloned()
            .collect()
    }
}

impl Publisher for Recorder {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        self.calls.lock().unwrap().push(batch.to_vec());
        let fail = self.fail.lock().unwrap().clone();
        batch
            .iter()
            .map(|e| {
                if fail.contains(&e.payload) {
                    Err(PublishError::refused("refused"))
                } else {
                    Ok(())
                }
            })
            .collect()
    }

    fn atomic_batches(&self) -> bool {
        self.atomic
    }
}

async fn enqueue_keyed(pool: &PgPool, keys: usize, per_key: usize) {
    let outbox = Outbox::new();
    let mut tx = pool.begin().await.unwrap();
    let messages = (0..per_key).flat_map(|n| {
        (0..keys)
            .map(move |k| Message::bytes("t", format!("{k}:{n}")).ordering_key(format!("k{k}")))
    });
    outbox.enqueue_batch(&mut tx, messages).await.unwrap();
    tx.commit().await.unwrap();
}

/// Per key, the payload numbers in the order they were published.
fn per_key_order(published: &[Envelope]) -> HashMap<String, Vec<usize>> {
    let mut order: HashMap<String, Vec<usize>> = HashMap::new();
    for e in published {
        let text = String::from_utf8(e.payload.clone()).unwrap();
        let (_, n) = text.split_once(':').unwrap();
        order
            .entry(e.ordering_key.clone().unwrap())
            .or_default()
            .push(n.parse().unwrap());
    }
    order
}

// --- 1. keyed drain -----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_backlog_drains_at_full_speed_not_one_message_per_key_per_poll() {
    for atomic in [true, false] {
        let db = TestDb::migrated().await;
        enqueue_keyed(&db.pool, 3, 40).await;
        let recorder = Recorder {
            atomic,
            ..Recorder::default()
        };
        // A poll interval far beyond the test's patience: only draining can finish it.
        let relay = Relay::builder(db.pool.clone(), recorder.clone())
            .wake_up(WakeUp::Poll)
            .poll_interval(Duration::from_secs(3600))
            .batch_size(10)
            .build()
            .unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let s = shutdown.clone();
            async move { relay.run(s).await }
        });
        let start = Instant::now();
        while recorder.published().len() < 120 && start.elapsed() < Duration::from_secs(20) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shutdown.cancel();
        task.await.unwrap().unwrap();
        let published = recorder.published();
        assert_eq!(
            published.len(),
            120,
            "atomic={atomic}: the backlog did not drain"
        );
        for (key, order) in per_key_order(&published) {
            assert_eq!(order, (0..40).collect::<Vec<_>>(), "key {key} out of order");
        }
        assert_eq!(
            count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
            0
        );
    }
}

#[tokio::test]
async fn one_round_publishes_a_run_of_one_key_in_order() {
    for atomic in [true, false] {
        let db = TestDb::migrated().await;
        enqueue_keyed(&db.pool, 1, 5).await;
        let recorder = Recorder {
            atomic,
            ..Recorder::default()
        };
        let relay = Relay::builder(db.pool.clone(), recorder.clone())
            .build()
            .unwrap();
        let report = relay.relay_once().await.unwrap();
        assert_eq!(report.published, 5, "one round, five messages of one key");
        assert_eq!(
            per_key_order(&recorder.published())["k0"],
            vec![0, 1, 2, 3, 4]
        );
        // An atomic publisher gets them in one call; a per-message one in five, each after
        // the previous was confirmed.
        let calls = recorder.calls.lock().unwrap().len();
        assert_eq!(calls, if atomic { 1 } else { 5 });
    }
}

#[tokio::test]
async fn a_key_stops_at_its_first_failure_and_later_messages_are_not_sent() {
    let db = TestDb::migrated().await;
    enqueue_keyed(&db.pool, 2, 5).await;
    let recorder = Recorder {
        atomic: false,
        ..Recorder::default()
    };
    recorder.fail.lock().unwrap().push(b"0:2".to_vec());
    let relay = Relay::builder(db.pool.clone(), recorder.clone())
        .build()
        .unwrap();
    let report = relay.relay_once().await.unwrap();
    assert_eq!(report.claimed, 10);
    assert_eq!(report.published, 7, "k0: 0 and 1; k1: all five");
    assert_eq!(report.retried, 1);
    // k0's messages 3 and 4 never reached the publisher: they must not overtake message 2.
    let sent: Vec<Vec<u8>> = recorder
        .calls
        .lock()
        .unwrap()
        .iter()
        .flatten()
        .map(|e| e.payload.clone())
        .collect();
    assert!(!sent.contains(&b"0:3".to_vec()) && !sent.contains(&b"0:4".to_vec()));
    let untouched: i64 = count(
        &db.pool,
        "SELECT count(*) FROM pgbox.outbox WHERE ordering_key = 'k0' AND attempts = 0",
    )
    .await;
    assert_eq!(untouched, 2, "not attempted, so no attempt counted");
    // The failed head is in backoff: its key is held, nothing else of it goes out. (The
    // backoff is jittered down to zero, so push it out of reach rather than race it.)
    sqlx::query(
        "UPDATE pgbox.outbox SET available_at = now() + interval '1 hour' \
         WHERE ordering_key = 'k0' AND attempts = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(relay.relay_once().await.unwrap().claimed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_relays_never_publish_a_key_out_of_order() {
    let db = TestDb::migrated().await;
    enqueue_keyed(&db.pool, 4, 150).await;
    let recorder = Recorder {
        atomic: false,
        ..Recorder::default()
    };
    let shutdown = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let relay = Relay::builder(db.pool.clone(), recorder.clone())
            .batch_size(7)
            .wake_up(WakeUp::Poll)
            .poll_interval(Duration::from_millis(20))
            .build()
            .unwrap();
        let s = shutdown.clone();
        tasks.push(tokio::spawn(async move { relay.run(s).await }));
    }
    let start = Instant::now();
    while recorder.published().len() < 600 && start.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let published = recorder.published();
    assert_eq!(published.len(), 600);
    for (key, order) in per_key_order(&published) {
        assert_eq!(order, (0..150).collect::<Vec<_>>(), "key {key}");
    }
}

// --- 2. handler panics ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_a_failed_delivery_dead_lettered_after_max_deliveries() {
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (payload text PRIMARY KEY)")
        .await
        .unwrap();
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for p in ["a", "boom", "b", "c"] {
        outbox
            .enqueue(&mut tx, Message::bytes("jobs", p))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let queue = PgQueue::new(db.pool.clone());
    let relay = Relay::builder(db.pool.clone(), queue.clone())
        .build()
        .unwrap();
    relay.relay_once().await.unwrap();

    let consumer = Consumer::builder(
        db.pool.clone(),
        queue,
        "jobs",
        Inbox::new("panics").unwrap(),
    )
    .max_deliveries(3)
    .backoff(pgbox::RetryPolicy::new().base_delay(Duration::from_millis(10)))
    .poll_interval(Duration::from_millis(20))
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let s = shutdown.clone();
        async move {
            consumer
                .run(
                    async |e: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                        let text = String::from_utf8(e.payload.clone()).unwrap();
                        sqlx::query("INSERT INTO effects VALUES ($1)")
                            .bind(&text)
                            .execute(&mut *conn)
                            .await
                            .map_err(Error::from)?;
                        assert_ne!(text, "boom", "deterministic bug in the handler");
                        Ok::<(), Error>(())
                    },
                    s,
                )
                .await
        }
    });
    let start = Instant::now();
    while count(&db.pool, "SELECT count(*) FROM pgbox.queue_dead_letters").await < 1
        && start.elapsed() < Duration::from_secs(20)
        && !run.is_finished()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = run.await.expect("the runner survived the panics").unwrap();
    assert_eq!(stats.processed, 3);
    assert_eq!(stats.panicked, 3, "three deliveries, each panicked");
    assert_eq!(stats.dead_lettered, 1);
    let (deliveries, error): (i32, String) = sqlx::query_as(
        "SELECT deliveries, last_error FROM pgbox.queue_dead_letters WHERE payload = 'boom'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(deliveries, 3);
    assert!(error.contains("panicked"), "{error}");
    // The panicking deliveries' writes rolled back.
    assert_eq!(count(&db.pool, "SELECT count(*) FROM effects").await, 3);
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pgbox.inbox WHERE consumer = 'panics'"
        )
        .await,
        3
    );
}

// --- 3. and 7. state machine ---------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    Created,
    Paid,
    Shipped,
    /// Named by `next()` of no one and missing from STATES: a caller bug.
    Lost,
}

impl StateMachine for Order {
    const STATES: &'static [Self] = &[Order::Created, Order::Paid, Order::Shipped];
    fn name(self) -> &'static str {
        match self {
            Order::Created => "created",
            Order::Paid => "paid",
            Order::Shipped => "shipped",
            Order::Lost => "lost",
        }
    }
    fn next(self) -> &'static [Self] {
        match self {
            Order::Created => &[Order::Paid],
            Order::Paid => &[Order::Shipped],
            Order::Shipped | Order::Lost => &[],
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transition_that_waited_for_its_predecessor_applies_it() {
    let db = TestDb::migrated().await;
    db.pool
        .execute(
            "CREATE TABLE orders (id bigint PRIMARY KEY, status text); \
             INSERT INTO orders VALUES (1, 'created')",
        )
        .await
        .unwrap();
    let orders = Arc::new(StateTable::<Order>::new("orders").unwrap());
    let mut a = db.connect().await;
    let mut tx_a = a.begin().await.unwrap();
    assert_eq!(
        orders
            .transition(&mut tx_a, 1_i64, Order::Paid)
            .await
            .unwrap(),
        Transition::Applied {
            from: Order::Created
        }
    );
    let b = tokio::spawn({
        let orders = orders.clone();
        let mut conn = db.connect().await;
        async move {
            let mut tx = conn.begin().await.unwrap();
            let t = orders.transition(&mut tx, 1_i64, Order::Shipped).await;
            tx.commit().await.unwrap();
            t
        }
    });
    support::wait_for_lock_waiter(&db.pool).await;
    tx_a.commit().await.unwrap();
    assert_eq!(
        b.await.unwrap().unwrap(),
        Transition::Applied { from: Order::Paid }
    );
    let status: String = sqlx::query_scalar("SELECT status FROM orders WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "shipped");
}

#[tokio::test]
async fn state_table_edge_inputs_are_typed_errors_not_panics() {
    let db = TestDb::migrated().await;
    db.pool
        .execute(
            "CREATE TABLE orders (id bigint PRIMARY KEY, status text); \
             INSERT INTO orders VALUES (1, 'created'), (2, NULL)",
        )
        .await
        .unwrap();
    let orders = StateTable::<Order>::new("orders").unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let err = orders
        .transition(&mut conn, 1_i64, Order::Lost)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidStateMachine(_)), "{err:?}");
    // NULL status: one typed answer from both calls.
    let t = orders.transition(&mut conn, 2_i64, Order::Paid).await;
    assert!(matches!(t, Err(Error::NullState { .. })), "{t:?}");
    let c = orders.current(&mut conn, 2_i64).await;
    assert!(matches!(c, Err(Error::NullState { .. })), "{c:?}");
    // Missing rows stay `NotFound` / `None`.
    assert_eq!(
        orders
            .transition(&mut conn, 3_i64, Order::Paid)
            .await
            .unwrap(),
        Transition::NotFound
    );
    assert_eq!(orders.current(&mut conn, 3_i64).await.unwrap(), None);

    // A machine whose `next()` names a state missing from STATES is refused at construction.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Half {
        A,
        B,
    }
    impl StateMachine for Half {
        const STATES: &'static [Self] = &[Half::A];
        fn name(self) -> &'static str {
            match self {
                Half::A => "a",
                Half::B => "b",
            }
        }
        fn next(self) -> &'static [Self] {
            match self {
                Half::A => &[Half::B],
                Half::B => &[],
            }
        }
    }
    assert!(matches!(
        StateTable::<Half>::new("orders"),
        Err(Error::InvalidStateMachine(_))
    ));
}

// --- 4. long schema names -------------------------------------------------------------------

#[tokio::test]
async fn no_accepted_schema_name_can_make_enqueue_or_publish_fail() {
    let db = TestDb::empty().await;
    for len in 57..=63 {
        let name = "s".repeat(len);
        let err = Migrator::new().schema(&name).unwrap_err();
        assert!(
            matches!(err, Error::InvalidIdentifier { what: "schema", .. }),
            "{len}: {err:?}"
        );
        assert!(Outbox::with_schema(&name).is_err());
        assert!(Inbox::builder("c").schema(&name).build().is_err());
        assert!(PgQueue::with_schema(db.pool.clone(), &name).is_err());
        assert!(
            Relay::builder(db.pool.clone(), pgbox::transport::DiscardPublisher)
                .schema(&name)
                .build()
                .is_err()
        );
    }
    // The longest accepted name works end to end, NOTIFY triggers included.
    let name = "s".repeat(pgbox::MAX_PGBOX_SCHEMA_BYTES);
    Migrator::new()
        .schema(&name)
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let outbox = Outbox::with_schema(&name).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, Message::bytes("t", "x").ordering_key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let queue = PgQueue::with_schema(db.pool.clone(), &name).unwrap();
    let relay = Relay::builder(db.pool.clone(), queue.clone())
        .schema(&name)
        .build()
        .unwrap();
    assert_eq!(relay.relay_once().await.unwrap().published, 1);
    let got = queue
        .receive("t", 10, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
}

// --- 6. claim tokens ------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_claim_token_cannot_write_through_another_transaction() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("tokens").unwrap();
    // A claim that rolls back leaves its token behind.
    let mut conn = db.connect().await;
    let mut tx1 = conn.begin().await.unwrap();
    let Claim::Claimed(stale) = inbox.claim(&mut tx1, "k").await.unwrap() else {
        panic!("first claim");
    };
    tx1.rollback().await.unwrap();
    // Another transaction processes the key and commits.
    let mut tx2 = db.pool.begin().await.unwrap();
    let Claim::Claimed(good) = inbox.claim(&mut tx2, "k").await.unwrap() else {
        panic!("second claim");
    };
    good.store_outcome(&mut tx2, &"original").await.unwrap();
    tx2.commit().await.unwrap();
    // A third transaction starts; make the committed row look as if it was recorded at the
    // same microsecond (two BEGINs often share one): the old guard's blind spot.
    let mut tx3 = conn.begin().await.unwrap();
    let now: time::OffsetDateTime = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx3)
        .await
        .unwrap();
    sqlx::query("UPDATE pgbox.inbox SET processed_at = $1, outcome = NULL WHERE key = 'k'")
        .bind(now)
        .execute(&db.pool)
        .await
        .unwrap();
    let err = stale.reject(&mut tx3, "stale").await.unwrap_err();
    assert!(matches!(err, Error::NotClaimed { .. }), "{err:?}");
    tx3.commit().await.unwrap();
    let rejection: Option<String> =
        sqlx::query_scalar("SELECT rejection FROM pgbox.inbox WHERE key = 'k'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(rejection, None, "the stale token wrote through");
}

// --- 9. bad input ---------------------------------------------------------------------------

#[tokio::test]
async fn non_finite_numbers_in_outcomes_and_payloads_are_typed_errors() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("floats").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let err = inbox
        .process(&mut tx, "nan", async |_conn| {
            Ok::<_, Error>(BTreeMap::from([("ratio", f64::NAN)]))
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidField {
                field: "outcome",
                ..
            }
        ),
        "{err:?}"
    );
    tx.rollback().await.unwrap();
    assert_eq!(count(&db.pool, "SELECT count(*) FROM pgbox.inbox").await, 0);

    // Through a claim token the value is checked before any SQL: the transaction is usable.
    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Claimed(claimed) = inbox.claim(&mut tx, "inf").await.unwrap() else {
        panic!()
    };
    let err = claimed
        .store_outcome(&mut tx, &vec![1.0, f64::INFINITY])
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidField {
            field: "outcome",
            ..
        }
    ));
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();

    for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let err = Message::json("t", &serde_json::json!({"x": 1}))
            .map(|_| ())
            .and(Message::json("t", &BTreeMap::from([("x", value)])).map(|_| ()));
        assert!(
            matches!(
                err,
                Err(Error::InvalidField {
                    field: "payload",
                    ..
                })
            ),
            "{err:?}"
        );
    }
    // serde failures name what failed: the payload, not a handler outcome.
    let err = Message::json("t", &BTreeMap::from([((1, 2), 3)])).unwrap_err();
    assert!(matches!(err, Error::SerializePayload(_)), "{err:?}");
    let envelope_err = {
        let mut tx = db.pool.begin().await.unwrap();
        Outbox::new()
            .enqueue(&mut tx, Message::bytes("t", "not json"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let queue = PgQueue::new(db.pool.clone());
        Relay::builder(db.pool.clone(), queue.clone())
            .build()
            .unwrap()
            .relay_once()
            .await
            .unwrap();
        let d = queue.receive("t", 1, Duration::from_secs(5)).await.unwrap();
        d[0].envelope.json::<serde_json::Value>().unwrap_err()
    };
    assert!(matches!(envelope_err, Error::DeserializePayload(_)));
}

#[tokio::test]
async fn oversized_messages_are_refused_before_any_sql_and_not_retryable() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new().max_message_bytes(1024).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("CREATE TABLE business (n int)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = outbox
        .enqueue(&mut tx, Message::bytes("t", vec![7u8; 1025]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooLarge {
                what: "message",
                len: 1025,
                max: 1024
            }
        ),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    // Headers count too.
    let err = outbox
        .enqueue(
            &mut tx,
            Message::bytes("t", vec![0u8; 1000]).header("h", "x".repeat(100)),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }));
    // The business transaction is untouched and commits.
    outbox
        .enqueue(&mut tx, Message::bytes("t", vec![7u8; 1024]))
        .await
        .unwrap();
    sqlx::query("INSERT INTO business VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pgbox.outbox").await,
        1
    );

    // The default limit, and the configurable range.
    let mut tx = db.pool.begin().await.unwrap();
    let big = vec![0u8; pgbox::DEFAULT_MAX_MESSAGE_BYTES + 1];
    let err = Outbox::new()
        .enqueue(&mut tx, Message::bytes("t", big))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }));
    tx.rollback().await.unwrap();
    assert!(Outbox::new().max_message_bytes(0).is_err());
    assert!(
        Outbox::new()
            .max_message_bytes(pgbox::MAX_MESSAGE_BYTES_LIMIT + 1)
            .is_err()
    );
}

#[tokio::test]
async fn consumer_settings_that_could_never_work_are_refused_at_build() {
    let db = TestDb::migrated().await;
    let build =
        |topic: &str,
         f: &dyn Fn(pgbox::ConsumerBuilder<PgQueue>) -> pgbox::ConsumerBuilder<PgQueue>| {
            f(Consumer::builder(
                db.pool.clone(),
                PgQueue::new(db.pool.clone()),
                topic,
                Inbox::new("c").unwrap(),
            ))
            .build()
            .map(|_| ())
        };
    let invalid = |r: pgbox::Result<()>| matches!(r, Err(Error::InvalidConfig(_)));
    assert!(build("t", &|b| b).is_ok());
    assert!(invalid(
        build("t", &|b| b.visibility_timeout(Duration::ZERO))
    ));
    assert!(invalid(build("t", &|b| b.visibility_timeout(Duration::MAX))));
    assert!(invalid(build("t", &|b| b.poll_interval(Duration::MAX))));
    assert!(invalid(build("t", &|b| b.concurrency(0))));
    assert!(invalid(build("t", &|b| b.max_deliveries(0))));
    assert!(invalid(build("a\0b", &|b| b)));
    assert!(invalid(build("", &|b| b)));
    assert!(invalid(build(&"t".repeat(256), &|b| b)));
}

#[tokio::test]
async fn header_names_and_values_that_break_brokers_are_refused() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for (name, value) in [
        ("", "v"),
        ("a\r\nb", "v"),
        ("x\n", "v"),
        ("\t", "v"),
        ("with space", "v"),
        ("a:b", "v"),
        ("bell\u{7}", "v"),
        ("ok", "line\r\nbreak"),
        ("ok", "nul\0"),
    ] {
        let err = outbox
            .enqueue(&mut tx, Message::bytes("t", "p").header(name, value))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidField { field, .. } if field.starts_with("header")),
            "{name:?}={value:?}: {err:?}"
        );
    }
    let long = "h".repeat(pgbox::MAX_HEADER_NAME_BYTES + 1);
    assert!(
        outbox
            .enqueue(&mut tx, Message::bytes("t", "p").header(long, "v"))
            .await
            .is_err()
    );
    outbox
        .enqueue(
            &mut tx,
            Message::bytes("t", "p")
                .header("x-trace_id.1", "any value: with spaces")
                .header("ünïcode", "ok"),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
}
