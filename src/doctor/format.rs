//! Numbers and durations as the report's messages write them.

use std::time::Duration;

/// A duration as a PostgreSQL setting value accepts it: whole seconds, at least one.
pub(super) fn postgres_interval(d: Duration) -> String {
    format!("{}s", d.as_secs().max(1))
}

pub(super) fn human_duration(secs: f64) -> String {
    let s = secs.max(0.0);
    let whole = s as u64;
    if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{}m {:02}s", whole / 60, whole % 60)
    } else if s < 86_400.0 {
        format!("{}h {:02}m", whole / 3600, whole % 3600 / 60)
    } else {
        format!("{}d {:02}h", whole / 86_400, whole % 86_400 / 3600)
    }
}

pub(super) fn human_bytes(bytes: i64) -> String {
    let b = bytes.max(0) as f64;
    if b < 1024.0 {
        format!("{bytes} B")
    } else if b < 1024.0 * 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else if b < 1024.0 * 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.1} GiB", b / (1024.0 * 1024.0 * 1024.0))
    }
}

pub(super) fn group_digits(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
