//! Business-row helpers: versions, state machines and in-order processing, under
//! concurrency and redelivery, on a real PostgreSQL.

mod support;

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use pgbox::{
    Error, GapPolicy, Inbox, Outcome, RetryPolicy, Sequenced, StateMachine, StateTable, Transition,
    VersionedTable,
};
use rand::seq::SliceRandom;
use sqlx::{Executor, PgConnection};
use support::TestDb;

// ---------------------------------------------------------------------------------------
// The ride lifecycle of seed 000.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Ride {
    Created,
    DriverAssigned,
    DriverDeparted,
    DriverArrived,
    PassengerPickedUp,
    Arrived,
}

impl StateMachine for Ride {
    const STATES: &'static [Self] = &[
        Ride::Created,
        Ride::DriverAssigned,
        Ride::DriverDeparted,
        Ride::DriverArrived,
        Ride::PassengerPickedUp,
        Ride::Arrived,
    ];
    fn name(self) -> &'static str {
        match self {
            Ride::Created => "created",
            Ride::DriverAssigned => "driver_assigned",
            Ride::DriverDeparted => "driver_departed",
            Ride::DriverArrived => "driver_arrived",
            Ride::PassengerPickedUp => "passenger_picked_up",
            Ride::Arrived => "arrived",
        }
    }
    fn next(self) -> &'static [Self] {
        match self {
            Ride::Created => &[Ride::DriverAssigned],
            Ride::DriverAssigned => &[Ride::DriverDeparted],
            Ride::DriverDeparted => &[Ride::DriverArrived],
            Ride::DriverArrived => &[Ride::PassengerPickedUp],
            Ride::PassengerPickedUp => &[Ride::Arrived],
            Ride::Arrived => &[],
        }
    }
}

const RIDES: i64 = 200;

/// A ride handler either finishes, or finds the message early and asks for redelivery.
#[derive(Debug, thiserror::Error)]
enum RideError {
    #[error("arrived before its predecessor")]
    TooEarly,
    #[error(transparent)]
    Pgbox(#[from] Error),
}
const WORKERS: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ride_lifecycle_never_moves_backwards_under_duplicates_and_shuffling() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute(
            "CREATE TABLE rides (id bigint PRIMARY KEY, status text NOT NULL);
             CREATE TABLE ride_status_log (ride bigint, old text, new text);
             CREATE FUNCTION log_status() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               INSERT INTO ride_status_log VALUES (NEW.id, OLD.status, NEW.status);
               RETURN NEW;
             END $$;
             CREATE TRIGGER rides_log AFTER UPDATE ON rides
               FOR EACH ROW EXECUTE FUNCTION log_status();
             INSERT INTO rides SELECT g, 'created' FROM generate_series(1, 200) g;",
        )
        .await
        .unwrap();

