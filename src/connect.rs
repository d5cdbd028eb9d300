//! [`connect`]: a pool whose first connection is made at once, so that a wrong URL, a server
//! that is not there or a refused login is reported in words a person can act on, instead of
//! a pool that retries until its acquire timeout and then says "pool timed out".

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::error::{Error, Result, TlsProblem};

/// How long the first connection may take before [`connect`] gives up (a server that accepts
/// TCP but never answers, a firewall that drops packets).
pub const FIRST_CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a pool on `url` with `options`, after one direct connection that proves the server
/// is there and accepts the login.
///
/// - A URL whose scheme is not `postgres://` or `postgresql://` is refused
///   ([`Error::InvalidConfig`]); sqlx would otherwise read `mysql://…` or `http://…` as
///   PostgreSQL connection settings.
/// - So are libpq's failover settings, which sqlx does not implement: a list of hosts
///   (`postgres://db1,db2/app`, which sqlx would look up as one host name) and
///   `target_session_attrs` other than `any` (which sqlx ignores, so it would connect to a
///   standby as readily as to the primary). After a failover, clients must reach the new
///   primary through one address that follows it: see the guide's "Failover" chapter (guide/src/failover.md).
/// - Nothing listening is reported at once as [`Error::Connect`] with the address ("connection
///   refused"), not after the pool's acquire timeout.
/// - A refused login, a missing database and other server errors keep the server's message
///   and SQLSTATE, without the server's source-file position.
///
/// - A login the server refuses (wrong password, no such role, no `pg_hba.conf` line:
///   SQLSTATE 28P01, 28000) is [`Error::Authentication`]; a certificate that does not verify,
///   a server without TLS when TLS is required, or a client certificate the server wants
///   and did not get is [`Error::Tls`] with its [`TlsProblem`](crate::TlsProblem). Both are
///   returned after the one attempt, never retried.
///
/// The password never appears in an error.
///
/// # TLS
///
/// The URL's `sslmode` (or `PGSSLMODE`) decides, as in libpq: `disable`, `allow` and `prefer`
/// (the default: TLS when the server offers it), `require` (TLS, certificate not checked),
/// `verify-ca` (signed by a trusted authority), `verify-full` (and issued for the host
/// dialled, a DNS name or an IP address). `sslrootcert` (`PGSSLROOTCERT`) names a PEM file of
/// authorities trusted in addition to the system's; `sslrootcert=system` means the
/// system's alone and, as in libpq, makes `verify-full` the default and refuses weaker
/// modes. `sslcert`/`sslkey` (`PGSSLCERT`/`PGSSLKEY`) give a client certificate. The
/// password comes from the URL, `PGPASSWORD` or the `.pgpass` file (`PGPASSFILE`).
///
/// TLS needs the `tls` feature (rustls; the system's root certificates). Without it,
/// `require`, `verify-ca` and `verify-full` are refused before any connection
/// ([`Error::Tls`] with [`TlsProblem::NotBuilt`](crate::TlsProblem::NotBuilt)), and `prefer`
/// connects in plain text. The pool's connections, and every connection pgbox makes from
/// them (the relays' sessions and replication connection, LISTEN, the janitor), use the
/// same settings.
///
/// ```no_run
/// # async fn f() -> Result<(), pgbox::Error> {
/// let pool = pgbox::connect(
///     "postgres://app@db.internal/orders",
///     sqlx::postgres::PgPoolOptions::new().max_connections(8),
/// )
/// .await?;
/// # Ok(()) }
/// ```
pub async fn connect(url: &str, options: PgPoolOptions) -> Result<PgPool> {
    let connect_options = parse_url(url)?;
    #[cfg(feature = "tls")]
    crate::tls::ensure_crypto_provider();
    let target = describe(&connect_options);
    let probe = tokio::time::timeout(FIRST_CONNECTION_TIMEOUT, connect_options.connect()).await;
    match probe {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
        }
        Ok(Err(e)) => return Err(connect_error(&target, e)),
        Err(_) => {
            return Err(Error::Connect {
                target,
                reason: format!(
                    "no answer within {} s (is the host right, and the port open?)",
                    FIRST_CONNECTION_TIMEOUT.as_secs()
                ),
            });
        }
    }
    options
        .connect_with(connect_options)
        .await
        .map_err(|e| connect_error(&target, e))
}

