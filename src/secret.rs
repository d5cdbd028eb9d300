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
    /// [`Error::InvalidConfig`] naming the variable (never its value).
    pub fn from_env(name: &str) -> Result<Secret> {
        match std::env::var(name) {
            Ok(value) if !value.is_empty() => Ok(Secret(value)),
            Ok(_) => Err(Error::InvalidConfig(format!(
                "the environment variable {name} is empty"
            ))),
            Err(std::env::VarError::NotPresent) => Err(Error::InvalidConfig(format!(
                "the environment variable {name} is not set"
            ))),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::InvalidConfig(format!(
                "the environment variable {name} is not UTF-8"
            ))),
        }
    }

    /// The contents of the file at `path`, without one trailing line break (`\n` or
    /// `\r\n`), as secrets files usually end. Unreadable, empty or not UTF-8 is
    /// [`Error::InvalidConfig`] naming the file (never its contents).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Secret> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| {
            Error::InvalidConfig(format!(
                "cannot read the secret file {}: {e}",
                path.display()
            ))
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

/// `url` with the password of its user-info part (`scheme://user:password@host`) replaced by
/// `***`; other URLs unchanged. For messages and logs that name a broker or server.
#[allow(dead_code)] // used by the transports
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The authority ends at the first '/', '?' or '#'; its user-info at the last '@'.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let (userinfo, host) = authority.split_at(at);
            match userinfo.split_once(':') {
                Some((user, _password)) => format!("{user}:***{host}"),
                None => authority.to_owned(),
            }
        }
        None => authority.to_owned(),
    };
    format!("{scheme}://{authority}{}", redact_query(tail))
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
            Some((name, _)) if is_secret_name(name) => format!("{name}=***"),
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
