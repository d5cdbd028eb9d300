//! LISTEN connections for relays and consumers.

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};

use crate::error::Result;

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
    let mut listener = PgListener::connect_with(&dedicated).await?;
    listener.listen(channel).await?;
    Ok(listener)
}
