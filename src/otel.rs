//! OpenTelemetry: a consumed message's span joins the trace of the span that produced it.
//!
//! pgbox carries W3C trace context in the [`traceparent`](crate::TRACEPARENT) message header
//! (see `outbox::trace`) and does not otherwise know about OpenTelemetry. With the
//! `opentelemetry` feature, and when the application's `tracing` subscriber has a
//! `tracing-opentelemetry` layer, the functions here turn that header into OpenTelemetry
//! parentage: the consumer's per-message span becomes a child of the producer's span, and a
//! relay round (one span for a whole batch) links to the span of every message it publishes.
//!
//! Without such a layer (or with the span filtered out) every function here does nothing,
//! and so does a message whose header is absent or malformed: tracing must never fail a
//! delivery.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::{Context, KeyValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use std::collections::BTreeMap;

use crate::traceparent::{TRACEPARENT, TRACESTATE};

/// Makes `span` a child of the span that produced a message, from its `traceparent` header.
///
/// Call it after creating the span and before entering it (or instrumenting a future with
/// it): `tracing-opentelemetry` starts the OpenTelemetry span on first entry, after which its
/// parent is fixed. Does nothing for an absent or malformed header, without an OpenTelemetry
/// layer, or for a disabled span.
pub(crate) fn join_producer_trace(span: &tracing::Span, headers: &BTreeMap<String, String>) {
    if span.is_disabled() {
        return;
    }
    let Some(producer) = remote_span_context(headers) else {
        return;
    };
    // An error means there is no OpenTelemetry layer or the span was already started:
    // either way there is nothing to join, and the delivery carries on.
    let _ = span.set_parent(Context::new().with_remote_span_context(producer));
}

/// Links `span` to the producer span of every message (id, headers) that carries a valid
/// `traceparent`, each link with the message's id (`messaging.message.id`).
///
/// For a span that covers a batch, such as the relay's round: a batch has many parents, so
/// OpenTelemetry models it with links rather than parentage. Links can be added while the
/// span is open, entered or not. The SDK keeps at most its span limit's worth of links (128
/// by default) and counts the rest as dropped.
pub(crate) fn link_producer_traces<'a>(
    span: &tracing::Span,
    messages: impl IntoIterator<Item = (uuid::Uuid, &'a BTreeMap<String, String>)>,
) {
    if span.is_disabled() {
        return;
    }
    for (id, headers) in messages {
        if let Some(producer) = remote_span_context(headers) {
            span.add_link_with_attributes(
                producer,
                vec![KeyValue::new("messaging.message.id", id.to_string())],
            );
        }
    }
}

/// The `traceparent` of the current `tracing` span's OpenTelemetry context: the header for a
/// message produced now whose consumer should be a child of the current span. `None` without
/// a current span, without an OpenTelemetry layer, or when the context is invalid.
///
/// Not called yet: meant for `outbox::trace::outgoing`, so that an enqueue inside an
/// OpenTelemetry span stamps that span's trace and span id rather than a fresh random trace.
#[allow(
    dead_code,
    reason = "called by outbox::trace once wired; remove this then"
)]
pub(crate) fn current_traceparent() -> Option<String> {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let current = context.span();
    let current = current.span_context();
    current.is_valid().then(|| {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            current.trace_id(),
            current.span_id(),
            current.trace_flags().to_u8()
        )
    })
}

/// The producer's span context from a message's headers, marked remote; `None` when the
/// `traceparent` is absent or malformed. A malformed `tracestate` is dropped, not the parent.
fn remote_span_context(headers: &BTreeMap<String, String>) -> Option<SpanContext> {
    let (trace_id, span_id, flags) = parse_traceparent(headers.get(TRACEPARENT)?)?;
    let state = headers
        .get(TRACESTATE)
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(trace_id, span_id, flags, true, state))
}

