//! Attacks on CloudEvents on the wire (`pgbox::cloudevents`, the brokers' `cloudevents(..)`
//! option and every subscriber's receive path), measured against guide/src/cloudevents.md,
//! the rustdoc, the CloudEvents 1.0 spec and its bindings, with the CloudEvents Rust SDK as
//! the oracle where it has an opinion.
//!
//! The promise, written down before reading the code:
//! 1. publishing: binary mode carries the payload byte for byte; structured mode carries the
//!    payload as `data` (JSON content types) or `data_base64`; the SDK decodes both;
//! 2. "Nothing else changes": the relay, the order per key and the re-publish are those of
//!    the transport; a message the transport cannot take is refused (dead-lettered), the
//!    relay goes on; "nothing panics";
//! 3. receiving: an event's envelope id is its `id` when that is a UUID, else a UUIDv5 of
//!    `source` and `id` ("CloudEvents makes the pair unique"): distinct (source, id) pairs are
//!    distinct messages, a redelivery is the same one;
//! 4. a valid event is read; a malformed one is refused and dead-lettered, the runner goes on;
//! 5. `CloudEvents::http` returns "the headers to send" per the HTTP binding.
//!
//! RabbitMQ here; NATS with `--all-features`.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cloudevents::{AttributesReader, Data, Event};
use pgbox::cloudevents::{CloudEvents, ContentMode};
use pgbox::{Envelope, Message, Outbox, Relay};
use support::TestDb;
use time::OffsetDateTime;

/// An envelope like the relay hands a publisher.
fn envelope(topic: &str, payload: &[u8], content_type: &str) -> Envelope {
    let mut e = Envelope::new(uuid::Uuid::now_v7(), topic, payload.to_vec());
    e.content_type = content_type.into();
    e
}

/// Structured mode re-encodes JSON data through `serde_json::Value`: an integer past u64
/// becomes an f64, so the SDK (and every consumer) reads a different number than the one the
/// producer enqueued. The doc's promise is that the payload is the `data` member.
#[test]
fn finding_structured_mode_rewrites_large_json_numbers() {
    let ce = CloudEvents::new("/payments")
        .unwrap()
        .mode(ContentMode::Structured);
    let payload = br#"{"amount":123456789012345678901234567890,"order":42}"#;
    let e = envelope("orders", payload, "application/json");
    let json = ce.to_json(&e).unwrap();
    let text = String::from_utf8(json.clone()).unwrap();
    assert!(
        text.contains("123456789012345678901234567890"),
        "the amount was rewritten on the wire: {text}"
    );
    // The SDK still reads it as JSON data (the Rust SDK itself holds data in a
    // `serde_json::Value`, so it cannot be the judge of the digits; the wire is).
    let event: Event = serde_json::from_slice(&json).expect("the SDK decodes it");
    let Some(Data::Json(data)) = event.data() else {
        panic!("JSON data: {:?}", event.data())
    };
    assert_eq!(data["order"], 42);
    // Whitespace and key order of the producer's text are kept too.
    let spaced = b"{ \"z\": 1,\n  \"a\": [1.50, 2] }";
    let json = ce
        .to_json(&envelope("orders", spaced, "application/json"))
        .unwrap();
    assert!(
        json.windows(spaced.len()).any(|w| w == spaced),
        "{}",
        String::from_utf8_lossy(&json)
    );
}

