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
        // A walsender holding a logical slot (a streaming WAL relay, a CDC tool) is no
        // standby: only the others count.
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
             FROM (SELECT 1) one LEFT JOIN pg_catalog.pg_stat_replication r \
               ON NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots l \
                              WHERE l.slot_type = 'logical' AND l.active_pid = r.pid)",
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

/// What a failover slot (PostgreSQL 17+) needs of the servers around it, read once by the WAL
/// slots check: the primary's `synchronized_standby_slots` and its standbys' physical slots,
/// a standby's slot-synchronization settings, and 18's `idle_replication_slot_timeout`.
pub(super) struct FailoverSetup {
    /// `server_version_num / 10000`.
    pub(super) major: i32,
    pub(super) in_recovery: bool,
    pub(super) wal_level: String,
    /// `synchronized_standby_slots` (17+), read as the server reads it (an identifier list:
    /// see [`split_identifier_list`]).
    pub(super) synchronized_standby_slots: Vec<String>,
    pub(super) sync_replication_slots: bool,
    pub(super) hot_standby_feedback: bool,
    pub(super) primary_slot_name: String,
    /// `None` when the role cannot read it (it needs `pg_read_all_settings`).
    pub(super) primary_conninfo: Option<String>,
    /// `idle_replication_slot_timeout` in seconds (18+; 0 is off).
    pub(super) idle_slot_timeout_secs: Option<i64>,
    /// Physical standbys streaming from this server: application name and the physical slot
    /// their walsender holds (logical walsenders, a streaming WAL relay among them, are not
    /// standbys).
    pub(super) standbys: Vec<(String, Option<String>)>,
    /// This server's physical slots: name, active, `wal_status`.
    pub(super) physical_slots: Vec<(String, bool, String)>,
    /// On a standby: whether the slot synchronization worker runs (17+), `None` when this
    /// role cannot see it (`pg_stat_activity` hides background processes' types without
    /// `pg_read_all_stats`).
    pub(super) slotsync_worker: Option<bool>,
}

impl FailoverSetup {
    pub(super) async fn read(conn: &mut PgConnection) -> Result<FailoverSetup> {
        let row = sqlx::query(
            "SELECT pg_catalog.current_setting('server_version_num')::int4 / 10000, \
                    pg_catalog.pg_is_in_recovery(), \
                    pg_catalog.current_setting('wal_level'), \
                    coalesce((SELECT setting FROM pg_catalog.pg_settings \
                              WHERE name = 'synchronized_standby_slots'), ''), \
                    coalesce((SELECT setting FROM pg_catalog.pg_settings \
                              WHERE name = 'sync_replication_slots'), 'off') = 'on', \
                    pg_catalog.current_setting('hot_standby_feedback') = 'on', \
                    coalesce((SELECT setting FROM pg_catalog.pg_settings \
                              WHERE name = 'primary_slot_name'), ''), \
                    (SELECT setting FROM pg_catalog.pg_settings WHERE name = 'primary_conninfo'), \
                    (SELECT CASE unit WHEN 'min' THEN setting::int8 * 60 \
                                      WHEN 'h' THEN setting::int8 * 3600 \
                                      WHEN 'd' THEN setting::int8 * 86400 \
                                      ELSE setting::int8 END \
                     FROM pg_catalog.pg_settings WHERE name = 'idle_replication_slot_timeout')",
        )
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let standbys = sqlx::query(
            "SELECT coalesce(r.application_name, '?'), \
                    (SELECT ps.slot_name::text FROM pg_catalog.pg_replication_slots ps \
                     WHERE ps.slot_type = 'physical' AND ps.active_pid = r.pid) \
             FROM pg_catalog.pg_stat_replication r \
             WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots l \
                               WHERE l.slot_type = 'logical' AND l.active_pid = r.pid) \
             ORDER BY 1",
        )
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<Result<Vec<_>>>()?;
        let physical_slots = sqlx::query(
            "SELECT slot_name::text, active, coalesce(wal_status, 'lost') \
             FROM pg_catalog.pg_replication_slots WHERE slot_type = 'physical' ORDER BY 1",
        )
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
        .collect::<Result<Vec<_>>>()?;
        // Background processes show a backend_type only to pg_read_all_stats (or pg_monitor).
        let worker = sqlx::query(
            "SELECT coalesce(pg_catalog.bool_or(backend_type = 'slotsync worker'), false), \
                    coalesce(pg_catalog.bool_or(backend_type IS NULL), false) \
             FROM pg_catalog.pg_stat_activity",
        )
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let (seen, hidden): (bool, bool) = (worker.try_get(0)?, worker.try_get(1)?);
        let slotsync_worker = match (seen, hidden) {
            (true, _) => Some(true),
            (false, true) => None,
            (false, false) => Some(false),
        };
        let synchronized: String = row.try_get(3)?;
        Ok(FailoverSetup {
            major: row.try_get(0)?,
            in_recovery: row.try_get(1)?,
            wal_level: row.try_get(2)?,
            synchronized_standby_slots: split_identifier_list(&synchronized),
            sync_replication_slots: row.try_get(4)?,
            hot_standby_feedback: row.try_get(5)?,
            primary_slot_name: row.try_get(6)?,
            primary_conninfo: row.try_get(7)?,
            idle_slot_timeout_secs: row.try_get(8)?,
            standbys,
            physical_slots,
            slotsync_worker,
        })
    }

