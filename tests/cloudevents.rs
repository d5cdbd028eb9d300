//! CloudEvents on the wire, proven against the CloudEvents Rust SDK on real brokers: what
//! pgbox's relay publishes (binary and structured) decodes with the SDK attribute by
//! attribute and byte for byte; what the SDK builds, written raw to the broker, is consumed
//! by pgbox's `Consumer` runner through the inbox (a second copy answers Duplicate); a
//! malformed event is dead-lettered and the runner goes on.
//!
//! RabbitMQ here; NATS and Kafka with `--all-features` (their modules at the end).

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cloudevents::event::{ExtensionValue, SpecVersion};
use cloudevents::message::{
    BinaryDeserializer, BinarySerializer, Encoding, MessageAttributeValue, MessageDeserializer,
    StructuredDeserializer, StructuredSerializer,
};
use cloudevents::{AttributesReader, Data, Event, EventBuilder, EventBuilderV10};
use pgbox::cloudevents::{CloudEvents, ContentMode};
use pgbox::transport::Publisher;
use pgbox::{CancellationToken, Consumer, Envelope, Inbox, Message, Outbox, Relay};
use support::TestDb;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// A raw broker message, as the SDK's bindings see one: headers by name (`prefix` marks the
/// attributes), the payload.
struct Raw {
    prefix: &'static str,
    headers: HashMap<String, String>,
    payload: Vec<u8>,
}

impl Raw {
    fn spec_header(&self) -> String {
        format!("{}specversion", self.prefix)
    }

    fn content_type(&self) -> Option<&String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v)
    }
}

impl BinaryDeserializer for Raw {
    fn deserialize_binary<R: Sized, V: BinarySerializer<R>>(
        mut self,
        mut visitor: V,
    ) -> cloudevents::message::Result<R> {
        let spec = self.headers.remove(&self.spec_header()).unwrap();
        let spec = SpecVersion::try_from(spec.as_str())?;
        let names = spec.attribute_names();
        visitor = visitor.set_spec_version(spec)?;
        if let Some(ct) = self.content_type().cloned() {
            visitor =
                visitor.set_attribute("datacontenttype", MessageAttributeValue::String(ct))?;
        }
        for (k, v) in self.headers {
            let Some(name) = k.strip_prefix(self.prefix) else {
                continue;
            };
            let value = MessageAttributeValue::String(v);
            visitor = if names.contains(&name) {
                visitor.set_attribute(name, value)?
            } else {
                visitor.set_extension(name, value)?
            };
        }
        visitor.end_with_data(self.payload)
    }
}

impl StructuredDeserializer for Raw {
    fn deserialize_structured<R: Sized, V: StructuredSerializer<R>>(
        self,
        visitor: V,
    ) -> cloudevents::message::Result<R> {
        visitor.set_structured_event(self.payload)
    }
}

impl MessageDeserializer for Raw {
    fn encoding(&self) -> Encoding {
        if self
            .content_type()
            .is_some_and(|c| c.starts_with("application/cloudevents+json"))
        {
            Encoding::STRUCTURED
        } else if self.headers.contains_key(&self.spec_header()) {
            Encoding::BINARY
        } else {
            Encoding::UNKNOWN
        }
    }
}

/// The raw message of an SDK event in binary mode: (attribute headers with `prefix`,
/// content type, data).
fn sdk_binary(event: &Event, prefix: &str) -> (Vec<(String, String)>, Option<String>, Vec<u8>) {
    let mut headers = Vec::new();
    let mut content_type = None;
    for (name, value) in event.iter() {
        if name == "datacontenttype" {
            content_type = Some(value.to_string());
        } else {
            headers.push((format!("{prefix}{name}"), value.to_string()));
        }
    }
    let data = match event.data() {
        Some(Data::Binary(b)) => b.clone(),
        Some(Data::String(s)) => s.clone().into_bytes(),
        Some(Data::Json(j)) => serde_json::to_vec(j).unwrap(),
        None => Vec::new(),
    };
    (headers, content_type, data)
}

/// Messages for the publish direction: a JSON one with every kind of header, a binary one,
/// both with an ordering key.
fn messages(topic: &str) -> Vec<Message> {
    vec![
        Message::json(topic, &serde_json::json!({"order": 42, "amount": "12.50"}))
            .unwrap()
            .ordering_key("order-42")
            .header("tenant", "acme")
            .header("x-Request", "r-1")
            .header("traceparent", TRACEPARENT),
        Message::bytes(topic, vec![0u8, 1, 2, 255, 128])
            .ordering_key("order-43")
            .header("tenant", "acme"),
    ]
}

