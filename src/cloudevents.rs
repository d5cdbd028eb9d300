//! CloudEvents 1.0 on the wire: an opt-in envelope so that services in other languages read
//! what pgbox publishes, and pgbox consumers read the CloudEvents others publish.
//!
//! A publisher given a [`CloudEvents`] config (for instance
//! `RabbitMq::builder(url).cloudevents(CloudEvents::new("/payments")?)`) sends each message
//! as an event; without one it sends pgbox's native form, as before. Receiving needs no
//! setting: every broker transport reads both forms, and tells them apart by the message
//! itself (a `specversion` attribute in the binding's headers: binary mode; a content type
//! `application/cloudevents+json`: structured mode; else native).
//!
//! # From a message to an event
//!
//! | attribute | from |
//! |---|---|
//! | `specversion` | `1.0` |
//! | `id` | the message id (a UUID, as text) |
//! | `source` | [`CloudEvents::new`]'s argument |
//! | `type` | the topic, or a header ([`CloudEvents::type_header`]) |
//! | `subject` | the ordering key, or a header ([`CloudEvents::subject_header`]), or none |
//! | `time` | when the producer's transaction enqueued it (RFC 3339) |
//! | `datacontenttype` | the content type |
//! | `partitionkey` | the ordering key (the Partitioning extension) |
//! | `traceparent` | the `traceparent` header (the Distributed Tracing extension) |
//! | other extensions | every other header whose name is a valid extension name (`a-z`, `0-9`, at most 20 characters) and not a core attribute's |
//!
//! Headers whose names are not valid extension names (`x-tenant`, `Content-Language`) stay
//! headers of the transport, beside the event (binary mode), or are dropped (structured
//! mode, whose payload is the whole event; NATS and RabbitMQ still carry them as headers).
//! Headers named `ce-…` are never sent: they are the attributes of an event the message was
//! received as (see below), and the new event has its own.
//!
//! # From an event to an [`Envelope`]
//!
//! - the id is the event's `id` when that is a UUID (hyphenated); else a UUIDv5 of `source` and `id`
//!   (which CloudEvents makes unique together), so a redelivery has the same id;
//! - the ordering key is `partitionkey`; the content type `datacontenttype`
//!   (`application/json` for structured events with JSON `data`); `created_at` is `time`
//!   (the time of receipt when absent);
//! - every attribute is a header named `ce-<attribute>` (`ce-source`, `ce-type`,
//!   `ce-subject`, `ce-id`, extensions alike): read them with
//!   [`Envelope::cloudevent_attribute`], for instance as the inbox key in the consumer's key
//!   closure; extensions are also headers of their own name (so a pgbox header survives a
//!   pgbox → CloudEvents → pgbox trip), `traceparent` included.
//!
//! A malformed event (a required attribute missing, a `specversion` other than 1.0, JSON
//! that does not parse, `data_base64` that is not base64) is refused with
//! [`Error::InvalidField`] (field `cloudevent`), and the transport dead-letters it like any
//! message it cannot decode.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::outbox::{Envelope, TRACEPARENT};

/// The media type of a structured event in the JSON format.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// The CloudEvents version pgbox writes and reads.
pub const SPEC_VERSION: &str = "1.0";

/// The longest extension attribute name CloudEvents recommends (and pgbox maps).
const MAX_EXTENSION_NAME: usize = 20;

/// The namespace of the UUIDv5 ids given to events whose `id` is not a UUID (a random UUID
/// fixed once for pgbox; the name hashed is `source`, a NUL, then `id`).
const ID_NAMESPACE: Uuid = Uuid::from_u128(0x6f1c_7b0e_52a4_4c55_9a0e_3d1b_8f4e_c2a7);

/// The attributes CloudEvents itself defines (everything else is an extension).
const CORE: [&str; 9] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
];

/// How an event is laid on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ContentMode {
    /// The attributes in the protocol's headers, the payload as it is (the default): the
    /// cheapest, and a consumer that ignores the headers still sees the plain payload.
    #[default]
    Binary,
    /// The whole event as one `application/cloudevents+json` document: `data` for JSON
    /// payloads, `data_base64` for the others.
    Structured,
}