    /// Whether this primary has standbys to fail over to: one streams now, or a physical slot
    /// waits for one.
    pub(super) fn has_standbys(&self) -> bool {
        !self.standbys.is_empty() || !self.physical_slots.is_empty()
    }

    /// On a 17+ primary with failover slots (`failover_slots`): every streaming standby
    /// streams through a physical slot (slot synchronization needs its `primary_slot_name`),
    /// `synchronized_standby_slots` names them, and each slot it names is usable.
    pub(super) fn primary_findings(&self, failover_slots: &[String]) -> Vec<Finding> {
        let mut findings = Vec::new();
        if self.in_recovery || failover_slots.is_empty() {
            return findings;
        }
        let slots = failover_slots.join(", ");
        let named = &self.synchronized_standby_slots;
        if self.has_standbys() {
            self.standby_findings(failover_slots, &mut findings);
        }
        // Checked with or without standbys: a list left from a decommissioned standby, or
        // copied with the configuration to a standby since promoted, stalls the relay all
        // the same.
        for name in named {
            let problem = match self.physical_slots.iter().find(|(n, _, _)| n == name) {
                None => Some("does not exist (or is not a physical slot)".to_owned()),
                Some((_, _, wal_status)) if wal_status == "lost" => {
                    Some("was invalidated".to_owned())
                }
                Some((_, false, _)) => Some("is not active: its standby is not streaming".into()),
                Some(_) => None,
            };
            if let Some(problem) = problem {
                findings.push(
                    Finding::new(
                        Severity::Critical,
                        Code::SynchronizedStandbySlotUnusable,
                        format!(
                            "slot {name}, named in synchronized_standby_slots, {problem}: \
                             reads of the failover slot(s) {slots} wait until it confirms the \
                             WAL, so the WAL relay publishes nothing meanwhile"
                        ),
                        format!(
                            "Bring its standby back (streaming through primary_slot_name = \
                             '{name}'), or, if that standby is gone, remove {name} from \
                             synchronized_standby_slots (ALTER SYSTEM SET ...; SELECT \
                             pg_reload_conf()) and drop its slot \
                             (pg_drop_replication_slot('{name}'))."
                        ),
                    )
                    .subject(name.clone())
                    .details(json!({ "slot": name, "problem": problem })),
                );
            }
        }
        findings
    }

