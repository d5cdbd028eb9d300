//! The WAL outbox suites' common set-up: a private `wal_level = logical` cluster, migrated,
//! with the slot `pgbox_outbox`; a small pool; a quick retry policy.

use std::time::Duration;

use pgbox::{RetryPolicy, WalSlot};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::cluster::Cluster;

/// A pool of at most six connections to `url`.
pub async fn pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .unwrap()
}

/// A private cluster with `wal_level = logical`, the settings `extra` (`ALTER SYSTEM`, then a
/// restart), migrated, with the slot `pgbox_outbox`.
pub async fn logical(extra: &'static [&'static str]) -> (Cluster, PgPool, WalSlot) {
    logical_at(None, extra).await
}

/// [`logical`] on PostgreSQL `major` (`None`: the default server, or the matrix's major).
pub async fn logical_at(
    major: Option<u32>,
    extra: &'static [&'static str],
) -> (Cluster, PgPool, WalSlot) {
    let cluster = tokio::task::spawn_blocking(move || {
        let cluster = match major {
            Some(major) => Cluster::start_logical_version(major),
            None => Cluster::start_logical(),
        };
        if !extra.is_empty() {
            for setting in extra {
                cluster.psql(&format!("ALTER SYSTEM SET {setting}"));
            }
            cluster.pg_ctl(&["-m", "fast", "restart"]);
        }
        cluster
    })
    .await
    .unwrap();
    let pool = pool(&cluster.url("postgres")).await;
    pgbox::migrate(&pool).await.unwrap();
    let slot = WalSlot::new("pgbox_outbox").unwrap();
    slot.create(&pool).await.unwrap();
    (cluster, pool, slot)
}

/// Retries after 1–5 ms.
pub fn quick() -> RetryPolicy {
    RetryPolicy::new()
        .base_delay(Duration::from_millis(1))
        .max_delay(Duration::from_millis(5))
}