/// `url` as connection options, if it is a PostgreSQL URL.
pub(crate) fn parse_url(url: &str) -> Result<PgConnectOptions> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("postgres" | "postgresql") => {}
        Some(other) => {
            return Err(Error::InvalidConfig(format!(
                "the database URL's scheme is {other:?}: pgbox needs a PostgreSQL URL \
                 (postgres://user@host:port/database or postgresql://…)"
            )));
        }
        None => {
            return Err(Error::InvalidConfig(
                "the database URL has no scheme: write it as postgres://user@host:port/database"
                    .to_owned(),
            ));
        }
    }
    refuse_failover_settings(url)?;
    let options = url.parse::<PgConnectOptions>().map_err(|e| {
        Error::InvalidConfig(format!(
            "the database URL cannot be read: {}",
            without_password(&e.to_string(), url)
        ))
    })?;
    let options = system_roots(url, options)?;
    refuse_tls_not_built(&options, "")?;
    #[cfg(feature = "tls")]
    check_certificate_files(url, &options)?;
    Ok(options)
}

/// The URL's (or the environment's) `sslrootcert`, `sslcert` and `sslkey` files, read and
/// parsed before any connection when TLS may be used: a file that is missing, a directory,
/// empty, or not PEM is [`Error::Tls`] with [`TlsProblem::BadFile`] naming the setting and
/// the file (sqlx would report a missing file as "no such socket or host", an empty root
/// file as an unknown issuer, a bad key as a configuration error).
#[cfg(feature = "tls")]
fn check_certificate_files(url: &str, options: &PgConnectOptions) -> Result<()> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    if matches!(
        options.get_ssl_mode(),
        PgSslMode::Disable | PgSslMode::Allow
    ) {
        return Ok(());
    }
    let bad = |name: &str, path: &str, why: String| Error::Tls {
        target: describe(options),
        problem: TlsProblem::BadFile,
        reason: format!("{name} file {path:?} {why}"),
    };
    let certificates = |name: &str, path: &str| -> Result<()> {
        let read = CertificateDer::pem_file_iter(path)
            .map_err(|e| bad(name, path, format!("cannot be read: {e}")))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| bad(name, path, format!("is not PEM certificates: {e}")))?;
        if read.is_empty() {
            return Err(bad(name, path, "holds no PEM certificate".to_owned()));
        }
        Ok(())
    };
    if let Some(root) = setting(url, ROOT_CERT)
        && root != "system"
    {
        certificates("sslrootcert", &root)?;
    }
    if let Some(cert) = setting(url, CLIENT_CERT) {
        certificates("sslcert", &cert)?;
    }
    if let Some(key) = setting(url, CLIENT_KEY) {
        // The key's text never goes into the error: only the parser's kind of failure.
        PrivateKeyDer::from_pem_file(&key).map_err(|e| {
            let why = match e {
                rustls::pki_types::pem::Error::Io(io) => format!("cannot be read: {io}"),
                rustls::pki_types::pem::Error::NoItemsFound => {
                    "holds no PEM private key".to_owned()
                }
                _ => "is not a PEM private key".to_owned(),
            };
            bad("sslkey", &key, why)
        })?;
    }
    Ok(())
}

/// A TLS setting: the names sqlx reads in a URL's query, and libpq's environment variable.
type Setting = (&'static [&'static str], &'static str);
const ROOT_CERT: Setting = (&["sslrootcert", "ssl-root-cert", "ssl-ca"], "PGSSLROOTCERT");
#[cfg(feature = "tls")]
const CLIENT_CERT: Setting = (&["sslcert", "ssl-cert"], "PGSSLCERT");
#[cfg(feature = "tls")]
const CLIENT_KEY: Setting = (&["sslkey", "ssl-key"], "PGSSLKEY");

/// `setting`'s value: the URL's, else the environment's.
fn setting(url: &str, (keys, env): Setting) -> Option<String> {
    query_value(url, keys).or_else(|| std::env::var(env).ok())
}

