//! The plain inbox claims a key with one of two statements, picked by what the inbox's last
//! claim found: after a new key, a plain `INSERT ... ON CONFLICT DO NOTHING` (a conflict then
//! reads the record with a second statement); after a duplicate, the statement that also
//! reads the record in the same round trip. Both must decide every case alike: a new key, a
//! duplicate (with its stored record), a rejected one, a key under a live lease (in progress,
//! and still a pure read), and an expired lease (taken over). Which statement ran is read
//! from sqlx's own statement log.

mod support;

use std::time::Duration;

use pgbox::{Error, Inbox, Key, LeaseAttempt, Outcome};
use sqlx::PgPool;
use support::TestDb;

/// Which statement the next claim of `inbox` uses.
#[derive(Debug, Clone, Copy)]
enum Form {
    /// After a new key: the plain INSERT.
    Plain,
    /// After a duplicate: the INSERT that also reads the record.
    Reading,
}

/// Steers `inbox`'s next claim to `form`: a claim of a new key, or of `"primer"`, recorded
/// at the start.
async fn steer(pool: &PgPool, inbox: &Inbox, form: Form) {
    let mut tx = pool.begin().await.unwrap();
    let key = match form {
        Form::Plain => uuid::Uuid::now_v7().to_string(),
        Form::Reading => "primer".to_owned(),
    };
    let outcome = inbox
        .process(&mut tx, key.as_str(), async |_c| Ok::<_, Error>(()))
        .await
        .unwrap();
    match form {
        Form::Plain => assert!(outcome.is_processed(), "{outcome:?}"),
        Form::Reading => assert!(outcome.is_duplicate(), "{outcome:?}"),
    }
    tx.rollback().await.unwrap();
}

async fn process(pool: &PgPool, inbox: &Inbox, key: &str, commit: bool) -> Outcome<String> {
    let mut tx = pool.begin().await.unwrap();
    let outcome = inbox
        .process(
            &mut tx,
            Key::new(key).with_message_id(format!("m-{key}")),
            async |_c| Ok::<_, Error>(format!("done {key}")),
        )
        .await
        .unwrap();
    let xid: Option<String> = sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    if !outcome.is_processed() {
        assert_eq!(xid, None, "{key}: anything but a claim is a pure read");
    }
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    outcome
}

#[tokio::test]
async fn both_claim_statements_decide_every_case_alike() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let inbox = Inbox::new("forms").unwrap();
    // The keys both forms meet: one processed (with a stored outcome), one rejected, one
    // under a live lease; expired leases are made per form below.
    assert!(process(pool, &inbox, "primer", true).await.is_processed());
    assert!(process(pool, &inbox, "done", true).await.is_processed());
    let mut tx = pool.begin().await.unwrap();
    let rejected = inbox
        .process_or_reject(&mut tx, "rejected", async |_c| {
            Ok::<_, Error>(pgbox::Verdict::<()>::Reject("no such order".into()))
        })
        .await
        .unwrap();
    assert!(matches!(rejected, Outcome::Rejected(_)), "{rejected:?}");
    tx.commit().await.unwrap();
    let LeaseAttempt::Leased(_live) = inbox
        .lease(pool, "live", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("not leased")
    };

    let mut records = Vec::new();
    for form in [Form::Plain, Form::Reading, Form::Plain, Form::Reading] {
        // A new key is claimed and processed.
        steer(pool, &inbox, form).await;
        let fresh = uuid::Uuid::now_v7().to_string();
        let outcome = process(pool, &inbox, &fresh, false).await;
        assert!(outcome.is_processed(), "{form:?}: {outcome:?}");

        // A duplicate hands back the first delivery's record.
        steer(pool, &inbox, form).await;
        let Outcome::Duplicate(done) = process(pool, &inbox, "done", false).await else {
            panic!("{form:?}: not a duplicate")
        };
        assert_eq!(done.message_id.as_deref(), Some("m-done"), "{form:?}");
        assert_eq!(
            done.outcome::<String>().unwrap().as_deref(),
            Some("done done"),
            "{form:?}"
        );

        // A rejected key is a duplicate that says so.
        steer(pool, &inbox, form).await;
        let Outcome::Duplicate(rejected) = process(pool, &inbox, "rejected", false).await else {
            panic!("{form:?}: not a duplicate")
        };
        assert!(rejected.was_rejected(), "{form:?}");
        records.push((done, rejected));

        // A live lease holds the key: in progress, nothing written.
        steer(pool, &inbox, form).await;
        let outcome = process(pool, &inbox, "live", false).await;
        assert!(
            matches!(outcome, Outcome::InProgress),
            "{form:?}: {outcome:?}"
        );

        // An expired lease is taken over by the claim.
        let expired = format!("expired-{}", uuid::Uuid::now_v7());
        let LeaseAttempt::Leased(_stale) = inbox
            .lease(pool, expired.as_str(), Duration::from_millis(1))
            .await
            .unwrap()
        else {
            panic!("not leased")
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        steer(pool, &inbox, form).await;
        let outcome = process(pool, &inbox, &expired, true).await;
        assert!(outcome.is_processed(), "{form:?}: {outcome:?}");
        assert!(
            inbox
                .lookup(pool, expired.as_str())
                .await
                .unwrap()
                .is_some(),
            "{form:?}: the taken-over key is recorded"
        );
    }
    // Every form read the same records.
    assert!(records.windows(2).all(|w| w[0] == w[1]), "{records:?}");
}