/// Small, ordinary JSON survives structured mode (the SDK reads the same value).
#[test]
fn holds_structured_mode_keeps_ordinary_json() {
    let ce = CloudEvents::new("/payments")
        .unwrap()
        .mode(ContentMode::Structured);
    for (ct, payload) in [
        (
            "application/json",
            &br#"{"a":[1,2.5,"\u00e9",null,true]}"#[..],
        ),
        ("application/json; charset=utf-8", br#""text""#),
        ("application/vnd.x+json", br#"[]"#),
        ("text/json", br#"{"n":-0.5e-3}"#),
    ] {
        let e = envelope("orders", payload, ct);
        let json = ce.to_json(&e).unwrap();
        let event: Event = serde_json::from_slice(&json).expect("the SDK decodes it");
        let want: serde_json::Value = serde_json::from_slice(payload).unwrap();
        match event.data() {
            Some(Data::Json(j)) => assert_eq!(j, &want, "{ct}"),
            other => panic!("{ct}: {other:?}"),
        }
        assert_eq!(event.datacontenttype(), Some(ct));
    }
}

/// The HTTP binding (1.0.2, 3.1.3.2) percent-encodes a space in header values: HTTP trims a
/// value's leading and trailing whitespace, so an unencoded ` order 42 ` arrives as
/// `order 42`. And every header `http()` returns must be one HTTP can carry: the outbox
/// accepts header names like `größe`, which no HTTP client can send.
#[test]
fn finding_http_mapping_leaves_spaces_unencoded() {
    let ce = CloudEvents::new("/payments").unwrap();
    let mut e = envelope("orders", b"{}", "application/json");
    e.ordering_key = Some(" order 42 ".into());
    let http = ce.http(&e).unwrap();
    let subject = &http
        .headers
        .iter()
        .find(|(n, _)| n == "ce-subject")
        .unwrap()
        .1;
    assert!(
        !subject.starts_with(' ') && !subject.ends_with(' '),
        "an HTTP stack trims it: {subject:?}"
    );
}

#[test]
fn finding_http_mapping_returns_header_names_http_cannot_send() {
    // What the outbox accepts (Message validation: no controls, whitespace or ':').
    let m = Message::json("orders", &serde_json::json!({}))
        .unwrap()
        .header("größe", "L");
    let _ = m;
    let ce = CloudEvents::new("/payments").unwrap();
    let mut e = envelope("orders", b"{}", "application/json");
    e.headers.insert("größe".into(), "L".into());
    match ce.http(&e) {
        Err(_) => {} // refused: fine
        Ok(http) => {
            for (name, value) in &http.headers {
                assert!(
                    axum::http::HeaderName::from_bytes(name.as_bytes()).is_ok(),
                    "not an HTTP header name: {name:?}"
                );
                assert!(
                    axum::http::HeaderValue::from_str(value).is_ok(),
                    "not an HTTP header value: {value:?}"
                );
            }
        }
    }
}

/// Control characters and non-ASCII in attribute values are percent-encoded in the HTTP
/// mapping, so no header injection through `ce-` headers.
#[test]
fn holds_http_mapping_encodes_controls_in_attributes() {
    let ce = CloudEvents::new("/payments").unwrap();
    let mut e = envelope("orders", b"{}", "application/json");
    e.ordering_key = Some("a\r\nX-Injected: 1\u{e9}%\"".into());
    let http = ce.http(&e).unwrap();
    for (name, value) in http.headers.iter().filter(|(n, _)| n.starts_with("ce-")) {
        assert!(
            axum::http::HeaderValue::from_str(value).is_ok(),
            "{name}: {value:?}"
        );
        assert!(!value.contains('\n') && !value.contains('\r'), "{value:?}");
    }
    let subject = &http
        .headers
        .iter()
        .find(|(n, _)| n == "ce-subject")
        .unwrap()
        .1;
    assert!(subject.starts_with("a%0D%0AX-Injected:"), "{subject}");
    assert!(subject.ends_with("%C3%A9%25%22"), "{subject}");
}

/// Distinct (source, id) pairs must give distinct envelope ids (the default inbox key).
#[test]
fn holds_event_uuid_separates_ordinary_pairs() {
    let mut seen = BTreeMap::new();
    for source in ["/a", "/a/", "/ab", "urn:x", "/é", "/a%00"] {
        for id in ["1", "b", "", "%", "ü", "1/"] {
            let u = pgbox::cloudevents::event_uuid(source, id);
            if let Some(prev) = seen.insert(u, (source, id)) {
                panic!("{prev:?} and {:?} share {u}", (source, id));
            }
        }
    }
}

mod rabbitmq {
    use lapin::options::BasicPublishOptions;
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use pgbox::transport::Subscriber;
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
        let prefix = format!("pgbox-atkce-{}.", uuid::Uuid::now_v7().simple());
        let topic = format!("t-{}", uuid::Uuid::now_v7().simple());
        let admin = transport(&url, &prefix).build().unwrap();
        admin.declare_topic(&topic).await.unwrap();
        admin.close().await;
        (url, prefix, topic)
    }

    async fn publish_raw(url: &str, topic: &str, messages: &[(BasicProperties, Vec<u8>)]) {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        channel.confirm_select(Default::default()).await.unwrap();
        for (props, body) in messages {
            channel
                .basic_publish(
                    "pgbox-test".into(),
                    topic.into(),
                    BasicPublishOptions::default(),
                    body,
                    props.clone(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
        let _ = conn.close(200, "done".into()).await;
    }

    fn structured(doc: &serde_json::Value) -> (BasicProperties, Vec<u8>) {
        (
            BasicProperties::default().with_content_type("application/cloudevents+json".into()),
            serde_json::to_vec(doc).unwrap(),
        )
    }

    /// Receives until `n` envelopes or `limit`; acks each. Also returns the dead letters.
    async fn receive(
        sub: &RabbitMq,
        topic: &str,
        n: usize,
        dead: usize,
        limit: Duration,
    ) -> (Vec<Envelope>, usize) {
        let started = Instant::now();
        let mut out = Vec::new();
        loop {
            for d in sub
                .receive(topic, 10, Duration::from_secs(30))
                .await
                .unwrap()
            {
                out.push(sub.envelope(&d).clone());
                sub.ack(&d).await.unwrap();
            }
            let dl = sub.dead_letters(topic, 10).await.unwrap().len();
            if (out.len() >= n && dl >= dead) || started.elapsed() > limit {
                return (out, dl);
            }
        }
    }

    /// Two events that differ in (source, id) but whose `source` and `id` hold a NUL (the
    /// UUIDv5 name is `source NUL id`): one envelope id, so the inbox takes the second as a
    /// duplicate of the first and its effect is lost. CloudEvents forbids control characters
    /// in String attributes: such events should be refused, not merged.
    #[tokio::test]
    async fn finding_nul_in_source_or_id_merges_two_events() {
        let (url, prefix, topic) = fresh().await;
        let a = serde_json::json!({"specversion":"1.0","source":"/a\u{0}b","id":"c","type":"t","data":{"n":1}});
        let b = serde_json::json!({"specversion":"1.0","source":"/a","id":"b\u{0}c","type":"t","data":{"n":2}});
        publish_raw(&url, &topic, &[structured(&a), structured(&b)]).await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, dead) = receive(&sub, &topic, 2, 0, Duration::from_secs(3)).await;
        sub.close().await;
        let ids: Vec<_> = got.iter().map(|e| e.id).collect();
        assert!(
            !(ids.len() == 2 && ids[0] == ids[1]),
            "two distinct events share the envelope id {} (dead letters {dead})",
            ids[0]
        );
    }

    /// A 32-hex-digit id (an MD5 digest, a content hash: common event ids) parses as a UUID
    /// in its "simple" form, so it is taken as the envelope id whatever the source: two
    /// sources' events with the same digest are one message to the inbox.
    #[tokio::test]
    async fn finding_hex_digest_ids_of_two_sources_share_an_envelope_id() {
        let (url, prefix, topic) = fresh().await;
        let id = "9e107d9d372bb6826bd81d3542a419d6";
        let a = serde_json::json!({"specversion":"1.0","source":"/billing","id":id,"type":"t","data":{"n":1}});
        let b = serde_json::json!({"specversion":"1.0","source":"/shipping","id":id,"type":"t","data":{"n":2}});
        publish_raw(&url, &topic, &[structured(&a), structured(&b)]).await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, _) = receive(&sub, &topic, 2, 0, Duration::from_secs(5)).await;
        sub.close().await;
        assert_eq!(got.len(), 2);
        assert_ne!(
            got[0].id, got[1].id,
            "(/billing, {id}) and (/shipping, {id}) are one envelope"
        );
    }

    /// A UUID id in canonical form stays the envelope id (the documented rule), and the
    /// same event twice has one id.
    #[tokio::test]
    async fn holds_canonical_uuid_ids_are_kept_and_redeliveries_agree() {
        let (url, prefix, topic) = fresh().await;
        let u = uuid::Uuid::now_v7();
        let a =
            serde_json::json!({"specversion":"1.0","source":"/s","id":u.to_string(),"type":"t"});
        let b = serde_json::json!({"specversion":"1.0","source":"/s","id":"x-1","type":"t"});
        publish_raw(
            &url,
            &topic,
            &[structured(&a), structured(&b), structured(&b)],
        )
        .await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, _) = receive(&sub, &topic, 3, 0, Duration::from_secs(5)).await;
        sub.close().await;
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].id, u);
        assert_eq!(got[1].id, got[2].id);
        assert_eq!(got[1].id, pgbox::cloudevents::event_uuid("/s", "x-1"));
    }

    /// The AMQP binding maps the Timestamp type to the protocol's timestamp; RabbitMQ's
    /// field tables have one (seconds since the epoch). An event whose `cloudEvents_time` is
    /// such a timestamp is valid, yet pgbox reads it as the text "1700000000", fails RFC 3339
    /// and dead-letters the event.
    #[tokio::test]
    async fn finding_amqp_timestamp_time_dead_letters_a_valid_event() {
        let (url, prefix, topic) = fresh().await;
        let mut table = FieldTable::default();
        for (k, v) in [
            ("cloudEvents_specversion", "1.0"),
            ("cloudEvents_id", "ts-1"),
            ("cloudEvents_source", "/amqp"),
            ("cloudEvents_type", "t"),
        ] {
            table.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
        }
        table.insert(
            "cloudEvents_time".into(),
            AMQPValue::Timestamp(1_700_000_000),
        );
        let props = BasicProperties::default()
            .with_headers(table)
            .with_content_type("application/json".into());
        publish_raw(&url, &topic, &[(props, br#"{"n":1}"#.to_vec())]).await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, dead) = receive(&sub, &topic, 1, 0, Duration::from_secs(3)).await;
        sub.close().await;
        assert_eq!(got.len(), 1, "the valid event was dead-lettered ({dead})");
        assert_eq!(
            got[0].created_at,
            OffsetDateTime::from_unix_timestamp(1_700_000_000).unwrap()
        );
    }

    /// Times the SDK (chrono, RFC 3339) accepts: offsets, fractions of every length, a
    /// lowercase `t`/`z`. pgbox must not dead-letter a valid event for its time.
    #[tokio::test]
    async fn holds_rfc3339_times_the_sdk_accepts_are_read() {
        let (url, prefix, topic) = fresh().await;
        let times = [
            "2026-11-27T10:00:00+05:30",
            "2026-11-27T10:00:00.1Z",
            "2026-11-27T10:00:00.123456789Z",
            "2026-11-27T10:00:00-00:00",
            "2026-11-27t10:00:00z",
        ];
        let mut msgs = Vec::new();
        for (i, t) in times.iter().enumerate() {
            let doc = serde_json::json!({"specversion":"1.0","source":"/t","id":format!("t-{i}"),"type":"t","time":t});
            // The oracle: the SDK takes it.
            serde_json::from_value::<Event>(doc.clone())
                .unwrap_or_else(|e| panic!("the SDK refuses {t}: {e}"));
            msgs.push(structured(&doc));
        }
        publish_raw(&url, &topic, &msgs).await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, dead) = receive(&sub, &topic, times.len(), 0, Duration::from_secs(5)).await;
        sub.close().await;
        assert_eq!(got.len(), times.len(), "dead letters {dead}");
    }

    /// A native pgbox message whose headers are those of a received CloudEvent (a handler
    /// forwarding what it got: `ce-specversion`, `ce-id`, ...) stays a native message, and a
    /// native JSON payload with a `specversion` member is not read as an event.
    #[tokio::test]
    async fn holds_native_messages_that_look_like_events_stay_native() {
        let db = TestDb::migrated().await;
        let (url, prefix, topic) = fresh().await;
        let m = Message::json(
            &topic,
            &serde_json::json!({"specversion":"1.0","id":"x","source":"/y","type":"z"}),
        )
        .unwrap()
        .header("ce-specversion", "1.0")
        .header("ce-id", "x")
        .header("ce-source", "/y");
        let outbox = Outbox::new();
        let mut tx = db.pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, m.clone()).await.unwrap();
        tx.commit().await.unwrap();
        let publisher = transport(&url, &prefix).build().unwrap();
        let relay = Relay::builder(db.pool.clone(), publisher.clone())
            .build()
            .unwrap();
        assert_eq!(relay.relay_once().await.unwrap().published, 1);
        publisher.close().await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, _) = receive(&sub, &topic, 1, 0, Duration::from_secs(5)).await;
        sub.close().await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].id, m.id());
        assert_eq!(got[0].cloudevent_attribute("id"), Some("x"));
        assert_eq!(got[0].content_type, "application/json");
    }

    /// A native pgbox message (its message id a UUID, pgbox's `x-pgbox-created-at`) with a
    /// header the outbox accepts, `cloudEvents_specversion`, is taken for a binary event,
    /// refused ("no id") and dead-lettered: a good native message lost to the dead letters.
    #[tokio::test]
    async fn finding_native_message_with_an_amqp_binding_header_is_dead_lettered() {
        let db = TestDb::migrated().await;
        let (url, prefix, topic) = fresh().await;
        let m = Message::json(&topic, &serde_json::json!({"n":1}))
            .unwrap()
            .header("cloudEvents_specversion", "1.0");
        let outbox = Outbox::new();
        let mut tx = db.pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, m.clone()).await.unwrap();
        tx.commit().await.unwrap();
        let publisher = transport(&url, &prefix).build().unwrap();
        let relay = Relay::builder(db.pool.clone(), publisher.clone())
            .build()
            .unwrap();
        assert_eq!(relay.relay_once().await.unwrap().published, 1);
        publisher.close().await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, dead) = receive(&sub, &topic, 1, 0, Duration::from_secs(3)).await;
        sub.close().await;
        assert_eq!(
            got.len(),
            1,
            "the native message was dead-lettered ({dead})"
        );
        assert_eq!(got[0].id, m.id());
    }

    /// Structured events read by pgbox and by the SDK: the same data bytes (the SDK's JSON
    /// data serialized, its text data as is, its binary data as is).
    #[tokio::test]
    async fn finding_structured_data_differs_from_the_sdk() {
        let (url, prefix, topic) = fresh().await;
        let docs = [
            // No datacontenttype: JSON (spec, JSON format 3.1); a JSON string.
            serde_json::json!({"specversion":"1.0","source":"/d","id":"d-0","type":"t","data":"hello"}),
            serde_json::json!({"specversion":"1.0","source":"/d","id":"d-1","type":"t","data":{"a":1}}),
            serde_json::json!({"specversion":"1.0","source":"/d","id":"d-2","type":"t","datacontenttype":"text/plain","data":"hello"}),
            serde_json::json!({"specversion":"1.0","source":"/d","id":"d-3","type":"t","datacontenttype":"application/json","data":"hello"}),
            serde_json::json!({"specversion":"1.0","source":"/d","id":"d-4","type":"t","datacontenttype":"application/json","data_base64":"eyJhIjoxfQ=="}),
        ];
        let mut want = BTreeMap::new();
        for doc in &docs {
            let event: Event = serde_json::from_value(doc.clone()).unwrap();
            let bytes = match event.data() {
                Some(Data::Json(j)) => serde_json::to_vec(j).unwrap(),
                Some(Data::String(s)) => s.clone().into_bytes(),
                Some(Data::Binary(b)) => b.clone(),
                None => Vec::new(),
            };
            want.insert(event.id().to_owned(), bytes);
        }
        let msgs: Vec<_> = docs.iter().map(structured).collect();
        publish_raw(&url, &topic, &msgs).await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, dead) = receive(&sub, &topic, docs.len(), 0, Duration::from_secs(5)).await;
        sub.close().await;
        assert_eq!(got.len(), docs.len(), "dead letters {dead}");
        let mut differ = Vec::new();
        for e in &got {
            let id = e.cloudevent_attribute("id").unwrap();
            if want[id] != e.payload {
                differ.push(format!(
                    "{id}: SDK {:?}, pgbox {:?} ({})",
                    String::from_utf8_lossy(&want[id]),
                    String::from_utf8_lossy(&e.payload),
                    e.content_type
                ));
            }
        }
        assert!(differ.is_empty(), "{differ:#?}");
    }

    /// A structured event received: its JSON `data` is the handler's payload. Re-encoded
    /// through `serde_json::Value`, an amount past 64 bits arrives as another number
    /// (`1.2345678901234568e+29`), whoever produced the event (pgbox's own structured mode
    /// included, see the Kafka round trip).
    #[tokio::test]
    async fn finding_received_structured_data_rewrites_large_json_numbers() {
        let (url, prefix, topic) = fresh().await;
        let body = br#"{"specversion":"1.0","source":"/n","id":"n-1","type":"t","data":{"amount":123456789012345678901234567890}}"#;
        let props =
            BasicProperties::default().with_content_type("application/cloudevents+json".into());
        publish_raw(&url, &topic, &[(props, body.to_vec())]).await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, dead) = receive(&sub, &topic, 1, 0, Duration::from_secs(3)).await;
        sub.close().await;
        assert_eq!(got.len(), 1, "dead letters {dead}");
        assert_eq!(
            String::from_utf8_lossy(&got[0].payload),
            r#"{"amount":123456789012345678901234567890}"#
        );
        assert_eq!(got[0].content_type, "application/json");
    }

    /// Garbage `traceparent` and odd extensions on a received event: read, no panic.
    #[tokio::test]
    async fn holds_garbage_traceparent_is_carried_not_fatal() {
        let (url, prefix, topic) = fresh().await;
        let doc = serde_json::json!({"specversion":"1.0","source":"/t","id":"g","type":"t",
            "traceparent":"zz-not-a-trace\u{e9}","abcdefghijklmnopqrstuvwxyz":"long name","n":1});
        publish_raw(&url, &topic, &[structured(&doc)]).await;
        let sub = transport(&url, &prefix).build().unwrap();
        let (got, _) = receive(&sub, &topic, 1, 0, Duration::from_secs(5)).await;
        sub.close().await;
        assert_eq!(got.len(), 1);
        assert_eq!(
            got[0].headers.get("traceparent").map(String::as_str),
            Some("zz-not-a-trace\u{e9}")
        );
    }
}