/// How a publisher turns messages into CloudEvents: the `source`, the content mode and
/// where `type` and `subject` come from. See the [module](self) for the mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    source: String,
    mode: ContentMode,
    type_header: Option<String>,
    subject: SubjectFrom,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SubjectFrom {
    OrderingKey,
    Header(String),
    Nothing,
}

impl CloudEvents {
    /// Events from `source`, a URI-reference naming the producer (`/payments`,
    /// `https://shop.example/payments`, `urn:shop:payments`), in binary mode, with the topic
    /// as `type` and the ordering key as `subject`.
    ///
    /// Refused ([`Error::InvalidConfig`]) when empty or holding whitespace, control
    /// characters or characters a URI never holds (`"`, `<`, `>`, `\`, `^`, `` ` ``, `{`,
    /// `|`, `}`).
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let source = source.into();
        let bad = source.is_empty()
            || source.chars().any(|c| {
                c.is_control()
                    || c.is_whitespace()
                    || matches!(c, '"' | '<' | '>' | '\\' | '^' | '`' | '{' | '|' | '}')
            });
        if bad {
            return Err(Error::InvalidConfig(format!(
                "CloudEvents source {source:?} is not a URI-reference (empty, or holds whitespace, controls or one of \"<>\\^`{{|}})"
            )));
        }
        Ok(CloudEvents {
            source,
            mode: ContentMode::Binary,
            type_header: None,
            subject: SubjectFrom::OrderingKey,
        })
    }

    /// Binary (the default) or structured.
    pub fn mode(mut self, mode: ContentMode) -> Self {
        self.mode = mode;
        self
    }

    /// Takes `type` from this header when a message has it (the topic otherwise); the
    /// header is then not sent again as an extension.
    pub fn type_header(mut self, name: impl Into<String>) -> Self {
        self.type_header = Some(name.into());
        self
    }

    /// Takes `subject` from this header (no subject when a message lacks it) instead of the
    /// ordering key; the header is then not sent again as an extension.
    pub fn subject_header(mut self, name: impl Into<String>) -> Self {
        self.subject = SubjectFrom::Header(name.into());
        self
    }

    /// Sends no `subject` (the ordering key still travels as `partitionkey`).
    pub fn no_subject(mut self) -> Self {
        self.subject = SubjectFrom::Nothing;
        self
    }

    /// The source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The content mode.
    pub fn content_mode(&self) -> ContentMode {
        self.mode
    }

    /// The event of `envelope`: its context attributes except `datacontenttype` (which
    /// bindings carry as their content type), in a fixed order, and the headers that stay
    /// headers of the transport.
    pub(crate) fn attributes(&self, envelope: &Envelope) -> Result<Attributes> {
        let time = envelope
            .created_at
            .format(&Rfc3339)
            .map_err(|_| invalid("the creation time is out of range"))?;
        let mut attrs = vec![
            ("specversion".to_owned(), SPEC_VERSION.to_owned()),
            ("id".to_owned(), envelope.id.to_string()),
            ("source".to_owned(), self.source.clone()),
        ];
        let ty = self
            .type_header
            .as_ref()
            .and_then(|h| envelope.headers.get(h))
            .unwrap_or(&envelope.topic);
        attrs.push(("type".to_owned(), ty.clone()));
        let subject = match &self.subject {
            SubjectFrom::OrderingKey => envelope.ordering_key.as_ref(),
            SubjectFrom::Header(h) => envelope.headers.get(h),
            SubjectFrom::Nothing => None,
        };
        if let Some(subject) = subject {
            attrs.push(("subject".to_owned(), subject.clone()));
        }
        attrs.push(("time".to_owned(), time));
        if let Some(key) = &envelope.ordering_key {
            attrs.push(("partitionkey".to_owned(), key.clone()));
        }
        let mut transport = Vec::new();
        for (name, value) in &envelope.headers {
            let used = Some(name) == self.type_header.as_ref()
                || matches!(&self.subject, SubjectFrom::Header(h) if h == name);
            // The ordering key is `partitionkey` already; a header of that name would be a
            // second value of the attribute.
            let shadowed = name == "partitionkey" && envelope.ordering_key.is_some();
            if used || shadowed || name.starts_with("ce-") {
                continue;
            }
            if name == TRACEPARENT || is_extension_name(name) {
                attrs.push((name.clone(), value.clone()));
            } else {
                transport.push((name.clone(), value.clone()));
            }
        }
        Ok(Attributes { attrs, transport })
    }

    /// The event of `envelope` in the JSON event format (structured mode's payload).
    pub fn to_json(&self, envelope: &Envelope) -> Result<Vec<u8>> {
        let a = self.attributes(envelope)?;
        let mut doc = Map::new();
        for (name, value) in a.attrs {
            doc.insert(name, Value::String(value));
        }
        doc.insert(
            "datacontenttype".to_owned(),
            Value::String(envelope.content_type.clone()),
        );
        // JSON data goes in as the producer wrote it: through `serde_json::Value` an integer
        // past 64 bits would become an f64 (another number on the wire).
        let json_data = is_json(&envelope.content_type)
            && std::str::from_utf8(&envelope.payload).is_ok()
            && serde_json::from_slice::<serde::de::IgnoredAny>(&envelope.payload).is_ok();
        if !json_data && !envelope.payload.is_empty() {
            doc.insert(
                "data_base64".to_owned(),
                Value::String(base64_encode(&envelope.payload)),
            );
        }
        let mut out = serde_json::to_vec(&Value::Object(doc)).map_err(Error::SerializePayload)?;
        if json_data {
            // `doc` is a non-empty object: its text ends with '}'.
            out.pop();
            out.extend_from_slice(b",\"data\":");
            out.extend_from_slice(&envelope.payload);
            out.push(b'}');
        }
        Ok(out)
    }

    /// The HTTP binding of `envelope` in binary mode, for webhooks: the headers to send
    /// (`ce-<attribute>` for every attribute, `content-type` for `datacontenttype`, then the
    /// headers that are not attributes, under their own names) and the body. Attribute
    /// values are percent-encoded as the binding asks; a header that is not an attribute and
    /// that HTTP cannot carry (a name that is not a token, such as `größe`) is refused
    /// ([`Error::InvalidField`]).
    ///
    /// ```
    /// # fn main() -> pgbox::Result<()> {
    /// use pgbox::cloudevents::CloudEvents;
    /// let ce = CloudEvents::new("/payments")?;
    /// let mut e = pgbox::Envelope::new(uuid::Uuid::now_v7(), "payment-succeeded", br#"{"order":42}"#.to_vec());
    /// e.content_type = "application/json".into();
    /// let http = ce.http(&e)?;
    /// assert!(http.headers.contains(&("ce-type".into(), "payment-succeeded".into())));
    /// assert!(http.headers.contains(&("content-type".into(), "application/json".into())));
    /// assert_eq!(http.body, e.payload);
    /// # Ok(()) }
    /// ```
    pub fn http(&self, envelope: &Envelope) -> Result<HttpEvent> {
        if self.mode == ContentMode::Structured {
            return Ok(HttpEvent {
                headers: vec![("content-type".into(), STRUCTURED_CONTENT_TYPE.into())],
                body: self.to_json(envelope)?,
            });
        }
        let a = self.attributes(envelope)?;
        let mut headers: Vec<(String, String)> = a
            .attrs
            .into_iter()
            .map(|(n, v)| (format!("ce-{n}"), percent_encode_header(&v)))
            .collect();
        headers.push(("content-type".into(), envelope.content_type.clone()));
        // The headers that stay headers: only names HTTP can carry (a token), values without
        // controls (the outbox accepts `größe` as a name; no HTTP client sends it).
        for (name, value) in &a.transport {
            let token = name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !token || value.chars().any(char::is_control) {
                return Err(invalid("a header that HTTP cannot carry"));
            }
        }
        headers.extend(a.transport);
        Ok(HttpEvent {
            headers,
            body: envelope.payload.clone(),
        })
    }
}

