//! CloudEvents interop with the Python SDK (`cloudevents` on PyPI, pinned below) through the
//! HTTP binding: what pgbox's `CloudEvents::http` writes, in binary and structured mode, the
//! Python SDK reads attribute by attribute and byte for byte; what the Python SDK writes,
//! pgbox's `HttpEvent::decode` reads.
//!
//! The SDK is installed once per machine into a virtual environment under
//! `~/.cache/pgbox/` (`python3 -m venv`, then `pip install` from PyPI; about ten seconds).
//! Without `python3` the tests fail saying so: they never skip.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use base64::Engine as _;
use pgbox::Envelope;
use pgbox::cloudevents::{CloudEvents, ContentMode, HttpEvent, event_uuid};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The Python SDK's version the tests run against.
const PYTHON_SDK: &str = "cloudevents==1.13.0";

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/support/python/cloudevents_interop.py"
);

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn unb64(text: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .unwrap()
}

/// The virtual environment's python, made on first use (a temporary directory renamed into
/// place, so two test processes never see a half-made one).
fn python() -> PathBuf {
    static MADE: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = made.as_ref() {
        return p.clone();
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    let version = PYTHON_SDK.replace("==", "-");
    let venv = home.join(format!(".cache/pgbox/python-{version}"));
    let python = venv.join("bin/python");
    if !python.exists() {
        std::fs::create_dir_all(venv.parent().unwrap()).unwrap();
        let tmp = venv.with_extension(format!("tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&tmp)
            .status()
            .unwrap_or_else(|e| {
                panic!("the Python SDK interop tests need python3 with venv (Debian: python3-venv): {e}")
            });
        assert!(status.success(), "python3 -m venv {tmp:?} failed");
        let status = Command::new(tmp.join("bin/pip"))
            .args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                PYTHON_SDK,
            ])
            .status()
            .unwrap();
        assert!(
            status.success(),
            "pip install {PYTHON_SDK} failed (it needs PyPI)"
        );
        if std::fs::rename(&tmp, &venv).is_err() {
            // Another process made it first.
            let _ = std::fs::remove_dir_all(&tmp);
        }
        assert!(python.exists(), "{python:?} missing after install");
    }
    *made = Some(python.clone());
    python
}

/// Runs one request through the Python side.
fn py(request: Value) -> Value {
    let mut child = Command::new(python())
        .arg("-W")
        .arg("ignore")
        .arg(SCRIPT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Python SDK failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// An HTTP event's headers as the Python side takes them (a JSON object).
fn headers_of(http: &HttpEvent) -> BTreeMap<&str, &str> {
    http.headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect()
}

/// What pgbox sends: a JSON message and a binary one (every byte value), both keyed, with
/// an extension, a trace header and a header that is not an extension.
fn envelopes() -> Vec<Envelope> {
    let mut json_message = Envelope::new(
        uuid::Uuid::now_v7(),
        "payment-succeeded",
        br#"{"order":42,"amount":"12.50","big":123456789012345678901234567890}"#.to_vec(),
    );
    json_message.content_type = "application/json".into();
    let mut binary = Envelope::new(
        uuid::Uuid::now_v7(),
        "receipt-rendered",
        (0..=255u8).collect::<Vec<_>>(),
    );
    binary.content_type = "application/octet-stream".into();
    for (e, key) in [(&mut json_message, "order-42"), (&mut binary, "order-43")] {
        e.ordering_key = Some(key.into());
        e.created_at = OffsetDateTime::now_utc();
        e.headers.insert("tenant".into(), "acme".into());
        e.headers.insert("x-Request".into(), "r-1".into());
        e.headers.insert("traceparent".into(), TRACEPARENT.into());
    }
    vec![json_message, binary]
}

#[test]
fn what_pgbox_writes_the_python_sdk_reads() {
    for mode in [ContentMode::Binary, ContentMode::Structured] {
        let ce = CloudEvents::new("/payments").unwrap().mode(mode);
        for e in envelopes() {
            let http = ce.http(&e).unwrap();
            let headers = headers_of(&http);
            let read = py(json!({"op": "read", "headers": headers, "body": b64(&http.body)}));
            let a = &read["attributes"];
            let what = format!("{mode:?} {}", e.topic);
            assert_eq!(a["specversion"], "1.0", "{what}");
            assert_eq!(a["id"], e.id.to_string(), "{what}");
            assert_eq!(a["source"], "/payments", "{what}");
            assert_eq!(a["type"], e.topic, "{what}");
            assert_eq!(a["subject"], e.ordering_key.clone().unwrap(), "{what}");
            assert_eq!(a["partitionkey"], e.ordering_key.clone().unwrap(), "{what}");
            assert_eq!(a["tenant"], "acme", "{what}");
            assert_eq!(a["traceparent"], TRACEPARENT, "{what}");
            assert_eq!(a["datacontenttype"], e.content_type, "{what}");
            assert!(
                a.get("x-Request").is_none(),
                "{what}: not an extension name"
            );
            // Python prints the time as it parsed it: the same instant.
            let time = a["time"].as_str().unwrap().replace(' ', "T");
            let time = OffsetDateTime::parse(&time, &Rfc3339).unwrap();
            assert_eq!(
                time.unix_timestamp(),
                e.created_at.unix_timestamp(),
                "{what}"
            );
            let data = unb64(read["data"].as_str().unwrap());
            if e.content_type == "application/json" {
                // Python parses JSON data (its integers have no bound) and prints it back
                // with sorted keys: the big number survives, digit for digit.
                assert_eq!(
                    String::from_utf8(data).unwrap(),
                    r#"{"amount":"12.50","big":123456789012345678901234567890,"order":42}"#,
                    "{what}"
                );
            } else {
                assert_eq!(data, e.payload, "{what}: byte for byte");
            }
        }
    }
}

#[test]
fn what_the_python_sdk_writes_pgbox_reads() {
    let attributes = json!({
        "id": "inv-7-paid",
        "source": "urn:billing:python-service",
        "type": "com.example.invoice.paid",
        "subject": "invoice-7",
        "time": "2026-11-27T10:15:30.250000+00:00",
        "partitionkey": "customer-9",
        "tenant": "acme",
    });
    let cases = [
        (
            "application/json",
            br#"{"invoice":7,"lines":[1,2]}"#.to_vec(),
        ),
        ("application/octet-stream", (0..=255u8).rev().collect()),
    ];
    for mode in ["binary", "structured"] {
        for (ct, data) in &cases {
            let mut attrs = attributes.clone();
            attrs["datacontenttype"] = json!(ct);
            let written =
                py(json!({"op": "write", "mode": mode, "attributes": attrs, "data": b64(data)}));
            let headers: Vec<(String, String)> = written["headers"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(n, v)| (n.clone(), v.as_str().unwrap().to_owned()))
                .collect();
            let body = unb64(written["body"].as_str().unwrap());
            let e = HttpEvent::new(headers, body).decode("invoices").unwrap();
            let what = format!("{mode} {ct}");
            assert_eq!(
                e.id,
                event_uuid("urn:billing:python-service", "inv-7-paid"),
                "{what}"
            );
            assert_eq!(e.ordering_key.as_deref(), Some("customer-9"), "{what}");
            assert_eq!(
                e.cloudevent_attribute("subject"),
                Some("invoice-7"),
                "{what}"
            );
            assert_eq!(
                e.cloudevent_attribute("type"),
                Some("com.example.invoice.paid"),
                "{what}"
            );
            assert_eq!(
                e.headers.get("tenant").map(String::as_str),
                Some("acme"),
                "{what}"
            );
            assert_eq!(e.content_type, *ct, "{what}");
            assert_eq!(
                e.created_at,
                OffsetDateTime::parse("2026-11-27T10:15:30.25Z", &Rfc3339).unwrap(),
                "{what}"
            );
            if *ct == "application/json" {
                let back: Value = serde_json::from_slice(&e.payload).unwrap();
                assert_eq!(back, json!({"invoice": 7, "lines": [1, 2]}), "{what}");
            } else {
                assert_eq!(&e.payload, data, "{what}: byte for byte");
            }
        }
    }
}

/// Attribute values beyond printable ASCII: the HTTP binding percent-encodes them in binary
/// mode, which the Python SDK 1.13 does not decode (it reads `order%2042`, a deviation
/// from the binding the guide names); structured mode carries them intact.
#[test]
fn values_beyond_ascii_reach_python_intact_in_structured_mode() {
    let mut e = envelopes().remove(0);
    e.ordering_key = Some("Bestellung 42 – größe \"x\" 100%".into());
    let want = e.ordering_key.clone().unwrap();
    for (mode, intact) in [
        (ContentMode::Structured, true),
        (ContentMode::Binary, false),
    ] {
        let http = CloudEvents::new("/payments")
            .unwrap()
            .mode(mode)
            .http(&e)
            .unwrap();
        let headers = headers_of(&http);
        let read = py(json!({"op": "read", "headers": headers, "body": b64(&http.body)}));
        assert_eq!(
            read["attributes"]["subject"] == want.as_str(),
            intact,
            "{mode:?}: {read}"
        );
        // pgbox itself reads both forms back intact.
        let back = http.decode("t").unwrap();
        assert_eq!(
            back.ordering_key.as_deref(),
            Some(want.as_str()),
            "{mode:?}"
        );
    }
}
