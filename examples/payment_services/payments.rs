//! The payments service: orders over HTTP, paid exactly once per `Idempotency-Key`, with
//! `PaymentSucceeded` written to the outbox in the paying transaction and relayed.
//!
//! A request with an `Idempotency-Key` runs inside `Inbox::process` keyed by it: the inbox
//! row, the order's transition and the outbox message commit together, and the response
//! (status and body) is the stored outcome, so every retry of the key is answered with what
//! the first attempt answered. A concurrent retry waits on the key (`Wait::Block`, the
//! default) until the first transaction ends. The stored outcome also carries a fingerprint
//! of the request: the same key sent with another request is refused with 422.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pgbox::transport::{PgQueue, PublishError, Publisher};
use pgbox::{
    CancellationToken, Envelope, HandlerConnection, Inbox, Message, Migrator, Outbox, Outcome,
    Relay, StateMachine, StateTable, Transition,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::service::{self, AppError, ServiceArgs, TransportKind, error_body};

/// The business schema and pgbox's, owned by this service.
pub const SCHEMA: &str = "payments";
pub const PGBOX_SCHEMA: &str = "payments_pgbox";
/// The built-in queue's schema (transport `postgres`).
pub const BROKER_SCHEMA: &str = "broker";
/// Inbox consumers: one key space per kind of request.
const PAY_REQUESTS: &str = "pay-requests";
const ORDER_REQUESTS: &str = "order-requests";

const SETUP: &str = "
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('payments-service-setup'));
CREATE SCHEMA IF NOT EXISTS payments;
CREATE TABLE IF NOT EXISTS payments.orders (
    id bigserial PRIMARY KEY,
    user_id bigint NOT NULL,
    amount bigint NOT NULL CHECK (amount > 0),
    status text NOT NULL DEFAULT 'created',
    payment_id uuid,
    created_at timestamptz NOT NULL DEFAULT now(),
    paid_at timestamptz
);
-- What the fault flags injected (--duplicate-rate, --producer-retries), across restarts.
CREATE TABLE IF NOT EXISTS payments.injected_faults (
    kind text PRIMARY KEY,
    count bigint NOT NULL
);
COMMIT;
";

const INSERT_ORDER: &str = "INSERT INTO payments.orders (user_id, amount) VALUES ($1, $2) \
     RETURNING to_jsonb(orders.*)";
const MARK_PAID: &str = "UPDATE payments.orders SET payment_id = gen_random_uuid(), paid_at = now() \
     WHERE id = $1 RETURNING to_jsonb(orders.*)";
const GET_ORDER: &str = "SELECT to_jsonb(o.*) FROM payments.orders o WHERE id = $1";
const STATS: &str = "SELECT count(*), count(*) FILTER (WHERE status = 'paid') FROM payments.orders";
const COUNT_FAULT: &str = "INSERT INTO payments.injected_faults AS f (kind, count) VALUES ($1, $2) \
     ON CONFLICT (kind) DO UPDATE SET count = f.count + EXCLUDED.count";
const FAULTS: &str = "SELECT \
     coalesce((SELECT count FROM payments.injected_faults WHERE kind = 'relay_duplicates'), 0), \
     coalesce((SELECT count FROM payments.injected_faults WHERE kind = 'producer_resends'), 0)";
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

/// What an idempotent request answered, stored with its inbox row.
#[derive(Debug, Serialize, Deserialize)]
struct StoredResponse {
    /// Which request produced it: a retry must be the same request.
    fingerprint: String,
    status: u16,
    body: Value,
}

/// A handler's result: the response to store and, for a payment, the event to enqueue in the
/// same transaction. Only the response is stored.
struct Handled {
    response: StoredResponse,
    event: Option<PaymentSucceeded>,
}

impl Serialize for Handled {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.response.serialize(s)
    }
}

struct Payments {
    pool: PgPool,
    orders: StateTable<OrderState>,
    outbox: Outbox,
    pay_requests: Inbox,
    order_requests: Inbox,
    topic: String,
    /// `--producer-retries`: the share of payments whose event is enqueued a second time.
    producer_retries: f64,
}

type Shared = Arc<Payments>;

