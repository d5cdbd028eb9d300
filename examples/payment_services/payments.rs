//! The payments service: orders over HTTP, paid exactly once per `Idempotency-Key`, with
//! `PaymentSucceeded` written to the outbox in the paying transaction and relayed.
//!
//! Idempotency is pgbox's `Idempotency-Key` layer (`pgbox::idempotency`, feature `axum`): it
//! claims the key in the inbox and hands the handler that transaction (`IdempotencyTx`), so
//! the inbox row, the order's transition, the outbox message and the stored response commit
//! together, and every retry of the key is answered with what the first attempt answered
//! (`Idempotent-Replayed: true`). A concurrent retry waits on the key (`Wait::Block`, the
//! default) until the first transaction ends. The same key sent with another request is
//! refused with 422. A 404 or 409 is not stored (its transaction rolls back): paying an order
//! that does not exist yet, then retrying the key once it does, pays it.
//!
//! Three features of pgbox a real payments service would use:
//!
//! - **A scheduled payment reminder.** Creating an order schedules a `PaymentReminder`
//!   (`Message::deliver_after`, `--reminder-after-secs`, schedule key `order-<id>`) in the
//!   creating transaction; paying the order cancels it (`Outbox::cancel_scheduled`) in the
//!   paying transaction. The service consumes its own reminders through its inbox (consumer
//!   `payment-reminders`, keyed by the order): under the order's row lock, an order still
//!   awaiting payment is reminded once (`svc_payments.reminders`); one paid meanwhile (its
//!   reminder was already due when the payment came) is not.
//! - **The archive.** The relay keeps what it published for `--archive-days`
//!   (`RelayBuilder::archive`), so an operator can replay one user's events
//!   (`pgbox replay --schema svc_payments_pgbox --topic payment-succeeded --key user-7`): they
//!   keep their ids, and the points inbox answers Duplicate.
//! - **CloudEvents.** On a broker (`--transport rabbitmq|nats|kafka`) the relay publishes
//!   CloudEvents 1.0 in binary mode, source `/payments`, so services in other languages read
//!   them with any CloudEvents SDK; the points service reads them like the native envelope.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use pgbox::cloudevents::CloudEvents;
use pgbox::idempotency::{IdempotencyLayer, IdempotencyTx};
use pgbox::janitor::{Janitor, Retention};
use pgbox::transport::Subscriber;
use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    Archive, ArchiveRetention, CancellationToken, Consumer, Envelope, Inbox, Message, Migrator,
    Outbox, Relay, RetryPolicy, StateMachine, StateTable, Transition,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::service::{self, AppError, ServiceArgs, TransportKind, error_body};

/// The business schema and pgbox's, owned by this service.
pub const SCHEMA: &str = "svc_payments";
pub const PGBOX_SCHEMA: &str = "svc_payments_pgbox";
/// The built-in queue's schema (transport `postgres`).
pub const BROKER_SCHEMA: &str = "broker";
/// Inbox consumers of the idempotency layers: one key space per kind of request.
const PAY_REQUESTS: &str = "pay-requests";
const ORDER_REQUESTS: &str = "order-requests";
/// The inbox consumer of the payment reminders.
const REMINDERS: &str = "payment-reminders";
/// The CloudEvents `source` of what this service publishes on a broker.
pub const EVENT_SOURCE: &str = "/payments";

/// Who owns this service's tables, as a layout mismatch names it.
const OWNER: &str = "examples/payment_services (its payments service)";
/// The tables `SETUP` makes, with their columns: an existing table without them is refused.
const TABLES: [(&str, &[&str]); 3] = [
    (
        "svc_payments.orders",
        &[
            "id",
            "user_id",
            "amount",
            "status",
            "payment_id",
            "created_at",
            "paid_at",
        ],
    ),
    ("svc_payments.injected_faults", &["kind", "count"]),
    (
        "svc_payments.reminders",
        &["order_id", "sent", "first_sent_at", "last_sent_at"],
    ),
];