    /// [`primary_findings`](Self::primary_findings) about the standbys: each streams through
    /// a physical slot, and `synchronized_standby_slots` names them.
    fn standby_findings(&self, failover_slots: &[String], findings: &mut Vec<Finding>) {
        let slots = failover_slots.join(", ");
        let named = &self.synchronized_standby_slots;
        for (standby, slot) in &self.standbys {
            if slot.is_none() {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::StandbyWithoutSlot,
                        format!(
                            "standby {standby} streams from this server without a physical \
                             replication slot: it cannot synchronize the failover slot(s) \
                             {slots} (slot synchronization needs the standby's \
                             primary_slot_name), so promoted, it has no copy of them"
                        ),
                        format!(
                            "On this primary: SELECT pg_create_physical_replication_slot('<name>'); \
                             on standby {standby}: ALTER SYSTEM SET primary_slot_name = '<name>'; \
                             SELECT pg_reload_conf(); then name the slot in this primary's \
                             synchronized_standby_slots."
                        ),
                    )
                    .subject(standby.clone())
                    .details(json!({ "standby": standby, "failover_slots": failover_slots })),
                );
            }
        }
        let standby_slots: Vec<&String> = self
            .standbys
            .iter()
            .filter_map(|(_, s)| s.as_ref())
            .collect();
        let unnamed: Vec<&String> = standby_slots
            .iter()
            .copied()
            .filter(|s| !named.contains(s))
            .collect();
        if named.is_empty() || !unnamed.is_empty() {
            let what = if named.is_empty() {
                "synchronized_standby_slots is empty".to_owned()
            } else {
                format!(
                    "synchronized_standby_slots ('{}') does not name the physical slot(s) {} \
                     of streaming standbys",
                    named.join(", "),
                    unnamed
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            let all: Vec<&str> = named
                .iter()
                .map(|s| s.as_str())
                .chain(unnamed.iter().map(|s| s.as_str()))
                .collect();
            let list = if all.is_empty() {
                "<each standby's physical slot>".to_owned()
            } else {
                all.join(", ")
            };
            findings.push(
                Finding::new(
                    Severity::Warning,
                    Code::FailoverSlotUnguarded,
                    format!(
                        "failover slot(s) {slots}: {what}. The WAL relay may then read and \
                         publish transactions a standby has not received yet; after a failover \
                         to that standby, messages were published whose commits it does not \
                         have (PostgreSQL decodes a commit once it is flushed here, even while \
                         it waits for a synchronous standby)"
                    ),
                    format!(
                        "ALTER SYSTEM SET synchronized_standby_slots = '{list}'; SELECT \
                         pg_reload_conf(); on this primary. Decoding of failover slots then \
                         waits until those standbys have flushed the WAL (a little latency \
                         for the relay); a named standby that is down stops the relay until \
                         it is back or is removed from the list."
                    ),
                )
                .details(json!({
                    "failover_slots": failover_slots,
                    "synchronized_standby_slots": named,
                    "standby_slots_not_named": unnamed,
                })),
            );
        }
    }

    /// On a 17+ standby: the settings slot synchronization needs, each one missing named.
    pub(super) fn standby_settings_finding(&self) -> Option<Finding> {
        if !self.in_recovery || self.major < crate::WalSlot::FAILOVER_SLOTS_SINCE {
            return None;
        }
        let mut missing = Vec::new();
        let mut fixes = Vec::new();
        if !self.sync_replication_slots {
            missing.push("sync_replication_slots is off".to_owned());
            fixes.push("ALTER SYSTEM SET sync_replication_slots = on;".to_owned());
        }
        if !self.hot_standby_feedback {
            missing.push(
                "hot_standby_feedback is off (the primary may remove catalog rows a \
                 synchronized slot needs: it is invalidated, rows_removed)"
                    .to_owned(),
            );
            fixes.push("ALTER SYSTEM SET hot_standby_feedback = on;".to_owned());
        }
        if self.primary_slot_name.is_empty() {
            missing.push("primary_slot_name is not set (a physical slot on the primary)".into());
            fixes.push(
                "SELECT pg_create_physical_replication_slot('<name>') on the primary, then \
                 ALTER SYSTEM SET primary_slot_name = '<name>'; here"
                    .to_owned(),
            );
        }
        match &self.primary_conninfo {
            Some(conninfo) if !conninfo_has_dbname(conninfo) => {
                missing.push("primary_conninfo names no dbname".to_owned());
                fixes.push(
                    "add dbname=<any database of the primary> to primary_conninfo;".to_owned(),
                );
            }
            _ => {}
        }
        if self.wal_level != "logical" {
            missing.push(format!("wal_level is {} here, not logical", self.wal_level));
            fixes.push("ALTER SYSTEM SET wal_level = logical; (a restart)".to_owned());
        }
        if missing.is_empty() && self.slotsync_worker == Some(false) {
            missing.push(
                "the slot synchronization worker is not running (it stops when a setting it \
                 needs is wrong or the primary is unreachable; this server's log says why)"
                    .to_owned(),
            );
            fixes.push("fix what this server's log names (slot sync worker);".to_owned());
        }
        // What this role cannot see keeps the doctor from saying synchronization works.
        let mut unreadable = Vec::new();
        if self.primary_conninfo.is_none() {
            unreadable.push(
                "primary_conninfo (whether it names a dbname; reading it needs \
                 pg_read_all_settings)",
            );
        }
        if self.slotsync_worker.is_none() {
            unreadable.push(
                "whether the slot synchronization worker runs (pg_stat_activity shows it to \
                 pg_read_all_stats)",
            );
        }
        if missing.is_empty() && unreadable.is_empty() {
            return None;
        }
        let unknown = if unreadable.is_empty() {
            String::new()
        } else {
            format!(
                "; this role could not check {} (run the doctor as a role with pg_monitor, or \
                 check them by hand)",
                unreadable.join(", ")
            )
        };
        let (message, advice) = if missing.is_empty() {
            (
                format!(
                    "the doctor cannot tell whether this standby synchronizes failover slots: \
                     its settings it could read are in place{unknown}. Until that is known, a \
                     promotion may find no current copy of the primary's WAL outbox slot"
                ),
                "Grant the doctor's role pg_monitor (pg_read_all_settings and \
                 pg_read_all_stats), or check by hand that primary_conninfo names a dbname and \
                 that pg_stat_activity lists a slotsync worker."
                    .to_owned(),
            )
        } else {
            (
                format!(
                    "this standby does not synchronize failover slots: {}{unknown}. Promoted, \
                     it has no current copy of the primary's WAL outbox slot, and what \
                     producers emitted after the copy's position is lost or published again",
                    missing.join("; ")
                ),
                format!(
                    "On this standby: {} SELECT pg_reload_conf(); and on the primary name this \
                     standby's physical slot in synchronized_standby_slots.",
                    fixes.join(" ")
                ),
            )
        };
        Some(
            Finding::new(
                Severity::Warning,
                Code::SlotSyncNotConfigured,
                message,
                advice,
            )
            .details(json!({
                "missing": missing,
                "sync_replication_slots": self.sync_replication_slots,
                "hot_standby_feedback": self.hot_standby_feedback,
                "primary_slot_name": self.primary_slot_name,
                "primary_conninfo_has_dbname": self.primary_conninfo.as_deref().map(conninfo_has_dbname),
                "wal_level": self.wal_level,
                "slotsync_worker_running": self.slotsync_worker,
                "unreadable": unreadable,
            })),
        )
    }
}