/// An event in the HTTP binding ([`CloudEvents::http`]): the headers to send, in order,
/// and the body.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpEvent {
    /// Header names and values (`ce-<attribute>`, `content-type`, the other headers).
    pub headers: Vec<(String, String)>,
    /// The body: the payload (binary mode) or the JSON event (structured mode).
    pub body: Vec<u8>,
}

impl HttpEvent {
    /// An event as an HTTP request or response carried it: its headers (names in any case)
    /// and its body. [`decode`](Self::decode) reads it.
    pub fn new<N, V>(headers: impl IntoIterator<Item = (N, V)>, body: impl Into<Vec<u8>>) -> Self
    where
        N: Into<String>,
        V: Into<String>,
    {
        HttpEvent {
            headers: headers
                .into_iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect(),
            body: body.into(),
        }
    }

    /// The message this event is, as the broker subscribers read events (see the
    /// [module](self)): structured mode when `content-type` is
    /// `application/cloudevents+json`, else binary mode (`ce-*` headers, percent-decoded,
    /// `content-type` as `datacontenttype`). `topic` names the envelope's topic (HTTP has no
    /// topic of its own: the route, say). HTTP's other headers (`host`, `user-agent`,
    /// `content-length`, ...) are not carried into the envelope.
    ///
    /// Refused with [`Error::InvalidField`] (field `cloudevent`): a request that is not an
    /// event (no `ce-specversion`, not structured), the batched format
    /// (`application/cloudevents-batch+json`), an attribute header given twice, a value
    /// that is not UTF-8 once decoded, and every malformed event the brokers' decoding
    /// refuses.
    ///
    /// ```
    /// # fn main() -> pgbox::Result<()> {
    /// use pgbox::cloudevents::HttpEvent;
    /// let request = HttpEvent::new(
    ///     [
    ///         ("CE-SpecVersion", "1.0"),
    ///         ("ce-id", "A234-1234-1234"),
    ///         ("ce-source", "/mycontext"),
    ///         ("ce-type", "com.example.order.paid"),
    ///         ("ce-subject", "order%2042"),
    ///         ("content-type", "application/json"),
    ///     ],
    ///     br#"{"order":42}"#.to_vec(),
    /// );
    /// let envelope = request.decode("webhooks")?;
    /// assert_eq!(envelope.cloudevent_attribute("subject"), Some("order 42"));
    /// // The same (source, id) always gives the same envelope id: the inbox dedups retries.
    /// assert_eq!(envelope.id, pgbox::cloudevents::event_uuid("/mycontext", "A234-1234-1234"));
    /// # Ok(()) }
    /// ```
    pub fn decode(&self, topic: &str) -> Result<Envelope> {
        let mut content_type = None;
        let mut attrs = BTreeMap::new();
        for (name, value) in &self.headers {
            let name = name.trim().to_ascii_lowercase();
            if name == "content-type" {
                if content_type.replace(value.trim().to_owned()).is_some() {
                    return Err(invalid("content-type given twice"));
                }
            } else if let Some(attr) = name.strip_prefix("ce-") {
                let decoded = String::from_utf8(crate::percent::decode(value.trim(), false))
                    .map_err(|_| invalid("an attribute is not UTF-8 once percent-decoded"))?;
                if attrs.insert(attr.to_owned(), decoded).is_some() {
                    return Err(invalid("an attribute header given twice"));
                }
            }
        }
        let essence = content_type
            .as_deref()
            .and_then(|ct| ct.split(';').next())
            .map(|e| e.trim().to_ascii_lowercase());
        if essence.as_deref() == Some("application/cloudevents-batch+json") {
            return Err(invalid(
                "the batched format is not read (one event per request)",
            ));
        }
        if content_type.as_deref().is_some_and(is_structured) {
            return decode_structured(topic, &self.body, BTreeMap::new());
        }
        if !attrs.contains_key("specversion") {
            return Err(invalid(
                "not a CloudEvent (no ce-specversion header, not application/cloudevents+json)",
            ));
        }
        decode_binary(topic, attrs, content_type, BTreeMap::new(), &self.body)
    }
}