    // Every transition message of every ride, each delivered twice, shuffled.
    let mut messages: Vec<(i64, Ride)> = (1..=RIDES)
        .flat_map(|ride| Ride::STATES[1..].iter().map(move |&s| (ride, s)))
        .flat_map(|m| [m, m])
        .collect();
    messages.shuffle(&mut rand::rng());
    let queue = Arc::new(Mutex::new(VecDeque::from(messages)));
    let rides = Arc::new(StateTable::<Ride>::new("rides").unwrap());
    let inbox = Inbox::new("ride-tracker").unwrap();
    let tally = Arc::new(Mutex::new(BTreeMap::<&'static str, usize>::new()));

    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let (queue, rides, inbox, pool, tally) = (
            queue.clone(),
            rides.clone(),
            inbox.clone(),
            db.pool.clone(),
            tally.clone(),
        );
        workers.push(tokio::spawn(async move {
            loop {
                let Some((ride, to)) = queue.lock().unwrap().pop_front() else {
                    break;
                };
                let mut tx = pool.begin().await.unwrap();
                let key = format!("ride-{ride}-{}", to.name());
                let outcome = inbox
                    .process(&mut tx, key.as_str(), async |conn| {
                        match rides.transition(conn, ride, to).await? {
                            Transition::TooEarly { .. } => Err(RideError::TooEarly),
                            Transition::Illegal { current } => {
                                panic!("illegal {current:?} -> {to:?}")
                            }
                            Transition::NotFound => panic!("ride {ride} missing"),
                            t => Ok(format!("{t:?}")),
                        }
                    })
                    .await;
                match outcome {
                    Ok(o) => {
                        tx.commit().await.unwrap();
                        let label = match o {
                            Outcome::Processed(ref t) if t.starts_with("Applied") => "applied",
                            Outcome::Processed(ref t) if t.starts_with("Stale") => "stale",
                            Outcome::Processed(_) => "already",
                            Outcome::Duplicate(_) => "duplicate",
                            _ => "other",
                        };
                        *tally.lock().unwrap().entry(label).or_default() += 1;
                    }
                    Err(RideError::TooEarly) => {
                        // Too early: roll back and redeliver after the others.
                        drop(tx);
                        *tally.lock().unwrap().entry("too_early").or_default() += 1;
                        queue.lock().unwrap().push_back((ride, to));
                        tokio::task::yield_now().await;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let tally = tally.lock().unwrap().clone();
    eprintln!("ride outcomes: {tally:?}");
    assert_eq!(
        tally.get("applied"),
        Some(&(RIDES as usize * 5)),
        "{tally:?}"
    );

    let unfinished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rides WHERE status <> 'arrived'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(unfinished, 0);
    // Every status write was a legal forward step.
    let log: Vec<(i64, String, String)> =
        sqlx::query_as("SELECT ride, old, new FROM ride_status_log")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        log.len(),
        RIDES as usize * 5,
        "each ride moved exactly 5 times"
    );
    let parse = |s: &str| *Ride::STATES.iter().find(|r| r.name() == s).unwrap();
    for (ride, old, new) in log {
        let (old, new) = (parse(&old), parse(&new));
        assert!(old.next().contains(&new), "ride {ride}: {old:?} -> {new:?}");
        assert!(new > old, "ride {ride} moved back: {old:?} -> {new:?}");
    }
}

#[tokio::test]
async fn transition_results_cover_replay_stale_early_illegal_and_missing() {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Order {
        Created,
        Paid,
        Shipped,
        Cancelled,
    }
    impl StateMachine for Order {
        const STATES: &'static [Self] = &[
            Order::Created,
            Order::Paid,
            Order::Shipped,
            Order::Cancelled,
        ];
        fn name(self) -> &'static str {
            match self {
                Order::Created => "created",
                Order::Paid => "paid",
                Order::Shipped => "shipped",
                Order::Cancelled => "cancelled",
            }
        }
        fn next(self) -> &'static [Self] {
            match self {
                Order::Created => &[Order::Paid, Order::Cancelled],
                Order::Paid => &[Order::Shipped],
                _ => &[],
            }
        }
    }
    let db = TestDb::migrated().await;
    db.pool
        .execute(
            "CREATE SCHEMA shop; CREATE TABLE shop.orders (order_id text PRIMARY KEY, state text NOT NULL);
             INSERT INTO shop.orders VALUES ('a', 'created'), ('b', 'created'), ('c', 'teleported');",
        )
        .await
        .unwrap();
    let orders = StateTable::<Order>::new("orders")
        .unwrap()
        .schema("shop")
        .unwrap()
        .id_column("order_id")
        .unwrap()
        .status_column("state")
        .unwrap();
    let mut c = db.pool.acquire().await.unwrap();
    let conn: &mut PgConnection = &mut c;
    use Transition::*;
    assert_eq!(
        orders.transition(conn, "a", Order::Shipped).await.unwrap(),
        TooEarly {
            current: Order::Created
        }
    );
    assert_eq!(
        orders.transition(conn, "a", Order::Paid).await.unwrap(),
        Applied {
            from: Order::Created
        }
    );
    assert_eq!(
        orders.transition(conn, "a", Order::Paid).await.unwrap(),
        AlreadyInState
    );
    assert_eq!(
        orders.transition(conn, "a", Order::Shipped).await.unwrap(),
        Applied { from: Order::Paid }
    );
    assert_eq!(
        orders.transition(conn, "a", Order::Paid).await.unwrap(),
        Stale {
            current: Order::Shipped
        }
    );
    assert_eq!(
        orders
            .transition(conn, "a", Order::Cancelled)
            .await
            .unwrap(),
        Illegal {
            current: Order::Shipped
        }
    );
    assert_eq!(
        orders
            .transition(conn, "b", Order::Cancelled)
            .await
            .unwrap(),
        Applied {
            from: Order::Created
        }
    );
    assert_eq!(
        orders.transition(conn, "b", Order::Paid).await.unwrap(),
        Illegal {
            current: Order::Cancelled
        }
    );
    assert_eq!(
        orders.transition(conn, "zzz", Order::Paid).await.unwrap(),
        NotFound
    );
    assert_eq!(
        orders.current(conn, "a").await.unwrap(),
        Some(Order::Shipped)
    );
    // Unknown stored values are a typed error, not a panic.
    let err = orders.transition(conn, "c", Order::Paid).await.unwrap_err();
    assert!(
        matches!(err, Error::UnknownState { ref value, .. } if value == "teleported"),
        "{err}"
    );
    assert!(matches!(
        orders.current(conn, "c").await,
        Err(Error::UnknownState { .. })
    ));
}

// ---------------------------------------------------------------------------------------
// Optimistic versions.

#[derive(Debug, thiserror::Error)]
enum AccountError {
    #[error(transparent)]
    Pgbox(#[from] Error),
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

impl pgbox::Retryable for AccountError {
    fn is_retryable(&self) -> bool {
        match self {
            AccountError::Pgbox(e) => e.is_retryable(),
            AccountError::Sql(e) => pgbox::DbErrorKind::classify(e).is_retryable(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_credits_through_versions_and_inbox_sum_exactly() {
    support::init_tracing();
    const ACCOUNTS: i64 = 4;
    const MESSAGES: usize = 2_000;
    let db = TestDb::migrated().await;
    db.pool
        .execute(
            "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL, version bigint NOT NULL);
             INSERT INTO accounts SELECT g, 0, 0 FROM generate_series(1, 4) g;",
        )
        .await
        .unwrap();
    // Each message credits one account; 25 % of them are delivered a second time.
    let mut deliveries: Vec<(usize, i64)> = (0..MESSAGES)
        .map(|m| (m, m as i64 % ACCOUNTS + 1))
        .collect();
    let redelivered: Vec<_> = deliveries
        .iter()
        .copied()
        .filter(|(m, _)| m % 4 == 0)
        .collect();
    deliveries.extend(redelivered);
    deliveries.shuffle(&mut rand::rng());
    let queue = Arc::new(Mutex::new(deliveries));
    let accounts = Arc::new(VersionedTable::new("accounts").unwrap());
    let inbox = Inbox::new("ledger").unwrap();
    let policy = RetryPolicy::new().max_attempts(200);
    let conflicts = Arc::new(std::sync::atomic::AtomicUsize::new(0));

    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let (queue, accounts, inbox, pool, policy, conflicts) = (
            queue.clone(),
            accounts.clone(),
            inbox.clone(),
            db.pool.clone(),
            policy.clone(),
            conflicts.clone(),
        );
        workers.push(tokio::spawn(async move {
            loop {
                let Some((message, account)) = queue.lock().unwrap().pop() else {
                    break;
                };
                let key = format!("credit-{message}");
                let outcome = inbox
                    .process_with_retry(&pool, key.as_str(), &policy, async |conn| {
                        // Read-modify-write: the version guard is all that stops lost updates.
                        let (balance, version): (i64, i64) =
                            sqlx::query_as("SELECT balance, version FROM accounts WHERE id = $1")
                                .bind(account)
                                .fetch_one(&mut *conn)
                                .await?;
                        tokio::task::yield_now().await;
                        let result = accounts
                            .update(account, version)
                            .set("balance", balance + 100)
                            .execute(conn)
                            .await;
                        if let Err(Error::VersionConflict { .. }) = result {
                            conflicts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        result?;
                        Ok::<(), AccountError>(())
                    })
                    .await
                    .unwrap();
                assert!(outcome.is_processed() || outcome.is_duplicate());
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let total: i64 = sqlx::query_scalar("SELECT sum(balance)::bigint FROM accounts")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    eprintln!(
        "version conflicts retried: {}",
        conflicts.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(total, 100 * MESSAGES as i64);
    let versions: i64 = sqlx::query_scalar("SELECT sum(version)::bigint FROM accounts")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        versions, MESSAGES as i64,
        "one version bump per distinct message"
    );
}

#[tokio::test]
async fn seed_001_precondition_add_100_if_balance_is_500_applies_once() {
    let db = TestDb::migrated().await;
    db.pool
        .execute(
            "CREATE TABLE wallets (user_id text PRIMARY KEY, balance bigint NOT NULL, rev bigint NOT NULL);
             INSERT INTO wallets VALUES ('u1', 500, 3);",
        )
        .await
        .unwrap();
    let wallets = VersionedTable::new("wallets")
        .unwrap()
        .id_column("user_id")
        .unwrap()
        .version_column("rev")
        .unwrap();
    // The message was built when the wallet was at 500, version 3: "add 100".
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(
        wallets
            .update("u1", 3)
            .add("balance", 100_i64)
            .execute(&mut conn)
            .await
            .unwrap(),
        4
    );
    // The same message again: the precondition no longer holds.
    let err = wallets
        .update("u1", 3)
        .add("balance", 100_i64)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::VersionConflict {
                expected: 3,
                actual: 4,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.is_retryable());
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM wallets")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(balance, 600);
    let missing = wallets
        .update("nobody", 1)
        .add("balance", 1_i64)
        .execute(&mut conn)
        .await;
    assert!(matches!(missing, Err(Error::RowNotFound { .. })));
    assert_eq!(
        wallets.current_version(&mut conn, "u1").await.unwrap(),
        Some(4)
    );
}

// ---------------------------------------------------------------------------------------
// In-order processing.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_order_handlers_see_each_entitys_messages_exactly_once_in_order() {
    support::init_tracing();
    const ENTITIES: i64 = 50;
    const PER_ENTITY: i64 = 20;
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE seen (n bigserial, entity text, seq bigint)")
        .await
        .unwrap();
    let mut messages: Vec<(String, i64)> = (0..ENTITIES)
        .flat_map(|e| (1..=PER_ENTITY).map(move |s| (format!("account-{e}"), s)))
        .collect();
    let dups: Vec<_> = messages
        .iter()
        .filter(|(_, s)| s % 3 == 0)
        .cloned()
        .collect();
    messages.extend(dups);
    messages.shuffle(&mut rand::rng());
    let queue = Arc::new(Mutex::new(VecDeque::from(messages)));
    let inbox = Inbox::new("statements").unwrap();
    let gaps = Arc::new(std::sync::atomic::AtomicUsize::new(0));

    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let (queue, inbox, pool, gaps) =
            (queue.clone(), inbox.clone(), db.pool.clone(), gaps.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let Some((entity, seq)) = queue.lock().unwrap().pop_front() else {
                    break;
                };
                let mut tx = pool.begin().await.unwrap();
                let result = inbox
                    .process_in_order(&mut tx, entity.as_str(), seq, async |conn| {
                        sqlx::query("INSERT INTO seen (entity, seq) VALUES ($1, $2)")
                            .bind(&entity)
                            .bind(seq)
                            .execute(&mut *conn)
                            .await
                            .map_err(Error::from)
                    })
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                if let Sequenced::Gap { expected } = result {
                    assert!(expected < seq);
                    gaps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    queue.lock().unwrap().push_back((entity, seq));
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    eprintln!(
        "gaps redelivered: {}",
        gaps.load(std::sync::atomic::Ordering::Relaxed)
    );
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT entity, seq FROM seen ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut per_entity: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (e, s) in rows {
        per_entity.entry(e).or_default().push(s);
    }
    assert_eq!(per_entity.len(), ENTITIES as usize);
    let expected: Vec<i64> = (1..=PER_ENTITY).collect();
    for (entity, seqs) in per_entity {
        assert_eq!(
            seqs, expected,
            "{entity} saw its messages out of order or twice"
        );
    }
}

#[tokio::test]
async fn skip_ahead_policy_jumps_gaps_and_late_messages_become_stale() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::builder("prices")
        .on_gap(GapPolicy::SkipAhead)
        .build()
        .unwrap();
    let strict = Inbox::new("prices-strict").unwrap();
    let run = async |inbox: &Inbox, seq: i64| {
        let mut tx = db.pool.begin().await.unwrap();
        let r = inbox
            .process_in_order(&mut tx, "sku-1", seq, async |_c| Ok::<i64, Error>(seq))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        r
    };
    assert_eq!(
        run(&inbox, 1).await,
        Sequenced::Processed {
            value: 1,
            skipped: 0
        }
    );
    assert_eq!(
        run(&inbox, 4).await,
        Sequenced::Processed {
            value: 4,
            skipped: 2
        }
    );
    assert_eq!(run(&inbox, 2).await, Sequenced::Stale { watermark: 4 });
    assert_eq!(run(&inbox, 4).await, Sequenced::Stale { watermark: 4 });
    assert_eq!(run(&strict, 2).await, Sequenced::Gap { expected: 1 });
    assert_eq!(
        run(&strict, 1).await,
        Sequenced::Processed {
            value: 1,
            skipped: 0
        }
    );

    let mut tx = db.pool.begin().await.unwrap();
    let bad = strict
        .process_in_order(&mut tx, "sku-1", 0, async |_c| Ok::<(), Error>(()))
        .await;
    assert!(matches!(bad, Err(Error::InvalidSequence(0))));
    let bad = strict
        .process_in_order(&mut tx, "", 1, async |_c| Ok::<(), Error>(()))
        .await;
    assert!(matches!(bad, Err(Error::EmptyKey)));
}

#[test]
fn bad_identifiers_and_state_machines_are_typed_errors() {
    let id =
        |e: &Error, what: &str| matches!(e, Error::InvalidIdentifier { what: w, .. } if *w == what);
    assert!(id(
        &VersionedTable::new("accounts; drop table x").unwrap_err(),
        "table"
    ));
    assert!(id(
        &VersionedTable::new("a")
            .unwrap()
            .id_column("Id")
            .unwrap_err(),
        "column"
    ));
    assert!(id(
        &VersionedTable::new("a")
            .unwrap()
            .version_column("")
            .unwrap_err(),
        "column"
    ));
    assert!(id(
        &VersionedTable::new("a")
            .unwrap()
            .schema("pg_catalog")
            .unwrap_err(),
        "schema"
    ));
    assert!(id(
        &StateTable::<Ride>::new("rides\"").unwrap_err(),
        "table"
    ));
    assert!(id(
        &StateTable::<Ride>::new("rides")
            .unwrap()
            .status_column("st atus")
            .unwrap_err(),
        "column"
    ));

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Loop {
        A,
        B,
    }
    impl StateMachine for Loop {
        const STATES: &'static [Self] = &[Loop::A, Loop::B];
        fn name(self) -> &'static str {
            match self {
                Loop::A => "a",
                Loop::B => "b",
            }
        }
        fn next(self) -> &'static [Self] {
            match self {
                Loop::A => &[Loop::B],
                Loop::B => &[Loop::A],
            }
        }
    }
    assert!(matches!(
        StateTable::<Loop>::new("t"),
        Err(Error::InvalidStateMachine(_))
    ));

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Twins {
        A,
        B,
    }
    impl StateMachine for Twins {
        const STATES: &'static [Self] = &[Twins::A, Twins::B];
        fn name(self) -> &'static str {
            "same"
        }
        fn next(self) -> &'static [Self] {
            &[]
        }
    }
    assert!(matches!(
        StateTable::<Twins>::new("t"),
        Err(Error::InvalidStateMachine(_))
    ));
}

#[tokio::test]
async fn bad_column_in_a_versioned_update_is_refused_before_sql() {
    let db = TestDb::migrated().await;
    let t = VersionedTable::new("nothing_here").unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let err = t
        .update(1_i64, 1)
        .set("x\"; drop", 1_i64)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidIdentifier { what: "column", .. }),
        "{err}"
    );
    let err = t
        .update(1_i64, 1)
        .set("version", 9_i64)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidIdentifier { .. }), "{err}");
    // With valid names, a missing table is a database error, classified.
    let err = t
        .update(1_i64, 1)
        .set("x", 1_i64)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_eq!(
        err.db_kind(),
        Some(pgbox::DbErrorKind::MissingSchema),
        "{err}"
    );
}
