//! The built-in queue's dead letters behave like the outbox's: a dead letter holds its
//! ordering key until it is replayed (back at its original position) or discarded, through
//! the library (`QueueDeadLetters`) and the CLI (`pgbox dead-letters --queue`).

mod support;

use std::process::{Command, Output};
use std::time::Duration;

use pgbox::transport::{Delivery, PgQueue, QueueDeadLetters};
use pgbox::{Message, Outbox, Relay};
use support::TestDb;
use uuid::Uuid;

const TOPIC: &str = "payments";
const VISIBILITY: Duration = Duration::from_secs(300);

/// Enqueues `(key, payload)` messages in order and relays them into the queue; returns their
/// ids in the same order.
async fn publish(db: &TestDb, queue: &PgQueue, messages: &[(Option<&str>, &str)]) -> Vec<Uuid> {
    let mut tx = db.pool.begin().await.unwrap();
    let batch: Vec<Message> = messages
        .iter()
        .map(|(key, payload)| {
            let m = Message::bytes(TOPIC, payload.as_bytes().to_vec());
            match key {
                Some(k) => m.ordering_key(*k),
                None => m,
            }
        })
        .collect();
    let ids = Outbox::new().enqueue_batch(&mut tx, batch).await.unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::builder(db.pool.clone(), queue.clone())
        .build()
        .unwrap();
    // The relay publishes one message per key per round: a bounded number of rounds.
    for _ in 0..=messages.len() {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if left == 0 {
            return ids;
        }
        relay.relay_once().await.unwrap();
    }
    panic!("the relay did not publish everything");
}

async fn receive(queue: &PgQueue) -> Vec<Delivery> {
    queue.receive(TOPIC, 100, VISIBILITY).await.unwrap()
}

fn ids(deliveries: &[Delivery]) -> Vec<Uuid> {
    deliveries.iter().map(|d| d.envelope.id).collect()
}

/// Receives, expects exactly `expected`, acks them all.
async fn receive_and_ack(queue: &PgQueue, expected: &[Uuid]) {
    let got = receive(queue).await;
    assert_eq!(ids(&got), expected);
    for d in &got {
        assert!(queue.ack(d).await.unwrap());
    }
}

/// Receives exactly the message `id` and dead-letters it.
async fn dead_letter(queue: &PgQueue, id: Uuid) -> Delivery {
    let got = receive(queue).await;
    assert_eq!(ids(&got), vec![id]);
    assert!(queue.dead_letter(&got[0], "poison").await.unwrap());
    got.into_iter().next().unwrap()
}

#[tokio::test]
async fn queue_dead_letter_holds_its_key_until_replayed() {
    let db = TestDb::migrated().await;
    let queue = PgQueue::new(db.pool.clone());
    let m = publish(
        &db,
        &queue,
        &[(Some("k"), "a"), (Some("k"), "b"), (Some("k"), "c")],
    )
    .await;
    let other = publish(&db, &queue, &[(Some("other"), "x"), (None, "y")]).await;

    // a is delivered twice (a nack in between), then dead-lettered.
    let first = receive(&queue).await;
    assert_eq!(ids(&first), vec![m[0], other[0], other[1]]);
    for d in &first[1..] {
        assert!(queue.ack(d).await.unwrap());
    }
    assert!(
        queue
            .nack(&first[0], Duration::ZERO, "retry")
            .await
            .unwrap()
    );
    let second = receive(&queue).await;
    assert_eq!(ids(&second), vec![m[0]]);
    assert_eq!(second[0].delivery, 2);
    assert!(queue.dead_letter(&second[0], "poison").await.unwrap());

    // While a is dead, b and c are held; other keys flow.
    assert!(
        receive(&queue).await.is_empty(),
        "b was delivered past its dead predecessor"
    );
    let more = publish(&db, &queue, &[(Some("k"), "d"), (Some("other"), "z")]).await;
    receive_and_ack(&queue, &[more[1]]).await;
    assert!(receive(&queue).await.is_empty());

    let dead = queue.dead_letters();
    let listed = dead.list(10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].message_id, m[0]);
    assert_eq!(listed[0].seq, second[0].envelope.seq);
    assert_eq!(listed[0].ordering_key.as_deref(), Some("k"));
    assert_eq!(listed[0].deliveries, 2);
    assert_eq!(listed[0].last_error.as_deref(), Some("poison"));
    let (shown, payload) = dead.get(m[0]).await.unwrap().unwrap();
    assert_eq!(shown, listed[0]);
    assert_eq!(payload, b"a");

    // Replay: a comes back first, at its original position, with a fresh delivery count;
    // then b, c, d in order, one at a time.
    assert_eq!(dead.replay(&[m[0], m[0]]).await.unwrap(), 1);
    assert!(dead.list(10).await.unwrap().is_empty());
    let again = receive(&queue).await;
    assert_eq!(ids(&again), vec![m[0]]);
    assert_eq!(again[0].delivery, 1, "replay starts a fresh delivery count");
    assert_eq!(again[0].envelope.seq, second[0].envelope.seq);
    assert_eq!(again[0].envelope.payload, b"a");
    assert!(queue.ack(&again[0]).await.unwrap());
    receive_and_ack(&queue, &[m[1]]).await;
    receive_and_ack(&queue, &[m[2]]).await;
    receive_and_ack(&queue, &[more[0]]).await;
    assert!(receive(&queue).await.is_empty());
}