/// The SDK's reading of what pgbox published, compared with the message it came from.
fn assert_same(
    event: &Event,
    m: &Message,
    source: &str,
    ordering_key: &str,
    raw_payload: &[u8],
    structured: bool,
) {
    assert_eq!(event.specversion(), SpecVersion::V10);
    assert_eq!(event.id(), m.id().to_string());
    assert_eq!(event.source().to_string(), source);
    assert_eq!(event.ty(), m.topic());
    assert_eq!(event.subject(), Some(ordering_key));
    assert_eq!(
        event.extension("partitionkey"),
        Some(&ExtensionValue::String(ordering_key.into()))
    );
    assert_eq!(
        event.extension("tenant"),
        Some(&ExtensionValue::String("acme".into()))
    );
    assert!(event.extension("x-Request").is_none());
    let time = event.time().expect("time").to_rfc3339();
    let time = OffsetDateTime::parse(&time, &Rfc3339).unwrap();
    assert!((OffsetDateTime::now_utc() - time).whole_seconds().abs() < 120);
    let (want_ct, want): (&str, Vec<u8>) = if m.topic().is_empty() {
        unreachable!()
    } else if event.extension("traceparent").is_some() {
        (
            "application/json",
            br#"{"amount":"12.50","order":42}"#.to_vec(),
        )
    } else {
        ("application/octet-stream", vec![0u8, 1, 2, 255, 128])
    };
    assert_eq!(event.datacontenttype(), Some(want_ct));
    let data = match event.data().expect("data") {
        Data::Binary(b) => b.clone(),
        Data::String(s) => s.clone().into_bytes(),
        Data::Json(j) => serde_json::to_vec(j).unwrap(),
    };
    if want_ct == "application/json" {
        assert_eq!(
            event.extension("traceparent"),
            Some(&ExtensionValue::String(TRACEPARENT.into()))
        );
        let parsed: serde_json::Value = serde_json::from_slice(&data).unwrap();
        assert_eq!(parsed, serde_json::json!({"order": 42, "amount": "12.50"}));
    } else {
        assert_eq!(data, want, "binary data, byte for byte");
    }
    if !structured {
        assert_eq!(
            raw_payload,
            &want[..],
            "the body is the payload, byte for byte"
        );
        assert_eq!(data, want);
    }
}

/// Enqueues `messages` and relays them through `publisher` (bounded rounds).
async fn enqueue_and_relay<P: Publisher + 'static>(
    db: &TestDb,
    publisher: P,
    messages: &[Message],
) {
    let outbox = Outbox::new();
    let mut tx = db.pool.begin().await.unwrap();
    for m in messages {
        outbox.enqueue(&mut tx, m.clone()).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::builder(db.pool.clone(), publisher).build().unwrap();
    let mut published = 0;
    for _ in 0..50 {
        let round = relay.relay_once().await.unwrap();
        published += round.published;
        if published == messages.len() {
            return;
        }
        if round.claimed == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    panic!("published {published} of {}", messages.len());
}

/// A running consumer: what its handler saw, how often its key closure ran per key (once
/// per delivery that reached the inbox, duplicates included), and how to stop it.
struct Running {
    seen: Arc<Mutex<Vec<Envelope>>>,
    keys: Arc<Mutex<BTreeMap<String, usize>>>,
    shutdown: CancellationToken,
    run: tokio::task::JoinHandle<pgbox::Result<pgbox::ConsumerStats>>,
}

/// Starts pgbox's consumer runner over `subscriber`, with the inbox key taken from the
/// CloudEvents attributes (`source|id`) and a handler that records an effect row.
async fn start_consumer<S: pgbox::transport::Subscriber + 'static>(
    db: &TestDb,
    subscriber: S,
    topic: &str,
) -> Running {
    sqlx::query("CREATE TABLE effects (id text PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let seen: Arc<Mutex<Vec<Envelope>>> = Arc::default();
    let keys: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let consumer = Consumer::builder(
        db.pool.clone(),
        subscriber,
        topic,
        Inbox::new("ce").unwrap(),
    )
    .poll_interval(Duration::from_millis(20))
    .key({
        let keys = keys.clone();
        move |e: &Envelope| {
            let key = format!(
                "{}|{}",
                e.cloudevent_attribute("source").unwrap_or("-"),
                e.cloudevent_attribute("id").unwrap_or("-")
            );
            *keys.lock().unwrap().entry(key.clone()).or_default() += 1;
            key
        }
    })
    .max_deliveries(2)
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let seen = seen.clone();
        let shutdown = shutdown.clone();
        async move {
            consumer
                .run(
                    async move |e: &Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
                        seen.lock().unwrap().push(e.clone());
                        sqlx::query("INSERT INTO effects VALUES ($1)")
                            .bind(e.id.to_string())
                            .execute(&mut *conn)
                            .await?;
                        Ok::<_, pgbox::Error>(())
                    },
                    shutdown,
                )
                .await
        }
    });
    Running {
        seen,
        keys,
        shutdown,
        run,
    }
}