/// `(trace-id, parent-id, flags)` of a valid `traceparent` (see [`crate::traceparent::parse`]).
fn parse_traceparent(header: &str) -> Option<(TraceId, SpanId, TraceFlags)> {
    let parsed = crate::traceparent::parse(header)?;
    Some((
        TraceId::from_hex(parsed.trace_id).ok()?,
        SpanId::from_hex(parsed.parent_id).ok()?,
        TraceFlags::new(u8::from_str_radix(parsed.flags, 16).ok()?),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use tracing_subscriber::layer::SubscriberExt;
    use uuid::Uuid;

    const HEADER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn envelope(traceparent: Option<&str>) -> crate::Envelope {
        let mut envelope = crate::Envelope::new(Uuid::now_v7(), "topic", "payload");
        if let Some(t) = traceparent {
            envelope
                .headers
                .insert(TRACEPARENT.to_owned(), t.to_owned());
        }
        envelope
    }

    /// Runs `f` under a subscriber with an OpenTelemetry layer; returns the spans it ended.
    fn traced(f: impl FnOnce()) -> Vec<SpanData> {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("pgbox-test")));
        tracing::subscriber::with_default(subscriber, f);
        provider.force_flush().unwrap();
        exporter.get_finished_spans().unwrap()
    }

    fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no span {name} in {spans:?}"))
    }

    #[test]
    fn parses_a_valid_traceparent_into_a_remote_span_context() {
        let mut e = envelope(Some(HEADER));
        e.headers
            .insert(TRACESTATE.to_owned(), "congo=t61rcWkgMzE".to_owned());
        let cx = remote_span_context(&e.headers).unwrap();
        assert_eq!(
            cx.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(cx.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(cx.is_sampled());
        assert!(cx.is_remote());
        assert_eq!(cx.trace_state().get("congo"), Some("t61rcWkgMzE"));

        let unsampled = HEADER.replace("-01", "-00");
        assert!(
            !remote_span_context(&envelope(Some(&unsampled)).headers)
                .unwrap()
                .is_sampled()
        );
    }

    #[test]
    fn absent_or_malformed_traceparents_are_ignored() {
        assert!(remote_span_context(&envelope(None).headers).is_none());
        for bad in [
            "",
            "garbage",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(
                remote_span_context(&envelope(Some(bad)).headers).is_none(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_joined_span_exports_with_the_producer_as_its_parent() {
        let spans = traced(|| {
            let span = tracing::info_span!("pgbox.consumer.handle");
            join_producer_trace(&span, &envelope(Some(HEADER)).headers);
            span.in_scope(|| {
                tracing::info_span!("handler").in_scope(|| {});
            });
        });
        let handle = named(&spans, "pgbox.consumer.handle");
        assert_eq!(
            handle.span_context.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(
            handle.parent_span_id,
            SpanId::from_hex("00f067aa0ba902b7").unwrap()
        );
        assert!(handle.parent_span_is_remote);
        // Spans inside it are in the producer's trace too.
        let handler = named(&spans, "handler");
        assert_eq!(
            handler.span_context.trace_id(),
            handle.span_context.trace_id()
        );
        assert_eq!(handler.parent_span_id, handle.span_context.span_id());
    }

    #[test]
    fn a_span_is_left_alone_without_a_valid_header_or_once_started() {
        let spans = traced(|| {
            let span = tracing::info_span!("no header");
            join_producer_trace(&span, &envelope(None).headers);
            span.in_scope(|| {});
            let span = tracing::info_span!("bad header");
            join_producer_trace(&span, &envelope(Some("garbage")).headers);
            span.in_scope(|| {});
            let span = tracing::info_span!("started");
            span.in_scope(|| {});
            join_producer_trace(&span, &envelope(Some(HEADER)).headers);
        });
        let producer = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        for name in ["no header", "bad header", "started"] {
            let span = named(&spans, name);
            assert_ne!(span.span_context.trace_id(), producer, "{name}");
            assert_eq!(span.parent_span_id, SpanId::INVALID, "{name}");
        }
    }

    #[test]
    fn does_nothing_without_an_opentelemetry_layer() {
        let span = tracing::info_span!("untraced");
        join_producer_trace(&span, &envelope(Some(HEADER)).headers);
        let one = envelope(Some(HEADER));
        link_producer_traces(&span, [(one.id, &one.headers)]);
        span.in_scope(|| assert_eq!(current_traceparent(), None));
        let subscriber = tracing_subscriber::registry();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("no otel layer");
            join_producer_trace(&span, &envelope(Some(HEADER)).headers);
            span.in_scope(|| assert_eq!(current_traceparent(), None));
        });
    }

    #[test]
    fn a_batch_span_links_to_every_traced_message() {
        let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let batch = [
            envelope(Some(HEADER)),
            envelope(None),
            envelope(Some("garbage")),
            envelope(Some(other)),
        ];
        let spans = traced(|| {
            let span = tracing::debug_span!("pgbox.relay.round");
            span.in_scope(|| link_producer_traces(&span, batch.iter().map(|e| (e.id, &e.headers))));
        });
        let round = named(&spans, "pgbox.relay.round");
        let links: Vec<_> = round
            .links
            .iter()
            .map(|l| {
                let id = l
                    .attributes
                    .iter()
                    .find(|a| a.key.as_str() == "messaging.message.id")
                    .map(|a| a.value.to_string());
                (l.span_context.trace_id(), l.span_context.span_id(), id)
            })
            .collect();
        assert_eq!(
            links,
            [
                (
                    TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
                    SpanId::from_hex("00f067aa0ba902b7").unwrap(),
                    Some(batch[0].id.to_string()),
                ),
                (
                    TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
                    SpanId::from_hex("b7ad6b7169203331").unwrap(),
                    Some(batch[3].id.to_string()),
                ),
            ]
        );
        // The round itself is not re-parented: it belongs to no single message.
        assert_eq!(round.parent_span_id, SpanId::INVALID);
    }

    #[test]
    fn the_current_traceparent_names_the_current_span() {
        let mut header = None;
        let spans = traced(|| {
            tracing::info_span!("producer").in_scope(|| header = current_traceparent());
        });
        let producer = named(&spans, "producer");
        let header = header.unwrap();
        assert_eq!(
            header,
            format!(
                "00-{:032x}-{:016x}-01",
                producer.span_context.trace_id(),
                producer.span_context.span_id()
            )
        );
        // And what it writes, a consumer joins.
        let (trace_id, span_id, _) = parse_traceparent(&header).unwrap();
        assert_eq!(
            (trace_id, span_id),
            (
                producer.span_context.trace_id(),
                producer.span_context.span_id()
            )
        );
    }
}