#[tokio::test]
async fn queue_dead_letter_discard_releases_its_key() {
    let db = TestDb::migrated().await;
    let queue = PgQueue::new(db.pool.clone());
    let m = publish(&db, &queue, &[(Some("k"), "a"), (Some("k"), "b")]).await;
    dead_letter(&queue, m[0]).await;
    assert!(receive(&queue).await.is_empty());

    let dead = QueueDeadLetters::new(db.pool.clone());
    assert_eq!(dead.discard(&[m[0], Uuid::now_v7()]).await.unwrap(), 1);
    assert!(dead.get(m[0]).await.unwrap().is_none());
    receive_and_ack(&queue, &[m[1]]).await;
    // Discarded for good: nothing comes back.
    assert!(receive(&queue).await.is_empty());
    assert_eq!(dead.replay(&[m[0]]).await.unwrap(), 0);
}

#[tokio::test]
async fn queue_dead_letters_of_one_schema_do_not_hold_another_schemas_keys() {
    let db = TestDb::migrated().await;
    pgbox::Migrator::new()
        .schema("other_box")
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let queue = PgQueue::new(db.pool.clone());
    let m = publish(&db, &queue, &[(Some("k"), "a"), (Some("k"), "b")]).await;
    dead_letter(&queue, m[0]).await;
    assert!(receive(&queue).await.is_empty());

    // The other schema's queue delivers its own messages of key k.
    let other_queue = PgQueue::with_schema(db.pool.clone(), "other_box").unwrap();
    sqlx::query(
        "INSERT INTO other_box.queue (message_id, topic, ordering_key, payload, content_type, headers, created_at) \
         VALUES ($1, $2, 'k', 'o', 'text/plain', '{}', now())",
    )
    .bind(Uuid::now_v7())
    .bind(TOPIC)
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        other_queue
            .receive(TOPIC, 10, VISIBILITY)
            .await
            .unwrap()
            .len(),
        1
    );

    let dead = QueueDeadLetters::with_schema(db.pool.clone(), "other_box").unwrap();
    assert!(dead.list(10).await.unwrap().is_empty());
    assert_eq!(dead.replay_all().await.unwrap(), 0);
    assert_eq!(queue.dead_letters().replay_all().await.unwrap(), 1);
    receive_and_ack(&queue, &[m[0]]).await;
    receive_and_ack(&queue, &[m[1]]).await;
}

#[tokio::test]
async fn queue_receive_finds_a_keys_dead_letter_through_an_index() {
    let db = TestDb::migrated().await;
    let mut conn = db.connect().await;
    sqlx::raw_sql("SET enable_seqscan = off")
        .execute(&mut conn)
        .await
        .unwrap();
    // The receive statement's per-candidate check, as the planner sees it.
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT 1 FROM pgbox.queue_dead_letters AS d \
         WHERE d.topic = 'payments' AND d.ordering_key = 'k'",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("queue_dead_letters_key_idx"), "{plan}");
}