impl Running {
    /// Deliveries that reached the inbox so far.
    fn deliveries(&self) -> usize {
        self.keys.lock().unwrap().values().sum()
    }

    async fn stop(self) -> (pgbox::ConsumerStats, Vec<Envelope>) {
        let stats = support::stop_runner(self.shutdown, self.run, Duration::from_secs(10)).await;
        let seen = self.seen.lock().unwrap().clone();
        (stats, seen)
    }
}

/// Checks what pgbox's consumer made of the SDK's events (see the callers): each handled
/// once, attributes reachable, the inbox holding one row per event.
async fn assert_sdk_events_consumed(
    db: &TestDb,
    running: Running,
    uuid: uuid::Uuid,
    dead: impl AsyncFn() -> usize,
) {
    let started = Instant::now();
    loop {
        let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if effects == 3 && running.deliveries() == 5 && dead().await == 1 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "effects {effects}, deliveries {}, dead letters {}",
            running.deliveries(),
            dead().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (stats, seen) = running.stop().await;
    assert_eq!(seen.len(), 3, "each event handled once: {seen:#?}");
    assert_eq!(stats.duplicates, 2, "{stats:?}");
    let first = seen
        .iter()
        .find(|e| e.cloudevent_attribute("id") == Some("inv-7-paid"))
        .unwrap();
    assert_eq!(
        first.id,
        pgbox::cloudevents::event_uuid("urn:billing:java-service", "inv-7-paid")
    );
    assert_eq!(first.ordering_key.as_deref(), Some("customer-9"));
    assert_eq!(first.cloudevent_attribute("subject"), Some("invoice-7"));
    assert_eq!(
        first.cloudevent_attribute("type"),
        Some("com.example.invoice.paid")
    );
    assert_eq!(first.cloudevent_attribute("tenant"), Some("acme"));
    assert_eq!(
        first.headers.get("tenant").map(String::as_str),
        Some("acme")
    );
    assert_eq!(first.content_type, "application/json");
    assert_eq!(
        first.json::<serde_json::Value>().unwrap(),
        serde_json::json!({"invoice": 7})
    );
    assert!(seen.iter().any(|e| e.id == uuid), "a UUID id is kept");
    let eighth = seen
        .iter()
        .find(|e| e.cloudevent_attribute("id") == Some("inv-8-paid"))
        .unwrap();
    assert_eq!(
        eighth.json::<serde_json::Value>().unwrap(),
        serde_json::json!({"invoice": 7})
    );
    let inbox_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = 'ce'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(inbox_rows, 3);
}

fn sdk_event(id: &str) -> Event {
    EventBuilderV10::new()
        .id(id)
        .source("urn:billing:java-service")
        .ty("com.example.invoice.paid")
        .subject("invoice-7")
        .extension("partitionkey", "customer-9")
        .extension("tenant", "acme")
        .data("application/json", serde_json::json!({"invoice": 7}))
        .build()
        .unwrap()
}

/// A structured event without a source: malformed.
const MALFORMED: &[u8] = br#"{"specversion":"1.0","id":"x","type":"t","data":{}}"#;

/// The HTTP binding, for webhooks: pgbox's `CloudEvents::http` decodes with the SDK's own
/// HTTP binding, what the SDK's HTTP binding writes decodes with `HttpEvent::decode`, and a
/// webhook retried by its sender is processed once through the inbox.
mod http_binding {
    use pgbox::Outcome;
    use pgbox::cloudevents::{HttpEvent, event_uuid};

    use super::*;

    fn envelope(m: &Message) -> Envelope {
        let mut e = Envelope::new(m.id(), m.topic(), Vec::new());
        e.created_at = OffsetDateTime::now_utc();
        e
    }

    /// The JSON message of `messages`, as the relay would hand it over.
    fn json_envelope() -> (Message, Envelope) {
        let m = messages("payment-succeeded").remove(0);
        let mut e = envelope(&m);
        e.payload =
            serde_json::to_vec(&serde_json::json!({"order": 42, "amount": "12.50"})).unwrap();
        e.content_type = "application/json".into();
        e.ordering_key = Some("order-42".into());
        e.headers.insert("tenant".into(), "acme".into());
        e.headers.insert("x-Request".into(), "r-1".into());
        e.headers.insert("traceparent".into(), TRACEPARENT.into());
        (m, e)
    }

    /// The request the SDK's HTTP binding writes for `event` (binary mode): headers, body.
    fn sdk_request(event: Event) -> (Vec<(String, String)>, Vec<u8>) {
        let request = http::Request::<Option<Vec<u8>>>::try_from(event).unwrap();
        let headers = request
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap().to_owned()))
            .collect();
        (headers, request.into_body().unwrap_or_default())
    }

    fn header_map(headers: &[(String, String)]) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (n, v) in headers {
            map.append(
                http::HeaderName::from_bytes(n.as_bytes()).expect("a header name HTTP sends"),
                http::HeaderValue::from_str(v).expect("a header value HTTP sends"),
            );
        }
        map
    }

    #[test]
    fn pgbox_http_events_decode_with_the_sdk() {
        let (m, e) = json_envelope();
        for mode in [ContentMode::Binary, ContentMode::Structured] {
            let ce = CloudEvents::new("/payments").unwrap().mode(mode);
            let http = ce.http(&e).unwrap();
            let map = header_map(&http.headers);
            let event = cloudevents::binding::http::to_event(&map, http.body.clone())
                .expect("the SDK's HTTP binding decodes it");
            assert_same(
                &event,
                &m,
                "/payments",
                "order-42",
                &http.body,
                mode == ContentMode::Structured,
            );
            if mode == ContentMode::Binary {
                assert_eq!(map.get("x-Request").unwrap(), "r-1", "a plain header stays");
            }
        }
    }

    #[test]
    fn sdk_http_events_decode_with_pgbox() {
        let sent = "2026-11-27T10:15:30.25Z";
        let event = EventBuilderV10::from(sdk_event("inv-7-paid"))
            .time(sent)
            .build()
            .unwrap();
        // Binary mode, as the SDK's HTTP binding writes a request.
        let (headers, body) = sdk_request(event.clone());
        assert!(headers.iter().any(|(n, _)| n == "ce-specversion"));
        let binary = HttpEvent::new(headers, body).decode("webhooks").unwrap();
        // Structured mode: the event as the SDK serializes it.
        let structured = HttpEvent::new(
            [(
                "Content-Type",
                "application/cloudevents+json; charset=utf-8",
            )],
            serde_json::to_vec(&event).unwrap(),
        )
        .decode("webhooks")
        .unwrap();
        for e in [&binary, &structured] {
            assert_eq!(e.id, event_uuid("urn:billing:java-service", "inv-7-paid"));
            assert_eq!(e.topic, "webhooks");
            assert_eq!(e.ordering_key.as_deref(), Some("customer-9"));
            assert_eq!(e.cloudevent_attribute("subject"), Some("invoice-7"));
            assert_eq!(
                e.cloudevent_attribute("type"),
                Some("com.example.invoice.paid")
            );
            assert_eq!(e.headers.get("tenant").map(String::as_str), Some("acme"));
            assert_eq!(e.content_type, "application/json");
            let data: serde_json::Value = e.json().unwrap();
            assert_eq!(data, serde_json::json!({"invoice": 7}));
            assert_eq!(e.created_at, OffsetDateTime::parse(sent, &Rfc3339).unwrap());
        }
    }

    #[test]
    fn requests_that_are_not_single_events_are_refused() {
        for (headers, body) in [
            (vec![("content-type", "application/json")], &b"{}"[..]),
            (
                vec![("content-type", "application/cloudevents-batch+json")],
                b"[]",
            ),
            (
                vec![
                    ("ce-specversion", "1.0"),
                    ("ce-id", "1"),
                    ("ce-source", "/s"),
                    ("ce-type", "t"),
                    ("CE-ID", "2"),
                ],
                b"",
            ),
            (
                vec![
                    ("ce-specversion", "1.0"),
                    ("ce-id", "%FF"),
                    ("ce-source", "/s"),
                    ("ce-type", "t"),
                ],
                b"",
            ),
            (
                vec![
                    ("ce-specversion", "1.0"),
                    ("ce-source", "/s"),
                    ("ce-type", "t"),
                ],
                b"",
            ),
        ] {
            let err = HttpEvent::new(headers.clone(), body.to_vec())
                .decode("webhooks")
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    pgbox::Error::InvalidField {
                        field: "cloudevent",
                        ..
                    }
                ),
                "{headers:?}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn a_retried_webhook_is_processed_once() {
        let db = TestDb::migrated().await;
        sqlx::query("CREATE TABLE invoices_paid (invoice int PRIMARY KEY)")
            .execute(&db.pool)
            .await
            .unwrap();
        let inbox = Inbox::new("billing-webhooks").unwrap();
        let event = sdk_event("inv-7-paid");
        let (headers, body) = sdk_request(event);
        let mut outcomes = Vec::new();
        // The sender retries: the same request three times.
        for _ in 0..3 {
            let e = HttpEvent::new(headers.clone(), body.clone())
                .decode("webhooks")
                .unwrap();
            let invoice = e.json::<serde_json::Value>().unwrap()["invoice"]
                .as_i64()
                .unwrap() as i32;
            let mut tx = db.pool.begin().await.unwrap();
            let outcome = inbox
                .process(&mut tx, e.id, async |conn| {
                    sqlx::query("INSERT INTO invoices_paid VALUES ($1)")
                        .bind(invoice)
                        .execute(&mut **conn)
                        .await?;
                    Ok::<_, pgbox::Error>(())
                })
                .await
                .unwrap();
            tx.commit().await.unwrap();
            outcomes.push(matches!(outcome, Outcome::Processed(())));
        }
        assert_eq!(outcomes, [true, false, false]);
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices_paid")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(n, 1);
    }
}

