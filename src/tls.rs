//! What every connection's TLS and credential checks share: whether an address is loopback
//! (credentials in clear text are refused elsewhere), and which [`TlsProblem`] a client
//! library's error chain describes.

use std::net::IpAddr;

use crate::error::TlsProblem;

/// Whether `host` names this machine: `localhost` (and `*.localhost`), a loopback address
/// (127.0.0.0/8, `::1`, IPv4-mapped loopback), or a Unix-domain socket path. A name that
/// only resolves to loopback through DNS or `/etc/hosts` is not trusted to stay there.
#[allow(dead_code)]
pub(crate) fn is_loopback(host: &str) -> bool {
    let host = host.trim();
    if host.starts_with('/') || host.starts_with('@') {
        return true; // a Unix-domain socket (a path, or an abstract name)
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let lower = bare.trim_end_matches('.').to_ascii_lowercase();
    if lower == "localhost" || lower.ends_with(".localhost") {
        return true;
    }
    match lower.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

/// The [`TlsProblem`] an error (or any error in its `source()` chain) describes, read from
/// the words rustls and OpenSSL use, or `None` when nothing in the chain is about TLS.
///
/// Text rather than types: the clients (sqlx, lapin, async-nats, librdkafka, the replication
/// client) wrap rustls's errors in their own, some as strings only.
#[allow(dead_code)]
pub(crate) fn classify(error: &(dyn std::error::Error + 'static)) -> Option<TlsProblem> {
    let mut text = String::new();
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    let mut depth = 0;
    while let Some(e) = current {
        text.push_str(&format!("{e} | {e:?} | "));
        current = e.source();
        depth += 1;
        if depth > 16 {
            break;
        }
    }
    classify_text(&text)
}

/// [`classify`] on a message alone (clients whose errors are strings).
#[allow(dead_code)]
pub(crate) fn classify_text(text: &str) -> Option<TlsProblem> {
    let t = text.to_ascii_lowercase();
    let any = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    if any(&[
        "notvalidforname",
        "not valid for name",
        "hostname mismatch",
        "certificate verify failed: hostname",
    ]) {
        Some(TlsProblem::HostnameMismatch)
    } else if any(&[
        "unknownissuer",
        "unknown issuer",
        "unable to get local issuer",
        "self-signed certificate in certificate chain",
        "self signed certificate in certificate chain",
        "unable to get issuer",
    ]) {
        Some(TlsProblem::UnknownIssuer)
    } else if any(&[
        "expired",
        "notvalidyet",
        "not valid yet",
        "certificate is not yet valid",
    ]) {
        Some(TlsProblem::Expired)
    } else if any(&[
        "certificaterequired",
        "certificate required",
        "bad certificate",
        "badcertificate",
        "unknown ca",
        "unknownca",
    ]) {
        Some(TlsProblem::ClientCertificate)
    } else if any(&[
        "server does not support tls",
        "does not support ssl",
        "server does not support ssl",
        "tls upgrade required",
        "invalidcontenttype",
        "invalid content type",
        "wrong version number",
    ]) {
        Some(TlsProblem::NotOffered)
    } else if any(&["tls", "ssl", "certificate", "handshake"]) {
        Some(TlsProblem::Other)
    } else {
        None
    }
}

/// Makes ring the process's rustls crypto provider unless one is installed already (an
/// application's own choice is kept). With the `tls` feature two providers are compiled in
/// (ring; aws-lc-rs through the replication client's tokio-rustls), so rustls cannot choose
/// one itself, and code that asks for the process default (sqlx's `verify-ca` verifier,
/// the TLS async-nats sets up itself) would panic. Called by [`connect`](crate::connect) and
/// before a NATS connection.
#[cfg(any(feature = "tls", feature = "nats"))]
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err: another thread installed one meanwhile; that one serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_addresses() {
        for host in [
            "localhost",
            "LOCALHOST.",
            "db.localhost",
            "127.0.0.1",
            "127.8.9.10",
            "::1",
            "[::1]",
            "::ffff:127.0.0.1",
            "/var/run/postgresql",
        ] {
            assert!(is_loopback(host), "{host}");
        }
        for host in [
            "db.internal",
            "10.0.0.1",
            "0.0.0.0",
            "::",
            "localhost.example.com",
            "127.0.0.1.nip.io",
            "",
        ] {
            assert!(!is_loopback(host), "{host}");
        }
    }

    #[test]
    fn tls_words_are_classified() {
        assert_eq!(
            classify_text("invalid peer certificate: UnknownIssuer"),
            Some(TlsProblem::UnknownIssuer)
        );
        assert_eq!(
            classify_text("invalid peer certificate: NotValidForName"),
            Some(TlsProblem::HostnameMismatch)
        );
        assert_eq!(
            classify_text("invalid peer certificate: Expired"),
            Some(TlsProblem::Expired)
        );
        assert_eq!(classify_text("connection refused"), None);
    }
}
