//! OpenTelemetry through `tracing-opentelemetry`: a message's consumer span is a child of the
//! span that produced it, across outbox → relay → Postgres queue → consumer → inbox.
//!
//! Each test installs its subscriber with `set_default` on a current-thread runtime and runs
//! the relay and the consumer on the test's own task, so every span it exports is its own
//! and the binary's other tests cannot interfere.
#![cfg(feature = "opentelemetry")]

mod support;

use std::time::{Duration, Instant};

use opentelemetry::trace::{SpanId, TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, Envelope, Error, HandlerConnection, Inbox, Lease, Message, Outbox,
    Relay, TRACEPARENT,
};
use sqlx::PgPool;
use support::TestDb;
use tracing::Instrument;
use tracing::subscriber::DefaultGuard;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// An OpenTelemetry pipeline exporting to memory, the default subscriber of this thread
/// while it lives.
struct Traced {
    provider: SdkTracerProvider,
    exporter: InMemorySpanExporter,
    _guard: DefaultGuard,
}

impl Traced {
    fn install() -> Traced {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("pgbox-test")));
        let guard = tracing::subscriber::set_default(subscriber);
        Traced {
            provider,
            exporter,
            _guard: guard,
        }
    }

    /// Every span ended so far.
    fn spans(&self) -> Vec<SpanData> {
        self.provider.force_flush().unwrap();
        self.exporter.get_finished_spans().unwrap()
    }
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    let mut found = spans.iter().filter(|s| s.name == name);
    let span = found
        .next()
        .unwrap_or_else(|| panic!("no span {name:?} among {:?}", names(spans)));
    assert!(found.next().is_none(), "more than one span {name:?}");
    span
}

fn names(spans: &[SpanData]) -> Vec<&str> {
    spans.iter().map(|s| s.name.as_ref()).collect()
}

/// The `traceparent` of the current span, as an application instrumented with OpenTelemetry
/// sets it on the messages it produces.
fn current_traceparent() -> String {
    let context = tracing::Span::current().context();
    let span = context.span();
    let span = span.span_context();
    assert!(
        span.is_valid(),
        "the producer span has an OpenTelemetry context"
    );
    format!(
        "00-{:032x}-{:016x}-{:02x}",
        span.trace_id(),
        span.span_id(),
        span.trace_flags().to_u8()
    )
}