mod rabbitmq {
    use lapin::options::{BasicConsumeOptions, BasicPublishOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use pgbox::transport::rabbitmq::RabbitMq;
    use support::brokers;

    use super::*;

    fn transport(url: &str, prefix: &str) -> pgbox::transport::rabbitmq::RabbitMqBuilder {
        RabbitMq::builder(url)
            .exchange("pgbox-test")
            .queue_prefix(prefix)
            .queue_expires(Duration::from_secs(600))
            .receive_wait(Duration::from_millis(100))
    }

    async fn fresh() -> (String, String, String) {
        support::init_tracing();
        let url = brokers::rabbitmq_url().await;
        let prefix = format!("pgbox-ce-{}.", uuid::Uuid::now_v7().simple());
        let topic = format!("t-{}", uuid::Uuid::now_v7().simple());
        let admin = transport(&url, &prefix).build().unwrap();
        admin.declare_topic(&topic).await.unwrap();
        admin.close().await;
        (url, prefix, topic)
    }

    /// The next `n` raw messages of `queue` (bounded wait; a quorum queue with a single
    /// active consumer takes no basic.get, so through a consumer).
    async fn raw(url: &str, queue: &str, n: usize) -> Vec<Raw> {
        use futures_util::StreamExt;
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "ce-raw".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut out = Vec::new();
        while out.len() < n {
            let m = tokio::time::timeout(Duration::from_secs(10), consumer.next())
                .await
                .unwrap_or_else(|_| panic!("got {} of {n}", out.len()))
                .expect("consumer open")
                .unwrap();
            let mut headers = HashMap::new();
            for (k, v) in m.properties.headers().clone().unwrap_or_default().inner() {
                if let AMQPValue::LongString(s) = v {
                    headers.insert(
                        k.as_str().to_owned(),
                        String::from_utf8(s.as_bytes().to_vec()).unwrap(),
                    );
                }
            }
            if let Some(ct) = m.properties.content_type() {
                headers.insert("content-type".into(), ct.to_string());
            }
            out.push(Raw {
                prefix: "cloudEvents_",
                headers,
                payload: m.data.clone(),
            });
        }
        let _ = conn.close(200, "done".into()).await;
        out
    }

    async fn publish_decodes_with_the_sdk(mode: ContentMode) {
        let db = TestDb::migrated().await;
        let (url, prefix, topic) = fresh().await;
        let ce = CloudEvents::new("/payments").unwrap().mode(mode);
        let publisher = transport(&url, &prefix).cloudevents(ce).build().unwrap();
        let messages = messages(&topic);
        enqueue_and_relay(&db, publisher.clone(), &messages).await;
        publisher.close().await;
        let queue = transport(&url, &prefix).build().unwrap().queue_name(&topic);
        let raws = raw(&url, &queue, messages.len()).await;
        for (raw, (m, key)) in raws
            .into_iter()
            .zip(messages.iter().zip(["order-42", "order-43"]))
        {
            let structured = mode == ContentMode::Structured;
            assert_eq!(
                raw.encoding(),
                if structured {
                    Encoding::STRUCTURED
                } else {
                    Encoding::BINARY
                }
            );
            if !structured {
                // The header that is not an extension name travels as a plain header.
                if m.id() == messages[0].id() {
                    assert_eq!(
                        raw.headers.get("x-Request").map(String::as_str),
                        Some("r-1")
                    );
                }
                assert!(
                    raw.headers.contains_key("cloudEvents_id"),
                    "the binding's prefix"
                );
            }
            let payload = raw.payload.clone();
            let event = MessageDeserializer::into_event(raw).expect("the SDK decodes it");
            assert_same(&event, m, "/payments", key, &payload, structured);
        }
    }

    #[tokio::test]
    async fn binary_events_decode_with_the_sdk() {
        publish_decodes_with_the_sdk(ContentMode::Binary).await;
    }

    #[tokio::test]
    async fn structured_events_decode_with_the_sdk() {
        publish_decodes_with_the_sdk(ContentMode::Structured).await;
    }

    async fn publish_raw(url: &str, topic: &str, props: BasicProperties, body: &[u8]) {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        channel.confirm_select(Default::default()).await.unwrap();
        channel
            .basic_publish(
                "pgbox-test".into(),
                topic.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        let _ = conn.close(200, "done".into()).await;
    }

    fn binary_props(event: &Event, prefix: &str) -> (BasicProperties, Vec<u8>) {
        let (headers, ct, data) = sdk_binary(event, prefix);
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert(
                k.into(),
                AMQPValue::LongString(LongString::from(v.as_bytes())),
            );
        }
        let mut props = BasicProperties::default().with_headers(table);
        if let Some(ct) = ct {
            props = props.with_content_type(ct.into());
        }
        (props, data)
    }

    /// An SDK event written in binary mode (both AMQP prefixes) and in structured mode, each
    /// twice: pgbox's consumer handles each event once (the second copy is a duplicate in
    /// the inbox), sees its attributes, and a malformed event is dead-lettered while the
    /// runner goes on.
    #[tokio::test]
    async fn sdk_events_are_consumed_once_through_the_inbox() {
        let db = TestDb::migrated().await;
        let (url, prefix, topic) = fresh().await;
        let structured_props = BasicProperties::default()
            .with_content_type("application/cloudevents+json; charset=utf-8".into());
        // First a malformed event (no source): dead-lettered, and the runner goes on.
        publish_raw(&url, &topic, structured_props.clone(), MALFORMED).await;
        // Binary with the current prefix; a non-UUID id (UUIDv5 of source and id).
        let (props, data) = binary_props(&sdk_event("inv-7-paid"), "cloudEvents_");
        publish_raw(&url, &topic, props.clone(), &data).await;
        publish_raw(&url, &topic, props, &data).await;
        // Binary with the older ':' prefix; the id is a UUID, kept as is.
        let uuid = uuid::Uuid::now_v7();
        let (props, data) = binary_props(&sdk_event(&uuid.to_string()), "cloudEvents:");
        publish_raw(&url, &topic, props, &data).await;
        // Structured, twice.
        let structured = serde_json::to_vec(&sdk_event("inv-8-paid")).unwrap();
        publish_raw(&url, &topic, structured_props.clone(), &structured).await;
        publish_raw(&url, &topic, structured_props, &structured).await;

        let subscriber = transport(&url, &prefix).build().unwrap();
        let dead_reader = subscriber.clone();
        let running = start_consumer(&db, subscriber, &topic).await;
        assert_sdk_events_consumed(&db, running, uuid, async || {
            dead_reader.dead_letters(&topic, 10).await.unwrap().len()
        })
        .await;
        dead_reader.close().await;
    }
}

#[cfg(feature = "nats")]
mod nats {
    use async_nats::HeaderMap;
    use async_nats::jetstream;
    use futures_util::StreamExt;
    use pgbox::transport::nats::{Nats, NatsBuilder};
    use support::brokers;

