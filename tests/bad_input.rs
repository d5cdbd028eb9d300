//! Bad input: each case gets its own typed error, before any SQL runs, and the caller's
//! transaction stays usable.

mod support;

use pgbox::{Error, Inbox, Key, MAX_KEY_BYTES, Migrator, Wait};
use std::time::Duration;
use support::TestDb;

type Check = fn(&Error) -> bool;

#[tokio::test]
async fn bad_keys_are_refused_with_typed_errors_and_the_transaction_stays_usable() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("points").unwrap();
    let long = "k".repeat(MAX_KEY_BYTES + 1);
    let long_id = "m".repeat(513);
    let cases: Vec<(&str, Key<'_>, Check)> = vec![
        ("empty key", Key::new(""), |e| matches!(e, Error::EmptyKey)),
        (
            "key one byte over the limit",
            Key::new(long.as_str()),
            |e| {
                matches!(
                    e,
                    Error::KeyTooLong {
                        len: 1025,
                        max: 1024
                    }
                )
            },
        ),
        (
            "multibyte key over the limit",
            Key::new("é".repeat(513)),
            |e| matches!(e, Error::KeyTooLong { len: 1026, .. }),
        ),
        ("NUL in key", Key::new("order\u{0}42"), |e| {
            matches!(e, Error::KeyContainsNul { position: 5 })
        }),
        ("NUL at start", Key::new("\u{0}"), |e| {
            matches!(e, Error::KeyContainsNul { position: 0 })
        }),
        (
            "NUL in message id",
            Key::new("ok").with_message_id("a\u{0}b"),
            |e| {
                matches!(
                    e,
                    Error::InvalidField {
                        field: "message id",
                        ..
                    }
                )
            },
        ),
        (
            "oversized message id",
            Key::new("ok").with_message_id(long_id.as_str()),
            |e| {
                matches!(
                    e,
                    Error::InvalidField {
                        field: "message id",
                        ..
                    }
                )
            },
        ),
    ];
    let mut tx = db.pool.begin().await.unwrap();
    for (name, key, check) in cases {
        let err = inbox.claim(&mut tx, key.clone()).await.unwrap_err();
        assert!(check(&err), "{name}: unexpected error {err:?}");
        assert!(!err.is_retryable(), "{name}");
        assert!(!err.to_string().is_empty());
        let err = inbox
            .process(&mut tx, key, async |_c| -> Result<(), Error> {
                panic!("{name}: the handler must not run")
            })
            .await
            .unwrap_err();
        assert!(check(&err), "{name} via process: {err:?}");
        // Never a poisoned transaction.
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(one, 1, "{name} poisoned the transaction");
    }
    // The exact limit is accepted, and stored without truncation.
    let exact = "x".repeat(MAX_KEY_BYTES);
    assert!(matches!(
        inbox.claim(&mut tx, exact.as_str()).await.unwrap(),
        pgbox::Claim::Claimed(_)
    ));
    tx.commit().await.unwrap();
    let stored: i32 = sqlx::query_scalar("SELECT octet_length(key) FROM pgbox.inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored as usize, MAX_KEY_BYTES);
}

#[test]
fn bad_consumer_names_schema_names_and_settings_are_refused() {
    let consumer = |e: &Error| matches!(e, Error::InvalidConsumerName { .. });
    let schema = |e: &Error| matches!(e, Error::InvalidIdentifier { what: "schema", .. });
    let config = |e: &Error| matches!(e, Error::InvalidConfig(_));
    let cases: Vec<(&str, pgbox::Result<Inbox>, Check)> = vec![
        ("empty consumer", Inbox::new(""), consumer),
        (
            "consumer with space",
            Inbox::new("points service"),
            consumer,
        ),
        ("consumer with NUL", Inbox::new("points\0"), consumer),
        (
            "consumer with quote",
            Inbox::new("x'; drop table y; --"),
            consumer,
        ),
        ("consumer too long", Inbox::new("c".repeat(129)), consumer),
        (
            "empty schema",
            Inbox::builder("c").schema("").build(),
            schema,
        ),
        (
            "schema with quote",
            Inbox::builder("c").schema("pg\"box").build(),
            schema,
        ),
        (
            "schema injection",
            Inbox::builder("c").schema("x; drop schema public").build(),
            schema,
        ),
        (
            "schema uppercase",
            Inbox::builder("c").schema("Pgbox").build(),
            schema,
        ),
        (
            "schema reserved",
            Inbox::builder("c").schema("pg_temp").build(),
            schema,
        ),
        (
            "schema too long",
            Inbox::builder("c").schema("s".repeat(64)).build(),
            schema,
        ),
        (
            "schema leading digit",
            Inbox::builder("c").schema("1box").build(),
            schema,
        ),
        (
            "sub-millisecond wait",
            Inbox::builder("c")
                .wait(Wait::Timeout(Duration::from_micros(10)))
                .build(),
            config,
        ),
    ];
    for (name, result, check) in cases {
        let err = result.expect_err(name);
        assert!(check(&err), "{name}: unexpected error {err:?}");
    }
    assert!(matches!(
        Migrator::new().schema("bad name"),
        Err(Error::InvalidIdentifier { .. })
    ));
}
