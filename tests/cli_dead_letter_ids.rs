//! `pgbox dead-letters replay|discard` treat their ids as a set: naming an id twice is
//! naming it once, and the report counts distinct ids.

mod support;

use std::process::{Command, Output};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{Envelope, Message, Outbox, Relay};
use support::TestDb;
use uuid::Uuid;

fn pgbox_cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .expect("run pgbox")
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

struct AlwaysFails;
impl Publisher for AlwaysFails {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        vec![Err(PublishError::refused("broker down")); batch.len()]
    }
}

/// One message, dead-lettered by a relay that always fails; returns its id.
async fn dead_letter(db: &TestDb, relay: &Relay<AlwaysFails>, key: &str) -> Uuid {
    let mut tx = db.pool.begin().await.unwrap();
    let id = Outbox::new()
        .enqueue(&mut tx, Message::bytes("orders", "{}").ordering_key(key))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let report = relay.relay_once().await.unwrap();
    assert_eq!(report.dead_lettered, 1);
    id
}

async fn outbox_rows(db: &TestDb, id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox WHERE message_id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn cli_dead_letter_ids_are_a_set_a_repeated_id_succeeds_once() {
    let db = TestDb::migrated().await;
    let url = db.url();
    let relay = Relay::builder(db.pool.clone(), AlwaysFails)
        .max_attempts(1)
        .build()
        .unwrap();
    let id = dead_letter(&db, &relay, "k1").await;
    let id_text = id.to_string();

    // replay A A: one message back in the outbox, success, "replayed 1".
    let replay = pgbox_cli(
        &url,
        &["dead-letters", "replay", &id_text, &id_text, "--json"],
    );
    assert_eq!(
        replay.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    assert_eq!(json(&replay)["replayed"], 1);
    assert_eq!(outbox_rows(&db, id).await, 1);

    // Dead again; discard A A A: success, "discarded 1".
    assert_eq!(relay.relay_once().await.unwrap().dead_lettered, 1);
    let discard = pgbox_cli(
        &url,
        &[
            "dead-letters",
            "discard",
            &id_text,
            &id_text,
            &id_text,
            "--json",
        ],
    );
    assert_eq!(
        discard.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&discard.stderr)
    );
    assert_eq!(json(&discard)["discarded"], 1);
    assert_eq!(outbox_rows(&db, id).await, 0);
}

#[tokio::test]
async fn cli_dead_letter_partial_report_counts_distinct_ids() {
    let db = TestDb::migrated().await;
    let url = db.url();
    let relay = Relay::builder(db.pool.clone(), AlwaysFails)
        .max_attempts(1)
        .build()
        .unwrap();
    let known = dead_letter(&db, &relay, "k1").await.to_string();
    let unknown = Uuid::now_v7().to_string();

    // A A B with B unknown: A is replayed, and the report is "1 of 2" distinct ids, exit 5.
    let replay = pgbox_cli(&url, &["dead-letters", "replay", &known, &known, &unknown]);
    let err = String::from_utf8_lossy(&replay.stderr);
    assert_eq!(replay.status.code(), Some(5), "{err}");
    assert!(err.contains("replayed 1 of 2"), "{err}");

    assert_eq!(relay.relay_once().await.unwrap().dead_lettered, 1);
    let discard = pgbox_cli(
        &url,
        &["dead-letters", "discard", &unknown, &known, &unknown],
    );
    let err = String::from_utf8_lossy(&discard.stderr);
    assert_eq!(discard.status.code(), Some(5), "{err}");
    assert!(err.contains("discarded 1 of 2"), "{err}");
}