    use super::*;

    fn transport(url: &str) -> NatsBuilder {
        Nats::builder(url)
            .stream("PGBOX_TEST")
            .subject_prefix("pgbox-test")
            .max_age(Duration::from_secs(3600))
            .inactive_threshold(Duration::from_secs(600))
            .receive_wait(Duration::from_millis(100))
    }

    async fn fresh() -> (String, String) {
        support::init_tracing();
        let url = brokers::nats_url().await;
        let topic = format!("t.{}", uuid::Uuid::now_v7().simple());
        transport(&url)
            .build()
            .unwrap()
            .declare_topic(&topic)
            .await
            .unwrap();
        (url, topic)
    }

    /// The first `n` raw messages of `subject` in the stream (an ephemeral consumer).
    async fn raw(url: &str, subject: &str, n: usize) -> Vec<Raw> {
        let js = jetstream::new(async_nats::connect(url).await.unwrap());
        let stream = js.get_stream("PGBOX_TEST").await.unwrap();
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: subject.to_owned(),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut messages = consumer.messages().await.unwrap();
        let mut out = Vec::new();
        while out.len() < n {
            let m = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .unwrap_or_else(|_| panic!("got {} of {n}", out.len()))
                .unwrap()
                .unwrap();
            let mut headers = HashMap::new();
            for (k, v) in m.headers.iter().flat_map(|h| h.iter()) {
                headers.insert(k.to_string(), v[0].as_str().to_owned());
            }
            out.push(Raw {
                prefix: "ce-",
                headers,
                payload: m.payload.to_vec(),
            });
            m.ack().await.unwrap();
        }
        out
    }

