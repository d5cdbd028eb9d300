//! Lease mode: fenced CONSUMING/CONSUMED marks for effects outside the database, with real
//! concurrency, real time and a real killed process.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pgbox::{
    Claim, Error, FencingToken, Inbox, LeaseAttempt, LeasedRun, MAX_KEY_BYTES, MAX_LEASE_TTL,
    Outcome, Verdict, Wait,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use support::TestDb;
use time::OffsetDateTime;

const CHILD_ENV: &str = "PGBOX_LEASE_CHILD_URL";

fn leased(attempt: LeaseAttempt) -> pgbox::Lease {
    match attempt {
        LeaseAttempt::Leased(lease) => lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

async fn rows(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The remote side of an external effect: it remembers, per resource, the highest fencing
/// token it has seen and refuses lower ones; accepted effects are logged with their token.
async fn remote_setup(pool: &PgPool) {
    pool.execute(
        "CREATE TABLE remote_fence (resource text PRIMARY KEY, highest bigint NOT NULL); \
         CREATE TABLE remote_effects (resource text NOT NULL, token bigint NOT NULL, accepted boolean NOT NULL)",
    )
    .await
    .unwrap();
}

async fn remote_call(pool: &PgPool, resource: &str, token: FencingToken) -> bool {
    let mut tx = pool.begin().await.unwrap();
    let accepted = sqlx::query(
        "INSERT INTO remote_fence AS f (resource, highest) VALUES ($1, $2) \
         ON CONFLICT (resource) DO UPDATE SET highest = EXCLUDED.highest \
         WHERE f.highest <= EXCLUDED.highest RETURNING 1",
    )
    .bind(resource)
    .bind(token.get())
    .fetch_optional(&mut *tx)
    .await
    .unwrap()
    .is_some();
    sqlx::query("INSERT INTO remote_effects VALUES ($1, $2, $3)")
        .bind(resource)
        .bind(token.get())
        .bind(accepted)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    accepted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holders_racing_one_key_exactly_one_leases() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("race").unwrap();
    const RACERS: usize = 8;
    for round in 0..15 {
        let key = format!("k{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let mut tasks = Vec::new();
        for _ in 0..RACERS {
            let (inbox, pool, key, barrier) =
                (inbox.clone(), db.pool.clone(), key.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                inbox
                    .lease(&pool, key.as_str(), Duration::from_secs(60))
                    .await
            }));
        }
        let mut winners = 0;
        for task in tasks {
            match task.await.unwrap().unwrap() {
                LeaseAttempt::Leased(_) => winners += 1,
                LeaseAttempt::InProgress { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(winners, 1, "round {round}: exactly one holder");
        assert_eq!(rows(&db.pool, &key).await, 1);
    }

    // Racing to take over one expired lease: again exactly one wins, fenced above the old.
    for round in 0..10 {
        let key = format!("expired{round}");
        let old = leased(
            inbox
                .lease(&db.pool, key.as_str(), Duration::from_millis(1))
                .await
                .unwrap(),
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let mut tasks = Vec::new();
        for _ in 0..RACERS {
            let (inbox, pool, key, barrier) =
                (inbox.clone(), db.pool.clone(), key.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                inbox
                    .lease(&pool, key.as_str(), Duration::from_secs(60))
                    .await
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            match task.await.unwrap().unwrap() {
                LeaseAttempt::Leased(lease) => winners.push(lease),
                LeaseAttempt::InProgress { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: exactly one takes over");
        assert_eq!(winners[0].taken_over_from(), Some(old.token()));
        assert!(winners[0].token() > old.token());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_lease_is_fenced_here_and_at_the_remote_side() {
    let db = TestDb::migrated().await;
    remote_setup(&db.pool).await;
    let inbox = Inbox::new("payments").unwrap();

    let a = leased(
        inbox
            .lease(&db.pool, "charge-7", Duration::from_millis(400))
            .await
            .unwrap(),
    );
    // A stalls (a GC pause, a slow DNS lookup...) well past its lease.
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let b = leased(
        inbox
            .lease(&db.pool, "charge-7", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    assert_eq!(b.taken_over_from(), Some(a.token()));
    assert!(b.token() > a.token(), "the token grows with the takeover");
    assert!(remote_call(&db.pool, "charge-7", b.token()).await);

    // A wakes up and carries on while B still holds the key: the remote side refuses its
    // stale token, and so does pgbox, before and after B completes.
    assert!(!remote_call(&db.pool, "charge-7", a.token()).await);
    for b_completed in [false, true] {
        if b_completed {
            b.complete(&db.pool, "receipt-from-b").await.unwrap();
        }
        let err = a.complete(&db.pool, "receipt-from-a").await.unwrap_err();
        match err {
            Error::LeaseLost { token, current, .. } => {
                assert_eq!(token, a.token().get());
                assert_eq!(current, Some(b.token().get()));
            }
            other => panic!("expected LeaseLost (B completed: {b_completed}), got {other:?}"),
        }
    }
    let mut a2 = a.clone();
    assert!(matches!(
        a2.extend(&db.pool, Duration::from_secs(5)).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        a.release(&db.pool).await,
        Err(Error::LeaseLost { .. })
    ));

    // Which token won, at both ends.
    let effects: Vec<(i64, bool)> =
        sqlx::query_as("SELECT token, accepted FROM remote_effects ORDER BY token DESC")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        effects,
        vec![(b.token().get(), true), (a.token().get(), false)]
    );
    let (token, outcome): (Option<i64>, Option<serde_json::Value>) = sqlx::query_as(
        "SELECT lease_token, outcome FROM pgbox.inbox WHERE consumer = 'payments' AND key = 'charge-7'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(token, Some(b.token().get()));
    assert_eq!(outcome, Some(serde_json::json!("receipt-from-b")));
    // The winner's completion is idempotent (a retry after a lost reply).
    b.complete(&db.pool, "receipt-from-b").await.unwrap();
    match inbox
        .lease(&db.pool, "charge-7", Duration::from_secs(1))
        .await
        .unwrap()
    {
        LeaseAttempt::Duplicate(d) => {
            assert_eq!(
                d.outcome::<String>().unwrap().as_deref(),
                Some("receipt-from-b")
            )
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
}

/// Run as a child process by `a_killed_holder_expires_and_is_taken_over`: takes a lease,
/// reports its token, then hangs until killed. A no-op in a normal test run.
#[tokio::test]
async fn crash_child_holder() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let inbox = Inbox::new("crashy").unwrap();
    let lease = leased(
        inbox
            .lease(&pool, "job-1", Duration::from_secs(3))
            .await
            .unwrap(),
    );
    println!("\nTOKEN {}", lease.token());
    std::io::stdout().flush().unwrap();
    tokio::time::sleep(Duration::from_secs(120)).await;
    panic!("the parent should have killed this process");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_expires_and_is_taken_over() {
    let db = TestDb::migrated().await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_child_holder",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, db.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let token = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .take(200)
            .map_while(Result::ok)
            .find_map(|line| {
                // libtest may print "test crash_child_holder ... " on the same line.
                line.split("TOKEN ")
                    .nth(1)
                    .map(|t| t.trim().parse::<i64>().unwrap())
            })
    })
    .await
    .unwrap()
    .expect("the child reported its token");
    // SIGKILL: no destructor, no release.
    child.kill().unwrap();
    child.wait().unwrap();

    let inbox = Inbox::new("crashy").unwrap();
    match inbox
        .lease(&db.pool, "job-1", Duration::from_secs(30))
        .await
        .unwrap()
    {
        LeaseAttempt::InProgress { retry_after, .. } => {
            assert!(retry_after <= Duration::from_secs(3), "{retry_after:?}")
        }
        other => panic!("the dead holder's lease is still live, got {other:?}"),
    }
    let start = Instant::now();
    let lease = loop {
        match inbox
            .lease(&db.pool, "job-1", Duration::from_secs(30))
            .await
            .unwrap()
        {
            LeaseAttempt::Leased(lease) => break lease,
            LeaseAttempt::InProgress { .. } if start.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => panic!("no takeover: {other:?}"),
        }
    };
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "not before expiry"
    );
    assert_eq!(lease.taken_over_from().map(FencingToken::get), Some(token));
    assert!(lease.token().get() > token);
    lease.complete(&db.pool, &()).await.unwrap();
    assert!(matches!(
        inbox
            .lease(&db.pool, "job-1", Duration::from_secs(1))
            .await
            .unwrap(),
        LeaseAttempt::Duplicate(_)
    ));
}

async fn pool_in_time_zone(db: &TestDb, zone: &'static str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(sqlx::AssertSqlSafe(format!("SET TimeZone = '{zone}'")))
                    .await?;
                Ok(())
            })
        })
        .connect_with(db.options.clone())
        .await
        .unwrap()
}

#[tokio::test]
async fn expiry_follows_the_database_clock_only() {
    let db = TestDb::migrated().await;
    let east = pool_in_time_zone(&db, "Pacific/Kiritimati").await; // UTC+14
    let west = pool_in_time_zone(&db, "Etc/GMT+12").await; // UTC-12
    let inbox = Inbox::new("clock").unwrap();
    let ttl = Duration::from_secs(30);

    let lease = leased(inbox.lease(&east, "k", ttl).await.unwrap());
    let db_now: OffsetDateTime = sqlx::query_scalar("SELECT now()")
        .fetch_one(&west)
        .await
        .unwrap();
    let ahead = lease.expires_at() - db_now;
    assert!(
        ahead > time::Duration::seconds(25) && ahead <= time::Duration::seconds(30),
        "expiry is the database's now() + ttl whatever the session's zone: {ahead}"
    );
    // Computed server-side: exactly the ttl after the lease's own start, both database time.
    let exact: bool = sqlx::query_scalar(
        "SELECT lease_expires_at - processed_at = interval '30 seconds' FROM pgbox.inbox WHERE key = 'k'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(exact);
    // Seen from a session 26 hours away: the same instant, and still live.
    match inbox.lease(&west, "k", ttl).await.unwrap() {
        LeaseAttempt::InProgress {
            expires_at,
            retry_after,
        } => {
            assert_eq!(expires_at, lease.expires_at());
            assert!(
                retry_after > Duration::from_secs(25) && retry_after <= ttl,
                "{retry_after:?}"
            );
        }
        other => panic!("expected in progress, got {other:?}"),
    }
    // Only the database's time decides. Move the lease an hour into the database's past (as
    // if the database clock had jumped an hour; the client's clock has not moved): it is
    // expired at once, and taken over.
    sqlx::query("UPDATE pgbox.inbox SET lease_expires_at = lease_expires_at - interval '1 hour'")
        .execute(&db.pool)
        .await
        .unwrap();
    let taker = leased(inbox.lease(&west, "k", ttl).await.unwrap());
    assert_eq!(taker.taken_over_from(), Some(lease.token()));
    // And an hour into its future: a tiny ttl does not expire by the client's reckoning.
    sqlx::query("UPDATE pgbox.inbox SET lease_expires_at = now() + interval '1 hour'")
        .execute(&db.pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(matches!(
        inbox
            .lease(&east, "k", Duration::from_millis(1))
            .await
            .unwrap(),
        LeaseAttempt::InProgress { .. }
    ));
}

#[tokio::test]
async fn bad_inputs_are_typed_errors_and_write_nothing() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("bad").unwrap();
    let ok = Duration::from_secs(1);
    for ttl in [
        Duration::ZERO,
        Duration::from_micros(999),
        MAX_LEASE_TTL + Duration::from_secs(1),
        Duration::MAX,
    ] {
        assert!(
            matches!(
                inbox.lease(&db.pool, "k", ttl).await,
                Err(Error::InvalidLeaseTtl { .. })
            ),
            "{ttl:?}"
        );
    }
    assert!(matches!(
        inbox.lease(&db.pool, "", ok).await,
        Err(Error::EmptyKey)
    ));
    assert!(matches!(
        inbox.lease(&db.pool, "a\0b", ok).await,
        Err(Error::KeyContainsNul { position: 1 })
    ));
    assert!(matches!(
        inbox
            .lease(&db.pool, "x".repeat(MAX_KEY_BYTES + 1), ok)
            .await,
        Err(Error::KeyTooLong { .. })
    ));
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 0);

    // On a held lease: a bad extension or an unstorable outcome is refused before any SQL,
    // and the lease is kept.
    let mut lease = leased(inbox.lease(&db.pool, "k", ok).await.unwrap());
    assert!(matches!(
        lease.extend(&db.pool, Duration::ZERO).await,
        Err(Error::InvalidLeaseTtl { .. })
    ));
    assert!(matches!(
        lease.complete(&db.pool, &f64::NAN).await,
        Err(Error::InvalidField {
            field: "outcome",
            ..
        })
    ));
    assert!(matches!(
        lease.complete(&db.pool, "nul\0").await,
        Err(Error::InvalidField {
            field: "outcome",
            ..
        })
    ));
    lease.complete(&db.pool, "fine").await.unwrap();
}

#[tokio::test]
async fn one_key_space_for_both_modes() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("mixed").unwrap();

    // Consumed through a lease, then delivered through `process`: a duplicate, a pure read.
    let lease = leased(
        inbox
            .lease(&db.pool, "leased-first", Duration::from_secs(30))
            .await
            .unwrap(),
    );
    lease
        .complete(&db.pool, &serde_json::json!({"charge": "ch_1"}))
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(
            &mut tx,
            "leased-first",
            async |_conn| -> Result<(), Error> { panic!("must not run") },
        )
        .await
        .unwrap();
    match outcome {
        Outcome::Duplicate(d) => assert_eq!(d.outcome, Some(serde_json::json!({"charge": "ch_1"}))),
        other => panic!("expected a duplicate, got {other:?}"),
    }
    let xid: Option<String> = sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(xid, None, "the duplicate wrote nothing");
    tx.commit().await.unwrap();
    assert!(
        inbox
            .lookup(&db.pool, "leased-first")
            .await
            .unwrap()
            .is_some()
    );

    // Recorded by `process` (processed or rejected), then leased: a duplicate.
    let mut tx = db.pool.begin().await.unwrap();
    let _ = inbox
        .process(&mut tx, "processed-first", async |_c| {
            Ok::<_, Error>("points+30")
        })
        .await
        .unwrap();
    let _ = inbox
        .process_or_reject(&mut tx, "rejected-first", async |_c| {
            Ok::<Verdict<()>, Error>(Verdict::Reject("unknown account".into()))
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    match inbox
        .lease(&db.pool, "processed-first", Duration::from_secs(1))
        .await
        .unwrap()
    {
        LeaseAttempt::Duplicate(d) => {
            assert_eq!(d.outcome::<String>().unwrap().as_deref(), Some("points+30"))
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    match inbox
        .lease(&db.pool, "rejected-first", Duration::from_secs(1))
        .await
        .unwrap()
    {
        LeaseAttempt::Duplicate(d) => assert!(d.was_rejected()),
        other => panic!("expected a duplicate, got {other:?}"),
    }
    // Lease mode's duplicates and in-progress answers are pure reads too: the row is not
    // touched and no token is drawn.
    let before: (String, i64) = sqlx::query_as(
        "SELECT (SELECT xmin::text FROM pgbox.inbox WHERE key = 'processed-first'), \
                (SELECT last_value FROM pgbox.inbox_lease_token_seq)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let _held = leased(
        inbox
            .lease(&db.pool, "held", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let before = (before.0, before.1 + 1);
    for key in ["processed-first", "held", "processed-first", "held"] {
        let _ = inbox
            .lease(&db.pool, key, Duration::from_secs(1))
            .await
            .unwrap();
    }
    let after: (String, i64) = sqlx::query_as(
        "SELECT (SELECT xmin::text FROM pgbox.inbox WHERE key = 'processed-first'), \
                (SELECT last_value FROM pgbox.inbox_lease_token_seq)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(after, before);
    let ran = AtomicUsize::new(0);
    let run = inbox
        .run_leased(
            &db.pool,
            "processed-first",
            Duration::from_secs(1),
            async |_l| {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(())
            },
        )
        .await
        .unwrap();
    assert!(matches!(run, LeasedRun::Duplicate(_)));
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // Another consumer's key space is separate.
    let other = Inbox::new("other").unwrap();
    assert!(matches!(
        other
            .lease(&db.pool, "processed-first", Duration::from_secs(1))
            .await
            .unwrap(),
        LeaseAttempt::Leased(_)
    ));
}

#[tokio::test]
async fn a_live_lease_is_in_progress_for_the_transactional_path_and_an_expired_one_is_taken_over() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("consuming").unwrap();
    let no_wait = Inbox::builder("consuming")
        .wait(Wait::NoWait)
        .build()
        .unwrap();
    let live = leased(
        inbox
            .lease(&db.pool, "live", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let expired = leased(
        inbox
            .lease(&db.pool, "expired", Duration::from_millis(1))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(20)).await;

    for key in ["live"] {
        for each in [&inbox, &no_wait] {
            let mut tx = db.pool.begin().await.unwrap();
            let outcome = each
                .process(&mut tx, key, async |_conn| -> Result<(), Error> {
                    panic!("must not run")
                })
                .await
                .unwrap();
            assert!(matches!(outcome, Outcome::InProgress), "{key}: {outcome:?}");
            assert!(!outcome.should_ack());
            let xid: Option<String> =
                sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
            assert_eq!(
                xid, None,
                "still a pure read, and the transaction is usable"
            );
            assert!(matches!(
                each.claim(&mut tx, key).await.unwrap(),
                Claim::InProgress
            ));
            tx.rollback().await.unwrap();
        }
        assert!(
            inbox.lookup(&db.pool, key).await.unwrap().is_none(),
            "{key} is not processed"
        );
    }
    // A batch claim never reports a leased key as recorded (its message would be acked).
    let mut tx = db.pool.begin().await.unwrap();
    assert!(matches!(
        inbox.claim_batch(&mut tx, ["live"]).await,
        Err(Error::KeyInProgress { .. })
    ));
    tx.rollback().await.unwrap();

    live.complete(&db.pool, &()).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "live", async |_c| Ok::<_, Error>(()))
        .await
        .unwrap();
    assert!(outcome.is_duplicate());
    tx.rollback().await.unwrap();

    // An expired lease (its holder crashed) does not block the key until a purge: the
    // transactional path takes it over, in either wait mode. Rolled back, the lease is back
    // as it was; committed, the stale holder's completion is refused.
    for each in [&inbox, &no_wait] {
        let mut tx = db.pool.begin().await.unwrap();
        let outcome = each
            .process(&mut tx, "expired", async |_c| Ok::<_, Error>(()))
            .await
            .unwrap();
        assert!(outcome.is_processed(), "{outcome:?}");
        tx.rollback().await.unwrap();
    }
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "expired", async |_c| Ok::<_, Error>("done here"))
        .await
        .unwrap();
    assert!(outcome.is_processed(), "{outcome:?}");
    tx.commit().await.unwrap();
    assert!(matches!(
        expired.complete(&db.pool, &()).await,
        Err(Error::LeaseLost { .. })
    ));
    let record = inbox.lookup(&db.pool, "expired").await.unwrap().unwrap();
    assert_eq!(
        record.outcome::<String>().unwrap().as_deref(),
        Some("done here")
    );
}

#[tokio::test]
async fn release_extend_and_growing_tokens() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("lifecycle").unwrap();
    let first = leased(
        inbox
            .lease(&db.pool, "r", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    first.release(&db.pool).await.unwrap();
    assert_eq!(rows(&db.pool, "r").await, 0, "released: the mark is gone");
    let second = leased(
        inbox
            .lease(&db.pool, "r", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    assert!(second.token() > first.token());
    assert_eq!(second.taken_over_from(), None);
    match first.release(&db.pool).await {
        Err(Error::LeaseLost { current, .. }) => assert_eq!(current, Some(second.token().get())),
        other => panic!("a second release is refused: {other:?}"),
    }
    assert_eq!(
        rows(&db.pool, "r").await,
        1,
        "the stale release deleted nothing"
    );

    // Extension: the lease outlives its first ttl.
    let mut lease = leased(
        inbox
            .lease(&db.pool, "e", Duration::from_millis(400))
            .await
            .unwrap(),
    );
    let before = lease.expires_at();
    let after = lease
        .extend(&db.pool, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(after > before && lease.expires_at() == after);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(matches!(
        inbox
            .lease(&db.pool, "e", Duration::from_secs(1))
            .await
            .unwrap(),
        LeaseAttempt::InProgress { .. }
    ));
    // An expired lease nobody took over is still its holder's.
    let mut slow = leased(
        inbox
            .lease(&db.pool, "s", Duration::from_millis(1))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    slow.extend(&db.pool, Duration::from_secs(30))
        .await
        .unwrap();
    slow.complete(&db.pool, &1).await.unwrap();
    assert!(matches!(
        slow.extend(&db.pool, Duration::from_secs(1)).await,
        Err(Error::LeaseLost { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_leased_completes_on_success_or_unstorable_outcome_and_releases_on_error_or_panic() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("runner").unwrap();
    let ttl = Duration::from_secs(30);
    let calls = Arc::new(AtomicUsize::new(0));

    let run = inbox
        .run_leased(&db.pool, "ok", ttl, async |lease| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(format!("done by {}", lease.token()))
        })
        .await
        .unwrap();
    let LeasedRun::Completed { value, token } = run else {
        panic!("{run:?}")
    };
    assert_eq!(value, format!("done by {token}"));
    let again = inbox
        .run_leased(&db.pool, "ok", ttl, async |_lease| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(String::new())
        })
        .await
        .unwrap();
    match again {
        LeasedRun::Duplicate(d) => assert_eq!(d.outcome::<String>().unwrap(), Some(value)),
        other => panic!("{other:?}"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let err = inbox
        .run_leased(
            &db.pool,
            "fails",
            ttl,
            async |_lease| -> Result<(), anyhow::Error> { anyhow::bail!("provider said 503") },
        )
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "provider said 503");
    assert_eq!(rows(&db.pool, "fails").await, 0, "released");

    let (inbox2, pool2) = (inbox.clone(), db.pool.clone());
    let panicked = tokio::spawn(async move {
        inbox2
            .run_leased(&pool2, "panics", ttl, async |_lease| -> Result<(), Error> {
                panic!("boom")
            })
            .await
    })
    .await
    .unwrap_err();
    assert!(panicked.is_panic());
    assert_eq!(rows(&db.pool, "panics").await, 0, "released");

    // An outcome that cannot be stored: the effect has happened, so the key is completed
    // (without an outcome) and never run again; the caller gets the typed error.
    let err = inbox
        .run_leased(&db.pool, "nan", ttl, async |_lease| {
            Ok::<_, Error>(f64::NAN)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidField { .. }));
    assert_eq!(rows(&db.pool, "nan").await, 1, "completed, not released");
    match inbox.lease(&db.pool, "nan", ttl).await.unwrap() {
        LeaseAttempt::Duplicate(d) => assert_eq!(d.outcome::<f64>().unwrap(), None),
        other => panic!("an effect that happened must not run again: {other:?}"),
    }

    // Each released key leases again at once.
    for key in ["fails", "panics"] {
        assert!(matches!(
            inbox.lease(&db.pool, key, ttl).await.unwrap(),
            LeaseAttempt::Leased(_)
        ));
    }
}

#[tokio::test]
async fn purge_covers_completed_and_abandoned_leases_but_never_live_ones() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("retention").unwrap();
    let ttl = Duration::from_secs(60);
    let mut tx = db.pool.begin().await.unwrap();
    let _ = inbox
        .process(&mut tx, "processed", async |_c| Ok::<_, Error>(()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    leased(inbox.lease(&db.pool, "completed", ttl).await.unwrap())
        .complete(&db.pool, &())
        .await
        .unwrap();
    let _abandoned = leased(
        inbox
            .lease(&db.pool, "abandoned", Duration::from_millis(1))
            .await
            .unwrap(),
    );
    let _live = leased(inbox.lease(&db.pool, "live", ttl).await.unwrap());
    leased(inbox.lease(&db.pool, "recent", ttl).await.unwrap())
        .complete(&db.pool, &())
        .await
        .unwrap();
    // Everything but "recent" was recorded (or leased) two days ago.
    sqlx::query("UPDATE pgbox.inbox SET processed_at = processed_at - interval '2 days' WHERE key <> 'recent'")
        .execute(&db.pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let deleted = inbox
        .purge_older_than(&db.pool, Duration::from_secs(86_400))
        .await
        .unwrap();
    assert_eq!(deleted, 3);
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM pgbox.inbox ORDER BY key")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, ["live", "recent"]);
    // The abandoned key leases again, with a token above every earlier one.
    let again = leased(inbox.lease(&db.pool, "abandoned", ttl).await.unwrap());
    assert!(again.token() > _live.token());
}

#[tokio::test]
async fn status_shows_live_and_expired_leases_per_consumer() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("leasing").unwrap();
    let ttl = Duration::from_secs(60);
    let _live1 = leased(inbox.lease(&db.pool, "a", ttl).await.unwrap());
    let _live2 = leased(inbox.lease(&db.pool, "b", ttl).await.unwrap());
    let _dead = leased(
        inbox
            .lease(&db.pool, "c", Duration::from_millis(1))
            .await
            .unwrap(),
    );
    leased(inbox.lease(&db.pool, "d", ttl).await.unwrap())
        .complete(&db.pool, &())
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let plain = Inbox::new("plain").unwrap();
    let _ = plain
        .process(&mut tx, "p", async |_c| Ok::<_, Error>(()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;

    let consumers = pgbox::inbox_status(&db.pool, "pgbox").await.unwrap();
    let leasing = consumers.iter().find(|c| c.consumer == "leasing").unwrap();
    assert_eq!(
        (leasing.rows, leasing.live_leases, leasing.expired_leases),
        (4, 2, 1)
    );
    assert!(
        leasing.earliest_lease_expiry.unwrap()
            <= OffsetDateTime::now_utc() + time::Duration::minutes(5)
    );
    let plain = consumers.iter().find(|c| c.consumer == "plain").unwrap();
    assert_eq!(
        (
            plain.live_leases,
            plain.expired_leases,
            plain.earliest_lease_expiry
        ),
        (0, 0, None)
    );

    // The CLI shows them too.
    let out = Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(["status", "--json", "--database-url", &db.url()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let leasing = json["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == "leasing")
        .unwrap();
    assert_eq!(leasing["live_leases"], 2);
    assert_eq!(leasing["expired_leases"], 1);
    let text = Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(["status", "--database-url", &db.url()])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("LEASES LIVE") && text.contains("leasing has 1 expired lease"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_runs_a_topic_in_lease_mode() {
    use pgbox::transport::PgQueue;
    use pgbox::{CancellationToken, Consumer, Envelope, Lease, Message, Outbox, Relay};

    let db = TestDb::migrated().await;
    remote_setup(&db.pool).await;
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..20 {
        let body = match i {
            0 => "flaky-0".to_owned(),
            1 => "panicky-1".to_owned(),
            _ => format!("charge-{i}"),
        };
        Outbox::new()
            .enqueue(&mut tx, Message::bytes("charges", body))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let queue = PgQueue::new(db.pool.clone());
    Relay::builder(db.pool.clone(), queue.clone())
        .build()
        .unwrap()
        .relay_once()
        .await
        .unwrap();

    let inbox = Inbox::new("charger").unwrap();
    // A holder that crashed with "charge-5" leased: the consumer must wait for its expiry.
    let crashed = leased(
        inbox
            .lease(&db.pool, "charge-5", Duration::from_millis(1500))
            .await
            .unwrap(),
    );
    let consumer = Consumer::builder(db.pool.clone(), queue, "charges", inbox.clone())
        .key(|e: &Envelope| String::from_utf8_lossy(&e.payload).into_owned())
        .concurrency(4)
        .poll_interval(Duration::from_millis(20))
        .backoff(
            pgbox::RetryPolicy::new()
                .base_delay(Duration::from_millis(10))
                .max_delay(Duration::from_millis(50)),
        )
        .build()
        .unwrap();
    let failures = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (s, pool, failures) = (shutdown.clone(), db.pool.clone(), failures.clone());
        let panics = Arc::new(AtomicUsize::new(0));
        async move {
            consumer
                .run_leased(
                    async move |e: &Envelope, lease: &mut Lease| -> Result<(), Error> {
                        let body = String::from_utf8_lossy(&e.payload).into_owned();
                        if body.starts_with("flaky") && failures.fetch_add(1, Ordering::SeqCst) == 0
                        {
                            return Err(Error::InvalidConfig("provider timed out".into()));
                        }
                        if body.starts_with("panicky") && panics.fetch_add(1, Ordering::SeqCst) == 0
                        {
                            panic!("provider client bug");
                        }
                        assert!(remote_call(&pool, lease.key(), lease.token()).await);
                        Ok(())
                    },
                    Duration::from_secs(10),
                    s,
                )
                .await
        }
    });
    let start = Instant::now();
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if left == 0 || start.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(stats.processed, 20, "{stats:?}");
    assert_eq!(stats.panicked, 1, "{stats:?}");
    assert!(
        stats.retried >= 3,
        "flaky, panicky and the in-progress key: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0);
    // Every charge happened once, at the remote side, under the token that completed it.
    let per_resource: Vec<(String, i64)> = sqlx::query_as(
        "SELECT resource, count(*) FROM remote_effects WHERE accepted GROUP BY resource HAVING count(*) <> 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(per_resource.is_empty(), "{per_resource:?}");
    let (done, mismatched): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE i.lease_token IS DISTINCT FROM r.token) \
         FROM pgbox.inbox i JOIN remote_effects r ON r.resource = i.key \
         WHERE i.consumer = 'charger' AND i.lease_expires_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((done, mismatched), (20, 0));
    assert!(matches!(
        crashed.complete(&db.pool, &()).await,
        Err(Error::LeaseLost { .. })
    ));
}

#[tokio::test]
async fn a_batch_claim_never_reports_a_leased_key_as_done() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("batch-lease").unwrap();
    let _held = leased(
        inbox
            .lease(&db.pool, "b", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let mut tx = db.pool.begin().await.unwrap();
    let err = inbox
        .claim_batch(&mut tx, ["a", "b", "c"])
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::KeyInProgress { key, .. } if key == "b"),
        "{err:?}"
    );
    assert!(err.is_retryable());
    drop(tx);
    // Without the leased key, the batch goes through.
    let mut tx = db.pool.begin().await.unwrap();
    let claimed = inbox.claim_batch(&mut tx, ["a", "c"]).await.unwrap();
    assert_eq!(claimed, vec![true, true]);
    tx.commit().await.unwrap();
}
