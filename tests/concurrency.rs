//! Many workers, many redeliveries, one effect per key.

mod support;

use std::collections::BTreeSet;

use pgbox::{Error, Inbox, Outcome};
use rand::seq::SliceRandom;
use sqlx::Executor;
use support::TestDb;

const KEYS: usize = 1_000;
const DELIVERIES_PER_KEY: usize = 3;
const WORKERS: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_workers_three_deliveries_per_key_exactly_one_effect_each() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    // No unique constraint here: a double effect would show up as a second row.
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL, worker int NOT NULL)")
        .await
        .unwrap();

    let mut deliveries: Vec<String> = (0..KEYS)
        .flat_map(|k| std::iter::repeat_n(format!("key-{k}"), DELIVERIES_PER_KEY))
        .collect();
    deliveries.shuffle(&mut rand::rng());
    let queue = std::sync::Arc::new(std::sync::Mutex::new(deliveries));
    let inbox = Inbox::new("effects-consumer").unwrap();

    let mut workers = Vec::new();
    for worker in 0..WORKERS as i32 {
        let (queue, inbox, pool) = (queue.clone(), inbox.clone(), db.pool.clone());
        workers.push(tokio::spawn(async move {
            let (mut processed, mut duplicates) = (0, 0);
            loop {
                let Some(key) = queue.lock().unwrap().pop() else {
                    break;
                };
                let mut tx = pool.begin().await.unwrap();
                let outcome = inbox
                    .process(&mut tx, key.as_str(), async |conn| {
                        sqlx::query("INSERT INTO effects (key, worker) VALUES ($1, $2)")
                            .bind(&key)
                            .bind(worker)
                            .execute(&mut *conn)
                            .await?;
                        // Widen the window in which a concurrent duplicate must wait.
                        tokio::task::yield_now().await;
                        Ok::<(), Error>(())
                    })
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                match outcome {
                    Outcome::Processed(()) => processed += 1,
                    Outcome::Duplicate(_) => duplicates += 1,
                    other => panic!("unexpected {other:?}"),
                }
            }
            (processed, duplicates)
        }));
    }
    let (mut processed, mut duplicates) = (0, 0);
    for w in workers {
        let (p, d) = w.await.unwrap();
        processed += p;
        duplicates += d;
    }
    assert_eq!(processed, KEYS);
    assert_eq!(duplicates, KEYS * (DELIVERIES_PER_KEY - 1));

    let effect_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        effect_rows as usize, KEYS,
        "a key took effect more than once"
    );
    let effects: BTreeSet<String> = sqlx::query_scalar("SELECT key FROM effects")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let inbox_keys: BTreeSet<String> =
        sqlx::query_scalar("SELECT key FROM pgbox.inbox WHERE consumer = 'effects-consumer'")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(effects.len(), KEYS);
    assert_eq!(
        effects, inbox_keys,
        "the effect table must equal the inbox table"
    );
}