/// Idempotent, run at every start: `IF NOT EXISTS` answers a restart with an "already exists,
/// skipping" NOTICE per object, which sqlx logs at info; quieted for this transaction only.
const SETUP: &str = "
BEGIN;
SET LOCAL client_min_messages = warning;
SELECT pg_advisory_xact_lock(hashtext('payments-service-setup'));
CREATE SCHEMA IF NOT EXISTS svc_payments;
CREATE TABLE IF NOT EXISTS svc_payments.orders (
    id bigserial PRIMARY KEY,
    user_id bigint NOT NULL,
    amount bigint NOT NULL CHECK (amount > 0),
    status text NOT NULL DEFAULT 'created',
    payment_id uuid,
    created_at timestamptz NOT NULL DEFAULT now(),
    paid_at timestamptz
);
-- What the fault flags injected (--duplicate-rate, --producer-retries), across restarts.
CREATE TABLE IF NOT EXISTS svc_payments.injected_faults (
    kind text PRIMARY KEY,
    count bigint NOT NULL
);
-- The payment reminders sent, one row per order; `sent` counts them (once, through the inbox).
CREATE TABLE IF NOT EXISTS svc_payments.reminders (
    order_id bigint PRIMARY KEY,
    sent int NOT NULL,
    first_sent_at timestamptz NOT NULL,
    last_sent_at timestamptz NOT NULL
);
COMMIT;
";

const INSERT_ORDER: &str = "INSERT INTO svc_payments.orders (user_id, amount) VALUES ($1, $2) \
     RETURNING to_jsonb(orders.*)";
/// `paid_at` is read under the order's row lock (`clock_timestamp()`, not the transaction's
/// start): a reminder recorded before the payment (under the same lock) is always earlier.
const MARK_PAID: &str = "UPDATE svc_payments.orders \
     SET payment_id = gen_random_uuid(), paid_at = clock_timestamp() \
     WHERE id = $1 RETURNING to_jsonb(orders.*)";
/// The order's status, its row locked against a concurrent payment.
const LOCK_ORDER: &str = "SELECT status FROM svc_payments.orders WHERE id = $1 FOR UPDATE";
const RECORD_REMINDER: &str = "INSERT INTO svc_payments.reminders AS r \
     (order_id, sent, first_sent_at, last_sent_at) VALUES ($1, 1, now(), now()) \
     ON CONFLICT (order_id) DO UPDATE SET sent = r.sent + 1, last_sent_at = now()";
const GET_ORDER: &str = "SELECT to_jsonb(o.*) FROM svc_payments.orders o WHERE id = $1";
const STATS: &str =
    "SELECT count(*), count(*) FILTER (WHERE status = 'paid') FROM svc_payments.orders";
const COUNT_FAULT: &str = "INSERT INTO svc_payments.injected_faults AS f (kind, count) VALUES ($1, $2) \
     ON CONFLICT (kind) DO UPDATE SET count = f.count + EXCLUDED.count";
const FAULTS: &str = "SELECT \
     coalesce((SELECT count FROM svc_payments.injected_faults WHERE kind = 'relay_duplicates'), 0), \
     coalesce((SELECT count FROM svc_payments.injected_faults WHERE kind = 'producer_resends'), 0)";
/// `injected_faults.kind` of each fault.
const RELAY_DUPLICATES: &str = "relay_duplicates";
const PRODUCER_RESENDS: &str = "producer_resends";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderState {
    Created,
    Paid,
}

impl StateMachine for OrderState {
    const STATES: &'static [Self] = &[OrderState::Created, OrderState::Paid];
    fn name(self) -> &'static str {
        match self {
            OrderState::Created => "created",
            OrderState::Paid => "paid",
        }
    }
    fn next(self) -> &'static [Self] {
        match self {
            OrderState::Created => &[OrderState::Paid],
            OrderState::Paid => &[],
        }
    }
}

/// The event, as the points service reads it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PaymentSucceeded {
    pub order_id: i64,
    pub user_id: i64,
    pub amount: i64,
}