/// An event's context attributes (without `datacontenttype`) and the headers that are not
/// attributes.
#[derive(Debug)]
pub(crate) struct Attributes {
    pub(crate) attrs: Vec<(String, String)>,
    pub(crate) transport: Vec<(String, String)>,
}

impl Envelope {
    /// A CloudEvents attribute of a message received as an event (`"source"`, `"type"`,
    /// `"subject"`, `"id"`, `"time"`, an extension's name): the header `ce-<name>`. `None`
    /// for a native pgbox message, or an attribute the event does not have.
    ///
    /// ```
    /// let mut e = pgbox::Envelope::new(uuid::Uuid::now_v7(), "orders", Vec::new());
    /// e.headers.insert("ce-subject".into(), "order-42".into());
    /// assert_eq!(e.cloudevent_attribute("subject"), Some("order-42"));
    /// assert_eq!(e.cloudevent_attribute("dataschema"), None);
    /// ```
    pub fn cloudevent_attribute(&self, name: &str) -> Option<&str> {
        self.headers.get(&format!("ce-{name}")).map(String::as_str)
    }
}

/// Whether `name` may be an extension attribute: `a-z` and `0-9`, 1 to 20 characters, not a
/// core attribute's name.
pub(crate) fn is_extension_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_EXTENSION_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && !CORE.contains(&name)
}

