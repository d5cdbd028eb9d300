//! Lease mode: charging a payment provider (an effect outside the database) once per order,
//! with several workers racing over the same orders and some of them stalling past their lease.
//!
//! The provider is simulated by tables in a schema of their own, standing for a remote API: it
//! dedups retries by idempotency key (derived from the fencing token), refuses a token lower
//! than the highest it has seen for an order (a stale holder), and charges an order once.
//! Exits non-zero if an order is charged twice, never, or recorded with another charge.
//! Run with `cargo run --example external_effect`.

#[allow(dead_code)]
#[path = "support/demo_db.rs"]
mod demo_db;
#[path = "../tests/support/local_pg.rs"]
mod local_pg;

use std::time::Duration;

use anyhow::Context;
use pgbox::{Error, Inbox, Lease, LeasedRun};
use sqlx::PgPool;

const ORDERS: i64 = 30;
const WORKERS: usize = 4;

/// The provider's API (see `ee_provider.charge` below): one call, with an idempotency key
/// derived from the fencing token, and the token itself. `None`: refused as stale.
async fn provider_charge(pool: &PgPool, order: i64, lease: &Lease) -> anyhow::Result<Option<i64>> {
    let charge = sqlx::query_scalar("SELECT ee_provider.charge($1, $2, $3)")
        .bind(order)
        .bind(lease.token().get())
        .bind(lease.idempotency_key());
    Ok(charge.fetch_one(pool).await?)
}

/// The remote side: a retry with the same idempotency key gets the same answer; a token below
/// the highest seen for the order is refused; an order is charged once (a later, newer holder
/// gets the existing charge back).
const PROVIDER: &str = "
CREATE TABLE ee_provider.charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, order_id bigint NOT NULL, token bigint NOT NULL);
CREATE TABLE ee_provider.fences (order_id bigint PRIMARY KEY, highest bigint NOT NULL);
CREATE TABLE ee_provider.requests (idempotency_key text PRIMARY KEY, charge_id bigint);
CREATE FUNCTION ee_provider.charge(p_order bigint, p_token bigint, p_key text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE v_id bigint;
BEGIN
  SELECT charge_id INTO v_id FROM ee_provider.requests WHERE idempotency_key = p_key;
  IF FOUND THEN RETURN v_id; END IF;
  INSERT INTO ee_provider.fences AS f VALUES (p_order, p_token) ON CONFLICT (order_id)
    DO UPDATE SET highest = EXCLUDED.highest WHERE f.highest <= EXCLUDED.highest;
  IF NOT FOUND THEN v_id := NULL;  -- stale token: refused
  ELSE
    SELECT id INTO v_id FROM ee_provider.charges WHERE order_id = p_order;
    IF NOT FOUND THEN
      INSERT INTO ee_provider.charges (order_id, token) VALUES (p_order, p_token) RETURNING id INTO v_id;
    END IF;
  END IF;
  INSERT INTO ee_provider.requests VALUES (p_key, v_id);
  RETURN v_id;
END $$;";

/// The provider refused a stale holder's call.
#[derive(Debug, thiserror::Error)]
#[error("the provider refused a stale fencing token")]
struct Refused;

async fn worker(pool: PgPool, inbox: Inbox, n: usize) -> anyhow::Result<(u32, u32)> {
    let (mut charged, mut refused) = (0, 0);
    for order in 1..=ORDERS {
        for attempt in 0.. {
            anyhow::ensure!(attempt < 100, "order {order} never settled");
            let run = inbox
                .run_leased(
                    &pool,
                    format!("order-{order}"),
                    Duration::from_millis(200),
                    async |lease| {
                        // Some holders stall past their lease before the call (a pause)...
                        if (order + n as i64) % 7 == 0 && lease.taken_over_from().is_none() {
                            tokio::time::sleep(Duration::from_millis(400)).await;
                        }
                        let charge = provider_charge(&pool, order, lease).await?;
                        // ...or after the call, before completing (the next holder calls too).
                        if (order + n as i64) % 5 == 0 && lease.taken_over_from().is_none() {
                            tokio::time::sleep(Duration::from_millis(400)).await;
                        }
                        charge.ok_or_else(|| anyhow::Error::new(Refused))
                    },
                )
                .await;
            match run {
                Ok(LeasedRun::Completed { .. }) => charged += 1,
                Ok(LeasedRun::InProgress { retry_after, .. }) => {
                    tokio::time::sleep(retry_after.min(Duration::from_millis(100))).await;
                    continue;
                }
                Ok(LeasedRun::Duplicate(_)) => {}
                Err(e)
                    if e.is::<Refused>()
                        || matches!(e.downcast_ref(), Some(Error::LeaseLost { .. })) =>
                {
                    refused += 1;
                    continue; // redeliver: the next attempt finds the order consumed, or leases it
                }
                Err(e) => return Err(e),
            }
            break;
        }
    }
    Ok((charged, refused))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = demo_db::demo_url().await?;
    let pool = pgbox::connect(&url, sqlx::postgres::PgPoolOptions::new()).await?;
    // The example's own schemas, so it never touches another program's.
    demo_db::reset_schemas(&pool, &["ee_provider", "ee_pgbox"]).await?;
    sqlx::raw_sql(PROVIDER).execute(&pool).await?;
    pgbox::Migrator::new()
        .schema("ee_pgbox")?
        .run(&pool)
        .await?;
    let inbox = Inbox::builder("external-effect")
        .schema("ee_pgbox")
        .build()?;
    let tasks: Vec<_> = (0..WORKERS)
        .map(|n| tokio::spawn(worker(pool.clone(), inbox.clone(), n)))
        .collect();
    let (mut charged, mut refused) = (0, 0);
    for task in tasks {
        let (c, r) = task.await.context("worker panicked")??;
        (charged, refused) = (charged + c, refused + r);
    }
    println!(
        "{WORKERS} workers, {ORDERS} orders: {charged} completions, {refused} stale holders refused"
    );

    // Invariants: each order charged exactly once, and the inbox records that very charge.
    let twice: i64 = sqlx::query_scalar("SELECT count(*) FROM (SELECT order_id FROM ee_provider.charges GROUP BY order_id HAVING count(*) > 1) t")
        .fetch_one(&pool).await?;
    let (orders, matching): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE (i.outcome #>> '{}')::bigint = c.id) \
         FROM ee_provider.charges c JOIN ee_pgbox.inbox i ON i.consumer = 'external-effect' \
           AND i.key = 'order-' || c.order_id AND i.lease_expires_at IS NULL",
    )
    .fetch_one(&pool)
    .await?;
    println!(
        "charged orders: {orders}, charged twice: {twice}, inbox matches provider: {matching}"
    );
    if twice != 0 || orders != ORDERS || matching != ORDERS || charged != ORDERS as u32 {
        eprintln!("INVARIANT BROKEN");
        std::process::exit(1);
    }
    println!("ok: every order charged once");
    Ok(())
}