/// The URL's last value of `key` (percent-decoded), if it has one.
fn query_value(url: &str, keys: &[&str]) -> Option<String> {
    let query = url.split_once('?')?.1;
    let query = query.split('#').next().unwrap_or(query);
    query
        .split('&')
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            keys.contains(&key).then_some(value)
        })
        .next_back()
        .map(crate::percent::decode_query)
}

/// libpq's `sslrootcert=system` (URL or `PGSSLROOTCERT`): the system's roots alone, which sqlx
/// would read as a file named `system`. Without an `sslmode` it means `verify-full`; a weaker
/// one is refused, as libpq does.
fn system_roots(url: &str, options: PgConnectOptions) -> Result<PgConnectOptions> {
    if setting(url, ROOT_CERT).as_deref() != Some("system") {
        return Ok(options);
    }
    let mode_given = query_value(url, &["sslmode", "ssl-mode"]).is_some()
        || std::env::var_os("PGSSLMODE").is_some();
    // An empty PEM bundle: sqlx adds no authority to the system's.
    let options = options.ssl_root_cert_from_pem(Vec::new());
    if !mode_given {
        return Ok(options.ssl_mode(PgSslMode::VerifyFull));
    }
    match options.get_ssl_mode() {
        PgSslMode::VerifyFull => Ok(options),
        weak => Err(Error::InvalidConfig(format!(
            "the database URL sets sslrootcert=system with sslmode={}: the system's \
             authorities vouch for any public name, so only verify-full is accepted with them \
             (as in libpq); drop sslmode or set sslmode=verify-full",
            ssl_mode_name(weak)
        ))),
    }
}

/// `mode` as written in a URL.
pub(crate) fn ssl_mode_name(mode: PgSslMode) -> &'static str {
    match mode {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    }
}

/// Without the `tls` feature, an `sslmode` that needs TLS is refused before any connection
/// (sqlx would only find out on connecting). `connection` names the connection, if not the
/// pool's (" for …").
#[cfg(not(feature = "tls"))]
pub(crate) fn refuse_tls_not_built(options: &PgConnectOptions, connection: &str) -> Result<()> {
    let mode = options.get_ssl_mode();
    if matches!(
        mode,
        PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull
    ) {
        return Err(Error::Tls {
            target: describe(options),
            problem: TlsProblem::NotBuilt,
            reason: format!(
                "sslmode={} needs TLS, and this build of pgbox has none{connection}: enable \
                 pgbox's `tls` feature",
                ssl_mode_name(mode)
            ),
        });
    }
    Ok(())
}

#[cfg(feature = "tls")]
fn refuse_tls_not_built(_options: &PgConnectOptions, _connection: &str) -> Result<()> {
    Ok(())
}

/// What sqlx would get wrong about libpq's multi-host failover: refused with what to do instead.
fn refuse_failover_settings(url: &str) -> Result<()> {
    const INSTEAD: &str = "Give pgbox one address that always reaches the primary: a virtual \
                           IP, a DNS name your failover manager moves, or HAProxy or PgBouncer \
                           routed to the primary (e.g. Patroni's /primary health check).";
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    // The hosts follow the last '@' (a password may hold '/' or ',' unencoded).
    let hosts = before_query
        .rsplit_once('@')
        .map_or(before_query, |(_, hosts)| hosts)
        .split('/')
        .next()
        .unwrap_or("");
    if hosts.contains(',') {
        return Err(Error::InvalidConfig(format!(
            "the database URL lists several hosts ({hosts}): sqlx, which pgbox connects with, \
             takes one host and has no failover between hosts. {INSTEAD}"
        )));
    }
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key == "target_session_attrs" && !value.eq_ignore_ascii_case("any") {
            return Err(Error::InvalidConfig(format!(
                "the database URL sets target_session_attrs={value}, which sqlx ignores: it \
                 would connect to a standby as readily as to the primary (where pgbox's writes \
                 fail with a retryable read-only error). {INSTEAD}"
            )));
        }
    }
    Ok(())
}