fn invalid(reason: &'static str) -> Error {
    Error::InvalidField {
        field: "cloudevent",
        reason,
    }
}

/// Whether a content type is JSON (`application/json`, `…+json`, with parameters).
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || essence == "text/json" || essence.ends_with("+json")
}

/// Whether a content type says the payload is a structured event in the JSON format.
pub(crate) fn is_structured(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .eq_ignore_ascii_case(STRUCTURED_CONTENT_TYPE)
}

/// A message received in binary mode: `attr` gives an attribute's value by name (the binding's
/// prefix already stripped: `"specversion"`, `"id"`, ...), `names` every attribute present,
/// `content_type` the protocol's content type, `others` the headers that are not attributes.
pub(crate) fn decode_binary(
    topic: &str,
    attrs: BTreeMap<String, String>,
    content_type: Option<String>,
    others: BTreeMap<String, String>,
    payload: &[u8],
) -> Result<Envelope> {
    let mut attrs = attrs;
    if let Some(ct) = content_type {
        attrs.insert("datacontenttype".to_owned(), ct);
    }
    finish(topic, attrs, others, payload.to_vec())
}

/// A structured event in the JSON format; `others` the protocol's headers.
pub(crate) fn decode_structured(
    topic: &str,
    payload: &[u8],
    others: BTreeMap<String, String>,
) -> Result<Envelope> {
    // Members as raw text: `data` reaches the handler as the producer wrote it (through
    // `serde_json::Value` an integer past 64 bits would become another number).
    let doc: BTreeMap<String, Box<serde_json::value::RawValue>> = serde_json::from_slice(payload)
        .map_err(|_| {
        match serde_json::from_slice::<serde::de::IgnoredAny>(payload) {
            Ok(_) => invalid("the event is not a JSON object"),
            Err(_) => invalid("the event is not valid JSON"),
        }
    })?;
    let mut attrs = BTreeMap::new();
    let mut data = None;
    let mut data_base64 = None;
    for (name, raw) in doc {
        let value: Value =
            serde_json::from_str(raw.get()).map_err(|_| invalid("the event is not valid JSON"))?;
        match name.as_str() {
            "data" => data = Some((value, raw)),
            "data_base64" => data_base64 = Some(value),
            _ => {
                let text = match value {
                    Value::String(s) => s,
                    Value::Number(n) => n.to_string(),
                    Value::Bool(b) => b.to_string(),
                    Value::Null => continue,
                    _ => return Err(invalid("an attribute is an object or an array")),
                };
                attrs.insert(name, text);
            }
        }
    }
    let payload = match (data, data_base64) {
        (Some(_), Some(_)) => return Err(invalid("both data and data_base64")),
        (None, Some(Value::String(b))) => {
            base64_decode(&b).ok_or(invalid("data_base64 is not base64"))?
        }
        (None, Some(_)) => return Err(invalid("data_base64 is not a string")),
        (Some((Value::String(s), _)), None)
            if attrs.get("datacontenttype").is_some_and(|ct| !is_json(ct)) =>
        {
            // Text data of a non-JSON content type travels as a JSON string (without a
            // content type the data is JSON: the JSON format, 3.1).
            s.into_bytes()
        }
        (Some((_, raw)), None) => {
            attrs
                .entry("datacontenttype".to_owned())
                .or_insert_with(|| "application/json".to_owned());
            raw.get().as_bytes().to_vec()
        }
        (None, None) => Vec::new(),
    };
    finish(topic, attrs, others, payload)
}

