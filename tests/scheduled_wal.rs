//! Scheduled messages in the WAL outbox: written to `outbox_scheduled` in the producer's
//! transaction, emitted into the WAL by the WAL relay once due (the delete and the emit in
//! one transaction), then read through the slot like any message. On a private cluster with
//! `wal_level = logical`.

mod support;

use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{Message, Outbox, OutboxMode, ScheduleConflict, WalRelay};
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

async fn queued(pool: &PgPool) -> Vec<(Uuid, String)> {
    sqlx::query_as::<_, (Uuid, Vec<u8>)>("SELECT message_id, payload FROM pgbox.queue ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(id, p)| (id, String::from_utf8(p).unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn due_scheduled_messages_enter_the_wal_once_in_due_order_and_keep_their_ids() {
    let (_cluster, pool, slot) = support::wal::logical(&[]).await;
    let wal = Outbox::new().mode(OutboxMode::Wal);
    let mut tx = pool.begin().await.unwrap();
    let later = wal
        .enqueue(
            &mut tx,
            Message::bytes("w", "later")
                .ordering_key("k")
                .deliver_after(Duration::from_millis(1500)),
        )
        .await
        .unwrap();
    let now = wal
        .enqueue(
            &mut tx,
            Message::bytes("w", "past").deliver_at(OffsetDateTime::UNIX_EPOCH),
        )
        .await
        .unwrap();
    // Cancelled before it is due: never in the WAL.
    wal.enqueue(
        &mut tx,
        Message::bytes("w", "cancelled")
            .schedule_key("c")
            .deliver_after(Duration::from_millis(100))
            .on_schedule_conflict(ScheduleConflict::Replace),
    )
    .await
    .unwrap();
    assert!(wal.cancel_scheduled(&mut tx, "w", "c").await.unwrap());
    wal.enqueue(&mut tx, Message::bytes("w", "immediate").ordering_key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox_scheduled")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        pending, 2,
        "scheduled messages wait in the table, not the WAL"
    );

    let relay = WalRelay::builder(pool.clone(), slot.clone(), PgQueue::new(pool.clone()))
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    // The one due now was promoted after the producer's commit: after `immediate`.
    assert_eq!(
        queued(&pool)
            .await
            .iter()
            .find(|(_, p)| p == "past")
            .map(|(id, _)| *id),
        Some(now)
    );
    let got: Vec<String> = queued(&pool).await.into_iter().map(|(_, p)| p).collect();
    assert_eq!(got, ["immediate", "past"]);
    let started = Instant::now();
    loop {
        relay.drain().await.unwrap();
        let got = queued(&pool).await;
        if got.len() == 3 {
            assert_eq!(got[2], (later, "later".to_owned()));
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.outbox_scheduled")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(pending, 0);
    // Nothing more: each went into the WAL once.
    relay.drain().await.unwrap();
    assert_eq!(queued(&pool).await.len(), 3);
}