    async fn publish_decodes_with_the_sdk(mode: ContentMode) {
        let db = TestDb::migrated().await;
        let (url, topic) = fresh().await;
        let ce = CloudEvents::new("/payments").unwrap().mode(mode);
        let publisher = transport(&url).cloudevents(ce).build().unwrap();
        let messages = messages(&topic);
        enqueue_and_relay(&db, publisher.clone(), &messages).await;
        let raws = raw(&url, &publisher.subject(&topic), messages.len()).await;
        let structured = mode == ContentMode::Structured;
        for (raw, (m, key)) in raws
            .into_iter()
            .zip(messages.iter().zip(["order-42", "order-43"]))
        {
            assert_eq!(
                raw.encoding(),
                if structured {
                    Encoding::STRUCTURED
                } else {
                    Encoding::BINARY
                }
            );
            assert_eq!(
                raw.headers.get("Nats-Msg-Id"),
                Some(&m.id().to_string()),
                "JetStream dedup id"
            );
            if !structured {
                assert!(raw.headers.contains_key("ce-id"), "the binding's prefix");
            }
            let payload = raw.payload.clone();
            let event = MessageDeserializer::into_event(raw).expect("the SDK decodes it");
            assert_same(&event, m, "/payments", key, &payload, structured);
        }
    }

