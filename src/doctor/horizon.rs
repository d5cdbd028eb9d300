//! `Check::XminHorizon`: what holds back VACUUM (old transactions, replication slots,
//! prepared transactions, standbys with feedback) and the transaction-id age.

use super::format::*;
use super::*;

impl Doctor {
    pub(super) async fn check_xmin_horizon(
        &self,
        conn: &mut PgConnection,
    ) -> Result<(Vec<Finding>, bool)> {
        let warn = self.xmin_age_warn.as_secs_f64();
        let crit = self.xmin_age_critical.as_secs_f64();
        let time_severity = |age: f64| {
            if age >= crit {
                Severity::Critical
            } else if age >= warn {
                Severity::Warning
            } else {
                Severity::Ok
            }
        };
        let xid_severity = |age: i64| {
            if age >= self.xid_age_critical {
                Severity::Critical
            } else if age >= self.xid_age_warn {
                Severity::Warning
            } else {
                Severity::Ok
            }
        };
        let mut findings = Vec::new();

        // Sessions of this database holding an xid or a snapshot. Since PostgreSQL 14, only
        // these (and the cluster-wide holders below) hold back vacuum of this database's
        // tables; autovacuum workers never do; walsenders are judged below.
        let rows = sqlx::query(
            "SELECT pid, coalesce(application_name, ''), coalesce(state, ''), \
                    coalesce(usename::text, ''), coalesce(host(client_addr), 'local'), \
                    extract(epoch FROM pg_catalog.clock_timestamp() - xact_start)::float8, \
                    greatest(pg_catalog.age(backend_xid), pg_catalog.age(backend_xmin))::int8, \
                    backend_xid IS NOT NULL \
             FROM pg_catalog.pg_stat_activity \
             WHERE datname = pg_catalog.current_database() AND pid <> pg_catalog.pg_backend_pid() \
               AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL) \
               AND backend_type NOT IN ('autovacuum worker', 'walsender') \
             ORDER BY xact_start NULLS LAST LIMIT 20",
        )
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?;
        let hidden: i64 = sqlx::query_scalar(
            "SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_activity \
             WHERE datname = pg_catalog.current_database() AND query = '<insufficient privilege>'",
        )
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let mut oldest = Value::Null;
        let mut reported = 0;
        for (i, row) in rows.iter().enumerate() {
            let pid: i32 = row.try_get(0)?;
            let app: String = row.try_get(1)?;
            let state: String = row.try_get(2)?;
            let user: String = row.try_get(3)?;
            let client: String = row.try_get(4)?;
            let age: Option<f64> = row.try_get(5)?;
            let xid_age: Option<i64> = row.try_get(6)?;
            let has_xid: bool = row.try_get(7)?;
            let age = age.unwrap_or(0.0);
            let details = json!({
                "pid": pid, "application_name": app, "state": state, "user": user,
                "client": client, "age_seconds": age, "xid_age": xid_age,
                "holds": if has_xid { "xid" } else { "snapshot" },
            });
            if i == 0 {
                oldest = details.clone();
            }
            let severity = time_severity(age);
            if severity == Severity::Ok {
                break; // ordered by age
            }
            reported += 1;
            if reported > 5 {
                continue;
            }
            let doing = if state.starts_with("idle in transaction") {
                format!(
                    "It is {state}: the application opened a transaction and stopped talking \
                     (a missing commit, or a connection returned to a pool mid-transaction). \
                     Commit or roll back in the application \"{app}\". To end it now: \
                     `SELECT pg_terminate_backend({pid});`. To stop it recurring: `ALTER ROLE \
                     {user} SET idle_in_transaction_session_timeout = '{}';`.",
                    postgres_interval(self.xmin_age_warn)
                )
            } else {
                format!(
                    "It is {state}: a long statement, or a session that keeps its \
                     transaction open between statements. See what it runs: `SELECT query, \
                     query_start FROM pg_catalog.pg_stat_activity WHERE pid = {pid};`. Cancel the \
                     statement: `SELECT pg_cancel_backend({pid});`, or end the session: \
                     `SELECT pg_terminate_backend({pid});`. Bound such work with \
                     statement_timeout, or run it on a replica without hot_standby_feedback."
                )
            };
            findings.push(
                Finding::new(
                    severity,
                    Code::LongTransaction,
                    format!(
                        "pid {pid} (application \"{app}\", user {user}, client {client}, \
                         state \"{state}\") has held a transaction open for {} (holding {}; \
                         {} transaction ids assigned since): until it ends, VACUUM cannot \
                         remove rows deleted since it began, so pgbox's outbox, queue and \
                         inbox bloat",
                        human_duration(age),
                        if has_xid { "an xid" } else { "a snapshot" },
                        xid_age.map_or_else(|| "?".into(), group_digits),
                    ),
                    doing,
                )
                .subject(format!("pid {pid}"))
                .details(details),
            );
        }
        if reported > 5 {
            findings.push(
                Finding::new(
                    findings
                        .iter()
                        .map(|f| f.severity)
                        .max()
                        .unwrap_or(Severity::Warning),
                    Code::LongTransaction,
                    format!(
                        "{} more transactions over the threshold (the 5 oldest are listed)",
                        reported - 5
                    ),
                    "Deal with the oldest first: the horizon is the oldest one's.".to_owned(),
                )
                .details(json!({ "more": reported - 5 })),
            );
        }

        // Prepared transactions: they survive restarts and hold their xid until someone
        // commits or rolls them back.
        let prepared = sqlx::query(
            "SELECT gid, owner::text, \
                    extract(epoch FROM pg_catalog.clock_timestamp() - prepared)::float8, \
                    pg_catalog.age(transaction)::int8 \
             FROM pg_catalog.pg_prepared_xacts WHERE database = pg_catalog.current_database() \
             ORDER BY prepared LIMIT 5",
        )
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?;
        let mut prepared_count = 0;
        for row in &prepared {
            let gid: String = row.try_get(0)?;
            let owner: String = row.try_get(1)?;
            let age: f64 = row.try_get(2)?;
            let xid_age: i64 = row.try_get(3)?;
            prepared_count += 1;
            let severity = time_severity(age);
            if severity == Severity::Ok {
                continue;
            }
            let gid_literal = gid.replace('\'', "''");
            findings.push(
                Finding::new(
                    severity,
                    Code::PreparedTransaction,
                    format!(
                        "prepared transaction '{gid}' (owner {owner}) was prepared {} ago \
                         ({} transaction ids): it holds back the xmin horizon until it is \
                         committed or rolled back, across restarts",
                        human_duration(age),
                        group_digits(xid_age)
                    ),
                    format!(
                        "Ask the transaction manager that prepared it whether it committed; \
                         then, as its owner or a superuser, `COMMIT PREPARED '{gid_literal}';` \
                         or `ROLLBACK PREPARED '{gid_literal}';`."
                    ),
                )
                .subject(gid.clone())
                .details(
                    json!({ "gid": gid, "owner": owner, "age_seconds": age, "xid_age": xid_age }),
                ),
            );
        }

        // Replication slots: `xmin` (physical slots with hot_standby_feedback) holds back
        // every database; `catalog_xmin` (logical slots) only catalogs, which matters here
        // when the slot is abandoned.
        let slots = sqlx::query(
            "SELECT slot_name::text, slot_type, active, \
                    pg_catalog.age(xmin)::int8, pg_catalog.age(catalog_xmin)::int8, coalesce(database::text, '') \
             FROM pg_catalog.pg_replication_slots \
             WHERE xmin IS NOT NULL \
                OR (catalog_xmin IS NOT NULL AND NOT active AND database = pg_catalog.current_database()) \
             ORDER BY greatest(pg_catalog.age(xmin), pg_catalog.age(catalog_xmin)) DESC LIMIT 5",
        )
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?;
        for row in &slots {
            let name: String = row.try_get(0)?;
            let kind: String = row.try_get(1)?;
            let active: bool = row.try_get(2)?;
            let xmin_age: Option<i64> = row.try_get(3)?;
            let catalog_age: Option<i64> = row.try_get(4)?;
            let age = xmin_age.or(catalog_age).unwrap_or(0);
            let mut severity = xid_severity(age);
            if !active && severity == Severity::Ok {
                severity = Severity::Warning;
            }
            if severity == Severity::Ok {
                continue;
            }
            let which = if xmin_age.is_some() {
                "xmin (every table of the cluster)"
            } else {
                "catalog_xmin (system catalogs)"
            };
            let name_literal = name.replace('\'', "''");
            findings.push(
                Finding::new(
                    severity,
                    Code::ReplicationSlotXmin,
                    format!(
                        "{} replication slot '{name}' ({}) holds back the {which} horizon by {} \
                         transaction ids",
                        kind,
                        if active { "active" } else { "inactive" },
                        group_digits(age)
                    ),
                    if active {
                        format!(
                            "Its consumer is connected but its xmin is old: a long query on a \
                             standby with hot_standby_feedback = on, or a consumer that does not \
                             confirm progress. Find that query on the standby and end it, or \
                             bound standby queries with statement_timeout; as a last resort \
                             turn hot_standby_feedback off (standby queries may then be \
                             cancelled). Slot: '{name_literal}'."
                        )
                    } else {
                        format!(
                            "Nothing is connected to it, so nothing will advance it (it also \
                             keeps WAL). If its standby or consumer is gone for good, drop it: \
                             `SELECT pg_drop_replication_slot('{name_literal}');`; otherwise \
                             bring the consumer back."
                        )
                    },
                )
                .subject(name.clone())
                .details(json!({
                    "slot": name, "slot_type": kind, "active": active,
                    "xmin_age": xmin_age, "catalog_xmin_age": catalog_age,
                })),
            );
        }

        // Standbys with hot_standby_feedback and no slot: their walsender carries the xmin.
        let walsenders = sqlx::query(
            "SELECT pid, coalesce(application_name, ''), coalesce(host(client_addr), 'local'), \
                    pg_catalog.age(backend_xmin)::int8 \
             FROM pg_catalog.pg_stat_activity \
             WHERE backend_type = 'walsender' AND backend_xmin IS NOT NULL \
             ORDER BY pg_catalog.age(backend_xmin) DESC LIMIT 5",
        )
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?;
        for row in &walsenders {
            let pid: i32 = row.try_get(0)?;
            let app: String = row.try_get(1)?;
            let client: String = row.try_get(2)?;
            let age: i64 = row.try_get(3)?;
            let severity = xid_severity(age);
            if severity == Severity::Ok {
                continue;
            }
            findings.push(
                Finding::new(
                    severity,
                    Code::StandbyFeedbackXmin,
                    format!(
                        "standby \"{app}\" ({client}, walsender pid {pid}) holds back the xmin \
                         horizon by {} transaction ids through hot_standby_feedback",
                        group_digits(age)
                    ),
                    "A long query on that standby holds it. Find and end it there, bound \
                     standby queries with statement_timeout, or turn hot_standby_feedback off \
                     on the standby (its queries may then be cancelled by replay)."
                        .to_owned(),
                )
                .subject(format!("pid {pid}"))
                .details(json!({ "pid": pid, "application_name": app, "client": client, "xid_age": age })),
            );
        }

        let held = !findings.is_empty();
        if !held {
            let mut message = match oldest.get("pid") {
                Some(pid) => format!(
                    "nothing holds back the xmin horizon beyond {}: the oldest transaction of \
                     this database holding an xid or snapshot is pid {pid}, {} old",
                    human_duration(warn),
                    human_duration(oldest["age_seconds"].as_f64().unwrap_or(0.0)),
                ),
                None => "nothing holds back the xmin horizon: no other transaction of this \
                         database holds an xid or snapshot"
                    .to_owned(),
            };
            message.push_str(&format!(
                "; {prepared_count} prepared transaction(s), {} replication slot(s) and {} \
                 standby(s) holding an xmin, all under the thresholds",
                slots.len(),
                walsenders.len()
            ));
            let mut advice = "Nothing to do.".to_owned();
            if hidden > 0 {
                message.push_str(&format!(
                    "; {hidden} session(s) of other roles were hidden from this role"
                ));
                advice = "Grant this role pg_monitor (or pg_read_all_stats) so that the doctor \
                          sees every session's transaction."
                    .to_owned();
            }
            findings.push(
                Finding::new(Severity::Ok, Code::XminHorizonOk, message, advice).details(json!({
                    "oldest_transaction": oldest,
                    "hidden_sessions": hidden,
                })),
            );
        }
        Ok((findings, held))
    }
}
