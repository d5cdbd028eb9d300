//! LISTEN connections for relays and consumers.

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};

use std::time::Duration;

use crate::error::{DbErrorKind, Error, Result};

/// A listener on `channel` over a connection of its own, made from `pool`'s connect options.
///
/// `PgListener::connect_with(pool)` would hold one of the pool's connections for as long as
/// it lives; a relay or consumer given a small pool could then starve itself.
pub(crate) async fn listen(pool: &PgPool, channel: &str) -> Result<PgListener> {
    let dedicated = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut listener = PgListener::connect_with(&dedicated)
        .await
        .map_err(|e| crate::connect::session_connect_error(&pool.connect_options(), e))?;
    listener.listen(channel).await?;
    Ok(listener)
}

/// Takes a relay's asleep lock, `pg_advisory_lock(class, hashtext(name))`, on its LISTEN
/// connection, waiting at most `timeout` for producers in flight (they hold it shared until
/// they commit). `Ok(false)` if they did not commit within it. Once it is held, producers
/// that commit notify; notifications buffered before are dropped (the caller reads after
/// taking the lock, which covers them).
pub(crate) async fn take_asleep_lock(
    listener: &mut PgListener,
    class: i32,
    name: &str,
    timeout: Duration,
) -> Result<bool> {
    sqlx::query("SELECT pg_catalog.set_config('lock_timeout', $1, false)")
        .bind(format!("{}ms", timeout.as_millis().max(1)))
        .execute(&mut *listener)
        .await?;
    let locked = sqlx::query("SELECT pg_catalog.pg_advisory_lock($1, pg_catalog.hashtext($2))")
        .bind(class)
        .bind(name)
        .execute(&mut *listener)
        .await;
    if let Err(e) = locked {
        let e = Error::from(e);
        return match e.db_kind() {
            Some(DbErrorKind::LockTimeout) => Ok(false),
            _ => Err(e),
        };
    }
    while listener.next_buffered().is_some() {}
    Ok(true)
}

/// Releases what [`take_asleep_lock`] took: producers stop notifying.
pub(crate) async fn release_asleep_lock(
    listener: &mut PgListener,
    class: i32,
    name: &str,
) -> Result<()> {
    sqlx::query("SELECT pg_catalog.pg_advisory_unlock($1, pg_catalog.hashtext($2))")
        .bind(class)
        .bind(name)
        .execute(&mut *listener)
        .await?;
    Ok(())
}