/// The reminder an order awaiting payment schedules for itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PaymentReminder {
    pub order_id: i64,
    pub user_id: i64,
}

/// The schedule key of an order's payment reminder (and the reminders' inbox key).
fn reminder_key(order_id: i64) -> String {
    format!("order-{order_id}")
}

struct Payments {
    pool: PgPool,
    orders: StateTable<OrderState>,
    outbox: Outbox,
    topic: String,
    /// `--producer-retries`: the share of payments whose event is enqueued a second time.
    producer_retries: f64,
    reminder_topic: String,
    reminder_after: std::time::Duration,
}

type Shared = Arc<Payments>;

pub async fn run(args: ServiceArgs) -> anyhow::Result<()> {
    let addr = args
        .listen
        .unwrap_or_else(|| "127.0.0.1:8081".parse().expect("address"));
    args.check_fault_rates()?;
    let metrics = service::install_metrics()?;
    let pool = args.connect().await?;
    // A table of ours with another layout first (named with its owner), then whose the
    // schemas are.
    for (table, columns) in TABLES {
        crate::demo_db::check_layout(&pool, OWNER, table, columns).await?;
    }
    crate::demo_db::ensure_schemas(&pool, &[SCHEMA, PGBOX_SCHEMA]).await?;
    sqlx::raw_sql(SETUP).execute(&pool).await?;
    Migrator::new().schema(PGBOX_SCHEMA)?.run(&pool).await?;
    if args.transport == TransportKind::Postgres {
        crate::demo_db::ensure_schemas(&pool, &[BROKER_SCHEMA]).await?;
        Migrator::new().schema(BROKER_SCHEMA)?.run(&pool).await?;
    }
    refuse_reminders_under_another_topic(&pool, &args.reminder_topic).await?;
    // `--archive-days` is this service's to set: recorded here, so a shorter value takes
    // effect (a relay on its own only ever lengthens the archive's retention).
    Archive::new(pool.clone())
        .with_schema(PGBOX_SCHEMA)?
        .configure(ArchiveRetention::days(args.archive_days))
        .await?;
    let state: Shared = Arc::new(Payments {
        pool: pool.clone(),
        orders: StateTable::new("orders")?.schema(SCHEMA)?,
        outbox: Outbox::with_schema(PGBOX_SCHEMA)?,
        topic: args.topic.clone(),
        producer_retries: args.producer_retries,
        reminder_topic: args.reminder_topic.clone(),
        reminder_after: args.reminder_after()?,
    });

    let shutdown = CancellationToken::new();
    service::cancel_on_signal(shutdown.clone());
    let mut gauge_schemas = vec![PGBOX_SCHEMA];
    // A broker that is down does not stop the service: it starts unready, declares the topic
    // with backoff, and the relay retries its publishes meanwhile (nothing is lost: the
    // messages wait in the outbox).
    // On a broker the relay publishes CloudEvents (binary mode); the reminders come back
    // through the same broker, its subscriber reading either form.
    let events = || CloudEvents::new(EVENT_SOURCE);
    let topics = [args.topic.as_str(), args.reminder_topic.as_str()];
    let (relay, reminders, broker) = match args.transport {
        TransportKind::Postgres => {
            gauge_schemas.push(BROKER_SCHEMA);
            let queue = PgQueue::with_schema(pool.clone(), BROKER_SCHEMA)?;
            (
                spawn_relay(&pool, queue.clone(), &args, &shutdown)?,
                spawn_reminders(&pool, queue, &args, &shutdown)?,
                service::BrokerReady::ready(),
            )
        }
        TransportKind::Rabbitmq => {
            let rabbit = args.rabbitmq(Some(events()?))?;
            let broker = service::BrokerReady::watch_topics(&rabbit, &topics, shutdown.clone());
            (
                spawn_relay(&pool, rabbit.clone(), &args, &shutdown)?,
                spawn_reminders(&pool, rabbit, &args, &shutdown)?,
                broker,
            )
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            let nats = args.nats("payments-service", Some(events()?))?;
            let broker = service::BrokerReady::watch_topics(&nats, &topics, shutdown.clone());
            (
                spawn_relay(&pool, nats.clone(), &args, &shutdown)?,
                spawn_reminders(&pool, nats, &args, &shutdown)?,
                broker,
            )
        }
        #[cfg(not(feature = "nats"))]
        TransportKind::Nats => anyhow::bail!(crate::needs_feature("nats")),
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            let kafka = args.kafka("payments-service", Some(events()?))?;
            let broker = service::BrokerReady::watch_topics(&kafka, &topics, shutdown.clone());
            (
                spawn_relay(&pool, kafka.clone(), &args, &shutdown)?,
                spawn_reminders(&pool, kafka, &args, &shutdown)?,
                broker,
            )
        }
        #[cfg(not(feature = "kafka"))]
        TransportKind::Kafka => anyhow::bail!(crate::needs_feature("kafka")),
    };
    let gauges = service::spawn_gauges(pool.clone(), gauge_schemas, shutdown.clone());
    let janitor = spawn_janitor(&pool, &args, &shutdown)?;

    // `Idempotency-Key`: required to pay, optional to create an order (without one, each
    // request creates an order).
    let pay_requests = IdempotencyLayer::builder(
        pool.clone(),
        Inbox::builder(PAY_REQUESTS).schema(PGBOX_SCHEMA).build()?,
    )
    .build()?;
    let order_requests = IdempotencyLayer::builder(
        pool.clone(),
        Inbox::builder(ORDER_REQUESTS)
            .schema(PGBOX_SCHEMA)
            .build()?,
    )
    .required(false)
    .build()?;
    let app = Router::new()
        .route("/orders", post(create_order).route_layer(order_requests))
        .route("/orders/{id}", get(get_order))
        .route(
            "/orders/{id}/pay",
            post(pay_order)
                .route_layer(pay_requests)
                // Outside the idempotency layer: runs after its commit.
                .route_layer(middleware::from_fn_with_state(
                    state.clone(),
                    resend_after_commit,
                )),
        )
        .route("/stats", get(stats))
        .with_state(state)
        .merge(service::ops_routes(pool.clone(), metrics, broker));
    tracing::info!(
        transport = args.transport.name(),
        topic = %args.topic,
        duplicate_rate = args.duplicate_rate,
        producer_retries = args.producer_retries,
        reminder_topic = %args.reminder_topic,
        reminder_after_secs = args.reminder_after_secs,
        archive_days = args.archive_days,
        "payments service starting"
    );
    let served = service::serve(addr, app, shutdown.clone()).await;
    // The listener is closed and requests in flight are answered: stop the relay (it
    // finishes its round) and the gauges.
    shutdown.cancel();
    let relayed = relay.await;
    let reminded = reminders.await;
    gauges.await.ok();
    if let Err(e) = janitor.await? {
        tracing::warn!(error = %e, "the janitor stopped with an error");
    }
    pool.close().await;
    served?;
    relayed??;
    let stats = reminded??;
    tracing::info!(?stats, "payment reminders consumer stopped");
    tracing::info!("payments service stopped");
    Ok(())
}