/// The plain INSERT finds the key held, and before its `read` looks the record is deleted by
/// another session that commits (a purge; a lease released). The claim must decide as in one
/// snapshot, not fail with `ConcurrentClaim`: here the key is free again, so it is claimed.
/// The delete is made deterministic by a statement trigger on the inbox that, once armed,
/// deletes the key through dblink (a session of its own, committed at once) right after the
/// claim's INSERT and before the claim's read.
#[tokio::test]
async fn a_record_deleted_between_the_plain_claim_and_its_read_is_claimed_again() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let other_session = db.url().replace('\'', "");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE EXTENSION IF NOT EXISTS dblink; \
         CREATE TABLE public.vanish (key text NOT NULL); \
         CREATE FUNCTION public.vanish() RETURNS trigger LANGUAGE plpgsql AS $$ \
         DECLARE k text; \
         BEGIN \
           DELETE FROM public.vanish RETURNING key INTO k; \
           IF k IS NOT NULL THEN \
             PERFORM public.dblink_exec('{other_session}', \
               pg_catalog.format('DELETE FROM pgbox.inbox WHERE key = %L', k)); \
           END IF; \
           RETURN NULL; \
         END $$; \
         CREATE TRIGGER vanish AFTER INSERT ON pgbox.inbox \
           FOR EACH STATEMENT EXECUTE FUNCTION public.vanish();"
    )))
    .execute(pool)
    .await
    .unwrap();
    let inbox = Inbox::new("vanishing").unwrap();
    assert!(process(pool, &inbox, "gone", true).await.is_processed());
    // The last claim found a new key: the next one takes the plain INSERT.
    sqlx::query("INSERT INTO public.vanish VALUES ('gone')")
        .execute(pool)
        .await
        .unwrap();
    let outcome = process(pool, &inbox, "gone", true).await;
    assert!(outcome.is_processed(), "{outcome:?}");
    let armed: i64 = sqlx::query_scalar("SELECT count(*) FROM public.vanish")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(armed, 0, "the trigger fired");
    assert!(inbox.lookup(pool, "gone").await.unwrap().is_some());
}

/// The statements sqlx ran while a [`statement_log`] guard was held on this thread, each as
/// the text of its `sqlx::query` event (its summary and, where sqlx gives it, the statement).
type StatementLog = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// A subscriber that keeps the text of every `sqlx::query` event, set as this thread's
/// default (a `#[tokio::test]` runs every task on the test's thread).
fn statement_log() -> (StatementLog, tracing::subscriber::DefaultGuard) {
    use tracing::field::{Field, Visit};
    use tracing::subscriber::Interest;
    use tracing::{Event, Metadata, span};

    struct Keep(StatementLog);
    struct Text(String);
    impl Visit for Text {
        fn record_str(&mut self, field: &Field, value: &str) {
            self.0.push_str(&format!(" {}={value}", field.name()));
        }
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
    impl tracing::Subscriber for Keep {
        fn register_callsite(&self, m: &'static Metadata<'static>) -> Interest {
            if m.target() == "sqlx::query" {
                Interest::always()
            } else {
                Interest::never()
            }
        }
        fn enabled(&self, m: &Metadata<'_>) -> bool {
            m.target() == "sqlx::query"
        }
        fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
            Some(tracing::level_filters::LevelFilter::TRACE)
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, e: &Event<'_>) {
            let mut text = Text(String::new());
            e.record(&mut text);
            self.0.lock().unwrap().push(text.0);
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }
    let log = StatementLog::default();
    let guard = tracing::subscriber::set_default(Keep(log.clone()));
    (log, guard)
}

/// Which of the inbox's statements ran, in order, from the log: `plain` (the INSERT alone),
/// `reading` (the INSERT that also reads the record), `read` (the record read alone).
fn claims(log: &StatementLog) -> Vec<&'static str> {
    let mut log = log.lock().unwrap();
    let named = log
        .iter()
        .filter_map(|text| {
            if text.contains("WITH claimed") {
                Some("reading")
            } else if text.contains("INSERT INTO \"pgbox\".inbox")
                || text.contains("INSERT INTO pgbox.inbox")
            {
                Some("plain")
            } else if text.contains("SELECT false, lease_expires_at") {
                Some("read")
            } else {
                None
            }
        })
        .collect();
    log.clear();
    named
}

/// The statements themselves, not only the decisions: a fresh inbox claims with the plain
/// INSERT; a duplicate found that way costs the INSERT plus a read; the claim after a
/// duplicate is the reading statement, alone for a duplicate and for a new key; the claim
/// after a new key is the plain one again.
#[tokio::test]
async fn the_statement_follows_what_the_last_claim_found() {
    let db = TestDb::migrated().await;
    let pool = &db.pool;
    let inbox = Inbox::new("statements").unwrap();
    let (log, _guard) = statement_log();
    let steps: [(&str, bool, &[&str]); 5] = [
        ("a", true, &["plain"]),
        ("a", false, &["plain", "read"]),
        ("a", false, &["reading"]),
        ("b", true, &["reading"]),
        ("c", true, &["plain"]),
    ];
    for (i, (key, new, expected)) in steps.into_iter().enumerate() {
        let outcome = process(pool, &inbox, key, true).await;
        assert_eq!(outcome.is_processed(), new, "step {i}: {outcome:?}");
        assert_eq!(claims(&log), expected, "step {i} ({key})");
    }
}
