//! A schema-per-tenant shop: every tenant's orders and outbox live in a schema of its own
//! (`tenant_acme`, `tenant_globex`, …); one `TenantRelay` publishes every tenant's outbox into
//! one built-in queue (schema `shop_hub`); one consumer runner writes each invoice into the
//! schema of the tenant the message came from (the `pgbox-tenant` header), through one inbox.
//! A tenant that signs up while everything runs is served without a restart.
//!
//! Run with `cargo run --example tenants`. Uses `DATABASE_URL` when set, else a local
//! server, else starts a throwaway cluster (see `tests/support/local_pg.rs`).

#[allow(dead_code)]
#[path = "support/demo_db.rs"]
mod demo_db;
#[path = "../tests/support/local_pg.rs"]
mod local_pg;

use std::time::{Duration, Instant};

use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, Envelope, HandlerConnection, Inbox, Message, Migrator, Outbox,
    TENANT_HEADER, TenantRelay,
};
use sqlx::{AssertSqlSafe, PgPool};

const FIRST_TENANTS: [&str; 3] = ["tenant_acme", "tenant_globex", "tenant_initech"];
const LATE_TENANT: &str = "tenant_umbrella";
const HUB: &str = "shop_hub";
const ORDERS_PER_TENANT: i64 = 40;

/// A tenant signs up: its schema, pgbox's tables in it, and its own business tables.
async fn sign_up(pool: &PgPool, tenant: &str) -> anyhow::Result<()> {
    demo_db::reset_schemas(pool, &[tenant]).await?;
    Migrator::new().schema(tenant)?.run(pool).await?;
    create_tables(pool, tenant).await
}

async fn create_tables(pool: &PgPool, tenant: &str) -> anyhow::Result<()> {
    // `tenant` is one of this example's constants, checked by `Migrator::schema` above.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {tenant}.orders (id bigint PRIMARY KEY, amount_cents bigint NOT NULL);
         CREATE TABLE {tenant}.invoices (order_id bigint PRIMARY KEY, amount_cents bigint NOT NULL);"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// A tenant's order: the row and its event, in one transaction of the tenant's schema.
async fn place_order(pool: &PgPool, tenant: &str, id: i64) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {tenant}.orders VALUES ($1, $2)"
    )))
    .bind(id)
    .bind(100 * id)
    .execute(&mut *tx)
    .await?;
    Outbox::with_schema(tenant)?
        .enqueue(
            &mut tx,
            Message::json(
                "order.placed",
                &serde_json::json!({"order": id, "cents": 100 * id}),
            )?
            .ordering_key(format!("order-{id}")),
        )
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The tenant a message came from, as one of this shop's tenant schemas (never a name taken
/// on trust into SQL).
fn tenant_of(envelope: &Envelope) -> anyhow::Result<&'static str> {
    let header = envelope
        .headers
        .get(TENANT_HEADER)
        .ok_or_else(|| anyhow::anyhow!("no {TENANT_HEADER} header"))?;
    let schema = header.rsplit('/').next().unwrap_or_default();
    FIRST_TENANTS
        .iter()
        .chain([&LATE_TENANT])
        .find(|t| **t == schema)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("unknown tenant {header:?}"))
}

async fn invoice(envelope: &Envelope, conn: &mut HandlerConnection<'_>) -> anyhow::Result<()> {
    let tenant = tenant_of(envelope)?;
    let body: serde_json::Value = serde_json::from_slice(&envelope.payload)?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {tenant}.invoices VALUES ($1, $2)"
    )))
    .bind(body["order"].as_i64().unwrap_or_default())
    .bind(body["cents"].as_i64().unwrap_or_default())
    .execute(&mut **conn)
    .await?;
    Ok(())
}

async fn invoices(pool: &PgPool, tenant: &str) -> anyhow::Result<(i64, i64)> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {tenant}.invoices), \
                (SELECT count(*) FROM {tenant}.orders o WHERE NOT EXISTS \
                   (SELECT 1 FROM {tenant}.invoices i WHERE i.order_id = o.id))"
    )))
    .fetch_one(pool)
    .await?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = demo_db::demo_url().await?;
    let pool = pgbox::connect(
        &url,
        sqlx::postgres::PgPoolOptions::new().max_connections(12),
    )
    .await?;

    // The hub: the queue every tenant's messages go to, and the invoicing consumer's inbox.
    demo_db::reset_schemas(&pool, &[HUB, LATE_TENANT]).await?;
    Migrator::new().schema(HUB)?.run(&pool).await?;
    // The tenants that exist at start-up, migrated in one call (a deploy would run
    // `pgbox --tenants 'tenant\_%' migrate`).
    demo_db::reset_schemas(&pool, &FIRST_TENANTS).await?;
    for outcome in Migrator::new().run_each(&pool, FIRST_TENANTS, 2).await? {
        outcome.result?;
    }
    for tenant in FIRST_TENANTS {
        create_tables(&pool, tenant).await?;
    }
    // The late tenant's schema is dropped again: it signs up below, while everything runs.
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {LATE_TENANT} CASCADE")))
        .execute(&pool)
        .await?;

    // One relay for every tenant schema of this database, found by name and found again
    // every second.
    let relay = TenantRelay::builder(PgQueue::with_schema(pool.clone(), HUB)?)
        .database(pool.clone())
        .schema_pattern("tenant\\_%")
        .discover_interval(Duration::from_secs(1))
        .build()?;
    // One runner for every tenant: one inbox in the hub, the key made of the tenant and the
    // message id (two tenants' ids never collide there).
    let consumer = Consumer::builder(
        pool.clone(),
        PgQueue::with_schema(pool.clone(), HUB)?,
        "order.placed",
        Inbox::builder("invoicing").schema(HUB).build()?,
    )
    .key(|e: &Envelope| {
        format!(
            "{}:{}",
            e.headers
                .get(TENANT_HEADER)
                .map(String::as_str)
                .unwrap_or("?"),
            e.id
        )
    })
    .concurrency(4)
    .build()?;

    let shutdown = CancellationToken::new();
    let relay_task = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let consumer_task = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { consumer.run(invoice, shutdown).await })
    };

    for tenant in FIRST_TENANTS {
        for id in 1..=ORDERS_PER_TENANT {
            place_order(&pool, tenant, id).await?;
        }
    }
    println!("placed {ORDERS_PER_TENANT} orders in each of {FIRST_TENANTS:?}");
    sign_up(&pool, LATE_TENANT).await?;
    for id in 1..=ORDERS_PER_TENANT {
        place_order(&pool, LATE_TENANT, id).await?;
    }
    println!("{LATE_TENANT} signed up while the relay ran, and placed {ORDERS_PER_TENANT} orders");

    let all: Vec<&str> = FIRST_TENANTS.iter().copied().chain([LATE_TENANT]).collect();
    let started = Instant::now();
    loop {
        let mut missing = 0;
        for tenant in &all {
            missing += invoices(&pool, tenant).await?.1;
        }
        if missing == 0 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "{missing} orders still without an invoice after a minute"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    relay_task.await??;
    let stats = consumer_task.await??;
    for tenant in &all {
        let (count, missing) = invoices(&pool, tenant).await?;
        println!("{tenant}: {count} invoices, {missing} orders without one");
        anyhow::ensure!(
            count == ORDERS_PER_TENANT && missing == 0,
            "{tenant}: each order invoiced once"
        );
    }
    println!(
        "every order of every tenant invoiced once, in its own schema ({} messages handled)",
        stats.processed
    );
    Ok(())
}
