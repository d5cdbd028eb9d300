//! [`Secret`]: a password, token or key that pgbox holds without ever showing it.

use std::fmt;
use std::path::Path;

use crate::error::{Error, Result};

/// A credential (a password, a token, an NKey seed) given to a transport or the CLI.
///
/// Its `Debug` and `Display` print `***`, so a configuration that holds one can be logged.
/// It can come from the program, from an environment variable or from a file (a mounted
/// Kubernetes or Docker secret), so that it need not sit in a URL or on a command line.
///
/// ```
/// let secret = pgbox::Secret::new("hunter2");
/// assert_eq!(format!("{secret:?} {secret}"), "Secret(***) ***");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// A secret from a value the program already has.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value of the environment variable `name`. Missing, empty or not UTF-8 is
    /// [`Error::InvalidConfig`] naming the variable (never its value). A `name` that is not
    /// an environment variable's usual form (`UPPER_CASE`, digits, `_`) is not named either:
    /// it may be the secret itself, given where its variable's name belongs.
    pub fn from_env(name: &str) -> Result<Secret> {
        let shown = if is_usual_variable_name(name) {
            name.to_owned()
        } else {
            format!(
                "named by {} characters (the name is not shown: it is not UPPER_CASE, and may \
                 be the secret itself)",
                name.chars().count()
            )
        };
        match std::env::var(name) {
            Ok(value) if !value.is_empty() => Ok(Secret(value)),
            Ok(_) => Err(Error::InvalidConfig(format!(
                "the environment variable {shown} is empty"
            ))),
            Err(std::env::VarError::NotPresent) => Err(Error::InvalidConfig(format!(
                "the environment variable {shown} is not set"
            ))),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::InvalidConfig(format!(
                "the environment variable {shown} is not UTF-8"
            ))),
        }
    }

    /// The contents of the file at `path`, without one trailing line break (`\n` or
    /// `\r\n`), as secrets files usually end. Unreadable, empty or not UTF-8 is
    /// [`Error::InvalidConfig`] naming the file (never its contents). A path that names no
    /// file in an existing directory (`hunter2`, `ab/cd+e=`) is not named either: it may be
    /// the secret itself, given where its file's path belongs.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Secret> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| {
            let in_a_directory = path
                .parent()
                .is_some_and(|dir| !dir.as_os_str().is_empty() && dir.is_dir());
            if e.kind() == std::io::ErrorKind::NotFound && !in_a_directory {
                Error::InvalidConfig(format!(
                    "cannot read the secret file: no such file, and no such directory (the \
                     path, {} characters, is not shown: it may be the secret itself)",
                    path.as_os_str().len()
                ))
            } else {
                Error::InvalidConfig(format!(
                    "cannot read the secret file {}: {e}",
                    path.display()
                ))
            }
        })?;
        let text = String::from_utf8(bytes).map_err(|_| {
            Error::InvalidConfig(format!("the secret file {} is not UTF-8", path.display()))
        })?;
        let value = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(&text);
        if value.is_empty() {
            return Err(Error::InvalidConfig(format!(
                "the secret file {} is empty",
                path.display()
            )));
        }
        Ok(Secret(value.to_owned()))
    }

    /// The value itself, for handing to a client library. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Whether `name` has an environment variable's usual form: ASCII upper-case letters, digits
/// and `_`, not starting with a digit.
fn is_usual_variable_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// `url` with the password of its user-info part (`scheme://user:password@host`) replaced by
/// `***`, and the value of every query parameter whose name says it holds a secret; other URLs
/// unchanged. For messages and logs that name a broker or server.
///
/// It errs on the side of hiding: a password pasted into the URL without percent-encoding
/// (a `/`, `?` or `#` in it ends the authority early, so the URL is malformed) is hidden up to
/// the URL's last `@`; a URL without a scheme (`user:pw@host:5432/db`) is read as one that has
/// one; and a libpq key=value string (`host=h password=pw`) loses its secret values.
#[allow(dead_code)] // used by the transports
pub(crate) fn redact_url(url: &str) -> String {
    let (prefix, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None if !url.contains('@') && url.contains('=') => return redact_conninfo(url),
        None => (String::new(), url),
    };
    // The authority ends at the first '/', '?' or '#'; its user-info at the last '@'.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if let Some(at) = authority.rfind('@') {
        let (userinfo, host) = authority.split_at(at);
        let authority = match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***{host}"),
            None => authority.to_owned(),
        };
        return format!("{prefix}{authority}{}", redact_query(tail));
    }
    // No '@' in the authority. If it reads `user:text` where text is no port number and an
    // '@' follows later, the text is most likely the start of a password holding a '/', '?'
    // or '#' unencoded: hide everything up to the last '@'.
    let broken_userinfo = !authority.starts_with('[')
        && authority
            .split_once(':')
            .is_some_and(|(_, after)| !after.bytes().all(|b| b.is_ascii_digit()));
    match rest.rfind('@') {
        Some(at) if broken_userinfo => {
            let user = authority.split_once(':').map_or("", |(user, _)| user);
            let after = &rest[at..]; // "@host.../..."
            let end = after.find(['/', '?', '#']).unwrap_or(after.len());
            let (host, tail) = after.split_at(end);
            format!("{prefix}{user}:***{host}{}", redact_query(tail))
        }
        _ => format!("{prefix}{authority}{}", redact_query(tail)),
    }
}