/// Refuses to start while payment reminders wait under a topic other than `topic` (the
/// service schedules nothing else): started with another `--reminder-topic`, it would neither
/// consume them nor cancel them when their orders are paid.
async fn refuse_reminders_under_another_topic(pool: &PgPool, topic: &str) -> anyhow::Result<()> {
    // PGBOX_SCHEMA is a constant of this file.
    let others: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT DISTINCT topic FROM {PGBOX_SCHEMA}.outbox_scheduled WHERE topic <> $1 ORDER BY 1 LIMIT 5"
    )))
    .bind(topic)
    .fetch_all(pool)
    .await?;
    if !others.is_empty() {
        anyhow::bail!(
            "payment reminders are scheduled under {others:?}, not under --reminder-topic \
             {topic:?}: start with --reminder-topic {first:?} until they are sent (or cancel \
             them: DELETE FROM {PGBOX_SCHEMA}.outbox_scheduled WHERE topic = '{first}')",
            first = others[0]
        );
    }
    Ok(())
}

/// The janitor of the payments' pgbox schema: creates the archive's partitions ahead and
/// drops expired ones (`--archive-days`), and purges the inboxes (the reminders', the
/// Idempotency-Key layers') a day after the archive lets go of what they guard, so a replay
/// of anything still archived still meets its inbox row.
fn spawn_janitor(
    pool: &PgPool,
    args: &ServiceArgs,
    shutdown: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<pgbox::Result<()>>> {
    let keep = std::time::Duration::from_secs(86_400 * (u64::from(args.archive_days) + 1));
    let janitor = Janitor::builder(pool.clone())
        .schema(PGBOX_SCHEMA)
        .inbox_retention(Retention::After(keep))
        // The service refreshes its gauges itself (`service::spawn_gauges`).
        .refresh_gauges(false)
        .build()?;
    let shutdown = shutdown.clone();
    Ok(tokio::spawn(async move { janitor.run(shutdown).await }))
}

fn spawn_relay<P: Publisher + 'static>(
    pool: &PgPool,
    publisher: P,
    args: &ServiceArgs,
    shutdown: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<pgbox::Result<()>>> {
    let publisher = DuplicatingPublisher {
        inner: publisher,
        rate: args.duplicate_rate,
        pool: pool.clone(),
    };
    // What it publishes is kept for `--archive-days` (daily partitions, dropped whole), for
    // replays.
    let relay = Relay::builder(pool.clone(), publisher)
        .schema(PGBOX_SCHEMA)
        .archive(ArchiveRetention::days(args.archive_days))
        .build()?;
    let shutdown = shutdown.clone();
    Ok(tokio::spawn(async move { relay.run(shutdown).await }))
}

/// Consumes the payment reminders through the inbox `payment-reminders`, keyed by the order:
/// one reminder per order whatever the redeliveries. An order paid meanwhile (its reminder
/// was due before the payment could cancel it) is not reminded.
fn spawn_reminders<S: Subscriber + 'static>(
    pool: &PgPool,
    subscriber: S,
    args: &ServiceArgs,
    shutdown: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<pgbox::Result<pgbox::ConsumerStats>>> {
    let inbox = Inbox::builder(REMINDERS).schema(PGBOX_SCHEMA).build()?;
    let consumer = Consumer::builder(pool.clone(), subscriber, args.reminder_topic.clone(), inbox)
        .concurrency(2)
        .visibility_timeout(std::time::Duration::from_millis(args.visibility_timeout_ms))
        .poll_interval(std::time::Duration::from_millis(250))
        .backoff(
            RetryPolicy::new()
                .base_delay(std::time::Duration::from_millis(10))
                .max_delay(std::time::Duration::from_secs(1)),
        )
        .key(|envelope| match envelope.json::<PaymentReminder>() {
            Ok(reminder) => reminder_key(reminder.order_id),
            Err(_) => envelope.id.to_string(),
        })
        .build()?;
    let shutdown = shutdown.clone();
    Ok(tokio::spawn(async move {
        consumer
            .run(
                async |envelope: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                    let reminder: PaymentReminder = envelope.json()?;
                    // Under the order's row lock: a payment in flight finishes first.
                    let status: Option<String> = sqlx::query_scalar(LOCK_ORDER)
                        .bind(reminder.order_id)
                        .fetch_optional(&mut **conn)
                        .await?;
                    if status.as_deref() == Some(OrderState::Created.name()) {
                        sqlx::query(RECORD_REMINDER)
                            .bind(reminder.order_id)
                            .execute(&mut **conn)
                            .await?;
                        // Where a real service would send the e-mail (through its own outbox).
                        tracing::info!(
                            order_id = reminder.order_id,
                            user_id = reminder.user_id,
                            "payment reminder sent"
                        );
                    } else {
                        tracing::info!(
                            order_id = reminder.order_id,
                            status = status.as_deref().unwrap_or("missing"),
                            "payment reminder dropped: the order does not await payment"
                        );
                    }
                    Ok::<(), pgbox::Error>(())
                },
                shutdown,
            )
            .await
    }))
}

