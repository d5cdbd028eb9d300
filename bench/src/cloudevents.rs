//! CE1: what CloudEvents cost on the publish path, per message, relative to pgbox's native
//! envelope. No broker: the wire mapping alone (what a publisher does per message before the
//! bytes go out), so the difference is the encoding and nothing else. The arms are
//! interleaved (each round runs every arm once, in turn) and the medians of the rounds are
//! reported.
//!
//! - native: what the native RabbitMQ mapping does per message (headers copied, the creation
//!   time formatted, the id as text);
//! - binary: `CloudEvents::http` in binary mode (every attribute mapped, prefixed headers);
//! - structured: `CloudEvents::to_json` (the whole event as one JSON document).

use std::hint::black_box;
use std::time::Instant;

use pgbox::Envelope;
use pgbox::cloudevents::{CloudEvents, ContentMode};
use time::format_description::well_known::Rfc3339;

const ROUNDS: usize = 31;
const PER_ROUND: usize = 20_000;

fn envelopes() -> Vec<(&'static str, Envelope)> {
    let mut json = Envelope::new(
        uuid::Uuid::now_v7(),
        "payment-succeeded",
        br#"{"order":"order-42","user":7,"amount":"12.50","currency":"EUR","items":[{"sku":"A-1","qty":2},{"sku":"B-7","qty":1}]}"#.to_vec(),
    );
    json.content_type = "application/json".into();
    json.ordering_key = Some("order-42".into());
    json.headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    json.headers.insert("tenant".into(), "acme".into());
    let mut binary = Envelope::new(
        uuid::Uuid::now_v7(),
        "blob",
        (0..1024u32).map(|i| (i * 31) as u8).collect::<Vec<u8>>(),
    );
    binary.ordering_key = Some("blob-1".into());
    vec![("json 120 B", json), ("binary 1 KiB", binary)]
}

/// The native RabbitMQ mapping's per-message work, as the transport does it.
fn native(e: &Envelope) -> usize {
    let mut headers: Vec<(String, String)> = e
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    headers.push((
        "x-pgbox-created-at".into(),
        e.created_at.format(&Rfc3339).unwrap(),
    ));
    if let Some(k) = &e.ordering_key {
        headers.push(("x-pgbox-ordering-key".into(), k.clone()));
    }
    let id = e.id.to_string();
    headers.len() + id.len() + e.payload.len()
}

/// Nanoseconds per message of `f` over `PER_ROUND` messages.
fn time(e: &Envelope, f: &dyn Fn(&Envelope) -> usize) -> f64 {
    let started = Instant::now();
    for _ in 0..PER_ROUND {
        black_box(f(black_box(e)));
    }
    started.elapsed().as_nanos() as f64 / PER_ROUND as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs CE1 and prints its table.
pub(crate) fn run() {
    let binary = CloudEvents::new("/payments").expect("valid source");
    let structured = binary.clone().mode(ContentMode::Structured);
    println!();
    println!(
        "CE1: CloudEvents encode cost per message (no broker), medians of {ROUNDS} interleaved rounds of {PER_ROUND}"
    );
    println!(
        "{:<14} {:>11} {:>11} {:>8} {:>13} {:>8}",
        "payload", "native ns", "binary ns", "ratio", "structured ns", "ratio"
    );
    for (name, e) in envelopes() {
        let arms: [&dyn Fn(&Envelope) -> usize; 3] = [
            &native,
            &|e| {
                let http = binary.http(e).expect("encodes");
                http.headers.len() + http.body.len()
            },
            &|e| structured.to_json(e).expect("encodes").len(),
        ];
        let mut samples = [Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            for (arm, s) in arms.iter().zip(samples.iter_mut()) {
                s.push(time(&e, *arm));
            }
        }
        let [n, b, s] = samples.map(median);
        println!(
            "{name:<14} {n:>11.0} {b:>11.0} {:>8.2} {s:>13.0} {:>8.2}",
            b / n,
            s / n
        );
    }
}