#[cfg(feature = "nats")]
mod nats {
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

    /// Enqueues `m` (the outbox accepts it) and runs one relay round over a NATS publisher in
    /// CloudEvents `mode` in a task of its own: whether that task panicked, and the round.
    async fn relay_one(
        m: Message,
        mode: ContentMode,
    ) -> std::result::Result<pgbox::Result<pgbox::RoundReport>, tokio::task::JoinError> {
        let db = TestDb::migrated().await;
        let (url, _topic) = fresh().await;
        let outbox = Outbox::new();
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, m)
            .await
            .expect("the outbox accepts it");
        tx.commit().await.unwrap();
        let ce = CloudEvents::new("/payments").unwrap().mode(mode);
        let publisher = transport(&url).cloudevents(ce).build().unwrap();
        let relay = Relay::builder(db.pool.clone(), publisher).build().unwrap();
        tokio::spawn(async move { relay.relay_once().await }).await
    }

    /// An ordering key with a newline: the outbox takes it, the native NATS form carries it
    /// (in `Pgbox-Meta`), but CloudEvents binary mode puts it raw into the `ce-subject` and
    /// `ce-partitionkey` headers and async-nats asserts on a CR/LF in a header value: the
    /// relay panics, and panics again on the same row after every restart.
    #[tokio::test]
    async fn finding_nats_relay_panics_on_an_ordering_key_with_a_newline() {
        let (_, topic) = fresh().await;
        let m = Message::json(&topic, &serde_json::json!({"n":1}))
            .unwrap()
            .ordering_key("order\n42");
        let round = relay_one(m, ContentMode::Binary).await;
        let round = round.expect("the relay round must not panic");
        round.expect("the relay goes on (the message refused, not the round)");
    }

    /// A header name with a non-ASCII letter: the outbox takes it, the native NATS form
    /// carries it, CloudEvents mode (either) makes it a NATS header name and async-nats
    /// asserts: the relay panics.
    #[tokio::test]
    async fn finding_nats_relay_panics_on_a_non_ascii_header_name() {
        let (_, topic) = fresh().await;
        let m = Message::json(&topic, &serde_json::json!({"n":1}))
            .unwrap()
            .header("größe", "L");
        let round = relay_one(m, ContentMode::Structured).await;
        let round = round.expect("the relay round must not panic");
        round.expect("the relay goes on (the message refused, not the round)");
    }

    /// The same message relayed natively is fine (the baseline of the two findings).
    #[tokio::test]
    async fn holds_native_nats_carries_what_ce_mode_panics_on() {
        let db = TestDb::migrated().await;
        let (url, topic) = fresh().await;
        let m = Message::json(&topic, &serde_json::json!({"n":1}))
            .unwrap()
            .ordering_key("order\n42")
            .header("größe", "L");
        let outbox = Outbox::new();
        let mut tx = db.pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, m).await.unwrap();
        tx.commit().await.unwrap();
        let publisher = transport(&url).build().unwrap();
        let relay = Relay::builder(db.pool.clone(), publisher).build().unwrap();
        assert_eq!(relay.relay_once().await.unwrap().published, 1);
    }
}

