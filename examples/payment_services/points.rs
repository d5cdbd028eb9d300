//! The points service: consumes `PaymentSucceeded` and grants 30 points per paid order,
//! exactly once, through its inbox keyed by the order id; serves the users' points.
//!
//! The events arrive in pgbox's native envelope on the built-in queue and as CloudEvents
//! (binary mode) on a broker: the subscribers tell the forms apart, and the handler is the
//! same. The ledger keeps the CloudEvents `source` of the event that granted the points (none
//! for the native envelope). A replay of the payments archive keeps the events' ids, and the
//! inbox, keyed by the order, answers Duplicate: no points twice.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use pgbox::transport::{PgQueue, Subscriber};
use pgbox::{CancellationToken, Consumer, Envelope, Inbox, Migrator, RetryPolicy};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::payments::PaymentSucceeded;
use crate::service::{self, AppError, ServiceArgs, TransportKind, error_body};

/// The business schema and pgbox's, owned by this service.
pub const SCHEMA: &str = "svc_points";
pub const PGBOX_SCHEMA: &str = "svc_points_pgbox";
/// The tables `SETUP` makes, with their columns: an existing table without them is refused.
const TABLES: [(&str, &[&str]); 2] = [
    (
        "svc_points.ledger",
        &[
            "order_id",
            "user_id",
            "points",
            "granted_at",
            "event_source",
        ],
    ),
    ("svc_points.accounts", &["user_id", "total", "version"]),
];
const BROKER_SCHEMA: &str = crate::payments::BROKER_SCHEMA;
/// Points per paid order.
pub const POINTS_PER_ORDER: i64 = 30;

/// Idempotent, run at every start: `IF NOT EXISTS` answers a restart with an "already exists,
/// skipping" NOTICE per object, which sqlx logs at info; quieted for this transaction only.
const SETUP: &str = "
BEGIN;
SET LOCAL client_min_messages = warning;
SELECT pg_advisory_xact_lock(hashtext('points-service-setup'));
CREATE SCHEMA IF NOT EXISTS svc_points;
CREATE TABLE IF NOT EXISTS svc_points.ledger (
    order_id bigint PRIMARY KEY,
    user_id bigint NOT NULL,
    points bigint NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT now(),
    -- The CloudEvents `source` of the granting event; NULL for pgbox's native envelope.
    event_source text
);
CREATE INDEX IF NOT EXISTS ledger_user ON svc_points.ledger (user_id);
CREATE TABLE IF NOT EXISTS svc_points.accounts (
    user_id bigint PRIMARY KEY,
    total bigint NOT NULL,
    version bigint NOT NULL
);
COMMIT;
";

const INSERT_LEDGER: &str = "INSERT INTO svc_points.ledger (order_id, user_id, points, event_source) \
     VALUES ($1, $2, $3, $4)";
/// The total moves only by this statement, under the row lock of the upsert; the version
/// counts the grants (equal to the ledger rows of the user).
const ADD_TO_TOTAL: &str = "INSERT INTO svc_points.accounts AS a (user_id, total, version) VALUES ($1, $2, 1) \
     ON CONFLICT (user_id) DO UPDATE SET total = a.total + EXCLUDED.total, version = a.version + 1";
const USER_POINTS: &str = "SELECT coalesce((SELECT total FROM svc_points.accounts WHERE user_id = $1), 0), \
     (SELECT coalesce(jsonb_agg(jsonb_build_object('order_id', order_id, 'points', points, \
        'granted_at', granted_at) ORDER BY order_id), '[]'::jsonb) \
      FROM svc_points.ledger WHERE user_id = $1)";
const STATS: &str = "SELECT count(*), coalesce(sum(points), 0)::bigint FROM svc_points.ledger";