/// "user@host:port/database" (or the socket path), never the password.
pub(crate) fn describe(options: &PgConnectOptions) -> String {
    let place = match options.get_socket() {
        Some(socket) => format!("{}", socket.display()),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    let database = options.get_database().unwrap_or(options.get_username());
    format!("{}@{place}/{database}", options.get_username())
}

/// A failed first connection of [`connect`] to `target` as a typed error: a refused login is
/// [`Error::Authentication`], a certificate failure [`Error::Tls`], the rest
/// [`Error::Connect`]. (Connections pgbox opens outside the pool: [`session_connect_error`].)
pub(crate) fn connect_error(target: &str, e: sqlx::Error) -> Error {
    if let Some(typed) = refusal(target, &e) {
        return typed;
    }
    let reason = match &e {
        sqlx::Error::Io(io) => match io.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                "connection refused (nothing is listening there: is PostgreSQL running, on that port?)"
                    .to_owned()
            }
            std::io::ErrorKind::NotFound => "no such socket or host".to_owned(),
            _ => io.to_string(),
        },
        sqlx::Error::Database(db) => crate::error::database_message(db.as_ref()),
        sqlx::Error::PoolTimedOut => "timed out waiting for a connection".to_owned(),
        other => other.to_string(),
    };
    Error::Connect {
        target: target.to_owned(),
        reason,
    }
}

/// A refused login ([`Error::Authentication`]) or a certificate failure ([`Error::Tls`]),
/// if `e` is one.
fn refusal(target: &str, e: &sqlx::Error) -> Option<Error> {
    if let sqlx::Error::Database(db) = e {
        let message = crate::error::database_message(db.as_ref());
        match db.code().as_deref() {
            // pg_hba's `cert` method (or `clientcert=verify-*`) without a valid client
            // certificate.
            Some("28000") if db.message().contains("certificate") => Some(Error::Tls {
                target: target.to_owned(),
                problem: TlsProblem::ClientCertificate,
                reason: message,
            }),
            Some("28P01" | "28000") => Some(Error::Authentication {
                target: target.to_owned(),
                reason: message,
            }),
            _ => None,
        }
    } else {
        crate::tls::classify(e).map(|problem| Error::Tls {
            target: target.to_owned(),
            problem,
            reason: tls_reason(problem, e),
        })
    }
}

/// A connection pgbox opens outside the pool (the WAL relay's reader, LISTEN, the janitor's
/// lock) failed: a refused login or certificate is typed as in [`connect_error`]; anything
/// else (the server away) stays the database error it was, which the callers' outage
/// handling reads.
pub(crate) fn session_connect_error(options: &PgConnectOptions, e: sqlx::Error) -> Error {
    refusal(&describe(options), &e).unwrap_or_else(|| Error::from(e))
}

/// The client's words for a TLS failure, with what to do about it.
fn tls_reason(problem: TlsProblem, e: &sqlx::Error) -> String {
    let advice = match problem {
        TlsProblem::NotOffered => {
            "; the server has ssl = off: turn it on, or connect with sslmode=prefer or disable"
        }
        TlsProblem::UnknownIssuer => {
            "; trust the authority that signed the server's certificate with sslrootcert=<PEM file>"
        }
        TlsProblem::HostnameMismatch => {
            "; dial a name the certificate lists (its subjectAltName), or use sslmode=verify-ca"
        }
        TlsProblem::Expired => "; the server's certificate must be renewed",
        TlsProblem::ClientCertificate => "; give sslcert and sslkey the server accepts",
        _ => "",
    };
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    let mut depth = 0;
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
        depth += 1;
        if depth > 8 {
            break;
        }
    }
    format!("{text}{advice}")
}