/// Enqueues one message on `topic` inside a `checkout` span whose context it carries.
async fn produce(db: &TestDb, topic: &str) {
    async {
        let mut tx = db.pool.begin().await.unwrap();
        Outbox::new()
            .enqueue(
                &mut tx,
                Message::bytes(topic, "order-42").header(TRACEPARENT, current_traceparent()),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    .instrument(tracing::info_span!("checkout"))
    .await;
}

/// Waits (on this task) until the queue is empty, then cancels `shutdown`.
async fn stop_when_drained(pool: &PgPool, shutdown: &CancellationToken) {
    let start = Instant::now();
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
            .fetch_one(pool)
            .await
            .unwrap();
        if left == 0 || start.elapsed() > Duration::from_secs(20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
}

fn consumer(db: &TestDb, topic: &str) -> Consumer<PgQueue> {
    Consumer::builder(
        db.pool.clone(),
        PgQueue::new(db.pool.clone()),
        topic,
        Inbox::new("points").unwrap(),
    )
    .concurrency(1)
    .poll_interval(Duration::from_millis(20))
    .build()
    .unwrap()
}

async fn relay(db: &TestDb) {
    let report = Relay::builder(db.pool.clone(), PgQueue::new(db.pool.clone()))
        .build()
        .unwrap()
        .relay_once()
        .await
        .unwrap();
    assert_eq!(report.published, 1);
}

/// checkout → pgbox.consumer.handle → pgbox.inbox.* → `handler`, all in the producer's
/// trace, and the outbox's enqueue span under checkout.
fn assert_one_tree(spans: &[SpanData], handler: &str) {
    let checkout = named(spans, "checkout");
    let trace_id = checkout.span_context.trace_id();
    let enqueue = named(spans, "pgbox.outbox.enqueue");
    assert_eq!(enqueue.span_context.trace_id(), trace_id);
    assert_eq!(enqueue.parent_span_id, checkout.span_context.span_id());

    let handle = named(spans, "pgbox.consumer.handle");
    assert_eq!(
        (handle.span_context.trace_id(), handle.parent_span_id),
        (trace_id, checkout.span_context.span_id()),
        "the consumer's span did not join the producer's trace as a child of the producer \
         span: is otel::join_producer_trace called in the consumer runner?"
    );
    assert!(handle.parent_span_is_remote);

    let inbox = spans
        .iter()
        .find(|s| {
            s.name.starts_with("pgbox.inbox.") && s.parent_span_id == handle.span_context.span_id()
        })
        .unwrap_or_else(|| panic!("no inbox span under the consumer's: {:?}", names(spans)));
    assert_eq!(inbox.span_context.trace_id(), trace_id);
    let handler = named(spans, handler);
    assert_eq!(handler.span_context.trace_id(), trace_id);
    assert_ne!(handler.parent_span_id, SpanId::INVALID);
    assert!(
        spans
            .iter()
            .any(|s| s.span_context.span_id() == handler.parent_span_id
                && s.span_context.trace_id() == trace_id),
        "the handler's span hangs from a span of the producer's trace"
    );
}

#[tokio::test]
async fn a_consumed_message_continues_the_producers_trace_under_the_producer_span() {
    let db = TestDb::migrated().await;
    let traced = Traced::install();
    produce(&db, "orders").await;
    relay(&db).await;

    let consumer = consumer(&db, "orders");
    let shutdown = CancellationToken::new();
    let (stats, ()) = tokio::join!(
        consumer.run(
            async |_e: &Envelope, conn: &mut HandlerConnection<'_>| {
                sqlx::query("SELECT 1")
                    .execute(&mut *conn)
                    .instrument(tracing::info_span!("grant points"))
                    .await
                    .map_err(Error::from)?;
                Ok::<(), Error>(())
            },
            shutdown.clone(),
        ),
        stop_when_drained(&db.pool, &shutdown),
    );
    assert_eq!(stats.unwrap().processed, 1);

    assert_one_tree(&traced.spans(), "grant points");
}

#[tokio::test]
async fn a_leased_message_continues_the_producers_trace_under_the_producer_span() {
    let db = TestDb::migrated().await;
    let traced = Traced::install();
    produce(&db, "emails").await;
    relay(&db).await;

    let consumer = consumer(&db, "emails");
    let shutdown = CancellationToken::new();
    let (stats, ()) = tokio::join!(
        consumer.run_leased(
            async |_e: &Envelope, _lease: &mut Lease| {
                async {}.instrument(tracing::info_span!("send email")).await;
                Ok::<(), Error>(())
            },
            Duration::from_secs(30),
            shutdown.clone(),
        ),
        stop_when_drained(&db.pool, &shutdown),
    );
    assert_eq!(stats.unwrap().processed, 1);

    assert_one_tree(&traced.spans(), "send email");
}

#[tokio::test]
async fn a_relay_round_links_to_the_producer_span_of_each_message_it_publishes() {
    let db = TestDb::migrated().await;
    let traced = Traced::install();
    produce(&db, "orders").await;
    relay(&db).await;

    let spans = traced.spans();
    let checkout = named(&spans, "checkout");
    let rounds: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == "pgbox.relay.round")
        .collect();
    let linked: Vec<_> = rounds
        .iter()
        .flat_map(|r| r.links.iter())
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    assert_eq!(
        linked,
        [(
            checkout.span_context.trace_id(),
            checkout.span_context.span_id()
        )],
        "the relay round that published the message links to its producer span: is \
         otel::link_producer_traces called in Relay::relay_once?"
    );
}
