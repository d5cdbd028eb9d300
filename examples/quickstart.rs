//! pgbox in one screen: a points consumer that receives the same "payment succeeded" message
//! three times (a broker redelivery and a producer retry) and grants the points once.
//!
//! Run with `cargo run --example quickstart`. Uses `DATABASE_URL` when set, else a local
//! server, else starts a throwaway cluster (see `tests/support/local_pg.rs`).

#[allow(dead_code)]
#[path = "support/demo_db.rs"]
mod demo_db;
#[path = "../tests/support/local_pg.rs"]
mod local_pg;

use pgbox::{Inbox, Outcome};
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;

/// What the handler returns: stored with the inbox row and handed back to every duplicate.
#[derive(Debug, Serialize, Deserialize)]
struct Grant {
    points: i64,
    new_total: i64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // A database of the example's own (pgbox_demo), or DATABASE_URL's.
    let url = demo_db::demo_url().await?;
    let pool = pgbox::connect(&url, sqlx::postgres::PgPoolOptions::new()).await?;

    // 1. Once per service start: pgbox's tables, in their own schema.
    pgbox::migrate(&pool).await?;
    // The example's own table, in a schema it made (a `quickstart` schema of anyone else's
    // stops it, untouched).
    demo_db::reset_schemas(&pool, &["quickstart"]).await?;
    sqlx::raw_sql(
        "CREATE TABLE quickstart.points (user_id bigint PRIMARY KEY, total bigint NOT NULL);
         INSERT INTO quickstart.points VALUES (7, 100);
         DELETE FROM pgbox.inbox WHERE consumer = 'quickstart-points';",
    )
    .execute(&pool)
    .await?;

    // 2. One inbox per consumer.
    let inbox = Inbox::new("quickstart-points")?;

    // 3. The same business event arrives three times.
    for delivery in 1..=3 {
        let mut tx = pool.begin().await?;
        let outcome = inbox
            .process(&mut tx, "order-1001", async |conn| {
                let new_total: i64 = sqlx::query_scalar(
                    "UPDATE quickstart.points SET total = total + 30 WHERE user_id = 7 \
                     RETURNING total",
                )
                .fetch_one(&mut *conn)
                .await?;
                Ok::<_, anyhow::Error>(Grant {
                    points: 30,
                    new_total,
                })
            })
            .await?;
        tx.commit().await?; // the points and the inbox row commit together
        match outcome {
            Outcome::Processed(grant) => {
                println!("delivery {delivery}: processed, granted {grant:?}")
            }
            Outcome::Duplicate(dup) => println!(
                "delivery {delivery}: duplicate of the delivery at {}, original answer {:?}",
                dup.first_processed_at.format(&Rfc3339)?,
                dup.outcome::<Grant>()?
            ),
            other => println!("delivery {delivery}: {other:?}"),
        }
    }

    let total: i64 = sqlx::query_scalar("SELECT total FROM quickstart.points WHERE user_id = 7")
        .fetch_one(&pool)
        .await?;
    println!("user 7 has {total} points (100 + 30, once)");
    anyhow::ensure!(total == 130, "expected 130 points, found {total}");
    Ok(())
}