fn without_password(text: &str, url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let password = rest
        .rsplit_once('@')
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, password)| password);
    match password {
        Some(password) if !password.is_empty() => text.replace(password, "***"),
        _ => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_postgres_urls_are_accepted() {
        for bad in [
            "mysql://root@localhost/db",
            "http://localhost:5432/db",
            "localhost:5432",
            "",
        ] {
            assert!(
                matches!(parse_url(bad), Err(Error::InvalidConfig(_))),
                "{bad:?} accepted"
            );
        }
        for good in [
            "postgres://u@h/d",
            "postgresql://u:p@h:5433/d",
            "POSTGRES://u@h/d",
        ] {
            assert!(parse_url(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn libpq_failover_settings_are_refused_with_advice() {
        for bad in [
            "postgres://app@db1:5432,db2:5432/orders",
            "postgres://app:pw@db1,db2/orders",
            "postgres://app@db/orders?target_session_attrs=read-write",
            "postgres://app@db/orders?sslmode=disable&target_session_attrs=primary",
        ] {
            match parse_url(bad) {
                Err(Error::InvalidConfig(message)) => {
                    assert!(message.contains("virtual IP"), "{message}");
                    assert!(!message.contains("pw"), "{message}");
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        for good in [
            "postgres://app@db/orders?target_session_attrs=any",
            "postgres://a%2Cb@db/orders",
            "postgres://app@db/orders?options=-c%20search_path%3Da,b",
        ] {
            assert!(parse_url(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn the_target_never_shows_the_password() {
        let options = parse_url("postgres://app:s3cret@db.internal:6543/orders").unwrap();
        assert_eq!(describe(&options), "app@db.internal:6543/orders");
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn tls_sslmodes_without_the_feature_are_refused_before_connecting() {
        for mode in ["require", "verify-ca", "verify-full"] {
            // Port 1: a connection attempt would fail differently; parse_url never makes one.
            let url = format!("postgres://app:s3cret@db.internal:1/orders?sslmode={mode}");
            match parse_url(&url) {
                Err(Error::Tls {
                    problem: TlsProblem::NotBuilt,
                    target,
                    reason,
                }) => {
                    assert!(reason.contains("`tls` feature"), "{reason}");
                    assert!(!reason.contains("s3cret") && !target.contains("s3cret"));
                }
                other => panic!("{mode}: {other:?}"),
            }
        }
        for mode in ["disable", "allow", "prefer"] {
            let url = format!("postgres://app@db/orders?sslmode={mode}");
            assert!(parse_url(&url).is_ok(), "{mode}");
        }
    }

    #[test]
    fn sslrootcert_system_means_the_system_roots_and_verify_full() {
        let options = parse_url("postgres://app@db/orders?sslrootcert=system");
        #[cfg(feature = "tls")]
        {
            let options = options.unwrap();
            assert!(matches!(options.get_ssl_mode(), PgSslMode::VerifyFull));
            // Not a file named "system" any more.
            assert!(!format!("{options:?}").contains("\"system\""));
        }
        #[cfg(not(feature = "tls"))]
        assert!(matches!(
            options,
            Err(Error::Tls {
                problem: TlsProblem::NotBuilt,
                ..
            })
        ));
        for weak in ["require", "verify-ca", "prefer"] {
            let url = format!("postgres://app@db/orders?sslrootcert=system&sslmode={weak}");
            match parse_url(&url) {
                Err(Error::InvalidConfig(m)) => assert!(m.contains("verify-full"), "{m}"),
                other => panic!("{weak}: {other:?}"),
            }
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn unreadable_certificate_files_are_bad_file_before_connecting() {
        let dir = std::env::temp_dir().join(format!("pgbox-connect-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, b"").unwrap();
        let key = dir.join("bad.key");
        std::fs::write(
            &key,
            b"-----BEGIN PRIVATE KEY-----\nk3y-s3cret!!\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        // Port 1: nothing is dialled, the files are refused first.
        let base = "postgres://app:s3cret@db.internal:1/orders?sslmode=verify-full";
        for query in [
            format!("sslrootcert={}", dir.join("missing.pem").display()),
            format!("sslrootcert={}", dir.display()),
            format!("sslrootcert={}", empty.display()),
            format!("sslcert={}&sslkey={}", empty.display(), key.display()),
        ] {
            match parse_url(&format!("{base}&{query}")) {
                Err(Error::Tls {
                    problem: TlsProblem::BadFile,
                    reason,
                    target,
                }) => {
                    assert!(
                        !reason.contains("s3cret") && !target.contains("s3cret"),
                        "{reason}"
                    );
                }
                other => panic!("{query}: {other:?}"),
            }
        }
        // disable never reads them.
        let off = format!(
            "postgres://app@db/orders?sslmode=disable&sslrootcert={}",
            empty.display()
        );
        assert!(parse_url(&off).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