fn pgbox_cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .expect("run pgbox")
}

fn json(o: &Output) -> serde_json::Value {
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

#[tokio::test]
async fn cli_dead_letters_queue_lists_shows_replays_and_discards() {
    let db = TestDb::migrated().await;
    let url = db.url();
    let queue = PgQueue::new(db.pool.clone());
    let m = publish(
        &db,
        &queue,
        &[
            (Some("k"), "a"),
            (Some("k"), "b"),
            (Some("j"), "c"),
            (Some("j"), "d"),
        ],
    )
    .await;
    let got = receive(&queue).await;
    assert_eq!(ids(&got), vec![m[0], m[2]]);
    assert!(queue.dead_letter(&got[0], "bad a").await.unwrap());
    assert!(queue.dead_letter(&got[1], "bad c").await.unwrap());
    let (a, c) = (m[0].to_string(), m[2].to_string());

    // list --queue shows the queue's dead letters; plain list shows the outbox's (none).
    let list = json(&pgbox_cli(
        &url,
        &["dead-letters", "--queue", "list", "--json"],
    ));
    let listed: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, vec![a.as_str(), c.as_str()]);
    assert_eq!(list[0]["deliveries"], 1);
    assert_eq!(list[0]["last_error"], "bad a");
    assert_eq!(list[0]["ordering_key"], "k");
    let outbox = json(&pgbox_cli(&url, &["dead-letters", "list", "--json"]));
    assert_eq!(outbox, serde_json::json!([]));
    let text = pgbox_cli(&url, &["dead-letters", "list", "--queue"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("deliveries=1"));

    // show (the flag also goes after the action).
    let show = json(&pgbox_cli(
        &url,
        &["dead-letters", "show", "--queue", &a, "--json"],
    ));
    assert_eq!(show["payload"], "a");
    assert_eq!(show["message_id"], a.as_str());

    // Unknown ids: exit 5, as for the outbox; a known id among them is still acted on.
    let unknown = Uuid::now_v7().to_string();
    for args in [
        vec!["dead-letters", "--queue", "show", unknown.as_str()],
        vec!["dead-letters", "--queue", "replay", unknown.as_str()],
        vec!["dead-letters", "--queue", "discard", unknown.as_str()],
    ] {
        let out = pgbox_cli(&url, &args);
        assert_eq!(out.status.code(), Some(5), "{args:?}");
    }

    // replay a (named twice): delivered first, then b.
    let replay = json(&pgbox_cli(
        &url,
        &["dead-letters", "--queue", "replay", &a, &a, "--json"],
    ));
    assert_eq!(replay["replayed"], 1);
    receive_and_ack(&queue, &[m[0]]).await;
    receive_and_ack(&queue, &[m[1]]).await;
    // j is still held by c.
    assert!(receive(&queue).await.is_empty());

    // discard c with an unknown id beside it: c is discarded, the report is 1 of 2, exit 5.
    let partial = pgbox_cli(&url, &["dead-letters", "--queue", "discard", &c, &unknown]);
    let err = String::from_utf8_lossy(&partial.stderr);
    assert_eq!(partial.status.code(), Some(5), "{err}");
    assert!(err.contains("discarded 1 of 2"), "{err}");
    receive_and_ack(&queue, &[m[3]]).await;
    let empty = json(&pgbox_cli(
        &url,
        &["dead-letters", "--queue", "list", "--json"],
    ));
    assert_eq!(empty, serde_json::json!([]));

    // replay --all.
    let more = publish(&db, &queue, &[(Some("k"), "e")]).await;
    dead_letter(&queue, more[0]).await;
    let all = json(&pgbox_cli(
        &url,
        &["dead-letters", "--queue", "replay", "--all", "--json"],
    ));
    assert_eq!(all["replayed"], 1);
    receive_and_ack(&queue, &[more[0]]).await;
}