fn finish(
    topic: &str,
    attrs: BTreeMap<String, String>,
    others: BTreeMap<String, String>,
    payload: Vec<u8>,
) -> Result<Envelope> {
    match attrs.get("specversion").map(String::as_str) {
        Some(SPEC_VERSION) => {}
        Some(_) => return Err(invalid("specversion is not 1.0")),
        None => return Err(invalid("no specversion")),
    }
    let id = attrs
        .get("id")
        .filter(|s| !s.is_empty())
        .ok_or(invalid("no id"))?;
    let source = attrs
        .get("source")
        .filter(|s| !s.is_empty())
        .ok_or(invalid("no source"))?;
    // CloudEvents forbids control characters in String attributes; in `source` or `id` they
    // would also let two pairs meet in one UUIDv5 name (`source NUL id`).
    if [source, id].iter().any(|s| s.chars().any(char::is_control)) {
        return Err(invalid("source or id holds a control character"));
    }
    if attrs.get("type").is_none_or(String::is_empty) {
        return Err(invalid("no type"));
    }
    let created_at = match attrs.get("time") {
        Some(t) => OffsetDateTime::parse(t, &Rfc3339)
            .map_err(|_| invalid("time is not an RFC 3339 timestamp"))?,
        None => OffsetDateTime::now_utc(),
    };
    let mut envelope = Envelope::new(event_uuid(source, id), topic, payload);
    envelope.created_at = created_at;
    envelope.ordering_key = attrs.get("partitionkey").cloned();
    if let Some(ct) = attrs.get("datacontenttype") {
        envelope.content_type = ct.clone();
    }
    envelope.headers = others;
    for (name, value) in attrs {
        if !CORE.contains(&name.as_str()) {
            envelope.headers.insert(name.clone(), value.clone());
        }
        envelope.headers.insert(format!("ce-{name}"), value);
    }
    Ok(envelope)
}

/// The envelope id of an event: its `id` when that is a UUID in the hyphenated form (36
/// characters), else a UUIDv5 of source and id.
pub fn event_uuid(source: &str, id: &str) -> Uuid {
    // The hyphenated form only: `Uuid::parse_str` also takes 32 bare hex digits (an MD5
    // digest, a common event id), braces and `urn:uuid:`, which would drop the source.
    if id.len() == 36
        && let Ok(uuid) = Uuid::parse_str(id)
    {
        return uuid;
    }
    let mut name = Vec::with_capacity(source.len() + 1 + id.len());
    name.extend_from_slice(source.as_bytes());
    name.push(0);
    name.extend_from_slice(id.as_bytes());
    Uuid::new_v5(&ID_NAMESPACE, &name)
}

