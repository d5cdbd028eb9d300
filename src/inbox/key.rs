//! Message keys and consumer names: validated before any SQL runs.

use std::borrow::Cow;

use uuid::Uuid;

use crate::error::{Error, Result};

/// The longest key the inbox accepts, in bytes of UTF-8.
///
/// Long enough for composite business keys, far below PostgreSQL's B-tree entry limit
/// (about 2.7 kB) so an index insert can never fail on size. Longer keys are refused, never
/// truncated; hash them (e.g. SHA-256, hex) if your business keys can be longer.
pub const MAX_KEY_BYTES: usize = 1024;

/// The longest consumer name the inbox accepts, in bytes.
pub const MAX_CONSUMER_BYTES: usize = 128;

/// The longest message id stored for diagnostics, in bytes.
pub const MAX_MESSAGE_ID_BYTES: usize = 512;

/// What a message is deduplicated by: a business key, and optionally the transport's message
/// id (stored for diagnostics only).
///
/// Converts from `&str`, `String` and [`Uuid`], so `inbox.process(&mut tx, "order-42", ..)`
/// and `inbox.process(&mut tx, message.id, ..)` both work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key<'a> {
    value: Cow<'a, str>,
    message_id: Option<Cow<'a, str>>,
}

impl<'a> Key<'a> {
    /// A key with no message id.
    pub fn new(value: impl Into<Cow<'a, str>>) -> Self {
        Key {
            value: value.into(),
            message_id: None,
        }
    }

    /// Attaches the transport's message id, stored with the inbox row for diagnostics.
    pub fn with_message_id(mut self, id: impl Into<Cow<'a, str>>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// The key text.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// The message id, if one was attached.
    pub fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// Checks the key and message id against the documented limits.
    pub fn validate(&self) -> Result<()> {
        validate_key(&self.value)?;
        if let Some(id) = &self.message_id {
            if id.len() > MAX_MESSAGE_ID_BYTES {
                return Err(Error::InvalidField {
                    field: "message id",
                    reason: "longer than 512 bytes",
                });
            }
            if id.contains('\0') {
                return Err(Error::InvalidField {
                    field: "message id",
                    reason: "contains a NUL byte",
                });
            }
        }
        Ok(())
    }
}

impl<'a> From<&'a str> for Key<'a> {
    fn from(value: &'a str) -> Self {
        Key::new(value)
    }
}

impl<'a> From<&'a String> for Key<'a> {
    fn from(value: &'a String) -> Self {
        Key::new(value.as_str())
    }
}

impl From<String> for Key<'static> {
    fn from(value: String) -> Self {
        Key::new(value)
    }
}

impl From<Uuid> for Key<'static> {
    fn from(value: Uuid) -> Self {
        Key::new(value.to_string())
    }
}

impl From<&Uuid> for Key<'static> {
    fn from(value: &Uuid) -> Self {
        Key::new(value.to_string())
    }
}

fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::EmptyKey);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::KeyTooLong {
            len: key.len(),
            max: MAX_KEY_BYTES,
        });
    }
    if let Some(position) = key.bytes().position(|b| b == 0) {
        return Err(Error::KeyContainsNul { position });
    }
    Ok(())
}

/// Consumer names scope keys: the same key under two consumers is two records. Printable
/// ASCII letters, digits and `-_.:/@`, 1 to 128 bytes, so names read cleanly in logs and CLIs.
pub(crate) fn validate_consumer(name: &str) -> Result<()> {
    let invalid = |reason| Error::InvalidConsumerName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("must not be empty"));
    }
    if name.len() > MAX_CONSUMER_BYTES {
        return Err(invalid("longer than 128 bytes"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b))
    {
        return Err(invalid(
            "only ASCII letters, digits and the characters - _ . : / @ are allowed",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_limits_are_exact() {
        assert!(Key::new("x".repeat(MAX_KEY_BYTES)).validate().is_ok());
        assert!(matches!(
            Key::new("x".repeat(MAX_KEY_BYTES + 1)).validate(),
            Err(Error::KeyTooLong {
                len: 1025,
                max: 1024
            })
        ));
        // The limit is bytes, not characters: 342 three-byte characters are 1026 bytes.
        assert!(matches!(
            Key::new("€".repeat(342)).validate(),
            Err(Error::KeyTooLong { len: 1026, .. })
        ));
        assert!(matches!(Key::new("").validate(), Err(Error::EmptyKey)));
        assert!(matches!(
            Key::new("ab\0c").validate(),
            Err(Error::KeyContainsNul { position: 2 })
        ));
    }

    #[test]
    fn consumer_names() {
        for ok in ["points-service", "a", "team/svc@v2:main", "x_y.z"] {
            validate_consumer(ok).unwrap();
        }
        for bad in ["", "has space", "tab\t", "nul\0", "ünï", &"c".repeat(129)] {
            assert!(validate_consumer(bad).is_err(), "{bad:?}");
        }
    }
}