/// A libpq key=value connection string with the values of its secret settings replaced by
/// `***` (a quoted value, `'...'` with `\\'` escapes, as one value).
fn redact_conninfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if c != '=' {
            continue;
        }
        let before = out[..out.len() - 1].trim_end();
        let key_start = before.rfind(char::is_whitespace).map_or(0, |i| i + 1);
        let secret = is_secret_name(&before[key_start..]);
        while let Some(&c) = chars.peek() {
            if !c.is_whitespace() {
                break;
            }
            out.push(c);
            chars.next();
        }
        // The value: quoted (to the closing quote) or up to the next whitespace.
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            value.push(chars.next().unwrap_or('\''));
            let mut escaped = false;
            for c in chars.by_ref() {
                value.push(c);
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '\'' {
                    break;
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push_str(if secret { "***" } else { &value });
    }
    out
}

/// `tail` (a URL's path, query and fragment) with the value of every query parameter whose
/// name says it holds a secret (`password`, `sasl.password`, `token`, ...) replaced by `***`.
fn redact_query(tail: &str) -> String {
    let Some((path, rest)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let (query, fragment) = match rest.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (rest, None),
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_name(&crate::percent::decode_query(name)) => {
                format!("{name}=***")
            }
            _ => pair.to_owned(),
        })
        .collect();
    let mut out = format!("{path}?{}", pairs.join("&"));
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(f);
    }
    out
}

/// Whether a setting's name says its value is a secret.
#[allow(dead_code)]
pub(crate) fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password",
        "passwd",
        "secret",
        "token",
        "nkey",
        "seed",
        "sslpassword",
        "private",
    ]
    .iter()
    .any(|w| n.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_password_only() {
        assert_eq!(
            redact_url("amqps://app:s3cr%40t@mq.example.com:5671/%2f"),
            "amqps://app:***@mq.example.com:5671/%2f"
        );
        assert_eq!(redact_url("nats://u:p@a@h:4222"), "nats://u:***@h:4222");
        assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
        assert_eq!(redact_url("nats://token@h:4222"), "nats://token@h:4222");
        assert_eq!(redact_url("h:4222"), "h:4222");
        assert_eq!(
            redact_url("postgres://h/db?user=a&password=s3cret&sslmode=require#x"),
            "postgres://h/db?user=a&password=***&sslmode=require#x"
        );
        assert_eq!(
            redact_url("kafka://h?sasl.password=p&x=1"),
            "kafka://h?sasl.password=***&x=1"
        );
        assert_eq!(
            redact_url("postgres://u:pw@h/db?x=a@b"),
            "postgres://u:***@h/db?x=a@b"
        );
    }

    #[test]
    fn malformed_and_scheme_less_urls_lose_their_password_too() {
        for (url, secret) in [
            ("amqp://app:ab/cd+e=@h:5672/%2f", "ab/cd"),
            ("amqp://app:ab?cd@h:5672/%2f", "ab?cd"),
            ("amqp://app:ab#cd@h:5672/%2f", "ab#cd"),
            ("postgres://app:ab/cd@h/db?x=1", "ab/cd"),
            ("app:s3cret@h:5432/db", "s3cret"),
            ("postgres://h/db?pass%77ord=s3cret", "s3cret"),
            ("postgres://h/db?PASSWORD=s3cret", "s3cret"),
            ("host=h password=s3cret user=u", "s3cret"),
            ("host=h password='s3 cr\\'et' user=u", "cr"),
            ("host=h password = s3cret", "s3cret"),
        ] {
            let redacted = redact_url(url);
            assert!(!redacted.contains(secret), "{url} -> {redacted}");
        }
        assert_eq!(
            redact_url("amqp://app:ab/cd@h:5672/%2f"),
            "amqp://app:***@h:5672/%2f"
        );
        assert_eq!(
            redact_url("host=h password=pw user=u"),
            "host=h password=*** user=u"
        );
        // Nothing to hide: unchanged.
        for url in [
            "postgres://h:5432/db?x=a@b",
            "postgres://[::1]:5432/db?x=a@b",
            "postgres://u@[::1]:5432/db",
            "host=h user=u",
        ] {
            assert_eq!(redact_url(url), url);
        }
    }

    #[test]
    fn files_and_variables() {
        let dir = std::env::temp_dir().join(format!("pgbox-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "p@ss word\r\n").unwrap();
        assert_eq!(Secret::from_file(&file).unwrap().expose(), "p@ss word");
        std::fs::write(&file, "\n").unwrap();
        let err = Secret::from_file(&file).unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
        let missing = Secret::from_file(dir.join("none")).unwrap_err().to_string();
        assert!(missing.contains("cannot read"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = Secret::from_env("PGBOX_SECRET_TEST_SURELY_UNSET").unwrap_err();
        assert!(err.to_string().contains("not set"));
    }
}
