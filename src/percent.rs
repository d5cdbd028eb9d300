//! Percent-decoding of the URL parts pgbox reads itself (query parameters' names and values,
//! a NATS URL's user-info), as the URL parsers that will read them do.

/// `text` with its `%XX` escapes decoded; a `%` not followed by two hex digits stays as it
/// is. In a query (`plus_is_space`), `+` is a space, as `application/x-www-form-urlencoded`
/// and sqlx's URL parser read it; in a user-info part it is a plus.
pub(crate) fn decode(text: &str, plus_is_space: bool) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                i += 3;
            }
            (b'+', _, _) if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// A query parameter's name or value decoded, bytes that are not UTF-8 replaced.
pub(crate) fn decode_query(text: &str) -> String {
    String::from_utf8_lossy(&decode(text, true)).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_pluses_and_stray_percents() {
        assert_eq!(decode_query("a%2Fb+c%zz%4"), "a/b c%zz%4");
        assert_eq!(decode_query("db%6Eame"), "dbname");
        assert_eq!(decode("p%40ss+w%zz%4", false), b"p@ss+w%zz%4");
        assert_eq!(decode("%ff%FF%", false), [0xff, 0xff, b'%']);
        assert_eq!(decode_query("%ff"), "\u{fffd}");
    }
}
