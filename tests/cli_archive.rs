//! `pgbox archive status` and `pgbox replay` end to end, with `--json`: a dry run counts, a
//! replay enqueues exactly the filtered messages and reports a cursor to resume from; bad
//! input exits with a usage or refusal code and enqueues nothing.

mod support;

use std::process::{Command, Output};

use pgbox::transport::{PublishError, Publisher};
use pgbox::{ArchiveRetention, Envelope, Message, Outbox, Relay};
use support::TestDb;

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

struct Confirms;

impl Publisher for Confirms {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        batch.iter().map(|_| Ok(())).collect()
    }
}

async fn pending(db: &TestDb) -> Vec<(String, Option<String>)> {
    sqlx::query_as("SELECT topic, ordering_key FROM pgbox.outbox ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn archive_status_and_replay_with_json() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..12 {
        let topic = if i % 3 == 0 { "invoices" } else { "orders" };
        let m = Message::bytes(topic, vec![i as u8])
            .ordering_key(format!("k{}", i % 2))
            .header("type", if i % 4 == 0 { "paid" } else { "created" });
        outbox.enqueue(&mut tx, m).await.unwrap();
    }
    tx.commit().await.unwrap();
    Relay::builder(db.pool.clone(), Confirms)
        .archive(ArchiveRetention::days(3))
        .build()
        .unwrap()
        .drain()
        .await
        .unwrap();
    let url = db.url();

    let status = pgbox_cli(&url, &["--json", "archive", "status"]);
    assert!(status.status.success());
    let status = json(&status);
    assert_eq!(status["retention"], "3d");
    assert_eq!(status["default_rows"], 0);
    assert!(status["partitions"].as_array().unwrap().len() >= 4);

    let dry = pgbox_cli(
        &url,
        &[
            "--json",
            "replay",
            "--topic",
            "orders",
            "--key",
            "k1",
            "--dry-run",
        ],
    );
    assert!(dry.status.success());
    assert_eq!(json(&dry)["would_replay"], 4);
    assert!(pending(&db).await.is_empty(), "a dry run enqueues nothing");

    let run = pgbox_cli(
        &url,
        &[
            "--json",
            "replay",
            "--topic",
            "orders",
            "--type",
            "created",
            "--limit",
            "5",
            "--batch-size",
            "2",
        ],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let first = json(&run);
    assert_eq!(first["replayed"], 5);
    assert_eq!(first["complete"], false);
    let cursor = first["cursor"].as_i64().unwrap().to_string();
    let id = first["replay_id"].as_str().unwrap().to_owned();
    let rest = pgbox_cli(
        &url,
        &[
            "--json",
            "replay",
            "--topic",
            "orders",
            "--type",
            "created",
            "--after",
            &cursor,
            "--replay-id",
            &id,
        ],
    );
    let rest = json(&rest);
    // 8 orders, of which i % 4 == 0 (i = 4, 8) are "paid": 6 created.
    assert_eq!(rest["replayed"], 1);
    assert_eq!(rest["complete"], true);
    let got = pending(&db).await;
    assert_eq!(got.len(), 6);
    assert!(got.iter().all(|(t, _)| t == "orders"));
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT headers->>'pgbox-replay-id' FROM pgbox.outbox")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(ids, vec![id]);
}

#[tokio::test]
async fn replay_bad_input_is_refused_and_enqueues_nothing() {
    let db = TestDb::migrated().await;
    let url = db.url();
    sqlx::query(
        "INSERT INTO pgbox.outbox_archive (message_id, topic, payload, content_type, headers, created_at) \
         VALUES (gen_random_uuid(), 'orders', '\\x01', 'x', '{}', now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let cases: &[&[&str]] = &[
        &[
            "--json",
            "replay",
            "--since",
            "2026-11-02T00:00:00Z",
            "--until",
            "2026-11-01T00:00:00Z",
        ],
        &["--json", "replay", "--topic", "no-such-topic"],
        &["--json", "replay", "--since", "yesterday"],
        &["--json", "replay", "--type-header", "a b", "--type", "x"],
        &["--json", "--schema", "x\"; DROP TABLE y", "replay"],
        &["--json", "replay", "--rate", "0"],
    ];
    for args in cases {
        let out = pgbox_cli(&url, args);
        assert!(!out.status.success(), "{args:?}");
        let code = out.status.code().unwrap();
        assert!((1..=6).contains(&code), "{args:?}: exit {code}");
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("panicked"),
            "{args:?}"
        );
    }
    assert!(pending(&db).await.is_empty());
}