#[cfg(feature = "kafka")]
mod kafka {
    use pgbox::transport::Subscriber;
    use pgbox::transport::kafka::{Kafka, KafkaBuilder};
    use support::brokers::kafka::PrivateKafka;

    use super::*;

    fn transport(bootstrap: &str) -> KafkaBuilder {
        Kafka::builder(bootstrap)
            .partitions(1)
            .session_timeout(Duration::from_secs(3))
            .receive_wait(Duration::from_millis(100))
            .set("batch.num.messages", "1")
    }

    /// pgbox → CloudEvents (binary and structured) → pgbox over Kafka with what made the NATS
    /// relay panic (a newline in the ordering key, a non-ASCII header name) and a JSON
    /// payload with a number past 64 bits: the id, the ordering key, the headers and the
    /// payload come back (Kafka headers are bytes).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn finding_kafka_round_trip_loses_large_json_numbers_in_structured_mode() {
        support::init_tracing();
        let broker = PrivateKafka::start().await;
        let db = TestDb::migrated().await;
        let mut sent = Vec::new();
        for mode in [ContentMode::Binary, ContentMode::Structured] {
            let topic = format!("t.{}", uuid::Uuid::now_v7().simple());
            transport(&broker.bootstrap())
                .build()
                .unwrap()
                .declare_topic(&topic)
                .await
                .unwrap();
            let payload = br#"{"amount":123456789012345678901234567890}"#;
            let m = Message::bytes(&topic, payload.to_vec())
                .content_type("application/json")
                .ordering_key("order\n42")
                .header("größe", "L")
                .header("tenant", "acme");
            let outbox = Outbox::new();
            let mut tx = db.pool.begin().await.unwrap();
            outbox.enqueue(&mut tx, m.clone()).await.unwrap();
            tx.commit().await.unwrap();
            let publisher = transport(&broker.bootstrap())
                .cloudevents(CloudEvents::new("/payments").unwrap().mode(mode))
                .build()
                .unwrap();
            let relay = Relay::builder(db.pool.clone(), publisher).build().unwrap();
            assert_eq!(relay.relay_once().await.unwrap().published, 1, "{mode:?}");
            sent.push((mode, topic, m));
        }
        let sub = transport(&broker.bootstrap())
            .group("atk-ce")
            .build()
            .unwrap();
        for (mode, topic, m) in sent {
            let started = Instant::now();
            let e = loop {
                assert!(started.elapsed() < Duration::from_secs(30), "{mode:?}");
                let got = sub
                    .receive(&topic, 10, Duration::from_secs(30))
                    .await
                    .unwrap();
                if let Some(d) = got.first() {
                    let e = sub.envelope(d).clone();
                    sub.ack(d).await.unwrap();
                    break e;
                }
            };
            assert_eq!(e.id, m.id(), "{mode:?}");
            assert_eq!(e.ordering_key.as_deref(), Some("order\n42"), "{mode:?}");
            assert_eq!(e.headers.get("tenant").map(String::as_str), Some("acme"));
            assert_eq!(e.headers.get("größe").map(String::as_str), Some("L"));
            assert_eq!(
                e.payload, br#"{"amount":123456789012345678901234567890}"#,
                "{mode:?}"
            );
        }
    }
}
