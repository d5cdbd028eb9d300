//! [`connect`]: a pool whose first connection is made at once, so that a wrong URL, a server
//! that is not there or a refused login is reported in words a person can act on, instead of
//! a pool that retries until its acquire timeout and then says "pool timed out".

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::error::{Error, Result};

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
/// The password never appears in an error.
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
    url.parse::<PgConnectOptions>().map_err(|e| {
        Error::InvalidConfig(format!(
            "the database URL cannot be read: {}",
            without_password(&e.to_string(), url)
        ))
    })
}

/// What sqlx would get wrong about libpq's multi-host failover: refused with what to do instead.
fn refuse_failover_settings(url: &str) -> Result<()> {
    const INSTEAD: &str = "Give pgbox one address that always reaches the primary: a virtual \
                           IP, a DNS name your failover manager moves, or HAProxy or PgBouncer \
                           routed to the primary (e.g. Patroni's /primary health check).";
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = before_query.split('/').next().unwrap_or("");
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
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
fn describe(options: &PgConnectOptions) -> String {
    let place = match options.get_socket() {
        Some(socket) => format!("{}", socket.display()),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    let database = options.get_database().unwrap_or(options.get_username());
    format!("{}@{place}/{database}", options.get_username())
}

fn connect_error(target: &str, e: sqlx::Error) -> Error {
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

fn without_password(text: &str, url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let password = rest
        .split_once('@')
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
}