fn base64_encode(data: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn base64_decode(text: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(text).ok()
}

/// HTTP header values: printable ASCII stays, the rest is percent-encoded as the HTTP
/// binding asks (space, `"` and `%` too: an HTTP stack trims a value's outer spaces).
fn percent_encode_header(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if (0x21..0x7f).contains(&b) && b != b'%' && b != b'"' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope() -> Envelope {
        let mut e = Envelope::new(Uuid::now_v7(), "orders", br#"{"order":42}"#.to_vec());
        e.content_type = "application/json".into();
        e.ordering_key = Some("order-42".into());
        e.headers.insert("tenant".into(), "acme".into());
        e.headers.insert("x-Trace".into(), "t".into());
        e.headers.insert(
            TRACEPARENT.into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        );
        e
    }

    #[test]
    fn ids_that_are_not_uuids_map_to_a_stable_uuid_per_source() {
        let a = event_uuid("/a", "42");
        assert_eq!(a, event_uuid("/a", "42"));
        assert_ne!(a, event_uuid("/b", "42"));
        assert_ne!(a, event_uuid("/a4", "2"));
        assert_eq!(a.get_version_num(), 5);
        let u = Uuid::now_v7();
        assert_eq!(event_uuid("/a", &u.to_string()), u);
    }

    #[test]
    fn sources_that_are_not_uri_references_are_refused() {
        for bad in ["", "a b", "a\nb", "<x>", "a|b"] {
            assert!(CloudEvents::new(bad).is_err(), "{bad:?}");
        }
        for good in [
            "/payments",
            "https://x.example/a?b=c#d",
            "urn:shop:payments",
        ] {
            assert!(CloudEvents::new(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn extensions_are_valid_names_only() {
        let ce = CloudEvents::new("/s").unwrap();
        let a = ce.attributes(&envelope()).unwrap();
        let names: Vec<&str> = a.attrs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "specversion",
                "id",
                "source",
                "type",
                "subject",
                "time",
                "partitionkey",
                "tenant",
                "traceparent"
            ]
        );
        assert_eq!(a.transport, [("x-Trace".to_owned(), "t".to_owned())]);
    }

    #[test]
    fn structured_round_trip_keeps_everything() {
        let ce = CloudEvents::new("/s").unwrap();
        for (ct, payload) in [
            ("application/json", br#"{"order":42}"#.to_vec()),
            ("application/octet-stream", vec![0, 1, 2, 255, 254]),
            ("text/plain", b"hi".to_vec()),
            ("application/octet-stream", Vec::new()),
        ] {
            let mut e = envelope();
            e.content_type = ct.into();
            e.payload = payload;
            let json = ce.to_json(&e).unwrap();
            let back = decode_structured("orders", &json, BTreeMap::new()).unwrap();
            assert_eq!(back.id, e.id);
            assert_eq!(back.payload, e.payload, "{ct}");
            assert_eq!(back.content_type, ct);
            assert_eq!(back.ordering_key, e.ordering_key);
            assert_eq!(back.created_at, e.created_at);
            assert_eq!(back.headers["tenant"], "acme");
            assert_eq!(back.headers[TRACEPARENT], e.headers[TRACEPARENT]);
            assert_eq!(back.cloudevent_attribute("source"), Some("/s"));
            assert_eq!(back.cloudevent_attribute("subject"), Some("order-42"));
        }
    }

    #[test]
    fn malformed_events_are_typed_errors() {
        for doc in [
            &b"not json"[..],
            b"[1]",
            br#"{"specversion":"0.3","id":"1","source":"/s","type":"t"}"#,
            br#"{"id":"1","source":"/s","type":"t"}"#,
            br#"{"specversion":"1.0","source":"/s","type":"t"}"#,
            br#"{"specversion":"1.0","id":"1","type":"t"}"#,
            br#"{"specversion":"1.0","id":"1","source":"/s"}"#,
            br#"{"specversion":"1.0","id":"1","source":"/s","type":"t","time":"yesterday"}"#,
            br#"{"specversion":"1.0","id":"1","source":"/s","type":"t","data_base64":"@@"}"#,
            br#"{"specversion":"1.0","id":"1","source":"/s","type":"t","data":1,"data_base64":""}"#,
        ] {
            let e = decode_structured("t", doc, BTreeMap::new()).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidField {
                        field: "cloudevent",
                        ..
                    }
                ),
                "{}: {e}",
                String::from_utf8_lossy(doc)
            );
        }
    }

    #[test]
    fn http_binary_round_trips_through_percent_encoding() {
        let ce = CloudEvents::new("/s").unwrap();
        let mut e = envelope();
        e.ordering_key = Some("Bestellung 42 – größe \"x\" 100%".into());
        let http = ce.http(&e).unwrap();
        assert!(
            http.headers
                .iter()
                .all(|(_, v)| v.bytes().all(|b| (0x20..0x7f).contains(&b))),
            "{:?}",
            http.headers
        );
        let back = http.decode("orders").unwrap();
        assert_eq!(back.id, e.id);
        assert_eq!(back.ordering_key, e.ordering_key);
        assert_eq!(
            back.cloudevent_attribute("subject"),
            e.ordering_key.as_deref()
        );
        assert_eq!(back.headers["tenant"], "acme");
        assert_eq!(back.headers[TRACEPARENT], e.headers[TRACEPARENT]);
        assert_eq!(back.payload, e.payload);
        assert_eq!(back.content_type, "application/json");
        // HTTP's own headers do not become the message's.
        assert!(!back.headers.contains_key("x-Trace"));
    }

    #[test]
    fn base64_round_trips() {
        for n in 0..10 {
            let data: Vec<u8> = (0..n).map(|i| (i * 37 + 200) as u8).collect();
            assert_eq!(base64_decode(&base64_encode(&data)).unwrap(), data);
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
    }
}