pub async fn run(args: ServiceArgs) -> anyhow::Result<()> {
    let addr = args
        .listen
        .unwrap_or_else(|| "127.0.0.1:8081".parse().expect("address"));
    args.check_fault_rates()?;
    let metrics = service::install_metrics()?;
    let pool = args.connect().await?;
    sqlx::raw_sql(SETUP).execute(&pool).await?;
    Migrator::new().schema(PGBOX_SCHEMA)?.run(&pool).await?;
    if args.transport == TransportKind::Postgres {
        Migrator::new().schema(BROKER_SCHEMA)?.run(&pool).await?;
    }
    let state: Shared = Arc::new(Payments {
        pool: pool.clone(),
        orders: StateTable::new("orders")?.schema(SCHEMA)?,
        outbox: Outbox::with_schema(PGBOX_SCHEMA)?,
        pay_requests: Inbox::builder(PAY_REQUESTS).schema(PGBOX_SCHEMA).build()?,
        order_requests: Inbox::builder(ORDER_REQUESTS)
            .schema(PGBOX_SCHEMA)
            .build()?,
        topic: args.topic.clone(),
        producer_retries: args.producer_retries,
    });

    let shutdown = CancellationToken::new();
    service::cancel_on_signal(shutdown.clone());
    let mut gauge_schemas = vec![PGBOX_SCHEMA];
    let relay = match args.transport {
        TransportKind::Postgres => {
            gauge_schemas.push(BROKER_SCHEMA);
            spawn_relay(
                &pool,
                PgQueue::with_schema(pool.clone(), BROKER_SCHEMA)?,
                &args,
                &shutdown,
            )?
        }
        TransportKind::Rabbitmq => {
            let rabbit = args.rabbitmq()?;
            // Its queue exists before the first publish (unroutable messages are retried).
            rabbit.declare_topic(&args.topic).await?;
            spawn_relay(&pool, rabbit, &args, &shutdown)?
        }
        TransportKind::Nats => {
            let nats = args.nats()?;
            nats.declare_topic(&args.topic).await?;
            spawn_relay(&pool, nats, &args, &shutdown)?
        }
    };
    let gauges = service::spawn_gauges(pool.clone(), gauge_schemas, shutdown.clone());

    let app = Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .route("/orders/{id}/pay", post(pay_order))
        .route("/stats", get(stats))
        .with_state(state)
        .merge(service::ops_routes(pool.clone(), metrics));
    tracing::info!(
        transport = args.transport.name(),
        topic = %args.topic,
        duplicate_rate = args.duplicate_rate,
        producer_retries = args.producer_retries,
        "payments service starting"
    );
    let served = service::serve(addr, app, shutdown.clone()).await;
    // The listener is closed and requests in flight are answered: stop the relay (it
    // finishes its round) and the gauges.
    shutdown.cancel();
    let relayed = relay.await;
    gauges.await.ok();
    pool.close().await;
    served?;
    relayed??;
    tracing::info!("payments service stopped");
    Ok(())
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
    let relay = Relay::builder(pool.clone(), publisher)
        .schema(PGBOX_SCHEMA)
        .build()?;
    let shutdown = shutdown.clone();
    Ok(tokio::spawn(async move { relay.run(shutdown).await }))
}

/// Fault injection (`--duplicate-rate`): publishes a share of the relayed messages a second
/// time, same message id, as a broker redelivering would. The points inbox absorbs them.
struct DuplicatingPublisher<P> {
    inner: P,
    rate: f64,
    /// Where the duplicates are counted (`payments.injected_faults`).
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

/// The Idempotency-Key header: `Ok(None)` when absent, `Err` (the reason for a 400) when
/// unusable.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, &'static str> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(key) if !key.is_empty() && key.len() <= 255 => Ok(Some(key.to_owned())),
        _ => Err("Idempotency-Key must be 1 to 255 visible ASCII characters"),
    }
}

fn bad_request(message: &str) -> Response {
    (StatusCode::BAD_REQUEST, Json(error_body(message))).into_response()
}

/// `POST /orders {user_id, amount}`: 201 with the order. With an `Idempotency-Key`, a retry
/// gets the same order instead of creating another one.
async fn create_order(
    State(app): State<Shared>,
    headers: HeaderMap,
    Json(new): Json<NewOrder>,
) -> Result<Response, AppError> {
    if new.amount <= 0 {
        return Ok((
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(error_body("amount must be positive")),
        )
            .into_response());
    }
    let key = match idempotency_key(&headers) {
        Ok(key) => key,
        Err(reason) => return Ok(bad_request(reason)),
    };
    let create = async |conn: &mut HandlerConnection<'_>| {
        let order: Value = sqlx::query_scalar(INSERT_ORDER)
            .bind(new.user_id)
            .bind(new.amount)
            .fetch_one(&mut *conn)
            .await?;
        Ok::<_, anyhow::Error>(order)
    };
    let Some(key) = key else {
        // Not idempotent: each request creates an order.
        let mut tx = app.pool.begin().await?;
        let order: Value = sqlx::query_scalar(INSERT_ORDER)
            .bind(new.user_id)
            .bind(new.amount)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        return Ok((StatusCode::CREATED, Json(order)).into_response());
    };
    let fingerprint = format!("POST /orders user_id={} amount={}", new.user_id, new.amount);
    app.idempotent(
        &app.order_requests,
        &key,
        fingerprint.clone(),
        async |conn| {
            let order = create(conn).await?;
            Ok(Handled {
                response: StoredResponse {
                    fingerprint,
                    status: StatusCode::CREATED.as_u16(),
                    body: order,
                },
                event: None,
            })
        },
    )
    .await
}