    #[tokio::test]
    async fn binary_events_decode_with_the_sdk() {
        publish_decodes_with_the_sdk(ContentMode::Binary).await;
    }

    #[tokio::test]
    async fn structured_events_decode_with_the_sdk() {
        publish_decodes_with_the_sdk(ContentMode::Structured).await;
    }

    async fn publish_raw(js: &jetstream::Context, subject: &str, headers: HeaderMap, body: &[u8]) {
        js.publish_with_headers(subject.to_owned(), headers, body.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// As on RabbitMQ: binary twice, binary with a UUID id, structured twice (as the NATS
    /// binding's structured mode sends it: no headers at all), after a malformed event. NATS
    /// terminates a message it cannot decode (it never comes back); the runner goes on.
    #[tokio::test]
    async fn sdk_events_are_consumed_once_through_the_inbox() {
        let db = TestDb::migrated().await;
        let (url, topic) = fresh().await;
        let subscriber = transport(&url).build().unwrap();
        let subject = subscriber.subject(&topic);
        let js = jetstream::new(async_nats::connect(&url).await.unwrap());
        let mut ct = HeaderMap::new();
        ct.insert("content-type", "application/cloudevents+json");
        publish_raw(&js, &subject, ct, MALFORMED).await;
        let binary = |event: &Event| {
            let (headers, ct, data) = sdk_binary(event, "ce-");
            let mut map = HeaderMap::new();
            for (k, v) in headers {
                map.insert(k.as_str(), v.as_str());
            }
            if let Some(ct) = ct {
                map.insert("content-type", ct.as_str());
            }
            (map, data)
        };
        let (h, d) = binary(&sdk_event("inv-7-paid"));
        publish_raw(&js, &subject, h.clone(), &d).await;
        publish_raw(&js, &subject, h, &d).await;
        let uuid = uuid::Uuid::now_v7();
        let (h, d) = binary(&sdk_event(&uuid.to_string()));
        publish_raw(&js, &subject, h, &d).await;
        let structured = serde_json::to_vec(&sdk_event("inv-8-paid")).unwrap();
        publish_raw(&js, &subject, HeaderMap::new(), &structured).await;
        publish_raw(&js, &subject, HeaderMap::new(), &structured).await;

        let running = start_consumer(&db, subscriber, &topic).await;
        assert_sdk_events_consumed(&db, running, uuid, async || 1).await;
    }
}

#[cfg(feature = "kafka")]
mod kafka {
    use pgbox::transport::kafka::{Kafka, KafkaBuilder};
    use rdkafka::ClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use support::brokers::kafka::PrivateKafka;

    use super::*;

    fn transport(bootstrap: &str) -> KafkaBuilder {
        Kafka::builder(bootstrap)
            .partitions(1)
            .session_timeout(Duration::from_secs(3))
            .receive_wait(Duration::from_millis(100))
            .set("batch.num.messages", "1")
    }

    async fn fresh() -> (PrivateKafka, String) {
        support::init_tracing();
        let broker = PrivateKafka::start().await;
        let topic = format!("t.{}", uuid::Uuid::now_v7().simple());
        transport(&broker.bootstrap())
            .build()
            .unwrap()
            .declare_topic(&topic)
            .await
            .unwrap();
        (broker, topic)
    }

    /// The first `n` raw records of `topic` (its one partition, from the start), with their
    /// keys.
    async fn raw(bootstrap: String, topic: String, n: usize) -> Vec<(Raw, Option<String>)> {
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("group.id", format!("ce-raw-{topic}"))
                .set("enable.auto.commit", "false")
                .set("auto.offset.reset", "earliest")
                .create()
                .unwrap();
            consumer.subscribe(&[&topic]).unwrap();
            let mut out = Vec::new();
            let started = Instant::now();
            while out.len() < n {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "got {} of {n}",
                    out.len()
                );
                let Some(m) = consumer.poll(Duration::from_millis(200)) else {
                    continue;
                };
                let m = m.unwrap();
                let mut headers = HashMap::new();
                if let Some(h) = m.headers() {
                    for h in h.iter() {
                        headers.insert(
                            h.key.to_owned(),
                            String::from_utf8(h.value.unwrap_or_default().to_vec()).unwrap(),
                        );
                    }
                }
                let key = m.key().map(|k| String::from_utf8(k.to_vec()).unwrap());
                out.push((
                    Raw {
                        prefix: "ce_",
                        headers,
                        payload: m.payload().unwrap_or_default().to_vec(),
                    },
                    key,
                ));
            }
            out
        })
        .await
        .unwrap()
    }

