//! `Check::WalSlots`: the logical replication slots of this database, which the WAL outbox
//! reads. A slot whose relay is down keeps every WAL segment from its restart position: the
//! disk fills, or, with `max_slot_wal_keep_size`, the server invalidates the slot and the
//! messages in the WAL it dropped are lost.

use super::format::*;
use super::*;

impl Doctor {
    pub(super) async fn check_wal_slots(&self, pool: &PgPool) -> Result<Vec<Finding>> {
        let mut tx = crate::pooler::begin(pool, None).await?;
        let rows = sqlx::query(
            "SELECT s.slot_name::text, s.plugin::text, s.active, \
                    coalesce(pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.restart_lsn), 0)::int8, \
                    coalesce(s.wal_status, 'lost'), \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = s.slot_name) \
             FROM pg_catalog.pg_replication_slots s \
             WHERE s.slot_type = 'logical' AND s.database = pg_catalog.current_database() \
             ORDER BY 1",
        )
        .persistent(false)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut findings = Vec::new();
        let mut fine = Vec::new();
        for row in rows {
            let name: String = row.try_get(0)?;
            let plugin: String = row.try_get(1)?;
            let active: bool = row.try_get(2)?;
            let retained: i64 = row.try_get(3)?;
            let wal_status: String = row.try_get(4)?;
            let has_publication: bool = row.try_get(5)?;
            // The oldest unpublished commit, read only from a slot nobody reads now (a peek
            // takes the slot for its duration): that is when it matters.
            let oldest_age =
                if !active && plugin == "pgoutput" && has_publication && wal_status != "lost" {
                    oldest_commit_age(pool, &name).await.ok().flatten()
                } else {
                    None
                };
            let details = json!({
                "slot": name, "plugin": plugin, "active": active,
                "retained_bytes": retained, "wal_status": wal_status,
                "oldest_unpublished_commit_age_seconds": oldest_age,
            });
            let state = if active {
                "read by a session"
            } else {
                "not read by anyone"
            };
            let age = oldest_age
                .map(|a| format!(", oldest unpublished commit {} old", human_duration(a)))
                .unwrap_or_default();
            if wal_status == "lost" {
                findings.push(
                    Finding::new(
                        Severity::Critical,
                        Code::WalSlotInvalidated,
                        format!(
                            "logical slot {name} was invalidated (wal_status lost): the WAL it \
                             needed was removed, and the WAL outbox messages in it are lost"
                        ),
                        format!(
                            "Drop and create it (`pgbox wal drop-slot --slot {name}`, then \
                             `create-slot`), and reconcile what producers committed since the \
                             relay last published (their business rows are there; the messages \
                             are not). Keep relays running, or raise max_slot_wal_keep_size."
                        ),
                    )
                    .subject(name.clone())
                    .details(details),
                );
            } else if retained >= self.wal_slot_retained_warn
                || oldest_age.is_some_and(|a| a >= self.xmin_age_warn.as_secs_f64())
            {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::WalSlotBehind,
                        format!(
                            "logical slot {name} ({state}) retains {} of WAL{age} \
                             (wal_status {wal_status})",
                            human_bytes(retained)
                        ),
                        format!(
                            "Start (or fix) the WAL relay reading {name}: until it reads, the \
                             WAL is kept and the disk fills. A slot nobody will read again must \
                             be dropped (`pgbox wal drop-slot --slot {name}`). \
                             max_slot_wal_keep_size bounds what a slot keeps; past it the slot \
                             is invalidated and its messages are lost."
                        ),
                    )
                    .subject(name.clone())
                    .details(details),
                );
            } else {
                fine.push(format!("{name} ({}{age})", human_bytes(retained)));
            }
        }
        if findings.is_empty() {
            let message = if fine.is_empty() {
                "no logical replication slot in this database (the WAL outbox is not in use)"
                    .to_owned()
            } else {
                format!("logical slots within thresholds: {}", fine.join(", "))
            };
            findings.push(Finding::new(
                Severity::Ok,
                Code::WalSlotsOk,
                message,
                format!(
                    "Nothing to do. The doctor warns when a slot retains {} of WAL or more.",
                    human_bytes(self.wal_slot_retained_warn)
                ),
            ));
        }
        Ok(findings)
    }
}

/// Seconds since the commit of the first transaction `slot` holds, `None` if it holds none.
async fn oldest_commit_age(pool: &PgPool, slot: &str) -> Result<Option<f64>> {
    let mut conn = pool.acquire().await?;
    let row = sqlx::query(
        "SELECT data FROM pg_catalog.pg_logical_slot_peek_binary_changes($1, NULL, 1, \
           'proto_version', '1', 'publication_names', $1, 'messages', 'true') LIMIT 1",
    )
    .persistent(false)
    .bind(slot)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let data: Vec<u8> = row.try_get(0)?;
    Ok(crate::relay::wal::begin_commit_time(&data).map(|commit| {
        (OffsetDateTime::now_utc() - commit)
            .as_seconds_f64()
            .max(0.0)
    }))
}
