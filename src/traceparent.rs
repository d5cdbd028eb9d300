//! The W3C `traceparent` header: its name and its syntax, shared by the outbox (which stamps
//! and continues it) and the OpenTelemetry bridge (which joins it). A leaf: it depends on
//! neither.

/// The header name.
pub const TRACEPARENT: &str = "traceparent";

/// The W3C header carrying vendor-specific trace state beside `traceparent`.
#[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
pub(crate) const TRACESTATE: &str = "tracestate";

/// The fields of a valid version-00 `traceparent`, as lowercase hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Traceparent<'a> {
    /// 32 hex digits, not all zero.
    pub(crate) trace_id: &'a str,
    /// 16 hex digits, not all zero.
    #[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
    pub(crate) parent_id: &'a str,
    /// 2 hex digits.
    pub(crate) flags: &'a str,
}

/// Parses a version-00 `traceparent`: four dash-separated fields of lowercase hex, 2-32-16-2
/// digits, with non-zero ids. `None` for anything else. One parser for every reader, so a
/// header is joined exactly when the outbox would continue it.
pub(crate) fn parse(header: &str) -> Option<Traceparent<'_>> {
    let mut parts = header.split('-');
    let (version, trace_id, parent_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    let valid = version == "00"
        && parts.next().is_none()
        && hex(trace_id, 32)
        && nonzero(trace_id)
        && hex(parent_id, 16)
        && nonzero(parent_id)
        && hex(flags, 2);
    valid.then_some(Traceparent {
        trace_id,
        parent_id,
        flags,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_version_00_and_refuses_the_rest() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parsed = parse(ok).unwrap();
        assert_eq!(parsed.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parsed.parent_id, "00f067aa0ba902b7");
        assert_eq!(parsed.flags, "01");
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