/// `POST /orders/{id}/pay` with `Idempotency-Key` (required): 200 with the paid order; 409
/// when the order is paid already (by another key); 404 when there is no such order.
async fn pay_order(
    State(app): State<Shared>,
    Path(order_id): Path<i64>,
    headers: HeaderMap,
) -> Result<Response, AppError> {
    let key = match idempotency_key(&headers) {
        Ok(Some(key)) => key,
        Ok(None) => return Ok(bad_request("the Idempotency-Key header is required")),
        Err(reason) => return Ok(bad_request(reason)),
    };
    let fingerprint = format!("POST /orders/{order_id}/pay");
    let orders = &app.orders;
    app.idempotent(&app.pay_requests, &key, fingerprint.clone(), async |conn| {
        let respond = |status: StatusCode, body: Value| StoredResponse {
            fingerprint: fingerprint.clone(),
            status: status.as_u16(),
            body,
        };
        // Locks the order row: a concurrent payment of it with another key waits here and
        // then finds it paid.
        let response = match orders.transition(conn, order_id, OrderState::Paid).await? {
            Transition::Applied { .. } => {
                let order: Value = sqlx::query_scalar(MARK_PAID)
                    .bind(order_id)
                    .fetch_one(&mut *conn)
                    .await?;
                let event = PaymentSucceeded {
                    order_id,
                    user_id: order["user_id"].as_i64().unwrap_or_default(),
                    amount: order["amount"].as_i64().unwrap_or_default(),
                };
                tracing::info!(order_id, user_id = event.user_id, key = %key, "order paid");
                return Ok(Handled {
                    response: respond(StatusCode::OK, order),
                    event: Some(event),
                });
            }
            Transition::AlreadyInState | Transition::Stale { .. } => respond(
                StatusCode::CONFLICT,
                json!({ "error": "order already paid", "order_id": order_id }),
            ),
            Transition::NotFound => respond(
                StatusCode::NOT_FOUND,
                json!({ "error": "no such order", "order_id": order_id }),
            ),
            other => respond(
                StatusCode::CONFLICT,
                json!({ "error": format!("cannot pay: {other:?}"), "order_id": order_id }),
            ),
        };
        Ok(Handled {
            response,
            event: None,
        })
    })
    .await
}

impl Payments {
    /// Runs `handler` once per `key` (in `inbox`'s key space), in one transaction with the
    /// inbox row and the handler's event; answers retries from the stored response.
    async fn idempotent<F>(
        &self,
        inbox: &Inbox,
        key: &str,
        fingerprint: String,
        handler: F,
    ) -> Result<Response, AppError>
    where
        F: AsyncFnOnce(&mut HandlerConnection<'_>) -> anyhow::Result<Handled>,
    {
        let mut tx = self.pool.begin().await?;
        match inbox.process(&mut tx, key, handler).await? {
            Outcome::Processed(handled) => {
                if let Some(event) = &handled.event {
                    let message = Message::json(&self.topic, event)?
                        .ordering_key(format!("user-{}", event.user_id));
                    self.outbox.enqueue(&mut tx, message).await?;
                }
                tx.commit().await?;
                if let Some(event) = &handled.event
                    && self.producer_retries > 0.0
                    && fastrand::f64() < self.producer_retries
                {
                    // An injected fault: the answer is not affected.
                    if let Err(e) = self.resend(event).await {
                        tracing::warn!(order_id = event.order_id, error = %format!("{e:#}"), "injected re-send failed");
                    }
                }
                Ok(reply(&handled.response, false))
            }
            Outcome::Duplicate(duplicate) => {
                tx.rollback().await?;
                let stored: StoredResponse = duplicate
                    .outcome()?
                    .ok_or_else(|| anyhow::anyhow!("key {key:?} has no stored response"))?;
                if stored.fingerprint != fingerprint {
                    tracing::info!(key, stored = %stored.fingerprint, request = %fingerprint, "idempotency key reused for another request");
                    return Ok((
                        StatusCode::UNPROCESSABLE_ENTITY,
                        Json(json!({
                            "error": "Idempotency-Key already used for a different request",
                            "original_request": stored.fingerprint,
                        })),
                    )
                        .into_response());
                }
                Ok(reply(&stored, true))
            }
            Outcome::Rejected(reason) => {
                Ok((StatusCode::UNPROCESSABLE_ENTITY, Json(error_body(reason))).into_response())
            }
            // Only with a bounded wait, which this inbox does not use.
            Outcome::InProgress => Ok((
                StatusCode::CONFLICT,
                Json(error_body("a request with this key is in progress; retry")),
            )
                .into_response()),
        }
    }
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

fn reply(stored: &StoredResponse, replayed: bool) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, Json(stored.body.clone())).into_response();
    if replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", "true".parse().expect("header value"));
    }
    response
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
