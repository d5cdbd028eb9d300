//! Replication: whether a failover can lose messages pgbox already acknowledged, and whether
//! this server can take pgbox's writes at all.
//!
//! pgbox's guarantees hold on one server's committed history. A failover replaces that
//! history with the standby's: with asynchronous replication, the commits the standby had
//! not received yet are gone (enqueued messages, inbox records, the business rows with them),
//! although their producers were told they committed.

use super::*;

/// `synchronous_commit` values under which a commit waits for a synchronous standby.
const WAITS_FOR_STANDBY: [&str; 3] = ["on", "remote_write", "remote_apply"];

impl Doctor {
    pub(super) async fn check_replication(&self, conn: &mut PgConnection) -> Result<Finding> {
        // Without pg_read_all_stats (or pg_monitor), pg_stat_replication still has one row per
        // standby, with everything but the pid NULL: the count holds, sync_state is unknown.
        let row = sqlx::query(
            "SELECT pg_catalog.pg_is_in_recovery(), \
                    pg_catalog.current_setting('synchronous_standby_names'), \
                    pg_catalog.current_setting('synchronous_commit'), \
                    pg_catalog.count(r.pid), \
                    pg_catalog.count(r.pid) FILTER (WHERE r.sync_state IN ('sync', 'quorum')), \
                    pg_catalog.count(r.sync_state), \
                    coalesce(pg_catalog.string_agg(coalesce(r.application_name, '?') || ' (' \
                        || coalesce(r.sync_state, 'unknown') || ')', ', ' \
                        ORDER BY r.application_name), '') \
             FROM (SELECT 1) one LEFT JOIN pg_catalog.pg_stat_replication r ON true",
        )
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let in_recovery: bool = row.try_get(0)?;
        let standby_names: String = row.try_get(1)?;
        let synchronous_commit: String = row.try_get(2)?;
        let standbys: i64 = row.try_get(3)?;
        let synchronous: i64 = row.try_get(4)?;
        let states_visible: i64 = row.try_get(5)?;
        let listed: String = row.try_get(6)?;
        let details = json!({
            "in_recovery": in_recovery,
            "standbys": standbys,
            "synchronous_standbys": if states_visible > 0 { Some(synchronous) } else { None },
            "synchronous_standby_names": standby_names,
            "synchronous_commit": synchronous_commit,
        });

        if in_recovery {
            return Ok(Finding::new(
                Severity::Critical,
                Code::ServerIsStandby,
                "this server is a standby (pg_is_in_recovery() is true): it only allows reads, so \
                 every enqueue, inbox claim, relay round and queue receive fails here with a \
                 read-only error (DbErrorKind::ReadOnly; retryable, but retrying on this server \
                 never succeeds)"
                    .to_owned(),
                "Point pgbox at the primary. After a failover, clients must reach the promoted \
                 server: sqlx connects to the one host of its URL (no multi-host URLs, no \
                 target_session_attrs), so give pgbox an address that follows the primary (a \
                 virtual IP, a DNS name your failover manager updates, HAProxy or PgBouncer \
                 routed to the primary, e.g. Patroni's /primary health check). If this server \
                 should be the primary, promote it (`pg_ctl promote`, or SELECT pg_promote())."
                    .to_owned(),
            )
            .details(details));
        }
        if standbys == 0 {
            return Ok(Finding::new(
                Severity::Ok,
                Code::ReplicationOk,
                "no standby streams from this server: there is nothing to fail over to, so no \
                 failover can lose a commit (a crash waits for this server to restart, which \
                 keeps every acknowledged commit as long as fsync is on)"
                    .to_owned(),
                "Nothing to do if running without a standby is your choice. With one, make it \
                 synchronous (synchronous_standby_names, synchronous_commit = on or \
                 remote_apply), or a failover loses the commits it had not received yet."
                    .to_owned(),
            )
            .details(details));
        }
        let waits = WAITS_FOR_STANDBY.contains(&synchronous_commit.as_str());
        if standby_names.trim().is_empty() || !waits {
            let why = if standby_names.trim().is_empty() {
                "synchronous_standby_names is empty".to_owned()
            } else {
                format!(
                    "synchronous_commit is '{synchronous_commit}' in this session (a commit does \
                     not wait for a standby)"
                )
            };
            return Ok(Finding::new(
                Severity::Warning,
                Code::AsyncReplication,
                format!(
                    "{standbys} standby(s) stream from this server ({listed}), asynchronously: \
                     {why}. A failover to one of them loses the commits it had not received yet \
                     (messages enqueued and acknowledged to their producers, with their business \
                     rows; consumed messages come back and are processed again)"
                ),
                "If losing the last moments of acknowledged messages on a failover is not \
                 acceptable, make a standby synchronous: ALTER SYSTEM SET \
                 synchronous_standby_names = 'FIRST 1 (<standby application_name>)'; ALTER \
                 SYSTEM SET synchronous_commit = 'remote_apply' (or 'on'); SELECT \
                 pg_reload_conf(); and fail over only to a standby pg_stat_replication lists as \
                 sync. synchronous_commit can also be set per role or database: set it where \
                 pgbox's role connects."
                    .to_owned(),
            )
            .details(details));
        }
        if states_visible > 0 && synchronous == 0 {
            return Ok(Finding::new(
                Severity::Warning,
                Code::AsyncReplication,
                format!(
                    "synchronous_standby_names is '{standby_names}', but none of the \
                     {standbys} connected standby(s) is synchronous ({listed}): every commit \
                     waits until one named there connects"
                ),
                "Check that the standby's application_name (in its primary_conninfo) matches \
                 synchronous_standby_names, and that it is connected and streaming."
                    .to_owned(),
            )
            .details(details));
        }
        Ok(Finding::new(
            Severity::Ok,
            Code::ReplicationOk,
            format!(
                "{standbys} standby(s) stream from this server ({listed}); commits wait for a \
                 synchronous one (synchronous_standby_names = '{standby_names}', \
                 synchronous_commit = {synchronous_commit}): a failover to it loses no \
                 acknowledged commit"
            ),
            "Nothing to do. Fail over only to a standby pg_stat_replication lists as sync (an \
             async one may lack the last commits), and point clients at the promoted server."
                .to_owned(),
        )
        .details(details))
    }
}