/// Fault injection (`--duplicate-rate`): publishes a share of the relayed messages a second
/// time, same message id, as a broker redelivering would. The points inbox absorbs them.
struct DuplicatingPublisher<P> {
    inner: P,
    rate: f64,
    /// Where the duplicates are counted (`svc_payments.injected_faults`).
    pool: PgPool,
}

impl<P: Publisher> Publisher for DuplicatingPublisher<P> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let results = self.inner.publish(batch).await;
        if self.rate <= 0.0 || !results.iter().all(Result::is_ok) {
            return results;
        }
        let again: Vec<Envelope> = batch
            .iter()
            .filter(|_| fastrand::f64() < self.rate)
            .cloned()
            .collect();
        if !again.is_empty() && self.inner.publish(&again).await.iter().all(Result::is_ok) {
            if let Err(e) = sqlx::query(COUNT_FAULT)
                .bind(RELAY_DUPLICATES)
                .bind(again.len() as i64)
                .execute(&self.pool)
                .await
            {
                tracing::warn!(error = %e, "cannot count the injected duplicates");
            }
            tracing::debug!(messages = again.len(), "injected: published twice");
        }
        results
    }

    fn atomic_batches(&self) -> bool {
        self.inner.atomic_batches()
    }
}

#[derive(Debug, Deserialize)]
struct NewOrder {
    user_id: i64,
    amount: i64,
}