    async fn publish_decodes_with_the_sdk(mode: ContentMode) {
        let db = TestDb::migrated().await;
        let (broker, topic) = fresh().await;
        let ce = CloudEvents::new("/payments").unwrap().mode(mode);
        let publisher = transport(&broker.bootstrap())
            .cloudevents(ce)
            .build()
            .unwrap();
        let messages = messages(&topic);
        enqueue_and_relay(&db, publisher, &messages).await;
        let raws = raw(broker.bootstrap(), topic.clone(), messages.len()).await;
        let structured = mode == ContentMode::Structured;
        for ((raw, record_key), (m, key)) in raws
            .into_iter()
            .zip(messages.iter().zip(["order-42", "order-43"]))
        {
            assert_eq!(
                raw.encoding(),
                if structured {
                    Encoding::STRUCTURED
                } else {
                    Encoding::BINARY
                }
            );
            assert_eq!(
                record_key.as_deref(),
                Some(key),
                "the record key is partitionkey"
            );
            if !structured {
                assert!(raw.headers.contains_key("ce_id"), "the binding's prefix");
            }
            let payload = raw.payload.clone();
            let event = MessageDeserializer::into_event(raw).expect("the SDK decodes it");
            assert_same(&event, m, "/payments", key, &payload, structured);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn binary_events_decode_with_the_sdk() {
        publish_decodes_with_the_sdk(ContentMode::Binary).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn structured_events_decode_with_the_sdk() {
        publish_decodes_with_the_sdk(ContentMode::Structured).await;
    }

    /// As on RabbitMQ: a malformed event first (dead-lettered to the dead-letter topic),
    /// binary twice, binary with a UUID id, structured twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sdk_events_are_consumed_once_through_the_inbox() {
        let db = TestDb::migrated().await;
        let (broker, topic) = fresh().await;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", broker.bootstrap())
            .create()
            .unwrap();
        let send = async |headers: Vec<(String, String)>, key: Option<&str>, body: &[u8]| {
            let mut h = OwnedHeaders::new();
            for (k, v) in &headers {
                h = h.insert(Header {
                    key: k,
                    value: Some(v.as_str()),
                });
            }
            let mut record = FutureRecord::<str, [u8]>::to(&topic)
                .payload(body)
                .headers(h);
            if let Some(key) = key {
                record = record.key(key);
            }
            producer
                .send(record, Duration::from_secs(10))
                .await
                .unwrap();
        };
        let ct = |v: &str| vec![("content-type".to_owned(), v.to_owned())];
        send(
            ct("application/cloudevents+json"),
            Some("customer-9"),
            MALFORMED,
        )
        .await;
        let binary = |event: &Event| {
            let (mut headers, ct, data) = sdk_binary(event, "ce_");
            if let Some(ct) = ct {
                headers.push(("content-type".into(), ct));
            }
            (headers, data)
        };
        let (h, d) = binary(&sdk_event("inv-7-paid"));
        send(h.clone(), Some("customer-9"), &d).await;
        send(h, Some("customer-9"), &d).await;
        let uuid = uuid::Uuid::now_v7();
        let (h, d) = binary(&sdk_event(&uuid.to_string()));
        send(h, Some("customer-9"), &d).await;
        let structured = serde_json::to_vec(&sdk_event("inv-8-paid")).unwrap();
        send(
            ct("application/cloudevents+json"),
            Some("customer-9"),
            &structured,
        )
        .await;
        send(
            ct("application/cloudevents+json"),
            Some("customer-9"),
            &structured,
        )
        .await;

        let subscriber = transport(&broker.bootstrap()).build().unwrap();
        let dead_reader = transport(&broker.bootstrap()).build().unwrap();
        let running = start_consumer(&db, subscriber, &topic).await;
        assert_sdk_events_consumed(&db, running, uuid, async || {
            dead_reader
                .dead_letters(&topic, 10)
                .await
                .map_or(0, |d| d.len())
        })
        .await;
    }
}
