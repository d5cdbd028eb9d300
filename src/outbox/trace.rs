//! W3C trace context (`traceparent`) carried in message headers.
//!
//! Without OpenTelemetry (feature `opentelemetry` off, or no `tracing-opentelemetry` layer
//! installed), pgbox propagates the context it can see: while the
//! [`Consumer`](crate::Consumer) runs a handler for a message that carried a `traceparent`,
//! messages enqueued by that handler continue the same trace (same trace id, a new parent
//! id), so a chain of services shares one trace id. Outside a handler, when a `tracing` span
//! is active, enqueue starts a new trace. With an OpenTelemetry layer, enqueue stamps the
//! current span's own ids, so the consumer's span hangs under the producer's. An explicit
//! `traceparent` header always wins.

use std::future::Future;

pub use crate::traceparent::TRACEPARENT;

tokio::task_local! {
    static INCOMING: Option<String>;
}

/// Runs `f` with `traceparent` as the incoming trace context.
pub(crate) async fn with_incoming<F: Future>(traceparent: Option<String>, f: F) -> F::Output {
    INCOMING.scope(traceparent, f).await
}

/// The `traceparent` for a message enqueued now, if there is a context to propagate.
pub(crate) fn outgoing() -> Option<String> {
    let incoming = INCOMING.try_with(|t| t.clone()).ok().flatten();
    let incoming = incoming
        .as_deref()
        .and_then(crate::traceparent::parse)
        .map(|t| (t.trace_id, t.flags));
    // With an OpenTelemetry layer installed, the current span is a real, exported parent:
    // stamp its ids, unless it belongs to another trace than the message being handled.
    #[cfg(feature = "opentelemetry")]
    if let Some(current) = crate::otel::current_traceparent()
        && incoming.is_none_or(|(trace_id, _)| current[3..35] == *trace_id)
    {
        return Some(current);
    }
    if let Some((trace_id, flags)) = incoming {
        return Some(format!("00-{trace_id}-{:016x}-{flags}", nonzero_u64()));
    }
    if tracing::Span::current().is_disabled() {
        return None;
    }
    let trace_id = u128::from(nonzero_u64()) << 64 | u128::from(fastrand::u64(..));
    Some(format!("00-{trace_id:032x}-{:016x}-01", nonzero_u64()))
}

fn nonzero_u64() -> u64 {
    fastrand::u64(1..)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn continues_an_incoming_trace_with_a_new_parent_id() {
        let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned();
        let out = with_incoming(Some(incoming.clone()), async { outgoing() })
            .await
            .unwrap();
        assert!(out.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(out.ends_with("-01"));
        assert_ne!(out, incoming);
        assert!(crate::traceparent::parse(&out).is_some());
    }

    #[tokio::test]
    async fn nothing_without_context_and_malformed_headers_are_ignored() {
        assert_eq!(outgoing(), None);
        for bad in [
            "garbage",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        ] {
            assert!(crate::traceparent::parse(bad).is_none(), "{bad}");
            assert_eq!(
                with_incoming(Some(bad.into()), async { outgoing() }).await,
                None
            );
        }
    }
}