/// Whether a libpq connection string (`key=value …` or a URI) names a database.
pub(super) fn conninfo_has_dbname(conninfo: &str) -> bool {
    let c = conninfo.trim();
    if let Some(rest) = c
        .strip_prefix("postgresql://")
        .or_else(|| c.strip_prefix("postgres://"))
    {
        let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
        let path_db = before_query
            .split_once('/')
            .is_some_and(|(_, db)| !db.is_empty());
        let query_db = query
            .split('&')
            .any(|kv| kv.strip_prefix("dbname=").is_some_and(|v| !v.is_empty()));
        return path_db || query_db;
    }
    // key = value pairs; spaces may surround '='.
    let normalized = c.replace(" =", "=").replace("= ", "=");
    normalized.split_whitespace().any(|kv| {
        kv.strip_prefix("dbname=")
            .is_some_and(|v| !v.is_empty() && v != "''")
    })
}

/// `synchronized_standby_slots` as the server splits it (`SplitIdentifierString`): names
/// separated by commas, whitespace around them ignored, an unquoted name folded to lower
/// case, a double-quoted one kept as written (`""` is a quote). PostgreSQL 17 has no `*` for
/// this setting (every entry is a slot name). An unparsable list yields what parsed before.
pub(super) fn split_identifier_list(list: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut chars = list.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let Some(&first) = chars.peek() else { break };
        let mut name = String::new();
        if first == '"' {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        name.push('"');
                    }
                    Some('"') => break,
                    Some(c) => name.push(c),
                    None => return names,
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| *c != ',' && !c.is_whitespace()) {
                name.extend(c.to_lowercase());
            }
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if !name.is_empty() {
            names.push(name);
        }
        match chars.next() {
            Some(',') => continue,
            _ => break,
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::split_identifier_list;

    #[test]
    fn synchronized_standby_slots_is_read_as_an_identifier_list() {
        assert_eq!(split_identifier_list("STANDBY1"), vec!["standby1"]);
        assert_eq!(
            split_identifier_list(" a ,\"B\", \"c\"\"d\" "),
            vec!["a", "B", "c\"d"]
        );
        assert!(split_identifier_list("").is_empty());
        assert!(split_identifier_list("  ").is_empty());
    }
}
