//! The WAL outbox's wire format: what one `pg_logical_emit_message` carries, and how the WAL
//! relay reads it back.
//!
//! One emitted message carries one or more outbox messages (an `enqueue_batch` is one emit):
//!
//! ```text
//! "PGBX" version:u8=1 count:u32
//! count × ( id:[u8;16]  topic:str  key:u8(0|1) [str]  content_type:str
//!           headers:u32-count × (name:str value:str)  payload:bytes )
//! str, bytes = len:u32 big-endian, then the bytes (UTF-8 for str)
//! ```
//!
//! The prefix of the emitted message is `pgbox:<schema>`: a relay reads only its schema's.

use std::collections::BTreeMap;

use uuid::Uuid;

use super::Message;

const MAGIC: &[u8; 4] = b"PGBX";
const VERSION: u8 = 1;

/// The logical-decoding message prefix of `schema`'s WAL outbox.
pub(crate) fn prefix(schema: &str) -> String {
    format!("pgbox:{schema}")
}

/// The channel producers notify when a WAL relay of `schema` sleeps.
pub(crate) fn channel(schema: &str) -> String {
    format!("{schema}.wal")
}

/// One outbox message as read back from the WAL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decoded {
    pub(crate) id: Uuid,
    pub(crate) topic: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) content_type: String,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) payload: Vec<u8>,
}

/// The bytes one emit carries for `messages`.
pub(crate) fn encode(messages: &[Message]) -> Vec<u8> {
    let size: usize = messages.iter().map(|m| m.size() + 64).sum();
    let mut out = Vec::with_capacity(9 + size);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    put_u32(&mut out, messages.len());
    for m in messages {
        out.extend_from_slice(m.id.as_bytes());
        put_bytes(&mut out, m.topic.as_bytes());
        match &m.ordering_key {
            Some(k) => {
                out.push(1);
                put_bytes(&mut out, k.as_bytes());
            }
            None => out.push(0),
        }
        put_bytes(&mut out, m.content_type.as_bytes());
        put_u32(&mut out, m.headers.len());
        for (name, value) in &m.headers {
            put_bytes(&mut out, name.as_bytes());
            put_bytes(&mut out, value.as_bytes());
        }
        put_bytes(&mut out, &m.payload);
    }
    out
}

fn put_u32(out: &mut Vec<u8>, n: usize) {
    // Sizes are bounded by the outbox's limits (256 MiB), far below u32::MAX.
    out.extend_from_slice(&(n as u32).to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u32(out, bytes.len());
    out.extend_from_slice(bytes);
}

/// The messages of one emit; `Err` names what is wrong with content that does not follow the
/// format (written by something other than pgbox under pgbox's prefix, or a newer version).
pub(crate) fn decode(content: &[u8]) -> Result<Vec<Decoded>, String> {
    let mut r = Reader(content);
    if r.take(4)? != MAGIC {
        return Err("not a pgbox WAL message (bad magic)".into());
    }
    let version = r.take(1)?[0];
    if version != VERSION {
        return Err(format!(
            "pgbox WAL message version {version}, this build reads {VERSION}"
        ));
    }
    let count = r.u32()?;
    let mut out = Vec::with_capacity(count.min(10_000));
    for _ in 0..count {
        let id = Uuid::from_slice(r.take(16)?).map_err(|e| e.to_string())?;
        let topic = r.string()?;
        let ordering_key = match r.take(1)?[0] {
            0 => None,
            1 => Some(r.string()?),
            other => return Err(format!("bad ordering-key flag {other}")),
        };
        let content_type = r.string()?;
        let headers_len = r.u32()?;
        let mut headers = BTreeMap::new();
        for _ in 0..headers_len {
            let name = r.string()?;
            let value = r.string()?;
            headers.insert(name, value);
        }
        let payload = r.bytes()?.to_vec();
        out.push(Decoded {
            id,
            topic,
            ordering_key,
            content_type,
            headers,
            payload,
        });
    }
    if !r.0.is_empty() {
        return Err(format!("{} trailing bytes", r.0.len()));
    }
    Ok(out)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "truncated: {n} bytes needed, {} left",
                self.0.len()
            ));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<usize, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()?;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let a = Message::bytes("orders", b"\x00\xffpayload".to_vec())
            .ordering_key("order-1")
            .header("traceparent", "00-abc-def-01");
        let b = Message::bytes("t", Vec::new());
        let encoded = encode(&[a.clone(), b.clone()]);
        let decoded = decode(&encoded).unwrap();
        assert_eq!(decoded.len(), 2);
        assert_eq!(decoded[0].id, a.id);
        assert_eq!(decoded[0].topic, "orders");
        assert_eq!(decoded[0].ordering_key.as_deref(), Some("order-1"));
        assert_eq!(decoded[0].payload, a.payload);
        assert_eq!(decoded[0].headers, a.headers);
        assert_eq!(decoded[0].content_type, a.content_type);
        assert_eq!(decoded[1].ordering_key, None);
        assert!(decoded[1].payload.is_empty());
    }

    #[test]
    fn malformed_content_is_an_error_not_a_panic() {
        let encoded = encode(&[Message::bytes("orders", b"x".to_vec())]);
        for cut in 0..encoded.len() {
            assert!(decode(&encoded[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode(b"PGBX\x02\x00\x00\x00\x00").is_err());
        let mut trailing = encoded.clone();
        trailing.push(0);
        assert!(decode(&trailing).is_err());
    }
}
