//! Topic patterns of the router's routes: dot-separated segments, `*` for exactly one
//! segment, `>` (last only) for one or more.

use crate::error::{Error, Result};

/// One segment of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// Matches this segment exactly.
    Exact(String),
    /// `*`: any one segment.
    One,
    /// `>`: one or more segments, to the end of the topic.
    Rest,
}

/// A validated topic pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TopicPattern {
    /// The pattern as written (for `Debug`).
    #[allow(dead_code)]
    text: String,
    segments: Vec<Segment>,
}

impl TopicPattern {
    /// Parses `text`: not empty, no empty segment, `>` only as the last segment, and `*` or
    /// `>` only as a whole segment (`pay*` is refused rather than read as a prefix match).
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let invalid =
            |reason: &str| Error::InvalidConfig(format!("route pattern {text:?}: {reason}"));
        if text.is_empty() {
            return Err(invalid("must not be empty"));
        }
        if text.len() > crate::MAX_TOPIC_BYTES {
            return Err(invalid("longer than a topic may be (255 bytes)"));
        }
        let parts: Vec<&str> = text.split('.').collect();
        let last = parts.len() - 1;
        let mut segments = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let segment = match *part {
                "" => {
                    return Err(invalid(
                        "has an empty segment (two dots, or a leading or trailing dot)",
                    ));
                }
                "*" => Segment::One,
                ">" if i == last => Segment::Rest,
                ">" => return Err(invalid("`>` may only be the last segment")),
                p if p.contains(['*', '>']) => {
                    return Err(invalid("`*` and `>` must be whole segments"));
                }
                p if p.chars().any(char::is_control) => {
                    return Err(invalid("contains a control character"));
                }
                p => Segment::Exact(p.to_owned()),
            };
            segments.push(segment);
        }
        Ok(TopicPattern {
            text: text.to_owned(),
            segments,
        })
    }

    /// Whether `topic` matches.
    pub(crate) fn matches(&self, topic: &str) -> bool {
        let mut parts = topic.split('.');
        for segment in &self.segments {
            match segment {
                Segment::Rest => return parts.next().is_some_and(|p| !p.is_empty()),
                Segment::One => match parts.next() {
                    Some(p) if !p.is_empty() => {}
                    _ => return false,
                },
                Segment::Exact(s) => {
                    if parts.next() != Some(s.as_str()) {
                        return false;
                    }
                }
            }
        }
        parts.next().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::TopicPattern;

    fn m(pattern: &str, topic: &str) -> bool {
        TopicPattern::parse(pattern).unwrap().matches(topic)
    }

    #[test]
    fn exact_star_and_rest_match_as_documented() {
        assert!(m("payments.refund", "payments.refund"));
        assert!(!m("payments.refund", "payments.refunds"));
        assert!(!m("payments.refund", "payments.refund.x"));
        assert!(m("payments.*", "payments.refund"));
        assert!(!m("payments.*", "payments"));
        assert!(!m("payments.*", "payments.refund.partial"));
        assert!(m("payments.>", "payments.refund"));
        assert!(m("payments.>", "payments.refund.partial"));
        assert!(!m("payments.>", "payments"));
        assert!(m("*.refund", "orders.refund"));
        assert!(m(">", "anything.at.all"));
        assert!(!m("payments.*", "payments."));
    }

    #[test]
    fn malformed_patterns_are_refused() {
        for bad in ["", "a..b", ".a", "a.", "a.>.b", "pay*", "a.b>", "a.\n"] {
            assert!(TopicPattern::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