/// `POST /orders {user_id, amount}`: 201 with the order, and its payment reminder scheduled in
/// the same transaction. With an `Idempotency-Key`, a retry gets the same order instead of
/// creating another one.
async fn create_order(
    State(app): State<Shared>,
    tx: IdempotencyTx,
    Json(new): Json<NewOrder>,
) -> Result<Response, AppError> {
    if new.amount <= 0 {
        return Ok((
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(error_body("amount must be positive")),
        )
            .into_response());
    }
    let mut tx = tx.lock().await?;
    let order: Value = sqlx::query_scalar(INSERT_ORDER)
        .bind(new.user_id)
        .bind(new.amount)
        .fetch_one(&mut **tx)
        .await?;
    let order_id = order["id"].as_i64().unwrap_or_default();
    let reminder = Message::json(
        &app.reminder_topic,
        &PaymentReminder {
            order_id,
            user_id: new.user_id,
        },
    )?
    .schedule_key(reminder_key(order_id))
    .deliver_after(app.reminder_after);
    app.outbox.enqueue(&mut tx.connection(), reminder).await?;
    Ok((StatusCode::CREATED, Json(order)).into_response())
}

/// `POST /orders/{id}/pay` with `Idempotency-Key` (required): 200 with the paid order; 409
/// when the order is paid already (by another key); 404 when there is no such order. The
/// layer stores the 200 with the payment; the 404 and 409 are not stored (and roll back).
async fn pay_order(
    State(app): State<Shared>,
    Path(order_id): Path<i64>,
    idempotent: IdempotencyTx,
) -> Result<Response, AppError> {
    let mut tx = idempotent.lock().await?;
    // Locks the order row: a concurrent payment of it with another key waits here and then
    // finds it paid.
    Ok(
        match app
            .orders
            .transition(&mut tx.connection(), order_id, OrderState::Paid)
            .await?
        {
            Transition::Applied { .. } => {
                // Paid: no reminder. Cancelled first, before `paid_at` is taken: a payment held
                // up later (the event's per-key enqueue lock) cannot let the relay promote the
                // reminder of an order recorded as paid before it fell due. Too late when it
                // was due already (the reminders consumer then finds the order paid, under the
                // same row lock, and drops it).
                let reminder_cancelled = app
                    .outbox
                    .cancel_scheduled(
                        &mut tx.connection(),
                        &app.reminder_topic,
                        &reminder_key(order_id),
                    )
                    .await?;
                let order: Value = sqlx::query_scalar(MARK_PAID)
                    .bind(order_id)
                    .fetch_one(&mut **tx)
                    .await?;
                let event = PaymentSucceeded {
                    order_id,
                    user_id: order["user_id"].as_i64().unwrap_or_default(),
                    amount: order["amount"].as_i64().unwrap_or_default(),
                };
                let message = Message::json(&app.topic, &event)?
                    .ordering_key(format!("user-{}", event.user_id));
                app.outbox.enqueue(&mut tx.connection(), message).await?;
                tracing::info!(
                    order_id,
                    user_id = event.user_id,
                    key = idempotent.key(),
                    reminder_cancelled,
                    "order paid"
                );
                // The event rides along for `resend_after_commit`; the layer stores only status,
                // selected headers and body.
                (StatusCode::OK, Extension(event), Json(order)).into_response()
            }
            Transition::AlreadyInState | Transition::Stale { .. } => (
                StatusCode::CONFLICT,
                Json(json!({ "error": "order already paid", "order_id": order_id })),
            )
                .into_response(),
            Transition::NotFound => (
                StatusCode::NOT_FOUND,
                Json(json!({ "error": "no such order", "order_id": order_id })),
            )
                .into_response(),
            other => (
                StatusCode::CONFLICT,
                Json(json!({ "error": format!("cannot pay: {other:?}"), "order_id": order_id })),
            )
                .into_response(),
        },
    )
}