pub async fn run(args: ServiceArgs) -> anyhow::Result<()> {
    let addr = args
        .listen
        .unwrap_or_else(|| "127.0.0.1:8082".parse().expect("address"));
    let metrics = service::install_metrics()?;
    let pool = args.connect().await?;
    // A table of ours with another layout first (named with its owner), then whose the
    // schemas are.
    for (table, columns) in TABLES {
        crate::demo_db::check_layout(
            &pool,
            "examples/payment_services (its points service)",
            table,
            columns,
        )
        .await?;
    }
    crate::demo_db::ensure_schemas(&pool, &[SCHEMA, PGBOX_SCHEMA]).await?;
    sqlx::raw_sql(SETUP).execute(&pool).await?;
    Migrator::new().schema(PGBOX_SCHEMA)?.run(&pool).await?;
    if args.transport == TransportKind::Postgres {
        crate::demo_db::ensure_schemas(&pool, &[BROKER_SCHEMA]).await?;
        Migrator::new().schema(BROKER_SCHEMA)?.run(&pool).await?;
    }
    let shutdown = CancellationToken::new();
    service::cancel_on_signal(shutdown.clone());
    let mut gauge_schemas = vec![PGBOX_SCHEMA];
    // Like the payment service: a broker that is down makes the service unready, not dead;
    // the consumer retries its receives with backoff meanwhile.
    let (consumer, broker) = match args.transport {
        TransportKind::Postgres => {
            gauge_schemas.push(BROKER_SCHEMA);
            let queue = PgQueue::with_schema(pool.clone(), BROKER_SCHEMA)?;
            (
                spawn_consumer(&pool, queue, &args, &shutdown)?,
                service::BrokerReady::ready(),
            )
        }
        TransportKind::Rabbitmq => {
            let rabbit = args.rabbitmq(None)?;
            let broker = service::BrokerReady::watch_topic(&rabbit, &args.topic, shutdown.clone());
            (spawn_consumer(&pool, rabbit, &args, &shutdown)?, broker)
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            let nats = args.nats("points-service", None)?;
            let broker = service::BrokerReady::watch_topic(&nats, &args.topic, shutdown.clone());
            (spawn_consumer(&pool, nats, &args, &shutdown)?, broker)
        }
        #[cfg(not(feature = "nats"))]
        TransportKind::Nats => anyhow::bail!(crate::needs_feature("nats")),
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            let kafka = args.kafka("points-service", None)?;
            let broker = service::BrokerReady::watch_topic(&kafka, &args.topic, shutdown.clone());
            (spawn_consumer(&pool, kafka, &args, &shutdown)?, broker)
        }
        #[cfg(not(feature = "kafka"))]
        TransportKind::Kafka => anyhow::bail!(crate::needs_feature("kafka")),
    };
    let gauges = service::spawn_gauges(pool.clone(), gauge_schemas, shutdown.clone());

    let app = Router::new()
        .route("/users/{id}/points", get(user_points))
        .route("/stats", get(stats))
        .with_state(pool.clone())
        .merge(service::ops_routes(pool.clone(), metrics, broker));
    tracing::info!(transport = args.transport.name(), topic = %args.topic, "points service starting");
    let served = service::serve(addr, app, shutdown.clone()).await;
    // Stop receiving; the messages in hand are finished and acked before `run` returns.
    shutdown.cancel();
    let consumed = consumer.await;
    gauges.await.ok();
    pool.close().await;
    served?;
    let stats = consumed??;
    tracing::info!(?stats, "points service stopped");
    Ok(())
}

fn spawn_consumer<S: Subscriber + 'static>(
    pool: &PgPool,
    subscriber: S,
    args: &ServiceArgs,
    shutdown: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<pgbox::Result<pgbox::ConsumerStats>>> {
    let inbox = Inbox::builder("points-service")
        .schema(PGBOX_SCHEMA)
        .build()?;
    let consumer = Consumer::builder(pool.clone(), subscriber, args.topic.clone(), inbox)
        .concurrency(4)
        .batch_size(args.batch_size)
        .visibility_timeout(Duration::from_millis(args.visibility_timeout_ms))
        .poll_interval(Duration::from_millis(250))
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(10))
                .max_delay(Duration::from_secs(1)),
        )
        // The business key: the order is rewarded once, whatever message carries it.
        .key(|envelope| match envelope.json::<PaymentSucceeded>() {
            Ok(event) => format!("order-{}", event.order_id),
            Err(_) => envelope.id.to_string(),
        })
        .build()?;
    let shutdown = shutdown.clone();
    Ok(tokio::spawn(async move {
        consumer
            .run(
                async |envelope: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                    let event: PaymentSucceeded = envelope.json()?;
                    // The ledger row and the total as one nested unit of work: a savepoint
                    // inside the inbox's transaction, so its commit cannot end that
                    // transaction (the message and the points still commit together).
                    let mut unit = sqlx::Connection::begin(&mut **conn).await?;
                    sqlx::query(INSERT_LEDGER)
                        .bind(event.order_id)
                        .bind(event.user_id)
                        .bind(POINTS_PER_ORDER)
                        .bind(envelope.cloudevent_attribute("source"))
                        .execute(&mut *unit)
                        .await?;
                    sqlx::query(ADD_TO_TOTAL)
                        .bind(event.user_id)
                        .bind(POINTS_PER_ORDER)
                        .execute(&mut *unit)
                        .await?;
                    unit.commit().await?;
                    tracing::debug!(
                        order_id = event.order_id,
                        user_id = event.user_id,
                        "points granted"
                    );
                    Ok::<(), pgbox::Error>(())
                },
                shutdown,
            )
            .await
    }))
}

/// `GET /users/{id}/points`: `{user_id, points, ledger: [{order_id, points, granted_at}]}`.
async fn user_points(
    State(pool): State<PgPool>,
    Path(user_id): Path<i64>,
) -> Result<Json<Value>, AppError> {
    let (points, ledger): (i64, Value) = sqlx::query_as(USER_POINTS)
        .bind(user_id)
        .fetch_one(&pool)
        .await?;
    Ok(Json(
        json!({ "user_id": user_id, "points": points, "ledger": ledger }),
    ))
}

/// `GET /stats`: `{rewarded_orders, points}`.
async fn stats(State(pool): State<PgPool>) -> Result<Response, AppError> {
    match sqlx::query_as::<_, (i64, i64)>(STATS)
        .fetch_one(&pool)
        .await
    {
        Ok((orders, points)) => {
            Ok(Json(json!({ "rewarded_orders": orders, "points": points })).into_response())
        }
        Err(e) => Ok((
            StatusCode::SERVICE_UNAVAILABLE,
            Json(error_body(e.to_string())),
        )
            .into_response()),
    }
}