/// Fault injection (`--producer-retries`), around the idempotency layer: after a payment
/// committed (its response carries the event; a replay does not), sometimes enqueue the event
/// again. The answer is not affected.
async fn resend_after_commit(State(app): State<Shared>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    if let Some(event) = response.extensions().get::<PaymentSucceeded>()
        && app.producer_retries > 0.0
        && fastrand::f64() < app.producer_retries
        && let Err(e) = app.resend(event).await
    {
        tracing::warn!(order_id = event.order_id, error = %format!("{e:#}"), "injected re-send failed");
    }
    response
}

impl Payments {
    /// Fault injection (`--producer-retries`): enqueues `event` again under a new message id,
    /// in its own transaction after the payment's commit, as a producer that did not see its
    /// first attempt succeed would. The points inbox is keyed by the order id: it grants once.
    async fn resend(&self, event: &PaymentSucceeded) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await?;
        let message =
            Message::json(&self.topic, event)?.ordering_key(format!("user-{}", event.user_id));
        self.outbox.enqueue(&mut tx, message).await?;
        sqlx::query(COUNT_FAULT)
            .bind(PRODUCER_RESENDS)
            .bind(1_i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        tracing::debug!(
            order_id = event.order_id,
            "injected: PaymentSucceeded re-sent"
        );
        Ok(())
    }
}

/// `GET /orders/{id}`.
async fn get_order(
    State(app): State<Shared>,
    Path(order_id): Path<i64>,
) -> Result<Response, AppError> {
    let order: Option<Value> = sqlx::query_scalar(GET_ORDER)
        .bind(order_id)
        .fetch_optional(&app.pool)
        .await?;
    Ok(match order {
        Some(order) => (StatusCode::OK, Json(order)).into_response(),
        None => (StatusCode::NOT_FOUND, Json(error_body("no such order"))).into_response(),
    })
}

/// `GET /stats`: `{orders, paid, injected: {relay_duplicates, producer_resends}}` (the
/// faults injected by `--duplicate-rate` and `--producer-retries` in this database, across
/// restarts).
async fn stats(State(app): State<Shared>) -> Result<Json<Value>, AppError> {
    let (orders, paid): (i64, i64) = sqlx::query_as(STATS).fetch_one(&app.pool).await?;
    let (duplicates, resends): (i64, i64) = sqlx::query_as(FAULTS).fetch_one(&app.pool).await?;
    Ok(Json(json!({
        "orders": orders,
        "paid": paid,
        "injected": { RELAY_DUPLICATES: duplicates, PRODUCER_RESENDS: resends },
    })))
}
